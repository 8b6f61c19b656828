"""Where spec.model.path's files are found: a directory in the pod, or a hub id's snapshot in the
Hugging Face cache; and what an absolute path that is not there (a volume not mounted) says."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub.constants
import pytest
import torch

from rljob_worker.model import load_causal_lm, load_tokenizer, resolve_model_path, stop_token_ids

# Qwen2.5-Instruct's declarations: <|endoftext|> in config.json, both in generation_config.json.
CONFIG = {"eos_token_id": 151643}
GENERATION_CONFIG = {"eos_token_id": [151645, 151643]}


def _write_model(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return directory


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache holding `org/instruct` as from_pretrained leaves it."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--instruct"
    commit = "0123456789abcdef0123456789abcdef01234567"
    _write_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    # The constants are read from the environment at import; the lookups read them per call.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_stops_on_the_same_ids_as_its_local_directory(
    tmp_path: Path, hub_cache: Path
) -> None:
    tokenizer: Any = SimpleNamespace(eos_token_id=151645)
    local = _write_model(tmp_path / "models" / "instruct")
    assert stop_token_ids(tokenizer, local) == [151645, 151643]
    assert stop_token_ids(tokenizer, "org/instruct") == [151645, 151643]


def test_a_hub_id_not_in_the_offline_cache_stops_on_the_tokenizers_eos(hub_cache: Path) -> None:
    tokenizer: Any = SimpleNamespace(eos_token_id=3)
    assert stop_token_ids(tokenizer, "org/not-downloaded") == [3]


@pytest.mark.parametrize("path", ["/data/models/Qwen2.5-1.5B-Instruct", "/etc/hostname"])
@pytest.mark.parametrize("load", [load_tokenizer, lambda path: load_causal_lm(path, torch.float32)])
def test_an_absolute_model_path_that_is_no_directory_says_to_mount_its_volume(
    path: str, load: Callable[[str], object]
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"spec.model.path {path}: no such directory in the pod \(mount the volume that "
        r"holds it, see docs/volumes-and-env.md",
    ):
        load(path)


def test_directories_and_hub_ids_pass_through_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = _write_model(tmp_path / "models" / "instruct")
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path(str(local)) == str(local)
    assert resolve_model_path("models/instruct") == "models/instruct"  # relative, as rljob run has
    assert resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
