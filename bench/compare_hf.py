"""kiln's fine-tune of a Hugging Face model against transformers + torch.optim.AdamW, step for step.

usage: python bench/compare_hf.py FIXTURE_DIR [FIXTURE_DIR ...] [--steps 30] [--kiln target/release/kiln]
                                  [--data ../shared/data/tinyshakespeare.txt] [--tol 1e-5]

For each model directory: `kiln train --init-from DIR` runs N steps with `train.record_batches` (each step's
token windows and learning rate go to RUN/batches.jsonl) and a loss/grad-norm line every step. The same
model is then loaded with transformers in fp32 (eager attention) and trained on exactly those windows and
learning rates with torch.optim.AdamW and the same decay groups (matrices decay; embeddings, the MoE router,
norms and biases do not), betas, eps, weight decay and global-norm clipping. Prints one JSON line per model and exits
1 if any step's loss or gradient norm differs by more than --tol relative.

The tokenizer is the directory's own tokenizer.json, else `char` (tinyshakespeare's 65 characters fit every
fixture's vocabulary). Needs torch and transformers (`pip install torch transformers`).
"""
import argparse, json, os, subprocess, sys, tempfile

import torch
from transformers import AutoModelForCausalLM


def kiln_run(kiln, model_dir, data, steps, out):
    args = [kiln, "train", "--init-from", model_dir, "--data", data, "--out", out, "--max-steps", str(steps),
            "--seq-len", "24", "--set", "train.batch_size=4", "--set", "train.grad_accum=1", "--set", "train.log_interval=1",
            "--set", "train.record_batches=true", "--set", "train.lr=1e-3", "--set", "train.min_lr=1e-4",
            "--set", "train.warmup_steps=5", "--set", "model.dropout=0.0", "--set", "eval.interval=0",
            "--set", "eval.iters=1", "--set", "sample.tokens=0", "--set", "checkpoint.interval=0", "--quiet"]
    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        args += ["--tokenizer", "char"]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    metrics = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    train = {m["step"]: m for m in metrics if m.get("kind") == "train"}
    batches = [json.loads(l) for l in open(os.path.join(out, "batches.jsonl"))]
    cfg = open(os.path.join(out, "config.toml")).read()
    return train, batches, cfg


def toml_value(cfg, section, key):
    sec = None
    for line in cfg.splitlines():
        line = line.strip()
        if line.startswith("["):
            sec = line.strip("[]")
        elif sec == section and line.startswith(key + " ="):
            return float(line.split("=", 1)[1])
    raise KeyError(f"{section}.{key}")


def torch_run(model_dir, batches, cfg):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        # Matrices decay (transformers 5 stores Mixtral's experts as one 3-D tensor each) but
        # embeddings and, as in kiln's layout, the MoE router.
        router = name.endswith("block_sparse_moe.gate.weight") or name.endswith("mlp.gate.weight")
        (decay if p.ndim >= 2 and not router and "embed" not in name and "wte" not in name and "wpe" not in name else no_decay).append(p)
    get = lambda k: toml_value(cfg, "train", k)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": get("weight_decay")}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=get("lr"), betas=(get("beta1"), get("beta2")), eps=get("eps"), foreach=False)
    clip = get("grad_clip")
    params = [p for p in model.parameters()]
    out = []
    for b in batches:
        # RUN/batches.jsonl: each row's input window and its targets (-100 where none counts).
        x = torch.tensor(b["inputs"], dtype=torch.long)
        y = torch.tensor(b["targets"], dtype=torch.long)
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # The global norm in float64 (torch's clip_grad_norm_ sums squares in fp32, which over a
        # 150k-row embedding is off by ~1e-5 relative; kiln accumulates in f64), then the same clip.
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for g in opt.param_groups:
            g["lr"] = b["lr"]
        opt.step()
        out.append((b["step"], loss.item(), norm.item()))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--data", default=os.path.join(os.path.dirname(__file__), "../../shared/data/tinyshakespeare.txt"))
    ap.add_argument("--tol", type=float, default=1e-5)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ok = True
    for d in a.dirs:
        with tempfile.TemporaryDirectory() as tmp:
            train, batches, cfg = kiln_run(a.kiln, d, a.data, a.steps, os.path.join(tmp, "run"))
        ref = torch_run(d, batches, cfg)
        worst_loss = worst_norm = 0.0
        for step, loss, norm in ref:
            k = train[step]
            worst_loss = max(worst_loss, abs(k["loss"] - loss) / abs(loss))
            worst_norm = max(worst_norm, abs(k["grad_norm"] - norm) / abs(norm))
        passed = worst_loss <= a.tol and worst_norm <= a.tol
        ok &= passed
        print(json.dumps({"model": os.path.basename(os.path.normpath(d)), "steps": len(ref), "max_rel_loss": worst_loss,
                          "max_rel_grad_norm": worst_norm, "first_loss": ref[0][1], "last_loss": ref[-1][1], "pass": passed}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
