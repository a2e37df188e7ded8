"""Helpers the tests share, imported as ``support`` (``pythonpath`` in pyproject.toml)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root: on ``sys.path`` for the tests, so that ``benchmarks`` (not part of
the installed package) imports, as ``tests/support/batches.py`` and ``tests/bench`` do."""
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "verifiers-0.4.0"
"""Real traces.jsonl files written by verifiers 0.4.0, each beside its NAME.branches.json:
verifiers' own branch views of that file (the ground truth)."""
FIXTURES_041 = FIXTURES.parent / "verifiers-0.4.1"
"""The same for verifiers 0.4.1.dev86 (weight versions, dropped traces, run work); see its
README.md. Its ``weight_versions.invalid.jsonl`` is not a fixture to ingest whole: pick the
``*.traces.jsonl`` files."""
