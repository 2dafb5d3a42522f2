/* The transformer's forward and backward over backend ops.
 *
 * Shape letters as in kernels/cpu/ops.h: N = B*T rows, C hidden, H = NH*HS,
 * KV = NKV*HS, I intermediate, V vocab, L layers, R LoRA rank, NL labels.
 *
 * Per layer l (pre-norm decoder block):
 *   ln1 = rmsnorm(res[l]); q,k,v = proj(ln1) (+bias); [qwen3: q,k = rmsnorm per head]
 *   q,k = rope(q,k); y = attention(q,k,v); res_mid = res[l] + o_proj(y)
 *   ln2 = rmsnorm(res_mid); h = silu(gate(ln2)) * up(ln2); res[l+1] = res_mid + down(h)
 * then lnf = rmsnorm(res[L]) and a head:
 *   causal      logits = lnf @ lm_head^T (lm_head = embedding if tied), CE
 *               (or, for a distillation student, the KL + CE of kernels/cpu/ops.h)
 *   classifier  pooled = lnf[row of each sequence's last non-pad token];
 *               logits = pooled @ score^T (B, NL), CE over the labels
 * Every projection goes through linear_forward/linear_backward, where the
 * methods live: an NF4 weight is dequantized into scratch for each use, and a
 * LoRA adapter adds scale * (dropout(x) A^T) B^T (PEFT's order of operations).
 * Every weight reaches an op through weight_of, as the backend's GEMMs read
 * it: in the bf16 mode its bf16 twin (a trainable weight's copy, rounded at
 * each update; a frozen weight's own bf16 storage; an NF4 weight dequantized
 * to bf16), elsewhere fp32 (a bf16-stored frozen weight widened into
 * scratch, exactly).
 * The step is the plan's list of stages (train/plan.h: struct tr_stage):
 * embedding, layer l, final norm, head chunks, then the head's backward
 * chunks, final norm, layer l's backward from the last, embedding, and the
 * optimizer; every entry point walks that list (forward_walk,
 * tr_model_backward). What a layer's backward reads is kept in the acts
 * arena, per layer or, where the plan's recompute policy does not keep it,
 * in one working set that a "layer l recompute" stage refills before layer
 * l's backward (layer_forward with recompute); the backward uses the scratch
 * arena's buffers. Under FULL_OFFLOAD the layer inputs res[l] live in the
 * host arena, and on the device in a ring of TR_OFFLOAD_RING slots that the
 * plan's offload and prefetch stages copy out of and back into (on the
 * backend's copy stream, beside the math); a stage that writes a slot, or
 * recomputes from one, first waits for the slot's copy. */
#include "train/model.h"

#include <assert.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Only for host-side computations: rope_cache() (the tables are uploaded like
 * weights) and the NF4 quantizer (weights are uploaded packed). No op is
 * called from here except through the backend. */
#include "kernels/cpu/ops.h"

_Static_assert(TR_NF4_BLOCK == NF4_BLOCK && TR_NF4_DQ_BLOCK == NF4_DQ_BLOCK,
	       "train/plan.h and kernels/cpu/ops.h disagree on the NF4 geometry");

/* One projection of one layer: weight (fp32, bf16 or NF4), bias, adapter. */
struct lin {
	const struct tr_param *wp;  /* the weight's entry in the plan (weight_of) */
	float *b;                   /* NULL without bias */
	float *dw, *db;             /* NULL where frozen */
	float *A, *B, *dA, *dB;     /* LoRA; d* NULL in a forward-only plan; A, B NULL where
				     * there is no adapter, or PARAMETERS gathers it in bf16 only */
	bool lora;                  /* the projection has an adapter */
	gpu_bf16 *A16, *B16;        /* the adapter's bf16 copies (bf16 mode), else NULL */
	float *u;                   /* acts: scale * (x A^T), (N, R) */
	float *xd;                  /* acts: dropout(x), (N, in); NULL without dropout */
	int in, out;
};

/* The norms of one layer (weights or their gradients). */
struct layer_w {
	float *ln1, *qn, *kn, *ln2;
};

struct layer_a {
	float *ln1, *ln1_rstd, *qraw, *q_rstd, *kraw, *k_rstd, *q, *k, *v, *att, *y;
	float *res_mid, *ln2, *ln2_rstd, *gate, *up, *h;
	/* bf16 twins of the products' inputs (bf16 mode, train/plan.c); ln1,
	 * ln2 and h are then NULL unless LoRA dropout needs them */
	gpu_bf16 *ln1_16, *y16, *ln2_16, *h16;
	gpu_bf16 *gate16, *up16; /* the MLP's products in bf16 only (gate, up NULL) */
	/* q, k, v (after RoPE) in bf16 only, as the fused attention reads them
	 * (q, k, v NULL; staged in fp32 in the model's q32, k32, v32, or
	 * q32 alone as one product's rows: qkv_forward_fused) */
	gpu_bf16 *q16, *k16, *v16;
};

enum head_kind { HEAD_CAUSAL, HEAD_DISTILL, HEAD_CLASSIFY };

struct tr_model {
	struct gpu_backend *be;
	struct tr_plan plan;
	void *arena[TR_ARENA_ALL];       /* [TR_ARENA_HOST]: pinned host memory (gpu_host_alloc) */

	float *params, *grads, *m1, *m2;
	/* A clip's coefficient not yet applied to grads (1: none): AdamW reads
	 * the gradients times it (gpu_adamw_update's gscale), saving a pass
	 * over them; anything else reading grads first applies it (settle). */
	float gscale;
	/* GRADIENTS (plan.grad_slot_numel): the work buffers the backward
	 * writes gradients into (grads.ring.K, grads.rest; NULL where none);
	 * grads is then the rank's part of the summed gradients. */
	float *gslot[TR_GRAD_RING + 1];
	/* TD_TEST_POISON_GRADS set (the unit tests' poison_env): zero_grad
	 * fills the floats it leaves to be overwritten with NaN, so a float
	 * that the first micro-batch only added to would show in every loss
	 * after. */
	bool poison_grads;
	/* The ranges of grads that zero_grad zeroes, where it zeroes only some
	 * (NULL: all of it): unsharded, every trainable float but the tensors
	 * whose first product of a step overwrites (tr_plan_dw_overwritten);
	 * GRADIENTS, the part's floats that the first micro-batch's reductions
	 * add to instead of writing (tr_model_zero_part_only). fresh: this
	 * step's first backward is still to come (unsharded, those products
	 * overwrite). */
	struct { size_t off, n; } *zr;
	size_t nzr;
	bool fresh;
	/* the causal head's weight gradient overwritten by a step's first
	 * chunk, or a micro-batch's with sharded gradients
	 * (tr_plan_dw_overwritten, once at creation); head_fresh: that chunk
	 * is still to come (head_weight_grad) */
	bool head_overwrites, head_fresh;
	/* PARAMETERS: the weights gathered into the same layout (params.ring.K,
	 * params.rest) and their bf16 rounding (params16.*, the bf16 mode);
	 * params is then the part's fp32 masters, and wholes (when set:
	 * tr_model_set_whole_weights) every trainable float on the host, for
	 * tr_model_get_param. */
	bool wpart;
	bool gpart;                      /* GRADIENTS: grads is the part */
	float *wslot[TR_GRAD_RING + 1];
	gpu_bf16 *wslot16[TR_GRAD_RING + 1];
	const float *wholes;
	float *base32;                   /* frozen fp32 tensors (base.f32, the base arena) */
	/* The base arena belongs to a train/base.h entry, not to this model
	 * (tr_model_new_shared): never allocated nor freed here; base_loaded:
	 * it held the weights when the model was made, and nothing here writes
	 * it (tr_model_load checks the files' tensors and skips them;
	 * tr_model_set_param refuses). */
	bool base_shared, base_loaded;
	gpu_bf16 *params16;              /* frozen tensors stored in bf16 (plan.opts.frozen_bf16) */
	gpu_bf16 *copy16;                /* bf16 mode: the trainable prefix of params, rounded */
	/* plan.copy16_ring: the layer whose matrices each slot holds rounded
	 * (-1: none, or stale since the masters changed) */
	int ring_holds[TR_COPY16_RING];
	/* lm_head == embed when tied; NULL for a classifier (weights: weight_of) */
	const struct tr_param *embed, *lm_head, *score;
	float *lnf;
	float *dembed, *dlnf, *dlm_head; /* NULL where frozen */
	float *dscore;                   /* classifier head (NL, C) */
	/* Data parallel's embedding rows (train/plan.h: embed_rows): every
	 * rank's d(res[0]) rows and ids (grads.rows, grads.rows_ids); while
	 * take_rows the embedding's backward leaves the scatter of d(res[0])
	 * to the stage hook, and with plan.embed_lookup_rows the lookup is the
	 * stage hook's too (train/ddp.h). */
	float *rows;
	int32_t *rows_ids;
	bool take_rows;
	struct layer_w *w, *g;           /* [L] */
	struct lin (*lin)[TR_LIN_COUNT]; /* [L][TR_LIN_COUNT] */

	/* NF4 storage; the scratch a frozen weight is materialised in for one
	 * use (fp32, or an NF4 one in bf16 in the bf16 mode) and NF4's absmax. */
	uint8_t *nf4_codes;
	float *nf4_absmax, *nf4_scale;
	int8_t *nf4_absmax_q;
	void *deq;
	float *deq_absmax;

	int32_t *ids, *targets, *pool_idx;
	float *rope_cos, *rope_sin;
	float **res;                     /* [L+1]; FULL_OFFLOAD: res[l] is ring slot l % TR_OFFLOAD_RING */
	float **res_host;                /* [L]: FULL_OFFLOAD's layer inputs in the host arena; else NULL */
	/* FULL_OFFLOAD with the fused attention (train/plan.c: off_att): ring
	 * slot k's attention output and statistics (acts.ring.k.*, one span of
	 * att_span bytes), and layer l's on the host (NULL for the last
	 * TR_OFFLOAD_RING layers, which stay in the ring); else NULL. */
	char *att_ring[TR_OFFLOAD_RING];
	char **att_host;                 /* [L] */
	size_t att_span;
	struct layer_a *a;               /* [L] */
	float *lnf_out, *lnf_rstd, *pooled;
	float *logits, *losses, *kl, *dres, *dln, *dq, *dk, *dv, *dqraw, *dkraw, *dy, *datt, *dh,
		*dgate, *dup, *dpooled, *lora_du, *lora_dx, *gemm_bf16;
	float *q32, *k32, *v32;          /* q, k, v in fp32 for the layer being computed (q16 ...) */
	size_t gemm_bf16_bytes;
	/* the fused attention backward's dS room (plan: scratch.att_ds, from
	 * dq on), lent only where that backward does not write dq, dk, dv */
	void *att_ds;
	size_t att_ds_bytes;
	gpu_bf16 *dgate16, *dup16; /* bf16 mode: the gradients the products read */
	/* bf16 mode: dres's twin, written by each norm's backward that
	 * updates dres, for the o and down projections' backward (and their
	 * adapters) that read it next */
	gpu_bf16 *dres16;
	gpu_bf16 *dh16;            /* plan.dh16: d(h) in bf16 (dh NULL) */
	/* plan.logits16: the causal head's logits in bf16, and then their
	 * gradient over them (logits NULL) */
	gpu_bf16 *logits16;

	int32_t *host_targets;           /* (N) */
	int32_t *host_ids;               /* (N) of the last forward */
	/* plan.emb_slots: the untied embedding's gradient by rows — its rows
	 * (grads.emb_rows); on the device each token's row (emb_slot) and each
	 * id's (emb_row_of, for AdamW); on the host an id's row (-1: none this
	 * step), each row's id, the tokens' rows; the rows taken this step */
	float *emb_rows;
	int32_t *emb_slot, *emb_row_of;
	int32_t *slot_of, *slot_id, *tok_slot;
	size_t nslots;
	float *host_losses, *host_kl;    /* (N) */
	int32_t *host_pool;              /* (B) */
	bool logits_valid;
	/* layer_forward is running a layer's recompute (its adapters' u then
	 * are the forward's: lora_input) */
	bool recomputing;
	/* backwards run to their end (adapters_first) */
	int64_t steps_done;
	/* The layer stages' graphs (STAGED): per stage of the plan, its
	 * executable graph (gpu/backend.h: graph_end) and its calls so far
	 * (-1: its recording failed, no graph again); NULL: none (the CPU
	 * backend). graph_holds: ring_holds when a recording began. */
	struct stage_graph {
		void *exec;
		int calls;
	} *graph;
	int graph_holds[TR_COPY16_RING];
	/* tr_model_fuse_head_backward: armed for the next forward (fuse_head),
	 * and done by the last one (head_done, with its dloss). */
	bool fuse_head, head_done;
	float fuse_dloss;
	bool head_loaded;
	enum head_kind last_head;        /* of the last forward */
	struct tr_model *teacher;        /* of the last distillation forward */
	float temperature, alpha;
	int pad_id;
	uint64_t dropout_seed;
	bool dropout_armed;              /* the next forward applies LoRA dropout */
	bool dropout_used;               /* the last forward did */
	tr_stage_hook stage_hook;        /* data parallel: after each backward stage */
	void *stage_ctx;
};

const struct tr_plan *tr_model_plan(const struct tr_model *m)
{
	return &m->plan;
}

struct gpu_backend *tr_model_backend(const struct tr_model *m)
{
	return m->be;
}

bool tr_model_head_loaded(const struct tr_model *m)
{
	return m->head_loaded;
}

void tr_model_set_pad_id(struct tr_model *m, int pad_id)
{
	m->pad_id = pad_id;
}

void tr_model_set_dropout_seed(struct tr_model *m, uint64_t seed)
{
	m->dropout_seed = seed;
	m->dropout_armed = true;
}

static void *buf(struct tr_model *m, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void *buf(struct tr_model *m, const char *fmt, ...)
{
	char name[64];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(name, sizeof(name), fmt, ap);
	va_end(ap);
	const struct tr_plan_buf *b = tr_plan_find(&m->plan, name);
	if (!b)
		return NULL; /* a buffer the config does not need (e.g. qraw without q/k norm) */
	return (char *)m->arena[b->arena] + b->offset;
}

/* Layer l's activation what: its own (acts.layers.l.what), or the working
 * set's that every layer shares where the plan recomputes it
 * (acts.work.what); NULL when the plan has neither. */
static void *act(struct tr_model *m, int l, const char *what)
{
	void *p = buf(m, "acts.layers.%d.%s", l, what);
	if (!p) /* FULL_OFFLOAD's attention output: the layer's ring slot */
		p = buf(m, "acts.ring.%d.%s", l % TR_OFFLOAD_RING, what);
	return p ? p : buf(m, "acts.work.%s", what);
}

/* The span [start, end) of its arena that the buffers named prefix* cover
 * (0, 0 when none). */
static void span_of(const struct tr_plan *p, const char *prefix, size_t *start, size_t *end)
{
	const size_t n = strlen(prefix);
	*start = SIZE_MAX;
	*end = 0;
	for (size_t i = 0; i < p->nbufs; i++) {
		const struct tr_plan_buf *b = &p->bufs[i];
		if (strncmp(b->name, prefix, n) != 0)
			continue;
		*start = b->offset < *start ? b->offset : *start;
		*end = b->offset + b->bytes > *end ? b->offset + b->bytes : *end;
	}
	if (*start == SIZE_MAX)
		*start = 0;
}

/* The fp32 tensor (or gradient) of p: NULL when p is absent, frozen (a
 * gradient), or stored otherwise (NF4, bf16: weight_of). */
static float *param_ptr(struct tr_model *m, const struct tr_param *p, bool grad)
{
	if (!p || p->nf4 || p->bf16)
		return NULL;
	if (grad) {
		if (!p->trainable)
			return NULL;
		if (p->gslot >= 0) /* GRADIENTS: its work buffer (train/plan.h) */
			return m->gslot[p->gslot] + p->gsoff;
		/* GRADIENTS without a work buffer: an embedding whose rows go
		 * straight to the part (plan.embed_rows); none either for an
		 * embedding kept by rows (plan.emb_slots) */
		if (m->gpart || p->goffset < m->plan.grads_lo)
			return NULL;
		return m->grads + (p->goffset - m->plan.grads_lo);
	}
	if (p->trainable && m->wpart) /* PARAMETERS: where it is gathered (bf16 only, or by rows: none) */
		return tr_plan_gathered16(&m->plan, p) || p->wslot < 0 ? NULL
									: m->wslot[p->wslot] + p->wsoff;
	return p->trainable ? m->params + p->offset : m->base32 + p->offset;
}

/* The bf16 copy of trainable float i (scratch.params_bf16 covers
 * [plan.copy16_lo, numel_trainable): tr_plan_copy16_index), or NULL where
 * it has none. Contiguous with the copies of the floats after i up to the
 * end of i's run: a layer's matrices in the ring (copy16_ring), or the
 * rest before or after them. */
static gpu_bf16 *copy16_at(struct tr_model *m, size_t i)
{
	if (!m->copy16 || i < m->plan.copy16_lo)
		return NULL;
	return m->copy16 + tr_plan_copy16_index(&m->plan, i);
}

/* Layer l's matrices rounded into their ring slot, unless it holds them
 * already (plan.copy16_ring; nothing otherwise): before any op of the
 * layer reads its bf16 weights. */
static void ring_ensure(struct tr_model *m, int l)
{
	const struct tr_plan *p = &m->plan;
	if (!p->copy16_ring || !m->copy16 || m->ring_holds[l % TR_COPY16_RING] == l)
		return;
	const size_t a = p->ring_lo + (size_t)l * p->ring_numel;
	gpu_bf16_round(m->be, copy16_at(m, a), m->params + a, p->ring_numel);
	m->ring_holds[l % TR_COPY16_RING] = l;
}

/* The masters changed: no ring slot holds what they round to. */
static void ring_stale(struct tr_model *m)
{
	for (int k = 0; k < TR_COPY16_RING; k++)
		m->ring_holds[k] = -1;
}

/* The bf16 copy of trainable p (the bf16 mode), else NULL. */
static gpu_bf16 *copy16_ptr(struct tr_model *m, const struct tr_param *p)
{
	if (!p || !p->trainable)
		return NULL;
	if (m->wpart)
		return p->wslot >= 0 && m->wslot16[p->wslot] ? m->wslot16[p->wslot] + p->w16off : NULL;
	return copy16_at(m, p->offset);
}

/* Rounds params [lo, hi) into their bf16 copy where they have one; the
 * layers' matrices under copy16_ring are rounded when a layer needs them
 * (ring_ensure), so their slots go stale instead. */
static void copy16_round(struct tr_model *m, size_t lo, size_t hi)
{
	if (lo < m->plan.copy16_lo)
		lo = m->plan.copy16_lo;
	if (hi <= lo || !m->copy16)
		return;
	if (m->plan.copy16_ring) {
		const size_t r0 = m->plan.ring_lo, r1 = tr_plan_ring_hi(&m->plan);
		if (lo < r1 && hi > r0)
			ring_stale(m);
		if (lo < r0) {
			const size_t e = hi < r0 ? hi : r0;
			gpu_bf16_round(m->be, copy16_at(m, lo), m->params + lo, e - lo);
		}
		if (hi > r1) {
			const size_t b = lo > r1 ? lo : r1;
			gpu_bf16_round(m->be, copy16_at(m, b), m->params + b, hi - b);
		}
		return;
	}
	gpu_bf16_round(m->be, copy16_at(m, lo), m->params + lo, hi - lo);
}

/* Parameter (or gradient) pointer by name; NULL as param_ptr. */
static float *pptr(struct tr_model *m, bool grad, const char *fmt, int l)
{
	char name[96];
	snprintf(name, sizeof(name), fmt, l);
	return param_ptr(m, tr_plan_param(&m->plan, name), grad);
}

static void bind_lin(struct tr_model *m, int l, int k)
{
	const struct tr_model_config *c = &m->plan.cfg;
	struct lin *L = &m->lin[l][k];
	char name[96];
	tr_lin_dims(c, k, &L->in, &L->out);
	snprintf(name, sizeof(name), "model.layers.%d.%s.weight", l, tr_lin_path(k));
	L->wp = tr_plan_param(&m->plan, name);
	assert(L->wp);
	L->dw = param_ptr(m, L->wp, true);
	snprintf(name, sizeof(name), "model.layers.%d.%s.bias", l, tr_lin_path(k));
	const struct tr_param *bp = tr_plan_param(&m->plan, name);
	L->b = param_ptr(m, bp, false);
	L->db = param_ptr(m, bp, true);
	snprintf(name, sizeof(name), "base_model.model.model.layers.%d.%s.lora_A.weight", l,
		 tr_lin_path(k));
	const struct tr_param *ap = tr_plan_param(&m->plan, name);
	snprintf(name, sizeof(name), "base_model.model.model.layers.%d.%s.lora_B.weight", l,
		 tr_lin_path(k));
	const struct tr_param *bp2 = tr_plan_param(&m->plan, name);
	L->A = param_ptr(m, ap, false);
	L->dA = param_ptr(m, ap, true);
	L->B = param_ptr(m, bp2, false);
	L->dB = param_ptr(m, bp2, true);
	L->A16 = copy16_ptr(m, ap);
	L->B16 = copy16_ptr(m, bp2);
	snprintf(name, sizeof(name), "lora_u.%s", tr_lin_name(k));
	L->u = act(m, l, name);
	snprintf(name, sizeof(name), "lora_x.%s", tr_lin_name(k));
	L->xd = act(m, l, name);
	L->lora = ap != NULL;
	assert(!ap == !bp2 && (!ap || L->u));
}

static int zr_by_off(const void *a, const void *b)
{
	const size_t x = *(const size_t *)a, y = *(const size_t *)b;
	return x < y ? -1 : x > y;
}

/* Unsharded training: the arena's ranges that zero_grad zeroes — all of
 * it but the tensors whose first product of a step overwrites their
 * gradient (tr_plan_dw_overwritten: the decoder's projection weights,
 * which sit together, decayed first, and the causal head's): for a full
 * fine-tune an untied embedding and the norms and biases (train/plan.c). None overwritten (LoRA, frozen
 * layers), or out of memory: m->zr stays NULL, the whole arena is zeroed. */
static void zero_ranges(struct tr_model *m)
{
	const struct tr_plan *p = &m->plan;
	if (p->opts.inference || tr_shard_grads(p->opts.shard, p->opts.shard_ranks) ||
	    !p->numel_trainable)
		return;
	size_t n = 0;
	for (size_t i = 0; i < p->nparams; i++)
		n += tr_plan_dw_overwritten(p, &p->params[i]);
	size_t *iv = n ? calloc(2 * n, sizeof(*iv)) : NULL;
	if (!iv)
		return;
	size_t k = 0;
	for (size_t i = 0; i < p->nparams; i++)
		if (tr_plan_dw_overwritten(p, &p->params[i])) {
			iv[2 * k] = p->params[i].goffset;
			iv[2 * k + 1] = p->params[i].goffset + p->params[i].numel;
			k++;
		}
	qsort(iv, n, 2 * sizeof(*iv), zr_by_off);
	/* the complement of the sorted, disjoint tensors in [grads_lo,
	 * numel_trainable) (the floats the arena holds: an embedding below
	 * grads_lo is kept by rows), as offsets into the arena */
	if (!(m->zr = calloc(n + 1, sizeof(*m->zr)))) {
		free(iv);
		return;
	}
	const size_t lo = p->grads_lo;
	size_t at = lo;
	for (size_t i = 0; i < n; i++) {
		assert(iv[2 * i] >= lo);
		if (iv[2 * i] > at)
			m->zr[m->nzr++] = (__typeof__(*m->zr)){at - lo, iv[2 * i] - at};
		at = iv[2 * i + 1];
	}
	if (p->numel_trainable > at)
		m->zr[m->nzr++] = (__typeof__(*m->zr)){at - lo, p->numel_trainable - at};
	free(iv);
}

static void bind(struct tr_model *m)
{
	const struct tr_model_config *c = &m->plan.cfg;
	m->params = buf(m, "params");
	m->base32 = buf(m, "base.f32");
	m->params16 = buf(m, "params16");
	m->copy16 = buf(m, "scratch.params_bf16");
	ring_stale(m);
	m->grads = buf(m, "grads");
	m->emb_rows = buf(m, "grads.emb_rows");
	m->emb_slot = buf(m, "grads.emb_slot");
	m->emb_row_of = buf(m, "grads.emb_row_of");
	for (int k = 0; k <= TR_GRAD_RING; k++)
		m->gslot[k] = k < TR_GRAD_RING ? buf(m, "grads.ring.%d", k) : buf(m, "grads.rest");
	m->wpart = tr_shard_params(m->plan.opts.shard, m->plan.opts.shard_ranks);
	m->gscale = 1.0f;
	zero_ranges(m);
	m->gpart = tr_shard_grads(m->plan.opts.shard, m->plan.opts.shard_ranks);
	m->rows = buf(m, "grads.rows");
	m->rows_ids = buf(m, "grads.rows_ids");
	/* sharded gradients: every micro-batch's rows go to the parts */
	m->take_rows = m->gpart && m->plan.embed_rows;
	for (int k = 0; m->wpart && k <= TR_GRAD_RING; k++) {
		m->wslot[k] = k < TR_GRAD_RING ? buf(m, "params.ring.%d", k) : buf(m, "params.rest");
		m->wslot16[k] = k < TR_GRAD_RING ? buf(m, "params16.ring.%d", k) : buf(m, "params16.rest");
	}
	m->m1 = buf(m, "optim.m");
	m->m2 = buf(m, "optim.v");
	m->nf4_codes = buf(m, "nf4.codes");
	m->nf4_absmax = buf(m, "nf4.absmax");
	m->nf4_absmax_q = buf(m, "nf4.absmax_q");
	m->nf4_scale = buf(m, "nf4.absmax_scale");
	m->embed = tr_plan_param(&m->plan, "model.embed_tokens.weight");
	m->lnf = pptr(m, false, "model.norm.weight", 0);
	m->dembed = pptr(m, true, "model.embed_tokens.weight", 0);
	m->dlnf = pptr(m, true, "model.norm.weight", 0);
	m->score = tr_plan_param(&m->plan, "score.weight");
	m->dscore = pptr(m, true, "score.weight", 0);
	if (m->plan.opts.num_labels > 0) {
		m->lm_head = NULL;
		m->dlm_head = NULL;
	} else if (c->tie_word_embeddings) {
		m->lm_head = m->embed;
		m->dlm_head = m->dembed;
	} else {
		m->lm_head = tr_plan_param(&m->plan, "lm_head.weight");
		m->dlm_head = pptr(m, true, "lm_head.weight", 0);
	}
	m->head_overwrites = m->lm_head && m->dlm_head && tr_plan_dw_overwritten(&m->plan, m->lm_head);
	for (int l = 0; l < c->num_layers; l++) {
		for (int gr = 0; gr < 2; gr++) {
			struct layer_w *w = gr ? &m->g[l] : &m->w[l];
			w->ln1 = pptr(m, gr, "model.layers.%d.input_layernorm.weight", l);
			w->qn = pptr(m, gr, "model.layers.%d.self_attn.q_norm.weight", l);
			w->kn = pptr(m, gr, "model.layers.%d.self_attn.k_norm.weight", l);
			w->ln2 = pptr(m, gr, "model.layers.%d.post_attention_layernorm.weight", l);
		}
		for (int k = 0; k < TR_LIN_COUNT; k++)
			bind_lin(m, l, k);
	}
	m->ids = buf(m, "acts.ids");
	m->targets = buf(m, "acts.targets");
	m->pool_idx = buf(m, "acts.pool_idx");
	m->pooled = buf(m, "acts.pooled");
	m->rope_cos = buf(m, "acts.rope_cos");
	m->rope_sin = buf(m, "acts.rope_sin");
	if (m->att_host) {
		/* One copy moves a layer's set: the plan lays every set out alike
		 * (train/plan.c), which each host layer's span is checked to. */
		size_t s0, e0, s, e;
		span_of(&m->plan, "acts.ring.0.", &s0, &e0);
		m->att_span = e0 - s0;
		for (int k = 0; k < TR_OFFLOAD_RING && k < c->num_layers; k++)
			m->att_ring[k] = buf(m, "acts.ring.%d.att", k);
		for (int l = 0; l < c->num_layers; l++) {
			char prefix[32];
			snprintf(prefix, sizeof(prefix), "host.layers.%d.", l);
			span_of(&m->plan, prefix, &s, &e);
			m->att_host[l] = e > s ? buf(m, "host.layers.%d.att", l) : NULL;
			assert(!m->att_host[l] || e - s == m->att_span);
		}
		assert(m->att_ring[0] == (char *)m->arena[TR_ARENA_ACTS] + s0);
	}
	for (int l = 0; l <= c->num_layers; l++) {
		m->res[l] = buf(m, "acts.res.%d", l);
		if (m->res_host) {
			m->res[l] = buf(m, "acts.res_ring.%d", l % TR_OFFLOAD_RING);
			if (l < c->num_layers)
				m->res_host[l] = buf(m, "host.res.%d", l);
		}
	}
	for (int l = 0; l < c->num_layers; l++) {
		struct layer_a *a = &m->a[l];
		if (l > 0 && m->plan.opts.inference) {
			*a = m->a[0]; /* forward only: one set of buffers for every layer */
			continue;
		}
#define A(f) a->f = act(m, l, #f)
		A(ln1);
		A(ln1_16);
		A(y16);
		A(ln2_16);
		A(h16);
		A(gate16);
		A(up16);
		A(q16);
		A(k16);
		A(v16);
		A(ln1_rstd);
		A(qraw);
		A(q_rstd);
		A(kraw);
		A(k_rstd);
		A(q);
		A(k);
		A(v);
		A(att);
		A(y);
		A(res_mid);
		A(ln2);
		A(ln2_rstd);
		A(gate);
		A(up);
		A(h);
#undef A
	}
	m->lnf_out = buf(m, "acts.lnf");
	m->lnf_rstd = buf(m, "acts.lnf_rstd");
#define S(f) m->f = buf(m, "scratch." #f)
	S(logits);
	S(losses);
	S(kl);
	S(dres);
	S(dln);
	S(dq);
	S(dk);
	S(dv);
	S(dqraw);
	S(dkraw);
	S(dy);
	S(datt);
	S(dh);
	S(dgate);
	S(dup);
	S(dpooled);
	S(deq);
	S(deq_absmax);
	S(lora_du);
	S(lora_dx);
	/* q, k and v's staging: one after another, or one product's rows
	 * (qkv_forward_fused) */
	m->q32 = buf(m, "scratch.qkv32");
	if (m->q32) {
		const struct tr_model_config *c = &m->plan.cfg;
		const size_t N = (size_t)m->plan.opts.B * (size_t)m->plan.opts.T;
		m->k32 = m->q32 + N * (size_t)c->num_heads * (size_t)c->head_dim;
		m->v32 = m->k32 + N * (size_t)c->num_kv_heads * (size_t)c->head_dim;
	}
	S(gemm_bf16);
	const struct tr_plan_buf *gb = tr_plan_find(&m->plan, "scratch.gemm_bf16");
	m->gemm_bf16_bytes = gb ? gb->bytes : 0;
	const struct tr_plan_buf *dsb = tr_plan_find(&m->plan, "scratch.att_ds");
	m->att_ds = buf(m, "scratch.att_ds");
	m->att_ds_bytes = dsb ? dsb->bytes : 0;
	m->dgate16 = buf(m, "scratch.dgate16");
	m->dup16 = buf(m, "scratch.dup16");
	m->dh16 = buf(m, "scratch.dh16");
	m->dres16 = buf(m, "scratch.dres16");
	if (m->plan.logits16) {
		m->logits16 = (gpu_bf16 *)m->logits;
		m->logits = NULL;
	}
#undef S
}

/* The backend's GEMMs round their operands into this model's scratch
 * (gpu/backend.h: gemm_scratch) from now on: set by every entry point that
 * runs ops, so that models sharing a backend (a distillation's student and
 * teacher) each use the one their plan sized for their own products. */
static void use_scratch(struct tr_model *m)
{
	m->be->gemm_scratch = m->gemm_bf16;
	m->be->gemm_scratch_bytes = m->gemm_bf16_bytes;
}

static td_err model_new(struct tr_model **out, struct gpu_backend *be,
			const struct tr_model_config *cfg, const struct tr_plan_opts *opts,
			void *base, size_t base_bytes, bool base_loaded, struct td_errbuf *eb)
{
	struct tr_model *m = calloc(1, sizeof(*m));
	if (!m)
		return td_fail(eb, TD_ENOMEM, "model: out of memory");
	m->be = be;
	m->poison_grads = getenv("TD_TEST_POISON_GRADS") != NULL;
	m->base_shared = base != NULL;
	m->base_loaded = base && base_loaded;
	m->pad_id = cfg->pad_token_id;
	/* The attention buffers are what this backend's attention keeps. */
	struct tr_plan_opts po = *opts;
	po.attention_lse = gpu_attention_flash(be, cfg->head_dim);
	po.gemm_bf16 = gpu_gemm_bf16(be);
	td_err e = tr_plan_build(&m->plan, cfg, &po, eb);
	if (e != TD_OK) {
		free(m);
		return e;
	}
	if (base && base_bytes != m->plan.arena_bytes[TR_ARENA_BASE]) {
		size_t want = m->plan.arena_bytes[TR_ARENA_BASE];
		tr_plan_fini(&m->plan);
		free(m);
		return td_fail(eb, TD_EINTERNAL,
			       "model: a shared base of %zu bytes for a plan whose base arena is %zu",
			       base_bytes, want);
	}
	if (base)
		m->arena[TR_ARENA_BASE] = base;
	int L = cfg->num_layers;
	size_t N = (size_t)opts->B * (size_t)opts->T;
	m->w = calloc((size_t)L, sizeof(*m->w));
	m->g = calloc((size_t)L, sizeof(*m->g));
	m->lin = calloc((size_t)L, sizeof(*m->lin));
	m->a = calloc((size_t)L, sizeof(*m->a));
	m->res = calloc((size_t)L + 1, sizeof(*m->res));
	if (m->plan.arena_bytes[TR_ARENA_HOST])
		m->res_host = calloc((size_t)L + 1, sizeof(*m->res_host));
	const bool off_att = tr_plan_find(&m->plan, "acts.ring.0.att") != NULL;
	if (off_att)
		m->att_host = calloc((size_t)L, sizeof(*m->att_host));
	m->host_targets = malloc(N * sizeof(int32_t));
	m->host_ids = malloc(N * sizeof(int32_t));
	m->host_losses = malloc(N * sizeof(float));
	m->host_kl = malloc(N * sizeof(float));
	m->host_pool = malloc((size_t)opts->B * sizeof(int32_t));
	if (be->ops->graph_begin && m->plan.nstages) /* NULL without room: no graphs, not an error */
		m->graph = calloc(m->plan.nstages, sizeof(*m->graph));
	const size_t ES = m->plan.emb_slots;
	if (ES) {
		m->slot_of = malloc((size_t)m->plan.cfg.vocab_size * sizeof(int32_t));
		m->slot_id = malloc(ES * sizeof(int32_t));
		m->tok_slot = malloc(N * sizeof(int32_t));
		for (int v = 0; m->slot_of && v < m->plan.cfg.vocab_size; v++)
			m->slot_of[v] = -1;
	}
	if (!m->w || !m->g || !m->lin || !m->a || !m->res || !m->host_targets || !m->host_ids || !m->host_losses ||
	    !m->host_kl || !m->host_pool || (m->plan.arena_bytes[TR_ARENA_HOST] && !m->res_host) ||
	    (off_att && !m->att_host) || (ES && (!m->slot_of || !m->slot_id || !m->tok_slot))) {
		tr_model_free(m);
		return td_fail(eb, TD_ENOMEM, "model: out of memory");
	}
	for (int a = 0; a < TR_ARENA_COUNT; a++) {
		if (!m->plan.arena_bytes[a] || (a == TR_ARENA_BASE && m->base_shared))
			continue;
		e = gpu_alloc(be, m->plan.arena_bytes[a], &m->arena[a]);
		if (e != TD_OK) {
			char b[32];
			tr_model_free(m);
			return td_fail(eb, e, "model: cannot allocate the %s arena (%s) on %s",
				       tr_arena_name(a), tr_fmt_bytes(b, sizeof(b), m->plan.arena_bytes[a]),
				       be->ops->name);
		}
	}
	const size_t host = m->plan.arena_bytes[TR_ARENA_HOST];
	if (host && (e = gpu_host_alloc(be, host, &m->arena[TR_ARENA_HOST])) != TD_OK) {
		char b[32];
		tr_model_free(m);
		return td_fail(eb, e,
			       "model: cannot allocate %s (%zu bytes) of pinned host memory for the "
			       "layer inputs that memory.recompute full-offload keeps on the host (%s)",
			       tr_fmt_bytes(b, sizeof(b), host), host, be->ops->name);
	}
	bind(m);
	use_scratch(m);

	/* RoPE tables are a function of (T, HS, theta) only: computed once here. */
	int T = opts->T, HS = cfg->head_dim;
	float *cs = malloc((size_t)T * (size_t)HS * sizeof(float));
	if (!cs) {
		tr_model_free(m);
		return td_fail(eb, TD_ENOMEM, "model: out of memory");
	}
	rope_cache(cs, cs + (size_t)T * HS / 2, T, HS, cfg->rope_theta);
	gpu_upload(be, m->rope_cos, cs, (size_t)T * HS / 2 * sizeof(float));
	gpu_upload(be, m->rope_sin, cs + (size_t)T * HS / 2, (size_t)T * HS / 2 * sizeof(float));
	free(cs);
	*out = m;
	return TD_OK;
}

td_err tr_model_new(struct tr_model **out, struct gpu_backend *be,
		    const struct tr_model_config *cfg, const struct tr_plan_opts *opts,
		    struct td_errbuf *eb)
{
	return model_new(out, be, cfg, opts, NULL, 0, false, eb);
}

td_err tr_model_new_shared(struct tr_model **out, struct gpu_backend *be,
			   const struct tr_model_config *cfg, const struct tr_plan_opts *opts,
			   void *base, size_t base_bytes, bool loaded, struct td_errbuf *eb)
{
	if (!base)
		return td_fail(eb, TD_EINVAL, "model: a shared base needs its memory");
	return model_new(out, be, cfg, opts, base, base_bytes, loaded, eb);
}

bool tr_model_base_shared(const struct tr_model *m)
{
	return m->base_shared;
}

void tr_model_free(struct tr_model *m)
{
	if (!m)
		return;
	free(m->zr);
	for (size_t i = 0; m->graph && i < m->plan.nstages; i++)
		gpu_graph_free(m->be, m->graph[i].exec);
	free(m->graph);
	if (m->gemm_bf16 && m->be->gemm_scratch == m->gemm_bf16) {
		m->be->gemm_scratch = NULL;
		m->be->gemm_scratch_bytes = 0;
	}
	for (int a = 0; a < TR_ARENA_COUNT; a++)
		if (!(a == TR_ARENA_BASE && m->base_shared))
			gpu_free(m->be, m->arena[a], m->plan.arena_bytes[a]);
	gpu_host_free(m->be, m->arena[TR_ARENA_HOST], m->plan.arena_bytes[TR_ARENA_HOST]);
	tr_plan_fini(&m->plan);
	free(m->w);
	free(m->g);
	free(m->lin);
	free(m->a);
	free(m->res);
	free(m->res_host);
	free(m->att_host);
	free(m->host_targets);
	free(m->host_ids);
	free(m->slot_of);
	free(m->slot_id);
	free(m->tok_slot);
	free(m->host_losses);
	free(m->host_kl);
	free(m->host_pool);
	free(m);
}

/* --- NF4 --- */

static size_t nf4_nblocks(const struct tr_param *p)
{
	return (p->numel + TR_NF4_BLOCK - 1) / TR_NF4_BLOCK;
}

/* Quantizes src (p->numel floats) on the host and uploads the packed form. */
static td_err nf4_upload(struct tr_model *m, const struct tr_param *p, const float *src,
			 struct td_errbuf *eb)
{
	size_t n = p->numel, nb = nf4_nblocks(p), ns = (nb + TR_NF4_DQ_BLOCK - 1) / TR_NF4_DQ_BLOCK;
	uint8_t *codes = malloc((n + 1) / 2);
	float *absmax = malloc(nb * sizeof(float));
	int8_t *q = malloc(nb);
	float *scale = malloc((ns + 1) * sizeof(float));
	td_err e = TD_OK;
	if (!codes || !absmax || !q || !scale) {
		e = td_fail(eb, TD_ENOMEM, "model: out of memory quantizing '%s'", p->name);
		goto out;
	}
	nf4_quantize(codes, absmax, src, n);
	gpu_upload(m->be, m->nf4_codes + p->q_codes, codes, (n + 1) / 2);
	if (m->plan.opts.nf4_double_quant) {
		absmax_quantize(q, scale, absmax, nb);
		gpu_upload(m->be, m->nf4_absmax_q + p->q_blocks, q, nb);
		gpu_upload(m->be, m->nf4_scale + p->q_scales, scale, (ns + 1) * sizeof(float));
	} else {
		gpu_upload(m->be, m->nf4_absmax + p->q_blocks, absmax, nb * sizeof(float));
	}
out:
	free(codes);
	free(absmax);
	free(q);
	free(scale);
	return e;
}

/* A weight as a matmul (or the embedding lookup) reads it: fp32 (f), its
 * bf16 twin (h, gpu/backend.h), or both. */
struct wref {
	const float *f;
	const gpu_bf16 *h;
};

/* Weight p as this backend's GEMMs read it. In the bf16 mode, always with a
 * twin: a trainable weight's bf16 copy beside its fp32 master, a frozen
 * weight's bf16 storage alone, an NF4 weight dequantized to bf16 into
 * scratch.deq. Elsewhere fp32: the weight itself, or an NF4 weight
 * dequantized, or a bf16 one widened (exactly), into scratch.deq. What lands
 * in scratch.deq is valid until the next weight_of. */
static struct wref weight_of(struct tr_model *m, const struct tr_param *p)
{
	const bool g16 = m->plan.opts.gemm_bf16;
	/* The plan was made for the precision the backend had at tr_model_new;
	 * switching since is a caller's bug. */
	assert(gpu_gemm_bf16(m->be) == g16);
	if (p->nf4) {
		const float *absmax = m->nf4_absmax + p->q_blocks;
		if (m->plan.opts.nf4_double_quant) {
			gpu_absmax_dequantize(m->be, m->deq_absmax, m->nf4_absmax_q + p->q_blocks,
					      m->nf4_scale + p->q_scales, nf4_nblocks(p));
			absmax = m->deq_absmax;
		}
		gpu_nf4_dequantize(m->be, g16 ? NULL : m->deq, g16 ? m->deq : NULL,
				   m->nf4_codes + p->q_codes, absmax, p->numel);
		return g16 ? (struct wref){NULL, m->deq} : (struct wref){m->deq, NULL};
	}
	if (p->bf16) {
		const gpu_bf16 *w16 = m->params16 + p->offset;
		if (g16)
			return (struct wref){NULL, w16};
		gpu_bf16_widen(m->be, m->deq, w16, p->numel);
		return (struct wref){m->deq, NULL};
	}
	/* fp32: in the bf16 mode only trainable weights (frozen ones are
	 * bf16); one without a copy is read in fp32 (an untied embedding, by
	 * its lookup) */
	const gpu_bf16 *h = g16 ? copy16_ptr(m, p) : NULL;
	assert(!g16 || (p->trainable && (h || p->offset < m->plan.copy16_lo)));
	/* plan.masters_part: the fp32 master is current in its owner's part
	 * only; every rank's copy is gathered after each step, and is what the
	 * ops read */
	if (h && m->plan.masters_part)
		return (struct wref){NULL, h};
	return (struct wref){param_ptr(m, p, false), h};
}

/* --- loading and host access --- */

static bool ignored_tensor(const struct tr_model *m, const struct tr_st_tensor *t)
{
	const struct tr_model_config *c = &m->plan.cfg;
	/* A tied model may carry a copy of the embedding; a causal LM loaded as a
	 * classifier brings a head that is dropped, as transformers drops it. */
	return strcmp(t->name, "lm_head.weight") == 0 &&
	       (c->tie_word_embeddings || m->plan.opts.num_labels > 0);
}

/* src (fp32) into p's storage: quantized to NF4, rounded to bf16 (once: a
 * bf16 checkpoint's values come back unchanged), or fp32 and, in the bf16
 * mode, its bf16 copy rounded from it. */
static td_err upload_param(struct tr_model *m, const struct tr_param *p, const float *src,
			   struct td_errbuf *eb)
{
	if (p->kind == TR_P_HEAD)
		m->head_loaded = true;
	if (!p->trainable && m->base_loaded)
		return td_fail(eb, TD_EPERM, "model: '%s' is in a shared base, which no job writes",
			       p->name);
	if (p->nf4)
		return nf4_upload(m, p, src, eb);
	if (p->bf16) {
		gpu_bf16 *h = malloc(p->numel * sizeof(gpu_bf16));
		if (!h)
			return td_fail(eb, TD_ENOMEM, "model: out of memory converting '%s' to bf16",
				       p->name);
		bf16_round(h, src, p->numel);
		gpu_upload(m->be, m->params16 + p->offset, h, p->numel * sizeof(gpu_bf16));
		free(h); /* gpu_upload has taken the bytes (gpu/backend.h) */
		return TD_OK;
	}
	if (p->trainable && m->wpart) {
		/* PARAMETERS: the part's floats of it, into the part */
		const size_t lo = m->plan.shard_lo, hi = m->plan.shard_hi;
		const size_t a = p->goffset, b = a + p->numel;
		const size_t x0 = a > lo ? a : lo, x1 = b < hi ? b : hi;
		if (x1 > x0)
			gpu_upload(m->be, m->params + (x0 - lo), src + (x0 - a), (x1 - x0) * sizeof(float));
		return TD_OK;
	}
	gpu_upload(m->be, param_ptr(m, p, false), src, p->numel * sizeof(float));
	if (p->trainable)
		copy16_round(m, p->offset, p->offset + p->numel);
	return TD_OK;
}

td_err tr_model_load(struct tr_model *m, const struct tr_weights *w, struct td_errbuf *eb)
{
	const struct tr_plan *p = &m->plan;
	size_t maxn = 0;
	for (size_t i = 0; i < p->nparams; i++)
		if (p->params[i].numel > maxn)
			maxn = p->params[i].numel;
	float *host = malloc(maxn * sizeof(float));
	if (!host)
		return td_fail(eb, TD_ENOMEM, "model: out of memory loading weights");
	td_err e = TD_OK;
	m->head_loaded = false;
	for (size_t i = 0; i < p->nparams && e == TD_OK; i++) {
		const struct tr_param *pp = &p->params[i];
		if (pp->kind == TR_P_LORA_A || pp->kind == TR_P_LORA_B)
			continue;
		const struct tr_st_tensor *t = tr_weights_find(w, pp->name);
		if (!t && pp->kind == TR_P_HEAD)
			continue; /* a new head: the caller initialises it */
		if (!t) {
			e = td_fail(eb, TD_EFORMAT, "weights: missing tensor '%s' (the %s config needs it)",
				    pp->name, p->cfg.model_type);
			break;
		}
		bool shape_ok = t->ndim == pp->ndim && t->shape[0] == pp->shape[0] &&
				(pp->ndim == 1 || t->shape[1] == pp->shape[1]);
		if (!shape_ok) {
			char got[96] = "", want[64];
			size_t o = 0;
			for (int d = 0; d < t->ndim && o < sizeof(got); d++)
				o += (size_t)snprintf(got + o, sizeof(got) - o, "%s%lld", d ? ", " : "",
						      (long long)t->shape[d]);
			if (pp->ndim == 1)
				snprintf(want, sizeof(want), "%lld", (long long)pp->shape[0]);
			else
				snprintf(want, sizeof(want), "%lld, %lld", (long long)pp->shape[0],
					 (long long)pp->shape[1]);
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' has shape [%s], the %s implies [%s]",
				    tr_weights_file_of(w, pp->name), pp->name, got,
				    pp->kind == TR_P_HEAD ? "number of labels" : "config", want);
			break;
		}
		if (!pp->trainable && m->base_loaded)
			continue; /* in the shared base already: checked, not written */
		e = tr_st_to_f32(host, t, eb);
		if (e == TD_OK)
			e = upload_param(m, pp, host, eb);
	}
	/* Tensors the model would ignore mean the file is not what the config says. */
	for (size_t i = 0; i < tr_weights_count(w) && e == TD_OK; i++) {
		const struct tr_st_tensor *t = tr_weights_at(w, i);
		const struct tr_param *pp = tr_plan_param(p, t->name);
		if ((!pp || pp->kind == TR_P_LORA_A || pp->kind == TR_P_LORA_B) && !ignored_tensor(m, t))
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' is not part of a %s %s with this config",
				    tr_weights_file_of(w, t->name), t->name, p->cfg.model_type,
				    p->opts.num_labels > 0 ? "classifier" : "model");
	}
	free(host);
	return e;
}

void tr_model_get_param(struct tr_model *m, const struct tr_param *p, float *dst)
{
	if (p->trainable && (m->wpart || m->plan.masters_part)) {
		/* PARAMETERS, and GRADIENTS's masters of the part: from the
		 * gathered host copy */
		assert(m->wholes);
		memcpy(dst, m->wholes + p->goffset, p->numel * sizeof(float));
		return;
	}
	if (!p->nf4 && !p->bf16) {
		gpu_download(m->be, dst, param_ptr(m, p, false), p->numel * sizeof(float));
		return;
	}
	struct wref w = weight_of(m, p);
	if (w.f) {
		gpu_download(m->be, dst, w.f, p->numel * sizeof(float));
		return;
	}
	/* bf16 values into the second half of dst's bytes, widened in place
	 * (kernels/cpu/ops.h: bf16_widen allows it); the download has waited
	 * for them. */
	gpu_bf16 *h = (gpu_bf16 *)dst + p->numel;
	gpu_download(m->be, h, w.h, p->numel * sizeof(gpu_bf16));
	bf16_widen(dst, h, p->numel);
}

td_err tr_model_set_param(struct tr_model *m, const struct tr_param *p, const float *src)
{
	return upload_param(m, p, src, NULL);
}

static void settle(struct tr_model *m);

void tr_model_get_grad(struct tr_model *m, const struct tr_param *p, float *dst)
{
	assert(p->trainable && p->gslot < 0 && !m->gpart); /* unsharded gradients */
	settle(m);
	const size_t lo = m->plan.grads_lo;
	if (p->goffset >= lo) {
		gpu_download(m->be, dst, m->grads + (p->goffset - lo), p->numel * sizeof(float));
		return;
	}
	/* the embedding kept by rows (plan.emb_slots): zeros, and each row the
	 * step took at its id's (the table's values) */
	assert(p->goffset == 0 && p->numel == lo);
	const size_t C = (size_t)m->plan.cfg.hidden_size;
	memset(dst, 0, p->numel * sizeof(float));
	float *rows = m->nslots ? malloc(m->nslots * C * sizeof(float)) : NULL;
	if (m->nslots && !rows) { /* one download a row, then */
		for (size_t r = 0; r < m->nslots; r++)
			gpu_download(m->be, dst + (size_t)m->slot_id[r] * C, m->emb_rows + r * C,
				     C * sizeof(float));
		return;
	}
	if (rows) /* the rows at once, each then at its id's */
		gpu_download(m->be, rows, m->emb_rows, m->nslots * C * sizeof(float));
	for (size_t r = 0; r < m->nslots; r++)
		memcpy(dst + (size_t)m->slot_id[r] * C, rows + r * C, C * sizeof(float));
	free(rows);
}

void tr_model_get_moments(struct tr_model *m, float *m1, float *m2)
{
	size_t bytes = (m->plan.shard_hi - m->plan.shard_lo) * sizeof(float);
	gpu_download(m->be, m1, m->m1, bytes);
	gpu_download(m->be, m2, m->m2, bytes);
}

void tr_model_set_moments(struct tr_model *m, const float *m1, const float *m2)
{
	size_t bytes = (m->plan.shard_hi - m->plan.shard_lo) * sizeof(float);
	gpu_upload(m->be, m->m1, m1, bytes);
	gpu_upload(m->be, m->m2, m2, bytes);
}

float *tr_model_params(struct tr_model *m)
{
	return m->params;
}

gpu_bf16 *tr_model_params16(struct tr_model *m)
{
	return m->copy16;
}

void tr_model_set_whole_weights(struct tr_model *m, const float *wholes)
{
	m->wholes = wholes;
}

float *tr_model_weight_slot(struct tr_model *m, int k)
{
	return m->wpart && k >= 0 && k <= TR_GRAD_RING ? m->wslot[k] : NULL;
}

gpu_bf16 *tr_model_weight_slot16(struct tr_model *m, int k)
{
	return m->wpart && k >= 0 && k <= TR_GRAD_RING ? m->wslot16[k] : NULL;
}

void tr_model_params_written(struct tr_model *m, size_t lo, size_t hi)
{
	assert(lo <= hi && hi <= m->plan.numel_trainable);
	copy16_round(m, lo, hi);
}

void tr_model_get_logits(struct tr_model *m, float *dst)
{
	const struct tr_plan_opts *o = &m->plan.opts;
	/* A chunked head never holds the whole logits (tr_model_forward_logits says so). */
	assert(m->logits_valid && (o->num_labels > 0 || m->plan.logits_rows == o->B * o->T));
	size_t n = o->num_labels > 0 ? (size_t)o->B * (size_t)o->num_labels
				     : (size_t)o->B * (size_t)o->T * (size_t)m->plan.cfg.vocab_size;
	if (m->logits16) { /* widened in place, as tr_model_get_param does */
		gpu_bf16 *h = (gpu_bf16 *)dst + n;
		gpu_download(m->be, h, m->logits16, n * sizeof(gpu_bf16));
		bf16_widen(dst, h, n);
		return;
	}
	gpu_download(m->be, dst, m->logits, n * sizeof(float));
}

void tr_model_get_hidden(struct tr_model *m, int i, float *dst)
{
	size_t N = (size_t)m->plan.opts.B * (size_t)m->plan.opts.T;
	int L = m->plan.cfg.num_layers;
	assert(i >= 0 && i <= L);
	const size_t bytes = N * (size_t)m->plan.cfg.hidden_size * sizeof(float);
	if (i < L && m->res_host) {
		/* FULL_OFFLOAD: the forward copied every layer's input out; the
		 * ring has only some. A failed copy is the next sync's to report. */
		gpu_sync(m->be, NULL);
		memcpy(dst, m->res_host[i], bytes);
		return;
	}
	const float *src = i < L ? m->res[i] : m->lnf_out;
	gpu_download(m->be, dst, src, bytes);
}

/* --- projections --- */

static uint64_t mix64(uint64_t z)
{
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static uint64_t dropout_seed(const struct tr_model *m, int l, int k)
{
	return mix64(m->dropout_seed ^ mix64(((uint64_t)l << 8 | (uint64_t)k) + 1));
}

/* What projection k's adapter keeps of its input inp (N, in) for the
 * backward: xd = dropout(inp) where the forward has dropout (its mask a
 * function of the seed, the layer and the projection: regenerated, not
 * stored) and, with u, u = scale * (x A^T) with x the input after dropout —
 * not in a recompute, where u is the forward's (every recompute policy keeps
 * it: train/plan.c), the bits the product would give again. Nothing without
 * an adapter. */
static void lora_input(struct tr_model *m, int l, int k, const float *inp, const gpu_bf16 *inp16,
		       bool u)
{
	struct gpu_backend *be = m->be;
	const struct lin *L = &m->lin[l][k];
	const int N = m->plan.opts.B * m->plan.opts.T, R = m->plan.opts.lora_rank;
	if (!L->lora)
		return;
	const float *x = inp;
	const gpu_bf16 *x16 = inp16;
	if (m->dropout_used) {
		assert(inp); /* the plan keeps fp32 inputs where there is dropout */
		gpu_dropout(be, L->xd, inp, m->plan.opts.lora_dropout, dropout_seed(m, l, k),
			    (size_t)N * L->in);
		x = L->xd;
		x16 = NULL;
	}
	if (!u || m->recomputing)
		return;
	if (be->ops->matmul_forward_scaled) { /* the scale as the GEMM's alpha: the same floats */
		gpu_matmul_forward_scaled(be, L->u, x, x16, L->A, L->A16, N, L->in, R,
					  m->plan.lora_scale);
		return;
	}
	gpu_matmul_forward(be, L->u, NULL, x, x16, L->A, L->A16, NULL, N, L->in, R);
	gpu_scale(be, L->u, m->plan.lora_scale, (size_t)N * R);
}

/* Whether a projection's adapter product goes before its weight's (the
 * bf16 mode, from the second step on): the weight's product then adds
 * onto the adapter's output (beta 1), and a product that adds onto its
 * output is never timed (gpu/cuda/cuda_ops.c: lt_tune runs a product
 * several times) — so the first step runs the other order, whose weight's
 * product is timed, and the later ones take the algorithm it chose for
 * the same shape. Either order gives the same bits. */
static bool adapters_first(const struct tr_model *m)
{
	return m->plan.opts.gemm_bf16 && m->steps_done > 0;
}

/* out (N, out) = inp @ W^T + b [+ scale * (dropout(inp) A^T) B^T]. inp16:
 * inp's bf16 twin or NULL (inp may then be NULL: gpu/backend.h). out16: the
 * product in bf16 instead of out (no bias, no adapter: train/plan.c). */
static void linear_forward(struct tr_model *m, int l, int k, float *out, gpu_bf16 *out16,
			   const float *inp, const gpu_bf16 *inp16)
{
	struct gpu_backend *be = m->be;
	const struct lin *L = &m->lin[l][k];
	const int N = m->plan.opts.B * m->plan.opts.T, R = m->plan.opts.lora_rank;
	assert(!out16 || !L->b);
	const struct wref w = weight_of(m, L->wp);
	if (L->lora && (out16 || (adapters_first(m) && !L->b))) {
		/* the adapter's product first (in bf16 out: rounded, small beside
		 * the weight's), then the weight's added onto it in fp32 and the
		 * sum rounded once. In fp32 the same bits as the other order (the
		 * two products' fp32 results added once, and that addition
		 * commutes), with one pass over out fewer: the weight's product
		 * reads its addend in its epilogue, where adding the adapter's
		 * after it read and wrote out again (q of the 8B shapes: 0.11 ms
		 * a layer). */
		lora_input(m, l, k, inp, inp16, true);
		gpu_matmul_forward(be, out, out16, L->u, NULL, L->B, L->B16, NULL, N, R, L->out);
		gpu_matmul_forward_add(be, out, out16, inp, inp16, w.f, w.h, N, L->in, L->out);
		return;
	}
	gpu_matmul_forward(be, out, out16, inp, inp16, w.f, w.h, L->b, N, L->in, L->out);
	if (!L->lora)
		return;
	lora_input(m, l, k, inp, inp16, true);
	gpu_matmul_forward_add(be, out, NULL, L->u, NULL, L->B, L->B16, N, R, L->out);
}

/* out = res + projection k of layer l (the residual stream's add after
 * o and down): one op where the bf16 mode's GEMM takes the addend apart
 * from its output (gpu/backend.h: matmul_forward_residual), an adapter's
 * product then added onto out (res + x W^T, then + u B^T: the order the
 * backends share, as matmul_forward_residual's fallback adds the product to
 * a copy of res); else the product into tmp and residual_forward — with a
 * bias, and in the fp32 mode, whose ops stay the CPU's. */
static void linear_forward_residual(struct tr_model *m, int l, int k, float *out,
				    const float *res, float *tmp, const float *inp,
				    const gpu_bf16 *inp16)
{
	const struct lin *L = &m->lin[l][k];
	if (m->plan.opts.gemm_bf16 && !L->b) {
		const struct wref w = weight_of(m, L->wp);
		const int N = m->plan.opts.B * m->plan.opts.T;
		gpu_matmul_forward_residual(m->be, out, res, inp, inp16, w.f, w.h, N, L->in, L->out);
		if (L->lora) {
			lora_input(m, l, k, inp, inp16, true);
			gpu_matmul_forward_add(m->be, out, NULL, L->u, NULL, L->B, L->B16, N,
					       m->plan.opts.lora_rank, L->out);
		}
		return;
	}
	linear_forward(m, l, k, tmp, NULL, inp, inp16);
	gpu_residual_forward(m->be, out, res, tmp, (size_t)m->plan.opts.B * m->plan.opts.T * L->out);
}

/* Whether projection L's weight-gradient product of a micro-batch's first
 * rows (first) overwrites its gradient instead of adding to it (the plan
 * says its work buffer was not zeroed: tr_plan_dw_overwritten). */
static bool dw_overwrites(const struct tr_model *m, const struct lin *L, bool first)
{
	const bool sharded = tr_shard_grads(m->plan.opts.shard, m->plan.opts.shard_ranks);
	return first && L->dw && (sharded || m->fresh) && tr_plan_dw_overwritten(&m->plan, L->wp);
}

/* dinp (N, in) += d/dinp (set: = instead, the old values never read);
 * weight, bias and adapter gradients += where they train. dout16, inp16:
 * bf16 twins or NULL (the fp32 tensor may then be NULL: gpu/backend.h; a bias
 * gradient needs dout). */
static void linear_backward_rows(struct tr_model *m, int l, int k, float *dinp,
				 gpu_bf16 *dinp16, bool set, const float *dout,
				 const gpu_bf16 *dout16, const float *inp, const gpu_bf16 *inp16, int n,
				 bool first, int slot);

static void adapter_backward(struct tr_model *m, int l, int k, float *dinp, bool set,
			     const float *dout, const gpu_bf16 *dout16, size_t ld16,
			     const float *inp, const gpu_bf16 *inp16, int slot);

static void linear_backward(struct tr_model *m, int l, int k, float *dinp, bool set,
			    const float *dout, const gpu_bf16 *dout16, const float *inp,
			    const gpu_bf16 *inp16)
{
	linear_backward_rows(m, l, k, dinp, NULL, set, dout, dout16, inp, inp16,
			     m->plan.opts.B * m->plan.opts.T, true, -1);
}

/* ... over n rows (every row, N, where the projection has an adapter:
 * its kept u and dropout masks are the whole batch's), dinp in bf16 where
 * dinp16 is given instead (set); the weight's and
 * bias's gradients are added to, so rows taken in parts sum in parts —
 * but first (the micro-batch's first rows) overwrites a weight's gradient
 * where the plan says so (tr_plan_dw_overwritten: its work buffer was not
 * zeroed). slot >= 0 (plan.lora_dx_group): the adapter's du goes to that
 * slot of scratch.lora_du and its share of dinp is left to the caller
 * (struct dx_group); -1: added here by a GEMM. */
static void linear_backward_rows(struct tr_model *m, int l, int k, float *dinp,
				 gpu_bf16 *dinp16, bool set, const float *dout,
				 const gpu_bf16 *dout16, const float *inp, const gpu_bf16 *inp16, int n,
				 bool first, int slot)
{
	struct gpu_backend *be = m->be;
	const struct lin *L = &m->lin[l][k];
	assert(dout || !L->db);
	assert(n == m->plan.opts.B * m->plan.opts.T || !L->lora);
	assert(slot < 0 || (L->lora && m->plan.lora_dx_group && !m->dropout_used &&
			    slot < GPU_LORA_DX_GROUP));
	/* dinp16 with an adapter: its share is the caller's (the down
	 * projection's d(h): swiglu_backward adds it) */
	assert(!dinp16 || (!dinp && set && (!L->lora || slot >= 0)));
	const struct wref w = weight_of(m, L->wp);
	const bool dw_set = dw_overwrites(m, L, first);
	/* An adapter whose share of dinp is a GEMM's (not grouped, no
	 * dropout) goes first, writing dinp where the weight's product would
	 * have, and that product adds onto it in its epilogue: one pass over
	 * dinp fewer (o of the 8B shapes: 0.105 ms a layer), the same bits
	 * (as linear_forward's). */
	const bool first_ad = L->lora && slot < 0 && adapters_first(m) && !m->dropout_used &&
			      dinp && !dinp16;
	if (first_ad)
		adapter_backward(m, l, k, dinp, set, dout, dout16, 0, inp, inp16, slot);
	gpu_matmul_backward(be, dinp, dinp16, L->dw, L->db, dout, dout16, inp, inp16, w.f, w.h, n,
			    L->in, L->out,
			    (set && !first_ad ? GPU_SET_DINP : 0u) | (dw_set ? GPU_SET_DWEIGHT : 0u));
	if (!first_ad)
		adapter_backward(m, l, k, dinp, false, dout, dout16, 0, inp, inp16, slot);
}

/* Projection k's adapter's part of linear_backward_rows (nothing without
 * one), after the frozen product's: dA and dB added to, its share of dinp
 * added (slot -1) or left in the slot for the caller. Whole rows. ld16 > 0:
 * dout is dout16 alone, its rows ld16 values apart (matmul_backward_ld16:
 * the q, k, v gradients' rows that the attention's backward rounded). */
static void adapter_backward(struct tr_model *m, int l, int k, float *dinp, bool set,
			     const float *dout, const gpu_bf16 *dout16, size_t ld16,
			     const float *inp, const gpu_bf16 *inp16, int slot)
{
	struct gpu_backend *be = m->be;
	const struct lin *L = &m->lin[l][k];
	const int N = m->plan.opts.B * m->plan.opts.T, R = m->plan.opts.lora_rank;
	if (!L->lora)
		return;
	/* With u = scale * x A^T kept: dB += dout^T u, du = scale * dout B. */
	float *du = m->lora_du + (slot > 0 ? (size_t)slot * (size_t)N * (size_t)R : 0);
	if (ld16) { /* du's scale as the GEMM's alpha: the same floats */
		gpu_matmul_backward_ld16(be, du, L->dB, dout16, ld16, L->u, NULL, L->B, L->B16, N, R,
					 L->out, GPU_SET_DINP, m->plan.lora_scale);
	} else {
		gpu_matmul_backward(be, du, NULL, L->dB, NULL, dout, dout16, L->u, NULL, L->B,
				    L->B16, N, R, L->out, true);
		gpu_scale(be, du, m->plan.lora_scale, (size_t)N * R);
	}
	assert(!set || (!m->dropout_used && slot < 0));
	if (!m->dropout_used) {
		gpu_matmul_backward(be, slot >= 0 ? NULL : dinp, NULL, L->dA, NULL, du, NULL, inp,
				    inp16, L->A, L->A16, N, L->in, R, set ? GPU_SET_DINP : 0u);
		return;
	}
	gpu_matmul_backward(be, m->lora_dx, NULL, L->dA, NULL, m->lora_du, NULL, L->xd, NULL, L->A,
			    L->A16, N, L->in, R, true);
	gpu_dropout(be, m->lora_dx, m->lora_dx, m->plan.opts.lora_dropout, dropout_seed(m, l, k),
		    (size_t)N * L->in);
	gpu_residual_forward(be, dinp, dinp, m->lora_dx, (size_t)N * L->in);
}

/* --- forward --- */

/* Projection k of layer l as the pass needs it: the whole product where
 * prod (the forward, a full recompute), else only what its adapter keeps and
 * the plan does not (a selective recompute: its dropout mask applied). */
static void project(struct tr_model *m, int l, int k, bool prod, float *out, gpu_bf16 *out16,
		    const float *inp, const gpu_bf16 *inp16)
{
	if (prod)
		linear_forward(m, l, k, out, out16, inp, inp16);
	else
		lora_input(m, l, k, inp, inp16, false);
}

/* --- FULL_OFFLOAD's ring (train/plan.h: TR_OFFLOAD_RING) --- */

/* The ring slot of res[l], and the number of the copy that moves it. */
static int ring_slot(int l)
{
	return l % TR_OFFLOAD_RING;
}

static size_t res_bytes(const struct tr_model *m)
{
	return (size_t)m->plan.opts.B * (size_t)m->plan.opts.T * (size_t)m->plan.cfg.hidden_size *
	       sizeof(float);
}

/* Before the forward writes res[l]: the copy out of the slot's last
 * occupant, res[l - TR_OFFLOAD_RING] (or a copy back into it, from the last
 * backward), is done. Nothing without offload. */
static void ring_claim(struct tr_model *m, int l)
{
	if (m->res_host)
		gpu_copy_wait(m->be, ring_slot(l));
}

/* The copies of the attention's output sets are numbered after the layer
 * inputs': copy TR_OFFLOAD_RING + slot. */
static_assert(2 * TR_OFFLOAD_RING <= GPU_COPY_SLOTS, "a copy number per ring slot and kind");
static int att_copy(int l)
{
	return TR_OFFLOAD_RING + ring_slot(l);
}

/* Before layer l's forward writes its attention output into its ring slot
 * (or its recompute reads it there): the last copy of that slot, out of it
 * (layer l - RING's offload) or back into it (layer l's prefetch), is done.
 * Nothing without the attention offloaded. */
static void att_claim(struct tr_model *m, int l)
{
	if (m->att_host)
		gpu_copy_wait(m->be, att_copy(l));
}

/* Layer l's q, k and v where the attention is fused (kept in bf16 only,
 * after RoPE), their weights' bf16 copies lie side by side as one
 * (H + 2 KV) x C matrix (and their biases, if any, likewise), and none has
 * an adapter or q/k norms: one product into the staging's rows of H + 2 KV
 * (bias added by the GEMM), then one op rotating q and k and rounding all
 * three (rope_qkv16) — instead of three products, two rotations and v's
 * rounding. Each value is its own product's fp32 sum over the same C
 * inputs (the GEMM's algorithm, and with it the order of a sum, may
 * differ from the narrower products': within the bf16 mode's bounds, as
 * any algorithm choice), the same rotation and rounding. Returns false,
 * having launched nothing, where it does not apply. */
static bool qkv_forward_fused(struct tr_model *m, int l)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int B = m->plan.opts.B, T = m->plan.opts.T, N = B * T, C = c->hidden_size;
	const size_t H = (size_t)c->num_heads * c->head_dim, KV = (size_t)c->num_kv_heads * c->head_dim;
	const struct lin *q = &m->lin[l][TR_LIN_Q], *k = &m->lin[l][TR_LIN_K],
			 *v = &m->lin[l][TR_LIN_V];
	const struct layer_a *a = &m->a[l];
	if (!be->ops->rope_qkv16 || !m->plan.opts.gemm_bf16 || c->qk_norm || !m->q32 || !a->q16 ||
	    !a->k16 || !a->v16 || !a->ln1_16 || q->lora || k->lora || v->lora || q->wp->nf4 ||
	    k->wp->nf4 || v->wp->nf4 || !q->b != !k->b || !q->b != !v->b ||
	    (q->b && (k->b != q->b + H || v->b != k->b + KV)))
		return false;
	const struct wref wq = weight_of(m, q->wp), wk = weight_of(m, k->wp),
			  wv = weight_of(m, v->wp);
	if (!wq.h || wk.h != wq.h + H * C || wv.h != wk.h + KV * C)
		return false;
	gpu_matmul_forward(be, m->q32, NULL, NULL, a->ln1_16, NULL, wq.h, q->b, N, C,
			   (int)(H + 2 * KV));
	gpu_rope_qkv16(be, a->q16, a->k16, a->v16, m->q32, m->rope_cos, m->rope_sin, B, T,
		       c->num_heads, c->num_kv_heads, c->head_dim);
	return true;
}

/* Layer l's forward (recompute false): res[l] -> res[l+1], every activation
 * the backward reads written where the plan keeps it. Its recompute (true),
 * before its backward: the same ops on the same inputs again, for what the
 * plan's policy did not keep, so the backward reads the forward's bits.
 * FULL runs every op but the down projection's product and the last
 * residual add (res[l+1] is kept; the down adapter's x after dropout is
 * not) and the adapters' A products (every policy keeps their u);
 * SELECTIVE reruns no product (each adapter's dropout mask is applied again)
 * and runs the norms, SwiGLU, RoPE under q/k norms (without them RoPE was
 * applied in place to the kept product) and the attention where it is not
 * fused (its probabilities and output are not kept; the fused attention's
 * output and statistics are). The recompute uses dln as its scratch: the
 * layer's backward has not started, and its d(res[l+1]) is in dres. */
static void layer_forward(struct tr_model *m, int l, bool recompute)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int B = m->plan.opts.B, T = m->plan.opts.T, N = B * T;
	const int C = c->hidden_size, I = c->intermediate_size, NH = c->num_heads;
	const int NKV = c->num_kv_heads, HS = c->head_dim;
	const float eps = (float)c->rms_norm_eps;
	const struct layer_w *w = &m->w[l];
	/* att was sized for the attention the backend ran when the model was
	 * built; a precision switched since would overrun it (a caller's bug). */
	assert(gpu_attention_flash(be, HS) == m->plan.opts.attention_lse);
	const enum tr_recompute rc =
		tr_layer_recompute(m->plan.opts.recompute, m->plan.opts.selective_layers, l);
	assert(!recompute || rc != TR_RECOMPUTE_NONE);
	m->recomputing = recompute;
	struct layer_a *a = &m->a[l];
	ring_ensure(m, l);
	/* The products run in the forward and in a full recompute (the
	 * layer's own policy: tr_layer_recompute). */
	const bool prod = !recompute || tr_recompute_full(rc);
	/* q, k, v in fp32: kept, or (q16: the fused attention's) staged in
	 * fp32 and kept rounded, q and k by RoPE; the attention reads what is
	 * kept. */
	float *q = a->q16 ? m->q32 : a->q, *k = a->k16 ? m->k32 : a->k;
	float *v = a->v16 ? m->v32 : a->v;

	gpu_rmsnorm_forward(be, a->ln1, a->ln1_16, a->ln1_rstd, m->res[l], w->ln1, N, C, eps);
	/* q16, k16 and v16 in one product where it applies (a product pass) */
	if (!prod || !qkv_forward_fused(m, l)) {
		if (c->qk_norm) {
			project(m, l, TR_LIN_Q, prod, a->qraw, NULL, a->ln1, a->ln1_16);
			project(m, l, TR_LIN_K, prod, a->kraw, NULL, a->ln1, a->ln1_16);
			gpu_rmsnorm_forward(be, q, NULL, a->q_rstd, a->qraw, w->qn, N * NH, HS, eps);
			gpu_rmsnorm_forward(be, k, NULL, a->k_rstd, a->kraw, w->kn, N * NKV, HS, eps);
		} else {
			project(m, l, TR_LIN_Q, prod, q, NULL, a->ln1, a->ln1_16);
			project(m, l, TR_LIN_K, prod, k, NULL, a->ln1, a->ln1_16);
		}
		/* v16 (the fused attention's) straight from its product where it has
		 * no bias (matmul_forward's bf16 output takes none) */
		const bool v16_out = a->v16 && !m->lin[l][TR_LIN_V].b;
		project(m, l, TR_LIN_V, prod, v16_out ? NULL : v, v16_out ? a->v16 : NULL, a->ln1,
			a->ln1_16);
		if (prod || c->qk_norm) { /* q16, k16: the rotation rounded (rope_forward's twin) */
			gpu_rope_forward(be, a->q16 ? NULL : q, a->q16, q, m->rope_cos, m->rope_sin, B, T,
					 NH, HS);
			gpu_rope_forward(be, a->k16 ? NULL : k, a->k16, k, m->rope_cos, m->rope_sin, B, T,
					 NKV, HS);
		}
		if (prod && a->v16 && !v16_out)
			gpu_bf16_round(be, a->v16, v, (size_t)N * NKV * HS);
	}
	/* not again where its output is kept: SELECTIVE's, FULL_OFFLOAD's ring */
	if (!recompute || !m->plan.opts.attention_lse || (prod && !m->att_host))
		gpu_attention_forward(be, a->y, a->y16, a->att, a->q, a->q16, a->k, a->k16, a->v, a->v16,
				      B, T, NH, NKV, HS);
	if (prod)
		linear_forward_residual(m, l, TR_LIN_O, a->res_mid, m->res[l], m->dln, a->y, a->y16);
	else
		project(m, l, TR_LIN_O, prod, m->dln, NULL, a->y, a->y16);

	gpu_rmsnorm_forward(be, a->ln2, a->ln2_16, a->ln2_rstd, a->res_mid, w->ln2, N, C, eps);
	project(m, l, TR_LIN_GATE, prod, a->gate, a->gate16, a->ln2, a->ln2_16);
	project(m, l, TR_LIN_UP, prod, a->up, a->up16, a->ln2, a->ln2_16);
	gpu_swiglu_forward(be, a->h, a->h16, a->gate, a->up, a->gate16, a->up16, (size_t)N * I);
	if (recompute) {
		lora_input(m, l, TR_LIN_DOWN, a->h, a->h16, prod);
		return;
	}
	linear_forward_residual(m, l, TR_LIN_DOWN, m->res[l + 1], a->res_mid, m->dln, a->h, a->h16);
}

/* Checks ids (and, for a causal head, labels into host_targets) before
 * anything runs: an id out of range would read outside the embedding on any
 * backend. */
static td_err check_inputs(struct tr_model *m, const int32_t *ids, const int32_t *labels,
			   int64_t *n_valid, struct td_errbuf *eb)
{
	const int B = m->plan.opts.B, T = m->plan.opts.T, V = m->plan.cfg.vocab_size;
	int64_t valid = 0;
	for (int b = 0; b < B; b++) {
		for (int t = 0; t < T; t++) {
			int32_t id = ids[b * T + t];
			if (id < 0 || id >= V)
				return td_fail(eb, TD_ERANGE,
					       "input_ids[%d][%d] = %d is outside the vocabulary [0, %d)",
					       b, t, id, V);
			int32_t tgt = -100;
			if (labels && t + 1 < T) {
				tgt = labels[b * T + t + 1];
				if (tgt != -100 && (tgt < 0 || tgt >= V))
					return td_fail(eb, TD_ERANGE,
						       "labels[%d][%d] = %d is neither -100 nor in [0, %d)",
						       b, t + 1, tgt, V);
			}
			valid += tgt != -100;
			m->host_targets[b * T + t] = tgt;
		}
	}
	memcpy(m->host_ids, ids, (size_t)B * T * sizeof(int32_t));
	*n_valid = valid;
	return TD_OK;
}

/* Sum of n host floats in double, which must be finite. */
static td_err host_sum(const float *x, int n, const char *what, double *out, struct td_errbuf *eb)
{
	double sum = 0;
	for (int i = 0; i < n; i++)
		sum += x[i];
	if (!isfinite(sum))
		return td_fail(eb, TD_ENUMERIC, "forward: the %s is not finite (%g)", what, sum);
	*out = sum;
	return TD_OK;
}

/* Logits of rows [r0, r0 + n) of the final hidden state into the logits
 * buffer (n <= plan.logits_rows; the whole logits when n is every row), in
 * bf16 where the plan says so (plan.logits16). */
static void head_chunk(struct tr_model *m, int r0, int n)
{
	const struct tr_model_config *c = &m->plan.cfg;
	const struct wref w = weight_of(m, m->lm_head);
	gpu_matmul_forward(m->be, m->logits, m->logits16, m->lnf_out + (size_t)r0 * c->hidden_size,
			   NULL, w.f, w.h, NULL, n, c->hidden_size, c->vocab_size);
}

/* dln rows [r0, r0 + n) (overwritten) and the lm_head's gradient from the
 * logits' gradient of those rows (dl fp32, or dl16 in bf16). */
static void head_weight_grad(struct tr_model *m, int r0, int n, const float *dl,
			     const gpu_bf16 *dl16)
{
	const struct tr_model_config *c = &m->plan.cfg;
	const int C = c->hidden_size, V = c->vocab_size;
	const struct wref w = weight_of(m, m->lm_head);
	/* the step's first chunk overwrites the gradient that zero_grad left
	 * (GRADIENTS: each micro-batch's, in grads.rest: micro_begin), the
	 * rest add */
	const bool set = m->head_fresh;
	m->head_fresh = false;
	gpu_matmul_backward(m->be, m->dln + (size_t)r0 * C, NULL, m->dlm_head, NULL, dl, dl16,
			    m->lnf_out + (size_t)r0 * C, NULL, w.f, w.h, n, C, V,
			    GPU_SET_DINP | (set ? GPU_SET_DWEIGHT : 0u));
}

/* The causal head's backward over rows [r0, r0 + n), whose logits are in the
 * logits buffer: the loss gradient (in place over the logits, fp32 or bf16
 * as they are), then dln and the lm_head's gradient.
 * losses: NULL, or also the forward's losses of those rows. */
static void head_grad_chunk(struct tr_model *m, int r0, int n, float *losses, float dloss)
{
	gpu_crossentropy_backward(m->be, losses, m->logits, m->logits16, m->logits, m->logits16,
				  m->targets + r0, dloss, n, m->plan.cfg.vocab_size);
	head_weight_grad(m, r0, n, m->logits, m->logits16);
}

/* What the head stages of a forward walk do. */
enum head_op {
	HEAD_OP_LOGITS,   /* logits only, and only whole ones (a chunked teacher's come by rows) */
	HEAD_OP_CAUSAL,   /* cross-entropy per row (fused: and the head's backward) */
	HEAD_OP_DISTILL,  /* the KL and CE terms against the teacher's rows */
	HEAD_OP_CLASSIFY, /* pool, score, cross-entropy per sequence */
};

struct head_args {
	enum head_op op;
	bool fused;                 /* HEAD_OP_CAUSAL: tr_model_fuse_head_backward's */
	float dloss;
	struct tr_model *teacher;   /* HEAD_OP_DISTILL */
	float temperature;
};

/* A forward stage TR_STAGE_HEAD: rows [s->r0, s->r0 + s->rows). */
static void head_forward(struct tr_model *m, const struct tr_stage *s, const struct head_args *h)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const struct tr_plan_opts *o = &m->plan.opts;
	const int N = o->B * o->T, V = c->vocab_size, r0 = s->r0, n = s->rows;
	switch (h->op) {
	case HEAD_OP_LOGITS:
		if (m->plan.logits_rows == N)
			head_chunk(m, r0, n);
		break;
	case HEAD_OP_CAUSAL:
		head_chunk(m, r0, n);
		if (h->fused)
			head_grad_chunk(m, r0, n, m->losses + r0, h->dloss);
		else
			gpu_crossentropy_forward(be, m->losses + r0, m->logits, m->logits16,
						 m->targets + r0, n, V);
		break;
	case HEAD_OP_DISTILL:
		head_chunk(m, r0, n);
		gpu_distill_forward(be, m->kl + r0, m->losses + r0, m->logits,
				    tr_model_teacher_rows(h->teacher, r0, n), m->targets + r0,
				    h->temperature, n, V);
		break;
	case HEAD_OP_CLASSIFY:
		/* Pooling is a gather of rows: the embedding op with row indices as ids. */
		gpu_embedding_forward(be, m->pooled, m->pool_idx, m->lnf_out, NULL, o->B, c->hidden_size);
		const struct wref w = weight_of(m, m->score);
		gpu_matmul_forward(be, m->logits, NULL, m->pooled, NULL, w.f, w.h, NULL, o->B,
				   c->hidden_size, o->num_labels);
		gpu_crossentropy_forward(be, m->losses, m->logits, NULL, m->targets, o->B,
					 o->num_labels);
		break;
	}
}

/* A layer stage through a graph (STAGED): from its third call — the first
 * two run as they come, since a product's algorithm is timed at its first
 * calls, which a recording cannot do (gpu/cuda/cuda_ops.c: lt_tune) —
 * stage i's ops are recorded and launched as one graph, each call's own
 * recording (gpu/backend.h: graph_end), so a graph never runs what this
 * call would not. A layer stage's ops only read and write device memory
 * on the stream: no copy, upload, wait or sync. Where a recording fails,
 * the host state it changed (the bf16 ring's holds) is put back and the
 * ops run again without one; that stage is not recorded again. */
static bool stage_record(struct tr_model *m, size_t i)
{
	if (!m->graph || m->graph[i].calls < 0)
		return false;
	if (m->graph[i].calls < 2) {
		m->graph[i].calls++;
		return false;
	}
	memcpy(m->graph_holds, m->ring_holds, sizeof(m->ring_holds));
	return gpu_graph_begin(m->be);
}

static bool stage_launch(struct tr_model *m, size_t i)
{
	if (gpu_graph_end(m->be, &m->graph[i].exec))
		return true;
	memcpy(m->ring_holds, m->graph_holds, sizeof(m->ring_holds));
	m->graph[i].calls = -1;
	return false;
}

#define STAGED(m, i, call)                                    \
	do {                                                  \
		if (stage_record(m, i)) {                     \
			call;                                 \
			if (stage_launch(m, i))               \
				break;                        \
		}                                             \
		call;                                         \
	} while (0)

/* The plan's forward stages over inputs already on the device. */
static void forward_walk(struct tr_model *m, const struct head_args *h)
{
	struct gpu_backend *be = m->be;
	const struct tr_plan *p = &m->plan;
	const struct tr_model_config *c = &p->cfg;
	const int N = p->opts.B * p->opts.T, C = c->hidden_size;
	use_scratch(m);
	m->dropout_used = m->dropout_armed && p->opts.lora_dropout > 0.0f;
	m->dropout_armed = false;
	if (m->stage_hook) /* a forward begins: sharded weights, the first gathered */
		m->stage_hook(m->stage_ctx, NULL);
	for (size_t i = 0; i < p->nforward; i++) {
		const struct tr_stage *s = &p->stages[i];
		switch (s->kind) {
		case TR_STAGE_EMBED: {
			ring_claim(m, 0);
			/* by rows from the ranks' parts: the stage hook's (train/ddp.h) */
			if (m->plan.embed_lookup_rows) {
				assert(m->stage_hook);
				break;
			}
			/* a lookup, not a GEMM: the fp32 rows where there are */
			const struct wref w = weight_of(m, m->embed);
			gpu_embedding_forward(be, m->res[0], m->ids, w.f, w.f ? NULL : w.h, N, C);
			break;
		}
		case TR_STAGE_LAYER:
			ring_claim(m, s->layer + 1);
			att_claim(m, s->layer);
			STAGED(m, i, layer_forward(m, s->layer, false));
			break;
		case TR_STAGE_OFFLOAD:
			gpu_copy_to_host(be, m->res_host[s->layer], m->res[s->layer], res_bytes(m),
					 ring_slot(s->layer));
			break;
		case TR_STAGE_OFFLOAD_ATTENTION:
			gpu_copy_to_host(be, m->att_host[s->layer], m->att_ring[ring_slot(s->layer)],
					 m->att_span, att_copy(s->layer));
			break;
		case TR_STAGE_FINAL_NORM:
			gpu_rmsnorm_forward(be, m->lnf_out, NULL, m->lnf_rstd, m->res[c->num_layers], m->lnf,
					    N, C, (float)c->rms_norm_eps);
			break;
		case TR_STAGE_HEAD:
			head_forward(m, s, h);
			break;
		default:
			assert(!"a backward stage among the forward's");
		}
		if (m->stage_hook) /* sharded weights: the next layer's gathered */
			m->stage_hook(m->stage_ctx, s);
	}
}

/* Checks and uploads the inputs of a causal forward (ids, and the shifted
 * labels), then walks the forward. */
static td_err causal_forward(struct tr_model *m, const int32_t *ids, const int32_t *labels,
			     int64_t *n_valid, const struct head_args *h, struct td_errbuf *eb)
{
	struct gpu_backend *be = m->be;
	const int N = m->plan.opts.B * m->plan.opts.T;
	if (m->plan.opts.num_labels > 0)
		return td_fail(eb, TD_EINVAL, "model: a classifier has no causal head; use "
			       "tr_model_forward_classify");
	m->logits_valid = false;
	td_err e = check_inputs(m, ids, labels, n_valid, eb);
	if (e != TD_OK)
		return e;
	gpu_upload(be, m->ids, ids, (size_t)N * sizeof(int32_t));
	gpu_upload(be, m->targets, m->host_targets, (size_t)N * sizeof(int32_t));
	forward_walk(m, h);
	return TD_OK;
}

td_err tr_model_forward(struct tr_model *m, const int32_t *ids, const int32_t *labels,
			double *loss_sum, int64_t *n_valid, struct td_errbuf *eb)
{
	struct gpu_backend *be = m->be;
	const int N = m->plan.opts.B * m->plan.opts.T;
	int64_t valid;
	/* armed for this forward only, even a failed one */
	const struct head_args h = {.op = HEAD_OP_CAUSAL, .fused = m->fuse_head, .dloss = m->fuse_dloss};
	m->fuse_head = false;
	td_err e = causal_forward(m, ids, labels, &valid, &h, eb);
	if (e != TD_OK)
		return e;
	gpu_download(be, m->host_losses, m->losses, (size_t)N * sizeof(float));
	double sum = 0;
	if ((e = gpu_sync(be, eb)) != TD_OK || (e = host_sum(m->host_losses, N, "loss", &sum, eb)))
		return e;
	m->logits_valid = !h.fused;
	m->head_done = h.fused;
	m->last_head = HEAD_CAUSAL;
	*loss_sum = sum;
	*n_valid = valid;
	return TD_OK;
}

td_err tr_model_forward_logits(struct tr_model *m, const int32_t *ids, struct td_errbuf *eb)
{
	int64_t valid;
	if (m->plan.logits_rows != m->plan.opts.B * m->plan.opts.T)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "model: this plan computes its logits in chunks of %d rows; whole logits "
			       "need an inference or distillation plan", m->plan.logits_rows);
	const struct head_args h = {.op = HEAD_OP_LOGITS};
	td_err e = causal_forward(m, ids, NULL, &valid, &h, eb);
	if (e == TD_OK)
		e = gpu_sync(m->be, eb);
	if (e != TD_OK)
		return e;
	m->logits_valid = true;
	m->last_head = HEAD_CAUSAL;
	return TD_OK;
}

td_err tr_model_forward_trunk(struct tr_model *m, const int32_t *ids, struct td_errbuf *eb)
{
	int64_t valid;
	const struct head_args h = {.op = HEAD_OP_LOGITS};
	td_err e = causal_forward(m, ids, NULL, &valid, &h, eb);
	if (e == TD_OK)
		e = gpu_sync(m->be, eb);
	if (e != TD_OK)
		return e;
	/* whole logits (the head stage computed them) or none yet */
	m->logits_valid = m->plan.logits_rows == m->plan.opts.B * m->plan.opts.T;
	m->last_head = HEAD_CAUSAL;
	return TD_OK;
}

const float *tr_model_teacher_rows(struct tr_model *m, int r0, int n)
{
	struct gpu_backend *be = m->be;
	const int V = m->plan.cfg.vocab_size;
	assert(!m->logits16); /* a teacher's plan trains nothing */
	if (m->plan.logits_rows == m->plan.opts.B * m->plan.opts.T)
		return m->logits + (size_t)r0 * V;
	assert(n <= m->plan.logits_rows);
	/* Called from the student's head: the teacher's GEMM on the teacher's
	 * scratch, then the student's back (stream order keeps them apart). */
	void *scratch = be->gemm_scratch;
	size_t bytes = be->gemm_scratch_bytes;
	use_scratch(m);
	head_chunk(m, r0, n);
	be->gemm_scratch = scratch;
	be->gemm_scratch_bytes = bytes;
	return m->logits;
}

td_err tr_model_forward_distill(struct tr_model *m, const int32_t *ids, const int32_t *labels,
				struct tr_model *teacher, float temperature, float alpha,
				struct tr_distill_sums *out, struct td_errbuf *eb)
{
	struct gpu_backend *be = m->be;
	const int N = m->plan.opts.B * m->plan.opts.T, V = m->plan.cfg.vocab_size;
	if (!m->plan.opts.distill)
		return td_fail(eb, TD_EINVAL, "model: not planned as a distillation student");
	if (teacher->plan.cfg.vocab_size != V ||
	    (teacher->plan.logits_rows < N && teacher->plan.logits_rows < m->plan.logits_rows))
		return td_fail(eb, TD_EINVAL,
			       "distill: the teacher's vocabulary (%d) or logits chunk (%d rows) does "
			       "not fit the student's (%d, %d rows)",
			       teacher->plan.cfg.vocab_size, teacher->plan.logits_rows, V,
			       m->plan.logits_rows);
	if (!(temperature > 0) || !(alpha >= 0 && alpha <= 1))
		return td_fail(eb, TD_EINVAL, "distill: temperature %g must be > 0 and alpha %g in [0, 1]",
			       (double)temperature, (double)alpha);
	int64_t valid;
	const struct head_args h = {.op = HEAD_OP_DISTILL, .teacher = teacher, .temperature = temperature};
	td_err e = causal_forward(m, ids, labels, &valid, &h, eb);
	if (e != TD_OK)
		return e;
	gpu_download(be, m->host_losses, m->losses, (size_t)N * sizeof(float));
	gpu_download(be, m->host_kl, m->kl, (size_t)N * sizeof(float));
	double ce = 0, kl = 0;
	if ((e = gpu_sync(be, eb)) != TD_OK || (e = host_sum(m->host_losses, N, "CE", &ce, eb)) ||
	    (e = host_sum(m->host_kl, N, "KL divergence", &kl, eb)))
		return e;
	m->logits_valid = true;
	m->last_head = HEAD_DISTILL;
	m->teacher = teacher;
	m->temperature = temperature;
	m->alpha = alpha;
	out->kl_sum = kl;
	out->ce_sum = ce;
	out->loss_sum = (double)alpha * temperature * temperature * kl + (1.0 - alpha) * ce;
	out->n_valid = valid;
	return TD_OK;
}

td_err tr_model_forward_classify(struct tr_model *m, const int32_t *ids, const int32_t *class_ids,
				 double *loss_sum, int64_t *n_valid, struct td_errbuf *eb)
{
	struct gpu_backend *be = m->be;
	const struct tr_plan_opts *o = &m->plan.opts;
	const int B = o->B, T = o->T, N = B * T, NL = o->num_labels;
	if (NL <= 0)
		return td_fail(eb, TD_EINVAL, "model: not planned as a classifier");
	m->logits_valid = false;
	int64_t unused, valid = 0;
	td_err e = check_inputs(m, ids, NULL, &unused, eb);
	if (e != TD_OK)
		return e;
	for (int b = 0; b < B; b++) {
		int32_t y = class_ids[b];
		if (y != -100 && (y < 0 || y >= NL))
			return td_fail(eb, TD_ERANGE,
				       "labels[%d] = %d is outside the %d labels [0, %d) of the classifier",
				       b, y, NL, NL);
		valid += y != -100;
		/* transformers: argmax of position * (id != pad), so the last non-pad
		 * token, and 0 for a row of padding only. */
		int last = T - 1;
		if (m->pad_id >= 0) {
			last = 0;
			for (int t = T - 1; t > 0; t--)
				if (ids[b * T + t] != m->pad_id) {
					last = t;
					break;
				}
		}
		m->host_pool[b] = b * T + last;
	}
	gpu_upload(be, m->ids, ids, (size_t)N * sizeof(int32_t));
	gpu_upload(be, m->targets, class_ids, (size_t)B * sizeof(int32_t));
	gpu_upload(be, m->pool_idx, m->host_pool, (size_t)B * sizeof(int32_t));
	const struct head_args h = {.op = HEAD_OP_CLASSIFY};
	forward_walk(m, &h);
	gpu_download(be, m->host_losses, m->losses, (size_t)B * sizeof(float));
	double sum = 0;
	if ((e = gpu_sync(be, eb)) != TD_OK || (e = host_sum(m->host_losses, B, "loss", &sum, eb)))
		return e;
	m->logits_valid = true;
	m->last_head = HEAD_CLASSIFY;
	*loss_sum = sum;
	*n_valid = valid;
	return TD_OK;
}
/* --- backward --- */

/* The adapters of projections that share an input (q, k, v; gate, up),
 * where the plan groups their input-gradient shares (plan.lora_dx_group):
 * each one's du in a slot of scratch.lora_du, then one lora_dx_add pass
 * over d(x) for all of them. */
struct dx_group {
	struct gpu_lora_dx ad[GPU_LORA_DX_GROUP];
	int G;
};

/* Projection k's slot in grp, or -1 (no adapter, or not grouped). */
static int group_slot(const struct tr_model *m, int l, int k, struct dx_group *grp)
{
	const struct lin *L = &m->lin[l][k];
	if (!L->lora || !m->plan.lora_dx_group)
		return -1;
	assert(!m->dropout_used && grp->G < GPU_LORA_DX_GROUP);
	const size_t NR = (size_t)m->plan.opts.B * m->plan.opts.T * m->plan.opts.lora_rank;
	const int s = grp->G++;
	grp->ad[s] = (struct gpu_lora_dx){.du = m->lora_du + (size_t)s * NR,
					  .A = L->A,
					  .A16 = L->A16,
					  .R = m->plan.opts.lora_rank,
					  .cols = L->in};
	return s;
}

static void group_add(struct tr_model *m, float *dinp, const struct dx_group *grp)
{
	if (grp->G > 0)
		gpu_lora_dx_add(m->be, dinp, grp->ad, grp->G, m->plan.opts.B * m->plan.opts.T);
}

/* qkv_backward_fused's operand room for layer l: d(y)'s floats, read by
 * the attention's backward only (as long as its H floats a row hold the
 * H + 2 KV bf16 values: KV <= H / 2), else the GEMM scratch; NULL where
 * the fused products do not apply. */
static gpu_bf16 *qkv_fused_room(struct tr_model *m, int l)
{
	const struct tr_model_config *c = &m->plan.cfg;
	const int N = m->plan.opts.B * m->plan.opts.T, C = c->hidden_size;
	const size_t H = (size_t)c->num_heads * c->head_dim, KV = (size_t)c->num_kv_heads * c->head_dim;
	const size_t W = H + 2 * KV;
	const struct lin *q = &m->lin[l][TR_LIN_Q], *k = &m->lin[l][TR_LIN_K],
			 *v = &m->lin[l][TR_LIN_V];
	const struct layer_a *a = &m->a[l];
	gpu_bf16 *d16 = m->dy && 2 * W <= 4 * H ? (gpu_bf16 *)(void *)m->dy
			: m->gemm_bf16_bytes >= (size_t)N * W * sizeof(gpu_bf16)
			? (gpu_bf16 *)(void *)m->gemm_bf16
			: NULL;
	/* adapters: on a frozen base (no weight gradient to fuse with theirs),
	 * without dropout (whose masked inputs and shares are
	 * linear_backward_rows') */
	const bool lora = q->lora || k->lora || v->lora;
	if (!m->plan.opts.gemm_bf16 || (lora && (q->dw || k->dw || v->dw || m->dropout_used)) ||
	    q->wp->nf4 || k->wp->nf4 || v->wp->nf4 || !a->ln1_16 || !d16 || !q->dw != !k->dw ||
	    !q->dw != !v->dw || (q->dw && (k->dw != q->dw + H * C || v->dw != k->dw + KV * C)))
		return NULL;
	const struct wref wq = weight_of(m, q->wp), wk = weight_of(m, k->wp),
			  wv = weight_of(m, v->wp);
	if (!wq.h || wk.h != wq.h + H * C || wv.h != wk.h + KV * C)
		return NULL;
	const bool set = dw_overwrites(m, q, true);
	if (dw_overwrites(m, k, true) != set || dw_overwrites(m, v, true) != set)
		return NULL;
	return d16;
}

/* Layer l's q, k and v input and weight gradients (the bf16 mode; with
 * adapters on them, over a frozen base and without dropout): where their
 * weights' bf16 copies lie side by side, as one (H + 2 KV) x C matrix, and so do their weight gradients (or none is
 * trained), the three products of each kind are one — d(ln1) = [dq dk dv]
 * [Wq; Wk; Wv] over K = H + 2 KV, and [dWq; dWk; dWv] = [dq dk dv]^T ln1 —
 * over the gradients rounded side by side into one bf16 operand, over
 * d(y) or in the model's GEMM scratch (which the products leave alone:
 * every operand has its bf16 twin). The same bf16 operands as three
 * products (each gradient rounded as matmul_backward rounds it); d(ln1) is
 * one fp32 sum over all of K instead of three added in turn, and
 * Qwen2-0.5B's k and v products (K or M of 128) no longer run alone.
 * Biases from those rows where the backend can (bias_backward_ld16), else
 * from the fp32 gradients; the adapters' products after
 * it, as linear_backward_rows takes them (their shares of d(ln1) grouped
 * where the plan groups them). Returns false, having launched nothing,
 * where it does not apply.
 * d16: qkv_fused_room's rows (the caller's); packed: the attention's
 * backward already rounded dq, dk and dv into them
 * (gpu_attention_backward_rope16). */
static bool qkv_backward_fused(struct tr_model *m, int l, gpu_bf16 *d16, const float *dq,
			       const float *dk, const float *dv, bool packed)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int N = m->plan.opts.B * m->plan.opts.T, C = c->hidden_size;
	const size_t H = (size_t)c->num_heads * c->head_dim, KV = (size_t)c->num_kv_heads * c->head_dim;
	const size_t W = H + 2 * KV;
	const struct lin *q = &m->lin[l][TR_LIN_Q], *k = &m->lin[l][TR_LIN_K],
			 *v = &m->lin[l][TR_LIN_V];
	const struct layer_a *a = &m->a[l];
	assert(d16 || !packed);
	if (!d16)
		return false;
	const struct wref wq = weight_of(m, q->wp);
	const bool set = dw_overwrites(m, q, true);
	if (!packed) {
		gpu_bf16_round_rows(be, d16, W, dq, (size_t)N, H);
		gpu_bf16_round_rows(be, d16 + H, W, dk, (size_t)N, KV);
		gpu_bf16_round_rows(be, d16 + H + KV, W, dv, (size_t)N, KV);
	}
	gpu_matmul_backward(be, m->dln, NULL, q->dw, NULL, NULL, d16, NULL, a->ln1_16, NULL, wq.h, N,
			    C, (int)W, GPU_SET_DINP | (set ? GPU_SET_DWEIGHT : 0u));
	const struct lin *lins[3] = {q, k, v};
	const float *douts[3] = {dq, dk, dv};
	const size_t outs[3] = {H, KV, KV}, cols[3] = {0, H, H + KV};
	/* the biases' gradients from the rows the weights' product read
	 * where the backend sums bf16 columns in place (no fp32 gradient then
	 * written for them: layer_backward), else from the fp32 gradients;
	 * one sum over all W columns where the three lie side by side (as
	 * train/plan.c's table puts them: Qwen2's; a launch instead of three,
	 * each column the sum of the same N rows, whose split into parts the
	 * backend may choose by the width: gpu/cuda/cuda_ops.c, plan_colsum) */
	const bool db_joint = q->db && k->db == q->db + H && v->db == k->db + KV &&
			      be->ops->bias_backward_ld16;
	if (db_joint)
		gpu_bias_backward_ld16(be, q->db, d16, W, N, (int)W);
	for (int i = 0; i < 3 && !db_joint; i++)
		if (lins[i]->db && be->ops->bias_backward_ld16)
			gpu_bias_backward_ld16(be, lins[i]->db, d16 + cols[i], W, N, (int)outs[i]);
		else if (lins[i]->db)
			gpu_matmul_backward(be, NULL, NULL, NULL, lins[i]->db, douts[i], NULL, NULL, NULL,
					    NULL, NULL, N, C, (int)outs[i], 0u);
	/* the adapters after the frozen product, as linear_backward_rows
	 * takes them: from the rows just rounded where the backend reads a
	 * block of them in place, else from the fp32 gradients (which round
	 * to those rows) */
	struct dx_group grp = {.G = 0};
	const int ks[3] = {TR_LIN_Q, TR_LIN_K, TR_LIN_V};
	const bool rows = packed && be->ops->matmul_backward_ld16;
	for (int i = 0; i < 3; i++)
		adapter_backward(m, l, ks[i], m->dln, false, rows ? NULL : douts[i], rows ? d16 + cols[i] : NULL,
				 rows ? W : 0, a->ln1, a->ln1_16, group_slot(m, l, ks[i], &grp));
	group_add(m, m->dln, &grp);
	return true;
}

/* Layer l's backward, its MLP half (TR_STAGE_LAYER_BACKWARD_MLP): every
 * gradient of tr_plan_mlp_half's tensors. */
static void layer_backward_mlp(struct tr_model *m, int l)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int N = m->plan.opts.B * m->plan.opts.T, C = c->hidden_size, I = c->intermediate_size;
	const struct layer_w *w = &m->w[l];
	const struct layer_w *g = &m->g[l];
	const struct layer_a *a = &m->a[l];
	ring_ensure(m, l);

	/* dres holds d(res[l+1]); it flows unchanged into d(res_mid) through the
	 * residual, and the MLP branch adds its part: by parts of
	 * plan.mlp_rows rows (d(h), d(gate) and d(up) are a part's), each
	 * part's weight gradients added to the last's, then the norm's over
	 * every row. */
#define ROWS(x, r0, w) ((x) ? (x) + (size_t)(r0) * (size_t)(w) : NULL)
	for (int r0 = 0; r0 < N; r0 += m->plan.mlp_rows) {
		const int n = N - r0 < m->plan.mlp_rows ? N - r0 : m->plan.mlp_rows;
		struct dx_group down = {.G = 0}, gu = {.G = 0};
		linear_backward_rows(m, l, TR_LIN_DOWN, m->dh, m->dh16, true, ROWS(m->dres, r0, C),
				     ROWS(m->dres16, r0, C), ROWS(a->h, r0, I), ROWS(a->h16, r0, I), n,
				     r0 == 0,
				     group_slot(m, l, TR_LIN_DOWN, &down));
		gpu_swiglu_backward(be, m->dgate, m->dup, m->dgate16, m->dup16, m->dh, m->dh16,
				    ROWS(a->gate, r0, I), ROWS(a->up, r0, I),
				    ROWS(a->gate16, r0, I), ROWS(a->up16, r0, I), (size_t)n * I,
				    down.G ? down.ad : NULL);
		linear_backward_rows(m, l, TR_LIN_GATE, ROWS(m->dln, r0, C), NULL, true, m->dgate,
				     m->dgate16, ROWS(a->ln2, r0, C), ROWS(a->ln2_16, r0, C), n,
				     r0 == 0, group_slot(m, l, TR_LIN_GATE, &gu));
		linear_backward_rows(m, l, TR_LIN_UP, ROWS(m->dln, r0, C), NULL, false, m->dup,
				     m->dup16, ROWS(a->ln2, r0, C), ROWS(a->ln2_16, r0, C), n,
				     r0 == 0, group_slot(m, l, TR_LIN_UP, &gu));
		assert(gu.G == 0 || n == N); /* an adapter on the MLP: whole rows */
		group_add(m, m->dln, &gu);
	}
#undef ROWS
	gpu_rmsnorm_backward(be, m->dres, m->dres16, g->ln2, m->dln, a->res_mid, w->ln2, a->ln2_rstd,
			     N, C);
}

/* ... and its attention half (TR_STAGE_LAYER_BACKWARD), after it: the
 * layer's other gradients. */
static void layer_backward(struct tr_model *m, int l)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int B = m->plan.opts.B, T = m->plan.opts.T, N = B * T;
	const int C = c->hidden_size, NH = c->num_heads;
	const int NKV = c->num_kv_heads, HS = c->head_dim, H = NH * HS, KV = NKV * HS;
	const struct layer_w *w = &m->w[l];
	const struct layer_w *g = &m->g[l];
	const struct layer_a *a = &m->a[l];
	ring_ensure(m, l);

	/* dres is now d(res_mid); same for the attention branch. Where the
	 * q, k, v products are fused and the backend can, the attention's
	 * backward rotates dq and dk back and rounds all three into the
	 * products' operand as it writes them (the fp32 gradients only where
	 * a bias or an adapter reads them). */
	linear_backward(m, l, TR_LIN_O, m->dy, true, m->dres, m->dres16, a->y, a->y16);
	gpu_bf16 *d16 = qkv_fused_room(m, l);
	bool f32 = false;
	for (int k = TR_LIN_Q; k <= TR_LIN_V; k++)
		f32 = f32 || (m->lin[l][k].db && !be->ops->bias_backward_ld16) ||
		      (m->lin[l][k].lora && !be->ops->matmul_backward_ld16);
	const bool packed =
		d16 && !c->qk_norm &&
		gpu_attention_backward_rope16(be, f32 ? m->dq : NULL, f32 ? m->dk : NULL, f32 ? m->dv : NULL,
					      m->datt, m->dy, a->y, a->y16, a->q16, a->k16, a->v16,
					      a->att, m->rope_cos, m->rope_sin, d16,
					      (size_t)(H + 2 * KV), f32 ? NULL : m->att_ds,
					      f32 ? 0 : m->att_ds_bytes, B, T, NH, NKV, HS);
	if (!packed) {
		gpu_attention_backward(be, m->dq, m->dk, m->dv, m->datt, m->dy, a->y, a->y16, a->q,
				       a->q16, a->k, a->k16, a->v, a->v16, a->att, B, T, NH, NKV, HS);
		gpu_rope_backward(be, m->dq, m->dq, m->rope_cos, m->rope_sin, B, T, NH, HS);
		gpu_rope_backward(be, m->dk, m->dk, m->rope_cos, m->rope_sin, B, T, NKV, HS);
	}
	const float *dqp = m->dq, *dkp = m->dk;
	if (c->qk_norm) {
		gpu_zero(be, m->dqraw, (size_t)N * H * sizeof(float));
		gpu_zero(be, m->dkraw, (size_t)N * KV * sizeof(float));
		gpu_rmsnorm_backward(be, m->dqraw, NULL, g->qn, m->dq, a->qraw, w->qn, a->q_rstd,
				     N * NH, HS);
		gpu_rmsnorm_backward(be, m->dkraw, NULL, g->kn, m->dk, a->kraw, w->kn, a->k_rstd,
				     N * NKV, HS);
		dqp = m->dqraw;
		dkp = m->dkraw;
	}
	if (qkv_backward_fused(m, l, d16, dqp, dkp, m->dv, packed)) {
		gpu_rmsnorm_backward(be, m->dres, m->dres16, g->ln1, m->dln, m->res[l], w->ln1,
				     a->ln1_rstd, N, C);
		return;
	}
	struct dx_group qkv = {.G = 0};
	linear_backward_rows(m, l, TR_LIN_Q, m->dln, NULL, true, dqp, NULL, a->ln1, a->ln1_16, N,
			     true, group_slot(m, l, TR_LIN_Q, &qkv));
	linear_backward_rows(m, l, TR_LIN_K, m->dln, NULL, false, dkp, NULL, a->ln1, a->ln1_16, N,
			     true, group_slot(m, l, TR_LIN_K, &qkv));
	linear_backward_rows(m, l, TR_LIN_V, m->dln, NULL, false, m->dv, NULL, a->ln1, a->ln1_16,
			     N, true, group_slot(m, l, TR_LIN_V, &qkv));
	group_add(m, m->dln, &qkv);
	gpu_rmsnorm_backward(be, m->dres, m->dres16, g->ln1, m->dln, m->res[l], w->ln1, a->ln1_rstd,
			     N, C);
}

void tr_model_fuse_head_backward(struct tr_model *m, float dloss)
{
	assert(!m->plan.opts.inference && m->plan.opts.num_labels == 0);
	m->fuse_head = true;
	m->fuse_dloss = dloss;
}

/* A backward stage TR_STAGE_HEAD_BACKWARD: dln of rows [s->r0, s->r0 +
 * s->rows) (overwritten; a classifier: every row) and the head's weight
 * gradients, from the logits of the last forward (recomputed chunk by chunk
 * where the plan chunks them: the forward kept only the losses). */
static void head_backward(struct tr_model *m, const struct tr_stage *s, float dloss)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const struct tr_plan_opts *o = &m->plan.opts;
	const int B = o->B, N = B * o->T, C = c->hidden_size, V = c->vocab_size;
	const int r0 = s->r0, n = s->rows;
	switch (m->last_head) {
	case HEAD_CLASSIFY: {
		gpu_crossentropy_backward(be, NULL, m->logits, NULL, m->logits, NULL, m->targets,
					  dloss, B, o->num_labels);
		const struct wref w = weight_of(m, m->score);
		gpu_matmul_backward(be, m->dpooled, NULL, m->dscore, NULL, m->logits, NULL,
				    m->pooled, NULL, w.f, w.h, B, C, o->num_labels, true);
		/* The gather's transpose: scatter-add the pooled rows' gradient. */
		gpu_zero(be, m->dln, (size_t)N * C * sizeof(float));
		gpu_embedding_backward(be, m->dln, m->dpooled, m->pool_idx, B, C);
		break;
	}
	case HEAD_DISTILL:
		if (m->plan.logits_rows != N)
			head_chunk(m, r0, n);
		gpu_distill_backward(be, m->logits, m->logits, tr_model_teacher_rows(m->teacher, r0, n),
				     m->targets + r0, dloss, m->alpha, m->temperature, n, V);
		head_weight_grad(m, r0, n, m->logits, NULL);
		break;
	case HEAD_CAUSAL:
		if (m->plan.logits_rows != N)
			head_chunk(m, r0, n);
		head_grad_chunk(m, r0, n, NULL, dloss);
		break;
	}
}

/* A backward stage TR_STAGE_EMBED_BACKWARD: dres holds d(res[0]). */
static void embed_backward(struct tr_model *m)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int N = m->plan.opts.B * m->plan.opts.T, C = c->hidden_size;
	if (!m->embed || !m->embed->trainable || m->embed->nf4 || m->embed->bf16)
		return;
	/* transformers' embedding has padding_idx = pad_token_id: the pad
	 * token's row gets no gradient from the input side (a tied lm_head
	 * still gives it one). Pad positions come in runs (padding). */
	int pad = c->pad_token_id;
	for (int n = 0; pad >= 0 && n < N;) {
		if (m->host_ids[n] != pad) {
			n++;
			continue;
		}
		int end = n;
		while (end < N && m->host_ids[end] == pad)
			end++;
		gpu_zero(be, m->dres + (size_t)n * C, (size_t)(end - n) * C * sizeof(float));
		n = end;
	}
	if (m->take_rows) /* every rank's rows, scattered by the stage hook (train/ddp.h) */
		return;
	if (!m->plan.emb_slots) {
		gpu_embedding_backward(be, m->dembed, m->dres, m->ids, N, C);
		return;
	}
	/* by rows (plan.emb_slots): each id of the step its row, taken in the
	 * order the ids first come; the tokens' rows folded into theirs as the
	 * table's would be (in row order, onto the old value) */
	for (int n = 0; n < N; n++) {
		const int32_t id = m->host_ids[n];
		int32_t r = m->slot_of[id];
		if (r < 0) {
			/* B*T rows for each of the plan's grad_accum micro-batches
			 * of a step (tr_model_zero_grad starts one) */
			if (m->nslots == m->plan.emb_slots) {
				fprintf(stderr, "traind: bug: more micro-batches in a step than the plan's "
						"grad_accum (%d)\n",
					m->plan.opts.grad_accum);
				abort();
			}
			r = (int32_t)m->nslots++;
			m->slot_of[id] = r;
			m->slot_id[r] = id;
		}
		m->tok_slot[n] = r;
	}
	gpu_upload(be, m->emb_slot, m->tok_slot, (size_t)N * sizeof(int32_t));
	gpu_embedding_backward(be, m->emb_rows, m->dres, m->emb_slot, N, C);
}

/* The plan's backward stages, up to the optimizer (the trainer's). */
void tr_model_backward(struct tr_model *m, float dloss)
{
	struct gpu_backend *be = m->be;
	const struct tr_plan *p = &m->plan;
	const struct tr_model_config *c = &p->cfg;
	const int N = p->opts.B * p->opts.T, C = c->hidden_size, L = c->num_layers;

	assert((m->logits_valid || m->head_done) && !p->opts.inference);
	use_scratch(m);
	/* Fused: the logits buffer becomes its own gradient. */
	m->logits_valid = false;
	const bool head_done = m->head_done;
	m->head_done = false;
	/* the forward ran the head's backward (tr_model_fuse_head_backward) */
	assert(!head_done || (m->last_head == HEAD_CAUSAL && dloss == m->fuse_dloss));
	for (size_t i = p->nforward; i < p->nstages; i++) {
		const struct tr_stage *s = &p->stages[i];
		switch (s->kind) {
		case TR_STAGE_HEAD_BACKWARD:
			if (!head_done)
				head_backward(m, s, dloss);
			break;
		case TR_STAGE_FINAL_NORM_BACKWARD:
			gpu_zero(be, m->dres, (size_t)N * C * sizeof(float));
			gpu_rmsnorm_backward(be, m->dres, m->dres16, m->dlnf, m->dln, m->res[L], m->lnf,
					     m->lnf_rstd,
					     N, C);
			break;
		case TR_STAGE_LAYER_RECOMPUTE:
			if (m->res_host) /* res[l] copied back (TR_STAGE_PREFETCH) */
				gpu_copy_wait(be, ring_slot(s->layer));
			att_claim(m, s->layer); /* and its attention's output */
			STAGED(m, i, layer_forward(m, s->layer, true));
			break;
		case TR_STAGE_PREFETCH:
			gpu_copy_to_device(be, m->res[s->layer], m->res_host[s->layer], res_bytes(m),
					   ring_slot(s->layer));
			break;
		case TR_STAGE_PREFETCH_ATTENTION:
			gpu_copy_to_device(be, m->att_ring[ring_slot(s->layer)], m->att_host[s->layer],
					   m->att_span, att_copy(s->layer));
			break;
		case TR_STAGE_LAYER_BACKWARD_MLP:
			STAGED(m, i, layer_backward_mlp(m, s->layer));
			break;
		case TR_STAGE_LAYER_BACKWARD:
			STAGED(m, i, layer_backward(m, s->layer));
			break;
		case TR_STAGE_EMBED_BACKWARD:
			embed_backward(m);
			break;
		case TR_STAGE_OPTIMIZER:
			/* tr_model_clip_grads and tr_model_adamw, called by the trainer */
			m->fresh = false; /* the step's next backwards add */
			m->steps_done++;
			return;
		default:
			assert(!"a forward stage among the backward's");
		}
		if (m->stage_hook)
			m->stage_hook(m->stage_ctx, s);
	}
	m->fresh = false;
	m->steps_done++;
}

float *tr_model_grads(struct tr_model *m)
{
	assert(!m->plan.emb_slots); /* one rank's table: the whole arena */
	settle(m);
	return m->grads;
}

float *tr_model_grad_slot(struct tr_model *m, int k)
{
	return k >= 0 && k <= TR_GRAD_RING ? m->gslot[k] : NULL;
}

void tr_model_take_embed_rows(struct tr_model *m, bool take)
{
	m->take_rows = take || (m->gpart && m->plan.embed_rows);
}

void tr_model_embed_io(struct tr_model *m, const int32_t **ids, float **res0, float **dres)
{
	*ids = m->ids;
	*res0 = m->res[0];
	*dres = m->dres;
}

float *tr_model_embed_rows(struct tr_model *m, int32_t **ids)
{
	*ids = m->rows_ids;
	return m->rows;
}

void tr_model_set_stage_hook(struct tr_model *m, tr_stage_hook fn, void *ctx)
{
	m->stage_hook = fn;
	m->stage_ctx = ctx;
}

/* --- optimizer --- */

/* The gradient floats this model holds summed at grads: every trainable
 * float's from plan.grads_lo (the embedding's below it kept by rows), or
 * (GRADIENTS) its part's [shard_lo, shard_hi). */
static size_t grads_held(const struct tr_model *m)
{
	const struct tr_plan *p = &m->plan;
	return tr_shard_grads(p->opts.shard, p->opts.shard_ranks) ? p->shard_hi - p->shard_lo
								    : p->numel_trainable - p->grads_lo;
}

/* plan.emb_slots: the floats of the rows the step took */
static size_t emb_held(const struct tr_model *m)
{
	return m->nslots * (size_t)m->plan.cfg.hidden_size;
}

/* A pending clip (gscale) applied to the gradients themselves. */
static void settle(struct tr_model *m)
{
	if (m->gscale != 1.0f) {
		gpu_scale(m->be, m->grads, m->gscale, grads_held(m));
		if (emb_held(m))
			gpu_scale(m->be, m->emb_rows, m->gscale, emb_held(m));
	}
	m->gscale = 1.0f;
}

void tr_model_zero_part_only(struct tr_model *m, size_t lo, size_t hi)
{
	assert(tr_shard_grads(m->plan.opts.shard, m->plan.opts.shard_ranks));
	assert(lo <= hi && hi <= grads_held(m) && !m->zr);
	if (!(m->zr = calloc(1, sizeof(*m->zr))))
		return; /* then zero_grad zeroes the whole part */
	if (hi > lo)
		m->zr[m->nzr++] = (__typeof__(*m->zr)){lo, hi - lo};
}

void tr_model_head_overwrites_next(struct tr_model *m)
{
	m->head_fresh = m->head_overwrites;
}

void tr_model_zero_grad(struct tr_model *m)
{
	m->gscale = 1.0f;
	if (m->zr) {
		if (m->poison_grads)
			gpu_scale(m->be, m->grads, NAN, grads_held(m));
		for (size_t i = 0; i < m->nzr; i++)
			gpu_zero(m->be, m->grads + m->zr[i].off, m->zr[i].n * sizeof(float));
		m->fresh = true;
		m->head_fresh = m->head_overwrites;
	} else {
		gpu_zero(m->be, m->grads, grads_held(m) * sizeof(float));
	}
	if (m->plan.emb_slots) { /* no row taken: the ids' rows free again */
		gpu_zero(m->be, m->emb_rows,
			 m->plan.emb_slots * (size_t)m->plan.cfg.hidden_size * sizeof(float));
		for (size_t r = 0; r < m->nslots; r++)
			m->slot_of[m->slot_id[r]] = -1;
		m->nslots = 0;
	}
	for (int k = 0; k <= TR_GRAD_RING; k++)
		if (m->gslot[k])
			gpu_zero(m->be, m->gslot[k], m->plan.grad_slot_numel[k] * sizeof(float));
}

double tr_model_grad_sumsq(struct tr_model *m)
{
	settle(m);
	/* the embedding's rows (plan.emb_slots: its only nonzero floats) first */
	const double e = emb_held(m) ? gpu_sumsq(m->be, m->emb_rows, emb_held(m)) : 0.0;
	return e + gpu_sumsq(m->be, m->grads, grads_held(m));
}

double tr_model_grad_norm(struct tr_model *m)
{
	return sqrt(tr_model_grad_sumsq(m));
}

double tr_model_clip_grads_by(struct tr_model *m, double max_norm, double norm)
{
	if (max_norm > 0) {
		/* torch.nn.utils.clip_grad_norm_: coef = max / (norm + 1e-6), clamped to 1. */
		double coef = max_norm / (norm + 1e-6);
		/* applied by AdamW as it reads them (the same float product) */
		if (coef < 1.0) {
			settle(m);
			m->gscale = (float)coef;
		}
	}
	return norm;
}

double tr_model_clip_grads(struct tr_model *m, double max_norm)
{
	return tr_model_clip_grads_by(m, max_norm, tr_model_grad_norm(m));
}

/* AdamW over the part's trainable floats [a, b) with weight decay wd: the
 * fp32 masters, and the bf16 copy of those that have one (from
 * plan.copy16_lo; PARAMETERS: none, the gathers round it). */
static void adamw_run(struct tr_model *m, const struct tr_adamw *h, float lr, int t, size_t a,
		      size_t b, float wd)
{
	const struct tr_plan *p = &m->plan;
	const size_t lo = p->shard_lo, c = p->copy16_lo;
	/* The fp32 master of trainable float i: params[i], or (PARAMETERS,
	 * the part's only) params[i - lo]. */
	const size_t wlo = m->wpart ? lo : 0;
	/* The summed gradient of trainable float i: grads[i], or (GRADIENTS,
	 * the part's only) grads[i - lo]. */
	const size_t glo = tr_shard_grads(p->opts.shard, p->opts.shard_ranks) ? lo : 0;
	/* copy16_ring: the layers' matrices [r0, r1) step without a copy (their
	 * slots go stale), the floats on either side with theirs */
	const bool ring = m->copy16 && p->copy16_ring;
	const size_t r0 = ring ? p->ring_lo : SIZE_MAX, r1 = ring ? tr_plan_ring_hi(p) : SIZE_MAX;
	if (ring && a < r1 && b > r0)
		ring_stale(m);
	while (b > a) {
		/* runs of floats split where their copy starts, stops or resumes */
		size_t e = b;
		if (m->copy16 && a < c && c < e)
			e = c;
		if (a < r0 && r0 < e)
			e = r0;
		if (a < r1 && r1 < e)
			e = r1;
		if (a < p->grads_lo && p->grads_lo < e)
			e = p->grads_lo;
		if (a < p->grads_lo) {
			/* the embedding, its gradient kept by rows (plan.emb_slots):
			 * each id's row, or none (zeros) */
			assert(a == 0 && e == p->grads_lo && !copy16_at(m, a) && !wlo);
			gpu_upload(m->be, m->emb_row_of, m->slot_of,
				   (size_t)p->cfg.vocab_size * sizeof(int32_t));
			gpu_adamw_update_rows(m->be, m->params, m->emb_rows, m->emb_row_of,
					      p->cfg.hidden_size, m->gscale, m->m1, m->m2, e, lr,
					      h->beta1, h->beta2, h->eps, wd, t);
			a = e;
			continue;
		}
		const bool none = a >= r0 && a < r1;
		gpu_adamw_update(m->be, m->params + (a - wlo), none ? NULL : copy16_at(m, a),
				 m->grads + (a - glo - p->grads_lo), m->gscale, m->m1 + (a - lo),
				 m->m2 + (a - lo), e - a, lr, h->beta1, h->beta2, h->eps, wd, t);
		a = e;
	}
}

void tr_model_adamw_part(struct tr_model *m, const struct tr_adamw *h, float lr, int t, size_t a,
			 size_t b)
{
	const struct tr_plan *p = &m->plan;
	/* Trainable tensors sit in the arena decayed first (train/plan.c), so
	 * [lo, hi) within this rank's part (all of them unsharded) is at most
	 * two runs: [lo, nd) decayed, [nd, hi) not; the moments are the part's. */
	const size_t nd = p->numel_decay;
	const size_t lo = a > p->shard_lo ? a : p->shard_lo, hi = b < p->shard_hi ? b : p->shard_hi;
	const size_t d1 = nd < hi ? nd : hi; /* decayed: [lo, d1) */
	adamw_run(m, h, lr, t, lo, d1, h->weight_decay);
	const size_t u0 = nd > lo ? nd : lo; /* undecayed: [u0, hi) */
	adamw_run(m, h, lr, t, u0, hi, 0.0f);
	/* gscale stays pending: whatever reads the gradients later (settle)
	 * reads them clipped, as AdamW did. */
}

void tr_model_adamw(struct tr_model *m, const struct tr_adamw *h, float lr, int t)
{
	tr_model_adamw_part(m, h, lr, t, m->plan.shard_lo, m->plan.shard_hi);
}
