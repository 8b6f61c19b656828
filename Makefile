# The two commands of the README, and the tools behind them. Each target does its own set-up.
.PHONY: run test e2e lint crd lock clean-cache

MANIFEST ?= examples/tiny-local.yaml

# Run the main job on the embedded default: the local colocated loop, no cluster, no GPU.
run:
	@bash hack/venv.sh
	.venv/bin/rljob run $(MANIFEST)

# The whole test suite (what CI runs): venv, control plane binaries, the e2e layer's images and
# kind cluster, ruff, mypy, pytest (tests/e2e first, then the rest once the cluster is gone).
test:
	@bash hack/test.sh

lint:
	@bash hack/venv.sh
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy

# Regenerate the checked-in CRD and the field reference (docs/rljob-spec.md) from the API models
# (unit tests fail when either drifts).
crd:
	@bash hack/venv.sh
	.venv/bin/rljob crd > crds/rljob.dev_rljobs.yaml
	cp crds/*.yaml charts/rljob/crds/
	.venv/bin/rljob spec-doc --out docs/rljob-spec.md

lock:
	@bash hack/lock.sh

clean-cache:
	rm -rf "$${RLJOB_CACHE_DIR:-$$HOME/.cache/rljob}"

# The e2e layer alone: images built here (hack/images.sh), the kind cluster (hack/kind.sh up),
# then tests/e2e. RLJOB_E2E_KEEP=1 keeps the cluster for the next run (`hack/kind.sh down`).
e2e:
	@bash hack/test.sh tests/e2e
