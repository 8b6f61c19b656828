"""Sharded loading on the CPU: two real gloo ranks build the builtin tiny Qwen2 on meta, shard it
with FSDP2 and read only their rows from the safetensors files.

While Trainer(...) loads the policy and the reference, a TorchDispatchMode records every plain
fp32 tensor any op allocates: none may be a whole (unsharded) parameter, which from_pretrained's
path (load everything, then shard) makes on every rank. The shards must equal that old path's
bit for bit, from one file and from a sharded checkpoint (model.safetensors.index.json).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support.model_cache import fresh_model_cache, tiny_spec
from support.ranks import gloo_rank, run_ranks

pytestmark = pytest.mark.worker

WORLD = 2


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    yield from fresh_model_cache(tmp_path_factory)


def _local(tensor: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rank_main(rank: int, init_method: str, world: int, sharded_dir: str, results: Any) -> None:
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from rljob_worker.model import load_causal_lm, resolve_model_path
    from rljob_worker.sync_send import flat_chunk_elements
    from rljob_worker.train import Trainer, _shard

    class Fp32Shapes(TorchDispatchMode):
        """Shapes of every plain (not DTensor, not meta) fp32 tensor an op allocates: views
        (safetensors' slice of its memory-mapped file, before the rows are read) own none."""

        def __init__(self) -> None:
            super().__init__()
            self.shapes: set[tuple[int, ...]] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            if func.is_view:
                return out
            for t in tree_flatten(out)[0]:
                if (
                    isinstance(t, torch.Tensor)
                    and not isinstance(t, DTensor)
                    and t.device.type != "meta"
                    and t.dtype == torch.float32
                ):
                    self.shapes.add(tuple(t.shape))
            return out

    def whole_params_allocated(seen: set[tuple[int, ...]], model: Any) -> list[str]:
        """Parameters whose whole shape was allocated (shapes some shard also has excluded)."""
        full = {n: tuple(p.shape) for n, p in model.named_parameters()}
        local = {tuple(_local(p).shape) for p in model.parameters()}
        return sorted(n for n, shape in full.items() if shape in seen and shape not in local)

    # transformers 5 loads in worker threads, which a (thread-local) dispatch mode does not see:
    # the control below needs from_pretrained on this thread.
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    with gloo_rank(rank, world, init_method, results) as out:
        cpu = torch.device("cpu")
        spec = tiny_spec()
        # The builtin model (one fp32 file): the new path against from_pretrained's, bit for bit.
        path = resolve_model_path("builtin:tiny-qwen2")
        trainer = Trainer(spec, path, cpu, pad_id=0)
        assert trainer.reference is not None
        old = load_causal_lm(path, torch.float32)
        _shard(old, trainer.mesh, torch.float32)
        old_params = dict(old.named_parameters())
        new_params = dict(trainer.model.named_parameters())
        out["names_equal"] = list(old_params) == list(new_params)
        out["policy_equal"] = all(
            torch.equal(_local(old_params[n]), _local(p)) for n, p in new_params.items()
        )
        ref = dict(trainer.reference.named_parameters())
        out["reference_equal"] = all(
            torch.equal(_local(old_params[n]).to(trainer.compute_dtype), _local(p))
            for n, p in ref.items()
        )
        out["buffers_equal"] = all(
            torch.equal(b, dict(trainer.model.named_buffers())[n]) for n, b in old.named_buffers()
        )
        policy: Any = trainer.model
        out["tied"] = policy.lm_head.weight is policy.model.embed_tokens.weight
        ids = torch.arange(12).reshape(2, 6) % 300 + 2
        with torch.no_grad():
            out["logits_equal"] = torch.equal(old(ids).logits, trainer.model(ids).logits)

        # A bf16 checkpoint in several files with an index (as real models come): the fp32
        # masters are made slice by slice. The old path, watched the same way, is the control.
        with Fp32Shapes() as seen:
            from_index = Trainer(spec, sharded_dir, cpu, pad_id=0)
        with Fp32Shapes() as seen_old:
            old_index = load_causal_lm(sharded_dir, torch.float32)
            _shard(old_index, trainer.mesh, torch.float32)
        out["checked"] = whole_params_allocated(
            {tuple(p.shape) for p in from_index.model.parameters()}, from_index.model
        )
        out["whole_allocated"] = whole_params_allocated(seen.shapes, from_index.model)
        out["whole_allocated_old"] = whole_params_allocated(seen_old.shapes, old_index)
        local_sizes = [_local(p).numel() for p in from_index.model.parameters()]
        # The policy's shards share one buffer (sharded_load.to_empty_flat): this rank's padded
        # rows of every parameter, a 1-D allocation of their sum; nothing else above a shard.
        flat = sum(flat_chunk_elements(p.shape, world) for p in from_index.model.parameters())
        out["flat_allocated"] = (flat,) in seen.shapes
        out["flat_share"] = flat / sum(p.numel() for p in from_index.model.parameters())
        out["largest_fp32_allocated"] = max(
            int(torch.Size(s).numel()) for s in seen.shapes if s != (flat,)
        )
        out["largest_local"] = max(local_sizes)
        out["largest_full"] = max(p.numel() for p in from_index.model.parameters())
        out["slice_bytes"] = from_index.load_slice_bytes
        old_index_params = dict(old_index.named_parameters())
        out["index_equal"] = all(
            torch.equal(_local(p), _local(old_index_params[n]))
            for n, p in from_index.model.named_parameters()
        )


def _save_sharded(model_path: Path, target: Path) -> int:
    """The tiny model re-saved in bf16, in several files with an index; the number of files."""
    import shutil

    import torch

    from rljob_worker.model import load_causal_lm

    model = load_causal_lm(model_path, torch.bfloat16)
    model.save_pretrained(target, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_path / name).exists():
            shutil.copy(model_path / name, target / name)
    return len(list(target.glob("*.safetensors")))


def test_no_rank_holds_a_whole_fp32_parameter_and_shards_equal_from_pretrained(
    model_cache: Path, tmp_path: Path
) -> None:
    from rljob_worker.model import resolve_model_path

    path = Path(resolve_model_path("builtin:tiny-qwen2"))
    sharded = tmp_path / "sharded"
    assert _save_sharded(path, sharded) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    collected = run_ranks(_rank_main, WORLD, WORLD, str(sharded))
    for rank in range(WORLD):
        out = collected[rank]
        assert "error" not in out, out
        # Parameters whose whole shape no shard has: the embedding, norms, biases, MLP.
        assert "model.embed_tokens.weight" in out["checked"]
        assert len(out["checked"]) >= 4
        assert out["whole_allocated_old"] == out["checked"], "the control: the old path does"
        assert out["whole_allocated"] == [], out["whole_allocated"]
        assert out["largest_fp32_allocated"] <= out["largest_local"] < out["largest_full"]
        # The one buffer is this rank's share (padding rows aside), not a whole model.
        assert out["flat_allocated"] and out["flat_share"] < 1 / WORLD + 0.01, out["flat_share"]
        # One slice at a time: the embedding's half, as stored (bf16).
        assert out["slice_bytes"] == out["largest_local"] * 2
        for check in (
            "names_equal",
            "policy_equal",
            "reference_equal",
            "buffers_equal",
            "tied",
            "logits_equal",
            "index_equal",
        ):
            assert out[check] is True, (rank, check)


def test_a_parameter_missing_from_the_files_is_named(model_cache: Path, tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from rljob_worker.model import resolve_model_path
    from rljob_worker.sharded_load import build_on_meta, fill_shards

    path = Path(resolve_model_path("builtin:tiny-qwen2"))
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    model = build_on_meta(broken, torch.float32)
    model.to_empty(device=torch.device("cpu"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        fill_shards(model, broken)
