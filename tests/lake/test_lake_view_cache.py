"""A view task's decoded node columns are kept for later tasks of the same traces at the
same snapshots (as the file store's handle keeps them between calls), and any commit to
a table they were read of (a mapping of weight labels, a credit set, a compaction) is
seen by the next task: its views are the file store's again."""

from __future__ import annotations

import pyarrow as pa
import pytest

import tracedb
import tracedb.credit

from support import FIXTURES_041

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import catalog, views  # noqa: E402
from tracedb.lake.select import resolve_rows  # noqa: E402
from tracedb.selection import Selection  # noqa: E402
from tracedb.views import branch_indices, token_columns  # noqa: E402

LABELS = FIXTURES_041 / "labels.traces.jsonl"
KEY = [("trace_id", "ascending"), ("branch_index", "ascending")]


def _view(lake, credit=None):
    """The views of every visible trace as one task computes them (in this process)."""
    rows, _ = resolve_rows(lake, Selection())
    worker = catalog.Opened.worker(lake.location)
    options = dict(train_once=False, trainable=None, branch_index=branch_indices(None))
    got = views.view(worker, rows, columns=token_columns(None), credit=credit, **options)
    return got.sort_by(KEY)


def _file_views(store, credit=None):
    with tracedb.connect(store, read_only=True) as db:
        return db.branches(credit=credit).replace_schema_metadata(None).sort_by(KEY)


def test_cached_columns_follow_every_commit(tmp_path, monkeypatch):
    monkeypatch.setattr(views, "_cache", views._Cache())
    store = tmp_path / "run.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(LABELS)
    lake = lakes.init(tmp_path / "L")
    lake.push(store)
    first = _view(lake)
    assert first.equals(_file_views(store)) and len(views._cache.items) == 1
    held = next(iter(views._cache.items.values()))
    assert _view(lake).equals(first) and list(views._cache.items.values()) == [held]  # a hit: nothing read again

    mapping = {"ckpt-abc": 5, "3f9a1c0de2b4": 9}
    with tracedb.connect(store) as db:
        db.set_policy_versions(mapping)
    lake.set_policy_versions(mapping)
    mapped = _view(lake)
    assert not mapped.column("policy_version").equals(first.column("policy_version"))  # the labels' commit seen
    assert mapped.equals(_file_views(store))

    with tracedb.connect(store) as db:
        tracedb.credit.run(db, "grpo")
    lake.push(store)  # the credit set the lake lacks
    assert _view(lake, credit="grpo").equals(_file_views(store, credit="grpo"))

    lake.compact(grace=0)  # the same rows in other files: read again, the same views
    before = len(views._cache.items)
    assert _view(lake).equals(mapped) and len(views._cache.items) == before + 1


def test_the_cache_keeps_at_most_its_tokens(monkeypatch):
    cache = views._Cache()
    monkeypatch.setattr(views, "CACHE_TOKENS", 100)

    class Columns:
        def __init__(self, tokens):
            self.starts = pa.array([0, tokens]).to_numpy()
            self.streams = {"logprobs": None}

    for key, tokens in (("a", 60), ("b", 30), ("c", 40), ("huge", 101)):
        cache.put(key, Columns(tokens))
    assert list(cache.items) == ["b", "c"]  # the least recently used out; one above the bound never in
    assert cache.get("b", ["logprobs"]) is not None and cache.get("b", ["entropies"]) is None  # a stream it lacks
    cache.put("d", Columns(50))
    assert list(cache.items) == ["b", "d"]  # "b" was used last
