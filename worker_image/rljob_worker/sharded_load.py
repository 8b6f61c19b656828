"""Sharded loading: a causal LM built on the meta device, sharded by FSDP2, each rank's rows read
straight from the safetensors files, so no rank (nor its host) ever holds a whole model.

from_pretrained builds the whole model in the master dtype on every rank before it is sharded:
a 32B model is ~131 GB in fp32 per rank and per copy (policy and reference), more than a card
and, times the ranks of a node, terabytes of host memory (docs/loading.md).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

SAFETENSORS_INDEX = "model.safetensors.index.json"

log = logging.getLogger(__name__)


def chunk_rows(rows: int, world: int) -> int:
    """Rows of a full dim-0 chunk as FSDP2 cuts it (torch.chunk): ceil(rows / world)."""
    return -(-rows // world)


def row_chunk(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(first row, rows) of `rank`'s dim-0 shard: full chunks, the last ones shorter or empty."""
    size = chunk_rows(rows, world)
    start = min(rank * size, rows)
    return start, min(size, rows - start)


def safetensors_files(path: Path | str) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it: model.safetensors.index.json's
    weight_map for a sharded checkpoint, else every *.safetensors file's own keys."""
    from safetensors import safe_open

    directory = Path(path)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory}: no *.safetensors files and no {SAFETENSORS_INDEX}: the sharded "
            "loader reads safetensors only (save the model with save_pretrained)"
        )
    found: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            found.update(dict.fromkeys(handle.keys(), file))
    return found


def build_on_meta(path: Path | str, dtype: torch.dtype) -> torch.nn.Module:
    """The model of `path`'s config.json with every parameter and buffer on the meta device, in
    `dtype`, in eval mode as from_pretrained returns it: no bytes allocated yet."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    model.eval()
    module: torch.nn.Module = model
    return module


def _fsdp_params(model: torch.nn.Module) -> list[Any]:
    """FSDP2's FSDPParam of every parameter it manages in `model` (its private bookkeeping:
    `_fsdp_param_groups` from torch 2.14, one `_fsdp_param_group` in 2.11)."""
    from torch.distributed.fsdp import FSDPModule

    found: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                group = state._fsdp_param_group
                groups = [group] if group is not None else []
            for group in groups:
                found.extend(group.fsdp_params)
    return found


def to_empty_flat(model: torch.nn.Module, device: torch.device) -> torch.Tensor | None:
    """model.to_empty(device=device), every FSDP2 shard a view of one zeroed buffer: the
    shards back to back in parameter order, each padded to its full dim-0 chunk as FSDP2 pads
    it (sync_send.flat_chunk_elements), which is also the layout of the weight sync's send buffer.
    So the sync's cast of a bucket is one copy, and on one rank the buffer is the bucket itself
    (sync_send.gather_full). Returns the buffer; None (nothing done) where the model is not all
    Shard(0) DTensors of one dtype, or FSDP2's bookkeeping is not where this reads it.

    FSDP2 keeps each shard twice: the DTensor parameter's local tensor (the rank's rows) and
    FSDPParam._sharded_param_data (those rows padded, flat); both are pointed here. The padded
    views are set first, so when to_empty's own pass (nn.Module._apply) makes the parameters,
    FSDP2's re-padding of a short shard (reset_sharded_param) finds its rows already in the
    padded view's storage and allocates nothing (without that, every short shard's padded copy
    would be alive at once: up to a second rank's worth of params at load). The views are
    checked, and put back where FSDP2 moved one, after it."""
    params = list(model.parameters())  # each once, in named_parameters order
    if not params or not all(
        isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),) and p.dim() > 0
        for p in params
    ):
        return None
    if len({p.dtype for p in params}) != 1:
        return None
    try:
        managed = {id(fp.sharded_param): fp for fp in _fsdp_params(model)}
    except AttributeError as error:
        log.warning("FSDP2's params are not where this torch kept them (%s): shards apart", error)
        return None
    if set(managed) != {id(p) for p in params}:
        return None
    first = params[0]
    assert isinstance(first, DTensor)
    mesh = first.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    rows = [chunk_rows(p.shape[0], world) for p in params]
    sizes = [r * p.shape[1:].numel() for r, p in zip(rows, params, strict=True)]
    buffer = torch.zeros(sum(sizes), dtype=first.dtype, device=device)
    padded = {
        id(p): piece.view(r, *p.shape[1:])
        for p, piece, r in zip(params, buffer.split(sizes), rows, strict=True)
    }

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        chunk = padded.get(id(tensor))
        if chunk is None:  # buffers
            return torch.empty_like(tensor, device=device)
        assert isinstance(tensor, DTensor)
        local = chunk.narrow(0, 0, row_chunk(tensor.shape[0], world, rank)[1])
        return DTensor.from_local(
            local,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )

    for key, fsdp_param in managed.items():
        fsdp_param._sharded_param_data = padded[key].view(-1)
    model._apply(empty)
    # Where FSDP2 re-padded a short shard into a new tensor after all (another torch), or gave
    # up its view, point its shard and padded rows at the buffer again.
    for key, fsdp_param in managed.items():
        chunk = padded[key]
        local = fsdp_param.sharded_param._local_tensor
        if local.data_ptr() != chunk.data_ptr():
            fsdp_param.sharded_param._local_tensor = chunk.narrow(0, 0, local.shape[0])
        fsdp_param._sharded_param_data = chunk.view(-1)
    return buffer


def flat_shards(model: torch.nn.Module) -> torch.UntypedStorage | None:
    """The one storage behind every local shard of `model` (to_empty_flat's), if they still
    share one; else None."""
    storages = [
        (p._local_tensor if isinstance(p, DTensor) else p).untyped_storage()  # type: ignore[attr-defined]
        for p in model.parameters()
    ]
    return storages[0] if len({s.data_ptr() for s in storages}) == 1 else None


def _with_fixed_buffers(model: torch.nn.Module) -> list[str]:
    """Names of modules that hold non-persistent buffers (rotary inv_freq): computed in their
    constructor, never stored in a checkpoint, so garbage after to_empty."""
    return [
        name
        for name, module in model.named_modules()
        if any(
            b in module._non_persistent_buffers_set for b, _ in module.named_buffers(recurse=False)
        )
    ]


def rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Rebuild every module with non-persistent buffers from the model's config, on `device`.

    Such modules (transformers' rotary embeddings) own no parameters and compute their buffers
    from the config in __init__; built on meta those buffers hold nothing, so the module is made
    again for real (a few bytes) and put in place. Anything else is an error naming it."""
    config = getattr(model, "config", None)
    for name in _with_fixed_buffers(model):
        module = model.get_submodule(name)
        accepts_config = "config" in inspect.signature(type(module).__init__).parameters
        if any(True for _ in module.parameters()) or config is None or not accepts_config:
            raise RuntimeError(
                f"{type(model).__name__}.{name} ({type(module).__name__}) has non-persistent "
                "buffers that the sharded loader cannot rebuild (it rebuilds parameter-free "
                "modules made from the model's config, such as rotary embeddings)"
            )
        with torch.device(device):
            fresh = type(module)(config=config)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)


def _checkpoint_name(name: str, available: dict[str, Path], prefix: str) -> str | None:
    """The checkpoint's key for module parameter `name`, as from_pretrained matches them: the
    same name, or with the base model's prefix ("model.") taken off or added."""
    candidates = [name]
    if prefix and name.startswith(prefix + "."):
        candidates.append(name[len(prefix) + 1 :])
    elif prefix:
        candidates.append(f"{prefix}.{name}")
    return next((c for c in candidates if c in available), None)


@contextlib.contextmanager
def _open_files() -> Iterator[Callable[[Path], object]]:
    """safe_open handles (memory maps) opened on first use, all closed on exit."""
    from safetensors import safe_open

    with contextlib.ExitStack() as stack:
        handles: dict[Path, object] = {}

        def handle(file: Path) -> object:
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            return handles[file]

        yield handle


def fill_shards(model: torch.nn.Module, path: Path | str) -> int:
    """Copy each parameter's local shard of this rank from the safetensors files of `path`.

    Only this rank's dim-0 rows are read (safe_open(...).get_slice), cast to the parameter's
    dtype on the way into it; tied parameters are one parameter (filled once). Returns the
    largest slice read, in bytes (the loading's transient). Raises naming every parameter the
    files lack or hold in another shape."""
    available = safetensors_files(path)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    params = list(model.named_parameters())  # tied parameters appear once
    missing = [n for n, _ in params if _checkpoint_name(n, available, prefix) is None]
    if missing:
        raise KeyError(
            f"{path}: the safetensors files have no tensor for parameters {missing} (of "
            f"{len(params)}); is model.path a checkpoint of this config.json's model?"
        )
    largest = 0
    mismatched: list[str] = []
    with torch.no_grad(), _open_files() as handle:
        for name, param in params:
            key = _checkpoint_name(name, available, prefix)
            assert key is not None
            source = handle(available[key]).get_slice(key)  # type: ignore[attr-defined]
            if tuple(source.get_shape()) != tuple(param.shape):
                mismatched.append(f"{key} {tuple(source.get_shape())} != {tuple(param.shape)}")
                continue
            local, start, rows = _local_rows(param)
            if local.numel() == 0:  # a rank past the last row (fewer rows than ranks)
                continue
            piece = source[start : start + rows]
            largest = max(largest, piece.numel() * piece.element_size())
            local.copy_(piece)
            del piece
    if mismatched:
        raise ValueError(f"{path}: tensors whose shape differs from the model's: {mismatched}")
    return largest


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(this rank's local tensor, its first row, its rows) of a parameter: FSDP2's Shard(0)
    chunk of a DTensor, or the whole of a plain tensor."""
    if isinstance(param, DTensor):
        if tuple(param.placements) != (Shard(0),):
            raise ValueError(f"sharded loading expects FSDP2's Shard(0), got {param.placements}")
        mesh = param.device_mesh
        start, rows = row_chunk(param.shape[0], mesh.size(), mesh.get_local_rank())
        local = param.to_local()
        if local.shape[0] != rows:
            raise RuntimeError(
                f"local shard has {local.shape[0]} rows, FSDP2's dim-0 chunking gives {rows} of "
                f"{param.shape[0]}"
            )
        return local, start, rows
    if param.dim() == 0:
        raise ValueError("sharded loading reads rows: a 0-dimensional parameter has none")
    return param.data, 0, param.shape[0]


def load_sharded(
    path: Path | str,
    dtype: torch.dtype,
    device: torch.device,
    shard: Callable[[torch.nn.Module], None],
    prepare: Callable[[torch.nn.Module], None] | None = None,
    *,
    flat: bool = False,
) -> tuple[torch.nn.Module, int]:
    """The model of `path` in `dtype`, sharded by `shard` (FSDP2's fully_shard) while on meta,
    then given this rank's storage on `device` and filled from the safetensors files.
    `prepare` runs on the meta model before sharding (gradient checkpointing); `flat`: every
    shard a view of one buffer (to_empty_flat). Returns the model and the largest slice read
    (bytes)."""
    model = build_on_meta(path, dtype)
    if prepare is not None:
        prepare(model)
    shard(model)
    if not flat or to_empty_flat(model, device) is None:
        if flat:
            log.warning(
                "the policy's shards could not be laid out in one buffer: the weight sync "
                "casts into a buffer of its own, which the memory plan (RLJOB_FLAT_SHARDS on) "
                "did not count"
            )
        model.to_empty(device=device)
    rebuild_buffers(model, device)
    largest = fill_shards(model, path)
    return model, largest
