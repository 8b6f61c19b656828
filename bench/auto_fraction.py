"""Print what rollout Auto chooses for a manifest on this machine's first GPU (or on
--capacity-bytes): `wakeUp fraction`. The bench runs that point (bench/colocate.py takes
fractions, not Auto), so the figures are of the choice a job would get on the same card; the
card's memory wins over the manifest's spec.memoryPlan.gpuMemory, as on a rank."""

from __future__ import annotations

import argparse
from pathlib import Path

from rljob.api import load_manifest
from rljob.plan import auto_choice, shape_for
from rljob.plan_cli import local_gpu_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--capacity-bytes", type=int, default=None)
    args = parser.parse_args()
    _, spec = load_manifest(args.manifest)
    capacity = args.capacity_bytes or local_gpu_bytes()
    if capacity is None:
        parser.error("no local GPU: pass --capacity-bytes")
    shape = shape_for(spec)
    if shape is None:
        parser.error("the manifest needs spec.model.shape")
    choice = auto_choice(spec, shape, capacity)
    print(choice.chosen.wake_up, f"{choice.chosen.mem_fraction_static:.2f}")


if __name__ == "__main__":
    main()
