"""The direct weight loader's own host time (issue 33): a bucket through per-tensor views
(`copy_into(unpack(...))`, the loader before its plan) against the bucket's plan
(`copy_bucket`), on this machine's CPU.

`python bench/direct_loader.py` builds the trainer's full tensors for a dense decoder of
--layers layers (Qwen2.5-3B has 36: 434 tensors) at a tiny hidden size, so the copies cost
little and what is timed is the host work per tensor, and a stand-in for sglang's model at TP
rank 0 of --tp (tests/unit/test_sglang_direct.EngineModelStandIn: sglang's names and shard
shapes; sglang's model classes need CUDA). Each way loads the same one-bucket payload
--repeats times after one untimed call (the plan's first build), and reports the median
milliseconds a call; both must leave the model holding the same parameters. On a GPU the
loader's own seconds come from `bench/gpu_steps.sh sync-buckets` instead.

Beside it, the sender's host work for the same tensors (`sender`): one rank's
`sync_send.gather_full` of FSDP2-style Shard(0) DTensors (a one-rank gloo group; the cast into one
flat buffer) and the hand-off's `flatten` and `payload_name`, the parts of a weight sync outside
the engine that a GPU run counts in the sync less the hand-off, or inside the hand-off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for extra in (REPO / "worker_image", REPO / "tests", REPO / "tests" / "unit"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from test_sglang_direct import CONFIG, engine_model, full_weights  # noqa: E402

from rljob_worker.engines import sglang_direct  # noqa: E402
from rljob_worker.weight_sync import flatten  # noqa: E402


def measure(layers: int, tp_size: int, repeats: int) -> dict[str, object]:
    """Median milliseconds a call each way, for one bucket of a `layers`-layer decoder at TP
    rank 0 of `tp_size`; raises where the two ways leave different parameters."""
    config = {**CONFIG, "num_hidden_layers": layers, "tie_word_embeddings": True}
    full = full_weights(config)
    flat = flatten(list(full.items()))
    name = sglang_direct.payload_name(flat)
    tp = (0, tp_size)
    result: dict[str, object] = {"tensors": len(full), "tp": tp_size, "torch": torch.__version__}
    ways = {
        "per-tensor views": lambda model: sglang_direct.copy_into(
            model, sglang_direct.unpack(name, flat.buffer), tp=tp
        ),
        "bucket plan": lambda model: sglang_direct.copy_bucket(model, name, flat.buffer, tp=tp),
    }
    held = []
    for way, load in ways.items():
        model = engine_model(full, config, *tp)
        load(model)  # untimed: the plan's first build
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            load(model)
            seconds.append(time.perf_counter() - started)
        result[way] = statistics.median(seconds) * 1e3
        held.append({n: p.detach().clone() for n, p in model.named_parameters()})
    first, second = held
    if any(not torch.equal(first[n], second[n]) for n in first):
        raise RuntimeError("the two ways left different parameters")
    return result


def sender(layers: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of gather_full, and of flatten + payload_name on its output, for the
    same decoder's tensors as one rank's Shard(0) DTensors. Needs no process group of its own
    (one is made here, world 1, gloo)."""
    import os
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rljob_worker.sync_send import gather_full

    config = {**CONFIG, "num_hidden_layers": layers, "tie_word_embeddings": True}
    full = full_weights(config)
    made = not dist.is_initialized()
    if made:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        # Parameters, as FSDP2 registers its shards (to_local on one costs more than on a bare
        # DTensor).
        params = [
            (n, torch.nn.Parameter(distribute_tensor(t.float(), mesh, [Shard(0)])))
            for n, t in full.items()
        ]
        times: dict[str, list[float]] = {}
        for label, plans in (("", None), (" planned", {})):
            for index in range(repeats + 1):
                started = time.perf_counter()
                out = gather_full(params, torch.bfloat16, plans)
                gathered = time.perf_counter()
                sglang_direct.payload_name(flatten(out))
                done = time.perf_counter()
                if index:  # the first is untimed (and makes the plan)
                    times.setdefault("gather_full" + label, []).append(gathered - started)
                    times.setdefault("flatten and payload_name" + label, []).append(done - gathered)
                if [n for n, _ in out] != list(full) or any(
                    not torch.equal(t, full[n]) for n, t in out
                ):
                    raise RuntimeError("gather_full did not give the full tensors back")
    finally:
        if made:
            dist.destroy_process_group()
    return {key: statistics.median(values) * 1e3 for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = measure(args.layers, args.tp, args.repeats)
    sent = sender(args.layers, args.repeats)
    result["sender"] = sent
    print(
        f"{result['tensors']} tensors, TP rank 0 of {args.tp}: per-tensor views "
        f"{result['per-tensor views']:.2f} ms a call, bucket plan {result['bucket plan']:.2f} ms "
        f"(median of {args.repeats}; torch {torch.__version__}); the sender: gather_full "
        f"{sent['gather_full']:.2f} ms (planned {sent['gather_full planned']:.2f}), flatten and "
        f"payload_name {sent['flatten and payload_name']:.2f} ms (planned "
        f"{sent['flatten and payload_name planned']:.2f})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
