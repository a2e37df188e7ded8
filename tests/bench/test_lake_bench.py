"""The lake benchmark: registered beside the others; its ratios, targets and projection
are the arithmetic docs/scale.md states (the measurement itself needs Ray in a network
namespace and is run by hand: ``python -m benchmarks lake --quick``)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.__main__ import parse_args


def test_lake_suite_is_registered() -> None:
    from benchmarks import lake

    for argv in (["lake"], ["--suite", "lake"]):
        args = parse_args([*argv, "--quick"])
        assert args.suite == "lake" and args.results == lake.RESULTS and args.traces == lake.QUICK["traces"]


def _catalog(ingest_s: float = 8.0) -> dict[str, Any]:
    return {
        "lake_ingest_1w_s": ingest_s,
        "lake_ingest_2w_s": ingest_s / 2,
        "lake_ingest_1w_commits": 10,
        "lake_ingest_2w_commits": 10,
        "commits_per_256_traces": 5.0,
        "lake_data_files": 640,
        "lake_bytes": 500_000,
        "lake_views_cold_s": 9.0,
        "lake_views_s": 5.0,
        "lake_visible_s": 1.0,
        "lake_micro_batches_s": 2.0,
        "lake_compact_s": 3.0,
        "lake_files_before_compact": 700,
        "lake_files_after_compact": 70,
        "lake_views_compacted_s": 2.5,
        "lake_micro_batches_compacted_s": 1.5,
        "sql_traces": 2048,
        "sql_file_s": 0.01,
        "sql_lake_s": 0.2,
        "sql_lake_compacted_s": 0.05,
        "compact_new_s": 2.0,
        "compact_new_traces": 256,
        "compaction_growth": 1.2,
    }


def _measured(writers: dict | None = None) -> dict[str, Any]:
    return {
        "traces": 512,
        "tokens": 512 * 3_000,  # traces of 3k tokens: the target's are 10x longer
        "shards": 8,
        "input_bytes": 1_000_000,
        "file_bytes": 400_000,
        "file_ingest_s": 2.0,
        "file_views_s": 1.0,
        "file_micro_batches_s": 1.0,
        "load": {"start": [3.5, 3.0, 2.0], "end": [4.0, 3.0, 2.0]},
        "sqlite": _catalog(),
        "postgres": _catalog(ingest_s=10.0),
        "sql_tokens_per_trace": 1_500,
        "writers": writers or {},
    }


def test_projection_falls_back_to_the_catalog_measured() -> None:
    from benchmarks.lake import project

    measured = _measured()
    del measured["postgres"]
    assert project(measured)["ingest_core_s"] == pytest.approx(8.0 / 512 * 10 * 1_000_000)


def test_ratios_against_the_targets() -> None:
    from benchmarks.lake import TARGETS, ratios

    got = ratios(_measured(), "postgres")
    assert set(got) == set(TARGETS)
    assert got["ingest"] == pytest.approx(5.0) and got["views"] == pytest.approx(5.0)
    assert got["views_compacted"] == pytest.approx(2.5) and got["micro_batches"] == pytest.approx(2.0)
    assert got["commits_per_256"] == 5.0 and got["sql"] == pytest.approx(20.0)
    assert got["compaction_growth"] == 1.2


def test_projection_scales_the_measured_figures() -> None:
    from benchmarks.lake import project

    target = {
        "rollouts": 1_000,
        "tokens": 30_000,
        "writers": 8,
        "traces_per_commit": 256,
        "traces_per_writer_minute": 60,
    }
    p = project(_measured(), target)  # the PostgreSQL catalog's figures, traces 10x longer
    assert p["input_bytes"] == pytest.approx(1_000_000 / 512 * 10 * 1_000)
    assert p["lake_bytes"] == pytest.approx(500_000 / 512 * 10 * 1_000)
    assert p["commits_of_traces"] == pytest.approx(1_000 / 256)
    assert p["table_commits"] == pytest.approx(1_000 / 256 * 5)
    assert p["traces_commits_per_s"] == pytest.approx(8 / 256) and p["commits_per_s"] == pytest.approx(8 / 256 * 5)
    assert p["ingest_core_s"] == pytest.approx(10.0 / 512 * 10 * 1_000)
    assert p["data_files_per_commit"] == pytest.approx(640 / 2)  # 640 files for 512 traces
    assert p["compact_core_s"] == pytest.approx(2.0 / 256 * 20 * 1_000)  # the growth lake's traces: 1.5k tokens
    assert p["views_core_s"] == pytest.approx(2.5 * 2 / 512 * 10 * 1_000)  # 2 cores busy


def test_catalogs_are_chosen_and_rendered() -> None:
    from benchmarks import lake

    assert parse_args(["lake", "--quick"]).catalog == "both"
    assert parse_args(["lake", "--catalog", "postgres"]).catalog == "postgres"
    with pytest.raises(SystemExit):
        parse_args(["lake", "--catalog", "oracle"])
    with pytest.raises(ValueError, match="catalog must be one of"):
        lake.run(None, None, 1, catalog="oracle")  # type: ignore[arg-type]  # refused before any work
    figures = {"seconds": 2.0, "writes": 16, "commits": 40, "retries": 10, "commits_per_s": 20.0}
    writers = {
        "sqlite": {
            "1": {**figures, "retries_per_commit": 0.0},
            "4": {"skipped": "the phase passed its 600 s"},
            "8": {**figures, "retries_per_commit": 0.25},
        },
        "postgres": {"skipped": "no PostgreSQL server here (apt-get install postgresql)"},
    }
    measured = _measured(writers)
    results = {
        "measured": measured,
        "projected": lake.project(measured),
        "ratios": {c: lake.ratios(measured, c) for c in lake.CATALOGS},
    }
    text = lake.render(results)
    lines = text.splitlines()
    writers_text = "\n".join(line for line in lines if line.startswith("writers"))
    assert (
        "writers on sqlite (16 writes; N at once): 1: 20.0 commits/s, 0.00 retries/commit, 4: not measured"
        in writers_text
    )
    assert "(the phase passed its 600 s), 8: 20.0 commits/s, 0.25 retries/commit" in writers_text
    assert "writers on postgres: not measured (no PostgreSQL server here" in writers_text
    assert "load average at start 3.5, at end 4.0" in lines[0]
    postgres = lines[lines.index("postgres catalog:") + 1 :]
    marks = next(line for line in postgres if line.strip().startswith("targets:"))
    assert "ingest 5.00 (MISSED <= 4)" in marks and "views_compacted 2.50 (MET <= 3)" in marks


def test_the_many_writers_input_is_small(tmp_path) -> None:
    """The writers write the first WRITER_TRACES lines (one trace each), not the workload."""
    from benchmarks import lake

    source = tmp_path / "traces.jsonl"
    source.write_bytes(b"".join(b'{"trace": %d}\n' % i for i in range(300)))
    out, count = lake.writer_input(source, tmp_path / "w" / "traces.jsonl", traces=256)
    assert count == 256 and out.read_bytes().splitlines()[-1] == b'{"trace": 255}'
    _, few = lake.writer_input(source, tmp_path / "w2" / "traces.jsonl", traces=1000)
    assert few == 300
