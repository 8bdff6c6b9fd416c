#!/usr/bin/env bash
# 0/1 Adam: shakespeare-char on dp 4, 2000 steps, uncompressed against 1-bit Adam
# and 0/1 Adam (and none_noclip: uncompressed without gradient clipping, which the compressed
# stages do not apply): bytes sent per rank per step (`comm_bytes_sent`: median over the run, and the
# mean, which counts the warm-up and 0/1 Adam's full-precision variance steps), final val loss.
# 0/1 Adam: warm-up 100, variance frozen after step 400 (κ 16), local steps syncing at
# intervals that double every 100 local steps up to 16.
# Usage: scripts/check_zero_one.sh [names...]   (KILN=path/to/kiln, OUT=dir; a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-zero-one}
STEPS=${STEPS:-2000}
mkdir -p "$OUT"
names=("$@")
[ ${#names[@]} -eq 0 ] && names=(none zero_one onebit)
for name in "${names[@]}"; do
    case $name in
        none) extra=() ;;
        # The compressed stages do not clip gradients; the same baseline without clipping.
        none_noclip) extra=(--set train.grad_clip=0) ;;
        onebit) extra=(--set parallel.compression=onebit_adam --set parallel.compression_warmup=400) ;;
        zero_one) extra=(--set parallel.compression=zero_one_adam --set parallel.compression_warmup=100 --set parallel.zeroone.var_freeze_step=400
                         --set parallel.zeroone.local_step_scaler=100 --set parallel.zeroone.local_step_clipper=16) ;;
    esac
    rm -rf "${OUT:?}/$name"
    "$KILN" train --preset shakespeare-char --data ../shared/data/tinyshakespeare.txt --dp 4 --max-steps "$STEPS" \
        --set sample.tokens=0 --set checkpoint.interval=0 "${extra[@]}" --out "$OUT/$name" --quiet > "$OUT/$name.log" 2>&1
done
python3 - "$OUT" "${names[@]}" <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
base = None
for name in ["none", "none_noclip", "onebit", "zero_one"]:
    if not os.path.exists(f"{out}/{name}/metrics.jsonl"):
        continue
    lines = [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl")]
    tr = [l for l in lines if l.get("kind") == "train"]
    ev = [l for l in lines if l.get("kind") == "eval"]
    med = statistics.median(l["comm_bytes_sent"] for l in tr)
    mean = statistics.mean(l["comm_bytes_sent"] for l in tr)
    tail = statistics.mean(l["comm_bytes_sent"] for l in tr[len(tr) // 2:])
    base = base or (mean, ev[-1]["val_loss"])
    print(f"{name:8} bytes/step median {med:11,.0f} mean {mean:11,.0f} ({base[0] / mean:5.2f}x fewer) second half {tail:11,.0f} ({base[0] / tail:6.2f}x)  val loss {ev[-1]['val_loss']:.4f} ({ev[-1]['val_loss'] - base[1]:+.4f})")
PY
