#!/usr/bin/env bash
# Builds fuzz/seeds/<target>/ from the shared fixtures and from what kiln itself writes (a tiny
# run's checkpoint, a prepared directory, an export): one valid input per file format, so the
# fuzzers start past the magic numbers. Multi-file inputs are joined with kiln::fuzz::SEP.
# Usage: fuzz/make_seeds.sh [path/to/kiln]   (default: target/release/kiln)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${1:-target/release/kiln}
SHARED=../shared/fixtures
DOCS=crates/data/tests/fixtures/docs
S=fuzz/seeds
rm -rf "$S"; mkdir -p "$S"/{hf_config,safetensors,checkpoint,tokenizer,npy,token_files,prepared,jsonl,parquet,config}
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
join() { python3 -c 'import sys; sys.stdout.buffer.write(b"\n--8<--\n".join(open(p,"rb").read() for p in sys.argv[1:]))' "$@"; }

for m in gpt2-tiny llama-tiny qwen2-tiny llama31-tiny mistral-tiny mixtral-tiny; do cp "$SHARED/$m/config.json" "$S/hf_config/$m.json"; done

# A tiny GPT-2 (the safetensors target's config: 1 layer, 2 heads, width 8, 8 positions, bytes)
# trained for one step, exported, and its checkpoint.
head -c 4000 ../shared/data/tinyshakespeare.txt > "$T/text.txt"
"$KILN" train --data "$T/text.txt" --tokenizer byte --out "$T/run" --quiet --set model.n_layer=1 --set model.n_head=2 \
    --set model.n_embd=8 --set model.block_size=8 --set train.batch_size=2 --set train.max_steps=1 --set eval.interval=0 \
    --set checkpoint.interval=1 --set sample.tokens=0 >/dev/null
"$KILN" export --run "$T/run" --out "$T/hf" >/dev/null
cp "$T/hf/model.safetensors" "$S/safetensors/gpt2-tiny-bytes.safetensors"
CK=$(ls -d "$T"/run/checkpoints/step-* | tail -1)
join "$T/run/config.toml" "$CK/manifest.json" "$CK/state.json" "$CK/model.safetensors" "$CK/optimizer.safetensors" "$CK/kiln-tokenizer.json" > "$S/checkpoint/tiny-run"

join "$SHARED/tokenizers/sp-bpe/tokenizer.json" "$SHARED/tokenizers/sp-bpe/tokenizer_config.json" > "$S/tokenizer/sp-bpe"
cp "$CK/kiln-tokenizer.json" "$S/tokenizer/byte.json"
"$KILN" tokenizer train --help >/dev/null 2>&1 && true
python3 - "$S/tokenizer" <<'PY'
import json, sys
# Small hand-made Hugging Face tokenizers: a word-level and a BPE one, with a chat template.
wl = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}],
      "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
      "model": {"type": "WordLevel", "vocab": {"<|endoftext|>": 0, "hello": 1, "world": 2, "[UNK]": 3}, "unk_token": "[UNK]"}}
open(sys.argv[1] + "/wordlevel.json", "w").write(json.dumps(wl))
bpe = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
       "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                 "vocab": {"H": 0, "e": 1, "l": 2, "o": 3, "He": 4, "ll": 5, "Hell": 6}, "merges": ["H e", "l l", "He ll"]}}
cfg = {"bos_token": None, "eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"}
open(sys.argv[1] + "/bpe-chat", "wb").write(json.dumps(bpe).encode() + b"\n--8<--\n" + json.dumps(cfg).encode())
PY

python3 - "$S" <<'PY'
import struct, sys
s = sys.argv[1]
def npy(dtype, shape, data):
    h = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (dtype, shape)
    h = h + " " * (63 - (10 + len(h)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h.encode() + data
open(s + "/npy/u16.npy", "wb").write(npy("<u2", "(6,)", struct.pack("<6H", 1, 2, 3, 4, 5, 6)))
open(s + "/npy/i32.npy", "wb").write(npy("<i4", "(2, 3)", struct.pack("<6i", 1, 2, 3, 4, 5, 6)))
open(s + "/npy/u32.npy", "wb").write(npy("<u4", "(4,)", struct.pack("<4I", 7, 8, 9, 10)))
open(s + "/token_files/u16.bin", "wb").write(struct.pack("<8H", 1, 2, 3, 4, 5, 6, 7, 8))
PY

"$KILN" data prepare --input "$T/text.txt" --out "$T/prep" --quiet >/dev/null
cp "$T/prep/train.tok" "$S/token_files/train.tok"
join "$T/prep/meta.json" "$T/prep/kiln-tokenizer.json" "$T/prep/train.tok" "$T/prep/train.docs" "$T/prep/val.tok" "$T/prep/val.docs" > "$S/prepared/text"
"$KILN" data prepare --input "$DOCS/pairs.jsonl" --format prompt_completion --out "$T/sft" --quiet >/dev/null
join "$T/sft/meta.json" "$T/sft/kiln-tokenizer.json" "$T/sft/train.tok" "$T/sft/train.docs" "$T/sft/val.tok" "$T/sft/val.docs" "$T/sft/train.mask" "$T/sft/val.mask" > "$S/prepared/masked"

cp "$DOCS"/{docs,chat,pairs}.jsonl "$S/jsonl/"
cp "$DOCS/docs.parquet" "$S/parquet/"

printf '[model]\nn_layer = 2\nn_embd = 32\nn_head = 4\n[train]\nbatch_size = 4\n[parallel]\ndp = 2\nzero = 2\n' > "$S/config/dp-zero"
printf '[model]\narch = "llama"\nn_kv_head = 2\nn_head = 4\nn_embd = 32\n\n--8<--\nparallel.tp=2\nparallel.pp=2\ntrain.grad_accum=4\nmodel.recompute="selective"\n' > "$S/config/llama-tp-pp"
printf '\n--8<--\nmodel.n_expert=4\nmodel.arch="llama"\nparallel.ep=2\nlora.rank=4\nmemory.limit="1GiB"\n' > "$S/config/moe-lora"
du -sh "$S"; find "$S" -type f | wc -l
