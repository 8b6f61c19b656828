"""A fresh model cache for one test module: RLJOB_CACHE_DIR set (rank processes inherit it) and
the builtin model built there once, so the ranks only load it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from rljob.api import RLJobSpec


def fresh_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from rljob_worker.model import resolve_model_path

    root = tmp_path_factory.mktemp("rljob-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLJOB_CACHE_DIR", str(root))
        resolve_model_path("builtin:tiny-qwen2")
        yield root


def tiny_spec(dtype: str = "float32") -> RLJobSpec:
    """A small GRPO job on the builtin tiny Qwen2, with a reference model (klCoef > 0): what
    the sharded-loading tests build a Trainer from."""
    from rljob.api import parse_manifest

    doc = {
        "apiVersion": "rljob.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "load"},
        "spec": {
            "model": {"path": "builtin:tiny-qwen2", "dtype": dtype},
            "algorithm": {"name": "grpo", "groupSize": 2, "iterations": 2, "klCoef": 0.05},
            "data": {"source": "builtin:digit", "trainBatchSize": 4, "maxResponseLength": 3},
            "rollout": {"engine": "torch"},
            "training": {"microBatchSize": 2},
            "resources": {"workers": 1, "gpusPerWorker": 0},
        },
    }
    return parse_manifest(doc)[1]
