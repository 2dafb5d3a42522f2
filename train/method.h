/* A job's training method: full fine-tuning, LoRA, QLoRA, distillation or
 * classification, seen from the step loop.
 *
 * The method decides which models a job builds (the trained one, and a frozen
 * teacher for distillation), their plan options (adapters, frozen or NF4
 * base, head), where their first weights come from (the model dir, an
 * adapter to start from or PEFT's initialisation, a new head), what one
 * micro-batch computes (the teacher's forward, then the trained model's), and
 * what a checkpoint and the output hold (a full model dir, or a PEFT adapter).
 * The step loop (train/trainer.c) is the same for all: forward and backward
 * per micro-batch, clip, AdamW on tr_method_model().
 *
 * Each method is a table of hooks in its own file (train/method_ops.h:
 * method_full.c, method_lora.c, method_distill.c, method_classify.c), looked
 * up once from spec->method; these entry points are the same for all.
 *
 * Every model lives on the backend the caller gives; one method belongs to one
 * runner thread. This is not the step loop and not the data. */
#ifndef TRAIN_METHOD_H
#define TRAIN_METHOD_H

#include <stdint.h>
#include <stdio.h>

#include "gpu/backend.h"
#include "proto/err.h"
#include "train/hfconfig.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/plan.h"
#include "traind.pb-c.h"

struct tr_method;

/* Checks what configs alone can tell (files read: the teacher's config.json
 * and both tokenizer.json, the init adapter's adapter_config.json and
 * tensors): the teacher's vocabulary against the student's, the adapter
 * against the base and the job's LoRA settings. spec has its defaults applied;
 * cfg is model_dir's config. Warns (TD-LORA-INIT) when an init adapter's
 * shape overrides the lora section's. */
td_err tr_method_check(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
		       struct td_errbuf *eb);

/* The plan options of the trained model (B x T rows). With an init adapter its
 * rank, alpha and targets are the adapter's. */
td_err tr_method_plan_opts(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B,
			   int T, struct tr_plan_opts *po, struct td_errbuf *eb);

/* *per: what each selective layer past po's adds to the plan of policy k
 * (base: that plan's total bytes with po's layers), where more are chosen
 * for the spec — FULL and FULL_OFFLOAD on one GPU, memory.selective_layers
 * unset (under memory.max_bytes here, by the scheduler under AUTO) — and
 * the plan with every layer selective is base and that many times it (each
 * layer's kept buffers alike); else 0, and none are added. */
td_err tr_method_selective_layer_bytes(const Traind__JobSpec *spec,
				       const struct tr_model_config *cfg,
				       const struct tr_plan_opts *po, int k, uint64_t base,
				       uint64_t *per, struct td_errbuf *eb);

/* How many more selective layers, each per bytes (from
 * tr_method_selective_layer_bytes), spare bytes hold, up to the left ones. */
static inline int tr_method_selective_fit(uint64_t spare, uint64_t per, int left)
{
	const uint64_t fit = per ? spare / per : 0;
	return fit < (uint64_t)left ? (int)fit : left;
}

/* Prints the plans (the trained model's, the teacher's) and their sum. */
td_err tr_method_print_plan(const Traind__JobSpec *spec, const struct tr_model_config *cfg, int B,
			    int T, FILE *out, struct td_errbuf *eb);

/* memory.shard as the plan's policy (AUTO and unset: NONE). */
enum tr_shard tr_method_shard(const Traind__JobSpec *spec);

/* Builds the models on be (which must outlive the method), the trained
 * one planned as rank `rank` of `ranks` (data parallel: memory.shard splits
 * its state over them; 1: one device). Weights are zero until
 * tr_method_load_initial or tr_method_load_saved. */
td_err tr_method_new(struct tr_method **out, const Traind__JobSpec *spec,
		     const struct tr_model_config *cfg, struct gpu_backend *be, int B, int T,
		     int rank, int ranks, struct td_errbuf *eb);
/* Whether spec's method may share its frozen base with other jobs
 * (train/base.h): LoRA or QLoRA on a causal LM (no teacher, no head). */
bool tr_method_can_share_base(const Traind__JobSpec *spec);
/* The trained model's base arena on be (the plan tr_method_new would make
 * there): its bytes and tr_plan_base_signature. */
td_err tr_method_base_layout(const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			     struct gpu_backend *be, int B, int T, char sig[65], size_t *bytes,
			     struct td_errbuf *eb);
/* tr_method_new whose trained model's base arena is base (train/model.h:
 * tr_model_new_shared; loaded: it holds the weights already). Only where
 * tr_method_can_share_base. */
td_err tr_method_new_shared(struct tr_method **out, const Traind__JobSpec *spec,
			    const struct tr_model_config *cfg, struct gpu_backend *be, int B, int T,
			    void *base, size_t base_bytes, bool loaded, struct td_errbuf *eb);
/* tr_method_free(NULL) is a no-op. Frees the models. */
void tr_method_free(struct tr_method *mt);

/* The model the optimizer steps. */
struct tr_model *tr_method_model(struct tr_method *mt);
/* The teacher (forward only), or NULL. */
struct tr_model *tr_method_teacher(struct tr_method *mt);
/* Bytes of every model's plan. */
size_t tr_method_total_bytes(const struct tr_method *mt);
void tr_method_print(const struct tr_method *mt, FILE *out);

/* Loads the first weights: the base from w (model_dir, opened by the caller),
 * then the init adapter or PEFT's initialisation (seeded by hyper.seed), a new
 * classifier head (normal, std 0.02 as transformers), the teacher. */
td_err tr_method_load_initial(struct tr_method *mt, const struct tr_weights *w,
			      struct td_errbuf *eb);

/* Training: the backward that will follow the next tr_method_forward takes
 * dloss; where the method's head allows it (a causal LM without a teacher),
 * that forward already runs the head's part (tr_model_fuse_head_backward). */
void tr_method_fuse_head(struct tr_method *mt, float dloss);

/* One micro-batch: (the teacher's forward on ids, then) the trained model's
 * forward. ids, labels (B, T) as tr_model_forward; class_ids (B) for a
 * classifier (else NULL). micro is the micro-batch's index over the whole run
 * (step * grad_accum + a): LoRA dropout masks are a function of it and the
 * seed, so a resumed run draws the same ones. Sums as tr_model_forward; the
 * caller then runs tr_model_backward on tr_method_model(). */
td_err tr_method_forward(struct tr_method *mt, const int32_t *ids, const int32_t *labels,
			 const int32_t *class_ids, uint64_t micro, double *loss_sum,
			 int64_t *n_valid, struct td_errbuf *eb);

/* The positions (or, for a classifier, the rows) one micro-batch contributes
 * to the loss's mean: shifted positions whose label is not -100, or rows whose
 * class is not -100. labels (B, T); class_ids (B) or NULL. */
int64_t tr_method_count_valid(const struct tr_method *mt, const int32_t *labels,
			      const int32_t *class_ids);

/* The pad id a classifier pools past (the data's padding; by default the
 * config's pad_token_id, else data.eos_id, else the config's eos_token_id). */
void tr_method_set_pad_id(struct tr_method *mt, int pad_id);

struct tr_data;
/* Whether the method evaluates a model its own way (a classifier); else the
 * step loop's mean token loss is the evaluation. */
bool tr_method_has_eval(const struct tr_method *mt);
/* The method's evaluation on an eval set (file order, at most max_batches
 * micro-batches of B; 0: all), logged with step to log (may be NULL); *loss
 * gets the loss it is scheduled by. A classifier's: mean loss over rows,
 * accuracy and macro-F1. Forward only, without dropout. TD_EUNSUPPORTED where
 * tr_method_has_eval is false. */
td_err tr_method_eval(struct tr_method *mt, const struct tr_data *d, uint64_t max_batches,
		      uint64_t step, FILE *log, double *loss, struct td_errbuf *eb);

/* Saves the trained weights to dir (which exists): an HF model dir in dtype
 * (a classifier's config says so), or, for LoRA, a PEFT adapter dir. */
td_err tr_method_save(struct tr_method *mt, const char *dir, enum tr_dtype dtype,
		      struct td_errbuf *eb);
/* Loads what tr_method_save wrote to dir (a checkpoint). For an adapter the
 * base comes from model_dir again (re-quantized for QLoRA: the same bits). */
td_err tr_method_load_saved(struct tr_method *mt, const char *dir, struct td_errbuf *eb);

#endif
