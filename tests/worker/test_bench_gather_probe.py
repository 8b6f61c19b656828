"""bench/gather_probe.py: the trainer's side of a weight sync, timed part by part on one rank.
On the CPU (gloo, the builtin tiny model) the probe must find the send plan kept after the first
sync, and its gather must hand back the bucket the stage would get."""

from __future__ import annotations

from typing import Any

import pytest
from support.ranks import gloo_rank, run_ranks
from support.scripts import bench_module


def _probe_rank_main(rank: int, init_method: str, engine_casts: bool, results: Any) -> None:
    import torch

    from rljob_worker.model import resolve_model_path
    from rljob_worker.sync_send import gather_full
    from rljob_worker.train import Trainer

    bench = bench_module("gather_probe.py", "bench_gather_probe")
    with gloo_rank(rank, 1, init_method, results) as out:
        path = resolve_model_path("builtin:tiny-qwen2")
        trainer = Trainer(bench._spec(path, 1), path, torch.device("cpu"), pad_id=0)
        rows = bench.probe(trainer, 1 << 30, 3, 0.0, False, engine_casts)
        out["rows"] = rows
        # As stored, every sync's one bucket is the policy's fp32 buffer itself.
        bucket = next(trainer.weight_buckets(1 << 30, torch.bfloat16, engine_casts=engine_casts))
        out["dtypes"] = sorted({str(t.dtype) for _, t in bucket})
        # The probe's gather is the stage's: the same bytes as the unplanned path.
        params = list(trainer.model.named_parameters())
        planned = gather_full(params, torch.bfloat16, trainer._send_plans)
        plain = gather_full(params, torch.bfloat16)
        out["equal"] = all(
            torch.equal(a, b) and n == m for (n, a), (m, b) in zip(planned, plain, strict=True)
        )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine_casts", [False, True], ids=["cast", "as-stored"])
def test_the_probe_times_a_sync_whose_plan_is_kept_after_the_first(engine_casts: bool) -> None:
    out = run_ranks(_probe_rank_main, 1, engine_casts, timeout_seconds=240)[0]
    assert "error" not in out, out
    rows = out["rows"]
    assert len(rows) == 3
    # Each row checks the plan after its own weight_buckets (the first row's made it): every
    # row finds it held; each part was timed.
    assert [r["plan_held"] for r in rows] == [1.0, 1.0, 1.0]
    assert all(r["next_s"] > 0 and r["launch_s"] > 0 and r["params_s"] > 0 for r in rows)
    assert out["equal"]
    assert out["dtypes"] == (["torch.float32"] if engine_casts else ["torch.bfloat16"])
