"""The read commands through a server (``--url``, env ``TRACEDB_URL``): where ``tracedb
serve`` owns the file (it follows a run, or holds a write token), ``sql``, ``stats`` and
``branches`` ask it over REST instead of opening the file, and get what a local read
gives, within the server's limits (its row limit and byte budget for SQL, its branch
token limit), said on stderr when reached. Fetching is here; main.py prints."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any

import typer

from tracedb.cli.common import err, fail
from tracedb.errors import TraceDBError

if TYPE_CHECKING:  # the client (http, ssl, Arrow) is imported by a command that asks a server
    import pyarrow as pa

UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="TRACEDB_URL",
        help="Read through the tracedb server at this URL (e.g. http://127.0.0.1:8000) instead of opening "
        "--db; env TRACEDB_URL.",
    ),
]


def _ask(call: Any) -> Any:
    """``call()``, a server's error or silence as the command's error exit (1)."""
    try:
        return call()
    except TraceDBError as e:
        raise fail(e) from None


def sql_rows(url: str, text: str, limit: int | None) -> list[dict[str, Any]]:
    """The rows of one SELECT, at most ``limit`` (None: as many as the server's limits let
    through); the server's limit on stderr when it stopped the answer."""
    from tracedb import client

    answer = _ask(lambda: client.sql(url, text, limit=limit, token=os.environ.get("TRACEDB_TOKEN")))
    names = [c["name"] for c in answer["columns"]]
    rows = [dict(zip(names, row, strict=True)) for row in answer["rows"]]
    if answer["truncated"] and (answer["truncated_by"] == "bytes" or limit is None or answer["limit"] < limit):
        err.print(
            f"[yellow]{answer['row_count']} rows: the server stopped there, {answer['truncated_why']} "
            f"(row limit {answer['limit']}, {answer['max_bytes']} bytes of rows)[/yellow]"
        )
    return rows


def stats(url: str) -> dict[str, Any]:
    """``db.stats()`` of the served database."""
    from tracedb import client

    return _ask(lambda: client.stats(url))


def trace_branches(
    url: str, trace_id: str, *, train_once: bool, credit: str | None, branch: list[int] | None
) -> tuple[pa.Table, bool]:
    """One trace's branch views (``branch``: only those indices) and whether the server
    holds the trace at all."""
    from tracedb import client

    table, _ = _ask(
        lambda: client.fetch_branches(
            url, trace_ids=[trace_id], train_once=train_once, credit=credit, branch_index=branch or None
        )
    )
    if table.num_rows or not branch:
        return table, table.num_rows > 0
    everything, _ = _ask(lambda: client.fetch_branches(url, trace_ids=[trace_id]))
    return table, everything.num_rows > 0
