/* Sequence classification (train/method_ops.h): a head score.weight
 * [num_labels, C] on the last non-pad token replaces lm_head; the model
 * under it is trained whole, or through adapters with classify.lora. A new
 * head starts as transformers' (normal, std 0.02, from hyper.seed). The loss
 * is per row; evaluation adds accuracy and macro-F1; the job saves a
 * classifier's model dir (its config naming the labels), or an adapter with
 * the head. Not the metrics' math or the config's writing: train/classify.h. */
#include "train/method_ops.h"

#include <math.h>
#include <stdlib.h>

#include "train/classify.h"
#include "train/data.h"

static bool classify_lora(const Traind__JobSpec *spec)
{
	return spec->classify && spec->classify->lora;
}

static td_err plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			struct tr_plan_opts *po, struct td_errbuf *eb)
{
	po->num_labels = (int)spec->classify->num_labels;
	if (cfg->num_labels > 0 && cfg->num_labels != po->num_labels)
		return td_fail(eb, TD_EMISMATCH,
			       "classify.num_labels: %d, but %s/config.json is a classifier of %d labels",
			       po->num_labels, spec->model_dir, cfg->num_labels);
	return TD_OK;
}

/* The pad id the head pools past: tr_method_set_pad_id's, else the config's,
 * else the data's EOS (what rows are padded with when the model has no pad
 * token), else the config's EOS. */
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
	uint64_t s = tr__method_seed(mt->spec, TR__SEED_HEAD_INIT);
	for (size_t i = 0; i < p->numel; i += 2) {
		/* Box-Muller on two uniforms in (0, 1]. */
		double u1 = ((double)(tr__mix64(s++) >> 11) + 1.0) * 0x1.0p-53;
		double u2 = (double)(tr__mix64(s++) >> 11) * 0x1.0p-53;
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

/* A checkpoint has its head; the first weights may not (a causal LM's dir):
 * then a new one. Either way the head pools past pad_id. */
static td_err loaded(struct tr_method *mt, const char *saved_dir, struct td_errbuf *eb)
{
	if (saved_dir && !tr_model_head_loaded(mt->m))
		return td_fail(eb, TD_EFORMAT, "%s: the checkpoint has no classifier head (score.weight)",
			       saved_dir);
	tr_model_set_pad_id(mt->m, pad_id(mt));
	return tr_model_head_loaded(mt->m) ? TD_OK : init_head(mt, eb);
}

static td_err forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
		      const int32_t *class_ids, double *loss_sum, int64_t *n_valid,
		      struct td_errbuf *eb)
{
	(void)labels;
	if (!class_ids)
		return td_fail(eb, TD_EINVAL, "classify: the rows have no labels");
	return tr_model_forward_classify(mt->m, ids, class_ids, loss_sum, n_valid, eb);
}

/* Rows whose class is not -100. */
static int64_t count_valid(const struct tr_method *mt, const int32_t *labels,
			   const int32_t *class_ids)
{
	(void)labels;
	int64_t valid = 0;
	for (int b = 0; class_ids && b < mt->B; b++)
		valid += class_ids[b] != -100;
	return valid;
}

/* Mean loss over rows, accuracy and macro-F1; forward only, without dropout. */
static td_err eval(struct tr_method *mt, const struct tr_data *d, uint64_t max_batches,
		   uint64_t step, FILE *log, double *loss, struct td_errbuf *eb)
{
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

/* An adapter (with the head), or the model dir with a classifier's config. */
static td_err save(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		   struct td_errbuf *eb)
{
	if (mt->adapter)
		return tr__save_adapter(mt, dir, dtype, eb);
	td_err e = tr__save_full(mt, dir, dtype, eb);
	if (e != TD_OK)
		return e;
	const Traind__ClassifySpec *c = mt->spec->classify;
	return tr_classify_write_config(dir, &mt->cfg, mt->num_labels,
					c->n_label_names ? (const char *const *)c->label_names : NULL,
					pad_id(mt), eb);
}

const struct tr__method_ops tr__method_classify = {
	.name = "classify",
	.adapter = classify_lora,
	.plan_opts = plan_opts,
	.loaded = loaded,
	.forward = forward,
	.count_valid = count_valid,
	.eval = eval,
	.save = save,
};
