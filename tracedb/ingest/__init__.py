"""Ingest: verifiers ``traces.jsonl`` files into the stored tables.

- :mod:`~tracedb.ingest.files`: which files a path names, and their lines (shared with
  counterfactual-edit-credit ingest);
- :mod:`~tracedb.ingest._scan` + :mod:`~tracedb.ingest.scanned`: the compiled scanner and
  its Python side, which take the lines they can vouch for straight into columns;
- :mod:`~tracedb.ingest.parse`: the parser for every other line, which words every rejection;
- :mod:`~tracedb.ingest.rows`: a batch's rows in the stored schemas;
- :mod:`~tracedb.ingest.writer`: the INSERT thread and the COMMIT;
- :mod:`~tracedb.ingest.rejects`: rejected records, kept with their reason;
- :mod:`~tracedb.ingest.run`: the loop and its report.
"""

from tracedb.ingest.files import find_files, read_lines
from tracedb.ingest.rejects import Reject
from tracedb.ingest.run import IngestReport, ingest_files

__all__ = ["IngestReport", "Reject", "find_files", "ingest_files", "read_lines"]
