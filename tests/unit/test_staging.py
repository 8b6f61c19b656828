"""The training state's copies (staging.Staging, host_copies._HostCopies) on the CPU: what each
start and wait records, that an offload started early frees only when finished, and that a load
left pending is refused a second start until someone waited for it."""

from __future__ import annotations

import pytest
import torch

from rljob.api import OverlapStaging, RLJobSpec
from rljob_worker.host_copies import _HostCopies
from rljob_worker.staging import Staging, overlap_staging

CPU = torch.device("cpu")


def _copies(staging: Staging) -> tuple[_HostCopies, torch.Tensor, list[torch.UntypedStorage]]:
    tensor = torch.arange(6, dtype=torch.float32)
    return _HostCopies(CPU, staging, "out", "in"), tensor, [tensor.untyped_storage()]


def test_an_offload_started_early_keeps_the_storage_until_it_is_finished() -> None:
    staging = Staging(CPU, overlap=True)
    copies, tensor, storages = _copies(staging)
    staging.stage = "offload_optimizer"
    copies.start_offload(storages)
    assert tensor.untyped_storage().nbytes() == 24  # still on the device: the sync runs
    staging.stage = "offload_train"
    copies.offload(storages)
    assert tensor.untyped_storage().nbytes() == 0
    staging.stage = "train"
    copies.load(wait=False)
    assert torch.equal(tensor, torch.arange(6, dtype=torch.float32))
    with (
        pytest.raises(RuntimeError, match="in: started again before anything waited"),
        staging.copies("in"),
    ):
        pass
    staging.wait("in", before="optimizer.step()")
    staging.wait("in")  # nothing pending: not recorded again
    assert staging.take() == (
        "offload_optimizer: start out",
        "offload_train: wait out",
        "train: start in",
        "train: wait in before optimizer.step()",
    )
    assert staging.take() == ()


def test_a_synchronous_offload_records_its_wait_in_its_own_stage() -> None:
    staging = Staging(CPU, overlap=False)
    copies, _, storages = _copies(staging)
    staging.stage = "offload_optimizer"
    copies.offload(storages)
    copies.load()
    assert staging.take() == (
        "offload_optimizer: start out",
        "offload_optimizer: wait out",
        "offload_optimizer: start in",
        "offload_optimizer: wait in",
    )
    copies.load()  # nothing offloaded: no copy, no record
    assert staging.take() == ()


@pytest.mark.parametrize(
    ("setting", "device", "overlap"),
    [("Auto", "cuda", True), ("Auto", "cpu", False), ("On", "cpu", True), ("Off", "cuda", False)],
)
def test_auto_overlaps_on_cuda_only(setting: str, device: str, overlap: bool) -> None:
    spec = RLJobSpec.model_validate(
        {"model": {"path": "/m"}, "training": {"overlapStaging": setting}}
    )
    assert spec.training.overlap_staging is OverlapStaging(setting)
    assert overlap_staging(spec, torch.device(device)) is overlap
