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
    # Both ranks ended in the checkpoint stage of iteration 2 (none waited in a collective):
    # iteration 1 is the last one every rank finished.
    assert status["iteration"] == 1
