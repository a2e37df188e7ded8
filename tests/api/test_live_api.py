"""A live run over REST: a server that follows a run while a writer appends, pollers that
page with ``after=`` and long-poll with ``wait=``, the branch views and one rank's
micro-batches of a selection, ``/stats``, the follower in ``/health`` (and a failing one),
and bad parameters named. Every server is real (uvicorn on 127.0.0.1), started and stopped
by the test."""

from __future__ import annotations

import io
import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

import tracedb
from tracedb import client
from tracedb.api import create_app
from tracedb.batches import write_step
from tracedb.synthetic import generate_episodes

from support import FIXTURES
from support.servers import in_thread

ARROW = "application/vnd.apache.arrow.stream"
DEADLINE_S = 30.0


def episode_lines(groups: int, group_size: int, *, seed: int, shuffle: bool = False) -> list[bytes]:
    """Sample episodes as ``traces.jsonl`` lines (one trace each), groups interleaved when
    ``shuffle``."""
    lines = [
        (json.dumps(e, separators=(",", ":")) + "\n").encode()
        for e in generate_episodes(
            groups=groups, group_size=group_size, tokens_per_trace=1_200, advantages=True, seed=seed
        )
    ]
    if shuffle:
        random.Random(seed).shuffle(lines)
    return lines


def trace_ids(lines: list[bytes]) -> list[str]:
    return [t["id"] for line in lines for t in json.loads(line)["traces"]]


def arrow(response: httpx.Response) -> pa.Table:
    assert response.status_code == 200, response.text
    with ipc.open_stream(io.BytesIO(response.content)) as reader:
        return reader.read_all()


def error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) >= {"error", "detail"}
    for word in words:
        assert word in body["detail"], (word, body["detail"])
    return body


def append_slowly(path: Path, lines: list[bytes], seed: int, pause: float = 0.01) -> None:
    """Append ``lines`` in randomly sized chunks that cut lines anywhere."""
    data = b"".join(lines)
    rng = random.Random(seed)
    at = 0
    with open(path, "ab") as f:
        while at < len(data):
            step = rng.randint(1, max(2, len(data) // 12))
            f.write(data[at : at + step])
            f.flush()
            at += step
            time.sleep(rng.random() * pause)


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    """A read-only server over the fixtures and sample groups, and its app."""
    root = tmp_path_factory.mktemp("live-static")
    (root / "traces.jsonl").write_bytes(b"".join(episode_lines(6, 4, seed=3, shuffle=True)))
    path = root / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        db.ingest(root / "traces.jsonl", tags=["step=$.task.data.idx", "run=a"])
    app = create_app(path, branch_token_limit=20_000)
    with in_thread(app) as base:
        yield base, app


@pytest.fixture
def follower(tmp_path: Path) -> Iterator[tuple[str, Any, Path]]:
    """A server that follows the directory ``run`` (empty at first) into a new database."""
    run = tmp_path / "run"
    run.mkdir()
    app = create_app(tmp_path / "runs.duckdb", follow=[run], follow_interval=0.05)
    with in_thread(app) as base:
        yield base, app, run


# --------------------------------------------------------------------------- following


def test_a_poller_sees_every_trace_once_while_the_server_follows_a_run(follower) -> None:
    base, app, run = follower
    first = episode_lines(6, 4, seed=1, shuffle=True)
    second = episode_lines(3, 4, seed=2)
    expected = trace_ids(first) + trace_ids(second)
    group_size = 4
    # The second file's groups share ids with the first's: they complete (once) in the first.
    expected_groups = sorted({json.loads(line)["group"]["id"] for line in first + second})

    def write() -> None:
        append_slowly(run / "traces.jsonl", first, seed=5)
        (run / "later").mkdir()
        append_slowly(run / "later" / "traces.jsonl", second, seed=6)  # a file that appears mid-run

    writer = threading.Thread(target=write)
    writer.start()
    seen: list[tuple[int, str]] = []
    groups: list[str] = []
    after = groups_after = 0
    deadline = time.monotonic() + DEADLINE_S
    with httpx.Client(base_url=base, timeout=30) as http:
        while len(seen) < len(expected) or len(groups) < len(expected_groups):
            assert time.monotonic() < deadline, f"saw {len(seen)} of {len(expected)} traces, {len(groups)} groups"
            page = http.get("/traces", params={"after": after, "wait": 1, "limit": 5}).json()
            assert page["watermark"] >= after
            seen += [(t["seq"], t["trace_id"]) for t in page["traces"]]
            after = page["watermark"]
            complete = http.get("/traces", params={"after": groups_after, "complete_groups": group_size}).json()
            groups += sorted({t["group_id"] for t in complete["traces"]})
            groups_after = complete["watermark"]
        writer.join()
        health = http.get("/health").json()
    assert sorted(t for _, t in seen) == sorted(expected)  # every trace, once
    assert [s for s, _ in seen] == sorted(s for s, _ in seen) == list(range(1, len(expected) + 1))
    assert sorted(groups) == expected_groups  # every group once, when complete
    status = health["follower"]
    assert status["state"] == "following" and status["files"] == 2
    assert status["traces"] == status["lines"] == len(expected) and status["rejected"] == 0
    assert status["watermark"] == health["watermark"] == len(expected) and status["last_error"] is None


def test_a_long_poll_answers_as_soon_as_a_trace_arrives(follower) -> None:
    base, _, run = follower
    lines = episode_lines(1, 2, seed=9)
    with httpx.Client(base_url=base, timeout=30) as http:
        started = time.monotonic()
        empty = http.get("/traces", params={"after": 0, "wait": 0.6})
        took = time.monotonic() - started
        assert empty.status_code == 200 and empty.json() == {"watermark": 0, "more": False, "traces": []}
        assert empty.headers["x-tracedb-watermark"] == "0"
        assert 0.55 <= took < 2.0, took  # waited its time, then answered empty

        answers: list[tuple[float, dict[str, Any]]] = []

        def poll() -> None:
            with httpx.Client(base_url=base, timeout=30) as c:
                body = c.get("/traces", params={"after": 0, "wait": 20}).json()
                answers.append((time.monotonic(), body))

        pollers = [threading.Thread(target=poll) for _ in range(10)]  # more than 8 at once
        for p in pollers:
            p.start()
        time.sleep(0.5)
        started = time.monotonic()  # the long-polls hold no worker thread: others are served meanwhile
        assert http.get("/health").status_code == 200 and http.get("/traces", params={"limit": 1}).status_code == 200
        assert time.monotonic() - started < 1.0
        written = time.monotonic()
        (run / "traces.jsonl").write_bytes(lines[0])
        for p in pollers:
            p.join(timeout=20)
        assert len(answers) == 10
        for at, body in answers:
            assert at - written < 2.0, at - written  # the follower's commit wakes every waiter
            assert [t["trace_id"] for t in body["traces"]] == trace_ids(lines[:1]) and body["watermark"] == 1


def test_a_failing_follower_is_reported_and_the_server_goes_on(follower) -> None:
    base, app, run = follower
    live = app.state.backend.follower
    poll = live.follower.poll

    def broken() -> None:
        raise OSError("disk on fire")

    live.follower.poll = broken
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            deadline = time.monotonic() + DEADLINE_S
            while (status := http.get("/health").json()["follower"])["state"] != "failing":
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert status["errors"] >= 1 and status["last_error"] == "OSError: disk on fire"
            assert status["last_error_at"] is not None
            assert http.get("/traces", params={"after": 0}).json()["traces"] == []  # still serving
            live.follower.poll = poll
            (run / "traces.jsonl").write_bytes(b"".join(episode_lines(1, 2, seed=4)))
            body = http.get("/traces", params={"after": 0, "wait": 10}).json()  # retried within ~1 s
            assert len(body["traces"]) == 2
            assert http.get("/health").json()["follower"]["state"] == "following"
    finally:
        live.follower.poll = poll


def test_a_follower_server_with_sql_ingests(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "traces.jsonl").write_bytes(b"".join(episode_lines(1, 2, seed=8)))
    app = create_app(tmp_path / "runs.duckdb", follow=[tmp_path / "run"], follow_interval=0.05, allow_sql=True)
    with in_thread(app) as base:
        body = httpx.get(f"{base}/traces", params={"after": 0, "wait": 5}, timeout=30).json()
        assert len(body["traces"]) == 2, httpx.get(f"{base}/health").json()["follower"]["last_error"]


def test_close_stops_the_follower(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    app = create_app(tmp_path / "runs.duckdb", follow=[tmp_path / "run"], follow_interval=0.05)
    live = app.state.backend.follower
    assert live.running
    started = time.monotonic()
    app.state.backend.close()
    assert not live.running and time.monotonic() - started < 5
    with tracedb.connect(tmp_path / "runs.duckdb") as db:  # the file is free again
        assert db.stats()["traces"] == 0


def test_a_follower_server_refuses_read_only_and_bad_tags(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="read-only"):
        create_app(tmp_path / "a.duckdb", follow=[tmp_path], read_only=True)
    with pytest.raises(ValueError, match="--tag"):
        create_app(tmp_path / "b.duckdb", follow=[tmp_path], follow_tags=["no equals sign"])


# --------------------------------------------------------------------------- reads


def test_live_listing_pages_in_arrival_order(static) -> None:
    base, app = static
    with app.state.backend.reader() as db:
        listing = db.traces().to_pylist()
    with httpx.Client(base_url=base, timeout=30) as http:
        rows, after, calls = [], 0, 0
        while True:
            page = http.get("/traces", params={"after": after, "limit": 7}).json()
            rows += page["traces"]
            after, calls = page["watermark"], calls + 1
            if not page["more"]:
                break
        assert [r["trace_id"] for r in rows] == [r["trace_id"] for r in listing] and calls == -(-len(listing) // 7)
        tagged = http.get("/traces", params={"tag": ["run=a", "step=0..1"]}).json()["traces"]
        assert tagged and all(t["tags"]["run"] == "a" and 0 <= t["tags"]["step"] <= 1 for t in tagged)
        with app.state.backend.reader() as db:
            assert [t["trace_id"] for t in tagged] == db.traces(tags={"run": "a", "step": (0, 1)}).column(
                "trace_id"
            ).to_pylist()
        legacy = http.get("/traces", params={"limit": 3}).json()  # without the live parameters: as before
        assert set(legacy) == {"traces", "next_cursor"} and "seq" not in legacy["traces"][0]


def test_branches_of_a_selection_equal_the_library_and_page_at_the_token_limit(static) -> None:
    base, app = static
    with app.state.backend.reader() as db:
        whole = db.branches(after=10, credit=None)
    with httpx.Client(base_url=base, timeout=30) as http:
        parts, after = [], 10
        while True:
            response = http.get("/branches", params={"after": after}, headers={"Accept": ARROW})
            table = arrow(response)
            assert int(response.headers["x-tracedb-tokens"]) <= 20_000
            parts.append(table)
            after = int(response.headers["x-tracedb-watermark"])
            assert tracedb.watermark_of(table) == after
            if response.headers["x-tracedb-truncated"] == "no":
                break
        assert len(parts) > 1  # the limit was reached and said
        got = pa.concat_tables([t.replace_schema_metadata(None) for t in parts]).sort_by(
            [("trace_id", "ascending"), ("branch_index", "ascending")]
        )
        assert got.equals(whole.replace_schema_metadata(None))
        body = http.get("/branches", params={"after": 10}).json()
        assert body["truncated"] and "branch token limit (20000" in body["truncated_why"]
        assert body["tokens"] <= body["token_limit"] == 20_000
        first = whole.column("trace_id")[0].as_py()
        one = http.get("/branches", params={"trace_id": first, "fields": "token_ids"}).json()
        assert one["branches"][0]["token_ids"] == whole.column("token_ids")[0].as_py()
        assert set(one["branches"][0]) == {"trace_id", "branch_index", "trainable", "token_ids"}


def test_a_trace_over_the_token_limit_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
    app = create_app(path, branch_token_limit=10)
    with in_thread(app) as base:
        error(httpx.get(f"{base}/branches", timeout=30), 422, "branch token limit (10)", "--branch-token-limit")


def test_per_trace_branch_routes_take_the_selection(static) -> None:
    base, app = static
    with app.state.backend.reader() as db:
        first, last = db.traces().column("trace_id")[0].as_py(), db.traces().column("trace_id")[-1].as_py()
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get(f"/traces/{first}/branches", params={"after": 5}).json()["branches"] == []
        assert http.get(f"/traces/{last}/branches", params={"after": 5}).json()["branches"]
        error(http.get(f"/traces/{first}/branches/0", params={"after": 5}), 404, "not in the selection")
        assert http.get(f"/traces/{last}/branches/0", params={"after": 5}).status_code == 200


@pytest.mark.parametrize("share", [False, True])
def test_micro_batches_over_rest_equal_the_library(static, tmp_path: Path, share: bool) -> None:
    base, app = static
    arguments = {"seq_len": 4096, "ranks": 2, "after": 20, "complete_groups": 4, "share_prefixes": share}
    with app.state.backend.reader() as db:
        plan = db.micro_batches(4096, ranks=2, after=20, complete_groups=4, share_prefixes=share)
    step = tmp_path / "step"
    write_step(plan, step)
    with httpx.Client(base_url=base, timeout=60) as http:
        for rank in range(2):
            tokens = http.get("/micro-batches", params={**arguments, "rank": rank})
            samples = http.get("/micro-batches", params={**arguments, "rank": rank, "part": "samples"})
            report = json.loads(tokens.headers["x-tracedb-report"])
            assert report == plan.report.to_dict() and report["samples"] > 0
            assert tokens.headers["x-tracedb-watermark"] == str(plan.report.watermark)
            assert tokens.headers["x-tracedb-micro-batches"] == str(len(plan[rank]))
            got = arrow(tokens).to_batches()
            assert len(got) == len(plan[rank]) and all(a.equals(b.tokens) for a, b in zip(got, plan[rank]))
            with ipc.open_file(step / f"rank_{rank}.samples.arrow") as reader:
                assert arrow(samples).equals(reader.read_all())  # the layout tracedb pack writes
            with ipc.open_file(step / f"rank_{rank}.arrow") as reader:
                assert reader.schema.equals(got[0].schema)


def test_importance_weights_over_rest_and_the_client_equal_the_library(static) -> None:
    """``importance`` and ``clip`` reach ``db.micro_batches`` from the route and from the
    client's pass-through options; the fixtures hold trainer_logprobs to weight."""
    from tracedb import client

    base, app = static
    with app.state.backend.reader() as db:
        plan = db.micro_batches(2048, ranks=2, importance="tis", clip=1.5)
    assert plan.report.importance_tokens > 0 and plan.report.importance_defaulted > 0
    params = {"seq_len": 2048, "ranks": 2, "importance": "tis", "clip": 1.5}
    with httpx.Client(base_url=base, timeout=60) as http:
        for rank in range(2):
            tokens = http.get("/micro-batches", params={**params, "rank": rank})
            assert json.loads(tokens.headers["x-tracedb-report"]) == plan.report.to_dict()
            got = arrow(tokens).to_batches()
            assert all(a.equals(b.tokens) for a, b in zip(got, plan[rank], strict=True))
            assert "importance_weight" in got[0].schema.names
            batches, report = client.micro_batches(base, 2048, rank=rank, ranks=2, importance="tis", clip=1.5)
            assert report == plan.report.to_dict()
            assert all(a.tokens.equals(b.tokens) for a, b in zip(batches, plan[rank], strict=True))


def test_two_calls_with_the_same_through_answer_the_same_plan(follower) -> None:
    base, app, run = follower
    (run / "traces.jsonl").write_bytes(b"".join(episode_lines(2, 4, seed=11)))
    with httpx.Client(base_url=base, timeout=60) as http:
        assert len(http.get("/traces", params={"after": 7, "wait": 20}).json()["traces"]) == 1
        params = {"seq_len": 2048, "ranks": 2, "rank": 1, "through": 8}
        before = http.get("/micro-batches", params=params)
        with open(run / "traces.jsonl", "ab") as f:
            f.write(b"".join(episode_lines(2, 4, seed=12)))
        assert http.get("/traces", params={"after": 8, "wait": 20}).json()["traces"]
        after = http.get("/micro-batches", params=params)
        assert (
            after.content == before.content and after.headers["x-tracedb-report"] == before.headers["x-tracedb-report"]
        )
        assert http.get("/micro-batches", params={**params, "through": None}).content != before.content
    backend = app.state.backend
    assert backend.plans.hits >= 1


def test_stats_equal_the_library(static) -> None:
    base, app = static
    with app.state.backend.reader() as db:
        expected = db.stats()
    assert httpx.get(f"{base}/stats", timeout=30).json() == json.loads(json.dumps(expected))


def test_concurrent_long_polls_and_reads_get_no_error(static) -> None:
    base, _ = static

    def poll(_: int) -> int:
        with httpx.Client(base_url=base, timeout=30) as c:
            return c.get("/traces", params={"after": 10_000, "wait": 1}).status_code

    with ThreadPoolExecutor(12) as pool:
        assert set(pool.map(poll, range(12))) == {200}


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("/traces?after=-1", ["after"]),
        ("/traces?after=abc", ["after"]),
        ("/traces?wait=61", ["wait"]),
        ("/traces?wait=nan", ["wait"]),
        ("/traces?complete_groups=0", ["complete_groups"]),
        ("/traces?through=-3", ["through"]),
        ("/traces?tag=nope", ["tag", "name=value"]),
        ("/traces?tag=a=1&tag=a=2", ["tag", "twice"]),
        ("/traces?tag=a=1..x", ["tag", "both numbers or both strings"]),
        ("/traces?after=0&sort=reward", ["sort", "arrival order"]),
        ("/traces?after=0&cursor=abc", ["cursor"]),
        ("/traces?after=0&min_reward=1", ["min_reward"]),
        ("/branches?after=x", ["after"]),
        ("/branches?fields=bogus", ["fields"]),
        ("/branches?branch_index=-1", ["branch_index"]),
        ("/micro-batches", ["seq_len"]),
        ("/micro-batches?seq_len=64", ["rank"]),  # required: leaving it off never silently answers rank 0
        ("/micro-batches?seq_len=0&rank=0", ["seq_len"]),
        ("/micro-batches?seq_len=64&ranks=2&rank=2", ["rank", "0-1"]),
        ("/micro-batches?seq_len=64&rank=0&part=both", ["part"]),
        ("/micro-batches?seq_len=64&rank=0&overflow=error", ["seq_len 64", "overflow"]),
        ("/micro-batches?seq_len=64&rank=0&share_prefixes=true&train_once=false", ["share_prefixes", "train_once"]),
        ("/micro-batches?seq_len=64&rank=0&cost_linear=-1", ["cost_linear"]),
        ("/micro-batches?seq_len=64&rank=0&importance=is", ["importance", "tis"]),
        ("/micro-batches?seq_len=64&rank=0&importance=tis&clip=0", ["clip"]),
        ("/micro-batches?seq_len=64&rank=0&importance=tis&clip=nan", ["clip"]),
        ("/micro-batches?seq_len=64&rank=0&clip=2", ["clip", "needs importance"]),
    ],
)
def test_bad_parameters_are_named(static, url: str, words: list[str]) -> None:
    base, _ = static
    error(httpx.get(base + url, timeout=30), 422, *words)


def test_unknown_credit_set_is_404(static) -> None:
    base, _ = static
    error(
        httpx.get(f"{base}/micro-batches", params={"seq_len": 64, "rank": 0, "credit": "nope"}, timeout=30), 404, "nope"
    )
    error(httpx.get(f"{base}/branches", params={"credit": "nope"}, timeout=30), 404, "nope")


def test_the_client_asks_for_a_rank(static) -> None:
    base, _ = static
    with pytest.raises(TypeError, match="rank"):
        client.micro_batches(base, 64)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="rank"):
        client.fetch_micro_batches(base, 64)  # type: ignore[call-arg]
