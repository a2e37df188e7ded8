"""Smoke test of the live benchmark: ``python -m benchmarks live --quick`` runs end to end (a
24-trace, 3k-token workload written by verifiers, appended at a fixed rate and then as fast as
the writer can, followed by ``tracedb serve --follow`` while 8 REST readers fetch every branch;
then a 32-trace soak), every client listed every trace once, the readers' branches equal the
database's, and ``results-live.json`` reports every figure. Also: the check has teeth (a wrong
branch, a trace never listed, one listed twice are refused), and the writer's chunks add up to
the source file."""

from __future__ import annotations

import contextlib
import io
import json
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m benchmarks live --quick`` in this process (the server and the writer are
    subprocesses)."""
    from benchmarks.__main__ import main

    tmp = tmp_path_factory.mktemp("bench-live")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["live", "--quick", "--workdir", str(tmp / "work"), "--results", str(tmp / "results.json")])
    assert code == 0, out.getvalue() + err.getvalue()
    return tmp, out.getvalue()


def test_quick_live_benchmark_completes_and_is_exact(quick_run: tuple[Path, str]) -> None:
    tmp, table = quick_run
    data = json.loads((tmp / "results.json").read_text())
    setup = data["setup"]
    assert setup["readers"] == 8 and setup["rate_traces"] == 12 and setup["format"] == "arrow"

    live, soak = data["live"], data["soak"]
    assert live["correctness"] == {
        "passed": True,
        "traces": 24,
        "clients": 9,
        "branches": live["correctness"]["branches"],
        "reader_branches_checked": 8 * live["correctness"]["branches"],
    }
    assert live["correctness"]["branches"] > 24  # compaction forks: several branches a trace
    assert soak["correctness"]["passed"] and soak["correctness"]["traces"] == 32
    assert soak["correctness"]["clients"] == 1 and "delivered" not in soak

    for phase, traces in (("rate", 12), ("fast", 12)):
        assert live["visibility"][phase]["n"] == traces
        assert 0 < live["visibility"][phase]["p50_ms"] <= live["visibility"][phase]["p99_ms"]
        assert live["delivered"][phase]["n"] == 8 * traces  # every reader, every trace
    assert live["until_ingest_began"]["rate"]["n"] == 12
    rate, fast = live["ingest"]["rate_phase"], live["ingest"]["fast_phase"]
    assert rate["traces"] == 12 and rate["MB_per_s_offered"] > 0
    assert fast["traces"] == 12 and fast["traces_per_s"] > 0 and fast["MB_per_s"] > 0
    assert fast["health_samples"] >= 0 and fast["max_backlog_MB"] >= 0
    assert soak["ingest"]["rate_phase"]["traces"] == 12 and soak["ingest"]["fast_phase"]["traces"] == 20
    assert soak["visibility"]["rate"]["n"] == 12

    requests = live["requests"]
    assert requests["branch_fetch"]["n"] == live["correctness"]["reader_branches_checked"]
    assert requests["branch_fetch"]["p99_ms"] > 0 and requests["total"] > requests["branch_fetch"]["n"]
    for run in (live, soak):
        assert run["errors"]["total"] == 0 and run["errors"]["follower_rejected"] == 0
        memory = run["memory"]
        assert memory["samples"] == len(memory["series"]) >= 2
        assert memory["peak_MB"] >= memory["rss_idle_MB"] > 0
        assert memory["series"][-1]["GB"] == round(run["workload"]["bytes"] / 1e9, 4)  # all ingested
        assert memory["slope_MB_per_GB"] is memory["slope_tail_MB_per_GB"] is None  # a few MB: no slope fitted
        assert memory["slope_stderr"] is None
    targets = data["targets"]
    assert set(targets) == {"visibility_p99_at_rate", "errors", "soak_rss_tail_slope"}
    assert targets["errors"]["passed"] is True and targets["soak_rss_tail_slope"]["passed"] is None
    assert data["machine"]["cpu_count"] and "load_average_before" in data["other_load"]
    for label in ("rate phase", "fast phase", "visibility", "delivered", "server RSS", "soak", "PASSED"):
        assert label in table


def test_the_writer_appends_exactly_the_source(quick_run: tuple[Path, str]) -> None:
    """The rate phase's file and the fast phase's (which appeared in a subdirectory) are the
    source file cut in two, whatever the chunks were."""
    tmp, _ = quick_run
    source = next((tmp / "work").glob("workload-24x3000-*")) / "traces.jsonl"
    run = tmp / "work" / "live" / "run"
    first, second = (run / "traces.jsonl").read_bytes(), (run / "fast" / "traces.jsonl").read_bytes()
    assert first + second == source.read_bytes()
    assert first.count(b"\n") == 12 and first.endswith(b"\n")


def _readers_as_the_database_says(db_path: Path, fmt: str = "arrow") -> tuple[list[str], dict[str, Any]]:
    import tracedb
    from benchmarks.live_parts import COLUMNS, Reader, Seen, Watcher, table_digests

    with tracedb.connect(db_path, read_only=True) as db:
        ids = [r[0] for r in db.handle.con.execute("SELECT trace_id FROM traces ORDER BY seq").fetchall()]
        truth = table_digests(db.branches(trace_ids=ids, columns=COLUMNS))
    stop = threading.Event()
    watcher = Watcher("watcher", "http://127.0.0.1:9", len(ids), stop)
    reader = Reader("reader-0", "http://127.0.0.1:9", len(ids), stop, fmt)
    for seq, trace_id in enumerate(ids, 1):
        branches = {i: d for (t, i), d in truth.items() if t == trace_id}
        watcher.log.seen[trace_id] = Seen(0.0, seq, len(branches))
        reader.log.seen[trace_id] = Seen(0.0, seq, len(branches), digests=branches)
    return ids, {"watcher": watcher, "reader-0": reader}


def test_the_check_refuses_what_is_not_exact(quick_run: tuple[Path, str]) -> None:
    from benchmarks.harness import CorrectnessError
    from benchmarks.live import check

    tmp, _ = quick_run
    db_path = tmp / "work" / "live" / "live.duckdb"
    ids, clients = _readers_as_the_database_says(db_path)
    assert check(ids, clients, db_path, log=lambda _: None)["reader_branches_checked"] > len(ids)

    reader = clients["reader-0"]
    first = reader.log.seen[ids[0]]
    good = first.digests[0]
    first.digests[0] = "0" * 32  # one branch's arrays differ
    with pytest.raises(CorrectnessError, match="1 branches differ"):
        check(ids, clients, db_path, log=lambda _: None)
    first.digests[0] = good

    del first.digests[0]  # one branch never fetched
    with pytest.raises(CorrectnessError, match="1 not fetched"):
        check(ids, clients, db_path, log=lambda _: None)
    first.digests[0] = good

    gone = clients["watcher"].log.seen.pop(ids[-1])  # a trace never listed
    with pytest.raises(CorrectnessError, match=f"watcher: listed {len(ids) - 1} of {len(ids)}"):
        check(ids, clients, db_path, log=lambda _: None)
    clients["watcher"].log.seen[ids[-1]] = gone

    reader.log.repeats[ids[3]] = 2  # listed twice
    with pytest.raises(CorrectnessError, match="more than once"):
        check(ids, clients, db_path, log=lambda _: None)
    reader.log.repeats.clear()

    with pytest.raises(CorrectnessError, match="the database holds 24 traces, 25 were appended"):
        check([*ids, "never-appended"], clients, db_path, log=lambda _: None)


def test_the_live_suite_is_registered() -> None:
    from benchmarks import live
    from benchmarks.__main__ import parse_args

    args = parse_args(["live", "--quick"])
    assert args.suite == "live" and args.results == live.RESULTS
    assert (args.traces, args.rate_traces, args.readers, args.soak_traces) == (24, 12, 8, 32)
    args = parse_args(["live"])
    assert (args.traces, args.rate, args.rate_traces, args.soak_traces) == (512, 2.0, 96, 12288)
    assert parse_args([]).suite == "core"
