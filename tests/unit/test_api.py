"""Unit tests of the RLJob API models: defaults, world size, and the cross-field rules.

Each rule is also enforced by the apiserver through CEL (tests/controlplane/test_rljob_admission.py);
here the same rule is checked on the Python side, which `rljob run` and the operator use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from rljob.api import (
    ENGINES_WITH_TAGGED_RELEASE,
    SPEC_RULES,
    EngineName,
    RLJobSpec,
    RLJobStatus,
    parse_manifest,
)

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))
BENCH_PLANS = sorted((Path(__file__).parents[2] / "bench" / "plans").glob("*.yaml"))


def test_empty_spec_gets_defaults_that_run() -> None:
    spec = RLJobSpec.model_validate({})
    assert spec.rollout.engine is EngineName.SGLANG
    assert spec.resources.gpus_per_worker == 1
    assert spec.world_size == 1


@pytest.mark.parametrize(
    ("resources", "world_size"),
    [
        ({"workers": 1, "gpusPerWorker": 0, "cpuRanksPerWorker": 2}, 2),
        ({"workers": 3, "gpusPerWorker": 0}, 3),
        ({"workers": 2, "gpusPerWorker": 8, "cpuRanksPerWorker": 5}, 16),
        ({"workers": 1, "gpusPerWorker": 1}, 1),
    ],
)
def test_world_size_is_gpus_or_cpu_ranks_times_workers(
    resources: dict[str, Any], world_size: int
) -> None:
    spec = RLJobSpec.model_validate(
        # A batch every one of these worlds divides (data.trainBatchSize's rule).
        {"rollout": {"engine": "torch"}, "resources": resources, "data": {"trainBatchSize": 48}}
    )
    assert spec.world_size == world_size


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_validates(path: Path) -> None:
    name, spec = parse_manifest(yaml.safe_load(path.read_text()))
    assert name == path.stem
    assert spec.world_size >= 1


@pytest.mark.parametrize("path", BENCH_PLANS, ids=lambda p: p.name)
def test_every_bench_manifest_validates(path: Path) -> None:
    """The manifests the GPU checks ran (bench/plans/) are valid RLJobs as they are stored."""
    name, spec = parse_manifest(yaml.safe_load(path.read_text()))
    assert name and spec.world_size >= 1


def test_tiny_local_example_is_cpu_torch_staged_with_two_ranks() -> None:
    _, spec = parse_manifest(yaml.safe_load((EXAMPLES[0].parent / "tiny-local.yaml").read_text()))
    assert spec.rollout.engine is EngineName.TORCH
    assert spec.rollout.wake_up == "staged"
    assert spec.resources.gpus_per_worker == 0
    assert spec.world_size == 2
    assert spec.algorithm.iterations >= 2


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"algorithm": {"name": "grpo", "groupSize": 1}}, "spec.algorithm.groupSize"),
        ({"resources": {"gpusPerWorker": 0}}, "spec.resources.gpusPerWorker"),
        (
            {"resources": {"gpusPerWorker": 8}, "rollout": {"tensorParallelSize": 3}},
            "spec.rollout.tensorParallelSize",
        ),
        (
            {
                "rollout": {"engine": "torch", "tensorParallelSize": 2},
                "resources": {"gpusPerWorker": 0, "cpuRanksPerWorker": 3},
            },
            "spec.rollout.tensorParallelSize",
        ),
        ({"rollout": {"memFractionStatic": 1.0}}, "memFractionStatic"),
        ({"rollout": {"memFractionStatic": 0}}, "memFractionStatic"),
        ({"resources": {"memory": "lots"}}, "memory"),
        ({"resources": {"tolerations": [{"operator": "Exists", "value": "x"}]}}, "Exists"),
        ({"rollout": {"engine": "vllm"}}, "engine"),
        ({"rollout": {"unknownKnob": 1}}, "unknownKnob"),
    ],
)
def test_invalid_spec_is_refused_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        RLJobSpec.model_validate(spec)
    assert field in str(info.value)


def test_grpo_with_group_of_one_fails_but_ppo_passes() -> None:
    assert RLJobSpec.model_validate({"algorithm": {"name": "ppo", "groupSize": 1}})
    with pytest.raises(ValidationError):
        RLJobSpec.model_validate({"algorithm": {"name": "grpo", "groupSize": 1}})


def test_staged_rule_lists_exactly_the_engines_with_tagged_release() -> None:
    rollout_rules = RLJobSpec.model_json_schema(by_alias=True)["$defs"]["RolloutSpec"][
        "x-kubernetes-validations"
    ]
    (staged,) = [r for r in rollout_rules if r["fieldPath"] == ".wakeUp"]
    for engine in EngineName:
        assert (f"'{engine.value}'" in staged["rule"]) == (engine in ENGINES_WITH_TAGGED_RELEASE)


@pytest.mark.parametrize("rule", SPEC_RULES, ids=lambda r: r.field_path)
def test_each_spec_rule_has_cel_message_and_a_field_path(rule: Any) -> None:
    assert rule.to_k8s()["fieldPath"].startswith(".")
    assert "self." in rule.cel
    assert rule.message


def test_status_round_trips_camel_case() -> None:
    wire = {
        "phase": "Running",
        "observedGeneration": 2,
        "rayJob": {"name": "j", "jobStatus": "RUNNING", "jobDeploymentStatus": "Running"},
        "oomCounts": {"OOMKilled": 2},
        "oomTotal": 2,
        "worstStageFraction": 0.91,
    }
    status = RLJobStatus.model_validate(wire)
    assert status.model_dump(by_alias=True, exclude_none=True, exclude_defaults=True) == wire
