"""kiln's fine-tune of a Hugging Face model against transformers + torch.optim.AdamW, step for step.

usage: python bench/compare_hf.py FIXTURE_DIR [FIXTURE_DIR ...] [--steps 30] [--kiln target/release/kiln]
                                  [--data ../shared/data/tinyshakespeare.txt] [--tol 1e-5]
                                  [--optimizer adamw|lion|muon|adafactor] [--set KEY=VALUE ...]
                                  [--objective lm|dpo|ipo|simpo --data PREFERENCES.jsonl]
                                  [--objective grpo --data PROMPTS.jsonl --set grpo.group=2 ...]

For each model directory: `kiln train --init-from DIR` runs N steps with `train.record_batches` (each step's
token windows and learning rate go to RUN/batches.jsonl) and a loss/grad-norm line every step. The same
model is then loaded with transformers in fp32 (eager attention) and trained on exactly those windows and
learning rates with torch.optim.AdamW and the same decay groups (matrices decay; embeddings, the MoE router,
norms and biases do not), betas, eps, weight decay and global-norm clipping. Prints one JSON line per model and exits
1 if any step's loss or gradient norm differs by more than --tol relative.

`--optimizer adafactor` replays it with `torch.optim.Adafactor` (PyTorch >= 2.5; its decay groups as AdamW's), and
`--optimizer lion` with lion-pytorch's `Lion` (`pip install lion-pytorch`; kiln's train.beta1/beta2
are its betas). `--optimizer muon` with `torch.optim.Muon` (PyTorch >= 2.9) on the matrices kiln gives Muon (2-D,
decaying, not the head) at optim.muon_lr on train.lr's schedule, and AdamW on the rest; Muon's hyper-parameters are
read from the run's config.toml, so `--set optim.muon_adjust_lr=match_rms_adamw` and the like are compared as set;
with `--set optim.muon_ns_precision=fp32` torch's Newton-Schulz runs in fp32 too (the same code, another dtype).
Muon's parity needs `[out, in]` weights (LLaMA-family fixtures): transformers' GPT-2 stores its `Conv1D` weights
transposed, which changes the shape adjustment, and Mixtral's experts are 3-D.

`--objective dpo|ipo|simpo` trains on preference rows (`--data`: jsonl of prompt/chosen/rejected) with that loss:
each recorded step's rows are pairs (chosen, then rejected), and the reference is a frozen copy of the model as
loaded, in eval mode. Each row's log-probability is the sum of its completion tokens' log-softmax at their targets
(the mean for ipo and simpo), and the pair losses are TRL's (`DPOTrainer.dpo_loss`, `CPOTrainer`'s simpo), written
out here in torch with kiln's `[preference]` keys read from the run's config.toml; the step's loss is their mean.
Step 1 is the fixed-batch check (the loss and gradient norm of one batch); every later step checks the training.
`--objective grpo` replays kiln's sampled completions (recorded with their advantages) through TRL's GRPO loss written
out in torch: the ratio against the detached log-probabilities (one optimiser step per batch of completions), the
clipped term, the k3 KL to the frozen reference when grpo.beta > 0, and the grpo or dr_grpo aggregation.

The tokenizer is the directory's own tokenizer.json, else `char` (tinyshakespeare's 65 characters fit every
fixture's vocabulary). Needs torch and transformers (`pip install torch transformers`).
"""
import argparse, json, os, subprocess, sys, tempfile

import torch
from transformers import AutoModelForCausalLM


def kiln_run(kiln, model_dir, data, steps, out, extra):
    args = [kiln, "train", "--init-from", model_dir, "--data", data, "--out", out, "--max-steps", str(steps),
            "--seq-len", "24", "--set", "train.batch_size=4", "--set", "train.grad_accum=1", "--set", "train.log_interval=1",
            "--set", "train.record_batches=true", "--set", "train.lr=1e-3", "--set", "train.min_lr=1e-4",
            "--set", "train.warmup_steps=5", "--set", "model.dropout=0.0", "--set", "eval.interval=0",
            "--set", "eval.iters=1", "--set", "sample.tokens=0", "--set", "checkpoint.interval=0", "--quiet"] + extra
    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        args += ["--tokenizer", "char"]
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    metrics = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    train = {m["step"]: m for m in metrics if m.get("kind") == "train"}
    batches = [json.loads(l) for l in open(os.path.join(out, "batches.jsonl"))]
    cfg = open(os.path.join(out, "config.toml")).read()
    return train, batches, cfg


def toml_value(cfg, section, key, kind=float):
    sec = None
    for line in cfg.splitlines():
        line = line.strip()
        if line.startswith("["):
            sec = line.strip("[]")
        elif sec == section and line.startswith(key + " ="):
            v = line.split("=", 1)[1].strip()
            return v.strip('"') if kind is str else (v == "true" if kind is bool else kind(v))
    raise KeyError(f"{section}.{key}")


def optimizers(named, cfg):
    """The run's optimizer over `named` (name, parameter) pairs, as kiln's config.toml sets it: a list of
    (optimizer, learning-rate multiplier of the recorded schedule) pairs."""
    get = lambda k: toml_value(cfg, "train", k)
    name = toml_value(cfg, "optim", "name", str)
    decay, no_decay, matrices = [], [], []
    for n, p in named:
        # Matrices decay (transformers 5 stores Mixtral's experts as one 3-D tensor each) but
        # embeddings and, as in kiln's layout, the MoE router.
        router = n.endswith("block_sparse_moe.gate.weight") or n.endswith("mlp.gate.weight")
        decays = p.ndim >= 2 and not router and "embed" not in n and "wte" not in n and "wpe" not in n
        if name == "muon" and decays and p.ndim == 2 and not n.endswith("lm_head.weight"):
            matrices.append(p)
        else:
            (decay if decays else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": get("weight_decay")}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adafactor":
        o = lambda k: toml_value(cfg, "optim", k)
        return [(torch.optim.Adafactor(groups, lr=get("lr"), beta2_decay=o("adafactor_beta2_decay"), eps=(None, o("adafactor_eps2")),
                                       d=o("adafactor_d"), foreach=False), 1.0)]
    if name == "lion":
        from lion_pytorch import Lion
        return [(Lion(groups, lr=get("lr"), betas=(get("beta1"), get("beta2"))), 1.0)]
    out = [(torch.optim.AdamW(groups, lr=get("lr"), betas=(get("beta1"), get("beta2")), eps=get("eps"), foreach=False), 1.0)]
    if name == "muon":
        o = lambda k, kind=float: toml_value(cfg, "optim", k, kind)
        if o("muon_ns_precision", str) == "fp32":
            fp32_newton_schulz()
        muon = torch.optim.Muon(matrices, lr=o("muon_lr"), weight_decay=get("weight_decay"), momentum=o("muon_momentum"),
                                nesterov=o("muon_nesterov", bool), ns_steps=o("muon_ns_steps", int), adjust_lr_fn=o("muon_adjust_lr", str))
        out.append((muon, o("muon_lr") / get("lr")))
    return out


def fp32_newton_schulz():
    """torch.optim.Muon's Newton-Schulz iteration, unchanged but in fp32 instead of bf16 (for
    optim.muon_ns_precision = fp32: two bf16 iterations agree only to bf16's precision, as their
    products' fp32 sums round differently, and the iteration spreads each difference)."""
    import torch.optim._muon as muon

    def ns(grad, coefs, steps, eps):
        a, b, c = coefs
        x = grad.to(dtype=torch.float32, copy=True)
        tall = grad.size(0) > grad.size(1)
        if tall:
            x = x.T
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        return x.T if tall else x

    muon._zeropower_via_newtonschulz = ns


def row_logps(model, x, y, average):
    """Each row's log-probability of its counted targets: summed, or averaged over them."""
    logits = model(input_ids=x).logits
    mask = y != -100
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    lp = (lp * mask).sum(-1)
    return lp / mask.sum(-1) if average else lp


def pair_loss(kind, cfg, model, ref, x, y):
    """TRL's preference losses over rows (chosen, rejected, chosen, ...), their mean over the pairs."""
    p = lambda k: toml_value(cfg, "preference", k)
    beta, eps, gamma = p("beta"), p("label_smoothing"), p("simpo_gamma")
    average = kind != "dpo"
    pol = row_logps(model, x, y, average)
    pc, pr = pol[0::2], pol[1::2]
    F = torch.nn.functional
    if kind == "simpo":
        z = beta * (pc - pr) - gamma
        losses = -F.logsigmoid(z) * (1 - eps) - F.logsigmoid(-z) * eps
    else:
        with torch.no_grad():
            r = row_logps(ref, x, y, average)
        h = (pc - r[0::2]) - (pr - r[1::2])
        if kind == "dpo":
            losses = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
        else:
            losses = (h - 1 / (2 * beta)) ** 2
    return losses.mean()


def grpo_loss(cfg, model, ref, x, y, adv):
    """TRL's GRPO loss over completions (rows), one optimiser step per batch: old = current, detached."""
    g = lambda k, kind=float: toml_value(cfg, "grpo", k, kind)
    eps_low, eps_high, beta, kind = g("epsilon"), g("epsilon_high"), g("beta"), g("loss", str)
    logits = model(input_ids=x).logits
    mask = (y != -100).float()
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(lp - lp.detach())
    a = adv.unsqueeze(-1)
    per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    if beta > 0:
        with torch.no_grad():
            rl = torch.log_softmax(ref(input_ids=x).logits.float(), dim=-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        per_token = per_token + beta * (torch.exp(rl - lp) - (rl - lp) - 1)
    if kind == "dr_grpo":
        return (per_token * mask).sum() / (x.shape[0] * g("max_new_tokens", int))
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def torch_run(model_dir, batches, cfg, objective="lm"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ref = None
    if objective != "lm":
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
        for q in ref.parameters():
            q.requires_grad_(False)
    model.train()
    opts = optimizers(list(model.named_parameters()), cfg)
    get = lambda k: toml_value(cfg, "train", k)
    clip = get("grad_clip")
    params = [p for p in model.parameters()]
    out = []
    for b in batches:
        # RUN/batches.jsonl: each row's input window and its targets (-100 where none counts).
        x = torch.tensor(b["inputs"], dtype=torch.long)
        y = torch.tensor(b["targets"], dtype=torch.long)
        if objective == "lm":
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        elif objective == "grpo":
            loss = grpo_loss(cfg, model, ref, x, y, torch.tensor(b["advantages"], dtype=torch.float32))
        else:
            loss = pair_loss(objective, cfg, model, ref, x, y)
        model.zero_grad(set_to_none=True)
        loss.backward()
        # The global norm in float64 (torch's clip_grad_norm_ sums squares in fp32, which over a
        # 150k-row embedding is off by ~1e-5 relative; kiln accumulates in f64), then the same clip.
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params if p.grad is not None))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        for opt, mult in opts:
            for g in opt.param_groups:
                g["lr"] = b["lr"] * mult
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
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "lion", "muon", "adafactor"])
    ap.add_argument("--set", action="append", default=[], help="a further kiln config key, KEY=VALUE")
    ap.add_argument("--objective", default="lm", choices=["lm", "dpo", "ipo", "simpo", "grpo"])
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    ok = True
    for d in a.dirs:
        with tempfile.TemporaryDirectory() as tmp:
            extra = ["--set", f"optim.name={a.optimizer}", "--objective", a.objective] + [x for kv in a.set for x in ("--set", kv)]
            train, batches, cfg = kiln_run(a.kiln, d, a.data, a.steps, os.path.join(tmp, "run"), extra)
        ref = torch_run(d, batches, cfg, a.objective)
        worst_loss = worst_norm = 0.0
        for step, loss, norm in ref:
            k = train[step]
            # (GRPO's loss at one step per batch is about 0, its advantages zero-mean: absolute there.)
            worst_loss = max(worst_loss, abs(k["loss"] - loss) / max(abs(loss), 1e-2))
            # (A step whose gradient is zero in exact arithmetic, as GRPO's first with no advantage,
            # has a norm of rounding noise: absolute below 1e-6.)
            worst_norm = max(worst_norm, abs(k["grad_norm"] - norm) / max(abs(norm), 1e-6))
        passed = worst_loss <= a.tol and worst_norm <= a.tol
        ok &= passed
        print(json.dumps({"model": os.path.basename(os.path.normpath(d)), "optimizer": a.optimizer, "objective": a.objective, "steps": len(ref), "max_rel_loss": worst_loss,
                          "max_rel_grad_norm": worst_norm, "first_loss": ref[0][1], "last_loss": ref[-1][1], "pass": passed}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
