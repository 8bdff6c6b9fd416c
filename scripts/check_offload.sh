#!/usr/bin/env bash
# AdamW-state offload (memory-mapped files) for GPT-2 124M, B4 T256:
# peak resident memory of the training loop and median step time, with and without.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-offload}
mkdir -p "$OUT"
for o in none optimizer none optimizer; do
    n=$((${n:-0} + 1))
    rm -rf "$OUT/$o-$n"
    target/release/kiln train --preset gpt2-124m --out "$OUT/$o-$n" --quiet --max-steps 12 --set model.block_size=256 \
        --set train.batch_size=4 --set train.grad_accum=1 --set eval.interval=0 --set eval.iters=1 --set sample.tokens=0 \
        --set checkpoint.interval=0 --offload $o > "$OUT/$o-$n.log" 2>&1
done
python3 - "$OUT" <<'PY'
import json, sys, glob, statistics as st
out = sys.argv[1]
for o in ("none", "optimizer"):
    for d in sorted(glob.glob(f"{out}/{o}-*/")):
        ls = [json.loads(l) for l in open(d + "metrics.jsonl") if '"train"' in l]
        t = st.median(4 * 256 / x["tokens_per_sec"] for x in ls[2:])
        print(f"{o:9s} {d}: peak RSS {ls[-1]['mem_rss_peak_bytes']/1e9:.3f} GB, optimizer state {(ls[-1]['mem_optim_bytes'] + ls[-1].get('mem_optim_offloaded_bytes', 0))/1e9:.3f} GB, median step {t:.3f} s, loss {ls[-1]['loss']:.6f}")
PY
