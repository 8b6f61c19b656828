"""Weight sync's gather: FSDP2 dim-0 shards to full tensors with one all-gather per bucket.

Three real gloo ranks (so shards are uneven, and some ranks hold no rows of a small tensor)
compare gather_full with DTensor.full_tensor, bit for bit, and count the collectives; one rank
(the single-GPU case) must give the same with no collective at all.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.ranks import gloo_rank, run_ranks
from support.weight_gather import counted_all_gathers, gather_and_describe

from rljob_worker.weight_sync import LARGE_COPY_BYTES

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


def _overlap_rank_main(rank: int, init_method: str, world: int, results: Any) -> None:
    """Buckets gathered one after another against the overlapped pipeline the weight sync runs
    (weight_sync.prefetched: bucket N+1's all-gather issued before bucket N is handed on)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rljob.plan import plan_buckets
    from rljob_worker.sync_send import gather_full
    from rljob_worker.weight_sync import flatten, prefetched

    with gloo_rank(rank, world, init_method, results) as out:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        params = {f"t{i}": distribute_tensor(torch.randn(s), mesh, [Shard(0)]) for i, s in enumerate(SHAPES)}  # fmt: skip
        # ~60 bf16 elements a bucket: several buckets, one tensor larger than a bucket.
        buckets = plan_buckets([(n, p.numel() * 2) for n, p in params.items()], 120)

        def gather(names: list[str]) -> Any:
            return lambda: gather_full([(n, params[n]) for n in names], torch.bfloat16)

        one_by_one = [gather(names)() for names in buckets]
        handed: list[list[tuple[str, bytes]]] = []
        views: list[bool] = []
        for bucket in prefetched(gather(names) for names in buckets):
            handed.append([(n, t.view(torch.uint8).numpy().tobytes()) for n, t in bucket])
            views.append(not flatten(bucket).packed)
            del bucket
        out["buckets"] = len(buckets)
        out["names_equal"] = [[n for n, _ in b] for b in handed] == buckets
        out["bytes_equal"] = [
            [(n, t.view(torch.uint8).numpy().tobytes()) for n, t in b] for b in one_by_one
        ] == handed
        out["views"] = views


@pytest.mark.parametrize("world", [1, WORLD])
def test_overlapped_gather_hands_on_the_same_buckets_in_order_bit_for_bit(world: int) -> None:
    collected = run_ranks(_overlap_rank_main, world, world)
    for rank in range(world):
        out = collected[rank]
        assert "error" not in out, out
        assert out["buckets"] >= 3
        assert out["names_equal"] and out["bytes_equal"], out
        # Every bucket gather_full gave lies in one buffer: the flattened hand-off copies none.
        assert out["views"] == [True] * out["buckets"]


def _planned_rank_main(
    rank: int, init_method: str, world: int, large_bytes: int, results: Any
) -> None:
    """gather_full with the trainer's plans against without, over syncs where the shards'
    storages are emptied and refilled (the params' offload) and one shard gets a new storage.
    `large_bytes`: weight_sync.LARGE_COPY_BYTES in this process (copies of at least that many
    bytes launched one by one, the rest as one foreach)."""
    import os

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from rljob_worker import weight_sync
    from rljob_worker.sync_send import gather_full
    from rljob_worker.weight_sync import GatheredBucket, flatten

    os.environ.pop(weight_sync.LARGE_COPY_ENV, None)  # the threshold is this test's
    weight_sync.LARGE_COPY_BYTES = large_bytes

    def raw(bucket: Any) -> list[tuple[str, bytes]]:
        return [(n, t.contiguous().view(torch.uint8).numpy().tobytes()) for n, t in bucket]

    with gloo_rank(rank, world, init_method, results) as out:
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        params: list[tuple[str, Any]] = [
            (f"t{i}", torch.nn.Parameter(distribute_tensor(torch.randn(s), mesh, [Shard(0)])))
            for i, s in enumerate(SHAPES)
        ]
        plans: dict[Any, Any] = {}
        rounds: list[dict[str, Any]] = []
        for round_ in range(4):
            if round_ == 1:  # the offload: every shard's storage emptied, refilled, rewritten
                for _, p in params:
                    local = p.to_local()
                    local.untyped_storage().resize_(0)
                    local.untyped_storage().resize_(local.numel() * local.element_size())
                    with torch.no_grad():
                        local.copy_(torch.full_like(local, float(round_ + rank)))
            if round_ == 2:  # one shard given another storage (the DTensor's own shard: a
                local = params[0][1]._local_tensor  # Parameter's to_local() is an alias of it)
                local.data = torch.full_like(local, 7.0)
            before = dict(plans)
            with counted_all_gathers() as gathers:
                planned = gather_full(params, torch.bfloat16, plans)
            plain = gather_full(params, torch.bfloat16)
            assert isinstance(planned, GatheredBucket)
            laid = flatten(list(planned))  # measured again, as the hand-off did before
            rounds.append(
                {
                    "equal": raw(planned) == raw(plain),
                    "layout": planned.flat.entries == laid.entries,
                    "buffer": torch.equal(planned.flat.buffer, laid.buffer),
                    "plans": len(plans),
                    "same_plan": bool(before) and all(plans[k] is before[k] for k in before),
                    "gathers": len(gathers),
                    "copies": [len(part) for part in next(iter(plans.values())).copies],
                }
            )
        # A shard re-strided in place keeps its object and address: the plan's layout check
        # sends the bucket down the general path (the shard is no longer contiguous).
        local = params[5][1]._local_tensor  # SHAPES[5] is (3, 2, 2)
        local.as_strided_(local.shape, (local.stride(0), 1, 2))
        restrided = gather_full(params, torch.bfloat16, plans)
        out["restrided"] = (not isinstance(restrided, GatheredBucket),
                            raw(restrided) == raw(gather_full(params, torch.bfloat16)))  # fmt: skip
        # A bucket with a replicated tensor is not planned: the general path, same answer.
        mixed = [*params[:2], ("r", distribute_tensor(torch.randn(4, 4), mesh, [Replicate()]))]
        other: dict[Any, Any] = {}
        got = gather_full(mixed, torch.bfloat16, other)
        out["mixed"] = (not other, not isinstance(got, GatheredBucket),
                        raw(got) == raw(gather_full(mixed, torch.bfloat16)))  # fmt: skip
        out["rounds"] = rounds


@pytest.mark.parametrize("world", [1, WORLD])
@pytest.mark.parametrize("large_bytes", [16, LARGE_COPY_BYTES], ids=["split", "default"])
def test_a_planned_gather_gives_the_unplanned_bytes_and_layout_across_offloads(
    world: int, large_bytes: int
) -> None:
    collected = run_ranks(_planned_rank_main, world, world, large_bytes)
    for rank in range(world):
        out = collected[rank]
        assert "error" not in out, out
        rounds = out["rounds"]
        # At 16 bytes the shards' copies go both ways (a copy_ each, a foreach for the rest);
        # at the default every test tensor is small.
        large, small = rounds[0]["copies"]
        assert small > 0 and (large > 0) == (large_bytes == 16)
        assert [r["equal"] and r["layout"] and r["buffer"] for r in rounds] == [True] * 4
        assert all(r["plans"] == 1 for r in rounds)
        # Planned once, kept across the offload, planned again for the new storage, then kept.
        assert [r["same_plan"] for r in rounds] == [False, True, False, True]
        assert [r["gathers"] for r in rounds] == [1 if world > 1 else 0] * 4
        assert list(out["mixed"]) == [True, True, True]
        assert list(out["restrided"]) == [True, True]
