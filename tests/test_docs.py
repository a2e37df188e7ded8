"""The README is tested: its opening commands, its length and links, its Python tour, and the
command list the README and docs/ document between them (tests/test_docs_run.py runs their
shell blocks)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import typer.main

from tracedb.cli.main import app

from support import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))


def code_blocks(lang: str, info: str = "") -> list[str]:
    """The README's blocks fenced as ```lang (``info`` a regex for the rest of the info string)."""
    return re.findall(rf"```{lang}{info}\n(.*?)```", README, flags=re.S)


def test_readme_opens_with_the_two_commands() -> None:
    first = code_blocks("bash", r"[^\n]*")[0].splitlines()
    assert README.index("```bash") < README.index("tracedb is a")
    assert first[0].startswith("python3 dev.py demo")
    assert first[1].startswith("python3 dev.py test")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python3 dev.py test" in ci


def test_readme_is_short_and_its_links_resolve() -> None:
    assert len(README.splitlines()) <= 200, "README.md is over 200 lines: move reference text into docs/"
    links = re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w-]*)?\)", README)
    assert "docs/performance.md" in links
    for link in links:
        assert (ROOT / link).is_file(), f"README.md links {link}, which does not exist"


def test_links_and_images_under_docs_resolve() -> None:
    for page in DOCS:
        for target in re.findall(r"\]\(([\w./-]+\.(?:md|png))(?:#[\w-]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links {target}, which does not exist"
    viewer = (ROOT / "docs" / "viewer.md").read_text()
    for route in ("/view/{id}", "/view/group/{id}", "/run", "/runs/compare"):  # each page shown
        section = viewer.split(f"`{route}`", 1)[1].split("\n## ", 1)[0]
        assert "![" in section, f"docs/viewer.md shows no screenshot of {route}"


def test_every_cli_command_is_documented() -> None:
    commands = typer.main.get_command(app).commands
    assert set(commands) >= {"ingest", "sql", "branches", "export", "stats"}
    text = README + "".join(page.read_text() for page in DOCS)
    for name in commands:
        assert f"tracedb {name}" in text, f"`tracedb {name}` is documented neither in README.md nor under docs/"


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
