#!/usr/bin/env bash
# Predicted vs measured step time of kiln's own CPU runs (issue 9, last criterion): `kiln plan calibrate` measures
# this machine, `kiln plan estimate` predicts, `kiln bench` measures; ROUNDS rounds, each calibrating right before
# its benches (the machine may be shared), then medians over rounds and the % error.
#
#   cargo build --release && crates/plan/scripts/plan_vs_bench.sh            # KILN, ROUNDS, OUT, CONFIGS override
set -euo pipefail
KILN=${KILN:-target/release/kiln}
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-/tmp/plan_vs_bench}
CONFIGS=${CONFIGS:-"shakespeare gpt2"}
ATTN=${ATTN:-unfused} # kiln's attention kernel in the benched build: unfused (keeps [B,NH,T,T]) or flash
mkdir -p "$OUT"

bench_args() {
  case $1 in
    shakespeare) echo "--preset shakespeare-char --set model.vocab_size=65 --steps 10 --warmup 2" ;;
    gpt2) echo "--preset gpt2-124m --set train.batch_size=4 --set model.block_size=256 --steps 3 --warmup 1" ;;
  esac
}
plan_args() {
  case $1 in
    shakespeare) echo "--layers 4 --hidden 128 --heads 4 --vocab 65 --biases false --dropout false --global-batch 12 --micro-batch 12 --seq 64" ;;
    gpt2) echo "--model gpt2-124m --vocab 50304 --dropout false --global-batch 4 --micro-batch 4 --seq 256" ;;
  esac
}

for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r: $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "$KILN" plan calibrate --out "$OUT/cpu-$r.json" > "$OUT/calibrate-$r.txt"
  sed -n 2,4p "$OUT/calibrate-$r.txt" >&2
  for c in $CONFIGS; do
    # shellcheck disable=SC2046
    "$KILN" bench $(bench_args "$c") --json --breakdown > "$OUT/bench-$c-$r.json"
    # shellcheck disable=SC2046
    "$KILN" plan estimate --gpu "$OUT/cpu-$r.json" --gpus 1 --precision fp32 --recompute none --attention "$ATTN" \
      $(plan_args "$c") --json > "$OUT/plan-$c-$r.json"
  done
done

python3 - "$OUT" "$ROUNDS" "$CONFIGS" <<'PY'
import json, statistics, sys
out, rounds, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
print(f"{'config':<12} {'round':>5} {'predicted ms':>13} {'measured ms':>12} {'(min..max)':>19} {'error':>8}")
for c in configs:
    pred, meas = [], []
    for r in range(1, rounds + 1):
        p = json.load(open(f"{out}/plan-{c}-{r}.json"))["step_time_s"] * 1e3
        b = json.load(open(f"{out}/bench-{c}-{r}.json"))["step_ms"]
        pred.append(p); meas.append(b["median"])
        rng = f"({b['min']:.1f}..{b['max']:.1f})"
        print(f"{c:<12} {r:>5} {p:>13.1f} {b['median']:>12.1f} {rng:>19} {(p / b['median'] - 1) * 100:>+7.1f}%")
    p, m = statistics.median(pred), statistics.median(meas)
    print(f"{c:<12} {'med':>5} {p:>13.1f} {m:>12.1f} {'':>19} {(p / m - 1) * 100:>+7.1f}%"
          f"   (round-to-round spread: predicted {min(pred):.1f}..{max(pred):.1f}, measured {min(meas):.1f}..{max(meas):.1f})")
# Per-kernel view of the last round: predicted terms vs the bench's profile.
for c in configs:
    p = json.load(open(f"{out}/plan-{c}-{rounds}.json"))["breakdown"]
    b = {x["op"]: x["ms_per_step"] for x in json.load(open(f"{out}/bench-{c}-{rounds}.json")).get("breakdown", [])}
    mm = b.get("matmul_forward", 0) + b.get("matmul_backward", 0) + b.get("lm_head_crossentropy", 0)
    at = b.get("attention_forward", 0) + b.get("attention_backward", 0)
    el = sum(v for k, v in b.items() if k.startswith(("layernorm", "gelu", "residual", "embedding", "dropout")))
    print(f"{c}: GEMM+head pred {p['compute_gemm_s']*1e3:.1f} / bench {mm:.1f} ms; attention pred {p['compute_attention_s']*1e3:.1f} / bench {at:.1f};"
          f" memory-bound pred {p['compute_elementwise_s']*1e3:.1f} / bench {el:.1f} (+ CE inside the head); optimizer pred {p['optimizer_s']*1e3:.1f} / adamw {b.get('adamw_update', 0):.1f} ms")
PY
