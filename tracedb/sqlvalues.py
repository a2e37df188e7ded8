"""SQL results a person or a JSON reader sees: every value faithful, none a crash.

A query's rows leave DuckDB as Arrow and become Python values, which loses or breaks some
of DuckDB's types: Arrow has no 128-bit integer (DuckDB sends ``HUGEINT`` and
``UHUGEINT`` as ``decimal128(38, 0)``, so a ``UHUGEINT`` of 2^127 or more came back
negative, the maximum as ``-1``); Python's ``datetime`` stops at year 9999 and has no
infinity (``'10000-01-01'::DATE``, ``'infinity'::TIMESTAMP`` raised ``OverflowError``);
``TIME WITH TIME ZONE`` loses its offset, ``BIT``, ``BIGNUM`` and ``GEOMETRY`` arrive as
raw bytes. :func:`portable` casts each such value, wherever it sits (inside lists,
arrays, structs, maps, unions), to DuckDB's own text of it, and keeps every other value
and the nesting as they are. :func:`jsonable` then makes each value one JSON can carry.

The JSON forms (``tracedb sql --json``, ``tracedb lake sql --json``, ``POST /sql``):
integers up to 64 bits are JSON numbers (as ``BIGINT`` and ``UBIGINT`` always were);
``HUGEINT``, ``UHUGEINT``, ``BIGNUM`` and decimals are their exact digits as strings (a JSON
number past 2^53 loses digits in JavaScript); dates, times, timestamps and intervals are
DuckDB's text (``2026-01-02 03:04:05``, ``infinity``, ``294247-01-10 04:00:54.775806``,
``1 year 2 months``); NaN and infinities are null (JSON has neither); blobs are base64.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import math
import uuid
from typing import Any

import duckdb

from tracedb.sqltext import quote_identifier

AS_TEXT = frozenset(
    {
        "hugeint",
        "uhugeint",
        "bignum",
        "varint",
        "date",
        "time",
        "time_ns",
        "time with time zone",
        "timestamp",
        "timestamp_s",
        "timestamp_ms",
        "timestamp_ns",
        "timestamp with time zone",
        "timestamptz_ns",
        "interval",
        "bit",
        "geometry",
    }
)
"""DuckDB type ids whose values come as DuckDB's text of them."""


def text_type(kind: duckdb.DuckDBPyType) -> str | None:
    """The type ``kind``'s values are cast to so that nothing of them is lost on the way to
    Python (:data:`AS_TEXT` replaced by ``VARCHAR`` wherever it sits), or None when
    they arrive whole as they are."""
    name = kind.id
    if name in AS_TEXT:
        return "VARCHAR"
    if name not in ("list", "array", "struct", "map", "union", "tuple"):
        return None
    children = list(kind.children)
    if name in ("list", "array"):
        child = text_type(children[0][1])
        if child is None:
            return None
        return f"{child}[]" if name == "list" else f"{child}[{children[1][1]}]"
    if name == "union":
        children = children[1:]  # the first child is the tag
    members = [(n, t, text_type(t)) for n, t in children]
    if all(target is None for _, _, target in members):
        return None
    texts = [target or str(t) for _, t, target in members]
    if name == "map":
        return f"MAP({texts[0]}, {texts[1]})"
    if name == "tuple":
        return f"TUPLE({', '.join(texts)})"
    fields = ", ".join(f"{quote_identifier(n)} {text}" for (n, _, _), text in zip(members, texts, strict=True))
    return f"{name.upper()}({fields})"


def portable(relation: duckdb.DuckDBPyRelation) -> duckdb.DuckDBPyRelation:
    """``relation`` with each column :func:`text_type` names cast to it (the others as
    they are; names and order kept, also names written twice)."""
    targets = [text_type(t) for t in relation.types]
    if all(t is None for t in targets):
        return relation
    columns = []
    for i, (name, target) in enumerate(zip(relation.columns, targets, strict=True), 1):
        ref = f"#{i}"  # by position: a name may be written twice, or need quoting
        columns.append(f"{ref if target is None else f'CAST({ref} AS {target})'} AS {quote_identifier(name)}")
    return relation.project(", ".join(columns))


def jsonable(value: Any) -> Any:
    """A value of a :func:`portable` result as JSON can carry it (see the module)."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime.date | datetime.time | datetime.timedelta | uuid.UUID):
        return str(value)  # not from a portable result (its temporal values are text): as Python says it
    return str(value)
