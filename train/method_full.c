/* Full fine-tuning (train/method_ops.h): every tensor of a causal LM is
 * trained, its first weights are model_dir's, and it saves a model dir. The
 * causal LM's loss, valid positions, fused head and full save live here;
 * LoRA's hooks are the same but for the adapters, and distillation and
 * classification use the save. Not the adapters (method_lora.c). */
#include "train/method_ops.h"

#include <stdlib.h>

#include "train/modeldir.h"

td_err tr__causal_forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
			  const int32_t *class_ids, double *loss_sum, int64_t *n_valid,
			  struct td_errbuf *eb)
{
	(void)class_ids;
	return tr_model_forward(mt->m, ids, labels, loss_sum, n_valid, eb);
}

int64_t tr__causal_count_valid(const struct tr_method *mt, const int32_t *labels,
			       const int32_t *class_ids)
{
	(void)class_ids;
	int64_t valid = 0;
	for (int b = 0; b < mt->B; b++)
		for (int t = 1; t < mt->T; t++)
			valid += labels[(size_t)b * mt->T + t] != -100;
	return valid;
}

/* A causal LM's head runs its backward a chunk at a time in the forward
 * (tr_model_fuse_head_backward). */
void tr__causal_fuse_head(struct tr_method *mt, float dloss)
{
	tr_model_fuse_head_backward(mt->m, dloss);
}

td_err tr__save_full(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
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
	free(host);
	free(ts);
	return e;
}

static bool no_adapter(const Traind__JobSpec *spec)
{
	(void)spec;
	return false;
}

const struct tr__method_ops tr__method_full = {
	.name = "full",
	.adapter = no_adapter,
	.fuse_head = tr__causal_fuse_head,
	.forward = tr__causal_forward,
	.count_valid = tr__causal_count_valid,
	.save = tr__save_full,
};
