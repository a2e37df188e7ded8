"""A pack that cuts samples or skips never-scored branches says so: the report's
``warnings`` (in the manifest, ``--json`` and the REST header too) and a line on stderr,
with how many and the share of loss tokens the cut lost, counted here from the views."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES

SEQ_LEN = 256


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pack-warnings") / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
    return path


def expected_cut(db: tracedb.Database, seq_len: int) -> tuple[int, int, int, int]:
    """From the branch views: samples packed, those cut, sampled tokens, those past the cut."""
    rows = [r for r in db.branches(trainable=True).to_pylist() if r["advantages"] is not None]
    cut = [r for r in rows if len(r["token_ids"]) > seq_len]
    sampled = sum(sum(r["sampled_mask"]) for r in rows)
    lost = sum(sum(r["sampled_mask"][seq_len:]) for r in cut)
    return len(rows), len(cut), sampled, lost


def test_truncation_and_never_scored_branches_are_warned(db_path: Path) -> None:
    with tracedb.connect(db_path, read_only=True) as db:
        samples, cut, sampled, lost = expected_cut(db, SEQ_LEN)
        never = sum(r["advantages"] is None for r in db.branches(trainable=True, columns=["advantages"]).to_pylist())
        report = db.micro_batches(SEQ_LEN).report
        assert 0 < cut < samples and 0 < lost < sampled and never > 0
        assert (report.samples, report.truncated) == (samples, cut)
        assert (report.sampled_tokens, report.truncated_sampled_tokens) == (sampled, lost)
        truncation, skipped = report.warnings()
        assert f"{cut} of {samples} samples truncated to seq_len {SEQ_LEN}" in truncation
        assert f"{lost:,} of {sampled:,} loss tokens ({lost / sampled:.1%})" in truncation
        assert f"{never} of {report.branches} branches skipped: never scored" in skipped
        assert report.to_dict()["warnings"] == [truncation, skipped]
        assert db.micro_batches(1 << 20, credit="default").report.warnings()[:1] == [skipped]  # nothing cut

    out = db_path.parent / "step"
    args = ("pack", "--out", out, "--seq-len", SEQ_LEN, "--db", db_path, "--json")
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    stderr = " ".join(result.stderr.split())
    assert f"warning: {truncation}" in stderr and f"warning: {skipped}" in stderr
    assert json.loads(result.stdout)["report"]["warnings"] == [truncation, skipped]
    assert json.loads((out / "manifest.json").read_text())["report"]["warnings"] == [truncation, skipped]
