"""Input fuzz: mutated fixture lines between good ones, through both parse paths.

Every mutated line is a fixture record under fresh ids, changed one way (seeded, see
``TRACEDB_FAULT_SEED``): cut at a random byte, random bytes replaced, a field of an
episode, trace or node given a value of the wrong JSON type, non-finite and huge numbers,
deep nesting, long strings, bad UTF-8, lone surrogate escapes, duplicate keys, forward
parents and cycles, lengths that disagree. Each category is one file (a few good lines,
the mutated lines between them), ingested with the compiled scanner (``always``) and with
the parser alone (``never``).

What a line must come to is decided without tracedb (:func:`support.faults.verdict`):
Python's ``json`` and the verifiers model (:class:`tracedb.records.Episode` / ``Trace``),
then the rules tracedb adds to the model (``tracedb/ingest/parse.py``: int32 token ids,
float32 stream values, no lone surrogates, lines up to ``max_line_bytes``, the layout
rules of ``check_trace``), in the order tracedb checks them, which names the field. Each
line is also ingested alone: in a file of its own, into a fresh database per test and
path (one ingest call reads those files). Then, per file and path: ``ingest`` raises nothing; each line
is rejected (file, line, field, node) exactly when the verdict says so, alone and in the
file alike, and both paths agree on every line (reason included); the ``rejects`` table
has one row per rejected line; every kept line's traces are there and ``db.trace`` equals
that of the line ingested alone; ``strict=True`` raises only :class:`TraceDBError` and
leaves the database as it was; ``tracedb ingest`` exits 1, or 0 on the kept lines alone.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import runtime
from tracedb.cli.main import app
from tracedb.errors import TraceDBError
from tracedb.records import COMPACT_STREAMS, Episode

from support.faults import Verdict, base_seed, contents, verdict
from support.ingested import FIXTURE_FILES, renamed

SEED = base_seed()
LIMIT = 128 << 10
KNOBS = {"max_line_bytes": LIMIT, "chunk_bytes": 1 << 16}
"""Every ingest here: lines over 128 KiB are rejected unread; 64 KiB chunks (a long line
spans several reads)."""
PATHS = ("always", "never")
BASE = [line for f in FIXTURE_FILES for line in f.read_bytes().splitlines() if line.strip()]
GOOD_PER_FILE = 8


def _mutable(line: bytes) -> bool:
    return any(i and sum(n.get("mask", [])) for i, n in enumerate(json.loads(line)["traces"][0]["nodes"]))


MUTABLE = [line for line in BASE if _mutable(line)]
"""The records mutations start from: a sampled node beside the root."""

# --------------------------------------------------------------------------- mutations


class Record:
    """A fixture record under fresh ids, changed as JSON; raw text goes in at markers."""

    def __init__(self, rng: random.Random, tag: str) -> None:
        self.rng = rng
        self.value = renamed(json.loads(rng.choice(MUTABLE)), f"-{tag}")
        self.subs: dict[str, tuple[bytes, str]] = {}
        t = self.value["traces"][0]
        self.i = rng.choice([i for i, n in enumerate(t["nodes"]) if i and sum(n["mask"])])
        n, k, size = t["nodes"][self.i], sum(t["nodes"][self.i]["mask"]), len(t["nodes"][self.i]["token_ids"])
        # every optional structure present (and valid) on node i, so that every path resolves
        n["semantic_parents"] = n.get("semantic_parents") or [{"node": 0, "type": "compaction"}]
        for s in COMPACT_STREAMS:
            n[s] = n.get(s) or [round(-0.25 * (j + 1), 2) for j in range(k)]
        n["loss_weights"] = n.get("loss_weights") or {"w": [1.0] * size}
        n["is_content"] = n.get("is_content") or [True] * size
        n["timestamp"] = n.get("timestamp") or 1.5
        t["rewards"] = t.get("rewards") or {"r": {"score": 1.0, "weight": 1.0}}
        self.value["group"] = self.value.get("group") or {"id": "g-fuzz"}

    def mark(self, raw: bytes | str, kind: str = "value") -> str:
        """A placeholder for ``raw`` JSON text: a ``value``, ``inside`` a string, or a ``key`` (with its value)."""
        token = f"\x00M{len(self.subs)}\x00"
        self.subs[token] = (raw.encode() if isinstance(raw, str) else raw, kind)
        return token

    def locate(self, path: str) -> tuple[Any, Any]:
        """(container, key) of a path: ``@`` is node i, ``#`` a random index, ``$`` the first key."""
        cur: Any = self.value
        keys: list[Any] = []
        for part in path.split("."):
            if keys:
                cur = cur[keys[-1]]
            key: Any = part
            if part == "@":
                key = self.i
            elif part == "#":
                key = self.rng.randrange(len(cur))
            elif part == "$":
                key = next(iter(cur))
            elif part.isdigit():
                key = int(part)
            keys.append(key)
        return cur, keys[-1]

    def set(self, path: str, value: Any) -> None:
        """``value`` at ``path``; a function is called with the record first (``lambda r: r.i``)."""
        container, key = self.locate(path)
        container[key] = value(self) if callable(value) else value

    def node(self, i: int | None = None) -> dict[str, Any]:
        return self.value["traces"][0]["nodes"][self.i if i is None else i]

    def dumps(self) -> bytes:
        text = json.dumps(self.value).encode()
        for token, (raw, kind) in self.subs.items():
            esc = json.dumps(token)[1:-1].encode()
            target = {"value": b'"' + esc + b'"', "inside": esc, "key": b'"' + esc + b'": 0'}[kind]
            assert text.count(target) == 1, (token, kind)
            text = text.replace(target, raw)
        return text


N = "traces.0.nodes.@"
T = "traces.0"
TYPE_PATHS = [
    *("id", "group", "group.id", "ok", "traces", T, f"{T}.version", f"{T}.id", f"{T}.nodes", f"{T}.rewards"),
    *(f"{T}.rewards.$", f"{T}.rewards.$.score", f"{T}.rewards.$.weight", f"{T}.ok", f"{T}.is_completed"),
    *(f"{T}.stop_condition", f"{T}.is_timeout", f"{T}.info", N, f"{N}.parent", f"{N}.semantic_parents"),
    *(f"{N}.semantic_parents.#", f"{N}.semantic_parents.#.node", f"{N}.semantic_parents.#.type", f"{N}.message"),
    *(f"{N}.message.role", f"{N}.sampled", f"{N}.timestamp", f"{N}.token_ids", f"{N}.token_ids.#", f"{N}.mask"),
    *(f"{N}.mask.#", f"{N}.is_content", f"{N}.is_content.#", f"{N}.logprobs", f"{N}.logprobs.#"),
    *(f"{N}.advantages", f"{N}.advantages.#", f"{N}.reference_logprobs.#", f"{N}.trainer_logprobs"),
    *(f"{N}.entropies.#", f"{N}.loss_weights", f"{N}.loss_weights.$", f"{N}.loss_weights.$.#", f"{N}.x_extra"),
    *(f"{N}.reference_logprobs", f"{N}.trainer_logprobs.#", f"{N}.entropies"),
]
WRONG = {"string": "x", "list": [1, "a"], "object": {"a": 1}, "null": None, "bool": True, "huge": 2**70, "float": 1.5}
NUMBER_PATHS = [f"{N}.logprobs.#", f"{N}.token_ids.#", f"{N}.timestamp", f"{T}.rewards.$.score"]
MORE_NUMBER_PATHS = [f"{N}.advantages.#", f"{N}.entropies.#", f"{N}.loss_weights.$.#", f"{T}.rewards.$.weight"]
MORE_NUMBER_PATHS += [f"{N}.parent", f"{T}.version", f"{N}.semantic_parents.#.node"]
NUMBERS = ["NaN", "Infinity", "-Infinity", "1e39", "-1e39", "1e400", "-1e400", "1e308", "1e-50", "-0.0"]
NUMBERS += ["3.4028235677973366e38", "3.4028235677973362e38", "2147483648", "-2147483649", "2147483647"]
BAD_UTF8 = [
    b"\xff",
    b"\xc3\x28",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xc0\xaf",
    b"\xe2\x82",
    b"\xed\xa0\xbd\xed\xb8\x80",
]
GOOD_UTF8 = [b"\xe2\x82\xac", b"\xf0\x9f\x98\x80"]
ESCAPES = ["\\ud800", "\\udfff", "\\ude00\\ud83d", "\\ud83dx", "\\uD800", "\\ud83d\\ude00"]
Mutation = Callable[[Record], bytes]


def _set(path: str, value: Any) -> Mutation:
    return lambda r: (r.set(path, value), r.dumps())[1]


def _text(path: str, raw: bytes | str, kind: str = "value") -> Mutation:
    def mutate(r: Record) -> bytes:
        if kind == "inside":  # into the string at path
            container, key = r.locate(path)
            container[key] = f"left {r.mark(raw, 'inside')} right"
        elif kind == "key":  # an extra key in the object at path
            container, key = r.locate(path)
            container[key][r.mark(raw, "key")] = 0
        else:
            r.set(path, r.mark(raw))
        return r.dumps()

    return mutate


def _raw(change: Callable[[random.Random, bytes], bytes]) -> Mutation:
    return lambda r: change(r.rng, r.dumps())


def _cut(rng: random.Random, raw: bytes) -> bytes:
    return raw[: rng.randrange(1, len(raw))]


def _flip(rng: random.Random, raw: bytes) -> bytes:
    """1-3 bytes replaced: half of them by printable ASCII (which keeps more lines JSON),
    the others by any byte but a line break."""
    data = bytearray(raw)
    for _ in range(rng.randint(1, 3)):
        pool = range(32, 127) if rng.random() < 0.5 else [b for b in range(256) if b not in (10, 13)]
        data[rng.randrange(len(data))] = rng.choice(pool)
    return bytes(data)


def _nest(depth: int, obj: bool = False) -> str:
    return '{"a":' * depth + "0" + "}" * depth if obj else "[" * depth + "]" * depth


def _dup(where: str, key: str, value: str, first: bool) -> Mutation:
    """``key`` written twice in the object at ``where``: ``value`` first (the record's wins) or last."""

    def mutate(r: Record) -> bytes:
        marker = r.mark(f'"{key}": {value}', "key")
        if not where:
            r.value = {marker: 0, **r.value} if first else {**r.value, marker: 0}
            return r.dumps()
        container, k = r.locate(where)
        obj = container[k]
        container[k] = {marker: 0, **obj} if first else {**obj, marker: 0}
        return r.dumps()

    return mutate


def _graph(change: Callable[[Record], None]) -> Mutation:
    return lambda r: (change(r), r.dumps())[1]


def _n(r: Record) -> int:
    return len(r.value["traces"][0]["nodes"])


def _more_true(r: Record) -> None:
    mask = r.node()["mask"]
    mask[mask.index(False) if False in mask else 0] = True


def _cycle(r: Record) -> None:
    if _n(r) > r.i + 1:
        r.node(r.i + 1)["parent"] = r.i
    r.node()["parent"] = r.i + 1


def categories() -> dict[str, list[Mutation]]:
    cats: dict[str, list[Mutation]] = {
        "truncate": [_raw(_cut)] * 15,
        "flip": [_raw(_flip)] * 40,
        "types_episode_trace": [_set(p, v) for p in TYPE_PATHS[:18] for v in WRONG.values()],
        "types_node": [_set(p, v) for p in TYPE_PATHS[18:] for v in WRONG.values()],
        "numbers": [_text(p, x) for p in NUMBER_PATHS for x in NUMBERS]
        + [_text(p, x) for p in MORE_NUMBER_PATHS for x in NUMBERS[::3]],
        "nesting": [_text(f"{N}.message.content", _nest(d)) for d in (300, 600, 5000)]
        + [_text(f"{N}.x_deep", _nest(5000, obj=True)), _text(f"{N}.token_ids.#", _nest(5000))]
        + [_text(f"{T}.info", _nest(300, obj=True)), _text("x_deep", _nest(5000))],
        "strings": [_set(f"{N}.message.content", "a" * n) for n in (100_000, 200_000, 1_000_000)]
        + [_text(f"{N}.message.content", "é".encode() * 50_000, "inside"), _set(f"{T}.id", "t" * 10_000)]
        + [_text(N, f'"{"k" * 50_000}": 1', "key")],
        "utf8": [_text(f"{N}.message.content", b, "inside") for b in BAD_UTF8 + GOOD_UTF8]
        + [_text(N, b'"x\xffy": 1', "key"), _text(f"{T}.id", BAD_UTF8[2], "inside")],
        "surrogates": [_text(f"{N}.message.content", e, "inside") for e in ESCAPES]
        + [_text(N, f'"{ESCAPES[0]}": 1', "key"), _text(f"{T}.id", ESCAPES[1], "inside")]
        + [_text("id", ESCAPES[2], "inside"), _text(f"{N}.loss_weights", f'"{ESCAPES[0]}": []', "key")]
        + [_text(f"{T}.info", ESCAPES[5], "inside"), _text("x_extra", ESCAPES[3], "inside")],
        "duplicate_keys": [
            *(_dup(N, "parent", "999", first=True), _dup(N, "parent", "999", first=False)),
            *(_dup(f"{N}.message", "role", '"tool"', first=False), _dup(N, "message", '"x"', first=True)),
            *(_dup(T, "id", '"dup-id"', first=False), _dup("", "traces", "[]", first=False)),
            *(_dup(N, "token_ids", "[1]", first=False), _dup(N, "token_ids", "[1]", first=True)),
            _dup("", "id", "7", first=True),
        ],
        "graph": [
            *(_set(f"{N}.parent", lambda r: r.i), _graph(_cycle), _graph(lambda r: r.node().update(parent=_n(r) + 3))),
            *(_set(f"{N}.parent", -1), _set(f"{N}.parent", 1.0), _set(f"{N}.parent", True)),
            _graph(lambda r: r.node().update(parent=None)),  # a second root: a forest, fine
            _graph(lambda r: r.node().update(parent=r.i - 1)),  # another earlier parent: fine
            *(_graph(lambda r: r.node().update(semantic_parents=[{"node": r.i, "type": "compaction"}])),),
            *(_graph(lambda r: r.node().update(semantic_parents=[{"node": r.i + 1, "type": "x"}])),),
            _set(f"{N}.semantic_parents", [{"node": -1, "type": "x"}]),
            _graph(lambda r: r.node(0).update(parent=0)),
        ],
        "lengths": [
            *(_graph(lambda r: r.node()["token_ids"].append(7)), _graph(lambda r: r.node()["token_ids"].pop())),
            *(_graph(lambda r: r.node()["mask"].append(True)), _graph(lambda r: r.node()["mask"].pop())),
            *(_graph(lambda r: r.node()["logprobs"].append(-1.0)), _graph(lambda r: r.node()["logprobs"].pop())),
            *(
                _graph(lambda r: r.node()["trainer_logprobs"].append(0.5)),
                _graph(lambda r: r.node()["is_content"].pop()),
            ),
            *(_graph(lambda r: next(iter(r.node()["loss_weights"].values())).pop()), _graph(_more_true)),
            *(_set(f"{N}.logprobs", []), _set(f"{N}.advantages", []), _set(f"{N}.mask", None)),
            _graph(lambda r: r.node().update(mask=[False] * len(r.node()["token_ids"]))),
        ],
    }
    return cats


# --------------------------------------------------------------------------- ingesting


@dataclass
class Outcome:
    rejects: dict[tuple[str, int], tuple[str | None, int | None, str]]
    """(file, line) -> (field, node, reason)."""
    records: dict[str, str]
    """Trace id -> ``db.trace`` as canonical JSON."""


def canonical(record: Any) -> str:
    return json.dumps(record, sort_keys=True, ensure_ascii=False)


def run(db: tracedb.Database, paths: list[Path], mode: str, trace_ids: list[str], strict: bool = False) -> Outcome:
    """Ingest ``paths`` into ``db`` with parse path ``mode``: the rejects, the records of those
    of ``trace_ids`` that these files added."""
    with runtime.configure(scanner=mode, **KNOBS):
        report = db.ingest(paths, strict=strict)  # any exception fails the test with its traceback
    rejects = {}
    for r in report.rejected:
        assert r.file is not None and r.line is not None, r
        assert (r.file, r.line) not in rejects, f"{r.file}:{r.line} rejected twice"
        rejects[r.file, r.line] = (r.field, r.node, r.reason)
    sources = [str(p) for p in paths]
    query = "SELECT trace_id FROM traces WHERE source IN (SELECT unnest(?::VARCHAR[]))"
    present = {row[0] for row in db.con.execute(query, [sources]).fetchall()}
    return Outcome(rejects, {t: canonical(db.trace(t)) for t in trace_ids if t in present})


def ingest_alone(lines: list[bytes], mode: str, verdicts: dict[int, Verdict], root: Path) -> dict[bytes, Outcome]:
    """Each line by itself, in a file of its own, into a fresh database (one ingest call
    reads them all, each file on its own): line -> its outcome (its reject, its records)."""
    root.mkdir(exist_ok=True)
    files = {line: root / f"{mode}-{hashlib.sha256(line).hexdigest()[:24]}.jsonl" for line in lines}
    for line, path in files.items():
        path.write_bytes(line + b"\n")
    ids = [t for v in verdicts.values() for t in v.traces]
    with tracedb.connect(":memory:") as db:
        outcome = run(db, list(dict.fromkeys(files.values())), mode, ids)
    by_file = {str(path): line for line, path in files.items()}
    return {
        line: Outcome({k: v for k, v in outcome.rejects.items() if by_file[k[0]] == line}, outcome.records)
        for line in lines
    }


def build(category: str, mutations: list[Mutation]) -> tuple[list[bytes], set[int]]:
    """The category's file: good lines with the mutated lines between them; which are mutated."""
    rng = random.Random(f"{SEED}:{category}")
    mutated = [m(Record(rng, f"{category}{k}")) for k, m in enumerate(mutations)]
    goods = rng.sample(BASE, GOOD_PER_FILE)
    lines, which, step = [goods[0]], set(), -(-len(mutated) // (GOOD_PER_FILE - 1))
    for g in range(1, GOOD_PER_FILE):
        for line in mutated[(g - 1) * step : g * step]:
            which.add(len(lines) + 1)
            lines.append(line)
        lines.append(goods[g])
    return lines, which


@pytest.mark.parametrize("category", list(categories()))
def test_fuzz(category: str, tmp_path: Path) -> None:
    print(f"seed {SEED}, category {category}")
    lines, mutated = build(category, categories()[category])
    path = tmp_path / f"{category}.traces.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    verdicts = {k + 1: verdict(line, LIMIT) for k, line in enumerate(lines)}
    assert all(verdicts[k].accepted for k in verdicts if k not in mutated), "a good line is refused: the oracle is off"
    kept = [t for v in verdicts.values() if v.accepted for t in v.traces]
    outcomes = {}
    problems: list[str] = []
    for mode in PATHS:
        with tracedb.connect(":memory:") as db:
            outcome = outcomes[mode] = run(db, [path], mode, kept)
            stored = db.sql("SELECT source, line FROM rejects ORDER BY line").to_pylist()
            assert [(r["source"], r["line"]) for r in stored] == sorted(outcome.rejects), "rejects table != rejects"
        singles = ingest_alone(lines, mode, verdicts, tmp_path / "alone")
        for k, line in enumerate(lines, 1):
            v, got, single = verdicts[k], outcome.rejects.get((str(path), k)), singles[line]
            by_itself = next(iter(single.rejects.values()), None)
            where = f"{mode} line {k} ({line[:120]!r}{'...' if len(line) > 120 else ''})"
            want = None if v.accepted else (v.field, v.node)
            if (got and got[:2]) != want or (by_itself and by_itself[:2]) != want:
                problems.append(f"{where}: verdict {want}, in the file {got}, alone {by_itself}")
            for t in v.traces:
                if t not in outcome.records:
                    problems.append(f"{where}: trace {t} of a kept line is not in the database")
                elif outcome.records[t] != single.records.get(t):
                    problems.append(f"{where}: trace {t} differs from the line ingested alone")
    for key in set(outcomes["always"].rejects) | set(outcomes["never"].rejects):
        a, b = outcomes["always"].rejects.get(key), outcomes["never"].rejects.get(key)
        if a != b:
            problems.append(f"line {key[1]}: the paths disagree: scanner {a}, parser {b}")
    assert outcomes["always"].records == outcomes["never"].records, "the paths store different records"
    assert not problems, f"seed {SEED}, {category}:\n" + "\n".join(problems[:40])
    check_strict(path, bool(outcomes["always"].rejects))
    check_cli(path, tmp_path, lines, verdicts)


def check_strict(path: Path, rejected: bool) -> None:
    """``strict=True`` on a database holding data: only TraceDBError, nothing written."""
    for mode in PATHS:
        with tracedb.connect(":memory:") as db:
            db.ingest(FIXTURE_FILES[0])
            before = contents(db)
            with runtime.configure(scanner=mode, **KNOBS):
                try:
                    db.ingest(path, strict=True)
                    raised = False
                except TraceDBError:
                    raised = True
            assert raised == rejected, f"{mode}: strict raised {raised}, rejects {rejected}"
            if raised:
                assert contents(db) == before, f"{mode}: a strict ingest that failed wrote something"


def check_cli(path: Path, tmp_path: Path, lines: list[bytes], verdicts: dict[int, Verdict]) -> None:
    """``tracedb ingest``: exit 1 with rejects; 0 for the kept lines alone."""
    good = tmp_path / "kept.traces.jsonl"
    good.write_bytes(b"".join(line + b"\n" for k, line in enumerate(lines, 1) if verdicts[k].accepted))
    runner = CliRunner()
    expected_rejects = sum(not v.accepted for v in verdicts.values())
    with runtime.configure(**KNOBS):
        for source, code, db in ((path, 1 if expected_rejects else 0, "a.duckdb"), (good, 0, "b.duckdb")):
            result = runner.invoke(app, ["ingest", str(source), "--db", str(tmp_path / db), "--json"])
            assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
            assert result.exit_code == code, (source.name, result.exit_code, result.output[-2000:])
            report = json.loads(result.stdout)
            assert len(report["rejected"]) == (expected_rejects if source == path else 0)


STRICTER = {
    "a stream value beyond float32": (lambda r: r.node()["logprobs"].__setitem__(0, 1e39), "logprobs.0"),
    "a token id beyond int32": (lambda r: r.node()["token_ids"].__setitem__(0, 2**31), "token_ids"),
    "a lone surrogate": (lambda r: r.node()["message"].update(content="\ud800"), "message"),
    "a parent that is not earlier": (lambda r: r.node().update(parent=r.i), "parent"),
    "logprobs longer than the sampled count": (lambda r: r.node()["logprobs"].append(0.0), "logprobs"),
}


@pytest.mark.parametrize("case", list(STRICTER))
def test_the_verdict_is_stricter_than_the_model_where_tracedb_is(case: str) -> None:
    """The verdict refuses what the verifiers model takes but tracedb cannot store."""
    r = Record(random.Random(SEED), "oracle")
    assert verdict(json.dumps(r.value).encode(), LIMIT).accepted
    change, field = STRICTER[case]
    change(r)
    Episode.model_validate(r.value)  # the model takes it
    assert verdict(json.dumps(r.value).encode(), LIMIT) == Verdict(False, field, r.i)
