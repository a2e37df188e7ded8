from __future__ import annotations

import pytest

import tracedb
from tracedb import runtime

from support import FIXTURES


@pytest.fixture(scope="session", autouse=True)
def _scanner_always():
    """The tests were written for ingest's compiled scanner: they use it whatever the input
    size (the product's ``auto`` keeps small first ingests on the parser; its own tests set
    it back)."""
    with runtime.configure(scanner="always"):
        yield


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


@pytest.fixture
def knobs():
    """``runtime.configure`` for one test: ``knobs(chunk_bytes=1)`` changes settings until
    the test ends (process-wide), then everything is back as it was."""
    import contextlib

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(runtime.configure(**changes))
