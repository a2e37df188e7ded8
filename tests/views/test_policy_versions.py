"""The ``policy_version`` column of branch views and ``branch_tokens()`` on records
verifiers 0.4.1 wrote (``tests/fixtures/verifiers-0.4.1``): each sampled token's version
is its span's label number (``step_12`` -> 12; a label with no number of its own is null
until mapped), else its episode's policy start, else its step; null off-sample. The
expected values come from the fixtures' per-token labels (``NAME.token_versions.json``,
written by the generator from verifiers' own spans), not from the code under test."""

from __future__ import annotations

import json
import re

import pytest

import tracedb

from support import FIXTURES, FIXTURES_041

NAMES = sorted(p.name.removesuffix(".traces.jsonl") for p in FIXTURES_041.glob("*.traces.jsonl"))
OWN = re.compile(r"^(?:step|v|version)?[_-]?(\d+)$", re.IGNORECASE)


def expected(name: str, mapping: dict[str, int]) -> dict[tuple[str, int], list[int | None] | None]:
    """(trace, branch) -> the versions, from the per-token labels and the episodes' run."""
    fallback = {}
    for line in (FIXTURES_041 / f"{name}.traces.jsonl").read_text().splitlines():
        record = json.loads(line)
        traces = record.get("traces", [record]) if "traces" in record else [record]
        work = ((record.get("run") or {}).get("work") or {}) if "traces" in record else {}
        policy = work.get("policy") or {}
        default = policy.get("start", work.get("step"))
        for t in traces:
            fallback[t["id"]] = default
    views = {(b["trace_id"], b["index"]): b for b in json.loads((FIXTURES_041 / f"{name}.branches.json").read_text())}
    out = {}
    for row in json.loads((FIXTURES_041 / f"{name}.token_versions.json").read_text()):
        key = (row["trace_id"], row["index"])
        mask = views[key]["sampled_mask"]
        values = []
        for label, sampled in zip(row["weight_versions"], mask, strict=True):
            if not sampled:
                values.append(None)
            elif label is None:
                values.append(fallback[key[0]])
            else:
                own = OWN.match(label)
                values.append(int(own.group(1)) if own else mapping.get(label))
        out[key] = None if all(v is None for v in values) else values
    return out


@pytest.mark.parametrize("name", NAMES)
def test_views_carry_each_tokens_policy_version(name):
    with tracedb.connect(":memory:") as db:
        db.ingest(FIXTURES_041 / f"{name}.traces.jsonl")
        got = {(r["trace_id"], r["branch_index"]): r["policy_version"] for r in db.branches().to_pylist()}
        assert got == expected(name, {})
        sql = db.sql("SELECT trace_id, branch_index, policy_version FROM branch_tokens()").to_pylist()
        assert {(r["trace_id"], r["branch_index"]): r["policy_version"] for r in sql} == got


def test_a_mapped_label_gets_its_number_everywhere(tmp_path):
    with tracedb.connect(tmp_path / "db.duckdb") as db:
        db.ingest(FIXTURES_041 / "labels.traces.jsonl")
        before = db.sql("SELECT trace_id, policy_min, policy_max, policy_unknown FROM traces").to_pylist()
        assert any(r["policy_unknown"] for r in before)
        labels = {
            s["version"]
            for line in (FIXTURES_041 / "labels.traces.jsonl").read_text().splitlines()
            for t in json.loads(line)["traces"]
            for n in t["nodes"]
            for s in n.get("weight_versions") or []
            if not OWN.match(s["version"])
        }
        mapping = {label: 40 + k for k, label in enumerate(sorted(labels))}
        assert db.set_policy_versions(mapping) >= 1
        after = db.sql("SELECT trace_id, policy_min, policy_max, policy_unknown FROM traces").to_pylist()
        assert all(r["policy_unknown"] == 0 for r in after)
        got = {(r["trace_id"], r["branch_index"]): r["policy_version"] for r in db.branches().to_pylist()}
        assert got == expected("labels", mapping)


def test_records_without_versions_have_none():
    with tracedb.connect(":memory:") as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        assert db.branches().column("policy_version").null_count == db.branches().num_rows
