"""Rows of one ingest batch: the records of both parse paths turned into the stored tables.

A :class:`Batch` collects accepted lines (``pending``), then, once ingest has left out
what the database already holds, the rows of the fresh episodes, traces, nodes,
segments and branches; :meth:`Batch.inserts` builds their Arrow tables, each in its
stored schema (:mod:`tracedb.tables`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from tracedb import policy, tables
from tracedb.graph import branch_paths
from tracedb.ingest.columns import numpy_lists, segment_key
from tracedb.ingest.parse import ParsedLine, ParsedNode, ParsedTrace
from tracedb.ingest.tags import Tag, TagRow, tag_rows
from tracedb.records import COMPACT_STREAMS, WEIGHT_VERSIONS_BIT, trace_reward

if TYPE_CHECKING:
    from tracedb.handle import Numbering
    from tracedb.ingest.scanned import ScannedNodes

Insert = tuple[str, pa.Table]
"""One INSERT of a batch: the table written and its rows (every column but those DuckDB
fills from their default)."""


def work_of(episode: dict[str, Any] | None) -> dict[str, Any]:
    """The ``episodes`` columns of an episode's ``run`` (already checked against the model):
    the work type (a run of type ``eval`` without work is ``eval``), step and policy span."""
    run = (episode or {}).get("run")
    out: dict[str, Any] = {"work_type": None, "work_step": None, "policy_start": None, "policy_end": None}
    if not isinstance(run, dict):
        return out
    work = run.get("work")
    if isinstance(work, dict):
        span = work.get("policy") if isinstance(work.get("policy"), dict) else {}
        out.update(
            work_type=work.get("type"),
            work_step=work.get("step"),
            policy_start=span.get("start"),
            policy_end=span.get("end"),
        )
    elif run.get("type") == "eval":
        out["work_type"] = "eval"
    return out


def spans_in(extra: str | None) -> list[dict[str, Any]] | None:
    """The ``weight_versions`` of a node's unknown fields (JSON text), None when it has none."""
    if not extra or '"weight_versions"' not in extra:
        return None
    value = json.loads(extra).get("weight_versions")
    return value if isinstance(value, list) else None


def split_weight_versions(nodes: pa.Table) -> pa.Table:
    """``nodes`` with each node's ``weight_versions`` moved out of ``extra`` into its own
    column (its present bit set; an explicit null kept as a null with the bit). Spans
    carrying keys beyond version/start/end stay in ``extra`` too, so the record reads back
    as written; the column holds their three fields either way."""
    extra = nodes.column("extra")
    rows = holding(extra, b'"weight_versions"')
    if not rows:
        return nodes
    texts = extra.to_pylist()
    present = nodes.column("present").to_numpy().copy()
    spans: list[Any] = [None] * nodes.num_rows
    for r in rows:
        fields = json.loads(texts[r])
        if "weight_versions" not in fields:
            continue
        value = fields["weight_versions"]
        present[r] |= WEIGHT_VERSIONS_BIT
        if value is not None:
            spans[r] = [{k: s[k] for k in policy.SPAN_KEYS} for s in value]
        if value is None or all(len(s) == len(policy.SPAN_KEYS) for s in value):
            del fields["weight_versions"]
            texts[r] = json.dumps(fields, separators=(",", ":")) if fields else None
    nodes = nodes.set_column(nodes.schema.get_field_index("extra"), "extra", pa.array(texts, pa.string()))
    nodes = nodes.set_column(nodes.schema.get_field_index("present"), "present", pa.array(present, pa.int32()))
    index = nodes.schema.get_field_index("weight_versions")
    return nodes.set_column(index, "weight_versions", pa.array(spans, tables.WEIGHT_VERSIONS))


def holding(column: pa.ChunkedArray, needle: bytes) -> list[int]:
    """The rows of a string column whose (non-null) value contains ``needle``, read off
    the column's buffers (a search of its bytes, its offsets to map the hits to rows):
    the ingest path imports no ``pyarrow.compute`` for it (~40 ms of a process)."""
    pattern = re.compile(b"(?=" + re.escape(needle) + b")")  # every start, overlapping ones too
    rows: list[int] = []
    base = 0
    for chunk in column.chunks:
        if len(chunk) and chunk.null_count < len(chunk):
            validity, offsets_buffer, data = chunk.buffers()
            wide = pa.types.is_large_string(chunk.type)
            offsets = np.frombuffer(offsets_buffer, np.int64 if wide else np.int32)[
                chunk.offset : chunk.offset + len(chunk) + 1
            ]
            lo, hi = int(offsets[0]), int(offsets[-1])
            starts = [m.start() for m in pattern.finditer(memoryview(data)[lo:hi])] if data is not None else []
            if starts:
                at = np.asarray(starts, np.int64) + lo
                row = np.searchsorted(offsets, at, side="right") - 1
                inside = at + len(needle) <= offsets[row + 1]  # not across two values
                found = np.unique(row[inside])
                if validity is not None:
                    found = found[[chunk[int(r)].is_valid for r in found]]
                rows.extend((found + base).tolist())
        base += len(chunk)
    return rows


def _compact(meta: dict[str, Any]) -> str:
    return json.dumps(meta, separators=(",", ":"))


class Batch:
    """Rows buffered for one flush to DuckDB."""

    def __init__(
        self, numbering: Numbering | None = None, tags: Sequence[Tag] = (), mapping: dict[str, int] | None = None
    ) -> None:
        self.mapping = mapping or {}
        """Weight labels mapped to policy versions (``policy_labels``) when the ingest began."""
        self.numbering = numbering
        """Where fresh traces get their sequence numbers (:meth:`tracedb.handle.Handle.numbering`)."""
        self.tags = tags
        self.tag_rows: list[TagRow] = []
        self.pending: list[tuple[ParsedLine, str, int]] = []
        """Accepted lines (record, file, line number), not yet checked against the database."""
        self.tokens = 0
        self.episodes: list[dict[str, Any]] = []
        self.traces: list[dict[str, Any]] = []
        self.parsed_nodes: list[tuple[str, int, ParsedNode, bytes]] = []
        """Nodes of the fallback parser: (trace id, node index, node, segment id)."""
        self.scanned: dict[int, tuple[ScannedNodes, list[np.ndarray]]] = {}
        """Per scanned chunk (by id): its nodes and the row ranges of its fresh traces."""
        self.branches: list[tuple[str, int, int, bool, list[int], int, int]] = []
        self.segments: dict[bytes, np.ndarray] = {}

    def _bounds(self, t: ParsedTrace, default: int | None) -> tuple[int | None, int | None, int]:
        """The trace's policy-version bounds (:func:`tracedb.policy.trace_bounds`)."""
        if t.block is None:
            nodes = [(n.n_sampled, n.spans) for n in t.nodes]
        else:
            lo, hi = t.rows
            sampled = t.block.n_sampled[lo:hi].tolist()
            extras = t.block.extra.slice(lo, hi - lo).to_pylist()
            nodes = [(k, spans_in(x)) for k, x in zip(sampled, extras, strict=True)]
        return policy.trace_bounds(nodes, self.mapping, default)

    def _number(self) -> int:
        if self.numbering is None:
            raise RuntimeError("a batch that adds traces needs the ingest's numbering")
        return self.numbering.take(1)

    def add(
        self,
        line: ParsedLine,
        source: str,
        number: int,
        group_id: str | None,
        fresh: list[ParsedTrace],
        episode: dict[str, Any] | None = None,
    ) -> None:
        """The rows of ``line``: its episode (unless already stored: None) and its ``fresh``
        traces, numbered in order; ``episode`` is the line's episode record even when it is
        stored already (tags read from it)."""
        if line.episode is not None:
            ep = line.episode
            env = ep.get("env")
            self.episodes.append(
                {
                    "episode_id": ep["id"],
                    "group_id": group_id,
                    "env_id": env.get("id") if isinstance(env, dict) else None,
                    "ok": ep.get("ok"),
                    "record": _compact(ep),
                    "source": source,
                    "line": number,
                    **work_of(ep),
                }
            )
        work = work_of(episode if episode is not None else line.episode)
        default = policy.fallback(work["policy_start"], work["work_step"])
        for t in fresh:
            scanned = t.block
            if scanned is None:
                parents = [n.parent for n in t.nodes]
                links = [n.semantic_parents for n in t.nodes]
                sizes = [len(n.token_ids) for n in t.nodes]
                sampled = [n.n_sampled for n in t.nodes]
            else:
                lo, hi = t.rows
                parents = scanned.parents(lo, hi)
                links = scanned.links(lo, hi)
                sizes = scanned.n_tokens[lo:hi].tolist()
                sampled = scanned.n_sampled[lo:hi].tolist()
            paths = branch_paths(parents, links)
            for i, (leaf, trainable, path) in enumerate(paths):
                self.branches.append(
                    (t.trace_id, i, leaf, trainable, path, sum(sizes[j] for j in path), sum(sampled[j] for j in path))
                )
            meta = t.meta
            self.traces.append(
                {
                    "trace_id": t.trace_id,
                    "episode_id": t.episode_id,
                    "position": t.position,
                    "group_id": group_id,
                    "reward": trace_reward(meta.get("rewards")),
                    "ok": meta.get("ok"),
                    "is_completed": meta.get("is_completed"),
                    "is_timeout": meta.get("is_timeout"),
                    "stop_condition": meta.get("stop_condition"),
                    "n_nodes": len(sizes),
                    "n_branches": len(paths),
                    "n_tokens": sum(sizes),
                    "n_sampled": sum(sampled),
                    "record": _compact(meta),
                    "source": source,
                    "line": number,
                    "seq": self._number(),
                    "dropped": meta.get("dropped"),
                    "work_type": work["work_type"],
                    **dict(zip(("policy_min", "policy_max", "policy_unknown"), self._bounds(t, default), strict=True)),
                }
            )
            if self.tags:
                self.tag_rows.extend(tag_rows(self.tags, t.trace_id, meta, episode))
            if scanned is None:
                for i, node in enumerate(t.nodes):
                    key = segment_key(node.token_ids)
                    self.segments.setdefault(key, node.token_ids)
                    self.parsed_nodes.append((t.trace_id, i, node, key))
                continue
            lo, hi = t.rows
            self.scanned.setdefault(id(scanned), (scanned, []))[1].append(np.arange(lo, hi))
            segments = self.segments
            for row in range(lo, hi):
                key = scanned.keys[row]
                if key not in segments:
                    segments[key] = scanned.token_ids(row)

    # ------------------------------------------------------------------ tables

    def node_table(self) -> pa.Table:
        """The nodes of both parse paths, in :data:`tracedb.tables.NODES`."""
        parts = [self.parsed_node_table()] if self.parsed_nodes else []
        for scanned, ranges in self.scanned.values():
            parts.append(scanned.table(np.concatenate(ranges)))
        return split_weight_versions(parts[0] if len(parts) == 1 else pa.concat_tables(parts))

    def parsed_node_table(self) -> pa.Table:
        """The fallback parser's nodes, in :data:`tracedb.tables.NODES`."""
        rows = self.parsed_nodes
        nodes = [r[2] for r in rows]
        slots = [None if n.mask is None else np.where(n.mask, np.cumsum(n.mask), 0).astype(np.int32) for n in nodes]
        columns: dict[str, Any] = {
            "trace_id": pa.array([r[0] for r in rows], pa.string()),
            "node_index": pa.array([r[1] for r in rows], pa.int32()),
            "parent": pa.array([n.parent for n in nodes], pa.int32()),
            "role": pa.array([n.role for n in nodes], pa.string()),
            "sampled": pa.array([n.sampled for n in nodes], pa.bool_()),
            "timestamp": pa.array([None if n.timestamp is None else float(n.timestamp) for n in nodes], pa.float64()),
            "segment_id": pa.array([r[3] for r in rows], pa.binary()),
            "n_tokens": pa.array(np.array([len(n.token_ids) for n in nodes], dtype=np.int32)),
            "n_sampled": pa.array(np.array([n.n_sampled for n in nodes], dtype=np.int32)),
            "mask_prefix": pa.array([n.mask_prefix for n in nodes], pa.int32()),
            "mask_slots": numpy_lists(slots, pa.int32()),
            "is_content": numpy_lists([n.is_content for n in nodes], pa.bool_()),
            **{name: numpy_lists([n.streams[name] for n in nodes], pa.float32()) for name in COMPACT_STREAMS},
            "loss_weights": pa.array(
                [
                    None if n.loss_weights is None else [(k, v.tolist()) for k, v in n.loss_weights.items()]
                    for n in nodes
                ],
                type=tables.LOSS_WEIGHTS,
            ),
            "semantic_parents": pa.array(
                [
                    None
                    if n.semantic_parents is None
                    else [{"node": s["node"], "type": s["type"]} for s in n.semantic_parents]
                    for n in nodes
                ],
                type=tables.LINKS,
            ),
            # The links as written, only when they carry more than node and type.
            "semantic_parents_record": pa.array(
                [
                    json.dumps(n.semantic_parents)
                    if n.semantic_parents and any(len(link) != 2 for link in n.semantic_parents)
                    else None
                    for n in nodes
                ],
                pa.string(),
            ),
            "message": pa.array([n.message for n in nodes], pa.string()),
            "extra": pa.array([n.extra for n in nodes], pa.string()),
            "present": pa.array([n.present for n in nodes], pa.int32()),
            "weight_versions": pa.nulls(len(nodes), tables.WEIGHT_VERSIONS),
        }
        return tables.table_from(tables.NODES, columns)

    def segment_table(self) -> pa.Table:
        keys = list(self.segments)
        chunks = [self.segments[k] for k in keys]
        columns = {
            "segment_id": pa.array(keys, pa.binary()),
            "n_tokens": pa.array([len(c) for c in chunks], pa.int32()),
            "token_ids": numpy_lists(chunks, pa.int32()),
        }
        return tables.table_from(tables.SEGMENTS, columns)

    def branch_table(self) -> pa.Table:
        b = self.branches
        columns = {
            "trace_id": pa.array([r[0] for r in b], pa.string()),
            "branch_index": pa.array([r[1] for r in b], pa.int32()),
            "leaf": pa.array([r[2] for r in b], pa.int32()),
            "trainable": pa.array([r[3] for r in b], pa.bool_()),
            "path": pa.array([r[4] for r in b], pa.list_(pa.int32())),
            "n_tokens": pa.array([r[5] for r in b], pa.int64()),
            "n_sampled": pa.array([r[6] for r in b], pa.int64()),
        }
        return tables.table_from(tables.BRANCHES, columns)

    def inserts(self) -> list[Insert]:
        """The INSERTs of this batch, their Arrow tables built (the Python half of a flush)."""
        out: list[Insert] = []
        if self.episodes:
            out.append(("episodes", pa.Table.from_pylist(self.episodes, schema=_EPISODE_ROWS)))
        if self.traces:
            out.append(("traces", pa.Table.from_pylist(self.traces, schema=_TRACE_ROWS)))
        if self.tag_rows:
            columns = list(zip(*self.tag_rows, strict=True))
            arrays = [pa.array(c, f.type) for c, f in zip(columns, tables.TRACE_TAGS, strict=True)]
            out.append(("trace_tags", pa.Table.from_arrays(arrays, schema=tables.TRACE_TAGS)))
        if self.segments:
            out.append(("segments", self.segment_table()))
        if self.parsed_nodes or self.scanned:
            out.append(("nodes", self.node_table()))
        if self.branches:
            out.append(("branches", self.branch_table()))
        return out


_EPISODE_ROWS = tables.inserted(tables.EPISODES)
_TRACE_ROWS = tables.inserted(tables.TRACES)
