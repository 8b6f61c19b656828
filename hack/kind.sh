#!/usr/bin/env bash
# The kind cluster the e2e layer runs against, made from the images hack/images.sh builds here.
#
#   hack/kind.sh up     images, cluster (1 control-plane + 1 worker), images loaded into the
#                       worker with `kind load`, KubeRay's chart (tests/e2e/vendor) and
#                       charts/rljob installed with helm; reuses a healthy cluster of the same
#                       node image (idempotent)
#   hack/kind.sh down   delete the cluster
#   hack/kind.sh env    RLJOB_E2E_KUBECONFIG, RLJOB_E2E_CLUSTER, the tools and image names
#
# RLJOB_KIND_CLUSTER names the cluster (default rljob-e2e). Any failure names its step:
# "[kind] FAILED in step <step>".
set -euo pipefail
set -E
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
CACHE=${RLJOB_CACHE_DIR:-$HOME/.cache/rljob}
NAME=${RLJOB_KIND_CLUSTER:-rljob-e2e}
KUBECONFIG_FILE=$CACHE/kind/$NAME.kubeconfig
KIND_CONFIG=$ROOT/tests/e2e/kind-config.yaml
KUBERAY_CHART=$ROOT/tests/e2e/vendor/kuberay-operator

STEP=setup
REPORTED=0
log() { printf '[kind] %s\n' "$*"; }
die() {
  printf '[kind] FAILED in step %s: %s\n' "$STEP" "$*" >&2
  REPORTED=1
  exit 1
}
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
}

load_images() {
  local nodes image
  nodes=$(workers)
  [[ -n $nodes ]] || die "cluster $NAME has no worker node"
  for image in "$RLJOB_KUBERAY_IMAGE" "$RLJOB_OPERATOR_IMAGE" "$RLJOB_WORKER_IMAGE"; do
    # Only the workers run pods (the control-plane node keeps its NoSchedule taint).
    "$KIND" load docker-image "$image" --name "$NAME" --nodes "$nodes"
  done
}

install_kuberay() {
  local chart
  chart=$(mktemp -d)
  cp -r "$KUBERAY_CHART" "$chart/"
  mkdir -p "$chart/kuberay-operator/crds"
  cp "$RLJOB_KUBERAY_CRDS"/*.yaml "$chart/kuberay-operator/crds/"
  # helm installs a chart's crds/ only on first install: apply them for a reused cluster too.
  k apply --server-side --force-conflicts -f "$chart/kuberay-operator/crds/" >/dev/null
  "$HELM" --kubeconfig "$KUBECONFIG_FILE" upgrade --install kuberay-operator \
    "$chart/kuberay-operator" --namespace kuberay-system --create-namespace \
    --set "image.repository=${RLJOB_KUBERAY_IMAGE%:*}" --set "image.tag=${RLJOB_KUBERAY_IMAGE##*:}" \
    --set image.pullPolicy=Never --wait --timeout 5m
  rm -rf "$chart"
}

install_rljob() {
  k apply --server-side --force-conflicts -f "$ROOT/charts/rljob/crds/" >/dev/null
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
  step kuberay-chart install_kuberay
  step rljob-chart install_rljob
  STEP=done
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
  bash "$HERE/images.sh" env
}

case ${1:-up} in
  up) cmd_up ;;
  down) cmd_down ;;
  env) cmd_env ;;
  *) echo "usage: $0 up|down|env" >&2; exit 2 ;;
esac
