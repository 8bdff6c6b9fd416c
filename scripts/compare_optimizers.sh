#!/usr/bin/env bash
# Optimizers on shakespeare-char (2000 steps).
# 1. Muon against AdamW, each at its best learning rate of a small sweep: AdamW's train.lr, then
#    Muon's optim.muon_lr with the other parameters' AdamW at the best train.lr. Prints each run's
#    final validation loss, the step at which the best Muon run first reaches the best AdamW
#    run's final validation loss, and plots both curves in one image.
# 2. Compact AdamW state against fp32 AdamW at the preset's learning rate: bf16 compute with bf16
#    state (bf16 weights as their own master copy) and with 8-bit state. Prints each run's final
#    validation loss, its difference from fp32 AdamW's, and its median tokens/s.
#
# usage: scripts/compare_optimizers.sh [OUT_DIR]   (about 20 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/compare-optimizers}
data=${DATA:-../shared/data/tinyshakespeare.txt}
kiln=target/release/kiln
cargo build --release --quiet
rm -rf "$out"
mkdir -p "$out"
run() { # NAME ARGS...
    local name=$1; shift
    "$kiln" train --preset shakespeare-char --data "$data" --out "$out/$name" --set eval.interval=50 \
        --set sample.tokens=0 --set checkpoint.interval=0 --quiet "$@" > /dev/null
}
final() { python3 -c 'import json,sys; e=[json.loads(l) for l in open(sys.argv[1]+"/metrics.jsonl")]; print([x["val_loss"] for x in e if x.get("kind")=="eval"][-1])' "$1"; }
best=""; best_loss=99
for lr in 2e-3 4e-3 8e-3; do
    run "adamw-lr$lr" --set train.lr=$lr --set train.min_lr=$(python3 -c "print($lr/10)")
    l=$(final "$out/adamw-lr$lr"); echo "adamw train.lr=$lr: final val loss $l"
    if python3 -c "import sys; sys.exit(0 if $l < $best_loss else 1)"; then best=$lr; best_loss=$l; fi
done
mbest=""; mbest_loss=99
for mlr in 0.005 0.01 0.02 0.04; do
    run "muon-lr$mlr" --set optim.name=muon --set optim.muon_lr=$mlr --set train.lr=$best --set train.min_lr=$(python3 -c "print($best/10)")
    l=$(final "$out/muon-lr$mlr"); echo "muon optim.muon_lr=$mlr (AdamW part train.lr=$best): final val loss $l"
    if python3 -c "import sys; sys.exit(0 if $l < $mbest_loss else 1)"; then mbest=$mlr; mbest_loss=$l; fi
done
python3 - "$out/adamw-lr$best" "$out/muon-lr$mbest" <<'PY'
import json, sys
def evals(run):
    return [(e["step"], e["val_loss"]) for e in map(json.loads, open(run + "/metrics.jsonl")) if e.get("kind") == "eval"]
a, m = evals(sys.argv[1]), evals(sys.argv[2])
target = a[-1][1]
first = lambda ev: next((s for s, l in ev if l <= target), None)
print(json.dumps({"adamw": sys.argv[1], "muon": sys.argv[2], "adamw_final_val": target, "muon_final_val": m[-1][1],
                  "adamw_steps_to_target": first(a), "muon_steps_to_target": first(m)}))
PY
"$kiln" plot "$out/adamw-lr$best" "$out/muon-lr$mbest" --out "$out/adamw-vs-muon.png"
run state-fp32
run state-bf16 --precision bf16 --set optim.state=bf16
run state-int8 --precision bf16 --set optim.state=int8
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def facts(name):
    ev = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    val = [e["val_loss"] for e in ev if e.get("kind") == "eval"][-1]
    return val, statistics.median(e["tokens_per_sec"] for e in ev if e.get("kind") == "train")
base = facts("state-fp32")
for name in ["state-fp32", "state-bf16", "state-int8"]:
    val, tps = facts(name)
    print(json.dumps({"run": name, "final_val_loss": round(val, 4), "minus_fp32": round(val - base[0], 4), "median_tokens_per_s": round(tps), "speed_over_fp32": round(tps / base[1], 3)}))
PY
