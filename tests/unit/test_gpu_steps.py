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


def test_a_background_step_outlives_its_call_and_wait_brings_back_what_it_has(
    tmp_path: Path,
) -> None:
    """bench/gpu_bg.sh: `start` returns at once with the step running in its own session (the
    device tool spares those when a call ends); `wait` brings back the log and the step's
    archive while it runs (said so) and after it ends (with its exit status)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    flag = tmp_path / "finish"
    (fake / "python3").write_text(
        f"#!/bin/sh\necho probe started\nwhile [ ! -f {flag} ]; do sleep 0.2; done\necho probe done\n"
    )
    (fake / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}",
           "RLJOB_STEP_PACK_SECONDS": "1", "RLJOB_STEPS_DIR": str(tmp_path / "steps"),
           "RLJOB_BG_DIR": str(tmp_path / "bg")}  # fmt: skip

    def bg(*words: str, out: Path | None = None) -> subprocess.CompletedProcess[str]:
        call_env = {**env, "OUT": str(out)} if out else env
        return subprocess.run(["timeout", "30", "bash", "bench/gpu_bg.sh", *words], cwd=REPO,
                              env=call_env, capture_output=True, text=True, timeout=60)  # fmt: skip

    started = bg("start", "probe", "staging-probe")
    assert started.returncode == 0 and "started probe" in started.stdout
    assert bg("start", "probe", "staging-probe").returncode == 1  # not twice at once

    def waited(seconds: str, said: str, written: bytes) -> Path:
        out = tmp_path / f"out-{seconds}"
        out.mkdir()
        assert said in bg("wait", "probe", seconds, out=out).stdout
        with tarfile.open(out / "probe-staging-probe.tgz") as archive:
            probe = archive.extractfile("staging-probe/probe.txt")
            assert probe is not None and probe.read() == written
        return out

    waited("3", "probe still running after 3 s", b"probe started\n")
    flag.touch()
    out = waited("20", "probe ended: exit 0", b"probe started\nprobe done\n")
    assert "== step staging-probe:" in (out / "probe.log").read_text()
