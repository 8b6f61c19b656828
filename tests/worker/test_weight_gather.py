"""Weight sync's gather: FSDP2 dim-0 shards to full tensors with one all-gather per bucket.

Three real gloo ranks (so shards are uneven, and some ranks hold no rows of a small tensor)
compare gather_full with DTensor.full_tensor, bit for bit, and count the collectives; one rank
(the single-GPU case) must give the same with no collective at all.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.ranks import gloo_rank, run_ranks
from support.weight_gather import gather_and_describe

pytestmark = pytest.mark.worker

WORLD = 3
# Rows not divisible by 3, fewer rows than ranks, 1-D, 3-D.
SHAPES = [(7, 3), (2, 5), (5,), (1, 4), (12,), (3, 2, 2), (64, 8)]


def _rank_main(rank: int, init_method: str, world: int, results: Any) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with gloo_rank(rank, world, init_method, results) as out:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)  # the same full tensors on every rank, then sharded
        tensors: list[torch.Tensor] = [
            distribute_tensor(torch.randn(s), mesh, [Shard(0)]) for s in SHAPES
        ]
        tensors.append(distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))
        tensors.append(torch.randn(3))  # not a DTensor: only cast
        named = [(f"t{i}", t) for i, t in enumerate(tensors)]

        expected = [
            t.full_tensor().to(torch.bfloat16)
            if isinstance(t, torch.distributed.tensor.DTensor)
            else t.to(torch.bfloat16)
            for t in tensors
        ]
        out.update(gather_and_describe(named, expected))


def test_one_all_gather_per_bucket_gives_the_same_full_tensors_as_full_tensor() -> None:
    collected = run_ranks(_rank_main, WORLD, WORLD)
    for rank in range(WORLD):
        out = collected[rank]
        assert "error" not in out, out
        assert out["names"] == [f"t{i}" for i in range(len(SHAPES) + 2)]
        assert all(out["equal"]), out["equal"]
        assert out["shapes"] == [*SHAPES, (4, 4), (3,)]
        assert out["dtypes"] == ["torch.bfloat16"]
        # Every Shard(0) tensor in one collective (the replicated one is gathered by DTensor).
        assert out["flat_gathers"] == 1


def test_one_rank_only_casts_without_a_collective() -> None:
    out = run_ranks(_rank_main, 1, 1)[0]
    assert "error" not in out, out
    assert all(out["equal"]), out["equal"]
    assert out["shapes"] == [*SHAPES, (4, 4), (3,)]
    assert out["dtypes"] == ["torch.bfloat16"]
    assert out["flat_gathers"] == 0


@pytest.mark.parametrize(
    ("rows", "world", "chunks"),
    [
        (7, 3, [(0, 3), (3, 3), (6, 1)]),
        (2, 3, [(0, 1), (1, 1), (2, 0)]),
        (1, 4, [(0, 1), (1, 0), (1, 0), (1, 0)]),
        (5, 4, [(0, 2), (2, 2), (4, 1), (5, 0)]),
        (8, 2, [(0, 4), (4, 4)]),
    ],
)
def test_row_chunks_follow_torch_chunk(
    rows: int, world: int, chunks: list[tuple[int, int]]
) -> None:
    import torch

    from rljob_worker.sharded_load import row_chunk

    assert [row_chunk(rows, world, r) for r in range(world)] == chunks
    # torch.chunk is what DTensor's Shard(0) and FSDP2 cut by (it may give fewer chunks).
    pieces = torch.arange(rows).chunk(world)
    assert [len(p) for p in pieces] == [n for _, n in chunks][: len(pieces)]
