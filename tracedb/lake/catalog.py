"""Where a lake lives and what it holds: the catalog, the namespace, the tables.

A lake is tracedb's tables as Apache Iceberg tables in one namespace of a pyiceberg
catalog. ``L`` is either a directory (a local lake made by :func:`init`: a SQLite
catalog ``catalog.db`` and the warehouse ``warehouse/`` inside it) or a ``.yaml`` /
``.json`` file of pyiceberg catalog properties (``uri``, ``warehouse``, ``type``, ...;
two keys are tracedb's: ``name``, the catalog's name, and ``namespace``, both
``tracedb`` by default).

The schemas are the file store's (:data:`tracedb.tables.STORED`, read when the lake is
made, never copied) with every column optional and columns of the lake's own:
:data:`BATCH` on the tables that the visibility rule joins (see :mod:`tracedb.lake.read`),
:data:`SEGMENT_HOME` on ``segments`` (what puts a segment beside the traces using it).
The tables are bucketed (``bucket(N, ...)``) with the N chosen when the lake is made
(:data:`DEFAULT_BUCKETS`), recorded in ``tracedb_meta`` as :data:`BUCKETS_KEY`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyiceberg.catalog import Catalog, load_catalog
from pyiceberg.exceptions import CommitFailedException, NamespaceAlreadyExistsError, NoSuchTableError
from pyiceberg.table import Table
from pyiceberg.transforms import BucketTransform

from tracedb import tables
from tracedb.errors import DatabaseError

LAKE_SCHEMA_VERSION = 4
"""The version of the lake's layout (its tables, :data:`BATCH`, the partitioning, what
a ``traces`` row's ``seq`` holds); stored in the lake's ``tracedb_meta`` as
``lake_schema_version``. 1: writers stored the file store's seq in the row, readers
took the file's sequence number; 2: a stored seq is the lake's (written by a
compaction or by the upgrade from 1, :mod:`tracedb.lake.upgrade`), else the file's;
3: segments are stored per write beside the traces that use them (:data:`SEGMENT_HOME`,
``bucket(N, lake_trace)``), the bucket count N is the lake's own (:data:`BUCKETS_KEY`);
4: the file store's schema 6 (policy versions: ``nodes.weight_versions``,
``traces.dropped`` / ``policy_min`` / ``policy_max`` / ``policy_unknown`` /
``work_type``, the episodes' work columns, ``policy_labels``), filled in on an upgrade
from 3 as the file store's migration fills them (:mod:`tracedb.lake.policy_columns`).
The upgrade from each earlier version is :mod:`tracedb.lake.upgrade`."""
VERSION_KEY = "lake_schema_version"
BATCH = "lake_batch"
"""The lake's own column: the id of the write that put a row in. A trace's rows are the
ones written with the traces row that made it visible (the same ``lake_batch``)."""
META = "tracedb_meta"
FILE_ONLY = ("tracedb_meta", "follow_positions")
"""Tables of the file store that the lake does not mirror: the file's own bookkeeping
(the lake has its own ``tracedb_meta``) and the follower's read positions."""
BUCKETS_KEY = "buckets"
"""The ``tracedb_meta`` key holding the lake's bucket count."""
DEFAULT_BUCKETS = 64
"""Hash buckets of a new lake's key columns (``bucket(64, trace_id)``, ...), sized for a
lake of about a million traces: each bucket's files then hold ~16k traces, which a
compaction keeps in files of a few GB per partition (row groups of a few hundred traces,
sorted by trace id, so a read of some traces reads their row groups only), while a write
of 256 traces adds ~60 files per table (fewer buckets: fewer, bigger files per write;
more: smaller partitions). ``tracedb lake init --buckets N`` chooses another."""
OLD_BUCKETS = 16
"""The bucket count of the lakes of layout versions 1 and 2 (fixed then)."""
MAX_BUCKETS = 4096
"""The most buckets a lake may have (each write may add a file per bucket per table)."""
SEGMENT_HOME = "lake_trace"
"""The lake's own column on ``segments``: a trace of the write that stored the row, of the
bucket of the traces that use the segment. ``segments`` is bucketed on it, so each write
stores a segment in every bucket holding one of its traces that uses it (once per bucket),
and a reader of some traces finds their segments in the traces' own buckets."""
ROW_GROUP_ROWS = {"traces": 4096, "nodes": 16384, "segments": 4096, "branches": 16384}
"""Parquet row groups (rows) of the big tables' files: a file is sorted by its key, so a
read of a few keys reads the row groups whose key range admits them (about 100-400
traces' rows each at 30k tokens per trace)."""
BATCHED_KEYS = {"episodes": "episode_id"}
"""Tables without a trace id whose rows still belong to a write (:data:`BATCH`), by the
key readers join them on."""
BUCKET_KEYS = {"segments": SEGMENT_HOME, "episodes": "episode_id"}
"""The bucketed column of tables that have no ``trace_id``."""

PROPERTY_FILES = (".yaml", ".yml", ".json")
"""What a lake given by its catalog properties is named like (anything else is a directory)."""
NAME = "tracedb"
"""The default catalog name and namespace."""


class LakeError(DatabaseError):
    """A lake that cannot be opened or written as asked (says which and why)."""


def lake_tables() -> dict[str, pa.Schema]:
    """The file store's tables the lake holds, by name, in the stored schemas."""
    return {name: schema for name, schema in tables.STORED.items() if name not in FILE_ONLY}


def per_trace(name: str, schema: pa.Schema) -> bool:
    """Whether a table's rows belong to one trace each (joined through ``traces``)."""
    return "trace_id" in schema.names and name != "rejects"


def batched(name: str, schema: pa.Schema) -> bool:
    """Whether a table carries :data:`BATCH`."""
    return per_trace(name, schema) or name in BATCHED_KEYS or name in ("rejects", "segments")


def lake_schema(name: str, schema: pa.Schema) -> pa.Schema:
    """The Arrow schema of ``name`` in the lake: the stored one, every column optional
    (Iceberg's required checks would refuse rows a writer builds nullable), metadata
    dropped, plus :data:`BATCH` where :func:`batched` and :data:`SEGMENT_HOME` on ``segments``."""
    fields = [f.with_nullable(True).remove_metadata() for f in schema]
    if batched(name, schema):
        fields.append(pa.field(BATCH, pa.string()))
    if name == "segments":
        fields.append(pa.field(SEGMENT_HOME, pa.string()))
    return pa.schema(fields)


def lake_columns(name: str) -> list[str]:
    """The lake's own columns of table ``name`` (none of them are in the stored schema)."""
    return [f.name for f in lake_schema(name, lake_tables()[name]) if f.name in (BATCH, SEGMENT_HOME)]


def partition_key(name: str, schema: pa.Schema) -> str | None:
    """The column a table is bucketed on: the trace id, else its own key (None: not
    partitioned)."""
    if per_trace(name, schema):
        return "trace_id"
    return BUCKET_KEYS.get(name)


@dataclass
class Commits:
    """The table commits a catalog was asked for (every attempt, pyiceberg's own retries
    included) and how many of them conflicted with another writer's."""

    attempts: int = 0
    conflicts: int = 0


@dataclass
class Location:
    """How to reach a lake: the catalog's properties and the namespace."""

    where: str
    name: str
    namespace: str
    properties: dict[str, str] = field(default_factory=dict)

    def catalog(self) -> Catalog:
        """The catalog, connected (a :class:`LakeError` naming it when it cannot be),
        counting its table commits in its ``commits`` (:class:`Commits`)."""
        try:
            made = load_catalog(self.name, **self.properties)
        except ModuleNotFoundError as e:
            raise LakeError(
                f"lake {self.where}: the catalog needs the {e.name} module: pip install 'tracedb[lake]'"
            ) from None
        except Exception as e:  # the catalog's driver says why (server down, no such database, ...)
            raise LakeError(f"lake {self.where}: cannot open catalog {self.describe()}: {_first_line(e)}") from None
        return counted(made)

    def describe(self) -> str:
        """The catalog's type and address, any password in it hidden."""
        uri = re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", self.properties.get("uri", ""))
        return f"{self.properties.get('type', '?')} {uri}".strip()


def counted(made: Catalog) -> Catalog:
    """``made`` with its ``commit_table`` counting into ``made.commits`` (what a write
    reports as its commits and retries): every table of the lake commits through it."""
    commits = Commits()
    commit = made.commit_table

    def commit_table(table: Any, requirements: Any, updates: Any) -> Any:
        commits.attempts += 1
        try:
            return commit(table, requirements, updates)
        except CommitFailedException:
            commits.conflicts += 1
            raise

    made.commit_table = commit_table  # type: ignore[method-assign]
    made.commits = commits  # type: ignore[attr-defined]
    return made


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def locate(lake: str | Path) -> Location:
    """The catalog of ``lake``: a directory (a local lake, see :func:`init`) or a
    ``.yaml``/``.json`` file of pyiceberg catalog properties."""
    path = Path(lake)
    if path.suffix in PROPERTY_FILES:
        if not path.is_file():
            raise LakeError(f"lake {path}: no such catalog properties file")
        text = path.read_text()
        try:
            if path.suffix == ".json":
                props = json.loads(text)
            else:
                import yaml

                props = yaml.safe_load(text)
        except Exception as e:
            raise LakeError(f"lake {path}: not readable as {path.suffix[1:]}: {e}") from None
        if not isinstance(props, dict):
            raise LakeError(f"lake {path}: holds {type(props).__name__}, not an object of catalog properties")
        props = {str(k): str(v) for k, v in props.items()}
        name = props.pop("name", NAME)
        namespace = props.pop("namespace", NAME)
        return Location(str(path), name, namespace, _anchored(props, path.resolve().parent))
    if path.exists() and not path.is_dir():
        raise LakeError(f"lake {path}: neither a directory nor a .yaml/.json of catalog properties")
    root = path.resolve()
    props = {
        "type": "sql",
        "uri": f"sqlite:///{root / 'catalog.db'}",
        "warehouse": (root / "warehouse").as_uri(),
    }
    return Location(str(path), NAME, NAME, props)


def _anchored(props: dict[str, str], base: Path) -> dict[str, str]:
    """``props`` with a relative local ``warehouse`` path and a relative SQLite catalog
    file taken from ``base`` (the properties file's directory), not from the directory a
    process happens to run in (a Ray worker's is another)."""
    out = dict(props)
    warehouse = out.get("warehouse")
    if warehouse and "://" not in warehouse and not Path(warehouse).is_absolute():
        out["warehouse"] = (base / warehouse).as_uri()
    uri = out.get("uri", "")
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and uri != "sqlite:///:memory:":
        out["uri"] = f"sqlite:///{base / uri.removeprefix('sqlite:///')}"
    return out


def create(location: Location, buckets: int | None = None) -> dict[str, Table]:
    """Make the namespace, the tables that are missing and the meta rows (idempotent);
    returns every table. A new lake gets ``buckets`` hash buckets (default
    :data:`DEFAULT_BUCKETS`); an existing one keeps its own (asking for another count is a
    :class:`LakeError`: the count is part of the layout). ``traces`` is made without
    pyiceberg's own commit retries: its writer retries itself and re-checks the trace ids
    each time."""
    if buckets is not None and (
        not isinstance(buckets, int) or isinstance(buckets, bool) or not 1 <= buckets <= MAX_BUCKETS
    ):
        raise ValueError(f"buckets is an int from 1 to {MAX_BUCKETS}, not {buckets!r}")
    catalog = location.catalog()
    try:
        catalog.create_namespace(location.namespace)
    except NamespaceAlreadyExistsError:
        pass
    made: dict[str, Table] = {}
    held: dict[str, str] = {}
    count = buckets or DEFAULT_BUCKETS
    for name, schema in {META: tables.META, **lake_tables()}.items():
        ident = f"{location.namespace}.{name}"
        try:
            made[name] = catalog.load_table(ident)
        except NoSuchTableError:
            made[name] = _create_table(catalog, ident, name, schema, count)
        if name == META:
            held = meta_rows(made[META])
            if VERSION_KEY in held:
                count = lake_buckets(held)
                if buckets is not None and buckets != count:
                    raise LakeError(
                        f"lake {location.where}: it has {count} buckets, fixed when it was made (not {buckets})"
                    )
    if VERSION_KEY not in held:
        set_meta(made[META], {VERSION_KEY: str(LAKE_SCHEMA_VERSION), BUCKETS_KEY: str(count)})
    return made


def _create_table(catalog: Catalog, ident: str, name: str, schema: pa.Schema, buckets: int) -> Table:
    arrow = lake_schema(name, schema)
    table = catalog.create_table(ident, schema=arrow, properties=table_properties(name, arrow))
    key = partition_key(name, schema)
    if key is not None:
        with table.update_spec() as update:
            update.add_field(key, BucketTransform(buckets), f"{key}_bucket")
    return catalog.load_table(ident)


KEY_COLUMNS = ("trace_id", "segment_id", "episode_id", "group_id", SEGMENT_HOME, BATCH)
"""Columns whose bounds the manifests keep in full (the keys a read prunes files by)."""


def table_properties(name: str, arrow: pa.Schema) -> dict[str, str]:
    """The Iceberg table properties tracedb gives table ``name`` (of lake schema
    ``arrow``): no commit retries of pyiceberg's own on ``traces`` (its writer retries and
    re-checks the trace ids), no column statistics for the per-token lists in the
    manifests (they only make planning read more), full bounds of the key columns, and
    the row groups of :data:`ROW_GROUP_ROWS`."""
    props = {f"write.metadata.metrics.column.{c}": "full" for c in KEY_COLUMNS if c in arrow.names}
    for f in arrow:
        for leaf in _nested_leaves(f.name, f.type):
            props[f"write.metadata.metrics.column.{leaf}"] = "none"
    if name == "traces":
        props["commit.retry.num-retries"] = "0"
    if name in ROW_GROUP_ROWS:
        props["write.parquet.row-group-limit"] = str(ROW_GROUP_ROWS[name])
    return props


def _nested_leaves(path: str, kind: pa.DataType) -> list[str]:
    """The Iceberg names of the leaf columns inside a nested column (``token_ids.element``,
    ``loss_weights.key``, ...); none for a primitive one."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        inner = f"{path}.element"
        return _nested_leaves(inner, kind.value_type) or [inner]
    if pa.types.is_map(kind):
        value = f"{path}.value"
        return [f"{path}.key", *(_nested_leaves(value, kind.item_type) or [value])]
    if pa.types.is_struct(kind):
        return [leaf for f in kind for leaf in (_nested_leaves(f"{path}.{f.name}", f.type) or [f"{path}.{f.name}"])]
    return []


def lake_buckets(held: dict[str, str]) -> int:
    """The bucket count of a lake whose meta rows are ``held`` (versions 1 and 2: 16)."""
    value = held.get(BUCKETS_KEY)
    return int(value) if value is not None and value.isdigit() else OLD_BUCKETS


def meta_rows(meta: Table) -> dict[str, str]:
    """The rows of a lake's ``tracedb_meta`` table, key to value."""
    rows = meta.scan().to_arrow().select(["key", "value"]).to_pydict()
    return dict(zip(rows["key"], rows["value"], strict=True))


def set_meta(meta: Table, values: dict[str, str]) -> None:
    """Set the keys of ``values`` in a lake's ``tracedb_meta`` table, in one commit."""
    held = meta_rows(meta)
    rows = {**held, **values}
    table = pa.table({"key": list(rows), "value": list(rows.values())}, schema=lake_schema(META, tables.META))
    if held:
        meta.overwrite(table)
    else:
        meta.append(table)


def load(location: Location) -> dict[str, Table]:
    """The lake's tables, after checking it is a lake of this version."""
    if location.properties.get("type") == "sql" and location.properties["uri"].startswith("sqlite:///"):
        db = Path(location.properties["uri"].removeprefix("sqlite:///"))
        if not db.exists():
            raise LakeError(
                f"lake {location.where}: no lake here (no {db.name}); "
                f"make one with `tracedb lake init --warehouse {location.where}`"
            )
    catalog = location.catalog()
    found: dict[str, Table] = {}
    missing = []
    for name in (META, *lake_tables()):
        try:
            found[name] = catalog.load_table(f"{location.namespace}.{name}")
        except NoSuchTableError:
            missing.append(name)
    if META in missing:
        raise LakeError(
            f"lake {location.where}: namespace {location.namespace!r} holds no tracedb lake (no {META} table)"
        )
    version = meta_rows(found[META]).get(VERSION_KEY)
    if version != str(LAKE_SCHEMA_VERSION):
        raise LakeError(f"lake {location.where}: {version_problem(version, location.where)}")
    if missing:
        raise LakeError(f"lake {location.where}: tables {missing} are missing; `tracedb lake init` adds them")
    lacking = {
        name: [f.name for f in lake_schema(name, schema) if f.name not in found[name].schema().column_names]
        for name, schema in lake_tables().items()
    }
    lacking = {name: columns for name, columns in lacking.items() if columns}
    if lacking:
        said = "; ".join(f"{name}: {', '.join(columns)}" for name, columns in lacking.items())
        raise LakeError(
            f"lake {location.where}: its tables lack columns of this tracedb's schema ({said}); "
            f"`tracedb lake init --warehouse {location.where}` (or tracedb.lake.init) adds them"
        )
    return found


def version_problem(version: str | None, where: str) -> str:
    """Why a lake of layout ``version`` (None: not recorded) is not opened, and what to do."""
    found = f"lake schema version {version}, this tracedb reads {LAKE_SCHEMA_VERSION}"
    if version is not None and version.isdigit() and int(version) < LAKE_SCHEMA_VERSION:
        does = {
            1: "rewrites traces with each trace's lake seq and segments beside their traces",
            2: "rewrites segments beside their traces",
            3: "rewrites traces",
        }
        return (
            f"{found}; upgrade it with `tracedb lake init --warehouse {where}` (or tracedb.lake.init): "
            f"it {does.get(int(version), 'rewrites its tables')} "
            "and adds the policy-version columns (stop the lake's writers first)"
        )
    if version is not None and version.isdigit():
        return f"{found}; a newer tracedb made it: upgrade tracedb"
    return f"{found}; not a version this tracedb knows"


class Opened:
    """The tables of an open lake, each reloaded when asked for: what the readers and
    the writer work on (:class:`tracedb.lake.Lake` adds the user's calls)."""

    def __init__(self, location: Location, tables: dict[str, Table], source: Catalog | None = None) -> None:
        self.location = location
        """The catalog properties and namespace."""
        self._tables = tables
        self._source = source

    @classmethod
    def at(cls, location: Location) -> Opened:
        """Open the lake ``location`` names (checking it, see :func:`load`)."""
        return cls(location, load(location))

    @classmethod
    def worker(cls, location: Location) -> Opened:
        """The lake a Ray task of a call on an opened lake works on: its tables loaded when
        first asked for, through one catalog connection per process and location (the
        driver checked the lake when it was opened), and kept for the process's later
        tasks: :meth:`table` reloads one only when the catalog's metadata pointer for it
        moved (a load reads and parses the metadata file: milliseconds per table per task)."""
        key = (location.name, location.namespace, tuple(sorted(location.properties.items())))
        made = _worker_catalogs.get(key)
        if made is None:
            made = _worker_catalogs[key] = location.catalog()
            _worker_tables[key] = {}
        return cls(location, _worker_tables[key], made)

    @property
    def commits(self) -> Commits:
        """The table commits made through this lake's catalog so far (see :func:`counted`;
        zeros for tables of a catalog made elsewhere)."""
        made = self._source or self._tables[META].catalog
        return getattr(made, "commits", None) or Commits()

    def table(self, name: str) -> Table:
        """The Iceberg table ``name``, reloaded (as of its latest commit: with a SQL catalog,
        only when the catalog's metadata pointer moved, which one query tells)."""
        table = self._tables.get(name)
        if table is None and self._source is not None:
            table = self._tables[name] = self._source.load_table(f"{self.location.namespace}.{name}")
            return table
        if table is None:
            raise LakeError(f"lake {self.location.where}: no table {name!r}")
        if current_location(table.catalog, self.location.namespace, name) != table.metadata_location:
            table.refresh()
        return table


def current_location(catalog: Catalog, namespace: str, name: str) -> str | None:
    """Where table ``name``'s current metadata file is, as a pyiceberg SQL catalog's row
    says (one query, no metadata file read); None for another kind of catalog."""
    from pyiceberg.catalog.sql import IcebergTables, SqlCatalog
    from sqlalchemy import select
    from sqlalchemy.orm import Session

    if not isinstance(catalog, SqlCatalog):
        return None
    with Session(catalog.engine) as session:
        return session.scalar(
            select(IcebergTables.metadata_location).where(
                IcebergTables.catalog_name == catalog.name,
                IcebergTables.table_namespace == namespace,
                IcebergTables.table_name == name,
            )
        )


_worker_catalogs: dict[tuple[Any, ...], Catalog] = {}
_worker_tables: dict[tuple[Any, ...], dict[str, Table]] = {}
