"""``micro_batches``: read a selection's nodes once, make its samples, pack them.

:func:`check` and :func:`plan_of` are the halves around the read, which the lake
(:mod:`tracedb.lake.train`) calls around its own read of the same node columns."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow.compute as pc

from tracedb import credit_sets
from tracedb.batches import provenance
from tracedb.batches import replay as replays
from tracedb.batches.importance import check as check_importance
from tracedb.batches.importance import view_weights
from tracedb.batches.plan import Plan, build_plan
from tracedb.batches.replay import Replay, Replayed, Swap
from tracedb.batches.samples import OVERFLOW, Samples, build
from tracedb.handle import Handle
from tracedb.records import COMPACT_STREAMS
from tracedb.selection import Selected, Selection, resolve_at
from tracedb.views import branch_indices, versions
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
    importance: str | None = None,
    clip: float | None = None,
    replay: Replay | Replayed | None = None,
) -> Plan:
    """Packed micro-batches of the selected branches; see :meth:`tracedb.Database.micro_batches`.
    ``replay``: the selection's zero-variance groups replaced by earlier ones
    (:mod:`tracedb.batches.replay`); a :class:`~tracedb.batches.replay.Replayed` makes a
    step's recorded choices again. ``plan.record`` is what the step's manifest records of
    its inputs (:mod:`tracedb.batches.provenance`)."""
    cap = check(seq_len, ranks, pad_to_multiple_of, overflow, cost, share_prefixes, train_once, importance, clip)
    credit = credit_sets.resolve(handle, credit)
    chosen = selection.for_training()  # dropped traces and eval episodes stay out unless asked in
    if replay is not None:
        replays.check(replay, chosen)  # before any reading
    read_at = handle.watermark()
    selected = resolve_at(handle.con, chosen, read_at)
    trace_ids: list[str] | None = [tid for tid, _ in selected.traces]
    mark = selected.watermark
    left_out = selected.report.get("dropped", 0) + selected.report.get("eval", 0)
    swap = None
    if isinstance(replay, Replayed):
        swap = replays.recorded(handle, chosen, selected, replay)
    elif replay is not None:
        swap = replays.choose(handle, chosen, selected, replay, credit)
    if swap is not None:
        trace_ids = swap.trace_ids
    elif selection.everything and not left_out:
        trace_ids = None  # every trace: the whole-database read (faster), at the watermark it sees
        mark = None
    data = load_nodes(handle, trace_ids, list(COMPACT_STREAMS), credit)
    versions.attach(handle, data)
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
        importance=importance,
        clip=cap,
        chosen=chosen,
        selected=selected,
        replay=None if replay is None else replay.settings if isinstance(replay, Replayed) else replay.manifest(),
        swap=swap,
    )
    plan.report.watermark = data.watermark if mark is None else mark
    plan.record = provenance.record(
        data,
        None if trace_ids is None else selected.trace_ids,
        data.watermark if trace_ids is None else read_at,
        plan.report.watermark,
        credit,
    )
    return plan


def check(
    seq_len: int,
    ranks: int,
    pad_to_multiple_of: int,
    overflow: str,
    cost: tuple[float, float],
    share_prefixes: bool,
    train_once: bool,
    importance: str | None = None,
    clip: float | None = None,
) -> float | None:
    """ValueError for packing arguments :func:`micro_batches` refuses (before anything is
    read); returns the importance weights' resolved clip (None without ``importance``)."""
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
    return check_importance(importance, clip)


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
    importance: str | None = None,
    clip: float | None = None,
    chosen: Selection = Selection(),
    selected: Selected | None = None,
    replay: dict[str, Any] | None = None,
    swap: Swap | None = None,
) -> Plan:
    """The plan of the loaded node columns ``data`` (arguments checked by :func:`check`,
    ``clip`` as it resolved; ``manifest``: the selection's, recorded in the plan's
    arguments; ``chosen``/``selected``: the training selection and what it resolved to, for
    stale masking and the report's staleness figures; ``replay``: the replay settings
    recorded, ``swap``: what replay did); its report's watermark is the caller's to set."""
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
    stale_tokens = mask_stale(samples, chosen, set() if swap is None else swap.replayed)
    if clip is not None:  # per view token; which of them are loss tokens is decided as the bins are laid out
        assert samples.path_off is not None and samples.path_rows is not None
        samples.importance = view_weights(data, samples.path_off, samples.path_rows, samples.view_offsets, clip)
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
        "importance": importance,
        "clip": clip,
        "replay": replay,
    }
    plan = build_plan(
        samples,
        seq_len=seq_len,
        ranks=ranks,
        cost=(float(cost[0]), float(cost[1])),
        pad_to_multiple_of=pad_to_multiple_of,
        pad_token_id=pad_token_id,
        share_prefixes=share_prefixes,
        arguments=arguments,
    )
    report = plan.report
    report.importance, report.clip = importance, clip
    if selected is None:
        return plan
    report.dropped = selected.report.get("dropped", 0)
    report.eval = selected.report.get("eval", 0)
    if chosen.bound is not None:
        report.policy, report.staleness_bound = chosen.policy, chosen.bound
        report.stale_groups = selected.report.get("stale_groups", 0)
        report.stale_traces = selected.report.get("stale_traces", 0)
        report.stale_tokens = stale_tokens
        report.unknown_dropped = selected.report.get("unknown", 0)
        packed = set(samples.trace_id)
        lows = {**selected.policy_min, **({} if swap is None else swap.policy_min)}
        ages = [chosen.policy - low for t, low in lows.items() if t in packed and low is not None]
        report.off_policy_level = sum(ages) / len(ages) if ages else None
        report.off_policy_max = max(ages) if ages else None
    report.groups_over = selected.report.get("groups_over", 0)
    if swap is not None:
        report.replay_replaced, report.replay_unfilled = len(swap.choices), swap.unfilled
        report.replay_candidates, report.replayed = swap.candidates, swap.choices
    return plan


def mask_stale(samples: Samples, selection: Selection, replayed: set[str]) -> int:
    """With ``stale="mask"``: the loss tokens older than the staleness bound leave the loss
    (``samples.loss_mask`` false there); returns how many did. A replayed group's tokens
    stay: replay held the group to its own bound (``Replay.max_staleness``)."""
    if selection.bound is None or (selection.stale or "drop") != "mask":
        return 0
    column = samples.view.column("policy_version").combine_chunks()
    if column.null_count == len(column):
        return 0
    # The view's lists sit back to back over its tokens (views.spread builds them so), a
    # null element where a token has no known version (unknown="keep" keeps those).
    start = column.offsets[0].as_py()
    flat = column.values.slice(start, int(samples.view_offsets[-1]))
    values = pc.fill_null(flat, np.iinfo(np.int32).max).to_numpy(zero_copy_only=False)
    old = samples.loss_mask & (values < selection.bound)
    if replayed:
        rows = np.array([t in replayed for t in samples.view.column("trace_id").to_pylist()], bool)
        old &= ~np.repeat(rows, np.diff(samples.view_offsets))
    samples.loss_mask[old] = False
    return int(old.sum())
