"""spec.data.validation: the held-out set (a file's first rows, or a builtin source's fixed draw),
when it runs, and its figures combined over ranks into status.metrics[].validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from rich.console import Console

from rljob.api import DataSpec, ValidationSpec, parse_manifest
from rljob.curves import metrics_table
from rljob.report import IterationMetrics
from rljob_worker.dataset import DatasetError
from rljob_worker.driver import iteration_reports
from rljob_worker.loop import RankIteration, ValidationStats, validation_due
from rljob_worker.model import TINY_QWEN2, load_tokenizer, resolve_model_path
from rljob_worker.task import make_task, validation_problems


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_path(TINY_QWEN2))


def test_defaults_are_greedy_every_five_iterations_and_many_samples_need_a_temperature() -> None:
    validation = ValidationSpec(source="builtin:digit")
    assert (validation.every_iterations, validation.max_prompts) == (5, 256)
    assert (validation.samples_per_prompt, validation.temperature) == (1, 0.0)
    assert ValidationSpec(source="builtin:digit", samples_per_prompt=4, temperature=0.7)
    with pytest.raises(ValidationError, match=r"spec\.data\.validation\.samplesPerPrompt: "):
        ValidationSpec(source="builtin:digit", samples_per_prompt=4)


def _rows(tmp_path: Path, count: int, long_row: int | None = None) -> Path:
    path = tmp_path / "test.jsonl"
    rows = [
        {"prompt": ("many words " * 40 if i == long_row else f"{i}+{i}="), "answer": str(2 * i)}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_files_first_rows_are_the_validation_set(tmp_path: Path, tokenizer: Any) -> None:
    path = _rows(tmp_path, 5)
    data = DataSpec(validation=ValidationSpec(source=str(path), max_prompts=3))
    problems = validation_problems(data, 0, tokenizer)
    assert [p.prompt for p in problems] == ["0+0=", "1+1=", "2+2="]
    assert [p.answer for p in problems] == ["0", "2", "4"]
    assert [p.where for p in problems] == [f"{path} line {n}" for n in (1, 2, 3)]
    everything = data.model_copy(update={"validation": ValidationSpec(source=str(path))})
    assert len(validation_problems(everything, 0, tokenizer)) == 5  # fewer rows than maxPrompts
    assert validation_problems(DataSpec(), 0, tokenizer) == []


def test_a_builtin_sources_validation_set_is_fixed_and_apart_from_training(
    tokenizer: Any,
) -> None:
    data = DataSpec(
        source="builtin:arithmetic",
        validation=ValidationSpec(source="builtin:arithmetic", max_prompts=32),
    )
    problems = validation_problems(data, 7, tokenizer)
    assert len(problems) == 32
    assert problems == validation_problems(data, 7, tokenizer)  # every rank and rerun
    training = make_task(data, 7, tokenizer)
    # Not the draw of any of the first iterations' rollouts (salts from 0).
    assert all(problems != training.sample(32, salt=salt) for salt in range(8))


def test_a_bad_validation_file_is_named_as_the_validation_source(
    tmp_path: Path, tokenizer: Any
) -> None:
    missing = DataSpec(validation=ValidationSpec(source=str(tmp_path / "nothing.jsonl")))
    with pytest.raises(DatasetError, match=r"^spec\.data\.validation\.source .*no such file"):
        validation_problems(missing, 0, tokenizer)
    long = DataSpec(validation=ValidationSpec(source=str(_rows(tmp_path, 3, long_row=1))))
    with pytest.raises(DatasetError, match=r"^spec\.data\.validation\.source: 1 of 3 rows"):
        validation_problems(long, 0, tokenizer)


def _job(iterations: int, validation: dict[str, Any] | None) -> Any:
    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "val"},
        "spec": {
            "algorithm": {"iterations": iterations},
            "data": {"validation": validation} if validation else {},
        },
    }
    return parse_manifest(doc)[1]


def test_validation_runs_at_iteration_zero_every_nth_and_the_last() -> None:
    spec = _job(12, {"source": "builtin:digit", "everyIterations": 5})
    assert [i for i in range(13) if validation_due(spec, i)] == [0, 5, 10, 12]
    assert not any(validation_due(_job(12, None), i) for i in range(13))


def test_validation_figures_combine_over_ranks() -> None:
    """Rank 0: 3 answers scoring 2.0, 2 correct, 12 tokens, 1 cut, 1.5 s; rank 1: 2 answers
    scoring 0.1, none correct, 8 tokens, a reward call failed, 2.25 s; rank 2 held no prompt.
    All 5: reward 2.1 / 5 = 0.42, correct 2 / 5, length 20 / 5 = 4, cut 1 / 5, the slowest
    rank's 2.25 s."""
    shares = [
        ValidationStats(3, 3, 2.0, 2, 12, 1, 0, 1.5),
        ValidationStats(2, 2, 0.1, 0, 8, 0, 1, 2.25),
        ValidationStats(0, 0, 0.0, 0, 0, 0, 0, 0.0),
    ]
    items = [
        RankIteration(rank, 5, (), 1.0, 4, None, None, 64, validation=share)
        for rank, share in enumerate(shares)
    ]
    (report,) = iteration_reports([], items)
    assert report.validation is not None
    assert report.validation.model_dump() == {
        "prompts": 5,
        "reward_mean": 0.42,
        "correct_share": 0.4,
        "response_length_mean": 4.0,
        "truncated_share": 0.2,
        "reward_errors": 1,
        "seconds": 2.25,
    }
    entry = IterationMetrics.of(report)
    assert entry.validation == report.validation
    json_entry = entry.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert json_entry["validation"]["rewardMean"] == 0.42
    # Iterations without validation have none; the table shows the columns once any has.
    plain = IterationMetrics(iteration=6, reward_mean=0.5)
    console = Console(width=200, record=True)
    console.print(metrics_table([entry, plain], "metrics"))
    text = console.export_text()
    assert "val reward" in text and "0.420" in text and "40%" in text
    console = Console(width=200, record=True)
    console.print(metrics_table([plain], "metrics"))
    assert "val reward" not in console.export_text()
