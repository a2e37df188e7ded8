"""The trainer feed: packed, rank-balanced micro-batches straight from the store.

- :mod:`~tracedb.batches.samples`: one sample per packed branch, its tokens cut to
  ``seq_len``, its loss mask under the train-once rule, its shareable prefix;
- :mod:`~tracedb.batches.packing`: first-fit-decreasing bins and the balanced split over
  ranks (plain algorithms);
- :mod:`~tracedb.batches.plan`: the bins laid out as :class:`MicroBatch` objects, per rank
  (:class:`Plan`), and the :class:`PackReport`;
- :mod:`~tracedb.batches.files`: a step directory for trainers (``tracedb pack``) and
  :func:`read_micro_batches`;
- :mod:`~tracedb.batches.replay`: zero-variance groups replaced by earlier groups with
  signal (:class:`Replay`);
- :mod:`~tracedb.batches.provenance` and :mod:`~tracedb.batches.steps`: what a step's
  manifest records of its inputs, and rebuilding a step from it (:func:`rebuild`).

The names are imported when first used (:mod:`tracedb.lazy`): the database facade holds
this package without an ingest paying for the trainer feed's modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracedb.lazy import exports

if TYPE_CHECKING:
    from tracedb.batches.files import read_micro_batches, write_step
    from tracedb.batches.plan import MicroBatch, PackReport, Plan
    from tracedb.batches.replay import Replay, Replayed
    from tracedb.batches.run import micro_batches
    from tracedb.batches.steps import rebuild

__all__ = [
    "MicroBatch",
    "PackReport",
    "Plan",
    "Replay",
    "Replayed",
    "micro_batches",
    "read_micro_batches",
    "rebuild",
    "write_step",
]

__getattr__, __dir__ = exports(
    __name__,
    {
        "MicroBatch": "tracedb.batches.plan:MicroBatch",
        "PackReport": "tracedb.batches.plan:PackReport",
        "Plan": "tracedb.batches.plan:Plan",
        "Replay": "tracedb.batches.replay:Replay",
        "Replayed": "tracedb.batches.replay:Replayed",
        "micro_batches": "tracedb.batches.run:micro_batches",
        "read_micro_batches": "tracedb.batches.files:read_micro_batches",
        "rebuild": "tracedb.batches.steps:rebuild",
        "write_step": "tracedb.batches.files:write_step",
    },
)
