"""What a process pays before it works: ``import tracedb`` and the command line's start
import none of the heavy libraries, a command imports what it uses, and the ``tracedb``
command hides pandas (pyarrow would import it, ~0.25 s, at its first conversion)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support import FIXTURES

HEAVY = ("duckdb", "pyarrow", "polars", "numba", "pandas", "pydantic", "numpy", "fastapi", "pyiceberg", "ray")


def _child(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


LOADED = "import json, sys; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1:]))))"


@pytest.mark.parametrize("statement", ["import tracedb", "import tracedb.cli.main", "from tracedb import TraceDBError"])
def test_starting_imports_no_heavy_library(statement):
    assert _child(f"{statement}; {LOADED}", *HEAVY) == []


def test_the_names_of_tracedb_are_there_when_used():
    out = _child(
        "import json, sys, tracedb\n"
        "names = [n for n in tracedb.__all__ if n not in dir(tracedb)]\n"
        "before = 'duckdb' in sys.modules\n"
        "from tracedb import connect, BRANCH_SCHEMA, batches\n"
        "with connect(':memory:') as db:\n"
        "    db.sql('SELECT 1')\n"
        "try:\n"
        "    tracedb.no_such_name\n"
        "    missing = None\n"
        "except AttributeError as e:\n"
        "    missing = str(e)\n"
        "print(json.dumps([names, before, batches.Plan.__name__, missing]))"
    )
    assert out == [[], False, "Plan", "module 'tracedb' has no attribute 'no_such_name'"]


def test_cec_plan_stays_the_function_whoever_imports_its_module_first():
    """``tracedb.cec.plan`` is the function; the module holding it is ``planning``, so the
    import system never rebinds the name to a module."""
    out = _child(
        "import json, tracedb.cec.audit, tracedb.cec as cec\n"
        "print(json.dumps([callable(cec.plan), type(cec.plan).__name__, cec.check.__module__]))"
    )
    assert out == [True, "function", "tracedb.cec.audit"]


INGEST = """
import gc, json, sys
from tracedb.cli.main import main
names = set(sys.argv[3:])  # before the command's own argv replaces them
sys.argv = ["tracedb", "ingest", sys.argv[1], "--db", sys.argv[2], "--no-progress", "--json"]
try:
    main()
except SystemExit as e:
    code = e.code
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"pandas", "numba", "polars", "pyiceberg", "ray", "fastapi"})
unused = sorted(set(sys.modules) & names)
print(json.dumps([code, loaded, unused, gc.get_freeze_count() > 1000]))
"""


# What the facade's other methods use (tracedb.database imports each in the method).
NOT_INGEST = (
    "tracedb.views",
    "tracedb.export",
    "tracedb.storage",
    "tracedb.readback",
    "tracedb.writeback",
    "tracedb.credit_sets",
    "tracedb.sqlcheck",
    "tracedb.batches",
    "pyarrow.parquet",
    "pyarrow.compute",  # the parser's path casts nothing and builds list arrays from buffers
)


def test_a_small_ingest_process_imports_only_what_it_uses(tmp_path):
    """``tracedb ingest`` of a small file: no pandas (hidden), no numba (the parser reads a
    small input), no Polars, lake or server libraries, none of the views, export, storage,
    readback, write-back or credit-set modules, no pyarrow.compute; once done, the objects are frozen out of
    the collector (the interpreter's exit does not walk them)."""
    db = str(tmp_path / "t.duckdb")
    code, loaded, unused, frozen = _child(INGEST, str(FIXTURES / "linear.traces.jsonl"), db, *NOT_INGEST)
    assert (code, loaded, unused, frozen) == (0, [], [], True)


def test_hidden_pandas_fails_to_import_until_shown():
    out = _child(
        "import json, sys\n"
        "from tracedb.cli.common import hide_pandas, show_pandas\n"
        "hide_pandas()\n"
        "import pyarrow as pa, numpy as np\n"
        "pa.array(np.arange(3)); pa.Table.from_pylist([{'a': 1}])\n"
        "try:\n"
        "    import pandas\n"
        "    hidden = False\n"
        "except ImportError:\n"
        "    hidden = True\n"
        "show_pandas()\n"
        "import pandas\n"
        "print(json.dumps([hidden, 'pandas' in sys.modules]))"
    )
    assert out == [True, True]


def test_lake_commands_see_pandas(tmp_path):
    """Ray Data needs pandas: the lake's commands show it again."""
    pytest.importorskip("pyiceberg")
    out = _child(
        "import json, sys\n"
        "from tracedb.cli.main import main\n"
        "sys.argv = ['tracedb', 'lake', 'init', '--warehouse', sys.argv[1], '--json']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "import pandas\n"
        "print(json.dumps([code, 'pandas' in sys.modules]))",
        str(tmp_path / "lake"),
    )
    assert out == [0, True]


def test_help_is_answered(tmp_path):
    done = subprocess.run([sys.executable, "-m", "tracedb", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ingest" in done.stdout and "cec" in done.stdout and "lake" in done.stdout


def test_the_console_script_is_main():
    script = Path(sys.executable).with_name("tracedb")
    if not script.exists():
        pytest.skip("no console script in this environment")
    assert "from tracedb.cli.main import main" in script.read_text()
