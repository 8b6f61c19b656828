"""Weight sync's multi-rank gather on a GPU: sync_send.gather_full's CUDA path over a real
collective, on the one GPU a single-GPU machine has.

Two processes share cuda:0 and join a gloo group (gloo all-gathers CUDA tensors through host
memory; NCCL refuses two ranks on one device). What is exercised is the device side of the
gather: the cast into one padded flat buffer, the strided copy-out per tensor and the foreach
copies, on CUDA, against the full tensors bit for bit. NCCL itself runs in test_multi_gpu.py,
which needs two GPUs.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.ranks import gloo_rank, run_ranks
from support.weight_gather import gather_and_describe

WORLD = 2
# Rows not divisible by 2, fewer rows than ranks, 1-D, 3-D, one large (a 3B model's MLP).
SHAPES = [(7, 3), (1, 5), (5,), (3, 2, 2), (11008, 2048)]

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _rank_main(rank: int, init_method: str, results: Any) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.cuda.set_device(0)
    with gloo_rank(rank, WORLD, init_method, results) as out:
        mesh = DeviceMesh("cuda", list(range(WORLD)))
        generator = torch.Generator().manual_seed(0)  # the same full tensors on every rank
        fulls = [torch.randn(s, generator=generator).cuda() for s in SHAPES]
        # src_data_rank=None: each rank cuts its own shard, no scatter.
        named = [
            (f"t{i}", distribute_tensor(f, mesh, [Shard(0)], src_data_rank=None))
            for i, f in enumerate(fulls)
        ]
        out.update(gather_and_describe(named, [f.to(torch.bfloat16) for f in fulls]))


def test_gather_full_on_cuda_over_two_ranks_equals_the_full_tensors() -> None:
    collected = run_ranks(_rank_main, WORLD, timeout_seconds=180)
    for rank in range(WORLD):
        out = collected[rank]
        assert "error" not in out, out
        assert all(out["equal"]), out["equal"]
        assert out["devices"] == ["cuda:0"]
        assert out["shapes"] == SHAPES
        assert out["flat_gathers"] == 1
