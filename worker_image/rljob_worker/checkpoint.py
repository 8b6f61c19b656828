"""Checkpoints (save, find the newest complete one, resume, keep N) and the Hugging Face export.

Layout, completeness rule and where the stage machine saves: docs/checkpoints.md. Every function
that takes a trainer is collective (all ranks call it together); the rest are plain file work.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from rljob.api import (
    REASON_CHECKPOINT_FAILED,
    CheckpointFailure,
    ResumeMode,
    ResumePoint,
    RLJobSpec,
)
from rljob_worker.model import torch_dtype

log = logging.getLogger(__name__)

# Written last, by rank 0, after every rank's files: a directory without it is not a checkpoint.
MARKER = "COMPLETE"
META = "meta.json"
STATE = "state"  # torch.distributed.checkpoint's directory (one .distcp file per rank)
PREFIX = "iteration-"


class CheckpointMismatch(ValueError):
    """A checkpoint that this spec must not load (another model)."""


class CheckpointFailed(RuntimeError):
    """A save that failed on some rank (a full disk, a read-only or forbidden directory). Every
    rank raises it together, so none waits in a collective for the one that failed; its
    directory has no marker, so no resume picks it."""

    def __init__(self, failure: CheckpointFailure) -> None:
        super().__init__(f"{REASON_CHECKPOINT_FAILED}: {failure.describe()}")
        self.failure = failure


@dataclass(frozen=True)
class SavedCheckpoint:
    """One rank's account of one save (the driver sums bytes and takes the slowest seconds)."""

    iteration: int
    path: str
    bytes: int  # this rank's files (rank 0 also counts the metadata and marker)
    seconds: float
    completed_at: str | None  # rank 0 only: when the marker was written


def checkpoint_dir(root: Path, iteration: int) -> Path:
    return root / f"{PREFIX}{iteration:08d}"


def _iteration_of(path: Path) -> int | None:
    suffix = path.name.removeprefix(PREFIX)
    return int(suffix) if path.name.startswith(PREFIX) and suffix.isdigit() else None


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(iteration, directory) of every complete checkpoint under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(_iteration_of(p), p) for p in root.iterdir() if (p / MARKER).is_file()]
    return sorted((i, p) for i, p in found if i is not None)


def newest_complete(root: Path) -> tuple[int, Path] | None:
    complete = complete_checkpoints(root)
    return complete[-1] if complete else None


def prune(root: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep`, and unfinished ones older
    than the newest complete (a crashed save: never picked, never finished). Run only after a
    save completed, so at least one complete checkpoint always remains. Returns the deleted."""
    complete = complete_checkpoints(root)
    if not complete:
        return []
    kept = {p for _, p in complete[-keep:]}
    newest = complete[-1][0]
    doomed = [p for _, p in complete if p not in kept]
    doomed += [
        p
        for p in root.iterdir()
        if (i := _iteration_of(p)) is not None and i < newest and not (p / MARKER).exists()
    ]
    for path in doomed:
        # The marker first: a deletion cut short leaves a directory that is no longer picked.
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return sorted(doomed)


def _write_atomically(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    with open(staging, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    staging.rename(path)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, its cause, or (torch.distributed.checkpoint gathers
    every rank's exception into one CheckpointException on all ranks) any rank's failure."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else getattr(failure, "exc", failure)
            if isinstance(inner, BaseException) and (found := _os_error(inner)) is not None:
                return found
    cause = exc.__cause__ or exc.__context__
    return _os_error(cause) if cause is not None else None


def _agreed(step: Callable[[], None], iteration: int, directory: Path) -> None:
    """Run this rank's part of a save step, then agree with every rank on how it went (a
    collective every rank reaches, whatever failed): an OSError on any rank raises
    CheckpointFailed on all, naming the lowest failing rank and its error."""
    rank, _ = _rank()
    error: str | None = None
    try:
        step()
    except (OSError, CheckpointException) as exc:
        found = _os_error(exc)
        if found is None and not isinstance(exc, CheckpointException):
            raise
        error = str(found) if found is not None else str(exc).strip().splitlines()[-1]
    errors: list[str | None] = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not failed:
        return
    first_rank, first_error = failed[0]
    log.error("checkpoint of iteration %d failed on rank(s) %s: %s", iteration,
              ", ".join(str(r) for r, _ in failed), first_error)  # fmt: skip
    if rank == 0:
        # What the failed save wrote is never a checkpoint (no marker): free its space.
        (directory / MARKER).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
    raise CheckpointFailed(
        CheckpointFailure(
            iteration=iteration, path=str(directory), rank=first_rank, error=first_error[:1024]
        )
    )


def _rank_bytes(directory: Path, rank: int) -> int:
    own = [*directory.glob(f"{STATE}/__{rank}_*"), directory / f"rng-rank{rank}.pt"]
    if rank == 0:
        own += [directory / STATE / ".metadata", directory / META, directory / MARKER]
    return sum(p.stat().st_size for p in own if p.is_file())


def save(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: RLJobSpec,
         iteration: int) -> SavedCheckpoint:  # fmt: skip
    """Write iteration `iteration`'s checkpoint under spec.checkpoint.path (collective).

    Each rank writes its own shard of model and optimizer (torch.distributed.checkpoint) and
    its RNG states; after a barrier rank 0 writes meta.json and then the marker, so a save that
    dies anywhere before leaves a directory resume ignores. Then older ones are pruned."""
    assert spec.checkpoint is not None
    started = time.perf_counter()
    rank, world = _rank()
    root = Path(spec.checkpoint.path)
    directory = checkpoint_dir(root, iteration)
    # Each step ends in an agreement (_agreed): an OSError on one rank (ENOSPC, EROFS, EACCES)
    # fails the save on every rank, instead of leaving the others in the next barrier.

    def prepare() -> None:
        if rank == 0:
            # What a save of this iteration that crashed left behind (it has no marker). The
            # marker goes first: a crash inside rmtree must not leave one beside partial shards.
            (directory / MARKER).unlink(missing_ok=True)
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)

    def write_shards() -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        # Collective itself: a rank's failure reaches all as one CheckpointException.
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory / STATE)
        torch.save(_rng_state(), directory / f"rng-rank{rank}.pt")

    completed: list[str] = []

    def complete() -> None:
        if rank != 0:
            return
        meta = {
            "iteration": iteration,
            "modelPath": spec.model.path,
            "worldSize": world,
            "spec": spec.model_dump(mode="json", by_alias=True),
        }
        _write_atomically(directory / META, json.dumps(meta, indent=1) + "\n")
        completed_at = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        _write_atomically(directory / MARKER, completed_at + "\n")
        completed.append(completed_at)

    _agreed(prepare, iteration, directory)
    _agreed(write_shards, iteration, directory)  # every rank's part is on disk
    # No rank runs on (and may fail) before the checkpoint is complete.
    _agreed(complete, iteration, directory)
    completed_at = completed[0] if completed else None
    if rank == 0:
        deleted = prune(root, spec.checkpoint.keep)
        if deleted:
            log.info("checkpoint: deleted %s", ", ".join(p.name for p in deleted))
    return SavedCheckpoint(
        iteration, str(directory), _rank_bytes(directory, rank),
        time.perf_counter() - started, completed_at,
    )  # fmt: skip


def check_compatible(meta: dict[str, Any], spec: RLJobSpec, directory: Path) -> None:
    if meta.get("modelPath") != spec.model.path:
        raise CheckpointMismatch(
            f"checkpoint {directory} was made for spec.model.path={meta.get('modelPath')!r}, "
            f"this job trains {spec.model.path!r}: point spec.checkpoint.path at a directory of "
            "its own"
        )


def resume_point(spec: RLJobSpec) -> tuple[int, Path] | None:
    """The checkpoint this run continues from, the same on every rank (rank 0 looks; a
    filesystem seen slightly differently by two ranks must not split them), or None."""
    checkpoint = spec.checkpoint
    if checkpoint is None:
        return None
    rank, _ = _rank()
    found: list[Any] = [newest_complete(Path(checkpoint.path)) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if checkpoint.resume is ResumeMode.NEVER and found[0] is not None:
        # Starting over beside an earlier run's checkpoints would mix the two: `keep` ranks
        # by iteration and would prune this run's saves in favour of the old run's newer ones,
        # and a later resume: Auto would continue the old run.
        raise CheckpointMismatch(
            f"spec.checkpoint.path {checkpoint.path} holds complete checkpoints of an earlier "
            f"run (the newest: {found[0][1]}), and spec.checkpoint.resume is Never: point the "
            "path at an empty directory, or delete those checkpoints, to start over"
        )
    return None if checkpoint.resume is ResumeMode.NEVER else found[0]


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: RLJobSpec,
         directory: Path) -> int:  # fmt: skip
    """Load a complete checkpoint into this rank's shards (collective); returns its iteration.

    torch.distributed.checkpoint reads whatever part of each tensor this rank's shard covers,
    so a checkpoint of another world size loads resharded. RNG states: this rank's, or rank
    0's where the checkpoint had fewer ranks (sampling seeds come from the iteration anyway)."""
    meta = json.loads((directory / META).read_text())
    check_compatible(meta, spec, directory)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    # dcp.load fills these dicts' tensors in place.
    dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory / STATE)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    rank, _ = _rank()
    own = directory / f"rng-rank{rank}.pt"
    rng = torch.load(own if own.exists() else directory / "rng-rank0.pt", weights_only=False)
    _set_rng_state(rng)
    return int(meta["iteration"])


def _tied_names(model: torch.nn.Module) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or ()
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    return set(tied.keys() if isinstance(tied, dict) else tied)


def export(model: torch.nn.Module, spec: RLJobSpec, model_path: Path | str, target: Path,
           dtype: torch.dtype) -> str | None:  # fmt: skip
    """The policy as a Hugging Face directory at `target` (collective; rank 0 writes).

    The full state dict is gathered once to rank 0's host memory, cast to `dtype`, written as
    model.safetensors beside the original config (its dtype set) and tokenizer; the directory
    is built aside and renamed into place, so a reader never sees half an export. Returns the
    path on rank 0, else None."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    rank, _ = _rank()
    if rank != 0:
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
        target.rename(old)
    staging.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return str(target)


class Keeper:
    """What one rank's loop asks of checkpoints: resume at the start, save when due (the
    checkpoint stage), export at the end; `take` hands over what the iteration wrote."""

    def __init__(self, spec: RLJobSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 model_path: Path | str) -> None:  # fmt: skip
        self.spec, self.model, self.optimizer, self.model_path = spec, model, optimizer, model_path
        self.saved: SavedCheckpoint | None = None
        self.exported: str | None = None
        self.resumed: ResumePoint | None = None  # the checkpoint resume() loaded

    def resume(self) -> int | None:
        """Load the newest complete checkpoint (spec.checkpoint.resume Auto); its iteration."""
        found = resume_point(self.spec)
        if found is None:
            return None
        iteration, directory = found
        if iteration > self.spec.algorithm.iterations:
            raise ValueError(
                f"the newest checkpoint under spec.checkpoint.path, {directory}, is past "
                f"spec.algorithm.iterations={self.spec.algorithm.iterations}: raise iterations "
                "to train on, or point spec.checkpoint.path at an empty directory to start over"
            )
        log.info("resuming from %s", directory)
        loaded = load(self.model, self.optimizer, self.spec, directory)
        self.resumed = ResumePoint(iteration=loaded, path=str(directory))
        return loaded

    def save(self, iteration: int) -> None:
        self.saved = save(self.model, self.optimizer, self.spec, iteration)
        if self.spec.export is not None and self.spec.export.with_checkpoints:
            self._export(Path(self.spec.export.path) / f"{PREFIX}{iteration:08d}")

    def take(self) -> tuple[SavedCheckpoint | None, str | None]:
        """This iteration's checkpoint part and export path (None: none), then forgets them."""
        taken = (self.saved, self.exported)
        self.saved = self.exported = None
        return taken

    def export_final(self) -> None:
        if self.spec.export is not None:
            self._export(Path(self.spec.export.path))

    def _export(self, target: Path) -> None:
        dtype = torch_dtype(self.spec.model.dtype)
        self.exported = export(self.model, self.spec, self.model_path, target, dtype)
