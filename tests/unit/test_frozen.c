/* Frozen weights stored in bf16 only (train/plan.h: frozen_bf16): a model
 * whose frozen base is stored so gives the same bits as the fp32-stored model
 * whose frozen matrices were rounded to bf16 first — losses, gradients,
 * hidden states, updated parameters and the frozen weights read back — for
 * LoRA (with and without dropout, tied and untied heads), QLoRA (NF4
 * projections, the embedding and lm_head in bf16), a classifier on a frozen
 * base and a distillation teacher; the plan is what the backend allocates
 * and all it ever holds, and its params arena has no fp32 copy of a frozen
 * matrix. Real shapes (Llama-3-8B, Qwen2-0.5B) from their configs alone: the
 * params arena and the bf16 buffers exactly, and every policy's total
 * printed.
 *
 * Why equal bits: on a backend whose GEMMs read fp32 (the CPU, the CUDA fp32
 * mode) a bf16 weight is widened, exactly, into scratch for each use, so
 * every op sees the same fp32 values as in the rounded fp32 model.
 *
 * test_frozen [--backend cpu|cuda|emu16|emu16-flash] [--precision fp32|bf16]: the same
 * on another backend. In the bf16 mode every frozen matrix is stored in bf16
 * whatever the options (gemm_bf16 implies it), so that run holds the model
 * to the CPU's rounded-fp32 reference within the bf16 mode's error instead
 * (loss, and the gradient's direction), besides the plan checks. emu16
 * (tests/unit/emu16.h, bf16 only) plays the CUDA bf16 mode on the CPU and
 * checks that no GEMM outgrows the planned scratch and no twin is stale;
 * emu16-flash also plays its fused attention (q, k, v kept in bf16 only). 77
 * (skipped) where the backend is not available. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/backend.h"
#include "gpu/select.h"
#include "kernels/cpu/ops.h"
#include "tests/check.h"
#include "tests/unit/emu16.h"
#include "train/lora.h"
#include "train/model.h"
#include "train/modeldir.h"

static const char *fx;
static const char *backend = "cpu";
static bool bf16;

static struct gpu_backend *open_backend(const char *name, bool b16)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	td_err e = strcmp(name, "emu16") == 0	      ? emu16_backend_new(&be, &eb)
		   : strcmp(name, "emu16-flash") == 0 ? emu16_flash_backend_new(&be, &eb)
						      : gpu_backend_open(&be, name, &eb);
	if (e == TD_OK && (e = gpu_set_bf16(be, b16, &eb)) != TD_OK)
		gpu_backend_free(be);
	if (e != TD_OK) {
		fprintf(stderr, "backend %s: %s\n", name, eb.msg);
		exit(2);
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

/* Whether the rounded reference rounds t: what frozen_bf16 stores in bf16. */
static bool rounded(const struct tr_param *t)
{
	return !t->trainable && t->ndim == 2 && !t->nf4;
}

/* A model of cfg on be: weights from the fixture dir wdir, or random when
 * wdir is NULL; adapters with lora_B nonzero (so that A has a gradient); a
 * classifier's head. round_first: every frozen matrix then rounded to bf16
 * through the host (the reference); the stored model rounds at load. */
static struct tr_model *new_model(struct gpu_backend *be, const struct tr_model_config *cfg,
				  const struct tr_plan_opts *po, const char *wdir, bool round_first)
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
		float *v = malloc(t->numel * sizeof(float));
		if (base && wdir) {
			if (!round_first || !rounded(t)) {
				free(v);
				continue;
			}
			tr_model_get_param(m, t, v);
		} else if (t->kind == TR_P_LORA_A) {
			free(v);
			continue; /* tr_lora_init's */
		} else {
			bool norm = base && t->ndim == 1 && strstr(t->name, "norm");
			for (size_t i = 0; i < t->numel; i++)
				v[i] = norm ? 1.0f + noise(k, i, 0.1f) : noise(k, i, base ? 0.08f : 0.05f);
		}
		if (round_first && rounded(t)) {
			uint16_t *h = malloc(t->numel * sizeof(uint16_t));
			bf16_round(h, v, t->numel);
			bf16_widen(v, h, t->numel);
			free(h);
		}
		CHECK_EQ_INT(tr_model_set_param(m, t, v), TD_OK);
		free(v);
	}
	return m;
}

enum method { M_CAUSAL, M_CLASSIFY, M_DISTILL };

struct fz_case {
	const char *name;
	const char *model; /* fixture dir */
	int layers;        /* > 0: this many layers and random weights */
	enum method method;
	struct tr_plan_opts po;
	bool fuse;         /* the head's backward fused into the forward */
};

/* What a run gives: every forward's loss terms, the gradients of the
 * second step, the hidden states of the last forward, the trainable
 * parameters after two AdamW steps and every frozen matrix read back. */
struct result {
	double loss[4][3];
	size_t ngrad, nparam, nhidden, nfrozen;
	float *grad, *param, *hidden, *frozen;
	size_t plan_bytes, alloc_bytes, peak_bytes; /* the last two: the models' own */
	bool ok;
};

static void result_free(struct result *r)
{
	free(r->grad);
	free(r->param);
	free(r->hidden);
	free(r->frozen);
}

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

/* Two steps of two micro-batches of c on the backend name (b16: its bf16
 * mode), the frozen matrices stored in bf16 (store) or rounded first. */
static void run(const struct fz_case *c, const char *name, bool b16, bool store, struct result *r)
{
	struct td_errbuf eb = {{0}};
	memset(r, 0, sizeof(*r));
	struct gpu_backend *be = open_backend(name, b16);
	struct tr_model_config cfg;
	load_config(&cfg, c->model);
	if (c->layers)
		cfg.num_layers = c->layers;
	const char *wdir = c->layers ? NULL : c->model;
	struct tr_plan_opts po = c->po;
	po.B = B_;
	po.T = T_;
	po.frozen_bf16 = store;
	struct tr_model *m = new_model(be, &cfg, &po, wdir, !store);
	const struct tr_plan *p = tr_model_plan(m);
	r->plan_bytes = tr_plan_total_bytes(p);
	struct tr_model *teacher = NULL;
	if (c->method == M_DISTILL) {
		struct tr_model_config tc;
		load_config(&tc, "distill/teacher");
		struct tr_plan_opts to = {.B = B_, .T = T_, .inference = true, .teacher_rows = true,
					  .logits_chunk_floats = c->po.logits_chunk_floats,
					  .frozen_bf16 = store};
		teacher = new_model(be, &tc, &to, "distill/teacher", !store);
		r->plan_bytes += tr_plan_total_bytes(tr_model_plan(teacher));
	}
	r->alloc_bytes = be->bytes_in_use;
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
				struct tr_distill_sums ds = {0};
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
			CHECK_MSG(e == TD_OK, "%s (%s): forward: %s", c->name, store ? "bf16" : "rounded",
				  eb.msg);
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
	for (size_t k = 0; k < p->nparams; k++)
		if (rounded(&p->params[k]))
			r->nfrozen += p->params[k].numel;
	r->frozen = malloc((r->nfrozen + 1) * sizeof(float));
	for (size_t k = 0, off = 0; k < p->nparams; k++)
		if (rounded(&p->params[k])) {
			tr_model_get_param(m, &p->params[k], r->frozen + off);
			off += p->params[k].numel;
		}
	CHECK_EQ_INT(gpu_sync(be, &eb), TD_OK);
	r->ok = true;
out:
	r->peak_bytes = be->bytes_peak;
	tr_model_free(m);
	tr_model_free(teacher);
	CHECK_EQ_INT(be->bytes_in_use, 0);
	gpu_backend_free(be);
}

static size_t first_diff(const float *a, const float *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (memcmp(a + i, b + i, sizeof(float)) != 0)
			return i;
	return n;
}

static const struct fz_case cases[] = {
	{"qwen2 lora q,v (tied head)", "qwen2", 0, M_CAUSAL,
	 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = QV}, false},
	{"llama lora all + dropout (untied head)", "llama", 0, M_CAUSAL,
	 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.2f}, false},
	{"qwen3 lora all, head fused, chunked, full recompute", "qwen3", 0, M_CAUSAL,
	 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .logits_chunk_floats = 5 * 512,
	  .recompute = TR_RECOMPUTE_FULL}, true},
	{"qwen2 4 layers lora all, selective recompute", "qwen2", 4, M_CAUSAL,
	 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN,
	  .recompute = TR_RECOMPUTE_SELECTIVE}, false},
	{"qwen3 4 layers lora all + dropout, full-offload", "qwen3", 4, M_CAUSAL,
	 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.1f,
	  .recompute = TR_RECOMPUTE_FULL_OFFLOAD}, false},
	{"llama qlora all + dropout", "llama", 0, M_CAUSAL,
	 {.lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN, .lora_dropout = 0.1f,
	  .base_quant = TR_QUANT_NF4, .nf4_double_quant = true}, false},
	{"qwen2 classify lora (frozen base)", "qwen2-classify", 0, M_CLASSIFY,
	 {.num_labels = 3, .lora_rank = 2, .lora_alpha = 4, .lora_targets = ALL_LIN}, false},
	{"qwen2 distill (frozen teacher), student lora", "qwen2", 0, M_DISTILL,
	 {.distill = true, .lora_rank = 4, .lora_alpha = 8, .lora_targets = QV,
	  .logits_chunk_floats = 5 * 512}, false},
	{"qwen2 full (nothing frozen)", "qwen2", 0, M_CAUSAL, {0}, false},
};

/* fp32 compute: equal bits to the rounded model, on the backend under test. */
static void test_same_bits(void)
{
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct fz_case *c = &cases[i];
		struct result st, ref;
		run(c, backend, false, true, &st);
		run(c, backend, false, false, &ref);
		CHECK_MSG(st.alloc_bytes == st.plan_bytes && st.peak_bytes == st.plan_bytes,
			  "%s: allocated %zu, peak %zu bytes, plan %zu", c->name, st.alloc_bytes,
			  st.peak_bytes, st.plan_bytes);
		/* nothing frozen: nothing changes, not even the plan */
		if (c->method != M_DISTILL && !c->po.lora_rank)
			CHECK_EQ_INT(st.plan_bytes, ref.plan_bytes);
		else
			CHECK_MSG(st.plan_bytes < ref.plan_bytes, "%s: plan %zu bytes, rounded fp32 %zu",
				  c->name, st.plan_bytes, ref.plan_bytes);
		printf("%-52s plan %8zu bytes (fp32-stored %8zu)\n", c->name, st.plan_bytes,
		       ref.plan_bytes);
		if (!st.ok || !ref.ok) {
			result_free(&st);
			result_free(&ref);
			continue;
		}
		CHECK_MSG(memcmp(st.loss, ref.loss, sizeof(st.loss)) == 0,
			  "%s: losses %.17g %.17g, rounded fp32's %.17g %.17g", c->name, st.loss[0][0],
			  st.loss[3][0], ref.loss[0][0], ref.loss[3][0]);
		const struct {
			const char *what;
			const float *a, *b;
			size_t n, nb;
		} arrays[] = {
			{"gradient", st.grad, ref.grad, st.ngrad, ref.ngrad},
			{"hidden state", st.hidden, ref.hidden, st.nhidden, ref.nhidden},
			{"parameter after AdamW", st.param, ref.param, st.nparam, ref.nparam},
			{"frozen weight read back", st.frozen, ref.frozen, st.nfrozen, ref.nfrozen},
		};
		for (size_t k = 0; k < sizeof(arrays) / sizeof(arrays[0]); k++) {
			CHECK_EQ_INT(arrays[k].n, arrays[k].nb);
			size_t d = first_diff(arrays[k].a, arrays[k].b, arrays[k].n);
			CHECK_MSG(d == arrays[k].n, "%s: %s %zu of %zu is %.9g, rounded fp32's %.9g", c->name,
				  arrays[k].what, d, arrays[k].n, d < arrays[k].n ? (double)arrays[k].a[d] : 0.0,
				  d < arrays[k].n ? (double)arrays[k].b[d] : 0.0);
		}
		result_free(&st);
		result_free(&ref);
	}
}

/* The bf16 mode (a GPU): the frozen base stored in bf16, held to the CPU's
 * rounded-fp32 model within the mode's error: each loss to 2%, the gradient's
 * direction (cosine > 0.98) and size (norm to 5%). */
static void test_bf16_mode(void)
{
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		const struct fz_case *c = &cases[i];
		struct result st, ref;
		run(c, backend, true, true, &st);
		run(c, "cpu", false, false, &ref);
		CHECK_MSG(st.alloc_bytes == st.plan_bytes && st.peak_bytes == st.plan_bytes,
			  "%s: allocated %zu, peak %zu bytes, plan %zu", c->name, st.alloc_bytes,
			  st.peak_bytes, st.plan_bytes);
		if (st.ok && ref.ok) {
			for (int k = 0; k < 4; k++)
				CHECK_MSG(fabs(st.loss[k][0] - ref.loss[k][0]) <= 0.02 * fabs(ref.loss[k][0]),
					  "%s: loss %d %.9g, the CPU's %.9g", c->name, k, st.loss[k][0],
					  ref.loss[k][0]);
			double dot = 0, na = 0, nb = 0;
			for (size_t k = 0; k < st.ngrad && st.ngrad == ref.ngrad; k++) {
				dot += (double)st.grad[k] * ref.grad[k];
				na += (double)st.grad[k] * st.grad[k];
				nb += (double)ref.grad[k] * ref.grad[k];
			}
			double cosine = dot / sqrt(na * nb);
			CHECK_MSG(cosine > 0.98 && fabs(sqrt(na) - sqrt(nb)) <= 0.05 * sqrt(nb),
				  "%s: gradient cosine %.6f, norm %.6g (CPU %.6g)", c->name, cosine, sqrt(na),
				  sqrt(nb));
			printf("%-52s loss %.6f (CPU %.6f), gradient cosine %.6f\n", c->name, st.loss[3][0],
			       ref.loss[3][0], cosine);
		}
		result_free(&st);
		result_free(&ref);
	}
}

static const char l8[] =
		"{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,\"intermediate_size\":14336,"
		"\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
		"\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,\"tie_word_embeddings\":false,"
		"\"max_position_embeddings\":8192,\"torch_dtype\":\"bfloat16\"}";
static const char q05[] =
		"{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":896,\"intermediate_size\":4864,"
		"\"num_hidden_layers\":24,\"num_attention_heads\":14,\"num_key_value_heads\":2,"
		"\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true,"
		"\"max_position_embeddings\":32768,\"torch_dtype\":\"bfloat16\"}";

/* Real shapes from their configs: the frozen base in bf16 only (params16,
 * two bytes a value), fp32 for the trainable tensors and the norms, a bf16
 * copy of the trainable ones only; totals per policy printed (traind
 * --plan's numbers, at B4 x T2048 and B8 x T1024). */
static void test_real_shapes(void)
{
	static const struct {
		const char *name, *json;
		struct tr_plan_opts po;
		size_t frozen2d; /* frozen matrices not in NF4, elements */
	} shapes[] = {
		{"Llama-3-8B LoRA r16 all seven B4xT2048", l8,
		 {.B = 4, .T = 2048, .lora_rank = 16, .lora_alpha = 32, .lora_targets = ALL_LIN},
		 8030261248u - 65u * 4096u},
		{"Llama-3-8B QLoRA r16 all seven B4xT2048", l8,
		 {.B = 4, .T = 2048, .lora_rank = 16, .lora_alpha = 32, .lora_targets = ALL_LIN,
		  .base_quant = TR_QUANT_NF4, .nf4_double_quant = true},
		 2u * 128256u * 4096u},
		{"Qwen2-0.5B LoRA r16 q,v B8xT1024", q05,
		 {.B = 8, .T = 1024, .lora_rank = 16, .lora_alpha = 32, .lora_targets = QV},
		 494032768u - 49u * 896u - 24u * (896u + 128u + 128u)},
	};
	for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
		struct tr_model_config cfg;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(tr_config_parse(&cfg, shapes[i].json, "case", &eb), TD_OK);
		struct tr_plan_opts po = shapes[i].po;
		po.gemm_bf16 = po.attention_lse = true;
		struct tr_plan p;
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
		CHECK(p.opts.frozen_bf16); /* implied by the bf16 GEMMs */
		CHECK_EQ_INT(p.numel_bf16, shapes[i].frozen2d);
		const struct tr_plan_buf *b16 = tr_plan_find(&p, "params16");
		CHECK(b16 && b16->bytes == 2 * p.numel_bf16);
		/* fp32: the trainable tensors and the frozen vectors, nothing else */
		size_t vec = p.numel_frozen - p.numel_bf16 - p.nf4_numel;
		CHECK_EQ_INT(p.numel_f32, p.numel_trainable + vec);
		/* trainable fp32 in params; the frozen ones, with params16 and the
		 * NF4 buffers, in the base arena (the part jobs may share) */
		CHECK_EQ_INT(tr_plan_find(&p, "params")->bytes, 4 * p.numel_trainable);
		CHECK_EQ_INT(tr_plan_find(&p, "base.f32")->bytes, 4 * vec);
		CHECK_EQ_INT(b16->arena, TR_ARENA_BASE);
		size_t base_sum = 0;
		for (size_t k = 0; k < p.nbufs; k++)
			if (p.bufs[k].arena == TR_ARENA_BASE)
				base_sum += (p.bufs[k].bytes + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
		CHECK_EQ_INT(tr_plan_base_bytes(&p), base_sum);
		CHECK(tr_plan_base_bytes(&p) >= p.frozen_bytes &&
		      tr_plan_base_bytes(&p) - p.frozen_bytes < 5 * TR_PLAN_ALIGN);
		CHECK_EQ_INT(tr_plan_find(&p, "scratch.params_bf16")->bytes, 2 * p.numel_trainable);
		CHECK_EQ_INT(p.frozen_bytes, 4 * vec + 2 * p.numel_bf16 + p.nf4_bytes);
		char *text = NULL;
		size_t len = 0;
		FILE *f = open_memstream(&text, &len);
		tr_plan_print(&p, f);
		fclose(f);
		CHECK_CONTAINS(text, "in bf16 only");
		free(text);
		/* A layer's backward: the MLP's and the attention's buffers share
		 * one region with the layer forward's q, k, v staging and the
		 * head's logits chunk, over which its bf16 gradient is written
		 * (none of them live at once), as big as the largest phase, each
		 * inside it. */
		const struct tr_plan_buf *lb = tr_plan_find(&p, "scratch.layer_backward");
		CHECK(lb != NULL);
		CHECK(p.logits16 && !tr_plan_find(&p, "scratch.dlogits16"));
		static const char *const attn[] = {"scratch.dy", "scratch.dq", "scratch.dk", "scratch.dv",
						   "scratch.datt"};
		/* d(h) in bf16 unless the down projection's adapter has dropout
		 * (its share is added as swiglu_backward reads d(h)) */
		const char *const mlp[] = {p.dh16 ? "scratch.dh16" : "scratch.dh", "scratch.dgate16",
					   "scratch.dup16"};
		CHECK_EQ_INT(p.dh16, !(po.lora_targets & (1u << TR_LIN_DOWN)) || po.lora_dropout == 0.0f);
		static const char *const fwd[] = {"scratch.qkv32"};
		static const char *const head[] = {"scratch.logits"};
		const char *const *const phases[] = {attn, mlp, fwd, head};
		static const size_t nphase[] = {5, 3, 1, 1};
		size_t sum[4] = {0, 0, 0, 0};
		for (int ph = 0; ph < 4 && lb; ph++) {
			const char *const *names = phases[ph];
			size_t n = nphase[ph];
			for (size_t k = 0; k < n; k++) {
				const struct tr_plan_buf *b = tr_plan_find(&p, names[k]);
				CHECK_MSG(b && b->offset >= lb->offset && b->offset + b->bytes <= lb->offset + lb->bytes,
					  "%s: %s is not inside scratch.layer_backward", shapes[i].name, names[k]);
				/* d(gate) over d(h) where it is written in place:
				 * their bytes once */
				const struct tr_plan_buf *first = k ? tr_plan_find(&p, names[0]) : NULL;
				if (b && first && ph == 1 && b->offset == first->offset)
					continue;
				sum[ph] += b ? (b->bytes + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN : 0;
			}
		}
		size_t most = 0;
		for (int ph = 0; ph < 4; ph++)
			most = sum[ph] > most ? sum[ph] : most;
		CHECK(!lb || lb->bytes == most);
		/* The head's chunk, of bf16 logits: twice min(TR_LOGITS_CHUNK_FLOATS
		 * / V, ceil(TR_LOGITS_CHUNK_INPUTS / C)) rows (Llama-3-8B: 2 x 384,
		 * Qwen2-0.5B: 2 x 1756, both by the inputs), N split evenly over
		 * the chunks that takes (multiples of 8 rows, at most N); or more
		 * where the other phases' region holds more bf16 rows of V (fit: a
		 * multiple of 64, within the bytes of the floats bound), N split
		 * evenly over the chunks of fit rows it takes. */
		const size_t V = (size_t)cfg.vocab_size, N = (size_t)po.B * (size_t)po.T;
		const size_t by_floats = TR_LOGITS_CHUNK_FLOATS / V;
		const size_t by_inputs = (TR_LOGITS_CHUNK_INPUTS + (size_t)cfg.hidden_size - 1) /
					 (size_t)cfg.hidden_size;
		CHECK(by_inputs < by_floats && 2 * by_inputs < N);
		size_t chunks = (N + 2 * by_inputs - 1) / (2 * by_inputs);
		size_t rows = ((N + chunks - 1) / chunks + 7) / 8 * 8;
		size_t others = sum[0] > sum[1] ? sum[0] : sum[1];
		others = sum[2] > others ? sum[2] : others;
		const size_t by_bytes = 2 * TR_LOGITS_CHUNK_FLOATS / V; /* bf16 rows of 1 GiB */
		size_t fit = others / (2 * V) < by_bytes ? others / (2 * V) : by_bytes;
		fit = fit / 64 * 64;
		if (fit > rows) {
			chunks = (N + fit - 1) / fit;
			rows = ((N + chunks - 1) / chunks + 7) / 8 * 8;
			rows = rows < N ? rows : N;
		}
		CHECK_EQ_INT(p.logits_rows, rows);
		const struct tr_plan_buf *lg = tr_plan_find(&p, "scratch.logits");
		CHECK(lg && lg->bytes == 2 * rows * V);
		/* Qwen2-0.5B's logits chunk (3 chunks of 2736 rows of 151936)
		 * outweighs a layer's backward; Llama-3-8B's grows to what the
		 * region holds (its LoRA MLP backward, all N rows, d(h) in bf16:
		 * 2688 bf16 rows, so 4 chunks of 2048) */
		if (cfg.hidden_size == 4096)
			CHECK(lb && most > sum[3] && p.logits_rows == 2048);
		else
			CHECK(lb && most == sum[3] && p.logits_rows == 2736);
		CHECK(!tr_plan_find(&p, "scratch.lora_tmp")); /* LoRA's product is added by its GEMM */
		tr_plan_fini(&p);
		/* the same, stored fp32 (what an fp32 backend plans) */
		po.gemm_bf16 = po.attention_lse = false;
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
		CHECK_EQ_INT(p.numel_bf16, 0);
		CHECK(!tr_plan_find(&p, "params16"));
		tr_plan_fini(&p);
		po.gemm_bf16 = po.attention_lse = true;
		size_t acts[TR_RECOMPUTE_COUNT], total[TR_RECOMPUTE_COUNT], host[TR_RECOMPUTE_COUNT];
		CHECK_EQ_INT(tr_plan_policy_bytes(&cfg, &po, acts, total, host, &eb), TD_OK);
		for (int rc = 0; rc < TR_RECOMPUTE_COUNT; rc++) {
			char a[32], t[32], h[32];
			printf("%-42s bf16 %-12s acts %10s  total %10s  (%zu bytes)  host %s (%zu bytes)\n",
			       shapes[i].name, tr_recompute_name(rc), tr_fmt_bytes(a, sizeof(a), acts[rc]),
			       tr_fmt_bytes(t, sizeof(t), total[rc]), total[rc],
			       tr_fmt_bytes(h, sizeof(h), host[rc]), host[rc]);
		}
	}
	/* Full fine-tuning in the bf16 mode: the trainable weights' bf16 copy
	 * leaves out an untied embedding (Llama-3-8B's 128256 x 4096: only its
	 * lookup reads it, in fp32) and keeps a tied one (Qwen2-0.5B's: the LM
	 * head's operand too). At the benches' shapes the head's chunks of
	 * bf16 logits (DESIGN.md): Llama-3-8B B4 x T2048, 4 of 2048 rows (its
	 * layers' region, its attention backward's 577 MiB, holds ~2358 bf16
	 * rows of 128256: 2304 by 64s, so 4 chunks, N split evenly);
	 * Qwen2-0.5B B8 x T1024, 3 of 2736 (twice
	 * the inputs bound's 1756 rows, 3 chunks, N split evenly, by 8s). The
	 * fp32 mode keeps fp32 logits. */
	const struct {
		const char *json;
		size_t lo;
		int B, T, rows16;
	} full[] = {{l8, 128256u * 4096u, 4, 2048, 2048}, {q05, 0, 8, 1024, 2736}};
	for (size_t i = 0; i < sizeof(full) / sizeof(full[0]); i++) {
		struct tr_model_config cfg;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(tr_config_parse(&cfg, full[i].json, "case", &eb), TD_OK);
		struct tr_plan_opts po = {.B = 1, .T = 64, .gemm_bf16 = true, .attention_lse = true};
		struct tr_plan p;
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
		const struct tr_param *emb = tr_plan_param(&p, "model.embed_tokens.weight");
		CHECK(emb && emb->trainable && emb->offset == 0);
		CHECK_EQ_INT(p.copy16_lo, full[i].lo);
		const struct tr_plan_buf *c16 = tr_plan_find(&p, "scratch.params_bf16");
		CHECK(c16 && c16->bytes == 2 * (p.numel_trainable - full[i].lo));
		tr_plan_fini(&p);
		for (int bf16 = 0; bf16 < 2; bf16++) {
			struct tr_plan_opts bo = {.B = full[i].B, .T = full[i].T, .gemm_bf16 = bf16,
						  .attention_lse = bf16};
			CHECK_EQ_INT(tr_plan_build(&p, &cfg, &bo, &eb), TD_OK);
			CHECK_EQ_INT(p.logits16, bf16);
			if (bf16)
				CHECK_EQ_INT(p.logits_rows, full[i].rows16);
			const struct tr_plan_buf *lg = tr_plan_find(&p, "scratch.logits");
			CHECK(lg && lg->bytes == (size_t)p.logits_rows * (size_t)cfg.vocab_size *
							 (bf16 ? 2 : 4));
			tr_plan_fini(&p);
		}
	}
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
			fprintf(stderr, "usage: test_frozen [--backend cpu|cuda|emu16|emu16-flash] [--precision fp32|bf16]\n");
			return 2;
		}
	}
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	if (strcmp(backend, "cpu") != 0 && strncmp(backend, "emu16", 5) != 0) {
		struct gpu_backend *be = NULL;
		struct td_errbuf eb = {{0}};
		td_err e = gpu_backend_open(&be, backend, &eb);
		if (e == TD_EUNSUPPORTED)
			return check_skip(eb.msg);
		gpu_backend_free(be);
	}
	test_real_shapes();
	if (bf16)
		test_bf16_mode();
	else
		test_same_bits();
	/* the emulator's checks: scratch always enough, twins never stale */
	CHECK_EQ_INT(emu16_violations(), 0);
	return check_status();
}
