"""Counterfactual edit credit (CEC) for software agents.

A repository-repair rollout ends in a patch that the tests score once. CEC picks one
*surviving* block of edits without looking at any verdict, verifies the final artifact
with that block's paths put back to their pre-block contents (one extra verifier run),
and turns the signed utility difference ``D`` into an additive advantage on the sampled
tokens of the turns that produced the block. Four arms are stamped side by side as
named credit sets: ``cec-O`` (terminal advantage only), ``cec-B`` (``D`` broadcast over
every sampled token), ``cec-M`` (``D`` localized on the block's turns) and ``cec-E``
(the terminal advantage concentrated on the block's turns, no counterfactual query).
The user documentation, with every decision the method leaves open, is ``docs/cec.md``.

Pieces, from pure rules to the database:

- rules: :func:`is_test_path`, :func:`edit_blocks` (blocks and eligibility from per-turn
  snapshots), :func:`select_block` (verifier-blind SHA-256 choice), :func:`utility`,
  :func:`coefficients`, :func:`edit_focus`, :func:`quantile`;
- records: :class:`TurnRecord`, :class:`TraceRecord`, :class:`VerificationRecord`
  (JSONL, one object per line with ``kind``), :func:`ingest_records` into ``cec_turns``,
  ``cec_traces``, ``cec_verifications`` with the rejection rules of trace ingest;
- :func:`plan` (per trace: blocks, selection, utilities, ``D``, coefficients, into
  ``cec_selection``), :func:`queries` (the interventions a harness should run),
  :func:`stamp` (plan + the four credit sets, one transaction), :func:`check` (the
  coefficient identities on the stored credit) and :func:`report` (signal availability).

The harness side (git snapshots and the intervention patch) is :mod:`tracedb.cec.git`;
the command line, ``tracedb cec ...``, is :mod:`tracedb.cec.cli`.
The tables are created by ``schema/cec.sql``, which this module installs itself,
idempotently, before it touches any ``cec_*`` table. The rules are imported with the
package; the rest when first used (:mod:`tracedb.lazy`), so ``tracedb cec`` is on the
command line's menu without its start importing DuckDB or Polars.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracedb.lazy import exports

if TYPE_CHECKING:
    from tracedb.cec.audit import CheckReport, check, report, report_rows
    from tracedb.cec.planning import plan, queries, stamp
    from tracedb.cec.records import (
        CecIngestReport,
        TraceRecord,
        TurnRecord,
        VerificationRecord,
        ensure_installed,
        ingest_records,
        install,
        parse_record,
    )
from tracedb.cec.rules import (
    ARMS,
    CEC_SCHEMA_VERSION,
    CREDIT_SETS,
    DEFAULT_CAP,
    DEFAULT_LAM,
    F32_EPS,
    PASSING,
    TEST_PATH_PATTERNS,
    CecError,
    EditBlock,
    Turn,
    Utility,
    block_digest,
    coefficients,
    contrast,
    edit_blocks,
    edit_focus,
    is_test_path,
    quantile,
    select_block,
    selection_key,
    utility,
    utility_parts,
)

__all__ = [
    "ARMS",
    "EditBlock",
    "CEC_SCHEMA_VERSION",
    "CREDIT_SETS",
    "CecError",
    "CecIngestReport",
    "CheckReport",
    "DEFAULT_CAP",
    "DEFAULT_LAM",
    "F32_EPS",
    "PASSING",
    "TEST_PATH_PATTERNS",
    "TraceRecord",
    "Turn",
    "TurnRecord",
    "Utility",
    "VerificationRecord",
    "block_digest",
    "check",
    "coefficients",
    "contrast",
    "edit_blocks",
    "edit_focus",
    "ensure_installed",
    "ingest_records",
    "install",
    "is_test_path",
    "parse_record",
    "plan",
    "quantile",
    "queries",
    "report",
    "report_rows",
    "select_block",
    "selection_key",
    "stamp",
    "utility",
    "utility_parts",
]

__getattr__, __dir__ = exports(
    __name__,
    {
        "CheckReport": "tracedb.cec.audit:CheckReport",
        "check": "tracedb.cec.audit:check",
        "report": "tracedb.cec.audit:report",
        "report_rows": "tracedb.cec.audit:report_rows",
        "plan": "tracedb.cec.planning:plan",
        "queries": "tracedb.cec.planning:queries",
        "stamp": "tracedb.cec.planning:stamp",
        "CecIngestReport": "tracedb.cec.records:CecIngestReport",
        "TraceRecord": "tracedb.cec.records:TraceRecord",
        "TurnRecord": "tracedb.cec.records:TurnRecord",
        "VerificationRecord": "tracedb.cec.records:VerificationRecord",
        "ensure_installed": "tracedb.cec.records:ensure_installed",
        "ingest_records": "tracedb.cec.records:ingest_records",
        "install": "tracedb.cec.records:install",
        "parse_record": "tracedb.cec.records:parse_record",
    },
)
