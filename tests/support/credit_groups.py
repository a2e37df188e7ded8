"""Random groups of verifiers v1 rollouts for the credit tests, and the plain-loop helpers
their references share (rewards, validity, grpo, token keys, reading results).

The rollouts of a group draw their message tokens from a small pool, so they share exact
prefixes, fork, share nodes between a trace's branches and hold identical siblings. Each
node may carry a weight field ``w`` (a number, 0, null, a non-numeric string, or absent),
``loss_weights`` named ``think`` (zeros on some tokens) and ``rl``; assistant nodes may call
tools (``read_skill``, ``bash``; verifiers' flat ``name`` or the OpenAI ``function.name``).
Traces score up to three named rewards (``resolved``, ``skill_ok``, ``judge``), any of them
missing; a share of them failed, timed out or unscored. Non-node fields are copied from a
real verifiers 0.4.0 record.
"""

from __future__ import annotations

import copy
import json
import math
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import tracedb

from support import FIXTURES

_FIXTURE = FIXTURES / "groups.traces.jsonl"


def _template() -> tuple[dict[str, Any], dict[str, Any]]:
    episode = json.loads(_FIXTURE.read_text().splitlines()[0])
    trace = episode.pop("traces")[0]
    trace.pop("nodes")
    return episode, trace


EPISODE, TRACE = _template()
SYSTEM = [101, 102, 103, 104]
TOOLS = ("read_skill", "bash")
REWARDS = ("resolved", "skill_ok", "judge")


def _weight(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.5:
        return round(rng.uniform(0.0, 3.0), 3)
    if roll < 0.6:
        return 0
    if roll < 0.7:
        return None
    if roll < 0.75:
        return "n/a"
    if roll < 0.8:
        return rng.randint(0, 4)
    return ...  # absent


def _node(rng: random.Random, parent: int | None, tokens: list[int], weights: float) -> dict[str, Any]:
    n = len(tokens)
    sampled = n > 0 and rng.random() < 0.6
    if not sampled:
        mask = [False] * n
    elif rng.random() < 0.6:
        k = rng.randint(0, n)
        mask = [False] * (n - k) + [True] * k
    else:
        mask = [rng.random() < 0.6 for _ in range(n)]
    k = sum(mask)
    message: dict[str, Any] = {"role": "assistant" if sampled else rng.choice(["user", "tool"]), "content": "."}
    tool = rng.random() if sampled else 1.0
    if tool < 0.45:
        name = TOOLS[0] if tool < 0.25 else TOOLS[1]
        call = (
            {"id": "c0", "type": "function", "name": name, "arguments": "{}"}
            if rng.random() < 0.7
            else {"id": "c0", "type": "function", "function": {"name": name, "arguments": "{}"}}
        )
        message["tool_calls"] = [call]
    node: dict[str, Any] = {
        "semantic_parents": [],
        "message": message,
        "sampled": sampled,
        "token_ids": tokens,
        "mask": mask,
        "is_content": [],
        "logprobs": [round(rng.uniform(-4.0, 0.0), 4) for _ in range(k)],
    }
    if parent is not None:
        node["parent"] = parent
    if rng.random() < weights:
        w = _weight(rng)
        if w is not ...:
            node["w"] = w
    streams = {}
    if "tool_calls" not in message and rng.random() < 0.6:
        streams["think"] = [rng.choice([0.0, 0.0, 0.5, 1.0]) for _ in range(n)]
    if rng.random() < 0.4:
        streams["rl"] = [round(rng.uniform(0.0, 2.0), 3) for _ in range(n)]
    if streams:
        node["loss_weights"] = streams
    return node


def forest(
    rng: random.Random, pool: list[list[int]], node: Callable[[int | None, list[int]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """A trace's nodes over pool segments: a main chain from the system prompt, sometimes
    forks and a second root; ``node(parent, tokens)`` makes each node."""
    nodes: list[dict[str, Any]] = []

    def chain(parent: int | None, length: int) -> None:
        for _ in range(length):
            nodes.append(node(parent, list(rng.choice(pool))))
            parent = len(nodes) - 1

    nodes.append(node(None, list(SYSTEM) if rng.random() < 0.85 else list(rng.choice(pool))))
    chain(0, rng.randint(0, 4))
    for _ in range(rng.choice([0, 0, 1, 2])):
        chain(rng.randrange(len(nodes)), rng.randint(1, 2))
    if rng.random() < 0.15:
        nodes.append(node(None, list(rng.choice(pool))))
        chain(len(nodes) - 1, rng.randint(0, 2))
    return nodes


def leaf_paths(nodes: list[dict[str, Any]]) -> list[list[int]]:
    """Root-to-leaf node paths, one per leaf in node order."""
    parents = {n.get("parent") for n in nodes}
    paths = []
    for leaf in range(len(nodes)):
        if leaf in parents:
            continue
        path, at = [], leaf
        while at is not None:
            path.append(at)
            at = nodes[at].get("parent")
        paths.append(path[::-1])
    return paths


def _rewards(rng: random.Random, values: tuple[float, ...], scored: bool) -> Any:
    if not scored:
        return None if rng.random() < 0.5 else {}
    out = {}
    for name in REWARDS:
        if name == "resolved" or rng.random() < 0.8:
            out[name] = {"score": rng.choice(values), "weight": rng.choice([0.5, 1.0])}
    return out


def make_episodes(
    seed: int,
    *,
    n_groups: int = 4,
    sizes: tuple[int, int] = (1, 6),
    rewards: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0),
    invalid: float = 0.2,
    weights: float = 0.8,
) -> list[dict[str, Any]]:
    """One trace per episode; ``weights`` is the share of nodes that write ``w`` at all."""
    rng = random.Random(seed)
    episodes = []
    for g in range(n_groups):
        pool = [[rng.randint(0, 6) for _ in range(rng.choice([0, 1, 2, 3, 4]))] for _ in range(rng.randint(2, 3))]
        grouped = rng.random() < 0.9
        for t in range(rng.randint(*sizes)):
            trace = copy.deepcopy(TRACE)
            trace["id"] = f"s{seed}-g{g}-t{t}"
            kind = rng.random()
            trace["ok"], trace["is_timeout"] = True, False
            if kind < invalid / 3:
                trace["ok"] = False
            elif kind < 2 * invalid / 3:
                trace["is_timeout"] = True
            trace["rewards"] = _rewards(rng, rewards, scored=not (2 * invalid / 3 <= kind < invalid))
            trace["nodes"] = forest(rng, pool, lambda parent, tokens: _node(rng, parent, tokens, weights))
            episode = copy.deepcopy(EPISODE)
            episode["id"] = f"e-{trace['id']}"
            if grouped:
                episode["group"] = {"id": f"s{seed}-group-{g}"}
            else:
                episode.pop("group", None)
            episode["traces"] = [trace]
            episodes.append(episode)
    return episodes


def ingest(tmp_path: Path, episodes: list[dict[str, Any]]) -> tracedb.Database:
    path = tmp_path / f"{len(list(tmp_path.iterdir()))}.traces.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    db = tracedb.connect(":memory:")
    report = db.ingest(path)
    assert report.ok, report.rejected
    return db


def all_traces(episodes: list[dict[str, Any]]) -> list[tuple[str | None, dict[str, Any]]]:
    return [((e.get("group") or {}).get("id"), t) for e in episodes for t in e["traces"]]


# --------------------------------------------------------------------------- references


def reward_of(trace: dict[str, Any], name: str | None = None) -> float | None:
    """The weighted sum of the scored rewards (``name`` None) or that reward's score."""
    rewards = trace.get("rewards") or {}
    if name is not None:
        return (rewards.get(name) or {}).get("score")
    scored = [r for r in rewards.values() if r.get("score") is not None]
    return sum(r["score"] * r["weight"] for r in scored) if scored else None


def is_valid(trace: dict[str, Any], name: str | None = None, include_failed: bool = False) -> bool:
    if reward_of(trace, name) is None:
        return False
    return include_failed or (trace["ok"] and not trace["is_timeout"])


def groups_of(
    episodes: list[dict[str, Any]], name: str | None = None, include_failed: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """The valid traces by group (a trace without a group is its own)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for group, trace in all_traces(episodes):
        if is_valid(trace, name, include_failed):
            groups[group if group is not None else "trace:" + trace["id"]].append(trace)
    return groups


def reference_grpo(
    episodes: list[dict[str, Any]],
    name: str | None = None,
    *,
    scale_std: bool = False,
    eps: float = 1e-6,
    include_failed: bool = False,
) -> dict[str, float]:
    """Trace id -> GRPO advantage of reward ``name``, one group at a time."""
    out = {}
    for traces in groups_of(episodes, name, include_failed).values():
        r = [reward_of(t, name) for t in traces]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1)) if len(r) > 1 else 0.0
        for t, x in zip(traces, r):
            a = 0.0 if min(r) == max(r) else x - mean
            out[t["id"]] = a / (std + eps) if scale_std else a
    return out


def n_sampled(node: dict[str, Any]) -> int:
    return sum(node["mask"])


def key_path(nodes: list[dict[str, Any]], i: int) -> tuple[tuple[int, ...], ...]:
    """The node's trie key: the token tuples from its root down to it."""
    path = []
    while i is not None:
        path.append(tuple(nodes[i]["token_ids"]))
        i = nodes[i].get("parent")
    return tuple(reversed(path))


def as_dict(table) -> dict[tuple[str, int], list[float]]:
    return {(r["trace_id"], r["node_index"]): r["values"] for r in table.to_pylist()}


def stored(db: tracedb.Database, name: str | None) -> dict[tuple[str, int], list[float]]:
    """A stored set's assigned nodes, read through ``credit_advantages``."""
    rows = db.sql("SELECT trace_id, node_index, advantages AS values FROM credit_advantages(?)", [name])
    return {k: v for k, v in as_dict(rows).items() if v is not None}


def assert_same(got: dict, want: dict, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    assert set(got) == set(want)
    for key, values in want.items():
        assert len(got[key]) == len(values), key
        np.testing.assert_allclose(got[key], values, rtol=rtol, atol=atol, err_msg=str(key))


def shared_sampled_nodes(db: tracedb.Database) -> int:
    """How many nodes with sampled tokens lie on two or more branches of their trace."""
    return (
        db.sql(
            "SELECT count(*) n FROM (SELECT b.trace_id, p FROM branches b, unnest(b.path) u(p) "
            "JOIN nodes n ON n.trace_id = b.trace_id AND n.node_index = p WHERE n.n_sampled > 0 "
            "GROUP BY ALL HAVING count(*) > 1)"
        )
        .column("n")[0]
        .as_py()
    )
