#!/usr/bin/env bash
# The memory plan (`kiln memory`) against what training runs measure.
#
# (a) Activation memory of GPT-2 124M (B 4, T 1024) and a LLaMA shape under recompute
#     none / selective / full: planned vs measured (`mem_activations_bytes`, the model's own
#     buffers after a real step, and `mem_tracked_peak_activations_bytes`, the tracking
#     allocator's count), and the ratios between the policies against Korthikanti et al.'s
#     per-layer formulas adapted to kiln (fp32, FlashAttention, no stored dropout masks).
# (b) The plan's per-process step peak against the tracked peak and the peak RSS for varied
#     configurations (recompute, ZeRO stage, dp, tp, sequence parallel, pp, offload, MoE, bf16).
#
# Usage: scripts/check_memory.sh   (KILN=path/to/kiln, OUT=dir; a release build is assumed)
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-target/release/kiln}
OUT=${OUT:-/tmp/kiln-memory}
mkdir -p "$OUT"
export RAYON_NUM_THREADS=${RAYON_NUM_THREADS:-2}
# A small corpus: the data's share of memory stays negligible, and tokenizing it is instant.
python3 scripts/corpus.py "$OUT/corpus.txt"
COMMON=(--data "$OUT/corpus.txt" --set data.tokenizer=byte --set sample.tokens=0 --set checkpoint.interval=0
        --set eval.interval=0 --set eval.iters=1 --set eval.batch_size=1 --set train.warmup_steps=1)

# run NAME STEPS ARGS...: `kiln memory --json` into NAME.plan.json, then `kiln train`.
# REPORT_ONLY=1 prints the report of an earlier run's files (REPORT_ONLY=plans re-plans them first).
run() {
    local name=$1 steps=$2
    shift 2
    # REPORT_ONLY=plans re-plans the earlier runs (after a change to the plan) and reports.
    [ "${REPORT_ONLY:-}" = plans ] && "$KILN" memory "${COMMON[@]}" "$@" --json > "$OUT/$name.plan.json"
    [ -n "${REPORT_ONLY:-}" ] && return
    "$KILN" memory "${COMMON[@]}" "$@" --json > "$OUT/$name.plan.json"
    rm -rf "${OUT:?}/$name"
    "$KILN" train "${COMMON[@]}" "$@" --out "$OUT/$name" --max-steps "$steps" --quiet > "$OUT/$name.log" 2>&1
    # The final checkpoint is not needed here (GPT-2 124M's is 1.5 GB).
    rm -rf "${OUT:?}/$name/checkpoints"
}

# (a) GPT-2 124M with its padded vocabulary (the byte tokenizer only predicts 256 of them; the
# buffers are those of the real shape), and a LLaMA shape (GQA, SwiGLU, untied head).
GPT2=(--preset gpt2-124m --set model.vocab_size=50304 --set train.batch_size=4)
LLAMA=(--preset llama-tiny --set model.n_layer=8 --set model.n_embd=512 --set model.n_head=8 --set model.n_kv_head=2
       --set model.ffn_hidden=1408 --set model.block_size=512 --set model.vocab_size=32000 --set train.batch_size=4)
for r in none selective full; do
    run "gpt2-$r" 1 "${GPT2[@]}" --set model.recompute=$r
    run "llama-$r" 1 "${LLAMA[@]}" --set model.recompute=$r
    [ -n "${REPORT_ONLY:-}" ] && continue
    # One layer fewer: the planned per-layer share (the rest is shared by all layers).
    "$KILN" memory "${COMMON[@]}" "${GPT2[@]}" --set model.recompute=$r --set model.n_layer=11 --json > "$OUT/gpt2-$r.l1.json"
    "$KILN" memory "${COMMON[@]}" "${LLAMA[@]}" --set model.recompute=$r --set model.n_layer=7 --json > "$OUT/llama-$r.l1.json"
done

# (b) Varied configurations of one GPT-2-style model (6 layers, 384 channels, B 16, T 256)
# and an MoE LLaMA; 3 steps each.
BASE=(--preset tiny --set model.n_layer=6 --set model.n_embd=384 --set model.n_head=6 --set model.block_size=256 --set train.batch_size=16)
MOE=(--preset moe-tiny --set model.n_layer=4 --set model.n_embd=256 --set model.n_head=4 --set model.n_kv_head=2 --set model.ffn_hidden=512
     --set model.block_size=256 --set train.batch_size=16 --set model.n_expert=4)
run b-none 3 "${BASE[@]}"
run b-full 3 "${BASE[@]}" --set model.recompute=full
run b-sel-dp2-zero1 3 "${BASE[@]}" --set model.recompute=selective --dp 2 --zero 1
run b-dp2-zero2 3 "${BASE[@]}" --dp 2 --zero 2
run b-dp2-zero3 3 "${BASE[@]}" --dp 2 --zero 3
run b-tp2 3 "${BASE[@]}" --tp 2
run b-offload 3 "${BASE[@]}" --offload optimizer
run b-moe 3 "${MOE[@]}"
run b-bf16 3 "${BASE[@]}" --precision bf16
run b-pp2-1f1b 3 "${BASE[@]}" --pp 2 --micro-batches 4
run b-tp2-sp 3 "${BASE[@]}" --tp 2 --sequence-parallel

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def last_train(name):
    return [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"train"' in l][-1]
def plan(name, suffix="plan"):
    return json.load(open(f"{out}/{name}.{suffix}.json"))
def acts(p):
    return sum(r["bytes"] for r in p["rows"] if r["kind"] == "activations" and r["phase"] == "held")
mb = lambda b: b / 2**20

print("(a) activation memory per rank: planned vs measured")
print(f"{'run':18s} {'planned MiB':>12s} {'model MiB':>10s} {'tracked MiB':>12s} {'err':>7s} {'per layer MiB':>14s}")
per_layer = {}
for model, layers in (("gpt2", 12), ("llama", 8)):
    for r in ("none", "selective", "full"):
        name = f"{model}-{r}"
        p, m = plan(name), last_train(name)
        pa, ma, ta = acts(p), m["mem_activations_bytes"], m["mem_tracked_peak_activations_bytes"]
        # The planned share of one layer (plan at L minus plan at L - 1); what the layers do
        # not scale (the head's chunk, the final norm, the shared recompute set) is then
        # taken off the measured total to give the measured per-layer bytes.
        pl = pa - acts(plan(name, "l1"))
        fixed = pa - layers * pl
        per_layer[name] = (ma - fixed) / layers
        err = max(abs(pa - ma), abs(pa - ta)) / pa
        print(f"{name:18s} {mb(pa):12.1f} {mb(ma):10.1f} {mb(ta):12.1f} {100*err:6.2f}% {mb(per_layer[name]):14.2f}")

# Korthikanti et al. 2023, per layer, 16-bit: s·b·h·(34 + 5·a·s/h) with no recomputation,
# 34·s·b·h with selective recomputation (the attention core: QKᵀ, softmax, its dropout, ·V),
# 2·s·b·h with full recomputation (the layer input only). Their terms are the inputs of the
# layer's products and norms: LN1 in (h), QKV in (h), Q, K, V (3h), proj in (h), LN2 in (h),
# fc1 in (h), GELU in (4h), fc2 in (4h), plus two 1-byte dropout masks and 5·a·s² softmax bytes.
# Adapted to kiln: 4-byte elements; the same terms at the model's own widths (GQA's K and V
# are n_kv_head·head_size wide, SwiGLU's activation input is gate|up = 2F, its output F); no
# dropout masks (kiln regenerates them from a counter-based hash); FlashAttention keeps no s×s
# matrix: the softmax terms become the per-row log-sum-exp, 4·a·s·b bytes. So, per token:
#   none      = 4·(6h + 2·kv + fc + F) + 4a      selective = 4·(6h + 2·kv + fc + F)      full = 4h
print("\nratios none : selective : full, per layer (full = 1)")
for model, (h, a, kv, fc, f) in (("gpt2", (768, 12, 768, 3072, 3072)), ("llama", (512, 8, 128, 2816, 1408))):
    kept = 4 * (6 * h + 2 * kv + fc + f)
    k = (kept + 4 * a, kept, 4 * h)
    kr = [x / k[2] for x in k]
    mr = [per_layer[f"{model}-{r}"] / per_layer[f"{model}-full"] for r in ("none", "selective", "full")]
    tot = [last_train(f"{model}-{r}")["mem_activations_bytes"] for r in ("none", "selective", "full")]
    tr = [x / tot[2] for x in tot]
    agree = [abs(m / q - 1) for m, q in zip(mr, kr)]
    print(f"  {model}: measured per layer {mr[0]:.2f} : {mr[1]:.2f} : 1   Korthikanti (adapted) {kr[0]:.2f} : {kr[1]:.2f} : 1"
          f"   disagreement none {100*agree[0]:.1f}%, selective {100*agree[1]:.1f}%   (whole totals {tr[0]:.2f} : {tr[1]:.2f} : 1)")
print("  selective (Korthikanti's) re-runs the attention core: kiln drops its output and log-sum-exp (h + a per token);\n"
      "  the adapted formula drops only the log-sum-exp (FlashAttention stores no s×s scores), so they differ by h.")

print("\n(b) per-process step peak: planned vs tracked allocator vs peak RSS")
print(f"{'run':18s} {'planned MiB':>12s} {'tracked MiB':>12s} {'err':>7s} {'RSS MiB':>9s} {'err':>7s}")
for name in ("b-none", "b-full", "b-sel-dp2-zero1", "b-dp2-zero2", "b-dp2-zero3", "b-tp2", "b-offload", "b-moe", "b-bf16", "b-pp2-1f1b", "b-tp2-sp"):
    p, m = plan(name), last_train(name)
    planned = p["process_step_peak_bytes"]
    tr, rss = m["mem_tracked_peak_bytes"], m["mem_rss_peak_bytes"]
    print(f"{name:18s} {mb(planned):12.1f} {mb(tr):12.1f} {100*(planned-tr)/tr:+6.1f}% {mb(rss):9.1f} {100*(planned-rss)/rss:+6.1f}%")
PY
