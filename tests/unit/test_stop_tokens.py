"""Which ids end an answer (model.stop_token_ids): the tokenizer's EOS and every id the model's
config.json and generation_config.json declare, the union sglang stops on."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rljob_worker.model import stop_token_ids


def _model_dir(tmp_path: Path, config: Any, generation: Any = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": config}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation}))
    return tmp_path


@pytest.mark.parametrize(
    ("config", "generation", "expected"),
    [
        (7, None, [7]),  # the tokenizer's own, once
        ([7, 151645, 9], None, [7, 151645, 9]),
        (151643, [151645, 151643], [7, 151643, 151645]),  # Qwen2.5-Instruct's two, after EOS
        (None, None, [7]),
    ],
)
def test_stop_ids_are_the_tokenizers_eos_then_every_declared_one(
    tmp_path: Path, config: Any, generation: Any, expected: list[int]
) -> None:
    tokenizer: Any = SimpleNamespace(eos_token_id=7)
    assert stop_token_ids(tokenizer, _model_dir(tmp_path, config, generation)) == expected


def test_a_directory_without_the_configs_stops_on_the_tokenizers_eos(tmp_path: Path) -> None:
    # A hub id not in the cache: test_model_files.py (offline; here it would try the network).
    tokenizer: Any = SimpleNamespace(eos_token_id=3)
    assert stop_token_ids(tokenizer, tmp_path) == [3]
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), tmp_path) == []  # type: ignore[arg-type]
