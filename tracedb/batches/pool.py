"""What replay reads of the store, once per step: every trace at or below the step's
watermark with the fields choosing needs (group, sequence number, reward, lowest policy
version, unknown-version tokens, dropped, eval) and its absolute credit mass in the
step's credit set (the macro ``credit_abs_mass()``), in one query.

The rows are kept per database (every handle of it, :attr:`Handle.shared`) for the
database's write generation and the credit set: a trace at or below a watermark already
read does not change until something is written (every write bumps the generation), so
the next step with a higher watermark reads only the traces above the last one (a
trainer reading a finished run, or several calls at one watermark: the rebuilt checks,
each rank's call). Any write drops what was kept; a read inside an open transaction
(whose writes are not counted yet) neither takes nor keeps rows. One entry is kept per
database, the last credit set's.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import duckdb

from tracedb.handle import Handle


class Row(NamedTuple):
    """One trace as replay reads it."""

    trace_id: str
    group_id: str | None
    seq: int
    reward: float | None
    policy_min: int | None
    unknown: int
    """Its sampled tokens of unknown policy version (0 when none)."""
    dropped: bool
    eval: bool
    mass: tuple[float, int] | None
    """(sum of |A| over its sampled tokens in node order, the tokens assigned) in the credit
    set read; None when the set assigns none of its nodes."""


_COLUMNS = (
    "t.trace_id, t.group_id, t.seq, t.reward, t.policy_min, coalesce(t.policy_unknown, 0), "
    "t.dropped IS NOT NULL, t.work_type IS NOT DISTINCT FROM 'eval'"
)
_QUERY = (
    f"SELECT {_COLUMNS}, m.a, m.n, m.present FROM traces t LEFT JOIN ("
    "SELECT trace_id, sum(abs_sum ORDER BY node_index) AS a, sum(n_sampled) AS n, true AS present "
    "FROM credit_abs_mass(credit := ?) WHERE trace_id IN (SELECT trace_id FROM traces WHERE seq > ? AND seq <= ?) "
    "GROUP BY trace_id) m USING (trace_id) WHERE t.seq > ? AND t.seq <= ? ORDER BY t.seq"
)


@dataclass
class _Entry:
    generation: int
    credit: str
    upto: int = 0
    rows: list[Row] = field(default_factory=list)
    """In sequence order."""
    seqs: list[int] = field(default_factory=list)
    by_id: dict[str, Row] = field(default_factory=dict)


_LOCK = threading.Lock()
_KEPT: weakref.WeakKeyDictionary[object, _Entry] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Pool:
    """The traces at or below one watermark, as replay reads them."""

    rows: list[Row]
    """In sequence order."""
    by_id: dict[str, Row]
    """Trace id -> its row (may hold traces above the watermark: look up only ids at or below it)."""


def _fetch(con: duckdb.DuckDBPyConnection, credit: str, after: int, mark: int) -> list[Row]:
    found = con.execute(_QUERY, [credit, after, mark, after, mark]).fetchall()
    return [
        Row(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), bool(r[7]), (r[8] or 0.0, r[9] or 0) if r[10] else None)
        for r in found
    ]


def read(handle: Handle, mark: int, credit: str | None, need: Sequence[str] = ()) -> Pool:
    """The traces at or below ``mark`` with their credit mass in ``credit`` (None: the
    default set), read once per write generation and credit set (see the module);
    ``by_id`` holds ``need`` too (a group-count selection's members may have arrived after
    its watermark: then the rows up to the store's watermark are read)."""
    name = "default" if credit is None else credit
    if handle.in_transaction:
        rows = _fetch(handle.con, name, 0, max(mark, handle.watermark()))
        return Pool([r for r in rows if r.seq <= mark], {r.trace_id: r for r in rows})
    generation = handle.generation
    with _LOCK:
        entry = _KEPT.get(handle.shared)
        if entry is None or entry.generation != generation or entry.credit != name:
            entry = _Entry(generation, name)
            _KEPT[handle.shared] = entry
        _extend(handle, entry, mark)
        if any(t not in entry.by_id for t in need):
            _extend(handle, entry, handle.watermark())
        return Pool(entry.rows[: bisect.bisect_right(entry.seqs, mark)], entry.by_id)


def _extend(handle: Handle, entry: _Entry, mark: int) -> None:
    if mark > entry.upto:
        new = _fetch(handle.con, entry.credit, entry.upto, mark)
        entry.rows.extend(new)
        entry.seqs.extend(r.seq for r in new)
        entry.by_id.update((r.trace_id, r) for r in new)
        entry.upto = mark
