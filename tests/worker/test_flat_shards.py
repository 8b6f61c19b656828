"""The policy's shards in one buffer (sharded_load.to_empty_flat) on real gloo ranks: the layout
is the weight sync's send layout, training on it is training apart bit for bit, it survives the
params' offload, the sync's cast is one copy of it, and on one rank an engine that casts is
handed the buffer itself (Trainer.weight_buckets' engine_casts).

World 3 gives the builtin tiny Qwen2 short shards (rows that do not divide by 3), which FSDP2
pads into a new tensor of its own unless to_empty_flat points them back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.model_cache import fresh_model_cache, tiny_spec
from support.ranks import gloo_rank, run_ranks

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from fresh_model_cache(tmp_path_factory)


def _local(param: Any) -> Any:
    from torch.distributed.tensor import DTensor

    assert isinstance(param, DTensor)
    return param._local_tensor  # type: ignore[attr-defined]


def _rank_main(
    rank: int, init_method: str, world: int, model_dir: str, checkpoint_dir: str, results: Any
) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from rljob_worker.policy_update import Experience
    from rljob_worker.sharded_load import flat_shards
    from rljob_worker.sync_send import FLAT_SHARDS_ENV, flat_chunk_elements
    from rljob_worker.train import Trainer
    from rljob_worker.weight_sync import GatheredBucket

    def raw(bucket: Any) -> list[tuple[str, str, bytes]]:
        return [
            (n, str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes()) for n, t in bucket
        ]

    class Fp32Made(TorchDispatchMode):
        """Elements of every fp32 tensor a factory op (empty, zeros, new_zeros, ...) makes on
        the CPU: the policy's own allocations while it loads (the reference is bf16)."""

        def __init__(self) -> None:
            super().__init__()
            self.elements = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            name = func.__name__
            if name.startswith(("empty", "zeros", "new_", "full", "ones")):
                for t in tree_flatten(out)[0]:
                    if (
                        isinstance(t, torch.Tensor)
                        and not isinstance(t, DTensor)
                        and t.device.type == "cpu"
                        and t.dtype == torch.float32
                    ):
                        self.elements += t.numel()
            return out

    with gloo_rank(rank, world, init_method, results) as out:
        cpu = torch.device("cpu")
        trainers = {}
        for flat in (True, False):
            os.environ[FLAT_SHARDS_ENV] = "1" if flat else "0"
            torch.manual_seed(0)
            with Fp32Made() as counted:
                trainers[flat] = Trainer(tiny_spec("bfloat16"), model_dir, cpu, pad_id=0)
            if flat:
                made = counted.elements
        flat_t, apart_t = trainers[True], trainers[False]
        storage = flat_shards(flat_t.model)
        assert storage is not None
        out["one_storage"] = True
        out["apart"] = flat_shards(apart_t.model) is None
        # Each shard at its padded chunk's start, back to back in parameter order.
        at, placed = 0, True
        for p in flat_t.model.parameters():
            placed &= int(_local(p).storage_offset()) == at
            at += flat_chunk_elements(p.shape, world)
        out["placed"] = placed and storage.nbytes() == at * 4
        # What loading allocated in fp32 (FSDP2's re-padding of a short shard must find its
        # rows in place, not copy them).
        buffers = sum(b.numel() for b in flat_t.model.buffers() if b.dtype == torch.float32)
        out["made"] = (made, at, buffers)
        experience = Experience(
            [[1 + rank, 2], [3]], [[4, 5], [6, 7 + rank, 8]], [1.0, 0.0], [0, 0]
        )
        for trainer in (flat_t, apart_t):
            for _ in range(2):
                trainer.train_step(experience)
                trainer.offload_params()
                trainer.load_params()
        out["steps_equal"] = all(
            torch.equal(_local(a), _local(b))
            for a, b in zip(flat_t.model.parameters(), apart_t.model.parameters(), strict=True)
        )
        os.environ[FLAT_SHARDS_ENV] = "1"
        fresh = Trainer(tiny_spec("bfloat16"), model_dir, cpu, pad_id=0)
        out["moved"] = any(
            not torch.equal(_local(a), _local(b))
            for a, b in zip(flat_t.model.parameters(), fresh.model.parameters(), strict=True)
        )
        # A checkpoint's save and load as checkpoint.load does it (the fresh trainer's own state
        # dict filled in place by dcp.load, then set_state_dict) keep the layout.
        saved = get_state_dict(flat_t.model, flat_t.optimizer)
        dcp.save({"model": saved[0], "optim": saved[1]}, checkpoint_id=checkpoint_dir)
        model_state, optimizer_state = get_state_dict(fresh.model, fresh.optimizer)
        dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=checkpoint_dir)
        set_state_dict(
            fresh.model,
            fresh.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
        )
        fresh_storage = flat_shards(fresh.model)
        out["loaded_flat"] = fresh_storage is not None
        out["loaded"] = all(
            torch.equal(_local(a), _local(b))
            for a, b in zip(flat_t.model.parameters(), fresh.model.parameters(), strict=True)
        )
        out["still_one"] = flat_shards(flat_t.model) is not None
        # The sync's buckets: the same bytes either way, the flat one cast in one copy.
        small = 1 << 12
        got = {
            f: [raw(b) for b in t.weight_buckets(small, torch.bfloat16)]
            for f, t in trainers.items()
        }
        out["buckets_equal"] = got[True] == got[False] and len(got[True]) > 1
        out["flat_plans"] = [p.flat_source is not None for p in flat_t._send_plans.values()]
        out["apart_plans"] = [p.flat_source is not None for p in apart_t._send_plans.values()]
        # An engine that casts: on one rank the whole model, as stored; else the same buckets.
        cast = list(flat_t.weight_buckets(small, torch.bfloat16, engine_casts=True))
        full = {n: p.full_tensor() for n, p in flat_t.model.named_parameters()}  # type: ignore[attr-defined]
        out["cast_buckets"] = len(cast)
        out["cast_dtypes"] = sorted({str(t.dtype) for b in cast for _, t in b})
        out["cast_equal"] = (
            [(n, t.tolist()) for b in cast for n, t in b] == [(n, full[n].tolist()) for n in full]
            if world == 1
            else [raw(b) for b in cast] == got[True]
        )
        if world == 1:
            bucket = cast[0]
            assert isinstance(bucket, GatheredBucket)
            flat_buffer = bucket.flat.buffer
            out["as_stored"] = (
                flat_buffer.untyped_storage().data_ptr() == storage.data_ptr()
                and [e.name for e in bucket.flat.entries] == list(full)
                and all(
                    torch.equal(
                        flat_buffer[e.start : e.end].view(torch.float32).view(e.shape), full[e.name]
                    )
                    for e in bucket.flat.entries
                )
            )
            # Apart, there is no buffer to hand: the engine gets cast buckets as before.
            apart = [
                raw(b) for b in apart_t.weight_buckets(small, torch.bfloat16, engine_casts=True)
            ]
            out["apart_cast"] = apart == got[False]


@pytest.mark.parametrize("world", [1, 3])
def test_flat_shards_train_as_apart_and_hand_the_sync_one_buffer(
    model_cache: Path, tmp_path: Path, world: int
) -> None:
    from rljob_worker.model import resolve_model_path

    model_dir = str(resolve_model_path("builtin:tiny-qwen2"))
    results = run_ranks(
        _rank_main, world, world, model_dir, str(tmp_path / "checkpoint"), timeout_seconds=300
    )
    for rank in range(world):
        out = results[rank]
        assert "error" not in out, out
        assert out["one_storage"] and out["apart"] and out["placed"], out
        assert out["steps_equal"] and out["moved"] and out["still_one"], out
        assert out["loaded"] and out["loaded_flat"], out
        # Loading the policy made its buffer (every padded shard) and its fp32 buffers (the
        # rotary frequencies), nothing else: at world 3 no padded copy of a short shard.
        made, flat_elements, buffers = out["made"]
        assert made == flat_elements + buffers, out["made"]
        assert out["buckets_equal"], out
        assert out["flat_plans"] and all(out["flat_plans"]), out
        # Apart, only a bucket of one tensor is its own flat source.
        assert out["apart_plans"] and not all(out["apart_plans"]), out
        assert out["cast_equal"], out
        if world == 1:
            assert out["cast_buckets"] == 1 and out["cast_dtypes"] == ["torch.float32"], out
            assert out["as_stored"] and out["apart_cast"], out
        else:
            assert out["cast_dtypes"] == ["torch.bfloat16"], out
