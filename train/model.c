/* The transformer's forward and backward over backend ops.
 *
 * Shape letters as in kernels/cpu/ops.h: N = B*T rows, C hidden, H = NH*HS,
 * KV = NKV*HS, I intermediate, V vocab, L layers.
 *
 * Per layer l (pre-norm decoder block):
 *   ln1 = rmsnorm(res[l]); q,k,v = proj(ln1) (+bias); [qwen3: q,k = rmsnorm per head]
 *   q,k = rope(q,k); y = attention(q,k,v); res_mid = res[l] + o_proj(y)
 *   ln2 = rmsnorm(res_mid); h = silu(gate(ln2)) * up(ln2); res[l+1] = res_mid + down(h)
 * then lnf = rmsnorm(res[L]); logits = lnf @ lm_head^T (lm_head = embedding if tied).
 * Everything the backward pass reads is kept in the acts arena; the backward
 * pass walks the same list in reverse with the scratch arena's buffers. */
#include "train/model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Only for rope_cache(), a host-side table computation: the tables are uploaded
 * like weights. No op is called from here except through the backend. */
#include "kernels/cpu/ops.h"

/* Pointers of one layer's tensors (weights or their gradients). */
struct layer_w {
	float *ln1, *wq, *bq, *wk, *bk, *wv, *bv, *wo, *bo, *qn, *kn, *ln2;
	float *wg, *bg, *wu, *bu, *wd, *bd;
};

struct layer_a {
	float *ln1, *ln1_rstd, *qraw, *q_rstd, *kraw, *k_rstd, *q, *k, *v, *att, *y;
	float *res_mid, *ln2, *ln2_rstd, *gate, *up, *h;
};

struct tr_model {
	struct gpu_backend *be;
	struct tr_plan plan;
	void *arena[TR_ARENA_COUNT];

	float *params, *grads, *m1, *m2;
	float *embed, *lnf, *lm_head;    /* lm_head == embed when tied */
	float *dembed, *dlnf, *dlm_head; /* NULL where frozen */
	struct layer_w *w, *g;           /* [L] */

	int32_t *ids, *targets;
	float *rope_cos, *rope_sin;
	float **res;                     /* [L+1] */
	struct layer_a *a;               /* [L] */
	float *lnf_out, *lnf_rstd;
	float *logits, *losses, *dres, *dln, *dq, *dk, *dv, *dqraw, *dkraw, *dy, *datt, *dh,
		*dgate, *dup;

	int32_t *host_targets;           /* (N) */
	float *host_losses;              /* (N) */
	bool logits_valid;
};

const struct tr_plan *tr_model_plan(const struct tr_model *m)
{
	return &m->plan;
}

struct gpu_backend *tr_model_backend(const struct tr_model *m)
{
	return m->be;
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

/* Parameter (or gradient) pointer by HF name; NULL when absent / frozen. */
static float *pptr(struct tr_model *m, bool grad, const char *fmt, int l)
{
	char name[96];
	snprintf(name, sizeof(name), fmt, l);
	const struct tr_param *p = tr_plan_param(&m->plan, name);
	if (!p)
		return NULL;
	if (grad)
		return p->trainable ? m->grads + p->goffset : NULL;
	return m->params + p->offset;
}

static void bind_layer(struct tr_model *m, struct layer_w *w, bool grad, int l)
{
	w->ln1 = pptr(m, grad, "model.layers.%d.input_layernorm.weight", l);
	w->wq = pptr(m, grad, "model.layers.%d.self_attn.q_proj.weight", l);
	w->bq = pptr(m, grad, "model.layers.%d.self_attn.q_proj.bias", l);
	w->wk = pptr(m, grad, "model.layers.%d.self_attn.k_proj.weight", l);
	w->bk = pptr(m, grad, "model.layers.%d.self_attn.k_proj.bias", l);
	w->wv = pptr(m, grad, "model.layers.%d.self_attn.v_proj.weight", l);
	w->bv = pptr(m, grad, "model.layers.%d.self_attn.v_proj.bias", l);
	w->wo = pptr(m, grad, "model.layers.%d.self_attn.o_proj.weight", l);
	w->bo = pptr(m, grad, "model.layers.%d.self_attn.o_proj.bias", l);
	w->qn = pptr(m, grad, "model.layers.%d.self_attn.q_norm.weight", l);
	w->kn = pptr(m, grad, "model.layers.%d.self_attn.k_norm.weight", l);
	w->ln2 = pptr(m, grad, "model.layers.%d.post_attention_layernorm.weight", l);
	w->wg = pptr(m, grad, "model.layers.%d.mlp.gate_proj.weight", l);
	w->bg = pptr(m, grad, "model.layers.%d.mlp.gate_proj.bias", l);
	w->wu = pptr(m, grad, "model.layers.%d.mlp.up_proj.weight", l);
	w->bu = pptr(m, grad, "model.layers.%d.mlp.up_proj.bias", l);
	w->wd = pptr(m, grad, "model.layers.%d.mlp.down_proj.weight", l);
	w->bd = pptr(m, grad, "model.layers.%d.mlp.down_proj.bias", l);
}

static void bind(struct tr_model *m)
{
	const struct tr_model_config *c = &m->plan.cfg;
	m->params = buf(m, "params");
	m->grads = buf(m, "grads");
	m->m1 = buf(m, "optim.m");
	m->m2 = buf(m, "optim.v");
	m->embed = pptr(m, false, "model.embed_tokens.weight", 0);
	m->lnf = pptr(m, false, "model.norm.weight", 0);
	m->dembed = pptr(m, true, "model.embed_tokens.weight", 0);
	m->dlnf = pptr(m, true, "model.norm.weight", 0);
	if (c->tie_word_embeddings) {
		m->lm_head = m->embed;
		m->dlm_head = m->dembed;
	} else {
		m->lm_head = pptr(m, false, "lm_head.weight", 0);
		m->dlm_head = pptr(m, true, "lm_head.weight", 0);
	}
	for (int l = 0; l < c->num_layers; l++) {
		bind_layer(m, &m->w[l], false, l);
		bind_layer(m, &m->g[l], true, l);
	}
	m->ids = buf(m, "acts.ids");
	m->targets = buf(m, "acts.targets");
	m->rope_cos = buf(m, "acts.rope_cos");
	m->rope_sin = buf(m, "acts.rope_sin");
	for (int l = 0; l <= c->num_layers; l++)
		m->res[l] = buf(m, "acts.res.%d", l);
	for (int l = 0; l < c->num_layers; l++) {
		struct layer_a *a = &m->a[l];
#define A(f) a->f = buf(m, "acts.layers.%d." #f, l)
		A(ln1);
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
#undef S
}

td_err tr_model_new(struct tr_model **out, struct gpu_backend *be,
		    const struct tr_model_config *cfg, const struct tr_plan_opts *opts,
		    struct td_errbuf *eb)
{
	struct tr_model *m = calloc(1, sizeof(*m));
	if (!m)
		return td_fail(eb, TD_ENOMEM, "model: out of memory");
	m->be = be;
	td_err e = tr_plan_build(&m->plan, cfg, opts, eb);
	if (e != TD_OK) {
		free(m);
		return e;
	}
	int L = cfg->num_layers;
	size_t N = (size_t)opts->B * (size_t)opts->T;
	m->w = calloc((size_t)L, sizeof(*m->w));
	m->g = calloc((size_t)L, sizeof(*m->g));
	m->a = calloc((size_t)L, sizeof(*m->a));
	m->res = calloc((size_t)L + 1, sizeof(*m->res));
	m->host_targets = malloc(N * sizeof(int32_t));
	m->host_losses = malloc(N * sizeof(float));
	if (!m->w || !m->g || !m->a || !m->res || !m->host_targets || !m->host_losses) {
		tr_model_free(m);
		return td_fail(eb, TD_ENOMEM, "model: out of memory");
	}
	for (int a = 0; a < TR_ARENA_COUNT; a++) {
		if (!m->plan.arena_bytes[a])
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
	bind(m);

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

void tr_model_free(struct tr_model *m)
{
	if (!m)
		return;
	for (int a = 0; a < TR_ARENA_COUNT; a++)
		gpu_free(m->be, m->arena[a], m->plan.arena_bytes[a]);
	tr_plan_fini(&m->plan);
	free(m->w);
	free(m->g);
	free(m->a);
	free(m->res);
	free(m->host_targets);
	free(m->host_losses);
	free(m);
}

/* --- loading and host access --- */

static bool tied_copy_ok(const struct tr_model *m, const struct tr_st_tensor *t)
{
	const struct tr_model_config *c = &m->plan.cfg;
	return c->tie_word_embeddings && strcmp(t->name, "lm_head.weight") == 0;
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
	for (size_t i = 0; i < p->nparams && e == TD_OK; i++) {
		const struct tr_param *pp = &p->params[i];
		const struct tr_st_tensor *t = tr_weights_find(w, pp->name);
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
				    "%s: tensor '%s' has shape [%s], the config implies [%s]",
				    tr_weights_file_of(w, pp->name), pp->name, got, want);
			break;
		}
		e = tr_st_to_f32(host, t, eb);
		if (e == TD_OK)
			gpu_upload(m->be, m->params + pp->offset, host, pp->numel * sizeof(float));
	}
	/* Tensors the model would ignore mean the file is not what the config says. */
	for (size_t i = 0; i < tr_weights_count(w) && e == TD_OK; i++) {
		const struct tr_st_tensor *t = tr_weights_at(w, i);
		if (!tr_plan_param(p, t->name) && !tied_copy_ok(m, t))
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' is not part of a %s model with this config",
				    tr_weights_file_of(w, t->name), t->name, p->cfg.model_type);
	}
	free(host);
	return e;
}

void tr_model_get_param(struct tr_model *m, const struct tr_param *p, float *dst)
{
	gpu_download(m->be, dst, m->params + p->offset, p->numel * sizeof(float));
}

void tr_model_set_param(struct tr_model *m, const struct tr_param *p, const float *src)
{
	gpu_upload(m->be, m->params + p->offset, src, p->numel * sizeof(float));
}

void tr_model_get_grad(struct tr_model *m, const struct tr_param *p, float *dst)
{
	assert(p->trainable);
	gpu_download(m->be, dst, m->grads + p->goffset, p->numel * sizeof(float));
}

void tr_model_get_moments(struct tr_model *m, float *m1, float *m2)
{
	size_t bytes = m->plan.numel_trainable * sizeof(float);
	gpu_download(m->be, m1, m->m1, bytes);
	gpu_download(m->be, m2, m->m2, bytes);
}

void tr_model_set_moments(struct tr_model *m, const float *m1, const float *m2)
{
	size_t bytes = m->plan.numel_trainable * sizeof(float);
	gpu_upload(m->be, m->m1, m1, bytes);
	gpu_upload(m->be, m->m2, m2, bytes);
}

void tr_model_get_logits(struct tr_model *m, float *dst)
{
	assert(m->logits_valid);
	size_t N = (size_t)m->plan.opts.B * (size_t)m->plan.opts.T;
	gpu_download(m->be, dst, m->logits, N * (size_t)m->plan.cfg.vocab_size * sizeof(float));
}

void tr_model_get_hidden(struct tr_model *m, int i, float *dst)
{
	size_t N = (size_t)m->plan.opts.B * (size_t)m->plan.opts.T;
	int L = m->plan.cfg.num_layers;
	assert(i >= 0 && i <= L);
	const float *src = i < L ? m->res[i] : m->lnf_out;
	gpu_download(m->be, dst, src, N * (size_t)m->plan.cfg.hidden_size * sizeof(float));
}

/* --- forward --- */

static void layer_forward(struct tr_model *m, int l)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int B = m->plan.opts.B, T = m->plan.opts.T, N = B * T;
	const int C = c->hidden_size, I = c->intermediate_size, NH = c->num_heads;
	const int NKV = c->num_kv_heads, HS = c->head_dim, H = NH * HS, KV = NKV * HS;
	const float eps = (float)c->rms_norm_eps;
	const struct layer_w *w = &m->w[l];
	struct layer_a *a = &m->a[l];

	gpu_rmsnorm_forward(be, a->ln1, a->ln1_rstd, m->res[l], w->ln1, N, C, eps);
	if (c->qk_norm) {
		gpu_matmul_forward(be, a->qraw, a->ln1, w->wq, w->bq, N, C, H);
		gpu_matmul_forward(be, a->kraw, a->ln1, w->wk, w->bk, N, C, KV);
		gpu_rmsnorm_forward(be, a->q, a->q_rstd, a->qraw, w->qn, N * NH, HS, eps);
		gpu_rmsnorm_forward(be, a->k, a->k_rstd, a->kraw, w->kn, N * NKV, HS, eps);
	} else {
		gpu_matmul_forward(be, a->q, a->ln1, w->wq, w->bq, N, C, H);
		gpu_matmul_forward(be, a->k, a->ln1, w->wk, w->bk, N, C, KV);
	}
	gpu_matmul_forward(be, a->v, a->ln1, w->wv, w->bv, N, C, KV);
	gpu_rope_forward(be, a->q, a->q, m->rope_cos, m->rope_sin, B, T, NH, HS);
	gpu_rope_forward(be, a->k, a->k, m->rope_cos, m->rope_sin, B, T, NKV, HS);
	gpu_attention_forward(be, a->y, a->att, a->q, a->k, a->v, B, T, NH, NKV, HS);
	gpu_matmul_forward(be, m->dln, a->y, w->wo, w->bo, N, H, C);
	gpu_residual_forward(be, a->res_mid, m->res[l], m->dln, (size_t)N * C);

	gpu_rmsnorm_forward(be, a->ln2, a->ln2_rstd, a->res_mid, w->ln2, N, C, eps);
	gpu_matmul_forward(be, a->gate, a->ln2, w->wg, w->bg, N, C, I);
	gpu_matmul_forward(be, a->up, a->ln2, w->wu, w->bu, N, C, I);
	gpu_swiglu_forward(be, a->h, a->gate, a->up, (size_t)N * I);
	gpu_matmul_forward(be, m->dln, a->h, w->wd, w->bd, N, I, C);
	gpu_residual_forward(be, m->res[l + 1], a->res_mid, m->dln, (size_t)N * C);
}

td_err tr_model_forward(struct tr_model *m, const int32_t *ids, const int32_t *labels,
			double *loss_sum, int64_t *n_valid, struct td_errbuf *eb)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int B = m->plan.opts.B, T = m->plan.opts.T, N = B * T;
	const int C = c->hidden_size, V = c->vocab_size;

	/* Validate before anything runs: an id out of range would read outside
	 * the embedding on any backend. */
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
	gpu_upload(be, m->ids, ids, (size_t)N * sizeof(int32_t));
	gpu_upload(be, m->targets, m->host_targets, (size_t)N * sizeof(int32_t));

	gpu_embedding_forward(be, m->res[0], m->ids, m->embed, N, C);
	for (int l = 0; l < c->num_layers; l++)
		layer_forward(m, l);
	gpu_rmsnorm_forward(be, m->lnf_out, m->lnf_rstd, m->res[c->num_layers], m->lnf, N, C,
			    (float)c->rms_norm_eps);
	gpu_matmul_forward(be, m->logits, m->lnf_out, m->lm_head, NULL, N, C, V);
	gpu_crossentropy_forward(be, m->losses, m->logits, m->targets, N, V);
	gpu_download(be, m->host_losses, m->losses, (size_t)N * sizeof(float));
	td_err e = gpu_sync(be, eb);
	if (e != TD_OK)
		return e;
	double sum = 0;
	for (int i = 0; i < N; i++)
		sum += m->host_losses[i];
	if (!isfinite(sum))
		return td_fail(eb, TD_ENUMERIC, "forward: the loss is not finite (%g)", sum);
	m->logits_valid = true;
	*loss_sum = sum;
	*n_valid = valid;
	return TD_OK;
}

/* --- backward --- */

static void layer_backward(struct tr_model *m, int l)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int B = m->plan.opts.B, T = m->plan.opts.T, N = B * T;
	const int C = c->hidden_size, I = c->intermediate_size, NH = c->num_heads;
	const int NKV = c->num_kv_heads, HS = c->head_dim, H = NH * HS, KV = NKV * HS;
	const struct layer_w *w = &m->w[l];
	const struct layer_w *g = &m->g[l];
	const struct layer_a *a = &m->a[l];

	/* dres holds d(res[l+1]); it flows unchanged into d(res_mid) through the
	 * residual, and the MLP branch adds its part. */
	gpu_zero(be, m->dh, (size_t)N * I * sizeof(float));
	gpu_matmul_backward(be, m->dh, g->wd, g->bd, m->dres, a->h, w->wd, N, I, C);
	gpu_swiglu_backward(be, m->dgate, m->dup, m->dh, a->gate, a->up, (size_t)N * I);
	gpu_zero(be, m->dln, (size_t)N * C * sizeof(float));
	gpu_matmul_backward(be, m->dln, g->wg, g->bg, m->dgate, a->ln2, w->wg, N, C, I);
	gpu_matmul_backward(be, m->dln, g->wu, g->bu, m->dup, a->ln2, w->wu, N, C, I);
	gpu_rmsnorm_backward(be, m->dres, g->ln2, m->dln, a->res_mid, w->ln2, a->ln2_rstd, N, C);

	/* dres is now d(res_mid); same for the attention branch. */
	gpu_zero(be, m->dy, (size_t)N * H * sizeof(float));
	gpu_matmul_backward(be, m->dy, g->wo, g->bo, m->dres, a->y, w->wo, N, H, C);
	gpu_attention_backward(be, m->dq, m->dk, m->dv, m->datt, m->dy, a->q, a->k, a->v, a->att, B,
			       T, NH, NKV, HS);
	gpu_rope_backward(be, m->dq, m->dq, m->rope_cos, m->rope_sin, B, T, NH, HS);
	gpu_rope_backward(be, m->dk, m->dk, m->rope_cos, m->rope_sin, B, T, NKV, HS);
	const float *dqp = m->dq, *dkp = m->dk, *qin = a->ln1;
	if (c->qk_norm) {
		gpu_zero(be, m->dqraw, (size_t)N * H * sizeof(float));
		gpu_zero(be, m->dkraw, (size_t)N * KV * sizeof(float));
		gpu_rmsnorm_backward(be, m->dqraw, g->qn, m->dq, a->qraw, w->qn, a->q_rstd, N * NH, HS);
		gpu_rmsnorm_backward(be, m->dkraw, g->kn, m->dk, a->kraw, w->kn, a->k_rstd, N * NKV, HS);
		dqp = m->dqraw;
		dkp = m->dkraw;
	}
	gpu_zero(be, m->dln, (size_t)N * C * sizeof(float));
	gpu_matmul_backward(be, m->dln, g->wq, g->bq, dqp, qin, w->wq, N, C, H);
	gpu_matmul_backward(be, m->dln, g->wk, g->bk, dkp, qin, w->wk, N, C, KV);
	gpu_matmul_backward(be, m->dln, g->wv, g->bv, m->dv, qin, w->wv, N, C, KV);
	gpu_rmsnorm_backward(be, m->dres, g->ln1, m->dln, m->res[l], w->ln1, a->ln1_rstd, N, C);
}

void tr_model_backward(struct tr_model *m, float dloss)
{
	struct gpu_backend *be = m->be;
	const struct tr_model_config *c = &m->plan.cfg;
	const int N = m->plan.opts.B * m->plan.opts.T;
	const int C = c->hidden_size, V = c->vocab_size, L = c->num_layers;

	assert(m->logits_valid);
	/* Fused: the logits buffer becomes its own gradient. */
	gpu_crossentropy_backward(be, m->logits, m->logits, m->targets, dloss, N, V);
	m->logits_valid = false;
	gpu_zero(be, m->dln, (size_t)N * C * sizeof(float));
	gpu_matmul_backward(be, m->dln, m->dlm_head, NULL, m->logits, m->lnf_out, m->lm_head, N, C,
			    V);
	gpu_zero(be, m->dres, (size_t)N * C * sizeof(float));
	gpu_rmsnorm_backward(be, m->dres, m->dlnf, m->dln, m->res[L], m->lnf, m->lnf_rstd, N, C);
	for (int l = L - 1; l >= 0; l--)
		layer_backward(m, l);
	if (m->dembed)
		gpu_embedding_backward(be, m->dembed, m->dres, m->ids, N, C);
}

/* --- optimizer --- */

void tr_model_zero_grad(struct tr_model *m)
{
	gpu_zero(m->be, m->grads, m->plan.numel_trainable * sizeof(float));
}

double tr_model_grad_norm(struct tr_model *m)
{
	return sqrt(gpu_sumsq(m->be, m->grads, m->plan.numel_trainable));
}

double tr_model_clip_grads(struct tr_model *m, double max_norm)
{
	double norm = tr_model_grad_norm(m);
	if (max_norm > 0) {
		/* torch.nn.utils.clip_grad_norm_: coef = max / (norm + 1e-6), clamped to 1. */
		double coef = max_norm / (norm + 1e-6);
		if (coef < 1.0)
			gpu_scale(m->be, m->grads, (float)coef, m->plan.numel_trainable);
	}
	return norm;
}

void tr_model_adamw(struct tr_model *m, const struct tr_adamw *h, float lr, int t)
{
	const struct tr_plan *p = &m->plan;
	size_t nd = p->numel_decay, nt = p->numel_trainable;
	/* Trainable tensors sit in the arena decayed first (train/plan.c). */
	if (nd)
		gpu_adamw_update(m->be, m->params, m->grads, m->m1, m->m2, nd, lr, h->beta1,
				 h->beta2, h->eps, h->weight_decay, t);
	if (nt > nd)
		gpu_adamw_update(m->be, m->params + nd, m->grads + nd, m->m1 + nd, m->m2 + nd,
				 nt - nd, lr, h->beta1, h->beta2, h->eps, 0.0f, t);
}
