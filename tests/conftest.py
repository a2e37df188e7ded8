from __future__ import annotations

from pathlib import Path

import pytest

import tracedb

FIXTURES = Path(__file__).parent / "fixtures" / "verifiers-0.4.0"
"""Real traces.jsonl files written by verifiers 0.4.0, each beside its NAME.branches.json:
verifiers' own branch views of that file (the ground truth)."""


@pytest.fixture
def fresh_db():
    with tracedb.connect(":memory:") as db:
        yield db


@pytest.fixture
def fixture_db():
    """An in-memory database holding every golden fixture."""
    with tracedb.connect(":memory:") as db:
        report = db.ingest(FIXTURES)
        assert report.ok, report.rejected
        yield db
