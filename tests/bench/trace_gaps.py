#!/usr/bin/env python3
"""Where a stream waited: TD_CUDA_TRACE's timelines, step by step.

usage: trace_gaps.py FILE.K [FILE.K ...]

Each file is one backend's (one rank's) timeline from gpu/cuda/cuda_prof.c:
a line per math op, "op start_us end_us". Ops on a stream run one after
another, so the time between one op's end and the next one's start is time
the stream waited: for the host's launches, for another stream (a
collective, a copy) or an event. A step ends with its adamw_update ops. For
each step: its span (and the wait before its first op), the ops' own time,
the waits within it, and the longest waits
with the ops on each side; then the ops' own time by op over the steady
steps (all but the first two)."""
import sys
from collections import defaultdict


def load(path):
    ops = []
    for line in open(path):
        parts = line.split()
        if len(parts) == 3:
            ops.append((parts[0], float(parts[1]), float(parts[2])))
    ops.sort(key=lambda o: o[1])
    return ops


def steps(ops):
    """Split after each run of adamw_update ops (a step may update in
    several calls: the trainable tensors' arenas)."""
    out, cur = [], []
    for i, o in enumerate(ops):
        cur.append(o)
        last = i + 1 == len(ops) or ops[i + 1][0] != "adamw_update"
        if o[0] == "adamw_update" and last:
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__.strip().splitlines()[2])
    for path in sys.argv[1:]:
        ops = load(path)
        print(f"== {path}: {len(ops)} ops")
        by_op = defaultdict(float)
        st = steps(ops)
        for k, s in enumerate(st):
            before = (s[0][1] - st[k - 1][-1][2]) / 1e3 if k else 0.0
            span = (s[-1][2] - s[0][1]) / 1e3
            busy = sum(e - b for _, b, e in s) / 1e3
            gaps = [(s[i + 1][1] - s[i][2], s[i][0], s[i + 1][0]) for i in range(len(s) - 1)]
            gaps.sort(reverse=True)
            top = ", ".join(f"{g / 1e3:.2f} ms {a} -> {b}" for g, a, b in gaps[:4])
            print(f"step {k}: {len(s)} ops, span {span:.2f} ms (and {before:.2f} before it), "
                  f"ops {busy:.2f}, waits {span - busy:.2f}; longest: {top}")
            if k >= 2:
                for name, b, e in s:
                    by_op[name] += (e - b) / 1e3
        n = max(len(st) - 2, 1)
        print("ops' own time a step (steady steps):")
        for name, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]:
            print(f"  {name:28s} {ms / n:8.2f} ms")


if __name__ == "__main__":
    main()
