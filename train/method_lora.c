/* LoRA and QLoRA (train/method_ops.h): adapters on a frozen base (QLoRA's in
 * NF4) are trained; their first weights are lora.init_adapter or PEFT's
 * initialisation from hyper.seed, and the job saves a PEFT adapter. The
 * tr__adapter_* helpers serve every method that trains adapters (a
 * distillation's student_lora, a classifier's lora too). Not the adapters'
 * math or files: train/lora.h. */
#include "train/method_ops.h"

#include <limits.h>
#include <stdio.h>

#include "proto/jobspec.h"
#include "proto/log.h"
#include "train/lora.h"

td_err tr__adapter_plan_opts(const Traind__JobSpec *spec, struct tr_plan_opts *po, bool warn,
			     struct td_errbuf *eb)
{
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
			return tr__prefixed(eb, e, "lora.init_adapter");
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
	return TD_OK;
}

td_err tr__adapter_check(const Traind__JobSpec *spec, bool adapter,
			 const struct tr_model_config *cfg, int num_labels, struct td_errbuf *eb)
{
	const char *dir = spec->lora->init_adapter;
	if (dir && !adapter) {
		td_warn("TD-LORA-UNUSED", "lora.init_adapter %s: method %s trains no adapter; ignored",
			dir, rpc_method_name(spec->method));
		return TD_OK;
	}
	if (!dir)
		return TD_OK;
	struct tr_lora_config lc;
	struct tr_st_file *f = NULL;
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
	td_err e;
	if ((e = tr_lora_config_load(&lc, dir, eb)) == TD_OK && (e = tr_st_open(&f, path, eb)) == TD_OK)
		e = tr_lora_check(&lc, cfg, num_labels, f, eb);
	tr_st_close(f);
	return e == TD_OK ? TD_OK : tr__prefixed(eb, e, "lora.init_adapter");
}

td_err tr__adapter_load_initial(struct tr_method *mt, struct td_errbuf *eb)
{
	const char *init = mt->spec->lora->init_adapter;
	return init ? tr_lora_load(mt->m, init, eb)
		    : tr_lora_init(mt->m, tr__method_seed(mt->spec, TR__SEED_LORA_INIT), eb);
}

td_err tr__adapter_load_saved(struct tr_method *mt, const char *dir, struct td_errbuf *eb)
{
	return tr_lora_load(mt->m, dir, eb);
}

td_err tr__save_adapter(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
			struct td_errbuf *eb)
{
	(void)dtype; /* an adapter is saved in F32 (train/lora.h) */
	return tr_lora_save(mt->m, dir, mt->spec->model_dir, eb);
}

static bool adapter(const Traind__JobSpec *spec)
{
	(void)spec;
	return true;
}

/* QLoRA: the base's projections in NF4 (lora.double_quant: their absmax too). */
static td_err qlora_plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			      struct tr_plan_opts *po, struct td_errbuf *eb)
{
	(void)cfg, (void)eb;
	po->base_quant = TR_QUANT_NF4;
	po->nf4_double_quant = spec->lora->double_quant;
	return TD_OK;
}

const struct tr__method_ops tr__method_lora = {
	.name = "lora",
	.adapter = adapter,
	.fuse_head = tr__causal_fuse_head,
	.forward = tr__causal_forward,
	.count_valid = tr__causal_count_valid,
	.save = tr__save_adapter,
};

const struct tr__method_ops tr__method_qlora = {
	.name = "qlora",
	.adapter = adapter,
	.plan_opts = qlora_plan_opts,
	.fuse_head = tr__causal_fuse_head,
	.forward = tr__causal_forward,
	.count_valid = tr__causal_count_valid,
	.save = tr__save_adapter,
};
