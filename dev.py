#!/usr/bin/env python3
"""Set up and run tracedb with nothing but Python 3.11+ and pip.

    python3 dev.py demo    # the main job: sample rollouts -> DuckDB file -> views, SQL, export
    python3 dev.py test    # ruff + the whole test suite (on min(2, cores) pytest-xdist workers)
    python3 dev.py bench   # benchmarks against verifiers, side by side
    python3 dev.py tracedb ARGS...   # the CLI inside the environment

Each command first makes sure ``.venv`` has what it needs, with pip's own progress shown:
``demo`` and ``tracedb`` install tracedb alone (no test or lake extras: no Ray, pyiceberg
or browser driver); ``test``, ``bench`` and ``setup`` add the ``test`` and ``lake`` extras.
What is installed is remembered in ``.venv/.tracedb-installed`` and installed again when
pyproject.toml changed. ``source .venv/bin/activate`` then puts ``tracedb`` on PATH.

``dev.py test ARGS...`` passes ARGS to pytest (``-k NAME``, a test path, ``-x``). The suite
runs on ``min(2, cores)`` pytest-xdist workers; ``TRACEDB_TEST_WORKERS=N`` sets the count
(``0`` or ``1``: one process, no workers), and so does an ``-n N`` among ARGS. A line as each
test module finishes says which, how many are done and the time so far (``--module-progress``,
tests/support/progress.py).
"""

from __future__ import annotations

import hashlib
import json
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


EXTRAS = {"demo": (), "tracedb": (), "test": ("test", "lake"), "bench": ("test", "lake"), "setup": ("test", "lake")}
"""The pyproject extras each command needs in .venv (the demo: tracedb alone)."""
ON_PATH = (
    "tracedb is installed in .venv: `source .venv/bin/activate` puts `tracedb` on PATH "
    "(or run it as `python3 dev.py tracedb ARGS...`)"
)


def read_stamp(stamp: str | None) -> tuple[str | None, tuple[str, ...]]:
    """What ``.venv/.tracedb-installed`` says: the digest of the pyproject.toml installed
    and its extras (the old form, the digest alone, was an install of test and lake)."""
    if not stamp:
        return None, ()
    try:
        found = json.loads(stamp)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        return stamp.strip(), ("lake", "test")
    return found.get("pyproject"), tuple(sorted(found.get("extras", ())))


def install_plan(command: str, stamp: str | None, digest: str) -> tuple[str, ...] | None:
    """The extras to install before ``command`` (``()``: tracedb alone), or None when .venv
    has them for this pyproject.toml (``digest``) already. An install keeps the extras that
    were there, so a demo after the tests does not take the test extras away."""
    installed, extras = read_stamp(stamp)
    want = set(EXTRAS[command])
    if installed == digest and want <= set(extras):
        return None
    return tuple(sorted(want | set(extras)))


def pip_install_args(extras: tuple[str, ...]) -> list[str]:
    """pip's arguments for an editable install of tracedb with ``extras``; no --quiet, so
    that pip shows what it downloads and builds."""
    return ["install", "-e", f".[{','.join(extras)}]" if extras else "."]


def setup(command: str = "setup") -> None:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    stamp = STAMP.read_text() if STAMP.exists() else None
    extras = install_plan(command, stamp, digest)
    if extras is None:
        return
    if not (BIN / "python").exists():
        print("creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
        run(BIN / "python", "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    what = f"tracedb with the {' and '.join(extras)} extras" if extras else "tracedb (no test or lake extras)"
    print(f"installing {what} into .venv (pip's output follows)", flush=True)
    run(BIN / "python", "-m", "pip", *pip_install_args(extras))
    # An install of the old layout may leave an empty tracedb/ in site-packages, which
    # Python would take for a namespace package ahead of the editable install's finder.
    for leftover in VENV.glob("lib/python*/site-packages/tracedb"):
        if leftover.is_dir() and not any(leftover.iterdir()):
            leftover.rmdir()
    STAMP.write_text(json.dumps({"pyproject": digest, "extras": list(extras)}))


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("demo", "test", "bench", "tracedb", "setup"):
        print(__doc__)
        sys.exit(2)
    command, rest = argv[0], argv[1:]
    setup(command)
    if command == "demo":
        run(BIN / "tracedb", "demo", "--db", "tracedb-demo.duckdb", *rest)
        print(ON_PATH)
    elif command == "setup":
        print(ON_PATH)
    elif command == "test":
        workers = test_workers(rest)
        run(BIN / "ruff", "check", ".")
        run(BIN / "ruff", "format", "--check", ".")
        run(BIN / "python", "-m", "pytest", "-q", "--module-progress", *workers, *rest)
    elif command == "bench":
        run(BIN / "python", "-m", "benchmarks", *rest)
    elif command == "tracedb":
        run(BIN / "tracedb", *rest)


if __name__ == "__main__":
    main(sys.argv[1:])
