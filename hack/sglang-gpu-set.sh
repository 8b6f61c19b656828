#!/usr/bin/env bash
# Puts SGLang on a lent GPU machine, which reaches no package registry: run here (with PyPI),
# then carry the pieces one call at a time (docs/development.md, "GPU tests with SGLang").
#
#   hack/sglang-gpu-set.sh lock   re-resolve requirements/gpu-sglang.txt: sglang $SGLANG_VERSION and
#                                 exactly the packages (name and version) that the GPU machine,
#                                 recorded in requirements/gpu-machine.txt, does not already have
#   hack/sglang-gpu-set.sh lock-ray  re-resolve requirements/gpu-ray.txt: ray $RAY_VERSION (the
#                                 project's lock's) and what neither the machine nor the sglang
#                                 lock has, constrained by both (the two-GPU Ray driver runs)
#   hack/sglang-gpu-set.sh pack   download the locks (hashes checked), unpack them for cp312
#                                 manylinux x86_64, and write .gl/sglang/: zstd archives split into
#                                 pieces under 60 MiB, the zstandard wheel that unpacks them there,
#                                 and MANIFEST (sha256 of every file); and .whl/ (xgrammar, and
#                                 pydantic with its dependencies: bench/gpu_steps.sh deps)
#
# On the GPU machine, hack/sglang-gpu-install.sh takes each carried piece and, once all are
# there, joins, checks and unpacks them into a directory that goes on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."

SGLANG_VERSION=0.5.17
LOCK=requirements/gpu-sglang.txt
RAY_LOCK=requirements/gpu-ray.txt
RAY_VERSION=$(grep -oE '^ray==[^ ]+' requirements/ci.txt | cut -d= -f3)
MACHINE=requirements/gpu-machine.txt
OUT=.gl/sglang
CACHE=${RLJOB_CACHE_DIR:-$HOME/.cache/rljob}/gpu-sglang
# A piece travels beside the tracked tree (15.5 MiB on 2026-12-05, most of it bench/results/raw)
# within a call's 64 MiB: 56 MiB pieces stopped fitting as the raw results grew.
PIECE=42m
# The GPU machines: CPython 3.12 on glibc 2.39. pip needs every manylinux tag spelled out.
PLATFORMS=()
for n in $(seq 39 -1 5); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
  --platform manylinux1_x86_64 --platform linux_x86_64 --platform any)
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
  --only-binary=:all: "${PLATFORMS[@]}")

# Packages in the lock that the rollout path (sglang.Engine with skip_tokenizer_init, FlashInfer
# or FA3 attention, torch_memory_saver) does not import: they go into a second archive, `extra`,
# carried only when a run shows one is needed. Each left out saves calls:
#   nvidia-cutlass-dsl*, quack-kernels, flash-attn-4: CuTe DSL kernels (FA4 on Blackwell, MoE)
#   tokenspeed-*, tilelang, z3-solver, helion, cuda-tile: alternative kernel compilers
#   nvidia-cuda-nvcc/crt/nvvm/nvdisasm/cccl, nvidia-mathdx: a second CUDA 13 toolchain (the
#     machine has /usr/local/cuda; FlashInfer's JIT uses it)
#   torchcodec, soundfile, timm: multimodal inputs; xgrammar, llguidance, outlines*: grammars
EXTRA='^(nvidia[-_]cutlass[-_]dsl.*|quack[-_]kernels|flash[-_]attn[-_]4|tokenspeed[-_].*|tilelang|z3[-_]solver|helion|cuda[-_]tile|nvidia[-_]cuda[-_](nvcc|crt|nvdisasm|cccl)|nvidia[-_]nvvm|nvidia[-_]mathdx|torchcodec|soundfile|timm|xgrammar|llguidance|outlines.*)$'

py() { "${PYTHON:-python3}" "$@"; }

lock() {  # lock REQUIREMENT LOCKFILE [MORE_CONSTRAINTS...]
  local uv=.venv/bin/uv work want=$1 lockfile=$2
  shift 2
  [[ -x $uv ]] || { echo "run hack/venv.sh first (it installs uv)" >&2; exit 1; }
  work=$(mktemp -d)
  trap 'rm -rf "$work"' RETURN
  # The machine's own versions are constraints, so a package it has is not carried again,
  # except where sglang pins another version: then sglang's pin wins (the constraint is
  # dropped, one conflict at a time, as the resolver names it).
  grep -E '^[A-Za-z0-9_.-]+==' "$MACHINE" | sed -E 's/\+[^ ]*$//' > "$work/constraints.txt"
  # Further locks (ray: the sglang lock) constrain too, and what they hold is not carried again.
  cat "$MACHINE" > "$work/have.txt"
  local more
  for more in "$@"; do
    grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' "$more" | tee -a "$work/have.txt" >> "$work/constraints.txt"
  done
  # The last pin of a name wins (the sglang lock's protobuf over the machine's).
  tac "$work/constraints.txt" | awk -F'==' '!seen[tolower($1)]++' > "$work/c" && mv "$work/c" "$work/constraints.txt"
  echo "$want" > "$work/in.txt"
  for _ in $(seq 1 30); do
    if "$uv" pip compile -q "$work/in.txt" -c "$work/constraints.txt" --generate-hashes \
      --python-version 3.12 --python-platform x86_64-manylinux_2_39 -o "$work/all.txt" \
      2> "$work/err"; then
      break
    fi
    local dropped=0 name
    for name in $(grep -oE '[A-Za-z0-9_.-]+==[^ ,]+' "$work/err" | cut -d= -f1 | sort -u); do
      if grep -qiE "^${name}==" "$work/constraints.txt"; then
        grep -viE "^${name}==" "$work/constraints.txt" > "$work/c" && mv "$work/c" "$work/constraints.txt"
        echo "lock: sglang needs another $name than the machine's" >&2
        dropped=1
        break
      fi
    done
    [[ $dropped == 1 ]] || { cat "$work/err" >&2; exit 1; }
  done
  py - "$work/all.txt" "$work/have.txt" "$lockfile" "$want" <<'EOF'
import re, sys
resolved, machine, lock, want = sys.argv[1:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {}
for line in open(machine):
    if re.match(r"^[A-Za-z0-9_.-]+==", line):
        name, v = line.strip().split("==")
        have[norm(name)] = v.split("+")[0]
blocks, block = [], []
for line in open(resolved):
    if re.match(r"^[A-Za-z0-9]", line):
        block = [line.rstrip()]
        blocks.append(block)
    elif line.startswith("    --hash") and block:
        block.append(line.rstrip())
keep = []
for block in blocks:
    name, v = block[0].split()[0].split("==")
    if have.get(norm(name.split("[")[0])) != v:
        keep.append("\n".join(block).rstrip(" \\"))
with open(lock, "w") as out:
    out.write(
        f"# {want} for the lent GPU machines (CPython 3.12, manylinux x86_64): exactly\n"
        f"# the packages, by name and version, that requirements/gpu-machine.txt does not have"
        + (".\n" if lock.endswith("gpu-sglang.txt") else "\n# (nor requirements/gpu-sglang.txt).\n")
        + f"# Made by `hack/sglang-gpu-set.sh lock{'' if lock.endswith('gpu-sglang.txt') else '-ray'}`;"
        f" installed there by hack/sglang-gpu-install.sh.\n"
    )
    out.write("\n".join(keep) + "\n")
print(f"lock: {len(keep)} of {len(blocks)} packages to carry -> {lock}")
EOF
}

pack() {
  local wheels=$CACHE/wheels-$SGLANG_VERSION stage=$CACHE/stage-$SGLANG_VERSION
  mkdir -p "$wheels"
  py -m pip download -q --no-deps --require-hashes -r "$LOCK" -r "$RAY_LOCK" --dest "$wheels" "${TARGET[@]}"
  # Unpack exactly the locked files (a stale wheel from an older lock must not come along).
  local want
  want=$(py - "$LOCK" "$RAY_LOCK" "$wheels" <<'EOF'
import re, sys, pathlib
lock, ray_lock, wheels = sys.argv[1:]
norm = lambda n: re.sub(r"[-_.]+", "_", n).lower()
text = open(lock).read() + open(ray_lock).read()
pins = {norm(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9_.-]+)(?:\[[^]]*\])?==(\S+)", text, re.M)}
for wheel in sorted(pathlib.Path(wheels).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if pins.get(norm(name)) == version:
        print(wheel)
EOF
)
  local count
  count=$(cat "$LOCK" "$RAY_LOCK" | grep -cE '^[A-Za-z0-9]')
  [[ $(echo "$want" | wc -l) == "$count" ]] || { echo "pack: $count pins but wheels: $want" >&2; exit 1; }
  rm -rf "$stage" "$OUT"
  mkdir -p "$stage/core" "$stage/extra" "$stage/ray" "$OUT"
  # One pip call per group: wheels that share a top-level folder (nvidia/, the CUDA namespace)
  # are merged; with one call per wheel pip would keep only the first.
  local wheel core=() extra=() ray=() ray_pins
  # The ray lock's names, normalised as wheel file names spell them (versions: see `want`).
  ray_pins=$(grep -oE '^[A-Za-z0-9_.-]+==' "$RAY_LOCK" | sed 's/==$//' | tr 'A-Z.-' 'a-z__')
  for wheel in $want; do
    if grep -qxF "$(basename "$wheel" | cut -d- -f1 | tr 'A-Z.-' 'a-z__')" <<< "$ray_pins"; then
      ray+=("$wheel")
    elif [[ $(basename "$wheel" | cut -d- -f1) =~ $EXTRA ]]; then extra+=("$wheel"); else core+=("$wheel"); fi
  done
  export PIP_ROOT_USER_ACTION=ignore
  py -m pip install -q --no-deps --no-compile --ignore-requires-python --target "$stage/core" "${TARGET[@]}" "${core[@]}"
  py -m pip install -q --no-deps --no-compile --ignore-requires-python --target "$stage/extra" "${TARGET[@]}" "${extra[@]}"
  py -m pip install -q --no-deps --no-compile --ignore-requires-python --target "$stage/ray" "${TARGET[@]}" "${ray[@]}"
  # The GPU machine has its own python: scripts pip wrote here would name this one.
  rm -rf "$stage"/*/bin
  for group in core extra ray; do
    # A long window finds the repeats across the kernel libraries' cubins (about 4x smaller
    # than the wheels for sgl_kernel).
    tar -C "$stage/$group" -cf - . | zstd -q -T0 -12 --long=30 | split -b "$PIECE" -d -a 2 - "$OUT/$group.tar.zst."
  done
  cp "$wheels"/zstandard-*.whl "$OUT/"
  (cd "$OUT" && sha256sum -- * > MANIFEST)
  # .whl/: what `bench/gpu_steps.sh deps` installs first, carried with the first call:
  # xgrammar (0.5.17's server_args imports it; the rest of `extra` is not needed) and pydantic
  # with its dependencies at the lock's versions, so rljob's own modules import before SGLang's
  # pieces are in (a fresh checkout's first `deps` failed without them, 2026-12-03).
  rm -rf .whl && mkdir -p .whl
  cp "$wheels"/xgrammar-*.whl .whl/
  local pins
  pins=$(grep -oE '^(pydantic|pydantic-core|annotated-types|typing-inspection|typing-extensions)==[^ ]+' requirements/ci.txt)
  # shellcheck disable=SC2086  # one pin a word
  py -m pip download -q --no-deps --dest .whl "${TARGET[@]}" $pins
  du -sh "$stage/core" "$stage/extra" "$stage/ray"
  ls -l "$OUT" .whl
}

case "${1:-}" in
  lock) lock "sglang==$SGLANG_VERSION" "$LOCK" ;;
  lock-ray) lock "ray==$RAY_VERSION" "$RAY_LOCK" "$LOCK" ;;
  pack) pack ;;
  *) echo "usage: $0 lock|lock-ray|pack" >&2; exit 2 ;;
esac
