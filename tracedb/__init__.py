"""tracedb: verifiers v1 message graphs stored deduplicated in DuckDB, served as
branch-spread token views for trainers, analysts and services.

The names below are imported when first used (:mod:`tracedb.lazy`): ``import tracedb``
costs the errors module, and the ``tracedb`` command starts without DuckDB or Arrow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracedb.errors import IngestAborted, NotFound, RecordError, StepChanged, TraceDBError
from tracedb.lazy import exports

if TYPE_CHECKING:
    from tracedb import batches
    from tracedb.batches import MicroBatch, Plan, Replay, read_micro_batches
    from tracedb.database import Database, connect
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

__getattr__, __dir__ = exports(
    __name__,
    {
        "connect": "tracedb.database:connect",
        "Database": "tracedb.database:Database",
        "BRANCH_SCHEMA": "tracedb.tables:BRANCH_SCHEMA",
        "to_polars": "tracedb.views:to_polars",
        "watermark_of": "tracedb.selection:watermark_of",
        "SCHEMA_VERSION": "tracedb.migrations:SCHEMA_VERSION",
        "MicroBatch": "tracedb.batches:MicroBatch",
        "Plan": "tracedb.batches:Plan",
        "Replay": "tracedb.batches:Replay",
        "Selection": "tracedb.selection:Selection",
        "read_micro_batches": "tracedb.batches:read_micro_batches",
        "batches": "tracedb.batches",
    },
)
