#!/usr/bin/env bash
# Context parallelism's memory at T = 16384, its balance and overlap.
#   scripts/check_cp.sh memory    LLaMA-shaped 4 × 256 (8 heads, 2 kv), one sequence of 16384: per-rank activations
#                                 and exchange at cp 4 (ring, Ulysses) vs one rank; one cp 4 step's tracked peak vs
#                                 the plan; a --memory-limit that refuses one rank lets cp 4 train
#   scripts/check_cp.sh balance   the same model at T 4096, cp 4 ring, device clock, zig-zag vs contiguous chunks:
#                                 the slowest rank's attention time and work (visible score pairs) over the mean;
#                                 cp 2 ring and Ulysses on the wall clock: the attention's share of kernel + wait
# Needs target/release/kiln (cargo build --release). Runs go to ${OUT:-/tmp/kiln-cp}.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kiln-cp}
K=$PWD/target/release/kiln
DATA=${DATA:-$PWD/../shared/data/tinyshakespeare.txt}
mkdir -p "$OUT"
cd "$OUT"
llama() { echo "--set model.arch=llama --set model.bias=false --set model.n_head=8 --set model.n_kv_head=2 --set model.n_embd=256 --set train.batch_size=1 --set eval.iters=1 --set eval.interval=0 --set checkpoint.interval=0 --set sample.tokens=0 $*"; }
case "${1:-}" in
memory)
    M=$(llama --set model.n_layer=4 --set model.block_size=16384)
    for a in "--cp 1" "--cp 4" "--cp 4 --cp-mode ulysses"; do $K memory --data "$DATA" $M $a --json > "mem $a.json"; done
    rm -rf t16; $K train --data "$DATA" $M --cp 4 --out t16 --max-steps 1 --quiet
    python3 - <<'P'
import json
one = json.load(open('mem --cp 1.json'))
rows = lambda p, f: sum(r['bytes'] for r in p['rows'] if f(r))
acts = lambda p: rows(p, lambda r: r['kind'] == 'activations')
ex = lambda p: rows(p, lambda r: r['name'] == 'context-parallel exchange')
for a in ['--cp 4', '--cp 4 --cp-mode ulysses']:
    p = json.load(open(f'mem {a}.json'))
    print(f"T16384 {a}: activations {acts(p)/2**20:.1f} MiB + exchange {ex(p)/2**20:.1f} MiB per rank vs {acts(one)/2**20:.1f} MiB on one rank: {(acts(p)+ex(p))/acts(one):.3f}x")
p = json.load(open('mem --cp 4.json'))
last = [json.loads(l) for l in open('t16/metrics.jsonl') if '"train"' in l][-1]
planned = p['ranks_per_process'] * p['step_peak_bytes'] + p['data_bytes']
t = last['mem_tracked_peak_bytes']
print(f"cp 4 step: tracked peak {t/2**20:.1f} MiB vs plan {planned/2**20:.1f} MiB ({100*(planned-t)/t:+.2f}%)")
open('limit', 'w').write(str((one['total_bytes'] + p['total_bytes']) // 2))
P
    L=$(cat limit)
    rm -rf lim1 lim4
    set +e
    $K train --data "$DATA" $M --out lim1 --max-steps 1 --quiet --memory-limit "$L"; echo "one rank under --memory-limit $L: exit $? (run directory: $(test -e lim1 && echo written || echo none))"
    set -e
    $K train --data "$DATA" $M --cp 4 --out lim4 --max-steps 1 --quiet --memory-limit "$L"; echo "cp 4 under --memory-limit $L: trained"
    ;;
balance)
    M=$(llama --set model.n_layer=2 --set model.block_size=4096 --max-steps 13 --quiet)
    for rep in 1 2 3; do for bal in zigzag none; do
        rm -rf bal; $K train --data "$DATA" $M --cp 4 --cp-balance $bal --set parallel.cp_clock=device --out bal
        python3 -c "
import json, statistics as st
L = [json.loads(l) for l in open('bal/metrics.jsonl') if '\"train\"' in l][1:]
mm = [x['cp_attention_max_over_mean'] for x in L]
print('run $rep cp 4 $bal, device clock: slowest/mean attention time median %.3f (%.3f-%.3f), work %.4f' % (st.median(mm), min(mm), max(mm), L[0]['cp_pairs_max_over_mean']))"
    done; done
    for mode in ring ulysses; do
        rm -rf ov; $K train --data "$DATA" $M --cp 2 --cp-mode $mode --out ov
        python3 -c "
import json, statistics as st
L = [json.loads(l) for l in open('ov/metrics.jsonl') if '\"train\"' in l][1:]
print('cp 2 $mode, wall clock: attention share of kernel + wait time, median %.3f' % st.median([x['cp_compute_fraction'] for x in L]))"
    done
    ;;
*) echo "usage: scripts/check_cp.sh memory|balance" >&2; exit 2 ;;
esac
