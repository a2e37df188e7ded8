"""``python -m tracedb``: the ``tracedb`` command."""

from tracedb.cli.main import app

app(prog_name="tracedb")
