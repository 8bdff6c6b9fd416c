#!/usr/bin/env bash
# In-memory checkpoints (Gemini) on GPT-2 124M at dp 2 (in-process ranks). Three runs
# of 30 steps: uninterrupted; rank 1 failing at step 18 with snapshots in memory every 5 steps
# (restored from memory, step 15); both ranks failing at step 18 (neither copy survives:
# restored from the disk checkpoint of step 10). Prints each restore's source, time and lost
# steps, and whether the final parameters and optimizer state equal the uninterrupted run's.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-gemini}
K=target/release/kiln
rm -rf "$OUT"; mkdir -p "$OUT"
common=(--preset gpt2-124m --quiet --max-steps 30 --dp 2 --set model.block_size=256 --set train.batch_size=4
        --set train.grad_accum=1 --set eval.interval=0 --set eval.iters=1 --set sample.tokens=0 --set checkpoint.keep=2)
"$K" train "${common[@]}" --out "$OUT/whole" --set checkpoint.interval=0 > "$OUT/whole.log" 2>&1
"$K" train "${common[@]}" --out "$OUT/memory" --set checkpoint.interval=10 --set checkpoint.memory_interval=5 \
    --set 'faults.fail_ranks=[1]' --set faults.fail_step=18 > "$OUT/memory.log" 2>&1
"$K" train "${common[@]}" --out "$OUT/disk" --set checkpoint.interval=10 --set checkpoint.memory_interval=5 \
    --set 'faults.fail_ranks=[0, 1]' --set faults.fail_step=18 > "$OUT/disk.log" 2>&1
for r in whole memory disk; do "$K" checkpoint inspect "$OUT/$r" > "$OUT/$r.json"; done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
digest = lambda r: (lambda j: (j["params_sha256"], j["optimizer_sha256"], j["step"]))(json.load(open(f"{out}/{r}.json")))
def el(r):
    ls = [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl")]
    return [x for x in ls if x["kind"] == "train"][-1]["elapsed_s"], [x for x in ls if x["kind"] == "fault"], [x for x in ls if x["kind"] == "checkpoint" and "snapshot_s" in x]
w, _, _ = el("whole")
for r in ("memory", "disk"):
    e, faults, cks = el(r)
    rest = [f for f in faults if f["event"] == "restored"][0]
    held = max((c.get("memory_held_bytes", 0) for c in cks), default=0)
    print(f"{r}: rank(s) failed at step {rest['step']}; restored from {rest['from']} at step {rest['restored_step']} in {rest['restore_s']:.2f} s, "
          f"{rest['lost_steps']} completed steps redone; final state {'identical' if digest(r) == digest('whole') else 'DIFFERENT'} to the uninterrupted run's; "
          f"rank 0 held {held / 1e9:.2f} GB of snapshots")
PY
