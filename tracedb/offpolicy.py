"""Off-policy figures: how far the policy that sampled the tokens (the inference engine's
``logprobs``) is from the trainer's (``trainer_logprobs``, written back by a recompute pass
with ``db.write_nodes(rows, stream="trainer_logprobs")``).

**Which tokens count.** A token holds both streams when it is one of its node's first
``min(n_sampled, len(logprobs), len(trainer_logprobs))`` sampled tokens: a node whose
stream is None or empty holds none, values past the node's sampled tokens are no tokens
(the spreading rule drops them), and unsampled tokens carry neither stream.

**The figures** (the macros ``node_mismatch()`` and ``policy_mismatch()`` of
``schema/macros.sql`` state them; :func:`mismatch` reads them for a selection). With the
log ratio ``d = trainer - inference`` and the ratio ``exp(d)``:

- ``k3 = (exp(d) - 1) - d`` (Schulman's estimator): its mean over tokens sampled from the
  inference policy estimates ``KL(inference || trainer)``, is unbiased and never negative;
- ``ratio_mean`` and ``ratio_max`` of ``exp(d)``;
- ``outside_share``: the share of tokens whose ratio leaves ``[1/c, c]``.

Per trace a node counts once (a node shared by several branches of the trace is one
node); per turn each node with sampled tokens is one row. A trace or turn without a token
holding both streams has ``tokens = 0`` and null figures (None, not zeros).
"""

from __future__ import annotations

import math

import pyarrow as pa

from tracedb.handle import HandleOf, handle_of
from tracedb.selection import Selection, resolve, with_watermark

PER = ("trace", "turn")
"""What one row of :func:`mismatch` is."""

MISMATCH_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string()),
        pa.field("node_index", pa.int32()),
        pa.field("tokens", pa.int64()),
        pa.field("k3_mean", pa.float64()),
        pa.field("ratio_mean", pa.float64()),
        pa.field("ratio_max", pa.float64()),
        pa.field("outside_share", pa.float64()),
    ]
)
"""The columns of :func:`mismatch` and of the ``policy_mismatch()`` macro (``node_index``
is null per trace)."""

TURN_RATIOS = pa.schema(
    [
        pa.field("trace_id", pa.string()),
        pa.field("node_index", pa.int32()),
        pa.field("n_sampled", pa.int64()),
        pa.field("n_logprobs", pa.int64()),
        pa.field("n_trainer_logprobs", pa.int64()),
        pa.field("log_ratio", pa.float64()),
    ]
)
"""Per node with sampled tokens: its sampled count, the values each stream holds (0 for
None or empty) and the sum of ``trainer - inference`` over the tokens holding both."""


def check_band(c: float) -> float:
    """``c`` as a float, refused (ValueError) unless finite and at least 1."""
    if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c < 1:
        raise ValueError(f"c must be a finite number of at least 1 (the ratio band is [1/c, c]), got {c!r}")
    return float(c)


def mismatch(db: HandleOf, *, per: str = "trace", c: float = 2.0, selection: Selection | None = None) -> pa.Table:
    """The policy mismatch of the selected traces (every trace without ``selection``), one
    row per trace (``per="trace"``) or per turn (``per="turn"``), ordered by trace id then
    node index, carrying the watermark it was read at (``tracedb.watermark_of``). The
    figures are the ``policy_mismatch()`` macro's (see the module docstring): ``tokens``,
    ``k3_mean``, ``ratio_mean``, ``ratio_max``, ``outside_share`` of ``[1/c, c]``.

    ``db`` is a :class:`tracedb.Database` or its handle; ``selection`` a
    :class:`tracedb.selection.Selection` (or use ``db.policy_mismatch(...)`` with keyword
    filters). ValueError for a bad ``per`` or ``c``."""
    if per not in PER:
        raise ValueError(f"per must be one of {list(PER)}, not {per!r}")
    c = check_band(c)
    handle = handle_of(db)
    selection = selection or Selection()
    query = "SELECT * FROM policy_mismatch(c := ?, per := ?)"
    if selection.everything:
        mark = handle.watermark()
        table = handle.sql(
            f"{query} WHERE trace_id IN (SELECT trace_id FROM traces WHERE seq <= ?) ORDER BY trace_id, node_index",
            [c, per, mark],
        )
    else:
        selected = resolve(handle, selection)
        mark = selected.watermark
        ids = pa.table({"trace_id": pa.array(selected.trace_ids, pa.string())})
        with handle.registered("_tdb_mismatch_traces", ids):
            table = handle.sql(
                f"{query} WHERE trace_id IN (SELECT trace_id FROM _tdb_mismatch_traces) ORDER BY trace_id, node_index",
                [c, per],
            )
    return with_watermark(table.cast(MISMATCH_SCHEMA), mark)


def turn_log_ratios(db: HandleOf) -> pa.Table:
    """:data:`TURN_RATIOS` for every node with sampled tokens, by trace id then node index:
    what a turn-level correction (V-trace's ``rho_s``) is made of, and what it needs to
    refuse a turn the streams do not cover."""
    handle = handle_of(db)
    table = handle.sql(
        "SELECT trace_id, node_index, n_sampled::BIGINT AS n_sampled, "
        "coalesce(len(logprobs), 0)::BIGINT AS n_logprobs, "
        "coalesce(len(trainer_logprobs), 0)::BIGINT AS n_trainer_logprobs, "
        "CASE WHEN logprobs IS NOT NULL AND trainer_logprobs IS NOT NULL THEN coalesce(list_sum(list_transform("
        "range(1, least(n_sampled, len(logprobs), len(trainer_logprobs)) + 1), "
        "lambda k: trainer_logprobs[k]::DOUBLE - logprobs[k]::DOUBLE)), 0.0) ELSE 0.0 END AS log_ratio "
        "FROM nodes WHERE n_sampled > 0 ORDER BY trace_id, node_index"
    )
    return table.cast(TURN_RATIOS)
