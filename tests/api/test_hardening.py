"""What keeps the REST service safe to leave running: the Host check (DNS rebinding), the
security headers and content security policy, the limits of POST /sql (rows, bytes,
time), SQL behind the token, the read-only open, the serve command's refusals and
warnings, and ingest bodies that are damaged zstd."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import zstandard
from fastapi.testclient import TestClient

import tracedb
import tracedb.api.queries as queries_module
from tracedb import sqlvalues
from tracedb.api import create_app
from tracedb.errors import DatabaseError

from support import FIXTURES
from support.servers import free_port

TOKEN = "hardening-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LINEAR = FIXTURES / "linear.traces.jsonl"
ARROW = "application/vnd.apache.arrow.stream"
SAFE = {"x-content-type-options": "nosniff", "x-frame-options": "DENY", "referrer-policy": "no-referrer"}
NEW_FILES = ["forest.traces.jsonl", "groups.traces.jsonl", "compaction.traces.jsonl", "subagent_fork.traces.jsonl"]


def make_db(path: Path, files: list[Path] | None = None) -> Path:
    with tracedb.connect(path) as db:
        for f in files if files is not None else [FIXTURES]:
            db.ingest(f)
    return path


@contextlib.contextmanager
def serving(path: Path, **options: Any) -> Iterator[TestClient]:
    """A client of ``create_app(path, **options)``; the database is closed after."""
    app = create_app(path, **options)
    try:
        with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as client:
            yield client
    finally:
        app.state.backend.close()


def n_traces(client: TestClient) -> int:
    with client.app.state.backend.reader() as db:
        return db.handle.scalar("SELECT count(*) FROM traces")


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("TRACEDB_TOKEN", "TRACEDB_DB")}


def read_only_open(path: Path) -> subprocess.CompletedProcess[str]:
    """Another process opening ``path`` read-only and printing its trace count."""
    code = f"import tracedb; print(tracedb.connect({str(path)!r}, read_only=True).stats()['traces'])"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=clean_env(), check=False
    )


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every fixture, ingested; only read-only servers open it."""
    return make_db(tmp_path_factory.mktemp("hardening") / "runs.duckdb")


@pytest.fixture(scope="module")
def client(db_path: Path) -> Iterator[TestClient]:
    with serving(db_path, max_body_bytes=1000) as c:
        yield c


@pytest.fixture(scope="module")
def trace_id(client: TestClient) -> str:
    return client.get("/traces", params={"limit": 1}).json()["traces"][0]["trace_id"]


# --------------------------------------------------------------------------- Host check


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.evil.example:8000", ""]
)
def test_a_foreign_host_is_refused(client: TestClient, host: str) -> None:
    response = client.get("/health", headers={"Host": host})
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["error"] == "bad_host" and "--allowed-host" in body["detail"]
    assert all(response.headers.get(k) == v for k, v in SAFE.items())


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.1:8000", "localhost", "localhost:8000", "LocalHost:1", "[::1]", "[::1]:8000"]
)
def test_loopback_names_are_served_by_default(client: TestClient, host: str) -> None:
    response = client.get("/health", headers={"Host": host})
    assert response.status_code == 200, response.text


def test_allowed_hosts_replace_and_widen(db_path: Path) -> None:
    with serving(db_path, allowed_hosts=["trace.example"]) as c:
        assert c.get("/health", headers={"Host": "trace.example"}).status_code == 200
        assert c.get("/health", headers={"Host": "trace.example:8443"}).status_code == 200
        for host in ("evil.example", "trace.example.evil.example", "127.0.0.1"):
            assert c.get("/health", headers={"Host": host}).json()["error"] == "bad_host", host
    with serving(db_path, allowed_hosts=["*"]) as c:
        for host in ("evil.example", "evil.example:8000", "anything.at.all"):
            assert c.get("/health", headers={"Host": host}).status_code == 200, host


def test_a_bad_host_is_refused_before_any_route_runs(tmp_path: Path) -> None:
    with serving(make_db(tmp_path / "w.duckdb", [LINEAR]), token=TOKEN, allow_sql=True, max_body_bytes=100) as c:
        before = n_traces(c)
        evil = AUTH | {"Host": "evil.example"}
        body = b"".join((FIXTURES / f).read_bytes() for f in NEW_FILES)
        response = c.post("/ingest", content=body, headers=evil)  # over the body limit too: the host goes first
        assert response.status_code == 400 and response.json()["error"] == "bad_host"
        assert c.post("/credit-sets", json={"name": "x"}, headers=evil).status_code == 400
        assert n_traces(c) == before
        assert [s["name"] for s in c.get("/credit-sets").json()] == ["default"]


# --------------------------------------------------------------------------- security headers


def requests_of_every_kind(trace_id: str) -> list[tuple[str, str, dict[str, Any], int, str]]:
    """(method, url, request options, status, content type) of every kind of answer."""
    return [
        ("get", "/health", {}, 200, "application/json"),
        ("get", "/openapi.json", {}, 200, "application/json"),
        ("get", f"/traces/{trace_id}/branches/0", {"headers": {"Accept": ARROW}}, 200, ARROW),
        ("get", "/static/viewer.js", {}, 200, ""),
        ("get", "/static/viewer.css", {}, 200, "text/css"),
        ("get", "/", {}, 200, "text/html"),
        ("get", f"/view/{trace_id}", {}, 200, "text/html"),
        ("get", "/traces/no-such-trace", {}, 404, "application/json"),
        ("get", "/no/such/route", {}, 404, "application/json"),
        ("get", "/view/no-such-trace", {}, 404, "application/json"),
        ("get", "/traces?limit=0", {}, 422, "application/json"),
        ("post", "/ingest", {"content": b"x" * 5000}, 413, "application/json"),
        ("post", "/ingest", {"content": LINEAR.read_bytes()[:500], "headers": AUTH}, 403, "application/json"),
        ("delete", "/health", {}, 405, "application/json"),
    ]


def test_every_answer_carries_the_security_headers(client: TestClient, trace_id: str) -> None:
    for method, url, options, status, kind in requests_of_every_kind(trace_id):
        response = client.request(method, url, **options)
        assert response.status_code == status, (url, response.text[:300])
        assert response.headers["content-type"].startswith(kind), (url, response.headers["content-type"])
        for name, value in SAFE.items():
            assert response.headers.get_list(name) == [value], (url, name)
        html = kind == "text/html"
        assert ("content-security-policy" in response.headers) == html, url


def test_an_internal_error_carries_them_too(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(queries_module, "list_traces", broken)
    response = client.get("/traces")
    assert response.status_code == 500 and response.json()["error"] == "internal_error"
    assert all(response.headers.get(k) == v for k, v in SAFE.items())


def policy(response: httpx.Response) -> dict[str, list[str]]:
    """The content security policy as directive -> sources."""
    out: dict[str, list[str]] = {}
    for part in response.headers["content-security-policy"].split(";"):
        if part.strip():
            name, *sources = part.split()
            out[name.lower()] = sources
    return out


class Inline(HTMLParser):
    """What a CSP without 'unsafe-inline' would block in a page, and the assets it loads."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.assets: list[str] = []
        self.json_blocks = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        for name, value in attrs:
            if name == "style" or name.startswith("on"):
                self.found.append(f"<{tag} {name}=...>")
            if name in ("href", "src", "action") and (value or "").strip().lower().startswith("javascript:"):
                self.found.append(f"<{tag} {name}=javascript:>")
        if tag == "style":
            self.found.append("<style> element")
        if tag == "script":
            if named.get("src"):
                self.assets.append(named["src"] or "")
            elif named.get("type") == "application/json":
                self.json_blocks += 1
            else:
                self.found.append(f"inline <script {named}>")
        if tag == "link" and named.get("rel") == "stylesheet":
            self.assets.append(named.get("href") or "")


def inline_code(html: str) -> Inline:
    parser = Inline()
    parser.feed(html)
    parser.close()
    return parser


def test_pages_have_a_strict_policy_and_their_assets_load(client: TestClient, trace_id: str) -> None:
    for url in ("/", f"/view/{trace_id}"):
        page = client.get(url)
        directives = policy(page)
        assert directives["default-src"] == ["'self'"]
        for name in ("script-src", "style-src", "default-src"):
            assert not {"'unsafe-inline'", "'unsafe-eval'", "*"} & set(directives.get(name, [])), name
        assert directives.get("frame-ancestors") == ["'none'"]
        found = inline_code(page.text)
        assert found.found == [], (url, found.found)
        assert "/static/viewer.css" in found.assets
        for asset in found.assets:
            assert asset.startswith("/") and not asset.startswith("//"), asset  # same origin
            assert client.get(asset).status_code == 200, asset
    view = inline_code(client.get(f"/view/{trace_id}").text)
    assert view.json_blocks == 1 and "/static/viewer.js" in view.assets


def test_templates_hold_no_inline_style_handler_or_script() -> None:
    templates = resources.files("tracedb.api").joinpath("templates")
    sources = {t.name: t.read_text() for t in templates.iterdir() if t.name.endswith(".html")}
    assert {"base.html", "index.html", "view.html"} <= set(sources)
    for name, text in sources.items():
        assert not re.search(r"\sstyle\s*=", text, re.I), name
        assert not re.search(r"<style\b", text, re.I), name
        assert not re.search(r"\son[a-z]+\s*=", text, re.I), name
        assert "javascript:" not in text.lower(), name
        for attrs in re.findall(r"<script\b([^>]*)>", text, re.I):
            assert re.search(r"\ssrc=", attrs) or re.search(r'type="application/json"', attrs), (name, attrs)
    script = resources.files("tracedb.api").joinpath("static", "viewer.js").read_text()
    for blocked in ("eval(", "new Function", ".innerHTML", 'setAttribute("style"', "setAttribute('style'"):
        assert blocked not in script, blocked  # what script-src / style-src 'self' would stop


# --------------------------------------------------------------------------- POST /sql limits

WIDE = "SELECT repeat('x', 100000) AS x FROM range(100)"


def test_the_byte_budget_keeps_rows_whole(db_path: Path) -> None:
    budget = 350_000
    with serving(db_path, allow_sql=True, sql_max_bytes=budget) as c:
        response = c.post("/sql", json={"sql": WIDE})
    assert response.status_code == 200, response.text[:300]
    body = response.json()
    assert body["truncated"] is True and body["truncated_by"] == "bytes" and body["truncated_why"]
    assert body["max_bytes"] == budget
    assert 0 < body["row_count"] == len(body["rows"]) < 100
    assert all(row == ["x" * 100_000] for row in body["rows"])
    assert len(orjson.dumps(body["rows"])) <= budget < len(orjson.dumps(body["rows"] + body["rows"][:1]))
    assert len(response.content) <= budget + 2048


def test_a_row_over_the_whole_budget_gives_none(db_path: Path) -> None:
    with serving(db_path, allow_sql=True, sql_max_bytes=50_000) as c:
        response = c.post("/sql", json={"sql": WIDE})
    body = response.json()
    assert response.status_code == 200 and body["rows"] == [] and body["row_count"] == 0
    assert body["truncated"] is True and body["truncated_by"] == "bytes"
    assert [col["name"] for col in body["columns"]] == ["x"]
    assert len(response.content) <= 50_000


def test_the_row_limit_says_rows_and_small_answers_are_whole(db_path: Path) -> None:
    with serving(db_path, allow_sql=True, sql_row_limit=5, sql_max_bytes=10_000) as c:
        body = c.post("/sql", json={"sql": "SELECT * FROM range(100)"}).json()
        assert body["row_count"] == 5 and body["truncated_by"] == "rows" and "5" in body["truncated_why"]
        body = c.post("/sql", json={"sql": "SELECT * FROM range(100)", "limit": 3}).json()
        assert body["row_count"] == 3 and body["truncated_by"] == "rows"
        for sql, rows in [("SELECT 42 AS answer", [[42]]), ("SELECT * FROM range(5)", [[i] for i in range(5)])]:
            body = c.post("/sql", json={"sql": sql}).json()
            assert body["rows"] == rows and body["truncated"] is False
            assert body["truncated_by"] is None and body["truncated_why"] is None


def test_building_the_answer_counts_against_the_time_limit(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = sqlvalues.jsonable

    def slow(value: Any) -> Any:
        time.sleep(0.05)  # 1000 rows: 50 s without the limit
        return real(value)

    with serving(db_path, allow_sql=True, sql_timeout_s=0.5) as c:
        monkeypatch.setattr(sqlvalues, "jsonable", slow)
        started = time.perf_counter()
        response = c.post("/sql", json={"sql": "SELECT * FROM range(1000)"})
        took = time.perf_counter() - started
        monkeypatch.undo()
        assert response.status_code == 400 and response.json()["error"] == "sql_timeout", response.text[:300]
        assert took < 10
        assert c.post("/sql", json={"sql": "SELECT 1"}).json()["rows"] == [[1]]


def test_a_long_query_is_interrupted(db_path: Path) -> None:
    with serving(db_path, allow_sql=True, sql_timeout_s=0.5) as c:
        started = time.perf_counter()
        sql = "SELECT sum(a.range * b.range) FROM range(100000) a, range(100000) b"
        response = c.post("/sql", json={"sql": sql})
        assert response.status_code == 400 and response.json()["error"] == "sql_timeout", response.text[:300]
        assert time.perf_counter() - started < 10
        assert c.post("/sql", json={"sql": "SELECT 2"}).json()["rows"] == [[2]]


# --------------------------------------------------------------------------- SQL behind the token


def test_sql_needs_token(tmp_path: Path) -> None:
    path = make_db(tmp_path / "t.duckdb", [LINEAR])
    query = {"sql": "SELECT count(*) FROM traces"}
    with serving(path, token=TOKEN, allow_sql=True, sql_needs_token=True) as c:
        response = c.post("/sql", json=query)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert c.post("/sql", json=query, headers={"Authorization": "Bearer nope"}).status_code == 403
        assert c.post("/sql", json=query, headers={"Authorization": f"Basic {TOKEN}"}).status_code == 401
        response = c.post("/sql", json=query, headers=AUTH)
        assert response.status_code == 200 and response.json()["rows"] == [[n_traces(c)]]
    with serving(path, token=TOKEN, allow_sql=True) as c:
        assert c.post("/sql", json=query).status_code == 200


def test_sql_needs_token_without_a_token_is_refused_at_startup(tmp_path: Path) -> None:
    missing = tmp_path / "never.duckdb"
    with pytest.raises(ValueError, match="token"):
        create_app(missing, allow_sql=True, sql_needs_token=True)
    assert not missing.exists()


# --------------------------------------------------------------------------- read-only open


def test_a_server_without_a_token_shares_the_file_and_refuses_writes(tmp_path: Path) -> None:
    path = make_db(tmp_path / "ro.duckdb", [LINEAR])
    with serving(path) as c:
        assert c.app.state.backend.read_only is True
        expected = n_traces(c)
        beside = read_only_open(path)
        assert beside.returncode == 0, beside.stderr[-2000:]
        assert beside.stdout.strip() == str(expected)
        body = b"".join((FIXTURES / f).read_bytes() for f in NEW_FILES)
        for method, url, options in [
            ("post", "/ingest", {"content": body}),
            ("post", "/credit-sets", {"json": {"name": "x"}}),
            ("put", "/traces/x/nodes/0/advantages", {"json": {"values": None}}),
        ]:
            response = c.request(method, url, headers=AUTH, **options)
            assert response.status_code == 403 and response.json()["error"] == "writes_disabled", url
        assert n_traces(c) == expected


def test_a_server_with_a_token_holds_the_file(tmp_path: Path) -> None:
    path = make_db(tmp_path / "rw.duckdb", [LINEAR])
    with serving(path, token=TOKEN) as c:
        assert c.app.state.backend.read_only is False
        beside = read_only_open(path)
    assert beside.returncode != 0 and beside.stdout == ""
    assert "DatabaseLocked" in beside.stderr and f"PID {os.getpid()}" in beside.stderr, beside.stderr[-2000:]


def test_read_only_beside_a_token_refuses_writes_as_403(tmp_path: Path) -> None:
    path = make_db(tmp_path / "rot.duckdb", [LINEAR])
    with serving(path, token=TOKEN, read_only=True, allow_sql=True, sql_needs_token=True) as c:
        before = n_traces(c)
        body = (FIXTURES / NEW_FILES[0]).read_bytes()
        for method, url, options in [
            ("post", "/ingest", {"content": body}),
            ("post", "/credit-sets", {"json": {"name": "x"}}),
        ]:
            assert c.request(method, url, **options).status_code == 401, url
            response = c.request(method, url, headers=AUTH, **options)
            assert response.status_code == 403 and response.json()["error"] == "read_only", response.text[:300]
        assert n_traces(c) == before
        assert c.post("/sql", json={"sql": "SELECT 1"}, headers=AUTH).status_code == 200  # reads still work


def test_a_read_only_server_needs_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.duckdb"
    with pytest.raises(DatabaseError, match="missing.duckdb"):
        create_app(missing)
    assert not missing.exists()
    done = subprocess.run(
        [sys.executable, "-m", "tracedb", "serve", "--db", str(missing), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "missing.duckdb" in lines[0], done.stderr
    assert not missing.exists()


# --------------------------------------------------------------------------- tracedb serve


def serve_output(db: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Start ``tracedb serve --db DB ARGS`` on a free port, wait for /health over
    loopback, ask it once under a foreign Host, stop it: (that answer's status, stderr,
    stdout)."""
    port = free_port()
    command = [sys.executable, "-m", "tracedb", "serve", "--db", str(db), "--port", str(port), *args]
    proc = subprocess.Popen(
        command, env=clean_env() | (env or {}), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited ({proc.returncode}): {proc.communicate()}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not answer /health within 60 s"
            time.sleep(0.1)
        foreign = httpx.get(f"{base}/health", headers={"Host": "evil.example"}, timeout=10).status_code
    finally:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate(timeout=20)
    return foreign, err, out


@pytest.mark.parametrize(
    ("host", "token", "warns"), [("0.0.0.0", None, True), ("127.0.0.1", None, False), ("0.0.0.0", TOKEN, False)]
)
def test_serving_beyond_loopback_without_a_token_warns(
    tmp_path: Path, host: str, token: str | None, warns: bool
) -> None:
    env = {"TRACEDB_TOKEN": token} if token else None
    foreign, err, _ = serve_output(make_db(tmp_path / "s.duckdb", [LINEAR]), "--host", host, env=env)
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == int(warns), err
    if warns:
        assert warnings[0].startswith(f"warning: serving on {host}") and "no token" in warnings[0], err
    assert ("writes on" if token else "read-only") in err, err
    assert foreign == 400  # a real server still answers only to its own names


# --------------------------------------------------------------------------- damaged zstd bodies


def frames() -> list[bytes]:
    """Each line of the files not yet in a LINEAR-only database as a zstd frame of its own."""
    compressor = zstandard.ZstdCompressor()
    lines = [line for f in NEW_FILES for line in (FIXTURES / f).read_bytes().splitlines(keepends=True)]
    return [compressor.compress(line) for line in lines]


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[TestClient]:
    with serving(make_db(tmp_path / "z.duckdb", [LINEAR]), token=TOKEN) as c:
        yield c


def truncated_multi_frame() -> bytes:
    parts = frames()
    return b"".join(parts[:3]) + parts[3][: len(parts[3]) // 2]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (truncated_multi_frame(), ["truncated", "zstd"]),
        (b"\x28\xb5\x2f\xfd" + bytes(range(256)) * 16, ["zstd"]),
        (b"".join(frames()) + b"trailing junk", ["zstd"]),
    ],
    ids=["truncated-multi-frame", "garbage-after-magic", "valid-then-junk"],
)
def test_a_damaged_zstd_body_is_422_and_commits_nothing(writer: TestClient, body: bytes, words: list[str]) -> None:
    before = n_traces(writer)
    response = writer.post("/ingest", content=body, headers=AUTH)
    assert response.status_code == 422, response.text[:300]
    detail = response.json()["detail"]
    assert detail.startswith("request body") and all(w in detail for w in words), detail
    assert n_traces(writer) == before
    good = writer.post("/ingest", content=b"".join(frames()), headers=AUTH)  # the writer is still usable
    assert good.status_code == 200 and good.json()["traces"] == len(frames()) and good.json()["rejected"] == []
    assert n_traces(writer) == before + len(frames())


@pytest.mark.parametrize("cut", ["last-bytes", "half", "magic-only"])
def test_a_body_cut_inside_its_only_frame_is_422(writer: TestClient, cut: str) -> None:
    """Nothing of such a body decompresses before the cut: the damage must still be seen."""
    packed = zstandard.ZstdCompressor().compress((FIXTURES / NEW_FILES[0]).read_bytes())
    body = {"last-bytes": packed[:-3], "half": packed[: len(packed) // 2], "magic-only": packed[:4]}[cut]
    assert body.startswith(b"\x28\xb5\x2f\xfd")
    before = n_traces(writer)
    response = writer.post("/ingest", content=body, headers=AUTH)
    assert response.status_code == 422 and "truncated" in response.json()["detail"], response.text[:300]
    assert n_traces(writer) == before
