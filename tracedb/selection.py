"""Which traces a call takes: the :class:`Selection` value, resolved at one watermark.

A selection is built once at a facade (:class:`tracedb.Database`, the lake's ``Lake``,
``tracedb.client``) from the keyword arguments a user types, and passed down whole: the
views, exports, micro-batches, listings and the lake's readers all take a
``Selection``. Resolving it (:func:`resolve_at`) is one SQL query over any connection
that holds a ``traces`` table (``trace_id``, ``group_id``, ``episode_id``, ``seq``,
``n_tokens``) and a ``trace_tags`` table: a file store's own tables
(:func:`resolve`), or the rows the lake scanned into a connection of their own.

The watermark is the highest ingest sequence number committed (``seq``: 1, 2, ... in
commit order). A selection read at watermark ``W`` takes nothing above ``W``; the result
carries ``W`` (:func:`with_watermark`), the ``after`` of the next call.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import duckdb
import pyarrow as pa

from tracedb.handle import Handle

__all__ = [
    "WATERMARK_KEY",
    "Selected",
    "Selection",
    "check_watermark",
    "completions",
    "pages",
    "resolve",
    "resolve_at",
    "tag_filters",
    "watermark_of",
    "with_watermark",
]


@dataclass(frozen=True)
class Selection:
    """Which traces a view, an export, a listing or a trainer step takes; None everywhere
    is every trace. The filters combine with AND."""

    trace_ids: str | Sequence[str] | None = None
    """Only these traces (one id or several)."""
    group: str | Sequence[str] | None = None
    """``episode.group.id`` (one or several)."""
    episode: str | Sequence[str] | None = None
    """Only traces of these episodes (one id or several)."""
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

    FIELDS: ClassVar[tuple[str, ...]] = ()
    """The field names, in order: every facade method that selects takes each of them."""
    LIVE: ClassVar[tuple[str, ...]] = ("after", "complete_groups", "through", "tags")
    """The fields a consumer of a live run narrows a selection with."""

    @property
    def everything(self) -> bool:
        """True when nothing is filtered (every trace at the current watermark)."""
        return all(getattr(self, name) is None for name in self.FIELDS)

    @property
    def is_live(self) -> bool:
        """True when a live-run field (``after``, ``complete_groups``, ``through``, ``tags``) is set."""
        return any(getattr(self, name) is not None for name in self.LIVE)

    def pinned(self, mark: int) -> Selection:
        """The same selection read as of the watermark ``mark`` (or ``through``, when
        lower): every call made with it selects the same traces, whatever arrives after."""
        through = mark if self.through is None else min(self.through, mark)
        return dataclasses.replace(self, through=through)

    def kwargs(self) -> dict[str, Any]:
        """The fields as the keyword arguments of a facade method (``db.traces(**s.kwargs())``)."""
        return {name: getattr(self, name) for name in self.FIELDS}

    def manifest(self) -> dict[str, Any]:
        """The selection as JSON holds it (pack manifests, plan arguments, the lake):
        id filters as lists, a tag range as a ``[low, high]`` list."""
        out: dict[str, Any] = {}
        for name in self.FIELDS:
            value = getattr(self, name)
            if name == "trace_ids" and value is not None:
                value = values_of(value)
            elif name == "tags" and value is not None:
                value = {str(k): list(v) if isinstance(v, tuple) else v for k, v in value.items()}
            out[name] = value
        return out


Selection.FIELDS = tuple(f.name for f in dataclasses.fields(Selection))


@dataclass
class Selected:
    """A selection resolved at one watermark."""

    traces: list[tuple[str, int]]
    """(trace id, stored tokens) of the selected traces, in trace id order."""
    watermark: int
    """The highest sequence number committed when the selection was made: none of the
    selected traces is above it; pass it as ``after`` next time."""

    @property
    def trace_ids(self) -> list[str]:
        return [tid for tid, _ in self.traces]


# --------------------------------------------------------------------------- watermarks

WATERMARK_KEY = b"tracedb.watermark"
"""The schema metadata key under which a result carries its watermark."""


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


def check_watermark(name: str, value: object) -> None:
    """Refuse a watermark argument (``after``, ``through``) that is not an int >= 0,
    naming it (ValueError)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} is a watermark (an int >= 0), not {value!r}")


# --------------------------------------------------------------------------- tags

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


# --------------------------------------------------------------------------- resolving


def values_of(value: str | Sequence[str]) -> list[str]:
    """An id filter as a list (one id given as a string is one id, not its characters)."""
    return [value] if isinstance(value, str) else list(value)


def _group_size(size: object) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"complete_groups is a group size (an int >= 1), not {size!r}")
    return size


# The groups whose size-th member (by sequence) arrived in (after, mark]: the group
# completion window. Parameters: mark, after, mark, size, after.
_COMPLETED_IN_WINDOW = (
    "group_id IN (SELECT group_id FROM (SELECT group_id, seq, row_number() OVER "
    "(PARTITION BY group_id ORDER BY seq) AS k FROM traces WHERE seq <= ? AND group_id IN "
    "(SELECT group_id FROM traces WHERE seq > ? AND seq <= ?)) WHERE k = ? AND seq > ?)"
)


def resolve_at(con: duckdb.DuckDBPyConnection, selection: Selection, watermark: int) -> Selected:
    """The traces ``selection`` takes among those of ``con``'s ``traces`` table at or
    below ``watermark`` (``through``, when lower), read on ``con`` (which also holds
    ``trace_tags`` when the selection filters on tags). ValueError naming the argument
    for a bad ``after``, ``through``, ``complete_groups`` or tag filter."""
    mark = watermark
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
            params.append(values_of(value))
    after = selection.after
    if after is not None:
        check_watermark("after", after)
    if selection.complete_groups is not None:
        size = _group_size(selection.complete_groups)
        where.append(_COMPLETED_IN_WINDOW)
        params += [mark, after or 0, mark, size, after or 0]
    elif after is not None:
        where.append("seq > ?")
        params.append(after)
    for name, want in (selection.tags or {}).items():
        clause, values = _tag_filter(name, want)
        where.append(clause)
        params += values
    query = "SELECT trace_id, n_tokens FROM traces WHERE " + " AND ".join(where) + " ORDER BY trace_id"
    return Selected([(r[0], r[1]) for r in con.execute(query, params).fetchall()], mark)


def resolve(handle: Handle, selection: Selection) -> Selected:
    """The selected traces of a file store at its current watermark (read first: every
    trace at or below it is committed, since ingests commit in sequence order)."""
    return resolve_at(handle.con, selection, handle.watermark())


def completions(handle: Handle, groups: Sequence[str], size: int, mark: int) -> dict[str, int]:
    """The sequence number at which each of ``groups`` completed: its ``size``-th member's
    among all the traces committed up to ``mark`` (groups not complete there are left out)."""
    table = pa.table({"group_id": pa.array(sorted(set(groups)), pa.string())})
    with handle.registered("_tdb_listed_groups", table):
        rows = handle.con.execute(
            "SELECT group_id, seq FROM (SELECT group_id, seq, row_number() OVER (PARTITION BY group_id "
            "ORDER BY seq) AS k FROM traces WHERE seq <= ? AND group_id IN "
            "(SELECT group_id FROM _tdb_listed_groups)) WHERE k = ?",
            [mark, _group_size(size)],
        ).fetchall()
    return {r[0]: r[1] for r in rows}


# --------------------------------------------------------------------------- paging


def pages(sizes: Sequence[int], budget: int, *, overshoot: bool) -> Iterator[slice]:
    """Cut items of these sizes, in the order given, into consecutive pages by a size
    budget. ``overshoot=True``: a page closes once it reaches the budget, so it may pass it
    by its last item (a streamed export's batches). ``overshoot=False``: a page stops before
    the item that would pass the budget (an answer that must stay within a limit); an item
    alone over the budget is a page by itself, which the caller refuses or takes. Every
    item is in exactly one page; no items, no pages."""
    start, acc = 0, 0
    for i, size in enumerate(sizes):
        if not overshoot and acc and acc + size > budget:
            yield slice(start, i)
            start, acc = i, 0
        acc += size
        if overshoot and acc >= budget:
            yield slice(start, i + 1)
            start, acc = i + 1, 0
    if start < len(sizes):
        yield slice(start, len(sizes))
