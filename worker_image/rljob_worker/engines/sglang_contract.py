"""What the SGLang adapter uses from each sglang release it supports (CONTRACTS), and the
contract of the release installed here; tests/unit/test_sglang_contract.py checks every entry
against that release's own source.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Mapping
from dataclasses import dataclass

from rljob_worker.engines.base import (
    TAG_CUDA_GRAPH,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
)
from rljob_worker.engines.sglang_direct import TP_PLACE


@dataclass(frozen=True)
class SGLangContract:
    """What the adapter uses from one sglang release; each entry is checked against its source."""

    # The release (sglang.__version__) this contract is checked against.
    release: str
    # Module (dotted) and class the adapter imports the engine from.
    engine_module: str
    engine_class: str
    # Engine method -> the keyword arguments the adapter passes to it (always by keyword).
    engine_methods: Mapping[str, tuple[str, ...]]
    # Engine(**kwargs) keys: every one must be a ServerArgs field.
    server_args: tuple[str, ...]
    # ServerArgs field -> values the adapter may pass, each of which must be among its choices.
    server_arg_choices: Mapping[str, tuple[str, ...]]
    # Keys of the per-request sampling_params dict: SamplingParams fields.
    sampling_params: tuple[str, ...]
    # sglang.srt.constants name -> the tag string this project uses for it (base.py).
    tags: Mapping[str, str]
    # Environment variable (an EnvBool in sglang.srt.environ) -> the value the adapter sets.
    env: Mapping[str, str]
    # Engine methods whose result is a (success, message) tuple that the adapter must check.
    returns_success_message: tuple[str, ...]
    # Engine methods whose result is a FlushCacheReqOutput-like object with `.success`.
    returns_success_attr: Mapping[str, str]
    # get_server_info() key holding the KV pool size in tokens (from the scheduler's init info).
    kv_capacity_key: str
    # Key of each generate() result holding the generated token ids.
    output_ids_key: str
    # Key of each result's meta_info holding, with return_logprob, one (logprob, token id, text)
    # per generated token: the log-prob it was sampled with.
    output_logprobs_key: str
    # meta_info key of a generate() result asked for return_logprob: (logprob, token id, text)
    # for each input token from logprob_start_len on (the first one's logprob is None).
    input_logprobs_key: str
    # meta_info key of every result: prompt tokens found in the radix cache (multi-turn
    # rollout's prefix-cache hit rate).
    cached_tokens_key: str
    # Engine methods that take **kwargs and pass them to every scheduler (collective_rpc) ->
    # (module, class, method) of the scheduler side that reads them as params["name"].
    rpc_methods: Mapping[str, tuple[str, str, str]]
    # Module and function that make CUDA tensors travel to other processes by device UUID.
    tensor_reduction_patch: tuple[str, str]
    # Module, class and method that serialize a tensor into an IPC handle (ForkingPickler).
    serializer: tuple[str, str, str]
    # Module, class and field of the per-TP-rank tensor wrapper the schedulers unwrap by rank;
    # the module is the one the schedulers' restricted unpickler allows it from.
    local_tensor: tuple[str, str, str]
    # Module and class of the restricted unpickler that must allow `local_tensor`.
    safe_unpickler: tuple[str, str]
    # update_weights_from_tensor's flattened-bucket path: (module, the metadata class its
    # schedulers rebuild a bucket from, the load_format that selects it). The schedulers
    # unpickle {"flattened_tensor", "metadata"} from one payload per TP rank and load the
    # rebuilt views with the model's load_weights, as the per-tensor path does. None: no such
    # path (the adapter hands over one tensor per parameter).
    flattened_bucket: tuple[str, str, str] | None = None
    # The direct hand-off (sglang_direct.py): (the ServerArgs field listing the weight loaders
    # the schedulers may run by import path, the WeightUpdater attribute holding that list,
    # which update_weights_from_tensor matches load_format against and then calls the loader as
    # loader(model, named_tensors) with each TP rank's own tensors). None: no such path.
    direct_loader: tuple[str, str] | None = ("custom_weight_loader", "custom_weight_loaders")
    # (module, function, function): where a scheduler reads its TP rank and TP size.
    tp_place: tuple[str, str, str] = TP_PLACE
    # The partial rollout's stop (abort_requests): (module, class, method, keyword) of the
    # engine's tokenizer manager call that aborts every request, as /abort_request does; an
    # aborted request answers what it sampled with meta_info finish_reason type "abort".
    abort: tuple[str, str, str, str] = (
        "sglang.srt.managers.tokenizer_manager", "TokenizerManager", "abort_request", "abort_all"
    )  # fmt: skip

    @property
    def opens_weight_update_session(self) -> bool:
        """Whether update_weights_from_tensor must run inside begin/end_weight_update()."""
        return "begin_weight_update" in self.engine_methods


# The weight-update session (0.5.23): its scheduler refuses update_weights_from_tensor outside
# begin_weight_update() / end_weight_update() (managers/scheduler_components/weight_updater.py).
_SESSION_METHODS = ("begin_weight_update", "end_weight_update")

_CONTRACT_0_5_23 = SGLangContract(
    release="0.5.23",
    engine_module="sglang.srt.entrypoints.engine",
    engine_class="Engine",
    engine_methods={
        "generate": ("input_ids", "sampling_params", "return_logprob", "logprob_start_len"),
        # One request from asyncio code (the multi-turn rollout; agentic/driver.py).
        "async_generate": ("input_ids", "sampling_params", "return_logprob"),
        "release_memory_occupation": ("tags",),
        "resume_memory_occupation": ("tags",),
        "begin_weight_update": (),
        "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
        "end_weight_update": (),
        "flush_cache": (),
        "get_server_info": (),
        # Every TP rank writes its weight shards (named_weights, `rljob run --verify-weights`).
        "save_sharded_model": ("path", "pattern", "max_size"),
        "shutdown": (),
    },
    server_args=(
        "model_path",
        "dtype",
        "tp_size",
        "base_gpu_id",
        "mem_fraction_static",
        "enable_memory_saver",
        "random_seed",
        "skip_tokenizer_init",
        "disable_cuda_graph",
        "custom_sigquit_handler",
    ),
    server_arg_choices={"dtype": ("bfloat16", "float16", "float32")},
    sampling_params=("max_new_tokens", "temperature", "top_p", "top_k", "sampling_seed"),
    tags={
        "GPU_MEMORY_TYPE_WEIGHTS": TAG_WEIGHTS,
        "GPU_MEMORY_TYPE_KV_CACHE": TAG_KV_CACHE,
        "GPU_MEMORY_TYPE_CUDA_GRAPH": TAG_CUDA_GRAPH,
    },
    env={"SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "false"},
    returns_success_message=(
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
    ),
    returns_success_attr={"flush_cache": "FlushCacheReqOutput"},
    kv_capacity_key="max_total_num_tokens",
    output_ids_key="output_ids",
    output_logprobs_key="output_token_logprobs",
    input_logprobs_key="input_token_logprobs",
    cached_tokens_key="cached_tokens",
    rpc_methods={
        "save_sharded_model": (
            "sglang.srt.managers.scheduler_components.weight_updater",
            "SchedulerWeightUpdaterManager",
            "save_sharded_model",
        )
    },
    tensor_reduction_patch=("sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions"),
    serializer=("sglang.srt.utils.common", "MultiprocessingSerializer", "serialize"),
    local_tensor=(
        "sglang.srt.model_executor.model_runner_components.weight_updater",
        "LocalSerializedTensor",
        "values",
    ),
    safe_unpickler=("sglang.srt.utils.common", "SafeUnpickler"),
    flattened_bucket=(
        "sglang.srt.weight_sync.tensor_bucket",
        "FlattenedTensorMetadata",
        "flattened_bucket",
    ),
)

# 0.5.17 has no weight-update session: Engine has neither begin_weight_update nor
# end_weight_update, and update_weights_from_tensor loads at once. Everything else is the same.
_CONTRACT_0_5_17 = dataclasses.replace(
    _CONTRACT_0_5_23,
    release="0.5.17",
    engine_methods={
        method: kwargs
        for method, kwargs in _CONTRACT_0_5_23.engine_methods.items()
        if method not in _SESSION_METHODS
    },
    returns_success_message=("update_weights_from_tensor",),
)

# The releases the adapter supports, oldest first: the GPU machines' (torch 2.11) and the worker
# image's. pyproject's sglang extra admits exactly these; a release between them is unchecked.
CONTRACTS: Mapping[str, SGLangContract] = {
    contract.release: contract for contract in (_CONTRACT_0_5_17, _CONTRACT_0_5_23)
}
SUPPORTED_SGLANG_VERSIONS = tuple(CONTRACTS)


class SGLangVersionError(RuntimeError):
    """The installed sglang is not a release this adapter is checked against."""


def contract_for(version: str) -> SGLangContract:
    """The contract of sglang `version`; a release outside CONTRACTS is refused, not guessed."""
    if version not in CONTRACTS:
        raise SGLangVersionError(
            f"sglang {version} is not supported: the SGLang adapter is checked against sglang "
            f"{' and '.join(SUPPORTED_SGLANG_VERSIONS)} only; install one of them "
            f"(pip install 'sglang=={SUPPORTED_SGLANG_VERSIONS[-1]}')"
        )
    return CONTRACTS[version]


def installed_contract() -> SGLangContract:
    """The contract of the sglang installed here (its distribution metadata; no import)."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SGLangVersionError(
            "rollout.engine=sglang needs sglang, which is not installed here: install "
            f"rljob[sglang] (sglang {' or '.join(SUPPORTED_SGLANG_VERSIONS)})"
        ) from None
    return contract_for(version)
