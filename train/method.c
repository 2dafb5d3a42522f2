/* A job's training method (train/method.h): the table of methods and what
 * they share. Each method is a struct of hooks in its own file
 * (train/method_ops.h); this file looks it up once from the spec and runs the
 * common part of every entry point around the hooks.
 *
 *   method    trained model                         first weights            output
 *   FULL      every tensor                          model_dir                model dir
 *   LORA      adapters (base frozen, bf16 or fp32)  model_dir + adapter      PEFT adapter
 *   QLORA     adapters (base frozen, NF4)           model_dir + adapter      PEFT adapter
 *   DISTILL   student, full or LoRA; + teacher      model_dir, teacher_dir   model dir / adapter
 *   CLASSIFY  full or LoRA, + head score            model_dir (+ new head)   classifier dir / adapter
 * "adapter" is lora.init_adapter, or PEFT's initialisation from hyper.seed. A
 * frozen base (and a teacher) is stored in bf16 only in the bf16 mode, fp32
 * on the CPU (train/plan.h: frozen_bf16); QLoRA's embedding and lm_head too.
 * Not the methods' own logic: method_full.c, method_lora.c,
 * method_distill.c and method_classify.c hold that. */
#include "train/method_ops.h"

#include <assert.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "proto/jobspec.h"

/* The spec's method → its hooks. UNSPECIFIED is FULL (jobspec's default). */
static const struct tr__method_ops *const methods[] = {
	[TRAIND__METHOD__METHOD_UNSPECIFIED] = &tr__method_full,
	[TRAIND__METHOD__METHOD_FULL] = &tr__method_full,
	[TRAIND__METHOD__METHOD_LORA] = &tr__method_lora,
	[TRAIND__METHOD__METHOD_QLORA] = &tr__method_qlora,
	[TRAIND__METHOD__METHOD_DISTILL] = &tr__method_distill,
	[TRAIND__METHOD__METHOD_CLASSIFY] = &tr__method_classify,
};

td_err tr__method_lookup(const Traind__JobSpec *spec, const struct tr__method_ops **out,
			 struct td_errbuf *eb)
{
	unsigned m = (unsigned)spec->method;
	const struct tr__method_ops *ops =
		m < sizeof(methods) / sizeof(methods[0]) ? methods[m] : NULL;
	if (!ops)
		return td_fail(eb, TD_EINVAL, "method: unknown value %d", (int)spec->method);
	assert(ops->name && ops->adapter && ops->forward && ops->count_valid && ops->save);
	*out = ops;
	return TD_OK;
}

/* --- what the methods share --- */

uint64_t tr__mix64(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

uint64_t tr__method_seed(const Traind__JobSpec *spec, uint64_t what)
{
	return tr__mix64(spec->hyper->seed ^ tr__mix64(what));
}

td_err tr__prefixed(struct td_errbuf *eb, td_err e, const char *what)
{
	if (!eb)
		return e;
	char msg[sizeof(eb->msg)];
	memcpy(msg, eb->msg, sizeof(msg));
	return td_fail(eb, e, "%s: %s", what, msg);
}

bool tr__job_bf16(const Traind__JobSpec *spec)
{
	Traind__Precision prec = spec->hyper->precision;
	return prec == TRAIND__PRECISION__PRECISION_BF16 ||
	       (prec == TRAIND__PRECISION__PRECISION_UNSPECIFIED &&
		spec->resources->device != TRAIND__DEVICE__DEVICE_CPU);
}

/* --- plan options --- */

/* The trained model's options: the common part, then the method's. */
static td_err plan_opts(const struct tr__method_ops *ops, const Traind__JobSpec *spec,
			const struct tr_model_config *cfg, int B, int T, struct tr_plan_opts *po,
			bool warn, struct td_errbuf *eb)
{
	memset(po, 0, sizeof(*po));
	po->B = B;
	po->T = T;
	/* The gang's sharding; AUTO (the scheduler writes its choice into the
	 * spec it runs) is NONE, the fastest. An estimate plans rank 0 of
	 * resources.gpus (every rank's plan has the same bytes); tr_method_new
	 * plans the rank it builds. */
	po->shard = tr_method_shard(spec);
	po->shard_ranks = spec->resources && spec->resources->gpus > 1 ? (int)spec->resources->gpus : 0;
	/* a step's micro-batches (validated: at least 1) bound an untied
	 * embedding's gradient rows (train/plan.h: emb_slots) */
	if (spec->hyper)
		po->grad_accum = spec->hyper->grad_accum > INT_MAX ? INT_MAX : (int)spec->hyper->grad_accum;
	td_err e;
	if (ops->adapter(spec) && (e = tr__adapter_plan_opts(spec, po, warn, eb)) != TD_OK)
		return e;
	/* A model built on a backend takes these from it (tr_model_new); an
	 * estimate made before there is one follows the precision the job will
	 * run in: bf16 is the CUDA backend's, whose attention is fused for these
	 * head sizes and whose GEMMs round their operands into a scratch. */
	bool bf16 = tr__job_bf16(spec);
	po->attention_lse = bf16 && gpu_flash_head_size(cfg->head_dim);
	po->gemm_bf16 = bf16;
	return ops->plan_opts ? ops->plan_opts(spec, cfg, po, eb) : TD_OK;
}

td_err tr_method_selective_layer_bytes(const Traind__JobSpec *spec,
				       const struct tr_model_config *cfg,
				       const struct tr_plan_opts *po, int k, uint64_t base,
				       uint64_t *per, struct td_errbuf *eb)
{
	const Traind__MemorySpec *m = spec->memory;
	const Traind__Resources *r = spec->resources;
	*per = 0;
	if (!tr_recompute_full((enum tr_recompute)k) || (m && m->has_selective_layers) ||
	    (r && (r->gpus > 1 || r->n_hosts > 0)) || po->selective_layers >= cfg->num_layers)
		return TD_OK;
	uint64_t b[2];
	const int n[2] = {po->selective_layers + 1, cfg->num_layers};
	for (int i = 0; i < 2; i++) {
		struct tr_plan_opts q = *po;
		q.recompute = (enum tr_recompute)k;
		q.selective_layers = n[i];
		struct tr_plan p;
		td_err e = tr_plan_build(&p, cfg, &q, eb);
		if (e != TD_OK)
			return e;
		b[i] = tr_plan_total_bytes(&p);
		tr_plan_fini(&p);
	}
	const uint64_t one = b[0] > base ? b[0] - base : 0;
	const uint64_t more = (uint64_t)(cfg->num_layers - po->selective_layers);
	*per = one && b[1] == base + more * one ? one : 0;
	return TD_OK;
}

/* Under FULL or FULL_OFFLOAD with memory.max_bytes and memory.selective_layers
 * unset, on one GPU: as many selective layers as the bound holds (room: the
 * bytes left for this model's plan, base of them its plan's now), each a
 * layer's products not recomputed — the fastest plan between the policy's
 * and the next faster one's, each layer the same bytes
 * (tr_method_selective_layer_bytes). Not on a gang or across daemons: a
 * sharding the scheduler picks later would change what fits, and the lease
 * must hold the plan the ranks build. */
static td_err most_selective(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			     struct tr_plan_opts *po, uint64_t base, uint64_t room,
			     struct td_errbuf *eb)
{
	uint64_t per;
	td_err e = tr_method_selective_layer_bytes(spec, cfg, po, (int)po->recompute, base, &per, eb);
	if (e != TD_OK || !per)
		return e;
	po->selective_layers +=
		tr_method_selective_fit(room - base, per, cfg->num_layers - po->selective_layers);
	return TD_OK;
}

/* memory.recompute into po (the rest of po set), held to memory.max_bytes
 * when that is set: the job's plan, this model's and the method's other
 * model's (a teacher's), must fit. AUTO is NONE, or with a bound the least
 * recompute that fits it; FULL and FULL_OFFLOAD under a bound take as many
 * selective layers as fit where the spec does not say (most_selective). */
static td_err choose_recompute(const struct tr__method_ops *ops, const Traind__JobSpec *spec,
			       const struct tr_model_config *cfg, struct tr_plan_opts *po,
			       struct td_errbuf *eb)
{
	const Traind__MemorySpec *ms = spec->memory;
	Traind__Recompute r = ms && ms->has_recompute ? ms->recompute
						      : TRAIND__RECOMPUTE__RECOMPUTE_UNSPECIFIED;
	uint64_t max = ms && ms->has_max_bytes ? ms->max_bytes : 0;
	bool aut = false;
	switch (r) {
	case TRAIND__RECOMPUTE__RECOMPUTE_UNSPECIFIED:
	case TRAIND__RECOMPUTE__RECOMPUTE_AUTO:
		aut = true;
		po->recompute = TR_RECOMPUTE_NONE;
		break;
	case TRAIND__RECOMPUTE__RECOMPUTE_NONE:
		po->recompute = TR_RECOMPUTE_NONE;
		break;
	case TRAIND__RECOMPUTE__RECOMPUTE_SELECTIVE:
		po->recompute = TR_RECOMPUTE_SELECTIVE;
		break;
	case TRAIND__RECOMPUTE__RECOMPUTE_FULL:
		po->recompute = TR_RECOMPUTE_FULL;
		break;
	case TRAIND__RECOMPUTE__RECOMPUTE_FULL_OFFLOAD:
		po->recompute = TR_RECOMPUTE_FULL_OFFLOAD;
		break;
	default:
		return td_fail(eb, TD_EINVAL, "memory.recompute: unknown value %d", (int)r);
	}
	/* under FULL and FULL_OFFLOAD (AUTO's too), in every plan below */
	po->selective_layers = ms && ms->selective_layers > (uint32_t)INT_MAX ? INT_MAX
			       : ms ? (int)ms->selective_layers : 0;
	if (!max)
		return TD_OK;
	size_t other = 0, acts[TR_RECOMPUTE_COUNT], total[TR_RECOMPUTE_COUNT];
	td_err e;
	if (ops->aux) {
		struct tr__aux aux;
		struct tr_plan ap;
		if ((e = ops->aux(spec, po->B, po->T, &aux, eb)) != TD_OK ||
		    (e = tr_plan_build(&ap, &aux.cfg, &aux.po, eb)) != TD_OK)
			return e;
		other = tr_plan_total_bytes(&ap);
		tr_plan_fini(&ap);
	}
	if ((e = tr_plan_recompute_bytes(cfg, po, acts, total, eb)) != TD_OK)
		return e;
	for (int k = aut ? 0 : (int)po->recompute; k < (aut ? TR_RECOMPUTE_COUNT : (int)po->recompute + 1);
	     k++) {
		if (total[k] + other <= max) {
			po->recompute = (enum tr_recompute)k;
			return most_selective(spec, cfg, po, total[k], max - other, eb);
		}
	}
	/* AUTO: the last policy's plan, the smallest on the device */
	const int k = aut ? TR_RECOMPUTE_COUNT - 1 : (int)po->recompute;
	char b1[32], b2[32], sel[64] = "";
	if (po->selective_layers > 0 && tr_recompute_full((enum tr_recompute)k))
		snprintf(sel, sizeof(sel), ", memory.selective_layers %d",
			 po->selective_layers);
	return td_fail(eb, TD_ERANGE,
		       "memory.max_bytes: %s (%llu bytes), but the job's plan needs %s (%zu bytes) with "
		       "recompute %s%s at micro-batch %d x sequence %d",
		       tr_fmt_bytes(b1, sizeof(b1), max), (unsigned long long)max,
		       tr_fmt_bytes(b2, sizeof(b2), total[k] + other), total[k] + other,
		       tr_recompute_name((enum tr_recompute)k), sel, po->B, po->T);
}

static td_err method_plan_opts(const struct tr__method_ops *ops, const Traind__JobSpec *spec,
			       const struct tr_model_config *cfg, int B, int T,
			       struct tr_plan_opts *po, struct td_errbuf *eb)
{
	td_err e = plan_opts(ops, spec, cfg, B, T, po, false, eb);
	if (e == TD_OK)
		e = choose_recompute(ops, spec, cfg, po, eb);
	return e;
}

td_err tr_method_plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B,
			   int T, struct tr_plan_opts *po, struct td_errbuf *eb)
{
	const struct tr__method_ops *ops;
	td_err e = tr__method_lookup(spec, &ops, eb);
	return e == TD_OK ? method_plan_opts(ops, spec, cfg, B, T, po, eb) : e;
}

/* --- checks from configs --- */

td_err tr_method_check(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
		       struct td_errbuf *eb)
{
	const struct tr__method_ops *ops;
	struct tr_plan_opts po;
	td_err e = tr__method_lookup(spec, &ops, eb);
	if (e == TD_OK)
		e = plan_opts(ops, spec, cfg, 1, 2, &po, true, eb);
	if (e == TD_OK) /* the policy's value; its bound is checked at the job's shape */
		e = choose_recompute(ops, spec, cfg, &po, eb);
	if (e != TD_OK)
		return e;
	if (ops->check) {
		struct tr__aux aux;
		if (ops->aux && (e = ops->aux(spec, 1, 2, &aux, eb)) != TD_OK)
			return e;
		if ((e = ops->check(spec, cfg, ops->aux ? &aux : NULL, eb)) != TD_OK)
			return e;
	}
	return tr__adapter_check(spec, ops->adapter(spec), cfg, po.num_labels, eb);
}

/* The other model's lines of a plan's printout, and the job's total (trained:
 * the trained model's bytes). */
static void print_aux(const struct tr__aux *aux, const struct tr_plan *ap, size_t trained,
		      FILE *out)
{
	fprintf(out, "%-11s%s\n", aux->role, aux->dir);
	tr_plan_print(ap, out);
	size_t total = trained + tr_plan_total_bytes(ap);
	char b[32];
	fprintf(out, "job total  %s (%zu bytes: %s)\n", tr_fmt_bytes(b, sizeof(b), total), total,
		aux->total);
}

td_err tr_method_print_plan(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B,
			    int T, FILE *out, struct td_errbuf *eb)
{
	const struct tr__method_ops *ops;
	struct tr_plan_opts po;
	struct tr_plan p;
	td_err e = tr__method_lookup(spec, &ops, eb);
	if (e != TD_OK || (e = method_plan_opts(ops, spec, cfg, B, T, &po, eb)) != TD_OK ||
	    (e = tr_plan_build(&p, cfg, &po, eb)) != TD_OK)
		return e;
	fprintf(out, "method     %s\n", rpc_method_name(spec->method));
	tr_plan_print(&p, out);
	size_t trained = tr_plan_total_bytes(&p);
	tr_plan_fini(&p);
	if (po.shard_ranks > 1) {
		/* A gang: each GPU's plan under each sharding this build has. */
		fprintf(out, "shard      each of %d GPUs' plan by memory.shard (recompute %s):", po.shard_ranks,
			tr_recompute_name(po.recompute));
		for (int k = 0; k < TR_SHARD_BUILT; k++) {
			struct tr_plan_opts so = po;
			so.shard = (enum tr_shard)k;
			if ((e = tr_plan_build(&p, cfg, &so, eb)) != TD_OK)
				return e;
			char b[32];
			fprintf(out, "%s %s %s (%zu bytes)", k ? ";" : "", tr_shard_name(so.shard),
				tr_fmt_bytes(b, sizeof(b), tr_plan_total_bytes(&p)), tr_plan_total_bytes(&p));
			tr_plan_fini(&p);
		}
		fprintf(out, "\n");
	}
	if (ops->aux) {
		struct tr__aux aux;
		if ((e = ops->aux(spec, B, T, &aux, eb)) != TD_OK ||
		    (e = tr_plan_build(&p, &aux.cfg, &aux.po, eb)) != TD_OK)
			return e;
		print_aux(&aux, &p, trained, out);
		tr_plan_fini(&p);
	}
	return TD_OK;
}

/* --- the models --- */

enum tr_shard tr_method_shard(const Traind__JobSpec *spec)
{
	const Traind__MemorySpec *ms = spec->memory;
	switch (ms && ms->has_shard ? ms->shard : TRAIND__SHARD__SHARD_UNSPECIFIED) {
	case TRAIND__SHARD__SHARD_OPTIMIZER: return TR_SHARD_OPTIMIZER;
	case TRAIND__SHARD__SHARD_GRADIENTS: return TR_SHARD_GRADIENTS;
	case TRAIND__SHARD__SHARD_PARAMETERS: return TR_SHARD_PARAMETERS;
	default: return TR_SHARD_NONE;
	}
}

bool tr_method_can_share_base(const Traind__JobSpec *spec)
{
	/* A causal LM's adapters on a frozen base: no other model (a teacher),
	 * no trained head (a classifier's). */
	return spec->method == TRAIND__METHOD__METHOD_LORA ||
	       spec->method == TRAIND__METHOD__METHOD_QLORA;
}

td_err tr_method_base_layout(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			     struct gpu_backend *be, int B, int T, char sig[65], size_t *bytes,
			     struct td_errbuf *eb)
{
	struct tr_plan_opts po;
	struct tr_plan p;
	td_err e = tr_method_plan_opts(spec, cfg, B, T, &po, eb);
	if (e != TD_OK)
		return e;
	/* As tr_model_new plans on be. */
	po.attention_lse = gpu_attention_flash(be, cfg->head_dim);
	po.gemm_bf16 = gpu_gemm_bf16(be);
	if ((e = tr_plan_build(&p, cfg, &po, eb)) != TD_OK)
		return e;
	tr_plan_base_signature(&p, sig);
	*bytes = tr_plan_base_bytes(&p);
	tr_plan_fini(&p);
	return TD_OK;
}

static td_err method_new(struct tr_method **out, const Traind__JobSpec *spec,
			 const struct tr_model_config *cfg, struct gpu_backend *be, int B, int T,
			 int rank, int ranks, void *base, size_t base_bytes, bool loaded,
			 struct td_errbuf *eb)
{
	const struct tr__method_ops *ops;
	td_err e = tr__method_lookup(spec, &ops, eb);
	if (e != TD_OK)
		return e;
	struct tr_method *mt = calloc(1, sizeof(*mt));
	if (!mt)
		return td_fail(eb, TD_ENOMEM, "method: out of memory");
	mt->ops = ops;
	mt->spec = spec;
	mt->cfg = *cfg;
	mt->be = be;
	mt->B = B;
	mt->T = T;
	mt->adapter = ops->adapter(spec);
	mt->pad_override = -2;
	struct tr_plan_opts po;
	e = method_plan_opts(ops, spec, cfg, B, T, &po, eb);
	po.shard_ranks = ranks > 1 ? ranks : 0;
	po.shard_rank = ranks > 1 ? rank : 0;
	if (e == TD_OK)
		e = base ? tr_model_new_shared(&mt->m, be, cfg, &po, base, base_bytes, loaded, eb)
			 : tr_model_new(&mt->m, be, cfg, &po, eb);
	mt->num_labels = po.num_labels;
	if (e == TD_OK && ops->aux)
		e = ops->aux(spec, B, T, &mt->aux_info, eb);
	if (e == TD_OK && ops->check)
		e = ops->check(spec, cfg, ops->aux ? &mt->aux_info : NULL, eb);
	if (e == TD_OK && ops->aux)
		e = tr_model_new(&mt->aux, be, &mt->aux_info.cfg, &mt->aux_info.po, eb);
	if (e != TD_OK) {
		tr_method_free(mt);
		return e;
	}
	*out = mt;
	return TD_OK;
}

td_err tr_method_new(struct tr_method **out, const Traind__JobSpec *spec,
		     const struct tr_model_config *cfg, struct gpu_backend *be, int B, int T,
		     int rank, int ranks, struct td_errbuf *eb)
{
	return method_new(out, spec, cfg, be, B, T, rank, ranks, NULL, 0, false, eb);
}

td_err tr_method_new_shared(struct tr_method **out, const Traind__JobSpec *spec,
			    const struct tr_model_config *cfg, struct gpu_backend *be, int B, int T,
			    void *base, size_t base_bytes, bool loaded, struct td_errbuf *eb)
{
	if (!tr_method_can_share_base(spec))
		return td_fail(eb, TD_EINVAL, "method: %s does not share a frozen base",
			       rpc_method_name(spec->method));
	return method_new(out, spec, cfg, be, B, T, 0, 1, base, base_bytes, loaded, eb);
}

void tr_method_free(struct tr_method *mt)
{
	if (!mt)
		return;
	tr_model_free(mt->aux);
	tr_model_free(mt->m);
	free(mt);
}

struct tr_model *tr_method_model(struct tr_method *mt)
{
	return mt->m;
}

struct tr_model *tr_method_teacher(struct tr_method *mt)
{
	return mt->aux;
}

size_t tr_method_total_bytes(const struct tr_method *mt)
{
	return tr_plan_total_bytes(tr_model_plan(mt->m)) +
	       (mt->aux ? tr_plan_total_bytes(tr_model_plan(mt->aux)) : 0);
}

void tr_method_print(const struct tr_method *mt, FILE *out)
{
	fprintf(out, "method     %s\n", rpc_method_name(mt->spec->method));
	tr_plan_print(tr_model_plan(mt->m), out);
	if (mt->aux)
		print_aux(&mt->aux_info, tr_model_plan(mt->aux),
			  tr_plan_total_bytes(tr_model_plan(mt->m)), out);
}

/* What every load ends with: the method's part, then the other model's weights. */
static td_err finish_load(struct tr_method *mt, const char *saved_dir, struct td_errbuf *eb)
{
	td_err e = TD_OK;
	if (mt->ops->loaded && (e = mt->ops->loaded(mt, saved_dir, eb)) != TD_OK)
		return e;
	if (mt->aux) {
		struct tr_weights *aw = NULL;
		if ((e = tr_weights_open(&aw, mt->aux_info.dir, eb)) != TD_OK)
			return e;
		e = tr_model_load(mt->aux, aw, eb);
		tr_weights_close(aw);
	}
	return e;
}

td_err tr_method_load_initial(struct tr_method *mt, const struct tr_weights *w,
			      struct td_errbuf *eb)
{
	td_err e = tr_model_load(mt->m, w, eb);
	if (e == TD_OK && mt->adapter)
		e = tr__adapter_load_initial(mt, eb);
	return e == TD_OK ? finish_load(mt, NULL, eb) : e;
}

td_err tr_method_load_saved(struct tr_method *mt, const char *dir, struct td_errbuf *eb)
{
	/* An adapter's checkpoint holds the adapters only: the base comes from
	 * model_dir again (re-quantized for QLoRA: the same bits). */
	struct tr_weights *w = NULL;
	td_err e = tr_weights_open(&w, mt->adapter ? mt->spec->model_dir : dir, eb);
	if (e != TD_OK)
		return e;
	e = tr_model_load(mt->m, w, eb);
	tr_weights_close(w);
	if (e == TD_OK && mt->adapter)
		e = tr__adapter_load_saved(mt, dir, eb);
	return e == TD_OK ? finish_load(mt, dir, eb) : e;
}

/* --- the step --- */

void tr_method_fuse_head(struct tr_method *mt, float dloss)
{
	if (mt->ops->fuse_head)
		mt->ops->fuse_head(mt, dloss);
}

td_err tr_method_forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
			 const int32_t *class_ids, uint64_t micro, double *loss_sum,
			 int64_t *n_valid, struct td_errbuf *eb)
{
	tr_model_set_dropout_seed(mt->m,
				  tr__method_seed(mt->spec, TR__SEED_DROPOUT) ^ tr__mix64(micro));
	return mt->ops->forward(mt, ids, labels, class_ids, loss_sum, n_valid, eb);
}

int64_t tr_method_count_valid(const struct tr_method *mt, const int32_t *labels,
			      const int32_t *class_ids)
{
	return mt->ops->count_valid(mt, labels, class_ids);
}

void tr_method_set_pad_id(struct tr_method *mt, int pad)
{
	mt->pad_override = pad;
	if (mt->num_labels > 0) /* only a classifier's head pools */
		tr_model_set_pad_id(mt->m, pad);
}

bool tr_method_has_eval(const struct tr_method *mt)
{
	return mt->ops->eval != NULL;
}

td_err tr_method_eval(struct tr_method *mt, const struct tr_data *d, uint64_t max_batches,
		      uint64_t step, FILE *log, double *loss, struct td_errbuf *eb)
{
	if (!mt->ops->eval)
		return td_fail(eb, TD_EUNSUPPORTED, "eval: method %s has no evaluation of its own",
			       mt->ops->name);
	return mt->ops->eval(mt, d, max_batches, step, log, loss, eb);
}

td_err tr_method_save(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		      struct td_errbuf *eb)
{
	return mt->ops->save(mt, dir, dtype, eb);
}
