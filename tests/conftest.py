"""Test layers by directory (unit, controlplane, worker, gpu, e2e) and the shared fixtures.
gpu/e2e skip, with the reason printed, only where this machine has no GPU / no Docker and kind.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.environment import MISSING_REASON_BY_LAYER

if TYPE_CHECKING:
    from support.plane import ControlPlane, KubeRayOperator

TESTS = Path(__file__).parent
LAYERS = ("unit", "controlplane", "worker", "gpu", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing: dict[str, str | None] = {}
    for item in items:
        parts = item.path.relative_to(TESTS).parts
        layer = parts[0] if parts else ""
        if layer not in LAYERS:
            continue
        item.add_marker(getattr(pytest.mark, layer))
        if layer in MISSING_REASON_BY_LAYER:
            if layer not in missing:
                missing[layer] = MISSING_REASON_BY_LAYER[layer]()
            if missing[layer]:
                item.add_marker(pytest.mark.skip(reason=f"{layer}: {missing[layer]}"))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Each test's report per phase as item.rep_setup/rep_call/rep_teardown, for fixtures that
    act on the outcome (the e2e namespace's logs on failure, the claim's cleanup check after a
    pass). Here, not in tests/e2e/: pytest calls hooks only from conftest files and plugins, and
    a second conftest module would clash with this one under mypy."""
    outcome = yield
    setattr(item, f"rep_{call.when}", outcome.get_result())  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver (RBAC) + kube-controller-manager, started once per session."""
    # Imported here: the plane needs `cryptography`, which the GPU machines lack, and the gpu
    # layer must still get this conftest's markers and skip logic there.
    from support.plane import Binaries, ControlPlane

    capture = request.config.pluginmanager.getplugin("capturemanager")
    # A fresh machine builds the binaries first (minutes): show that progress live.
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        bins = Binaries.locate()
        control_plane = ControlPlane(bins=bins).start()
    try:
        yield control_plane
    finally:
        control_plane.stop()


@pytest.fixture
def namespace(plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = plane.create_namespace(f"t-{uuid.uuid4().hex[:8]}")
    try:
        yield name
    finally:
        plane.delete_namespace(name)


@pytest.fixture
def kuberay(plane: ControlPlane) -> Iterator[KubeRayOperator]:
    """The real KubeRay operator for one test, stopped after it: left running, it would also
    write the RayJob status that other tests write as KubeRay's stand-in."""
    operator = plane.start_kuberay_operator()
    try:
        yield operator
    finally:
        operator.stop()
