"""The operator's side of the OOM policy as pure functions (rljob_operator/attempts.py): which
attempt is current, how a failed attempt ended, status.attempts after an observation, and the
status fields and render output that follow from it."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from rljob.api import JOB_CONFIG_FILE, AttemptKnobs, JobConfig, RLJobSpec, WakeUp
from rljob_operator import attempts, render, status

pytestmark = pytest.mark.unit

CREATED_AT = "2026-11-25T10:00:00Z"


def spec(max_retries: int = 2, wake_up: str = "staged", **policy: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(
        {
            "rollout": {"memFractionStatic": 0.85, "wakeUp": wake_up},
            "oomPolicy": {"maxRetries": max_retries, **policy},
        }
    )


def rayjob(name: str, job_status: str = "FAILED", deployment: str = "Failed") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": CREATED_AT},
        "status": {"jobStatus": job_status, "jobDeploymentStatus": deployment},
    }


def cuda(time: str, stage: str = "wake_kv_cache", rank: int = 0) -> dict[str, Any]:
    return {"id": f"cuda/{rank}/{time}", "kind": "CUDAOutOfMemory", "time": time,
            "stage": stage, "rank": rank, "iteration": 1}  # fmt: skip


def killed(time: str) -> dict[str, Any]:
    return {"id": "killed/p/c", "kind": "OOMKilled", "time": time, "pod": "j-workers-x",
            "container": "ray-worker", "limitBytes": 1 << 30}  # fmt: skip


def test_policy_off_writes_no_attempts() -> None:
    step = attempts.advance("j", spec(0), {"oomEvents": [cuda("2026-11-25T10:00:09Z")]},
                            rayjob("j"))  # fmt: skip
    assert step == attempts.Step(None)


def test_first_observation_records_attempt_one_running() -> None:
    step = attempts.advance("j", spec(), {}, rayjob("j", "RUNNING", "Running"))
    assert step.attempts == [
        {"attempt": 1, "rayJob": "j", "memFractionStatic": 0.85, "wakeUp": "staged",
         "result": "Running", "message": "", "startedAt": CREATED_AT}
    ]  # fmt: skip
    assert step.retry is None and step.stop is None


def test_an_oom_after_the_start_retries_with_the_lowered_fraction() -> None:
    current = {"oomEvents": [cuda("2026-11-25T10:00:07Z")]}
    step = attempts.advance("j", spec(), current, rayjob("j"))
    assert step.attempts is not None
    first, second = step.attempts
    assert (first["result"], first["oomStage"], first["oomRank"]) == (
        "CUDAOutOfMemory", "wake_kv_cache", 0,
    )  # fmt: skip
    assert "attempt 2 runs with rollout.memFractionStatic 0.85 -> 0.8" in first["message"]
    assert second["changed"] == "rollout.memFractionStatic 0.85 -> 0.8"
    assert second == {"attempt": 2, "rayJob": "j-a2", "memFractionStatic": 0.8,
                      "wakeUp": "staged", "result": "Running", "message": "",
                      "changed": "rollout.memFractionStatic 0.85 -> 0.8"}  # fmt: skip
    assert step.retry == attempts.Current(2, "j-a2", AttemptKnobs(mem_fraction_static=0.8,
                                                                  wake_up=WakeUp.STAGED))  # fmt: skip


def test_single_becomes_staged_first() -> None:
    current = {"oomEvents": [cuda("2026-11-25T10:00:07Z")]}
    step = attempts.advance("j", spec(wake_up="single"), current, rayjob("j"))
    assert step.retry is not None and step.retry.knobs == AttemptKnobs(
        mem_fraction_static=0.85, wake_up=WakeUp.STAGED
    )


def test_the_same_observation_gives_the_same_answer_and_an_old_rayjob_changes_nothing() -> None:
    current: dict[str, Any] = {"oomEvents": [cuda("2026-11-25T10:00:07Z")]}
    step = attempts.advance("j", spec(), current, rayjob("j"))
    recorded = {**current, "attempts": step.attempts}
    # The first attempt's RayJob seen again (an operator restart lists it): not current.
    again = attempts.advance("j", spec(), recorded, rayjob("j"))
    assert again.attempts == step.attempts and again.retry is None
    assert attempts.current("j", spec(), recorded).ray_job == "j-a2"
    assert attempts.current_ray_job("j", recorded) == "j-a2"


def test_an_oom_of_the_previous_attempt_is_not_this_attempts() -> None:
    # j-a2 created in the same second as attempt 1's OOM: that OOM is not attempt 2's.
    previous = [
        {"attempt": 1, "rayJob": "j", "memFractionStatic": 0.85, "wakeUp": "staged",
         "result": "CUDAOutOfMemory", "message": "m"},
        {"attempt": 2, "rayJob": "j-a2", "memFractionStatic": 0.8, "wakeUp": "staged",
         "result": "Running", "message": ""},
    ]  # fmt: skip
    current = {"attempts": previous, "oomEvents": [cuda(CREATED_AT)]}
    step = attempts.advance("j", spec(), current, rayjob("j-a2"))
    assert step.attempts is not None and step.attempts[-1]["result"] == "Failed"
    assert step.retry is None and step.stop is None


def test_a_third_oom_exhausts_max_retries_two() -> None:
    made = [attempts.entry("j", n, AttemptKnobs(mem_fraction_static=f, wake_up=WakeUp.STAGED))
            for n, f in ((1, 0.85), (2, 0.8), (3, 0.75))]  # fmt: skip
    current = {"attempts": made, "oomEvents": [cuda("2026-11-25T10:00:30Z", "rollout", 1)]}
    step = attempts.advance("j", spec(), current, rayjob("j-a3"))
    assert step.retry is None and step.stop is not None
    assert step.stop[0] == "OOMRetriesExhausted" and "attempt 3" in step.stop[1]
    assert step.attempts is not None and len(step.attempts) == 3
    assert (step.attempts[-1]["oomStage"], step.attempts[-1]["oomRank"]) == ("rollout", 1)


def test_oomkilled_is_not_retried_and_names_the_limit() -> None:
    step = attempts.advance("j", spec(), {"oomEvents": [killed("2026-11-25T10:00:05Z")]},
                            rayjob("j"))  # fmt: skip
    assert step.stop is not None and step.stop[0] == "OOMKilled"
    assert str(1 << 30) in step.stop[1] and "j-workers-x" in step.stop[1]
    assert step.attempts is not None and step.attempts[-1]["result"] == "OOMKilled"


@pytest.mark.parametrize(
    ("job_status", "deployment", "result"),
    [("RUNNING", "Running", "Running"), ("", "Initializing", "Running"),
     ("SUCCEEDED", "Complete", "Succeeded"), ("FAILED", "Failed", "Failed")],
)  # fmt: skip
def test_the_current_attempts_result_follows_its_rayjob(
    job_status: str, deployment: str, result: str
) -> None:
    step = attempts.advance("j", spec(), {}, rayjob("j", job_status, deployment))
    assert step.attempts is not None and step.attempts[-1]["result"] == result


def test_new_retries_and_needs_attention() -> None:
    one = [{"attempt": 1, "rayJob": "j", "message": "m1"}]
    two = [*one, {"attempt": 2, "rayJob": "j-a2"}]
    assert attempts.new_retries(one, two) == [(2, "m1")]
    assert attempts.new_retries(two, two) == []
    policy = {"oomPolicy": {"maxRetries": 2}}
    # A retry whose RayJob status does not mirror yet.
    assert attempts.needs_attention(policy, {"attempts": two, "rayJob": {"name": "j"}})
    assert not attempts.needs_attention(policy, {"attempts": two, "rayJob": {"name": "j-a2"}})
    # A failure decided before the OOM record arrived.
    failed = [{"attempt": 1, "rayJob": "j", "result": "Failed", "startedAt": CREATED_AT}]
    oom = [cuda("2026-11-25T10:00:07Z")]
    assert attempts.needs_attention(policy, {"attempts": failed, "oomEvents": oom})
    assert not attempts.needs_attention(policy, {"attempts": failed})
    assert not attempts.needs_attention({}, {"oomEvents": oom})
    # An entry from before startedAt existed is not looked at again (no polling for good).
    unknown = [{"attempt": 1, "rayJob": "j", "result": "Failed"}]
    assert not attempts.needs_attention(policy, {"attempts": unknown, "oomEvents": oom})


def test_a_finished_attempts_rayjob_is_stood_in_for_by_its_mirror() -> None:
    """KubeRay may delete a finished RayJob before the driver's OOM lands: the decision is made
    from status's mirror (name, status, startedAt), never by applying the attempt again."""
    failed = [{"attempt": 1, "rayJob": "j", "memFractionStatic": 0.85, "wakeUp": "staged",
               "result": "Failed", "message": "", "startedAt": CREATED_AT}]  # fmt: skip
    mirror = {"name": "j", "jobStatus": "FAILED", "jobDeploymentStatus": "Failed"}
    current = {"phase": "Failed", "attempts": failed, "rayJob": mirror,
               "oomEvents": [cuda("2026-11-25T10:00:07Z")]}  # fmt: skip
    stand_in = attempts.mirrored_rayjob("j", current, "u")
    assert stand_in == {
        "metadata": {"name": "j", "creationTimestamp": CREATED_AT,
                     "labels": {"rljob.dev/job-uid": "u"}},
        "status": {"jobStatus": "FAILED", "jobDeploymentStatus": "Failed"},
    }  # fmt: skip
    step = attempts.advance("j", spec(), current, stand_in)
    assert step.attempts is not None and step.attempts[0]["result"] == "CUDAOutOfMemory"
    assert step.retry is not None and step.retry.ray_job == "j-a2"
    # Not finished (still running, or no startedAt): no stand-in.
    assert attempts.mirrored_rayjob("j", {**current, "phase": "Running"}, "u") is None
    no_start = [{k: v for k, v in failed[0].items() if k != "startedAt"}]
    assert attempts.mirrored_rayjob("j", {**current, "attempts": no_start}, "u") is None


def test_a_late_oom_wants_attention_until_decided_and_an_earlier_attempts_never() -> None:
    """Bounded: the operator's timer takes the policy's step while this holds, so it must turn
    false once the step is recorded, and stay false for a job whose earlier attempt OOMed and
    whose last one failed otherwise (before startedAt it stayed true for good)."""
    policy = {"oomPolicy": {"maxRetries": 2}}
    first = {"attempt": 1, "rayJob": "j", "memFractionStatic": 0.85, "wakeUp": "staged",
             "result": "CUDAOutOfMemory", "message": "m", "startedAt": CREATED_AT}  # fmt: skip
    second = {"attempt": 2, "rayJob": "j-a2", "memFractionStatic": 0.8, "wakeUp": "staged",
              "result": "Failed", "message": "", "startedAt": "2026-11-25T10:05:00Z"}  # fmt: skip
    earlier = [cuda("2026-11-25T10:01:00Z")]  # attempt 1's OOM
    mirrored = {"name": "j-a2"}
    quiet = {"attempts": [first, second], "oomEvents": earlier, "rayJob": mirrored}
    assert not attempts.needs_attention(policy, quiet)
    # Attempt 2's own OOM, recorded after its failure: attention, until the decision is in.
    late = {**quiet, "oomEvents": [*earlier, cuda("2026-11-25T10:06:00Z", "rollout")]}
    assert attempts.needs_attention(policy, late)
    step = attempts.advance("j", spec(), late, {**rayjob("j-a2"), "metadata": {
        "name": "j-a2", "creationTimestamp": "2026-11-25T10:05:00Z"}})  # fmt: skip
    assert step.attempts is not None and step.attempts[1]["result"] == "CUDAOutOfMemory"
    decided = {**late, "attempts": step.attempts[:2]}
    assert not attempts.needs_attention(policy, decided)
    # An OOM in the second its RayJob was created is the previous attempt's (outcome's rule).
    same_second = {**quiet, "oomEvents": [cuda("2026-11-25T10:05:00Z")]}
    assert not attempts.needs_attention(policy, same_second)


def _observed(step: attempts.Step, rj: dict[str, Any] | None) -> status.Observed:
    return status.Observed(generation=1, spec=spec(), applied_spec=spec(), rayjob=rj,
                           attempts=step.attempts, oom_stop=step.stop)  # fmt: skip


def test_status_keeps_the_retry_pending_and_fails_an_exhausted_job() -> None:
    retry = attempts.advance("j", spec(), {"oomEvents": [cuda("2026-11-25T10:00:07Z")]},
                             rayjob("j"))  # fmt: skip
    fields, _ = status.compute(_observed(retry, None), "2026-11-25T10:00:08Z")
    assert fields["phase"] == "Pending" and len(fields["attempts"]) == 2
    created = next(c for c in fields["conditions"] if c["type"] == "Created")
    assert "j-a2" in created["message"]
    made = [attempts.entry("j", n, AttemptKnobs(mem_fraction_static=f, wake_up=WakeUp.STAGED))
            for n, f in ((1, 0.85), (2, 0.8), (3, 0.75))]  # fmt: skip
    stop = attempts.advance("j", spec(), {"attempts": made,
                            "oomEvents": [cuda("2026-11-25T10:00:30Z")]}, rayjob("j-a3"))  # fmt: skip
    # Failed=True RayJobFailed first (the OOM record came later): the policy's reason is news.
    before = [{"type": "Failed", "status": "True", "reason": "RayJobFailed", "message": "",
               "lastTransitionTime": "2026-11-25T10:00:29Z"}]  # fmt: skip
    observed = status.Observed(generation=1, spec=spec(), applied_spec=spec(),
                               rayjob=rayjob("j-a3"), previous_conditions=before,
                               attempts=stop.attempts, oom_stop=stop.stop)  # fmt: skip
    fields, transitions = status.compute(observed, "2026-11-25T10:00:31Z")
    failed = next(c for c in fields["conditions"] if c["type"] == "Failed")
    assert fields["phase"] == "Failed" and failed["reason"] == "OOMRetriesExhausted"
    assert failed["lastTransitionTime"] == "2026-11-25T10:00:29Z"
    assert [(t.reason, t.event_type) for t in transitions if t.type == "Failed"] == [
        ("OOMRetriesExhausted", "Warning")
    ]


def test_render_names_the_attempts_rayjob_and_puts_its_knobs_in_the_job_config() -> None:
    owner = render.Owner(name="j", namespace="ns", uid="u")
    knobs = AttemptKnobs(mem_fraction_static=0.8, wake_up=WakeUp.STAGED)
    kids = {c["kind"]: c for c in render.children(owner, spec(), 2, knobs)}
    assert kids["RayJob"]["metadata"]["name"] == "j-a2"
    assert kids["RayJob"]["metadata"]["labels"]["rljob.dev/job"] == "j"
    config = JobConfig.from_yaml(kids["ConfigMap"]["data"][JOB_CONFIG_FILE])
    assert (config.attempt, config.knobs) == (2, knobs)
    assert config.spec == spec()  # the user's spec, unchanged
    assert config.effective_spec.rollout.mem_fraction_static == 0.8
    # Attempt 1 renders exactly as before the policy existed.
    assert render.children(owner, spec(), 1, None) == render.children(owner, spec())
    plain = JobConfig.from_yaml(render.config_map(owner, spec())["data"][JOB_CONFIG_FILE])
    assert (plain.attempt, plain.knobs) == (1, None)


def test_a_retry_restarts_the_startup_clock() -> None:
    job = {
        "metadata": {"creationTimestamp": "2026-11-25T09:00:00Z"},
        "spec": {"startupTimeoutSeconds": 60},
        "status": {
            "phase": "Pending",
            "attempts": [{"attempt": 1}, {"attempt": 2}],
            "conditions": [{"type": "Created", "status": "False",
                            "lastTransitionTime": "2026-11-25T10:00:00Z"}],
        },
    }  # fmt: skip
    deadline = status.startup_deadline(job)
    assert deadline is not None and deadline.isoformat() == "2026-11-25T10:01:00+00:00"


def test_a_finished_attempt_stands_and_a_running_or_retried_one_does_not() -> None:
    """status.rayJob mirrors the current attempt's RayJob as ended and the phase followed it:
    the RayJob's deletion afterwards must not reopen the job (attempts.finished)."""

    def held(phase: str, name: str, job: str, deployment: str, **more: Any) -> dict[str, Any]:
        mirrored = {"name": name, "jobStatus": job, "jobDeploymentStatus": deployment}
        return {"phase": phase, "rayJob": mirrored, **more}

    assert attempts.finished("j", held("Succeeded", "j", "SUCCEEDED", "Complete"))
    assert attempts.finished("j", held("Failed", "j", "FAILED", "Failed"))
    assert attempts.finished("j", held("Failed", "j", "STOPPED", "Complete"))
    assert not attempts.finished("j", held("Running", "j", "RUNNING", "Running"))
    assert not attempts.finished("j", {"phase": "Pending"})
    # attempt 2 recorded, attempt 1's RayJob still mirrored: the retry is not finished
    retry = [{"attempt": 1, "rayJob": "j", "result": "Failed"}, {"attempt": 2, "rayJob": "j-a2"}]
    assert not attempts.finished("j", held("Pending", "j", "FAILED", "Failed", attempts=retry))
    done = [*retry[:1], {**retry[1], "result": "Succeeded"}]
    assert attempts.finished("j", held("Succeeded", "j-a2", "SUCCEEDED", "Complete", attempts=done))
    assert attempts.ended(
        {"status": {"jobStatus": "STOPPED", "jobDeploymentStatus": "Complete"}}
    ) == (attempts.FAILED)


def numbered(time: str, attempt: int, stage: str = "wake_kv_cache") -> dict[str, Any]:
    return {**cuda(time, stage), "id": f"cuda/{attempt}/{time}", "attempt": attempt}


@pytest.mark.parametrize("skew_seconds", [-30, 30])
def test_an_oom_belongs_to_its_attempt_by_number_whatever_the_drivers_clock(
    skew_seconds: int,
) -> None:
    """The driver's node clock 30 s behind or ahead of the apiserver's: attempt 2's RayJob was
    created at 10:00:00 by the apiserver's clock. By time alone, 30 s behind would drop attempt
    2's own OOM (09:59:35 is before the RayJob) and 30 s ahead would take attempt 1's (written
    at 09:59:58 by the apiserver's clock, 10:00:28 by the driver's)."""
    drift = datetime.timedelta(seconds=skew_seconds)

    def at(apiserver_time: str) -> str:
        when = datetime.datetime.fromisoformat(apiserver_time.replace("Z", "+00:00")) + drift
        return when.strftime("%Y-%m-%dT%H:%M:%SZ")

    second = rayjob("j-a2")  # created CREATED_AT = 10:00:00
    earlier = numbered(at("2026-11-25T09:59:58Z"), 1)
    own = numbered(at("2026-11-25T10:00:05Z"), 2, stage="train")
    assert attempts.outcome(second, [earlier], 2).kind == "Failed"
    found = attempts.outcome(second, [earlier, own], 2)
    assert (found.kind, found.stage) == ("CUDAOutOfMemory", "train")
    # The same entries without numbers (an older driver) are placed by time, and the skew
    # shows: that is what the number fixes.
    unnumbered = [{k: v for k, v in e.items() if k != "attempt"} for e in (earlier, own)]
    by_time = attempts.outcome(second, unnumbered, 2)
    assert by_time.stage != "train" or skew_seconds > 0


def test_a_late_numbered_oom_is_decided_even_without_started_at() -> None:
    current = {
        "attempts": [{"attempt": 1, "rayJob": "j", "memFractionStatic": 0.85, "result": "Failed"}],
        "oomEvents": [numbered("2026-11-25T09:00:00Z", 1)],
    }
    assert attempts.late_oom_undecided({"oomPolicy": {"maxRetries": 1}}, current)
    current["oomEvents"] = [numbered("2026-11-25T09:00:00Z", 2)]  # another attempt's
    assert not attempts.late_oom_undecided({"oomPolicy": {"maxRetries": 1}}, current)


def test_a_train_stage_oom_records_the_knob_it_changed_in_the_next_attempt() -> None:
    run = RLJobSpec.model_validate(
        {"training": {"microBatchSize": 4}, "oomPolicy": {"maxRetries": 2}}
    )
    current = {"oomEvents": [numbered("2026-11-25T10:00:07Z", 1, stage="train")]}
    step = attempts.advance("j", run, current, rayjob("j"))
    assert step.attempts is not None and step.retry is not None
    first, second = step.attempts
    assert first["oomStage"] == "train"
    assert second["microBatchSize"] == 2 and second["memFractionStatic"] == 0.85
    assert second["changed"] == "training.microBatchSize 4 -> 2"
    assert (
        step.retry.knobs is not None and step.retry.knobs.apply(run).training.micro_batch_size == 2
    )
    config = JobConfig.from_yaml(
        render.config_map(render.Owner("j", "ns", "u"), run, 2, step.retry.knobs)["data"][
            JOB_CONFIG_FILE
        ]
    )
    assert config.effective_spec.training.micro_batch_size == 2 and config.uid == "u"
