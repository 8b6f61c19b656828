"""A checkpoint save that fails with a real OS error (2 ranks, FSDP2 on gloo, the builtin tiny
model): a tmpfs too small for two checkpoints, so iteration 1's fits and iteration 2's runs out
of space (ENOSPC) in the middle of the ranks' writes. The job ends Failed, in bounded time, with
the errno text in status and iteration 2's directory never marked complete.

The tmpfs is mounted here (mount(8); the test machines and CI run as root). Where mounting is
not allowed the test fails saying so: it is not a test of anything without the full disk.
"""

from __future__ import annotations

import json
import subprocess
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from rljob_worker.checkpoint import MARKER, checkpoint_dir, complete_checkpoints

pytestmark = pytest.mark.worker

REPO = Path(__file__).resolve().parents[2]
# One checkpoint of the tiny model is ~1.6 MB (two ranks' halves of the fp32 params and both
# AdamW moments, docs/checkpoints.md): 2.5 MiB holds one and not two (keep 2 keeps the first).
TMPFS_SIZE = "2560k"
# The run is ~30 s alone on 2 shared cores; a rank left waiting in a collective would hang far
# past this (gloo's default timeout is 30 minutes).
BOUND_SECONDS = 300.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mount)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(
            f"cannot mount a {TMPFS_SIZE} tmpfs at {mount} ({done.stderr.strip()}): this test "
            "needs root (CAP_SYS_ADMIN) to make a real full disk"
        )
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_fails_the_job_with_checkpoint_failed_and_the_errno_on_every_rank(
    tmp_path: Path, small_disk: Path
) -> None:
    from rljob_worker.cli_run import main

    doc = yaml.safe_load((REPO / "examples" / "checkpoint-resume.yaml").read_text())
    doc["spec"]["checkpoint"]["path"] = str(small_disk / "ckpt")
    doc["spec"]["export"]["path"] = str(tmp_path / "export")
    doc["spec"]["oomPolicy"] = {"maxRetries": 0}
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    out = tmp_path / "out"

    started = time.monotonic()
    assert main([str(manifest), "--out", str(out)]) != 0
    assert time.monotonic() - started < BOUND_SECONDS

    status = json.loads((out / "status.json").read_text())
    assert status["phase"] == "Failed"
    failure = status["checkpointFailure"]
    assert failure["iteration"] == 2, failure
    assert failure["path"] == str(checkpoint_dir(small_disk / "ckpt", 2))
    assert "[Errno 28] No space left on device" in failure["error"], failure
    assert status["cause"].startswith("CheckpointFailed: the checkpoint of iteration 2 in ")
    assert "[Errno 28]" in status["cause"]
    # Iteration 1's checkpoint fitted and stays the newest complete one; 2's is never marked
    # complete (its partial files are removed to give the space back).
    assert status["checkpoint"]["iteration"] == 1
    assert [i for i, _ in complete_checkpoints(small_disk / "ckpt")] == [1]
    assert not (checkpoint_dir(small_disk / "ckpt", 2) / MARKER).exists()
    # Both ranks stopped at a stage boundary (none waited in a collective). The writer of
    # iteration 2's checkpoint runs behind the stages that follow (mode Async, the default):
    # its failure is agreed at the first boundary after it, in iteration 2 or, when the write
    # fails late, in the next one, so the last iteration every rank finished is 1 or 2.
    assert status["iteration"] in (1, 2)


def test_an_os_error_under_torch_saves_end_of_file_error_is_the_one_reported(
    tmp_path: Path,
) -> None:
    """torch.save's zip writer ends its file in __exit__ even after a failed write, so a full
    disk can surface as RuntimeError('[enforce fail at inline_container.cc] unexpected pos ...')
    with the OSError as its __context__ (seen in a full-suite run of the full-disk test above):
    the checkpoint fails naming the OSError, not the RuntimeError."""
    import errno

    from rljob_worker.checkpoint import CheckpointFailed, _agreed

    def step() -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            # implicit context, as torch's __exit__ raises it: no "from"
            raise RuntimeError(  # noqa: B904
                "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
            )

    with pytest.raises(CheckpointFailed) as failed:
        _agreed(step, 2, tmp_path / "iteration-00000002")
    assert "[Errno 28] No space left on device" in failed.value.failure.error

    def unrelated() -> None:
        raise RuntimeError("not an OS error")

    with pytest.raises(RuntimeError, match="not an OS error"):
        _agreed(unrelated, 2, tmp_path / "iteration-00000002")


def test_a_failure_without_an_os_error_on_a_full_file_system_says_enospc(
    tmp_path: Path, small_disk: Path
) -> None:
    """The other form torch's zip writer gives a full disk: its own RuntimeError with no OSError
    behind it. With the checkpoint's file system (almost) full, the reported line says ENOSPC
    and keeps the writer's; with room left (a GPU machine's run failed so, 2026-12-05), it says
    a short write and what the file system has free; any other error is the writer's line."""
    from torch.distributed.checkpoint.api import CheckpointException

    from rljob_worker.checkpoint import CheckpointFailed, _agreed

    def step() -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    def dcp_step() -> None:  # as dcp.save raises it: every rank's (exception, stack)
        error = RuntimeError("unexpected pos 704 vs 598")
        raise CheckpointException("write", {0: (error, traceback.extract_stack())})

    directory = small_disk / "ckpt" / "iteration-00000002"
    with pytest.raises(RuntimeError, match="unexpected pos"):  # not dcp's, no OSError: a bug
        _agreed(step, 2, directory)
    with pytest.raises(CheckpointFailed) as failed:  # room left: a short write, and the room
        _agreed(dcp_step, 2, directory)
    error = failed.value.failure.error
    assert error.startswith("RuntimeError: unexpected pos 704 vs 598: a file came out shorter")
    assert f"{small_disk} has " in error and " free of 2.5 MiB at the failure" in error, error
    assert "Errno" not in error

    def other_dcp_step() -> None:  # another error of the writer's: its line alone
        raise CheckpointException("write", {0: (RuntimeError("bad"), traceback.extract_stack())})

    with pytest.raises(CheckpointFailed) as failed:
        _agreed(other_dcp_step, 2, directory)
    assert failed.value.failure.error == "RuntimeError: bad"
    (small_disk / "filler").write_bytes(b"\0" * (2560 * 1024 - 4096))  # fill the 2560k tmpfs
    with pytest.raises(OSError):
        (small_disk / "more").write_bytes(b"\0" * (1 << 20))
    with pytest.raises(CheckpointFailed) as failed:
        _agreed(dcp_step, 2, directory)
    assert failed.value.failure.error.startswith("[Errno 28] No space left on device: ")
