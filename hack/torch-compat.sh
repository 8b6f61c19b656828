#!/usr/bin/env bash
# The CPU layers on the GPU machines' torch (2.11), where CI runs them on the lock's (2.14.1).
#
#   hack/torch-compat.sh [PYTEST ARGS...]    default: tests/unit tests/worker
#
# rljob supports torch 2.11 through 2.14.1 (pyproject.toml): 2.11 is what the lent GPU machines
# and sglang 0.5.17 have, 2.14.1 what the lock and the worker image's sglang 0.5.23 pin. The gpu
# layer runs on 2.11 there; this runs the CPU layers (FSDP on gloo, Ray, the stage machine) on
# 2.11 here, in a venv of its own: the lock's packages less torch and what pins it (triton, CUDA
# wheels, setuptools), then torch==$TORCH and what it asks for. Not part of `make test` (a
# second torch is GBs to fetch and ~15 minutes of tests); run it after touching torch APIs.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${RLJOB_COMPAT_TORCH:-2.11.0}
VENV=.venv-torch$TORCH
bash hack/venv.sh >/dev/null # for its uv
UV=.venv/bin/uv
want=$({ echo "$TORCH"; cat requirements/ci.txt pyproject.toml; } | sha256sum | cut -c1-16)
if [[ ! -f $VENV/.rljob-stamp || $(cat "$VENV/.rljob-stamp") != "$want" ]]; then
  rm -rf "$VENV"
  "$UV" venv -q -p "$(.venv/bin/python -c 'import sys; print(sys._base_executable)')" "$VENV"
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  grep -vE '^(torch|triton|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+|setuptools)==' requirements/ci.txt >"$constraints"
  "$UV" pip install -q -p "$VENV/bin/python" -r "$constraints" "torch==$TORCH"
  "$UV" pip install -q -p "$VENV/bin/python" --no-deps -e .
  echo "$want" >"$VENV/.rljob-stamp"
fi
"$VENV/bin/python" -c 'import torch; print(f"torch {torch.__version__} in '"$VENV"'")'
[[ $# == 0 ]] && set -- tests/unit tests/worker
PYTHONPATH=hack exec "$VENV/bin/python" -m pytest -p pytest_layer_guard -q --timeout=1200 "$@"
