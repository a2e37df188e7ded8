"""The run page and the group page, in process: ``/api/run``'s numbers against a plain
Python computation from what the run was written with (tests/support/run_db.py: a
zero-variance group, None rewards, tags as bins, a group across two steps), the pages'
elements, the 4xx answers naming the parameter, and a run that goes on while read.
The browser test (test_viewer_browser.py) checks what the pages draw."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

import tracedb
from tracedb.api import create_app
from tracedb.credit import dose

from support import REPO
from support.run_db import Expected, build, write_late, write_trainer_logprobs

STATIC = REPO / "api" / "static"
TEMPLATES = REPO / "api" / "templates"
Run = tuple[Path, Expected, dict[str, int]]
"""The database, what it was written with, each trace's seq."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The run, with a rejected line and two credit sets: ``zeros`` (all zero on one member
    of group-0) and ``some`` (one sampled node of another member); the seq of each trace."""
    tmp = tmp_path_factory.mktemp("run")
    path, expected = build(tmp)
    with tracedb.connect(path) as db:
        (tmp / "bad.jsonl").write_text('{"not": "an episode"}\n')
        db.ingest(tmp / "bad.jsonl")
        seqs = {r["trace_id"]: r["seq"] for r in db.traces().to_pylist()}
        members = sorted(t for t, g in expected.group.items() if g == "group-0")
        db.create_credit_set("zeros")
        db.create_credit_set("some")
        nodes = db.sql(
            "SELECT trace_id, node_index, n_sampled FROM nodes WHERE trace_id IN (?, ?) AND n_sampled > 0 "
            "ORDER BY trace_id, node_index",
            members[:2],
        ).to_pylist()
        zeros = [
            {"trace_id": n["trace_id"], "node_index": n["node_index"], "values": [0.0] * n["n_sampled"]}
            for n in nodes
            if n["trace_id"] == members[0]
        ]
        db.write_nodes(zeros, credit="zeros")
        one = next(n for n in nodes if n["trace_id"] == members[1])
        db.write_nodes(
            [{"trace_id": one["trace_id"], "node_index": one["node_index"], "values": [0.5] * one["n_sampled"]}],
            credit="some",
        )
    return path, expected, seqs


@pytest.fixture(scope="module")
def client(run: Run) -> Iterator[TestClient]:
    with TestClient(create_app(run[0]), base_url="http://127.0.0.1") as c:
        yield c


def get_run(client: TestClient, **params: Any) -> dict[str, Any]:
    response = client.get("/api/run", params=params)
    assert response.status_code == 200, response.text
    return response.json()


# --------------------------------------------------------------------------- the reference


def reward_stats(rewards: list[float | None]) -> dict[str, Any]:
    scored = np.array([r for r in rewards if r is not None], np.float64)
    if not len(scored):
        return {"scored": 0, "mean": None, "std": None, "min": None, "max": None, "p10": None, "p90": None}
    return {
        "scored": len(scored),
        "mean": scored.mean(),
        "std": scored.std(),
        "min": scored.min(),
        "max": scored.max(),
        "p10": np.quantile(scored, 0.1),
        "p90": np.quantile(scored, 0.9),
    }


def reference_bins(expected: Expected, x: dict[str, float], key: Any) -> dict[Any, dict[str, Any]]:
    """Per bin key: the traces with an x, their reward stats and sizes, and their groups
    (each in the bin of its newest member's x), by plain loops."""
    out: dict[Any, dict[str, Any]] = {}
    for tid, value in x.items():
        b = out.setdefault(key(value), {"ids": [], "groups": set()})
        b["ids"].append(tid)
    members: dict[str, list[str]] = {}
    for tid in x:
        members.setdefault(expected.group[tid], []).append(tid)
    for group, ids in members.items():
        out.setdefault(key(max(x[t] for t in ids)), {"ids": [], "groups": set()})["groups"].add(group)
    for b in out.values():
        b.update(reward_stats([expected.reward[t] for t in b["ids"]]))
        b["traces"] = len(b["ids"])
        b["tokens"] = sum(expected.tokens[t] for t in b["ids"])
        b["sampled"] = sum(expected.sampled[t] for t in b["ids"])
        scored_groups = zero = single = 0
        for g in b["groups"]:
            rewards = [expected.reward[t] for t in members[g] if expected.reward[t] is not None]
            if rewards:
                scored_groups += 1
                single += len(rewards) == 1
                zero += len(set(rewards)) == 1
        b.update(groups=len(b["groups"]), groups_scored=scored_groups, groups_single=single, zero_variance=zero)
    return out


def assert_bins(got: list[dict[str, Any]], want: dict[Any, dict[str, Any]], keys: list[Any]) -> None:
    assert len(got) == len(keys)
    for row, key in zip(got, keys, strict=True):
        ref = want[key]
        for name in ("traces", "scored", "tokens", "sampled", "groups", "groups_scored", "groups_single"):
            assert row[name] == ref[name], (key, name, row[name], ref[name])
        assert row["zero_variance"] == ref["zero_variance"], key
        for name in ("mean", "std", "min", "max", "p10", "p90"):
            assert (row[name] is None) == (ref[name] is None), (key, name)
            if ref[name] is not None:
                assert row[name] == pytest.approx(ref[name], abs=1e-12), (key, name)
        assert row["dropped"] == 0 and row["dropped_share"] == 0.0  # this run drops nothing
        assert row["tokens_mean"] == pytest.approx(ref["tokens"] / ref["traces"])
        assert row["sampled_share"] == pytest.approx(ref["sampled"] / ref["tokens"])
        share = ref["zero_variance"] / ref["groups_scored"] if ref["groups_scored"] else None
        assert row["zero_variance_share"] == (None if share is None else pytest.approx(share))


# --------------------------------------------------------------------------- /api/run


def test_summary_matches_the_written_run(client: TestClient, run: Run) -> None:
    _, expected, seqs = run
    data = get_run(client)
    assert data["changed"] is True and data["watermark"] == max(seqs.values()) == len(expected.reward)
    s = data["summary"]
    rewards = [r for r in expected.reward.values() if r is not None]
    assert s["traces"] == len(expected.reward) and s["groups"] == 6
    assert s["scored"] == len(rewards) and s["unscored"] == 5
    assert s["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert s["reward_std"] == pytest.approx(float(np.std(rewards)))
    assert s["tokens"] == sum(expected.tokens.values()) and s["sampled"] == sum(expected.sampled.values())
    # zero variance: group-1 (all 1), group-2 (scored members all 0.5), group-5 (all 0); group-3 has no score
    assert s["groups_scored"] == 5 and s["groups_zero_variance"] == 3
    assert s["zero_variance_share"] == pytest.approx(3 / 5)
    assert s["age_s"] >= 0 and s["last_arrival"]
    assert data["rejects"]["total"] == 1 and data["rejects"]["recent"] == 1
    assert data["rejects"]["last_source"].endswith("bad.jsonl") and data["rejects"]["last_reason"]


def test_dropped_share_per_training_step(tmp_path: Path, client: TestClient) -> None:
    """An asynchronous run (verifiers 0.4.1's fields): the episodes' training step is an x
    axis (auto picks it without a step tag), and each step's dropped traces and their share
    are counted from the records as written, as is the headline figure."""
    from tracedb.synthetic import generate_episodes, versioned

    eps = generate_episodes(
        groups=8, group_size=3, tokens_per_trace=300, system_tokens=20, task_tokens=8, turn_tokens=(8, 30), seed=4
    )
    episodes = list(versioned(eps, step=4, groups_per_step=2, dropped_share=0.3, seed=4))
    path = tmp_path / "async.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    want: dict[int, list[int]] = {}
    for ep in episodes:
        counts = want.setdefault(ep["run"]["work"]["step"], [0, 0])
        for trace in ep["traces"]:
            counts[0] += 1
            counts[1] += trace.get("dropped") is not None
    assert len(want) == 4 and 0 < sum(d for _, d in want.values()) < len(episodes)
    with tracedb.connect(tmp_path / "async.duckdb") as db:
        db.ingest(path)
    with TestClient(create_app(tmp_path / "async.duckdb"), base_url="http://127.0.0.1") as c:
        data = get_run(c)
        assert data["axis"]["by"] == "work_step" and "work_step" in data["axes"]
        assert data["axis"]["layout"] == "values" and data["axis"]["untagged"] == 0
        got = {row["lo"]: (row["traces"], row["dropped"], row["dropped_share"]) for row in data["bins"]}
        assert got == {step: (n, d, pytest.approx(d / n)) for step, (n, d) in want.items()}
        total, dropped = len(episodes), sum(d for _, d in want.values())
        assert data["summary"]["dropped"] == dropped and data["summary"]["dropped_share"] == pytest.approx(
            dropped / total
        )
        by_seq = get_run(c, by="seq", bins=1)["bins"]
        assert by_seq[0]["dropped"] == dropped
    response = client.get("/api/run", params={"by": "work_step"})  # a run without training steps
    assert response.status_code == 422 and "training step" in response.json()["detail"]
    assert "work_step" not in get_run(client)["axes"]


@pytest.mark.parametrize("bins", [1, 3, 7, 100])
def test_seq_bins(client: TestClient, run: Run, bins: int) -> None:
    _, expected, seqs = run
    data = get_run(client, by="seq", bins=bins)
    width = math.ceil(len(seqs) / bins)
    want = reference_bins(expected, {t: float(s) for t, s in seqs.items()}, lambda v: int(v - 1) // width)
    keys = sorted(want)
    assert len(keys) <= bins
    assert data["axis"] == {
        "by": "seq",
        "requested": "seq",
        "bins": bins,
        "layout": "width",
        "width": width,
        "through": len(seqs),
        "untagged": 0,
    }
    assert_bins(data["bins"], want, keys)
    for row, key in zip(data["bins"], keys):
        assert row["lo"] == key * width + 1 and row["hi"] == min((key + 1) * width, len(seqs))
        ids = want[key]["ids"]
        assert row["x_min"] == min(seqs[t] for t in ids) and row["x_max"] == max(seqs[t] for t in ids)


def test_tag_bins_one_per_value(client: TestClient, run: Run) -> None:
    _, expected, _ = run
    data = get_run(client)  # auto: the step tag
    assert data["axis"]["by"] == "tag:step" and data["axis"]["layout"] == "values"
    assert data["axis"]["untagged"] == 4 and data["axes"] == ["seq", "tag:step"]
    want = reference_bins(expected, expected.step, lambda v: v)
    assert_bins(data["bins"], want, [0.0, 1.0, 2.0, 3.0])
    assert [b["x"] for b in data["bins"]] == [0.0, 1.0, 2.0, 3.0]
    # group-4 arrived at steps 2 and 3: counted once, at 3; its step-2 traces still count at 2
    assert [b["groups"] for b in data["bins"]] == [2, 2, 0, 1]
    assert [b["traces"] for b in data["bins"]] == [8, 8, 2, 2]


def test_tag_bins_in_ranges(client: TestClient, run: Run) -> None:
    _, expected, _ = run
    data = get_run(client, by="tag:step", bins=2)  # 4 values in 2 ranges of 1.5
    assert data["axis"]["layout"] == "range" and data["axis"]["width"] == 1.5 and data["axis"]["lo"] == 0.0
    want = reference_bins(expected, expected.step, lambda v: min(int(v // 1.5), 1))
    assert_bins(data["bins"], want, [0, 1])
    assert [(b["lo"], b["hi"]) for b in data["bins"]] == [(0.0, 1.5), (1.5, 3.0)]


@pytest.mark.parametrize(("recent", "hist_bins"), [(0, 4), (0, 1), (6, 3), (4, 5)])
def test_histogram(client: TestClient, run: Run, recent: int, hist_bins: int) -> None:
    _, expected, seqs = run
    latest = sorted(seqs, key=seqs.get, reverse=True)[: recent or None]
    rewards = [expected.reward[t] for t in latest if expected.reward[t] is not None]
    h = get_run(client, recent=recent, hist_bins=hist_bins)["histogram"]
    assert h["traces"] == len(latest) and h["scored"] == len(rewards)
    lo, hi = min(rewards), max(rewards)
    n = hist_bins if hi > lo else 1
    counts = [0] * n
    for r in rewards:
        counts[min(int((r - lo) / (hi - lo) * n), n - 1) if hi > lo else 0] += 1
    assert [b["count"] for b in h["bins"]] == counts and sum(counts) == len(rewards)
    assert h["bins"][0]["lo"] == lo and h["bins"][-1]["hi"] == hi
    for a, b in zip(h["bins"], h["bins"][1:]):
        assert a["hi"] == pytest.approx(b["lo"])


def test_histogram_of_unscored_traces_is_empty(client: TestClient, run: Run) -> None:
    _, expected, seqs = run
    with client.app.state.backend.reader() as db:
        h = pages_module().histogram(db, min(seqs[t] for t, g in expected.group.items() if g == "group-3") - 1, 0, 5)
    assert h["bins"] and h["scored"] > 0  # before group-3: scored traces
    with tracedb.connect(":memory:") as empty:
        h = pages_module().histogram(empty, 0, 0, 5)
        assert h == {"recent": 0, "traces": 0, "scored": 0, "lo": None, "hi": None, "bins": []}
        assert pages_module().run_data(empty)["bins"] == []


def pages_module() -> Any:
    from tracedb.api import pages

    return pages


def test_recent_groups(client: TestClient, run: Run) -> None:
    _, expected, seqs = run
    groups = get_run(client)["recent_groups"]
    last = {}
    for tid, g in expected.group.items():
        last[g] = max(last.get(g, 0), seqs[tid])
    assert [g["group_id"] for g in groups] == sorted(last, key=last.get, reverse=True)
    for g in groups:
        rewards = [expected.reward[t] for t, gg in expected.group.items() if gg == g["group_id"]]
        ref = reward_stats(rewards)
        assert g["traces"] == 4 and g["scored"] == ref["scored"] and g["last_seq"] == last[g["group_id"]]
        assert g["zero_variance"] == (ref["scored"] > 0 and ref["min"] == ref["max"])
        assert g["mean"] == (None if ref["mean"] is None else pytest.approx(ref["mean"]))


def test_after_the_watermark_answers_only_what_is_cheap(client: TestClient) -> None:
    w = get_run(client)["watermark"]
    same = get_run(client, after=w)
    assert same["changed"] is False and same["watermark"] == w and "bins" not in same and same["rejects"]["total"] == 1
    assert get_run(client, after=w - 1)["changed"] is True


def test_the_run_goes_on(tmp_path: Path) -> None:
    path, expected = build(tmp_path)
    with TestClient(create_app(path, token="t"), base_url="http://127.0.0.1") as c:
        first = get_run(c, by="tag:step")
        assert get_run(c, by="tag:step", after=first["watermark"])["changed"] is False
        late, tags = write_late(tmp_path, expected)
        with c.app.state.backend.writer() as db:
            db.ingest(late, tags=tags)
        then = get_run(c, by="tag:step", after=first["watermark"])
    assert then["changed"] is True and then["watermark"] == first["watermark"] + 4
    assert then["summary"]["traces"] == first["summary"]["traces"] + 4
    assert [b["x"] for b in then["bins"]] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert_bins(then["bins"], reference_bins(expected, expected.step, lambda v: v), [0.0, 1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("bins=0", "bins"),
        ("bins=501", "bins"),
        ("bins=x", "bins"),
        ("by=nonsense", "by"),
        ("by=tag:nope", "by"),
        ("by=tag:", "by"),
        ("after=-1", "after"),
        ("after=x", "after"),
        ("recent=-1", "recent"),
        ("hist_bins=0", "hist_bins"),
        ("hist_bins=101", "hist_bins"),
        ("mismatch_c=0.9", "mismatch_c"),
        ("mismatch_c=nan", "mismatch_c"),
        ("mismatch_c=x", "mismatch_c"),
    ],
)
def test_bad_parameters_are_422_naming_them(client: TestClient, query: str, name: str) -> None:
    response = client.get(f"/api/run?{query}")
    assert response.status_code == 422, response.text
    assert re.search(rf"\b{name}\b", response.json()["detail"]), response.json()


def test_library_refuses_out_of_range_directly() -> None:
    pages = pages_module()
    with tracedb.connect(":memory:") as db:
        for kwargs, name in [
            ({"bins": 0}, "bins"),
            ({"hist_bins": 1000}, "hist_bins"),
            ({"recent": -2}, "recent"),
            ({"mismatch_c": 0.5}, "mismatch_c"),
            ({"mismatch_c": float("inf")}, "mismatch_c"),
        ]:
            with pytest.raises(Exception, match=name):
                pages.run_data(db, **kwargs)


# --------------------------------------------------------------------------- the pages


def test_run_page_renders(client: TestClient) -> None:
    response = client.get("/run?by=seq&bins=40&refresh=0.5")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    html = response.text
    for element in (
        "plot-reward",
        "plot-hist",
        "plot-zero",
        "plot-tokens",
        "plot-sampled",
        "plot-k3",
        "plot-outside",
        "plot-dropped",
        "mismatch-c",
        "headline",
        "groups",
    ):
        assert f'id="{element}"' in html, element
    config = json.loads(re.search(r'<script type="application/json" id="run-config">(.*?)</script>', html).group(1))
    assert config == {"by": "seq", "bins": 40, "max_bins": 500, "refresh_s": 0.5, "mismatch_c": 2.0}
    assert '<script src="/static/run.js"></script>' in html and 'href="/run"' in client.get("/").text


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ("by=nope", 422),
        ("by=tag:nope", 422),
        ("bins=0", 422),
        ("refresh=0", 422),
        ("refresh=x", 422),
        ("mismatch_c=0.5", 422),
    ],
)
def test_run_page_bad_parameters(client: TestClient, query: str, status: int) -> None:
    response = client.get(f"/run?{query}")
    assert response.status_code == status and query.split("=")[0] in response.json()["detail"]


def group_payload(html: str) -> dict[str, Any]:
    return json.loads(re.search(r'<script type="application/json" id="group-data">(.*?)</script>', html, re.S).group(1))


def test_group_page_members_statuses_and_strips(client: TestClient, run: Run) -> None:
    _, expected, _ = run
    members = sorted(t for t, g in expected.group.items() if g == "group-0")
    html = client.get("/view/group/group-0").text
    rows = re.findall(r'<tr data-trace="([0-9a-f]+)">', html)
    # side by side by reward, highest first, trace id breaking ties
    assert rows == sorted(members, key=lambda t: (-expected.reward[t], t))
    for tid in members:
        assert f'href="/view/{tid}?credit=default"' in html
    table = {}
    for tid, body in re.findall(r'<tr data-trace="([0-9a-f]+)">(.*?)</tr>', html, re.S):
        table[tid] = {s: v for v, s in re.findall(r'class="credit-status status-(\w+)" data-set="(\w+)"', body)}
    for tid in members:
        assert table[tid]["default"] == "assigned"  # rewards differ: nonzero advantages everywhere
        assert table[tid]["zeros"] == ("zero" if tid == members[0] else "unassigned")
        assert table[tid]["some"] == ("partial" if tid == members[1] else "unassigned")
    data = group_payload(html)
    assert data["group_id"] == "group-0" and data["credit"] == "default" and data["color"] == "advantage"
    with client.app.state.backend.reader() as db:
        view = db.branches(group="group-0", columns=["token_ids", "sampled_mask", "advantages", "logprobs"])
    assert len(data["nodes"]) == view.num_rows == html.count('class="strip"')
    assert sum(s["advantages"] is not None for s in data["nodes"]) >= len(members)
    by_branch = {(r["trace_id"], r["branch_index"]): r for r in view.to_pylist()}
    order = [(tid, b) for tid in rows for (t, b) in sorted(by_branch) if t == tid]
    for i, (strip, key) in enumerate(zip(data["nodes"], order, strict=True)):
        assert f'<div class="strip" data-node="{i}">' in html
        ref = by_branch[key]
        start = ref["sampled_mask"].index(True) if any(ref["sampled_mask"]) else 0
        end = min(len(ref["token_ids"]), start + 2000)
        assert strip["offset"] == start
        assert strip["token_ids"] == ref["token_ids"][start:end]
        assert strip["sampled_mask"] == ref["sampled_mask"][start:end]
        for stream in ("advantages", "logprobs"):
            want = ref[stream]  # None on a branch without sampled nodes
            assert strip[stream] == (None if want is None else pytest.approx(want[start:end])), stream
        assert all(
            a == pytest.approx(expected.advantage[key[0]])
            for a, m in zip(strip["advantages"] or [], strip["sampled_mask"])
            if m
        )


def test_group_page_zero_variance_and_unassigned(client: TestClient, run: Run) -> None:
    _, expected, _ = run
    html = client.get("/view/group/group-2").text
    assert "zero variance: no group-relative gradient" in html
    unscored = next(t for t, g in expected.group.items() if g == "group-2" and expected.reward[t] is None)
    rows = re.findall(r'<tr data-trace="([0-9a-f]+)">(.*?)</tr>', html, re.S)
    assert rows[-1][0] == unscored  # unscored last
    for tid, body in rows:
        status = re.search(r'status-(\w+)" data-set="default"', body).group(1)
        assert status == ("unassigned" if tid == unscored else "zero")  # every scored member's advantage is 0
    data = group_payload(html)
    assert data["nodes"][-1]["advantages"] is None  # the unscored member's strips hold no credit
    assert "rewards differ" in client.get("/view/group/group-4").text


def test_group_page_in_another_credit_set(client: TestClient, run: Run) -> None:
    html = client.get("/view/group/group-0?credit=some&color=logprob").text
    data = group_payload(html)
    assert data["credit"] == "some" and data["color"] == "logprob"
    row = re.search(r"<tr data-trace=.*?</tr>", html, re.S).group(0)  # each member: a status per set, in order
    assert re.findall(r'<span class="set-name">(\w+)</span>', row) == ["some", "default", "zeros"]
    assert sum(s["advantages"] is not None for s in data["nodes"]) >= 1
    assert sum(s["advantages"] is None for s in data["nodes"]) >= 3


@pytest.mark.parametrize(
    ("url", "status"),
    [("/view/group/nope", 404), ("/view/group/group-0?credit=nope", 404), ("/view/group/group-0?color=red", 422)],
)
def test_group_page_errors(client: TestClient, url: str, status: int) -> None:
    response = client.get(url)
    assert response.status_code == status and response.json()["detail"]


@pytest.mark.parametrize(("a", "b"), [("default", "zeros"), ("some", "default"), ("some", "zeros")])
def test_group_compare_figures_are_the_librarys_over_the_group(client: TestClient, run: Run, a: str, b: str) -> None:
    _, expected, _ = run
    members = sorted(t for t, g in expected.group.items() if g == "group-0")
    html = client.get(f"/view/group/group-0?credit={a}&compare={b}").text
    figures = group_payload(html)["compare"]
    with client.app.state.backend.reader() as db:
        want = dose.compare(db, [a, b], trace_ids=members)
        per_trace = dose.dose(db, [a, b], per_trace=True).to_pylist()
    assert figures["a"] == a and figures["b"] == b and figures["traces"] == members
    assert figures["dose"] == [pytest.approx(row) for row in want["dose"].to_pylist()]
    if want["agreement"].num_rows:
        assert figures["agreement"] == pytest.approx(want["agreement"].to_pylist()[0])
    else:  # the two share no token in the group
        assert figures["agreement"] == {
            "set_a": a,
            "set_b": b,
            "shared_tokens": 0,
            "sign_agreement": None,
            "correlation": None,
        }
        assert (a, b) == ("some", "zeros")
    # the restriction is the group's: its members' per-trace figures add up to the set's
    for row in figures["dose"]:
        mine = [r for r in per_trace if r["credit_set"] == row["credit_set"] and r["trace_id"] in members]
        assert row["traces"] == len(members)
        for key in ("sampled_tokens", "assigned_tokens", "credited_tokens"):
            assert row[key] == sum(r[key] for r in mine), key
        masses = [r["abs_mass"] for r in mine if r["abs_mass"] is not None]
        assert row["abs_mass"] == (pytest.approx(sum(masses)) if masses else None)
    # the tables show those figures, per set and for the pair
    section = re.search(r'<section id="group-compare">(.*?)</section>', html, re.S).group(1)
    for row in figures["dose"]:
        body = re.search(rf'<tr data-set="{row["credit_set"]}">(.*?)</tr>', section, re.S).group(1)
        cells = dict(re.findall(r'data-figure="(\w+)">([^<]*)</td>', body))
        for key in ("traces_assigned", "sampled_tokens", "assigned_tokens", "credited_tokens"):
            assert cells[key] == str(row[key]), key
        for key in ("coverage", "mass", "abs_mass", "sq_mass", "concentration"):
            assert cells[key] == ("—" if row[key] is None else f"{row[key]:.4g}"), key
    pair = dict(re.findall(r'data-figure="(\w+)">([^<]*)</td>', section.split('id="compare-agreement"')[1]))
    agree = figures["agreement"]
    assert pair["shared_tokens"] == str(agree["shared_tokens"])
    for key in ("sign_agreement", "correlation"):
        assert pair[key] == ("—" if agree[key] is None else f"{agree[key]:.4g}"), key
    for tid in members:  # each member links its trace compare view
        assert html.count(f'href="/view/{tid}?credit={a}&amp;compare={b}"') == 2
    assert re.search(rf'<option value="{b}" selected>', html)


def test_group_compare_of_different_credit(client: TestClient, run: Run) -> None:
    """zeros assigns one member, all zero; the default set every member: the figures say so."""
    _, expected, _ = run
    members = sorted(t for t, g in expected.group.items() if g == "group-0")
    figures = group_payload(client.get("/view/group/group-0?compare=zeros").text)["compare"]
    default, zeros = figures["dose"]
    assert default["credit_set"] == "default" and default["traces_assigned"] == len(members)
    assert zeros["traces_assigned"] == 1 and zeros["credited_tokens"] == 0 and zeros["abs_mass"] == 0.0
    assert zeros["concentration"] is None and 0 < zeros["coverage"] < 1
    assert figures["agreement"]["shared_tokens"] == zeros["assigned_tokens"] > 0


@pytest.mark.parametrize(
    ("query", "status", "name"),
    [
        ("compare=nope", 404, "compare"),
        ("credit=nope&compare=zeros", 404, "credit"),
        ("compare=" + "x" * 201, 422, "compare"),
    ],
)
def test_group_compare_errors_name_the_parameter(client: TestClient, query: str, status: int, name: str) -> None:
    response = client.get(f"/view/group/group-0?{query}")
    assert response.status_code == status
    assert name in json.dumps(response.json()["detail"])
    if status == 404:
        assert response.json()["detail"].startswith(f"{name}: credit set 'nope' does not exist")


def test_group_page_without_compare_has_no_figures(client: TestClient) -> None:
    for url in ("/view/group/group-0", "/view/group/group-0?compare="):
        html = client.get(url).text
        assert group_payload(html)["compare"] is None and 'id="group-compare"' not in html
        assert '<option value="" selected>' in html


def test_strip_budget_bounds_the_page(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = pages_module()
    monkeypatch.setattr(pages, "STRIP_BUDGET", 1)
    data = group_payload(client.get("/view/group/group-0").text)
    assert all(len(s["token_ids"]) <= pages.STRIP_TOKENS[0] for s in data["nodes"])
    assert any(len(s["token_ids"]) == pages.STRIP_TOKENS[0] for s in data["nodes"])


def test_pages_hold_no_inline_code_or_external_resources(client: TestClient) -> None:
    for url in ("/run", "/view/group/group-0"):
        html = client.get(url).text
        assert "content-security-policy" in {k.lower() for k in client.get(url).headers}
        assert not re.search(r"\sstyle\s*=|<style\b|\son[a-z]+\s*=", html, re.I), url
        for attrs in re.findall(r"<script\b([^>]*)>", html):
            assert 'src="/static/' in attrs or 'type="application/json"' in attrs, attrs
    for path in [TEMPLATES / "run.html", TEMPLATES / "group.html", STATIC / "run.js"]:
        text = path.read_text()
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", text) and "cdn" not in text.lower(), path
        for blocked in ("eval(", "new Function", ".innerHTML", 'setAttribute("style"', ".style."):
            assert blocked not in text, (path, blocked)
    assert client.get("/static/run.js").status_code == 200


# --------------------------------------------------------------------------- two credit sets of one trace


def compare_payload(html: str) -> dict[str, Any]:
    return json.loads(
        re.search(r'<script type="application/json" id="compare-data">(.*?)</script>', html, re.S).group(1)
    )


def compact(db: tracedb.Database, trace_id: str, credit: str | None) -> dict[int, list[float] | None]:
    """Each sampled node's compact advantages in one set, read back as a record."""
    record = db.trace(trace_id, credit=credit)
    return {i: n.get("advantages") for i, n in enumerate(record["nodes"]) if sum(n["mask"])}


@pytest.mark.parametrize(("member", "a", "b"), [(0, "default", "zeros"), (1, "some", "default"), (2, "some", "zeros")])
def test_compare_two_credit_sets(client: TestClient, run: Run, member: int, a: str, b: str) -> None:
    _, expected, _ = run
    tid = sorted(t for t, g in expected.group.items() if g == "group-0")[member]
    html = client.get(f"/view/{tid}?credit={a}&compare={b}").text
    data = compare_payload(html)
    assert data["credit"] == f"{a}-{b}" and data["trace_id"] == tid
    with client.app.state.backend.reader() as db:
        want_a, want_b = compact(db, tid, None if a == "default" else a), compact(db, tid, b)
    rows = re.findall(r'<tr data-node-index="(\d+)">(.*?)</tr>', html, re.S)
    assert [int(i) for i, _ in rows] == sorted(want_a)
    assert len(data["nodes"]) == 3 * len(want_a) == html.count('class="strip"')
    diffs = 0
    for k, node in enumerate(sorted(want_a)):
        strip_a, strip_b, strip_d = data["nodes"][3 * k : 3 * k + 3]
        assert [s["side"] for s in (strip_a, strip_b, strip_d)] == ["a", "b", "diff"]
        assert all(s["node_index"] == node for s in (strip_a, strip_b, strip_d))
        mask = strip_a["sampled_mask"]

        def sampled(values: list[float] | None, mask: list[bool] = mask) -> list[float] | None:
            return None if values is None else [v for v, m in zip(values, mask) if m]

        va, vb = want_a[node], want_b[node]
        assert sampled(strip_a["advantages"]) == (None if va is None else pytest.approx(va))
        assert sampled(strip_b["advantages"]) == (None if vb is None else pytest.approx(vb))
        body = dict(rows)[str(node)]
        if va is None or vb is None:
            assert strip_d["advantages"] is None and '<td class="num max-diff">—</td>' in body
            continue
        diffs += 1
        want = [x - y for x, y in zip(va, vb)]
        assert sampled(strip_d["advantages"]) == pytest.approx(want, abs=1e-6)
        largest = float(re.search(r'<td class="num max-diff">([-0-9.e]+)</td>', body).group(1))
        assert largest == pytest.approx(max(abs(d) for d in want), rel=1e-3)
    assert diffs == {0: len(want_a), 1: 1, 2: 0}[member]  # zeros: everywhere; some: one node; some vs zeros: none


def test_compare_errors_and_links(client: TestClient, run: Run) -> None:
    _, expected, _ = run
    tid = next(iter(expected.group))
    assert client.get(f"/view/{tid}?compare=nope").status_code == 404
    assert "nope" in client.get(f"/view/{tid}?compare=nope").json()["detail"]
    assert client.get(f"/view/{tid}?credit=nope&compare=default").status_code == 404
    assert client.get(f"/view/{tid}?compare={'x' * 201}").status_code == 422
    assert client.get("/view/nope?compare=default").status_code == 404
    view = client.get(f"/view/{tid}").text
    # the first other set, in the registry's order (default, zeros, some)
    assert re.search(rf'id="compare-link" href="/view/{tid}\?credit=default&amp;compare=zeros"', view)
    group = client.get(f"/view/group/{expected.group[tid]}").text
    assert f'href="/view/{tid}?credit=default&amp;compare=zeros"' in group
    html = client.get(f"/view/{tid}?compare=zeros").text
    assert not re.search(r"\sstyle\s*=|<style\b|\son[a-z]+\s*=", html, re.I)
    assert '<select id="compare" name="compare" data-submit>' in html


# --------------------------------------------------------------------------- policy mismatch


@pytest.fixture(scope="module")
def recomputed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Expected, dict[str, list[np.ndarray]]]:
    """The run with ``trainer_logprobs`` written back on some traces: every sampled node of
    the step-0 and step-2 traces, one node of each step-1 trace, none elsewhere. Per trace
    the log ratios (trainer - inference) of its tokens holding both, by numpy."""
    tmp = tmp_path_factory.mktemp("recomputed")
    path, expected = build(tmp)
    with tracedb.connect(path) as db:
        ratios = write_trainer_logprobs(db, expected, whole={0.0, 2.0}, first={1.0})
    return path, expected, ratios


def mismatch_reference(ratios: dict[str, list[np.ndarray]], ids: list[str], c: float) -> dict[str, Any]:
    """The figures over every token of ``ids`` holding both streams, by numpy."""
    held = [t for t in ids if t in ratios]
    if not held:
        return {"mismatch_traces": 0, "mismatch_tokens": 0, "k3_mean": None, "outside_share": None}
    d = np.concatenate([x for t in held for x in ratios[t]])
    r = np.exp(d)
    return {
        "mismatch_traces": len(held),
        "mismatch_tokens": len(d),
        "k3_mean": float(np.mean(r - 1 - d)),
        "ratio_mean": float(np.mean(r)),
        "ratio_max": float(np.max(r)),
        "outside_share": float(np.mean((r < 1 / c) | (r > c))),
    }


def assert_mismatch(row: dict[str, Any], want: dict[str, Any], key: Any) -> None:
    assert row["mismatch_traces"] == want["mismatch_traces"] and row["mismatch_tokens"] == want["mismatch_tokens"], key
    for name in ("k3_mean", "ratio_mean", "ratio_max", "outside_share"):
        if want.get(name) is None:
            assert row[name] is None, (key, name)
        else:
            assert row[name] == pytest.approx(want[name], rel=1e-9), (key, name)


@pytest.mark.parametrize("c", [2.0, 1.5])
def test_mismatch_per_step_matches_numpy(recomputed, c: float) -> None:
    path, expected, ratios = recomputed
    with TestClient(create_app(path), base_url="http://127.0.0.1") as client:
        data = get_run(client, mismatch_c=c)  # auto: the step tag
        by_seq = get_run(client, by="seq", bins=5, mismatch_c=c)
        with tracedb.connect(path, read_only=True) as db:
            seqs = {r["trace_id"]: r["seq"] for r in db.traces().to_pylist()}
    steps = sorted(set(expected.step.values()))
    assert [b["x"] for b in data["bins"]] == steps
    for row, step in zip(data["bins"], steps, strict=True):
        ids = [t for t, s in expected.step.items() if s == step]
        assert_mismatch(row, mismatch_reference(ratios, ids, c), step)
    assert [b["mismatch_traces"] for b in data["bins"]] == [8, 8, 2, 0]
    assert data["bins"][3]["k3_mean"] is None
    for row in by_seq["bins"]:
        ids = [t for t, s in seqs.items() if row["lo"] <= s <= row["hi"]]
        assert_mismatch(row, mismatch_reference(ratios, ids, c), row["lo"])
    summary = data["mismatch"]
    assert summary["c"] == c
    assert_mismatch(summary, mismatch_reference(ratios, list(seqs), c), "summary")
    assert 0 < summary["outside_share"] < 1 and summary["k3_mean"] > 0
    # the library's per-trace figures agree with the page's
    with tracedb.connect(path, read_only=True) as db:
        per_trace = {r["trace_id"]: r for r in db.policy_mismatch(c=c).to_pylist()}
    for tid in expected.reward:
        want = mismatch_reference(ratios, [tid], c)
        assert per_trace[tid]["tokens"] == want["mismatch_tokens"]
        if want["mismatch_tokens"]:
            assert per_trace[tid]["k3_mean"] == pytest.approx(want["k3_mean"], rel=1e-9)


def test_a_run_without_trainer_logprobs_shows_no_mismatch(client: TestClient) -> None:
    data = get_run(client)
    assert data["mismatch"] == {
        "c": 2.0,
        "mismatch_traces": 0,
        "mismatch_tokens": 0,
        "k3_mean": None,
        "ratio_mean": None,
        "ratio_max": None,
        "outside_share": None,
    }
    assert all(b["mismatch_traces"] == 0 and b["k3_mean"] is None for b in data["bins"])
