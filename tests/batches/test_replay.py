"""Replay: a step's zero-variance groups replaced by earlier complete groups with signal,
within a staleness bound, used at most ``max_uses`` times over the steps under
``steps_root``; the choice is the highest priority (or a seeded sample), deterministic, and
a group left without a candidate is kept and counted. Every check is against the groups as
SQL states them (``support.steps.groups_at``), not against the replay code."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import tracedb
import tracedb.credit
from tracedb.batches import write_step

from support.hostile import duckdb_run
from support.steps import async_run, groups_at, ingest_step, loss_versions_by_trace, packed_traces

K, KR = 1, 3  # the fresh staleness bound, and the replay's


def trainer_loop(
    root: Path,
    episodes: list[dict[str, Any]],
    steps: int = 8,
    *,
    write: bool = True,
    stale: str | None = None,
    **replay: Any,
) -> list[tuple[int, tracedb.Plan, dict[str, dict[str, Any]], set[str]]]:
    """A prime-rl-style loop: each step ingests the groups dispatched at it, packs the groups
    completed since the last step with policy=step, max_staleness=K and replay, and writes
    the step under ``root / "steps"``. Returns per step: the step, its plan, the groups as of
    its watermark and the groups its selection held (fresh, in the bound)."""
    root.mkdir(parents=True, exist_ok=True)
    out = []
    after = 0
    options = {"max_staleness": KR, "max_uses": 1, "seed": 7, "steps_root": root / "steps", **replay}
    with tracedb.connect(root / "run.duckdb") as db:
        for step in range(1, steps + 1):
            ingest_step(db, root, episodes, step)
            plan = db.micro_batches(
                4096,
                complete_groups=4,
                after=after,
                policy=step,
                max_staleness=K,
                stale=stale,
                replay=tracedb.Replay(**options),
            )
            mark = plan.report.watermark
            groups = groups_at(db, mark)
            window = db.branches(complete_groups=4, after=after, through=mark).column("trace_id").to_pylist()
            in_window = {g for g, r in groups.items() if set(r["traces"]) & set(window)}
            selection = in_window if stale == "mask" else {g for g in in_window if groups[g]["oldest"] >= step - K}
            out.append((step, plan, groups, selection))
            if write:
                write_step(plan, root / "steps" / f"step_{step}")
            after = mark
    return out


@pytest.fixture(scope="module")
def episodes() -> list[dict[str, Any]]:
    return async_run()


@pytest.fixture(scope="module")
def loop(episodes: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("loop")
    return root, trainer_loop(root, episodes)


def test_a_trainer_loop_replaces_each_zero_variance_group_by_the_best_candidate(loop):
    root, steps = loop
    used: Counter[str] = Counter()
    replaced_any = unfilled_any = False
    for step, plan, groups, selection in steps:
        report = plan.report
        flat = {g for g in selection if groups[g]["scored"] and groups[g]["lo"] == groups[g]["hi"]}
        assert report.replay_replaced + report.replay_unfilled == len(flat), step
        # The candidates: complete by the watermark, outside the selection, with signal and
        # credit, within the replay bound, not replayed before (max_uses=1).
        candidates = {
            g: r["mean_abs"] * r["std"]
            for g, r in groups.items()
            if len(r["traces"]) == 4
            and g not in selection
            and r["std"] > 0
            and r["mean_abs"] is not None
            and r["oldest"] >= step - KR
            and used[g] < 1
        }
        assert report.replay_candidates == (len(candidates) if flat else 0), step  # looked for when needed
        choices = report.replayed
        assert len(choices) == min(len(flat), len(candidates))
        assert {c["replaced"] for c in choices} <= flat
        best = sorted(candidates.values(), reverse=True)[: len(choices)]
        assert sorted((c["priority"] for c in choices), reverse=True) == pytest.approx(best, rel=1e-5)
        for c in choices:
            group = groups[c["group"]]
            assert c["traces"] == group["traces"] and c["uses"] == used[c["group"]] == 0
            assert group["done"] <= report.watermark and group["std"] > 0
            used[c["group"]] += 1
        # What was packed: the selection less the replaced groups, plus the replayed ones.
        kept = {t for g in selection - {c["replaced"] for c in choices} for t in groups[g]["traces"]}
        replayed = {t for c in choices for t in c["traces"]}
        assert packed_traces(plan) == kept | replayed
        # No loss token older than its bound: step - K fresh, step - KR replayed.
        for tid, versions in loss_versions_by_trace(plan).items():
            bound = step - (KR if tid in replayed else K)
            assert (versions >= bound).all(), (step, tid)
        replaced_any |= bool(choices)
        unfilled_any |= report.replay_unfilled > 0
    assert replaced_any and unfilled_any  # the run exercises both
    assert max(used.values()) == 1


def test_the_manifest_says_what_replaced_what(loop):
    root, steps = loop
    for step, plan, groups, selection in steps:
        manifest = json.loads((root / "steps" / f"step_{step}" / "manifest.json").read_text())
        assert manifest["report"]["replayed"] == json.loads(json.dumps(plan.report.replayed))
        assert manifest["arguments"]["replay"] == {
            "max_staleness": KR,
            "priority": "signal",
            "max_uses": 1,
            "seed": 7,
            "steps_root": str(root / "steps"),
        }
        assert (manifest["arguments"]["policy"], manifest["arguments"]["max_staleness"]) == (step, K)
        recorded = manifest["selection"]
        assert recorded["watermark"] == plan.report.watermark and recorded["read_at"] >= recorded["watermark"]
        # The selection as resolved (before replay), and the credit read for what was packed.
        assert recorded["trace_ids"] == sorted(t for g in selection for t in groups[g]["traces"])
        assert recorded["traces"] == len(recorded["trace_ids"])
        replaced = {t for c in plan.report.replayed for t in groups[c["replaced"]]["traces"]}
        replayed = {t for c in plan.report.replayed for t in c["traces"]}
        assert manifest["credit"]["set"] == "default" and len(manifest["credit"]["rows_sha256"]) == 64
        assert manifest["credit"]["traces"] == len(set(recorded["trace_ids"]) - replaced) + len(replayed)
        assert [f["tokens_sha256"] for f in manifest["files"]] == [
            hashlib.sha256((root / "steps" / f"step_{step}" / f["tokens"]).read_bytes()).hexdigest()
            for f in manifest["files"]
        ]


def test_replay_is_deterministic(episodes, tmp_path):
    """The same store, manifests and arguments: the same choices, step after step, and the
    same bytes (two runs in two directories)."""
    a = trainer_loop(tmp_path / "a", episodes, steps=6)
    b = trainer_loop(tmp_path / "b", episodes, steps=6)
    for (step, pa_, _, _), (_, pb, _, _) in zip(a, b, strict=True):
        assert pa_.report.replayed == pb.report.replayed, step
        for name in ("rank_0.arrow", "rank_0.samples.arrow"):
            one = (tmp_path / "a" / "steps" / f"step_{step}" / name).read_bytes()
            assert one == (tmp_path / "b" / "steps" / f"step_{step}" / name).read_bytes(), (step, name)
    # Asked again at the last step (its manifest is not there yet): the same choice.
    with tracedb.connect(tmp_path / "a" / "run.duckdb") as db:
        last = a[-1][1]
        (tmp_path / "a" / "steps" / "step_6" / "manifest.json").unlink()
        again = db.micro_batches(
            4096,
            complete_groups=4,
            after=a[-2][1].report.watermark,
            policy=6,
            max_staleness=K,
            replay=tracedb.Replay(max_staleness=KR, max_uses=1, seed=7, steps_root=tmp_path / "a" / "steps"),
        )
        assert again.report.replayed == last.report.replayed


def _ingest(db: tracedb.Database, tmp: Path, episodes: list[dict[str, Any]], steps: int) -> list[int]:
    """Ingest steps 1..``steps``; the watermark after each (index 0: before any)."""
    marks = [db.watermark()]
    for step in range(1, steps + 1):
        ingest_step(db, tmp, episodes, step)
        marks.append(db.watermark())
    return marks


def test_uniform_samples_with_the_seed(episodes, tmp_path):
    """uniform: a candidate drawn with the seed (no priority); a seed gives one choice,
    different seeds different ones."""
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        marks = _ingest(db, tmp_path, episodes, 8)
        groups = groups_at(db, marks[8])

        def choose(seed: int) -> list[str]:
            plan = db.micro_batches(
                4096, complete_groups=4, after=marks[7], replay=tracedb.Replay(priority="uniform", seed=seed)
            )
            assert all(c["priority"] is None for c in plan.report.replayed)
            return [c["group"] for c in plan.report.replayed]

        picks = {seed: choose(seed) for seed in range(6)}
        assert picks[0], "the last step has a zero-variance group"
        assert choose(0) == picks[0] and choose(3) == picks[3]
        assert len({tuple(p) for p in picks.values()}) > 1
        every = {g for p in picks.values() for g in p}
        assert all(groups[g]["std"] > 0 and groups[g]["done"] <= marks[7] for g in every)


def test_max_uses_bounds_replays_across_steps(episodes, tmp_path):
    """The same selection packed step after step: each candidate is replayed at most M
    times; once all are used up, every zero-variance group is kept and counted."""
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        marks = _ingest(db, tmp_path, episodes, 4)
        groups = groups_at(db, marks[4])
        pool = {g for g, r in groups.items() if r["done"] <= marks[3] and r["std"] > 0}
        flat = {g for g, r in groups.items() if r["done"] > marks[3] and r["lo"] == r["hi"]}
        assert pool and flat
        for uses in (1, 2):
            root = tmp_path / f"steps-{uses}"
            seen: Counter[str] = Counter()
            for k in range(len(pool) * uses // len(flat) + 2):
                plan = db.micro_batches(
                    4096,
                    complete_groups=4,
                    after=marks[3],
                    replay=tracedb.Replay(max_uses=uses, seed=k % 3, steps_root=root),
                )
                assert all(seen[c["group"]] == c["uses"] < uses for c in plan.report.replayed)
                seen.update(c["group"] for c in plan.report.replayed)
                write_step(plan, root / f"step_{k}")
            assert set(seen) == pool and all(n == uses for n in seen.values())
            assert plan.report.replay_unfilled == len(flat) and plan.report.replay_candidates == 0


def test_no_candidate_keeps_the_group_and_counts_it(episodes, tmp_path):
    """The first step has nothing earlier: its zero-variance groups stay, counted."""
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in range(1, 3):
            ingest_step(db, tmp_path, episodes, step)
        plain = db.micro_batches(4096, complete_groups=4)
        plan = db.micro_batches(4096, complete_groups=4, replay=tracedb.Replay())
        groups = groups_at(db, db.watermark())
        flat = [g for g, r in groups.items() if r["scored"] and r["lo"] == r["hi"]]
        assert flat
        assert plan.report.replay_unfilled == len(flat) and plan.report.replay_replaced == 0
        assert plan.report.replayed == [] and packed_traces(plan) == packed_traces(plain)


def test_masking_leaves_replayed_groups_to_their_own_bound(episodes, tmp_path):
    """stale="mask" takes the fresh selection's tokens older than step - K out of the loss; a
    replayed group was held whole to the replay bound (step - 2 here), so its tokens stay."""
    steps = trainer_loop(tmp_path, episodes, stale="mask", max_staleness=2)
    older_kept = 0
    for step, plan, groups, selection in steps:
        replayed = {t for c in plan.report.replayed for t in c["traces"]}
        assert all(groups[c["group"]]["oldest"] >= step - 2 for c in plan.report.replayed)
        assert packed_traces(plan) - replayed == {
            t for g in selection - {c["replaced"] for c in plan.report.replayed} for t in groups[g]["traces"]
        }
        for tid, versions in loss_versions_by_trace(plan).items():
            assert (versions >= step - (2 if tid in replayed else K)).all(), (step, tid)
            older_kept += int((versions < step - K).sum()) if tid in replayed else 0
    assert older_kept > 0  # replayed tokens older than the fresh bound were kept, not masked
    assert any(p.report.stale_tokens for _, p, _, _ in steps)


def test_replay_needs_whole_groups_and_a_policy_for_its_bound(episodes, tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        ingest_step(db, tmp_path, episodes, 1)
        with pytest.raises(ValueError, match="give complete_groups=N"):
            db.micro_batches(4096, replay=tracedb.Replay())
        with pytest.raises(ValueError, match="measured from the step's policy"):
            db.micro_batches(4096, complete_groups=4, replay=tracedb.Replay(max_staleness=2))
        with pytest.raises(ValueError, match="replay is a tracedb.Replay"):
            db.micro_batches(4096, complete_groups=4, replay={"max_uses": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_staleness": -1}, "replay max_staleness is a number of policy versions"),
        ({"max_staleness": 1.5}, "replay max_staleness is a number of policy versions"),
        ({"priority": "best"}, r"replay priority is one of \['signal', 'uniform'\], not 'best'"),
        ({"max_uses": 0, "steps_root": "s"}, "replay max_uses is a number of uses"),
        ({"max_uses": True, "steps_root": "s"}, "replay max_uses is a number of uses"),
        ({"max_uses": 2}, "give steps_root"),
        ({"seed": -1}, "replay seed is an int >= 0"),
        ({"seed": "7"}, "replay seed is an int >= 0"),
        ({"steps_root": 3}, "replay steps_root is a directory"),
        ({"steps_root": " "}, "replay steps_root is empty"),
    ],
)
def test_bad_replay_parameters_are_one_clear_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        tracedb.Replay(**kwargs)
    assert "\n" not in str(info.value)


def test_a_foreign_manifest_under_steps_root_is_refused_named(episodes, tmp_path):
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        after = _ingest(db, tmp_path, episodes, 3)[2]  # step 3 holds zero-variance groups
        root = tmp_path / "steps"
        (root / "other").mkdir(parents=True)
        (root / "other" / "manifest.json").write_text(json.dumps({"name": "not a step"}))
        with pytest.raises(tracedb.TraceDBError, match=r"other/manifest.json: not a tracedb step manifest"):
            db.micro_batches(4096, complete_groups=4, after=after, replay=tracedb.Replay(max_uses=1, steps_root=root))
        (root / "other" / "manifest.json").write_text("{not json")
        with pytest.raises(tracedb.TraceDBError, match="cannot read this step manifest"):
            db.micro_batches(4096, complete_groups=4, after=after, replay=tracedb.Replay(max_uses=1, steps_root=root))


@pytest.mark.parametrize("credit", ["default", "grpo", "returns"])
def test_the_credit_mass_replay_ranks_by_is_the_dose_of_the_set(episodes, tmp_path, credit):
    """``credit_abs_mass()`` (per node, no per-token lists for values) sums per trace to
    ``credit_dose()``'s absolute mass and assigned tokens, for per-token lists (default),
    per-trace values (grpo) and per-node lists (returns)."""
    with tracedb.connect(tmp_path / "run.duckdb") as db:
        for step in (1, 2):
            ingest_step(db, tmp_path, episodes, step)
        if credit != "default":
            tracedb.credit.run(db, credit, credit)
        rows = db.sql(
            "WITH m AS (SELECT trace_id, sum(abs_sum) AS abs_mass, sum(n_sampled) AS tokens "
            "           FROM credit_abs_mass(credit := $c) GROUP BY trace_id) "
            "SELECT d.trace_id, d.abs_mass AS dose, d.assigned_tokens, m.abs_mass, m.tokens "
            "FROM credit_dose(credit := $c) d FULL JOIN m USING (trace_id)",
            params={"c": credit},
        ).to_pylist()
    assert rows and any(r["dose"] for r in rows)
    for r in rows:
        assert (r["dose"] is None) == (r["abs_mass"] is None), r
        if r["dose"] is not None:
            assert r["abs_mass"] == pytest.approx(r["dose"], rel=1e-9, abs=1e-9) and r["tokens"] == r["assigned_tokens"]


def test_a_file_whose_macros_predate_replay_replays_read_only_as_read_write(episodes, tmp_path):
    """A file an older tracedb wrote (no credit_abs_mass()), opened read-only: this
    tracedb's macros are the reader's own (temporary), so replay runs and chooses what a
    read-write open, which installs them, chooses."""
    path = tmp_path / "run.duckdb"
    with tracedb.connect(path) as db:
        for step in (1, 2, 3, 4):
            ingest_step(db, tmp_path, episodes, step)
            if step == 2:
                after = db.watermark()  # steps 3-4 packed: steps 1-2 hold the candidates
    duckdb_run(
        path,
        "DROP MACRO TABLE credit_abs_mass",
        "UPDATE tracedb_meta SET value = 'older' WHERE key = 'macros_sha256'",
    )
    replay = tracedb.Replay(seed=1)
    with tracedb.connect(path, read_only=True) as db:
        read_only = db.micro_batches(4096, complete_groups=4, after=after, replay=replay).report
    with tracedb.connect(path) as db:
        read_write = db.micro_batches(4096, complete_groups=4, after=after, replay=replay).report
    assert read_only.replay_replaced > 0 and read_only.replayed == read_write.replayed
