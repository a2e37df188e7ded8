from __future__ import annotations

from pathlib import Path

import pytest

import tracedb
from tracedb import runtime

from support import FIXTURES

pytest_plugins = ("support.progress",)  # --module-progress (dev.py test)

TESTS = Path(__file__).resolve().parent
LONGEST_FIRST = (
    "lake/test_lake_ray.py",
    "lake/test_lake_writers.py",
    "faults/test_crash.py",
    "api/test_fuzz.py",
    "views/test_views_property.py",
    "ingest/test_scan_generated.py",
    "lake/test_lake.py",
    "lake/test_lake_ray_start.py",
    "views/test_buffers.py",
    "faults/test_fuzz.py",
)
"""The modules that run longest (a minute or more on a busy worker), slowest first. Under
pytest-xdist (``dev.py test``: whole modules to workers, in collection order) they are
handed out first, so none of them starts last and holds up the end of the run."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the modules of ``LONGEST_FIRST`` come first in that order; the
    rest keep theirs. A name there that is no test module any more is an error."""
    if not hasattr(config, "workerinput"):
        return
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py LONGEST_FIRST names no test module: {', '.join(missing)}")
    rank = {TESTS / name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.resolve(), len(rank)))


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
