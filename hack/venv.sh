#!/usr/bin/env bash
# Creates/updates .venv with the locked packages (requirements/ci.txt) and rljob in editable mode.
# Idempotent: a stamp keyed by the lock file and pyproject.toml makes a warm run a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
VENV=.venv
PY=${PYTHON:-python3}
STAMP="$VENV/.rljob-stamp"
want=$(cat requirements/ci.txt pyproject.toml | sha256sum | cut -c1-16)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" && -x "$VENV/bin/python" ]]; then
  echo "venv: up to date ($VENV)"
  exit 0
fi

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "rljob needs Python >= 3.11")'
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY" -m venv "$VENV"
fi
if [[ ! -x "$VENV/bin/uv" ]] || [[ "$("$VENV/bin/uv" --version | cut -d' ' -f2)" != "$UV_VERSION" ]]; then
  if [[ -x "$VENV/bin/pip" ]]; then
    "$VENV/bin/pip" install -q --disable-pip-version-check "uv==$UV_VERSION"
  else
    "$PY" -m pip install -q --disable-pip-version-check --target "$VENV/uv-bootstrap" "uv==$UV_VERSION"
    ln -sf "$PWD/$VENV/uv-bootstrap/bin/uv" "$VENV/bin/uv"
  fi
fi
# uv keeps its download cache in ~/.cache/uv, so a warm machine installs from disk.
"$VENV/bin/uv" pip sync -q -p "$VENV/bin/python" requirements/ci.txt
"$VENV/bin/uv" pip install -q -p "$VENV/bin/python" --no-deps -e .
echo "$want" > "$STAMP"
echo "venv: installed ($("$VENV/bin/python" -c 'import torch, ray, kopf; print(f"torch {torch.__version__}, ray {ray.__version__}, kopf {kopf.__version__}")'))"
