/* Distillation (train/method_ops.h): a student (every tensor, or adapters
 * with distill.student_lora) learns from the next-token distributions of a
 * frozen teacher (distill.teacher_dir; NF4 with distill.teacher_nf4) that
 * shares its vocabulary. One micro-batch is the teacher's trunk, then the
 * student's forward with the chunked KL and cross-entropy terms
 * (tr_model_forward_distill). The job saves the student: a model dir, or an
 * adapter. Not the loss's math: train/model.c and the distill ops. */
#include "train/method_ops.h"

#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>

#include "train/safetensors.h"

#define TOKENIZER_MAX_BYTES (512u << 20)

static bool student_lora(const Traind__JobSpec *spec)
{
	return spec->distill && spec->distill->student_lora;
}

static td_err plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			struct tr_plan_opts *po, struct td_errbuf *eb)
{
	(void)spec, (void)cfg, (void)eb;
	po->distill = true;
	return TD_OK;
}

/* The teacher: its config, and an estimate that keeps the
 * stored-probabilities attention (at worst above what it uses) and the bf16
 * GEMM scratch when the job is bf16. */
static td_err teacher(const Traind__JobSpec *spec, int B, int T, struct tr__aux *aux,
		      struct td_errbuf *eb)
{
	aux->role = "teacher";
	aux->total = "student and teacher";
	aux->dir = spec->distill->teacher_dir;
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/config.json", aux->dir);
	td_err e = tr_config_load(&aux->cfg, path, eb);
	if (e != TD_OK)
		return tr__prefixed(eb, e, "distill.teacher_dir");
	struct tr_plan_opts *po = &aux->po;
	memset(po, 0, sizeof(*po));
	po->B = B;
	po->T = T;
	po->inference = true;
	po->teacher_rows = true; /* its logits come a chunk at a time, with the student's */
	po->gemm_bf16 = tr__job_bf16(spec);
	if (spec->distill->teacher_nf4) {
		po->base_quant = TR_QUANT_NF4;
		po->nf4_double_quant = spec->lora->double_quant;
	}
	return TD_OK;
}

/* tokenizer.json's model.vocab of dir into *vocab (NULL when there is none). */
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

/* The teacher shares the student's vocabulary: its size, and the tokens of
 * both tokenizer.json where both have one. */
static td_err check(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
		    const struct tr__aux *aux, struct td_errbuf *eb)
{
	const char *tdir = aux->dir;
	const struct tr_model_config *tcfg = &aux->cfg;
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

static td_err forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
		      const int32_t *class_ids, double *loss_sum, int64_t *n_valid,
		      struct td_errbuf *eb)
{
	(void)class_ids;
	td_err e = tr_model_forward_trunk(mt->aux, ids, eb);
	if (e != TD_OK)
		return e;
	struct tr_distill_sums s;
	const Traind__DistillSpec *d = mt->spec->distill;
	e = tr_model_forward_distill(mt->m, ids, labels, mt->aux, (float)d->temperature,
				     (float)d->alpha, &s, eb);
	if (e != TD_OK)
		return e;
	*loss_sum = s.loss_sum;
	*n_valid = s.n_valid;
	return TD_OK;
}

static td_err save(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		   struct td_errbuf *eb)
{
	return mt->adapter ? tr__save_adapter(mt, dir, dtype, eb) : tr__save_full(mt, dir, dtype, eb);
}

const struct tr__method_ops tr__method_distill = {
	.name = "distill",
	.adapter = student_lora,
	.plan_opts = plan_opts,
	.aux = teacher,
	.check = check,
	.forward = forward,
	.count_valid = tr__causal_count_valid,
	.save = save,
};
