#!/usr/bin/env python3
"""Checks a kiln run directory's TensorBoard event files against its metrics.jsonl.

    python3 crates/kiln/tests/tfevents_roundtrip.py RUN_DIR

Reads the event files with TensorBoard's own EventAccumulator (`pip install tensorboard`;
no TensorFlow needed) and requires that the scalars it shows are exactly the numeric
fields of metrics.jsonl: tag `<kind>/<key>` at the line's step, equal to float32
precision, nothing missing and nothing extra. Prints OK and exits 0, or lists the
differences and exits 1.
"""
import json
import math
import os
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def expected(run_dir):
    want = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            obj = json.loads(line)
            kind, step = obj.get("kind"), obj["step"]
            for k, v in obj.items():
                if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
                    continue
                tag = f"{kind}/{k}" if kind is not None else k
                if (tag, step) in want:
                    raise SystemExit(f"metrics.jsonl line {n}: {tag} at step {step} appears twice")
                want[(tag, step)] = float(v)
    return want


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    run_dir = sys.argv[1]
    files = sorted(f for f in os.listdir(run_dir) if "tfevents" in f)
    if not files:
        raise SystemExit(f"{run_dir}: no event files")
    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    got = {}
    for tag in acc.Tags()["scalars"]:
        for ev in acc.Scalars(tag):
            if (tag, ev.step) in got:
                print(f"duplicate: {tag} at step {ev.step}")
                sys.exit(1)
            got[(tag, ev.step)] = ev.value
    want = expected(run_dir)
    problems = []
    for key in sorted(set(want) | set(got)):
        if key not in got:
            problems.append(f"missing from the event files: {key[0]} at step {key[1]} = {want[key]}")
        elif key not in want:
            problems.append(f"not in metrics.jsonl: {key[0]} at step {key[1]} = {got[key]}")
        else:
            w, g = want[key], got[key]
            # simple_value is a float32: allow its rounding (half an ulp is 2^-24 relative).
            if not (math.isclose(g, w, rel_tol=1e-6, abs_tol=1e-37) or (math.isinf(w) and g == w)):
                problems.append(f"{key[0]} at step {key[1]}: events {g!r} != metrics.jsonl {w!r}")
    if problems:
        print(f"{run_dir}: {len(problems)} differences")
        for p in problems[:50]:
            print("  " + p)
        sys.exit(1)
    tags = sorted({t for t, _ in want})
    print(f"OK: {len(want)} scalars in {len(tags)} tags ({', '.join(tags)}) from {len(files)} event file(s) match metrics.jsonl")


if __name__ == "__main__":
    main()
