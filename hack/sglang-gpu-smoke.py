"""Smoke check of an installed SGLang on a GPU machine: import it, start the adapter's engine on the
builtin tiny Qwen2, generate greedily, release and resume every tag. Prints what it saw; exits
non-zero on the first failure. Run after hack/sglang-gpu-install.sh (docs/development.md, "GPU tests with SGLang").
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch


def main() -> int:
    import sglang

    from rljob_worker.engines.base import ALL_TAGS, SamplingParams
    from rljob_worker.engines.sglang_engine import SGLangEngine
    from rljob_worker.model import resolve_model_path

    path = Path(resolve_model_path(sys.argv[1] if len(sys.argv) > 1 else "builtin:tiny-qwen2"))
    print(f"sglang {sglang.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    start = time.monotonic()
    engine = SGLangEngine(model_path=str(path), dtype="bfloat16", mem_fraction_static=0.3)
    print(
        f"engine up in {time.monotonic() - start:.1f} s, KV pool {engine.kv_capacity_tokens} tokens"
    )
    try:
        engine.resume(list(ALL_TAGS))
        answers = engine.generate([[5, 6, 7], [9, 10, 11, 12]], SamplingParams(max_new_tokens=8))
        print(f"greedy answers {answers}")
        free = torch.cuda.mem_get_info()[0]
        engine.release(list(ALL_TAGS))
        print(f"release freed {(torch.cuda.mem_get_info()[0] - free) / 2**20:.0f} MiB")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
