"""A fresh model cache for one test module: RLJOB_CACHE_DIR set (rank processes inherit it) and
the builtin model built there once, so the ranks only load it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


def fresh_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    from rljob_worker.model import resolve_model_path

    root = tmp_path_factory.mktemp("rljob-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLJOB_CACHE_DIR", str(root))
        resolve_model_path("builtin:tiny-qwen2")
        yield root
