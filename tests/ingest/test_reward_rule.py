"""A trace's reward has one rule (tracedb.records.trace_reward): the weighted sum of the
scores present, None when none is scored; a record whose rewards the model refuses is
rejected at ingest, on either parse path, never given a reward."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import tracedb
from tracedb import runtime
from tracedb.records import Trace, trace_reward

from support import FIXTURES

TEMPLATE = json.loads((FIXTURES / "linear.traces.jsonl").read_text().splitlines()[0])


def _line(rewards: Any, trace_id: str) -> str:
    episode = json.loads(json.dumps(TEMPLATE))
    episode["id"] = f"ep-{trace_id}"
    episode["traces"][0]["id"] = trace_id
    episode["traces"][0]["rewards"] = rewards
    return json.dumps(episode)


ACCEPTED = [
    ({"a": {"score": 1, "weight": 2}, "b": {"score": 0.5}}, 2.5),
    ({"a": None, "b": {"score": -1.0, "weight": 0.5}}, -0.5),
    ({"a": None}, None),
    ({}, None),
    (None, None),
]
REFUSED = [
    ({"a": {"weight": 1.0}}, "rewards.a.score"),
    ({"a": {"score": None}}, "rewards.a.score"),
    ({"a": {"score": "1"}}, "rewards.a.score"),
    ({"a": {"score": 1, "weight": None}}, "rewards.a.weight"),
    ({"a": "x"}, "rewards.a"),
    ([1, 2], "rewards"),
]


@pytest.mark.parametrize("scanner", ["auto", "never"])
def test_stored_reward_follows_the_one_rule(tmp_path: Path, scanner: str) -> None:
    lines = [_line(r, f"ok{i}") for i, (r, _) in enumerate(ACCEPTED)]
    lines += [_line(r, f"bad{i}") for i, (r, _) in enumerate(REFUSED)]
    path = tmp_path / "rewards.traces.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with runtime.configure(scanner=scanner), tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        stored = {r["trace_id"]: r["reward"] for r in db.sql("SELECT trace_id, reward FROM traces").to_pylist()}
        for i, (rewards, expected) in enumerate(ACCEPTED):
            record = db.trace(f"ok{i}")
            assert stored[f"ok{i}"] == expected == trace_reward(rewards) == Trace.model_validate(record).reward
    rejected = {r.trace_id: r for r in report.rejected}
    assert sorted(rejected) == sorted(f"bad{i}" for i in range(len(REFUSED)))
    for i, (_, field) in enumerate(REFUSED):
        assert rejected[f"bad{i}"].field == field and rejected[f"bad{i}"].line == len(ACCEPTED) + i + 1
