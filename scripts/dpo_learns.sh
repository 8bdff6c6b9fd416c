#!/usr/bin/env bash
# DPO with LoRA teaches a model a preference it did not have: which sum is right.
#
# 1. A base model (2 layers, 64 channels, char tokenizer) learns the format "a+b=s." with s a
#    random number, so it prefers no answer over another.
# 2. DPO with LoRA (rank 8 on every projection) on pairs "a+b=" -> the right sum chosen over a
#    wrong one (off by 1 to 9), a and b in 0..19; 2000 pairs, 10% held out by kiln.
# 3. The held-out preference accuracy (val_rewards_accuracy) before the first step and after.
#
# usage: scripts/dpo_learns.sh [KILN] [OUT]     (defaults: target/release/kiln, /tmp/kiln-dpo)
set -euo pipefail
KILN=${1:-target/release/kiln}
OUT=${2:-/tmp/kiln-dpo}
rm -rf "$OUT"; mkdir -p "$OUT"
python3 - "$OUT" <<'PY'
import json, random, sys
out = sys.argv[1]
r = random.Random(0)
with open(f"{out}/format.txt", "w") as f:
    for _ in range(20000):
        a, b = r.randint(0, 19), r.randint(0, 19)
        f.write(f"{a}+{b}={r.randint(0, 38)}.\n")
with open(f"{out}/pairs.jsonl", "w") as f:
    for _ in range(2000):
        a, b = r.randint(0, 19), r.randint(0, 19)
        s = a + b
        w = s + r.choice([-1, 1]) * r.randint(1, 9)
        w = w if w >= 0 else s + r.randint(1, 9)
        f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": f"{s}.", "rejected": f"{w}."}) + "\n")
PY
MODEL=(--set model.n_layer=2 --set model.n_head=4 --set model.n_embd=64 --set model.block_size=16 --set model.dropout=0.0)
"$KILN" train --data "$OUT/format.txt" --tokenizer char --out "$OUT/base" "${MODEL[@]}" --seq-len 16 \
  --max-steps 600 --set train.batch_size=32 --set train.lr=3e-3 --set train.warmup_steps=50 \
  --set eval.interval=0 --set sample.tokens=0 --quiet
"$KILN" train --init-from "$OUT/base" --data "$OUT/pairs.jsonl" --objective dpo --lora-rank 8 --lora-targets all-linear \
  --out "$OUT/dpo" --seq-len 12 --max-steps 300 --set train.batch_size=32 --set train.lr=2e-3 --set train.warmup_steps=20 \
  --set preference.beta=0.1 --set eval.interval=50 --set eval.iters=0 --set sample.tokens=0 --set checkpoint.interval=0 --quiet
python3 - "$OUT/dpo/metrics.jsonl" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if '"eval"' in l]
for e in ev:
    print(f"step {e['step']:4d}: held-out preference accuracy {100 * e['val_rewards_accuracy']:.1f}% over {int(e['val_pairs'])} pairs, margin {e['val_rewards_margin']:.3f}, val loss {e['val_loss']:.4f}")
PY
