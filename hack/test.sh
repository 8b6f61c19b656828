#!/usr/bin/env bash
# The whole test suite with all its set-up: venv, control-plane binaries, lint, types, pytest.
# This is the README's test command (`make test`) and exactly what .ci/run runs.
# Extra arguments go to pytest (e.g. `hack/test.sh -m controlplane -k smoke`).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

declare -a PHASES=()
# Each phase has a time limit (seconds): a step that hangs fails by name, with the time it was
# given, instead of running in silence into CI's own limit. Generous: about twice a cold run's.
declare -A LIMIT=([venv]=1200 [controlplane]=2400 [e2e-images]=2700 [e2e-cluster]=900
  [ruff]=300 [ruff-format]=300 [mypy]=900 [pytest-e2e]=1800 [e2e-down]=300 [pytest]=3600)
phase() {  # phase NAME CMD...: run a step within its limit, time it, stop the run on failure
  local name=$1 start end rc limit
  shift
  limit=${LIMIT[$name]:-1800}
  echo "==> $name"
  start=$(date +%s)
  if declare -F "$1" >/dev/null; then
    PHASE_LIMIT=$limit "$@"  # a function of this script bounds its own command (run_pytest)
  else
    timeout -k 30 "$limit" "$@"
  fi
  rc=$?
  end=$(date +%s)
  if [[ $rc == 124 || $rc == 137 ]] && ((end - start >= limit)); then
    echo "==> $name did not end within its limit of ${limit}s: stopped" >&2
  fi
  PHASES+=("$(printf '%-14s %4ss  %s' "$name" "$((end - start))" "$([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)")")")
  if [[ $rc != 0 ]]; then
    summary
    exit "$rc"
  fi
}
summary() {
  echo "==> phase times"
  printf '  %s\n' "${PHASES[@]}"
}

run_pytest() {
  local rc
  # --durations: the slowest tests in every run, so CI time can be followed test by test.
  PYTHONPATH=hack timeout -k 60 "${PHASE_LIMIT:-3600}" .venv/bin/python -m pytest -p pytest_layer_guard -rs --timeout=1200 --durations=20 "$@"
  rc=$?
  if [[ $rc == 5 ]]; then
    echo "pytest collected no tests: that is a failure here, not a pass" >&2
    return 1
  fi
  return $rc
}

phase venv bash hack/venv.sh
phase controlplane bash hack/controlplane.sh install
# The e2e layer (docs/development.md: end-to-end on kind): its images, a kind cluster, then
# tests/e2e. Part of the full run (no arguments) and of a run whose arguments name the layer
# (`make e2e`); RLJOB_E2E=1 adds it to any run, RLJOB_E2E=0 leaves it out. A missing dockerd,
# a failed image build or a cluster that does not come up fails its phase (and the run), naming
# the step.
E2E=0
case ${RLJOB_E2E:-} in
  1) E2E=1 ;;
  0) ;;
  *)
    if [[ $# == 0 ]]; then E2E=1; fi
    for arg in "$@"; do  # an argument that names the layer, not one that leaves it out
      if [[ $arg == *e2e* && $arg != --ignore* && $arg != --deselect* ]]; then E2E=1; fi
    done
    ;;
esac
if [[ $E2E == 1 ]]; then
  phase e2e-images bash hack/images.sh install
  phase e2e-cluster bash hack/kind.sh up
  eval "$(bash hack/kind.sh env)"
  if [[ ${RLJOB_E2E_KEEP:-0} != 1 ]]; then
    trap 'bash hack/kind.sh down >/dev/null 2>&1 || true' EXIT
  fi
fi
if [[ $# == 0 ]]; then
  phase ruff .venv/bin/ruff check .
  phase ruff-format .venv/bin/ruff format --check .
  phase mypy .venv/bin/mypy
fi
if [[ $E2E == 1 && $# == 0 ]]; then
  # The full run: the e2e layer in a pytest run of its own, then the cluster goes (idle, its two
  # nodes still take about a fifth of a core) before the other layers run.
  phase pytest-e2e run_pytest tests/e2e
  if [[ ${RLJOB_E2E_KEEP:-0} != 1 ]]; then
    phase e2e-down bash hack/kind.sh down
  fi
  phase pytest run_pytest --ignore=tests/e2e
else
  phase pytest run_pytest "$@"
fi
summary
