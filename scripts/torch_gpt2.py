#!/usr/bin/env python3
"""GPT-2 training steps in PyTorch, the peer `scripts/gpu_check.sh` measures kiln against.

The model is GPT-2 as kiln's `gpt2-124m` preset builds it (learned positions, pre-norm blocks,
GELU (tanh), a tied head, biases, no dropout), trained with AdamW on random tokens in bf16
autocast: eager, then `torch.compile`. Prints one JSON object: tokens/s of each, the model FLOPs
per token (6N + 12·L·C·T, PaLM's count, as kiln's bench counts it), and the versions.

usage: torch_gpt2.py [--device cuda|cpu] [--batch 16] [--seq 1024] [--steps 10] [--warmup 3]
                     [--layers 12 --heads 12 --embd 768 --vocab 50257] [--no-compile]
"""
import argparse
import json
import math
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--embd", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
    except ImportError as e:
        print(json.dumps({"absent": f"PyTorch is not installed ({e})"}))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"absent": "torch.cuda.is_available() is false"}))
        return 0

    class Block(nn.Module):
        def __init__(self, c, nh):
            super().__init__()
            self.nh = nh
            self.ln_1 = nn.LayerNorm(c)
            self.c_attn = nn.Linear(c, 3 * c)
            self.c_proj = nn.Linear(c, c)
            self.ln_2 = nn.LayerNorm(c)
            self.c_fc = nn.Linear(c, 4 * c)
            self.mlp_proj = nn.Linear(4 * c, c)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, self.nh, c // self.nh).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(a.vocab, a.embd)
            self.wpe = nn.Embedding(a.seq, a.embd)
            self.h = nn.ModuleList(Block(a.embd, a.heads) for _ in range(a.layers))
            self.ln_f = nn.LayerNorm(a.embd)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.h:
                x = blk(x)
            logits = self.ln_f(x) @ self.wte.weight.t()
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))

    torch.manual_seed(0)
    dev = torch.device(a.device)
    if a.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    n_params = sum(p.numel() for p in Gpt().parameters())
    flops_per_token = 6 * n_params + 12 * a.layers * a.embd * a.seq

    def run(compiled):
        model = Gpt().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, fused=(a.device == "cuda"))
        step = torch.compile(model) if compiled else model
        x = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
        y = torch.randint(0, a.vocab, (a.batch, a.seq), device=dev)
        times = []
        for i in range(a.warmup + a.steps):
            t0 = time.perf_counter()
            with torch.autocast(device_type=a.device, dtype=torch.bfloat16):
                loss = step(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if a.device == "cuda":
                torch.cuda.synchronize()
            if i >= a.warmup:
                times.append(time.perf_counter() - t0)
        s = sorted(times)[len(times) // 2]
        return {"step_s_median": s, "tokens_per_sec": a.batch * a.seq / s, "loss": float(loss)}

    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "batch": a.batch,
        "seq": a.seq,
        "parameters": n_params,
        "flops_per_token": flops_per_token,
        "eager_bf16": run(False),
    }
    out["compile_bf16"] = {"skipped": "--no-compile"} if a.no_compile else run(True)
    assert all(math.isfinite(v["loss"]) for v in (out["eager_bf16"], out["compile_bf16"]) if "loss" in v)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
