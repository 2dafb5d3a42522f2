/* The methods table: train/method.h's inside.
 *
 * A training method is one struct of hooks (struct tr__method_ops), filled
 * once per method with designated initialisers, one file a method:
 * method_full.c (every tensor trained; the causal LM's loss the others share),
 * method_lora.c (LoRA and QLoRA; the adapters that distillation and
 * classification can train too), method_distill.c (a student and its frozen
 * teacher), method_classify.c (a score head on the last token). method.c
 * looks the method up once from the spec's method (tr__method_lookup, which
 * asserts the required hooks), runs what every method shares around the
 * hooks — plan options, the recompute policy, building, loading, the dropout
 * seed — and calls them through its small wrappers. A new method (DPO, a
 * reward model) is a new file and a row of method.c's table.
 *
 * Nothing outside train/method*.c includes this. */
#ifndef TRAIN_METHOD_OPS_H
#define TRAIN_METHOD_OPS_H

#include "train/method.h"

/* The frozen model a method runs beside the trained one (distillation's
 * teacher): where it comes from and how it is planned at the job's B x T. */
struct tr__aux {
	const char *role;  /* "teacher": the plan's line names it so */
	const char *total; /* "student and teacher": what the job total sums */
	const char *dir;   /* its model dir: config.json and the weights */
	struct tr_model_config cfg;
	struct tr_plan_opts po;
};

struct tr__method_ops {
	const char *name;

	/* --- from the spec and configs alone (check, plan, preflight) --- */

	/* Required. Whether the trained model carries LoRA adapters: then its
	 * plan has the lora section's adapters, its first adapter weights are
	 * lora.init_adapter or PEFT's initialisation, and it saves a PEFT
	 * adapter (method_lora.c's tr__adapter_*). */
	bool (*adapter)(const Traind__JobSpec *spec);
	/* Optional. The method's part of the trained model's plan options, over
	 * the common part already in po (B, T, the adapters, the precision's
	 * attention_lse and gemm_bf16). Fails naming the spec's field. */
	td_err (*plan_opts)(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			    struct tr_plan_opts *po, struct td_errbuf *eb);
	/* Optional (NULL: the method runs no other model). Fills *aux for B x T;
	 * reads its config.json, and fails naming the spec's field. */
	td_err (*aux)(const Traind__JobSpec *spec, int B, int T, struct tr__aux *aux,
		      struct td_errbuf *eb);
	/* Optional. What the configs (and the files beside them) refute beyond
	 * the plan options: cfg is the trained model's, aux the other model's
	 * (NULL where the method has none). Runs at check and again at build. */
	td_err (*check)(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			const struct tr__aux *aux, struct td_errbuf *eb);

	/* --- a built method (tr_method_new; one runner thread) --- */

	/* Optional. After the trained model's weights are loaded (from
	 * saved_dir, a checkpoint; NULL: the first weights) and before the
	 * other model's: what the method adds (a classifier's head, its pad id). */
	td_err (*loaded)(struct tr_method *mt, const char *saved_dir, struct td_errbuf *eb);
	/* Optional (NULL: the head's backward runs in the backward). The
	 * backward after the next forward takes dloss (tr_method_fuse_head). */
	void (*fuse_head)(struct tr_method *mt, float dloss);
	/* Required. One micro-batch's forward and its loss's sums, as
	 * tr_method_forward (whose dropout seed is already armed); the caller
	 * runs the backward. */
	td_err (*forward)(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
			  const int32_t *class_ids, double *loss_sum, int64_t *n_valid,
			  struct td_errbuf *eb);
	/* Required. As tr_method_count_valid. */
	int64_t (*count_valid)(const struct tr_method *mt, const int32_t *labels,
			       const int32_t *class_ids);
	/* Optional (NULL: the trainer's mean token loss). As tr_method_eval. */
	td_err (*eval)(struct tr_method *mt, const struct tr_data *d, uint64_t max_batches,
		       uint64_t step, FILE *log, double *loss, struct td_errbuf *eb);
	/* Required. As tr_method_save. */
	td_err (*save)(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		       struct td_errbuf *eb);
};

/* A built method: what every hook may read. */
struct tr_method {
	const struct tr__method_ops *ops;
	const Traind__JobSpec *spec;
	struct tr_model_config cfg;
	struct gpu_backend *be;
	struct tr_model *m;   /* the trained model */
	struct tr_model *aux; /* the frozen one (ops->aux), or NULL */
	struct tr__aux aux_info;
	int B, T;
	bool adapter;     /* ops->adapter(spec) */
	int num_labels;   /* the trained model's classifier labels; 0: a causal LM */
	int pad_override; /* tr_method_set_pad_id; -2: none */
};

/* The methods (one file each). */
extern const struct tr__method_ops tr__method_full, tr__method_lora, tr__method_qlora,
	tr__method_distill, tr__method_classify;

/* The spec's method (UNSPECIFIED is FULL); TD_EINVAL naming `method` for a
 * value no method has. Asserts the table's required hooks. */
td_err tr__method_lookup(const Traind__JobSpec *spec, const struct tr__method_ops **out,
			 struct td_errbuf *eb);

/* --- what the method files share (method.c) --- */

/* splitmix64's finaliser. */
uint64_t tr__mix64(uint64_t z);
/* Seeds of the methods' random draws, each its own stream of hyper.seed. */
enum { TR__SEED_LORA_INIT = 1, TR__SEED_HEAD_INIT = 2, TR__SEED_DROPOUT = 3 };
uint64_t tr__method_seed(const Traind__JobSpec *spec, uint64_t what);
/* Puts "what: " before the message already in eb; returns e. */
td_err tr__prefixed(struct td_errbuf *eb, td_err e, const char *what);
/* Whether the job will run in bf16: asked, or unset and not bound to the CPU
 * (train/trainer.c sets the backend's precision by the same rule). */
bool tr__job_bf16(const Traind__JobSpec *spec);

/* --- the causal LM (method_full.c): FULL's hooks, which LoRA's share --- */

td_err tr__causal_forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
			  const int32_t *class_ids, double *loss_sum, int64_t *n_valid,
			  struct td_errbuf *eb);
/* Shifted positions whose label is not -100. */
int64_t tr__causal_count_valid(const struct tr_method *mt, const int32_t *labels,
			       const int32_t *class_ids);
void tr__causal_fuse_head(struct tr_method *mt, float dloss);
/* Every tensor of the trained model to an HF model dir in dtype. */
td_err tr__save_full(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		     struct td_errbuf *eb);

/* --- adapters (method_lora.c), for every method whose ops->adapter says so --- */

/* The lora section into po (rank, alpha, dropout, targets), or an init
 * adapter's shape, which wins (warned, TD-LORA-INIT, when warn). */
td_err tr__adapter_plan_opts(const Traind__JobSpec *spec, struct tr_plan_opts *po, bool warn,
			     struct td_errbuf *eb);
/* lora.init_adapter against the base cfg and num_labels (its config and
 * tensors), where the method trains adapters; else warns (TD-LORA-UNUSED)
 * that it is ignored. */
td_err tr__adapter_check(const Traind__JobSpec *spec, bool adapter,
			 const struct tr_model_config *cfg, int num_labels, struct td_errbuf *eb);
/* The first adapter weights: lora.init_adapter, or PEFT's initialisation. */
td_err tr__adapter_load_initial(struct tr_method *mt, struct td_errbuf *eb);
/* The adapters tr__save_adapter wrote to dir (the base is loaded). */
td_err tr__adapter_load_saved(struct tr_method *mt, const char *dir, struct td_errbuf *eb);
/* The trained model as a PEFT adapter dir. */
td_err tr__save_adapter(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
			struct td_errbuf *eb);

#endif
