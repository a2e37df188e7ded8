"""Every shell block of the README and docs/ runs as written (docs/contributing.md).

One sample run is generated for the module; each Markdown file runs in a directory of its
own, the README from the sample files alone, a docs page with what the README's quick start
leaves (runs.duckdb: the sample ingested, credit set grpo).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import tracedb
import tracedb.credit

from support import REPO
from support.docrun import SAMPLE, Block, DocError, Runner, commands_of, shell_blocks, write_sample_dir

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_sample_dir(tmp_path_factory.mktemp("docs-sample") / "files")
    with tracedb.connect(root.parent / "runs.duckdb") as db:  # what the README's quick start leaves
        report = db.ingest(root / "runs")
        tracedb.credit.run(db, "grpo", "grpo")
    assert report.traces == SAMPLE["groups"] * SAMPLE["group_size"]
    return root


def _workdir(sample: Path, tmp_path: Path, page: Path) -> Path:
    work = tmp_path / page.stem
    shutil.copytree(sample, work)
    if page.parent.name == "docs":
        shutil.copy(sample.parent / "runs.duckdb", work / "runs.duckdb")
    return work


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs_as_written(page: Path, sample: Path, tmp_path: Path) -> None:
    runner = Runner(_workdir(sample, tmp_path, page))
    blocks = runner.run_file(page)
    assert runner.ran == [b.where for b in blocks if b.notest is None and b.commands]


def test_readme_quick_start_is_run() -> None:
    """The README's quick start is made of runnable blocks, the first writing the sample this
    module generates (so the runner's sample is the one a newcomer makes)."""
    blocks = [b for b in shell_blocks(REPO / "README.md") if b.notest is None]
    assert len(blocks) >= 6
    assert "write_sample('runs/traces.jsonl'" in blocks[0].text
    for key, value in SAMPLE.items():
        assert f"{key}={value}" in blocks[0].text
    assert any(b.server for b in blocks) and any("--follow" in b.text for b in blocks)


# --------------------------------------------------------------------------- the runner itself


def _page(tmp_path: Path, body: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(body)
    return page


def test_commands_are_split_and_classified() -> None:
    text = (
        "tracedb stats --db runs.duckdb   # a comment\n"
        "# only a comment\n\n"
        "tracedb ingest bad.jsonl --db x.duckdb --strict   # exits 1: refused\n"
        "tracedb pack --db runs.duckdb \\\n    --out s --seq-len 64\n"
        "tracedb ingest --follow runs/ --tag step='$.info.step'\n"
        'curl -s "http://127.0.0.1:8000/x?a=1&b=2" | head -c 10\n'
        'tracedb sql "SELECT 1 AS \\"a\\"" --db r.duckdb\n'
    )
    commands = commands_of(text, 10)
    assert [c.line for c in commands] == [10, 13, 14, 16, 17, 18]
    assert commands[0].argv == ["stats", "--db", "runs.duckdb"] and commands[0].expect == 0
    assert commands[1].expect == 1
    assert commands[2].argv == ["pack", "--db", "runs.duckdb", "--out", "s", "--seq-len", "64"]
    assert commands[3].argv == ["ingest", "--follow", "runs/", "--tag", "step=$.info.step"]
    assert commands[4].argv is None and commands[5].argv is None  # a pipe; an escape inside double quotes


def test_blocks_and_markers(tmp_path: Path) -> None:
    page = _page(
        tmp_path,
        "# t\n\n```bash\ntracedb stats --db a.duckdb\n```\n\n```bash notest tests/test_docs.py\nrm -rf /\n```\n\n"
        "```python\nprint(1)\n```\n\n```sh\ntracedb serve --db a.duckdb\n```\n",
    )
    blocks = shell_blocks(page)
    assert [(b.line, b.info, b.notest) for b in blocks] == [
        (3, "bash", None),
        (7, "bash notest tests/test_docs.py", "tests/test_docs.py"),
        (15, "sh", None),
    ]
    assert blocks[0].in_process and not blocks[0].background
    assert blocks[2].background and blocks[2].server


def test_a_failing_command_fails_the_page(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(DocError, match=r"page\.md:5: exit status 3, expected 0"):
        Runner(work).run_file(_page(tmp_path, "x\n\n```bash\nls\n(exit 3)\n```\n"))
    with pytest.raises(DocError, match=r"page\.md:4: `tracedb stats --db missing.duckdb` exited 2, expected 0"):
        Runner(work).run_file(_page(tmp_path, "x\n\n```bash\ntracedb stats --db missing.duckdb\n```\n"))
    # the promised failure passes, a promise broken fails
    Runner(work).run_file(
        _page(tmp_path, "```bash\ntracedb stats --db missing.duckdb   # exits 2\nfalse  # exits 1\n```\n")
    )
    with pytest.raises(DocError, match="expected 1"):
        Runner(work).run_file(_page(tmp_path, "```bash\ntrue  # exits 1\n```\n"))


def test_notest_names_an_existing_test(tmp_path: Path) -> None:
    with pytest.raises(DocError, match="tests/no_such_test.py, which does not exist"):
        Runner(tmp_path).run_file(_page(tmp_path, "```bash notest tests/no_such_test.py\nfalse\n```\n"))


def test_a_block_that_never_exits_holds_one_command(tmp_path: Path) -> None:
    block = Block(tmp_path / "p.md", 1, "bash", "", commands_of("tracedb serve --db a\ntracedb serve --db b\n", 2))
    with pytest.raises(DocError, match="holds that one command only"):
        Runner(tmp_path).run_block(block)
