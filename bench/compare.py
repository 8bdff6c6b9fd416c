#!/usr/bin/env python3
"""Side-by-side CPU training speed: `kiln bench` against PyTorch eager (bench/torch_gpt.py).

For each config it runs kiln and PyTorch alternately (kiln, torch, kiln, torch, ... --repeats
pairs) on the same thread count, takes the median step time of each run, and reports per
config the median over repeats of kiln tokens/s, torch tokens/s and the pair-by-pair ratio
kiln/torch. It also measures the machine's fp32 matmul peak two ways, alternately: `kiln bench --peak` and a
numpy (OpenBLAS) 2048^3 sgemm on the same thread count.

Runs with the standard library only. PyTorch, numpy and threadpoolctl are installed from PyPI
into a separate virtual environment the first time (see bench/README.md for what that pulls
and why); --python uses an interpreter that already has them instead.

    python3 bench/compare.py                       # configs a-d, 3 repeats, 2 threads
    python3 bench/compare.py --configs a,b --repeats 5 --out /tmp/cmp.json
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TORCH_SCRIPT = os.path.join(HERE, "torch_gpt.py")
DEFAULT_VENV = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kiln-bench", "venv")

# The GPT-2 124M shape (tied, bias, vocab 50257 padded to 50304), block_size set to T.
GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab=50304, bias=True, beta2=0.95)
# name -> model shape, batch, optimizer beta2 (the presets' values), kiln preset, steps.
# `warmup` untimed steps precede `steps` timed ones. The step counts are odd so that the median
# is one measured step on both sides (kiln bench takes the upper median of an even count).
CONFIGS = {
    "a": dict(label="shakespeare-char B12 T64", preset="shakespeare-char",
              n_layer=4, n_head=4, n_embd=128, vocab=65, bias=False, beta2=0.99,
              batch=12, seq=64, steps=11, warmup=2),
    "b": dict(label="gpt2-124m B4 T64", preset="gpt2-124m", **GPT2, batch=4, seq=64, steps=5, warmup=2),
    "c": dict(label="gpt2-124m B4 T256", preset="gpt2-124m", **GPT2, batch=4, seq=256, steps=3, warmup=1),
    "d": dict(label="gpt2-124m B1 T2048", preset="gpt2-124m", **GPT2, batch=1, seq=2048, steps=3, warmup=1),
}

# What `pip install torch` brings from PyPI on Linux x86-64 that a CPU-only run never loads:
# triton (the GPU compiler), cuSOLVER (only the lazily opened libtorch_cuda_linalg.so needs
# it), the cuda-python bindings, the cuda-toolkit meta package and CUDA C++ headers. The
# other nvidia-* wheels stay: torch's own libraries name them as DT_NEEDED, so `import torch`
# fails without them even on a machine without a GPU.
LEAN_SKIP = {"triton", "nvidia-cusolver", "cuda-bindings", "cuda-pathfinder", "cuda-toolkit",
             "nvidia-cuda-cccl", "nvidia-nvtx"}

NUMPY_PEAK = r"""
import json, os, statistics, sys, time
n, reps = int(sys.argv[1]), int(sys.argv[2])
import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits
threads = int(os.environ["OPENBLAS_NUM_THREADS"])
rng = np.random.default_rng(0)
a = rng.standard_normal((n, n), dtype=np.float32)
b = rng.standard_normal((n, n), dtype=np.float32)
c = np.empty((n, n), dtype=np.float32)
with threadpool_limits(limits=threads, user_api="blas"):
    info = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    np.matmul(a, b, out=c)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); np.matmul(a, b, out=c); ts.append(time.perf_counter() - t0)
med = statistics.median(ts)
print(json.dumps({"n": n, "reps": reps, "median_s": med, "gflops": 2 * n**3 / med / 1e9,
                  "best_gflops": 2 * n**3 / min(ts) / 1e9, "numpy_version": np.__version__,
                  "blas": [{k: i.get(k) for k in ("internal_api", "version", "architecture",
                            "threading_layer", "num_threads", "filepath")} for i in info]}))
"""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def loadavg():
    try:
        with open("/proc/loadavg") as f:
            return [float(x) for x in f.read().split()[:3]]
    except OSError:
        return None


def last_json(text):
    """The last line of `text` that parses as a JSON object."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RuntimeError("no JSON object in output:\n" + text[-2000:])


def cpu_times():
    """(busy, total) CPU jiffies of the whole machine from /proc/stat, or None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    total = sum(v[:8])  # guest time is already inside user/nice
    return total - idle, total


def cpu_busy(interval=1.0):
    """Fraction of all CPUs busy over `interval` seconds (0..1), or None."""
    a = cpu_times()
    time.sleep(interval)
    b = cpu_times()
    if not a or not b or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_idle(max_busy, max_wait):
    """Waits until the machine is at most `max_busy` busy; returns (busy, seconds waited)."""
    t0 = time.time()
    busy = cpu_busy()
    warned = False
    while busy is not None and busy > max_busy and time.time() - t0 < max_wait:
        if not warned:
            log(f"    machine {busy:.0%} busy; waiting up to {max_wait:.0f} s for <= {max_busy:.0%}")
            warned = True
        time.sleep(4)
        busy = cpu_busy()
    if busy is not None and busy > max_busy:
        log(f"    still {busy:.0%} busy after {max_wait:.0f} s; running anyway")
    return busy, time.time() - t0


def run_json(cmd, env, timeout, cwd=ROOT):
    """Runs `cmd`, returns the last JSON object it printed, plus how contended the run was."""
    t0 = time.time()
    c0 = cpu_times()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True, timeout=timeout)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    c1 = cpu_times()
    wall = time.time() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    out = last_json(p.stdout)
    out["_wall_s"] = wall
    if c0 and c1 and c1[1] > c0[1]:
        hz = os.sysconf("SC_CLK_TCK")
        own = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        machine = (c1[0] - c0[0]) / hz
        # CPU time other processes took during the run, as a share of the machine.
        out["_others_cpu_share"] = max(0.0, machine - own) / (wall * (os.cpu_count() or 1))
    return out


# ---------------------------------------------------------------- installing torch and numpy

def torch_ok(py):
    """(True, torch version) when `py` imports torch, numpy and threadpoolctl and can backprop."""
    code = ("import torch, numpy, threadpoolctl; x = torch.randn(8, 8, requires_grad=True); "
            "(x @ x).sum().backward(); print(torch.__version__)")
    try:
        p = subprocess.run([py, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        return False, str(e)
    if p.returncode == 0:
        return True, p.stdout.strip()
    lines = p.stderr.strip().splitlines()
    return False, lines[-1] if lines else f"exit status {p.returncode}"


def pip(py, *args):
    cmd = [py, "-m", "pip", "install", "--disable-pip-version-check", *args]
    log("+ " + " ".join(cmd))
    subprocess.run(cmd, check=True, stdout=sys.stderr)  # stdout is kept for the table and JSON


def install_lean(py, torch_spec):
    """torch --no-deps plus every requirement pip resolves for it except LEAN_SKIP."""
    report = os.path.join(os.path.dirname(os.path.dirname(py)), "torch-resolve.json")
    pip(py, "--dry-run", "--ignore-installed", "--quiet", "--report", report, torch_spec,
        "numpy", "threadpoolctl")
    with open(report) as f:
        items = json.load(f)["install"]
    specs, skipped = [], []
    for it in items:
        name = it["metadata"]["name"].lower().replace("_", "-")
        ver = it["metadata"]["version"]
        (skipped if name in LEAN_SKIP else specs).append(f"{name}=={ver}")
    log("lean install skips: " + ", ".join(skipped))
    pip(py, "--no-deps", *specs)


def ensure_python(args):
    """An interpreter with torch, numpy and threadpoolctl; installs them if needed."""
    if args.python:
        ok, msg = torch_ok(args.python)
        if not ok:
            sys.exit(f"--python {args.python}: cannot import torch/numpy/threadpoolctl: {msg}")
        return args.python
    py = os.path.join(args.venv, "bin", "python")
    if not os.path.exists(py):
        log(f"creating virtual environment {args.venv}")
        subprocess.run([sys.executable, "-m", "venv", args.venv], check=True)
    ok, msg = torch_ok(py)
    if ok:
        return py
    if args.no_install:
        sys.exit(f"{py}: torch/numpy/threadpoolctl missing ({msg}) and --no-install given")
    if args.install == "lean":
        try:
            install_lean(py, args.torch_spec)
            ok, msg = torch_ok(py)
        except subprocess.CalledProcessError as e:
            ok, msg = False, str(e)
        if not ok:
            log(f"lean install does not import ({msg}); falling back to the full install")
    if not ok:
        pip(py, args.torch_spec, "numpy", "threadpoolctl")
        ok, msg = torch_ok(py)
        if not ok:
            sys.exit(f"torch still does not import after installing: {msg}")
    log(f"torch {msg} ready in {args.venv}")
    return py


# ---------------------------------------------------------------- the runs

def kiln_cmd(args, cfg, precision=None):
    c = cfg
    sets = {
        "model.n_layer": c["n_layer"], "model.n_head": c["n_head"], "model.n_embd": c["n_embd"],
        "model.block_size": c["seq"], "model.vocab_size": c["vocab"],
        "model.bias": "true" if c["bias"] else "false", "train.batch_size": c["batch"],
        "train.precision": precision or args.precision,
    }
    cmd = [args.kiln, "bench", "--preset", c["preset"]]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    cmd += ["--steps", str(c["steps"]), "--warmup", str(c["warmup"]), "--threads", str(args.threads), "--json"]
    return cmd + args.kiln_arg


def torch_cmd(py, args, cfg):
    c = cfg
    return [py, TORCH_SCRIPT, "--n-layer", str(c["n_layer"]), "--n-head", str(c["n_head"]),
            "--n-embd", str(c["n_embd"]), "--block-size", str(c["seq"]), "--vocab", str(c["vocab"]),
            "--bias" if c["bias"] else "--no-bias", "--batch", str(c["batch"]),
            "--beta2", str(c["beta2"]), "--steps", str(c["steps"]), "--warmup", str(c["warmup"]),
            "--threads", str(args.threads), "--autocast", "bf16" if args.precision == "bf16" else "none"]


def thread_env(threads):
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "RAYON_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    return env


def numpy_peak(py, threads, n, reps, keep_openblas_env=False):
    env = thread_env(threads)
    removed = {}
    if not keep_openblas_env:
        for var in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
            if var in env:
                removed[var] = env.pop(var)
    out = run_json([py, "-c", NUMPY_PEAK, str(n), str(reps)], env, timeout=600)
    out["unset_env"] = removed
    out["env_openblas"] = {k: v for k, v in env.items() if k.startswith("OPENBLAS_")}
    return out


def cfg_value(config, dotted):
    """Look a key up in kiln's reported config, nested ({"model": {...}}) or flat."""
    if not isinstance(config, dict):
        return None
    if dotted in config:
        return config[dotted]
    sect, _, key = dotted.partition(".")
    if isinstance(config.get(sect), dict) and key in config[sect]:
        return config[sect][key]
    return config.get(key)


def check_same(name, cfg, k, t):
    """Warn when kiln and torch did not run the same model."""
    warnings = []
    kf, tf = k.get("model_flops_per_step"), t.get("model_flops_per_step")
    if kf and tf and abs(kf - tf) > 1e-3 * tf:
        warnings.append(f"model_flops_per_step differs: kiln {kf:.4g} torch {tf:.4g}")
    want = {"model.n_layer": cfg["n_layer"], "model.n_head": cfg["n_head"], "model.n_embd": cfg["n_embd"],
            "model.block_size": cfg["seq"], "model.vocab_size": cfg["vocab"], "model.bias": cfg["bias"],
            "train.batch_size": cfg["batch"]}
    for key, v in want.items():
        got = cfg_value(k.get("config"), key)
        if got is not None and got != v:
            warnings.append(f"kiln {key} = {got!r}, expected {v!r}")
    if k.get("threads") not in (None, t.get("threads")):
        warnings.append(f"threads differ: kiln {k.get('threads')} torch {t.get('threads')}")
    for w in warnings:
        log(f"WARNING [{name}] {w}")
    return warnings


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main():
    ap = argparse.ArgumentParser(description="kiln vs PyTorch eager CPU training speed")
    ap.add_argument("--configs", default="a,b,c,d", help=f"comma list of {','.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=3, help="kiln/torch pairs per config")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=0, help="timed steps per run (0 = per-config default)")
    ap.add_argument("--kiln", default=os.path.join(ROOT, "target", "release", "kiln"))
    ap.add_argument("--kiln-arg", action="append", default=[], help="extra argument for `kiln bench` (repeatable)")
    ap.add_argument("--no-build", action="store_true", help="skip `cargo build --release`")
    ap.add_argument("--no-kiln", action="store_true", help="run only the PyTorch side and the numpy peak")
    ap.add_argument("--no-torch", action="store_true", help="run only the kiln side and the peaks")
    ap.add_argument("--python", help="interpreter that already has torch, numpy and threadpoolctl")
    ap.add_argument("--venv", default=os.environ.get("KILN_BENCH_VENV", DEFAULT_VENV))
    ap.add_argument("--install", choices=["lean", "full"], default="lean",
                    help="lean: skip wheels a CPU run never loads (falls back to full); full: plain pip install torch")
    ap.add_argument("--torch-spec", default="torch", help="pip requirement for torch, e.g. torch==2.15.0")
    ap.add_argument("--no-install", action="store_true")
    ap.add_argument("--peak-n", type=int, default=2048)
    ap.add_argument("--peak-reps", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument("--wait-idle", type=float, default=0.25, metavar="FRACTION",
                    help="before each run wait until at most this share of the CPUs is busy (1 = never wait)")
    ap.add_argument("--max-wait", type=float, default=600, help="seconds to wait for --wait-idle per run")
    ap.add_argument("--max-others", type=float, default=0.10, metavar="FRACTION",
                    help="rerun a run during which other processes used more than this share of the CPUs")
    ap.add_argument("--retries", type=int, default=2, help="reruns allowed per run for --max-others (the least contended is kept)")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: kiln --precision bf16 against PyTorch under torch.autocast('cpu', "
                         "dtype=torch.bfloat16), with kiln fp32 run alongside (kiln_fp32_*)")
    ap.add_argument("--out", help="also write the JSON summary here")
    args = ap.parse_args()

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    for n in names:
        if n not in CONFIGS:
            sys.exit(f"unknown config {n!r}; known: {', '.join(CONFIGS)}")
    configs = {n: dict(CONFIGS[n], **({"steps": args.steps} if args.steps else {})) for n in names}

    py = ensure_python(args)
    if not args.no_kiln and not args.no_build:
        log("+ cargo build --release")
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True, stdout=sys.stderr)
    if not args.no_kiln and not os.path.exists(args.kiln):
        sys.exit(f"{args.kiln} not found (build kiln or pass --kiln)")
    env = thread_env(args.threads)

    summary = {"threads": args.threads, "repeats": args.repeats, "precision": args.precision, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "cpus": os.cpu_count(), "configs": {}, "peak": {}}

    # Peaks first, alternating the two probes like the runs.
    kiln_peaks, np_peaks, kp = [], [], {}
    idle = (lambda: wait_idle(args.wait_idle, args.max_wait)) if args.wait_idle < 1 else (lambda: None)
    for r in range(max(1, min(args.repeats, 3))):
        if not args.no_kiln:
            idle()
            kp = run_json([args.kiln, "bench", "--peak", "--threads", str(args.threads), "--json"], env, args.timeout)
            kiln_peaks.append(kp.get("peak_gflops"))
        idle()
        npk = numpy_peak(py, args.threads, args.peak_n, args.peak_reps)
        np_peaks.append(npk["gflops"])
    idle()
    npk_env = numpy_peak(py, args.threads, args.peak_n, max(3, args.peak_reps // 2), keep_openblas_env=True)
    summary["peak"] = {
        "kiln_peak_gflops": med(kiln_peaks), "kiln_peak_gflops_all": kiln_peaks,
        "kiln_peak_products": kp.get("products"),
        "numpy_sgemm_gflops": med(np_peaks), "numpy_sgemm_gflops_all": np_peaks,
        "numpy_sgemm_n": args.peak_n, "numpy_blas": npk["blas"], "numpy_version": npk["numpy_version"],
        "numpy_unset_env": npk["unset_env"],
        "numpy_sgemm_gflops_with_env_as_is": npk_env["gflops"], "numpy_blas_with_env_as_is": npk_env["blas"],
    }
    blas = npk["blas"][0] if npk["blas"] else {}
    log(f"peak: kiln {fmt(summary['peak']['kiln_peak_gflops'], '.1f')} GFLOP/s, numpy sgemm {med(np_peaks):.1f} GFLOP/s "
        f"({blas.get('internal_api')} {blas.get('version')} {blas.get('architecture')}, {blas.get('num_threads')} threads; "
        f"with {npk['unset_env'] or 'nothing'} unset), as-is env: {npk_env['gflops']:.1f} GFLOP/s "
        f"({(npk_env['blas'] or [{}])[0].get('architecture')})")

    for name, cfg in configs.items():
        impls = ("kiln", "torch") + (("kiln-fp32",) if args.precision != "fp32" else ())
        runs = {i: [] for i in impls}
        for r in range(args.repeats):
            for impl in impls:
                if (impl.startswith("kiln") and args.no_kiln) or (impl == "torch" and args.no_torch):
                    continue
                cmd = {"kiln": lambda: kiln_cmd(args, cfg), "torch": lambda: torch_cmd(py, args, cfg),
                       "kiln-fp32": lambda: kiln_cmd(args, cfg, "fp32")}[impl]()
                best = None
                for attempt in range(1 + args.retries):
                    busy, waited = wait_idle(args.wait_idle, args.max_wait) if args.wait_idle < 1 else (None, 0)
                    la = loadavg()
                    log(f"[{name} {r + 1}/{args.repeats}] {impl}: {' '.join(cmd)}  (load {la})")
                    res = run_json(cmd, env, args.timeout)
                    others = res.get("_others_cpu_share") or 0.0
                    res.update(_load_before=la, _busy_before=busy, _waited_s=waited, _attempt=attempt + 1)
                    log(f"    median {res['step_ms']['median']:.1f} ms/step, {res['tokens_per_sec']:.0f} tok/s, "
                        f"other processes used {others:.0%} of the CPUs meanwhile")
                    if best is None or others < (best.get("_others_cpu_share") or 0.0):
                        best = res
                    if others <= args.max_others:
                        break
                    if attempt < args.retries:
                        log(f"    above --max-others {args.max_others:.0%}: running it again")
                runs[impl].append(best)
        k, t = runs["kiln"], runs["torch"]
        pairs = [a["tokens_per_sec"] / b["tokens_per_sec"] for a, b in zip(k, t)]
        entry = {
            "label": cfg["label"],
            "shape": {x: cfg[x] for x in ("n_layer", "n_head", "n_embd", "vocab", "bias", "batch", "seq")},
            "timed_steps": cfg["steps"],
            "kiln_tokens_per_sec": med([x["tokens_per_sec"] for x in k]),
            "torch_tokens_per_sec": med([x["tokens_per_sec"] for x in t]),
            "kiln_step_ms": med([x["step_ms"]["median"] for x in k]),
            "torch_step_ms": med([x["step_ms"]["median"] for x in t]),
            "ratio_kiln_over_torch": med(pairs),
            "ratio_pairs": pairs,
            "kiln_mfu": med([x.get("mfu") for x in k]),
            "kiln_achieved_gflops": med([x.get("achieved_gflops") for x in k]),
            "torch_achieved_gflops": med([x.get("achieved_gflops") for x in t]),
            "model_flops_per_step": (t or k)[0].get("model_flops_per_step") if (t or k) else None,
            "kiln_peak_rss_bytes": max([x.get("peak_rss_bytes") or 0 for x in k], default=None),
            "torch_peak_rss_bytes": max([x.get("peak_rss_bytes") or 0 for x in t], default=None),
            "torch_version": t[0].get("torch_version") if t else None,
            "warnings": check_same(name, cfg, k[0], t[0]) if k and t else [],
            "max_others_cpu_share": max([x.get("_others_cpu_share") or 0 for x in k + t], default=None),
            "runs": runs,
        }
        if runs.get("kiln-fp32"):
            f = runs["kiln-fp32"]
            entry["kiln_fp32_tokens_per_sec"] = med([x["tokens_per_sec"] for x in f])
            entry["ratio_kiln_over_kiln_fp32"] = med([a["tokens_per_sec"] / b["tokens_per_sec"] for a, b in zip(k, f)])
            entry["kiln_fp32_peak_rss_bytes"] = max([x.get("peak_rss_bytes") or 0 for x in f], default=None)
        if entry["torch_achieved_gflops"] and summary["peak"]["numpy_sgemm_gflops"]:
            entry["torch_mfu_vs_numpy_peak"] = entry["torch_achieved_gflops"] / summary["peak"]["numpy_sgemm_gflops"]
        summary["configs"][name] = entry

    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print_table(summary)
    text = json.dumps(summary, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    # The compact summary (without the per-run records) goes last on stdout.
    compact = json.loads(text)
    for e in compact["configs"].values():
        e.pop("runs", None)
    print(json.dumps(compact))


def fmt(x, spec):
    """`x` formatted with `spec`, or a dash as wide as the spec's width when there is no value."""
    if isinstance(x, (int, float)):
        return format(x, spec)
    width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
    return "-".rjust(int(width) if width else 1)


def print_table(s):
    p = s["peak"]
    print(f"precision {s['precision']} (torch: {'bf16 autocast' if s['precision'] == 'bf16' else 'fp32 eager'}); "
          f"threads {s['threads']}, {s['repeats']} repeats, medians; fp32 peak: kiln {fmt(p['kiln_peak_gflops'], '.1f')} "
          f"GFLOP/s, numpy sgemm {fmt(p['numpy_sgemm_gflops'], '.1f')} GFLOP/s")
    hdr = f"{'config':<4} {'shape':<26} {'kiln ms':>10} {'torch ms':>10} {'kiln tok/s':>11} {'torch tok/s':>11} {'kiln/torch':>10} {'others':>6}  {'pairs'}"
    print(hdr)
    print("-" * len(hdr))
    for name, e in s["configs"].items():
        pairs = " ".join(f"{x:.2f}" for x in e["ratio_pairs"])
        print(f"{name:<4} {e['label']:<26} {fmt(e['kiln_step_ms'], '10.1f')} {fmt(e['torch_step_ms'], '10.1f')} "
              f"{fmt(e['kiln_tokens_per_sec'], '11.0f')} {fmt(e['torch_tokens_per_sec'], '11.0f')} "
              f"{fmt(e['ratio_kiln_over_torch'], '10.2f')} {fmt(e['max_others_cpu_share'], '6.0%')}  {pairs}")
        if e.get("kiln_fp32_tokens_per_sec"):
            print(f"     kiln fp32 {e['kiln_fp32_tokens_per_sec']:.0f} tok/s: kiln {s['precision']} / kiln fp32 "
                  f"{e['ratio_kiln_over_kiln_fp32']:.2f}; peak RSS kiln {s['precision']} {(e['kiln_peak_rss_bytes'] or 0) / 2**20:.0f} MiB, "
                  f"kiln fp32 {(e['kiln_fp32_peak_rss_bytes'] or 0) / 2**20:.0f} MiB, torch {(e['torch_peak_rss_bytes'] or 0) / 2**20:.0f} MiB")
        for w in e["warnings"]:
            print(f"     WARNING: {w}")


if __name__ == "__main__":
    main()
