"""Weight labels mapped to policy versions: ``db.set_policy_versions({"label": 12})``.

A label that names its number itself (``step_12``, ``v3``: :data:`tracedb.policy.LABEL`)
needs no mapping; any other label (a checkpoint name, a hash) has no policy version until
it is mapped here. A mapping is stored in ``policy_labels`` and every trace whose spans use
one of its labels gets its bounds (``traces.policy_min`` / ``policy_max`` /
``policy_unknown``) stored again, in one transaction, under the writing lock (an ingest
reads the mapping once, when it begins).
"""

from __future__ import annotations

from collections.abc import Mapping

import pyarrow as pa

from tracedb import policy
from tracedb.errors import WriteError
from tracedb.handle import Handle

_INT32 = 2**31 - 1


def check(mapping: Mapping[str, int]) -> dict[str, int]:
    """The mapping as stored, or :class:`WriteError` naming the first bad entry."""
    if not isinstance(mapping, Mapping) or not mapping:
        raise WriteError(f"a mapping of weight labels to policy versions is a non-empty dict, not {mapping!r}")
    out = {}
    for label, version in mapping.items():
        if not isinstance(label, str) or not label.strip():
            raise WriteError(f"a weight label is a non-empty string, not {label!r}")
        if policy.label_number(label) is not None:
            raise WriteError(
                f"{label!r} names its policy version itself ({policy.label_number(label)}): "
                "only other labels are mapped"
            )
        if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= _INT32:
            raise WriteError(f"label {label!r}: a policy version is an int from 0 to {_INT32}, not {version!r}")
        out[label] = version
    return out


def set_versions(handle: Handle, mapping: Mapping[str, int]) -> int:
    """Map labels to policy versions (replacing earlier mappings of the same labels) and
    store the bounds of the traces using them again; returns how many traces that was."""
    rows = check(mapping)
    table = pa.table({"label": pa.array(list(rows), pa.string()), "version": pa.array(list(rows.values()), pa.int64())})
    with handle.sequencing(), handle.transaction():
        with handle.registered("_tdb_labels", table):
            handle.con.execute("DELETE FROM policy_labels WHERE label IN (SELECT label FROM _tdb_labels)")
            handle.con.execute("INSERT INTO policy_labels (label, version) SELECT label, version FROM _tdb_labels")
        return policy.recompute_bounds(handle.con, list(rows))


def listing(handle: Handle) -> pa.Table:
    """The mapped labels: label, version, when it was set."""
    return handle.sql("SELECT label, version, set_at FROM policy_labels ORDER BY label")
