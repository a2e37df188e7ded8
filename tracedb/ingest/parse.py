"""The parser behind the compiled scanner: one ``traces.jsonl`` line at a time, with the
pydantic contract behind it.

Ingest sends here every line the scanner (:mod:`tracedb.ingest.scanned`) does not vouch
for; :func:`parse_line` either returns the record's columns or raises a
:class:`~tracedb.errors.RecordError` that says exactly where and what is wrong.

The fast path parses a line with simdjson and takes every per-token stream straight into
numpy buffers, never as Python objects. It checks the stream layouts vectorized. When
anything looks off (a type it does not expect, a length that disagrees, bytes it cannot
account for) the line goes through the slow path instead: ``json`` plus the pydantic
models of :mod:`tracedb.records`, which either accept the record or say exactly what is
wrong. Both paths produce the same :class:`ParsedTrace` values.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pydantic
import simdjson

from tracedb import policy
from tracedb.errors import Location, RecordError
from tracedb.records import BIT, COMPACT_STREAMS, Episode, Trace

_INT32 = np.iinfo(np.int32)
_F32_MAX = float(np.finfo(np.float32).max)


class Fallback(Exception):
    """The fast path cannot vouch for this line; use the slow path."""


@dataclass
class ParsedNode:
    parent: int | None
    sampled: bool | None
    timestamp: float | None
    message: str | None  # JSON text
    role: str | None  # message.role, for queries
    semantic_parents: list[dict[str, Any]] | None
    extra: str | None  # JSON text of unknown keys
    present: int
    token_ids: np.ndarray  # int32
    n_sampled: int
    mask_prefix: int | None  # canonical mask: this many unsampled tokens, then all sampled
    mask: np.ndarray | None  # bool, only for a mask that is not canonical
    is_content: np.ndarray | None  # bool; None when the key is absent
    streams: dict[str, np.ndarray | None]  # compact float32 streams
    loss_weights: dict[str, np.ndarray] | None
    spans: list[dict[str, Any]] | None = None  # weight_versions (also in ``extra``), checked against the mask


@dataclass
class ParsedTrace:
    trace_id: str
    episode_id: str | None
    position: int
    meta: dict[str, Any]  # the trace record, its nodes (when present) None
    nodes: list[ParsedNode] = field(default_factory=list)
    block: Any = None
    """The :class:`tracedb.ingest.scanned.ScannedNodes` holding this trace's nodes (rows
    ``rows``) instead of ``nodes``."""
    rows: tuple[int, int] = (0, 0)

    @property
    def n_nodes(self) -> int:
        return len(self.nodes) if self.block is None else self.rows[1] - self.rows[0]

    @property
    def n_tokens(self) -> int:
        if self.block is None:
            return sum(len(n.token_ids) for n in self.nodes)
        lo, hi = self.rows
        return int(self.block.tok_off[hi] - self.block.tok_off[lo])


@dataclass
class ParsedLine:
    episode: dict[str, Any] | None  # the episode record without traces; None for a bare trace
    traces: list[ParsedTrace]


def _f32(values: Any) -> np.ndarray:
    with np.errstate(over="ignore"):  # out of range: inf, which the checks refuse
        return np.asarray(values, dtype=np.float64).astype(np.float32)


def _finite32(values: np.ndarray) -> np.ndarray:
    """float32 values the fast path may keep: every one finite (a float beyond the float32
    range became infinity; the slow path words it)."""
    if not np.isfinite(values).all():
        raise Fallback
    return values


def _tokens(values: Any) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64)
    if arr.size and (arr.min() < _INT32.min or arr.max() > _INT32.max):
        raise Fallback
    return arr.astype(np.int32)


# --------------------------------------------------------------------------- fast path


_EMPTY = {"i": np.zeros(0, np.int64), "d": np.zeros(0, np.float64)}


def _num(arr: Any, kind: str) -> np.ndarray:
    if not isinstance(arr, simdjson.Array):
        raise Fallback
    if not len(arr):
        return _EMPTY[kind]
    try:
        buf = np.frombuffer(arr.as_buffer(of_type=kind), dtype=np.int64 if kind == "i" else np.float64)
    except (TypeError, ValueError) as e:
        raise Fallback from e
    if len(buf) != len(arr):
        raise Fallback
    return buf


_BOOL_DROP = b"[],rueals"


def _bool_text(arr: Any) -> tuple[bytes, int, int]:
    """The minified text of a JSON list of booleans, its true and its false count."""
    if not isinstance(arr, simdjson.Array):
        raise Fallback
    text = arr.mini
    trues, falses = text.count(b"t"), text.count(b"f")
    # "true" holds one t and no f, "false" one f and no t; a string, number, null or
    # nested list breaks one of these counts.
    if trues + falses != len(arr) or text.count(b"[") != 1 or b'"' in text:
        raise Fallback
    return text, trues, falses


def _bools(arr: Any) -> np.ndarray:
    if isinstance(arr, simdjson.Array) and not len(arr):
        return np.zeros(0, bool)
    text, _, _ = _bool_text(arr)
    return np.frombuffer(text.translate(None, _BOOL_DROP), dtype=np.uint8) == ord("t")


def _mask(arr: Any) -> tuple[int, int | None, np.ndarray | None]:
    """(sampled count, canonical prefix or None, explicit mask or None)."""
    text, trues, falses = _bool_text(arr)
    if trues == 0 or text.rfind(b"f") < text.find(b"t"):
        return trues, falses, None
    return trues, None, np.frombuffer(text.translate(None, _BOOL_DROP), dtype=np.uint8) == ord("t")


def split_mask(mask: np.ndarray) -> tuple[int, int | None, np.ndarray | None]:
    """The same triple as ``_mask`` from a bool array."""
    k = int(mask.sum())
    n = len(mask)
    if k == 0 or mask[n - k :].all():
        return k, n - k, None
    return k, None, mask


def _keys(obj: Any) -> list[str]:
    """An object's keys; a key written twice falls back (simdjson's lookup gives the first
    value, Python's ``json``, and so verifiers, the last: the slow path decides)."""
    keys = list(obj.keys())
    if len(set(keys)) != len(keys):
        raise Fallback
    return keys


def _plain(value: Any) -> Any:
    if isinstance(value, simdjson.Object):
        return value.as_dict()
    if isinstance(value, simdjson.Array):
        return value.as_list()
    return value


def _fast_node(node: Any) -> tuple[ParsedNode, int]:
    """One node from the simdjson tape; returns it and the ``[`` bytes it accounts for."""
    if not isinstance(node, simdjson.Object):
        raise Fallback
    present = 0
    extra: dict[str, Any] = {}
    parent = sampled = timestamp = message = semantic = role = None
    token_ids = is_content = loss_weights = None
    n_sampled, mask_prefix, mask = 0, 0, None
    streams: dict[str, np.ndarray | None] = {}
    brackets = 0
    for key in _keys(node):
        value = node[key]
        bit = BIT.get(key)
        if bit is None:
            extra[key] = _plain(value)
            if key == "weight_versions" and not policy.typed(extra[key]):
                raise Fallback  # pydantic words it
            continue
        present |= bit
        if key == "token_ids":
            token_ids = _num(value, "i")
            brackets += 1
        elif key == "mask":
            n_sampled, mask_prefix, mask = _mask(value)
            brackets += 1
        elif key == "is_content":
            is_content = _bools(value)
            brackets += 1
        elif key == "message":
            if not isinstance(value, simdjson.Object):
                raise Fallback
            message = value.mini
            brackets += message.count(b"[")
            _keys(value)  # a repeated key (role) means its last value, as Python's json reads it
            role = value.get("role")
        elif key == "parent":
            if value is not None and (type(value) is not int or value < 0):
                raise Fallback
            parent = value
        elif key == "sampled":
            if type(value) is not bool:
                raise Fallback
            sampled = value
        elif key == "timestamp":
            if type(value) not in (int, float):
                raise Fallback
            timestamp = value
        elif key == "semantic_parents":
            if not isinstance(value, simdjson.Array):
                raise Fallback
            brackets += 1
            semantic = value.as_list() if len(value) else []
            for link in semantic:
                if (
                    type(link) is not dict
                    or type(link.get("node")) is not int
                    or type(link.get("type")) is not str
                    or link["node"] < 0
                ):
                    raise Fallback
                brackets += json.dumps(link).count("[")
        elif key == "loss_weights":
            if value is None:
                continue
            if not isinstance(value, simdjson.Object):
                raise Fallback
            loss_weights = {}
            for name in _keys(value):
                loss_weights[name] = _finite32(_f32(_num(value[name], "d")))
                brackets += 1 + name.count("[")
        else:  # a compact stream
            if value is None:
                if key == "logprobs":
                    raise Fallback  # a list, empty when unknown: pydantic words it
                streams[key] = None
                continue
            streams[key] = _finite32(_f32(_num(value, "d")))
            brackets += 1
    if message is None:
        raise Fallback  # message is required; let pydantic say so
    extra_text = None
    if extra:
        extra_text = json.dumps(extra, separators=(",", ":"))
        brackets += extra_text.count("[")
    n = 0 if token_ids is None else len(token_ids)
    if token_ids is not None and n and (token_ids.min() < _INT32.min or token_ids.max() > _INT32.max):
        raise Fallback
    parsed = ParsedNode(
        parent=parent,
        sampled=sampled,
        timestamp=timestamp,
        message=message.decode() if message is not None else None,
        role=role if isinstance(role, str) else None,
        semantic_parents=semantic,
        extra=extra_text,
        present=present,
        token_ids=np.zeros(0, np.int32) if token_ids is None else token_ids.astype(np.int32),
        n_sampled=n_sampled,
        mask_prefix=mask_prefix,
        mask=mask,
        is_content=is_content,
        streams={k: streams.get(k) for k in COMPACT_STREAMS},
        loss_weights=loss_weights,
        spans=extra.get("weight_versions"),
    )
    return parsed, brackets


def _fast_trace(trace: Any, episode_id: str | None, position: int) -> tuple[ParsedTrace, int]:
    if not isinstance(trace, simdjson.Object):
        raise Fallback
    meta: dict[str, Any] = {}
    nodes_value = None
    for key in _keys(trace):
        if key == "nodes":
            nodes_value = trace[key]
            meta[key] = None  # a placeholder in the key's place; the nodes are filled in on read
        else:
            meta[key] = _plain(trace[key])
    trace_id = meta.get("id")
    if type(trace_id) is not str:
        raise Fallback
    brackets = json.dumps(meta).count("[")
    parsed = ParsedTrace(trace_id, episode_id, position, meta)
    if "nodes" in meta:
        if not isinstance(nodes_value, simdjson.Array):  # "nodes": null is no list: pydantic words it
            raise Fallback
        brackets += 1
        for node in nodes_value:
            pn, b = _fast_node(node)
            parsed.nodes.append(pn)
            brackets += b
    try:  # the non-node part of the contract, cheap because it carries no tokens
        Trace.model_validate({**meta, "nodes": []})
    except pydantic.ValidationError as e:
        raise Fallback from e
    return parsed, brackets


def parse_fast(parser: simdjson.Parser, raw: bytes) -> ParsedLine:
    """Parse one line on the fast path; raises :class:`Fallback` when unsure."""
    try:
        doc = parser.parse(raw)
    except (ValueError, RuntimeError) as e:
        raise Fallback from e
    try:
        if not isinstance(doc, simdjson.Object):
            raise Fallback
        if "nodes" in doc and "traces" not in doc:  # a bare Trace record
            trace, brackets = _fast_trace(doc, None, 0)
            result = ParsedLine(None, [trace])
        else:
            episode: dict[str, Any] = {}
            traces_value = None
            for key in _keys(doc):
                if key == "traces":
                    traces_value = doc[key]
                    episode[key] = None  # in the key's place; the traces are filled in on read
                else:
                    episode[key] = _plain(doc[key])
            if type(episode.get("id")) is not str or not isinstance(traces_value, simdjson.Array):
                raise Fallback
            try:
                Episode.model_validate({**episode, "traces": []})
            except pydantic.ValidationError as e:
                raise Fallback from e
            brackets = json.dumps(episode).count("[") + 1
            traces = []
            for i, t in enumerate(traces_value):
                pt, b = _fast_trace(t, episode["id"], i)
                traces.append(pt)
                brackets += b
            result = ParsedLine(episode, traces)
        # Every "[" of the line must belong to an array we took apart; a nested list hidden
        # inside a numeric stream would otherwise be flattened silently.
        if raw.count(b"[") != brackets:
            raise Fallback
        return result
    except (KeyError, RecursionError) as e:  # e.g. a key holding "\u0000", a deep value
        raise Fallback from e
    finally:
        del doc


# --------------------------------------------------------------------------- slow path


def _slow_node(node: dict[str, Any]) -> ParsedNode:
    present = 0
    for key in node:
        if key in BIT:
            present |= BIT[key]
    extra = {k: v for k, v in node.items() if k not in BIT}
    lw = node.get("loss_weights")
    n_sampled, mask_prefix, mask = split_mask(np.asarray(node.get("mask", []), dtype=bool))
    return ParsedNode(
        parent=node.get("parent"),
        sampled=node.get("sampled"),
        timestamp=node.get("timestamp"),
        message=json.dumps(node["message"], separators=(",", ":"), ensure_ascii=False),
        role=node["message"].get("role") if isinstance(node["message"].get("role"), str) else None,
        semantic_parents=node.get("semantic_parents"),
        extra=json.dumps(extra, separators=(",", ":")) if extra else None,
        present=present,
        token_ids=_tokens(node.get("token_ids", [])),
        n_sampled=n_sampled,
        mask_prefix=mask_prefix,
        mask=mask,
        is_content=np.asarray(node["is_content"], dtype=bool) if "is_content" in node else None,
        streams={k: (None if node.get(k) is None else _f32(node[k])) for k in COMPACT_STREAMS},
        loss_weights=None if lw is None else {k: _f32(v) for k, v in lw.items()},
        spans=node.get("weight_versions"),
    )


def _pydantic_location(err: pydantic.ValidationError, raw: dict[str, Any]) -> tuple[Location, str]:
    first = err.errors()[0]
    loc = list(first["loc"])
    where = Location()
    unnamed = None
    traces = raw.get("traces") if "traces" in raw or "nodes" not in raw else [raw]
    if "nodes" in raw and "traces" not in raw:
        loc = ["traces", 0, *loc]
    if len(loc) >= 2 and loc[0] == "traces" and isinstance(loc[1], int):
        try:
            trace_id = traces[loc[1]].get("id")
        except (AttributeError, IndexError, TypeError):
            trace_id = None
        where.trace_id = trace_id if isinstance(trace_id, str) else None  # an id that is no string names nothing
        if where.trace_id is None and ("traces" in raw or "nodes" not in raw):
            unnamed = loc[1]  # so the message says which of the episode's traces
        loc = loc[2:]
        if len(loc) >= 2 and loc[0] == "nodes" and isinstance(loc[1], int):
            where.node = loc[1]
            loc = loc[2:]
    where.field = ".".join(str(p) for p in loc) or None
    message = first["msg"]
    if first["type"] == "value_error":
        message = message.removeprefix("Value error, ")
    if first["type"] != "missing" and "input" in first:
        shown = json.dumps(first["input"], default=str)
        message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
    if unnamed is not None:
        message += f" (in trace {unnamed} of the episode, which has no string id)"
    return where, message


def _check_types(value: Any, where: Location) -> None:
    """Values must fit the stored types: token ids int32, per-token streams float32."""
    for t in value.get("traces", []) if "traces" in value else [value]:
        for i, node in enumerate(t.get("nodes", [])):
            ids = node.get("token_ids") or []
            if ids and (min(ids) < _INT32.min or max(ids) > _INT32.max):
                value = min(ids) if min(ids) < _INT32.min else max(ids)
                raise RecordError(
                    f"token id {value} at position {ids.index(value)} does not fit int32",
                    Location(where.file, where.line, t.get("id"), i, "token_ids"),
                )
            streams = [(k, node.get(k)) for k in COMPACT_STREAMS]
            streams += [(f"loss_weights.{k}", v) for k, v in (node.get("loss_weights") or {}).items()]
            for name, values in streams:
                if not values:
                    continue
                over = np.flatnonzero(np.isinf(_f32(values)))
                if len(over):
                    k = int(over[0])
                    raise RecordError(
                        f"value {values[k]!r} at position {k} is outside the float32 range (|x| <= {_F32_MAX:.7g})",
                        Location(where.file, where.line, t.get("id"), i, f"{name}.{k}"),
                    )


_SURROGATE = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")
"""A UTF-16 surrogate written as an escape or encoded as UTF-8: maybe a lone one."""


def _lone_surrogate(value: Any, bare: bool, where: Location) -> RecordError | None:
    """Where a string of the record holds a lone surrogate (not Unicode; DuckDB refuses it)."""

    def bad(v: Any) -> bool:
        try:
            json.dumps(v, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False

    def error(trace_id: Any = None, node: int | None = None, key: str | None = None) -> RecordError:
        loc = Location(where.file, where.line, trace_id if isinstance(trace_id, str) else None, node, key)
        return RecordError("holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not Unicode text", loc)

    traces = [value] if bare else value.get("traces") or []
    if not bare:
        for key, v in value.items():
            if key != "traces" and (bad(key) or bad(v)):
                return error(key=key)
    for t in traces:
        for key, v in t.items():
            if key != "nodes" and (bad(key) or bad(v)):
                return error(t.get("id"), key=key)
        for i, node in enumerate(t.get("nodes") or []):
            for key, v in node.items():
                if bad(key) or bad(v):
                    return error(t.get("id"), i, key)
    return None


def json_object(raw: bytes | str, where: Location) -> dict[str, Any]:
    """One line's JSON object; :class:`RecordError` when it is not JSON, not an object, or
    nested deeper than Python's ``json`` reads."""
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RecordError(f"not valid JSON: {e}", where) from None
    except RecursionError:
        raise RecordError("nested too deeply to read (over ~900 levels of lists and objects)", where) from None
    if not isinstance(value, dict):
        raise RecordError(f"expected a JSON object, got {type(value).__name__}", where)
    return value


def parse_slow(raw: bytes, where: Location) -> ParsedLine:
    """Parse and validate one line with ``json`` and the pydantic models."""
    try:
        return _parse_slow(raw, where)
    except RecursionError:
        raise RecordError("nested too deeply to read (over ~900 levels of lists and objects)", where) from None


def _parse_slow(raw: bytes, where: Location) -> ParsedLine:
    value = json_object(raw, where)
    bare = "nodes" in value and "traces" not in value
    try:
        if bare:
            Trace.model_validate(value)
        else:
            Episode.model_validate(value)
    except pydantic.ValidationError as e:
        loc, message = _pydantic_location(e, value)
        loc.file, loc.line = where.file, where.line
        raise RecordError(message, loc) from None
    _check_types(value, where)
    if _SURROGATE.search(raw) and (error := _lone_surrogate(value, bare, where)) is not None:
        raise error
    traces_raw = [value] if bare else value.get("traces", [])
    episode = None if bare else {**value}
    if episode is not None and "traces" in episode:
        episode["traces"] = None  # in the key's place; the traces are filled in on read
    traces = []
    for i, t in enumerate(traces_raw):
        meta = {**t}
        nodes = meta.get("nodes")
        if "nodes" in meta:
            meta["nodes"] = None  # in the key's place; the nodes are filled in on read
        pt = ParsedTrace(t["id"], None if bare else value["id"], i, meta)
        pt.nodes = [_slow_node(n) for n in nodes or []]
        traces.append(pt)
    return ParsedLine(episode, traces)


# --------------------------------------------------------------------------- checks


def check_trace(trace: ParsedTrace, where: Location, *, allow_ragged: bool = False) -> None:
    """The layout and graph rules of the contract, on parsed columns.

    Raises :class:`RecordError` naming the node, the field and the lengths.
    ``allow_ragged`` accepts compact streams that are longer or shorter than the
    sampled-token count (verifiers' spreading drops or zero-fills them).
    """
    for i, node in enumerate(trace.nodes):
        problem = _node_problem(i, node, allow_ragged)
        if problem is not None:
            field, reason = problem
            raise RecordError(reason, Location(where.file, where.line, trace.trace_id, i, field))


def _node_problem(i: int, node: ParsedNode, allow_ragged: bool) -> tuple[str, str] | None:
    """(field, reason) of the first rule node ``i`` breaks, or None."""
    n = len(node.token_ids)
    size = len(node.mask) if node.mask is not None else node.n_sampled + node.mask_prefix
    if size != n:
        return "mask", f"mask has {size} entries but token_ids has {n}"
    if node.is_content is not None and len(node.is_content) and len(node.is_content) != n:
        return "is_content", f"is_content has {len(node.is_content)} entries but token_ids has {n}"
    k = node.n_sampled
    if not allow_ragged:
        for name, values in node.streams.items():
            if values is not None and len(values) and len(values) != k:
                return name, f"{name} has {len(values)} values but mask has {k} sampled tokens"
    for name, weights in (node.loss_weights or {}).items():
        if len(weights) != n:
            return f"loss_weights.{name}", f"loss_weights[{name!r}] has {len(weights)} values but token_ids has {n}"
    if node.spans:
        reason = policy.span_problem(node.spans, k)
        if reason is not None:
            return "weight_versions", reason
    if node.parent is not None and node.parent >= i:
        return "parent", f"parent {node.parent} is not an earlier node than {i}"
    for link in node.semantic_parents or []:
        if link["node"] >= i:
            return (
                "semantic_parents",
                f"semantic parent {link['node']} ({link['type']}) is not an earlier node than {i}",
            )
    return None


def parse_line(parser: simdjson.Parser, raw: bytes, where: Location, *, allow_ragged: bool = False) -> ParsedLine:
    """Parse and check one record; raises :class:`RecordError` when it is bad."""
    try:
        line = parse_fast(parser, raw)
    except Fallback:
        line = parse_slow(raw, where)
    for t in line.traces:
        check_trace(t, where, allow_ragged=allow_ragged)
    return line
