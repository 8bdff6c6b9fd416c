#!/usr/bin/env bash
# Issue 6's figures: pipeline / tensor / composed parallelism against one rank, the measured
# pipeline bubble, stage 0's activation memory per schedule, and bytes sent per step.
#   scripts/check_pp.sh equiv    shakespeare-char (8 layers, 8 heads, batch 16 = 8 micro-batches), 20 steps:
#                                pp 2/4 × gpipe/1f1b/interleaved (v 2), tp 2/4, dp2 × tp2 × pp2 vs one rank
#   scripts/check_pp.sh bubble   pp 4, m = 4/8/16, each schedule: idle/busy on the device clock vs (p−1)/(v·m)
#   scripts/check_pp.sh memory   pp 4: stage 0's peak activation bytes and micro-batches in flight, GPipe vs 1F1B
#   scripts/check_pp.sh volume   bytes sent per step per rank, pp and tp, vs Megatron's formulas
# Needs target/release/kiln (cargo build --release). Runs go to ${OUT:-/tmp/kiln-pp}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-pp}
K=target/release/kiln
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
STEPS=${STEPS:-20}
mkdir -p "$OUT"
run() { # name, args...
    local name=$1; shift
    rm -rf "$OUT/$name"
    "$K" train --out "$OUT/$name" --quiet --preset shakespeare-char --data "$DATA" --set sample.tokens=0 --set checkpoint.interval=0 \
        --set eval.interval=0 --set eval.iters=2 "$@" > "$OUT/$name.log" 2>&1 || { cat "$OUT/$name.log"; exit 1; }
}
# Equal-cost 8-layer model: batch 16 in 8 micro-batches of 2 sequences.
SHAPE=(--set model.n_layer=8 --set model.n_head=8 --set train.batch_size=16 --micro-batches 8 --max-steps "$STEPS")
case "${1:-equiv}" in
equiv)
    for drop in 0.1 0.0; do
        run "ref-d$drop" "${SHAPE[@]}" --set model.dropout=$drop
    done
    for p in 2 4; do
        for s in gpipe 1f1b; do run "pp$p-$s" "${SHAPE[@]}" --set model.dropout=0.1 --pp $p --schedule $s; done
        run "pp$p-interleaved" "${SHAPE[@]}" --set model.dropout=0.1 --pp $p --schedule interleaved --virtual 2
    done
    # Tensor parallel draws attention-dropout masks per shard: compare without dropout.
    for t in 2 4; do run "tp$t" "${SHAPE[@]}" --set model.dropout=0.0 --tp $t; done
    run "dp2-tp2-pp2" "${SHAPE[@]}" --set model.dropout=0.0 --dp 2 --tp 2 --pp 2
    # Data parallel too: each rank's dropout masks are drawn over its own rows.
    run "dp2-z1-pp2-interleaved" "${SHAPE[@]}" --set model.dropout=0.0 --dp 2 --zero 1 --pp 2 --schedule interleaved --virtual 2
    run "dp2-z3-pp2" "${SHAPE[@]}" --set model.dropout=0.0 --dp 2 --zero 3 --pp 2
    python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def lines(r): return [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl")]
def losses(r): return [l["loss"] for l in lines(r) if l["kind"] == "train"]
def val(r): return [l["val_loss"] for l in lines(r) if l["kind"] == "eval"][-1]
worst = 0
for r, ref in [("pp2-gpipe", "ref-d0.1"), ("pp2-1f1b", "ref-d0.1"), ("pp2-interleaved", "ref-d0.1"),
               ("pp4-gpipe", "ref-d0.1"), ("pp4-1f1b", "ref-d0.1"), ("pp4-interleaved", "ref-d0.1"),
               ("tp2", "ref-d0.0"), ("tp4", "ref-d0.0"), ("dp2-tp2-pp2", "ref-d0.0"),
               ("dp2-z1-pp2-interleaved", "ref-d0.0"), ("dp2-z3-pp2", "ref-d0.0")]:
    a, b = losses(r), losses(ref)
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    worst = max(worst, rel)
    print(f"{r:>24}: {len(a)} steps, max rel loss diff vs one rank {rel:.2e}; final val loss {val(r):.6f} vs {val(ref):.6f}")
print(f"worst {worst:.2e} (target 1e-5)")
sys.exit(0 if worst <= 1e-5 else 1)
PY
    ;;
bubble|memory)
    for m in 4 8 16; do
        for s in gpipe 1f1b interleaved; do
            v=1; [ $s = interleaved ] && v=2
            run "b-$s-m$m" --set model.n_layer=8 --set model.n_head=8 --set model.n_embd=256 --set train.batch_size=$((4 * m)) --micro-batches $m \
                --max-steps 8 --pp 4 --schedule $s --virtual $v --pp-trace device --set eval.iters=1
        done
    done
    python3 - "$OUT" <<'PY'
import json, sys, statistics as st
out = sys.argv[1]; p = 4
print(f"{'schedule':>12} {'m':>3} {'bubble':>7} {'ranks':>13} {'formula':>8} {'diff':>7} | stage 0 peak activations")
worst = 0
for s in ("gpipe", "1f1b", "interleaved"):
    v = 2 if s == "interleaved" else 1
    for m in (4, 8, 16):
        # Per rank: the median over steps 2.. of idle/busy on the device clock (step 1 warms up).
        per = []
        for r in range(p):
            steps = [json.loads(l) for l in open(f"{out}/b-{s}-m{m}/pipeline/rank-{r:03}.jsonl")][1:]
            per.append(st.median(x["bubble"] for x in steps))
            if r == 0: s0 = steps[-1]
        bub = st.mean(per)
        f = (p - 1) / (v * m)
        worst = max(worst, abs(bub - f))
        print(f"{s:>12} {m:>3} {bub:>7.3f} {min(per):>6.3f}-{max(per):.3f} {f:>8.3f} {bub - f:>+7.3f} | {s0['peak_in_flight']:>2} micro-batch activation sets, {s0['peak_activation_bytes']/1e6:.2f} MB")
print(f"largest |measured - formula| {worst:.3f} (target 0.05)")
PY
    ;;
*) echo "usage: $0 equiv|bubble|memory|volume" >&2; exit 2 ;;
esac
