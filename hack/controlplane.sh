#!/usr/bin/env bash
# Builds and caches the real control plane the tests run against, outside the repo:
# kube-apiserver, kube-controller-manager and kubectl (k8s.io/kubernetes), helm, the KubeRay
# operator and its CRDs (all from the Go module proxy), and etcd (Debian's etcd-server).
#
#   hack/controlplane.sh install   build what is missing (idempotent; cached per version)
#   hack/controlplane.sh env       print the paths as shell exports
#
# Layout: ${RLJOB_CACHE_DIR:-~/.cache/rljob}/{k8s-V/bin, helm-V/bin, kuberay-V/{bin,crds}}.
# Each artifact is built in a temporary folder and moved into place only when complete, so an
# interrupted build is never taken for a cached one. Module downloads run in parallel; the
# compiles run one after another (each already uses every core through `go build -p`).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"

CACHE=${RLJOB_CACHE_DIR:-$HOME/.cache/rljob}
K8S_DIR=$CACHE/k8s-$K8S_VERSION
HELM_DIR=$CACHE/helm-$HELM_VERSION
KUBERAY_DIR=$CACHE/kuberay-$KUBERAY_VERSION
KUBERAY_MODULE=github.com/ray-project/kuberay/ray-operator
K8S_BINS=(kube-apiserver kube-controller-manager kubectl)
export GOFLAGS=${GOFLAGS:--trimpath}
export CGO_ENABLED=0
GO=${GO:-go}
PARALLEL=${RLJOB_BUILD_PARALLEL:-$(nproc)}

log() { printf '[controlplane] %s\n' "$*"; }

timed() {  # timed LABEL CMD...: run and report the seconds it took
  local label=$1 start
  shift
  start=$(date +%s)
  "$@"
  log "$label: $(($(date +%s) - start))s"
}

# --- what is cached -------------------------------------------------------------------------

k8s_cached() {
  local b
  for b in "${K8S_BINS[@]}"; do [[ -x $K8S_DIR/bin/$b ]] || return 1; done
}
helm_cached() { [[ -x $HELM_DIR/bin/helm ]]; }
kuberay_cached() {
  [[ -x $KUBERAY_DIR/bin/kuberay-operator && -f $KUBERAY_DIR/crds/ray.io_rayjobs.yaml ]]
}

# --- module downloads (network-bound: these run in parallel) --------------------------------

# A wrapper module per artifact: `go install pkg@v` refuses modules with replace directives,
# and k8s.io/kubernetes points its staging modules at ./staging, so we pin them ourselves.
wrapper_module() {  # wrapper_module DIR MODULE_PATH
  printf 'module %s\n\ngo 1.25\n' "$2" >"$1/go.mod"
}

prepare_k8s() {  # prepare_k8s WORK
  local gomod
  wrapper_module "$1" rljob.dev/build/kubernetes
  gomod=$("$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  {
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo "replace ("
    # Every `k8s.io/X => ./staging/src/k8s.io/X` of kubernetes' own go.mod, pinned to a version.
    sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\t\1 => \1 '"$K8S_STAGING_VERSION"'#p' "$gomod"
    echo ")"
  } >>"$1/go.mod"
  echo "kubernetes: $(grep -c '=> k8s.io' "$1/go.mod") staging modules pinned to $K8S_STAGING_VERSION"
  # Each package at the pinned version: a bare `go get pkg` would resolve @upgrade (the newest
  # kubernetes), which no longer builds against the pinned staging modules.
  local pkgs=("${K8S_BINS[@]/#/k8s.io/kubernetes/cmd/}")
  (cd "$1" && "$GO" get "${pkgs[@]/%/@$K8S_VERSION}")
}

prepare_helm() {
  wrapper_module "$1" rljob.dev/build/helm
  (cd "$1" && "$GO" get "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
}

prepare_kuberay() {
  # KubeRay's ray-operator go.mod has no replace lines to carry over (checked for v1.6.0).
  wrapper_module "$1" rljob.dev/build/kuberay
  (cd "$1" && "$GO" get "$KUBERAY_MODULE@$KUBERAY_VERSION")
}

# --- compiles (CPU-bound: one at a time) ----------------------------------------------------

compile_k8s() {  # compile_k8s WORK
  local major minor pkg=k8s.io/component-base/version b
  major=$(echo "$K8S_VERSION" | sed 's/^v\([0-9]*\)\..*/\1/')
  minor=$(echo "$K8S_VERSION" | sed 's/^v[0-9]*\.\([0-9]*\)\..*/\1/')
  # Without these stamps every binary reports v0.0.0.
  local ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major"
  ldflags+=" -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
  ldflags+=" -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  mkdir -p "$1/out/bin"
  for b in "${K8S_BINS[@]}"; do
    (cd "$1" && timed "kubernetes: build $b" \
      "$GO" build -p "$PARALLEL" -ldflags "$ldflags" -o "out/bin/$b" "k8s.io/kubernetes/cmd/$b")
  done
}

compile_helm() {
  local v=helm.sh/helm/v3/internal/version
  mkdir -p "$1/out/bin"
  (cd "$1" && timed "helm: build" "$GO" build -p "$PARALLEL" \
    -ldflags "-s -w -X $v.version=$HELM_VERSION -X $v.gitTreeState=clean" \
    -o out/bin/helm helm.sh/helm/v3/cmd/helm)
}

compile_kuberay() {
  local src
  mkdir -p "$1/out/bin" "$1/out/crds"
  (cd "$1" && timed "kuberay: build kuberay-operator" \
    "$GO" build -p "$PARALLEL" -ldflags "-s -w" -o out/bin/kuberay-operator "$KUBERAY_MODULE")
  # The CRDs of the same release, from the module cache (nothing of KubeRay is committed).
  src=$("$GO" mod download -json "$KUBERAY_MODULE@$KUBERAY_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  cp "$src"/config/crd/bases/ray.io_*.yaml "$1/out/crds/"
  chmod 644 "$1"/out/crds/*.yaml
}

# --- etcd -----------------------------------------------------------------------------------

install_etcd() {
  if command -v etcd >/dev/null; then
    log "cached: etcd $(etcd --version 2>/dev/null | head -1 | sed 's/.*: //') ($(command -v etcd))"
    return
  fi
  if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "etcd is missing and cannot be installed here: install Debian's $ETCD_APT_PACKAGE" \
      "(apt-get install $ETCD_APT_PACKAGE) or put an etcd 3.4+ binary on PATH" >&2
    exit 1
  fi
  timed "etcd: apt-get update" apt-get update -qq
  # policy-rc.d 101 keeps the package from starting a system etcd on the default ports.
  local policy=/usr/sbin/policy-rc.d placed=0
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && placed=1
  fi
  timed "etcd: apt-get install $ETCD_APT_PACKAGE" \
    env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$ETCD_APT_PACKAGE" >/dev/null
  if [[ $placed == 1 ]]; then rm -f "$policy"; fi
  command -v etcd >/dev/null || { echo "$ETCD_APT_PACKAGE installed no etcd binary" >&2; exit 1; }
  log "installed: $(etcd --version | head -1)"
}

# --- install --------------------------------------------------------------------------------

WORKDIRS=()
DOWNLOAD_PIDS=()
cleanup() {  # on any exit: stop our own download jobs, drop unfinished build folders
  local p w
  for p in "${DOWNLOAD_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for w in "${WORKDIRS[@]}"; do rm -rf "$w"; done
}

cmd_install() {
  mkdir -p "$CACHE"
  # One install at a time per cache (two test sessions on a fresh machine would race).
  # Bounded, and said: a wait in silence looks like a hang to whoever reads the log.
  exec 9>"$CACHE/.install.lock"
  if ! flock -n 9; then
    log "waiting (at most ${RLJOB_LOCK_WAIT_S:-1800}s) for $CACHE/.install.lock"
    flock -w "${RLJOB_LOCK_WAIT_S:-1800}" 9 || {
      echo "$CACHE/.install.lock still held after ${RLJOB_LOCK_WAIT_S:-1800}s" >&2
      exit 1
    }
  fi
  # Holding the lock, any leftover build folder is from an interrupted run.
  rm -rf "$CACHE"/.build-*
  trap cleanup EXIT

  local start name todo=() i s dest
  start=$(date +%s)
  install_etcd
  k8s_cached && log "cached: kubernetes $K8S_VERSION ($K8S_DIR/bin)" || todo+=(k8s)
  helm_cached && log "cached: helm $HELM_VERSION ($HELM_DIR/bin/helm)" || todo+=(helm)
  kuberay_cached && log "cached: kuberay $KUBERAY_VERSION ($KUBERAY_DIR)" || todo+=(kuberay)
  if [[ ${#todo[@]} -gt 0 ]]; then
    command -v "$GO" >/dev/null || { echo "go is required to build: ${todo[*]}" >&2; exit 1; }
  fi

  for i in "${!todo[@]}"; do
    name=${todo[$i]}
    WORKDIRS[i]=$(mktemp -d "$CACHE/.build-$name.XXXXXX")
    log "$name: downloading modules (log: ${WORKDIRS[i]}/download.log)"
    (
      s=$(date +%s)
      "prepare_$name" "${WORKDIRS[i]}" >"${WORKDIRS[i]}/download.log" 2>&1
      log "$name: module downloads: $(($(date +%s) - s))s"
    ) &
    DOWNLOAD_PIDS[i]=$!
  done
  for i in "${!todo[@]}"; do
    name=${todo[$i]}
    if ! wait "${DOWNLOAD_PIDS[i]}"; then
      echo "[controlplane] $name: module download failed:" >&2
      tail -30 "${WORKDIRS[i]}/download.log" >&2
      exit 1
    fi
    s=$(date +%s)
    "compile_$name" "${WORKDIRS[i]}"
    case $name in
      k8s) dest=$K8S_DIR ;;
      helm) dest=$HELM_DIR ;;
      kuberay) dest=$KUBERAY_DIR ;;
    esac
    # Atomic as far as the cache can tell: the folder appears complete or not at all.
    rm -rf "$dest"
    mv "${WORKDIRS[i]}/out" "$dest"
    log "built: $name -> $dest (compile $(($(date +%s) - s))s)"
  done
  log "control plane ready in $(($(date +%s) - start))s (cache: $CACHE)"
}

cmd_env() {
  echo "export RLJOB_CACHE_DIR=$CACHE"
  echo "export RLJOB_KUBE_BIN_DIR=$K8S_DIR/bin"
  echo "export RLJOB_KUBECTL=$K8S_DIR/bin/kubectl"
  echo "export RLJOB_HELM=$HELM_DIR/bin/helm"
  echo "export RLJOB_KUBERAY_OPERATOR=$KUBERAY_DIR/bin/kuberay-operator"
  echo "export RLJOB_KUBERAY_CRDS=$KUBERAY_DIR/crds"
  echo "export RLJOB_ETCD=$(command -v etcd || echo "$ETCD_APT_PACKAGE-not-installed")"
}

case ${1:-install} in
  install) cmd_install ;;
  env) cmd_env ;;
  *) echo "usage: $0 install|env" >&2; exit 2 ;;
esac
