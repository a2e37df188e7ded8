"""The viewer in a real headless browser (Debian's chromium driven by playwright).

CI installs chromium (.ci/run), so these tests fail, never skip, when it is missing.
Checked: pages load without console errors; each node's heat strip has one cell per
token; cells take the right colours for known advantages (diverging scale, null
hatched, unsampled grey) and logprobs; the credit-set and colour switches repaint; with
a tokenizer the cells show decoded text. The run page draws what /api/run answers and
redraws when a new ingest moves the watermark (only then); the group page paints each
member's branch strips, switches colour and credit set, and links to a branch's view; a
trace of many branches pages through them (next/previous links, the credit set kept).
Screenshots land in test-artifacts/.
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

import httpx
import pytest
import uvicorn
from playwright.sync_api import Browser, Page, sync_playwright

import tracedb
from tracedb.api import create_app

from support import FIXTURES, REPO
from support.run_db import build as build_run
from support.run_db import write_late, write_trainer_logprobs
from support.tokenizers import make_tokenizer
from support.wide import wide_episode, write_wide

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
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "index.png"), full_page=False)
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
    assert page.locator("#branch-table .credit-status").first.inner_text() in ("partial", "assigned", "zero")

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


# --------------------------------------------------------------------------- the run page and the group page


@pytest.fixture(scope="module")
def run_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The small run of tests/support/run_db.py behind a server that can write (the test
    moves the run on through its writer, as a follower inside the server does)."""
    tmp = tmp_path_factory.mktemp("run-browser")
    path, expected = build_run(tmp)
    top = max((t for t, g in expected.group.items() if g == "group-0"), key=lambda t: (expected.reward[t], t))
    with tracedb.connect(path) as db:  # credit set "zeros": zero on every sampled node of one member
        nodes = db.sql(
            "SELECT node_index, n_sampled FROM nodes WHERE trace_id = ? AND n_sampled > 0", [top]
        ).to_pylist()
        db.create_credit_set("zeros")
        zeros = [{"trace_id": top, "node_index": n["node_index"], "values": [0.0] * n["n_sampled"]} for n in nodes]
        db.write_nodes(zeros, credit="zeros")
        write_trainer_logprobs(db, expected, whole={0.0, 2.0}, first={1.0})  # a mismatch to plot, not everywhere
    app = create_app(path, token="browser-test")
    for url in serve(app):
        yield {"base": url, "app": app, "expected": expected, "tmp": tmp, "zeroed": top}


def drawn(page: Page, svg: str, selector: str, attrs: tuple[str, ...]) -> list[dict[str, Any]]:
    return page.eval_on_selector_all(
        f"#{svg} {selector}",
        f"els => els.map(e => Object.fromEntries({list(attrs)!r}.map(a => [a, e.getAttribute(a)])))",
    )


def assert_drawn(page: Page, answer: dict[str, Any]) -> None:
    """What the plots show is what /api/run answered."""
    bins = answer["bins"]
    points = drawn(page, "plot-reward", "circle.pt", ("data-x", "data-y", "cx", "cy"))
    scored = [b for b in bins if b["mean"] is not None]
    assert [float(p["data-y"]) for p in points] == pytest.approx([b["mean"] for b in scored])
    assert [float(p["data-x"]) for p in points] == [b["x"] for b in scored]
    xs = [float(p["cx"]) for p in points]
    assert xs == sorted(xs) and all(56 <= x <= 546 for x in xs)  # inside the plot area, left to right
    assert page.locator("#plot-reward polygon.band").count() == 1
    line = page.locator("#plot-reward path.line").get_attribute("d")  # a bin without a reward breaks it
    assert line.count("M") + line.count("L") == len(scored)
    starts = [b["mean"] is not None and (i == 0 or bins[i - 1]["mean"] is None) for i, b in enumerate(bins)]
    assert line.count("M") == sum(starts)
    bars = drawn(page, "plot-hist", "rect.bar", ("data-count", "height"))
    assert [int(b["data-count"]) for b in bars] == [b["count"] for b in answer["histogram"]["bins"]]
    tallest = max(range(len(bars)), key=lambda i: int(bars[i]["data-count"]))
    assert float(bars[tallest]["height"]) == max(float(b["height"]) for b in bars) > 0
    zero = drawn(page, "plot-zero", "circle.pt", ("data-y",))
    shares = [b["zero_variance_share"] for b in bins if b["zero_variance_share"] is not None]
    assert [float(p["data-y"]) for p in zero] == pytest.approx(shares)
    for svg, key in (("plot-tokens", "tokens_mean"), ("plot-sampled", "sampled_share"), ("plot-traces", "traces")) + (
        ("plot-dropped", "dropped_share"),
    ):
        values = [float(p["data-y"]) for p in drawn(page, svg, "circle.pt", ("data-y",))]
        assert values == pytest.approx([b[key] for b in bins]), svg
    for svg, key in (("plot-k3", "k3_mean"), ("plot-outside", "outside_share")):
        values = [float(p["data-y"]) for p in drawn(page, svg, "circle.pt", ("data-y",))]
        shown = [b[key] for b in bins if b[key] is not None]
        assert values == pytest.approx(shown) and 0 < len(shown) < len(bins), svg  # bins without: no point
    stat = lambda key: page.locator(f'[data-stat="{key}"]').inner_text()  # noqa: E731
    assert stat("mismatch").endswith("outside)") and answer["mismatch"]["mismatch_tokens"] > 0
    assert stat("traces") == str(answer["summary"]["traces"]) and stat("watermark") == str(answer["watermark"])
    assert stat("groups") == str(answer["summary"]["groups"])
    rows = page.locator("#groups tbody tr")
    assert rows.count() == len(answer["recent_groups"])
    assert rows.first.locator("a").get_attribute("href") == f"/view/group/{answer['recent_groups'][0]['group_id']}"


def test_run_page_draws_and_follows_the_run(page: Page, run_server: dict[str, Any]) -> None:
    base, app = run_server["base"], run_server["app"]
    page.goto(f"{base}/run?by=tag:step&refresh=0.25")
    page.wait_for_selector('body[data-draws="1"]')
    answer = httpx.get(f"{base}/api/run", params={"by": "tag:step"}).json()
    assert_drawn(page, answer)
    assert page.locator("#by").input_value() == "tag:step"
    # polls go on; nothing arrived, so nothing is redrawn
    page.wait_for_function("() => Number(document.body.dataset.polls) >= 4", timeout=10_000)
    assert page.locator("body").get_attribute("data-draws") == "1"

    late, tags = write_late(run_server["tmp"], run_server["expected"])
    with app.state.backend.writer() as db:
        db.ingest(late, tags=tags)
    page.wait_for_selector(f'body[data-watermark="{answer["watermark"] + 4}"]', timeout=10_000)
    assert page.locator("body").get_attribute("data-draws") == "2"
    after = httpx.get(f"{base}/api/run", params={"by": "tag:step"}).json()
    assert len(after["bins"]) == len(answer["bins"]) + 1
    assert_drawn(page, after)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "run.png"), full_page=True)

    page.select_option("#by", "seq")  # another axis: redrawn at once, in the URL
    page.wait_for_selector('body[data-draws="3"]')
    assert "by=seq" in page.url
    assert_drawn(page, httpx.get(f"{base}/api/run", params={"by": "seq"}).json())
    assert page.problems == []


def test_group_page_strips(page: Page, run_server: dict[str, Any]) -> None:
    base, expected = run_server["base"], run_server["expected"]
    page.goto(f"{base}/view/group/group-0")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    data = page.evaluate("JSON.parse(document.getElementById('group-data').textContent)")
    members = page.locator("#members tbody tr").evaluate_all("rows => rows.map(r => r.dataset.trace)")
    assert page.locator("article.member").count() == len(members) == 4
    owner = [m for m in members for _ in range(page.locator(f'article.member[data-trace="{m}"] .strip').count())]
    assert len(owner) == len(data["nodes"])
    scale = max(abs(expected.advantage[m]) for m in members)
    for i, (strip, trace_id) in enumerate(zip(data["nodes"], owner)):
        got = cells(page, i)
        assert len(got) == len(strip["token_ids"]), i
        for cell, sampled in zip(got, strip["sampled_mask"]):
            if not sampled:
                assert "off" in cell["cls"].split()
            elif strip["advantages"] is None:
                assert "null" in cell["cls"].split()
            else:
                assert cell["bg"] == advantage_color(expected.advantage[trace_id], scale), (i, cell)
    assert {advantage_color(0.5, scale), advantage_color(-0.5, scale)} == {"rgb(178, 24, 43)", "rgb(33, 102, 172)"}

    page.select_option("#color", "logprob")
    page.wait_for_selector('body[data-painted="logprob:default"]')
    lp_scale = max(-v for s in data["nodes"] if s["logprobs"] for v, m in zip(s["logprobs"], s["sampled_mask"]) if m)
    strip = next(s for s in data["nodes"] if any(s["sampled_mask"]))
    index = data["nodes"].index(strip)
    sampled = [c for c, m in zip(cells(page, index), strip["sampled_mask"]) if m]
    lps = [v for v, m in zip(strip["logprobs"], strip["sampled_mask"]) if m]
    for cell, lp in zip(sampled, lps):
        assert cell["bg"] == mix(LOGPROB, -lp / lp_scale)
    assert "color=logprob" in page.url
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "group.png"), full_page=False)

    page.select_option("#credit", "zeros")  # another set: the page reloads with its strips and statuses
    page.wait_for_selector('body[data-painted="logprob:zeros"]')
    page.select_option("#color", "advantage")
    page.wait_for_selector('body[data-painted="advantage:zeros"]')
    assert "credit=zeros" in page.url
    zeroed = run_server["zeroed"]
    assert page.locator(f'#members tr[data-trace="{zeroed}"] [data-set="zeros"]').inner_text() == "zero"
    data = page.evaluate("JSON.parse(document.getElementById('group-data').textContent)")
    owner = page.locator("article.member").evaluate_all(
        "arts => arts.flatMap(a => Array.from(a.querySelectorAll('.strip')).map(() => a.dataset.trace))"
    )
    for i, trace_id in enumerate(owner):
        for cell, sampled in zip(cells(page, i), data["nodes"][i]["sampled_mask"]):
            if sampled:  # zero credit is white, not the null hatch; the other members hold none
                assert cell["bg"] == "rgb(255, 255, 255)" if trace_id == zeroed else "null" in cell["cls"].split()

    link = page.locator(f'article.member[data-trace="{zeroed}"] .branch-strip a').last
    index = int(link.inner_text().split()[-1])
    link.click()  # the branch's trace view, that branch shown
    page.wait_for_selector('body[data-painted="advantage:zeros"]')
    assert page.locator("#branch").input_value() == str(index)
    with run_server["app"].state.backend.reader() as db:
        path = db.sql("SELECT path FROM branches WHERE trace_id = ? AND branch_index = ?", [zeroed, index]).to_pylist()[
            0
        ]["path"]
    assert page.locator("article.node:visible").count() == len(path)
    assert page.problems == []


def test_compare_page_strips(page: Page, run_server: dict[str, Any]) -> None:
    base, zeroed = run_server["base"], run_server["zeroed"]
    page.goto(f"{base}/view/{zeroed}")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    page.select_option("#credit", "zeros")
    page.wait_for_selector('body[data-painted="advantage:zeros"]')
    page.click("#compare-link")  # follows the set shown: zeros against the other one
    page.wait_for_selector('body[data-painted="advantage:zeros-default"]')
    assert "credit=zeros" in page.url and "compare=default" in page.url
    page.select_option("#credit", "default")  # swap the sides: the form reloads the page
    page.wait_for_selector('body[data-painted="advantage:default-default"]')
    page.select_option("#compare", "zeros")
    page.wait_for_selector('body[data-painted="advantage:default-zeros"]')
    data = page.evaluate("JSON.parse(document.getElementById('compare-data').textContent)")
    value = run_server["expected"].advantage[zeroed]  # default: this on every sampled token; zeros: 0
    colour = advantage_color(value, abs(value))
    assert colour == "rgb(178, 24, 43)" and len(data["nodes"]) % 3 == 0 and data["nodes"]
    for i, strip in enumerate(data["nodes"]):
        want = {"a": colour, "b": "rgb(255, 255, 255)", "diff": colour}[strip["side"]]  # a - 0 = a
        got = cells(page, i)
        assert len(got) == len(strip["token_ids"])
        for cell, sampled in zip(got, strip["sampled_mask"]):
            assert cell["bg"] == want if sampled else "off" in cell["cls"].split(), (i, strip["side"], cell)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "compare.png"), full_page=False)
    assert page.problems == []


# --------------------------------------------------------------------------- a trace of many branches


@pytest.fixture(scope="module")
def wide_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A trace of 120 branches (a prompt, two shared turns, 120 answers of six tokens) whose
    answer 75 (branch 75, on the second page) holds known advantages in credit set ``probe``."""
    tmp = tmp_path_factory.mktemp("wide-browser")
    path = tmp / "wide.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(write_wide(tmp / "wide.jsonl", wide_episode(120, name="wide", forks=2, leaf_tokens=6)))
        db.create_credit_set("probe")
        (branch,) = db.sql("SELECT leaf, path FROM branches WHERE trace_id = 'wide' AND branch_index = 75").to_pylist()
        db.write_nodes([{"trace_id": "wide", "node_index": branch["leaf"], "values": [2.0, -2.0, 0.0]}], credit="probe")
    for url in serve(create_app(path)):
        yield {"base": url, "leaf": branch["leaf"], "path": branch["path"]}


def test_paging_a_wide_trace(page: Page, wide_server: dict[str, Any]) -> None:
    base, leaf = wide_server["base"], wide_server["leaf"]
    page.goto(f"{base}/view/wide")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    assert page.locator("#branch-window").inner_text() == "branches 0–49 of 120"
    assert page.locator("#branch-table tbody tr").count() == 50 and page.locator("#previous-branches").count() == 0
    page.click("#next-branches")
    page.wait_for_url("**branches_from=50**")
    page.wait_for_selector('body[data-painted="advantage:default"]')
    rows = page.locator("#branch-table tbody tr")
    assert rows.count() == 50 and rows.first.get_attribute("data-branch") == "50"
    assert page.locator(f"#node-{leaf}").count() == 1
    page.select_option("#credit", "probe")  # repaints the page's nodes in place
    page.wait_for_selector('body[data-painted="advantage:probe"]')
    got = [c for c in cells(page, leaf) if "off" not in c["cls"].split()]
    assert [c["bg"] for c in got] == ["rgb(178, 24, 43)", "rgb(33, 102, 172)", "rgb(255, 255, 255)"]
    status = page.locator('#branch-table tr[data-branch="75"] .credit-status').inner_text()
    assert status in ("partial", "assigned")
    page.select_option("#branch", "75")
    visible = page.locator("article.node:visible").evaluate_all("els => els.map(e => Number(e.dataset.node))")
    assert visible == wide_server["path"] and len(visible) >= 4  # the prompts, shared turns, the answer
    page.click("#next-branches")
    page.wait_for_url("**branches_from=100**")
    page.wait_for_selector('body[data-painted="advantage:probe"]')  # the credit set stays
    assert page.locator("#branch-table tbody tr").count() == 20 and page.locator("#next-branches").count() == 0
    page.click("#previous-branches")
    page.wait_for_url("**branches_from=50**")
    assert page.problems == []


# --------------------------------------------------------------------------- turns, nine credit sets, runs compared


def no_horizontal_scroll(page: Page) -> None:
    widths = page.evaluate(
        "({doc: document.documentElement.scrollWidth, body: document.body.scrollWidth, view: window.innerWidth})"
    )
    assert widths["doc"] <= widths["view"] and widths["body"] <= widths["view"], widths


def test_turn_summary_and_sampled_nodes_only(page: Page, run_server: dict[str, Any]) -> None:
    base, zeroed, expected = run_server["base"], run_server["zeroed"], run_server["expected"]
    with run_server["app"].state.backend.reader() as db:
        sampled = db.sql("SELECT node_index FROM nodes WHERE trace_id = ? AND sampled ORDER BY 1", [zeroed])
    sampled_nodes = sampled.column("node_index").to_pylist()
    page.goto(f"{base}/view/{zeroed}")
    page.wait_for_selector('body[data-painted="advantage:default"][data-turns="default"]')
    chips = page.eval_on_selector_all(
        "#turn-chips .turn",
        "els => els.map(e => ({node: Number(e.dataset.node), bg: getComputedStyle(e).backgroundColor}))",
    )
    assert [c["node"] for c in chips] == sampled_nodes
    value = expected.advantage[zeroed]  # the same on every turn: the summary's scale is its size
    assert {c["bg"] for c in chips} == {advantage_color(value, abs(value))} == {"rgb(178, 24, 43)"}
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#turns").screenshot(path=str(ARTIFACTS / "viewer-turns.png"))
    page.select_option("#credit", "zeros")  # the summary follows the credit set
    page.wait_for_selector('body[data-painted="advantage:zeros"][data-turns="zeros"]')
    chips = page.eval_on_selector_all("#turn-chips .turn", "els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert set(chips) == {"rgb(255, 255, 255)"}
    assert set(page.locator('#turn-table [data-figure="mean"]').all_text_contents()) == {"0"}  # in a closed <details>
    page.click("#show-sampled")
    page.wait_for_url("**sampled=true**")
    page.wait_for_selector('body[data-painted="advantage:zeros"]')  # the credit set shown is kept
    shown = page.locator("article.node").evaluate_all("els => els.map(e => Number(e.dataset.node))")
    assert shown == sampled_nodes
    assert page.locator("#show-all").count() == 1
    assert page.problems == []


@pytest.fixture(scope="module")
def runs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Two runs behind one server (``a``, with nine credit sets, and ``b``, moved on by the
    late group), for the group page at 1280 px and the runs page."""
    tmp = tmp_path_factory.mktemp("runs-browser")
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    a_path, _ = build_run(tmp / "a")
    b_path, expected = build_run(tmp / "b")
    late, tags = write_late(tmp / "b", expected)
    with tracedb.connect(b_path) as db:
        db.ingest(late, tags=tags)
    sets = ["grpo", "grpo-std", "rloo", "grpo-eps-0.1", "rloo-again", "grpo-by-group", "grpo-scaled", "rloo-3"]
    with tracedb.connect(a_path) as db:
        for name in sets:
            params = {"scale_std": True} if "std" in name or "scaled" in name else {}
            tracedb.credit.run(db, "rloo" if name.startswith("rloo") else "grpo", name, **params)
    app = create_app(a_path, name="a", runs={"b": b_path})
    for url in serve(app):
        yield {"base": url, "sets": ["default", *sets]}


def test_group_page_fits_1280_px_with_nine_credit_sets(page: Page, runs_server: dict[str, Any]) -> None:
    page.goto(f"{runs_server['base']}/view/group/group-0?credit=grpo&compare=rloo")
    page.wait_for_selector('body[data-painted="advantage:grpo"]')
    assert len(runs_server["sets"]) == 9
    no_horizontal_scroll(page)
    row = page.locator("#members tbody tr").first
    assert set(row.locator(".set-name").all_inner_texts()) == set(runs_server["sets"])  # a status per set
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "group-nine-sets.png"), full_page=False)
    assert page.problems == []


def test_runs_side_by_side(page: Page, runs_server: dict[str, Any]) -> None:
    base = runs_server["base"]
    page.goto(f"{base}/")
    page.click("#nav-compare")
    page.wait_for_url("**/runs/compare")
    assert page.locator("#run-figures thead .run-name").all_inner_texts() == ["a", "b"]
    answer = httpx.get(f"{base}/api/runs/compare").json()
    cells = page.locator('#run-figures tr[data-figure="traces"] td').all_inner_texts()
    assert cells == [str(r["traces"]) for r in answer["runs"]]
    rows = page.locator("#run-steps tbody tr").evaluate_all("rs => rs.map(r => r.dataset.key)")
    assert rows == ["0", "1", "2", "3", "4"]
    step4 = page.locator('#run-steps tr[data-key="4"] td[data-run="b"][data-figure="reward_mean"]').inner_text()
    assert float(step4) == pytest.approx(next(r for r in answer["rows"] if r["key"] == 4)["runs"]["b"]["reward_mean"])
    no_horizontal_scroll(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "runs-compare.png"), full_page=True)
    page.uncheck('input[name="run"][value="a"]')  # the form names runs, as the query does
    page.click("#compare-runs")
    page.wait_for_url("**run=b**")
    assert page.locator("#run-figures thead .run-name").all_inner_texts() == ["b"]
    assert page.problems == []
