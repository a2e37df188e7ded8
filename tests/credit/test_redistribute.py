"""Redistribution of a per-trace advantage over turns (``tracedb.credit.redistribute``)
against a plain loop over each trace's turns, on random groups with branches, shared
nodes and missing, zero, null and non-numeric weights; the identities it promises; the
uniform and shuffled controls; every parameter's refusal; one CLI run."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import tracedb
import tracedb.credit
from tracedb.cli.main import app
from tracedb.credit.redistribute import redistribute
from tracedb.errors import NotFound

from support.credit_groups import (
    all_traces,
    as_dict,
    assert_same,
    ingest,
    make_episodes,
    n_sampled,
    reference_grpo,
    shared_sampled_nodes,
    stored,
)


def weight(node: dict[str, Any], field: str | None) -> float:
    """A node's weight as the algorithm reads it: a number, else 0."""
    value = node.get(field) if field else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    return float(value)


def reference_redistribute(
    episodes: list[dict[str, Any]],
    base: dict[str, float],
    weight_field: str | None = "w",
    epsilon: float = 0.0,
    assigned: set[tuple[str, int]] | None = None,
) -> dict[tuple[str, int], list[float]]:
    """(trace id, node) -> compact credit; ``base``: trace id -> A_tau; ``assigned``: the
    nodes the base set assigns (None: every sampled node of a trace in ``base``)."""
    out: dict[tuple[str, int], list[float]] = {}
    for _, trace in all_traces(episodes):
        tid = trace["id"]
        if tid not in base:
            continue
        turns = [
            i for i, node in enumerate(trace["nodes"]) if n_sampled(node) and (assigned is None or (tid, i) in assigned)
        ]
        w = [weight(trace["nodes"][i], weight_field) for i in turns]
        T, total = len(turns), sum(w)
        for i, x in zip(turns, w):
            share = (1 - epsilon) * x / total + epsilon / T if total > 0 else 1 / T
            out[(tid, i)] = [base[tid] * T * share] * n_sampled(trace["nodes"][i])
    return out


def per_trace(credit: dict[tuple[str, int], list[float]]) -> dict[str, list[float]]:
    """Trace id -> its turns' values (one per node, node order)."""
    out: dict[str, list[float]] = defaultdict(list)
    for (tid, _), values in sorted(credit.items()):
        assert len(set(values)) == 1
        out[tid].append(values[0])
    return out


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("epsilon", [0.0, 0.3, 1.0])
def test_matches_reference_with_grpo_on_the_fly(tmp_path: Path, seed: int, epsilon: float) -> None:
    episodes = make_episodes(2000 + seed, weights=0.6)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(redistribute(db, weight_field="w", epsilon=epsilon))
        want = reference_redistribute(episodes, reference_grpo(episodes), "w", epsilon)
        assert_same(got, want)


@pytest.mark.parametrize("seed", range(4))
def test_stored_bases_grpo_and_rloo(tmp_path: Path, seed: int) -> None:
    episodes = make_episodes(2100 + seed)
    with ingest(tmp_path, episodes) as db:
        tracedb.credit.run(db, "grpo", "g", scale_std=True)
        tracedb.credit.run(db, "rloo", "r")
        for name in ("g", "r"):
            base = {tid: values[0] for tid, values in per_trace(stored(db, name)).items()}
            got = as_dict(redistribute(db, base=name, weight_field="w", epsilon=0.2))
            assert_same(got, reference_redistribute(episodes, base, "w", 0.2))
        # The default base is GRPO: the same as a stamped grpo set (up to its float32 storage).
        tracedb.credit.run(db, "grpo", "plain")
        from_set = as_dict(redistribute(db, base="plain", weight_field="w"))
        assert_same(from_set, as_dict(redistribute(db, weight_field="w")))


def test_the_random_groups_cover_the_cases(tmp_path: Path) -> None:
    """Traces whose weights all read 0 (abstain), traces mixing zero and positive weights,
    nodes shared by branches, and weights that are null, strings, or absent."""
    abstain = mixed = odd = 0
    for seed in range(8):
        for _, trace in all_traces(make_episodes(2000 + seed, weights=0.6)):
            w = [weight(n, "w") for n in trace["nodes"] if n_sampled(n)]
            abstain += bool(w) and sum(w) == 0
            mixed += 0 in w and sum(w) > 0
            odd += sum(1 for n in trace["nodes"] if n_sampled(n) and not isinstance(n.get("w", 0), int | float))
    with ingest(tmp_path, make_episodes(2003, weights=0.6)) as db:
        shared = shared_sampled_nodes(db)
    assert abstain >= 5 and mixed >= 10 and odd >= 5 and shared >= 3


@pytest.mark.parametrize("seed", range(4))
def test_turn_sums_are_conserved_and_epsilon_one_is_uniform(tmp_path: Path, seed: int) -> None:
    episodes = make_episodes(2200 + seed)
    with ingest(tmp_path, episodes) as db:
        a_tau = reference_grpo(episodes)
        with_turns = {t["id"] for _, t in all_traces(episodes) if any(n_sampled(n) for n in t["nodes"])}
        a_tau = {tid: a for tid, a in a_tau.items() if tid in with_turns}  # a trace without turns has no rows
        for epsilon, shuffle in ((0.0, None), (0.45, None), (0.0, 7), (0.8, 11)):
            turns = per_trace(as_dict(redistribute(db, weight_field="w", epsilon=epsilon, shuffle_seed=shuffle)))
            assert set(turns) == set(a_tau)
            for tid, values in turns.items():
                T = len(values)
                assert math.isclose(sum(values), T * a_tau[tid], rel_tol=1e-5, abs_tol=1e-5 * T)
        uniform = per_trace(as_dict(redistribute(db, weight_field="w", epsilon=1.0)))
        for tid, values in uniform.items():
            np.testing.assert_allclose(values, a_tau[tid], rtol=1e-6, atol=1e-7)
        # The uniform control is GRPO broadcast, node for node.
        tracedb.credit.run(db, "grpo", "g")
        assert_same(as_dict(redistribute(db, base="g", epsilon=1.0)), stored(db, "g"), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_control_matches_concentration(tmp_path: Path, seed: int) -> None:
    episodes = make_episodes(2300 + seed, n_groups=6, sizes=(3, 6))
    with ingest(tmp_path, episodes) as db:
        plain = per_trace(as_dict(redistribute(db, weight_field="w", epsilon=0.1)))
        shuffled = per_trace(as_dict(redistribute(db, weight_field="w", epsilon=0.1, shuffle_seed=5)))
        again = per_trace(as_dict(redistribute(db, weight_field="w", epsilon=0.1, shuffle_seed=5)))
        other = per_trace(as_dict(redistribute(db, weight_field="w", epsilon=0.1, shuffle_seed=6)))
        assert shuffled == again  # seeded: the same permutation
        assert set(shuffled) == set(plain)
        moved = 0
        for tid, values in plain.items():
            # The same per-trace values on other turns: the same mass and concentration.
            np.testing.assert_allclose(sorted(shuffled[tid]), sorted(values), rtol=1e-6, atol=1e-7)
            a = np.asarray(values)
            assert math.isclose(float((np.asarray(shuffled[tid]) ** 2).sum()), float((a**2).sum()), rel_tol=1e-5)
            moved += not np.allclose(shuffled[tid], values)
        assert moved >= 1  # the weights did move (a one-turn trace cannot)
        assert any(not np.allclose(other[t], shuffled[t]) for t in plain)


def test_unassigned_stays_unassigned_and_partial_bases(tmp_path: Path) -> None:
    episodes = make_episodes(2400, invalid=0.4)
    with ingest(tmp_path, episodes) as db:
        got = as_dict(redistribute(db, weight_field="w"))
        invalid = {t["id"] for _, t in all_traces(episodes)} - set(reference_grpo(episodes))
        assert invalid and not {tid for tid, _ in got} & invalid
        # A hand-written base on some nodes of some traces: only those nodes are turns.
        picked: dict[tuple[str, int], float] = {}
        for k, (_, trace) in enumerate(all_traces(episodes)[:8]):
            for i, node in enumerate(trace["nodes"]):
                if n_sampled(node) and (i + k) % 2 == 0:
                    picked[(trace["id"], i)] = 0.25 * (k - 3)
        db.create_credit_set("part", algorithm="manual")
        nodes = {t["id"]: t["nodes"] for _, t in all_traces(episodes)}
        rows = [
            {"trace_id": t, "node_index": i, "values": [v] * n_sampled(nodes[t][i])} for (t, i), v in picked.items()
        ]
        db.write_nodes(rows, credit="part")
        base = {t: v for (t, _), v in picked.items()}
        want = reference_redistribute(episodes, base, "w", 0.3, assigned=set(picked))
        assert_same(as_dict(redistribute(db, base="part", weight_field="w", epsilon=0.3)), want)


def test_a_base_that_varies_within_a_trace_is_refused_naming_it(tmp_path: Path) -> None:
    episodes = make_episodes(2500, invalid=0.0, sizes=(3, 4), n_groups=2)
    with ingest(tmp_path, episodes) as db:
        trace = next(t for _, t in all_traces(episodes) if sum(1 for n in t["nodes"] if n_sampled(n)) >= 2)
        turns = [i for i, n in enumerate(trace["nodes"]) if n_sampled(n)]
        db.create_credit_set("uneven", algorithm="manual")
        rows = [
            {"trace_id": trace["id"], "node_index": i, "values": [float(k)] * n_sampled(trace["nodes"][i])}
            for k, i in enumerate(turns)
        ]
        db.write_nodes(rows, credit="uneven")
        with pytest.raises(ValueError, match=f"not constant per trace: trace {trace['id']}"):
            redistribute(db, base="uneven")


@pytest.mark.parametrize("bad", [-0.5, "-inf", "inf"])
def test_negative_or_non_finite_weights_are_refused_naming_the_node(tmp_path: Path, bad: Any) -> None:
    episodes = make_episodes(2600, invalid=0.0, n_groups=2)
    trace = next(t for _, t in all_traces(episodes) if any(n_sampled(n) for n in t["nodes"]))
    node = max(i for i, n in enumerate(trace["nodes"]) if n_sampled(n))
    trace["nodes"][node]["w"] = bad
    with ingest(tmp_path, episodes) as db:
        with pytest.raises(ValueError, match=f"trace {trace['id']}, node {node}: weight_field 'w'"):
            redistribute(db, weight_field="w")
        with pytest.raises(ValueError, match=f"node {node}: weight_field"):
            redistribute(db, weight_field="w", epsilon=1.0)  # bad data even where it would not count


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon": 1.5}, "epsilon"),
        ({"epsilon": math.nan}, "epsilon"),
        ({"epsilon": "0.5"}, "epsilon"),
        ({"shuffle_seed": -1}, "shuffle_seed"),
        ({"shuffle_seed": 1.5}, "shuffle_seed"),
        ({"shuffle_seed": True}, "shuffle_seed"),
        ({"weight_field": "no_such_field"}, "weight_field 'no_such_field'"),
        ({"base": 3}, "base"),
    ],
)
def test_parameters_are_validated_naming_them(tmp_path: Path, params: dict, match: str) -> None:
    with ingest(tmp_path, make_episodes(2700, n_groups=1)) as db:
        with pytest.raises(ValueError, match=match):
            redistribute(db, **params)


def test_missing_base_set_names_the_parameter(tmp_path: Path) -> None:
    with ingest(tmp_path, make_episodes(2800, n_groups=1)) as db:
        with pytest.raises(NotFound, match="base: credit set 'nope'"):
            redistribute(db, base="nope")


def test_a_nodes_column_can_be_the_weight(tmp_path: Path) -> None:
    episodes = make_episodes(2900)
    with ingest(tmp_path, episodes) as db:
        got = per_trace(as_dict(redistribute(db, weight_field="n_sampled")))
        a_tau = reference_grpo(episodes)
        for tid, trace in ((t["id"], t) for _, t in all_traces(episodes) if t["id"] in a_tau):
            sizes = [n_sampled(n) for n in trace["nodes"] if n_sampled(n)]
            want = [a_tau[tid] * len(sizes) * s / sum(sizes) for s in sizes]
            np.testing.assert_allclose(got[tid], want, rtol=1e-5, atol=1e-6)


def test_empty_database() -> None:
    with tracedb.connect(":memory:") as db:
        assert redistribute(db).num_rows == 0


def test_cli_uniform_control(tmp_path: Path) -> None:
    episodes = make_episodes(3000)
    path = tmp_path / "traces.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    db_path = tmp_path / "runs.duckdb"
    runner = CliRunner()
    result = runner.invoke(app, ["ingest", str(path), "--db", str(db_path), "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    args = ["credit", "redistribute", "--name", "uniform", "-p", "epsilon=1", "--db", str(db_path), "--json"]
    result = runner.invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["algorithm"] == "redistribute" and info["params"]["epsilon"] == 1
    bad = runner.invoke(app, [*args[:4], "-p", "epsilon=2", "--replace", "--db", str(db_path)])
    assert bad.exit_code == 1 and "epsilon" in bad.stderr
    with tracedb.connect(db_path) as db:
        a_tau = reference_grpo(episodes)
        want = {
            (t["id"], i): [a_tau[t["id"]]] * n_sampled(n)
            for _, t in all_traces(episodes)
            if t["id"] in a_tau
            for i, n in enumerate(t["nodes"])
            if n_sampled(n)
        }
        assert_same(stored(db, "uniform"), want)
        assert info["nodes"] == len(want)
