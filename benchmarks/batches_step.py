"""tracedb's side of the trainer-feed benchmark (``benchmarks/batches.py``): the step
``db.micro_batches(seq_len, ranks=...)`` with every token column touched, from the file or
on an open database."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.harness import from_file

STEP_BYTES_PER_TOKEN = 13  # int32 id + bool loss mask + float32 advantage + float32 logprob


def touch(plan: Any) -> int:
    """Every token column of every micro-batch as numpy (what a trainer hands to torch);
    returns the values touched."""
    values = 0
    for rank in plan:
        for mb in rank:
            for column in mb.tokens.columns:
                values += len(column.to_numpy(zero_copy_only=False))
    return values


def tracedb_from_file(db_path: Path, seq_len: int, ranks: int, **options: Any) -> Any:
    """A fresh read-only connection to the file (refused while it is open here), the step,
    every column touched, closed."""
    with from_file(db_path, "the step") as db:
        plan = db.micro_batches(seq_len, ranks=ranks, **options)
        touch(plan)
    return plan


def tracedb_warm(db: Any, seq_len: int, ranks: int, **options: Any) -> Any:
    """The step on an open database, every column touched."""
    plan = db.micro_batches(seq_len, ranks=ranks, **options)
    touch(plan)
    return plan
