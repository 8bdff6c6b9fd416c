#!/usr/bin/env bash
# Pipeline / tensor / composed parallelism against one rank, the measured
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
SHAPE=(--set model.n_layer=8 --set model.n_head=8 --set train.batch_size=16 --micro-batches 8)
case "${1:-equiv}" in
equiv)
    SHAPE+=(--max-steps "$STEPS")
    for drop in 0.1 0.0; do
        run "ref-d$drop" "${SHAPE[@]}" --set model.dropout=$drop
    done
    for p in 2 4; do
        for s in gpipe 1f1b; do run "pp$p-$s" "${SHAPE[@]}" --set model.dropout=0.1 --pp $p --schedule $s; done
        run "pp$p-interleaved" "${SHAPE[@]}" --set model.dropout=0.1 --pp $p --schedule interleaved --virtual 2
    done
    # Tensor parallel draws attention-dropout masks per shard: compare without dropout.
    for t in 2 4; do run "tp$t" "${SHAPE[@]}" --set model.dropout=0.0 --tp $t; done
    for t in 2 4; do run "sp$t" "${SHAPE[@]}" --set model.dropout=0.0 --tp $t --sequence-parallel; done
    run "dp2-tp2-pp2" "${SHAPE[@]}" --set model.dropout=0.0 --dp 2 --tp 2 --pp 2
    # Data parallel too: each rank's dropout masks are drawn over its own rows.
    run "dp2-z1-pp2-interleaved" "${SHAPE[@]}" --set model.dropout=0.0 --dp 2 --zero 1 --pp 2 --schedule interleaved --virtual 2
    run "dp2-z3-pp2" "${SHAPE[@]}" --set model.dropout=0.0 --dp 2 --zero 3 --pp 2
    # The same composed layout under MPI (a build with --features mpi into $MPI_TARGET).
    MPI_K=${MPI_TARGET:-/work/target-mpi}/release/kiln
    if [ -x "$MPI_K" ] && command -v mpirun >/dev/null; then
        rm -rf "$OUT/mpi-dp2-tp2-pp2"
        RAYON_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -n 8 "$MPI_K" train --out "$OUT/mpi-dp2-tp2-pp2" --quiet --preset shakespeare-char --data "$DATA" \
            --set sample.tokens=0 --set checkpoint.interval=0 --set eval.interval=0 --set eval.iters=2 "${SHAPE[@]}" --set model.dropout=0.0 \
            --backend mpi --dp 0 --tp 2 --pp 2 > "$OUT/mpi-dp2-tp2-pp2.log" 2>&1 || { cat "$OUT/mpi-dp2-tp2-pp2.log"; exit 1; }
    fi
    python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
def lines(r): return [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl")]
def losses(r): return [l["loss"] for l in lines(r) if l["kind"] == "train"]
def val(r): return [l["val_loss"] for l in lines(r) if l["kind"] == "eval"][-1]
worst = 0
for r, ref in [("pp2-gpipe", "ref-d0.1"), ("pp2-1f1b", "ref-d0.1"), ("pp2-interleaved", "ref-d0.1"),
               ("pp4-gpipe", "ref-d0.1"), ("pp4-1f1b", "ref-d0.1"), ("pp4-interleaved", "ref-d0.1"),
               ("tp2", "ref-d0.0"), ("tp4", "ref-d0.0"), ("sp2", "ref-d0.0"), ("sp4", "ref-d0.0"), ("dp2-tp2-pp2", "ref-d0.0"),
               ("dp2-z1-pp2-interleaved", "ref-d0.0"), ("dp2-z3-pp2", "ref-d0.0")]:
    a, b = losses(r), losses(ref)
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    worst = max(worst, rel)
    print(f"{r:>24}: {len(a)} steps, max rel loss diff vs one rank {rel:.2e}; final val loss {val(r):.6f} vs {val(ref):.6f}")
if os.path.exists(f"{out}/mpi-dp2-tp2-pp2/metrics.jsonl"):
    a, b = losses("mpi-dp2-tp2-pp2"), losses("ref-d0.0")
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b)); worst = max(worst, rel)
    print(f"{'MPI dp2-tp2-pp2 (8 procs)':>24}: {len(a)} steps, max rel loss diff vs one rank {rel:.2e}; identical to in-process: {a == losses('dp2-tp2-pp2')}")
print(f"worst {worst:.2e} (target 1e-5)")
sys.exit(0 if worst <= 1e-5 else 1)
PY
    ;;
bubble|memory)
    for m in 4 8 16; do
        for s in gpipe 1f1b interleaved; do
            v=1; [ $s = interleaved ] && v=2
            run "b-$s-m$m" --set model.n_layer=16 --set model.n_head=8 --set model.n_embd=256 --set train.batch_size=$((4 * m)) --micro-batches $m \
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
volume)
    run v-tp2 "${SHAPE[@]}" --max-steps 6 --tp 2
    run v-tp4-sp "${SHAPE[@]}" --max-steps 6 --tp 4 --sequence-parallel
    run v-pp4 "${SHAPE[@]}" --max-steps 6 --pp 4
    run v-pp2-tp2-sp "${SHAPE[@]}" --max-steps 6 --pp 2 --tp 2 --sequence-parallel
    python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
L, h, s, m, b = 8, 128, 64, 8, 2   # layers, hidden, sequence, micro-batches, sequences per micro-batch
def line(r): return [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl") if '"train"' in l][3]
def op(x, k): return x.get(f"comm_bytes_sent_{k}", 0)
bsh = b * s * h * 4  # bytes of one [b, s, h] fp32 activation
rows = []
for r, t in (("v-tp2", 2), ("v-tp4-sp", 4)):
    x = line(r)
    # Megatron: 8·b·s·h·(t−1)/t per layer per micro-batch (4 all-reduces), plus the vocab-parallel
    # embedding and head (2 more); sequence parallel moves the same as reduce-scatter + all-gather.
    f = (8 * L + 4) * m * bsh * (t - 1) / t
    got = op(x, "all_reduce") + op(x, "reduce_scatter") + op(x, "all_gather") if "sp" in r else op(x, "all_reduce")
    if "sp" in r:
        got = 2 * op(x, "reduce_scatter")  # the all-gathers equal the reduce-scatters (checked below)
        print(f"  {r}: all-gather {op(x, 'all_gather')} B vs reduce-scatter {op(x, 'reduce_scatter')} B (+ the cross-entropy's row exchange)")
    rows.append((f"{r} (tensor, rank 0)", got, f))
for r, t in (("v-pp4", 1), ("v-pp2-tp2-sp", 2)):
    x = line(r)
    # Stage 0 sends one activation per micro-batch forward: b·s·h, or b·s·h/t with sequence
    # parallelism (Megatron's scatter/gather optimisation).
    rows.append((f"{r} (pipeline, stage 0)", op(x, "send_recv"), m * bsh / t))
worst = 0
for name, got, f in rows:
    worst = max(worst, abs(got / f - 1))
    print(f"{name:>36}: {got/1e6:9.4f} MB/step vs formula {f/1e6:9.4f} MB ({100*(got/f-1):+.2f} %)")
print(f"largest deviation {100*worst:.2f} % (target 5 %)")
PY
    ;;
*) echo "usage: $0 equiv|bubble|memory|volume" >&2; exit 2 ;;
esac
