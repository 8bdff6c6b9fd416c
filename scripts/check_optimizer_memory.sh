#!/usr/bin/env bash
# Optimizer state's memory and speed: GPT-2 124M, B4 T256, 4 steps, fp32 AdamW against bf16
# compute with fp32, bf16 (stochastic rounding, bf16 weights as the master copy) and 8-bit
# AdamW state. Prints, per run, the peak resident set during training (the last step's
# mem_rss_peak_bytes) and over the whole process (/usr/bin/time -v, the final checkpoint's
# fp32 snapshot included), each over the fp32 run's, the optimizer state's bytes and the last
# step's tokens/s.
#
# usage: scripts/check_optimizer_memory.sh   (about 5 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
K=target/release/kiln
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
OUT=${OUT:-/tmp/kiln-optimizer-memory}
cargo build --release --quiet
mkdir -p "$OUT"
COMMON=(--preset gpt2-124m --seq-len 256 --set train.batch_size=4 --max-steps 4 --set train.log_interval=1
        --set sample.tokens=0 --set eval.interval=1000 --set checkpoint.interval=0)
run() {
    local name=$1; shift
    rm -rf "$OUT/run-$name"
    /usr/bin/time -v $K train --data "$DATA" --out "$OUT/run-$name" "$@" "${COMMON[@]}" --quiet 2> "$OUT/time-$name.txt" > /dev/null
}
run fp32
run bf16 --precision bf16
run bf16-state-bf16 --precision bf16 --set optim.state=bf16
run bf16-state-int8 --precision bf16 --set optim.state=int8
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
def facts(name):
    rss = 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{out}/time-{name}.txt").read()).group(1))
    last = [l for l in map(json.loads, open(f"{out}/run-{name}/metrics.jsonl")) if l.get("kind") == "train"][-1]
    return rss, last["mem_rss_peak_bytes"], last["mem_optim_bytes"], last["tokens_per_sec"]
base = facts("fp32")
for name in ["fp32", "bf16", "bf16-state-bf16", "bf16-state-int8"]:
    rss, train_rss, optim, tps = facts(name)
    print(json.dumps({"run": name, "train_peak_rss_mib": round(train_rss / 2**20), "train_peak_over_fp32": round(train_rss / base[1], 3),
                      "process_peak_rss_mib": round(rss / 2**20), "process_peak_over_fp32": round(rss / base[0], 3),
                      "optimizer_state_mib": round(optim / 2**20), "tokens_per_s": round(tps, 1), "speed_over_fp32": round(tps / base[3], 3)}))
PY
