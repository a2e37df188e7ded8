"""Synthetic verifiers v1 rollouts, written without verifiers.

The records follow the on-disk contract of ``verifiers.v1`` (``Episode.to_record``
with ``exclude_none``): groups of traces that share one system prompt across the
whole run and one task prompt per group, tool-using assistant turns with a canonical
mask (a short unsampled scaffold, then the sampled completion), and optional context
compaction, which forks the graph: the compaction attempt is a dangling leaf and the
resumed branch restarts from the shared system prompt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 151_000
SCAFFOLD = 3  # unsampled generation-prompt tokens ahead of each completion

_AGENT = {
    "config": {
        "runtime": {
            "allow": ["*"],
            "block": [],
            "type": "prime",
            "image": "python:3.11-slim",
            "labels": [],
            "cpu": 1.0,
            "memory": 2.0,
            "disk": 5.0,
            "idle_timeout": 3600.0,
        },
        "timeout": {},
        "retries": {"max_retries": 0, "rules": []},
        "network_notice": True,
    },
    "name": "agent",
    "trainable": True,
}


def _timing(start: float) -> dict[str, Any]:
    span = {"start": 0.0, "end": 0.0}
    return {
        "start": start,
        "boot": dict(span),
        "setup": dict(span),
        "agent": {**span, "model": {"duration": 0.0}, "harness": {"duration": 0.0}},
        "finalize": dict(span),
        "scoring": dict(span),
    }


def _uid(rng: np.random.Generator) -> str:
    return uuid.UUID(bytes=rng.bytes(16)).hex


class _Builder:
    def __init__(self, rng: np.random.Generator, t0: float) -> None:
        self.rng = rng
        self.nodes: list[dict[str, Any]] = []
        self.t = t0

    def add(self, parent: int | None, role: str, tokens: np.ndarray, sampled: bool, content: str, **extra: Any) -> int:
        n = len(tokens)
        node: dict[str, Any] = {}
        if parent is not None:
            node["parent"] = parent
        node["semantic_parents"] = extra.pop("semantic_parents", [])
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "tool":
            message = {"role": role, "tool_call_id": f"call_{len(self.nodes)}", "content": content}
        node["message"] = message
        node["sampled"] = sampled
        self.t += 0.01
        node["timestamp"] = round(self.t, 6)
        node["token_ids"] = tokens.tolist()
        if sampled:
            k = min(SCAFFOLD, n)
            node["mask"] = [False] * k + [True] * (n - k)
            lp = -np.round(self.rng.exponential(0.8, n - k), 4)
            node["logprobs"] = lp.tolist()
        else:
            node["mask"] = [False] * n
            node["logprobs"] = []
        node["is_content"] = []
        node.update(extra)
        self.nodes.append(node)
        return len(self.nodes) - 1


def generate_episodes(
    groups: int = 4,
    group_size: int = 8,
    tokens_per_trace: int = 4_000,
    *,
    system_tokens: int = 1_500,
    task_tokens: int = 300,
    turn_tokens: tuple[int, int] = (120, 600),
    compaction_every: int = 12_000,
    advantages: bool = False,
    seed: int = 0,
) -> Iterator[dict[str, Any]]:
    """Yield episode records (dicts) ready for ``json.dumps`` as ``traces.jsonl`` lines.

    Every trace is about ``tokens_per_trace`` tokens over all its nodes. When a branch
    passes ``compaction_every`` tokens the agent compacts: the summary turn is a leaf
    with a ``compaction_attempt`` link and a fresh branch resumes from the shared system
    prompt with a ``compaction`` link back to it.  With ``advantages`` the sampled
    nodes carry a group-relative advantage broadcast over their tokens.
    """
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, system_tokens, dtype=np.int64)
    t0 = 1_795_949_995.0
    for g in range(groups):
        task_prompt = rng.integers(0, VOCAB, task_tokens, dtype=np.int64)
        task = {"type": "SWETask", "data": {"idx": g, "prompt": f"fix bug #{g}", "skills": []}}
        rewards = rng.integers(0, 2, group_size).astype(float)
        for member in range(group_size):
            b = _Builder(rng, t0)
            root = b.add(None, "system", system, False, "You are a careful engineer.")
            last = b.add(root, "user", task_prompt, False, f"fix bug #{g}")
            total = branch = system_tokens + task_tokens
            turn = 0
            while total < tokens_per_trace:
                n = int(rng.integers(*turn_tokens))
                kind = "assistant" if turn % 2 == 0 else "tool"
                toks = rng.integers(0, VOCAB, n, dtype=np.int64)
                if kind == "assistant" and branch > compaction_every:
                    attempt = b.add(
                        last,
                        "assistant",
                        toks,
                        True,
                        "summary of work so far",
                        semantic_parents=[{"node": last, "type": "compaction_attempt"}],
                    )
                    resume = b.add(root, "user", toks[: n // 2], False, "summary of work so far")
                    last = resume
                    total += n + n // 2
                    branch = system_tokens + n // 2
                    b.nodes[resume]["semantic_parents"] = [{"node": attempt, "type": "compaction"}]
                    continue
                sampled = kind == "assistant"
                last = b.add(last, kind, toks, sampled, f"{kind} turn {turn}")
                total += n
                branch += n
                turn += 1
            reward = float(rewards[member])
            if advantages:
                adv = round(reward - float(rewards.mean()), 4)
                for node in b.nodes:
                    if node["sampled"]:
                        node["advantages"] = [adv] * sum(node["mask"])
            trace = {
                "version": 1,
                "id": _uid(rng),
                "verifiers": {"version": "0.4.0"},
                "task": task,
                "agent": _AGENT,
                "tools": [],
                "nodes": b.nodes,
                "calls": [],
                "mm_token_type_id_map": {},
                "request_rewrites": [],
                "response_rewrites": [],
                "rewards": {"resolved": {"score": reward, "weight": 1.0}},
                "metrics": {"turns": float(turn)},
                "info": {},
                "extra_usage": [],
                "is_completed": True,
                "ok": True,
                "stop_condition": "agent_completed",
                "is_timeout": False,
                "errors": [],
                "timing": _timing(t0),
                "num_input_tokens": 0,
                "num_output_tokens": 0,
                "num_total_tokens": 0,
            }
            yield {
                "id": _uid(rng),
                "env": {"id": "sample-swe"},
                "task": task,
                "group": {"id": f"group-{g}"},
                "ok": True,
                "is_timeout": False,
                "errors": [],
                "traces": [trace],
                "num_input_tokens": 0,
                "num_output_tokens": 0,
                "num_total_tokens": 0,
            }


def versioned(
    episodes: Iterable[dict[str, Any]],
    *,
    step: int = 10,
    groups_per_step: int = 4,
    stale_share: float = 0.2,
    zero_variance_share: float = 0.25,
    dropped_share: float = 0.0,
    seed: int = 0,
    first_step: int = 1,
) -> Iterator[dict[str, Any]]:
    """The episodes of :func:`generate_episodes` as an asynchronous trainer's rollouts
    (verifiers 0.4.1's fields): each group is dispatched at a training step (groups fill
    steps 1, 2, ... ``groups_per_step`` at a time, up to ``step``), generated while policy
    versions ``[dispatch - 1, dispatch]`` were live (``run.work``), and every assistant node
    carries 1-3 weight-version spans ``step_N`` tiling its sampled tokens (a weight swap
    mid-turn). A ``stale_share`` of the groups were sampled two versions further back; a
    ``zero_variance_share`` of the groups get one reward for all members (their
    advantages 0); a ``dropped_share`` of the traces are dropped (``Trace.dropped``).
    ``first_step``: the step the first groups are dispatched at (later ones count on from it)."""
    rng = np.random.default_rng(seed + 7_777)
    by_group: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    for ep in episodes:
        gid = (ep.get("group") or {}).get("id", ep["id"])
        if gid not in by_group:
            order.append(gid)
            by_group[gid] = []
        by_group[gid].append(ep)
    for k, gid in enumerate(order):
        dispatch = min(step, first_step + k // max(1, groups_per_step))
        lag = 2 if rng.random() < stale_share else 0
        low, high = max(0, dispatch - 1 - lag), max(0, dispatch - lag)
        flat = rng.random() < zero_variance_share
        for ep in by_group[gid]:
            ep["run"] = {
                "type": "train",
                "id": "run-async",
                "name": "async",
                "work": {"type": "train", "step": dispatch, "policy": {"start": low, "end": high}},
            }
            for trace in ep["traces"]:
                if flat:
                    trace["rewards"] = {"resolved": {"score": 1.0, "weight": 1.0}}
                    for node in trace["nodes"]:
                        if node.get("advantages") is not None:
                            node["advantages"] = [0.0] * len(node["advantages"])
                if dropped_share and rng.random() < dropped_share:
                    trace["dropped"] = "judge: task_defect=yes"
                for node in trace["nodes"]:
                    if not node.get("sampled"):
                        continue
                    n = sum(node["mask"])
                    if not n:
                        continue
                    cuts = sorted(rng.choice(np.arange(1, n), size=min(n - 1, int(rng.integers(0, 3))), replace=False))
                    edges = [0, *(int(c) for c in cuts), n]
                    versions = np.linspace(low, high, len(edges) - 1).round().astype(int)
                    node["weight_versions"] = [
                        {"version": f"step_{int(v)}", "start": a, "end": b}
                        for v, a, b in zip(versions, edges[:-1], edges[1:], strict=True)
                        if b > a
                    ]
            yield ep


def write_sample(path: str | Path, **kwargs: Any) -> Path:
    """Write ``generate_episodes(**kwargs)`` to ``path`` as ``traces.jsonl``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for episode in generate_episodes(**kwargs):
            f.write(json.dumps(episode, separators=(",", ":")))
            f.write("\n")
    return path
