"""What a trainer takes from a lake: micro-batch plans and step directories equal to the
file store's for the same traces (no Ray needed)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import tracedb

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.cli.main import app  # noqa: E402

from support.plans import assert_same_step  # noqa: E402


@pytest.fixture(scope="module")
def store(golden_store):
    """A file store holding every golden fixture."""
    return golden_store


@pytest.fixture(scope="module")
def lake(store, tmp_path_factory):
    """A lake the store was pushed into, in three writes (so ``seq`` differs from the file's)."""
    opened = lakes.init(tmp_path_factory.mktemp("lake") / "L")
    opened.push(store, batch_traces=20)
    return opened


def _same_plan(got, want, *, watermark):
    assert got.arguments == want.arguments
    assert {**got.report.to_dict(), "watermark": None} == {**want.report.to_dict(), "watermark": None}
    assert got.report.watermark == watermark
    assert len(got) == len(want)
    for rank_got, rank_want in zip(got, want, strict=True):
        assert len(rank_got) == len(rank_want)
        for mb_got, mb_want in zip(rank_got, rank_want, strict=True):
            assert mb_got.tokens.equals(mb_want.tokens)
            assert mb_got.samples.equals(mb_want.samples)


@pytest.mark.parametrize(
    "options",
    [
        dict(seq_len=4096),
        dict(seq_len=400, ranks=3, overflow="drop", cost=(1.0, 0.01)),
        dict(seq_len=256, ranks=2, trainable=None, share_prefixes=True, pad_to_multiple_of=8),
        dict(seq_len=1024, ranks=2, importance="tis", clip=1.5),
    ],
    ids=["whole", "drop-ranks", "shared-prefixes", "importance"],
)
def test_plans_equal_the_file_stores(lake, store, options):
    with tracedb.connect(store, read_only=True) as db:
        want = db.micro_batches(**options)
    got = lake.micro_batches(**options)
    assert got.report.samples > 0
    _same_plan(got, want, watermark=lake.watermark())


def test_plan_of_a_selection(lake, store):
    with tracedb.connect(store, read_only=True) as db:
        groups = db.sql("SELECT DISTINCT group_id FROM traces WHERE group_id IS NOT NULL ORDER BY 1")
        group = groups.column("group_id").to_pylist()[:2]
        want = db.micro_batches(512, group=group, ranks=2)
    got = lake.micro_batches(512, group=group, ranks=2)
    assert got.report.samples > 0
    _same_plan(got, want, watermark=lake.watermark())
    first = lake.table("traces").snapshots()[0].sequence_number
    later = lake.micro_batches(512, after=first)  # the traces of the later writes only
    with tracedb.connect(store, read_only=True) as db:
        ids = db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column("trace_id").to_pylist()[20:]
    assert {s for mb in later[0] for s in mb.samples.column("trace_id").to_pylist()} <= set(ids)


def test_lake_pack_writes_the_file_stores_step(lake, store, tmp_path):
    run = CliRunner().invoke
    args = ["--seq-len", "200", "--ranks", "2", "--share-prefixes", "--json"]
    filed = run(app, ["pack", "--db", str(store), "--out", str(tmp_path / "file"), *args])
    assert filed.exit_code == 0, filed.output
    laked = run(app, ["lake", "pack", "--lake", lake.where, "--out", str(tmp_path / "lake"), *args])
    assert laked.exit_code == 0, laked.output
    names = sorted(p.name for p in (tmp_path / "file").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "lake").iterdir()) and "manifest.json" in names
    for name in names:
        if name != "manifest.json":
            assert (tmp_path / "file" / name).read_bytes() == (tmp_path / "lake" / name).read_bytes(), name
    assert_same_step(tmp_path / "lake", tmp_path / "file", lake.watermark())
    bad = run(app, ["lake", "pack", "--lake", lake.where, "--out", str(tmp_path / "x"), "--seq-len", "0"])
    assert bad.exit_code == 2 and "seq_len must be at least 1" in bad.output
