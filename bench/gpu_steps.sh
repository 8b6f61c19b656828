#!/usr/bin/env bash
# The GPU measurements as named steps, for the device tool's calls (one or more steps a call):
#
#   bash bench/gpu_steps.sh STEP...
#
# Run from the repository root on the lent machine, after SGLang is installed there
# (hack/sglang-gpu-install.sh, call by call: docs/development.md). Each step writes under
# /tmp/rljob-steps/STEP (RLJOB_STEPS_DIR) and packs that folder into $OUT/STEP.tgz when it ends,
# and every 30 s while it runs, so a step cut by the call's limit still brings back what it had
# written (the device tool brings back at most 8 files, 2 folders deep: one archive a step keeps
# under that). Unpack them here into bench/results/raw/. A step that needs two cards says so;
# `par1` runs two one-card steps side by side on a two-card machine.
#
# Steps (the issue each serves):
#   install      xgrammar's wheel from .whl/ (carry it) and the carried .gl/sglang pieces
#   deps         the wheels in .whl/ only (xgrammar, and pydantic with its three dependencies, so
#                rljob's own modules import before SGLang's pieces are all there), then the
#                carried pieces: the install calls also run the steps that need only torch
#   models       the bench's random 1.5B, 3B and 7B models under /tmp/rljob-bench-models (once;
#                MODELS="qwen2.5-3b qwen2.5-7b" builds only those)
#   ckpt-1.5b    #30: ckpt-bench's 1.5B half (torch only); ckpt-3b: its 3B half; ckpt-7b: the
#                7B shape (91 GB a save: a two-card machine's disk; one H200; pinned only)
#                (CKPT_REPEATS=N: saves each way, 2 unless set, 1 at 7B; CKPT_MODES: a list
#                of checkpoint_gpu.py's modes, sync,async,pinned unless set, pinned at 7B)
#   load-7b      #30: `rljob run bench/plans/load-7b-two-gpu.yaml`, the sharded loader's start-up
#                peak against the plan's load row, 7B over two cards (two H200s)
#   tp2-3x3      #35: 3B TP 2 at Auto's choice, 3 runs of 3 iterations, then Auto + 0.01 and
#                + 0.02 (the sweep's next points) (two cards)
#   sanity       tests/gpu/test_sglang_gpu.py and test_loop_gpu.py (one card; about 5 minutes);
#                PYTEST_K selects tests in any pytest step
#   sanity-rest  the other one-card files: engine, saver exit, overlap staging, multi-turn, IPC
#                alias, validation
#   multi-gpu    test_multi_gpu.py and test_weight_gather_gpu.py (two cards, torch and NCCL only)
#   ckpt-resume  #30: kill, resume and export of the 1.5B job (bench/checkpoint_resume_gpu.sh)
#   ckpt-bench   #30: bench/checkpoint_gpu.py, sync against the async (pinned) save, 1.5B and 3B
#   mt-test      #32: tests/gpu/test_multi_turn_gpu.py
#   val-test     tests/gpu/test_validation_gpu.py (spec.data.validation and the rate schedule)
#   mt-bench     #32: bench/multi_turn.py on sglang (the random 0.5B model: 32k context)
#   mt-engines   #32: two engines, sticky against random routing: one a GPU where two are
#                visible, else both on one card
#   mt-tools     #32: mt-bench with 256 conversations and tools that take time (--tool-seconds
#                0.3: log-normal, median 0.3 s, as a code runner or a search API), 2-4 turns
#                (builtin:python's pool of runners); mt-tools-spawn: the same with the interpreter
#                spawned per call it replaced (--python-runner spawn), to compare on one machine
#   mt-long      #32: mt-tools at 3 turns with turns of up to 256 x 1/4..4 tokens (agentic lengths);
#                MT_MODEL (qwen2.5-0.5b), MT_CONVERSATIONS (256), MT_MEM_FRACTION (0.6) and
#                MT_TOOL_SECONDS (0.3, the tools' median wait) change the regime; MT_TURNS="2 3 4"
#                runs each of those numbers of turns (3 unless set); MT_ARGS more arguments of
#                bench/multi_turn.py (here and in mt-sched), e.g. "--partial 0.5 --rollouts 3"
#   mt-sched     #32: the 3B, 1024-conversation mt-long point once per sglang scheduler setting
#                (MT_SCHED: base, delayer), each in its own process, to compare on one card
#   tool-runner  #32: bench/tool_runner.py, builtin:python's calls/s spawn against pool (CPU only)
#   sync-paths   #33: the weight-sync paths at 3B beside their floor (small workload)
#   sync-direct  #33: the same for the direct hand-off against the per-tensor one (one card)
#   sync-buckets #33: the direct hand-off with 512, 2048 and 8192 MiB buckets (one card;
#                BUCKETS_MB), the loader's own seconds beside each hand-off; SYNC_BEFORE_TREE
#                (an older tree's worker_image, carried) runs each size with it first; each
#                size's sync is split into its parts (bench/sync_trip.py: mbN-trip.md); SYNC_TP
#                one engine over that many cards (full buckets, then shard to shard)
#   shard-profile #33: the weight sync's parts without a loop, the shard-to-shard send's too
#                (SYNC_MODEL, SYNC_RANKS, SYNC_TP, BUCKETS_MB; torch only)
#   copy-kernels #33: bench/copy_kernels.py, the sync's two copies launched four ways (torch only)
#   link-probe   #33: bench/link_probe.py, the all-gather and card-to-card copies alone
#                (two cards, torch only), with NCCL's defaults and LINK_SETTINGS
#   gather-probe #33: bench/gather_probe.py, the trainer's side of a 3B sync alone (torch only)
#   realistic-7b #33/#30: 7B realistic over two cards with the async checkpoint (gpu_bg.sh;
#                SYNC_PATH, ALONE=1)
#   realistic    #33: 3B realistic workload, before and after (one card)
#   realistic-ckpt #33/#30: 3B realistic, overlapStaging Off, the async checkpoint at iteration 2
#                (its share of the iteration; CKPT_EVERY=1 ITERS=3 ALONE=0: a save every
#                iteration, on a 128 GiB disk); realistic-on: overlapStaging On. Each runs
#                longer than a call: start them with bench/gpu_bg.sh
#   train-alone  #33: bench/train_alone.py, the train stage alone at the realistic 3B shape:
#                64 rows with a profile, then all 1024 with micro-batches packed by length and
#                not (one card, no SGLang: only the deps call before it; about 5 minutes)
#   train-alone-7b #33: the same at 7B over two cards (two H200s), micro-batch 4, packed
#   overlap      #33: 3B one card, staging tax with overlapStaging off then on: small workload,
#                then realistic (2 iterations; the deadline keeps the call under 10 minutes)
#   overlap-test #33: tests/gpu/test_overlap_staging_gpu.py (on = off bit for bit, on the card)
#   writer-stalls #30: bench/writer_stalls.py, the checkpoint writer's stalls (CPU only)
#   staging-probe #33: bench/staging_probe.py: which host calls make a side-stream copy end early
#   alloc-probe  #33: bench/alloc_probe.py: a sync buffer's fill after empty_cache, from torch's
#                cache, and held (torch only, one card)
#   tp2          #31: 3B, one TP-2 engine over both cards, at Auto's choice on the card (two cards)
#   tp2-next     #31/#35: the same at Auto's choice + 0.01, the sweep's next point (two cards)
#   two-gpu      #31: tests/gpu/test_two_gpu_sglang.py (two cards; needs ray: carry its pieces)
#   two-gpu-1    its TP-2 tests (3 items, about 4 min with FlashInfer's first compile);
#   two-gpu-2    the rest: Ray driver at TP 1 and 2, a worker killed, a TP leader killed (4 items,
#                about 6.5 min): one call each
#   auto-7b      #35: the 7B job at Auto's choice, 3 runs of 3 iterations (two H200s)
#   sweep-7b     #35: the 7B sweep around Auto's choice (two H200s)
#   ckpt-writer  #30: the async checkpoint's writer at 1.5B, before and after its fix, beside a
#                busy (pure-Python) main thread, and the disk's floor (one card; ~150 s)
#   par1         ckpt-resume on card 0 beside mt-test and mt-bench on card 1 (two cards)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/rljob-sglang/site:/tmp/rljob-xg:$PWD:$PWD/worker_image:$PWD/operator:$PWD/tests
export RLJOB_GPU_SGLANG=1 PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
R=${RLJOB_STEPS_DIR:-/tmp/rljob-steps}
mkdir -p "$R"
nvidia-smi --query-gpu=index,name,uuid,memory.total,driver_version --format=csv,noheader > "$R/gpus.txt" || echo "no nvidia-smi" > "$R/gpus.txt"
cat "$R/gpus.txt"

model() {  # the bench's random Qwen2.5-shaped model, built once per machine
  python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import colocate; \
colocate.build_model('$1', Path('/tmp/rljob-bench-models/$1'))"
}
auto() {  # "wakeUp fraction" that rollout Auto chooses for a manifest on this card
  python3 bench/auto_fraction.py "bench/plans/$1.yaml"
}
colocate() { python3 bench/colocate.py --engine sglang "$@"; }

pack() {  # pack STEP: its folder into $OUT/STEP.tgz (written aside, then renamed: never half)
  [[ -n ${OUT:-} ]] || return 0
  tar -C "$R" -czf "$OUT/.$1.tgz" "$1" gpus.txt 2> /dev/null && mv -f "$OUT/.$1.tgz" "$OUT/$1.tgz"
}

for step in "$@"; do
  start=$SECONDS
  out=$R/$step
  mkdir -p "$out"
  # A call cut by its time limit brings back what is under $OUT then: pack the step's folder
  # every 30 s (RLJOB_STEP_PACK_SECONDS) while it runs, so a cut step returns what it wrote.
  (while sleep "${RLJOB_STEP_PACK_SECONDS:-30}"; do pack "$step"; done) > /dev/null 2>&1 &
  packer=$!
  case $step in
    deps)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rljob-xg .whl/*.whl
      python3 -c "import pydantic, rljob.api, rljob_worker.train; print('rljob imports')"
      bash hack/sglang-gpu-install.sh
      echo "install: exit $? (3: pieces still missing)" ;;
    models)
      for m in ${MODELS:-qwen2.5-1.5b qwen2.5-3b qwen2.5-7b}; do model "$m"; done
      du -sh /tmp/rljob-bench-models/* ;;
    ckpt-bench | ckpt-1.5b | ckpt-3b | ckpt-7b)
      sizes=$([[ $step == ckpt-bench ]] && echo "1.5b 3b" || echo "${step#ckpt-}")
      for size in $sizes; do
        m=qwen2.5-$size
        df -h /tmp | tail -1
        # 7B: one pinned save after the first unless told (dcp.save beside the 91 GB of pinned
        # buffers was killed by the host's OOM killer on a 251 GiB machine).
        modes=sync,async,pinned repeats=2
        [[ $size == 7b ]] && modes=pinned repeats=1
        model "$m" && python3 bench/checkpoint_gpu.py --model-dir "/tmp/rljob-bench-models/$m" \
          --repeats "${CKPT_REPEATS:-$repeats}" --modes "${CKPT_MODES:-$modes}" \
          --out "$out/ckpt-gpu-$m.json" > "$out/ckpt-gpu-$m.log" 2>&1
        echo "checkpoint_gpu exit $?"; tail -15 "$out/ckpt-gpu-$m.log"
      done ;;
    load-7b)
      model qwen2.5-7b && python3 -m rljob.cli run bench/plans/load-7b-two-gpu.yaml --device cuda \
        --out "$out/run" > "$out/log" 2>&1
      echo "rljob run exit $?"; grep -E "start-up load|Succeeded|Failed|OOM" "$out/log" | head; tail -30 "$out/log" ;;
    tp2-3x3)
      read -r wake fraction < <(auto auto-sglang-3b-tp2-two-gpu)
      next=$(python3 -c "print(f'{$fraction + 0.01:.2f},{$fraction + 0.02:.2f}')")
      echo "Auto on these cards: $wake $fraction; then $next" | tee "$out/auto.txt"
      colocate --model qwen2.5-3b --ranks 2 --tp 2 --modes "$wake" \
        "--$wake-fractions" "$fraction,$fraction,$fraction,$next" --keep-going --iterations 3 \
        --no-alone --deadline-seconds 300 --out "$out/run" > "$out/log" 2>&1
      tail -30 "$out/log" ;;
    sanity | sanity-rest | multi-gpu | mt-test | overlap-test | ipc-test | val-test)
      case $step in
        val-test) files=tests/gpu/test_validation_gpu.py ;;
        sanity) files="tests/gpu/test_sglang_gpu.py tests/gpu/test_loop_gpu.py" ;;
        ipc-test) files=tests/gpu/test_ipc_alias_gpu.py ;;
        mt-test) files=tests/gpu/test_multi_turn_gpu.py ;;
        overlap-test) files=tests/gpu/test_overlap_staging_gpu.py ;;
        sanity-rest) files="tests/gpu/test_engine_gpu.py tests/gpu/test_saver_exit_gpu.py
          tests/gpu/test_overlap_staging_gpu.py tests/gpu/test_multi_turn_gpu.py
          tests/gpu/test_ipc_alias_gpu.py tests/gpu/test_validation_gpu.py" ;;
        *) files="tests/gpu/test_multi_gpu.py tests/gpu/test_weight_gather_gpu.py" ;;
      esac
      # shellcheck disable=SC2086  # a list of paths
      python3 -m pytest -v -s $files ${PYTEST_K:+-k "$PYTEST_K"} > "$out/pytest.log" 2>&1
      echo "pytest exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/pytest.log" | tail -14 ;;
    install)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/rljob-xg .whl/*.whl
      bash hack/sglang-gpu-install.sh
      echo "install: exit $? (3: pieces still missing)" ;;
    ckpt-resume)
      bash bench/checkpoint_resume_gpu.sh "$out" 2>&1 | tail -40 ;;
    mt-bench)
      model qwen2.5-0.5b && python3 bench/multi_turn.py --engine sglang --device cuda --dtype bfloat16 \
        --model /tmp/rljob-bench-models/qwen2.5-0.5b --conversations 64 --turns 2 3 4 --spread \
        --out "$out/one" > "$out/log" 2>&1
      tail -12 "$out/log" ;;
    mt-tools|mt-tools-spawn)
      runner=pool; [[ $step == mt-tools-spawn ]] && runner=spawn
      model qwen2.5-0.5b && python3 bench/multi_turn.py --engine sglang --device cuda --dtype bfloat16 \
        --model /tmp/rljob-bench-models/qwen2.5-0.5b --conversations 256 --turns 2 3 4 --spread \
        --tool-seconds 0.3 --python-runner $runner --out "$out/tools" > "$out/log" 2>&1
      tail -12 "$out/log" ;;
    mt-long)
      # mt-tools at agentic turn lengths: a turn samples up to 256 x 1/4..4 tokens (--spread:
      # 64-1024, long-tailed) instead of 24 x that, 3 turns, the same slow tools.
      m=${MT_MODEL:-qwen2.5-0.5b}
      model "$m" && python3 bench/multi_turn.py --engine sglang --device cuda --dtype bfloat16 \
        --model "/tmp/rljob-bench-models/$m" --conversations "${MT_CONVERSATIONS:-256}" --turns ${MT_TURNS:-3} \
        --turn-tokens 256 --spread --tool-seconds "${MT_TOOL_SECONDS:-0.3}" \
        --mem-fraction "${MT_MEM_FRACTION:-0.6}" ${MT_ARGS:-} --out "$out/long" > "$out/log" 2>&1
      tail -12 "$out/log" ;;
    mt-sched)
      # The 3B, 1024-conversation point where async lost (0.85x with decode graphs up to 1024):
      # the same rollouts once per sglang scheduler setting, each in a process of its own, on one
      # card. `delayer`: sglang's prefill delayer with its queue trigger (0.5.17), so the turns
      # that arrive one by one while the batch decodes are prefilled together, not each in a
      # pass of its own that pauses every running conversation. MT_SCHED picks the settings.
      declare -A sched=(
        [base]='{"cuda_graph_max_bs_decode": 1024}'
        [delayer]='{"cuda_graph_max_bs_decode": 1024, "enable_prefill_delayer": true, "prefill_delayer_queue_min_ratio": 0.05, "prefill_delayer_max_delay_ms": 100}'
      )
      m=${MT_MODEL:-qwen2.5-3b}
      model "$m"
      for name in ${MT_SCHED:-base delayer}; do
        RLJOB_SGLANG_ENGINE_ARGS=${sched[$name]} python3 bench/multi_turn.py --engine sglang \
          --device cuda --dtype bfloat16 --model "/tmp/rljob-bench-models/$m" \
          --conversations "${MT_CONVERSATIONS:-1024}" --turns ${MT_TURNS:-3} --turn-tokens 256 --spread \
          --tool-seconds "${MT_TOOL_SECONDS:-0.3}" --mem-fraction "${MT_MEM_FRACTION:-0.85}" \
          ${MT_ARGS:-} --out "$out/$name" > "$out/$name.log" 2>&1
        echo "$name: exit $? ${sched[$name]}"; grep -E '^\{"turns_per' "$out/$name.log" | cut -c1-400
      done ;;
    copy-kernels)
      python3 bench/copy_kernels.py --repeats 10 --large-bytes 1048576 8388608 33554432 \
        --out "$out" > "$out/log" 2>&1
      tail -14 "$out/log" ;;
    link-probe)
      # #33: the link between the cards alone (bench/link_probe.py): the all-gather of 512 MiB,
      # 4 GiB and 15 GiB receive buffers (a 7B bucket, the whole 7B model in bf16) over all
      # visible cards, and the copy engines' card-to-card copy; once with NCCL's defaults and
      # once per setting in LINK_SETTINGS (default: more channels; the simple protocol).
      python3 bench/link_probe.py --ranks "$(nvidia-smi -L | wc -l)" --mb 512 4096 15360 \
        --out "$out/default.json" 2>&1 | tee "$out/default.log"
      for setting in ${LINK_SETTINGS:-NCCL_MIN_NCHANNELS=32 NCCL_PROTO=Simple}; do
        env "$setting" python3 bench/link_probe.py --ranks "$(nvidia-smi -L | wc -l)" \
          --mb 512 4096 15360 --out "$out/$setting.json" 2>&1 | tee "$out/$setting.log"
      done ;;
    shard-profile)
      # #33: the weight sync's parts without a loop (bench/colocate.py profile_weight_sync) at
      # SYNC_MODEL over SYNC_RANKS cards, each size in BUCKETS_MB; with SYNC_TP equal to the
      # ranks, the shard-to-shard send by part (fill, exchange as all_to_all and as all-gather).
      for mb in ${BUCKETS_MB:-16384 4096}; do
        python3 -c "import json, sys; sys.path.insert(0, 'bench'); import colocate; \
print(json.dumps(colocate.profile_weight_sync(sys.argv[1], ranks=int(sys.argv[2]), \
bucket_mb=int(sys.argv[3]), tp=int(sys.argv[4])), indent=1))" "${SYNC_MODEL:-qwen2.5-7b}" \
          "${SYNC_RANKS:-2}" "$mb" "${SYNC_TP:-2}" > "$out/mb$mb.json" 2> "$out/mb$mb.log"
        echo "mb$mb: exit $?"; cat "$out/mb$mb.json"; tail -3 "$out/mb$mb.log"
      done ;;
    gather-probe)
      # ENGINE_CASTS=1: the one-rank sync to an engine that casts (the trainer's buffer as is).
      casts=(); [[ ${ENGINE_CASTS:-0} == 1 ]] && casts=(--engine-casts)
      model qwen2.5-3b && python3 bench/gather_probe.py --model qwen2.5-3b --syncs 8 \
        --sampler-ms 0 5 --empty-cache 0 1 "${casts[@]}" --out "$out" > "$out/log" 2>&1
      tail -5 "$out/log" ;;
    tool-runner)
      python3 bench/tool_runner.py --calls 64 256 --repeats 5 --out "$out/tool_runner" > "$out/log" 2>&1
      tail -9 "$out/log" ;;
    mt-engines)
      # Two engines, one a GPU where two are visible (the issue's first choice), else (or if
      # that fails) both on one GPU at half the fraction each.
      model qwen2.5-0.5b
      two_engines() {  # two_engines NAME [ARG...]: the routing bench into $out/NAME(.log)
        python3 bench/multi_turn.py --engine sglang --device cuda --dtype bfloat16 \
          --model /tmp/rljob-bench-models/qwen2.5-0.5b --conversations 64 --turns 3 --engines 2 \
          --mem-fraction 0.6 --out "$out/$1" "${@:2}" > "$out/$1.log" 2>&1
      }
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())") rc=1
      if ((gpus >= 2)); then
        two_engines two-gpus --gpus 2
        rc=$?; echo "two engines on two GPUs: exit $rc"; tail -12 "$out/two-gpus.log"
      fi
      if ((gpus < 2 || rc != 0)); then
        two_engines two; tail -12 "$out/two.log"
      fi ;;
    sync-paths)
      colocate --model qwen2.5-3b --modes staged --staged-fractions 0.9 --prompts 4 \
        --sync-path before,flattened --no-alone --deadline-seconds 420 --out "$out/run" > "$out/log" 2>&1
      tail -30 "$out/log" ;;
    sync-direct)
      colocate --model qwen2.5-3b --modes staged --staged-fractions 0.9 --prompts 4 \
        --sync-path before,direct --no-alone --deadline-seconds 420 --out "$out/run" > "$out/log" 2>&1
      echo "colocate exit $?"; tail -30 "$out/log" ;;
    sync-buckets)
      # The direct hand-off's bucket size at 3B, one card: 512 MiB (the spec's default), 2048
      # (a quarter of the buckets; the plan's weight-sync stage holds two at a time) and 8192
      # (the whole 6.2 GB model in one). The loader's own seconds per call go to
      # mbN-loader.jsonl (RLJOB_SGLANG_DIRECT_TIMINGS): the hand-off less those is the
      # request's trip through sglang's processes. SYNC_BEFORE_TREE=<a worker_image folder of
      # an older tree> runs each size with that tree's worker first (mbN-before), so a change
      # to the hand-off is measured before and after on one card. SYNC_MODEL, SYNC_RANKS and
      # SYNC_FRACTION: another shape (built by `models` first), FSDP over that many cards.
      # Over more than one card the after tree's points also time the all-gathers alone
      # (--profile-sync): the floor with the link (colocate.stage_floors).
      # SYNC_PROFILE=0 skips that; SYNC_PATH another --sync-path (its name joins the tag).
      # SYNC_TP=<n>: one engine over n cards (--tp); with SYNC_RANKS equal to it, each size runs
      # with the full gather (RLJOB_TP_SHARDED_SYNC=0, tag -full), shard to shard with the own
      # blocks in the buffer (=buffer, tag -buffer) and shard to shard with them read as stored
      # (the default, tag -sharded; rljob_worker/tp_shards.py), or only the kinds in
      # SYNC_TP_SENDS.
      for tree in ${SYNC_BEFORE_TREE:+before} after; do
        for mb in ${BUCKETS_MB:-512 2048 8192}; do
         sends=plain
         [[ ${SYNC_TP:-1} -gt 1 && ${SYNC_TP:-1} == "${SYNC_RANKS:-1}" ]] &&
           sends=${SYNC_TP_SENDS:-full buffer sharded}
         for send in $sends; do
          sync_path=${SYNC_PATH:-direct} tag=mb$mb path=$PYTHONPATH profile=() switch=1
          [[ $sync_path != direct ]] && tag=mb$mb-$sync_path
          [[ $send != plain ]] && tag=$tag-$send
          [[ $send == full ]] && switch=0
          [[ $send == buffer ]] && switch=buffer
          [[ $tree == after && ${SYNC_RANKS:-1} -gt 1 && ${SYNC_PROFILE:-1} == 1 ]] &&
            profile=(--profile-sync)
          [[ $tree == before ]] && tag=$tag-before path=$SYNC_BEFORE_TREE:$PYTHONPATH
          rm -f "$out/$tag-loader.jsonl"  # a rerun on a warm machine starts it anew
          PYTHONPATH=$path RLJOB_SGLANG_DIRECT_TIMINGS=$out/$tag-loader.jsonl \
            RLJOB_TP_SHARDED_SYNC=$switch \
            colocate --model "${SYNC_MODEL:-qwen2.5-3b}" --ranks "${SYNC_RANKS:-1}" --modes staged \
            --tp "${SYNC_TP:-1}" --staged-fractions "${SYNC_FRACTION:-0.9}" --prompts 4 \
            --sync-path "$sync_path" --bucket-mb "$mb" --no-alone --deadline-seconds 420 \
            "${profile[@]}" --out "$out/$tag" > "$out/$tag.log" 2>&1
          echo "$tag: colocate exit $?"; grep -E "weight sync within|hand-off" "$out/$tag.log" | tail -3
          python3 -c "import json, statistics as s, sys; r = [json.loads(l) for l in open(sys.argv[1])]; \
r = [x for x in r if x.get('call', 'loader') == 'loader']; \
print(f'loader calls {len(r)}, bytes/call {s.median(x[\"bytes\"] for x in r) / 2**20:.0f} MiB, seconds/call median \
{s.median(x[\"seconds\"] for x in r) * 1e3:.2f} ms (launch {s.median(x[\"launch_seconds\"] for x in r) * 1e3:.2f} ms), \
fallback tensors {sum(x[\"fallback_tensors\"] for x in r)}')" "$out/$tag-loader.jsonl"
          # This tree's stage and adapter also write their spans there: the sync split in parts.
          [[ $tree == after ]] && python3 bench/sync_trip.py "$out/$tag-loader.jsonl" \
            --json "$out/$tag-trip.json" | tee "$out/$tag-trip.md"
         done
        done
      done ;;
    realistic-7b)
      # #33 and #30: 7B over two cards (one engine and one FSDP rank per card), the realistic
      # workload, overlapStaging Off, the asynchronous checkpoint at iteration 2 (45 GB a rank:
      # one fits the two-card machine's disk), the weight-sync path SYNC_PATH (default unless
      # set); ALONE=1 also runs the engine alone after the point; CKPT=0: 3 iterations and no
      # checkpoint; ITERS=3: the save at iteration 2 and one iteration after it (does the
      # writer slow the next train?); RLJOB_CHECKPOINT_WRITER_START=after_sync (passed through
      # to the ranks) starts the writer after the weight sync. Start it with gpu_bg.sh.
      df -h /tmp | tail -1
      alone=(--no-alone); [[ ${ALONE:-0} == 1 ]] && alone=()
      ckpt=(--iterations "${ITERS:-2}" --checkpoint-every 2 --checkpoint-dir /tmp/rljob-bench-checkpoints)
      [[ ${CKPT:-1} == 0 ]] && ckpt=(--iterations 3)  # CKPT=0: 3 iterations, no checkpoint
      colocate --model qwen2.5-7b --ranks 2 --tp 1 --workload realistic --micro-batch-size auto \
        --modes staged --staged-fractions 0.9 --overlap-staging off "${ckpt[@]}" \
        --sync-path "${SYNC_PATH:-default}" "${alone[@]}" --out "$out/run" > "$out/log" 2>&1
      echo "colocate exit $?"; df -h /tmp | tail -1; tail -30 "$out/log" ;;
    realistic)
      for path in before flattened; do
        colocate --model qwen2.5-3b --workload realistic --micro-batch-size auto --modes staged \
          --staged-fractions 0.9 --iterations 2 --sync-path $path --no-alone --out "$out/$path" \
          > "$out/$path.log" 2>&1
        tail -30 "$out/$path.log"
      done ;;
    overlap)
      # OVERLAP_WORKLOADS="realistic" skips the small points; OVERLAP_DEADLINE=0 lets the
      # realistic On point start however late (about 7 minutes a point at 3B on an H200:
      # start it with bench/gpu_bg.sh).
      if [[ ${OVERLAP_WORKLOADS:-small realistic} == *small* ]]; then
        colocate --model qwen2.5-3b --modes staged --staged-fractions 0.9 --iterations 3 \
          --overlap-staging off,on --no-alone --out "$out/small" > "$out/small.log" 2>&1
        tail -12 "$out/small.log"
      fi
      if [[ ${OVERLAP_WORKLOADS:-small realistic} == *realistic* ]]; then
        colocate --model qwen2.5-3b --workload realistic --micro-batch-size auto --modes staged \
          --staged-fractions 0.9 --iterations 2 --overlap-staging off,on --no-alone \
          --deadline-seconds "${OVERLAP_DEADLINE:-300}" --out "$out/realistic" \
          > "$out/realistic.log" 2>&1
        tail -30 "$out/realistic.log"
      fi ;;
    realistic-ckpt | realistic-on)
      # #33 and #30: the 3B realistic workload, one card, 2 iterations (a point outlasts a
      # call: start it with bench/gpu_bg.sh). realistic-ckpt: overlapStaging Off with the
      # asynchronous checkpoint every 2 iterations (one save, at iteration 2, from buffers
      # iteration 1's offload pinned: the steady save; a second 38 GB checkpoint would not fit
      # a 64 GiB disk beside the first); realistic-on: overlapStaging On, no checkpoint.
      df -h /tmp | tail -1
      # CKPT_EVERY=1 ITERS=3: a save every iteration in one run (two 38 GB checkpoints on the
      # disk at once at 3B, keep 1: a two-card machine's 128 GiB disk; ALONE=0 skips the
      # engine alone).
      extra=(--overlap-staging on)
      [[ $step == realistic-ckpt ]] && extra=(--overlap-staging off --checkpoint-every
        "${CKPT_EVERY:-2}" --checkpoint-dir /tmp/rljob-bench-checkpoints)
      # realistic-ckpt also runs the engine alone after the point (the rollout's floor).
      [[ $step == realistic-on || ${ALONE:-1} == 0 ]] && extra+=(--no-alone)
      colocate --model qwen2.5-3b --workload realistic --micro-batch-size auto --modes staged \
        --staged-fractions 0.9 --iterations "${ITERS:-2}" "${extra[@]}" --out "$out/run" \
        > "$out/log" 2>&1
      echo "colocate exit $?"; df -h /tmp | tail -1; tail -30 "$out/log" ;;
    train-alone)
      # 64 rows packed, and a profile of 24 (a minute); then the whole rollout packed and not
      # (the second is not started after 240 s).
      python3 bench/train_alone.py --model qwen2.5-3b --workload realistic --prompts 8 \
        --micro-batch-size "${TRAIN_MICRO:-2}" --pack on --profile-rows 24 \
        --out "$out/train-alone-3b-64.json" > "$out/log-64" 2>&1
      echo "train_alone (64 rows) exit $?"; cut -c1-700 "$out/log-64" | grep "^{"
      python3 bench/train_alone.py --model qwen2.5-3b --workload realistic \
        --micro-batch-size "${TRAIN_MICRO:-2}" --pack on,off --deadline-seconds 240 \
        --out "$out/train-alone-3b.json" > "$out/log" 2>&1
      echo "train_alone exit $?"; grep -v "^{" "$out/log" | tail -4; cut -c1-700 "$out/log" | grep "^{" ;;
    train-alone-7b)
      # The 7B realistic point's train stage alone, FSDP over both cards (two H200s), at the
      # micro-batch its memory plan chose there (4), packed: #33's 1.15x at 7B.
      python3 bench/train_alone.py --model qwen2.5-7b --ranks 2 --workload realistic \
        --micro-batch-size "${TRAIN_MICRO:-4}" --pack on --out "$out/train-alone-7b.json" > "$out/log" 2>&1
      echo "train_alone exit $?"; grep -v "^{" "$out/log" | tail -4; cut -c1-700 "$out/log" | grep "^{" ;;
    writer-stalls)
      # CPU only: the checkpoint writer's stalls of a round-trip loop, thread against process
      # (bench/writer_stalls.py), on a host with cores to spare.
      python3 bench/writer_stalls.py --gigabytes 4 --repeats 2 --out "$out/writer-stalls.json" \
        > "$out/log" 2>&1
      echo "writer_stalls exit $?"; grep "^{" "$out/log" | cut -c1-220 ;;
    staging-probe)
      python3 bench/staging_probe.py > "$out/probe.txt" 2>&1
      echo "staging_probe exit $?"; cat "$out/probe.txt" ;;
    alloc-probe)
      python3 bench/alloc_probe.py --out "$out" > "$out/probe.txt" 2>&1
      echo "alloc_probe exit $?"; cat "$out/probe.txt" ;;
    tp2 | tp2-next)
      read -r wake fraction < <(auto auto-sglang-3b-tp2-two-gpu)
      [[ $step == tp2-next ]] && fraction=$(python3 -c "print(f'{$fraction + 0.01:.2f}')")
      echo "Auto on this card: $wake; running $fraction" | tee "$out/auto.txt"
      python3 -m rljob.cli plan bench/plans/auto-sglang-3b-tp2-two-gpu.yaml > "$out/plan.txt" 2>&1
      colocate --model qwen2.5-3b --ranks 2 --tp 2 --modes "$wake" "--$wake-fractions" "$fraction" \
        --iterations 3 --no-alone --out "$out/run" > "$out/log" 2>&1
      tail -30 "$out/log" ;;
    two-gpu | two-gpu-1 | two-gpu-2)
      case $step in two-gpu) select="" ;; two-gpu-1) select="tp2" ;; *) select="not tp2" ;; esac
      [[ -n ${PYTEST_K:-} ]] && select="${select:+$select and }($PYTEST_K)"
      python3 -m pytest -v -s tests/gpu/test_two_gpu_sglang.py -k "$select" > "$out/pytest.log" 2>&1
      echo "pytest exit $?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/pytest.log" | tail -12 ;;
    auto-7b)
      read -r wake fraction < <(auto auto-sglang-7b-two-gpu-h200)
      echo "Auto on this card: $wake $fraction" | tee "$out/auto.txt"
      colocate --model qwen2.5-7b --ranks 2 --tp 1 --modes "$wake" \
        "--$wake-fractions" "$fraction,$fraction,$fraction" --keep-going --iterations 3 --no-alone \
        --deadline-seconds 400 --out "$out/run" > "$out/log" 2>&1
      tail -30 "$out/log" ;;
    sweep-7b)
      colocate --model qwen2.5-7b --ranks 2 --tp 1 --modes staged --staged-fractions 0.96,0.97,0.98 \
        --keep-going --iterations 3 --no-alone --deadline-seconds 420 --out "$out/run" > "$out/log" 2>&1
      tail -30 "$out/log" ;;
    ckpt-writer)
      model qwen2.5-1.5b && python3 bench/checkpoint_gpu.py --model-dir /tmp/rljob-bench-models/qwen2.5-1.5b \
        --repeats 1 --modes pinned-before,pinned --busy python --out "$out/ckpt-writer-1.5b.json" \
        > "$out/ckpt-writer-1.5b.log" 2>&1
      echo "checkpoint_gpu exit $?"; tail -4 "$out/ckpt-writer-1.5b.log" ;;
    par1)
      (CUDA_VISIBLE_DEVICES=0 bash bench/gpu_steps.sh ckpt-resume > "$out/card0.log" 2>&1) &
      (CUDA_VISIBLE_DEVICES=1 bash bench/gpu_steps.sh mt-test mt-bench > "$out/card1.log" 2>&1) &
      wait
      tail -20 "$out/card0.log" "$out/card1.log" ;;
    *)
      echo "unknown step $step (see the head of bench/gpu_steps.sh)" >&2
      exit 2 ;;
  esac
  pkill -P "$packer" 2> /dev/null  # its sleep
  kill "$packer" 2> /dev/null
  wait "$packer" 2> /dev/null
  echo "== step $step: $((SECONDS - start)) s"
  pack "$step"
done
