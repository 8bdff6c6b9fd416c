#!/usr/bin/env bash
# Measures the foundation issue's resume and determinism figures on shakespeare-char:
#  - 200 steps straight vs 100 steps + --resume to 200: train losses of steps 101-200 compared bit for bit;
#  - the same seed twice: identical losses and identical generated sample.
# Usage: scripts/check_foundation.sh [DATA]   (default ../shared/data/tinyshakespeare.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-../shared/data/tinyshakespeare.txt}
cargo build --release -q
k=target/release/kiln
tmp=$(mktemp -d)
common=(--preset shakespeare-char --data "$data" --quiet --set eval.interval=100 --set checkpoint.interval=100)
$k train "${common[@]}" --out "$tmp/straight" --max-steps 200 >/dev/null
$k train "${common[@]}" --out "$tmp/split" --max-steps 100 >/dev/null
$k train "${common[@]}" --out "$tmp/split" --max-steps 200 --resume >/dev/null
$k train "${common[@]}" --out "$tmp/again" --max-steps 200 >/dev/null
losses() { python3 -c 'import json,sys
for l in open(sys.argv[1]):
    o=json.loads(l)
    if o["kind"]=="train" and int(sys.argv[2])<=o["step"]<=int(sys.argv[3]): print(o["step"], repr(o["loss"]))' "$1/metrics.jsonl" "$2" "$3"; }
if diff <(losses "$tmp/straight" 101 200) <(losses "$tmp/split" 101 200) >/dev/null; then
  echo "resume: steps 101-200 identical ($(losses "$tmp/split" 101 200 | wc -l) losses compared)"
else
  echo "resume: MISMATCH"; diff <(losses "$tmp/straight" 101 200) <(losses "$tmp/split" 101 200) | head; exit 1
fi
if diff <(losses "$tmp/straight" 1 200) <(losses "$tmp/again" 1 200) >/dev/null && cmp -s "$tmp/straight/sample.txt" "$tmp/again/sample.txt"; then
  echo "determinism: same seed twice, 200 identical losses and identical sample ($(wc -c < "$tmp/again/sample.txt") bytes)"
else
  echo "determinism: MISMATCH"; exit 1
fi
rm -rf "$tmp"
