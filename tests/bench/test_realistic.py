"""The realistic workload (benchmarks/realistic.py) at a small size: deterministic, valid
verifiers lines with the shape it promises, a lossless round trip through tracedb, the
corpus pins' check, and the byte peers. The corpus is one package (verifiers, pinned at
0.4.0) and the vocabulary 4k, so the tokenizer trains in a second."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1")
pytest.importorskip("tokenizers")

SMALL = {"traces": 8, "tokens": 6_000, "vocab": 4_000, "packages": ("verifiers",)}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory):
    from benchmarks.realistic import RealisticWorkload
    from benchmarks.workload import build

    work = tmp_path_factory.mktemp("realistic")
    files = build(RealisticWorkload(**SMALL), work, log=lambda _: None)
    return work, files


def test_same_seed_same_bytes_other_seed_other_bytes(built, tmp_path: Path) -> None:
    from benchmarks.realistic import RealisticWorkload

    work, files = built
    again = RealisticWorkload(**SMALL)
    out = tmp_path / "again"
    out.mkdir()
    # Written afresh (not the cache), with the tokenizer and encodings cached in `work`.
    manifest = again.write(out, work, log=lambda _: None)
    assert (out / "traces.jsonl").read_bytes() == files.jsonl.read_bytes()
    assert manifest["key"] == files.manifest["key"]
    other = RealisticWorkload(**{**SMALL, "seed": 1})
    assert other.key() != again.key()
    out1 = tmp_path / "seed1"
    out1.mkdir()
    other.write(out1, work, log=lambda _: None)
    assert (out1 / "traces.jsonl").read_bytes() != files.jsonl.read_bytes()


def test_more_traces_start_with_the_smaller_run(built, tmp_path: Path) -> None:
    from benchmarks.realistic import RealisticWorkload

    work, files = built
    out = tmp_path / "more"
    out.mkdir()
    RealisticWorkload(**{**SMALL, "traces": 16}).write(out, work, log=lambda _: None)
    assert (out / "traces.jsonl").read_bytes().startswith(files.jsonl.read_bytes())


def test_lines_are_verifiers_records_of_the_promised_shape(built) -> None:
    from tokenizers import Tokenizer
    from verifiers.v1 import WireTrace
    from verifiers.v1.utils.trace_store import read_episodes

    _, files = built
    m = files.manifest
    assert m["workload"] == "realistic" and m["corpus"]["matches_pins"] and m["corpus"]["differences"] == []
    assert m["tokenizer"]["vocab_size"] == SMALL["vocab"]
    episodes = read_episodes(files.dir, WireTrace)
    assert len(episodes) == 8 and m["traces"] == 8
    tok = Tokenizer.from_str(Path(next(files.dir.parent.glob("realistic-cache/bpe-*.json"))).read_text())
    systems, tasks, forks = set(), {}, 0
    for episode in episodes:
        (trace,) = episode.traces
        nodes = trace.nodes
        systems.add(tuple(nodes[0].token_ids))
        tasks.setdefault(episode.group.id, set()).add(tuple(nodes[1].token_ids))
        forks += len(trace.branches) > 1
        assert sum(len(n.token_ids) for n in nodes) > 0.6 * SMALL["tokens"]
        rewards = [e.traces[0].rewards["resolved"].score for e in episodes if e.group.id == episode.group.id]
        mean = sum(rewards) / len(rewards)
        for n in nodes:
            assert len(n.mask) == len(n.token_ids)
            text = tok.decode(n.token_ids, skip_special_tokens=False)
            content = n.message.content
            assert content in text  # the content is the decode of its tokens, inside the template
            if n.sampled:
                k = n.mask.index(True)
                assert not any(n.mask[:k]) and all(n.mask[k:])
                assert len(n.logprobs) == len(n.token_ids) - k
                assert all(v <= 0 and round(v, 4) == v for v in n.logprobs)
                assert n.advantages == [round(trace.rewards["resolved"].score - mean, 4)] * len(n.logprobs)
                assert text.endswith("<|im_end|>")
            else:
                assert not any(n.mask) and n.logprobs == []
            if n.message.role == "tool":
                calls = [getattr(p.message, "tool_calls", None) for p in nodes]
                assert any(c and c[0].id == n.message.tool_call_id for c in calls)
    assert len(systems) == 1  # one system prompt for the run
    assert all(len(v) == 1 for v in tasks.values()) and len(tasks) == 1  # one task prompt per group
    assert forks > 0  # compaction forks


def test_round_trip_through_tracedb_and_the_byte_peers(built, tmp_path: Path) -> None:
    import tracedb
    from benchmarks.peers import measure_bytes

    _, files = built
    db_path = tmp_path / "runs.duckdb"
    with tracedb.connect(db_path) as db:
        assert db.ingest(files.jsonl).ok
    lines = files.jsonl.read_text().splitlines()
    with tracedb.connect(db_path, read_only=True) as db:
        for line in lines:
            record = json.loads(line)
            for trace in record["traces"]:
                assert db.trace(trace["id"]) == trace
            assert db.episode(record["id"]) == record
    peers = measure_bytes(files, db_path, tmp_path, log=lambda _: None)
    assert set(peers) == {
        "jsonl",
        "zstd -3",
        "zstd -19",
        "branches parquet (zstd)",
        "tables parquet (zstd 3)",
        "tables parquet (zstd 19)",
        "duckdb read_json",
        "tracedb",
    }
    assert peers["jsonl"]["bytes"] == files.jsonl.stat().st_size
    assert peers["zstd -19"]["bytes"] < peers["zstd -3"]["bytes"] < peers["jsonl"]["bytes"]
    assert peers["tracedb"]["tracedb_ratio"] == 1.0 and "passed" in peers["zstd -19"]


def test_a_pinned_file_that_differs_is_named(tmp_path: Path) -> None:
    from benchmarks import corpus

    pins = json.loads(corpus.PINS.read_text())
    entry = pins["packages"]["verifiers"]
    first = sorted(entry["files"])[0]
    entry["files"][first] = hashlib.sha256(b"other").hexdigest()
    entry["files"]["v1/not_there.py"] = hashlib.sha256(b"x").hexdigest()
    entry["version"] = "0.0.1"
    path = tmp_path / "pins.json"
    path.write_text(json.dumps(pins))
    c = corpus.load(path, packages=("verifiers",))
    assert not c.matches_pins
    text = "\n".join(c.differences)
    assert f"verifiers/{first}: content differs" in text
    assert "verifiers/v1/not_there.py: pinned, not readable here" in text
    assert "verifiers: version 0.4.0 installed, the pins are of 0.0.1" in text
    assert c.hash != corpus.load(packages=("verifiers",)).hash or c.pinned_hash != c.hash
    with pytest.raises(ValueError, match="not pinned"):
        corpus.load(packages=("no-such-package",))


def test_the_workload_option_selects_the_realistic_workload() -> None:
    from benchmarks.__main__ import parse_args
    from benchmarks.realistic import RealisticWorkload
    from benchmarks.workload import Workload, make

    args = parse_args(["--quick", "--workload", "realistic"])
    assert args.workload == "realistic" and args.results.name == "results-realistic.json"
    assert (
        parse_args(["batches", "--quick", "--workload", "realistic"]).results.name == "results-batches-realistic.json"
    )
    assert parse_args(["--quick"]).workload == "core" and parse_args(["--quick"]).results.name == "results.json"
    assert isinstance(make("realistic", traces=8, tokens=3000), RealisticWorkload)
    assert isinstance(make("core", traces=8, tokens=3000), Workload)
    with pytest.raises(SystemExit):
        parse_args(["--workload", "nope"])
