/* Data parallel's gradient reduction for one rank (issue 12, item 2): the
 * gradients arena of the rank's model summed over the ranks (gpu/comm.h)
 * in buckets, each as soon as the backward has made it final, so that the
 * sums overlap the layers still to run.
 *
 * A bucket is a run of trainable tensors adjacent in the arena. A tensor of
 * decoder layer l is final after the TR_STAGE_LAYER_BACKWARD of l (of the
 * step's last micro-batch: tr_ddp_arm before that backward only); the
 * final norm after its backward, a head after its own, a tied embedding's
 * table after the final norm's (its rows at its backward: tr_ddp_arm).
 * After each stage
 * the runs of final tensors not yet summed are summed, each run that holds
 * at least bucket_floats floats; tr_ddp_finish sums the rest and waits. The
 * buckets follow from the plan alone, so every rank makes the same calls in
 * the same order (NCCL's requirement). A comm that is not asynchronous
 * (host) gets one sum of the whole arena at tr_ddp_finish unless buckets
 * are asked for (overlap: tests check that bucketing changes nothing).
 *
 * How the step is split is the trainer's (tr_ddp_share); not thread-safe:
 * one per rank thread. */
#ifndef TRAIN_DDP_H
#define TRAIN_DDP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/comm.h"
#include "proto/err.h"
#include "train/model.h"

/* Default bucket size: a layer of a 0.5B model (Qwen2-0.5B: 14.9M floats)
 * is one bucket, a small layer's tensors wait for more. */
#define TR_DDP_BUCKET_FLOATS ((size_t)4 << 20)

struct tr_ddp;

struct tr_ddp_stats {
	uint64_t steps;
	uint64_t overlapped;   /* buckets summed during a backward */
	uint64_t at_finish;    /* buckets summed by tr_ddp_finish */
	uint64_t floats;       /* floats summed, all steps */
	uint64_t gathered;     /* floats all-gathered (sharded weights), all steps */
	uint64_t rows;         /* floats of the embedding's rows gathered and summed (its
				* gradient and lookup by rows: train/plan.h embed_rows), all steps */
};

/* For model m (its plan and gradients) over comm c. bucket_floats: 0 for
 * TR_DDP_BUCKET_FLOATS; overlap: bucket even where c is not asynchronous.
 * Installs m's stage hook (tr_ddp_free removes it). */
td_err tr_ddp_new(struct tr_ddp **out, struct tr_model *m, struct gpu_comm *c, size_t bucket_floats,
		  bool overlap, struct td_errbuf *eb);
/* tr_ddp_free(NULL) is a no-op. */
void tr_ddp_free(struct tr_ddp *d);

/* The step's micro-batches (hyper.grad_accum), the same on every rank:
 * with it an untied embedding's table is summed only where some rank runs
 * more than one (see below); without it (0), always. */
void tr_ddp_set_accum(struct tr_ddp *d, int accum);
/* The next tr_model_backward on the model is the step's last on this rank:
 * its buckets are summed as they become final.
 *
 * The embedding's gradient (train/plan.h: embed_rows, a gang with a
 * trainable embedding) is not summed as a table after the backward: its
 * input side is a scatter of B*T rows of d(res[0]) by the ids, so after
 * the embedding's backward stage every rank's ids and rows are
 * all-gathered (gpu_comm_all_gather_from) and every rank scatters all of
 * them in rank order (embedding_backward_part) into its summed gradients
 * — unsharded: the whole table, after the table itself was summed: the
 * head's part of a tied one (final after the final norm's backward, and
 * summed then, overlapping the layers' backward) and the scatters of
 * earlier micro-batches, which stay on their rank (the sum is linear);
 * sharded gradients: every micro-batch's into the part only (a part
 * boundary may cut a row), after the head's part of a tied table was
 * reduced onto its owners. With the weights sharded too an untied
 * embedding is never gathered: after the embedding stage every rank's ids
 * are gathered, each rank writes the floats its part holds for all of
 * them (embedding_forward_part: zeros elsewhere) and each rank's rows are
 * summed onto it (gpu_comm_reduce_sum) into its res[0]. */
void tr_ddp_arm(struct tr_ddp *d);
/* Sums the buckets not summed yet (all of them without an armed backward),
 * then waits until every sum is done: the gradients are the ranks' sum.
 * Errors (the comm's, another rank's failure) come back here. */
td_err tr_ddp_finish(struct tr_ddp *d, struct td_errbuf *eb);
void tr_ddp_get_stats(const struct tr_ddp *d, struct tr_ddp_stats *out);

/* Sharded gradients (the model's plan is tr_shard_grads': memory.shard
 * GRADIENTS): the backward writes each micro-batch's gradients into the
 * model's work buffers (train/plan.h: tr_param.gslot), and each is summed
 * onto the ranks that own its floats (gpu_comm_reduce_sum) — a layer's
 * from the stage hook in two units as its backward's two stages end (its
 * MLP half's, then its attention half's: tr_param.gunit), the head's, the
 * final norm's and a tied embedding's after the final norm's backward, the
 * embedding's own by rows after its backward (tr_ddp_arm) — into the
 * model's grads, which holds the part (plan.shard_lo .. shard_hi). A ring
 * slot is zeroed right before the stage that writes it (the hook after the
 * stage before), once the sums of its last user, the unit two above, are
 * complete (gpu_comm_after), so each half's sums overlap the next half's
 * backward (and a recompute): the two slots hold one layer's gradients,
 * not two. Every micro-batch is summed, so every
 * rank runs the same number of rounds, ceil(grad_accum / ranks): a rank
 * whose share is one fewer runs tr_ddp_micro_empty for its last (the same
 * calls, with zero gradients). Around each micro-batch's forward and
 * backward: tr_ddp_micro_begin (waits for the last one's sums, zeroes
 * grads.rest), tr_ddp_micro_end. tr_ddp_arm does nothing then. Errors of
 * the sums started from the hook come back from micro_end or finish. The
 * gradient norm is the ranks' parts' (tr_ddp_grad_norm). Unsharded
 * gradients: micro_begin and micro_end do nothing, micro_empty is not
 * called. */
bool tr_ddp_sharded_grads(const struct tr_ddp *d);
/* Sharded weights (PARAMETERS, which shards the gradients too): the
 * model's params are the part's fp32 masters, and each unit's weights are
 * broadcast from their owners (gpu_comm_broadcast) into the model's weight
 * work buffers — the other tensors' and layer 0's as a forward begins,
 * layer l + 1's after layer l - 1's forward and waited for (and rounded to
 * bf16) before its own, layer l - 2's after layer l's backward — so that
 * each layer's weights are gathered a layer ahead of their use, forward
 * and backward (two slots: the forward leaves the last two layers for the
 * backward). The same calls in an empty round. Nothing is gathered after
 * the step (tr_ddp_gather_params does nothing). The first gathers are the
 * stage hook's before a forward's first stage, so any forward gathers what
 * it reads — an evaluation's too, which every rank must then run alike;
 * tr_ddp_check returns a gather's error after one (micro_end does in
 * training). */
td_err tr_ddp_check(struct tr_ddp *d, struct td_errbuf *eb);
td_err tr_ddp_micro_begin(struct tr_ddp *d, struct td_errbuf *eb);
td_err tr_ddp_micro_end(struct tr_ddp *d, struct td_errbuf *eb);
td_err tr_ddp_micro_empty(struct tr_ddp *d, struct td_errbuf *eb);
/* The L2 norm of the step's summed gradients, every rank's the same: this
 * model's (unsharded gradients) or the square root of the ranks' parts'
 * sums of squares added in rank order (gpu_comm_sum_host). After
 * tr_ddp_finish; every rank calls it. */
td_err tr_ddp_grad_norm(struct tr_ddp *d, double *norm, struct td_errbuf *eb);

/* Sharded state (the model's plan shards its optimizer: memory.shard
 * OPTIMIZER, GRADIENTS): after tr_model_adamw stepped this rank's part of
 * the weights, all-gathers every rank's part (plan.shard_numel floats
 * each, the params buffer's padded trainable prefix) and refreshes the
 * bf16 copy of the parts this rank did not step — or, with
 * plan.masters_part, gathers the bf16 copy itself and the fp32 floats
 * that do not decay, leaving the other fp32 masters the part's; returns
 * once the weights the ops read are whole again on this rank. Every rank
 * calls it after each step; unsharded and PARAMETERS it does nothing. On
 * the host comm the weights are the bits an unsharded run has (each part
 * stepped by the same elementwise AdamW on the same summed gradients, then
 * copied). */
td_err tr_ddp_gather_params(struct tr_ddp *d, struct td_errbuf *eb);
/* The optimizer's step on a gang's rank: tr_model_adamw, then
 * tr_ddp_gather_params — or, with plan.masters_part, the part stepped in
 * pieces, each piece's bf16 copy and undecayed fp32 floats broadcast from
 * every rank right after it (one NCCL group a piece), so that the gathers
 * overlap AdamW: the same floats stepped with the same arithmetic and the
 * same bytes gathered, so the same bits. Every rank calls it. */
td_err tr_ddp_step(struct tr_ddp *d, const struct tr_adamw *h, float lr, int t,
		   struct td_errbuf *eb);
/* tr_ddp_step's pieces, in floats (rounded up to 64; 0: the default, 32
 * Mi): tests cut a small model's parts into many. */
void tr_ddp_set_step_piece(struct tr_ddp *d, size_t floats);

/* Rank r's share of a step's `accum` micro-batches over n ranks: [*a0, *a1),
 * contiguous, in order, sizes differing by at most one (the later ranks get
 * the larger). Every rank has one when accum >= n. */
static inline void tr_ddp_share(int accum, int n, int r, int *a0, int *a1)
{
	*a0 = (int)((long long)accum * r / n);
	*a1 = (int)((long long)accum * (r + 1) / n);
}

#endif
