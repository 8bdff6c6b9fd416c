#!/usr/bin/env bash
# Shakespeare-char to step 2000 in fp32, bf16, fp16 (loss scaling) and fp8
# (simulated on CPU): final val loss against fp32 (targets: within 0.03 for bf16/fp16, 0.08
# for fp8), median tokens/s, and the memory plan's per-rank total for each precision.
# Needs target/release/kiln. Runs go to ${OUT:-/tmp/kiln-precision}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-precision}
K=target/release/kiln
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
STEPS=${STEPS:-2000}
mkdir -p "$OUT"
for p in fp32 bf16 fp16 fp8; do
    rm -rf "$OUT/$p"
    "$K" train --preset shakespeare-char --data "$DATA" --out "$OUT/$p" --quiet --max-steps "$STEPS" --precision $p \
        --set sample.tokens=0 --set checkpoint.interval=0 --set eval.interval=500 > "$OUT/$p.log" 2>&1 || { cat "$OUT/$p.log"; exit 1; }
    "$K" memory --preset shakespeare-char --data "$DATA" --precision $p --json > "$OUT/$p.memory.json"
done
python3 - "$OUT" <<'PY'
import json, sys, statistics as st
out = sys.argv[1]
def run(p):
    ls = [json.loads(l) for l in open(f"{out}/{p}/metrics.jsonl")]
    val = [x["val_loss"] for x in ls if x["kind"] == "eval"][-1]
    tps = st.median(x["tokens_per_sec"] for x in ls if x["kind"] == "train")
    faults = [x for x in ls if x["kind"] == "fault"]
    return val, tps, faults
base, base_tps, _ = run("fp32")
for p, tol in (("fp32", 0), ("bf16", 0.03), ("fp16", 0.03), ("fp8", 0.08)):
    val, tps, faults = run(p)
    mem = json.load(open(f"{out}/{p}.memory.json"))
    total = mem["process_total_bytes"]
    ok = "" if p == "fp32" else ("ok" if abs(val - base) <= tol else "MISSED")
    print(f"{p:>5}: val loss {val:.4f} (Δ {val - base:+.4f}, target ±{tol}) {ok}; {tps:,.0f} tokens/s ({tps / base_tps:.2f}× fp32); "
          f"plan {total / 2**20:.1f} MiB per rank; {len(faults)} loss-scale backoffs")
PY
