"""Checkpoints (save, find the newest complete one, resume, keep N) and the Hugging Face export.

Layout, completeness rule and where the stage machine saves: docs/checkpoints.md. Every function
that takes a trainer is collective (all ranks call it together); the rest are plain file work.
The writer thread and the host copies it writes from: checkpoint_writer.py.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from rljob.api import (
    REASON_CHECKPOINT_FAILED,
    CheckpointFailure,
    CheckpointMode,
    ResumeMode,
    ResumePoint,
    RLJobSpec,
)
from rljob.metrics_file import write_atomically
from rljob.report import Stage
from rljob_worker.checkpoint_writer import (
    FileWriter,
    HostLookup,
    held_thread,
    host_state_dict,
)
from rljob_worker.export import export
from rljob_worker.model import torch_dtype

log = logging.getLogger(__name__)

# Written last, by rank 0, after every rank's files: a directory without it is not a checkpoint.
MARKER = "COMPLETE"
META = "meta.json"
# meta.json's key for the job that wrote the checkpoint (resume_point).
JOB_KEY = "job"
STATE = "state"  # torch.distributed.checkpoint's directory (one .distcp file per rank)
PREFIX = "iteration-"


class HostCopies(Protocol):
    """Where the training state has host buffers of its own (train.Trainer: the offloads')."""

    def copy_to_host(self) -> HostLookup: ...
    def hold_host_copies(self, wait: Callable[[], None]) -> None: ...


class CheckpointMismatch(ValueError):
    """spec.checkpoint (or spec.export) that this run must not use as it stands: a checkpoint
    of another model or run, a directory the worker cannot write."""


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
    seconds: float  # from the checkpoint stage's start until this rank's part was durable
    completed_at: str | None  # rank 0 only: when the marker was written
    # How long the loop stood still for it: the checkpoint stage, and any wait for its writer
    # (before its host copies were overwritten, or at the job's end). Sync: all of `seconds`.
    blocked_seconds: float | None = None


@dataclass(frozen=True)
class ModelExported:
    """Rank 0's export of the policy after `iteration`'s update (spec.export): sent on its own
    when that iteration then failed (its report, which carries the path, never went out)."""

    iteration: int
    path: str


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
    save completed, so at least one complete checkpoint always remains. Returns the deleted.
    One that cannot be deleted (its marker not removable: another owner, a read-only mount) is
    logged and kept: the save that just completed stands, and the next save tries again."""
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
    deleted = []
    for path in doomed:
        # The marker first: a deletion cut short leaves a directory that is no longer picked.
        try:
            (path / MARKER).unlink(missing_ok=True)
        except OSError as error:
            log.warning("checkpoint: %s not deleted (kept; the next save tries again): %s",
                        path, error)  # fmt: skip
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return sorted(deleted)


def _rng_state() -> dict[str, Any]:
    """The RNG states a rank restores on resume. CUDA's: the rank's own device only, not every
    device the process sees (all of the host's under the local driver, one under Ray): a
    checkpoint resumed where fewer devices are visible would otherwise set a generator that
    does not exist there (IndexError) and fail every retry."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if not torch.cuda.is_available():
        return
    if "cuda_device" in state:
        torch.cuda.set_rng_state(state["cuda_device"])
    elif "cuda" in state:
        # Written before the above: one state per device the saving process saw. This rank's
        # device, where it was seen; nothing samples from the CUDA generator (the engines seed
        # each request), so a state not found is not restored.
        device = torch.cuda.current_device()
        if device < len(state["cuda"]):
            torch.cuda.set_rng_state(state["cuda"][device])


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


# Below this many free bytes a failed write is reported as the full disk it is.
FULL_DISK_BYTES = 1 << 20
# torch.save's zip writer's words for a file that came out shorter than it wrote.
SHORT_WRITE = "unexpected pos"


def _size(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _nearest_existing(path: Path) -> Path | None:
    """`path`, else the nearest folder above it that exists: whose file system it will be on."""
    return next((p for p in (path, *path.parents) if p.exists()), None)


def _full_disk(directory: Path, exc: BaseException) -> str:
    """The line a failure without an OSError reports. torch.save's zip writer can meet a
    short write on a full disk as its own error ("[enforce fail at inline_container.cc]
    unexpected pos ..."), with no OSError behind it: where the checkpoint's file system has
    (almost) no space left, say so with ENOSPC's text, the writer's own line after it; a short
    write with room left (a quota, a thin volume that reports more than it can give, space
    freed since) says what it is and what the file system has."""
    line = str(exc).strip().splitlines()[-1]
    existing = _nearest_existing(directory)
    if existing is None:
        return line
    usage = shutil.disk_usage(existing)
    if usage.free < FULL_DISK_BYTES:
        enospc = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
        return f"{enospc}: {usage.free} bytes free in {existing} ({line})"
    if SHORT_WRITE in line:
        return (
            f"{line}: a file came out shorter than written, as a full disk or a quota makes "
            f"it; {existing} has {_size(usage.free)} free of {_size(usage.total)} at the "
            "failure (the unfinished checkpoint is deleted next)"
        )
    return line


def _agreed(step: Callable[[], None], iteration: int, directory: Path,
            group: dist.ProcessGroup | None = None) -> None:  # fmt: skip
    """Run this rank's part of a save step, then agree with every rank on how it went (a
    collective every rank reaches, whatever failed): an OSError on any rank raises
    CheckpointFailed on all, naming the lowest failing rank and its error. `group`: the
    writer thread's own (its collectives must not interleave with the loop's)."""
    rank, _ = _rank()
    error: str | None = None
    try:
        step()
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        # torch.save's zip writer ends its file in __exit__ even after a failed write, and
        # that raises a RuntimeError ("unexpected pos ...") over the OSError (ENOSPC, EIO):
        # the OSError is then its __context__, and it is what the user must read.
        found = _os_error(exc)
        if found is None and not isinstance(exc, CheckpointException):
            raise
        error = str(found) if found is not None else _full_disk(directory, exc)
    errors: list[str | None] = [error]
    if dist.is_initialized():
        errors = [None] * dist.get_world_size(group)
        dist.all_gather_object(errors, error, group=group)
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


def _prepare(directory: Path) -> None:
    """Rank 0: remove what a save of this iteration that crashed left behind (it has no
    marker), then create the directory. The marker goes first: a crash inside rmtree must not
    leave one beside partial shards."""
    if _rank()[0] == 0:
        (directory / MARKER).unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)


def _write_durably(path: Path, value: Any) -> None:
    with open(path, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


@dataclass(frozen=True)
class _Written:
    finished: float  # perf_counter() when this rank's part (rank 0: and the marker) was durable
    completed_at: str | None


def _write(state: dict[str, Any], rng: dict[str, Any], spec: RLJobSpec, iteration: int,
           directory: Path, group: dist.ProcessGroup | None,
           job: str | None = None) -> _Written:  # fmt: skip
    """Every rank's shard and RNG file, then (rank 0, once every rank's part is durable) meta.json
    and last the marker, then the pruning of older checkpoints (collective over `group`)."""
    assert spec.checkpoint is not None
    rank, world = _rank()

    def write_shards() -> None:
        # Collective itself: a rank's failure reaches all as one CheckpointException. Its
        # writer fsyncs every file before the ranks' results are gathered.
        dcp.save(state, storage_writer=FileWriter(directory / STATE), process_group=group)
        _write_durably(directory / f"rng-rank{rank}.pt", rng)

    completed: list[str] = []

    def complete() -> None:
        if rank != 0:
            return
        meta = {
            "iteration": iteration,
            "modelPath": spec.model.path,
            "worldSize": world,
            JOB_KEY: job,
            "spec": spec.model_dump(mode="json", by_alias=True),
        }
        write_atomically(directory / META, json.dumps(meta, indent=1) + "\n")
        completed_at = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        write_atomically(directory / MARKER, completed_at + "\n")
        completed.append(completed_at)

    _agreed(write_shards, iteration, directory, group)  # every rank's part is on disk
    # No rank goes on (and may fail) before the checkpoint is complete.
    _agreed(complete, iteration, directory, group)
    if rank == 0:
        deleted = prune(Path(spec.checkpoint.path), spec.checkpoint.keep)
        if deleted:
            log.info("checkpoint: deleted %s", ", ".join(p.name for p in deleted))
    return _Written(time.perf_counter(), completed[0] if completed else None)


@dataclass
class _InFlight:
    """A save whose writer was started and whose outcome the ranks have not yet agreed on."""

    iteration: int
    directory: Path
    started: float
    blocked_seconds: float
    future: Future[_Written]
    # Releases a writer held back for the weight sync (WRITER_START_ENV; idempotent).
    release: Callable[[], None]


def check_compatible(meta: dict[str, Any], spec: RLJobSpec, directory: Path) -> None:
    if meta.get("modelPath") != spec.model.path:
        raise CheckpointMismatch(
            f"checkpoint {directory} was made for spec.model.path={meta.get('modelPath')!r}, "
            f"this job trains {spec.model.path!r}: point spec.checkpoint.path at a directory of "
            "its own"
        )


def _written_by(directory: Path) -> str | None:
    """The job (JOB_KEY) that wrote the complete checkpoint `directory`, where it says."""
    with contextlib.suppress(OSError, ValueError):
        job = json.loads((directory / META).read_text()).get(JOB_KEY)
        return None if job is None else str(job)
    return None


def unwritable(field: str, root: Path) -> str | None:
    """Why this process cannot write under `root` (spec.`field`'s directory), or None: found at
    the start (a file made and removed), not at the first save an iteration later or at the
    export after the last. A claim formatted root-owned (EBS, PD) without
    spec.resources.fsGroup is the usual cause."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".rljob-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        return (
            f"spec.{field} {root}: the worker cannot write there ({error.strerror}: "
            f"{error.filename}; it runs as uid {os.getuid()}, gid {os.getgid()}): give the "
            "volume to its group (spec.resources.fsGroup, 1000 unless set: the kubelet makes a "
            "claim's files that group's) or make the directory writable by that user"
        )
    return None


def checkpoint_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """About what one checkpoint holds (every rank's files together): each parameter at its
    training dtype (an FSDP2 DTensor counts whole; a tied one, as the model's state dict has it
    under both names, twice: Qwen2.5-1.5B's embeddings, 0.93 GB of its 19.46 GB), and as much
    again for each of Adam's two moments (one per parameter); RNG states and metadata are
    kilobytes."""
    named = sum(
        p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False)
    )
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = 2 if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) else 0
    return named + moments * params


def space_problem(root: Path, keep: int, each: int) -> str | None:
    """Why spec.checkpoint.path's file system will fill before the run's saves are done, or
    None: `keep` checkpoints stay and the next is written before the oldest is pruned, so
    keep + 1 of `each` bytes, less what the complete checkpoints already there hold."""
    held = len(complete_checkpoints(root))
    needed = max(keep + 1 - held, 1) * each
    existing = _nearest_existing(root)
    if existing is None:
        return None
    free = shutil.disk_usage(existing).free
    if free >= needed:
        return None
    return (
        f"spec.checkpoint.path {root}: {_size(free)} free, and keep {keep} needs about "
        f"{_size(needed)} more ({keep + 1} checkpoints of about {_size(each)} at once, the "
        f"newest written before the oldest is deleted; {held} already there): a save will "
        "fail with a full disk. Give the volume more space, or lower spec.checkpoint.keep"
    )


def _start_problems(spec: RLJobSpec) -> list[str]:
    """Rank 0's write checks of the checkpoint and export directories (the export is built
    beside its path, in the folder above it)."""
    problems = []
    if spec.checkpoint is not None:
        problems.append(unwritable("checkpoint.path", Path(spec.checkpoint.path)))
    if spec.export is not None:
        problems.append(unwritable("export.path's folder", Path(spec.export.path).parent))
    return [p for p in problems if p is not None]


def resume_point(spec: RLJobSpec, job: str | None = None) -> tuple[int, Path] | None:
    """The checkpoint this run continues from, the same on every rank (rank 0 looks; a
    filesystem seen slightly differently by two ranks must not split them), or None.

    resume Never starts at iteration 0 beside no earlier job's checkpoints; a checkpoint this
    job (`job`: the RLJob's uid, one `rljob run`) wrote is its own progress, and a retry of the
    job (the OOM policy's next attempt, KubeRay's run after a lost pod) continues from it as
    with Auto: "never resume" means never from another run. Rank 0 first makes sure the
    checkpoint and export directories can be written (unwritable): CheckpointMismatch on
    every rank when one cannot."""
    checkpoint = spec.checkpoint
    if checkpoint is None and spec.export is None:
        return None
    rank, _ = _rank()
    found: list[Any] = [None, None, []]
    if rank == 0:
        found[2] = _start_problems(spec)
        if checkpoint is not None and not found[2]:
            found[0] = newest_complete(Path(checkpoint.path))
            found[1] = None if found[0] is None else _written_by(found[0][1])
    if dist.is_initialized():
        dist.broadcast_object_list(found, src=0)
    if found[2]:
        raise CheckpointMismatch("; ".join(found[2]))
    if checkpoint is None:
        return None
    point: tuple[int, Path] | None = found[0]
    if checkpoint.resume is ResumeMode.NEVER and point is not None:
        if job is not None and found[1] == job:
            return point
        # Starting over beside an earlier run's checkpoints would mix the two: `keep` ranks
        # by iteration and would prune this run's saves in favour of the old run's newer ones,
        # and a later resume: Auto would continue the old run.
        raise CheckpointMismatch(
            f"spec.checkpoint.path {checkpoint.path} holds complete checkpoints of an earlier "
            f"run (the newest: {point[1]}), and spec.checkpoint.resume is Never: point the "
            "path at an empty directory, or delete those checkpoints, to start over"
        )
    return None if checkpoint.resume is ResumeMode.NEVER else point


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
    # The optimizer's state brings back the saved param_groups, the learning rate and weight
    # decay with them: the spec's stand, so a rate lowered before a resume takes effect, as
    # the spec says it does (each train stage then sets its iteration's rate from the
    # schedule, a function of the iteration: nothing of it is in the checkpoint).
    for group in optimizer.param_groups:
        group["lr"] = spec.algorithm.learning_rate
        group["weight_decay"] = spec.algorithm.weight_decay
    rank, _ = _rank()
    own = directory / f"rng-rank{rank}.pt"
    rng = torch.load(own if own.exists() else directory / "rng-rank0.pt", weights_only=False)
    _set_rng_state(rng)
    return int(meta["iteration"])


# The key of a rank's RNG file that holds its rollout's state (the partial rollout's carried
# conversations; loop._MultiTurnRollout.rollout_state).
ROLLOUT_KEY = "rollout"


def rollout_state(directory: Path) -> Any:
    """This rank's rollout state in the checkpoint `directory` (None: none kept). Kept per rank:
    a checkpoint of another world size gives none back, with a warning (the conversations its
    ranks carried are not trained)."""
    meta = json.loads((directory / META).read_text())
    rank, world = _rank()
    own = directory / f"rng-rank{rank}.pt"
    if not own.exists():
        return None
    state = torch.load(own, weights_only=False).get(ROLLOUT_KEY)
    if state is not None and int(meta.get("worldSize", world)) != world:
        log.warning("%s was saved by %s ranks, this run has %d: the conversations its partial "
                    "rollout carried are not resumed", directory, meta.get("worldSize"), world)  # fmt: skip
        return None
    return state


# When an asynchronous save's writer starts writing (RLJOB_CHECKPOINT_WRITER_START, the rank's
# environment): "after_sync" (the default) at the boundary after wake_weights, so that the
# weight sync does not run beside the writer; "stage" in the checkpoint stage, right after the
# copy to host memory. At 7B on two H200s the sync took 3.37 s beside both ranks' writers
# started in the stage, and 0.128 s with them held to after the sync, the checkpoint iteration
# costing 2% instead of 7% (docs/checkpoint-figures.md). The host copies the writer reads do
# not change before the next iteration's offload, which waits for the writer either way.
WRITER_START_ENV = "RLJOB_CHECKPOINT_WRITER_START"
WRITER_STARTS = ("after_sync", "stage")
# The stage after which an "after_sync" writer is released.
WRITER_STARTS_AFTER = Stage.WAKE_WEIGHTS
# A held-back writer writes anyway after this long: where a rank's loop stops before the
# boundary (an OOM on another rank, whose drain() needs this rank's writer for the writers'
# collectives), the checkpoint still completes, well inside the grace a driver gives a blocked
# rank before ending it (driver/local.py: 10 s). The checkpoint stage's boundary to the end of
# the sync took under 1 s at 7B on two H200s without a writer beside it.
WRITER_HOLD_SECONDS = 3.0


def writer_start() -> str:
    """RLJOB_CHECKPOINT_WRITER_START, checked (unset: "after_sync")."""
    choice = os.environ.get(WRITER_START_ENV, "").strip().lower() or WRITER_STARTS[0]
    if choice not in WRITER_STARTS:
        raise ValueError(f"{WRITER_START_ENV}={choice!r} must be one of {WRITER_STARTS}")
    return choice


class Keeper:
    """What one rank's loop asks of checkpoints: resume at the start, save when due (the
    checkpoint stage), `poll` at every stage boundary while a writer runs, `finish` at the end,
    export; `take` hands over what the iteration completed.

    A save (spec.checkpoint.mode Async) blocks only for the copy of the training state into
    host memory (`host`'s buffers, which the offloads reuse) and hands the files to a writer
    thread; the checkpoint is complete once every rank's writer is done, as all ranks agree
    at a stage boundary. Sync waits for the writer inside the stage. docs/checkpoints.md."""

    def __init__(self, spec: RLJobSpec, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 model_path: Path | str, host: HostCopies | None = None,
                 job: str | None = None,
                 rollout: Callable[[], Any] | None = None) -> None:  # fmt: skip
        self.spec, self.model, self.optimizer, self.model_path = spec, model, optimizer, model_path
        self.job = job  # recorded in each checkpoint (resume_point)
        # The rollout's state each save keeps beside the RNG states (ROLLOUT_KEY), and the one
        # resume() found.
        self.rollout = rollout
        self.resumed_rollout: Any = None
        self.host = host
        # Completed (agreed) since the last take, oldest first: two can complete between
        # takes (a save settles the previous writer, then its own completes at a later boundary
        # or at finish), and each is reported.
        self.saved: list[SavedCheckpoint] = []
        self.exported: ModelExported | None = None  # this iteration's (rank 0)
        self.resumed: ResumePoint | None = None  # the checkpoint resume() loaded
        self._in_flight: _InFlight | None = None
        self._cpu_meshes: dict[int, Any] = {}
        self.writer_start = writer_start()
        # The writer's collectives run beside the loop's: on a group of their own (every rank
        # creates it here, in the same order), or the two would interleave.
        self._group: dist.ProcessGroup | None = None
        if spec.checkpoint is not None and dist.is_initialized():
            group = dist.new_group(backend="gloo")
            assert isinstance(group, dist.ProcessGroup)  # every rank is a member
            self._group = group

    def resume(self) -> int | None:
        """Load the newest complete checkpoint (spec.checkpoint.resume Auto); its iteration.
        Rank 0 first warns when the checkpoints will not fit where they go (space_problem)."""
        found = resume_point(self.spec, self.job)
        self.check_space()
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
        self.resumed_rollout = rollout_state(directory) if self.rollout is not None else None
        return loaded

    def check_space(self) -> str | None:
        """Rank 0: the warning space_problem gives for spec.checkpoint.path, logged at the start
        rather than found at the save that fails an hour in. A warning, not an error: the
        size is an estimate, and a volume can grow while the job runs."""
        checkpoint = self.spec.checkpoint
        if checkpoint is None or _rank()[0] != 0:
            return None
        problem = space_problem(
            Path(checkpoint.path), checkpoint.keep, checkpoint_bytes(self.model, self.optimizer)
        )
        if problem is not None:
            log.warning("%s", problem)
        return problem

    def save(self, iteration: int) -> None:
        """The checkpoint stage (collective): the state to host memory, the writer started."""
        assert self.spec.checkpoint is not None
        # The next checkpoint waits for the previous writer (normally done long before).
        self._settle()
        started = time.perf_counter()
        directory = checkpoint_dir(Path(self.spec.checkpoint.path), iteration)
        _agreed(lambda: _prepare(directory), iteration, directory)
        rng = _rng_state()
        if self.rollout is not None:
            rng[ROLLOUT_KEY] = self.rollout()
        lookup = self.host.copy_to_host() if self.host is not None else None
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        host = host_state_dict(
            {"model": model_state, "optim": optimizer_state}, lookup, self._cpu_meshes
        )
        log.debug("checkpoint %d: %d bytes viewed in host copies, %d copied", iteration,
                  host.viewed_bytes, host.copied_bytes)  # fmt: skip
        spec, group = self.spec, self._group

        def work() -> _Written:
            return _write(host.state, rng, spec, iteration, directory, group, self.job)

        name = f"checkpoint-writer-{iteration}"
        held = (
            self.writer_start == "after_sync"
            and self.spec.checkpoint.mode is not CheckpointMode.SYNC
        )
        future, release = held_thread(work, name, WRITER_HOLD_SECONDS)
        if not held:
            release()
        self._in_flight = _InFlight(iteration, directory, started, 0.0, future, release)
        if self.host is not None:
            self.host.hold_host_copies(self._wait_for_writer)
        if self.spec.export is not None and self.spec.export.with_checkpoints:
            self._export(Path(self.spec.export.path) / f"{PREFIX}{iteration:08d}", iteration)
        self._in_flight.blocked_seconds += time.perf_counter() - started
        if self.spec.checkpoint.mode is CheckpointMode.SYNC:
            self._settle()

    def poll(self, stage: Stage | None = None) -> None:
        """At a stage boundary (collective while a writer runs), after `stage`: all ranks agree
        on how far the writers are. Every one done: the checkpoint is complete (take() reports
        it); any one failed: CheckpointFailed on every rank, here, together. A writer held back
        for the weight sync ("after_sync") is released here once `stage` is
        WRITER_STARTS_AFTER."""
        if self._in_flight is not None:
            if stage == WRITER_STARTS_AFTER:
                self._in_flight.release()
            self._agree(self._in_flight)

    def finish(self) -> None:
        """The job's end (collective): wait for the last writer; its failure raised here."""
        self._settle()

    def drain(self, timeout_seconds: float = 300.0) -> None:
        """An attempt that ends by an OOM: let this rank's writer finish (no collective, no
        raise; the other ranks' writers need only theirs), so a retry resumes from the newest
        checkpoint. Bounded: a writer whose peer process is gone gives up, not the job."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.release()  # one held back for a weight sync that the OOM cut short
            done, _ = futures.wait([in_flight.future], timeout=timeout_seconds)
            if not done:
                log.warning("checkpoint writer of iteration %d still running after %.0f s: "
                            "left behind", in_flight.iteration, timeout_seconds)  # fmt: skip

    def _wait_for_writer(self) -> None:
        """Block until this rank's writer is done (its outcome stays for the agreement)."""
        in_flight = self._in_flight
        if in_flight is None or in_flight.future.done():
            return
        in_flight.release()  # a writer still held back writes now: something waits for it
        waiting = time.perf_counter()
        futures.wait([in_flight.future])
        in_flight.blocked_seconds += time.perf_counter() - waiting

    def _settle(self) -> None:
        if self._in_flight is not None:
            self._wait_for_writer()
            self._agree(self._in_flight)

    def _agree(self, in_flight: _InFlight) -> None:
        rank, _ = _rank()
        future = in_flight.future
        mine: tuple[str, Any] = ("running", None)
        if future.done():
            exc = future.exception()
            mine = ("done", None)
            if isinstance(exc, CheckpointFailed):
                mine = ("failed", exc.failure)
            elif exc is not None:
                mine = ("error", f"{type(exc).__name__}: {exc}")
        states: list[Any] = [mine]
        if dist.is_initialized():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, mine)
        failures = [(r, state, what) for r, (state, what) in enumerate(states)
                    if state in ("failed", "error")]  # fmt: skip
        if not failures and any(state == "running" for state, _ in states):
            return  # asked again at the next boundary
        self._in_flight = None
        if not failures:
            written = future.result()
            self.saved.append(
                SavedCheckpoint(
                    in_flight.iteration,
                    str(in_flight.directory),
                    _rank_bytes(in_flight.directory, rank),
                    written.finished - in_flight.started,
                    written.completed_at,
                    blocked_seconds=in_flight.blocked_seconds,
                )
            )
            return
        exc = future.exception() if future.done() else None
        if exc is not None and not isinstance(exc, CheckpointFailed):
            raise exc  # this rank's own error (a bug, not the disk): its traceback
        first_rank, state, what = failures[0]
        if state == "failed":
            raise CheckpointFailed(what)
        raise RuntimeError(
            f"the checkpoint writer of iteration {in_flight.iteration} failed on rank "
            f"{first_rank}: {what}"
        )

    def take(self) -> tuple[tuple[SavedCheckpoint, ...], ModelExported | None]:
        """The checkpoints completed (agreed) since the last take, oldest first, and this
        iteration's export (None: none here), then forgets them."""
        taken = (tuple(self.saved), self.exported)
        self.saved, self.exported = [], None
        return taken

    def export_final(self) -> None:
        if self.spec.export is not None:
            # withCheckpoints' exports live under this path: the final one keeps them.
            self._export(
                Path(self.spec.export.path),
                self.spec.algorithm.iterations,
                lambda p: _iteration_of(p) is not None,
            )

    def _export(
        self, target: Path, iteration: int, carried: Callable[[Path], bool] | None = None
    ) -> None:
        dtype = torch_dtype(self.spec.model.dtype)
        path = export(self.model, self.spec, self.model_path, target, dtype, carried)
        self.exported = ModelExported(iteration, path) if path is not None else None
