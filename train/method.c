/* A job's training method (train/method.h).
 *
 *   method    trained model                         first weights            output
 *   FULL      every tensor                          model_dir                model dir
 *   LORA      adapters (base frozen, bf16 or fp32)  model_dir + adapter      PEFT adapter
 *   QLORA     adapters (base frozen, NF4)           model_dir + adapter      PEFT adapter
 *   DISTILL   student, full or LoRA; + teacher      model_dir, teacher_dir   model dir / adapter
 *   CLASSIFY  full or LoRA, + head score            model_dir (+ new head)   classifier dir / adapter
 * "adapter" is lora.init_adapter, or PEFT's initialisation from hyper.seed. A
 * frozen base (and a teacher) is stored in bf16 only in the bf16 mode, fp32
 * on the CPU (train/plan.h: frozen_bf16); QLoRA's embedding and lm_head too. */
#include "train/method.h"

#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/backend.h"
#include "proto/jobspec.h"
#include "proto/log.h"
#include "train/classify.h"
#include "train/data.h"
#include "train/lora.h"

#define TOKENIZER_MAX_BYTES (512u << 20)

struct tr_method {
	const Traind__JobSpec *spec;
	struct tr_model_config cfg, tcfg;
	struct gpu_backend *be;
	struct tr_model *m, *teacher;
	int B, T;
	bool lora;
	int num_labels;
	int pad_override;           /* tr_method_set_pad_id; -2: none */
};

static Traind__Method method_of(const Traind__JobSpec *spec)
{
	return spec->method == TRAIND__METHOD__METHOD_UNSPECIFIED ? TRAIND__METHOD__METHOD_FULL
								  : spec->method;
}

/* Whether the trained model carries LoRA adapters. */
static bool uses_lora(const Traind__JobSpec *spec)
{
	switch (method_of(spec)) {
	case TRAIND__METHOD__METHOD_LORA:
	case TRAIND__METHOD__METHOD_QLORA:
		return true;
	case TRAIND__METHOD__METHOD_DISTILL:
		return spec->distill && spec->distill->student_lora;
	case TRAIND__METHOD__METHOD_CLASSIFY:
		return spec->classify && spec->classify->lora;
	default:
		return false;
	}
}

static uint64_t mix64(uint64_t z)
{
	z += 0x9e3779b97f4a7c15ULL;
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/* Seeds of the method's random draws, each its own stream of hyper.seed. */
enum { SEED_LORA_INIT = 1, SEED_HEAD_INIT = 2, SEED_DROPOUT = 3 };

static uint64_t seed_for(const Traind__JobSpec *spec, uint64_t what)
{
	return mix64(spec->hyper->seed ^ mix64(what));
}

/* --- plan options --- */

/* Puts "what: " before the message already in eb. */
static td_err prefixed(struct td_errbuf *eb, td_err e, const char *what)
{
	if (!eb)
		return e;
	char msg[sizeof(eb->msg)];
	memcpy(msg, eb->msg, sizeof(msg));
	return td_fail(eb, e, "%s: %s", what, msg);
}

static td_err teacher_config(const Traind__JobSpec *spec, struct tr_model_config *tcfg,
			     struct td_errbuf *eb)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/config.json", spec->distill->teacher_dir);
	td_err e = tr_config_load(tcfg, path, eb);
	if (e != TD_OK)
		return prefixed(eb, e, "distill.teacher_dir");
	return TD_OK;
}

/* Whether the job will run in bf16: asked, or unset and not bound to the
 * CPU (train/trainer.c sets the backend's precision by the same rule, where
 * unset on a GPU means bf16). */
static bool job_bf16(const Traind__JobSpec *spec)
{
	Traind__Precision prec = spec->hyper->precision;
	return prec == TRAIND__PRECISION__PRECISION_BF16 ||
	       (prec == TRAIND__PRECISION__PRECISION_UNSPECIFIED &&
		spec->resources->device != TRAIND__DEVICE__DEVICE_CPU);
}

/* The teacher's estimate keeps the stored-probabilities attention (at worst
 * above what it uses) and the bf16 GEMM scratch when the job is bf16. */
static void teacher_opts(const Traind__JobSpec *spec, int B, int T, struct tr_plan_opts *po)
{
	memset(po, 0, sizeof(*po));
	po->B = B;
	po->T = T;
	po->inference = true;
	po->teacher_rows = true; /* its logits come a chunk at a time, with the student's */
	po->gemm_bf16 = job_bf16(spec);
	if (spec->distill->teacher_nf4) {
		po->base_quant = TR_QUANT_NF4;
		po->nf4_double_quant = spec->lora->double_quant;
	}
}

static td_err plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B, int T,
			struct tr_plan_opts *po, bool warn, struct td_errbuf *eb)
{
	memset(po, 0, sizeof(*po));
	po->B = B;
	po->T = T;
	Traind__Method meth = method_of(spec);
	if (uses_lora(spec)) {
		const Traind__LoraSpec *l = spec->lora;
		po->lora_rank = (int)l->rank;
		po->lora_alpha = l->alpha;
		po->lora_dropout = (float)l->dropout;
		for (size_t i = 0; i < l->n_target_modules; i++) {
			int lin = tr_lin_from_name(l->target_modules[i]);
			if (lin < 0)
				return td_fail(eb, TD_EINVAL, "lora.target_modules[%zu]: unknown module '%s'", i,
					       l->target_modules[i]);
			po->lora_targets |= 1u << lin;
		}
		if (!po->lora_targets)
			po->lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_V;
		if (l->init_adapter) {
			/* The adapter's shape wins: it is what the tensors have. */
			struct tr_lora_config lc;
			td_err e = tr_lora_config_load(&lc, l->init_adapter, eb);
			if (e != TD_OK)
				return prefixed(eb, e, "lora.init_adapter");
			if (warn && (lc.r != po->lora_rank || lc.targets != po->lora_targets ||
				     lc.alpha != po->lora_alpha))
				td_warn("TD-LORA-INIT",
					"lora.init_adapter %s has r=%d alpha=%g on its own targets; the "
					"lora section's rank %d, alpha %g and targets are not used",
					l->init_adapter, lc.r, lc.alpha, po->lora_rank, po->lora_alpha);
			po->lora_rank = lc.r;
			po->lora_alpha = lc.alpha;
			po->lora_targets = lc.targets;
			po->lora_rslora = lc.rslora;
		}
	}
	if (meth == TRAIND__METHOD__METHOD_QLORA) {
		po->base_quant = TR_QUANT_NF4;
		po->nf4_double_quant = spec->lora->double_quant;
	}
	if (meth == TRAIND__METHOD__METHOD_DISTILL)
		po->distill = true;
	/* A model built on a backend takes these from it (tr_model_new); an
	 * estimate made before there is one follows the precision the job will
	 * run in: bf16 is the CUDA backend's, whose attention is fused for these
	 * head sizes and whose GEMMs round their operands into a scratch. */
	bool bf16 = job_bf16(spec);
	po->attention_lse = bf16 && gpu_flash_head_size(cfg->head_dim);
	po->gemm_bf16 = bf16;
	if (meth == TRAIND__METHOD__METHOD_CLASSIFY) {
		po->num_labels = (int)spec->classify->num_labels;
		if (cfg->num_labels > 0 && cfg->num_labels != po->num_labels)
			return td_fail(eb, TD_EMISMATCH,
				       "classify.num_labels: %d, but %s/config.json is a classifier of %d labels",
				       po->num_labels, spec->model_dir, cfg->num_labels);
	}
	return TD_OK;
}

/* memory.recompute into po (the rest of po set), held to memory.max_bytes
 * when that is set: the job's plan, this model's and a teacher's, must fit.
 * AUTO is NONE, or with a bound the least recompute that fits it. */
static td_err choose_recompute(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			       struct tr_plan_opts *po, struct td_errbuf *eb)
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
	if (!max)
		return TD_OK;
	size_t teacher = 0, acts[TR_RECOMPUTE_COUNT], total[TR_RECOMPUTE_COUNT];
	td_err e;
	if (method_of(spec) == TRAIND__METHOD__METHOD_DISTILL) {
		struct tr_model_config tcfg;
		struct tr_plan_opts to;
		struct tr_plan tp;
		teacher_opts(spec, po->B, po->T, &to);
		if ((e = teacher_config(spec, &tcfg, eb)) != TD_OK ||
		    (e = tr_plan_build(&tp, &tcfg, &to, eb)) != TD_OK)
			return e;
		teacher = tr_plan_total_bytes(&tp);
		tr_plan_fini(&tp);
	}
	if ((e = tr_plan_recompute_bytes(cfg, po, acts, total, eb)) != TD_OK)
		return e;
	for (int k = aut ? 0 : (int)po->recompute; k < (aut ? TR_RECOMPUTE_COUNT : (int)po->recompute + 1);
	     k++) {
		if (total[k] + teacher <= max) {
			po->recompute = (enum tr_recompute)k;
			return TD_OK;
		}
	}
	/* AUTO: the last policy's plan, the smallest on the device */
	const int k = aut ? TR_RECOMPUTE_COUNT - 1 : (int)po->recompute;
	char b1[32], b2[32];
	return td_fail(eb, TD_ERANGE,
		       "memory.max_bytes: %s (%llu bytes), but the job's plan needs %s (%zu bytes) with "
		       "recompute %s at micro-batch %d x sequence %d",
		       tr_fmt_bytes(b1, sizeof(b1), max), (unsigned long long)max,
		       tr_fmt_bytes(b2, sizeof(b2), total[k] + teacher), total[k] + teacher,
		       tr_recompute_name((enum tr_recompute)k), po->B, po->T);
}

td_err tr_method_plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B,
			   int T, struct tr_plan_opts *po, struct td_errbuf *eb)
{
	td_err e = plan_opts(spec, cfg, B, T, po, false, eb);
	if (e == TD_OK)
		e = choose_recompute(spec, cfg, po, eb);
	return e;
}

/* --- checks from configs --- */

/* tokenizer.json's model.vocab of dir into *out (NULL when there is none). */
static td_err read_vocab(const char *dir, json_object **root, json_object **vocab,
			 struct td_errbuf *eb)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/tokenizer.json", dir);
	*root = *vocab = NULL;
	td_err e = tr__json_read_file(root, path, TOKENIZER_MAX_BYTES, eb);
	if (e == TD_ENOENT)
		return TD_OK;
	if (e != TD_OK)
		return e;
	json_object *model;
	if (json_object_object_get_ex(*root, "model", &model))
		json_object_object_get_ex(model, "vocab", vocab);
	return TD_OK;
}

static td_err check_teacher(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			    const struct tr_model_config *tcfg, struct td_errbuf *eb)
{
	const char *tdir = spec->distill->teacher_dir;
	if (tcfg->vocab_size != cfg->vocab_size)
		return td_fail(eb, TD_EMISMATCH,
			       "distill.teacher_dir: the teacher %s has a vocabulary of %d tokens, the "
			       "student %s of %d; distillation compares their next-token distributions "
			       "token for token, so they must share one vocabulary",
			       tdir, tcfg->vocab_size, spec->model_dir, cfg->vocab_size);
	json_object *sr, *sv, *tr, *tv;
	td_err e = read_vocab(spec->model_dir, &sr, &sv, eb);
	if (e != TD_OK)
		return e;
	if ((e = read_vocab(tdir, &tr, &tv, eb)) != TD_OK) {
		json_object_put(sr);
		return e;
	}
	if (sv && tv && !json_object_equal(sv, tv))
		e = td_fail(eb, TD_EMISMATCH,
			    "distill.teacher_dir: %s/tokenizer.json and %s/tokenizer.json have different "
			    "vocabularies (the same %d ids name different tokens)",
			    tdir, spec->model_dir, cfg->vocab_size);
	json_object_put(sr);
	json_object_put(tr);
	return e;
}

td_err tr_method_check(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
		       struct td_errbuf *eb)
{
	struct tr_plan_opts po;
	td_err e = plan_opts(spec, cfg, 1, 2, &po, true, eb);
	if (e == TD_OK) /* the policy's value; its bound is checked at the job's shape */
		e = choose_recompute(spec, cfg, &po, eb);
	if (e != TD_OK)
		return e;
	if (method_of(spec) == TRAIND__METHOD__METHOD_DISTILL) {
		struct tr_model_config tcfg;
		if ((e = teacher_config(spec, &tcfg, eb)) != TD_OK ||
		    (e = check_teacher(spec, cfg, &tcfg, eb)) != TD_OK)
			return e;
	}
	if (uses_lora(spec) && spec->lora->init_adapter) {
		const char *dir = spec->lora->init_adapter;
		struct tr_lora_config lc;
		struct tr_st_file *f = NULL;
		char path[PATH_MAX];
		snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
		if ((e = tr_lora_config_load(&lc, dir, eb)) == TD_OK &&
		    (e = tr_st_open(&f, path, eb)) == TD_OK)
			e = tr_lora_check(&lc, cfg, po.num_labels, f, eb);
		tr_st_close(f);
		if (e != TD_OK)
			return prefixed(eb, e, "lora.init_adapter");
	} else if (spec->lora->init_adapter && !uses_lora(spec)) {
		td_warn("TD-LORA-UNUSED", "lora.init_adapter %s: method %s trains no adapter; ignored",
			spec->lora->init_adapter, rpc_method_name(spec->method));
	}
	return TD_OK;
}

td_err tr_method_print_plan(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B,
			    int T, FILE *out, struct td_errbuf *eb)
{
	struct tr_plan_opts po;
	struct tr_plan p;
	td_err e = tr_method_plan_opts(spec, cfg, B, T, &po, eb);
	if (e != TD_OK || (e = tr_plan_build(&p, cfg, &po, eb)) != TD_OK)
		return e;
	fprintf(out, "method     %s\n", rpc_method_name(spec->method));
	tr_plan_print(&p, out);
	size_t total = tr_plan_total_bytes(&p);
	tr_plan_fini(&p);
	if (method_of(spec) == TRAIND__METHOD__METHOD_DISTILL) {
		struct tr_model_config tcfg;
		if ((e = teacher_config(spec, &tcfg, eb)) != TD_OK)
			return e;
		teacher_opts(spec, B, T, &po);
		if ((e = tr_plan_build(&p, &tcfg, &po, eb)) != TD_OK)
			return e;
		fprintf(out, "teacher    %s\n", spec->distill->teacher_dir);
		tr_plan_print(&p, out);
		total += tr_plan_total_bytes(&p);
		tr_plan_fini(&p);
		char b[32];
		fprintf(out, "job total  %s (%zu bytes: student and teacher)\n",
			tr_fmt_bytes(b, sizeof(b), total), total);
	}
	return TD_OK;
}

/* --- the models --- */

td_err tr_method_new(struct tr_method **out, const Traind__JobSpec *spec,
		     const struct tr_model_config *cfg, struct gpu_backend *be, int B, int T,
		     struct td_errbuf *eb)
{
	struct tr_method *mt = calloc(1, sizeof(*mt));
	if (!mt)
		return td_fail(eb, TD_ENOMEM, "method: out of memory");
	mt->spec = spec;
	mt->cfg = *cfg;
	mt->be = be;
	mt->B = B;
	mt->T = T;
	mt->lora = uses_lora(spec);
	mt->pad_override = -2;
	struct tr_plan_opts po;
	td_err e = tr_method_plan_opts(spec, cfg, B, T, &po, eb);
	if (e == TD_OK)
		e = tr_model_new(&mt->m, be, cfg, &po, eb);
	mt->num_labels = po.num_labels;
	if (e == TD_OK && method_of(spec) == TRAIND__METHOD__METHOD_DISTILL) {
		teacher_opts(spec, B, T, &po);
		if ((e = teacher_config(spec, &mt->tcfg, eb)) == TD_OK &&
		    (e = check_teacher(spec, cfg, &mt->tcfg, eb)) == TD_OK)
			e = tr_model_new(&mt->teacher, be, &mt->tcfg, &po, eb);
	}
	if (e != TD_OK) {
		tr_method_free(mt);
		return e;
	}
	*out = mt;
	return TD_OK;
}

void tr_method_free(struct tr_method *mt)
{
	if (!mt)
		return;
	tr_model_free(mt->teacher);
	tr_model_free(mt->m);
	free(mt);
}

struct tr_model *tr_method_model(struct tr_method *mt)
{
	return mt->m;
}

struct tr_model *tr_method_teacher(struct tr_method *mt)
{
	return mt->teacher;
}

size_t tr_method_total_bytes(const struct tr_method *mt)
{
	return tr_plan_total_bytes(tr_model_plan(mt->m)) +
	       (mt->teacher ? tr_plan_total_bytes(tr_model_plan(mt->teacher)) : 0);
}

void tr_method_print(const struct tr_method *mt, FILE *out)
{
	fprintf(out, "method     %s\n", rpc_method_name(mt->spec->method));
	tr_plan_print(tr_model_plan(mt->m), out);
	if (mt->teacher) {
		fprintf(out, "teacher    %s\n", mt->spec->distill->teacher_dir);
		tr_plan_print(tr_model_plan(mt->teacher), out);
		char b[32];
		size_t total = tr_method_total_bytes(mt);
		fprintf(out, "job total  %s (%zu bytes: student and teacher)\n",
			tr_fmt_bytes(b, sizeof(b), total), total);
	}
}

/* The pad id a classifier pools past: the config's, else the data's EOS
 * (what rows are padded with when the model has no pad token), else none. */
static int pad_id(const struct tr_method *mt)
{
	if (mt->pad_override != -2)
		return mt->pad_override;
	if (mt->cfg.pad_token_id >= 0)
		return mt->cfg.pad_token_id;
	if (mt->spec->data->has_eos_id)
		return (int)mt->spec->data->eos_id;
	return mt->cfg.eos_token_id;
}

/* transformers' init of a new Linear head: normal(0, initializer_range = 0.02). */
static td_err init_head(struct tr_method *mt, struct td_errbuf *eb)
{
	const struct tr_param *p = tr_plan_param(tr_model_plan(mt->m), "score.weight");
	float *h = malloc(p->numel * sizeof(float));
	if (!h)
		return td_fail(eb, TD_ENOMEM, "method: out of memory");
	uint64_t s = seed_for(mt->spec, SEED_HEAD_INIT);
	for (size_t i = 0; i < p->numel; i += 2) {
		/* Box-Muller on two uniforms in (0, 1]. */
		double u1 = ((double)(mix64(s++) >> 11) + 1.0) * 0x1.0p-53;
		double u2 = (double)(mix64(s++) >> 11) * 0x1.0p-53;
		double r = sqrt(-2.0 * log(u1)) * 0.02;
		h[i] = (float)(r * cos(2 * M_PI * u2));
		if (i + 1 < p->numel)
			h[i + 1] = (float)(r * sin(2 * M_PI * u2));
	}
	td_err e = tr_model_set_param(mt->m, p, h);
	free(h);
	if (e != TD_OK)
		return td_fail(eb, e, "method: cannot set score.weight: %s", td_strerror(e));
	return e;
}

/* What every load ends with: the teacher's weights, the head, the pad id. */
static td_err finish_load(struct tr_method *mt, struct td_errbuf *eb)
{
	td_err e = TD_OK;
	if (mt->num_labels > 0) {
		tr_model_set_pad_id(mt->m, pad_id(mt));
		if (!tr_model_head_loaded(mt->m) && (e = init_head(mt, eb)) != TD_OK)
			return e;
	}
	if (mt->teacher) {
		struct tr_weights *tw = NULL;
		if ((e = tr_weights_open(&tw, mt->spec->distill->teacher_dir, eb)) != TD_OK)
			return e;
		e = tr_model_load(mt->teacher, tw, eb);
		tr_weights_close(tw);
	}
	return e;
}

td_err tr_method_load_initial(struct tr_method *mt, const struct tr_weights *w,
			      struct td_errbuf *eb)
{
	td_err e = tr_model_load(mt->m, w, eb);
	if (e != TD_OK)
		return e;
	if (mt->lora) {
		const char *init = mt->spec->lora->init_adapter;
		e = init ? tr_lora_load(mt->m, init, eb)
			 : tr_lora_init(mt->m, seed_for(mt->spec, SEED_LORA_INIT), eb);
		if (e != TD_OK)
			return e;
	}
	return finish_load(mt, eb);
}

td_err tr_method_load_saved(struct tr_method *mt, const char *dir, struct td_errbuf *eb)
{
	struct tr_weights *w = NULL;
	td_err e = tr_weights_open(&w, mt->lora ? mt->spec->model_dir : dir, eb);
	if (e != TD_OK)
		return e;
	e = tr_model_load(mt->m, w, eb);
	tr_weights_close(w);
	if (e == TD_OK && mt->lora)
		e = tr_lora_load(mt->m, dir, eb);
	if (e == TD_OK && mt->num_labels > 0 && !tr_model_head_loaded(mt->m))
		return td_fail(eb, TD_EFORMAT, "%s: the checkpoint has no classifier head (score.weight)",
			       dir);
	return e == TD_OK ? finish_load(mt, eb) : e;
}

void tr_method_fuse_head(struct tr_method *mt, float dloss)
{
	if (mt->num_labels == 0 && !mt->teacher)
		tr_model_fuse_head_backward(mt->m, dloss);
}

td_err tr_method_forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
			 const int32_t *class_ids, uint64_t micro, double *loss_sum,
			 int64_t *n_valid, struct td_errbuf *eb)
{
	tr_model_set_dropout_seed(mt->m, seed_for(mt->spec, SEED_DROPOUT) ^ mix64(micro));
	if (mt->num_labels > 0) {
		if (!class_ids)
			return td_fail(eb, TD_EINVAL, "classify: the rows have no labels");
		return tr_model_forward_classify(mt->m, ids, class_ids, loss_sum, n_valid, eb);
	}
	if (!mt->teacher)
		return tr_model_forward(mt->m, ids, labels, loss_sum, n_valid, eb);
	td_err e = tr_model_forward_trunk(mt->teacher, ids, eb);
	if (e != TD_OK)
		return e;
	struct tr_distill_sums s;
	const Traind__DistillSpec *d = mt->spec->distill;
	e = tr_model_forward_distill(mt->m, ids, labels, mt->teacher, (float)d->temperature,
				     (float)d->alpha, &s, eb);
	if (e != TD_OK)
		return e;
	*loss_sum = s.loss_sum;
	*n_valid = s.n_valid;
	return TD_OK;
}

int64_t tr_method_count_valid(const struct tr_method *mt, const int32_t *labels,
			      const int32_t *class_ids)
{
	int64_t valid = 0;
	if (mt->num_labels > 0) {
		for (int b = 0; class_ids && b < mt->B; b++)
			valid += class_ids[b] != -100;
		return valid;
	}
	for (int b = 0; b < mt->B; b++)
		for (int t = 1; t < mt->T; t++)
			valid += labels[(size_t)b * mt->T + t] != -100;
	return valid;
}

void tr_method_set_pad_id(struct tr_method *mt, int pad)
{
	mt->pad_override = pad;
	if (mt->num_labels > 0)
		tr_model_set_pad_id(mt->m, pad);
}

td_err tr_method_eval_classify(struct tr_method *mt, const struct tr_data *d, uint64_t max_batches,
			       uint64_t step, FILE *log, double *loss, struct td_errbuf *eb)
{
	if (mt->num_labels <= 0)
		return td_fail(eb, TD_EINVAL, "eval: not a classifier");
	const uint64_t B = (uint64_t)mt->B, T = (uint64_t)mt->T, n = tr_data_num_sequences(d);
	uint64_t batches = (n + B - 1) / B;
	if (max_batches && batches > max_batches)
		batches = max_batches;
	size_t rows = (size_t)(batches * B);
	int32_t *ids = malloc(B * T * sizeof(int32_t)), *labels = malloc(B * T * sizeof(int32_t));
	int32_t *gold = malloc(rows * sizeof(int32_t)), *pred = malloc(rows * sizeof(int32_t));
	float *logits = malloc(B * (size_t)mt->num_labels * sizeof(float));
	td_err e = TD_OK;
	if (!ids || !labels || !gold || !pred || !logits)
		e = td_fail(eb, TD_ENOMEM, "eval: out of memory");
	double sum = 0;
	int64_t count = 0;
	for (uint64_t k = 0; k < batches && e == TD_OK; k++) {
		int32_t *g = gold + k * B;
		for (uint64_t b = 0; b < B; b++) {
			if (k * B + b < n) {
				e = tr_data_sequence(d, k * B + b, ids + b * T, labels + b * T, &g[b], eb);
				if (e != TD_OK)
					break;
				continue;
			}
			for (uint64_t t = 0; t < T; t++) /* past the end: a padding row, no loss */
				ids[b * T + t] = pad_id(mt) >= 0 ? pad_id(mt) : 0;
			g[b] = -100;
		}
		if (e != TD_OK)
			break;
		double ls;
		int64_t nv;
		if ((e = tr_model_forward_classify(mt->m, ids, g, &ls, &nv, eb)) != TD_OK)
			break;
		tr_model_get_logits(mt->m, logits);
		tr_classify_argmax(pred + k * B, logits, (int)B, mt->num_labels);
		sum += ls;
		count += nv;
	}
	struct tr_class_metrics cm = {0};
	if (e == TD_OK)
		e = tr_classify_metrics(pred, gold, rows, mt->num_labels, &cm, eb);
	if (e == TD_OK) {
		*loss = count ? sum / (double)count : NAN;
		if (log)
			fprintf(log, "eval   %6llu  loss %.4f  accuracy %.4f  macro-F1 %.4f  (%zu rows)\n",
				(unsigned long long)step, *loss, cm.accuracy, cm.macro_f1, cm.n);
	}
	free(ids);
	free(labels);
	free(gold);
	free(pred);
	free(logits);
	return e;
}

static td_err save_full(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
			struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(mt->m);
	float *host = malloc(p->numel_params * sizeof(float));
	struct tr_save_tensor *ts = calloc(p->nparams, sizeof(*ts));
	if (!host || !ts) {
		free(host);
		free(ts);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory saving the model", dir);
	}
	size_t off = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		tr_model_get_param(mt->m, pp, host + off);
		ts[i].name = pp->name;
		ts[i].ndim = pp->ndim;
		ts[i].shape[0] = pp->shape[0];
		ts[i].shape[1] = pp->shape[1];
		ts[i].data = host + off;
		off += pp->numel;
	}
	td_err e = gpu_sync(mt->be, eb);
	if (e == TD_OK)
		e = tr_modeldir_save(dir, mt->spec->model_dir, &mt->cfg, ts, p->nparams, dtype,
				     mt->spec->output->shard_bytes, eb);
	if (e == TD_OK && mt->num_labels > 0) {
		const Traind__ClassifySpec *c = mt->spec->classify;
		e = tr_classify_write_config(dir, &mt->cfg, mt->num_labels,
					     c->n_label_names ? (const char *const *)c->label_names : NULL,
					     pad_id(mt), eb);
	}
	free(host);
	free(ts);
	return e;
}

td_err tr_method_save(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		      struct td_errbuf *eb)
{
	if (mt->lora)
		return tr_lora_save(mt->m, dir, mt->spec->model_dir, eb);
	return save_full(mt, dir, dtype, eb);
}
