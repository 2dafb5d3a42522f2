/* Buckets of the gradients arena, summed as the backward finishes them
 * (train/ddp.h). */
#include "train/ddp.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A trainable tensor's range of the arena and the stage after which its
 * gradient is final (an index into plan.stages; nstages: at the end). */
struct span {
	size_t off, end;
	size_t ready;
	bool summed;
};

/* GRADIENTS: a run of trainable floats [off, off + n) whose gradients the
 * backward writes at work buffer slot's soff (train/plan.h: tr_param.gslot,
 * gsoff); PARAMETERS: whose weights are gathered into work buffer slot, in
 * bf16 at soff (tr_param.wslot, w16off) and in fp32 at wsoff. */
struct piece {
	size_t off, n;
	int slot;
	size_t soff;
	/* PARAMETERS in the bf16 mode: gathered in bf16 only (tr_plan_gathered16),
	 * or in fp32 and rounded after (r16: a tied embedding, the head's GEMM
	 * operand too) */
	bool g16, r16;
	size_t wsoff;       /* PARAMETERS: the fp32 copy's place (not g16) */
};

/* What one reduction covers (train/plan.h: tr_param.gunit) — a decoder
 * layer's attention half's gradients (unit 2l) or its MLP half's (2l + 1),
 * the head's, the final norm's and a tied embedding's (unit 2L; an untied
 * embedding's go by rows) — or one gather (tr_param.wunit: layer l's
 * weights, unit l; the head's, the final norm's, a tied embedding's L): its pieces [p0,
 * p1) of the reductions' or the gathers' list, and the comm's mark after
 * its collectives (their completion frees its slot, or makes its weights
 * usable). */
struct unit {
	size_t p0, p1;
	uint64_t mark;
	/* GRADIENTS: its slot's ranges [zr[z0], zr[z1]) to zero before its
	 * backward — its tensors but those the backward overwrites
	 * (tr_plan_dw_overwritten) — as (start, count) pairs */
	size_t z0, z1;
};

/* tr_ddp_step's pieces under plan.masters_part: floats a rank steps and
 * then broadcasts (a multiple of 64: AdamW's vector path stays aligned). */
#define DDP_STEP_PIECE ((size_t)32 << 20)

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
	/* GRADIENTS (tr_shard_grads): the reductions' units [0, 2L + 1] and
	 * their pieces */
	bool gr;
	int L;
	struct unit *units;
	struct piece *pieces;
	size_t npieces;
	struct zrange { size_t off, n; } *zr;
	bool poison;        /* TD_TEST_POISON_GRADS: the slot's other floats NaN first */
	/* the parts' running sums are zero: no micro-batch of this step summed
	 * into them yet (tr_model_zero_grad began it; tr_ddp_finish ends it) */
	bool fresh;
	/* tr_ddp_step's pieces (plan.masters_part), floats */
	size_t step_piece;
	/* PARAMETERS (tr_shard_params): the gathers' units [0, L + 1], their
	 * pieces, and whether each is in its work buffers and rounded
	 * (ensured) */
	bool wp;
	struct unit *wunits;
	struct piece *wpieces;
	size_t nwpieces;
	bool *wready;
	/* GRADIENTS: the last mark the backend's stream was made to wait for
	 * on the device (after): the host waits for it, bounded, before the
	 * forward's end blocks on that stream (the loss) */
	uint64_t joined;
	bool head_reduced;  /* GRADIENTS: unit 2L reduced in this micro-batch */
	bool lookup_l;      /* PARAMETERS: the lookup reads gather unit L (a tied embedding) */
	/* The embedding's rows (train/plan.h: embed_rows): its floats
	 * [emb_off, emb_off + emb_n) of the trainable ones, N rows of C a
	 * rank, R ranks; emb_head: it is the head too, whose part of its
	 * gradient is a table summed after the head's backward. */
	bool rows, emb_head, lookup;
	/* the lookup: the rank whose part holds the whole table (its rows
	 * broadcast from it), or -1 (a part's edge cuts the table, or the
	 * comm has no broadcast: the rows summed over the parts) */
	int emb_owner;
	size_t emb_off, emb_n;
	int N, C, R;
	int accum;          /* the step's micro-batches (tr_ddp_set_accum; 0: not known) */
	size_t emb_span;    /* unsharded: its span's index */
	bool last;          /* unsharded: this backward is the rank's last of the step */
	bool empty;         /* sharded: an empty round (tr_ddp_micro_empty) */
	uint64_t lookup_mark;
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

/* --- GRADIENTS --- */

static int piece_by_off(const void *a, const void *b)
{
	const struct piece *x = a, *y = b;
	return x->off < y->off ? -1 : x->off > y->off;
}

/* Units [0, nunits) and their pieces from the plan: each unit's tensors
 * (gunit, or with gather the weights' wunit) by offset, adjacent ones (in
 * the arena and in their slot) merged into one piece. */
static void make_units(const struct tr_plan *p, bool gather, int nunits, struct unit *units,
		       struct piece *pieces, size_t *npieces)
{
	size_t np = 0;
	for (int u = 0; u < nunits; u++) {
		units[u].p0 = np;
		size_t first = np;
		for (size_t i = 0; i < p->nparams; i++) {
			const struct tr_param *t = &p->params[i];
			if (!t->trainable || !t->numel || (gather ? t->wunit : t->gunit) != u)
				continue;
			assert(t->gslot >= 0 && (!gather || t->wslot >= 0));
			const bool g16 = gather && tr_plan_gathered16(p, t);
			const bool r16 = gather && !g16 && p->opts.gemm_bf16 && t->ndim == 2 &&
					 p->cfg.tie_word_embeddings; /* a tied embedding */
			pieces[np++] = gather ? (struct piece){t->goffset, t->numel, t->wslot, t->w16off,
							       g16, r16, t->wsoff}
					      : (struct piece){t->goffset, t->numel, t->gslot, t->gsoff,
							       false, false, 0};
		}
		qsort(pieces + first, np - first, sizeof(*pieces), piece_by_off);
		size_t k = first;
		for (size_t i = first; i < np; i++) {
			struct piece *q = &pieces[k - 1];
			if (i > first && q->off + q->n == pieces[i].off && q->slot == pieces[i].slot &&
			    q->soff + q->n == pieces[i].soff && q->g16 == pieces[i].g16 &&
			    q->r16 == pieces[i].r16 && (q->g16 || q->wsoff + q->n == pieces[i].wsoff))
				q->n += pieces[i].n;
			else
				pieces[k++] = pieces[i];
		}
		np = k;
		units[u].p1 = np;
	}
	*npieces = np;
}

/* The first micro-batch's reductions write their pieces' floats of this
 * rank's part (fresh: not added to); the embedding's rows (an untied table:
 * not in any unit) only add. Where the units' pieces and the rows' range
 * cover the whole part, zero_grad need zero only the rows' range — a
 * memset of the part (16 GB a step for Llama-3-8B on 2 GPUs) saved. */
static void emb_part(const struct tr_ddp *d, size_t *a, size_t *b);

static void part_overwrite(struct tr_ddp *d)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	/* A tied table's rows add onto the head's sum, made at the final
	 * norm's backward, before them; without that stage the sum comes at
	 * the micro-batch's end, after the rows: keep the zeroing. */
	bool norm_stage = false;
	for (size_t i = 0; i < p->nstages; i++)
		norm_stage |= p->stages[i].kind == TR_STAGE_FINAL_NORM_BACKWARD;
	if (d->rows && d->emb_head && !norm_stage)
		return;
	const size_t lo = p->shard_lo, hi = p->shard_hi;
	size_t covered = 0, a = lo, b = lo;
	for (size_t i = 0; i < d->npieces; i++) {
		const size_t x0 = d->pieces[i].off > lo ? d->pieces[i].off : lo;
		const size_t e = d->pieces[i].off + d->pieces[i].n, x1 = e < hi ? e : hi;
		if (x1 > x0)
			covered += x1 - x0;
	}
	if (d->rows && !d->emb_head)
		emb_part(d, &a, &b);
	if (covered + (b - a) == hi - lo) /* pieces are disjoint tensors, and not the rows' */
		tr_model_zero_part_only(d->m, a - lo, b - lo);
}

static int zr_by_off(const void *a, const void *b)
{
	const struct zrange *x = a, *y = b;
	return x->off < y->off ? -1 : x->off > y->off;
}

/* Each unit's ranges of its slot to zero: its tensors that the backward
 * adds to (norms, biases, adapters), adjacent ones merged — the ring's
 * units and unit 2L, grads.rest (the head's weight overwritten). */
static void zero_ranges(struct tr_ddp *d, const struct tr_plan *p)
{
	size_t nz = 0;
	for (int u = 0; u <= 2 * d->L; u++) {
		d->units[u].z0 = nz;
		const size_t first = nz;
		for (size_t i = 0; i < p->nparams; i++) {
			const struct tr_param *t = &p->params[i];
			if (!t->trainable || !t->numel || t->gunit != u || tr_plan_dw_overwritten(p, t))
				continue;
			d->zr[nz++] = (struct zrange){t->gsoff, t->numel};
		}
		qsort(d->zr + first, nz - first, sizeof(*d->zr), zr_by_off);
		size_t k = first;
		for (size_t i = first; i < nz; i++)
			if (k > first && d->zr[k - 1].off + d->zr[k - 1].n == d->zr[i].off)
				d->zr[k - 1].n += d->zr[i].n;
			else
				d->zr[k++] = d->zr[i];
		nz = k;
		d->units[u].z1 = nz;
	}
}

static td_err grads_units(struct tr_ddp *d, const struct tr_plan *p, struct td_errbuf *eb)
{
	d->L = p->cfg.num_layers;
	assert(p->grad_units == 2 * d->L + 1);
	d->units = calloc(2 * (size_t)d->L + 2, sizeof(*d->units));
	d->pieces = calloc(p->nparams ? p->nparams : 1, sizeof(*d->pieces));
	if (!d->units || !d->pieces)
		return td_fail(eb, TD_ENOMEM, "data parallel: out of memory");
	make_units(p, false, p->grad_units, d->units, d->pieces, &d->npieces);
	if (!(d->zr = calloc(p->nparams ? p->nparams : 1, sizeof(*d->zr))))
		return td_fail(eb, TD_ENOMEM, "data parallel: out of memory");
	zero_ranges(d, p);
	if (!d->wp)
		return TD_OK;
	d->wunits = calloc((size_t)d->L + 2, sizeof(*d->wunits));
	d->wpieces = calloc(p->nparams ? p->nparams : 1, sizeof(*d->wpieces));
	d->wready = calloc((size_t)d->L + 2, sizeof(*d->wready));
	if (!d->wunits || !d->wpieces || !d->wready)
		return td_fail(eb, TD_ENOMEM, "data parallel: out of memory");
	make_units(p, true, d->L + 1, d->wunits, d->wpieces, &d->nwpieces);
	return TD_OK;
}

/* The work enqueued next on the backend runs after the collectives before
 * mark, the host going on (gpu_comm_after): a slot's sums before it is
 * zeroed, a unit's gathers before its weights are read. A wait on the host
 * here would keep it at most a layer ahead of the device. */
static void after(struct tr_ddp *d, uint64_t mark)
{
	d->err = gpu_comm_after(d->c, mark, &d->eb);
	if (mark > d->joined)
		d->joined = mark;
}

/* Unit u's gradients summed onto their owners' parts. Each piece is split
 * where the parts (shard_numel floats each, rank r's from r * shard_numel)
 * split it, and each share reduced onto its owner's part; the owner first
 * adds its part's running sum into its own share (this rank's earlier
 * micro-batches, zero at the first), so that the reduction writes the new
 * running sum: x0 + x1 + ... in rank order, with the owner's term its
 * gradient plus the part — at the first micro-batch the part is zero and
 * the sum NONE's all-reduce bits, and the addition is skipped (fresh: x +
 * 0 is x; a -0 share would turn +0, which no sum or AdamW step tells
 * apart). Every rank makes the same calls in the same order (the plan's). */
static void grads_reduce(struct tr_ddp *d, int u)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	struct gpu_backend *be = tr_model_backend(d->m);
	const size_t S = p->shard_numel, lo = p->shard_lo;
	const int me = p->opts.shard_rank;
	float *part = tr_model_grads(d->m);
	gpu_comm_group_begin(d->c); /* the unit's reductions, one launch */
	for (size_t i = d->units[u].p0; i < d->units[u].p1 && d->err == TD_OK; i++) {
		const struct piece *q = &d->pieces[i];
		float *w = tr_model_grad_slot(d->m, q->slot) + q->soff;
		const size_t end = q->off + q->n;
		for (size_t r = q->off / S; r * S < end && d->err == TD_OK; r++) {
			const size_t x0 = q->off > r * S ? q->off : r * S;
			const size_t x1 = end < (r + 1) * S ? end : (r + 1) * S;
			float *send = w + (x0 - q->off);
			if ((int)r == me && !d->fresh)
				gpu_residual_forward(be, send, send, part + (x0 - lo), x1 - x0);
			d->err = gpu_comm_reduce_sum(d->c, send, x1 - x0, (int)r,
						     (int)r == me ? part + (x0 - lo) : NULL, &d->eb);
			d->stats.floats += x1 - x0;
		}
	}
	td_err e = gpu_comm_group_end(d->c, &d->eb);
	if (d->err == TD_OK)
		d->err = e;
	d->units[u].mark = gpu_comm_mark(d->c);
}

/* Before unit u's backward stage, the first writer of its ring slot (the
 * stage hook's call after the stage before it, as late as the slot can be
 * made ready): the slot free — the sums of unit u + TR_GRAD_RING, its last
 * user (the backward runs the units from the last) — and zero where the
 * backward adds (its projection weights' first products overwrite theirs:
 * tr_plan_dw_overwritten; an empty round's zeros are all of it). The units
 * that use a slot first in a micro-batch find it holding nothing of this
 * one's (the last micro-batch's sums were waited for by micro_begin) but
 * not zero: with plan.rest16_in_ring the forward put the head's bf16
 * weights there. */
static void grads_before_unit(struct tr_ddp *d, int u)
{
	const int k = u % TR_GRAD_RING;
	const size_t n = tr_model_plan(d->m)->grad_slot_numel[k];
	struct gpu_backend *be = tr_model_backend(d->m);
	float *slot = tr_model_grad_slot(d->m, k);
	if (u + TR_GRAD_RING < 2 * d->L)
		after(d, d->units[u + TR_GRAD_RING].mark);
	if (d->err != TD_OK || !n)
		return;
	if (d->empty) { /* no backward writes it: all of it */
		gpu_zero(be, slot, n * sizeof(float));
		return;
	}
	if (d->poison)
		gpu_scale(be, slot, NAN, n);
	for (size_t z = d->units[u].z0; z < d->units[u].z1; z++)
		gpu_zero(be, slot + d->zr[z].off, d->zr[z].n * sizeof(float));
}

/* The gradient unit a backward stage writes: layer l's MLP half 2l + 1,
 * then its attention half 2l; -1 for the others. */
static int stage_unit(const struct tr_stage *s)
{
	if (s->kind == TR_STAGE_LAYER_BACKWARD_MLP)
		return 2 * s->layer + 1;
	return s->kind == TR_STAGE_LAYER_BACKWARD ? 2 * s->layer : -1;
}

/* --- PARAMETERS --- */

/* Unit u's weights from their owners into its work buffer: each piece
 * split where the parts split it, each share broadcast from its owner's
 * part (gpu_comm_broadcast, in the same order on every rank). */
static void weights_gather(struct tr_ddp *d, int u)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	const size_t S = p->shard_numel, lo = p->shard_lo;
	const int me = p->opts.shard_rank;
	const float *part = tr_model_params(d->m);
	struct gpu_backend *be = tr_model_backend(d->m);
	for (size_t i = d->wunits[u].p0; i < d->wunits[u].p1 && d->err == TD_OK; i++) {
		const struct piece *q = &d->wpieces[i];
		float *w = q->g16 ? NULL : tr_model_weight_slot(d->m, q->slot) + q->wsoff;
		gpu_bf16 *h = q->g16 ? tr_model_weight_slot16(d->m, q->slot) + q->soff : NULL;
		const size_t end = q->off + q->n;
		for (size_t r = q->off / S; r * S < end && d->err == TD_OK; r++) {
			const size_t x0 = q->off > r * S ? q->off : r * S;
			const size_t x1 = end < (r + 1) * S ? end : (r + 1) * S;
			if (h) { /* bf16 only: the owner rounds its share where it goes */
				gpu_bf16 *y = h + (x0 - q->off);
				if ((int)r == me)
					gpu_bf16_round(be, y, part + (x0 - lo), x1 - x0);
				d->err = gpu_comm_broadcast16(d->c, y, x1 - x0, (int)r, y, &d->eb);
				d->stats.gathered += (x1 - x0 + 1) / 2;
				continue;
			}
			d->err = gpu_comm_broadcast(d->c, (int)r == me ? part + (x0 - lo) : NULL, x1 - x0,
						    (int)r, w + (x0 - q->off), &d->eb);
			d->stats.gathered += x1 - x0;
		}
	}
	d->wunits[u].mark = gpu_comm_mark(d->c);
	d->wready[u] = false;
}

/* Unit u's weights usable by the work enqueued next: its gather complete
 * and, in the bf16 mode, rounded into the bf16 work buffer (the bits
 * AdamW's own rounding gives an unsharded copy). */
static void weights_ensure(struct tr_ddp *d, int u)
{
	if (d->wready[u] || d->err != TD_OK)
		return;
	after(d, d->wunits[u].mark);
	if (d->err != TD_OK)
		return;
	/* what the GEMMs read in bf16 but was gathered in fp32 (a tied
	 * embedding): rounded now; the matrices came in bf16, the rest is read
	 * in fp32 only */
	for (size_t i = d->wunits[u].p0; i < d->wunits[u].p1; i++) {
		const struct piece *q = &d->wpieces[i];
		gpu_bf16 *h = tr_model_weight_slot16(d->m, q->slot);
		if (q->r16 && h)
			gpu_bf16_round(tr_model_backend(d->m), h + q->soff,
				       tr_model_weight_slot(d->m, q->slot) + q->wsoff, q->n);
	}
	d->wready[u] = true;
}

/* --- the embedding's rows (train/plan.h: embed_rows) --- */

/* This rank's floats of the embedding: [*a, *b) of the trainable ones,
 * the intersection of its part and the table (empty: *a == *b). */
static void emb_part(const struct tr_ddp *d, size_t *a, size_t *b)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	const size_t lo = p->shard_lo, hi = p->shard_hi, e1 = d->emb_off + d->emb_n;
	*a = lo > d->emb_off ? lo : d->emb_off;
	*b = hi < e1 ? hi : e1;
	if (*b < *a)
		*b = *a;
}

/* Every rank's ids (into grads.rows_ids, rank r's at r * N) and, with
 * dx, its d(res[0]) rows (into grads.rows): gathered from the model's, or
 * in an empty round zeros (id 0, rows of zeros: adding them changes no
 * sum). Returns the comm's mark after them. */
static uint64_t rows_gather(struct tr_ddp *d, bool dx)
{
	struct gpu_backend *be = tr_model_backend(d->m);
	const int me = tr_model_plan(d->m)->opts.shard_rank;
	const size_t N = (size_t)d->N, NC = N * (size_t)d->C;
	int32_t *ids;
	float *rows = tr_model_embed_rows(d->m, &ids);
	const int32_t *mids;
	float *res0, *dres;
	tr_model_embed_io(d->m, &mids, &res0, &dres);
	if (d->empty) {
		gpu_zero(be, ids + (size_t)me * N, N * sizeof(int32_t));
		if (dx)
			gpu_zero(be, rows + (size_t)me * NC, NC * sizeof(float));
	}
	/* the ids as 4-byte values: the gather copies them */
	const float *sid = d->empty ? (const float *)(ids + (size_t)me * N) : (const float *)mids;
	d->err = gpu_comm_all_gather_from(d->c, sid, (float *)ids, N, &d->eb);
	if (dx && d->err == TD_OK) {
		d->err = gpu_comm_all_gather_from(d->c, d->empty ? rows + (size_t)me * NC : dres, rows,
						  NC, &d->eb);
		d->stats.rows += (uint64_t)d->R * NC;
	}
	return gpu_comm_mark(d->c);
}

/* The embedding's backward (after TR_STAGE_EMBED_BACKWARD, the model having
 * left the scatter of its d(res[0]) to this): every rank's rows gathered,
 * then scattered in rank order (row n of rank r is row r * N + n: the
 * order of one device's micro-batches) into what this rank keeps —
 * sharded gradients: its part's floats of the table, after the head's sums
 * onto the part where the embedding is the head; unsharded: the whole
 * table, after its sum over the ranks (the head's part of it, and earlier
 * micro-batches' own scatters). */
static void rows_backward(struct tr_ddp *d)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	struct gpu_backend *be = tr_model_backend(d->m);
	const uint64_t g = rows_gather(d, true);
	int32_t *ids;
	const float *rows = tr_model_embed_rows(d->m, &ids);
	const int NR = d->N * d->R;
	/* g is after every collective started before the gather's, so the
	 * scatter also runs after the table's sums: the head's onto the part,
	 * or (unsharded) the table's own */
	if (d->err == TD_OK)
		after(d, g);
	if (d->gr) {
		size_t a, b;
		emb_part(d, &a, &b);
		if (d->err == TD_OK && b > a)
			gpu_embedding_backward_part(be, tr_model_grads(d->m) + (a - p->shard_lo), rows,
						    ids, NR, d->C, a - d->emb_off, b - d->emb_off);
		return;
	}
	if (d->err == TD_OK)
		gpu_embedding_backward_part(be, d->grads + d->emb_off, rows, ids, NR, d->C, 0,
					    d->emb_n);
}

/* lookup_start where one rank's part holds the whole table (emb_owner):
 * it writes each other rank's rows into the rows buffer and broadcasts them
 * to that rank (into its res[0]; to the rest into their rows buffer,
 * unread), and its own straight into its res[0] — the table's floats
 * themselves, as the sum over the parts gives them, with half its bytes on
 * two GPUs and nothing to wait for on the owner. */
static void lookup_owned(struct tr_ddp *d, float *rows, const int32_t *ids, const int32_t *mids,
			 float *res0)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	struct gpu_backend *be = tr_model_backend(d->m);
	const int me = p->opts.shard_rank, o = d->emb_owner;
	const size_t NC = (size_t)d->N * (size_t)d->C;
	const float *table =
		me == o ? tr_model_params(d->m) + (d->emb_off - (d->wp ? p->shard_lo : 0)) : NULL;
	if (me == o && !d->empty)
		gpu_embedding_forward_part(be, res0, mids, table, d->N, d->C, 0, d->emb_n);
	for (int r = 0; r < d->R && d->err == TD_OK; r++) {
		if (r == o)
			continue;
		float *x = rows + (size_t)r * NC;
		if (me == o)
			gpu_embedding_forward_part(be, x, ids + (size_t)r * (size_t)d->N, table, d->N,
						   d->C, 0, d->emb_n);
		d->err = gpu_comm_broadcast(d->c, x, NC, o, r == me && !d->empty ? res0 : x, &d->eb);
		d->stats.rows += NC;
	}
}

/* PARAMETERS with the embedding apart from the head, and GRADIENTS whose
 * masters are the part's (plan.embed_lookup_rows;
 * after TR_STAGE_EMBED, which left res[0] to this): every rank's ids
 * gathered; this rank writes the floats of the table its part holds for
 * all of them (zeros elsewhere) and each rank's N rows are summed onto it,
 * into its res[0] — one part holds each float, so the sum is the table's
 * row (an empty round's into its own rows) — or the one rank holding it all
 * sends them (lookup_owned). Waited for by lookup_wait. */
static void lookup_start(struct tr_ddp *d)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	struct gpu_backend *be = tr_model_backend(d->m);
	const int me = p->opts.shard_rank;
	const uint64_t g = rows_gather(d, false);
	int32_t *ids;
	float *rows = tr_model_embed_rows(d->m, &ids);
	const int32_t *mids;
	float *res0, *dres;
	tr_model_embed_io(d->m, &mids, &res0, &dres);
	const size_t NC = (size_t)d->N * (size_t)d->C;
	if (d->err == TD_OK)
		after(d, g);
	if (d->err != TD_OK)
		return;
	if (d->emb_owner >= 0) {
		lookup_owned(d, rows, ids, mids, res0);
		d->lookup_mark = gpu_comm_mark(d->c);
		return;
	}
	size_t a, b;
	emb_part(d, &a, &b);
	if (b > a)
		gpu_embedding_forward_part(be, rows, ids,
					   tr_model_params(d->m) + (a - (d->wp ? p->shard_lo : 0)),
					   d->N * d->R, d->C, a - d->emb_off, b - d->emb_off);
	else
		gpu_zero(be, rows, (size_t)d->R * NC * sizeof(float));
	for (int r = 0; r < d->R && d->err == TD_OK; r++) {
		float *x = rows + (size_t)r * NC;
		d->err = gpu_comm_reduce_sum(d->c, x, NC, r,
					     r == me ? (d->empty ? x : res0) : NULL, &d->eb);
		d->stats.rows += NC;
	}
	d->lookup_mark = gpu_comm_mark(d->c);
}

static void lookup_wait(struct tr_ddp *d)
{
	if (d->err == TD_OK)
		after(d, d->lookup_mark);
}

/* The gathers around the stages: a layer's weights are gathered one layer
 * ahead (into the slot the layer before it has finished with) and ensured
 * before its forward; the backward finds the last two layers' still in the
 * ring and gathers layer l - 2 once layer l's backward has freed its slot.
 * The other tensors' (final norm, head, a tied embedding) and layer 0's
 * are gathered by micro_begin, the others' ensured at once where the
 * lookup reads them (a tied embedding), else after the last layer's
 * forward. An untied embedding is never gathered (lookup_start). Where the
 * head's bf16 weights share layer L - 2's bf16 slot (plan.rest16_slot),
 * the head's are gathered after layer L - 2's forward instead, and layer
 * L - 2's again after the final norm's backward (the backward then finds
 * only the last layer's in the ring). */
static void weights_on_stage(struct tr_ddp *d, const struct tr_stage *s)
{
	const int L = d->L;
	/* plan.rest16_slot: the head's bf16 weights over layer L - 2's slot */
	const bool late = tr_model_plan(d->m)->rest16_slot >= 0;
	if (s->kind == TR_STAGE_EMBED) {
		if (L > 1)
			weights_gather(d, 1);
		if (L == 0)
			weights_ensure(d, L);
	} else if (s->kind == TR_STAGE_LAYER) {
		if (s->layer + 2 < L)
			weights_gather(d, s->layer + 2);
		if (late && s->layer == L - 2) /* its slot read for the last time */
			weights_gather(d, L);
		if (s->layer + 1 < L)
			weights_ensure(d, s->layer + 1);
		if (s->layer == L - 1)
			weights_ensure(d, L);
	} else if (s->kind == TR_STAGE_FINAL_NORM_BACKWARD) {
		if (late) /* the head's last reader done: layer L - 2's again */
			weights_gather(d, L - 2);
	} else if (s->kind == TR_STAGE_LAYER_BACKWARD) {
		if (s->layer - 2 >= 0)
			weights_gather(d, s->layer - 2);
		if (s->layer - 1 >= 0)
			weights_ensure(d, s->layer - 1);
	}
}

/* After the final norm's backward the head's gradients (the final norm's,
 * a tied embedding's head part) are final and summed onto their owners,
 * overlapping the layers' backward. */
static void grads_head_done(struct tr_ddp *d)
{
	grads_reduce(d, 2 * d->L);
	d->head_reduced = true;
	d->stats.overlapped++;
}

static td_err take_err(struct tr_ddp *d, struct td_errbuf *eb)
{
	td_err e = d->err;
	if (e != TD_OK)
		snprintf(eb->msg, sizeof(eb->msg), "%s", d->eb.msg);
	d->err = TD_OK;
	return e;
}

bool tr_ddp_sharded_grads(const struct tr_ddp *d)
{
	return d->gr;
}

td_err tr_ddp_check(struct tr_ddp *d, struct td_errbuf *eb)
{
	return take_err(d, eb);
}

static td_err micro_begin(struct tr_ddp *d, bool empty, struct td_errbuf *eb)
{
	if (!d->gr)
		return TD_OK;
	/* The last micro-batch's sums read the slots: done before this one's
	 * forward gathers into them (plan.rest16_in_ring) and grads.rest is
	 * zeroed where the backward adds (the ring's slots are zeroed before
	 * their first writer: grads_before_unit). */
	td_err e = gpu_comm_wait(d->c, eb);
	if (e != TD_OK)
		return e;
	const size_t n = tr_model_plan(d->m)->grad_slot_numel[TR_GRAD_RING];
	struct gpu_backend *be = tr_model_backend(d->m);
	float *rest = tr_model_grad_slot(d->m, TR_GRAD_RING);
	if (!n)
		return TD_OK;
	if (empty) { /* no backward writes it: all of it */
		gpu_zero(be, rest, n * sizeof(float));
		return TD_OK;
	}
	/* but the head's weight, which its first chunk overwrites */
	tr_model_head_overwrites_next(d->m);
	if (d->poison)
		gpu_scale(be, rest, NAN, n);
	for (size_t z = d->units[2 * d->L].z0; z < d->units[2 * d->L].z1; z++)
		gpu_zero(be, rest + d->zr[z].off, d->zr[z].n * sizeof(float));
	return TD_OK;
}

td_err tr_ddp_micro_begin(struct tr_ddp *d, struct td_errbuf *eb)
{
	return micro_begin(d, false, eb);
}

/* PARAMETERS: the weights a forward starts with (the stage hook's call
 * before its first stage: every forward, a training micro-batch's or an
 * evaluation's, which every rank then runs). */
static void weights_begin(struct tr_ddp *d)
{
	/* plan.rest16_slot: the head's (no embedding in it) after layer L - 2's forward */
	if (tr_model_plan(d->m)->rest16_slot < 0)
		weights_gather(d, d->L);
	if (d->L > 0)
		weights_gather(d, 0);
	if (d->lookup_l) /* the lookup reads the tied embedding */
		weights_ensure(d, d->L);
	if (d->L > 0)
		weights_ensure(d, 0);
}

td_err tr_ddp_micro_end(struct tr_ddp *d, struct td_errbuf *eb)
{
	if (!d->gr)
		return TD_OK;
	if (d->err == TD_OK && !d->head_reduced) { /* a plan without the final norm's backward */
		grads_reduce(d, 2 * d->L);
		d->stats.at_finish++;
	}
	d->fresh = false; /* every unit summed into the parts */
	d->head_reduced = false;
	return take_err(d, eb);
}

static void on_stage(void *ctx, const struct tr_stage *s);

td_err tr_ddp_micro_empty(struct tr_ddp *d, struct td_errbuf *eb)
{
	assert(d->gr);
	/* The hook's calls after every stage of a forward and backward, on
	 * zero gradients: the same collectives in the same order. */
	td_err e = micro_begin(d, true, eb);
	const struct tr_plan *p = tr_model_plan(d->m);
	d->empty = true;
	if (e == TD_OK)
		on_stage(d, NULL);
	for (size_t i = 0; i < p->nstages && e == TD_OK && d->err == TD_OK; i++)
		if (p->stages[i].kind != TR_STAGE_OPTIMIZER)
			on_stage(d, &p->stages[i]);
	d->empty = false;
	return e != TD_OK ? e : tr_ddp_micro_end(d, eb);
}

td_err tr_ddp_grad_norm(struct tr_ddp *d, double *norm, struct td_errbuf *eb)
{
	double ss = tr_model_grad_sumsq(d->m);
	if (d->gr) {
		td_err e = gpu_comm_sum_host(d->c, &ss, eb);
		if (e != TD_OK)
			return e;
	}
	*norm = sqrt(ss);
	return TD_OK;
}

static void on_stage(void *ctx, const struct tr_stage *s)
{
	struct tr_ddp *d = ctx;
	if (!s) { /* a forward begins */
		if (d->wp && d->err == TD_OK)
			weights_begin(d);
		return;
	}
	if (d->gr) {
		const struct tr_plan *p = tr_model_plan(d->m);
		const size_t next = (size_t)(s - p->stages) + 1;
		if (stage_unit(s) >= 0 && d->err == TD_OK) { /* its sums started */
			grads_reduce(d, stage_unit(s));
			d->stats.overlapped++;
		}
		if (s->kind == TR_STAGE_FINAL_NORM_BACKWARD && d->err == TD_OK)
			grads_head_done(d);
		if (s->kind == TR_STAGE_EMBED_BACKWARD && d->rows && d->err == TD_OK)
			rows_backward(d);
		const bool lookup = d->lookup && s->kind == TR_STAGE_EMBED && d->err == TD_OK;
		if (lookup)
			lookup_start(d);
		if (d->wp && d->err == TD_OK)
			weights_on_stage(d, s);
		if (lookup)
			lookup_wait(d);
		/* last: it may wait, with the collectives above enqueued */
		if (next < p->nstages && stage_unit(&p->stages[next]) >= 0 && d->err == TD_OK)
			grads_before_unit(d, stage_unit(&p->stages[next]));
		/* The forward's end: tr_model_forward blocks on the stream next */
		if (next == p->nforward && d->joined && d->err == TD_OK)
			d->err = gpu_comm_wait_for(d->c, d->joined, &d->eb);
		return;
	}
	if (d->armed)
		sum_runs(d, (size_t)(s - tr_model_plan(d->m)->stages), d->bucket_floats, false);
	if (s->kind == TR_STAGE_EMBED_BACKWARD && d->rows && d->last && d->err == TD_OK) {
		/* the table's sum (where one is needed: not yet made) before the rows */
		struct span *e = &d->spans[d->emb_span];
		if (!e->summed) {
			d->err = gpu_comm_all_reduce_sum(d->c, d->grads + e->off, e->end - e->off, &d->eb);
			e->summed = true;
			d->stats.floats += e->end - e->off;
			d->stats.overlapped++;
		}
		rows_backward(d);
		tr_model_take_embed_rows(d->m, false);
		d->last = false;
	}
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
	d->step_piece = DDP_STEP_PIECE;
	d->grads = tr_model_grads(m);
	d->bucket_floats = bucket_floats ? bucket_floats : TR_DDP_BUCKET_FLOATS;
	d->overlap = overlap || gpu_comm_async(c);
	d->nstages = p->nstages;
	d->gr = tr_shard_grads(p->opts.shard, p->opts.shard_ranks);
	d->wp = tr_shard_params(p->opts.shard, p->opts.shard_ranks);
	d->L = p->cfg.num_layers;
	const struct tr_param *emb = tr_plan_param(p, "model.embed_tokens.weight");
	d->rows = p->embed_rows;
	d->lookup = p->embed_lookup_rows;
	if (d->rows) {
		d->emb_off = emb->goffset;
		d->emb_n = emb->numel;
		d->N = p->opts.B * p->opts.T;
		d->C = p->cfg.hidden_size;
		d->R = p->opts.shard_ranks;
		d->emb_head = p->cfg.tie_word_embeddings && p->opts.num_labels == 0;
		d->lookup_l = d->wp && emb->wunit == d->L;
	}
	d->emb_owner = -1;
	if (d->lookup && p->shard_numel && d->emb_n && gpu_comm_can_broadcast(c) &&
	    d->emb_off / p->shard_numel == (d->emb_off + d->emb_n - 1) / p->shard_numel)
		d->emb_owner = (int)(d->emb_off / p->shard_numel);
	if (d->gr) {
		d->fresh = true; /* zero_grad before the first step */
		d->poison = getenv("TD_TEST_POISON_GRADS") != NULL;
		td_err e = grads_units(d, p, eb);
		if (e == TD_OK)
			part_overwrite(d);
		if (e != TD_OK) {
			free(d->units);
			free(d->pieces);
			free(d->zr);
			free(d->spans);
			free(d->wunits);
			free(d->wpieces);
			free(d->wready);
			free(d);
			return e;
		}
		tr_model_set_stage_hook(m, on_stage, d);
		*out = d;
		return TD_OK;
	}
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *t = &p->params[i];
		if (!t->trainable || !t->numel)
			continue;
		/* A decoder layer's tensors: after its backward. An untied head
		 * (lm_head, a classifier's score): after the head's last backward
		 * chunk (with the fused head, the forward's). The final norm: after
		 * its backward. The embedding by rows: its table (a tied head's
		 * part, earlier micro-batches' scatters) after the final norm's
		 * backward, its rows at its own (on_stage); else at the end. */
		size_t ready = p->nstages;
		enum tr_stage_kind after = TR_STAGE_KIND_COUNT;
		if (t->layer >= 0)
			after = TR_STAGE_LAYER_BACKWARD;
		else if (t->kind == TR_P_HEAD || strcmp(t->name, "lm_head.weight") == 0)
			after = TR_STAGE_HEAD_BACKWARD;
		else if (strcmp(t->name, "model.norm.weight") == 0 || (d->rows && t == emb))
			after = TR_STAGE_FINAL_NORM_BACKWARD;
		for (size_t k = p->nforward; k < p->nstages; k++)
			if (p->stages[k].kind == after &&
			    (after != TR_STAGE_LAYER_BACKWARD || p->stages[k].layer == t->layer))
				ready = k; /* the last such stage */
		d->spans[d->nspans++] = (struct span){t->goffset, t->goffset + t->numel, ready, false};
	}
	qsort(d->spans, d->nspans, sizeof(*d->spans), by_off);
	for (size_t i = 0; d->rows && i < d->nspans; i++)
		if (d->spans[i].off == d->emb_off)
			d->emb_span = i;
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
	free(d->units);
	free(d->pieces);
	free(d->zr);
	free(d->wunits);
	free(d->wpieces);
	free(d->wready);
	free(d);
}

void tr_ddp_set_accum(struct tr_ddp *d, int accum)
{
	d->accum = accum;
}

void tr_ddp_arm(struct tr_ddp *d)
{
	d->armed = d->overlap;
	if (!d->rows || d->gr)
		return;
	d->last = true;
	tr_model_take_embed_rows(d->m, true);
	/* An untied table has nothing to sum where no rank ran an earlier
	 * micro-batch (its scatter): zero on every rank. The same answer on
	 * every rank: from the step's micro-batches, not this rank's. */
	if (!d->emb_head && d->accum > 0 && d->accum <= d->R)
		d->spans[d->emb_span].summed = true;
}

td_err tr_ddp_finish(struct tr_ddp *d, struct td_errbuf *eb)
{
	if (d->gr) { /* every unit was summed by its micro-batches */
		d->fresh = true; /* the next step's zero_grad zeroes the parts */
		td_err e = take_err(d, eb);
		if (e == TD_OK)
			e = gpu_comm_wait(d->c, eb);
		d->stats.steps++;
		return e;
	}
	d->armed = false;
	if (d->last) { /* no embedding backward ran after tr_ddp_arm */
		tr_model_take_embed_rows(d->m, false);
		d->last = false;
	}
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

/* plan.masters_part: the bf16 copy and the floats read in fp32 (those that
 * do not decay: norms, biases) from their owners; the other fp32 masters
 * stay the part's. Each rank's part is cut in pieces at the same offsets
 * from its start (step_piece floats; the copy covers floats [copy16_lo, T),
 * the undecayed ones [numel_decay, T)); with h, each piece is stepped
 * first (tr_model_adamw_part) and its gathers launched right after it, so
 * that they run beside AdamW on the next; without h the weights are only
 * gathered. A piece's broadcasts from every rank are one NCCL group: both
 * link directions carry them at once. */
static td_err masters_part_pieces(struct tr_ddp *d, const struct tr_adamw *h, float lr, int t,
				  struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	const size_t S = p->shard_numel, T = p->numel_trainable, c = p->copy16_lo;
	const size_t nd = p->numel_decay;
	const int R = p->opts.shard_ranks;
	gpu_bf16 *h16 = tr_model_params16(d->m);
	float *w = tr_model_params(d->m);
	td_err e = TD_OK;
	const size_t P = d->step_piece;
	for (size_t k0 = 0; k0 < S && e == TD_OK; k0 += P) {
		const size_t k1 = k0 + P < S ? k0 + P : S;
		if (h)
			tr_model_adamw_part(d->m, h, lr, t, p->shard_lo + k0, p->shard_lo + k1);
		struct td_errbuf later; /* a failure inside the group keeps its own words */
		gpu_comm_group_begin(d->c);
		for (int r = 0; r < R && e == TD_OK; r++) {
			const size_t a = (size_t)r * S + k0;
			const size_t b = (size_t)r * S + k1 < T ? (size_t)r * S + k1 : T;
			const size_t a16 = a > c ? a : c, a32 = a > nd ? a : nd;
			if (b > a16)
				e = gpu_comm_broadcast16(d->c, h16 + (a16 - c), b - a16, r,
							 h16 + (a16 - c), eb);
			if (e == TD_OK && b > a32)
				e = gpu_comm_broadcast(d->c, w + a32, b - a32, r, w + a32, eb);
		}
		td_err ge = gpu_comm_group_end(d->c, e == TD_OK ? eb : &later);
		if (e == TD_OK)
			e = ge;
	}
	if (e == TD_OK)
		e = gpu_comm_wait(d->c, eb);
	if (e == TD_OK)
		d->stats.gathered += (T - c + 1) / 2 + (T > nd ? T - nd : 0);
	return e;
}

void tr_ddp_set_step_piece(struct tr_ddp *d, size_t floats)
{
	d->step_piece = floats ? (floats + 63) / 64 * 64 : DDP_STEP_PIECE;
}

td_err tr_ddp_step(struct tr_ddp *d, const struct tr_adamw *h, float lr, int t,
		   struct td_errbuf *eb)
{
	/* (a gang keeps no embedding rows for AdamW: plan.grads_lo is one
	 * rank's, so no piece cuts them) */
	if (tr_model_plan(d->m)->masters_part)
		return masters_part_pieces(d, h, lr, t, eb);
	tr_model_adamw(d->m, h, lr, t);
	return tr_ddp_gather_params(d, eb);
}

td_err tr_ddp_gather_params(struct tr_ddp *d, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(d->m);
	if (p->opts.shard == TR_SHARD_NONE || p->opts.shard_ranks < 2 || !p->shard_numel || d->wp)
		return TD_OK; /* PARAMETERS: the part is all a rank keeps; the gathers are per use */
	if (p->masters_part)
		return masters_part_pieces(d, NULL, 0.0f, 0, eb);
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
