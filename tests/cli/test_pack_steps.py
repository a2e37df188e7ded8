"""``tracedb pack`` with replay (``--replay-zero-variance`` and its options) and rebuilding a
step (``--from-manifest``): what a trainer's orchestrator types, each refusal one line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

import tracedb
import tracedb.credit
from tracedb.cli.main import app

from support.steps import async_run, ingest_step

runner = CliRunner()


def invoke(*args: object) -> Result:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    """Three steps of an asynchronous run; the watermark after each (0 first)."""
    root = tmp_path_factory.mktemp("store")
    episodes = async_run()
    marks = [0]
    with tracedb.connect(root / "run.duckdb") as db:
        for step in range(1, 4):
            ingest_step(db, root, episodes, step)
            marks.append(db.watermark())
        tracedb.credit.run(db, "grpo", "grpo")
    return root / "run.duckdb", marks


def _pack_steps(db: Path, marks: list[int], root: Path, *extra: object) -> list[dict]:
    manifests = []
    for step in (1, 2, 3):
        out = root / f"step_{step}"
        result = invoke(
            "pack", "--db", db, "--out", out, "--seq-len", 4096, "--complete-groups", 4,
            "--after", marks[step - 1], "--through", marks[step], "--replay-zero-variance",
            "--replay-max-uses", 1, "--replay-seed", 5, "--steps-root", root, *extra,
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        manifests.append(json.loads((out / "manifest.json").read_text()))
    return manifests


def test_pack_replays_zero_variance_groups_and_says_which(store, tmp_path):
    db, marks = store
    manifests = _pack_steps(db, marks, tmp_path / "steps", "--credit", "grpo")
    replayed = [c for m in manifests for c in m["report"]["replayed"]]
    assert replayed, "step 3 replaces its zero-variance groups"
    assert all(m["arguments"]["replay"]["max_uses"] == 1 for m in manifests)
    assert len({c["group"] for c in replayed}) == len(replayed)  # max_uses=1 over the steps
    # The same as the library's choice, and the table says what replaced what.
    with tracedb.connect(db, read_only=True) as database:
        plan = database.micro_batches(
            4096,
            complete_groups=4,
            after=marks[2],
            through=marks[3],
            credit="grpo",
            replay=tracedb.Replay(max_uses=1, seed=5, steps_root=tmp_path / "other"),
        )
    again = invoke(
        "pack", "--db", db, "--out", tmp_path / "table", "--seq-len", 4096, "--complete-groups", 4,
        "--after", marks[2], "--through", marks[3], "--credit", "grpo", "--replay-zero-variance",
        "--replay-seed", 5,
    )  # fmt: skip
    assert again.exit_code == 0, again.output
    for choice in plan.report.replayed:
        assert re.search(
            rf"replayed group {choice['group']} \(4 traces, priority [0-9.e-]+, replayed 0 times before\) "
            rf"for zero-variance group {choice['replaced']}",
            again.stdout,
        )
    assert "replay_unfilled" in again.stdout


def test_pack_from_manifest_rebuilds_byte_identical(store, tmp_path):
    db, marks = store
    _pack_steps(db, marks, tmp_path / "steps", "--ranks", 2, "--share-prefixes")
    for step in (1, 2, 3):
        source = tmp_path / "steps" / f"step_{step}"
        out = tmp_path / "steps" / "again" / f"step_{step}"
        result = invoke("pack", "--db", db, "--from-manifest", source / "manifest.json", "--out", out)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"rebuilt {source} in {out}: 4 files byte-identical to the step's")
        for name in ("rank_0.arrow", "rank_1.arrow", "rank_0.samples.arrow", "rank_1.samples.arrow"):
            assert (source / name).read_bytes() == (out / name).read_bytes()
    printed = invoke("pack", "--db", db, "--from-manifest", source, "--out", tmp_path / "json", "--json")
    assert printed.exit_code == 0, printed.output
    manifest = json.loads(printed.stdout)
    assert manifest["rebuilt_from"] == str(source / "manifest.json")
    # Rebuilt steps under --steps-root are no uses: the next pack chooses as it would without them.
    for step in (1, 2, 3):
        shutil.copytree(tmp_path / "steps" / f"step_{step}", tmp_path / "originals" / f"step_{step}")
    chosen = []
    for k, root in enumerate((tmp_path / "steps", tmp_path / "originals")):
        result = invoke(
            "pack", "--db", db, "--out", tmp_path / f"next_{k}", "--seq-len", 4096, "--complete-groups", 4,
            "--after", marks[2], "--through", marks[3], "--replay-zero-variance", "--replay-max-uses", 2,
            "--replay-seed", 5, "--steps-root", root, "--json",
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        chosen.append(json.loads(result.stdout)["report"]["replayed"])
    assert chosen[0] == chosen[1] and chosen[0]
    assert any(c["uses"] == 1 for c in chosen[0])  # the original steps' replays do count


def test_a_changed_credit_set_exits_1_naming_it(store, tmp_path):
    db, marks = store
    copy = tmp_path / "run.duckdb"
    copy.write_bytes(db.read_bytes())
    result = invoke("pack", "--db", copy, "--out", tmp_path / "step", "--seq-len", 4096, "--credit", "grpo")
    assert result.exit_code == 0, result.output
    with tracedb.connect(copy) as database:
        tracedb.credit.run(database, "grpo", "grpo", replace=True, scale_std=True)
    result = invoke("pack", "--db", copy, "--from-manifest", tmp_path / "step", "--out", tmp_path / "again")
    assert result.exit_code == 1
    (line,) = result.stderr.strip().splitlines()
    assert re.fullmatch(
        rf"{tmp_path / 'step'} cannot be rebuilt byte-identical: credit set 'grpo' changed since the step: .* "
        r"in the manifest",
        line,
    )
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--seq-len", 4096, "--replay-seed", 3], "--replay-seed goes with --replay-zero-variance"),
        (["--seq-len", 4096, "--steps-root", "s"], "--steps-root goes with --replay-zero-variance"),
        (["--seq-len", 4096, "--replay-zero-variance"], "replay replaces whole groups with complete ones"),
        (
            ["--seq-len", 4096, "--complete-groups", 4, "--replay-zero-variance", "--replay-priority", "best"],
            r"replay priority is one of \['signal', 'uniform'\], not 'best'",
        ),
        (
            ["--seq-len", 4096, "--complete-groups", 4, "--replay-zero-variance", "--replay-max-uses", 0],
            "replay max_uses is a number of uses",
        ),
        (
            ["--seq-len", 4096, "--complete-groups", 4, "--replay-zero-variance", "--replay-max-uses", 2],
            "give steps_root",
        ),
        (
            ["--seq-len", 4096, "--complete-groups", 4, "--replay-zero-variance", "--replay-seed", -1],
            "replay seed is an int >= 0",
        ),
        (
            ["--seq-len", 4096, "--complete-groups", 4, "--replay-zero-variance", "--replay-max-staleness", 2],
            "replay max_staleness is measured from the step's policy",
        ),
        ([], r"--seq-len is required \(or --from-manifest to rebuild a step\)"),
        (["--from-manifest", "STEP", "--ranks", 2], "--ranks does not go with --from-manifest"),
        (["--from-manifest", "STEP", "--replay-zero-variance"], "--replay-zero-variance does not go with"),
        (["--from-manifest", "NOWHERE"], "--from-manifest: .*NOWHERE is not a finished step"),
        (["--from-manifest", "DB"], "--from-manifest: .*a step manifest is a manifest.json"),
    ],
)
def test_bad_parameters_exit_2_with_one_line(store, tmp_path, args, message):
    db, marks = store
    step = tmp_path / "step"
    assert invoke("pack", "--db", db, "--out", step, "--seq-len", 4096).exit_code == 0
    subst = {"STEP": step, "NOWHERE": tmp_path / "NOWHERE", "DB": db}
    result = invoke("pack", "--db", db, "--out", tmp_path / "out", *(subst.get(a, a) for a in args))
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


def test_the_step_itself_is_no_output(store, tmp_path):
    db, _ = store
    step = tmp_path / "step"
    assert invoke("pack", "--db", db, "--out", step, "--seq-len", 4096).exit_code == 0
    result = invoke("pack", "--db", db, "--from-manifest", step / "manifest.json", "--out", step)
    assert result.exit_code == 2
    assert "is the step being rebuilt: give another directory" in result.stderr
    assert (step / "manifest.json").exists()


def test_pack_help_lists_the_replay_and_rebuild_options():
    text = invoke("pack", "--help").stdout
    for flag in (
        "--replay-zero-variance",
        "--replay-max-staleness",
        "--replay-priority",
        "--replay-max-uses",
        "--replay-seed",
        "--steps-root",
        "--from-manifest",
    ):
        assert flag in text, flag
