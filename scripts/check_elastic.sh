#!/usr/bin/env bash
# Elastic training and stragglers. Needs a release build with MPI
# (cargo build --release --features mpi) and mpirun.
#   shrink+grow   dp 4 in process; rank 1 lost for good at step 100 of 300 (in-memory snapshots
#                 every 10 steps), back from step 200 (rejoins at the disk checkpoint of 210);
#                 compared with plain resumes at dp 3 from step 90 and at dp 4 from step 210.
#   mpi           the same under `kiln train --supervise --backend mpi` with 4 processes.
#   stragglers    dp 4, 300 steps: rank 2 slowed 1.5x, and no rank slowed.
# Every run uses 1 thread per rank (RAYON_NUM_THREADS=1) so the comparisons are bit for bit.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-elastic}
K=target/release/kiln
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
what=${1:-all}
export RAYON_NUM_THREADS=1
mkdir -p "$OUT"
m=(--data "$DATA" --tokenizer byte --quiet --set model.n_layer=2 --set model.n_head=4 --set model.n_embd=64
   --set model.block_size=64 --set train.batch_size=12 --set train.lr_decay_steps=300 --set eval.interval=50
   --set eval.iters=4 --set sample.tokens=0 --set checkpoint.interval=30 --set faults.straggler_ratio=0)
lose=(--dp 4 --elastic 3:4 --max-steps 300 --set 'faults.fail_ranks=[1]' --set faults.fail_step=100
      --set faults.fail_permanent=true --set faults.rejoin_step=200)
compare() {
python3 - "$@" <<'PY'
import json, sys
def L(p): return {j["step"]: j["loss"] for j in map(json.loads, open(p + "/metrics.jsonl")) if j.get("kind") == "train"}
a, b = L(sys.argv[1]), L(sys.argv[2])
steps = [s for s in a if s in b]
same = [s for s in steps if a[s] == b[s]]
print(f"  {sys.argv[1]} vs {sys.argv[2]}: {len(same)} of {len(steps)} steps' losses bit-identical (steps {min(steps)}..{max(steps)}), {len(a)} steps in all")
for j in map(json.loads, open(sys.argv[1] + "/metrics.jsonl")):
    if j.get("kind") == "fault" and len(sys.argv) > 3:
        print("  ", {k: j[k] for k in j if k in ("step", "event", "rank", "ranks", "from", "to", "grad_accum_to", "restored_step", "lost_steps", "from_state")})
PY
}
if [[ $what == all || $what == shrink ]]; then
  rm -rf "$OUT"/{el,re}
  "$K" train "${m[@]}" "${lose[@]}" --out "$OUT/el" --set checkpoint.memory_interval=10 2> "$OUT/el.log"
  "$K" train "${m[@]}" --out "$OUT/re" --dp 4 --max-steps 90 2> /dev/null
  "$K" train "${m[@]}" --out "$OUT/re" --resume --dp 3 --micro-batches 2 --max-steps 210 2> /dev/null
  "$K" train "${m[@]}" --out "$OUT/re" --resume --dp 4 --micro-batches 1 --max-steps 300 2> /dev/null
  echo "in process: elastic run vs resumed runs (dp 4 to 90, dp 3 to 210, dp 4 to 300)"
  compare "$OUT/el" "$OUT/re" events
fi
if [[ $what == all || $what == mpi ]]; then
  rm -rf "$OUT/mpi"
  "$K" train --supervise --launcher "mpirun --allow-run-as-root --oversubscribe" --backend mpi "${m[@]}" "${lose[@]}" \
      --out "$OUT/mpi" --set faults.rejoin_timeout_s=10 2> "$OUT/mpi.log"
  echo "MPI (4 processes, supervisor): vs the in-process elastic run"
  compare "$OUT/mpi" "$OUT/el" events
fi
if [[ $what == all || $what == stragglers ]]; then
  for r in slow idle; do
    rm -rf "$OUT/$r"
    extra=(); [[ $r == slow ]] && extra=(--set 'faults.slow_ranks=[2]' --set faults.slow_factor=1.5)
    "$K" train "${m[@]}" --out "$OUT/$r" --dp 4 --max-steps 300 --set faults.straggler_ratio=1.3 "${extra[@]}" 2> /dev/null
    python3 - "$OUT/$r" <<'PY'
import json, sys, statistics
ls = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
f = [j for j in ls if j.get("event") == "straggler"]
t = [j for j in ls if j.get("kind") == "train"]
med = [statistics.median(j["rank_compute_s"][k] for j in t) * 1e3 for k in range(4)]
print(f"{sys.argv[1]}: {len(f)} straggler report(s) {[(j['step'], j['rank'], round(j['ratio'], 2)) for j in f]}; median compute per rank (ms) {[round(x, 2) for x in med]}")
PY
  done
fi
