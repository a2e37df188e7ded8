"""Random groups of rollouts for the state-keyed credit tests (``anchor``, ``potential``) and
the plain-loop reference turn table both check against.

The rollouts of a group share the system prompt and the group's task prompt, then draw
their turns and tool outputs from small pools, so different traces reach the same history
(a shared state), reach the same last observation after different histories (a state that
must not merge), fork (nodes shared by branches) and leave compaction attempts that were
never resumed (an untrainable branch that must not own a shared node). Turns carry a
``state_key`` field sometimes (a string, a number, ``"1"`` beside ``1``, a null) and a
per-turn ``reward`` sometimes. Non-node fields come from a real verifiers 0.4.0 record.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import tracedb

from support import FIXTURES

SYSTEM = [101, 102, 103]


def _template() -> tuple[dict[str, Any], dict[str, Any]]:
    episode = json.loads((FIXTURES / "groups.traces.jsonl").read_text().splitlines()[0])
    trace = episode.pop("traces")[0]
    trace.pop("nodes")
    return episode, trace


EPISODE, TRACE = _template()


def node(tokens: list[int], parent: int | None, *, sampled: bool, **fields: Any) -> dict[str, Any]:
    """A message node: sampled ones get a one-token unsampled scaffold then sampled tokens."""
    mask = [False] + [True] * (len(tokens) - 1) if sampled else [False] * len(tokens)
    out: dict[str, Any] = {
        "semantic_parents": [],
        "message": {"role": "assistant" if sampled else "tool", "content": "x"},
        "sampled": sampled,
        "token_ids": list(tokens),
        "mask": mask,
        "is_content": [],
        "logprobs": [-0.5] * sum(mask),
        **fields,
    }
    if parent is not None:
        out["parent"] = parent
    return out


def _turn_fields(rng: random.Random) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    roll = rng.random()
    if roll < 0.3:
        fields["state_key"] = rng.choice(["s0", "s1", 1, "1", 2.5])
    elif roll < 0.4:
        fields["state_key"] = None
    if rng.random() < 0.5:
        fields["reward"] = rng.choice([None, 0.5, -1.0, 2, 0.25])
    return fields


def random_nodes(rng: random.Random, prompt: list[int]) -> list[dict[str, Any]]:
    """System, task prompt, then turns and tool outputs from small pools, forks and
    compaction attempts (leaves that nothing resumes)."""
    actions = [[7, 1], [7, 2], [7, 3, 3]]
    outputs = [[8, 1], [8, 2]]
    nodes = [node(SYSTEM, None, sampled=False), node(prompt, 0, sampled=False)]

    def chain(parent: int, length: int) -> None:
        for _ in range(length):
            nodes.append(node(rng.choice(actions), parent, sampled=True, **_turn_fields(rng)))
            if rng.random() < 0.2:  # a compaction attempt off this turn, never resumed
                attempt = node([9, rng.randint(0, 2)], len(nodes) - 1, sampled=True, **_turn_fields(rng))
                attempt["semantic_parents"] = [{"node": len(nodes) - 1, "type": "compaction_attempt"}]
                nodes.append(attempt)
                nodes.append(node(rng.choice(outputs), len(nodes) - 2, sampled=False))
            else:
                nodes.append(node(rng.choice(outputs), len(nodes) - 1, sampled=False))
            parent = len(nodes) - 1

    chain(1, rng.randint(1, 4))
    for _ in range(rng.choice([0, 0, 1, 2])):  # forks from any earlier node
        chain(rng.randrange(len(nodes)), rng.randint(1, 2))
    return nodes


def episode_of(trace_id: str, group: str | None, nodes: list[dict], reward: float | None, **trace: Any) -> dict:
    """One episode holding one trace with these nodes and this outcome reward."""
    t = copy.deepcopy(TRACE)
    t["id"] = trace_id
    t["ok"], t["is_timeout"] = trace.pop("ok", True), trace.pop("is_timeout", False)
    t["rewards"] = {} if reward is None else {"r": {"score": reward, "weight": 1.0}}
    t["nodes"] = nodes
    if "task" in trace:
        t["task"] = copy.deepcopy(t["task"])
        t["task"]["data"]["idx"] = trace.pop("task")
    t.update(trace)
    ep = copy.deepcopy(EPISODE)
    ep["id"] = "e-" + trace_id
    if group is None:
        ep.pop("group", None)
    else:
        ep["group"] = {"id": group}
    ep["traces"] = [t]
    return ep


def make_episodes(
    seed: int, *, n_groups: int = 5, sizes: tuple[int, int] = (1, 6), invalid: float = 0.15, prefix: str = ""
) -> list[dict[str, Any]]:
    """Random groups (one in ten traces without a group: its own group); ``task`` g."""
    rng = random.Random(seed)
    episodes = []
    for g in range(n_groups):
        prompt = [200 + g, 201]
        for t in range(rng.randint(*sizes)):
            flags: dict[str, Any] = {}
            reward: float | None = rng.choice([0.0, 0.5, 1.0, 2.0])
            roll = rng.random()
            if roll < invalid / 3:
                flags["ok"] = False
            elif roll < 2 * invalid / 3:
                flags["is_timeout"] = True
            elif roll < invalid:
                reward = None
            group = None if rng.random() < 0.1 else f"{prefix}g{g}"
            tid = f"{prefix}s{seed}-g{g}-t{t}"
            episodes.append(episode_of(tid, group, random_nodes(rng, prompt), reward, task=g, **flags))
    return episodes


def write(path: Path, episodes: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def ingest(tmp_path: Path, episodes: list[dict[str, Any]], db: tracedb.Database | None = None, **kw: Any):
    """Ingest ``episodes`` (into ``db`` when given, else a new in-memory database)."""
    db = db or tracedb.connect(":memory:")
    report = db.ingest(write(tmp_path / f"{len(list(tmp_path.iterdir()))}.traces.jsonl", episodes), **kw)
    assert report.ok, report.rejected
    return db


# --------------------------------------------------------------------------- reference


def reward_of(trace: dict[str, Any]) -> float | None:
    scored = [r for r in (trace.get("rewards") or {}).values() if r.get("score") is not None]
    return sum(r["score"] * r["weight"] for r in scored) if scored else None


def is_valid(trace: dict[str, Any], include_failed: bool = False) -> bool:
    if reward_of(trace) is None:
        return False
    return include_failed or (trace["ok"] and not trace["is_timeout"])


def group_of(episode: dict[str, Any], trace: dict[str, Any]) -> str:
    group = (episode.get("group") or {}).get("id")
    return group if group is not None else "trace:" + trace["id"]


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def state_key(nodes: list[dict[str, Any]], i: int, key_field: str | None) -> tuple:
    """The turn's key: its field (as JSON text), else the token lists of its ancestors."""
    if key_field == "role":
        return ("field", nodes[i]["message"]["role"])
    if key_field is not None and nodes[i].get(key_field) is not None:
        return ("field", json.dumps(nodes[i][key_field]))
    history = []
    parent = nodes[i].get("parent")
    while parent is not None:
        history.append(tuple(nodes[parent]["token_ids"]))
        parent = nodes[parent].get("parent")
    return ("history", tuple(reversed(history)))


@dataclass
class Turn:
    trace_id: str
    node: int
    group: str
    key: tuple
    R: float
    r: float  # per-turn reward, the outcome added on the owning branch's last turn
    G: float  # return along the owning branch
    next_key: tuple | None  # the next turn's key on the owning branch


def reference_turns(
    episodes: list[dict[str, Any]],
    *,
    gamma: float = 1.0,
    reward_field: str | None = None,
    key_field: str | None = "state_key",
    include_failed: bool = False,
) -> list[Turn]:
    """One Turn per turn node of every valid trace, branch by branch with loops."""
    out = []
    for ep in episodes:
        for trace in ep["traces"]:
            if not is_valid(trace, include_failed):
                continue
            nodes, R = trace["nodes"], reward_of(trace)
            parents = [n.get("parent") for n in nodes]
            resumed = {s["node"] for n in nodes for s in n["semantic_parents"] if s["type"] == "compaction"}
            branches = []
            for leaf in [i for i in range(len(nodes)) if i not in parents]:
                path, i = [], leaf
                while i is not None:
                    path.insert(0, i)
                    i = parents[i]
                attempt = any(s["type"] == "compaction_attempt" for s in nodes[leaf]["semantic_parents"])
                branches.append((not attempt or leaf in resumed, [i for i in path if sum(nodes[i]["mask"])]))
            owner: dict[int, list[int]] = {}
            for prefer in (True, False):
                for trainable, turns in branches:
                    if trainable == prefer:
                        for i in turns:
                            owner.setdefault(i, turns)
            for i, turns in sorted(owner.items()):
                t = turns.index(i)
                rs = [_num(nodes[j].get(reward_field)) if reward_field else 0.0 for j in turns]
                rs[-1] += R
                g = 0.0
                for j in reversed(range(t, len(turns))):
                    g = rs[j] + gamma * g
                following = state_key(nodes, turns[t + 1], key_field) if t + 1 < len(turns) else None
                out.append(
                    Turn(trace["id"], i, group_of(ep, trace), state_key(nodes, i, key_field), R, rs[t], g, following)
                )
    return out


def group_rewards(episodes: list[dict[str, Any]], include_failed: bool = False) -> dict[str, list[float]]:
    """Group -> the outcome rewards of its valid traces."""
    out: dict[str, list[float]] = {}
    for ep in episodes:
        for trace in ep["traces"]:
            if is_valid(trace, include_failed):
                out.setdefault(group_of(ep, trace), []).append(reward_of(trace))
    return out


def result(table: Any) -> dict[tuple[str, int], float]:
    """(trace id, node) -> the node's value, checking it is one constant over its tokens."""
    out = {}
    for row in table.to_pylist():
        values = row["values"]
        assert values and all(x == values[0] for x in values), row
        out[(row["trace_id"], row["node_index"])] = values[0]
    return out


def assert_close(got: dict, want: dict) -> None:
    """The same nodes, and values equal to float32 precision."""
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key


def stored(db: tracedb.Database, credit_set: str) -> dict[tuple[str, int], float]:
    """(trace id, node) -> value, as a stamped set reads back (assigned nodes only)."""
    return result(
        db.sql(
            'SELECT trace_id, node_index, advantages AS "values" FROM credit_advantages(?) '
            "WHERE advantages IS NOT NULL",
            [credit_set],
        )
    )
