/* The memory plan (contract 1 of DESIGN.md): every buffer a job needs — weights,
 * gradients, optimizer state, activations kept for the backward pass, scratch —
 * derived from the model config, method, batch and sequence length before
 * anything is allocated or any weight is read.
 *
 * Buffers live in arenas by lifetime. The engine allocates each arena once, at
 * the plan's size, and points into it at the plan's offsets; nothing else is
 * allocated on the device, so the plan's bytes are the job's device bytes.
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
	TR_ARENA_PARAMS,  /* fp32 master weights, whole job */
	TR_ARENA_GRADS,   /* fp32 gradients of trainable tensors, whole job */
	TR_ARENA_OPTIM,   /* AdamW m and v of trainable tensors, whole job */
	TR_ARENA_ACTS,    /* per-step activations kept for backward, inputs, RoPE tables */
	TR_ARENA_SCRATCH, /* per-step temporaries: logits, backward buffers */
	TR_ARENA_COUNT
};

const char *tr_arena_name(enum tr_arena a);

/* Offsets inside an arena are multiples of this (enough for any vector load). */
#define TR_PLAN_ALIGN 256

struct tr_param {
	char name[96];     /* model.layers.3.self_attn.q_proj.weight */
	int ndim;          /* 1 or 2 */
	int64_t shape[2];
	size_t numel;
	bool trainable;
	bool decay;        /* weight decay applies: trainable and ndim >= 2 */
	size_t offset;     /* in floats, into the params arena */
	size_t goffset;    /* in floats, into the grads arena (and each half of optim) */
};

struct tr_plan_buf {
	char name[64];     /* "acts.layers.3.att" */
	enum tr_arena arena;
	size_t offset;     /* bytes into the arena */
	size_t bytes;
};

struct tr_plan_opts {
	int B;             /* micro-batch rows */
	int T;             /* sequence length */
};

struct tr_plan {
	struct tr_model_config cfg;
	struct tr_plan_opts opts;

	struct tr_param *params;      /* Hugging Face order */
	size_t nparams;
	size_t numel_params;          /* every tensor */
	size_t numel_trainable;       /* prefix of the grads arena */
	size_t numel_decay;           /* the first numel_decay trainable floats decay */

	struct tr_plan_buf *bufs;
	size_t nbufs, capbufs;
	size_t arena_bytes[TR_ARENA_COUNT];
};

/* Builds the plan. Validates that B, T and the config give sizes that fit
 * (no overflow, T <= max_position_embeddings is only a warning elsewhere). */
td_err tr_plan_build(struct tr_plan *p, const struct tr_model_config *cfg,
		     const struct tr_plan_opts *o, struct td_errbuf *eb);
void tr_plan_fini(struct tr_plan *p);

/* Sum over arenas. */
size_t tr_plan_total_bytes(const struct tr_plan *p);
/* The buffer called name, or NULL. */
const struct tr_plan_buf *tr_plan_find(const struct tr_plan *p, const char *name);
const struct tr_param *tr_plan_param(const struct tr_plan *p, const char *name);

/* Human-readable plan: per arena, the largest buffers, and totals. */
void tr_plan_print(const struct tr_plan *p, FILE *f);

/* Bytes as "1.23 GiB" into buf (returns buf). */
const char *tr_fmt_bytes(char *buf, size_t len, uint64_t bytes);

#endif
