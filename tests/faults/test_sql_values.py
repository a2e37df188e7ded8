"""Every value a query can give, in every way tracedb shows one: never a crash, never wrong.

``'10000-01-01'::DATE`` and ``'infinity'::TIMESTAMP`` made ``POST /sql`` answer 500 (and
drop the connection) and ``tracedb sql`` print a traceback (Python's datetime stops at
year 9999); a ``UHUGEINT`` of 2^127 or more came back negative (Arrow carries it as
``decimal128(38)``). The oracle here is DuckDB's own JSON of each value (``to_json``),
not tracedb's code: every column of ``test_all_types()`` (the minimum, the maximum and
the nulls of every type DuckDB has), through ``POST /sql``, ``tracedb sql --json``, the
table ``tracedb sql`` prints, and the Arrow ``db.sql()`` returns. The JSON forms are
:mod:`tracedb.sqlvalues`'s: 64-bit integers as numbers, 128-bit ones and decimals as
their exact digits, temporal values as DuckDB's text, blobs as base64.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import tracedb
from tracedb.api import create_app
from tracedb.cli import common
from tracedb.cli.main import app

from support import FIXTURES

ALL = "SELECT * FROM test_all_types()"
DIGITS = {"hugeint", "uhugeint", "bignum"}
"""Integers past 64 bits: DuckDB's JSON writes a number, tracedb the same digits as a string."""


def finite_or_null(value: Any) -> Any:
    """NaN and infinities as null (JSON has neither; DuckDB's JSON writes ``NaN``)."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    return value


def oracle() -> tuple[list[str], list[dict[str, Any]], dict[str, list[Any]]]:
    """Column names, DuckDB's JSON of each row, and per column what tracedb's JSON of
    each row must be, from DuckDB alone."""
    con = duckdb.connect()
    names = con.sql(ALL).columns
    kinds = {n: t.id for n, t in zip(names, con.sql(ALL).types, strict=True)}
    duck = [json.loads(r[0]) for r in con.sql(f"SELECT to_json(t)::VARCHAR FROM ({ALL}) t").fetchall()]
    raw = con.sql(ALL).fetchall()  # blobs as bytes
    as_text = {
        n: [r[0] for r in con.sql(f'SELECT CAST("{n}" AS VARCHAR) FROM ({ALL})').fetchall()]
        for n in names
        if kinds[n] == "decimal"
    }
    want: dict[str, list[Any]] = {}
    for i, name in enumerate(names):
        column = []
        for k, row in enumerate(duck):
            value = row[name]
            if value is None:
                column.append(None)
            elif name in DIGITS:
                column.append(str(value))
            elif kinds[name] == "decimal":
                column.append(as_text[name][k])  # DuckDB's JSON rounds them to a double
            elif kinds[name] == "blob":
                column.append(base64.b64encode(raw[k][i]).decode())
            else:
                column.append(finite_or_null(value))
        want[name] = column
    con.close()
    return list(names), duck, want


NAMES, DUCK, WANT = oracle()
TEXT_COLUMNS = [
    n for n in NAMES if isinstance(WANT[n][1], str) and n not in ("varchar", "blob", "uuid") and "enum" not in n
]
"""Columns whose values are DuckDB's text in every form (temporal ones, 128-bit integers, ...)."""


def same(name: str, got: Any, want: Any) -> bool:
    """tracedb's JSON of a value against the oracle's: maps are lists of [key, value]
    pairs (keys need not be strings), a union shows its member's value, a TUPLE its
    fields by position, floats at float32 when the column is FLOAT."""
    if want is None or got is None:
        return got is want
    if name == "map":
        return {k: v for k, v in got} == want
    if name == "union":
        return [got] == list(want.values())
    if name == "tuple":
        return list(got.values()) == want
    if name == "float":
        return np.float32(got) == np.float32(want)
    return got == want


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlvalues") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
    return path


@pytest.fixture(scope="module")
def client(db_path: Path) -> Any:
    application = create_app(db_path, allow_sql=True, sql_row_limit=100, sql_max_bytes=64 << 20)
    try:
        with TestClient(application, base_url="http://127.0.0.1", raise_server_exceptions=False) as c:
            yield c
    finally:
        application.state.backend.close()


def cli(*args: str) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_every_type_through_post_sql(client: TestClient) -> None:
    response = client.post("/sql", json={"sql": ALL})
    assert response.status_code == 200, response.text[:500]
    body = response.json()
    assert [c["name"] for c in body["columns"]] == NAMES
    types = {c["name"]: c["type"] for c in body["columns"]}
    assert types["uhugeint"] == "UHUGEINT" and types["date"] == "DATE"  # the query's types, not the text's
    assert body["row_count"] == 3
    wrong = [
        (name, k, got, WANT[name][k])
        for k, row in enumerate(body["rows"])
        for name, got in zip(NAMES, row, strict=True)
        if not same(name, got, WANT[name][k])
    ]
    assert wrong == []
    assert client.get("/health").status_code == 200


def test_every_type_through_sql_json(db_path: Path) -> None:
    done = cli("sql", ALL, "--db", db_path, "--json")
    assert done.exit_code == 0, done.output[-2000:]
    rows = json.loads(done.stdout)  # strict JSON: no NaN or Infinity literals
    assert len(rows) == 3 and list(rows[0]) == NAMES
    wrong = [(n, k, r[n], WANT[n][k]) for k, r in enumerate(rows) for n in NAMES if not same(n, r[n], WANT[n][k])]
    assert wrong == []


@pytest.mark.parametrize("name", NAMES)
def test_every_type_in_the_printed_table(db_path: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common.out, "width", 100_000)  # no wrapping: each cell on one line
    done = cli("sql", f'SELECT "{name}" FROM test_all_types()', "--db", db_path)
    assert done.exit_code == 0, done.output[-2000:]
    assert "Traceback" not in done.output
    if name in TEXT_COLUMNS:
        for value in WANT[name]:
            if value is not None:
                assert str(value) in done.stdout, (name, value)


def test_the_arrow_of_db_sql_holds_every_type(db_path: Path) -> None:
    with tracedb.connect(db_path, read_only=True) as db:
        table = db.sql(ALL)  # DuckDB's own Arrow, as ever
        assert table.num_rows == 3 and table.column_names == NAMES
        rows = db.sql(ALL, portable=True).to_pylist()  # what the shells print from
    assert [r["uhugeint"] for r in rows] == WANT["uhugeint"]
    assert [r["date"] for r in rows] == WANT["date"]


EDGES = {
    "'10000-01-01'::DATE": "10000-01-01",
    "'infinity'::TIMESTAMP": "infinity",
    "'-infinity'::DATE": "-infinity",
    "'-infinity'::TIMESTAMPTZ": "-infinity",
    "'294247-01-10 04:00:54'::TIMESTAMP": "294247-01-10 04:00:54",
    "[DATE '10000-01-01', 'infinity'::DATE]": ["10000-01-01", "infinity"],
    "{'at': 'infinity'::TIMESTAMP, 'n': 1}": {"at": "infinity", "n": 1},
    "MAP {'k': 'infinity'::DATE}": [["k", "infinity"]],
    "(2::UHUGEINT ** 127)::UHUGEINT": str(2**127),
    "340282366920938463463374607431768211455::UHUGEINT": str(2**128 - 1),
    "(-170141183460469231731687303715884105728)::HUGEINT": str(-(2**127)),
    "[340282366920938463463374607431768211455::UHUGEINT]": [str(2**128 - 1)],
    "9223372036854775807::BIGINT": 2**63 - 1,
    "(-9223372036854775808)::BIGINT": -(2**63),
    "18446744073709551615::UBIGINT": 2**64 - 1,
    "'nan'::DOUBLE": None,
    "'-infinity'::FLOAT": None,
}


def test_edges_through_post_sql_and_the_command(client: TestClient, db_path: Path) -> None:
    expressions = list(EDGES)
    sql = "SELECT " + ", ".join(f"{e} AS c{i}" for i, e in enumerate(expressions))
    response = client.post("/sql", json={"sql": sql})
    assert response.status_code == 200, response.text[:500]
    (row,) = response.json()["rows"]
    assert dict(zip(expressions, row, strict=True)) == EDGES
    done = cli("sql", sql, "--db", db_path, "--json")
    assert done.exit_code == 0, done.output[-2000:]
    (printed,) = json.loads(done.stdout)
    assert dict(zip(expressions, printed.values(), strict=True)) == EDGES
    table = cli("sql", sql, "--db", db_path)
    assert table.exit_code == 0 and "Traceback" not in table.output, table.output[-2000:]
