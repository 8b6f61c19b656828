"""rollout Auto (issue 35): the choice on tables of predicted peaks, on the real plan, at
admission, and the OOM policy's retry by the measured overshoot (rljob/plan/auto.py auto_choice,
rljob/oom_policy.py)."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.api import AUTO, DEFAULT_PLAN_MARGIN, AttemptKnobs, RLJobSpec, WakeUp
from rljob.oom_policy import Outcome, admit, first_knobs, next_attempt
from rljob.plan import (
    ALLOCATOR_SLACK_BYTES,
    AutoRefused,
    GiB,
    ModePlan,
    Parts,
    StagePeak,
    _with_bucket,
    auto_bucket,
    auto_choice,
    auto_lines,
    choose,
    largest_fitting_fraction,
    mode_plan,
    plan,
    resolved_bucket_bytes,
    shape_for,
    whole_model_megabytes,
)
from rljob.report import Stage
from rljob_operator import attempts

pytestmark = pytest.mark.unit

CARD = 80 * GiB


def candidate(
    mode: WakeUp,
    fraction: float,
    peak_gib: float,
    kv_tokens: int,
    stage: Stage = Stage.ROLLOUT,
    kv_tokens_needed: int = 0,
    kv_conversations: int = 0,
) -> ModePlan:
    """One row of a table: a candidate whose worst stage peaks at `peak_gib` and whose rollout
    needs `kv_tokens_needed` KV tokens at once (one request, or in mode multiTurn
    `kv_conversations` conversations)."""
    parts = Parts(
        context=0, train_params=0, optimizer=0, grads=0, step_temp=0, step_cache=0,
        activations=0, fsdp_buffers=0, engine_weights=3 * GiB, kv_pool=kv_tokens * 1024,
        kv_tokens=kv_tokens, gather=0, rollout_workspace=0, kv_tokens_needed=kv_tokens_needed,
        kv_conversations=kv_conversations,
    )  # fmt: skip
    stages = (
        StagePeak(Stage.TRAIN, 10 * GiB, CARD),
        StagePeak(stage, int(peak_gib * GiB), CARD),
    )
    return ModePlan(mode, fraction, False, False, stages, parts)


LIMIT = int(
    CARD * (1 - 0.03)
)  # 77.6 GiB: a margin of 0.03, fixed here (the tables are sized for it)


@pytest.mark.parametrize(
    ("table", "chosen"),
    [
        # The largest KV pool that fits wins; the one above it passes the limit.
        (
            [candidate(WakeUp.STAGED, 0.90, 72.0, 900), candidate(WakeUp.STAGED, 0.95, 77.9, 950)],
            (WakeUp.STAGED, 0.90),
        ),
        # A tie in KV tokens: staged (its peaks are lower), whatever the order.
        (
            [candidate(WakeUp.SINGLE, 0.80, 70.0, 800), candidate(WakeUp.STAGED, 0.80, 60.0, 800)],
            (WakeUp.STAGED, 0.80),
        ),
        # A tie within one mode (the torch engine's whole blocks): the lower fraction.
        (
            [candidate(WakeUp.STAGED, 0.81, 70.5, 800), candidate(WakeUp.STAGED, 0.80, 70.0, 800)],
            (WakeUp.STAGED, 0.80),
        ),
        # Single where it gives the larger pool (staged misfits here).
        (
            [candidate(WakeUp.SINGLE, 0.85, 76.0, 850), candidate(WakeUp.STAGED, 0.85, 78.0, 850),
             candidate(WakeUp.STAGED, 0.84, 77.0, 840)],
            (WakeUp.SINGLE, 0.85),
        ),
        # A candidate without one KV token is never chosen, however low its peak.
        (
            [candidate(WakeUp.STAGED, 0.05, 12.0, 0), candidate(WakeUp.STAGED, 0.10, 14.0, 10)],
            (WakeUp.STAGED, 0.10),
        ),
    ],
    ids=["largest-fitting", "tie-staged", "tie-lower-fraction", "single-wins", "no-kv-skipped"],
)  # fmt: skip
def test_choose_takes_the_largest_kv_pool_under_the_limit(
    table: list[ModePlan], chosen: tuple[WakeUp, float]
) -> None:
    m = choose(table, LIMIT)
    assert (m.wake_up, m.mem_fraction_static) == chosen


def test_a_peak_that_fits_the_card_but_not_the_margin_is_refused() -> None:
    # 78 GiB fits 80 GiB and not 80 GiB less 3%: the bytes short are the limit's.
    table = [candidate(WakeUp.STAGED, 0.95, 78.0, 950, Stage.WAKE_KV_CACHE)]
    assert table[0].fits
    with pytest.raises(AutoRefused) as info:
        choose(table, LIMIT)
    short = (78 * GiB + ALLOCATOR_SLACK_BYTES - LIMIT) / GiB
    text = str(info.value)
    assert "wake_kv_cache needs 78.00 GiB" in text
    assert f"({short:.2f} GiB short)" in text
    assert f"nothing fits {LIMIT / GiB:.2f} GiB" in text


def test_nothing_fits_names_the_closest_candidates_stage() -> None:
    table = [
        candidate(WakeUp.STAGED, 0.50, 90.0, 500, Stage.TRAIN),
        candidate(WakeUp.SINGLE, 0.50, 95.0, 500, Stage.WAKE_WEIGHTS),
    ]
    with pytest.raises(AutoRefused, match=r"closest: wakeUp staged at memFractionStatic 0.50, "
                       r"where train needs 90.00 GiB \(12.46 GiB short\)"):  # fmt: skip
        choose(table, LIMIT)


def test_a_multi_turn_kv_shortfall_is_refused_naming_the_conversations() -> None:
    # 0.50 and 0.90 fit the limit but hold 500 and 900 of the 1000 tokens the conversations
    # need; 0.95 would hold them but passes the limit: the largest pool that fits is named.
    table = [
        candidate(WakeUp.STAGED, 0.50, 60.0, 500, kv_tokens_needed=1000, kv_conversations=4),
        candidate(WakeUp.STAGED, 0.90, 76.0, 900, kv_tokens_needed=1000, kv_conversations=4),
        candidate(WakeUp.STAGED, 0.95, 78.0, 1000, kv_tokens_needed=1000, kv_conversations=4),
    ]
    with pytest.raises(AutoRefused) as info:
        choose(table, LIMIT)
    text = str(info.value)
    assert "at wakeUp staged, memFractionStatic 0.90 (the largest that fits)" in text, text
    assert "holds 900 tokens" in text and "4 concurrent full-length trajectories need 1000" in text
    assert "lower spec.rollout.multiTurn.maxConcurrentConversations" in text
    assert "GiB short" not in text


def test_a_kv_pool_smaller_than_one_full_request_is_not_chosen() -> None:
    # Single-turn: sglang shortens a request's max_new_tokens to what its pool holds, so a pool
    # under one prompt + response would cut every long response short without an error.
    table = [
        candidate(WakeUp.STAGED, 0.50, 60.0, 700, kv_tokens_needed=800),
        candidate(WakeUp.SINGLE, 0.60, 70.0, 900, kv_tokens_needed=800),
        candidate(WakeUp.STAGED, 0.95, 90.0, 5000, kv_tokens_needed=800),  # over the limit
    ]
    assert choose(table, LIMIT) is table[1]
    with pytest.raises(AutoRefused) as info:
        choose(table[:1], LIMIT)
    text = str(info.value)
    assert "holds 700 tokens, one full-length request" in text and "needs 800" in text, text
    assert "lower spec.data.maxPromptLength or maxResponseLength" in text


def test_a_multi_turn_kv_shortfall_on_the_real_plan_names_max_concurrent_conversations() -> None:
    s = RLJobSpec.model_validate({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "shape": QWEN25_05B},
        "data": {"source": "builtin:calculator", "trainBatchSize": 64, "maxPromptLength": 256},
        "algorithm": {"groupSize": 64}, "training": {"microBatchSize": 1},
        "rollout": {"engine": "sglang", "memFractionStatic": AUTO, "mode": "multiTurn",
                    "multiTurn": {"maxResponseLength": 8192, "maxConcurrentConversations": 4096}},
        "resources": {"gpusPerWorker": 1},
    })  # fmt: skip
    shape = shape_for(s)
    assert shape is not None
    with pytest.raises(AutoRefused) as info:
        auto_choice(s, shape, CARD, 1)
    # 64 x 64 = 4096 conversations at once, 256 + 8192 tokens each: 34,603,008 tokens, more
    # than any pool under 80 GiB holds for 0.5B (every stage fits at every fraction).
    text = str(info.value)
    assert "need 34603008" in text and "maxConcurrentConversations" in text, text
    assert "leave no KV cache" not in text


def test_short_host_memory_is_refused_naming_spec_resources_memory() -> None:
    s = RLJobSpec.model_validate({
        "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "shape": QWEN25_05B},
        "rollout": {"engine": "sglang", "memFractionStatic": AUTO},
        "resources": {"gpusPerWorker": 1, "memory": "768Mi", "sharedMemory": "256Mi"},
    })  # fmt: skip
    shape = shape_for(s)
    assert shape is not None
    # The load's largest slice, the 151936 x 896 embedding, as stored (bf16) and as fp32:
    # 136,134,656 x 6 = 816,807,936 bytes (0.76 GiB) in a pod of 768 MiB (0.75 GiB).
    with pytest.raises(AutoRefused) as info:
        auto_choice(s, shape, CARD, 1)
    text = str(info.value)
    assert "load needs 0.76 GiB of host memory per worker pod" in text, text
    assert "spec.resources.memory is 0.75 GiB" in text and "raise spec.resources.memory" in text


QWEN25_05B = {"numHiddenLayers": 24, "hiddenSize": 896, "intermediateSize": 4864,
              "numAttentionHeads": 14, "numKeyValueHeads": 2, "vocabSize": 151936,
              "tieWordEmbeddings": True}  # fmt: skip
QWEN25_1_5B = {"numHiddenLayers": 28, "hiddenSize": 1536, "intermediateSize": 8960,
               "numAttentionHeads": 12, "numKeyValueHeads": 2, "vocabSize": 151936,
               "tieWordEmbeddings": True}  # fmt: skip
QWEN25_7B = {"numHiddenLayers": 28, "hiddenSize": 3584, "intermediateSize": 18944,
             "numAttentionHeads": 28, "numKeyValueHeads": 4, "vocabSize": 152064,
             "tieWordEmbeddings": False}  # fmt: skip


def job(path: str, shape: dict[str, Any], gpus: int, gpu_memory: int, **rollout: Any) -> RLJobSpec:
    """An sglang job of this model shape on `gpus` GPUs of `gpu_memory` bytes."""
    return RLJobSpec.model_validate(
        {
            "model": {"path": path, "shape": shape},
            "rollout": rollout,
            "resources": {"gpusPerWorker": gpus},
            "memoryPlan": {"gpuMemory": str(gpu_memory)},
        }
    )


def spec(**rollout: Any) -> RLJobSpec:
    """A Qwen2.5-1.5B-shaped sglang job on one GPU (the issue's smallest GPU point)."""
    auto = {"memFractionStatic": AUTO, "wakeUp": AUTO, **rollout}
    return job("Qwen/Qwen2.5-1.5B-Instruct", QWEN25_1_5B, 1, 85017034752, **auto)


H100 = 85_017_034_752


def test_a_card_smaller_than_the_weights_is_refused_with_the_stage_short() -> None:
    s = spec()
    shape = shape_for(s)
    assert shape is not None
    with pytest.raises(AutoRefused) as info:
        auto_choice(s, shape, 2 * GiB)
    text = str(info.value)
    assert "GiB short" in text and "leave no KV cache" in text


def test_auto_on_the_plan_is_the_largest_fraction_under_the_margin() -> None:
    s = spec()
    shape = shape_for(s)
    assert shape is not None
    choice = auto_choice(s, shape, H100)
    chosen = choice.chosen
    assert chosen.wake_up is WakeUp.STAGED  # staged's pool is larger at 1.5B on an H100
    assert choice.margin == DEFAULT_PLAN_MARGIN
    assert all(st.peak_bytes + ALLOCATOR_SLACK_BYTES <= choice.limit_bytes for st in chosen.stages)
    # One grid step up passes the limit: Auto stops at the margin, not before it.
    up = [
        c
        for c in choice.candidates
        if c.wake_up is WakeUp.STAGED
        and c.mem_fraction_static == round(chosen.mem_fraction_static + 0.01, 4)
    ]
    assert up and not up[0].fits_under(choice.limit_bytes)
    # With no margin, Auto's fraction is the plan's largest fitting one.
    bare = s.model_copy(update={"memory_plan": s.memory_plan.model_copy(update={"margin": 0.0})})
    fixed = bare.model_copy(
        update={"rollout": bare.rollout.model_copy(update={"wake_up": WakeUp.STAGED})}
    )
    assert auto_choice(fixed, shape, H100).chosen.mem_fraction_static == (
        largest_fitting_fraction(bare, shape, H100, WakeUp.STAGED)
    )


def test_status_plan_records_the_choice_bounded() -> None:
    s = spec()
    shape = shape_for(s)
    assert shape is not None
    memory_plan = plan(s, shape, H100)
    status = memory_plan.to_status()
    assert status.auto is not None
    assert (status.wake_up, status.mem_fraction_static) == (
        memory_plan.auto.chosen.wake_up,  # type: ignore[union-attr]
        memory_plan.auto.chosen.mem_fraction_static,  # type: ignore[union-attr]
    )
    assert status.auto.planned == 2 * 99
    assert status.auto.margin == DEFAULT_PLAN_MARGIN
    rows = [(c.wake_up, c.fits) for c in status.auto.candidates]
    assert rows == [
        (WakeUp.STAGED, True), (WakeUp.STAGED, False), (WakeUp.SINGLE, True), (WakeUp.SINGLE, False)
    ]  # fmt: skip
    lines = auto_lines(status)
    assert lines[0].startswith(
        f"rollout Auto chose wakeUp staged, memFractionStatic {status.mem_fraction_static:.2f}"
    )
    assert len(lines) == 2 + len(status.auto.candidates)


def test_wake_up_auto_with_a_fixed_fraction_plans_both_modes_at_it() -> None:
    s = spec(memFractionStatic=0.8)
    shape = shape_for(s)
    assert shape is not None
    choice = auto_choice(s, shape, H100)
    assert {(c.wake_up, c.mem_fraction_static) for c in choice.candidates} == {
        (WakeUp.STAGED, 0.8), (WakeUp.SINGLE, 0.8)
    }  # fmt: skip
    assert choice.chosen.wake_up is WakeUp.STAGED  # the same pool: staged on the tie


def test_admission_plans_auto_on_gpu_memory() -> None:
    admission = admit(spec())
    assert admission.status == "True" and admission.start
    assert "Auto chose wakeUp staged" in admission.message
    small = spec().model_copy(
        update={"memory_plan": spec().memory_plan.model_copy(update={"gpu_memory": "2Gi"})}
    )
    refused = admit(small)
    assert (refused.status, refused.reason) == ("False", "PlanMisfit")
    assert "rollout Auto: nothing fits" in refused.message and "GiB short" in refused.message


# -- weightSyncBucketMegabytes Auto -------------------------------------------------------------

H200 = 150_754_820_096  # NVIDIA H200, mem_get_info total (143771 MiB)


def spec_7b(**rollout: Any) -> RLJobSpec:
    """A Qwen2.5-7B-shaped sglang job over two GPUs (FSDP and one engine per card)."""
    auto = {"weightSyncBucketMegabytes": AUTO, **rollout}
    return job("Qwen/Qwen2.5-7B-Instruct", QWEN25_7B, 2, H200, **auto)


def test_bucket_auto_is_the_whole_model_where_it_fits_and_keeps_the_kv_autos_choice() -> None:
    """Staged at 7B on two H200s: one bucket of the whole model fits under the limit (the
    weight-sync stage runs before the KV cache is back), and Auto's mode, fraction and KV
    cache are the ones it chooses with the smallest bucket."""
    s = spec_7b(memFractionStatic=AUTO, wakeUp=AUTO)
    shape = shape_for(s)
    assert shape is not None
    choice = auto_choice(s, shape, H200)
    smallest = auto_choice(_with_bucket(s, 512), shape, H200)
    assert smallest.bucket_megabytes is None
    assert choice.bucket_megabytes == whole_model_megabytes(s, shape) == 14526
    kept = (choice.chosen.wake_up, choice.chosen.mem_fraction_static, choice.chosen.parts.kv_tokens)
    assert kept == (
        smallest.chosen.wake_up,
        smallest.chosen.mem_fraction_static,
        smallest.chosen.parts.kv_tokens,
    )
    # The plan Auto returns is the one at the bucket chosen: its transient is larger and fits.
    assert choice.chosen.parts.gather > smallest.chosen.parts.gather
    assert choice.chosen.fits_under(choice.limit_bytes)
    resolved = choice.resolve(s)
    assert resolved_bucket_bytes(resolved) == 14526 << 20
    with pytest.raises(ValueError, match="not resolved"):
        resolved_bucket_bytes(s)
    status = plan(s, shape, H200).to_status()
    assert status.auto is not None and status.auto.weight_sync_bucket_megabytes == 14526
    assert "weight-sync bucket 14526 MiB" in status.auto.reason
    # Only the bucket Auto: the spec's mode and fraction, the bucket chosen the same way.
    only = auto_choice(spec_7b(memFractionStatic=0.85, wakeUp="staged"), shape, H200)
    assert only.bucket_megabytes == 14526 and only.chosen.mem_fraction_static == 0.85


@pytest.mark.parametrize("size", [4096, 2048, 1024, 512])
def test_bucket_auto_takes_the_largest_size_whose_plan_fits_the_limit(size: int) -> None:
    """In single mode the buckets sit beside the KV cache, so each larger size raises the worst
    stage: with the limit at one size's peak, that size is chosen and no larger one. (The
    whole-model bucket is left out: at this fraction it fits only with the params offloaded
    too, which Auto never buys; the next test.)"""
    s = spec_7b(memFractionStatic=0.6, wakeUp="single")
    shape = shape_for(s)
    assert shape is not None
    plans = {
        mb: mode_plan(_with_bucket(s, mb), shape, H200) for mb in (512, 1024, 2048, 4096, 14526)
    }
    peaks = [plans[mb].worst.peak_bytes for mb in sorted(plans)]
    assert peaks == sorted(set(peaks))  # strictly rising with the bucket
    limit = plans[size].worst.peak_bytes + ALLOCATOR_SLACK_BYTES
    smallest = mode_plan(_with_bucket(s, 512), shape, H200, None, limit)
    bucket, chosen = auto_bucket(s, shape, H200, None, limit, smallest)
    assert bucket == size
    assert chosen.worst.peak_bytes == plans[size].worst.peak_bytes


@pytest.mark.parametrize("fraction", [0.35, 0.45, 0.55, 0.58, 0.78])
def test_bucket_auto_runs_the_offload_a_fixed_bucket_would(fraction: float) -> None:
    """Only the bucket Auto: the mode and fraction are planned as with the fixed 512 (offload
    chosen under the card, not the margin), and a larger bucket is taken only with that same
    offload and KV cache: never bought with a PCIe round trip every iteration."""
    s = spec_7b(memFractionStatic=fraction, wakeUp="single")
    shape = shape_for(s)
    assert shape is not None
    choice = auto_choice(s, shape, H200)
    fixed = mode_plan(_with_bucket(s, 512), shape, H200)
    kept = (fixed.offload_optimizer, fixed.offload_params, fixed.parts.kv_tokens)
    got = (choice.chosen.offload_optimizer, choice.chosen.offload_params)
    assert (*got, choice.chosen.parts.kv_tokens) == kept
    if choice.bucket_megabytes != 512:  # a larger bucket: its plan fits under the limit
        assert choice.chosen.fits_under(choice.limit_bytes)


def test_the_whole_model_bucket_that_needs_an_offload_is_not_taken() -> None:
    s = spec_7b(memFractionStatic=0.45, wakeUp="single")
    shape = shape_for(s)
    assert shape is not None
    choice = auto_choice(s, shape, H200)
    whole = mode_plan(_with_bucket(s, 14526), shape, H200, None, choice.limit_bytes)
    assert whole.offload_optimizer and not choice.chosen.offload_optimizer
    assert choice.bucket_megabytes is not None and choice.bucket_megabytes < 14526


def test_bucket_auto_alone_never_refuses_a_job_a_fixed_bucket_would_run() -> None:
    """Only the bucket Auto, at a fraction whose plan passes the margin: the job is planned and
    admitted as with the fixed default bucket (512), never refused by Auto."""
    over = spec(memFractionStatic=0.97, wakeUp="staged", weightSyncBucketMegabytes=AUTO)
    fixed = spec(memFractionStatic=0.97, wakeUp="staged", weightSyncBucketMegabytes=512)
    shape = shape_for(over)
    assert shape is not None
    choice = auto_choice(over, shape, H100)
    assert not choice.chosen.fits_under(choice.limit_bytes)  # past the margin
    assert choice.bucket_megabytes == 512 and not choice.rollout_auto
    assert "512 MiB, the smallest: the plan at this mode and fraction passes the limit" in (
        choice.reason
    )
    assert (admit(over).status, admit(over).start) == (admit(fixed).status, admit(fixed).start)
    planned = plan(over, shape, H100)
    assert planned.chosen.mem_fraction_static == 0.97
    assert planned.chosen.stages == plan(fixed, shape, H100).chosen.stages


def test_bucket_auto_is_named_where_it_chose_and_only_there() -> None:
    """The admission message and the status lines name the bucket; with only the bucket Auto
    they do not credit the rollout's Auto with the mode and fraction the spec gave."""
    only = spec_7b(memFractionStatic=0.85, wakeUp="staged")
    admission = admit(only)
    assert admission.status == "True" and admission.start
    assert "wakeUp staged at memFractionStatic 0.85, Auto chose weight-sync bucket 14526 MiB" in (
        admission.message
    )
    assert "Auto chose wakeUp" not in admission.message
    shape = shape_for(only)
    assert shape is not None
    lines = auto_lines(plan(only, shape, H200).to_status())
    assert lines == [lines[0]] and lines[0].startswith(  # no candidates of mode and fraction
        "weightSyncBucketMegabytes Auto chose 14526 MiB at wakeUp staged, memFractionStatic 0.85"
    )
    both = spec_7b(memFractionStatic=AUTO, wakeUp=AUTO)
    assert "Auto chose wakeUp staged" in admit(both).message
    assert ", weight-sync bucket 14526 MiB" in admit(both).message
    assert auto_lines(plan(both, shape, H200).to_status())[0].startswith("rollout Auto chose")


def test_the_other_modes_table_is_planned_at_the_smallest_bucket() -> None:
    """`rljob plan`'s rows: the mode Auto chose at its bucket, the other at 512 (the size Auto
    chose fits the chosen mode only)."""
    s = spec_7b(memFractionStatic=0.85, wakeUp="staged")
    shape = shape_for(s)
    assert shape is not None
    planned = plan(s, shape, H200)
    single = planned.modes[WakeUp.SINGLE]
    at_512 = mode_plan(
        _with_bucket(spec_7b(memFractionStatic=0.85, wakeUp="single"), 512), shape, H200
    )
    assert single.stages == at_512.stages
    assert (
        planned.modes[WakeUp.STAGED].parts.gather
        == planned.chosen.parts.gather
        > single.parts.gather
    )


# -- the OOM policy under Auto -----------------------------------------------------------------


def with_policy(s: RLJobSpec) -> RLJobSpec:
    return s.model_copy(update={"oom_policy": s.oom_policy.model_copy(update={"max_retries": 2})})


def test_first_knobs_carry_auto_and_the_margin() -> None:
    knobs = first_knobs(spec())
    assert (knobs.mem_fraction_static, knobs.wake_up, knobs.margin) == (AUTO, AUTO, 0.015)
    assert first_knobs(spec(memFractionStatic=0.8, wakeUp="staged")).margin is None


def test_a_retry_raises_the_margin_by_the_measured_overshoot() -> None:
    s = with_policy(spec())
    knobs = first_knobs(s)
    # The stage planned 76 GiB; at the OOM 4 GiB were free and 3 GiB asked: it needed 79 GiB
    # of 80 GiB, 3 GiB (3.75% of the card) over its plan.
    outcome = Outcome(
        "CUDAOutOfMemory", Stage.WAKE_KV_CACHE, 0, requested_bytes=3 * GiB, free_bytes=4 * GiB,
        capacity_bytes=CARD, planned_peak_bytes=76 * GiB,
    )  # fmt: skip
    assert outcome.overshoot_bytes == 3 * GiB
    decision = next_attempt(s, knobs, 1, outcome)
    assert decision.retry and decision.knobs is not None
    assert decision.knobs.margin == round(0.015 + 0.0375, 4)
    assert decision.knobs.mem_fraction_static == AUTO  # the driver chooses again on the card
    changed = decision.changed(knobs, s)
    assert changed.startswith("memoryPlan.margin 0.015 -> 0.0525: wake_kv_cache needed 3.00 GiB")
    assert "3.75% of the GPU" in changed


def test_a_tiny_overshoot_still_moves_one_grid_step_and_an_unmeasured_one_the_fraction_step() -> (
    None
):
    s = with_policy(spec())
    knobs = first_knobs(s)
    tiny = Outcome(
        "CUDAOutOfMemory", Stage.ROLLOUT, 0, requested_bytes=1 << 20, free_bytes=1 << 20,
        capacity_bytes=CARD, planned_peak_bytes=CARD - (1 << 20),
    )  # fmt: skip
    assert next_attempt(s, knobs, 1, tiny).knobs == knobs.model_copy(update={"margin": 0.025})
    blind = next_attempt(s, knobs, 1, Outcome("CUDAOutOfMemory", Stage.ROLLOUT, 0))
    assert blind.knobs is not None and blind.knobs.margin == 0.065  # + fractionStep 0.05
    assert "not measured" in blind.why


def test_a_training_oom_under_auto_keeps_the_training_knobs_semantics() -> None:
    s = with_policy(spec())
    decision = next_attempt(s, first_knobs(s), 1, Outcome("CUDAOutOfMemory", Stage.TRAIN, 0))
    assert decision.knobs is not None
    assert (decision.knobs.micro_batch_size, decision.knobs.margin) == (1, 0.015)


def test_the_margin_stops_below_one_half() -> None:
    s = with_policy(spec())
    knobs = AttemptKnobs(mem_fraction_static=AUTO, wake_up=AUTO, margin=0.45)
    decision = next_attempt(s, knobs, 1, Outcome("CUDAOutOfMemory", Stage.ROLLOUT, 0))
    assert not decision.retry and "no knobs left" in decision.message


def test_the_operator_measures_the_overshoot_against_this_attempts_plan_only() -> None:
    s = with_policy(spec())
    oom = {"id": "cuda/0/t", "kind": "CUDAOutOfMemory", "time": "2026-11-25T10:00:07Z",
           "stage": "rollout", "rank": 0, "iteration": 1, "attempt": 1,
           "requestedBytes": 2 * GiB, "freeBytes": 3 * GiB}  # fmt: skip
    plan_status = {"capacityBytes": CARD, "attempt": 1,
                   "stages": [{"name": "rollout", "peakBytes": 77 * GiB}]}  # fmt: skip
    rayjob = {"metadata": {"name": "j", "creationTimestamp": "2026-11-25T10:00:00Z"},
              "status": {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"}}  # fmt: skip
    out = attempts.outcome(rayjob, [oom], 1, plan_status)
    assert out.overshoot_bytes == 2 * GiB
    stale = attempts.outcome(rayjob, [oom], 1, {**plan_status, "attempt": 2})
    assert stale.overshoot_bytes is None
    step = attempts.advance("j", s, {"oomEvents": [oom], "plan": plan_status}, rayjob)
    assert step.attempts is not None
    second = step.attempts[1]
    assert (second["memFractionStatic"], second["wakeUp"], second["margin"]) == (
        "Auto", "Auto", 0.04,
    )  # fmt: skip
    assert second["changed"].startswith("memoryPlan.margin 0.015 -> 0.04: rollout needed 2.00 GiB")


def test_kubectl_rljob_describe_prints_autos_choice() -> None:
    from rich.console import Console

    from rljob.api import RLJobStatus
    from rljob.kubectl_plugin import describe

    s = spec()
    shape = shape_for(s)
    assert shape is not None
    status = RLJobStatus(plan=plan(s, shape, H100).to_status())
    console = Console(record=True, width=200)
    describe("auto", status, console)
    text = console.export_text()
    assert "rollout Auto chose wakeUp staged, memFractionStatic" in text
    assert "margin 1.5% of 79.18 GiB" in text


@pytest.mark.parametrize("rollout", [{"memFractionStatic": 0.55, "wakeUp": "single"},
                                     {"memFractionStatic": AUTO, "wakeUp": AUTO}],
                         ids=["fixed-fraction", "rollout-auto"])  # fmt: skip
def test_an_engine_oom_under_bucket_auto_retries_with_the_smallest_bucket_fixed(
    rollout: dict[str, Any],
) -> None:
    """Whatever else the retry changes (staged, a lower fraction, a larger margin), it runs the
    smallest bucket Auto takes, fixed: the room it frees never goes to a larger bucket. The
    knob is recorded in status.attempts and read back from there; a training OOM keeps Auto."""
    s = with_policy(spec_7b(**rollout))
    knobs = first_knobs(s)
    outcome = Outcome("CUDAOutOfMemory", Stage.WAKE_WEIGHTS, 0)
    decision = next_attempt(s, knobs, 1, outcome)
    assert decision.retry and decision.knobs is not None
    assert decision.knobs.weight_sync_bucket_megabytes == 512
    retry = decision.knobs.apply(s)
    assert retry.rollout.weight_sync_bucket_megabytes == 512
    assert "rollout.weightSyncBucketMegabytes Auto -> 512" in decision.changed(knobs, s)
    # The operator's status entry carries it, and the next attempt's knobs are read back.
    entry = attempts.entry("j", 2, decision.knobs)
    assert entry["weightSyncBucketMegabytes"] == 512
    assert attempts.current("j", s, {"attempts": [entry]}).knobs == decision.knobs
    # A later engine OOM keeps it; a training OOM never sets it.
    again = next_attempt(s, decision.knobs, 2, outcome)
    assert again.knobs is None or again.knobs.weight_sync_bucket_megabytes == 512
    training = next_attempt(s, knobs, 1, Outcome("CUDAOutOfMemory", Stage.TRAIN, 0))
    assert training.knobs is not None and training.knobs.weight_sync_bucket_megabytes is None
