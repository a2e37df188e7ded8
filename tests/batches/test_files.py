"""Step directories: ``write_step`` and ``read_micro_batches`` give back the plan's
micro-batches; a step is a step only once its manifest is there."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow.ipc as ipc
import pytest

import tracedb
from tracedb.batches import files, write_step

from support.batches import fixture_traces


def same_batches(got: list[Any], want: list[Any]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.tokens.equals(w.tokens)
        assert g.samples.equals(w.samples)


@pytest.mark.parametrize(
    "kw",
    [
        {"seq_len": 300, "ranks": 3, "pad_to_multiple_of": 8},
        {"seq_len": 4096, "ranks": 2, "trainable": None, "share_prefixes": True},
        {"seq_len": 120, "ranks": 1, "overflow": "drop", "cost": (1.0, 0.01)},
    ],
)
def test_write_and_read_back(golden_db: tracedb.Database, tmp_path: Path, kw: dict[str, Any]) -> None:
    plan = golden_db.micro_batches(**kw)
    manifest = write_step(plan, tmp_path / "step")
    names = sorted(p.name for p in (tmp_path / "step").iterdir())
    ranks = kw["ranks"]
    per_rank = [name for r in range(ranks) for name in (f"rank_{r}.arrow", f"rank_{r}.samples.arrow")]
    assert names == sorted(["manifest.json", *per_rank])
    on_disk = json.loads((tmp_path / "step" / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    assert on_disk["arguments"] == json.loads(json.dumps(plan.arguments))
    assert on_disk["arguments"]["seq_len"] == kw["seq_len"] and on_disk["arguments"]["ranks"] == ranks
    assert on_disk["report"] == json.loads(json.dumps(plan.report.to_dict()))
    assert [f["rank"] for f in on_disk["files"]] == list(range(ranks))
    for r in range(ranks):
        entry = on_disk["files"][r]
        assert (entry["tokens"], entry["samples"]) == (f"rank_{r}.arrow", f"rank_{r}.samples.arrow")
        assert entry["micro_batches"] == len(plan[r])
        with ipc.open_file(tmp_path / "step" / entry["tokens"]) as reader:
            assert reader.num_record_batches == len(plan[r])
        same_batches(tracedb.read_micro_batches(tmp_path / "step", r), plan[r])
    with pytest.raises(tracedb.TraceDBError, match=f"ranks 0-{ranks - 1}"):
        tracedb.read_micro_batches(tmp_path / "step", ranks)


def test_a_plan_of_padding_only(golden_db: tracedb.Database, tmp_path: Path) -> None:
    """Nothing scored (linear): each rank gets one padding micro-batch, and reads it back."""
    trace_ids = [t["id"] for t in fixture_traces("linear")]
    plan = golden_db.micro_batches(100, ranks=2, trace_ids=trace_ids, pad_to_multiple_of=4)
    assert plan.report.samples == 0 and plan.report.micro_batches == 2
    write_step(plan, tmp_path)
    for r in range(2):
        got = tracedb.read_micro_batches(tmp_path, r)
        same_batches(got, plan[r])
        assert got[0].samples.num_rows == 0


def test_a_directory_without_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(tracedb.TraceDBError, match="manifest.json"):
        tracedb.read_micro_batches(tmp_path, 0)
    start = time.monotonic()
    with pytest.raises(tracedb.TraceDBError, match="manifest.json"):
        tracedb.read_micro_batches(tmp_path, 0, wait=0.2)
    waited = time.monotonic() - start
    assert 0.2 <= waited < 2.0, waited


def test_a_reader_waits_for_the_writer(golden_db: tracedb.Database, tmp_path: Path) -> None:
    plan = golden_db.micro_batches(512, ranks=2)
    writer = threading.Timer(0.2, write_step, args=(plan, tmp_path / "late"))
    writer.start()
    try:
        got = tracedb.read_micro_batches(tmp_path / "late", 1, wait=10.0)
    finally:
        writer.join()
    same_batches(got, plan[1])


def test_not_a_step(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else/9", "files": []}))
    with pytest.raises(tracedb.TraceDBError, match="not a tracedb micro-batch step"):
        tracedb.read_micro_batches(tmp_path, 0)


def test_rewriting_a_step_removes_the_old_manifest_first(
    golden_db: tracedb.Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rewrite that fails half way leaves no manifest: a reader never takes the old
    manifest for the new files."""
    first = golden_db.micro_batches(512, ranks=2)
    write_step(first, tmp_path)
    same_batches(tracedb.read_micro_batches(tmp_path, 0), first[0])

    real = files.ipc.new_file
    calls = []

    def failing(*args: Any, **kw: Any) -> Any:
        calls.append(args)
        if len(calls) == 2:
            assert not (tmp_path / "manifest.json").exists(), "the old manifest is still there"
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(files.ipc, "new_file", failing)
    with pytest.raises(OSError, match="disk full"):
        write_step(golden_db.micro_batches(256, ranks=2), tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / "manifest.json").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    with pytest.raises(tracedb.TraceDBError, match="manifest.json"):
        tracedb.read_micro_batches(tmp_path, 0)

    second = golden_db.micro_batches(256, ranks=2)
    write_step(second, tmp_path)
    same_batches(tracedb.read_micro_batches(tmp_path, 1), second[1])
    assert json.loads((tmp_path / "manifest.json").read_text())["arguments"]["seq_len"] == 256
