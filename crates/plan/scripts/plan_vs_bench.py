#!/usr/bin/env python3
"""Predicted vs measured step time of kiln's own CPU runs (last criterion).

Each round: `kiln plan calibrate` measures this machine, `kiln plan estimate` predicts, `kiln bench` measures.
Two clocks, because a shared 2-core machine runs other jobs:
  wall  the bench's median (and min) step, what the criterion names; calibrate --clock wall;
  cpu   CPU seconds of the bench process / threads per step: two benches that differ only in --steps, the CPU time
        of the difference divided by the extra steps (start-up cancels), compared with calibrate --clock cpu. Other
        processes barely change CPU time, so this is the comparison that repeats; on an idle machine both agree.
Medians over ROUNDS rounds, then the % error.

    cargo build --release && python3 crates/plan/scripts/plan_vs_bench.py [--rounds 3] [--kiln target/release/kiln]
"""
import argparse, json, os, resource, statistics, subprocess, sys, time

CONFIGS = {
    "shakespeare": dict(
        bench="--preset shakespeare-char --set model.vocab_size=65",
        steps=(5, 15), warmup=2,
        plan="--layers 4 --hidden 128 --heads 4 --vocab 65 --biases false --dropout false "
             "--global-batch 12 --micro-batch 12 --seq 64"),
    "gpt2": dict(
        bench="--preset gpt2-124m --set train.batch_size=4 --set model.block_size=256",
        steps=(1, 3), warmup=1,
        plan="--model gpt2-124m --vocab 50304 --dropout false --global-batch 4 --micro-batch 4 --seq 256"),
}

ap = argparse.ArgumentParser()
ap.add_argument("--kiln", default=os.environ.get("KILN", "target/release/kiln"))
ap.add_argument("--rounds", type=int, default=int(os.environ.get("ROUNDS", 3)))
ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/plan_vs_bench"))
ap.add_argument("--configs", default="shakespeare,gpt2")
ap.add_argument("--attention", default="flash", help="kiln's attention kernel in this build: flash (tensor::flash, since 2026-12-01) or unfused (tensor::attention)")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
configs = a.configs.split(",")


def run(args, path=None):
    """Run kiln; return (stdout, CPU seconds of the child)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([a.kiln] + args.split(), check=True, capture_output=True, text=True).stdout
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if path:
        open(path, "w").write(out)
    return out, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


rows = {c: [] for c in configs}
for r in range(1, a.rounds + 1):
    load = open("/proc/loadavg").read().split()[:3]
    print(f"== round {r}: {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {' '.join(load)}", file=sys.stderr)
    for clock in ("wall", "cpu"):
        txt, _ = run(f"plan calibrate --clock {clock} --out {a.out}/cpu-{clock}-{r}.json")
        print("  " + " | ".join(txt.splitlines()[1:3]), file=sys.stderr)
    for c in configs:
        cf = CONFIGS[c]
        s1, s2 = cf["steps"]
        benches, cpu = [], []
        for s in (s1, s2):
            out, cs = run(f"bench {cf['bench']} --steps {s} --warmup {cf['warmup']} --json",
                          f"{a.out}/bench-{c}-{s}-{r}.json")
            benches.append(json.loads(out)); cpu.append(cs)
        threads = benches[1]["threads"]
        cpu_step = (cpu[1] - cpu[0]) / (s2 - s1) / threads * 1e3
        wall = benches[1]["step_ms"]
        pred = {}
        for clock in ("wall", "cpu"):
            out, _ = run(f"plan estimate --gpu {a.out}/cpu-{clock}-{r}.json --gpus 1 --precision fp32 "
                         f"--recompute none --attention {a.attention} {cf['plan']} --json",
                         f"{a.out}/plan-{c}-{clock}-{r}.json")
            pred[clock] = json.loads(out)["step_time_s"] * 1e3
        rows[c].append(dict(pred_wall=pred["wall"], med=wall["median"], mn=wall["min"], mx=wall["max"],
                            pred_cpu=pred["cpu"], cpu=cpu_step))

err = lambda p, m: f"{(p / m - 1) * 100:+.1f}%"
print(f"{'config':<12} {'round':>5} | {'pred(wall)':>10} {'bench med':>10} {'min..max':>17} {'err':>7} "
      f"| {'pred(cpu)':>10} {'bench cpu':>10} {'err':>7}   (ms per step)")
for c in configs:
    for i, x in enumerate(rows[c], 1):
        print(f"{c:<12} {i:>5} | {x['pred_wall']:>10.1f} {x['med']:>10.1f} {x['mn']:>8.1f}..{x['mx']:<8.1f} "
              f"{err(x['pred_wall'], x['med']):>7} | {x['pred_cpu']:>10.1f} {x['cpu']:>10.1f} {err(x['pred_cpu'], x['cpu']):>7}")
    m = {k: statistics.median(x[k] for x in rows[c]) for k in rows[c][0]}
    print(f"{c:<12} {'med':>5} | {m['pred_wall']:>10.1f} {m['med']:>10.1f} {'':>17} {err(m['pred_wall'], m['med']):>7} "
          f"| {m['pred_cpu']:>10.1f} {m['cpu']:>10.1f} {err(m['pred_cpu'], m['cpu']):>7}")
json.dump(rows, open(f"{a.out}/summary.json", "w"), indent=1)
