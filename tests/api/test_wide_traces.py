"""Every route costs linearly in a trace's branches, and a viewer page stays small.

A valid trace of 4,000 branches (a 0.7 MB line: a prompt with 4,000 sampled answers)
used to take the viewer quadratically: ``/view/{id}`` drew one lane per node and branch
(2,000 branches: 12 s and 183 MB of HTML; 4,000: no answer in 40 s, 2.1 GB), and
``GET /branches`` had only a token budget, which branches without tokens pass. Here each
route is asked about a trace of 400 branches and one of 4,000, a few times in turn, and
the medians compared: 10x the branches may cost at most ``RATIO`` x the time and the bytes
(linear, with room for a shared machine), and every HTML page is under ``HTML_CAP``.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import tracedb
from tracedb.api import create_app, tracepage

from support.tokenizers import make_tokenizer
from support.wide import wide_episode, write_wide

SMALL, LARGE = 400, 4000
RATIO = 15.0
"""The most 10x the branches may cost, in time and in bytes (linear is 10; quadratic, 100)."""
HTML_CAP = 5_000_000
"""Bytes of HTML a viewer page holds at most, whatever the trace."""
RUNS = 5
FLOOR_S = 0.01
"""Times below this are taken as this (a ratio of two tiny times is noise)."""
TOKEN = "wide-token"


@pytest.fixture(scope="module")
def app_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """For each size: ``empty-N`` (a root with N leaves and no tokens at all, group
    ``g-empty-N``) and ``tokens-N`` (N leaves of six tokens under a chain of four shared
    turns, every sampled token credited, group ``g-tokens-N``); a credit set ``probe``."""
    tmp = tmp_path_factory.mktemp("wide")
    episodes = []
    for n in (SMALL, LARGE):
        episodes.append(wide_episode(n, name=f"empty-{n}", group=f"g-empty-{n}"))
        episodes.append(
            wide_episode(n, name=f"tokens-{n}", group=f"g-tokens-{n}", forks=4, leaf_tokens=6, advantage=0.5)
        )
    path = tmp / "wide.duckdb"
    with tracedb.connect(path) as db:
        report = db.ingest(write_wide(tmp / "wide.jsonl", *episodes))
        assert report.traces == 4 and not report.rejected
        db.create_credit_set("probe")
    return path


@pytest.fixture(scope="module")
def client(app_db: Path) -> TestClient:
    # No view cache and a plan per run (pad_token_id={run}): every answer is built, never a cache hit.
    with TestClient(create_app(app_db, token=TOKEN, view_cache_tokens=0), base_url="http://127.0.0.1") as c:
        yield c


# Each route, with {t} the trace, {g} its group, {leaf} its first leaf and {run} the run;
# "json", "arrow" or "html" says what it answers.
ROUTES = [
    ("GET", "/traces/{t}", "json"),
    ("GET", "/traces/{t}?tokens=true&messages=true", "json"),
    ("GET", "/traces/{t}/record", "json"),
    ("GET", "/traces/{t}/branches", "json"),
    ("GET", "/traces/{t}/branches?after=0", "json"),
    ("GET", "/traces/{t}/branches/7", "json"),
    ("GET", "/branches?trace_id={t}", "json"),
    ("GET", "/branches?trace_id={t}&format=arrow", "arrow"),
    ("GET", "/branches?group={g}&after=0", "json"),
    ("GET", "/groups/{g}", "json"),
    ("GET", "/traces?trace_id={t}", "json"),
    ("GET", "/traces?trace_id={t}&after=0", "json"),
    ("GET", "/micro-batches?trace_id={t}&seq_len=4096&rank=0&pad_token_id={run}", "arrow"),
    (
        "GET",
        "/micro-batches?trace_id={t}&seq_len=4096&rank=0&part=samples&all_branches=true&pad_token_id={run}",
        "arrow",
    ),  # noqa: E501
    ("GET", "/stats", "json"),
    ("GET", "/api/run", "json"),
    ("GET", "/view/{t}", "html"),
    ("GET", "/view/{t}?branch_limit=100&branches_from=300", "html"),
    ("GET", "/view/{t}?branch=399&color=logprob", "html"),
    ("GET", "/view/{t}?compare=probe", "html"),
    ("GET", "/view/group/{g}", "html"),
    ("GET", "/view/group/{g}?compare=probe", "html"),
    ("GET", "/?group={g}", "html"),
    ("PUT", "/traces/{t}/nodes/{leaf}/advantages?credit=probe", "json"),
]


def ask(client: TestClient, method: str, route: str, trace: str, run: int) -> tuple[float, Any]:
    leaf = 3 if trace.startswith("empty") else 6  # the first leaf, after the prompts and the chain
    url = route.format(t=trace, g=f"g-{trace}", leaf=leaf, run=run)
    began = time.perf_counter()
    if method == "PUT":
        values = None if trace.startswith("empty") else [0.25] * 3  # a leaf of six tokens holds three sampled
        response = client.put(url, json={"values": values}, headers={"Authorization": f"Bearer {TOKEN}"})
    else:
        response = client.get(url)
    return time.perf_counter() - began, response


def measure(client: TestClient, method: str, route: str, kind: str, shape: str) -> dict[int, tuple[float, int]]:
    """Per size, the median time and the bytes of the answer; the sizes are asked in turn
    (after one round unmeasured), so a change in the machine's load falls on both."""
    times: dict[int, list[float]] = {SMALL: [], LARGE: []}
    sizes: dict[int, int] = {}
    for run in range(RUNS + 1):
        for n in (SMALL, LARGE):
            took, response = ask(client, method, route, f"{shape}-{n}", run)
            assert response.status_code == 200, (route, shape, n, response.text[:500])
            if kind == "html":
                assert len(response.content) < HTML_CAP, (route, shape, n, len(response.content))
            if run:
                times[n].append(took)
            sizes[n] = len(response.content)
    return {n: (statistics.median(times[n]), sizes[n]) for n in (SMALL, LARGE)}


@pytest.mark.parametrize("shape", ["empty", "tokens"])
@pytest.mark.parametrize(("method", "route", "kind"), ROUTES, ids=[f"{m} {r}" for m, r, _ in ROUTES])
def test_ten_times_the_branches_cost_at_most_fifteen_times(
    client: TestClient, method: str, route: str, kind: str, shape: str
) -> None:
    got = measure(client, method, route, kind, shape)
    (t_small, b_small), (t_large, b_large) = got[SMALL], got[LARGE]
    ratio = t_large / max(t_small, FLOOR_S)
    print(
        f"{method} {route} [{shape}]: {t_small * 1000:.1f} ms -> {t_large * 1000:.1f} ms ({ratio:.1f}x), "
        f"{b_small} -> {b_large} bytes"
    )
    assert ratio <= RATIO, f"{route}: {t_small:.3f} s for {SMALL} branches, {t_large:.3f} s for {LARGE}"
    assert b_large <= RATIO * b_small, f"{route}: {b_small} bytes for {SMALL} branches, {b_large} for {LARGE}"


def test_ingesting_ten_times_the_branches_costs_at_most_fifteen_times(client: TestClient) -> None:
    """``POST /ingest`` of a new trace of each size, in turn (a trace id once each)."""
    times: dict[int, list[float]] = {SMALL: [], LARGE: []}
    sizes: dict[int, int] = {}
    for run in range(RUNS + 1):
        for n in (SMALL, LARGE):
            body = json.dumps(wide_episode(n, name=f"posted-{n}-{run}", leaf_tokens=6, advantage=1.0)) + "\n"
            began = time.perf_counter()
            r = client.post("/ingest", content=body.encode(), headers={"Authorization": f"Bearer {TOKEN}"})
            took = time.perf_counter() - began
            assert r.status_code == 200 and r.json()["traces"] == 1, r.text[:500]
            if run:
                times[n].append(took)
            sizes[n] = len(body)
    t_small, t_large = statistics.median(times[SMALL]), statistics.median(times[LARGE])
    ratio = t_large / max(t_small, FLOOR_S)
    print(f"POST /ingest: {t_small * 1000:.1f} ms -> {t_large * 1000:.1f} ms ({ratio:.1f}x), {sizes} bytes")
    assert ratio <= RATIO, f"POST /ingest: {t_small:.3f} s for {SMALL} branches, {t_large:.3f} s for {LARGE}"


# --------------------------------------------------------------------------- paging the trace page


def branch_rows(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-branch="(\d+)">', html)]


def node_articles(html: str) -> list[tuple[int, list[int]]]:
    found = re.findall(r'id="node-(\d+)"\s+data-node="\d+" data-branches="([^"]*)"', html)
    return [(int(i), [int(b) for b in on.split(",") if b]) for i, on in found]


def link(html: str, name: str) -> str | None:
    match = re.search(rf'id="{name}" href="([^"]+)"', html)
    return None if match is None else match.group(1).replace("&amp;", "&")


def test_the_default_page_shows_the_first_branches_and_says_how_many(client: TestClient) -> None:
    html = client.get(f"/view/empty-{LARGE}").text
    assert branch_rows(html) == list(range(tracepage.BRANCHES))
    assert f"branches 0–{tracepage.BRANCHES - 1} of {LARGE}" in html and f"{LARGE} branches" in html
    assert link(html, "previous-branches") is None
    assert (
        link(html, "next-branches")
        == f"/view/empty-{LARGE}?credit=default&color=advantage&branch_limit=50&branches_from=50"
    )
    articles = dict(node_articles(html))
    assert sorted(articles) == [0, 1, 2, *range(3, 3 + tracepage.BRANCHES)]  # prompts, the shared turn, leaves
    assert articles[0] == list(range(tracepage.BRANCHES))  # the page's branches only ...
    assert f"shared by {LARGE} branches ({tracepage.BRANCHES} on this page)" in html  # ... and how many in all
    assert html.count('class="lane on') == 4 * tracepage.BRANCHES  # the three shared nodes on each, each leaf on one
    assert '<td class="mono small">0 → 1 → 2 → 3</td>' in html
    data = json.loads(re.search(r'id="trace-data">(.*?)</script>', html, re.S).group(1))
    assert [n["node_index"] for n in data["nodes"]] == sorted(articles) == [n["strip"] for n in data["nodes"]]
    assert (data["branches_from"], data["branch_limit"]) == (0, tracepage.BRANCHES)


def test_next_links_walk_every_branch_once(client: TestClient) -> None:
    url: str | None = f"/view/tokens-{LARGE}?branch_limit={tracepage.MAX_BRANCHES}"
    seen: list[int] = []
    pages = 0
    while url is not None:
        html = client.get(url).text
        assert len(html.encode()) < HTML_CAP
        rows = branch_rows(html)
        assert len(rows) == tracepage.MAX_BRANCHES
        seen += rows
        back = link(html, "previous-branches")
        assert (back is None) == (pages == 0)
        url = link(html, "next-branches")
        pages += 1
    assert seen == list(range(LARGE)) and pages == LARGE // tracepage.MAX_BRANCHES


def test_a_link_to_one_branch_opens_its_page(client: TestClient) -> None:
    html = client.get(f"/view/tokens-{LARGE}?branch=1234").text
    assert branch_rows(html) == list(range(1200, 1250))
    assert '<option value="1234">branch 1234</option>' in html


def test_pages_past_the_end_and_bad_windows_are_refused(client: TestClient) -> None:
    assert client.get(f"/view/empty-{SMALL}?branches_from={SMALL}").status_code == 404
    assert client.get(f"/view/empty-{SMALL}?nodes_from=10000").status_code == 404
    assert client.get(f"/view/tokens-{SMALL}?compare=probe&nodes_from=10000").status_code == 404
    for bad in ("branch_limit=0", f"branch_limit={tracepage.MAX_BRANCHES + 1}", "branches_from=-1", "branch=x"):
        assert client.get(f"/view/empty-{SMALL}?{bad}").status_code == 422, bad


def test_the_compare_page_pages_through_sampled_nodes(client: TestClient) -> None:
    url: str | None = f"/view/tokens-{SMALL}?compare=probe"
    seen: list[int] = []
    while url is not None:
        html = client.get(url).text
        seen += [int(i) for i in re.findall(r'<tr data-node-index="(\d+)">', html)]
        url = link(html, "next-nodes")
    chain = [2, 4]  # the chain's sampled turns (assistant turns 0 and 2)
    assert seen == [*chain, *range(6, 6 + SMALL)]


def test_the_group_page_shows_the_first_branches_of_each_member(client: TestClient) -> None:
    html = client.get(f"/view/group/g-tokens-{LARGE}").text
    assert html.count('class="branch-strip"') == 400  # GROUP_STRIPS over one member
    assert f"{LARGE - 400} more branches" in html and "branches_from=400" in html


def test_the_trace_json_answers_only_the_nodes_asked_for(client: TestClient) -> None:
    body = client.get(f"/traces/tokens-{SMALL}?tokens=true&node=9&node=2&node=100000").json()
    assert [n["node_index"] for n in body["nodes"]] == [2, 9]
    assert len(body["nodes"][0]["tokens"]["token_ids"]) == 6


# --------------------------------------------------------------------------- fat traces: the budgets


@pytest.fixture(scope="module")
def fat(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A deep trace of big nodes: 1,200 chain turns of 300 tokens and 3,000 characters that
    escape (``<&"``) under two prompts, with 3 leaves, served with a tokenizer."""
    tmp = tmp_path_factory.mktemp("fat")
    episode = wide_episode(
        3, name="fat", group="g-fat", forks=1200, leaf_tokens=300, prompt_tokens=300, advantage=-1.5, text='<&"' * 1000
    )
    path = tmp / "fat.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(write_wide(tmp / "fat.jsonl", episode)).traces == 1
        db.create_credit_set("probe")
    ids = sorted({t for n in episode["traces"][0]["nodes"] for t in n["token_ids"]})
    return {"path": path, "tokenizer": make_tokenizer(tmp / "tokenizer.json", ids), "nodes": 1200 + 2 + 3}


def test_fat_pages_stay_under_the_cap_and_say_what_they_leave_out(fat: dict[str, Any]) -> None:
    app = create_app(fat["path"], tokenizer=fat["tokenizer"])
    with TestClient(app, base_url="http://127.0.0.1") as c:
        html = c.get("/view/fat").text
        assert len(html.encode()) < HTML_CAP
        assert "nodes 1–200 of the 1205 on these branches" in html and link(html, "next-nodes")
        data = json.loads(re.search(r'id="trace-data">(.*?)</script>', html, re.S).group(1))
        assert sum(len(n["token_ids"]) for n in data["nodes"]) == tracepage.TOKENS  # the page's token budget
        assert all(len(n["pieces"]) == len(n["token_ids"]) for n in data["nodes"])
        assert "tokens not drawn" in html and "strip: tokens 0–200 of 300" in html
        assert "more characters (the" in html
        assert re.search(r"0 → 1 → 2 → 3 → 4 → 5 → … 11\d\d more … → \d+ → ", html)  # a deep path by its ends
        seen, url = [], "/view/fat"
        while url is not None:
            page = c.get(url).text
            assert len(page.encode()) < HTML_CAP
            seen += [i for i, _ in node_articles(page)]
            url = link(page, "next-nodes")
        assert seen == list(range(fat["nodes"]))
        for url in ("/view/fat?compare=probe", "/view/group/g-fat", "/view/group/g-fat?compare=probe"):
            page = c.get(url)
            assert page.status_code == 200 and len(page.content) < HTML_CAP, (url, len(page.content))


def test_shares_fill_the_budget_from_the_smallest() -> None:
    assert tracepage.shares([], 10) == []
    assert tracepage.shares([3, 4], 10) == [3, 4]  # both fit whole
    assert tracepage.shares([100, 1, 100], 21) == [10, 1, 10]
    assert tracepage.shares([5, 50, 7], 20) == [5, 8, 7]
    assert sum(tracepage.shares([300] * 1205, 40_000)) <= 40_000


# --------------------------------------------------------------------------- GET /branches: a row budget


def test_branches_without_tokens_stop_at_the_row_limit(app_db: Path) -> None:
    with TestClient(create_app(app_db, token=TOKEN, branch_row_limit=LARGE), base_url="http://127.0.0.1") as c:
        ids = {"trace_id": [f"empty-{SMALL}", f"empty-{LARGE}"]}
        r = c.get("/branches", params=ids)
        body = r.json()
        assert r.status_code == 200 and r.headers["x-tracedb-truncated"] == "branches"
        assert body["truncated_by"] == "branches" and body["n_branches"] == SMALL == len(body["branches"])
        assert body["tokens"] == 0 and f"branch row limit ({LARGE} branches)" in body["truncated_why"]
        assert (r.headers["x-tracedb-branches"], r.headers["x-tracedb-branch-limit"]) == (str(SMALL), str(LARGE))
        rest = c.get("/branches", params={**ids, "after": body["watermark"]}).json()
        assert rest["n_branches"] == LARGE and not rest["truncated"] and rest["truncated_by"] is None
        assert {b["trace_id"] for b in rest["branches"]} == {f"empty-{LARGE}"}
    with TestClient(create_app(app_db, token=TOKEN, branch_row_limit=SMALL - 1), base_url="http://127.0.0.1") as c:
        r = c.get("/branches", params={"trace_id": f"empty-{SMALL}"})
        assert r.status_code == 422
        assert f"has {SMALL} branches, over this server's branch row limit ({SMALL - 1})" in r.json()["detail"]
        assert "--branch-row-limit" in r.json()["detail"]
        narrowed = c.get("/branches", params={"trace_id": f"empty-{SMALL}", "branch_index": [0, 1]})
        assert narrowed.status_code == 200 and narrowed.json()["n_branches"] == 2


def test_a_traces_branch_list_pages_at_the_row_limit(app_db: Path) -> None:
    with TestClient(create_app(app_db, token=TOKEN, branch_row_limit=1500), base_url="http://127.0.0.1") as c:
        seen: list[int] = []
        start: int | None = 0
        while start is not None:
            body = c.get(f"/traces/empty-{LARGE}/branches", params={"branches_from": start}).json()
            assert body["n_branches"] == LARGE and body["limit"] == 1500 and len(body["branches"]) <= 1500
            seen += [b["branch_index"] for b in body["branches"]]
            start = body["next_from"]
        assert seen == list(range(LARGE))
        small = c.get(f"/traces/empty-{LARGE}/branches", params={"branches_from": 3998, "limit": 10}).json()
        assert [b["branch_index"] for b in small["branches"]] == [3998, 3999] and small["next_from"] is None
        assert c.get(f"/traces/empty-{LARGE}/branches", params={"limit": 0}).status_code == 422
