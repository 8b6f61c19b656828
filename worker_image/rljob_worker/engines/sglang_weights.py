"""Reading an sglang engine's weights back under the trainer's parameter names: every TP rank's
shard as its scheduler holds it, joined into the full tensors training sent.

sglang's own `Engine.get_weights_by_name` cannot do this for the models this project runs: in
0.5.17 and 0.5.23 it asks the model class for the weight, and Qwen2ForCausalLM has no such method
(sglang's weight_exporter says "TODO: Add support for Qwen models" and answers None); where a
model has it (Llama), at TP > 1 it returns TP rank 0's shard of every column-parallel weight, as
a float32 Python list cut to `truncate_size` rows. So each TP rank writes its shards instead
(`Engine.save_sharded_model`, safetensors, one file set per rank, names as sglang's model holds
them), and `join_shards` undoes sglang's tensor-parallel layout of a dense Qwen2/Llama-style
model: fused qkv_proj and gate_up_proj split back, row-parallel o_proj/down_proj concatenated on
their input dimension, the vocab-parallel embedding and LM head concatenated and cut to the
vocabulary (sglang pads it to a multiple of 64). Every shard is compared on the way: a weight
that TP ranks replicate (norms, a KV head shared by several ranks) must be equal on all of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# The file name each TP rank's scheduler writes its shards under (save_sharded_model's pattern).
SHARD_PATTERN = "rank-{rank}-part-{part}.safetensors"


class EngineWeightsError(RuntimeError):
    """The engine's shards are not what a dense model's TP layout holds (or TP ranks disagree)."""


@dataclass(frozen=True)
class DenseLayout:
    """What sglang's TP sharding of a dense decoder depends on (from the model's config.json)."""

    tp_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_model(cls, model_path: str | Path, tp_size: int) -> DenseLayout:
        return cls.from_config(json.loads((Path(model_path) / "config.json").read_text()), tp_size)

    @classmethod
    def from_config(cls, config: Any, tp_size: int) -> DenseLayout:
        """From a model config: config.json's dict, or a Hugging Face config object (what
        sglang's model holds). A required field it lacks is a KeyError."""

        def get(key: str, required: bool = False) -> Any:
            value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
            if value is None and required:
                raise KeyError(key)
            return value

        heads = int(get("num_attention_heads", required=True))
        return cls(
            tp_size=tp_size,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            head_dim=int(get("head_dim") or get("hidden_size", required=True) // heads),
            vocab_size=int(get("vocab_size", required=True)),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
        )

    @property
    def kv_heads_per_rank(self) -> int:
        # Fewer KV heads than TP ranks: each rank holds one, shared by tp_size/num_kv_heads ranks.
        return max(1, self.num_kv_heads // self.tp_size)

    def kv_owners(self) -> list[list[int]]:
        """For each group of KV heads, the TP ranks that hold it (several where replicated)."""
        if self.num_kv_heads >= self.tp_size:
            return [[rank] for rank in range(self.tp_size)]
        replicas = self.tp_size // self.num_kv_heads
        return [list(range(h * replicas, (h + 1) * replicas)) for h in range(self.num_kv_heads)]


@dataclass(frozen=True)
class WeightShards:
    """Where an engine's TP ranks wrote their shards, and the layout they are in."""

    directory: str
    layout: DenseLayout


def load_shards(shards: WeightShards) -> list[dict[str, torch.Tensor]]:
    """Each TP rank's state dict, as written by save_sharded_model with SHARD_PATTERN."""
    from safetensors.torch import load_file

    directory = Path(shards.directory)
    per_rank: list[dict[str, torch.Tensor]] = []
    for rank in range(shards.layout.tp_size):
        files = sorted(directory.glob(SHARD_PATTERN.format(rank=rank, part="*")))
        if not files:
            raise EngineWeightsError(f"TP rank {rank} wrote no shards into {directory}")
        state: dict[str, torch.Tensor] = {}
        for path in files:
            state.update(load_file(str(path)))
        per_rank.append(state)
    return per_rank


def read_weights(shards: WeightShards) -> dict[str, torch.Tensor]:
    """The engine's full weights (on CPU) under the trainer's names."""
    return join_shards(load_shards(shards), shards.layout)


def join_shards(
    per_rank: Sequence[Mapping[str, torch.Tensor]], layout: DenseLayout
) -> dict[str, torch.Tensor]:
    """Full tensors by Hugging Face name from every TP rank's shards (see the module's text).

    A tied LM head (one tensor that sglang saves under one of its two names) answers under both
    `model.embed_tokens.weight` and `lm_head.weight`. Raises EngineWeightsError where ranks hold
    different names or a replicated weight differs between ranks.
    """
    import torch

    if len(per_rank) != layout.tp_size:
        raise EngineWeightsError(f"{len(per_rank)} TP ranks' shards for tp_size {layout.tp_size}")
    names = set(per_rank[0])
    for rank, state in enumerate(per_rank[1:], start=1):
        if set(state) != names:
            raise EngineWeightsError(
                f"TP rank {rank} holds other weights than rank 0: {sorted(set(state) ^ names)[:6]}"
            )
    full: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        parts = [state[name] for state in per_rank]
        if ".qkv_proj." in name:
            full.update(_split_qkv(name, parts, layout))
        elif ".gate_up_proj." in name:
            gates, ups = zip(*(p.chunk(2, dim=0) for p in parts), strict=True)
            full[name.replace("gate_up_proj", "gate_proj")] = torch.cat(gates, dim=0)
            full[name.replace("gate_up_proj", "up_proj")] = torch.cat(ups, dim=0)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            full[name] = torch.cat(parts, dim=1)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            full[name] = torch.cat(parts, dim=0)[: layout.vocab_size]
        else:
            full[name] = _replicated(name, parts, list(range(layout.tp_size)))
    if layout.tie_word_embeddings:
        tied = full.get("model.embed_tokens.weight", full.get("lm_head.weight"))
        if tied is not None:
            full["model.embed_tokens.weight"] = full["lm_head.weight"] = tied
    return full


def _split_qkv(
    name: str, parts: Sequence[torch.Tensor], layout: DenseLayout
) -> dict[str, torch.Tensor]:
    """QKVParallelLinear: rank r holds [its query heads; its KV heads (k); (v)] along dim 0."""
    import torch

    q_rows = layout.num_heads // layout.tp_size * layout.head_dim
    kv_rows = layout.kv_heads_per_rank * layout.head_dim
    split = [p.split([q_rows, kv_rows, kv_rows], dim=0) for p in parts]
    if any(p.shape[0] != q_rows + 2 * kv_rows for p in parts):
        raise EngineWeightsError(
            f"{name}: {[tuple(p.shape) for p in parts]} is not {q_rows}+2x{kv_rows} rows per rank"
        )
    out = {name.replace("qkv_proj", "q_proj"): torch.cat([s[0] for s in split], dim=0)}
    for index, which in ((1, "k_proj"), (2, "v_proj")):
        heads = [
            _replicated(f"{name} ({which})", [split[r][index] for r in owners], owners)
            for owners in layout.kv_owners()
        ]
        out[name.replace("qkv_proj", which)] = torch.cat(heads, dim=0)
    return out


def _replicated(name: str, parts: Sequence[torch.Tensor], ranks: Sequence[int]) -> torch.Tensor:
    """The one value TP ranks `ranks` all hold; bit for bit, or EngineWeightsError."""
    import torch

    first = parts[0]
    for rank, part in zip(ranks[1:], parts[1:], strict=True):
        if part.shape != first.shape or not torch.equal(
            part.view(torch.uint8) if part.is_floating_point() else part,
            first.view(torch.uint8) if first.is_floating_point() else first,
        ):
            raise EngineWeightsError(
                f"{name}: TP rank {rank} holds another value than TP rank {ranks[0]} "
                "(a replicated weight must be the same on every rank)"
            )
    return first
