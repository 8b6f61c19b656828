"""The SGLang adapter's calls, per stage, against a recording stand-in for sglang.Engine.

sglang.Engine needs CUDA, so it cannot run here. The stand-in imitates one supported release: it
accepts only the methods and keywords of that release's contract (which test_sglang_contract.py
checks against the release's source) and models the sglang state rules the adapter must respect.
Tests that hold for every supported release run once per release.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.sglang_standin import (
    KV_CAPACITY,
    NEWEST,
    SGLangEngineStandIn,
    staged_iteration_calls,
)

from rljob.api import RLJobSpec
from rljob_worker.engines import make_engine
from rljob_worker.engines import sglang_engine as sglang_module
from rljob_worker.engines.base import (
    ALL_TAGS,
    TAG_CUDA_GRAPH,
    TAG_KV_CACHE,
    TAG_WEIGHTS,
    RolloutEngine,
    SamplingParams,
)
from rljob_worker.engines.sglang_engine import (
    CONTRACTS,
    ENGINE_ARGS_ENV,
    SUPPORTED_SGLANG_VERSIONS,
    SGLangContract,
    SGLangEngine,
    SGLangEngineError,
    SGLangVersionError,
    extra_engine_args,
    installed_contract,
)
from rljob_worker.engines.sglang_weights import SHARD_PATTERN, EngineWeightsError
from rljob_worker.loop import tensor_digest

ENV_SWITCH = next(iter(NEWEST.env))
# Run a test once per supported release, the stand-in imitating it.
every_release = pytest.mark.parametrize("release", SUPPORTED_SGLANG_VERSIONS)


def make_adapter(
    contract: SGLangContract = NEWEST, **overrides: Any
) -> tuple[SGLangEngine, SGLangEngineStandIn]:
    holder: list[SGLangEngineStandIn] = []

    def engine_class(**kwargs: Any) -> SGLangEngineStandIn:
        holder.append(SGLangEngineStandIn(contract=contract, **kwargs))
        return holder[0]

    options: dict[str, Any] = {
        "model_path": "/models/qwen",
        "dtype": "bfloat16",
        "mem_fraction_static": 0.9,
    }
    engine = SGLangEngine(**{**options, **overrides}, engine_class=engine_class, contract=contract)
    return engine, holder[0]


def bucket(*names: str) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(2)) for name in names]


SAMPLING = SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20, seed=3)


def test_engine_starts_colocated_with_spec_knobs_then_releases_every_tag() -> None:
    engine, sgl = make_adapter(tp_size=1, base_gpu_id=3, seed=11)
    name, kwargs = sgl.calls[0]
    assert name == "__init__"
    assert kwargs["enable_memory_saver"] is True
    assert kwargs["mem_fraction_static"] == 0.9
    assert (kwargs["tp_size"], kwargs["base_gpu_id"], kwargs["random_seed"]) == (1, 3, 11)
    assert kwargs["dtype"] == "bfloat16"
    assert sgl.calls[1:] == [
        ("get_server_info", {}),
        ("release_memory_occupation", {"tags": list(ALL_TAGS)}),
    ]
    assert engine.kv_capacity_tokens == KV_CAPACITY
    assert engine.released_tags == frozenset(ALL_TAGS)
    assert isinstance(engine, RolloutEngine)


@every_release
def test_staged_wake_up_calls_sglang_in_stage_order_for_two_iterations(release: str) -> None:
    engine, sgl = make_adapter(CONTRACTS[release])
    start = len(sgl.calls)
    for _ in range(2):
        engine.resume([TAG_WEIGHTS])  # wake_weights
        engine.update_weights(bucket("a", "b"))
        engine.update_weights(bucket("c"))
        engine.flush_cache()
        engine.resume([TAG_KV_CACHE, TAG_CUDA_GRAPH])  # wake_kv_cache
        assert engine.generate([[1, 2, 3], [4]], SAMPLING) == [[3, 7], [1, 7]]
        engine.release(ALL_TAGS)  # sleep
    per_iteration = staged_iteration_calls(buckets=2, contract=CONTRACTS[release])
    assert sgl.names()[start:] == per_iteration * 2
    calls = dict(enumerate(sgl.calls[start : start + len(per_iteration)]))
    updates = [kw for n, kw in calls.values() if n == "update_weights_from_tensor"]
    resumes = [kw for n, kw in calls.values() if n == "resume_memory_occupation"]
    (generate,) = [kw for n, kw in calls.values() if n == "generate"]
    (release_call,) = [kw for n, kw in calls.values() if n == "release_memory_occupation"]
    assert resumes == [{"tags": [TAG_WEIGHTS]}, {"tags": [TAG_KV_CACHE, TAG_CUDA_GRAPH]}]
    assert [n for n, _ in updates[0]["named_tensors"]] == ["a", "b"]
    # No flush in any update request: the KV cache's release emptied the prefix cache (staged
    # awake), and 0.5.17 sends no flush of its own either (staged_iteration_calls); 0.5.23
    # flushes once, after its session.
    assert [kw["flush_cache"] for kw in updates] == [False, False]
    # One sampling_params dict per request; each request its own seed (the batch's is 3).
    seeds = [3 << 20, (3 << 20) + 1]
    assert generate["sampling_params"] == [
        {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "sampling_seed": s}
        for s in seeds
    ]
    assert release_call == {"tags": list(ALL_TAGS)}
    assert sgl.offloaded == set(ALL_TAGS)
    # The behaviour log-probs are asked for with every rollout (the PPO ratio's denominator).
    assert generate["return_logprob"] is True


def test_0_5_23_weight_update_runs_inside_one_session_per_wake_up() -> None:
    # sglang 0.5.23 refuses update_weights_from_tensor outside begin/end_weight_update().
    engine, sgl = make_adapter(CONTRACTS["0.5.23"])
    engine.resume([TAG_WEIGHTS])
    start = len(sgl.calls)
    engine.update_weights(bucket("a"))
    assert sgl.session_open
    engine.update_weights(bucket("b"))
    engine.flush_cache()
    assert not sgl.session_open
    assert sgl.names()[start:] == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
    ]
    assert sorted(sgl.loaded) == ["a", "b"]


def test_0_5_17_has_no_weight_update_session_and_the_adapter_updates_without_one() -> None:
    # sglang 0.5.17's Engine has neither begin_weight_update nor end_weight_update (the stand-in
    # refuses them, as the release would with AttributeError); its update loads at once.
    engine, sgl = make_adapter(CONTRACTS["0.5.17"])
    with pytest.raises(AttributeError, match=r"not in sglang 0\.5\.17's contract"):
        sgl.begin_weight_update  # noqa: B018
    engine.resume(ALL_TAGS)
    start = len(sgl.calls)
    engine.update_weights(bucket("a"))
    engine.update_weights(bucket("b"))
    # Still no generate() before the flush that drops prefixes cached with the old weights.
    with pytest.raises(RuntimeError, match="flush_cache"):
        engine.generate([[1]], SAMPLING)
    engine.flush_cache()
    # The first update's request flushed the prefix cache after its load: no flush request.
    assert sgl.names()[start:] == ["update_weights_from_tensor", "update_weights_from_tensor"]
    assert [kw["flush_cache"] for _, kw in sgl.calls[start:]] == [True, False]
    assert sorted(sgl.loaded) == ["a", "b"]


@every_release
def test_single_wake_up_resumes_weights_and_kv_cache_in_one_call(release: str) -> None:
    engine, sgl = make_adapter(CONTRACTS[release])
    start = len(sgl.calls)
    for _ in range(2):
        engine.resume(ALL_TAGS)
        engine.update_weights(bucket("a"))
        engine.flush_cache()
        engine.generate([[1]], SAMPLING)
        engine.release(ALL_TAGS)
    resumes = [kw for n, kw in sgl.calls[start:] if n == "resume_memory_occupation"]
    assert resumes == [{"tags": list(ALL_TAGS)}] * 2


def test_engine_args_from_the_environment_reach_sglangs_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    given: list[dict[str, Any]] = []

    def engine_class(**kwargs: Any) -> SGLangEngineStandIn:
        given.append(kwargs)
        # The stand-in, like sglang's ServerArgs, takes only fields it knows: not this one.
        return SGLangEngineStandIn(
            contract=NEWEST, **{k: v for k, v in kwargs.items() if k != "enable_mixed_chunk"}
        )

    monkeypatch.setenv(ENGINE_ARGS_ENV, '{"enable_mixed_chunk": true}')
    SGLangEngine(model_path="/m", dtype="bfloat16", mem_fraction_static=0.5,
                 engine_class=engine_class, contract=NEWEST)  # fmt: skip
    assert given[0]["enable_mixed_chunk"] is True and given[0]["dtype"] == "bfloat16"
    # A field sglang does not take fails the start, and the error names it.
    monkeypatch.setenv(ENGINE_ARGS_ENV, '{"no_such_field": 1}')
    with pytest.raises(SGLangEngineError, match="no_such_field"):
        make_adapter()
    monkeypatch.setenv(ENGINE_ARGS_ENV, " ")
    assert extra_engine_args() == {}
    # A malformed value is the variable's own error, before sglang is asked to start.
    monkeypatch.setenv(ENGINE_ARGS_ENV, '{"context_length": 4096}')
    given.clear()
    with pytest.raises(ValueError, match="sets context_length") as raised:
        SGLangEngine(model_path="/m", dtype="bfloat16", mem_fraction_static=0.5,
                     engine_class=engine_class, contract=NEWEST)  # fmt: skip
    assert not isinstance(raised.value, SGLangEngineError) and given == []


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("[1]", "must be a JSON object"),
        ("{nope", "is not JSON"),
        ('{"mem_fraction_static": 0.5, "dtype": "float16"}', "sets dtype, mem_fraction_static"),
        ('{"enable_memory_saver": false}', "sets enable_memory_saver: rljob sets these"),
        ('{"dp_size": 2, "max_running_requests": 8}', "sets dp_size: "),
    ],
)
def test_engine_args_that_are_not_an_object_or_set_rljobs_own_fields_are_refused(
    value: str, error: str
) -> None:
    with pytest.raises(ValueError, match=error):
        extra_engine_args({ENGINE_ARGS_ENV: value})


def test_release_and_resume_send_only_tags_that_change_state() -> None:
    engine, sgl = make_adapter()
    start = len(sgl.calls)
    engine.release(ALL_TAGS)  # already released at start-up: nothing to send
    engine.resume([TAG_WEIGHTS])
    engine.resume([TAG_WEIGHTS, TAG_KV_CACHE])
    assert sgl.calls[start:] == [
        ("resume_memory_occupation", {"tags": [TAG_WEIGHTS]}),
        ("resume_memory_occupation", {"tags": [TAG_KV_CACHE]}),
    ]


def test_update_weights_with_weights_released_raises_without_calling_sglang() -> None:
    engine, sgl = make_adapter()
    start = len(sgl.calls)
    with pytest.raises(RuntimeError, match=r"resume\(\['weights'\]\)"):
        engine.update_weights(bucket("a"))
    assert sgl.calls[start:] == []


@every_release
def test_generate_with_logprobs_reads_each_tokens_logprob_from_meta_info(release: str) -> None:
    engine, _ = make_adapter(CONTRACTS[release])
    engine.resume([TAG_WEIGHTS])
    engine.update_weights(bucket("a"))
    engine.flush_cache()
    engine.resume([TAG_KV_CACHE, TAG_CUDA_GRAPH])
    # The stand-in answers [len(prompt), 7] with log-probs (-len(prompt) / 10, -0.7).
    completions = engine.generate_with_logprobs([[1, 2, 3], [4]], SAMPLING)
    assert [c.token_ids for c in completions] == [[3, 7], [1, 7]]
    assert [c.logprobs for c in completions] == [[-0.3, -0.7], [-0.1, -0.7]]


def test_generate_with_kv_cache_released_raises_without_calling_sglang() -> None:
    engine, sgl = make_adapter()
    engine.resume([TAG_WEIGHTS])
    start = len(sgl.calls)
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.generate([[1]], SAMPLING)
    assert sgl.calls[start:] == []


def test_generate_before_flush_after_an_update_raises() -> None:
    engine, _ = make_adapter()
    engine.resume(ALL_TAGS)
    engine.update_weights(bucket("a"))
    with pytest.raises(RuntimeError, match="flush_cache"):
        engine.generate([[1]], SAMPLING)


@pytest.mark.parametrize(
    ("release", "method"),
    [
        ("0.5.17", "update_weights_from_tensor"),
        ("0.5.23", "begin_weight_update"),
        ("0.5.23", "update_weights_from_tensor"),
    ],
)
def test_sglang_refusing_a_weight_update_raises_with_its_message(release: str, method: str) -> None:
    engine, sgl = make_adapter(CONTRACTS[release])
    engine.resume([TAG_WEIGHTS])
    sgl.refuse[method] = "shape mismatch for a"
    with pytest.raises(SGLangEngineError, match=f"{method} failed: shape mismatch for a"):
        engine.update_weights(bucket("a"))


def test_sglang_refusing_flush_cache_raises_with_its_message() -> None:
    engine, sgl = make_adapter()
    sgl.refuse["flush_cache"] = "requests are still running"
    with pytest.raises(SGLangEngineError, match="requests are still running"):
        engine.flush_cache()


def test_unknown_tag_is_refused() -> None:
    engine, _ = make_adapter()
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.resume(["weight"])


@every_release
def test_tensor_parallel_engine_turns_off_sglang_memory_balance_check(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both releases read the same switch (the contract test checks where).
    assert CONTRACTS[release].env == {ENV_SWITCH: "false"}
    monkeypatch.delenv(ENV_SWITCH, raising=False)
    make_adapter(CONTRACTS[release], tp_size=1)
    assert ENV_SWITCH not in os.environ
    make_adapter(CONTRACTS[release], tp_size=2)
    assert os.environ[ENV_SWITCH] == "false"


def _pretend_installed(monkeypatch: pytest.MonkeyPatch, sglang_version: str | None) -> None:
    """Make importlib.metadata report this sglang (None: not installed); other packages as is."""
    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name != "sglang":
            return real_version(name)
        if sglang_version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return sglang_version

    monkeypatch.setattr(importlib.metadata, "version", version)


@every_release
def test_installed_release_picks_its_contract(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pretend_installed(monkeypatch, release)
    assert installed_contract() is CONTRACTS[release]
    assert installed_contract().release == release


@pytest.mark.parametrize("version", ["0.5.16", "0.5.20", "0.5.23.post1", "0.6.0"])
def test_release_outside_the_checked_ones_is_refused_naming_the_supported_ones(
    version: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _pretend_installed(monkeypatch, version)
    with pytest.raises(
        SGLangVersionError, match=rf"sglang {re.escape(version)} is not supported.*0\.5\.17"
    ):
        installed_contract()
    with pytest.raises(SGLangVersionError, match=r"0\.5\.17 and 0\.5\.23"):
        SGLangEngine(model_path="/m", dtype="bfloat16", mem_fraction_static=0.9)


def test_sglang_not_installed_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    _pretend_installed(monkeypatch, None)
    with pytest.raises(SGLangVersionError, match=r"needs sglang, which is not installed here"):
        installed_contract()


def test_shutdown_is_idempotent() -> None:
    engine, sgl = make_adapter()
    engine.shutdown()
    engine.shutdown()
    assert sgl.names().count("shutdown") == 1


def spec(engine: str, tensor_parallel_size: int = 1, path: str = "/models/qwen") -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "model": {"path": path, "dtype": "float16"},
            "algorithm": {"seed": 5},
            "rollout": {
                "engine": engine,
                "tensorParallelSize": tensor_parallel_size,
                "memFractionStatic": 0.93,
            },
            "resources": {"gpusPerWorker": tensor_parallel_size},
        }
    )


@every_release
def test_make_engine_builds_sglang_on_the_rank_gpu(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tensorParallelSize > 1 goes through engines/tensor_parallel.py: tests/worker covers it.
    _pretend_installed(monkeypatch, release)
    stand_in = functools.partial(SGLangEngineStandIn, contract=CONTRACTS[release])
    monkeypatch.setattr(sglang_module, "_load_engine_class", lambda: stand_in)
    engine = make_engine(spec("sglang", tensor_parallel_size=1), device="cuda:2")
    assert isinstance(engine, SGLangEngine)
    assert engine._engine.contract.release == release
    kwargs = engine._engine.calls[0][1]
    assert kwargs["model_path"] == "/models/qwen"
    assert (kwargs["tp_size"], kwargs["base_gpu_id"]) == (1, 2)
    assert (kwargs["dtype"], kwargs["mem_fraction_static"], kwargs["random_seed"]) == (
        "float16",
        0.93,
        5,
    )


def test_make_engine_refuses_sglang_without_a_cuda_device() -> None:
    with pytest.raises(ValueError, match="not a CUDA device"):
        make_engine(spec("sglang"), device="cpu")


def test_make_engine_refuses_tensor_parallel_torch_engine() -> None:
    # The models refuse this spec at admission (rollout's TORCH_ONE_DEVICE_RULE); the engine
    # still refuses one built past them.
    torch_tp = spec("torch").model_copy(deep=True)
    torch_tp.rollout.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="tensorParallelSize=2"):
        make_engine(torch_tp, device="cpu")


def test_make_engine_builds_the_torch_engine_on_cpu() -> None:
    engine = make_engine(spec("torch", path="builtin:tiny-qwen2"), device="cpu")
    try:
        from rljob_worker.engines.torch_engine import TorchEngine

        assert isinstance(engine, TorchEngine)
        assert isinstance(engine, RolloutEngine)
        assert engine.kv_capacity_tokens > 0
    finally:
        engine.shutdown()


def test_a_failed_sglang_child_raises_in_the_owner_instead_of_killing_it() -> None:
    """sglang's launch handler for SIGQUIT kills the whole process tree, the rank included (on an
    H100 with sglang 0.5.17 a too small memFractionStatic ended the rank with -9 and no report).
    The adapter passes its own handler: it stops sglang's processes and raises, with the start's
    parameters in the message."""
    import signal
    import subprocess
    import sys

    _engine, sgl = make_adapter()
    handler = sgl.calls[0][1]["custom_sigquit_handler"]
    assert handler is sglang_module._on_sglang_child_failure
    # The handler kills every child of its process: run it in a process of its own, not in
    # pytest's (whose children may be a control plane).
    script = """
import signal, subprocess, sys
from rljob_worker.engines.sglang_engine import SGLangProcessFailed, _on_sglang_child_failure
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
try:
    _on_sglang_child_failure(signal.SIGQUIT, None)
except SGLangProcessFailed as error:
    print("raised:", error)
print("child:", child.wait(timeout=10))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert "raised: an sglang process failed and signalled SIGQUIT" in done.stdout, done
    assert f"child: {-signal.SIGKILL}" in done.stdout, done

    def failing_start(**_kwargs: Any) -> Any:
        # What the handler raises during start-up (outside an event loop), without running it
        # here: it kills every child of pytest's process.
        raise sglang_module.SGLangProcessFailed(sglang_module.CHILD_FAILED_MESSAGE)

    with pytest.raises(SGLangEngineError, match=r"starting sglang.Engine \(memFractionStatic=0.5"):
        SGLangEngine(
            model_path="/m", dtype="bfloat16", mem_fraction_static=0.5, engine_class=failing_start,
            contract=NEWEST,
        )  # fmt: skip


def test_the_running_phase_sigquit_handler_of_sglang_is_replaced_by_the_adapters() -> None:
    """At its first request sglang's tokenizer manager puts its running-phase SIGQUIT handler on
    its asyncio loop (it kills the process tree, the rank included: -9 and no report, seen on an
    H100 when a resume ran out of memory). After start-up the adapter's handler is back, and the
    loop no longer holds sglang's."""
    import asyncio
    import signal

    loop = asyncio.new_event_loop()
    killed: list[str] = []

    class WithTokenizerManager(SGLangEngineStandIn):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(contract=NEWEST, **kwargs)
            self.tokenizer_manager = SimpleNamespace(event_loop=None)

        def _answer(self, method: str, kwargs: dict[str, Any]) -> Any:
            manager = self.tokenizer_manager
            if manager.event_loop is None:  # auto_create_handle_loop
                manager.event_loop = loop
                loop.add_signal_handler(signal.SIGQUIT, lambda: killed.append("tree"))
            return super()._answer(method, kwargs)

    before = signal.getsignal(signal.SIGQUIT)
    try:
        SGLangEngine(
            model_path="/m", dtype="bfloat16", mem_fraction_static=0.5,
            engine_class=WithTokenizerManager, contract=NEWEST,
        )  # fmt: skip
        assert signal.getsignal(signal.SIGQUIT) is sglang_module._on_sglang_child_failure
        assert signal.SIGQUIT not in loop._signal_handlers  # type: ignore[attr-defined]
    finally:
        signal.signal(signal.SIGQUIT, before)
        loop.close()
    assert not killed


def test_a_child_failing_while_a_call_waits_in_sglangs_event_loop_fails_that_call() -> None:
    """Inside sglang's event loop (a resume waiting for its scheduler), uvloop runs the SIGQUIT
    handler from a loop callback and only logs what it raises; on an H100 the rank then waited
    for an answer no process would send. The handler stops the loop instead, and the adapter's
    engine raises SGLangProcessFailed for the waiting call. Run in a process of its own (the
    handler kills every child of its process)."""
    import signal
    import subprocess
    import sys

    script = """
import asyncio, signal, subprocess, sys
from rljob_worker.engines import sglang_engine as m

loop = asyncio.new_event_loop()

class Waiting:
    def resume_memory_occupation(self, tags):
        never = loop.create_future()
        loop.call_later(0.2, m._on_sglang_child_failure, signal.SIGQUIT, None)
        return loop.run_until_complete(never)

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
engine = m._Guarded(Waiting())
try:
    engine.resume_memory_occupation(tags=["kv_cache"])
except m.SGLangProcessFailed as error:
    print("raised:", error, "| cause:", type(error.__cause__).__name__, error.__cause__)
print("child:", child.wait(timeout=10))
try:
    engine.resume_memory_occupation(tags=["weights"])
except m.SGLangProcessFailed as error:
    print("next call:", error)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert (
        "raised: Engine.resume_memory_occupation: an sglang process failed and signalled SIGQUIT"
        in done.stdout
    ), done
    assert "cause: RuntimeError Event loop stopped before Future completed." in done.stdout, done
    assert f"child: {-signal.SIGKILL}" in done.stdout, done
    assert "next call: Engine.resume_memory_occupation: an sglang process failed" in done.stdout


def test_sglangs_running_phase_sigquit_handler_is_patched_to_the_adapters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before an engine is built the adapter swaps sglang's SignalHandler method (a stand-in
    module here: sglang cannot be installed on this machine) for one that calls its own handler;
    the contract test checks the name in both releases' sources."""
    import signal
    import sys
    import types

    module_name, cls_name, method = sglang_module.RUNNING_PHASE_SIGQUIT
    original_calls: list[str] = []

    class SignalHandler:
        def running_phase_sigquit_handler(self, signum: Any = None, frame: Any = None) -> None:
            original_calls.append("kill_process_tree")

    stand_in = types.ModuleType(module_name)
    setattr(stand_in, cls_name, SignalHandler)
    monkeypatch.setitem(sys.modules, module_name, stand_in)
    sglang_module._patch_running_phase_sigquit()
    assert getattr(SignalHandler, method) is sglang_module._running_phase_sigquit_handler
    called: list[tuple[int, object]] = []
    monkeypatch.setattr(
        sglang_module, "_on_sglang_child_failure", lambda s, f: called.append((s, f))
    )
    SignalHandler().running_phase_sigquit_handler()
    assert called == [(signal.SIGQUIT, None)] and not original_calls


# What a scheduler left on stderr when its resume ran out of device memory, on an H100 with
# sglang 0.5.17 (bench/results/raw/s6-sglang-h100-1.5b-reported.log): torch_memory_saver's note,
# which a caller may recover from, then its fatal error; the scheduler exited 1, no traceback.
TMS_NOTE = (
    "[torch_memory_saver.cpp] cuMemCreate CUDA_ERROR_OUT_OF_MEMORY (may not be an issue e.g. "
    "torch allocator will free cache and retry)"
)
TMS_FATAL = (
    "[torch_memory_saver.cpp] cudaError error: 2 (out of memory)  file=csrc/core.cpp "
    "func=resume line=243"
)


def test_a_childs_last_words_name_its_oom_or_its_error() -> None:
    line, oom = sglang_module.child_failure_line(f"Loading shards: 100%\n{TMS_NOTE}\n{TMS_FATAL}\n")
    assert (line, oom) == (TMS_FATAL, True)
    assert sglang_module.child_failure_line(f"{TMS_NOTE}\n") == (None, False)
    traceback = (
        "Scheduler hit an exception: Traceback (most recent call last):\n"
        '  File "scheduler.py", line 3, in run\n'
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.18 GiB of which 1.00 GiB is free.\n"
    )
    line, oom = sglang_module.child_failure_line(traceback)
    assert oom and line is not None and line.startswith("torch.OutOfMemoryError: CUDA out of")
    # sglang's own pools "run out of memory" too: no CUDA OOM, a smaller fraction would not help
    for pool in (
        "RuntimeError: alloc_req_slots runs out of memory. Please set a smaller number for "
        "--max-running-requests.",
        "RuntimeError: Prefill out of memory. Try to lower your batch size.",
    ):
        assert sglang_module.child_failure_line(pool) == (pool, False)
    line, oom = sglang_module.child_failure_line("Traceback\nValueError: bad tag\n[done]\n")
    assert (line, oom) == ("ValueError: bad tag", False)
    assert sglang_module.child_failure_line("") == (None, False)


def test_a_child_dying_of_a_cuda_oom_is_the_stages_cuda_oom_with_its_last_words() -> None:
    """Real processes, in a process of its own (the handler kills every child of its process):
    the engine's child inherits the adapter's stderr pipe, writes what sglang 0.5.17's scheduler
    wrote on an H100 when its resume ran out of memory, signals SIGQUIT and exits 1 while the
    rank waits in a resume. The wait fails as a torch.OutOfMemoryError quoting the child, the
    stage boundary records it as that stage's CUDA OOM, and the child's output still reached
    this process's stderr."""
    import subprocess
    import sys

    script = f"""
import asyncio, signal, subprocess, sys
import torch
from support.sglang_standin import NEWEST, SGLangEngineStandIn
from rljob.report import Stage
from rljob_worker.engines import sglang_engine as m
from rljob_worker.memory import MemoryMeter, StageOOM

CHILD = (
    "import os, signal, sys, time\\n"
    "sys.stdin.read()\\n"
    "sys.stderr.write({TMS_NOTE!r} + '\\\\n' + {TMS_FATAL!r} + '\\\\n'); sys.stderr.flush()\\n"
    "os.kill(os.getppid(), signal.SIGQUIT); sys.exit(1)\\n"
)
loop = asyncio.new_event_loop()

class Scheduler(SGLangEngineStandIn):
    def __init__(self, **kwargs):
        super().__init__(contract=NEWEST, **kwargs)
        signal.signal(signal.SIGQUIT, kwargs["custom_sigquit_handler"])
        self.child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE)

    def _answer(self, method, kwargs):
        if method == "resume_memory_occupation" and "kv_cache" in kwargs["tags"]:
            self.child.stdin.close()  # the scheduler starts resuming, and runs out of memory
            return loop.run_until_complete(loop.create_future())
        return super()._answer(method, kwargs)

engine = m.SGLangEngine(model_path="/m", dtype="bfloat16", mem_fraction_static=0.5,
                        engine_class=Scheduler, contract=NEWEST)
print("stderr back:", sys.stderr.fileno(), flush=True)
meter = MemoryMeter(rank=0, device=torch.device("cpu"))
engine.resume(["weights"])
try:
    with meter.stage(Stage.WAKE_KV_CACHE, 1):
        engine.resume(["kv_cache", "cuda_graph"])
except StageOOM as oom:
    print("oom:", oom.record.kind, oom.record.stage, "|", oom.record.message)
    print("is torch oom:", isinstance(oom.__cause__ or oom.__context__, torch.OutOfMemoryError))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path, "tests"])}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done
    assert (
        f"oom: CUDAOutOfMemory wake_kv_cache | CUDA out of memory in an sglang process: "
        f"Engine.resume_memory_occupation: its last words: {TMS_FATAL}" in done.stdout
    ), done
    assert "is torch oom: True" in done.stdout, done
    assert TMS_FATAL in done.stderr, done  # the tee passed the child's output on


def test_shutdown_after_a_child_failed_stops_nothing_and_raises_nothing() -> None:
    """The failure handler has stopped sglang's processes; a shutdown in the rank's `finally`
    must not replace the stage's error with its own."""
    engine, sgl = make_adapter()
    sglang_module._child_failed.set()
    try:
        engine.shutdown()
        engine.shutdown()
    finally:
        sglang_module._child_failed.clear()
    assert "shutdown" not in sgl.names()


# --- reading the weights back (named_weights: `rljob run --verify-weights`, the GPU tests) -------


def _dense_model(directory: Path, kv_heads: int) -> dict[str, torch.Tensor]:
    """config.json of a one-layer dense Qwen2 in `directory`, and random bf16 weights for it
    under the trainer's names (tied embedding; vocab 100, which sglang pads to 128)."""
    hidden, heads, inter, vocab, head_dim = 128, 4, 96, 100, 32
    (directory / "config.json").write_text(
        json.dumps(
            {"hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
             "intermediate_size": inter, "vocab_size": vocab, "tie_word_embeddings": True}
        )
    )  # fmt: skip
    layer = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        f"{layer}input_layernorm.weight": (hidden,),
        f"{layer}self_attn.q_proj.weight": (heads * head_dim, hidden),
        f"{layer}self_attn.q_proj.bias": (heads * head_dim,),
        f"{layer}self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        f"{layer}self_attn.k_proj.bias": (kv_heads * head_dim,),
        f"{layer}self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        f"{layer}self_attn.v_proj.bias": (kv_heads * head_dim,),
        f"{layer}self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{layer}post_attention_layernorm.weight": (hidden,),
        f"{layer}mlp.gate_proj.weight": (inter, hidden),
        f"{layer}mlp.up_proj.weight": (inter, hidden),
        f"{layer}mlp.down_proj.weight": (hidden, inter),
        "model.norm.weight": (hidden,),
    }
    generator = torch.Generator().manual_seed(kv_heads)
    return {
        name: torch.randn(shape, generator=generator).to(torch.bfloat16)
        for name, shape in shapes.items()
    }


def _updated(tmp_path: Path, tp_size: int, kv_heads: int) -> tuple[SGLangEngine, Any, dict]:
    weights = _dense_model(tmp_path, kv_heads)
    engine, sgl = make_adapter(CONTRACTS["0.5.17"], tp_size=tp_size, model_path=str(tmp_path))
    engine.resume([TAG_WEIGHTS])
    items = list(weights.items())
    engine.update_weights(items[:5])
    engine.update_weights(items[5:])
    return engine, sgl, weights


@pytest.mark.parametrize(
    ("tp_size", "kv_heads"),
    [(1, 2), (2, 2), (2, 4), (4, 2)],
    ids=["tp1", "tp2", "tp2-two-kv-heads-per-rank", "tp4-kv-heads-shared-by-two-ranks"],
)
def test_named_weights_joins_every_tp_ranks_shards_into_what_training_sent(
    tmp_path: Path, tp_size: int, kv_heads: int
) -> None:
    """The loop's weight check (`rljob run --verify-weights`) on sglang: each TP rank's shards,
    written by the stand-in in sglang's layout, come back as the full tensors sent, bit for bit,
    under the trainer's names (the tied embedding under both of its names)."""
    engine, sgl, sent = _updated(tmp_path, tp_size, kv_heads)
    held = dict(engine.named_weights())  # as loop.check_weights reads it
    assert held.keys() == {*sent, "lm_head.weight"}
    for name, tensor in sent.items():
        assert tensor_digest(held[name]) == tensor_digest(tensor), name
    assert held["lm_head.weight"] is held["model.embed_tokens.weight"]
    (save,) = [kw for n, kw in sgl.calls if n == "save_sharded_model"]
    assert save["pattern"] == SHARD_PATTERN and save["max_size"] is None
    assert not Path(save["path"]).exists(), "the shards are removed once read"


@pytest.mark.parametrize(
    ("tp_size", "kv_heads", "name", "message"),
    [
        (
            2,
            2,
            "model.norm.weight",
            "model.norm.weight: TP rank 1 holds another value than TP rank 0",
        ),
        (
            4,
            2,
            "model.layers.0.self_attn.k_proj.weight",
            "qkv_proj.weight (k_proj): TP rank 3 holds",
        ),
    ],
)
def test_a_replicated_weight_that_differs_between_tp_ranks_is_named(
    tmp_path: Path, tp_size: int, kv_heads: int, name: str, message: str
) -> None:
    engine, sgl, sent = _updated(tmp_path, tp_size, kv_heads)
    sgl.loaded[name][tp_size - 1] = sent[name] + 1  # the last rank loaded something else
    with pytest.raises(EngineWeightsError, match=re.escape(message)):
        dict(engine.named_weights())


def test_named_weights_with_weights_released_raises_without_calling_sglang() -> None:
    engine, sgl = make_adapter()
    before = len(sgl.calls)
    with pytest.raises(RuntimeError, match=r"dump_weights\(\) needs \['weights'\] resident"):
        engine.named_weights()
    assert len(sgl.calls) == before


@every_release
def test_prompt_logprobs_scores_every_token_after_the_first_in_one_call(release: str) -> None:
    engine, sgl = make_adapter(CONTRACTS[release])
    engine.resume(ALL_TAGS)
    assert engine.prompt_logprobs([[5, 6, 7], [9, 8]]) == [[-0.1, -0.2], [-0.1]]
    name, kwargs = sgl.calls[-1]
    assert name == "generate"
    assert kwargs["return_logprob"] is True and kwargs["logprob_start_len"] == 0
    assert kwargs["sampling_params"] == [{"max_new_tokens": 1, "temperature": 0.0}] * 2


@every_release
def test_async_generate_sends_one_request_per_call_and_reads_cached_tokens(release: str) -> None:
    # The multi-turn rollout's path: several requests in flight at once on run_async's loop,
    # each one Engine.async_generate call with flat input_ids (token in, token out).
    engine, sgl = make_adapter(CONTRACTS[release])
    engine.resume([TAG_WEIGHTS])
    engine.update_weights(bucket("a"))
    engine.flush_cache()
    engine.resume([TAG_KV_CACHE, TAG_CUDA_GRAPH])

    async def three() -> list[Any]:
        import asyncio

        return list(
            await asyncio.gather(
                *(engine.async_generate(p, SAMPLING) for p in ([1, 2, 3], [4], [5, 6]))
            )
        )

    answers = engine.run_async(three())
    # The stand-in answers [len(prompt), 7], log-probs (-len / 10, -0.7), cached len // 2.
    assert [(a.token_ids, a.logprobs, a.cached_tokens) for a in answers] == [
        ([3, 7], [-0.3, -0.7], 1), ([1, 7], [-0.1, -0.7], 0), ([2, 7], [-0.2, -0.7], 1)
    ]  # fmt: skip
    sent = [kwargs for method, kwargs in sgl.calls if method == "async_generate"]
    assert [k["input_ids"] for k in sent] == [[1, 2, 3], [4], [5, 6]]
    assert all(
        k["return_logprob"] is True and k["sampling_params"]["max_new_tokens"] == 4 for k in sent
    )


def test_async_generate_with_kv_cache_released_raises_without_calling_sglang() -> None:
    engine, sgl = make_adapter()
    engine.resume([TAG_WEIGHTS])
    start = len(sgl.calls)
    with pytest.raises(RuntimeError, match="kv_cache"):
        engine.run_async(engine.async_generate([1], SAMPLING))
    assert sgl.calls[start:] == []


def test_release_while_an_async_request_is_in_flight_is_refused() -> None:
    # What staged awake relies on (sglang itself refuses to release while a request runs): the
    # adapter counts async_generate calls in flight and names them.
    engine, _ = make_adapter()
    engine.resume(list(ALL_TAGS))

    async def release_mid_request() -> None:
        import asyncio

        request = asyncio.ensure_future(engine.async_generate([1, 2], SAMPLING))
        await asyncio.sleep(0)  # the request has started and awaits sglang's answer
        assert engine.requests_in_flight == 1
        with pytest.raises(RuntimeError, match="1 async_generate requests in flight"):
            engine.release([TAG_KV_CACHE])
        await request

    engine.run_async(release_mid_request())
    assert engine.requests_in_flight == 0
    engine.release([TAG_KV_CACHE])
    assert TAG_KV_CACHE in engine.released_tags


def test_an_update_with_a_request_in_flight_is_refused_before_sglang_is_called() -> None:
    # 0.5.17 flushes the prefix cache inside the update's first request, and its scheduler
    # asserts that flush succeeded (it does not while a request runs): refuse first.
    engine, sgl = make_adapter(CONTRACTS["0.5.17"])
    engine.resume(list(ALL_TAGS))

    async def update_mid_request() -> None:
        import asyncio

        request = asyncio.ensure_future(engine.async_generate([1, 2], SAMPLING))
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="1 async_generate requests in flight"):
            engine.update_weights(bucket("a"))
        await request

    engine.run_async(update_mid_request())
    assert "update_weights_from_tensor" not in sgl.names()
    engine.update_weights(bucket("a"))
    engine.flush_cache()
    assert sorted(sgl.loaded) == ["a"]


@every_release
def test_no_prefix_cached_with_old_weights_is_reused_with_the_kv_cache_resident(
    release: str,
) -> None:
    """wakeUp single keeps the KV cache (and its radix tree) through the update: the prefixes
    cached by the last rollout must be dropped with each update, whichever request drops them
    (the stand-in fails a generate that would reuse one: SGLangEngineStandIn.cached_versions).
    Three updates of two buckets each, a rollout after each."""
    engine, sgl = make_adapter(CONTRACTS[release])
    engine.resume(list(ALL_TAGS))
    for _ in range(3):
        engine.generate([[1, 2, 3]], SAMPLING)
        engine.update_weights(bucket("a", "b"))
        engine.update_weights(bucket("c"))
        engine.flush_cache()
    engine.generate([[1, 2, 3]], SAMPLING)
    assert sgl.cached_versions == {sgl.weights_version} and sgl.weights_version == 6
    flushes = sgl.names().count("flush_cache")
    assert flushes == (3 if CONTRACTS[release].opens_weight_update_session else 0)


def test_a_refused_first_update_leaves_the_flush_to_its_own_request() -> None:
    # 0.5.17 flushes inside an update only when its load succeeded: after a refused first
    # request, the update's flush is a request of its own again.
    engine, sgl = make_adapter(CONTRACTS["0.5.17"])
    engine.resume(list(ALL_TAGS))
    engine.generate([[1, 2, 3]], SAMPLING)
    sgl.refuse["update_weights_from_tensor"] = "out of memory"
    with pytest.raises(SGLangEngineError, match="out of memory"):
        engine.update_weights(bucket("a"))
    del sgl.refuse["update_weights_from_tensor"]
    start = len(sgl.calls)
    engine.update_weights(bucket("a"))
    engine.flush_cache()
    assert sgl.names()[start:] == ["update_weights_from_tensor", "flush_cache"]
    assert sgl.calls[start][1]["flush_cache"] is False
    engine.generate([[1, 2, 3]], SAMPLING)  # no prefix of the old weights (the stand-in checks)


def test_the_stand_in_catches_an_update_that_drops_no_prefix() -> None:
    # The check above can fail: updates without any flush leave the old prefixes in place.
    _, sgl = make_adapter(CONTRACTS["0.5.17"])
    sgl.resume_memory_occupation(tags=list(ALL_TAGS))
    sgl.generate(input_ids=[[1, 2]], sampling_params=[{}])
    sgl.update_weights_from_tensor(named_tensors=bucket("a"), load_format=None, flush_cache=False)
    with pytest.raises(AssertionError, match="prefixes cached with weights version"):
        sgl.generate(input_ids=[[1, 2]], sampling_params=[{}])


def test_engines_of_one_process_answer_on_one_event_loop_when_given_it() -> None:
    """Two sglang engines in one process (bench/multi_turn.py --engines 2): each sglang.Engine
    makes its own loop, and its tokenizer manager starts its receive loop on the loop running
    its first request (its own, during start-up). A rollout awaiting both engines on the first
    one's loop then never hears from the second: on an H100 two engines waited until the call's
    limit, on one card and on two. Given the first engine's loop, the second answers there."""
    import asyncio
    import signal

    class WithLoops(SGLangEngineStandIn):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(contract=NEWEST, **kwargs)
            self.loop = asyncio.new_event_loop()  # as sglang's Engine.__init__, out of a loop
            self.tokenizer_manager = SimpleNamespace(event_loop=None)

        def _answer(self, method: str, kwargs: dict[str, Any]) -> Any:
            # Each blocking call runs on self.loop; the first starts the receive loop there.
            if self.tokenizer_manager.event_loop is None:
                self.tokenizer_manager.event_loop = self.loop
            return super()._answer(method, kwargs)

        async def _async_answer(self, kwargs: dict[str, Any]) -> dict[str, Any]:
            if asyncio.get_running_loop() is not self.tokenizer_manager.event_loop:
                raise AssertionError("no receive loop on this loop: sglang would wait forever")
            return await super()._async_answer(kwargs)

    def started(loop: asyncio.AbstractEventLoop | None = None) -> SGLangEngine:
        engine = SGLangEngine(model_path="/m", dtype="bfloat16", mem_fraction_static=0.3,
                              engine_class=WithLoops, contract=NEWEST, event_loop=loop)  # fmt: skip
        engine.resume(list(ALL_TAGS))
        return engine

    before = signal.getsignal(signal.SIGQUIT)
    try:
        first = started()
        second = started(first.event_loop)
        alone = started()  # as before the fix: a loop of its own
        assert first.event_loop is not None and second.event_loop is first.event_loop

        async def both(engines: list[SGLangEngine]) -> list[Any]:
            return list(
                await asyncio.gather(*(e.async_generate([1, 2], SAMPLING) for e in engines))
            )

        answers = first.run_async(both([first, second]))
        assert [a.token_ids for a in answers] == [[2, 7], [2, 7]]
        second.flush_cache()  # its blocking calls run on the shared loop too
        with pytest.raises(AssertionError, match="would wait forever"):
            first.run_async(both([first, alone]))
    finally:
        signal.signal(signal.SIGQUIT, before)


def test_request_seeds_of_neighbouring_batches_never_meet() -> None:
    # The loop's batch seeds of neighbouring ranks and iterations differ by 1: seed + index
    # gave batch 8's request 1 batch 9's request 0's seed.
    from rljob_worker.engines.base import request_seed

    seeds = [request_seed(batch, index) for batch in range(8, 72) for index in range(512)]
    assert len(set(seeds)) == len(seeds)
    assert request_seed(8, 1) != request_seed(9, 0)
    assert all(0 <= s < 1 << 63 for s in (request_seed(2**62, 3), request_seed(7, 2**21)))


def test_an_abort_stops_the_requests_in_flight_with_what_they_sampled() -> None:
    """The partial rollout's stop: abort_requests() is the tokenizer manager's abort of every
    request (the contract's `abort`); a request it stops answers what it had sampled,
    finish_reason abort, and comes back marked aborted; one sent after it runs to its end."""
    import asyncio

    engine = SGLangEngine(model_path="/m", dtype="bfloat16", mem_fraction_static=0.3,
                          engine_class=SGLangEngineStandIn, contract=NEWEST)  # fmt: skip
    engine.resume(list(ALL_TAGS))

    async def scenario() -> tuple[Any, Any]:
        cut = asyncio.ensure_future(engine.async_generate([1, 2], SAMPLING))
        await asyncio.sleep(0)  # sent
        engine.abort_requests()
        return await cut, await engine.async_generate([1, 2], SAMPLING)

    cut, whole = engine.run_async(scenario())
    assert cut.aborted and cut.token_ids == [2] and len(cut.logprobs) == 1
    assert not whole.aborted and whole.token_ids == [2, 7] and len(whole.logprobs) == 2
    assert engine.requests_in_flight == 0
    # One aborted while queued: an answer without ids or log-probs, an empty aborted completion.
    engine._engine._target.abort_queued = True
    queued, _ = engine.run_async(scenario())
    assert queued.aborted and queued.token_ids == [] == queued.logprobs
