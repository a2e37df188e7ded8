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
    policy: int | None = None
    """The trainer's policy version ``V`` that staleness is measured from (with
    ``max_staleness``)."""
    max_staleness: int | None = None
    """``K``: a group (traces sharing a group id; a trace without one is its own group) is
    stale when its oldest member's ``policy_min`` is below ``V - K``; a stale group is left
    out whole (``stale="drop"``, prime-rl's rule) or kept with its tokens older than
    ``V - K`` out of the loss (``stale="mask"``)."""
    stale: str | None = None
    """``"drop"`` (default) or ``"mask"``: what a staleness bound does to a stale group."""
    unknown: str | None = None
    """Under a staleness bound, a trace with a sampled token of unknown policy version is
    refused (default, naming it and how to map its labels), or ``"keep"`` (its known
    tokens decide) or ``"drop"`` (left out)."""
    include_dropped: bool | None = None
    """Dropped traces (verifiers' ``Trace.dropped``): None is the output's own default
    (training outputs leave them out, analysis outputs keep them), True keeps, False leaves out."""
    include_eval: bool | None = None
    """Traces of ``work_type="eval"`` episodes, as ``include_dropped``."""
    max_groups: int | None = None
    """At most this many groups, oldest first (by completion: the ``complete_groups``-th
    member's sequence number, else the newest member's); the watermark is then the last
    group's, so the next call's ``after`` takes the rest (a trainer's fixed batch)."""

    FIELDS: ClassVar[tuple[str, ...]] = ()
    """The field names, in order: every facade method that selects takes each of them."""
    LIVE: ClassVar[tuple[str, ...]] = (
        *("after", "complete_groups", "through", "tags", "policy", "max_staleness", "stale", "unknown"),
        *("include_dropped", "include_eval", "max_groups"),
    )
    """The fields that narrow a selection beyond its ids (a live run's consumer's)."""
    STALE: ClassVar[tuple[str, ...]] = ("drop", "mask")
    UNKNOWN: ClassVar[tuple[str, ...]] = ("refuse", "keep", "drop")

    def for_training(self) -> Selection:
        """The selection a training output (micro-batches, a pack, a trainable-only export,
        group credit) takes: dropped traces and eval episodes left out unless asked for."""
        return dataclasses.replace(
            self,
            include_dropped=False if self.include_dropped is None else self.include_dropped,
            include_eval=False if self.include_eval is None else self.include_eval,
        )

    @property
    def bound(self) -> int | None:
        """``V - K``: the oldest policy version a loss token may have (None: no bound)."""
        return None if self.policy is None else self.policy - (self.max_staleness or 0)

    @property
    def everything(self) -> bool:
        """True when nothing is filtered (every trace at the current watermark)."""
        return all(getattr(self, name) is None for name in self.FIELDS)

    @property
    def is_live(self) -> bool:
        """True when a field beyond the id filters is set (``after``, ``complete_groups``,
        ``through``, ``tags``, the staleness and group-count fields)."""
        return any(getattr(self, name) is not None for name in self.LIVE)

    def pinned(self, mark: int) -> Selection:
        """The same selection read as of the watermark ``mark`` (or ``through``, when
        lower): every call made with it selects the same traces, whatever arrives after."""
        through = mark if self.through is None else min(self.through, mark)
        return dataclasses.replace(self, through=through)

    def check(self) -> Selection:
        """This selection, once every field holds a value of its kind (watermarks,
        group sizes, tag filters, the staleness and group-count fields); ValueError naming
        the field otherwise. What needs the data (which traces exist) is for
        :func:`resolve_at`: a shell checks what was typed before it opens anything."""
        for name in ("after", "through"):
            if getattr(self, name) is not None:
                check_watermark(name, getattr(self, name))
        if self.complete_groups is not None:
            _group_size(self.complete_groups)
        for name, want in (self.tags or {}).items():
            _tag_filter(name, want)
        _check_async(self)
        return self

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Selection:
        """The selection a facade method was called with, from its arguments by name
        (``Selection.of(locals())`` first thing in the method): every facade method spells
        each field in its signature (``tests/test_architecture.py``), and the value is
        built here by name, never by position."""
        return cls(**{name: arguments[name] for name in cls.FIELDS})

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
    report: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What the selection left out and why: ``dropped``, ``eval`` (traces), ``stale_groups``,
    ``stale_traces``, ``unknown`` (traces of unknown version left out), ``groups_over``
    (groups past ``max_groups``); with a staleness bound, ``policy``, ``bound`` and the
    selected traces' ``staleness`` (``V - policy_min``: ``mean``, ``max``)."""
    policy_min: dict[str, int | None] = dataclasses.field(default_factory=dict)
    """Each selected trace's lowest known policy version, when a staleness bound was given."""

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
    _check_async(selection)
    if not _narrowed(selection):
        query = "SELECT trace_id, n_tokens FROM traces WHERE " + " AND ".join(where) + " ORDER BY trace_id"
        return Selected([(r[0], r[1]) for r in con.execute(query, params).fetchall()], mark)
    columns = ["trace_id", "n_tokens", "seq", "group_id"]
    columns.append("dropped IS NOT NULL AS is_dropped" if selection.include_dropped is False else "false")
    if selection.include_eval is False:
        columns.append("work_type IS NOT DISTINCT FROM 'eval' AS is_eval")
    else:
        columns.append("false")
    if selection.policy is not None:
        columns += ["policy_min", "coalesce(policy_unknown, 0)"]
    else:
        columns += ["NULL", "0"]
    query = f"SELECT {', '.join(columns)} FROM traces WHERE " + " AND ".join(where) + " ORDER BY trace_id"
    # A trace without a group is its own group: its unit is (None, trace id).
    rows = [
        (r[0], r[1], r[2], (r[3], None) if r[3] is not None else (None, r[0]), *r[4:])
        for r in con.execute(query, params).fetchall()
    ]
    return _narrow(con, selection, rows, mark)


def _check_async(selection: Selection) -> None:
    """Refuse a bad staleness, unknown-version or group-count argument, naming it."""
    policy, k = selection.policy, selection.max_staleness
    for name, value in (("policy", policy), ("max_staleness", k)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name} is a policy version count (an int), not {value!r}")
    if (policy is None) != (k is None):
        given, missing = ("policy", "max_staleness") if k is None else ("max_staleness", "policy")
        raise ValueError(f"{given} needs {missing} too: a staleness bound is policy=V, max_staleness=K")
    if k is not None and k < 0:
        raise ValueError(f"max_staleness is a number of policy versions (an int >= 0), not {k!r}")
    if selection.stale is not None and selection.stale not in Selection.STALE:
        raise ValueError(f"stale is one of {list(Selection.STALE)}, not {selection.stale!r}")
    if selection.unknown is not None and selection.unknown not in Selection.UNKNOWN:
        raise ValueError(f"unknown is one of {list(Selection.UNKNOWN)}, not {selection.unknown!r}")
    if (selection.stale is not None or selection.unknown is not None) and policy is None:
        raise ValueError("stale and unknown say what a staleness bound does: give policy and max_staleness too")
    for name in ("include_dropped", "include_eval"):
        value = getattr(selection, name)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"{name} is True or False (or None: the output's default), not {value!r}")
    size = selection.max_groups
    if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"max_groups is a number of groups (an int >= 1), not {size!r}")


def _narrowed(selection: Selection) -> bool:
    return (
        selection.policy is not None
        or selection.include_dropped is False
        or selection.include_eval is False
        or selection.max_groups is not None
    )


UNKNOWN_ADVICE = (
    "map its weight labels to policy versions (db.set_policy_versions({'LABEL': N}), "
    "tracedb policy-versions --set LABEL=N), or pass unknown='keep' or 'drop' (--unknown keep|drop)"
)


def _narrow(con: duckdb.DuckDBPyConnection, selection: Selection, rows: list[tuple], mark: int) -> Selected:
    """Apply the training rules to the candidate rows ``(trace_id, n_tokens, seq, unit,
    is_dropped, is_eval, policy_min, unknown tokens)``: dropped and eval traces, the
    staleness bound per group, the group count."""
    report: dict[str, Any] = {"dropped": 0, "eval": 0}
    kept = []
    for row in rows:
        if row[4]:
            report["dropped"] += 1
        elif row[5]:
            report["eval"] += 1
        else:
            kept.append(row)
    policy_min: dict[str, int | None] = {}
    bound = selection.bound
    if bound is not None:
        unknown = selection.unknown or "refuse"
        report.update(policy=selection.policy, bound=bound, unknown=0, stale_groups=0, stale_traces=0)
        if unknown == "refuse":
            for row in kept:
                if row[7]:
                    raise ValueError(
                        f"trace {row[0]!r} has {row[7]} sampled tokens of unknown policy version, so its staleness "
                        f"cannot be told: {UNKNOWN_ADVICE}"
                    )
        elif unknown == "drop":
            report["unknown"] = sum(1 for row in kept if row[7])
            kept = [row for row in kept if not row[7]]
        oldest: dict[Any, int] = {}
        for row in kept:
            if row[6] is not None:
                oldest[row[3]] = min(oldest.get(row[3], row[6]), row[6])
        stale = {unit for unit, low in oldest.items() if low < bound}
        report["stale_groups"] = len(stale)
        if (selection.stale or "drop") == "drop":
            report["stale_traces"] = sum(1 for row in kept if row[3] in stale)
            kept = [row for row in kept if row[3] not in stale]
        else:
            report["stale_traces"] = sum(1 for row in kept if row[3] in stale)
        policy_min = {row[0]: row[6] for row in kept}
    if selection.max_groups is not None:
        kept, mark, report["groups_over"] = _first_groups(con, selection, kept, mark)
    if bound is not None:
        ages = [selection.policy - low for low in (policy_min.get(row[0]) for row in kept) if low is not None]
        report["staleness"] = {
            "mean": sum(ages) / len(ages) if ages else None,
            "max": max(ages) if ages else None,
        }
        policy_min = {row[0]: policy_min.get(row[0]) for row in kept}
    return Selected([(row[0], row[1]) for row in kept], mark, report, policy_min)


def _first_groups(
    con: duckdb.DuckDBPyConnection, selection: Selection, rows: list[tuple], mark: int
) -> tuple[list[tuple], int, int]:
    """The rows of the ``max_groups`` oldest groups (by completion), the watermark that
    ends at the last of them, and how many groups were past it."""
    done: dict[tuple[str | None, str | None], int] = {}
    for row in rows:
        done[row[3]] = max(done.get(row[3], 0), row[2])  # the newest member
    if selection.complete_groups is not None:
        ids = [u[0] for u in done if u[0] is not None]
        found = completions_at(con, ids, selection.complete_groups, mark)
        done.update({(g, None): seq for g, seq in found.items()})
    order = sorted(done, key=lambda u: (done[u], str(u)))
    size = selection.max_groups
    assert size is not None
    if len(order) <= size:
        return rows, mark, 0
    taken = set(order[:size])
    return [row for row in rows if row[3] in taken], done[order[size - 1]], len(order) - size


def resolve(handle: Handle, selection: Selection) -> Selected:
    """The selected traces of a file store at its current watermark (read first: every
    trace at or below it is committed, since ingests commit in sequence order)."""
    return resolve_at(handle.con, selection, handle.watermark())


def completions(handle: Handle, groups: Sequence[str], size: int, mark: int) -> dict[str, int]:
    """The sequence number at which each of ``groups`` completed: its ``size``-th member's
    among all the traces committed up to ``mark`` (groups not complete there are left out)."""
    return completions_at(handle.con, groups, size, mark)


def completions_at(con: duckdb.DuckDBPyConnection, groups: Sequence[str], size: int, mark: int) -> dict[str, int]:
    """:func:`completions` over any connection holding ``traces``."""
    rows = con.execute(
        "SELECT group_id, seq FROM (SELECT group_id, seq, row_number() OVER (PARTITION BY group_id "
        "ORDER BY seq) AS k FROM traces WHERE seq <= ? AND group_id IN "
        "(SELECT unnest(?::VARCHAR[]))) WHERE k = ?",
        [mark, sorted(set(groups)), _group_size(size)],
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
