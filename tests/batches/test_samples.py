"""Which branches become samples: the selection, never-scored branches skipped and
counted, all-zero advantages dropped on request, long samples cut, dropped or refused;
the report's counts against the golden branch files."""

from __future__ import annotations

from typing import Any

import pytest

import tracedb

from support import FIXTURES
from support.batches import NAMES, all_branches, episodes_of, expect, f32, fixture_traces, golden, rebuild


def packed(plan: Any) -> dict[tuple[str, int], Any]:
    out = {}
    for key, found in rebuild(plan).items():
        assert len(found) == 1, key
        out[key] = found[0]
    return out


def ids(name: str) -> list[str]:
    return [t["id"] for t in fixture_traces(name)]


# --------------------------------------------------------------------------- the report against verifiers


@pytest.mark.parametrize("trainable", [True, None, False])
@pytest.mark.parametrize("name", NAMES)
def test_report_counts_match_the_golden_branches(golden_db: tracedb.Database, name: str, trainable: Any) -> None:
    """Counted from NAME.branches.json alone: advantages null -> skipped; all zero ->
    dropped on request; over seq_len -> truncated or dropped."""
    rows = [r for r in golden(name).values() if trainable is None or r["trainable"] == trainable]
    scored = [r for r in rows if r["advantages"] is not None]
    zero = [r for r in scored if all(a == 0 for a in r["advantages"])]
    seq_len = 200
    for drop_zero in (False, True):
        for overflow in ("truncate", "drop"):
            kept = [r for r in scored if not (drop_zero and r in zero)]
            long = [r for r in kept if len(r["token_ids"]) > seq_len]
            plan = golden_db.micro_batches(
                seq_len, trace_ids=ids(name), trainable=trainable, overflow=overflow, drop_zero_advantages=drop_zero
            )
            rep = plan.report
            assert rep.branches == len(rows)
            assert rep.skipped_never_scored == len(rows) - len(scored)
            assert rep.dropped_zero_advantages == (len(zero) if drop_zero else 0)
            assert rep.truncated == (len(long) if overflow == "truncate" else 0)
            assert rep.dropped_overflow == (len(long) if overflow == "drop" else 0)
            want = kept if overflow == "truncate" else [r for r in kept if r not in long]
            assert rep.samples == len(want)
            assert sorted(packed(plan)) == sorted((r["trace_id"], r["index"]) for r in want)


def test_report_counts_over_every_fixture(golden_db: tracedb.Database) -> None:
    rows = [r for name in NAMES for r in golden(name).values()]
    rep = golden_db.micro_batches(150, trainable=None).report
    assert rep.branches == len(rows)
    assert rep.skipped_never_scored == sum(r["advantages"] is None for r in rows)
    assert rep.truncated == sum(r["advantages"] is not None and len(r["token_ids"]) > 150 for r in rows)
    assert rep.samples == sum(r["advantages"] is not None for r in rows)
    trainable = golden_db.micro_batches(150).report
    assert trainable.branches == sum(r["trainable"] for r in rows)


# --------------------------------------------------------------------------- never scored, zero credit


def test_never_scored_is_skipped_not_zero_filled(golden_db: tracedb.Database) -> None:
    """linear: one branch, no advantages anywhere: nothing packed, one padding bin per rank."""
    (row,) = golden("linear").values()
    assert row["advantages"] is None
    plan = golden_db.micro_batches(4096, ranks=3, trace_ids=ids("linear"), pad_to_multiple_of=4)
    assert plan.report.skipped_never_scored == 1 and plan.report.samples == 0
    assert [len(batches) for batches in plan] == [1, 1, 1]
    for (mb,) in plan:
        assert mb.samples.num_rows == 0
        assert not any(mb.tokens.column("loss_mask").to_pylist())
    assert plan.report.padding_micro_batches == plan.report.micro_batches == 3


def test_zero_credit_is_packed_unless_dropped(golden_db: tracedb.Database) -> None:
    """zero_credit: advantages assigned and all zero: a sample (zeros are credit), left
    out only with drop_zero_advantages."""
    (row,) = golden("zero_credit").values()
    assert row["advantages"] is not None and not any(row["advantages"])
    kept = golden_db.micro_batches(4096, trace_ids=ids("zero_credit"))
    (sample,) = packed(kept).values()
    assert sample.columns["advantages"] == [0.0] * len(row["token_ids"])
    assert any(sample.columns["loss_mask"])
    dropped = golden_db.micro_batches(4096, trace_ids=ids("zero_credit"), drop_zero_advantages=True)
    assert dropped.report.dropped_zero_advantages == 1 and dropped.report.samples == 0
    assert packed(dropped) == {}


def test_partial_credit_is_zero_where_unassigned(golden_db: tracedb.Database) -> None:
    """partial_credit: advantages on some nodes only; the others read 0.0, never null."""
    rows = golden("partial_credit")
    got = packed(golden_db.micro_batches(4096, trace_ids=ids("partial_credit")))
    assert sorted(got) == sorted(rows)
    for key, sample in got.items():
        assert sample.columns["advantages"] == f32(rows[key]["advantages"])
        assert None not in sample.columns["advantages"]


# --------------------------------------------------------------------------- overflow


def test_overflow_truncate_drop_error(golden_db: tracedb.Database) -> None:
    (row,) = golden("linear_assigned").values()
    tid, n = row["trace_id"], len(row["token_ids"])
    assert n == 320
    cut = packed(golden_db.micro_batches(100, trace_ids=[tid]))
    assert cut[(tid, 0)].truncated and cut[(tid, 0)].columns["input_ids"] == row["token_ids"][:100]
    exact = packed(golden_db.micro_batches(n, trace_ids=[tid]))
    assert not exact[(tid, 0)].truncated and exact[(tid, 0)].columns["input_ids"] == row["token_ids"]
    dropped = golden_db.micro_batches(n - 1, trace_ids=[tid], overflow="drop")
    assert dropped.report.dropped_overflow == 1 and packed(dropped) == {}
    assert golden_db.micro_batches(n, trace_ids=[tid], overflow="error").report.samples == 1
    with pytest.raises(ValueError, match=rf"trace {tid}, branch 0\b.*320 tokens"):
        golden_db.micro_batches(n - 1, trace_ids=[tid], overflow="error")


def test_overflow_error_names_the_long_branch(golden_db: tracedb.Database) -> None:
    """forest: branch 0 has 73 tokens, branch 1 146: at 100 only branch 1 is refused."""
    rows = golden("forest")
    (tid,) = ids("forest")
    assert [len(rows[(tid, i)]["token_ids"]) for i in (0, 1)] == [73, 146]
    with pytest.raises(ValueError, match=rf"trace {tid}, branch 1\b"):
        golden_db.micro_batches(100, trace_ids=[tid], overflow="error")
    assert sorted(packed(golden_db.micro_batches(100, trace_ids=[tid], overflow="drop"))) == [(tid, 0)]


@pytest.mark.parametrize(
    "kw",
    [
        {"seq_len": 0},
        {"seq_len": 10, "ranks": 0},
        {"seq_len": 10, "overflow": "wrap"},
        {"seq_len": 10, "pad_to_multiple_of": 0},
        {"seq_len": 10, "cost": (1.0, -1.0)},
        {"seq_len": 10, "share_prefixes": True, "train_once": False},
    ],
)
def test_bad_arguments(golden_db: tracedb.Database, kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        golden_db.micro_batches(**kw)


# --------------------------------------------------------------------------- selection


def test_selection(golden_db: tracedb.Database) -> None:
    """trace_ids, group, episode, branch_index and trainable pick the branches as the
    records say."""
    traces = [t for name in NAMES for t in fixture_traces(name)]
    branches = all_branches(traces)
    episodes = [ep for p in sorted(FIXTURES.glob("*.traces.jsonl")) for ep in episodes_of(p)]
    group_of = {t["id"]: (ep.get("group") or {}).get("id") for ep in episodes for t in ep["traces"]}
    episode_of = {t["id"]: ep["id"] for ep in episodes for t in ep["traces"]}

    def want(keep: Any, **kw: Any) -> list[tuple[str, int]]:
        return sorted(b.key for b in expect([b for b in branches if keep(b)], 10_000, **kw).samples)

    some = sorted(group_of)[::5]
    assert sorted(packed(golden_db.micro_batches(10_000, trace_ids=some))) == want(lambda b: b.trace_id in some)
    group = next(g for g in group_of.values() if g)
    got = packed(golden_db.micro_batches(10_000, group=group, trainable=None))
    assert sorted(got) == want(lambda b: group_of[b.trace_id] == group, trainable=None)
    ep = episode_of[some[0]]
    got = packed(golden_db.micro_batches(10_000, episode=ep))
    assert sorted(got) == want(lambda b: episode_of[b.trace_id] == ep)
    got = packed(golden_db.micro_batches(10_000, branch_index=1, trainable=None))
    assert sorted(got) == want(lambda b: True, trainable=None, branch_index=[1])
    got = packed(golden_db.micro_batches(10_000, trainable=False))
    assert sorted(got) == want(lambda b: True, trainable=False)
    assert got, "the fixtures hold an unaccepted compaction attempt that is scored"


def test_named_credit(fresh_db: tracedb.Database) -> None:
    """A credit set scores a branch the ingested credit never did."""
    assert fresh_db.ingest(FIXTURES / "linear.traces.jsonl").ok
    (row,) = golden("linear").values()
    tid = row["trace_id"]
    fresh_db.create_credit_set("half")
    fresh_db.write_traces({"trace_id": [tid], "value": [0.5]}, credit="half")
    assert fresh_db.micro_batches(4096).report.skipped_never_scored == 1
    got = packed(fresh_db.micro_batches(4096, credit="half"))
    assert got[(tid, 0)].columns["advantages"] == [0.5 if m else 0.0 for m in row["sampled_mask"]]
    with pytest.raises(tracedb.NotFound):
        fresh_db.micro_batches(4096, credit="nope")
