/* Activation recompute (train/plan.h: enum tr_recompute) on the CPU backend:
 * SELECTIVE, FULL and FULL_OFFLOAD give NONE's losses, gradients, hidden
 * states and updated parameters bit for bit, for every method; each
 * policy's plan is what the backend allocates, device and host apart, and
 * FULL_OFFLOAD < FULL < SELECTIVE < NONE in activations; the step's stage
 * list has its recompute, offload and prefetch stages where the policy says.
 * FULL_OFFLOAD runs twice: with the CPU's copies, done when enqueued, and
 * with copies done as late as the copy stream's contract allows
 * (tests/unit/lazycopy.h), so that a copy the model does not wait for, or a
 * ring slot it reuses too soon, changes the bits.
 *
 * Why equal bits: a recompute runs the forward's own ops (the same backend
 * entry points, the same shapes, the same inputs, the same dropout seeds) into
 * other buffers, and the backward then reads those bits; on the CPU backend
 * an op's result does not depend on where its buffers are. Nothing is
 * compared within a tolerance here.
 *
 * Cases: the qwen2, llama and qwen3 fixtures (2 layers: only layer 0 is
 * recomputed, the last layer's working set being the forward's) and
 * 4-layer qwen2- and qwen3-shaped models with random weights (three
 * recomputes reusing one working set); full fine-tuning (whole and chunked
 * logits, the head's backward fused), LoRA with and without dropout, QLoRA,
 * classification and distillation.
 *
 * test_recompute [--backend cpu|cuda] [--precision fp32|bf16]: the same
 * comparisons on another backend (the gpu suite runs the CUDA backend in
 * both precisions: its fp32 attention stores the probabilities, its bf16
 * attention is fused and keeps row statistics, so both of SELECTIVE's
 * attention paths run). Equal bits there need the backend's ops to be
 * deterministic, which NONE run twice checks first. --backend emu16
 * --precision bf16 (tests/unit/emu16.h): the CPU playing the CUDA bf16 mode
 * (twins, bf16 weights, the GEMM scratch; stored probabilities), which also
 * checks that no GEMM outgrows the planned scratch and no twin is stale;
 * --backend emu16-flash: the same with the attention fused as the CUDA
 * backend fuses it (q, k, v kept in bf16 only, row statistics instead of
 * probabilities: SELECTIVE's other attention path). 77 (skipped) where the
 * backend is not available. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/backend.h"
#include "gpu/select.h"
#include "tests/check.h"
#include "tests/unit/emu16.h"
#include "tests/unit/lazycopy.h"
#include "train/lora.h"
#include "train/model.h"
#include "train/modeldir.h"

static const char *fx;
static const char *backend = "cpu";
static bool bf16;
/* open_backend's tables without attention_backward_rope16: the model then
 * runs the attention's backward, RoPE's and the roundings apart */
static bool unfused;
/* > 0: the runs' plans keep that many layers as SELECTIVE under FULL and
 * FULL_OFFLOAD (tr_plan_opts.selective_layers) */
static int sel_layers;

static struct gpu_backend *open_backend(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	td_err e = strcmp(backend, "emu16") == 0	 ? emu16_backend_new(&be, &eb)
		   : strcmp(backend, "emu16-flash") == 0 ? emu16_flash_backend_new(&be, &eb)
							 : gpu_backend_open(&be, backend, &eb);
	if (e == TD_OK && (e = gpu_set_bf16(be, bf16, &eb)) != TD_OK)
		gpu_backend_free(be);
	if (e != TD_OK) {
		fprintf(stderr, "backend %s: %s\n", backend, eb.msg);
		exit(2);
	}
	if (unfused) {
		static struct gpu_backend_ops t;
		t = *be->ops;
		t.attention_backward_rope16 = NULL;
		be->ops = &t;
	}
	return be;
}

#define QV (1u << TR_LIN_Q | 1u << TR_LIN_V)
#define ALL_LIN ((1u << TR_LIN_COUNT) - 1)
#define B_ 2
#define T_ 24
#define N_ (B_ * T_)

static void load_config(struct tr_model_config *c, const char *dir)
{
	char path[512];
	struct td_errbuf eb = {{0}};
	snprintf(path, sizeof(path), "%s/%s/config.json", fx, dir);
	if (tr_config_load(c, path, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		exit(2);
	}
}

/* A deterministic value in [-a, a) for element i of tensor k. */
static float noise(size_t k, size_t i, float a)
{
	uint64_t z = (k * 0x9e3779b97f4a7c15ULL) ^ (i * 0xbf58476d1ce4e5b9ULL);
	z ^= z >> 31;
	z *= 0x94d049bb133111ebULL;
	z ^= z >> 29;
	return a * (float)((double)(z >> 11) * 0x1p-53 * 2.0 - 1.0);
}

/* A model of cfg on be with the plan opts po: weights from the fixture dir
 * wdir, or random (norms near 1) when wdir is NULL; adapters initialised
 * with lora_B nonzero too (PEFT's zero B would give the adapters' A no
 * gradient), and a classifier's head. */
static struct tr_model *new_model(struct gpu_backend *be, const struct tr_model_config *cfg,
				  const struct tr_plan_opts *po, const char *wdir)
{
	struct td_errbuf eb = {{0}};
	struct tr_model *m = NULL;
	if (tr_model_new(&m, be, cfg, po, &eb) != TD_OK) {
		fprintf(stderr, "model: %s\n", eb.msg);
		exit(2);
	}
	if (wdir) {
		char path[512];
		snprintf(path, sizeof(path), "%s/%s", fx, wdir);
		struct tr_weights *w = NULL;
		if (tr_weights_open(&w, path, &eb) != TD_OK || tr_model_load(m, w, &eb) != TD_OK) {
			fprintf(stderr, "%s: %s\n", path, eb.msg);
			exit(2);
		}
		tr_weights_close(w);
	}
	if (po->lora_rank && tr_lora_init(m, 5, &eb) != TD_OK) {
		fprintf(stderr, "lora: %s\n", eb.msg);
		exit(2);
	}
	const struct tr_plan *p = tr_model_plan(m);
	for (size_t k = 0; k < p->nparams; k++) {
		const struct tr_param *t = &p->params[k];
		bool base = t->kind == TR_P_BASE;
		if (base && wdir)
			continue;
		if (t->kind == TR_P_LORA_A)
			continue; /* tr_lora_init's */
		float *v = malloc(t->numel * sizeof(float));
		bool norm = base && t->ndim == 1 && strstr(t->name, "norm");
		for (size_t i = 0; i < t->numel; i++)
			v[i] = norm ? 1.0f + noise(k, i, 0.1f) : noise(k, i, base ? 0.08f : 0.05f);
		CHECK_EQ_INT(tr_model_set_param(m, t, v), TD_OK);
		free(v);
	}
	return m;
}

enum method { M_CAUSAL, M_CLASSIFY, M_DISTILL };

struct rc_case {
	const char *name;
	const char *model;   /* fixture dir */
	int layers;          /* > 0: this many layers and random weights */
	enum method method;
	struct tr_plan_opts po;
	bool fuse;           /* the head's backward fused into the forward */
};

/* What a run gives: every forward's loss terms, the gradients of the
 * second step, the hidden states of the last forward and the parameters
 * after two AdamW steps. */
struct result {
	double loss[4][3];
	size_t ngrad, nparam, nhidden;
	float *grad, *param, *hidden;
	size_t plan_bytes, acts_bytes, alloc_bytes, peak_bytes; /* the last two: the model's alone */
	size_t host_plan, host_alloc, host_peak; /* the host arena (FULL_OFFLOAD) */
	int layers;
	/* From the shapes: a layer input (fp32 N x C) and, where the attention
	 * is fused, its output and row statistics (its bf16 twin y16, y in
	 * fp32 only where planned, B x NH x T floats), each at TR_PLAN_ALIGN:
	 * what FULL_OFFLOAD moves a layer */
	size_t res, att_set;
	bool off_att; /* FULL_OFFLOAD moves the attention's too (tr_plan_offloads_attention) */
};

static size_t al(size_t bytes)
{
	return (bytes + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
}

static void result_free(struct result *r)
{
	free(r->grad);
	free(r->param);
	free(r->hidden);
}

/* The batch of micro-batch a of step s: ids and labels (some -100), with a
 * padded tail for the classifier; class ids. */
static void batch(int s, int a, int V, int32_t *ids, int32_t *labels, int32_t *cls)
{
	for (int i = 0; i < N_; i++) {
		ids[i] = (int32_t)((i * 131 + 7 + 37 * (2 * s + a)) % V);
		labels[i] = i % 7 == 3 ? -100 : (int32_t)((i * 17 + 3 + s + a) % V);
	}
	for (int t = T_ - 4; t < T_; t++)
		ids[T_ + t] = 5; /* row 1 padded with the classifier's pad id */
	cls[0] = (int32_t)(s + a) % 3;
	cls[1] = 2;
}

/* Runs whose plan kept the bf16 copy of the layers' matrices in a ring
 * (train/plan.h: copy16_ring; FULL and FULL_OFFLOAD of the 4-layer full
 * fine-tunes in the bf16 mode), each then compared with NONE's copy of
 * every layer: the rounding again before a layer's use gives its bits. */
static int ring_runs;

/* lazy: the copies as late as they may be (tests/unit/lazycopy.h). */
static void run(const struct rc_case *c, enum tr_recompute rc, bool lazy, struct result *r)
{
	struct td_errbuf eb = {{0}};
	memset(r, 0, sizeof(*r));
	struct gpu_backend *be = open_backend();
	if (lazy)
		lazycopy_install(be);
	struct tr_model_config cfg;
	load_config(&cfg, c->model);
	if (c->layers)
		cfg.num_layers = c->layers;
	const char *wdir = c->layers ? NULL : c->model;
	struct tr_plan_opts po = c->po;
	po.B = B_;
	po.T = T_;
	po.recompute = rc;
	po.selective_layers = sel_layers;
	/* FULL_OFFLOAD moves the attention's output wherever it frees device
	 * memory, though at these sizes the copies would not pay */
	po.offload_attention = 1;
	size_t before = be->bytes_in_use;
	struct tr_model *m = new_model(be, &cfg, &po, wdir);
	const struct tr_plan *p = tr_model_plan(m);
	r->plan_bytes = tr_plan_total_bytes(p);
	r->acts_bytes = p->arena_bytes[TR_ARENA_ACTS];
	r->alloc_bytes = be->bytes_in_use - before;
	r->host_plan = tr_plan_host_bytes(p);
	r->layers = cfg.num_layers;
	if (p->copy16_ring)
		ring_runs++;
	{
		const size_t N = (size_t)B_ * T_, H = (size_t)cfg.num_heads * cfg.head_dim;
		r->res = al(N * cfg.hidden_size * sizeof(float));
		/* the output in fp32 only where read: the unfused attention,
		 * fp32 GEMMs, LoRA dropout; the fused backward reads y16 */
		const struct tr_plan_opts *o = &p->opts;
		const bool y32 = !o->attention_lse || !o->gemm_bf16 ||
				 (o->lora_rank && o->lora_dropout > 0.0f);
		r->att_set = o->attention_lse
				     ? al((size_t)B_ * cfg.num_heads * T_ * sizeof(float)) +
					       (y32 ? al(N * H * sizeof(float)) : 0) +
					       (o->gemm_bf16 ? al(N * H * 2) : 0)
				     : 0;
		CHECK_MSG(y32 == (tr_plan_find(p, "acts.layers.0.y") || tr_plan_find(p, "acts.work.y") ||
				  tr_plan_find(p, "acts.ring.0.y")),
			  "%s: the attention's fp32 output is planned exactly where it is read (%d)",
			  c->name, (int)y32);
		r->off_att = tr_plan_offloads_attention(&cfg, &p->opts);
	}
	r->host_alloc = be->host_bytes_in_use;
	/* The teacher after the student, as train/method.c builds them (each
	 * model's ops use its own bf16 GEMM scratch, whatever the order). */
	struct tr_model *teacher = NULL;
	size_t teacher_bytes = be->bytes_in_use;
	if (c->method == M_DISTILL) {
		struct tr_model_config tc;
		load_config(&tc, "distill/teacher");
		struct tr_plan_opts to = {.B = B_, .T = T_, .inference = true, .teacher_rows = true,
					  .logits_chunk_floats = c->po.logits_chunk_floats};
		teacher = new_model(be, &tc, &to, "distill/teacher");
	}
	teacher_bytes = be->bytes_in_use - teacher_bytes;
	if (c->method == M_CLASSIFY)
		tr_model_set_pad_id(m, 5);
	const int V = cfg.vocab_size;
	int32_t ids[N_], labels[N_], cls[B_];
	for (int s = 0; s < 2; s++) {
		tr_model_zero_grad(m);
		for (int a = 0; a < 2; a++) {
			batch(s, a, V, ids, labels, cls);
			double *l = r->loss[2 * s + a];
			int64_t nv = 0;
			const float dloss = 1.0f / 64.0f;
			tr_model_set_dropout_seed(m, (uint64_t)(100 + 2 * s + a));
			td_err e = TD_OK;
			switch (c->method) {
			case M_CAUSAL:
				if (c->fuse)
					tr_model_fuse_head_backward(m, dloss);
				e = tr_model_forward(m, ids, labels, &l[0], &nv, &eb);
				break;
			case M_CLASSIFY:
				e = tr_model_forward_classify(m, ids, cls, &l[0], &nv, &eb);
				break;
			case M_DISTILL: {
				struct tr_distill_sums ds;
				e = tr_model_forward_trunk(teacher, ids, &eb);
				if (e == TD_OK)
					e = tr_model_forward_distill(m, ids, labels, teacher, 2.0f, 0.5f, &ds,
								     &eb);
				l[0] = ds.loss_sum;
				l[1] = ds.kl_sum;
				nv = ds.n_valid;
				break;
			}
			}
			CHECK_MSG(e == TD_OK, "%s (%s): forward: %s", c->name, tr_recompute_name(rc), eb.msg);
			if (e != TD_OK)
				goto out;
			l[2] = (double)nv;
			tr_model_backward(m, dloss);
		}
		if (s == 1)
			break; /* the second step's gradients, before its update */
		tr_model_clip_grads(m, 1.0);
		struct tr_adamw h = {0.9f, 0.999f, 1e-8f, 0.01f};
		tr_model_adamw(m, &h, 1e-3f, s + 1);
	}
	r->ngrad = p->numel_trainable;
	r->grad = malloc((r->ngrad + 1) * sizeof(float));
	for (size_t k = 0; k < p->nparams; k++)
		if (p->params[k].trainable)
			tr_model_get_grad(m, &p->params[k], r->grad + p->params[k].goffset);
	size_t C = (size_t)cfg.hidden_size;
	r->nhidden = (size_t)(cfg.num_layers + 1) * N_ * C;
	r->hidden = malloc(r->nhidden * sizeof(float));
	for (int i = 0; i <= cfg.num_layers; i++)
		tr_model_get_hidden(m, i, r->hidden + (size_t)i * N_ * C);
	tr_model_clip_grads(m, 1.0);
	struct tr_adamw h = {0.9f, 0.999f, 1e-8f, 0.01f};
	tr_model_adamw(m, &h, 1e-3f, 2);
	r->nparam = p->numel_trainable;
	r->param = malloc((r->nparam + 1) * sizeof(float));
	for (size_t k = 0; k < p->nparams; k++)
		if (p->params[k].trainable)
			tr_model_get_param(m, &p->params[k], r->param + p->params[k].goffset);
	CHECK_EQ_INT(gpu_sync(be, &eb), TD_OK);
out:
	r->peak_bytes = be->bytes_peak - before - teacher_bytes;
	r->host_peak = be->host_bytes_peak;
	tr_model_free(m);
	tr_model_free(teacher);
	CHECK_EQ_INT(be->bytes_in_use, 0);
	CHECK_EQ_INT(be->host_bytes_in_use, 0);
	gpu_backend_free(be);
}

/* Index of the first element where a and b differ, or n. */
static size_t first_diff(const float *a, const float *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (memcmp(a + i, b + i, sizeof(float)) != 0)
			return i;
	return n;
}

/* An untied embedding's gradient kept by rows (train/plan.h: emb_slots,
 * opts.grad_accum) against the same model keeping the table (grad_accum
 * unsaid), on the llama fixture (untied), full fine-tuning, 2 steps of 2
 * micro-batches (ids repeating within and across them, the pad id among
 * them): the plan holds the rows, the tokens' rows and the ids' rows
 * instead of the table (the bytes, each buffer aligned), and its grads arena the other floats; the losses, every
 * gradient of the second step (the embedding's read back as a table) and
 * the parameters after AdamW (the embedding's through its rows) are the
 * same bits. Both clip with the table model's norm, so AdamW sees one
 * coefficient; the rows model's own norm sums the same squares in another
 * order (the rows, then the rest): within 1e-10 relative, a double sum's
 * rounding over ~2^17 terms (each 2^-53 relative) being below 2^-36. */
static void test_emb_rows(void)
{
	struct tr_model_config cfg;
	load_config(&cfg, "llama");
	CHECK(!cfg.tie_word_embeddings);
	const int V = cfg.vocab_size, C = cfg.hidden_size;
	struct gpu_backend *be[2];
	struct tr_model *m[2];
	for (int k = 0; k < 2; k++) {
		be[k] = open_backend();
		struct tr_plan_opts po = {.B = B_, .T = T_, .grad_accum = k ? 2 : 0};
		m[k] = new_model(be[k], &cfg, &po, "llama");
		tr_model_set_pad_id(m[k], 5);
	}
	const struct tr_plan *p0 = tr_model_plan(m[0]), *p1 = tr_model_plan(m[1]);
	const struct tr_param *emb = tr_plan_param(p1, "model.embed_tokens.weight");
	CHECK_EQ_INT(p0->emb_slots, 0);
	CHECK_EQ_INT(p1->emb_slots, 2 * N_);
	CHECK_EQ_INT(p1->grads_lo, (size_t)V * C);
	CHECK_EQ_INT(tr_plan_find(p1, "grads")->bytes, (p1->numel_trainable - (size_t)V * C) * 4);
	CHECK_EQ_INT(tr_plan_find(p1, "grads.emb_rows")->bytes, (size_t)2 * N_ * C * 4);
	CHECK_EQ_INT(tr_plan_find(p1, "grads.emb_row_of")->bytes, (size_t)V * 4);
	const size_t nt = p1->numel_trainable, VC = (size_t)V * C;
	CHECK_EQ_INT(tr_plan_total_bytes(p0) - tr_plan_total_bytes(p1),
		     al(nt * 4) - al((nt - VC) * 4) - al((size_t)2 * N_ * C * 4) - al((size_t)V * 4) -
			     al((size_t)N_ * 4));
	int32_t ids[N_], labels[N_], cls[B_];
	double loss[2][2][2];
	float *g[2], *w[2];
	const size_t n = p1->numel_trainable;
	double norm[2] = {0, 0};
	for (int k = 0; k < 2; k++) {
		g[k] = malloc(n * sizeof(float));
		w[k] = malloc(n * sizeof(float));
	}
	for (int s = 0; s < 2; s++) {
		for (int k = 0; k < 2; k++) {
			struct td_errbuf eb = {{0}};
			tr_model_zero_grad(m[k]);
			for (int a = 0; a < 2; a++) {
				batch(s, a, V, ids, labels, cls);
				ids[3] = 5; /* the pad id: its rows add no gradient */
				int64_t nv;
				CHECK_EQ_INT(tr_model_forward(m[k], ids, labels, &loss[k][s][a], &nv, &eb), TD_OK);
				tr_model_backward(m[k], 1.0f / 64.0f);
			}
			norm[k] = tr_model_grad_norm(m[k]);
			if (s == 1)
				for (size_t i = 0; i < p1->nparams; i++)
					tr_model_get_grad(m[k], &p1->params[i], g[k] + p1->params[i].goffset);
		}
		CHECK_MSG(fabs(norm[1] - norm[0]) <= 1e-10 * norm[0], "step %d: norms %.17g and %.17g", s,
			  norm[1], norm[0]);
		struct tr_adamw h = {0.9f, 0.999f, 1e-8f, 0.01f};
		for (int k = 0; k < 2; k++) {
			tr_model_clip_grads_by(m[k], 1.0, norm[0]);
			tr_model_adamw(m[k], &h, 1e-3f, s + 1);
		}
	}
	for (int k = 0; k < 2; k++)
		for (size_t i = 0; i < p1->nparams; i++)
			tr_model_get_param(m[k], &p1->params[i], w[k] + p1->params[i].goffset);
	CHECK(memcmp(loss[0], loss[1], sizeof(loss[0])) == 0);
	size_t d = first_diff(g[0], g[1], n);
	CHECK_MSG(d == n, "gradient %zu of %zu (the embedding's %zu): %.9g, the table's %.9g", d, n,
		  emb->numel, d < n ? g[1][d] : 0.0, d < n ? g[0][d] : 0.0);
	d = first_diff(w[0], w[1], n);
	CHECK_MSG(d == n, "parameter %zu of %zu after AdamW: %.9g, the table's %.9g", d, n,
		  d < n ? w[1][d] : 0.0, d < n ? w[0][d] : 0.0);
	/* the embedding's gradient is not all zero rows (the test would be weak) */
	size_t nz = 0;
	for (size_t i = 0; i < emb->numel; i++)
		nz += g[1][i] != 0.0f;
	CHECK(nz > 0 && nz < emb->numel);
	printf("llama, the embedding's gradient by rows (%zu of %d): the table's bits\n", p1->emb_slots, V);
	for (int k = 0; k < 2; k++) {
		free(g[k]);
		free(w[k]);
		tr_model_free(m[k]);
		CHECK_EQ_INT(be[k]->bytes_in_use, 0);
		gpu_backend_free(be[k]);
	}
}

static void test_same_bits(void)
{
	const struct rc_case cases[] = {
		{"qwen2 full", "qwen2", 0, M_CAUSAL, {0}, false},
		{"llama full", "llama", 0, M_CAUSAL, {0}, false},
		{"qwen3 full", "qwen3", 0, M_CAUSAL, {0}, false},
		{"qwen2 full, chunked head fused", "qwen2", 0, M_CAUSAL,
		 {.logits_chunk_floats = 5 * 512}, true},
		{"qwen3 4 layers full", "qwen3", 4, M_CAUSAL, {0}, false},
		{"qwen2 4 layers full, head fused", "qwen2", 4, M_CAUSAL, {0}, true},
		{"qwen2 lora q,v", "qwen2", 0, M_CAUSAL,
		 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = QV}, false},
		{"llama lora all + dropout", "llama", 0, M_CAUSAL,
		 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.2f}, false},
		{"qwen3 lora all + dropout, head fused", "qwen3", 0, M_CAUSAL,
		 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.2f}, true},
		{"qwen3 4 layers lora all + dropout", "qwen3", 4, M_CAUSAL,
		 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.1f}, false},
		{"qwen2 qlora all + dropout", "qwen2", 0, M_CAUSAL,
		 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.1f,
		  .base_quant = TR_QUANT_NF4, .nf4_double_quant = true}, false},
		{"llama 4 layers qlora all", "llama", 4, M_CAUSAL,
		 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .base_quant = TR_QUANT_NF4},
		 false},
		{"qwen2 classify full", "qwen2-classify", 0, M_CLASSIFY, {.num_labels = 3}, false},
		{"qwen2 classify lora all + dropout", "qwen2-classify", 0, M_CLASSIFY,
		 {.num_labels = 3, .lora_rank = 2, .lora_alpha = 4, .lora_targets = ALL_LIN,
		  .lora_dropout = 0.3f}, false},
		{"qwen2 distill", "qwen2", 0, M_DISTILL, {.distill = true}, false},
		{"qwen2 distill chunked", "qwen2", 0, M_DISTILL,
		 {.distill = true, .logits_chunk_floats = 5 * 512}, false},
	};
	/* The late copies are the CPU's: a GPU backend's copies are its own. */
	const bool cpu = strcmp(backend, "cpu") == 0 || strncmp(backend, "emu16", 5) == 0;
	/* NONE with the attention's backward apart from RoPE's and the
	 * roundings, where the backend fuses them */
	struct gpu_backend *probe = open_backend();
	const bool fuses = probe->ops->attention_backward_rope16 != NULL;
	gpu_backend_free(probe);
	/* MIXED, MIXED_OFF: FULL and FULL_OFFLOAD with the first layer
	 * SELECTIVE (tr_layer_recompute), the last layer as it always is */
	enum { AGAIN = TR_RECOMPUTE_COUNT, LAZY, UNFUSED, MIXED, MIXED_OFF, NRUNS };
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct rc_case *c = &cases[i];
		struct result r[NRUNS];
		for (int rc = 0; rc < NRUNS; rc++) {
			if (rc == AGAIN) {
				/* NONE again: whether this backend repeats itself at all */
				run(c, TR_RECOMPUTE_NONE, false, &r[rc]);
				continue;
			}
			if (rc == LAZY) {
				if (cpu)
					run(c, TR_RECOMPUTE_FULL_OFFLOAD, true, &r[rc]);
				else
					memset(&r[rc], 0, sizeof(r[rc]));
				continue;
			}
			if (rc == UNFUSED) {
				if (fuses) {
					unfused = true;
					run(c, TR_RECOMPUTE_NONE, false, &r[rc]);
					unfused = false;
				} else {
					memset(&r[rc], 0, sizeof(r[rc]));
				}
				continue;
			}
			if (rc == MIXED || rc == MIXED_OFF) {
				sel_layers = 1;
				run(c, rc == MIXED ? TR_RECOMPUTE_FULL : TR_RECOMPUTE_FULL_OFFLOAD, false,
				    &r[rc]);
				sel_layers = 0;
			} else {
				run(c, (enum tr_recompute)rc, false, &r[rc]);
			}
			/* the plan is what the backend allocates, and all it ever
			 * holds, on the device and on the host */
			CHECK_MSG(r[rc].alloc_bytes == r[rc].plan_bytes,
				  "%s (%s): allocated %zu bytes, plan %zu", c->name,
				  tr_recompute_name(rc), r[rc].alloc_bytes, r[rc].plan_bytes);
			CHECK_MSG(r[rc].peak_bytes == r[rc].plan_bytes, "%s (%s): peak %zu bytes, plan %zu",
				  c->name, tr_recompute_name(rc), r[rc].peak_bytes, r[rc].plan_bytes);
			CHECK_MSG(r[rc].host_alloc == r[rc].host_plan && r[rc].host_peak == r[rc].host_plan,
				  "%s (%s): host memory allocated %zu bytes, peak %zu, plan %zu", c->name,
				  tr_recompute_name(rc), r[rc].host_alloc, r[rc].host_peak, r[rc].host_plan);
			/* only FULL_OFFLOAD has host bytes: FULL's layer inputs but the last output */
			CHECK_MSG((rc == TR_RECOMPUTE_FULL_OFFLOAD || rc == MIXED_OFF) ==
					  (r[rc].host_plan > 0),
				  "%s (%s): host plan %zu bytes", c->name, tr_recompute_name(rc),
				  r[rc].host_plan);
		}
		CHECK_MSG(r[TR_RECOMPUTE_FULL_OFFLOAD].acts_bytes < r[TR_RECOMPUTE_FULL].acts_bytes &&
				  r[TR_RECOMPUTE_FULL].acts_bytes < r[TR_RECOMPUTE_SELECTIVE].acts_bytes &&
				  r[TR_RECOMPUTE_SELECTIVE].acts_bytes < r[TR_RECOMPUTE_NONE].acts_bytes,
			  "%s: acts full-offload %zu, full %zu, selective %zu, none %zu", c->name,
			  r[TR_RECOMPUTE_FULL_OFFLOAD].acts_bytes, r[TR_RECOMPUTE_FULL].acts_bytes,
			  r[TR_RECOMPUTE_SELECTIVE].acts_bytes, r[TR_RECOMPUTE_NONE].acts_bytes);
		/* a selective layer keeps more than a full one, less than
		 * SELECTIVE's layers and working set (as much where every layer
		 * but the last is selective: the last's products are then
		 * FULL's working set), and the host the same */
		for (int k = MIXED; k <= MIXED_OFF; k++) {
			const int base = k == MIXED ? TR_RECOMPUTE_FULL : TR_RECOMPUTE_FULL_OFFLOAD;
			CHECK_MSG(r[k].acts_bytes > r[base].acts_bytes &&
					  r[k].acts_bytes - r[base].acts_bytes <=
						  r[TR_RECOMPUTE_SELECTIVE].acts_bytes -
							  r[TR_RECOMPUTE_FULL].acts_bytes &&
					  r[k].host_plan == r[base].host_plan,
				  "%s: acts %s with a selective layer %zu (host %zu), without %zu (%zu); "
				  "selective %zu",
				  c->name, tr_recompute_name(base), r[k].acts_bytes, r[k].host_plan,
				  r[base].acts_bytes, r[base].host_plan, r[TR_RECOMPUTE_SELECTIVE].acts_bytes);
		}
		/* what moved to the host is what left the device, but for the
		 * ring's slots, one of which would have held the last output:
		 * L layer inputs on the host, L + 1 - RING fewer on the device;
		 * with the attention's output, L - RING sets on the host and one
		 * more on the device (its ring slots for FULL's working copy) */
		const struct result *fo = &r[TR_RECOMPUTE_FULL_OFFLOAD];
		const size_t L = (size_t)fo->layers, ring = L < TR_OFFLOAD_RING ? L : TR_OFFLOAD_RING;
		CHECK_MSG(fo->off_att == (fo->att_set > 0 && (L + 1 - ring) * fo->res > (ring - 1) * fo->att_set),
			  "%s: full-offload %s the attention's output", c->name,
			  fo->off_att ? "moves" : "does not move");
		const size_t set = fo->off_att ? fo->att_set : 0;
		CHECK_MSG(fo->host_plan == L * fo->res + (L - ring) * set,
			  "%s: full-offload's host plan %zu bytes, %zu layers of %zu + %zu", c->name,
			  fo->host_plan, L, fo->res, set);
		CHECK_MSG(r[TR_RECOMPUTE_FULL].acts_bytes - fo->acts_bytes ==
				  (L + 1 - ring) * fo->res - (ring - 1) * set,
			  "%s: full-offload moved %zu bytes of acts to %zu host bytes", c->name,
			  r[TR_RECOMPUTE_FULL].acts_bytes - fo->acts_bytes, fo->host_plan);
		printf("%-40s acts none %7zu  selective %7zu  full %7zu  full-offload %7zu "
		       "(+ host %7zu) bytes\n",
		       c->name, r[0].acts_bytes, r[1].acts_bytes, r[2].acts_bytes, fo->acts_bytes,
		       fo->host_plan);
		const struct result *n = &r[TR_RECOMPUTE_NONE];
		for (int rc = NRUNS - 1; rc >= 1; rc--) {
			const struct result *x = &r[rc];
			if ((rc == LAZY && !cpu) || (rc == UNFUSED && !fuses))
				continue;
			const char *pol = rc == AGAIN	 ? "none again"
					  : rc == LAZY	 ? "full-offload, late copies"
					  : rc == UNFUSED ? "none, attention backward unfused"
					  : rc == MIXED	 ? "full, first layer selective"
					  : rc == MIXED_OFF ? "full-offload, first layer selective"
							 : tr_recompute_name(rc);
			CHECK_MSG(memcmp(x->loss, n->loss, sizeof(n->loss)) == 0,
				  "%s (%s): losses %.17g %.17g, none's %.17g %.17g", c->name, pol,
				  x->loss[0][0], x->loss[3][0], n->loss[0][0], n->loss[3][0]);
			const struct {
				const char *what;
				const float *a, *b;
				size_t n;
			} arrays[] = {
				{"gradient", x->grad, n->grad, n->ngrad},
				{"hidden state", x->hidden, n->hidden, n->nhidden},
				{"parameter after AdamW", x->param, n->param, n->nparam},
			};
			for (size_t k = 0; k < sizeof(arrays) / sizeof(arrays[0]); k++) {
				if (!arrays[k].a || !arrays[k].b) { /* a run that failed (reported) */
					CHECK(arrays[k].a == arrays[k].b);
					continue;
				}
				size_t d = first_diff(arrays[k].a, arrays[k].b, arrays[k].n);
				CHECK_MSG(d == arrays[k].n, "%s (%s): %s %zu of %zu is %.9g, none's %.9g",
					  c->name, pol, arrays[k].what, d, arrays[k].n,
					  d < arrays[k].n ? (double)arrays[k].a[d] : 0.0,
					  d < arrays[k].n ? (double)arrays[k].b[d] : 0.0);
			}
		}
		for (int rc = 0; rc < NRUNS; rc++)
			result_free(&r[rc]);
	}
	/* the late copies were late: up to a ring's worth queued at once */
	CHECK_MSG(!cpu || lazycopy_most_queued() >= 2, "late copies: at most %zu queued (%zu done)",
		  lazycopy_most_queued(), lazycopy_done());
}

/* The stage list: the forward, then the head's chunks backward, the final
 * norm, layer by layer from the last (recomputed first, but the last, where
 * the policy recomputes; each layer's backward its MLP's stage, then its
 * attention's), the embedding and the optimizer. FULL_OFFLOAD:
 * each layer's input copied out after the stage that writes it (the last
 * layer's output is not: nothing recomputes from it), and copied back after
 * the stage that last reads its ring slot, TR_OFFLOAD_RING layers above. */
static void test_stages(void)
{
	struct tr_model_config cfg;
	load_config(&cfg, "qwen2");
	cfg.num_layers = 3;
	for (int rc = 0; rc < TR_RECOMPUTE_COUNT; rc++) {
		for (int inf = 0; inf < 2; inf++) {
			struct tr_plan p;
			struct td_errbuf eb = {{0}};
			struct tr_plan_opts po = {.B = B_, .T = T_, .logits_chunk_floats = 20 * 512,
						  .recompute = (enum tr_recompute)rc, .inference = inf,
						  .teacher_rows = inf};
			CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
			CHECK_EQ_INT(p.logits_rows, 20);
			char got[1024] = "", want[1024] = "";
			size_t g = 0, w = 0;
			for (size_t i = 0; i < p.nstages; i++) {
				const struct tr_stage *s = &p.stages[i];
				g += (size_t)snprintf(got + g, sizeof(got) - g, "%s%s", i ? " " : "",
						      tr_stage_name(s->kind));
				if (s->layer >= 0)
					g += (size_t)snprintf(got + g, sizeof(got) - g, "%d", s->layer);
				if (s->rows)
					g += (size_t)snprintf(got + g, sizeof(got) - g, "[%d+%d]", s->r0,
							      s->rows);
				if (i + 1 == p.nforward)
					g += (size_t)snprintf(got + g, sizeof(got) - g, " |");
			}
			const bool off = rc == TR_RECOMPUTE_FULL_OFFLOAD && !inf;
			_Static_assert(TR_OFFLOAD_RING == 2, "the stages below are a ring of two's");
			w += (size_t)snprintf(want + w, sizeof(want) - w, "%s",
					      off ? "embed offload0 layer0 offload1 layer1 offload2 layer2"
						  : "embed layer0 layer1 layer2");
			w += (size_t)snprintf(want + w, sizeof(want) - w,
					      " final_norm head[0+20] head[20+20] head[40+8] |");
			if (!inf) {
				w += (size_t)snprintf(want + w, sizeof(want) - w,
						      " head_backward[0+20] head_backward[20+20] "
						      "head_backward[40+8] final_norm_backward%s layer_backward_mlp2 "
						      "layer_backward2%s",
						      off ? " prefetch1" : "", off ? " prefetch0" : "");
				for (int l = 1; l >= 0; l--) {
					if (rc)
						w += (size_t)snprintf(want + w, sizeof(want) - w,
								      " layer_recompute%d", l);
					w += (size_t)snprintf(want + w, sizeof(want) - w,
							      " layer_backward_mlp%d layer_backward%d", l, l);
				}
				w += (size_t)snprintf(want + w, sizeof(want) - w, " embed_backward optimizer");
			}
			CHECK_MSG(strcmp(got, want) == 0, "%s%s stages:\n  got  %s\n  want %s",
				  tr_recompute_name(rc), inf ? " (inference)" : "", got, want);
			CHECK_EQ_INT(p.nforward, off ? 11 : 8);
			tr_plan_fini(&p);
		}
	}
}

/* Real shapes, from their configs alone, in the precision a GPU job runs
 * (bf16 GEMMs, fused attention) and the CPU's (fp32, stored probabilities):
 * FULL_OFFLOAD < FULL < SELECTIVE < NONE in activations, FULL_OFFLOAD's host
 * arena L residual streams, and the bytes are printed. */
static void test_real_shapes(void)
{
	static const struct {
		const char *name, *json;
		struct tr_plan_opts po;
	} cases[] = {
		{"Qwen2-0.5B full B8 x T1024",
		 "{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":896,\"intermediate_size\":4864,"
		 "\"num_hidden_layers\":24,\"num_attention_heads\":14,\"num_key_value_heads\":2,"
		 "\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true,"
		 "\"max_position_embeddings\":32768,\"torch_dtype\":\"bfloat16\"}",
		 {.B = 8, .T = 1024}},
		{"Llama-3-8B full B1 x T2048",
		 "{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,\"intermediate_size\":14336,"
		 "\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
		 "\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,\"tie_word_embeddings\":false,"
		 "\"max_position_embeddings\":8192,\"torch_dtype\":\"bfloat16\"}",
		 {.B = 1, .T = 2048}},
		{"Llama-3-8B LoRA q,v r16 B4 x T2048",
		 "{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,\"intermediate_size\":14336,"
		 "\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
		 "\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,\"tie_word_embeddings\":false,"
		 "\"max_position_embeddings\":8192,\"torch_dtype\":\"bfloat16\"}",
		 {.B = 4, .T = 2048, .lora_rank = 16, .lora_alpha = 32, .lora_targets = QV}},
		{"Llama-3-8B LoRA all seven r16 B4 x T2048",
		 "{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,\"intermediate_size\":14336,"
		 "\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
		 "\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,\"tie_word_embeddings\":false,"
		 "\"max_position_embeddings\":8192,\"torch_dtype\":\"bfloat16\"}",
		 {.B = 4, .T = 2048, .lora_rank = 16, .lora_alpha = 32, .lora_targets = ALL_LIN}},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct tr_model_config cfg;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(tr_config_parse(&cfg, cases[i].json, "case", &eb), TD_OK);
		for (int bf16 = 1; bf16 >= 0; bf16--) {
			struct tr_plan_opts po = cases[i].po;
			po.gemm_bf16 = po.attention_lse = bf16;
			size_t acts[TR_RECOMPUTE_COUNT], total[TR_RECOMPUTE_COUNT], host[TR_RECOMPUTE_COUNT];
			CHECK_EQ_INT(tr_plan_policy_bytes(&cfg, &po, acts, total, host, &eb), TD_OK);
			CHECK(acts[TR_RECOMPUTE_FULL_OFFLOAD] < acts[TR_RECOMPUTE_FULL] &&
			      acts[TR_RECOMPUTE_FULL] < acts[TR_RECOMPUTE_SELECTIVE] &&
			      acts[TR_RECOMPUTE_SELECTIVE] < acts[TR_RECOMPUTE_NONE]);
			/* FULL_OFFLOAD: L layer inputs on the host, L + 1 - RING fewer
			 * on the device; fused, also the attention's output and
			 * statistics of L - RING layers on the host, one set more on
			 * the device (see run) */
			const size_t N = (size_t)po.B * po.T, H = (size_t)cfg.num_heads * cfg.head_dim;
			const size_t L = (size_t)cfg.num_layers;
			const size_t res = (size_t)po.B * po.T * cfg.hidden_size * sizeof(float);
			/* where the layer computes long enough for the copies
			 * (TR_OFFLOAD_MIN_FLOP_PER_BYTE): Llama-3-8B's 10.6k FLOP a
			 * byte, not Qwen2-0.5B's 3.3k */
			const bool pays = bf16 && cfg.hidden_size == 4096;
			CHECK_EQ_INT(tr_plan_offloads_attention(&cfg, &po), pays);
			/* the fused attention's output in bf16 only (no dropout here:
			 * nothing reads it in fp32) */
			const size_t set = pays ? al((size_t)po.B * cfg.num_heads * po.T * sizeof(float)) +
							  al(N * H * 2)
						: 0;
			CHECK_EQ_INT(host[TR_RECOMPUTE_FULL_OFFLOAD], L * res + (L - TR_OFFLOAD_RING) * set);
			CHECK_EQ_INT(acts[TR_RECOMPUTE_FULL] - acts[TR_RECOMPUTE_FULL_OFFLOAD],
				     (L + 1 - TR_OFFLOAD_RING) * res - (TR_OFFLOAD_RING - 1) * set);
			/* A full fine-tune's bf16 copy of its layers' matrices (q, k,
			 * v, o, gate, up, down) under FULL and FULL_OFFLOAD: a ring
			 * of TR_COPY16_RING layers' (train/plan.h: copy16_ring) */
			const size_t C = (size_t)cfg.hidden_size, I = (size_t)cfg.intermediate_size;
			const size_t KV = (size_t)cfg.num_kv_heads * cfg.head_dim;
			const size_t per = C * (H + 2 * KV) + H * C + 3 * C * I;
			const bool ring = bf16 && po.lora_rank == 0 && L > TR_COPY16_RING;
			CHECK_EQ_INT(per * 2 % TR_PLAN_ALIGN, 0); /* so the aligned buffer shrinks by it */
			/* The MLP's backward takes the same rows under every
			 * policy (their bits are NONE's): whole where that takes
			 * no more scratch (tr_plan_build) — Qwen2-0.5B's in the
			 * bf16 mode, whose 3 x 8192 x 4864 bf16 gradients (239
			 * MB) fit under its logits' chunk (2736 x 151936 bf16,
			 * 831 MB) in the layer's backward region. */
			int rows[TR_RECOMPUTE_COUNT];
			for (int rc = 0; rc < TR_RECOMPUTE_COUNT; rc++) {
				struct tr_plan q;
				struct tr_plan_opts qo = po;
				qo.recompute = (enum tr_recompute)rc;
				CHECK_EQ_INT(tr_plan_build(&q, &cfg, &qo, &eb), TD_OK);
				rows[rc] = q.mlp_rows;
				tr_plan_fini(&q);
				CHECK_EQ_INT(rows[rc], rows[0]);
			}
			if (bf16 && cfg.hidden_size == 896)
				CHECK_EQ_INT(rows[0], (int)N);
			printf("%-36s %-4s the MLP's backward by %d of %zu rows\n", cases[i].name,
			       bf16 ? "bf16" : "fp32", rows[0], N);
			for (int rc = 0; rc < TR_RECOMPUTE_COUNT; rc++) {
				/* the other arenas do not depend on the policy, but for
				 * the ring */
				const bool full = rc == TR_RECOMPUTE_FULL || rc == TR_RECOMPUTE_FULL_OFFLOAD;
				const size_t saved = ring && full ? (L - TR_COPY16_RING) * per * 2 : 0;
				CHECK_EQ_INT(total[rc] - acts[rc], total[0] - acts[0] - saved);
				CHECK_EQ_INT(host[rc] > 0, rc == TR_RECOMPUTE_FULL_OFFLOAD);
				char b1[32], b2[32], b3[32];
				printf("%-36s %-4s %-12s acts %10s  total %10s  host %10s  (%zu / %zu / %zu bytes)\n",
				       cases[i].name, bf16 ? "bf16" : "fp32", tr_recompute_name(rc),
				       tr_fmt_bytes(b1, sizeof(b1), acts[rc]),
				       tr_fmt_bytes(b2, sizeof(b2), total[rc]),
				       tr_fmt_bytes(b3, sizeof(b3), host[rc]), acts[rc], total[rc], host[rc]);
			}
		}
	}
	/* The printed plan (traind --plan) names the policy and gives every
	 * policy's activations and total (and FULL_OFFLOAD's host bytes); a
	 * forward-only plan has none. */
	struct tr_model_config cfg;
	load_config(&cfg, "qwen2");
	struct tr_plan p;
	struct td_errbuf eb = {{0}};
	for (int inf = 0; inf < 3; inf++) {
		struct tr_plan_opts po = {.B = 2, .T = 8,
					  .recompute = inf == 2 ? TR_RECOMPUTE_FULL_OFFLOAD
								: TR_RECOMPUTE_SELECTIVE,
					  .inference = inf == 1};
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
		size_t acts[TR_RECOMPUTE_COUNT], total[TR_RECOMPUTE_COUNT];
		CHECK_EQ_INT(tr_plan_recompute_bytes(&cfg, &po, acts, total, &eb), TD_OK);
		char *text = NULL, want[256];
		size_t len = 0;
		FILE *f = open_memstream(&text, &len);
		tr_plan_print(&p, f);
		fclose(f);
		if (inf == 2) {
			/* the host arena on its own line, and in the policies' list */
			snprintf(want, sizeof(want), "host       %s (%zu bytes) of pinned host memory",
				 tr_fmt_bytes((char[32]){0}, 32, tr_plan_host_bytes(&p)),
				 tr_plan_host_bytes(&p));
			CHECK_CONTAINS(text, want);
			CHECK_CONTAINS(text, "recompute  full-offload; by policy");
			snprintf(want, sizeof(want), " + %s pinned on the host\n",
				 tr_fmt_bytes((char[32]){0}, 32, tr_plan_host_bytes(&p)));
			CHECK_CONTAINS(text, want);
			CHECK_EQ_INT(tr_plan_host_bytes(&p),
				     (size_t)cfg.num_layers * 2 * 8 * cfg.hidden_size * sizeof(float));
		} else if (inf) {
			CHECK(text && !strstr(text, "recompute") && !strstr(text, "host  "));
		} else {
			CHECK_CONTAINS(text, "recompute  selective; by policy, acts and total: none ");
			snprintf(want, sizeof(want), "full %s (%zu bytes)",
				 tr_fmt_bytes((char[32]){0}, 32, acts[TR_RECOMPUTE_FULL]),
				 acts[TR_RECOMPUTE_FULL]);
			CHECK_CONTAINS(text, want);
			CHECK_EQ_INT(p.arena_bytes[TR_ARENA_ACTS], acts[TR_RECOMPUTE_SELECTIVE]);
		}
		free(text);
		tr_plan_fini(&p);
	}
	/* An unknown policy is refused, naming it. */
	struct tr_plan_opts bad = {.B = 1, .T = 4, .recompute = (enum tr_recompute)7};
	CHECK_EQ_INT(tr_plan_build(&p, &cfg, &bad, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "unknown recompute policy 7");
}

/* A host that cannot pin FULL_OFFLOAD's memory: tr_model_new fails with
 * TD_ENOMEM naming the bytes, and holds nothing. */
static td_err no_host_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	(void)be;
	(void)bytes;
	(void)out;
	return TD_ENOMEM;
}

static void test_host_alloc_fails(void)
{
	struct gpu_backend *be = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	static struct gpu_backend_ops ops;
	ops = *be->ops;
	ops.host_alloc = no_host_alloc;
	be->ops = &ops;
	struct tr_model_config cfg;
	load_config(&cfg, "qwen2");
	struct tr_plan_opts po = {.B = B_, .T = T_, .recompute = TR_RECOMPUTE_FULL_OFFLOAD};
	struct tr_model *m = NULL;
	CHECK_EQ_INT(tr_model_new(&m, be, &cfg, &po, &eb), TD_ENOMEM);
	CHECK(m == NULL);
	char want[128];
	snprintf(want, sizeof(want), "(%zu bytes) of pinned host memory",
		 (size_t)cfg.num_layers * N_ * cfg.hidden_size * sizeof(float));
	CHECK_CONTAINS(eb.msg, want);
	CHECK_CONTAINS(eb.msg, "memory.recompute full-offload");
	CHECK_EQ_INT(be->bytes_in_use, 0);
	CHECK_EQ_INT(be->host_bytes_in_use, 0);
	gpu_backend_free(be);
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
			backend = argv[++i];
		} else if (strcmp(argv[i], "--precision") == 0 && i + 1 < argc &&
			   (strcmp(argv[i + 1], "fp32") == 0 || strcmp(argv[i + 1], "bf16") == 0)) {
			bf16 = strcmp(argv[++i], "bf16") == 0;
		} else {
			fprintf(stderr, "usage: test_recompute [--backend cpu|cuda|emu16|emu16-flash] [--precision fp32|bf16]\n");
			return 2;
		}
	}
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	if (strcmp(backend, "cpu") != 0 && strncmp(backend, "emu16", 5) != 0) {
		/* No GPU here: the gpu suite reports itself skipped, not passed. */
		struct gpu_backend *be = NULL;
		struct td_errbuf eb = {{0}};
		td_err e = gpu_backend_open(&be, backend, &eb);
		if (e == TD_EUNSUPPORTED)
			return check_skip(eb.msg);
		gpu_backend_free(be);
	}
	test_stages();
	test_real_shapes();
	test_host_alloc_fails();
	test_same_bits();
	test_emb_rows();
	/* the ring was among what the same bits cover where the products are
	 * bf16 (emu16, and the CUDA backend's bf16 mode) */
	if (bf16)
		CHECK_MSG(ring_runs > 0, "no run kept the bf16 copy in a ring");
	/* the emulator's checks: scratch always enough, twins never stale */
	CHECK_EQ_INT(emu16_violations(), 0);
	return check_status();
}
