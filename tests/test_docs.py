"""The README is tested: its opening commands, its Python tour, and its command list."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import typer.main

from tracedb.cli.main import app

from support import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_commands() -> None:
    first = code_blocks("bash")[0].splitlines()
    assert README.index("```bash") < README.index("tracedb is a")
    assert first[0].startswith("python3 dev.py demo")
    assert first[1].startswith("python3 dev.py test")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in ci


def test_every_cli_command_is_in_the_readme() -> None:
    commands = typer.main.get_command(app).commands
    assert set(commands) >= {"ingest", "sql", "branches", "export", "stats"}
    for name in commands:
        assert f"tracedb {name}" in README, f"`tracedb {name}` is not documented in README.md"


def test_python_tour_runs(tmp_path: Path, monkeypatch) -> None:
    shutil.copytree(FIXTURES, tmp_path / "runs")
    monkeypatch.chdir(tmp_path)
    (block,) = code_blocks("python")  # blocks marked `python notest` are fragments
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["report"].traces == 44
    assert namespace["table"].num_rows == 69
    assert namespace["record"]["id"] == namespace["table"]["trace_id"][0].as_py()
    assert len(namespace["df"]) > 0
