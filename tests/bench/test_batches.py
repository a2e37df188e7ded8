"""Smoke test of the trainer-feed benchmark: ``python -m benchmarks batches --quick`` runs end to
end (a 16-trace, 3k-token workload written by verifiers, one repeat; ``--seq-len 2048`` so that
bins hold several samples), tracedb's micro-batches equal the Python peer's sample by sample, and
``results-batches.json`` reports every figure. Also: the check has teeth (a broken plan is
refused), it holds on the golden fixtures (train-once on shared sampled nodes, never-scored
branches skipped, truncation inside nodes), and the suite is registered beside the others."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from support import FIXTURES

pytest.importorskip("verifiers.v1")

METRICS = {"from_file", "warm", "shared"}
SEQ_LEN, RANKS = 2048, 8  # bins of 2 samples (sharing the system prompt); 8 ranks need padding bins


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m benchmarks batches --quick --seq-len 2048`` in this process."""
    from benchmarks.__main__ import main

    tmp = tmp_path_factory.mktemp("bench-batches")
    out, err = io.StringIO(), io.StringIO()
    argv = ["batches", "--quick", "--seq-len", str(SEQ_LEN), "--workdir", str(tmp / "work")]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--results", str(tmp / "results.json")])
    assert code == 0, out.getvalue() + err.getvalue()
    return tmp, out.getvalue()


def test_quick_batches_benchmark_completes_and_is_correct(quick_run: tuple[Path, str]) -> None:
    tmp, table = quick_run
    data = json.loads((tmp / "results.json").read_text())

    correctness = data["correctness"]
    assert correctness["passed"] is True and correctness["tracedb_plans_checked"] >= 4
    plan, shared = correctness["plan"], correctness["shared_plan"]
    assert plan["samples"] == shared["samples"] == data["step"]["samples"] > data["workload"]["traces"]
    assert plan["loss_tokens"] > 0 and plan["padding_micro_batches"] > 0
    assert plan["micro_batches"] == data["step"]["micro_batches"] and plan["micro_batches"] % RANKS == 0
    assert data["call"] == {"seq_len": SEQ_LEN, "ranks": RANKS} and data["repeat"] == 1

    assert set(data["metrics"]) == METRICS
    for key, metric in data["metrics"].items():
        assert len(metric["tracedb"]["samples"]) == 1 and metric["tracedb"]["median"] > 0, key
        assert metric["notes"]["tracedb_M_tokens_per_s"] > 0, key
        if key != "shared":
            assert len(metric["peer"]["samples"]) == 1 and metric["peer"]["median"] > 0, key
            assert metric["ratio"] > 0, key
        assert (metric["passed"] is not None) == (key == "from_file"), key
        assert metric["target"] == (">= 20x" if key == "from_file" else "info"), key
    notes = data["metrics"]["shared"]["notes"]
    assert 0 < notes["physical_over_logical"] < 1  # the system prompt is stored once per bin
    assert notes["physical_tokens"] == data["shared_step"]["physical_tokens"]
    assert set(data["peer_stages"]) == {"read_episodes", "samples", "packing", "bin_arrays", "ranks"}

    memory = data["memory"]
    assert memory["step_bytes"] == data["step"]["logical_tokens"] * 13 > 0
    assert memory["first_call_peak_growth"] > 0 and len(memory["later_calls_peak_growth"]) == 2
    stages = {row["stage"] for row in data["profile"]}
    assert {"open (connect)", "load_nodes (DuckDB reads + decode)", "samples.build", "build_plan", "total"} <= stages
    assert data["machine"]["cpu_count"] and "load_average_before" in data["other_load"]

    for label in ("step from the file", "warm", "share_prefixes", "memory", "prefix sharing", "profile", "PASSED"):
        assert label in table
    assert "PASS" in table or "MISS" in table


def _replace(
    plan: Any, rank: int, k: int, tokens: pa.RecordBatch | None = None, samples: pa.Table | None = None
) -> Any:
    """A copy of ``plan`` with one micro-batch's tokens or samples replaced."""
    from tracedb.batches import MicroBatch, Plan

    ranks = [list(r) for r in plan]
    mb = ranks[rank][k]
    ranks[rank][k] = MicroBatch(mb.tokens if tokens is None else tokens, mb.samples if samples is None else samples)
    return Plan(ranks, plan.report, plan.arguments)


def _with_column(batch: pa.RecordBatch, name: str, values: np.ndarray) -> pa.RecordBatch:
    return batch.set_column(batch.schema.get_field_index(name), name, pa.array(values))


def test_correctness_check_catches_a_broken_plan(quick_run: tuple[Path, str]) -> None:
    from benchmarks.batches_check import verify
    from benchmarks.batches_step import tracedb_from_file
    from benchmarks.harness import CorrectnessError
    from benchmarks.reference_packer import peer_read_pack
    from tracedb.batches import Plan

    tmp, _ = quick_run
    db_path = tmp / "work" / "batches" / "tracedb.duckdb"
    peer = peer_read_pack(next((tmp / "work").glob("workload-*")), SEQ_LEN, RANKS)
    plan = tracedb_from_file(db_path, SEQ_LEN, RANKS)
    assert verify(plan, peer, SEQ_LEN, RANKS)["samples"] == len(peer.samples)

    # The first real micro-batch and a sampled token in it.
    rank, k = next((r, k) for r, mbs in enumerate(plan) for k, mb in enumerate(mbs) if mb.samples.num_rows)
    mb = plan[rank][k]
    cols = {name: mb.tokens.column(name).to_numpy(zero_copy_only=False).copy() for name in mb.tokens.schema.names}
    t = int(np.flatnonzero(cols["loss_mask"])[0])

    loss = cols["loss_mask"].copy()
    loss[t] = False
    with pytest.raises(CorrectnessError, match="loss_mask differs"):
        verify(_replace(plan, rank, k, tokens=_with_column(mb.tokens, "loss_mask", loss)), peer, SEQ_LEN, RANKS)

    advantages = cols["advantages"].copy()
    advantages[t] += 1e-3
    broken = _replace(plan, rank, k, tokens=_with_column(mb.tokens, "advantages", advantages))
    with pytest.raises(CorrectnessError, match="advantages differs"):
        verify(broken, peer, SEQ_LEN, RANKS)

    ids = cols["input_ids"].copy()
    ids[t] += 1
    with pytest.raises(CorrectnessError, match="input_ids differs"):
        verify(_replace(plan, rank, k, tokens=_with_column(mb.tokens, "input_ids", ids)), peer, SEQ_LEN, RANKS)

    # A sample left out of its micro-batch: refused (missing, and its tokens belong to nobody).
    with pytest.raises(CorrectnessError, match="missing from tracedb's"):
        verify(_replace(plan, rank, k, samples=mb.samples.slice(1)), peer, SEQ_LEN, RANKS)

    # A micro-batch moved to another rank: refused.
    ranks = [list(r) for r in plan]
    ranks[(rank + 1) % RANKS].append(ranks[rank].pop(k))
    with pytest.raises(CorrectnessError, match="micro-batches per rank"):
        verify(Plan(ranks, plan.report, plan.arguments), peer, SEQ_LEN, RANKS)


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Every golden fixture in one verifiers results directory, and its database."""
    import tracedb
    from benchmarks.workload import TRACES_FILE

    tmp = tmp_path_factory.mktemp("bench-batches-fixtures")
    with (tmp / TRACES_FILE).open("wb") as out:
        for path in sorted(FIXTURES.glob("*.traces.jsonl")):
            out.write(path.read_bytes())
    db_path = tmp / "fixtures.duckdb"
    with tracedb.connect(db_path) as db:
        assert db.ingest(tmp / TRACES_FILE).ok
    return tmp, db_path


@pytest.mark.parametrize("seq_len", [7, 64, 1000, 32_768])
def test_check_holds_on_the_fixtures(fixture_run: tuple[Path, Path], seq_len: int) -> None:
    """Shared sampled nodes (train-once), never-scored branches, truncation inside nodes and
    prefix sharing: the peer and tracedb agree on the fixtures; a peer without the train-once
    rule does not."""
    import tracedb
    from benchmarks.batches_check import verify
    from benchmarks.harness import CorrectnessError, peer_read
    from benchmarks.reference_packer import peer_pack

    results_dir, db_path = fixture_run
    episodes = peer_read(results_dir)
    peer = peer_pack(episodes, seq_len, 3)
    assert peer.skipped_never_scored > 0
    with tracedb.connect(db_path, read_only=True) as db:
        plan = db.micro_batches(seq_len, ranks=3)
        shared = db.micro_batches(seq_len, ranks=3, share_prefixes=True)
    checked = verify(plan, peer, seq_len, 3)
    assert checked["samples"] == len(peer.samples) and verify(shared, peer, seq_len, 3, shared=True)
    if seq_len < 1000:
        assert checked["truncated"] > 0
    if seq_len >= 64:
        assert peer.shared_sampled_tokens > 0  # the train-once rule took tokens out of the loss
        with pytest.raises(CorrectnessError, match="loss_mask differs"):
            verify(plan, peer_pack(episodes, seq_len, 3, train_once=False), seq_len, 3)


def test_step_from_file_refuses_a_file_still_open(fixture_run: tuple[Path, Path]) -> None:
    import tracedb
    from benchmarks.batches_step import tracedb_from_file

    _, db_path = fixture_run
    with tracedb.connect(db_path, read_only=True):
        with pytest.raises(RuntimeError, match="still open"):
            tracedb_from_file(db_path, 64, 3)
    assert tracedb_from_file(db_path, 64, 3).report.samples > 0


def test_batches_suite_is_registered() -> None:
    from benchmarks import batches, core
    from benchmarks.__main__ import parse_args

    default = parse_args([])
    assert default.suite == "core" and default.results == core.RESULTS and default.repeat == 5
    for argv in (["batches"], ["--suite", "batches"]):
        args = parse_args(argv)
        assert args.suite == "batches" and args.results == batches.RESULTS
        assert (args.repeat, args.seq_len, args.ranks) == (batches.FULL["repeat"], 32_768, 8)
    quick = parse_args(["batches", "--quick", "--ranks", "2"])
    assert (quick.traces, quick.tokens, quick.repeat, quick.ranks) == (16, 3_000, 1, 2)
