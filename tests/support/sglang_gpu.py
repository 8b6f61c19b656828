"""What every test module with the real SGLang engine starts with (marker gpu)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch


def sglang_gpu_missing() -> str | None:
    """Why a module of real-SGLang tests cannot run here (None: it can). Without sglang and with
    RLJOB_GPU_SGLANG=1 (it must be there) this raises instead: a missing sglang is an error."""
    if not torch.cuda.is_available():
        return "needs a CUDA device (run through the device tool)"
    if importlib.util.find_spec("sglang") is None:
        if os.environ.get("RLJOB_GPU_SGLANG") == "1":
            raise RuntimeError(
                "RLJOB_GPU_SGLANG=1 but sglang does not import: install the GPU set with "
                "hack/sglang-gpu-install.sh and put its site on PYTHONPATH"
            )
        return "sglang is not installed (hack/sglang-gpu-install.sh)"
    return None


def builtin_model_copy(directory: Path) -> Path:
    """The builtin tiny Qwen2, copied to a local directory as a user would point at one."""
    from rljob_worker.model import resolve_model_path

    shutil.copytree(Path(resolve_model_path("builtin:tiny-qwen2")), directory, dirs_exist_ok=True)
    return directory
