#!/usr/bin/env bash
# A LoRA fine-tune of a LLaMA-shaped model (SHAPE = layers ×
# width × heads × kv heads × MLP hidden, default 8 × 768 × 12 × 4 × 2048; GQA, SwiGLU, untied
# head; the base exported as a bf16 Hugging Face directory) with its frozen base
# in fp32, NF4 and int8 (`--quantize-base`). For each: peak RSS of the training loop
# (`mem_rss_peak_bytes`), the memory plan's per-process peak (`kiln memory --json`), and
# tokens/s (the median over steps 3.. of each run; the runs alternate, REPEAT times).
#
# Usage: scripts/check_qlora.sh   (KILN=path/to/kiln, OUT=dir, REPEAT=n, QUANTS="none nf4 int8", STEPS=12;
# a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-qlora}
REPEAT=${REPEAT:-3}
# The vocabulary: 256 gives the embeddings and head the share of a 7B LLaMA (under 1 %), 8192
# a fifth of the parameters (both stay fp32 under QLoRA, as in the paper).
VOCAB=${VOCAB:-256}
SHAPE=${SHAPE:-8x768x12x4x2048}
IFS=x read -r NL NE NH NKV FF <<< "$SHAPE"
mkdir -p "$OUT"
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
python3 scripts/corpus.py "$OUT/corpus.txt"
# The base: one step of a LLaMA shape, exported in bf16.
BASE="$OUT/base-$SHAPE-v$VOCAB"
if [ ! -f "$BASE/model.safetensors" ]; then
    "$KILN" train --preset llama-tiny --set model.n_layer="$NL" --set model.n_embd="$NE" --set model.n_head="$NH" --set model.n_kv_head="$NKV" \
        --set model.ffn_hidden="$FF" --set model.block_size=256 --set model.vocab_size="$VOCAB" --set model.tied_embeddings=false \
        --data "$OUT/corpus.txt" --set data.tokenizer=byte --max-steps 1 --set train.batch_size=1 --recompute full --set sample.tokens=0 --set eval.interval=0 \
        --set eval.iters=1 --out "$BASE-run" --quiet
    "$KILN" export --run "$BASE-run" --dtype bf16 --out "$BASE"
fi
COMMON=(--init-from "$BASE" --data "$OUT/corpus.txt" --tokenizer char --lora-rank 8 --seq-len 256 --set train.batch_size=4
        --recompute full --set sample.tokens=0 --set checkpoint.interval=0 --set eval.interval=0 --set eval.iters=1 --max-steps "${STEPS:-12}")
for i in $(seq "$REPEAT"); do
    for q in ${QUANTS:-none nf4 int8}; do
        extra=(); [ "$q" != none ] && extra=(--quantize-base "$q")
        [ "$i" = 1 ] && "$KILN" memory "${COMMON[@]}" "${extra[@]}" --json > "$OUT/$SHAPE-v$VOCAB-$q.plan.json"
        rm -rf "${OUT:?}/$SHAPE-v$VOCAB-$q-$i"
        "$KILN" train "${COMMON[@]}" "${extra[@]}" --out "$OUT/$SHAPE-v$VOCAB-$q-$i" --quiet > "$OUT/$SHAPE-v$VOCAB-$q-$i.log" 2>&1
    done
done
python3 - "$OUT/$SHAPE-v$VOCAB" "$REPEAT" <<'PY'
import json, statistics, sys
out, rep = sys.argv[1], int(sys.argv[2])
def train(name):
    return [json.loads(l) for l in open(f"{out}-{name}/metrics.jsonl") if '"train"' in l]
import os
rows = {}
quants = os.environ.get("QUANTS", "none nf4 int8").split()
for q in quants:
    runs = [train(f"{q}-{i}") for i in range(1, rep + 1)]
    rss = statistics.median(r[-1]["mem_rss_peak_bytes"] for r in runs)
    tps = statistics.median(statistics.median(s["tokens_per_sec"] for s in r[2:]) for r in runs)
    plan = json.load(open(f"{out}-{q}.plan.json"))["process_step_peak_bytes"]
    rows[q] = (rss, tps, plan)
    print(f"{q:5}  peak RSS {rss / 1e6:8.1f} MB   plan {plan / 2**20:7.1f} MiB ({plan / 1e6:7.1f} MB)   tokens/s {tps:6.1f}")
for q in [q for q in quants if q != "none" and "none" in rows]:
    print(f"{q}: peak RSS {rows['none'][0] / rows[q][0]:.2f}x lower than the fp32 base; step time {rows['none'][1] / rows[q][1]:.2f}x of it; plan/RSS {rows[q][2] / rows[q][0]:.3f}")
PY
