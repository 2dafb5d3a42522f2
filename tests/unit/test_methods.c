/* The methods end to end on the CPU backend: plans, numerics and jobs.
 *
 * Plans: under LoRA only the adapters (and a classifier's head) have
 * gradients and optimizer state, sized as the config implies; QLoRA's frozen
 * projections are stored as NF4 (packed nibbles, absmax per 64, optionally
 * 8-bit absmax per 256 with an fp32 scale) and are >= 3.5x smaller than in
 * bf16, on the fixture and on Qwen2-1.5B; what the backend allocates is the
 * plan. Numerics: a QLoRA model computes exactly what an fp32 LoRA model on
 * the dequantized weights computes; its loss after 3 steps stays within the
 * bound stated at test_qlora_bound; LoRA dropout's gradient is the gradient of
 * what the forward computed; classification pools the last non-pad token;
 * distillation with alpha = 0 is plain CE. Bad input: a teacher with another
 * vocabulary, a label outside the range. Jobs: LoRA resumes bit for bit,
 * QLoRA, distillation and classification (with eval metrics) run through
 * tr_train and write outputs that load back; a method value no method has
 * is refused. */
#include <ftw.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "proto/jobspec.h"
#include "tests/check.h"
#include "tests/unit/rowmatmul.h"
#include "train/classify.h"
#include "train/lora.h"
#include "train/merge.h"
#include "train/method.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/trainer.h"

static char tmp[256];
static const char *fx;
static struct tr_model_config qwen2;

#define QV (1u << TR_LIN_Q | 1u << TR_LIN_V)
#define ALL_LIN ((1u << TR_LIN_COUNT) - 1)

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
		perror(path);
		exit(2);
	}
}

static size_t align(size_t b)
{
	return (b + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
}

/* --------------------------------------------------------------- plans -- */

/* Adapter elements a config implies: L * sum over targets of r * (in + out). */
static size_t adapter_numel(const struct tr_model_config *c, int r, unsigned targets)
{
	size_t C = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
	size_t H = (size_t)c->num_heads * c->head_dim, KV = (size_t)c->num_kv_heads * c->head_dim;
	const size_t io[TR_LIN_COUNT] = {C + H, C + KV, C + KV, H + C, C + I, C + I, I + C};
	size_t n = 0;
	for (int k = 0; k < TR_LIN_COUNT; k++)
		if (targets & (1u << k))
			n += (size_t)r * io[k];
	return n * (size_t)c->num_layers;
}

/* NF4 bytes of the 7 projection weights of every layer, from the config. */
static size_t nf4_bytes(const struct tr_model_config *c, bool dq, size_t *numel)
{
	size_t C = (size_t)c->hidden_size, I = (size_t)c->intermediate_size;
	size_t H = (size_t)c->num_heads * c->head_dim, KV = (size_t)c->num_kv_heads * c->head_dim;
	const size_t n[TR_LIN_COUNT] = {H * C, KV * C, KV * C, C * H, I * C, I * C, C * I};
	size_t bytes = 0;
	*numel = 0;
	for (int k = 0; k < TR_LIN_COUNT; k++) {
		size_t blocks = (n[k] + 63) / 64;
		bytes += (n[k] + 1) / 2; /* two 4-bit codes a byte */
		bytes += dq ? blocks + 4 * ((blocks + 255) / 256 + 1) : 4 * blocks;
		*numel += n[k];
	}
	*numel *= (size_t)c->num_layers;
	return bytes * (size_t)c->num_layers;
}

static void check_lora_plan(const struct tr_model_config *c, const struct tr_plan_opts *po,
			    const char *what)
{
	struct tr_plan p;
	struct td_errbuf eb = {{0}};
	td_err e = tr_plan_build(&p, c, po, &eb);
	CHECK_MSG(e == TD_OK, "%s: %s", what, eb.msg);
	if (e != TD_OK)
		return;
	size_t want = adapter_numel(c, po->lora_rank, po->lora_targets);
	size_t head = po->num_labels > 0 ? (size_t)po->num_labels * c->hidden_size : 0;
	CHECK_EQ_INT(p.numel_trainable, want + head);
	CHECK_EQ_INT(p.numel_decay, want + head); /* every adapter is 2-D: AdamW decays it */
	/* Gradients and both moments: the adapters' size, nothing else. */
	CHECK_EQ_INT(p.arena_bytes[TR_ARENA_GRADS], align((want + head) * 4));
	CHECK_EQ_INT(p.arena_bytes[TR_ARENA_OPTIM], 2 * align((want + head) * 4));
	size_t trainable = 0, frozen = 0;
	for (size_t i = 0; i < p.nparams; i++) {
		const struct tr_param *t = &p.params[i];
		bool adapter = strstr(t->name, ".lora_A.weight") || strstr(t->name, ".lora_B.weight");
		bool is_head = strcmp(t->name, "score.weight") == 0;
		CHECK_MSG(t->trainable == (adapter || is_head), "%s: %s trainable = %d", what, t->name,
			  t->trainable);
		*(t->trainable ? &trainable : &frozen) += t->numel;
	}
	CHECK_EQ_INT(trainable, want + head);
	CHECK_EQ_INT(frozen, p.numel_frozen);
	if (po->base_quant == TR_QUANT_NF4) {
		size_t numel, bytes = nf4_bytes(c, po->nf4_double_quant, &numel);
		CHECK_EQ_INT(p.nf4_numel, numel);
		CHECK_EQ_INT(p.nf4_bytes, bytes);
		CHECK_EQ_INT(p.numel_f32, p.numel_params - numel);
		double ratio = (double)(numel * 2) / (double)p.nf4_bytes;
		CHECK_MSG(ratio >= 3.5, "%s: NF4 frozen projections only %.3fx smaller than bf16", what, ratio);
		printf("%s: NF4%s frozen projections %zu bytes for %zu weights: %.3fx smaller than bf16\n",
		       what, po->nf4_double_quant ? " (double-quantized)" : "", p.nf4_bytes, numel, ratio);
		char *text = NULL;
		size_t len = 0;
		FILE *f = open_memstream(&text, &len);
		tr_plan_print(&p, f);
		fclose(f);
		CHECK_CONTAINS(text, "in NF4");
		CHECK_CONTAINS(text, "only the adapters");
		free(text);
	}
	tr_plan_fini(&p);
}

static void test_plans(void)
{
	struct tr_plan_opts lora = {.B = 2, .T = 16, .lora_rank = 4, .lora_alpha = 8, .lora_targets = QV};
	check_lora_plan(&qwen2, &lora, "qwen2 lora");
	struct tr_plan_opts all = lora;
	all.lora_targets = ALL_LIN;
	all.lora_dropout = 0.1f;
	check_lora_plan(&qwen2, &all, "qwen2 lora all targets + dropout");
	for (int dq = 0; dq < 2; dq++) {
		struct tr_plan_opts q = all;
		q.base_quant = TR_QUANT_NF4;
		q.nf4_double_quant = dq;
		check_lora_plan(&qwen2, &q, dq ? "qwen2 qlora dq" : "qwen2 qlora");
	}
	struct tr_plan_opts cls = lora;
	cls.num_labels = 3;
	check_lora_plan(&qwen2, &cls, "qwen2 lora classifier");

	/* Qwen2-1.5B: QLoRA r=16 on every projection. */
	struct tr_model_config big;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_config_parse(&big,
				     "{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":1536,"
				     "\"intermediate_size\":8960,\"num_hidden_layers\":28,\"num_attention_heads\":12,"
				     "\"num_key_value_heads\":2,\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,"
				     "\"tie_word_embeddings\":true,\"torch_dtype\":\"bfloat16\"}",
				     "qwen2-1.5b", &eb),
		     TD_OK);
	for (int dq = 0; dq < 2; dq++) {
		struct tr_plan_opts q = {.B = 1, .T = 512, .lora_rank = 16, .lora_alpha = 32,
					 .lora_targets = ALL_LIN, .base_quant = TR_QUANT_NF4,
					 .nf4_double_quant = dq};
		check_lora_plan(&big, &q, dq ? "qwen2-1.5b qlora dq" : "qwen2-1.5b qlora");
	}

	/* A classifier: score [labels, C] instead of lm_head; logits (B, labels). */
	struct tr_plan p;
	struct tr_plan_opts full_cls = {.B = 3, .T = 8, .num_labels = 5};
	CHECK_EQ_INT(tr_plan_build(&p, &qwen2, &full_cls, &eb), TD_OK);
	const struct tr_param *score = tr_plan_param(&p, "score.weight");
	CHECK(score && score->shape[0] == 5 && score->shape[1] == qwen2.hidden_size && score->trainable);
	CHECK(!tr_plan_param(&p, "lm_head.weight"));
	CHECK_EQ_INT(tr_plan_find(&p, "scratch.logits")->bytes, 3 * 5 * 4);
	CHECK_EQ_INT(p.numel_trainable, p.numel_params);
	tr_plan_fini(&p);

	/* A teacher: nothing trains, no backward buffers. */
	struct tr_plan_opts teacher = {.B = 2, .T = 8, .inference = true, .base_quant = TR_QUANT_NF4};
	CHECK_EQ_INT(tr_plan_build(&p, &qwen2, &teacher, &eb), TD_OK);
	CHECK_EQ_INT(p.numel_trainable, 0);
	CHECK_EQ_INT(p.arena_bytes[TR_ARENA_GRADS] + p.arena_bytes[TR_ARENA_OPTIM], 0);
	CHECK(!tr_plan_find(&p, "scratch.dres") && !tr_plan_find(&p, "scratch.datt"));
	CHECK(p.nf4_numel > 0);
	tr_plan_fini(&p);

	/* Options that do not fit. */
	static const struct {
		struct tr_plan_opts o;
		const char *msg;
	} bad[] = {
		{{.B = 1, .T = 4, .lora_rank = 40, .lora_alpha = 8, .lora_targets = QV},
		 "lora rank 40 exceeds v_proj's smaller dimension 32 (64 -> 32)"},
		{{.B = 1, .T = 4, .base_quant = TR_QUANT_NF4}, "NF4 weights must be frozen"},
		{{.B = 1, .T = 4, .num_labels = 1}, "1 labels (a classifier needs >= 2)"},
		{{.B = 1, .T = 4, .lora_rank = 4, .lora_alpha = 8, .lora_targets = QV, .lora_dropout = 1.0f},
		 "lora dropout 1 is outside [0, 1)"},
		{{.B = 1, .T = 4, .num_labels = 3, .distill = true}, "distillation trains a causal LM"},
	};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		CHECK_EQ_INT(tr_plan_build(&p, &qwen2, &bad[i].o, &eb), TD_EINVAL);
		CHECK_CONTAINS(eb.msg, bad[i].msg);
	}
}

/* ------------------------------------------------------------- helpers -- */

struct batch {
	int32_t ids[2 * 24], labels[2 * 24];
	int B, T;
};

/* The qwen2-lora fixture's batch (real token ids, some labels -100). */
static void load_batch(struct batch *b)
{
	char path[PATH_MAX];
	struct td_errbuf eb = {{0}};
	snprintf(path, sizeof(path), "%s/qwen2-lora/reference.safetensors", fx);
	struct tr_st_file *f = NULL;
	if (tr_st_open(&f, path, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		exit(2);
	}
	const struct tr_st_tensor *t = tr_st_find(f, "input_ids");
	b->B = (int)t->shape[0];
	b->T = (int)t->shape[1];
	if (b->B * b->T > 48)
		exit(2);
	tr_st_to_i32(b->ids, t, &eb);
	tr_st_to_i32(b->labels, tr_st_find(f, "labels"), &eb);
	tr_st_close(f);
}

static struct tr_model *new_model(struct gpu_backend *be, const struct tr_model_config *c,
				  const struct tr_plan_opts *po, const char *weights_dir,
				  const char *adapter)
{
	struct td_errbuf eb = {{0}};
	struct tr_model *m = NULL;
	struct tr_weights *w = NULL;
	if (tr_model_new(&m, be, c, po, &eb) || tr_weights_open(&w, weights_dir, &eb) ||
	    tr_model_load(m, w, &eb) || (adapter && tr_lora_load(m, adapter, &eb))) {
		fprintf(stderr, "new_model: %s\n", eb.msg);
		exit(2);
	}
	tr_weights_close(w);
	return m;
}

static double loss_of(struct tr_model *m, const struct batch *b)
{
	double ls;
	int64_t nv;
	struct td_errbuf eb = {{0}};
	if (tr_model_forward(m, b->ids, b->labels, &ls, &nv, &eb)) {
		fprintf(stderr, "forward: %s\n", eb.msg);
		exit(2);
	}
	return ls / (double)nv;
}

/* One step as the fixtures train: forward, backward, clip 1, AdamW lr 1e-3. */
static double train_step(struct tr_model *m, const struct batch *b, int t)
{
	double ls;
	int64_t nv;
	struct td_errbuf eb = {{0}};
	if (tr_model_forward(m, b->ids, b->labels, &ls, &nv, &eb)) {
		fprintf(stderr, "forward: %s\n", eb.msg);
		exit(2);
	}
	tr_model_zero_grad(m);
	tr_model_backward(m, (float)(1.0 / (double)nv));
	tr_model_clip_grads(m, 1.0);
	struct tr_adamw h = {0.9f, 0.999f, 1e-8f, 0.01f};
	tr_model_adamw(m, &h, 1e-3f, t);
	return ls / (double)nv;
}

/* ----------------------------------------------------------- numerics -- */

/* Backend bytes are the plan, before and after a step, for every method. */
static void test_bytes_are_plan(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct batch b;
	load_batch(&b);
	char base[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	const struct tr_plan_opts opts[] = {
		{.B = b.B, .T = b.T, .lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN,
		 .lora_dropout = 0.2f},
		{.B = b.B, .T = b.T, .lora_rank = 4, .lora_alpha = 8, .lora_targets = ALL_LIN,
		 .base_quant = TR_QUANT_NF4, .nf4_double_quant = true},
		{.B = b.B, .T = b.T, .num_labels = 3, .lora_rank = 2, .lora_alpha = 4, .lora_targets = QV},
		{.B = b.B, .T = b.T, .inference = true, .base_quant = TR_QUANT_NF4},
	};
	for (size_t i = 0; i < sizeof(opts) / sizeof(opts[0]); i++) {
		struct tr_model *m = new_model(be, &qwen2, &opts[i], base, NULL);
		const struct tr_plan *p = tr_model_plan(m);
		CHECK_EQ_INT(be->bytes_in_use, tr_plan_total_bytes(p));
		size_t peak = be->bytes_peak;
		if (opts[i].lora_rank)
			CHECK_EQ_INT(tr_lora_init(m, 5, &eb), TD_OK);
		double ls;
		int64_t nv;
		if (opts[i].num_labels) {
			int32_t cls[2] = {0, 2};
			tr_model_set_dropout_seed(m, 1);
			CHECK_EQ_INT(tr_model_forward_classify(m, b.ids, cls, &ls, &nv, &eb), TD_OK);
		} else if (opts[i].inference) {
			CHECK_EQ_INT(tr_model_forward_logits(m, b.ids, &eb), TD_OK);
		} else {
			tr_model_set_dropout_seed(m, 1);
			CHECK_EQ_INT(tr_model_forward(m, b.ids, b.labels, &ls, &nv, &eb), TD_OK);
		}
		if (!opts[i].inference) {
			tr_model_backward(m, 0.01f);
			tr_model_clip_grads(m, 1.0);
			struct tr_adamw h = {0.9f, 0.999f, 1e-8f, 0.01f};
			tr_model_adamw(m, &h, 1e-3f, 1);
		}
		CHECK_MSG(be->bytes_peak == peak && peak >= tr_plan_total_bytes(p),
			  "case %zu: peak %zu, plan %zu", i, be->bytes_peak, tr_plan_total_bytes(p));
		tr_model_free(m);
		CHECK_EQ_INT(be->bytes_in_use, 0);
		be->bytes_peak = 0;
	}
	gpu_backend_free(be);
}

/* A QLoRA model is an fp32 LoRA model on the dequantized weights, exactly. */
static void test_qlora_exact(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct batch b;
	load_batch(&b);
	char base[PATH_MAX], adir[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	snprintf(adir, sizeof(adir), "%s/qwen2-lora/adapter_init", fx);
	struct tr_plan_opts lo = {.B = b.B, .T = b.T, .lora_rank = 4, .lora_alpha = 8, .lora_targets = QV};
	for (int dq = 0; dq < 2; dq++) {
		struct tr_plan_opts qo = lo;
		qo.base_quant = TR_QUANT_NF4;
		qo.nf4_double_quant = dq;
		struct tr_model *q = new_model(be, &qwen2, &qo, base, adir);
		struct tr_model *f = new_model(be, &qwen2, &lo, base, adir);
		const struct tr_plan *pq = tr_model_plan(q), *pf = tr_model_plan(f);
		float *buf = malloc(pq->nf4_max_numel * sizeof(float));
		size_t changed = 0;
		for (size_t i = 0; i < pq->nparams; i++) {
			const struct tr_param *t = &pq->params[i];
			if (!t->nf4)
				continue;
			tr_model_get_param(q, t, buf);
			float *orig = malloc(t->numel * sizeof(float));
			tr_model_get_param(f, tr_plan_param(pf, t->name), orig);
			for (size_t k = 0; k < t->numel; k++)
				changed += buf[k] != orig[k];
			free(orig);
			CHECK_EQ_INT(tr_model_set_param(f, tr_plan_param(pf, t->name), buf), TD_OK);
		}
		CHECK(changed > pq->nf4_numel / 2); /* quantization did change the weights */
		free(buf);
		double lq = train_step(q, &b, 1), lf = train_step(f, &b, 1);
		CHECK_MSG(lq == lf, "dq=%d: QLoRA loss %.9g, LoRA on the dequantized weights %.9g", dq, lq, lf);
		for (size_t i = 0; i < pq->nparams; i++) {
			const struct tr_param *t = &pq->params[i];
			if (!t->trainable)
				continue;
			float a[256], c[256];
			tr_model_get_param(q, t, a);
			tr_model_get_param(f, tr_plan_param(pf, t->name), c);
			CHECK_MSG(memcmp(a, c, t->numel * sizeof(float)) == 0, "dq=%d: %s differs after a step", dq,
				  t->name);
		}
		tr_model_free(q);
		tr_model_free(f);
	}
	gpu_backend_free(be);
}

/* The bound on QLoRA's loss after 3 steps against fp32 LoRA's, and why.
 *
 * Both runs start from the same adapter and see the same batch; they differ
 * only in the frozen projections, W (fp32) versus Q(W) (NF4). To first order
 * the loss differs by F = sum_i g_i dW_i, with g the gradient of the adapted
 * model at the start (the base with the initial adapter merged) and dW =
 * Q(W) - W. NF4's rounding errors dW_i are zero-mean and do not depend on the
 * sign of g_i, so F is a sum of independent terms of either sign: a random
 * walk whose standard deviation is
 *     S = sqrt(sum_i (g_i dW_i)^2),
 * computed here from the fixture (not assumed). The bound we state is
 *     |L_QLoRA - L_LoRA| <= 3 S   after 3 steps (and before training),
 * three standard deviations of the first-order term. The second-order term is
 * O(|dW|^2) and small at NF4's resolution; three AdamW steps at lr 1e-3 move
 * each adapter element by at most 3e-3 in both runs alike, far less than
 * quantization moves the base, so the gap stays the quantization's. Two checks
 * back the reasoning: before training the measured gap is F to within 25%
 * (first order holds), and the deterministic Cauchy-Schwarz bound
 * B = sum_t |g_t| |dW_t| (which is ~sqrt(n) looser than S) holds as well. */
static void test_qlora_bound(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct batch b;
	load_batch(&b);
	char base[PATH_MAX], adir[PATH_MAX], merged[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	snprintf(adir, sizeof(adir), "%s/qwen2-lora/adapter_init", fx);
	snprintf(merged, sizeof(merged), "%s/merged-init", tmp);
	CHECK_EQ_INT(tr_merge(base, adir, merged, "cpu", NULL, &eb), TD_OK);

	/* Gradients of the start point, every projection weight. */
	struct tr_plan_opts fo = {.B = b.B, .T = b.T};
	struct tr_model *full = new_model(be, &qwen2, &fo, merged, NULL);
	double ls;
	int64_t nv;
	CHECK_EQ_INT(tr_model_forward(full, b.ids, b.labels, &ls, &nv, &eb), TD_OK);
	tr_model_zero_grad(full);
	tr_model_backward(full, (float)(1.0 / (double)nv));

	struct tr_plan_opts lo = {.B = b.B, .T = b.T, .lora_rank = 4, .lora_alpha = 8, .lora_targets = QV};
	struct tr_plan_opts qo = lo;
	qo.base_quant = TR_QUANT_NF4;
	qo.nf4_double_quant = true;
	struct tr_model *f = new_model(be, &qwen2, &lo, base, adir);
	struct tr_model *q = new_model(be, &qwen2, &qo, base, adir);
	const struct tr_plan *pq = tr_model_plan(q), *pfull = tr_model_plan(full);
	double bound = 0, first_order = 0, walk = 0;
	size_t maxn = pq->nf4_max_numel;
	float *g = malloc(maxn * sizeof(float)), *wq = malloc(maxn * sizeof(float));
	float *w = malloc(maxn * sizeof(float));
	struct tr_weights *bw = NULL;
	CHECK_EQ_INT(tr_weights_open(&bw, base, &eb), TD_OK);
	for (size_t i = 0; i < pq->nparams; i++) {
		const struct tr_param *t = &pq->params[i];
		if (!t->nf4)
			continue;
		tr_model_get_param(q, t, wq);
		tr_st_to_f32(w, tr_weights_find(bw, t->name), &eb);
		tr_model_get_grad(full, tr_plan_param(pfull, t->name), g);
		double gg = 0, dd = 0, gd = 0;
		for (size_t k = 0; k < t->numel; k++) {
			double d = (double)wq[k] - w[k];
			gg += (double)g[k] * g[k];
			dd += d * d;
			gd += g[k] * d;
			walk += (g[k] * d) * (g[k] * d);
		}
		bound += sqrt(gg) * sqrt(dd);
		first_order += gd;
	}
	tr_weights_close(bw);
	free(g);
	free(w);
	free(wq);

	double lf0 = 0, lq0 = 0;
	for (int t = 1; t <= 3; t++) {
		double a = train_step(f, &b, t), c = train_step(q, &b, t);
		if (t == 1) {
			lf0 = a;
			lq0 = c;
		}
	}
	double lf3 = loss_of(f, &b), lq3 = loss_of(q, &b);
	printf("QLoRA vs LoRA (qwen2 fixture, r=4 on q,v, NF4 + double quantization):\n"
	       "  before training  %.6f vs %.6f  |diff| %.3e\n"
	       "  after 3 steps    %.6f vs %.6f  |diff| %.3e\n"
	       "  first order F = <grad, Q(W)-W> = %.3e; S = sqrt(sum (g dW)^2) = %.3e; bound 3S = %.3e;\n"
	       "  Cauchy-Schwarz B = %.3e\n",
	       lf0, lq0, fabs(lf0 - lq0), lf3, lq3, fabs(lf3 - lq3), first_order, sqrt(walk), 3 * sqrt(walk),
	       bound);
	double S = sqrt(walk);
	CHECK(S > 0 && bound > 0);
	CHECK_MSG(fabs(lq0 - lf0) <= 3 * S, "before training: |%g - %g| > 3S = %g", lq0, lf0, 3 * S);
	CHECK_MSG(fabs(lq3 - lf3) <= 3 * S, "after 3 steps: |%g - %g| > 3S = %g", lq3, lf3, 3 * S);
	CHECK_MSG(fabs((lq0 - lf0) - first_order) <= 0.25 * fabs(first_order),
		  "first order does not explain the gap: %g vs F = %g", lq0 - lf0, first_order);
	CHECK_MSG(fabs(lq3 - lf3) <= bound, "after 3 steps: |%g - %g| > B = %g", lq3, lf3, bound);
	/* Training did something in both. */
	CHECK(lf3 < lf0 && lq3 < lq0);
	tr_model_free(full);
	tr_model_free(f);
	tr_model_free(q);
	gpu_backend_free(be);
}

/* With dropout, the gradient is that of the loss the forward computed: the
 * directional derivative along the gradient g (central differences of the
 * loss with the same masks) equals |g|. A backward with other masks than the
 * forward's would not. */
static void test_dropout_gradient(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct batch b;
	load_batch(&b);
	char base[PATH_MAX], adir[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	snprintf(adir, sizeof(adir), "%s/qwen2-lora/adapter_init", fx);
	struct tr_plan_opts po = {.B = b.B, .T = b.T, .lora_rank = 4, .lora_alpha = 8,
				  .lora_targets = QV, .lora_dropout = 0.3f};
	struct tr_plan_opts p0 = po;
	p0.lora_dropout = 0;
	struct tr_model *m = new_model(be, &qwen2, &po, base, adir);
	struct tr_model *nod = new_model(be, &qwen2, &p0, base, adir);
	const struct tr_plan *p = tr_model_plan(m);
	size_t n = p->numel_trainable;
	float *theta = malloc(n * sizeof(float)), *grad = malloc(n * sizeof(float)), *x = malloc(n * sizeof(float));

	/* An unarmed forward has no dropout: it is the dropout-free model. */
	double l_eval = loss_of(m, &b), l_nod = loss_of(nod, &b);
	CHECK_MSG(l_eval == l_nod, "unarmed forward %.9g != no-dropout model %.9g", l_eval, l_nod);
	tr_model_set_dropout_seed(m, 77);
	double l1 = loss_of(m, &b);
	tr_model_set_dropout_seed(m, 77);
	double l2 = loss_of(m, &b);
	tr_model_set_dropout_seed(m, 78);
	double l3 = loss_of(m, &b);
	CHECK(l1 == l2 && l1 != l3 && l1 != l_nod);

	tr_model_set_dropout_seed(m, 77);
	double ls;
	int64_t nv;
	CHECK_EQ_INT(tr_model_forward(m, b.ids, b.labels, &ls, &nv, &eb), TD_OK);
	tr_model_zero_grad(m);
	tr_model_backward(m, (float)(1.0 / (double)nv));
	double gnorm = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *t = &p->params[i];
		if (!t->trainable)
			continue;
		tr_model_get_param(m, t, theta + t->goffset);
		tr_model_get_grad(m, t, grad + t->goffset);
	}
	for (size_t i = 0; i < n; i++)
		gnorm += (double)grad[i] * grad[i];
	gnorm = sqrt(gnorm);
	const double h = 0.05;
	double lp = 0, lm = 0;
	for (int sgn = -1; sgn <= 1; sgn += 2) {
		for (size_t i = 0; i < n; i++)
			x[i] = (float)(theta[i] + sgn * h * grad[i] / gnorm);
		for (size_t i = 0; i < p->nparams; i++)
			if (p->params[i].trainable)
				tr_model_set_param(m, &p->params[i], x + p->params[i].goffset);
		tr_model_set_dropout_seed(m, 77);
		*(sgn > 0 ? &lp : &lm) = loss_of(m, &b);
	}
	double dd = (lp - lm) / (2 * h);
	printf("dropout 0.3: |grad| %.6e, directional derivative %.6e\n", gnorm, dd);
	CHECK_MSG(fabs(dd - gnorm) <= 0.01 * gnorm, "directional derivative %g != |grad| %g", dd, gnorm);
	free(theta);
	free(grad);
	free(x);
	tr_model_free(m);
	tr_model_free(nod);
	gpu_backend_free(be);
}

/* Pooling: a right-padded row's logits are those of the row without its
 * padding (causal attention: later tokens cannot change the pooled one). */
static void test_classify(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	char dir[PATH_MAX];
	snprintf(dir, sizeof(dir), "%s/qwen2-classify", fx);
	struct tr_model_config cc;
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/config.json", dir);
	CHECK_EQ_INT(tr_config_load(&cc, path, &eb), TD_OK);
	const int T = 10, K = 6, NL = cc.num_labels, pad = cc.pad_token_id;
	CHECK(NL == 3 && pad >= 0);
	struct tr_plan_opts two = {.B = 2, .T = T, .num_labels = NL};
	struct tr_plan_opts one = {.B = 1, .T = K, .num_labels = NL};
	struct tr_model *m2 = new_model(be, &cc, &two, dir, NULL);
	struct tr_model *m1 = new_model(be, &cc, &one, dir, NULL);
	int32_t ids[2 * 10], short_ids[6];
	for (int t = 0; t < T; t++) {
		ids[t] = 5 + t * 3;
		ids[T + t] = t < K ? 11 + t * 7 : pad;
	}
	ids[T + 2] = pad; /* a pad id inside the text does not end it */
	memcpy(short_ids, ids + T, sizeof(short_ids));
	tr_model_set_pad_id(m1, -1); /* no padding: the last token */
	double ls;
	int64_t nv;
	int32_t cls2[2] = {1, 2}, cls1[1] = {2};
	CHECK_EQ_INT(tr_model_forward_classify(m2, ids, cls2, &ls, &nv, &eb), TD_OK);
	CHECK_EQ_INT(nv, 2);
	float l2[6], l1[3];
	tr_model_get_logits(m2, l2);
	CHECK_EQ_INT(tr_model_forward_classify(m1, short_ids, cls1, &ls, &nv, &eb), TD_OK);
	tr_model_get_logits(m1, l1);
	/* the same sequence through GEMMs and attention of other shapes */
	for (int k = 0; k < NL; k++)
		CHECK_NEAR(l2[NL + k], l1[k], F32_FORWARD_RTOL * (1 + fabs(l1[k])));

	/* -100 rows are ignored; a label outside the range is refused. */
	int32_t ign[2] = {-100, 1};
	CHECK_EQ_INT(tr_model_forward_classify(m2, ids, ign, &ls, &nv, &eb), TD_OK);
	CHECK_EQ_INT(nv, 1);
	int32_t bad[2] = {0, 3};
	CHECK_EQ_INT(tr_model_forward_classify(m2, ids, bad, &ls, &nv, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "labels[1] = 3 is outside the 3 labels [0, 3)");
	int32_t neg[2] = {-1, 0};
	CHECK_EQ_INT(tr_model_forward_classify(m2, ids, neg, &ls, &nv, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "labels[0] = -1");
	CHECK_EQ_INT(tr_model_forward(m2, ids, ids, &ls, &nv, &eb), TD_EINVAL);
	tr_model_free(m1);
	tr_model_free(m2);
	gpu_backend_free(be);

	/* Metrics against their definitions: F1 as the harmonic mean of
	 * precision and recall per label, averaged over labels that occur. */
	const int32_t gold[] = {0, 0, 1, 1, 1, 2, 2, -100, 0, 3};
	const int32_t pred[] = {0, 1, 1, 1, 0, 2, 0, 2, 0, 3};
	struct tr_class_metrics cm;
	CHECK_EQ_INT(tr_classify_metrics(pred, gold, 10, 5, &cm, &eb), TD_OK);
	double f1 = 0;
	int labels = 0, correct = 0, rows = 0;
	for (int k = 0; k < 5; k++) {
		int tp = 0, np = 0, ng = 0;
		for (int i = 0; i < 10; i++) {
			if (gold[i] == -100)
				continue;
			tp += gold[i] == k && pred[i] == k;
			np += pred[i] == k;
			ng += gold[i] == k;
		}
		if (!np && !ng)
			continue;
		labels++;
		double prec = np ? (double)tp / np : 0, rec = ng ? (double)tp / ng : 0;
		f1 += prec + rec > 0 ? 2 * prec * rec / (prec + rec) : 0;
	}
	for (int i = 0; i < 10; i++)
		if (gold[i] != -100) {
			rows++;
			correct += gold[i] == pred[i];
		}
	CHECK_EQ_INT(cm.n, rows);
	CHECK_NEAR(cm.accuracy, (double)correct / rows, 1e-12);
	CHECK_NEAR(cm.macro_f1, f1 / labels, 1e-12);
	const int32_t oob[] = {7};
	CHECK_EQ_INT(tr_classify_metrics(oob, oob, 1, 5, &cm, &eb), TD_ERANGE);
}

/* Distillation with alpha = 0 is CE, loss and gradients; alpha = 1 is the
 * KL term alone, which is 0 (with a zero gradient) against itself. */
static void test_distill_limits(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct batch b;
	load_batch(&b);
	char base[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	struct tr_plan_opts so = {.B = b.B, .T = b.T, .distill = true};
	struct tr_plan_opts fo = {.B = b.B, .T = b.T};
	struct tr_plan_opts to = {.B = b.B, .T = b.T, .inference = true};
	struct tr_model *s = new_model(be, &qwen2, &so, base, NULL);
	struct tr_model *f = new_model(be, &qwen2, &fo, base, NULL);
	struct tr_model *t = new_model(be, &qwen2, &to, base, NULL); /* the student's twin */
	CHECK_EQ_INT(tr_model_forward_logits(t, b.ids, &eb), TD_OK);
	struct tr_distill_sums ds;
	CHECK_EQ_INT(tr_model_forward_distill(s, b.ids, b.labels, t, 2.0f, 0.0f, &ds, &eb),
		     TD_OK);
	double ls;
	int64_t nv;
	CHECK_EQ_INT(tr_model_forward(f, b.ids, b.labels, &ls, &nv, &eb), TD_OK);
	CHECK_EQ_INT(ds.n_valid, nv);
	/* Same shapes, so the same logits bit for bit; each row's CE is then
	 * a double expression rounded once to float32 by either kernel (u of
	 * each row's loss, all positive: 2u of the sum apart), summed in
	 * double. */
	CHECK_NEAR(ds.loss_sum, ls, 2 * F32_U * ls + 1e-12);
	CHECK_NEAR(ds.ce_sum, ls, 2 * F32_U * ls + 1e-12);
	/* the teacher is the student: its logits are the same bits, so each
	 * row's KL sums exact zeros */
	CHECK_MSG(ds.kl_sum == 0, "KL against itself: %.9g", ds.kl_sum);
	tr_model_zero_grad(s);
	tr_model_zero_grad(f);
	tr_model_backward(s, (float)(1.0 / (double)nv));
	tr_model_backward(f, (float)(1.0 / (double)nv));
	const struct tr_plan *p = tr_model_plan(s);
	float *a = malloc(p->numel_trainable * sizeof(float)), *c = malloc(p->numel_trainable * sizeof(float));
	double maxd = 0, maxr = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		tr_model_get_grad(s, &p->params[i], a);
		tr_model_get_grad(f, &p->params[i], c);
		for (size_t k = 0; k < p->params[i].numel; k++) {
			maxd = fmax(maxd, fabs((double)a[k] - c[k]));
			maxr = fmax(maxr, fabs((double)c[k]));
		}
	}
	/* The loss gradients are double expressions rounded once to float32
	 * by either kernel: 2u apart, relative. The rest of the backward is the
	 * same float ops on them, a linear map, so the parameter gradients
	 * differ by 2u times that map's amplification (|J| |dl| / |J dl|,
	 * the cancellation in its dot products). F32_FORWARD_RTOL (84u)
	 * allows an amplification of 40. */
	CHECK_MSG(maxd <= F32_FORWARD_RTOL * maxr, "alpha 0: gradients differ from CE's by %g (max %g)", maxd, maxr);
	/* alpha = 1 against itself: zero loss, zero gradient. */
	CHECK_EQ_INT(tr_model_forward_logits(t, b.ids, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_forward_distill(s, b.ids, b.labels, t, 2.0f, 1.0f, &ds, &eb),
		     TD_OK);
	/* the same bits again: KL rows of exact zeros, and a gradient
	 * alpha T (q - p) of exact zeros */
	CHECK_MSG(ds.loss_sum == 0, "alpha 1 against itself: loss %.9g", ds.loss_sum);
	tr_model_zero_grad(s);
	tr_model_backward(s, (float)(1.0 / (double)nv));
	CHECK_MSG(tr_model_grad_norm(s) == 0, "alpha 1 against itself: gradient norm %.9g",
		  tr_model_grad_norm(s));
	free(a);
	free(c);
	tr_model_free(s);
	tr_model_free(f);
	tr_model_free(t);
	gpu_backend_free(be);
}

/* A distillation student whose logits come in chunks of 5 rows (48 = 9 x 5 +
 * 3) gives the losses and every gradient of the whole-logits student, with
 * the teacher's logits whole or in chunks of the same rows. With the row-wise
 * matmuls of rowmatmul.h a row's logits do not depend on how many rows their
 * call covers (OpenBLAS's may, by shape, thread count and core type), so the
 * chunked passes perform the whole pass's float operations and the
 * comparisons are for equal bits. */
static void test_distill_chunked(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	rowmatmul_install(be);
	struct batch b;
	load_batch(&b);
	char base[PATH_MAX], tdir[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	snprintf(tdir, sizeof(tdir), "%s/distill/teacher", fx);
	struct tr_model_config tc;
	char cpath[PATH_MAX + 16];
	snprintf(cpath, sizeof(cpath), "%s/config.json", tdir);
	CHECK_EQ_INT(tr_config_load(&tc, cpath, &eb), TD_OK);
	struct tr_plan_opts to = {.B = b.B, .T = b.T, .inference = true};
	struct tr_model *t = new_model(be, &tc, &to, tdir, NULL);
	/* the teacher as the trainer plans it: logits by rows */
	struct tr_plan_opts tro = {.B = b.B, .T = b.T, .inference = true, .teacher_rows = true,
				   .logits_chunk_floats = 5 * (size_t)qwen2.vocab_size};
	struct tr_model *tr = new_model(be, &tc, &tro, tdir, NULL);
	CHECK_EQ_INT(tr_model_plan(tr)->logits_rows, 5);
	struct tr_distill_sums ds[3];
	float *g[3];
	size_t numel = 0;
	for (int v = 0; v < 3; v++) {
		struct tr_plan_opts so = {.B = b.B, .T = b.T, .distill = true,
					  .logits_chunk_floats = v ? 5 * (size_t)qwen2.vocab_size : 0};
		struct tr_model *s = new_model(be, &qwen2, &so, base, NULL);
		struct tr_model *teacher = v == 2 ? tr : t;
		CHECK_EQ_INT(tr_model_forward_trunk(teacher, b.ids, &eb), TD_OK);
		const struct tr_plan *p = tr_model_plan(s);
		CHECK_EQ_INT(p->logits_rows, v ? 5 : b.B * b.T);
		CHECK_EQ_INT(tr_model_forward_distill(s, b.ids, b.labels, teacher, 2.0f, 0.5f, &ds[v],
						      &eb),
			     TD_OK);
		tr_model_zero_grad(s);
		tr_model_backward(s, (float)(1.0 / (double)ds[v].n_valid));
		numel = p->numel_trainable;
		g[v] = malloc(numel * sizeof(float));
		for (size_t i = 0; i < p->nparams; i++)
			if (p->params[i].trainable)
				tr_model_get_grad(s, &p->params[i], g[v] + p->params[i].goffset);
		tr_model_free(s);
	}
	for (int v = 1; v < 3; v++) {
		CHECK_EQ_INT(ds[v].n_valid, ds[0].n_valid);
		CHECK_MSG(ds[v].kl_sum == ds[0].kl_sum && ds[v].ce_sum == ds[0].ce_sum &&
			  ds[v].loss_sum == ds[0].loss_sum,
			  "chunked student (teacher %s): kl %.17g ce %.17g loss %.17g, whole: kl "
			  "%.17g ce %.17g loss %.17g",
			  v == 2 ? "chunked" : "whole", ds[v].kl_sum, ds[v].ce_sum, ds[v].loss_sum,
			  ds[0].kl_sum, ds[0].ce_sum, ds[0].loss_sum);
		CHECK_MSG(memcmp(g[v], g[0], numel * sizeof(float)) == 0,
			  "chunked student (teacher %s): gradients differ from the whole student's",
			  v == 2 ? "chunked" : "whole");
	}
	/* a student whose chunks the teacher's cannot serve is refused */
	struct tr_plan_opts wo = {.B = b.B, .T = b.T, .distill = true};
	struct tr_model *w = new_model(be, &qwen2, &wo, base, NULL);
	CHECK_EQ_INT(tr_model_forward_trunk(tr, b.ids, &eb), TD_OK);
	struct tr_distill_sums dw;
	CHECK_EQ_INT(tr_model_forward_distill(w, b.ids, b.labels, tr, 2.0f, 0.5f, &dw, &eb),
		     TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "logits chunk");
	tr_model_free(w);
	for (int v = 0; v < 3; v++)
		free(g[v]);
	tr_model_free(tr);
	tr_model_free(t);
	gpu_backend_free(be);
}

/* --------------------------------------------------------------- jobs -- */

static Traind__JobSpec *spec(const char *name, const char *method, const char *data,
			     const char *extra, const char *output)
{
	char path[512], text[8192];
	snprintf(path, sizeof(path), "%s/%s.txtpb", tmp, name);
	snprintf(text, sizeof(text),
		 "name: \"%s\"\nmodel_dir: \"%s/qwen2\"\nmethod: %s\n%s\n"
		 "hyper { schedule: SCHEDULE_CONSTANT lr: 3e-3 weight_decay: 0.01 seed: 7 max_steps: 4 "
		 "micro_batch: 2 }\n%s\n"
		 "output { dir: \"%s/%s\" %s }\nresources { device: DEVICE_CPU }\n",
		 name, fx, method, data, extra, tmp, name, output);
	write_file(path, text);
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = rpc_jobspec_load(&s, path, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_apply_defaults(s, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_validate(s, &eb);
	if (e != TD_OK) {
		fprintf(stderr, "spec %s: %s\n", name, eb.msg);
		exit(2);
	}
	return s;
}

static char tokens_data[1024];

static td_err train(const Traind__JobSpec *s, uint64_t stop_after, struct tr_train_result *r,
		    struct td_errbuf *eb)
{
	struct tr_train_opts o = {.backend = "cpu", .stop_after = stop_after};
	return tr_train(s, &o, NULL, r, eb);
}

/* The tensors of two safetensors files, bit for bit. */
static bool same_file(const char *a, const char *b)
{
	struct tr_st_file *fa = NULL, *fb = NULL;
	struct td_errbuf eb = {{0}};
	bool same = tr_st_open(&fa, a, &eb) == TD_OK && tr_st_open(&fb, b, &eb) == TD_OK &&
		    tr_st_count(fa) == tr_st_count(fb);
	for (size_t i = 0; same && i < tr_st_count(fa); i++) {
		const struct tr_st_tensor *t = tr_st_at(fa, i), *u = tr_st_find(fb, t->name);
		same = u && u->nbytes == t->nbytes && memcmp(u->data, t->data, t->nbytes) == 0;
	}
	tr_st_close(fa);
	tr_st_close(fb);
	return same;
}

static void test_jobs(void)
{
	struct td_errbuf eb = {{0}};
	struct tr_train_result r;
	char path[PATH_MAX], other[PATH_MAX];
	const char *lora = "lora { rank: 4 alpha: 8 dropout: 0.1 target_modules: \"q_proj\" "
			   "target_modules: \"v_proj\" target_modules: \"down_proj\" }";

	/* LoRA with dropout: stopped after 2 steps and resumed is the run of 4. */
	Traind__JobSpec *a = spec("lora-a", "METHOD_LORA", tokens_data, lora, "checkpoint_every: 2");
	Traind__JobSpec *b = spec("lora-b", "METHOD_LORA", tokens_data, lora, "checkpoint_every: 2");
	td_err e = train(a, 0, &r, &eb);
	CHECK_MSG(e == TD_OK, "lora: %s", eb.msg);
	CHECK(r.last_loss < r.first_loss);
	CHECK_EQ_INT(train(b, 2, &r, &eb), TD_OK);
	CHECK(r.stopped);
	CHECK_EQ_INT(train(b, 0, &r, &eb), TD_OK);
	CHECK_EQ_INT(r.resumed_from, 2);
	snprintf(path, sizeof(path), "%s/lora-a/adapter_model.safetensors", tmp);
	snprintf(other, sizeof(other), "%s/lora-b/adapter_model.safetensors", tmp);
	CHECK_MSG(same_file(path, other), "a resumed LoRA run differs from the uninterrupted one");
	/* The output is an adapter that loads onto the base; no full model was written. */
	snprintf(path, sizeof(path), "%s/lora-a/model.safetensors", tmp);
	CHECK(access(path, F_OK) != 0);
	snprintf(path, sizeof(path), "%s/lora-a", tmp);
	struct tr_lora_config lc;
	CHECK_EQ_INT(tr_lora_config_load(&lc, path, &eb), TD_OK);
	CHECK_EQ_INT(lc.targets, QV | 1u << TR_LIN_DOWN);
	snprintf(other, sizeof(other), "%s/lora-a-merged", tmp);
	char base[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	CHECK_EQ_INT(tr_merge(base, path, other, "cpu", NULL, &eb), TD_OK);
	rpc_jobspec_free(a);
	rpc_jobspec_free(b);

	/* QLoRA, starting from the fixture's adapter. */
	char qlora[512];
	snprintf(qlora, sizeof(qlora), "lora { init_adapter: \"%s/qwen2-lora/adapter_init\" }", fx);
	a = spec("qlora", "METHOD_QLORA", tokens_data, qlora, "");
	e = train(a, 0, &r, &eb);
	CHECK_MSG(e == TD_OK, "qlora: %s", eb.msg);
	CHECK(isfinite(r.last_loss) && r.last_loss < r.first_loss);
	snprintf(path, sizeof(path), "%s/qlora", tmp);
	CHECK_EQ_INT(tr_lora_config_load(&lc, path, &eb), TD_OK);
	CHECK_EQ_INT(lc.r, 4); /* the init adapter's rank, not the lora section's default 8 */
	rpc_jobspec_free(a);

	/* Distillation from the fixture's teacher; --plan shows both models. */
	char distill[512];
	snprintf(distill, sizeof(distill), "distill { teacher_dir: \"%s/distill/teacher\" teacher_nf4: true }", fx);
	a = spec("distill", "METHOD_DISTILL", tokens_data, distill, "");
	char *text = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&text, &len);
	CHECK_EQ_INT(tr_train_plan(a, f, &eb), TD_OK);
	fclose(f);
	CHECK_CONTAINS(text, "teacher");
	CHECK_CONTAINS(text, "job total");
	CHECK_CONTAINS(text, "forward only");
	free(text);
	e = train(a, 0, &r, &eb);
	CHECK_MSG(e == TD_OK, "distill: %s", eb.msg);
	CHECK(isfinite(r.last_loss) && r.last_loss < r.first_loss);
	snprintf(path, sizeof(path), "%s/distill", tmp);
	struct tr_weights *w = NULL;
	CHECK_EQ_INT(tr_weights_open(&w, path, &eb), TD_OK); /* a full student */
	tr_weights_close(w);
	rpc_jobspec_free(a);

	/* A teacher with another vocabulary, or another tokenizer. */
	char tdir[PATH_MAX], cfgpath[PATH_MAX];
	snprintf(tdir, sizeof(tdir), "%s/teacher-v600", tmp);
	mkdir(tdir, 0755);
	snprintf(cfgpath, sizeof(cfgpath), "%s/distill/teacher/config.json", fx);
	struct json_object *tc = json_object_from_file(cfgpath);
	json_object_object_add(tc, "vocab_size", json_object_new_int(600));
	snprintf(path, sizeof(path), "%s/config.json", tdir);
	write_file(path, json_object_to_json_string(tc));
	snprintf(distill, sizeof(distill), "distill { teacher_dir: \"%s\" }", tdir);
	a = spec("distill-v600", "METHOD_DISTILL", tokens_data, distill, "");
	CHECK_EQ_INT(train(a, 0, &r, &eb), TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "has a vocabulary of 600 tokens, the student");
	CHECK_EQ_INT(tr_train_plan(a, stdout, &eb), TD_EMISMATCH);
	rpc_jobspec_free(a);
	json_object_object_add(tc, "vocab_size", json_object_new_int(qwen2.vocab_size));
	write_file(path, json_object_to_json_string(tc));
	json_object_put(tc);
	snprintf(path, sizeof(path), "%s/tokenizer.json", tdir);
	write_file(path, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}}}");
	a = spec("distill-tok", "METHOD_DISTILL", tokens_data, distill, "");
	CHECK_EQ_INT(train(a, 0, &r, &eb), TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "have different vocabularies");
	rpc_jobspec_free(a);

	/* An init adapter that does not fit the base fails before training. */
	snprintf(qlora, sizeof(qlora), "lora { init_adapter: \"%s/qwen2-lora/adapter_init\" }", fx);
	Traind__JobSpec *ll = spec("lora-llama", "METHOD_LORA", tokens_data, qlora, "");
	free(ll->model_dir);
	snprintf(path, sizeof(path), "%s/llama", fx);
	ll->model_dir = strdup(path);
	CHECK_EQ_INT(train(ll, 0, &r, &eb), TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "lora.init_adapter: ");
	CHECK_CONTAINS(eb.msg, "of the llama base model need [64, 4]");
	rpc_jobspec_free(ll);
}

/* Classification from JSONL rows, with LoRA and the head trained, evaluated
 * (loss, accuracy, macro-F1); the output loads as a classifier. */
static void test_classify_job(void)
{
	struct td_errbuf eb = {{0}};
	char path[PATH_MAX], data[1024], evalp[PATH_MAX];
	snprintf(path, sizeof(path), "%s/cls.jsonl", tmp);
	snprintf(evalp, sizeof(evalp), "%s/cls-eval.jsonl", tmp);
	static const char *const rows[] = {
		"{\"text\": \"The cat sat on the mat.\", \"label\": 0}",
		"{\"text\": \"A dog barked at the moon all night long.\", \"label\": 1}",
		"{\"text\": \"Stocks fell sharply.\", \"label\": 2}",
		"{\"text\": \"The kitten slept.\", \"label\": 0}",
		"{\"text\": \"Puppies play in the park.\", \"label\": 1}",
		"{\"text\": \"Markets rallied today after the news.\", \"label\": 2}",
	};
	FILE *f = fopen(path, "w"), *g = fopen(evalp, "w");
	for (size_t i = 0; i < 6; i++) {
		fprintf(f, "%s\n", rows[i]);
		fprintf(g, "%s\n", rows[(i * 5) % 6]);
	}
	fclose(f);
	fclose(g);
	snprintf(data, sizeof(data),
		 "data { train_file: \"%s\" eval_file: \"%s\" format: DATA_FORMAT_JSONL seq_len: 16 packing: false }",
		 path, evalp);
	Traind__JobSpec *s = spec("classify", "METHOD_CLASSIFY", data,
				  "classify { num_labels: 3 label_names: \"pets\" label_names: \"dogs\" "
				  "label_names: \"money\" lora: true } lora { rank: 2 }",
				  "");
	struct tr_train_result r;
	char *text = NULL;
	size_t len = 0;
	FILE *log = open_memstream(&text, &len);
	struct tr_train_opts o = {.backend = "cpu", .log = log};
	td_err e = tr_train(s, &o, NULL, &r, &eb);
	fclose(log);
	CHECK_MSG(e == TD_OK, "classify: %s", eb.msg);
	CHECK_CONTAINS(text, "accuracy");
	CHECK_CONTAINS(text, "macro-F1");
	CHECK_CONTAINS(text, "head       score [3, 64]");
	CHECK(isfinite(r.eval_loss));
	free(text);
	/* A SEQ_CLS adapter with the head; merged, a classifier dir. */
	snprintf(path, sizeof(path), "%s/classify", tmp);
	struct tr_lora_config lc;
	CHECK_EQ_INT(tr_lora_config_load(&lc, path, &eb), TD_OK);
	CHECK(lc.score);
	CHECK_STR_EQ(lc.task_type, "SEQ_CLS");
	char merged[PATH_MAX], base[PATH_MAX];
	snprintf(merged, sizeof(merged), "%s/classify-merged", tmp);
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	CHECK_EQ_INT(tr_merge(base, path, merged, "cpu", NULL, &eb), TD_OK);
	snprintf(path, sizeof(path), "%s/config.json", merged);
	struct tr_model_config mc;
	CHECK_EQ_INT(tr_config_load(&mc, path, &eb), TD_OK);
	CHECK_EQ_INT(mc.num_labels, 3);
	struct json_object *cj = json_object_from_file(path), *arch;
	CHECK(cj && json_object_object_get_ex(cj, "architectures", &arch));
	CHECK_STR_EQ(json_object_get_string(json_object_array_get_idx(arch, 0)), "Qwen2ForSequenceClassification");
	json_object_put(cj);
	struct tr_weights *w = NULL;
	CHECK_EQ_INT(tr_weights_open(&w, merged, &eb), TD_OK);
	CHECK(tr_weights_find(w, "score.weight") != NULL);
	tr_weights_close(w);
	rpc_jobspec_free(s);

	/* Full fine-tuning of a classifier writes a classifier dir with the names. */
	snprintf(data, sizeof(data),
		 "data { train_file: \"%s/cls.jsonl\" format: DATA_FORMAT_JSONL seq_len: 16 packing: false }", tmp);
	s = spec("classify-full", "METHOD_CLASSIFY", data,
		 "classify { num_labels: 3 label_names: \"pets\" label_names: \"dogs\" label_names: \"money\" }", "");
	e = train(s, 0, &r, &eb);
	CHECK_MSG(e == TD_OK, "classify-full: %s", eb.msg);
	snprintf(path, sizeof(path), "%s/classify-full/config.json", tmp);
	CHECK_EQ_INT(tr_config_load(&mc, path, &eb), TD_OK);
	CHECK_EQ_INT(mc.num_labels, 3);
	CHECK(mc.pad_token_id >= 0);
	cj = json_object_from_file(path);
	struct json_object *id2label, *l1;
	CHECK(cj && json_object_object_get_ex(cj, "id2label", &id2label) &&
	      json_object_object_get_ex(id2label, "1", &l1));
	CHECK_STR_EQ(json_object_get_string(l1), "dogs");
	json_object_put(cj);
	rpc_jobspec_free(s);
}

/* The methods table: a method value no method has (validation refuses it
 * in a job file; a spec built in memory may still carry one) fails every
 * entry point naming the field, never falls back to another method. */
static void test_unknown_method(void)
{
	Traind__JobSpec *s = spec("unknown-method", "METHOD_FULL", tokens_data, "", "");
	s->method = (Traind__Method)99;
	struct td_errbuf eb = {{0}};
	struct tr_plan_opts po;
	CHECK_EQ_INT(tr_method_plan_opts(s, &qwen2, 2, 16, &po, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "method: unknown value 99");
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(tr_method_check(s, &qwen2, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "method: unknown value 99");
	memset(&eb, 0, sizeof(eb));
	struct tr_method *mt = NULL;
	CHECK_EQ_INT(tr_method_new(&mt, s, &qwen2, NULL, 2, 16, 0, 1, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "method: unknown value 99");
	CHECK(mt == NULL);
	rpc_jobspec_free(s);
}

int main(void)
{
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set");
	snprintf(tmp, sizeof(tmp), "/tmp/test_methods-XXXXXX");
	if (!mkdtemp(tmp))
		return 2;
	char path[PATH_MAX];
	struct td_errbuf eb = {{0}};
	snprintf(path, sizeof(path), "%s/qwen2/config.json", fx);
	if (tr_config_load(&qwen2, path, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		return 2;
	}
	snprintf(tokens_data, sizeof(tokens_data),
		 "data { train_file: \"%s/demo/fortunes.tokens\" format: DATA_FORMAT_TOKENS seq_len: 16 }", fx);
	test_plans();
	test_bytes_are_plan();
	test_qlora_exact();
	test_qlora_bound();
	test_dropout_gradient();
	test_classify();
	test_distill_limits();
	test_distill_chunked();
	test_jobs();
	test_classify_job();
	test_unknown_method();
	check_rm_tree(tmp);
	return check_status();
}
