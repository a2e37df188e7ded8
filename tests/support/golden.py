"""Branch views in a comparable form: verifiers' own (a fixture's ``NAME.branches.json``)
or a reference's beside tracedb's (``db.branches()`` or the SQL macro ``branch_tokens()``);
trace records with their per-token floats at float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

COMPACT = ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies")
OPTIONAL = COMPACT[1:]


def f32(values: list[float] | None) -> list[float] | None:
    """Float32 values as plain floats: == between two of these is np.float32 equality."""
    if values is None:
        return None
    return np.asarray(values, dtype=np.float64).astype(np.float32).tolist()


def canon(row: dict[str, Any]) -> dict[str, Any]:
    """One branch row (golden json, Arrow or SQL) in a comparable form."""
    lw = row["loss_weights"]
    lw = dict(lw) if isinstance(lw, list) else lw
    assert isinstance(lw, dict), row["loss_weights"]
    out = {
        "trace_id": row["trace_id"],
        "branch_index": row["index"] if "index" in row else row["branch_index"],
        "trainable": row["trainable"],
        "token_ids": list(row["token_ids"]),
        "sampled_mask": list(row["sampled_mask"]),
        "logprobs": f32(row["logprobs"]),
        "loss_weights": {name: f32(v) for name, v in lw.items()},
    }
    for name in OPTIONAL:
        out[name] = f32(row[name])
    return out


def golden_file(path: Path) -> list[dict[str, Any]]:
    """The rows of a ``NAME.branches.json``, canonical, by trace id then branch index."""
    rows = json.loads(path.read_text())
    return sorted((canon(r) for r in rows), key=lambda r: (r["trace_id"], r["branch_index"]))


def rows_of(table: pa.Table) -> list[dict[str, Any]]:
    return [canon(r) for r in table.to_pylist()]


def canon_record(record: dict[str, Any]) -> dict[str, Any]:
    """A trace record (a copy) with its nodes' per-token float streams at float32 precision."""
    record = json.loads(json.dumps(record))
    for node in record.get("nodes") or []:
        for name in COMPACT:
            if isinstance(node.get(name), list):
                node[name] = f32(node[name])
        if isinstance(node.get("loss_weights"), dict):
            node["loss_weights"] = {k: f32(v) for k, v in node["loss_weights"].items()}
    return record
