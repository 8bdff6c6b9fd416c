#!/usr/bin/env bash
# MoE figure: moe-tiny (8 experts, top-2, same active parameters per token as llama-tiny) vs its
# dense twin llama-tiny, same data, settings and steps; prints both val losses and the MoE
# run's final expert load balance (max/mean tokens per expert, worst layer) and dropped fraction.
# Usage: scripts/check_moe.sh [DATA] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/tinyshakespeare.txt}
steps=${2:-2000}
k=target/release/kiln
tmp=$(mktemp -d)
for p in llama-tiny moe-tiny; do
  $k train --preset $p --data "$data" --out "$tmp/$p" --max-steps "$steps" --quiet > /dev/null
done
python3 - "$tmp" <<'PY'
import json, sys
for p in ["llama-tiny", "moe-tiny"]:
    lines = [json.loads(l) for l in open(f"{sys.argv[1]}/{p}/metrics.jsonl")]
    ev = [l for l in lines if l["kind"] == "eval"][-1]
    tr = [l for l in lines if l["kind"] == "train"][-1]
    extra = ""
    if "moe_max_over_mean_load" in tr:
        extra = f", final max/mean expert load {tr['moe_max_over_mean_load']:.3f}, dropped {tr['moe_dropped_fraction']:.4f}, load {tr['moe_expert_load']}"
    print(f"{p}: val loss {ev['val_loss']:.4f} at step {ev['step']}{extra}")
PY
