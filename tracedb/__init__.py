"""tracedb: verifiers v1 message graphs stored deduplicated in DuckDB, served as
branch-spread token views for trainers, analysts and services."""

from tracedb.errors import IngestAborted, NotFound, RecordError, TraceDBError
from tracedb.store import SCHEMA_VERSION, Database, connect
from tracedb.views import BRANCH_SCHEMA, to_polars

__all__ = [
    "connect",
    "Database",
    "BRANCH_SCHEMA",
    "to_polars",
    "TraceDBError",
    "RecordError",
    "IngestAborted",
    "NotFound",
    "SCHEMA_VERSION",
]
__version__ = "0.1.0"
