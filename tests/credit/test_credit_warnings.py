"""A credit run whose output is another algorithm's by construction says so: in the run's
``warnings``, as a :class:`tracedb.errors.CreditWarning` from the function, and on stderr
from the CLI. Each warning is checked to be true (the credit does equal grpo's), and
runs that differ from grpo stay quiet."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import credit
from tracedb.cli.main import app
from tracedb.credit.anchor import anchor
from tracedb.errors import CreditWarning

from support import FIXTURES
from support.state_traces import ingest, make_episodes, stored


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("warnings") / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
        credit.run(db, "grpo")
    return path


@pytest.mark.parametrize(
    ("algorithm", "params", "words"),
    [
        ("anchor", {}, ["anchor", "state", "grpo"]),
        ("redistribute", {}, ["redistribute", "no weight_field", "uniform control", "grpo"]),
        ("redistribute", {"weight_field": "n_sampled", "epsilon": 1.0}, ["epsilon=1", "uniform control"]),
        ("channels", {"channels": {"role:assistant": "*"}}, ["'role:assistant' selects every sampled token", "grpo"]),
    ],
)
def test_a_run_equal_to_grpo_by_construction_says_so(golden: Path, algorithm: str, params: dict, words: list) -> None:
    with tracedb.connect(golden) as db:
        result = credit.run(db, algorithm, f"w-{algorithm}", replace=True, **params)
        (line,) = result["warnings"]
        for word in words:
            assert word in line, (word, line)
        assert stored(db, f"w-{algorithm}") == stored(db, "grpo")  # the warning is true


def quiet_run(db: tracedb.Database, algorithm: str, **params: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CreditWarning)
        result = credit.run(db, algorithm, replace=True, **params)
    assert "warnings" not in result, (algorithm, result["warnings"])
    assert stored(db, algorithm) != stored(db, "grpo"), algorithm


def test_runs_that_differ_from_grpo_stay_quiet(tmp_path: Path, golden: Path) -> None:
    episodes = make_episodes(7, n_groups=8, sizes=(1, 7))  # shared states with differing returns
    db = ingest(tmp_path, episodes)
    try:
        credit.run(db, "grpo")
        quiet_run(db, "anchor")
        quiet_run(db, "redistribute", weight_field="n_sampled")
    finally:
        db.close()
    with tracedb.connect(golden) as db:
        quiet_run(db, "channels", channels={"tool:bash": "*"})  # the turns that call bash: not every token


def test_the_function_warns_and_the_cli_prints_it_on_stderr(golden: Path) -> None:
    with tracedb.connect(golden, read_only=True) as db, pytest.warns(CreditWarning, match="anchor"):
        anchor(db)
    result = CliRunner().invoke(app, ["credit", "anchor", "--name", "a2", "--db", str(golden), "--json"])
    assert result.exit_code == 0, result.output
    assert "warning: anchor" in result.stderr
    assert json.loads(result.stdout)["warnings"][0].startswith("anchor:")
