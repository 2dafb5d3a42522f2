#!/usr/bin/env python3
# A Llama-3-8B-shaped model dir with random bf16 weights, made on the device
# (no download): config.json (meta-llama/Meta-Llama-3-8B's shapes, as
# tests/bench/bench_train.c's llama3-8b), model.safetensors written by hand
# (the format's header and raw little-endian bf16: nothing but torch needed),
# and a token file of random ids for DATA_FORMAT_TOKENS.
# usage: gen_llama.py DIR [LAYERS [tiny]]   (LAYERS: 32; fewer, and tiny
# widths, to check this script anywhere)
import json, os, random, struct, sys, time

try:
    import torch
except ImportError:  # the tiny check without torch: pure Python, slow
    torch = None

out = sys.argv[1]
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 32
C, I, NH, NKV, V = 4096, 14336, 32, 8, 128256
if len(sys.argv) > 3 and sys.argv[3] == "tiny":
    C, I, NH, NKV, V = 64, 128, 4, 2, 128256
HS = C // NH
cfg = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
    "hidden_size": C, "intermediate_size": I, "num_hidden_layers": layers,
    "num_attention_heads": NH, "num_key_value_heads": NKV, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16",
}
shapes = [("model.embed_tokens.weight", (V, C))]
for l in range(layers):
    p = f"model.layers.{l}."
    shapes += [(p + "input_layernorm.weight", (C,)),
               (p + "self_attn.q_proj.weight", (NH * HS, C)),
               (p + "self_attn.k_proj.weight", (NKV * HS, C)),
               (p + "self_attn.v_proj.weight", (NKV * HS, C)),
               (p + "self_attn.o_proj.weight", (C, NH * HS)),
               (p + "post_attention_layernorm.weight", (C,)),
               (p + "mlp.gate_proj.weight", (I, C)),
               (p + "mlp.up_proj.weight", (I, C)),
               (p + "mlp.down_proj.weight", (C, I))]
shapes += [("model.norm.weight", (C,)), ("lm_head.weight", (V, C))]

os.makedirs(out, exist_ok=True)
t0 = time.time()
header, off = {}, 0
for name, shape in shapes:
    n = 1
    for d in shape:
        n *= d
    header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + 2 * n]}
    off += 2 * n
header["__metadata__"] = {"format": "pt"}
h = json.dumps(header, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
if torch:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(1234)
rng = random.Random(1234)


def tensor_bytes(shape):
    n = 1
    for d in shape:
        n *= d
    if not torch:  # bf16: the float's upper half (truncated: any values will do)
        vals = [1.0] * n if len(shape) == 1 else [rng.gauss(0, 0.02) for _ in range(n)]
        return b"".join(struct.pack("<f", v)[2:] for v in vals)
    if len(shape) == 1:
        t = torch.ones(shape, dtype=torch.bfloat16, device=dev)
    else:
        t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16)
    return t.view(torch.int16).cpu().numpy().tobytes()


tmp = os.path.join(out, "model.safetensors.tmp")
with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for name, shape in shapes:
        f.write(tensor_bytes(shape))
os.replace(tmp, os.path.join(out, "model.safetensors"))
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
# Random tokens: documents of 4096 ids below the specials, EOS between them.
tr = random.Random(7)
ids = [cfg["eos_token_id"] if i % 4096 == 4095 else tr.randrange(128000) for i in range(1 << 20)]
with open(os.path.join(out, "data.tokens"), "wb") as f:
    f.write(struct.pack("<%dI" % len(ids), *ids))
print(json.dumps({"model_dir": out, "layers": layers, "bytes": off,
                  "seconds": round(time.time() - t0, 1)}))
