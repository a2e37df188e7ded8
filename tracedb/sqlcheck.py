"""Which SQL only reads: every statement checked with DuckDB's own parser before any runs.

``tracedb sql`` without ``--write``, ``tracedb lake sql`` and ``POST /sql`` promise not to
change any database. Opening a file read-only does not keep that promise by itself: a
string can ``USE memory; DETACH`` the read-only attachment and ``ATTACH`` the file again,
writable. So the text is split into statements by DuckDB's parser
(``extract_statements``) and each is judged by its statement type, before any of it runs:

- ``SELECT`` (with ``DESCRIBE``, ``SHOW``, ``SUMMARIZE``, ``FROM``, ``VALUES``: DuckDB
  parses them as selects) reads;
- ``EXPLAIN`` reads when the statement it explains does (``EXPLAIN ANALYZE`` runs it): the
  explained statement is found with DuckDB's tokenizer and judged the same way;
- ``COPY`` reads when it copies a query to a file and the caller allows exports
  (``copy_to_file``): DuckDB's plan of it (``json_serialize_plan``) must be a
  ``LOGICAL_COPY_TO_FILE`` whose target is not, and does not hold, a database file
  attached to the connection (or its write-ahead log);
- anything else does not: ``ATTACH``, ``DETACH``, ``USE`` and ``SET`` (DuckDB's ``SET``
  type), ``PRAGMA`` (``IMPORT DATABASE`` and ``COPY FROM DATABASE`` are pragmas),
  ``CALL`` (``CHECKPOINT`` is one), ``INSTALL``/``LOAD``, ``EXPORT``, transactions,
  ``CREATE`` (``... AS`` included), ``INSERT``/``UPDATE``/``DELETE``/``MERGE``, ``PREPARE``,
  ``VACUUM``, ``PIVOT`` (a ``MULTI``: it creates a type first), and a statement the
  parser's Python binding cannot name.

A refusal is a :class:`~tracedb.errors.SqlRefused` naming the statement (its number, its
type, its first words) and what would run instead.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import duckdb

from tracedb.errors import SqlRefused

READS = "SELECT (DESCRIBE, SHOW, SUMMARIZE), EXPLAIN of one"
"""What reads, in a refusal's words."""


def check(
    con: duckdb.DuckDBPyConnection,
    text: str,
    *,
    copy_to_file: bool = False,
    explain: bool = True,
    single: bool = False,
    protected: Sequence[str] = (),
) -> list[Any]:
    """The statements of ``text`` (DuckDB's ``Statement`` objects), each checked to only
    read (see the module); :class:`SqlRefused` for the first that does not, before
    anything runs (text DuckDB cannot parse raises its ``duckdb.Error``). ``copy_to_file`` allows
    ``COPY (query) TO 'file'``, ``explain`` allows ``EXPLAIN`` of a read, ``single``
    allows one statement only. ``con`` is the connection the text would run on (a COPY
    is planned on it, its attached files are the ones a COPY may not write), and no
    COPY may write into ``protected`` (files and directories: a lake's catalog and
    warehouse)."""
    allowed = READS + (", COPY (query) TO 'file'" if copy_to_file else "")
    statements = _split(con, text, allowed)
    if not statements:
        raise SqlRefused("no SQL statement given")
    if single and len(statements) != 1:
        raise SqlRefused(f"send exactly one statement (only {allowed}), got {len(statements)}")
    for n, statement in enumerate(statements, 1):
        where = f"statement {n} of {len(statements)}" if len(statements) > 1 else "the statement"
        _check_one(con, statement, where, allowed, copy_to_file=copy_to_file, explain=explain, protected=protected)
    return statements


def _split(con: duckdb.DuckDBPyConnection, text: str, allowed: str) -> list[Any]:
    statements = con.extract_statements(text)  # a parser error is DuckDB's own (duckdb.Error)
    try:
        for statement in statements:
            statement.type  # noqa: B018 - a type the binding cannot name raises here
    except ValueError as e:  # e.g. UPDATE EXTENSIONS: "29 is not a valid StatementType"
        raise SqlRefused(f"a statement of a kind tracedb cannot check ({e}); only {allowed} runs here") from None
    return statements


def _check_one(
    con: duckdb.DuckDBPyConnection,
    statement: Any,
    where: str,
    allowed: str,
    *,
    copy_to_file: bool,
    explain: bool,
    protected: Sequence[str],
) -> None:
    kind = statement.type
    if kind == duckdb.StatementType.SELECT:
        return
    if kind == duckdb.StatementType.EXPLAIN and explain:
        inner = _explained(con, statement.query, allowed)
        what = "the statement under EXPLAIN" + ("" if where == "the statement" else f" ({where})")
        _check_one(con, inner, what, allowed, copy_to_file=copy_to_file, explain=False, protected=protected)
        return
    if kind == duckdb.StatementType.COPY and copy_to_file:
        _check_copy(con, statement.query, where, protected)
        return
    raise SqlRefused(
        f"{where} is {_name(kind)} ({_opening(statement.query)}), which does not only read; only {allowed}"
    )


def _name(kind: Any) -> str:
    return {"SET": "SET (or USE, RESET)", "CALL": "CALL (or CHECKPOINT)", "LOAD": "LOAD (or INSTALL)"}.get(
        kind.name, kind.name
    )


def _opening(query: str) -> str:
    words = " ".join(query.split())
    return repr(words if len(words) <= 60 else words[:57] + "...")


def _explained(con: duckdb.DuckDBPyConnection, query: str, allowed: str) -> Any:
    """The statement an EXPLAIN explains, found with DuckDB's tokenizer: after the
    EXPLAIN keyword, an ANALYZE keyword and a parenthesised option list (either or both)."""
    tokens = [(at, kind) for at, kind in duckdb.tokenize(query) if kind != duckdb.token_type.comment]
    ends = [at for at, _ in tokens[1:]] + [len(query)]
    words = [query[at:end].strip() for (at, _), end in zip(tokens, ends, strict=True)]
    i = 1  # tokens[0] is EXPLAIN
    if i < len(words) and tokens[i][1] == duckdb.token_type.keyword and words[i].upper() in ("ANALYZE", "ANALYSE"):
        i += 1
    if i < len(words) and words[i] == "(":
        depth = 0
        while i < len(words):
            depth += words[i].count("(") - words[i].count(")") if tokens[i][1] == duckdb.token_type.operator else 0
            i += 1
            if depth == 0:
                break
    if i >= len(tokens):
        raise SqlRefused(f"an EXPLAIN without a statement to explain ({_opening(query)})")
    inner = con.extract_statements(query[tokens[i][0] :])
    if len(inner) != 1:
        raise SqlRefused(f"an EXPLAIN of {len(inner)} statements ({_opening(query)}); only {allowed}")
    return inner[0]


def _check_copy(con: duckdb.DuckDBPyConnection, query: str, where: str, protected: Sequence[str]) -> None:
    """A COPY that writes a query's rows to a file other than a database's."""
    plan = json.loads(con.execute("SELECT json_serialize_plan(?)", [query]).fetchone()[0])
    if plan.get("error"):
        first = (plan.get("error_message") or "").strip().splitlines()[:1]
        raise SqlRefused(f"{where} is a COPY that could not be planned ({_opening(query)}): {' '.join(first)}")
    root = plan["plans"][0] if len(plan.get("plans", [])) == 1 else {}
    if root.get("type") != "LOGICAL_COPY_TO_FILE":
        raise SqlRefused(
            f"{where} is a COPY into a table ({_opening(query)}): that writes; only COPY (query) TO 'file' runs here"
        )
    if root.get("copy_info", {}).get("file_path_expression") is not None or not root.get("file_path"):
        raise SqlRefused(f"{where} is a COPY to a computed path ({_opening(query)}); name the file")
    target = os.path.realpath(root["file_path"])
    for path in [*_database_files(con), *(os.path.realpath(p) for p in protected)]:
        inside = path.startswith(target.rstrip(os.sep) + os.sep) or target.startswith(path.rstrip(os.sep) + os.sep)
        if path == target or inside:
            raise SqlRefused(f"{where} would write over or into {path} ({_opening(query)}), which tracedb reads from")


def _database_files(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The files of every database attached to ``con``'s instance, and their WALs."""
    rows = con.execute("SELECT path FROM duckdb_databases() WHERE path IS NOT NULL").fetchall()
    files = [os.path.realpath(r[0]) for r in rows]
    return files + [f + ".wal" for f in files]
