"""CEC records in the database: ingest (validation, rejects with their location, strict,
idempotence, conflicting records), the schema's installation, and the ``tracedb cec``
commands end to end.

The traces and records: :mod:`support.cec_records`; the plan, the stamped arms and the
report: ``test_db_credit.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import cec
from tracedb.cec.cli import app

from support.cec_records import G0, GROUPS, PASS2, hand_records, trace_record, turn_records, verification, write

# --------------------------------------------------------------------------- ingest


def test_ingest_stores_records_and_is_idempotent(db, tmp_path) -> None:
    path = write(tmp_path / "cec.jsonl", hand_records())
    first = cec.ingest_records(db, path)
    assert first.ok and first.added == {"trace": 9, "turn": 42, "verification": 14}
    again = cec.ingest_records(db, path)
    assert again.ok and again.added == {"trace": 0, "turn": 0, "verification": 0} and again.skipped == 65
    row = db.sql("SELECT * FROM cec_turns WHERE trace_id = ? AND node_index = 4", [G0[0]]).to_pylist()[0]
    assert (row["tree"], row["changed_paths"], row["format_error"]) == (f"{G0[0][:6]}-t1", ["src/a.py"], False)
    assert row["source"] == str(path) and row["line"] == 3
    v = db.sql(
        "SELECT status, resolved, f2p, p2p FROM cec_verifications WHERE trace_id = ? AND role = 'original'", [G0[0]]
    )
    assert v.to_pylist()[0] == {"status": "ok", "resolved": True, "f2p": list(PASS2.items()), "p2p": [("p1", "PASSED")]}
    t = db.sql("SELECT rep, cache_salt FROM cec_traces WHERE trace_id = ?", [G0[0]]).to_pylist()[0]
    assert t == {"rep": "0", "cache_salt": "pilot"}


BAD = [
    ("{not json", None, None, None, "not valid JSON"),
    ("[1, 2]", None, None, None, "expected a JSON object"),
    ({"trace_id": G0[0], "node": 2}, G0[0], None, "kind", "kind must be one of"),
    ({"kind": "snapshot", "trace_id": G0[0]}, G0[0], None, "kind", "kind must be one of"),
    ({**turn_records(G0[0], {})[0], "node": "2"}, G0[0], None, "node", "Input should be a valid integer"),
    ({**turn_records(G0[0], {})[0], "format_error": 0}, G0[0], 2, "format_error", "valid boolean"),
    ({**turn_records(G0[0], {})[0], "tree": ""}, G0[0], 2, "tree", "at least 1 character"),
    ({**turn_records(G0[0], {})[0], "extra": 1}, G0[0], 2, "extra", "Extra inputs are not permitted"),
    ({k: v for k, v in turn_records(G0[0], {})[0].items() if k != "tree"}, G0[0], 2, "tree", "Field required"),
    ({**turn_records(G0[0], {})[0], "changed_paths": ["a.py", 3]}, G0[0], 2, "changed_paths.1", "valid string"),
    ({**turn_records(G0[0], {})[0], "changed_paths": ["/abs.py"]}, G0[0], 2, "changed_paths", "repository-relative"),
    ({**turn_records(G0[0], {})[0], "changed_paths": ["a.py", "a.py"]}, G0[0], 2, "changed_paths", "listed twice"),
    (
        {**turn_records(G0[0], {})[0], "changed_paths": ["a.py"], "format_error": True},
        G0[0],
        2,
        "changed_paths",
        "format-error turn executes nothing",
    ),
    ({**turn_records(G0[0], {})[0], "node": 3}, G0[0], 3, "node", "node 3 is a tool node"),
    ({**turn_records(G0[0], {})[0], "node": 0}, G0[0], 0, "node", "node 0 is a system node"),
    ({**turn_records(G0[0], {})[0], "node": 99}, G0[0], 99, "node", "has no node 99"),
    ({**trace_record("nope")}, "nope", None, "trace_id", "not in the database"),
    ({**trace_record(G0[0]), "rep": 1.0}, G0[0], None, "rep", "an integer or a string (got 1.0)"),
    ({**trace_record(G0[0]), "instance_id": None}, G0[0], None, "instance_id", "valid string"),
    (verification(G0[0], "original", True, {"t": "PASSED"}, None), G0[0], None, "p2p", "needs p2p"),
    (verification(G0[0], "original", 1, {"t": "PASSED"}, {}), G0[0], None, "resolved", "valid boolean"),
    (verification(G0[0], "final", True, {"t": "PASSED"}, {}), G0[0], None, "role", "'original' or 'intervention'"),
    ({**verification(G0[0], "original", status="missing"), "resolved": False}, G0[0], None, "resolved", "missing"),
    (verification(G0[0], "original", status="lost"), G0[0], None, "status", "'ok', 'missing' or 'unparseable'"),
    (verification(G0[0], "original", True, {"t": 1}, {}), G0[0], None, "f2p.t", "valid string"),
]


def test_bad_records_are_rejected_with_their_location_and_neighbours_kept(db, tmp_path) -> None:
    good = [trace_record(G0[0]), *turn_records(G0[0], {4: ["a.py"]})]
    lines = []
    for bad, *_ in BAD:
        lines += [bad, good[len(lines) // 2 % len(good)]]
    path = write(tmp_path / "mixed.jsonl", lines)
    report = cec.ingest_records(db, path)
    assert len(report.rejected) == len(BAD)
    for reject, (_, trace_id, node, field, reason) in zip(report.rejected, BAD):
        assert (reject.trace_id, reject.node, reject.field) == (trace_id, node, field), reject
        assert reason in reject.reason, reject
        assert reject.file == str(path)
    assert [r.line for r in report.rejected] == list(range(1, 2 * len(BAD), 2))
    assert sum(report.added.values()) == len(good)  # the good lines, each once
    stored = db.sql("SELECT source, line, trace_id, node, field, reason, record FROM rejects ORDER BY line").to_pylist()
    assert len(stored) == len(BAD) and stored[4]["field"] == "node" and stored[0]["record"] == "{not json"
    assert str(report.rejected[13]) == (
        f"{path}:27, trace {G0[0]}, node 3, field node: node 3 is a tool node; turns are sampled assistant nodes"
    )


def test_conflicting_records_are_rejected_identical_ones_skipped(db, tmp_path) -> None:
    assert cec.ingest_records(db, write(tmp_path / "a.jsonl", [trace_record(G0[0])])).ok
    changed = {**trace_record(G0[0]), "cache_salt": "other"}
    report = cec.ingest_records(db, write(tmp_path / "b.jsonl", [trace_record(G0[0]), changed, changed]))
    assert report.skipped == 1
    assert len(report.rejected) == 2
    assert f"already stored from {tmp_path / 'a.jsonl'}:1" in report.rejected[0].reason
    # Within one file: the first of two different records for a key wins, the second is rejected.
    records = [verification(G0[1], "original", True, {"t": "PASSED"}, {})] * 2
    records.append(verification(G0[1], "original", False, {"t": "PASSED"}, {}))
    report = cec.ingest_records(db, write(tmp_path / "c.jsonl", records))
    assert report.added["verification"] == 1 and report.skipped == 1 and len(report.rejected) == 1
    assert "c.jsonl:1" in report.rejected[0].reason


def test_strict_ingest_aborts_with_the_database_unchanged(db, tmp_path) -> None:
    assert cec.ingest_records(db, write(tmp_path / "a.jsonl", [trace_record(G0[0])])).ok
    before = {
        t: db.sql(f"SELECT count(*) AS n FROM {t}")["n"][0].as_py() for t in ("cec_traces", "cec_turns", "rejects")
    }
    path = write(tmp_path / "b.jsonl", [*turn_records(G0[0], {2: ["a.py"]}), {**trace_record(G0[1]), "rep": None}])
    with pytest.raises(
        tracedb.IngestAborted,
        match=r"b.jsonl:6, trace .*, field rep: Input should be an integer or a string \(got null\)",
    ):
        cec.ingest_records(db, path, strict=True)
    after = {t: db.sql(f"SELECT count(*) AS n FROM {t}")["n"][0].as_py() for t in before}
    assert after == before


def test_schema_is_installed_once_and_plan_needs_records(tmp_path) -> None:
    path = tmp_path / "db.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(GROUPS)
        cec.install(db)
        cec.install(db)  # idempotent
        assert db.sql("SELECT value FROM tracedb_meta WHERE key = 'cec_schema_version'")["value"][0].as_py() == "1"
        with pytest.raises(cec.CecError, match="no CEC plan"):
            cec.report(db)
        summary = cec.plan(db)  # no records at all: every trace is planned, none selected
        assert summary["selection"] == {"no_trace_record": 32}
        with pytest.raises(cec.CecError, match="lam and cap"):
            cec.plan(db, lam=0)
    with tracedb.connect(path, read_only=True) as db:
        assert cec.report(db)["planned_trajectories"] == 32


# --------------------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path: Path) -> None:
    runner = CliRunner()
    dbfile = str(tmp_path / "cli.duckdb")
    with tracedb.connect(dbfile) as db:
        assert db.ingest(GROUPS).ok
    good = write(tmp_path / "cec.jsonl", hand_records())
    result = runner.invoke(app, ["ingest", str(good), "--db", dbfile])
    assert result.exit_code == 0, result.output
    assert "ingested 9 trace, 42 turn and 14 verification records" in result.output
    bad = write(tmp_path / "bad.jsonl", ["{oops", trace_record("missing-trace")])
    result = runner.invoke(app, ["ingest", str(bad), "--db", dbfile, "--json"])
    assert result.exit_code == 1 and len(json.loads(result.stdout)["rejected"]) == 2
    result = runner.invoke(app, ["ingest", str(bad), "--db", dbfile, "--strict"])
    assert result.exit_code == 1 and "ingest aborted, database unchanged" in result.output

    result = runner.invoke(app, ["plan", "--db", dbfile, "--lam", "0.1", "--cap", "0.5", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["query"]["planned"] == 6
    result = runner.invoke(app, ["queries", "--db", dbfile, "--pending", "--json"])
    (pending,) = json.loads(result.stdout)
    assert (
        pending["trace_id"] == G0[6]
        and pending["touched_paths"] == ["p.py"]
        and pending["key"] == "repo__issue-1|0|pilot"
    )
    result = runner.invoke(app, ["stamp", "--db", dbfile, "--lam", "0.1", "--cap", "0.5"])
    assert result.exit_code == 0 and "cec-M" in result.output
    result = runner.invoke(app, ["check", "--db", dbfile])
    assert result.exit_code == 0 and "all identities hold on 3 traces" in result.output
    result = runner.invoke(app, ["report", "--db", dbfile, "--json"])
    assert json.loads(result.stdout)["queries"]["usable"] == 3
    result = runner.invoke(app, ["report", "--db", dbfile])
    assert result.exit_code == 0 and "Issued / usable CF queries" in result.output and "5 / 3" in result.output

    with tracedb.connect(dbfile) as db:
        db.con.execute("UPDATE credit SET value = value * 2 WHERE credit_set = 'cec-B'")
    result = runner.invoke(app, ["check", "--db", dbfile, "--json"])
    assert result.exit_code == 1 and not json.loads(result.stdout)["ok"]


def test_cli_help_for_every_command() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("ingest", "plan", "queries", "stamp", "check", "report", "snapshot", "intervene"):
        assert command in result.output
        sub = runner.invoke(app, [command, "--help"])
        assert sub.exit_code == 0 and "Usage" in sub.output, command
