/* The sanity check of bench_attn (attn_check.h): reference values in
 * double from the same bf16 operands, and per element a bound on what the
 * kernels' roundings can move their result by, derived below from
 * kernels/cuda/flash.cu's arithmetic. Not a test of the kernels' every
 * element (tests/gpu/test_cuda_ops.c holds whole tensors at small shapes):
 * a check that the timed kernels compute attention at the timed shape. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench/attn_check.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

float attn_widen(uint16_t b)
{
	uint32_t x = (uint32_t)b << 16;
	float f;
	memcpy(&f, &x, sizeof(f));
	return f;
}

static size_t qi(const struct attn_shape *s, int b, int t, int h)
{
	return (((size_t)b * s->T + t) * s->NH + h) * s->HS;
}
static size_t ki(const struct attn_shape *s, int b, int t, int g)
{
	return (((size_t)b * s->T + t) * s->NKV + g) * s->HS;
}
static size_t li(const struct attn_shape *s, int b, int h, int t)
{
	return ((size_t)b * s->NH + h) * s->T + t;
}

/* The problem and the host's D = rowsum(dout * out16 widened) and S =
 * rowsum |dout * out16| per (b,h,t), in double. */
struct ctx {
	const struct attn_host *h;
	double *D, *S;
};

/* Rounding units. u: one fp32 rounding to nearest (CUDA cores, IEEE). U: per
 * term of a sum on the tensor cores, whose fp32 accumulation of mma.sync is
 * not IEEE round-to-nearest (it truncates the aligned addends: Fasi, Higham,
 * Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores", 2021),
 * so a sum of n terms is held to n U sum |terms| with U = 2u. R16: one
 * rounding to bf16 to nearest (8 significant bits: half a unit in the
 * last place is 2^-8 of the value at most). EXP: exp2f's and log2f's error,
 * 2 ulp (CUDA C Programming Guide, single-precision functions). Every bound
 * below is first order in these; the second-order terms (products of two of
 * them, each < 2^-8) are covered by the factor SECOND = 1.01. */
static const double u = 0x1p-24, U = 0x1p-23, R16 = 0x1p-8, EXP = 0x1p-22, SECOND = 1.01;
static const double FLUSH = 0x1p-126; /* the kernels' powers flushed to 0 below it */

static void check_elem(struct attn_check *c, double got, double ref, double bound, const char *what,
		       int b, int h, int t, int col)
{
	const double err = fabs(got - ref);
	const double r = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
	c->n++;
	if (!(r <= 1.0)) { /* NaN counts as bad */
		if (c->bad < 5)
			fprintf(stderr,
				"attn_check: %s (b=%d h=%d t=%d c=%d): %.9g, reference %.9g, "
				"|diff| %.3g > bound %.3g\n",
				what, b, h, t, col, got, ref, err, bound);
		c->bad++;
	}
	if (!(r <= c->worst)) {
		c->worst = r;
		snprintf(c->what, sizeof(c->what), "%s (b=%d h=%d t=%d c=%d)", what, b, h, t, col);
	}
}

static size_t nonfinite_f(const float *x, size_t n)
{
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		k += !isfinite(x[i]);
	return k;
}
static size_t nonfinite_h(const uint16_t *x, size_t n)
{
	size_t k = 0;
	for (size_t i = 0; i < n; i++)
		k += (x[i] & 0x7f80u) == 0x7f80u;
	return k;
}

/* Sampled rows: both ends of the batch, of the heads, and positions at the
 * tiles' edges (the kernels' tiles are 64 rows), the middle and the end. */
static int sample_t(int T, int *out)
{
	const int cand[] = {0, 1, 63, 64, 65, T / 2 + 17, T - 2, T - 1};
	int n = 0;
	for (size_t i = 0; i < COUNT(cand); i++) {
		bool dup = cand[i] < 0 || cand[i] >= T;
		for (int j = 0; j < n && !dup; j++)
			dup = out[j] == cand[i];
		if (!dup)
			out[n++] = cand[i];
	}
	return n;
}
static int sample_of(int a, int b2, int c, int *out)
{
	const int cand[] = {a, b2, c};
	int n = 0;
	for (int i = 0; i < 3; i++) {
		bool dup = false;
		for (int j = 0; j < n; j++)
			dup |= out[j] == cand[i];
		if (!dup)
			out[n++] = cand[i];
	}
	return n;
}

/* Query row t of head h, batch b: the scaled scores x_s = sl2 q_t . k_s
 * (log2 units, sl2 = log2(e)/sqrt(HS)) for s <= t, their error bound dx_s
 * on the device (the score an fp32 tensor-core sum of HS exact products:
 * HS U sum |q k|, times sl2; then the product by sl2, whose own fp32 value
 * is within 4u (rsqrtf 2 ulp, one product) and one rounding: 5u |x|), and
 * the exact L = log2 sum_s 2^x_s. */
static double scores(const struct ctx *p, int b, int h, int t, double *x, double *dx)
{
	const struct attn_shape *s = &p->h->s;
	const int g = h / (s->NH / s->NKV);
	const double sl2 = M_LOG2E / sqrt((double)s->HS);
	const uint16_t *qt = p->h->q + qi(s, b, t, h);
	double m = -INFINITY;
	for (int j = 0; j <= t; j++) {
		const uint16_t *kj = p->h->k + ki(s, b, j, g);
		double d = 0, a = 0;
		for (int c = 0; c < s->HS; c++) {
			const double pr = (double)attn_widen(qt[c]) * attn_widen(kj[c]);
			d += pr;
			a += fabs(pr);
		}
		x[j] = sl2 * d;
		dx[j] = sl2 * s->HS * U * a + 5 * u * fabs(x[j]);
		m = fmax(m, x[j]);
	}
	double l = 0;
	for (int j = 0; j <= t; j++)
		l += exp2(x[j] - m);
	return m + log2(l);
}

/* Forward, on the sampled query rows.
 * The kernel: p_s = 2^fl(s~_s sl2 - m) (one FFMA, then ex2.approx.ftz:
 * exp2f's instruction, EXP, and 0 where the power is under 2^-126) for the
 * running max m = fl(sl2 max s~) (= max fl(sl2 s~): rounding is monotonic),
 * rescaled by exp2f(m_old - m_new) at each of the row's ceil((t+1)/64) key
 * tiles; out = (sum_s bf16(p_s) v_s) / l, l = sum_s p_s, in fp32; then
 * rounded to bf16 (out16). Relative error of each p (alpha): ln2 (2 max dx
 * + u max|x - m|) (its exponent's error: its score's and the max's, and the
 * FFMA's rounding; the score's product by sl2 is not rounded on its own
 * there, one rounding fewer than dx counts) + EXP (the power) + tiles (EXP
 * + 2u) (a rescale's exp2f and the products by it, on numerator and
 * denominator alike). Numerator: each term's p within alpha + R16 (rounded
 * to bf16 for the product), the sum of t+1 terms within (t+1) U; l: within
 * alpha + (t+1) u; the division and the product by 1/l: 2u. With A_c =
 * sum_s P_s |v_sc| >= |ref_c|:
 *   |out_c - ref_c| <= (2 alpha + R16 + 2 (t+1) U + 4u) A_c,
 * and out16 adds R16 |out_c|. A power under 2^-126 flushed to 0 is off by
 * less than FLUSH = 2^-126 outright (p <= 1 against the running max, and
 * a later rescale only shrinks it; l >= 1): the numerator by at most (t+1)
 * FLUSH max_s |v_sc|, l by (t+1) FLUSH relatively. bound = SECOND ((2 alpha
 * + R16 + 2(t+1)U + 4u) A_c + R16 |ref_c| + (t+1) FLUSH (max_s |v_sc| +
 * |ref_c|)). L~ = m + log2f(l): within max dx (m's score) + (alpha + (t+1)
 * (u + FLUSH)) / ln2 (l's relative error) + 2u (|L| + log2(t+1) + 1)
 * (log2f's 2 ulp of a value <= log2(t+1), and the sum's rounding).
 * A wrong mask, scale, tile or head gives errors of the order of A_c. */
static bool check_forward(const struct ctx *p, struct attn_check *c)
{
	const struct attn_shape *s = &p->h->s;
	const int rep = s->NH / s->NKV;
	int ts[8], hs[3], bs[3];
	const int nt = sample_t(s->T, ts), nh = sample_of(0, rep - 1, s->NH - 1, hs),
		  nb = sample_of(0, s->B - 1, s->B - 1, bs);
	bool ok = true;
	double *x = malloc((size_t)s->T * sizeof(double)), *dx = malloc((size_t)s->T * sizeof(double));
	double *ref = malloc((size_t)s->HS * sizeof(double)), *A = malloc((size_t)s->HS * sizeof(double));
	double *vm = malloc((size_t)s->HS * sizeof(double));
	if (!x || !dx || !ref || !A || !vm) {
		ok = false;
		goto out;
	}
	for (int ib = 0; ib < nb; ib++)
		for (int ih = 0; ih < nh; ih++)
			for (int it = 0; it < nt; it++) {
				const int b = bs[ib], h = hs[ih], t = ts[it], g = h / rep;
				const double L = scores(p, b, h, t, x, dx);
				double dxm = 0, xr = 0, m = -INFINITY;
				for (int j = 0; j <= t; j++)
					m = fmax(m, x[j]);
				for (int j = 0; j <= t; j++) {
					dxm = fmax(dxm, dx[j]);
					xr = fmax(xr, fabs(x[j] - m));
				}
				const double tiles = t / 64 + 1;
				const double alpha = M_LN2 * (2 * dxm + u * xr) + EXP + tiles * (EXP + 2 * u);
				for (int cc = 0; cc < s->HS; cc++)
					ref[cc] = A[cc] = vm[cc] = 0;
				for (int j = 0; j <= t; j++) {
					const double P = exp2(x[j] - L);
					const uint16_t *vj = p->h->v + ki(s, b, j, g);
					for (int cc = 0; cc < s->HS; cc++) {
						ref[cc] += P * attn_widen(vj[cc]);
						A[cc] += P * fabs(attn_widen(vj[cc]));
						vm[cc] = fmax(vm[cc], fabs(attn_widen(vj[cc])));
					}
				}
				const uint16_t *o = p->h->o + qi(s, b, t, h);
				const double k1 = 2 * alpha + R16 + 2 * (t + 1) * U + 4 * u;
				const double fl = (t + 1) * FLUSH;
				for (int cc = 0; cc < s->HS; cc++)
					check_elem(c, attn_widen(o[cc]), ref[cc],
						   SECOND * (k1 * A[cc] + R16 * fabs(ref[cc]) +
							     fl * (vm[cc] + fabs(ref[cc]))),
						   "out16", b, h, t, cc);
				const double bl = SECOND * (dxm + (alpha + (t + 1) * u + fl) / M_LN2 +
							    2 * u * (fabs(L) + log2(t + 1.0) + 1));
				check_elem(c, p->h->lse[li(s, b, h, t)], L, bl, "L", b, h, t, -1);
			}
out:
	free(x), free(dx), free(ref), free(A), free(vm);
	return ok;
}

/* Backward. D: flash_rowdot's fp32 sum of HS fp32 products dout * out16
 * (a lane's share, then a 5-level shuffle tree: at most HS + 1 roundings in
 * a row) against the host's double sum of the same terms: within
 * (HS + 1) u S, S = sum |dout * out16|; on every row.
 * The kernels (flash_bwd_dq, flash_bwd_dkdv) rebuild P~_ts = 2^fl(s~_ts sl2
 * - L~_t) from the forward's L~ (one FFMA, then ex2.approx.ftz as in the
 * forward: EXP, and 0 where the power is under 2^-126); dP~_ts = bf16(dout_t) . v_s (a tensor-core
 * sum of HS terms); dS~ = P~ (dP~ - D~), rounded to bf16 for the products;
 * dq_t = scale sum_s dS~_ts k_s, dk_s = scale sum_t,h dS~_ts q_t, dv_s =
 * sum_t,h bf16(P~_ts) bf16(dout_t) (sums of at most T terms on the tensor
 * cores, and for GQA the rep per-head partials added in fp32). Per term:
 *   beta_ts (P's relative error) = ln2 (dx_ts + |L~_t - L_t| + u |x - L|) + EXP,
 *     (the FFMA's one rounding; the product by sl2 is not rounded on its
 *     own, one rounding fewer than dx counts), |L~ - L| measured (dq: the
 *     reference takes the exact L; dk, dv: it takes L~ itself, the
 *     forward's L being checked on the sampled rows);
 *   a power under 2^-126 flushed to 0 is off by less than FLUSH outright,
 *     and dS = P (dP~ - D~) then by FLUSH |dP~ - D~| <= FLUSH (|dP - D| +
 *     M_ts + S_t) (the errors of dP~ and D~ are under M and S), plus FLUSH
 *     for dS's own product where it falls under 2^-126; bf16(P) dout by
 *     FLUSH |dout|;
 *   |dP~ - dP| <= (R16 + HS U) M_ts, M_ts = sum |dout_t v_s| (dout's bf16
 *     copy and the sum); |D~ - D| <= (HS + 1) u S_t (above);
 *   |dS~16 - dS| <= |dS| (beta + R16 + 2u) + P (|dP~ - dP| + |D~ - D|).
 * dq_c (and dk_c with q for k) within SECOND scale sum_s |k_sc|
 *   (|dS_ts| (beta + R16 + n U + 7u) + P_ts ((R16 + HS U) M_ts + (HS+1) u S_t)
 *    + FLUSH (|dP_ts - D_t| + M_ts + S_t + 1)),
 *   n the number of terms summed (t + 1 for dq; T - s + rep for dk), 7u
 *   dS's subtraction and product (2u), the scale's rsqrtf (2 ulp: 4u) and
 *   the product by it (u); dv_c within
 *   SECOND sum |dout_tc| (P_ts (beta + 2 R16 + n U) + FLUSH) (P and dout
 *   rounded). */
static bool check_backward(const struct ctx *p, struct attn_check *c)
{
	const struct attn_shape *s = &p->h->s;
	const int rep = s->NH / s->NKV, HS = s->HS;
	const double scale = 1.0 / sqrt((double)HS);
	for (int b = 0; b < s->B; b++)
		for (int h = 0; h < s->NH; h++)
			for (int t = 0; t < s->T; t++) {
				const size_t r = li(s, b, h, t);
				check_elem(c, p->h->dr[r], p->D[r], SECOND * (HS + 1) * u * p->S[r], "D", b,
					   h, t, -1);
			}
	int ts[8], hs[3], bs[3], gs[3];
	const int nt = sample_t(s->T, ts), nh = sample_of(0, rep - 1, s->NH - 1, hs),
		  nb = sample_of(0, s->B - 1, s->B - 1, bs), ng = sample_of(0, s->NKV - 1, s->NKV - 1, gs);
	bool ok = true;
	double *x = malloc((size_t)s->T * sizeof(double)), *dx = malloc((size_t)s->T * sizeof(double));
	double *r1 = malloc((size_t)HS * sizeof(double)), *w1 = malloc((size_t)HS * sizeof(double));
	double *r2 = malloc((size_t)HS * sizeof(double)), *w2 = malloc((size_t)HS * sizeof(double));
	if (!x || !dx || !r1 || !w1 || !r2 || !w2) {
		ok = false;
		goto out;
	}
	/* dq on the sampled query rows */
	for (int ib = 0; ib < nb; ib++)
		for (int ih = 0; ih < nh; ih++)
			for (int it = 0; it < nt; it++) {
				const int b = bs[ib], h = hs[ih], t = ts[it], g = h / rep;
				const double L = scores(p, b, h, t, x, dx);
				const size_t r = li(s, b, h, t);
				const double Lg = p->h->lse[r], dL = fabs(Lg - L);
				const float *dot = p->h->dout + qi(s, b, t, h);
				for (int cc = 0; cc < HS; cc++)
					r1[cc] = w1[cc] = 0;
				for (int j = 0; j <= t; j++) {
					const uint16_t *vj = p->h->v + ki(s, b, j, g), *kj = p->h->k + ki(s, b, j, g);
					double dP = 0, M = 0;
					for (int cc = 0; cc < HS; cc++) {
						const double pr = (double)dot[cc] * attn_widen(vj[cc]);
						dP += pr;
						M += fabs(pr);
					}
					const double P = exp2(x[j] - L), dS = P * (dP - p->D[r]);
					const double beta =
						M_LN2 * (dx[j] + dL + u * fabs(x[j] - Lg)) + EXP;
					const double w = fabs(dS) * (beta + R16 + (t + 1) * U + 7 * u) +
							 P * ((R16 + HS * U) * M + (HS + 1) * u * p->S[r]) +
							 FLUSH * (fabs(dP - p->D[r]) + M + p->S[r] + 1);
					for (int cc = 0; cc < HS; cc++) {
						r1[cc] += dS * attn_widen(kj[cc]);
						w1[cc] += fabs(attn_widen(kj[cc])) * w;
					}
				}
				const float *dq = p->h->dq + qi(s, b, t, h);
				for (int cc = 0; cc < HS; cc++)
					check_elem(c, dq[cc], scale * r1[cc], SECOND * scale * w1[cc], "dq", b,
						   h, t, cc);
			}
	/* dk, dv on the sampled key rows: every query at or past them, every
	 * query head of the group, with the forward's L~ */
	const int ss[] = {0, 63, 64, s->T / 2 + 5, s->T - 1};
	for (int ib = 0; ib < nb; ib++)
		for (int ig = 0; ig < ng; ig++)
			for (size_t is = 0; is < COUNT(ss); is++) {
				const int b = bs[ib], g = gs[ig], j = ss[is];
				if (j < 0 || j >= s->T || (is > 0 && j == ss[is - 1]))
					continue;
				const uint16_t *kj = p->h->k + ki(s, b, j, g), *vj = p->h->v + ki(s, b, j, g);
				const double sl2 = M_LOG2E / sqrt((double)HS);
				const double n = s->T - j + rep;
				for (int cc = 0; cc < HS; cc++)
					r1[cc] = w1[cc] = r2[cc] = w2[cc] = 0;
				for (int h = g * rep; h < (g + 1) * rep; h++)
					for (int t = j; t < s->T; t++) {
						const size_t r = li(s, b, h, t);
						const uint16_t *qt = p->h->q + qi(s, b, t, h);
						const float *dot = p->h->dout + qi(s, b, t, h);
						double sc = 0, a = 0, dP = 0, M = 0;
						for (int cc = 0; cc < HS; cc++) {
							const double pq = (double)attn_widen(qt[cc]) * attn_widen(kj[cc]);
							const double pd = (double)dot[cc] * attn_widen(vj[cc]);
							sc += pq, a += fabs(pq);
							dP += pd, M += fabs(pd);
						}
						const double xs = sl2 * sc, Lg = p->h->lse[r];
						const double dxs = sl2 * HS * U * a + 5 * u * fabs(xs);
						const double P = exp2(xs - Lg), dS = P * (dP - p->D[r]);
						const double beta = M_LN2 * (dxs + u * fabs(xs - Lg)) + EXP;
						const double w = fabs(dS) * (beta + R16 + n * U + 7 * u) +
								 P * ((R16 + HS * U) * M + (HS + 1) * u * p->S[r]) +
								 FLUSH * (fabs(dP - p->D[r]) + M + p->S[r] + 1);
						const double wv = P * (beta + 2 * R16 + n * U) + FLUSH;
						for (int cc = 0; cc < HS; cc++) {
							const double qc = attn_widen(qt[cc]);
							r1[cc] += dS * qc;
							w1[cc] += fabs(qc) * w;
							r2[cc] += P * dot[cc];
							w2[cc] += fabs((double)dot[cc]) * wv;
						}
					}
				const float *dk = p->h->dk + ki(s, b, j, g), *dv = p->h->dv + ki(s, b, j, g);
				for (int cc = 0; cc < HS; cc++) {
					check_elem(c, dk[cc], scale * r1[cc], SECOND * scale * w1[cc], "dk", b,
						   g, j, cc);
					check_elem(c, dv[cc], r2[cc], SECOND * w2[cc], "dv", b, g, j, cc);
				}
			}
out:
	free(x), free(dx), free(r1), free(w1), free(r2), free(w2);
	return ok;
}


bool attn_check(const struct attn_host *h, struct attn_check *fwd, struct attn_check *bwd)
{
	const struct attn_shape *s = &h->s;
	const size_t nq = (size_t)s->B * s->T * s->NH * s->HS;
	const size_t nk = (size_t)s->B * s->T * s->NKV * s->HS, nl = (size_t)s->B * s->NH * s->T;
	memset(fwd, 0, sizeof(*fwd));
	memset(bwd, 0, sizeof(*bwd));
	struct ctx c = {.h = h, .D = malloc(nl * sizeof(double)), .S = malloc(nl * sizeof(double))};
	if (!c.D || !c.S) {
		free(c.D), free(c.S);
		return false;
	}
	const size_t bad_f = nonfinite_h(h->o, nq) + nonfinite_f(h->lse, nl);
	const size_t bad_b = nonfinite_f(h->dr, nl) + nonfinite_f(h->dq, nq) +
			     nonfinite_f(h->dk, nk) + nonfinite_f(h->dv, nk);
	if (bad_f)
		fprintf(stderr, "attn_check: %zu values of out16 and L not finite\n", bad_f);
	if (bad_b)
		fprintf(stderr, "attn_check: %zu values of D, dq, dk, dv not finite\n", bad_b);
	fwd->bad += bad_f;
	bwd->bad += bad_b;
	for (int b = 0; b < s->B; b++)
		for (int t = 0; t < s->T; t++)
			for (int hh = 0; hh < s->NH; hh++) {
				const size_t at = qi(s, b, t, hh), r = li(s, b, hh, t);
				double d = 0, a = 0;
				for (int i = 0; i < s->HS; i++) {
					const double pr = (double)h->dout[at + i] * attn_widen(h->o[at + i]);
					d += pr;
					a += fabs(pr);
				}
				c.D[r] = d;
				c.S[r] = a;
			}
	bool ok = check_forward(&c, fwd) && check_backward(&c, bwd);
	free(c.D), free(c.S);
	return ok;
}
