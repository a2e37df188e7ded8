"""tracedb benchmarks: tracedb side by side with verifiers v1 (the peer) in one run.

Run with ``python -m benchmarks`` (``make bench``); see ``benchmarks/README.md``.
"""
