"""What this machine can run: a CUDA GPU (for `gpu` tests), Docker + kind (for `e2e` tests).
conftest.py skips those two layers, with the reason printed, only where this says no.
"""

from __future__ import annotations

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
    """Why e2e tests cannot run here (no docker/kind binary, no running Docker engine), or None."""
    for tool in ("docker", "kind"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (the kind e2e suite needs Docker and kind)"
    probe = subprocess.run(
        ["docker", "info"], capture_output=True, text=True, check=False, timeout=30
    )
    if probe.returncode != 0:
        return "no Docker engine is running (the kind e2e suite needs one)"
    return None


# Layers that may skip, and the probe saying why this machine cannot run them (None: it can).
MISSING_REASON_BY_LAYER: dict[str, Callable[[], str | None]] = {
    "gpu": gpu_missing_reason,
    "e2e": kind_missing_reason,
}
