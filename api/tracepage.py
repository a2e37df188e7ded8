"""The data behind a trace's pages (``/view/{id}``, and with ``compare`` its credit in two
sets), a page at a time: whatever the trace's size, a page costs what its own contents
cost, and its HTML stays small.

A trace page shows a window of the trace's branches (``BRANCHES`` by default, from
``branches_from`` in branch-index order) and the nodes on them (at most ``NODES``, from
``nodes_from``), each node with its message and a heat strip of its tokens. What the
page embeds is bounded by budgets shared out over the page's nodes (:func:`shares`): at
most ``TOKENS`` strip tokens and ``TEXT`` characters of messages, a node getting all of
its own when it fits its share; a node cut short says so (and the record has it whole).
A branch's path is shown by its ends when it is long. The work is linear in the trace:
the branch window is one indexed query, the nodes are read for the page only, and which
page branch holds which node is a dictionary built once from the page's paths.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tracedb.database import Database

from . import queries
from .errors import not_found

BRANCHES = 50
"""Branches a page shows by default (``branch_limit``)."""
MAX_BRANCHES = 100
"""Branches a page shows at most."""
NODES = 200
"""Nodes a page shows at most (``nodes_from`` pages through more)."""
TOKENS = 40_000
"""Strip tokens a page embeds at most, shared out over its nodes."""
TEXT = 100_000
"""Characters of messages (text, tool calls, other fields) a page shows at most, shared out over its nodes."""
TEXT_FLOOR = 500
"""Characters every node may show whatever the share (a page of many nodes still reads)."""
PATH_ENDS = 6
"""A longer branch path is shown as its first and last ``PATH_ENDS`` nodes."""
COMPARE_NODES = 100
"""Sampled nodes one compare page shows at most (three strips each)."""


def shares(sizes: Sequence[int], budget: int) -> list[int]:
    """How much of each item fits a shared ``budget``: every item gets ``min(size, level)``
    for the highest ``level`` at which they add up to at most the budget (small items
    whole, the large ones cut to one level). Linear after one sort."""
    caps = [0] * len(sizes)
    left, rest = budget, len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: sizes[i]):
        level = left // rest
        caps[i] = min(sizes[i], level)
        left -= caps[i]
        rest -= 1
    return caps


def page_from(branch: int | None, branches_from: int | None, limit: int) -> int:
    """The page's first branch: ``branches_from``, else the start of the page holding
    ``branch`` (links to one branch), else 0."""
    if branches_from is not None:
        return branches_from
    return 0 if branch is None else branch // limit * limit


def trace_page(
    db: Database,
    trace_id: str,
    credit: str | None,
    *,
    branches_from: int,
    branch_limit: int,
    nodes_from: int,
    only: set[int] | None = None,
) -> dict[str, Any]:
    """One page of a trace (``only``: of these nodes alone, e.g. the sampled ones): its
    ``meta``, the page's ``branches`` (each with ``path_text``),
    its ``nodes`` (each with ``view``: the message as shown, ``on``: the page's branches
    holding it, ``n_branches``: all branches holding it, ``shown``/``cut``: its strip's
    tokens), the strips to embed (``strips``) and where the page sits (``window``)."""
    meta = queries.trace_meta(db, trace_id)
    total = meta["n_branches"]
    if total and branches_from >= total:
        raise not_found(f"trace {trace_id!r} has {total} branches (0-{total - 1}); no page from branch {branches_from}")
    branches = queries.branch_list(db, trace_id, credit, start=branches_from, limit=branch_limit)
    on: dict[int, list[int]] = {}
    for b in branches:
        b["path_text"] = path_text(b["path"])
        for n in b["path"]:
            on.setdefault(n, []).append(b["branch_index"])
    listed = sorted(on if only is None else (n for n in on if n in only))  # the page's nodes, in index order
    if listed and nodes_from >= len(listed):
        raise not_found(
            f"the page's branches hold {len(listed)} nodes (0-{len(listed) - 1} of the page); no node {nodes_from}"
        )
    window = listed[nodes_from : nodes_from + NODES]
    nodes = queries.trace_nodes(db, trace_id, credit, tokens=True, messages=True, nodes=window)
    holding = branch_counts(db, trace_id, window)
    shown = shares([n["n_tokens"] for n in nodes], TOKENS)
    views = [message_view(n.pop("message", None)) for n in nodes]
    text = shares([v["chars"] for v in views], TEXT)
    strips = []
    for node, view, cap, chars in zip(nodes, views, shown, text, strict=True):
        index = node["node_index"]
        node["view"] = cut_view(view, max(chars, TEXT_FLOOR))
        node["on"] = set(on[index])
        node["branches"] = on[index]
        node["n_branches"] = holding.get(index, 0)
        node["shown"], node["cut"] = cap, node["n_tokens"] - cap
        tokens = node.pop("tokens")
        strip = {k: head_of(tokens[k], cap) for k in ("token_ids", "sampled_mask", "logprobs", "advantages")}
        strips.append({"strip": index, "node_index": index, "offset": 0, **strip})
    window_info = {
        "n_branches": total,
        "branches_from": branches_from,
        "branches_to": branches_from + len(branches),
        "branch_limit": branch_limit,
        "previous_from": max(0, branches_from - branch_limit) if branches_from > 0 else None,
        "next_from": branches_from + len(branches) if branches_from + len(branches) < total else None,
        "n_nodes": len(listed),
        "nodes_from": nodes_from,
        "nodes_to": nodes_from + len(window),
        "previous_nodes": max(0, nodes_from - NODES) if nodes_from > 0 else None,
        "next_nodes": nodes_from + NODES if nodes_from + NODES < len(listed) else None,
        "tokens_cut": sum(n["cut"] for n in nodes),
    }
    return {"meta": meta, "branches": branches, "nodes": nodes, "strips": strips, "window": window_info}


def branch_counts(db: Database, trace_id: str, nodes: Sequence[int]) -> dict[int, int]:
    """How many of the trace's branches hold each of ``nodes`` (one pass over its paths)."""
    table = db.sql(
        "SELECT node, count(*)::BIGINT AS n FROM (SELECT unnest(path) AS node FROM branches WHERE trace_id = ?) "
        "WHERE node IN (SELECT unnest(?::INTEGER[])) GROUP BY node",
        [trace_id, list(nodes)],
    )
    return dict(zip(table.column("node").to_pylist(), table.column("n").to_pylist(), strict=True))


def path_text(path: Sequence[int]) -> str:
    """A branch's path as shown: every node, or its ends around how many are left out."""
    if len(path) <= 2 * PATH_ENDS + 1:
        return " → ".join(map(str, path))
    head, tail = path[:PATH_ENDS], path[-PATH_ENDS:]
    middle = f"… {len(path) - 2 * PATH_ENDS} more …"
    return " → ".join([*map(str, head), middle, *map(str, tail)])


def head_of(values: np.ndarray | None, n: int) -> np.ndarray | None:
    """The first ``n`` values (None stays None: a stream the node does not hold)."""
    return None if values is None else values[:n]


def message_view(message: dict[str, Any] | None) -> dict[str, Any]:
    """What a person reads of a message: its text, tool calls and other fields (``chars``: their length)."""
    if not message:
        return {"text": "", "calls": [], "extra": None, "chars": 0}
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(f"[{part.get('type', 'part') if isinstance(part, dict) else 'part'}]")
        text = "\n".join(parts)
    else:
        text = "" if content is None else str(content)
    calls = []
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            calls.append(f"{fn.get('name', '?')}({fn.get('arguments', '')})")
    extra = {k: v for k, v in message.items() if k not in ("role", "content", "tool_calls")}
    shown = json.dumps(extra, indent=1) if extra else None
    chars = len(text) + sum(map(len, calls)) + (len(shown) if shown else 0)
    return {"text": text, "calls": calls, "extra": shown, "chars": chars}


def cut_view(view: dict[str, Any], chars: int) -> dict[str, Any]:
    """``view`` within ``chars`` characters (text first, then the calls, then the other
    fields); ``cut``: the characters left out."""
    left = chars
    text, left = _cut(view["text"], left)
    calls = []
    for call in view["calls"]:
        if left <= 0:
            break
        shown, left = _cut(call, left)
        calls.append(shown)
    extra = None
    if view["extra"] is not None and left > 0:
        extra, left = _cut(view["extra"], left)
    shown = len(text) + sum(map(len, calls)) + (len(extra) if extra else 0)
    return {"text": text, "calls": calls, "extra": extra, "cut": view["chars"] - shown}


def _cut(text: str, room: int) -> tuple[str, int]:
    return text[: max(0, room)], room - len(text)


def compare_window(sampled: int, nodes_from: int) -> tuple[int, int]:
    """The compare page's window of sampled nodes: ``(start, stop)``; 404 past the end."""
    if sampled and nodes_from >= sampled:
        raise not_found(f"the trace has {sampled} sampled nodes (0-{sampled - 1}); no node {nodes_from}")
    return nodes_from, min(sampled, nodes_from + COMPARE_NODES)


def compare_tokens(sizes: Sequence[int]) -> list[int]:
    """Tokens of each node the compare page shows (three strips a node: a third of ``TOKENS``)."""
    return shares(list(sizes), math.floor(TOKENS / 3))
