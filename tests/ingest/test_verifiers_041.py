"""Traces written by verifiers 0.4.1 (``tests/fixtures/verifiers-0.4.1``) ingest with
today's records: every line kept, every record read back (``weight_versions``, ``dropped``
and ``run.work`` ride in the record's remainder), and the branch views are verifiers' own.

Read back exactly but for the per-token float streams, which are equal at float32: 0.4.1
holds them as float32 arrays and writes an unrounded one (``loss_weights``, always) as the
float32 widened to a double (``0.0833333358168602``), which tracedb gives back as the
shortest decimal of that float32 (``0.083333336``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from support import FIXTURES_041
from support.golden import canon_record, golden_file, rows_of
from support.ingested import assert_same, episodes_of

FILES = sorted(FIXTURES_041.glob("*.traces.jsonl"))
NAMES = [p.name.removesuffix(".traces.jsonl") for p in FILES]


def traces_of(path: Path) -> list[dict[str, Any]]:
    """Every trace record of a file: an episode's traces, or the line itself when bare."""
    return [t for r in episodes_of(path) for t in (r["traces"] if "traces" in r else [r])]


def nodes_of(path: Path) -> list[dict[str, Any]]:
    return [n for t in traces_of(path) for n in t["nodes"]]


@pytest.fixture
def all_041(fresh_db):
    report = fresh_db.ingest(FILES)
    assert report.ok, [str(r) for r in report.rejected]
    return fresh_db


def test_the_set_is_there() -> None:
    assert len(NAMES) >= 10
    for name in NAMES:
        assert (FIXTURES_041 / f"{name}.branches.json").is_file(), name
    for path in FILES:
        for t in traces_of(path):
            assert t["verifiers"]["version"] == "0.4.1.dev86", path.name
            assert t["version"] == 1, path.name


def test_the_set_holds_every_case() -> None:
    """What the fixtures are for: each case is in some file."""
    nodes = [n for p in FILES for n in nodes_of(p)]
    spans = [n["weight_versions"] for n in nodes if n.get("weight_versions")]
    assert any(len(s) == 1 for s in spans) and any(len(s) >= 3 for s in spans)
    assert any(n.get("weight_versions", "absent") is None for n in nodes if n["sampled"])  # explicit null
    assert any("weight_versions" not in n for n in nodes if n["sampled"])  # absent (the writer drops None)
    assert any(n.get("weight_versions") == [] for n in nodes)
    labels = {s["version"] for ss in spans for s in ss}
    assert {"step_12", "v3", "12", "version-7", "ckpt-abc", "3f9a1c0de2b4"} <= labels
    traces = [t for p in FILES for t in traces_of(p)]
    assert any(t.get("dropped") for t in traces) and any(t.get("stop_condition") == "max_turn_tokens" for t in traces)
    runs = [r.get("run") for p in FILES for r in episodes_of(p) if "traces" in r]
    works = [(r["type"], (r.get("work") or {}).get("type"), "policy" in (r.get("work") or {})) for r in runs if r]
    assert {("train", "train", True), ("train", "train", False), ("train", "eval", True), ("eval", None, False)} <= set(
        works
    )


@pytest.mark.parametrize("name", NAMES)
def test_round_trip(fresh_db, name: str) -> None:
    path = FIXTURES_041 / f"{name}.traces.jsonl"
    report = fresh_db.ingest(path)
    assert report.ok, [str(r) for r in report.rejected]
    assert report.traces == len(traces_of(path))
    for record in episodes_of(path):
        if "traces" in record:
            got = fresh_db.episode(record["id"])
            assert_same({**got, "traces": None}, {**record, "traces": None})
            assert [canon_record(t) for t in got["traces"]] == [canon_record(t) for t in record["traces"]]
    for trace in traces_of(path):
        assert_same(canon_record(fresh_db.trace(trace["id"])), canon_record(trace))


@pytest.mark.parametrize("name", NAMES)
def test_views_are_verifiers_own(fresh_db, name: str) -> None:
    assert fresh_db.ingest(FIXTURES_041 / f"{name}.traces.jsonl").ok
    expected = golden_file(FIXTURES_041 / f"{name}.branches.json")
    assert rows_of(fresh_db.branches()) == expected
    assert rows_of(fresh_db.sql("SELECT * FROM branch_tokens()")) == expected


def test_all_together(all_041) -> None:
    expected = sorted(
        (r for name in NAMES for r in golden_file(FIXTURES_041 / f"{name}.branches.json")),
        key=lambda r: (r["trace_id"], r["branch_index"]),
    )
    assert rows_of(all_041.branches()) == expected


def test_new_fields_read_back(all_041) -> None:
    (dropped,) = [t for p in FILES for t in traces_of(p) if t.get("dropped") == "judge: task_defect=yes"]
    assert all_041.trace(dropped["id"])["dropped"] == "judge: task_defect=yes"
    (swap,) = [t for t in traces_of(FIXTURES_041 / "weight_swap.traces.jsonl")]
    assert [s["version"] for s in all_041.trace(swap["id"])["nodes"][6]["weight_versions"]] == ["v4", "v5", "v6"]
    kept, _ = traces_of(FIXTURES_041 / "bare_records.traces.jsonl")
    got = all_041.trace(kept["id"])
    assert "dropped" in got and got["dropped"] is None
    assert [n["weight_versions"] for n in got["nodes"] if n["sampled"]][1] is None
    (labels,) = episodes_of(FIXTURES_041 / "labels.traces.jsonl")
    assert all_041.episode(labels["id"])["run"]["work"] == {"type": "train", "step": 12}


@pytest.mark.parametrize("path", sorted(FIXTURES_041.glob("*.token_versions.json")), ids=lambda p: p.name)
def test_token_versions_align_with_the_views(path: Path) -> None:
    """Each ``token_versions`` row belongs to a branch of the same name's views: one label
    per token, none off-sample, and every label one the trace's spans hold."""
    name = path.name.removesuffix(".token_versions.json")
    branches = {
        (r["trace_id"], r["index"]): r for r in json.loads((FIXTURES_041 / f"{name}.branches.json").read_text())
    }
    rows = json.loads(path.read_text())
    assert {(r["trace_id"], r["index"]) for r in rows} == set(branches)
    spans = {
        t["id"]: {s["version"] for n in t["nodes"] for s in n.get("weight_versions") or []}
        for t in traces_of(FIXTURES_041 / f"{name}.traces.jsonl")
    }
    for row in rows:
        branch = branches[(row["trace_id"], row["index"])]
        assert len(row["weight_versions"]) == len(branch["token_ids"])
        for label, sampled in zip(row["weight_versions"], branch["sampled_mask"]):
            assert sampled or label is None
            assert label is None or label in spans[row["trace_id"]]
