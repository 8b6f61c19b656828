"""The torch reference engine on CPU: generation against transformers, weights, tags, KV sizing.

A tiny Qwen2 model is saved to a temporary directory and loaded through from_pretrained; tiny
Llama, Qwen3 and Mistral models for the other decoders the engine runs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rljob_worker.engines.base import RolloutEngine, SamplingParams
from rljob_worker.engines.paged_decoder import DecoderShape, Llama3Rope
from rljob_worker.engines.torch_engine import (
    CPU_FALLBACK_KV_CAPACITY_TOKENS,
    KVCapacityError,
    TorchEngine,
    kv_pool_capacity_tokens,
)
from rljob_worker.rl_math import token_logprobs
from rljob_worker.saver import PassThroughSaver, make_saver

GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
# Mixed lengths so that a batch is padded, and long enough to cross 4-token blocks.
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43]]


def _save_tiny_qwen2(directory: Path, tie: bool, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        # Wide initial weights: at the default 0.02 a random model repeats one token forever,
        # which would make "matches transformers" nearly vacuous.
        initializer_range=0.3,
    )
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2ForCausalLM]:
    directory = tmp_path_factory.mktemp("tiny-qwen2")
    return directory, _save_tiny_qwen2(directory, tie=True, seed=0)


@pytest.fixture(scope="module")
def tiny_untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2ForCausalLM]:
    directory = tmp_path_factory.mktemp("tiny-qwen2-untied")
    return directory, _save_tiny_qwen2(directory, tie=False, seed=1)


def _engine(path: Path, **kwargs: object) -> TorchEngine:
    options: dict[str, object] = {
        "dtype": torch.float32,
        "kv_capacity_tokens": 256,
        "block_size": 4,
    }
    options.update(kwargs)
    return TorchEngine(path, **options)  # type: ignore[arg-type]


def _hf_greedy(model: Qwen2ForCausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    generate: Any = getattr(model, "generate")  # noqa: B009 (transformers' stub mistypes self)
    out = generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize("fixture", ["tiny", "tiny_untied"])
def test_greedy_generation_matches_transformers_generate_token_for_token(
    fixture: str, request: pytest.FixtureRequest
) -> None:
    path, model = request.getfixturevalue(fixture)
    engine = _engine(path)
    assert isinstance(engine, RolloutEngine)

    got = engine.generate(PROMPTS, GREEDY)

    expected = [_hf_greedy(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    assert got == expected
    assert len({tuple(r) for r in got}) == len(PROMPTS)  # not a degenerate constant output


def test_generation_in_several_waves_when_pool_is_small_gives_the_same_tokens(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    # 32 tokens hold one request of <= 13 + 12 tokens at a time: three waves.
    small = _engine(path, kv_capacity_tokens=32)
    roomy = _engine(path)

    assert small.generate(PROMPTS, GREEDY) == roomy.generate(PROMPTS, GREEDY)


def test_request_longer_than_kv_pool_fails_with_the_numbers(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path, kv_capacity_tokens=16)

    with pytest.raises(
        KVCapacityError, match=r"prompt 0 needs 5 \+ 12 = 17 tokens of KV, the pool holds 16"
    ):
        engine.generate(PROMPTS, GREEDY)


def test_seeded_sampling_is_reproducible_and_seed_dependent(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.95, top_k=50, seed=7)

    first = engine.generate(PROMPTS, sampling)
    again = engine.generate(PROMPTS, sampling)
    other = engine.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))

    assert first == again
    assert first != other


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_are_the_trainers_at_the_same_temperature(
    tiny: tuple[Path, Qwen2ForCausalLM], temperature: float
) -> None:
    # What the trainer computes for the same tokens (rl_math.token_logprobs on transformers'
    # logits / temperature) is what the engine reports it sampled with: the PPO ratio's and the
    # mismatch's two sides agree up to float32 kernel differences.
    path, model = tiny
    engine = _engine(path)
    sampling = SamplingParams(max_new_tokens=6, temperature=temperature, seed=3)
    for prompt, completion in zip(
        PROMPTS, engine.generate_with_logprobs(PROMPTS, sampling), strict=True
    ):
        assert len(completion.logprobs) == len(completion.token_ids)
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = token_logprobs(logits, ids[0, len(prompt) :], temperature).logprobs
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_top_k_one_and_tiny_top_p_sample_the_greedy_token(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path)
    greedy = engine.generate(PROMPTS, GREEDY)

    top_k_1 = SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=1)
    top_p_tiny = SamplingParams(max_new_tokens=12, temperature=1.5, top_p=1e-6, seed=1)

    assert engine.generate(PROMPTS, top_k_1) == greedy
    assert engine.generate(PROMPTS, top_p_tiny) == greedy


def test_generation_stops_after_an_eos_token(tiny: tuple[Path, Qwen2ForCausalLM]) -> None:
    path, _ = tiny
    greedy = _engine(path).generate(PROMPTS, GREEDY)
    eos = greedy[0][3]  # the 4th token of the first response becomes its stop token
    engine = _engine(path, eos_token_ids=[eos])

    got = engine.generate(PROMPTS, GREEDY)

    assert got[0] == greedy[0][: greedy[0].index(eos) + 1]
    for response, full in zip(got, greedy, strict=True):
        assert response == (full[: full.index(eos) + 1] if eos in full else full)


def test_update_weights_changes_outputs_in_place_keeping_addresses(
    tiny: tuple[Path, Qwen2ForCausalLM], tiny_untied: tuple[Path, Qwen2ForCausalLM]
) -> None:
    path, _ = tiny
    _, other_model = tiny_untied
    engine = _engine(path)
    before_tokens = engine.generate(PROMPTS, GREEDY)
    before_ptrs = engine.data_ptrs()
    # Same architecture, other values: every parameter of the tied model exists in the untied one.
    new = dict(other_model.named_parameters())
    names = engine.parameter_names()

    for start in range(0, len(names), 5):  # buckets of 5 tensors
        engine.update_weights((n, new[n].detach()) for n in names[start : start + 5])

    assert engine.data_ptrs() == before_ptrs
    for name, tensor in engine.named_weights():
        assert torch.equal(tensor, new[name].detach()), name
    assert engine.generate(PROMPTS, GREEDY) != before_tokens


def test_update_weights_on_tied_lm_head_name_writes_the_embedding(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path)
    embedding = dict(engine.named_weights())["model.embed_tokens.weight"]
    replacement = torch.randn_like(embedding)

    engine.update_weights([("lm_head.weight", replacement)])

    assert torch.equal(dict(engine.named_weights())["model.embed_tokens.weight"], replacement)


def test_update_weights_with_unknown_name_or_wrong_shape_raises_clearly(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path)

    with pytest.raises(KeyError, match=r"unknown weight 'model\.layers\.9\.mlp\.up_proj\.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(128, 64))])
    with pytest.raises(ValueError, match=r"shape \(64, 64\), the engine's is \(128, 64\)"):
        engine.update_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 64))])
    # A bad tensor anywhere in a bucket rejects the whole bucket: nothing was written.
    before = dict(engine.named_weights())["model.layers.0.mlp.down_proj.weight"].clone()
    with pytest.raises(ValueError, match="up_proj"):
        engine.update_weights(
            [
                ("model.layers.0.mlp.down_proj.weight", torch.ones_like(before)),
                ("model.layers.0.mlp.up_proj.weight", torch.zeros(64, 64)),
            ]
        )
    assert torch.equal(dict(engine.named_weights())["model.layers.0.mlp.down_proj.weight"], before)


def test_release_and_resume_reach_the_pass_through_saver_in_order(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    saver = PassThroughSaver()
    engine = _engine(path, saver=saver)
    assert saver.calls == [("region", "weights"), ("region", "kv_cache")]

    engine.release(["kv_cache", "weights", "cuda_graph"])
    engine.resume(["weights"])
    engine.resume(["kv_cache", "cuda_graph"])

    # cuda_graph is accepted and is a no-op: the torch engine captures no CUDA graphs.
    assert saver.calls[2:] == [
        ("pause", "kv_cache"),
        ("pause", "weights"),
        ("resume", "weights"),
        ("resume", "kv_cache"),
    ]
    assert engine.released_tags == frozenset()


def test_release_twice_resume_unreleased_or_unknown_tag_is_refused(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path, saver=PassThroughSaver())
    engine.release(["kv_cache"])

    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] already released"):
        engine.release(["kv_cache"])
    with pytest.raises(RuntimeError, match=r"\['weights'\] not released"):
        engine.resume(["weights"])
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release(["optimizer"])


def test_generate_needs_resumed_memory_and_refreshed_weights_after_release(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, model = tiny
    engine = _engine(path, saver=PassThroughSaver())
    expected = engine.generate(PROMPTS, GREEDY)
    weights = {n: t.detach().clone() for n, t in model.named_parameters()}
    names = engine.parameter_names()

    engine.release(["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="released; resume first"):
        engine.generate(PROMPTS, GREEDY)
    engine.resume(["weights", "kv_cache"])
    # Released weights are discarded (SGLang's semantics): a partial update is not enough.
    engine.update_weights((n, weights[n]) for n in names[:-1])
    with pytest.raises(RuntimeError, match="1 of them were not updated"):
        engine.generate(PROMPTS, GREEDY)
    engine.update_weights([(names[-1], weights[names[-1]])])

    assert engine.generate(PROMPTS, GREEDY) == expected


def test_kv_capacity_is_fraction_of_device_minus_weights_in_whole_blocks(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    total = 8 * 2**20
    engine = _engine(
        path, kv_capacity_tokens=None, device_total_bytes=total, mem_fraction_static=0.5
    )
    # fp32, 2 layers x 2 KV heads x head_dim 16, K and V: 512 bytes per token.
    per_token = 2 * 2 * 2 * 16 * 4
    expected = (int(0.5 * total) - engine.weight_bytes) // per_token // 4 * 4

    assert engine.kv_capacity_tokens == expected
    assert engine.kv_capacity_tokens > 1000
    # The pool holds the capacity plus one null block.
    assert engine.kv_pool_bytes == (expected + 4) * per_token


def test_kv_capacity_falls_back_on_cpu_without_a_device_total(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    path, _ = tiny
    engine = _engine(path, kv_capacity_tokens=None)
    assert engine.kv_capacity_tokens == CPU_FALLBACK_KV_CAPACITY_TOKENS


@pytest.mark.parametrize(
    ("fraction", "total", "weights", "expected"),
    [
        (0.9, 80 * 2**30, 15 * 2**30, (int(0.9 * 80 * 2**30) - 15 * 2**30) // 57344 // 16 * 16),
        (0.5, 1000, 100, None),
        (0.2, 80 * 2**30, 16 * 2**30, None),
    ],
)
def test_kv_pool_capacity_tokens_formula(
    fraction: float, total: int, weights: int, expected: int | None
) -> None:
    # 57344 bytes per token: Qwen2.5-7B (28 layers, 4 KV heads, head_dim 128, bf16).
    if expected is None:
        with pytest.raises(KVCapacityError, match="raise mem_fraction_static"):
            kv_pool_capacity_tokens(fraction, total, weights, 57344, 16)
    else:
        assert kv_pool_capacity_tokens(fraction, total, weights, 57344, 16) == expected


def test_make_saver_picks_the_pass_through_stand_in_on_cpu() -> None:
    assert isinstance(make_saver("cpu"), PassThroughSaver)
    assert make_saver("cpu").releases_device_memory is False


def test_engine_refuses_use_after_shutdown(tiny: tuple[Path, Qwen2ForCausalLM]) -> None:
    path, _ = tiny
    engine = _engine(path)
    engine.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        engine.generate(PROMPTS, GREEDY)


def test_a_stopped_request_keeps_its_tokens_and_its_continuation_ends_as_if_uncut(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    # The partial rollout's abort (agentic/driver.py): rows stop after two decode steps with
    # what they sampled, a prefix of the uncut answer; asked again from there, they go on to
    # the uncut answer, log-probs too (greedy).
    engine = _engine(tiny[0])
    whole = engine.generate_with_logprobs(PROMPTS, GREEDY)
    checks = iter([False, False, False, True])  # the wave, two steps, then stop
    cut = engine._generate_rows(PROMPTS, [12] * len(PROMPTS), GREEDY, lambda: next(checks))
    for part, full, prompt in zip(cut, whole, PROMPTS, strict=True):
        assert part.aborted and len(part.token_ids) == 3
        assert part.token_ids == full.token_ids[:3]
        rest = engine.generate_with_logprobs(
            [prompt + part.token_ids], SamplingParams(max_new_tokens=9, temperature=0.0)
        )[0]
        assert part.token_ids + rest.token_ids == full.token_ids
        assert part.logprobs + rest.logprobs == pytest.approx(full.logprobs, abs=1e-4)


def test_an_abort_answers_waiting_requests_at_once_and_spares_later_ones(
    tiny: tuple[Path, Qwen2ForCausalLM],
) -> None:
    engine = _engine(tiny[0])
    engine.batch_window_seconds = 0.05

    async def scenario() -> tuple[list[Any], Any]:
        waiting = [asyncio.ensure_future(engine.async_generate(p, GREEDY)) for p in PROMPTS]
        await asyncio.sleep(0)  # sent: waiting for their batch (the 50 ms window)
        engine.abort_requests()
        later = asyncio.ensure_future(engine.async_generate(PROMPTS[0], GREEDY))
        return list(await asyncio.gather(*waiting)), await later

    aborted, later = asyncio.run(scenario())
    assert all(a.aborted and a.token_ids == [] == a.logprobs for a in aborted)
    assert not later.aborted
    assert later.token_ids == engine.generate_with_logprobs([PROMPTS[0]], GREEDY)[0].token_ids


# The other decoders the memory plan sizes exactly: each a tiny random model saved and loaded
# through from_pretrained, with the options that change the forward switched on.
def _llama(**options: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_TINY, **options)
    return LlamaForCausalLM(config)


def _qwen3() -> Any:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32, not hidden / heads (16): Qwen3 configs give it explicitly.
    return Qwen3ForCausalLM(Qwen3Config(**_TINY, head_dim=32))


def _mistral() -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_TINY, sliding_window=None))


_TINY: dict[str, Any] = {
    "vocab_size": 97, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rope_theta": 5000.0, "initializer_range": 0.3, "tie_word_embeddings": False,
}  # fmt: skip
# Llama 3.1's scaling with an original context of 16 positions, so that the prompts below
# (up to 25 positions) reach past it and the head's 8 frequencies fall on both sides of it.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
ARCHITECTURES: dict[str, Any] = {
    "llama": lambda: _llama(),
    "llama-biases-llama3-rope": lambda: _llama(
        attention_bias=True, mlp_bias=True, rope_parameters=LLAMA3_ROPE
    ),
    "qwen3": _qwen3,
    "mistral": _mistral,
}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_other_decoders_generate_as_transformers_and_report_its_logprobs(
    architecture: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = ARCHITECTURES[architecture]().eval()
    # transformers starts biases at 0 and norms at 1: drawn instead, so that a bias or a norm
    # the engine left out or misplaced changes the answers.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    engine = _engine(tmp_path)

    got = engine.generate(PROMPTS, GREEDY)

    assert got == [_hf_greedy(model, p, GREEDY.max_new_tokens) for p in PROMPTS]
    assert len({tuple(r) for r in got}) == len(PROMPTS)
    # Sampled, the log-probs the engine reports are transformers' for the same tokens.
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    for prompt, completion in zip(
        PROMPTS, engine.generate_with_logprobs(PROMPTS, sampling), strict=True
    ):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        expected = token_logprobs(logits, ids[0, len(prompt) :], 1.0).logprobs
        assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_llama3_rope_scaling_against_hand_computed_frequencies() -> None:
    # Original context 16, factor 8, low/high frequency factors 1 and 4: wavelengths above 16
    # are divided by 8, below 4 kept, between them interpolated with
    # s = (16 / wavelength - 1) / (4 - 1).
    rope = Llama3Rope(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_positions=16)  # fmt: skip
    inv_freq = torch.tensor([2.0, 1.0, 0.1, 0.001])
    # 2.0: wavelength pi, under 4: kept. 1.0: wavelength 2 pi, s = (16 / 2pi - 1) / 3 =
    # 0.515494, so (1 - s) / 8 + s = 0.576057. 0.1 and 0.001: wavelengths 62.8 and 6283: / 8.
    expected = torch.tensor([2.0, 0.576057, 0.0125, 0.000125])
    assert torch.allclose(rope.scale(inv_freq), expected, rtol=1e-5)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "gpt2"}, r"model_type='gpt2' is not supported.*qwen2, qwen3, llama, mistral"),
        ({"model_type": "mistral", "sliding_window": 4096}, "mistral sliding-window attention"),
        ({"model_type": "qwen2", "use_sliding_window": True}, "qwen2 sliding-window attention"),
        ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
         "rope_type='yarn'"),
    ],
)  # fmt: skip
def test_an_unsupported_decoder_is_refused_with_what_it_lacks(
    config: dict[str, Any], message: str
) -> None:
    from types import SimpleNamespace

    base = {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 97, "rope_theta": 1e4}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        DecoderShape.from_config(SimpleNamespace(**{**base, **config}))
