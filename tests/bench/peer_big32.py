# Peer of bench_train's llama3-8b shape (all 32 of Llama-3-8B's layers): torch.compile of
# transformers' Llama with PEFT's LoRA, the run ../shared/bench/peer_big.py does not have.
# One JSON line per run (the fields of peer_big.py's lines): tokens/s and
# torch.cuda.max_memory_allocated. tests/gpu/device-run.sh big32 runs it beside bench_train.
#   RUNS=lora-8b-gc-compile,lora-8b-compile python3 peer_big32.py
# lora-8b-gc-compile  random init, bf16 base, LoRA r16 alpha 32 on the seven projections (fp32
#                     adapters), B4 x T2048, gradient checkpointing (non-reentrant), the model
#                     under torch.compile, fused AdamW, bf16 autocast, no clipping
# lora-8b-compile     the same without checkpointing (wants an H200's memory)
# Timing: 3 steps (the first compiles), then 5 between torch.cuda.synchronize() calls.
import json, os, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model

B, T = int(os.environ.get("B", 4)), int(os.environ.get("T", 2048))
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama3_8b():
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                       rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                       tie_word_embeddings=False, attn_implementation="sdpa")


def one(name):
    checkpointing = "-gc" in name
    cfg = llama3_8b()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=PROJ))
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    opt = torch.optim.AdamW(trainable, lr=1e-5, fused=True)
    step_model = torch.compile(model)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    out = {"name": "peer-" + name, "batch": B, "seq": T, "layers": cfg.num_hidden_layers,
           "params_trainable": sum(p.numel() for p in trainable)}
    try:
        t_start = time.time()
        for i in range(8):
            if i == 3:
                torch.cuda.synchronize()
                out["warmup_s"] = round(time.time() - t_start, 1)
                t0 = time.time()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step_model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = (time.time() - t0) / 5
        out.update(ms_per_step=round(dt * 1e3, 2), tokens_per_s=round(B * T / dt, 1),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3), loss=loss.item())
    except torch.OutOfMemoryError:
        out.update(error="out of memory",
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3))
    print(json.dumps(out), flush=True)
    del model, step_model, opt
    torch._dynamo.reset()


for run in os.environ.get("RUNS", "lora-8b-gc-compile,lora-8b-compile").split(","):
    one(run)
