"""A kiln LoRA run's two exports against each other and against kiln, in transformers and PEFT.

usage: python bench/check_lora_export.py BASE_DIR MERGED_DIR PEFT_DIR HELD_OUT.txt KILN_EVAL_JSON

- MERGED_DIR (`kiln export --run RUN --merge`) loads with AutoModelForCausalLM + AutoTokenizer and
  generates text;
- PEFT_DIR (`kiln export --run RUN --format peft`) loads with PeftModel.from_pretrained onto BASE_DIR;
  its logits on the held-out text match the merged model's within 1e-4;
- the merged model's mean next-token loss over the held-out text's windows (seq_len from the kiln eval
  line) equals the `val_loss` kiln printed (`kiln eval --checkpoint MERGED_DIR --data HELD_OUT.txt`)
  within 1e-5 relative.
Prints one JSON line; exit 1 on a failed check.
"""
import json, sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

base_dir, merged_dir, peft_dir, held, kiln_json = sys.argv[1:6]
kiln = json.loads(open(kiln_json).read())
t = kiln["seq_len"]
tok = AutoTokenizer.from_pretrained(merged_dir)
merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, attn_implementation="eager").eval()
ids = tok(open(held).read(), add_special_tokens=False)["input_ids"]
n = (len(ids) - 1) // t
x = torch.tensor(ids[: n * t]).view(n, t)
y = torch.tensor(ids[1 : n * t + 1]).view(n, t)
with torch.no_grad():
    logits = torch.cat([merged(input_ids=x[i : i + 8]).logits for i in range(0, n, 8)])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    peft = PeftModel.from_pretrained(base, peft_dir).eval()
    plog = torch.cat([peft(input_ids=x[i : i + 8]).logits for i in range(0, min(n, 16), 8)])
    diff = (plog - logits[: plog.shape[0]]).abs().max().item()
    prompt = tok("First Citizen:", return_tensors="pt")
    gen = merged.generate(**prompt, max_new_tokens=12, do_sample=False)
text = tok.decode(gen[0], skip_special_tokens=True)
rel = abs(loss - kiln["val_loss"]) / kiln["val_loss"]
ok = diff <= 1e-4 and rel <= 1e-5 and text.startswith("First Citizen:")
print(json.dumps({"peft_vs_merged_max_abs_logit": diff, "torch_loss": loss, "kiln_loss": kiln["val_loss"], "rel": rel,
                  "windows": n, "generated": text, "pass": ok}, ensure_ascii=False))
sys.exit(0 if ok else 1)
