/* Whether splitting k helps the small weight-gradient products (issue 13):
 * Qwen2-0.5B's o and q,k,v weight gradients are 896 x 896 and 896 x 1152
 * outputs over k = 8192 tokens, 49 and 63 tiles of 128 x 128 on 132
 * multiprocessors. For each shape (NT, as cuda_ops.c's matmul_backward
 * calls it, bf16 in, fp32 out), the time of cublasGemmEx's default, of the
 * heuristic's best unsplit algorithm, and of each of its first algorithms
 * copied with CUBLASLT_ALGO_CONFIG_SPLITK_NUM s and each reduction scheme,
 * with whether two runs of it give the same bits (the backend keeps only
 * deterministic products). A probe that reports: JSON lines, no assertion
 * on times. Run on the device by tests/gpu/device-run.sh splitk. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cublas_check.h"

struct shape {
	const char *what;
	int m, n, k;
};

static cublasLtHandle_t lt;
static void *ws;
static const size_t ws_bytes = 32u << 20;

static float run_ms(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
		    cublasLtMatrixLayout_t lc, const cublasLtMatmulAlgo_t *a, const void *A,
		    const void *B, float *D, int reps)
{
	const float one = 1.0f, zero = 0.0f;
	cudaEvent_t e0, e1;
	CK(cudaEventCreate(&e0));
	CK(cudaEventCreate(&e1));
	if (cublasLtMatmul(lt, d, &one, A, la, B, lb, &zero, D, lc, D, lc, a, ws, ws_bytes, 0))
		return -1.0f;
	CK(cudaEventRecord(e0));
	for (int r = 0; r < reps; r++)
		cublasLtMatmul(lt, d, &one, A, la, B, lb, &zero, D, lc, D, lc, a, ws, ws_bytes, 0);
	CK(cudaEventRecord(e1));
	CK(cudaEventSynchronize(e1));
	float ms = 0;
	CK(cudaEventElapsedTime(&ms, e0, e1));
	cudaEventDestroy(e0);
	cudaEventDestroy(e1);
	return ms / reps;
}

static uint64_t digest(const float *D, size_t n)
{
	uint32_t *h = (uint32_t *)malloc(n * 4);
	CK(cudaMemcpy(h, D, n * 4, cudaMemcpyDeviceToHost));
	uint64_t x = 1469598103934665603ull;
	for (size_t i = 0; i < n; i++)
		x = (x ^ h[i]) * 1099511628211ull;
	free(h);
	return x;
}

int main(void)
{
	const struct shape shapes[] = {
		{"qwen2 o dW", 896, 896, 8192},     {"qwen2 qkv dW", 896, 1152, 8192},
		{"qwen2 mlp dW", 4864, 896, 8192},   {"qwen2 down dW", 896, 4864, 8192},
		{"8b o dW", 4096, 4096, 8192},       {"8b qkv dW", 4096, 6144, 8192},
	};
	if (cublasLtCreate(&lt))
		return 2;
	cublasHandle_t blas;
	if (cublasCreate(&blas))
		return 2;
	CK(cudaMalloc(&ws, ws_bytes));
	for (const struct shape &s : shapes) {
		const int m = s.m, n = s.n, k = s.k;
		__nv_bfloat16 *A, *B;
		float *D;
		CK(cudaMalloc(&A, (size_t)m * k * 2));
		CK(cudaMalloc(&B, (size_t)n * k * 2));
		CK(cudaMalloc(&D, (size_t)m * n * 4));
		{ /* values of both signs, a few bits each */
			uint16_t *h = (uint16_t *)malloc((size_t)(m > n ? m : n) * k * 2);
			for (size_t i = 0; i < (size_t)(m > n ? m : n) * k; i++) {
				__nv_bfloat16 b = __float2bfloat16((float)((int)(i * 2654435761u % 97) - 48) / 64.0f);
				memcpy(&h[i], &b, 2);
			}
			CK(cudaMemcpy(A, h, (size_t)m * k * 2, cudaMemcpyHostToDevice));
			CK(cudaMemcpy(B, h, (size_t)n * k * 2, cudaMemcpyHostToDevice));
			free(h);
		}
		const cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_T;
		cublasLtMatmulDesc_t d;
		cublasLtMatrixLayout_t la, lb, lc;
		cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
		cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
		cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
		cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, m);
		cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, n, k, n);
		cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, m);
		cublasLtMatmulPreference_t pref;
		cublasLtMatmulPreferenceCreate(&pref);
		cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
						     sizeof(ws_bytes));
		cublasLtMatmulHeuristicResult_t res[16];
		int found = 0;
		cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, lc, lc, pref, 16, res, &found);
		/* the default */
		const float one = 1.0f, zero = 0.0f;
		cudaEvent_t e0, e1;
		CK(cudaEventCreate(&e0));
		CK(cudaEventCreate(&e1));
		cublasGemmEx(blas, ta, tb, m, n, k, &one, A, CUDA_R_16BF, m, B, CUDA_R_16BF, n, &zero, D,
			     CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
		CK(cudaEventRecord(e0));
		for (int r = 0; r < 20; r++)
			cublasGemmEx(blas, ta, tb, m, n, k, &one, A, CUDA_R_16BF, m, B, CUDA_R_16BF, n, &zero,
				     D, CUDA_R_32F, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
		CK(cudaEventRecord(e1));
		CK(cudaEventSynchronize(e1));
		float dms = 0;
		CK(cudaEventElapsedTime(&dms, e0, e1));
		dms /= 20;
		float best1 = 1e9f;
		int best1_i = -1;
		for (int i = 0; i < found; i++) {
			uint32_t sk = 0;
			size_t w;
			cublasLtMatmulAlgoConfigGetAttribute(&res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &sk,
							     sizeof(sk), &w);
			const float ms = run_ms(d, la, lb, lc, &res[i].algo, A, B, D, 20);
			if (sk <= 1 && ms > 0 && ms < best1)
				best1 = ms, best1_i = i;
			printf("{\"shape\": \"%s\", \"algo\": %d, \"heuristic_splitk\": %u, \"ms\": %.4f}\n", s.what,
			       i, sk, ms);
		}
		printf("{\"shape\": \"%s\", \"m\": %d, \"n\": %d, \"k\": %d, \"default_ms\": %.4f, "
		       "\"best_unsplit_ms\": %.4f, \"best_unsplit\": %d, \"found\": %d}\n",
		       s.what, m, n, k, dms, best1, best1_i, found);
		const uint32_t schemes[] = {CUBLASLT_REDUCTION_SCHEME_INPLACE,
					    CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE};
		for (uint32_t split : {2u, 3u, 4u, 6u, 8u})
			for (uint32_t sch : schemes) {
				float best = 1e9f;
				int bi = -1, det = -1;
				for (int i = 0; i < found && i < 8; i++) {
					cublasLtMatmulAlgo_t a = res[i].algo;
					if (cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
										 &split, sizeof(split)) ||
					    cublasLtMatmulAlgoConfigSetAttribute(
						    &a, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &sch, sizeof(sch)))
						continue;
					cublasLtMatmulHeuristicResult_t chk;
					if (cublasLtMatmulAlgoCheck(lt, d, la, lb, lc, lc, &a, &chk) ||
					    chk.workspaceSize > ws_bytes)
						continue;
					const float ms = run_ms(d, la, lb, lc, &a, A, B, D, 20);
					if (ms <= 0)
						continue;
					const uint64_t h1 = digest(D, (size_t)m * n);
					run_ms(d, la, lb, lc, &a, A, B, D, 1);
					const uint64_t h2 = digest(D, (size_t)m * n);
					if (ms < best) {
						best = ms;
						bi = i;
						det = h1 == h2;
					}
				}
				printf("{\"shape\": \"%s\", \"splitk\": %u, \"scheme\": \"%s\", \"best_ms\": %.4f, "
				       "\"algo\": %d, \"deterministic\": %d, \"vs_default\": %.3f}\n",
				       s.what, split, sch == CUBLASLT_REDUCTION_SCHEME_INPLACE ? "inplace" : "compute",
				       bi >= 0 ? best : -1.0f, bi, det, bi >= 0 ? dms / best : 0.0f);
			}
		cublasLtMatmulPreferenceDestroy(pref);
		cublasLtMatrixLayoutDestroy(la);
		cublasLtMatrixLayoutDestroy(lb);
		cublasLtMatrixLayoutDestroy(lc);
		cublasLtMatmulDescDestroy(d);
		cudaFree(A);
		cudaFree(B);
		cudaFree(D);
	}
	return 0;
}
