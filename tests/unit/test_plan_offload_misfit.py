"""Offload Auto where no offload fits (rljob/plan/stages.py mode_plan): the least offload whose
every stage fits when the shortfall is one offload cannot fix, none when host memory is short."""

from __future__ import annotations

import pytest

from rljob.api import RLJobSpec
from rljob.plan import GiB, ModePlan, mode_plan, shape_for

pytestmark = pytest.mark.unit

QWEN_05B = {"hiddenSize": 896, "intermediateSize": 4864, "numHiddenLayers": 24,
            "numAttentionHeads": 14, "numKeyValueHeads": 2, "vocabSize": 151936,
            "tieWordEmbeddings": True}  # fmt: skip
CARD = 80 * GiB


def _plan(spec: RLJobSpec) -> ModePlan:
    shape = shape_for(spec)
    assert shape is not None
    return mode_plan(spec, shape, CARD, 1)


def _multi_turn(fraction: float, conversations: int, prompts: int) -> RLJobSpec:
    return RLJobSpec.model_validate({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "shape": QWEN_05B},
        "data": {"source": "builtin:calculator", "trainBatchSize": prompts, "maxPromptLength": 256},
        "algorithm": {"groupSize": 8}, "training": {"microBatchSize": 1},
        "rollout": {"engine": "sglang", "memFractionStatic": fraction, "mode": "multiTurn",
                    "multiTurn": {"maxResponseLength": 8192,
                                  "maxConcurrentConversations": conversations}},
        "resources": {"gpusPerWorker": 1},
    })  # fmt: skip


@pytest.mark.parametrize(
    ("fraction", "conversations", "prompts", "offload", "stages_fit"),
    [
        # 16 x 8 = 128 conversations of 256 + 8192 tokens: 1,081,344, more than a 0.15 pool
        # holds. Every stage fits without an offload, and an offload would not grow the pool.
        (0.15, 128, 16, (False, False), True),
        # 1024 of them (8,650,752 tokens) at 0.9: the stages need the moments off the card, not
        # the params as well (the round trip of both would buy no KV token).
        (0.9, 1024, 128, (True, False), True),
        # At 0.97 no offload brings rollout under the card: everything the flags allow.
        (0.97, 1024, 128, (True, True), False),
    ],
)
def test_a_kv_shortfall_takes_the_least_offload_whose_stages_fit(
    fraction: float,
    conversations: int,
    prompts: int,
    offload: tuple[bool, bool],
    stages_fit: bool,
) -> None:
    m = _plan(_multi_turn(fraction, conversations, prompts))
    assert m.parts.kv_tokens_needed == conversations * (256 + 8192)
    assert not m.kv_holds_rollout and not m.fits
    assert (m.offload_optimizer, m.offload_params) == offload
    assert m.stages_fit_under(CARD) is stages_fit
    # The pool is the same at every offload: offloading cannot fix the shortfall.
    assert m.parts.kv_tokens == _plan(_multi_turn(fraction, 1, prompts)).parts.kv_tokens


@pytest.mark.parametrize("fraction", [0.5, 0.9])
def test_short_host_memory_never_adds_host_copies(fraction: float) -> None:
    spec = RLJobSpec.model_validate({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "shape": QWEN_05B},
        "rollout": {"engine": "sglang", "memFractionStatic": fraction},
        "resources": {"gpusPerWorker": 1, "memory": "768Mi", "sharedMemory": "256Mi"},
    })  # fmt: skip
    m = _plan(spec)
    # The load's largest slice, the 151936 x 896 embedding (136,134,656 elements), as stored
    # (bf16) and cast to fp32: x 6 bytes = 816,807,936, 778.97 MiB, over the pod's 768 MiB.
    assert m.load is not None and m.load.host_bytes_per_node == 816_807_936
    # Offloading would pin the moments' and params' host copies in that pod: none (at 0.9 the
    # device needs the moments offloaded too, so the misfit names both).
    assert (m.offload_optimizer, m.offload_params) == (False, False)
    assert m.host_short and not m.fits
    assert m.stages_fit_under(CARD) is (fraction == 0.5)
