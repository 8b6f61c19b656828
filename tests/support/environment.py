"""What this machine can run: a CUDA GPU (for `gpu` tests), Docker + kind (for `e2e` tests).
conftest.py skips those two layers, with the reason printed, only where this says no.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path


def gpu_missing_reason() -> str | None:
    """Why gpu tests cannot run here, or None. Only a missing GPU is a reason: a GPU machine
    without torch or torch_memory_saver must fail loudly, not skip into green."""
    if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists():
        return None
    if shutil.which("nvidia-smi"):
        probe = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, check=False, timeout=30
        )
        if probe.returncode == 0 and "GPU" in probe.stdout:
            return None
    return "no NVIDIA GPU on this machine (gpu tests run on the GPU test machines)"


def kind_missing_reason() -> str | None:
    """Why e2e tests cannot run here, or None. They run against the kind cluster that
    `hack/test.sh` builds (`make test`, `make e2e`, or RLJOB_E2E=1 with arguments), which then
    sets RLJOB_E2E_KUBECONFIG;
    a failed image build or cluster has already failed that run, naming the step. Without it,
    the layer skips with the reason."""
    if os.environ.get("RLJOB_E2E_KUBECONFIG"):
        return None
    if shutil.which("docker") is None:
        return "docker is not installed (the kind e2e suite needs Docker and kind: `make e2e`)"
    return "no kind cluster: the e2e layer runs under `make test` or `make e2e` (hack/test.sh builds it)"


# Layers that may skip, and the probe saying why this machine cannot run them (None: it can).
MISSING_REASON_BY_LAYER: dict[str, Callable[[], str | None]] = {
    "gpu": gpu_missing_reason,
    "e2e": kind_missing_reason,
}
