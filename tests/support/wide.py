"""Traces of many branches, in verifiers v1's on-disk shape (``tests/api/test_wide_traces.py``).

A verifiers trace forks wherever a node has more than one child: best-of-n sampling from
one prompt, subagents, retries. The hostile shape is a wide one: one prompt whose
``branches`` sampled answers all hang off a short chain of ``forks`` shared nodes (a root
with every leaf under it when ``forks`` is 1). Every branch is a root-to-leaf path of at
most ``forks + 3`` nodes, so the stored trace grows linearly with its branches, and with
``leaf_tokens=0`` (the default) the branches hold no tokens at all: no token budget bounds
what a route does with them. A trace of 4,000 such branches is a line of about 0.7 MB.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from support import FIXTURES

_TEMPLATE: dict[str, Any] = json.loads((FIXTURES / "empty_tokens.traces.jsonl").read_text().splitlines()[0])
"""An episode verifiers wrote (one trace of two nodes without tokens): everything but the nodes."""
T0 = 1_795_949_995.0


def _node(
    parent: int | None,
    role: str,
    content: str,
    sampled: bool,
    tokens: int,
    at: float,
    advantage: float | None = None,
) -> dict[str, Any]:
    node: dict[str, Any] = {} if parent is None else {"parent": parent}
    node["semantic_parents"] = []
    node["message"] = {"role": role, "content": content}
    node["sampled"] = sampled
    node["timestamp"] = round(at, 6)
    node["token_ids"] = [(7 * i + 11) % 151_000 for i in range(tokens)]
    if sampled:
        scaffold = min(3, tokens)
        node["mask"] = [False] * scaffold + [True] * (tokens - scaffold)
        node["logprobs"] = [-0.25] * (tokens - scaffold)
        if advantage is not None:
            node["advantages"] = [advantage] * (tokens - scaffold)
    else:
        node["mask"] = [False] * tokens
        node["logprobs"] = []
    node["is_content"] = []
    return node


def wide_episode(
    branches: int,
    *,
    forks: int = 1,
    leaf_tokens: int = 0,
    prompt_tokens: int = 0,
    name: str | None = None,
    group: str | None = None,
    reward: float | None = 1.0,
    advantage: float | None = None,
    text: str = "",
) -> dict[str, Any]:
    """An episode of one trace with ``branches`` branches: a system prompt, a user prompt,
    a chain of ``forks`` shared assistant/tool turns, and ``branches`` sampled leaves
    spread evenly over the chain's nodes from its end (leaf ``i`` under the ``i % forks``-th
    from the end). A chain longer than ``branches`` makes deep branches: the last one's
    path holds every node of the chain.

    Its trace id is ``name`` (default ``wide-{branches}``), its group ``group`` (default
    none); every leaf holds ``leaf_tokens`` tokens, each prompt ``prompt_tokens``; with
    ``advantage`` every sampled token holds that advantage; every message ends in ``text``.
    """
    if branches < 1 or forks < 1:
        raise ValueError(f"need branches >= 1 and forks >= 1, got forks={forks}, branches={branches}")
    name = name or f"wide-{branches}"
    nodes = [
        _node(None, "system", "You are a careful engineer." + text, False, prompt_tokens, T0),
        _node(0, "user", f"fix bug {name}" + text, False, prompt_tokens, T0 + 0.001),
    ]
    chain = []
    for k in range(forks):
        role = "assistant" if k % 2 == 0 else "tool"
        at = T0 + 0.002 + k * 1e-4
        nodes.append(_node(len(nodes) - 1, role, f"turn {k}" + text, role == "assistant", leaf_tokens, at, advantage))
        chain.append(len(nodes) - 1)
    for i in range(branches):
        at = T0 + 0.1 + i * 1e-5
        nodes.append(_node(chain[-1 - i % forks], "assistant", f"answer {i}" + text, True, leaf_tokens, at, advantage))
    episode = copy.deepcopy(_TEMPLATE)
    episode["id"] = f"episode-{name}"
    if group is not None:
        episode["group"] = {"id": group}
    trace = episode["traces"][0]
    trace["id"] = name
    trace["nodes"] = nodes
    trace["rewards"] = {} if reward is None else {"resolved": {"score": reward, "weight": 1.0}}
    trace["is_completed"] = trace["ok"] = True
    trace["stop_condition"] = "agent_completed"
    return episode


def write_wide(path: Path, *episodes: dict[str, Any]) -> Path:
    """``episodes`` as the lines of a traces.jsonl file at ``path``."""
    path.write_text("".join(json.dumps(e, separators=(",", ":")) + "\n" for e in episodes))
    return path
