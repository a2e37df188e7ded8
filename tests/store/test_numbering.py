"""Sequence numbers: handed out in one place (``Handle.numbering``), only under the
writing lock, never twice, and the watermark moves only when traces were numbered."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

import tracedb
from tracedb.handle import handle_of
from tracedb.lake import move
from tracedb.synthetic import generate_episodes


def _lines(path, seed: int, groups: int = 2) -> None:
    import json

    episodes = generate_episodes(groups=groups, group_size=2, tokens_per_trace=200, seed=seed)
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))


def test_numbering_outside_the_writing_lock_is_refused(fresh_db: tracedb.Database) -> None:
    handle = handle_of(fresh_db)
    with pytest.raises(RuntimeError, match="writing lock"):
        handle.numbering()
    with handle.sequencing(), handle.transaction():
        numbering = handle.numbering()
        assert numbering.take(3) == 1 and numbering.take(0) == 4 and numbering.take() == 4
        assert numbering.store() == 4
        assert handle.watermark() == 4
        with pytest.raises(ValueError, match="count"):
            numbering.take(-1)
    with handle.sequencing(), handle.transaction():
        assert handle.numbering().store() is None  # nothing numbered: the watermark stays
    assert fresh_db.watermark() == 4


def test_ingests_and_pulls_in_threads_never_share_a_number(tmp_path) -> None:
    """Four threads ingest (two of them on the same handle's children) while a fifth
    writes pulled rows in: every trace gets its own number, 1..N without a gap."""
    for k in range(4):
        _lines(tmp_path / f"run{k}.jsonl", seed=k)
    _lines(tmp_path / "pulled.jsonl", seed=99)
    with tracedb.connect(":memory:") as source:
        source.ingest(tmp_path / "pulled.jsonl")
        rows = {name: source.sql(f"SELECT * FROM {name}") for name in ("traces", "episodes", "nodes")}
        rows.update({name: source.sql(f"SELECT * FROM {name}") for name in ("segments", "branches")})
    with tracedb.connect(tmp_path / "db.duckdb") as db:
        root = handle_of(db)
        errors: list[BaseException] = []

        def ingest(k: int) -> None:
            try:
                child = tracedb.Database.on(root.child())
                child.ingest(tmp_path / f"run{k}.jsonl")
                child.close()
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        def pull() -> None:
            try:
                child = tracedb.Database.on(root.child())
                move.write_into(child, {k: v for k, v in rows.items() if isinstance(v, pa.Table)})
                child.close()
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=ingest, args=(k,)) for k in range(4)] + [threading.Thread(target=pull)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        seqs = sorted(db.sql("SELECT seq FROM traces").column("seq").to_pylist())
        assert seqs == list(range(1, len(seqs) + 1)) and len(seqs) == 5 * 4
        assert db.watermark() == len(seqs)
