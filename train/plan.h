/* The memory plan (contract 1 of DESIGN.md): every buffer a job needs — weights,
 * gradients, optimizer state, activations kept for the backward pass, scratch —
 * derived from the model config, method, batch and sequence length before
 * anything is allocated or any weight is read.
 *
 * Buffers live in arenas by lifetime. The engine allocates each arena once, at
 * the plan's size, and points into it at the plan's offsets; nothing else is
 * allocated on the device, so the plan's bytes are the job's device bytes.
 * One arena is host memory (TR_ARENA_HOST, pinned: FULL_OFFLOAD's layer
 * inputs), planned the same way and reported beside the device total.
 * The plan also owns the parameter table (Hugging Face names, shapes, whether a
 * tensor trains and whether it decays).
 *
 * This is not an allocator: see train/model.h for the code that binds a plan. */
#ifndef TRAIN_PLAN_H
#define TRAIN_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/err.h"
#include "train/hfconfig.h"

enum tr_arena {
	TR_ARENA_PARAMS,  /* trainable weights, whole job: fp32 master weights */
	/* Frozen weights, whole job, as stored: fp32 (norms, biases; every
	 * frozen tensor outside the bf16 storage), bf16 (params16), NF4
	 * (nf4.*). Nothing the job writes after loading: jobs of one process
	 * on one device whose bases are the same files stored alike may share
	 * one copy (train/base.h), each model then holding only the other
	 * arenas (tr_model_new_shared). */
	TR_ARENA_BASE,
	TR_ARENA_GRADS,   /* fp32 gradients of trainable tensors, whole job */
	TR_ARENA_OPTIM,   /* AdamW m and v of trainable tensors, whole job */
	TR_ARENA_ACTS,    /* per-step activations kept for backward, inputs, RoPE tables */
	TR_ARENA_SCRATCH, /* per-step temporaries: logits, backward buffers */
	TR_ARENA_COUNT,   /* the device arenas above: the plan's total, the job's lease */
	/* Pinned host memory, whole job (gpu/backend.h: gpu_host_alloc): the
	 * layer inputs TR_RECOMPUTE_FULL_OFFLOAD keeps off the device. Per
	 * job, like the device arenas, but never in the device total nor in
	 * the lease: tr_plan_host_bytes. */
	TR_ARENA_HOST = TR_ARENA_COUNT,
	TR_ARENA_ALL
};

const char *tr_arena_name(enum tr_arena a);

/* The seven linear projections of a decoder layer, in HF order; LoRA targets
 * them by bit (1u << TR_LIN_Q ...). */
enum tr_lin { TR_LIN_Q, TR_LIN_K, TR_LIN_V, TR_LIN_O, TR_LIN_GATE, TR_LIN_UP, TR_LIN_DOWN, TR_LIN_COUNT };
/* "q_proj" ... "down_proj"; NULL out of range. */
const char *tr_lin_name(int lin);
/* "self_attn.q_proj" ... "mlp.down_proj": the module path inside a layer. */
const char *tr_lin_path(int lin);
/* The index of "q_proj" etc., or -1. */
int tr_lin_from_name(const char *name);
/* in_features and out_features of projection lin under cfg (q: C -> NH*HS...). */
void tr_lin_dims(const struct tr_model_config *cfg, int lin, int *in, int *out);

/* NF4 geometry (kernels/cpu/ops.h NF4_BLOCK, NF4_DQ_BLOCK; asserted equal in
 * train/nf4.c): values per absmax, absmax values per double-quantization scale. */
#define TR_NF4_BLOCK 64
#define TR_NF4_DQ_BLOCK 256

/* How frozen linear weights are stored. */
enum tr_quant {
	TR_QUANT_NONE, /* fp32, like every other tensor */
	TR_QUANT_NF4,  /* NF4 codes + absmax per 64 (train/nf4.h), dequantized for each use */
};

enum tr_param_kind {
	TR_P_BASE,   /* a tensor of the Hugging Face model */
	TR_P_HEAD,   /* score.weight, the classification head */
	TR_P_LORA_A, /* PEFT lora_A [r, in] of a projection */
	TR_P_LORA_B, /* PEFT lora_B [out, r] */
};

/* The most logits floats a causal plan holds at once (1 GiB of fp32): the
 * head runs in ceil(N / (this / V)) chunks, and fewer, larger GEMMs are
 * faster (Qwen2-0.5B at B8 T1024: 5 chunks, of 1756 rows by the bound
 * below; in bf16, tr_plan.logits16, 3 of 2736). */
#define TR_LOGITS_CHUNK_FLOATS ((size_t)256 << 20)
/* ...but a causal training plan (not a distillation's) takes no more rows a
 * chunk than give the head's GEMM this many inputs (rows x C): past that a
 * chunk's product is big enough for the device (rows x C x V multiply-adds,
 * ~0.2 T at V = 128k), and more rows only make the logits bigger. Llama-3-8B
 * (C 4096): 384 rows (three 128-row tiles), 188 MiB of logits instead of
 * 1 GiB, with their bf16 gradient inside a layer's backward region (its
 * attention's 288 MiB); Qwen2-0.5B (C 896): 1756 rows. */
#define TR_LOGITS_CHUNK_INPUTS ((size_t)3 << 19)

/* Offsets inside an arena are multiples of this (enough for any vector load). */
#define TR_PLAN_ALIGN 256

struct tr_param {
	char name[96];     /* model.layers.3.self_attn.q_proj.weight; adapters by their PEFT
			    * file name, base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight */
	int ndim;          /* 1 or 2 */
	int64_t shape[2];
	size_t numel;
	bool trainable;
	bool decay;        /* weight decay applies: trainable and ndim >= 2 */
	size_t offset;     /* in floats, into the params buffer (trainable) or base.f32
			    * (frozen); bf16: in bf16 values, into params16; unused when nf4 */
	size_t goffset;    /* in floats, into the trainable floats: the grads arena
			    * unsharded (and each half of optim: less shard_lo) */
	/* Where the backward writes this tensor's gradient: gslot -1, the
	 * grads buffer at goffset; else (memory.shard GRADIENTS and past: the
	 * grads buffer is the rank's part) work buffer gslot at gsoff floats:
	 * 0 .. TR_GRAD_RING - 1 the ring slot of a unit of a decoder layer
	 * (gunit % TR_GRAD_RING: grads.ring.K), TR_GRAD_RING the other
	 * tensors' (grads.rest). A unit's tensors are packed in goffset order
	 * (its decayed ones, then the rest) from the start of its slot, so a
	 * slot holds runs of the trainable floats (train/ddp.c reduces them
	 * onto their owners). */
	int gslot;
	size_t gsoff;
	/* ... and what it is summed with, a unit the backward finishes at
	 * once: decoder layer l's attention half (input_layernorm, q, k, v,
	 * o, their biases, q/k norms and adapters: tr_plan_mlp_half false)
	 * unit 2l, its MLP half (post_attention_layernorm, gate, up, down)
	 * unit 2l + 1 — the layer's backward is two stages, the MLP's first
	 * — so that the two slots of the ring hold a layer between them; the
	 * final norm, the head and a tied embedding unit 2L; an untied
	 * trainable embedding none (its gradient goes by rows: plan.embed_rows,
	 * and so does its lookup under PARAMETERS); -1 unsharded. */
	int gunit;
	/* PARAMETERS: what it is gathered with — decoder layer l's tensors
	 * unit l (the whole layer: its forward and recompute read both
	 * halves), the final norm, the head and a tied embedding unit L (an
	 * untied trainable embedding none, as gunit) — and where: work buffer wslot (l
	 * % TR_GRAD_RING, TR_GRAD_RING the others': params.ring.K,
	 * params.rest), its bf16 copy at w16off (params16.*: every tensor of
	 * the unit, packed in goffset order; plan.wslot16_numel), its fp32
	 * copy at wsoff (packed likewise over the tensors gathered in fp32
	 * only, not tr_plan_gathered16; plan.wslot_numel). */
	int wunit, wslot;
	size_t w16off;
	size_t wsoff;
	enum tr_param_kind kind;
	int layer;         /* decoder layer, -1 for embeddings, final norm and heads */
	int lin;           /* enum tr_lin of a projection's weight, bias or adapter; -1 otherwise */
	/* NF4 storage (frozen projection weights of a TR_QUANT_NF4 plan): offsets
	 * into the nf4.* buffers of the params arena (train/nf4.h). */
	bool nf4;
	/* Stored in bf16 only (a frozen 2-D tensor of a frozen_bf16 plan, not NF4). */
	bool bf16;
	size_t q_codes;    /* bytes into nf4.codes */
	size_t q_blocks;   /* absmax values before this tensor's (floats / bytes into nf4.absmax{,_q}) */
	size_t q_scales;   /* floats into nf4.absmax_scale (double quantization) */
};

/* The step as a schedule of stages (issue 11, step 0): the plan lists them,
 * the model walks them (train/model.c), and what later runs per layer — a
 * layer's recompute before its backward, the all-gathers and
 * reduce-scatters of several GPUs — hooks in at a stage, not inside one long
 * forward or backward. Forward stages come first (plan.nforward of them),
 * then the backward's, then the optimizer. */
enum tr_stage_kind {
	TR_STAGE_EMBED,           /* ids -> res[0] */
	TR_STAGE_LAYER,           /* layer l's forward: res[l] -> res[l+1], keeping what the plan keeps */
	TR_STAGE_FINAL_NORM,      /* res[L] -> lnf */
	TR_STAGE_HEAD,            /* rows [r0, r0 + rows) of the head: logits and loss (a classifier: all rows) */
	TR_STAGE_HEAD_BACKWARD,   /* the head's backward of those rows: d(lnf), the head's gradients */
	TR_STAGE_FINAL_NORM_BACKWARD, /* d(lnf) -> d(res[L]) */
	TR_STAGE_LAYER_RECOMPUTE, /* layer l's activations that the plan did not keep, regenerated */
	/* layer l's backward in two stages, so that a hook runs between
	 * them: this one, the attention's, d(res_mid) -> d(res[l]) and its
	 * half's gradients (tr_param.gunit), after TR_STAGE_LAYER_BACKWARD_MLP */
	TR_STAGE_LAYER_BACKWARD,
	TR_STAGE_EMBED_BACKWARD,  /* d(res[0]) -> the embedding's gradient */
	TR_STAGE_OPTIMIZER,       /* clip and AdamW: the trainer's (tr_model_clip_grads, tr_model_adamw) */
	/* FULL_OFFLOAD (train/plan.h: TR_OFFLOAD_RING): res[l], just written (by
	 * the embedding or layer l - 1), copied out to the host arena beside the
	 * next layers; the stage that next writes its ring slot waits for it. */
	TR_STAGE_OFFLOAD,
	/* FULL_OFFLOAD: res[l] copied back from the host into its ring slot,
	 * which the stage before it was the last to read; layer l's recompute
	 * waits for it. */
	TR_STAGE_PREFETCH,
	/* FULL_OFFLOAD with the fused attention: layer l's attention output and
	 * row statistics (acts.ring.K.*, K = l % TR_OFFLOAD_RING), just written
	 * by its forward, copied out to host.layers.l.*; layer l + RING's
	 * forward waits for it before writing the slot. Not for the last
	 * TR_OFFLOAD_RING layers (the backward finds theirs in the ring). */
	TR_STAGE_OFFLOAD_ATTENTION,
	/* ... and copied back into its slot after the stage that last read it
	 * (layer l + RING's backward); layer l's recompute waits for it. */
	TR_STAGE_PREFETCH_ATTENTION,
	/* layer l's MLP backward: d(res[l+1]) -> d(res_mid), the MLP half's
	 * gradients; right before its TR_STAGE_LAYER_BACKWARD */
	TR_STAGE_LAYER_BACKWARD_MLP,
	TR_STAGE_KIND_COUNT
};

struct tr_stage {
	enum tr_stage_kind kind;
	int layer;         /* TR_STAGE_LAYER*: the decoder layer; -1 otherwise */
	int r0, rows;      /* TR_STAGE_HEAD*: the rows of the chunk; 0, 0 otherwise */
};

/* "layer", "head_backward" ...; "?" out of range. */
const char *tr_stage_name(enum tr_stage_kind k);

struct tr_plan_buf {
	char name[64];     /* "acts.layers.3.att" */
	enum tr_arena arena;
	size_t offset;     /* bytes into the arena */
	size_t bytes;
};

/* Slots of the bf16 copy's ring (tr_plan.copy16_ring): a layer's
 * forward may read its slot while the next layer's is rounded. */
#define TR_COPY16_RING 2

/* Activation recompute (gradient checkpointing), per layer: what each
 * layer keeps from its forward for its backward, and what the backward
 * regenerates first (a TR_STAGE_LAYER_RECOMPUTE before the layer's
 * TR_STAGE_LAYER_BACKWARD) by running the forward's ops again on the same
 * inputs, so that gradients are the same bits as without recompute. What is
 * not kept lives once, for the layer being computed or recomputed
 * (acts.work.*); the last layer's is still there after the forward, so it
 * is never recomputed. A forward-only plan ignores the policy. */
enum tr_recompute {
	TR_RECOMPUTE_NONE,      /* every layer keeps everything its backward reads */
	TR_RECOMPUTE_SELECTIVE, /* keeps the products (GEMM outputs), the residual
				 * stream and the fused attention's output and row
				 * statistics; recomputes the norms, RoPE (under q/k
				 * norms), SwiGLU, LoRA dropout and the unfused
				 * attention (its T x T probabilities) */
	TR_RECOMPUTE_FULL,      /* keeps each layer's input (the residual stream)
				 * and its LoRA adapters' x A^T (as every policy:
				 * r floats a token an adapter) only; recomputes
				 * the layer but its last product */
	TR_RECOMPUTE_FULL_OFFLOAD, /* FULL, with the layer inputs kept in pinned
				 * host memory (the host arena) instead of the
				 * device: the device holds a ring of
				 * TR_OFFLOAD_RING of them. The forward copies each
				 * layer's input out as soon as it is written (a
				 * copy stream beside the math, gpu/backend.h:
				 * gpu_copy_to_host) and writes a ring slot only
				 * once the copy out of it is done; the backward
				 * copies layer l's input back into its slot while
				 * the layer above it recomputes and runs its
				 * backward. Copies are exact: the same bits as
				 * FULL, the device's acts smaller by L + 1 -
				 * TR_OFFLOAD_RING residual streams, at the cost of
				 * L of them in host memory */
	TR_RECOMPUTE_COUNT
};

/* The residual streams a FULL_OFFLOAD plan keeps on the device: layer l's
 * input (and the last layer's output, l = L) lives in slot l % this. Two:
 * a slot is written again two layers later, so each copy out overlaps a
 * whole layer's forward and each copy back a layer's recompute and
 * backward. The last TR_OFFLOAD_RING residual streams of a forward are still
 * in the ring when the backward starts (never copied back). */
#define TR_OFFLOAD_RING 2

/* "none", "selective", "full", "full-offload"; "?" out of range. */
const char *tr_recompute_name(enum tr_recompute r);
/* Whether r keeps only each layer's input (FULL, FULL_OFFLOAD; and the
 * adapters' x A^T, as every policy): a recompute reruns the whole layer but
 * its last product and those A products. */
static inline bool tr_recompute_full(enum tr_recompute r)
{
	return r == TR_RECOMPUTE_FULL || r == TR_RECOMPUTE_FULL_OFFLOAD;
}

/* Layer l's policy in a plan of policy r and selective_layers: SELECTIVE
 * for the first selective_layers layers under FULL or FULL_OFFLOAD, else
 * r. Which layers does not change the bytes (each keeps the same) or the
 * bits (every policy gives NONE's); the first ones are those a two-layer
 * model can recompute (the last layer never is: its working set is still
 * the forward's). */
static inline enum tr_recompute tr_layer_recompute(enum tr_recompute r, int selective_layers,
						   int l)
{
	return tr_recompute_full(r) && l < selective_layers ? TR_RECOMPUTE_SELECTIVE : r;
}

/* Sharded data parallel (ZeRO; the spec's memory.shard): which of a
 * gang's per-rank copies of the training state are split over its ranks
 * instead, each rank keeping a contiguous part of the trainable floats
 * (tr_plan.shard_lo .. shard_hi). OPTIMIZER: the AdamW moments; each rank
 * steps its part and the updated weights are all-gathered (train/ddp.h).
 * GRADIENTS: the summed gradients too: the grads buffer is the part
 * (shard_numel floats), and the backward writes each micro-batch's
 * gradients into work buffers — a ring of TR_GRAD_RING slots
 * (grads.ring.K: a layer's attention half's gradients in one, its MLP
 * half's in the other, tr_param.gunit) and the other tensors'
 * (grads.rest) — that are summed onto their owners' parts as each half's
 * backward ends (train/ddp.h). PARAMETERS (ZeRO-3, FSDP): the
 * weights too: the params buffer is the part's fp32 masters (shard_numel
 * floats), and each unit's weights (a layer's, the others') are gathered
 * from their owners into work buffers (params.ring.K, params.rest: the
 * fp32 copies, tr_param.wsoff; in the bf16 mode params16.ring.K,
 * params16.rest: every tensor's bf16 copy, tr_param.w16off, the matrices
 * gathered in bf16 only, tr_plan_gathered16) a layer ahead of their use
 * in the forward, and again for the backward (train/ddp.h); no whole
 * weights nor their bf16 copy. The order is the expected speed's: each
 * saves more memory and costs more. */
enum tr_shard {
	TR_SHARD_NONE,       /* every rank holds the whole state */
	TR_SHARD_OPTIMIZER,  /* ZeRO-1 */
	TR_SHARD_GRADIENTS,  /* ZeRO-2 */
	TR_SHARD_PARAMETERS, /* ZeRO-3, FSDP */
	TR_SHARD_COUNT
};
/* The policies a plan builds: all of them. */
#define TR_SHARD_BUILT 4
/* GRADIENTS: the gradient ring's slots, unit u's in slot u % this
 * (tr_param.gunit): a layer's attention half in one, its MLP half in the
 * other, each slot written again two units later, so that a unit's sums
 * overlap the next unit's backward (and a layer's recompute). PARAMETERS:
 * the gathered weights' slots, layer l's in slot l % this. */
#define TR_GRAD_RING 2

/* Whether plan options o keep only a part of the summed gradients
 * (GRADIENTS and past, over more than one rank). */
static inline bool tr_shard_grads(enum tr_shard s, int ranks)
{
	return s >= TR_SHARD_GRADIENTS && ranks > 1;
}
/* ... and only a part of the weights (PARAMETERS over more than one rank). */
static inline bool tr_shard_params(enum tr_shard s, int ranks)
{
	return s >= TR_SHARD_PARAMETERS && ranks > 1;
}

/* "none", "optimizer", "gradients", "parameters"; "?" out of range. */
const char *tr_shard_name(enum tr_shard s);

/* All zero past B and T: full fine-tuning of a causal LM. */
struct tr_plan_opts {
	int B;             /* micro-batch rows */
	int T;             /* sequence length */

	/* LoRA: rank > 0 adds PEFT adapters to the projections in lora_targets
	 * (bits of enum tr_lin) and freezes every base tensor. */
	int lora_rank;
	unsigned lora_targets;
	double lora_alpha;     /* scale = alpha / rank (alpha / sqrt(rank) with rslora) */
	bool lora_rslora;
	float lora_dropout;    /* [0, 1): dropout on the adapters' input */
	/* Frozen projection weights stored as NF4 (QLoRA, or a teacher); needs a
	 * frozen base. Double quantization packs the absmax values to 8 bits. */
	enum tr_quant base_quant;
	bool nf4_double_quant;
	/* Every other frozen matrix (the embedding, lm_head, the projections of
	 * a frozen base not in NF4: every frozen tensor but the norms' and the
	 * biases' vectors) stored in bf16 only, converted once at load; no fp32
	 * copy. gemm_bf16 implies it (the bf16 mode's GEMMs read bf16 weights;
	 * tr_plan_build sets it). Elsewhere (the CPU backend, the CUDA fp32
	 * mode) each use widens the weight exactly into scratch.deq: the same
	 * math as fp32 weights that were rounded to bf16. */
	bool frozen_bf16;
	/* > 0: sequence classification: a head score.weight [num_labels, C] on
	 * the last non-pad token replaces lm_head. Trained even under LoRA. */
	int num_labels;
	bool distill;          /* the student of a distillation: room for the KL terms */
	bool inference;        /* forward only (a teacher): everything frozen, no backward buffers */
	bool teacher_rows;     /* a teacher whose logits a student asks for by rows (chunked) */
	size_t logits_chunk_floats; /* the chunked head's bound (see logits_rows); 0: TR_LOGITS_CHUNK_FLOATS */
	/* > 0: a causal training head's chunks of at most this many rows,
	 * split evenly (multiples of 8 rows) over the chunks N rows take, in
	 * place of the bounds' rule (bench_train --logits-rows: the trade of
	 * memory for fewer, larger head products measured) */
	int logits_rows;
	/* The MLP's backward in parts of this many rows (a multiple of 8; B * T
	 * or more: whole rows; tests that hold the parts to whole rows), where
	 * no adapter is on the MLP; 0: the plan's rule (mlp_rows). */
	int mlp_rows;
	/* Attention is fused (gpu/backend.h: gpu_attention_flash): att and datt
	 * are B*NH*T row statistics instead of (B,NH,T,T) probabilities.
	 * tr_model_new sets it from its backend; estimates made without one set
	 * it from the precision (tr_method_plan_opts). */
	bool attention_lse;
	/* The backend rounds GEMM operands to bf16 into a scratch this plan
	 * holds (gpu/backend.h: gpu_gemm_bf16; scratch.gemm_bf16). Set like
	 * attention_lse. */
	bool gemm_bf16;
	enum tr_recompute recompute; /* TR_RECOMPUTE_NONE (0): keep everything */
	/* Under FULL and FULL_OFFLOAD: the first selective_layers layers keep
	 * what SELECTIVE keeps and are recomputed as SELECTIVE recomputes
	 * (tr_layer_recompute); 0 to num_layers, ignored under NONE and
	 * SELECTIVE. The steps between FULL and SELECTIVE, a layer's
	 * products at a time: what a memory bound takes where SELECTIVE does
	 * not fit (train/method.c). */
	int selective_layers;
	/* FULL_OFFLOAD's attention output on the host (tr_plan_offloads_attention):
	 * 0 where it pays, 1 wherever the device holds less for it (tests:
	 * small models never pay), -1 never. */
	int offload_attention;
	/* Sharding over shard_ranks ranks (0 or 1: none, whatever shard says),
	 * this plan being rank shard_rank's. Every rank's plan has the same
	 * bytes: only shard_lo and shard_hi differ. */
	enum tr_shard shard;
	int shard_ranks, shard_rank;
	/* Micro-batches a step, where the caller says (0: not said): what
	 * bounds the rows of an untied embedding's gradient (tr_plan.emb_slots) */
	int grad_accum;
};

struct tr_plan {
	struct tr_model_config cfg;
	struct tr_plan_opts opts;

	struct tr_param *params;      /* Hugging Face order, each layer's adapters after it */
	size_t nparams;
	size_t numel_params;          /* every tensor */
	size_t numel_trainable;       /* prefix of the grads arena */
	size_t numel_decay;           /* the first numel_decay trainable floats decay */
	/* The bf16 mode's rounded copy of the trainable floats
	 * (scratch.params_bf16) covers [copy16_lo, numel_trainable): an untied
	 * trainable embedding, first in the arena, is no GEMM's operand (its
	 * lookup reads fp32 rows), so it has no copy (Llama-3-8B: 1 GiB). */
	size_t copy16_lo;
	/* ... and under FULL and FULL_OFFLOAD recompute, where a full fine-tune
	 * trains every decoder layer's matrices (its weights not sharded: the
	 * gathers round them per layer then), the copy of those
	 * matrices — trainable floats [ring_lo, ring_lo + L * ring_numel),
	 * layer l's the run at ring_lo + l * ring_numel — lives in
	 * TR_COPY16_RING slots of ring_numel (slot l % TR_COPY16_RING, from the
	 * start of scratch.params_bf16), rounded from the fp32 masters before the
	 * layer's forward and again before its recompute or backward where its
	 * slot has held another layer since (train/model.c), not by AdamW. The
	 * rest of [copy16_lo, numel_trainable) keeps its copy after the slots,
	 * in order. The same bits reach every product; the policies that trade
	 * compute for memory trade the per-layer roundings too (Llama-3-8B at 32
	 * layers: 14.0 GiB of copy become 1.8). copy16_ring false: one copy of
	 * the whole range, kept. */
	bool copy16_ring;
	size_t ring_lo, ring_numel;
	size_t numel_f32;             /* fp32 floats: params (numel_trainable) + base.f32 (the frozen rest) */
	/* Sharded (opts.shard not NONE over shard_ranks > 1): each rank's part
	 * of the trainable floats is shard_numel = ceil(numel_trainable /
	 * ranks) long, rank r's [r * shard_numel, ...) clipped to
	 * numel_trainable: [shard_lo, shard_hi) (may be empty for the last
	 * ranks of a tiny model). The params buffer (the trainable tensors) is
	 * padded to ranks * shard_numel floats (numel_trainable_padded; not in
	 * numel_f32) so that the parts all-gather as equal counts; the padding
	 * is never read. optim.m and optim.v hold shard_numel floats,
	 * the part's moments. Unsharded: shard_lo 0, shard_hi = shard_numel =
	 * numel_trainable_padded = numel_trainable. GRADIENTS: the grads
	 * buffer holds shard_numel floats, the part's summed gradients
	 * (trainable float i at i - shard_lo), and the backward writes into
	 * work buffers of grad_slot_numel[k] floats each (tr_param.gslot). */
	size_t shard_numel, shard_lo, shard_hi, numel_trainable_padded;
	size_t grad_slot_numel[TR_GRAD_RING + 1];
	int grad_units; /* GRADIENTS: units of tr_param.gunit, 2L + 1 */
	/* PARAMETERS: floats of params.ring.K, params.rest (fp32) and bf16
	 * values of params16.ring.K, params16.rest */
	size_t wslot_numel[TR_GRAD_RING + 1];
	size_t wslot16_numel[TR_GRAD_RING + 1];
	/* Data parallel (opts.shard_ranks > 1) with a trainable embedding:
	 * its input-side gradient travels as rows — every rank's ids and
	 * d(res[0]) all-gathered into grads.rows_ids and grads.rows
	 * (shard_ranks * B*T rows each) and scattered by every rank into what
	 * it keeps (train/ddp.h) — not summed as a whole table. Where the
	 * embedding is not the head (untied, or a classifier's) and the
	 * gradients are sharded, it has no work buffer (tr_param.gunit, gslot,
	 * wunit and wslot -1): its rows go straight into the part; with the
	 * weights sharded too (embed_lookup_rows) it has no gathered copy
	 * either, and the lookup goes by rows: each rank writes the elements
	 * its part holds for every rank's ids, and each rank's rows are summed
	 * onto it. */
	bool embed_rows, embed_lookup_rows;
	/* GRADIENTS in the bf16 mode of a full fine-tune (no adapters, no
	 * classifier head, no bf16 ring; train/plan.c decides): a rank's fp32
	 * masters outside its part are not kept current. After AdamW the ranks
	 * gather the bf16 copy (the GEMMs' operands: half the bytes of the
	 * masters) and the fp32 tensors the ops read in fp32 (norms, biases:
	 * the floats that do not decay: train/ddp.h tr_ddp_step, a piece at a
	 * time as AdamW steps them); the
	 * lookup goes by rows (embed_lookup_rows); a checkpoint is saved from
	 * the parts gathered on the host (train/trainer.c, as PARAMETERS'). */
	bool masters_part;
	/* One rank training an untied embedding (not a GEMM's operand) with
	 * opts.grad_accum micro-batches a step: its gradient is kept by rows,
	 * not as a table — emb_slots rows (grads.emb_rows: B*T*grad_accum,
	 * fewer than the vocabulary), one a distinct id of the step in the order
	 * the ids first come, into which the backward folds its tokens'
	 * d(res[0]) (grads.emb_slot: each token's row) — and AdamW reads each
	 * id's row through grads.emb_row_of (each id's row, or -1: a zero
	 * gradient). The grads arena then holds the trainable floats
	 * [grads_lo, numel_trainable) (grads_lo: the embedding's floats). An
	 * id's rows fold in the order the table's would and AdamW runs the same
	 * arithmetic on them, so the same bits (Llama-3-8B: 2 GiB of gradient
	 * become 128 MiB at B4 x T2048). 0 (and grads_lo 0): the table in the
	 * grads arena. */
	size_t emb_slots, grads_lo;
	/* PARAMETERS in the bf16 mode with a ring: params16.rest (the other
	 * tensors' bf16 copy: the head's) is a view of the grads arena's
	 * region grads.rest's ring slots are views of too (grads.ring, the
	 * larger of the two), not a buffer of the params arena. The head's
	 * bf16 weights are read by the forward and the head's stages only,
	 * the ring written from the first layer's backward on, after they
	 * are: train/ddp.c zeroes each slot right before the stage that
	 * first writes it, and a forward's gathers start after the last
	 * micro-batch's sums are complete (tr_ddp_micro_begin, and the
	 * step's end before an evaluation). */
	bool rest16_in_ring;
	/* ... and, where the head's unit holds no tensor read before the
	 * final norm (no embedding: untied, or frozen) and there are two
	 * layers or more, the bf16 slot of layer L - 2's gathered weights
	 * (params16.ring.K, K = (L - 2) % TR_GRAD_RING) is in that region
	 * too, after the gradient slots, and params16.rest ends where the
	 * region ends, over that slot (and as much of the gradient slots as
	 * it needs): grads.ring is the larger of the two. The head's weights
	 * are then gathered once layer L - 2's forward is done with the slot
	 * (its forward stage's hook: the gather overlaps layer L - 1's
	 * forward), and layer L - 2's weights again after the final norm's
	 * backward, the head's last reader (overlapping layer L - 1's
	 * backward; train/ddp.c). K, or -1 where not so. */
	int rest16_slot;
	size_t numel_bf16;            /* bf16 values of the params16 buffer (opts.frozen_bf16) */
	size_t bf16_max_numel;        /* the largest bf16 tensor */
	size_t numel_frozen;          /* elements of frozen tensors */
	size_t frozen_bytes;          /* frozen tensors as stored: fp32, bf16 or the NF4 buffers */
	size_t nf4_numel, nf4_bytes;  /* the NF4-stored part of the above */
	/* Rows of logits (N, V) held at once. A causal training plan whose logits
	 * would exceed TR_LOGITS_CHUNK_FLOATS (or, not a distillation's, whose
	 * rows exceed TR_LOGITS_CHUNK_INPUTS / C) computes the LM head and its
	 * loss in chunks of this many rows, forward and (recomputing them)
	 * backward, so the full N x V tensor never exists; otherwise N. A
	 * distillation's student and teacher chunk by the floats alone: the same
	 * rows whatever their hidden sizes. */
	int logits_rows;
	/* The causal head's logits in bf16 (training in the bf16 mode, not a
	 * distillation): the head's GEMM writes them rounded once from its fp32
	 * sums, as transformers' head does under autocast; the cross-entropy
	 * reads them widened (its sums in fp32 and double as for fp32 logits)
	 * and writes their bf16 gradient over them, which the head's backward
	 * products read. A chunk holds twice the rows that fp32 logits of the
	 * same bytes would (the bounds below are in fp32's bytes). */
	bool logits16;
	/* Rows of a layer's MLP backward at once (a training plan): its
	 * d(h), d(gate) and d(up) are this many rows' (scratch.dh ...), the
	 * rows taken in parts whose weight gradients are added up in order —
	 * the same parts in every mode, so that sharded runs stay NONE's
	 * bits. ceil(N / 2) rounded up to 8 rows where no adapter is on the
	 * MLP's projections (an adapter's kept product and dropout are the
	 * whole batch's), that is fewer than N, and N rows would take more
	 * scratch (tr_plan_build compares the scratch arenas, the same in
	 * every mode); else N. */
	int mlp_rows;
	/* The MLP's d(h) in bf16 (scratch.dh16, the bf16 mode; with an
	 * adapter on the down projection, where lora_dx_group holds): its
	 * product writes it rounded once, as transformers' down_proj backward
	 * does under autocast, and SwiGLU's backward reads it (half the bytes,
	 * both ways), adding the adapter's share in fp32 as it reads. */
	bool dh16;
	/* The adapters' input-gradient shares added where d(x) is read or in
	 * one pass for the projections that share an input (gpu_lora_dx:
	 * swiglu_backward for down; lora_dx_add for q, k, v and for gate, up),
	 * not each in a GEMM pass over the fp32 d(x): the bf16 mode, LoRA
	 * without dropout (the shares would pass the masks), rank at most
	 * GPU_LORA_DX_RMAX. scratch.lora_du then holds GPU_LORA_DX_GROUP
	 * adapters' du. */
	bool lora_dx_group;
	size_t nf4_blocks, nf4_scales;/* absmax values; double-quantization floats */
	size_t nf4_max_numel;         /* the largest NF4 tensor (the dequantization scratch) */
	float lora_scale;             /* alpha / rank (rslora: / sqrt(rank)); 0 without LoRA */

	struct tr_plan_buf *bufs;
	size_t nbufs, capbufs;
	size_t arena_bytes[TR_ARENA_ALL]; /* [TR_ARENA_HOST]: pinned host memory */

	/* The step's schedule: stages[0, nforward) the forward, the rest the
	 * backward (none in a forward-only plan) ending with the optimizer. */
	struct tr_stage *stages;
	size_t nstages, nforward;
};

/* Whether a plan of o keeps the attention's output in fp32 (acts y) beside
 * its bf16 twin (y16): where something reads it — the unfused attention's
 * backward, fp32 GEMMs (no gemm_bf16), LoRA dropout (its mask applied to
 * fp32 inputs). The fused backward forms its row sums from y16. */
bool tr_plan_attention_y32(const struct tr_plan_opts *o);

/* Whether a PARAMETERS plan in the bf16 mode gathers trainable t in bf16
 * only (params16.*: its owner rounds its part and broadcasts that): a
 * matrix read by the GEMMs alone — every trainable 2-D tensor but the
 * embedding, which its lookup reads in fp32 (and, tied, the head in bf16:
 * gathered in fp32 and rounded). The others are gathered in fp32. */
/* Where trainable float i (copy16_lo <= i < numel_trainable) has its bf16
 * copy: an index into scratch.params_bf16 (copy16_ring: layer l's matrices
 * in slot l % TR_COPY16_RING). */
size_t tr_plan_copy16_index(const struct tr_plan *p, size_t i);
/* copy16_ring: the end of the decoder layers' matrices in the arena */
static inline size_t tr_plan_ring_hi(const struct tr_plan *p)
{
	return p->ring_lo + (size_t)p->cfg.num_layers * p->ring_numel;
}
bool tr_plan_gathered16(const struct tr_plan *p, const struct tr_param *t);

/* Whether decoder-layer tensor t is its layer's MLP half's (written by
 * TR_STAGE_LAYER_BACKWARD_MLP): post_attention_layernorm, and the gate, up
 * and down projections' weights, biases and adapters. */
bool tr_plan_mlp_half(const struct tr_param *t);

/* Whether the backward writes trainable t's gradient by overwriting, not
 * adding to, what holds it (the matmul's GPU_SET_DWEIGHT): a decoder
 * layer's projection weight, whose only writers are its weight products —
 * GRADIENTS and past, in its ring slot, at its first product of a
 * micro-batch (train/ddp.c leaves it out of the slot's zeroing); else in
 * the gradients arena at its first product of a step (tr_model_zero_grad
 * leaves it out); and the causal head's weight (a tied embedding's: its
 * lookup adds after, or goes by rows in a gang), at the first chunk of a
 * step (unsharded) or of a micro-batch (GRADIENTS: in grads.rest, which
 * tr_ddp_micro_begin zeroes but for it). */
bool tr_plan_dw_overwritten(const struct tr_plan *p, const struct tr_param *t);

/* Whether a FULL_OFFLOAD plan of cfg and o keeps each layer's attention
 * output and row statistics (fused attention: the row statistics, y16, and
 * y where tr_plan_attention_y32) on the host beside its input, so that its
 * recompute runs no attention (train/plan.c says when). */
bool tr_plan_offloads_attention(const struct tr_model_config *cfg, const struct tr_plan_opts *o);

/* Builds the plan. Validates that B, T and the config give sizes that fit
 * (no overflow, T <= max_position_embeddings is only a warning elsewhere),
 * and the method options (a LoRA rank above a projection's size, NF4 on a
 * base that trains, ...: TD_EINVAL naming the option). */
td_err tr_plan_build(struct tr_plan *p, const struct tr_model_config *cfg,
		     const struct tr_plan_opts *o, struct td_errbuf *eb);
void tr_plan_fini(struct tr_plan *p);

/* Sum over the device arenas (not the host arena). */
size_t tr_plan_total_bytes(const struct tr_plan *p);
/* The host arena's bytes: pinned host memory the job holds beside its
 * device bytes (FULL_OFFLOAD's layer inputs); 0 for every other plan. */
size_t tr_plan_host_bytes(const struct tr_plan *p);
/* The base arena's bytes (in tr_plan_total_bytes): what a job that shares
 * its frozen base with others (train/base.h) does not hold itself. */
size_t tr_plan_base_bytes(const struct tr_plan *p);
/* A digest of the base arena's layout: every frozen tensor's name, shape,
 * storage (fp32, bf16, NF4 and its block settings) and offset, and the
 * arena's buffers. Two plans whose signatures are equal read the same
 * bytes at the same places of a base arena: a base loaded for one serves
 * the other. Hex, 64 characters and a NUL. */
void tr_plan_base_signature(const struct tr_plan *p, char out[65]);
/* The buffer called name, or NULL. */
const struct tr_plan_buf *tr_plan_find(const struct tr_plan *p, const char *name);
const struct tr_param *tr_plan_param(const struct tr_plan *p, const char *name);

/* The acts arena's bytes and the plan's total for (cfg, o) under each
 * recompute policy (o->recompute is not read), indexed by enum tr_recompute. */
td_err tr_plan_recompute_bytes(const struct tr_model_config *cfg, const struct tr_plan_opts *o,
			       size_t acts[TR_RECOMPUTE_COUNT], size_t total[TR_RECOMPUTE_COUNT],
			       struct td_errbuf *eb);
/* The same with each policy's host arena (tr_plan_host_bytes): acts, total
 * and host may each be NULL. */
td_err tr_plan_policy_bytes(const struct tr_model_config *cfg, const struct tr_plan_opts *o,
			    size_t acts[TR_RECOMPUTE_COUNT], size_t total[TR_RECOMPUTE_COUNT],
			    size_t host[TR_RECOMPUTE_COUNT], struct td_errbuf *eb);

/* Human-readable plan: per arena, the largest buffers, and totals (the host
 * arena's apart); for a training plan, the recompute policy and the acts and
 * total of each (and FULL_OFFLOAD's host bytes). */
void tr_plan_print(const struct tr_plan *p, FILE *f);

/* Bytes as "1.23 GiB" into buf (returns buf). */
const char *tr_fmt_bytes(char *buf, size_t len, uint64_t bytes);

#endif
