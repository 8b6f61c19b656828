"""Which checkpoint directories count (the marker rule), what keep deletes, which model a
checkpoint may load into, and the status the driver makes of the ranks' reports."""

from __future__ import annotations

from pathlib import Path

import pytest

from rljob.api import RLJobSpec
from rljob_worker.checkpoint import (
    MARKER,
    CheckpointMismatch,
    SavedCheckpoint,
    check_compatible,
    checkpoint_dir,
    complete_checkpoints,
    newest_complete,
    prune,
)
from rljob_worker.driver import checkpoint_status, export_status
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


def test_a_checkpoint_of_another_model_is_refused_with_what_to_do(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate({"model": {"path": "Qwen/Qwen2.5-1.5B"}})
    check_compatible({"modelPath": "Qwen/Qwen2.5-1.5B"}, spec, tmp_path)
    with pytest.raises(CheckpointMismatch, match=r"Qwen/Qwen2\.5-0\.5B.*resume=Never"):
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
