"""The lake benchmark: registered beside the others; its projection is the arithmetic
docs/scale.md states (the measurement itself needs Ray in a network namespace and is
run by hand: ``python -m benchmarks lake --quick``)."""

from __future__ import annotations

import pytest

from benchmarks.__main__ import parse_args


def test_lake_suite_is_registered() -> None:
    from benchmarks import lake

    for argv in (["lake"], ["--suite", "lake"]):
        args = parse_args([*argv, "--quick"])
        assert args.suite == "lake" and args.results == lake.RESULTS and args.traces == lake.QUICK["traces"]


def test_projection_scales_the_measured_figures() -> None:
    from benchmarks.lake import project

    measured = {
        "traces": 10,
        "tokens": 10 * 3_000,  # traces of 3k tokens: the target's are 10x longer
        "input_bytes": 1_000_000,
        "lake_bytes": 500_000,
        "lake_commits": 20,
        "lake_writes": 4,
        "lake_ingest_1w_s": 2.0,
    }
    target = {"rollouts": 1_000, "tokens": 30_000, "writers": 8, "traces_per_write": 10, "write_seconds": 4.0}
    p = project(measured, target)
    assert p["input_bytes"] == pytest.approx(1_000_000 / 10 * 10 * 1_000)
    assert p["lake_bytes"] == pytest.approx(500_000 / 10 * 10 * 1_000)
    assert p["writes"] == 100 and p["commits_per_write"] == 5 and p["commits"] == 500
    assert p["writes_per_s"] == 2 and p["commits_per_s"] == 10 and p["traces_commits_per_s"] == 2
    assert p["ingest_cpu_s_per_write"] == pytest.approx(2.0 / 10 * 10 * 10)
    assert p["files_per_write"] == 80


def test_writers_catalogs_are_chosen_and_rendered() -> None:
    from benchmarks import lake

    assert parse_args(["lake", "--quick"]).catalog == "both"
    assert parse_args(["lake", "--catalog", "postgres"]).catalog == "postgres"
    with pytest.raises(SystemExit):
        parse_args(["lake", "--catalog", "oracle"])
    with pytest.raises(ValueError, match="catalog must be one of"):
        lake.run(None, None, 1, catalog="oracle")  # type: ignore[arg-type]  # refused before any work
    figures = {"seconds": 2.0, "writes": 16, "commits": 40, "retries": 10, "commits_per_s": 20.0}
    writers = {
        "sqlite": {"1": {**figures, "retries_per_commit": 0.0}, "8": {**figures, "retries_per_commit": 0.25}},
        "postgres": {"skipped": "no PostgreSQL server here (apt-get install postgresql)"},
    }
    text = "\n".join(line for line in lake.render(_results(writers)).splitlines() if line.startswith("writers"))
    assert "writers on sqlite (16 writes; N at once): 1: 20.0 commits/s, 0.00 retries/commit, 8: 20.0" in text
    assert "writers on postgres: not measured (no PostgreSQL server here" in text


def _results(writers: dict) -> dict:
    keys = ("file_ingest_s", "lake_ingest_1w_s", "lake_ingest_2w_s", "file_views_s", "lake_views_cold_s")
    keys += ("lake_views_warm_s", "file_micro_batches_s", "lake_micro_batches_s", "lake_compact_s")
    measured = {k: 1.0 for k in keys}
    measured.update(traces=10, tokens=30_000, shards=4, input_bytes=1, file_bytes=1, lake_bytes=1)
    measured.update(lake_catalog_bytes=1, lake_commits=20, lake_writes=4, lake_files_before_compact=9)
    measured.update(lake_files_after_compact=3, lake_visible_s=0.1, writers=writers)
    from benchmarks.lake import project

    return {"measured": measured, "projected": project(measured)}
