#!/usr/bin/env python3
"""Hugging Face tokenizers on the same texts as bench_tokenizer, one thread.

    peer_tokenizers.py [--tokenizer tokenizer.json] [--data file.jsonl]
                       [--field text] [--seconds S] [--dump ids.bin]

Encodes the JSONL file's texts one document at a time (Tokenizer.encode,
add_special_tokens=False: special tokens in the text are matched, none are
added), the way bench_tokenizer does with traind's tokenizer, and prints the
same line:

    tokenizer impl=hf-tokenizers docs=N bytes=B tokens=K passes=P cold_mb_s=X mb_s=Y

bytes are the texts' UTF-8 bytes; cold is the first pass, mb_s the best later
one. --dump writes every document's ids (a little-endian uint32 count, then
the ids) for `bench_tokenizer --check`, which compares them id for id.
Needs `pip install tokenizers`; runs where that is (the GPU machine).
"""
import argparse
import json
import os
import struct
import sys
import time

# One thread: tokenizers parallelises batches through rayon; encode() of one
# text is sequential, and this keeps the pool out of it.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default="tests/fixtures/tokenizer/tokenizer.json")
    ap.add_argument("--data", default="tests/fixtures/demo/fortunes.jsonl")
    ap.add_argument("--field", default="text")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--dump")
    a = ap.parse_args()

    tok = Tokenizer.from_file(a.tokenizer)
    texts = []
    with open(a.data, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            v = json.loads(line).get(a.field)
            if isinstance(v, str):
                texts.append(v)
    if not texts:
        sys.exit(f"{a.data}: no \"{a.field}\" rows")
    nbytes = sum(len(t.encode("utf-8")) for t in texts)

    cold, best, total, passes, tokens = 0.0, float("inf"), 0.0, 0, 0
    while passes < 2 or total < a.seconds:
        t0 = time.perf_counter()
        k = 0
        for t in texts:
            k += len(tok.encode(t, add_special_tokens=False).ids)
        dt = time.perf_counter() - t0
        if passes == 0:
            cold = dt
        else:
            best = min(best, dt)
        total += dt
        tokens = k
        passes += 1
    print(f"tokenizer impl=hf-tokenizers docs={len(texts)} bytes={nbytes} tokens={tokens} passes={passes} "
          f"cold_mb_s={nbytes / 1e6 / cold:.2f} mb_s={nbytes / 1e6 / best:.2f}")

    if a.dump:
        with open(a.dump, "wb") as f:
            for t in texts:
                ids = tok.encode(t, add_special_tokens=False).ids
                f.write(struct.pack("<I", len(ids)))
                f.write(struct.pack(f"<{len(ids)}I", *ids))


if __name__ == "__main__":
    main()
