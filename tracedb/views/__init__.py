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

import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tracedb import credit_sets, runtime
from tracedb.handle import Handle
from tracedb.records import COMPACT_STREAMS
from tracedb.tables import BRANCH_SCHEMA, TOKEN_COLUMNS
from tracedb.views.nodes import load_nodes
from tracedb.views.spread import branch_table

if TYPE_CHECKING:
    import polars

__all__ = [
    "BRANCH_SCHEMA",
    "Selected",
    "Selection",
    "branches",
    "check_watermark",
    "iter_branches",
    "resolve",
    "select_traces",
    "to_polars",
    "watermark_of",
    "with_watermark",
]


@dataclass(frozen=True)
class Selection:
    """Which traces a view (or an export, or a trainer step) takes; None everywhere is
    every trace. The filters combine with AND."""

    trace_ids: Sequence[str] | None = None
    group: str | Sequence[str] | None = None
    """``episode.group.id`` (one or several)."""
    episode: str | Sequence[str] | None = None
    after: int | None = None
    """Only traces whose ingest sequence number is above this: what arrived since a
    consumer last looked (pass the watermark the previous call returned)."""
    complete_groups: int | None = None
    """Only the groups that have at least this many members and completed after ``after``
    (a group completes when its N-th member arrives; that member's sequence number is the
    group's), with every member they hold at the watermark: a consumer passing each
    call's watermark to the next gets each group once, in the call after it completed."""
    tags: Mapping[str, Any] | None = None
    """Ingest tags (``trace_tags``): name -> a value (equal; numbers compare as numbers)
    or a ``(low, high)`` pair (inclusive; None leaves a side open)."""
    through: int | None = None
    """Read as of this watermark (default: the current one): nothing above it is taken,
    so two calls with the same ``after`` and ``through`` select the same traces, however
    much arrived in between (a watermark above the current one is the current one)."""

    @property
    def everything(self) -> bool:
        return all(
            v is None
            for v in (
                self.trace_ids,
                self.group,
                self.episode,
                self.after,
                self.complete_groups,
                self.tags,
                self.through,
            )
        )


@dataclass
class Selected:
    """A selection resolved against the database at one watermark."""

    traces: list[tuple[str, int]]
    """(trace id, stored tokens) of the selected traces, in trace id order."""
    watermark: int
    """The highest sequence number committed when the selection was made: none of the
    selected traces is above it; pass it as ``after`` next time."""


WATERMARK_KEY = b"tracedb.watermark"
"""The schema metadata key under which a view carries its watermark."""


def with_watermark(table: pa.Table, watermark: int) -> pa.Table:
    """``table`` carrying ``watermark`` in its schema metadata (no data is copied)."""
    metadata = dict(table.schema.metadata or {})
    metadata[WATERMARK_KEY] = str(watermark).encode()
    return table.replace_schema_metadata(metadata)


def watermark_of(table: pa.Table | pa.Schema) -> int | None:
    """The watermark a view (or an exported file's schema) was read at: pass it as
    ``after=`` to get what arrived since; None for a table that carries none."""
    schema = table if isinstance(table, pa.Schema) else table.schema
    value = (schema.metadata or {}).get(WATERMARK_KEY)
    return None if value is None else int(value)


_TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")


def _tag_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def tag_filters(values: Sequence[str] | None) -> dict[str, Any] | None:
    """Tag filters as text (``--tag``, ``?tag=``) as :class:`Selection`'s ``tags``:
    ``name=VALUE`` (equal; the value read as JSON when it is JSON, so ``12`` is a number
    and compares as one) or ``name=LOW..HIGH`` (inclusive, either end may be left
    empty). ValueError with the reason otherwise."""
    if not values:
        return None
    out: dict[str, Any] = {}
    for text in values:
        name, sep, spec = text.partition("=")
        name = name.strip()
        if not sep or not _TAG_NAME.match(name):
            raise ValueError(f"expected name=value or name=low..high, got {text!r}")
        if name in out:
            raise ValueError(f"{name!r} is given twice (one filter per tag; a range is name=low..high)")
        value = _tag_value(spec)
        if isinstance(value, str) and ".." in spec:
            low, high = (None if not end.strip() else _tag_value(end.strip()) for end in spec.split("..", 1))
            ends = [v for v in (low, high) if v is not None]
            numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in ends)
            if not (numbers or all(isinstance(v, str) for v in ends)):
                raise ValueError(f"a range's ends are both numbers or both strings, not {text!r}")
            value = (low, high)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{text!r} is not a finite number")
        out[name] = value
    return out


def _values(value: str | Sequence[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def _tag_filter(name: str, want: Any) -> tuple[str, list[Any]]:
    """SQL (a subquery of trace ids) for one tag filter, and its parameters."""
    base = "trace_id IN (SELECT trace_id FROM trace_tags WHERE name = ? AND "
    if isinstance(want, tuple):
        if len(want) != 2:
            raise ValueError(f"tag {name!r}: a range is (low, high), not {want!r}")
        low, high = want
        ends = [v for v in want if v is not None]
        if not ends:
            return base + "true)", [name]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in ends):
            column = "number"
        elif all(isinstance(v, str) for v in ends):
            column = "text"
        else:
            raise ValueError(f"tag {name!r}: a range's ends are both numbers or both strings, not {want!r}")
        parts, params = [f"{column} IS NOT NULL"], [name]
        if low is not None:
            parts.append(f"{column} >= ?")
            params.append(low)
        if high is not None:
            parts.append(f"{column} <= ?")
            params.append(high)
        return base + " AND ".join(parts) + ")", params
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return base + "number = ?)", [name, float(want)]
    if isinstance(want, str):
        return base + "text = ?)", [name, want]
    return base + "value = ?::JSON)", [name, json.dumps(want, separators=(",", ":"))]


def check_watermark(name: str, value: object) -> None:
    """Refuse a watermark argument (``after``, ``through``) that is not an int >= 0,
    naming it (ValueError)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is a watermark (an int >= 0), not {value!r}")


def resolve(handle: Handle, selection: Selection) -> Selected:
    """The selected traces at the current watermark (read first: every trace at or
    below it is committed, since ingests commit in sequence order)."""
    mark = handle.watermark()
    through = selection.through
    if through is not None:
        check_watermark("through", through)
        mark = min(mark, through)
    where, params = ["seq <= ?"], [mark]
    for column, value in (
        ("trace_id", selection.trace_ids),
        ("group_id", selection.group),
        ("episode_id", selection.episode),
    ):
        if value is not None:
            where.append(f"{column} IN (SELECT unnest(?::VARCHAR[]))")
            params.append(_values(value))
    after = selection.after
    if after is not None:
        check_watermark("after", after)
    size = selection.complete_groups
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"complete_groups is a group size (an int >= 1), not {size!r}")
        # The groups whose size-th member (by sequence) arrived in (after, mark].
        where.append(
            "group_id IN (SELECT group_id FROM (SELECT group_id, seq, row_number() OVER "
            "(PARTITION BY group_id ORDER BY seq) AS k FROM traces WHERE seq <= ? AND group_id IN "
            "(SELECT group_id FROM traces WHERE seq > ? AND seq <= ?)) WHERE k = ? AND seq > ?)"
        )
        params += [mark, after or 0, mark, size, after or 0]
    elif after is not None:
        where.append("seq > ?")
        params.append(after)
    for name, want in (selection.tags or {}).items():
        clause, values = _tag_filter(name, want)
        where.append(clause)
        params += values
    query = "SELECT trace_id, n_tokens FROM traces WHERE " + " AND ".join(where) + " ORDER BY trace_id"
    return Selected([(r[0], r[1]) for r in handle.con.execute(query, params).fetchall()], mark)


def select_traces(handle: Handle, selection: Selection) -> list[tuple[str, int]]:
    """(trace id, stored tokens) of the selected traces, in trace id order."""
    return resolve(handle, selection).traces


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
    chunk: list[str] = []
    acc = 0
    for tid, size in selected:
        chunk.append(tid)
        acc += size
        if acc >= batch_tokens:
            yield _view(handle, chunk, cols, train_once, trainable, indices, credit, cache=False, mark=mark)
            chunk, acc = [], 0
    if chunk or not selected:
        yield _view(handle, chunk, cols, train_once, trainable, indices, credit, cache=False, mark=mark)


def to_polars(table: pa.Table) -> polars.DataFrame:
    """A branch view as a Polars DataFrame (zero-copy where Arrow allows)."""
    import polars as pl

    return pl.from_arrow(table)
