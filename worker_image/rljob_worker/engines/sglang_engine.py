"""The SGLang rollout engine: `sglang.Engine` (a release listed in CONTRACTS, the range of
pyproject's sglang extra) behind the RolloutEngine interface, with tagged release/resume and
in-place weight updates.

Everything this adapter touches in sglang is declared per release, in CONTRACTS, and chosen at
run time from the installed release; tests/unit/test_sglang_contract.py checks every release's
contract against that release's own source, and tests/unit/test_sglang_engine.py drives the
adapter against a stand-in that refuses any call outside the contract of the release it imitates,
so a renamed method, argument, field or tag fails a CPU test, not a GPU job.

The parts live apart: the release contracts in sglang_contract.py, sglang's processes (their
stderr, the errors their failure becomes) in sglang_process.py, the tensor hand-off to the
schedulers in sglang_handoff.py. This module keeps the adapter and the SIGQUIT handlers its
start-up installs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from rljob_worker.engines.base import (
    ALL_TAGS,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    ColocatedEngine,
    Completion,
    SamplingParams,
    request_seed,
)
from rljob_worker.engines.sglang_contract import (
    _CONTRACT_0_5_17,
    _CONTRACT_0_5_23,
    _SESSION_METHODS,
    CONTRACTS,
    SUPPORTED_SGLANG_VERSIONS,
    SGLangContract,
    SGLangVersionError,
    contract_for,
    installed_contract,
)
from rljob_worker.engines.sglang_direct import DIRECT_LOADER, payload_name
from rljob_worker.engines.sglang_handoff import (
    DEFAULT_WEIGHT_SYNC,
    WEIGHT_SYNC_ENV,
    WEIGHT_SYNC_PATHS,
    TensorHandoff,
    _patch_tensor_reductions,
    direct_chosen,
    flattened_bucket_metadata,
    load_tensor_handoff,
    weight_sync_choice,
)
from rljob_worker.engines.sglang_process import (
    CHILD_BENIGN_MARKERS,
    CHILD_FAILED_MESSAGE,
    CHILD_OOM_MARKERS,
    CHILD_TAIL_BYTES,
    SGLangEngineError,
    SGLangProcessFailed,
    SGLangProcessOutOfMemory,
    _child_failed,
    _child_stderr,
    _ChildStderr,
    _Guarded,
    child_failure,
    child_failure_line,
)
from rljob_worker.engines.sglang_weights import (
    SHARD_PATTERN,
    DenseLayout,
    WeightShards,
    read_weights,
)
from rljob_worker.tp_shards import STORED_NAME
from rljob_worker.weight_sync import (
    GatheredBucket,
    flatten,
    ipc_alias,
    record_span,
    sglang_flattened_bucket,
)

# Every name this module offered before its contract, process and hand-off parts moved out
# (sglang_contract.py, sglang_process.py, sglang_handoff.py): importable from here as before.
__all__ = [
    "CHILD_BENIGN_MARKERS",
    "CHILD_FAILED_MESSAGE",
    "CHILD_OOM_MARKERS",
    "CHILD_TAIL_BYTES",
    "CONTRACTS",
    "DEFAULT_WEIGHT_SYNC",
    "RUNNING_PHASE_SIGQUIT",
    "SUPPORTED_SGLANG_VERSIONS",
    "WEIGHT_SYNC_ENV",
    "WEIGHT_SYNC_PATHS",
    "_CONTRACT_0_5_17",
    "_CONTRACT_0_5_23",
    "_SESSION_METHODS",
    "SGLangContract",
    "SGLangEngine",
    "SGLangEngineError",
    "SGLangProcessFailed",
    "SGLangProcessOutOfMemory",
    "SGLangVersionError",
    "TensorHandoff",
    "_ChildStderr",
    "_Guarded",
    "_child_failed",
    "_child_stderr",
    "_load_engine_class",
    "_on_sglang_child_failure",
    "_patch_running_phase_sigquit",
    "_patch_tensor_reductions",
    "_reclaim_sigquit",
    "_request_params",
    "_running_phase_sigquit_handler",
    "child_failure",
    "child_failure_line",
    "contract_for",
    "flattened_bucket_metadata",
    "installed_contract",
    "load_tensor_handoff",
    "weight_sync_choice",
]

T = TypeVar("T")


def _request_params(sampling: SamplingParams, index: int) -> dict[str, Any]:
    """One request's sampling_params. A seed is its own per request (request_seed): GRPO sends
    each prompt group_size times, and one seed for all would make a deterministic sampler answer
    each copy alike (sglang uses sampling_seed only with deterministic inference on)."""
    params: dict[str, Any] = {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = request_seed(sampling.seed, index)
    return params


# The SIGQUIT handlers stay beside the adapter that installs them: the running-phase handler
# calls _on_sglang_child_failure by this module's name for it, which a test replaces.
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


ENGINE_ARGS_ENV = "RLJOB_SGLANG_ENGINE_ARGS"
# ServerArgs fields the pass-through refuses: those SGLangEngine sets itself (staged awake,
# token ids in and out, the weight hand-off and the failure handling depend on them), the
# context the loop sizes every request by (the model's max_position_embeddings), and the
# layouts an engine of one rank or one TP group cannot take (data/pipeline parallel, nodes).
OWN_ENGINE_ARGS = frozenset({
    "model_path", "dtype", "tp_size", "base_gpu_id", "mem_fraction_static", "enable_memory_saver",
    "random_seed", "skip_tokenizer_init", "disable_cuda_graph", "custom_sigquit_handler",
    "custom_weight_loader", "load_format", "context_length", "dp_size", "pp_size", "nnodes",
    "node_rank", "dist_init_addr",
})  # fmt: skip


def extra_engine_args(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """More sglang ServerArgs for every engine this process starts: RLJOB_SGLANG_ENGINE_ARGS, a
    JSON object (e.g. '{"enable_mixed_chunk": true}'). A name sglang does not know fails the
    engine's start with sglang's own message; the fields rljob sets itself are refused here."""
    raw = (os.environ if environ is None else environ).get(ENGINE_ARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        extra = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(f"{ENGINE_ARGS_ENV} is not JSON ({error}): {raw!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(f"{ENGINE_ARGS_ENV} must be a JSON object of ServerArgs fields: {raw!r}")
    own = sorted(OWN_ENGINE_ARGS & extra.keys())
    if own:
        raise ValueError(
            f"{ENGINE_ARGS_ENV} sets {', '.join(own)}: rljob sets these itself or cannot run "
            "with them (docs/volumes-and-env.md)"
        )
    return extra


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


class SGLangEngine(ColocatedEngine):
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
        event_loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        # RLJOB_SGLANG_ENGINE_ARGS, checked before anything starts (a bad value is the
        # variable's error, not a failed engine start).
        extra = extra_engine_args()
        self._contract = contract = contract or installed_contract()
        # How buckets travel: flattened (one IPC handle per bucket) where sglang has that path,
        # else one tensor per parameter; found at the first update (load_tensor_handoff). With
        # an engine class given (a stand-in), only as told.
        self._handoff = handoff
        self._find_handoff = handoff is None and engine_class is None
        # The direct path needs rljob's loader declared to sglang at start-up (the schedulers
        # run only loaders named in ServerArgs.custom_weight_loader).
        self._direct = (
            handoff.direct
            if handoff is not None
            else (engine_class is None and direct_chosen(contract))
        )
        if self._direct and contract.direct_loader is None:
            raise SGLangVersionError(
                f"the direct weight hand-off, but sglang {contract.release} runs no custom weight "
                f"loader; set {WEIGHT_SYNC_ENV}=tensors"
            )
        loaders = (
            {contract.direct_loader[0]: [DIRECT_LOADER]}
            if contract.direct_loader and self._direct
            else {}
        )
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
                    **loaders,
                    **extra,
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
        if event_loop is not None:
            # Several engines in one process (bench/multi_turn.py --engines 2): sglang's Engine
            # makes a loop of its own (Engine.loop) and its tokenizer manager starts its receive
            # loop on the loop running its first request, which is Engine.loop. A rollout awaits
            # every engine's answers on one loop, so an engine whose receive loop lives on
            # another never answers (seen on an H100: two engines, the first request waited
            # until the call's limit). Give them one loop before the first request (below).
            started.loop = event_loop
            asyncio.set_event_loop(event_loop)
        self._engine = _Guarded(started)
        # The KV pool is sized once, at start-up, from mem_fraction_static (scheduler init info).
        self._kv_capacity_tokens = int(self._engine.get_server_info()[contract.kv_capacity_key])
        self._released: set[str] = set()
        self._update_open = False
        # The open update's first request also dropped the prefix cache (sglang flushes after
        # loading it); flush_cache() then only closes the update (see _load).
        self._flushed_with_update = False
        # async_generate calls not yet answered: sglang refuses to release memory while a
        # request is queued or running, so release() refuses first, naming the count.
        self.requests_in_flight = 0
        self._model_path = model_path
        self._tp_size = tp_size
        self.release(ALL_TAGS)
        _reclaim_sigquit(started)

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
        reason = output["meta_info"].get("finish_reason") or {}
        aborted = isinstance(reason, Mapping) and reason.get("type") == "abort"
        return dataclasses.replace(
            self._completion(output, aborted),
            cached_tokens=None if cached is None else int(cached),
            aborted=aborted,
        )

    def abort_requests(self) -> None:
        """Every request sent so far ends: sglang's tokenizer manager aborts them all (a queued
        one answers no tokens, a running one what it has sampled, finish_reason abort), as its
        server's /abort_request does. The partial rollout's stop (agentic/driver.py)."""
        method, keyword = self._contract.abort[2:]
        getattr(self._engine.tokenizer_manager, method)(**{keyword: True})

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop sglang's Engine runs its calls and its answers on (Engine.loop); pass it as
        `event_loop` to the next engine of this process. None for a stand-in without one."""
        return getattr(self._engine, "loop", None)

    def run_async(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine of async_generate calls to its end, on sglang's event loop: the one
        its Engine made (Engine.loop) and runs its own blocking calls on, where its tokenizer
        manager's receive loop lives. A stand-in without one gets a fresh loop."""
        loop = getattr(self._engine, "loop", None)
        if loop is None:
            return asyncio.run(coroutine)
        return loop.run_until_complete(coroutine)  # type: ignore[no-any-return]

    def _completion(self, output: Mapping[str, Any], aborted: bool = False) -> Completion:
        # An abort's answer may have no ids at all (one aborted while queued, in some releases).
        ids = (
            list(output.get(self._contract.output_ids_key) or [])
            if aborted
            else list(output[self._contract.output_ids_key])
        )
        entries = output["meta_info"].get(self._contract.output_logprobs_key) or []
        if aborted:  # stopped mid-way: the tokens that have their log-probs
            ids = ids[: len(entries)]
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

    @property
    def casts_weights(self) -> bool:
        """Whether a bucket may come in another dtype than the engine's: rljob's loader in the
        schedulers copies it into the weights, which casts (sglang_direct.py); sglang's own
        loaders are handed the engine's dtype."""
        return self._direct

    @property
    def direct_buckets(self) -> bool:
        """Whether buckets go to rljob's loader in the schedulers (sglang_direct.py)."""
        return self._direct

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
        On the direct path a bucket may be in another floating dtype than the engine's (the
        trainer's fp32 buffer, casts_weights): rljob's loader casts as it copies; a tensor its
        rules do not place goes to the model's load_weights in that dtype (sglang's own loaders
        copy_, which casts).
        """
        # A GatheredBucket keeps its worked-out layout for flatten(); any other iterable is
        # listed once.
        named_tensors = bucket if isinstance(bucket, GatheredBucket) else list(bucket)
        if not named_tensors:
            return
        tensors = isinstance(named_tensors, GatheredBucket) or all(
            isinstance(t, torch.Tensor) for _, t in named_tensors
        )
        if self._direct and tensors:
            flat = flatten(named_tensors)
            self.update_weights_direct(payload_name(flat), ipc_alias(flat.buffer))
            return
        if self.flattened_buckets and tensors:
            payload = self.flat_payload(named_tensors)
            self.update_weights_flattened([payload] * self._tp_size)
            return
        self._load(list(named_tensors), None)

    def update_weights_flattened(self, payloads: Sequence[bytes]) -> None:
        """Load one bucket given as one flattened-bucket payload per TP rank (flat_payload on
        the rank whose GPU that TP rank runs on)."""
        if len(payloads) != self._tp_size:
            raise ValueError(f"{len(payloads)} payloads for tp_size {self._tp_size}")
        assert self._contract.flattened_bucket is not None
        self._load(list(payloads), self._contract.flattened_bucket[2])

    def update_weights_direct(
        self, name: str, buffer: torch.Tensor | Any, stored: torch.Tensor | Any = None
    ) -> None:
        """Load one bucket through rljob's loader in the schedulers: `buffer` is its flat buffer
        (every TP rank opens the same) or a TensorHandoff.local_tensor of one per TP rank, and
        `name` its layout (sglang_direct.payload_name, or a tp_shards payload). `stored`: a
        sharded bucket's own blocks as the trainer stores them (a local_tensor of one per TP
        rank), handed just before it under tp_shards.STORED_NAME."""
        if not self._direct:
            raise SGLangEngineError(
                "update_weights_direct on an engine started without rljob's direct loader "
                f"({WEIGHT_SYNC_ENV}=direct must be set before the engine starts)"
            )
        if stored is None:
            self._load([(name, buffer)], DIRECT_LOADER)
        else:
            self._load([(STORED_NAME, stored), (name, buffer)], DIRECT_LOADER)

    def _load(self, named_tensors: list[Any], load_format: str | None) -> None:
        self._require_resident((TAG_WEIGHTS,), "update_weights")
        if self.requests_in_flight:
            raise RuntimeError(
                f"update_weights with {self.requests_in_flight} async_generate requests in "
                "flight: weights change only between rollouts"
            )
        # Where there is no update session (0.5.17), no flush request of its own: with the KV
        # cache released (staged awake) sglang emptied the prefix cache in that release, and
        # nothing can be served until the cache is back and flush_cache() closes the update, so
        # none is needed; with the KV cache resident, the update's first request drops the
        # prefixes itself, after its load (no request can be served until flush_cache(), so
        # nothing is cached meanwhile). Either way the sync saves the flush's trip through
        # sglang's processes (1.4-1.9 ms at 3B on an H200, docs/weight-sync-figures.md). That in-update
        # flush leaves the scheduler's allocator cache to the next release (the standalone
        # flush also empties it; the loaders allocate nothing there), and sglang asserts it
        # succeeded: refused above while a request is in flight. Inside 0.5.23's session,
        # flush_cache() sends the flush after end_weight_update as before.
        flush = False
        if not self._update_open:
            if self._contract.opens_weight_update_session:
                result = self._engine.begin_weight_update()
                self._check_success_message("begin_weight_update", result)
            elif TAG_KV_CACHE in self._released:
                self._flushed_with_update = True  # emptied by the KV cache's release
            else:
                flush = True
            self._update_open = True
        sent = time.time()
        result = self._engine.update_weights_from_tensor(
            named_tensors=named_tensors, load_format=load_format, flush_cache=flush
        )
        record_span("update", sent, time.time())
        self._check_success_message("update_weights_from_tensor", result)
        self._flushed_with_update |= flush

    def flush_cache(self) -> None:
        """Close the weight update, if one is open, and drop prefixes cached with old weights.

        Where the update's first request dropped them already (_load), no request is sent.
        Safe with the KV cache released: sglang flushes inside its own KV release too.
        """
        if self._update_open:
            self._update_open = False
            if self._flushed_with_update:
                self._flushed_with_update = False
                return
            if self._contract.opens_weight_update_session:
                self._check_success_message("end_weight_update", self._engine.end_weight_update())
        sent = time.time()
        result = self._engine.flush_cache()
        record_span("flush", sent, time.time())
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
