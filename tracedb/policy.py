"""Policy versions: which weights sampled each token, and how stale a trace is.

verifiers 0.4.1 labels an assistant node's sampled tokens with the engine's weights:
``MessageNode.weight_versions`` is a list of spans ``{version, start, end}``, tokens
``[start, end)`` among the node's sampled tokens (the positions of its compact
``logprobs``) sampled by the weights labelled ``version``. An episode carries
``run.work = {type, step, policy: {start, end} | null}``: the training step it was
dispatched at and the span of live policy versions while it was generated.

The one rule for a token's policy version (an int):

- a sampled token a span covers has its label's number: a label matching
  :data:`LABEL` (``step_12``, ``v3``, ``12``, ``version-7``; case-insensitive) is that
  number, any other label has the number it is mapped to (``db.set_policy_versions``),
  and none (unknown) until it is mapped;
- a sampled token no span covers has its episode's ``policy.start``, else its
  ``work.step``, else none;
- an unsampled token has none.

The functions here are pure (arrays in, arrays out), shared by ingest (which stores each
trace's bounds), the views (a per-token ``policy_version`` column) and the mapping (which
recomputes the bounds).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

LABEL = re.compile(r"^(?:step|v|version)?[_-]?(\d+)$", re.IGNORECASE)
"""A label that names its policy version: an optional ``step``/``v``/``version``, an
optional ``_`` or ``-``, the number."""
UNKNOWN = np.iinfo(np.int32).min
"""The policy version of a token no rule gives one (stored arrays use it for null)."""
_MAX = np.iinfo(np.int32).max


def label_number(label: str) -> int | None:
    """The policy version a label names by itself (None: it needs a mapping)."""
    found = LABEL.match(label)
    if found is None:
        return None
    value = int(found.group(1))
    return value if value <= _MAX else None


SPAN_KEYS = ("version", "start", "end")
"""A span's keys, in the order verifiers writes them."""


def typed(value: Any) -> bool:
    """True when ``value`` is None or a list of spans with a str ``version`` and int
    ``start``/``end`` (booleans are not ints; other keys are kept)."""
    if value is None:
        return True
    if type(value) is not list:
        return False
    for span in value:
        if type(span) is not dict or type(span.get("version")) is not str:
            return False
        if type(span.get("start")) is not int or type(span.get("end")) is not int:
            return False
    return True


def span_problem(spans: Sequence[Mapping[str, Any]], n_sampled: int) -> str | None:
    """Why ``spans`` do not fit a node of ``n_sampled`` sampled tokens, or None: every
    span ``0 <= start <= end <= n_sampled``, none overlapping another. Values must be
    typed already (``version`` a str, ``start``/``end`` ints)."""
    taken: list[tuple[int, int, int]] = []
    for k, span in enumerate(spans):
        start, end = span["start"], span["end"]
        if start < 0:
            return (
                f"weight_versions[{k}] ({span['version']!r}) starts at {start}, before the node's first sampled token"
            )
        if start > end:
            return f"weight_versions[{k}] ({span['version']!r}) starts at {start}, after its end {end}"
        if end > n_sampled:
            return (
                f"weight_versions[{k}] ({span['version']!r}) ends at {end} but the node has {n_sampled} sampled tokens"
            )
        taken.append((start, end, k))
    taken.sort()
    for (s1, e1, k1), (s2, e2, k2) in zip(taken, taken[1:]):
        if s2 < e1:
            a, b = sorted((k1, k2))
            return f"weight_versions[{a}] and weight_versions[{b}] overlap (tokens {max(s1, s2)}-{min(e1, e2) - 1})"
    return None


def fallback(policy_start: int | None, work_step: int | None) -> int | None:
    """The version of a sampled token no span labels: the episode's policy start, else its
    dispatch step, else none."""
    return policy_start if policy_start is not None else work_step


def number_of(label: str, mapping: Mapping[str, int]) -> int | None:
    """A label's policy version: its own number, else the mapping's (None: unknown)."""
    own = label_number(label)
    return own if own is not None else mapping.get(label)


def node_versions(
    spans: Sequence[Mapping[str, Any]] | None, n_sampled: int, mapping: Mapping[str, int], default: int | None
) -> np.ndarray:
    """The policy version of each of a node's sampled tokens (int32, :data:`UNKNOWN` where
    none is known): spans first, ``default`` (:func:`fallback`) where no span covers."""
    out = np.full(n_sampled, UNKNOWN if default is None else default, np.int32)
    for span in spans or ():
        number = number_of(span["version"], mapping)
        out[span["start"] : span["end"]] = UNKNOWN if number is None else number
    return out


def bounds(versions: Sequence[np.ndarray]) -> tuple[int | None, int | None, int]:
    """(lowest, highest, unknown count) of the sampled tokens' versions of a trace."""
    if not versions:
        return None, None, 0
    every = np.concatenate(list(versions)) if len(versions) > 1 else versions[0]
    known = every[every != UNKNOWN]
    unknown = int(len(every) - len(known))
    if not len(known):
        return None, None, unknown
    return int(known.min()), int(known.max()), unknown


def trace_bounds(
    nodes: Sequence[tuple[int, Sequence[Mapping[str, Any]] | None]], mapping: Mapping[str, int], default: int | None
) -> tuple[int | None, int | None, int]:
    """(lowest, highest, unknown count) of a trace's sampled tokens' versions, from its
    nodes' ``(sampled tokens, spans)``; ``default`` is the episode's :func:`fallback`."""
    lo: int | None = None
    hi: int | None = None
    unknown = 0
    uncovered = 0
    for n_sampled, spans in nodes:
        if not n_sampled:
            continue
        covered = 0
        for span in spans or ():
            width = max(0, min(span["end"], n_sampled) - max(span["start"], 0))
            if not width:
                continue
            covered += width
            number = number_of(span["version"], mapping)
            if number is None:
                unknown += width
            else:
                lo = number if lo is None else min(lo, number)
                hi = number if hi is None else max(hi, number)
        uncovered += max(0, n_sampled - covered)
    if uncovered:
        if default is None:
            unknown += uncovered
        else:
            lo = default if lo is None else min(lo, default)
            hi = default if hi is None else max(hi, default)
    return lo, hi, unknown


def mapping_of(con: Any) -> dict[str, int]:
    """The labels mapped to versions in a database (``policy_labels``), on ``con``."""
    return dict(con.execute("SELECT label, version FROM policy_labels").fetchall())


def recompute_bounds(con: Any, labels: Sequence[str] | None = None) -> int:
    """Store ``traces.policy_min`` / ``policy_max`` / ``policy_unknown`` again, on ``con``
    (in its transaction): of the traces whose spans use one of ``labels`` (None: every
    trace). Returns the number of traces updated."""
    import pyarrow as pa

    mapping = mapping_of(con)
    where = ""
    params: list[Any] = []
    if labels is not None:
        where = (
            " WHERE t.trace_id IN (SELECT DISTINCT trace_id FROM nodes, unnest(weight_versions) AS u(s) "
            "WHERE s.version IN (SELECT unnest(?::VARCHAR[])))"
        )
        params.append(list(labels))
    rows = con.execute(
        "SELECT t.trace_id, coalesce(e.policy_start, e.work_step) AS fallback, "
        "  list(n.n_sampled ORDER BY n.node_index) FILTER (WHERE n.n_sampled > 0) AS sampled, "
        "  list(n.weight_versions ORDER BY n.node_index) FILTER (WHERE n.n_sampled > 0) AS spans "
        "FROM traces t LEFT JOIN episodes e USING (episode_id) LEFT JOIN nodes n USING (trace_id)" + where + " "
        "GROUP BY t.trace_id, e.policy_start, e.work_step",
        params,
    ).fetchall()
    ids, lows, highs, unknowns = [], [], [], []
    for trace_id, default, sampled, spans in rows:
        lo, hi, unknown = trace_bounds(list(zip(sampled or [], spans or [], strict=True)), mapping, default)
        ids.append(trace_id)
        lows.append(lo)
        highs.append(hi)
        unknowns.append(unknown)
    table = pa.table(
        {
            "trace_id": pa.array(ids, pa.string()),
            "policy_min": pa.array(lows, pa.int64()),
            "policy_max": pa.array(highs, pa.int64()),
            "policy_unknown": pa.array(unknowns, pa.int64()),
        }
    )
    con.register("_tdb_bounds", table)
    try:
        con.execute(
            "UPDATE traces SET policy_min = b.policy_min, policy_max = b.policy_max, "
            "policy_unknown = b.policy_unknown FROM _tdb_bounds b WHERE traces.trace_id = b.trace_id"
        )
    finally:
        con.unregister("_tdb_bounds")
    return len(ids)
