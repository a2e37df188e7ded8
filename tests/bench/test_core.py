"""Smoke test of the benchmark suite: ``python -m benchmarks --quick`` runs end to end
(a 16-trace, 3k-token workload written by verifiers, one repeat), its correctness check
passes, and ``results.json`` reports every metric. Also: the check has teeth."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from support import FIXTURES

pytest.importorskip("verifiers.v1")

METRICS = {
    "ingest",
    "warm_views",
    "warm_views_cold_cache",
    "views_from_file",
    "storage",
    "sql_macro_view",
    "export_parquet",
}
TARGETS = {"ingest", "warm_views", "views_from_file", "storage"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``python -m benchmarks --quick`` in this process (verifiers is imported once)."""
    from benchmarks.__main__ import main

    tmp = tmp_path_factory.mktemp("bench")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--quick", "--workdir", str(tmp / "work"), "--results", str(tmp / "results.json")])
    assert code == 0, out.getvalue() + err.getvalue()
    return tmp, out.getvalue()


def test_quick_benchmark_reports_every_metric(quick_run: tuple[Path, str]) -> None:
    tmp, table = quick_run
    data = json.loads((tmp / "results.json").read_text())

    assert data["correctness"]["passed"] is True
    assert data["correctness"]["branches"] > data["workload"]["traces"]  # compaction forks
    assert data["correctness"]["tracedb_views_checked"] >= 4
    assert data["repeat"] == 1
    assert set(data["metrics"]) == METRICS
    for key, metric in data["metrics"].items():
        assert metric["tracedb"] and len(metric["tracedb"]["samples"]) == 1, key
        assert metric["tracedb"]["median"] > 0, key
        if key != "export_parquet":
            assert metric["peer"] and metric["peer"]["median"] > 0, key
            assert metric["ratio"] and metric["ratio"] > 0, key
        assert (metric["passed"] is not None) == (key in TARGETS), key
    export = data["metrics"]["export_parquet"]["notes"]
    assert export["rows"] == data["correctness"]["branches"] and export["view_MB_per_s"] > 0
    assert data["machine"]["cpu_count"] and data["machine"]["packages"]["verifiers"] == "0.4.0"
    assert data["workload"]["bytes"] > 0 and data["database"]["traces"] == data["workload"]["traces"]

    ingest = data["peers"]["ingest"]
    assert ingest["targets"] == {
        "whole_process_verifiers_over_tracedb": ">= 6x",
        "tracedb_help_over_import_duckdb_pyarrow": "<= 1.3x",
    }
    assert set(ingest["passed"]) == set(ingest["targets"])
    assert data["metrics"]["ingest"]["target"] == ">= 8x"
    passes = [m["passed"] for m in data["metrics"].values() if m["passed"] is not None]
    assert data["all_targets_met"] == all([*passes, *ingest["passed"].values()])

    for label in ("ingest", "warm views", "views from file", "storage", "SQL", "Parquet", "as whole processes"):
        assert label in table
    assert "PASS" in table or "MISS" in table


def test_correctness_check_catches_a_wrong_view(quick_run: tuple[Path, str]) -> None:
    import tracedb
    from benchmarks.core import COLUMNS, verify_against_peer
    from benchmarks.harness import CorrectnessError, peer_read

    tmp, _ = quick_run
    workload = next((tmp / "work").glob("workload-*"))
    episodes = peer_read(workload)
    with tracedb.connect(tmp / "work" / "run" / "tracedb.duckdb", read_only=True) as db:
        view = db.branches(columns=COLUMNS)
    assert verify_against_peer(view, episodes)["branches"] == view.num_rows

    # One logprob off by 1e-3 in one branch: refused.
    logprobs = view["logprobs"].combine_chunks()
    values = logprobs.values.to_numpy().copy()
    values[len(values) // 2] = values[len(values) // 2] + 1e-3
    bad = view.set_column(
        view.schema.get_field_index("logprobs"),
        "logprobs",
        pa.ListArray.from_arrays(logprobs.offsets, pa.array(values, pa.float32())),
    )
    with pytest.raises(CorrectnessError, match="logprobs differs"):
        verify_against_peer(bad, episodes)

    # Advantages nulled out: refused (None-ness is part of the contract).
    nulled = view.set_column(
        view.schema.get_field_index("advantages"),
        "advantages",
        pa.nulls(view.num_rows, view.schema.field("advantages").type),
    )
    with pytest.raises(CorrectnessError, match="advantages is null"):
        verify_against_peer(nulled, episodes)

    # A branch missing: refused.
    with pytest.raises(CorrectnessError, match="missing"):
        verify_against_peer(view.filter(pc.not_equal(view["branch_index"], 0)), episodes)


def test_views_from_file_refuses_a_file_still_open(tmp_path: Path) -> None:
    """Databases share one DuckDB instance per process: the "from the file" figure must
    not be served by an attachment another handle keeps open."""
    import tracedb
    from benchmarks.core import tracedb_from_file
    from tracedb.runtime import is_attached

    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        assert is_attached(str(path))
        with pytest.raises(RuntimeError, match="still open"):
            tracedb_from_file(path)
    assert not is_attached(str(path))
    assert tracedb_from_file(path).num_rows == 1
