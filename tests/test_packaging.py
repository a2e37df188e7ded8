"""What a wheel ships: tracedb with its REST app and SQL files inside it (tracedb.api,
tracedb.schema), no top-level ``api``; and ``tracedb serve`` works from that install."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

import tracedb

from support import FIXTURES
from support.servers import free_port, in_process

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of what the wheel is made of: setuptools writes build/ and
    # *.egg-info into the tree it builds, and two test processes (pytest-xdist workers,
    # or another checkout's run) must not build in one tree at once.
    source = tmp_path_factory.mktemp("source")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("tracedb", "api", "schema"):
        shutil.copytree(REPO / name, source / name, ignore=skip)
    # Offline: the build backend is the environment's own setuptools.
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("tracedb-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def test_the_wheel_holds_tracedb_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"tracedb"}
    for shipped in (
        "tracedb/api/app.py",
        "tracedb/api/routes/branches.py",
        "tracedb/api/templates/view.html",
        "tracedb/api/static/viewer.js",
        "tracedb/schema/tables.sql",
        "tracedb/schema/macros.sql",
        "tracedb/schema/encoded.sql",
        "tracedb/schema/cec.sql",
    ):
        assert shipped in names, shipped
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "tracedb = tracedb.cli.main:main" in entry


def test_serve_works_from_the_installed_wheel(installed: Path, tmp_path: Path) -> None:
    db = tmp_path / "runs.duckdb"
    with tracedb.connect(db) as database:
        assert database.ingest(FIXTURES / "linear.traces.jsonl").ok
    # The install comes first on the path, so neither the repository nor the editable
    # install can stand in for it; the working directory holds nothing of tracedb.
    env = {"PYTHONPATH": str(installed), "PYTHONSAFEPATH": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import tracedb, tracedb.api; print(tracedb.__file__); import api"],
        env={**env, "PATH": ""},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.startswith(str(installed)), where.stdout + where.stderr
    assert "No module named 'api'" in where.stderr
    port = free_port()
    with in_process(
        [sys.executable, "-m", "tracedb", "serve", "--db", str(db), "--port", str(port)], port, env=env, cwd=tmp_path
    ) as base:
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["traces"] == 1 and health["status"] == "ok"
        page = httpx.get(f"{base}/", timeout=10)
        assert page.status_code == 200 and "<table" in page.text  # templates from the install
        assert httpx.get(f"{base}/static/viewer.js", timeout=10).status_code == 200
