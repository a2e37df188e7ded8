"""A small live run with known rewards, for the run page and the group page.

Six groups of four, ingested file by file (each with a ``step`` tag, the last without):
rewards differ in group-0, are all equal in group-1 (zero variance), are equal among
the scored members of group-2 (one member has no reward: still zero variance), are all
None in group-3, differ in group-4 (whose members arrive at steps 2 and 3) and are all
0 in the untagged group-5. Advantages are the group-relative ones (reward minus the
mean of the group's scored members) on every sampled node; a member without a reward
has none (unassigned). :class:`Expected` holds what each trace was written with, so
tests compute the aggregates from it, not from the code under test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

import tracedb
from tracedb.synthetic import generate_episodes

REWARDS: dict[str, list[float | None]] = {
    "group-0": [1.0, 0.0, 1.0, 0.0],
    "group-1": [1.0, 1.0, 1.0, 1.0],
    "group-2": [0.5, None, 0.5, 0.5],
    "group-3": [None, None, None, None],
    "group-4": [0.2, 0.9, 0.4, 0.7],
    "group-5": [0.0, 0.0, 0.0, 0.0],
}
# (file, groups and members, tags): in ingest order.
FILES: list[tuple[str, list[tuple[str, slice]], list[str]]] = [
    ("step0.jsonl", [("group-0", slice(None)), ("group-1", slice(None))], ["step=0"]),
    ("step1.jsonl", [("group-2", slice(None)), ("group-3", slice(None))], ["step=1"]),
    ("step2.jsonl", [("group-4", slice(0, 2))], ["step=2"]),
    ("step3.jsonl", [("group-4", slice(2, 4))], ["step=3"]),
    ("untagged.jsonl", [("group-5", slice(None))], []),
]
LATE = ("late.jsonl", ["step=4"])
"""One more group, written by :func:`write_late` for tests of a run that goes on."""
LATE_REWARDS = [0.3, 0.3, 0.6, 0.9]


@dataclass
class Expected:
    """What the run was written with, per trace id."""

    reward: dict[str, float | None] = field(default_factory=dict)
    group: dict[str, str] = field(default_factory=dict)
    step: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    sampled: dict[str, int] = field(default_factory=dict)
    advantage: dict[str, float | None] = field(default_factory=dict)


def _episodes(group: str, rewards: list[float | None], seed: int) -> list[dict[str, Any]]:
    episodes = list(
        generate_episodes(
            groups=1,
            group_size=len(rewards),
            tokens_per_trace=420,
            system_tokens=40,
            task_tokens=12,
            turn_tokens=(12, 40),
            compaction_every=200,
            seed=seed,
        )
    )
    scored = [r for r in rewards if r is not None]
    mean = sum(scored) / len(scored) if scored else 0.0
    for episode, reward in zip(episodes, rewards, strict=True):
        episode["group"] = {"id": group}
        trace = episode["traces"][0]
        trace["rewards"] = {} if reward is None else {"resolved": {"score": reward, "weight": 1.0}}
        for node in trace["nodes"]:
            if node["sampled"] and reward is not None:
                node["advantages"] = [reward - mean] * sum(node["mask"])
    return episodes


def _note(expected: Expected, episodes: list[dict[str, Any]], tags: list[str]) -> None:
    step = next((float(t.split("=")[1]) for t in tags if t.startswith("step=")), None)
    for episode in episodes:
        trace = episode["traces"][0]
        tid = trace["id"]
        reward = trace["rewards"]["resolved"]["score"] if trace["rewards"] else None
        expected.reward[tid] = reward
        expected.group[tid] = episode["group"]["id"]
        expected.tokens[tid] = sum(len(n["token_ids"]) for n in trace["nodes"])
        expected.sampled[tid] = sum(sum(n["mask"]) for n in trace["nodes"])
        adv = [n["advantages"][0] for n in trace["nodes"] if n.get("advantages")]
        expected.advantage[tid] = adv[0] if adv else None
        if step is not None:
            expected.step[tid] = step


def _write(path: Path, episodes: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def build(directory: Path) -> tuple[Path, Expected]:
    """The run in ``directory/run.duckdb``, each file ingested in turn."""
    expected = Expected()
    episodes = {g: _episodes(g, r, seed=i) for i, (g, r) in enumerate(REWARDS.items())}
    path = directory / "run.duckdb"
    with tracedb.connect(path) as db:
        for name, parts, tags in FILES:
            chosen = [e for g, members in parts for e in episodes[g][members]]
            db.ingest(_write(directory / name, chosen), tags=tags)
            _note(expected, chosen, tags)
    return path, expected


def write_late(directory: Path, expected: Expected) -> tuple[Path, list[str]]:
    """The late group's file (and its tags), noted in ``expected``: ingest it to move the run on."""
    episodes = _episodes("group-late", LATE_REWARDS, seed=99)
    _note(expected, episodes, LATE[1])
    return _write(directory / LATE[0], episodes), LATE[1]


def write_trainer_logprobs(
    db: tracedb.Database, expected: Expected, *, whole: set[float], first: set[float], seed: int = 17
) -> dict[str, list[np.ndarray]]:
    """A recompute pass written back: ``trainer_logprobs`` (the stored logprobs plus
    N(0, 0.6) noise) on every sampled node of the traces of the steps in ``whole``, on the
    first sampled node of those in ``first``, none elsewhere. Per trace, the log ratios
    (trainer - inference) of its tokens holding both, by numpy."""
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[np.ndarray]] = {}
    rows = []
    for tid, step in sorted(expected.step.items()):
        if step not in whole | first:
            continue
        turns = [(i, n) for i, n in enumerate(db.trace(tid)["nodes"]) if sum(n["mask"])]
        for i, node in turns if step in whole else turns[:1]:
            lp = np.asarray(node["logprobs"], np.float32)
            tr = (lp + rng.normal(0.0, 0.6, size=len(lp))).astype(np.float32)
            rows.append({"trace_id": tid, "node_index": i, "values": tr.tolist()})
            ratios.setdefault(tid, []).append(tr.astype(np.float64) - lp.astype(np.float64))
    db.write_nodes(pa.Table.from_pylist(rows), stream="trainer_logprobs")
    return ratios
