"""``micro_batches``: read a selection's nodes once, make its samples, pack them.

:func:`check` and :func:`plan_of` are the halves around the read, which the lake
(:mod:`tracedb.lake.train`) calls around its own read of the same node columns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracedb import credit_sets
from tracedb.batches.plan import Plan, build_plan
from tracedb.batches.samples import OVERFLOW, build
from tracedb.handle import Handle
from tracedb.records import COMPACT_STREAMS
from tracedb.selection import Selection, resolve
from tracedb.views import branch_indices
from tracedb.views.nodes import NodeColumns, load_nodes


def micro_batches(
    handle: Handle,
    seq_len: int,
    selection: Selection = Selection(),
    *,
    ranks: int = 1,
    trainable: bool | None = True,
    branch_index: int | Sequence[int] | None = None,
    credit: str | None = None,
    train_once: bool = True,
    overflow: str = "truncate",
    cost: tuple[float, float] = (1.0, 0.0),
    pad_to_multiple_of: int = 1,
    pad_token_id: int = 0,
    share_prefixes: bool = False,
    drop_zero_advantages: bool = False,
) -> Plan:
    """Packed micro-batches of the selected branches; see :meth:`tracedb.Database.micro_batches`."""
    check(seq_len, ranks, pad_to_multiple_of, overflow, cost, share_prefixes, train_once)
    credit = credit_sets.resolve(handle, credit)
    if selection.everything:
        trace_ids, mark = None, None
    else:
        selected = resolve(handle, selection)
        trace_ids, mark = [tid for tid, _ in selected.traces], selected.watermark
    data = load_nodes(handle, trace_ids, list(COMPACT_STREAMS), credit)
    plan = plan_of(
        data,
        seq_len,
        selection.manifest(),
        ranks=ranks,
        trainable=trainable,
        branch_index=branch_index,
        credit=credit,
        train_once=train_once,
        overflow=overflow,
        cost=cost,
        pad_to_multiple_of=pad_to_multiple_of,
        pad_token_id=pad_token_id,
        share_prefixes=share_prefixes,
        drop_zero_advantages=drop_zero_advantages,
    )
    plan.report.watermark = data.watermark if mark is None else mark
    return plan


def check(
    seq_len: int,
    ranks: int,
    pad_to_multiple_of: int,
    overflow: str,
    cost: tuple[float, float],
    share_prefixes: bool,
    train_once: bool,
) -> None:
    """ValueError for packing arguments :func:`micro_batches` refuses (before anything is read)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be at least 1, got {pad_to_multiple_of}")
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow must be one of {list(OVERFLOW)}, not {overflow!r}")
    if len(cost) != 2 or min(cost) < 0:
        raise ValueError(f"cost is (linear, quadratic), both >= 0, not {cost!r}")
    if share_prefixes and not train_once:
        raise ValueError(
            "share_prefixes stores a shared token once, so it is in the loss once: it needs train_once=True"
        )


def plan_of(
    data: NodeColumns,
    seq_len: int,
    manifest: dict[str, Any],
    *,
    ranks: int,
    trainable: bool | None,
    branch_index: int | Sequence[int] | None,
    credit: str | None,
    train_once: bool,
    overflow: str,
    cost: tuple[float, float],
    pad_to_multiple_of: int,
    pad_token_id: int,
    share_prefixes: bool,
    drop_zero_advantages: bool,
) -> Plan:
    """The plan of the loaded node columns ``data`` (arguments checked by :func:`check`;
    ``manifest``: the selection's, recorded in the plan's arguments); its report's
    watermark is the caller's to set."""
    samples = build(
        data,
        seq_len,
        trainable=trainable,
        branch_index=branch_indices(branch_index),
        train_once=train_once,
        overflow=overflow,
        drop_zero_advantages=drop_zero_advantages,
        share_prefixes=share_prefixes,
    )
    arguments = {
        "seq_len": seq_len,
        "ranks": ranks,
        **manifest,
        "trainable": trainable,
        "branch_index": branch_index,
        "credit": credit,
        "train_once": train_once,
        "overflow": overflow,
        "cost": list(cost),
        "pad_to_multiple_of": pad_to_multiple_of,
        "pad_token_id": pad_token_id,
        "share_prefixes": share_prefixes,
        "drop_zero_advantages": drop_zero_advantages,
    }
    return build_plan(
        samples,
        seq_len=seq_len,
        ranks=ranks,
        cost=(float(cost[0]), float(cost[1])),
        pad_to_multiple_of=pad_to_multiple_of,
        pad_token_id=pad_token_id,
        share_prefixes=share_prefixes,
        arguments=arguments,
    )
