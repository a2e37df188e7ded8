"""Reproducible steps: a step's manifest records what made it (the selection and its
watermark, the traces, the credit digest, the replay choices, every file's SHA-256), and
``tracedb.batches.rebuild`` makes it again byte-identical from the same database, or names
what changed; rebuilding never changes replay counts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import tracedb
import tracedb.credit
from tracedb.batches import rebuild, steps, write_step
from tracedb.batches.replay import use_counts

from support.steps import async_run, ingest_step

FILES = ("rank_0.arrow", "rank_0.samples.arrow")


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.glob("*.arrow"))
    assert names == sorted(p.name for p in b.glob("*.arrow")) and names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def _rebuild_into(db: tracedb.Database, step: Path, out: Path) -> dict[str, Any]:
    manifest, where = steps.load(step)
    plan = rebuild(db, manifest)
    return write_step(plan, out, rebuilt_from=str(where / "manifest.json"), expect=manifest)


@pytest.fixture(scope="module")
def episodes() -> list[dict[str, Any]]:
    return async_run(seed=5)


@pytest.fixture(scope="module")
def run(episodes: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight steps of a loop with replay (policy=step, max_staleness=1), written under steps/."""
    root = tmp_path_factory.mktemp("run")
    after = 0
    with tracedb.connect(root / "run.duckdb") as db:
        for step in range(1, 9):
            ingest_step(db, root, episodes, step)
            plan = db.micro_batches(
                4096,
                ranks=2,
                complete_groups=4,
                after=after,
                policy=step,
                max_staleness=1,
                replay=tracedb.Replay(max_staleness=3, max_uses=1, steps_root=root / "steps"),
            )
            write_step(plan, root / "steps" / f"step_{step}")
            after = plan.report.watermark
    return root


def test_every_step_of_a_replay_loop_rebuilds_byte_identical(run):
    before = use_counts(run / "steps")
    assert sum(before.values()) > 0
    with tracedb.connect(run / "run.duckdb", read_only=True) as db:
        for step in range(1, 9):
            source = run / "steps" / f"step_{step}"
            again = run / "steps" / "again" / f"step_{step}"  # under steps_root: must not count
            written = _rebuild_into(db, source, again)
            _same_files(source, again)
            original = json.loads((source / "manifest.json").read_text())
            assert written.pop("rebuilt_from") == str(source / "manifest.json")
            assert json.loads(json.dumps(written)) == original
    assert use_counts(run / "steps") == before  # a rebuilt step is no use


def test_a_rebuild_consults_no_use_counts(run, tmp_path):
    """Replay choices are made again as recorded, whatever the manifests under steps_root
    say now (here: every step's choices used up again by a copy of the steps)."""
    import shutil

    shutil.copytree(run / "steps", tmp_path / "steps")
    manifests = sorted((run / "steps").glob("step_*/manifest.json"))
    with tracedb.connect(run / "run.duckdb", read_only=True) as db:
        for path in manifests:
            manifest = json.loads(path.read_text())
            manifest["arguments"]["replay"]["steps_root"] = str(tmp_path / "steps")
            manifest["arguments"]["replay"]["max_uses"] = 1
            plan = rebuild(db, manifest)
            assert plan.report.replayed == manifest["report"]["replayed"]


OPTIONS = [
    {},
    {"ranks": 3, "pad_to_multiple_of": 8, "cost": (1.0, 0.01)},
    {"trainable": None, "share_prefixes": True, "ranks": 2},
    {"seq_len": 300, "overflow": "drop", "drop_zero_advantages": True},
    {"complete_groups": 4, "max_groups": 5},
    {"policy": 8, "max_staleness": 1, "stale": "mask"},
    {"policy": 8, "max_staleness": 2, "credit": "grpo"},
    {"tags": {"run": ("a", "b")}, "train_once": False},
    {"complete_groups": 4, "after": 40, "replay": {"priority": "uniform", "seed": 3}},
]


@pytest.mark.parametrize("options", OPTIONS, ids=[",".join(o) or "everything" for o in OPTIONS])
def test_a_step_rebuilds_byte_identical_whatever_its_options(episodes, tmp_path, options):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in range(1, 9):
            ingest_step(db, tmp_path, episodes, step, tags=[f"run={'a' if step <= 4 else 'c'}"])
        tracedb.credit.run(db, "grpo", "grpo")
        options = dict(options)
        seq_len = options.pop("seq_len", 4096)
        if "replay" in options:
            options["replay"] = tracedb.Replay(**options["replay"])
        big = db.micro_batches(8192, ranks=2, trainable=None)  # the buffer pool holds other bytes now
        plan = db.micro_batches(seq_len, **options)
        del big
        write_step(plan, tmp_path / "step")
        db.micro_batches(1024, ranks=4, share_prefixes=True)
        _rebuild_into(db, tmp_path / "step", tmp_path / "again")
        _same_files(tmp_path / "step", tmp_path / "again")


def test_a_changed_credit_set_is_named(episodes, tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in range(1, 4):
            ingest_step(db, tmp_path, episodes, step)
        tracedb.credit.run(db, "grpo", "grpo")
        write_step(db.micro_batches(4096, credit="grpo"), tmp_path / "step")
        tracedb.credit.run(db, "grpo", "grpo", replace=True, scale_std=True)
        with pytest.raises(tracedb.StepChanged, match=r"credit set 'grpo' changed since the step: its rows over") as e:
            _rebuild_into(db, tmp_path / "step", tmp_path / "again")
        assert "\n" not in str(e.value)
        assert not (tmp_path / "again").exists()  # nothing written


def test_a_trace_selected_now_is_named(episodes, tmp_path):
    """A label mapped after the step makes a trace of unknown version known and fresh: the
    pinned selection takes it now, and the rebuild names it."""
    eps = copy.deepcopy(episodes)
    first = next(e for e in eps if e["run"]["work"]["step"] == 2)
    trace = first["traces"][0]
    for node in trace["nodes"]:
        for span in node.get("weight_versions") or []:
            span["version"] = "ckpt-a"
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in range(1, 4):
            ingest_step(db, tmp_path, eps, step)
        plan = db.micro_batches(4096, policy=3, max_staleness=2, unknown="drop")
        assert plan.report.unknown_dropped == 1
        write_step(plan, tmp_path / "step")
        db.set_policy_versions({"ckpt-a": 2})
        with pytest.raises(tracedb.StepChanged, match=f"trace {trace['id']} is selected now and was not in the step"):
            _rebuild_into(db, tmp_path / "step", tmp_path / "again")


def test_changed_tokens_with_the_same_inputs_name_the_file(episodes, tmp_path):
    """Selection and credit the same, but a stream written back since (trainer logprobs):
    the rank file differs, named; the directory gets no manifest (it is no step)."""
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in range(1, 3):
            ingest_step(db, tmp_path, episodes, step)
        write_step(db.micro_batches(4096), tmp_path / "step")
        node = db.sql("SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 LIMIT 1").to_pylist()[0]
        db.write_nodes(
            [{"trace_id": node["trace_id"], "node_index": node["node_index"], "values": [-0.5] * node["n_sampled"]}],
            stream="trainer_logprobs",
        )
        with pytest.raises(tracedb.StepChanged, match=r"rank_0.arrow differs from the step's .*selection and credit"):
            _rebuild_into(db, tmp_path / "step", tmp_path / "again")
        assert not (tmp_path / "again").exists()  # made by the rebuild, so removed
        (tmp_path / "kept").mkdir()
        with pytest.raises(tracedb.StepChanged, match=r"rank_0.arrow differs"):
            _rebuild_into(db, tmp_path / "step", tmp_path / "kept")
        assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "manifest.json").exists()


def test_a_tampered_replay_record_is_named(run, tmp_path):
    manifests = [json.loads(p.read_text()) for p in sorted((run / "steps").glob("step_*/manifest.json"))]
    manifest = next(m for m in manifests if m["report"]["replayed"])
    with tracedb.connect(run / "run.duckdb", read_only=True) as db:
        edited = copy.deepcopy(manifest)
        edited["report"]["replayed"][0]["traces"] = edited["report"]["replayed"][0]["traces"][1:]
        with pytest.raises(tracedb.StepChanged, match=r"replayed group \S+ changed since the step: trace \S+ is in it"):
            rebuild(db, edited)
        edited = copy.deepcopy(manifest)
        edited["report"]["replayed"][0]["replaced"] = edited["report"]["replayed"][0]["group"]
        with pytest.raises(tracedb.StepChanged, match="not a zero-variance group of its selection now"):
            rebuild(db, edited)


def test_another_database_is_refused(run, tmp_path):
    with tracedb.connect(tmp_path / "small.duckdb") as db:
        ingest_step(db, tmp_path, async_run(seed=5), 1)
        manifest, _ = steps.load(run / "steps" / "step_8")
        with pytest.raises(tracedb.StepChanged, match=r"the database is at watermark 12, below the \d+ the step"):
            rebuild(db, manifest)


def test_manifests_that_cannot_be_rebuilt_are_refused_named(run, tmp_path):
    step = tmp_path / "old"
    step.mkdir()
    manifest = json.loads((run / "steps" / "step_3" / "manifest.json").read_text())
    for key in ("selection", "credit"):
        manifest.pop(key)
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(tracedb.TraceDBError, match="does not record its inputs .*selection, credit missing"):
        steps.load(step)
    (step / "manifest.json").write_text("{oops")
    with pytest.raises(tracedb.TraceDBError, match="not a step manifest"):
        steps.load(step / "manifest.json")
    with pytest.raises(tracedb.TraceDBError, match="a step manifest is a manifest.json"):
        steps.load(run / "run.duckdb")
