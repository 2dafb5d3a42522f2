/* The memory plan: parameter table and arena layout from config × shape.
 *
 * Shape letters (kernels/cpu/ops.h): B, T, N = B*T, C hidden, I intermediate,
 * V vocab, NH, NKV heads, HS head size, H = NH*HS, KV = NKV*HS, L layers.
 * Every size is computed in size_t with overflow checks; the layout here is
 * the only place that decides where a buffer lives. */
#include "train/plan.h"

#include "gpu/backend.h"

#include <assert.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static void copy16_ring(struct tr_plan *p, const struct tr_plan_opts *o);
static size_t copy16_numel(const struct tr_plan *p);

const char *tr_arena_name(enum tr_arena a)
{
	static const char *names[TR_ARENA_ALL] = {"params", "base", "grads", "optim", "acts", "scratch", "host"};
	return a < TR_ARENA_ALL ? names[a] : "?";
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

static const char *const lin_names[TR_LIN_COUNT] = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
						     "gate_proj", "up_proj", "down_proj"};
static const char *const lin_paths[TR_LIN_COUNT] = {
	"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
	"mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

const char *tr_lin_name(int lin)
{
	return lin >= 0 && lin < TR_LIN_COUNT ? lin_names[lin] : NULL;
}

const char *tr_lin_path(int lin)
{
	return lin >= 0 && lin < TR_LIN_COUNT ? lin_paths[lin] : NULL;
}

int tr_lin_from_name(const char *name)
{
	for (int i = 0; name && i < TR_LIN_COUNT; i++)
		if (strcmp(name, lin_names[i]) == 0)
			return i;
	return -1;
}

void tr_lin_dims(const struct tr_model_config *c, int lin, int *in, int *out)
{
	int C = c->hidden_size, I = c->intermediate_size;
	int H = c->num_heads * c->head_dim, KV = c->num_kv_heads * c->head_dim;
	static const int in_is[TR_LIN_COUNT] = {0, 0, 0, 1, 0, 0, 2};  /* 0 C, 1 H, 2 I */
	static const int out_is[TR_LIN_COUNT] = {1, 3, 3, 0, 2, 2, 0}; /* 3 KV */
	const int dims[4] = {C, H, I, KV};
	*in = dims[in_is[lin]];
	*out = dims[out_is[lin]];
}

struct param_spec {
	const char *fmt; /* with %d for the layer, or a plain name */
	int rows, cols;  /* cols 0: a vector */
	int lin;         /* the projection, or -1 */
};

static td_err add_param(struct tr_plan *p, size_t *cap, const char *name, int rows, int cols,
			enum tr_param_kind kind, int layer, int lin, struct td_errbuf *eb)
{
	if (p->nparams == *cap) {
		size_t ncap = *cap ? *cap * 2 : 64;
		struct tr_param *np = realloc(p->params, ncap * sizeof(*np));
		if (!np)
			return td_fail(eb, TD_ENOMEM, "plan: out of memory");
		p->params = np;
		*cap = ncap;
	}
	const struct tr_plan_opts *o = &p->opts;
	struct tr_param *t = &p->params[p->nparams++];
	memset(t, 0, sizeof(*t));
	snprintf(t->name, sizeof(t->name), "%s", name);
	t->ndim = cols ? 2 : 1;
	t->shape[0] = rows;
	t->shape[1] = cols;
	t->numel = (size_t)rows * (size_t)(cols ? cols : 1);
	t->kind = kind;
	t->layer = layer;
	t->lin = lin;
	/* LoRA freezes the base; the head and the adapters train. */
	t->trainable = !o->inference && !(kind == TR_P_BASE && o->lora_rank > 0);
	t->decay = t->trainable && t->ndim >= 2;
	t->nf4 = !t->trainable && kind == TR_P_BASE && lin >= 0 && t->ndim == 2 &&
		 o->base_quant == TR_QUANT_NF4;
	t->bf16 = !t->trainable && t->ndim == 2 && !t->nf4 && o->frozen_bf16;
	return TD_OK;
}

static size_t max_sz(size_t a, size_t b);

static td_err build_params(struct tr_plan *p, struct td_errbuf *eb)
{
	const struct tr_model_config *c = &p->cfg;
	const struct tr_plan_opts *o = &p->opts;
	int C = c->hidden_size, I = c->intermediate_size, V = c->vocab_size;
	int H = c->num_heads * c->head_dim, KV = c->num_kv_heads * c->head_dim;
	size_t cap = 0;
	char name[96];
	td_err e;
#define ADD(nm, r, cl, kind, layer, lin)                                                   \
	do {                                                                                \
		if ((e = add_param(p, &cap, (nm), (r), (cl), (kind), (layer), (lin), eb)) != TD_OK) \
			return e;                                                           \
	} while (0)
	ADD("model.embed_tokens.weight", V, C, TR_P_BASE, -1, -1);
	for (int l = 0; l < c->num_layers; l++) {
		const struct param_spec specs[] = {
			{"model.layers.%d.input_layernorm.weight", C, 0, -1},
			{"model.layers.%d.self_attn.q_proj.weight", H, C, TR_LIN_Q},
			{c->qkv_bias ? "model.layers.%d.self_attn.q_proj.bias" : NULL, H, 0, TR_LIN_Q},
			{"model.layers.%d.self_attn.k_proj.weight", KV, C, TR_LIN_K},
			{c->qkv_bias ? "model.layers.%d.self_attn.k_proj.bias" : NULL, KV, 0, TR_LIN_K},
			{"model.layers.%d.self_attn.v_proj.weight", KV, C, TR_LIN_V},
			{c->qkv_bias ? "model.layers.%d.self_attn.v_proj.bias" : NULL, KV, 0, TR_LIN_V},
			{"model.layers.%d.self_attn.o_proj.weight", C, H, TR_LIN_O},
			{c->o_bias ? "model.layers.%d.self_attn.o_proj.bias" : NULL, C, 0, TR_LIN_O},
			{c->qk_norm ? "model.layers.%d.self_attn.q_norm.weight" : NULL, c->head_dim, 0, -1},
			{c->qk_norm ? "model.layers.%d.self_attn.k_norm.weight" : NULL, c->head_dim, 0, -1},
			{"model.layers.%d.post_attention_layernorm.weight", C, 0, -1},
			{"model.layers.%d.mlp.gate_proj.weight", I, C, TR_LIN_GATE},
			{c->mlp_bias ? "model.layers.%d.mlp.gate_proj.bias" : NULL, I, 0, TR_LIN_GATE},
			{"model.layers.%d.mlp.up_proj.weight", I, C, TR_LIN_UP},
			{c->mlp_bias ? "model.layers.%d.mlp.up_proj.bias" : NULL, I, 0, TR_LIN_UP},
			{"model.layers.%d.mlp.down_proj.weight", C, I, TR_LIN_DOWN},
			{c->mlp_bias ? "model.layers.%d.mlp.down_proj.bias" : NULL, C, 0, TR_LIN_DOWN},
		};
		for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++) {
			if (!specs[i].fmt)
				continue;
			snprintf(name, sizeof(name), specs[i].fmt, l);
			ADD(name, specs[i].rows, specs[i].cols, TR_P_BASE, l, specs[i].lin);
		}
		/* PEFT's adapters, by the names its adapter_model.safetensors uses. */
		for (int lin = 0; o->lora_rank > 0 && lin < TR_LIN_COUNT; lin++) {
			if (!(o->lora_targets & (1u << lin)))
				continue;
			int in, out;
			tr_lin_dims(c, lin, &in, &out);
			snprintf(name, sizeof(name), "base_model.model.model.layers.%d.%s.lora_A.weight", l,
				 lin_paths[lin]);
			ADD(name, o->lora_rank, in, TR_P_LORA_A, l, lin);
			snprintf(name, sizeof(name), "base_model.model.model.layers.%d.%s.lora_B.weight", l,
				 lin_paths[lin]);
			ADD(name, out, o->lora_rank, TR_P_LORA_B, l, lin);
		}
	}
	ADD("model.norm.weight", C, 0, TR_P_BASE, -1, -1);
	if (o->num_labels > 0)
		ADD("score.weight", o->num_labels, C, TR_P_HEAD, -1, -1);
	else if (!c->tie_word_embeddings)
		ADD("lm_head.weight", V, C, TR_P_BASE, -1, -1);
#undef ADD

	/* Arena order: trainable decayed tensors, trainable undecayed, frozen. The
	 * optimizer then covers two contiguous ranges and the grads arena only the
	 * trainable prefix. NF4 and bf16 tensors have no fp32 copy: they live in
	 * the nf4.* buffers, each tensor's blocks starting afresh, and in
	 * params16, in the table's order. */
	size_t off = 0;
	for (int pass = 0; pass < 3; pass++) {
		for (size_t i = 0; i < p->nparams; i++) {
			struct tr_param *t = &p->params[i];
			int group = !t->trainable ? 2 : t->decay ? 0 : 1;
			if (group != pass || t->nf4 || t->bf16)
				continue;
			/* A frozen tensor's offset is into base.f32, which
			 * follows the trainable prefix. */
			t->offset = pass == 2 ? off - p->numel_trainable : off;
			t->goffset = t->trainable ? off : 0;
			off += t->numel;
		}
		if (pass == 0)
			p->numel_decay = off;
		if (pass == 1) {
			p->numel_trainable = off;
			p->numel_trainable_padded = p->shard_numel = p->shard_hi = off;
			p->shard_lo = 0;
			if (o->shard != TR_SHARD_NONE && o->shard_ranks > 1) {
				size_t n = (size_t)o->shard_ranks, r = (size_t)o->shard_rank;
				p->shard_numel = (off + n - 1) / n;
				p->numel_trainable_padded = p->shard_numel * n;
				size_t lo = r * p->shard_numel, hi = lo + p->shard_numel;
				p->shard_lo = lo < off ? lo : off;
				p->shard_hi = hi < off ? hi : off;
			}
		}
	}
	p->numel_f32 = off;
	/* GRADIENTS: each trainable tensor's place in the work buffers the
	 * backward writes (train/plan.h: tr_param.gslot), visited in goffset
	 * order (the passes above), so that a layer's decayed tensors and its
	 * undecayed ones are each one run of its slot and of the arena. */
	for (size_t i = 0; i < p->nparams; i++) {
		p->params[i].gslot = -1;
		p->params[i].gunit = -1;
		p->params[i].wslot = -1;
		p->params[i].wunit = -1;
	}
	const struct tr_param *emb = tr_plan_param(p, "model.embed_tokens.weight");
	p->embed_rows = o->shard_ranks > 1 && emb && emb->trainable && !o->inference;
	/* the embedding is no GEMM's operand: its gradient and (PARAMETERS)
	 * its lookup go by rows alone (train/plan.h: embed_rows) */
	const bool emb_gemm = p->cfg.tie_word_embeddings && o->num_labels == 0; /* the LM head too */
	const bool emb_apart = p->embed_rows && !emb_gemm;
	p->embed_lookup_rows = emb_apart && tr_shard_params(o->shard, o->shard_ranks);
	/* read in fp32 only, by the lookup, unless it is the LM head too */
	p->copy16_lo = emb && emb->trainable && emb->offset == 0 && !emb_gemm ? emb->numel : 0;
	copy16_ring(p, o);
	p->masters_part = tr_shard_grads(o->shard, o->shard_ranks) &&
			  !tr_shard_params(o->shard, o->shard_ranks) && o->gemm_bf16 && !o->inference &&
			  o->lora_rank == 0 && o->num_labels == 0 && !p->copy16_ring;
	p->embed_lookup_rows |= p->masters_part && p->embed_rows;
	/* the untied embedding's gradient by rows (train/plan.h: emb_slots) */
	p->emb_slots = p->grads_lo = 0;
	{
		const size_t rows = (size_t)o->B * (size_t)o->T * (size_t)(o->grad_accum > 0 ? o->grad_accum : 0);
		if (!o->inference && p->copy16_lo && !p->embed_rows && o->shard_ranks <= 1 &&
		    rows > 0 && rows < (size_t)p->cfg.vocab_size && !emb->nf4 && !emb->bf16) {
			p->emb_slots = rows;
			p->grads_lo = emb->numel;
		}
	}
	if (tr_shard_grads(o->shard, o->shard_ranks)) {
		const int L = p->cfg.num_layers;
		/* Units: layer l's halves units 2l and 2l + 1; the head's, the
		 * final norm's and a tied embedding's unit 2L (gathered: unit L),
		 * from the start of grads.rest; an untied embedding's none (by
		 * rows). [0, 2L + 2): the gradients' units; [2L + 2, 3L + 4): the
		 * gathers' (layer l's at 2L + 2 + l), bf16 then fp32 */
		const size_t nu = 2 * (size_t)L + 2, nw = (size_t)L + 2;
		size_t *used = calloc(nu + 2 * nw, sizeof(size_t));
		if (!used)
			return td_fail(eb, TD_ENOMEM, "plan: out of memory");
		size_t *w16 = used + nu, *w32 = w16 + nw;
		for (int pass = 0; pass < 2; pass++)
			for (size_t i = 0; i < p->nparams; i++) {
				struct tr_param *t = &p->params[i];
				if (!t->trainable || (t->decay ? 0 : 1) != pass || (emb_apart && t == emb))
					continue;
				const int u = t->layer >= 0 ? 2 * t->layer + tr_plan_mlp_half(t) : 2 * L;
				t->gunit = u;
				t->gslot = t->layer >= 0 ? u % TR_GRAD_RING : TR_GRAD_RING;
				t->gsoff = used[u];
				used[u] += t->numel;
				const int w = t->layer >= 0 ? t->layer : L;
				t->wunit = w;
				t->wslot = t->layer >= 0 ? t->layer % TR_GRAD_RING : TR_GRAD_RING;
				t->w16off = w16[w];
				w16[w] += t->numel;
			}
		for (int u = 0; u < 2 * L; u++) /* each slot: the largest of its units */
			if (used[u] > p->grad_slot_numel[u % TR_GRAD_RING])
				p->grad_slot_numel[u % TR_GRAD_RING] = used[u];
		p->grad_slot_numel[TR_GRAD_RING] = used[2 * L];
		p->grad_units = 2 * L + 1;
		/* PARAMETERS: the gathered copies' slots, per layer; the fp32
		 * ones packed over the tensors gathered in fp32 */
		for (int pass = 0; tr_shard_params(o->shard, o->shard_ranks) && pass < 2; pass++)
			for (size_t i = 0; i < p->nparams; i++) {
				struct tr_param *t = &p->params[i];
				if (!t->trainable || (t->decay ? 0 : 1) != pass || t->gunit < 0 ||
				    tr_plan_gathered16(p, t))
					continue;
				t->wsoff = w32[t->wunit];
				w32[t->wunit] += t->numel;
				p->wslot_numel[t->wslot] = max_sz(p->wslot_numel[t->wslot], w32[t->wunit]);
			}
		for (int w = 0; tr_shard_params(o->shard, o->shard_ranks) && w < L + 2; w++) {
			const int k = w < L ? w % TR_GRAD_RING : TR_GRAD_RING;
			p->wslot16_numel[k] = max_sz(p->wslot16_numel[k], w16[w]);
		}
		free(used);
	}
	size_t codes = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		struct tr_param *t = &p->params[i];
		p->numel_params += t->numel;
		if (!t->trainable)
			p->numel_frozen += t->numel;
		if (t->bf16) {
			t->offset = p->numel_bf16;
			p->numel_bf16 += t->numel;
			if (t->numel > p->bf16_max_numel)
				p->bf16_max_numel = t->numel;
		}
		if (!t->nf4)
			continue;
		size_t nb = (t->numel + TR_NF4_BLOCK - 1) / TR_NF4_BLOCK;
		t->q_codes = codes;
		t->q_blocks = p->nf4_blocks;
		t->q_scales = p->nf4_scales;
		codes += (t->numel + 1) / 2;
		p->nf4_blocks += nb;
		p->nf4_scales += (nb + TR_NF4_DQ_BLOCK - 1) / TR_NF4_DQ_BLOCK + 1;
		p->nf4_numel += t->numel;
		if (t->numel > p->nf4_max_numel)
			p->nf4_max_numel = t->numel;
	}
	p->nf4_bytes = codes + (o->nf4_double_quant ? p->nf4_blocks + p->nf4_scales * sizeof(float)
						    : p->nf4_blocks * sizeof(float));
	if (!o->nf4_double_quant)
		p->nf4_scales = 0;
	p->frozen_bytes = (p->numel_frozen - p->nf4_numel - p->numel_bf16) * sizeof(float) +
			  p->numel_bf16 * sizeof(uint16_t) + p->nf4_bytes;
	return TD_OK;
}

/* The method options against the config, before any size is computed. */
static td_err check_opts(const struct tr_plan_opts *o, const struct tr_model_config *c,
			 struct td_errbuf *eb)
{
	if (o->lora_rank < 0)
		return td_fail(eb, TD_EINVAL, "plan: lora rank %d is negative", o->lora_rank);
	if ((unsigned)o->shard >= TR_SHARD_BUILT)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "plan: unknown sharding %d", (int)o->shard);
	if (o->grad_accum < 0)
		return td_fail(eb, TD_EINVAL, "plan: grad_accum %d", o->grad_accum);
	if (o->mlp_rows < 0 || o->mlp_rows % 8)
		return td_fail(eb, TD_EINVAL, "plan: the MLP's parts of %d rows (a multiple of 8)",
			       o->mlp_rows);
	if (o->shard_ranks < 0 || (o->shard_ranks > 1 && (o->shard_rank < 0 || o->shard_rank >= o->shard_ranks)))
		return td_fail(eb, TD_EINVAL, "plan: shard rank %d of %d", o->shard_rank, o->shard_ranks);
	if (o->lora_rank > 0) {
		if (!o->lora_targets || o->lora_targets >> TR_LIN_COUNT)
			return td_fail(eb, TD_EINVAL, "plan: LoRA needs target modules among q_proj, k_proj, "
				       "v_proj, o_proj, gate_proj, up_proj, down_proj");
		if (!(o->lora_alpha > 0) || !isfinite(o->lora_alpha))
			return td_fail(eb, TD_EINVAL, "plan: lora alpha %g must be > 0", o->lora_alpha);
		if (!(o->lora_dropout >= 0.0f && o->lora_dropout < 1.0f))
			return td_fail(eb, TD_EINVAL, "plan: lora dropout %g is outside [0, 1)",
				       (double)o->lora_dropout);
		for (int lin = 0; lin < TR_LIN_COUNT; lin++) {
			int in, out;
			tr_lin_dims(c, lin, &in, &out);
			int small = in < out ? in : out;
			if ((o->lora_targets & (1u << lin)) && o->lora_rank > small)
				return td_fail(eb, TD_EINVAL,
					       "plan: lora rank %d exceeds %s's smaller dimension %d "
					       "(%d -> %d) in this %s model",
					       o->lora_rank, lin_names[lin], small, in, out, c->model_type);
		}
	}
	if (o->base_quant == TR_QUANT_NF4 && !(o->lora_rank > 0 || o->inference))
		return td_fail(eb, TD_EINVAL, "plan: NF4 weights must be frozen: QLoRA (a LoRA rank) or a "
			       "forward-only model (a teacher), not full fine-tuning");
	if (o->base_quant != TR_QUANT_NONE && o->base_quant != TR_QUANT_NF4)
		return td_fail(eb, TD_EINVAL, "plan: unknown weight storage %d", (int)o->base_quant);
	if (o->num_labels < 0 || (o->num_labels > 0 && o->num_labels < 2))
		return td_fail(eb, TD_EINVAL, "plan: %d labels (a classifier needs >= 2)", o->num_labels);
	if (o->num_labels > 0 && o->distill)
		return td_fail(eb, TD_EINVAL, "plan: distillation trains a causal LM, not a classifier");
	if ((unsigned)o->recompute >= TR_RECOMPUTE_COUNT)
		return td_fail(eb, TD_EINVAL, "plan: unknown recompute policy %d", (int)o->recompute);
	if (o->selective_layers < 0 || o->selective_layers > c->num_layers)
		return td_fail(eb, TD_EINVAL,
			       "plan: %d selective layers (memory.selective_layers: 0 to the model's %d)",
			       o->selective_layers, c->num_layers);
	if (o->inference && o->distill)
		return td_fail(eb, TD_EINVAL, "plan: a distillation student trains; it is not forward-only");
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

/* Bytes rounded up to TR_PLAN_ALIGN, as add_buf places buffers. */
static size_t aligned(size_t bytes)
{
	return (bytes + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
}

/* A buffer inside one the plan already placed (a region that buffers whose
 * lifetimes never overlap share): bytes at offset, the arena unchanged. */
static td_err add_view(struct tr_plan *p, enum tr_arena a, const char *name, size_t offset,
		       size_t bytes, struct td_errbuf *eb)
{
	size_t end = p->arena_bytes[a];
	td_err e = add_buf(p, a, name, bytes, eb);
	if (e != TD_OK)
		return e;
	p->bufs[p->nbufs - 1].offset = offset;
	assert(offset + bytes <= end);
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

static size_t max_sz(size_t a, size_t b)
{
	return a > b ? a : b;
}

static size_t min_sz(size_t a, size_t b)
{
	return a < b ? a : b;
}

/* Rows a chunk when N rows are split evenly over the chunks of at most
 * `most` rows they take: a multiple of 8 (each chunk's rows start 16-byte
 * aligned), at most N. */
static size_t even_rows(size_t N, size_t most)
{
	const size_t chunks = (N + most - 1) / most;
	return min_sz(((N + chunks - 1) / chunks + 7) / 8 * 8, N);
}

/* A chunk of logits: rows of V, lsz bytes each (4, or 2 in bf16); 0 where
 * that overflows, as f32_bytes. */
static size_t logits_bytes(size_t rows, size_t V, size_t lsz)
{
	return f32_bytes(rows, V, 1) / 4 * lsz;
}

/* bf16 elements of the GEMM operand scratch (scratch.gemm_bf16) that the
 * products of train/model.c need in the bf16 mode: the most any one call
 * rounds (gpu/backend.h: gpu_matmul_scratch_elems), with the twins each call
 * has. Every weight comes with one (a trainable weight's bf16 copy, a frozen
 * one's bf16 storage, an NF4 one dequantized to bf16), and so do the
 * projections' inputs (ln1_16, y16, ln2_16, h16), the MLP's gradients
 * (dgate16, dup16) and the causal head's (bf16 logits, their gradient over
 * them: tr_plan.logits16). What is rounded: the
 * attention's and the down projection's gradients (fp32), LoRA's x A^T and
 * its gradient, the adapters' dropped-out inputs, the final norm's output
 * for the head and a distillation student's logits gradient. Plus the
 * fused attention's bf16 copies (of dout only: it is given q, k and v in
 * bf16, qkv16 below). */
static size_t gemm_scratch_elems(const struct tr_plan *p)
{
	const struct tr_model_config *c = &p->cfg;
	const struct tr_plan_opts *o = &p->opts;
	const size_t B = (size_t)o->B, N = B * (size_t)o->T, R = (size_t)o->lora_rank;
	const size_t C = (size_t)c->hidden_size, V = (size_t)c->vocab_size;
	const size_t NL = (size_t)o->num_labels, rows = (size_t)p->logits_rows;
	const bool train = !o->inference, drop = R && o->lora_dropout > 0.0f;
	size_t g = 0;
#define FWD(n, in, out, x16) \
	g = max_sz(g, gpu_matmul_scratch_elems((n), (in), (out), false, false, false, true, (x16), false))
#define BWD(n, in, out, dinp, dw, x16, d16) \
	g = max_sz(g, gpu_matmul_scratch_elems((n), (in), (out), true, (dinp), (dw), true, (x16), (d16)))
	for (int lin = 0; lin < TR_LIN_COUNT; lin++) {
		int in_, out_;
		tr_lin_dims(c, lin, &in_, &out_);
		const size_t in = (size_t)in_, out = (size_t)out_;
		const bool d16 = lin == TR_LIN_GATE || lin == TR_LIN_UP;
		/* the MLP's backward by parts of plan.mlp_rows rows */
		const size_t nb = lin == TR_LIN_GATE || lin == TR_LIN_UP || lin == TR_LIN_DOWN
					  ? (size_t)p->mlp_rows : N;
		FWD(N, in, out, true);
		if (train)
			BWD(nb, in, out, true, !R, true, d16);
		if (!R || !(o->lora_targets & (1u << lin)))
			continue;
		FWD(N, in, R, !drop);   /* u = x A^T */
		FWD(N, R, out, false);  /* u B^T */
		if (!train)
			continue;
		BWD(N, R, out, true, true, false, d16); /* du, dB */
		BWD(N, in, R, true, true, !drop, false); /* dx, dA */
	}
	if (NL > 0) {
		FWD(B, C, NL, false);
		if (train)
			BWD(B, C, NL, true, true, false, false);
	} else {
		FWD(rows, C, V, false);
		const struct tr_param *head =
			tr_plan_param(p, c->tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
		if (train)
			BWD(rows, C, V, true, head && head->trainable, false, !o->distill);
	}
#undef FWD
#undef BWD
	if (o->attention_lse) /* the fused attention's bf16 copies */
		g = max_sz(g, gpu_flash_scratch_bytes(o->B, o->T, c->num_heads, c->num_kv_heads,
						      c->head_dim, o->gemm_bf16) / 2);
	return g;
}

/* --- the schedule --- */

const char *tr_recompute_name(enum tr_recompute r)
{
	static const char *const names[TR_RECOMPUTE_COUNT] = {"none", "selective", "full",
								 "full-offload"};
	return (unsigned)r < TR_RECOMPUTE_COUNT ? names[r] : "?";
}

const char *tr_shard_name(enum tr_shard s)
{
	static const char *const names[TR_SHARD_COUNT] = {"none", "optimizer", "gradients",
							     "parameters"};
	return (unsigned)s < TR_SHARD_COUNT ? names[s] : "?";
}

const char *tr_stage_name(enum tr_stage_kind k)
{
	static const char *const names[TR_STAGE_KIND_COUNT] = {
		"embed",    "layer",           "final_norm",     "head",           "head_backward",
		"final_norm_backward", "layer_recompute", "layer_backward", "embed_backward", "optimizer",
		"offload",  "prefetch",        "offload_attention", "prefetch_attention",
		"layer_backward_mlp"};
	return k < TR_STAGE_KIND_COUNT ? names[k] : "?";
}

static td_err add_stage(struct tr_plan *p, size_t *cap, enum tr_stage_kind kind, int layer, int r0,
			int rows, struct td_errbuf *eb)
{
	if (p->nstages == *cap) {
		size_t ncap = *cap ? *cap * 2 : 64;
		struct tr_stage *ns = realloc(p->stages, ncap * sizeof(*ns));
		if (!ns)
			return td_fail(eb, TD_ENOMEM, "plan: out of memory");
		p->stages = ns;
		*cap = ncap;
	}
	p->stages[p->nstages++] = (struct tr_stage){.kind = kind, .layer = layer, .r0 = r0, .rows = rows};
	return TD_OK;
}

/* The least forward FLOPs a layer does per byte FULL_OFFLOAD copies out of
 * it for the attention's output to go too: the copies take the layer's
 * forward time only where they keep up. Measured: pinned copies at 55 GB/s
 * each way (H100 and H200, PCIe 5), large bf16 GEMMs at ~600 TFLOP/s:
 * ~11k FLOP a byte. Llama-3-8B at B4 x T2048 does 10.6k (3.57 TFLOP a
 * layer for 128 MiB of input and 193 MiB of attention output, y in fp32
 * then; 17.7k with y16 alone, 65 MiB) and gained;
 * Qwen2-0.5B at B8 x T1024 does 3.3k and lost 7% of its tokens/s (H200). */
#define TR_OFFLOAD_MIN_FLOP_PER_BYTE 8192.0

bool tr_plan_gathered16(const struct tr_plan *p, const struct tr_param *t)
{
	return tr_shard_params(p->opts.shard, p->opts.shard_ranks) && p->opts.gemm_bf16 &&
	       t->trainable && t->ndim == 2 && strcmp(t->name, "model.embed_tokens.weight") != 0;
}

bool tr_plan_mlp_half(const struct tr_param *t)
{
	const size_t n = strlen(t->name), k = strlen("post_attention_layernorm.weight");
	return t->layer >= 0 &&
	       (t->lin == TR_LIN_GATE || t->lin == TR_LIN_UP || t->lin == TR_LIN_DOWN ||
		(n >= k && strcmp(t->name + n - k, "post_attention_layernorm.weight") == 0));
}

bool tr_plan_dw_overwritten(const struct tr_plan *p, const struct tr_param *t)
{
	if (!t->trainable || t->kind != TR_P_BASE || t->ndim != 2)
		return false;
	/* The causal head's weight (a tied embedding's, whose lookup's
	 * scatter comes after the head's products in every step, or goes by
	 * rows in a gang: embed_rows): its first chunk's product overwrites
	 * the gradient arena's floats (unsharded) or its floats of grads.rest
	 * (GRADIENTS: each micro-batch's, reduced from there onto the
	 * owners). */
	if (t->layer < 0)
		return !p->opts.inference && p->opts.num_labels == 0 &&
		       t == tr_plan_param(p, p->cfg.tie_word_embeddings ? "model.embed_tokens.weight"
									 : "lm_head.weight");
	if (t->lin < 0)
		return false;
	return tr_shard_grads(p->opts.shard, p->opts.shard_ranks)
		       ? t->gslot >= 0 && t->gslot < TR_GRAD_RING
		       : t->gslot < 0;
}

bool tr_plan_attention_y32(const struct tr_plan_opts *o)
{
	return !o->attention_lse || !o->gemm_bf16 || (o->lora_rank && o->lora_dropout > 0.0f);
}

bool tr_plan_offloads_attention(const struct tr_model_config *cfg, const struct tr_plan_opts *o)
{
	/* The set takes a ring slot more than FULL's one working copy; the
	 * layer inputs free L + 1 - RING slots of FULL's. FULL_OFFLOAD stays
	 * below FULL on the device: only where those outweigh the slot, and
	 * where the layer computes long enough for its copies. */
	const size_t L = (size_t)cfg->num_layers, ring = min_sz(TR_OFFLOAD_RING, L);
	const size_t N = (size_t)o->B * (size_t)o->T, H = (size_t)cfg->num_heads * cfg->head_dim;
	const size_t set = aligned((size_t)o->B * cfg->num_heads * o->T * sizeof(float)) +
			   (tr_plan_attention_y32(o) ? aligned(N * H * sizeof(float)) : 0) +
			   (o->gemm_bf16 ? aligned(N * H * 2) : 0);
	const size_t res = aligned(N * (size_t)cfg->hidden_size * sizeof(float));
	double layer_params = 0; /* the seven projections' weights */
	for (int lin = 0; lin < TR_LIN_COUNT; lin++) {
		int in, out;
		tr_lin_dims(cfg, lin, &in, &out);
		layer_params += (double)in * out;
	}
	const double flop_per_byte = 2.0 * (double)N * layer_params / (double)(res + set);
	return o->attention_lse && !o->inference && o->offload_attention >= 0 &&
	       (L + 1 - ring) * res > (ring - 1) * set &&
	       (o->offload_attention > 0 || flop_per_byte >= TR_OFFLOAD_MIN_FLOP_PER_BYTE);
}

/* The forward: embedding, the layers, the final norm, the head in chunks of
 * logits_rows (a classifier's head is one stage over every row). The
 * backward: the head's chunks in the same order, the final norm, the layers
 * from the last (each recomputed first where the plan did not keep its
 * activations), the embedding, and the optimizer. FULL_OFFLOAD: each layer's
 * input copied out right after the stage that writes it, and copied back
 * right after the stage that frees its ring slot (TR_OFFLOAD_RING layers
 * before it is recomputed: the final norm's backward frees the slot of
 * res[L], layer l's backward that of res[l]). */
static td_err build_stages(struct tr_plan *p, struct td_errbuf *eb)
{
	const int L = p->cfg.num_layers, N = p->opts.B * p->opts.T;
	const int R = p->opts.num_labels > 0 ? N : p->logits_rows;
	const bool offload = p->opts.recompute == TR_RECOMPUTE_FULL_OFFLOAD; /* NONE when forward only */
	const bool off_att = offload && tr_plan_offloads_attention(&p->cfg, &p->opts);
	size_t cap = 0;
	td_err e;
#define STAGE(kind, layer, r0, rows)                                                  \
	do {                                                                          \
		if ((e = add_stage(p, &cap, (kind), (layer), (r0), (rows), eb)) != TD_OK) \
			return e;                                                     \
	} while (0)
	STAGE(TR_STAGE_EMBED, -1, 0, 0);
	if (offload && L > 0)
		STAGE(TR_STAGE_OFFLOAD, 0, 0, 0);
	for (int l = 0; l < L; l++) {
		STAGE(TR_STAGE_LAYER, l, 0, 0);
		if (offload && l + 1 < L)
			STAGE(TR_STAGE_OFFLOAD, l + 1, 0, 0);
		if (off_att && l < L - TR_OFFLOAD_RING)
			STAGE(TR_STAGE_OFFLOAD_ATTENTION, l, 0, 0);
	}
	STAGE(TR_STAGE_FINAL_NORM, -1, 0, 0);
	for (int r0 = 0; r0 < N; r0 += R)
		STAGE(TR_STAGE_HEAD, -1, r0, N - r0 < R ? N - r0 : R);
	p->nforward = p->nstages;
	if (p->opts.inference)
		return TD_OK;
	for (int r0 = 0; r0 < N; r0 += R)
		STAGE(TR_STAGE_HEAD_BACKWARD, -1, r0, N - r0 < R ? N - r0 : R);
	STAGE(TR_STAGE_FINAL_NORM_BACKWARD, -1, 0, 0);
	if (offload && L - TR_OFFLOAD_RING >= 0)
		STAGE(TR_STAGE_PREFETCH, L - TR_OFFLOAD_RING, 0, 0);
	for (int l = L - 1; l >= 0; l--) {
		/* the last layer's working set is still the forward's */
		if (p->opts.recompute != TR_RECOMPUTE_NONE && l < L - 1)
			STAGE(TR_STAGE_LAYER_RECOMPUTE, l, 0, 0);
		STAGE(TR_STAGE_LAYER_BACKWARD_MLP, l, 0, 0);
		STAGE(TR_STAGE_LAYER_BACKWARD, l, 0, 0);
		if (offload && l - TR_OFFLOAD_RING >= 0)
			STAGE(TR_STAGE_PREFETCH, l - TR_OFFLOAD_RING, 0, 0);
		if (off_att && l - TR_OFFLOAD_RING >= 0)
			STAGE(TR_STAGE_PREFETCH_ATTENTION, l - TR_OFFLOAD_RING, 0, 0);
	}
	STAGE(TR_STAGE_EMBED_BACKWARD, -1, 0, 0);
	STAGE(TR_STAGE_OPTIMIZER, -1, 0, 0);
#undef STAGE
	return TD_OK;
}

/* plan.copy16_ring: where it applies, and each layer's run of matrices —
 * the decayed trainable tensors of layer l, one run of the arena in layer
 * order (the passes of tr_plan_build), all of one length. */
static void copy16_ring(struct tr_plan *p, const struct tr_plan_opts *o)
{
	const int L = p->cfg.num_layers;
	p->copy16_ring = false;
	p->ring_lo = p->ring_numel = 0;
	if (!o->gemm_bf16 || o->inference || o->lora_rank > 0 || L <= TR_COPY16_RING ||
	    (o->recompute != TR_RECOMPUTE_FULL && o->recompute != TR_RECOMPUTE_FULL_OFFLOAD) ||
	    tr_shard_params(o->shard, o->shard_ranks))
		return;
	size_t lo = 0, per = 0;
	for (int l = 0; l < L; l++) {
		size_t a = SIZE_MAX, b = 0, n = 0;
		for (size_t i = 0; i < p->nparams; i++) {
			const struct tr_param *t = &p->params[i];
			if (t->layer != l || t->ndim != 2)
				continue;
			if (!t->trainable || !t->decay || t->nf4 || t->bf16)
				return;
			a = t->offset < a ? t->offset : a;
			b = t->offset + t->numel > b ? t->offset + t->numel : b;
			n += t->numel;
		}
		if (b <= a || n != b - a || a < p->copy16_lo)
			return;
		if (l == 0) {
			lo = a;
			per = n;
		} else if (n != per || a != lo + (size_t)l * per) {
			return;
		}
	}
	p->copy16_ring = true;
	p->ring_lo = lo;
	p->ring_numel = per;
}

static size_t copy16_numel(const struct tr_plan *p)
{
	const size_t n = p->numel_trainable - p->copy16_lo;
	if (!p->copy16_ring)
		return n;
	return n - (tr_plan_ring_hi(p) - p->ring_lo) + TR_COPY16_RING * p->ring_numel;
}

size_t tr_plan_copy16_index(const struct tr_plan *p, size_t i)
{
	assert(i >= p->copy16_lo && i < p->numel_trainable);
	if (!p->copy16_ring)
		return i - p->copy16_lo;
	const size_t ring = TR_COPY16_RING * p->ring_numel, hi = tr_plan_ring_hi(p);
	if (i < p->ring_lo)
		return ring + (i - p->copy16_lo);
	if (i >= hi)
		return ring + (p->ring_lo - p->copy16_lo) + (i - hi);
	const size_t l = (i - p->ring_lo) / p->ring_numel;
	return (l % TR_COPY16_RING) * p->ring_numel + (i - p->ring_lo - l * p->ring_numel);
}

static td_err plan_build(struct tr_plan *p, const struct tr_model_config *cfg,
			 const struct tr_plan_opts *o, bool mlp_whole, struct td_errbuf *eb);

/* The MLP's backward over all of a micro-batch's rows where that takes no
 * more scratch than its two parts (another phase of a layer's backward
 * region is as large: the logits', the attention's), else in parts
 * (tr_plan.mlp_rows). One product over N rows instead of two over N/2,
 * and no second pass adding onto the weight gradients: on an H100,
 * Qwen2-0.5B's full step 69.5 → 68.3 ms at the same plan bytes. The
 * scratch does not depend on the shard or recompute policy, so every
 * policy of a model makes the same choice (and gives the same bits). */
td_err tr_plan_build(struct tr_plan *p, const struct tr_model_config *cfg,
		     const struct tr_plan_opts *o, struct td_errbuf *eb)
{
	td_err e = plan_build(p, cfg, o, false, eb);
	if (e != TD_OK || p->mlp_rows == o->B * o->T || o->mlp_rows > 0)
		return e;
	struct tr_plan w;
	struct td_errbuf web = {{0}};
	if (plan_build(&w, cfg, o, true, &web) != TD_OK)
		return TD_OK; /* the parts' plan stands */
	/* whole rows kept: the plans swap (their arrays are the heap's, none
	 * points into the struct), and w is then the one let go */
	if (w.arena_bytes[TR_ARENA_SCRATCH] <= p->arena_bytes[TR_ARENA_SCRATCH]) {
		const struct tr_plan parts = *p;
		*p = w;
		w = parts;
	}
	tr_plan_fini(&w);
	return TD_OK;
}

static td_err plan_build(struct tr_plan *p, const struct tr_model_config *cfg,
			 const struct tr_plan_opts *o, bool mlp_whole, struct td_errbuf *eb)
{
	memset(p, 0, sizeof(*p));
	p->cfg = *cfg;
	p->opts = *o;
	if (o->B < 1 || o->T < 2)
		return td_fail(eb, TD_EINVAL, "plan: batch %d and sequence length %d (need >= 1 and >= 2)",
			       o->B, o->T);
	td_err e = check_opts(o, cfg, eb);
	if (e != TD_OK)
		return e;
	if (o->inference)
		p->opts.recompute = TR_RECOMPUTE_NONE; /* nothing is kept for a backward */
	if (!tr_recompute_full(p->opts.recompute))
		p->opts.selective_layers = 0; /* ignored: every layer keeps as the policy says */
	if (o->gemm_bf16)
		p->opts.frozen_bf16 = true; /* the bf16 GEMMs read frozen weights in bf16 */
	if (o->lora_rank > 0)
		p->lora_scale = (float)(o->lora_rslora ? o->lora_alpha / sqrt((double)o->lora_rank)
						       : o->lora_alpha / (double)o->lora_rank);
	e = build_params(p, eb);
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

	const size_t NL = (size_t)o->num_labels, R = (size_t)o->lora_rank;
	const bool train = !o->inference, classify = NL > 0;
	/* Training a causal head (plain or a distillation student) takes its
	 * logits in chunks of rows, and so does a teacher asked for rows
	 * (tr_model_teacher_rows); any other forward-only model keeps them whole. */
	const size_t chunk = o->logits_chunk_floats ? o->logits_chunk_floats : TR_LOGITS_CHUNK_FLOATS;
	size_t rows = chunk / V > 0 ? chunk / V : 1;
	if (train && !o->distill)
		rows = min_sz(rows, (TR_LOGITS_CHUNK_INPUTS + C - 1) / C);
	p->logits16 = train && o->gemm_bf16 && !classify && !o->distill;
	const size_t lsz = p->logits16 ? 2 : 4; /* a logit's bytes */
	/* bf16 logits: the rows of the same bytes, N split evenly over the
	 * chunks they take (multiples of 8 rows), unless a test set the chunk;
	 * bigger chunks cost nothing more and each adds its head's weight
	 * gradient product, which reads and writes the whole fp32 gradient */
	if (p->logits16 && !o->logits_chunk_floats)
		rows = even_rows(N, 2 * rows);
	p->logits_rows = (int)N;
	if ((train || o->teacher_rows) && !classify && N > rows)
		p->logits_rows = (int)rows;
	/* the MLP's backward in two parts of rows, where no adapter is on it
	 * and the whole rows would take more scratch (tr_plan_build) */
	const unsigned mlp3 = 1u << TR_LIN_GATE | 1u << TR_LIN_UP | 1u << TR_LIN_DOWN;
	/* (a multiple of 8 rows: each part's rows start 16-byte aligned whatever I) */
	const size_t half = ((N + 1) / 2 + 7) / 8 * 8;
	p->mlp_rows = train && !mlp_whole && half < N && !(R && (o->lora_targets & mlp3)) ? (int)half
											   : (int)N;
	if (train && o->mlp_rows > 0 && !(R && (o->lora_targets & mlp3)))
		p->mlp_rows = (size_t)o->mlp_rows < N ? o->mlp_rows : (int)N;
	/* the adapters' input-gradient shares where d(x) is read, or one pass
	 * for those that share an input: not through dropout's masks nor past
	 * the ops' rank */
	p->lora_dx_group = train && o->gemm_bf16 && R > 0 && R <= GPU_LORA_DX_RMAX &&
			   o->lora_dropout == 0.0f;
	/* d(h) in bf16; with an adapter on down, its share added as
	 * swiglu_backward reads d(h) */
	p->dh16 = train && o->gemm_bf16 &&
		  (!(R && (o->lora_targets & (1u << TR_LIN_DOWN))) || p->lora_dx_group);
	const bool wpart = tr_shard_params(o->shard, o->shard_ranks);
	/* PARAMETERS in the bf16 mode: the other tensors' bf16 copy (the
	 * head's: params16.rest) lives in the gradient ring's memory, which
	 * holds nothing between a micro-batch's last sums and its first
	 * layer backward — the forward's and the head's stages, the only
	 * ones that read it (train/plan.h: rest16_in_ring). */
	p->rest16_in_ring = wpart && o->gemm_bf16 && p->wslot16_numel[TR_GRAD_RING] > 0 &&
			    (p->grad_slot_numel[0] > 0 || p->grad_slot_numel[1] > 0);
	/* ... with layer L - 2's bf16 slot, where the head's unit holds no
	 * tensor the lookup reads (train/plan.h: rest16_slot) */
	p->rest16_slot = -1;
	const struct tr_param *emb16 = tr_plan_param(p, "model.embed_tokens.weight");
	if (p->rest16_in_ring && cfg->num_layers >= 2 &&
	    p->wslot16_numel[(cfg->num_layers - 2) % TR_GRAD_RING] > 0 &&
	    !(emb16 && emb16->trainable && emb16->wunit == cfg->num_layers))
		p->rest16_slot = (cfg->num_layers - 2) % TR_GRAD_RING;
	if (p->numel_trainable) {
		/* padded to the shards' parts where sharded; PARAMETERS: the part */
		NAMED("params");
		BUF(TR_ARENA_PARAMS, f32_bytes(wpart ? p->shard_numel : p->numel_trainable_padded, 1, 1));
		/* PARAMETERS: the weights gathered for use, in the gradients'
		 * layout (tr_param.gslot), and their bf16 rounding for the GEMMs */
		for (int k = 0; wpart && k <= TR_GRAD_RING; k++) {
			for (int h = 0; h < (o->gemm_bf16 ? 2 : 1); h++) {
				/* fp32: the tensors gathered so (wsoff); bf16: all (w16off) */
				const size_t n = h ? p->wslot16_numel[k] : p->wslot_numel[k];
				if (!n || (h && k == TR_GRAD_RING && p->rest16_in_ring) ||
				    (h && k == p->rest16_slot))
					continue; /* in the grads arena's ring (below) */
				if (k < TR_GRAD_RING)
					NAMED("%s.ring.%d", h ? "params16" : "params", k);
				else
					NAMED("%s.rest", h ? "params16" : "params");
				BUF(TR_ARENA_PARAMS, f32_bytes(n, 1, 1) / (h ? 2 : 1));
			}
		}
	}
	if (p->numel_f32 > p->numel_trainable) {
		NAMED("base.f32"); /* frozen tensors in fp32 */
		BUF(TR_ARENA_BASE, f32_bytes(p->numel_f32 - p->numel_trainable, 1, 1));
	}
	if (p->numel_bf16) {
		NAMED("params16"); /* frozen tensors in bf16 */
		BUF(TR_ARENA_BASE, f32_bytes(p->numel_bf16, 1, 1) / 2);
	}
	if (p->nf4_numel) {
		/* Every NF4 tensor's codes, then its absmax values (fp32, or int8
		 * with an fp32 scale per TR_NF4_DQ_BLOCK and an offset). */
		size_t codes = p->nf4_bytes - (o->nf4_double_quant
						       ? p->nf4_blocks + p->nf4_scales * sizeof(float)
						       : p->nf4_blocks * sizeof(float));
		NAMED("nf4.codes");
		BUF(TR_ARENA_BASE, codes);
		if (o->nf4_double_quant) {
			NAMED("nf4.absmax_q");
			BUF(TR_ARENA_BASE, p->nf4_blocks);
			NAMED("nf4.absmax_scale");
			BUF(TR_ARENA_BASE, f32_bytes(p->nf4_scales, 1, 1));
		} else {
			NAMED("nf4.absmax");
			BUF(TR_ARENA_BASE, f32_bytes(p->nf4_blocks, 1, 1));
		}
	}
	if (p->numel_trainable) {
		/* Every trainable float's gradient; GRADIENTS: the part's summed
		 * gradients, and the work buffers the backward writes. */
		const bool gpart = tr_shard_grads(o->shard, o->shard_ranks);
		NAMED("grads");
		BUF(TR_ARENA_GRADS,
		    f32_bytes(gpart ? p->shard_numel : p->numel_trainable - p->grads_lo, 1, 1));
		if (p->emb_slots) {
			NAMED("grads.emb_rows");
			BUF(TR_ARENA_GRADS, f32_bytes(p->emb_slots, C, 1));
			NAMED("grads.emb_slot");
			BUF(TR_ARENA_GRADS, N * sizeof(int32_t));
			NAMED("grads.emb_row_of");
			BUF(TR_ARENA_GRADS, V * sizeof(int32_t));
		}
		/* rest16_in_ring: the ring's slots and params16.rest share one
		 * region (grads.ring), as large as the larger of the two */
		size_t ring = 0, region = p->arena_bytes[TR_ARENA_GRADS];
		for (int k = 0; k < TR_GRAD_RING; k++)
			ring += aligned(f32_bytes(p->grad_slot_numel[k], 1, 1));
		const size_t rest16 = f32_bytes(p->wslot16_numel[TR_GRAD_RING], 1, 1) / 2;
		/* rest16_slot: layer L - 2's bf16 slot after the gradient
		 * slots, params16.rest ending where the region ends */
		const size_t slot16 = p->rest16_slot >= 0
					      ? aligned(f32_bytes(p->wslot16_numel[p->rest16_slot], 1, 1) / 2)
					      : 0;
		const size_t rbytes = p->rest16_slot >= 0 ? max_sz(ring + slot16, aligned(rest16))
							  : max_sz(ring, rest16);
		if (p->rest16_in_ring) {
			NAMED("grads.ring");
			BUF(TR_ARENA_GRADS, rbytes);
		}
		size_t at = 0;
		for (int k = 0; gpart && k <= TR_GRAD_RING; k++) {
			if (!p->grad_slot_numel[k])
				continue;
			if (k < TR_GRAD_RING)
				NAMED("grads.ring.%d", k);
			else
				NAMED("grads.rest");
			if (k == TR_GRAD_RING || !p->rest16_in_ring) {
				BUF(TR_ARENA_GRADS, f32_bytes(p->grad_slot_numel[k], 1, 1));
				continue;
			}
			if ((e = add_view(p, TR_ARENA_GRADS, nm, region + at,
					  f32_bytes(p->grad_slot_numel[k], 1, 1), eb))) {
				tr_plan_fini(p);
				return e;
			}
			at += aligned(f32_bytes(p->grad_slot_numel[k], 1, 1));
		}
		if (p->rest16_slot >= 0) {
			NAMED("params16.ring.%d", p->rest16_slot);
			if ((e = add_view(p, TR_ARENA_GRADS, nm, region + ring,
					  f32_bytes(p->wslot16_numel[p->rest16_slot], 1, 1) / 2, eb))) {
				tr_plan_fini(p);
				return e;
			}
		}
		if (p->rest16_in_ring) {
			NAMED("params16.rest");
			const size_t r0 = p->rest16_slot >= 0 ? rbytes - aligned(rest16) : 0;
			if ((e = add_view(p, TR_ARENA_GRADS, nm, region + r0, rest16, eb))) {
				tr_plan_fini(p);
				return e;
			}
		}
		if (p->embed_rows) {
			/* every rank's rows of the embedding's gradient (train/plan.h:
			 * embed_rows), and of its lookup (embed_lookup_rows) */
			const size_t NR = (size_t)o->shard_ranks * N;
			NAMED("grads.rows");
			BUF(TR_ARENA_GRADS, f32_bytes(NR, C, 1));
			NAMED("grads.rows_ids");
			BUF(TR_ARENA_GRADS, NR * sizeof(int32_t));
		}
		/* The moments of this rank's part (all of them unsharded). */
		NAMED("optim.m");
		BUF(TR_ARENA_OPTIM, f32_bytes(p->shard_numel, 1, 1));
		NAMED("optim.v");
		BUF(TR_ARENA_OPTIM, f32_bytes(p->shard_numel, 1, 1));
	}

	NAMED("acts.ids");
	BUF(TR_ARENA_ACTS, N * sizeof(int32_t));
	NAMED("acts.targets");
	BUF(TR_ARENA_ACTS, N * sizeof(int32_t));
	NAMED("acts.rope_cos");
	BUF(TR_ARENA_ACTS, f32_bytes(T, HS / 2, 1));
	NAMED("acts.rope_sin");
	BUF(TR_ARENA_ACTS, f32_bytes(T, HS / 2, 1));
	const enum tr_recompute rc = train ? o->recompute : TR_RECOMPUTE_NONE;
	if (rc == TR_RECOMPUTE_FULL_OFFLOAD) {
		/* The residual stream entering layer l in ring slot l %
		 * TR_OFFLOAD_RING on the device, and every layer's input in the
		 * host arena (train/plan.h: TR_RECOMPUTE_FULL_OFFLOAD). */
		const int ring = (int)min_sz(TR_OFFLOAD_RING, (size_t)cfg->num_layers + 1);
		for (int k = 0; k < ring; k++) {
			NAMED("acts.res_ring.%d", k);
			BUF(TR_ARENA_ACTS, f32_bytes(N, C, 1));
		}
		for (int l = 0; l < cfg->num_layers; l++) {
			NAMED("host.res.%d", l);
			BUF(TR_ARENA_HOST, f32_bytes(N, C, 1));
		}
	} else {
		for (int l = 0; l <= cfg->num_layers; l++) {
			NAMED("acts.res.%d", l); /* residual stream entering layer l (l = L: leaving the last) */
			BUF(TR_ARENA_ACTS, f32_bytes(N, C, 1));
		}
	}
	/* bf16 GEMMs (gemm_bf16): the products' inputs kept as bf16 twins
	 * (gpu/backend.h), written by the ops that make them; the norms' outputs
	 * and the MLP's hidden are then kept only as bf16, unless LoRA dropout
	 * needs them in fp32. */
	const bool twins = o->gemm_bf16;
	const bool keep32 = !twins || (R && o->lora_dropout > 0.0f);
	/* The MLP's gate and up products too (an adapter's product added in
	 * bf16: train/model.c, linear_forward). */
	const bool mlp32 = !twins;
	/* Where a layer's activations live. Forward only, nothing is kept for a
	 * backward pass: every layer reuses layer 0's buffers. Training, each
	 * layer keeps what the recompute policy keeps (acts.layers.L.*) and the
	 * rest lives once, in acts.work.*, for the layer being computed or
	 * recomputed (train/model.c binds both so). KEEP_SEL: kept under
	 * SELECTIVE too — the products (GEMM outputs: q, k, v or the q/k norms'
	 * inputs, gate, up), the residual stream after
	 * attention, and the fused attention's output and row statistics;
	 * KEEP_NONE: recomputed under SELECTIVE — the norms' outputs and their
	 * statistics, RoPE'd q and k under q/k norms, SwiGLU's output, the
	 * adapters' dropout, and the unfused attention's probabilities and
	 * output. FULL keeps only the residual stream (acts.res.L), and
	 * FULL_OFFLOAD the same in the host arena; every policy keeps the
	 * adapters' x A^T (below). */
	enum { KEEP_SEL, KEEP_NONE };
	const bool lse = o->attention_lse;
	const int qk = cfg->qk_norm ? KEEP_NONE : KEEP_SEL; /* without q/k norms, RoPE runs in place on the product */
	const int att = lse ? KEEP_SEL : KEEP_NONE;
	/* The fused attention reads q, k, v in bf16 only: they are kept so
	 * (after RoPE, rounded from fp32 values staged in scratch.qkv32:
	 * the bits the attention rounded for itself before), and its
	 * backward reads them again. The unfused attention reads fp32. */
	const bool qkv16 = lse && o->gemm_bf16;
	/* The attention's output in fp32 only where something reads it: the
	 * unfused backward's ops and fp32 GEMMs (and LoRA dropout, keep32);
	 * the fused backward forms its row sums from the bf16 twin, and the
	 * o projection's bf16 GEMM reads that (tr_plan_attention_y32). */
	const bool y32 = tr_plan_attention_y32(o);
	/* FULL_OFFLOAD where the attention is fused keeps its output and row
	 * statistics (att, y16 and y where planned: what SELECTIVE keeps of it)
	 * beside each layer
	 * input on the host, so a layer's recompute runs no attention forward:
	 * a ring of TR_OFFLOAD_RING on the device (acts.ring.K.*), and the
	 * layers the backward copies back from the host (all but the last
	 * TR_OFFLOAD_RING, still in the ring when it starts: host.layers.L.*).
	 * Its recompute then costs the products and element-wise ops only; the
	 * copies (65 MiB a layer for Llama-3-8B at B4 x T2048 with y16 alone,
	 * with the layer input's 128) stay under what PCIe moves while a layer
	 * computes. */
	const bool off_att = rc == TR_RECOMPUTE_FULL_OFFLOAD && lse &&
			     tr_plan_offloads_attention(cfg, o);
	const struct {
		const char *what;
		size_t bytes;
		bool on;
		int keep;
		bool att_out; /* the attention's output and statistics (off_att) */
	} acts[] = {
		{"ln1", f32_bytes(N, C, 1), keep32, KEEP_NONE, false},
		{"ln1_16", f32_bytes(N, C, 1) / 2, twins, KEEP_NONE, false},
		{"ln1_rstd", f32_bytes(N, 1, 1), true, KEEP_NONE, false},
		{"qraw", f32_bytes(N, H, 1), cfg->qk_norm, KEEP_SEL, false},
		{"q_rstd", f32_bytes(N, NH, 1), cfg->qk_norm, KEEP_NONE, false},
		{"kraw", f32_bytes(N, KV, 1), cfg->qk_norm, KEEP_SEL, false},
		{"k_rstd", f32_bytes(N, NKV, 1), cfg->qk_norm, KEEP_NONE, false},
		{"q", f32_bytes(N, H, 1), !qkv16, qk, false},
		{"k", f32_bytes(N, KV, 1), !qkv16, qk, false},
		{"v", f32_bytes(N, KV, 1), !qkv16, KEEP_SEL, false},
		{"q16", f32_bytes(N, H, 1) / 2, qkv16, qk, false},
		{"k16", f32_bytes(N, KV, 1) / 2, qkv16, qk, false},
		{"v16", f32_bytes(N, KV, 1) / 2, qkv16, KEEP_SEL, false},
		{"att", lse ? f32_bytes(B * NH, T, 1) : f32_bytes(B * NH, T, T), true, att, true},
		{"y", f32_bytes(N, H, 1), y32, att, true},
		{"y16", f32_bytes(N, H, 1) / 2, twins, att, true},
		{"res_mid", f32_bytes(N, C, 1), true, KEEP_SEL, false},
		{"ln2", f32_bytes(N, C, 1), keep32, KEEP_NONE, false},
		{"ln2_16", f32_bytes(N, C, 1) / 2, twins, KEEP_NONE, false},
		{"ln2_rstd", f32_bytes(N, 1, 1), true, KEEP_NONE, false},
		{"gate", f32_bytes(N, I, 1), mlp32, KEEP_SEL, false},
		{"up", f32_bytes(N, I, 1), mlp32, KEEP_SEL, false},
		{"gate16", f32_bytes(N, I, 1) / 2, !mlp32, KEEP_SEL, false},
		{"up16", f32_bytes(N, I, 1) / 2, !mlp32, KEEP_SEL, false},
		{"h", f32_bytes(N, I, 1), keep32, KEEP_NONE, false},
		{"h16", f32_bytes(N, I, 1) / 2, twins, KEEP_NONE, false},
	};
	const int nl = train ? cfg->num_layers : 1;
	for (int l = 0; l <= nl; l++) {
		const bool work = l == nl; /* the working set, after the layers' own */
		if (work && rc == TR_RECOMPUTE_NONE)
			break;
		/* the layer's own policy (tr_layer_recompute); the working set
		 * is the plan's, for the layers that keep less */
		const enum tr_recompute lrc =
			work ? rc : tr_layer_recompute(rc, p->opts.selective_layers, l);
#define KEPT(keep) (lrc == TR_RECOMPUTE_NONE || (lrc == TR_RECOMPUTE_SELECTIVE && (keep) == KEEP_SEL))
#define ACT_NAME(what)                                        \
	do {                                                  \
		if (work)                                     \
			NAMED("acts.work.%s", (what));        \
		else                                          \
			NAMED("acts.layers.%d.%s", l, (what)); \
	} while (0)
		for (size_t i = 0; i < sizeof(acts) / sizeof(acts[0]); i++) {
			if (!acts[i].on || KEPT(acts[i].keep) == work || (off_att && acts[i].att_out))
				continue;
			ACT_NAME(acts[i].what);
			BUF(TR_ARENA_ACTS, acts[i].bytes);
		}
		/* LoRA keeps scale * (x A^T) per adapter under every policy (N x r
		 * floats: at r 16 the 32 layers' seven adapters of Llama-3-8B
		 * at B4 x T2048 are 112 MiB), so no recompute runs the adapters'
		 * A products again (train/model.c: lora_input); and x after
		 * dropout when there is dropout (the pre-dropout x is the base's
		 * input). */
		for (int lin = 0; R && lin < TR_LIN_COUNT; lin++) {
			if (!(o->lora_targets & (1u << lin)))
				continue;
			int in, out;
			tr_lin_dims(cfg, lin, &in, &out);
			char what[32];
			if (!work) {
				snprintf(what, sizeof(what), "lora_u.%s", lin_names[lin]);
				ACT_NAME(what);
				BUF(TR_ARENA_ACTS, f32_bytes(N, R, 1));
			}
			if (o->lora_dropout > 0.0f && KEPT(KEEP_NONE) != work) {
				snprintf(what, sizeof(what), "lora_x.%s", lin_names[lin]);
				ACT_NAME(what);
				BUF(TR_ARENA_ACTS, f32_bytes(N, (size_t)in, 1));
			}
		}
#undef KEPT
#undef ACT_NAME
	}
	/* off_att: ring slot k's set, then host layer l's, each in acts[]'s
	 * order: every set has the same layout, and one copy moves a set
	 * (train/model.c). */
	const int nring = (int)min_sz(TR_OFFLOAD_RING, (size_t)cfg->num_layers);
	for (int k = 0; off_att && k < nring + (cfg->num_layers - nring); k++) {
		const bool host = k >= nring; /* host layer k - nring */
		for (size_t i = 0; i < sizeof(acts) / sizeof(acts[0]); i++) {
			if (!acts[i].on || !acts[i].att_out)
				continue;
			if (host)
				NAMED("host.layers.%d.%s", k - nring, acts[i].what);
			else
				NAMED("acts.ring.%d.%s", k, acts[i].what);
			BUF(host ? TR_ARENA_HOST : TR_ARENA_ACTS, acts[i].bytes);
		}
	}
	NAMED("acts.lnf");
	BUF(TR_ARENA_ACTS, f32_bytes(N, C, 1));
	NAMED("acts.lnf_rstd");
	BUF(TR_ARENA_ACTS, f32_bytes(N, 1, 1));
	if (classify) {
		NAMED("acts.pool_idx"); /* row of each sequence's last non-pad token */
		BUF(TR_ARENA_ACTS, B * sizeof(int32_t));
		NAMED("acts.pooled");
		BUF(TR_ARENA_ACTS, f32_bytes(B, C, 1));
	}

	/* Scratch: shared by every layer, reused forward and backward. */
	const size_t MR = (size_t)p->mlp_rows;
	size_t lora_in = 0;
	for (int lin = 0; R && lin < TR_LIN_COUNT; lin++) {
		int in, out;
		tr_lin_dims(cfg, lin, &in, &out);
		if (o->lora_targets & (1u << lin))
			lora_in = (size_t)in > lora_in ? (size_t)in : lora_in;
	}
	/* The bf16 GEMM operands: the most any product of this model needs. */
	const size_t gemm = o->gemm_bf16 ? gemm_scratch_elems(p) : 0;
	/* A frozen weight materialised for one use: an NF4 one dequantized (in
	 * bf16 in the bf16 mode: the GEMM's operand) and, on a backend without
	 * bf16 GEMMs, a bf16 one widened to fp32. */
	const size_t deq = o->gemm_bf16 ? p->nf4_max_numel * sizeof(uint16_t)
					: f32_bytes(max_sz(p->nf4_max_numel, p->bf16_max_numel), 1, 1);
	/* d(gate) written over d(h) (the bf16 mode, no adapter's share added
	 * as d(h) is read: swiglu_backward's plain kernel, each element read by
	 * the thread that then writes it): the MLP's phase holds two of its
	 * three tensors, so its whole rows fit where its two parts did */
	const bool dgate_over_dh = p->dh16 && !(R && (o->lora_targets & (1u << TR_LIN_DOWN)));
	struct {
		const char *what;
		size_t bytes;
		bool on;
		int phase; /* 0: its own bytes; 1 .. 4: a place in scratch.layer_backward */
	} scratch[] = {
		/* the CE gradient overwrites the logits in place. Training, the
		 * logits and their gradient are live in the head's stages only
		 * (its forward chunks and their backward, between the last
		 * layer's forward and the final norm's backward), which no
		 * layer's forward, recompute or backward overlaps: phase 4 */
		{"logits",
		 classify ? f32_bytes(B, NL, 1) : logits_bytes((size_t)p->logits_rows, V, lsz), true,
		 train ? 4 : 0},
		{"losses", f32_bytes(N, 1, 1), true, 0},
		{"kl", f32_bytes(N, 1, 1), o->distill, 0},
		{"dres", f32_bytes(N, C, 1), train, 0},
		/* its twin (the bf16 mode): each norm's backward that updates
		 * dres rounds it as it writes, for the o and down projections'
		 * products and adapters that read it next (their own rounding
		 * pass left out); live from one layer's half into the next */
		{"dres16", f32_bytes(N, C, 1) / 2, train && o->gemm_bf16, 0},
		{"dln", f32_bytes(N, C, 1), true, 0}, /* also the forward's projection output */
		/* A layer's backward in two phases that share one region
		 * (scratch.layer_backward): the MLP's (phase 2) runs first and is
		 * done before the attention's (phase 1) starts. */
		{"dq", f32_bytes(N, H, 1), train, 1},
		{"dk", f32_bytes(N, KV, 1), train, 1},
		{"dv", f32_bytes(N, KV, 1), train, 1},
		/* The fused attention's dS room (gpu/backend.h: ds of
		 * attention_backward_rope16), a view from dq on: dq, dk and dv,
		 * which that op's packed form does not write, and past them as
		 * much of the region as phase 1 leaves below the largest other
		 * phase, up to every (batch, head) pair's dS (its bytes here:
		 * that extra; set below) */
		{"att_ds", 0, false, 1},
		{"dqraw", f32_bytes(N, H, 1), train && cfg->qk_norm, 1},
		{"dkraw", f32_bytes(N, KV, 1), train && cfg->qk_norm, 1},
		{"dy", f32_bytes(N, H, 1), train, 1},
		{"datt",
		 o->attention_lse ? f32_bytes(gpu_flash_datt_floats((int)B, (int)T, (int)NH, (int)NKV,
								     (int)HS), 1, 1)
				  : f32_bytes(B * NH, T, T),
		 train, 1},
		/* d(h), of plan.mlp_rows rows (MR) */
		{"dh", f32_bytes(MR, I, 1), train && !p->dh16, 2},
		{"dh16", f32_bytes(MR, I, 1) / 2, p->dh16, 2},
		{"dgate", f32_bytes(MR, I, 1), train && !o->gemm_bf16, 2},
		{"dup", f32_bytes(MR, I, 1), train && !o->gemm_bf16, 2},
		{"dgate16", f32_bytes(MR, I, 1) / 2, train && o->gemm_bf16, 2},
		{"dup16", f32_bytes(MR, I, 1) / 2, train && o->gemm_bf16, 2},
		/* The fused attention's q, k, v in fp32 before RoPE and their
		 * rounding (qkv16): a layer's forward or recompute, which never
		 * overlaps its backward (phase 3; nothing of phases 1 and 2 is
		 * live in a forward). A forward-only plan has no region: their
		 * own bytes. One buffer of N rows of H + 2 KV: q's, k's and v's
		 * products one after another, or as one product's rows side by
		 * side (train/model.c: qkv_forward_fused). */
		{"qkv32", f32_bytes(N, H + 2 * KV, 1), qkv16, train ? 3 : 0},
		{"dpooled", f32_bytes(B, C, 1), train && classify, 0},
		/* a frozen weight for one use (and an NF4 one's absmax values) */
		{"deq", deq, deq > 0, 0},
		{"deq_absmax", f32_bytes((p->nf4_max_numel + TR_NF4_BLOCK - 1) / TR_NF4_BLOCK, 1, 1),
		 p->nf4_numel > 0 && o->nf4_double_quant, 0},
		/* LoRA: d(x A^T); d(x) through dropout ((x A^T) B^T is added to
		 * the projection's output by the GEMM: matmul_forward_add) */
		{"lora_du", f32_bytes(N, R, p->lora_dx_group ? GPU_LORA_DX_GROUP : 1), train && R > 0, 0},
		{"lora_dx", f32_bytes(N, lora_in, 1), train && R > 0 && o->lora_dropout > 0.0f, 0},
		{"gemm_bf16", gemm * 2, gemm > 0, 0},
		/* the trainable weights rounded once per update, not per product
		 * (the GEMMs' twins of them; frozen ones are stored in bf16) */
		{"params_bf16", copy16_numel(p) * 2,
		 o->gemm_bf16 && p->numel_trainable > 0 && !tr_shard_params(o->shard, o->shard_ranks), 0},
	};
	const size_t nscratch = sizeof(scratch) / sizeof(scratch[0]);
	/* the member of its phase whose bytes member i reuses, or NULL */
#define OVER(i) (dgate_over_dh && !strcmp(scratch[i].what, "dgate16") ? "dh16" : NULL)
	size_t phase_bytes[5] = {0, 0, 0, 0, 0}, at[5] = {0, 0, 0, 0, 0};
	for (size_t i = 0; i < nscratch; i++) {
		if (!scratch[i].on || OVER(i))
			continue;
		phase_bytes[scratch[i].phase] += aligned(scratch[i].bytes);
	}
	/* att_ds where the packed attention backward can run and uses it
	 * (fused, bf16, kv groups, no q/k norms, head size 128: the CUDA
	 * backend's Hopper kernels): every (batch, head) pair's dS at most */
	size_t ids = nscratch, idq = nscratch;
	for (size_t i = 0; i < nscratch; i++) {
		ids = !strcmp(scratch[i].what, "att_ds") ? i : ids;
		idq = !strcmp(scratch[i].what, "dq") ? i : idq;
	}
	if (train && o->attention_lse && o->gemm_bf16 && NKV < NH && !cfg->qk_norm && HS == 128) {
		const size_t want = B * NH * gpu_flash_ds_pair_bytes((int)o->T);
		const size_t have = aligned(f32_bytes(N, H, 1)) + 2 * aligned(f32_bytes(N, KV, 1));
		const size_t others = max_sz(phase_bytes[2], phase_bytes[3]);
		const size_t slack = others > phase_bytes[1] ? others - phase_bytes[1] : 0;
		scratch[ids].on = true;
		scratch[ids].bytes = want > have ? min_sz(want - have, slack) / TR_PLAN_ALIGN * TR_PLAN_ALIGN : 0;
		phase_bytes[1] += scratch[ids].bytes;
	}
	/* A chunked causal head (phase 4: its logits, and their gradient over
	 * them) takes as many more rows as the region that the layers'
	 * backward, forward and recompute need anyway holds (fit: a multiple of
	 * 64 rows, within the floats bound's bytes), split evenly over the
	 * chunks that N rows then take (multiples of 8 rows): fewer chunks,
	 * each head weight gradient product with more rows to add over — each
	 * reads and writes the whole fp32 gradient (Llama-3-8B at B4 x T2048:
	 * 22 chunks of 384 rows once, 8 of 1024 with this, 4 of 2048 in bf16).
	 * Not where the caller set the bound (logits_chunk_floats: tests that
	 * want a given chunk); where it set the rows (logits_rows), those. */
	size_t rows_now = 0; /* the chunk's rows, where set here */
	if (train && !classify && !o->distill && o->logits_rows > 0 && !o->logits_chunk_floats) {
		rows_now = even_rows(N, (size_t)o->logits_rows);
	} else if (train && !classify && !o->distill && !o->logits_chunk_floats &&
		   (size_t)p->logits_rows < N) {
		const size_t others = max_sz(max_sz(phase_bytes[1], phase_bytes[2]), phase_bytes[3]);
		const size_t fit = min_sz(others / (V * lsz),
					  TR_LOGITS_CHUNK_FLOATS * sizeof(float) / lsz / V) / 64 * 64;
		if (fit > (size_t)p->logits_rows)
			rows_now = even_rows(N, fit);
	}
	if (rows_now) {
		p->logits_rows = (int)rows_now;
		for (size_t i = 0; i < nscratch; i++) {
			if (!strcmp(scratch[i].what, "logits")) {
				phase_bytes[4] -= aligned(scratch[i].bytes);
				scratch[i].bytes = logits_bytes(p->logits_rows, V, lsz);
				phase_bytes[4] += aligned(scratch[i].bytes);
			} else if (!strcmp(scratch[i].what, "gemm_bf16")) {
				/* the head's input, rounded: more rows */
				scratch[i].bytes = gemm_scratch_elems(p) * 2;
			}
		}
	}
	size_t region = 0; /* the region's offset, placed with its first member */
	bool placed = false;
	size_t place[sizeof(scratch) / sizeof(scratch[0])]; /* each region member's offset in it */
	for (size_t i = 0; i < nscratch; i++) {
		if (!scratch[i].on)
			continue;
		const int ph = scratch[i].phase;
		if (ph && !placed) {
			placed = true;
			region = p->arena_bytes[TR_ARENA_SCRATCH];
			NAMED("scratch.layer_backward");
			BUF(TR_ARENA_SCRATCH, max_sz(max_sz(phase_bytes[1], phase_bytes[2]),
						     max_sz(phase_bytes[3], phase_bytes[4])));
		}
		NAMED("scratch.%s", scratch[i].what);
		if (!ph) {
			BUF(TR_ARENA_SCRATCH, scratch[i].bytes);
			continue;
		}
		if (i == ids) { /* from dq's place through its own extra */
			const size_t from = place[idq], to = at[ph] + scratch[i].bytes;
			if ((e = add_view(p, TR_ARENA_SCRATCH, nm, region + from, to - from, eb))) {
				tr_plan_fini(p);
				return e;
			}
			at[ph] = to;
			continue;
		}
		const char *over = OVER(i);
		size_t off = at[ph];
		for (size_t j = 0; over && j < i; j++)
			if (scratch[j].on && scratch[j].phase == ph && !strcmp(scratch[j].what, over)) {
				assert(scratch[j].bytes >= scratch[i].bytes);
				off = place[j];
			}
		assert(!over || off != at[ph]);
		place[i] = off;
		if ((e = add_view(p, TR_ARENA_SCRATCH, nm, region + off, scratch[i].bytes, eb))) {
			tr_plan_fini(p);
			return e;
		}
		if (!over)
			at[ph] += aligned(scratch[i].bytes);
	}
#undef OVER
#undef BUF
#undef NAMED
	if ((e = build_stages(p, eb)) != TD_OK) {
		tr_plan_fini(p);
		return e;
	}
	return TD_OK;
}

void tr_plan_fini(struct tr_plan *p)
{
	free(p->params);
	free(p->bufs);
	free(p->stages);
	p->params = NULL;
	p->bufs = NULL;
	p->stages = NULL;
	p->nparams = p->nbufs = p->capbufs = p->nstages = p->nforward = 0;
}

size_t tr_plan_total_bytes(const struct tr_plan *p)
{
	size_t t = 0;
	for (int a = 0; a < TR_ARENA_COUNT; a++)
		t += p->arena_bytes[a];
	return t;
}

size_t tr_plan_host_bytes(const struct tr_plan *p)
{
	return p->arena_bytes[TR_ARENA_HOST];
}

size_t tr_plan_base_bytes(const struct tr_plan *p)
{
	return p->arena_bytes[TR_ARENA_BASE];
}

/* FNV-1a, 64 bits, four lanes of different bases: 256 bits of layout, not
 * a cryptographic digest (the files' contents are hashed elsewhere,
 * train/base.h: tr_base_files_digest). */
static void sig_add(uint64_t h[4], const void *data, size_t n)
{
	const unsigned char *b = data;
	for (int k = 0; k < 4; k++)
		for (size_t i = 0; i < n; i++) {
			h[k] ^= b[i];
			h[k] *= 0x100000001b3ull;
		}
}

void tr_plan_base_signature(const struct tr_plan *p, char out[65])
{
	uint64_t h[4] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull, 0x9e3779b97f4a7c15ull,
			 0x6a09e667f3bcc908ull};
	char line[256];
	int n = snprintf(line, sizeof(line), "base v1 quant %d dq %d bf16 %d nf4 %d/%d\n",
			 (int)p->opts.base_quant, (int)p->opts.nf4_double_quant,
			 (int)p->opts.frozen_bf16, TR_NF4_BLOCK, TR_NF4_DQ_BLOCK);
	sig_add(h, line, (size_t)n);
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *t = &p->params[i];
		if (t->trainable)
			continue;
		n = snprintf(line, sizeof(line), "%s %d %" PRId64 " %" PRId64 " %s %zu %zu %zu %zu\n",
			     t->name, t->ndim, t->shape[0], t->shape[1],
			     t->nf4 ? "nf4" : t->bf16 ? "bf16" : "f32", t->offset, t->q_codes,
			     t->q_blocks, t->q_scales);
		sig_add(h, line, (size_t)n);
	}
	for (size_t i = 0; i < p->nbufs; i++) {
		const struct tr_plan_buf *b = &p->bufs[i];
		if (b->arena != TR_ARENA_BASE)
			continue;
		n = snprintf(line, sizeof(line), "buf %s %zu %zu\n", b->name, b->offset, b->bytes);
		sig_add(h, line, (size_t)n);
	}
	for (int k = 0; k < 4; k++)
		snprintf(out + 16 * k, 17, "%016" PRIx64, h[k]);
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
	const struct tr_plan_opts *o = &p->opts;
	if (p->mlp_rows < o->B * o->T)
		fprintf(f, "mlp        the backward in parts of %d rows (the whole rows' d(h), d(gate) and "
			"d(up) would need more scratch)\n", p->mlp_rows);
	if (o->shard != TR_SHARD_NONE && o->shard_ranks > 1)
		fprintf(f, "shard      %s over %d ranks: each keeps the moments%s of %zu trainable floats "
			"(rank %d: [%zu, %zu))%s\n",
			tr_shard_name(o->shard), o->shard_ranks,
			tr_shard_params(o->shard, o->shard_ranks) ? ", summed gradients and weights"
			: tr_shard_grads(o->shard, o->shard_ranks) ? " and summed gradients" : "",
			p->shard_numel, o->shard_rank, p->shard_lo, p->shard_hi,
			tr_shard_params(o->shard, o->shard_ranks) ? ""
								   : "; the weights are all-gathered after each step");
	if (tr_shard_grads(o->shard, o->shard_ranks))
		fprintf(f, "grads      the backward writes a layer's attention's and MLP's into a ring of %d "
			"slots (%zu, %zu floats), the others' into %zu floats; each summed onto its owners' "
			"parts as its backward ends\n",
			TR_GRAD_RING, p->grad_slot_numel[0], p->grad_slot_numel[1],
			p->grad_slot_numel[TR_GRAD_RING]);
	if (tr_shard_params(o->shard, o->shard_ranks))
		fprintf(f, "weights    each rank keeps its part's fp32 masters; a layer's weights are gathered "
			"from their owners into the same ring%s a layer ahead of use, forward and backward, "
			"the others' once a micro-batch\n",
			o->gemm_bf16 ? " (and rounded to bf16 for the GEMMs)" : "");
	if (p->embed_rows)
		fprintf(f, "embedding  its gradient by rows: every rank's %d ids and d(res[0]) rows gathered "
			"(%d x %d), each rank scattering them into %s%s\n",
			o->B * o->T, o->shard_ranks, o->B * o->T,
			tr_shard_grads(o->shard, o->shard_ranks) ? "its part" : "its summed gradients",
			p->embed_lookup_rows ? "; looked up by rows from the parts, never gathered whole" : "");
	if (o->lora_rank > 0) {
		char targets[96] = "";
		size_t len = 0;
		for (int lin = 0; lin < TR_LIN_COUNT && len < sizeof(targets); lin++)
			if (o->lora_targets & (1u << lin))
				len += (size_t)snprintf(targets + len, sizeof(targets) - len, "%s%s",
							len ? ", " : "", lin_names[lin]);
		fprintf(f, "lora       r=%d alpha=%g (scale %g%s) dropout %g on %s; only the adapters%s have "
			"gradients and optimizer state\n",
			o->lora_rank, o->lora_alpha, (double)p->lora_scale, o->lora_rslora ? ", rslora" : "",
			(double)o->lora_dropout, targets, o->num_labels > 0 ? " and the head" : "");
	}
	if (o->num_labels > 0)
		fprintf(f, "head       score [%d, %d] on the last non-pad token\n", o->num_labels,
			c->hidden_size);
	if (o->inference)
		fprintf(f, "mode       forward only (frozen; no gradients, optimizer state or backward buffers)\n");
	if (p->numel_frozen) {
		fprintf(f, "frozen     %zu parameters, %s as stored", p->numel_frozen,
			tr_fmt_bytes(b1, sizeof(b1), p->frozen_bytes));
		if (p->numel_bf16)
			fprintf(f, "; %zu in bf16 only (%s, no fp32 copy)", p->numel_bf16,
				tr_fmt_bytes(b2, sizeof(b2), p->numel_bf16 * 2));
		if (p->nf4_numel)
			fprintf(f, "; %zu in NF4%s: %s, %.2fx smaller than their %s in bf16",
				p->nf4_numel, o->nf4_double_quant ? " (double-quantized absmax)" : "",
				tr_fmt_bytes(b1, sizeof(b1), p->nf4_bytes),
				(double)(p->nf4_numel * 2) / (double)p->nf4_bytes,
				tr_fmt_bytes(b2, sizeof(b2), p->nf4_numel * 2));
		fprintf(f, "\n");
	}
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
	const size_t host = tr_plan_host_bytes(p);
	if (host) {
		size_t n = 0;
		for (size_t i = 0; i < p->nbufs; i++)
			n += p->bufs[i].arena == TR_ARENA_HOST;
		fprintf(f, "host       %s (%zu bytes) of pinned host memory beside the device's total, "
			"not in its lease (%zu layer inputs, %s each)\n",
			tr_fmt_bytes(b1, sizeof(b1), host), host, n,
			tr_fmt_bytes(b2, sizeof(b2), n ? host / n : 0));
	}
	size_t acts[TR_RECOMPUTE_COUNT], totals[TR_RECOMPUTE_COUNT], hosts[TR_RECOMPUTE_COUNT];
	if (o->inference || tr_plan_policy_bytes(&p->cfg, o, acts, totals, hosts, NULL) != TD_OK)
		return;
	if (p->opts.selective_layers > 0)
		fprintf(f, "recompute  %s, the first %d of %d layers selective; by policy, acts and "
			"total:",
			tr_recompute_name(o->recompute), p->opts.selective_layers, p->cfg.num_layers);
	else
		fprintf(f, "recompute  %s; by policy, acts and total:", tr_recompute_name(o->recompute));
	for (int r = 0; r < TR_RECOMPUTE_COUNT; r++) {
		fprintf(f, "%s %s %s (%zu bytes), %s", r ? ";" : "", tr_recompute_name(r),
			tr_fmt_bytes(b1, sizeof(b1), acts[r]), acts[r],
			tr_fmt_bytes(b2, sizeof(b2), totals[r]));
		if (hosts[r])
			fprintf(f, " + %s pinned on the host", tr_fmt_bytes(b1, sizeof(b1), hosts[r]));
	}
	fprintf(f, "\n");
}

td_err tr_plan_policy_bytes(const struct tr_model_config *cfg, const struct tr_plan_opts *o,
			    size_t acts[TR_RECOMPUTE_COUNT], size_t total[TR_RECOMPUTE_COUNT],
			    size_t host[TR_RECOMPUTE_COUNT], struct td_errbuf *eb)
{
	for (int r = 0; r < TR_RECOMPUTE_COUNT; r++) {
		struct tr_plan q;
		struct tr_plan_opts po = *o;
		po.recompute = (enum tr_recompute)r; /* selective_layers: FULL's and FULL_OFFLOAD's */
		td_err e = tr_plan_build(&q, cfg, &po, eb);
		if (e != TD_OK)
			return e;
		if (acts)
			acts[r] = q.arena_bytes[TR_ARENA_ACTS];
		if (total)
			total[r] = tr_plan_total_bytes(&q);
		if (host)
			host[r] = tr_plan_host_bytes(&q);
		tr_plan_fini(&q);
	}
	return TD_OK;
}

td_err tr_plan_recompute_bytes(const struct tr_model_config *cfg, const struct tr_plan_opts *o,
			       size_t acts[TR_RECOMPUTE_COUNT], size_t total[TR_RECOMPUTE_COUNT],
			       struct td_errbuf *eb)
{
	return tr_plan_policy_bytes(cfg, o, acts, total, NULL, eb);
}
