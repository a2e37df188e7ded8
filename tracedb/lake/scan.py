"""Reading Iceberg files of a lake as Arrow: what every reader of a lake starts from.

:func:`scan_traces` gives the ``traces`` rows with their ``seq`` (the data sequence
number of the file that committed each row).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
from pyiceberg.expressions import AlwaysTrue, BooleanExpression
from pyiceberg.io.pyarrow import ArrowScan


def scan_traces(
    table: Any, row_filter: BooleanExpression = AlwaysTrue(), columns: Sequence[str] | None = None
) -> pa.Table:
    """The traces rows (with :data:`BATCH`) that ``row_filter`` keeps, ``seq`` set to the
    data sequence number of the file each was committed in; ``columns`` (with ``seq``)
    reads only those."""
    fields = ("*",) if columns is None else tuple(dict.fromkeys([*columns, "seq"]))
    snapshot = table.current_snapshot()
    if snapshot is None:
        return table.scan(selected_fields=fields).to_arrow()
    seqs = {
        entry.data_file.file_path: entry.sequence_number
        for manifest in snapshot.manifests(table.io)
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
    }
    projected = table.schema() if columns is None else table.schema().select(*fields)
    scan = ArrowScan(table.metadata, table.io, projected, row_filter)
    parts = []
    for task in table.scan(row_filter=row_filter).plan_files():
        part = scan.to_table([task])
        seq = pa.array([seqs[task.file.file_path]] * part.num_rows, pa.int64())
        parts.append(part.set_column(part.schema.get_field_index("seq"), "seq", seq))
    if not parts:
        return table.scan(row_filter=row_filter, selected_fields=fields, limit=0).to_arrow()
    return pa.concat_tables(parts, promote_options="permissive")  # files may differ in string vs large_string


__all__ = ["scan_traces"]
