"""Micro-batches: samples packed into bins, bins balanced over data-parallel ranks.

:func:`micro_batches` is ``db.micro_batches``; :class:`Plan` is its answer (one list of
:class:`MicroBatch` per rank, and a :class:`PackReport`). A micro-batch is one bin of at
most ``seq_len`` tokens (plus padding to ``pad_to_multiple_of``): its token columns as one
Arrow record batch, and its samples with the spans where their tokens sit.

Without prefix sharing a sample is one span and ``position_ids`` restart at 0 on each
(attention kernels derive ``cu_seqlens`` from the restarts). With it, the tokens several
samples of a bin share as a prefix are stored once: a sample's spans are the shared
span(s) then its own, positions continue across them, and the spans form a tree (a span's
parent is the span before it in every sample using it). A token attends to the earlier
tokens of its span and to every token of the spans above it:
:meth:`MicroBatch.attention_mask` builds that mask, :meth:`MicroBatch.segment_ids` and
:meth:`MicroBatch.span_ancestors` give what a flex-attention ``mask_mod`` needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from tracedb.batches import packing
from tracedb.batches.samples import Samples

SPAN = pa.struct([("start", pa.int32()), ("length", pa.int32())])
SAMPLES_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("branch_index", pa.int32(), nullable=False),
        pa.field("spans", pa.list_(SPAN), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
    ]
)
"""A micro-batch's samples: which branch, where its tokens sit in the bin, in order."""
BASE_COLUMNS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
OPTIONAL_COLUMNS = ("reference_logprobs", "trainer_logprobs", "entropies")
"""Token columns present when any packed sample holds the stream (null on the tokens of a
sample whose stream is None)."""


@dataclass
class PackReport:
    """What one ``micro_batches`` call packed, and what it left out and why."""

    seq_len: int
    ranks: int
    branches: int = 0
    """Branches selected (before anything was left out)."""
    samples: int = 0
    """Samples packed."""
    skipped_never_scored: int = 0
    """Branches whose advantages are None: not packed, never zero-filled."""
    dropped_zero_advantages: int = 0
    dropped_overflow: int = 0
    truncated: int = 0
    """Samples cut to ``seq_len``."""
    micro_batches: int = 0
    padding_micro_batches: int = 0
    """Zero-loss bins added so that every rank has as many micro-batches."""
    logical_tokens: int = 0
    """Tokens of the packed samples (after truncation), each sample counted whole."""
    physical_tokens: int = 0
    """Tokens stored in the bins, a shared prefix once (padding not counted)."""
    padding_tokens: int = 0
    rank_costs: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class MicroBatch:
    """One bin: ``tokens`` (a record batch: ``input_ids``, ``position_ids``,
    ``loss_mask``, ``advantages``, ``inference_logprobs``, maybe the optional streams and
    ``loss_weights.NAME``) and ``samples`` (``trace_id``, ``branch_index``, ``spans``,
    ``truncated``)."""

    def __init__(self, tokens: pa.RecordBatch, samples: pa.Table) -> None:
        self.tokens = tokens
        self.samples = samples

    def __len__(self) -> int:
        return self.tokens.num_rows

    def __repr__(self) -> str:
        return f"MicroBatch({self.tokens.num_rows} tokens, {self.samples.num_rows} samples)"

    def to_numpy(self) -> dict[str, np.ndarray]:
        """The token columns as numpy arrays (nulls as NaN in the float columns)."""
        out = {}
        for name in self.tokens.schema.names:
            column = self.tokens.column(name)
            if column.null_count:
                column = column.fill_null(float("nan"))
            out[name] = column.to_numpy(zero_copy_only=False)
        return out

    def spans(self) -> list[tuple[int, int]]:
        """The bin's spans, ``(start, length)`` in token order."""
        found = {(s["start"], s["length"]) for row in self.samples.column("spans").to_pylist() for s in row}
        return sorted(found)

    def segment_ids(self) -> np.ndarray:
        """Per token, the index (in :meth:`spans`) of the span holding it; -1 on padding."""
        ids = np.full(self.tokens.num_rows, -1, np.int32)
        for k, (start, length) in enumerate(self.spans()):
            ids[start : start + length] = k
        return ids

    def span_parents(self) -> np.ndarray:
        """Per span, the span before it in the samples that use it (-1: a sample starts with it)."""
        index = {span: k for k, span in enumerate(self.spans())}
        parents = np.full(len(index), -1, np.int32)
        for row in self.samples.column("spans").to_pylist():
            for before, span in zip(row, row[1:]):
                parents[index[(span["start"], span["length"])]] = index[(before["start"], before["length"])]
        return parents

    def span_ancestors(self) -> np.ndarray:
        """``[q, k]``: span ``k`` is span ``q`` or above it (a token of ``q`` may attend to ``k``)."""
        parents = self.span_parents()
        n = len(parents)
        out = np.eye(n, dtype=bool)
        for q in range(n):
            k = parents[q]
            while k >= 0:
                out[q, k] = True
                k = parents[k]
        return out

    def attention_mask(self) -> np.ndarray:
        """``[q, k]``: token ``q`` attends to token ``k`` (for tests and small cases; a
        trainer uses :meth:`segment_ids` and :meth:`span_ancestors`). Padding attends only
        to itself."""
        seg = self.segment_ids()
        ancestors = self.span_ancestors()
        n = len(seg)
        if not len(ancestors):  # no spans (a padding micro-batch): every token is padding
            return np.eye(n, dtype=bool)
        q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        real = (seg[:, None] >= 0) & (seg[None, :] >= 0)
        above = ancestors[np.maximum(seg, 0)][:, np.maximum(seg, 0)] & (seg[:, None] != seg[None, :])
        same = (seg[:, None] == seg[None, :]) & (k <= q)
        return (real & (above | same)) | ((seg[:, None] < 0) & (q == k))


class Plan(Sequence[list[MicroBatch]]):
    """One list of micro-batches per rank (``plan[r]``), all of the same length, and the
    report. ``arguments`` records the call."""

    def __init__(self, ranks: list[list[MicroBatch]], report: PackReport, arguments: dict[str, Any]) -> None:
        self._ranks = ranks
        self.report = report
        self.arguments = arguments

    def __len__(self) -> int:
        return len(self._ranks)

    def __getitem__(self, rank: int) -> list[MicroBatch]:  # type: ignore[override]
        return self._ranks[rank]

    def __iter__(self) -> Iterator[list[MicroBatch]]:
        return iter(self._ranks)

    def __repr__(self) -> str:
        r = self.report
        return f"Plan({r.ranks} ranks x {len(self._ranks[0]) if self._ranks else 0} micro-batches, {r.samples} samples)"


# --------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """A bin's physical layout: for each piece of tokens, where it comes from."""

    src: list[np.ndarray] = field(default_factory=list)  # view token indices
    pos: list[np.ndarray] = field(default_factory=list)  # position ids
    owners: list[list[int]] = field(default_factory=list)  # per piece: the samples using it
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sample -> its spans
    size: int = 0

    def piece(self, sample: int, start: int, length: int, users: list[int], samples: Samples) -> tuple[int, int]:
        at = self.size
        first = int(samples.start[sample]) + start
        self.src.append(np.arange(first, first + length, dtype=np.int64))
        self.pos.append(np.arange(start, start + length, dtype=np.int32))
        self.owners.append(users)
        self.size += length
        return at, length


def _layout(bin_samples: list[int], samples: Samples, share: bool) -> _Layout:
    """Place a bin's samples: each whole, or (sharing) the spans of its trie shared once."""
    layout = _Layout()
    if not share:
        for s in bin_samples:
            layout.spans[s] = [layout.piece(s, 0, int(samples.length[s]), [s], samples)]
        return layout
    assert samples.prefixes is not None
    # Users of each trie node in this bin, and each sample's chain of trie nodes.
    users: dict[int, list[int]] = {}
    for s in bin_samples:
        for key, _ in samples.prefixes[s]:
            users.setdefault(key, []).append(s)
    placed: dict[tuple[int, ...], tuple[int, int]] = {}  # a shared run (its trie ids) -> its span
    for s in bin_samples:
        spans: list[tuple[int, int]] = []
        start = 0
        chain = [(key, upto) for key, upto in samples.prefixes[s] if len(users[key]) > 1]
        # Maximal runs of trie nodes used by the same samples are one span each.
        run: list[int] = []
        run_end = 0
        for k, (key, upto) in enumerate(chain):
            run.append(key)
            run_end = upto
            last = k + 1 == len(chain) or users[chain[k + 1][0]] != users[key]
            if last:
                ident = tuple(run)
                if run_end > start:  # a run of token-less nodes is no span (it would collide with others)
                    if ident not in placed:
                        placed[ident] = layout.piece(s, start, run_end - start, users[key], samples)
                    spans.append(placed[ident])
                start, run = run_end, []
        rest = int(samples.length[s]) - start
        if rest > 0 or not spans:
            spans.append(layout.piece(s, start, rest, [s], samples))
        layout.spans[s] = spans
    return layout


# --------------------------------------------------------------------------- columns


def _flat(view: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A list column's values over the view's tokens, and per row whether it is valid."""
    column = view.column(name).combine_chunks()
    values = column.values.to_numpy(zero_copy_only=False)
    valid = column.is_valid().to_numpy(zero_copy_only=False) if column.null_count else None
    return values, valid


def _loss_weight_columns(samples: Samples) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``loss_weights.NAME`` over the view's tokens: (values, held per token), for the names
    the packed samples hold."""
    total = int(samples.view_offsets[-1])
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    column = samples.view.column("loss_weights")
    for row in samples.rows.tolist():
        a, b = int(samples.view_offsets[row]), int(samples.view_offsets[row + 1])
        for name, values in column[row].as_py():
            if name not in out:
                out[name] = (np.zeros(total, np.float32), np.zeros(total, bool))
            out[name][0][a:b] = values
            out[name][1][a:b] = True
    return dict(sorted(out.items()))


def build_plan(
    samples: Samples,
    *,
    seq_len: int,
    ranks: int,
    cost: tuple[float, float],
    pad_to_multiple_of: int,
    pad_token_id: int,
    share_prefixes: bool,
    arguments: dict[str, Any],
) -> Plan:
    """Pack ``samples`` into bins, balance the bins over ``ranks``, lay out each bin."""
    report = PackReport(seq_len=seq_len, ranks=ranks, **samples.counts)
    n = len(samples.length)
    report.samples = n
    report.logical_tokens = int(samples.length.sum())
    bins = packing.pack(samples.length.tolist(), seq_len, prefixes=samples.prefixes if share_prefixes else None)
    layouts = [_layout(sorted(b.samples), samples, share_prefixes) for b in bins]
    square = np.array([float((samples.length[b.samples].astype(np.float64) ** 2).sum()) for b in bins], np.float64)
    bin_cost = packing.costs(np.array([lay.size for lay in layouts]), square, *cost)
    padding = (-len(bins)) % ranks if bins else ranks
    report.padding_micro_batches = padding
    groups = packing.balance([*bin_cost.tolist(), *([0.0] * padding)], ranks)
    report.rank_costs = [float(sum(bin_cost[i] for i in g if i < len(bins))) for g in groups]
    report.micro_batches = len(bins) + padding
    report.physical_tokens = int(sum(lay.size for lay in layouts))

    view_columns = _ViewColumns.of(samples)
    multiple = max(pad_to_multiple_of, 1)
    batches: list[MicroBatch] = []
    for lay, b in zip(layouts, bins, strict=True):
        pad = (-lay.size) % multiple
        report.padding_tokens += pad
        tokens = view_columns.bin(lay, samples, pad, pad_token_id)
        batches.append(MicroBatch(tokens, _samples_table(sorted(b.samples), lay, samples)))
    empty = _samples_table([], _Layout(), samples)
    for _ in range(padding):
        batches.append(MicroBatch(view_columns.bin(_Layout(), samples, multiple, pad_token_id), empty))
        report.padding_tokens += multiple
    plan = [[batches[i] for i in g] for g in groups]
    return Plan(plan, report, arguments)


def _any_user(layout: _Layout, samples: Samples, per_token: np.ndarray) -> np.ndarray:
    """``per_token`` (over the view's tokens) for the bin's physical tokens: true where it
    is true for any sample using the token (the pieces' sources are their first user's)."""
    out = []
    for piece, users in zip(layout.src, layout.owners, strict=True):
        got = per_token[piece]
        for s in users[1:]:
            got = got | per_token[piece - samples.start[users[0]] + samples.start[s]]
        out.append(got)
    return np.concatenate(out) if out else np.zeros(0, bool)


@dataclass
class _ViewColumns:
    """The samples' token columns, flat over the view's tokens, that bins gather from."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray
    streams: dict[str, tuple[np.ndarray, np.ndarray | None]]  # values, valid per view token (None: all)
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # loss_weights.NAME: values, held per view token

    @classmethod
    def of(cls, samples: Samples) -> _ViewColumns:
        view = samples.view
        streams = {}
        for name in OPTIONAL_COLUMNS:
            values, valid = _flat(view, name)
            held = valid if valid is not None else np.ones(view.num_rows, bool)
            if held[samples.rows].any():  # a column only when some packed sample holds it
                per_token = None if valid is None else np.repeat(valid, np.diff(samples.view_offsets))
                streams[name] = (values, per_token)
        return cls(
            token_ids=_flat(view, "token_ids")[0],
            logprobs=_flat(view, "logprobs")[0],
            advantages=_flat(view, "advantages")[0],
            streams=streams,
            weights=_loss_weight_columns(samples),
        )

    def bin(self, layout: _Layout, samples: Samples, pad: int, pad_token_id: int) -> pa.RecordBatch:
        """One bin's token columns. A physical token is in the loss when a sample using it
        owns it (train-once), and holds a stream when any sample using it does. Padding:
        ``pad_token_id``, position 0, no loss, zeros, null in the optional columns."""
        src = np.concatenate(layout.src) if layout.src else np.zeros(0, np.int64)
        pos = np.concatenate(layout.pos) if layout.pos else np.zeros(0, np.int32)

        def padded(values: np.ndarray, fill: Any) -> np.ndarray:
            return np.concatenate([values, np.full(pad, fill, values.dtype)]) if pad else values

        columns: dict[str, pa.Array] = {
            "input_ids": pa.array(padded(self.token_ids[src].astype(np.int32), pad_token_id)),
            "position_ids": pa.array(padded(pos.astype(np.int32), 0)),
            "loss_mask": pa.array(padded(_any_user(layout, samples, samples.loss_mask), False)),
            "advantages": pa.array(padded(self.advantages[src].astype(np.float32), 0.0)),
            "inference_logprobs": pa.array(padded(self.logprobs[src].astype(np.float32), 0.0)),
        }
        for name, (values, valid) in self.streams.items():
            present = np.ones(len(src), bool) if valid is None else _any_user(layout, samples, valid)
            columns[name] = pa.array(padded(values[src].astype(np.float32), 0.0), mask=padded(~present, True))
        for name, (values, held) in self.weights.items():
            present = _any_user(layout, samples, held)
            columns[f"loss_weights.{name}"] = pa.array(padded(values[src], 0.0), mask=padded(~present, True))
        return pa.RecordBatch.from_pydict(columns)


def _samples_table(bin_samples: list[int], layout: _Layout, samples: Samples) -> pa.Table:
    return pa.Table.from_pydict(
        {
            "trace_id": pa.array([samples.trace_id[s] for s in bin_samples], pa.string()),
            "branch_index": pa.array([int(samples.branch_index[s]) for s in bin_samples], pa.int32()),
            "spans": pa.array(
                [[{"start": a, "length": n} for a, n in layout.spans[s]] for s in bin_samples], pa.list_(SPAN)
            ),
            "truncated": pa.array([bool(samples.truncated[s]) for s in bin_samples], pa.bool_()),
        },
        schema=SAMPLES_SCHEMA,
    )
