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
