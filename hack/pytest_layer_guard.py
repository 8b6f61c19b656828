"""pytest plugin: the unit, controlplane and worker layers must never skip, and tests must run.

Only `gpu` and `e2e` tests may skip (no GPU, no Docker/kind here); any other skip, or a
session that collected nothing, turns the run red, so a missing install step can't hide.
"""

from __future__ import annotations

import pytest

MAY_SKIP = {"gpu", "e2e"}
_bad_skips: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        markers = set(report.keywords)
        if not markers & MAY_SKIP:
            _bad_skips.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _bad_skips:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _bad_skips:
        terminalreporter.section("layer guard")
        terminalreporter.write_line(
            f"{len(_bad_skips)} test(s) outside the gpu/e2e layers were skipped; these layers "
            "must run everywhere:"
        )
        for nodeid in _bad_skips:
            terminalreporter.write_line(f"  {nodeid}")
