# Peer of bench_attn: attention alone in PyTorch, torch.nn.functional.scaled_dot_product_attention
# under sdpa_kernel(SDPBackend.FLASH_ATTENTION) (its FlashAttention-2 kernels; no other backend may
# run: the call fails rather than fall back), causal, bf16, the shapes and the JSON fields of
# tests/bench/bench_attn.c, one line per (T, HS, direction). tests/gpu/device-run.sh attn runs both.
#   python3 peer_attn.py [--seq 2048,8192] [--hs 128,64] [--heads 32] [--kv-heads 8] [--tokens 16384]
# Layout: q, k, v made (B, T, heads, HS) as traind keeps them and passed transposed to
# (B, heads, T, HS), a view (the flash kernels take the strides; no copy).
# GQA: enable_gqa=True (PyTorch >= 2.5: the flash kernels read each kv head for its query
# heads); where that call fails, k and v are expanded to NH heads with repeat_interleave inside
# the timed call (what transformers' repeat_kv does), and "gqa" says "expanded".
# FLOPs as bench_attn counts them (FlashAttention's): forward 4*B*NH*T*T*HS/2 (causal), backward
# 2.5 times that. Timing as bench_attn: 3 warm-up calls, n calls per group (~0.2 s, 3..200),
# 5 groups between torch.cuda.synchronize() and time.perf_counter(); ms the median group's mean.
# The forward runs under torch.no_grad() (the kernel alone; its log-sum-exp is written either way);
# the backward is torch.autograd.grad of one forward's output, bf16 dout, bf16 gradients.
import argparse, json, math, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def ints(s):
    return [int(x) for x in s.split(",")]


def timed(fn):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    n = min(200, max(3, math.ceil(0.2 / one) if one > 0 else 200))
    groups = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        groups.append((time.perf_counter() - t0) / n * 1e3)
    groups.sort()
    return groups[2], groups[0], 5 * n


def attn(q, k, v, gqa):
    # q (B, NH, T, HS); k, v (B, NKV, T, HS)
    if gqa == "enable_gqa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def run(B, T, NH, NKV, HS, device):
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(B, T, h, HS, device="cuda", dtype=torch.bfloat16, generator=g)
    # the leaves in traind's layout; SDPA gets their (B, heads, T, HS) views
    qb, kb, vb = mk(NH).requires_grad_(), mk(NKV).requires_grad_(), mk(NKV).requires_grad_()
    q, k, v = qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
    dout = mk(NH).transpose(1, 2)
    fwd_flop = 4.0 * B * NH * T * T * HS / 2
    base = {"name": "peer-sdpa-flash", "B": B, "T": T, "NH": NH, "NKV": NKV, "HS": HS, "causal": True,
            "dtype": "bf16", "device": device, "torch": torch.__version__}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        gqa = "enable_gqa" if NH != NKV else "none"
        if NH != NKV:
            try:
                with torch.no_grad():
                    attn(q, k, v, gqa)
                torch.cuda.synchronize()
            except (RuntimeError, TypeError) as e:
                print(f"peer_attn: enable_gqa with the flash backend failed ({str(e)[:160]}): "
                      "k and v expanded in the call", file=sys.stderr, flush=True)
                gqa = "expanded"
        out = []
        with torch.no_grad():
            ms, ms_min, iters = timed(lambda: attn(q, k, v, gqa))
        out.append(dict(base, dir="fwd", ms=round(ms, 4), ms_min=round(ms_min, 4),
                        tflops=round(fwd_flop / (ms * 1e-3) / 1e12, 2), flop=fwd_flop, iters=iters, gqa=gqa,
                        io="q,k,v bf16 in; out bf16, logsumexp fp32 out"))
        o = attn(q, k, v, gqa)
        ms, ms_min, iters = timed(lambda: torch.autograd.grad(o, (qb, kb, vb), dout, retain_graph=True))
        out.append(dict(base, dir="bwd", ms=round(ms, 4), ms_min=round(ms_min, 4),
                        tflops=round(2.5 * fwd_flop / (ms * 1e-3) / 1e12, 2), flop=2.5 * fwd_flop, iters=iters,
                        gqa=gqa, io="dout, out, q,k,v bf16 in; dq,dk,dv bf16 out"))
    del o, q, k, v, qb, kb, vb, dout
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=ints, default=[2048, 8192])
    ap.add_argument("--hs", type=ints, default=[128, 64])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args()
    if a.heads % a.kv_heads:
        ap.error(f"--heads ({a.heads}) must be a multiple of --kv-heads ({a.kv_heads})")
    device = torch.cuda.get_device_name()
    status = 0
    for HS in a.hs:
        for T in a.seq:
            B = max(1, a.tokens // T)
            try:
                for line in run(B, T, a.heads, a.kv_heads, HS, device):
                    print(json.dumps(line), flush=True)
            except Exception as e:  # one shape's failure is reported; the others still run
                print(json.dumps({"name": "peer-sdpa-flash", "B": B, "T": T, "NH": a.heads, "NKV": a.kv_heads,
                                  "HS": HS, "error": repr(e)[:300]}), flush=True)
                status = 1
    raise SystemExit(status)


if __name__ == "__main__":
    main()
