#!/usr/bin/env bash
# Issue 30 on one GPU: checkpoint, kill, resume, export, then load the export with SGLang.
#   bash bench/checkpoint_resume_gpu.sh OUT_DIR [MANIFEST]
# Needs sglang on PYTHONPATH (hack/sglang-gpu-install.sh) and the random model of
# bench/colocate.py in /tmp/rljob-bench-models (the first step builds it when missing).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}
manifest=${2:-bench/plans/checkpoint-sglang-1.5b-one-gpu.yaml}
mkdir -p "$out"
rm -rf /tmp/rljob-ckpt /tmp/rljob-ckpt-runs
# A 1.5B checkpoint is 19.5 GB and keep 2 holds three for a moment (the new one before the
# oldest is pruned): 58 GB of a 64 GiB machine's disk. Say what is free at each step; run this
# on a machine without the 3B and 7B bench models (a run after mt-sched's 3B failed its save).
df -h /tmp | tee "$out/df.txt"
python3 -c "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; import colocate; colocate.build_model('qwen2.5-1.5b', Path('/tmp/rljob-bench-models/qwen2.5-1.5b'))"
# 1. Run, and kill the whole process group once iteration 2's checkpoint is complete.
start=$SECONDS
setsid python3 -m rljob.cli run "$manifest" --device cuda --out /tmp/rljob-ckpt-runs/run1 > "$out/run1.log" 2>&1 &
leader=$!
while kill -0 "$leader" 2> /dev/null; do
  if [[ -f /tmp/rljob-ckpt/checkpoints/iteration-00000002/COMPLETE ]]; then
    sleep 1
    kill -9 -- "-$leader"
    echo "killed run 1 at $((SECONDS - start)) s, checkpoints: $(ls /tmp/rljob-ckpt/checkpoints | tr '\n' ' ')" | tee "$out/kill.txt"
    break
  fi
  sleep 0.5
done
wait "$leader" 2> /dev/null
for _ in $(seq 60); do  # the GPU is free once every process of run 1 is gone
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
  [[ $used -lt 2000 ]] && break
  sleep 1
done
ls -la /tmp/rljob-ckpt/checkpoints/* | head -40 >> "$out/kill.txt"
df -h /tmp | tail -1 | tee -a "$out/df.txt"
# 2. The same manifest again: it resumes.
python3 -m rljob.cli run "$manifest" --device cuda --out /tmp/rljob-ckpt-runs/run2 > "$out/run2.log" 2>&1
echo "run 2 exit $?" | tee -a "$out/kill.txt"
df -h /tmp | tail -1 | tee -a "$out/df.txt"
cp /tmp/rljob-ckpt-runs/run2/status.json "$out/run2-status.json"
python3 - "$out/run2-status.json" <<'PY' | tee -a "$out/kill.txt"
import json, sys
s = json.load(open(sys.argv[1]))
print("phase", s.get("phase"), "checkpoint", json.dumps(s.get("checkpoint")), "export", json.dumps(s.get("export")))
print("stages", json.dumps((s.get("memory") or {}).get("stages"))[:2000])
for a in s.get("attempts") or []:
    print("attempt", a.get("number"), a.get("result"), "resumedFrom", json.dumps(a.get("resumedFrom")))
for m in (s.get("metrics") or [])[:8]:  # one entry per iteration of this run
    print("iteration", m.get("iteration"), "reward", m.get("rewardMean"))
PY
# The metrics history beside the checkpoints: every iteration once, across the kill.
python3 - /tmp/rljob-ckpt/checkpoints/metrics.jsonl <<'PY' | tee -a "$out/kill.txt"
import json, sys
lines = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print("metrics.jsonl iterations", [m.get("iteration") for m in lines])
PY
cp /tmp/rljob-ckpt/checkpoints/metrics.jsonl "$out/metrics.jsonl" 2> /dev/null
# 3. SGLang loads the export as its model path; the weights bit for bit, greedy answers.
python3 bench/export_check.py /tmp/rljob-ckpt/export > "$out/export-check.json" 2> "$out/export-check.log"
echo "export check exit $?" | tee -a "$out/kill.txt"
cat "$out/export-check.json"
# Leave the disk as it was found (three 1.5B checkpoints are 58 GB): a later step on the same
# machine (mt-sched's 3B model, say) must not meet a full disk.
rm -rf /tmp/rljob-ckpt /tmp/rljob-ckpt-runs
df -h /tmp | tail -1 | tee -a "$out/df.txt"
