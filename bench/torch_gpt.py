#!/usr/bin/env python3
"""PyTorch eager reference for `kiln bench`: the same GPT-2 model, optimizer and step.

The model is nanoGPT's GPT as kiln builds it (crates/model): pre-LN blocks, LayerNorm with or
without bias, GELU with the tanh approximation, causal self-attention through
`F.scaled_dot_product_attention(is_causal=True)`, no dropout, the LM head tied to the token
embedding, N(0, 0.02) init with residual projections N(0, 0.02/sqrt(2L)), biases 0, norm
weights 1. The optimizer is AdamW (fused=False, foreach left at its default) with weight decay
on 2-D matrices except the embeddings, then global-norm clipping. Batches are random tokens
from a fixed seed. fp32 throughout.

Each timed step is exactly: zero_grad, forward, loss, backward, clip, optimizer step.
Prints one JSON object on stdout (see bench/README.md).
"""
import argparse
import json
import math
import os
import resource
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--vocab", type=int, default=65, help="vocabulary size of the model (already padded)")
    p.add_argument("--bias", dest="bias", action="store_true", default=False)
    p.add_argument("--no-bias", dest="bias", action="store_false")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--seq", type=int, default=0, help="sequence length T (0 = block size)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--autocast", choices=["none", "bf16"], default="none",
                   help="bf16: forward and loss under torch.autocast('cpu', dtype=torch.bfloat16) "
                        "(fp32 master weights, moments and gradients; oneDNN's BF16 kernels)")
    a = p.parse_args(argv)
    if a.seq == 0:
        a.seq = a.block_size
    if a.seq > a.block_size:
        p.error("--seq must not exceed --block-size")
    if a.n_embd % a.n_head:
        p.error("--n-embd must be a multiple of --n-head")
    if a.steps < 1:
        p.error("--steps must be at least 1")
    return a


def main(argv=None):
    a = parse_args(argv)
    # Thread pools read these when they start: set them before torch is imported.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(a.threads)

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(a.n_embd, 3 * a.n_embd, bias=a.bias)
            self.c_proj = nn.Linear(a.n_embd, a.n_embd, bias=a.bias)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            hs = C // a.n_head
            q = q.view(B, T, a.n_head, hs).transpose(1, 2)
            k = k.view(B, T, a.n_head, hs).transpose(1, 2)
            v = v.view(B, T, a.n_head, hs).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.c_proj(y)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc = nn.Linear(a.n_embd, 4 * a.n_embd, bias=a.bias)
            self.c_proj = nn.Linear(4 * a.n_embd, a.n_embd, bias=a.bias)

        def forward(self, x):
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(a.n_embd, bias=a.bias)
            self.attn = CausalSelfAttention()
            self.ln_2 = nn.LayerNorm(a.n_embd, bias=a.bias)
            self.mlp = MLP()

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.n_embd)
            self.wpe = nn.Embedding(a.block_size, a.n_embd)
            self.h = nn.ModuleList([Block() for _ in range(a.n_layer)])
            self.ln_f = nn.LayerNorm(a.n_embd, bias=a.bias)
            self.lm_head = nn.Linear(a.n_embd, a.vocab, bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            for name, prm in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    nn.init.normal_(prm, 0.0, 0.02 / math.sqrt(2 * a.n_layer))
                elif prm.dim() == 2:
                    nn.init.normal_(prm, 0.0, 0.02)
                elif name.endswith("bias"):
                    nn.init.zeros_(prm)
                else:  # LayerNorm weights
                    nn.init.ones_(prm)

        def forward(self, idx, targets):
            T = idx.shape[1]
            pos = torch.arange(T, dtype=torch.long)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.h:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    model = GPT()
    model.train()
    # named_parameters() yields the tied matrix once (as wte.weight).
    named = list(model.named_parameters())
    n_params = sum(p.numel() for _, p in named)
    n_params_no_pos = n_params - model.wpe.weight.numel()
    embeddings = {"wte.weight", "wpe.weight"}
    decay = [p for n, p in named if p.dim() >= 2 and n not in embeddings]
    no_decay = [p for n, p in named if not (p.dim() >= 2 and n not in embeddings)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps, fused=False,
    )
    params = [p for _, p in named]

    gen = torch.Generator().manual_seed(a.seed)
    B, T = a.batch, a.seq

    def batch():
        xy = torch.randint(0, a.vocab, (B, T + 1), generator=gen)
        return xy[:, :-1].contiguous(), xy[:, 1:].contiguous()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast == "bf16"):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, a.grad_clip)
        opt.step()
        return loss

    times = []
    losses = []
    for i in range(a.warmup + a.steps):
        x, y = batch()  # outside the timed region
        t0 = time.perf_counter()
        loss = step(x, y)
        dt = time.perf_counter() - t0
        losses.append(loss.item())  # eager CPU: the step has finished; this only reads it
        if i >= a.warmup:
            times.append(dt)

    L, C = a.n_layer, a.n_embd
    flops_per_token = 6 * n_params_no_pos + 12 * L * C * T
    flops_per_step = flops_per_token * B * T
    ordered = sorted(times)
    med = ordered[len(ordered) // 2]  # as kiln bench: the upper median of an even count
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = None
    out = {
        "impl": "pytorch",
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": capability,
        "config": {
            "n_layer": L, "n_head": a.n_head, "n_embd": C, "block_size": a.block_size,
            "vocab_size": a.vocab, "bias": a.bias, "batch_size": B, "seq_len": T,
            "tied_embeddings": True, "dtype": "float32",
            "lr": a.lr, "weight_decay": a.weight_decay, "betas": [a.beta1, a.beta2],
            "eps": a.eps, "grad_clip": a.grad_clip, "seed": a.seed,
            "warmup_steps": a.warmup, "timed_steps": a.steps,
        },
        "params": n_params,
        "params_no_pos": n_params_no_pos,
        "step_ms": {"min": ordered[0] * 1e3, "median": med * 1e3, "max": ordered[-1] * 1e3},
        "step_ms_all": [t * 1e3 for t in times],
        "tokens_per_sec": B * T / med,
        "model_flops_per_step": flops_per_step,
        "achieved_gflops": flops_per_step / med / 1e9,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        # ru_maxrss is KiB on Linux.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
