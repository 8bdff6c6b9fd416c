"""A Hugging Face user's whole journey through kiln, checked against transformers and PEFT.

usage: python bench/check_journey.py [--kiln target/release/kiln] [--fixture ../shared/fixtures/qwen2-tiny]
                                      [--work DIR] [--steps N]

1. The fixture as transformers 5 saves it: `save_pretrained` in bf16, the chat template in
   `chat_template.jinja` (none in `tokenizer_config.json`), EOS as a list in
   `generation_config.json`.
2. kiln: `data prepare --format chat` -> LoRA SFT (`train --init-from`) -> `eval` of the merged
   export -> `generate --chat` (greedy, stopping at EOS) -> `export --merge` and `--format peft`.
3. transformers and PEFT:
   - both exports' tokenizers render the chat template as the base's does;
   - the merged model's mean next-token loss over held-out windows equals `kiln eval`'s within
     1e-5 relative;
   - PEFT's logits (base + adapter) equal the merged model's within 1e-4;
   - greedy generation from the templated prompt stops at EOS and gives kiln's reply.
Prints one JSON line; exit 1 on a failed check. Needs torch, transformers and peft.
"""
import argparse, json, os, random, subprocess, sys, tempfile

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ap = argparse.ArgumentParser()
ap.add_argument("--kiln", default=os.path.join(ROOT, "target/release/kiln"))
ap.add_argument("--fixture", default=os.path.join(ROOT, "../shared/fixtures/qwen2-tiny"))
ap.add_argument("--work", default=None)
ap.add_argument("--steps", type=int, default=100)
args = ap.parse_args()
work = args.work or tempfile.mkdtemp(prefix="kiln-journey-")
os.makedirs(work, exist_ok=True)
p = lambda *x: os.path.join(work, *x)


def kiln(*a):
    r = subprocess.run([args.kiln, *a], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"kiln {' '.join(a)}: exit {r.returncode}\n{r.stderr}")
    return r.stdout


# 1. The model directory as transformers 5 writes it.
tok = AutoTokenizer.from_pretrained(args.fixture)
model = AutoModelForCausalLM.from_pretrained(args.fixture, dtype=torch.bfloat16)
eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
model.generation_config.eos_token_id = eos
model.save_pretrained(p("model"))
tok.save_pretrained(p("model"))
saved_cfg = json.load(open(p("model", "tokenizer_config.json")))
template_file = os.path.exists(p("model", "chat_template.jinja")) and "chat_template" not in saved_cfg
gen_eos = json.load(open(p("model", "generation_config.json")))["eos_token_id"]

# 2. The journey in kiln.
rng = random.Random(3)
with open(p("chats.jsonl"), "w") as f:
    for _ in range(300):
        a, b = rng.randrange(20), rng.randrange(20)
        f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                         {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]}) + "\n")
with open(p("held.txt"), "w") as f:
    f.write(" ".join(f"{a} plus {b} is {a + b}." for a in range(12) for b in range(12)))
kiln("data", "prepare", "--input", p("chats.jsonl"), "--tokenizer", p("model"), "--format", "chat", "--out", p("prepared"), "--quiet")
kiln("train", "--init-from", p("model"), "--data", p("prepared"), "--lora-rank", "8", "--lora-targets", "all-linear",
     "--packing", "documents", "--reset-positions", "--seq-len", "64", "--max-steps", str(args.steps),
     "--set", "train.lr=1e-3", "--set", "sample.tokens=0", "--out", p("sft"), "--quiet")
kiln("export", "--run", p("sft"), "--merge", "--out", p("merged"))
kiln("export", "--run", p("sft"), "--format", "peft", "--out", p("peft"))
ev = json.loads(kiln("eval", "--checkpoint", p("merged"), "--data", p("held.txt"), "--seq-len", "64").strip().splitlines()[-1])
question = "What is 3 plus 4?"
reply = kiln("generate", "--run", p("sft"), "--chat", "--prompt", question, "--temperature", "0",
             "--max-new-tokens", "24", "--skip-special-tokens").strip()

# 3. transformers and PEFT.
msgs = [{"role": "user", "content": question}]
render = lambda d: AutoTokenizer.from_pretrained(d).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
want = render(p("model"))
templates = {"merged": render(p("merged")) == want, "peft": render(p("peft")) == want}
mtok = AutoTokenizer.from_pretrained(p("merged"))
merged = AutoModelForCausalLM.from_pretrained(p("merged"), dtype=torch.float32, attn_implementation="eager").eval()
t = ev["seq_len"]
ids = mtok(open(p("held.txt")).read(), add_special_tokens=False)["input_ids"]
n = (len(ids) - 1) // t
x = torch.tensor(ids[: n * t]).view(n, t)
y = torch.tensor(ids[1: n * t + 1]).view(n, t)
with torch.no_grad():
    logits = torch.cat([merged(input_ids=x[i: i + 8]).logits for i in range(0, n, 8)])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    base = AutoModelForCausalLM.from_pretrained(p("model"), dtype=torch.float32, attn_implementation="eager")
    peft = PeftModel.from_pretrained(base, p("peft")).eval()
    plog = torch.cat([peft(input_ids=x[i: i + 8]).logits for i in range(0, n, 8)])
    diff = (plog - logits).abs().max().item()
    prompt = mtok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = merged.generate(**prompt, max_new_tokens=24, do_sample=False)
new = out[0, prompt["input_ids"].shape[1]:].tolist()
stopped = new[-1] in eos or len(new) < 24
torch_reply = mtok.decode(new, skip_special_tokens=True).strip()
rel = abs(loss - ev["val_loss"]) / ev["val_loss"]
checks = {
    "template_in_chat_template_jinja": template_file,
    "generation_config_eos_list": gen_eos == eos,
    "exports_render_the_template": all(templates.values()),
    "merged_loss_equals_kiln_eval": rel <= 1e-5,
    "peft_logits_equal_merged": diff <= 1e-4,
    "greedy_reply_equals_kiln": torch_reply == reply,
}
ok = all(checks.values())
print(json.dumps({"work": work, "checks": checks, "torch_loss": loss, "kiln_loss": ev["val_loss"], "rel": rel,
                  "peft_vs_merged_max_abs_logit": diff, "windows": n, "kiln_reply": reply, "torch_reply": torch_reply,
                  "stopped_at_eos": stopped, "pass": ok}, ensure_ascii=False))
sys.exit(0 if ok else 1)
