"""Replay: a step's zero-variance groups replaced by earlier groups that carry signal.

A group whose scored members all hold one reward (the library's rule: the macro
``tdb_zero_variance``, also behind ``group_rewards()``) gets a group-relative advantage
of 0 on every token: it fills a trainer's batch and teaches nothing. With
``micro_batches(..., replay=Replay(...))`` each such group of the selection is replaced,
whole, by an earlier group of the store (a *candidate*) that is

- **complete** at or before the selection's watermark (its ``complete_groups``-th member
  arrived by then: replay needs ``complete_groups``) and has no trace in this selection;
- **with signal**: scored members of different rewards (reward standard deviation > 0,
  so not zero-variance), and credit in the step's set on some sampled token (an unscored
  group would only be skipped by the packer);
- **within the staleness bound**: its oldest member's ``policy_min`` is at or above
  ``V - K``, ``V`` the selection's ``policy`` and ``K`` ``Replay.max_staleness`` (None: the
  selection's own ``max_staleness``). Without a ``policy`` staleness is not checked, and a
  ``Replay.max_staleness`` is refused (it has nothing to be measured from). A group with a
  member of unknown policy version is a candidate only under ``unknown="keep"``;
- **used fewer than** ``max_uses`` **times**: the uses are the replays listed by the step
  manifests under ``steps_root`` (every ``manifest.json`` below it; a step rebuilt from
  its manifest is not a use), so packing stays a read.

A group's members are its traces at the watermark that training takes (dropped traces
and eval episodes left out unless the selection asks for them), under the selection's
tag filters. A trace without a group id is no group here (neither replaced nor
replayed), as in ``group_rewards()``.

**Choice.** ``priority="signal"``: the candidates of highest mean |A| (over their sampled
tokens, in the step's credit set) times reward standard deviation (population), ties in
a random order drawn from ``seed`` and the watermark; ``"uniform"``: that random order
alone (a uniform sample without replacement). The zero-variance groups, oldest first,
take the candidates in turn, one each; a group left without one is kept and counted
(``report.replay_unfilled``). The same store, manifests and arguments give the same
choice. ``report.replayed`` (and the step's manifest) says what replaced what.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np

from tracedb.batches import pool
from tracedb.errors import StepChanged, TraceDBError
from tracedb.handle import Handle
from tracedb.selection import Selected, Selection, resolve_at

PRIORITIES = ("signal", "uniform")
MANIFEST = "manifest.json"  # as batches.files writes it (files imports this module's users)


@dataclass(frozen=True)
class Replay:
    """How ``micro_batches`` replaces the selection's zero-variance groups (see
    :mod:`tracedb.batches.replay`)."""

    max_staleness: int | None = None
    """``K``: a replayed group's oldest member is at most ``K`` policy versions behind the
    selection's ``policy`` (None: the selection's own ``max_staleness``; needs a policy)."""
    priority: str = "signal"
    """``"signal"`` (mean |A| x reward std, highest first) or ``"uniform"`` (random)."""
    max_uses: int | None = None
    """A group is replayed at most this many times over the steps under ``steps_root``
    (None: no limit)."""
    seed: int = 0
    """Seeds the tie-breaking (``signal``) or the sampling (``uniform``), with the watermark."""
    steps_root: str | Path | None = None
    """The directory whose step manifests count the uses (``max_uses`` needs it; a
    directory not made yet holds no steps)."""

    def __post_init__(self) -> None:
        k = self.max_staleness
        if k is not None and (not _whole(k) or k < 0):
            raise ValueError(f"replay max_staleness is a number of policy versions (an int >= 0), not {k!r}")
        if self.priority not in PRIORITIES:
            raise ValueError(f"replay priority is one of {list(PRIORITIES)}, not {self.priority!r}")
        m = self.max_uses
        if m is not None and (not _whole(m) or m < 1):
            raise ValueError(f"replay max_uses is a number of uses (an int >= 1), not {m!r}")
        if not _whole(self.seed) or self.seed < 0:
            raise ValueError(f"replay seed is an int >= 0, not {self.seed!r}")
        root = self.steps_root
        if root is not None and not isinstance(root, str | Path):
            raise ValueError(f"replay steps_root is a directory (a path), not {root!r}")
        if root is not None and not str(root).strip():
            raise ValueError("replay steps_root is empty: give the directory the steps are written under")
        if m is not None and root is None:
            raise ValueError(
                "replay max_uses counts the replays listed by the step manifests under steps_root: give steps_root"
            )

    def manifest(self) -> dict[str, Any]:
        """The settings as JSON holds them (plan arguments, step manifests)."""
        return {
            "max_staleness": self.max_staleness,
            "priority": self.priority,
            "max_uses": self.max_uses,
            "seed": self.seed,
            "steps_root": None if self.steps_root is None else str(self.steps_root),
        }


@dataclass(frozen=True)
class Replayed:
    """The replay choices a step made (its manifest's ``report.replayed``), made again as
    recorded: rebuilding a step consults no use counts and no priorities."""

    choices: tuple[dict[str, Any], ...]
    settings: dict[str, Any] = field(default_factory=dict)
    """The step's :meth:`Replay.manifest`, for the plan's arguments."""
    candidates: int = 0
    """The step's ``report.replay_candidates`` (not counted again)."""


@dataclass
class Swap:
    """What replay did to one selection."""

    trace_ids: list[str]
    """What to pack: the selection less the replaced groups, plus the replayed groups."""
    choices: list[dict[str, Any]]
    """Per replaced group: ``replaced`` (its id), ``group`` (the replayed group's),
    ``traces`` (the replayed traces), ``priority`` (None under ``uniform``), ``uses``
    (times replayed before this step)."""
    unfilled: int = 0
    candidates: int = 0
    replayed: set[str] = field(default_factory=set)
    """The replayed traces."""
    policy_min: dict[str, int | None] = field(default_factory=dict)
    """The replayed traces' lowest known policy versions."""


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check(replay: Replay | Replayed, selection: Selection) -> int | None:
    """Refuse a replay the selection cannot take (one clear line); returns the staleness
    bound ``K`` candidates are held to (None: not checked)."""
    if not isinstance(replay, Replay | Replayed):
        raise ValueError(f"replay is a tracedb.Replay(...), not {type(replay).__name__} {replay!r}")
    if selection.complete_groups is None:
        raise ValueError("replay replaces whole groups with complete ones: give complete_groups=N (the group size) too")
    if isinstance(replay, Replayed):
        return None
    if replay.max_staleness is not None and selection.policy is None:
        raise ValueError(
            "replay max_staleness is measured from the step's policy: give policy=V and max_staleness=K too"
        )
    return replay.max_staleness if replay.max_staleness is not None else selection.max_staleness


@dataclass
class _Traces:
    """Some traces' rows of ``traces``, their groups' reward spread, and their credit."""

    group: dict[str, str]
    """trace id -> group id (the traces with one)."""
    reward: dict[str, float | None]
    policy_min: dict[str, int | None]
    unknown: set[str]
    """The traces with a sampled token of unknown policy version."""
    flat: list[str]
    """Their zero-variance groups (``tdb_zero_variance`` over these members), oldest first
    (by the newest member's sequence number)."""
    scored: dict[str, int]
    """group id -> its scored members among these."""
    mass: dict[str, tuple[float, int]] = field(default_factory=dict)
    """trace id -> (sum of |A| over its sampled tokens, the tokens assigned), in the credit
    set read (summed in node order, so equal data give equal figures)."""

    def members(self) -> dict[str, list[str]]:
        """group id -> its traces among these (sorted)."""
        out: dict[str, list[str]] = {}
        for tid in sorted(self.group):
            out.setdefault(self.group[tid], []).append(tid)
        return out


def _traces(rows: Iterable[pool.Row]) -> _Traces:
    """What replay needs of these traces, the group figures over these members (the rule
    of ``tdb_zero_variance``: some member scored, all scored members of one reward)."""
    found = _Traces(group={}, reward={}, policy_min={}, unknown=set(), flat=[], scored={})
    figures: dict[str, list] = {}  # group id -> [scored, lowest, highest, newest seq]
    for r in rows:
        found.reward[r.trace_id], found.policy_min[r.trace_id] = r.reward, r.policy_min
        if r.unknown:
            found.unknown.add(r.trace_id)
        if r.mass is not None:
            found.mass[r.trace_id] = r.mass
        if r.group_id is None:
            continue
        found.group[r.trace_id] = r.group_id
        f = figures.setdefault(r.group_id, [0, None, None, r.seq])
        f[3] = max(f[3], r.seq)
        if r.reward is not None:
            f[0] += 1
            f[1] = r.reward if f[1] is None else min(f[1], r.reward)
            f[2] = r.reward if f[2] is None else max(f[2], r.reward)
    groups = sorted((f[3], g, f[0], f[0] >= 1 and f[1] == f[2]) for g, f in figures.items())
    found.flat = [g for _, g, _, zero in groups if zero]
    found.scored = {g: n for _, g, n, _ in groups}
    return found


def _read(con: duckdb.DuckDBPyConnection, trace_ids: Sequence[str]) -> _Traces:
    """What replay needs of ``trace_ids`` (one query; no credit mass)."""
    rows = con.execute(
        "SELECT trace_id, group_id, seq, reward, policy_min, coalesce(policy_unknown, 0) FROM traces "
        "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))",
        [list(trace_ids)],
    ).fetchall()
    return _traces(pool.Row(*r, False, False, None) for r in rows)


def members(
    con: duckdb.DuckDBPyConnection, groups: Sequence[str], selection: Selection, mark: int, k: int | None = None
) -> list[str]:
    """The training members of ``groups`` at ``mark`` (the selection's dropped/eval and tag
    rules; with ``k``, groups older than ``policy - k`` left out whole, prime-rl's rule),
    in trace id order."""
    if not groups:
        return []
    bounded = k is not None and selection.policy is not None
    found = resolve_at(
        con,
        Selection(
            group=list(groups),
            tags=selection.tags,
            include_dropped=selection.include_dropped,
            include_eval=selection.include_eval,
            policy=selection.policy if bounded else None,
            max_staleness=k if bounded else None,
            unknown="keep" if bounded else None,
        ),
        mark,
    )
    return found.trace_ids


def _pool_members(
    con: duckdb.DuckDBPyConnection,
    rows: Sequence[pool.Row],
    groups: set[str],
    selection: Selection,
    mark: int,
    k: int | None,
) -> list[pool.Row]:
    """:func:`members` over rows already read (the traces at or below ``mark``): the same
    rules, the tag filters asked of the store (one query, only when the selection has tags)."""
    tagged = None
    if selection.tags:
        tagged = set(resolve_at(con, Selection(tags=selection.tags), mark).trace_ids)
    kept = [
        r
        for r in rows
        if r.group_id in groups
        and (tagged is None or r.trace_id in tagged)
        and not (selection.include_dropped is False and r.dropped)
        and not (selection.include_eval is False and r.eval)
    ]
    if k is not None and selection.policy is not None:
        bound = selection.policy - k
        oldest: dict[str, int] = {}
        for r in kept:
            if r.policy_min is not None:
                oldest[r.group_id] = min(oldest.get(r.group_id, r.policy_min), r.policy_min)
        kept = [r for r in kept if oldest.get(r.group_id, bound) >= bound]
    return sorted(kept, key=lambda r: r.trace_id)


def use_counts(root: str | Path | None) -> Counter[str]:
    """How many times each group was replayed by the steps whose manifests are under
    ``root`` (a step rebuilt from a manifest is not counted; no directory: no steps).
    A ``manifest.json`` there that is not a tracedb step is refused, named (the counts
    could not be trusted)."""
    counts: Counter[str] = Counter()
    if root is None or not Path(root).is_dir():
        return counts
    for path in sorted(Path(root).rglob(MANIFEST)):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise TraceDBError(f"{path}: cannot read this step manifest to count replays: {e}") from None
        if not isinstance(manifest, dict) or not str(manifest.get("format", "")).startswith("tracedb-micro-batches/"):
            raise TraceDBError(f"{path}: not a tracedb step manifest, under the replay steps_root {root}")
        if manifest.get("rebuilt_from"):
            continue
        for choice in (manifest.get("report") or {}).get("replayed") or []:
            counts[choice["group"]] += 1
    return counts


def _signal(found: _Traces) -> dict[str, tuple[float, float]]:
    """Per group of ``found`` with signal (scored members of different rewards) and credit
    on some sampled token: (mean |A| over its sampled tokens, the population std of its
    scored rewards). Sums run in trace id order over per-trace sums in node order, so equal
    data give equal figures."""
    flat = set(found.flat)
    out = {}
    for group, ids in found.members().items():
        if group in flat or not found.scored.get(group):
            continue
        tokens = sum(found.mass[t][1] for t in ids if t in found.mass)
        if not tokens:
            continue
        scored = np.array([found.reward[t] for t in ids if found.reward[t] is not None], np.float64)
        out[group] = (sum(found.mass[t][0] for t in ids if t in found.mass) / tokens, float(scored.std()))
    return out


def choose(handle: Handle, selection: Selection, selected: Selected, replay: Replay, credit: str | None) -> Swap:
    """Replace the zero-variance groups of ``selected`` (see the module docstring)."""
    k = check(replay, selection)
    con, mark = handle.con, selected.watermark
    read = pool.read(handle, mark, credit, selected.trace_ids)  # the traces up to the watermark, credit mass too
    mine = _traces(read.by_id[t] for t in selected.trace_ids)
    swap = Swap(trace_ids=selected.trace_ids, choices=[])
    if not mine.flat:
        return swap
    taken = set(mine.group.values())
    assert selection.complete_groups is not None  # check() refused it otherwise
    size = selection.complete_groups  # checked by the selection's resolve
    arrived = Counter(r.group_id for r in read.rows if r.group_id is not None and r.group_id not in taken)
    complete = {g for g, n in arrived.items() if n >= size}  # its size-th member arrived by the watermark
    uses = use_counts(replay.steps_root)
    if replay.max_uses is not None:
        complete = {g for g in complete if uses[g] < replay.max_uses}
    found = _traces(_pool_members(con, read.rows, complete, selection, mark, k))
    groups = found.members()
    signal = _signal(found)
    if k is not None and selection.unknown != "keep":  # a group of unknown staleness is no candidate
        signal = {g: v for g, v in signal.items() if not found.unknown.intersection(groups[g])}
    candidates = sorted(signal)
    swap.candidates = len(candidates)
    rng = np.random.default_rng([replay.seed, mark])
    keys = rng.random(len(candidates))
    if replay.priority == "signal":
        order = sorted(range(len(candidates)), key=lambda i: (-_priority(signal[candidates[i]]), keys[i]))
    else:
        order = sorted(range(len(candidates)), key=lambda i: keys[i])
    picks = [candidates[i] for i in order[: len(mine.flat)]]
    for replaced, group in zip(mine.flat, picks, strict=False):
        swap.choices.append(
            {
                "replaced": replaced,
                "group": group,
                "traces": groups[group],
                "priority": _priority(signal[group]) if replay.priority == "signal" else None,
                "uses": uses[group],
            }
        )
    swap.unfilled = len(mine.flat) - len(swap.choices)
    return _apply(swap, mine, found)


def _priority(figures: tuple[float, float]) -> float:
    return figures[0] * figures[1]


def _apply(swap: Swap, mine: _Traces, found: _Traces) -> Swap:
    """The traces to pack once the chosen groups replace theirs (``mine``: the selection's
    traces, ``found``: the replayed ones among others), and the replayed traces' lowest
    policy versions (for the report's staleness figures)."""
    out = {c["replaced"] for c in swap.choices}
    kept = [t for t in swap.trace_ids if mine.group.get(t) not in out]
    swap.replayed = {t for c in swap.choices for t in c["traces"]}
    swap.trace_ids = sorted([*kept, *swap.replayed])
    swap.policy_min = {t: found.policy_min.get(t) for t in swap.replayed}
    return swap


def recorded(handle: Handle, selection: Selection, selected: Selected, replay: Replayed) -> Swap:
    """The recorded choices made again: each replaced group must be a zero-variance group
    of the selection, each replayed group must hold the traces it held
    (:class:`~tracedb.errors.StepChanged` naming the difference otherwise)."""
    check(replay, selection)
    con, mark = handle.con, selected.watermark
    mine = _read(con, selected.trace_ids)
    for choice in replay.choices:
        if choice["replaced"] not in mine.flat:
            raise StepChanged(
                f"group {choice['replaced']} was replaced as zero-variance in the step, and is not a "
                "zero-variance group of its selection now"
            )
    found = _read(con, members(con, [c["group"] for c in replay.choices], selection, mark))
    groups = found.members()
    for choice in replay.choices:
        now, then = set(groups.get(choice["group"], [])), set(choice["traces"])
        if now != then:
            gone, new = sorted(then - now), sorted(now - then)
            what = f"trace {new[0]} is in it now" if new else f"trace {gone[0]} is not in it now"
            raise StepChanged(
                f"replayed group {choice['group']} changed since the step: {what} ({len(new)} new, {len(gone)} gone)"
            )
    swap = Swap(trace_ids=selected.trace_ids, choices=[dict(c) for c in replay.choices])
    swap.unfilled, swap.candidates = len(mine.flat) - len(swap.choices), replay.candidates
    return _apply(swap, mine, found)
