"""The torch engine on CUDA with the real torch_memory_saver (hook_mode "torch").

Released memory must come back as free device memory, measured by the driver (mem_get_info).

torch_memory_saver is one process-wide singleton: every engine in this process allocates under
the same tags, so the tests use one engine at a time and assert lower bounds on freed bytes
(memory of an engine shut down earlier stays cached in the tag's pool and is paused with it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rljob_worker.engines.base import SamplingParams
from rljob_worker.engines.torch_engine import TorchEngine
from rljob_worker.saver import CudaMemorySaver

if not torch.cuda.is_available():
    # Collected everywhere, runnable only where CUDA is (marker gpu; run through the device tool).
    pytest.skip("needs a CUDA device and torch_memory_saver", allow_module_level=True)

GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]]
MiB = 2**20


def _free_device_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _config(hidden: int, layers: int, vocab: int) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(hidden // 256, 1),
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        initializer_range=0.3,  # a random model at 0.02 repeats one token; see the unit tests
    )


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A ~120M-parameter Qwen2 in bf16 (~250 MB of weights: large enough to see in free memory)."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(_config(hidden=1024, layers=8, vocab=32000)).bfloat16()
    directory = tmp_path_factory.mktemp("qwen2-bf16")
    model.save_pretrained(directory)
    host_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return directory, host_weights


def test_greedy_generation_on_cuda_matches_transformers_generate(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(_config(hidden=256, layers=2, vocab=512)).eval()
    directory = tmp_path_factory.mktemp("qwen2-fp32")
    model.save_pretrained(directory)
    engine = TorchEngine(directory, device="cuda", dtype=torch.float32, kv_capacity_tokens=1024)
    generate: Any = getattr(model.cuda(), "generate")  # noqa: B009 (transformers' stub mistypes self)
    try:
        got = engine.generate(PROMPTS, GREEDY)
        expected = [
            generate(
                torch.tensor([p], device="cuda"),
                max_new_tokens=GREEDY.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    finally:
        engine.shutdown()
    assert got == expected


def test_release_frees_device_memory_and_resume_keeps_addresses_over_two_iterations(
    bf16_model: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    directory, host_weights = bf16_model
    engine = TorchEngine(directory, device="cuda", dtype=torch.bfloat16, mem_fraction_static=0.15)
    try:
        assert isinstance(engine._saver, CudaMemorySaver)
        total = torch.cuda.mem_get_info()[1]
        # Sized the documented way: fraction of the device minus the engine's weights.
        per_token = engine.shape.kv_bytes_per_token(torch.bfloat16)
        expected_pool = int(0.15 * total) - engine.weight_bytes
        assert expected_pool - 16 * per_token <= engine.kv_capacity_tokens * per_token
        assert engine.kv_capacity_tokens * per_token <= expected_pool
        reference = engine.generate(PROMPTS, GREEDY)
        addresses = engine.data_ptrs()

        for iteration in range(2):  # the second cycle is where release/resume bugs show
            allocated = torch.cuda.memory_allocated()
            free_awake = _free_device_bytes()
            engine.release(["kv_cache"])
            free_no_kv = _free_device_bytes()
            engine.release(["weights", "cuda_graph"])
            free_asleep = _free_device_bytes()
            # The caching allocator still counts the tensors: only the driver sees the release.
            assert torch.cuda.memory_allocated() == allocated

            engine.resume(["weights"])  # staged: weights first, KV cache still released
            free_weights_only = _free_device_bytes()
            # Released weights are discarded (SGLang's semantics): refill them, bucket by bucket.
            names = engine.parameter_names()
            for start in range(0, len(names), 8):
                engine.update_weights((n, host_weights[n]) for n in names[start : start + 8])
            engine.resume(["kv_cache", "cuda_graph"])
            free_resumed = _free_device_bytes()
            responses = engine.generate(PROMPTS, GREEDY)

            print(
                f"\n[{torch.cuda.get_device_name()}] iteration {iteration}: weights "
                f"{engine.weight_bytes / MiB:.1f} MiB, KV pool {engine.kv_pool_bytes / MiB:.1f} MiB "
                f"({engine.kv_capacity_tokens} tokens); freed by kv_cache release "
                f"{(free_no_kv - free_awake) / MiB:.1f} MiB, by weights release "
                f"{(free_asleep - free_no_kv) / MiB:.1f} MiB; taken by weights resume "
                f"{(free_asleep - free_weights_only) / MiB:.1f} MiB, by kv resume "
                f"{(free_weights_only - free_resumed) / MiB:.1f} MiB"
            )
            assert free_no_kv - free_awake >= engine.kv_pool_bytes
            assert free_asleep - free_no_kv >= engine.weight_bytes
            assert free_asleep - free_weights_only >= engine.weight_bytes
            assert free_weights_only - free_resumed >= engine.kv_pool_bytes
            assert abs(free_resumed - free_awake) <= 64 * MiB
            assert engine.data_ptrs() == addresses
            assert responses == reference
    finally:
        engine.shutdown()


def test_resume_without_room_raises_torch_oom_and_keeps_the_tag_released(
    bf16_model: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    directory, _ = bf16_model
    engine = TorchEngine(directory, device="cuda", dtype=torch.bfloat16, mem_fraction_static=0.15)
    try:
        engine.release(["kv_cache"])
        # Take all but half the pool's bytes, the way resident training state would.
        blocker = torch.empty(
            _free_device_bytes() - engine.kv_pool_bytes // 2, dtype=torch.uint8, device="cuda"
        )
        with pytest.raises(
            torch.OutOfMemoryError,
            match=r"Tried to allocate \d+ bytes\..* of which \d+ bytes is free",
        ):
            engine.resume(["kv_cache"])
        assert "kv_cache" in engine.released_tags
        del blocker
        torch.cuda.empty_cache()
        engine.resume(["kv_cache"])
        assert engine.released_tags == frozenset()
    finally:
        engine.shutdown()
