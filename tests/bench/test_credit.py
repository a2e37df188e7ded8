"""Smoke test of the credit benchmark: ``python -m benchmarks credit --quick`` runs end to end
(a 16-trace, 3k-token workload written by verifiers, one repeat), tracedb's stamped ``grpo``
and ``gae`` sets equal the Python peer's, and ``results-credit.json`` reports every figure.
Also: the correctness check has teeth, and the core suite stays the default."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

METRICS = {"grpo_stamp", "grpo_compute", "gae_stamp", "gae_compute", "grpo_floor"}
TARGETS = {"grpo_stamp": ">= 5x", "gae_stamp": ">= 3x", "grpo_floor": "<= 3x"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m benchmarks credit --quick`` in this process."""
    from benchmarks.__main__ import main

    tmp = tmp_path_factory.mktemp("bench-credit")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["credit", "--quick", "--workdir", str(tmp / "work"), "--results", str(tmp / "results.json")])
    assert code == 0, out.getvalue() + err.getvalue()
    return tmp, out.getvalue()


def test_quick_credit_benchmark_completes_and_is_correct(quick_run: tuple[Path, str]) -> None:
    tmp, table = quick_run
    data = json.loads((tmp / "results.json").read_text())

    correctness = data["correctness"]
    assert correctness["passed"] is True
    for algorithm in ("grpo", "gae"):
        assert correctness[algorithm]["nodes"] > data["workload"]["traces"]
        assert correctness[algorithm]["branches"] > data["workload"]["traces"]  # compaction forks
        assert correctness[algorithm]["compute_rows"] > 0
    assert data["repeat"] == 1
    assert data["sampled_tokens"] == data["workload"]["sampled_tokens"] > 0
    assert set(data["metrics"]) == METRICS
    for key, metric in data["metrics"].items():
        assert len(metric["peer"]["samples"]) == len(metric["tracedb"]["samples"]) == 1, key
        assert metric["peer"]["median"] > 0 and metric["tracedb"]["median"] > 0, key
        assert metric["ratio"] > 0, key
        assert metric["notes"]["peer_s_per_M_sampled"] > 0 and metric["notes"]["tracedb_s_per_M_sampled"] > 0
        assert (metric["passed"] is not None) == (key in TARGETS), key
        assert metric["target"] == TARGETS.get(key, "info"), key
    floor = data["metrics"]["grpo_floor"]
    assert floor["tracedb"]["samples"] == data["metrics"]["grpo_stamp"]["tracedb"]["samples"]
    assert floor["ratio"] == pytest.approx(floor["tracedb"]["median"] / floor["peer"]["median"])
    assert data["floor"]["set_created_and_committed"]["median"] == floor["peer"]["median"]
    assert data["floor"]["empty_commit_seconds"]["median"] > 0
    for algorithm in ("grpo", "gae"):
        profile = data["profile"][algorithm]
        assert profile["statements"] and any(s["statement"] == "COMMIT" for s in profile["statements"])
    assert data["machine"]["cpu_count"] and "load_average_before" in data["other_load"]

    for label in ("grpo: stamp", "gae: stamp", "compute only", "s/M sampled", "PASSED", "the floor", "vs floor"):
        assert label in table
    assert "PASS" in table or "MISS" in table


def test_correctness_check_catches_wrong_credit(quick_run: tuple[Path, str]) -> None:
    import tracedb
    from benchmarks.credit import compare_nodes, peer_gae, peer_grpo, peer_nodes, stamped_nodes, verify_branches
    from benchmarks.harness import CorrectnessError, peer_read

    tmp, _ = quick_run
    episodes = peer_read(next((tmp / "work").glob("workload-*")))
    with tracedb.connect(tmp / "work" / "credit" / "tracedb.duckdb", read_only=True) as db:
        peer_grpo(episodes)
        grpo = stamped_nodes(db, "bench-grpo")
        assert compare_nodes("grpo", grpo, "advantages", peer_nodes(episodes)) == grpo.num_rows
        peer_gae(episodes)
        gae = stamped_nodes(db, "bench-gae")
        assert compare_nodes("gae", gae, "advantages", peer_nodes(episodes)) == gae.num_rows
        assert verify_branches(db, "bench-gae", episodes) > 0

        # The two algorithms' credit is not interchangeable.
        with pytest.raises(CorrectnessError, match="differs"):
            compare_nodes("gae", grpo, "advantages", peer_nodes(episodes))

        # One node's advantage off by 1e-4: refused, node by node and in the branch view.
        node = next(n for n in episodes[0].traces[0].nodes if n.advantages)
        node.advantages = [node.advantages[0] + 1e-4] * len(node.advantages)
        with pytest.raises(CorrectnessError, match="differs"):
            compare_nodes("gae", gae, "advantages", peer_nodes(episodes))
        with pytest.raises(CorrectnessError, match="branch advantages differ"):
            verify_branches(db, "bench-gae", episodes)

        # A node the peer leaves unassigned: refused.
        node.advantages = None
        with pytest.raises(CorrectnessError, match="assigned by tracedb, not by the peer"):
            compare_nodes("gae", gae, "advantages", peer_nodes(episodes))


def test_core_suite_stays_the_default() -> None:
    from benchmarks import core, credit
    from benchmarks.__main__ import parse_args

    default = parse_args([])
    assert default.suite == "core" and default.results == core.RESULTS and default.repeat == 5
    for argv in (["credit"], ["--suite", "credit"]):
        args = parse_args(argv)
        assert args.suite == "credit" and args.results == credit.RESULTS and args.repeat == credit.FULL["repeat"]
    quick = parse_args(["credit", "--quick", "--repeat", "2"])
    assert (quick.traces, quick.tokens, quick.repeat) == (16, 3_000, 2)
