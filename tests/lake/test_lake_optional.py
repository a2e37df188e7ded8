"""The file store does not need the lake extra: nothing outside tracedb.lake imports it."""

from __future__ import annotations

import subprocess
import sys


def test_the_file_store_and_the_cli_import_neither_pyiceberg_nor_ray():
    code = (
        "import sys, tracedb, tracedb.cli.main, tracedb.api.app\n"
        "db = tracedb.connect(':memory:'); db.close()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pyiceberg', 'ray', 'tracedb') "
        "and (m.startswith('tracedb.lake') or not m.startswith('tracedb'))))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_lake_commands_say_what_is_missing_without_the_extra(tmp_path):
    """With pyiceberg hidden, a lake command exits 2 naming the extra (and the rest works)."""
    code = (
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('pyiceberg', 'ray'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Hide())\n"
        "from typer.testing import CliRunner\n"
        "from tracedb.cli.main import app\n"
        f"r = CliRunner().invoke(app, ['lake', 'init', '--warehouse', {str(tmp_path / 'L')!r}])\n"
        "print(r.exit_code); print(r.output)\n"
        "print(CliRunner().invoke(app, ['--help']).exit_code)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "2" and "pip install 'tracedb[lake]'" in run.stdout and lines[-1] == "0"
