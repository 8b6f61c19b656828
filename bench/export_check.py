"""An exported policy as SGLang and transformers load it: the weights bit for bit, greedy answers.

`python bench/export_check.py EXPORT_DIR` (on a GPU with sglang) starts `sglang.Engine` with the
export as its `model_path`, reads the engine's weights back by name (`save_sharded_model`, as
`rljob run --verify-weights` does) and compares each with the export's safetensors bit for bit;
then generates greedily on fixed prompts with SGLang and with
`AutoModelForCausalLM.from_pretrained(EXPORT_DIR)` and prints where the answers first differ
(two bf16 kernels may break a near-tie differently: the weights are the exact check). Exit
status 1 when a weight differs or is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--mem-fraction-static", type=float, default=0.5)
    args = parser.parse_args()

    import sglang
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rljob_worker.engines.sglang_weights import (
        SHARD_PATTERN,
        DenseLayout,
        WeightShards,
        read_weights,
    )

    exported: dict[str, torch.Tensor] = {}
    for file in sorted(args.export.glob("*.safetensors")):
        exported.update(load_file(str(file)))
    engine = sglang.Engine(
        model_path=str(args.export),
        mem_fraction_static=args.mem_fraction_static,
        random_seed=0,
        log_level="error",
    )
    try:
        with tempfile.TemporaryDirectory(prefix="rljob-export-check-") as directory:
            engine.save_sharded_model(path=directory, pattern=SHARD_PATTERN, max_size=None)
            held = read_weights(WeightShards(directory, DenseLayout.from_model(args.export, 1)))
        missing = sorted(set(exported) - set(held))
        differ = sorted(
            n for n in set(exported) & set(held) if not torch.equal(held[n].cpu(), exported[n])
        )
        tokenizer = AutoTokenizer.from_pretrained(str(args.export))
        prompts = [tokenizer.encode(p) for p in ("12+7=", "What is 3*4? ", "say 5:", "1 2 3")]
        sampling = {"temperature": 0.0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
        outputs = engine.generate(input_ids=prompts, sampling_params=sampling)
        sglang_ids = [list(o["output_ids"]) for o in outputs]
    finally:
        engine.shutdown()
    model: Any = AutoModelForCausalLM.from_pretrained(str(args.export), dtype=torch.bfloat16)
    model.cuda()
    agree = []
    for prompt, ours in zip(prompts, sglang_ids, strict=True):
        output = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=args.new_tokens,
            do_sample=False,
            min_new_tokens=args.new_tokens,
        )
        theirs = output[0, len(prompt) :].tolist()
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                    min(len(ours), len(theirs)))  # fmt: skip
        agree.append(same)
    print(
        json.dumps(
            {
                "export": str(args.export),
                "tensors": len(exported),
                "compared": len(set(exported) & set(held)),
                "missing_in_engine": missing,
                "differ": differ,
                "greedy_tokens_equal_before_first_difference": agree,
                "new_tokens": args.new_tokens,
            }
        )
    )
    return 1 if missing or differ else 0


if __name__ == "__main__":
    sys.exit(main())
