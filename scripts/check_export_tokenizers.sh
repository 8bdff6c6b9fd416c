#!/usr/bin/env bash
# kiln's own tokenizers (byte, char, gpt2) exported in Hugging Face form: for each, a small run
# is trained and exported, and transformers' AutoTokenizer on the export gives kiln's ids and
# decodings for hard texts, and AutoModelForCausalLM's greedy continuation equals
# `kiln generate --temperature 0` on the export. Needs target/release/kiln and a Python with
# torch and transformers (PY, default the bench venv's). Runs go to ${OUT:-/tmp/kiln-export-tok}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-export-tok}
K=target/release/kiln
PY=${PY:-$HOME/.cache/kiln-bench/venv/bin/python}
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
mkdir -p "$OUT"
head -c 200000 "$DATA" > "$OUT/data.txt"
TEXTS=("First Citizen:\nBefore we proceed" "  spaces   and\ttabs\r\n" "naïve café — 東京 🦀" "<|endoftext|>x" "")
for tok in byte char gpt2; do
    run="$OUT/$tok-run"; exp="$OUT/$tok-export"
    rm -rf "$run" "$exp"
    "$K" train --data "$OUT/data.txt" --out "$run" --quiet --max-steps 60 --set data.tokenizer=$tok \
        --set model.n_layer=2 --set model.n_head=2 --set model.n_embd=64 --set model.block_size=64 \
        --set train.batch_size=4 --set sample.tokens=0 --set eval.interval=0 > "$OUT/$tok.log" 2>&1 || { cat "$OUT/$tok.log"; exit 1; }
    "$K" export --run "$run" --out "$exp" > /dev/null
    for t in "${TEXTS[@]}"; do printf '%b' "$t"; printf '\0'; done > "$OUT/texts.bin"
    : > "$OUT/$tok.kiln-ids.jsonl"
    while IFS= read -r -d '' t; do
        "$K" tokenizer encode --tokenizer "$run/kiln-tokenizer.json" --text "$t" >> "$OUT/$tok.kiln-ids.jsonl"
    done < "$OUT/texts.bin"
    prompt="ROMEO:"
    "$K" generate --checkpoint "$exp" --prompt "$prompt" --max-new-tokens 24 --temperature 0 > "$OUT/$tok.kiln-gen.txt"
    "$PY" - "$exp" "$OUT/texts.bin" "$OUT/$tok.kiln-ids.jsonl" "$tok" "$prompt" "$OUT/$tok.kiln-gen.txt" <<'PY'
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
exp, texts, ids_file, kind, prompt, gen_file = sys.argv[1:7]
kiln_gen = open(gen_file, encoding="utf-8").read().removesuffix("\n")
texts = open(texts, "rb").read().decode().split("\0")[:-1]
want = [json.loads(l)["ids"] for l in open(ids_file)]
tok = AutoTokenizer.from_pretrained(exp)
for t, w in zip(texts, want):
    got = tok(t, add_special_tokens=False).input_ids
    assert got == w, f"{kind}: ids of {t!r}: transformers {got} kiln {w}"
    assert tok.decode(got) == (t if kind != "char" else tok.decode(w)), f"{kind}: decoding {t!r}"
m = AutoModelForCausalLM.from_pretrained(exp, dtype=torch.float32, attn_implementation="eager").eval()
ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
hf_gen = tok.decode(out[0])
print(f"{kind:>5}: {len(texts)} texts, ids equal; vocab {len(tok)}; greedy: transformers {hf_gen!r} kiln {kiln_gen!r}")
assert hf_gen == kiln_gen, f"{kind}: greedy continuations differ"
PY
done
echo "all exported tokenizers load in transformers with kiln's ids"
