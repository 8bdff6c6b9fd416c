#!/usr/bin/env bash
# LoRA fine-tuning figure: a trained shakespeare-char run, fine-tuned with LoRA on a different
# text (the Rust book, restricted to the base model's 65 characters), lowers that text's
# held-out loss while training a small fraction of the parameters.
# Usage: scripts/check_lora.sh BASE_RUN_DIR   (a finished `--preset shakespeare-char` run)
set -euo pipefail
cd "$(dirname "$0")/.."
base=$1
k=target/release/kiln
tmp=$(mktemp -d)
python3 - "$base/tokenizer.json" "$(rustc --print sysroot)/share/doc/rust/html/book/print.html" "$tmp" <<'PY'
import html, json, re, sys
vocab = set(json.load(open(sys.argv[1]))["chars"])
text = open(sys.argv[2], encoding="utf-8").read()
text = re.sub(r"(?s)<(script|style|nav)[^>]*>.*?</\1>", " ", text)
text = html.unescape(re.sub(r"<[^>]+>", " ", text))
text = re.sub(r"[ \t]+", " ", text)
text = re.sub(r"\n\s*\n+", "\n\n", text)
text = "".join(c for c in text if c in vocab)
n = int(len(text) * 0.9)
open(sys.argv[3] + "/train.txt", "w").write(text[:n])
open(sys.argv[3] + "/val.txt", "w").write(text[n:])
print(f"new text: {len(text)} chars ({n} train / {len(text) - n} held out)", file=sys.stderr)
PY
before=$($k eval --run "$base" --data "$tmp/val.txt")
$k train --init-from "$base" --data "$tmp/train.txt" --out "$tmp/lora" --lora-rank 4 --lora-alpha 8 \
  --lora-targets q,k,v,o,up,down --max-steps 300 --set train.lr=2e-3 --set train.warmup_steps=20 \
  --set train.lr_decay_steps=300 --set eval.interval=100 --set eval.iters=20 2>&1 | grep -E "parameters|error" || true
after=$($k eval --run "$tmp/lora" --data "$tmp/val.txt")
echo "base on the new text's held-out part: $before"
echo "after LoRA:                           $after"
$k export --run "$tmp/lora" --merge --out "$tmp/merged" >/dev/null && echo "merged export: $tmp/merged"
