"""The REST benchmark runs end to end (tiny sizes): server subprocess, clients, no errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import REPO

ROOT = REPO
if str(ROOT) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(ROOT))


def test_bench_api_smoke(tmp_path: Path) -> None:
    from benchmarks.bench_api import main

    results = tmp_path / "api.json"
    args = ["--seconds", "0.5", "--traces", "4", "--tokens", "2000", "--clients", "2", "--workdir", str(tmp_path)]
    assert main([*args, "--results", str(results)]) == 0
    data = json.loads(results.read_text())
    for label in ("warm", "cold"):
        assert {r["format"] for r in data[label]} == {"json", "arrow"}
        assert all(r["errors"] == 0 and r["requests"] > 0 for r in data[label])
