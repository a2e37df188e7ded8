"""``tracedb ingest --follow`` killed with SIGKILL at random moments while a writer appends
verifiers episodes in randomly sized pieces and rotates its file as logrotate's ``create``
mode does (``traces.jsonl.N`` shifted to ``.N+1``, ``traces.jsonl`` renamed to ``.1``, a new
``traces.jsonl``), sometimes writing the rest of a line into the renamed file before it
opens the new one, sometimes rotating twice while no follower runs: restarted each time,
it ends with exactly what an offline ingest of every generation stores (file names,
sequence numbers, positions and clocks aside), and reports no loss. Seeded by
``TRACEDB_FAULT_SEED``."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import tracedb

from support.faults import base_seed, branch_digest
from support.ingested import all_episodes, renamed

DEADLINE = 120.0
SKIPPED = {"ingested_at", "rejected_at", "created_at", "updated_at", "seq", "source"}
NAME = "traces.jsonl"


def follower(path: Path, db: Path) -> tuple[subprocess.Popen[str], list[dict[str, Any]]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracedb", "ingest", str(path), "--db", str(db), "--follow", "--interval", "0.05"]
        + ["--settle", "0", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[dict[str, Any]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"'):
                seen.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return proc, seen


def rotate(run: Path) -> None:
    """Shift ``traces.jsonl.N`` to ``.N+1`` (oldest first), then ``traces.jsonl`` to ``.1``."""
    numbers = sorted((int(p.name.rsplit(".", 1)[1]) for p in run.glob(f"{NAME}.*")), reverse=True)
    for n in numbers:
        os.rename(run / f"{NAME}.{n}", run / f"{NAME}.{n + 1}")
    os.rename(run / NAME, run / f"{NAME}.1")


def writer(
    run: Path, lines: list[bytes], rng: random.Random, done: threading.Event, kills: list[int] | None = None
) -> None:
    """Append the lines in pieces of random size; now and then, at a line's end (or with
    the rest of a line still to come, written to the renamed file), rotate. With ``kills``
    (a counter the test bumps), the second and third thirds wait for the first and second
    kills, so that followers are killed while the file is written however slow the
    machine (bounded waits)."""
    f = open(run / NAME, "ab")
    for i, line in enumerate(lines):
        for need, at_line in ((1, len(lines) // 3), (2, 2 * len(lines) // 3)):
            if kills is not None and i == at_line:
                waited = time.monotonic()
                while kills[0] < need and time.monotonic() - waited < 60:
                    time.sleep(0.02)
        at = 0
        while at < len(line):
            step = rng.choice([1, 50, 2000, 8000, 20000])
            f.write(line[at : at + step])
            f.flush()
            at += step
            if at < len(line) and rng.random() < 0.05:  # renamed while the writer is inside a line
                rotate(run)
                f.write(line[at:])  # it finishes the line in the file it holds, then opens the new one
                f.flush()
                at = len(line)
                f.close()
                f = open(run / NAME, "ab")
            time.sleep(rng.uniform(0, 0.06))
        if rng.random() < 0.12:
            rotate(run)
            f.close()
            f = open(run / NAME, "ab")
    f.close()
    done.set()


def rows(db: tracedb.Database) -> dict[str, list[str]]:
    out = {}
    for table in ("episodes", "traces", "nodes", "segments", "branches", "rejects", "trace_tags", "tracedb_meta"):
        columns = ", ".join(f'"{c}"' for c in db.handle.columns(table) if c not in SKIPPED)
        query = f'SELECT md5(CAST(ROW({columns}) AS VARCHAR)) AS h FROM "{table}" ORDER BY h'
        out[table] = db.sql(query).column("h").to_pylist()
    return out


def test_a_follower_killed_at_random_moments_loses_nothing_to_rotations(tmp_path: Path) -> None:
    seed = base_seed()
    rng = random.Random(seed)
    base = all_episodes()
    lines = [(json.dumps(renamed(base[i % len(base)], f"-r{i}")) + "\n").encode() for i in range(50)]
    for k in rng.sample(range(len(lines)), 2):  # two rejected lines among them
        lines.insert(k, b'{"id": "broken-%d", "traces": [\n' % k)
    good = sum(not line.startswith(b'{"id": "broken') for line in lines) + 1  # and the last one, below
    run = tmp_path / "run"
    run.mkdir()
    (run / NAME).write_bytes(lines.pop(0))
    db_path = tmp_path / "runs.duckdb"
    done = threading.Event()
    counted = [0]
    writing = threading.Thread(target=writer, args=(run, lines, random.Random(seed + 1), done, counted))
    kills = commits = 0
    started = time.monotonic()
    try:
        while not done.is_set() and time.monotonic() - started < DEADLINE:
            proc, seen = follower(run / NAME, db_path)
            while not seen and proc.poll() is None and time.monotonic() - started < DEADLINE:
                time.sleep(0.02)  # started (it takes seconds on a busy machine) and committing
            if not kills:
                writing.start()  # once the first follower holds a position
            time.sleep(rng.uniform(0, 1.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
            counted[0] = kills
            commits += sum("traces" in o for o in seen)
            if rng.random() < 0.3:  # rotations go on while no follower runs
                time.sleep(rng.uniform(0.2, 0.8))
    finally:
        writing.join(DEADLINE)
    assert done.is_set(), "the writer did not finish"

    proc, seen = follower(run / NAME, db_path)
    last = (json.dumps(renamed(base[0], "-last")) + "\n").encode()
    with open(run / NAME, "ab") as f:
        f.write(last)
    expected = good
    try:
        while not any(o.get("watermark") == expected for o in seen if "traces" in o):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() - started < DEADLINE + 30, f"seed {seed}: the last follower did not catch up"
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
    assert code == 0, f"seed {seed}: SIGTERM exit {code}"
    assert kills >= 3 and commits >= kills, (kills, commits)  # every killed follower had committed
    assert not [o for o in seen if o.get("event") == "loss"], f"seed {seed}: {seen}"

    generations = sorted(run.glob(f"{NAME}*"), key=lambda p: -int(p.name.rsplit(".", 1)[1]) if p.name != NAME else 0)
    assert len(generations) >= 3, f"seed {seed}: the writer rotated {len(generations) - 1} times"
    with tracedb.connect(db_path, read_only=True) as followed, tracedb.connect(":memory:") as ref:
        ref.ingest(generations)  # oldest first
        assert followed.watermark() == expected, f"seed {seed}: a trace was numbered twice or lost"
        assert rows(followed) == rows(ref), f"seed {seed}, {kills} kills, {len(generations)} files"
        assert branch_digest(followed) == branch_digest(ref)
        positions = followed.sql('SELECT path, "offset" FROM follow_positions').to_pylist()
        assert {r["path"]: r["offset"] for r in positions if r["path"] == str(run / NAME)} == {
            str(run / NAME): (run / NAME).stat().st_size
        }
