"""The web viewer's pages, in process: what the server renders and embeds (the browser
test checks what a person sees)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import tracedb
from tracedb.api import create_app

from support import FIXTURES, REPO
from support.tokenizers import make_tokenizer

STATIC = REPO / "api"


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("viewer") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        db.create_credit_set("probe")
    return path


@pytest.fixture(scope="module")
def client(db_path: Path) -> TestClient:
    with TestClient(create_app(db_path), base_url="http://127.0.0.1") as c:
        yield c


def payload(html: str) -> dict[str, Any]:
    match = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', html, re.S)
    assert match
    return json.loads(match.group(1))


def fork_trace(client: TestClient) -> str:
    """A trace whose branches share nodes."""
    with client.app.state.backend.reader() as db:
        return db.sql(
            "SELECT trace_id FROM traces WHERE n_branches > 1 AND n_sampled > 0 ORDER BY trace_id LIMIT 1"
        ).to_pylist()[0]["trace_id"]


def test_index_lists_traces_with_links(client: TestClient) -> None:
    html = client.get("/").text
    with client.app.state.backend.reader() as db:
        ids = [r[0] for r in db.con.execute("SELECT trace_id FROM traces ORDER BY 1").fetchall()]
    for trace_id in ids:
        assert f'href="/view/{trace_id}"' in html
    assert "44 in the database" in html


def test_index_filters_and_empty_form_fields(client: TestClient) -> None:
    html = client.get("/?group=group-1&episode=&ok=&min_reward=0.5&max_reward=&stop_condition=&sort=reward").text
    rows = re.findall(r'href="/view/([0-9a-f]+)"', html)
    with client.app.state.backend.reader() as db:
        want = (
            db.sql("SELECT trace_id FROM traces WHERE group_id = 'group-1' AND reward >= 0.5 ORDER BY reward, trace_id")
            .column("trace_id")
            .to_pylist()
        )
    assert rows == want and rows


def test_index_sorts_by_reward_and_pages(client: TestClient) -> None:
    html = client.get("/?sort=-reward&limit=10").text
    rewards = [float(x) for x in re.findall(r'<td class="num reward">([-0-9.e]+)</td>', html)]
    assert rewards == sorted(rewards, reverse=True) and len(rewards) == 10
    next_link = re.search(r'id="next" href="([^"]+)"', html).group(1).replace("&amp;", "&")
    second = client.get(next_link).text
    assert set(re.findall(r'href="/view/([0-9a-f]+)"', second)).isdisjoint(
        re.findall(r'href="/view/([0-9a-f]+)"', html)
    )


@pytest.mark.parametrize("query", ["ok=maybe", "min_reward=abc", "max_reward=inf", "sort=size", "cursor=!!"])
def test_index_bad_filters_are_422(client: TestClient, query: str) -> None:
    response = client.get(f"/?{query}")
    assert response.status_code == 422 and response.json()["detail"]


def test_view_shows_every_message_and_marks_shared_nodes(client: TestClient) -> None:
    trace_id = fork_trace(client)
    html = client.get(f"/view/{trace_id}").text
    with client.app.state.backend.reader() as db:
        record = db.trace(trace_id)
        branches = db.sql(
            "SELECT branch_index, path FROM branches WHERE trace_id = ? ORDER BY 1", [trace_id]
        ).to_pylist()
    on = {i: [b["branch_index"] for b in branches if i in b["path"]] for i in range(len(record["nodes"]))}
    for i, node in enumerate(record["nodes"]):
        article = re.search(rf'<article class="([^"]+)" id="node-{i}"\s+data-node="{i}" data-branches="([^"]*)"', html)
        assert article, i
        assert ("shared" in article.group(1).split()) == (len(on[i]) > 1)
        assert article.group(2) == ",".join(map(str, on[i]))
        content = node["message"].get("content")
        if isinstance(content, str) and content:
            assert content.replace("&", "&amp;").replace("<", "&lt;") in html
    assert html.count('class="strip"') == len(record["nodes"])
    assert any(len(v) > 1 for v in on.values())


def test_view_embeds_each_nodes_tokens_and_streams(client: TestClient) -> None:
    trace_id = fork_trace(client)
    data = payload(client.get(f"/view/{trace_id}").text)
    with client.app.state.backend.reader() as db:
        record = db.trace(trace_id)
    assert data["trace_id"] == trace_id and data["credit"] == "default" and data["color"] == "advantage"
    for node, rec in zip(data["nodes"], record["nodes"], strict=True):
        assert node["token_ids"] == rec["token_ids"] and node["sampled_mask"] == rec["mask"]
        assert (node["advantages"] is None) == (rec.get("advantages") is None)
        assert len(node["logprobs"]) == len(rec["token_ids"]) and "pieces" not in node
    unassigned = payload(client.get(f"/view/{trace_id}?credit=probe&color=logprob").text)
    assert unassigned["credit"] == "probe" and unassigned["color"] == "logprob"
    assert all(n["advantages"] is None for n in unassigned["nodes"])


def test_view_errors(client: TestClient) -> None:
    assert client.get("/view/nope").status_code == 404
    trace_id = fork_trace(client)
    assert client.get(f"/view/{trace_id}?credit=nope").status_code == 404
    assert client.get(f"/view/{trace_id}?color=rainbow").status_code == 422


def test_embedded_json_cannot_close_its_script_tag(tmp_path: Path) -> None:
    record = json.loads((FIXTURES / "linear.traces.jsonl").read_text().splitlines()[0])
    record["traces"][0]["nodes"][0]["message"]["content"] = "</script><script>alert(1)</script>"
    (tmp_path / "t.jsonl").write_text(json.dumps(record) + "\n")
    with tracedb.connect(tmp_path / "x.duckdb") as db:
        db.ingest(tmp_path / "t.jsonl")
    with TestClient(create_app(tmp_path / "x.duckdb"), base_url="http://127.0.0.1") as c:
        html = c.get(f"/view/{record['traces'][0]['id']}").text
    assert "<script>alert(1)" not in html and "&lt;/script&gt;&lt;script&gt;alert(1)" in html


def test_static_files_and_no_external_resources(client: TestClient) -> None:
    assert "paint" in client.get("/static/viewer.js").text
    assert ".strip" in client.get("/static/viewer.css").text
    for path in [*STATIC.glob("templates/*.html"), *STATIC.glob("static/*")]:
        assert not re.search(r"(src|href)=[\"']?(https?:)?//", path.read_text()), path
        assert "cdn" not in path.read_text().lower(), path


def test_tokenizer_pieces(client: TestClient, db_path: Path, tmp_path: Path) -> None:
    trace_id = fork_trace(client)
    with client.app.state.backend.reader() as db:
        record = db.trace(trace_id)
    ids = [t for n in record["nodes"] for t in n["token_ids"]]
    known = ids[: len(ids) // 2]  # the rest are unknown to this tokenizer
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json", known)
    with TestClient(create_app(db_path, tokenizer=tokenizer), base_url="http://127.0.0.1") as c:
        html = c.get(f"/view/{trace_id}").text
    assert 'class="graph decoded"' in html
    for node in payload(html)["nodes"]:
        want = [f"w{t}" if t in set(known) and t else f"<{t}>" for t in node["token_ids"]]
        assert node["pieces"] == want


def test_missing_tokenizer_file_is_refused(db_path: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        create_app(db_path, tokenizer=tmp_path / "missing.json")
