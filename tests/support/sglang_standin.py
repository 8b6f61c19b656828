"""Stand-ins for the parts of sglang the adapter calls, which cannot run on any machine here
(sglang.Engine needs CUDA). Named as stand-ins wherever a test uses them.

SGLangEngineStandIn imitates one supported release (the newest unless told): it accepts only the
methods and keywords that release's contract declares (test_sglang_contract.py checks each
contract against its release) and models the sglang state rules the adapter must respect there.
The handoff stand-ins mirror sglang's MultiprocessingSerializer (ForkingPickler: a tensor travels
as a handle to its memory) and LocalSerializedTensor (one handle per TP rank, unwrapped by each
TP scheduler with its rank).
"""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rljob_worker.engines.sglang_engine import (
    CONTRACTS,
    SUPPORTED_SGLANG_VERSIONS,
    SGLangContract,
    TensorHandoff,
)

KV_CAPACITY = 4096
# The release a stand-in imitates unless told: the worker image's.
NEWEST = CONTRACTS[SUPPORTED_SGLANG_VERSIONS[-1]]


def serialize(obj: Any) -> bytes:
    """Stand-in for sglang.srt.utils.MultiprocessingSerializer.serialize (the same pickler)."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


def deserialize(data: bytes) -> Any:
    return pickle.loads(data)


@dataclass
class LocalSerializedTensorStandIn:
    """Stand-in for sglang's LocalSerializedTensor: values[i] is TP rank i's handle."""

    values: list[bytes]

    def get(self, rank: int) -> Any:
        return deserialize(self.values[rank])


HANDOFF_STAND_IN = TensorHandoff(serialize=serialize, local_tensor=LocalSerializedTensorStandIn)


@dataclass
class FlattenedTensorMetadataStandIn:
    """Stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata (the same
    fields; test_weight_sync.py runs the adapter's payload through the releases' own class)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


# The hand-off where the installed sglang has the flattened-bucket path.
HANDOFF_FLAT_STAND_IN = TensorHandoff(
    serialize=serialize,
    local_tensor=LocalSerializedTensorStandIn,
    flattened_metadata=FlattenedTensorMetadataStandIn,
)


# The direct hand-off (rljob's loader in the schedulers, engines/sglang_direct.py).
HANDOFF_DIRECT_STAND_IN = TensorHandoff(
    serialize=serialize, local_tensor=LocalSerializedTensorStandIn, direct=True
)


def reconstruct_flattened(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """What a TP scheduler does with its flattened-bucket payload (weight_updater's
    _update_weights_from_flattened_bucket and FlattenedTensorBucket.reconstruct_tensors)."""
    bucket = payload["flattened_tensor"]
    return [
        (m.name, bucket[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
        for m in payload["metadata"]
    ]


def staged_iteration_calls(buckets: int, contract: SGLangContract = NEWEST) -> list[str]:
    """The sglang calls of one staged iteration whose weights come in `buckets` buckets:
    wake_weights (resume, one update session where the release has them), wake_kv_cache,
    rollout, sleep."""
    session = contract.opens_weight_update_session
    return [
        "resume_memory_occupation",
        *(["begin_weight_update"] if session else []),
        *["update_weights_from_tensor"] * buckets,
        # Without a session the first update flushes the prefix cache itself (flush_cache=True).
        *(["end_weight_update", "flush_cache"] if session else []),
        "resume_memory_occupation",
        "generate",
        "release_memory_occupation",
    ]


class SGLangEngineStandIn:
    """Stand-in for sglang.Engine (cannot run here): records calls, refuses undeclared ones.

    Models what the imitated release enforces: a tag resumed must have been released (its
    scheduler does `offload_tags.remove(tag)`), and, where the release has weight-update sessions
    (0.5.23), update_weights_from_tensor answers (False, ...) outside begin_weight_update() /
    end_weight_update(); 0.5.17 has neither method and loads at once.
    """

    def __init__(self, *, contract: SGLangContract = NEWEST, **kwargs: Any) -> None:
        self.contract = contract
        loader_field = [contract.direct_loader[0]] if contract.direct_loader else []
        undeclared = set(kwargs) - set(contract.server_args) - set(loader_field)
        assert not undeclared, f"Engine() keywords outside the contract's server_args: {undeclared}"
        self.calls: list[tuple[str, dict[str, Any]]] = [("__init__", kwargs)]
        # What the scheduler processes would inherit: the GPUs they may use.
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        # name -> the tensor each TP rank's scheduler loaded for it, in TP-rank order.
        self.loaded: dict[str, list[Any]] = {}
        self.offloaded: set[str] = set()
        self.session_open = False
        self.refuse: dict[str, str] = {}
        self.flattened_loads = 0  # buckets loaded through load_format="flattened_bucket"
        # The radix cache, as the weights' versions its prefixes were computed with: a load
        # makes a new version; a flush (its own request, an update's flush_cache=True after its
        # load, a release of the KV cache) empties it; a generate that would reuse a prefix of
        # an older version is the bug a missing flush causes, and fails here.
        self.weights_version = 0
        self.cached_versions: set[int] = set()
        self.direct_loads = 0  # buckets loaded through rljob's loader (the direct path)
        self.direct_names: list[list[str]] = []  # each such load's names, in order
        # The tokenizer manager's abort (the contract's `abort`): requests in flight when it
        # comes answer their first token, finish_reason abort, as sglang's running ones do.
        self.aborts = 0
        self.abort_queued = False  # True: an abort answers as one of a queued request, no ids
        _, _, method, keyword = contract.abort

        def abort(**kwargs: Any) -> None:
            assert kwargs == {keyword: True}, kwargs
            self.aborts += 1

        self.tokenizer_manager = SimpleNamespace(event_loop=None, **{method: abort})

    def __getattr__(self, method: str) -> Any:
        contract = self.contract
        if method not in contract.engine_methods:
            raise AttributeError(
                f"the adapter calls Engine.{method}, not in sglang {contract.release}'s contract"
            )

        def call(*args: Any, **kwargs: Any) -> Any:
            assert not args, f"Engine.{method} called positionally; the contract checks keywords"
            undeclared = set(kwargs) - set(contract.engine_methods[method])
            assert not undeclared, f"Engine.{method} keywords outside the contract: {undeclared}"
            self.calls.append((method, kwargs))
            if method in ("generate", "async_generate"):
                self._use_prefix_cache()
            if method == "async_generate":  # a coroutine, answered as generate() answers one
                return self._async_answer(kwargs)
            return self._answer(method, kwargs)

        return call

    async def _async_answer(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        import asyncio

        aborts = self.aborts
        await asyncio.sleep(0.01)  # the scheduler's turn: the request is in flight meanwhile
        answer = self._generated(kwargs["input_ids"], kwargs.get("return_logprob", False))
        answer["meta_info"][self.contract.cached_tokens_key] = len(kwargs["input_ids"]) // 2
        if self.aborts > aborts and self.abort_queued:  # aborted before its prefill
            return {"meta_info": {"finish_reason": {"type": "abort", "message": "queued"}}}
        if self.aborts > aborts:
            answer[self.contract.output_ids_key] = answer[self.contract.output_ids_key][:1]
            logprobs = answer["meta_info"].get(self.contract.output_logprobs_key)
            if logprobs is not None:
                answer["meta_info"][self.contract.output_logprobs_key] = logprobs[:1]
            answer["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}
        return answer

    def _answer(self, method: str, kwargs: dict[str, Any]) -> Any:
        if method in self.refuse:
            message = self.refuse[method]
            if method == "flush_cache":
                return SimpleNamespace(success=False, message=message)
            return False, message
        if method == "get_server_info":
            return {self.contract.kv_capacity_key: KV_CAPACITY, "tp_size": 1}
        if method == "release_memory_occupation":
            self.offloaded.update(kwargs["tags"])
            if "kv_cache" in kwargs["tags"]:
                self.cached_versions.clear()  # sglang flushes inside its KV release
        if method == "resume_memory_occupation":
            for tag in kwargs["tags"]:
                self.offloaded.remove(tag)  # KeyError, as in sglang's scheduler
        if method == "begin_weight_update":
            self.session_open = True
        if method == "end_weight_update":
            self.session_open = False
        needs_session = self.contract.opens_weight_update_session
        if method == "update_weights_from_tensor" and needs_session and not self.session_open:
            return False, "update_weights_from_tensor must run between begin and end"
        if method == "update_weights_from_tensor" and kwargs["load_format"] == "flattened_bucket":
            self._load_flattened(kwargs["named_tensors"])
        elif method == "update_weights_from_tensor" and kwargs["load_format"] is not None:
            self._load_direct(kwargs["load_format"], kwargs["named_tensors"])
        elif method == "update_weights_from_tensor":
            self._load(kwargs["named_tensors"])
        if method == "update_weights_from_tensor":
            self.weights_version += 1
            if kwargs.get("flush_cache", True):  # sglang's default; flushed after the load
                self.cached_versions.clear()
        if method == "flush_cache":
            self.cached_versions.clear()
        if method in self.contract.returns_success_message:
            return True, "Success"
        if method == "flush_cache":
            return SimpleNamespace(success=True, message="")
        if method == "generate":
            # Two tokens per prompt, [len(prompt), 7] (_generated).
            return [
                self._generated(ids, kwargs.get("return_logprob", False))
                for ids in kwargs["input_ids"]
            ]
        if method == "save_sharded_model":
            self._save_shards(kwargs["path"], kwargs["pattern"])
        return None

    def _use_prefix_cache(self) -> None:
        stale = {v for v in self.cached_versions if v != self.weights_version}
        assert not stale, (
            f"generate would reuse prefixes cached with weights version(s) {sorted(stale)}, "
            f"now {self.weights_version}: no flush since those weights were replaced"
        )
        self.cached_versions.add(self.weights_version)

    def _generated(self, ids: list[int], return_logprob: bool) -> dict[str, Any]:
        """Answers [len(ids), 7]; with return_logprob, input token i's log-prob is -i/10 (the
        first has none, as in sglang)."""
        meta: dict[str, Any] = {}
        if return_logprob:
            # The generated tokens' log-probs (id / -10: distinct values a test can check), as
            # (logprob, token id, text) the way sglang answers.
            meta[self.contract.output_logprobs_key] = [
                (-len(ids) / 10, len(ids), None),
                (-0.7, 7, None),
            ]
            meta[self.contract.input_logprobs_key] = [
                (None if i == 0 else -i / 10, token, None) for i, token in enumerate(ids)
            ]
        return {self.contract.output_ids_key: [len(ids), 7], "meta_info": meta}

    def _save_shards(self, path: str, pattern: str) -> None:
        """What each TP scheduler's save_sharded_model writes: its own shards of the weights it
        loaded, in sglang's layout of a dense Qwen2 (sglang_shards; config.json at model_path)."""
        from safetensors.torch import save_file

        tp_size = self.calls[0][1].get("tp_size", 1)
        config = json.loads((Path(self.calls[0][1]["model_path"]) / "config.json").read_text())
        for rank in range(tp_size):
            full = {name: values[rank] for name, values in self.loaded.items()}
            shards = sglang_shards(full, config, rank, tp_size)
            save_file(shards, os.path.join(path, pattern.format(rank=rank, part=0)))

    def _load(self, named_tensors: list[tuple[str, Any]]) -> None:
        """What each TP scheduler does (weight_updater._unwrap_tensor): take its rank's value."""
        tp_size = self.calls[0][1].get("tp_size", 1)
        for name, value in named_tensors:
            if isinstance(value, LocalSerializedTensorStandIn):
                assert len(value.values) == tp_size, f"{name}: {len(value.values)} != tp {tp_size}"
                self.loaded[name] = [value.get(rank) for rank in range(tp_size)]
            else:
                self.loaded[name] = [value] * tp_size

    def _load_flattened(self, payloads: list[bytes]) -> None:
        """Each TP scheduler deserializes its own rank's payload (tp_worker's
        _deserialize_own_rank) and loads the tensors rebuilt from it."""
        tp_size = self.calls[0][1].get("tp_size", 1)
        assert len(payloads) == tp_size, f"{len(payloads)} payloads for tp {tp_size}"
        self.flattened_loads += 1
        per_rank = [reconstruct_flattened(deserialize(payload)) for payload in payloads]
        for index, (name, _) in enumerate(per_rank[0]):
            self.loaded[name] = [tensors[index][1].clone() for tensors in per_rank]

    def _load_direct(self, load_format: str, named_tensors: list[tuple[str, Any]]) -> None:
        """A custom loader runs only where the engine was started with it declared
        (ServerArgs.custom_weight_loader); each TP scheduler unwraps its own rank's buffer and
        the loader cuts the bucket's tensors out of it (sglang_direct.unpack)."""
        from rljob_worker.engines.sglang_direct import unpack
        from rljob_worker.tp_shards import PAYLOAD_PREFIX as SHARDED_PREFIX
        from rljob_worker.tp_shards import STORED_NAME

        assert self.contract.direct_loader is not None
        declared = self.calls[0][1].get(self.contract.direct_loader[0]) or []
        assert load_format in declared, f"load_format {load_format!r} is not a declared loader"
        tp_size = self.calls[0][1].get("tp_size", 1)
        self.direct_loads += 1
        self.direct_names.append([name for name, _ in named_tensors])
        for name, value in named_tensors:
            if isinstance(value, LocalSerializedTensorStandIn):
                buffers = [value.get(rank) for rank in range(tp_size)]
            else:
                buffers = [value] * tp_size
            # A bucket sent shard to shard, and its own blocks as stored: each rank its own.
            if name.startswith(SHARDED_PREFIX) or name == STORED_NAME:
                self.loaded[name] = [buffer.clone() for buffer in buffers]
                continue
            per_rank = [unpack(name, buffer) for buffer in buffers]
            for index, (tensor, _) in enumerate(per_rank[0]):
                self.loaded[tensor] = [tensors[index][1].clone() for tensors in per_rank]

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


def sglang_shards(
    full: dict[str, torch.Tensor], config: dict[str, Any], rank: int, tp_size: int
) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s state dict as sglang 0.5.17/0.5.23 hold a dense Qwen2, written from their
    layers, independently of the adapter's join: q/k/v fused into qkv_proj (this rank's query
    heads, then its KV heads; one KV head shared by tp_size/num_kv_heads ranks where there are
    fewer than ranks), gate/up into gate_up_proj, o_proj/down_proj cut on the input dimension,
    the embedding and an untied LM head padded with zeros to a multiple of 64 rows and cut on the
    vocabulary (a tied LM head saved once, as `lm_head.weight`: save_sharded_model keeps the
    smaller of two names)."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    q_rows = heads // tp_size * head_dim
    kv_rows = max(1, kv // tp_size) * head_dim
    kv_start = (rank * kv_rows) if kv >= tp_size else (rank // (tp_size // kv)) * head_dim
    rows = {
        "q_proj": slice(rank * q_rows, (rank + 1) * q_rows),
        "k_proj": slice(kv_start, kv_start + kv_rows),
        "v_proj": slice(kv_start, kv_start + kv_rows),
    }
    fused: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        part = next((p for p in (*rows, "gate_proj", "up_proj") if f".{p}." in name), None)
        if part in rows:
            fused.setdefault(name.replace(part, "qkv_proj"), {})[part] = tensor[rows[part]]
        elif part is not None:
            piece = tensor.chunk(tp_size, dim=0)[rank]
            fused.setdefault(name.replace(part, "gate_up_proj"), {})[part] = piece
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = tensor.chunk(tp_size, dim=1)[rank]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = torch.zeros(
                (-(-tensor.shape[0] // 64) * 64, *tensor.shape[1:]), dtype=tensor.dtype
            )
            padded[: tensor.shape[0]] = tensor
            tied = config.get("tie_word_embeddings") and name.endswith("embed_tokens.weight")
            key = "lm_head.weight" if tied else name
            out[key] = padded.chunk(tp_size, dim=0)[rank]
        else:
            out[name] = tensor
    order = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    for name, parts in fused.items():
        out[name] = torch.cat([parts[p] for p in order if p in parts])
    return {name: tensor.contiguous() for name, tensor in out.items()}


# The engine's model as rljob's direct loader sees it in a scheduler (tests of the loader).


def full_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's full tensors by Hugging Face name (a tied head is not a tensor of its own,
    as named_parameters() gives it), in bf16 as the sync sends them."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    q = config["num_attention_heads"] * head_dim  # h unless config.head_dim says otherwise

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).bfloat16()

    out = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": rand(h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out |= {
            f"{p}.self_attn.q_proj.weight": rand(q, h),
            f"{p}.self_attn.q_proj.bias": rand(q),
            f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.k_proj.bias": rand(kv),
            f"{p}.self_attn.v_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.bias": rand(kv),
            f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.mlp.gate_proj.weight": rand(i, h),
            f"{p}.mlp.up_proj.weight": rand(i, h),
            f"{p}.mlp.down_proj.weight": rand(h, i),
            f"{p}.input_layernorm.weight": rand(h),
            f"{p}.post_attention_layernorm.weight": rand(h),
        }
    if not config.get("tie_word_embeddings"):
        out["lm_head.weight"] = rand(v, h)
    return out


def expected_shards(
    full: dict[str, torch.Tensor], config: dict[str, Any], rank: int, tp: int
) -> dict[str, torch.Tensor]:
    """TP rank `rank`'s parameters by the names sglang's model holds them under: the oracle's
    shards, with a tied head under the embedding's name (one parameter, named_parameters())."""
    shards = sglang_shards(full, config, rank, tp)
    if config.get("tie_word_embeddings"):
        shards["model.embed_tokens.weight"] = shards.pop("lm_head.weight")
    return shards


class EngineModelStandIn(torch.nn.Module):
    """sglang's model as its loader sees it (a stand-in): parameters under sglang's names with
    this TP rank's shapes, zeros at first; `config`; and `load_weights`, which records what it
    was given (sglang's own loader, for what the direct rules do not place)."""

    def __init__(self, shapes: dict[str, torch.Size], config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.held = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        )
        self.given: list[str] = []

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # sglang's names
        return ((name.replace("__", "."), p) for name, p in self.held.items())

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.given += [name for name, _ in weights]


def engine_model(full: dict[str, torch.Tensor], config: dict[str, Any], rank: int, tp: int) -> Any:
    shapes = {n: t.shape for n, t in expected_shards(full, config, rank, tp).items()}
    return EngineModelStandIn(shapes, config)


def assert_holds(model: Any, expected: dict[str, torch.Tensor]) -> None:
    held = dict(model.named_parameters())
    assert sorted(held) == sorted(expected)
    wrong = [n for n in expected if not torch.equal(held[n].data, expected[n])]
    assert not wrong, f"{len(wrong)} of {len(expected)} parameters differ: {wrong[:4]}"
