"""Ingest: file kinds, idempotency, segment dedup, exact round trips (into a database
file, its schema version and the writer's failures: ``test_ingest_persistence.py``)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest
import zstandard

import tracedb
from tracedb.ingest import IngestReport

from support import FIXTURES
from support.ingested import (
    FIXTURE_FILES,
    all_episodes,
    assert_same,
    content,
    counts,
    episodes_of,
    fixture_totals,
    groups_head,
    one_episode,
    renamed,
    write_jsonl,
)

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


@pytest.mark.parametrize("scanner", ["always", "never"])
@pytest.mark.parametrize("batch_tokens", [None, 1], ids=["one-batch", "batch-per-line"])
def test_a_stored_trace_under_a_new_episode_id_adds_no_empty_episode(fresh_db, tmp_path, knobs, scanner, batch_tokens):
    """Re-ingesting a trace inside an episode line of another id skips the trace and adds
    no episode row (it would hold no trace); a new episode with a new trace still gets its
    row, also after such a line and in the same batch, and an empty episode line (no
    traces at all) keeps its row as before."""
    knobs(scanner=scanner)
    if batch_tokens is not None:
        knobs(batch_tokens=batch_tokens)
        knobs(chunk_bytes=1)  # a chunk per line
    old = one_episode("linear")
    fresh_db.ingest(write_jsonl(tmp_path / "a.jsonl", [old]))
    moved = json.loads(json.dumps(old))
    moved["id"] = old["id"] + "-again"  # the same trace, another episode id
    new = renamed(old, "-new")
    new["id"] = moved["id"]  # the same new episode id, now with a trace of its own
    other = renamed(one_episode("forest"), "-other")
    empty = {**renamed(old, "-empty"), "traces": []}
    bad = renamed(old, "-bad")
    bad["traces"][0]["nodes"][2]["logprobs"] = bad["traces"][0]["nodes"][2]["logprobs"][:-1]
    elsewhere = {**moved, "id": old["id"] + "-elsewhere"}  # only ever the stored trace
    lines = [moved, other, bad, elsewhere, new, empty]
    report = fresh_db.ingest(write_jsonl(tmp_path / "b.jsonl", lines))
    assert [r.line for r in report.rejected] == [3]  # the bad line is still rejected
    assert (report.traces, report.skipped, report.episodes) == (2, 2, 3)
    rows = fresh_db.sql(
        "SELECT e.episode_id, count(t.trace_id) AS n FROM episodes e LEFT JOIN traces t USING (episode_id) "
        "GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    assert rows == sorted(
        [
            {"episode_id": old["id"], "n": 1},
            {"episode_id": moved["id"], "n": 1},  # from the line of ``new``, whose trace is new
            {"episode_id": other["id"], "n": 1},
            {"episode_id": empty["id"], "n": 0},
        ],
        key=lambda r: r["episode_id"],
    )
    stored = fresh_db.sql("SELECT line FROM episodes WHERE episode_id = ?", [moved["id"]]).column("line")
    assert stored.to_pylist() == [5]
    assert fresh_db.sql(f"SELECT episode_id FROM traces WHERE trace_id = '{old['traces'][0]['id']}'").to_pylist() == [
        {"episode_id": old["id"]}
    ]
    again = fresh_db.ingest(tmp_path / "b.jsonl")  # all of it stored now: nothing added
    assert (again.traces, again.episodes) == (0, 0)


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


@pytest.mark.parametrize("rows_per_key", [0, 10**12], ids=["index", "scan"])
def test_dedup_lookups_through_the_index_or_a_scan_store_the_same(tmp_path, monkeypatch, rows_per_key):
    """Ingest finds stored traces, episodes and segments either by the key's index (a large
    table) or by scanning the key column (a small one): the same rows either way."""
    import tracedb.handle

    monkeypatch.setattr(tracedb.handle, "INDEX_ROWS_PER_KEY", rows_per_key)
    files = sorted(FIXTURES.glob("*.traces.jsonl"))
    with tracedb.connect(tmp_path / "a.duckdb") as db:
        first = db.ingest(files[:2])
        again = db.ingest(files)  # half of it stored already: skipped, segments shared
        assert again.skipped == first.traces
        counts = db.sql(
            "SELECT (SELECT count(*) FROM traces) AS t, (SELECT count(*) FROM segments) AS s, "
            "(SELECT count(DISTINCT segment_id) FROM nodes) AS used"
        ).to_pylist()[0]
        assert counts["s"] == counts["used"]  # every stored segment once, each one used
    with tracedb.connect(tmp_path / "b.duckdb") as ref:
        ref.ingest(files)
        assert ref.sql("SELECT count(*) AS t FROM traces").column("t")[0].as_py() == counts["t"]
        assert ref.sql("SELECT count(*) AS s FROM segments").column("s")[0].as_py() == counts["s"]


def test_existing_reads_the_tables_size_and_finds_keys_both_ways(fresh_db, monkeypatch):
    import tracedb.handle
    from tracedb.handle import handle_of

    fresh_db.ingest(FIXTURES / "linear.traces.jsonl")
    handle = handle_of(fresh_db)
    stored = [r["trace_id"] for r in fresh_db.sql("SELECT trace_id FROM traces").to_pylist()]
    probe = [*stored, "no-such-trace"]
    segments = [r["segment_id"] for r in fresh_db.sql("SELECT segment_id FROM segment_store").to_pylist()]
    calls: list[str] = []

    class Spy:
        def __init__(self, con):
            self.con = con

        def execute(self, query, params=None):
            calls.append(query)
            return self.con.execute(query, params)

    reader = Spy(handle.cursor())
    assert handle.existing("traces", "trace_id", probe, con=reader, sql_type="VARCHAR") == set(stored)
    assert "unnest" in calls[-1]  # a small table is scanned
    monkeypatch.setattr(tracedb.handle, "INDEX_ROWS_PER_KEY", 0)
    assert handle.existing("traces", "trace_id", probe, con=reader, sql_type="VARCHAR") == set(stored)
    assert "unnest" not in calls[-1] and "?" in calls[-1]  # through the index
    sizes = [q for q in calls if "estimated_size" in q]
    assert sizes and reader.con.execute(sizes[0], ["traces"]).fetchall()[0] == (len(stored),)
    keyed = [q for q in calls if "duckdb_constraints" in q]  # asked only of a table large enough for its index
    assert keyed and reader.con.execute(keyed[0], ["traces", "trace_id"]).fetchall()[0] == (1,)
    # segment_store has no index on its key (schema 7): always scanned, whatever its size
    found = handle.existing("segment_store", "segment_id", [*segments, b"\x00" * 16], con=reader, sql_type="BLOB")
    assert found == set(segments) and "unnest" in calls[-1]
