/* Buckets of the gradients arena, summed as the backward finishes them
 * (train/ddp.h). */
#include "train/ddp.h"

#include <stdlib.h>
#include <string.h>

/* A trainable tensor's range of the arena and the stage after which its
 * gradient is final (an index into plan.stages; nstages: at the end). */
struct span {
	size_t off, end;
	size_t ready;
	bool summed;
};

struct tr_ddp {
	struct tr_model *m;
	struct gpu_comm *c;
	float *grads;
	size_t bucket_floats;
	bool overlap;
	struct span *spans; /* by offset */
	size_t nspans;
	size_t nstages;
	bool armed;
	td_err err;         /* the first error of a sum started from the hook */
	struct td_errbuf eb;
	struct tr_ddp_stats stats;
};

static int by_off(const void *a, const void *b)
{
	const struct span *x = a, *y = b;
	return x->off < y->off ? -1 : x->off > y->off;
}

/* Sums the runs of final, unsummed spans (final: ready <= done) that hold at
 * least min floats, in arena order. */
static void sum_runs(struct tr_ddp *d, size_t done, size_t min, bool at_finish)
{
	for (size_t i = 0; i < d->nspans && d->err == TD_OK;) {
		if (d->spans[i].summed || d->spans[i].ready > done) {
			i++;
			continue;
		}
		size_t k = i;
		while (k < d->nspans && !d->spans[k].summed && d->spans[k].ready <= done)
			k++;
		size_t off = d->spans[i].off, n = d->spans[k - 1].end - off;
		if (n >= min) {
			d->err = gpu_comm_all_reduce_sum(d->c, d->grads + off, n, &d->eb);
			for (size_t j = i; j < k; j++)
				d->spans[j].summed = true;
			d->stats.floats += n;
			if (at_finish)
				d->stats.at_finish++;
			else
				d->stats.overlapped++;
		}
		i = k;
	}
}

static void on_stage(void *ctx, const struct tr_stage *s)
{
	struct tr_ddp *d = ctx;
	if (!d->armed)
		return;
	size_t idx = (size_t)(s - tr_model_plan(d->m)->stages);
	sum_runs(d, idx, d->bucket_floats, false);
}

td_err tr_ddp_new(struct tr_ddp **out, struct tr_model *m, struct gpu_comm *c, size_t bucket_floats,
		  bool overlap, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(m);
	struct tr_ddp *d = calloc(1, sizeof(*d));
	if (!d || !(d->spans = calloc(p->nparams ? p->nparams : 1, sizeof(*d->spans)))) {
		free(d);
		return td_fail(eb, TD_ENOMEM, "data parallel: out of memory");
	}
	d->m = m;
	d->c = c;
	d->grads = tr_model_grads(m);
	d->bucket_floats = bucket_floats ? bucket_floats : TR_DDP_BUCKET_FLOATS;
	d->overlap = overlap || gpu_comm_async(c);
	d->nstages = p->nstages;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *t = &p->params[i];
		if (!t->trainable || !t->numel)
			continue;
		/* A decoder layer's tensors: after its backward. An untied head
		 * (lm_head, a classifier's score): after the head's last backward
		 * chunk (with the fused head, the forward's). The final norm: after
		 * its backward. The embedding (a tied head's too): at the end. */
		size_t ready = p->nstages;
		enum tr_stage_kind after = TR_STAGE_KIND_COUNT;
		if (t->layer >= 0)
			after = TR_STAGE_LAYER_BACKWARD;
		else if (t->kind == TR_P_HEAD || strcmp(t->name, "lm_head.weight") == 0)
			after = TR_STAGE_HEAD_BACKWARD;
		else if (strcmp(t->name, "model.norm.weight") == 0)
			after = TR_STAGE_FINAL_NORM_BACKWARD;
		for (size_t k = p->nforward; k < p->nstages; k++)
			if (p->stages[k].kind == after &&
			    (after != TR_STAGE_LAYER_BACKWARD || p->stages[k].layer == t->layer))
				ready = k; /* the last such stage */
		d->spans[d->nspans++] = (struct span){t->goffset, t->goffset + t->numel, ready, false};
	}
	qsort(d->spans, d->nspans, sizeof(*d->spans), by_off);
	tr_model_set_stage_hook(m, on_stage, d);
	*out = d;
	return TD_OK;
}

void tr_ddp_free(struct tr_ddp *d)
{
	if (!d)
		return;
	tr_model_set_stage_hook(d->m, NULL, NULL);
	free(d->spans);
	free(d);
}

void tr_ddp_arm(struct tr_ddp *d)
{
	d->armed = d->overlap;
}

td_err tr_ddp_finish(struct tr_ddp *d, struct td_errbuf *eb)
{
	d->armed = false;
	/* Whatever is left, final now: each remaining run in one sum. */
	sum_runs(d, d->nstages, 0, true);
	td_err e = d->err;
	if (e != TD_OK)
		snprintf(eb->msg, sizeof(eb->msg), "%s", d->eb.msg);
	else
		e = gpu_comm_wait(d->c, eb);
	for (size_t i = 0; i < d->nspans; i++)
		d->spans[i].summed = false;
	d->err = TD_OK;
	d->stats.steps++;
	return e;
}

void tr_ddp_get_stats(const struct tr_ddp *d, struct tr_ddp_stats *out)
{
	*out = d->stats;
}

td_err tr_ddp_gather_params(struct tr_ddp *d, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	if (p->opts.shard == TR_SHARD_NONE || p->opts.shard_ranks < 2 || !p->shard_numel)
		return TD_OK;
	td_err e = gpu_comm_all_gather(d->c, tr_model_params(d->m), p->shard_numel, eb);
	if (e == TD_OK)
		e = gpu_comm_wait(d->c, eb);
	if (e != TD_OK)
		return e;
	d->stats.gathered += p->numel_trainable_padded;
	tr_model_params_written(d->m, 0, p->shard_lo);
	tr_model_params_written(d->m, p->shard_hi, p->numel_trainable);
	return TD_OK;
}
