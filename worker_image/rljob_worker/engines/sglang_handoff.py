"""How a rank's tensors reach sglang's schedulers: CUDA tensors by device UUID, sglang's
serializer and per-TP-rank wrapper, and the opt-in flattened-bucket path (one buffer a bucket).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rljob.plan import SGLANG_WEIGHT_SYNC_DEFAULT, SGLANG_WEIGHT_SYNC_ENV, sglang_weight_sync
from rljob_worker.engines.sglang_contract import (
    SGLangContract,
    SGLangVersionError,
    installed_contract,
)


def _patch_tensor_reductions(contract: SGLangContract) -> None:
    """Make CUDA tensors this process hands to sglang travel by device UUID (idempotent).

    Tensors cross into the scheduler processes by CUDA IPC; sglang's own weight_sync/utils.py
    patches the producer side too (0.5.17 and 0.5.23), so a device stays right when the scheduler
    sees a different CUDA_VISIBLE_DEVICES than this process (Ray actors, a tensor-parallel
    group's union).
    """
    patch_module, patch_function = contract.tensor_reduction_patch
    getattr(importlib.import_module(patch_module), patch_function)()


@dataclass(frozen=True)
class TensorHandoff:
    """How one rank hands its full tensors to a tensor-parallel engine's schedulers.

    `serialize(tensor)` turns a tensor into an IPC handle (bytes); `local_tensor(values=[...])`
    wraps one handle per TP rank, and TP rank i's scheduler loads values[i], a tensor on its
    own GPU, so no scheduler reads another GPU's memory.
    """

    serialize: Callable[[Any], bytes]
    local_tensor: Callable[..., Any]
    # sglang's FlattenedTensorMetadata where the flattened-bucket path is taken, else None:
    # then each rank serializes one {"flattened_tensor", "metadata"} per bucket instead.
    flattened_metadata: Callable[..., Any] | None = None
    # The direct path (engines/sglang_direct.py): each bucket travels as one flat buffer to
    # rljob's own loader in the schedulers, which copies it into sglang's parameters.
    direct: bool = False


# RLJOB_SGLANG_WEIGHT_SYNC: "direct" (the default: one flat buffer a bucket, copied into sglang's
# parameters by rljob's loader in the schedulers, sglang_direct.py; 2.2x faster than one tensor
# per parameter on an H200), "tensors" (one tensor per parameter, sglang's own load_weights),
# "auto" (flattened buckets where the installed sglang has them), or "flattened_bucket"
# (required: an error where sglang lacks it). The flattened path gained nothing on an H100
# (docs/weight-sync.md); bench/colocate.py --sync-path measures each.
# The name and default are the memory plan's (rljob.plan.sync_as_stored reads them too).
WEIGHT_SYNC_ENV = SGLANG_WEIGHT_SYNC_ENV
WEIGHT_SYNC_PATHS = ("auto", "tensors", "flattened_bucket", "direct")
DEFAULT_WEIGHT_SYNC = SGLANG_WEIGHT_SYNC_DEFAULT


def weight_sync_choice() -> str:
    """RLJOB_SGLANG_WEIGHT_SYNC, checked (one of WEIGHT_SYNC_PATHS; unset: the default)."""
    choice = sglang_weight_sync(os.environ.get(WEIGHT_SYNC_ENV, ""))
    if choice not in WEIGHT_SYNC_PATHS:
        raise ValueError(f"{WEIGHT_SYNC_ENV}={choice!r} must be one of {WEIGHT_SYNC_PATHS}")
    return choice


def direct_chosen(contract: SGLangContract) -> bool:
    """Whether buckets go to rljob's loader in the schedulers: RLJOB_SGLANG_WEIGHT_SYNC is
    "direct" (the default). Where the installed sglang runs no custom weight loader, the default
    falls back to one tensor per parameter, and an explicit "direct" is an error."""
    if weight_sync_choice() != "direct":
        return False
    if contract.direct_loader is not None:
        return True
    if os.environ.get(WEIGHT_SYNC_ENV, "").strip():
        raise SGLangVersionError(
            f"{WEIGHT_SYNC_ENV}=direct, but sglang {contract.release} runs no custom weight "
            "loader; unset it to hand over one tensor per parameter"
        )
    return False


def flattened_bucket_metadata(contract: SGLangContract) -> Callable[..., Any] | None:
    """sglang's metadata class of the flattened-bucket path, found by import (the feature, not
    the version number), or None where the path is not taken: RLJOB_SGLANG_WEIGHT_SYNC says
    "tensors" or "direct", or (under "auto") the contract has none or the installed sglang lacks
    the class."""
    choice = weight_sync_choice()
    if choice in ("tensors", "direct"):
        return None
    found: Callable[..., Any] | None = None
    if contract.flattened_bucket is not None:
        module, cls, _load_format = contract.flattened_bucket
        try:
            found = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            found = None
    if found is None and choice == "flattened_bucket":
        raise SGLangVersionError(
            f"{WEIGHT_SYNC_ENV}=flattened_bucket, but sglang {contract.release} here has no "
            "flattened-bucket weight update (sglang.srt.weight_sync.tensor_bucket); unset it to "
            "hand over one tensor per parameter"
        )
    return found


def load_tensor_handoff() -> TensorHandoff:
    """sglang's own serializer and per-rank wrapper (the contract's serializer, local_tensor),
    and its flattened-bucket metadata where that path is taken (flattened_bucket_metadata), or
    the direct path where RLJOB_SGLANG_WEIGHT_SYNC asks for it."""
    contract = installed_contract()
    _patch_tensor_reductions(contract)
    module, cls, method = contract.serializer
    serializer = getattr(importlib.import_module(module), cls)
    module, cls, _field = contract.local_tensor
    return TensorHandoff(
        serialize=getattr(serializer, method),
        local_tensor=getattr(importlib.import_module(module), cls),
        flattened_metadata=flattened_bucket_metadata(contract),
        direct=direct_chosen(contract),
    )
