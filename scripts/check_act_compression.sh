#!/usr/bin/env bash
# Activation compression (`memory.activation_compression`):
#  (a) GPT-2 124M, B 4, T 1024, one step: the activation bytes the model holds, what one block keeps for backward,
#      (`mem_activations_bytes`) and the tracking allocator's activation peak against the
#      plan (`kiln memory --json`), for none / int8 / int4;
#  (b) shakespeare-char and moe-tiny (8 experts, top 2: the experts' activations compressed,
#      the routing kept exact), 2000 steps: final val loss, activation bytes and median step
#      time for none / int8 / int4 (and int8 with stochastic rounding).
# Usage: scripts/check_act_compression.sh [a|b]   (KILN=path/to/kiln, OUT=dir; a release build)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-actc}
mkdir -p "$OUT"
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
what=${1:-ab}
python3 scripts/corpus.py "$OUT/corpus.txt"
SH=../shared/data/tinyshakespeare.txt
ac() { [ "$1" = none ] && return; [ "$1" = int8s ] && echo "--set memory.activation_compression=int8 --set memory.activation_rounding=stochastic" && return; echo "--set memory.activation_compression=$1"; }
if [[ $what == *a* ]]; then
    G=(--preset gpt2-124m --set model.vocab_size=50304 --set train.batch_size=4 --data "$OUT/corpus.txt" --set data.tokenizer=byte
       --set sample.tokens=0 --set checkpoint.interval=0 --set eval.interval=0 --set eval.iters=1 --set eval.batch_size=1 --set train.warmup_steps=1)
    for c in none int8 int4; do
        # shellcheck disable=SC2046
        "$KILN" memory "${G[@]}" $(ac $c) --json > "$OUT/gpt2-$c.plan.json"
        rm -rf "${OUT:?}/gpt2-$c"
        # shellcheck disable=SC2046
        "$KILN" train "${G[@]}" $(ac $c) --max-steps 1 --out "$OUT/gpt2-$c" --quiet > "$OUT/gpt2-$c.log" 2>&1
        rm -rf "${OUT:?}/gpt2-$c/checkpoints"
        # What one block keeps for backward: the plan at 24 layers less the plan at 12 (the
        # plan equals the held buffers, checked above), per block; the fixed working buffers
        # (the fp32 residual stream in flight, the head's logits chunk) cancel.
        for L in 12 24; do
            # shellcheck disable=SC2046
            "$KILN" memory "${G[@]}" --set model.n_layer=$L $(ac $c) --json > "$OUT/gpt2-$c.L$L.plan.json"
        done
    done
    python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def last(n): return [json.loads(l) for l in open(f"{out}/{n}/metrics.jsonl") if '"train"' in l][-1]
def plan(n): return sum(r["bytes"] for r in json.load(open(f"{out}/{n}.plan.json"))["rows"] if r["kind"] == "activations" and r["phase"] != "eval")
base = last("gpt2-none")["mem_activations_bytes"]
for c in ["none", "int8", "int4"]:
    m, p = last(f"gpt2-{c}"), plan(f"gpt2-{c}")
    held, tr = m["mem_activations_bytes"], m["mem_tracked_peak_activations_bytes"]
    print(f"gpt2-124m B4 T1024 {c:5}: activations {held / 2**20:8.1f} MiB ({held / base:.3f} of none), plan {p / 2**20:8.1f} MiB (plan/held {p / held:.4f}), tracked peak {tr / 2**20:8.1f} MiB (plan/tracked {p / tr:.4f})")
def block(n): return (plan(f"{n}.L24") - plan(f"{n}.L12")) / 12
for c in ["none", "int8", "int4"]:
    print(f"gpt2-124m B4 T1024 {c:5}: kept for backward per block {block(f'gpt2-{c}') / 2**20:7.2f} MiB ({block(f'gpt2-{c}') / block('gpt2-none'):.3f} of none)")
PY
fi
if [[ $what == *b* ]]; then
    for preset in shakespeare-char moe-tiny; do
        for c in none int8 int4 int8s; do
            rm -rf "${OUT:?}/$preset-$c"
            # shellcheck disable=SC2046
            "$KILN" train --preset $preset --data "$SH" $(ac $c) --set sample.tokens=0 --set checkpoint.interval=0 --out "$OUT/$preset-$c" --quiet > "$OUT/$preset-$c.log" 2>&1
        done
    done
    python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
for preset in ["shakespeare-char", "moe-tiny"]:
    base = None
    for c in ["none", "int8", "int4", "int8s"]:
        lines = [json.loads(l) for l in open(f"{out}/{preset}-{c}/metrics.jsonl")]
        tr = [l for l in lines if l.get("kind") == "train"]
        val = [l for l in lines if l.get("kind") == "eval"][-1]["val_loss"]
        dt = statistics.median(l["step_time_s"] for l in tr[10:]) if "step_time_s" in tr[-1] else statistics.median(1 / l["tokens_per_sec"] for l in tr[10:])
        acts = tr[-1]["mem_activations_bytes"]
        base = base or (val, dt, acts)
        print(f"{preset:16} {c:5}: val loss {val:.4f} ({val - base[0]:+.4f}), activations {acts / 2**20:6.2f} MiB ({acts / base[2]:.3f}), step time {dt / base[1]:.2f}x of none")
PY
fi
