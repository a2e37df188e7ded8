"""dev.py: what each command installs (the demo: tracedb alone, no test or lake extras),
that the demo runs with nothing more, and the test run's per-module progress lines, with
and without pytest-xdist's ``--dist loadfile`` (as ``dev.py test`` and CI run it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from support import REPO

spec = importlib.util.spec_from_file_location("devpy", REPO / "dev.py")
dev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dev)

HEAVY = ("verifiers", "pytest", "hypothesis", "ray", "pyiceberg", "playwright", "schemathesis", "httpx", "psycopg2")
"""What the test and lake extras bring, and the demo must not need."""


def stamp(digest: str, *extras: str) -> str:
    return json.dumps({"pyproject": digest, "extras": list(extras)})


def test_the_demo_installs_tracedb_alone_and_the_tests_the_rest() -> None:
    assert dev.install_plan("demo", None, "d1") == ()
    assert dev.install_plan("tracedb", None, "d1") == ()
    assert dev.install_plan("test", None, "d1") == ("lake", "test")
    assert dev.install_plan("demo", stamp("d1"), "d1") is None  # there already
    assert dev.install_plan("test", stamp("d1"), "d1") == ("lake", "test")  # after a demo: the rest
    assert dev.install_plan("demo", stamp("d1", "lake", "test"), "d1") is None
    assert dev.install_plan("demo", stamp("d0", "lake", "test"), "d1") == ("lake", "test")  # kept on a new pyproject
    assert dev.install_plan("demo", "d1", "d1") is None  # the old stamp: the digest of a full install
    assert dev.install_plan("bench", "d0", "d1") == ("lake", "test")
    assert dev.pip_install_args(()) == ["install", "-e", "."]
    assert dev.pip_install_args(("lake", "test")) == ["install", "-e", ".[lake,test]"]
    assert all("--quiet" not in a for a in dev.pip_install_args(("test",)))  # pip's progress is shown
    assert "source .venv/bin/activate" in dev.ON_PATH and "python3 dev.py tracedb" in dev.ON_PATH


def test_tracedb_itself_depends_on_nothing_heavy() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {re.split(r"[<>=\[ ;]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    assert not names & set(HEAVY), names & set(HEAVY)


def test_the_demo_runs_without_the_test_and_lake_extras(tmp_path: Path) -> None:
    blocker = tmp_path / "blocked"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(  # found (a library may look), but never importable
        textwrap.dedent(
            f"""
            import importlib.abc, importlib.machinery, sys
            class Missing(importlib.abc.Loader):
                def create_module(self, spec):
                    raise ModuleNotFoundError(f"{{spec.name}} is not installed (the demo must not need it)")
                def exec_module(self, module):
                    pass
            class Blocked:
                def find_spec(self, name, path=None, target=None):
                    if name.split(".")[0] in {HEAVY!r}:
                        return importlib.machinery.ModuleSpec(name, Missing())
            sys.meta_path.insert(0, Blocked())
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    env.pop("TRACEDB_DB", None)
    command = [sys.executable, "-m", "tracedb", "demo", "--db", "demo.duckdb", "--data", "sample/traces.jsonl"]
    done = subprocess.run(
        [*command, "--groups", "2", "--group-size", "2", "--tokens", "2000"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exported" in done.stdout and (tmp_path / "demo.parquet").exists()


MODULES = {
    "test_a.py": "def test_one():\n    pass\n\ndef test_two():\n    pass\n",
    "test_b.py": "import pytest\n\n@pytest.mark.skip\ndef test_skipped():\n    pass\n\ndef test_three():\n    pass\n",
    "test_c.py": "def test_four():\n    pass\n",
}


@pytest.mark.parametrize("workers", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one-process", "xdist"])
def test_progress_names_each_module_as_it_finishes(tmp_path: Path, workers: list[str]) -> None:
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "support.progress",
            "--module-progress",
            *workers,
            "-p",
            "no:cacheprovider",
        ]
        + ([] if workers else ["-p", "no:xdist"]),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = re.findall(
        r"^\[\s*(\d)/3 modules, (\d)/5 tests, [\d.ms]+\] (test_\w)\.py: (\d) tests in ", done.stdout, re.M
    )
    assert sorted(m for _, _, m, _ in lines) == ["test_a", "test_b", "test_c"], done.stdout
    assert [int(n) for n, _, _, _ in lines] == [1, 2, 3]
    assert int(lines[-1][1]) == 5 and {m: int(t) for _, _, m, t in lines} == {"test_a": 2, "test_b": 2, "test_c": 1}
    quiet = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "support.progress", "-p", "no:xdist", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert quiet.returncode == 0 and "modules," not in quiet.stdout  # silent unless asked for
