"""Read queries behind the routes: listings, a trace's nodes and branches, a group.

Each function takes a :class:`tracedb.Database` and returns plain data; values are
always bound parameters. Token views come from the library (``db.branches()`` and the
``node_tokens()`` macro), so the REST service can never disagree with it.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from tracedb.batches import Plan
from tracedb.batches.plan import SAMPLES_SCHEMA
from tracedb.database import Database
from tracedb.errors import NotFound
from tracedb.selection import Selection, pages, values_of, watermark_of, with_watermark
from tracedb.selection import tag_filters as parse_tag_filters
from tracedb.tables import KEY_COLUMNS, NULLABLE_TOKEN_COLUMNS

from .encode import list_cells
from .errors import invalid, not_found

_ROW = "trace_id, episode_id, group_id, reward, ok, stop_condition, n_nodes, n_branches, n_tokens, n_sampled"


# --------------------------------------------------------------------------- credit sets


def credit_sets(db: Database) -> list[dict[str, Any]]:
    rows = db.credit_sets().to_pylist()
    for row in rows:
        row["params"] = json.loads(row["params"]) if isinstance(row["params"], str) else row["params"]
        row["created_at"] = None if row["created_at"] is None else row["created_at"].isoformat()
    return rows


def credit_name(db: Database, credit: str | None) -> str | None:
    """None for the default (ingested) set, else a named set that must exist (404)."""
    try:
        return db.credit_set_name(credit)
    except NotFound as e:
        raise not_found(str(e)) from None


# --------------------------------------------------------------------------- listing


def _keys(sort: str) -> tuple[str, str]:
    """Ascending sort keys (unscored last) for a reward order; the trace id breaks ties."""
    return "reward IS NULL", "-coalesce(reward, 0)" if sort == "-reward" else "coalesce(reward, 0)"


def encode_cursor(sort: str, row: dict[str, Any]) -> str:
    reward = row["reward"]
    key = [reward is None, 0.0 if reward is None else (-reward if sort == "-reward" else reward), row["trace_id"]]
    return base64.urlsafe_b64encode(orjson.dumps({"sort": sort, "after": key})).decode().rstrip("=")


def decode_cursor(cursor: str, sort: str) -> list[Any]:
    try:
        data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        after = data["after"]
        ok = (
            isinstance(after, list)
            and len(after) == 3
            and isinstance(after[0], bool)
            and isinstance(after[1], int | float)
            and not isinstance(after[1], bool)
            and isinstance(after[2], str)
        )
    except (ValueError, TypeError, KeyError, binascii.Error, UnicodeDecodeError):
        ok = False
    if not ok:
        raise invalid("cursor: not a cursor this server handed out; use next_cursor from a previous page")
    if data.get("sort") != sort:
        raise invalid(f"cursor: it was made for sort={data.get('sort')!r}, not sort={sort!r}")
    return after


def list_traces(
    db: Database,
    *,
    trace_ids: str | Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    ok: bool | None = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    stop_condition: str | None = None,
    sort: str = "trace_id",
    cursor: str | None = None,
    limit: int = 50,
) -> dict[str, Any]:
    """One page of traces, keyset-paginated (stable under concurrent ingest)."""
    where: list[str] = []
    params: list[Any] = []
    trace_ids, group, episode = (None if v is None else values_of(v) for v in (trace_ids, group, episode))
    for clause, value in (
        ("trace_id IN (SELECT unnest(?::VARCHAR[]))", trace_ids),
        ("group_id IN (SELECT unnest(?::VARCHAR[]))", group),
        ("episode_id IN (SELECT unnest(?::VARCHAR[]))", episode),
        ("ok = ?", ok),
        ("reward >= ?", min_reward),
        ("reward <= ?", max_reward),
        ("stop_condition = ?", stop_condition),
    ):
        if value is not None:
            where.append(clause)
            params.append(value)
    order = "trace_id"
    if sort == "trace_id":
        if cursor is not None:
            where.append("trace_id > ?")
            params.append(decode_cursor(cursor, sort)[2])
    else:
        k1, k2 = _keys(sort)
        order = f"{k1}, {k2}, trace_id"
        if cursor is not None:
            a1, a2, a3 = decode_cursor(cursor, sort)
            where.append(f"(({k1}) > ? OR (({k1}) = ? AND ({k2}) > ?) OR (({k1}) = ? AND ({k2}) = ? AND trace_id > ?))")
            params += [a1, a1, a2, a1, a2, a3]
    sql = f"SELECT {_ROW} FROM traces"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY {order} LIMIT ?"
    rows = db.sql(sql, [*params, limit + 1]).to_pylist()
    more = len(rows) > limit
    rows = rows[:limit]
    return {"traces": rows, "next_cursor": encode_cursor(sort, rows[-1]) if more else None}


# --------------------------------------------------------------------------- one trace


def trace_meta(db: Database, trace_id: str) -> dict[str, Any]:
    rows = db.sql(
        f"SELECT {_ROW}, position, is_completed, is_timeout, source, line, ingested_at FROM traces WHERE trace_id = ?",
        [trace_id],
    ).to_pylist()
    if not rows:
        raise not_found(f"trace {trace_id!r} is not in {db.path}")
    row = rows[0]
    row["ingested_at"] = None if row["ingested_at"] is None else row["ingested_at"].isoformat()
    return row


def _only(nodes: Sequence[int] | None) -> tuple[str, list[Any]]:
    """The SQL condition (and its parameter) keeping ``nodes`` only (None: every node)."""
    if nodes is None:
        return "", []
    return " AND node_index IN (SELECT unnest(?::INTEGER[]))", [list(nodes)]


def trace_nodes(
    db: Database,
    trace_id: str,
    credit: str | None,
    *,
    tokens: bool = False,
    messages: bool = False,
    nodes: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """The node list (only ``nodes``, when given): structure, sizes, which streams each
    node holds; arrays on request."""
    only, bound = _only(nodes)
    table = db.sql(
        "SELECT n.node_index, n.parent, n.role, n.sampled, n.n_tokens, n.n_sampled, "
        "  len(coalesce(n.logprobs, [])) > 0 AS has_logprobs, a.advantages IS NOT NULL AS has_advantages, "
        "  n.reference_logprobs IS NOT NULL AS has_reference_logprobs, "
        "  n.trainer_logprobs IS NOT NULL AS has_trainer_logprobs, n.entropies IS NOT NULL AS has_entropies, "
        "  coalesce(map_keys(n.loss_weights), []) AS loss_weight_names, "
        "  coalesce(n.semantic_parents, []) AS semantic_parents, n.message "
        "FROM nodes n JOIN credit_advantages(?) a USING (trace_id, node_index) "
        f"WHERE n.trace_id = ?{only.replace('node_index', 'n.node_index')} ORDER BY n.node_index",
        [credit, trace_id, *bound],
    )
    out = []
    for row in table.to_pylist():
        message = row.pop("message")
        node = {k: v for k, v in row.items() if not k.startswith("has_") or k == "has_logprobs"}
        node["streams"] = [s for s in NULLABLE_TOKEN_COLUMNS if row[f"has_{s}"]]
        node["loss_weight_names"] = sorted(node["loss_weight_names"])
        if messages:
            node["message"] = None if message is None else orjson.loads(message)
        out.append(node)
    if tokens:
        for node, arrays in zip(out, node_tokens(db, trace_id, credit, nodes=nodes), strict=True):
            node["tokens"] = arrays
    return out


def node_tokens(
    db: Database, trace_id: str, credit: str | None, *, nodes: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Per node (only ``nodes``, when given), token ids and every stream in full layout,
    through the ``node_tokens()`` macro."""
    only, bound = _only(nodes)
    table = db.sql(
        "SELECT token_ids, sampled_mask, logprobs, "
        "  CASE WHEN has_advantages THEN advantages END AS advantages, "
        "  CASE WHEN has_reference_logprobs THEN reference_logprobs END AS reference_logprobs, "
        "  CASE WHEN has_trainer_logprobs THEN trainer_logprobs END AS trainer_logprobs, "
        "  CASE WHEN has_entropies THEN entropies END AS entropies, loss_weights "
        f"FROM node_tokens(credit := ?) WHERE trace_id = ?{only} ORDER BY node_index",
        [credit, trace_id, *bound],
    )
    columns = {name: list_cells(table.column(name)) for name in table.column_names if name != "loss_weights"}
    weights = table.column("loss_weights").to_pylist()
    out = []
    for i in range(table.num_rows):
        node = {name: col[i] for name, col in columns.items()}
        node["loss_weights"] = {k: np.asarray(v, np.float32) for k, v in (weights[i] or [])}
        out.append(node)
    return out


def branch_list(
    db: Database, trace_id: str, credit: str | None, *, start: int = 0, limit: int | None = None
) -> list[dict[str, Any]]:
    """The trace's branches in index order, ``limit`` of them (None: all) from branch
    index ``start`` on, each with its credit status in ``credit``; 404 for an unknown trace."""
    trace_meta(db, trace_id)
    rows = db.sql(
        "SELECT b.branch_index, b.trainable, b.leaf, b.path, b.n_tokens, b.n_sampled, "
        "  c.assigned_nodes AS credited_nodes, c.sampled_nodes, c.credit_status "
        "FROM branches b JOIN branch_credit_status(credit := ?) c USING (trace_id, branch_index) "
        "WHERE b.trace_id = ? AND b.branch_index >= ? ORDER BY b.branch_index LIMIT ?",
        [credit, trace_id, start, limit],
    ).to_pylist()
    for row in rows:
        row["credit_assigned"] = row["credited_nodes"] > 0
    return rows


def pick_branch(db: Database, table: pa.Table, trace_id: str, index: int, fields: list[str] | None) -> pa.Table:
    """Branch ``index`` of a trace's view, with the columns (and the exact schema) that
    ``db.branches(trace_ids=[trace_id], columns=fields)`` has; 404 for an unknown trace or index."""
    if table.num_rows == 0:
        trace_meta(db, trace_id)  # 404 for an unknown trace
    if index >= table.num_rows:
        n = table.num_rows
        raise not_found(f"trace {trace_id!r} has {n} branches (0-{n - 1}); no {index}")
    row = table.filter(pc.equal(table.column("branch_index"), index))
    if fields:
        row = row.select([c for c in row.column_names if c in KEY_COLUMNS or c in fields])
    return row


# --------------------------------------------------------------------------- groups


def group(db: Database, group_id: str, credit: str | None) -> dict[str, Any]:
    """A group's members with their credit status in ``credit`` (``trace_credit_status()``)
    and its reward figures (``group_rewards()``, whose rule says what zero variance is)."""
    rows = db.sql(
        f"SELECT {', '.join('t.' + c for c in _ROW.split(', '))}, "
        "  c.assigned_nodes AS credited_nodes, c.sampled_nodes, c.credit_status "
        "FROM traces t JOIN trace_credit_status(credit := ?) c USING (trace_id) "
        "WHERE t.group_id = ? ORDER BY t.trace_id",
        [credit, group_id],
    ).to_pylist()
    if not rows:
        raise not_found(f"group {group_id!r} has no traces in {db.path}")
    figures = db.sql("SELECT * FROM group_rewards() WHERE group_id = ?", [group_id]).to_pylist()[0]
    return {
        "group_id": group_id,
        "n_traces": len(rows),
        "reward_mean": figures["reward_mean"],
        "reward_std": figures["reward_std"] if figures["scored"] else None,
        "zero_variance": figures["zero_variance"],
        "traces": rows,
    }


def node_exists(db: Database, trace_id: str, index: int) -> None:
    """404 unless the trace and its node exist."""
    meta = trace_meta(db, trace_id)
    if index >= meta["n_nodes"]:
        raise not_found(f"trace {trace_id!r} has {meta['n_nodes']} nodes (0-{meta['n_nodes'] - 1}); no node {index}")


# --------------------------------------------------------------------------- live runs


def tag_filters(values: Sequence[str] | None) -> dict[str, Any] | None:
    """``?tag=`` values as the library's ``tags`` (:func:`tracedb.views.tag_filters`);
    422 naming the parameter for anything else."""
    try:
        return parse_tag_filters(values)
    except ValueError as e:
        raise invalid(f"tag: {e}") from None


def _library(call: Any) -> Any:
    """``call()``, the library's refusal of an argument (ValueError, TypeError) as a 422."""
    try:
        return call()
    except (ValueError, TypeError) as e:
        raise invalid(str(e)) from None


def live_traces(db: Database, selection: Selection, *, limit: int | None = None) -> dict[str, Any]:
    """The selected traces in arrival order (sequence number), with the watermark to pass
    as ``after`` next time, ``more`` when ``limit`` stopped the listing short of it, and
    ``read_at``: the watermark the selection was read at."""
    pinned = selection.pinned(db.watermark())
    table = _library(lambda: db.traces(limit=limit, **pinned.kwargs()))
    mark = watermark_of(table)
    assert mark is not None and pinned.through is not None
    rows = table.to_pylist()
    for row in rows:
        row["ingested_at"] = None if row["ingested_at"] is None else row["ingested_at"].isoformat()
        row["tags"] = orjson.loads(row["tags"]) if row["tags"] else {}
    return {"watermark": mark, "more": mark < pinned.through, "read_at": pinned.through, "traces": rows}


def in_selection(db: Database, trace_id: str, selection: Selection) -> int | None:
    """The watermark the selection was read at when ``trace_id`` is in it, else None (404
    for a trace not in the database at all)."""
    trace_meta(db, trace_id)
    one = replace(selection.pinned(db.watermark()), trace_ids=[trace_id])
    table = _library(lambda: db.traces(**one.kwargs()))
    return watermark_of(table) if table.num_rows else None


def view_sizes(
    db: Database, trace_ids: list[str], trainable: bool | None, branch_index: list[int] | None
) -> tuple[dict[str, int], dict[str, int]]:
    """Tokens and branches of each trace's branch view (the branches kept by the filters)."""
    where, params = ["trace_id IN (SELECT unnest(?::VARCHAR[]))"], [trace_ids]
    if trainable is not None:
        where.append("trainable = ?")
        params.append(trainable)
    if branch_index is not None:
        where.append("branch_index IN (SELECT unnest(?::INTEGER[]))")
        params.append(branch_index)
    table = db.sql(
        f"SELECT trace_id, sum(n_tokens)::BIGINT AS n, count(*)::BIGINT AS rows FROM branches "
        f"WHERE {' AND '.join(where)} GROUP BY trace_id",
        params,
    )
    ids = table.column("trace_id").to_pylist()
    tokens, rows = dict.fromkeys(trace_ids, 0), dict.fromkeys(trace_ids, 0)
    tokens.update(zip(ids, table.column("n").to_pylist(), strict=True))
    rows.update(zip(ids, table.column("rows").to_pylist(), strict=True))
    return tokens, rows


def select_branches(
    db: Database,
    selection: Selection,
    *,
    trainable: bool | None,
    branch_index: list[int] | None,
    columns: list[str] | None,
    train_once: bool,
    credit: str | None,
    token_limit: int,
    row_limit: int,
) -> tuple[pa.Table, dict[str, Any]]:
    """The branch views of a selection, whole traces in arrival order up to
    ``token_limit`` view tokens and ``row_limit`` branches (with ``complete_groups``,
    whole groups in the order they completed); the table carries the watermark to pass
    as ``after`` to get the rest and what came since. 422 when the first trace (or
    group) alone is over a limit. The branch limit bounds what the token limit cannot:
    branches that hold few tokens or none."""
    pinned = selection.pinned(db.watermark())
    listing = _library(lambda: db.traces(**pinned.kwargs()))
    ids = listing.column("trace_id").to_pylist()
    sizes, counts = view_sizes(db, ids, trainable, branch_index)
    total, rows = sum(sizes.values()), sum(counts.values())
    mark = watermark_of(listing)
    limits = {"tokens": token_limit, "branches": row_limit}
    truncated_by = None
    if total > token_limit or rows > row_limit:
        # The traces that fit both limits, in arrival order; the listing then rounds them to whole groups.
        fits = {
            "tokens": next(pages([sizes[t] for t in ids], token_limit, overshoot=False)).stop,
            "branches": next(pages([counts[t] for t in ids], row_limit, overshoot=False)).stop,
        }
        truncated_by = min(fits, key=lambda k: fits[k])
        fit = fits[truncated_by]
        while True:  # each pass drops at least one trace (or group)
            page = db.traces(limit=max(fit, 1), **pinned.kwargs())
            kept = page.column("trace_id").to_pylist()
            total, rows = sum(sizes[t] for t in kept), sum(counts[t] for t in kept)
            over = "tokens" if total > token_limit else "branches" if rows > row_limit else None
            if over is None:
                break
            if len(kept) <= 1 or fit <= 1:
                first = page.column("group_id")[0].as_py()
                what = f"group {first!r}" if selection.complete_groups else f"trace {kept[0]!r}"
                size = f"{total} view tokens" if over == "tokens" else f"{rows} branches"
                option = "--branch-token-limit" if over == "tokens" else "--branch-row-limit"
                raise invalid(
                    f"the selection's first {what} has {size}, over this server's branch "
                    f"{'token' if over == 'tokens' else 'row'} limit ({limits[over]}): narrow it (trace_id, "
                    f"branch_index, trainable) or raise {option}"
                )
            fit = len(kept) - 1
        ids, mark = kept, watermark_of(page)
    table = _library(
        lambda: db.branches(
            trace_ids=ids,
            trainable=trainable,
            branch_index=branch_index,
            columns=columns,
            train_once=train_once,
            credit=credit,
        )
    )
    why = {
        "tokens": f"the next trace would pass this server's branch token limit ({token_limit} view tokens)",
        "branches": f"the next trace would pass this server's branch row limit ({row_limit} branches)",
    }
    info = {
        "watermark": mark,
        "traces": len(ids),
        "tokens": total,
        "token_limit": token_limit,
        "n_branches": rows,
        "branch_limit": row_limit,
        "truncated": truncated_by is not None,
        "truncated_by": truncated_by,
        "truncated_why": f"{why[truncated_by]}; pass after={mark} for the rest" if truncated_by else None,
    }
    return with_watermark(table, mark), info


def rank_table(plan: Plan, rank: int, part: str) -> pa.Table:
    """One rank's micro-batches as ``tracedb pack`` lays them out: ``tokens``, one record
    batch per micro-batch (``rank_R.arrow``); ``samples``, the samples of every
    micro-batch with a ``micro_batch`` column (``rank_R.samples.arrow``)."""
    batches = plan[rank]
    if part == "tokens":
        return pa.Table.from_batches([mb.tokens for mb in batches]) if batches else pa.schema([]).empty_table()
    schema = SAMPLES_SCHEMA.append(pa.field("micro_batch", pa.int32(), nullable=False))
    parts = [
        mb.samples.append_column("micro_batch", pa.array([i] * mb.samples.num_rows, pa.int32()))
        for i, mb in enumerate(batches)
    ]
    return pa.concat_tables(parts) if parts else schema.empty_table()  # as write_step writes it
