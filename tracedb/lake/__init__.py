"""tracedb's tables as Apache Iceberg tables (the lake): many writers, Ray workers.

Needs the ``lake`` extra (``pip install 'tracedb[lake]'``: pyiceberg, and Ray for the
distributed calls); the file store never imports this package. See ``docs/lake.md``.

    import tracedb.lake
    lake = tracedb.lake.init("lake/")          # a local lake: SQLite catalog + warehouse
    lake.push("runs.duckdb")                  # idempotent by trace id
    lake.sql("SELECT * FROM branch_stats()")  # the file store's macros over the lake
"""

from __future__ import annotations

try:
    import pyiceberg  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tracedb.lake needs the lake extra: pip install 'tracedb[lake]'") from e

from tracedb.lake.catalog import LAKE_SCHEMA_VERSION, LakeError
from tracedb.lake.lake import Lake, init
from tracedb.lake.lake import open_lake as open  # noqa: A001 - tracedb.lake.open(L), as the issue names it
from tracedb.lake.write import AppendReport

__all__ = ["LAKE_SCHEMA_VERSION", "AppendReport", "Lake", "LakeError", "init", "open"]
