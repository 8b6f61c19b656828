"""Models for the GPU tests: random Qwen2 checkpoints of a chosen shape, saved as a user's."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rljob_worker.model import load_tokenizer, resolve_model_path


def random_qwen2(directory: Path, *, seed: int, **shape: int) -> Path:
    """A random Qwen2 with the builtin tokenizer, saved in bf16 (head_dim 64: every backend)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    builtin = Path(resolve_model_path("builtin:tiny-qwen2"))
    tokenizer = load_tokenizer(builtin)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin / name, directory / name)
    hidden = shape.get("hidden", 256)
    config = Qwen2Config(
        vocab_size=shape.get("vocab", len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=shape.get("intermediate", hidden * 11 // 4),
        num_hidden_layers=shape.get("layers", 2),
        num_attention_heads=hidden // 64,
        num_key_value_heads=shape.get("kv_heads", 2),
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        # A random model at 0.02 answers nearly uniform logits, where argmax is a coin toss
        # between kernels; 0.3 makes greedy decoding decisive (see the torch engine's tests).
        initializer_range=0.3,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).bfloat16().save_pretrained(directory)
    return directory


def random_qwen25_05b(directory: Path) -> Path:
    """Qwen2.5-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads: one per TP rank of 2;
    vocab 151936), random, seed 3."""
    return random_qwen2(
        directory, seed=3, hidden=896, intermediate=4864, layers=24, kv_heads=2, vocab=151936
    )
