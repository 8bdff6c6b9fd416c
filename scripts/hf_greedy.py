"""Greedy continuation of PROMPT by a Hugging Face model directory in transformers (fp32, eager attention):
compare with `kiln generate --checkpoint DIR --prompt PROMPT --max-new-tokens N --temperature 0`.
Usage: python scripts/hf_greedy.py DIR PROMPT N (needs torch, transformers)."""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, prompt, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(d)
m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
with torch.no_grad():
    out = m.generate(ids, max_new_tokens=n, do_sample=False)
print(tok.decode(out[0]))
