"""Databases for the trainer-feed tests: every golden fixture once per session (packing
only reads), and one reusable empty database per module for hypothesis examples."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import tracedb

from support import FIXTURES
from support.strategies import write_jsonl


@pytest.fixture(scope="session")
def golden_db(_scanner_always: None) -> Iterator[tracedb.Database]:
    """Every golden fixture, in memory; tests must not write to it."""
    with tracedb.connect(":memory:") as db:
        report = db.ingest(FIXTURES)
        assert report.ok, report.rejected
        yield db


@pytest.fixture(scope="module")
def load() -> Iterator[Callable[[list[dict[str, Any]]], tracedb.Database]]:
    """``load(episodes)``: one database, wiped and holding just these episodes (a schema
    install costs more than a whole example)."""
    db = tracedb.connect(":memory:")
    tables = [
        r[0]
        for r in db.con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND table_name <> 'tracedb_meta'"
        ).fetchall()
    ]

    def make(eps: list[dict[str, Any]]) -> tracedb.Database:
        for table in tables:
            db.con.execute(f'DELETE FROM "{table}"')
        db.handle.changed()
        with tempfile.TemporaryDirectory() as tmp:
            report = db.ingest(write_jsonl(Path(tmp) / "gen.traces.jsonl", eps))
        assert report.ok, [str(r) for r in report.rejected]
        return db

    yield make
    db.close()
