"""The trained policy as a Hugging Face directory (spec.export), and where an export may not
go: it replaces its directory whole, so a target at or above what the job reads or keeps
(checkpoints, the model, the data) would delete it at the job's end with no error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from rljob.api import RLJobSpec


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def export_target_problem(spec: RLJobSpec, model_path: Path | str) -> str | None:
    """Why spec.export.path may not be written (None: it may): it is, or is above, the
    checkpoint directory, the model's directory or a data file, compared as this pod's
    filesystem resolves them (relative paths, symbolic links). Admission compares the spellings
    only (rljob.api's EXPORT_SPARES_CHECKPOINTS_RULE); this runs at every rank's start, before
    any training, where the export would otherwise delete them at the end."""
    if spec.export is None:
        return None
    target = Path(spec.export.path).resolve()
    kept: dict[str, Path] = {}
    if spec.checkpoint is not None:
        kept["spec.checkpoint.path"] = Path(spec.checkpoint.path)
    if Path(model_path).exists():  # a directory here (a hub id is in the cache, not under it)
        kept["the model's directory"] = Path(model_path)
    if Path(spec.data.source).exists():
        kept["spec.data.source"] = Path(spec.data.source)
    if spec.data.validation is not None and Path(spec.data.validation.source).exists():
        kept["spec.data.validation.source"] = Path(spec.data.validation.source)
    for what, path in kept.items():
        resolved = path.resolve()
        if resolved == target or target in resolved.parents:
            return (
                f"spec.export.path {spec.export.path} is {what} ({path}) or a directory above "
                "it: an export replaces its directory whole and would delete it at the job's "
                "end; export to a directory of its own"
            )
    return None


def _tied_names(model: torch.nn.Module) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or ()
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def export(model: torch.nn.Module, spec: RLJobSpec, model_path: Path | str, target: Path,
           dtype: torch.dtype,
           carried: Callable[[Path], bool] | None = None) -> str | None:  # fmt: skip
    """The policy as a Hugging Face directory at `target` (collective; rank 0 writes).

    The full state dict is gathered once to rank 0's host memory, cast to `dtype`, written as
    model.safetensors beside the original config (its dtype set) and tokenizer; the directory
    is built aside and renamed into place, so a reader never sees half an export. The
    subdirectories of the old `target` that `carried` names (withCheckpoints' iteration-N
    exports, under the final one's path) move into the new one first: only the old model's own
    files go. Returns the path on rank 0, else None."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if _rank() != 0:
        return None
    tied = _tied_names(model)
    tensors = {
        n: t.to(dtype).contiguous()
        for n, t in full.items()
        if n not in tied and isinstance(t, torch.Tensor)  # a full state dict: plain tensors
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
    config = AutoConfig.from_pretrained(str(model_path))
    config.torch_dtype = dtype
    config.save_pretrained(staging)
    # A model without generation_config.json loads without one too.
    with contextlib.suppress(OSError):
        GenerationConfig.from_pretrained(str(model_path)).save_pretrained(staging)
    AutoTokenizer.from_pretrained(str(model_path)).save_pretrained(staging)
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        for child in sorted(target.iterdir()):
            if carried is not None and child.is_dir() and carried(child):
                child.rename(staging / child.name)  # one filesystem: a rename, no copy
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return str(target)
