"""An asynchronous trainer's feed from a lake equals the file store's: the same Selection
(staleness bound per group, stale="mask", unknown versions, dropped and eval traces out
of training by default, max_groups) gives the same plans and reports, and the same
branch views with their per-token ``policy_version``. The data: ``tracedb.synthetic.
versioned()`` rollouts (stale groups, dropped traces) and the verifiers 0.4.1 fixtures
(eval episodes, labels with no number), pushed three versioned groups per write."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

import tracedb
from tracedb.synthetic import generate_episodes, versioned

from support import FIXTURES_041
from support.plans import assert_same_plan, assert_same_step

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402

GROUP = 4
V, K = 4, 1


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    episodes = generate_episodes(
        groups=6,
        group_size=GROUP,
        tokens_per_trace=600,
        system_tokens=50,
        task_tokens=20,
        turn_tokens=(20, 60),
        compaction_every=400,
        advantages=True,
        seed=5,
    )
    run = root / "run.jsonl"
    rows = versioned(episodes, step=V, groups_per_step=2, stale_share=0.4, dropped_share=0.15, seed=5)
    run.write_text("".join(json.dumps(e) + "\n" for e in rows))
    path = root / "store.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(run)
        db.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        counts = db.sql(
            "SELECT count(*) FILTER (WHERE dropped IS NOT NULL) AS dropped, "
            "count(*) FILTER (WHERE work_type = 'eval') AS eval, "
            f"count(*) FILTER (WHERE policy_min < {V - K}) AS stale, "
            "count(*) FILTER (WHERE policy_unknown > 0) AS unknown FROM traces"
        ).to_pylist()[0]
    assert all(counts.values()), counts  # every rule has traces to act on
    return path


@pytest.fixture(scope="module")
def lake(store, tmp_path_factory):
    opened = lakes.init(tmp_path_factory.mktemp("lake") / "L")
    opened.push(store, batch_traces=3 * GROUP)  # three versioned groups per write
    return opened


SELECTIONS = {
    "training-default": {},
    "with-dropped-and-eval": {"include_dropped": True, "include_eval": True},
    "stale-dropped": {"policy": V, "max_staleness": K, "unknown": "drop"},
    "stale-masked": {"policy": V, "max_staleness": K, "stale": "mask", "unknown": "keep"},
    "max-groups": {"complete_groups": GROUP, "max_groups": 3},  # the first write's groups: the oldest three
}


@pytest.mark.parametrize("selection", SELECTIONS.values(), ids=SELECTIONS)
def test_plans_and_reports_equal_the_file_stores(lake, store, selection):
    with tracedb.connect(store, read_only=True) as db:
        want = db.micro_batches(4096, ranks=2, trainable=None, **selection)
    got = lake.micro_batches(4096, ranks=2, trainable=None, **selection)
    assert got.report.samples > 0
    assert_same_plan(got, want)
    report = got.report
    if "max_groups" in selection:
        assert report.groups_over > 0
    elif "policy" not in selection:
        assert report.dropped > 0 or selection.get("include_dropped")
        assert report.eval > 0 or selection.get("include_eval")
    elif selection.get("stale") == "mask":
        assert report.stale_groups > 0 and report.stale_tokens > 0
    else:
        assert report.stale_groups > 0 and report.unknown_dropped > 0 and report.stale_tokens == 0


@pytest.mark.parametrize(
    "selection",
    [
        {"policy": V, "max_staleness": K, "unknown": "drop"},
        {"include_dropped": False, "include_eval": False},
        {"complete_groups": GROUP, "max_groups": 3},
    ],
    ids=["stale", "training-only", "max-groups"],
)
def test_views_of_a_selection_equal_the_file_stores(lake, store, selection):
    """Analysis outputs keep dropped and eval traces unless told; ``policy_version`` per token."""
    with tracedb.connect(store, read_only=True) as db:
        want = db.branches(**selection).replace_schema_metadata(None)
    with tracedb.connect(":memory:") as db:
        lake.pull(db, **selection)
        got = db.branches().replace_schema_metadata(None)
    assert got.num_rows and got.equals(want)
    assert got.column("policy_version").null_count < got.num_rows


def test_every_visible_trace_keeps_its_columns_and_views(lake, store):
    with tracedb.connect(store, read_only=True) as db:
        want = db.branches().replace_schema_metadata(None)
        columns = db.sql("SELECT * EXCLUDE (seq, ingested_at) FROM traces ORDER BY trace_id")
        records = {t: db.trace(t) for t in columns.column("trace_id").to_pylist()}
    tables = lake.tables()
    got = tables["traces"].sort_by("trace_id").drop_columns(["seq", "ingested_at"])
    assert got.equals(columns.cast(got.schema))
    with tracedb.connect(":memory:") as db:
        lake.pull(db)
        assert db.branches().replace_schema_metadata(None).equals(want)
        assert {t: db.trace(t) for t in records} == records  # explicit null and [] spans round-trip


def test_max_groups_steps_take_each_group_once_and_end_at_the_watermark(lake):
    traces = lake.tables()["traces"]
    group_of = dict(zip(traces.column("trace_id").to_pylist(), traces.column("group_id").to_pylist(), strict=True))
    after, seen = 0, []
    for _ in range(20):
        plan = lake.micro_batches(4096, complete_groups=GROUP, after=after, max_groups=4, trainable=None)
        groups = {group_of[t] for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}
        assert len(groups) <= 4
        seen += sorted(groups)
        if plan.report.watermark == after:
            break
        after = plan.report.watermark
    assert len(seen) == len(set(seen)) >= 6 and after == lake.watermark()


def test_max_groups_never_cuts_between_groups_of_one_write(lake):
    """A write's groups share their completion seq: a cut there would lose the rest."""
    plan = lake.micro_batches(4096, complete_groups=GROUP, max_groups=5, trainable=None)
    assert plan.report.watermark == 1  # three groups (the first write), not five
    with pytest.raises(ValueError, match=r"max_groups=2 would cut between the 3 groups that completed in one lake"):
        lake.micro_batches(4096, complete_groups=GROUP, max_groups=2)


def test_unknown_versions_and_bad_parameters_are_refused_as_the_file_store_refuses(lake, store):
    for kwargs in ({"policy": V, "max_staleness": K}, {"max_staleness": 1}, {"stale": "mask"}, {"max_groups": 0}):
        with tracedb.connect(store, read_only=True) as db, pytest.raises(ValueError) as want:
            db.micro_batches(4096, **kwargs)
        with pytest.raises(ValueError) as got:
            lake.micro_batches(4096, **kwargs)
        assert str(got.value) == str(want.value)


ASYNC_ARGS = ["--policy", str(V), "--max-staleness", str(K), "--stale", "mask", "--unknown", "keep"]


def test_lake_pack_and_export_take_the_async_options_as_the_file_commands_do(lake, store, tmp_path):
    from typer.testing import CliRunner

    from tracedb.cli.main import app

    run = CliRunner().invoke
    args = ["--seq-len", "4096", "--ranks", "2", *ASYNC_ARGS, "--json"]
    filed = run(app, ["pack", "--db", str(store), "--out", str(tmp_path / "file"), *args])
    assert filed.exit_code == 0, filed.output
    laked = run(app, ["lake", "pack", "--lake", lake.where, "--out", str(tmp_path / "lake"), *args])
    assert laked.exit_code == 0, laked.output
    manifest = assert_same_step(tmp_path / "lake", tmp_path / "file", lake.watermark())
    assert manifest["report"]["stale_tokens"] > 0

    exported = {}
    for where, command in (
        ("file", ["export", "--db", str(store)]),
        ("lake", ["lake", "export", "--lake", lake.where]),
    ):
        out = tmp_path / f"{where}.arrow"
        options = ["--trainable-only", "--include-eval", *ASYNC_ARGS[:4], "--unknown", "drop", "--json"]
        result = run(app, [*command, str(out), *options])
        assert result.exit_code == 0, result.output
        exported[where] = (json.loads(result.output), pa.ipc.open_file(out).read_all())
    (file_result, file_table), (lake_result, lake_table) = exported["file"], exported["lake"]
    assert lake_result["watermark"] == lake.watermark() == tracedb.watermark_of(lake_table)
    assert lake_table.num_rows and lake_table.replace_schema_metadata(None).equals(
        file_table.replace_schema_metadata(None)
    )
    assert {k: v for k, v in lake_result.items() if k not in ("path", "watermark", "bytes")} == {
        k: v for k, v in file_result.items() if k not in ("path", "watermark", "bytes")
    }
    bad = run(app, ["lake", "export", str(tmp_path / "x.arrow"), "--lake", lake.where, "--stale", "mask"])
    assert bad.exit_code == 2 and "give policy and max_staleness" in bad.output and "Traceback" not in bad.output


def test_the_async_options_are_one_list_shared_by_the_file_and_lake_commands():
    import typer.main

    from tracedb.cli.common import TRAINING_OPTIONS
    from tracedb.cli.main import app

    command = typer.main.get_command(app)
    shared = {name for name, _, _ in TRAINING_OPTIONS}
    for path in (["pack"], ["export"], ["lake", "pack"], ["lake", "export"]):
        found = command
        for name in path:
            found = found.commands[name]  # type: ignore[attr-defined]
        assert shared <= {p.name for p in found.params}, path
