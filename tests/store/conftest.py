"""Databases the write-back tests share (the reference model: :mod:`support.writeback_model`)."""

from __future__ import annotations

import pytest

import tracedb

from support import FIXTURES
from support.writeback_model import LINEAR, SMALL


@pytest.fixture
def db():
    """The fixtures without the 32-episode groups file (credit algorithms use fixture_db)."""
    with tracedb.connect(":memory:") as database:
        assert database.ingest(SMALL).ok
        yield database


@pytest.fixture(scope="module")
def shared_db():
    """One database for the tests that expect a refusal. Each of them compares the full
    state before and after, so a write that leaks fails the test that leaked it."""
    with tracedb.connect(":memory:") as db:
        assert db.ingest(FIXTURES).ok
        db.create_credit_set("manual")
        db.write_traces([{"trace_id": LINEAR, "value": 3.0}], credit="manual")
        yield db
