"""The facade: :class:`Database` and :func:`connect`, the names a user types.

A database is one DuckDB file (or ``:memory:``) holding episodes, traces, nodes,
deduplicated token segments and precomputed branches, with tracedb's SQL macros
installed in it so that any DuckDB client can query it. :class:`Database` stores nothing
itself: each method is one call into the package that does the work (ingest, views,
writeback, readback, export, the credit-set registry), on the database's
:class:`~tracedb.handle.Handle`. The packages behind the views, records, export, stats,
write-back and credit-set methods are imported by the method that uses them, so a process
that only ingests (``tracedb ingest``) does not pay for them (~0.1 s of start-up).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb
import pyarrow as pa

from tracedb import migrations
from tracedb.dbfile import open_handle
from tracedb.handle import Handle
from tracedb.ingest import IngestReport, ingest_files
from tracedb.selection import Selection

if TYPE_CHECKING:
    from tracedb.batches import Plan, Replay
    from tracedb.ingest.follow import Follower, FollowEvent


class Database:
    """A tracedb database. Create with :func:`tracedb.connect`."""

    def __init__(self, path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> None:
        self.handle: Handle = open_handle(path, read_only=read_only, isolated=isolated)
        """The connection, its transaction and the SQL helpers every package works on."""

    @classmethod
    def on(cls, handle: Handle) -> Database:
        """The facade over an open handle (the REST server puts one over a per-thread handle)."""
        db = cls.__new__(cls)
        db.handle = handle
        return db

    # ----------------------------------------------------------------- lifecycle

    @property
    def path(self) -> str:
        return self.handle.path

    @property
    def con(self) -> duckdb.DuckDBPyConnection:
        """The DuckDB connection (its default catalog is this database)."""
        return self.handle.con

    @property
    def schema_version(self) -> int | None:
        """The schema version the file holds (this tracedb's once it is open)."""
        return self.handle.stored_version()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to this database, for another thread (a DuckDB connection is
        not meant to be shared between threads that run queries at the same time)."""
        return self.handle.cursor()

    def close(self) -> None:
        """Close the database (idempotent); a database opened for writing is checkpointed.

        Raises (and can be retried) while another thread is still running a query on the
        connection."""
        self.handle.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- queries

    def sql(
        self,
        query: str,
        params: Sequence[Any] | dict[str, Any] | None = None,
        *,
        read_only: bool = False,
        portable: bool = False,
    ) -> pa.Table:
        """Run SQL (tracedb's macros are available) and return the result as Arrow.

        ``read_only=True`` (``tracedb sql`` without ``--write``) first checks that every
        statement only reads (SELECT, EXPLAIN of one, ``COPY (query) TO 'file'``), with
        DuckDB's parser, whatever the file was opened as; :class:`~tracedb.errors.SqlRefused`
        before anything runs otherwise (:mod:`tracedb.sqlcheck`). ``portable=True`` gives
        values Arrow or Python cannot hold faithfully (128-bit integers, dates past year
        9999 or infinite, times with a time zone, intervals, ...) as DuckDB's text of them,
        nesting kept (:mod:`tracedb.sqlvalues`; what ``tracedb sql`` prints)."""
        if read_only:
            from tracedb import sqlcheck

            sqlcheck.check(self.handle.con, query, copy_to_file=True)
        return self.handle.sql(query, params, portable=portable)

    def scalar(self, query: str, params: Sequence[Any] | None = None) -> Any:
        """The first value of the first row of a query, or None."""
        return self.handle.scalar(query, params)

    def stats(self) -> dict[str, Any]:
        """Counts and sizes: episodes, traces, nodes, branches, tokens, bytes, dedup ratio."""
        from tracedb import readback

        return readback.stats(self.handle)

    def storage(self) -> dict[str, Any]:
        """Where the file's bytes are: per table and column (with DuckDB's compression
        methods), metadata, ART indexes, free blocks; see :mod:`tracedb.storage`."""
        from tracedb import storage

        return storage.storage_bytes(self.handle)

    # ----------------------------------------------------------------- ingest

    def ingest(
        self,
        paths: str | Path | Iterable[str | Path],
        *,
        strict: bool = False,
        allow_ragged: bool = False,
        progress: bool = False,
        whole_files: bool = False,
        tags: Iterable[str] = (),
    ) -> IngestReport:
        """Ingest ``traces.jsonl`` / ``.jsonl.zst`` / ``.json`` files or directories.

        Idempotent by trace id. Bad records are rejected with their location and kept in
        the ``rejects`` table while good ones are ingested; ``strict=True`` aborts on the
        first rejection and leaves the database unchanged (:class:`IngestAborted`).
        ``allow_ragged`` accepts compact streams whose length differs from the sampled
        count (they spread as verifiers spreads them). A file that cannot be read to its end
        (corrupt or truncated compression) keeps the lines before the damage and is
        reported in ``report.unreadable`` and ``rejects``; ``whole_files=True`` raises
        :class:`~tracedb.errors.InputError` instead and writes nothing. ``tags``
        (``"step=12"``, ``"step=$.info.step"``) are stored on every trace added, in
        ``trace_tags`` (see :mod:`tracedb.ingest.tags`). Each trace added gets the next
        sequence number (:meth:`watermark`). Returns an ``IngestReport``.
        """
        return ingest_files(
            self.handle,
            paths,
            strict=strict,
            allow_ragged=allow_ragged,
            progress=progress,
            whole_files=whole_files,
            tags=tags,
        )

    def follow(
        self,
        paths: str | Path | Sequence[str | Path],
        *,
        interval: float = 0.25,
        settle: float = 2.0,
        tags: Iterable[str] = (),
        allow_ragged: bool = False,
        rotated: Iterable[str] = (),
        on_commit: Callable[[IngestReport], None] | None = None,
        on_event: Callable[[FollowEvent], None] | None = None,
    ) -> Follower:
        """A follower of a live run into this database: :meth:`~tracedb.ingest.follow.Follower.poll`
        ingests the whole lines added to ``paths`` (files or directories, followed
        recursively) since the last poll, :meth:`~tracedb.ingest.follow.Follower.run` polls
        every ``interval`` seconds until stopped. Positions are committed with the lines,
        so a follower started again on the same database goes on where the last one
        stopped. Compressed and ``.json`` files are ingested once unchanged for ``settle``
        seconds. A rotated file (renamed, or copied and truncated: ``rotated`` adds glob
        patterns of the copies' names, ``{name}``/``{stem}`` standing for the file's) is read
        to its end first; what no file holds any more is reported (see ``docs/live.md``).
        ``tags`` and ``allow_ragged`` are :meth:`ingest`'s; ``on_commit`` is called with each
        commit's report, ``on_event`` with each restart, rotation and loss. Close the
        follower (it holds descriptors on the files) when done; give it a database of its own
        when other threads use this one."""
        from tracedb.ingest.follow import Follower

        chosen = [paths] if isinstance(paths, str | Path) else list(paths)
        return Follower(
            self.handle,
            chosen,
            interval=interval,
            settle=settle,
            tags=list(tags),
            allow_ragged=allow_ragged,
            rotated=list(rotated),
            on_commit=on_commit,
            on_event=on_event,
        )

    def watermark(self) -> int:
        """The highest ingest sequence number committed: every trace gets the next one
        when its ingest commits (1, 2, ...; 0 before the first). Pass it as ``after=`` to
        select what arrived since."""
        return self.handle.watermark()

    def wait(self, after: int, timeout: float) -> int:
        """Block until a trace above the watermark ``after`` is committed (by an ingest or
        a follower of this process) or ``timeout`` seconds passed; returns the watermark."""
        return self.handle.wait_for(after, timeout)

    def traces(
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
        limit: int | None = None,
    ) -> pa.Table:
        """The selected traces in arrival order, one row each (``seq``, ids, reward,
        flags, counts, source, ``tags`` as a JSON object), filters as in :meth:`branches`.
        The table carries the watermark to pass as ``after`` next time
        (``tracedb.watermark_of``); with ``limit`` it is the last row's, so paging through
        a live run misses nothing and repeats nothing."""
        selection = Selection.of(locals())
        from tracedb import readback

        return readback.trace_listing(self.handle, selection, limit)

    # ----------------------------------------------------------------- records

    def trace(self, trace_id: str, *, credit: str | None = None) -> dict[str, Any]:
        """The trace record exactly as ingested (per-token floats at float32 precision).

        Later writes show: streams written back are in the record. ``credit="name"``
        puts that credit set's advantages on the nodes instead of the default set's
        (a node the set does not assign has no ``advantages``, i.e. None).
        """
        from tracedb import readback

        return readback.trace_record(self.handle, trace_id, credit=credit)

    def episode(self, episode_id: str) -> dict[str, Any]:
        """The episode record exactly as ingested, with its traces."""
        from tracedb import readback

        return readback.episode_record(self.handle, episode_id)

    # ----------------------------------------------------------------- views

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
    ) -> pa.Table:
        """One row per branch of the selected traces, ordered by trace id then branch index.

        ``trace_ids``, ``group`` (``episode.group.id``) and ``episode`` select traces;
        ``trainable=True`` keeps only trainable branches, ``branch_index`` only the
        branches of that index (or indices; verifiers' ``Branch.index``). ``columns``
        picks token columns (``trace_id``, ``branch_index`` and ``trainable`` are always
        there). ``train_once`` leaves a shared node's sampled tokens in the mask of its
        first trainable branch only. ``credit="name"`` reads advantages from that credit
        set (default: the ingested set). Decoded node columns are cached until the next
        write, so repeated views of the same selection skip the database.

        For a live run: ``after=W`` selects the traces committed since the watermark
        ``W``; ``complete_groups=N`` the groups of at least N members that completed since
        (each group once, in the call after its N-th member arrived); ``tags`` filters on
        ingest tags (``{"step": 12}``, ``{"step": (10, None)}``); ``through=W`` reads as
        of the watermark ``W`` (two calls with the same ``after`` and ``through`` select
        the same traces). The table carries the watermark it was read at, to pass as
        ``after`` next time: ``tracedb.watermark_of(table)``.
        """
        from tracedb import views

        return views.branches(
            self.handle,
            Selection.of(locals()),
            trainable=trainable,
            branch_index=branch_index,
            columns=columns,
            train_once=train_once,
            credit=credit,
        )

    def iter_branches(
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
        batch_tokens: int = 16_000_000,
    ) -> Iterator[pa.Table]:
        """:meth:`branches` in batches of whole traces, about ``batch_tokens`` stored
        tokens each, so memory stays bounded whatever the database size; every batch
        carries the watermark the selection was made at."""
        from tracedb import views

        return views.iter_branches(
            self.handle,
            Selection.of(locals()),
            trainable=trainable,
            branch_index=branch_index,
            columns=columns,
            train_once=train_once,
            credit=credit,
            batch_tokens=batch_tokens,
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
        batch_tokens: int = 16_000_000,
        compression: str | None = "zstd",
    ) -> dict[str, Any]:
        """Stream branch views to Parquet (``.parquet``), an Arrow IPC file (``.arrow``)
        or stream (``.arrows``); ``format`` overrides the suffix. Filters and ``columns``
        are those of :meth:`branches`. Written beside ``path`` and renamed into place.
        Returns rows, tokens, bytes and the watermark (also in the file's schema metadata)."""
        from tracedb.export import export

        return export(
            self.handle,
            path,
            Selection.of(locals()),
            format=format,
            trainable=trainable,
            columns=columns,
            train_once=train_once,
            credit=credit,
            batch_tokens=batch_tokens,
            compression=compression,
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
        replay: Replay | None = None,
    ) -> Plan:
        """Packed, rank-balanced micro-batches of the selected branches, for a trainer.

        One sample per trainable branch (``trainable=None``: every branch) of the selected
        traces (filters as in :meth:`branches`), its advantages from ``credit``; a branch
        whose advantages are None (never scored) is skipped and counted, never zero-filled
        (``drop_zero_advantages`` also leaves out samples whose advantages are all 0).
        ``train_once``: a shared sampled token is in the loss once, in the first trainable
        sample still carrying it after truncation. A sample over ``seq_len`` is cut
        (``overflow="truncate"``), left out (``"drop"``) or refused (``"error"``). Samples
        are packed first-fit-decreasing into bins of at most ``seq_len`` tokens; the bins
        are split over ``ranks`` with as many per rank (zero-loss padding bins where needed)
        and balanced costs (``cost=(linear, quadratic)``: a bin costs linear * tokens +
        quadratic * the sum of its samples' lengths squared). Each bin is padded with
        ``pad_token_id`` to a multiple of ``pad_to_multiple_of``. ``share_prefixes`` stores
        the tokens several samples of a bin share as a prefix once (see
        :mod:`tracedb.batches.plan`). Returns a :class:`~tracedb.batches.Plan`: ``plan[r]``
        is rank r's micro-batches, ``plan.report`` what was packed and left out, and
        ``plan.report.watermark`` the watermark to pass as ``after`` for the next step
        (``complete_groups=N``: the groups completed since, each once; see :meth:`branches`).

        ``importance="tis"`` adds the token column ``importance_weight``: on each loss token
        holding both ``logprobs`` and ``trainer_logprobs`` (written back by a recompute pass
        with ``write_nodes(rows, stream="trainer_logprobs")``) ``min(exp(trainer -
        inference), clip)`` (``clip`` default 2.0), 1.0 on every other token; the report
        counts the loss tokens weighted, defaulted to 1.0 and clipped
        (:mod:`tracedb.batches.importance`).

        ``replay=tracedb.Replay(...)`` replaces each zero-variance group of the selection by
        an earlier complete group with signal, within a staleness bound and a use limit
        (:mod:`tracedb.batches.replay`; ``plan.report.replayed`` says what replaced what).
        """
        from tracedb import batches

        return batches.micro_batches(
            self.handle,
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
            replay=replay,
        )

    # ----------------------------------------------------------------- write-back

    def write_nodes(
        self, data: Any, *, stream: str = "advantages", credit: str | None = None, name: str | None = None
    ) -> int:
        """Write per-node compact values ``(trace_id, node_index, values)``; see :mod:`tracedb.writeback`."""
        from tracedb import writeback

        return writeback.write_nodes(self.handle, data, stream=stream, credit=credit, name=name)

    def write_traces(self, data: Any, *, stream: str = "advantages", credit: str | None = None) -> int:
        """Write per trace: ``value`` broadcast over its sampled tokens, or ``values`` over all of them."""
        from tracedb import writeback

        return writeback.write_traces(self.handle, data, stream=stream, credit=credit)

    def write_branches(
        self, data: Any, *, stream: str = "advantages", credit: str | None = None, name: str | None = None
    ) -> int:
        """Write full-layout branch values ``(trace_id, branch_index, values)``, projected onto nodes."""
        from tracedb import writeback

        return writeback.write_branches(self.handle, data, stream=stream, credit=credit, name=name)

    def clear(
        self,
        *,
        stream: str = "advantages",
        credit: str | None = None,
        trace_ids: Sequence[str] | None = None,
        name: str | None = None,
    ) -> int:
        """Return ``stream`` to unassigned (None) on every node of ``trace_ids`` (default: all)."""
        from tracedb import writeback

        return writeback.clear(self.handle, stream=stream, credit=credit, trace_ids=trace_ids, name=name)

    # ----------------------------------------------------------------- policy versions

    def set_policy_versions(self, mapping: Mapping[str, int]) -> int:
        """Map weight labels that name no number of their own (a checkpoint name, a hash)
        to policy versions (``{"ckpt-abc": 12}``); a label like ``step_12`` or ``v3`` needs
        none. The traces using them get their policy-version bounds again; returns how
        many. See :mod:`tracedb.policy` for the rule."""
        from tracedb import policy_labels

        return policy_labels.set_versions(self.handle, mapping)

    def policy_versions(self) -> pa.Table:
        """The mapped weight labels: label, version, set_at."""
        from tracedb import policy_labels

        return policy_labels.listing(self.handle)

    def policy_mismatch(
        self,
        *,
        per: str = "trace",
        c: float = 2.0,
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
    ) -> pa.Table:
        """How far the trainer's policy (``trainer_logprobs``) is from the one that sampled
        (``logprobs``), per trace or per turn (``per="turn"``) of the selected traces (filters
        as in :meth:`branches`), over the tokens holding both: ``tokens``, ``k3_mean``
        (estimates KL(inference || trainer)), ``ratio_mean`` and ``ratio_max`` of
        exp(trainer - inference), ``outside_share`` of ``[1/c, c]``; see
        :mod:`tracedb.offpolicy` (the ``policy_mismatch()`` macro in SQL)."""
        selection = Selection.of(locals())
        from tracedb import offpolicy

        return offpolicy.mismatch(self.handle, per=per, c=c, selection=selection)

    # ----------------------------------------------------------------- credit sets

    def create_credit_set(
        self,
        name: str,
        *,
        algorithm: str = "manual",
        params: Mapping[str, Any] | None = None,
        description: str | None = None,
        replace: bool = False,
        layout: str = "node",
    ) -> None:
        """Register a named credit set; its advantages are then written with ``credit=name``.
        ``layout="trace"`` stores one value per trace (it then takes ``write_traces`` with
        ``value`` only); ``"node"`` stores values per node and takes every writer."""
        from tracedb import credit_sets

        credit_sets.create(
            self.handle,
            name,
            algorithm=algorithm,
            params=params,
            description=description,
            replace=replace,
            layout=layout,
        )

    def drop_credit_set(self, name: str) -> None:
        """Remove a named credit set and all its credit."""
        from tracedb import credit_sets

        credit_sets.drop(self.handle, name)

    def credit_set_name(self, credit: str | None) -> str | None:
        """The set a caller means by ``credit``: None for the default (ingested) set (``None``
        or ``"default"``), else the named set, which must exist (:class:`~tracedb.errors.NotFound`)."""
        from tracedb import credit_sets

        return credit_sets.resolve(self.handle, credit)

    def has_credit_set(self, name: str) -> bool:
        """True for ``"default"`` (the ingested credit) and for every named set created."""
        from tracedb import credit_sets

        return credit_sets.exists(self.handle, name)

    def credit_sets(self) -> pa.Table:
        """The credit sets: name, algorithm, params, description, created_at, assigned nodes,
        layout (``trace`` or ``node``)."""
        from tracedb import credit_sets

        return credit_sets.listing(self.handle)


def migrate(path: str | Path) -> dict[str, Any]:
    """Upgrade a database file written by an older tracedb to this one's schema, in place
    (one transaction: a failure leaves the file as it was). Returns the path, the version
    the file held before (None: none) and after, and this tracedb's; then rewrites a file
    in another DuckDB storage format into tracedb's, one DuckDB 1.5 reads (atomically:
    :func:`tracedb.dbfile.rewrite_storage`), saying the format before and after."""
    before = migrations.stored_version(Path(path))
    with Database(path) as db:  # a read-write open upgrades
        after = db.schema_version
    from tracedb.dbfile import rewrite_storage

    rewritten = rewrite_storage(path)
    return {
        "path": str(path),
        "from_version": before,
        "to_version": after,
        "current": migrations.SCHEMA_VERSION,
        **{k: rewritten[k] for k in ("from_storage", "to_storage")},
    }


def connect(path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> Database:
    """Open (creating if needed) a tracedb database; ``":memory:"`` for a throwaway one.

    Databases are attached to one DuckDB instance per process (see
    :mod:`tracedb.runtime`: opening is ~2 ms instead of ~15 ms, and the instance's
    memory is reused); ``SET`` statements therefore apply to all of them. ``isolated=True``
    gives this database a DuckDB instance of its own.
    """
    return Database(path, read_only=read_only, isolated=isolated)
