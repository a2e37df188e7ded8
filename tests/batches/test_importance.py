"""``micro_batches(importance="tis", clip=C)``: the ``importance_weight`` column against
numpy token by token (every packed sample rebuilt from its spans, each token traced back to
its node), the report's counts, the step files, ``tracedb pack --importance``, a recompute
pass written back before packing, and bad parameters."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

import tracedb
import tracedb.credit
from tracedb.batches import importance
from tracedb.cli.main import app

from support.batches import branches_of, rebuild
from support.offpolicy import episodes, ingest


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    eps = episodes(23, n_groups=12)
    db = ingest(tmp_path_factory.mktemp("importance"), eps)
    tracedb.credit.run(db, "grpo", "g")
    yield db, eps
    db.close()


def expected_weight(node: dict[str, Any], position: int, clip: float) -> tuple[bool, float, bool]:
    """(holds both streams, its weight, its ratio was cut) for token ``position`` of a node, by numpy."""
    mask = node["mask"]
    if not mask[position]:
        return False, 1.0, False
    k = sum(mask[:position])
    lp, tr = node.get("logprobs") or [], node.get("trainer_logprobs") or []
    if k >= min(sum(mask), len(lp), len(tr)):
        return False, 1.0, False
    d = np.float64(np.float32(tr[k])) - np.float64(np.float32(lp[k]))
    ratio = np.exp(np.array([d]))
    return True, float(np.minimum(ratio, clip).astype(np.float32)[0]), bool(ratio[0] > clip)


def check_weights(plan: tracedb.Plan, eps: list[dict[str, Any]], clip: float) -> dict[str, int]:
    """Every packed token's ``importance_weight`` equals the reference's (1.0 out of the
    loss), padding is 1.0; returns the reference's counts over the physical loss tokens."""
    traces = {e["traces"][0]["id"]: e["traces"][0] for e in eps}
    branches = {b.key: b for t in traces.values() for b in branches_of(t)}
    physical: dict[tuple[int, int, int], tuple[bool, bool, bool]] = {}
    for key, got in rebuild(plan).items():
        branch = branches[key]
        nodes = traces[key[0]]["nodes"]
        for sample in got:
            columns = sample.columns
            for j, row in enumerate(sample.rows):
                node, position = branch.origin[j]
                held, weight, cut = expected_weight(nodes[node], position, clip)
                loss = columns["loss_mask"][j]
                want = np.float32(weight if loss else 1.0)
                assert np.float32(columns["importance_weight"][j]) == want, (key, j, columns["importance_weight"][j])
                place = (sample.rank, sample.batch, row)
                before = physical.get(place, (False, held, cut))
                physical[place] = (before[0] or loss, held, cut)
    for batches in plan:
        for mb in batches:
            column = mb.tokens.column("importance_weight")
            assert column.type == pa.float32() and column.null_count == 0
            used = np.zeros(len(column), bool)
            for row in mb.samples.column("spans").to_pylist():
                for s in row:
                    used[s["start"] : s["start"] + s["length"]] = True
            assert (column.to_numpy()[~used] == 1.0).all()  # padding
    return {
        "tokens": sum(loss and held for loss, held, _ in physical.values()),
        "defaulted": sum(loss and not held for loss, held, _ in physical.values()),
        "clipped": sum(loss and held and cut for loss, held, cut in physical.values()),
    }


@pytest.mark.parametrize(
    ("clip", "options"),
    [
        (2.0, {}),
        (1.2, {"ranks": 3, "seq_len": 24}),  # truncated samples
        (1.6, {"share_prefixes": True}),
        (1.0, {"train_once": False, "pad_to_multiple_of": 8}),
        (0.5, {"trainable": None, "ranks": 2}),
    ],
)
def test_weights_match_numpy_token_by_token(ragged, clip, options):
    db, eps = ragged
    seq_len = options.pop("seq_len", 512)
    plan = db.micro_batches(seq_len, credit="g", importance="tis", clip=clip, **options)
    counts = check_weights(plan, eps, clip)
    r = plan.report
    assert (r.importance, r.clip) == ("tis", clip)
    assert (r.importance_tokens, r.importance_defaulted, r.importance_clipped) == (
        counts["tokens"],
        counts["defaulted"],
        counts["clipped"],
    )
    assert r.importance_tokens > 20 and r.importance_defaulted > 5 and 0 < r.importance_clipped < r.importance_tokens
    loss = sum(
        int(np.count_nonzero(mb.tokens.column("loss_mask").to_numpy(zero_copy_only=False))) for b in plan for mb in b
    )
    assert r.importance_tokens + r.importance_defaulted == loss
    assert plan.arguments["importance"] == "tis" and plan.arguments["clip"] == clip
    plain = db.micro_batches(seq_len, credit="g", **options)
    for a, b in zip([mb for rank in plan for mb in rank], [mb for rank in plain for mb in rank], strict=True):
        assert a.tokens.drop_columns(["importance_weight"]).equals(b.tokens) and a.samples.equals(b.samples)


def test_without_importance_nothing_changes(ragged):
    db, _ = ragged
    plan = db.micro_batches(512, credit="g")
    assert "importance_weight" not in plan[0][0].tokens.schema.names
    r = plan.report
    assert (r.importance, r.clip, r.importance_tokens, r.importance_defaulted, r.importance_clipped) == (
        None,
        None,
        0,
        0,
        0,
    )
    assert plan.arguments["importance"] is None and plan.arguments["clip"] is None
    assert db.micro_batches(512, credit="g", importance="tis").report.clip == importance.DEFAULT_CLIP


def test_a_recompute_pass_written_back_before_packing(tmp_path):
    """The workflow the weights are for: traces arrive with the engine's logprobs only; the
    trainer recomputes them and writes them back; the next pack weights every loss token."""
    eps = episodes(31, n_groups=4, ragged=False)
    for e in eps:
        for node in e["traces"][0]["nodes"]:
            node.pop("trainer_logprobs", None)
    db = ingest(tmp_path, eps)
    tracedb.credit.run(db, "grpo", "g")
    before = db.micro_batches(512, credit="g", importance="tis", clip=1.5)
    assert before.report.importance_tokens == 0 and before.report.importance_defaulted > 0
    assert all((mb.tokens.column("importance_weight").to_numpy() == 1.0).all() for rank in before for mb in rank)
    rng = np.random.default_rng(4)
    nodes = db.sql(
        "SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 ORDER BY trace_id, node_index"
    )
    recomputed = []
    for row in nodes.to_pylist():
        node = next(e for e in eps if e["traces"][0]["id"] == row["trace_id"])["traces"][0]["nodes"][row["node_index"]]
        node["trainer_logprobs"] = [round(x + float(rng.normal(0, 0.4)), 4) for x in node["logprobs"]]
        recomputed.append({**row, "values": node["trainer_logprobs"]})
    db.write_nodes(
        pa.Table.from_pylist(recomputed).select(["trace_id", "node_index", "values"]), stream="trainer_logprobs"
    )
    after = db.micro_batches(512, credit="g", importance="tis", clip=1.5)
    counts = check_weights(after, eps, 1.5)
    assert after.report.importance_defaulted == 0 == counts["defaulted"]
    assert after.report.importance_tokens == counts["tokens"] == before.report.importance_defaulted


def test_the_step_files_hold_the_column(ragged, tmp_path):
    db, eps = ragged
    plan = db.micro_batches(256, ranks=2, credit="g", importance="tis", clip=1.5)
    manifest = tracedb.batches.write_step(plan, tmp_path / "step")
    assert manifest["report"]["importance_tokens"] == plan.report.importance_tokens > 0
    assert manifest["arguments"]["importance"] == "tis" and manifest["arguments"]["clip"] == 1.5
    for rank in range(2):
        got = tracedb.read_micro_batches(tmp_path / "step", rank)
        assert all(a.tokens.equals(b.tokens) for a, b in zip(got, plan[rank], strict=True))
        assert got[0].tokens.schema.field("importance_weight").type == pa.float32()


def test_pack_importance_on_the_command_line(ragged, tmp_path):
    db, eps = ragged
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as file_db:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(e) + "\n" for e in eps))
        assert file_db.ingest(src, allow_ragged=True).ok
        tracedb.credit.run(file_db, "grpo", "g")
    runner = CliRunner()
    out = tmp_path / "step"
    args = ["pack", "--db", str(path), "--out", str(out), "--seq-len", "300", "--credit", "g"]
    args += ["--importance", "tis", "--clip", "1.5"]
    result = runner.invoke(app, [*args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    with tracedb.connect(path, read_only=True) as file_db:
        plan = file_db.micro_batches(300, credit="g", importance="tis", clip=1.5)
    assert manifest["report"] == json.loads(json.dumps(plan.report.to_dict()))
    assert manifest["report"]["importance_tokens"] > 0 and manifest["report"]["clip"] == 1.5
    got = tracedb.read_micro_batches(out, 0)
    assert all(a.tokens.equals(b.tokens) for a, b in zip(got, plan[0], strict=True))
    for extra, words in (
        (["--importance", "is"], ["importance", "tis"]),
        (["--importance", "tis", "--clip", "0"], ["clip", "above 0"]),
        (["--clip", "2"], ["clip", "needs importance"]),
    ):
        bad = runner.invoke(app, [*args[:9], *extra], catch_exceptions=False)
        assert bad.exit_code == 2, bad.output
        lines = bad.output.strip().splitlines()
        assert len(lines) == 1 and all(w in lines[0] for w in words), bad.output


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"importance": "is"}, "importance must be one of"),
        ({"importance": "TIS"}, "importance must be one of"),
        ({"importance": "tis", "clip": 0}, "clip must be a finite number above 0"),
        ({"importance": "tis", "clip": -1.0}, "clip must be"),
        ({"importance": "tis", "clip": float("nan")}, "clip must be"),
        ({"importance": "tis", "clip": float("inf")}, "clip must be"),
        ({"importance": "tis", "clip": "2"}, "clip must be"),
        ({"clip": 2.0}, "needs importance='tis'"),
    ],
)
def test_bad_parameters_are_one_clear_line(ragged, kwargs, message):
    db, _ = ragged
    with pytest.raises(ValueError, match=message):
        db.micro_batches(64, **kwargs)


def test_an_empty_selection(ragged):
    db, _ = ragged
    plan = db.micro_batches(64, group="no such group", importance="tis")
    assert plan.report.samples == 0 and plan.report.importance_tokens == 0 == plan.report.importance_defaulted
    assert all("importance_weight" in mb.tokens.schema.names for rank in plan for mb in rank)


def test_the_module_checks_on_its_own():
    assert importance.check(None, None) is None
    assert importance.check("tis", None) == importance.DEFAULT_CLIP
    assert importance.check("tis", 3) == 3.0
    with pytest.raises(ValueError, match="clip"):
        importance.check("tis", True)
