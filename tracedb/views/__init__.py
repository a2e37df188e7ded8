"""Branch-spread token views: one row per root-to-leaf branch, aligned per-token arrays.

- :mod:`~tracedb.views.nodes`: the selection's nodes, segments and branches read from
  DuckDB into columns (:func:`~tracedb.views.nodes.load_nodes`; the writers and credit
  algorithms read nodes through it too);
- :mod:`~tracedb.views.spread` + :mod:`~tracedb.views._kernels`: the spreading rule,
  written by compiled loops;
- :mod:`~tracedb.views._buffers`: view memory kept mapped between views.

Here: which traces a view selects (:class:`Selection`), the view cache, and the two
entry points, :func:`branches` (one table) and :func:`iter_branches` (batches of whole
traces, for exports that must stay within bounded memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

from tracedb import credit_sets, runtime
from tracedb.handle import Handle
from tracedb.records import COMPACT_STREAMS
from tracedb.tables import BRANCH_SCHEMA, TOKEN_COLUMNS
from tracedb.views.nodes import load_nodes
from tracedb.views.spread import branch_table

if TYPE_CHECKING:
    import polars

__all__ = ["BRANCH_SCHEMA", "Selection", "branches", "iter_branches", "select_traces", "to_polars"]


@dataclass(frozen=True)
class Selection:
    """Which traces a view (or an export) takes; None everywhere is every trace."""

    trace_ids: Sequence[str] | None = None
    group: str | Sequence[str] | None = None
    """``episode.group.id`` (one or several)."""
    episode: str | Sequence[str] | None = None

    @property
    def everything(self) -> bool:
        return self.trace_ids is None and self.group is None and self.episode is None


def select_traces(handle: Handle, selection: Selection) -> list[tuple[str, int]]:
    """(trace id, stored tokens) of the selected traces, in trace id order."""
    where, params = [], []
    for column, value in (
        ("trace_id", selection.trace_ids),
        ("group_id", selection.group),
        ("episode_id", selection.episode),
    ):
        if value is None:
            continue
        values = [value] if isinstance(value, str) else list(value)
        where.append(f"{column} IN (SELECT unnest(?::VARCHAR[]))")
        params.append(values)
    query = "SELECT trace_id, n_tokens FROM traces"
    if where:
        query += " WHERE " + " AND ".join(where)
    query += " ORDER BY trace_id"
    return [(r[0], r[1]) for r in handle.con.execute(query, params).fetchall()]


def token_columns(columns: Sequence[str] | None) -> list[str]:
    """The token columns a view asked for ``columns`` has, in view order (ValueError for
    a name a branch view does not have)."""
    if columns is None:
        return list(TOKEN_COLUMNS)
    unknown = [c for c in columns if c not in BRANCH_SCHEMA.names]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; a branch view has {BRANCH_SCHEMA.names}")
    return [c for c in TOKEN_COLUMNS if c in columns]


def branch_indices(branch_index: int | Sequence[int] | None) -> list[int] | None:
    """``branch_index`` as a list (TypeError for anything but ints)."""
    if branch_index is None:
        return None
    values = [branch_index] if isinstance(branch_index, int) else list(branch_index)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TypeError(f"branch_index takes an int or a list of ints, not {branch_index!r}")
    return values


def _view(
    handle: Handle,
    trace_ids: list[str] | None,
    cols: list[str],
    train_once: bool,
    trainable: bool | None,
    branch_index: list[int] | None,
    credit: str | None,
    cache: bool,
) -> pa.Table:
    streams = [c for c in COMPACT_STREAMS if c in cols]
    key = (handle.generation, None if trace_ids is None else tuple(trace_ids), credit)
    data = None
    cached = handle.view_cache
    if cache and cached is not None and cached[0] == key and set(streams) <= set(cached[1].streams):
        data = cached[1]
    if data is None:
        data = load_nodes(handle, trace_ids, streams, credit)
        if cache and data.starts[-1] <= runtime.settings().view_cache_tokens:
            handle.view_cache = (key, data)
    return branch_table(data, cols, train_once, trainable, branch_index)


def branches(
    handle: Handle,
    selection: Selection = Selection(),
    *,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
) -> pa.Table:
    """One row per branch of the selected traces, ordered by trace id then branch index;
    see :meth:`tracedb.Database.branches`. Decoded node columns are cached on the handle
    until its next write, so repeated views of the same selection skip the database."""
    cols = token_columns(columns)
    credit = credit_sets.resolve(handle, credit)
    selected = None if selection.everything else [tid for tid, _ in select_traces(handle, selection)]
    return _view(handle, selected, cols, train_once, trainable, branch_indices(branch_index), credit, cache=True)


def iter_branches(
    handle: Handle,
    selection: Selection = Selection(),
    *,
    trainable: bool | None = None,
    branch_index: int | Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
    batch_tokens: int = 16_000_000,
) -> Iterator[pa.Table]:
    """:func:`branches` in batches of whole traces, about ``batch_tokens`` stored tokens
    each: memory stays bounded by the batch whatever the database size (exports stream
    from here)."""
    cols = token_columns(columns)
    credit = credit_sets.resolve(handle, credit)
    indices = branch_indices(branch_index)
    selected = select_traces(handle, selection)
    if selection.everything and sum(size for _, size in selected) < batch_tokens:  # one batch: the whole-database read
        yield _view(handle, None, cols, train_once, trainable, indices, credit, cache=False)
        return
    chunk: list[str] = []
    acc = 0
    for tid, size in selected:
        chunk.append(tid)
        acc += size
        if acc >= batch_tokens:
            yield _view(handle, chunk, cols, train_once, trainable, indices, credit, cache=False)
            chunk, acc = [], 0
    if chunk or not selected:
        yield _view(handle, chunk, cols, train_once, trainable, indices, credit, cache=False)


def to_polars(table: pa.Table) -> polars.DataFrame:
    """A branch view as a Polars DataFrame (zero-copy where Arrow allows)."""
    import polars as pl

    return pl.from_arrow(table)
