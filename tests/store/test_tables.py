"""The Arrow schema of every stored table (tracedb.tables) equals what its DDL creates."""

from __future__ import annotations

import pyarrow as pa
import pytest

import tracedb
from tracedb import cec, tables

ALL = {**tables.PHYSICAL, **tables.CEC_STORED}


@pytest.fixture(scope="module")
def db():
    with tracedb.connect(":memory:") as db:
        cec.install(db)
        yield db


def test_every_table_of_the_ddl_is_declared(db) -> None:
    names = {
        r[0]
        for r in db.con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database()"
        ).fetchall()
    }
    assert names == set(ALL)
    views = {
        r[0]
        for r in db.con.execute(
            "SELECT view_name FROM duckdb_views() WHERE database_name = current_database() AND NOT internal"
        ).fetchall()
    }
    assert views == set(tables.ENCODED)


@pytest.mark.parametrize("name", sorted(tables.ENCODED))
def test_the_views_over_encoded_tables_read_as_declared(db, name: str) -> None:
    """``nodes`` and ``segments`` read (to any SQL client) as their schema-6 tables did."""
    read = db.sql(f"SELECT * FROM {name} LIMIT 0").schema
    assert read.names == tables.STORED[name].names
    assert [f.type for f in read] == [f.type for f in tables.STORED[name]], name


@pytest.mark.parametrize("name", sorted(ALL))
def test_declared_schema_equals_the_ddl(db, name: str) -> None:
    declared = ALL[name]
    read = db.sql(f"SELECT * FROM {name} LIMIT 0").schema
    assert read.names == declared.names
    assert [f.type for f in read] == [f.type for f in declared], name
    columns = db.con.execute(
        "SELECT column_name, is_nullable, column_default FROM duckdb_columns() "
        "WHERE table_name = ? AND database_name = current_database() ORDER BY column_index",
        [name],
    ).fetchall()
    for (column, nullable, default), field in zip(columns, declared, strict=True):
        assert field.nullable == nullable, (name, column, "NOT NULL")
        assert tables.default_of(field) == default, (name, column, "DEFAULT")


def test_rows_built_for_a_schema_must_name_every_column() -> None:
    with pytest.raises(ValueError, match="missing"):
        tables.table_from(tables.SEGMENTS, {"segment_id": pa.array([b"x"]), "n_tokens": pa.array([1], pa.int32())})
    with pytest.raises(ValueError, match="unknown"):
        tables.table_from(tables.META, {"key": pa.array(["a"]), "value": pa.array(["b"]), "extra": pa.array([1])})


def test_inserted_leaves_out_the_defaulted_columns() -> None:
    assert "ingested_at" not in tables.inserted(tables.TRACES).names
    assert tables.inserted(tables.TRACES).names == [n for n in tables.TRACES.names if n != "ingested_at"]
