"""The models refuse every malformed RLJob of tests/support/malformed.py, naming the field: the
same table the control-plane layer applies with kubectl, so CRD and models cannot drift."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError
from support.malformed import MALFORMED, Malformed

from rljob.api import (
    BUILTIN_DATA_SOURCES,
    BUILTIN_MODELS,
    QUANTITY_PATTERN,
    RLJobSpec,
    name_problems,
)
from rljob_operator.status_writer import _validation_problems


@pytest.mark.parametrize("case", MALFORMED, ids=lambda c: c.id)
def test_models_refuse_the_malformed_rljob_naming_the_field(case: Malformed) -> None:
    if case.field == "metadata.name":
        RLJobSpec.model_validate(case.spec)  # the spec is fine; the name is not
        assert [path for path, _ in name_problems(case.job_name)] == ["metadata.name"]
        return
    with pytest.raises(ValidationError) as info:
        RLJobSpec.model_validate(case.spec)
    # A field's own rule is reported at its path; a cross-field rule names it in its message.
    problems = [f"{path}: {msg}" for path, msg in _validation_problems(info.value)]
    named = case.field.replace("[0]", ".0")
    assert any(p.startswith(named) or f"{named}:" in p for p in problems), problems


def test_the_table_holds_every_seen_case_and_twenty_more() -> None:
    assert len([c for c in MALFORMED if c.seen]) == 12
    assert len([c for c in MALFORMED if not c.seen]) >= 20
    assert len({c.id for c in MALFORMED}) == len(MALFORMED)


@pytest.mark.parametrize(
    "value", ["8", "500m", "0.5", ".5", "1.", "64Gi", "1e3", "1E", "2k", "+4Gi", "100n", "3Ti"]
)
def test_real_quantities_pass(value: str) -> None:
    assert re.match(QUANTITY_PATTERN, value)
    spec = RLJobSpec.model_validate({"resources": {"cpu": value, "memory": "2Ei"}})
    assert spec.resources.cpu == value


@pytest.mark.parametrize(
    "image",
    [
        "ghcr.io/rljob/worker:0.1.0",
        "rljob-worker:dev",
        "localhost:5000/rljob/worker",
        "registry.example.com:443/team/rl_job__x/worker.cpu:v1.2-rc_3",
        "busybox@sha256:" + "a" * 64,
        "ghcr.io/rljob/worker:0.1.0@sha256:" + "0" * 64,
        "[::1]:5000/worker:latest",
    ],
)
def test_real_image_references_pass(image: str) -> None:
    assert RLJobSpec.model_validate({"resources": {"image": image}}).resources.image == image


def test_the_builtin_names_are_what_the_worker_resolves() -> None:
    # The worker imports these very tuples; a builtin the models accept is one the worker makes.
    from rljob.api import DataSpec
    from rljob_worker import model, task
    from rljob_worker.model import load_tokenizer, resolve_model_path

    assert model.BUILTIN_MODELS is BUILTIN_MODELS and model.TINY_QWEN2 in BUILTIN_MODELS
    assert task.BUILTIN_DATA_SOURCES is BUILTIN_DATA_SOURCES
    assert task.BUILTIN_ARITHMETIC in BUILTIN_DATA_SOURCES
    for name in BUILTIN_DATA_SOURCES:
        tokenizer = load_tokenizer(resolve_model_path(model.TINY_QWEN2))
        # builtin:calculator's prompts (question and tool-call form) take ~190 builtin tokens.
        data = DataSpec(source=name, max_prompt_length=256)
        assert task.make_task(data, seed=0, tokenizer=tokenizer).sample(1, salt=0)[0].prompt_ids
    with pytest.raises(ValueError, match="unknown builtin model"):
        model.resolve_model_path("builtin:gpt-17")


def test_paths_and_hugging_face_ids_pass() -> None:
    spec = RLJobSpec.model_validate(
        {"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "data": {"source": "/data/train.jsonl"}}
    )
    assert spec.model.path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert spec.data.source == "/data/train.jsonl"


@pytest.mark.parametrize(
    "function",
    ["exactMatch", "numeric", "/data/reward.py:compute_score", "rewards.gsm8k:score_v2",
     "reward.py:_private"],
)  # fmt: skip
def test_builtin_and_file_or_module_reward_functions_pass(function: str) -> None:
    assert RLJobSpec.model_validate({"reward": {"function": function}}).reward.function == function


@pytest.mark.parametrize(
    ("shm", "memory", "fits"),
    [
        ("1E", "2Ei", True),  # exa (10^18) under 2 exbi
        ("2Ei", "1E", False),
        ("1e3", "1Ki", True),  # an exponent, not the E suffix
        ("1Ki", "1e3", False),
        ("1500m", "2", True),
        ("2001m", "2", False),
        ("64Gi", "64Gi", True),
    ],
)
def test_shared_memory_is_compared_as_a_quantity(shm: str, memory: str, fits: bool) -> None:
    # The handler's copy of the CEL rule parses the quantity itself (no kubernetes client in
    # the worker); "E" alone is a suffix, "E3" an exponent, "Ei" a binary suffix.
    resources = {"sharedMemory": shm, "memory": memory}
    if fits:
        RLJobSpec.model_validate({"resources": resources})
    else:
        with pytest.raises(ValidationError, match="sharedMemory"):
            RLJobSpec.model_validate({"resources": resources})


@pytest.mark.parametrize(
    "spec",
    [
        # Each is next to a refused case of the table: the rules refuse only what cannot run.
        {
            "rollout": {"engine": "torch", "tensorParallelSize": 1},
            "resources": {"gpusPerWorker": 2},
        },
        {"data": {"trainBatchSize": 8}, "resources": {"workers": 2, "gpusPerWorker": 2}},
        {
            "algorithm": {"groupSize": 2, "ppoMiniBatches": 4},
            "data": {"trainBatchSize": 4},
            "resources": {"gpusPerWorker": 2},
        },
        {"checkpoint": {"path": "/data/ckpt"}, "export": {"path": "/data/ckpt/final"}},
        {"checkpoint": {"path": "/data/ckpt"}, "export": {"path": "/data/ck"}},
        {"checkpoint": {"path": "out/ckpt"}, "export": {"path": "out/export"}},
    ],
)
def test_the_cross_section_rules_pass_what_the_worker_runs(spec: dict[str, object]) -> None:
    RLJobSpec.model_validate(spec)
