# Conveniences over dev.py, which needs only Python and pip.
PYTHON ?= python3
.PHONY: demo test bench clean
demo:
	$(PYTHON) dev.py demo
test:
	$(PYTHON) dev.py test
bench:
	$(PYTHON) dev.py bench
clean:
	rm -rf .venv data out tracedb-demo.duckdb tracedb-demo.parquet .pytest_cache
