#!/usr/bin/env bash
# Compact AdamW state against fp32 AdamW on shakespeare-char (2000 steps, the preset's learning rate): fp32
# AdamW in fp32, and bf16 compute with bf16 state (bf16 weights as their own master copy) and with 8-bit state.
# Prints each run's final validation loss, its difference from fp32 AdamW's, and its median tokens/s.
#
# usage: scripts/check_optimizer_state.sh [OUT_DIR]   (about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/check-optimizer-state}
data=${DATA:-../shared/data/tinyshakespeare.txt}
kiln=target/release/kiln
cargo build --release --quiet
rm -rf "$out"
mkdir -p "$out"
run() { # NAME ARGS...
    local name=$1; shift
    "$kiln" train --preset shakespeare-char --data "$data" --out "$out/$name" --set eval.interval=250 \
        --set sample.tokens=0 --set checkpoint.interval=0 --quiet "$@" > /dev/null
}
run fp32
run bf16-state-bf16 --precision bf16 --set optim.state=bf16
run bf16-state-int8 --precision bf16 --set optim.state=int8
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def facts(name):
    ev = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    val = [e["val_loss"] for e in ev if e.get("kind") == "eval"][-1]
    tps = statistics.median(e["tokens_per_sec"] for e in ev if e.get("kind") == "train")
    return val, tps
base = facts("fp32")
for name in ["fp32", "bf16-state-bf16", "bf16-state-int8"]:
    val, tps = facts(name)
    print(json.dumps({"run": name, "final_val_loss": round(val, 4), "minus_fp32": round(val - base[0], 4), "median_tokens_per_s": round(tps), "speed_over_fp32": round(tps / base[1], 3)}))
PY
