"""The docs runner: every shell block of the README and docs/, run in order against a sample run.

The conventions a writer of docs follows are in docs/contributing.md: which fences are
shell blocks, ``notest`` (with the test that covers the block), ``# exits N`` on a command
that must fail, and commands that do not exit (``tracedb serve``, ``--follow``), which run
in the background until the next block has run. A block of plain ``tracedb ...`` commands
runs in this process through the CLI's entry point; any other block runs in bash with the
test's virtualenv first on the PATH.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import typer.testing

from .tokenizers import make_tokenizer

SHELLS = ("bash", "sh", "shell")
READY_S = 60.0
STOP_S = 20.0
BLOCK_S = 600.0  # a hang guard, not the budget (docs/contributing.md)
SAMPLE = dict(groups=4, group_size=4, tokens_per_trace=3000, compaction_every=2000, advantages=True)
"""What the README's quick start writes into runs/traces.jsonl (its first runnable block)."""


class DocError(AssertionError):
    """A block failed as written: the message names the file, the line and what happened."""


@dataclass
class Command:
    line: int
    text: str  # the command as written, continuation lines joined, comment dropped
    expect: int  # the exit status its comment promises (`# exits N`), else 0
    argv: list[str] | None  # its arguments after `tracedb` when it needs no shell, else None


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    info: str
    text: str
    commands: list[Command] = field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def notest(self) -> str | None:
        """None when the block runs; else what follows ``notest`` (the covering test), maybe ''."""
        words = self.info.split()
        if len(words) >= 2 and words[1] == "notest":
            return " ".join(words[2:])
        return None

    @property
    def background(self) -> bool:
        return any(_never_exits(c.text) for c in self.commands)

    @property
    def server(self) -> bool:
        return any(re.search(r"\btracedb\s+serve\b", c.text) for c in self.commands)

    @property
    def in_process(self) -> bool:
        return bool(self.commands) and all(c.argv is not None for c in self.commands)

    @property
    def shell_state(self) -> bool:
        """Whether a command changes the shell for the ones after it (export, cd, a variable):
        then the block runs whole in one bash, else command by command."""
        return any(
            re.match(r"(export|cd|source|\.|set|unset|alias)\s|[A-Za-z_][A-Za-z0-9_]*=\S*$", c.text)
            for c in self.commands
        )


def _never_exits(text: str) -> bool:
    return bool(re.search(r"\btracedb\s+serve\b", text) or re.search(r"\btracedb\b.*\s--follow\b", text))


def _comment_at(line: str) -> tuple[int | None, bool]:
    """Where the line's comment starts (None: none) and whether it uses shell syntax before it
    (expansions, globs, operators, escapes) that only a shell runs as written."""
    quote = None
    syntax = False
    for i, ch in enumerate(line):
        if quote == "'":
            quote = None if ch == "'" else quote
            continue
        if quote == '"':
            if ch == '"':
                quote = None
            elif ch in "$`\\":
                syntax = True
            continue
        if ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i, syntax
        elif ch in "$`\\*?[]~{}|&;<>()":
            syntax = True
    return None, syntax


def commands_of(text: str, first_line: int) -> list[Command]:
    """The block's commands: continuation lines joined, blank and comment-only lines skipped."""
    commands: list[Command] = []
    pending: list[str] = []
    start = first_line
    for offset, raw in enumerate(text.splitlines()):
        if not pending:
            start = first_line + offset
        if raw.rstrip().endswith("\\"):
            pending.append(raw.rstrip()[:-1])
            continue
        joined = " ".join(part.strip() for part in [*pending, raw])
        pending = []
        at, syntax = _comment_at(joined)
        command = (joined if at is None else joined[:at]).strip()
        comment = "" if at is None else joined[at:]
        if not command:
            continue
        expect = re.search(r"\bexits?\s+(\d+)", comment)
        argv = None
        if not syntax:
            words = shlex.split(command)
            if words and words[0] == "tracedb":
                argv = words[1:]
        commands.append(Command(start, command, int(expect.group(1)) if expect else 0, argv))
    return commands


def shell_blocks(path: Path) -> list[Block]:
    """The shell blocks of a Markdown file, in order (fences at the start of a line)."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^```(\S*)(.*)$", lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        info = (opening.group(1) + opening.group(2)).strip()
        if info.split()[:1] and info.split()[0] in SHELLS:
            text = "\n".join(lines[i + 1 : end])
            blocks.append(Block(path, i + 1, info, text, commands_of(text, i + 2)))
        i = end + 1
    return blocks


# --------------------------------------------------------------------------- the sample


def write_sample_dir(root: Path) -> Path:
    """The files every docs run starts with (docs/contributing.md): runs/traces.jsonl as the
    README writes it, bad.jsonl (one good record, one rejected) and tokenizer.json."""
    from tracedb.synthetic import write_sample

    traces = write_sample(root / "runs" / "traces.jsonl", **SAMPLE)
    first = json.loads(traces.read_text().splitlines()[0])
    bad = json.loads(json.dumps(first))
    bad["id"] = "bad-episode"
    trace = bad["traces"][0]
    trace["id"] = "bad-trace"
    node = next(n for n in trace["nodes"] if n["sampled"])
    node["logprobs"] = node["logprobs"][:-1]
    good = json.loads(json.dumps(first))
    good["id"], good["traces"][0]["id"] = "good-episode", "good-trace"
    (root / "bad.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    ids = sorted(
        {
            t
            for line in traces.read_text().splitlines()
            for n in json.loads(line)["traces"][0]["nodes"]
            for t in n["token_ids"]
        }
    )
    make_tokenizer(root / "tokenizer.json", ids)
    return root


# --------------------------------------------------------------------------- running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_port(text: str, port: int, serve: bool) -> str:
    text = re.sub(r"\b(127\.0\.0\.1|localhost):\d{2,5}\b", f"127.0.0.1:{port}", text)
    if serve:
        if re.search(r"--port\s+\d+", text):
            text = re.sub(r"--port\s+\d+", f"--port {port}", text)
        else:
            text = re.sub(r"\btracedb\s+serve\b", f"tracedb serve --port {port}", text, count=1)
    return text


def _script(block: Block, commands: list[Command]) -> str:
    """Commands as a bash script that checks each one's exit status as its comment says."""
    lines = ["set -uo pipefail"]
    for c in commands:
        lines.append(c.text)
        lines.append(
            f'rc=$?; if [ "$rc" -ne {c.expect} ]; then '
            f'echo "{block.path.name}:{c.line}: exit status $rc, expected {c.expect}" >&2; exit 97; fi'
        )
    return "\n".join(lines) + "\n"


@dataclass
class Background:
    block: Block
    process: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


class Runner:
    """Runs one Markdown file's shell blocks in ``workdir``, a server or follower at a time in
    the background until the next block has run."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.env = dict(env if env is not None else os.environ)
        bin_dir = str(Path(sys.executable).parent)
        self.env["PATH"] = bin_dir + os.pathsep + self.env.get("PATH", "")
        self.env.pop("TRACEDB_URL", None)
        self.env.pop("TRACEDB_TOKEN", None)
        self.background: Background | None = None
        self.port: int | None = None
        self.ran: list[str] = []

    def run_file(self, path: Path) -> list[Block]:
        blocks = shell_blocks(path)
        try:
            for block in blocks:
                self.run_block(block)
        finally:
            self.stop()
        return blocks

    def run_block(self, block: Block) -> None:
        covering = block.notest
        if covering is not None:
            if covering and covering.split()[0].startswith("tests/"):
                test = Path(__file__).resolve().parents[2] / covering.split()[0]
                if not test.exists():
                    raise DocError(f"{block.where}: notest names {covering.split()[0]}, which does not exist")
            return
        if not block.commands:
            return
        previous, port = self.background, self.port
        self.background = None
        try:
            if block.background:
                self._start(block)
            else:
                commands = block.commands
                if previous is not None and port is not None:
                    commands = [replace(c, text=_with_port(c.text, port, serve=False)) for c in commands]
                if block.shell_state:
                    self._bash(block, commands)
                for c in [] if block.shell_state else commands:
                    if c.argv is not None:
                        self._in_process(block, c, shlex.split(c.text)[1:])
                    else:
                        self._bash(block, [c])
        finally:
            if previous is not None:
                self._stop(previous)
        self.ran.append(block.where)

    def _in_process(self, block: Block, c: Command, argv: list[str]) -> None:
        from tracedb.cli.main import app

        cwd = Path.cwd()
        os.chdir(self.workdir)
        try:
            result = typer.testing.CliRunner().invoke(app, argv, env={"TRACEDB_URL": None, "TRACEDB_TOKEN": None})
        finally:
            os.chdir(cwd)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise DocError(
                f"{block.path.name}:{c.line}: `{c.text}` raised {result.exception!r}\n{result.output[-3000:]}"
            ) from result.exception
        if result.exit_code != c.expect:
            raise DocError(
                f"{block.path.name}:{c.line}: `{c.text}` exited {result.exit_code}, expected {c.expect}\n"
                f"{result.output[-3000:]}"
            )

    def _bash(self, block: Block, commands: list[Command]) -> None:
        """``commands`` of ``block`` in one bash, each one's exit status checked."""
        try:
            done = subprocess.run(
                ["bash", "-c", _script(block, commands)],
                cwd=self.workdir,
                env=self.env,
                capture_output=True,
                text=True,
                timeout=BLOCK_S,
            )
        except subprocess.TimeoutExpired as e:
            raise DocError(f"{block.where}: the block ran past {BLOCK_S:.0f} s\n{e.stdout}\n{e.stderr}") from None
        if done.returncode:
            raise DocError(
                f"{block.where}: the block failed (exit {done.returncode})\n"
                f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
            )

    def _start(self, block: Block) -> None:
        if len(block.commands) != 1:
            raise DocError(
                f"{block.where}: a block that does not exit (serve, --follow) holds that one command "
                "only: split it, or mark it notest (docs/contributing.md)"
            )
        self.port = _free_port() if block.server else None
        text = _with_port(block.text, self.port, serve=True) if self.port else block.text
        log = self.workdir / f".background-{block.line}.log"
        with log.open("w") as out:
            process = subprocess.Popen(
                ["bash", "-c", "set -u\n" + text],
                cwd=self.workdir,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        running = Background(block, process, log)
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise DocError(
                    f"{block.where}: `{block.commands[0].text}` ended (exit {process.returncode}) "
                    f"before it was stopped\n{running.output()}"
                )
            if self.port is not None:
                with socket.socket() as s:
                    s.settimeout(0.2)
                    if s.connect_ex(("127.0.0.1", self.port)) == 0:
                        break
            elif log.stat().st_size:
                break
            time.sleep(0.1)
        else:
            self._stop(running, check=False)
            raise DocError(f"{block.where}: not ready after {READY_S:.0f} s\n{running.output()}")
        self.background = running

    def _stop(self, running: Background, check: bool = True) -> None:
        process = running.process
        ended_early = process.poll() is not None
        if not ended_early:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(STOP_S)
        if check and ended_early:
            raise DocError(
                f"{running.block.where}: `{running.block.commands[0].text}` ended (exit "
                f"{process.returncode}) before it was stopped\n{running.output()}"
            )
        if check and process.returncode not in (0, 130, -signal.SIGINT):
            raise DocError(
                f"{running.block.where}: stopped with SIGINT, it exited {process.returncode}\n{running.output()}"
            )

    def stop(self) -> None:
        running, self.background = self.background, None
        if running is not None:
            self._stop(running, check=False)
