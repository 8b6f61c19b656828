"""The e2e layer's pytest hooks: a hook in a test module is never called, only one in a conftest.

Each test's report per phase as item.rep_setup/rep_call/rep_teardown, for fixtures that act on the
outcome (the namespace's logs on failure, the claim's cleanup check after a pass).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    setattr(item, f"rep_{call.when}", outcome.get_result())  # type: ignore[attr-defined]
