#!/usr/bin/env bash
# bench/gpu_steps.sh steps that outlast one device call (a call runs at most 10 minutes; one
# point of the 3B realistic workload runs longer). The device tool ends what a call leaves
# running, except a process that started its own session: those run on until the machine goes
# back. So:
#
#   bash bench/gpu_bg.sh start NAME STEP...   run `gpu_steps.sh STEP...` in a session of its own
#                                            (setsid) and return at once
#   bash bench/gpu_bg.sh wait NAME SECONDS    wait up to SECONDS for NAME to end, then bring back
#                                            what it has so far either way: its log and each
#                                            step's archive (packed every 30 s while it runs)
#                                            into this call's $OUT
#
# The steps' environment passes through (CUDA_VISIBLE_DEVICES=1 bash bench/gpu_bg.sh start ...
# runs them on the second card). A later call must keep the machine held (the next call within
# its idle window, or a `wait` call in flight) or the run is lost with the machine.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${RLJOB_BG_DIR:-/tmp/rljob-bg}
usage() { sed -n '2,14p' "$0" >&2; exit 2; }
(($# >= 2)) || usage
verb=$1 name=$2
shift 2
dir=$B/$name
case $verb in
  start)
    (($# >= 1)) || usage
    if [[ -d $dir && ! -f $dir/rc ]]; then
      echo "$name is running already (since $(cat "$dir/started"))" >&2
      exit 1
    fi
    rm -rf "$dir" && mkdir -p "$dir/out"
    date -u +%FT%TZ > "$dir/started"
    # Its own session, its own OUT (this call's $OUT is emptied before the next call).
    OUT=$dir/out setsid nohup bash -c 'bash bench/gpu_steps.sh "$@"; echo $? > "$0/rc"' \
      "$dir" "$@" > "$dir/log" 2>&1 < /dev/null &
    echo "started $name (pid $!): gpu_steps.sh $*" ;;
  wait)
    (($# == 1)) || usage
    [[ -d $dir ]] || { echo "no run named $name under $B" >&2; exit 2; }
    deadline=$((SECONDS + $1))
    while [[ ! -f $dir/rc ]] && ((SECONDS < deadline)); do sleep 5; done
    if [[ -f $dir/rc ]]; then
      echo "$name ended: exit $(cat "$dir/rc")"
    else
      echo "$name still running after ${1} s (started $(cat "$dir/started"))"
    fi
    if [[ -n ${OUT:-} ]]; then
      cp "$dir/log" "$OUT/$name.log"
      for archive in "$dir"/out/*.tgz; do
        [[ -f $archive ]] && cp "$archive" "$OUT/$name-$(basename "$archive")"
      done
    fi
    tail -40 "$dir/log" ;;
  *) usage ;;
esac
