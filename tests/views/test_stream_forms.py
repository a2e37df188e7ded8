"""A batch's streams are kept as text or as lists (``tracedb.codec.stream_form``; the
``node_store`` columns ``logprobs`` / ``logprobs_list``, ...): a file holding batches of
both forms reads as one holding either, through every reader (the branch views, whole and
of a selection; ``db.trace``; the ``nodes`` SQL view; written streams)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import tracedb
from tracedb import codec, runtime

from support import FIXTURES

STREAMS = ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies")


def ingested(tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, forms: itertools.cycle) -> Path:
    monkeypatch.setattr(codec, "stream_form", lambda values, *a, **k: next(forms))
    path = tmp_path / f"{name}.duckdb"
    with runtime.configure(chunk_bytes=1, batch_tokens=1), tracedb.connect(path) as db:  # a batch per line
        report = db.ingest([FIXTURES / "groups.traces.jsonl", FIXTURES / "loss_weights.traces.jsonl"])
        assert report.ok
    monkeypatch.undo()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("forms")
    with pytest.MonkeyPatch.context() as mp:
        return {
            name: ingested(tmp, name, mp, itertools.cycle(forms))
            for name, forms in (("text", ["text"]), ("list", ["list"]), ("mixed", ["text", "list", "list"]))
        }


def forms_held(path: Path) -> set[str]:
    with tracedb.connect(path, read_only=True) as db:
        parts = [f"count({s}) AS {s}, count({s}_list) AS {s}_list" for s in STREAMS]
        row = db.sql(f"SELECT {', '.join(parts)} FROM node_store").to_pylist()[0]
    return {("list" if k.endswith("_list") else "text") for k, v in row.items() if v}


def test_the_files_hold_the_forms_asked_for(files):
    assert forms_held(files["text"]) == {"text"}
    assert forms_held(files["list"]) == {"list"}
    assert forms_held(files["mixed"]) == {"text", "list"}


@pytest.mark.parametrize("name", ["list", "mixed"])
def test_every_reader_reads_either_form_the_same(files, name):
    with tracedb.connect(files["text"], read_only=True) as ref, tracedb.connect(files[name], read_only=True) as db:
        ids = ref.sql("SELECT trace_id FROM traces ORDER BY seq").column(0).to_pylist()
        assert db.branches().equals(ref.branches())  # the whole file, read flat
        assert db.branches(trace_ids=ids[1:4]).equals(ref.branches(trace_ids=ids[1:4]))  # a selection
        for trace_id in ids:
            assert db.trace(trace_id) == ref.trace(trace_id)
        nodes = "SELECT * FROM nodes ORDER BY trace_id, node_index"
        assert db.sql(nodes).equals(ref.sql(nodes))


def test_written_streams_replace_either_form(files, tmp_path):
    path = tmp_path / "mixed.duckdb"
    path.write_bytes(files["mixed"].read_bytes())
    with tracedb.connect(path) as db:
        nodes = db.sql("SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 ORDER BY ALL")
        rows = nodes.to_pylist()[:6]
        written = {
            (r["trace_id"], r["node_index"]): [0.1 * (k + 1) + 1e-3 / 3 for k in range(r["n_sampled"])] for r in rows
        }
        db.write_nodes(
            pa.table(
                {
                    "trace_id": [k[0] for k in written],
                    "node_index": [k[1] for k in written],
                    "values": list(written.values()),
                }
            ),
            stream="advantages",
        )
        for (trace_id, node), values in written.items():
            got = (
                db.sql("SELECT advantages FROM nodes WHERE trace_id = ? AND node_index = ?", params=[trace_id, node])
                .column(0)[0]
                .as_py()
            )
            assert np.array_equal(np.float32(got), np.float32(values))
            record = db.trace(trace_id)["nodes"][node]
            assert record["advantages"] == [float(str(np.float32(v))) for v in values]
        assert db.branches().num_rows > 0
