"""tracedb: verifiers v1 message graphs stored deduplicated in DuckDB, served as
branch-spread token views for trainers, analysts and services."""

from tracedb import batches
from tracedb.batches import MicroBatch, Plan, Replay, read_micro_batches
from tracedb.database import Database, connect
from tracedb.errors import IngestAborted, NotFound, RecordError, StepChanged, TraceDBError
from tracedb.migrations import SCHEMA_VERSION
from tracedb.selection import Selection, watermark_of
from tracedb.tables import BRANCH_SCHEMA
from tracedb.views import to_polars

__all__ = [
    "connect",
    "Database",
    "BRANCH_SCHEMA",
    "to_polars",
    "watermark_of",
    "TraceDBError",
    "RecordError",
    "IngestAborted",
    "NotFound",
    "StepChanged",
    "SCHEMA_VERSION",
    "MicroBatch",
    "Plan",
    "Replay",
    "Selection",
    "read_micro_batches",
    "batches",
]
__version__ = "0.1.0"
