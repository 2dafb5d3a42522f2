/* Whether a timed choice of cuBLASLt's algorithm beats what the CUDA
 * backend runs today (issue 13): for each bf16 GEMM of a Qwen2-0.5B and a
 * Llama-3-8B-shaped step, as gpu/cuda/cuda_ops.c calls it (cublasGemmEx,
 * CUBLAS_GEMM_DEFAULT; the residual adds through cuBLASLt's first
 * heuristic), the time of that call, then of each algorithm cuBLASLt's
 * heuristic offers for the same product (up to 32, within the backend's
 * 32 MiB workspace), each checked against the default's output: whether
 * its bits are the default's, and its largest difference from it over the
 * largest magnitude (two fp32 sums of the same bf16 products in other
 * orders, or a bf16 output rounded from another fp32 sum). A probe that
 * reports, not a test: the worst-case bound of a reordered fp32 sum over
 * k up to 151936 terms is far above any difference seen, so it would check
 * nothing; what decides is whether the faster algorithms are bit-identical.
 *
 * One JSON line a shape: the default's ms, the best algorithm's ms and
 * index, the heuristic's first algorithm's ms, how many algorithms ran,
 * and how many were bit-identical to the default. Those times are a cool
 * device's (a wait after each call). Then the same at the power cap, as a
 * step runs its products (an H200 at ~1.6 GHz under them): the device kept
 * busy (the default for ~150 calls), then rounds of 30 calls back to back
 * of the default and of each bit-identical algorithm in turn, the mean of
 * the last three rounds — the default's, the best's and its index, and
 * the time at the cap of the algorithm that was fastest cool (what a
 * cool timing would keep; gpu/cuda/cuda_ops.c: lt_tune times at the cap
 * since these numbers). Built by the build
 * (tests/bench/meson.build) so that it cannot rot; run on the device by
 * tests/gpu/device-run.sh gemm. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cublas_check.h"

/* One product as cuda_ops.c issues it, column-major: D (m, n) = op(A) op(B)
 * + beta C, A and B bf16, D fp32 or bf16 (out16), C = D unless resid
 * (matmul_forward_residual: C the residual, fp32, D another buffer). */
struct shape {
	const char *what;
	cublasOperation_t ta, tb;
	int m, n, k;
	float beta;
	bool out16, resid;
};

#define T_ CUBLAS_OP_T
#define N_ CUBLAS_OP_N
static const struct shape shapes[] = {
	/* Qwen2-0.5B, B8 x T1024: C 896, I 4864, kv 128, vocab 151936 (head chunks of 2736) */
	{"qwen2 fwd gate/up (bf16 out)", T_, N_, 4864, 8192, 896, 0, true, false},
	{"qwen2 fwd q (fp32 out)", T_, N_, 896, 8192, 896, 0, false, false},
	{"qwen2 fwd k/v (fp32 out)", T_, N_, 128, 8192, 896, 0, false, false},
	{"qwen2 fwd o + residual", T_, N_, 896, 8192, 896, 1, false, true},
	{"qwen2 fwd down + residual", T_, N_, 896, 8192, 4864, 1, false, true},
	{"qwen2 fwd head chunk (bf16 out)", T_, N_, 151936, 2736, 896, 0, true, false},
	{"qwen2 bwd gate/up dinp", N_, N_, 896, 4096, 4864, 1, false, false},
	{"qwen2 bwd gate/up dweight", N_, T_, 896, 4864, 4096, 1, false, false},
	{"qwen2 bwd down dinp (bf16 out)", N_, N_, 4864, 4096, 896, 0, true, false},
	{"qwen2 bwd down dweight", N_, T_, 4864, 896, 4096, 1, false, false},
	{"qwen2 bwd q/o dinp", N_, N_, 896, 8192, 896, 0, false, false},
	{"qwen2 bwd q/o dweight", N_, T_, 896, 896, 8192, 0, false, false},
	{"qwen2 bwd k/v dinp", N_, N_, 896, 8192, 128, 1, false, false},
	{"qwen2 bwd k/v dweight", N_, T_, 896, 128, 8192, 0, false, false},
	{"qwen2 bwd head dinp", N_, N_, 896, 2736, 151936, 0, false, false},
	{"qwen2 bwd head dweight", N_, T_, 896, 151936, 2736, 1, false, false},
	/* Llama-3-8B shapes, B4 x T2048: C 4096, I 14336, kv 1024, vocab 128256 (chunks of 2048),
	 * as its step runs them (TD_CUDA_PROFILE at 6429de5) */
	{"8b fwd gate/up (bf16 out)", T_, N_, 14336, 8192, 4096, 0, true, false},
	{"8b fwd q, k, v (fp32 out)", T_, N_, 6144, 8192, 4096, 0, false, false},
	{"8b fwd o + residual", T_, N_, 4096, 8192, 4096, 1, false, true},
	{"8b fwd down + residual", T_, N_, 4096, 8192, 14336, 1, false, true},
	{"8b fwd head chunk (bf16 out)", T_, N_, 128256, 2048, 4096, 0, true, false},
	{"8b bwd gate/up dinp (adding)", N_, N_, 4096, 8192, 14336, 1, false, false},
	{"8b bwd gate/up dweight", N_, T_, 4096, 14336, 8192, 0, false, false},
	{"8b bwd down dinp (bf16 out)", N_, N_, 14336, 8192, 4096, 0, true, false},
	{"8b bwd down dweight", N_, T_, 14336, 4096, 8192, 0, false, false},
	{"8b bwd q, k, v dinp", N_, N_, 4096, 8192, 6144, 0, false, false},
	{"8b bwd q, k, v dweight", N_, T_, 4096, 6144, 8192, 0, false, false},
	{"8b bwd o dinp", N_, N_, 4096, 8192, 4096, 0, false, false},
	{"8b bwd o dweight", N_, T_, 4096, 4096, 8192, 0, false, false},
	{"8b bwd head dinp", N_, N_, 4096, 2048, 128256, 0, false, false},
	{"8b bwd head dweight (adding)", N_, T_, 4096, 128256, 2048, 1, false, false},
};

#define WS_BYTES ((size_t)32 << 20) /* GPU_CUDA_BLAS_WORKSPACE_BYTES */
#define MAX_ALGOS 32

__global__ void fill_bf16(__nv_bfloat16 *x, size_t n, uint32_t seed)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		uint32_t h = (uint32_t)i * 2654435761u ^ seed;
		h ^= h >> 15;
		h *= 2246822519u;
		h ^= h >> 13;
		x[i] = __float2bfloat16((float)(h & 0xffff) / 65536.0f - 0.5f);
	}
}

__global__ void fill_f32(float *x, size_t n, uint32_t seed)
{
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		uint32_t h = (uint32_t)i * 2246822519u ^ seed;
		h ^= h >> 16;
		x[i] = (float)(h & 0xffff) / 65536.0f - 0.5f;
	}
}

struct bufs {
	__nv_bfloat16 *a, *b;
	void *c, *d, *ref; /* C (the addend), D, the default's D */
	void *ws;
};

static cudaEvent_t e0, e1;

/* ms a call of fn(ctx), the median of reps after two warm calls */
template <class F> static float time_ms(F fn, int reps)
{
	fn();
	fn();
	float t[64];
	for (int r = 0; r < reps; r++) {
		CK(cudaEventRecord(e0));
		fn();
		CK(cudaEventRecord(e1));
		CK(cudaEventSynchronize(e1));
		CK(cudaEventElapsedTime(&t[r], e0, e1));
	}
	for (int i = 1; i < reps; i++) /* insertion sort: reps is small */
		for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
			float x = t[j];
			t[j] = t[j - 1];
			t[j - 1] = x;
		}
	return t[reps / 2];
}

/* D's elements as floats on the host */
static void fetch(float *h, const void *d, size_t n, bool is16)
{
	if (!is16) {
		CK(cudaMemcpy(h, d, n * 4, cudaMemcpyDeviceToHost));
		return;
	}
	uint16_t *t = (uint16_t *)malloc(n * 2);
	CK(cudaMemcpy(t, d, n * 2, cudaMemcpyDeviceToHost));
	for (size_t i = 0; i < n; i++) {
		uint32_t u = (uint32_t)t[i] << 16;
		memcpy(&h[i], &u, 4);
	}
	free(t);
}

int main(void)
{
	cublasHandle_t blas;
	cublasLtHandle_t lt;
	CB(cublasCreate(&blas));
	CB(cublasLtCreate(&lt));
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	size_t ma = 0, mb = 0, md = 0;
	for (const struct shape &s : shapes) {
		size_t a = (size_t)s.m * s.k, b = (size_t)s.k * s.n, d = (size_t)s.m * s.n;
		ma = a > ma ? a : ma;
		mb = b > mb ? b : mb;
		md = d > md ? d : md;
	}
	struct bufs B;
	CK(cudaMalloc(&B.a, ma * 2));
	CK(cudaMalloc(&B.b, mb * 2));
	CK(cudaMalloc(&B.c, md * 4));
	CK(cudaMalloc(&B.d, md * 4));
	CK(cudaMalloc(&B.ref, md * 4));
	CK(cudaMalloc(&B.ws, WS_BYTES));
	CB(cublasSetWorkspace(blas, B.ws, WS_BYTES));
	fill_bf16<<<1024, 256>>>(B.a, ma, 1);
	fill_bf16<<<1024, 256>>>(B.b, mb, 2);
	CK(cudaDeviceSynchronize());
	float *h_ref = (float *)malloc(md * 4), *h_d = (float *)malloc(md * 4);
	cudaDeviceProp prop;
	CK(cudaGetDeviceProperties(&prop, 0));
	for (const struct shape &s : shapes) {
		const int lda = s.ta == N_ ? s.m : s.k, ldb = s.tb == N_ ? s.k : s.n, ldc = s.m;
		const size_t nd = (size_t)s.m * s.n;
		const cudaDataType_t dt = s.out16 ? CUDA_R_16BF : CUDA_R_32F;
		const float alpha = 1.0f, beta = s.beta;
		/* the addend: the residual (resid) or what beta = 1 adds to */
		auto reset = [&]() {
			fill_f32<<<1024, 256>>>((float *)B.c, nd, 3);
			if (!s.resid && s.beta != 0) {
				if (s.out16)
					fill_bf16<<<1024, 256>>>((__nv_bfloat16 *)B.d, nd, 3);
				else
					CK(cudaMemcpy(B.d, B.c, nd * 4, cudaMemcpyDeviceToDevice));
			}
		};
		/* cuBLASLt's description of the same product */
		cublasLtMatmulDesc_t desc;
		cublasLtMatrixLayout_t la, lb, lc, ld;
		CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
		CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &s.ta, sizeof(s.ta)));
		CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &s.tb, sizeof(s.tb)));
		CB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, s.ta == N_ ? s.m : s.k,
					      s.ta == N_ ? s.k : s.m, lda));
		CB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, s.tb == N_ ? s.k : s.n,
					      s.tb == N_ ? s.n : s.k, ldb));
		CB(cublasLtMatrixLayoutCreate(&lc, s.resid ? CUDA_R_32F : dt, s.m, s.n, ldc));
		CB(cublasLtMatrixLayoutCreate(&ld, dt, s.m, s.n, ldc));
		cublasLtMatmulPreference_t pref;
		CB(cublasLtMatmulPreferenceCreate(&pref));
		size_t ws = WS_BYTES;
		CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
							&ws, sizeof(ws)));
		cublasLtMatmulHeuristicResult_t res[MAX_ALGOS];
		int found = 0;
		CB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, s.resid ? lc : ld, ld, pref,
						  MAX_ALGOS, res, &found));
		const void *C = s.resid ? B.c : B.d;
		auto lt_call = [&](int i) {
			CB(cublasLtMatmul(lt, desc, &alpha, B.a, la, B.b, lb, &beta, C, s.resid ? lc : ld,
					  B.d, ld, &res[i].algo, B.ws, WS_BYTES, 0));
		};
		/* what cuda_ops.c runs: cublasGemmEx, or (resid) the heuristic's first */
		auto dflt = [&]() {
			if (s.resid)
				lt_call(0);
			else
				CB(cublasGemmEx(blas, s.ta, s.tb, s.m, s.n, s.k, &alpha, B.a, CUDA_R_16BF,
						lda, B.b, CUDA_R_16BF, ldb, &beta, B.d, dt, ldc,
						CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
		};
		const double flop = 2.0 * s.m * s.n * (double)s.k;
		/* beta = 1 accumulates into D at every call: the timing does not
		 * care, the check resets D before one call of each */
		reset();
		const float t_def = time_ms(dflt, 15);
		reset();
		dflt();
		CK(cudaMemcpy(B.ref, B.d, nd * (s.out16 ? 2 : 4), cudaMemcpyDeviceToDevice));
		fetch(h_ref, B.ref, nd, s.out16);
		float amax = 0;
		for (size_t i = 0; i < nd; i++)
			amax = fmaxf(amax, fabsf(h_ref[i]));
		int best = -1, same = 0, ran = 0, ids[MAX_ALGOS], nid = 0, cool_best = -1;
		float t_best = 1e30f, t_first = 0, t_cool_best = 1e30f;
		double worst = 0;
		for (int i = 0; i < found; i++) {
			if (res[i].state != CUBLAS_STATUS_SUCCESS)
				continue;
			reset();
			const float t = time_ms([&]() { lt_call(i); }, 9);
			reset();
			lt_call(i);
			CK(cudaDeviceSynchronize());
			fetch(h_d, B.d, nd, s.out16);
			double diff = 0;
			bool bits = true;
			for (size_t j = 0; j < nd; j++) {
				double x = fabs((double)h_d[j] - h_ref[j]);
				diff = x > diff ? x : diff;
				bits = bits && h_d[j] == h_ref[j];
			}
			diff /= amax > 0 ? amax : 1;
			worst = diff > worst ? diff : worst;
			same += bits;
			ran++;
			if (bits) {
				ids[nid++] = i;
				if (t < t_cool_best) {
					t_cool_best = t;
					cool_best = i;
				}
			}
			if (i == 0)
				t_first = t;
			if (t < t_best) {
				t_best = t;
				best = i;
			}
		}
		/* at the power cap: the device kept busy, then rounds of 30 calls
		 * of the default and of each bit-identical algorithm in turn;
		 * the first round not counted */
		if (t_def <= t_cool_best)
			cool_best = -1; /* the default was fastest cool */
		enum { CALLS = 30, ROUNDS = 4 };
		double cap[MAX_ALGOS + 1] = {0};
		for (int h = 0; h < 150; h++)
			dflt();
		for (int r = 0; r < ROUNDS; r++)
			for (int j = 0; j <= nid; j++) {
				for (int h = 0; h < 5; h++)
					dflt();
				CK(cudaEventRecord(e0));
				for (int c = 0; c < CALLS; c++)
					if (j == nid)
						dflt();
					else
						lt_call(ids[j]);
				CK(cudaEventRecord(e1));
				CK(cudaEventSynchronize(e1));
				float ms;
				CK(cudaEventElapsedTime(&ms, e0, e1));
				if (r > 0)
					cap[j] += ms / CALLS / (ROUNDS - 1);
			}
		int cap_best = -1;
		double t_cap_best = cap[nid], t_cap_cool = cap[nid];
		for (int j = 0; j < nid; j++) {
			if (cap[j] < t_cap_best) {
				t_cap_best = cap[j];
				cap_best = ids[j];
			}
			if (ids[j] == cool_best)
				t_cap_cool = cap[j];
		}
		printf("{\"device\": \"%s\", \"gemm\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, "
		       "\"default_ms\": %.4f, \"default_tflops\": %.1f, \"lt_first_ms\": %.4f, "
		       "\"best_ms\": %.4f, \"best_tflops\": %.1f, \"best_index\": %d, "
		       "\"gain\": %.3f, \"algos\": %d, \"bit_identical\": %d, \"worst_rel\": %.3g, "
		       "\"cap_default_ms\": %.4f, \"cap_best_ms\": %.4f, \"cap_best_index\": %d, "
		       "\"cap_of_cool_best_ms\": %.4f, \"cool_best_index\": %d}\n",
		       prop.name, s.what, s.m, s.n, s.k, t_def, flop / t_def / 1e9, t_first, t_best,
		       flop / t_best / 1e9, best, t_def / t_best, ran, same, worst, cap[nid], t_cap_best,
		       cap_best, t_cap_cool, cool_best);
		fflush(stdout);
		cublasLtMatmulPreferenceDestroy(pref);
		cublasLtMatrixLayoutDestroy(la);
		cublasLtMatrixLayoutDestroy(lb);
		cublasLtMatrixLayoutDestroy(lc);
		cublasLtMatrixLayoutDestroy(ld);
		cublasLtMatmulDescDestroy(desc);
	}
	free(h_ref);
	free(h_d);
	return 0;
}
