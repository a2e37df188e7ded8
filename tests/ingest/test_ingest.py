"""Ingest: file kinds, idempotency, segment dedup, exact round trips, persistence, schema version."""

from __future__ import annotations

import copy
import gc
import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
import zstandard

import tracedb
import tracedb.ingest.rows
import tracedb.ingest.run
import tracedb.ingest.writer
from tracedb.errors import SchemaVersionError
from tracedb.ingest import IngestReport

from support import FIXTURES

TABLES = ("tracedb_meta", "episodes", "traces", "segments", "nodes", "branches", "rejects")
FIXTURE_FILES = sorted(FIXTURES.glob("*.traces.jsonl"))


# --------------------------------------------------------------------------- helpers


def episodes_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_episode(name: str = "linear") -> dict[str, Any]:
    (episode,) = episodes_of(FIXTURES / f"{name}.traces.jsonl")
    return episode


def all_episodes() -> list[dict[str, Any]]:
    return [e for f in FIXTURE_FILES for e in episodes_of(f)]


def canon(value: Any) -> str:
    """Type-exact form: equal only if ints stay ints, floats floats, None None."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def assert_same(got: Any, want: Any) -> None:
    assert got == want
    assert canon(got) == canon(want)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def counts(db: tracedb.Database) -> dict[str, int]:
    return {t: db.sql(f"SELECT count(*) AS n FROM {t}").column("n")[0].as_py() for t in TABLES}


def content(db: tracedb.Database) -> dict[str, list[str]]:
    """Every row of every table, order-independent."""
    return {t: sorted(repr(r) for r in db.sql(f"SELECT * FROM {t}").to_pylist()) for t in TABLES}


def stats_without_size(db: tracedb.Database) -> dict[str, Any]:
    s = db.stats()
    s.pop("bytes")
    return s


def renamed(episode: dict[str, Any], suffix: str) -> dict[str, Any]:
    """A copy of an episode with fresh episode and trace ids."""
    e = copy.deepcopy(episode)
    e["id"] = e["id"] + suffix
    for t in e["traces"]:
        t["id"] = t["id"] + suffix
    return e


def groups_head(tmp_path: Path, n: int) -> Path:
    """The first ``n`` lines of the groups fixture, as a file of their own."""
    path = tmp_path / f"groups_head_{n}.traces.jsonl"
    lines = (FIXTURES / "groups.traces.jsonl").read_text().splitlines(keepends=True)[:n]
    path.write_text("".join(lines))
    return path


def fixture_totals() -> dict[str, int]:
    eps = all_episodes()
    traces = [t for e in eps for t in e["traces"]]
    nodes = [n for t in traces for n in t["nodes"]]
    return {
        "episodes": len(eps),
        "traces": len(traces),
        "nodes": len(nodes),
        "tokens": sum(len(n.get("token_ids", [])) for n in nodes),
    }


# --------------------------------------------------------------------------- file kinds


def test_jsonl_file(fresh_db, tmp_path):
    path = FIXTURES / "linear.traces.jsonl"
    episode = one_episode("linear")
    trace = episode["traces"][0]
    report = fresh_db.ingest(path)
    assert isinstance(report, IngestReport)
    assert report.ok and report.rejected == []
    assert (report.files, report.lines, report.episodes, report.traces, report.skipped) == (1, 1, 1, 1, 0)
    assert report.nodes == len(trace["nodes"])
    assert report.tokens == sum(len(n["token_ids"]) for n in trace["nodes"])
    assert report.segments_added == len({tuple(n["token_ids"]) for n in trace["nodes"]})
    d = report.to_dict()
    assert d["traces"] == 1 and d["rejected"] == [] and d["skipped"] == 0
    assert_same(fresh_db.trace(trace["id"]), trace)
    assert_same(fresh_db.episode(episode["id"]), episode)
    row = fresh_db.sql("SELECT source, line, episode_id, position FROM traces").to_pylist()
    assert row == [{"source": str(path), "line": 1, "episode_id": episode["id"], "position": 0}]


def test_str_path_and_list_of_paths(fresh_db):
    report = fresh_db.ingest([str(FIXTURES / "linear.traces.jsonl"), FIXTURES / "forest.traces.jsonl"])
    assert report.ok and report.files == 2 and report.traces == 2


def test_missing_path_raises_and_writes_nothing(fresh_db, tmp_path):
    with pytest.raises(FileNotFoundError):
        fresh_db.ingest([FIXTURES / "linear.traces.jsonl", tmp_path / "nope.jsonl"])
    assert fresh_db.stats()["traces"] == 0


def _zst_one_shot(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


def _zst_streamed(data: bytes) -> bytes:
    # A streamed frame does not record the content size; several flushes make several blocks.
    import io

    buf = io.BytesIO()
    with zstandard.ZstdCompressor(level=1).stream_writer(buf, closefd=False) as w:
        for i in range(0, len(data), 4096):
            w.write(data[i : i + 4096])
            w.flush(zstandard.FLUSH_BLOCK)
    return buf.getvalue()


@pytest.mark.parametrize("compress", [_zst_one_shot, _zst_streamed], ids=["one-shot", "streamed"])
def test_jsonl_zst_file(fresh_db, tmp_path, compress):
    source = groups_head(tmp_path, 8)
    path = tmp_path / "groups.traces.jsonl.zst"
    path.write_bytes(compress(source.read_bytes()))
    report = fresh_db.ingest(path)
    eps = episodes_of(source)
    assert report.ok, report.rejected
    assert (report.files, report.lines, report.episodes, report.traces) == (1, len(eps), len(eps), len(eps))
    for e in eps:
        assert_same(fresh_db.episode(e["id"]), e)
    # the same bytes uncompressed give the same database
    with tracedb.connect(":memory:") as plain:
        plain.ingest(source)
        assert counts(plain) == counts(fresh_db)
        assert plain.stats()["dedup_ratio"] == fresh_db.stats()["dedup_ratio"]
    assert fresh_db.sql("SELECT DISTINCT source FROM traces").column("source").to_pylist() == [str(path)]


@pytest.mark.parametrize("indent", [None, 2], ids=["compact", "pretty"])
def test_json_file_single_trace(fresh_db, tmp_path, indent):
    trace = one_episode("compaction")["traces"][0]
    path = tmp_path / "one.json"
    path.write_text(json.dumps(trace, indent=indent))
    report = fresh_db.ingest(path)
    assert report.ok, report.rejected
    assert (report.files, report.lines, report.episodes, report.traces) == (1, 1, 0, 1)
    assert report.nodes == len(trace["nodes"])
    assert_same(fresh_db.trace(trace["id"]), trace)
    row = fresh_db.sql("SELECT episode_id, line FROM traces").to_pylist()
    assert row == [{"episode_id": None, "line": 1}]
    assert fresh_db.stats()["episodes"] == 0
    assert fresh_db.stats()["branches"] == len(json.loads((FIXTURES / "compaction.branches.json").read_text()))


def test_bare_trace_line_in_jsonl(fresh_db, tmp_path):
    bare = one_episode("forest")["traces"][0]
    episode = one_episode("linear")
    path = write_jsonl(tmp_path / "mixed.jsonl", [bare, episode])
    report = fresh_db.ingest(path)
    assert report.ok, report.rejected
    assert (report.lines, report.episodes, report.traces) == (2, 1, 2)
    assert_same(fresh_db.trace(bare["id"]), bare)
    assert_same(fresh_db.episode(episode["id"]), episode)
    rows = fresh_db.sql("SELECT trace_id, episode_id, line FROM traces ORDER BY line").to_pylist()
    assert rows == [
        {"trace_id": bare["id"], "episode_id": None, "line": 1},
        {"trace_id": episode["traces"][0]["id"], "episode_id": episode["id"], "line": 2},
    ]


def test_blank_lines_and_crlf(fresh_db, tmp_path):
    a, b = one_episode("linear"), one_episode("forest")
    path = tmp_path / "crlf.jsonl"
    path.write_bytes(b"\r\n" + json.dumps(a).encode() + b"\r\n\r\n  \n" + json.dumps(b).encode())
    report = fresh_db.ingest(path)
    assert report.ok, report.rejected
    assert (report.lines, report.traces) == (2, 2)
    lines = fresh_db.sql("SELECT line FROM episodes ORDER BY line").column("line").to_pylist()
    assert lines == [2, 5]  # physical line numbers
    assert_same(fresh_db.episode(a["id"]), a)
    assert_same(fresh_db.episode(b["id"]), b)


def test_directory_recursion(fresh_db, tmp_path):
    root = tmp_path / "runs"
    (root / "a").mkdir(parents=True)
    shutil.copy(FIXTURES / "linear.traces.jsonl", root / "a" / "x.jsonl")
    deep = root / "b" / "c" / "d"
    deep.mkdir(parents=True)
    (deep / "groups.traces.jsonl.zst").write_bytes(_zst_one_shot((FIXTURES / "groups.traces.jsonl").read_bytes()))
    # files that are not traces.jsonl: ground truth, notes, a .json record, a stray .zst
    shutil.copy(FIXTURES / "linear.branches.json", root / "linear.branches.json")
    shutil.copy(FIXTURES / "forest.branches.json", deep / "forest.branches.json")
    (root / "notes.txt").write_text("not json at all\n")
    (root / "b" / "trace.json").write_text(json.dumps(one_episode("forest")["traces"][0]))
    (root / "b" / "other.zst").write_bytes(_zst_one_shot(b"garbage\n"))
    (root / "b" / "x.jsonl.bak").write_text("garbage\n")
    report = fresh_db.ingest(root)
    assert report.ok, report.rejected
    assert report.files == 2
    n_groups = len(episodes_of(FIXTURES / "groups.traces.jsonl"))
    assert report.traces == 1 + n_groups
    assert fresh_db.stats()["rejects"] == 0
    sources = set(fresh_db.sql("SELECT DISTINCT source FROM traces").column("source").to_pylist())
    assert sources == {str(root / "a" / "x.jsonl"), str(deep / "groups.traces.jsonl.zst")}


def test_fixture_directory(fresh_db):
    report = fresh_db.ingest(FIXTURES)
    totals = fixture_totals()
    assert report.ok, report.rejected
    assert report.files == len(FIXTURE_FILES)
    assert (report.episodes, report.traces, report.nodes, report.tokens) == (
        totals["episodes"],
        totals["traces"],
        totals["nodes"],
        totals["tokens"],
    )
    s = fresh_db.stats()
    assert (s["episodes"], s["traces"], s["nodes"], s["tokens"]) == (
        totals["episodes"],
        totals["traces"],
        totals["nodes"],
        totals["tokens"],
    )
    n_branches = sum(len(json.loads(p.read_text())) for p in FIXTURES.glob("*.branches.json"))
    assert s["branches"] == n_branches
    assert s["segments"] == report.segments_added


# --------------------------------------------------------------------------- idempotency


def test_reingest_adds_nothing(fixture_db):
    before_counts, before_content = counts(fixture_db), content(fixture_db)
    before_stats = fixture_db.stats()
    report = fixture_db.ingest(FIXTURES)
    total = fixture_totals()["traces"]
    assert report.ok
    assert (report.traces, report.skipped, report.episodes, report.nodes, report.tokens) == (0, total, 0, 0, 0)
    assert report.segments_added == 0
    assert report.to_dict()["skipped"] == total
    assert "already present" in str(report)
    assert counts(fixture_db) == before_counts
    assert content(fixture_db) == before_content
    assert fixture_db.stats() == before_stats


def test_reingest_one_file_twice_and_a_zst_copy(fresh_db, tmp_path):
    src = FIXTURES / "groups.traces.jsonl"
    first = fresh_db.ingest(src)
    snap = content(fresh_db)
    again = fresh_db.ingest(src)
    zst = tmp_path / "copy.jsonl.zst"
    zst.write_bytes(_zst_one_shot(src.read_bytes()))
    third = fresh_db.ingest(zst)
    assert first.traces == again.skipped == third.skipped == len(episodes_of(src))
    assert again.traces == third.traces == 0
    assert content(fresh_db) == snap


def test_reingest_with_some_new_traces(fresh_db, tmp_path):
    old = one_episode("linear")
    new = renamed(old, "-new")
    fresh_db.ingest(write_jsonl(tmp_path / "a.jsonl", [old]))
    report = fresh_db.ingest(write_jsonl(tmp_path / "b.jsonl", [old, new]))
    assert (report.traces, report.skipped, report.episodes) == (1, 1, 1)
    assert fresh_db.stats()["traces"] == 2
    assert_same(fresh_db.episode(new["id"]), new)
    assert_same(fresh_db.episode(old["id"]), old)


def test_reingest_bare_trace(fresh_db, tmp_path):
    trace = one_episode("forest")["traces"][0]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    fresh_db.ingest(path)
    snap = content(fresh_db)
    report = fresh_db.ingest(path)
    assert (report.traces, report.skipped) == (0, 1)
    assert content(fresh_db) == snap
    # the same trace inside an episode is also already there
    report = fresh_db.ingest(FIXTURES / "forest.traces.jsonl")
    assert (report.traces, report.skipped) == (0, 1)


@pytest.mark.parametrize("batch_tokens", [None, 1], ids=["one-batch", "batch-per-line"])
def test_trace_twice_in_one_file(fresh_db, tmp_path, knobs, batch_tokens):
    if batch_tokens is not None:
        knobs(batch_tokens=batch_tokens)
        knobs(chunk_bytes=1)  # a chunk per line
    a, b = one_episode("linear"), one_episode("forest")
    path = write_jsonl(tmp_path / "dup.jsonl", [a, b, a])
    report = fresh_db.ingest(path)
    assert report.ok, report.rejected
    assert (report.lines, report.traces, report.skipped, report.episodes) == (3, 2, 1, 2)
    assert report.nodes == len(a["traces"][0]["nodes"]) + len(b["traces"][0]["nodes"])
    assert counts(fresh_db)["traces"] == 2 and counts(fresh_db)["episodes"] == 2
    assert fresh_db.stats()["nodes"] == report.nodes
    # the first occurrence is the one kept
    assert fresh_db.sql(f"SELECT line FROM traces WHERE trace_id = '{a['traces'][0]['id']}'").to_pylist() == [
        {"line": 1}
    ]
    assert_same(fresh_db.episode(a["id"]), a)


def test_idempotency_across_batches_and_files(fresh_db, tmp_path, knobs):
    knobs(batch_tokens=1)  # every line is its own batch
    knobs(chunk_bytes=1)  # a chunk per line
    head = groups_head(tmp_path, 6)
    files = [FIXTURES / "linear.traces.jsonl", head, FIXTURES / "forest.traces.jsonl", head]
    report = fresh_db.ingest(files)
    assert report.ok
    assert (report.traces, report.skipped, report.episodes) == (8, 6, 8)
    assert fresh_db.stats()["traces"] == 8
    for e in episodes_of(head):
        assert_same(fresh_db.episode(e["id"]), e)


# --------------------------------------------------------------------------- segment dedup


def _sharing_system_prompt(base: dict[str, Any], suffix: str, shift: int) -> dict[str, Any]:
    """Same node 0 (the system prompt) as ``base``; every other node's tokens differ."""
    e = renamed(base, suffix)
    for node in e["traces"][0]["nodes"][1:]:
        node["token_ids"] = [t + shift for t in node["token_ids"]]
    return e


def test_shared_system_prompt_stored_once(fresh_db, tmp_path):
    a = one_episode("linear")
    b = _sharing_system_prompt(a, "-b", 1)
    nodes_a = a["traces"][0]["nodes"]
    assert len({tuple(n["token_ids"]) for n in nodes_a}) == len(nodes_a)  # the premise: no repeats within a
    report = fresh_db.ingest(write_jsonl(tmp_path / "ab.jsonl", [a, b]))
    assert report.ok, report.rejected
    n = len(nodes_a)
    assert report.segments_added == 2 * n - 1
    s = fresh_db.stats()
    assert s["nodes"] == 2 * n and s["segments"] == 2 * n - 1
    per_trace = sum(len(x["token_ids"]) for x in nodes_a)
    system = len(nodes_a[0]["token_ids"])
    assert s["tokens"] == 2 * per_trace
    assert s["stored_tokens"] == 2 * per_trace - system
    assert s["branch_tokens"] == 2 * per_trace  # one branch each (linear)
    assert s["dedup_ratio"] == round(2 * per_trace / (2 * per_trace - system), 3)
    seg = fresh_db.sql("SELECT count(DISTINCT segment_id) AS k, count(*) AS n FROM nodes WHERE node_index = 0")
    assert seg.to_pylist() == [{"k": 1, "n": 2}]
    assert_same(fresh_db.trace(a["traces"][0]["id"]), a["traces"][0])
    assert_same(fresh_db.trace(b["traces"][0]["id"]), b["traces"][0])

    # A later ingest reuses the stored segment too.
    c = _sharing_system_prompt(a, "-c", 2)
    report = fresh_db.ingest(write_jsonl(tmp_path / "c.jsonl", [c]))
    assert report.segments_added == n - 1
    assert fresh_db.stats()["segments"] == 3 * n - 2
    assert_same(fresh_db.trace(c["traces"][0]["id"]), c["traces"][0])


def test_dedup_ratio_counts_shared_branch_nodes(fixture_db):
    s = fixture_db.stats()
    branch_tokens = fixture_db.sql("SELECT sum(n_tokens)::BIGINT AS t FROM branches").column("t")[0].as_py()
    stored = fixture_db.sql("SELECT sum(n_tokens)::BIGINT AS t FROM segments").column("t")[0].as_py()
    assert s["branch_tokens"] == branch_tokens and s["stored_tokens"] == stored
    assert s["dedup_ratio"] == round(branch_tokens / stored, 3)
    assert s["dedup_ratio"] > 1  # forks and compaction share nodes between branches
    # every stored segment is referenced, and identical token lists share one row
    orphan = fixture_db.sql("SELECT count(*) AS n FROM segments WHERE segment_id NOT IN (SELECT segment_id FROM nodes)")
    assert orphan.column("n")[0].as_py() == 0
    distinct = {tuple(n.get("token_ids", [])) for e in all_episodes() for t in e["traces"] for n in t["nodes"]}
    assert s["segments"] == len(distinct)


def test_empty_stats_dedup_ratio(fresh_db):
    s = fresh_db.stats()
    assert s["traces"] == 0 and s["dedup_ratio"] is None


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.split(".")[0])
def test_fixture_round_trip(fixture_db, path):
    for episode in episodes_of(path):
        assert_same(fixture_db.episode(episode["id"]), episode)
        for trace in episode["traces"]:
            assert_same(fixture_db.trace(trace["id"]), trace)


def test_not_found(fixture_db):
    with pytest.raises(tracedb.NotFound):
        fixture_db.trace("no-such-trace")
    with pytest.raises(tracedb.NotFound):
        fixture_db.episode("no-such-episode")
    with pytest.raises(KeyError):  # NotFound is a KeyError too
        fixture_db.trace("no-such-trace")


def _with_unknown_fields() -> dict[str, Any]:
    e = one_episode("linear")
    e["x_episode"] = {"nested": [1, [2, {"deep": None}]], "text": "épisode ✓"}
    e["x_episode_null"] = None
    t = e["traces"][0]
    t["x_trace"] = [[1], [2, 3], []]
    t["x_trace_obj"] = {"k": "v", "n": 1.5}
    t["rewards"] = {"correct": {"score": 1.0, "weight": 0.5, "x_reward": [7]}, "unscored": None}
    nodes = t["nodes"]
    nodes[2]["x_node"] = {"k": [[1, 2], []]}
    nodes[2]["x_node_null"] = None
    nodes[2]["x_node_int"] = 3
    nodes[2]["message"]["x_message"] = [1, [2], {"z": None}]
    nodes[2]["message"]["content"] = 'héllo "q" \\ ✓ \u0000 😀 \n\t'
    nodes[3]["semantic_parents"] = [{"node": 1, "type": "x_custom_edge"}, {"node": 2, "type": "compaction_attempt"}]
    nodes[4]["semantic_parents"] = [{"node": 3, "type": "some_future_edge"}]
    return e


def test_unknown_fields_kept_at_every_level(fresh_db, tmp_path):
    e = _with_unknown_fields()
    report = fresh_db.ingest(write_jsonl(tmp_path / "unknown.jsonl", [e]))
    assert report.ok, report.rejected
    t = e["traces"][0]
    got = fresh_db.trace(t["id"])
    for key in ("x_trace", "x_trace_obj", "rewards"):
        assert_same(got[key], t[key])
    assert_same(got["nodes"][2], t["nodes"][2])
    assert_same(got["nodes"][3]["semantic_parents"], t["nodes"][3]["semantic_parents"])
    assert_same(got, t)
    ep = fresh_db.episode(e["id"])
    assert_same(ep["x_episode"], e["x_episode"])
    assert "x_episode_null" in ep and ep["x_episode_null"] is None
    assert_same(ep, e)
    types = fresh_db.sql("SELECT semantic_parents FROM nodes WHERE node_index = 3").to_pylist()
    assert types[0]["semantic_parents"][0]["type"] == "x_custom_edge"


def test_unknown_fields_in_bare_trace(fresh_db, tmp_path):
    t = _with_unknown_fields()["traces"][0]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(t, ensure_ascii=False))
    report = fresh_db.ingest(path)
    assert report.ok, report.rejected
    assert_same(fresh_db.trace(t["id"]), t)


def test_unknown_field_on_semantic_link_kept(fresh_db, tmp_path):
    """ParentLink keeps unknown fields like every model (models.py: extra="allow")."""
    e = one_episode("linear")
    t = e["traces"][0]
    t["nodes"][3]["semantic_parents"] = [{"node": 1, "type": "compaction", "x_link": 5}]
    fresh_db.ingest(write_jsonl(tmp_path / "link.jsonl", [e]))
    assert_same(fresh_db.trace(t["id"])["nodes"][3]["semantic_parents"], t["nodes"][3]["semantic_parents"])


def test_absent_none_and_empty_stay_distinct(fresh_db, tmp_path):
    e = one_episode("linear")
    t = e["traces"][0]
    n = len(t["nodes"])
    t["nodes"] += [
        {"message": {"role": "user", "content": "only a message"}, "parent": n - 1},
        {
            "parent": n,
            "message": {"role": "assistant", "content": "nulls"},
            "sampled": True,
            "token_ids": [5, 6, 7],
            "mask": [False, True, True],
            "is_content": [False, True, True],
            "logprobs": [],
            "advantages": None,
            "reference_logprobs": [],
            "trainer_logprobs": [0.0, 0.0],
            "entropies": None,
            "loss_weights": None,
        },
        {
            "parent": n + 1,
            "message": {"role": "tool", "content": ""},
            "token_ids": [],
            "mask": [],
            "advantages": [],
            "loss_weights": {},
            "semantic_parents": [],
        },
    ]
    fresh_db.ingest(write_jsonl(tmp_path / "nulls.jsonl", [e]))
    got = fresh_db.trace(t["id"])
    for i in (n, n + 1, n + 2):
        assert_same(got["nodes"][i], t["nodes"][i])
    rows = fresh_db.sql(
        f"SELECT node_index, advantages, reference_logprobs, loss_weights FROM nodes "
        f"WHERE trace_id = '{t['id']}' AND node_index >= {n + 1} ORDER BY node_index"
    ).to_pylist()
    assert rows[0]["advantages"] is None and rows[0]["reference_logprobs"] == []
    assert rows[1]["advantages"] == []


def test_float_streams_round_trip_at_float32(fresh_db, tmp_path):
    e = one_episode("linear_assigned")
    t = e["traces"][0]
    node = next(x for x in t["nodes"] if x.get("advantages"))
    node["advantages"] = [0.1, -1e-8, 3.4e38, 1e-45, 0.0, -0.0, 123456.789] + node["advantages"][7:]
    fresh_db.ingest(write_jsonl(tmp_path / "f.jsonl", [e]))
    got = next(x for x in fresh_db.trace(t["id"])["nodes"] if x.get("advantages"))["advantages"]
    import numpy as np

    assert np.array_equal(np.asarray(got, np.float32), np.asarray(node["advantages"], np.float32))
    assert got[0] == 0.1  # shortest decimal of the float32, not 0.10000000149011612


# --------------------------------------------------------------------------- persistence


def test_file_database_persists(tmp_path):
    path = tmp_path / "db.duckdb"
    with tracedb.connect(path) as db:
        report = db.ingest(FIXTURES)
        assert report.ok
        stats = stats_without_size(db)
        views = db.branches()
        snap = content(db)
        assert db.stats()["bytes"] > 0
    assert path.exists()
    for read_only in (False, True):
        with tracedb.connect(path, read_only=read_only) as db:
            assert stats_without_size(db) == stats
            assert db.branches().equals(views)
            assert content(db) == snap
            for episode in all_episodes():
                assert_same(db.episode(episode["id"]), episode)


def test_file_database_reingest_after_reopen(tmp_path):
    path = tmp_path / "db.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "groups.traces.jsonl")
    with tracedb.connect(path) as db:
        report = db.ingest(FIXTURES)
        n_groups = len(episodes_of(FIXTURES / "groups.traces.jsonl"))
        assert report.skipped == n_groups
        assert report.traces == fixture_totals()["traces"] - n_groups
    with tracedb.connect(path, read_only=True) as db:
        assert db.stats()["traces"] == fixture_totals()["traces"]


def test_schema_version_recorded(fresh_db, tmp_path):
    rows = fresh_db.sql("SELECT key, value FROM tracedb_meta WHERE key = 'schema_version'").to_pylist()
    assert rows == [{"key": "schema_version", "value": str(tracedb.SCHEMA_VERSION)}]
    assert fresh_db.stats()["schema_version"] == tracedb.SCHEMA_VERSION == fresh_db.schema_version
    path = tmp_path / "v.duckdb"
    with tracedb.connect(path):
        pass
    with tracedb.connect(path, read_only=True) as db:
        assert db.sql("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").to_pylist() == [
            {"value": str(tracedb.SCHEMA_VERSION)}
        ]


@pytest.mark.parametrize("stored", ["999", "0"])
def test_other_schema_version_refused(tmp_path, stored):
    path = tmp_path / "old.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        db.sql(f"UPDATE tracedb_meta SET value = '{stored}' WHERE key = 'schema_version'")
    for read_only in (True, False):
        with pytest.raises(SchemaVersionError) as info:
            tracedb.connect(path, read_only=read_only)
        assert stored in str(info.value) and isinstance(info.value, tracedb.TraceDBError)
        del info
        gc.collect()
    # refusing did not rewrite the file's version
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").fetchall() == [(stored,)]
    finally:
        con.close()


def test_refused_open_does_not_keep_the_file_open(tmp_path):
    """A caller that holds on to the SchemaVersionError (logs it, re-raises it later) must
    still be able to open the file again, e.g. read-only to inspect it."""
    path = tmp_path / "old.duckdb"
    with tracedb.connect(path) as db:
        db.sql("UPDATE tracedb_meta SET value = '999' WHERE key = 'schema_version'")
    try:
        tracedb.connect(path)
    except SchemaVersionError as e:
        held = e
    con = duckdb.connect(str(path), read_only=True)
    con.close()
    assert isinstance(held, SchemaVersionError)


def test_a_large_ingest_lands_in_the_file_at_commit(tmp_path):
    """The commit of a large ingest checkpoints straight into the file (no WAL left
    behind), and the instance's checkpoint threshold is put back afterwards."""
    from tracedb.sample import write_sample

    jsonl = write_sample(tmp_path / "traces.jsonl", groups=2, tokens_per_trace=15_000, advantages=True)
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        before = db.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0]
        report = db.ingest(jsonl)
        assert report.traces == 16
        wal = Path(str(path) + ".wal")
        assert not wal.exists() or wal.stat().st_size < 64 * 1024  # not the ~2 MB of data
        assert db.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0] == before
        expected = db.branches()
    with tracedb.connect(path, read_only=True) as db:
        assert db.branches().equals(expected)


@pytest.mark.parametrize("batch_tokens", [None, 1], ids=["one-batch", "batch-per-line"])
def test_one_episode_over_two_lines_is_stored_once(fresh_db, tmp_path, knobs, batch_tokens):
    """The same episode id on two lines (its traces written in two goes): one episode row,
    both traces, whether or not the lines land in the same batch."""
    if batch_tokens is not None:
        knobs(batch_tokens=batch_tokens)
        knobs(chunk_bytes=1)  # a chunk per line
    first = one_episode("linear")
    second = renamed(first, "-second")
    second["id"] = first["id"]
    report = fresh_db.ingest(write_jsonl(tmp_path / "split.jsonl", [first, second]))
    assert report.ok, report.rejected
    assert (report.episodes, report.traces) == (1, 2)
    assert counts(fresh_db)["episodes"] == 1 and counts(fresh_db)["traces"] == 2
    ids = fresh_db.sql("SELECT DISTINCT episode_id FROM traces").column("episode_id").to_pylist()
    assert ids == [first["id"]]


def test_a_failed_insert_leaves_the_database_as_it_was(tmp_path, monkeypatch, knobs):
    """The INSERTs run on the writer thread; its failure reaches the caller, after the
    batches written before it, and the whole ingest is rolled back."""
    knobs(batch_tokens=1)
    knobs(chunk_bytes=1)  # a chunk per line
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        before = content(db)
        real = tracedb.ingest.writer.Writer._write
        calls = []

        def failing(self, inserts):
            calls.append(len(inserts))
            if len(calls) == 3:
                raise OSError("disk full (simulated)")
            real(self, inserts)

        monkeypatch.setattr(tracedb.ingest.writer.Writer, "_write", failing)
        with pytest.raises(OSError, match="simulated"):
            db.ingest(FIXTURES / "groups.traces.jsonl")
        assert len(calls) >= 3
        assert content(db) == before
        monkeypatch.setattr(tracedb.ingest.writer.Writer, "_write", real)
        report = db.ingest(FIXTURES / "groups.traces.jsonl")  # still usable
        assert report.ok and report.traces > 3
    with tracedb.connect(path, read_only=True) as db:
        assert counts(db)["traces"] == 1 + report.traces


def test_a_failing_insert_reports_its_own_error(tmp_path, monkeypatch):
    """The writer thread's INSERT error reaches the caller as itself, not as the
    "transaction is aborted" that cleaning up after it would raise."""
    import duckdb

    real = tracedb.ingest.rows.Batch.inserts

    def with_a_bad_row(batch):
        bad = pa.table({"trace_id": pa.array([None], pa.string())})
        return [
            *real(batch),
            ("_tdb_bad", "INSERT INTO traces (trace_id, record) SELECT trace_id, '{}' FROM _tdb_bad", bad),
        ]

    monkeypatch.setattr(tracedb.ingest.rows.Batch, "inserts", with_a_bad_row)
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        before = content(db)
        with pytest.raises(duckdb.ConstraintException):
            db.ingest(FIXTURES / "linear.traces.jsonl")
        assert content(db) == before
        monkeypatch.setattr(tracedb.ingest.rows.Batch, "inserts", real)
        assert db.ingest(FIXTURES / "linear.traces.jsonl").traces == 1


def test_a_failed_commit_reports_its_own_error(tmp_path, monkeypatch):
    """DuckDB ends the transaction when COMMIT fails; the ROLLBACK after it must not hide
    the commit's error behind "no transaction is active"."""
    import duckdb

    def failing_commit(db):
        db.con.execute("ROLLBACK")  # what a failed COMMIT leaves behind
        raise duckdb.ConstraintException("commit failed (simulated)")

    monkeypatch.setattr(tracedb.ingest.run, "commit_into_file", failing_commit)
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        with pytest.raises(duckdb.ConstraintException, match="simulated"):
            db.ingest(FIXTURES / "linear.traces.jsonl")
        assert counts(db)["traces"] == 0


def test_interrupted_twice_the_ingest_still_rolls_back_after_the_writer(tmp_path, monkeypatch, knobs):
    """Ctrl-C while the writer inserts, and again while ingest waits for it: the ROLLBACK
    comes only once the writer is done (an INSERT after it would autocommit)."""
    import threading
    import time

    knobs(batch_tokens=1)

    knobs(chunk_bytes=1)  # a chunk per line
    real_write, real_join = tracedb.ingest.writer.Writer._write, threading.Thread.join
    inserting = threading.Event()

    def slow_write(self, inserts):
        inserting.set()
        time.sleep(0.3)  # a large INSERT
        real_write(self, inserts)

    def join_interrupted_once(self, timeout=None):
        if self.name == "tracedb-ingest-writer" and not getattr(self, "_tdb_interrupted", False):
            self._tdb_interrupted = True
            raise KeyboardInterrupt  # the second Ctrl-C, while ingest waits for the writer
        return real_join(self, timeout)

    def interrupted_flush(*args, **kwargs):
        real_flush(*args, **kwargs)
        if inserting.is_set():
            raise KeyboardInterrupt  # the first Ctrl-C, in the parsing thread

    real_flush = tracedb.ingest.run._flush
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        before = content(db)
        monkeypatch.setattr(tracedb.ingest.writer.Writer, "_write", slow_write)
        monkeypatch.setattr(threading.Thread, "join", join_interrupted_once)
        monkeypatch.setattr(tracedb.ingest.run, "_flush", interrupted_flush)
        with pytest.raises(KeyboardInterrupt):
            db.ingest(FIXTURES / "groups.traces.jsonl")
        time.sleep(0.5)  # a writer left running would insert (and autocommit) by now
        assert content(db) == before
        assert not [t for t in threading.enumerate() if t.name == "tracedb-ingest-writer"]
        monkeypatch.undo()
        assert db.ingest(FIXTURES / "groups.traces.jsonl").ok


def test_an_ingest_that_cannot_begin_leaves_nothing_running(fresh_db):
    import threading

    import duckdb

    fresh_db.con.execute("BEGIN TRANSACTION")  # the caller's own, still open
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(duckdb.TransactionException):
        fresh_db.ingest(FIXTURES / "linear.traces.jsonl", progress=True)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
    fresh_db.con.execute("ROLLBACK")


def test_inserts_fill_whole_row_groups(tmp_path, monkeypatch, knobs):
    """Every INSERT of an ingest but the last of each table adds whole row groups, from one
    Arrow chunk (else DuckDB writes the rows again at COMMIT and the file keeps both); the
    rows held back between batches all arrive."""
    inserted: dict[str, list[tuple[int, int]]] = {}
    real = tracedb.ingest.writer.Writer._insert

    def recording(self, name, statement, table):
        inserted.setdefault(name, []).append((len(table), len(table.column(0).chunks)))
        real(self, name, statement, table)

    monkeypatch.setattr(tracedb.ingest.writer.Writer, "_insert", recording)
    knobs(batch_tokens=1)
    knobs(chunk_bytes=1)  # a batch per line
    knobs(write_alignment_rows=4)  # the fixtures are small
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        report = db.ingest(FIXTURES / "groups.traces.jsonl")
        assert report.ok
        stats = db.stats()
    assert sum(n for n, _ in inserted["_tdb_nodes"]) == stats["nodes"] == report.nodes
    assert sum(n for n, _ in inserted["_tdb_traces"]) == stats["traces"]
    assert sum(n for n, _ in inserted["_tdb_branches"]) == stats["branches"]
    assert len(inserted["_tdb_nodes"]) > 3
    for name, rows in inserted.items():
        assert all(n % 4 == 0 for n, _ in rows[:-1]), (name, rows)
        assert all(chunks == 1 for _, chunks in rows), (name, rows)
