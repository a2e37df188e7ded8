"""Hypothesis strategies for verifiers v1 records with random message forests.

An episode is a dict shaped like one line of a verifiers ``traces.jsonl``: the non-node
fields are copied from a real fixture record (``linear.traces.jsonl``) and only ids,
groups and the node graphs are generated. Nodes are written the way verifiers writes
them (``exclude_none``: an absent key means None), with a few deliberate departures that
the contract allows: explicit ``null`` values, absent list keys, unknown node fields.

Per-token floats are rounded to 4 decimals, like verifiers' ``to_record``, so they read
back at float32 precision without surprises.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from support import FIXTURES

COMPACT = ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies")
OPTIONAL = COMPACT[1:]
LINK_TYPES = ("compaction_attempt", "compaction", "subagent_return", "vendor:review")
"""``vendor:review`` is a type tracedb does not know; it must be kept and otherwise ignored."""
LOSS_WEIGHT_NAMES = ("rl", "kl", "sft[0]")


def _template() -> tuple[dict[str, Any], dict[str, Any]]:
    line = (FIXTURES / "linear.traces.jsonl").read_text().splitlines()[0]
    episode = json.loads(line)
    trace = episode.pop("traces")[0]
    trace.pop("nodes")
    return episode, trace


EPISODE_TEMPLATE, TRACE_TEMPLATE = _template()
"""The non-node fields of a real verifiers 0.4.0 episode and trace."""

floats4 = st.floats(min_value=-8.0, max_value=8.0, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 4))
"""A per-token float as a verifiers record holds it (4 decimals)."""
stream_value = st.one_of(floats4, floats4, floats4, st.sampled_from([0, 1, -1, 0.0, -0.0]))
"""Mostly 4-decimal floats; sometimes a JSON integer (verifiers accepts ints in float lists)."""
token_id = st.one_of(st.integers(0, 9), st.integers(0, 2**31 - 1))
"""Small ids make identical token segments (deduplication) likely; large ones test int32."""
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)


@st.composite
def masks(draw: st.DrawFn, n: int) -> list[bool]:
    """A canonical mask (unsampled prefix, sampled suffix) or any mask at all."""
    if draw(st.booleans()):
        k = draw(st.integers(0, n))
        return [False] * (n - k) + [True] * k
    return draw(st.lists(st.booleans(), min_size=n, max_size=n))


@st.composite
def compact_stream(draw: st.DrawFn, k: int, *, nullable: bool, ragged: bool) -> Any:
    """A compact stream for a node with ``k`` sampled tokens, or ``ABSENT``.

    ``None`` (only for nullable streams), empty, exact length; with ``ragged`` also
    shorter or longer than ``k`` (verifiers drops extra values and reads missing as 0.0).
    """
    kinds = ["absent", "empty", "exact", "exact"]
    if nullable:
        kinds.append("none")
    if ragged:
        kinds += ["short", "long"]
    kind = draw(st.sampled_from(kinds))
    if kind == "absent":
        return ABSENT
    if kind == "none":
        return None
    if kind == "empty":
        return []
    size = k
    if kind == "short" and k > 1:
        size = draw(st.integers(1, k - 1))
    elif kind in ("short", "long"):
        size = k + draw(st.integers(1, 3))
    return draw(st.lists(stream_value, min_size=size, max_size=size))


ABSENT = object()
"""Marker: leave the key out of the record."""


@st.composite
def message_nodes(draw: st.DrawFn, n_nodes: int, *, ragged: bool) -> list[dict[str, Any]]:
    """``n_nodes`` verifiers ``MessageNode`` records forming a random forest."""
    nodes: list[dict[str, Any]] = []
    attempts: list[int] = []  # nodes carrying a compaction_attempt link
    for i in range(n_nodes):
        node: dict[str, Any] = {}
        how = draw(st.sampled_from(["prev", "prev", "any", "root"])) if i else "root"
        if how == "prev" and attempts and attempts[-1] == i - 1:
            # after a compaction attempt the rollout usually resumes from an earlier node,
            # leaving the attempt a leaf that shares its ancestors with later branches
            how = "retry" if i >= 2 and draw(st.integers(0, 3)) else how
        if how == "root":
            if draw(st.integers(0, 4)) == 0:
                node["parent"] = None  # written out explicitly: same as absent
        elif how == "retry":
            node["parent"] = draw(st.integers(0, i - 2))
        else:
            node["parent"] = i - 1 if how == "prev" else draw(st.integers(0, i - 1))
        links = []
        if i:
            for _ in range(draw(st.integers(0, 2))):
                kind = draw(st.sampled_from(LINK_TYPES + ("compaction_attempt",)))
                target = draw(st.integers(0, i - 1))
                if kind == "compaction" and attempts and draw(st.booleans()):
                    target = draw(st.sampled_from(attempts))  # accept an earlier compaction attempt
                links.append({"node": target, "type": kind})
        if any(link["type"] == "compaction_attempt" for link in links):
            attempts.append(i)
        if links or draw(st.integers(0, 5)):
            node["semantic_parents"] = links
        sampled = draw(st.booleans())
        role = "assistant" if sampled else draw(st.sampled_from(["system", "user"]))
        node["message"] = {"role": role, "content": draw(text)}
        node["sampled"] = sampled
        if draw(st.integers(0, 5)):
            node["timestamp"] = draw(st.floats(0, 2e9, allow_nan=False))
        tokens = draw(st.lists(token_id, max_size=6))
        mask = draw(masks(len(tokens)))
        if tokens or draw(st.integers(0, 3)):
            node["token_ids"] = tokens
            node["mask"] = mask
        is_content = draw(st.sampled_from(["absent", "empty", "full"]))
        if is_content == "empty":
            node["is_content"] = []
        elif is_content == "full":
            node["is_content"] = draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens)))
        k = sum(mask)
        for name in COMPACT:
            value = draw(compact_stream(k, nullable=name != "logprobs", ragged=ragged))
            if value is not ABSENT:
                node[name] = value
        lw = draw(st.sampled_from(["absent", "none", "names", "names"]))
        if lw == "none":
            node["loss_weights"] = None
        elif lw == "names":
            names = draw(st.lists(st.sampled_from(LOSS_WEIGHT_NAMES), max_size=2, unique=True))
            node["loss_weights"] = {
                name: draw(st.lists(stream_value, min_size=len(tokens), max_size=len(tokens))) for name in names
            }
        if draw(st.integers(0, 9)) == 0:
            node["x_note"] = {"kept": [1, [2, "]["]], "by": draw(text)}  # a field tracedb has no column for
        nodes.append(node)
    return nodes


@st.composite
def traces(draw: st.DrawFn, trace_id: str, *, ragged: bool, min_nodes: int = 0) -> dict[str, Any]:
    trace = copy.deepcopy(TRACE_TEMPLATE)
    trace["id"] = trace_id
    n_nodes = draw(st.integers(min_nodes, 8))
    nodes = draw(message_nodes(n_nodes, ragged=ragged))
    # Keep verifiers' key order: nodes sit between tools and calls.
    out: dict[str, Any] = {}
    for key, value in trace.items():
        out[key] = value
        if key == "tools":
            out["nodes"] = nodes
    return out


@st.composite
def episodes(draw: st.DrawFn, *, ragged: bool = False) -> list[dict[str, Any]]:
    """One or two episodes (lines) of one to three traces each.

    The first trace always has a node, so a selection never comes out without branches
    (empty views are tested on their own); later traces may have no nodes at all.
    """
    salt = draw(st.uuids()).hex[:8]
    out = []
    for e in range(draw(st.integers(1, 2))):
        episode = copy.deepcopy(EPISODE_TEMPLATE)
        episode["id"] = f"ep-{salt}-{e}"
        if draw(st.booleans()):
            episode["group"] = {"id": f"group-{draw(st.integers(0, 1))}"}
        episode["traces"] = [
            draw(traces(f"{draw(st.uuids()).hex[:6]}-{e}-{t}", ragged=ragged, min_nodes=1 if e == t == 0 else 0))
            for t in range(draw(st.integers(1, 3)))
        ]
        out.append(episode)
    return out


def all_traces(eps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for ep in eps for t in ep["traces"]]


def is_ragged(trace: dict[str, Any]) -> bool:
    """Some compact stream is non-empty and not one value per sampled token."""
    for node in trace.get("nodes") or []:
        k = sum(node.get("mask") or [])
        for name in COMPACT:
            values = node.get(name)
            if values and len(values) != k:
                return True
    return False


def write_jsonl(path: Path, eps: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(ep, ensure_ascii=False) + "\n" for ep in eps), encoding="utf-8")
    return path
