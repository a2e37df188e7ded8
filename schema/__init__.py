"""tracedb's DDL and SQL macros as ``.sql`` files, shipped as the package data
``tracedb.schema`` (read with :func:`tracedb.sqltext.load_sql`)."""
