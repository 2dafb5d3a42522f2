/* Unit tests for kernels/cpu/ops.c: every op against a naive double-precision
 * reference written here.
 *
 * Forward ops are compared with the double reference; backward ops with
 * central finite differences of that reference's scalar L = sum(out * R) for a
 * random R (R is what the op gets as dout). Inputs come from a fixed-seed
 * PRNG, never zeros. Each op has a table of small shapes, and the header's
 * contract is checked as well: accumulate versus overwrite (outputs pre-filled
 * with random values or NaN), NULL outputs, the allowed aliasing, -100
 * targets. This is not a test against transformers; the fixture tests do that. */
#include "kernels/cpu/ops.h"
#include "tests/check.h"

#include <stdbool.h>
#include <stdint.h>

/* Tolerances. The matmuls (OpenBLAS: its summation order depends on shape,
 * threads and core type) are held per element to the float32 bound of their
 * dot products (f32_gamma in tests/check.h). Every other op here is plain C
 * in a fixed order, so its error is the same on every machine; they are held
 * to these bounds, derived from their arithmetic:
 * - FWD: an output is rounded to float32 a few times (reductions accumulate in
 *   double; element-wise chains are at most ~10 float operations, expf/cosf
 *   within 1 ulp): relative error <= ~20u = 1.2e-6 where the result is not a
 *   cancellation. FWD_RTOL 1e-5 (~170u) covers the conditioning of the chains
 *   (x*sigmoid(x), RoPE's differences of products); FWD_ATOL 1e-6 covers
 *   outputs that are differences of O(1) terms (inputs lie in [-1, 1]), whose
 *   absolute error is a few u times the terms (4 terms x 4u = 1e-6).
 * - GRAD, against central differences of the double reference with step
 *   FD_STEP h: their error is h^2/6 |f^(3)| (~1e-11 for these smooth O(1)
 *   losses) plus 2^-53 |L| / h (|L| = |sum out*R| <= ~1e3 here: ~1e-8). The
 *   op's own float32 error dominates: sums of up to T*HS ~ 300 float
 *   products of O(1) values in attention's backward, sqrt(300) u ~ 1e-6
 *   relative in a typical order and gamma_300 = 1.8e-5 of the terms at
 *   worst; GRAD_ATOL 1e-5 + GRAD_RTOL 1e-4 hold that worst case for the
 *   terms' magnitudes these shapes give (sum |terms| <= ~5 |ref| + 0.5).
 * The test prints the largest errors it saw, to show the room left. */
#define FWD_ATOL 1e-6
#define FWD_RTOL 1e-5
#define GRAD_ATOL 1e-5
#define GRAD_RTOL 1e-4
#define FD_STEP 1e-5

/* ------------------------------------------------------------ helpers -- */

enum kind { FWD, GRAD, NKIND };
static double max_abs_err[NKIND], max_rel_err[NKIND];
static char max_abs_at[NKIND][128], max_rel_at[NKIND][128];
static char where[96]; /* the case being run, for failure messages */

static uint64_t rng_state = 0x7261696e64ULL;

/* splitmix64: tiny, fixed-seed, the same sequence everywhere. */
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

/* Every allocation of a case is tracked and freed by scratch_free(). */
static void *tracked[256];
static int ntracked;

static void *scratch(size_t bytes)
{
	if (ntracked == (int)(sizeof(tracked) / sizeof(tracked[0]))) {
		fprintf(stderr, "test_ops: scratch table full\n");
		abort();
	}
	void *p = calloc(1, bytes ? bytes : 1);
	if (!p) {
		fprintf(stderr, "test_ops: out of memory\n");
		abort();
	}
	tracked[ntracked++] = p;
	return p;
}

static void scratch_free(void)
{
	while (ntracked > 0)
		free(tracked[--ntracked]);
}

static float *fvec(size_t n)
{
	return scratch(n * sizeof(float));
}

static double *dvec(size_t n)
{
	return scratch(n * sizeof(double));
}

static float *frand(size_t n, double scale, double offset)
{
	float *x = fvec(n);
	for (size_t i = 0; i < n; i++)
		x[i] = (float)(offset + scale * urand());
	return x;
}

static float *fcopy(const float *x, size_t n)
{
	float *y = fvec(n);
	memcpy(y, x, n * sizeof(float));
	return y;
}

static float *ffill(size_t n, float value)
{
	float *x = fvec(n);
	for (size_t i = 0; i < n; i++)
		x[i] = value;
	return x;
}

static double *to_d(const float *x, size_t n)
{
	double *y = dvec(n);
	for (size_t i = 0; i < n; i++)
		y[i] = x[i];
	return y;
}

/* base[i] + add[i] in double: the expected value of an accumulated output. */
static double *plus(const float *base, const double *add, size_t n)
{
	double *y = dvec(n);
	for (size_t i = 0; i < n; i++)
		y[i] = (double)base[i] + add[i];
	return y;
}

/* One check per array: passes when every |got - ref| <= atol + rtol*|ref|;
 * on failure prints the worst element with both values. NaN fails. */
static void expect_close(const char *what, const float *got, const double *ref, size_t n,
			 double atol, double rtol, enum kind kind)
{
	size_t worst = 0;
	double worst_excess = -INFINITY;
	int bad = 0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - ref[i]);
		double tol = atol + rtol * fabs(ref[i]);
		if (!(d <= tol)) {
			if (!bad || !(d - tol <= worst_excess)) {
				worst = i;
				worst_excess = isnan(d) ? INFINITY : d - tol;
			}
			bad = 1;
			continue;
		}
		if (d > max_abs_err[kind]) {
			max_abs_err[kind] = d;
			snprintf(max_abs_at[kind], sizeof(max_abs_at[kind]), "%s %s", where, what);
		}
		if (fabs(ref[i]) > 1e-3 && d / fabs(ref[i]) > max_rel_err[kind]) {
			max_rel_err[kind] = d / fabs(ref[i]);
			snprintf(max_rel_at[kind], sizeof(max_rel_at[kind]), "%s %s", where, what);
		}
	}
	CHECK_MSG(!bad, "%s: %s[%zu] = %.9g, ref %.9g (atol %g, rtol %g)", where, what, worst,
		  bad ? got[worst] : 0.0, bad ? ref[worst] : 0.0, atol, rtol);
}

/* got[i] within bound[i] of ref[i], a bound derived per element. */
static void expect_within(const char *what, const float *got, const double *ref,
			  const double *bound, size_t n)
{
	size_t bad = 0, worst = 0;
	double worst_ratio = 0.0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - ref[i]);
		if (!(d <= bound[i])) {
			double r = isnan(d) ? INFINITY : d / bound[i];
			if (!bad++ || r > worst_ratio) {
				worst = i;
				worst_ratio = r;
			}
		}
	}
	CHECK_MSG(!bad, "%s: %s[%zu] = %.9g, ref %.9g, bound %.3g (%zu element(s) outside)", where,
		  what, worst, bad ? got[worst] : 0.0, bad ? ref[worst] : 0.0, bad ? bound[worst] : 0.0,
		  bad);
}

static void expect_same(const char *what, const float *a, const float *b, size_t n)
{
	CHECK_MSG(memcmp(a, b, n * sizeof(float)) == 0, "%s: %s differ bitwise", where, what);
}

/* Central differences of f with respect to x[0..n), where x is one of the
 * arrays f reads through ctx. */
typedef double (*loss_fn)(void *ctx);

static double *fd_grad(double *x, size_t n, loss_fn f, void *ctx)
{
	double *g = dvec(n);
	for (size_t i = 0; i < n; i++) {
		double save = x[i];
		x[i] = save + FD_STEP;
		double lp = f(ctx);
		x[i] = save - FD_STEP;
		double lm = f(ctx);
		x[i] = save;
		g[i] = (lp - lm) / (2 * FD_STEP);
	}
	return g;
}

static double dot(const double *a, const double *b, size_t n)
{
	double s = 0.0;
	for (size_t i = 0; i < n; i++)
		s += a[i] * b[i];
	return s;
}

/* --------------------------------------------------- double references -- */

static void ref_rmsnorm(double *out, double *rstd, const double *x, const double *w, int N, int C,
			double eps)
{
	for (int n = 0; n < N; n++) {
		double ss = 0.0;
		for (int c = 0; c < C; c++)
			ss += x[n * C + c] * x[n * C + c];
		double r = 1.0 / sqrt(ss / C + eps);
		for (int c = 0; c < C; c++)
			out[n * C + c] = w[c] * x[n * C + c] * r;
		if (rstd)
			rstd[n] = r;
	}
}

static void ref_rope(double *out, const double *x, const double *cos, const double *sin, int B,
		     int T, int NH, int HS)
{
	int H2 = HS / 2;
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++)
			for (int h = 0; h < NH; h++) {
				int off = ((b * T + t) * NH + h) * HS;
				for (int i = 0; i < H2; i++) {
					double x1 = x[off + i], x2 = x[off + i + H2];
					double c = cos[t * H2 + i], s = sin[t * H2 + i];
					out[off + i] = x1 * c - x2 * s;
					out[off + i + H2] = x2 * c + x1 * s;
				}
			}
}

static void ref_attention(double *out, double *att, const double *q, const double *k,
			  const double *v, int B, int T, int NH, int NKV, int HS)
{
	double scale = 1.0 / sqrt((double)HS);
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++) {
			int kh = h / (NH / NKV);
			for (int t = 0; t < T; t++) {
				const double *qr = q + ((b * T + t) * NH + h) * HS;
				double *p = att + (((size_t)b * NH + h) * T + t) * T;
				double max = -INFINITY;
				for (int s = 0; s < T; s++) {
					p[s] = 0.0;
					if (s > t)
						continue;
					const double *kr = k + ((b * T + s) * NKV + kh) * HS;
					double d = 0.0;
					for (int i = 0; i < HS; i++)
						d += qr[i] * kr[i];
					p[s] = d * scale;
					if (p[s] > max)
						max = p[s];
				}
				double sum = 0.0;
				for (int s = 0; s <= t; s++)
					sum += p[s] = exp(p[s] - max);
				for (int s = 0; s <= t; s++)
					p[s] /= sum;
				double *o = out + ((b * T + t) * NH + h) * HS;
				for (int i = 0; i < HS; i++) {
					double acc = 0.0;
					for (int s = 0; s <= t; s++)
						acc += p[s] * v[((b * T + s) * NKV + kh) * HS + i];
					o[i] = acc;
				}
			}
		}
}

static void ref_swiglu(double *out, const double *gate, const double *up, size_t n)
{
	for (size_t i = 0; i < n; i++)
		out[i] = gate[i] / (1.0 + exp(-gate[i])) * up[i];
}

static void ref_crossentropy(double *losses, const double *logits, const int32_t *targets, int N,
			     int V)
{
	for (int n = 0; n < N; n++) {
		const double *x = logits + (size_t)n * V;
		if (targets[n] == -100) {
			losses[n] = 0.0;
			continue;
		}
		double max = x[0];
		for (int i = 1; i < V; i++)
			max = x[i] > max ? x[i] : max;
		double sum = 0.0;
		for (int i = 0; i < V; i++)
			sum += exp(x[i] - max);
		losses[n] = max + log(sum) - x[targets[n]];
	}
}

/* ---------------------------------------------------------------- tests -- */

static void test_embedding(void)
{
	static const struct { int N, C, V; } cases[] = {
		{ 1, 1, 1 }, { 6, 8, 5 }, { 12, 16, 3 }, { 4, 33, 50 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int N = cases[ci].N, C = cases[ci].C, V = cases[ci].V;
		snprintf(where, sizeof(where), "embedding case %zu (N=%d C=%d V=%d)", ci, N, C, V);
		int32_t *ids = scratch(sizeof(int32_t) * N);
		for (int n = 0; n < N; n++)
			ids[n] = (int32_t)(rng_next() % (uint64_t)V);
		float *wte = frand((size_t)V * C, 1.0, 0.0);
		float *out = ffill((size_t)N * C, NAN);
		embedding_forward(out, ids, wte, N, C);
		double *ref = dvec((size_t)N * C);
		for (int n = 0; n < N; n++)
			for (int c = 0; c < C; c++)
				ref[n * C + c] = wte[ids[n] * C + c];
		expect_close("out", out, ref, (size_t)N * C, 0.0, 0.0, FWD);

		/* Accumulates, and repeated ids add up. */
		float *dout = frand((size_t)N * C, 1.0, 0.0);
		float *dwte = frand((size_t)V * C, 1.0, 0.0);
		double *dref = to_d(dwte, (size_t)V * C);
		for (int n = 0; n < N; n++)
			for (int c = 0; c < C; c++)
				dref[ids[n] * C + c] += dout[n * C + c];
		float *dwte0 = scratch(sizeof(float) * (size_t)V * C);
		memcpy(dwte0, dwte, sizeof(float) * (size_t)V * C);
		embedding_backward(dwte, dout, ids, N, C);
		expect_close("dwte", dwte, dref, (size_t)V * C, 1e-6, 1e-6, GRAD);

		/* Parts of the table (a data-parallel rank's, train/ddp.h), each
		 * cutting rows where it can: together the whole table's bits (the
		 * same sums in the same order), and the lookups of the parts sum
		 * to the lookup (each element from one part, zeros elsewhere). */
		const size_t nw = (size_t)V * C, nparts = 3;
		float *pw = scratch(sizeof(float) * nw);
		memcpy(pw, dwte0, sizeof(float) * nw);
		float *sum = ffill((size_t)N * C, 0.0f), *po = ffill((size_t)N * C, NAN);
		for (size_t k = 0; k < nparts; k++) {
			const size_t lo = nw * k / nparts + (k ? 1 : 0), hi = nw * (k + 1) / nparts + 1;
			const size_t l = lo < nw ? lo : nw, h = k + 1 == nparts || hi > nw ? nw : hi;
			embedding_backward_part(pw + l, dout, ids, N, C, l, h);
			embedding_forward_part(po, ids, wte + l, N, C, l, h);
			for (size_t i = 0; i < (size_t)N * C; i++)
				sum[i] += po[i];
		}
		expect_same("dwte by parts", pw, dwte, nw);
		expect_same("lookup by parts", sum, out, (size_t)N * C);
		scratch_free();
	}
}

struct rmsnorm_ctx {
	double *x, *w, *R, *out;
	int N, C;
	double eps;
};

static double rmsnorm_loss(void *p)
{
	struct rmsnorm_ctx *c = p;
	ref_rmsnorm(c->out, NULL, c->x, c->w, c->N, c->C, c->eps);
	return dot(c->out, c->R, (size_t)c->N * c->C);
}

static void test_rmsnorm(void)
{
	static const struct { int N, C; float eps; double offset; } cases[] = {
		{ 1, 1, 1e-6f, 0.0 }, { 4, 8, 1e-5f, 0.0 }, { 5, 64, 1e-6f, 0.5 },
		{ 3, 33, 1e-5f, 0.0 }, { 2, 256, 1e-6f, -0.3 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int N = cases[ci].N, C = cases[ci].C;
		size_t NC = (size_t)N * C;
		float eps = cases[ci].eps;
		snprintf(where, sizeof(where), "rmsnorm case %zu (N=%d C=%d)", ci, N, C);
		float *x = frand(NC, 2.0, cases[ci].offset);
		float *w = frand((size_t)C, 0.5, 1.0);
		float *out = ffill(NC, NAN), *rstd = ffill((size_t)N, NAN);
		rmsnorm_forward(out, rstd, x, w, N, C, eps);

		struct rmsnorm_ctx ctx = { to_d(x, NC), to_d(w, (size_t)C), NULL, dvec(NC), N, C,
					   (double)eps };
		double *ref = dvec(NC), *rref = dvec((size_t)N);
		ref_rmsnorm(ref, rref, ctx.x, ctx.w, N, C, ctx.eps);
		expect_close("out", out, ref, NC, FWD_ATOL, FWD_RTOL, FWD);
		expect_close("rstd", rstd, rref, (size_t)N, FWD_ATOL, FWD_RTOL, FWD);

		float *dout = frand(NC, 1.0, 0.0);
		ctx.R = to_d(dout, NC);
		double *gx = fd_grad(ctx.x, NC, rmsnorm_loss, &ctx);
		double *gw = fd_grad(ctx.w, (size_t)C, rmsnorm_loss, &ctx);

		float *dinp0 = frand(NC, 1.0, 0.0), *dw0 = frand((size_t)C, 1.0, 0.0);
		float *dinp = fcopy(dinp0, NC), *dw = fcopy(dw0, (size_t)C);
		rmsnorm_backward(dinp, dw, dout, x, w, rstd, N, C);
		expect_close("dinp (+=)", dinp, plus(dinp0, gx, NC), NC, GRAD_ATOL, GRAD_RTOL, GRAD);
		expect_close("dweight (+=)", dw, plus(dw0, gw, (size_t)C), (size_t)C, GRAD_ATOL,
			     GRAD_RTOL, GRAD);

		float *dinp2 = fcopy(dinp0, NC);
		rmsnorm_backward(dinp2, NULL, dout, x, w, rstd, N, C);
		expect_same("dinp with dweight NULL", dinp2, dinp, NC);
		scratch_free();
	}
}

static void test_matmul(void)
{
	static const struct { int N, C, OC, bias; } cases[] = {
		{ 1, 1, 1, 0 }, { 4, 8, 6, 1 }, { 10, 5, 3, 0 }, { 7, 16, 12, 1 }, { 3, 64, 40, 1 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int N = cases[ci].N, C = cases[ci].C, OC = cases[ci].OC;
		size_t NC = (size_t)N * C, NO = (size_t)N * OC, OCC = (size_t)OC * C;
		snprintf(where, sizeof(where), "matmul case %zu (N=%d C=%d OC=%d bias=%d)", ci, N, C,
			 OC, cases[ci].bias);
		float *x = frand(NC, 1.0, 0.0), *w = frand(OCC, 1.0, 0.0);
		float *bias = cases[ci].bias ? frand((size_t)OC, 1.0, 0.0) : NULL;
		float *out = ffill(NO, NAN);
		matmul_forward(out, x, w, bias, N, C, OC);

		/* OpenBLAS sums in an order that depends on the shape, the
		 * thread count and the core type: each element is held to the
		 * float32 bound of its dot product, gamma_{C+1} times the sum of
		 * its terms' magnitudes (the bias is one term), against the exact
		 * (double) product. */
		double *ref = dvec(NO), *mag = dvec(NO);
		for (int n = 0; n < N; n++)
			for (int o = 0; o < OC; o++) {
				double s = bias ? bias[o] : 0.0, a = bias ? fabs(bias[o]) : 0.0;
				for (int c = 0; c < C; c++) {
					s += (double)x[n * C + c] * w[o * C + c];
					a += fabs((double)x[n * C + c] * w[o * C + c]);
				}
				ref[n * OC + o] = s;
				mag[n * OC + o] = f32_gamma(C + 1) * a;
			}
		expect_within("out", out, ref, mag, NO);

		/* matmul_forward_add: out += x @ w^T, the old value one more
		 * term of each element's sum (as the bias is above). */
		float *acc = frand(NO, 1.0, 0.0);
		double *ra = to_d(acc, NO), *ba = dvec(NO);
		for (int n = 0; n < N; n++)
			for (int o = 0; o < OC; o++) {
				double a = fabs(ra[n * OC + o]);
				for (int c = 0; c < C; c++) {
					ra[n * OC + o] += (double)x[n * C + c] * w[o * C + c];
					a += fabs((double)x[n * C + c] * w[o * C + c]);
				}
				ba[n * OC + o] = f32_gamma(C + 1) * a;
			}
		matmul_forward_add(acc, x, w, N, C, OC);
		expect_within("out (add)", acc, ra, ba, NO);

		/* The backward against its exact values (the op is linear, so no
		 * finite differences are needed): dinp += dout @ w has OC products
		 * and the old value per element, dweight += dout^T @ x has N, dbias
		 * += sum_n dout has N terms; each bounded like the forward. */
		float *dout = frand(NO, 1.0, 0.0);
		float *dinp0 = frand(NC, 1.0, 0.0), *dw0 = frand(OCC, 1.0, 0.0);
		float *db0 = frand((size_t)OC, 1.0, 0.0);
		double *rx = to_d(dinp0, NC), *rw = to_d(dw0, OCC), *rb = to_d(db0, (size_t)OC);
		double *bx = dvec(NC), *bw = dvec(OCC), *bb = dvec((size_t)OC);
		for (size_t i = 0; i < NC; i++)
			bx[i] = fabs(rx[i]);
		for (size_t i = 0; i < OCC; i++)
			bw[i] = fabs(rw[i]);
		for (int o = 0; o < OC; o++)
			bb[o] = fabs(rb[o]);
		for (int n = 0; n < N; n++)
			for (int o = 0; o < OC; o++) {
				double d = dout[n * OC + o];
				rb[o] += d;
				bb[o] += fabs(d);
				for (int c = 0; c < C; c++) {
					double tx = d * w[o * C + c], tw = d * x[n * C + c];
					rx[n * C + c] += tx;
					bx[n * C + c] += fabs(tx);
					rw[o * C + c] += tw;
					bw[o * C + c] += fabs(tw);
				}
			}
		for (size_t i = 0; i < NC; i++)
			bx[i] *= f32_gamma(OC + 1);
		for (size_t i = 0; i < OCC; i++)
			bw[i] *= f32_gamma(N + 1);
		for (int o = 0; o < OC; o++)
			bb[o] *= f32_gamma(N + 1);

		/* Every combination of NULL outputs; the present ones accumulate. */
		for (int mask = 0; mask < 8; mask++) {
			float *dinp = mask & 1 ? fcopy(dinp0, NC) : NULL;
			float *dw = mask & 2 ? fcopy(dw0, OCC) : NULL;
			float *db = mask & 4 ? fcopy(db0, (size_t)OC) : NULL;
			matmul_backward(dinp, dw, db, dout, x, w, N, C, OC);
			snprintf(where, sizeof(where), "matmul case %zu mask %d", ci, mask);
			if (dinp)
				expect_within("dinp (+=)", dinp, rx, bx, NC);
			if (dw)
				expect_within("dweight (+=)", dw, rw, bw, OCC);
			if (db)
				expect_within("dbias (+=)", db, rb, bb, (size_t)OC);
		}
		scratch_free();
	}
}

static void test_rope_cache(void)
{
	static const struct { int T, HS; double theta; } cases[] = {
		{ 1, 8, 10000.0 }, { 5, 8, 10000.0 }, { 64, 64, 1000000.0 },
		{ 2048, 128, 500000.0 }, { 300, 2, 10000.0 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int T = cases[ci].T, HS = cases[ci].HS, H2 = HS / 2;
		double theta = cases[ci].theta;
		size_t n = (size_t)T * H2;
		snprintf(where, sizeof(where), "rope_cache case %zu (T=%d HS=%d theta=%g)", ci, T, HS,
			 theta);
		float *cs = ffill(n, NAN), *sn = ffill(n, NAN);
		rope_cache(cs, sn, T, HS, theta);

		/* transformers' float32 steps, with pow correctly rounded through
		 * double: inv_freq = 1 / float(theta^float(2i/HS)), angle =
		 * float(t * inv_freq); only cos/sin are taken in double. With the
		 * angle in double instead, T=2048 is off by ~1e-4. */
		double *rc = dvec(n), *rs = dvec(n), *dc = dvec(n), *ds = dvec(n);
		for (int i = 0; i < H2; i++) {
			float e = (float)(2 * i) / (float)HS;
			float p = (float)pow((double)(float)theta, (double)e);
			float inv = 1.0f / p;
			for (int t = 0; t < T; t++) {
				float a = (float)t * inv;
				rc[t * H2 + i] = cos((double)a);
				rs[t * H2 + i] = sin((double)a);
				double ad = t * pow(theta, -2.0 * i / HS);
				dc[t * H2 + i] = cos(ad);
				ds[t * H2 + i] = sin(ad);
			}
		}
		expect_close("cos", cs, rc, n, 1e-7, 0.0, FWD);
		expect_close("sin", sn, rs, n, 1e-7, 0.0, FWD);
		/* The first rows also agree with the exact angles. */
		size_t head = (size_t)(T < 8 ? T : 8) * H2;
		expect_close("cos vs exact angle", cs, dc, head, 1e-5, 0.0, FWD);
		expect_close("sin vs exact angle", sn, ds, head, 1e-5, 0.0, FWD);
		scratch_free();
	}
}

struct rope_ctx {
	double *x, *cos, *sin, *R, *out;
	int B, T, NH, HS;
};

static double rope_loss(void *p)
{
	struct rope_ctx *c = p;
	ref_rope(c->out, c->x, c->cos, c->sin, c->B, c->T, c->NH, c->HS);
	return dot(c->out, c->R, (size_t)c->B * c->T * c->NH * c->HS);
}

static void test_rope(void)
{
	static const struct { int B, T, NH, HS; } cases[] = {
		{ 1, 1, 1, 2 }, { 2, 5, 4, 8 }, { 1, 7, 3, 16 }, { 2, 1, 2, 8 }, { 1, 40, 2, 64 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int B = cases[ci].B, T = cases[ci].T, NH = cases[ci].NH, HS = cases[ci].HS;
		size_t n = (size_t)B * T * NH * HS, nc = (size_t)T * (HS / 2);
		snprintf(where, sizeof(where), "rope case %zu (B=%d T=%d NH=%d HS=%d)", ci, B, T, NH,
			 HS);
		float *cs = fvec(nc), *sn = fvec(nc);
		rope_cache(cs, sn, T, HS, 10000.0);
		float *x = frand(n, 1.0, 0.0), *out = ffill(n, NAN);
		rope_forward(out, x, cs, sn, B, T, NH, HS);
		struct rope_ctx ctx = { to_d(x, n), to_d(cs, nc), to_d(sn, nc), NULL, dvec(n),
					B, T, NH, HS };
		double *ref = dvec(n);
		ref_rope(ref, ctx.x, ctx.cos, ctx.sin, B, T, NH, HS);
		expect_close("out", out, ref, n, FWD_ATOL, FWD_RTOL, FWD);

		float *inplace = fcopy(x, n);
		rope_forward(inplace, inplace, cs, sn, B, T, NH, HS);
		expect_same("in-place forward vs out-of-place", inplace, out, n);

		float *dout = frand(n, 1.0, 0.0), *dinp = ffill(n, NAN);
		ctx.R = to_d(dout, n);
		double *gx = fd_grad(ctx.x, n, rope_loss, &ctx);
		rope_backward(dinp, dout, cs, sn, B, T, NH, HS);
		expect_close("dinp", dinp, gx, n, GRAD_ATOL, GRAD_RTOL, GRAD);

		float *dinplace = fcopy(dout, n);
		rope_backward(dinplace, dinplace, cs, sn, B, T, NH, HS);
		expect_same("in-place backward vs out-of-place", dinplace, dinp, n);

		/* A rotation: the backward (transpose) undoes the forward. */
		rope_backward(inplace, inplace, cs, sn, B, T, NH, HS);
		expect_close("backward(forward(x))", inplace, ctx.x, n, 1e-6, 1e-6, FWD);
		scratch_free();
	}
}

struct attn_ctx {
	double *q, *k, *v, *R, *out, *att;
	int B, T, NH, NKV, HS;
};

static double attn_loss(void *p)
{
	struct attn_ctx *c = p;
	ref_attention(c->out, c->att, c->q, c->k, c->v, c->B, c->T, c->NH, c->NKV, c->HS);
	return dot(c->out, c->R, (size_t)c->B * c->T * c->NH * c->HS);
}

static void test_attention(void)
{
	static const struct { int B, T, NH, NKV, HS; double scale; } cases[] = {
		{ 2, 5, 4, 2, 8, 1.0 },	  /* GQA */
		{ 1, 6, 4, 4, 8, 1.0 },	  /* NKV == NH */
		{ 2, 1, 4, 2, 8, 1.0 },	  /* T = 1 */
		{ 1, 7, 6, 1, 4, 2.0 },	  /* MQA, peakier softmax */
		{ 1, 4, 2, 2, 16, 0.5 },
		{ 1, 9, 2, 1, 32, 1.5 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int B = cases[ci].B, T = cases[ci].T, NH = cases[ci].NH, NKV = cases[ci].NKV;
		int HS = cases[ci].HS;
		size_t nq = (size_t)B * T * NH * HS, nk = (size_t)B * T * NKV * HS;
		size_t na = (size_t)B * NH * T * T;
		snprintf(where, sizeof(where), "attention case %zu (B=%d T=%d NH=%d NKV=%d HS=%d)", ci,
			 B, T, NH, NKV, HS);
		double sc = cases[ci].scale;
		float *q = frand(nq, sc, 0.0), *k = frand(nk, sc, 0.0), *v = frand(nk, 1.0, 0.0);
		float *out = ffill(nq, NAN), *att = ffill(na, NAN);
		attention_forward(out, att, q, k, v, B, T, NH, NKV, HS);

		struct attn_ctx ctx = { to_d(q, nq), to_d(k, nk), to_d(v, nk), NULL,
					dvec(nq), dvec(na), B, T, NH, NKV, HS };
		double *ref = dvec(nq), *aref = dvec(na);
		ref_attention(ref, aref, ctx.q, ctx.k, ctx.v, B, T, NH, NKV, HS);
		expect_close("out", out, ref, nq, FWD_ATOL, FWD_RTOL, FWD);
		expect_close("att", att, aref, na, FWD_ATOL, FWD_RTOL, FWD);
		int upper_zero = 1;
		for (int bh = 0; bh < B * NH; bh++)
			for (int t = 0; t < T; t++)
				for (int s = t + 1; s < T; s++)
					upper_zero &= att[((size_t)bh * T + t) * T + s] == 0.0f;
		CHECK_MSG(upper_zero, "%s: att not exactly zero above the diagonal", where);

		float *dout = frand(nq, 1.0, 0.0);
		ctx.R = to_d(dout, nq);
		double *gq = fd_grad(ctx.q, nq, attn_loss, &ctx);
		double *gk = fd_grad(ctx.k, nk, attn_loss, &ctx);
		double *gv = fd_grad(ctx.v, nk, attn_loss, &ctx);

		/* Overwrite: NaN in the outputs and the scratch must not leak through. */
		float *dq = ffill(nq, NAN), *dk = ffill(nk, NAN), *dv = ffill(nk, NAN);
		float *datt = ffill(na, NAN);
		attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, NH, NKV, HS);
		expect_close("dq", dq, gq, nq, GRAD_ATOL, GRAD_RTOL, GRAD);
		expect_close("dk", dk, gk, nk, GRAD_ATOL, GRAD_RTOL, GRAD);
		expect_close("dv", dv, gv, nk, GRAD_ATOL, GRAD_RTOL, GRAD);

		/* Deterministic: a second run gives the same bits. */
		float *out2 = fvec(nq), *att2 = fvec(na);
		attention_forward(out2, att2, q, k, v, B, T, NH, NKV, HS);
		expect_same("forward run twice", out2, out, nq);
		float *dq2 = frand(nq, 1.0, 0.0), *dk2 = frand(nk, 1.0, 0.0);
		float *dv2 = frand(nk, 1.0, 0.0);
		attention_backward(dq2, dk2, dv2, datt, dout, q, k, v, att, B, T, NH, NKV, HS);
		expect_same("dq run twice", dq2, dq, nq);
		expect_same("dk run twice", dk2, dk, nk);
		expect_same("dv run twice", dv2, dv, nk);
		scratch_free();
	}
}

struct swiglu_ctx {
	double *gate, *up, *R, *out;
	size_t n;
};

static double swiglu_loss(void *p)
{
	struct swiglu_ctx *c = p;
	ref_swiglu(c->out, c->gate, c->up, c->n);
	return dot(c->out, c->R, c->n);
}

static void test_swiglu(void)
{
	static const float extreme[] = { -100.0f, -30.0f, -5.0f, -0.25f, 0.5f, 5.0f, 30.0f, 100.0f };
	static const struct { size_t n; double scale; int extreme; } cases[] = {
		{ 1, 1.0, 0 }, { 7, 2.0, 0 }, { 64, 6.0, 0 }, { 8, 0.0, 1 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		size_t n = cases[ci].n;
		snprintf(where, sizeof(where), "swiglu case %zu (n=%zu)", ci, n);
		float *gate = cases[ci].extreme ? fcopy(extreme, n) : frand(n, cases[ci].scale, 0.0);
		float *up = frand(n, 1.0, 0.0), *out = ffill(n, NAN);
		swiglu_forward(out, gate, up, n);
		struct swiglu_ctx ctx = { to_d(gate, n), to_d(up, n), NULL, dvec(n), n };
		double *ref = dvec(n);
		ref_swiglu(ref, ctx.gate, ctx.up, n);
		expect_close("out", out, ref, n, FWD_ATOL, FWD_RTOL, FWD);

		float *dout = frand(n, 1.0, 0.0);
		ctx.R = to_d(dout, n);
		double *gg = fd_grad(ctx.gate, n, swiglu_loss, &ctx);
		double *gu = fd_grad(ctx.up, n, swiglu_loss, &ctx);
		float *dgate = ffill(n, NAN), *dup = ffill(n, NAN);
		swiglu_backward(dgate, dup, dout, gate, up, n);
		expect_close("dgate", dgate, gg, n, GRAD_ATOL, GRAD_RTOL, GRAD);
		expect_close("dup", dup, gu, n, GRAD_ATOL, GRAD_RTOL, GRAD);
		scratch_free();
	}
}

static void test_elementwise(void)
{
	static const size_t sizes[] = { 1, 13, 100, 1001 };
	for (size_t ci = 0; ci < sizeof(sizes) / sizeof(sizes[0]); ci++) {
		size_t n = sizes[ci];
		snprintf(where, sizeof(where), "elementwise case %zu (n=%zu)", ci, n);
		float *a = frand(n, 1.0, 0.0), *b = frand(n, 1.0, 0.0);
		double *sum = dvec(n);
		for (size_t i = 0; i < n; i++)
			sum[i] = (double)a[i] + b[i];

		float *out = ffill(n, NAN);
		residual_forward(out, a, b, n);
		expect_close("residual", out, sum, n, 0.0, 1e-7, FWD);
		float *aa = fcopy(a, n), *bb = fcopy(b, n);
		residual_forward(aa, aa, b, n);
		expect_same("residual out == a", aa, out, n);
		residual_forward(bb, a, bb, n);
		expect_same("residual out == b", bb, out, n);

		float *y = fcopy(a, n);
		add_inplace(y, b, n);
		expect_same("add_inplace", y, out, n);

		float *s = fcopy(a, n);
		scale_inplace(s, -0.37f, n);
		double *sref = dvec(n);
		for (size_t i = 0; i < n; i++)
			sref[i] = (double)a[i] * (double)-0.37f;
		expect_close("scale_inplace", s, sref, n, 0.0, 1e-7, FWD);

		long double ss = 0.0L;
		for (size_t i = 0; i < n; i++)
			ss += (long double)a[i] * a[i];
		/* sumsq adds n <= 1000 non-negative double squares (each exact:
		 * a float's square fits a double): gamma_n in double is
		 * n * 2^-53 = 1.1e-13 relative at worst. */
		CHECK_NEAR(sumsq(a, n), (double)ss, (double)n * 0x1p-53 * (double)ss);
		scratch_free();
	}
	CHECK_NEAR(sumsq(NULL, 0), 0.0, 0.0);
	float big[3] = { 3e20f, 4e20f, 1.0f }; /* squares overflow float, not double */
	double bigref = (double)big[0] * big[0] + (double)big[1] * big[1] + 1.0;
	CHECK_NEAR(sumsq(big, 3), bigref, 3 * 0x1p-53 * bigref); /* gamma_3 in double */
}

struct ce_ctx {
	double *logits, *losses;
	const int32_t *targets;
	double dloss;
	int N, V;
};

static double ce_loss(void *p)
{
	struct ce_ctx *c = p;
	ref_crossentropy(c->losses, c->logits, c->targets, c->N, c->V);
	double s = 0.0;
	for (int n = 0; n < c->N; n++)
		s += c->losses[n];
	return c->dloss * s;
}

static void test_crossentropy(void)
{
	/* ignore: every row n with n % ignore == 1 has target -100 (1: all rows).
	 * shift: added to the logits, to need the max subtracted. */
	static const struct { int N, V, ignore; double scale, shift; float dloss; } cases[] = {
		{ 1, 1, 0, 1.0, 0.0, 1.0f },	   { 4, 10, 0, 1.0, 0.0, 0.25f },
		{ 6, 33, 3, 3.0, 0.0, 0.5f },	   { 3, 1000, 0, 30.0, 0.0, 1.0f / 3 },
		{ 5, 17, 2, 2.0, 1000.0, 0.2f }, { 2, 7, 1, 1.0, 0.0, 1.0f },
		{ 2, 50, 0, 2.0, -500.0, 2.0f },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		int N = cases[ci].N, V = cases[ci].V, ig = cases[ci].ignore;
		size_t NV = (size_t)N * V;
		float dloss = cases[ci].dloss;
		snprintf(where, sizeof(where), "crossentropy case %zu (N=%d V=%d)", ci, N, V);
		int32_t *targets = scratch(sizeof(int32_t) * N);
		for (int n = 0; n < N; n++)
			targets[n] = (ig == 1 || (ig > 1 && n % ig == 1))
					     ? -100
					     : (int32_t)(rng_next() % (uint64_t)V);
		float *logits = frand(NV, cases[ci].scale, cases[ci].shift);
		float *losses = ffill((size_t)N, NAN);
		crossentropy_forward(losses, logits, targets, N, V);
		struct ce_ctx ctx = { to_d(logits, NV), dvec((size_t)N), targets, dloss, N, V };
		double *ref = dvec((size_t)N);
		ref_crossentropy(ref, ctx.logits, targets, N, V);
		expect_close("losses", losses, ref, (size_t)N, FWD_ATOL, FWD_RTOL, FWD);
		for (int n = 0; n < N; n++)
			if (targets[n] == -100)
				CHECK_MSG(losses[n] == 0.0f, "%s: losses[%d] = %g for target -100",
					  where, n, losses[n]);

		double *g = fd_grad(ctx.logits, NV, ce_loss, &ctx);
		float *dlogits = ffill(NV, NAN);
		crossentropy_backward(dlogits, logits, targets, dloss, N, V);
		expect_close("dlogits", dlogits, g, NV, GRAD_ATOL, GRAD_RTOL, GRAD);
		for (int n = 0; n < N; n++)
			if (targets[n] == -100)
				for (int i = 0; i < V; i++)
					CHECK_MSG(dlogits[(size_t)n * V + i] == 0.0f,
						  "%s: dlogits[%d][%d] = %g for target -100", where, n,
						  i, dlogits[(size_t)n * V + i]);

		float *inplace = fcopy(logits, NV);
		crossentropy_backward(inplace, inplace, targets, dloss, N, V);
		expect_same("in-place backward vs out-of-place", inplace, dlogits, NV);
		scratch_free();
	}
}

static void test_adamw(void)
{
	static const struct {
		size_t n;
		float lr, beta1, beta2, eps, wd;
		int t0, warm; /* first step; warm: start from random m, v */
	} cases[] = {
		{ 1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 0 },
		{ 37, 1e-2f, 0.9f, 0.95f, 1e-6f, 0.1f, 1, 0 },
		{ 16, 3e-4f, 0.8f, 0.999f, 1e-8f, 0.0f, 1, 0 },
		{ 64, 5e-3f, 0.9f, 0.999f, 1e-8f, 0.05f, 10, 1 },
	};
	for (size_t ci = 0; ci < sizeof(cases) / sizeof(cases[0]); ci++) {
		size_t n = cases[ci].n;
		double lr = cases[ci].lr, b1 = cases[ci].beta1, b2 = cases[ci].beta2;
		double eps = cases[ci].eps, wd = cases[ci].wd;
		float *p = frand(n, 1.0, 0.0), *m = fvec(n), *v = fvec(n);
		if (cases[ci].warm)
			for (size_t i = 0; i < n; i++) {
				m[i] = (float)(0.01 * urand());
				v[i] = (float)(1e-4 * (1.5 + urand()));
			}
		double *rp = to_d(p, n), *rm = to_d(m, n), *rv = to_d(v, n);
		for (int t = cases[ci].t0; t < cases[ci].t0 + 2; t++) {
			snprintf(where, sizeof(where), "adamw case %zu step %d", ci, t);
			float *g = frand(n, 0.1, 0.0);
			adamw_update(p, g, 1.0f, m, v, n, cases[ci].lr, cases[ci].beta1, cases[ci].beta2,
				     cases[ci].eps, cases[ci].wd, t);
			for (size_t i = 0; i < n; i++) {
				rp[i] *= 1.0 - lr * wd;
				rm[i] = rm[i] + (1.0 - b1) * (g[i] - rm[i]);
				rv[i] = b2 * rv[i] + (1.0 - b2) * g[i] * g[i];
				double denom = sqrt(rv[i]) / sqrt(1.0 - pow(b2, t)) + eps;
				rp[i] -= lr / (1.0 - pow(b1, t)) * rm[i] / denom;
			}
			expect_close("param", p, rp, n, 1e-6, 1e-6, FWD);
			expect_close("m", m, rm, n, 1e-9, 1e-6, FWD);
			expect_close("v", v, rv, n, 1e-12, 1e-6, FWD);
		}
		/* gscale (a clip's coefficient): the same bits as the gradients
		 * scaled first (scale_inplace) and stepped with gscale 1 */
		for (int k = 0; k < 2; k++) {
			const float s = k ? 0.3712f : 1.0f / 3.0f;
			snprintf(where, sizeof(where), "adamw case %zu gscale %g", ci, s);
			float *g = frand(n, 0.1, 0.0), *gs = malloc(n * sizeof(float));
			float *p2 = malloc(n * sizeof(float)), *m2 = malloc(n * sizeof(float));
			float *v2 = malloc(n * sizeof(float));
			memcpy(gs, g, n * sizeof(float));
			memcpy(p2, p, n * sizeof(float));
			memcpy(m2, m, n * sizeof(float));
			memcpy(v2, v, n * sizeof(float));
			scale_inplace(gs, s, n);
			const int t = cases[ci].t0 + 2;
			adamw_update(p, g, s, m, v, n, cases[ci].lr, cases[ci].beta1, cases[ci].beta2,
				     cases[ci].eps, cases[ci].wd, t);
			adamw_update(p2, gs, 1.0f, m2, v2, n, cases[ci].lr, cases[ci].beta1,
				     cases[ci].beta2, cases[ci].eps, cases[ci].wd, t);
			CHECK_MSG(memcmp(p, p2, n * sizeof(float)) == 0 &&
					  memcmp(m, m2, n * sizeof(float)) == 0 &&
					  memcmp(v, v2, n * sizeof(float)) == 0,
				  "%s: not the bits of scale_inplace then adamw_update", where);
			free(gs), free(p2), free(m2), free(v2);
		}
		scratch_free();
	}
}

/* bf16_round and bf16_widen: every bf16 value survives widening and rounding
 * unchanged (a bf16 checkpoint loads without rounding); ties go to even,
 * carries ripple into the exponent (to infinity at the top), NaNs become
 * the canonical 0x7fff (CUDA's cvt.rn.bf16.f32), and widening runs in place
 * over the second half of its output as the contract allows. */
static void test_bf16(void)
{
	uint16_t *h = malloc(65536 * sizeof(uint16_t)), *back = malloc(65536 * sizeof(uint16_t));
	float *w = malloc(65536 * sizeof(float));
	for (uint32_t i = 0; i < 65536; i++)
		h[i] = (uint16_t)i;
	bf16_widen(w, h, 65536);
	bf16_round(back, w, 65536);
	size_t bad = 0;
	for (uint32_t i = 0; i < 65536; i++) {
		uint32_t u;
		memcpy(&u, &w[i], sizeof(u));
		bool nan = (i & 0x7fffu) > 0x7f80u;
		bad += u != i << 16 || back[i] != (nan ? 0x7fffu : i);
	}
	CHECK_EQ_INT(bad, 0);
	static const struct {
		uint32_t in;
		uint16_t out;
	} cases[] = {
		{0x3f808000u, 0x3f80u}, /* a tie, even below: down */
		{0x3f818000u, 0x3f82u}, /* a tie, odd below: up */
		{0x3f808001u, 0x3f81u}, /* above the tie: up */
		{0x3f807fffu, 0x3f80u}, /* below it: down */
		{0x3fffffffu, 0x4000u}, /* the carry reaches the exponent */
		{0x7f7fffffu, 0x7f80u}, /* the largest float: infinity */
		{0xff7fffffu, 0xff80u},
		{0x7f800000u, 0x7f80u},
		{0x00000001u, 0x0000u}, /* the smallest subnormal: zero */
		{0x80008000u, 0x8000u}, /* -0 and a subnormal tie */
		{0x7fc00000u, 0x7fffu},
		{0xffc00001u, 0x7fffu},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		float x;
		uint16_t r;
		memcpy(&x, &cases[i].in, sizeof(x));
		bf16_round(&r, &x, 1);
		CHECK_MSG(r == cases[i].out, "bf16_round(%#x) = %#x, want %#x", cases[i].in, r,
			  cases[i].out);
	}
	/* in place: the bf16 values in the upper half of the output's bytes */
	memcpy((uint16_t *)w + 65536, h, 65536 * sizeof(uint16_t));
	bf16_widen(w, (uint16_t *)w + 65536, 65536);
	bad = 0;
	for (uint32_t i = 0; i < 65536; i++) {
		uint32_t u;
		memcpy(&u, &w[i], sizeof(u));
		bad += u != i << 16;
	}
	CHECK_EQ_INT(bad, 0);
	free(h);
	free(back);
	free(w);
}

int main(void)
{
	test_bf16();
	test_embedding();
	test_rmsnorm();
	test_matmul();
	test_rope_cache();
	test_rope();
	test_attention();
	test_swiglu();
	test_elementwise();
	test_crossentropy();
	test_adamw();
	static const char *names[NKIND] = { "forward", "gradients" };
	for (int kd = 0; kd < NKIND; kd++)
		fprintf(stderr, "max %s error: abs %.3g (%s), rel %.3g (%s)\n", names[kd],
			max_abs_err[kd], max_abs_at[kd], max_rel_err[kd], max_rel_at[kd]);
	return check_status();
}
