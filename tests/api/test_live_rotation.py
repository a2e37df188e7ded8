"""A server following a run (``create_app(follow=...)``) says in ``/health`` what its
follower found: a rotation followed, and the bytes a copytruncate lost."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tracedb.api import create_app

from support.ingested import one_episode, renamed
from support.servers import in_thread

DEADLINE_S = 30.0


def three_runs() -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Lines of three, two and two new traces: read first, then between a poll and a
    copytruncate, then after it."""
    base = one_episode("subagent_fork")
    first, between, after = (
        [(json.dumps(renamed(base, f"-{t}{i}")) + "\n").encode() for i in range(n)]
        for t, n in (("a", 3), ("b", 2), ("c", 2))
    )
    return first, between, after


def test_health_shows_a_copytruncate_and_what_it_lost(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = run / "traces.jsonl"
    first, between, after = three_runs()
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
        # the watermark moves at the commit, the follower's counters just after it
        while (health := http.get("/health").json())["watermark"] < 7 or health["follower"]["traces"] < 7:
            assert time.monotonic() < deadline, json.dumps(health["follower"])
            time.sleep(0.05)
    status = health["follower"]
    assert (status["traces"], status["rejected"], status["restarts"]) == (7, 0, [])
    (rotation,) = status["rotations"]
    assert "copied to traces.jsonl.1 and truncated" in rotation
    (loss,) = status["lost"]
    assert (loss["file"], loss["bytes"], loss["lines"]) == (str(path), 800, 1) and status["lost_bytes"] == 800


@pytest.mark.parametrize("rotated", [[], ["{name}.bak"]], ids=["default-names", "rotated-pattern"])
def test_a_rotated_pattern_reaches_the_follower(tmp_path: Path, rotated: list[str]) -> None:
    """``follow_rotated`` (``serve --rotated``) reaches ``Database.follow``: a copytruncate
    to a name only the pattern knows is finished from the copy; without it the file is
    read again from its start, and /health says the lines before the truncation were not
    found in any rotated copy."""
    path = tmp_path / "traces.jsonl"
    first, between, after = three_runs()
    path.write_bytes(b"".join(first))
    # A poll every 2 s: the copy and the truncate below land between two polls.
    app = create_app(tmp_path / "runs.duckdb", follow=[path], follow_interval=2.0, follow_rotated=rotated)
    with in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        deadline = time.monotonic() + DEADLINE_S
        while http.get("/health").json()["watermark"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with open(path, "ab") as f:
            f.write(b"".join(between))
        shutil.copyfile(path, tmp_path / "traces.jsonl.bak")
        with open(path, "r+b") as f:
            f.truncate(0)
        with open(path, "ab") as f:
            f.write(b"".join(after))
        want = 7 if rotated else 5
        while (health := http.get("/health").json())["follower"]["traces"] < want or not (
            health["follower"]["rotations"] or health["follower"]["restarts"]
        ):
            assert time.monotonic() < deadline, json.dumps(health["follower"])
            time.sleep(0.05)
    status = health["follower"]
    assert status["rotated"] == rotated and status["traces"] == want and status["rejected"] == 0
    if rotated:
        (rotation,) = status["rotations"]
        assert "traces.jsonl.bak" in rotation and status["restarts"] == [], status
        assert status["lost"] == [] and status["lost_bytes"] == 0
    else:
        (restart,) = status["restarts"]
        assert "no rotated copy holds its bytes" in restart and status["rotations"] == [], status
