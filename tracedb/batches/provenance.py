"""What a step was made from, as its manifest records it: the traces selected (at which
watermark) and a digest of the credit rows read for the packed traces.

``tracedb pack --from-manifest`` (:mod:`tracedb.batches.steps`) resolves the recorded
selection again and compares both before it writes anything: the same figures, the same
inputs. The digests hash values in a fixed order and layout (never Arrow buffers, whose
chunking may differ between two reads of the same rows).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tracedb.views.nodes import NodeColumns


def ids_digest(trace_ids: Sequence[str]) -> str:
    """SHA-256 of trace ids, sorted, one per line."""
    return hashlib.sha256("".join(f"{t}\n" for t in sorted(trace_ids)).encode()).hexdigest()


def credit_digest(data: NodeColumns) -> str:
    """SHA-256 of the advantages ``data`` holds (the credit rows read for its traces): the
    trace ids, then per trace in id order and per node in index order whether it is
    assigned, how many values it spreads, and the values (float32). Independent of the
    order the nodes were read in (a whole-database read and a read by ids differ)."""
    stream = data.streams["advantages"]
    ids = sorted(data.base)
    starts = np.array(sorted(data.base.values()) + [len(data.n_tok)], np.int64)
    first = np.array([data.base[t] for t in ids], np.int64)
    count = starts[np.searchsorted(starts, first, side="right")] - first  # each trace's node rows
    rows = np.repeat(first - np.concatenate([[0], np.cumsum(count)[:-1]]), count) + np.arange(int(count.sum()))
    digest = hashlib.sha256("".join(f"{t}\n" for t in ids).encode())
    has = np.asarray(stream.has, bool)[rows]
    take = np.where(has, np.asarray(stream.take, np.int64)[rows], 0)
    digest.update(has.tobytes())
    digest.update(take.tobytes())
    total = int(take.sum())
    if total:
        src = np.asarray(stream.src, np.int64)[rows]
        at = np.repeat(src - np.concatenate([[0], np.cumsum(take)[:-1]]), take) + np.arange(total)
        digest.update(np.asarray(stream.values, np.float32)[at].tobytes())
    return digest.hexdigest()


def record(
    data: NodeColumns, selected: Sequence[str] | None, read_at: int, watermark: int, credit: str | None
) -> dict[str, Any]:
    """A plan's provenance for its manifest: ``selection`` (``read_at``, the watermark the
    selection was resolved at; ``watermark``, the step's; the selected trace ids before
    replay and their digest; ``selected`` None: every trace ``data`` holds) and ``credit``
    (the set, the traces read, the digest of their credit rows)."""
    ids = sorted(data.base) if selected is None else sorted(selected)
    return {
        "selection": {
            "read_at": read_at,
            "watermark": watermark,
            "traces": len(ids),
            "trace_ids": ids,
            "trace_ids_sha256": ids_digest(ids),
        },
        "credit": {
            "set": "default" if credit is None else credit,
            "traces": len(data.base),
            "rows_sha256": credit_digest(data),
        },
    }
