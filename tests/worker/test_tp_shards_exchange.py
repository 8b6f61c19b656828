"""The weight sync shard to shard (sync_send.shard_bucket, rljob_worker.tp_shards) between real gloo
ranks: FSDP2-style Shard(0) DTensors of a small dense decoder's fp32 master weights, each
bucket one all_to_all_single, and each rank's buffer loaded by rljob's loader
(sglang_direct.copy_bucket) into that TP rank's engine model (a stand-in: sglang's model
classes need CUDA, support.sglang_standin). What each TP rank must hold comes from
sglang_standin.sglang_shards. Both ways the own blocks go: cast into the bucket's buffer
(the shards apart), and read where the trainer stores them (the shards in one buffer, as
sharded_load.to_empty_flat lays the policy's out). The GPU side, with sglang's own schedulers:
tests/gpu/test_two_gpu_sglang.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.ranks import gloo_rank, run_ranks

pytestmark = pytest.mark.worker

CONFIG: dict[str, Any] = {
    "hidden_size": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 24,
    "vocab_size": 256,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}
BUCKETS = 3
ROUNDS = 3


def _rank_main(rank: int, init_method: str, args: tuple[int, bool], results: Any) -> None:
    import torch
    import torch.distributed as dist
    from support.sglang_standin import engine_model, expected_shards, full_weights
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rljob.plan import shard_block_numel
    from rljob_worker.engines.sglang_direct import copy_bucket
    from rljob_worker.engines.sglang_weights import DenseLayout
    from rljob_worker.sync_send import shard_bucket
    from rljob_worker.tp_shards import parse_payload

    world, flat = args
    with gloo_rank(rank, world, init_method, results) as out:
        mesh = init_device_mesh("cpu", (world,))
        first, second = full_weights(CONFIG, seed=1), full_weights(CONFIG, seed=2)
        params: dict[str, Any] = {
            name: torch.nn.Parameter(distribute_tensor(t.float(), mesh, [Shard(0)]))
            for name, t in first.items()
        }
        names = list(params)
        if flat:  # every local shard a view of one fp32 buffer, back to back in name order
            locals_ = [params[n]._local_tensor for n in names]
            whole = torch.empty(sum(t.numel() for t in locals_))
            at = 0
            with torch.no_grad():
                for local in locals_:
                    values = local.clone()
                    local.set_(whole.untyped_storage(), at, local.shape, local.stride())
                    local.copy_(values)
                    at += local.numel()
        step = -(-len(names) // BUCKETS)
        buckets = [names[i : i + step] for i in range(0, len(names), step)]
        layout = DenseLayout.from_config(CONFIG, world)
        model = engine_model(first, CONFIG, rank, world)
        exchanges: list[int] = []
        real = dist.all_to_all_single

        def counted(*args: Any, **kwargs: Any) -> Any:
            exchanges.append(1)
            return real(*args, **kwargs)

        dist.all_to_all_single = counted  # type: ignore[assignment]
        plans: dict[Any, Any] = {}
        rounds = []
        for round_ in range(ROUNDS):
            expected = first
            if round_ >= 1:  # the params' offload: storages emptied, refilled with new values
                expected = second
                storages = {
                    p._local_tensor.untyped_storage().data_ptr(): p._local_tensor.untyped_storage()
                    for p in params.values()
                }
                for storage in storages.values():
                    nbytes = storage.nbytes()
                    storage.resize_(0)
                    storage.resize_(nbytes)
                for name, p in params.items():
                    with torch.no_grad():
                        p._local_tensor.copy_(second[name].float().chunk(world)[rank])
            if round_ == 2:  # one shard given another storage: its bucket is planned again
                local = params[names[0]]._local_tensor
                local.data = local.data.clone()
            before = dict(plans)
            del exchanges[:]
            payloads, stored = [], []
            for bucket in buckets:
                sent = shard_bucket([(n, params[n]) for n in bucket], torch.bfloat16, plans, layout)
                assert sent is not None and sent.names == bucket
                loaded = copy_bucket(model, sent.name, sent.buffer, (rank, world), sent.stored)
                assert loaded == []
                payloads.append(sent.name)
                # Own blocks as stored: the payload says so, the storage travels beside, and
                # the buffer holds only what crossed (its received region).
                payload = parse_payload(sent.name)
                stored.append(payload.stored)
                assert (sent.stored is not None) is (payload.stored is not None)
                if payload.stored is not None:
                    # From the storage's start: CUDA IPC shares an allocation by its base.
                    assert sent.stored is not None and sent.stored.storage_offset() == 0
                    assert all(e.own < sent.stored.numel() for e in payload.entries)
                    # The buffer is the received blocks' alone: smaller than the own blocks.
                    own = sum(shard_block_numel(e.shape, e.kind, world) * 2
                              for e in payload.entries)  # fmt: skip
                    assert 0 < sent.buffer.numel() < own
            held = dict(model.named_parameters())
            want = expected_shards(expected, CONFIG, rank, world)
            rounds.append(
                {
                    "equal": all(torch.equal(held[n].data, want[n]) for n in want),
                    "exchanges": len(exchanges),
                    "kept": [k[0] for k in before if plans[k] is before[k]],
                    "payloads": payloads,
                    "stored": stored,
                }
            )
        out["rounds"] = rounds
        out["buckets"] = [tuple(b) for b in buckets]
        # A bucket with rows the ranks do not divide goes by the full gather (None, everywhere).
        odd = distribute_tensor(torch.randn(3 * world + 1, 16), mesh, [Shard(0)])
        out["odd"] = shard_bucket([("model.layers.0.mlp.gate_proj.weight", odd)],
                                  torch.bfloat16, {}, layout)  # fmt: skip


@pytest.mark.parametrize("flat", [False, True], ids=["apart", "one-buffer"])
@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_its_tp_share_after_every_sync_across_offloads(
    world: int, flat: bool
) -> None:
    collected = run_ranks(_rank_main, world, (world, flat))
    for rank in range(world):
        out = collected[rank]
        assert "error" not in out, out
        rounds = out["rounds"]
        assert [r["equal"] for r in rounds] == [True] * ROUNDS
        # One all_to_all_single per bucket; every bucket of this model has a COLS or ALL tensor.
        assert [r["exchanges"] for r in rounds] == [BUCKETS] * ROUNDS
        # Planned once, kept across the offload; the bucket whose shard got a new storage is
        # planned again (the first), the others kept.
        assert rounds[1]["kept"] == out["buckets"]
        assert rounds[2]["kept"] == out["buckets"][1:]
        assert out["odd"] is None
        # With the shards in one buffer every bucket's own blocks go as stored, but the one
        # whose shard left that buffer (round 2: it falls back to the buffer, on every rank).
        as_stored = [r["stored"] for r in rounds]
        if flat:
            assert as_stored == [["float32"] * BUCKETS] * 2 + [[None] + ["float32"] * 2]
        else:
            assert as_stored == [[None] * BUCKETS] * ROUNDS
    # Every rank names every bucket by the same layout (the TP engine checks it on the GPU).
    assert len({tuple(collected[r]["rounds"][0]["payloads"]) for r in range(world)}) == 1
