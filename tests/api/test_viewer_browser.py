"""The viewer in a real headless browser (Debian's chromium driven by playwright).

CI installs chromium (.ci/run), so these tests fail, never skip, when it is missing.
Checked: pages load without console errors; each node's heat strip has one cell per
token; cells take the right colours for known advantages (diverging scale, null
hatched, unsampled grey) and logprobs; the credit-set and colour switches repaint; with
a tokenizer the cells show decoded text. A screenshot lands in test-artifacts/.
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from playwright.sync_api import Browser, Page, sync_playwright

import tracedb
from tracedb.api import create_app

from support import FIXTURES, REPO
from support.tokenizers import make_tokenizer

ROOT = REPO
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("TRACEDB_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WHITE, POSITIVE, NEGATIVE, LOGPROB = (255, 255, 255), (178, 24, 43), (33, 102, 172), (84, 39, 143)
PROBE = [2.0, -2.0, 0.0, 1.0, -0.5]  # the first sampled tokens of one node; the rest 0.0


def mix(end: tuple[int, int, int], t: float) -> str:
    """The viewer's colour rule (viewer.js `mix`), rounding half up as Math.round does."""
    t = min(1.0, max(0.0, t))
    r, g, b = (math.floor(w + (e - w) * t + 0.5) for w, e in zip(WHITE, end))
    return f"rgb({r}, {g}, {b})"


def advantage_color(value: float, scale: float) -> str:
    return mix(POSITIVE, value / scale) if value >= 0 else mix(NEGATIVE, -value / scale)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A database with the fixtures; the linear trace (no ingested credit) gets known
    advantages on one node in the credit set ``probe``."""
    tmp = tmp_path_factory.mktemp("browser")
    path = tmp / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        trace_id = db.sql(
            "SELECT trace_id FROM traces WHERE source LIKE '%linear.traces.jsonl' ORDER BY line LIMIT 1"
        ).to_pylist()[0]["trace_id"]
        record = db.trace(trace_id)
        node = next(i for i, n in enumerate(record["nodes"]) if sum(n["mask"]) >= len(PROBE))
        values = PROBE + [0.0] * (sum(record["nodes"][node]["mask"]) - len(PROBE))
        db.create_credit_set("probe")
        db.write_nodes([{"trace_id": trace_id, "node_index": node, "values": values}], credit="probe")
        fork = db.sql(
            "SELECT trace_id FROM traces WHERE n_branches > 1 AND n_sampled > 0 "
            "AND trace_id IN (SELECT trace_id FROM nodes WHERE advantages IS NOT NULL) ORDER BY 1 LIMIT 1"
        ).to_pylist()[0]["trace_id"]
        paths = db.sql("SELECT path FROM branches WHERE trace_id = ? ORDER BY branch_index", [fork]).to_pylist()
    ids = [t for n in record["nodes"] for t in n["token_ids"]]
    return {
        "path": path,
        "trace_id": trace_id,
        "record": record,
        "node": node,
        "values": values,
        "fork": fork,
        "fork_paths": [p["path"] for p in paths],
        "tokenizer": make_tokenizer(tmp / "tokenizer.json", ids),
    }


def serve(app: Any) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=20)
    app.state.backend.close()


@pytest.fixture(scope="module")
def base(data: dict[str, Any]) -> Iterator[str]:
    yield from serve(create_app(data["path"]))


@pytest.fixture(scope="module")
def decoded_base(data: dict[str, Any]) -> Iterator[str]:
    yield from serve(create_app(data["path"], tokenizer=data["tokenizer"]))


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"no chromium at {CHROMIUM}: apt-get install chromium (.ci/run does)"
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Browser, tmp_path: Path) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.problems = []  # type: ignore[attr-defined]
    page.on("console", lambda m: m.type in ("error", "warning") and page.problems.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: page.problems.append(f"pageerror: {e}"))
    page.on("requestfailed", lambda r: page.problems.append(f"request failed: {r.url}"))
    yield page
    context.close()


def cells(page: Page, node: int) -> list[dict[str, Any]]:
    return page.eval_on_selector_all(
        f'.strip[data-node="{node}"] .t',
        "els => els.map(e => ({cls: e.className, bg: getComputedStyle(e).backgroundColor, text: e.textContent}))",
    )


def test_index_page_loads_clean(page: Page, base: str) -> None:
    page.goto(base + "/")
    assert page.locator("#traces tbody tr").count() == 44
    page.click("#sort-reward")
    page.wait_for_url("**sort=reward**")
    rewards = [r for r in page.locator("td.reward").all_inner_texts() if r != "—"]
    assert [float(r) for r in rewards] == sorted(float(r) for r in rewards)
    assert page.problems == []


def test_heat_strips_colours_and_switches(page: Page, base: str, data: dict[str, Any]) -> None:
    record, node = data["record"], data["node"]
    page.goto(f"{base}/view/{data['trace_id']}")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    # one cell per token; the linear trace holds no credit: sampled cells null, others off
    for i, rec in enumerate(record["nodes"]):
        got = cells(page, i)
        assert len(got) == len(rec["token_ids"]), i
        for cell, sampled in zip(got, rec["mask"]):
            assert ("null" if sampled else "off") in cell["cls"].split()
    null_cell = page.locator(f'.strip[data-node="{node}"] .t.null').first
    assert "repeating-linear-gradient" in null_cell.evaluate("e => getComputedStyle(e).backgroundImage")

    page.select_option("#credit", "probe")
    page.wait_for_selector('body[data-painted="advantage:probe"]')
    assert "credit=probe" in page.url
    scale = max(abs(v) for v in data["values"])
    sampled = [cell for cell, m in zip(cells(page, node), record["nodes"][node]["mask"]) if m]
    for cell, value in zip(sampled, data["values"]):
        assert "null" not in cell["cls"] and cell["bg"] == advantage_color(value, scale), (value, cell)
    assert sampled[0]["bg"] == "rgb(178, 24, 43)" and sampled[1]["bg"] == "rgb(33, 102, 172)"
    assert sampled[2]["bg"] == "rgb(255, 255, 255)"  # zero credit: white, not the null hatch
    for i, rec in enumerate(record["nodes"]):
        if i != node:
            assert all("null" in c["cls"] for c, m in zip(cells(page, i), rec["mask"]) if m)
    assert page.locator("#branch-table .credit-status").first.inner_text() in ("partial", "full")

    page.select_option("#color", "logprob")
    page.wait_for_selector('body[data-painted="logprob:probe"]')
    lp_scale = max(-v for n in record["nodes"] for v in (n.get("logprobs") or [])) or 1.0
    lps = record["nodes"][node]["logprobs"]
    sampled = [cell for cell, m in zip(cells(page, node), record["nodes"][node]["mask"]) if m]
    for cell, lp in zip(sampled, lps):
        assert cell["bg"] == mix(LOGPROB, -lp / lp_scale), (lp, cell)

    page.select_option("#color", "advantage")
    page.select_option("#credit", "default")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    assert all("null" in c["cls"] for c, m in zip(cells(page, node), record["nodes"][node]["mask"]) if m)
    assert page.problems == []


def test_branch_filter_and_screenshot(page: Page, base: str, data: dict[str, Any]) -> None:
    fork, paths = data["fork"], data["fork_paths"]
    page.goto(f"{base}/view/{fork}")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    shared = page.locator("article.node.shared")
    assert shared.count() == len(set(paths[0]) & set(paths[1])) > 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "viewer.png"), full_page=False)
    page.select_option("#branch", "1")
    visible = page.locator("article.node:visible").count()
    assert visible == len(paths[1])
    assert page.problems == []


def test_decoded_tokens(page: Page, decoded_base: str, data: dict[str, Any]) -> None:
    record = data["record"]
    page.goto(f"{decoded_base}/view/{data['trace_id']}?credit=probe")
    page.wait_for_selector('body[data-painted="advantage:probe"]')
    for i, rec in enumerate(record["nodes"]):
        assert [c["text"] for c in cells(page, i)] == [f"w{t}" for t in rec["token_ids"]]
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator(f"#node-{data['node']}").screenshot(path=str(ARTIFACTS / "viewer-decoded.png"))
    assert page.problems == []
