/* Unit tests for the method ops of kernels/cpu/ops.c (NF4, double
 * quantization, distillation loss, dropout) against references written here:
 *   NF4        every value against the nearest code of the code book found by
 *              brute force in double, so the round-trip error is the code
 *              book's; code points round-trip exactly; the nibble order
 *   absmax DQ  each value within half a quantization step of the original
 *   distill    KL and CE against a double reference; the gradient against
 *              central differences of that reference
 *   dropout    deterministic in (seed, i), the kept fraction, the scale, the
 *              backward being the same mask
 * Inputs come from a fixed-seed PRNG. */
#include "kernels/cpu/ops.h"
#include "tests/check.h"

#include <stdbool.h>
#include <stdint.h>

static uint64_t rng_state = 0x6e66345f746573ULL;

static uint64_t rng_next(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ULL);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static double urand(void)
{
	return (double)(rng_next() >> 11) * 0x1.0p-52 - 1.0;
}

/* ----------------------------------------------------------------- NF4 -- */

/* The nearest code to v by brute force in double; *second is the distance
 * margin to the runner-up (a tie within rounding may go either way). */
static int nearest_code(double v, double *margin)
{
	int best = 0;
	double bd = INFINITY, second = INFINITY;
	for (int k = 0; k < 16; k++) {
		double d = fabs(v - (double)nf4_code[k]);
		if (d < bd) {
			second = bd;
			bd = d;
			best = k;
		} else if (d < second) {
			second = d;
		}
	}
	*margin = second - bd;
	return best;
}

static void test_nf4_codebook(void)
{
	/* The code book's own shape (QLoRA paper, Appendix E): 16 ascending
	 * values from -1 to 1 with an exact 0, 7 below it and 8 above. */
	CHECK_NEAR(nf4_code[0], -1.0, 0);
	CHECK_NEAR(nf4_code[7], 0.0, 0);
	CHECK_NEAR(nf4_code[15], 1.0, 0);
	for (int k = 1; k < 16; k++)
		CHECK_MSG(nf4_code[k] > nf4_code[k - 1], "nf4_code[%d] = %g <= nf4_code[%d] = %g", k,
			  (double)nf4_code[k], k - 1, (double)nf4_code[k - 1]);
}

static void test_nf4_roundtrip(void)
{
	static const size_t sizes[] = {1, 2, 63, 64, 65, 127, 128, 1000, 4096 + 3};
	for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
		size_t n = sizes[c], nb = (n + NF4_BLOCK - 1) / NF4_BLOCK;
		float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
		float *am = malloc(nb * sizeof(float));
		uint8_t *codes = malloc((n + 1) / 2);
		for (size_t i = 0; i < n; i++)
			x[i] = (float)(0.05 * urand());
		/* An all-zero block, and a block with one large outlier. */
		if (n >= 128)
			memset(x + 64, 0, 64 * sizeof(float));
		if (n > 200)
			x[130] = 3.0f;
		nf4_quantize(codes, am, x, n);
		nf4_dequantize(y, codes, am, n);
		int bad = 0;
		double worst = 0;
		for (size_t i = 0; i < n; i++) {
			size_t b = i / NF4_BLOCK;
			double amax = 0;
			for (size_t k = b * NF4_BLOCK; k < n && k < (b + 1) * NF4_BLOCK; k++)
				amax = fmax(amax, fabs((double)x[k]));
			if (am[b] != (float)amax) {
				bad++;
				continue;
			}
			double v = amax > 0 ? x[i] / amax : 0, margin;
			int k = nearest_code(v, &margin);
			float want = nf4_code[k] * am[b];
			/* a tie within rounding: x / absmax is one float32 division
			 * off by u, so a value within 2u of a midpoint may go
			 * either way */
			bool ok = y[i] == want || margin < 2 * F32_U;
			if (!ok && bad++ < 3)
				fprintf(stderr, "n=%zu: x[%zu] = %.9g -> %.9g, nearest code gives %.9g\n", n, i,
					(double)x[i], (double)y[i], (double)want);
			worst = fmax(worst, fabs((double)y[i] - x[i]) / (amax > 0 ? amax : 1));
		}
		CHECK_MSG(bad == 0, "n=%zu: %d values are not their nearest NF4 code", n, bad);
		/* The largest gap of the code book is between 0.7230 and 1: no value is
		 * further than half of it (relative to its block's absmax). */
		double half_gap = 0;
		for (int k = 1; k < 16; k++)
			half_gap = fmax(half_gap, (nf4_code[k] - nf4_code[k - 1]) / 2.0);
		/* plus the float32 roundings of x / absmax and of the code times
		 * absmax (2u of a value <= 1 after the division) */
		CHECK_MSG(worst <= half_gap + 2 * F32_U, "n=%zu: relative error %g > half the largest gap %g", n,
			  worst, half_gap);
		free(x);
		free(y);
		free(am);
		free(codes);
	}

	/* Code points times the absmax come back exactly, in bitsandbytes'
	 * nibble order: element 2i in the high nibble of byte i. */
	float x[NF4_BLOCK], y[NF4_BLOCK], am;
	uint8_t codes[NF4_BLOCK / 2];
	const float s = 0.375f;
	for (int i = 0; i < NF4_BLOCK; i++)
		x[i] = nf4_code[(i * 7) % 16] * s;
	x[0] = -s; /* absmax = s exactly */
	nf4_quantize(codes, &am, x, NF4_BLOCK);
	nf4_dequantize(y, codes, &am, NF4_BLOCK);
	CHECK_NEAR(am, s, 0);
	CHECK_MSG(memcmp(x, y, sizeof(x)) == 0, "code points do not round-trip exactly");
	CHECK_EQ_INT(codes[0] >> 4, 0);   /* x[0] = -1 * s */
	CHECK_EQ_INT(codes[0] & 15, 7);   /* x[1] = code[7] = 0 */
	CHECK_EQ_INT(codes[1] >> 4, 14);  /* x[2] = code[14] */
}

/* nf4_quantize's code for each value is the one a scan of all 16 finds by
 * |x - code| in float32, the lower on a tie (the definition the search it
 * runs instead must keep exactly): checked at every code, every midpoint
 * between neighbours and the floats up to 3 ulps around them, and at random
 * values, in blocks whose absmax is exactly 1 (so x / absmax is x itself). */
static int scan_code(float x)
{
	int best = 0;
	float bd = fabsf(x - nf4_code[0]);
	for (int k = 1; k < 16; k++) {
		float d = fabsf(x - nf4_code[k]);
		if (d < bd) {
			bd = d;
			best = k;
		}
	}
	return best;
}

static void test_nf4_nearest(void)
{
	enum { NV = 16 * 7 + 15 * 7 + 4 * NF4_BLOCK * 63 };
	static float vals[NV];
	size_t n = 0;
	for (int k = 0; k < 16; k++) {
		float c = nf4_code[k];
		for (int u = -3; u <= 3; u++) {
			float v = c;
			for (int s = 0; s < (u < 0 ? -u : u); s++)
				v = nextafterf(v, u < 0 ? -2.0f : 2.0f);
			vals[n++] = v;
		}
	}
	for (int k = 0; k + 1 < 16; k++) {
		float mid = (nf4_code[k] + nf4_code[k + 1]) / 2.0f;
		for (int u = -3; u <= 3; u++) {
			float v = mid;
			for (int s = 0; s < (u < 0 ? -u : u); s++)
				v = nextafterf(v, u < 0 ? -2.0f : 2.0f);
			vals[n++] = v;
		}
	}
	while (n < NV)
		vals[n++] = (float)urand();
	/* Blocks of 63 values and a 1 (absmax exactly 1, inverse exactly 1);
	 * values past +-1 are clamped to the block's range. */
	const size_t nb = (NV + 62) / 63, len = nb * NF4_BLOCK;
	float *x = calloc(len, sizeof(float)), *am = malloc(nb * sizeof(float));
	uint8_t *codes = malloc(len / 2);
	size_t j = 0;
	for (size_t b = 0; b < nb; b++) {
		x[b * NF4_BLOCK] = 1.0f;
		for (int i = 1; i < NF4_BLOCK; i++)
			x[b * NF4_BLOCK + i] = j < NV ? fmaxf(-1.0f, fminf(1.0f, vals[j++])) : 0.0f;
	}
	nf4_quantize(codes, am, x, len);
	int bad = 0;
	for (size_t i = 0; i < len; i++) {
		int got = i % 2 ? codes[i / 2] & 15 : codes[i / 2] >> 4;
		int want = scan_code(x[i]);
		if (got != want && bad++ < 5)
			fprintf(stderr, "x = %.9g (%a): code %d, the scan's %d\n", (double)x[i], (double)x[i],
				got, want);
	}
	CHECK_MSG(bad == 0, "%d of %zu values got another code than the scan's", bad, len);
	free(x);
	free(am);
	free(codes);
}

static void test_absmax_dq(void)
{
	static const size_t sizes[] = {1, 255, 256, 257, 1000};
	for (size_t c = 0; c < sizeof(sizes) / sizeof(sizes[0]); c++) {
		size_t n = sizes[c], ns = (n + NF4_DQ_BLOCK - 1) / NF4_DQ_BLOCK;
		float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
		float *scale = malloc((ns + 1) * sizeof(float));
		int8_t *q = malloc(n);
		for (size_t i = 0; i < n; i++)
			a[i] = (float)(0.02 + 0.01 * urand() + (i % 97 == 0 ? 0.1 : 0));
		absmax_quantize(q, scale, a, n);
		absmax_dequantize(b, q, scale, n);
		double mean = 0;
		for (size_t i = 0; i < n; i++)
			mean += a[i];
		mean /= (double)n;
		/* The offset is the mean summed in double, rounded once to float. */
		CHECK_NEAR(scale[ns], mean, F32_U * mean + (double)n * 0x1p-53 * mean);
		int bad = 0;
		for (size_t s = 0; s < ns; s++) {
			double m = 0;
			for (size_t i = s * NF4_DQ_BLOCK; i < n && i < (s + 1) * NF4_DQ_BLOCK; i++)
				m = fmax(m, fabs(a[i] - mean));
			double step = m / 127;
			for (size_t i = s * NF4_DQ_BLOCK; i < n && i < (s + 1) * NF4_DQ_BLOCK; i++)
				/* half a quantisation step, plus the float32
				 * roundings of (a - offset) / scale, its product
				 * back and the offset's add: 4u of each operand */
				bad += !(fabs((double)b[i] - a[i]) <=
					 step / 2 + 4 * F32_U * (fabs(a[i]) + fabs(mean) + step));
		}
		CHECK_MSG(bad == 0, "n=%zu: %d absmax values are off by more than half a step", n, bad);
		free(a);
		free(b);
		free(scale);
		free(q);
	}
}

/* ------------------------------------------------------------- distill -- */

struct dctx {
	double *s, *t;
	const int32_t *tgt;
	int N, V;
	double T, alpha;
};

static double lse(const double *x, int V, double T)
{
	double m = -INFINITY, sum = 0;
	for (int i = 0; i < V; i++)
		m = fmax(m, x[i] / T);
	for (int i = 0; i < V; i++)
		sum += exp(x[i] / T - m);
	return m + log(sum);
}

static void ref_distill(double *kl, double *ce, const struct dctx *c)
{
	for (int n = 0; n < c->N; n++) {
		const double *s = c->s + (size_t)n * c->V, *t = c->t + (size_t)n * c->V;
		if (c->tgt[n] == -100) {
			kl[n] = ce[n] = 0;
			continue;
		}
		double ls = lse(s, c->V, c->T), lt = lse(t, c->V, c->T), acc = 0;
		for (int i = 0; i < c->V; i++) {
			double p = exp(t[i] / c->T - lt);
			acc += p * ((t[i] / c->T - lt) - (s[i] / c->T - ls));
		}
		kl[n] = acc;
		ce[n] = lse(s, c->V, 1.0) - s[c->tgt[n]];
	}
}

static double distill_loss(const struct dctx *c)
{
	double *kl = malloc((size_t)c->N * sizeof(double)), *ce = malloc((size_t)c->N * sizeof(double));
	ref_distill(kl, ce, c);
	double sum = 0;
	for (int n = 0; n < c->N; n++)
		sum += c->alpha * c->T * c->T * kl[n] + (1 - c->alpha) * ce[n];
	free(kl);
	free(ce);
	return sum;
}

static void test_distill(void)
{
	static const struct {
		int N, V;
		float T, alpha;
	} cases[] = {{3, 5, 2.0f, 0.5f}, {4, 17, 1.0f, 0.0f}, {2, 9, 0.7f, 1.0f}, {5, 33, 3.0f, 0.25f}};
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const int N = cases[c].N, V = cases[c].V;
		size_t nv = (size_t)N * V;
		float *s = malloc(nv * sizeof(float)), *t = malloc(nv * sizeof(float));
		float *kl = malloc(N * sizeof(float)), *ce = malloc(N * sizeof(float));
		float *d = malloc(nv * sizeof(float)), *d2 = malloc(nv * sizeof(float));
		double *sd = malloc(nv * sizeof(double)), *td = malloc(nv * sizeof(double));
		int32_t *tgt = malloc(N * sizeof(int32_t));
		for (size_t i = 0; i < nv; i++) {
			s[i] = (float)(2 * urand());
			t[i] = (float)(3 * urand());
			sd[i] = s[i];
			td[i] = t[i];
		}
		for (int n = 0; n < N; n++)
			tgt[n] = n == 1 ? -100 : (int32_t)(rng_next() % (uint64_t)V);
		struct dctx ctx = {sd, td, tgt, N, V, cases[c].T, cases[c].alpha};
		double *rkl = malloc(N * sizeof(double)), *rce = malloc(N * sizeof(double));
		ref_distill(rkl, rce, &ctx);
		for (int n = 0; n < N; n++)
			kl[n] = ce[n] = NAN; /* overwritten */
		distill_forward(kl, ce, s, t, tgt, cases[c].T, N, V);
		for (int n = 0; n < N; n++) {
			/* Both sides compute in double (V <= 1000 terms of
			 * magnitude <= ~10: <= 1e-12 apart); the op rounds its
			 * result once to float32. */
			CHECK_NEAR(kl[n], rkl[n], F32_U * fabs(rkl[n]) + 1e-10);
			CHECK_NEAR(ce[n], rce[n], F32_U * fabs(rce[n]) + 1e-10);
			CHECK(kl[n] >= 0);
		}
		/* dloss = 0.3: the gradient of 0.3 * sum(loss rows), against central
		 * differences of the double reference. */
		const float dloss = 0.3f;
		for (size_t i = 0; i < nv; i++)
			d[i] = NAN;
		distill_backward(d, s, t, tgt, dloss, cases[c].alpha, cases[c].T, N, V);
		int bad = 0;
		for (size_t i = 0; i < nv; i++) {
			double save = sd[i], h = 1e-5;
			sd[i] = save + h;
			double lp = distill_loss(&ctx);
			sd[i] = save - h;
			double lm = distill_loss(&ctx);
			sd[i] = save;
			double g = dloss * (lp - lm) / (2 * h);
			/* The op: a double expression rounded once to float32
			 * (u |g|). The central difference: h^2/6 |f^(3)| (f is
			 * smooth in the logits with derivatives O(1/T^3) <= 1:
			 * ~2e-11) and 2^-53 |L| / h (|L| <= ~50 here: ~6e-10). */
			if (!(fabs(d[i] - g) <= F32_U * fabs(g) + 1e-9) && bad++ < 3)
				fprintf(stderr, "case %zu: dlogits[%zu] = %.9g, finite differences %.9g\n", c, i,
					(double)d[i], g);
		}
		CHECK_MSG(bad == 0, "case %zu: %d gradient values off", c, bad);
		/* In place gives the same bits. */
		memcpy(d2, s, nv * sizeof(float));
		distill_backward(d2, d2, t, tgt, dloss, cases[c].alpha, cases[c].T, N, V);
		CHECK_MSG(memcmp(d, d2, nv * sizeof(float)) == 0, "case %zu: in-place backward differs", c);
		free(s);
		free(t);
		free(kl);
		free(ce);
		free(d);
		free(d2);
		free(sd);
		free(td);
		free(tgt);
		free(rkl);
		free(rce);
	}
}

/* -------------------------------------------------------------- dropout -- */

static void test_dropout(void)
{
	const size_t n = 100000;
	float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float));
	float *z = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
	for (size_t i = 0; i < n; i++)
		x[i] = (float)(1.5 + urand()); /* never 0: a 0 output means dropped */
	static const float ps[] = {0.0f, 0.1f, 0.5f, 0.9f};
	for (size_t c = 0; c < sizeof(ps) / sizeof(ps[0]); c++) {
		float p = ps[c];
		dropout_forward(y, x, p, 1234, n);
		dropout_forward(z, x, p, 1234, n);
		CHECK_MSG(memcmp(y, z, n * sizeof(float)) == 0, "p=%g: not deterministic", (double)p);
		size_t dropped = 0, badscale = 0;
		float keep = (float)(1.0 / (1.0 - (double)p));
		for (size_t i = 0; i < n; i++) {
			if (y[i] == 0.0f)
				dropped++;
			else
				badscale += y[i] != x[i] * keep;
		}
		/* Binomial(n, p): within 5 standard deviations. */
		double sd = sqrt((double)n * p * (1 - p));
		CHECK_MSG(fabs((double)dropped - (double)n * p) <= 5 * sd + 0.5, "p=%g: dropped %zu of %zu",
			  (double)p, dropped, n);
		CHECK_EQ_INT(badscale, 0);
		/* The backward is the same call on dout: the same positions. */
		memcpy(w, x, n * sizeof(float));
		dropout_forward(w, w, p, 1234, n); /* in place */
		CHECK_MSG(memcmp(w, y, n * sizeof(float)) == 0, "p=%g: in place differs", (double)p);
		if (p > 0) {
			dropout_forward(z, x, p, 1235, n);
			CHECK_MSG(memcmp(y, z, n * sizeof(float)) != 0, "p=%g: another seed, the same mask",
				  (double)p);
		}
	}
	free(x);
	free(y);
	free(z);
	free(w);
}

int main(void)
{
	test_nf4_codebook();
	test_nf4_roundtrip();
	test_nf4_nearest();
	test_absmax_dq();
	test_distill();
	test_dropout();
	return check_status();
}
