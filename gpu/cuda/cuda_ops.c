/* The CUDA backend's math ops: one launcher per op of gpu/backend.h's math
 * section, fp32, and cu_ops_fill, which puts them in the ops table.
 *
 * A launcher computes the grid, packs pointers to its arguments for
 * cuLaunchKernel and enqueues kernels (the .cu files of kernels/cuda,
 * reached through the sealed table by enum) and cuBLAS calls on the
 * backend's stream. It never synchronises (sumsq excepted: it is blocking by
 * contract) and checks nothing itself: cu_launch and cu_check_blas record
 * the first error, which the next gpu_sync reports. Every op matches its CPU
 * twin in kernels/cpu/ops.h (overwrite or accumulate, NULL outputs, the
 * allowed aliasing); each is deterministic run to run (fixed reduction
 * orders, no float atomics), and the elementwise ones whose arithmetic allows
 * it are bit-identical to the CPU.
 *
 * GEMMs are cuBLAS calls with llm.c's row-major trick: a row-major (R, K)
 * matrix is a column-major (K, R) one, so out (N,OC) = inp (N,C) W(OC,C)^T is
 * the column-major out^T = W^T inp^T, sgemm(T, N, m=OC, n=N, k=C). The
 * backend's cuBLAS handle is on its stream, without TF32 in fp32 mode (SGEMMs);
 * in the bf16 mode they are bf16 products, each shape's algorithm the
 * fastest, timed once, of cublasGemmEx's default and those of cuBLASLt's that
 * give its bits (lt_tune; TD_CUDA_NO_GEMM_TUNE=1: the default alone).
 *
 * Not here: the backend's memory, context and kernel table (cuda_backend.c).
 *
 * Key: B batch, T sequence, N = B*T rows, C channels, OC output channels,
 * V vocab, NH query heads, NKV key/value heads, HS head size. */
#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_internal.h"
#include "kernels/cpu/ops.h"

/* Threads of an elementwise block, and the most blocks of a grid-stride
 * launch (more work loops inside the kernel). */
#define CU_THREADS 256
#define CU_MAX_GRID 65536u
/* Row kernels with one block per row (V up to ~152k for the vocabulary). */
#define CU_VOCAB_THREADS 512
/* sumsq: at most this many per-block partials (also bounded by reduce_cap),
 * each block covering at least CU_SUMSQ_MIN values. */
#define CU_SUMSQ_MAX_BLOCKS 1024
#define CU_SUMSQ_MIN (CU_THREADS * 16)
/* Column sums (dbias, rmsnorm's dweight): aim for this many blocks, with at
 * least CU_COLSUM_MIN_ROWS rows per part and at most CU_COLSUM_MAX_PARTS parts. */
#define CU_COLSUM_TARGET_BLOCKS 256
#define CU_COLSUM_MIN_ROWS 128
#define CU_COLSUM_MAX_PARTS 64

/* ---------------------------------------------------------------- helpers -- */

static struct cu_dim dim1(unsigned x)
{
	return (struct cu_dim){x, 1, 1};
}

static unsigned grid_cap(size_t blocks)
{
	return blocks > CU_MAX_GRID ? CU_MAX_GRID : (unsigned)blocks;
}

/* A grid-stride elementwise launch over n values. */
static void launch_n(struct cu_backend *cb, enum cu_kernel k, size_t n, void **args)
{
	if (n == 0)
		return;
	cu_launch(cb, k, dim1(grid_cap((n + CU_THREADS - 1) / CU_THREADS)), dim1(CU_THREADS), 0,
		  args);
}

/* A grid-stride launch over n values for a kernel that takes four a step
 * (elementwise.cu's vector paths). */
static void launch_n4(struct cu_backend *cb, enum cu_kernel k, size_t n, void **args)
{
	if (n == 0)
		return;
	cu_launch(cb, k, dim1(grid_cap((n / 4 + CU_THREADS) / CU_THREADS)), dim1(CU_THREADS), 0,
		  args);
}

/* The same for a kernel that takes eight a step. */
static void launch_n8(struct cu_backend *cb, enum cu_kernel k, size_t n, void **args)
{
	if (n == 0)
		return;
	cu_launch(cb, k, dim1(grid_cap((n / 8 + CU_THREADS) / CU_THREADS)), dim1(CU_THREADS), 0,
		  args);
}

/* out (n bf16) = in (n floats) rounded: cast_bf16_f32 takes four values a
 * thread step. */
static void launch_cast(struct cu_backend *cb, uint16_t *out, const float *in, size_t n)
{
	void *args[] = {&out, &in, &n};
	if (n)
		cu_launch(cb, CU_K_cast_bf16_f32,
			  dim1(grid_cap((n / 4 + CU_THREADS) / CU_THREADS)), dim1(CU_THREADS), 0,
			  args);
}

/* Threads for a block that owns one row of C values: whole warps, enough to
 * give each thread a few values, at most 512. */
static unsigned row_threads(int C)
{
	if (C >= 4096)
		return 512;
	if (C >= 256)
		return 256;
	return C <= 32 ? 32 : (unsigned)(C + 31) / 32 * 32;
}

/* A one-block-per-row launch over N rows of C values. */
static void launch_rows(struct cu_backend *cb, enum cu_kernel k, int N, unsigned threads,
			void **args)
{
	if (N <= 0)
		return;
	cu_launch(cb, k, dim1(grid_cap((size_t)N)), dim1(threads), 0, args);
}

/* The reduction scratch (cuda_internal.h: reduce_buf, reduce_cap doubles),
 * seen as floats: the column sums keep their per-part partials there.
 * Stream order makes sharing it with sumsq safe. */
static float *scratch_floats(struct cu_backend *cb, size_t *cap)
{
	*cap = cb->reduce_buf ? cb->reduce_cap * (sizeof(double) / sizeof(float)) : 0;
	return (float *)cb->reduce_buf;
}

/* How a column sum over N rows of C columns is split: parts chunks of
 * rows_per_part rows, each reduced by its own blocks. One part adds straight
 * into the output; more write partials to the scratch, which colsum_reduce
 * adds up in part order. The split is a function of (N, C, scratch size) only,
 * so the bits are the same on every run. */
struct colsum_plan {
	unsigned parts;
	int rows_per_part;
	float *partial; /* scratch, when parts > 1 */
};

static struct colsum_plan plan_colsum(struct cu_backend *cb, int N, int C)
{
	size_t cap;
	float *scratch = scratch_floats(cb, &cap);
	size_t tiles = cu_blocks((size_t)C, 32);
	size_t parts = (CU_COLSUM_TARGET_BLOCKS + tiles - 1) / tiles;
	size_t by_rows = (size_t)N / CU_COLSUM_MIN_ROWS;
	size_t by_scratch = cap / (size_t)C;
	if (parts > by_rows)
		parts = by_rows;
	if (parts > by_scratch)
		parts = by_scratch;
	if (parts > CU_COLSUM_MAX_PARTS)
		parts = CU_COLSUM_MAX_PARTS;
	if (parts < 1)
		parts = 1;
	struct colsum_plan p;
	p.rows_per_part = (int)(((size_t)N + parts - 1) / parts);
	p.parts = (unsigned)(((size_t)N + p.rows_per_part - 1) / p.rows_per_part);
	p.partial = p.parts > 1 ? scratch : NULL;
	return p;
}

/* out (C) += the parts' partials, in part order. */
static void colsum_finish(struct cu_backend *cb, float *out, const struct colsum_plan *p, int C)
{
	if (p->parts <= 1)
		return;
	int P = (int)p->parts;
	const float *partial = p->partial;
	void *args[] = {&out, &partial, &P, &C};
	launch_n(cb, CU_K_colsum_reduce_f32, (size_t)C, args);
}

static void sgemm_(struct cu_backend *cb, const char *what, cublasOperation_t ta,
		   cublasOperation_t tb, int m, int n, int k, float alpha, const float *A,
		   const gpu_bf16 *A16, int lda, const float *B, const gpu_bf16 *B16, int ldb,
		   float beta, float *C, int ldc);

/* Column-major GEMM on the backend's handle, C = alpha op(A) op(B) + beta C
 * with C (m, n). beta == 0 never reads C (cuBLAS's contract), so an
 * overwritten output may hold anything, NaN included. A16, B16: bf16 twins
 * of A, B (gpu/backend.h), or NULL; used in the bf16 mode, where A (B) may be
 * NULL if its twin is not. */
static void sgemm(struct cu_backend *cb, const char *what, cublasOperation_t ta,
		  cublasOperation_t tb, int m, int n, int k, float alpha, const float *A,
		  const gpu_bf16 *A16, int lda, const float *B, const gpu_bf16 *B16, int ldb,
		  float beta, float *C, int ldc)
{
	cu_prof_begin(cb);
	sgemm_(cb, what, ta, tb, m, n, k, alpha, A, A16, lda, B, B16, ldb, beta, C, ldc);
	cu_prof_end(cb, "%s %dx%dx%d", what, m, n, k);
}

/* A bf16 GEMM operand without a twin: x (n floats) rounded into slot, a
 * part of be->gemm_scratch (gpu/backend.h lays the parts out). */
static const uint16_t *round_into(struct cu_backend *cb, uint16_t *slot, const float *x, size_t n)
{
	launch_cast(cb, slot, x, n);
	return slot;
}

/* Elements of an op(X) operand with leading dimension ld: ld * columns. */
static size_t operand_elems(cublasOperation_t op, int ld, int rows_if_t, int cols_if_n)
{
	return (size_t)ld * (size_t)(op == CUBLAS_OP_N ? cols_if_n : rows_if_t);
}

/* Whether the scratch holds elems bf16 values (none needed always fits). */
static bool scratch_fits(const struct cu_backend *cb, size_t elems)
{
	return elems == 0 ||
	       (cb->base.gemm_scratch && 2 * elems <= cb->base.gemm_scratch_bytes);
}

/* ------------------------------------------------------ cuBLASLt plans -- */

/* The largest power of two, at most 256, that divides every address. */
static unsigned common_align(const void *a, const void *b, const void *c, const void *d)
{
	uintptr_t x = (uintptr_t)a | (uintptr_t)b | (uintptr_t)c | (uintptr_t)d | 256;
	return (unsigned)(x & -x);
}

/* cuBLASLt's plan for D (m, n) = alpha op(A) op(B) + beta C, column-major,
 * A and B bf16, D fp32 or bf16 (out16), C = D or (resid) an fp32 addend
 * apart from it: made the first time the backend sees the shape (its
 * operations, sizes, leading dimensions and the pointers' alignment), with
 * the heuristic's first CU_LT_ALGOS algorithms within the cuBLAS
 * workspace. NULL where there is no handle, no room for another shape or
 * no algorithm (the caller then takes cublasGemmEx). */
static struct cu_lt_plan *lt_plan_(struct cu_backend *cb, cublasOperation_t ta,
				   cublasOperation_t tb, int m, int n, int k, int lda, int ldb,
				   int ldc, bool out16, bool resid, bool bias, unsigned align)
{
	if (!cb->lt)
		return NULL;
	for (int i = 0; i < cb->lt_nplans; i++) {
		struct cu_lt_plan *lp = &cb->lt_plans[i];
		if (lp->ta == (int)ta && lp->tb == (int)tb && lp->m == m && lp->n == n &&
		    lp->k == k && lp->lda == lda && lp->ldb == ldb && lp->ldc == ldc &&
		    lp->out16 == out16 && lp->resid == resid && lp->bias == bias &&
		    lp->align == align)
			return lp->nalgo > 0 ? lp : NULL;
	}
	if (cb->lt_nplans == CU_LT_PLANS)
		return NULL;
	struct cu_lt_plan *lp = &cb->lt_plans[cb->lt_nplans];
	*lp = (struct cu_lt_plan){.ta = (int)ta, .tb = (int)tb, .m = m, .n = n, .k = k, .lda = lda,
				  .ldb = ldb, .ldc = ldc, .out16 = out16, .resid = resid,
				  .bias = bias, .align = align,
				  .chosen = resid || bias ? 0 : -1}; /* the reference */
	const cublasLtEpilogue_t epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
	const cudaDataType_t dt = out16 ? CUDA_R_16BF : CUDA_R_32F;
	cublasLtMatmulPreference_t pref = NULL;
	cublasLtMatmulHeuristicResult_t res[CU_LT_ALGOS];
	int found = 0;
	const size_t ws = cb->blas_ws_bytes;
	const uint32_t al = align;
	if (cublasLtMatmulDescCreate(&lp->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) ||
	    cublasLtMatmulDescSetAttribute(lp->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)) ||
	    cublasLtMatmulDescSetAttribute(lp->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)) ||
	    cublasLtMatmulDescSetAttribute(lp->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)) ||
	    cublasLtMatrixLayoutCreate(&lp->la, CUDA_R_16BF, ta == CUBLAS_OP_N ? m : k,
				       ta == CUBLAS_OP_N ? k : m, lda) ||
	    cublasLtMatrixLayoutCreate(&lp->lb, CUDA_R_16BF, tb == CUBLAS_OP_N ? k : n,
				       tb == CUBLAS_OP_N ? n : k, ldb) ||
	    cublasLtMatrixLayoutCreate(&lp->lc, resid ? CUDA_R_32F : dt, m, n, ldc) ||
	    cublasLtMatrixLayoutCreate(&lp->ld, dt, m, n, ldc) ||
	    cublasLtMatmulPreferenceCreate(&pref) ||
	    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
						 sizeof(ws)) ||
	    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al,
						 sizeof(al)) ||
	    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al,
						 sizeof(al)) ||
	    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al,
						 sizeof(al)) ||
	    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al,
						 sizeof(al)) ||
	    cublasLtMatmulAlgoGetHeuristic(cb->lt, lp->desc, lp->la, lp->lb, lp->lc, lp->ld, pref,
					   CU_LT_ALGOS, res, &found))
		found = 0;
	for (int i = 0; i < found; i++)
		if (res[i].state == CUBLAS_STATUS_SUCCESS)
			lp->algo[lp->nalgo++] = res[i].algo;
	if (pref)
		cublasLtMatmulPreferenceDestroy(pref);
	cb->lt_nplans++; /* kept either way: destroyed with the backend, not asked again */
	return lp->nalgo > 0 ? lp : NULL;
}

static struct cu_lt_plan *lt_plan(struct cu_backend *cb, cublasOperation_t ta,
				  cublasOperation_t tb, int m, int n, int k, int lda, int ldb,
				  int ldc, bool out16, bool resid, unsigned align)
{
	return lt_plan_(cb, ta, tb, m, n, k, lda, ldb, ldc, out16, resid, false, align);
}

static cublasStatus_t lt_run(struct cu_backend *cb, const struct cu_lt_plan *lp, int i,
			     float alpha, const uint16_t *A, const uint16_t *B, float beta,
			     const void *C, void *D)
{
	return cublasLtMatmul(cb->lt, lp->desc, &alpha, A, lp->la, B, lp->lb, &beta, C, lp->lc, D,
			      lp->ld, &lp->algo[i], cb->blas_ws, cb->blas_ws_bytes,
			      (cudaStream_t)cb->stream);
}

/* cublasGemmEx's default: bf16 x bf16 -> D (fp32, or bf16 with out16),
 * fp32 accumulation; the backend's way before cuBLASLt's algorithms were
 * timed, and the reference they are held to (lt_tune). */
static cublasStatus_t gemm_ex(struct cu_backend *cb, cublasOperation_t ta, cublasOperation_t tb,
			      int m, int n, int k, float alpha, const uint16_t *A, int lda,
			      const uint16_t *B, int ldb, float beta, void *D, bool out16, int ldc)
{
	return cublasGemmEx(cb->blas, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF,
			    ldb, &beta, D, out16 ? CUDA_R_16BF : CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F,
			    CUBLAS_GEMM_DEFAULT);
}

/* gemm_ex for the plan's product */
static cublasStatus_t ex_run(struct cu_backend *cb, const struct cu_lt_plan *lp, float alpha,
			     const uint16_t *A, const uint16_t *B, float beta, void *D)
{
	return gemm_ex(cb, (cublasOperation_t)lp->ta, (cublasOperation_t)lp->tb, lp->m, lp->n, lp->k,
		       alpha, A, lp->lda, B, lp->ldb, beta, D, lp->out16, lp->ldc);
}

/* A fingerprint of D's bits, or (D NULL) of as many zero words (hash_u16
 * into the reduction scratch, then downloaded: blocking); 0 after an
 * error. */
static uint64_t lt_fingerprint(struct cu_backend *cb, const struct cu_lt_plan *lp, const void *D)
{
	unsigned long long *h = (unsigned long long *)cb->reduce_buf;
	size_t n = (size_t)lp->ldc * (size_t)(lp->n - 1) + (size_t)lp->m; /* D's span */
	n *= lp->out16 ? 1 : 2;
	cb->base.ops->zero(&cb->base, h, sizeof(*h));
	const unsigned short *x = D;
	void *args[] = {&h, &x, &n};
	launch_n(cb, CU_K_hash_u16, n, args);
	uint64_t v = 0;
	cb->base.ops->download(&cb->base, &v, h, sizeof(v));
	return cb->first_error == CUDA_SUCCESS ? v : 0;
}

static uint32_t algo_config(const cublasLtMatmulAlgo_t *a, cublasLtMatmulAlgoConfigAttributes_t at)
{
	uint32_t x = UINT32_MAX;
	size_t w;
	if (cublasLtMatmulAlgoConfigGetAttribute(a, at, &x, sizeof(x), &w))
		return UINT32_MAX;
	return x;
}

/* Whether an algorithm may be held to the reference: its split of k and
 * reduction scheme are the first algorithm's (a residual add or a bias,
 * whose reference that is), or none (against cublasGemmEx). Two that differ in
 * them add their products in different orders; the fingerprint decides
 * the rest. */
static bool lt_candidate(const struct cu_lt_plan *lp, int i)
{
	const cublasLtMatmulAlgoConfigAttributes_t at[] = {CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
							   CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME};
	const uint32_t none[] = {1, CUBLASLT_REDUCTION_SCHEME_NONE};
	for (int j = 0; j < 2; j++) {
		const uint32_t x = algo_config(&lp->algo[i], at[j]);
		if (x == UINT32_MAX ||
		    x != (lp->resid || lp->bias ? algo_config(&lp->algo[0], at[j]) : none[j]))
			return false;
	}
	return true;
}

/* Runs algorithm i (-1: cublasGemmEx's default) n times back to back. */
static void lt_repeat(struct cu_backend *cb, const struct cu_lt_plan *lp, int i, int n,
		      float alpha, const uint16_t *A, const uint16_t *B, float beta, const void *C,
		      void *D)
{
	for (int r = 0; r < n; r++)
		if (i < 0)
			ex_run(cb, lp, alpha, A, B, beta, D);
		else
			lt_run(cb, lp, i, alpha, A, B, beta, C, D);
}

static bool lt_events(struct cu_backend *cb)
{
	for (int k = 0; k < CU_LT_EVENTS; k++)
		if (!cb->tune_ev[k] &&
		    cb->drv.cuEventCreate(&cb->tune_ev[k], CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
			cb->tune_ev[k] = NULL;
			return false;
		}
	return true;
}

/* ms a run of each of the n algorithms in ids (-1: cublasGemmEx's default)
 * into ms[], as the step runs them: the device kept busy from before the
 * first timed run to after the last (no wait between them), so at the power
 * cap it holds under a step's products (an H200 at ~1.6 GHz, not its
 * 1.98), where the fastest algorithm when the device is cool need not be
 * the fastest (the 8B shapes' head input gradient: 2.97 ms cool against
 * cublasGemmEx's 3.00, but 3.26 against 2.91 at the cap;
 * tests/bench/gemm_tune.cu). First the reference, back to back for about
 * 30 ms; then CU_LT_ROUNDS rounds of REPS runs of each, the order turned
 * each round; each one's time the median of its rounds. false where an
 * event failed. */
static bool lt_time(struct cu_backend *cb, const struct cu_lt_plan *lp, const int *ids, int n,
		    float *ms, float alpha, const uint16_t *A, const uint16_t *B, float beta,
		    const void *C, void *D)
{
	enum { REPS = 5, HEAT_MS = 30, HEAT_MAX = 400 };
	assert(n >= 1 && n <= CU_LT_ALGOS + 1);
	float t0 = 0;
	cb->drv.cuEventRecord(cb->tune_ev[0], cb->stream);
	lt_repeat(cb, lp, ids[0], REPS, alpha, A, B, beta, C, D);
	cb->drv.cuEventRecord(cb->tune_ev[1], cb->stream);
	if (cb->drv.cuEventSynchronize(cb->tune_ev[1]) != CUDA_SUCCESS ||
	    cb->drv.cuEventElapsedTime(&t0, cb->tune_ev[0], cb->tune_ev[1]) != CUDA_SUCCESS)
		return false;
	const float per = t0 / REPS > 1e-3f ? t0 / REPS : 1e-3f;
	const int heat = HEAT_MS / per < HEAT_MAX ? (int)(HEAT_MS / per) : HEAT_MAX;
	lt_repeat(cb, lp, ids[0], heat, alpha, A, B, beta, C, D);
	for (int r = 0, e = 0; r < CU_LT_ROUNDS; r++)
		for (int j = 0; j < n; j++, e++) {
			cb->drv.cuEventRecord(cb->tune_ev[e], cb->stream);
			lt_repeat(cb, lp, ids[(j + r) % n], REPS, alpha, A, B, beta, C, D);
		}
	const int last = CU_LT_ROUNDS * n;
	cb->drv.cuEventRecord(cb->tune_ev[last], cb->stream);
	if (cb->drv.cuEventSynchronize(cb->tune_ev[last]) != CUDA_SUCCESS)
		return false;
	float t[CU_LT_ALGOS + 1][CU_LT_ROUNDS];
	for (int r = 0, e = 0; r < CU_LT_ROUNDS; r++)
		for (int j = 0; j < n; j++, e++) {
			float x;
			if (cb->drv.cuEventElapsedTime(&x, cb->tune_ev[e], cb->tune_ev[e + 1]) !=
			    CUDA_SUCCESS)
				return false;
			t[(j + r) % n][r] = x / REPS;
		}
	for (int j = 0; j < n; j++) { /* the median of the rounds: sorted in place */
		float *v = t[j];
		for (int a = 1; a < CU_LT_ROUNDS; a++)
			for (int b = a; b > 0 && v[b] < v[b - 1]; b--) {
				const float x = v[b];
				v[b] = v[b - 1];
				v[b - 1] = x;
			}
		ms[j] = v[CU_LT_ROUNDS / 2];
	}
	return true;
}

/* Runs the plan's product as the call asks, with the algorithm chosen so far
 * (the reference until timed). */
static void lt_call(struct cu_backend *cb, const struct cu_lt_plan *lp, const char *what,
		    float alpha, const uint16_t *A, const uint16_t *B, float beta, const void *C,
		    void *D)
{
	cu_check_blas(cb,
		      lp->chosen < 0 ? ex_run(cb, lp, alpha, A, B, beta, D)
				     : lt_run(cb, lp, lp->chosen, alpha, A, B, beta, C, D),
		      what);
}

/* Times the plan's algorithms on this call's operands, where running the
 * call again gives the same D (beta 0, or C apart from D), beside the
 * reference (cublasGemmEx's default; for a residual add or a bias the
 * heuristic's first), and keeps the fastest of those whose output has the reference's
 * bits: a split of k the reference may share (lt_candidate), and the same
 * fingerprint of D. Every algorithm it may keep thus computes what the
 * reference computes, so the choice, which the clock makes and may differ
 * from run to run or rank to rank, changes no bits. An output of zeros
 * (a LoRA B at its start) would tell nothing: the timing waits for another
 * call, three times at most. The kept one runs last: D is its output.
 * Blocking: once per plan, at its first such call. */
static void lt_tune(struct cu_backend *cb, struct cu_lt_plan *lp, const char *what, float alpha,
		    const uint16_t *A, const uint16_t *B, float beta, const void *C, void *D)
{
	const int ref = lp->resid || lp->bias ? 0 : -1;
	lp->chosen = ref;
	if (!lt_events(cb)) {
		lp->tuned = true;
		lt_call(cb, lp, what, alpha, A, B, beta, C, D);
		return;
	}
	lt_call(cb, lp, what, alpha, A, B, beta, C, D);
	const uint64_t want = lt_fingerprint(cb, lp, D);
	if (cb->first_error != CUDA_SUCCESS)
		return;
	if (want == lt_fingerprint(cb, lp, NULL)) {
		lp->tuned = ++lp->degenerate >= 3;
		return;
	}
	lp->tuned = true;
	/* the reference first, then each algorithm with its bits */
	int ids[CU_LT_ALGOS + 1], n = 0;
	ids[n++] = ref;
	for (int i = 0; i < lp->nalgo; i++) {
		lp->ms[i] = -1.0f;
		if (i == ref || !lt_candidate(lp, i) ||
		    lt_run(cb, lp, i, alpha, A, B, beta, C, D) != CUBLAS_STATUS_SUCCESS)
			continue; /* nothing was enqueued */
		if (lt_fingerprint(cb, lp, D) != want || cb->first_error != CUDA_SUCCESS)
			continue;
		ids[n++] = i;
	}
	float ms[CU_LT_ALGOS + 1];
	/* none with its bits: the reference, untimed */
	if (n > 1 && lt_time(cb, lp, ids, n, ms, alpha, A, B, beta, C, D)) {
		float best = lp->ms_ref = ms[0];
		if (ref >= 0)
			lp->ms[ref] = ms[0];
		for (int j = 1; j < n; j++) {
			lp->ms[ids[j]] = ms[j];
			if (ms[j] < best) {
				best = ms[j];
				lp->chosen = ids[j];
			}
		}
	}
	/* D may hold an ineligible algorithm's output (other bits) */
	lt_call(cb, lp, what, alpha, A, B, beta, C, D);
}

/* A plan whose reference is its first algorithm (an addend apart from D,
 * or a bias): timed at its first call (lt_tune) wherever the backend times
 * its algorithms; untimed, the reference (#0) alone, whatever a timing
 * kept before the switch. */
static void lt_epilogue_call(struct cu_backend *cb, struct cu_lt_plan *lp, const char *what,
			     const uint16_t *A, const uint16_t *B, float beta, const void *C, void *D)
{
	if (cb->gemm_tune && !lp->tuned && !cb->capturing) /* a recording cannot block */
		lt_tune(cb, lp, what, 1.0f, A, B, beta, C, D);
	else
		cu_check_blas(cb, lt_run(cb, lp, cb->gemm_tune ? lp->chosen : 0, 1.0f, A, B, beta, C, D),
			      what);
}

/* bf16 x bf16 -> C GEMM, fp32 accumulation; C fp32, or bf16 (C16) when C is
 * NULL: cublasGemmEx's default, or where the backend times them the
 * algorithm its plan for the shape keeps (lt_tune: the same bits). */
static void gemm16_(struct cu_backend *cb, const char *what, cublasOperation_t ta,
		    cublasOperation_t tb, int m, int n, int k, float alpha, const uint16_t *A,
		    int lda, const uint16_t *B, int ldb, float beta, float *C, uint16_t *C16,
		    int ldc)
{
	void *D = C ? (void *)C : (void *)C16;
	struct cu_lt_plan *lp =
		cb->gemm_tune && m > 0 && n > 0 && k > 0
			? lt_plan(cb, ta, tb, m, n, k, lda, ldb, ldc, !C, false,
				  common_align(A, B, D, D))
			: NULL;
	if (lp && !lp->tuned && beta == 0.0f && !cb->capturing) { /* a recording cannot block */
		lt_tune(cb, lp, what, alpha, A, B, beta, D, D);
		return;
	}
	if (lp) {
		lt_call(cb, lp, what, alpha, A, B, beta, D, D);
		return;
	}
	cu_check_blas(cb, gemm_ex(cb, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, D, !C, ldc),
		      what);
}

static void gemm16(struct cu_backend *cb, const char *what, cublasOperation_t ta,
		   cublasOperation_t tb, int m, int n, int k, float alpha, const uint16_t *A,
		   int lda, const uint16_t *B, int ldb, float beta, float *C, int ldc)
{
	gemm16_(cb, what, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, NULL, ldc);
}

static void sgemm_(struct cu_backend *cb, const char *what, cublasOperation_t ta,
		   cublasOperation_t tb, int m, int n, int k, float alpha, const float *A,
		   const gpu_bf16 *A16, int lda, const float *B, const gpu_bf16 *B16, int ldb,
		   float beta, float *C, int ldc)
{
	if (cb->fp32_strict) {
		if (!A || !B) { /* a bf16-only operand (a frozen weight) in fp32 mode: a caller's bug */
			cu_check(cb, CUDA_ERROR_INVALID_VALUE, "GEMM: a bf16-only operand in fp32 mode");
			return;
		}
		cu_check_blas(cb, cublasSgemm(cb->blas, ta, tb, m, n, k, &alpha, A, lda, B, ldb, &beta,
					      C, ldc),
			      what);
		return;
	}
	/* bf16 operands (a twin, else rounded into the scratch: the first at
	 * element 0, the second after its slot, gpu_gemm_slot), then a bf16 x
	 * bf16 -> fp32 GEMM. Measured faster than FAST_16BF on fp32 operands
	 * (H200, Qwen2-0.5B step 167 -> 149 ms). */
	size_t na = A16 ? 0 : operand_elems(ta, lda, m, k), nb = B16 ? 0 : operand_elems(tb, ldb, k, n);
	if (scratch_fits(cb, gpu_gemm_slot(na) + nb)) {
		uint16_t *slot = cb->base.gemm_scratch;
		const uint16_t *a16 = A16 ? A16 : round_into(cb, slot, A, na);
		const uint16_t *b16 = B16 ? B16 : round_into(cb, slot + gpu_gemm_slot(na), B, nb);
		gemm16(cb, what, ta, tb, m, n, k, alpha, a16, lda, b16, ldb, beta, C, ldc);
		return;
	}
	if (!A || !B) { /* a twin alone needs the scratch for the other operand */
		cu_check(cb, CUDA_ERROR_INVALID_VALUE, "GEMM: a bf16 twin without room in gemm_scratch");
		return;
	}
	/* bf16 compute: fp32 operands rounded to bf16 on the way into the tensor
	 * cores, fp32 accumulation and output. */
	cu_check_blas(cb, cublasGemmEx(cb->blas, ta, tb, m, n, k, &alpha, A, CUDA_R_32F, lda, B,
				       CUDA_R_32F, ldb, &beta, C, CUDA_R_32F, ldc,
				       CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
		      what);
}

static void sgemm_batched_(struct cu_backend *cb, const char *what, cublasOperation_t ta,
			   cublasOperation_t tb, int m, int n, int k, float alpha, const float *A,
			   int lda, long long sA, const float *B, int ldb, long long sB,
			   float beta, float *C, int ldc, long long sC, int batch);

/* The same over `batch` problems whose operands sit sA, sB, sC floats apart. */
static void sgemm_batched(struct cu_backend *cb, const char *what, cublasOperation_t ta,
			  cublasOperation_t tb, int m, int n, int k, float alpha, const float *A,
			  int lda, long long sA, const float *B, int ldb, long long sB, float beta,
			  float *C, int ldc, long long sC, int batch)
{
	cu_prof_begin(cb);
	sgemm_batched_(cb, what, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC,
		       batch);
	cu_prof_end(cb, "%s %dx%dx%d x%d", what, m, n, k, batch);
}

static void sgemm_batched_(struct cu_backend *cb, const char *what, cublasOperation_t ta,
			   cublasOperation_t tb, int m, int n, int k, float alpha, const float *A,
			   int lda, long long sA, const float *B, int ldb, long long sB,
			   float beta, float *C, int ldc, long long sC, int batch)
{
	if (cb->fp32_strict) {
		cu_check_blas(cb, cublasSgemmStridedBatched(cb->blas, ta, tb, m, n, k, &alpha, A, lda,
							    sA, B, ldb, sB, &beta, C, ldc, sC, batch),
			      what);
		return;
	}
	cu_check_blas(cb, cublasGemmStridedBatchedEx(cb->blas, ta, tb, m, n, k, &alpha, A, CUDA_R_32F,
						     lda, sA, B, CUDA_R_32F, ldb, sB, &beta, C,
						     CUDA_R_32F, ldc, sC, batch,
						     CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
		      what);
}

#define OP_N CUBLAS_OP_N
#define OP_T CUBLAS_OP_T

/* -------------------------------------------------------------- embedding -- */

/* wte16: a table stored in bf16 only (wte NULL), rows widened exactly. */
static void cu_embedding_forward(struct gpu_backend *be, float *out, const int32_t *ids,
				 const float *wte, const gpu_bf16 *wte16, int N, int C)
{
	if (C <= 0)
		return;
	void *args[] = {&out, &ids, &wte, &wte16, &N, &C};
	launch_rows(cu_of(be), CU_K_embedding_forward_f32, N, row_threads(C), args);
}

/* Keys a block of embedding_sort_local sorts (kernels/cuda/embedding.cu). */
#define CU_EMB_SORT_CHUNK 2048u

/* Deterministic (see kernels/cuda/embedding.cu): the rows' keys sorted in
 * the reduction scratch (P keys of 8 bytes, P the power of two at or above
 * N), then folded a run a block; where they do not fit, 256 threads scan
 * the ids 256 at a time. Both give the CPU's bits. */
static void cu_embedding_backward_part(struct gpu_backend *be, float *part, const float *dout,
				       const int32_t *ids, int N, int C, size_t lo, size_t hi)
{
	struct cu_backend *cb = cu_of(be);
	if (C <= 0 || lo >= hi || N <= 0)
		return;
	unsigned P = 2;
	while (P < (unsigned)N && P <= (1u << 30))
		P <<= 1;
	if (!cb->reduce_buf || (size_t)P > cb->reduce_cap || P < (unsigned)N) {
		void *args[] = {&part, &dout, &ids, &N, &C, &lo, &hi};
		launch_rows(cb, CU_K_embedding_backward_f32, N, CU_THREADS, args);
		return;
	}
	_Static_assert(sizeof(double) == sizeof(unsigned long long), "a key is a double's room");
	unsigned long long *keys = (unsigned long long *)cb->reduce_buf;
	const unsigned chunk = P < CU_EMB_SORT_CHUNK ? P : CU_EMB_SORT_CHUNK;
	unsigned long long k0 = 2, k1 = chunk;
	int fill = 1;
	void *largs[] = {&keys, &ids, &N, &k0, &k1, &fill};
	cu_launch(cb, CU_K_embedding_sort_local, dim1(P / chunk), dim1(chunk / 2), 0, largs);
	fill = 0;
	for (unsigned long long k = 2ull * chunk; k <= P; k <<= 1) {
		for (unsigned j = (unsigned)(k / 2); j >= chunk; j >>= 1) {
			void *sargs[] = {&keys, &P, &k, &j};
			cu_launch(cb, CU_K_embedding_sort_step, dim1(grid_cap(P / 2 / CU_THREADS)),
				  dim1(CU_THREADS), 0, sargs);
		}
		k0 = k1 = k;
		cu_launch(cb, CU_K_embedding_sort_local, dim1(P / chunk), dim1(chunk / 2), 0, largs);
	}
	void *fargs[] = {&part, &dout, &keys, &N, &C, &lo, &hi};
	launch_rows(cb, CU_K_embedding_fold_f32, N, row_threads(C), fargs);
}

/* The whole table: the part [0, SIZE_MAX). */
static void cu_embedding_backward(struct gpu_backend *be, float *dwte, const float *dout,
				  const int32_t *ids, int N, int C)
{
	cu_embedding_backward_part(be, dwte, dout, ids, N, C, 0, SIZE_MAX);
}

static void cu_embedding_forward_part(struct gpu_backend *be, float *out, const int32_t *ids,
				      const float *part, int N, int C, size_t lo, size_t hi)
{
	if (C <= 0)
		return;
	void *args[] = {&out, &ids, &part, &N, &C, &lo, &hi};
	launch_rows(cu_of(be), CU_K_embedding_forward_part_f32, N, row_threads(C), args);
}

/* ---------------------------------------------------------------- rmsnorm -- */

/* rmsnorm.cu's warp-a-row kernels (rows of C <= 1024, C a multiple of 4,
 * every pointer 16-byte aligned): V float4s a lane, the fewest of 1, 2, 4
 * and 8 that hold a row; 0 where they do not apply (then a block a row).
 * RMS_WARP_ROWS warps (rows at a time) a block. */
#define RMS_WARP_ROWS 8
static int rms_warp_vec(int C, uintptr_t ptrs)
{
	if (C <= 0 || (C & 3) || C / 4 > 32 * 8 || (ptrs & 15))
		return 0;
	const int f = (C / 4 + 31) / 32;
	return f <= 1 ? 1 : f <= 2 ? 2 : f <= 4 ? 4 : 8;
}

static void cu_rmsnorm_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *rstd,
			       const float *inp, const float *weight, int N, int C, float eps)
{
	struct cu_backend *cb = cu_of(be);
	void *args[] = {&out, &out16, &rstd, &inp, &weight, &N, &C, &eps};
	const int v = rms_warp_vec(C, (uintptr_t)out | (uintptr_t)out16 | (uintptr_t)inp |
					      (uintptr_t)weight);
	if (v && N > 0) {
		const enum cu_kernel k = v == 1 ? CU_K_rmsnorm_forward_w1_f32
				       : v == 2 ? CU_K_rmsnorm_forward_w2_f32
				       : v == 4 ? CU_K_rmsnorm_forward_w4_f32
						: CU_K_rmsnorm_forward_w8_f32;
		cu_launch(cb, k, dim1(grid_cap(((size_t)N + RMS_WARP_ROWS - 1) / RMS_WARP_ROWS)),
			  dim1(32 * RMS_WARP_ROWS), 0, args);
		return;
	}
	launch_rows(cb, CU_K_rmsnorm_forward_f32, N, row_threads(C), args);
}

/* The most float4s a thread of rmsnorm.cu's backward holds (its kernels
 * come in VEC 1, 2 and 4), and the bounds on rmsnorm_backward_dw's blocks:
 * at most RMS_FUSED_MAX_PARTS partial rows (bias_grad_f32 then sums at most
 * that many a column), at least RMS_FUSED_MIN_PARTS (else the one-pass row
 * kernel is too narrow a grid, unless N itself is smaller). */
#define RMS_VEC 4
#define RMS_FUSED_MAX_PARTS 1024
#define RMS_FUSED_MIN_PARTS 256

/* rmsnorm_backward's vector path conditions, which the fused kernel
 * assumes: C a multiple of 4 that the block's float4 registers hold, every
 * row pointer 16-byte aligned. */
static bool rms_fused_vec(const float *dinp, const float *dout, const float *inp,
			  const float *weight, int C, unsigned threads)
{
	return (C & 3) == 0 && C / 4 <= RMS_VEC * (int)threads &&
	       (((uintptr_t)dinp | (uintptr_t)dout | (uintptr_t)inp | (uintptr_t)weight) & 15) == 0;
}

/* The backward kernels of the fewest float4s a thread that hold a row of
 * C (VEC 1, 2 or 4: unused float4s would still take their registers and
 * cut the blocks an SM holds); beyond 4, VEC 4's (its scalar path). */
static void rms_kernels(int C, unsigned threads, enum cu_kernel *k, enum cu_kernel *kdw)
{
	const int f4 = (C / 4 + (int)threads - 1) / (int)threads;
	*k = f4 <= 1 ? CU_K_rmsnorm_backward1_f32 : f4 <= 2 ? CU_K_rmsnorm_backward2_f32
							     : CU_K_rmsnorm_backward4_f32;
	*kdw = f4 <= 1 ? CU_K_rmsnorm_backward_dw1_f32 : f4 <= 2 ? CU_K_rmsnorm_backward_dw2_f32
								 : CU_K_rmsnorm_backward_dw4_f32;
}

/* The partial rows of dweight a one-pass backward over `units` (rows, or
 * blocks of rows) writes to the scratch: as many as the scratch holds, at
 * most RMS_FUSED_MAX_PARTS and units; 0 where that is under
 * RMS_FUSED_MIN_PARTS and not every unit (the pass would be too narrow:
 * the two-pass way then). From N, C and the scratch only: the same order
 * on every run and device. */
static size_t rms_parts(struct cu_backend *cb, int C, size_t units, float **part)
{
	size_t cap;
	*part = scratch_floats(cb, &cap);
	size_t G = cap / (size_t)C;
	if (G > RMS_FUSED_MAX_PARTS)
		G = RMS_FUSED_MAX_PARTS;
	if (G > units)
		G = units;
	return G >= RMS_FUSED_MIN_PARTS || G == units ? G : 0;
}

/* dweight (C) += the P partial rows at part, in row order (bias_grad_f32) */
static void rms_parts_sum(struct cu_backend *cb, float *dweight, const float *part, int P, int C)
{
	int direct = 1;
	void *cargs[] = {&dweight, &part, &P, &C, &P, &direct};
	cu_launch(cb, CU_K_bias_grad_f32, (struct cu_dim){cu_blocks((size_t)C, 32), 1, 1},
		  (struct cu_dim){32, 32, 1}, 0, cargs);
}

static void cu_rmsnorm_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				float *dweight, const float *dout, const float *inp,
				const float *weight, const float *rstd, int N, int C)
{
	struct cu_backend *cb = cu_of(be);
	if (N <= 0 || C <= 0)
		return;
	/* the twin four values a store where the float4 paths run */
	const bool a16 = ((uintptr_t)dinp16 & 7) == 0;
	/* The warp-a-row backward for rows of up to 256 channels (a lane's two
	 * float4s of each of inp, dout and dinp): per-head norms (Qwen3's q
	 * and k, 128). Past that its registers held one or two blocks an SM
	 * and it ran slower than a block a row (Qwen2-0.5B's C 896: 2.65 ->
	 * 3.24 ms a step, on an H100), which the forward did not (1.30 ->
	 * 1.03). */
	const int v = rms_warp_vec(C, (uintptr_t)dinp | (uintptr_t)dout | (uintptr_t)inp |
					      (uintptr_t)weight);
	if (v && v <= 2 && a16) {
		/* Block b's warps take rows 8 b + w, 8 b + w + 8 G, ... (G
		 * blocks); with dweight, each block its partial row in the
		 * scratch (G from N, C and the scratch only, as the block-a-row
		 * kernel's below), added by bias_grad_f32 in block order. */
		const enum cu_kernel k =
			v == 1 ? CU_K_rmsnorm_backward_w1_f32 : CU_K_rmsnorm_backward_w2_f32;
		const size_t blocks = grid_cap(((size_t)N + RMS_WARP_ROWS - 1) / RMS_WARP_ROWS);
		float *part = NULL;
		const size_t G = dweight ? rms_parts(cb, C, blocks, &part) : blocks;
		if (G) {
			void *wargs[] = {&dinp, &dinp16, &part, &dout, &inp, &weight, &rstd, &N, &C};
			cu_launch(cb, k, dim1((unsigned)G), dim1(32 * RMS_WARP_ROWS), 0, wargs);
			if (!dweight)
				return;
			rms_parts_sum(cb, dweight, part, (int)G, C);
			return;
		}
	}
	const unsigned threads = row_threads(C);
	enum cu_kernel krow, kdw;
	rms_kernels(C, threads, &krow, &kdw);
	if (dweight && a16 && rms_fused_vec(dinp, dout, inp, weight, C, threads)) {
		/* One pass (rmsnorm_backward_dwV_f32): G blocks, each a partial row
		 * of dweight in the scratch, added by bias_grad_f32 in block order.
		 * G from N, C and the scratch only: the same order on every run
		 * and device. At least RMS_FUSED_MIN_PARTS blocks, else the row
		 * pass would be too narrow: then the two-pass way below. */
		float *part;
		const size_t G = rms_parts(cb, C, (size_t)N, &part);
		if (G) {
			void *fargs[] = {&dinp, &dinp16, &part, &dout, &inp, &weight, &rstd, &N, &C};
			cu_launch(cb, kdw, dim1((unsigned)G), dim1(threads), 0, fargs);
			rms_parts_sum(cb, dweight, part, (int)G, C);
			return;
		}
	}
	void *args[] = {&dinp, &dinp16, &dout, &inp, &weight, &rstd, &N, &C};
	launch_rows(cb, krow, N, threads, args);
	if (!dweight)
		return;
	struct colsum_plan p = plan_colsum(cb, N, C);
	int direct = p.parts == 1;
	float *dst = direct ? dweight : p.partial;
	void *wargs[] = {&dst, &dout, &inp, &rstd, &N, &C, &p.rows_per_part, &direct};
	cu_launch(cb, CU_K_rmsnorm_dweight_f32, (struct cu_dim){cu_blocks((size_t)C, 32), p.parts, 1},
		  (struct cu_dim){32, 32, 1}, 0, wargs);
	colsum_finish(cb, dweight, &p, C);
}

/* ----------------------------------------------------------------- matmul -- */

/* out16 (N,OC) = bf16(inp W^T + beta out16), beta 0 or 1: bf16 operands,
 * twins or rounded into the scratch (gpu_matmul_scratch_elems), fp32
 * accumulation and epilogue (the old bf16 values widened), one rounding.
 * op: the caller's name, for errors and the profile. */
static void forward16(struct cu_backend *cb, const char *op, gpu_bf16 *out16, float beta,
		      const float *inp, const gpu_bf16 *inp16, const float *weight,
		      const gpu_bf16 *weight16, int N, int C, int OC)
{
	size_t nw = weight16 ? 0 : (size_t)OC * C, nx = inp16 ? 0 : (size_t)N * C;
	if (cb->fp32_strict || !scratch_fits(cb, gpu_gemm_slot(nw) + nx)) {
		char msg[96];
		snprintf(msg, sizeof(msg), "%s: a bf16 output needs the bf16 mode and gemm_scratch", op);
		cu_check(cb, CUDA_ERROR_INVALID_VALUE, msg);
		return;
	}
	uint16_t *slot = cb->base.gemm_scratch;
	cu_prof_begin(cb);
	const uint16_t *w16 = weight16 ? weight16 : round_into(cb, slot, weight, nw);
	const uint16_t *x16 = inp16 ? inp16 : round_into(cb, slot + gpu_gemm_slot(nw), inp, nx);
	gemm16_(cb, op, OP_T, OP_N, OC, N, C, 1.0f, w16, C, x16, C, beta, NULL, out16, OC);
	cu_prof_end(cb, "%s: GEMM (bf16 out) %dx%dx%d", op, OC, N, C);
}

/* matmul_forward's fp32 product with its bias added by the GEMM's epilogue
 * (cuBLASLt's CUBLASLT_EPILOGUE_BIAS, the bf16 mode): each element the
 * product's fp32 sum plus the bias in one rounding, as the product and
 * add_bias_f32 give, in one pass over out instead of the product's and
 * then add_bias's two (Qwen2's q, k and v: 0.6 ms of a Qwen2-0.5B step on
 * an H100). The first algorithm of the shape's plan is the reference the
 * timed ones are held to (lt_tune). False, with nothing run, where there
 * is no plan (the fp32 mode, no cuBLASLt, no room for the operands). */
static bool forward_bias(struct cu_backend *cb, float *out, const float *inp,
			 const gpu_bf16 *inp16, const float *weight, const gpu_bf16 *weight16,
			 const float *bias, int N, int C, int OC)
{
	size_t nw = weight16 ? 0 : (size_t)OC * C, nx = inp16 ? 0 : (size_t)N * C;
	if (cb->fp32_strict || cb->no_bias_epilogue || !scratch_fits(cb, gpu_gemm_slot(nw) + nx))
		return false;
	uint16_t *slot = cb->base.gemm_scratch;
	const void *wa = weight16 ? (const void *)weight16 : slot;
	const void *xa = inp16 ? (const void *)inp16 : slot + gpu_gemm_slot(nw);
	struct cu_lt_plan *lp = lt_plan_(cb, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, C, C, OC, false,
					 false, true, common_align(wa, xa, out, bias));
	if (!lp)
		return false;
	const uint16_t *w16 = weight16 ? weight16 : round_into(cb, slot, weight, nw);
	const uint16_t *x16 = inp16 ? inp16 : round_into(cb, slot + gpu_gemm_slot(nw), inp, nx);
	if (cublasLtMatmulDescSetAttribute(lp->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
					   sizeof(bias)) != CUBLAS_STATUS_SUCCESS) {
		cu_check(cb, CUDA_ERROR_INVALID_VALUE, "matmul_forward: the bias epilogue's pointer");
		return true;
	}
	cu_prof_begin(cb);
	lt_epilogue_call(cb, lp, "matmul_forward (bias): GEMM", w16, x16, 0.0f, out, out);
	cu_prof_end(cb, "matmul_forward (bias): GEMM %dx%dx%d", OC, N, C);
	return true;
}

static void cu_matmul_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			      const float *inp, const gpu_bf16 *inp16, const float *weight,
			      const gpu_bf16 *weight16, const float *bias, int N, int C, int OC)
{
	struct cu_backend *cb = cu_of(be);
	if (N <= 0 || OC <= 0)
		return;
	if (out16) {
		assert(!out && !bias && C > 0);
		forward16(cb, "matmul_forward", out16, 0.0f, inp, inp16, weight, weight16, N, C, OC);
		return;
	}
	if (bias && C > 0 && forward_bias(cb, out, inp, inp16, weight, weight16, bias, N, C, OC))
		return;
	if (C > 0)
		sgemm(cb, "matmul_forward: GEMM", OP_T, OP_N, OC, N, C, 1.0f, weight, weight16,
		      C, inp, inp16, C, 0.0f, out, OC);
	else
		be->ops->zero(be, out, sizeof(float) * (size_t)N * (size_t)OC);
	if (bias) {
		void *args[] = {&out, &bias, &N, &OC};
		launch_rows(cb, CU_K_add_bias_f32, N, row_threads(OC), args);
	}
}

/* out (N,OC) += inp (N,C) W^T (OC,C): matmul_forward's product with beta 1
 * (the same operands, rounded into the scratch in the bf16 mode where they
 * have no twin); out16: the same onto a bf16 out (C and D of the GEMM in
 * bf16, its epilogue in fp32). */
static void cu_matmul_forward_add(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				  const float *inp, const gpu_bf16 *inp16, const float *weight,
				  const gpu_bf16 *weight16, int N, int C, int OC)
{
	struct cu_backend *cb = cu_of(be);
	if (N <= 0 || OC <= 0 || C <= 0)
		return; /* nothing to add */
	if (out16) {
		assert(!out);
		forward16(cb, "matmul_forward_add", out16, 1.0f, inp, inp16, weight, weight16, N, C, OC);
		return;
	}
	sgemm(cb, "matmul_forward_add: GEMM", OP_T, OP_N, OC, N, C, 1.0f, weight, weight16,
	      C, inp, inp16, C, 1.0f, out, OC);
}

/* out (N,OC) = res + inp (N,C) W^T (OC,C), out != res: where the GEMM can
 * take its addend apart from its output (cuBLASLt, the bf16 mode: C = res,
 * D = out), one pass writes out, and each element is res plus the
 * product's fp32 sum in one rounding, as matmul_forward_add's epilogue and
 * as the product and residual_forward give; else res is copied to out and
 * matmul_forward_add adds the product. */
static void cu_matmul_forward_residual(struct gpu_backend *be, float *out, const float *res,
				       const float *inp, const gpu_bf16 *inp16,
				       const float *weight, const gpu_bf16 *weight16, int N, int C,
				       int OC)
{
	struct cu_backend *cb = cu_of(be);
	const size_t no = (size_t)N * (size_t)OC;
	size_t nw = weight16 ? 0 : (size_t)OC * C, nx = inp16 ? 0 : (size_t)N * C;
	const bool lt_ok = out != res && N > 0 && OC > 0 && C > 0 && !cb->fp32_strict &&
			   scratch_fits(cb, gpu_gemm_slot(nw) + nx);
	uint16_t *slot = cb->base.gemm_scratch;
	const uint16_t *w16 = weight16, *x16 = inp16;
	struct cu_lt_plan *lp = NULL;
	if (lt_ok) { /* the plan knows the operands' alignment: the rounded ones' slots */
		const void *wa = w16 ? (const void *)w16 : slot;
		const void *xa = x16 ? (const void *)x16 : slot + gpu_gemm_slot(nw);
		lp = lt_plan(cb, CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, C, C, OC, false, true,
			     common_align(wa, xa, res, out));
	}
	if (!lp) {
		if (out != res && no > 0)
			cu_check(cb, cb->drv.cuMemcpyDtoDAsync((CUdeviceptr)(uintptr_t)out,
							       (CUdeviceptr)(uintptr_t)res,
							       no * sizeof(float), cb->stream),
				 "cuMemcpyDtoDAsync (matmul_forward_residual)");
		cu_matmul_forward_add(be, out, NULL, inp, inp16, weight, weight16, N, C, OC);
		return;
	}
	if (!w16)
		w16 = round_into(cb, slot, weight, nw);
	if (!x16)
		x16 = round_into(cb, slot + gpu_gemm_slot(nw), inp, nx);
	cu_prof_begin(cb);
	/* out = res + the product whatever ran before: a call that may be
	 * timed (lt_tune) wherever the backend times its algorithms */
	lt_epilogue_call(cb, lp, "matmul_forward_residual: GEMM", w16, x16, 1.0f, res, out);
	cu_prof_end(cb, "matmul_forward_residual: GEMM %dx%dx%d", OC, N, C);
}

/* dinp (N,C) += dout (N,OC) W (OC,C): column-major dinp^T = W^T dout^T.
 * dweight (OC,C) += dout^T inp: column-major dweight^T = inp^T dout.
 * dbias (OC) += the column sums of dout (fp32 dout required). */
/* cu_matmul_backward with dout16's rows ldo values apart (ldo: OC where
 * dout16 is dense, or where dout is rounded into the scratch) */
static void mm_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16, float *dweight,
			float *dbias, const float *dout, const gpu_bf16 *dout16, int ldo,
			const float *inp, const gpu_bf16 *inp16, const float *weight,
			const gpu_bf16 *weight16, int N, int C, int OC, unsigned set, float alpha_in)
{
	struct cu_backend *cb = cu_of(be);
	assert(ldo == OC || (dout16 && !dout && !dbias && ldo > OC));
	assert(alpha_in == 1.0f || (set & GPU_SET_DINP));
	const bool dinp_set = set & GPU_SET_DINP, dw_set = set & GPU_SET_DWEIGHT;
	assert(!dinp16 || (!dinp && dinp_set));
	if (dinp && dinp_set && N > 0 && C > 0 && OC <= 0)
		be->ops->zero(be, dinp, sizeof(float) * (size_t)N * (size_t)C);
	if (dinp16 && N > 0 && C > 0 && OC <= 0)
		be->ops->zero(be, dinp16, sizeof(gpu_bf16) * (size_t)N * (size_t)C);
	if (dweight && dw_set && C > 0 && OC > 0 && N <= 0)
		be->ops->zero(be, dweight, sizeof(float) * (size_t)OC * (size_t)C);
	if (N <= 0 || OC <= 0)
		return; /* nothing to add */
	const float beta_in = dinp_set ? 0.0f : 1.0f; /* 0: cuBLAS never reads dinp */
	const float beta_w = dw_set ? 0.0f : 1.0f;
	const bool want_in = (dinp || dinp16) && C > 0, want_w = dweight && C > 0;
	size_t nd = (size_t)N * OC, nw = (size_t)OC * C, nx = (size_t)N * C;
	/* bf16: dout, the second operand of both products, rounded once (or
	 * its twin) after one slot that the weight and then the input take in
	 * turn where they have no twin (gpu_matmul_scratch_elems). */
	size_t sw = want_in && !weight16 ? nw : 0, sx = want_w && !inp16 ? nx : 0;
	size_t first = gpu_gemm_slot(sw > sx ? sw : sx);
	if ((want_in || want_w) && !cb->fp32_strict && scratch_fits(cb, first + (dout16 ? 0 : nd))) {
		uint16_t *slot = cb->base.gemm_scratch;
		const uint16_t *d16 = dout16 ? dout16 : round_into(cb, slot + first, dout, nd);
		if (want_in) {
			cu_prof_begin(cb);
			const uint16_t *w16 = weight16 ? weight16 : round_into(cb, slot, weight, nw);
			gemm16_(cb, "matmul_backward (dinp): GEMM", OP_N, OP_N, C, N, OC,
				alpha_in, w16, C, d16, ldo, beta_in, dinp, dinp16, C);
			cu_prof_end(cb, "matmul_backward (dinp): GEMM %dx%dx%d", C, N, OC);
		}
		if (want_w) {
			cu_prof_begin(cb);
			const uint16_t *x16 = inp16 ? inp16 : round_into(cb, slot, inp, nx);
			gemm16(cb, "matmul_backward (dweight): GEMM", OP_N, OP_T, C, OC, N,
			       1.0f, x16, C, d16, ldo, beta_w, dweight, C);
			cu_prof_end(cb, "matmul_backward (dweight): GEMM %dx%dx%d", C, OC, N);
		}
	} else if (dinp16 || ldo != OC || alpha_in != 1.0f) {
		if (ldo != OC || alpha_in != 1.0f) {
			cu_check(cb, CUDA_ERROR_INVALID_VALUE,
				 "matmul_backward_ld16: needs the bf16 mode and gemm_scratch");
			return;
		}
		cu_check(cb, CUDA_ERROR_INVALID_VALUE,
			 "matmul_backward: a bf16 dinp needs the bf16 mode and gemm_scratch");
		return;
	} else {
		if (want_in)
			sgemm(cb, "matmul_backward (dinp): GEMM", OP_N, OP_N, C, N, OC, 1.0f,
			      weight, weight16, C, dout, dout16, OC, beta_in, dinp, C);
		if (want_w)
			sgemm(cb, "matmul_backward (dweight): GEMM", OP_N, OP_T, C, OC, N, 1.0f,
			      inp, inp16, C, dout, dout16, OC, beta_w, dweight, C);
	}
	if (dbias) {
		assert(dout);
		struct colsum_plan p = plan_colsum(cb, N, OC);
		int direct = p.parts == 1;
		float *dst = direct ? dbias : p.partial;
		void *args[] = {&dst, &dout, &N, &OC, &p.rows_per_part, &direct};
		cu_launch(cb, CU_K_bias_grad_f32,
			  (struct cu_dim){cu_blocks((size_t)OC, 32), p.parts, 1},
			  (struct cu_dim){32, 32, 1}, 0, args);
		colsum_finish(cb, dbias, &p, OC);
	}
}

static void cu_matmul_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
			       float *dweight, float *dbias, const float *dout,
			       const gpu_bf16 *dout16, const float *inp, const gpu_bf16 *inp16,
			       const float *weight, const gpu_bf16 *weight16, int N, int C, int OC,
			       unsigned set)
{
	mm_backward(be, dinp, dinp16, dweight, dbias, dout, dout16, OC, inp, inp16, weight, weight16,
		    N, C, OC, set, 1.0f);
}

/* dbias += the column sums of bf16 rows ldo apart: bias_grad_f32's plan
 * and order over the widened values. */
static void cu_bias_backward_ld16(struct gpu_backend *be, float *dbias, const gpu_bf16 *dout16,
				  size_t ldo, int N, int OC)
{
	struct cu_backend *cb = cu_of(be);
	assert(ldo >= (size_t)OC);
	if (N <= 0 || OC <= 0)
		return;
	struct colsum_plan p = plan_colsum(cb, N, OC);
	int direct = p.parts == 1;
	float *dst = direct ? dbias : p.partial;
	void *args[] = {&dst, &dout16, &ldo, &N, &OC, &p.rows_per_part, &direct};
	/* four columns a thread where they are 8-byte aligned (the same bits) */
	const bool x4 = OC % 4 == 0 && ldo % 4 == 0 && ((uintptr_t)dout16 & 7) == 0;
	cu_launch(cb, x4 ? CU_K_bias_grad_bf16x4 : CU_K_bias_grad_bf16,
		  (struct cu_dim){cu_blocks((size_t)OC, x4 ? 128 : 32), p.parts, 1},
		  (struct cu_dim){32, 32, 1}, 0, args);
	colsum_finish(cb, dbias, &p, OC);
}

static void cu_matmul_backward_ld16(struct gpu_backend *be, float *dinp, float *dweight,
				    const gpu_bf16 *dout16, size_t ldo, const float *inp,
				    const gpu_bf16 *inp16, const float *weight,
				    const gpu_bf16 *weight16, int N, int C, int OC, unsigned set,
				    float alpha_in)
{
	assert(ldo >= (size_t)OC && ldo <= INT_MAX);
	mm_backward(be, dinp, NULL, dweight, NULL, NULL, dout16, (int)ldo, inp, inp16, weight,
		    weight16, N, C, OC, set, alpha_in);
}

/* matmul_forward's fp32 product with the GEMM's alpha */
static void cu_matmul_forward_scaled(struct gpu_backend *be, float *out, const float *inp,
				     const gpu_bf16 *inp16, const float *weight,
				     const gpu_bf16 *weight16, int N, int C, int OC, float alpha)
{
	struct cu_backend *cb = cu_of(be);
	if (N <= 0 || OC <= 0)
		return;
	if (C > 0)
		sgemm(cb, "matmul_forward_scaled: GEMM", OP_T, OP_N, OC, N, C, alpha, weight, weight16,
		      C, inp, inp16, C, 0.0f, out, OC);
	else
		be->ops->zero(be, out, sizeof(float) * (size_t)N * (size_t)OC);
}

/* ------------------------------------------------------------------- rope -- */

/* args: the kernel's, out16 among them where it has one (the forward).
 * k4, the kernel's four-pairs-a-thread twin (the same bits), where HS/2 is
 * a multiple of 4 and v4 (the caller's pointers 16-byte aligned, out16
 * 8-byte); else k, a block a token. */
static void launch_rope(struct cu_backend *cb, enum cu_kernel k, enum cu_kernel k4, bool v4,
			void **args, int B, int T, int NH, int HS)
{
	if (B <= 0 || T <= 0 || NH <= 0 || HS < 2)
		return;
	if (v4 && (HS / 2) % 4 == 0) {
		size_t units = (size_t)B * (size_t)T * (size_t)NH * (size_t)(HS / 8);
		cu_launch(cb, k4, dim1(grid_cap((units + CU_THREADS - 1) / CU_THREADS)),
			  dim1(CU_THREADS), 0, args);
		return;
	}
	int pairs = NH * (HS / 2);
	cu_launch(cb, k, dim1(grid_cap((size_t)B * (size_t)T)), dim1(row_threads(pairs)), 0, args);
}

static void cu_rope_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, const float *inp,
			    const float *cos, const float *sin, int B, int T, int NH, int HS)
{
	void *args[] = {&out, &out16, &inp, &cos, &sin, &B, &T, &NH, &HS};
	bool v4 = (((uintptr_t)out | (uintptr_t)inp | (uintptr_t)cos | (uintptr_t)sin) & 15) == 0 &&
		  ((uintptr_t)out16 & 7) == 0;
	launch_rope(cu_of(be), CU_K_rope_forward_f32, CU_K_rope_forward4_f32, v4, args, B, T, NH, HS);
}

/* gpu/backend.h: rope_qkv16. Four values a thread where HS/2 is a
 * multiple of 4 and the pointers allow (kernels/cuda/rope.cu), else one. */
static void cu_rope_qkv16(struct gpu_backend *be, gpu_bf16 *q16, gpu_bf16 *k16, gpu_bf16 *v16,
			  const float *qkv, const float *cos, const float *sin, int B, int T,
			  int NH, int NKV, int HS)
{
	if (B <= 0 || T <= 0 || NH <= 0 || NKV <= 0 || HS < 2)
		return;
	void *args[] = {&q16, &k16, &v16, &qkv, &cos, &sin, &B, &T, &NH, &NKV, &HS};
	const bool v4 = (HS / 2) % 4 == 0 &&
			(((uintptr_t)qkv | (uintptr_t)cos | (uintptr_t)sin) & 15) == 0 &&
			(((uintptr_t)q16 | (uintptr_t)k16 | (uintptr_t)v16) & 7) == 0;
	const size_t tokens = (size_t)B * (size_t)T, rows = (size_t)(NH + NKV) * (size_t)(HS / 2),
		     vals = (size_t)NKV * (size_t)HS;
	const size_t units = v4 ? tokens * (rows / 4 + vals / 4) : tokens * (rows + vals);
	cu_launch(cu_of(be), v4 ? CU_K_rope_qkv16x4_f32 : CU_K_rope_qkv16_f32,
		  dim1(grid_cap((units + CU_THREADS - 1) / CU_THREADS)), dim1(CU_THREADS), 0, args);
}

static void cu_rope_backward(struct gpu_backend *be, float *dinp, const float *dout,
			     const float *cos, const float *sin, int B, int T, int NH, int HS)
{
	void *args[] = {&dinp, &dout, &cos, &sin, &B, &T, &NH, &HS};
	bool v4 = (((uintptr_t)dinp | (uintptr_t)dout | (uintptr_t)cos | (uintptr_t)sin) & 15) == 0;
	launch_rope(cu_of(be), CU_K_rope_backward_f32, CU_K_rope_backward4_f32, v4, args, B, T, NH,
		    HS);
}

/* -------------------------------------------------------------- attention -- */

/* The views, per query head h (kv head g = h / rep) and batch row b:
 * Q_h row t at q + (b*T + t)*NH*HS + h*HS, so the leading dimension is
 * ldq = NH*HS and batch rows are T*ldq apart; K_g, V_g likewise with
 * ldk = NKV*HS; P_h = att + (b*NH + h)*T*T, (T,T) row-major, batch rows
 * NH*T*T apart. Each GEMM below is one cuBLAS call per head, batched over b;
 * in column-major terms a row-major (T,HS) view is (HS,T) with ld ldq. */
struct att_views {
	int rep, ldq, ldk;
	long long sq, sk, sa; /* batch strides of q, k/v, att */
	float scale;
};

static struct att_views att_views(int T, int NH, int NKV, int HS)
{
	struct att_views a;
	a.rep = NH / NKV;
	a.ldq = NH * HS;
	a.ldk = NKV * HS;
	a.sq = (long long)T * a.ldq;
	a.sk = (long long)T * a.ldk;
	a.sa = (long long)NH * T * T;
	a.scale = 1.0f / sqrtf((float)HS);
	return a;
}

/* A warp per row of att: 8 rows per block. */
static void launch_att_rows(struct cu_backend *cb, enum cu_kernel k, size_t rows, void **args)
{
	cu_launch(cb, k, dim1(grid_cap((rows + 7) / 8)), dim1(CU_THREADS), 0, args);
}

/* bf16 mode and a head size flash.cu is built for: the fused kernels. */
static bool cu_attention_flash(struct gpu_backend *be, int HS)
{
	const struct cu_backend *cb = cu_of(be);
	int bit = HS == 16 ? 0 : HS == 32 ? 1 : HS == 64 ? 2 : 3;
	return !cb->fp32_strict && gpu_flash_head_size(HS) && (cb->flash_ok >> bit & 1u);
}

/* bf16 mode: GEMM operands rounded into be->gemm_scratch (sgemm_). */
static bool cu_gemm_bf16(struct gpu_backend *be)
{
	return !cu_of(be)->fp32_strict;
}

/* flash_wg.cuh's wgmma kernels (the sm_90a image: cb->flash_wg) cover head
 * sizes 64 and 128 */
static bool flash_wg_size(int HS)
{
	return HS == 64 || HS == 128;
}

/* flash_wg.cuh's grid: (64-row tiles, NH, B), 128 threads a block; a
 * head's tiles start together (x fastest), so that the rows they all
 * stream come from L2 */
static struct cu_dim flash_wg_grid(int B, int T, int NH)
{
	return (struct cu_dim){cu_blocks((size_t)T, 64), (unsigned)NH, (unsigned)B};
}

/* The fused kernels of one head size, by enum: flash.cu's mma.sync ones, or
 * with wg flash_wg.cuh's (flash_wg_size(HS)). */
static void flash_kernels(int HS, bool wg, enum cu_kernel *fwd, enum cu_kernel *dkdv, enum cu_kernel *dq)
{
	assert(!wg || flash_wg_size(HS));
	if (wg && HS == 64) {
		*fwd = CU_K_flash_fwd_wg_d64, *dkdv = CU_K_flash_bwd_dkdv_wg_d64, *dq = CU_K_flash_bwd_dq_wg_d64;
		return;
	}
	if (wg) {
		*fwd = CU_K_flash_fwd_wg_d128, *dkdv = CU_K_flash_bwd_dkdv_wg_d128,
		*dq = CU_K_flash_bwd_dq_wg_d128;
		return;
	}
	switch (HS) {
	case 16:
		*fwd = CU_K_flash_fwd_d16, *dkdv = CU_K_flash_bwd_dkdv_d16, *dq = CU_K_flash_bwd_dq_d16;
		break;
	case 32:
		*fwd = CU_K_flash_fwd_d32, *dkdv = CU_K_flash_bwd_dkdv_d32, *dq = CU_K_flash_bwd_dq_d32;
		break;
	case 64:
		*fwd = CU_K_flash_fwd_d64, *dkdv = CU_K_flash_bwd_dkdv_d64, *dq = CU_K_flash_bwd_dq_d64;
		break;
	default:
		assert(HS == 128);
		*fwd = CU_K_flash_fwd_d128, *dkdv = CU_K_flash_bwd_dkdv_d128,
		*dq = CU_K_flash_bwd_dq_d128;
		break;
	}
}

/* Dynamic shared memory of the fused kernels (flash.cu's fa_cfg and
 * layouts): FA_TILE x (HS + 8) bf16 tiles, double-buffered up to HS 64
 * (dq at every head size). */
enum flash_kind { FLASH_FWD, FLASH_DKDV, FLASH_DQ };
/* flash.cu's FA_KV16X8_SMEM(128), flash_bwd_dkdv8_d128's: Q, dO
 * double-buffered, the block's 128 keys and values (eight tiles), and the
 * row statistics of both buffers */
#define FLASH_DKDV8_SMEM (8u * 64u * (128u + 8u) * 2u + 2u * 2u * 64u * 4u)
/* flash_wg.cuh's FA_WG_SMEM(D): six 64 x HS bf16 tiles, the row
 * statistics twice, 1 KiB to align the tiles */
#define FLASH_WG_SMEM(HS) (6u * 64u * (unsigned)(HS) * 2u + 2u * 2u * 64u * 4u + 1024u)
/* FA_WG_DKDV_SMEM(D): FLASH_WG_SMEM and an 8 KiB dS staging tile */
#define FLASH_WG_DKDV_SMEM(HS) (FLASH_WG_SMEM(HS) + 8192u)
/* FA_WG_DQS_SMEM(D): a ring of three slots of two 8 KiB dS tiles and a
 * 64 x HS K tile, 1 KiB (head size 128 only) */
#define FLASH_WG_DQS_SMEM(HS) (3u * (2u * 8192u + 64u * (unsigned)(HS) * 2u) + 1024u)

static unsigned flash_smem_bytes(enum flash_kind kind, int HS)
{
	unsigned tile = 64u * (unsigned)(HS + 8) * 2u, st = HS <= 64 ? 2u : 1u;
	switch (kind) {
	case FLASH_FWD: /* four tiles at every head size (flash.cu's forward) */
		return 4u * tile;
	case FLASH_DKDV: /* Q, dO (+ K, V past 64; up to 64 the block's 128 keys
			  * and values staged through them) and the row statistics */
		return (2u * st + (HS > 64 ? 2u : 0u)) * tile + 2u * st * 64u * 4u;
	default: /* K, V double-buffered at every head size, through which the
		  * block's 128 queries and output gradients are staged: four
		  * tiles */
		return 4u * tile;
	}
}

void cu_flash_prepare(struct cu_backend *cb)
{
	static const int sizes[] = {16, 32, 64, 128};
	cb->flash_ok = 0;
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		enum cu_kernel k[3];
		flash_kernels(sizes[i], false, &k[0], &k[1], &k[2]);
		bool ok = true;
		for (int j = 0; j < 3; j++) {
			unsigned bytes = flash_smem_bytes((enum flash_kind)j, sizes[i]);
			if (bytes > 48u * 1024u &&
			    cb->drv.cuFuncSetAttribute(cb->fn[k[j]],
						       CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
						       (int)bytes) != CUDA_SUCCESS)
				ok = false;
		}
		if (ok)
			cb->flash_ok |= 1u << i;
	}
	cb->flash_dkdv8 = cb->drv.cuFuncSetAttribute(cb->fn[CU_K_flash_bwd_dkdv8_d128],
						     CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
						     (int)FLASH_DKDV8_SMEM) == CUDA_SUCCESS;
	/* TD_CUDA_NO_WGMMA=1: the mma.sync kernels on Hopper too (a test and
	 * benchmark hook: the two paths side by side in one call) */
	const char *no_wg = getenv("TD_CUDA_NO_WGMMA");
	cb->flash_wg = cb->image_specific && !(no_wg && strcmp(no_wg, "1") == 0);
	for (int HS = 64; HS <= 128 && cb->flash_wg; HS += 64) {
		enum cu_kernel k[3];
		flash_kernels(HS, true, &k[0], &k[1], &k[2]);
		for (int j = 0; j < 3; j++)
			if (cb->drv.cuFuncSetAttribute(cb->fn[k[j]],
						       CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
						       (int)(j == 1 ? FLASH_WG_DKDV_SMEM(HS)
								    : FLASH_WG_SMEM(HS))) != CUDA_SUCCESS)
				cb->flash_wg = false;
	}
	if (cb->flash_wg && cb->drv.cuFuncSetAttribute(cb->fn[CU_K_flash_bwd_dqs_wg_d128],
						       CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
						       (int)FLASH_WG_DQS_SMEM(128)) != CUDA_SUCCESS)
		cb->flash_wg = false;
	/* TD_CUDA_NO_ROPE16=1: the attention backward's RoPE and roundings
	 * apart (attention_backward_rope16 says no; an A/B hook) */
	const char *no_r16 = getenv("TD_CUDA_NO_ROPE16");
	cb->no_rope16 = no_r16 && strcmp(no_r16, "1") == 0;
	/* TD_CUDA_NO_DS=1: the room for dS left unused (dQ by its three
	 * products again; an A/B hook) */
	const char *no_ds = getenv("TD_CUDA_NO_DS");
	cb->no_ds = no_ds && strcmp(no_ds, "1") == 0;
	/* TD_CUDA_NO_BIAS_EPILOGUE=1: a bias added by add_bias_f32 after the
	 * product (forward_bias says no; an A/B hook) */
	const char *no_be = getenv("TD_CUDA_NO_BIAS_EPILOGUE");
	cb->no_bias_epilogue = no_be && strcmp(no_be, "1") == 0;
}

#define FLASH_FWD_ROWS 128 /* flash.cu's FA_FWD_ROWS: queries per forward block */
#define FLASH_DQ_ROWS(HS) 128 /* flash.cu's FA_DQ_ROWS: per dq block */
/* flash.cu's FA_DQ_THREADS: 8 warps at HS 128 (16 rows each), else 4 */
#define FLASH_DQ_THREADS(HS) ((HS) <= 64 ? 128 : 256)
#define FLASH_KV_ROWS(HS) ((HS) <= 64 ? 128 : 64) /* flash.cu's FA_KV_ROWS: per dkdv block */
#define FLASH_THREADS 128

/* The fused kernels' bf16 q, k, v, dout: copies in be->gemm_scratch
 * (gpu/backend.h: gpu_flash_scratch_bytes): q, dout (B,T,NH,HS), k, v
 * (B,T,NKV,HS); or q, k, v the caller's twins and only dout's copy there. */
struct flash_copies {
	uint16_t *q, *k, *v, *dout;
};

static bool flash_copies(struct cu_backend *cb, int B, int T, int NH, int NKV, int HS, bool qkv16,
			 struct flash_copies *fc)
{
	if (!cb->base.gemm_scratch ||
	    cb->base.gemm_scratch_bytes < gpu_flash_scratch_bytes(B, T, NH, NKV, HS, qkv16)) {
		cu_check(cb, CUDA_ERROR_INVALID_VALUE,
			 "attention: no room for the fused kernels' bf16 copies (gemm_scratch)");
		return false;
	}
	size_t n = (size_t)B * T * HS;
	size_t q = (n * NH + 127) / 128 * 128, k = (n * NKV + 127) / 128 * 128;
	fc->q = cb->base.gemm_scratch;
	fc->k = fc->q + q;
	fc->v = fc->k + k;
	fc->dout = qkv16 ? fc->q : fc->v + k;
	return true;
}

/* The copies placed (false, the stream failed: no room) and q, k, v rounded
 * into theirs — or, given as twins (q16 and k16 and v16), read where they
 * are: the same bits as rounding them here; dout's is flash_rowdot's to
 * write. */
static bool flash_cast_qkv(struct cu_backend *cb, struct flash_copies *fc, const float *q,
			   const gpu_bf16 *q16, const float *k, const gpu_bf16 *k16, const float *v,
			   const gpu_bf16 *v16, int B, int T, int NH, int NKV, int HS)
{
	const bool twins = q16 && k16 && v16;
	assert(twins || (!q16 && !k16 && !v16 && q && k && v));
	if (!flash_copies(cb, B, T, NH, NKV, HS, twins, fc))
		return false;
	size_t n = (size_t)B * T * HS;
	if (twins) {
		fc->q = (uint16_t *)q16;
		fc->k = (uint16_t *)k16;
		fc->v = (uint16_t *)v16;
		return true;
	}
	launch_cast(cb, fc->q, q, n * NH);
	launch_cast(cb, fc->k, k, n * NKV);
	launch_cast(cb, fc->v, v, n * NKV);
	return true;
}

static void cu_attention_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *att,
				 const float *q, const gpu_bf16 *q16, const float *k,
				 const gpu_bf16 *k16, const float *v, const gpu_bf16 *v16, int B, int T,
				 int NH, int NKV, int HS)
{
	struct cu_backend *cb = cu_of(be);
	assert(NKV > 0 && NH % NKV == 0);
	if (B <= 0 || T <= 0 || NH <= 0 || HS <= 0)
		return;
	if (cu_attention_flash(be, HS)) {
		/* att: the (B,NH,T) row statistics; out, out16: each written
		 * where not NULL */
		assert(out || out16);
		struct flash_copies fc;
		if (!flash_cast_qkv(cb, &fc, q, q16, k, k16, v, v16, B, T, NH, NKV, HS))
			return;
		const bool wg = cb->flash_wg && flash_wg_size(HS);
		enum cu_kernel f, d1, d2;
		flash_kernels(HS, wg, &f, &d1, &d2);
		void *args[] = {&out, &out16, &att, &fc.q, &fc.k, &fc.v, &T, &NH, &NKV};
		if (wg) {
			cu_launch(cb, f, flash_wg_grid(B, T, NH), dim1(128), FLASH_WG_SMEM(HS), args);
			return;
		}
		/* grid (NH, B, query tiles): blocks start in this order, x
		 * fastest, and the kernel takes the last (heaviest) query tiles
		 * first, so every head's heaviest tiles start before any
		 * lighter one (the lightest fill the tail) */
		cu_launch(cb, f,
			  (struct cu_dim){(unsigned)NH, (unsigned)B,
					  cu_blocks((size_t)T, FLASH_FWD_ROWS)},
			  dim1(FLASH_THREADS), flash_smem_bytes(FLASH_FWD, HS), args);
		return;
	}
	assert(out && !q16 && !k16 && !v16); /* twins are the fused kernels' */
	struct att_views a = att_views(T, NH, NKV, HS);
	/* S_h = scale Q_h K_g^T: column-major S^T (T,T) = K_g Q_h^T. */
	for (int h = 0; h < NH; h++) {
		int g = h / a.rep;
		sgemm_batched(cb, "attention_forward (QK^T): cublasSgemmStridedBatched", OP_T, OP_N,
			      T, T, HS, a.scale, k + (size_t)g * HS, a.ldk, a.sk,
			      q + (size_t)h * HS, a.ldq, a.sq, 0.0f, att + (size_t)h * T * T, T,
			      a.sa, B);
	}
	size_t rows = (size_t)B * NH * T;
	void *args[] = {&att, &rows, &T};
	launch_att_rows(cb, CU_K_attention_softmax_f32, rows, args);
	/* out_h = P_h V_g: column-major out^T (HS,T) = V_g^T P_h^T. */
	for (int h = 0; h < NH; h++) {
		int g = h / a.rep;
		sgemm_batched(cb, "attention_forward (PV): cublasSgemmStridedBatched", OP_N, OP_N,
			      HS, T, T, 1.0f, v + (size_t)g * HS, a.ldk, a.sk,
			      att + (size_t)h * T * T, T, a.sa, 0.0f, out + (size_t)h * HS, a.ldq,
			      a.sq, B);
	}
	if (out16)
		launch_cast(cb, out16, out, (size_t)B * T * NH * HS);
}

/* dP = dout V^T ; dS = P (dP - rowsum(dP P)) ; dq = scale dS K ;
 * dk = scale sum_h dS^T Q ; dv = sum_h P^T dout, the sums over the query
 * heads h of a kv group in increasing h: the group's first head writes
 * (beta 0), the others add (beta 1), one GEMM after another on the stream —
 * a fixed order, no atomics. datt is scratch (it ends holding dS). */
/* attention_backward_rope16's tables and rows (gpu/backend.h), for the
 * wgmma kernels with kv groups only (att_backward's caller checks) */
struct att_rope16 {
	const float *cos, *sin;
	gpu_bf16 *d16;
	int ld16;
	void *ds; /* the caller's free scratch for dS (else NULL), ds_bytes of it */
	size_t ds_bytes;
};

static void att_backward(struct gpu_backend *be, float *dq, float *dk, float *dv, float *datt,
			 const float *dout, const float *out, const gpu_bf16 *out16, const float *q,
			 const gpu_bf16 *q16, const float *k, const gpu_bf16 *k16, const float *v,
			 const gpu_bf16 *v16, const float *att, int B, int T, int NH, int NKV, int HS,
			 const struct att_rope16 *r)
{
	struct cu_backend *cb = cu_of(be);
	assert(NKV > 0 && NH % NKV == 0);
	if (B <= 0 || T <= 0 || NH <= 0 || HS <= 0)
		return;
	if (cu_attention_flash(be, HS)) {
		/* datt: Dr = rowsum(dout * out), (B,NH,T), out read as out16
		 * widened where it is given; with kv groups, the
		 * per-head dK and dV partials after it (gpu_flash_datt_floats).
		 * dK, dV (or their partials) and dQ per query head, each owned
		 * by one block; the partials added in head order (no atomics). */
		struct flash_copies fc;
		if (!flash_cast_qkv(cb, &fc, q, q16, k, k16, v, v16, B, T, NH, NKV, HS))
			return;
		const bool wg = cb->flash_wg && flash_wg_size(HS);
		enum cu_kernel f, kdkdv, kdq;
		flash_kernels(HS, wg, &f, &kdkdv, &kdq);
		size_t warps = (size_t)B * T * NH;
		assert(out || out16);
		void *rargs[] = {&datt, &fc.dout, &dout, &out, &out16, &B, &T, &NH, &HS};
		/* four columns a lane where the rows' alignment allows (HS a
		 * power of two from 4 to 128: HS / 4 lanes a row, whole xor
		 * groups of a warp; every row of dout, out, out16 and the copy
		 * starts as aligned as the tensor) */
		cu_prof_begin(cb);
		if (HS >= 4 && HS <= 128 && (HS & (HS - 1)) == 0 &&
		    (((uintptr_t)dout | (uintptr_t)out) & 15) == 0 &&
		    (((uintptr_t)out16 | (uintptr_t)fc.dout) & 7) == 0)
			launch_att_rows(cb, CU_K_flash_rowdot4_f32, (warps * (size_t)(HS / 4) + 31) / 32,
					rargs);
		else
			launch_att_rows(cb, CU_K_flash_rowdot_f32, warps, rargs);
		cu_prof_end(cb, "attention_backward: rowdot");
		float *pk = dk, *pv = dv;
		if (NH != NKV) {
			pk = datt + gpu_flash_part_offset(B, T, NH);
			pv = pk + (size_t)B * T * NH * HS;
		}
		const float *rc = r ? r->cos : NULL, *rs = r ? r->sin : NULL;
		gpu_bf16 *d16 = r ? r->d16 : NULL;
		int ld16 = r ? r->ld16 : 0;
		/* Hopper at head size 128, where the caller lends room for dS
		 * (the rows' form): the dK dV kernel leaves each tile's dS there
		 * and dQ is one product from it (flash_wg.cuh: fa_wg_dqs)
		 * instead of three; as many (batch, head) pairs at a time as the
		 * room holds, each chunk's dK dV before its dQ. A tile pair's dS
		 * costs 16 KiB of traffic (written, read) for two products of
		 * 64 x 64 x HS: at head size 64 half the products for the same
		 * bytes, and no faster on Qwen2-0.5B's shape (DESIGN.md) */
		const int pairs = B * NH;
		const size_t pair_ds = gpu_flash_ds_pair_bytes(T);
		gpu_bf16 *ds = wg && HS == 128 && r && r->ds && r->ds_bytes >= pair_ds ? r->ds : NULL;
		if (wg) {
			size_t fit = ds ? r->ds_bytes / pair_ds : (size_t)pairs;
			fit = fit < 65535u ? fit : 65535u; /* gridDim.y */
			const size_t chunks = ((size_t)pairs + fit - 1) / fit; /* of even size */
			const int per = (int)(((size_t)pairs + chunks - 1) / chunks);
			for (int p0 = 0; p0 < pairs; p0 += per) {
				const unsigned n = (unsigned)(pairs - p0 < per ? pairs - p0 : per);
				const unsigned tiles = cu_blocks((size_t)T, 64);
				/* with ds: pairs fastest, the heaviest tiles first
				 * (flash_wg.cuh: fa_wg_dkdv, fa_wg_dqs) */
				const struct cu_dim grid = ds ? (struct cu_dim){n, tiles, 1}
							      : (struct cu_dim){tiles, n, 1};
				void *wkargs[] = {&pk, &pv, &fc.dout, &fc.q,  &fc.k, &fc.v, &att,
						  &datt, &T, &NH,     &NKV,  &ds,   &p0};
				cu_prof_begin(cb);
				cu_launch(cb, kdkdv, grid, dim1(128), FLASH_WG_DKDV_SMEM(HS), wkargs);
				cu_prof_end(cb, "attention_backward: dK dV T%d HS%d", T, HS);
				if (!ds)
					continue;
				void *sargs[] = {&dq, &ds, &fc.k, &T, &NH, &NKV, &p0, &rc, &rs, &d16, &ld16};
				cu_prof_begin(cb);
				cu_launch(cb, CU_K_flash_bwd_dqs_wg_d128, (struct cu_dim){n, (tiles + 1) / 2, 1},
					  dim1(128), FLASH_WG_DQS_SMEM(128), sargs);
				cu_prof_end(cb, "attention_backward: dQ from dS T%d HS%d", T, HS);
			}
		}
		void *kargs[] = {&pk, &pv, &fc.dout, &fc.q, &fc.k, &fc.v, &att, &datt, &T, &NH, &NKV};
		if (!wg) {
			cu_prof_begin(cb);
			if (HS == 128 && cb->flash_dkdv8) /* 8 warps, 128 keys a block */
				cu_launch(cb, CU_K_flash_bwd_dkdv8_d128,
					  (struct cu_dim){cu_blocks((size_t)T, 128), (unsigned)NH,
							  (unsigned)B},
					  dim1(256), FLASH_DKDV8_SMEM, kargs);
			else
				cu_launch(cb, kdkdv,
					  (struct cu_dim){cu_blocks((size_t)T, FLASH_KV_ROWS(HS)),
							  (unsigned)NH, (unsigned)B},
					  dim1(FLASH_THREADS), flash_smem_bytes(FLASH_DKDV, HS), kargs);
			cu_prof_end(cb, "attention_backward: dK dV T%d HS%d", T, HS);
		}
		int rows = B * T;
		cu_prof_begin(cb);
		if (r) { /* dk rotated back, both rounded into d16's rows */
			int ok = NH * HS, ov = (NH + NKV) * HS;
			void *sargs[] = {&dk, &dv, &pk,	 &pv, &rc, &rs,	 &d16, &ld16,
					 &ok, &ov, &rows, &T,  &NH, &NKV, &HS};
			launch_n(cb, CU_K_flash_kv_reduce_rope_f32, (size_t)rows * NKV * HS / 8, sargs);
		} else if (NH != NKV) {
			void *sargs[] = {&dk, &dv, &pk, &pv, &rows, &NH, &NKV, &HS};
			launch_n(cb, CU_K_flash_kv_reduce_f32, (size_t)rows * NKV * HS / 4, sargs);
		}
		cu_prof_end(cb, "attention_backward: kv reduce");
		void *qargs[] = {&dq, &fc.dout, &fc.q, &fc.k, &fc.v, &att, &datt, &T, &NH, &NKV};
		if (wg && ds)
			return;
		if (wg) {
			void *wargs[] = {&dq, &fc.dout, &fc.q, &fc.k, &fc.v, &att, &datt,
					 &T,  &NH,	&NKV,  &rc,   &rs,   &d16, &ld16};
			cu_prof_begin(cb);
			cu_launch(cb, kdq, flash_wg_grid(B, T, NH), dim1(128), FLASH_WG_SMEM(HS), wargs);
			cu_prof_end(cb, "attention_backward: dQ T%d HS%d", T, HS);
			return;
		}
		assert(!r);
		/* the heaviest (last) query tiles of every head first */
		cu_launch(cb, kdq,
			  (struct cu_dim){(unsigned)NH, (unsigned)B,
					  cu_blocks((size_t)T, FLASH_DQ_ROWS(HS))},
			  dim1(FLASH_DQ_THREADS(HS)), flash_smem_bytes(FLASH_DQ, HS), qargs);
		return;
	}
	assert(!q16 && !k16 && !v16 && !r);
	struct att_views a = att_views(T, NH, NKV, HS);
	/* dP_h = dout_h V_g^T: column-major dP^T = V_g dout_h^T. */
	for (int h = 0; h < NH; h++) {
		int g = h / a.rep;
		sgemm_batched(cb, "attention_backward (dP): cublasSgemmStridedBatched", OP_T, OP_N,
			      T, T, HS, 1.0f, v + (size_t)g * HS, a.ldk, a.sk,
			      dout + (size_t)h * HS, a.ldq, a.sq, 0.0f, datt + (size_t)h * T * T, T,
			      a.sa, B);
	}
	size_t rows = (size_t)B * NH * T;
	void *args[] = {&datt, &att, &rows, &T};
	launch_att_rows(cb, CU_K_attention_softmax_backward_f32, rows, args);
	for (int h = 0; h < NH; h++) {
		int g = h / a.rep;
		float beta = h % a.rep == 0 ? 0.0f : 1.0f;
		const float *dS = datt + (size_t)h * T * T, *P = att + (size_t)h * T * T;
		/* dq_h = scale dS_h K_g: column-major dq^T (HS,T) = K_g^T dS_h^T. */
		sgemm_batched(cb, "attention_backward (dq): cublasSgemmStridedBatched", OP_N, OP_N,
			      HS, T, T, a.scale, k + (size_t)g * HS, a.ldk, a.sk, dS, T, a.sa,
			      0.0f, dq + (size_t)h * HS, a.ldq, a.sq, B);
		/* dk_g (+)= scale dS_h^T Q_h: column-major dk^T (HS,T) = Q_h^T dS_h. */
		sgemm_batched(cb, "attention_backward (dk): cublasSgemmStridedBatched", OP_N, OP_T,
			      HS, T, T, a.scale, q + (size_t)h * HS, a.ldq, a.sq, dS, T, a.sa,
			      beta, dk + (size_t)g * HS, a.ldk, a.sk, B);
		/* dv_g (+)= P_h^T dout_h: column-major dv^T (HS,T) = dout_h^T P_h. */
		sgemm_batched(cb, "attention_backward (dv): cublasSgemmStridedBatched", OP_N, OP_T,
			      HS, T, T, 1.0f, dout + (size_t)h * HS, a.ldq, a.sq, P, T, a.sa, beta,
			      dv + (size_t)g * HS, a.ldk, a.sk, B);
	}
}

static void cu_attention_backward(struct gpu_backend *be, float *dq, float *dk, float *dv,
				  float *datt, const float *dout, const float *out,
				  const gpu_bf16 *out16, const float *q, const gpu_bf16 *q16,
				  const float *k, const gpu_bf16 *k16, const float *v,
				  const gpu_bf16 *v16, const float *att, int B, int T, int NH, int NKV,
				  int HS)
{
	att_backward(be, dq, dk, dv, datt, dout, out, out16, q, q16, k, k16, v, v16, att, B, T, NH,
		     NKV, HS, NULL);
}

/* Where the wgmma kernels run with kv groups: the dQ kernel rotates and
 * rounds what it writes, and the kv groups' sum (flash_kv_reduce_rope_f32)
 * does so for dk and dv; rope_backward's and cast_bf16_f32_rows4's passes
 * over them are left out. Elsewhere false (gpu/backend.h). */
static bool cu_attention_backward_rope16(struct gpu_backend *be, float *dq, float *dk, float *dv,
					 float *datt, const float *dout, const float *out,
					 const gpu_bf16 *out16, const gpu_bf16 *q16,
					 const gpu_bf16 *k16, const gpu_bf16 *v16, const float *att,
					 const float *cos, const float *sin, gpu_bf16 *d16,
					 size_t ld16, void *ds, size_t ds_bytes, int B, int T, int NH,
					 int NKV, int HS)
{
	struct cu_backend *cb = cu_of(be);
	const size_t W = (size_t)(NH + 2 * NKV) * HS;
	/* the reduce's float4 and uint2 accesses: HS / 2 in quads, every row
	 * of d16 (and dk's and dv's columns in it) 8-byte aligned, the tables,
	 * dk and dv 16-byte */
	if (cb->no_rope16 || B <= 0 || T <= 0 || NH <= NKV || NKV <= 0 || NH % NKV ||
	    !cu_attention_flash(be, HS) ||
	    !cb->flash_wg || !flash_wg_size(HS) || !q16 || !k16 || !v16 || !d16 || !cos || !sin ||
	    !dq != !dk || !dq != !dv || ld16 < W || ld16 > INT_MAX || ld16 % 4 ||
	    ((uintptr_t)d16 & 7) || (((uintptr_t)cos | (uintptr_t)sin) & 15) ||
	    (((uintptr_t)dk | (uintptr_t)dv) & 15))
		return false;
	/* the kernels read dout's bf16 copy from the GEMM scratch after the
	 * kv groups' sum has written its rows: never the same bytes */
	const uintptr_t r0 = (uintptr_t)d16, r1 = r0 + ((size_t)B * T * ld16) * sizeof(gpu_bf16);
	const uintptr_t s0 = (uintptr_t)cb->base.gemm_scratch, s1 = s0 + cb->base.gemm_scratch_bytes;
	if (r0 < s1 && s0 < r1)
		return false;
	/* ds: where it is 16-byte aligned and clear of the rows and of the
	 * GEMM scratch (the kernels' bf16 copies); else not used */
	const uintptr_t x0 = (uintptr_t)ds, x1 = x0 + ds_bytes;
	if (cb->no_ds || (x0 & 15) || (x0 < r1 && r0 < x1) || (x0 < s1 && s0 < x1))
		ds = NULL;
	const struct att_rope16 r = {cos, sin, d16, (int)ld16, ds, ds ? ds_bytes : 0};
	att_backward(be, dq, dk, dv, datt, dout, out, out16, NULL, q16, NULL, k16, NULL, v16, att, B,
		     T, NH, NKV, HS, &r);
	return true;
}

/* ------------------------------------------------------------ elementwise -- */

/* SwiGLU's all-bf16 kernels (elementwise.cu: *_bf16x8) where each of its
 * n operands is given and 16-byte aligned (the plan's buffers are) */
static bool swiglu_x8(int n, const void *const *p)
{
	for (int i = 0; i < n; i++)
		if (!p[i] || ((uintptr_t)p[i] & 15))
			return false;
	return true;
}

static void cu_swiglu_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			      const float *gate, const float *up, const gpu_bf16 *gate16,
			      const gpu_bf16 *up16, size_t n)
{
	if (!out && !gate && !up && swiglu_x8(3, (const void *[]){out16, gate16, up16})) {
		void *args[] = {&out16, &gate16, &up16, &n};
		launch_n8(cu_of(be), CU_K_swiglu_forward_bf16x8, n, args);
		return;
	}
	void *args[] = {&out, &out16, &gate, &up, &gate16, &up16, &n};
	launch_n4(cu_of(be), CU_K_swiglu_forward_f32, n, args);
}

static void cu_swiglu_backward(struct gpu_backend *be, float *dgate, float *dup,
			       gpu_bf16 *dgate16, gpu_bf16 *dup16, const float *dout,
			       const gpu_bf16 *dout16, const float *gate, const float *up,
			       const gpu_bf16 *gate16, const gpu_bf16 *up16, size_t n,
			       const struct gpu_lora_dx *ad)
{
	if (!ad && !dgate && !dup && !dout && !gate && !up &&
	    swiglu_x8(5, (const void *[]){dgate16, dup16, dout16, gate16, up16})) {
		void *args[] = {&dgate16, &dup16, &dout16, &gate16, &up16, &n};
		launch_n8(cu_of(be), CU_K_swiglu_backward_bf16x8, n, args);
		return;
	}
	if (!ad) {
		void *args[] = {&dgate, &dup,	&dgate16, &dup16,  &dout, &dout16,
				&gate,	&up,	&gate16,  &up16,   &n};
		launch_n4(cu_of(be), CU_K_swiglu_backward_f32, n, args);
		return;
	}
	/* kernels/cuda/elementwise.cu: the bf16 mode's form (bf16 in and out,
	 * A16, cols even and every row 4-byte aligned) on the tensor cores in
	 * blocks of 64 rows by 64 columns; else blocks of 256 columns by 32
	 * rows */
	const size_t rows = n / (size_t)ad->cols;
	assert(rows <= (size_t)INT32_MAX && cu_blocks(rows, 32) <= 65535);
	const float *du = ad->du, *A = ad->A;
	const gpu_bf16 *A16 = ad->A16;
	int R = ad->R, nrows = (int)rows, cols = ad->cols;
	if (!dgate && !dup && dgate16 && dup16 && !dout && dout16 && !gate && !up && gate16 &&
	    up16 && A16 && cols % 2 == 0 &&
	    (((uintptr_t)dgate16 | (uintptr_t)dup16 | (uintptr_t)dout16 | (uintptr_t)gate16 |
	      (uintptr_t)up16) & 3) == 0) {
		void *args[] = {&dgate16, &dup16, &dout16, &gate16, &up16,
				&du,	  &A16,	  &R,	   &nrows,  &cols};
		cu_launch(cu_of(be), CU_K_swiglu_backward_lora_mma,
			  (struct cu_dim){cu_blocks((size_t)cols, 64), cu_blocks(rows, 64), 1},
			  dim1(128), 0, args);
		return;
	}
	void *args[] = {&dgate, &dup, &dgate16, &dup16, &dout, &dout16, &gate, &up,
			&gate16, &up16,	&du,  &A,	&A16,	&R,    &nrows, &cols};
	cu_launch(cu_of(be), CU_K_swiglu_backward_lora_f32,
		  (struct cu_dim){cu_blocks((size_t)cols, 256), cu_blocks(rows, 32), 1}, dim1(256),
		  0, args);
}

static void cu_lora_dx_add(struct gpu_backend *be, float *dinp, const struct gpu_lora_dx *ad,
			   int G, int rows)
{
	/* kernels/cuda/elementwise.cu: blocks of 256 columns by 16 rows */
	if (rows <= 0)
		return;
	assert(cu_blocks((size_t)rows, 16) <= 65535 && G <= 3);
	const float *du[3] = {ad[0].du, NULL, NULL}, *A[3] = {ad[0].A, NULL, NULL};
	const gpu_bf16 *A16[3] = {ad[0].A16, NULL, NULL};
	for (int g = 1; g < G; g++)
		du[g] = ad[g].du, A[g] = ad[g].A, A16[g] = ad[g].A16;
	int R = ad[0].R, cols = ad[0].cols;
	if (A16[0] && cols % 2 == 0 && ((uintptr_t)dinp & 7) == 0) {
		/* the bf16 mode's: on the tensor cores, blocks of 64 rows by 64
		 * columns */
		assert(cu_blocks((size_t)rows, 64) <= 65535);
		void *args[] = {&dinp, &du[0], &du[1], &du[2], &A16[0], &A16[1],
				&A16[2], &G,	&R,	&rows,	&cols};
		cu_launch(cu_of(be), CU_K_lora_dx_add_mma,
			  (struct cu_dim){cu_blocks((size_t)cols, 64), cu_blocks((size_t)rows, 64), 1},
			  dim1(128), 0, args);
		return;
	}
	int vec = cols % 4 == 0 && ((uintptr_t)dinp & 15) == 0;
	void *args[] = {&dinp,	 &du[0],  &du[1], &du[2], &A[0], &A[1], &A[2], &A16[0],
			&A16[1], &A16[2], &G,	  &R,	  &rows, &cols, &vec};
	cu_launch(cu_of(be), CU_K_lora_dx_add_f32,
		  (struct cu_dim){cu_blocks((size_t)cols, 256), cu_blocks((size_t)rows, 16), 1},
		  dim1(256), 0, args);
}

static void cu_residual_forward(struct gpu_backend *be, float *out, const float *a,
				const float *b, size_t n)
{
	void *args[] = {&out, &a, &b, &n};
	launch_n4(cu_of(be), CU_K_residual_forward_f32, n, args);
}

/* ---------------------------------------------------------- cross-entropy -- */

static unsigned vocab_threads(int V)
{
	return V >= 8192 ? CU_VOCAB_THREADS : row_threads(V);
}

static void cu_crossentropy_forward(struct gpu_backend *be, float *losses, const float *logits,
				    const gpu_bf16 *logits16, const int32_t *targets, int N, int V)
{
	assert(!logits != !logits16);
	const void *x = logits ? (const void *)logits : (const void *)logits16;
	void *args[] = {&losses, &x, &targets, &N, &V};
	launch_rows(cu_of(be), logits ? CU_K_crossentropy_forward_f32 : CU_K_crossentropy_forward_bf16,
		    N, vocab_threads(V), args);
}

static void cu_crossentropy_backward(struct gpu_backend *be, float *losses, float *dlogits,
				     gpu_bf16 *dlogits16, const float *logits,
				     const gpu_bf16 *logits16, const int32_t *targets, float dloss,
				     int N, int V)
{
	assert(!logits != !logits16);
	/* in place only over its own kind (gpu/backend.h) */
	assert(!logits16 || (const void *)dlogits != (const void *)logits16);
	assert(!logits || (const void *)dlogits16 != (const void *)logits);
	const void *x = logits ? (const void *)logits : (const void *)logits16;
	void *args[] = {&losses, &dlogits, &dlogits16, &x, &targets, &dloss, &N, &V};
	launch_rows(cu_of(be),
		    logits ? CU_K_crossentropy_backward_f32 : CU_K_crossentropy_backward_bf16, N,
		    vocab_threads(V), args);
}

/* -------------------------------------------------------------- optimizer -- */

static void cu_adamw_update(struct gpu_backend *be, float *param, gpu_bf16 *param16,
			    const float *grad, float gscale, float *m, float *v, size_t n, float lr,
			    float beta1, float beta2, float eps, float weight_decay, int t)
{
	assert(t >= 1);
	struct adamw_scalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
	void *args[] = {&param,	 &param16, &grad,    &gscale,	  &m,		&v,    &n,
			&k.decay, &k.omb1,  &k.omb2, &k.beta2, &k.bc2_sqrt, &k.step_size, &k.eps};
	/* Four values a thread step where the pointers allow (the same bits). */
	bool v4 = (((uintptr_t)param | (uintptr_t)grad | (uintptr_t)m | (uintptr_t)v) & 15) == 0 &&
		  ((uintptr_t)param16 & 7) == 0;
	if (v4)
		launch_n4(cu_of(be), CU_K_adamw_update_v4_f32, n, args);
	else
		launch_n(cu_of(be), CU_K_adamw_update_f32, n, args);
}

/* An embedding's AdamW whose gradient is kept by rows: adamw_update_f32's
 * arithmetic (adamw_one), each value's gradient from its row's row. */
static void cu_adamw_update_rows(struct gpu_backend *be, float *param, const float *rows,
				 const int32_t *row_of, int C, float gscale, float *m, float *v,
				 size_t n, float lr, float beta1, float beta2, float eps,
				 float weight_decay, int t)
{
	assert(C > 0 && n % (size_t)C == 0);
	assert(t >= 1);
	struct adamw_scalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
	void *args[] = {&param, &rows,	 &row_of, &C,	   &gscale,	&m,	      &v,    &n,
			&k.decay, &k.omb1, &k.omb2, &k.beta2, &k.bc2_sqrt, &k.step_size, &k.eps};
	/* By rows, four values a thread, where C and the pointers allow (the
	 * same bits): a block of C / 4 threads (up to CU_THREADS, whole warps) */
	if (C % 4 == 0 &&
	    (((uintptr_t)param | (uintptr_t)rows | (uintptr_t)m | (uintptr_t)v) & 15) == 0) {
		const size_t q = (size_t)C / 4, threads = ((q < CU_THREADS ? q : CU_THREADS) + 31) / 32 * 32;
		cu_launch(cu_of(be), CU_K_adamw_update_rows_v4_f32, dim1(grid_cap(n / (size_t)C)),
			  dim1((unsigned)threads), 0, args);
		return;
	}
	launch_n(cu_of(be), CU_K_adamw_update_rows_f32, n, args);
}

/* Blocking. Per-block double partials into reduce_buf, downloaded (which
 * waits for the stream) and added on the host in block order. The grid is a
 * function of n and reduce_cap, so the sum is the same bits on every run.
 * After a device error the result is NaN (the error itself is reported by
 * the next gpu_sync). */
static double cu_sumsq(struct gpu_backend *be, const float *x, size_t n)
{
	struct cu_backend *cb = cu_of(be);
	if (n == 0)
		return 0.0;
	if (!cb->reduce_buf || cb->reduce_cap == 0) {
		cu_check(cb, CUDA_ERROR_NOT_INITIALIZED, "sumsq: the backend has no reduction buffer");
		return NAN;
	}
	size_t blocks = (n + CU_SUMSQ_MIN - 1) / CU_SUMSQ_MIN;
	if (blocks > CU_SUMSQ_MAX_BLOCKS)
		blocks = CU_SUMSQ_MAX_BLOCKS;
	if (blocks > cb->reduce_cap)
		blocks = cb->reduce_cap;
	double *partial = cb->reduce_buf;
	void *args[] = {&partial, &x, &n};
	/* four values a thread step where x is aligned (an order as fixed) */
	cu_launch(cb, ((uintptr_t)x & 15) == 0 ? CU_K_sumsq_v4_f32 : CU_K_sumsq_f32,
		  dim1((unsigned)blocks), dim1(CU_THREADS), 0, args);
	double host[CU_SUMSQ_MAX_BLOCKS];
	be->ops->download(be, host, partial, blocks * sizeof(double));
	if (cb->first_error != CUDA_SUCCESS)
		return NAN;
	double sum = 0.0;
	for (size_t i = 0; i < blocks; i++)
		sum += host[i];
	return sum;
}

static void cu_scale(struct gpu_backend *be, float *x, float s, size_t n)
{
	void *args[] = {&x, &s, &n};
	if (((uintptr_t)x & 15) == 0)
		launch_n4(cu_of(be), CU_K_scale_v4_f32, n, args);
	else
		launch_n(cu_of(be), CU_K_scale_f32, n, args);
}

/* ------------------------------------------------------------------ bf16 -- */

static void cu_bf16_round(struct gpu_backend *be, gpu_bf16 *out, const float *in, size_t n)
{
	launch_cast(cu_of(be), out, in, n);
}

static void cu_bf16_widen(struct gpu_backend *be, float *out, const gpu_bf16 *in, size_t n)
{
	void *args[] = {&out, &in, &n};
	launch_n(cu_of(be), CU_K_cast_f32_bf16, n, args);
}

static void cu_bf16_round_rows(struct gpu_backend *be, gpu_bf16 *out, size_t ldo, const float *in,
			       size_t rows, size_t cols)
{
	void *args[] = {&out, &ldo, &in, &rows, &cols};
	/* four values a thread: whole quads a row, in 16-byte and out 8-byte
	 * aligned at every row */
	if (cols > 0 && cols % 4 == 0 && ldo % 4 == 0 && ((uintptr_t)in & 15) == 0 &&
	    ((uintptr_t)out & 7) == 0) {
		size_t quads = rows * (cols / 4);
		launch_n(cu_of(be), CU_K_cast_bf16_f32_rows4, quads, args);
		return;
	}
	if (cols > 0)
		launch_rows(cu_of(be), CU_K_cast_bf16_f32_rows,
			    rows > (size_t)INT_MAX ? INT_MAX : (int)rows,
			    row_threads(cols > 4096 ? 4096 : (int)cols), args);
}

/* ---------------------------------------------------------------- methods -- */

/* out16: the values rounded to bf16 as cast_bf16_f32 rounds them (the
 * same bits as out then a cast), for the bf16 mode's GEMMs. */
static void cu_nf4_dequantize(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			      const uint8_t *codes, const float *absmax, size_t n)
{
	void *args[] = {&out, &out16, &codes, &absmax, &n};
	launch_n(cu_of(be), CU_K_nf4_dequantize_f32, n, args);
}

static void cu_absmax_dequantize(struct gpu_backend *be, float *absmax, const int8_t *q,
				 const float *scale, size_t nblocks)
{
	void *args[] = {&absmax, &q, &scale, &nblocks};
	launch_n(cu_of(be), CU_K_absmax_dequantize_f32, nblocks, args);
}

static void cu_distill_forward(struct gpu_backend *be, float *kl, float *ce, const float *logits,
			       const float *tlogits, const int32_t *targets, float temperature,
			       int N, int V)
{
	void *args[] = {&kl, &ce, &logits, &tlogits, &targets, &temperature, &N, &V};
	launch_rows(cu_of(be), CU_K_distill_forward_f32, N, vocab_threads(V), args);
}

/* The gradient's weights formed in double as the CPU op forms them. */
static void cu_distill_backward(struct gpu_backend *be, float *dlogits, const float *logits,
				const float *tlogits, const int32_t *targets, float dloss,
				float alpha, float temperature, int N, int V)
{
	float wkd = (float)((double)dloss * alpha * (double)temperature);
	float wce = (float)((double)dloss * (1.0 - alpha));
	void *args[] = {&dlogits, &logits, &tlogits, &targets, &wkd, &wce, &temperature, &N, &V};
	launch_rows(cu_of(be), CU_K_distill_backward_f32, N, vocab_threads(V), args);
}

/* The mask threshold and the keep scale as the CPU op forms them. */
static void cu_dropout(struct gpu_backend *be, float *out, const float *inp, float p,
		       uint64_t seed, size_t n)
{
	assert(p >= 0.0f && p < 1.0f);
	unsigned threshold = (unsigned)((double)p * 16777216.0);
	float keep_scale = (float)(1.0 / (1.0 - (double)p));
	void *args[] = {&out, &inp, &threshold, &keep_scale, &seed, &n};
	launch_n(cu_of(be), CU_K_dropout_f32, n, args);
}

/* ------------------------------------------------------------------ table -- */

void cu_ops_fill(struct gpu_backend_ops *ops)
{
	ops->embedding_forward = cu_embedding_forward;
	ops->embedding_backward = cu_embedding_backward;
	ops->embedding_forward_part = cu_embedding_forward_part;
	ops->embedding_backward_part = cu_embedding_backward_part;
	ops->rmsnorm_forward = cu_rmsnorm_forward;
	ops->rmsnorm_backward = cu_rmsnorm_backward;
	ops->matmul_forward = cu_matmul_forward;
	ops->matmul_forward_add = cu_matmul_forward_add;
	ops->matmul_forward_residual = cu_matmul_forward_residual;
	ops->matmul_backward = cu_matmul_backward;
	ops->rope_forward = cu_rope_forward;
	ops->rope_qkv16 = cu_rope_qkv16;
	ops->rope_backward = cu_rope_backward;
	ops->attention_flash = cu_attention_flash;
	ops->gemm_bf16 = cu_gemm_bf16;
	ops->attention_forward = cu_attention_forward;
	ops->attention_backward = cu_attention_backward;
	ops->attention_backward_rope16 = cu_attention_backward_rope16;
	ops->matmul_backward_ld16 = cu_matmul_backward_ld16;
	ops->bias_backward_ld16 = cu_bias_backward_ld16;
	ops->matmul_forward_scaled = cu_matmul_forward_scaled;
	ops->swiglu_forward = cu_swiglu_forward;
	ops->swiglu_backward = cu_swiglu_backward;
	ops->lora_dx_add = cu_lora_dx_add;
	ops->residual_forward = cu_residual_forward;
	ops->crossentropy_forward = cu_crossentropy_forward;
	ops->crossentropy_backward = cu_crossentropy_backward;
	ops->adamw_update = cu_adamw_update;
	ops->adamw_update_rows = cu_adamw_update_rows;
	ops->sumsq = cu_sumsq;
	ops->scale = cu_scale;
	ops->bf16_round = cu_bf16_round;
	ops->bf16_widen = cu_bf16_widen;
	ops->bf16_round_rows = cu_bf16_round_rows;
	ops->nf4_dequantize = cu_nf4_dequantize;
	ops->absmax_dequantize = cu_absmax_dequantize;
	ops->distill_forward = cu_distill_forward;
	ops->distill_backward = cu_distill_backward;
	ops->dropout = cu_dropout;
}
