"""bench/gpu_steps.sh's packing: the device tool brings back what is under $OUT when a call ends,
also when the call is cut by its time limit, so a step must have packed what it wrote by then.

A stand-in `python3` first on PATH writes a line and then never ends, as a GPU step that runs
past the call's limit; `timeout` plays the call's limit.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run_cut_step(tmp_path: Path, pack_seconds: str) -> tuple[int, Path]:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\necho written before the cut\nexec sleep 60\n")
    (fake / "python3").chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(out),
           "RLJOB_STEP_PACK_SECONDS": pack_seconds,
           "RLJOB_STEPS_DIR": str(tmp_path / "steps")}  # fmt: skip
    done = subprocess.run(["timeout", "4", "bash", "bench/gpu_steps.sh", "staging-probe"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    return done.returncode, out


def test_a_step_cut_by_the_calls_limit_has_packed_what_it_wrote(tmp_path: Path) -> None:
    returncode, out = _run_cut_step(tmp_path, "1")
    assert returncode == 124  # cut, as the device tool cuts a call
    with tarfile.open(out / "staging-probe.tgz") as archive:
        probe = archive.extractfile("staging-probe/probe.txt")
        assert probe is not None and probe.read() == b"written before the cut\n"
    assert [p.name for p in out.iterdir()] == ["staging-probe.tgz"]  # no half-written archive


def test_without_the_periodic_pack_a_cut_step_brings_back_nothing(tmp_path: Path) -> None:
    """The case the packing exists for (and the check that the test above can fail): packing
    less often than the call lasts leaves nothing under $OUT."""
    returncode, out = _run_cut_step(tmp_path, "600")
    assert returncode == 124 and list(out.iterdir()) == []
