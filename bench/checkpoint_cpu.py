"""Checkpoint cost on the CPU: seconds and bytes per rank of each synchronous save, tiny model.

`python bench/checkpoint_cpu.py [--ranks 2] [--iterations 3]` runs examples/checkpoint-resume.yaml
(paths moved to a temporary directory) with the local driver and prints, per rank and
iteration, the checkpoint stage's seconds and the bytes that rank wrote, with the machine.
`--async-compare` instead times, in this one process (world 1, gloo), dcp.save against
dcp.async_save (until it returns, and until its future resolves) on the same sharded model.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from concurrent.futures import Future
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
    parser.add_argument("--async-compare", action="store_true")
    args = parser.parse_args()
    if args.async_compare:
        compare_async()
        return
    doc = yaml.safe_load((REPO / "examples" / "checkpoint-resume.yaml").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        doc["spec"]["checkpoint"]["path"] = f"{tmp}/ckpt"
        doc["spec"]["export"]["path"] = f"{tmp}/export"
        doc["spec"]["algorithm"]["iterations"] = args.iterations
        spec = parse_manifest(doc)[1]
        run = run_local(spec, args.ranks, "cpu")
        assert run.ok, run.errors
    print(f"machine: {_machine()}, torch {torch.__version__}, {args.ranks} ranks on gloo, "
          "1 thread per rank")  # fmt: skip
    stage = {(s.rank, s.iteration): s.seconds for s in run.samples if s.stage is Stage.CHECKPOINT}
    print("iteration rank stage_seconds save_seconds bytes")
    for item in sorted(run.iterations, key=lambda i: (i.iteration, i.rank)):
        if item.checkpoint is not None:
            saved = item.checkpoint
            print(
                f"{item.iteration:9d} {item.rank:4d} {stage[(item.rank, item.iteration)]:13.3f} "
                f"{saved.seconds:12.3f} {saved.bytes:d}"
            )


def _machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in line
        ),
        platform.machine(),
    )
    return f"{model}, {len(os.sched_getaffinity(0))} cores"


def compare_async(repeats: int = 5) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rljob_worker.model import load_causal_lm, resolve_model_path

    path = resolve_model_path("builtin:tiny-qwen2")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        model = load_causal_lm(path, torch.float32)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        state = dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True))
        print(f"machine: {_machine()}, torch {torch.__version__}, 1 rank, "
              f"{torch.get_num_threads()} threads")  # fmt: skip
        for kind in ("sync", "async"):
            returned, done = [], []
            for index in range(repeats):
                started = time.perf_counter()
                target = f"{tmp}/{kind}-{index}"
                if kind == "sync":
                    dcp.save(state, checkpoint_id=target)
                    returned.append(time.perf_counter() - started)
                else:
                    future = dcp.async_save(state, checkpoint_id=target)
                    returned.append(time.perf_counter() - started)
                    assert isinstance(future, Future)  # without async staging options
                    future.result()
                done.append(time.perf_counter() - started)
            print(f"{kind:5s} median returned {sorted(returned)[repeats // 2]:.4f} s, "
                  f"median written {sorted(done)[repeats // 2]:.4f} s")  # fmt: skip
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
