"""Checkpoint cost on the CPU: seconds and bytes per rank of each synchronous save, tiny model.

`python bench/checkpoint_cpu.py [--ranks 2] [--iterations 3]` runs examples/checkpoint-resume.yaml
(paths moved to a temporary directory) with the local driver and prints, per rank and
iteration, the checkpoint stage's seconds and the bytes that rank wrote, with the machine.
"""

from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import torch
import yaml

from rljob.api import parse_manifest
from rljob.report import Stage
from rljob_worker.driver.local import run_local

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    args = parser.parse_args()
    doc = yaml.safe_load((REPO / "examples" / "checkpoint-resume.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        doc["spec"]["checkpoint"]["path"] = f"{tmp}/ckpt"
        doc["spec"]["export"]["path"] = f"{tmp}/export"
        doc["spec"]["algorithm"]["iterations"] = args.iterations
        spec = parse_manifest(doc)[1]
        run = run_local(spec, args.ranks, "cpu")
        assert run.ok, run.errors
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads/process, torch {torch.__version__}, {args.ranks} ranks on gloo")  # fmt: skip
    stage = {(s.rank, s.iteration): s.seconds for s in run.samples if s.stage is Stage.CHECKPOINT}
    print("iteration rank stage_seconds save_seconds bytes")
    for item in sorted(run.iterations, key=lambda i: (i.iteration, i.rank)):
        if item.checkpoint is not None:
            saved = item.checkpoint
            print(
                f"{item.iteration:9d} {item.rank:4d} {stage[(item.rank, item.iteration)]:13.3f} "
                f"{saved.seconds:12.3f} {saved.bytes:d}"
            )


if __name__ == "__main__":
    main()
