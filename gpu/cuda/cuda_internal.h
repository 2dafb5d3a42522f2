/* Inside the CUDA backend module (libtraind-cuda.so): the backend object, the
 * sealed kernel table and the launch primitive the op launchers use.
 *
 * The module reaches the driver only through function pointers resolved from
 * libcuda.so.1 at run time (contract 5): nothing here links libcuda. Kernels
 * live in the .cu files of kernels/cuda, compiled at build time into one cubin per
 * supported architecture plus PTX, embedded in the module. At backend creation
 * every kernel of the table is resolved (the "prewarm"), then the table is
 * sealed: there is no way to look a kernel up by a string after that, and any
 * compile (PTX JIT for an architecture without a cubin) after seal counts in
 * compiles_after_seal, which the gpu tests assert is zero (contract 2).
 *
 * Not a public API: the engine sees only gpu/backend.h. */
#ifndef GPU_CUDA_CUDA_INTERNAL_H
#define GPU_CUDA_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cublasLt.h>
#include <cuda.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu/backend.h"

/* Every kernel of kernels/cuda, by its extern "C" name. The enum below is
 * generated from this list; the .cu files must define exactly these. */
#include "gpu/cuda/kernels.def"

enum cu_kernel {
#define CU_KERNEL_ENUM_(name) CU_K_##name,
	CU_KERNEL_LIST(CU_KERNEL_ENUM_)
#undef CU_KERNEL_ENUM_
	CU_K_COUNT_
};

/* Driver entry points used by the module, resolved with dlsym from
 * libcuda.so.1. The X-macro argument is the cuda.h name; cuda.h maps some to
 * versioned symbols (cuMemAlloc -> cuMemAlloc_v2), which is what is looked up. */
#define CU_DRIVER_LIST(X)                                                     \
	X(cuInit) X(cuDriverGetVersion) X(cuDeviceGetCount) X(cuDeviceGet)    \
	X(cuDeviceGetName) X(cuDeviceGetUuid) X(cuDeviceGetAttribute)         \
	X(cuDeviceTotalMem) X(cuDevicePrimaryCtxRetain)                       \
	X(cuDevicePrimaryCtxRelease) X(cuCtxSetCurrent) X(cuCtxSynchronize)   \
	X(cuStreamCreate) X(cuStreamDestroy) X(cuStreamSynchronize)           \
	X(cuMemAlloc) X(cuMemFree) X(cuMemGetInfo) X(cuMemcpyHtoDAsync)       \
	X(cuMemcpyDtoHAsync) X(cuMemcpyDtoDAsync) X(cuMemsetD8Async)          \
	X(cuModuleLoadData) X(cuModuleUnload) X(cuModuleGetFunction)          \
	X(cuFuncSetAttribute) X(cuLaunchKernel) X(cuGetErrorName)             \
	X(cuGetErrorString) X(cuLinkCreate) X(cuLinkAddData)                  \
	X(cuLinkComplete) X(cuLinkDestroy) X(cuEventCreate)                   \
	X(cuEventRecord) X(cuEventSynchronize) X(cuEventElapsedTime)          \
	X(cuEventDestroy) X(cuStreamWaitEvent) X(cuMemHostAlloc)              \
	X(cuMemFreeHost)

/* Optional entry points (NULL where the driver lacks them): the virtual
 * memory management API, which a shared base (gpu/backend.h: share_alloc)
 * is allocated through so that it can be made read-only; stream capture
 * and graphs (gpu/backend.h: graph_begin). */
#define CU_DRIVER_OPT_LIST(X)                                                 \
	X(cuMemCreate) X(cuMemRelease) X(cuMemAddressReserve)                 \
	X(cuMemAddressFree) X(cuMemMap) X(cuMemUnmap) X(cuMemSetAccess)       \
	X(cuMemGetAllocationGranularity)                                      \
	X(cuStreamBeginCapture) X(cuStreamEndCapture)                         \
	X(cuGraphInstantiateWithFlags) X(cuGraphExecUpdate) X(cuGraphLaunch)  \
	X(cuGraphDestroy) X(cuGraphExecDestroy)

struct cu_driver {
	void *lib;
#define CU_DRIVER_PTR_(name) __typeof__(&name) name;
	CU_DRIVER_LIST(CU_DRIVER_PTR_)
	CU_DRIVER_OPT_LIST(CU_DRIVER_PTR_)
#undef CU_DRIVER_PTR_
};

struct cu_dim {
	unsigned x, y, z;
};

#define CU_LT_PLANS 128 /* a model's product shapes (LoRA's and the head's included) */
#define CU_LT_ALGOS 8	 /* the heuristic's first algorithms timed per shape */
#define CU_LT_ROUNDS 3	 /* lt_tune's rounds: each algorithm timed once a round */
#define CU_LT_EVENTS (CU_LT_ROUNDS * (CU_LT_ALGOS + 1) + 1)

struct cu_backend {
	struct gpu_backend base; /* first: the engine holds a struct gpu_backend * */
	struct cu_driver drv;
	CUdevice dev;
	CUcontext ctx;
	CUstream stream;
	/* The copy stream (gpu/backend.h: copy_async, copy_wait): copies
	 * between the device and pinned host memory beside the math. mark is
	 * recorded on stream at each copy and waited on by copy_stream (the
	 * copy after the ops enqueued before it); done[k] is recorded on
	 * copy_stream after copy k and waited on by stream (copy_wait). */
	CUstream copy_stream;
	CUevent copy_mark;
	CUevent copy_done[GPU_COPY_SLOTS];
	CUmodule module;
	CUfunction fn[CU_K_COUNT_];
	bool sealed;
	int cc_major, cc_minor;
	char name[256];
	char uuid[37];
	cublasHandle_t blas;
	/* cuBLASLt: the residual adds' products (an addend apart from the
	 * output), and every bf16 product's timed choice (cuda_ops.c:
	 * gemm16_, lt_plan, lt_tune); NULL where it could not be created (the
	 * products then go through cublasGemmEx, the residual adds through a
	 * copy). Its plans, one per product shape, made the first time the
	 * backend sees it: the heuristic's algorithms for it (up to
	 * CU_LT_ALGOS), timed beside the reference (cublasGemmEx's default;
	 * for a residual add, the heuristic's first) at the first call that
	 * may run more than once (beta 0, or the addend apart), and the
	 * fastest kept of those whose output has the reference's bits —
	 * fastest as the step runs them: back to back, the device at its
	 * power cap (cuda_ops.c: lt_tune). */
	cublasLtHandle_t lt;
	struct cu_lt_plan {
		int ta, tb, m, n, k, lda, ldb, ldc; /* ta, tb: cublasOperation_t */
		bool out16, resid;		    /* D bf16; C fp32 apart from D */
		bool bias;			    /* the epilogue adds a bias (fp32 D, beta 0) */
		unsigned align;			    /* of the four pointers, bytes, at most 256 */
		int nalgo;			    /* 0: no algorithm (the plan is not used) */
		int chosen;			    /* the algorithm run: -1 cublasGemmEx's */
		bool tuned;
		int degenerate;			    /* timings put off: an output of zeros */
		float ms_ref;			    /* the reference's time */
		float ms[CU_LT_ALGOS];		    /* each one's time (-1: not eligible) */
		cublasLtMatmulDesc_t desc;
		cublasLtMatrixLayout_t la, lb, lc, ld;
		cublasLtMatmulAlgo_t algo[CU_LT_ALGOS];
	} lt_plans[CU_LT_PLANS];
	int lt_nplans;
	/* cuBLASLt's algorithms timed (false: TD_CUDA_NO_GEMM_TUNE=1, or fp32
	 * mode): cublasGemmEx's default for the products, as before. */
	bool gemm_tune;
	/* lt_tune's marks between its timed runs, made at its first call */
	CUevent tune_ev[CU_LT_EVENTS];
	/* The first error of an asynchronous op: sticky until reported by sync. */
	CUresult first_error;
	char first_error_where[128];
	/* Graphs (gpu/backend.h: graph_begin): the driver has them and
	 * TD_CUDA_NO_GRAPHS is not set; capturing: the stream is being
	 * recorded, and capture_error is the first failure while it was (the
	 * recording's, not the stream's: the ops run again without a graph);
	 * no blocking op (lt_tune) runs then. */
	bool graphs, capturing;
	CUresult capture_error;
	char capture_error_where[128];
	bool capture_told; /* a failed recording logged (once a backend) */
	int64_t compiles, compiles_after_seal;
	/* Tier 2 of the module cache (gpu/cuda/modcache.h): its directory, ""
	 * for none (every PTX load compiles), and what it did at creation. */
	char cache_dir[4096];
	int64_t cache_hits, cache_rebuilds;
	bool fp32_strict; /* fp32 mode: TF32 off (parity); false: bf16 GEMMs (set_bf16) */
	/* A device scratch for reductions, reduce_cap doubles: sumsq's partials
	 * (1 double per block), and, seen as 2*reduce_cap floats, the per-part
	 * partials of the column sums (dbias, rmsnorm dweight) in cuda_ops.c,
	 * which use up to 64*C floats when there is room (else fewer parts),
	 * and, seen as reduce_cap 8-byte keys, the embedding backward's sorted
	 * rows. Stream-ordered, so the ops share it safely. */
	double *reduce_buf;
	size_t reduce_cap;
	/* cuBLAS's workspace, allocated at creation (counted in fixed_bytes). */
	void *blas_ws;
	size_t blas_ws_bytes;
	/* The TD_CUDA_FAULT_AFTER_OPS test hook (cuda_backend.c): N (0: off),
	 * the kernel launches so far, and whether this backend fired it. */
	long long fault_after, launches;
	bool fault_culprit;
	/* Bit i: the fused attention kernels of head size 16 << i can have the
	 * shared memory they need on this device (cu_flash_prepare). */
	unsigned flash_ok;
	/* HS 128's dK, dV by flash_bwd_dkdv8_d128 (8 warps, 128 keys a block,
	 * 137 KiB of shared memory: sm_80/90/100), else by
	 * flash_bwd_dkdv_d128 (4 warps, 64 keys, within 99 KiB). */
	bool flash_dkdv8;
	/* The module is the sm_90a cubin (load_kernels): the kernels of
	 * kernels/cuda/flash_wg.cuh have their bodies. */
	bool image_specific;
	/* HS 64's and 128's forward and backward by flash_wg.cuh's wgmma kernels (the
	 * sm_90a image, their shared memory granted, TD_CUDA_NO_WGMMA unset),
	 * else by flash.cu's mma.sync ones. */
	bool flash_wg;
	bool no_rope16; /* TD_CUDA_NO_ROPE16=1 (cuda_ops.c) */
	bool no_ds;     /* TD_CUDA_NO_DS=1 (cuda_ops.c) */
	bool no_bias_epilogue; /* TD_CUDA_NO_BIAS_EPILOGUE=1 (cuda_ops.c) */
	/* TD_CUDA_PROFILE's per-op device times (cuda_prof.c); NULL when off. */
	struct cu_prof *prof;
	/* TD_CUDA_TRACE's timeline of the ops (cuda_prof.c); NULL when off. */
	struct cu_trace *tr;
};

static inline struct cu_backend *cu_of(struct gpu_backend *be)
{
	return (struct cu_backend *)be;
}

/* Records the first failure of an async call; later ops still enqueue (they
 * are cheap no-ops on a broken context) and sync reports the first error. */
void cu_check(struct cu_backend *cb, CUresult r, const char *what);
void cu_check_blas(struct cu_backend *cb, cublasStatus_t s, const char *what);

/* Launches kernel k on the backend's stream. args as for cuLaunchKernel: an
 * array of pointers to each argument. Never synchronises. */
void cu_launch(struct cu_backend *cb, enum cu_kernel k, struct cu_dim grid, struct cu_dim block,
	       unsigned shmem, void **args);

/* ceil(a / b) */
static inline unsigned cu_blocks(size_t a, unsigned b)
{
	return (unsigned)((a + b - 1) / b);
}

/* Opens libcuda.so.1 and resolves CU_DRIVER_LIST into d (d->lib NULL when the
 * library is missing). TD_EUNSUPPORTED: no driver, or one too old. */
td_err cu_open_driver(struct cu_driver *d, struct td_errbuf *eb);

/* TD_CUDA_PROFILE (gpu/cuda/cuda_prof.c): open at creation (installs the
 * trace hook when the variable is set), begin/end around a region (no-ops
 * when off; regions nest two deep), close prints the table to stderr.
 * TD_CUDA_TRACE=FILE instead: open installs a timeline hook, close (the
 * stream idle) writes FILE.K. */
void cu_prof_open(struct cu_backend *cb);
void cu_prof_begin(struct cu_backend *cb);
void cu_prof_end(struct cu_backend *cb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void cu_prof_close(struct cu_backend *cb);
/* The ops (gpu/cuda/cuda_ops.c): fills the math entries of the ops table. */
void cu_ops_fill(struct gpu_backend_ops *ops);
/* After the kernel table is sealed: lets the fused attention kernels use the
 * dynamic shared memory they need, and records in flash_ok which can. */
void cu_flash_prepare(struct cu_backend *cb);

#endif
