"""An asynchronous trainer's feed: staleness bounds per group (prime-rl's rule, or masked
tokens), dropped traces and eval episodes out of training outputs by default, unknown
versions refused unless told, a fixed number of groups per step, every refusal one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tracedb
from tracedb.synthetic import generate_episodes, versioned

from support import FIXTURES_041


def _write(path: Path, episodes: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def _run(seed: int = 3, groups: int = 12, **kwargs) -> list[dict]:
    eps = generate_episodes(
        groups=groups,
        group_size=4,
        tokens_per_trace=1_500,
        system_tokens=100,
        task_tokens=40,
        turn_tokens=(20, 90),
        compaction_every=900,
        advantages=True,
        seed=seed,
    )
    return list(versioned(eps, step=4, groups_per_step=3, stale_share=0.3, seed=seed, **kwargs))


def _loss_versions(plan: tracedb.Plan) -> np.ndarray:
    out = [np.zeros(0, np.int64)]
    for rank in plan:
        for mb in rank:
            t = mb.tokens
            if "policy_version" not in t.schema.names:
                continue
            loss = t.column("loss_mask").to_numpy(zero_copy_only=False)
            v = t.column("policy_version")
            known = v.is_valid().to_numpy(zero_copy_only=False)
            values = v.fill_null(-1).to_numpy(zero_copy_only=False)
            out.append(values[loss & known].astype(np.int64))
    return np.concatenate(out)


@pytest.mark.parametrize("stale", ["drop", "mask"])
def test_a_trainer_loop_never_trains_on_a_token_older_than_its_bound(tmp_path, stale):
    """Groups arrive step by step (ingested in dispatch order); each step packs the groups
    completed since the last one with policy=step, max_staleness=1: no loss token is older
    than step - 1, and every fresh group is trained on exactly once."""
    episodes = _run()
    k = 1
    after = 0
    trained: set[str] = set()
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in range(1, 5):
            todo = [e for e in episodes if e["run"]["work"]["step"] == step]
            db.ingest(_write(tmp_path / f"step{step}.jsonl", todo))
            plan = db.micro_batches(4096, complete_groups=4, after=after, policy=step, max_staleness=k, stale=stale)
            ages = step - _loss_versions(plan)
            assert (ages <= k).all(), (step, ages.max())
            report = plan.report
            assert report.policy == step and report.staleness_bound == step - k
            if stale == "drop":
                assert report.stale_tokens == 0
            else:
                assert report.stale_traces == 0 or report.stale_tokens > 0
            packed = {tid for rank in plan for mb in rank for tid in mb.samples.column("trace_id").to_pylist()}
            assert not packed & trained
            trained |= packed
            if report.off_policy_max is not None:
                assert report.off_policy_max <= k or stale == "mask"
            after = report.watermark
        assert after == db.watermark()


def test_stale_groups_are_left_out_whole_and_counted(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", _run()))
        groups = db.sql(
            "SELECT group_id, min(policy_min) AS low, count(*) AS n FROM traces GROUP BY group_id"
        ).to_pylist()
        stale = [g for g in groups if g["low"] is not None and g["low"] < 3]
        plan = db.micro_batches(4096, policy=4, max_staleness=1)
        assert plan.report.stale_groups == len(stale) and plan.report.stale_traces == sum(g["n"] for g in stale)
        packed = {t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}
        fresh_groups = [g["group_id"] for g in groups if g not in stale]
        fresh = set(db.traces(group=fresh_groups).column("trace_id").to_pylist())
        assert packed == fresh
        lows = db.sql("SELECT policy_min FROM traces WHERE policy_min IS NOT NULL").column(0).to_pylist()
        ages = [4 - low for low in lows]
        assert plan.report.off_policy_level == pytest.approx(
            np.mean([a for a in ages if a <= 1])
        ) and plan.report.off_policy_max == max(a for a in ages if a <= 1)


def test_dropped_and_eval_traces_stay_out_of_training_by_default(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        dropped = set(db.sql("SELECT trace_id FROM traces WHERE dropped IS NOT NULL").column(0).to_pylist())
        evals = set(
            db.sql("SELECT t.trace_id FROM traces t JOIN episodes e USING (episode_id) WHERE e.work_type = 'eval'")
            .column(0)
            .to_pylist()
        )
        assert dropped and evals
        every = set(db.sql("SELECT trace_id FROM traces").column(0).to_pylist())
        db.create_credit_set("flat", layout="trace")  # every trace scored, so every branch is a sample
        db.write_traces([{"trace_id": t, "value": 0.5} for t in every], credit="flat")

        def packed(plan):
            return {t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}

        plan = db.micro_batches(4096, trainable=None, credit="flat")
        assert not packed(plan) & (dropped | evals) and packed(plan) == every - dropped - evals
        assert plan.report.dropped == len(dropped) and plan.report.eval == len(evals - dropped)
        both = db.micro_batches(4096, trainable=None, credit="flat", include_dropped=True, include_eval=True)
        assert packed(both) == every
        # analysis outputs keep them
        assert set(db.branches().column("trace_id").to_pylist()) == every
        listing = db.traces().to_pylist()
        assert {r["trace_id"] for r in listing if r["dropped"]} == dropped
        assert {r["trace_id"] for r in listing if r["work_type"] == "eval"} == evals


def test_unknown_versions_are_refused_under_a_bound_unless_told(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(FIXTURES_041 / "labels.traces.jsonl")
        unknown = db.sql("SELECT trace_id FROM traces WHERE policy_unknown > 0").column(0).to_pylist()
        assert unknown
        with pytest.raises(ValueError, match="unknown policy version.*set_policy_versions"):
            db.micro_batches(4096, policy=12, max_staleness=100)
        kept = db.micro_batches(4096, policy=12, max_staleness=100, unknown="keep", trainable=None)
        dropped = db.micro_batches(4096, policy=12, max_staleness=100, unknown="drop", trainable=None)
        assert dropped.report.unknown_dropped == len(unknown) and dropped.report.branches == 0
        assert kept.report.unknown_dropped == 0 and kept.report.branches > 0


def test_max_groups_takes_the_oldest_and_the_rest_next_time(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", _run()))
        seen: list[str] = []
        after = 0
        for _ in range(20):
            plan = db.micro_batches(4096, complete_groups=4, after=after, max_groups=5, trainable=None)
            groups = {
                g
                for rank in plan
                for mb in rank
                for g in db.traces(trace_ids=mb.samples.column("trace_id").to_pylist()).column("group_id").to_pylist()
            }
            assert len(groups) <= 5
            seen += sorted(groups)
            if plan.report.watermark == after:
                break
            after = plan.report.watermark
        assert sorted(seen) == sorted(set(seen)) and len(seen) == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"policy": 3}, "policy needs max_staleness"),
        ({"max_staleness": 1}, "max_staleness needs policy"),
        ({"policy": 3, "max_staleness": -1}, "max_staleness is a number"),
        ({"policy": 3, "max_staleness": 1, "stale": "keep"}, "stale is one of"),
        ({"policy": 3, "max_staleness": 1, "unknown": "ignore"}, "unknown is one of"),
        ({"stale": "mask"}, "give policy and max_staleness"),
        ({"max_groups": 0}, "max_groups is a number of groups"),
        ({"include_dropped": "yes"}, "include_dropped is True or False"),
        ({"policy": "3", "max_staleness": 1}, "policy is a policy version"),
    ],
)
def test_bad_parameters_are_one_clear_line(kwargs, message):
    with tracedb.connect(":memory:") as db:
        db.ingest(FIXTURES_041 / "one_span.traces.jsonl")
        with pytest.raises(ValueError, match=message):
            db.micro_batches(4096, **kwargs)
        with pytest.raises(ValueError, match=message):
            db.branches(**kwargs)


def test_group_credit_leaves_dropped_and_eval_traces_out_of_the_mean(tmp_path):
    """verifiers' own rule: a dropped trace is out of reward means, like a failed rollout."""
    import tracedb.credit

    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(FIXTURES_041 / "dropped_group.traces.jsonl")
        rows = db.sql("SELECT trace_id, group_id, reward, dropped FROM traces").to_pylist()
        tracedb.credit.run(db, "grpo", "grpo")
        values = {
            r["trace_id"]: r["value"]
            for r in db.sql("SELECT trace_id, value FROM trace_credit WHERE credit_set = 'grpo'").to_pylist()
        }
        for row in rows:
            if row["dropped"]:
                assert row["trace_id"] not in values  # unassigned: None, not zero
        kept = [r for r in rows if not r["dropped"] and r["reward"] is not None]
        mean = sum(r["reward"] for r in kept) / len(kept)
        for r in kept:
            assert values[r["trace_id"]] == pytest.approx(r["reward"] - mean, abs=1e-6)
        tracedb.credit.run(db, "grpo", "grpo-all", include_dropped=True)
        assert db.sql("SELECT count(*) AS n FROM trace_credit WHERE credit_set = 'grpo-all'").column(0)[
            0
        ].as_py() == len([r for r in rows if r["reward"] is not None])
