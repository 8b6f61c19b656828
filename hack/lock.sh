#!/usr/bin/env bash
# Re-resolves requirements/ci.txt (what CI and `make` install) from pyproject.toml's extras.
# The sglang extra is left out: it needs CUDA and is installed only in the GPU worker image.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/uv pip compile pyproject.toml --extra operator --extra worker --extra dev \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 -o requirements/ci.txt
# The GPU worker image's constraints: sglang pins its own transformers and torch, and ships
# manylinux_2_34 wheels for the SGLang CUDA image's Python 3.12.
.venv/bin/uv pip compile pyproject.toml --extra worker --extra sglang \
  --python-version 3.12 --python-platform x86_64-manylinux_2_34 -o requirements/worker-gpu.txt
