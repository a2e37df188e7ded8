"""The two shapes a credit algorithm's output takes (see :mod:`tracedb.credit`)."""

from __future__ import annotations

import pyarrow as pa

TRACE_CREDIT = pa.schema([("trace_id", pa.string()), ("value", pa.float64())])
"""One value per trace, broadcast over its sampled tokens (outcome-level credit)."""
NODE_CREDIT = pa.schema([("trace_id", pa.string()), ("node_index", pa.int32()), ("values", pa.list_(pa.float32()))])
"""Compact values per node, one per sampled token (turn- and token-level credit)."""
