#!/usr/bin/env bash
# Builds and caches every image the kind e2e layer runs, where no image registry is reachable:
# only Debian packages (debootstrap, apt), the Go module proxy and PyPI go in.
#
#   hack/images.sh install   start dockerd if none runs; build what is missing (idempotent)
#   hack/images.sh env       print the image names and tool paths as shell exports
#
# What it makes (names from `env`):
#   debian base      debootstrap --variant=minbase, `docker import`ed
#   python base      Debian's python3 on it: the PYTHON_IMAGE of operator/ and worker_image/
#   kind node image  systemd + Debian's containerd/runc/CNI plugins + kind's node files (kind Go
#                    module) + kubelet/kubeadm/kubectl, with the component images imported into
#                    its containerd: kube-apiserver, -controller-manager, -scheduler, -proxy,
#                    etcd (Debian's etcd-server), CoreDNS, pause, the pod network daemon,
#                    and kind's default StorageClass: rancher's local-path provisioner (its
#                    Go module) with the Debian base as its helper image
#   KubeRay          its operator (the v1.6.0 module hack/controlplane.sh builds) on an empty image
#   rljob operator   operator/Dockerfile;   CPU worker   worker_image/Dockerfile.cpu
# Each image is keyed by a hash of its inputs (Dockerfile, context files, build args, base key)
# and kept as a `docker save` tarball in ${RLJOB_CACHE_DIR:-~/.cache/rljob}/images, so a warm
# machine, or a fresh dockerd, loads instead of building. Go binaries are cached per version.
# Any failure names its step: "[images] FAILED in step <step>".
set -euo pipefail
set -E
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
# shellcheck source=versions.env
source "$HERE/versions.env"

# Pins of the e2e layer (the control plane's are in versions.env).
KIND_VERSION=v0.33.0
COREDNS_VERSION=v1.12.1 # kubeadm v1.34's CoreDNS (constants.CoreDNSVersion)
PAUSE_VERSION=3.10.1    # kubeadm v1.34's pause (constants.PauseVersion)
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${RLJOB_DEBIAN_MIRROR:-http://deb.debian.org/debian}

CACHE=${RLJOB_CACHE_DIR:-$HOME/.cache/rljob}
IMAGES=$CACHE/images
K8S_DIR=$CACHE/k8s-$K8S_VERSION
NODE_BIN_DIR=$CACHE/k8s-node-$K8S_VERSION/bin
KIND_DIR=$CACHE/kind-$KIND_VERSION
COREDNS_DIR=$CACHE/coredns-$COREDNS_VERSION
PAUSE_DIR=$CACHE/pause-go
KUBERAY_DIR=$CACHE/kuberay-$KUBERAY_VERSION
LOCAL_PATH_DIR=$CACHE/local-path-provisioner-$LOCAL_PATH_PROVISIONER_VERSION
LOCAL_PATH_MODULE=github.com/rancher/local-path-provisioner
NODE_BINS=(kubelet kubeadm kube-proxy kube-scheduler)
KEY_LABEL=dev.rljob.inputs
export GOFLAGS=${GOFLAGS:--trimpath}
export CGO_ENABLED=0
export DOCKER_BUILDKIT=0 # the classic builder: BuildKit would pull its Dockerfile frontend image
GO=${GO:-go}
PARALLEL=${RLJOB_BUILD_PARALLEL:-$(nproc)}

# Image names (the keyed tag is added by ensure_image).
DEBIAN_IMAGE=rljob.local/debian:$DEBIAN_SUITE
PYTHON_IMAGE=rljob.local/python:3.11-$DEBIAN_SUITE
NODE_BASE_IMAGE=rljob.local/kind-base:$KIND_VERSION
NODE_IMAGE=rljob.local/kind-node:$K8S_VERSION
NETD_IMAGE=rljob.local/kind-netd:1
LOCAL_PATH_IMAGE=rljob.local/local-path-provisioner:$LOCAL_PATH_PROVISIONER_VERSION
KUBERAY_IMAGE=rljob.local/kuberay-operator:$KUBERAY_VERSION
OPERATOR_IMAGE=rljob.local/operator:e2e
WORKER_IMAGE=rljob.local/worker-cpu:e2e
# Debian's etcd-server version as kubeadm's etcd tag (3.4.23-0): kubeadm picks etcd's flags by it.
ETCD_TAG=$(apt-cache show "$ETCD_APT_PACKAGE" 2>/dev/null | sed -n 's/^Version: \([0-9.]*\).*/\1/p' | head -1)-0

STEP=setup
log() { printf '[images] %s\n' "$*"; }
REPORTED=0
die() {
  printf '[images] FAILED in step %s: %s\n' "$STEP" "$*" >&2
  REPORTED=1
  exit 1
}
# shellcheck disable=SC2154 # rc is set inside the trap's own text
trap 'rc=$?; [[ $REPORTED == 1 ]] || printf "[images] FAILED in step %s (exit %s)\n" "$STEP" "$rc" >&2; REPORTED=1' ERR
step() { # step NAME CMD...: name the step for failures, time it
  local start
  step_wanted "$1" || return 0
  STEP=$1
  shift
  start=$(date +%s)
  "$@"
  log "$STEP: $(($(date +%s) - start))s"
}

hash_files() { # hash_files DIR PATH...: one hash of the files' names (relative to DIR) and contents
  (cd "$1" && shift && find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}
hash_text() { sha256sum | cut -c1-16; }

# --- dockerd -----------------------------------------------------------------------------------

# Whether this host withholds a capability runc knows (here CAP_SYS_RESOURCE): then kind's
# --privileged nodes need the runtime hack/images/runc-bounded-caps.
caps_withheld() { [[ $(sed -n 's/^CapBnd:[[:space:]]*//p' /proc/self/status) != 000001ffffffffff ]]; }

ensure_dockerd() {
  docker info >/dev/null 2>&1 && {
    if caps_withheld && [[ $(docker info -f '{{.DefaultRuntime}}') == runc ]]; then
      die "dockerd runs with plain runc, but this host withholds capabilities (CapBnd" \
        "$(sed -n 's/^CapBnd:[[:space:]]*//p' /proc/self/status)): privileged containers fail." \
        "Stop that dockerd; hack/images.sh starts one with hack/images/runc-bounded-caps"
    fi
    log "dockerd: running ($(docker version -f '{{.Server.Version}}'), runtime $(docker info -f '{{.DefaultRuntime}}'))"
    return
  }
  if ! command -v dockerd >/dev/null; then
    if [[ $(id -u) != 0 ]] || ! command -v apt-get >/dev/null; then
      die "no dockerd here and not root with apt-get: install Debian's docker.io"
    fi
    log "dockerd: apt-get install docker.io"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io debootstrap >/dev/null
  fi
  command -v docker >/dev/null || die "docker.io installed no docker client"
  [[ $(id -u) == 0 ]] || die "no Docker engine is running, and only root can start dockerd here"
  log "dockerd: starting (log: $CACHE/dockerd.log)"
  mkdir -p "$CACHE/bin"
  install -m 0755 "$HERE/images/runc-bounded-caps" "$CACHE/bin/runc-bounded-caps"
  # A config file of its own (not /etc/docker/daemon.json, whose keys would clash with flags).
  printf '{"storage-driver": "overlay2", "runtimes": {"rljob-runc": {"path": "%s"}}, "default-runtime": "rljob-runc"}\n' \
    "$CACHE/bin/runc-bounded-caps" >"$CACHE/dockerd.json"
  # Without the lock's descriptors (8 here, 9 of hack/controlplane.sh): a daemon that inherited
  # one would hold the lock for its whole life, and the next install would wait on it for ever
  # (the CI run of 7f3683e did, silently, from the kind step on, until CI's limit).
  setsid dockerd --config-file "$CACHE/dockerd.json" >"$CACHE/dockerd.log" 2>&1 </dev/null 8>&- 9>&- &
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && return
    sleep 1
  done
  tail -20 "$CACHE/dockerd.log" >&2
  die "dockerd did not answer within 60s (log above: $CACHE/dockerd.log)"
}

# --- the image cache ---------------------------------------------------------------------------

image_key() { docker image inspect -f "{{index .Config.Labels \"$KEY_LABEL\"}}" "$1" 2>/dev/null || true; }

# ensure_image REF KEY BUILD_CMD...: REF with label KEY in dockerd, else loaded from its cached
# tarball, else built by BUILD_CMD (which must label it KEY) and saved. Older tarballs of REF go.
ensure_image() {
  local ref=$1 key=$2 tar base
  shift 2
  base=$IMAGES/$(tr '/:' '__' <<<"$ref")
  tar=$base-$key.tar
  if [[ $(image_key "$ref") == "$key" ]]; then
    log "cached: $ref ($key, in dockerd)"
    return
  fi
  if [[ -f $tar ]]; then
    docker load -q -i "$tar" >/dev/null
    [[ $(image_key "$ref") == "$key" ]] || die "$tar did not hold $ref with key $key"
    log "cached: $ref ($key, loaded from $tar)"
    return
  fi
  log "building $ref ($key)"
  "$@"
  [[ $(image_key "$ref") == "$key" ]] || die "the build of $ref left no image labelled $key"
  rm -f "$base"-*.tar
  # The image this build replaced, now untagged (unless a container, e.g. an old kind node, runs it).
  docker image prune -f --filter "label=$KEY_LABEL" >/dev/null
  docker save -o "$tar.part" "$ref"
  mv "$tar.part" "$tar"
  log "saved: $ref -> $tar ($(du -h "$tar" | cut -f1))"
}

# --- Go builds (cached per version, built in a temporary folder, moved in when complete) -------

wrapper_module() { printf 'module %s\n\ngo 1.25\n' "$2" >"$1/go.mod"; }

build_node_bins() { # kubelet, kubeadm, kube-proxy, kube-scheduler at K8S_VERSION
  local work=$1 gomod pkg=k8s.io/component-base/version major minor ldflags b
  wrapper_module "$work" rljob.dev/build/kubernetes-node
  gomod=$("$GO" mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",/\1/p')
  {
    echo "require k8s.io/kubernetes $K8S_VERSION"
    echo "replace ("
    sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => ./staging/src/.*#\t\1 => \1 '"$K8S_STAGING_VERSION"'#p' "$gomod"
    echo ")"
  } >>"$work/go.mod"
  # Each package at the pinned version (a bare `go get pkg` would resolve the newest kubernetes).
  local pkgs=("${NODE_BINS[@]/#/k8s.io/kubernetes/cmd/}")
  (cd "$work" && "$GO" get "${pkgs[@]/%/@$K8S_VERSION}")
  major=${K8S_VERSION#v}
  major=${major%%.*}
  minor=$(cut -d. -f2 <<<"$K8S_VERSION")
  ldflags="-s -w -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  mkdir -p "$work/out/bin"
  for b in "${NODE_BINS[@]}"; do
    (cd "$work" && "$GO" build -p "$PARALLEL" -ldflags "$ldflags" -o "out/bin/$b" "k8s.io/kubernetes/cmd/$b")
    log "built $b"
  done
}

build_kind() {
  mkdir -p "$1/out/bin"
  GOBIN=$1/out/bin "$GO" install "sigs.k8s.io/kind@$KIND_VERSION"
}

build_coredns() {
  wrapper_module "$1" rljob.dev/build/coredns
  cp "$HERE/images/coredns/main.go" "$1/"
  (cd "$1" && "$GO" get "github.com/coredns/coredns@$COREDNS_VERSION" && "$GO" mod tidy)
  mkdir -p "$1/out/bin"
  (cd "$1" && "$GO" build -p "$PARALLEL" -ldflags "-s -w" -o out/bin/coredns .)
}

build_pause() {
  wrapper_module "$1" rljob.dev/build/pause
  cp "$HERE/images/pause/main.go" "$1/"
  mkdir -p "$1/out/bin"
  (cd "$1" && "$GO" build -ldflags "-s -w" -o out/bin/pause .)
}

# The provisioner's `main` is its module's root package; its go.mod has no replace lines, so
# `go install pkg@version` builds it as released (VERSION stamped as its own scripts/build does).
build_local_path_provisioner() {
  mkdir -p "$1/out/bin"
  GOBIN=$1/out/bin "$GO" install -p "$PARALLEL" \
    -ldflags "-s -w -X main.VERSION=$LOCAL_PATH_PROVISIONER_VERSION" \
    "$LOCAL_PATH_MODULE@$LOCAL_PATH_PROVISIONER_VERSION"
}

# go_artifact NAME DEST BUILD_FN CHECK_FILE
go_artifact() {
  local name=$1 dest=$2 fn=$3 check=$4 work
  if [[ -x $dest/$check ]]; then
    log "cached: $name ($dest)"
    return
  fi
  command -v "$GO" >/dev/null || die "go is required to build $name"
  work=$(mktemp -d "$CACHE/.build-$name.XXXXXX")
  # In the background and waited for: under `||` bash would ignore set -e inside the function.
  "$fn" "$work" >"$work/build.log" 2>&1 &
  wait $! || {
    tail -30 "$work/build.log" >&2
    die "$name: Go build failed (log: $work/build.log)"
  }
  [[ -x $work/out/$check ]] || die "$name: the build made no $check (log: $work/build.log)"
  rm -rf "$dest"
  mkdir -p "$(dirname "$dest")"
  mv "$work/out" "$dest"
  rm -rf "$work"
  log "built: $name -> $dest"
}

go_builds() {
  go_artifact kind "$KIND_DIR" build_kind bin/kind
  go_artifact "kubernetes-node-$K8S_VERSION" "$(dirname "$NODE_BIN_DIR")" build_node_bins bin/kubelet
  go_artifact "coredns-$COREDNS_VERSION" "$COREDNS_DIR" build_coredns bin/coredns
  go_artifact pause "$PAUSE_DIR" build_pause bin/pause
  go_artifact "local-path-provisioner-$LOCAL_PATH_PROVISIONER_VERSION" "$LOCAL_PATH_DIR" \
    build_local_path_provisioner bin/local-path-provisioner
}

# --- base images -------------------------------------------------------------------------------

# The host's own extra CAs (an HTTPS-intercepting egress proxy on the project's machines) go
# into the base image too, or pip in an image build could not reach PyPI.
EXTRA_CAS=/usr/local/share/ca-certificates
debian_key() {
  { echo "debootstrap minbase $DEBIAN_SUITE $DEBIAN_MIRROR ca-certificates"
    [[ -d $EXTRA_CAS ]] && hash_files "$EXTRA_CAS" .; } | hash_text
}

build_debian() {
  command -v debootstrap >/dev/null || {
    [[ $(id -u) == 0 ]] || die "debootstrap is missing: apt-get install debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  }
  local rootfs
  rootfs=$(mktemp -d "$CACHE/.build-debian.XXXXXX")
  debootstrap --variant=minbase --include=ca-certificates "$DEBIAN_SUITE" "$rootfs" \
    "$DEBIAN_MIRROR" >"$rootfs.log" 2>&1 || {
    tail -20 "$rootfs.log" >&2
    die "debootstrap $DEBIAN_SUITE failed (log: $rootfs.log)"
  }
  if compgen -G "$EXTRA_CAS/*.crt" >/dev/null; then
    cp "$EXTRA_CAS"/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null
  fi
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change "LABEL $KEY_LABEL=$1" --change 'CMD ["/bin/bash"]' - "$DEBIAN_IMAGE" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
}

# docker build with the classic builder, without its deprecation notice on every call.
classic_build() { # (grep finding no other line is no failure: `|| true` keeps the ERR trap quiet)
  docker build "$@" 2> >(grep -v -e '^DEPRECATED: The legacy builder' -e 'BuildKit is currently disabled' \
    -e 'environment-variable\.$' -e '^$' >&2 || true)
}

# docker_build KEY TAG DOCKERFILE CONTEXT [ARGS...]
docker_build() {
  local key=$1 tag=$2 file=$3 context=$4
  shift 4
  classic_build -q --label "$KEY_LABEL=$key" -t "$tag" -f "$file" "$@" "$context" >/dev/null
}

# --- the kind node image -----------------------------------------------------------------------

kind_files() { echo "$("$GO" env GOMODCACHE)/sigs.k8s.io/kind@$KIND_VERSION/images/base/files"; }

node_base_key() {
  { image_key "$DEBIAN_IMAGE"; hash_files "$(kind_files)" .; hash_files "$HERE" images/node-base.Dockerfile; } | hash_text
}

build_node_base() {
  local files
  files=$(kind_files)
  [[ -d $files ]] || (cd /tmp && "$GO" mod download "sigs.k8s.io/kind@$KIND_VERSION")
  docker_build "$1" "$NODE_BASE_IMAGE" "$HERE/images/node-base.Dockerfile" "$files" \
    --build-arg "BASE_IMAGE=$DEBIAN_IMAGE"
}

# The component images kubeadm and kind run, named as kubeadm and kind name them.
declare -A STATIC_IMAGES=(
  [kube-apiserver]="registry.k8s.io/kube-apiserver:$K8S_VERSION"
  [kube-controller-manager]="registry.k8s.io/kube-controller-manager:$K8S_VERSION"
  [kube-scheduler]="registry.k8s.io/kube-scheduler:$K8S_VERSION"
)
COREDNS_IMAGE=registry.k8s.io/coredns/coredns:$COREDNS_VERSION
PAUSE_IMAGE=registry.k8s.io/pause:$PAUSE_VERSION
KUBE_PROXY_IMAGE=registry.k8s.io/kube-proxy:$K8S_VERSION
ETCD_IMAGE=registry.k8s.io/etcd:$ETCD_TAG

binary_path() {
  case $1 in
    kube-apiserver | kube-controller-manager) echo "$K8S_DIR/bin/$1" ;;
    coredns) echo "$COREDNS_DIR/bin/coredns" ;;
    pause) echo "$PAUSE_DIR/bin/pause" ;;
    kuberay-operator) echo "$KUBERAY_DIR/bin/kuberay-operator" ;;
    local-path-provisioner) echo "$LOCAL_PATH_DIR/bin/local-path-provisioner" ;;
    *) echo "$NODE_BIN_DIR/$1" ;;
  esac
}

# static_image TAG BINARY [DEST NAME USER]: one binary on an empty image
static_image() {
  local tag=$1 binary=$2 dest=${3:-/usr/local/bin} name=${4:-$2} user=${5:-0} ctx
  ctx=$(mktemp -d "$CACHE/.build-ctx.XXXXXX")
  cp "$(binary_path "$binary")" "$ctx/$name"
  # The binary is the entrypoint (pause and CoreDNS run with none given; an ENTRYPOINT takes no ARG).
  { cat "$HERE/images/static.Dockerfile"; echo "ENTRYPOINT [\"${dest%/}/$name\"]"; } |
    classic_build -q -t "$tag" -f - --build-arg "BINARY=$name" \
      --build-arg "DEST=$dest" --build-arg "USER_ID=$user" "$ctx" >/dev/null
  rm -rf "$ctx"
}

# tools_image TAG "PACKAGES" [BINARY...]: Debian packages and binaries on the Debian base
tools_image() {
  local tag=$1 packages=$2 ctx b
  shift 2
  ctx=$(mktemp -d "$CACHE/.build-ctx.XXXXXX")
  mkdir -p "$ctx/bin"
  for b in "$@"; do cp "$b" "$ctx/bin/"; done
  classic_build -q -t "$tag" -f "$HERE/images/debian-tools.Dockerfile" \
    --build-arg "BASE_IMAGE=$DEBIAN_IMAGE" --build-arg "PACKAGES=$packages" "$ctx" >/dev/null
  rm -rf "$ctx"
}

node_key() {
  {
    image_key "$NODE_BASE_IMAGE"
    echo "$K8S_VERSION $COREDNS_VERSION $PAUSE_VERSION $ETCD_TAG $NETD_IMAGE $LOCAL_PATH_IMAGE $DEBIAN_IMAGE"
    sha256sum "$K8S_DIR"/bin/* "$NODE_BIN_DIR"/* "$COREDNS_DIR/bin/coredns" "$PAUSE_DIR/bin/pause" \
      "$LOCAL_PATH_DIR/bin/local-path-provisioner" | cut -c1-64
    # The files it is made of and the functions that make it, not all of this script: a change
    # to another image's build must not rebuild the node image (and so every cluster).
    hash_files "$HERE" images
    declare -f build_node static_image tools_image binary_path
  } | hash_text
}

# kind's `build node-image`, without its pulls: a container of the base image gets the binaries,
# /kind/version and the manifests; its containerd imports the component images; docker commit.
build_node() ( # a subshell: its EXIT trap removes the build container
  local key=$1 name c tar
  for name in "${!STATIC_IMAGES[@]}"; do static_image "${STATIC_IMAGES[$name]}" "$name"; done
  static_image "$COREDNS_IMAGE" coredns / coredns
  static_image "$PAUSE_IMAGE" pause / pause
  tools_image "$KUBE_PROXY_IMAGE" "nftables conntrack iptables" "$NODE_BIN_DIR/kube-proxy"
  tools_image "$ETCD_IMAGE" "$ETCD_APT_PACKAGE"
  tools_image "$NETD_IMAGE" "iproute2 curl jq ca-certificates" "$HERE/images/netd.sh"
  static_image "$LOCAL_PATH_IMAGE" local-path-provisioner
  tar=$(mktemp "$CACHE/.build-components.XXXXXX")
  # The Debian base is the provisioner's helper image: its layer is the one the tools images
  # above are built on, so it adds nothing to the tarball or the node.
  docker save -o "$tar" "${STATIC_IMAGES[@]}" "$COREDNS_IMAGE" "$PAUSE_IMAGE" \
    "$KUBE_PROXY_IMAGE" "$ETCD_IMAGE" "$NETD_IMAGE" "$LOCAL_PATH_IMAGE" "$DEBIAN_IMAGE"

  c=$(docker run -d --privileged --entrypoint=sleep "$NODE_BASE_IMAGE" infinity)
  # shellcheck disable=SC2064
  trap "docker rm -f -v $c >/dev/null 2>&1; rm -f $tar" EXIT
  for name in kubelet kubeadm; do docker cp "$NODE_BIN_DIR/$name" "$c:/usr/bin/$name"; done
  docker cp "$K8S_DIR/bin/kubectl" "$c:/usr/bin/kubectl"
  docker exec "$c" mkdir -p /kind/manifests
  docker exec -i "$c" sh -c 'cat >/kind/version' <<<"$K8S_VERSION"
  sed "s#NETD_IMAGE#$NETD_IMAGE#" "$HERE/images/default-cni.yaml" |
    docker exec -i "$c" sh -c 'cat >/kind/manifests/default-cni.yaml'
  sed -e "s#LOCAL_PATH_IMAGE#$LOCAL_PATH_IMAGE#" -e "s#HELPER_IMAGE#$DEBIAN_IMAGE#" \
    "$HERE/images/default-storage.yaml" | docker exec -i "$c" sh -c 'cat >/kind/manifests/default-storage.yaml'
  # kubeadm v1.34 probes etcd at /livez and /readyz, which etcd 3.4 (Debian's) does not serve:
  # the startup probe would kill it every 4 minutes. tests/e2e/kind-config.yaml points kubeadm at
  # these patches (probes on /health, which 3.4 serves on the same metrics port).
  docker cp "$HERE/images/kubeadm-patches" "$c:/kind/kubeadm-patches"
  docker exec "$c" sed -i "s#sandbox_image = .*#sandbox_image = \"$PAUSE_IMAGE\"#" /etc/containerd/config.toml
  # The node's containerd runs pods (kube-proxy is privileged) through the same capability
  # filter as dockerd: the node's bounding set is the host's.
  docker cp "$HERE/images/runc-bounded-caps" "$c:/usr/local/bin/runc-bounded-caps"
  docker exec "$c" sed -i 's#^\(\s*\)SystemdCgroup = true#&\n\1BinaryName = "/usr/local/bin/runc-bounded-caps"#' \
    /etc/containerd/config.toml
  # Without CAP_SYS_RESOURCE no process may lower its oom_score_adj, and kubelet asks for -998
  # (critical pods, every sandbox of a static pod) or -997 (Guaranteed): runc's nsexec then fails
  # with "failed to update /proc/self/oom_score_adj: Permission denied", seen by containerd as
  # "can't get final child's PID from pipe: EOF". restrict_oom_score_adj (what kind sets for
  # rootless nodes) clamps each request to containerd's own score (0 here; -999 where systemd
  # may set it, so a no-op there); positive scores (BestEffort 1000, Burstable) stay as asked.
  docker exec "$c" sed -i 's/restrict_oom_score_adj = false/restrict_oom_score_adj = true/' \
    /etc/containerd/config.toml
  docker exec "$c" bash -c 'nohup containerd >/tmp/containerd.log 2>&1 &
    for i in $(seq 30); do ctr version >/dev/null 2>&1 && exit 0; sleep 1; done; exit 1'
  docker exec -i "$c" ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned \
    --all-platforms --no-unpack --digests - <"$tar" >/dev/null
  docker exec "$c" pkill containerd
  docker exec "$c" rm -f /tmp/containerd.log
  docker commit --change 'ENTRYPOINT [ "/usr/local/bin/entrypoint", "/sbin/init" ]' \
    --change "LABEL $KEY_LABEL=$key" "$c" "$NODE_IMAGE" >/dev/null
)

# --- the images kind loads ---------------------------------------------------------------------

kuberay_key() { { echo "$KUBERAY_VERSION"; sha256sum "$KUBERAY_DIR/bin/kuberay-operator"; hash_files "$HERE" images/static.Dockerfile; } | hash_text; }

build_kuberay() {
  # KubeRay's own image: /manager, non-root 65532 (its chart sets runAsNonRoot).
  static_image "$KUBERAY_IMAGE" kuberay-operator / manager 65532
  classic_build -q -t "$KUBERAY_IMAGE" --label "$KEY_LABEL=$1" - >/dev/null <<<"FROM $KUBERAY_IMAGE"
}

# The project's files a Dockerfile copies (the .dockerignore allow-list) and the lock.
project_key() { # project_key DOCKERFILE
  {
    image_key "$PYTHON_IMAGE"
    hash_files "$ROOT" "$1" .dockerignore pyproject.toml README.md requirements rljob \
      operator/rljob_operator worker_image/rljob_worker
  } | hash_text
}

build_project_image() { # build_project_image KEY TAG DOCKERFILE
  docker_build "$1" "$2" "$ROOT/$3" "$ROOT" --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE"
}

# wait_lock FD FILE: flock FD, waiting at most RLJOB_LOCK_WAIT_S (default 1800 s) and saying so,
# with the processes that hold FILE, instead of waiting in silence.
wait_lock() {
  local fd=$1 file=$2 limit=${RLJOB_LOCK_WAIT_S:-1800}
  flock -n "$fd" && return
  log "waiting (at most ${limit}s) for $file, held by: $(fuser "$file" 2>/dev/null | xargs -r ps -o pid=,args= -p | tr '\n' ';' || true)"
  flock -w "$limit" "$fd" || die "$file still held after ${limit}s (another hack/images.sh install?)"
}

ONLY=()
step_wanted() { [[ ${#ONLY[@]} == 0 || " ${ONLY[*]} " == *" $1 "* ]]; }

cmd_install() { # cmd_install [STEP...]: all steps, or only these (for working on one image)
  ONLY=("$@")
  mkdir -p "$CACHE" "$IMAGES"
  if [[ ${#ONLY[@]} == 0 ]]; then
    exec 8>"$CACHE/.images.lock"
    wait_lock 8 "$CACHE/.images.lock"
    rm -rf "$CACHE"/.build-ctx.* "$CACHE"/.build-components.* "$CACHE"/.build-debian.*
  fi
  local start
  start=$(date +%s)
  step dockerd ensure_dockerd
  step controlplane-binaries bash "$HERE/controlplane.sh" install >/dev/null
  step go-builds go_builds
  step debian-image ensure_image "$DEBIAN_IMAGE" "$(debian_key)" build_debian "$(debian_key)"
  # Each key only for a step that runs: a key hashes what the steps before it built.
  local key=
  step_wanted python-image &&
    key=$({ image_key "$DEBIAN_IMAGE"; hash_files "$HERE" images/python.Dockerfile; } | hash_text)
  step python-image ensure_image "$PYTHON_IMAGE" "$key" docker_build "$key" "$PYTHON_IMAGE" \
    "$HERE/images/python.Dockerfile" "$HERE/images" --build-arg "BASE_IMAGE=$DEBIAN_IMAGE"
  step_wanted kind-base-image && key=$(node_base_key)
  step kind-base-image ensure_image "$NODE_BASE_IMAGE" "$key" build_node_base "$key"
  step_wanted kind-node-image && key=$(node_key)
  step kind-node-image ensure_image "$NODE_IMAGE" "$key" build_node "$key"
  step_wanted kuberay-image && key=$(kuberay_key)
  step kuberay-image ensure_image "$KUBERAY_IMAGE" "$key" build_kuberay "$key"
  step_wanted operator-image && key=$(project_key operator/Dockerfile)
  step operator-image ensure_image "$OPERATOR_IMAGE" "$key" \
    build_project_image "$key" "$OPERATOR_IMAGE" operator/Dockerfile
  step_wanted worker-image && key=$(project_key worker_image/Dockerfile.cpu)
  step worker-image ensure_image "$WORKER_IMAGE" "$key" \
    build_project_image "$key" "$WORKER_IMAGE" worker_image/Dockerfile.cpu
  # The images kind loads, tagged with their input keys: a changed image gets a new name, so a
  # reused cluster's Deployments roll to it and nothing runs an old image under a reused tag.
  # Each with its `docker save` tarball (holding REF, the untagged name) and that name:
  # hack/kind.sh imports the tarball into the nodes, saving a `docker save` of GBs per cluster.
  local ref refs=() var key tar
  [[ ${#ONLY[@]} == 0 ]] || return 0
  for var in KUBERAY_IMAGE OPERATOR_IMAGE WORKER_IMAGE; do
    ref=${!var}
    key=$(image_key "$ref")
    tar=$IMAGES/$(tr '/:' '__' <<<"$ref")-$key.tar
    docker tag "$ref" "${ref%:*}:$key"
    # Older keyed tags of it go (their images share all but the changed layers with this one).
    docker images --format '{{.Repository}}:{{.Tag}}' "${ref%:*}" |
      { grep -vx -e "$ref" -e "${ref%:*}:$key" || true; } | xargs -r docker rmi >/dev/null
    refs+=("export RLJOB_$var=${ref%:*}:$key")
    if [[ -f $tar ]]; then
      refs+=("export RLJOB_${var}_ARCHIVE=$tar" "export RLJOB_${var}_ARCHIVED_AS=$ref")
    fi
  done
  printf '%s\n' "${refs[@]}" >"$IMAGES/loaded-images.env"
  STEP='done'
  log "images ready in $(($(date +%s) - start))s (cache: $IMAGES)"
}

cmd_env() {
  echo "export RLJOB_KIND=$KIND_DIR/bin/kind"
  echo "export RLJOB_KIND_NODE_IMAGE=$NODE_IMAGE"
  echo "export RLJOB_ETCD_IMAGE_TAG=$ETCD_TAG"
  # RLJOB_{KUBERAY,OPERATOR,WORKER}_IMAGE, keyed tags, as the last `install` made them.
  cat "$IMAGES/loaded-images.env" 2>/dev/null || true
}

case ${1:-install} in
  install) shift && cmd_install "$@" ;;
  env) cmd_env ;;
  *) echo "usage: $0 install|env" >&2; exit 2 ;;
esac
