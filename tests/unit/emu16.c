/* The bf16-mode emulator of tests/unit/emu16.h: the CPU backend's table with
 * the ops that take twins replaced. */
#include "tests/unit/emu16.h"

#include <assert.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/ops.h"

static size_t violations;

size_t emu16_violations(void)
{
	return violations;
}

static void violation(const char *fmt, const char *what, size_t a, size_t b)
{
	if (violations++ < 10) {
		fprintf(stderr, "emu16: ");
		fprintf(stderr, fmt, what, a, b);
		fputc('\n', stderr);
	}
}

static void *xmalloc(size_t bytes)
{
	void *p = malloc(bytes ? bytes : 1);
	if (!p) {
		fprintf(stderr, "emu16: out of memory\n");
		abort();
	}
	return p;
}

/* n floats: x16 widened, else x rounded to bf16 and widened (a GEMM operand
 * as the tensor cores read it). A twin beside its fp32 tensor must be that
 * tensor rounded. */
static float *operand(const char *what, const float *x, const gpu_bf16 *x16, size_t n)
{
	float *r = xmalloc(n * sizeof(float));
	gpu_bf16 *h = xmalloc(n * sizeof(gpu_bf16));
	if (x) {
		bf16_round(h, x, n);
		if (x16) {
			size_t stale = 0;
			for (size_t i = 0; i < n; i++)
				stale += h[i] != x16[i];
			if (stale)
				violation("%s: twin is not its fp32 tensor rounded (%zu of %zu values)", what,
					  stale, n);
		}
	}
	bf16_widen(r, x16 ? x16 : h, n);
	free(h);
	return r;
}

/* n floats for an op that reads fp32: x, or its twin widened. */
static const float *input(const float *x, const gpu_bf16 *x16, size_t n, float **tmp)
{
	*tmp = NULL;
	if (x)
		return x;
	*tmp = xmalloc(n * sizeof(float));
	bf16_widen(*tmp, x16, n);
	return *tmp;
}

/* An output: into out, or a temporary when only its twin is wanted; then
 * finish writes the twin. */
static float *output(float *out, size_t n, float **tmp)
{
	*tmp = out ? NULL : xmalloc(n * sizeof(float));
	return out ? out : *tmp;
}

static void finish(gpu_bf16 *out16, const float *v, size_t n, float *tmp)
{
	if (out16)
		bf16_round(out16, v, n);
	free(tmp);
}

static void check_scratch(struct gpu_backend *be, const char *what, size_t need)
{
	size_t have = be->gemm_scratch ? be->gemm_scratch_bytes / 2 : 0;
	if (need > have)
		violation("%s: needs %zu bf16 values of gemm_scratch, has %zu", what, need, have);
}

static td_err emu_set_bf16(struct gpu_backend *be, bool bf16, struct td_errbuf *eb)
{
	if (!bf16)
		return td_fail(eb, TD_EUNSUPPORTED, "emu16: the bf16 mode only");
	return TD_OK;
}

static bool emu_true(struct gpu_backend *be)
{
	return true;
}

static bool emu_no_flash(struct gpu_backend *be, int HS)
{
	return false;
}

static void emu_embedding_forward(struct gpu_backend *be, float *out, const int32_t *ids,
				  const float *wte, const gpu_bf16 *wte16, int N, int C)
{
	if (wte && wte16)
		violation("%s: both a table and its bf16 form (%zu x %zu)", "embedding_forward",
			  (size_t)N, (size_t)C);
	if (wte) {
		embedding_forward(out, ids, wte, N, C);
		return;
	}
	for (int n = 0; n < N; n++)
		bf16_widen(out + (size_t)n * C, wte16 + (size_t)ids[n] * C, (size_t)C);
}

static void emu_rmsnorm_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *rstd,
				const float *inp, const float *weight, int N, int C, float eps)
{
	float *tmp;
	float *o = output(out, (size_t)N * C, &tmp);
	rmsnorm_forward(o, rstd, inp, weight, N, C, eps);
	finish(out16, o, (size_t)N * C, tmp);
}

static void emu_matmul_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const float *inp, const gpu_bf16 *inp16, const float *weight,
			       const gpu_bf16 *weight16, const float *bias, int N, int C, int OC)
{
	check_scratch(be, "matmul_forward",
		      gpu_matmul_scratch_elems((size_t)N, (size_t)C, (size_t)OC, false, false, false,
					       weight16, inp16, false));
	assert(!out16 || (!out && !bias));
	float *x = operand("matmul_forward inp", inp, inp16, (size_t)N * C);
	float *w = operand("matmul_forward weight", weight, weight16, (size_t)OC * C);
	float *tmp;
	float *o = output(out, (size_t)N * OC, &tmp);
	matmul_forward(o, x, w, bias, N, C, OC);
	finish(out16, o, (size_t)N * OC, tmp);
	free(x);
	free(w);
}

static void emu_matmul_forward_add(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				   const float *inp, const gpu_bf16 *inp16, const float *weight,
				   const gpu_bf16 *weight16, int N, int C, int OC)
{
	check_scratch(be, "matmul_forward_add",
		      gpu_matmul_scratch_elems((size_t)N, (size_t)C, (size_t)OC, false, false, false,
					       weight16, inp16, false));
	float *x = operand("matmul_forward_add inp", inp, inp16, (size_t)N * C);
	float *w = operand("matmul_forward_add weight", weight, weight16, (size_t)OC * C);
	float *acc = out;
	if (out16) { /* the bf16 sum: the old values widened, added, rounded once */
		assert(!out);
		acc = xmalloc((size_t)N * OC * sizeof(float));
		bf16_widen(acc, out16, (size_t)N * OC);
	}
	matmul_forward_add(acc, x, w, N, C, OC);
	if (out16) {
		bf16_round(out16, acc, (size_t)N * OC);
		free(acc);
	}
	free(x);
	free(w);
}

static void emu_matmul_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				float *dweight, float *dbias, const float *dout,
				const gpu_bf16 *dout16, const float *inp, const gpu_bf16 *inp16,
				const float *weight, const gpu_bf16 *weight16, int N, int C, int OC,
				unsigned set)
{
	const bool dinp_set = set & GPU_SET_DINP;
	check_scratch(be, "matmul_backward",
		      gpu_matmul_scratch_elems((size_t)N, (size_t)C, (size_t)OC, true,
					       dinp || dinp16, dweight, weight16, inp16, dout16));
	assert(dout || !dbias);
	if (dinp16) { /* the fp32 product, rounded once */
		assert(!dinp && dinp_set);
		float *t = xmalloc((size_t)N * C * sizeof(float));
		emu_matmul_backward(be, t, NULL, dweight, dbias, dout, dout16, inp, inp16, weight,
				    weight16, N, C, OC, set);
		bf16_round(dinp16, t, (size_t)N * C);
		free(t);
		return;
	}
	float *d = operand("matmul_backward dout", dout, dout16, (size_t)N * OC);
	float *x = dweight ? operand("matmul_backward inp", inp, inp16, (size_t)N * C) : NULL;
	float *w = dinp ? operand("matmul_backward weight", weight, weight16, (size_t)OC * C) : NULL;
	if (dinp && dinp_set)
		memset(dinp, 0, (size_t)N * C * sizeof(float));
	if (dweight && (set & GPU_SET_DWEIGHT))
		memset(dweight, 0, (size_t)OC * C * sizeof(float));
	/* dweight and dinp from the bf16 operands; dbias from the fp32 dout */
	matmul_backward(dinp, dweight, NULL, d, x ? x : d, w ? w : d, N, C, OC);
	if (dbias)
		matmul_backward(NULL, NULL, dbias, dout, d, d, N, C, OC);
	free(d);
	free(x);
	free(w);
}

static void emu_attention_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *att,
				  const float *q, const gpu_bf16 *q16, const float *k,
				  const gpu_bf16 *k16, const float *v, const gpu_bf16 *v16, int B,
				  int T, int NH, int NKV, int HS)
{
	/* not fused (emu_no_flash): q, k, v in fp32, as the engine keeps them then */
	if (q16 || k16 || v16 || !out)
		violation("%s: q, k, v twins or no fp32 out given to the unfused attention (%zu x %zu)",
			  "attention_forward", (size_t)B * T, (size_t)NH * HS);
	attention_forward(out, att, q, k, v, B, T, NH, NKV, HS);
	finish(out16, out, (size_t)B * T * NH * HS, NULL);
}

/* The fused attention (emu16_flash_backend_new), by what it reads and keeps
 * rather than how it computes: q, k, v in bf16 (twins, or fp32 rounded),
 * B*NH*T row statistics in att instead of probabilities, room for its
 * copies in gemm_scratch (gpu_flash_scratch_bytes), an output in fp32 or
 * bf16 or both (out or out16 NULL), and a backward that reads the
 * forward's row statistics and output (held to be the forward's own: a
 * plan that dropped or overwrote them is a violation) and, as the kernels
 * do, forms D = rowsum(dout * out) from out16 widened where it is given,
 * else from out (flash_rowdot). The statistic is sum_s P[t][s] (s + 1);
 * the products are the CPU's. */
static bool emu_flash(struct gpu_backend *be, int HS)
{
	return gpu_flash_head_size(HS);
}

/* q, k, v as the fused kernels read them, widened; P (B,NH,T,T), o
 * (B,T,NH,HS) and the row statistics (B,NH,T) recomputed from them. */
static void flash_math(struct gpu_backend *be, const char *what, const float *q,
		       const gpu_bf16 *q16, const float *k, const gpu_bf16 *k16, const float *v,
		       const gpu_bf16 *v16, int B, int T, int NH, int NKV, int HS, float **qw,
		       float **kw, float **vw, float **P, float *o, float *stats)
{
	const size_t nq = (size_t)B * T * NH * HS, nk = (size_t)B * T * NKV * HS;
	const bool twins = q16 && k16 && v16;
	if (!twins && (q16 || k16 || v16))
		violation("%s: some of q, k, v as twins (%zu x %zu)", what, (size_t)B * T,
			  (size_t)NH * HS);
	check_scratch(be, what, gpu_flash_scratch_bytes(B, T, NH, NKV, HS, twins) / 2);
	*qw = operand(what, q, q16, nq);
	*kw = operand(what, k, k16, nk);
	*vw = operand(what, v, v16, nk);
	*P = xmalloc((size_t)B * NH * T * T * sizeof(float));
	attention_forward(o, *P, *qw, *kw, *vw, B, T, NH, NKV, HS);
	for (size_t r = 0; r < (size_t)B * NH * T; r++) {
		const float *row = *P + r * T;
		double s = 0.0;
		for (int c = 0; c < T; c++)
			s += (double)row[c] * (c + 1);
		stats[r] = (float)s;
	}
}

static void emu_flash_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *att,
			      const float *q, const gpu_bf16 *q16, const float *k,
			      const gpu_bf16 *k16, const float *v, const gpu_bf16 *v16, int B,
			      int T, int NH, int NKV, int HS)
{
	if (!emu_flash(be, HS)) {
		emu_attention_forward(be, out, out16, att, q, q16, k, k16, v, v16, B, T, NH, NKV, HS);
		return;
	}
	const size_t nq = (size_t)B * T * NH * HS;
	if (!out && !out16)
		violation("%s: neither out nor out16 (%zu x %zu)", "attention_forward (fused)",
			  (size_t)B * T, (size_t)NH * HS);
	float *qw, *kw, *vw, *P, *tmp;
	float *o = output(out, nq, &tmp);
	flash_math(be, "attention_forward (fused)", q, q16, k, k16, v, v16, B, T, NH, NKV, HS, &qw,
		   &kw, &vw, &P, o, att);
	finish(out16, o, nq, tmp);
	free(qw);
	free(kw);
	free(vw);
	free(P);
}

static void emu_flash_backward(struct gpu_backend *be, float *dq, float *dk, float *dv,
			       float *datt, const float *dout, const float *out,
			       const gpu_bf16 *out16, const float *q, const gpu_bf16 *q16,
			       const float *k, const gpu_bf16 *k16, const float *v,
			       const gpu_bf16 *v16, const float *att, int B, int T, int NH, int NKV,
			       int HS)
{
	if (!emu_flash(be, HS)) {
		attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, NH, NKV, HS);
		return;
	}
	const size_t nq = (size_t)B * T * NH * HS, nr = (size_t)B * NH * T;
	float *qw, *kw, *vw, *P, *o = xmalloc(nq * sizeof(float)), *st = xmalloc(nr * sizeof(float));
	flash_math(be, "attention_backward (fused)", q, q16, k, k16, v, v16, B, T, NH, NKV, HS, &qw,
		   &kw, &vw, &P, o, st);
	/* out16: the forward's out rounded (the bits its twin got); out: the
	 * forward's out itself; D from the first given, as flash_rowdot */
	gpu_bf16 *o16 = xmalloc(nq * sizeof(gpu_bf16));
	bf16_round(o16, o, nq);
	if (!out && !out16)
		violation("%s: neither out nor out16 (%zu x %zu)", "attention_backward (fused)",
			  (size_t)B * T, (size_t)NH * HS);
	if (out16 && memcmp(o16, out16, nq * sizeof(gpu_bf16)) != 0)
		violation("%s: out16 is not the forward's of these q, k, v, rounded (%zu x %zu)",
			  "attention_backward (fused)", (size_t)B * T, (size_t)NH * HS);
	if (out && memcmp(o, out, nq * sizeof(float)) != 0)
		violation("%s: out is not the forward's of these q, k, v (%zu x %zu)",
			  "attention_backward (fused)", (size_t)B * T, (size_t)NH * HS);
	if (memcmp(st, att, nr * sizeof(float)) != 0)
		violation("%s: the row statistics are not the forward's (%zu rows of %zu)",
			  "attention_backward (fused)", nr, (size_t)T);
	float *w16 = NULL;
	if (out16) {
		w16 = xmalloc(nq * sizeof(float));
		bf16_widen(w16, out16, nq);
	}
	const float *ow = w16 ? w16 : out ? out : o;
	float *dr = xmalloc(nr * sizeof(float));
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++)
			for (int t = 0; t < T; t++) {
				const size_t at = (((size_t)b * T + t) * NH + h) * HS;
				double s = 0.0;
				for (int c = 0; c < HS; c++)
					s += (double)dout[at + c] * ow[at + c];
				dr[((size_t)b * NH + h) * T + t] = (float)s;
			}
	free(w16);
	float *dS = xmalloc(nr * T * sizeof(float));
	attention_backward_dr(dq, dk, dv, dS, dout, qw, kw, vw, P, dr, B, T, NH, NKV, HS);
	free(dr);
	free(o16);
	/* datt is the kernels' scratch (gpu_flash_datt_floats): written, as theirs */
	memset(datt, 0, nr * sizeof(float));
	free(dS);
	free(qw);
	free(kw);
	free(vw);
	free(P);
	free(o);
	free(st);
}

static void emu_swiglu_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const float *gate, const float *up, const gpu_bf16 *gate16,
			       const gpu_bf16 *up16, size_t n)
{
	float *tg, *tu, *tmp;
	const float *g = input(gate, gate16, n, &tg), *u = input(up, up16, n, &tu);
	float *o = output(out, n, &tmp);
	swiglu_forward(o, g, u, n);
	finish(out16, o, n, tmp);
	free(tg);
	free(tu);
}

static void emu_rope_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			     const float *inp, const float *cos, const float *sin, int B, int T,
			     int NH, int HS)
{
	float *tmp;
	size_t n = (size_t)B * T * NH * HS;
	float *o = output(out, n, &tmp);
	rope_forward(o, inp, cos, sin, B, T, NH, HS);
	finish(out16, o, n, tmp);
}

/* the adapters' shares on the GEMM's operands: each du rounded, each A's
 * bf16 copy (a twin checked against its master) */
static void emu_lora_dx_add(struct gpu_backend *be, float *dinp, const struct gpu_lora_dx *ad,
			    int G, int rows)
{
	float *du[GPU_LORA_DX_GROUP] = {NULL}, *A[GPU_LORA_DX_GROUP] = {NULL};
	const size_t R = (size_t)ad[0].R, cols = (size_t)ad[0].cols;
	for (int g = 0; g < G; g++) {
		du[g] = operand("lora_dx_add du", ad[g].du, NULL, (size_t)rows * R);
		A[g] = operand("lora_dx_add A", ad[g].A, ad[g].A16, R * cols);
	}
	lora_dx_add(dinp, (const float *const *)du, (const float *const *)A, G, rows, (int)R,
		    (int)cols);
	for (int g = 0; g < G; g++) {
		free(du[g]);
		free(A[g]);
	}
}

static void emu_swiglu_backward(struct gpu_backend *be, float *dgate, float *dup,
				gpu_bf16 *dgate16, gpu_bf16 *dup16, const float *dout,
				const gpu_bf16 *dout16, const float *gate, const float *up,
				const gpu_bf16 *gate16, const gpu_bf16 *up16, size_t n,
				const struct gpu_lora_dx *ad)
{
	float *tg, *tu, *td, *t1, *t2;
	const float *g = input(gate, gate16, n, &tg), *u = input(up, up16, n, &tu);
	const float *d = input(dout, dout16, n, &td);
	float *dg = output(dgate, n, &t1), *du = output(dup, n, &t2);
	if (ad) { /* dout + the adapter's share, as lora_dx_add forms it */
		float *dd = xmalloc(n * sizeof(float));
		memcpy(dd, d, n * sizeof(float));
		emu_lora_dx_add(be, dd, ad, 1, (int)(n / (size_t)ad->cols));
		free(td);
		d = td = dd;
	}
	swiglu_backward(dg, du, d, g, u, n);
	free(td);
	finish(dgate16, dg, n, t1);
	finish(dup16, du, n, t2);
	free(tg);
	free(tu);
}

/* bf16 logits are read widened (the CUDA kernels' fp32 math on them). */
static void emu_crossentropy_forward(struct gpu_backend *be, float *losses, const float *logits,
				     const gpu_bf16 *logits16, const int32_t *targets, int N, int V)
{
	float *tl;
	const float *x = input(logits, logits16, (size_t)N * V, &tl);
	crossentropy_forward(losses, x, targets, N, V);
	free(tl);
}

static void emu_crossentropy_backward(struct gpu_backend *be, float *losses, float *dlogits,
				      gpu_bf16 *dlogits16, const float *logits,
				      const gpu_bf16 *logits16, const int32_t *targets, float dloss,
				      int N, int V)
{
	/* the logits are all read (widened) before any gradient is written,
	 * so either may be in place */
	float *tl;
	const float *x = input(logits, logits16, (size_t)N * V, &tl);
	if (losses)
		crossentropy_forward(losses, x, targets, N, V);
	float *tmp;
	float *d = output(dlogits, (size_t)N * V, &tmp);
	crossentropy_backward(d, x, targets, dloss, N, V);
	finish(dlogits16, d, (size_t)N * V, tmp);
	free(tl);
}

static void emu_adamw_update(struct gpu_backend *be, float *param, gpu_bf16 *param16,
			     const float *grad, float gscale, float *m, float *v, size_t n, float lr,
			     float beta1, float beta2, float eps, float weight_decay, int t)
{
	adamw_update(param, grad, gscale, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
	if (param16)
		bf16_round(param16, param, n);
}

static void emu_nf4_dequantize(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const uint8_t *codes, const float *absmax, size_t n)
{
	float *tmp;
	float *o = output(out, n, &tmp);
	nf4_dequantize(o, codes, absmax, n);
	finish(out16, o, n, tmp);
}

/* matmul_backward_ld16: the rows gathered into a dense twin, then this
 * table's matmul_backward (the CUDA backend's GEMM reads them in place:
 * the same values). */
static void emu_matmul_backward_ld16(struct gpu_backend *be, float *dinp, float *dweight,
				     const gpu_bf16 *dout16, size_t ldo, const float *inp,
				     const gpu_bf16 *inp16, const float *weight,
				     const gpu_bf16 *weight16, int N, int C, int OC, unsigned set,
				     float alpha_in)
{
	if (alpha_in != 1.0f && !(set & GPU_SET_DINP))
		violation("%s: an alpha on a dinp (%zu x %zu) added to, not set", "matmul_backward_ld16",
			  (size_t)N, (size_t)C);
	if (ldo < (size_t)OC)
		violation("%s: rows of %zu values, fewer than %zu", "matmul_backward_ld16", ldo,
			  (size_t)OC);
	gpu_bf16 *d = xmalloc((size_t)N * OC * sizeof(gpu_bf16));
	for (int r = 0; r < N; r++)
		memcpy(d + (size_t)r * OC, dout16 + (size_t)r * ldo, (size_t)OC * sizeof(gpu_bf16));
	be->ops->matmul_backward(be, dinp, NULL, dweight, NULL, NULL, d, inp, inp16, weight, weight16,
				 N, C, OC, set);
	free(d);
	if (alpha_in != 1.0f && dinp)
		be->ops->scale(be, dinp, alpha_in, (size_t)N * C);
}

/* bias_backward_ld16: the columns widened into fp32 rows, then this
 * CPU's bias gradient (its order: a sum of the same values within a
 * reduction's bound of the CUDA kernel's). */
static void emu_bias_backward_ld16(struct gpu_backend *be, float *dbias, const gpu_bf16 *dout16,
				   size_t ldo, int N, int OC)
{
	if (ldo < (size_t)OC)
		violation("%s: rows of %zu values, fewer than %zu", "bias_backward_ld16", ldo,
			  (size_t)OC);
	float *d = xmalloc((size_t)N * OC * sizeof(float));
	for (int r = 0; r < N; r++)
		bf16_widen(d + (size_t)r * OC, dout16 + (size_t)r * ldo, (size_t)OC);
	matmul_backward(NULL, NULL, dbias, d, d, d, N, 0, OC);
	free(d);
}

/* matmul_forward_scaled: this table's matmul_forward, then scale. */
static void emu_matmul_forward_scaled(struct gpu_backend *be, float *out, const float *inp,
				      const gpu_bf16 *inp16, const float *weight,
				      const gpu_bf16 *weight16, int N, int C, int OC, float alpha)
{
	be->ops->matmul_forward(be, out, NULL, inp, inp16, weight, weight16, NULL, N, C, OC);
	be->ops->scale(be, out, alpha, (size_t)N * OC);
}

/* attention_backward_rope16 as the CUDA backend gives it where it fuses
 * (kv groups): the five ops in turn, so that the model's path through it
 * runs here too (d16 may hold dout's bytes: the backward has read them
 * all before the rows are written; dq, dk, dv NULL: not written; ds
 * overwritten). */
static bool emu_flash_backward_rope16(struct gpu_backend *be, float *dq, float *dk, float *dv,
				      float *datt, const float *dout, const float *out,
				      const gpu_bf16 *out16, const gpu_bf16 *q16,
				      const gpu_bf16 *k16, const gpu_bf16 *v16, const float *att,
				      const float *cos, const float *sin, gpu_bf16 *d16, size_t ld16,
				      void *ds, size_t ds_bytes, int B, int T, int NH, int NKV, int HS)
{
	if (!emu_flash(be, HS) || NH == NKV || !q16 || !k16 || !v16 || !dq != !dk || !dq != !dv)
		return false;
	/* the room lent as scratch: scribbled over (NaN), as the CUDA
	 * kernels leave it holding dS, so that a room that is not free shows */
	if (ds)
		memset(ds, 0xff, ds_bytes);
	const size_t N = (size_t)B * T, H = (size_t)NH * HS, KV = (size_t)NKV * HS;
	if (ld16 < H + 2 * KV)
		return false;
	float *q = dq ? dq : xmalloc(N * H * sizeof(float));
	float *k = dk ? dk : xmalloc(N * KV * sizeof(float));
	float *v = dv ? dv : xmalloc(N * KV * sizeof(float));
	emu_flash_backward(be, q, k, v, datt, dout, out, out16, NULL, q16, NULL, k16, NULL, v16, att,
			   B, T, NH, NKV, HS);
	rope_backward(q, q, cos, sin, B, T, NH, HS);
	rope_backward(k, k, cos, sin, B, T, NKV, HS);
	be->ops->bf16_round_rows(be, d16, ld16, q, N, H);
	be->ops->bf16_round_rows(be, d16 + H, ld16, k, N, KV);
	be->ops->bf16_round_rows(be, d16 + H + KV, ld16, v, N, KV);
	if (!dq) {
		free(q);
		free(k);
		free(v);
	}
	return true;
}

static td_err emu_new(struct gpu_backend **out, bool flash, struct td_errbuf *eb)
{
	static struct gpu_backend_ops tables[2];
	struct gpu_backend_ops *t = &tables[flash];
	struct gpu_backend_ops ops;
	struct gpu_backend *be = NULL;
	td_err e = gpu_cpu_backend_new(&be, eb);
	if (e != TD_OK)
		return e;
	ops = *be->ops;
	ops.name = flash ? "emu16-flash" : "emu16";
	ops.set_bf16 = emu_set_bf16;
	ops.gemm_bf16 = emu_true;
	ops.attention_flash = emu_no_flash;
	ops.embedding_forward = emu_embedding_forward;
	ops.rmsnorm_forward = emu_rmsnorm_forward;
	ops.matmul_forward = emu_matmul_forward;
	/* matmul_forward_residual: the CPU backend's (res copied, then this
	 * table's matmul_forward_add) */
	ops.matmul_forward_add = emu_matmul_forward_add;
	ops.matmul_backward = emu_matmul_backward;
	ops.attention_forward = emu_attention_forward;
	ops.swiglu_forward = emu_swiglu_forward;
	ops.rope_forward = emu_rope_forward;
	ops.swiglu_backward = emu_swiglu_backward;
	ops.lora_dx_add = emu_lora_dx_add;
	ops.crossentropy_forward = emu_crossentropy_forward;
	ops.crossentropy_backward = emu_crossentropy_backward;
	ops.adamw_update = emu_adamw_update;
	ops.nf4_dequantize = emu_nf4_dequantize;
	if (flash) {
		ops.attention_flash = emu_flash;
		ops.attention_forward = emu_flash_forward;
		ops.attention_backward = emu_flash_backward;
		ops.attention_backward_rope16 = emu_flash_backward_rope16;
		ops.matmul_backward_ld16 = emu_matmul_backward_ld16;
		ops.bias_backward_ld16 = emu_bias_backward_ld16;
		ops.matmul_forward_scaled = emu_matmul_forward_scaled;
	}
	gpu_backend_check_ops(&ops);
	*t = ops;
	be->ops = t;
	snprintf(be->device, sizeof(be->device), "%s", ops.name);
	*out = be;
	return TD_OK;
}

td_err emu16_backend_new(struct gpu_backend **out, struct td_errbuf *eb)
{
	return emu_new(out, false, eb);
}

td_err emu16_flash_backend_new(struct gpu_backend **out, struct td_errbuf *eb)
{
	return emu_new(out, true, eb);
}
