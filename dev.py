#!/usr/bin/env python3
"""Set up and run tracedb with nothing but Python 3.11+ and pip.

    python3 dev.py demo    # the main job: sample rollouts -> DuckDB file -> views, SQL, export
    python3 dev.py test    # ruff + the whole test suite (on min(2, cores) pytest-xdist workers)
    python3 dev.py bench   # benchmarks against verifiers, side by side
    python3 dev.py tracedb ARGS...   # the CLI inside the environment

Each command first makes sure ``.venv`` exists with tracedb and its test dependencies
installed (re-installing when pyproject.toml changed).

``dev.py test ARGS...`` passes ARGS to pytest (``-k NAME``, a test path, ``-x``). The suite
runs on ``min(2, cores)`` pytest-xdist workers; ``TRACEDB_TEST_WORKERS=N`` sets the count
(``0`` or ``1``: one process, no workers), and so does an ``-n N`` among ARGS.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".tracedb-installed"


def run(*args: str | Path) -> None:
    result = subprocess.run([str(a) for a in args], cwd=ROOT)
    if result.returncode:
        sys.exit(result.returncode)


def test_workers(args: list[str]) -> list[str]:
    """The pytest-xdist arguments for ``dev.py test``: none when ``args`` already choose
    (``-n``, ``--numprocesses``, ``-p no:xdist``), else ``-n N`` with N from
    ``TRACEDB_TEST_WORKERS`` or ``min(2, cores)``; none when N is below 2."""
    if any(a.startswith(("-n", "--numprocesses")) or a in ("no:xdist", "-pno:xdist") for a in args):
        return []
    chosen = os.environ.get("TRACEDB_TEST_WORKERS", "").strip()
    if chosen:
        if not chosen.isdigit():
            sys.exit(f"dev.py: TRACEDB_TEST_WORKERS={chosen!r} is not a whole number of workers")
        workers = int(chosen)
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(2, cores)
    # loadfile: a test module runs whole on one worker, in its order, as it does alone, so
    # its module fixtures (a benchmark run, a wheel build, a browser, Ray) are made once.
    # Modules go out in collection order (tests/conftest.py puts the longest first), not
    # xdist's default of most tests first, which left one-test modules like Ray's for last.
    return ["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"] if workers >= 2 else []


def setup() -> None:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    if not (BIN / "python").exists():
        print("creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("installing tracedb and its test dependencies into .venv", flush=True)
    run(BIN / "python", "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    run(BIN / "python", "-m", "pip", "install", "--quiet", "-e", ".[test,lake]")
    # An install of the old layout may leave an empty tracedb/ in site-packages, which
    # Python would take for a namespace package ahead of the editable install's finder.
    for leftover in VENV.glob("lib/python*/site-packages/tracedb"):
        if leftover.is_dir() and not any(leftover.iterdir()):
            leftover.rmdir()
    STAMP.write_text(digest)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "test", "bench", "tracedb", "setup"):
        print(__doc__)
        sys.exit(2)
    setup()
    command, rest = argv[0], argv[1:]
    if command == "demo":
        run(BIN / "tracedb", "demo", "--db", "tracedb-demo.duckdb", *rest)
    elif command == "test":
        workers = test_workers(rest)
        run(BIN / "ruff", "check", ".")
        run(BIN / "ruff", "format", "--check", ".")
        run(BIN / "python", "-m", "pytest", "-q", *workers, *rest)
    elif command == "bench":
        run(BIN / "python", "-m", "benchmarks", *rest)
    elif command == "tracedb":
        run(BIN / "tracedb", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
