/* The transformer on a backend: parameters, forward, backward, optimizer step.
 *
 * A tr_model binds a memory plan (train/plan.h) to a backend: one allocation
 * per arena, every tensor a pointer into one. Forward, backward and the
 * optimizer are sequences of backend ops; the model never touches device
 * memory directly. Llama, Qwen2 and Qwen3 share one code path: the config
 * switches q/k/v bias, q/k RMSNorm and tied embeddings.
 *
 * Not thread-safe: one model belongs to one runner thread. This is not the
 * training loop (train/trainer.h) nor the data (train/data.h). */
#ifndef TRAIN_MODEL_H
#define TRAIN_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "gpu/backend.h"
#include "proto/err.h"
#include "train/modeldir.h"
#include "train/plan.h"

struct tr_model;

struct tr_adamw {
	float beta1, beta2, eps, weight_decay;
};

/* Builds the plan for (cfg, opts) and allocates its arenas on be (which must
 * outlive the model). Parameters are zero until loaded. */
td_err tr_model_new(struct tr_model **out, struct gpu_backend *be,
		    const struct tr_model_config *cfg, const struct tr_plan_opts *opts,
		    struct td_errbuf *eb);
/* tr_model_new with the base arena (train/plan.h: TR_ARENA_BASE, the frozen
 * weights) at base, base_bytes long (the plan's, else TD_EINTERNAL), which
 * the model neither allocates nor frees: a train/base.h entry that several
 * models of the same plan's base signature share. loaded: the base holds
 * the weights already — tr_model_load then checks the files' tensors
 * against the plan and writes only the model's own (trainable) ones, and
 * tr_model_set_param on a frozen tensor is TD_EPERM; the model writes no
 * byte of it (the ops read weights through const pointers). Not loaded:
 * the first model loads it like its own, and the entry then seals it. */
td_err tr_model_new_shared(struct tr_model **out, struct gpu_backend *be,
			   const struct tr_model_config *cfg, const struct tr_plan_opts *opts,
			   void *base, size_t base_bytes, bool loaded, struct td_errbuf *eb);
/* Whether m was made by tr_model_new_shared. */
bool tr_model_base_shared(const struct tr_model *m);
/* tr_model_free(NULL) is a no-op. Frees the arenas (but a shared base). */
void tr_model_free(struct tr_model *m);

const struct tr_plan *tr_model_plan(const struct tr_model *m);
struct gpu_backend *tr_model_backend(const struct tr_model *m);

/* Loads every base parameter from w (converting to fp32; NF4 tensors are
 * quantized on the host and uploaded packed, tensors the plan stores in bf16
 * rounded once, to nearest even: a bf16 checkpoint's values unchanged),
 * checking that each is present
 * with the shape the config implies; tensors in w the model does not use are
 * an error too (naming them), except `lm_head.weight` of a tied model and the
 * causal head of a model loaded as a classifier (transformers drops it too).
 * LoRA adapters never come from w (train/lora.h loads them). A classifier's
 * score.weight is loaded when w has it; tr_model_head_loaded() says whether. */
td_err tr_model_load(struct tr_model *m, const struct tr_weights *w, struct td_errbuf *eb);
bool tr_model_head_loaded(const struct tr_model *m);

/* Host copies of a parameter / its gradient / its AdamW moments (numel floats).
 * An NF4 tensor comes back dequantized (in the bf16 mode as its GEMMs read
 * it, rounded to bf16) and is quantized when set; a tensor stored in bf16
 * comes back widened and is rounded when set (either can fail, TD_ENOMEM,
 * with no message: the caller names the tensor). In the bf16 mode, setting a
 * trainable tensor also rounds its bf16 copy. */
void tr_model_get_param(struct tr_model *m, const struct tr_param *p, float *dst);
td_err tr_model_set_param(struct tr_model *m, const struct tr_param *p, const float *src);
void tr_model_get_grad(struct tr_model *m, const struct tr_param *p, float *dst);
/* The AdamW moments this model keeps, for checkpoints: those of trainable
 * floats [plan.shard_lo, plan.shard_hi) (every trainable float unsharded;
 * a rank's part under memory.shard), hi - lo floats each. */
void tr_model_get_moments(struct tr_model *m, float *m1, float *m2);
void tr_model_set_moments(struct tr_model *m, const float *m1, const float *m2);

/* One forward pass over ids (B, T) host int32. labels (B, T) or NULL: position
 * t predicts labels[t+1]; -100 is ignored. Computes the loss summed over valid
 * positions and their count (loss_sum/n_valid is HF's mean loss). Checks every
 * id and label against the vocabulary first (TD_ERANGE naming row and column). */
td_err tr_model_forward(struct tr_model *m, const int32_t *ids, const int32_t *labels,
			double *loss_sum, int64_t *n_valid, struct td_errbuf *eb);
/* Host copies of forward results of the last forward: logits (B*T*V) — only
 * before tr_model_backward, which overwrites them — and hidden state i in
 * Hugging Face's numbering (0 = embeddings, i = output of layer i-1, L = after
 * the final norm), (B*T*C). */
void tr_model_get_logits(struct tr_model *m, float *dst);
void tr_model_get_hidden(struct tr_model *m, int i, float *dst);

/* The forward up to the logits, without a loss (a teacher). */
td_err tr_model_forward_logits(struct tr_model *m, const int32_t *ids, struct td_errbuf *eb);

/* A teacher planned with opts.teacher_rows: the forward without its head
 * (tr_model_forward_logits computes the head when the logits fit whole). */
td_err tr_model_forward_trunk(struct tr_model *m, const int32_t *ids, struct td_errbuf *eb);
/* The teacher's logits of rows [r0, r0 + n) of its last forward, on the
 * device: computed into its chunk (n <= plan.logits_rows), or a view of its
 * whole logits. Valid until the next call or forward. */
const float *tr_model_teacher_rows(struct tr_model *m, int r0, int n);

/* Distillation (a plan with opts.distill): the forward of tr_model_forward
 * plus, over the same shifted positions whose label is not -100, the terms of
 *   loss = alpha*T^2*KL(softmax(t/T) || softmax(s/T)) + (1-alpha)*CE(s)
 * with t the teacher's logits for the same ids (a model with the same
 * vocabulary on the same backend, after tr_model_forward_logits or
 * tr_model_forward_trunk on them; read through tr_model_teacher_rows, chunk
 * by chunk with the student's, here and again in tr_model_backward, before
 * which the teacher must not run again). Sums over positions, in double;
 * loss_sum/n_valid is the loss, kl_sum/n_valid the mean KL and ce_sum/n_valid
 * the CE. */
struct tr_distill_sums {
	double loss_sum, kl_sum, ce_sum;
	int64_t n_valid;
};
td_err tr_model_forward_distill(struct tr_model *m, const int32_t *ids, const int32_t *labels,
				struct tr_model *teacher, float temperature, float alpha,
				struct tr_distill_sums *out, struct td_errbuf *eb);

/* Classification (a plan with opts.num_labels): logits (B, num_labels) from
 * the hidden state of each row's last token that is not the pad id (the last
 * token when there is no pad id; position 0 when a row is all padding), as
 * transformers' *ForSequenceClassification pools, and cross-entropy against
 * class_ids (B), -100 ignored. Sums as tr_model_forward. An id outside
 * [0, num_labels) is TD_ERANGE naming the row. */
td_err tr_model_forward_classify(struct tr_model *m, const int32_t *ids, const int32_t *class_ids,
				 double *loss_sum, int64_t *n_valid, struct td_errbuf *eb);
/* The pad id pooling skips; initially the config's pad_token_id (-1: none). */
void tr_model_set_pad_id(struct tr_model *m, int pad_id);

/* Seeds and arms LoRA dropout for the next forward (and its backward): the
 * masks are a function of this seed, the layer and the projection only. A
 * forward that was not armed (evaluation, a teacher) has no dropout. */
void tr_model_set_dropout_seed(struct tr_model *m, uint64_t seed);

/* Backward of the last forward (causal, distillation or classification): the
 * plan's backward stages up to the optimizer's, recomputing each layer's
 * activations first where the plan's policy did not keep them (the same ops
 * on the same inputs: the same bits as without recompute). With
 * d(loss)/d(loss_sum) = dloss (1/n_valid for a mean over one batch; 1/total
 * over accumulated micro-batches). Gradients accumulate (+=) into the grads
 * arena; frozen tensors get none. Not for a forward-only plan. */
void tr_model_backward(struct tr_model *m, float dloss);
/* Training with a causal head: the next tr_model_forward also runs the head's
 * part of tr_model_backward(m, dloss) (the loss gradient, the lm_head's
 * backward) chunk by chunk while each chunk's logits are fresh, so the
 * backward neither recomputes nor re-reads them: same bits, one lm_head
 * product and one pass over the logits fewer per chunk. That forward keeps
 * no logits (tr_model_get_logits is invalid after it), and the
 * tr_model_backward that follows must pass the same dloss. */
void tr_model_fuse_head_backward(struct tr_model *m, float dloss);
void tr_model_zero_grad(struct tr_model *m);
/* GRADIENTS (train/ddp.c): the first micro-batch's reductions write every
 * float of the rank's part of grads except [lo, hi) (offsets into the
 * part), which is only added to; tr_model_zero_grad then zeroes only that
 * range of the part (its work buffers as before). */
void tr_model_zero_part_only(struct tr_model *m, size_t lo, size_t hi);
/* GRADIENTS: the next micro-batch's first chunk of the causal head
 * overwrites the head's gradient in its work buffer (grads.rest) where the
 * plan says so (tr_plan_dw_overwritten); tr_ddp_micro_begin zeroes the
 * slot's other floats. */
void tr_model_head_overwrites_next(struct tr_model *m);
/* Data parallel (train/ddp.h): the gradients arena on the device
 * (plan.numel_trainable floats; a trainable tensor's at its goffset), which
 * the ranks sum; and a hook that tr_model_backward calls (fn(ctx, s), on the
 * calling thread) after each backward stage it runs (and the forwards after
 * each forward stage, and with s NULL before the first), so that a layer's
 * gradients, final after its TR_STAGE_LAYER_BACKWARD (its MLP half's after
 * TR_STAGE_LAYER_BACKWARD_MLP), are summed while the layers below run. fn
 * NULL: none. */
float *tr_model_grads(struct tr_model *m);
/* GRADIENTS (train/plan.h: tr_param.gslot): work buffer k (0 ..
 * TR_GRAD_RING) that the backward writes gradients into,
 * plan.grad_slot_numel[k] floats; NULL where the plan has none. The grads
 * buffer (tr_model_grads) is then the part's summed gradients,
 * plan.shard_numel floats, trainable float i at i - plan.shard_lo. */
float *tr_model_grad_slot(struct tr_model *m, int k);
/* Data parallel's embedding rows (train/plan.h: embed_rows; train/ddp.h).
 * take: the backwards from now on leave the scatter of d(res[0]) into the
 * embedding's gradient to the stage hook (after TR_STAGE_EMBED_BACKWARD,
 * d(res[0]) is in dres, the pad token's rows zeroed); always so with
 * sharded gradients. embed_io: the device ids of the last forward (N), the
 * layers' input res[0] (N, C; the stage hook writes it after TR_STAGE_EMBED
 * where plan.embed_lookup_rows) and dres (N, C). embed_rows: grads.rows
 * (shard_ranks * N rows of C floats) and, at *ids, grads.rows_ids; NULL
 * where the plan has none. */
void tr_model_take_embed_rows(struct tr_model *m, bool take);
void tr_model_embed_io(struct tr_model *m, const int32_t **ids, float **res0, float **dres);
float *tr_model_embed_rows(struct tr_model *m, int32_t **ids);
typedef void (*tr_stage_hook)(void *ctx, const struct tr_stage *s);
void tr_model_set_stage_hook(struct tr_model *m, tr_stage_hook fn, void *ctx);
/* Sharded data parallel (train/ddp.h): the params buffer on the device,
 * plan.numel_trainable_padded floats: the trainable tensors (at their
 * goffset) and the padding that the ranks' parts all-gather over; and, after trainable floats [lo, hi) of it were written
 * from outside (an all-gather), the refresh of their bf16 copy (the bf16
 * mode; the same rounding AdamW's own writes make). */
float *tr_model_params(struct tr_model *m);
void tr_model_params_written(struct tr_model *m, size_t lo, size_t hi);
/* The bf16 mode's copy of the trainable floats (train/plan.h: copy16_lo,
 * tr_plan_copy16_index; NULL in fp32): plan.masters_part gathers it. */
gpu_bf16 *tr_model_params16(struct tr_model *m);
/* PARAMETERS (train/plan.h: tr_shard_params): params is the part's fp32
 * masters (plan.shard_numel floats, trainable float i at i -
 * plan.shard_lo); tr_model_set_param writes a tensor's floats of the part
 * only; the ops read each trainable weight where the plan gathers it
 * (tr_param.wslot: work buffer k, fp32 at wsoff, and its bf16 rounding
 * at w16off in the bf16 mode; NULL where none), which train/ddp.h fills before each use
 * (the stage hook runs after each forward stage too); tr_model_get_param
 * of a trainable tensor reads the host copy of every trainable float set
 * by tr_model_set_whole_weights (NULL: none; the caller keeps it alive) —
 * as it does with plan.masters_part, whose params outside the part are
 * not kept current. */
float *tr_model_weight_slot(struct tr_model *m, int k);
gpu_bf16 *tr_model_weight_slot16(struct tr_model *m, int k);
void tr_model_set_whole_weights(struct tr_model *m, const float *wholes);
/* Global L2 norm of all gradients (blocking). GRADIENTS: of the part's
 * only; the ranks' sums of squares add up to the global one
 * (tr_model_grad_sumsq, train/ddp.h: tr_ddp_sum). */
double tr_model_grad_norm(struct tr_model *m);
double tr_model_grad_sumsq(struct tr_model *m);
/* PyTorch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is < 1.
 * Returns the norm before clipping. max_norm <= 0 only measures. _by: with
 * the norm given (a sharded gang's, summed over the ranks). */
double tr_model_clip_grads(struct tr_model *m, double max_norm);
double tr_model_clip_grads_by(struct tr_model *m, double max_norm, double norm);
/* One AdamW step t (1-based) at learning rate lr, of the trainable floats
 * [plan.shard_lo, plan.shard_hi) (all of them unsharded): a sharded rank
 * steps its part, and the parts are then all-gathered (tr_ddp_gather_params). */
void tr_model_adamw(struct tr_model *m, const struct tr_adamw *h, float lr, int t);
/* The same over the trainable floats [a, b) of this rank's part only (a
 * and b clipped to it): a sharded rank may step its part in pieces
 * (train/ddp.h: tr_ddp_step), each float with the same arithmetic as in
 * one call: the same bits. An embedding whose gradient is kept by rows
 * (plan.grads_lo > 0) steps whole: a piece holds all of [0, grads_lo) or
 * none of it. */
void tr_model_adamw_part(struct tr_model *m, const struct tr_adamw *h, float lr, int t, size_t a,
			 size_t b);

#endif
