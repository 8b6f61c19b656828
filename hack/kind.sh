#!/usr/bin/env bash
# The kind cluster the e2e layer runs against, made from the images hack/images.sh builds here.
#
#   hack/kind.sh up     images, cluster (1 control-plane + 1 worker; default StorageClass
#                       `standard`: kind's local-path provisioner), images imported into the
#                       worker from hack/images.sh's cache, KubeRay (its Go module's kustomize
#                       config) and charts/rljob (helm) installed; reuses a healthy cluster of
#                       the same node image (idempotent)
#   hack/kind.sh down   delete the cluster
#   hack/kind.sh env    RLJOB_E2E_KUBECONFIG, RLJOB_E2E_CLUSTER, the tools and image names
#
# RLJOB_KIND_CLUSTER names the cluster (default rljob-e2e). Any failure names its step:
# "[kind] FAILED in step <step>".
set -euo pipefail
set -E
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"
CACHE=${RLJOB_CACHE_DIR:-$HOME/.cache/rljob}
NAME=${RLJOB_KIND_CLUSTER:-rljob-e2e}
KUBECONFIG_FILE=$CACHE/kind/$NAME.kubeconfig
KIND_CONFIG=$ROOT/tests/e2e/kind-config.yaml
KUBERAY_MODULE=github.com/ray-project/kuberay/ray-operator
GO=${GO:-go}

STEP=setup
REPORTED=0
log() { printf '[kind] %s\n' "$*"; }
die() {
  printf '[kind] FAILED in step %s: %s\n' "$STEP" "$*" >&2
  REPORTED=1
  exit 1
}
# shellcheck disable=SC2154 # rc is set inside the trap's own text
trap 'rc=$?; [[ $REPORTED == 1 ]] || printf "[kind] FAILED in step %s (exit %s)\n" "$STEP" "$rc" >&2; REPORTED=1' ERR
step() {
  local start
  STEP=$1
  shift
  start=$(date +%s)
  "$@"
  log "$STEP: $(($(date +%s) - start))s"
}

load_env() {
  eval "$(bash "$HERE/controlplane.sh" env)"
  eval "$(bash "$HERE/images.sh" env)"
  KIND=$RLJOB_KIND
  KUBECTL=$RLJOB_KUBECTL
  HELM=$RLJOB_HELM
}

k() { "$KUBECTL" --kubeconfig "$KUBECONFIG_FILE" "$@"; }

workers() { "$KIND" get nodes --name "$NAME" | grep -v control-plane | paste -sd, -; }

cluster_is_current() { # the cluster exists, runs the current node image, and answers
  "$KIND" get clusters 2>/dev/null | grep -qx "$NAME" || return 1
  local running want
  running=$(docker inspect -f '{{.Image}}' "$NAME-control-plane" 2>/dev/null) || return 1
  want=$(docker image inspect -f '{{.Id}}' "$RLJOB_KIND_NODE_IMAGE") || return 1
  [[ $running == "$want" ]] || { log "cluster $NAME runs an older node image"; return 1; }
  "$KIND" get kubeconfig --name "$NAME" >"$KUBECONFIG_FILE" &&
    k wait --for=condition=Ready nodes --all --timeout=60s >/dev/null
}

create_cluster() {
  mkdir -p "$(dirname "$KUBECONFIG_FILE")"
  if cluster_is_current; then
    log "reusing cluster $NAME"
    return
  fi
  "$KIND" delete cluster --name "$NAME" >/dev/null 2>&1 || true
  # The node image an older cluster ran, untagged by a rebuild (hack/images.sh prunes it unless a
  # container runs it, as that cluster's nodes did): GBs.
  docker image prune -f --filter "label=dev.rljob.inputs" >/dev/null
  local config
  config=$(mktemp)
  sed "s/ETCD_IMAGE_TAG/$RLJOB_ETCD_IMAGE_TAG/" "$KIND_CONFIG" >"$config"
  if ! "$KIND" create cluster --name "$NAME" --image "$RLJOB_KIND_NODE_IMAGE" --config "$config" \
    --kubeconfig "$KUBECONFIG_FILE" --wait 300s --retain; then
    local logs=$CACHE/kind/$NAME-logs
    rm -rf "$logs"
    "$KIND" export logs "$logs" --name "$NAME" >/dev/null 2>&1 || true
    "$KIND" delete cluster --name "$NAME" >/dev/null 2>&1 || true
    rm -f "$config"
    die "kind create cluster $NAME failed (node logs: $logs)"
  fi
  rm -f "$config"
  k wait --for=condition=Ready nodes --all --timeout=180s
  # CoreDNS serves the Ray head's Service name to the workers: wait for it as for the nodes.
  k -n kube-system rollout status deploy/coredns --timeout=180s
  # kind applied the node image's default-storage.yaml: the local-path provisioner behind the
  # default StorageClass `standard`. A claim made before it runs would wait unprovisioned.
  k -n local-path-storage rollout status deploy/local-path-provisioner --timeout=180s
}

# After an import (`ctr import` of a `docker save` tarball) a node holds each image twice: its layer tarballs
# in containerd's content store and the unpacked snapshots. Only the snapshots run containers, so
# the tarballs go, as containerd's own discard_unpacked_layers does for pulled images (the worker
# image's CUDA torch is GBs; this machine's disk is small). The manifest and config stay, so the
# image is listed, runs, and a later import of it is skipped; a changed image re-imports and
# reuses the snapshots of its unchanged layers.
# shellcheck disable=SC2016 # expanded by the node's bash, not here
DISCARD_LAYERS='
set -euo pipefail
for ref in "$@"; do
  manifest=$(ctr -n k8s.io images ls "name==$ref" | awk "NR == 2 {print \$3}")
  [[ -n $manifest ]] || { echo "no image $ref in the node" >&2; exit 1; }
  for layer in $(ctr -n k8s.io content get "$manifest" | jq -r ".layers[]?.digest"); do
    ctr -n k8s.io content rm "$layer" >/dev/null 2>&1 || true
  done
done
'

# import_archive NODE VAR: the image named by $VAR into NODE's containerd from the tarball
# hack/images.sh saved (as kind's own `load` does after a `docker save`), under its keyed name.
import_archive() {
  local node=$1 var=$2 archive saved
  archive=${var}_ARCHIVE saved=${var}_ARCHIVED_AS
  docker exec -i "$node" ctr -n k8s.io images import --all-platforms --digests \
    --snapshotter=overlayfs - <"${!archive}" >/dev/null
  docker exec "$node" ctr -n k8s.io images tag --force "${!saved}" "${!var}" >/dev/null
  docker exec "$node" ctr -n k8s.io images rm "${!saved}" >/dev/null
}

load_images() {
  local nodes node var image archive
  nodes=$(workers)
  [[ -n $nodes ]] || die "cluster $NAME has no worker node"
  for var in RLJOB_KUBERAY_IMAGE RLJOB_OPERATOR_IMAGE RLJOB_WORKER_IMAGE; do
    image=${!var}
    archive=${var}_ARCHIVE
    # Only the workers run pods (the control-plane node keeps its NoSchedule taint). kind's own
    # "already present" check runs crictl, which the node image lacks: check with ctr here (the
    # tags are keyed by the image's inputs), or every `up` would copy GBs again.
    local missing=()
    for node in ${nodes//,/ }; do
      docker exec "$node" ctr -n k8s.io images ls -q "name==$image" | grep -qx "$image" ||
        missing+=("$node")
    done
    if [[ ${#missing[@]} == 0 ]]; then
      log "$image: on every worker already"
    elif [[ -f ${!archive:-} ]]; then
      for node in "${missing[@]}"; do import_archive "$node" "$var"; done
      log "$image: imported from ${!archive}"
    else
      "$KIND" load docker-image "$image" --name "$NAME" --nodes "$(IFS=,; echo "${missing[*]}")"
    fi
  done
  for node in ${nodes//,/ }; do
    docker exec "$node" bash -c "$DISCARD_LAYERS" discard \
      "$RLJOB_KUBERAY_IMAGE" "$RLJOB_OPERATOR_IMAGE" "$RLJOB_WORKER_IMAGE"
  done
}

# KubeRay from its own kustomize config (ray-operator/config/default: CRDs, RBAC, Deployment) in
# the KubeRay Go module of the pinned release, read where `go mod download` (hack/controlplane.sh
# does the same) keeps it in the Go module cache: nothing of KubeRay is committed here. Its Helm
# chart is in no Go module, and no chart repository is reachable from the project's machines.
# The overlay written here sets the namespace, the image hack/images.sh built, and the feature
# gates KubeRay's chart turns on by default.
install_kuberay() {
  local src overlay
  src=$(cd / && "$GO" mod download -json "$KUBERAY_MODULE@$KUBERAY_VERSION" |
    sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  [[ -d $src/config/default ]] || die "no config/default in the KubeRay module ($src)"
  overlay=$(mktemp -d)
  # (kustomize takes another kustomization only by a relative path)
  cat >"$overlay/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: kuberay-system
resources:
  - $(realpath --relative-to="$overlay" "$src/config/default")
images:
  - name: quay.io/kuberay/operator
    newName: ${RLJOB_KUBERAY_IMAGE%:*}
    newTag: ${RLJOB_KUBERAY_IMAGE##*:}
patches:
  - target: {kind: Deployment, name: kuberay-operator}
    patch: |
      - op: replace
        path: /spec/template/spec/containers/0/args
        value:
          - --feature-gates=RayClusterStatusConditions=true,RayJobDeletionPolicy=true,RayMultiHostIndexing=true
      - op: replace
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Never
EOF
  k create namespace kuberay-system --dry-run=client -o yaml | k apply -f - >/dev/null
  # Server-side: the RayJob and RayCluster CRDs are too large for apply's last-applied annotation.
  k apply --server-side --force-conflicts -k "$overlay" >/dev/null
  rm -rf "$overlay"
  k -n kuberay-system rollout status deploy/kuberay-operator --timeout=300s
}

install_rljob() {
  k apply --server-side --force-conflicts -f "$ROOT/charts/rljob/crds/" >/dev/null
  # The operator pod may start before Helm creates its ClusterKopfPeering (the image is on the
  # node already): it waits for the release's object (RLJOB_HELM_RELEASE) rather than racing.
  "$HELM" --kubeconfig "$KUBECONFIG_FILE" upgrade --install rljob "$ROOT/charts/rljob" \
    --namespace rljob-system --create-namespace \
    --set "image.repository=${RLJOB_OPERATOR_IMAGE%:*}" --set "image.tag=${RLJOB_OPERATOR_IMAGE##*:}" \
    --set image.pullPolicy=Never --wait --timeout 5m
  k -n rljob-system rollout status deploy/rljob --timeout=180s
}

cmd_up() {
  local start
  start=$(date +%s)
  step images bash "$HERE/images.sh" install
  load_env
  step cluster create_cluster
  step load-images load_images
  step kuberay install_kuberay
  step rljob-chart install_rljob
  STEP='done'
  log "cluster $NAME ready in $(($(date +%s) - start))s (kubeconfig: $KUBECONFIG_FILE)"
}

cmd_down() {
  load_env
  "$KIND" delete cluster --name "$NAME"
  rm -f "$KUBECONFIG_FILE"
}

cmd_env() {
  load_env
  echo "export RLJOB_E2E_CLUSTER=$NAME"
  echo "export RLJOB_E2E_KUBECONFIG=$KUBECONFIG_FILE"
  # kubectl and helm (tests/e2e/cluster.py runs kubectl from RLJOB_KUBECTL).
  bash "$HERE/controlplane.sh" env
  bash "$HERE/images.sh" env
}

case ${1:-up} in
  up) cmd_up ;;
  down) cmd_down ;;
  env) cmd_env ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
