"""Reward channels (SkillGate, MR-IQA): each part of a rollout is credited by the reward
that judges it.

``channels`` maps a *node selector* to a *reward*::

    {"role:assistant": "resolved", "tool:read_skill": "skill_ok", "loss_weights:think": "judge"}

Selectors pick sampled tokens:

- ``role:NAME``: every sampled token of a node whose message role is NAME;
- ``tool:NAME``: every sampled token of a node whose message calls tool NAME (a tool call's
  ``name``, as verifiers writes it, or its OpenAI-style ``function.name``);
- ``loss_weights:NAME``: the sampled tokens where the node's ``loss_weights`` stream NAME is
  nonzero (a node without that stream has none).

A reward is the name of one of the trace's rewards, or ``*`` for its weighted reward (the
one ``grpo`` reads by default). Each selected token gets that reward's group advantage,
computed exactly as :func:`tracedb.credit.outcome.grpo` computes it (same ``group_by``,
``scale_std``, ``eps``, ``include_failed``). Tokens no channel selects get 0.0 (scored,
no credit); a token two channels select is refused, naming the node, since its credit
would be counted twice. So ``{"role:assistant": "*"}`` is ``grpo`` wherever only assistant
messages hold sampled tokens.

A trace is credited when at least one channel's reward is valid for it (scored, and ok
unless ``include_failed``); its sampled nodes then all get rows, and a channel whose
reward it lacks contributes 0.0. Every other trace stays unassigned. A role no node has, a
``loss_weights`` name no node holds and a reward no trace scores are refused as typos; a
tool nobody called in this data simply selects nothing.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from tracedb.credit.layouts import NODE_CREDIT, node_table
from tracedb.credit.outcome import grpo
from tracedb.errors import CreditWarning
from tracedb.handle import Handle, HandleOf, handle_of

KINDS = ("role", "tool", "loss_weights")
"""What a selector (``KIND:NAME``) selects by."""
ALL_REWARDS = "*"
"""The reward name standing for the trace's weighted reward."""

_TRACES = "_tdb_channels_traces"
_TOOLS = (
    "list_concat(coalesce(json_extract_string(n.message, '$.tool_calls[*].name'), []), "
    "coalesce(json_extract_string(n.message, '$.tool_calls[*].function.name'), []))"
)


def channels(
    db: HandleOf,
    *,
    channels: Mapping[str, str] | str | None = None,
    group_by: str = "group_id",
    scale_std: bool = False,
    eps: float = 1e-6,
    include_failed: bool = False,
) -> pa.Table:
    """Channel credit per node: ``trace_id, node_index, values`` (one value per sampled
    token). ``channels`` is the selector -> reward map (a mapping or its JSON text); see the
    module notes. ``group_by``, ``scale_std``, ``eps`` and ``include_failed`` are grpo's."""
    handle = handle_of(db)
    parsed = _parse(channels)
    _check_names(handle, parsed)

    # One grpo per distinct reward; a trace a reward leaves out reads 0.0 in that channel.
    rewards = sorted({reward for *_, reward in parsed})
    advantage: pl.DataFrame | None = None
    for k, reward in enumerate(rewards):
        table = grpo(
            handle,
            reward=None if reward == ALL_REWARDS else reward,
            group_by=group_by,
            scale_std=scale_std,
            eps=eps,
            include_failed=include_failed,
        )
        frame = pl.from_arrow(table).rename({"value": f"a{k}"})
        advantage = frame if advantage is None else advantage.join(frame, on="trace_id", how="full", coalesce=True)
    assert advantage is not None  # _parse refuses an empty map
    advantage = advantage.sort("trace_id").fill_null(0.0).with_row_index("trace_code")
    if advantage.height == 0:
        return NODE_CREDIT.empty_table()

    params: dict[str, object] = {}
    columns = []
    for k, (_, kind, name, _) in enumerate(parsed):
        params[f"s{k}"] = name
        if kind == "role":
            columns.append(f"coalesce(n.role = $s{k}, false) AS c{k}")
        elif kind == "tool":
            columns.append(f"coalesce(list_contains({_TOOLS}, $s{k}), false) AS c{k}")
        else:
            stream = (
                f"coalesce(list_where(element_at(n.loss_weights, $s{k})[1], "
                "tdb_mask(n.n_tokens, n.mask_prefix, n.mask_slots)), []::FLOAT[])"
            )
            columns.append(f"list_transform(list_resize({stream}, n.n_sampled, 0.0::FLOAT), lambda x: x <> 0) AS c{k}")
    with handle.registered(_TRACES, advantage.select("trace_id", "trace_code").to_arrow()):
        rows = handle.sql(
            f"SELECT n.trace_id, n.node_index, n.n_sampled, x.trace_code, {', '.join(columns)} "
            f"FROM nodes n JOIN {_TRACES} x USING (trace_id) WHERE n.n_sampled > 0 "
            "ORDER BY n.trace_id, n.node_index",
            params,
        )
    if rows.num_rows == 0:
        return NODE_CREDIT.empty_table()

    n_sampled = rows.column("n_sampled").to_numpy().astype(np.int64)
    token_trace = np.repeat(rows.column("trace_code").to_numpy().astype(np.int64), n_sampled)
    values = np.zeros(len(token_trace))
    chosen = np.full(len(token_trace), -1, np.int64)
    for k, (selector, kind, _, reward) in enumerate(parsed):
        column = rows.column(f"c{k}")
        if kind == "loss_weights":
            array = column.combine_chunks()
            selected = np.asarray(array.flatten().to_numpy(zero_copy_only=False), bool)
        else:
            selected = np.repeat(column.to_numpy(zero_copy_only=False).astype(bool), n_sampled)
        clash = np.flatnonzero(selected & (chosen >= 0))
        if len(clash):
            i = int(clash[0])
            row = int(np.searchsorted(np.cumsum(n_sampled), i, side="right"))
            raise ValueError(
                f"channels: trace {rows.column('trace_id')[row]}, node {rows.column('node_index')[row]}: a sampled "
                f"token is selected by both {parsed[chosen[i]][0]!r} and {selector!r}; a token takes one channel"
            )
        chosen[selected] = k
        a = advantage.get_column(f"a{rewards.index(reward)}").to_numpy()
        values[selected] = a[token_trace[selected]]
    used = {parsed[k][3] for k in np.unique(chosen[chosen >= 0])}
    if len(used) == 1 and (chosen >= 0).all():
        (reward,) = used
        used_channels = np.unique(chosen)
        picked = ", ".join(repr(parsed[k][0]) for k in used_channels)
        warnings.warn(
            CreditWarning(
                f"channels: {picked} {'select' if len(used_channels) > 1 else 'selects'} every sampled token with one "
                f"reward ({reward!r}), so the credit equals "
                f"grpo's{'' if reward == ALL_REWARDS else f' with reward={reward!r}'}; a channel that credits "
                "part of a rollout selects fewer tokens"
            ),
            stacklevel=2,
        )
    return node_table(
        rows.column("trace_id").combine_chunks(), rows.column("node_index").combine_chunks(), n_sampled, values
    )


def _parse(channels: Mapping[str, str] | str | None) -> list[tuple[str, str, str, str]]:
    """(selector, kind, name, reward) per channel, in the order given."""
    usage = (
        "channels must be a JSON map from a node selector (role:NAME, tool:NAME, loss_weights:NAME) "
        "to a reward name or '*'"
    )
    if channels is None:
        raise ValueError(f"{usage}; none was given")
    if isinstance(channels, str):
        try:
            channels = json.loads(channels)
        except ValueError as e:
            raise ValueError(f"{usage}; not JSON: {e}") from None
    if not isinstance(channels, Mapping) or not channels:
        raise ValueError(f"{usage}; got {channels!r}")
    out = []
    for selector, reward in channels.items():
        kind, _, name = str(selector).partition(":")
        if kind not in KINDS or not name:
            raise ValueError(f"channels: selector {selector!r} is not KIND:NAME with KIND one of {list(KINDS)}")
        if not isinstance(reward, str) or not reward:
            raise ValueError(f"channels: selector {selector!r} maps to {reward!r}, not a reward name or '*'")
        out.append((str(selector), kind, name, reward))
    return out


def _check_names(db: Handle, parsed: list[tuple[str, str, str, str]]) -> None:
    """Refuse a role no node has, a loss_weights name no node holds, a reward no trace scores."""
    roles: list[Any] | None = None
    for selector, kind, name, reward in parsed:
        if kind == "role":
            if roles is None:
                roles = sorted(r for r in db.sql("SELECT DISTINCT role FROM nodes").column("role").to_pylist() if r)
            if name not in roles:
                raise ValueError(f"channels: selector {selector!r}: no node has role {name!r} (roles: {roles})")
        elif kind == "loss_weights":
            held = db.scalar(
                "SELECT EXISTS (SELECT 1 FROM nodes WHERE list_contains(map_keys(loss_weights), ?))", [name]
            )
            if not held:
                raise ValueError(f"channels: selector {selector!r}: no node holds loss_weights {name!r}")
        if reward != ALL_REWARDS:
            scored = db.scalar(
                "SELECT EXISTS (SELECT 1 FROM traces WHERE json_exists(record, '$.rewards.' || to_json(?::VARCHAR)))",
                [reward],
            )
            if not scored:
                raise ValueError(f"channels: selector {selector!r}: no trace has a reward named {reward!r}")
