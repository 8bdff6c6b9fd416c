#!/usr/bin/env bash
# The memory plan against the measured peak resident set for fine-tunes of a Hugging Face base:
# a GPT-2 124M exported in bf16, LoRA rank 8, QLoRA NF4 and full, B4 T128, 5 steps each.
# Prints, per fine-tune, `kiln memory`'s total, the peak RSS (/usr/bin/time -v), their ratio,
# and the allocator's count of loading the base beside the plan's load phase.
set -euo pipefail
cd "$(dirname "$0")/.."
K=target/release/kiln
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
OUT=${OUT:-/tmp/kiln-finetune-memory}
mkdir -p "$OUT"
if [ ! -d "$OUT/hf124" ]; then
    $K train --preset gpt2-124m --data "$DATA" --out "$OUT/g124" --max-steps 1 --set train.batch_size=1 \
        --set model.block_size=256 --set sample.tokens=0 --set eval.iters=1 --quiet
    $K export --run "$OUT/g124" --format hf --dtype bf16 --out "$OUT/hf124"
fi
COMMON=(--seq-len 128 --set train.batch_size=4 --max-steps 5 --set sample.tokens=0 --set eval.interval=1000 --set checkpoint.interval=0)
run() {
    local name=$1; shift
    rm -rf "$OUT/run-$name"
    $K memory --init-from "$OUT/hf124" --data "$DATA" "$@" "${COMMON[@]}" --json > "$OUT/plan-$name.json"
    /usr/bin/time -v $K train --init-from "$OUT/hf124" --data "$DATA" --out "$OUT/run-$name" "$@" "${COMMON[@]}" --quiet \
        2> "$OUT/time-$name.txt" > /dev/null
    python3 - "$name" "$OUT" <<'PY'
import json, re, sys
name, out = sys.argv[1:]
plan = json.load(open(f"{out}/plan-{name}.json"))
rss = 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", open(f"{out}/time-{name}.txt").read()).group(1))
mem = next(l for l in map(json.loads, open(f"{out}/run-{name}/metrics.jsonl")) if l["kind"] == "memory")
mib = lambda b: round(b / 2**20, 1)
print(json.dumps({"fine_tune": name, "plan_mib": mib(plan["total_bytes"]), "peak_rss_mib": mib(rss),
                  "plan_over_measured": round(plan["total_bytes"] / rss, 3), "plan_load_mib": mib(plan["load_peak_bytes"]),
                  "tracked_load_mib": mib(mem.get("base_load_tracked_peak_bytes", 0))}))
PY
}
run lora --lora-rank 8
run qlora --lora-rank 8 --quantize-base nf4
run full
