"""tracedb's REST service and web trace viewer: ``create_app(db_path, ...)``, served by
``tracedb serve --db runs.duckdb`` (uvicorn)."""

from .app import create_app

__all__ = ["create_app"]
