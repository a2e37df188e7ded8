"""``python -m tracedb``: the ``tracedb`` command."""

from tracedb.cli.main import main

main()
