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
import os
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

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


def staged_iteration_calls(buckets: int, contract: SGLangContract = NEWEST) -> list[str]:
    """The sglang calls of one staged iteration whose weights come in `buckets` buckets:
    wake_weights (resume, one update session where the release has them), wake_kv_cache,
    rollout, sleep."""
    session = contract.opens_weight_update_session
    return [
        "resume_memory_occupation",
        *(["begin_weight_update"] if session else []),
        *["update_weights_from_tensor"] * buckets,
        *(["end_weight_update"] if session else []),
        "flush_cache",
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
        undeclared = set(kwargs) - set(contract.server_args)
        assert not undeclared, f"Engine() keywords outside the contract's server_args: {undeclared}"
        self.calls: list[tuple[str, dict[str, Any]]] = [("__init__", kwargs)]
        # What the scheduler processes would inherit: the GPUs they may use.
        self.visible_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        # name -> the tensor each TP rank's scheduler loaded for it, in TP-rank order.
        self.loaded: dict[str, list[Any]] = {}
        self.offloaded: set[str] = set()
        self.session_open = False
        self.refuse: dict[str, str] = {}

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
            return self._answer(method, kwargs)

        return call

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
        if method == "update_weights_from_tensor":
            self._load(kwargs["named_tensors"])
        if method in self.contract.returns_success_message:
            return True, "Success"
        if method == "flush_cache":
            return SimpleNamespace(success=True, message="")
        if method == "generate":
            # Two tokens per prompt, [len(prompt), 7], each with a log-prob (id / -10: distinct
            # values a test can check), as (logprob, token id, text) the way sglang answers.
            return [
                {
                    self.contract.output_ids_key: [len(p), 7],
                    "meta_info": {
                        self.contract.output_logprobs_key: [
                            (-len(p) / 10, len(p), None),
                            (-0.7, 7, None),
                        ]
                    },
                }
                for p in kwargs["input_ids"]
            ]
        return None

    def _load(self, named_tensors: list[tuple[str, Any]]) -> None:
        """What each TP scheduler does (weight_updater._unwrap_tensor): take its rank's value."""
        tp_size = self.calls[0][1].get("tp_size", 1)
        for name, value in named_tensors:
            if isinstance(value, LocalSerializedTensorStandIn):
                assert len(value.values) == tp_size, f"{name}: {len(value.values)} != tp {tp_size}"
                self.loaded[name] = [value.get(rank) for rank in range(tp_size)]
            else:
                self.loaded[name] = [value] * tp_size

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]
