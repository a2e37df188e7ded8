"""An asynchronous run's rollouts step by step, and what the tests check a step against:
the groups of a store as SQL states them, independently of the replay code."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import tracedb
from tracedb.synthetic import generate_episodes, versioned


def async_run(seed: int = 3, groups: int = 24, steps: int = 8, **kwargs: Any) -> list[dict[str, Any]]:
    """Versioned rollouts: groups of 4 dispatched 3 per step over ``steps`` steps, some stale,
    a quarter zero-variance (``tracedb.synthetic.versioned``)."""
    eps = generate_episodes(
        groups=groups,
        group_size=4,
        tokens_per_trace=1_200,
        system_tokens=100,
        task_tokens=40,
        turn_tokens=(20, 90),
        compaction_every=900,
        advantages=True,
        seed=seed,
    )
    options = {"step": steps, "groups_per_step": 3, "stale_share": 0.2, "seed": seed, **kwargs}
    return list(versioned(eps, **options))


def write_jsonl(path: Path, episodes: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def ingest_step(db: tracedb.Database, tmp: Path, episodes: list[dict[str, Any]], step: int, **options: Any) -> None:
    """Ingest the groups dispatched at ``step`` (``options``: ``db.ingest``'s)."""
    todo = [e for e in episodes if e["run"]["work"]["step"] == step]
    assert db.ingest(write_jsonl(tmp / f"step{step}.jsonl", todo), **options).ok


def packed_traces(plan: tracedb.Plan) -> set[str]:
    return {t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}


def groups_at(db: tracedb.Database, mark: int, credit: str = "default") -> dict[str, dict[str, Any]]:
    """Every group as of ``mark`` (dropped and eval traces left out): members, the newest
    member's sequence number, reward spread, the oldest policy version, and mean |A| over
    the sampled tokens of its nodes the credit set assigns (``node_credit()``)."""
    rows = db.sql(
        "WITH t AS (SELECT * FROM traces WHERE seq <= $mark AND dropped IS NULL "
        "           AND work_type IS DISTINCT FROM 'eval' AND group_id IS NOT NULL), "
        "c AS (SELECT trace_id, sum(advantage_abs_sum) AS abs_sum, sum(n_sampled) AS tokens "
        "      FROM node_credit(credit := $credit) WHERE assigned AND n_sampled > 0 GROUP BY trace_id) "
        "SELECT t.group_id, list(t.trace_id ORDER BY t.trace_id) AS traces, max(t.seq) AS done, "
        "count(t.reward) AS scored, min(t.reward) AS lo, max(t.reward) AS hi, stddev_pop(t.reward) AS std, "
        "min(t.policy_min) AS oldest, sum(c.abs_sum) / sum(c.tokens) AS mean_abs "
        "FROM t LEFT JOIN c USING (trace_id) GROUP BY t.group_id",
        params={"mark": mark, "credit": credit},
    ).to_pylist()
    return {r["group_id"]: r for r in rows}


def loss_versions_by_trace(plan: tracedb.Plan) -> dict[str, np.ndarray]:
    """Per packed trace, the policy versions of its loss tokens (known ones)."""
    out: dict[str, list[np.ndarray]] = {}
    for rank in plan:
        for mb in rank:
            if "policy_version" not in mb.tokens.schema.names:
                continue
            loss = mb.tokens.column("loss_mask").to_numpy(zero_copy_only=False)
            column = mb.tokens.column("policy_version")
            known = column.is_valid().to_numpy(zero_copy_only=False)
            values = column.fill_null(-1).to_numpy(zero_copy_only=False)
            for tid, spans in zip(
                mb.samples.column("trace_id").to_pylist(), mb.samples.column("spans").to_pylist(), strict=True
            ):
                for span in spans:
                    at = slice(span["start"], span["start"] + span["length"])
                    keep = loss[at] & known[at]
                    out.setdefault(tid, []).append(values[at][keep].astype(np.int64))
    return {t: np.concatenate(v) for t, v in out.items()}
