"""A small synthetic corpus for the memory and speed scripts: the data's share of memory stays
negligible and tokenizing it is instant. Usage: python3 scripts/corpus.py OUT.txt"""
import random
import sys

random.seed(7)
w = "the quick brown fox jumps over a lazy dog and then runs far away from home while birds sing".split()
open(sys.argv[1], "w").write(" ".join(random.choice(w) for _ in range(60000)))
