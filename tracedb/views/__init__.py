"""Branch-spread token views: one row per root-to-leaf branch, aligned per-token arrays.

- :mod:`~tracedb.views.nodes`: the selection's nodes, segments and branches read from
  DuckDB into columns (:func:`~tracedb.views.nodes.load_nodes`; the writers and credit
  algorithms read nodes through it too);
- :mod:`~tracedb.views.spread` + :mod:`~tracedb.views._kernels`: the spreading rule,
  written by compiled loops;
- :mod:`~tracedb.views._buffers`: view memory kept mapped between views.

Here: the view cache and the two entry points, :func:`branches` (one table) and
:func:`iter_branches` (batches of whole traces, for exports that must stay within
bounded memory). Which traces a view takes is a :class:`~tracedb.selection.Selection`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

from tracedb import credit_sets, runtime
from tracedb.handle import Handle
from tracedb.records import COMPACT_STREAMS
from tracedb.selection import Selection, pages, resolve, watermark_of, with_watermark
from tracedb.tables import BRANCH_SCHEMA, TOKEN_COLUMNS
from tracedb.views import versions
from tracedb.views.nodes import load_nodes
from tracedb.views.spread import branch_table

if TYPE_CHECKING:
    import polars

__all__ = ["BRANCH_SCHEMA", "branches", "iter_branches", "to_polars"]


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
    mark: int | None = None,
) -> pa.Table:
    """The view of ``trace_ids`` (None: all), carrying ``mark`` (default: the watermark
    its read saw) as its watermark."""
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
    if "policy_version" in cols:
        versions.attach(handle, data)
    table = branch_table(data, cols, train_once, trainable, branch_index)
    return with_watermark(table, data.watermark if mark is None else mark)


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
    until its next write, so repeated views of the same selection skip the database. The
    table carries the watermark it was read at (:func:`watermark_of`)."""
    cols = token_columns(columns)
    credit = credit_sets.resolve(handle, credit)
    indices = branch_indices(branch_index)
    if selection.everything:
        return _view(handle, None, cols, train_once, trainable, indices, credit, cache=True)
    selected = resolve(handle, selection)
    ids = [tid for tid, _ in selected.traces]
    return _view(handle, ids, cols, train_once, trainable, indices, credit, cache=True, mark=selected.watermark)


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
    from here). Every batch carries the watermark the selection was made at, and holds
    no trace above it."""
    cols = token_columns(columns)
    credit = credit_sets.resolve(handle, credit)
    indices = branch_indices(branch_index)
    resolved = resolve(handle, selection)
    selected, mark = resolved.traces, resolved.watermark
    if selection.everything and sum(size for _, size in selected) < batch_tokens:  # one batch: the whole-database read
        table = _view(handle, None, cols, train_once, trainable, indices, credit, cache=False)
        if watermark_of(table) == mark:  # nothing was committed since the selection
            yield table
            return
    ids = [tid for tid, _ in selected]
    for page in pages([size for _, size in selected], batch_tokens, overshoot=True):
        yield _view(handle, ids[page], cols, train_once, trainable, indices, credit, cache=False, mark=mark)
    if not selected:
        yield _view(handle, [], cols, train_once, trainable, indices, credit, cache=False, mark=mark)


def to_polars(table: pa.Table) -> polars.DataFrame:
    """A branch view as a Polars DataFrame (zero-copy where Arrow allows)."""
    import polars as pl

    return pl.from_arrow(table)
