#!/usr/bin/env bash
# One prepared check of kiln on a machine with an NVIDIA GPU, PyTorch and python3, and no Rust and
# no network: a kiln binary built elsewhere (`cargo build --release --features cuda`) is carried
# in as a file. It writes one JSON summary (--out) and finishes within 8 minutes:
#   1. `kiln doctor --check-kernels --device cuda`: every kernel against its CPU twin on the GPU;
#   2. 200 steps of `shakespeare-char` on the CPU and on CUDA: fp32 within 1e-4 of the CPU,
#      bf16 within 2e-2 of fp32;
#   3. the parallel layouts one GPU can host, ranks sharing it: dp 2 under ZeRO-3, tp 2 with
#      sequence parallelism, pp 2 under 1F1B, and dp 2 with its gradients all-reduced by NCCL
#      on the GPU (parallel.nccl), each within 1e-4 of the one-rank run;
#   4. GPT-2 124M in bf16, batch 16 × 1024: kiln's tokens/s and MFU against the GPU's dense bf16
#      peak; beside it, in the same run and on the same GPU, PyTorch eager bf16 and
#      torch.compile on the same model and batch (scripts/torch_gpt2.py).
# When the system has no CUDA libraries, LD_LIBRARY_PATH is set from PyTorch's
# site-packages/nvidia/*/lib.
#
# --dry-run runs every step with --device vulkan at tiny shapes (lavapipe in CI), and without
# PyTorch if it is absent: the plumbing, not the figures.
#
# usage: scripts/gpu_check.sh [--dry-run] [--kiln PATH] [--out FILE] [--data FILE]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dry=0
kiln=""
out=gpu_check.json
data=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --kiln) kiln=$2; shift ;;
        --out) out=$2; shift ;;
        --data) data=$2; shift ;;
        *) echo "gpu_check.sh: unknown argument $1 (usage: [--dry-run] [--kiln PATH] [--out FILE] [--data FILE])" >&2; exit 2 ;;
    esac
    shift
done
if [ -z "$kiln" ]; then
    for k in ./kiln "$here/../target/release/kiln"; do
        [ -x "$k" ] && kiln=$k && break
    done
fi
[ -x "$kiln" ] || { echo "gpu_check.sh: no kiln binary (pass --kiln PATH)" >&2; exit 2; }
py=python3
[ -x /opt/torch/.venv/bin/python3 ] && py=/opt/torch/.venv/bin/python3

if [ $dry -eq 1 ]; then
    device=vulkan
    steps=10
    shape=(--set model.block_size=32 --set train.batch_size=2)
    bench=(--preset shakespeare-char --set model.vocab_size=65 --set train.batch_size=2 --set model.block_size=32 --steps 2 --warmup 1)
    torch_args=(--device cpu --batch 2 --seq 32 --steps 2 --warmup 1 --layers 2 --heads 2 --embd 32 --vocab 65 --no-compile)
    limits=(120 60 120 120)
    layout_steps=6
    layout_shape=(--set model.block_size=32 --set train.batch_size=4)
else
    device=cuda
    steps=200
    shape=()
    bench=(--preset gpt2-124m --set model.vocab_size=50257 --set train.batch_size=16 --set model.block_size=1024 --steps 10 --warmup 2)
    torch_args=(--device cuda --batch 16 --seq 1024 --steps 10 --warmup 3)
    limits=(60 60 100 120)
    layout_steps=50
    layout_shape=()
fi

# The CUDA libraries from PyTorch's wheels when the system has none.
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so'; then
    libs=$($py -c "import nvidia, glob, os; print(':'.join(sorted(glob.glob(os.path.join(list(nvidia.__path__)[0], '*', 'lib')))))" 2>/dev/null || true)
    [ -n "$libs" ] && export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$data" ]; then
    # No corpus on the machine: Python's own standard library sources, the first 1 MB.
    data=$work/data.txt
    $py -c "import glob, os, sysconfig; fs = sorted(glob.glob(os.path.join(sysconfig.get_paths()['stdlib'], '*.py'))); print(''.join(open(f, errors='replace').read() for f in fs)[:1000000])" > "$data"
fi

t_start=$(date +%s)
# Step 1: the kernels against their CPU twins, from inside the binary.
timeout "${limits[0]}" "$kiln" doctor > "$work/doctor.txt" 2>&1
timeout "${limits[0]}" "$kiln" doctor --check-kernels --device $device > "$work/check.txt" 2>&1
echo $? > "$work/check.rc"

# Step 2: shakespeare-char on the CPU and on the device, fp32 and bf16.
train() {
    local name=$1 dev=$2 prec=$3
    local t0
    t0=$(date +%s%N)
    timeout "${limits[1]}" "$kiln" train --preset shakespeare-char --data "$data" --out "$work/$name" --device "$dev" --precision "$prec" \
        --max-steps $steps "${shape[@]}" --quiet --set train.log_interval=1 --set eval.interval=0 --set eval.iters=2 --set sample.tokens=0 > "$work/$name.log" 2>&1
    echo "$? $(( ($(date +%s%N) - t0) / 1000000 ))" > "$work/$name.rc"
}
train cpu cpu fp32
train dev-fp32 $device fp32
train dev-bf16 $device bf16

# Step 3: the layouts on the one device (rank r takes device r modulo the devices found),
# against one rank, two micro-batches a step.
layout() {
    local name=$1
    shift
    timeout "${limits[1]}" "$kiln" train --preset shakespeare-char --data "$data" --out "$work/$name" --device $device \
        --max-steps $layout_steps "${layout_shape[@]}" --quiet --set train.grad_accum=2 --set train.log_interval=1 --set eval.interval=0 \
        --set eval.iters=2 --set sample.tokens=0 "$@" > "$work/$name.log" 2>&1
    echo "$?" > "$work/$name.rc"
}
layout one-rank
layout dp2-zero3 --dp 2 --zero 3
layout tp2-sp --tp 2 --sequence-parallel
layout pp2-1f1b --pp 2 --schedule 1f1b
layout cp2-ring --cp 2
layouts="dp2-zero3 tp2-sp pp2-1f1b cp2-ring"
if [ $dry -eq 0 ]; then
    # NCCL from PyTorch's wheel when the system has none: the loader looks for libnccl.so.
    if ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so '; then
        nccl=$($py -c "import nvidia, glob, os; print((glob.glob(os.path.join(list(nvidia.__path__)[0], '*', 'lib', 'libnccl.so.2')) + [''])[0])" 2>/dev/null || true)
        if [ -n "$nccl" ]; then
            mkdir -p "$work/nccl" && ln -sf "$nccl" "$work/nccl/libnccl.so"
            export LD_LIBRARY_PATH="$work/nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    fi
    layout dp2-nccl --dp 2 --set parallel.nccl=true
    layouts="$layouts dp2-nccl"
fi

# Step 4: GPT-2 124M (tiny in the dry run) in bf16: kiln, then PyTorch on the same batch.
timeout "${limits[2]}" "$kiln" bench "${bench[@]}" --set train.precision=bf16 --device $device --json > "$work/bench.json" 2> "$work/bench.err"
echo $? > "$work/bench.rc"
timeout "${limits[3]}" $py "$here/torch_gpt2.py" "${torch_args[@]}" > "$work/torch.json" 2> "$work/torch.err"
echo $? > "$work/torch.rc"

DRY=$dry DEVICE=$device STEPS=$steps LAYOUT_STEPS=$layout_steps LAYOUTS="$layouts" ELAPSED=$(( $(date +%s) - t_start )) $py - "$work" "$out" <<'PY'
import json, os, sys
work, out = sys.argv[1], sys.argv[2]
def text(name):
    try:
        return open(os.path.join(work, name)).read()
    except OSError:
        return ""
def losses(name):
    rows = [json.loads(l) for l in text(f"{name}/metrics.jsonl").splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}
def worst(a, b):
    steps = sorted(set(a) & set(b))
    return max((abs(a[s] - b[s]) / abs(a[s]) for s in steps), default=None), len(steps)
summary = {"dry_run": os.environ["DRY"] == "1", "device": os.environ["DEVICE"], "elapsed_s": int(os.environ["ELAPSED"])}
summary["doctor"] = [l for l in text("doctor.txt").splitlines() if l.startswith(("gpus:", "cuda:", "cpu", "kiln"))]
check = text("check.txt").splitlines()
summary["check_kernels"] = {"ok": text("check.rc").strip() == "0", "kernels": sum(l.startswith("ok ") for l in check), "tail": check[-3:]}
runs = {}
for name in ["cpu", "dev-fp32", "dev-bf16"]:
    rc, ms = (text(f"{name}.rc").split() + ["?", "?"])[:2]
    runs[name] = {"ok": rc == "0", "seconds": int(ms) / 1000 if ms.isdigit() else None, "steps": len(losses(name)), "log_tail": text(f"{name}.log").splitlines()[-2:]}
cpu, f32, b16 = losses("cpu"), losses("dev-fp32"), losses("dev-bf16")
e32, n32 = worst(cpu, f32)
e16, n16 = worst(f32, b16)
steps = int(os.environ["STEPS"])
summary["shakespeare_char"] = {
    "steps": steps, "runs": runs,
    "fp32_vs_cpu_max_rel": e32, "fp32_within_1e-4": e32 is not None and n32 == steps and e32 <= 1e-4,
    "bf16_vs_fp32_max_rel": e16, "bf16_within_2e-2": e16 is not None and n16 == steps and e16 <= 2e-2,
}
one = losses("one-rank")
layouts = {}
for name in os.environ["LAYOUTS"].split():
    e, n = worst(one, losses(name))
    layouts[name] = {"ok": text(f"{name}.rc").strip() == "0", "steps": n, "max_rel_vs_one_rank": e, "log_tail": text(f"{name}.log").splitlines()[-2:]}
    layouts[name]["within_1e-4"] = layouts[name]["ok"] and e is not None and n == int(os.environ["LAYOUT_STEPS"]) and e <= 1e-4
summary["layouts_on_one_device"] = layouts
# Dense bf16 peaks (NVIDIA's datasheets, without sparsity), by the name the driver reports.
PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}
bench = {}
try:
    b = json.loads(text("bench.json"))
    flops_per_token = b["model_flops_per_step"] / b["tokens_per_step"]
    name = b.get("adapter") or ""
    peak = next((v for k, v in PEAKS.items() if k in name), None)
    bench = {"ok": True, "adapter": name, "tokens_per_sec": b["tokens_per_sec"], "flops_per_token": flops_per_token,
             "mfu_vs_device_measured_peak": b.get("mfu"), "host_device_bytes_per_step": b.get("host_device_bytes_per_step"),
             "dense_bf16_peak_flops": peak, "mfu_vs_dense_bf16_peak": b["tokens_per_sec"] * flops_per_token / peak if peak else None}
except (ValueError, KeyError) as e:
    bench = {"ok": False, "error": f"{type(e).__name__}: {e}", "stderr": text("bench.err").splitlines()[-3:]}
summary["gpt2_kiln"] = bench
try:
    t = json.loads(text("torch.json"))
    if "absent" not in t and bench.get("ok"):
        for k in ("eager_bf16", "compile_bf16"):
            if "tokens_per_sec" in t.get(k, {}):
                t[k]["kiln_over_this"] = bench["tokens_per_sec"] / t[k]["tokens_per_sec"]
                if bench.get("dense_bf16_peak_flops"):
                    t[k]["mfu_vs_dense_bf16_peak"] = t[k]["tokens_per_sec"] * bench["flops_per_token"] / bench["dense_bf16_peak_flops"]
    summary["gpt2_pytorch"] = t
except ValueError as e:
    summary["gpt2_pytorch"] = {"error": f"{e}", "stderr": text("torch.err").splitlines()[-3:]}
summary["ok"] = summary["check_kernels"]["ok"] and summary["shakespeare_char"]["fp32_within_1e-4"] and summary["shakespeare_char"]["bf16_within_2e-2"] and all(l["within_1e-4"] for l in layouts.values()) and bench.get("ok", False)
json.dump(summary, open(out, "w"), indent=1)
print(json.dumps({"ok": summary["ok"], "out": out, "elapsed_s": summary["elapsed_s"]}))
PY
