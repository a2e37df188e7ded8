"""``--module-progress``: a line as each test module finishes, so a long run says where it
is (``dev.py test`` turns it on)::

    [  7/131 modules,  412/2380 tests, 3m12s] tests/cli/test_cli.py: 16 tests in 41.2s

Under pytest-xdist the lines come from the controller, which sees every worker's reports:
a module is done when the teardown of its last collected test is reported (``--dist
loadfile`` runs a module whole on one worker; with other modes a module's tests may finish
on several, and the line comes when the last one does). Without xdist, the same from the
one process. Loaded by ``tests/conftest.py``; silent unless asked for.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--module-progress",
        action="store_true",
        default=False,
        help="print a line as each test module finishes: modules and tests done, elapsed time",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--module-progress") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(ModuleProgress(config), "tracedb-module-progress")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def elapsed(seconds: float) -> str:
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f}s"


class ModuleProgress:
    """Counts each module's finished tests against its collected ones."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.start = time.monotonic()
        self.total: Counter[str] = Counter()
        self.done: Counter[str] = Counter()
        self.began: dict[str, float] = {}
        self.finished_modules = 0
        self.collected = False

    def collected_ids(self, ids: list[str]) -> None:
        if not self.collected:  # every worker collects the same tests: count them once
            self.collected = True
            self.total = Counter(module_of(i) for i in ids)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if session.items:  # no items in an xdist controller: its workers collect
            self.collected_ids([item.nodeid for item in session.items])

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node: object, ids: list[str]) -> None:
        self.collected_ids(ids)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        module = module_of(report.nodeid)
        self.began.setdefault(module, time.monotonic())
        if report.when != "teardown":
            return
        self.done[module] += 1
        if self.done[module] != self.total.get(module):
            return
        self.finished_modules += 1
        now = time.monotonic()
        modules = len(self.total)
        tests = sum(self.total.values())
        done = f"{self.finished_modules:>{len(str(modules))}}/{modules} modules"
        count = f"{sum(self.done.values()):>{len(str(tests))}}/{tests} tests"
        line = (
            f"[{done}, {count}, {elapsed(now - self.start)}] {module}: {self.total[module]} tests in "
            f"{elapsed(now - self.began[module])}"
        )
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            if reporter._tw.width_of_current_line:  # after -q's dots: a line of its own
                reporter.write("\n")
            reporter.write_line(line)
