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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = measure(args.layers, args.tp, args.repeats)
    print(
        f"{result['tensors']} tensors, TP rank 0 of {args.tp}: per-tensor views "
        f"{result['per-tensor views']:.2f} ms a call, bucket plan {result['bucket plan']:.2f} ms "
        f"(median of {args.repeats}; torch {torch.__version__})"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
