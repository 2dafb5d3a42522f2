/* GPU test of the CUDA backend's math ops: every op of gpu/backend.h's math
 * section, run through the CUDA backend's ops table, against the CPU reference
 * op of kernels/cpu/ops.h on the same inputs.
 *
 * Each op has a table of shapes: the small GQA case (B=2 T=5 NH=4 NKV=2 HS=8),
 * NKV == NH, T = 1, odd sizes (C = 67), sizes that cross the kernels' warp,
 * block and part boundaries, and a larger one (B=4 T=256 NH=8 HS=64). Inputs
 * come from a fixed-seed PRNG, never zeros. The header's contract is checked
 * too: outputs the op overwrites are pre-filled with NaN, outputs it
 * accumulates into with random values, NULL outputs are skipped, the aliasing
 * the header allows is run in place, and targets of -100 give zeros. Ops with
 * a reduction are run twice to show the GPU result is the same bits each time.
 *
 * Tolerances, |gpu - cpu| <= atol + rtol*|cpu|:
 * - exact: ops whose kernels do the CPU op's float arithmetic in its order
 *   (no FMA contraction, IEEE sqrt and division): embedding, rope, residual,
 *   scale, AdamW, the dequantizers, dropout. Any difference is a bug.
 * - FWD 1e-5 + 1e-4|ref|: elementwise ops with expf (CUDA's and glibc's
 *   expf each round within 2 ulp).
 * - RED 5e-5*sqrt(max(1, K/1000)) + 1e-4|ref|: outputs that are sums of K
 *   terms formed in another order or precision — cuBLAS versus OpenBLAS
 *   SGEMMs, fp32 row and column sums on the GPU versus the CPU's double (or
 *   sequential fp32) ones. With O(1) inputs the rounding differences grow
 *   like sqrt(K) ulp of the partial sums: ~1e-5 at K = 1000, hence atol
 *   5e-5 there, growing as sqrt(K) beyond.
 * - SOFT 1e-9 + 1e-4|ref|: softmax gradients (cross-entropy), whose values
 *   reach 1e-9 but are products, so their error is relative.
 * - distillation gradients: 1e-4|ref| + 1e-5 * max|ref| of the row block,
 *   since q - p cancels and the error follows the larger terms.
 * - sumsq: relative 1e-10 (both sum in double).
 *
 * Skips (exit 77) when the CUDA backend cannot be opened (no module, no
 * driver, no device). Not a benchmark: see tests/bench. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "gpu/select.h"
#include "kernels/cpu/ops.h"
#include "tests/check.h"

#define FWD_ATOL 1e-5
#define FWD_RTOL 1e-4
#define RED_ATOL 5e-5
#define RED_RTOL 1e-4
#define SOFT_ATOL 1e-9
#define SOFT_RTOL 1e-4
#define SUMSQ_RTOL 1e-10

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static struct gpu_backend *be;
static char where[128]; /* the case being run, for failure messages */

/* Worst error of the current op, over its cases: reported per op. */
static double op_max_abs, op_max_ratio;
static int op_arrays;
static char op_worst[160];

/* ------------------------------------------------------------ helpers -- */

static uint64_t rng_state = 0x6375646174657374ULL;

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

/* Host and device allocations of a case, freed together by case_end(). */
static void *host_tracked[256];
static int nhost;
static struct {
	void *p;
	size_t bytes;
} dev_tracked[256];
static int ndev;

static void *hmem(size_t bytes)
{
	if (nhost == (int)COUNT(host_tracked)) {
		fprintf(stderr, "test_cuda_ops: host table full\n");
		abort();
	}
	void *p = calloc(1, bytes ? bytes : 1);
	if (!p) {
		fprintf(stderr, "test_cuda_ops: out of host memory (%zu bytes)\n", bytes);
		abort();
	}
	return host_tracked[nhost++] = p;
}

static void *dmem(size_t bytes)
{
	if (ndev == (int)COUNT(dev_tracked)) {
		fprintf(stderr, "test_cuda_ops: device table full\n");
		abort();
	}
	void *p = NULL;
	if (gpu_alloc(be, bytes, &p) != TD_OK) {
		fprintf(stderr, "test_cuda_ops: gpu_alloc(%zu) failed\n", bytes);
		abort();
	}
	dev_tracked[ndev].p = p;
	dev_tracked[ndev].bytes = bytes;
	ndev++;
	return p;
}

static float *fvec(size_t n)
{
	return hmem(n * sizeof(float));
}

static float *frand(size_t n, double scale, double offset)
{
	float *x = fvec(n);
	for (size_t i = 0; i < n; i++)
		x[i] = (float)(offset + scale * urand());
	return x;
}

static float *ffill(size_t n, float value)
{
	float *x = fvec(n);
	for (size_t i = 0; i < n; i++)
		x[i] = value;
	return x;
}

static float *fcopy(const float *x, size_t n)
{
	float *y = fvec(n);
	memcpy(y, x, n * sizeof(float));
	return y;
}

/* A device copy of host data. */
static void *dput(const void *h, size_t bytes)
{
	void *d = dmem(bytes);
	gpu_upload(be, d, h, bytes);
	return d;
}

static float *dputf(const float *h, size_t n)
{
	return dput(h, n * sizeof(float));
}

/* A device buffer of n floats, all NaN: for outputs the op must overwrite. */
static float *dnan(size_t n)
{
	float *h = ffill(n, NAN);
	return dputf(h, n);
}

/* A host copy of n device floats. */
static float *hget(const float *d, size_t n)
{
	float *h = fvec(n);
	gpu_download(be, h, d, n * sizeof(float));
	return h;
}

/* n bf16 values from the device, widened (exactly) to floats. */
static float *hget16(const gpu_bf16 *d, size_t n)
{
	uint16_t *h16 = hmem(n * sizeof(uint16_t));
	gpu_download(be, h16, d, n * sizeof(uint16_t));
	float *h = fvec(n);
	for (size_t i = 0; i < n; i++) {
		uint32_t bits = (uint32_t)h16[i] << 16;
		memcpy(&h[i], &bits, sizeof(bits));
	}
	return h;
}

/* Reports a device error of the op just run; one is fatal to the context, so
 * the test stops there. */
static void synced(const char *op)
{
	struct td_errbuf eb = {{0}};
	if (gpu_sync(be, &eb) != TD_OK) {
		fprintf(stderr, "%s: %s: device error: %s\n", where, op, eb.msg);
		exit(1);
	}
}

static void case_end(void)
{
	synced("case end");
	while (ndev > 0) {
		ndev--;
		gpu_free(be, dev_tracked[ndev].p, dev_tracked[ndev].bytes);
	}
	while (nhost > 0)
		free(host_tracked[--nhost]);
}

/* Every |got - ref| <= atol + rtol*|ref| + frac*max|ref|; NaN fails. On
 * failure prints the worst element with both values and the count. */
static void expect_close_scaled(const char *what, const float *got, const float *ref, size_t n,
				double atol, double rtol, double frac)
{
	double refmax = 0.0;
	for (size_t i = 0; i < n; i++)
		refmax = fabs((double)ref[i]) > refmax ? fabs((double)ref[i]) : refmax;
	size_t bad = 0, worst = 0;
	double worst_ratio = -1.0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - (double)ref[i]);
		double tol = atol + rtol * fabs((double)ref[i]) + frac * refmax;
		double ratio = isnan(d) ? INFINITY : tol > 0.0 ? d / tol : (d > 0.0 ? INFINITY : 0.0);
		if (!(d <= tol))
			bad++;
		if (ratio > worst_ratio) {
			worst_ratio = ratio;
			worst = i;
		}
		if (d > op_max_abs)
			op_max_abs = d;
	}
	if (worst_ratio > op_max_ratio) {
		op_max_ratio = worst_ratio;
		snprintf(op_worst, sizeof(op_worst), "%s %s", where, what);
	}
	op_arrays++;
	CHECK_MSG(bad == 0,
		  "%s: %s: %zu of %zu outside %.0e + %.0e|ref| + %.0e max|ref|; worst [%zu] gpu %.9g cpu %.9g",
		  where, what, bad, n, atol, rtol, frac, worst, n ? got[worst] : 0.0,
		  n ? ref[worst] : 0.0);
}

static void expect_close(const char *what, const float *got, const float *ref, size_t n,
			 double atol, double rtol)
{
	expect_close_scaled(what, got, ref, n, atol, rtol, 0.0);
}

/* An output whose elements are sums of K terms (the RED tolerance). */
static void expect_red(const char *what, const float *got, const float *ref, size_t n, double K)
{
	double atol = RED_ATOL * sqrt(K > 1000.0 ? K / 1000.0 : 1.0);
	expect_close_scaled(what, got, ref, n, atol, RED_RTOL, 0.0);
}

/* Equal values (bit-identical up to the sign of zero); NaN fails. */
static void expect_exact(const char *what, const float *got, const float *ref, size_t n)
{
	expect_close_scaled(what, got, ref, n, 0.0, 0.0, 0.0);
}

/* The same bits: a GPU op run twice on the same inputs. */
static void expect_same_bits(const char *what, const float *a, const float *b, size_t n)
{
	CHECK_MSG(memcmp(a, b, n * sizeof(float)) == 0, "%s: %s differs between two runs", where,
		  what);
}

static void op_begin(void)
{
	op_max_abs = 0.0;
	op_max_ratio = 0.0;
	op_arrays = 0;
	op_worst[0] = '\0';
}

static void op_report(const char *op)
{
	fprintf(stderr, "%-16s %3d arrays, max |gpu-cpu| %.3g, worst err/tol %.3g (%s)\n", op,
		op_arrays, op_max_abs, op_max_ratio, op_worst[0] ? op_worst : "-");
}

static int32_t *ids_rand(int N, int V)
{
	int32_t *ids = hmem(sizeof(int32_t) * (size_t)N);
	for (int n = 0; n < N; n++)
		ids[n] = (int32_t)(rng_next() % (uint64_t)V);
	return ids;
}

/* ---------------------------------------------------------------- tests -- */

static void test_embedding(void)
{
	/* V=1 and V=7: every row, or most, repeat an id (the deterministic
	 * scatter's hard case); V=50000: few repeats. N above the sort's
	 * 2048-key chunk, not a power of two, takes its global passes
	 * (5000: P 8192; 20000: P 32768, Qwen2's vocabulary); N = 600000 has
	 * more keys than the reduction scratch holds (512K) and takes the
	 * scanned scatter. */
	static const struct { int N, C, V; } cases[] = {
		{ 1, 1, 1 }, { 5, 8, 3 }, { 40, 67, 7 }, { 300, 96, 1 }, { 2048, 256, 50 },
		{ 1024, 128, 50000 }, { 5000, 40, 7 }, { 20000, 24, 151936 }, { 4097, 33, 1 },
		{ 600000, 1, 1000 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int N = cases[ci].N, C = cases[ci].C, V = cases[ci].V;
		size_t nout = (size_t)N * C, nw = (size_t)V * C;
		snprintf(where, sizeof(where), "embedding (N=%d C=%d V=%d)", N, C, V);
		int32_t *ids = ids_rand(N, V);
		float *wte = frand(nw, 1.0, 0.0);
		int32_t *d_ids = dput(ids, sizeof(int32_t) * (size_t)N);

		float *out = fvec(nout);
		embedding_forward(out, ids, wte, N, C);
		float *d_out = dnan(nout);
		gpu_embedding_forward(be, d_out, d_ids, dputf(wte, nw), NULL, N, C);
		expect_exact("out", hget(d_out, nout), out, nout);

		/* A table stored in bf16 only: its rows widened exactly. */
		uint16_t *wte16 = hmem(nw * sizeof(uint16_t));
		float *wide = fvec(nw);
		bf16_round(wte16, wte, nw);
		bf16_widen(wide, wte16, nw);
		embedding_forward(out, ids, wide, N, C);
		d_out = dnan(nout);
		gpu_embedding_forward(be, d_out, d_ids, NULL, dput(wte16, nw * sizeof(uint16_t)), N,
				      C);
		expect_exact("out (bf16 table)", hget(d_out, nout), out, nout);

		/* Accumulates into random values, in the CPU's order. */
		float *dout = frand(nout, 1.0, 0.0);
		float *dwte0 = frand(nw, 1.0, 0.0);
		float *dwte = fcopy(dwte0, nw);
		embedding_backward(dwte, dout, ids, N, C);
		float *d_dout = dputf(dout, nout);
		float *d_dwte = dputf(dwte0, nw);
		gpu_embedding_backward(be, d_dwte, d_dout, d_ids, N, C);
		expect_exact("dwte", hget(d_dwte, nw), dwte, nw);

		/* A part of the table (data parallel's rows, train/ddp.h) that cuts
		 * rows at both ends: the backward in the CPU's order (exact), the
		 * lookup of the part's elements and zeros elsewhere (exact). */
		size_t lo = nw / 3 + (C > 2 ? (size_t)C / 2 : 0), hi = 2 * nw / 3 + 1;
		if (hi > nw)
			hi = nw;
		if (lo >= hi) /* one row (V 1): a part inside it */
			lo = nw / 3;
		float *pw = fcopy(dwte0 + lo, hi - lo);
		embedding_backward_part(pw, dout, ids, N, C, lo, hi);
		float *d_pw = dputf(dwte0 + lo, hi - lo);
		gpu_embedding_backward_part(be, d_pw, d_dout, d_ids, N, C, lo, hi);
		expect_exact("dwte part", hget(d_pw, hi - lo), pw, hi - lo);
		embedding_forward_part(out, ids, wte + lo, N, C, lo, hi);
		d_out = dnan(nout);
		gpu_embedding_forward_part(be, d_out, d_ids, dputf(wte + lo, hi - lo), N, C, lo, hi);
		expect_exact("out part", hget(d_out, nout), out, nout);
		case_end();
	}
	op_report("embedding");
}

static gpu_bf16 *dnan16(size_t n);
static void expect_twin(const char *what, const gpu_bf16 *d16, const float *f32, size_t n);

static void test_rmsnorm(void)
{
	/* C a multiple of 4 up to 1024 takes the warp-a-row forward, a lane
	 * holding V float4s of a row: V 1 ({5, 8}, {33, 36}: 9 of the 32
	 * lanes; {3000, 128}: Qwen3's per-head norm), 2 ({1024, 256}), 4
	 * ({77, 512}), 8 ({64, 896}, {2048, 896}, {8192, 896}: Qwen2-0.5B's
	 * B8 x T1024; {1000, 1024}: every lane's 8); up to 256 (V 1 and 2) the
	 * warp-a-row backward too, dweight as partial rows, one a block of 8
	 * warps. Other C a multiple of 4 take the block-a-row one-pass
	 * backward ({64, 896}, {8192, 896}; {3000, 4096}: the scratch holds
	 * 256 partial rows, ~12 a block). Otherwise
	 * the separate column sum: N >= 256 splits it into parts (when the
	 * backend's scratch has room); N < 128 keeps one. A block-a-row thread
	 * holds two float4s at 4096, four at 6144 (three used) and 8192: each
	 * kernel of the backward's. */
	static const struct { int N, C; } cases[] = {
		{ 1, 1 }, { 5, 8 }, { 10, 67 }, { 64, 896 }, { 1024, 256 }, { 300, 4096 },
		{ 4100, 33 }, { 2048, 896 }, { 3000, 4096 }, { 64, 6144 }, { 300, 8192 },
		{ 33, 36 }, { 3000, 128 }, { 77, 512 }, { 8192, 896 }, { 1000, 1024 },
	};
	const float eps = 1e-6f;
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int N = cases[ci].N, C = cases[ci].C;
		size_t nx = (size_t)N * C;
		snprintf(where, sizeof(where), "rmsnorm (N=%d C=%d)", N, C);
		float *inp = frand(nx, 2.0, 0.0);
		float *weight = frand((size_t)C, 0.5, 1.0);
		float *out = fvec(nx), *rstd = fvec((size_t)N);
		rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
		float *d_inp = dputf(inp, nx), *d_weight = dputf(weight, (size_t)C);
		float *d_out = dnan(nx), *d_rstd = dnan((size_t)N);
		gpu_rmsnorm_forward(be, d_out, NULL, d_rstd, d_inp, d_weight, N, C, eps);
		expect_close("out", hget(d_out, nx), out, nx, FWD_ATOL, FWD_RTOL);
		expect_close("rstd", hget(d_rstd, (size_t)N), rstd, (size_t)N, FWD_ATOL, FWD_RTOL);

		/* Backward from the CPU's rstd; dinp and dweight accumulate. */
		float *dout = frand(nx, 1.0, 0.0);
		float *dinp0 = frand(nx, 1.0, 0.0), *dw0 = frand((size_t)C, 1.0, 0.0);
		float *dinp = fcopy(dinp0, nx), *dw = fcopy(dw0, (size_t)C);
		rmsnorm_backward(dinp, dw, dout, inp, weight, rstd, N, C);
		float *d_dout = dputf(dout, nx), *d_rstd_ref = dputf(rstd, (size_t)N);
		float *d_dinp = dputf(dinp0, nx), *d_dw = dputf(dw0, (size_t)C);
		/* with dinp's twin: the new values rounded */
		gpu_bf16 *d_t16 = dnan16(nx);
		gpu_rmsnorm_backward(be, d_dinp, d_t16, d_dw, d_dout, d_inp, d_weight, d_rstd_ref, N, C);
		float *g_dw = hget(d_dw, (size_t)C), *g_dinp = hget(d_dinp, nx);
		expect_red("dinp", g_dinp, dinp, nx, C);
		expect_red("dweight", g_dw, dw, (size_t)C, N);
		expect_twin("dinp16", d_t16, g_dinp, nx);

		/* Determinism, without the twin: the same bits. */
		gpu_upload(be, d_dw, dw0, sizeof(float) * (size_t)C);
		gpu_upload(be, d_dinp, dinp0, sizeof(float) * nx);
		gpu_rmsnorm_backward(be, d_dinp, NULL, d_dw, d_dout, d_inp, d_weight, d_rstd_ref, N, C);
		expect_same_bits("dweight", hget(d_dw, (size_t)C), g_dw, (size_t)C);
		expect_same_bits("dinp (no twin)", hget(d_dinp, nx), g_dinp, nx);
		/* dweight NULL (dinp alone), the twin a value past 8-byte
		 * alignment (its values a store each) */
		float *dinp_only = fcopy(dinp0, nx);
		rmsnorm_backward(dinp_only, NULL, dout, inp, weight, rstd, N, C);
		gpu_upload(be, d_dinp, dinp0, sizeof(float) * nx);
		gpu_bf16 *d_u16 = dnan16(nx + 1) + 1;
		gpu_rmsnorm_backward(be, d_dinp, d_u16, NULL, d_dout, d_inp, d_weight, d_rstd_ref, N, C);
		float *g_only = hget(d_dinp, nx);
		expect_red("dinp (dweight NULL)", g_only, dinp_only, nx, C);
		expect_twin("dinp16 (unaligned)", d_u16, g_only, nx);
		synced("rmsnorm_backward");
		case_end();
	}
	op_report("rmsnorm");
}

static void test_matmul(void)
{
	static const struct { int N, C, OC; } cases[] = {
		{ 1, 1, 1 }, { 5, 8, 16 }, { 7, 67, 33 }, { 64, 128, 96 }, { 300, 896, 1152 },
		{ 1024, 256, 512 }, { 4100, 64, 40 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int N = cases[ci].N, C = cases[ci].C, OC = cases[ci].OC;
		size_t nin = (size_t)N * C, nout = (size_t)N * OC, nw = (size_t)OC * C;
		snprintf(where, sizeof(where), "matmul (N=%d C=%d OC=%d)", N, C, OC);
		float *inp = frand(nin, 1.0, 0.0), *weight = frand(nw, 1.0, 0.0);
		float *bias = frand((size_t)OC, 1.0, 0.0);
		float *d_inp = dputf(inp, nin), *d_weight = dputf(weight, nw);
		float *d_bias = dputf(bias, (size_t)OC);
		for (int with_bias = 0; with_bias < 2; with_bias++) {
			float *out = fvec(nout);
			matmul_forward(out, inp, weight, with_bias ? bias : NULL, N, C, OC);
			float *d_out = dnan(nout);
			gpu_matmul_forward(be, d_out, NULL, d_inp, NULL, d_weight, NULL,
					   with_bias ? d_bias : NULL, N, C, OC);
			expect_red(with_bias ? "out (bias)" : "out", hget(d_out, nout), out, nout, C);
		}
		/* out += inp @ weight^T (beta 1): the old value one more term */
		float *acc0 = frand(nout, 1.0, 0.0), *acc = fcopy(acc0, nout);
		matmul_forward_add(acc, inp, weight, N, C, OC);
		float *d_acc = dputf(acc0, nout);
		gpu_matmul_forward_add(be, d_acc, NULL, d_inp, NULL, d_weight, NULL, N, C, OC);
		expect_red("out (add)", hget(d_acc, nout), acc, nout, C + 1);
		/* out = res + inp @ weight^T (the residual stream's add): the same
		 * sums into another buffer, res untouched */
		float *d_res = dputf(acc0, nout), *d_ro = dnan(nout);
		gpu_matmul_forward_residual(be, d_ro, d_res, d_inp, NULL, d_weight, NULL, N, C, OC);
		expect_red("out (residual)", hget(d_ro, nout), acc, nout, C + 1);
		expect_exact("res (the residual's addend)", hget(d_res, nout), acc0, nout);

		/* Backward: all three outputs, then each alone (the others NULL). */
		float *dout = frand(nout, 1.0, 0.0);
		float *d_dout = dputf(dout, nout);
		float *dinp0 = frand(nin, 1.0, 0.0), *dw0 = frand(nw, 1.0, 0.0);
		float *db0 = frand((size_t)OC, 1.0, 0.0);
		float *first_db = NULL;
		for (int mask = 7; mask >= 1; mask = mask == 7 ? 4 : mask >> 1) {
			bool want_in = mask & 4, want_w = mask & 2, want_b = mask & 1;
			float *dinp = fcopy(dinp0, nin), *dw = fcopy(dw0, nw);
			float *db = fcopy(db0, (size_t)OC);
			matmul_backward(want_in ? dinp : NULL, want_w ? dw : NULL, want_b ? db : NULL,
					dout, inp, weight, N, C, OC);
			float *d_dinp = dputf(dinp0, nin), *d_dw = dputf(dw0, nw);
			float *d_db = dputf(db0, (size_t)OC);
			gpu_matmul_backward(be, want_in ? d_dinp : NULL, NULL, want_w ? d_dw : NULL,
					    want_b ? d_db : NULL, d_dout, NULL, d_inp, NULL,
					    d_weight, NULL, N, C, OC, false);
			/* A NULL output is left alone: it still equals its start. */
			char what[64];
			snprintf(what, sizeof(what), "dinp (mask %d)", mask);
			expect_red(what, hget(d_dinp, nin), dinp, nin, OC);
			snprintf(what, sizeof(what), "dweight (mask %d)", mask);
			expect_red(what, hget(d_dw, nw), dw, nw, N);
			snprintf(what, sizeof(what), "dbias (mask %d)", mask);
			float *g_db = hget(d_db, (size_t)OC);
			expect_red(what, g_db, db, (size_t)OC, N);
			if (want_b && first_db)
				expect_same_bits("dbias", g_db, first_db, (size_t)OC);
			if (want_b && !first_db)
				first_db = g_db;
		}
		/* dinp_set: dinp is overwritten, its old values (NaN here) never read */
		float *dset = ffill(nin, 0.0f), *dw_set = fcopy(dw0, nw);
		matmul_backward(dset, dw_set, NULL, dout, inp, weight, N, C, OC);
		float *d_dset = dnan(nin), *d_dw_set = dputf(dw0, nw);
		gpu_matmul_backward(be, d_dset, NULL, d_dw_set, NULL, d_dout, NULL, d_inp, NULL,
				    d_weight, NULL, N, C, OC, true);
		expect_red("dinp (set)", hget(d_dset, nin), dset, nin, OC);
		expect_red("dweight (with dinp set: still added)", hget(d_dw_set, nw), dw_set, nw, N);
		/* GPU_SET_DWEIGHT: dweight overwritten too, its NaNs never read */
		float *dw_over = ffill(nw, 0.0f);
		matmul_backward(NULL, dw_over, NULL, dout, inp, weight, N, C, OC);
		d_dset = dnan(nin);
		float *d_dw_over = dnan(nw);
		gpu_matmul_backward(be, d_dset, NULL, d_dw_over, NULL, d_dout, NULL, d_inp, NULL,
				    d_weight, NULL, N, C, OC, GPU_SET_DINP | GPU_SET_DWEIGHT);
		expect_red("dinp (set, dweight set)", hget(d_dset, nin), dset, nin, OC);
		expect_red("dweight (set)", hget(d_dw_over, nw), dw_over, nw, N);
		case_end();
	}
	op_report("matmul");
}

/* x rounded to bf16, nearest even, back as a float (finite x). */
static float round_bf16(float x)
{
	uint32_t u;
	memcpy(&u, &x, sizeof(u));
	u += 0x7fffu + ((u >> 16) & 1u);
	u &= 0xffff0000u;
	memcpy(&x, &u, sizeof(u));
	return x;
}

static float *bf16_rounded(const float *x, size_t n)
{
	float *y = fvec(n);
	for (size_t i = 0; i < n; i++)
		y[i] = round_bf16(x[i]);
	return y;
}

/* bf16 bits of x (nearest even), as the twins hold them. */
static uint16_t bf16_bits(float x)
{
	float r = round_bf16(x);
	uint32_t u;
	memcpy(&u, &r, sizeof(u));
	return (uint16_t)(u >> 16);
}

/* Every twin equals its fp32 tensor rounded, bit for bit. */
static void expect_twin(const char *what, const gpu_bf16 *d16, const float *f32, size_t n)
{
	uint16_t *got = hmem(n * sizeof(uint16_t));
	gpu_download(be, got, d16, n * sizeof(uint16_t));
	size_t bad = 0, first = 0;
	for (size_t i = 0; i < n; i++)
		if (got[i] != bf16_bits(f32[i]) && bad++ == 0)
			first = i;
	CHECK_MSG(bad == 0, "%s: %s: %zu of %zu values are not the fp32 value rounded (first at %zu: %#x vs %g)",
		  where, what, bad, n, first, bad ? got[first] : 0, bad ? f32[first] : 0.0);
}

static gpu_bf16 *dput16(const float *x, size_t n)
{
	uint16_t *h = hmem(n * sizeof(uint16_t));
	for (size_t i = 0; i < n; i++)
		h[i] = bf16_bits(x[i]);
	return dput(h, n * sizeof(uint16_t));
}

static gpu_bf16 *dnan16(size_t n)
{
	uint16_t *h = hmem(n * sizeof(uint16_t));
	for (size_t i = 0; i < n; i++)
		h[i] = 0x7fc1; /* a NaN */
	return dput(h, n * sizeof(uint16_t));
}

/* The bf16 mode's GEMMs (gpu/cuda/cuda_ops.c: sgemm_, round_into): operands
 * rounded to bf16 (nearest even), products exact in fp32, fp32 accumulation;
 * so the reference is the CPU op on operands rounded on the host, held to the
 * fp32 reduction tolerance (only the order of the additions differs). The
 * weight comes three ways: fp32 alone (rounded into the scratch per call),
 * fp32 with its twin (a trainable weight's copy, made by bf16_round and kept
 * by adamw_update's param16), and bf16 only (a frozen weight: weight NULL).
 * The scratch is exactly what gpu_matmul_scratch_elems says each call needs
 * (at least 1 element): a bf16-only weight has no fallback, so a layout that
 * needed more would fail the stream. */
static void test_matmul_bf16(void)
{
	static const struct { int N, C, OC; } cases[] = {
		{ 5, 8, 16 }, { 7, 67, 33 }, { 300, 896, 1152 }, { 1024, 256, 512 },
	};
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int N = cases[ci].N, C = cases[ci].C, OC = cases[ci].OC;
		size_t nin = (size_t)N * C, nout = (size_t)N * OC, nw = (size_t)OC * C;
		snprintf(where, sizeof(where), "bf16 matmul (N=%d C=%d OC=%d)", N, C, OC);
		/* room for the most any call below is told it has */
		size_t fwd = gpu_matmul_scratch_elems(N, C, OC, false, false, false, false, false, false);
		size_t bwd = gpu_matmul_scratch_elems(N, C, OC, true, true, true, false, false, false);
		void *scratch = dmem(2 * (fwd > bwd ? fwd : bwd));
		float *weight = frand(nw, 1.0, 0.0), *d_weight = dputf(weight, nw);
		float *inp = frand(nin, 1.0, 0.0), *d_inp = dputf(inp, nin);
		float *out = fvec(nout), *d_out = dnan(nout);
		gpu_bf16 *d_w16 = dnan16(nw);
		gpu_bf16_round(be, d_w16, d_weight, nw);
		expect_twin("bf16_round (the weight's copy)", d_w16, weight, nw);
		/* the exact scratch for each call */
#define SCRATCH(bwd, dinp, dw, w16, x16, d16)                                                     \
	do {                                                                                      \
		be->gemm_scratch = scratch;                                                       \
		size_t e_ = gpu_matmul_scratch_elems(N, C, OC, (bwd), (dinp), (dw), (w16), (x16), \
						     (d16));                                       \
		be->gemm_scratch_bytes = 2 * (e_ ? e_ : 1);                                       \
	} while (0)
		matmul_forward(out, bf16_rounded(inp, nin), bf16_rounded(weight, nw), NULL, N, C, OC);
		SCRATCH(false, false, false, false, false, false);
		gpu_matmul_forward(be, d_out, NULL, d_inp, NULL, d_weight, NULL, NULL, N, C, OC);
		expect_red("out (weight rounded per call)", hget(d_out, nout), out, nout, C);
		SCRATCH(false, false, false, true, false, false);
		gpu_matmul_forward(be, d_out, NULL, d_inp, NULL, d_weight, d_w16, NULL, N, C, OC);
		expect_red("out (the weight's copy)", hget(d_out, nout), out, nout, C);
		gpu_matmul_forward(be, d_out, NULL, d_inp, NULL, NULL, d_w16, NULL, N, C, OC);
		expect_red("out (bf16-only weight)", hget(d_out, nout), out, nout, C);
		gpu_bf16 *d_inp16 = dput16(inp, nin);
		SCRATCH(false, false, false, true, true, false);
		float *d_out2 = dnan(nout);
		gpu_matmul_forward(be, d_out2, NULL, NULL, d_inp16, NULL, d_w16, NULL, N, C, OC);
		expect_same_bits("out (both twins, no scratch)", hget(d_out2, nout), hget(d_out, nout),
				 nout);
		/* a bias (Qwen2's q, k, v): added by the GEMM's epilogue in
		 * the bf16 mode (cuda_ops.c: forward_bias); against the CPU's
		 * product plus the bias (a sum of C + 1 terms), and run twice:
		 * the same bits (timed or not, the reference's) */
		float *bias = frand((size_t)OC, 1.0, 0.0), *d_bias = dputf(bias, (size_t)OC);
		float *outb = fvec(nout);
		matmul_forward(outb, bf16_rounded(inp, nin), bf16_rounded(weight, nw), bias, N, C, OC);
		SCRATCH(false, false, false, true, false, false);
		float *d_ob = dnan(nout);
		gpu_matmul_forward(be, d_ob, NULL, d_inp, NULL, d_weight, d_w16, d_bias, N, C, OC);
		float *gb = hget(d_ob, nout);
		expect_red("out (bias)", gb, outb, nout, C + 1);
		gpu_matmul_forward(be, d_ob, NULL, d_inp, NULL, d_weight, d_w16, d_bias, N, C, OC);
		expect_same_bits("out (bias, again)", hget(d_ob, nout), gb, nout);
		SCRATCH(false, false, false, true, true, false);
		gpu_matmul_forward(be, d_ob, NULL, NULL, d_inp16, NULL, d_w16, d_bias, N, C, OC);
		expect_red("out (bias, both twins)", hget(d_ob, nout), outb, nout, C + 1);
		/* the add (LoRA's B product): a bf16-only weight, the fp32 input
		 * rounded into the scratch */
		float *acc0 = frand(nout, 1.0, 0.0), *acc = fcopy(acc0, nout);
		matmul_forward_add(acc, bf16_rounded(inp, nin), bf16_rounded(weight, nw), N, C, OC);
		SCRATCH(false, false, false, true, false, false);
		float *d_acc = dputf(acc0, nout);
		gpu_matmul_forward_add(be, d_acc, NULL, d_inp, NULL, NULL, d_w16, N, C, OC);
		expect_red("out (add, bf16-only weight)", hget(d_acc, nout), acc, nout, C + 1);
		/* the residual stream's add (cuBLASLt: its addend apart from its
		 * output), the input rounded into the scratch, then both twins */
		float *d_res = dputf(acc0, nout), *d_ro = dnan(nout);
		gpu_matmul_forward_residual(be, d_ro, d_res, d_inp, NULL, NULL, d_w16, N, C, OC);
		expect_red("out (residual, bf16-only weight)", hget(d_ro, nout), acc, nout, C + 1);
		expect_exact("res (the residual's addend)", hget(d_res, nout), acc0, nout);
		SCRATCH(false, false, false, true, true, false);
		float *d_ro2 = dnan(nout);
		gpu_matmul_forward_residual(be, d_ro2, d_res, NULL, d_inp16, NULL, d_w16, N, C, OC);
		expect_red("out (residual, both twins)", hget(d_ro2, nout), acc, nout, C + 1);
		SCRATCH(false, false, false, true, false, false);
		/* ...onto a bf16 out (a LoRA gate/up): the old bf16 values widened,
		 * the fp32 product added, the sum rounded once — the CPU's fp32 sum
		 * to within one bf16 step (rounding, and another kernel's order of
		 * the C + 1 terms), as for the bf16 product above */
		float *acc16 = bf16_rounded(acc0, nout), *acc16_ref = fcopy(acc16, nout);
		matmul_forward_add(acc16_ref, bf16_rounded(inp, nin), bf16_rounded(weight, nw), N, C,
				   OC);
		gpu_bf16 *d_acc16 = dput16(acc0, nout);
		gpu_matmul_forward_add(be, NULL, d_acc16, d_inp, NULL, NULL, d_w16, N, C, OC);
		expect_close_scaled("out16 (add onto bf16, bf16-only weight)", hget16(d_acc16, nout),
				    acc16_ref, nout, 0.0, 1.0 / 128, 1e-3);

		/* an optimizer step writes the weight's copy with the new values */
		float *g = frand(nw, 1.0, 0.0), *zeros = ffill(nw, 0.0f);
		float *d_g = dputf(g, nw), *d_m = dputf(zeros, nw), *d_v = dputf(zeros, nw);
		gpu_adamw_update(be, d_weight, d_w16, d_g, 1.0f, d_m, d_v, nw, 1e-2f, 0.9f, 0.999f,
				 1e-8f, 0.0f, 1);
		float *w2 = hget(d_weight, nw);
		CHECK_MSG(memcmp(w2, weight, nw * sizeof(float)) != 0, "%s: adamw changed nothing", where);
		expect_twin("adamw_update's param16", d_w16, w2, nw);
		SCRATCH(false, false, false, true, false, false);
		matmul_forward(out, bf16_rounded(inp, nin), bf16_rounded(w2, nw), NULL, N, C, OC);
		gpu_matmul_forward(be, d_out, NULL, d_inp, NULL, d_weight, d_w16, NULL, N, C, OC);
		expect_red("out (after adamw)", hget(d_out, nout), out, nout, C);

		/* backward: dinp and dweight share dout's rounding; the weight
		 * rounded per call, its copy, or bf16 only (dinp alone: frozen) */
		float *dout = frand(nout, 1.0, 0.0), *d_dout = dputf(dout, nout);
		float *dinp = ffill(nin, 0.5f), *dw = ffill(nw, 0.25f), *dinp_only = ffill(nin, 0.5f);
		matmul_backward(dinp, dw, NULL, bf16_rounded(dout, nout), bf16_rounded(inp, nin),
				bf16_rounded(w2, nw), N, C, OC);
		matmul_backward(dinp_only, NULL, NULL, bf16_rounded(dout, nout), bf16_rounded(inp, nin),
				bf16_rounded(w2, nw), N, C, OC);
		for (int how = 0; how < 3; how++) {
			static const char *const hows[] = {"rounded per call", "copy", "bf16 only"};
			float *d_dinp = dputf(ffill(nin, 0.5f), nin), *d_dw = dputf(ffill(nw, 0.25f), nw);
			bool frozen = how == 2;
			SCRATCH(true, true, !frozen, how > 0, false, false);
			gpu_matmul_backward(be, d_dinp, NULL, frozen ? NULL : d_dw, NULL, d_dout,
					    NULL, d_inp, NULL, frozen ? NULL : d_weight,
					    how ? d_w16 : NULL, N, C, OC, false);
			char what[64];
			snprintf(what, sizeof(what), "dinp (%s)", hows[how]);
			expect_red(what, hget(d_dinp, nin), frozen ? dinp_only : dinp, nin, OC);
			if (!frozen) {
				snprintf(what, sizeof(what), "dweight (%s)", hows[how]);
				expect_red(what, hget(d_dw, nw), dw, nw, N);
			}
		}
#undef SCRATCH
		synced("bf16 matmul");
		be->gemm_scratch = NULL;
		be->gemm_scratch_bytes = 0;
		case_end();
	}
	op_report("bf16 matmul");
	CHECK_EQ_INT(gpu_set_bf16(be, false, &eb), TD_OK);
}

/* The bf16 mode's products go through cuBLASLt, each shape's algorithm
 * timed at its first call (gpu/cuda/cuda_ops.c: lt_tune) and the fastest
 * kept of those that give the reference's bits (cublasGemmEx's default;
 * for the residual add, cuBLASLt's first). So the timed call, the next
 * (the kept algorithm, with no timing) and the reference alone
 * (TD_CUDA_NO_GEMM_TUNE=1) give the same bits, whatever the clock chose:
 * checked on model-sized shapes, where
 * cuBLASLt offers several algorithms (Qwen2-0.5B's gate/up, down and o
 * with its residual, at 2048 rows), fp32 and bf16 outputs, and a sample of
 * each output against the host's double sums of the same bf16 products
 * (the fp32 reduction bound over C terms). */
/* matmul_backward_ld16 (an adapter's products over the q, k, v gradients'
 * rows that attention_backward_rope16 rounds): dout a column block of a
 * wider bf16 matrix, read in place. Against matmul_backward given the same
 * values as a dense twin, and as fp32 values that round to them: the same
 * bits (the same bf16 operands into the same products), with dinp and
 * dweight set and with dweight added to. */
static void test_matmul_ld16(void)
{
	static const struct { int N, C, OC, W, c0; } cases[] = {
		{ 300, 16, 896, 1152, 0 }, { 300, 16, 128, 1152, 1024 }, { 1024, 64, 256, 512, 128 },
		{ 8192, 16, 896, 1152, 0 },
	};
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		const int N = cases[ci].N, C = cases[ci].C, OC = cases[ci].OC, W = cases[ci].W;
		const int c0 = cases[ci].c0;
		snprintf(where, sizeof(where), "matmul_backward_ld16 (N=%d C=%d OC=%d, columns %d.. of %d)",
			 N, C, OC, c0, W);
		const size_t nx = (size_t)N * C, nw = (size_t)OC * C, nd = (size_t)N * OC;
		be->gemm_scratch_bytes =
			2 * gpu_matmul_scratch_elems(N, C, OC, true, true, true, true, false, false);
		be->gemm_scratch = dmem(be->gemm_scratch_bytes);
		float *full = frand((size_t)N * W, 2.0, -1.0), *block = fvec(nd);
		for (int r = 0; r < N; r++)
			memcpy(block + (size_t)r * OC, full + (size_t)r * W + c0, (size_t)OC * sizeof(float));
		gpu_bf16 *d_full16 = dput16(full, (size_t)N * W), *d_block16 = dput16(block, nd);
		float *d_block = dputf(block, nd);
		float *inp = frand(nx, 2.0, -1.0), *w = frand(nw, 2.0, -1.0), *dw0 = frand(nw, 1.0, 0.0);
		float *d_inp = dputf(inp, nx);
		gpu_bf16 *d_w16 = dput16(w, nw);
		for (int set = 0; set < 2; set++) {
			const unsigned flags = GPU_SET_DINP | (set ? GPU_SET_DWEIGHT : 0u);
			float *d_dx[3], *d_dw[3];
			for (int k = 0; k < 3; k++) {
				d_dx[k] = dnan(nx);
				d_dw[k] = set ? dnan(nw) : dputf(dw0, nw);
			}
			gpu_matmul_backward_ld16(be, d_dx[0], d_dw[0], d_full16 + c0, (size_t)W, d_inp, NULL,
						 NULL, d_w16, N, C, OC, flags, 1.0f);
			gpu_matmul_backward(be, d_dx[1], NULL, d_dw[1], NULL, NULL, d_block16, d_inp, NULL,
					    NULL, d_w16, N, C, OC, flags);
			gpu_matmul_backward(be, d_dx[2], NULL, d_dw[2], NULL, d_block, NULL, d_inp, NULL,
					    NULL, d_w16, N, C, OC, flags);
			float *x0 = hget(d_dx[0], nx), *w0 = hget(d_dw[0], nw);
			CHECK_MSG(memcmp(x0, hget(d_dx[1], nx), nx * sizeof(float)) == 0 &&
					  memcmp(w0, hget(d_dw[1], nw), nw * sizeof(float)) == 0,
				  "%s: not the dense twin's bits (dweight %s)", where, set ? "set" : "added to");
			CHECK_MSG(memcmp(x0, hget(d_dx[2], nx), nx * sizeof(float)) == 0 &&
					  memcmp(w0, hget(d_dw[2], nw), nw * sizeof(float)) == 0,
				  "%s: not the fp32 gradient's bits (dweight %s)", where,
				  set ? "set" : "added to");
			/* and right: the CPU's product of the same bf16 values */
			float *ref = fvec(nx);
			matmul_backward(ref, NULL, NULL, bf16_rounded(block, nd), bf16_rounded(inp, nx),
					bf16_rounded(w, nw), N, C, OC);
			expect_red("dinp", x0, ref, nx, OC);
			/* alpha (a LoRA scale, a power of two and not): dinp as
			 * the product then scale give it; dweight as before */
			for (int ai = 0; ai < 2; ai++) {
				const float alpha = ai ? 0.37f : 2.0f;
				float *d_a = dnan(nx), *d_aw = set ? dnan(nw) : dputf(dw0, nw);
				gpu_matmul_backward_ld16(be, d_a, d_aw, d_full16 + c0, (size_t)W, d_inp, NULL,
							 NULL, d_w16, N, C, OC, flags, alpha);
				gpu_scale(be, d_dx[1], alpha, nx);
				CHECK_MSG(memcmp(hget(d_a, nx), hget(d_dx[1], nx), nx * sizeof(float)) == 0 &&
						  memcmp(hget(d_aw, nw), w0, nw * sizeof(float)) == 0,
					  "%s: alpha %g: not the product then scale's bits", where,
					  (double)alpha);
				gpu_upload(be, d_dx[1], x0, nx * sizeof(float));
			}
		}
		/* bias_backward_ld16: the column sums of the block's bf16 values
		 * read in place, added to the bias gradient — the bits of
		 * matmul_backward's bias gradient over fp32 values equal to them
		 * (the same tiles and order), and within a reduction's bound of
		 * the CPU's sum over the N rows */
		{
			float *b0 = frand((size_t)OC, 1.0, 0.0), *br = bf16_rounded(block, nd);
			float *d_b1 = dputf(b0, (size_t)OC), *d_b2 = dputf(b0, (size_t)OC);
			gpu_bias_backward_ld16(be, d_b1, d_full16 + c0, (size_t)W, N, OC);
			gpu_matmul_backward(be, NULL, NULL, NULL, d_b2, dputf(br, nd), NULL, NULL, NULL,
					    NULL, NULL, N, C, OC, 0u);
			float *b1 = hget(d_b1, (size_t)OC);
			expect_same_bits("bias_backward_ld16", b1, hget(d_b2, (size_t)OC), (size_t)OC);
			matmul_backward(NULL, NULL, b0, br, br, br, N, C, OC);
			expect_red("bias_backward_ld16 against the CPU", b1, b0, (size_t)OC, N);
			/* OC - 1 columns (not a multiple of 4: one column a
			 * thread), from the block's second: the same bits too */
			const int O1 = OC - 1;
			float *br1 = fvec((size_t)N * O1);
			for (int r = 0; r < N; r++)
				memcpy(br1 + (size_t)r * O1, br + (size_t)r * OC + 1, (size_t)O1 * sizeof(float));
			float *d_c1 = dputf(b0, (size_t)O1), *d_c2 = dputf(b0, (size_t)O1);
			gpu_bias_backward_ld16(be, d_c1, d_full16 + c0 + 1, (size_t)W, N, O1);
			gpu_matmul_backward(be, NULL, NULL, NULL, d_c2, dputf(br1, (size_t)N * O1), NULL,
					    NULL, NULL, NULL, NULL, N, C, O1, 0u);
			expect_same_bits("bias_backward_ld16 (one column a thread)",
					 hget(d_c1, (size_t)O1), hget(d_c2, (size_t)O1), (size_t)O1);
		}
		/* matmul_forward_scaled: matmul_forward then scale's bits */
		for (int ai = 0; ai < 2; ai++) {
			const float alpha = ai ? 0.37f : 2.0f;
			const size_t no = (size_t)N * C;
			float *d_o1 = dnan(no), *d_o2 = dnan(no);
			/* u = x A^T: x the block (N, OC), A (C, OC) */
			float *a = frand((size_t)C * OC, 2.0, -1.0), *d_a = dputf(a, (size_t)C * OC);
			gpu_bf16 *d_a16 = dput16(a, (size_t)C * OC);
			gpu_matmul_forward_scaled(be, d_o1, d_block, NULL, d_a, d_a16, N, OC, C, alpha);
			gpu_matmul_forward(be, d_o2, NULL, d_block, NULL, d_a, d_a16, NULL, N, OC, C);
			gpu_scale(be, d_o2, alpha, no);
			CHECK_MSG(memcmp(hget(d_o1, no), hget(d_o2, no), no * sizeof(float)) == 0,
				  "%s: matmul_forward_scaled (alpha %g): not matmul_forward then scale's bits",
				  where, (double)alpha);
		}
		case_end();
	}
	be->gemm_scratch = NULL;
	be->gemm_scratch_bytes = 0;
	CHECK_EQ_INT(gpu_set_bf16(be, false, &eb), TD_OK);
}

static void test_gemm_tune(void)
{
	static const struct { int N, C, OC; bool resid; } cases[] = {
		{ 2048, 896, 4864, false }, { 2048, 4864, 896, true }, { 2048, 896, 896, true },
	};
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		const int N = cases[ci].N, C = cases[ci].C, OC = cases[ci].OC;
		const size_t nin = (size_t)N * C, nout = (size_t)N * OC, nw = (size_t)OC * C;
		snprintf(where, sizeof(where), "timed GEMM (N=%d C=%d OC=%d)", N, C, OC);
		float *x = bf16_rounded(frand(nin, 1.0, 0.0), nin);
		float *w = bf16_rounded(frand(nw, 1.0, 0.0), nw);
		float *res = frand(nout, 1.0, 0.0);
		gpu_bf16 *d_x16 = dput16(x, nin), *d_w16 = dput16(w, nw);
		be->gemm_scratch = dmem(2); /* both twins: no rounding into it */
		be->gemm_scratch_bytes = 2;
		float *d_res = dputf(res, nout), *d_a = dnan(nout), *d_b = dnan(nout);
		if (cases[ci].resid) {
			gpu_matmul_forward_residual(be, d_a, d_res, NULL, d_x16, NULL, d_w16, N, C, OC);
			gpu_matmul_forward_residual(be, d_b, d_res, NULL, d_x16, NULL, d_w16, N, C, OC);
		} else {
			gpu_matmul_forward(be, d_a, NULL, NULL, d_x16, NULL, d_w16, NULL, N, C, OC);
			gpu_matmul_forward(be, d_b, NULL, NULL, d_x16, NULL, d_w16, NULL, N, C, OC);
		}
		float *a = hget(d_a, nout);
		expect_same_bits("out (timed call, then the kept algorithm)", hget(d_b, nout), a, nout);
		/* ...and the reference's bits: TD_CUDA_NO_GEMM_TUNE=1 (read by
		 * set_bf16) runs cublasGemmEx's default, or for the residual add
		 * cuBLASLt's first algorithm, as before the timing */
		setenv("TD_CUDA_NO_GEMM_TUNE", "1", 1);
		CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
		float *d_c = dnan(nout);
		if (cases[ci].resid)
			gpu_matmul_forward_residual(be, d_c, d_res, NULL, d_x16, NULL, d_w16, N, C, OC);
		else
			gpu_matmul_forward(be, d_c, NULL, NULL, d_x16, NULL, d_w16, NULL, N, C, OC);
		unsetenv("TD_CUDA_NO_GEMM_TUNE");
		CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
		expect_same_bits("out (the kept algorithm, then the reference)", hget(d_c, nout), a,
				 nout);
		/* bf16 out (no residual form): the same, as bf16 bits */
		gpu_bf16 *d_a16 = dnan16(nout), *d_b16 = dnan16(nout);
		if (!cases[ci].resid) {
			gpu_matmul_forward(be, NULL, d_a16, NULL, d_x16, NULL, d_w16, NULL, N, C, OC);
			gpu_matmul_forward(be, NULL, d_b16, NULL, d_x16, NULL, d_w16, NULL, N, C, OC);
			expect_same_bits("out16 (timed call, then the kept algorithm)",
					 hget16(d_b16, nout), hget16(d_a16, nout), nout);
		}
		enum { SAMPLES = 256 };
		float got[SAMPLES], ref[SAMPLES];
		for (int i = 0; i < SAMPLES; i++) {
			const size_t r = (size_t)((urand() + 1.0) / 2 * N) % (size_t)N;
			const size_t c = (size_t)((urand() + 1.0) / 2 * OC) % (size_t)OC;
			double sum = cases[ci].resid ? res[r * OC + c] : 0.0;
			for (int k = 0; k < C; k++)
				sum += (double)x[r * C + k] * w[c * C + k];
			ref[i] = (float)sum;
			got[i] = a[r * OC + c];
		}
		expect_red("out (sampled, against double sums)", got, ref, SAMPLES, C + 1);
		synced("timed GEMM");
		be->gemm_scratch = NULL;
		be->gemm_scratch_bytes = 0;
		case_end();
	}
	op_report("timed GEMM");
	CHECK_EQ_INT(gpu_set_bf16(be, false, &eb), TD_OK);
}

/* The bf16 twins (gpu/backend.h): each producer's twin is its fp32 output
 * rounded (with the fp32 output written, and with it NULL: the same twin);
 * a matmul that reads a twin gives the same bits as one that rounds the
 * fp32 operand itself. */
static void test_twins(void)
{
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
	op_begin();
	const int N = 37, C = 96, OC = 80, V = 1000;
	snprintf(where, sizeof(where), "twins (N=%d C=%d OC=%d)", N, C, OC);
	size_t nx = (size_t)N * C, nd = (size_t)N * OC, nw = (size_t)OC * C, nl = (size_t)N * V;
	be->gemm_scratch_bytes = 2 * ((nw > nx ? nw : nx) + 128 + nl);
	be->gemm_scratch = dmem(be->gemm_scratch_bytes);

	/* rmsnorm_forward */
	float *x = frand(nx, 2.0, 0.0), *w = frand((size_t)C, 1.0, 1.0);
	float *d_x = dputf(x, nx), *d_w = dputf(w, (size_t)C), *d_r = dnan((size_t)N);
	float *d_o = dnan(nx);
	gpu_bf16 *d_o16 = dnan16(nx), *d_o16b = dnan16(nx);
	gpu_rmsnorm_forward(be, d_o, d_o16, d_r, d_x, d_w, N, C, 1e-6f);
	gpu_rmsnorm_forward(be, NULL, d_o16b, d_r, d_x, d_w, N, C, 1e-6f);
	float *o = hget(d_o, nx);
	expect_twin("rmsnorm out16", d_o16, o, nx);
	expect_twin("rmsnorm out16 (out NULL)", d_o16b, o, nx);

	/* swiglu forward and backward (n not a multiple of 4: the tail too) */
	size_t n = 4 * 1000 + 3;
	float *g = frand(n, 4.0, 0.0), *u = frand(n, 1.0, 0.0), *dy = frand(n, 1.0, 0.0);
	float *d_g = dputf(g, n), *d_u = dputf(u, n), *d_dy = dputf(dy, n);
	float *d_h = dnan(n), *d_dg = dnan(n), *d_du = dnan(n);
	gpu_bf16 *d_h16 = dnan16(n), *d_h16b = dnan16(n), *d_dg16 = dnan16(n), *d_du16 = dnan16(n);
	gpu_swiglu_forward(be, d_h, d_h16, d_g, d_u, NULL, NULL, n);
	gpu_swiglu_forward(be, NULL, d_h16b, d_g, d_u, NULL, NULL, n);
	float *h = hget(d_h, n);
	expect_twin("swiglu out16", d_h16, h, n);
	expect_twin("swiglu out16 (out NULL)", d_h16b, h, n);
	gpu_swiglu_backward(be, d_dg, d_du, NULL, NULL, d_dy, NULL, d_g, d_u, NULL, NULL, n, NULL);
	gpu_swiglu_backward(be, NULL, NULL, d_dg16, d_du16, d_dy, NULL, d_g, d_u, NULL, NULL, n, NULL);
	expect_twin("swiglu dgate16", d_dg16, hget(d_dg, n), n);
	expect_twin("swiglu dup16", d_du16, hget(d_du, n), n);
	/* gate and up kept in bf16 only: the same bits as fp32 inputs that
	 * hold those rounded values */
	float *gr = bf16_rounded(g, n), *ur = bf16_rounded(u, n);
	float *d_gr = dputf(gr, n), *d_ur = dputf(ur, n);
	gpu_bf16 *d_g16 = dput16(g, n), *d_u16 = dput16(u, n);
	float *d_h2 = dnan(n), *d_h3 = dnan(n);
	gpu_swiglu_forward(be, d_h2, NULL, d_gr, d_ur, NULL, NULL, n);
	gpu_swiglu_forward(be, d_h3, NULL, NULL, NULL, d_g16, d_u16, n);
	expect_same_bits("swiglu from bf16 gate, up", hget(d_h3, n), hget(d_h2, n), n);
	gpu_swiglu_backward(be, d_dg, d_du, NULL, NULL, d_dy, NULL, d_gr, d_ur, NULL, NULL, n, NULL);
	float *dg_ref = hget(d_dg, n), *du_ref = hget(d_du, n);
	gpu_swiglu_backward(be, d_dg, d_du, NULL, NULL, d_dy, NULL, NULL, NULL, d_g16, d_u16, n, NULL);
	expect_same_bits("swiglu dgate from bf16 gate, up", hget(d_dg, n), dg_ref, n);
	expect_same_bits("swiglu dup from bf16 gate, up", hget(d_du, n), du_ref, n);
	/* dout in bf16 too (d(h) from a bf16 product): fp32 holding the
	 * rounded values gives the same bits */
	float *d_dyr = dputf(bf16_rounded(dy, n), n);
	gpu_swiglu_backward(be, d_dg, d_du, NULL, NULL, d_dyr, NULL, d_gr, d_ur, NULL, NULL, n, NULL);
	dg_ref = hget(d_dg, n), du_ref = hget(d_du, n);
	gpu_swiglu_backward(be, d_dg, d_du, NULL, NULL, NULL, dput16(dy, n), NULL, NULL, d_g16,
			    d_u16, n, NULL);
	expect_same_bits("swiglu dgate from bf16 dout, gate, up", hget(d_dg, n), dg_ref, n);
	expect_same_bits("swiglu dup from bf16 dout, gate, up", hget(d_du, n), du_ref, n);
	/* every operand bf16 (the bf16 mode's form: swiglu_*_bf16x8, eight a
	 * thread step, n / 8 * 8 of them and a tail of 3): the bits of the
	 * fp32 outputs above rounded; and from views 8 bytes off (no longer
	 * 16-byte aligned: the four-a-step kernel), the same bits again */
	{
		const size_t o = 4, m = n - o;
		gpu_bf16 *d_h16c = dnan16(n), *d_h16d = dnan16(n), *d_dg16c = dnan16(n),
			 *d_du16c = dnan16(n), *d_dg16d = dnan16(n), *d_du16d = dnan16(n);
		gpu_bf16 *d_dy16c = dput16(dy, n);
		gpu_swiglu_forward(be, NULL, d_h16c, NULL, NULL, d_g16, d_u16, n);
		expect_twin("swiglu all bf16: out16", d_h16c, hget(d_h2, n), n);
		gpu_swiglu_forward(be, NULL, d_h16d + o, NULL, NULL, d_g16 + o, d_u16 + o, m);
		expect_same_bits("swiglu all bf16, 8 bytes off: out16", hget16(d_h16d + o, m),
				 hget16(d_h16c + o, m), m);
		gpu_swiglu_backward(be, NULL, NULL, d_dg16c, d_du16c, NULL, d_dy16c, NULL, NULL,
				    d_g16, d_u16, n, NULL);
		expect_twin("swiglu all bf16: dgate16", d_dg16c, dg_ref, n);
		expect_twin("swiglu all bf16: dup16", d_du16c, du_ref, n);
		gpu_swiglu_backward(be, NULL, NULL, d_dg16d + o, d_du16d + o, NULL, d_dy16c + o, NULL,
				    NULL, d_g16 + o, d_u16 + o, m, NULL);
		expect_same_bits("swiglu all bf16, 8 bytes off: dgate16", hget16(d_dg16d + o, m),
				 hget16(d_dg16c + o, m), m);
		expect_same_bits("swiglu all bf16, 8 bytes off: dup16", hget16(d_du16d + o, m),
				 hget16(d_du16c + o, m), m);
	}
	/* d(gate) written over d(h) (train/plan.c: dgate_over_dh), all bf16:
	 * the bits of separate buffers */
	gpu_bf16 *d_dy16 = dput16(dy, n), *d_dyin = dput16(dy, n);
	gpu_swiglu_backward(be, NULL, NULL, d_dg16, d_du16, NULL, d_dy16, NULL, NULL, d_g16, d_u16,
			    n, NULL);
	gpu_swiglu_backward(be, NULL, NULL, d_dyin, d_du16, NULL, d_dyin, NULL, NULL, d_g16, d_u16,
			    n, NULL);
	expect_same_bits("swiglu dgate16 over dout16", hget16(d_dyin, n), hget16(d_dg16, n), n);

	/* crossentropy_backward: the twin alone */
	float *lg = frand(nl, 4.0, 0.0);
	int32_t *tg = ids_rand(N, V);
	tg[3] = -100;
	float *d_lg = dputf(lg, nl), *d_dl = dnan(nl);
	int32_t *d_tg = dput(tg, sizeof(int32_t) * (size_t)N);
	gpu_bf16 *d_dl16 = dnan16(nl);
	gpu_crossentropy_backward(be, NULL, d_dl, NULL, d_lg, NULL, d_tg, 0.25f, N, V);
	gpu_crossentropy_backward(be, NULL, NULL, d_dl16, d_lg, NULL, d_tg, 0.25f, N, V);
	expect_twin("crossentropy dlogits16", d_dl16, hget(d_dl, nl), nl);

	/* ...of bf16 logits (the bf16 mode's head), against the fp32 kernels
	 * on fp32 logits holding the same values; V 1000 (eight a load), 1001
	 * (rows not 16-byte aligned: one a load), 20000 (many loads a row).
	 * The two kernels push the same values in another order into the
	 * row's double sum (~V terms: a relative difference ~V 2^-53), so the
	 * losses are the same floats or one fp32 step apart (2.4e-7 relative:
	 * two steps' room), and 1 / sum may be one fp32 step apart, which moves
	 * a gradient (two more roundings) by a few steps of itself, or of
	 * dloss where the target's term cancels (4 steps: 4.8e-7, relative
	 * and times dloss); the bf16 gradient, written in place over the
	 * logits, is the fp32 one rounded, within half a bf16 step besides
	 * (2^-8 relative). Then the head's products read it: the CPU's sums
	 * of the same bf16 values, within a reduction's bound. */
	static const int v16[] = {1000, 1001, 20000};
	for (size_t vi = 0; vi < COUNT(v16); vi++) {
		const int Vi = v16[vi];
		size_t ni = (size_t)N * Vi, nwi = (size_t)Vi * C;
		float *lgi = frand(ni, 4.0, 0.0);
		int32_t *tgi = ids_rand(N, Vi);
		tgi[3] = -100;
		float *d_lgr = dputf(bf16_rounded(lgi, ni), ni), *d_ref = dnan(ni);
		float *d_lo = dnan((size_t)N), *d_lf = dnan((size_t)N), *d_li = dnan((size_t)N);
		int32_t *d_tgi = dput(tgi, sizeof(int32_t) * (size_t)N);
		gpu_bf16 *d_lg16 = dput16(lgi, ni), *d_tw16 = dnan16(ni);
		float *d_tw = dnan(ni);
		gpu_crossentropy_backward(be, d_lo, d_ref, NULL, d_lgr, NULL, d_tgi, 0.25f, N, Vi);
		float *ref = hget(d_ref, ni), *lo = hget(d_lo, (size_t)N);
		gpu_crossentropy_forward(be, d_lf, NULL, d_lg16, d_tgi, N, Vi);
		expect_close("crossentropy_forward (bf16 logits)", hget(d_lf, (size_t)N), lo,
			     (size_t)N, 0.0, 2.4e-7);
		gpu_crossentropy_backward(be, NULL, d_tw, d_tw16, NULL, d_lg16, d_tgi, 0.25f, N, Vi);
		float *tw = hget(d_tw, ni);
		expect_close("crossentropy_backward (bf16 logits)", tw, ref, ni, 0.25 * 4.8e-7, 4.8e-7);
		expect_twin("crossentropy_backward dlogits16 (bf16 logits)", d_tw16, tw, ni);
		gpu_crossentropy_backward(be, d_li, NULL, d_lg16, NULL, d_lg16, d_tgi, 0.25f, N, Vi);
		expect_close("crossentropy losses (bf16, in place)", hget(d_li, (size_t)N), lo,
			     (size_t)N, 0.0, 2.4e-7);
		float *dl = hget16(d_lg16, ni);
		expect_close("crossentropy dlogits16 (bf16, in place)", dl, ref, ni, 0.25 * 4.8e-7,
			     1.0 / 256);
		if (Vi != 1000)
			continue;
		/* the products: dinp = dl W, dweight = dl^T x (bf16 x, W) */
		float *wi = frand(nwi, 1.0, 0.0);
		float *dx_ref = ffill(nx, 0.0f), *dw_ref = ffill(nwi, 0.0f);
		matmul_backward(dx_ref, dw_ref, NULL, dl, bf16_rounded(x, nx), bf16_rounded(wi, nwi), N,
				C, Vi);
		float *d_dxi = dnan(nx), *d_dwi = dnan(nwi);
		gpu_matmul_backward(be, d_dxi, NULL, d_dwi, NULL, NULL, d_lg16, NULL, dput16(x, nx),
				    NULL, dput16(wi, nwi), N, C, Vi,
				    GPU_SET_DINP | GPU_SET_DWEIGHT);
		expect_red("matmul_backward dinp (the bf16 loss gradient)", hget(d_dxi, nx), dx_ref, nx,
			   Vi);
		expect_red("matmul_backward dweight (the bf16 loss gradient)", hget(d_dwi, nwi), dw_ref,
			   nwi, N);
	}

	/* matmul: twins in, the same bits as rounding inside */
	float *wt = frand(nw, 1.0, 0.0), *dout = frand(nd, 1.0, 0.0);
	float *d_wt = dputf(wt, nw), *d_dout = dputf(dout, nd);
	gpu_bf16 *d_x16 = dput16(x, nx), *d_dout16 = dput16(dout, nd);
	float *d_y1 = dnan(nd), *d_y2 = dnan(nd);
	gpu_matmul_forward(be, d_y1, NULL, d_x, NULL, d_wt, NULL, NULL, N, C, OC);
	gpu_matmul_forward(be, d_y2, NULL, NULL, d_x16, d_wt, NULL, NULL, N, C, OC);
	float *y1 = hget(d_y1, nd);
	expect_same_bits("matmul_forward (inp16)", hget(d_y2, nd), y1, nd);
	/* the product in bf16: the fp32 product rounded, to within one bf16
	 * step (the output type may pick another kernel, another order) */
	gpu_bf16 *d_y16 = dnan16(nd);
	gpu_matmul_forward(be, NULL, d_y16, NULL, d_x16, d_wt, NULL, NULL, N, C, OC);
	expect_close_scaled("matmul_forward (bf16 out)", hget16(d_y16, nd), y1, nd, 0.0, 1.0 / 128,
			    1e-3);
	float *zx = ffill(nx, 0.5f), *zw = ffill(nw, 0.25f);
	float *d_dx1 = dputf(zx, nx), *d_dx2 = dputf(zx, nx), *d_dw1 = dputf(zw, nw), *d_dw2 = dputf(zw, nw);
	gpu_matmul_backward(be, d_dx1, NULL, d_dw1, NULL, d_dout, NULL, d_x, NULL, d_wt, NULL, N, C,
			    OC, false);
	gpu_matmul_backward(be, d_dx2, NULL, d_dw2, NULL, NULL, d_dout16, NULL, d_x16, d_wt, NULL,
			    N, C, OC, false);
	expect_same_bits("matmul_backward dinp (twins)", hget(d_dx2, nx), hget(d_dx1, nx), nx);
	expect_same_bits("matmul_backward dweight (twins)", hget(d_dw2, nw), hget(d_dw1, nw), nw);
	/* dinp written in bf16 (the MLP's d(h)): the fp32 product rounded, to
	 * within one bf16 step (the output type may pick another kernel) */
	gpu_bf16 *d_dx16 = dnan16(nx);
	gpu_matmul_backward(be, d_dx1, NULL, NULL, NULL, NULL, d_dout16, NULL, d_x16, d_wt, NULL, N,
			    C, OC, GPU_SET_DINP);
	gpu_matmul_backward(be, NULL, d_dx16, NULL, NULL, NULL, d_dout16, NULL, d_x16, d_wt, NULL,
			    N, C, OC, GPU_SET_DINP);
	expect_close_scaled("matmul_backward dinp16", hget16(d_dx16, nx), hget(d_dx1, nx), nx, 0.0,
			    1.0 / 128, 1e-3);
	case_end();

	/* attention_forward's twin, fused (HS 64) and not (HS 96) */
	const int B = 2, T = 70, NH = 4, NKV = 2;
	for (int HS = 64; HS <= 96; HS += 32) {
		snprintf(where, sizeof(where), "twins: attention (HS=%d)", HS);
		size_t nq = (size_t)B * T * NH * HS, nk = (size_t)B * T * NKV * HS;
		be->gemm_scratch_bytes = gpu_flash_scratch_bytes(B, T, NH, NKV, HS, false);
		be->gemm_scratch = dmem(be->gemm_scratch_bytes);
		float *q = frand(nq, 1.0, 0.0), *k = frand(nk, 1.0, 0.0), *v = frand(nk, 1.0, 0.0);
		size_t na = gpu_attention_flash(be, HS) ? (size_t)B * NH * T : (size_t)B * NH * T * T;
		float *d_out = dnan(nq), *d_att = dnan(na);
		gpu_bf16 *d_out16 = dnan16(nq);
		gpu_attention_forward(be, d_out, d_out16, d_att, dputf(q, nq), NULL, dputf(k, nk), NULL,
				      dputf(v, nk), NULL, B, T, NH, NKV, HS);
		expect_twin("attention out16", d_out16, hget(d_out, nq), nq);
		case_end();
	}
	be->gemm_scratch = NULL;
	be->gemm_scratch_bytes = 0;
	op_report("twins");
	CHECK_EQ_INT(gpu_set_bf16(be, false, &eb), TD_OK);
}

static void test_rope(void)
{
	static const struct { int B, T, NH, HS; double theta; } cases[] = {
		{ 2, 5, 4, 8, 10000.0 }, { 1, 1, 2, 2, 10000.0 }, { 3, 7, 3, 6, 1e6 },
		{ 4, 256, 8, 64, 1e6 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int B = cases[ci].B, T = cases[ci].T, NH = cases[ci].NH, HS = cases[ci].HS;
		size_t n = (size_t)B * T * NH * HS, nc = (size_t)T * (HS / 2);
		snprintf(where, sizeof(where), "rope (B=%d T=%d NH=%d HS=%d)", B, T, NH, HS);
		float *cos = fvec(nc), *sin = fvec(nc);
		rope_cache(cos, sin, T, HS, cases[ci].theta);
		float *d_cos = dputf(cos, nc), *d_sin = dputf(sin, nc);
		float *inp = frand(n, 1.0, 0.0);
		float *d_inp = dputf(inp, n);

		float *out = fvec(n);
		rope_forward(out, inp, cos, sin, B, T, NH, HS);
		float *d_out = dnan(n);
		gpu_rope_forward(be, d_out, NULL, d_inp, d_cos, d_sin, B, T, NH, HS);
		expect_exact("out", hget(d_out, n), out, n);
		/* the bf16 twin, beside out and alone: out rounded */
		gpu_bf16 *d_o16 = dnan16(n), *d_o16b = dnan16(n);
		gpu_rope_forward(be, d_out, d_o16, d_inp, d_cos, d_sin, B, T, NH, HS);
		gpu_rope_forward(be, NULL, d_o16b, d_inp, d_cos, d_sin, B, T, NH, HS);
		expect_twin("out16", d_o16, out, n);
		expect_twin("out16 (out NULL)", d_o16b, out, n);
		gpu_rope_forward(be, d_inp, NULL, d_inp, d_cos, d_sin, B, T, NH, HS);
		expect_exact("out (in place)", hget(d_inp, n), out, n);

		float *dout = frand(n, 1.0, 0.0);
		float *d_dout = dputf(dout, n);
		float *dinp = fvec(n);
		rope_backward(dinp, dout, cos, sin, B, T, NH, HS);
		float *d_dinp = dnan(n);
		gpu_rope_backward(be, d_dinp, d_dout, d_cos, d_sin, B, T, NH, HS);
		expect_exact("dinp", hget(d_dinp, n), dinp, n);
		gpu_rope_backward(be, d_dout, d_dout, d_cos, d_sin, B, T, NH, HS);
		expect_exact("dinp (in place)", hget(d_dout, n), dinp, n);
		case_end();
	}
	op_report("rope");

	/* rope_qkv16 against rope_forward and the rounding on q, k and v
	 * apart: every value the CPU op's rotation (or v) rounded, bit for
	 * bit. off 1: qkv one float past an aligned address (the scalar
	 * kernel where HS would take the four-wide one). */
	static const struct { int B, T, NH, NKV, HS, off; } qc[] = {
		{ 2, 5, 4, 2, 8, 0 },    { 3, 7, 3, 1, 6, 0 },  { 2, 33, 14, 2, 64, 0 },
		{ 1, 16, 4, 4, 128, 0 }, { 2, 9, 4, 2, 64, 1 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(qc) && be->ops->rope_qkv16; ci++) {
		const int B = qc[ci].B, T = qc[ci].T, NH = qc[ci].NH, NKV = qc[ci].NKV, HS = qc[ci].HS;
		const size_t N = (size_t)B * T, H = (size_t)NH * HS, KV = (size_t)NKV * HS;
		const size_t W = H + 2 * KV, nc = (size_t)T * (HS / 2);
		snprintf(where, sizeof(where), "rope_qkv16 (B=%d T=%d NH=%d NKV=%d HS=%d off %d)", B, T,
			 NH, NKV, HS, qc[ci].off);
		float *cos = fvec(nc), *sin = fvec(nc);
		rope_cache(cos, sin, T, HS, 1e6);
		float *qkv = frand(N * W + 1, 1.0, 0.0);
		float *q = fvec(N * H), *k = fvec(N * KV), *v = fvec(N * KV);
		const float *rows = qkv + qc[ci].off;
		for (size_t r = 0; r < N; r++) {
			memcpy(q + r * H, rows + r * W, H * sizeof(float));
			memcpy(k + r * KV, rows + r * W + H, KV * sizeof(float));
			memcpy(v + r * KV, rows + r * W + H + KV, KV * sizeof(float));
		}
		float *qr = fvec(N * H), *kr = fvec(N * KV);
		rope_forward(qr, q, cos, sin, B, T, NH, HS);
		rope_forward(kr, k, cos, sin, B, T, NKV, HS);
		gpu_bf16 *d_q16 = dnan16(N * H), *d_k16 = dnan16(N * KV), *d_v16 = dnan16(N * KV);
		const float *d_qkv = dputf(qkv, N * W + 1) + qc[ci].off;
		gpu_rope_qkv16(be, d_q16, d_k16, d_v16, d_qkv, dputf(cos, nc), dputf(sin, nc), B, T, NH,
			       NKV, HS);
		expect_twin("q16", d_q16, qr, N * H);
		expect_twin("k16", d_k16, kr, N * KV);
		expect_twin("v16", d_v16, v, N * KV);
		case_end();
	}
	CHECK(be->ops->rope_qkv16 != NULL);
	op_report("rope_qkv16");
}

static void test_attention(void)
{
	static const struct { int B, T, NH, NKV, HS; } cases[] = {
		{ 2, 5, 4, 2, 8 },  { 2, 5, 4, 4, 8 },   { 3, 1, 4, 2, 8 },    { 1, 7, 6, 1, 6 },
		{ 2, 33, 4, 2, 16 }, { 1, 64, 14, 2, 64 }, { 4, 256, 8, 2, 64 }, { 4, 256, 8, 8, 64 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int B = cases[ci].B, T = cases[ci].T, NH = cases[ci].NH, NKV = cases[ci].NKV;
		int HS = cases[ci].HS;
		size_t nq = (size_t)B * T * NH * HS, nk = (size_t)B * T * NKV * HS;
		size_t na = (size_t)B * NH * T * T;
		snprintf(where, sizeof(where), "attention (B=%d T=%d NH=%d NKV=%d HS=%d)", B, T, NH,
			 NKV, HS);
		float *q = frand(nq, 1.0, 0.0), *k = frand(nk, 1.0, 0.0), *v = frand(nk, 1.0, 0.0);
		float *d_q = dputf(q, nq), *d_k = dputf(k, nk), *d_v = dputf(v, nk);
		float *out = fvec(nq), *att = fvec(na);
		attention_forward(out, att, q, k, v, B, T, NH, NKV, HS);
		float *d_out = dnan(nq), *d_att = dnan(na);
		gpu_attention_forward(be, d_out, NULL, d_att, d_q, NULL, d_k, NULL, d_v, NULL, B, T, NH,
				      NKV, HS);
		expect_red("att", hget(d_att, na), att, na, T > HS ? T : HS);
		expect_red("out", hget(d_out, nq), out, nq, T);

		/* Backward from the CPU's probabilities; all outputs overwritten,
		 * datt is scratch. */
		float *dout = frand(nq, 1.0, 0.0);
		float *dq = fvec(nq), *dk = fvec(nk), *dv = fvec(nk), *datt = fvec(na);
		attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, NH, NKV, HS);
		float *d_dout = dputf(dout, nq), *d_att_ref = dputf(att, na);
		float *d_dq = dnan(nq), *d_dk = dnan(nk), *d_dv = dnan(nk), *d_datt = dnan(na);
		gpu_attention_backward(be, d_dq, d_dk, d_dv, d_datt, d_dout, d_out, NULL, d_q, NULL, d_k, NULL,
				       d_v, NULL, d_att_ref, B, T, NH, NKV, HS);
		float *g_dk = hget(d_dk, nk);
		expect_red("dq", hget(d_dq, nq), dq, nq, T);
		expect_red("dk", g_dk, dk, nk, (double)T * (NH / NKV));
		expect_red("dv", hget(d_dv, nk), dv, nk, (double)T * (NH / NKV));
		gpu_attention_backward(be, d_dq, d_dk, d_dv, d_datt, d_dout, d_out, NULL, d_q, NULL, d_k, NULL,
				       d_v, NULL, d_att_ref, B, T, NH, NKV, HS);
		expect_same_bits("dk", hget(d_dk, nk), g_dk, nk);
		case_end();
	}
	op_report("attention");
}

/* ||got - ref|| / ||ref||, NaN anywhere failing. */
static void expect_normwise(const char *what, const float *got, const float *ref, size_t n,
			    double tol)
{
	double d2 = 0.0, r2 = 0.0;
	for (size_t i = 0; i < n; i++) {
		double d = (double)got[i] - (double)ref[i];
		d2 += d * d;
		r2 += (double)ref[i] * (double)ref[i];
	}
	double rel = sqrt(d2) / (r2 > 0.0 ? sqrt(r2) : 1.0);
	if (rel > op_max_ratio || isnan(rel)) {
		op_max_ratio = isnan(rel) ? INFINITY : rel;
		snprintf(op_worst, sizeof(op_worst), "%s %s", where, what);
	}
	op_arrays++;
	CHECK_MSG(rel <= tol, "%s: %s: normwise error %.3g > %.3g", where, what, rel, tol);
}

/* The fused attention of the bf16 mode (kernels/cuda/flash.cu) against the
 * CPU's fp32 op. Its products take bf16 operands (q, k, v, the
 * probabilities, dout, dS: 8 significant bits, relative rounding <= 2^-8),
 * so it is held to the bf16 mode's bounds, normwise: 2e-2 for out and the
 * gradients, where the roundings' combined effect measures ~3e-3 and a wrong
 * mask, scale or tile gives O(1). T crosses the 64-row tiles (63, 64, 65,
 * 130) and the forward's 128-query blocks (130, 200, 256, 300: a block's
 * last key tile, which only its second m-tiles see, and 5 key tiles through
 * head size 128's single K and V buffers), GQA groups of 1 to 7 heads,
 * every head size the kernels are built for. att holds B*NH*T floats in
 * this mode, datt gpu_flash_datt_floats (with GQA, the per-head dK/dV
 * partials). Run twice: the same bits (no atomics). And with q, k, v given
 * as bf16 twins (the engine keeps them so when attention is fused) in a
 * scratch with room for dout's copy only: the same bits as rounding the
 * fp32 ones (they are those, rounded). */
#define FLASH_NORM_TOL 2e-2

/* The output kept in bf16 only (the plan's y16 without y): the forward
 * given out NULL and out16 writes out16 as the fp32 run's out rounded and
 * the same statistics; the backward given out16 (out NULL) forms
 * Dr = rowsum(dout * out16 widened) (flash_rowdot; Dr is datt's first
 * B*NH*T floats). Per row, with S = sum |dout * out| over its HS columns:
 * against the host's sum of the same widened terms, Dr is an fp32 sum of
 * HS fp32 products, within (HS + 1) 2^-24 S' (S' the same sum over out16,
 * <= (1 + 2^-8) S); against the fp32 run's D = rowsum(dout * out), each
 * term moved by at most 2^-8 of itself (out16 = out rounded to nearest,
 * 8 significant bits), so within 2^-8 S plus both sums' rounding. dv does
 * not read Dr: the same bits as the fp32-out run. dq and dk against the
 * CPU's fp32 op: the bf16 mode's FLASH_NORM_TOL plus what D's move adds
 * normwise: dS = P (dP - D), so dq_t moves by scale |dD_t| ||sum_s P_ts
 * k_s|| <= scale |dD_t| max_s<=t ||k_s||, and dk_s by at most scale
 * sum over the group's heads and t >= s of P_ts |dD_t| ||q_t|| (P the
 * CPU's, doubled for the fused kernels' own P, within FLASH_NORM_TOL of
 * it), with |dD_t| <= 2^-8 S_t. */
static void flash_out16_case(int B, int T, int NH, int NKV, int HS, const float *g_out,
			     const float *dout, const float *att, const float *q, const float *k,
			     const float *dq, const float *dk, const float *g_dv, const gpu_bf16 *d_q16,
			     const gpu_bf16 *d_k16, const gpu_bf16 *d_v16, const float *d_dout,
			     const float *g_lse)
{
	const size_t nq = (size_t)B * T * NH * HS, nk = (size_t)B * T * NKV * HS;
	const size_t nl = (size_t)B * NH * T;
	const int ldq = NH * HS, ldk = NKV * HS, rep = NH / NKV;
	const double u = ldexp(1.0, -24), r16 = ldexp(1.0, -8), scale = 1.0 / sqrt((double)HS);
	gpu_bf16 *d_o16 = dnan16(nq);
	float *d_lse = dnan(nl);
	gpu_attention_forward(be, NULL, d_o16, d_lse, NULL, d_q16, NULL, d_k16, NULL, d_v16, B, T,
			      NH, NKV, HS);
	expect_twin("out16 (out NULL)", d_o16, g_out, nq);
	expect_same_bits("lse (out NULL)", hget(d_lse, nl), g_lse, nl);
	float *d_dq = dnan(nq), *d_dk = dnan(nk), *d_dv = dnan(nk);
	float *d_dr = dnan(gpu_flash_datt_floats(B, T, NH, NKV, HS));
	gpu_attention_backward(be, d_dq, d_dk, d_dv, d_dr, d_dout, NULL, d_o16, NULL, d_q16, NULL,
			       d_k16, NULL, d_v16, d_lse, B, T, NH, NKV, HS);
	float *dr = hget(d_dr, nl), *g_dq = hget(d_dq, nq), *g_dk = hget(d_dk, nk);
	uint16_t *o16 = hmem(nq * sizeof(uint16_t));
	gpu_download(be, o16, d_o16, nq * sizeof(uint16_t));
	double *dD = (double *)hmem(nl * sizeof(double));
	size_t bad16 = 0, bad32 = 0;
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++)
			for (int t = 0; t < T; t++) {
				const size_t at = ((size_t)b * T + t) * ldq + (size_t)h * HS;
				const size_t r = ((size_t)b * NH + h) * T + t;
				double s16 = 0, s32 = 0, a16 = 0, a32 = 0;
				for (int c = 0; c < HS; c++) {
					uint32_t bits = (uint32_t)o16[at + c] << 16;
					float w;
					memcpy(&w, &bits, sizeof(w));
					s16 += (double)dout[at + c] * w;
					a16 += fabs((double)dout[at + c] * w);
					s32 += (double)dout[at + c] * g_out[at + c];
					a32 += fabs((double)dout[at + c] * g_out[at + c]);
				}
				bad16 += !(fabs(dr[r] - s16) <= (HS + 1) * u * a16);
				bad32 += !(fabs(dr[r] - s32) <= r16 * a32 + (HS + 1) * u * (a16 + a32));
				dD[r] = r16 * a32;
			}
	CHECK_MSG(bad16 == 0, "%s: Dr (out16): %zu of %zu rows off the sum over out16 widened",
		  where, bad16, nl);
	CHECK_MSG(bad32 == 0, "%s: Dr (out16): %zu of %zu rows more than 2^-8 off rowsum(dout * out)",
		  where, bad32, nl);
	expect_same_bits("dv (out16)", hget(d_dv, nk), g_dv, nk);
	/* what D's move adds to dq and dk, normwise, against the CPU's */
	double eq2 = 0, ek2 = 0, rq2 = 0, rk2 = 0;
	for (size_t i = 0; i < nq; i++)
		rq2 += (double)dq[i] * dq[i];
	for (size_t i = 0; i < nk; i++)
		rk2 += (double)dk[i] * dk[i];
	double *ek = (double *)hmem((size_t)B * T * NKV * sizeof(double));
	memset(ek, 0, (size_t)B * T * NKV * sizeof(double));
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++) {
			const int g = h / rep;
			double kmax = 0;
			for (int t = 0; t < T; t++) {
				double kn = 0, qn = 0;
				for (int c = 0; c < HS; c++) {
					const double kv = k[((size_t)b * T + t) * ldk + (size_t)g * HS + c];
					const double qv = q[((size_t)b * T + t) * ldq + (size_t)h * HS + c];
					kn += kv * kv;
					qn += qv * qv;
				}
				kmax = fmax(kmax, sqrt(kn));
				const double d = dD[((size_t)b * NH + h) * T + t];
				eq2 += pow(scale * d * kmax, 2);
				const float *P = att + (((size_t)b * NH + h) * T + t) * T;
				for (int s = 0; s <= t; s++)
					ek[((size_t)b * T + s) * NKV + g] += 2.0 * scale * P[s] * d * sqrt(qn);
			}
		}
	for (size_t i = 0; i < (size_t)B * T * NKV; i++)
		ek2 += ek[i] * ek[i];
	expect_normwise("dq (out16)", g_dq, dq, nq,
			FLASH_NORM_TOL + sqrt(eq2) / (rq2 > 0 ? sqrt(rq2) : 1.0));
	expect_normwise("dk (out16)", g_dk, dk, nk,
			FLASH_NORM_TOL + sqrt(ek2) / (rk2 > 0 ? sqrt(rk2) : 1.0));
}

/* attention_backward_rope16 (gpu/backend.h) against the five ops it
 * stands for, run here on the same inputs: attention_backward (q, k, v
 * twins, out given in fp32), rope_backward of dq and dk, and dq, dk, dv
 * rounded by bf16_round_rows into rows of ld16 values (a column past the
 * three left alone: its NaN stays). Where the backend fuses them, the same
 * bits, whole: the fp32 gradients, and every bf16 value (they are the
 * same roundings of the same floats); with dq, dk, dv NULL the same rows;
 * with the rows over dout's own bytes (the model's room), the same rows
 * again. Where it does not, it must say so and write nothing. Returns
 * whether it fused. */
static bool flash_rope16_case(int B, int T, int NH, int NKV, int HS, const float *d_dout,
			      const float *d_out, const gpu_bf16 *d_q16, const gpu_bf16 *d_k16,
			      const gpu_bf16 *d_v16, const float *d_lse)
{
	const size_t N = (size_t)B * T, H = (size_t)NH * HS, KV = (size_t)NKV * HS;
	const size_t W = H + 2 * KV, ld = W + 4, nq = N * H, nk = N * KV;
	float *cs = frand((size_t)T * HS / 2, 2.0, -1.0), *sn = frand((size_t)T * HS / 2, 2.0, -1.0);
	float *d_cos = dputf(cs, (size_t)T * HS / 2), *d_sin = dputf(sn, (size_t)T * HS / 2);
	float *d_dr = dnan(gpu_flash_datt_floats(B, T, NH, NKV, HS));
	/* the five ops */
	float *d_rq = dnan(nq), *d_rk = dnan(nk), *d_rv = dnan(nk);
	gpu_attention_backward(be, d_rq, d_rk, d_rv, d_dr, d_dout, d_out, NULL, NULL, d_q16, NULL,
			       d_k16, NULL, d_v16, d_lse, B, T, NH, NKV, HS);
	gpu_rope_backward(be, d_rq, d_rq, d_cos, d_sin, B, T, NH, HS);
	gpu_rope_backward(be, d_rk, d_rk, d_cos, d_sin, B, T, NKV, HS);
	gpu_bf16 *d_ref = dnan16(N * ld);
	gpu_bf16_round_rows(be, d_ref, ld, d_rq, N, H);
	gpu_bf16_round_rows(be, d_ref + H, ld, d_rk, N, KV);
	gpu_bf16_round_rows(be, d_ref + H + KV, ld, d_rv, N, KV);
	float *rq = hget(d_rq, nq), *rk = hget(d_rk, nk), *rv = hget(d_rv, nk);
	float *ref = hget16(d_ref, N * ld);
	/* fused */
	float *d_dq = dnan(nq), *d_dk = dnan(nk), *d_dv = dnan(nk);
	gpu_bf16 *d16 = dnan16(N * ld);
	const bool fused = gpu_attention_backward_rope16(be, d_dq, d_dk, d_dv, d_dr, d_dout, d_out,
							 NULL, d_q16, d_k16, d_v16, d_lse, d_cos,
							 d_sin, d16, ld, NULL, 0, B, T, NH, NKV, HS);
	if (!fused) {
		float *nan = ffill(nq, NAN);
		CHECK_MSG(memcmp(hget(d_dq, nq), nan, nq * sizeof(float)) == 0 &&
				  memcmp(hget16(d16, N * ld), hget16(dnan16(N * ld), N * ld),
					 N * ld * sizeof(float)) == 0,
			  "%s: attention_backward_rope16 said no, and wrote", where);
		return false;
	}
	CHECK_MSG(memcmp(hget(d_dq, nq), rq, nq * sizeof(float)) == 0,
		  "%s: rope16's dq is not rope_backward's", where);
	CHECK_MSG(memcmp(hget(d_dk, nk), rk, nk * sizeof(float)) == 0,
		  "%s: rope16's dk is not rope_backward's", where);
	CHECK_MSG(memcmp(hget(d_dv, nk), rv, nk * sizeof(float)) == 0,
		  "%s: rope16's dv is not attention_backward's", where);
	CHECK_MSG(memcmp(hget16(d16, N * ld), ref, N * ld * sizeof(float)) == 0,
		  "%s: rope16's bf16 rows are not bf16_round_rows'", where);
	/* without the fp32 gradients */
	gpu_bf16 *d16b = dnan16(N * ld);
	CHECK(gpu_attention_backward_rope16(be, NULL, NULL, NULL, d_dr, d_dout, d_out, NULL, d_q16,
					    d_k16, d_v16, d_lse, d_cos, d_sin, d16b, ld, NULL, 0, B, T,
					    NH, NKV, HS));
	CHECK_MSG(memcmp(hget16(d16b, N * ld), ref, N * ld * sizeof(float)) == 0,
		  "%s: rope16's bf16 rows (dq, dk, dv NULL) are not bf16_round_rows'", where);
	/* with room for dS (Hopper: dQ from the dS the dK dV kernel leaves,
	 * one product instead of three over the same bf16 dS in the same
	 * order): every pair's at once, then room for a third of them
	 * (chunks), then too little for one pair (not used) — the same bits
	 * each time */
	const size_t pair = gpu_flash_ds_pair_bytes(T);
	const size_t pairs = (size_t)B * NH, rooms[] = {pairs * pair, (pairs + 2) / 3 * pair, pair - 16};
	for (size_t i = 0; i < sizeof(rooms) / sizeof(rooms[0]); i++) {
		void *d_ds = dmem(rooms[i]);
		gpu_bf16 *d16c = dnan16(N * ld);
		CHECK(gpu_attention_backward_rope16(be, NULL, NULL, NULL, d_dr, d_dout, d_out, NULL,
						    d_q16, d_k16, d_v16, d_lse, d_cos, d_sin, d16c, ld,
						    d_ds, rooms[i], B, T, NH, NKV, HS));
		float *got = hget16(d16c, N * ld);
		size_t bad = 0;
		for (size_t e = 0; e < N * ld; e++)
			bad += memcmp(&got[e], &ref[e], sizeof(float)) != 0;
		CHECK_MSG(bad == 0, "%s: rope16 with %zu bytes of dS room: %zu of %zu values differ",
			  where, rooms[i], bad, N * ld);
	}
	/* the rows over dout's bytes, ld16 = W (as the model's room, where
	 * they fit: W <= 2 H) */
	if (W <= 2 * H) {
		float *d_du = dmem(nq * sizeof(float));
		gpu_upload(be, d_du, hget(d_dout, nq), nq * sizeof(float));
		CHECK(gpu_attention_backward_rope16(be, d_dq, d_dk, d_dv, d_dr, d_du, d_out, NULL,
						    d_q16, d_k16, d_v16, d_lse, d_cos, d_sin,
						    (gpu_bf16 *)(void *)d_du, W, NULL, 0, B, T, NH, NKV, HS));
		float *got = hget16((gpu_bf16 *)(void *)d_du, N * W);
		size_t bad = 0;
		for (size_t r = 0; r < N; r++)
			bad += memcmp(got + r * W, ref + r * ld, W * sizeof(float)) != 0;
		CHECK_MSG(bad == 0, "%s: rope16 over dout's bytes: %zu of %zu rows differ", where, bad,
			  N);
		CHECK_MSG(memcmp(hget(d_dq, nq), rq, nq * sizeof(float)) == 0,
			  "%s: rope16's dq over dout's bytes is not rope_backward's", where);
	}
	return true;
}

static void test_flash_attention(void)
{
	static const struct { int B, T, NH, NKV, HS; } cases[] = {
		{ 2, 5, 4, 2, 16 },   { 1, 1, 2, 1, 16 },   { 2, 63, 4, 4, 32 },  { 1, 64, 14, 2, 64 },
		{ 2, 65, 4, 2, 64 },  { 1, 130, 7, 1, 16 }, { 2, 256, 8, 2, 64 }, { 1, 200, 4, 2, 32 },
		{ 1, 130, 4, 2, 128 }, { 2, 64, 2, 2, 128 }, { 1, 1, 2, 1, 128 },
		{ 1, 300, 4, 1, 128 }, { 1, 200, 4, 1, 64 }, { 1, 200, 2, 2, 128 },
	};
	struct td_errbuf eb = {{0}};
	int rope16_fused = 0, rope16_eligible = 0;
	CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK);
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int B = cases[ci].B, T = cases[ci].T, NH = cases[ci].NH, NKV = cases[ci].NKV;
		int HS = cases[ci].HS;
		CHECK(gpu_attention_flash(be, HS));
		/* the bf16 copies of q, k, v, dout: exactly the size the plan gives */
		be->gemm_scratch_bytes = gpu_flash_scratch_bytes(B, T, NH, NKV, HS, false);
		be->gemm_scratch = dmem(be->gemm_scratch_bytes);
		size_t nq = (size_t)B * T * NH * HS, nk = (size_t)B * T * NKV * HS;
		size_t na = (size_t)B * NH * T * T, nl = (size_t)B * NH * T;
		snprintf(where, sizeof(where), "flash attention (B=%d T=%d NH=%d NKV=%d HS=%d)", B, T,
			 NH, NKV, HS);
		float *q = frand(nq, 1.0, 0.0), *k = frand(nk, 1.0, 0.0), *v = frand(nk, 1.0, 0.0);
		float *d_q = dputf(q, nq), *d_k = dputf(k, nk), *d_v = dputf(v, nk);
		float *out = fvec(nq), *att = fvec(na);
		attention_forward(out, att, q, k, v, B, T, NH, NKV, HS);
		float *d_out = dnan(nq), *d_lse = dnan(nl);
		gpu_attention_forward(be, d_out, NULL, d_lse, d_q, NULL, d_k, NULL, d_v, NULL, B, T, NH,
				      NKV, HS);
		float *g_out = hget(d_out, nq);
		expect_normwise("out", g_out, out, nq, FLASH_NORM_TOL);

		float *dout = frand(nq, 1.0, 0.0);
		float *dq = fvec(nq), *dk = fvec(nk), *dv = fvec(nk), *datt = fvec(na);
		attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, NH, NKV, HS);
		float *d_dout = dputf(dout, nq);
		float *d_dq = dnan(nq), *d_dk = dnan(nk), *d_dv = dnan(nk);
		float *d_dr = dnan(gpu_flash_datt_floats(B, T, NH, NKV, HS));
		gpu_attention_backward(be, d_dq, d_dk, d_dv, d_dr, d_dout, d_out, NULL, d_q, NULL, d_k, NULL,
				       d_v, NULL, d_lse, B, T, NH, NKV, HS);
		float *g_dq = hget(d_dq, nq), *g_dk = hget(d_dk, nk), *g_dv = hget(d_dv, nk);
		expect_normwise("dq", g_dq, dq, nq, FLASH_NORM_TOL);
		expect_normwise("dk", g_dk, dk, nk, FLASH_NORM_TOL);
		expect_normwise("dv", g_dv, dv, nk, FLASH_NORM_TOL);
		gpu_attention_forward(be, d_out, NULL, d_lse, d_q, NULL, d_k, NULL, d_v, NULL, B, T, NH,
				      NKV, HS);
		gpu_attention_backward(be, d_dq, d_dk, d_dv, d_dr, d_dout, d_out, NULL, d_q, NULL, d_k, NULL,
				       d_v, NULL, d_lse, B, T, NH, NKV, HS);
		expect_same_bits("out", hget(d_out, nq), g_out, nq);
		expect_same_bits("dq", hget(d_dq, nq), g_dq, nq);
		expect_same_bits("dk", hget(d_dk, nk), g_dk, nk);
		expect_same_bits("dv", hget(d_dv, nk), g_dv, nk);
		/* dout a float past 16-byte alignment: Dr by flash_rowdot's
		 * column-a-lane kernel, not the four-columns one (its sum in
		 * another order: within the same bounds) */
		float *d_du = (float *)dmem((nq + 1) * sizeof(float)) + 1;
		gpu_upload(be, d_du, dout, nq * sizeof(float));
		gpu_attention_backward(be, d_dq, d_dk, d_dv, d_dr, d_du, d_out, NULL, d_q, NULL, d_k, NULL,
				       d_v, NULL, d_lse, B, T, NH, NKV, HS);
		expect_normwise("dq (dout unaligned)", hget(d_dq, nq), dq, nq, FLASH_NORM_TOL);
		expect_normwise("dk (dout unaligned)", hget(d_dk, nk), dk, nk, FLASH_NORM_TOL);
		expect_normwise("dv (dout unaligned)", hget(d_dv, nk), dv, nk, FLASH_NORM_TOL);
		/* q, k, v as twins (bf16_round of the same values), and a scratch
		 * of exactly dout's copy: the same bits again */
		gpu_bf16 *d_q16 = dnan16(nq), *d_k16 = dnan16(nk), *d_v16 = dnan16(nk);
		gpu_bf16_round(be, d_q16, d_q, nq);
		gpu_bf16_round(be, d_k16, d_k, nk);
		gpu_bf16_round(be, d_v16, d_v, nk);
		be->gemm_scratch_bytes = gpu_flash_scratch_bytes(B, T, NH, NKV, HS, true);
		be->gemm_scratch = dmem(be->gemm_scratch_bytes);
		float *d_out2 = dnan(nq), *d_lse2 = dnan(nl);
		gpu_attention_forward(be, d_out2, NULL, d_lse2, NULL, d_q16, NULL, d_k16, NULL, d_v16, B,
				      T, NH, NKV, HS);
		gpu_attention_backward(be, d_dq, d_dk, d_dv, d_dr, d_dout, d_out2, NULL, NULL, d_q16, NULL,
				       d_k16, NULL, d_v16, d_lse2, B, T, NH, NKV, HS);
		expect_same_bits("out (q, k, v twins)", hget(d_out2, nq), g_out, nq);
		expect_same_bits("lse (q, k, v twins)", hget(d_lse2, nl), hget(d_lse, nl), nl);
		expect_same_bits("dq (q, k, v twins)", hget(d_dq, nq), g_dq, nq);
		expect_same_bits("dk (q, k, v twins)", hget(d_dk, nk), g_dk, nk);
		expect_same_bits("dv (q, k, v twins)", hget(d_dv, nk), g_dv, nk);
		flash_out16_case(B, T, NH, NKV, HS, g_out, dout, att, q, k, dq, dk, g_dv, d_q16,
				 d_k16, d_v16, d_dout, hget(d_lse, nl));
		const bool fused =
			flash_rope16_case(B, T, NH, NKV, HS, d_dout, d_out2, d_q16, d_k16, d_v16, d_lse2);
		/* kv groups at HS 64 and 128: Hopper's kernels fuse them
		 * (TD_EXPECT_FLASH_WG=1: device-run.sh on compute capability 9.0) */
		const bool eligible = NH != NKV && (HS == 64 || HS == 128);
		rope16_fused += fused;
		rope16_eligible += eligible;
		CHECK_MSG(!fused || eligible, "%s: rope16 fused where it should not", where);
		if (getenv("TD_EXPECT_FLASH_WG") && strcmp(getenv("TD_EXPECT_FLASH_WG"), "1") == 0)
			CHECK_MSG(fused == eligible, "%s: rope16 %s", where,
				  fused ? "fused" : "not fused");
		case_end();
	}
	fprintf(stderr, "flash attention: attention_backward_rope16 fused %d of %d cases with kv "
			"groups at HS 64 or 128\n",
		rope16_fused, rope16_eligible);
	op_report("flash attention");
	be->gemm_scratch = NULL; /* freed with the last case */
	be->gemm_scratch_bytes = 0;
	CHECK(!gpu_attention_flash(be, 96)); /* not built: the stored-probabilities path */
	CHECK_EQ_INT(gpu_set_bf16(be, false, &eb), TD_OK);
	CHECK(!gpu_attention_flash(be, 64)); /* fp32 mode: never fused */
}

/* Without room in gemm_scratch for its bf16 copies, fused attention fails
 * the stream with an error that names the scratch (never a fault). The
 * error is sticky, so this runs on a backend of its own. */
static void test_flash_no_scratch(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *b2 = NULL;
	snprintf(where, sizeof(where), "flash attention without room for its copies");
	CHECK_EQ_INT(gpu_backend_open(&b2, "cuda", &eb), TD_OK);
	if (!b2)
		return;
	CHECK_EQ_INT(gpu_set_bf16(b2, true, &eb), TD_OK);
	int B = 1, T = 8, NH = 2, NKV = 1, HS = 16;
	size_t nq = (size_t)B * T * NH * HS, need = gpu_flash_scratch_bytes(B, T, NH, NKV, HS, false);
	void *x = NULL, *l = NULL, *scratch = NULL;
	CHECK_EQ_INT(gpu_alloc(b2, nq * sizeof(float), &x), TD_OK);
	CHECK_EQ_INT(gpu_alloc(b2, (size_t)B * NH * T * sizeof(float), &l), TD_OK);
	CHECK_EQ_INT(gpu_alloc(b2, need - 2, &scratch), TD_OK);
	b2->gemm_scratch = scratch;
	b2->gemm_scratch_bytes = need - 2;
	gpu_attention_forward(b2, x, NULL, l, x, NULL, x, NULL, x, NULL, B, T, NH, NKV, HS);
	CHECK_EQ_INT(gpu_sync(b2, &eb), TD_EDEVICE);
	CHECK_MSG(strstr(eb.msg, "gemm_scratch") != NULL, "the error names the scratch: %s", eb.msg);
	gpu_free(b2, scratch, need - 2);
	gpu_free(b2, l, (size_t)B * NH * T * sizeof(float));
	gpu_free(b2, x, nq * sizeof(float));
	gpu_backend_free(b2);
}

static void test_swiglu(void)
{
	static const size_t sizes[] = { 1, 67, 1000, (1u << 20) + 7 };
	op_begin();
	for (size_t ci = 0; ci < COUNT(sizes); ci++) {
		size_t n = sizes[ci];
		snprintf(where, sizeof(where), "swiglu (n=%zu)", n);
		float *gate = frand(n, 6.0, 0.0), *up = frand(n, 1.0, 0.0);
		/* silu's tails: exp(-x) overflows for x << 0. */
		static const float tails[] = { -100.0f, 100.0f, -20.0f, 30.0f, -88.5f };
		for (size_t i = 0; i < COUNT(tails) && i < n; i++)
			gate[n - 1 - i] = tails[i];
		float *d_gate = dputf(gate, n), *d_up = dputf(up, n);
		float *out = fvec(n);
		swiglu_forward(out, gate, up, n);
		float *d_out = dnan(n);
		gpu_swiglu_forward(be, d_out, NULL, d_gate, d_up, NULL, NULL, n);
		expect_close("out", hget(d_out, n), out, n, FWD_ATOL, FWD_RTOL);

		float *dout = frand(n, 1.0, 0.0);
		float *dgate = fvec(n), *dup = fvec(n);
		swiglu_backward(dgate, dup, dout, gate, up, n);
		float *d_dgate = dnan(n), *d_dup = dnan(n);
		gpu_swiglu_backward(be, d_dgate, d_dup, NULL, NULL, dputf(dout, n), NULL, d_gate,
				    d_up, NULL, NULL, n, NULL);
		expect_close("dgate", hget(d_dgate, n), dgate, n, FWD_ATOL, FWD_RTOL);
		expect_close("dup", hget(d_dup, n), dup, n, FWD_ATOL, FWD_RTOL);
		case_end();
	}
	/* With an adapter's share of dout (gpu_lora_dx: the LoRA down
	 * projection's d(h)): rows and columns past the kernel's 32 x 256
	 * blocks, R under, at and past its 16 values a pass. The share is
	 * lora_dx_add's to the bit (the same fused multiply-adds in the same
	 * order), so the only difference is swiglu's expf, as above. Then the
	 * bf16 mode's form (du rounded inside, A from its bf16 copy, dout,
	 * gate and up in bf16, bf16 outputs) against the fp32 form given the
	 * rounded values: the same bits; then the model's call (below). */
	static const int lshapes[][3] = {{45, 300, 8},	 {64, 256, 16}, {33, 517, 19},
					  {40, 130, 64}, {37, 516, 19}, {50, 1028, 36},
					  {45, 264, 16}, {70, 136, 8}};
	for (size_t ci = 0; ci < COUNT(lshapes); ci++) {
		const int rows = lshapes[ci][0], cols = lshapes[ci][1], R = lshapes[ci][2];
		const size_t n = (size_t)rows * cols, na = (size_t)R * cols, nu = (size_t)rows * R;
		snprintf(where, sizeof(where), "swiglu_backward + adapter (rows=%d cols=%d R=%d)",
			 rows, cols, R);
		float *gate = frand(n, 4.0, 0.0), *up = frand(n, 1.0, 0.0);
		float *dout = frand(n, 1.0, 0.0), *du = frand(nu, 1.0, 0.0), *A = frand(na, 0.5, 0.0);
		float *d = fvec(n), *dgate = fvec(n), *dup = fvec(n);
		memcpy(d, dout, n * sizeof(float));
		lora_dx_add(d, (const float *const *)&du, (const float *const *)&A, 1, rows, R, cols);
		swiglu_backward(dgate, dup, d, gate, up, n);
		float *d_gate = dputf(gate, n), *d_up = dputf(up, n), *d_dgate = dnan(n),
		      *d_dup = dnan(n);
		const struct gpu_lora_dx ad = {.du = dputf(du, nu), .A = dputf(A, na), .R = R,
					       .cols = cols};
		gpu_swiglu_backward(be, d_dgate, d_dup, NULL, NULL, dputf(dout, n), NULL, d_gate,
				    d_up, NULL, NULL, n, &ad);
		expect_close("dgate", hget(d_dgate, n), dgate, n, FWD_ATOL, FWD_RTOL);
		expect_close("dup", hget(d_dup, n), dup, n, FWD_ATOL, FWD_RTOL);

		const struct gpu_lora_dx adr = {.du = dputf(bf16_rounded(du, nu), nu),
						.A = dputf(bf16_rounded(A, na), na),
						.R = R,
						.cols = cols};
		gpu_swiglu_backward(be, d_dgate, d_dup, NULL, NULL, dputf(bf16_rounded(dout, n), n),
				    NULL, dputf(bf16_rounded(gate, n), n),
				    dputf(bf16_rounded(up, n), n), NULL, NULL, n, &adr);
		float *rg = hget(d_dgate, n), *ru = hget(d_dup, n);
		const struct gpu_lora_dx ad16 = {.du = ad.du, .A = ad.A, .A16 = dput16(A, na), .R = R,
						 .cols = cols};
		gpu_bf16 *d_dg16 = dnan16(n), *d_du16 = dnan16(n), *d_dout16 = dput16(dout, n),
			 *d_g16 = dput16(gate, n), *d_u16 = dput16(up, n);
		gpu_swiglu_backward(be, d_dgate, NULL, d_dg16, d_du16, NULL, d_dout16, NULL, NULL,
				    d_g16, d_u16, n, &ad16);
		expect_same_bits("dgate (bf16 operands)", hget(d_dgate, n), rg, n);
		expect_twin("dgate16", d_dg16, rg, n);
		expect_twin("dup16", d_du16, ru, n);
		/* twins only (the model's call): odd cols take the same kernel,
		 * the same bits; even cols the tensor cores' (lora_dx_add_mma's
		 * sum), held to rg, ru within what that sum's order moves: d by
		 * at most dd = (R + 2) 2^-22 S + 2^-23 |d| (S: the sum of the
		 * share's products' magnitudes; lora_dx_add's test says why),
		 * each output by its derivative in d times dd, then the bf16
		 * rounding of the twin (2^-8 of the value) and the few fp32
		 * roundings of the gradient's formula, which now see another d
		 * (2^-20 of it) */
		gpu_bf16 *d_dg16b = dnan16(n), *d_du16b = dnan16(n);
		gpu_swiglu_backward(be, NULL, NULL, d_dg16b, d_du16b, NULL, d_dout16, NULL, NULL,
				    d_g16, d_u16, n, &ad16);
		if (cols % 2) {
			expect_twin("dgate16 (twins only)", d_dg16b, rg, n);
			expect_twin("dup16 (twins only)", d_du16b, ru, n);
		} else {
			const float *dr = bf16_rounded(du, nu), *ar = bf16_rounded(A, na);
			float *xr = bf16_rounded(gate, n), *urd = bf16_rounded(up, n);
			float *dd = bf16_rounded(dout, n);
			lora_dx_add(dd, &dr, &ar, 1, rows, R, cols);
			const float *g16 = hget16(d_dg16b, n), *p16 = hget16(d_du16b, n);
			size_t bad = 0;
			double worst = 0.0;
			for (int r = 0; r < rows; r++)
				for (int i = 0; i < cols; i++) {
					const size_t e = (size_t)r * cols + i;
					double S = 0.0;
					for (int k = 0; k < R; k++)
						S += fabs((double)dr[(size_t)r * R + k] * ar[(size_t)k * cols + i]);
					const double dd_b = (R + 2) * ldexp(S, -22) + ldexp(fabs(dd[e]), -23);
					const double x = xr[e], sig = 1.0 / (1.0 + exp(-x));
					const double Fg = fabs(urd[e] * sig * (1.0 + x * (1.0 - sig)));
					const double Fp = fabs(x * sig);
					const double bg = Fg * dd_b * (1 + 0x1p-7) + ldexp(fabs(rg[e]), -8) +
							  ldexp(fabs(rg[e]), -20);
					const double bp = Fp * dd_b * (1 + 0x1p-7) + ldexp(fabs(ru[e]), -8) +
							  ldexp(fabs(ru[e]), -20);
					const double eg = fabs((double)g16[e] - rg[e]);
					const double ep = fabs((double)p16[e] - ru[e]);
					bad += !(eg <= bg) + !(ep <= bp);
					worst = eg / bg > worst ? eg / bg : worst;
					worst = ep / bp > worst ? ep / bp : worst;
				}
			CHECK_MSG(bad == 0, "%s: twins only (tensor cores): %zu of %zu values past "
				  "their bound (worst err/bound %.3g)", where, bad, 2 * n, worst);
		}
		if (cols % 8 == 0) {
			/* the tensor cores' kernel eight columns a lane (cols a
			 * multiple of 8, every row 16-byte aligned) against its two
			 * a lane (the same tensors 4 bytes into their allocations):
			 * the same bits */
			float *h_off[3];
			const float *h_src[3] = {dout, gate, up};
			for (int t = 0; t < 3; t++) {
				h_off[t] = fvec(n + 2);
				h_off[t][0] = h_off[t][1] = 0.0f;
				memcpy(h_off[t] + 2, h_src[t], n * sizeof(float));
			}
			gpu_bf16 *o_dg = dnan16(n + 2) + 2, *o_du = dnan16(n + 2) + 2;
			gpu_swiglu_backward(be, NULL, NULL, o_dg, o_du, NULL, dput16(h_off[0], n + 2) + 2,
					    NULL, NULL, dput16(h_off[1], n + 2) + 2,
					    dput16(h_off[2], n + 2) + 2, n, &ad16);
			expect_same_bits("dgate16 (eight columns a lane, then two)",
					 hget16(d_dg16b, n), hget16(o_dg, n), n);
			expect_same_bits("dup16 (eight columns a lane, then two)", hget16(d_du16b, n),
					 hget16(o_du, n), n);
		}
		case_end();
	}
	op_report("swiglu");

	/* lora_dx_add: G = 1..3 adapters' shares in one pass. In fp32, against
	 * the CPU op (the same fused multiply-adds in the same order: the same
	 * bits), also on bf16-rounded values; columns a multiple of four
	 * (float4 rows) and not, rows and columns past the blocks. With bf16
	 * copies of A (du rounded inside: the tensor cores' kernel where cols
	 * is even, else the same fused multiply-adds) against the CPU op on
	 * the rounded values: the K = G R products are exact, so two fp32 sums
	 * of them in any order, each add off by at most an ulp (2^-23 of the
	 * partial sum: the tensor cores' accumulation need not round to
	 * nearest), differ by at most (K + 2) 2^-22 times the sum of the
	 * products' magnitudes S, and the add to dinp by 2^-23 of the result. */
	op_begin();
	static const int xshapes[][4] = {{45, 300, 8, 1}, {64, 256, 16, 3}, {33, 517, 19, 2},
					 {40, 132, 64, 3}, {17, 1028, 36, 2}};
	for (size_t ci = 0; ci < COUNT(xshapes); ci++) {
		const int rows = xshapes[ci][0], cols = xshapes[ci][1], R = xshapes[ci][2],
			  G = xshapes[ci][3];
		const size_t n = (size_t)rows * cols, na = (size_t)R * cols, nu = (size_t)rows * R;
		snprintf(where, sizeof(where), "lora_dx_add (rows=%d cols=%d R=%d G=%d)", rows, cols,
			 R, G);
		float *d = frand(n, 1.0, 0.0), *ref = fvec(n);
		const float *du[3], *A[3];
		struct gpu_lora_dx ad[3], adr[3], ad16[3];
		for (int g = 0; g < G; g++) {
			float *u = frand(nu, 1.0, 0.0), *a = frand(na, 0.5, 0.0);
			du[g] = u, A[g] = a;
			ad[g] = (struct gpu_lora_dx){.du = dputf(u, nu), .A = dputf(a, na), .R = R,
						     .cols = cols};
			adr[g] = (struct gpu_lora_dx){.du = dputf(bf16_rounded(u, nu), nu),
						      .A = dputf(bf16_rounded(a, na), na),
						      .R = R,
						      .cols = cols};
			ad16[g] = (struct gpu_lora_dx){.du = ad[g].du, .A16 = dput16(a, na), .R = R,
						       .cols = cols};
		}
		memcpy(ref, d, n * sizeof(float));
		lora_dx_add(ref, du, A, G, rows, R, cols);
		float *d_d = dputf(d, n);
		gpu_lora_dx_add(be, d_d, ad, G, rows);
		expect_exact("dinp", hget(d_d, n), ref, n);
		const float *dur[3], *Ar[3];
		for (int g = 0; g < G; g++) {
			dur[g] = bf16_rounded(du[g], nu);
			Ar[g] = bf16_rounded(A[g], na);
		}
		float *refr = fvec(n);
		memcpy(refr, d, n * sizeof(float));
		lora_dx_add(refr, dur, Ar, G, rows, R, cols);
		float *d_r = dputf(d, n), *d_b = dputf(d, n);
		gpu_lora_dx_add(be, d_r, adr, G, rows);
		expect_exact("dinp (rounded values)", hget(d_r, n), refr, n);
		gpu_lora_dx_add(be, d_b, ad16, G, rows);
		const float *got = hget(d_b, n);
		size_t bad = 0;
		double worst = 0.0;
		for (int r = 0; r < rows; r++)
			for (int i = 0; i < cols; i++) {
				double S = 0.0;
				for (int g = 0; g < G; g++)
					for (int k = 0; k < R; k++)
						S += fabs((double)dur[g][(size_t)r * R + k] *
							  Ar[g][(size_t)k * cols + i]);
				const size_t e = (size_t)r * cols + i;
				const double bound = (G * R + 2) * ldexp(S, -22) + ldexp(fabs(refr[e]), -23);
				const double err = fabs((double)got[e] - refr[e]);
				bad += !(err <= bound);
				worst = err / bound > worst ? err / bound : worst;
			}
		CHECK_MSG(bad == 0, "%s: dinp (bf16 copies): %zu of %zu values past their bound "
			  "(worst err/bound %.3g)", where, bad, n, worst);
		case_end();
	}
	op_report("lora_dx_add");
}

static void test_residual_scale(void)
{
	static const size_t sizes[] = { 1, 67, (1u << 20) + 7 };
	op_begin();
	for (size_t ci = 0; ci < COUNT(sizes); ci++) {
		size_t n = sizes[ci];
		snprintf(where, sizeof(where), "residual/scale (n=%zu)", n);
		float *a = frand(n, 1.0, 0.0), *b = frand(n, 1.0, 0.0);
		float *out = fvec(n);
		residual_forward(out, a, b, n);
		float *d_a = dputf(a, n), *d_b = dputf(b, n), *d_out = dnan(n);
		gpu_residual_forward(be, d_out, d_a, d_b, n);
		expect_exact("residual out", hget(d_out, n), out, n);
		gpu_residual_forward(be, d_a, d_a, d_b, n);
		expect_exact("residual out (== a)", hget(d_a, n), out, n);
		gpu_upload(be, d_a, a, n * sizeof(float));
		gpu_residual_forward(be, d_b, d_a, d_b, n);
		expect_exact("residual out (== b)", hget(d_b, n), out, n);

		const float s = 0.37f;
		float *x = fcopy(a, n);
		scale_inplace(x, s, n);
		gpu_scale(be, d_a, s, n);
		expect_exact("scale", hget(d_a, n), x, n);
		/* one float in: not 16-byte aligned, the one-wide kernel */
		if (n > 1) {
			gpu_upload(be, d_a, a, n * sizeof(float));
			float *y = fcopy(a, n);
			scale_inplace(y + 1, s, n - 1);
			gpu_scale(be, d_a + 1, s, n - 1);
			expect_exact("scale (unaligned)", hget(d_a, n), y, n);
		}
		case_end();
	}
	op_report("residual, scale");
}

static void test_crossentropy(void)
{
	/* V=152064: Qwen2's vocabulary; V=1: a degenerate softmax. */
	static const struct { int N, V; } cases[] = {
		{ 5, 8 }, { 7, 67 }, { 3, 1 }, { 64, 1000 }, { 4, 50000 }, { 3, 152064 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int N = cases[ci].N, V = cases[ci].V;
		size_t nl = (size_t)N * V;
		snprintf(where, sizeof(where), "crossentropy (N=%d V=%d)", N, V);
		float *logits = frand(nl, 4.0, 0.0);
		/* Row 0 far from 0: only a max-subtracted exp survives it. */
		for (int i = 0; i < V; i++)
			logits[i] += 80.0f;
		int32_t *targets = ids_rand(N, V);
		int valid = 0;
		for (int n = 0; n < N; n++) {
			if (n % 3 == 2)
				targets[n] = -100;
			valid += targets[n] != -100;
		}
		float dloss = 1.0f / (float)(valid ? valid : 1);
		float *d_logits = dputf(logits, nl);
		int32_t *d_targets = dput(targets, sizeof(int32_t) * (size_t)N);

		float *losses = fvec((size_t)N);
		crossentropy_forward(losses, logits, targets, N, V);
		float *d_losses = dnan((size_t)N);
		gpu_crossentropy_forward(be, d_losses, d_logits, NULL, d_targets, N, V);
		expect_red("losses", hget(d_losses, (size_t)N), losses, (size_t)N, 1);

		float *dlogits = fvec(nl);
		crossentropy_backward(dlogits, logits, targets, dloss, N, V);
		float *d_dlogits = dnan(nl);
		gpu_crossentropy_backward(be, NULL, d_dlogits, NULL, d_logits, NULL, d_targets, dloss, N, V);
		float *g_dlogits = hget(d_dlogits, nl);
		expect_close("dlogits", g_dlogits, dlogits, nl, SOFT_ATOL, SOFT_RTOL);
		/* in place, with the forward's losses (the fused head): the same
		 * bits as the two ops apart */
		float *g_losses = hget(d_losses, (size_t)N);
		float *d_losses2 = dnan((size_t)N);
		gpu_crossentropy_backward(be, d_losses2, d_logits, NULL, d_logits, NULL, d_targets, dloss,
					  N, V);
		expect_same_bits("dlogits (in place)", hget(d_logits, nl), g_dlogits, nl);
		expect_same_bits("losses (fused)", hget(d_losses2, (size_t)N), g_losses, (size_t)N);
		case_end();
	}
	op_report("crossentropy");
}

static void test_adamw(void)
{
	/* off: the tensors start off floats into their allocations. 0 takes the
	 * four-wide kernel where n allows (its n % 4 tail too: 67, 2^20 + 7),
	 * 1 the one-wide (the pointers not 16-byte aligned); both the same bits
	 * as the CPU. gscale (a clip's coefficient) 1 or not, on both kernels. */
	static const struct { size_t n; int t; float wd; size_t off; } cases[] = {
		{ 1, 1, 0.0f, 0 }, { 67, 1, 0.1f, 0 }, { 1000, 7, 0.0f, 0 },
		{ (1u << 20) + 7, 1000, 0.01f, 0 }, { 1001, 3, 0.01f, 1 }, { 4096, 2, 0.0f, 1 },
	};
	const float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f;
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		size_t n = cases[ci].n;
		int t = cases[ci].t;
		float wd = cases[ci].wd;
		const float gscale = ci % 3 == 1 ? 0.3712f : 1.0f;
		snprintf(where, sizeof(where), "adamw (n=%zu t=%d wd=%g gscale=%g)", n, t, wd, gscale);
		const size_t off = cases[ci].off, na = n + off;
		float *param = frand(na, 1.0, 0.0), *grad = frand(na, 1.0, 0.0);
		float *m = frand(na, 0.1, 0.0), *v = frand(na, 0.005, 0.005);
		float *d_param = dputf(param, na) + off, *d_grad = dputf(grad, na) + off;
		float *d_m = dputf(m, na) + off, *d_v = dputf(v, na) + off;
		param += off, grad += off, m += off, v += off;
		adamw_update(param, grad, gscale, m, v, n, lr, beta1, beta2, eps, wd, t);
		gpu_bf16 *d_param16 = ci % 2 ? dnan16(na) + off : NULL; /* with a bf16 copy, and without */
		gpu_adamw_update(be, d_param, d_param16, d_grad, gscale, d_m, d_v, n, lr, beta1, beta2,
				 eps, wd, t);
		expect_exact("param", hget(d_param, n), param, n);
		if (d_param16)
			expect_twin("param16", d_param16, param, n);
		expect_exact("m", hget(d_m, n), m, n);
		expect_exact("v", hget(d_v, n), v, n);
		case_end();
	}
	op_report("adamw");
	/* adamw_update_rows (an untied embedding's, its gradient by rows):
	 * C a multiple of 4 with aligned pointers takes the by-rows four-wide
	 * kernel (C / 4 of 1024 quads: 4 a thread, of 24: part of a warp), else
	 * the one-wide; every third row without a gradient (zeros); the same
	 * bits as the CPU op. */
	static const struct { int C, rows, slots; size_t off; int t; float wd; } rcases[] = {
		{ 4096, 37, 13, 0, 1, 0.1f }, { 96, 1000, 400, 0, 5, 0.0f }, { 6, 50, 20, 0, 2, 0.01f },
		{ 96, 40, 17, 1, 3, 0.01f },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(rcases); ci++) {
		const int C = rcases[ci].C, R = rcases[ci].rows, S = rcases[ci].slots;
		const size_t n = (size_t)C * (size_t)R, off = rcases[ci].off, na = n + off;
		const float gscale = ci % 2 ? 0.3712f : 1.0f;
		snprintf(where, sizeof(where), "adamw_update_rows (C=%d rows=%d off=%zu)", C, R, off);
		float *param = frand(na, 1.0, 0.0), *m = frand(na, 0.1, 0.0), *v = frand(na, 0.005, 0.005);
		float *rows = frand((size_t)S * C, 1.0, 0.0);
		int32_t *row_of = malloc((size_t)R * sizeof(int32_t));
		for (int r = 0; r < R; r++)
			row_of[r] = r % 3 == 2 ? -1 : (r * 7) % S;
		float *d_param = dputf(param, na) + off, *d_m = dputf(m, na) + off;
		float *d_v = dputf(v, na) + off, *d_rows = dputf(rows, (size_t)S * C);
		int32_t *d_row_of = dput(row_of, (size_t)R * sizeof(int32_t));
		param += off, m += off, v += off;
		adamw_update_rows(param, rows, row_of, C, gscale, m, v, n, lr, beta1, beta2, eps,
				  rcases[ci].wd, rcases[ci].t);
		gpu_adamw_update_rows(be, d_param, d_rows, d_row_of, C, gscale, d_m, d_v, n, lr, beta1,
				      beta2, eps, rcases[ci].wd, rcases[ci].t);
		expect_exact("param", hget(d_param, n), param, n);
		expect_exact("m", hget(d_m, n), m, n);
		expect_exact("v", hget(d_v, n), v, n);
		free(row_of);
		case_end();
	}
	op_report("adamw_update_rows");
}

static void test_sumsq(void)
{
	/* off 1: x one float into its allocation, not 16-byte aligned (the
	 * one-wide kernel); 0: the four-wide, with an n % 4 tail where n has. */
	static const struct { size_t n, off; } sizes[] = {
		{ 0, 0 }, { 1, 0 }, { 67, 0 }, { 4096, 0 }, { (1u << 20) + 7, 0 }, { (1u << 23) + 3, 0 },
		{ 67, 1 }, { (1u << 20) + 7, 1 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(sizes); ci++) {
		size_t n = sizes[ci].n, off = sizes[ci].off;
		snprintf(where, sizeof(where), "sumsq (n=%zu, offset %zu)", n, off);
		float *x = frand(n + off, 1.0, 0.0);
		float *d_x = dputf(x, n + off) + off;
		x += off;
		double ref = sumsq(x, n);
		double got = gpu_sumsq(be, d_x, n);
		double again = gpu_sumsq(be, d_x, n);
		synced("sumsq");
		CHECK_MSG(fabs(got - ref) <= SUMSQ_RTOL * ref, "%s: gpu %.17g cpu %.17g", where, got,
			  ref);
		CHECK_MSG(memcmp(&got, &again, sizeof(got)) == 0, "%s: %.17g then %.17g", where, got,
			  again);
		double ratio = ref > 0.0 ? fabs(got - ref) / (SUMSQ_RTOL * ref) : 0.0;
		op_max_ratio = ratio > op_max_ratio ? ratio : op_max_ratio;
		op_max_abs = fabs(got - ref) > op_max_abs ? fabs(got - ref) : op_max_abs;
		op_arrays++;
		case_end();
	}
	op_report("sumsq");
}

/* bf16_round and bf16_widen: the CPU ops' bits (kernels/cpu/ops.h),
 * infinities, ties and overflow to infinity included; a NaN stays a NaN. */
static void test_bf16_convert(void)
{
	static const size_t sizes[] = { 1, 3, 4, 1001, (1u << 20) + 5 };
	op_begin();
	for (size_t ci = 0; ci < COUNT(sizes); ci++) {
		size_t n = sizes[ci];
		snprintf(where, sizeof(where), "bf16 convert (n=%zu)", n);
		float *x = frand(n, 1000.0, 0.0);
		static const uint32_t special[] = { 0x7fc00000u, 0xffc00001u, 0x7f800000u, 0xff800000u,
						    0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x00000001u };
		for (size_t i = 0; i < n && i < COUNT(special); i++)
			memcpy(&x[i], &special[i], sizeof(float));
		uint16_t *h = hmem(n * sizeof(uint16_t)), *g = hmem(n * sizeof(uint16_t));
		bf16_round(h, x, n);
		gpu_bf16 *d16 = dnan16(n);
		gpu_bf16_round(be, d16, dputf(x, n), n);
		gpu_download(be, g, d16, n * sizeof(uint16_t));
		/* NaN: a NaN (the CPU writes 0x7fff; the device's payload is its own) */
		size_t bad = 0;
		for (size_t i = 0; i < n; i++) {
			bool nan = (h[i] & 0x7fffu) > 0x7f80u;
			bad += nan ? (g[i] & 0x7fffu) <= 0x7f80u : g[i] != h[i];
		}
		CHECK_MSG(bad == 0, "%s: bf16_round differs from the CPU's in %zu of %zu values", where,
			  bad, n);
		float *w = fvec(n), *d_w = dnan(n);
		bf16_widen(w, g, n); /* of the device's bf16 values: exact either way */
		gpu_bf16_widen(be, d_w, d16, n);
		expect_same_bits("bf16_widen", hget(d_w, n), w, n);
		case_end();
	}
	/* bf16_round_rows: each row into its place in a wider matrix, the
	 * columns around it untouched (a sentinel) */
	static const struct { size_t rows, cols, ldo, off; } shapes[] = {
		{1, 1, 3, 1}, {5, 7, 20, 13}, {300, 896, 1152, 0}, {300, 128, 1152, 896},
		{300, 128, 1152, 1024}, {3, 5000, 5003, 2}, {4, 8, 12, 2}, {4, 8, 12, 4}};
	for (size_t ci = 0; ci < COUNT(shapes); ci++) {
		const size_t R = shapes[ci].rows, Cc = shapes[ci].cols, L = shapes[ci].ldo,
			     O = shapes[ci].off, n = R * Cc, nt = R * L;
		snprintf(where, sizeof(where), "bf16_round_rows (%zu x %zu into ld %zu at %zu)", R, Cc,
			 L, O);
		float *x = frand(n, 1000.0, 0.0);
		uint16_t *want = hmem(nt * sizeof(uint16_t)), *got = hmem(nt * sizeof(uint16_t));
		for (size_t i = 0; i < nt; i++)
			want[i] = 0x7fa5u; /* a NaN no rounding writes */
		gpu_bf16 *d16 = dnan16(nt);
		gpu_upload(be, d16, want, nt * sizeof(uint16_t)); /* the sentinel everywhere */
		for (size_t r = 0; r < R; r++)
			bf16_round(want + r * L + O, x + r * Cc, Cc);
		gpu_bf16_round_rows(be, d16 + O, L, dputf(x, n), R, Cc);
		gpu_download(be, got, d16, nt * sizeof(uint16_t));
		size_t bad = 0;
		for (size_t i = 0; i < nt; i++)
			bad += got[i] != want[i];
		CHECK_MSG(bad == 0, "%s: %zu of %zu values differ from the CPU's rows", where, bad, nt);
		case_end();
	}
	op_report("bf16 convert");
}

static void test_nf4(void)
{
	/* Sizes around the 64-value block and the 256-absmax block, and odd n
	 * (a half-filled last code byte). */
	static const size_t sizes[] = { 1, 63, 64, 1001, 64 * 256 + 5, (1u << 20) + 5 };
	op_begin();
	for (size_t ci = 0; ci < COUNT(sizes); ci++) {
		size_t n = sizes[ci], nb = (n + NF4_BLOCK - 1) / NF4_BLOCK;
		size_t ns = (nb + NF4_DQ_BLOCK - 1) / NF4_DQ_BLOCK;
		snprintf(where, sizeof(where), "nf4 (n=%zu)", n);
		float *w = frand(n, 1.0, 0.0);
		uint8_t *codes = hmem((n + 1) / 2);
		float *absmax = fvec(nb);
		nf4_quantize(codes, absmax, w, n);
		float *out = fvec(n);
		nf4_dequantize(out, codes, absmax, n);
		float *d_out = dnan(n);
		float *d_absmax = dputf(absmax, nb);
		uint8_t *d_codes = dput(codes, (n + 1) / 2);
		gpu_nf4_dequantize(be, d_out, NULL, d_codes, d_absmax, n);
		expect_exact("nf4 out", hget(d_out, n), out, n);
		/* in bf16 (the bf16 mode's GEMM operand): out rounded */
		gpu_bf16 *d_out16 = dnan16(n);
		gpu_nf4_dequantize(be, NULL, d_out16, d_codes, d_absmax, n);
		expect_twin("nf4 out16", d_out16, out, n);

		int8_t *q = hmem(nb);
		float *scale = fvec(ns + 1);
		absmax_quantize(q, scale, absmax, nb);
		float *am = fvec(nb);
		absmax_dequantize(am, q, scale, nb);
		gpu_upload(be, d_absmax, ffill(nb, NAN), nb * sizeof(float));
		gpu_absmax_dequantize(be, d_absmax, dput(q, nb), dputf(scale, ns + 1), nb);
		expect_exact("absmax", hget(d_absmax, nb), am, nb);
		case_end();
	}
	op_report("nf4, absmax");
}

static void test_dropout(void)
{
	static const struct { size_t n; float p; uint64_t seed; } cases[] = {
		{ 1, 0.1f, 1 }, { 1000, 0.0f, 7 }, { 1000, 0.5f, 7 }, { (1u << 20) + 3, 0.1f, 1234567 },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		size_t n = cases[ci].n;
		float p = cases[ci].p;
		uint64_t seed = cases[ci].seed;
		snprintf(where, sizeof(where), "dropout (n=%zu p=%g)", n, p);
		float *inp = frand(n, 1.0, 0.0);
		float *out = fvec(n);
		dropout_forward(out, inp, p, seed, n);
		float *d_inp = dputf(inp, n), *d_out = dnan(n);
		gpu_dropout(be, d_out, d_inp, p, seed, n);
		expect_exact("out", hget(d_out, n), out, n);
		gpu_dropout(be, d_inp, d_inp, p, seed, n);
		expect_exact("out (in place)", hget(d_inp, n), out, n);
		case_end();
	}
	op_report("dropout");
}

static void test_distill(void)
{
	static const struct { int N, V; float temperature, alpha; } cases[] = {
		{ 5, 8, 2.0f, 0.5f }, { 7, 67, 1.0f, 0.9f }, { 3, 1, 2.0f, 0.5f },
		{ 4, 50000, 2.0f, 0.5f }, { 3, 152064, 1.5f, 0.7f },
	};
	op_begin();
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		int N = cases[ci].N, V = cases[ci].V;
		float temp = cases[ci].temperature, alpha = cases[ci].alpha;
		size_t nl = (size_t)N * V;
		snprintf(where, sizeof(where), "distill (N=%d V=%d T=%g alpha=%g)", N, V, temp, alpha);
		/* The teacher near the student, as after some training. */
		float *logits = frand(nl, 4.0, 0.0), *tlogits = fvec(nl);
		for (size_t i = 0; i < nl; i++)
			tlogits[i] = logits[i] + (float)urand();
		for (int i = 0; i < V; i++)
			logits[i] += 40.0f;
		int32_t *targets = ids_rand(N, V);
		int valid = 0;
		for (int n = 0; n < N; n++) {
			if (n % 3 == 1)
				targets[n] = -100;
			valid += targets[n] != -100;
		}
		float dloss = 1.0f / (float)(valid ? valid : 1);
		float *d_logits = dputf(logits, nl), *d_tlogits = dputf(tlogits, nl);
		int32_t *d_targets = dput(targets, sizeof(int32_t) * (size_t)N);

		float *kl = fvec((size_t)N), *ce = fvec((size_t)N);
		distill_forward(kl, ce, logits, tlogits, targets, temp, N, V);
		float *d_kl = dnan((size_t)N), *d_ce = dnan((size_t)N);
		gpu_distill_forward(be, d_kl, d_ce, d_logits, d_tlogits, d_targets, temp, N, V);
		expect_red("kl", hget(d_kl, (size_t)N), kl, (size_t)N, 1);
		expect_red("ce", hget(d_ce, (size_t)N), ce, (size_t)N, 1);

		float *dlogits = fvec(nl);
		distill_backward(dlogits, logits, tlogits, targets, dloss, alpha, temp, N, V);
		float *d_dlogits = dnan(nl);
		gpu_distill_backward(be, d_dlogits, d_logits, d_tlogits, d_targets, dloss, alpha, temp,
				     N, V);
		expect_close_scaled("dlogits", hget(d_dlogits, nl), dlogits, nl, 0.0, 1e-4, 1e-5);
		gpu_distill_backward(be, d_logits, d_logits, d_tlogits, d_targets, dloss, alpha, temp,
				     N, V);
		expect_close_scaled("dlogits (in place)", hget(d_logits, nl), dlogits, nl, 0.0, 1e-4,
				    1e-5);
		case_end();
	}
	op_report("distill");
}

int main(void)
{
	struct td_errbuf eb = {{0}};
	if (gpu_backend_open(&be, "cuda", &eb) != TD_OK)
		return check_skip(eb.msg);
	fprintf(stderr, "device: %s\n", be->device);
	test_embedding();
	test_rmsnorm();
	test_matmul();
	test_rope();
	test_attention();
	test_flash_attention();
	test_flash_no_scratch();
	test_matmul_bf16();
	test_matmul_ld16();
	test_gemm_tune();
	test_twins();
	test_swiglu();
	test_residual_scale();
	test_crossentropy();
	test_adamw();
	test_sumsq();
	test_bf16_convert();
	test_nf4();
	test_dropout();
	test_distill();
	/* Contract 2: nothing compiles after the kernel table is sealed. */
	fprintf(stderr, "compiles: %lld (after seal: %lld)\n", (long long)be->compiles,
		(long long)be->compiles_after_seal);
	CHECK_EQ_INT(be->compiles_after_seal, 0);
	CHECK_EQ_INT(be->bytes_in_use, 0);
	gpu_backend_free(be);
	return check_status();
}
