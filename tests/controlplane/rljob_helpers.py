"""Helpers shared by the RLJob control-plane tests: API clients on the test plane, CRD install,
and waiting with a deadline (never an unbounded sleep loop)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from rljob.api import GROUP, PLURAL, VERSION

ROOT = Path(__file__).parents[2]
T = TypeVar("T")


def admin_kubeconfig(plane: Any) -> Path:
    # tests/support/plane.py names the admin kubeconfig `kubeconfig`.
    return Path(plane.kubeconfig)


def api_client(kubeconfig: Path) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(kubeconfig))


def install_rljob_crds(plane: Any) -> None:
    """Apply the checked-in CRDs (idempotent) and wait until they are served."""
    for name in ("rljob.dev_rljobs.yaml", "kopf-peering.yaml"):
        plane.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds" / name)
        )
    plane.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        f"crd/{PLURAL}.{GROUP}", "crd/clusterkopfpeerings.kopf.dev",
    )  # fmt: skip


def rljob(name: str, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RLJob",
        "metadata": {"name": name},
        "spec": spec or {},
    }


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 30.0) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
