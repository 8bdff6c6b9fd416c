"""`kiln data prepare` against the Hugging Face `tokenizers` library's batch encoding of the same
jsonl file, side by side, alternating, medians of --reps runs each.

    python bench/prepare.py --kiln target/release/kiln --data corpus.jsonl --tokenizer DIR [--reps 3]

The Python side reads the file, parses each line, encodes the documents with
`Tokenizer.encode_batch` in batches of 4096 (all cores, as kiln) and appends the EOS: the same
work as kiln minus writing shards. Both must produce the same number of tokens. Prints one JSON
line with both times, MB/s and the ratio (python time / kiln time: above 1 means kiln is faster).
"""
import argparse, json, os, resource, shutil, statistics, subprocess, tempfile, time

from tokenizers import Tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--kiln", required=True)
ap.add_argument("--data", required=True)
ap.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json and tokenizer_config.json")
ap.add_argument("--reps", type=int, default=3)
a = ap.parse_args()

cfg = json.load(open(os.path.join(a.tokenizer, "tokenizer_config.json")))
tok = Tokenizer.from_file(os.path.join(a.tokenizer, "tokenizer.json"))
eos = tok.token_to_id(cfg["eos_token"])
bos = [tok.token_to_id(cfg["bos_token"])] if cfg.get("add_bos_token") else []


def python_once():
    t0 = time.perf_counter()
    n, batch = 0, []
    with open(a.data, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                batch.append(json.loads(line)["text"])
            if len(batch) == 4096:
                n += sum(len(bos) + len(e.ids) + 1 for e in tok.encode_batch(batch))
                batch = []
    if batch:
        n += sum(len(bos) + len(e.ids) + 1 for e in tok.encode_batch(batch))
    return time.perf_counter() - t0, n


def kiln_once():
    out = tempfile.mkdtemp(prefix="kiln-prep-")
    shutil.rmtree(out)
    t0 = time.perf_counter()
    subprocess.run([a.kiln, "data", "prepare", "--input", a.data, "--tokenizer", a.tokenizer, "--out", out, "--val-fraction", "0.0001", "--quiet"],
                   check=True, stdout=subprocess.DEVNULL)
    dt = time.perf_counter() - t0
    meta = json.load(open(os.path.join(out, "meta.json")))
    shutil.rmtree(out)
    return dt, meta["train_tokens"] + meta["val_tokens"]


mb = os.path.getsize(a.data) / 1e6
kt, pt, kn, pn = [], [], None, None
for _ in range(a.reps):
    t, kn = kiln_once()
    kt.append(t)
    t, pn = python_once()
    pt.append(t)
assert kn == pn, f"token counts differ: kiln {kn}, tokenizers {pn}"
k, p = statistics.median(kt), statistics.median(pt)
print(json.dumps({"data_mb": round(mb, 1), "tokens": kn, "kiln_s": [round(x, 2) for x in kt], "tokenizers_s": [round(x, 2) for x in pt],
                  "kiln_mb_s": round(mb / k, 2), "tokenizers_mb_s": round(mb / p, 2), "ratio": round(p / k, 3), "threads": os.cpu_count()}))
