"""Replay over REST: ``GET /micro-batches?replay=true`` and ``client.micro_batches(...,
replay=tracedb.Replay(...))`` answer the plan the library makes, the report saying what
replaced what; a use limit is refused (a server writes no step manifests to count from)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

import tracedb
import tracedb.credit
from tracedb import client
from tracedb.api import create_app

from support.servers import in_thread
from support.steps import async_run, ingest_step


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any, list[int]]]:
    """A read-only server over three steps of an asynchronous run (credit set grpo), its app,
    and the watermark after each step (0 first)."""
    root = tmp_path_factory.mktemp("replay-api")
    episodes = async_run()
    marks = [0]
    with tracedb.connect(root / "run.duckdb") as db:
        for step in range(1, 4):
            ingest_step(db, root, episodes, step)
            marks.append(db.watermark())
        tracedb.credit.run(db, "grpo", "grpo")
    app = create_app(root / "run.duckdb")
    with in_thread(app) as base:
        yield base, app, marks


def step_arguments(marks: list[int], **extra: Any) -> dict[str, Any]:
    return {"after": marks[2], "through": marks[3], "complete_groups": 4, "credit": "grpo", **extra}


def test_rest_replay_answers_the_library_plan(served) -> None:
    base, app, marks = served
    replay = tracedb.Replay(priority="signal", seed=7)
    with app.state.backend.reader() as db:
        plan = db.micro_batches(4096, ranks=2, **step_arguments(marks), replay=replay)
    assert plan.report.replayed and plan.report.replay_replaced == len(plan.report.replayed)
    params = {"seq_len": 4096, "ranks": 2, **step_arguments(marks), "replay": "true", "replay_seed": 7}
    with httpx.Client(base_url=base, timeout=60) as http:
        for rank in range(2):
            answer = http.get("/micro-batches", params={**params, "rank": rank})
            assert answer.status_code == 200, answer.text
            report = json.loads(answer.headers["x-tracedb-report"])
            assert report == plan.report.to_dict()
            assert report["replay_unfilled"] == plan.report.replay_unfilled
            assert [(c["replaced"], c["group"]) for c in report["replayed"]] == [
                (c["replaced"], c["group"]) for c in plan.report.replayed
            ]
        plain = http.get("/micro-batches", params={"seq_len": 4096, "ranks": 2, "rank": 0, **step_arguments(marks)})
        assert plain.status_code == 200, plain.text
        assert json.loads(plain.headers["x-tracedb-report"]).get("replayed") in (None, [])
    for rank in range(2):
        batches, report = client.micro_batches(base, 4096, rank=rank, ranks=2, **step_arguments(marks), replay=replay)
        assert report == plan.report.to_dict()
        assert len(batches) == len(plan[rank])
        for got, want in zip(batches, plan[rank], strict=True):
            assert got.tokens.equals(want.tokens)
            assert got.samples.equals(want.samples.cast(got.samples.schema))


def test_rest_replay_takes_uniform_sampling_and_a_staleness_bound(served) -> None:
    base, app, marks = served
    replay = tracedb.Replay(max_staleness=1, priority="uniform", seed=3)
    with app.state.backend.reader() as db:
        plan = db.micro_batches(4096, **step_arguments(marks, policy=3, max_staleness=2), replay=replay)
    tokens, report = client.fetch_micro_batches(
        base, 4096, rank=0, **step_arguments(marks, policy=3, max_staleness=2), replay=replay
    )
    assert report == plan.report.to_dict()
    assert all(c["priority"] is None for c in report["replayed"])
    assert tokens.equals(pa.Table.from_batches([mb.tokens for mb in plan[0]], schema=tokens.schema))


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"replay_seed": 3}, ["replay_seed", "goes with replay=true"]),
        ({"replay_priority": "signal"}, ["replay_priority", "goes with replay=true"]),
        ({"replay": "true", "complete_groups": None}, ["complete_groups"]),
        ({"replay": "true", "replay_priority": "best"}, ["replay_priority"]),
        ({"replay": "true", "replay_seed": -1}, ["replay_seed"]),
        ({"replay": "true", "replay_max_staleness": 1}, ["max_staleness is measured from the step's policy"]),
    ],
)
def test_bad_replay_parameters_are_one_named_422(served, extra: dict[str, Any], words: list[str]) -> None:
    base, _, marks = served
    params = {k: v for k, v in {"seq_len": 4096, "rank": 0, **step_arguments(marks), **extra}.items() if v is not None}
    answer = httpx.get(f"{base}/micro-batches", params=params, timeout=30)
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"]
    assert "\n" not in detail
    for word in words:
        assert word in detail, (word, detail)


def test_the_client_refuses_a_use_limit_in_one_line(served, tmp_path: Path) -> None:
    base, _, marks = served
    for replay in (tracedb.Replay(max_uses=1, steps_root=tmp_path), tracedb.Replay(steps_root=tmp_path)):
        with pytest.raises(ValueError, match="^replay over a server takes no max_uses or steps_root: ") as e:
            client.micro_batches(base, 4096, rank=0, **step_arguments(marks), replay=replay)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="replay is a tracedb.Replay"):
        client.micro_batches(base, 4096, rank=0, **step_arguments(marks), replay={"seed": 1})
