"""bench/multi_turn.py's --tool-seconds: the extra time a tool turn waits is drawn per
conversation and turn, so the async and turn-by-turn runs of one bench wait the same."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from support.scripts import bench_module

from rljob_worker.agentic.driver import Trajectory


def _bench() -> Any:
    return bench_module("multi_turn.py", "bench_multi_turn")


def _rollout(bench: Any, seconds: float) -> Any:
    rollout = bench.BenchRollout.__new__(bench.BenchRollout)  # tool_delay reads no engine
    rollout.tool_seconds = seconds
    return rollout


def test_tool_delay_is_the_same_draw_for_the_same_conversation_and_turn() -> None:
    bench = _bench()
    one, other = _rollout(bench, 0.5), _rollout(bench, 0.5)
    draws = [one.tool_delay(Trajectory(c, [1], turns=k)) for c in range(50) for k in (1, 2)]
    assert draws == [
        other.tool_delay(Trajectory(c, [1], turns=k)) for c in range(50) for k in (1, 2)
    ]
    # different conversations and turns wait different times (a spread, not a constant)
    assert len(set(draws)) == len(draws)


def test_tool_delay_has_the_median_asked_a_cap_and_none_by_default() -> None:
    bench = _bench()
    rollout = _rollout(bench, 0.2)
    draws = [rollout.tool_delay(Trajectory(c, [1], turns=1)) for c in range(4000)]
    assert 0.18 < statistics.median(draws) < 0.22
    assert max(draws) <= 2.0 and max(draws) > 1.0  # sigma 1: the tail reaches the 10x cap
    assert _rollout(bench, 0.0).tool_delay(Trajectory(0, [1], turns=1)) == 0.0


def test_engines_are_dealt_round_the_gpus_each_with_its_cards_share(monkeypatch: Any) -> None:
    """--engines 2 --gpus 2 (issue 32's routing bench on two cards): one engine a GPU at the
    whole fraction; --gpus 1: both on GPU 0 at half each; 3 on 2: the busier card's third."""
    import argparse

    import torch
    import transformers

    from rljob_worker.engines import sglang_engine

    bench = _bench()
    made: list[dict[str, Any]] = []

    class StandIn:  # records how it was made; the bench's calls after that do nothing
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)

        def __getattr__(self, name: str) -> Any:
            return lambda *args, **kwargs: None

    monkeypatch.setattr(sglang_engine, "SGLangEngine", StandIn)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        staticmethod(lambda *a, **k: torch.nn.Module()))  # fmt: skip
    for engines, gpus, expected in [
        (2, 2, [(0, 0.6), (1, 0.6)]),
        (2, 1, [(0, 0.3), (0, 0.3)]),
        (3, 2, [(0, 0.3), (1, 0.3), (0, 0.3)]),
    ]:
        made.clear()
        args = argparse.Namespace(engine="sglang", engines=engines, gpus=gpus, dtype="bfloat16",
                                  mem_fraction=0.6)  # fmt: skip
        assert len(bench._engines(args, "/m", [0])) == engines
        assert [(m["base_gpu_id"], m["mem_fraction_static"]) for m in made] == expected
    assert bench.engines_per_gpu(4, 2) == 2 and bench.engines_per_gpu(1, 2) == 1


def test_a_longer_context_is_a_copy_whose_config_alone_differs(tmp_path: Path) -> None:
    bench = _bench()
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 256, "a": 1}))
    (model / "model.safetensors").write_bytes(b"weights")
    copy = bench.with_context(model, 4096)
    assert json.loads((copy / "config.json").read_text()) == {
        "max_position_embeddings": 4096,
        "a": 1,
    }
    assert (copy / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 256
