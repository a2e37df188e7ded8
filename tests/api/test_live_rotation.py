"""A server following a run (``create_app(follow=...)``) says in ``/health`` what its
follower found: a rotation followed, and the bytes a copytruncate lost."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx

from tracedb.api import create_app

from support.ingested import one_episode, renamed
from support.servers import in_thread

DEADLINE_S = 30.0


def test_health_shows_a_copytruncate_and_what_it_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = run / "traces.jsonl"
    base = one_episode("subagent_fork")
    first, between, after = (
        [(json.dumps(renamed(base, f"-{t}{i}")) + "\n").encode() for i in range(n)]
        for t, n in (("a", 3), ("b", 2), ("c", 2))
    )
    path.write_bytes(b"".join(first))
    app = create_app(tmp_path / "runs.duckdb", follow=[run], follow_interval=0.05)
    with in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        deadline = time.monotonic() + DEADLINE_S
        while http.get("/health").json()["watermark"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with open(path, "ab") as f:  # two lines and the start of a third, then copied and truncated
            f.write(b"".join(between) + after[0][:800])
        shutil.copyfile(path, run / "traces.jsonl.1")
        with open(path, "r+b") as f:
            f.truncate(0)
        with open(path, "ab") as f:
            f.write(b"".join(after))
        while (health := http.get("/health").json())["watermark"] < 7:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
    status = health["follower"]
    assert (status["traces"], status["rejected"], status["restarts"]) == (7, 0, [])
    (rotation,) = status["rotations"]
    assert "copied to traces.jsonl.1 and truncated" in rotation
    (loss,) = status["lost"]
    assert (loss["file"], loss["bytes"], loss["lines"]) == (str(path), 800, 1) and status["lost_bytes"] == 800
