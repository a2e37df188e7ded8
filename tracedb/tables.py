"""The Arrow schema of every stored table and of the branch view, declared once.

``schema/tables.sql`` and ``schema/cec.sql`` create the tables; the schemas here are
what reading a table back gives (``SELECT * ... LIMIT 0`` to Arrow) and what every
writer builds its rows in. ``tests/store/test_tables.py`` asserts each one equals its
DDL: names, types, NOT NULL and defaults. A column with a default (``ingested_at``, ...)
is left to DuckDB by the writers: :func:`inserted` is a schema without those.

Two tables are kept encoded (:data:`ENCODED`, :mod:`tracedb.codec`): ``nodes`` and
``segments`` are views over ``node_store`` and ``segment_store``, which hold their
per-token arrays as text. :data:`STORED` has what a reader sees (the views' schemas, as
every SQL client and the lake read them); writers build rows in those and
:func:`encode_rows` turns them into the stored ones (:data:`PHYSICAL`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from tracedb import codec
from tracedb.records import COMPACT_STREAMS, OPTIONAL_STREAMS

NOW = "current_timestamp"


def _col(name: str, kind: pa.DataType, *, required: bool = False, default: str | None = None) -> pa.Field:
    """A column: ``required`` is NOT NULL (or part of the key), ``default`` the DDL's DEFAULT."""
    return pa.field(name, kind, nullable=not required, metadata=None if default is None else {"default": default})


def default_of(field: pa.Field) -> str | None:
    """The DDL default of a column, or None."""
    meta = field.metadata or {}
    value = meta.get(b"default")
    return None if value is None else value.decode()


def inserted(schema: pa.Schema) -> pa.Schema:
    """The columns a writer supplies: all but those DuckDB fills from their default."""
    return pa.schema([f for f in schema if default_of(f) is None])


def table_from(schema: pa.Schema, columns: Mapping[str, pa.Array | pa.ChunkedArray]) -> pa.Table:
    """``columns`` as a table of exactly ``schema`` (every name, no other, cast to its type)."""
    missing = [n for n in schema.names if n not in columns]
    extra = [n for n in columns if n not in schema.names]
    if missing or extra:
        raise ValueError(f"rows for {schema.names}: missing {missing}, unknown {extra}")
    arrays = [columns[f.name] for f in schema]
    target = pa.schema([f.with_nullable(True) for f in schema])
    if all(a.type == f.type for a, f in zip(arrays, target, strict=True)):
        # nothing to cast: a cast would import pyarrow.compute (~40 ms) into an ingest
        return pa.Table.from_arrays(arrays, schema=target)
    return pa.Table.from_arrays(arrays, names=schema.names).cast(target)


FLOATS = pa.list_(pa.float32())
LOSS_WEIGHTS = pa.map_(pa.string(), FLOATS)
LINKS = pa.list_(pa.struct([("node", pa.int32()), ("type", pa.string())]))
WEIGHT_VERSIONS = pa.list_(pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))
"""A node's weight-version spans (verifiers 0.4.1 ``MessageNode.weight_versions``)."""

META = pa.schema([_col("key", pa.string(), required=True), _col("value", pa.string())])

EPISODES = pa.schema(
    [
        _col("episode_id", pa.string(), required=True),
        _col("group_id", pa.string()),
        _col("env_id", pa.string()),
        _col("ok", pa.bool_()),
        _col("record", pa.string(), required=True),
        _col("source", pa.string()),
        _col("line", pa.int64()),
        _col("ingested_at", pa.timestamp("us"), default=NOW),
        _col("work_type", pa.string()),
        _col("work_step", pa.int64()),
        _col("policy_start", pa.int64()),
        _col("policy_end", pa.int64()),
    ]
)

TRACES = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("episode_id", pa.string()),
        _col("position", pa.int32()),
        _col("group_id", pa.string()),
        _col("reward", pa.float64()),
        _col("ok", pa.bool_()),
        _col("is_completed", pa.bool_()),
        _col("is_timeout", pa.bool_()),
        _col("stop_condition", pa.string()),
        _col("n_nodes", pa.int32()),
        _col("n_branches", pa.int32()),
        _col("n_tokens", pa.int64()),
        _col("n_sampled", pa.int64()),
        _col("record", pa.string(), required=True),
        _col("source", pa.string()),
        _col("line", pa.int64()),
        _col("ingested_at", pa.timestamp("us"), default=NOW),
        _col("seq", pa.int64()),
        _col("dropped", pa.string()),
        _col("policy_min", pa.int64()),
        _col("policy_max", pa.int64()),
        _col("policy_unknown", pa.int64()),
        _col("work_type", pa.string()),
    ]
)

POLICY_LABELS = pa.schema(
    [
        _col("label", pa.string(), required=True),
        _col("version", pa.int64(), required=True),
        _col("set_at", pa.timestamp("us"), default=NOW),
    ]
)

TRACE_TAGS = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("name", pa.string(), required=True),
        _col("value", pa.string(), required=True),
        _col("number", pa.float64()),
        _col("text", pa.string()),
    ]
)

FOLLOW_POSITIONS = pa.schema(
    [
        _col("path", pa.string(), required=True),
        _col("device", pa.int64()),
        _col("inode", pa.int64()),
        _col("offset", pa.int64(), required=True),
        _col("line", pa.int64(), required=True),
        _col("head", pa.binary()),
        _col("updated_at", pa.timestamp("us"), default=NOW),
        _col("tail", pa.binary()),
        _col("rotated_from", pa.string()),
    ]
)

SEGMENTS = pa.schema(
    [
        _col("segment_id", pa.binary(), required=True),
        _col("n_tokens", pa.int32(), required=True),
        _col("token_ids", pa.list_(pa.int32()), required=True),
    ]
)

NODES = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("node_index", pa.int32(), required=True),
        _col("parent", pa.int32()),
        _col("role", pa.string()),
        _col("sampled", pa.bool_()),
        _col("timestamp", pa.float64()),
        _col("segment_id", pa.binary(), required=True),
        _col("n_tokens", pa.int32(), required=True),
        _col("n_sampled", pa.int32(), required=True),
        _col("mask_prefix", pa.int32()),
        _col("mask_slots", pa.list_(pa.int32())),
        _col("is_content", pa.list_(pa.bool_())),
        *(_col(name, FLOATS) for name in COMPACT_STREAMS),
        _col("loss_weights", LOSS_WEIGHTS),
        _col("semantic_parents", LINKS),
        _col("semantic_parents_record", pa.string()),
        _col("message", pa.string()),
        _col("extra", pa.string()),
        _col("present", pa.int32(), required=True),
        _col("weight_versions", WEIGHT_VERSIONS),
    ]
)

SEGMENT_STORE = pa.schema(
    [
        _col("segment_id", pa.binary(), required=True),
        _col("n_tokens", pa.int32(), required=True),
        _col("token_ids", pa.list_(pa.int32())),
        _col("tokens", pa.string()),
    ]
)
"""``segments`` as stored: each row's ids as a list or as text (the other one NULL)."""

TEXT_COLUMNS = (*COMPACT_STREAMS, "loss_weights")
"""The ``nodes`` columns ``node_store`` keeps as stream text."""

NODE_STORE = pa.schema(
    [_col(f.name, pa.string()) if f.name in TEXT_COLUMNS else f for f in NODES]
    + [_col(f"{s}_list", pa.list_(pa.float32())) for s in COMPACT_STREAMS]
)
"""``nodes`` as stored: the streams and ``loss_weights`` as their text, or a batch's
streams as lists (``logprobs_list``, ...; :func:`tracedb.codec.stream_form`)."""

BRANCHES = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("branch_index", pa.int32(), required=True),
        _col("leaf", pa.int32(), required=True),
        _col("trainable", pa.bool_(), required=True),
        _col("path", pa.list_(pa.int32()), required=True),
        _col("n_tokens", pa.int64(), required=True),
        _col("n_sampled", pa.int64(), required=True),
    ]
)

REJECTS = pa.schema(
    [
        _col("source", pa.string()),
        _col("line", pa.int64()),
        _col("trace_id", pa.string()),
        _col("node", pa.int32()),
        _col("field", pa.string()),
        _col("reason", pa.string(), required=True),
        _col("record", pa.string()),
        _col("rejected_at", pa.timestamp("us"), default=NOW),
        _col("record_bytes", pa.int64()),
        _col("record_sha256", pa.string()),
    ]
)

CREDIT_SETS = pa.schema(
    [
        _col("name", pa.string(), required=True),
        _col("algorithm", pa.string(), required=True),
        _col("params", pa.string()),
        _col("description", pa.string()),
        _col("created_at", pa.timestamp("us"), default=NOW),
        _col("layout", pa.string(), required=True, default="'node'"),
    ]
)

CREDIT = pa.schema(
    [
        _col("credit_set", pa.string(), required=True),
        _col("trace_id", pa.string(), required=True),
        _col("node_index", pa.int32(), required=True),
        _col("value", pa.float32()),
        _col("advantages", FLOATS),
    ]
)

TRACE_CREDIT = pa.schema(
    [
        _col("credit_set", pa.string(), required=True),
        _col("trace_id", pa.string(), required=True),
        _col("value", pa.float32(), required=True),
    ]
)

_RECORD_TAIL = [
    _col("info", pa.string()),
    _col("record", pa.string(), required=True),
    _col("source", pa.string()),
    _col("line", pa.int64()),
    _col("ingested_at", pa.timestamp("us"), default=NOW),
]

CEC_TRACES = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("baseline_tree", pa.string(), required=True),
        _col("instance_id", pa.string(), required=True),
        _col("rep", pa.string(), required=True),
        _col("cache_salt", pa.string(), required=True),
        *_RECORD_TAIL,
    ]
)

CEC_TURNS = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("node_index", pa.int32(), required=True),
        _col("tree", pa.string(), required=True),
        _col("changed_paths", pa.list_(pa.string()), required=True),
        _col("format_error", pa.bool_(), required=True),
        *_RECORD_TAIL,
    ]
)

CEC_VERIFICATIONS = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("role", pa.string(), required=True),
        _col("status", pa.string(), required=True),
        _col("resolved", pa.bool_()),
        _col("f2p", pa.map_(pa.string(), pa.string())),
        _col("p2p", pa.map_(pa.string(), pa.string())),
        *_RECORD_TAIL,
    ]
)

_F64 = pa.float64()
CEC_SELECTION = pa.schema(
    [
        _col("trace_id", pa.string(), required=True),
        _col("group_key", pa.string()),
        _col("reward", _F64),
        _col("valid", pa.bool_(), required=True),
        _col("advantage", _F64, required=True),
        _col("format_error", pa.bool_(), required=True),
        _col("n_turns", pa.int32(), required=True),
        _col("blocks", pa.string()),
        _col("eligible", pa.list_(pa.int32())),
        _col("selected", pa.int32()),
        _col("selection", pa.string(), required=True),
        _col("selection_detail", pa.string()),
        _col("selected_nodes", pa.list_(pa.int32())),
        _col("touched_paths", pa.list_(pa.string())),
        _col("baseline_tree", pa.string()),
        _col("pre_block_tree", pa.string()),
        _col("final_tree", pa.string()),
        _col("generated_tokens", pa.int64(), required=True),
        _col("edit_tokens", pa.int64()),
        _col("query", pa.string(), required=True),
        _col("intervention", pa.string()),
        *(
            _col(name, _F64)
            for name in (
                *("y_orig", "f_orig", "g_orig", "u_orig", "y_int", "f_int", "g_int", "u_int"),
                *("d", "d_y", "d_f", "d_g", "s", "coef_m", "coef_b", "coef_e"),
            )
        ),
        *(_col(name, _F64, required=True) for name in ("credit_m", "credit_b", "credit_e", "lam", "cap")),
        _col("planned_at", pa.timestamp("us"), default=NOW),
    ]
)

STORED: dict[str, pa.Schema] = {
    "tracedb_meta": META,
    "episodes": EPISODES,
    "traces": TRACES,
    "trace_tags": TRACE_TAGS,
    "follow_positions": FOLLOW_POSITIONS,
    "policy_labels": POLICY_LABELS,
    "segments": SEGMENTS,
    "nodes": NODES,
    "branches": BRANCHES,
    "rejects": REJECTS,
    "credit_sets": CREDIT_SETS,
    "credit": CREDIT,
    "trace_credit": TRACE_CREDIT,
}
"""The tables a reader of the file sees, by name: those of ``schema/tables.sql``, with
``nodes`` and ``segments`` the views over their encoded tables (:data:`ENCODED`)."""

ENCODED: dict[str, tuple[str, pa.Schema]] = {
    "nodes": ("node_store", NODE_STORE),
    "segments": ("segment_store", SEGMENT_STORE),
}
"""The tables kept encoded: the view's name -> the table holding it, and its schema."""

PHYSICAL: dict[str, pa.Schema] = {
    ENCODED[n][0] if n in ENCODED else n: ENCODED[n][1] if n in ENCODED else s for n, s in STORED.items()
}
"""The tables ``schema/tables.sql`` creates, by name."""


def encode_rows(name: str, table: pa.Table) -> tuple[str, pa.Table]:
    """Rows of :data:`STORED` ``[name]`` as the rows of the table that holds them: the same
    rows for a plain table, the encoded ones for ``nodes`` and ``segments``."""
    if name not in ENCODED:
        return name, table
    target, schema = ENCODED[name]
    columns = {n: table.column(n) for n in table.column_names}
    if name == "segments":
        lists = table.column("token_ids").combine_chunks()
        offsets = lists.offsets.to_numpy().astype(np.int64)
        ids = lists.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        if codec.token_form(ids) == "text":
            columns["tokens"] = codec.token_text(ids, offsets - offsets[0])
            columns["token_ids"] = pa.nulls(len(table), pa.list_(pa.int32()))
        else:
            columns["tokens"] = pa.nulls(len(table), pa.string())
    else:
        for column in COMPACT_STREAMS:
            columns[column], columns[f"{column}_list"] = codec.stream_columns(table.column(column))
        weights = table.column("loss_weights")
        columns["loss_weights"] = (
            pa.nulls(len(table), pa.string())
            if weights.null_count == len(weights)
            else codec.loss_weights_text(weights.to_pylist())
        )
    return target, table_from(schema, columns)


CEC_STORED: dict[str, pa.Schema] = {
    "cec_traces": CEC_TRACES,
    "cec_turns": CEC_TURNS,
    "cec_verifications": CEC_VERIFICATIONS,
    "cec_selection": CEC_SELECTION,
}
"""The tables of ``schema/cec.sql`` (installed on first use of counterfactual edit credit)."""

# --------------------------------------------------------------------------- views

KEY_COLUMNS = ("trace_id", "branch_index", "trainable")
"""The columns every branch view has, whatever ``columns=`` asks for."""
TOKEN_COLUMNS = ("token_ids", "sampled_mask", *COMPACT_STREAMS, "loss_weights", "policy_version")
"""A branch view's per-token columns, in view order."""
NULLABLE_TOKEN_COLUMNS = OPTIONAL_STREAMS
"""Token columns that are null on a branch where no node holds the stream (never
scored is not zero credit)."""

BRANCH_SCHEMA = pa.schema(
    [
        pa.field("trace_id", pa.string(), nullable=False),
        pa.field("branch_index", pa.int32(), nullable=False),
        pa.field("trainable", pa.bool_(), nullable=False),
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("sampled_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("logprobs", FLOATS, nullable=False),
        *(pa.field(name, FLOATS) for name in NULLABLE_TOKEN_COLUMNS),
        pa.field("loss_weights", LOSS_WEIGHTS, nullable=False),
        # The policy version of each token (tracedb/policy.py): null off-sample and where
        # unknown; None for a branch none of whose tokens has a known version.
        pa.field("policy_version", pa.list_(pa.int32())),
    ]
)
"""A branch view (``db.branches()``, exports, the REST routes): one row per branch."""
