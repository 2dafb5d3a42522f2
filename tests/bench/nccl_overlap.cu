/* How much an NCCL all-reduce slows the products running beside it: the
 * question behind the two-GPU gap (README, "Several GPUs"). Two GPUs of
 * one host, one thread: a stream of bf16 products (cuBLAS, fp32 outputs)
 * on each GPU, and a stream of fp32 all-reduces of BUCKET_MB buckets on a
 * second, highest-priority stream (as gpu/comm.c has it) — each alone,
 * then both started at once. The all-reduces run on plain device memory
 * (cudaMalloc: NCCL's ring) and on a symmetric window (ncclMemAlloc +
 * ncclCommWindowRegister, NCCL 2.27+: its symmetric kernels, which take
 * fewer SMs). One JSON line a case:
 *   {"buffers", "gemm_ms", "gemm_tflops", "allreduce_ms", "allreduce_gbs",
 *    "together_gemm_ms", "gemm_slowdown_pct", "together_allreduce_ms",
 *    "slowdown_ms_per_gb"}
 * slowdown_ms_per_gb: the products' extra time per GB all-reduced (each
 * rank's data), the cost a data-parallel step pays for its gradients'
 * bytes whatever the overlap.
 *
 * Not part of the build (NCCL's headers are no build dependency: traind
 * loads the library at run time); tests/gpu/device-run.sh overlap compiles
 * it on the device against the NCCL that PyTorch ships.
 * usage: nccl_overlap [GEMMS [ALLREDUCES [BUCKET_MB]]]   (400 64 60) */
#include <cstdio>
#include <cstdlib>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <nccl.h>

/* A failed call: its file, line and message, and the caller returns 1. */
#define FAIL_IF(bad, msg)                                                            \
	do {                                                                         \
		if (bad) {                                                           \
			fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, (msg)); \
			return 1;                                                    \
		}                                                                    \
	} while (0)
#define CK(x) do { cudaError_t e_ = (x); FAIL_IF(e_ != cudaSuccess, cudaGetErrorString(e_)); } while (0)
#define NK(x) do { ncclResult_t r_ = (x); FAIL_IF(r_ != ncclSuccess, ncclGetErrorString(r_)); } while (0)
#define BK(x) \
	do { cublasStatus_t s_ = (x); FAIL_IF(s_ != CUBLAS_STATUS_SUCCESS, cublasGetStatusString(s_)); } while (0)

enum { ND = 2, NBUCKETS = 8 };
/* A Qwen2-0.5B MLP product: M tokens, N = intermediate, K = hidden. */
static const int M = 8192, N = 4864, K = 896;

struct gpu {
	ncclComm_t comm;
	cublasHandle_t blas;
	cudaStream_t math, coll;
	__nv_bfloat16 *a, *b; /* (M, K), (N, K) */
	float *c;             /* (M, N) */
	float *plain, *sym;   /* NBUCKETS buckets each */
	ncclWindow_t win;
	cudaEvent_t t0, t1, c0, c1;
};
static struct gpu g[ND];

static int gemms(int n)
{
	const float one = 1, zero = 0;
	for (int d = 0; d < ND; d++) {
		CK(cudaSetDevice(d));
		for (int i = 0; i < n; i++)
			BK(cublasGemmEx(g[d].blas, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, g[d].b,
					CUDA_R_16BF, K, g[d].a, CUDA_R_16BF, K, &zero, g[d].c, CUDA_R_32F,
					N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
	}
	return 0;
}

static int allreduces(bool sym, size_t count, int n)
{
	for (int i = 0; i < n; i++) {
		NK(ncclGroupStart());
		for (int d = 0; d < ND; d++) {
			float *x = (sym ? g[d].sym : g[d].plain) + (size_t)(i % NBUCKETS) * count;
			NK(ncclAllReduce(x, x, count, ncclFloat, ncclSum, g[d].comm, g[d].coll));
		}
		NK(ncclGroupEnd());
	}
	return 0;
}

/* The slower GPU's time between its events a and b. */
static int span(cudaEvent_t gpu::*a, cudaEvent_t gpu::*b, float *ms)
{
	*ms = 0;
	for (int d = 0; d < ND; d++) {
		float t;
		CK(cudaSetDevice(d));
		CK(cudaEventSynchronize(g[d].*b));
		CK(cudaEventElapsedTime(&t, g[d].*a, g[d].*b));
		if (t > *ms)
			*ms = t;
	}
	return 0;
}

static int record(cudaEvent_t gpu::*e, cudaStream_t gpu::*s)
{
	for (int d = 0; d < ND; d++) {
		CK(cudaSetDevice(d));
		CK(cudaEventRecord(g[d].*e, g[d].*s));
	}
	return 0;
}

static int sync_all(void)
{
	for (int d = 0; d < ND; d++) {
		CK(cudaSetDevice(d));
		CK(cudaDeviceSynchronize());
	}
	return 0;
}

int main(int argc, char **argv)
{
	const int ng = argc > 1 ? atoi(argv[1]) : 400, na = argc > 2 ? atoi(argv[2]) : 64;
	const size_t count = (size_t)(argc > 3 ? atoi(argv[3]) : 60) << 20 >> 2; /* floats a bucket */
	const size_t bytes = count * NBUCKETS * sizeof(float);
	int devs[ND] = {0, 1}, n = 0;
	CK(cudaGetDeviceCount(&n));
	if (n < ND || ng < 1 || na < 1 || !count) {
		fprintf(stderr, "nccl_overlap: needs %d GPUs (found %d) and positive counts\n", ND, n);
		return 1;
	}
	ncclComm_t comms[ND];
	NK(ncclCommInitAll(comms, ND, devs));
	for (int d = 0; d < ND; d++) {
		struct gpu *x = &g[d];
		int least, greatest;
		x->comm = comms[d];
		CK(cudaSetDevice(d));
		BK(cublasCreate(&x->blas));
		CK(cudaStreamCreateWithFlags(&x->math, cudaStreamNonBlocking));
		CK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
		CK(cudaStreamCreateWithPriority(&x->coll, cudaStreamNonBlocking, greatest));
		BK(cublasSetStream(x->blas, x->math));
		CK(cudaMalloc(&x->a, (size_t)M * K * sizeof(*x->a)));
		CK(cudaMalloc(&x->b, (size_t)N * K * sizeof(*x->b)));
		CK(cudaMalloc(&x->c, (size_t)M * N * sizeof(*x->c)));
		CK(cudaMemset(x->a, 0, (size_t)M * K * sizeof(*x->a)));
		CK(cudaMemset(x->b, 0, (size_t)N * K * sizeof(*x->b)));
		CK(cudaMalloc(&x->plain, bytes));
		CK(cudaMemset(x->plain, 0, bytes));
		NK(ncclMemAlloc((void **)&x->sym, bytes));
		CK(cudaMemset(x->sym, 0, bytes));
		CK(cudaEventCreate(&x->t0));
		CK(cudaEventCreate(&x->t1));
		CK(cudaEventCreate(&x->c0));
		CK(cudaEventCreate(&x->c1));
	}
	NK(ncclGroupStart()); /* collective: every rank's window at once */
	for (int d = 0; d < ND; d++) {
		CK(cudaSetDevice(d));
		NK(ncclCommWindowRegister(g[d].comm, g[d].sym, bytes, &g[d].win,
					  NCCL_WIN_COLL_SYMMETRIC));
	}
	NK(ncclGroupEnd());
	if (sync_all() || gemms(20) || allreduces(false, count, NBUCKETS) ||
	    allreduces(true, count, NBUCKETS) || sync_all()) /* warm */
		return 1;
	const double gb = (double)na * (double)count * sizeof(float) / 1e9;
	const double flop = 2.0 * M * N * K * ng;
	for (int rep = 0; rep < 2; rep++) {
		float gemm_ms;
		if (record(&gpu::t0, &gpu::math) || gemms(ng) || record(&gpu::t1, &gpu::math) ||
		    span(&gpu::t0, &gpu::t1, &gemm_ms))
			return 1;
		for (int sym = 0; sym < 2; sym++) {
			float ar_ms, tg_ms, ta_ms;
			if (record(&gpu::c0, &gpu::coll) || allreduces(sym, count, na) ||
			    record(&gpu::c1, &gpu::coll) || span(&gpu::c0, &gpu::c1, &ar_ms) || sync_all())
				return 1;
			/* together: the collectives' stream starts with the products' */
			for (int d = 0; d < ND; d++) {
				CK(cudaSetDevice(d));
				CK(cudaEventRecord(g[d].t0, g[d].math));
				CK(cudaStreamWaitEvent(g[d].coll, g[d].t0, 0));
				CK(cudaEventRecord(g[d].c0, g[d].coll));
			}
			if (gemms(ng) || allreduces(sym, count, na) || record(&gpu::t1, &gpu::math) ||
			    record(&gpu::c1, &gpu::coll) || span(&gpu::t0, &gpu::t1, &tg_ms) ||
			    span(&gpu::c0, &gpu::c1, &ta_ms) || sync_all())
				return 1;
			printf("{\"buffers\": \"%s\", \"gemm_ms\": %.2f, \"gemm_tflops\": %.0f, "
			       "\"allreduce_ms\": %.2f, \"allreduce_gbs\": %.0f, \"together_gemm_ms\": %.2f, "
			       "\"gemm_slowdown_pct\": %.1f, \"together_allreduce_ms\": %.2f, "
			       "\"slowdown_ms_per_gb\": %.2f}\n",
			       sym ? "symmetric window" : "cudaMalloc", gemm_ms, flop / gemm_ms / 1e9, ar_ms,
			       gb / ar_ms * 1e3, tg_ms, 100.0 * (tg_ms - gemm_ms) / gemm_ms, ta_ms,
			       (tg_ms - gemm_ms) / gb);
		}
	}
	for (int d = 0; d < ND; d++) {
		CK(cudaSetDevice(d));
		NK(ncclCommWindowDeregister(g[d].comm, g[d].win));
		NK(ncclMemFree(g[d].sym));
		NK(ncclCommDestroy(g[d].comm));
	}
	return 0;
}
