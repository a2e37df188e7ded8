"""The REST benchmark runs end to end (tiny sizes): server subprocess, clients, no errors."""

from __future__ import annotations

import json
from pathlib import Path


def test_bench_api_smoke(tmp_path: Path) -> None:
    from benchmarks.bench_api import main

    results = tmp_path / "api.json"
    args = ["--seconds", "0.5", "--traces", "4", "--tokens", "2000", "--clients", "2", "--workdir", str(tmp_path)]
    assert main([*args, "--results", str(results)]) == 0
    data = json.loads(results.read_text())
    for label in ("warm", "cold"):
        assert {r["format"] for r in data[label]} == {"json", "arrow"}
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in data[label])


def test_bench_api_as_a_suite_of_the_runner(tmp_path: Path) -> None:
    """``python -m benchmarks api``: the same figures through the one runner, written to the
    results file with the keys ``--results`` gives; the table printed."""
    import contextlib
    import io

    from benchmarks.__main__ import main

    results = tmp_path / "api.json"
    args = ["api", "--seconds", "0.5", "--traces", "4", "--tokens", "2000", "--clients", "2"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main([*args, "--workdir", str(tmp_path), "--results", str(results)]) == 0
    data = json.loads(results.read_text())
    assert list(data) == ["clients", "traces", "tokens_per_branch", "seconds", "warm", "cold", "arrow_vs_json"]
    assert all(r["errors"] == 0 for label in ("warm", "cold") for r in data[label])
    assert "REST branch lookup: 2 clients, 4 traces" in out.getvalue() and "arrow vs json" in out.getvalue()
