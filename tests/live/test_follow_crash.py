"""``tracedb ingest --follow`` killed with SIGKILL at random moments while a writer appends
verifiers episodes in randomly sized pieces (cutting lines anywhere) and new files appear:
restarted each time, it ends with exactly what an offline ingest of the final files
stores (sequence numbers, positions and clocks aside): nothing lost, nothing twice.
Then SIGTERM stops it cleanly (exit 0). Seeded by ``TRACEDB_FAULT_SEED``."""

from __future__ import annotations

import json
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
SKIPPED = {"ingested_at", "rejected_at", "created_at", "updated_at", "seq"}


def follower(run: Path, db: Path) -> tuple[subprocess.Popen[str], list[dict[str, Any]]]:
    """Start ``tracedb ingest --follow --json``; its commit lines are collected as they come."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracedb", "ingest", str(run), "--db", str(db), "--follow", "--interval", "0.05"]
        + ["--settle", "0", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    commits: list[dict[str, Any]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith('{"traces"'):
                commits.append(json.loads(line))

    threading.Thread(target=read, daemon=True).start()
    return proc, commits


def writer(run: Path, lines: list[tuple[str, bytes]], rng: random.Random, done: threading.Event) -> None:
    """Append each file's lines in pieces of random size, a little at a time."""
    data: dict[str, bytes] = {}
    for name, line in lines:
        data[name] = data.get(name, b"") + line
    at = dict.fromkeys(data, 0)
    while any(at[n] < len(data[n]) for n in data):
        name = rng.choice([n for n in data if at[n] < len(data[n])])
        path = run / name
        path.parent.mkdir(parents=True, exist_ok=True)
        step = rng.choice([1, 50, 2000, 8000, 20000])
        with open(path, "ab") as f:
            f.write(data[name][at[name] : at[name] + step])
        at[name] += step
        time.sleep(rng.uniform(0, 0.08))  # ~8 s of writing in all
    done.set()


def rows(db: tracedb.Database) -> dict[str, list[str]]:
    out = {}
    for table in ("episodes", "traces", "nodes", "segments", "branches", "rejects", "trace_tags", "tracedb_meta"):
        columns = ", ".join(f'"{c}"' for c in db.handle.columns(table) if c not in SKIPPED)
        query = f'SELECT md5(CAST(ROW({columns}) AS VARCHAR)) AS h FROM "{table}" ORDER BY h'
        out[table] = db.sql(query).column("h").to_pylist()
    return out


def test_a_follower_killed_at_random_moments_ends_with_an_offline_ingests_data(tmp_path: Path) -> None:
    seed = base_seed()
    rng = random.Random(seed)
    base = all_episodes()
    episodes = [renamed(base[i % len(base)], f"-c{i}") for i in range(90)]
    names = ["traces.jsonl", "a/traces.jsonl", "b/deeper/traces.jsonl"]
    lines = [(rng.choice(names), (json.dumps(e) + "\n").encode()) for e in episodes]
    bad_at = rng.sample(range(len(lines)), 2)
    for k in bad_at:  # two rejected lines among them
        lines.insert(k, (lines[k][0], b'{"id": "broken-%d", "traces": [\n' % k))
    run = tmp_path / "run"
    run.mkdir()
    db_path = tmp_path / "runs.duckdb"
    done = threading.Event()
    writing = threading.Thread(target=writer, args=(run, lines, random.Random(seed + 1), done))
    writing.start()
    kills = 0
    started = time.monotonic()
    try:
        while not done.is_set() and time.monotonic() - started < DEADLINE:
            proc, _ = follower(run, db_path)
            time.sleep(rng.uniform(0.3, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills += 1
    finally:
        writing.join(DEADLINE)
    assert done.is_set(), "the writer did not finish"

    # The last one runs until it has everything. The killed ones may have taken it all
    # already, so one more episode is written while it runs: its commit is always awaited.
    proc, commits = follower(run, db_path)
    episodes.append(renamed(base[0], "-last"))
    lines.append((names[0], (json.dumps(episodes[-1]) + "\n").encode()))
    with open(run / names[0], "ab") as f:
        f.write(lines[-1][1])
    try:
        while True:
            if commits and commits[-1]["watermark"] == len(episodes):
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() - started < DEADLINE, f"seed {seed}: the last follower did not catch up: {commits}"
            time.sleep(0.05)
        time.sleep(0.3)  # one more poll: nothing more may come
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
    assert code == 0, f"seed {seed}: SIGTERM exit {code}"
    assert kills >= 3

    with tracedb.connect(db_path, read_only=True) as followed, tracedb.connect(":memory:") as ref:
        ref.ingest(sorted({run / name for name, _ in lines}))
        assert followed.watermark() == len(episodes), f"seed {seed}: a trace was numbered twice or lost"
        assert rows(followed) == rows(ref), f"seed {seed}, {kills} kills"
        assert branch_digest(followed) == branch_digest(ref)
        seqs = followed.sql("SELECT seq FROM traces ORDER BY seq").column("seq").to_pylist()
        assert seqs == list(range(1, len(episodes) + 1))
        sizes = {p: (run / p).stat().st_size for p in names if (run / p).exists()}
        positions = {
            str(Path(r["path"]).relative_to(run)): (r["offset"], r["line"])
            for r in followed.sql('SELECT path, "offset", line FROM follow_positions').to_pylist()
        }
        assert {p: o for p, (o, _) in positions.items()} == sizes
