"""The :class:`Lake`: one open lake, the calls a user makes on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from tracedb.database import Database, connect
from tracedb.lake import catalog, move
from tracedb.lake.write import AppendReport, append
from tracedb.selection import Selection

if TYPE_CHECKING:
    import ray.data

    from tracedb.batches import Plan
    from tracedb.lake.compact import CompactReport
    from tracedb.lake.ingest import LakeIngestReport


class Lake(catalog.Opened):
    """An open tracedb lake. Make one with :func:`tracedb.lake.init`, open with
    :func:`tracedb.lake.open`."""

    def __repr__(self) -> str:
        return f"Lake({self.location.where!r})"

    @property
    def where(self) -> str:
        return self.location.where

    @property
    def buckets(self) -> int:
        """The hash buckets of the lake's tables (chosen when it was made, see :func:`init`)."""
        return catalog.lake_buckets(catalog.meta_rows(self.table(catalog.META)))

    # ----------------------------------------------------------------- writing

    def append(self, rows: dict[str, pa.Table]) -> AppendReport:
        """Append the traces of ``rows`` (tables by name in the stored schemas) the lake
        does not show yet, as one write (see :mod:`tracedb.lake.write`)."""
        return append(self, rows)

    def push(self, db: str | Path | Database, *, batch_traces: int = move.PUSH_TRACES) -> AppendReport:
        """Push a file store's traces (with their episodes, nodes, segments, branches,
        tags and credit; its credit sets and rejects) into the lake, ``batch_traces`` per
        write. Idempotent by trace id: traces the lake shows already are skipped, but the
        credit sets the lake lacks are added for them too; a set the lake holds with other
        values is refused, naming it (see :func:`tracedb.lake.move.push`)."""
        with _database(db, read_only=True) as database:
            return move.push(self, database, batch_traces)

    # ----------------------------------------------------------------- reading

    def tables(
        self,
        *,
        trace_ids: str | Sequence[str] | None = None,
        group: str | Sequence[str] | None = None,
        episode: str | Sequence[str] | None = None,
        after: int | None = None,
        complete_groups: int | None = None,
        tags: Mapping[str, Any] | None = None,
        through: int | None = None,
        policy: int | None = None,
        max_staleness: int | None = None,
        stale: str | None = None,
        unknown: str | None = None,
        include_dropped: bool | None = None,
        include_eval: bool | None = None,
        max_groups: int | None = None,
    ) -> dict[str, pa.Table]:
        """The visible rows of the selected traces in every table, by name (see
        :func:`tracedb.lake.read.visible`); the selection is :meth:`branches`'."""
        from tracedb.lake.select import visible_tables

        selection = Selection.of(locals())
        return visible_tables(self, selection)

    def watermark(self) -> int:
        """The sequence number of the latest ``traces`` commit (0 before the first): at
        least the highest ``seq`` of a visible trace, higher after a compaction or upgrade
        rewrote ``traces`` (the rewrite is a commit, its rows keep their ``seq``). Every
        trace committed later gets a ``seq`` above it, so it is the ``after`` that selects
        exactly those."""
        snapshot = self.table("traces").current_snapshot()
        return 0 if snapshot is None else snapshot.sequence_number

    def pull(
        self,
        db: str | Path | Database,
        *,
        trace_ids: Sequence[str] | None = None,
        group: str | Sequence[str] | None = None,
        episode: str | Sequence[str] | None = None,
        after: int | None = None,
        complete_groups: int | None = None,
        tags: Mapping[str, Any] | None = None,
        through: int | None = None,
        policy: int | None = None,
        max_staleness: int | None = None,
        stale: str | None = None,
        unknown: str | None = None,
        include_dropped: bool | None = None,
        include_eval: bool | None = None,
        max_groups: int | None = None,
    ) -> int:
        """Write the selected visible traces (all by default) into a file store (created
        if missing), skipping those it holds; returns how many were added. The selection
        is :meth:`branches`' (``after`` / ``through`` / ``complete_groups`` on the lake's
        ``seq``, ``tags`` on its ``trace_tags``). ``db.trace()`` of a pulled trace equals
        what the pushed file store returned."""
        from tracedb.lake.select import visible_tables

        rows = visible_tables(
            self,
            Selection.of(locals()),
        )
        with _database(db, read_only=False) as database:
            return move.write_into(database, rows)

    def branches(
        self,
        *,
        trace_ids: Sequence[str] | None = None,
        group: str | Sequence[str] | None = None,
        episode: str | Sequence[str] | None = None,
        after: int | None = None,
        complete_groups: int | None = None,
        tags: Mapping[str, Any] | None = None,
        through: int | None = None,
        policy: int | None = None,
        max_staleness: int | None = None,
        stale: str | None = None,
        unknown: str | None = None,
        include_dropped: bool | None = None,
        include_eval: bool | None = None,
        max_groups: int | None = None,
        trainable: bool | None = None,
        branch_index: int | Sequence[int] | None = None,
        columns: Sequence[str] | None = None,
        train_once: bool = False,
        credit: str | None = None,
        traces_per_task: int = 256,
    ) -> ray.data.Dataset:
        """The branch views of the selected visible traces as a ``ray.data.Dataset`` in
        the :meth:`tracedb.Database.branches` schema, computed in Ray workers
        (``traces_per_task`` traces each, taken by trace-id bucket) by the file store's own
        view code; the arguments are :meth:`tracedb.Database.branches`', selecting what the
        file store's selection does (``after`` / ``through`` / ``complete_groups`` compare
        with the lake's ``seq``; ``tags`` filter on the lake's ``trace_tags``; see
        :mod:`tracedb.lake.select`). Runs on the Ray of this process, started when none runs
        (:func:`tracedb.lake.workers.running_ray`: ``RAY_ADDRESS``, else a local one)."""
        from tracedb.lake import views

        return views.branches(
            self,
            Selection.of(locals()),
            trainable=trainable,
            branch_index=branch_index,
            columns=columns,
            train_once=train_once,
            credit=credit,
            traces_per_task=traces_per_task,
        )

    def micro_batches(
        self,
        seq_len: int,
        *,
        ranks: int = 1,
        trace_ids: Sequence[str] | None = None,
        group: str | Sequence[str] | None = None,
        episode: str | Sequence[str] | None = None,
        after: int | None = None,
        complete_groups: int | None = None,
        tags: Mapping[str, Any] | None = None,
        through: int | None = None,
        policy: int | None = None,
        max_staleness: int | None = None,
        stale: str | None = None,
        unknown: str | None = None,
        include_dropped: bool | None = None,
        include_eval: bool | None = None,
        max_groups: int | None = None,
        trainable: bool | None = True,
        branch_index: int | Sequence[int] | None = None,
        credit: str | None = None,
        train_once: bool = True,
        overflow: str = "truncate",
        cost: tuple[float, float] = (1.0, 0.0),
        pad_to_multiple_of: int = 1,
        pad_token_id: int = 0,
        share_prefixes: bool = False,
        drop_zero_advantages: bool = False,
        importance: str | None = None,
        clip: float | None = None,
    ) -> Plan:
        """Packed, rank-balanced micro-batches of the selected visible traces: the plan
        :meth:`tracedb.Database.micro_batches` makes of the same traces (the same
        arguments and selection; ``after`` / ``through`` / ``complete_groups`` compare with
        the lake's ``seq``, and ``plan.report.watermark`` is the lake's, the ``after`` of the
        next step). The driver reads the selection's node columns straight from the lake's
        files and packs them with the file store's code (no Ray needed). Write it with
        :func:`tracedb.batches.write_step`."""
        from tracedb.lake import train

        return train.micro_batches(
            self,
            seq_len,
            Selection.of(locals()),
            ranks=ranks,
            trainable=trainable,
            branch_index=branch_index,
            credit=credit,
            train_once=train_once,
            overflow=overflow,
            cost=cost,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_token_id=pad_token_id,
            share_prefixes=share_prefixes,
            drop_zero_advantages=drop_zero_advantages,
            importance=importance,
            clip=clip,
        )

    def export(
        self,
        path: str | Path,
        *,
        format: str | None = None,
        trace_ids: Sequence[str] | None = None,
        group: str | Sequence[str] | None = None,
        episode: str | Sequence[str] | None = None,
        after: int | None = None,
        complete_groups: int | None = None,
        tags: Mapping[str, Any] | None = None,
        through: int | None = None,
        policy: int | None = None,
        max_staleness: int | None = None,
        stale: str | None = None,
        unknown: str | None = None,
        include_dropped: bool | None = None,
        include_eval: bool | None = None,
        max_groups: int | None = None,
        trainable: bool | None = None,
        columns: Sequence[str] | None = None,
        train_once: bool = False,
        credit: str | None = None,
        compression: str | None = "zstd",
    ) -> dict[str, Any]:
        """Write the branch views of the selected visible traces to ``path`` (``.parquet``,
        ``.arrow``, ``.arrows``; ``format`` overrides the suffix), as
        :meth:`tracedb.Database.export` writes a file's: the same arguments and selection
        (``after`` / ``through`` / ``complete_groups`` on the lake's ``seq``; with
        ``trainable=True`` dropped traces and eval episodes out unless kept), the same
        columns, published whole or not at all. The driver pulls the selection a chunk of
        traces at a time (no Ray). Returns rows, tokens, bytes and the lake's watermark
        the selection was read at (also in the file's schema)."""
        from tracedb.lake import export

        return export.export(
            self,
            path,
            Selection.of(locals()),
            format=format,
            trainable=trainable,
            columns=None if columns is None else list(columns),
            train_once=train_once,
            credit=credit,
            compression=compression,
        )

    def credit(
        self,
        algorithm: str,
        name: str | None = None,
        *,
        trace_ids: str | Sequence[str] | None = None,
        group: str | Sequence[str] | None = None,
        episode: str | Sequence[str] | None = None,
        after: int | None = None,
        complete_groups: int | None = None,
        tags: Mapping[str, Any] | None = None,
        through: int | None = None,
        policy: int | None = None,
        max_staleness: int | None = None,
        stale: str | None = None,
        unknown: str | None = None,
        include_dropped: bool | None = None,
        include_eval: bool | None = None,
        max_groups: int | None = None,
        **params: Any,
    ) -> dict[str, Any]:
        """Compute group credit (``"grpo"`` or ``"rloo"``, with that algorithm's parameters:
        ``reward``, ``group_by``, ``include_failed``, ``include_dropped``,
        ``include_eval``; grpo's ``scale_std``, ``eps``) over the visible traces, each group
        in a Ray ``groupby`` by the file store's own algorithm, and append it as credit set
        ``name`` (default: the algorithm's name; stored per trace). Returns the set's name,
        algorithm, parameters and rows. Runs on the Ray of this process (started when none
        runs, as :meth:`branches` says).

        Without a selection the whole set is written once: a set of that name in the lake
        is refused. With one (the fields of :meth:`branches`: ``after=W,
        complete_groups=N``, a staleness bound, ``max_groups``, ids, tags), only the
        selected traces are stamped, into the set, created on first use, as
        :func:`tracedb.credit.run` does for a file: group means over each selected trace's
        whole group as the lake holds it, dropped and eval traces left out unless
        included, the same algorithm and parameters as the set was made with, and a trace
        the set already holds refused (a lake does not recompute a trace's credit). The
        result then has the traces selected, their ``watermark`` (the next step's
        ``after``) and the selection's report."""
        from tracedb.lake import credit

        selection = Selection.of(locals())
        for flag in ("include_dropped", "include_eval"):  # also the algorithm's: credit them and select them
            if getattr(selection, flag) is not None:
                params[flag] = getattr(selection, flag)
        narrowed = dataclasses.replace(selection, include_dropped=None, include_eval=None)
        return credit.run(self, algorithm, name, selection=None if narrowed.everything else selection, **params)

    def set_policy_versions(self, mapping: Mapping[str, int]) -> int:
        """Map weight labels that name no number of their own to policy versions in the
        lake (``{"ckpt-abc": 12}``, as :meth:`tracedb.Database.set_policy_versions`): the
        mapping is appended, then every visible trace whose spans use one of the labels
        gets its bounds again and ``traces`` is rewritten (each trace keeps its ``seq``).
        Returns how many traces that was. Writers that ingest traces using these labels
        while it runs keep the bounds they computed (see :mod:`tracedb.lake.labels`)."""
        from tracedb.lake import labels

        return labels.set_versions(self, mapping)

    def policy_versions(self) -> dict[str, int]:
        """The lake's mapped weight labels and their policy versions."""
        from tracedb.lake import labels

        return labels.mapping(self)

    def compact(
        self, *, grace: float = 3600.0, expire_older_than: float | None = None, full: bool = False
    ) -> CompactReport:
        """Rewrite the files added to each table since its last compaction (``full``: every
        file) holding only what readers see (removing rows of writes that never committed
        their traces row, rows of writes that lost the race for a trace id, duplicate
        segments, rejects and credit sets), one file per partition, and merge each table's
        manifests: readers' answers are unchanged (``traces`` rows keep their ``seq``,
        stored in the row; the rewrite is a traces commit, so the watermark moves past
        it). A file holding rows of an uncommitted write, added less than ``grace`` seconds
        ago, is left for a later compaction (its writer may still be at work). With
        ``expire_older_than`` (seconds), snapshots replaced longer ago than that are
        expired and the files no snapshot refers to that are older than ``grace`` are
        deleted. See :mod:`tracedb.lake.compact`."""
        from tracedb.lake import compact

        return compact.compact(self, grace=grace, expire_older_than=expire_older_than, full=full)

    def ingest(
        self,
        paths: str | Path | Iterable[str | Path],
        *,
        workers: int | None = None,
        files_per_task: int = 1,
        allow_ragged: bool = False,
        range_bytes: int | None = None,
        commit_traces: int | None = None,
    ) -> LakeIngestReport:
        """Ingest ``traces.jsonl`` files or directories into the lake in Ray tasks
        (``files_per_task`` files each, at most ``workers`` at once; default: Ray's CPUs):
        each task runs the file store's ingest (scanner, parser, validation, rejects kept)
        in memory and appends its traces as one write. A plain ``.jsonl`` file larger than
        ``range_bytes`` (default 128 MiB) is cut at line starts into byte ranges of about
        that size, a task each, its lines and rejects numbered as in the whole file
        (compressed and ``.json`` files are never cut). The tasks stage their writes (data
        files, nothing visible) and this process commits them together once they hold
        ``commit_traces`` traces (default 256), and the rest at the end: one commit per
        table, ``traces`` last. Idempotent by trace id, also against other ingests running
        at the same time. Runs on the Ray of this process (started when none runs, as
        :meth:`branches` says)."""
        from tracedb.lake import ingest

        chosen = [paths] if isinstance(paths, str | Path) else list(paths)
        return ingest.ingest(
            self,
            chosen,
            workers=workers,
            files_per_task=files_per_task,
            allow_ragged=allow_ragged,
            range_bytes=ingest.RANGE_BYTES if range_bytes is None else range_bytes,
            commit_traces=ingest.COMMIT_TRACES if commit_traces is None else commit_traces,
        )

    def sql(
        self, query: str, params: Sequence[Any] | dict[str, Any] | None = None, *, portable: bool = False
    ) -> pa.Table:
        """Run SQL over the lake's visible rows with tracedb's macros (``branch_stats()``,
        ``node_credit()``, ...), as :meth:`tracedb.Database.sql` does over a file.

        Only what the query needs is read: the filters and columns DuckDB's plan pushes
        into each table's scans (and the trace or segment ids its joins carry) become
        pyiceberg row filters and projections; the visible rows read are registered
        under the tables' names, the macros created over them (see
        :mod:`tracedb.lake.sqlscan`). Only reads run (every statement is checked first,
        :mod:`tracedb.sqlcheck`; ``COPY (query) TO 'file'`` outside the lake is one);
        ``portable`` as in :meth:`tracedb.Database.sql`."""
        from tracedb.lake import sqlscan

        return sqlscan.run(self, query, params, portable=portable)[0]


@contextmanager
def _database(db: str | Path | Database, *, read_only: bool) -> Iterator[Database]:
    """A Database for the block: the one passed in (left open), or a path opened and closed."""
    if isinstance(db, Database):
        yield db
        return
    path = Path(db)
    if read_only and not path.exists():
        raise catalog.LakeError(f"no database at {path}")
    with connect(path, read_only=read_only) as opened:
        yield opened


def init(lake: str | Path, *, buckets: int | None = None) -> Lake:
    """Make a lake (idempotent: an existing one gets the tables it lacks, and a lake of
    an older layout version is upgraded to this one, see :mod:`tracedb.lake.upgrade`)
    and open it. ``lake`` is a directory (created; a SQLite catalog and the warehouse go
    inside) or a ``.yaml``/``.json`` file of pyiceberg catalog properties. ``buckets``:
    the hash buckets of a new lake's tables (default
    :data:`~tracedb.lake.catalog.DEFAULT_BUCKETS`); an existing lake keeps its own (asking
    for another count is a :class:`~tracedb.lake.catalog.LakeError`)."""
    from tracedb.lake.upgrade import upgrade

    location = catalog.locate(lake)
    if Path(lake).suffix not in catalog.PROPERTY_FILES:
        Path(lake).mkdir(parents=True, exist_ok=True)
    catalog.create(location, buckets)
    upgrade(location)
    return open_lake(lake)


def open_lake(lake: str | Path) -> Lake:
    """Open the lake at ``lake`` (a directory :func:`init` made, or a ``.yaml``/``.json``
    of pyiceberg catalog properties); :class:`~tracedb.lake.catalog.LakeError` when it
    is not a lake of this version."""
    location = catalog.locate(lake)
    return Lake.at(location)
