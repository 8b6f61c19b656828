"""Print what rollout Auto chooses for a manifest on this machine's first GPU (or on
--capacity-bytes): `wakeUp fraction`. The bench runs that point (bench/colocate.py takes
fractions, not Auto), so the figures are of the choice a job would get on the same card."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from rljob.api import parse_manifest
from rljob.plan import auto_choice, shape_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--capacity-bytes", type=int, default=None)
    args = parser.parse_args()
    doc = yaml.safe_load(args.manifest.read_text())
    doc["spec"].pop("memoryPlan", None)  # plan on the card, not on the manifest's figure
    spec = parse_manifest(doc)[1]
    capacity = args.capacity_bytes
    if capacity is None:
        import torch

        capacity = int(torch.cuda.mem_get_info(0)[1])
    shape = shape_for(spec)
    assert shape is not None, "the manifest needs spec.model.shape"
    choice = auto_choice(spec, shape, capacity)
    print(choice.chosen.wake_up, f"{choice.chosen.mem_fraction_static:.2f}")


if __name__ == "__main__":
    main()
