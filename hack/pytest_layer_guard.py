"""pytest plugin: the unit, controlplane and worker layers must never skip, and tests must run.

Only `gpu` and `e2e` tests may skip (no GPU, no Docker/kind here); any other skip, or a
session that collected nothing, turns the run red, so a missing install step can't hide.

It also ends the pytest process with the session's exit status as soon as pytest is done,
without the interpreter's finalization: a cold `make test` on 2026-11-27 reported every test
and then died of SIGSEGV (exit 139) while the interpreter shut down, with Ray's and gRPC's
native threads still alive in the process (the Ray driver leaves with os._exit for the same
reason). The status is the session's, so nothing that failed can pass this way.
"""

from __future__ import annotations

import os
import sys

import pytest

MAY_SKIP = {"gpu", "e2e"}
_bad_skips: list[str] = []
_sessions: list[pytest.Session] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _sessions.append(session)


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


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """The last thing pytest does: leave with the session's status, skipping finalization."""
    if not _sessions:
        return
    status = int(_sessions[-1].exitstatus)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
