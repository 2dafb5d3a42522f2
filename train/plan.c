/* The memory plan: parameter table and arena layout from config × shape.
 *
 * Shape letters (kernels/cpu/ops.h): B, T, N = B*T, C hidden, I intermediate,
 * V vocab, NH, NKV heads, HS head size, H = NH*HS, KV = NKV*HS, L layers.
 * Every size is computed in size_t with overflow checks; the layout here is
 * the only place that decides where a buffer lives. */
#include "train/plan.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

const char *tr_arena_name(enum tr_arena a)
{
	static const char *names[TR_ARENA_COUNT] = {"params", "grads", "optim", "acts", "scratch"};
	return a < TR_ARENA_COUNT ? names[a] : "?";
}

const char *tr_fmt_bytes(char *buf, size_t len, uint64_t bytes)
{
	static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
	double v = (double)bytes;
	int u = 0;
	while (v >= 1024.0 && u < 4) {
		v /= 1024.0;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%" PRIu64 " B", bytes);
	else
		snprintf(buf, len, "%.2f %s", v, units[u]);
	return buf;
}

/* --- parameter table --- */

struct param_spec {
	const char *fmt; /* with %d for the layer, or a plain name */
	int rows, cols;  /* cols 0: a vector */
};

static td_err add_param(struct tr_plan *p, size_t *cap, const char *name, int rows, int cols,
			struct td_errbuf *eb)
{
	if (p->nparams == *cap) {
		size_t ncap = *cap ? *cap * 2 : 64;
		struct tr_param *np = realloc(p->params, ncap * sizeof(*np));
		if (!np)
			return td_fail(eb, TD_ENOMEM, "plan: out of memory");
		p->params = np;
		*cap = ncap;
	}
	struct tr_param *t = &p->params[p->nparams++];
	memset(t, 0, sizeof(*t));
	snprintf(t->name, sizeof(t->name), "%s", name);
	t->ndim = cols ? 2 : 1;
	t->shape[0] = rows;
	t->shape[1] = cols;
	t->numel = (size_t)rows * (size_t)(cols ? cols : 1);
	t->trainable = true;
	t->decay = t->ndim >= 2;
	return TD_OK;
}

static td_err build_params(struct tr_plan *p, struct td_errbuf *eb)
{
	const struct tr_model_config *c = &p->cfg;
	int C = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
	int H = c->num_heads * c->head_dim, KV = c->num_kv_heads * c->head_dim;
	size_t cap = 0;
	char name[96];
	td_err e;
#define ADD(nm, r, cl)                                                   \
	do {                                                             \
		if ((e = add_param(p, &cap, (nm), (r), (cl), eb)) != TD_OK) \
			return e;                                        \
	} while (0)
	ADD("model.embed_tokens.weight", V, C);
	for (int l = 0; l < c->num_layers; l++) {
		const struct param_spec specs[] = {
			{"model.layers.%d.input_layernorm.weight", C, 0},
			{"model.layers.%d.self_attn.q_proj.weight", H, C},
			{c->qkv_bias ? "model.layers.%d.self_attn.q_proj.bias" : NULL, H, 0},
			{"model.layers.%d.self_attn.k_proj.weight", KV, C},
			{c->qkv_bias ? "model.layers.%d.self_attn.k_proj.bias" : NULL, KV, 0},
			{"model.layers.%d.self_attn.v_proj.weight", KV, C},
			{c->qkv_bias ? "model.layers.%d.self_attn.v_proj.bias" : NULL, KV, 0},
			{"model.layers.%d.self_attn.o_proj.weight", C, H},
			{c->o_bias ? "model.layers.%d.self_attn.o_proj.bias" : NULL, C, 0},
			{c->qk_norm ? "model.layers.%d.self_attn.q_norm.weight" : NULL, c->head_dim, 0},
			{c->qk_norm ? "model.layers.%d.self_attn.k_norm.weight" : NULL, c->head_dim, 0},
			{"model.layers.%d.post_attention_layernorm.weight", C, 0},
			{"model.layers.%d.mlp.gate_proj.weight", I, C},
			{c->mlp_bias ? "model.layers.%d.mlp.gate_proj.bias" : NULL, I, 0},
			{"model.layers.%d.mlp.up_proj.weight", I, C},
			{c->mlp_bias ? "model.layers.%d.mlp.up_proj.bias" : NULL, I, 0},
			{"model.layers.%d.mlp.down_proj.weight", C, I},
			{c->mlp_bias ? "model.layers.%d.mlp.down_proj.bias" : NULL, C, 0},
		};
		for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++) {
			if (!specs[i].fmt)
				continue;
			snprintf(name, sizeof(name), specs[i].fmt, l);
			ADD(name, specs[i].rows, specs[i].cols);
		}
	}
	ADD("model.norm.weight", C, 0);
	if (!c->tie_word_embeddings)
		ADD("lm_head.weight", V, C);
#undef ADD

	/* Arena order: trainable decayed tensors, trainable undecayed, frozen. The
	 * optimizer then covers two contiguous ranges and the grads arena only the
	 * trainable prefix. */
	size_t off = 0;
	for (int pass = 0; pass < 3; pass++) {
		for (size_t i = 0; i < p->nparams; i++) {
			struct tr_param *t = &p->params[i];
			int group = !t->trainable ? 2 : t->decay ? 0 : 1;
			if (group != pass)
				continue;
			t->offset = off;
			t->goffset = t->trainable ? off : 0;
			off += t->numel;
		}
		if (pass == 0)
			p->numel_decay = off;
		if (pass == 1)
			p->numel_trainable = off;
	}
	p->numel_params = off;
	return TD_OK;
}

/* --- buffers --- */

static td_err add_buf(struct tr_plan *p, enum tr_arena a, const char *name, size_t bytes,
		      struct td_errbuf *eb)
{
	if (p->nbufs == p->capbufs) {
		size_t ncap = p->capbufs ? p->capbufs * 2 : 128;
		struct tr_plan_buf *nb = realloc(p->bufs, ncap * sizeof(*nb));
		if (!nb)
			return td_fail(eb, TD_ENOMEM, "plan: out of memory");
		p->bufs = nb;
		p->capbufs = ncap;
	}
	struct tr_plan_buf *b = &p->bufs[p->nbufs++];
	snprintf(b->name, sizeof(b->name), "%s", name);
	b->arena = a;
	b->offset = p->arena_bytes[a];
	b->bytes = bytes;
	size_t end = b->offset + ((bytes + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN) * TR_PLAN_ALIGN;
	if (end < b->offset)
		return td_fail(eb, TD_ERANGE, "plan: %s overflows", name);
	p->arena_bytes[a] = end;
	return TD_OK;
}

/* a*b*c*4 bytes with overflow detection (0 on overflow, which the callers reject). */
static size_t f32_bytes(size_t a, size_t b, size_t c)
{
	size_t r;
	if (__builtin_mul_overflow(a, b, &r) || __builtin_mul_overflow(r, c, &r) ||
	    __builtin_mul_overflow(r, (size_t)4, &r))
		return 0;
	return r;
}

td_err tr_plan_build(struct tr_plan *p, const struct tr_model_config *cfg,
		     const struct tr_plan_opts *o, struct td_errbuf *eb)
{
	memset(p, 0, sizeof(*p));
	p->cfg = *cfg;
	p->opts = *o;
	if (o->B < 1 || o->T < 2)
		return td_fail(eb, TD_EINVAL, "plan: batch %d and sequence length %d (need >= 1 and >= 2)",
			       o->B, o->T);
	td_err e = build_params(p, eb);
	if (e != TD_OK) {
		tr_plan_fini(p);
		return e;
	}

	const size_t B = (size_t)o->B, T = (size_t)o->T, N = B * T;
	const size_t C = (size_t)cfg->hidden_size, I = (size_t)cfg->intermediate_size;
	const size_t V = (size_t)cfg->vocab_size, NH = (size_t)cfg->num_heads;
	const size_t NKV = (size_t)cfg->num_kv_heads, HS = (size_t)cfg->head_dim;
	const size_t H = NH * HS, KV = NKV * HS;
	char nm[64];
	bool sizes_check = f32_bytes(B * NH, T, T) && f32_bytes(N, V, 1) && f32_bytes(N, I, 1);
	if (!sizes_check) {
		tr_plan_fini(p);
		return td_fail(eb, TD_ERANGE, "plan: batch %d x sequence %d is too large for this model",
			       o->B, o->T);
	}

#define BUF(arena, bytes)                                                  \
	do {                                                               \
		if ((e = add_buf(p, (arena), nm, (bytes), eb)) != TD_OK) { \
			tr_plan_fini(p);                                   \
			return e;                                          \
		}                                                          \
	} while (0)
#define NAMED(...) snprintf(nm, sizeof(nm), __VA_ARGS__)

	NAMED("params");
	BUF(TR_ARENA_PARAMS, f32_bytes(p->numel_params, 1, 1));
	NAMED("grads");
	BUF(TR_ARENA_GRADS, f32_bytes(p->numel_trainable, 1, 1));
	NAMED("optim.m");
	BUF(TR_ARENA_OPTIM, f32_bytes(p->numel_trainable, 1, 1));
	NAMED("optim.v");
	BUF(TR_ARENA_OPTIM, f32_bytes(p->numel_trainable, 1, 1));

	NAMED("acts.ids");
	BUF(TR_ARENA_ACTS, N * sizeof(int32_t));
	NAMED("acts.targets");
	BUF(TR_ARENA_ACTS, N * sizeof(int32_t));
	NAMED("acts.rope_cos");
	BUF(TR_ARENA_ACTS, f32_bytes(T, HS / 2, 1));
	NAMED("acts.rope_sin");
	BUF(TR_ARENA_ACTS, f32_bytes(T, HS / 2, 1));
	for (int l = 0; l <= cfg->num_layers; l++) {
		NAMED("acts.res.%d", l); /* residual stream entering layer l (l = L: leaving the last) */
		BUF(TR_ARENA_ACTS, f32_bytes(N, C, 1));
	}
	for (int l = 0; l < cfg->num_layers; l++) {
		const struct {
			const char *what;
			size_t bytes;
			bool on;
		} acts[] = {
			{"ln1", f32_bytes(N, C, 1), true},
			{"ln1_rstd", f32_bytes(N, 1, 1), true},
			{"qraw", f32_bytes(N, H, 1), cfg->qk_norm},
			{"q_rstd", f32_bytes(N, NH, 1), cfg->qk_norm},
			{"kraw", f32_bytes(N, KV, 1), cfg->qk_norm},
			{"k_rstd", f32_bytes(N, NKV, 1), cfg->qk_norm},
			{"q", f32_bytes(N, H, 1), true},
			{"k", f32_bytes(N, KV, 1), true},
			{"v", f32_bytes(N, KV, 1), true},
			{"att", f32_bytes(B * NH, T, T), true},
			{"y", f32_bytes(N, H, 1), true},
			{"res_mid", f32_bytes(N, C, 1), true},
			{"ln2", f32_bytes(N, C, 1), true},
			{"ln2_rstd", f32_bytes(N, 1, 1), true},
			{"gate", f32_bytes(N, I, 1), true},
			{"up", f32_bytes(N, I, 1), true},
			{"h", f32_bytes(N, I, 1), true},
		};
		for (size_t i = 0; i < sizeof(acts) / sizeof(acts[0]); i++) {
			if (!acts[i].on)
				continue;
			NAMED("acts.layers.%d.%s", l, acts[i].what);
			BUF(TR_ARENA_ACTS, acts[i].bytes);
		}
	}
	NAMED("acts.lnf");
	BUF(TR_ARENA_ACTS, f32_bytes(N, C, 1));
	NAMED("acts.lnf_rstd");
	BUF(TR_ARENA_ACTS, f32_bytes(N, 1, 1));

	/* Scratch: shared by every layer, reused forward and backward. */
	const struct {
		const char *what;
		size_t bytes;
		bool on;
	} scratch[] = {
		{"logits", f32_bytes(N, V, 1), true}, /* the CE gradient overwrites it in place */
		{"losses", f32_bytes(N, 1, 1), true},
		{"dres", f32_bytes(N, C, 1), true},
		{"dln", f32_bytes(N, C, 1), true}, /* also the forward's projection output */
		{"dq", f32_bytes(N, H, 1), true},
		{"dk", f32_bytes(N, KV, 1), true},
		{"dv", f32_bytes(N, KV, 1), true},
		{"dqraw", f32_bytes(N, H, 1), cfg->qk_norm},
		{"dkraw", f32_bytes(N, KV, 1), cfg->qk_norm},
		{"dy", f32_bytes(N, H, 1), true},
		{"datt", f32_bytes(B * NH, T, T), true},
		{"dh", f32_bytes(N, I, 1), true},
		{"dgate", f32_bytes(N, I, 1), true},
		{"dup", f32_bytes(N, I, 1), true},
	};
	for (size_t i = 0; i < sizeof(scratch) / sizeof(scratch[0]); i++) {
		if (!scratch[i].on)
			continue;
		NAMED("scratch.%s", scratch[i].what);
		BUF(TR_ARENA_SCRATCH, scratch[i].bytes);
	}
#undef BUF
#undef NAMED
	return TD_OK;
}

void tr_plan_fini(struct tr_plan *p)
{
	free(p->params);
	free(p->bufs);
	p->params = NULL;
	p->bufs = NULL;
	p->nparams = p->nbufs = p->capbufs = 0;
}

size_t tr_plan_total_bytes(const struct tr_plan *p)
{
	size_t t = 0;
	for (int a = 0; a < TR_ARENA_COUNT; a++)
		t += p->arena_bytes[a];
	return t;
}

const struct tr_plan_buf *tr_plan_find(const struct tr_plan *p, const char *name)
{
	for (size_t i = 0; i < p->nbufs; i++)
		if (strcmp(p->bufs[i].name, name) == 0)
			return &p->bufs[i];
	return NULL;
}

const struct tr_param *tr_plan_param(const struct tr_plan *p, const char *name)
{
	for (size_t i = 0; i < p->nparams; i++)
		if (strcmp(p->params[i].name, name) == 0)
			return &p->params[i];
	return NULL;
}

void tr_plan_print(const struct tr_plan *p, FILE *f)
{
	const struct tr_model_config *c = &p->cfg;
	char b1[32], b2[32];
	fprintf(f, "model      %s: L=%d C=%d I=%d V=%d heads=%d kv_heads=%d head_dim=%d%s\n",
		c->model_type, c->num_layers, c->hidden_size, c->intermediate_size, c->vocab_size,
		c->num_heads, c->num_kv_heads, c->head_dim, c->tie_word_embeddings ? " tied" : "");
	fprintf(f, "shape      micro-batch %d x sequence %d = %d tokens\n", p->opts.B, p->opts.T,
		p->opts.B * p->opts.T);
	fprintf(f, "parameters %zu (%zu trainable, %zu with weight decay)\n", p->numel_params,
		p->numel_trainable, p->numel_decay);
	for (int a = 0; a < TR_ARENA_COUNT; a++) {
		size_t n = 0, largest = 0;
		const char *lname = "";
		for (size_t i = 0; i < p->nbufs; i++) {
			if (p->bufs[i].arena != (enum tr_arena)a)
				continue;
			n++;
			if (p->bufs[i].bytes > largest) {
				largest = p->bufs[i].bytes;
				lname = p->bufs[i].name;
			}
		}
		fprintf(f, "arena %-8s %12s  (%zu buffers; largest %s, %s)\n", tr_arena_name(a),
			tr_fmt_bytes(b1, sizeof(b1), p->arena_bytes[a]), n, lname,
			tr_fmt_bytes(b2, sizeof(b2), largest));
	}
	size_t total = tr_plan_total_bytes(p);
	fprintf(f, "total      %s (%zu bytes)\n", tr_fmt_bytes(b1, sizeof(b1), total), total);
}
