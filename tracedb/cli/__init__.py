"""The ``tracedb`` command (:mod:`tracedb.cli.main`): a thin shell over the library, and
what its commands share (:mod:`tracedb.cli.common`)."""
