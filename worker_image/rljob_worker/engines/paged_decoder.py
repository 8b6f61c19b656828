"""The torch engine's compute: a dense decoder's forward over a paged KV pool, and token sampling.

Written over the Hugging Face parameter tensors (same names, same math as transformers'
Qwen2, Qwen3, Llama and Mistral modules) so that it depends on no transformers internals such
as its Cache classes. It runs the model types the memory plan sizes exactly (MODEL_TYPES is
rljob.api.model.PLANNED_MODEL_TYPES), with the same bias and q/k-norm rules
(rljob.plan.model_shape).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rljob.api.model import PLANNED_MODEL_TYPES as MODEL_TYPES
from rljob.plan.model_shape import QK_NORM_MODEL_TYPES
from rljob_worker.engines.base import SamplingParams

# Block 0 of the pool is never handed out: masked-out keys and padded queries point at it, so
# the attention never reads memory that was never written (after a resume its contents are
# arbitrary, possibly NaN, and 0 * NaN is NaN even under a zero attention weight).
NULL_BLOCK = 0


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE scaling (rope_type "llama3"): long wavelengths divided by `factor`,
    short ones kept, the band between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        low_wavelen = self.original_max_positions / self.low_freq_factor
        high_wavelen = self.original_max_positions / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_positions / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class DecoderShape:
    """The config numbers and options the forward needs, read once from a transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    qk_norm: bool = False
    llama3_rope: Llama3Rope | None = None

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        model_type = getattr(config, "model_type", None)
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"torch engine: model_type={model_type!r} is not supported; the reference engine "
                f"runs {', '.join(MODEL_TYPES)} decoders (use engine sglang for others)"
            )
        # Qwen2/Qwen3 switch sliding windows on with use_sliding_window; Mistral's config has
        # the window itself (None: full attention, as in Mistral 7B v0.2 and later).
        sliding = getattr(config, "use_sliding_window", False) or (
            model_type == "mistral" and getattr(config, "sliding_window", None) is not None
        )
        if sliding:
            raise ValueError(
                f"torch engine: {model_type} sliding-window attention is not supported"
            )
        activation = getattr(config, "hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"torch engine: hidden_act={activation!r} is not supported (silu)")
        # transformers 5 keeps RoPE settings in rope_parameters; 4.x had rope_theta/rope_scaling.
        rope = dict(getattr(config, "rope_parameters", None) or {})
        scaling = dict(getattr(config, "rope_scaling", None) or {})
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        rope_type = rope_type or "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"torch engine: rope_type={rope_type!r} is not supported")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("torch engine: a partial rotary factor is not supported")
        rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if rope_theta is None:
            raise ValueError("torch engine: the model config has no rope_theta")
        llama3 = None
        if rope_type == "llama3":
            options = {**scaling, **rope}
            llama3 = Llama3Rope(
                factor=float(options["factor"]),
                low_freq_factor=float(options["low_freq_factor"]),
                high_freq_factor=float(options["high_freq_factor"]),
                original_max_positions=int(options["original_max_position_embeddings"]),
            )
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        return cls(
            num_layers=int(config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope_theta),
            vocab_size=int(config.vocab_size),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            llama3_rope=llama3,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token across all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE's inverse frequencies (fp32), as transformers' rope init functions compute them."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device)
        inv_freq = 1.0 / (self.rope_theta ** (exponents / self.head_dim))
        return inv_freq if self.llama3_rope is None else self.llama3_rope.scale(inv_freq)


class BlockAllocator:
    """Hands out fixed-size KV blocks (ids 1..num_blocks; 0 is the null block)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[int] = []
        self.reset()

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"KV pool: {count} blocks requested, {len(self._free)} free")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def reset(self) -> None:
        """Every block free again (flush_cache, and after the KV memory was released)."""
        self._free = list(range(1, self.num_blocks + 1))


def rope_cos_sin(
    positions: torch.Tensor, shape: DecoderShape, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, T, head_dim] as transformers' RoPE computes them (fp32, then cast)."""
    freqs = positions[..., None].float() * shape.inv_freq(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as Qwen2RMSNorm (and Llama's, Qwen3's): fp32 statistics, cast
    # back, then scale.
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def token_slots(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Pool slot of each (sequence, position): block_tables[b, pos // bs] * bs + pos % bs."""
    blocks = block_tables.gather(1, torch.div(positions, block_size, rounding_mode="floor"))
    return blocks * block_size + positions % block_size


@torch.no_grad()
def forward_paged(
    params: Mapping[str, torch.Tensor],
    shape: DecoderShape,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    kv_lens: torch.Tensor,
    last_index: torch.Tensor,
    write_mask: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """Run tokens [B, T] at positions [B, T] through the decoder; return fp32 logits [B, vocab].

    K/V of each token are written into the pool at its sequence's slots (only where write_mask,
    None meaning all), then every query attends to its sequence's first kv_lens[b] pool entries,
    causally. Logits are computed only at last_index[b], the token that predicts the next one.
    """
    batch, steps = tokens.shape
    device = tokens.device
    embed = params["model.embed_tokens.weight"]
    hidden = F.embedding(tokens, embed)
    cos, sin = rope_cos_sin(positions, shape, hidden.dtype)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads: [B, T, 1, D]

    write_slots = token_slots(block_tables, positions, block_size)
    if write_mask is not None:
        write_slots = write_slots[write_mask]
    kv_max = int(kv_lens.max())
    key_pos = torch.arange(kv_max, device=device)
    key_valid = key_pos[None, :] < kv_lens[:, None]  # [B, K]
    read_slots = token_slots(block_tables, key_pos.expand(batch, kv_max), block_size)
    read_slots = torch.where(key_valid, read_slots, NULL_BLOCK * block_size)
    # Causal within the sequence, and never past its length; a padded query (position beyond
    # the prompt) still sees key 0, so no row is fully masked (that would give NaN).
    attn_mask = (key_pos[None, None, :] <= positions[:, :, None]) & key_valid[:, None, :]
    attn_mask = attn_mask.unsqueeze(1)  # [B, 1, T, K]

    hq, hkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}."
        residual = hidden
        x = _rms_norm(hidden, params[prefix + "input_layernorm.weight"], shape.rms_norm_eps)
        attn = prefix + "self_attn."
        # Biases as the checkpoint has them: Qwen2's q/k/v always, Llama's and Qwen3's with
        # attention_bias (o_proj too), Llama's gate/up/down with mlp_bias, Mistral's none.
        q = F.linear(x, params[attn + "q_proj.weight"], params.get(attn + "q_proj.bias"))
        k = F.linear(x, params[attn + "k_proj.weight"], params.get(attn + "k_proj.bias"))
        v = F.linear(x, params[attn + "v_proj.weight"], params.get(attn + "v_proj.bias"))
        q = q.view(batch, steps, hq, hd)
        k = k.view(batch, steps, hkv, hd)
        v = v.view(batch, steps, hkv, hd)
        if shape.qk_norm:
            q = _rms_norm(q, params[attn + "q_norm.weight"], shape.rms_norm_eps)
            k = _rms_norm(k, params[attn + "k_norm.weight"], shape.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin

        pool_k, pool_v = kv_pool[0, layer], kv_pool[1, layer]  # [slots, Hkv, D] views
        if write_mask is None:
            pool_k[write_slots.reshape(-1)] = k.reshape(-1, hkv, hd)
            pool_v[write_slots.reshape(-1)] = v.reshape(-1, hkv, hd)
        else:
            pool_k[write_slots] = k[write_mask]
            pool_v[write_slots] = v[write_mask]
        keys = pool_k[read_slots]  # [B, K, Hkv, D]
        values = pool_v[read_slots]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=attn_mask,
            scale=1.0 / math.sqrt(hd),
            enable_gqa=hq != hkv,
        )
        out = out.transpose(1, 2).reshape(batch, steps, hq * hd)
        hidden = residual + F.linear(
            out, params[attn + "o_proj.weight"], params.get(attn + "o_proj.bias")
        )

        residual = hidden
        x = _rms_norm(
            hidden, params[prefix + "post_attention_layernorm.weight"], shape.rms_norm_eps
        )
        mlp = prefix + "mlp."
        gate = F.silu(
            F.linear(x, params[mlp + "gate_proj.weight"], params.get(mlp + "gate_proj.bias"))
        )
        up = F.linear(x, params[mlp + "up_proj.weight"], params.get(mlp + "up_proj.bias"))
        hidden = residual + F.linear(
            gate * up, params[mlp + "down_proj.weight"], params.get(mlp + "down_proj.bias")
        )

    last = hidden[torch.arange(batch, device=device), last_index]
    last = _rms_norm(last, params["model.norm.weight"], shape.rms_norm_eps)
    return F.linear(last, params["lm_head.weight"]).float()


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per row of fp32 logits [B, V]: greedy at temperature 0, else top-k/top-p;
    with the log-prob of each chosen token under the distribution it was drawn from (greedy:
    the unscaled softmax), which the trainer compares with its own (rl_math)."""
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        return tokens, _chosen(torch.log_softmax(logits, dim=-1), tokens)
    logits = logits / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = (cumulative - sorted_logits.softmax(dim=-1)) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return tokens, _chosen(torch.log_softmax(logits, dim=-1), tokens)


def _chosen(log_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.gather(log_probs, 1, tokens[:, None]).squeeze(1)
