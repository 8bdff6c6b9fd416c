#!/usr/bin/env bash
# Muon against AdamW on shakespeare-char (2000 steps), each at its best learning rate of a small
# sweep: AdamW's train.lr, then Muon's optim.muon_lr with the other parameters' AdamW at the
# best train.lr. Prints each run's final validation loss, the step at which the best Muon run
# first reaches the best AdamW run's final validation loss, and plots both curves in one image.
#
# usage: scripts/compare_optimizers.sh [OUT_DIR]   (about 10 minutes on 2 cores)
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
