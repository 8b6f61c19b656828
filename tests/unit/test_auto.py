"""rollout Auto (issue 35): the choice on tables of predicted peaks, on the real plan, at
admission, and the OOM policy's retry by the measured overshoot (rljob/plan.py auto_choice,
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
    auto_choice,
    auto_lines,
    choose,
    largest_fitting_fraction,
    plan,
    shape_for,
)
from rljob.report import Stage
from rljob_operator import attempts

pytestmark = pytest.mark.unit

CARD = 80 * GiB


def candidate(
    mode: WakeUp, fraction: float, peak_gib: float, kv_tokens: int, stage: Stage = Stage.ROLLOUT
) -> ModePlan:
    """One row of a table: a candidate whose worst stage peaks at `peak_gib`."""
    parts = Parts(
        context=0, train_params=0, optimizer=0, grads=0, step_temp=0, step_cache=0,
        activations=0, fsdp_buffers=0, engine_weights=3 * GiB, kv_pool=kv_tokens * 1024,
        kv_tokens=kv_tokens, gather=0, rollout_workspace=0,
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


def spec(**rollout: Any) -> RLJobSpec:
    """A Qwen2.5-1.5B-shaped sglang job on one GPU (the issue's smallest GPU point)."""
    return RLJobSpec.model_validate(
        {
            "model": {
                "path": "Qwen/Qwen2.5-1.5B-Instruct",
                "shape": {"numHiddenLayers": 28, "hiddenSize": 1536, "intermediateSize": 8960,
                          "numAttentionHeads": 12, "numKeyValueHeads": 2, "vocabSize": 151936,
                          "tieWordEmbeddings": True},
            },
            "rollout": {"memFractionStatic": AUTO, "wakeUp": AUTO, **rollout},
            "resources": {"gpusPerWorker": 1},
            "memoryPlan": {"gpuMemory": "85017034752"},
        }
    )  # fmt: skip


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
