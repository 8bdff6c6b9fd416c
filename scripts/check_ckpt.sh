#!/usr/bin/env bash
# The cost of background checkpointing of GPT-2 124M every 10 steps,
# against the same run without checkpoints (elapsed training time at step 40, which includes
# the snapshots of steps 10, 20 and 30 and the writer competing for the cores). Alternates the
# two configurations ${ROUNDS:-2} times and prints each run and the median overhead.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-ckpt}
K=target/release/kiln
mkdir -p "$OUT"
for r in $(seq 1 "${ROUNDS:-2}"); do
    for mode in ${MODES:-none bg sync}; do
        case $mode in
            none) ck=(--set checkpoint.interval=0) ;;
            bg) ck=(--set checkpoint.interval=10 --set checkpoint.background=true) ;;
            sync) ck=(--set checkpoint.interval=10 --set checkpoint.background=false) ;;
        esac
        rm -rf "$OUT/$mode-$r"
        "$K" train --preset gpt2-124m --out "$OUT/$mode-$r" --quiet --max-steps 40 --set model.block_size=256 \
            --set train.batch_size=4 --set train.grad_accum=1 --set eval.interval=0 --set eval.iters=1 \
            --set sample.tokens=0 --set checkpoint.keep=2 "${ck[@]}" > "$OUT/$mode-$r.log" 2>&1
    done
done
python3 - "$OUT" "${ROUNDS:-2}" "${MODES:-none bg sync}" <<'PY'
import json, sys, statistics as st
out, rounds = sys.argv[1], int(sys.argv[2])
def el(r):
    ls = [json.loads(l) for l in open(f"{out}/{r}/metrics.jsonl")]
    return [x for x in ls if x["kind"] == "train"][-1]["elapsed_s"], [x for x in ls if x["kind"] == "checkpoint"]
for mode in [m for m in ("bg", "sync") if m in sys.argv[3].split()]:
    over = []
    for r in range(1, rounds + 1):
        a, _ = el(f"none-{r}"); b, ck = el(f"{mode}-{r}")
        over.append(b / a - 1)
        snaps = [c["snapshot_s"] for c in ck if "snapshot_s" in c][:3]; writes = [c["write_s"] for c in ck if "write_s" in c][:3]
        print(f"round {r} {mode}: 40 steps {b:.1f} s vs {a:.1f} s without checkpoints ({100*(b/a-1):+.1f} %); snapshot {st.median(snaps):.2f} s, write {st.median(writes):.2f} s (medians)")
    print(f"{mode}: median overhead {100*st.median(over):+.1f} % of training time")
PY
