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
import pyarrow.compute as pc

from tracedb.batches import packing
from tracedb.batches.importance import Weights
from tracedb.batches.samples import Samples
from tracedb.views import _buffers

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
IMPORTANCE_COLUMN = "importance_weight"
"""With ``importance="tis"``: float32, the truncated ratio on loss tokens holding both
streams, 1.0 elsewhere (:mod:`tracedb.batches.importance`)."""


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
    sampled_tokens: int = 0
    """Sampled tokens of the packed samples before any cut (their loss tokens, train_once aside)."""
    truncated_sampled_tokens: int = 0
    """Of those, the ones the cut to ``seq_len`` left out."""
    micro_batches: int = 0
    padding_micro_batches: int = 0
    """Zero-loss bins added so that every rank has as many micro-batches."""
    logical_tokens: int = 0
    """Tokens of the packed samples (after truncation), each sample counted whole."""
    physical_tokens: int = 0
    """Tokens stored in the bins, a shared prefix once (padding not counted)."""
    padding_tokens: int = 0
    rank_costs: list[float] = field(default_factory=list)
    watermark: int = 0
    """The watermark the selection was read at: pass it as ``after`` for the next step."""
    dropped: int = 0
    """Dropped traces (verifiers' ``Trace.dropped``) left out (``include_dropped`` keeps them)."""
    eval: int = 0
    """Traces of eval episodes left out (``include_eval`` keeps them)."""
    policy: int | None = None
    """The policy version ``V`` staleness was measured from (None: no bound)."""
    staleness_bound: int | None = None
    """``V - K``: no loss token is older."""
    stale_groups: int = 0
    """Groups whose oldest member's lowest policy version is below the bound."""
    stale_traces: int = 0
    """Their traces: left out (``stale="drop"``) or kept masked (``"mask"``)."""
    stale_tokens: int = 0
    """With ``stale="mask"``: loss tokens older than the bound, taken out of the loss."""
    unknown_dropped: int = 0
    """Traces of unknown policy version left out (``unknown="drop"``)."""
    off_policy_level: float | None = None
    """Mean of ``V - policy_min`` over the packed traces (prime-rl's ``off_policy_level``)."""
    off_policy_max: int | None = None
    """Its maximum."""
    groups_over: int = 0
    """Groups past ``max_groups``, left for the next step."""
    importance: str | None = None
    """The importance correction written as ``importance_weight`` (``"tis"``), or None."""
    clip: float | None = None
    """Its cap: a loss token's weight is ``min(exp(trainer - inference), clip)``."""
    importance_tokens: int = 0
    """Loss tokens holding both ``logprobs`` and ``trainer_logprobs``: weighted."""
    importance_defaulted: int = 0
    """Loss tokens without both (no recomputed logprob, or no sampling one): weight 1.0."""
    importance_clipped: int = 0
    """Of the weighted loss tokens, those whose ratio was above ``clip``."""
    replay_replaced: int = 0
    """Zero-variance groups replaced by a replayed group (``replay``)."""
    replay_unfilled: int = 0
    """Zero-variance groups kept: no candidate was left for them."""
    replay_candidates: int = 0
    """Earlier groups that could be replayed (complete, with signal, within the bound and
    the use limit); looked for only when the selection has a zero-variance group."""
    replayed: list[dict[str, Any]] = field(default_factory=list)
    """What replaced what: per replaced group, ``replaced`` (its id), ``group`` (the
    replayed group's id), ``traces`` (the replayed traces), ``priority`` and ``uses``
    (times the group was replayed before)."""

    def to_dict(self) -> dict[str, Any]:
        """The counts, and the :meth:`warnings` under ``warnings``."""
        return {**asdict(self), "warnings": self.warnings()}

    def warnings(self) -> list[str]:
        """What a trainer should not miss: samples cut to ``seq_len`` (how many, the share of
        their loss tokens lost) and branches skipped as never scored."""
        found = []
        if self.truncated:
            share = self.truncated_sampled_tokens / self.sampled_tokens if self.sampled_tokens else 0.0
            found.append(
                f"{self.truncated} of {self.samples} samples truncated to seq_len {self.seq_len}: "
                f"{self.truncated_sampled_tokens:,} of {self.sampled_tokens:,} loss tokens ({share:.1%}) left out "
                "(a larger seq_len keeps them; overflow='drop' leaves such samples out whole)"
            )
        if self.skipped_never_scored:
            found.append(
                f"{self.skipped_never_scored} of {self.branches} branches skipped: never scored (advantages None, "
                "not 0); stamp a credit set (tracedb credit grpo) and pack with it (--credit grpo)"
            )
        return found


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
    report. ``arguments`` records the call, ``record`` what it read (the selected traces
    and the credit's digest: :mod:`tracedb.batches.provenance`)."""

    def __init__(self, ranks: list[list[MicroBatch]], report: PackReport, arguments: dict[str, Any]) -> None:
        self._ranks = ranks
        self.report = report
        self.arguments = arguments
        self.record: dict[str, Any] = {}

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
    """A bin's physical layout: pieces of tokens, each copied from its first user's view
    tokens (``sample``, its tokens ``start:start + length``), used by ``users``."""

    pieces: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # sample, start, length, users
    spans: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # sample -> its spans in the bin
    size: int = 0

    def piece(self, sample: int, start: int, length: int, users: list[int]) -> tuple[int, int]:
        at = self.size
        self.pieces.append((sample, start, length, users))
        self.size += length
        return at, length


def _layout(bin_samples: list[int], samples: Samples, share: bool) -> _Layout:
    """Place a bin's samples: each whole, or (sharing) the spans of its trie shared once."""
    layout = _Layout()
    if not share:
        for s in bin_samples:
            layout.spans[s] = [layout.piece(s, 0, int(samples.length[s]), [s])]
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
                        placed[ident] = layout.piece(s, start, run_end - start, users[key])
                    spans.append(placed[ident])
                start, run = run_end, []
        rest = int(samples.length[s]) - start
        if rest > 0 or not spans:
            spans.append(layout.piece(s, start, rest, [s]))
        layout.spans[s] = spans
    return layout


# --------------------------------------------------------------------------- columns


def _flat(view: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A list column's values over the view's tokens, and per row whether it is valid."""
    chunked = view.column(name)
    column = chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
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


def _version_column(samples: Samples) -> tuple[np.ndarray, np.ndarray] | None:
    """``policy_version`` over the view's tokens (values, known per token), when some packed
    sample has a token of known version."""
    column = samples.view.column("policy_version").combine_chunks()
    if column.null_count == len(column):
        return None
    valid = column.is_valid().to_numpy(zero_copy_only=False)
    if not valid[samples.rows].any():
        return None
    start = column.offsets[0].as_py()
    flat = column.values.slice(start, int(samples.view_offsets[-1]))
    known = flat.is_valid().to_numpy(zero_copy_only=False)
    values = pc.fill_null(flat, 0).to_numpy(zero_copy_only=False).astype(np.int32)
    return values, known


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

    multiple = max(pad_to_multiple_of, 1)
    layouts += [_Layout() for _ in range(padding)]  # the zero-loss bins: padding only
    pads = [(-lay.size) % multiple or (multiple if not lay.pieces else 0) for lay in layouts]
    report.padding_tokens = int(sum(pads))
    view_columns = _ViewColumns.of(samples)
    columns = view_columns.assemble(layouts, pads, samples, pad_token_id)
    if samples.importance is not None:
        counts = view_columns.importance_counts
        report.importance_tokens, report.importance_defaulted = counts["tokens"], counts["defaulted"]
        report.importance_clipped = counts["clipped"]
    tables = _samples_tables([sorted(b.samples) for b in bins] + [[] for _ in range(padding)], layouts, samples)
    starts = np.concatenate([[0], np.cumsum([lay.size + pad for lay, pad in zip(layouts, pads, strict=True)])])
    batches = [
        MicroBatch(
            pa.RecordBatch.from_arrays(
                [c.slice(int(starts[i]), int(starts[i + 1] - starts[i])) for c in columns.values()],
                names=list(columns),
            ),
            table,
        )
        for i, table in enumerate(tables)
    ]
    plan = [[batches[i] for i in g] for g in groups]
    return Plan(plan, report, arguments)


@dataclass
class _ViewColumns:
    """The samples' token columns, flat over the view's tokens, that bins copy from."""

    token_ids: np.ndarray
    logprobs: np.ndarray
    advantages: np.ndarray
    streams: dict[str, tuple[np.ndarray, np.ndarray | None]]  # values, valid per view row (None: all)
    weights: dict[str, tuple[np.ndarray, np.ndarray]]  # loss_weights.NAME: values, held per view token
    versions: tuple[np.ndarray, np.ndarray] | None = None  # policy_version: values, known per view token
    importance: Weights | None = None  # importance_weight inputs per view token (importance="tis")
    importance_counts: dict[str, int] = field(default_factory=dict)  # loss tokens weighted, defaulted, clipped

    @classmethod
    def of(cls, samples: Samples) -> _ViewColumns:
        view = samples.view
        streams = {}
        for name in OPTIONAL_COLUMNS:
            column = view.column(name)
            valid = column.is_valid().to_numpy(zero_copy_only=False) if column.null_count else None
            held = valid if valid is not None else np.ones(view.num_rows, bool)
            if held[samples.rows].any():  # a column only when some packed sample holds it
                streams[name] = (_flat(view, name)[0], valid)
        return cls(
            token_ids=_flat(view, "token_ids")[0],
            logprobs=_flat(view, "logprobs")[0],
            advantages=_flat(view, "advantages")[0],
            streams=streams,
            weights=_loss_weight_columns(samples),
            versions=_version_column(samples),
            importance=samples.importance,
        )

    def assemble(
        self, layouts: list[_Layout], pads: list[int], samples: Samples, pad_token_id: int
    ) -> dict[str, pa.Array]:
        """Every bin's token columns, back to back (each bin then padded), one copy of
        each piece. A physical token is in the loss when a sample using it owns it
        (train-once); optional streams are null where its samples hold none (samples
        share tokens only when they hold the same streams). Padding: ``pad_token_id``,
        position 0, no loss, zeros, null in the optional columns."""
        total = sum(lay.size + pad for lay, pad in zip(layouts, pads, strict=True))
        # Every position is written below, by a piece or as padding: no zero-filled pages
        # first, and memory that stays mapped between steps (views/_buffers).
        ids, pos, loss = _buffers.empty(total, np.int32), _buffers.empty(total, np.int32), np.empty(total, bool)
        adv, lp = _buffers.empty(total, np.float32), _buffers.empty(total, np.float32)
        streams = {name: (_buffers.empty(total, np.float32), np.empty(total, bool)) for name in self.streams}
        weights = {name: (_buffers.empty(total, np.float32), np.empty(total, bool)) for name in self.weights}
        versions = None if self.versions is None else (_buffers.empty(total, np.int32), np.empty(total, bool))
        imp = self.importance
        weight = None if imp is None else _buffers.empty(total, np.float32)
        counts = {"tokens": 0, "defaulted": 0, "clipped": 0}
        ramp = np.arange(max((int(n) for n in samples.length), default=0) + 1, dtype=np.int32)
        at = 0
        for lay, pad in zip(layouts, pads, strict=True):
            for sample, start, length, users in lay.pieces:
                a = int(samples.start[sample]) + start
                here, there = slice(at, at + length), slice(a, a + length)
                ids[here] = self.token_ids[there]
                pos[here] = ramp[start : start + length]
                adv[here] = self.advantages[there]
                lp[here] = self.logprobs[there]
                piece_loss = samples.loss_mask[there]
                for other in users[1:]:
                    b = int(samples.start[other]) + start
                    piece_loss = piece_loss | samples.loss_mask[b : b + length]
                loss[here] = piece_loss
                row = samples.rows[sample]
                for name, (values, valid) in self.streams.items():
                    streams[name][0][here] = values[there]
                    streams[name][1][here] = True if valid is None else bool(valid[row])
                for name, (values, held) in self.weights.items():
                    weights[name][0][here] = values[there]
                    weights[name][1][here] = held[there]
                if versions is not None and self.versions is not None:
                    versions[0][here] = self.versions[0][there]
                    versions[1][here] = self.versions[1][there]
                if weight is not None and imp is not None:
                    held = imp.held[there]
                    weight[here] = np.where(piece_loss, imp.weight[there], np.float32(1.0))
                    counts["tokens"] += int(np.count_nonzero(piece_loss & held))
                    counts["defaulted"] += int(np.count_nonzero(piece_loss & ~held))
                    counts["clipped"] += int(np.count_nonzero(piece_loss & imp.clipped[there]))
                at += length
            padding = slice(at, at + pad)
            ids[padding], pos[padding], loss[padding], adv[padding], lp[padding] = pad_token_id, 0, False, 0.0, 0.0
            for values, present in (*streams.values(), *weights.values()):
                values[padding], present[padding] = 0.0, False
            if versions is not None:
                versions[0][padding], versions[1][padding] = 0, False
            if weight is not None:
                weight[padding] = 1.0
            at += pad
        columns: dict[str, pa.Array] = {
            "input_ids": _arrow(ids),
            "position_ids": _arrow(pos),
            "loss_mask": pa.array(loss),
            "advantages": _arrow(adv),
            "inference_logprobs": _arrow(lp),
        }
        for name, (values, present) in streams.items():
            columns[name] = _arrow(values, ~present)
        for name, (values, present) in weights.items():
            columns[f"loss_weights.{name}"] = _arrow(values, ~present)
        if versions is not None:
            columns["policy_version"] = _arrow(versions[0], ~versions[1])
        if weight is not None:
            columns[IMPORTANCE_COLUMN] = _arrow(weight)
        self.importance_counts = counts
        return columns


def _arrow(values: np.ndarray, null: np.ndarray | None = None) -> pa.Array:
    """``values`` as an Arrow array without a copy (a pooled buffer), null where ``null``."""
    kind = pa.from_numpy_dtype(values.dtype)
    bitmap = None if null is None or not null.any() else pa.array(~null).buffers()[1]
    data = values.base if isinstance(values.base, pa.Buffer) else pa.py_buffer(values)
    return pa.Array.from_buffers(kind, len(values), [bitmap, data], null_count=-1 if bitmap else 0)


def _samples_tables(bins: list[list[int]], layouts: list[_Layout], samples: Samples) -> list[pa.Table]:
    """Each bin's samples table, sliced from one table of every bin's samples in bin order."""
    order = [s for b in bins for s in b]
    spans = [layouts[i].spans[s] for i, b in enumerate(bins) for s in b]
    span_off = np.zeros(len(order) + 1, np.int32)
    np.cumsum([len(x) for x in spans], out=span_off[1:])
    flat = [span for x in spans for span in x]
    span_values = pa.StructArray.from_arrays(
        [pa.array([a for a, _ in flat], pa.int32()), pa.array([n for _, n in flat], pa.int32())], fields=list(SPAN)
    )
    index = pa.array(np.array(order, np.int64))
    table = pa.Table.from_arrays(
        [
            pa.array(samples.trace_id, pa.string()).take(index) if order else pa.array([], pa.string()),
            pa.array(samples.branch_index[order] if order else np.zeros(0, np.int32)),
            pa.ListArray.from_arrays(pa.array(span_off), span_values),
            pa.array(samples.truncated[order] if order else np.zeros(0, bool)),
        ],
        schema=SAMPLES_SCHEMA,
    )
    bounds = np.concatenate([[0], np.cumsum([len(b) for b in bins])])
    return [table.slice(int(bounds[i]), int(bounds[i + 1] - bounds[i])) for i in range(len(bins))]
