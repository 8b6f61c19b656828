#!/usr/bin/env bash
# Runs on the lent GPU machine, once per call that carries pieces of .gl/sglang/ (made here by
# `hack/sglang-gpu-set.sh pack`). Every call runs the same command:
#
#   bash hack/sglang-gpu-install.sh [DIR]        (DIR defaults to /tmp/rljob-sglang)
#
# It keeps the carried pieces in DIR/pieces (the machine keeps /tmp while it is held), checks each
# against MANIFEST, and as soon as every piece of a group (core, extra, ray) is there it joins them and
# unpacks the group into DIR/site. When `core` is in, it prints the line that puts SGLang on the
# path: `export PYTHONPATH=DIR/site`. Exit status: 0 once core is installed, 3 while pieces are
# still missing, 1 on a bad piece.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-/tmp/rljob-sglang}
SRC=.gl/sglang
mkdir -p "$DIR/pieces" "$DIR/site" "$DIR/tools"

if [[ -d $SRC ]]; then
  cp -f "$SRC"/* "$DIR/pieces/"
fi
cd "$DIR/pieces"
[[ -f MANIFEST ]] || { echo "sglang-gpu-install: no MANIFEST yet: carry .gl/sglang/MANIFEST" >&2; exit 3; }
# Every piece present must be the one packed; a missing one is only waited for.
present=$(awk '{print $2}' MANIFEST | while read -r f; do [[ -f $f ]] && echo "$f"; done || true)
[[ -z $present ]] || grep -F -f <(echo "$present") MANIFEST | sha256sum --quiet -c - || {
  echo "sglang-gpu-install: a piece does not match MANIFEST" >&2
  exit 1
}

unzstd_stream() {
  if command -v zstd > /dev/null; then
    zstd -d -q --long=31 -c
  else
    # The machine has no zstd binary: the zstandard module from the carried wheel unpacks it.
    if [[ ! -d $DIR/tools/zstandard ]]; then
      python3 -m pip install -q --no-deps --no-index --target "$DIR/tools" ./zstandard-*.whl
    fi
    PYTHONPATH=$DIR/tools python3 -c '
import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=1 << 31).copy_stream(sys.stdin.buffer, sys.stdout.buffer)'
  fi
}

status=0
for group in core extra ray; do
  pieces=$(awk '{print $2}' MANIFEST | grep -E "^$group\.tar\.zst\.[0-9]+$" | sort)
  total=$(echo "$pieces" | grep -c . || true)
  have=$(for p in $pieces; do [[ -f $p ]] && echo "$p"; done | grep -c . || true)
  if [[ -f $DIR/$group.installed ]]; then
    echo "sglang-gpu-install: $group installed"
  elif [[ $total -gt 0 && $have == "$total" ]]; then
    start=$SECONDS
    # shellcheck disable=SC2086
    cat $pieces | unzstd_stream | tar -C "$DIR/site" -xf -
    touch "$DIR/$group.installed"
    echo "sglang-gpu-install: $group installed from $total pieces in $((SECONDS - start)) s"
    rm -f $pieces
  else
    echo "sglang-gpu-install: $group has $have of $total pieces"
    [[ $group == core ]] && status=3
  fi
done
if [[ $status == 0 ]]; then
  echo "export PYTHONPATH=$DIR/site"
fi
exit $status
