"""The SGLang rollout engine: `sglang.Engine` (a release listed in CONTRACTS, the range of
pyproject's sglang extra) behind the RolloutEngine interface, with tagged release/resume and
in-place weight updates.

Everything this adapter touches in sglang is declared per release, in CONTRACTS, and chosen at
run time from the installed release; tests/unit/test_sglang_contract.py checks every release's
contract against that release's own source, and tests/unit/test_sglang_engine.py drives the
adapter against a stand-in that refuses any call outside the contract of the release it imitates,
so a renamed method, argument, field or tag fails a CPU test, not a GPU job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import importlib.metadata
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rljob_worker.engines.base import (
    ALL_TAGS,
    TAG_CUDA_GRAPH,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    Completion,
    SamplingParams,
    token_ids,
)
from rljob_worker.engines.sglang_weights import (
    SHARD_PATTERN,
    DenseLayout,
    WeightShards,
    read_weights,
)
from rljob_worker.memory import LIBRARY_OOM_MARKERS
from rljob_worker.weight_sync import flatten, sglang_flattened_bucket

T = TypeVar("T")


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


def _request_params(sampling: SamplingParams, index: int) -> dict[str, Any]:
    """One request's sampling_params. A seed is offset per request: GRPO sends each prompt
    group_size times, and one seed for all would make a deterministic sampler answer each copy
    alike (sglang uses sampling_seed only with deterministic inference on)."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed + index
    return params


class SGLangEngineError(RuntimeError):
    """sglang refused a call (it answers with success=False instead of raising)."""


class SGLangProcessFailed(SGLangEngineError):
    """One of sglang's processes failed and signalled this one (SIGQUIT)."""


class SGLangProcessOutOfMemory(SGLangProcessFailed, torch.OutOfMemoryError):
    """An sglang process died of a CUDA OOM (its last words say so): a torch.OutOfMemoryError,
    so the stage boundary records it as the stage's CUDA OOM and the OOM policy can act on it."""


CHILD_FAILED_MESSAGE = (
    "an sglang process failed and signalled SIGQUIT; its own error is in the log above "
    "(sglang's scheduler logs it before it signals)"
)
# Set by _on_sglang_child_failure, never cleared: this process's engine lost a process.
_child_failed = threading.Event()

# What a child's stderr says when it died of a CUDA OOM: torch's OutOfMemoryError, the CUDA
# runtime's and driver's errors (torch_memory_saver resuming a region: "cudaError error: 2 (out of
# memory) ... func=resume", seen on an H100 with sglang 0.5.17, where the scheduler then exits 1
# with no Python traceback), and the CUDA libraries' failed workspaces the stage boundary counts
# as OOMs in this process (memory.LIBRARY_OOM_MARKERS). Not a bare "out of memory": sglang says
# that of its own pools too ("alloc_req_slots runs out of memory", "Prefill out of memory"),
# which a smaller memFractionStatic would make worse.
CHILD_OOM_MARKERS = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "(out of memory)",
    "OutOfMemoryError",
    "CUDA_ERROR_OUT_OF_MEMORY",
    "cudaErrorMemoryAllocation",
    *LIBRARY_OOM_MARKERS,
)
# torch_memory_saver's note on a cuMemCreate that the caller may still recover from: not a death.
CHILD_BENIGN_MARKERS = ("may not be an issue",)
CHILD_TAIL_BYTES = 64 << 10


class _ChildStderr:
    """The stderr sglang's processes inherit: a pipe whose every byte this process copies to its
    own stderr, keeping the last CHILD_TAIL_BYTES, so that when a child fails its last words can
    say why in the error (and in status) instead of only in the pod's log.

    Only the engine's start-up has it as fd 2 (the children are spawned then and keep it); this
    process's own stderr is its own again once the engine has started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tail = bytearray()
        self._pump_thread: threading.Thread | None = None
        self._inherited = False

    @contextlib.contextmanager
    def inherited(self) -> Iterator[None]:
        read_fd, write_fd = os.pipe()
        out_fd = os.dup(2)
        with self._lock:
            self._tail.clear()
        thread = threading.Thread(
            target=self._pump, args=(read_fd, out_fd), name="rljob-sglang-stderr", daemon=True
        )
        thread.start()
        self._pump_thread = thread
        sys.stderr.flush()
        os.dup2(write_fd, 2)
        self._inherited = True
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(out_fd, 2)
            os.close(write_fd)  # from now on only the children hold it: EOF when they are gone
            self._inherited = False

    def _pump(self, read_fd: int, out_fd: int) -> None:
        try:
            while chunk := os.read(read_fd, 65536):
                with self._lock:
                    self._tail += chunk
                    del self._tail[:-CHILD_TAIL_BYTES]
                view = memoryview(chunk)
                while view:
                    try:
                        view = view[os.write(out_fd, view) :]
                    except OSError:
                        break
        finally:
            os.close(read_fd)
            os.close(out_fd)

    def last_words(self, wait_seconds: float = 2.0) -> str:
        """The children's last output: waits (bounded) for the pipe's end once they are gone;
        during start-up this process still holds the pipe, so only briefly, for the pump."""
        thread = self._pump_thread
        if thread is not None:
            thread.join(wait_seconds if not self._inherited else 0.3)
        with self._lock:
            return self._tail.decode(errors="replace")


_child_stderr = _ChildStderr()


def child_failure_line(text: str) -> tuple[str | None, bool]:
    """(the line that says why a child failed, whether it is a CUDA OOM) from its last words:
    the last OOM line if any, else the last line naming an error; (None, False) if none does."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if any(m in line for m in CHILD_OOM_MARKERS) and not any(
            m in line for m in CHILD_BENIGN_MARKERS
        ):
            return line[:1000], True
    for line in reversed(lines):
        if "Error" in line or "Exception" in line:
            return line[:1000], False
    return None, False


def child_failure(call: str | None = None) -> SGLangProcessFailed:
    """The error for a failed sglang process: an SGLangProcessOutOfMemory where its last words
    name a CUDA OOM, else SGLangProcessFailed quoting its last error line where there is one."""
    where = f"Engine.{call}: " if call else ""
    line, oom = child_failure_line(_child_stderr.last_words())
    if oom:
        return SGLangProcessOutOfMemory(
            f"CUDA out of memory in an sglang process: {where}its last words: {line}"
        )
    if line is not None:
        return SGLangProcessFailed(
            f"{where}an sglang process failed and signalled SIGQUIT; its last error: {line}"
        )
    return SGLangProcessFailed(f"{where}{CHILD_FAILED_MESSAGE}")


def _on_sglang_child_failure(signum: int, frame: object) -> None:
    """sglang's processes send SIGQUIT to the engine's owner when they fail (a scheduler that
    cannot fit weights and a KV pool, a crash mid-run). sglang's own handler then kills the
    whole process tree, this process included, so the rank dies with -9 and no report (seen on
    an H100 with sglang 0.5.17). Instead: stop sglang's other processes and make the call that
    waits on them fail, so the error reaches the loop's error path with the stage it happened
    in.

    Outside sglang's event loop (its start-up waits in a plain poll) the handler raises there.
    Inside it (a call waiting in run_until_complete), raising would be lost: uvloop runs Python
    signal handlers from a loop callback and logs what they raise, and the call would wait for
    an answer no process will send (seen on an H100: a resume that ran out of memory). So the
    handler stops the loop; the waiting call then fails, and _Guarded raises
    SGLangProcessFailed for it.
    """
    import asyncio

    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    _child_failed.set()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise child_failure() from None
    # Through the loop's self-pipe: a handler run by the interpreter (not by uvloop) interrupts
    # the loop's poll, which would otherwise go on waiting with the loop already told to stop.
    loop.call_soon_threadsafe(loop.stop)


class _Guarded:
    """sglang.Engine whose calls, once one of its processes failed, raise SGLangProcessFailed
    (the call's own error, e.g. 'Event loop stopped before Future completed.', as the cause)."""

    def __init__(self, engine: Any) -> None:
        self._target = engine

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute

        def call(*args: Any, **kwargs: Any) -> Any:
            if _child_failed.is_set():
                raise child_failure(name)
            try:
                return attribute(*args, **kwargs)
            except Exception as error:
                if _child_failed.is_set():
                    raise child_failure(name) from error
                raise

        return call


def _reclaim_sigquit(engine: Any) -> None:
    """Put _on_sglang_child_failure back as this process's SIGQUIT handler.

    sglang's tokenizer manager, at its first request (auto_create_handle_loop, 0.5.17 and 0.5.23),
    installs its running-phase SIGQUIT handler on its asyncio loop, in place of the
    custom_sigquit_handler the engine was started with; that handler kills the whole process
    tree, this rank included. Seen on an H100 (sglang 0.5.17): a scheduler whose
    resume_memory_occupation ran out of device memory exited 1, sglang's subprocess watchdog sent
    SIGQUIT, and the rank died with -9 and no report, so no stage was named. Called once the
    engine has answered a request (the loop exists by then); only the main thread may set
    handlers, as in sglang.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    manager = getattr(engine, "tokenizer_manager", None)
    loop = getattr(manager, "event_loop", None)
    if loop is not None:
        loop.remove_signal_handler(signal.SIGQUIT)
    signal.signal(signal.SIGQUIT, _on_sglang_child_failure)


def _patch_tensor_reductions(contract: SGLangContract) -> None:
    """Make CUDA tensors this process hands to sglang travel by device UUID (idempotent).

    Tensors cross into the scheduler processes by CUDA IPC; sglang's own weight_sync/utils.py
    patches the producer side too (0.5.17 and 0.5.23), so a device stays right when the scheduler
    sees a different CUDA_VISIBLE_DEVICES than this process (Ray actors, a tensor-parallel
    group's union).
    """
    patch_module, patch_function = contract.tensor_reduction_patch
    getattr(importlib.import_module(patch_module), patch_function)()


def _load_engine_class() -> Callable[..., Any]:
    """Import sglang only when an engine is built: the module must import where sglang cannot."""
    contract = installed_contract()
    _patch_tensor_reductions(contract)
    _patch_running_phase_sigquit()
    return getattr(importlib.import_module(contract.engine_module), contract.engine_class)  # type: ignore[no-any-return]


# Where sglang keeps its running-phase SIGQUIT handler (0.5.17 and 0.5.23 alike; the contract
# test checks both sources): the tokenizer manager registers it on its event loop at its first
# request, and it kills the whole process tree.
RUNNING_PHASE_SIGQUIT = (
    "sglang.srt.managers.tokenizer_manager",
    "SignalHandler",
    "running_phase_sigquit_handler",
)


def _running_phase_sigquit_handler(self: Any, signum: Any = None, frame: Any = None) -> None:
    _on_sglang_child_failure(signal.SIGQUIT, frame)


def _patch_running_phase_sigquit() -> None:
    """Make sglang's running-phase SIGQUIT handler ours, before any engine registers it: putting
    our handler back after start-up (_reclaim_sigquit) was seen to lose, on an H100, to the
    handler sglang's loop had registered (the rank died with -9, no report). Idempotent."""
    module, cls, method = RUNNING_PHASE_SIGQUIT
    setattr(getattr(importlib.import_module(module), cls), method, _running_phase_sigquit_handler)


@dataclass(frozen=True)
class TensorHandoff:
    """How one rank hands its full tensors to a tensor-parallel engine's schedulers.

    `serialize(tensor)` turns a tensor into an IPC handle (bytes); `local_tensor(values=[...])`
    wraps one handle per TP rank, and TP rank i's scheduler loads values[i], a tensor on its
    own GPU, so no scheduler reads another GPU's memory.
    """

    serialize: Callable[[Any], bytes]
    local_tensor: Callable[..., Any]
    # sglang's FlattenedTensorMetadata where the flattened-bucket path is taken, else None:
    # then each rank serializes one {"flattened_tensor", "metadata"} per bucket instead.
    flattened_metadata: Callable[..., Any] | None = None


# RLJOB_SGLANG_WEIGHT_SYNC: "tensors" (the default: one tensor per parameter, the path the GPU
# tests verified), "auto" (flattened buckets where the installed sglang has them), or
# "flattened_bucket" (required: an error where sglang lacks it). The flattened path is opt-in
# until it has run on a GPU (docs/performance.md); bench/colocate.py --sync-path measures each.
WEIGHT_SYNC_ENV = "RLJOB_SGLANG_WEIGHT_SYNC"
WEIGHT_SYNC_PATHS = ("auto", "tensors", "flattened_bucket")
DEFAULT_WEIGHT_SYNC = "tensors"


def flattened_bucket_metadata(contract: SGLangContract) -> Callable[..., Any] | None:
    """sglang's metadata class of the flattened-bucket path, found by import (the feature, not
    the version number), or None where the path is not taken: RLJOB_SGLANG_WEIGHT_SYNC says
    "tensors", or (under "auto") the contract has none or the installed sglang lacks the class."""
    choice = os.environ.get(WEIGHT_SYNC_ENV, DEFAULT_WEIGHT_SYNC).strip().lower()
    choice = choice or DEFAULT_WEIGHT_SYNC
    if choice not in WEIGHT_SYNC_PATHS:
        raise ValueError(f"{WEIGHT_SYNC_ENV}={choice!r} must be one of {WEIGHT_SYNC_PATHS}")
    if choice == "tensors":
        return None
    found: Callable[..., Any] | None = None
    if contract.flattened_bucket is not None:
        module, cls, _load_format = contract.flattened_bucket
        try:
            found = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            found = None
    if found is None and choice == "flattened_bucket":
        raise SGLangVersionError(
            f"{WEIGHT_SYNC_ENV}=flattened_bucket, but sglang {contract.release} here has no "
            "flattened-bucket weight update (sglang.srt.weight_sync.tensor_bucket); unset it to "
            "hand over one tensor per parameter"
        )
    return found


def load_tensor_handoff() -> TensorHandoff:
    """sglang's own serializer and per-rank wrapper (the contract's serializer, local_tensor),
    and its flattened-bucket metadata where that path is taken (flattened_bucket_metadata)."""
    contract = installed_contract()
    _patch_tensor_reductions(contract)
    module, cls, method = contract.serializer
    serializer = getattr(importlib.import_module(module), cls)
    module, cls, _field = contract.local_tensor
    return TensorHandoff(
        serialize=getattr(serializer, method),
        local_tensor=getattr(importlib.import_module(module), cls),
        flattened_metadata=flattened_bucket_metadata(contract),
    )


class SGLangEngine:
    """One `sglang.Engine` in colocated mode (memory saver on), owned by this process.

    The engine spans `tp_size` GPUs starting at `base_gpu_id`. Right after start-up every tag is
    released: the colocated loop begins with training, which needs the memory. Release and resume
    are idempotent per tag (sglang itself is not: pausing twice or resuming a resident tag breaks
    its scheduler), and calls that would touch released memory raise here instead of crashing a
    scheduler process. `contract` is the installed release's unless given (a stand-in's).
    """

    def __init__(
        self,
        *,
        model_path: str,
        dtype: str,
        mem_fraction_static: float,
        tp_size: int = 1,
        base_gpu_id: int = 0,
        seed: int = 0,
        disable_cuda_graph: bool = False,
        engine_class: Callable[..., Any] | None = None,
        contract: SGLangContract | None = None,
        handoff: TensorHandoff | None = None,
    ) -> None:
        self._contract = contract = contract or installed_contract()
        # How buckets travel: flattened (one IPC handle per bucket) where sglang has that path,
        # else one tensor per parameter; found at the first update (load_tensor_handoff). With
        # an engine class given (a stand-in), only as told.
        self._handoff = handoff
        self._find_handoff = handoff is None and engine_class is None
        if dtype not in contract.server_arg_choices["dtype"]:
            raise ValueError(
                f"dtype={dtype!r} is not one of {contract.server_arg_choices['dtype']}"
            )
        if tp_size > 1:
            # Training shares these GPUs, so free memory differs across the TP ranks at start-up
            # (each holds its own FSDP shard and allocator cache); sglang's check that free memory
            # is balanced would refuse to start. 0.5.17 and 0.5.23 read
            # SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK (distributed/bootstrap.py); the older
            # SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK is copied or rewritten to other names, and
            # 0.5.17's SGLANG_DISABLE_... is declared but read nowhere. Set before the engine
            # exists: its processes inherit it.
            os.environ.update(contract.env)
        engine_class = engine_class or _load_engine_class()
        _child_failed.clear()  # a process starts an engine only once its last one is gone
        try:
            with _child_stderr.inherited():
                self._engine: Any = engine_class(
                    model_path=model_path,
                    dtype=dtype,
                    tp_size=tp_size,
                    base_gpu_id=base_gpu_id,
                    mem_fraction_static=mem_fraction_static,
                    # Weights, KV cache and CUDA graphs are allocated in torch_memory_saver regions, so
                    # they can be released and resumed at the same addresses (CUDA graphs stay valid).
                    enable_memory_saver=True,
                    random_seed=seed,
                    # Prompts arrive as token ids and responses leave as token ids: no detokenizer work.
                    skip_tokenizer_init=True,
                    disable_cuda_graph=disable_cuda_graph,
                    custom_sigquit_handler=_on_sglang_child_failure,
                )
        except Exception as error:
            # sglang reports a failed start (a scheduler that could not fit weights and a KV
            # pool, a kernel that would not load) as a bare exception from its launcher: say
            # which start it was and with what share of the device.
            raise SGLangEngineError(
                f"starting sglang.Engine (memFractionStatic={mem_fraction_static}, "
                f"tp_size={tp_size}, GPU {base_gpu_id}, model {model_path}) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        started = self._engine
        self._engine = _Guarded(started)
        # The KV pool is sized once, at start-up, from mem_fraction_static (scheduler init info).
        self._kv_capacity_tokens = int(self._engine.get_server_info()[contract.kv_capacity_key])
        self._released: set[str] = set()
        self._update_open = False
        # async_generate calls not yet answered: sglang refuses to release memory while a
        # request is queued or running, so release() refuses first, naming the count.
        self.requests_in_flight = 0
        self._model_path = model_path
        self._tp_size = tp_size
        self.release(ALL_TAGS)
        _reclaim_sigquit(started)

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV pool holds (sglang's max_total_num_tokens)."""
        return self._kv_capacity_tokens

    @property
    def released_tags(self) -> frozenset[str]:
        """Tags whose memory is given back right now."""
        return frozenset(self._released)

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[list[int]]:
        """Sample one response per prompt; needs weights, KV cache and CUDA graphs resident."""
        return token_ids(self.generate_with_logprobs(prompts, sampling))

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[Completion]:
        return self.generate_many([(prompts, sampling)])[0]

    def generate_many(
        self, batches: Sequence[tuple[Sequence[Sequence[int]], SamplingParams]]
    ) -> list[list[Completion]]:
        """Several ranks' batches, each with its own sampling, in one sglang call (one batch for
        the scheduler); answers come back per batch, in order, with each token's log-prob."""
        self._require_resident(ALL_TAGS, "generate")
        if self._update_open:
            raise RuntimeError("generate() during a weight update: call flush_cache() first")
        input_ids: list[list[int]] = []
        params: list[dict[str, Any]] = []
        for prompts, sampling in batches:
            for index, prompt in enumerate(prompts):
                input_ids.append(list(prompt))
                params.append(_request_params(sampling, index))
        if not input_ids:
            return [[] for _ in batches]
        outputs = self._engine.generate(
            input_ids=input_ids, sampling_params=params, return_logprob=True
        )
        # A batch answers with a list of dicts; a batch of one may come back as the dict itself.
        if isinstance(outputs, dict):
            outputs = [outputs]
        responses = [self._completion(out) for out in outputs]
        answers, start = [], 0
        for prompts, _ in batches:
            answers.append(responses[start : start + len(prompts)])
            start += len(prompts)
        return answers

    async def async_generate(
        self, input_ids: Sequence[int], sampling: SamplingParams
    ) -> Completion:
        """One request from asyncio code (the multi-turn rollout): sglang's Engine.async_generate
        awaits its tokenizer manager's coroutine, on the loop run_async runs. The answer carries
        the prompt tokens sglang found in its radix cache (meta_info cached_tokens)."""
        self._require_resident(ALL_TAGS, "async_generate")
        if self._update_open:
            raise RuntimeError("async_generate() during a weight update: call flush_cache() first")
        self.requests_in_flight += 1
        try:
            output = await self._engine.async_generate(
                input_ids=list(input_ids),
                sampling_params=_request_params(sampling, 0),
                return_logprob=True,
            )
        finally:
            self.requests_in_flight -= 1
        cached = output["meta_info"].get(self._contract.cached_tokens_key)
        return dataclasses.replace(
            self._completion(output), cached_tokens=None if cached is None else int(cached)
        )

    def run_async(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of async_generate calls to its end, on sglang's event loop: the one
        its Engine made (Engine.loop) and runs its own blocking calls on, where its tokenizer
        manager's receive loop lives. A stand-in without one gets a fresh loop."""
        loop = getattr(self._engine, "loop", None)
        if loop is None:
            return asyncio.run(coroutine)
        return loop.run_until_complete(coroutine)  # type: ignore[no-any-return]

    def _completion(self, output: Mapping[str, Any]) -> Completion:
        ids = list(output[self._contract.output_ids_key])
        entries = output["meta_info"][self._contract.output_logprobs_key]
        if len(entries) != len(ids):
            raise SGLangEngineError(
                f"sglang returned {len(entries)} token log-probs for {len(ids)} tokens"
            )
        return Completion(ids, [float(entry[0]) for entry in entries])

    def prompt_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Teacher-forced log-probs: for each sequence, log p(ids[i] | ids[:i]) for i >= 1."""
        return self.prompt_logprobs_many([sequences])[0]

    def prompt_logprobs_many(
        self, batches: Sequence[Sequence[Sequence[int]]]
    ) -> list[list[list[float]]]:
        """prompt_logprobs of several ranks' sequences in one sglang call, answered per batch."""
        self._require_resident(ALL_TAGS, "prompt_logprobs")
        if self._update_open:
            raise RuntimeError("prompt_logprobs() during a weight update: call flush_cache() first")
        flat = [list(ids) for batch in batches for ids in batch]
        if not flat:
            return [[] for _ in batches]
        # One greedy token each: sglang scores the whole input when logprob_start_len is 0.
        outputs = self._engine.generate(
            input_ids=flat,
            sampling_params=[{"max_new_tokens": 1, "temperature": 0.0} for _ in flat],
            return_logprob=True,
            logprob_start_len=0,
        )
        if isinstance(outputs, dict):
            outputs = [outputs]
        key = self._contract.input_logprobs_key
        scored = [[float(lp) for lp, *_ in out["meta_info"][key][1:]] for out in outputs]
        answers, start = [], 0
        for batch in batches:
            answers.append(scored[start : start + len(batch)])
            start += len(batch)
        return answers

    def dump_weights(self, directory: str) -> WeightShards:
        """Every TP rank's scheduler writes its weight shards into `directory` (this node's)."""
        self._require_resident((TAG_WEIGHTS,), "dump_weights")
        self._engine.save_sharded_model(path=directory, pattern=SHARD_PATTERN, max_size=None)
        return WeightShards(directory, DenseLayout.from_model(self._model_path, self._tp_size))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The engine's weights, full and on CPU, under the trainer's names (sglang_weights.py).

        Each call writes every TP rank's shards to a temporary directory and reads them back,
        about the model's size in bytes: for checks (`rljob run --verify-weights`, tests).
        """
        with tempfile.TemporaryDirectory(prefix="rljob-sglang-weights-") as directory:
            weights = read_weights(self.dump_weights(directory))
        return iter(weights.items())

    def release(self, tags: Sequence[str]) -> None:
        """Give the memory of these tags back (their contents are lost)."""
        todo = [t for t in self._known(tags) if t not in self._released]
        if not todo:
            return
        if self._update_open:
            raise RuntimeError("release() during a weight update: call flush_cache() first")
        if self.requests_in_flight:
            raise RuntimeError(
                f"release({todo}) with {self.requests_in_flight} async_generate requests in "
                "flight: sglang refuses to release memory while a request runs; finish or cut "
                "off every conversation first"
            )
        self._engine.release_memory_occupation(tags=todo)
        self._released.update(todo)

    def resume(self, tags: Sequence[str]) -> None:
        """Map memory back for these tags at their old addresses (contents undefined)."""
        todo = [t for t in self._known(tags) if t in self._released]
        if not todo:
            return
        self._engine.resume_memory_occupation(tags=todo)
        self._released.difference_update(todo)

    @property
    def flattened_buckets(self) -> bool:
        """Whether buckets go to sglang flattened (one buffer each) rather than per tensor."""
        if self._find_handoff:
            self._handoff, self._find_handoff = load_tensor_handoff(), False
        return self._handoff is not None and self._handoff.flattened_metadata is not None

    def flat_payload(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> bytes:
        """One bucket as sglang's flattened-bucket payload: one IPC handle for its buffer."""
        assert self._handoff is not None and self._handoff.flattened_metadata is not None
        metadata = self._handoff.flattened_metadata
        return self._handoff.serialize(sglang_flattened_bucket(flatten(bucket), metadata))

    def update_weights(self, bucket: Iterable[tuple[str, torch.Tensor | Any]]) -> None:
        """Load one bucket of full tensors into the resident weights, in place.

        sglang 0.5.23 loads tensors only inside a weight-update session: there the first bucket
        opens one and flush_cache() closes it; 0.5.17 has no session and loads at once. Where
        the flattened-bucket path is taken, the bucket travels as one buffer (every TP rank's
        scheduler opens the same handle); otherwise a value is a tensor (every TP rank's
        scheduler opens it by CUDA IPC) or, from a TensorParallelEngine, a
        TensorHandoff.local_tensor holding one handle per TP rank, each on that rank's GPU.
        """
        named_tensors = list(bucket)
        if not named_tensors:
            return
        if self.flattened_buckets and all(isinstance(t, torch.Tensor) for _, t in named_tensors):
            payload = self.flat_payload(named_tensors)
            self.update_weights_flattened([payload] * self._tp_size)
            return
        self._load(named_tensors, None)

    def update_weights_flattened(self, payloads: Sequence[bytes]) -> None:
        """Load one bucket given as one flattened-bucket payload per TP rank (flat_payload on
        the rank whose GPU that TP rank runs on)."""
        if len(payloads) != self._tp_size:
            raise ValueError(f"{len(payloads)} payloads for tp_size {self._tp_size}")
        assert self._contract.flattened_bucket is not None
        self._load(list(payloads), self._contract.flattened_bucket[2])

    def _load(self, named_tensors: list[Any], load_format: str | None) -> None:
        self._require_resident((TAG_WEIGHTS,), "update_weights")
        if not self._update_open:
            if self._contract.opens_weight_update_session:
                result = self._engine.begin_weight_update()
                self._check_success_message("begin_weight_update", result)
            self._update_open = True
        result = self._engine.update_weights_from_tensor(
            named_tensors=named_tensors,
            load_format=load_format,
            # One flush after the last bucket (flush_cache below), not one per bucket.
            flush_cache=False,
        )
        self._check_success_message("update_weights_from_tensor", result)

    def flush_cache(self) -> None:
        """Close the weight update, if one is open, and drop prefixes cached with old weights.

        Safe with the KV cache released: sglang flushes inside its own KV release too.
        """
        if self._update_open:
            self._update_open = False
            if self._contract.opens_weight_update_session:
                self._check_success_message("end_weight_update", self._engine.end_weight_update())
        result = self._engine.flush_cache()
        if not getattr(result, "success", False):
            message = getattr(result, "message", "")
            raise SGLangEngineError(f"sglang flush_cache failed: {message or result!r}")

    def shutdown(self) -> None:
        """Stop sglang's processes; idempotent. After one of them failed, the failure handler
        has stopped them all already: nothing to call, and no second error to mask the first."""
        engine, self._engine = self._engine, None
        if engine is not None and not _child_failed.is_set():
            engine.shutdown()

    def _known(self, tags: Sequence[str]) -> list[str]:
        unknown = [t for t in tags if t not in ALL_TAGS]
        if unknown:
            raise ValueError(f"unknown memory tags {unknown}; known: {list(ALL_TAGS)}")
        # Keep the caller's order but drop repeats.
        return list(dict.fromkeys(tags))

    def _require_resident(self, tags: Sequence[str], what: str) -> None:
        missing = [t for t in tags if t in self._released]
        if missing:
            raise RuntimeError(f"{what}() needs {missing} resident: call resume({missing}) first")

    @staticmethod
    def _check_success_message(method: str, result: Any) -> None:
        success, message = result
        if not success:
            raise SGLangEngineError(f"sglang {method} failed: {message}")
