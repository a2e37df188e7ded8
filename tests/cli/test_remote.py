"""Reads through a server: ``tracedb sql / stats / branches --url`` answer as the local
reads do (within the server's limits, said when reached), ``tracedb serve --follow`` owns
the file while readers go through it, and the client (``tracedb.client``) polls, fetches
branch views and a rank's micro-batches equal to the library's."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import client
from tracedb.api import create_app
from tracedb.cli.main import app
from tracedb.synthetic import generate_episodes

from support import FIXTURES
from support.servers import free_port, in_process, in_thread

runner = CliRunner()
DEADLINE_S = 30.0
QUERIES = [
    "SELECT seq, trace_id, group_id, reward, ok, n_tokens FROM traces ORDER BY seq",
    "SELECT trace_id, branch_index, n_tokens, sampled_share FROM branch_stats() ORDER BY ALL",
    "SELECT count(*) AS n, sum(n_sampled) AS sampled FROM nodes",
]


def invoke(*args: object, env: dict[str, str] | None = None):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, env=env)


def sample_lines(groups: int, group_size: int, seed: int) -> bytes:
    episodes = generate_episodes(
        groups=groups, group_size=group_size, tokens_per_trace=1_000, advantages=True, seed=seed
    )
    return b"".join((json.dumps(e, separators=(",", ":")) + "\n").encode() for e in episodes)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("remote")
    (root / "traces.jsonl").write_bytes(sample_lines(3, 4, seed=1))
    path = root / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        db.ingest(root / "traces.jsonl")
    return path


@pytest.fixture(scope="module")
def url(db_path: Path) -> Iterator[str]:
    """``tracedb serve`` read-only with SQL, in another process: local reads share the file."""
    port = free_port()
    command = [sys.executable, "-m", "tracedb", "serve", "--db", str(db_path), "--port", str(port), "--allow-sql"]
    with in_process(command, port, env={"TRACEDB_TOKEN": "", "TRACEDB_URL": ""}) as base:
        yield base


def first_trace(db_path: Path) -> str:
    with tracedb.connect(db_path, read_only=True) as db:
        return db.sql("SELECT trace_id FROM traces WHERE n_branches > 1 ORDER BY seq LIMIT 1").column(0)[0].as_py()


# --------------------------------------------------------------------------- same answers


@pytest.mark.parametrize("query", QUERIES)
@pytest.mark.parametrize("as_json", [True, False])
def test_sql_through_the_server_answers_as_a_local_read(db_path: Path, url: str, query: str, as_json: bool) -> None:
    flags = ["--json"] if as_json else ["--limit", "5"]
    local = invoke("sql", query, "--db", db_path, *flags)
    remote = invoke("sql", query, "--url", url, *flags)
    assert local.exit_code == remote.exit_code == 0, remote.output
    assert remote.stdout == local.stdout
    if not as_json and "ORDER BY seq" in query:  # more rows than --limit: both say so
        assert "5 shown (--limit)" in local.stderr and "more than 5 rows, 5 shown (--limit)" in remote.stderr


def test_stats_through_the_server_answer_as_a_local_read(db_path: Path, url: str) -> None:
    local = json.loads(invoke("stats", "--db", db_path, "--json").stdout)
    remote = invoke("stats", "--url", url, "--json")
    assert remote.exit_code == 0 and json.loads(remote.stdout) == local
    assert local["watermark"] == local["traces"] == 56
    table = invoke("stats", env={"TRACEDB_URL": url})  # the environment names the server too
    assert table.exit_code == 0 and url in table.stdout and "dedup_ratio" in table.stdout


@pytest.mark.parametrize(
    "flags", [[], ["--json"], ["--json", "--tokens"], ["--train-once", "--json", "--tokens"], ["-b", "1", "--json"]]
)
def test_branches_through_the_server_answer_as_a_local_read(db_path: Path, url: str, flags: list[str]) -> None:
    trace_id = first_trace(db_path)
    local = invoke("branches", trace_id, "--db", db_path, *flags)
    remote = invoke("branches", trace_id, "--url", url, *flags)
    assert local.exit_code == remote.exit_code == 0, remote.output
    assert remote.stdout == local.stdout


def test_every_selection_field_reaches_the_server(db_path: Path, url: str) -> None:
    """``poll_traces`` and ``fetch_branches`` take each selection field and answer as
    ``db.traces`` / ``db.branches`` of the same selection do (one id as a string is one id)."""
    with tracedb.connect(db_path, read_only=True) as db:
        rows = db.traces().to_pylist()
        ids = [r["trace_id"] for r in rows[1:4]]
        groups = sorted({r["group_id"] for r in rows if r["group_id"]})[:2]
        cases = [
            {"trace_ids": ids},
            {"trace_ids": ids[0]},
            {"group": groups},
            {"group": groups[0], "after": 3},
            {"episode": rows[2]["episode_id"]},
            {"trace_ids": ids, "through": rows[2]["seq"]},
            {"complete_groups": 4, "after": 0},
        ]
        for case in cases:
            want = db.traces(**case)
            page = client.poll_traces(url, **{"after": 0, **case})
            assert [t["trace_id"] for t in page["traces"]] == want.column("trace_id").to_pylist(), case
            assert page["watermark"] == tracedb.watermark_of(want), case
            table, info = client.fetch_branches(url, **case)
            assert table.equals(db.branches(**case)), case


def test_unknown_trace_and_branch_read_as_locally(db_path: Path, url: str) -> None:
    missing = invoke("branches", "no-such-trace", "--url", url)
    assert missing.exit_code == 1 and f"'no-such-trace' is not in {url}" in missing.stderr
    trace_id = first_trace(db_path)
    no_branch = invoke("branches", trace_id, "--url", url, "-b", "7")
    local = invoke("branches", trace_id, "--db", db_path, "-b", "7")
    assert no_branch.exit_code == local.exit_code == 1 and no_branch.stderr == local.stderr


# --------------------------------------------------------------------------- limits and errors


def test_the_servers_limits_are_said_when_reached(db_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.duckdb"
    copy.write_bytes(db_path.read_bytes())
    small = create_app(copy, allow_sql=True, sql_row_limit=3, sql_max_bytes=200, branch_token_limit=50)
    with in_thread(small) as base:
        rows = invoke("sql", QUERIES[0], "--url", base, "--json")
        assert rows.exit_code == 0 and len(json.loads(rows.stdout)) == 3
        assert "the server stopped there" in rows.stderr and "row limit (3)" in rows.stderr
        wide = invoke("sql", "SELECT repeat('x', 150) AS a FROM range(5)", "--url", base, "--json")
        assert wide.exit_code == 0 and len(json.loads(wide.stdout)) == 1 and "byte budget" in wide.stderr
        mine = invoke("sql", QUERIES[0], "--url", base, "--limit", "2")  # my own --limit is no server limit
        assert mine.exit_code == 0 and "the server stopped" not in mine.stderr and "2 shown" in mine.stderr
        over = invoke("branches", first_trace(db_path), "--url", base)
        assert over.exit_code == 1 and "branch token limit (50)" in over.stderr and "HTTP 422" in over.stderr
    rows = create_app(copy, branch_row_limit=5)  # a branch budget: whole traces, said as the token one is
    with in_thread(rows) as base:
        table, info = client.fetch_branches(base, after=0)
        with tracedb.connect(copy, read_only=True) as db:
            first = db.traces(after=0).column("trace_id").to_pylist()
            counts = {
                r["trace_id"]: r["n"]
                for r in db.sql("SELECT trace_id, count(*) AS n FROM branches GROUP BY 1").to_pylist()
            }
        taken = 0
        while taken < len(first) and sum(counts[t] for t in first[: taken + 1]) <= 5:
            taken += 1
        assert info["truncated"] and info["truncated_by"] == "branches" and info["branch_limit"] == 5
        assert info["n_branches"] == table.num_rows == sum(counts[t] for t in first[:taken]) > 0
        assert table.column("trace_id").unique().to_pylist() == first[:taken]


def test_errors_through_the_server_are_clear(db_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.duckdb"
    copy.write_bytes(db_path.read_bytes())
    with in_thread(create_app(copy)) as base:
        refused = invoke("sql", "SELECT 1", "--url", base)
        assert refused.exit_code == 1 and "HTTP 403" in refused.stderr and "--allow-sql" in refused.stderr
        with pytest.raises(client.ServerError) as raised:
            client.poll_traces(base, -1)
        assert raised.value.status == 422 and raised.value.error == "invalid_request" and "after" in raised.value.detail
        write = invoke("sql", "DELETE FROM traces", "--url", base, "--write")
        assert write.exit_code == 2 and "--write" in write.stderr
    nobody = f"http://127.0.0.1:{free_port()}"
    gone = invoke("stats", "--url", nobody)
    assert gone.exit_code == 1 and f"cannot reach the tracedb server at {nobody}" in gone.stderr
    with pytest.raises(client.ServerUnreachable):
        client.stats(nobody)


# --------------------------------------------------------------------------- serve --follow


def test_serve_follow_owns_the_file_and_readers_go_through_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    path = tmp_path / "runs.duckdb"
    port = free_port()
    command = [
        *(sys.executable, "-m", "tracedb", "serve", "--db", str(path), "--port", str(port)),
        *("--follow", str(run), "--interval", "0.05", "--tag", "step=3"),
    ]
    data = sample_lines(3, 4, seed=5)
    with in_process(command, port, env={"TRACEDB_TOKEN": "", "TRACEDB_URL": ""}) as base:
        half = len(data) // 2
        (run / "traces.jsonl").write_bytes(data[:half])  # a line cut in the middle waits for its end
        seen: list[str] = []
        after = 0
        deadline = time.monotonic() + DEADLINE_S
        while len(seen) < 12:
            assert time.monotonic() < deadline, f"{len(seen)} of 12 traces seen"
            page = client.poll_traces(base, after, wait=2)
            seen += [t["trace_id"] for t in page["traces"]]
            assert all(t["tags"] == {"step": 3} for t in page["traces"])
            after = page["watermark"]
            if len(seen) and half:
                with open(run / "traces.jsonl", "ab") as f:
                    f.write(data[half:])
                half = 0
        assert len(set(seen)) == 12 == len(seen)
        locked = invoke("stats", "--db", path)  # the server owns the file ...
        assert locked.exit_code == 2 and "open for writing in another process" in locked.stderr
        remote = json.loads(invoke("stats", "--url", base, "--json").stdout)  # ... and answers for it
        assert remote["traces"] == remote["watermark"] == 12
        health = client.health(base)
        assert health["follower"]["state"] == "following" and health["follower"]["traces"] == 12
        assert health["writes_enabled"] is False
        plan_remote, report = client.micro_batches(base, 2048, rank=1, ranks=2, complete_groups=4, after=0)
        branches_remote, info = client.fetch_branches(base, after=4, tags={"step": (3, None)})
    with tracedb.connect(path, read_only=True) as db:  # the server stopped: the file is free
        local = json.loads(invoke("stats", "--db", path, "--json").stdout)
        assert {k: v for k, v in remote.items() if k != "bytes"} == {k: v for k, v in local.items() if k != "bytes"}
        plan = db.micro_batches(2048, ranks=2, complete_groups=4, after=0, through=report["watermark"])
        assert report == plan.report.to_dict() and len(plan_remote) == len(plan[1]) > 0
        for got, want in zip(plan_remote, plan[1], strict=True):
            assert got.tokens.equals(want.tokens) and got.samples.equals(want.samples)
        expected = db.branches(after=4, tags={"step": (3, None)})
        assert branches_remote.equals(expected) and info["watermark"] == 12 and not info["truncated"]


def test_serve_follow_rotated_finishes_a_copy_it_names(tmp_path: Path) -> None:
    """``serve --rotated PATTERN`` (repeatable) reaches the follower, as ``ingest --follow
    --rotated`` does: a copytruncate to ``traces.jsonl.bak`` is finished from the copy.
    (``--branch-row-limit`` reaches ``GET /branches``.)"""
    path = tmp_path / "traces.jsonl"
    lines = sample_lines(2, 4, seed=9).splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]))
    port = free_port()
    command = [
        *(sys.executable, "-m", "tracedb", "serve", "--db", str(tmp_path / "runs.duckdb"), "--port", str(port)),
        *("--follow", str(path), "--interval", "2", "--rotated", "{name}.bak", "--rotated", "{stem}.old.*"),
        *("--branch-row-limit", "3"),
    ]
    with in_process(command, port, env={"TRACEDB_TOKEN": "", "TRACEDB_URL": ""}) as base:
        deadline = time.monotonic() + DEADLINE_S
        while client.health(base)["watermark"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with open(path, "ab") as f:  # between two polls (every 2 s): two lines, copied, truncated
            f.write(b"".join(lines[3:5]))
        (tmp_path / "traces.jsonl.bak").write_bytes(path.read_bytes())
        with open(path, "r+b") as f:
            f.truncate(0)
        with open(path, "ab") as f:
            f.write(b"".join(lines[5:]))
        # the watermark moves at the commit, the follower's counters just after it
        while (health := client.health(base))["watermark"] < 8 or health["follower"]["traces"] < 8:
            assert time.monotonic() < deadline, health["follower"]
            time.sleep(0.05)
        table, info = client.fetch_branches(base, after=0)  # one branch a trace: three traces an answer
        assert (table.num_rows, info["branch_limit"], info["truncated_by"]) == (3, 3, "branches")
    status = health["follower"]
    assert status["rotated"] == ["{name}.bak", "{stem}.old.*"]
    assert (status["traces"], status["restarts"], status["lost_bytes"]) == (8, [], 0)
    (rotation,) = status["rotations"]
    assert "traces.jsonl.bak" in rotation


def test_serve_rotated_needs_follow_and_a_pattern_it_can_read(tmp_path: Path) -> None:
    alone = invoke("serve", "--db", tmp_path / "runs.duckdb", "--rotated", "{name}.bak")
    assert alone.exit_code == 2 and "--rotated" in alone.stderr and "--follow" in alone.stderr
    bad = invoke("serve", "--db", tmp_path / "runs.duckdb", "--follow", tmp_path / "run", "--rotated", "{name}.{when}")
    assert bad.exit_code == 2 and "--rotated '{name}.{when}'" in bad.stderr and "{stem}" in bad.stderr
