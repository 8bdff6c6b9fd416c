#!/usr/bin/env bash
# DPO with LoRA teaches a model a preference it did not have: which sum is right.
#
# 1. A base model (2 layers, 64 channels, char tokenizer) learns sums "a+b=s." from text where
#    half the answers are right and half are one too high, so it ranks s and s+1 about evenly.
# 2. DPO with LoRA (rank 16 on every projection) on pairs "a+b=" -> s chosen over s+1, for the
#    sums of a, b in 0..19 whose (a + 2b) mod 5 is not 0; the pairs of the other fifth are the
#    held-out set (kiln holds out the last 2.5% of the rows, which are those).
# 3. The held-out preference accuracy: the base's (measured with the reference before step 1)
#    and after every 250 steps.
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
facts = [(a, b) for a in range(20) for b in range(20)]
with open(f"{out}/format.txt", "w") as f:
    for _ in range(40000):
        a, b = r.choice(facts)
        f.write(f"{a}+{b}={a + b + r.randint(0, 1)}.\n")
seen = [x for x in facts if (x[0] + 2 * x[1]) % 5 != 0]
held = [x for x in facts if (x[0] + 2 * x[1]) % 5 == 0]
rows = [r.choice(seen) for _ in range(3120)] + held  # 3200 rows, the last 80 (2.5%) held out
with open(f"{out}/pairs.jsonl", "w") as f:
    for a, b in rows:
        f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": f"{a + b}.", "rejected": f"{a + b + 1}."}) + "\n")
PY
MODEL=(--set model.n_layer=2 --set model.n_head=4 --set model.n_embd=64 --set model.block_size=16 --set model.dropout=0.0)
"$KILN" train --data "$OUT/format.txt" --tokenizer char --out "$OUT/base" "${MODEL[@]}" --seq-len 16 \
  --max-steps 2000 --set train.batch_size=32 --set train.lr=3e-3 --set train.warmup_steps=50 \
  --set eval.interval=0 --set sample.tokens=0 --quiet
"$KILN" train --init-from "$OUT/base" --data "$OUT/pairs.jsonl" --objective dpo --lora-rank 16 --lora-targets all-linear \
  --out "$OUT/dpo" --seq-len 12 --max-steps 1000 --set train.batch_size=32 --set train.lr=5e-3 --set train.warmup_steps=50 --set data.val_fraction=0.025 \
  --set preference.beta=0.1 --set eval.interval=250 --set eval.iters=0 --set sample.tokens=0 --set checkpoint.interval=0 --quiet
python3 - "$OUT/dpo/metrics.jsonl" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
for e in lines:
    if e.get("kind") == "reference":
        print(f"step    0: held-out preference accuracy {100 * e['val_preference_accuracy']:.1f}% (the base model)")
    if e.get("kind") == "eval":
        print(f"step {e['step']:4d}: held-out preference accuracy {100 * e['val_preference_accuracy']:.1f}% over {int(e['val_pairs'])} pairs,"
              f" reward accuracy {100 * e['val_rewards_accuracy']:.1f}%, margin {e['val_rewards_margin']:.3f}, val loss {e['val_loss']:.4f}")
PY
