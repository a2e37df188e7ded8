"""Upgrading a lake's layout to this tracedb's (:data:`~tracedb.lake.catalog.LAKE_SCHEMA_VERSION`).

1 → 2: a version-1 writer stored the file store's ``seq`` in each ``traces`` row (a push
copied it) and readers took the data sequence number of the file holding the row; a
version-2 reader takes a stored seq when there is one. The upgrade rewrites ``traces``
with compaction's own rewrite (:func:`tracedb.lake.compact.rewrite_traces`: the visible
row per trace id), each row's stored seq set to the data sequence number of the file
holding it then, whatever version 1 stored, so every trace keeps the seq version-1
readers gave it; then it sets the meta row to 2.

Crash-safe by its order and its marker: the rewrite's snapshot carries
:data:`UPGRADED` in its summary, in the same commit as the rows, and the meta row is
set last. A rerun after a crash between the two takes the stored seq of the files that
snapshot added (they are right already, and their files' own numbers are the
rewrite's) and the file's number everywhere else (rows a version-1 writer appended
since); it does not rewrite again when the rewrite is the current snapshot. Stop the
lake's writers while it runs: a version-1 writer keeps writing until the meta row says 2.

2 → 3: the file store's schema-6 columns are added to the tables and filled in from the
rows' records, as the file store's migration fills them, ``traces`` rewritten last with
every seq kept (:mod:`tracedb.lake.policy_columns`), then the meta row is set to 3. A
rerun fills only what is still empty. A lake of version 1 goes through both.
"""

from __future__ import annotations

from typing import Any

from tracedb.lake import catalog, compact, policy_columns

UPGRADED = "tracedb.lake-schema-version"
"""The snapshot summary property marking the upgrade's rewrite of ``traces`` (value: the
version it upgrades to)."""


def upgrade(location: catalog.Location) -> int | None:
    """Upgrade the lake at ``location`` to this version; returns the version it had (None:
    it was of this version already, nothing done). A lake of a newer or unknown version
    is refused (:class:`~tracedb.lake.catalog.LakeError`). Run after
    :func:`tracedb.lake.catalog.create` (which makes the tables a version lacks)."""
    load = compact.own_tables(location)
    version = catalog.meta_rows(load(catalog.META)).get(catalog.VERSION_KEY)
    if version == str(catalog.LAKE_SCHEMA_VERSION):
        return None
    if version not in ("1", "2"):
        raise catalog.LakeError(f"lake {location.where}: {catalog.version_problem(version, location.where)}")
    if version == "1":
        _stored_seqs(load)
        catalog.set_meta(load(catalog.META), catalog.VERSION_KEY, "2")
    policy_columns.add_columns(load)
    policy_columns.fill(load, properties={UPGRADED: "3"})
    catalog.set_meta(load(catalog.META), catalog.VERSION_KEY, str(catalog.LAKE_SCHEMA_VERSION))
    return int(version)


def _stored_seqs(load: Any) -> None:
    """1 → 2: ``traces`` rewritten with each row's seq its file's (see the module's docstring)."""
    traces = load("traces")
    marked = {s.snapshot_id for s in traces.metadata.snapshots if s.summary and s.summary[UPGRADED] == "2"}
    current = traces.current_snapshot()
    if current is not None and current.snapshot_id not in marked:
        compact.rewrite_traces(load, stored_from=marked, properties={UPGRADED: "2"}, force=True)


__all__ = ["UPGRADED", "upgrade"]
