"""Which checkpoint directories count (the marker rule), what keep deletes, which model a
checkpoint may load into, and the status the driver makes of the ranks' reports."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path

import pytest
from support.processes import as_another_user

from rljob.api import RLJobSpec, WakeUp
from rljob.report import Stage, StageSample
from rljob_worker.checkpoint import (
    MARKER,
    CheckpointMismatch,
    SavedCheckpoint,
    check_compatible,
    checkpoint_dir,
    complete_checkpoints,
    newest_complete,
    prune,
    resume_point,
)
from rljob_worker.driver import checkpoint_status, export_status
from rljob_worker.driver.failure import position_at_failure
from rljob_worker.loop import RankIteration
from rljob_worker.publish import driver_fields


def _make(root: Path, iteration: int, complete: bool) -> Path:
    directory = checkpoint_dir(root, iteration)
    (directory / "state").mkdir(parents=True)
    (directory / "state" / "__0_0.distcp").write_bytes(b"x" * 10)
    if complete:
        (directory / MARKER).write_text("2026-01-01T00:00:00Z\n")
    return directory


def test_only_directories_with_the_marker_are_checkpoints(tmp_path: Path) -> None:
    _make(tmp_path, 1, True)
    _make(tmp_path, 2, True)
    _make(tmp_path, 3, False)  # a save that died before its marker
    (tmp_path / "iteration-notanumber").mkdir()
    (tmp_path / "iteration-notanumber" / MARKER).write_text("")
    assert [i for i, _ in complete_checkpoints(tmp_path)] == [1, 2]
    assert newest_complete(tmp_path) == (2, checkpoint_dir(tmp_path, 2))
    assert newest_complete(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("layout", "keep", "left"),
    [
        # (iteration, complete) ...; keep; what remains
        ([(1, True), (2, True), (3, True)], 2, [2, 3]),
        ([(1, True), (2, True), (3, True)], 5, [1, 2, 3]),
        # An unfinished newer save never counts toward keep: the older complete ones stay.
        ([(1, True), (2, True), (3, False)], 1, [2, 3]),
        # An unfinished older one can never be picked: it goes.
        ([(1, False), (2, True)], 1, [2]),
        ([(1, False), (2, False)], 1, [1, 2]),  # nothing complete: nothing deleted
    ],
)
def test_keep_deletes_only_older_than_the_newest_complete(
    tmp_path: Path, layout: list[tuple[int, bool]], keep: int, left: list[int]
) -> None:
    for iteration, complete in layout:
        _make(tmp_path, iteration, complete)
    prune(tmp_path, keep)
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir()) == left


def test_a_checkpoint_that_cannot_be_deleted_is_kept_and_the_others_pruned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keep 1 after iteration 3's save: iteration 1's marker cannot be removed (EACCES: another
    owner's directory), so it is kept and logged, iteration 2 still goes, and prune returns
    only what it deleted. Before, the OSError failed the save that had just completed."""
    for iteration in (1, 2, 3):
        _make(tmp_path, iteration, complete=True)
    stuck = checkpoint_dir(tmp_path, 1) / MARKER
    unlink = Path.unlink

    def refuse(self: Path, missing_ok: bool = False) -> None:
        if self == stuck:
            raise PermissionError(13, "Permission denied", str(self))
        unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", refuse)
    deleted = prune(tmp_path, 1)
    assert deleted == [checkpoint_dir(tmp_path, 2)]
    assert sorted(int(p.name.split("-")[1]) for p in tmp_path.iterdir()) == [1, 3]


def test_a_checkpoint_of_another_model_is_refused_with_what_to_do(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate({"model": {"path": "Qwen/Qwen2.5-1.5B"}})
    check_compatible({"modelPath": "Qwen/Qwen2.5-1.5B"}, spec, tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"Qwen/Qwen2\.5-0\.5B.*a directory of its own"):
        check_compatible({"modelPath": "Qwen/Qwen2.5-0.5B"}, spec, tmp_path)


def _rank(rank: int, iteration: int, saved: bool, export: str | None = None) -> RankIteration:
    return RankIteration(
        rank=rank, iteration=iteration, stages=(), reward_sum=0.0, reward_count=1, kl_mean=None,
        loss=None, kv_capacity_tokens=0, export_path=export,
        checkpoint=SavedCheckpoint(
            iteration, f"/c/iteration-{iteration:08d}", 100 + rank, 1.0 + rank,
            "2026-01-01T00:00:00Z" if rank == 0 else None,
        ) if saved else None,
    )  # fmt: skip


def test_status_names_the_newest_checkpoint_every_rank_saved() -> None:
    iterations = [
        _rank(0, 1, True), _rank(1, 1, True),
        _rank(0, 2, True),  # rank 1 never reported iteration 2's part
        _rank(0, 3, False, export="/export"), _rank(1, 3, False),
    ]  # fmt: skip
    status = checkpoint_status(iterations, 2)
    assert status is not None
    assert (status.iteration, status.bytes, status.seconds) == (1, 201, 2.0)
    assert status.completed_at == "2026-01-01T00:00:00Z"
    export = export_status(iterations)
    assert export is not None and (export.path, export.iteration) == ("/export", 3)

    from rljob.api import RLJobStatus

    fields = driver_fields(RLJobStatus(checkpoint=status, export=export), [])
    assert fields["checkpoint"]["completedAt"] == "2026-01-01T00:00:00Z"
    assert fields["export"] == {"path": "/export", "iteration": 3}


def test_resume_never_beside_an_earlier_runs_checkpoints_is_refused(tmp_path: Path) -> None:
    """keep ranks checkpoints by iteration: a new run saving iteration 2 beside an old run's
    8..10 would have its own saves pruned, and a later resume: Auto would continue the old run."""
    spec = RLJobSpec.model_validate(
        {"checkpoint": {"path": str(tmp_path), "resume": "Never", "keep": 2}}
    )
    assert resume_point(spec) is None  # empty: start over
    _make(tmp_path, 3, False)  # an unfinished save is nobody's checkpoint
    assert resume_point(spec) is None
    _make(tmp_path, 10, True)
    with pytest.raises(CheckpointMismatch, match=r"earlier run.*iteration-0*10.*empty directory"):
        resume_point(spec)
    auto = spec.model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"resume": "Auto"})}  # type: ignore[union-attr]
    )
    assert resume_point(auto) == (10, checkpoint_dir(tmp_path, 10))
    # A retry of the job that wrote it (meta.json's job) continues from it, Never or not.
    meta = checkpoint_dir(tmp_path, 10) / "meta.json"
    meta.write_text('{"iteration": 10, "job": "uid-1"}')
    assert resume_point(spec, job="uid-1") == (10, checkpoint_dir(tmp_path, 10))
    with pytest.raises(CheckpointMismatch, match="earlier run"):
        resume_point(spec, job="uid-2")


def test_a_rank_that_died_after_its_checkpoint_stage_is_placed_in_the_next_stage() -> None:
    """The driver places a silent death in the stage after the last sample: after `checkpoint`
    that is offload_optimizer (the stage order of a checkpoint iteration has it after train)."""
    samples = [
        StageSample.model_validate(
            {"rank": 0, "iteration": 1, "stage": stage, "startSeconds": n, "seconds": 1.0,
             "kind": "host", "device": "cpu",
             "peakAllocatedBytes": 0, "peakReservedBytes": 0, "allocatedBytes": 0,
             "reservedBytes": 0, "deviceUsedBytes": 0, "devicePeakUsedBytes": 0,
             "deviceTotalBytes": 1}
        )
        for n, stage in enumerate((Stage.TRAIN, Stage.CHECKPOINT))
    ]  # fmt: skip
    assert position_at_failure(samples, WakeUp.STAGED, 3, raised=False) == (
        1, Stage.OFFLOAD_OPTIMIZER,
    )  # fmt: skip
    assert position_at_failure(samples, WakeUp.STAGED, 3, raised=True) == (1, Stage.CHECKPOINT)


def test_an_asynchronous_checkpoint_counts_for_its_own_iteration_and_its_blocked_seconds() -> None:
    def part(rank: int, blocked: float) -> SavedCheckpoint:
        return SavedCheckpoint(
            2, "/c/iteration-00000002", 100, 5.0 + rank,
            "2026-01-01T00:00:00Z" if rank == 0 else None, blocked_seconds=blocked,
        )  # fmt: skip

    # Agreed complete during iteration 3: reported by iteration 3's reports, not 2's. Rank 1's
    # part came alone (its iteration failed after the agreement).
    reported = dataclasses.replace(_rank(0, 3, False), checkpoint=part(0, 0.4))
    status = checkpoint_status([reported, _rank(1, 3, False)], 2, alone=[part(1, 0.7)])
    assert status is not None
    assert (status.iteration, status.bytes, status.seconds, status.blocked_seconds) == (
        2, 200, 6.0, 0.7,
    )  # fmt: skip
    assert checkpoint_status([reported, _rank(1, 3, False)], 2) is None  # rank 1's part missing


def test_a_resumed_optimizer_steps_at_the_specs_learning_rate(tmp_path: Path) -> None:
    # The optimizer state's param_groups carry the saved rate; a rate lowered before a resume
    # must be the one the next step uses (docs/checkpoints.md, resume semantics).
    import json

    import torch
    import torch.distributed.checkpoint as dcp
    from support.bigram import Bigram
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rljob_worker import checkpoint

    def spec(lr: float) -> RLJobSpec:
        return RLJobSpec.model_validate(
            {"algorithm": {"learningRate": lr}, "checkpoint": {"path": str(tmp_path)}}
        )

    model = Bigram()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.table.sum().backward()
    optimizer.step()
    directory = tmp_path / "iteration-00000001"
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state}, checkpoint_id=directory / checkpoint.STATE
    )
    torch.save(checkpoint._rng_state(), directory / "rng-rank0.pt")
    meta = {"iteration": 1, "modelPath": spec(0.1).model.path, "worldSize": 1}
    (directory / checkpoint.META).write_text(json.dumps(meta))

    resumed = Bigram()
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=0.01)
    assert checkpoint.load(resumed, optimizer, spec(0.01), directory) == 1
    assert [g["lr"] for g in optimizer.param_groups] == [0.01]
    assert optimizer.state  # the moments did come back
    assert torch.equal(resumed.table, model.table)


def test_a_rank_that_died_copying_its_state_to_the_host_is_placed_in_the_checkpoint() -> None:
    """Its last sample is train's (the checkpoint stage sends one only when it ends): with
    checkpoints every 2 iterations, iteration 2's stage after train is checkpoint, iteration
    3's is offload_optimizer. A host OOMKill while copying to pinned memory was named
    offload_optimizer."""

    def train(iteration: int) -> StageSample:
        return StageSample.model_validate(
            {"rank": 0, "iteration": iteration, "stage": Stage.TRAIN, "startSeconds": 0,
             "seconds": 1.0, "kind": "host", "device": "cpu", "peakAllocatedBytes": 0,
             "peakReservedBytes": 0, "allocatedBytes": 0, "reservedBytes": 0,
             "deviceUsedBytes": 0, "devicePeakUsedBytes": 0, "deviceTotalBytes": 1}
        )  # fmt: skip

    def died(iteration: int, every: int) -> tuple[int, Stage] | None:
        return position_at_failure(
            [train(iteration)], WakeUp.STAGED, 4, raised=False, checkpoint_every=every
        )

    assert died(2, every=2) == (2, Stage.CHECKPOINT)
    assert died(3, every=2) == (3, Stage.OFFLOAD_OPTIMIZER)
    assert died(2, every=0) == (2, Stage.OFFLOAD_OPTIMIZER)  # no checkpoints


@pytest.mark.parametrize("field", ["checkpoint", "export"])
def test_a_directory_the_worker_may_not_write_fails_at_the_start(field: str) -> None:
    """A claim formatted root-owned (mode 755) and a worker of another uid: said before the
    first iteration, not at the first save (or after the last iteration, for the export)."""
    volume = Path(tempfile.mkdtemp())  # mode 700 under pytest's tmp_path: not this case
    try:
        volume.chmod(0o755)
        target = volume / "run" if field == "checkpoint" else volume / "model"
        spec = RLJobSpec.model_validate({field: {"path": str(target)}})
        said = as_another_user(lambda: resume_point(spec))
        ours = resume_point(spec)  # root: writable, and nothing left behind but the folder
        left = sorted(p.name for p in volume.rglob("*"))
    finally:
        shutil.rmtree(volume)
    where = (
        f"spec.checkpoint.path {target}"
        if field == "checkpoint"
        else (f"spec.export.path's folder {volume}")
    )
    assert said.startswith(
        f"CheckpointMismatch: {where}: the worker cannot write there (Permission denied: "
    ), said
    assert "; it runs as uid " in said and "spec.resources.fsGroup" in said, said
    assert ours is None
    assert left == (["run"] if field == "checkpoint" else [])


class _OneCard:
    """Stand-in for torch.cuda on a process that sees one card (no GPU on this machine): the
    generator states it is asked to set, by device."""

    def __init__(self) -> None:
        self.set: list[tuple[int, str]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": "state-of-0")

        def set_rng_state(state: str, device: int | str = "cuda") -> None:
            index = 0 if device == "cuda" else int(device)
            if index >= 1:
                raise IndexError("tuple index out of range")  # what torch raises there
            self.set.append((index, state))

        def set_rng_state_all(states: list[str]) -> None:
            for index, state in enumerate(states):
                set_rng_state(state, index)

        monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_rng_state_all)


@pytest.mark.parametrize("written", ["now", "before"])
def test_a_checkpoint_resumes_where_the_process_sees_fewer_cards_than_the_saver(
    monkeypatch: pytest.MonkeyPatch, written: str
) -> None:
    """A rank's CUDA RNG state is its own device's: a checkpoint saved by a process that saw
    the host's 8 cards (the local driver) resumes in one that sees 1 (under Ray). Checkpoints
    written before kept every card's state: the rank's device's is restored, the rest left."""
    from rljob_worker import checkpoint

    card = _OneCard()
    card.install(monkeypatch)
    state = checkpoint._rng_state()
    assert state["cuda_device"] == "state-of-0" and "cuda" not in state
    if written == "before":
        del state["cuda_device"]
        state["cuda"] = [f"state-of-{i}" for i in range(8)]
    checkpoint._set_rng_state(state)
    assert card.set == [(0, "state-of-0")]
