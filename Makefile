# The two commands of the README, and the tools behind them. Each target does its own set-up.
.PHONY: run test e2e lint crd lock clean-cache

MANIFEST ?= examples/tiny-local.yaml

# Run the main job on the embedded default: the local colocated loop, no cluster, no GPU.
run:
	@bash hack/venv.sh
	.venv/bin/rljob run $(MANIFEST)

# The whole test suite (what CI runs): venv, control plane binaries, ruff, mypy, pytest.
test:
	@bash hack/test.sh

lint:
	@bash hack/venv.sh
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

# Regenerate the checked-in CRD from the API models (a unit test fails when they drift).
crd:
	@bash hack/venv.sh
	.venv/bin/rljob crd > crds/rljob.dev_rljobs.yaml
	cp crds/*.yaml charts/rljob/crds/

lock:
	@bash hack/lock.sh

clean-cache:
	rm -rf "$${RLJOB_CACHE_DIR:-$$HOME/.cache/rljob}"

# kind e2e: needs Docker, kind, network to KubeRay's Helm repo and the package index.
# RLJOB_TORCH_INDEX_URL=<CPU torch index> for a small worker image; RLJOB_E2E_KEEP=1 keeps the cluster.
e2e:
	@bash hack/venv.sh
	@bash hack/controlplane.sh install
	@for t in docker kind; do command -v $$t >/dev/null || { echo "make e2e: $$t is not on PATH" >&2; exit 1; }; done
	@docker info >/dev/null 2>&1 || { echo "make e2e: no Docker engine is running" >&2; exit 1; }
	eval "$$(bash hack/controlplane.sh env)"; PYTHONPATH=hack .venv/bin/python -m pytest -p pytest_layer_guard -rs --timeout=3600 tests/e2e
