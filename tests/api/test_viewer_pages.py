"""The viewer's turn summary, its sampled-only view, and runs side by side (/runs/compare),
checked against what the run of tests/support/run_db.py was written with (the browser's
side: tests/api/test_viewer_browser.py)."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import tracedb
from tracedb.api import create_app
from tracedb.api.runsets import MAX_COMPARED, parse_run
from tracedb.cli.main import app as cli

from support.run_db import REWARDS, Expected, build, write_late


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Run ``a`` (the run_db run) and run ``b`` (the same, moved on by the late group, step 4),
    served by one app named ``a`` with ``b`` beside it; ``zeros`` zeroes one member in ``a``."""
    tmp = tmp_path_factory.mktemp("viewer-pages")
    a_path, a_expected = build(tmp)
    b_dir = tmp / "b"
    b_dir.mkdir()
    b_path = b_dir / "b.duckdb"
    shutil.copy(a_path, b_path)
    b_expected = Expected(**{k: dict(v) for k, v in vars(a_expected).items()})
    late, tags = write_late(b_dir, b_expected)
    with tracedb.connect(b_path) as db:
        db.ingest(late, tags=tags)
    member = next(t for t, g in a_expected.group.items() if g == "group-0" and a_expected.reward[t] == 1.0)
    with tracedb.connect(a_path) as db:
        nodes = db.sql("SELECT node_index, n_sampled FROM nodes WHERE trace_id = ? AND sampled", [member]).to_pylist()
        db.create_credit_set("zeros")
        db.write_nodes(
            [{"trace_id": member, "node_index": n["node_index"], "values": [0.0] * n["n_sampled"]} for n in nodes],
            credit="zeros",
        )
    application = create_app(a_path, name="a", runs={"b": b_path})
    with TestClient(application, base_url="http://127.0.0.1") as client:
        yield {
            "client": client,
            "a": a_expected,
            "b": b_expected,
            "member": member,
            "nodes": nodes,
            "a_path": a_path,
            "b_path": b_path,
        }
    application.state.backend.close()


def test_turn_summary_is_each_sampled_node_in_the_set(runs: dict[str, Any]) -> None:
    client, member, expected = runs["client"], runs["member"], runs["a"]
    answer = client.get(f"/traces/{member}/turns").json()
    assert [t["node_index"] for t in answer["turns"]] == [n["node_index"] for n in runs["nodes"]]
    assert [t["turn"] for t in answer["turns"]] == list(range(1, len(runs["nodes"]) + 1))
    assert answer["n_turns"] == len(runs["nodes"]) and answer["next_from"] is None
    assert answer["sampled_tokens"] == expected.sampled[member] == sum(n["n_sampled"] for n in runs["nodes"])
    advantage = expected.advantage[member]  # group-relative, on every sampled token of the member
    for turn in answer["turns"]:
        assert turn["assigned"] and turn["role"] == "assistant"
        assert turn["mean"] == turn["min"] == turn["max"] == pytest.approx(advantage)
        assert turn["sum"] == pytest.approx(advantage * turn["n_sampled"], rel=1e-5)
    assert answer["scale"] == pytest.approx(abs(advantage))
    zeros = client.get(f"/traces/{member}/turns", params={"credit": "zeros"}).json()
    assert {t["mean"] for t in zeros["turns"]} == {0.0} and zeros["scale"] == 0.0
    unscored = next(t for t, r in expected.reward.items() if r is None)
    none = client.get(f"/traces/{unscored}/turns").json()
    assert none["assigned_turns"] == 0 and none["scale"] is None
    assert all(t["mean"] is None and not t["assigned"] for t in none["turns"])
    paged = client.get(f"/traces/{member}/turns", params={"limit": 1, "turns_from": 1}).json()
    assert [t["turn"] for t in paged["turns"]] == [2] and paged["n_turns"] == answer["n_turns"]
    past = client.get(f"/traces/{member}/turns", params={"turns_from": answer["n_turns"]})
    assert past.status_code == 404 and f"has {answer['n_turns']} turns" in past.json()["detail"]
    assert client.get("/traces/nope/turns").status_code == 404
    assert client.get(f"/traces/{member}/turns", params={"credit": "no-such-set"}).status_code == 404


def test_view_page_summary_and_sampled_only(runs: dict[str, Any]) -> None:
    client, member = runs["client"], runs["member"]
    html = client.get(f"/view/{member}").text
    chips = re.findall(r'<a class="turn" data-node="(\d+)" data-turn="(\d+)" href="#node-\1">', html)
    assert [int(n) for n, _ in chips] == [n["node_index"] for n in runs["nodes"]]
    assert len(re.findall(r'<tr data-node="\d+">', html)) == len(chips)  # the per-turn table
    every = re.findall(r'<article class="node role-(\w+)', html)
    assert set(every) > {"assistant"}
    assert 'id="show-sampled"' in html and "sampled=true" in html
    sampled = client.get(f"/view/{member}", params={"sampled": "true", "credit": "zeros"}).text
    kept = re.findall(r'<article class="node role-(\w+)[^"]*" id="node-(\d+)"', sampled)
    assert [int(i) for _, i in kept] == [n["node_index"] for n in runs["nodes"]] and {r for r, _ in kept} == {
        "assistant"
    }
    assert 'id="show-all"' in sampled and "credit=zeros" in re.search(r'id="show-all" href="([^"]+)"', sampled).group(1)
    assert client.get(f"/view/{member}", params={"sampled": "maybe"}).status_code == 422


def _reward_means(expected: Expected) -> dict[float, float]:
    steps: dict[float, list[float]] = {}
    for trace_id, step in expected.step.items():
        if expected.reward[trace_id] is not None:
            steps.setdefault(step, []).append(expected.reward[trace_id])
    return {s: sum(v) / len(v) for s, v in steps.items()}


def _zero_variance(groups: dict[str, list[float | None]]) -> float:
    scored = {g: [r for r in rewards if r is not None] for g, rewards in groups.items()}
    scored = {g: r for g, r in scored.items() if r}
    return sum(1 for r in scored.values() if max(r) == min(r)) / len(scored)


def test_runs_compare_figures(runs: dict[str, Any]) -> None:
    client, a, b = runs["client"], runs["a"], runs["b"]
    assert client.get("/runs").json() == {"primary": "a", "runs": ["a", "b"]}
    answer = client.get("/api/runs/compare", params={"runs": "a,b"}).json()
    assert answer["axis"] == "tag:step" and [r["name"] for r in answer["runs"]] == ["a", "b"]
    for run, expected, zero_variance in (
        (answer["runs"][0], a, _zero_variance(REWARDS)),
        (answer["runs"][1], b, _zero_variance({**REWARDS, "group-late": [0.3, 0.3, 0.6, 0.9]})),
    ):
        assert run["traces"] == len(expected.reward)
        scored = [r for r in expected.reward.values() if r is not None]
        assert run["reward_mean"] == pytest.approx(sum(scored) / len(scored))
        assert run["zero_variance_share"] == pytest.approx(zero_variance)
        assert run["tokens_per_trace"] == pytest.approx(sum(expected.tokens.values()) / len(expected.tokens))
        with tracedb.connect(runs["a_path"] if run["name"] == "a" else runs["b_path"], read_only=True) as db:
            has_dropped = "dropped" in db.sql("DESCRIBE traces").column("column_name").to_pylist()
        assert run["dropped_recorded"] == has_dropped and run["dropped_share"] == 0.0
        assert run["untagged"] == sum(1 for t in expected.reward if t not in expected.step)
    rows = {row["key"]: row["runs"] for row in answer["rows"]}
    assert sorted(rows) == [0, 1, 2, 3, 4]
    for name, expected in (("a", a), ("b", b)):
        means = _reward_means(expected)
        for step, mean in means.items():
            assert rows[step][name]["reward_mean"] == pytest.approx(mean), (name, step)
    assert "a" not in rows[4] and rows[4]["b"]["traces"] == 4
    assert answer == client.get("/api/runs/compare").json()  # default: every run
    assert client.get("/api/runs/compare", params=[("run", "b"), ("run", "a")]).json()["runs"][0]["name"] == "b"


def test_runs_compare_page(runs: dict[str, Any]) -> None:
    client = runs["client"]
    html = client.get("/runs/compare", params={"runs": "b,a"}).text
    assert re.findall(r'<th class="run-name" data-run="(\w+)">', html) == ["b", "a"]
    assert re.findall(r'<tr data-key="([\d.]+)">', html) == ["0", "1", "2", "3", "4"]
    assert 'id="nav-compare"' in html
    figures = client.get("/api/runs/compare", params={"runs": "b,a"}).json()["runs"]
    missing = sum((not r["dropped_recorded"]) + (not r["staleness_recorded"]) for r in figures)
    assert html.count("(not recorded)") == missing  # a figure the file lacks is said missing, not zero


@pytest.mark.parametrize(
    ("query", "status", "words"),
    [
        ({"runs": "a,zz"}, 404, "no run named 'zz'; this server has a, b"),
        ({"runs": "/etc/passwd"}, 404, "no run named '/etc/passwd'"),
        ({"runs": "../b.duckdb"}, 404, "no run named"),
        ({"runs": "a,a"}, 422, "named twice"),
        ({"runs": ",".join(["a"] * (MAX_COMPARED + 1))}, 422, f"at most {MAX_COMPARED} runs"),
    ],
)
def test_runs_are_named_never_paths(runs: dict[str, Any], query: dict[str, str], status: int, words: str) -> None:
    for route in ("/api/runs/compare", "/runs/compare"):
        response = runs["client"].get(route, params=query)
        assert response.status_code == status, (route, response.text)
        assert words in response.text


def test_run_names_and_the_command_line(tmp_path: Path, runs: dict[str, Any]) -> None:
    assert parse_run("runs/a.duckdb") == ("a", Path("runs/a.duckdb"))
    assert parse_run("base=runs/a.duckdb") == ("base", Path("runs/a.duckdb"))
    for bad, words in (("=x.duckdb", "a run's name"), ("n=", "no path"), ("a b=x", "a run's name")):
        with pytest.raises(ValueError, match=words):
            parse_run(bad)
    odd = tmp_path / "k=v.duckdb"
    shutil.copy(runs["b_path"], odd)
    assert parse_run(str(odd)) == ("k_v", odd)  # an existing file is a path, whatever its name holds
    with pytest.raises(ValueError, match="two runs are named 'a'"):
        create_app(runs["a_path"], name="a", runs={"a": runs["b_path"]})
    with pytest.raises(ValueError, match="run 'same' is the server's own file"):
        create_app(runs["a_path"], name="a", runs={"same": runs["a_path"]})
    with pytest.raises(ValueError, match="run 'c': no database at"):
        create_app(runs["a_path"], name="a", runs={"c": tmp_path / "missing.duckdb"})
    runner = CliRunner()
    same = runner.invoke(cli, ["serve", "--db", str(runs["a_path"]), "--db", str(runs["a_path"])])
    assert same.exit_code == 2 and "named alike" in same.output
    missing = runner.invoke(cli, ["serve", "--db", str(runs["a_path"]), "--db", f"c={tmp_path / 'missing.duckdb'}"])
    assert missing.exit_code == 2 and "no database at" in missing.output
    assert not (tmp_path / "missing.duckdb").exists()


def test_a_run_that_cannot_be_read_is_a_409(runs: dict[str, Any], tmp_path: Path) -> None:
    gone = tmp_path / "gone.duckdb"
    shutil.copy(runs["b_path"], gone)
    application = create_app(runs["a_path"], name="a", runs={"gone": gone})
    gone.unlink()  # after the server started: the request says so, naming the run
    gone.write_bytes(b"not a database file")
    with TestClient(application, base_url="http://127.0.0.1") as client:
        response = client.get("/api/runs/compare", params={"runs": "a,gone"})
    application.state.backend.close()
    assert response.status_code == 409, response.text
    assert response.json()["error"] == "run_unavailable" and "run 'gone'" in response.json()["detail"]
