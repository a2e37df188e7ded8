#!/usr/bin/env python3
"""Set up and run tracedb with nothing but Python 3.11+ and pip.

    python3 dev.py demo    # the main job: sample rollouts -> DuckDB file -> views, SQL, export
    python3 dev.py test    # ruff + the whole test suite
    python3 dev.py bench   # benchmarks against verifiers, side by side
    python3 dev.py tracedb ARGS...   # the CLI inside the environment

Each command first makes sure ``.venv`` exists with tracedb and its test dependencies
installed (re-installing when pyproject.toml changed).
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
        run(BIN / "ruff", "check", ".")
        run(BIN / "ruff", "format", "--check", ".")
        run(BIN / "python", "-m", "pytest", "-q", *rest)
    elif command == "bench":
        run(BIN / "python", "-m", "benchmarks", *rest)
    elif command == "tracedb":
        run(BIN / "tracedb", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
