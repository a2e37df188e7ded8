"""Replay reads the store once per step and keeps those rows per database for its write
generation and credit set (``tracedb.batches.pool``): a later step reads only the traces
above the last watermark, and any write drops what was kept. Checked against a fresh
process-level read of the same file (the database closed and opened again)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

import tracedb
import tracedb.credit
from tracedb.batches import replay
from tracedb.selection import Selection

from support.steps import async_run, ingest_step, write_jsonl


@pytest.fixture(scope="module")
def episodes() -> list[dict[str, Any]]:
    return async_run()


def _steps(db: tracedb.Database, tmp: Path, episodes: list[dict[str, Any]], steps: int) -> list[int]:
    marks = [db.watermark()]
    for step in range(1, steps + 1):
        ingest_step(db, tmp, episodes, step)
        marks.append(db.watermark())
    return marks


def _choices(db: tracedb.Database, marks: list[int], step: int, credit: str | None = None) -> list[dict[str, Any]]:
    return db.micro_batches(
        4096,
        complete_groups=4,
        after=marks[step - 1],
        through=marks[step],
        credit=credit,
        replay=tracedb.Replay(seed=5),
    ).report.replayed


def test_steps_read_in_any_order_choose_as_a_fresh_read(episodes, tmp_path):
    """Steps packed forwards, backwards and again on one open database choose as each step
    does on a database just opened (nothing kept)."""
    path = tmp_path / "run.duckdb"
    with tracedb.connect(path) as db:
        marks = _steps(db, tmp_path, episodes, 8)
    fresh = {}
    for step in range(2, 9):
        with tracedb.connect(path, read_only=True) as db:
            fresh[step] = _choices(db, marks, step)
    assert any(fresh.values()), "some step replaces a zero-variance group"
    with tracedb.connect(path, read_only=True) as db:
        for step in [*range(2, 9), *range(8, 1, -1), 5, 8, 3]:
            assert _choices(db, marks, step) == fresh[step], step


def test_a_credit_rewrite_between_steps_is_read(episodes, tmp_path):
    """The priorities come from the credit set as it is now: rewriting the set (replace)
    after a step drops the kept rows, so the next call ranks by the new credit, as a fresh
    open of the file does."""
    path = tmp_path / "run.duckdb"
    with tracedb.connect(path) as db:
        marks = _steps(db, tmp_path, episodes, 8)
        tracedb.credit.run(db, "grpo", "c")
        before = _choices(db, marks, 8, "c")
        tracedb.credit.run(db, "grpo", "c", replace=True, scale_std=True)
        after = _choices(db, marks, 8, "c")
    with tracedb.connect(path, read_only=True) as db:
        fresh = _choices(db, marks, 8, "c")
    assert before and after == fresh
    assert [c["priority"] for c in before] != [c["priority"] for c in fresh], "the rewrite changed the priorities"


def test_a_policy_mapping_between_steps_is_read(episodes, tmp_path):
    """Labels mapped after a step move the traces' policy bounds: the next bounded replay
    holds the groups to them, as a fresh open does (kept rows would hold the old, unknown,
    bounds and keep every group a candidate)."""
    renamed = copy.deepcopy(episodes)
    for ep in renamed:
        for trace in ep["traces"]:
            for node in trace["nodes"]:
                for span in node.get("weight_versions") or ():
                    span["version"] = span["version"].replace("step_", "ckpt-")
    path = tmp_path / "run.duckdb"
    replay = tracedb.Replay(max_staleness=2, seed=5)
    bound = {"policy": 8, "max_staleness": 1, "unknown": "keep", "complete_groups": 4}
    with tracedb.connect(path) as db:
        marks = _steps(db, tmp_path, renamed, 8)
        unmapped = db.micro_batches(4096, after=marks[7], replay=replay, **bound).report
        labels = db.sql("SELECT DISTINCT s.version AS v FROM nodes, unnest(weight_versions) AS u(s)").column("v")
        db.set_policy_versions({label: int(label.removeprefix("ckpt-")) for label in labels.to_pylist()})
        mapped = db.micro_batches(4096, after=marks[7], replay=replay, **bound).report
    with tracedb.connect(path, read_only=True) as db:
        fresh = db.micro_batches(4096, after=marks[7], replay=replay, **bound).report
    assert (mapped.replayed, mapped.replay_candidates) == (fresh.replayed, fresh.replay_candidates)
    assert unmapped.replay_candidates > mapped.replay_candidates, "the mapping made some earlier groups stale"


def test_replayed_groups_hold_the_training_members_the_selection_takes(tmp_path):
    """With dropped traces and tag filters, each replayed group holds exactly the members
    the selection's own resolution gives it (``replay.members``, asked of the store in
    SQL): its dropped traces and those the tags leave out (a quarter of every group's
    members is tagged ``run=b``) are not replayed."""
    path = tmp_path / "run.duckdb"
    run = async_run(dropped_share=0.25)
    with tracedb.connect(path) as db:
        marks = [0]
        for step in range(1, 9):
            todo = [e for e in run if e["run"]["work"]["step"] == step]
            rank: dict[str, int] = {}
            for tag in ("a", "b"):
                part = []
                for ep in todo:
                    k = rank.setdefault(ep["id"], sum(1 for e in todo[: todo.index(ep)] if e["group"] == ep["group"]))
                    if (tag == "b") == (k % 4 == 3):
                        part.append(ep)
                assert db.ingest(write_jsonl(tmp_path / f"s{step}{tag}.jsonl", part), tags=[f"run={tag}"]).ok
            marks.append(db.watermark())
        chosen = Selection(tags={"run": "a"}, complete_groups=4).for_training()
        seen = dropped = 0
        for step in (5, 7, 8):
            plan = db.micro_batches(
                4096, complete_groups=4, after=marks[step - 1], tags={"run": "a"}, replay=tracedb.Replay(seed=2)
            )
            mark = plan.report.watermark
            for choice in plan.report.replayed:
                want = replay.members(db.handle.con, [choice["group"]], chosen, mark)
                assert choice["traces"] == want, (step, choice["group"])
                everyone = db.sql(
                    "SELECT trace_id, dropped FROM traces WHERE group_id = ? AND seq <= ?", [choice["group"], mark]
                ).to_pylist()
                dropped += sum(1 for r in everyone if r["dropped"] is not None)
                seen += 1
                tagged_b = db.sql(
                    "SELECT count(*) AS n FROM traces JOIN trace_tags USING (trace_id) WHERE group_id = ? "
                    "AND name = 'run' AND text = 'b'",
                    [choice["group"]],
                ).to_pylist()[0]["n"]
                assert tagged_b and len(want) <= len(everyone) - tagged_b
    assert seen and dropped, "some replayed group had a dropped member, left out"
