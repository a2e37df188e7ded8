"""Credit on a selection (``tracedb.credit.run(..., selection=...)``): a trainer stamps each
step's new complete groups into one set and ends with what one run over everything gives;
a trace is stamped once unless replaced; group means come from the whole stored group;
dropped and eval traces stay out; every refusal is one error and writes nothing."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import pytest

import tracedb
import tracedb.credit
from tracedb.credit import selected
from tracedb.errors import WriteError
from tracedb.selection import Selection
from tracedb.synthetic import generate_episodes, versioned

GROUP = 4


def _episodes(seed: int = 5, groups: int = 9, dropped: float = 0.15) -> list[dict]:
    eps = generate_episodes(
        groups=groups,
        group_size=GROUP,
        tokens_per_trace=700,
        system_tokens=40,
        task_tokens=20,
        turn_tokens=(15, 60),
        compaction_every=400,
        seed=seed,
    )
    out = list(versioned(eps, step=4, groups_per_step=3, dropped_share=dropped, seed=seed))
    rng = random.Random(seed)
    for ep in out:  # rewards that differ within groups (some groups stay flat)
        for trace in ep["traces"]:
            if trace["rewards"]["resolved"]["score"] != 1.0 or rng.random() < 0.5:
                trace["rewards"]["resolved"]["score"] = rng.choice([0.0, 0.25, 0.5, 1.0])
    return out


def _arrivals(episodes: list[dict], seed: int = 5) -> list[list[dict]]:
    """The episodes in four ingest steps, a group's members spread over two neighbouring
    steps (a group completes in the step its last member arrives in)."""
    rng = random.Random(seed)
    steps: list[list[dict]] = [[], [], [], [], []]
    for ep in episodes:
        step = ep["run"]["work"]["step"] - 1
        steps[min(4, step + (rng.random() < 0.4))].append(ep)
    return steps


def _write(path: Path, episodes: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    return path


def _rows(db: tracedb.Database, name: str) -> dict:
    trace = db.sql("SELECT trace_id, value FROM trace_credit WHERE credit_set = ?", [name]).to_pylist()
    node = db.sql("SELECT trace_id, node_index, value, advantages FROM credit WHERE credit_set = ?", [name]).to_pylist()
    return {
        **{r["trace_id"]: r["value"] for r in trace},
        **{(r["trace_id"], r["node_index"]): (r["value"], r["advantages"]) for r in node},
    }


RUNS = {
    "g": ("grpo", {"scale_std": True}),
    "a": ("gae", {"gamma": 0.9, "lam": 0.8}),
    "t": ("tree", {}),
    "p": ("potential", {"kappa": 0.5}),
    "e": ("grpo", {"group_by": "$.task.data.idx"}),  # another grouping: read whole
}


def test_a_trainer_crediting_each_steps_new_groups_ends_with_one_run_over_everything(tmp_path):
    """Per trace (grpo) and per node (gae, tree, potential) algorithms alike, read on the
    selected groups or (grouped by task) whole."""
    episodes = _episodes()
    after = 0
    stamped: list[str] = []
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step, todo in enumerate(_arrivals(episodes)):
            db.ingest(_write(tmp_path / f"step{step}.jsonl", todo), progress=False)
            complete = db.traces(after=after, complete_groups=GROUP).column("trace_id").to_pylist()
            results = [
                tracedb.credit.run(db, algorithm, name, after=after, complete_groups=GROUP, **params)
                for name, (algorithm, params) in RUNS.items()
            ]
            for result in results:
                assert result["watermark"] == db.watermark()
                assert result["traces"] == len(set(complete) - _dropped(db))
            stamped += complete
            after = results[0]["watermark"]
        assert len(stamped) == len(set(stamped)) == len(episodes)  # every trace in exactly one step
        dropped = _dropped(db)
        assert dropped
        for name, (algorithm, params) in RUNS.items():
            tracedb.credit.run(db, algorithm, f"{name}-once", **params)
            live, once = _rows(db, name), _rows(db, f"{name}-once")
            assert live == once and live, algorithm
            assert not {k if isinstance(k, str) else k[0] for k in live} & dropped
        sets = {s["name"]: s for s in db.credit_sets().to_pylist()}
        assert json.loads(sets["g"]["params"]) == json.loads(sets["g-once"]["params"])


def _dropped(db: tracedb.Database) -> set[str]:
    return set(db.sql("SELECT trace_id FROM traces WHERE dropped IS NOT NULL").column(0).to_pylist())


def test_group_means_come_from_the_whole_stored_group(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", _episodes(dropped=0.0)), progress=False)
        tracedb.credit.run(db, "grpo", "once")
        once = _rows(db, "once")
        varied = next(t for t, v in once.items() if v != 0.0)
        result = tracedb.credit.run(db, "grpo", "one", selection=Selection(trace_ids=[varied]))
        assert result["traces"] == result["rows"] == 1
        assert _rows(db, "one") == {varied: once[varied]}  # not 0.0, the mean of a group of one


def test_a_trace_is_stamped_once_unless_replaced(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", _episodes(dropped=0.0)), progress=False)
        groups = db.sql("SELECT DISTINCT group_id FROM traces ORDER BY 1").column(0).to_pylist()
        tracedb.credit.run(db, "returns", "r", group=groups[:2], gamma=0.5)
        before = _rows(db, "r")
        with pytest.raises(WriteError) as refused:
            tracedb.credit.run(db, "returns", "r", group=groups[1:3], gamma=0.5)
        held = db.traces(group=groups[1]).column("trace_id").to_pylist()
        message = str(refused.value)
        assert f"already holds {len(held)} of the selected traces" in message and "replace=True" in message
        assert all(t in message for t in held) and "nothing written" in message
        assert _rows(db, "r") == before
        # replace=True computes the selected traces again and leaves the others
        db.sql("UPDATE credit SET value = 99 WHERE credit_set = 'r'")
        result = tracedb.credit.run(db, "returns", "r", group=groups[1:3], gamma=0.5, replace=True)
        after = _rows(db, "r")
        first = set(db.traces(group=groups[0]).column("trace_id").to_pylist())
        assert all(v == (99.0, None) for k, v in after.items() if k[0] in first)
        tracedb.credit.run(db, "returns", "whole", gamma=0.5)
        whole = _rows(db, "whole")
        assert {k: v for k, v in after.items() if k[0] not in first} == {
            k: v for k, v in whole.items() if k[0] not in first and db_group(db, k[0]) in groups[1:3]
        }
        assert result["rows"] > 0


def db_group(db: tracedb.Database, trace_id: str) -> str:
    return db.sql("SELECT group_id FROM traces WHERE trace_id = ?", [trace_id]).column(0)[0].as_py()


def test_a_set_takes_one_algorithm_and_its_parameters(tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", _episodes(dropped=0.0)), progress=False)
        groups = db.sql("SELECT DISTINCT group_id FROM traces ORDER BY 1").column(0).to_pylist()
        tracedb.credit.run(db, "grpo", "g", group=groups[0])
        before = _rows(db, "g")
        with pytest.raises(WriteError, match=r"holds grpo with .*not grpo with .*scale_std.*: true.*nothing written"):
            tracedb.credit.run(db, "grpo", "g", group=groups[1], scale_std=True)
        with pytest.raises(WriteError, match="holds grpo with .* not rloo"):
            tracedb.credit.run(db, "rloo", "g", group=groups[1])
        with pytest.raises(ValueError, match="give the selection once"):
            tracedb.credit.run(db, "grpo", "g", selection=Selection(group=groups[1]), after=0)
        assert _rows(db, "g") == before
        # a bad selection is refused before anything is written, naming the argument
        with pytest.raises(ValueError, match="policy needs max_staleness"):
            tracedb.credit.run(db, "grpo", "new", policy=3)
        assert not db.has_credit_set("new")


def test_a_step_credits_what_the_same_selection_packs(tmp_path):
    """Staleness and max_groups select as in micro_batches: the stale groups are not
    credited, and the watermark is the one the pack of the step returns."""
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", _episodes()), progress=False)
        step = {"after": 0, "complete_groups": GROUP, "policy": 2, "max_staleness": 1, "max_groups": 2}
        result = tracedb.credit.run(db, "grpo", "step", **step)
        plan = db.micro_batches(4096, credit="step", trainable=None, **step)
        packed = {t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()}
        assert result["watermark"] == plan.report.watermark
        assert set(_rows(db, "step")) == packed and packed
        assert result["selection"]["stale_groups"] == plan.report.stale_groups
        assert result["selection"]["groups_over"] > 0
        nxt = tracedb.credit.run(db, "grpo", "step", **{**step, "after": result["watermark"]})
        assert nxt["traces"] > 0 and not set(_rows(db, "step")) - packed - set(
            db.traces(after=result["watermark"]).column("trace_id").to_pylist()
        )


def test_a_group_local_run_reads_only_the_selected_groups(tmp_path, monkeypatch):
    """The algorithm sees the selected traces' whole groups and nothing else (temporary
    views over the stored tables, gone after the run, also after a failure); another
    grouping reads everything."""
    seen: list[tuple[int | None, int]] = []
    real = selected.scoped

    @contextlib.contextmanager
    def spying(handle, trace_ids):
        with real(handle, trace_ids):
            count = handle.scalar("SELECT count(*) FROM traces")
            assert handle.scalar("SELECT count(DISTINCT trace_id) FROM nodes") == count
            assert handle.scalar("SELECT count(DISTINCT trace_id) FROM branches") == count
            seen.append((None if trace_ids is None else len(trace_ids), count))
            yield

    monkeypatch.setattr(selected, "scoped", spying)
    episodes = _episodes(dropped=0.0)
    for ep in episodes:  # a per-turn reward field only group-0's nodes hold
        if ep["group"]["id"] == "group-0":
            for node in ep["traces"][0]["nodes"]:
                node["w"] = 0.5
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        db.ingest(_write(tmp_path / "all.jsonl", episodes), progress=False)
        total = db.stats()["traces"]
        one = db.traces(group="group-2").column("trace_id").to_pylist()
        tracedb.credit.run(db, "gae", "a", trace_ids=one[:1])
        assert seen[-1] == (GROUP, GROUP)  # the trace's whole group
        tracedb.credit.run(db, "grpo", "e", trace_ids=one[:1], group_by="$.task.data.idx")
        assert seen[-1] == (None, total)
        assert db.scalar("SELECT count(*) FROM traces") == total
        # a field checked over every node: read whole, so group-2 (which lacks it) is not refused as a typo
        tracedb.credit.run(db, "potential", "p", trace_ids=one[:1], reward_field="w")
        assert seen[-1] == (None, total)
        with pytest.raises(ValueError):
            tracedb.credit.run(db, "gae", "a2", trace_ids=one[:1], gamma=2.0)
        assert db.scalar("SELECT count(*) FROM traces") == total and not db.has_credit_set("a2")
