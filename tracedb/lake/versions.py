"""Per-token policy versions of node columns read from a lake (the views'
``policy_version`` column, a staleness bound's token mask in ``lake.micro_batches``).

The file store's :func:`tracedb.views.versions.attach` reads its tables through a
handle; this reads the same rows of the lake, for the visible ``traces`` rows the node
columns were read of (:func:`tracedb.lake.columns.visible_columns`): the nodes'
``weight_versions`` spans written with them, their episodes' ``policy_start`` /
``work_step`` (the episode row the lake shows) and the lake's label mapping
(:func:`tracedb.lake.labels.mapping`), and hands them to the file store's own rule
(:func:`tracedb.views.versions.attach_rows`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb.lake import files as lake_files
from tracedb.lake import labels, read
from tracedb.lake.catalog import BATCH
from tracedb.lake.columns import written_with
from tracedb.lake.scan import scan_keys
from tracedb.views.nodes import NodeColumns
from tracedb.views.versions import attach_rows


def attach(lake: Any, traces: pa.Table, data: NodeColumns) -> np.ndarray | None:
    """``data.versions`` for node columns read of the visible traces rows ``traces``
    (``trace_id``, :data:`~tracedb.lake.catalog.BATCH`); None when no sampled token has
    a known version (see :func:`tracedb.views.versions.attach`)."""
    if data.versions_read:
        return data.versions
    ids = traces.column("trace_id").combine_chunks()
    if not len(ids) or not int(data.n_sampled.sum()):
        data.versions_read = True
        return None
    wanted = ["trace_id", "node_index", "weight_versions", BATCH]
    nodes = scan_keys(lake.table("nodes"), "trace_id", ids, columns=wanted)
    nodes = written_with(nodes, traces)
    nodes = nodes.filter(pc.fill_null(pc.greater(pc.list_value_length(nodes.column("weight_versions")), 0), False))
    spans = [  # an explicit null is stored as one null span (tracedb.lake.nulls): no spans
        (r["trace_id"], r["node_index"], held)
        for r in nodes.to_pylist()
        if (held := [span for span in r["weight_versions"] if span is not None])
    ]
    vis = written_with(scan_keys(lake.table("traces"), "trace_id", ids, ["trace_id", "episode_id", BATCH]), traces)
    episodes = pc.unique(vis.column("episode_id").drop_null())
    fallbacks: list[tuple[str, int | None]] = []
    if len(episodes):
        raw = scan_keys(
            lake.table("episodes"),
            "episode_id",
            episodes,
            ["episode_id", "policy_start", "work_step", "ingested_at", BATCH],
        )
        con = lake_files.duck()
        try:
            con.register("vis", vis)
            con.register("episode_rows", read.visible_episodes(con, lake, raw, vis))
            fallbacks = con.execute(
                "SELECT v.trace_id, coalesce(e.policy_start, e.work_step) FROM vis v "
                "JOIN episode_rows e USING (episode_id) WHERE coalesce(e.policy_start, e.work_step) IS NOT NULL"
            ).fetchall()
        finally:
            con.close()
    fallbacks = [(t, v) for t, v in fallbacks if t in data.base]
    mapping = labels.mapping(lake) if spans else {}
    return attach_rows(data, fallbacks, spans, mapping)


__all__ = ["attach"]
