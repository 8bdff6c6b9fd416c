#!/usr/bin/env bash
# ZeRO++: shakespeare-char on dp 4 as two nodes of two, 2000 steps, ZeRO-3 against
# ZeRO++ (qwZ + qgZ, and with hpZ): bytes sent per rank per step (`comm_bytes_sent`, median
# over the run's training steps), final val loss; then the planner's prediction for GPT-2 1.5B
# on 64 nodes of eight A100s with one 100 Gb/s Ethernet NIC each.
# Usage: scripts/check_zeropp.sh [train|plan]   (KILN=path/to/kiln, OUT=dir; a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-zeropp}
STEPS=${STEPS:-2000}
mkdir -p "$OUT"
what=${1:-train,plan}
Z=(--set parallel.zeropp.qwz=true --set parallel.zeropp.qgz=true --set parallel.zeropp.node_size=2)
if [[ $what == *train* ]]; then
    for name in zero3 zeropp hpz; do
        extra=()
        [ "$name" != zero3 ] && extra=("${Z[@]}")
        [ "$name" = hpz ] && extra+=(--set parallel.zeropp.hpz=true)
        rm -rf "${OUT:?}/$name"
        "$KILN" train --preset shakespeare-char --data ../shared/data/tinyshakespeare.txt --dp 4 --zero 3 --max-steps "$STEPS" \
            --set sample.tokens=0 --set checkpoint.interval=0 "${extra[@]}" --out "$OUT/$name" --quiet > "$OUT/$name.log" 2>&1
    done
    python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
base = None
for name in ["zero3", "zeropp", "hpz"]:
    lines = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    tr = [l for l in lines if l.get("kind") == "train"]
    ev = [l for l in lines if l.get("kind") == "eval"]
    b = statistics.median(l["comm_bytes_sent"] for l in tr)
    ops = {k[len("comm_bytes_sent_"):]: v for k, v in tr[len(tr) // 2].items() if k.startswith("comm_bytes_sent_")}
    tps = statistics.median(l["tokens_per_sec"] for l in tr[10:])
    base = base or (b, ev[-1]["val_loss"], tps)
    print(f"{name:7} bytes/step {b:12,.0f} ({base[0] / b:5.2f}x fewer than ZeRO-3)  val loss {ev[-1]['val_loss']:.4f} ({ev[-1]['val_loss'] - base[1]:+.4f})  tokens/s {tps:7.0f}  per op {ops}")
PY
fi
if [[ $what == *plan* ]]; then
    for zpp in false true; do
        "$KILN" plan estimate --model gpt2-1558m --gpu a100-80gb --gpus 512 --gpus-per-node 8 --inter-link eth-100g --nics-per-node 1 \
            --global-batch 1024 --tp 1 --pp 1 --dp 512 --zero 3 --precision bf16 --zeropp $zpp | grep -E "step|TFLOP|DP traffic" | head -4
    done
fi
