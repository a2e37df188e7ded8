"""docs/async.md is tested: its commands run in order on a versioned run (the ones that
would follow forever are parsed against the command's real options), its trainer program
runs, and its client call is answered by a server holding the file."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import typer.main
from typer.testing import CliRunner

from tracedb.api import create_app
from tracedb.cli.main import app
from tracedb.synthetic import generate_episodes, versioned

from support.servers import in_thread

DOC = (Path(__file__).resolve().parent.parent / "docs" / "async.md").read_text()
runner = CliRunner()


def blocks() -> list[tuple[str, bool, str]]:
    """Every fenced block: (language, marked notest, text), in order. A block marked
    ``notest tests/test_docs_async.py`` (the docs runner's skip, naming this test) is run
    here; a bare ``notest`` one is not (it follows until stopped, or is a fragment)."""
    found = re.findall(r"```(\w+)( notest[^\n]*)?\n(.*?)```", DOC, flags=re.S)
    return [(m[0], m[1].strip() == "notest", m[2]) for m in found]


def commands(text: str) -> list[list[str]]:
    return [shlex.split(line)[1:] for line in text.splitlines() if line.startswith("tracedb ")]


def _rollouts(directory: Path) -> None:
    """A versioned run in three files, one weight label without a number (ckpt-7f3a)."""
    eps = generate_episodes(
        groups=9, group_size=4, tokens_per_trace=400, system_tokens=20, task_tokens=8, turn_tokens=(8, 30), seed=8
    )
    episodes = list(versioned(eps, step=3, groups_per_step=3, dropped_share=0.1, seed=8))
    episodes[0]["traces"][0]["nodes"][2]["weight_versions"][0]["version"] = "ckpt-7f3a"
    directory.mkdir()
    for step in (1, 2, 3):
        chosen = [e for e in episodes if e["run"]["work"]["step"] == step]
        (directory / f"step{step}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in chosen))


def test_every_command_and_program_of_the_async_page_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    _rollouts(tmp_path / "rollouts")
    assert "(docs/async.md)" in (Path(__file__).resolve().parent.parent / "README.md").read_text()
    found = blocks()
    assert [lang for lang, _, _ in found].count("python") == 2
    cli = typer.main.get_command(app)
    ran = 0
    client_block = None
    for lang, notest, text in found:
        if lang == "bash":
            for args in commands(text):
                if notest:  # follows until stopped: its options must be the command's own
                    command = cli.commands[args[0]]
                    command.make_context(args[0], [a.replace("$TRACEDB_TOKEN", "secret") for a in args[1:]])
                    continue
                result = runner.invoke(app, args, catch_exceptions=False)
                assert result.exit_code == 0, (args, result.output)
                ran += 1
        elif notest:
            client_block = text
        else:
            exec(compile(text, "docs/async.md", "exec"), {})
            printed = capsys.readouterr().out
            assert printed.count("step ") == 3 and "stale groups left out" in printed, printed
    assert ran == 5
    manifest = json.loads((tmp_path / "steps" / "1" / "manifest.json").read_text())
    assert manifest["report"]["policy"] == 1 and manifest["report"]["staleness_bound"] == 0

    assert client_block is not None
    server = create_app(tmp_path / "run.duckdb")
    with in_thread(server) as url:
        namespace = {"after": 0, "step": 2, "mark": None}
        exec(compile(client_block.replace('"http://127.0.0.1:8000"', repr(url)), "docs/async.md", "exec"), namespace)
        assert namespace["after"] == namespace["report"]["watermark"] > 0 and namespace["micro_batches"]
