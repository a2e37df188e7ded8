"""``tracedb ingest --follow`` as a process, through a truncation and a copytruncate: what it
says on stderr and in ``--json`` (restart and loss events as they are found, the final
report), its exit code at SIGTERM, and ``--rotated``. Every wait is bounded."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support.ingested import one_episode, renamed

DEADLINE = 60.0
SMALL = one_episode("empty_tokens")
LARGE = one_episode("subagent_fork")


def lines(n: int, tag: str, base: dict[str, Any]) -> list[bytes]:
    return [(json.dumps(renamed(base, f"-{tag}{i}")) + "\n").encode() for i in range(n)]


class Following:
    """``tracedb ingest PATH --follow --json`` running; its stdout lines collected."""

    def __init__(self, path: Path, db: Path, interval: float = 0.1) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tracedb", "ingest", str(path), "--db", str(db), "--follow", "--json"]
            + ["--interval", str(interval), "--settle", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.out: list[dict[str, Any]] = []
        """The one-line objects: commits and events."""
        self.rest: list[str] = []
        """The lines after them: the final report."""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith('{"') and not self.rest:
                self.out.append(json.loads(line))
            else:
                self.rest.append(line)

    def wait_for(self, watermark: int) -> None:
        started = time.monotonic()
        while not any(o.get("watermark") == watermark for o in self.out if "traces" in o):
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            assert time.monotonic() - started < DEADLINE, f"watermark {watermark} not reached: {self.out}"
            time.sleep(0.05)

    def stop(self) -> tuple[int, dict[str, Any], str]:
        """SIGTERM; the exit code, the final report, stderr."""
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(20)
        stderr = self.proc.stderr.read() if self.proc.stderr else ""
        self.reader.join(10)
        return code, json.loads("".join(self.rest)), stderr


def test_a_follower_process_reports_a_truncate_and_regrow_and_exits_0(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    db = tmp_path / "runs.duckdb"
    # The first line is over 4 KiB: the first bytes' hash alone does not see the cut.
    old, new = lines(1, "first", LARGE) + lines(16, "old", SMALL), lines(4, "new", LARGE)
    path.write_bytes(b"".join(old))
    following = Following(path, db)
    try:
        following.wait_for(17)
        with open(path, "r+b") as f:  # cut back to the first line and grown past the old offset
            f.truncate(len(old[0]))
        with open(path, "ab") as f:
            f.write(b"".join(new))
        following.wait_for(21)
        time.sleep(0.3)  # a few more polls: nothing more may come
    finally:
        code, report, stderr = following.stop()
    assert code == 0, stderr
    assert (report["traces"], report["rejected"], report["lost"]) == (21, 0, [])
    (message,) = report["restarts"]
    assert str(path.absolute()) in message and "read again from its start" in message
    events = [o for o in following.out if "event" in o]
    assert [(e["event"], e["file"]) for e in events] == [("restart", str(path.absolute()))]
    assert "read again from its start" in stderr
    with tracedb.connect(db, read_only=True) as database:
        assert (database.stats()["traces"], database.stats()["rejects"]) == (21, 0)


def test_a_follower_process_says_what_a_copytruncate_lost(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    db = tmp_path / "runs.duckdb"
    first, between, after = lines(5, "a", SMALL), lines(3, "b", SMALL), lines(2, "c", SMALL)
    cut, lost = lines(2, "x", LARGE)
    path.write_bytes(b"".join(first))
    # The next poll begins 2 s after the one that committed the first lines: what follows
    # (microseconds of writes) is done before it, as logrotate does it between two polls.
    following = Following(path, db, interval=2.0)
    try:
        following.wait_for(5)
        with open(path, "ab") as f:
            f.write(b"".join(between) + cut[:1000])  # the copy is made with the writer inside a line
        shutil.copyfile(path, tmp_path / "traces.jsonl.1")
        with open(path, "ab") as f:  # between the copy and the truncation: in neither file
            f.write(cut[1000:] + lost)
        with open(path, "r+b") as f:
            f.truncate(0)
        with open(path, "ab") as f:
            f.write(b"".join(after))
        following.wait_for(10)
        time.sleep(0.3)
    finally:
        code, report, stderr = following.stop()
    assert code == 0, stderr
    assert (report["traces"], report["rejected"], report["restarts"]) == (10, 0, [])
    (loss,) = report["lost"]
    assert (loss["file"], loss["bytes"], loss["lines"]) == (str(path.absolute()), 1000, 1)
    assert (report["lost_bytes"], report["lost_lines"]) == (1000, 1)
    assert "copied to traces.jsonl.1 and truncated" in report["rotations"][0]
    assert "LOST" in stderr and "1000 bytes" in stderr and str(path.absolute()) in stderr
    kinds = [o["event"] for o in following.out if "event" in o]
    assert kinds == ["rotation", "loss"]


runner = CliRunner()


def test_rotated_is_documented_and_a_bad_pattern_refused(tmp_path: Path) -> None:
    result = runner.invoke(app, ["ingest", "--help"], catch_exceptions=False, terminal_width=200)
    assert "--rotated" in result.output and "copytruncate" in result.output
    result = runner.invoke(
        app,
        ["ingest", str(tmp_path), "--db", str(tmp_path / "r.duckdb"), "--follow", "--rotated", "{nope}"],
        catch_exceptions=False,
    )
    assert result.exit_code == 2 and "--rotated '{nope}'" in result.output
