"""Smoke test of the async-feed benchmark: ``python -m benchmarks async`` on a small run (5
groups: exactly one stale, one zero-variance) ends to end, its rule check passes and has
teeth, and the results report every figure."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")

METRICS = {"bound", "mask", "twin", "spans", "column"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    from benchmarks.__main__ import main

    tmp = tmp_path_factory.mktemp("bench-async")
    out, err = io.StringIO(), io.StringIO()
    args = ["async", "--quick", "--traces", "40", "--workdir", str(tmp / "work"), "--results", str(tmp / "r.json")]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    assert code == 0, out.getvalue() + err.getvalue()
    return tmp, out.getvalue()


def test_quick_async_benchmark_completes_and_is_correct(quick_run: tuple[Path, str]) -> None:
    tmp, table = quick_run
    data = json.loads((tmp / "r.json").read_text())
    assert set(data["metrics"]) == METRICS
    v, c = data["versioned"], data["correctness"]
    assert (v["groups"], v["stale_groups"], v["zero_variance_groups"]) == (5, 1, 1)
    assert c["passed"] and c["stale_groups"] == 1 and c["masked_tokens"] > 0
    assert c["bound_samples"] < c["plain_samples"] and c["off_policy_max"] <= 1
    assert v["spans"] >= v["nodes_with_spans"] > 0
    for key in ("bound", "mask"):
        assert data["metrics"][key]["target"] == "<= 1.15x" and data["metrics"][key]["ratio"] > 0
    assert data["metrics"]["column"]["target"] == "<= 1%"
    assert "groups stale at K=1" in table and "PASSED" in table


def test_the_rule_check_has_teeth(quick_run: tuple[Path, str]) -> None:
    import tracedb
    from benchmarks.asyncfeed import STEP, K, check
    from benchmarks.harness import CorrectnessError

    tmp, _ = quick_run
    with tracedb.connect(tmp / "work" / "async" / "versioned.duckdb", read_only=True) as db:
        plain = db.micro_batches(32_768, ranks=2)
        bound = db.micro_batches(32_768, ranks=2, policy=STEP, max_staleness=K)
        mask = db.micro_batches(32_768, ranks=2, policy=STEP, max_staleness=K, stale="mask")
        assert check(db, plain, bound, mask)["passed"]
        with pytest.raises(CorrectnessError, match="bound"):
            check(db, plain, db.micro_batches(32_768, ranks=2, policy=STEP, max_staleness=K + 3), mask)
        with pytest.raises(CorrectnessError, match="mask"):
            check(db, plain, bound, bound)
