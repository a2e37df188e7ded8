"""Fixture records and what an ingest stored, for the ingest tests: the fixture episodes,
type-exact comparison, and every row of every table."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import tracedb

from support import FIXTURES

TABLES = ("tracedb_meta", "episodes", "traces", "segments", "nodes", "branches", "rejects")
FIXTURE_FILES = sorted(FIXTURES.glob("*.traces.jsonl"))


# --------------------------------------------------------------------------- helpers


def episodes_of(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSONL file, parsed."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def one_episode(name: str = "linear") -> dict[str, Any]:
    """The one episode of the fixture ``name``."""
    (episode,) = episodes_of(FIXTURES / f"{name}.traces.jsonl")
    return episode


def all_episodes() -> list[dict[str, Any]]:
    """Every episode of every fixture file."""
    return [e for f in FIXTURE_FILES for e in episodes_of(f)]


def canon(value: Any) -> str:
    """Type-exact form: equal only if ints stay ints, floats floats, None None."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def assert_same(got: Any, want: Any) -> None:
    assert got == want
    assert canon(got) == canon(want)


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """``records`` as the lines of ``path`` (UTF-8, not ASCII-escaped)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def counts(db: tracedb.Database) -> dict[str, int]:
    """The number of rows of every table."""
    return {t: db.sql(f"SELECT count(*) AS n FROM {t}").column("n")[0].as_py() for t in TABLES}


def content(db: tracedb.Database) -> dict[str, list[str]]:
    """Every row of every table, order-independent."""
    return {t: sorted(repr(r) for r in db.sql(f"SELECT * FROM {t}").to_pylist()) for t in TABLES}


def stats_without_size(db: tracedb.Database) -> dict[str, Any]:
    """``db.stats()`` without its ``bytes`` (a file's size changes as it is written)."""
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
    """Episodes, traces, nodes and tokens over every fixture file."""
    eps = all_episodes()
    traces = [t for e in eps for t in e["traces"]]
    nodes = [n for t in traces for n in t["nodes"]]
    return {
        "episodes": len(eps),
        "traces": len(traces),
        "nodes": len(nodes),
        "tokens": sum(len(n.get("token_ids", [])) for n in nodes),
    }
