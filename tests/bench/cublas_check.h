/* The CUDA probes' checks (tests/bench/gemm_tune.cu, splitk_probe.cu,
 * graph_probe.cu): a runtime or cuBLAS call that fails prints where and
 * exits 2. */
#ifndef TD_BENCH_CUBLAS_CHECK_H
#define TD_BENCH_CUBLAS_CHECK_H
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                            \
	do {                                                                             \
		cudaError_t e_ = (x);                                                    \
		if (e_ != cudaSuccess) {                                                 \
			fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,        \
				cudaGetErrorString(e_));                                 \
			exit(2);                                                         \
		}                                                                        \
	} while (0)
#define CB(x)                                                                            \
	do {                                                                             \
		cublasStatus_t s_ = (x);                                                 \
		if (s_ != CUBLAS_STATUS_SUCCESS) {                                       \
			fprintf(stderr, "%s:%d %s: %d\n", __FILE__, __LINE__, #x, (int)s_); \
			exit(2);                                                         \
		}                                                                        \
	} while (0)

#endif
