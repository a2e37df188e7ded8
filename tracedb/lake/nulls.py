"""A null ``nodes.weight_versions`` in the lake's files.

pyiceberg (0.12) writes a null list of structs as an empty list (its write path rebuilds
such a list from its offsets and values, dropping the list's validity), so a node whose
``weight_versions`` is null would read back as ``[]``. The file store tells the two
apart: null is "the record holds none" (or an explicit ``null``, with the node's present
bit, :data:`tracedb.records.WEIGHT_VERSIONS_BIT`), ``[]`` an explicit empty list. So the
lake's writer stores an explicit null (present bit set) as a list of one null span, which
no record holds (a span is an object), and its readers turn that back into null, and an
empty list without the present bit into null too, unless the node's unknown fields hold
an empty ``weight_versions`` (a node a schema-5 writer stored, whose spans stayed there:
the file store's migration copies them out, ``[]`` as ``[]``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb.ingest.rows import spans_in
from tracedb.records import WEIGHT_VERSIONS_BIT

COLUMN = "weight_versions"


def _present(table: pa.Table) -> np.ndarray:
    bits = pc.fill_null(table.column("present"), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    return (bits & WEIGHT_VERSIONS_BIT) != 0


def encode(name: str, table: pa.Table) -> pa.Table:
    """``table`` (rows of lake table ``name`` about to be written) with each explicit null
    ``weight_versions`` stored as a list of one null span."""
    if name != "nodes" or COLUMN not in table.column_names or "present" not in table.column_names:
        return table
    column = table.column(COLUMN)
    explicit = _present(table) & ~column.is_valid().to_numpy(zero_copy_only=False)
    if not explicit.any():
        return table
    values = column.to_pylist()
    for row in np.flatnonzero(explicit).tolist():
        values[row] = [None]
    index = table.schema.get_field_index(COLUMN)
    return table.set_column(index, table.schema.field(COLUMN), pa.array(values, column.type))


def decode(name: str, table: pa.Table) -> pa.Table:
    """``table`` (rows read of lake table ``name``) with ``weight_versions`` as the file
    store holds it: a list of one null span, and an empty list the node's present bit and
    unknown fields do not account for, null."""
    if name != "nodes" or COLUMN not in table.column_names or "present" not in table.column_names:
        return table
    column = table.column(COLUMN)
    lengths = pc.fill_null(pc.list_value_length(column), -1).to_numpy(zero_copy_only=False)
    blank = np.zeros(table.num_rows, bool)
    empty = np.flatnonzero((lengths == 0) & ~_present(table))
    if len(empty):
        blank[empty] = True
        if "extra" in table.column_names:  # unless the unknown fields hold an empty list (a schema-5 node's)
            extras = table.column("extra").take(pa.array(empty))
            named = pc.fill_null(pc.match_substring(extras, f'"{COLUMN}"'), False).to_numpy(zero_copy_only=False)
            for row, text in zip(empty[named].tolist(), extras.filter(pa.array(named)).to_pylist(), strict=True):
                blank[row] = spans_in(text) != []
    single = np.flatnonzero(lengths == 1)
    if len(single):
        blank[single] = [v == [None] for v in column.take(pa.array(single)).to_pylist()]
    if not blank.any():
        return table
    index = table.schema.get_field_index(COLUMN)
    kept = pc.if_else(pa.array(blank), pa.scalar(None, column.type), column)
    return table.set_column(index, table.schema.field(COLUMN), kept)


__all__ = ["COLUMN", "decode", "encode"]
