#!/usr/bin/env bash
# Expert-parallel figures: `kiln train --preset moe-tiny` on 1 rank against --ep 2,
# --ep 4 and --dp 2 --ep 2 (in-process ranks), 20 steps, same global batch, dropout 0:
#   1. dropless (model.capacity_factor=0), moe-tiny's load-balancing loss (0.01) on: max
#      relative per-step loss difference vs one rank (required ≤ 1e-5), and --dp 2 alongside
#      (both sum the routing statistics over the batch's ranks);
#   2. with capacity (model.capacity_factor=1.25, moe-tiny's own): capacity is per routing
#      group, i.e. per rank, so --ep 2 is compared with one rank and with --dp 2 (whose ranks
#      route the same token groups);
#   3. rank 0's all-to-all bytes per step (metrics.jsonl `comm_bytes_sent_all_to_all`) against
#      the exact formula  L·[2·4·C·(sent + received) + 4·(P−1)·E/P]  (sent / received: rows
#      routed to other ranks' experts / received for its own, `moe_ep_rows_*`) and against
#      the balanced-routing estimate  L·[4 all-to-alls × 4·C·R·(P−1)/P + counts], R = N·K.
# Usage: scripts/check_ep.sh [KILN] [STEPS]   (KILN defaults to the debug build in
# $CARGO_TARGET_DIR or target/)
set -euo pipefail
KILN=${1:-${CARGO_TARGET_DIR:-target}/debug/kiln}
STEPS=${2:-20}
OUT=${OUT:-/tmp/kiln-check-ep}
rm -rf "$OUT"
mkdir -p "$OUT"
COMMON=(--preset moe-tiny --max-steps "$STEPS" --set model.dropout=0 --set sample.tokens=0 --set checkpoint.interval=0 --set eval.interval=0 --quiet)
run() { # name, extra args...
    local name=$1
    shift
    "$KILN" train "${COMMON[@]}" --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1 || { cat "$OUT/$name.log"; exit 1; }
}
run drop0-one --set model.capacity_factor=0
run drop0-ep2 --set model.capacity_factor=0 --ep 2
run drop0-ep4 --set model.capacity_factor=0 --ep 4
run drop0-dp2ep2 --set model.capacity_factor=0 --dp 2 --ep 2
run drop0-dp2 --set model.capacity_factor=0 --dp 2
run cap-one
run cap-ep2 --ep 2
run cap-dp2 --dp 2
python3 - "$OUT" <<'EOF'
import json, sys, tomllib
out = sys.argv[1]
def lines(name):
    return [json.loads(l) for l in open(f"{out}/{name}/metrics.jsonl") if '"kind":"train"' in l]
def rel(a, b):
    return max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(lines(a), lines(b)))
print("equivalence, max relative per-step loss difference over the run:")
for l in ["ep2", "ep4", "dp2ep2", "dp2"]:
    r = rel(f"drop0-{l}", "drop0-one")
    g = max(abs(x["grad_norm"] / y["grad_norm"] - 1) for x, y in zip(lines(f"drop0-{l}"), lines("drop0-one")))
    print(f"  dropless  --{l:7s} vs 1 rank: loss {r:.2e}  {'PASS' if r <= 1e-5 else 'FAIL'} (≤ 1e-5); grad norm {g:.2e}")
d = lambda n: sum(x["moe_dropped_fraction"] for x in lines(n)) / len(lines(n))
print(f"  capacity 1.25: --ep 2 vs 1 rank: {rel('cap-ep2', 'cap-one'):.2e}; --ep 2 vs --dp 2: {rel('cap-ep2', 'cap-dp2'):.2e}")
print(f"    mean dropped fraction (rank 0's routing group): 1 rank {d('cap-one'):.4f}, --dp 2 {d('cap-dp2'):.4f}, --ep 2 {d('cap-ep2'):.4f}")
print("all-to-all bytes sent per step by rank 0 (dropless):")
for l, p in [("ep2", 2), ("ep4", 4), ("dp2ep2", 2)]:
    name = f"drop0-{l}"
    cfg = tomllib.load(open(f"{out}/{name}/config.toml", "rb"))
    m, t = cfg["model"], cfg["train"]
    c, L, e, k, T = m["n_embd"], m["n_layer"], m["n_expert"], m["top_k"], m["block_size"]
    ranks = p * (2 if l.startswith("dp2") else 1)
    r = t["batch_size"] // t["grad_accum"] // ranks * T * k
    xs = lines(name)
    meas = [x["comm_bytes_sent_all_to_all"] for x in xs]
    exact = [2 * 4 * c * (x["moe_ep_rows_sent"] + x["moe_ep_rows_received"]) + L * 4 * (p - 1) * e // p for x in xs]
    bal = L * (4 * 4 * c * r * (p - 1) / p + 4 * (p - 1) * e // p)
    mean = sum(meas) / len(meas)
    ok = all(a == b for a, b in zip(meas, exact))
    print(f"  --{l:7s} P={p}: measured mean {mean:,.0f} B/step; exact formula {'matches every step' if ok else 'DIFFERS'}; "
          f"balanced estimate {bal:,.0f} B ({100 * (mean / bal - 1):+.1f}%: routing imbalance)")
EOF
