"""SQL text: the ``.sql`` files shipped with tracedb and the one quoting helper.

The DDL and macros live in ``schema/*.sql`` (shipped as the package data
``tracedb.schema``, in a wheel and in an editable install alike, so there is one lookup).
Identifiers go through :func:`quote_identifier`; values are bound parameters, never
formatted into a statement. :func:`quote_literal` is for the few statements DuckDB takes
no parameters in (``ATTACH``, ``SET``).
"""

from __future__ import annotations

from importlib import resources

WATERMARK_KEY = "last_seq"
"""The ``tracedb_meta`` key holding the watermark (the highest ingest sequence number)."""


def load_sql(name: str) -> str:
    """The text of ``schema/<name>`` (e.g. ``tables.sql``)."""
    return resources.files("tracedb.schema").joinpath(name).read_text(encoding="utf-8")


def quote_identifier(name: str) -> str:
    """A SQL identifier, double-quoted (values never go through here: they are bound)."""
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    """A SQL string literal, for the statements that take no bound parameters."""
    return "'" + text.replace("'", "''") + "'"
