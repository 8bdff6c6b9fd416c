#!/usr/bin/env bash
# Data parallel / ZeRO equivalence, memory, volume and overlap.
#   scripts/check_dp.sh equiv   shakespeare-char, 50 steps: dp ∈ {1,2,4} × zero ∈ {0..3} vs one rank
#   scripts/check_dp.sh memory  GPT-2 124M shapes, dp 4: model-state bytes and bytes sent per stage
#   scripts/check_dp.sh overlap GPT-2 124M shapes, dp 2: gradient-reduction time hidden behind backward
# Needs target/release/kiln (cargo build --release). Runs go to ${OUT:-/tmp/kiln-dp}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-dp}
K=target/release/kiln
DATA=${DATA:-../shared/data/tinyshakespeare.txt}
mkdir -p "$OUT"
run() { # name, args...
    local name=$1; shift
    rm -rf "$OUT/$name"
    "$K" train --out "$OUT/$name" --quiet --set sample.tokens=0 --set checkpoint.interval=0 "$@" > "$OUT/$name.log" 2>&1 || { cat "$OUT/$name.log"; exit 1; }
}
case "${1:-equiv}" in
equiv)
    for dp in 1 2 4; do for z in 0 1 2 3; do
        run "sc-dp$dp-z$z" --preset shakespeare-char --data "$DATA" --max-steps 50 --dp $dp --zero $z
    done; done
    python3 - "$OUT" <<'PY'
import json, sys, filecmp, glob
out = sys.argv[1]
def losses(r): return [json.loads(l)["loss"] for l in open(f"{out}/{r}/metrics.jsonl") if '"train"' in l]
def ck(r): return glob.glob(f"{out}/{r}/checkpoints/step-*/model.safetensors")[0]
base = losses("sc-dp1-z0")
for dp in (1, 2, 4):
    for z in range(4):
        r = f"sc-dp{dp}-z{z}"; l = losses(r)
        rel = max(abs(a - b) / abs(b) for a, b in zip(l, base))
        same_loss = l == base
        same_params = filecmp.cmp(ck(r), ck("sc-dp1-z0"), shallow=False)
        same_z0 = filecmp.cmp(ck(r), ck(f"sc-dp{dp}-z0"), shallow=False)
        print(f"dp {dp} zero {z}: {len(l)} steps, max rel loss diff vs 1 rank {rel:.2e}, losses bit-identical {same_loss}, params = 1 rank {same_params}, params = zero 0 at this dp {same_z0}")
PY
    ;;
memory)
    for z in 0 1 2 3; do
        run "g2-dp4-z$z" --preset gpt2-124m --max-steps 3 --dp 4 --zero $z --set train.batch_size=4 --set train.grad_accum=1 \
            --set model.block_size=64 --set eval.iters=1 --set eval.batch_size=4 --set train.warmup_steps=1
    done
    python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]; n = 4
for z in range(4):
    line = [json.loads(l) for l in open(f"{out}/g2-dp4-z{z}/metrics.jsonl") if '"train"' in l][-1]
    if z == 0: psi = line["mem_params_bytes"] / 4
    held = line["mem_params_bytes"] + line["mem_grads_bytes"] + line["mem_optim_bytes"]
    formula = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n][z]
    ring = 2 * (n - 1) / n * 4 * psi; theory = 1.5 * ring if z == 3 else ring
    print(f"zero {z}: held {held/1e6:.1f} MB vs formula {formula/1e6:.1f} MB ({100*(held/formula-1):+.2f} %), "
          f"transient peak {line['mem_transient_peak_bytes']/1e6:.1f} MB; sent {line['comm_bytes_sent']/1e6:.1f} MB/step vs theory {theory/1e6:.1f} MB ({100*(line['comm_bytes_sent']/theory-1):+.3f} %)")
PY
    ;;
overlap)
    for b in 25 1000; do
        run "g2-dp2-b$b" --preset gpt2-124m --max-steps 6 --dp 2 --set train.batch_size=4 --set train.grad_accum=1 \
            --set model.block_size=128 --set eval.iters=1 --set eval.batch_size=2 --set train.warmup_steps=1 --set parallel.bucket_mb=$b
    done
    python3 - "$OUT" <<'PY'
import json, sys, statistics as st
out = sys.argv[1]
for b in (25, 1000):
    ls = [json.loads(l) for l in open(f"{out}/g2-dp2-b{b}/metrics.jsonl") if '"train"' in l][1:]
    f = st.median(x["comm_hidden_fraction"] for x in ls); c = st.median(x["comm_s"] for x in ls); e = st.median(x["comm_exposed_s"] for x in ls)
    tps = st.median(x["tokens_per_sec"] for x in ls)
    print(f"bucket {b} MiB: reduction {c*1e3:.0f} ms/step, exposed {e*1e3:.0f} ms, hidden fraction {f:.3f} (median of {len(ls)} steps), {tps:.0f} tok/s")
PY
    ;;
esac
