"""The bench's scripts as modules (they are scripts, not a package's), for tests of their parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def bench_module(relative: str, name: str) -> Any:
    """bench/`relative` loaded as module `name`, registered in sys.modules (dataclasses and
    pickling look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
