#!/usr/bin/env python3
"""The README's speed table from one `tests/gpu/device-run.sh bench` call.

usage: bench_table.py OUT_DIR

Reads the JSON lines that call wrote to OUT_DIR: bench_traind.jsonl
(bench_train, with nvidia-smi's peak appended), bench_peer.jsonl (peer_hf.py:
Qwen2-0.5B, eager and torch.compile) and bench_big.jsonl (peer_big.py: the
Llama-3-8B-shaped 4-layer runs), and prints a Markdown table: traind's
tokens/s and memory beside each peer's, with the ratios. Only numbers from
the same call are put side by side; a run missing from the files shows as
a dash. traind's memory is what cuMemGetInfo lost during the run (used_gib,
no CUDA context); a peer's is torch.cuda.max_memory_allocated."""
import json
import os
import sys

# (row label, traind's name and layer count, the peers' eager and compiled names)
ROWS = [
    ("Qwen2-0.5B, B8 x T1024", "full fine-tune", ("traind-full-bf16", 24),
     "full-amp-sdpa", "full-amp-sdpa-compile"),
    ("", "LoRA q,v r16", ("traind-lora-qv", 24), "lora-qv-sdpa", "lora-qv-sdpa-compile"),
    ("Llama-3-8B shapes, 4 layers, B4 x T2048", "full fine-tune", ("traind-full-bf16", 4),
     "peer-full-8b4l", "peer-full-8b4l-compile"),
    ("", "LoRA all seven r16", ("traind-lora-all", 4), "peer-lora-8b4l",
     "peer-lora-8b4l-compile"),
]


# Model FLOPs a token of the Llama-3-8B-shaped full fine-tune (4 layers, T
# 2048): 6 x its matrix weights (the projections and the head: a multiply-add
# each in the forward, two in the backward) plus causal attention's two
# forward products of T x HS per head, halved by the mask, times 3 for the
# backward's (FlashAttention's count); no recompute, no element-wise ops.
def flops_8b4l(layers=4, C=4096, I=14336, NH=32, NKV=8, HS=128, V=128256, T=2048):
    matrix = layers * (2 * C * NH * HS + 2 * C * NKV * HS + 3 * C * I) + V * C
    return 6 * matrix + layers * 3 * (4 * T * HS * NH / 2)


PEAK_TFLOPS = 790  # a large bf16 GEMM on an H100/H200 (issue 13's yardstick)


def lines(path):
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            r = json.loads(line)
            if "error" not in r:
                out.append(r)
    return out


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2])
    d = sys.argv[1]
    ours = lines(os.path.join(d, "bench_traind.jsonl"))
    peers = {r["name"]: r for r in lines(os.path.join(d, "bench_peer.jsonl")) +
             lines(os.path.join(d, "bench_big.jsonl"))}
    device = next((r["device"] for r in ours if "device" in r), "?")
    print(f"traind on {device}, the peers in the same call: tokens/s and peak GiB, in brackets "
          "traind's over the peer's\n")
    print("| shape | run | traind | PyTorch eager | torch.compile | traind memory | eager | compile |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, run, (name, layers), eager, comp in ROWS:
        t = next((r for r in ours if r["name"] == name and r["layers"] == layers
                  and r.get("gpus", 1) == 1), None)
        e, c = peers.get(eager), peers.get(comp)
        def tok(p):
            if not p:
                return "-"
            s = f"{p['tokens_per_s'] / 1e3:.1f}k"
            return s + (f" ({t['tokens_per_s'] / p['tokens_per_s']:.2f}x)" if t else "")
        def mem(p):
            if not p:
                return "-"
            s = f"{p['peak_gib']:.1f}"
            return s + (f" ({t['used_gib'] / p['peak_gib']:.2f}x)" if t else "")
        ts = f"{t['tokens_per_s'] / 1e3:.1f}k" if t else "-"
        tm = (f"{t['used_gib']:.1f}" + (f" (smi {t['nvidia_smi_peak_mib']} MiB)"
                                        if "nvidia_smi_peak_mib" in t else "")) if t else "-"
        print(f"| {shape} | {run} | {ts} | {tok(e)} | {tok(c)} | {tm} | {mem(e)} | {mem(c)} |")
    print()
    full = next((r for r in ours if r["name"] == "traind-full-bf16" and r["layers"] == 4
                 and r.get("gpus", 1) == 1), None)
    if full:
        per_token = flops_8b4l(T=full["seq"])
        tf = full["tokens_per_s"] * per_token / 1e12
        print(f"The 8B shapes' full fine-tune: {tf:.0f} TFLOP/s of model FLOPs "
              f"({per_token / 1e9:.2f} GFLOP a token: 6 x the matrix weights and causal "
              f"attention), {100 * tf / PEAK_TFLOPS:.1f}% of {PEAK_TFLOPS}.")
    clips = sorted({(r["name"], r["layers"], r.get("clip", 1.0)) for r in ours
                    if r.get("gpus", 1) == 1})
    if clips:
        print("Gradient clipping (traind's runs, as their peers: peer_hf.py clips to 1.0, "
              "peer_big.py not at all): " +
              ", ".join(f"{n} ({l} layers) {'none' if c == 0 else c}" for n, l, c in clips) + ".")


if __name__ == "__main__":
    main()
