/* The CUDA backend's core: driver loading, device, context, stream, memory,
 * the embedded kernel images, the sealed kernel table, cuBLAS, and the use of
 * tier 2 of the module cache (gpu/cuda/modcache.h) for the PTX path.
 *
 * This file is compiled into libtraind-cuda.so, a module the daemon and the
 * tests dlopen (gpu/select.c). libcuda.so.1 is itself opened here with dlopen,
 * so nothing links the driver. One primary context per device (the daemon
 * owns it), one stream per backend object (one per job) and beside it a copy
 * stream for the copies to and from pinned host memory. All kernels are
 * resolved when the backend is created — before any weight is uploaded —
 * and the table is sealed (contract 2). The math ops are in cuda_ops.c.
 *
 * Not the engine: it never sees the model, only ops and buffers. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/cuda/cuda_internal.h"
#include "gpu/cuda/images.h"
#include "gpu/cuda/modcache.h"
#include "gpu/gpu_abi.h"

/* The GPU interface this module was built from (gpu/abi.py): traind
 * refuses a module whose stamp is not its own (gpu/select.c). */
__attribute__((visibility("default"))) const char gpu_cuda_abi[] = TD_GPU_ABI;
#include "proto/log.h"
#include "gpu/select.h"

#define CU_STR2_(x) #x
#define CU_STR_(x) CU_STR2_(x)

/* The errors after which the context is unusable for the rest of the
 * process (CUDA's "sticky" errors): every stream of every backend on the
 * device reports them from then on, until the primary context is reset
 * (gpu_device_reset). Reported as TD_EDEVICE_LOST, not TD_EDEVICE. */
static bool cu_sticky(CUresult r)
{
	switch (r) {
	case CUDA_ERROR_ILLEGAL_ADDRESS:
	case CUDA_ERROR_LAUNCH_FAILED:
	case CUDA_ERROR_ILLEGAL_INSTRUCTION:
	case CUDA_ERROR_MISALIGNED_ADDRESS:
	case CUDA_ERROR_INVALID_ADDRESS_SPACE:
	case CUDA_ERROR_INVALID_PC:
	case CUDA_ERROR_HARDWARE_STACK_ERROR:
	case CUDA_ERROR_ASSERT:
	case CUDA_ERROR_ECC_UNCORRECTABLE:
		return true;
	default:
		return false;
	}
}

/* The fault-injection test hook (tests/gpu/fault.sh): with
 * TD_CUDA_FAULT_AFTER_OPS=N in the environment, the first backend of the
 * process whose kernel launches (cu_launch: every math op but the cuBLAS
 * GEMMs launches at least one) reach N launches fault_inject_f32 on a wild
 * pointer: a real CUDA_ERROR_ILLEGAL_ADDRESS, which corrupts the device's
 * primary context. It fires once per process, whichever backend gets there
 * first. So that the daemon names the faulting job (the one that reports the
 * loss first, daemon/runner.c), the other backends' syncs wait, at most
 * FAULT_WAIT_MS, until the faulting backend is destroyed before they report
 * the loss. Never set in production. */
enum { FAULT_ARMED, FAULT_FIRED, FAULT_DONE };
static atomic_int fault_state = FAULT_ARMED;
#define FAULT_WAIT_MS 10000

static void fault_hook(struct cu_backend *cb)
{
	if (cb->fault_after <= 0 || ++cb->launches != cb->fault_after)
		return;
	int want = FAULT_ARMED;
	if (!atomic_compare_exchange_strong(&fault_state, &want, FAULT_FIRED))
		return;
	cb->fault_culprit = true;
	/* Aligned, far from any allocation, never mapped. */
	float *wild = (float *)(uintptr_t)0x10;
	void *args[] = {&wild};
	td_warn("TD-GPU-FAULT-INJECT", "TD_CUDA_FAULT_AFTER_OPS=%lld: launching fault_inject_f32 "
		"on CUDA device %d (test hook)", (long long)cb->fault_after, (int)cb->dev);
	CUresult r = cb->drv.cuLaunchKernel(cb->fn[CU_K_fault_inject_f32], 1, 1, 1, 1, 1, 1, 0,
					    cb->stream, args, NULL);
	cu_check(cb, r, "fault_inject_f32 (TD_CUDA_FAULT_AFTER_OPS test hook)");
	cu_check(cb, cb->drv.cuStreamSynchronize(cb->stream),
		 "fault_inject_f32 (TD_CUDA_FAULT_AFTER_OPS test hook)");
}

/* Not the faulting backend of the hook: let it report first (see above). */
static void fault_wait(struct cu_backend *cb)
{
	if (cb->fault_culprit || !cu_sticky(cb->first_error))
		return;
	for (int ms = 0; ms < FAULT_WAIT_MS && atomic_load(&fault_state) == FAULT_FIRED; ms += 10)
		nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
}

/* A failure while the stream is recorded is the recording's (graph_end
 * then drops it and the ops run again), unless it lost the context. */
static bool capture_failed(struct cu_backend *cb, CUresult r, const char *what)
{
	if (!cb->capturing || cu_sticky(r))
		return false;
	if (cb->capture_error == CUDA_SUCCESS) {
		cb->capture_error = r;
		snprintf(cb->capture_error_where, sizeof(cb->capture_error_where), "%s", what);
	}
	return true;
}

void cu_check(struct cu_backend *cb, CUresult r, const char *what)
{
	if (r == CUDA_SUCCESS || cb->first_error != CUDA_SUCCESS || capture_failed(cb, r, what))
		return;
	cb->first_error = r;
	snprintf(cb->first_error_where, sizeof(cb->first_error_where), "%s", what);
}

void cu_check_blas(struct cu_backend *cb, cublasStatus_t s, const char *what)
{
	if (s == CUBLAS_STATUS_SUCCESS || cb->first_error != CUDA_SUCCESS ||
	    capture_failed(cb, CUDA_ERROR_UNKNOWN, what))
		return;
	/* cuBLAS failures map onto a driver-style sticky error with the cuBLAS name. */
	cb->first_error = CUDA_ERROR_UNKNOWN;
	snprintf(cb->first_error_where, sizeof(cb->first_error_where), "%s: %s", what,
		 cublasGetStatusName(s));
}

void cu_launch(struct cu_backend *cb, enum cu_kernel k, struct cu_dim grid, struct cu_dim block,
	       unsigned shmem, void **args)
{
	static const char *const names[] = {
#define CU_KERNEL_NAME_(name) #name,
		CU_KERNEL_LIST(CU_KERNEL_NAME_)
#undef CU_KERNEL_NAME_
	};
	if (grid.x == 0 || grid.y == 0 || grid.z == 0)
		return; /* nothing to do: an empty launch is an error to the driver */
	CUresult r = cb->drv.cuLaunchKernel(cb->fn[k], grid.x, grid.y, grid.z, block.x, block.y,
					     block.z, shmem, cb->stream, args, NULL);
	cu_check(cb, r, names[k]);
	fault_hook(cb);
}

static td_err cu_err(struct cu_backend *cb, CUresult r, const char *what, struct td_errbuf *eb)
{
	const char *name = "?", *str = "?";
	if (cb->drv.cuGetErrorName)
		cb->drv.cuGetErrorName(r, &name);
	if (cb->drv.cuGetErrorString)
		cb->drv.cuGetErrorString(r, &str);
	if (cu_sticky(r))
		return td_fail(eb, TD_EDEVICE_LOST, "%s: %s (%s); the device's context is lost", what,
			       name, str);
	return td_fail(eb, TD_EDEVICE, "%s: %s (%s)", what, name, str);
}

/* --- memory --- */

static td_err cuda_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	struct cu_backend *cb = cu_of(be);
	CUdeviceptr p = 0;
	CUresult r = cb->drv.cuMemAlloc(&p, bytes ? bytes : 256);
	if (r != CUDA_SUCCESS)
		return r == CUDA_ERROR_OUT_OF_MEMORY ? TD_ENOMEM
		       : cu_sticky(r)		     ? TD_EDEVICE_LOST
						     : TD_EDEVICE;
	cu_check(cb, cb->drv.cuMemsetD8Async(p, 0, bytes, cb->stream), "cuMemsetD8Async");
	be->bytes_in_use += bytes;
	if (be->bytes_in_use > be->bytes_peak)
		be->bytes_peak = be->bytes_in_use;
	*out = (void *)(uintptr_t)p;
	return TD_OK;
}

static void cuda_free(struct gpu_backend *be, void *p, size_t bytes)
{
	struct cu_backend *cb = cu_of(be);
	/* Work still queued may read p: finish it first (a copy too). */
	cb->drv.cuStreamSynchronize(cb->stream);
	cb->drv.cuStreamSynchronize(cb->copy_stream);
	cb->drv.cuMemFree((CUdeviceptr)(uintptr_t)p);
	be->bytes_in_use -= bytes;
}

/* Shared memory (a frozen base that several jobs' backends on this device
 * read, train/base.h). Through the VMM API where the driver has it: physical
 * memory mapped at a reserved range with read-write access until
 * cuda_share_seal makes the mapping read-only (CU_MEM_ACCESS_FLAGS_PROT_READ:
 * a kernel's write then faults instead of changing another job's weights).
 * Elsewhere (or if the VMM calls fail) cuMemAlloc in the primary context,
 * which every backend of the device shares, and no seal. The VMM ranges are
 * remembered here, so that share_free knows how to undo each. */
#define CU_VMM_MAX 64
static struct {
	CUdeviceptr ptr;
	size_t size; /* rounded up to the granularity */
} vmm_ranges[CU_VMM_MAX];
static pthread_mutex_t vmm_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t vmm_size(struct cu_backend *cb, size_t bytes)
{
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)cb->dev}};
	size_t g = 0;
	if (!cb->drv.cuMemGetAllocationGranularity ||
	    cb->drv.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
		    CUDA_SUCCESS ||
	    g == 0)
		return 0;
	return (bytes + g - 1) / g * g;
}

static td_err vmm_alloc(struct cu_backend *cb, size_t bytes, CUdeviceptr *out)
{
	const struct cu_driver *d = &cb->drv;
	if (!d->cuMemCreate || !d->cuMemRelease || !d->cuMemAddressReserve || !d->cuMemAddressFree ||
	    !d->cuMemMap || !d->cuMemUnmap || !d->cuMemSetAccess)
		return TD_EUNSUPPORTED;
	size_t size = vmm_size(cb, bytes);
	if (!size)
		return TD_EUNSUPPORTED;
	CUmemAllocationProp prop = {.type = CU_MEM_ALLOCATION_TYPE_PINNED,
				    .location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)cb->dev}};
	CUmemGenericAllocationHandle h;
	CUresult r = d->cuMemCreate(&h, size, &prop, 0);
	if (r != CUDA_SUCCESS)
		return r == CUDA_ERROR_OUT_OF_MEMORY ? TD_ENOMEM : TD_EUNSUPPORTED;
	CUdeviceptr p = 0;
	if (d->cuMemAddressReserve(&p, size, 0, 0, 0) != CUDA_SUCCESS) {
		d->cuMemRelease(h);
		return TD_EUNSUPPORTED;
	}
	CUmemAccessDesc acc = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
	if (d->cuMemMap(p, size, 0, h, 0) != CUDA_SUCCESS) {
		d->cuMemAddressFree(p, size);
		d->cuMemRelease(h);
		return TD_EUNSUPPORTED;
	}
	/* The mapping holds the memory from now on: it goes at cuMemUnmap. */
	d->cuMemRelease(h);
	if (d->cuMemSetAccess(p, size, &acc, 1) != CUDA_SUCCESS) {
		d->cuMemUnmap(p, size);
		d->cuMemAddressFree(p, size);
		return TD_EUNSUPPORTED;
	}
	pthread_mutex_lock(&vmm_mu);
	int slot = -1;
	for (int i = 0; i < CU_VMM_MAX && slot < 0; i++)
		if (!vmm_ranges[i].ptr)
			slot = i;
	if (slot >= 0)
		vmm_ranges[slot].ptr = p, vmm_ranges[slot].size = size;
	pthread_mutex_unlock(&vmm_mu);
	if (slot < 0) {
		d->cuMemUnmap(p, size);
		d->cuMemAddressFree(p, size);
		return TD_EUNSUPPORTED;
	}
	*out = p;
	return TD_OK;
}

/* The VMM range at p (removed when take), or 0. */
static size_t vmm_find(CUdeviceptr p, bool take)
{
	size_t size = 0;
	pthread_mutex_lock(&vmm_mu);
	for (int i = 0; i < CU_VMM_MAX; i++)
		if (vmm_ranges[i].ptr == p) {
			size = vmm_ranges[i].size;
			if (take)
				vmm_ranges[i].ptr = 0;
			break;
		}
	pthread_mutex_unlock(&vmm_mu);
	return size;
}

static td_err cuda_share_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	struct cu_backend *cb = cu_of(be);
	cb->drv.cuCtxSetCurrent(cb->ctx);
	CUdeviceptr p = 0;
	td_err e = vmm_alloc(cb, bytes ? bytes : 256, &p);
	if (e == TD_ENOMEM)
		return e;
	if (e != TD_OK) {
		CUresult r = cb->drv.cuMemAlloc(&p, bytes ? bytes : 256);
		if (r != CUDA_SUCCESS)
			return r == CUDA_ERROR_OUT_OF_MEMORY ? TD_ENOMEM
			       : cu_sticky(r)		     ? TD_EDEVICE_LOST
							     : TD_EDEVICE;
	}
	cu_check(cb, cb->drv.cuMemsetD8Async(p, 0, bytes, cb->stream), "cuMemsetD8Async");
	cb->drv.cuStreamSynchronize(cb->stream);
	*out = (void *)(uintptr_t)p;
	return TD_OK;
}

static void cuda_share_free(struct gpu_backend *be, void *p, size_t bytes)
{
	struct cu_backend *cb = cu_of(be);
	(void)bytes;
	cb->drv.cuCtxSetCurrent(cb->ctx);
	cb->drv.cuStreamSynchronize(cb->stream);
	cb->drv.cuStreamSynchronize(cb->copy_stream);
	CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;
	size_t size = vmm_find(d, true);
	if (size) {
		cb->drv.cuMemUnmap(d, size);
		cb->drv.cuMemAddressFree(d, size);
	} else {
		cb->drv.cuMemFree(d);
	}
}

static td_err cuda_share_seal(struct gpu_backend *be, void *p, size_t bytes, struct td_errbuf *eb)
{
	struct cu_backend *cb = cu_of(be);
	(void)bytes;
	CUdeviceptr d = (CUdeviceptr)(uintptr_t)p;
	size_t size = vmm_find(d, false);
	if (!size)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "cuda: the shared base is not a VMM mapping (the driver lacks the VMM API "
			       "or refused it): it stays writable");
	cb->drv.cuCtxSetCurrent(cb->ctx);
	cb->drv.cuStreamSynchronize(cb->stream);
	cb->drv.cuStreamSynchronize(cb->copy_stream);
	CUmemAccessDesc acc = {.location = {.type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)cb->dev},
			       .flags = CU_MEM_ACCESS_FLAGS_PROT_READ};
	CUresult r = cb->drv.cuMemSetAccess(d, size, &acc, 1);
	if (r != CUDA_SUCCESS) {
		const char *name = "?";
		cb->drv.cuGetErrorName(r, &name);
		return td_fail(eb, TD_EUNSUPPORTED,
			       "cuda: cuMemSetAccess(PROT_READ) on the shared base: %s: it stays writable",
			       name);
	}
	return TD_OK;
}

/* Page-locked, so that the copy engines move it while the math runs (a
 * copy from pageable memory is staged by the driver and serialised). */
static td_err cuda_host_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	struct cu_backend *cb = cu_of(be);
	void *p = NULL;
	cb->drv.cuCtxSetCurrent(cb->ctx);
	CUresult r = cb->drv.cuMemHostAlloc(&p, bytes ? bytes : 256, 0);
	if (r != CUDA_SUCCESS)
		return r == CUDA_ERROR_OUT_OF_MEMORY ? TD_ENOMEM
		       : cu_sticky(r)		     ? TD_EDEVICE_LOST
						     : TD_EDEVICE;
	/* zeroed, as alloc's: nothing reads it before a copy writes it */
	memset(p, 0, bytes);
	be->host_bytes_in_use += bytes;
	if (be->host_bytes_in_use > be->host_bytes_peak)
		be->host_bytes_peak = be->host_bytes_in_use;
	*out = p;
	return TD_OK;
}

static void cuda_host_free(struct gpu_backend *be, void *p, size_t bytes)
{
	struct cu_backend *cb = cu_of(be);
	cb->drv.cuStreamSynchronize(cb->stream);
	cb->drv.cuStreamSynchronize(cb->copy_stream);
	cb->drv.cuMemFreeHost(p);
	be->host_bytes_in_use -= bytes;
}

/* copy_stream waits for what stream has so far (mark), copies, and marks
 * the copy done[k]. Nothing here waits on the host. */
static void cuda_copy_async(struct gpu_backend *be, void *dst, const void *src, size_t bytes,
			    bool to_host, int k)
{
	struct cu_backend *cb = cu_of(be);
	cu_check(cb, cb->drv.cuEventRecord(cb->copy_mark, cb->stream), "cuEventRecord (copy)");
	cu_check(cb, cb->drv.cuStreamWaitEvent(cb->copy_stream, cb->copy_mark, 0),
		 "cuStreamWaitEvent (copy after the ops before it)");
	if (bytes && to_host)
		cu_check(cb, cb->drv.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes,
						       cb->copy_stream),
			 "cuMemcpyDtoHAsync (copy stream)");
	else if (bytes)
		cu_check(cb, cb->drv.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes,
						       cb->copy_stream),
			 "cuMemcpyHtoDAsync (copy stream)");
	cu_check(cb, cb->drv.cuEventRecord(cb->copy_done[k], cb->copy_stream),
		 "cuEventRecord (copy done)");
}

/* An event never recorded is complete: a wait on it passes at once. */
static void cuda_copy_wait(struct gpu_backend *be, int k)
{
	struct cu_backend *cb = cu_of(be);
	cu_check(cb, cb->drv.cuStreamWaitEvent(cb->stream, cb->copy_done[k], 0),
		 "cuStreamWaitEvent (ops after a copy)");
}

static void cuda_upload(struct gpu_backend *be, void *dst, const void *src, size_t bytes)
{
	struct cu_backend *cb = cu_of(be);
	if (!bytes)
		return;
	/* From pageable memory the call returns once src has been staged, so the
	 * caller may reuse src at once. */
	cu_check(cb, cb->drv.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, cb->stream),
		 "cuMemcpyHtoDAsync");
}

static void cuda_download(struct gpu_backend *be, void *dst, const void *src, size_t bytes)
{
	struct cu_backend *cb = cu_of(be);
	if (!bytes)
		return;
	cu_check(cb, cb->drv.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, cb->stream),
		 "cuMemcpyDtoHAsync");
	cu_check(cb, cb->drv.cuStreamSynchronize(cb->stream), "cuStreamSynchronize");
}

static void cuda_zero(struct gpu_backend *be, void *dst, size_t bytes)
{
	struct cu_backend *cb = cu_of(be);
	if (bytes)
		cu_check(cb, cb->drv.cuMemsetD8Async((CUdeviceptr)(uintptr_t)dst, 0, bytes, cb->stream),
			 "cuMemsetD8Async");
}

static td_err cuda_sync(struct gpu_backend *be, struct td_errbuf *eb)
{
	struct cu_backend *cb = cu_of(be);
	CUresult r = cb->drv.cuStreamSynchronize(cb->stream);
	/* the copy stream's copies: enqueued after ops of stream, so waited for second */
	CUresult rc = cb->drv.cuStreamSynchronize(cb->copy_stream);
	if (r == CUDA_SUCCESS || (cu_sticky(rc) && !cu_sticky(r)))
		r = rc;
	/* A lost context outranks an earlier error it may have caused (a cuBLAS
	 * status): it is what the daemon must act on. */
	if (cu_sticky(r) && !cu_sticky(cb->first_error))
		cb->first_error = CUDA_SUCCESS;
	cu_check(cb, r, "cuStreamSynchronize");
	if (cb->first_error == CUDA_SUCCESS)
		return TD_OK;
	fault_wait(cb);
	return cu_err(cb, cb->first_error, cb->first_error_where, eb);
}

static td_err cuda_mem_info(struct gpu_backend *be, size_t *free_bytes, size_t *total_bytes)
{
	struct cu_backend *cb = cu_of(be);
	cb->drv.cuCtxSetCurrent(cb->ctx);
	return cb->drv.cuMemGetInfo(free_bytes, total_bytes) == CUDA_SUCCESS ? TD_OK : TD_EDEVICE;
}

static td_err cuda_set_bf16(struct gpu_backend *be, bool bf16, struct td_errbuf *eb)
{
	struct cu_backend *cb = cu_of(be);
	/* Pedantic math in fp32 mode keeps TF32 and every other shortcut out. */
	cublasStatus_t s = cublasSetMathMode(cb->blas, bf16 ? CUBLAS_DEFAULT_MATH : CUBLAS_PEDANTIC_MATH);
	if (s != CUBLAS_STATUS_SUCCESS)
		return td_fail(eb, TD_EDEVICE, "cublasSetMathMode: %s", cublasGetStatusName(s));
	cb->fp32_strict = !bf16;
	/* bf16 mode: the products through cuBLASLt, their algorithms timed
	 * (cuda_ops.c: lt_tune); TD_CUDA_NO_GEMM_TUNE=1 keeps cublasGemmEx's
	 * default (an A/B in one process, and a way back). */
	const char *no_tune = getenv("TD_CUDA_NO_GEMM_TUNE");
	cb->gemm_tune = bf16 && cb->lt && !(no_tune && *no_tune && strcmp(no_tune, "0"));
	return TD_OK;
}

static void cuda_destroy(struct gpu_backend *be)
{
	struct cu_backend *cb = cu_of(be);
	if (cb->ctx) {
		cb->drv.cuCtxSetCurrent(cb->ctx);
		if (cb->stream)
			cb->drv.cuStreamSynchronize(cb->stream);
		cu_prof_close(cb);
		for (int i = 0; i < cb->lt_nplans; i++) {
			struct cu_lt_plan *lp = &cb->lt_plans[i];
			cublasLtMatrixLayoutDestroy(lp->ld);
			cublasLtMatrixLayoutDestroy(lp->lc);
			cublasLtMatrixLayoutDestroy(lp->lb);
			cublasLtMatrixLayoutDestroy(lp->la);
			cublasLtMatmulDescDestroy(lp->desc);
		}
		if (cb->lt)
			cublasLtDestroy(cb->lt);
		if (cb->blas)
			cublasDestroy(cb->blas);
		if (cb->reduce_buf)
			cb->drv.cuMemFree((CUdeviceptr)(uintptr_t)cb->reduce_buf);
		if (cb->blas_ws)
			cb->drv.cuMemFree((CUdeviceptr)(uintptr_t)cb->blas_ws);
		if (cb->module)
			cb->drv.cuModuleUnload(cb->module);
		if (cb->copy_stream) {
			cb->drv.cuStreamSynchronize(cb->copy_stream);
			cb->drv.cuStreamDestroy(cb->copy_stream);
		}
		if (cb->copy_mark)
			cb->drv.cuEventDestroy(cb->copy_mark);
		for (int k = 0; k < CU_LT_EVENTS; k++)
			if (cb->tune_ev[k])
				cb->drv.cuEventDestroy(cb->tune_ev[k]);
		for (int k = 0; k < GPU_COPY_SLOTS; k++)
			if (cb->copy_done[k])
				cb->drv.cuEventDestroy(cb->copy_done[k]);
		if (cb->stream)
			cb->drv.cuStreamDestroy(cb->stream);
		cb->drv.cuDevicePrimaryCtxRelease(cb->dev);
	}
	if (cb->drv.lib)
		dlclose(cb->drv.lib);
	if (cb->fault_culprit)
		atomic_store(&fault_state, FAULT_DONE);
	free(cb);
}

/* --- kernels --- */

/* The JIT's options for the PTX path, and the same as text for the cache key
 * (cu_cache_key): one table, so the key cannot miss an option. Level 4 is the
 * driver's default, stated so that the key says it. */
#define CU_JIT_OPTION_LIST(X) X(CU_JIT_OPTIMIZATION_LEVEL, 4)

/* What the daemon indexes (gpu_backend.cache_entry) for the entry of key. */
static void note_entry(struct cu_backend *cb, const unsigned char *key, const void *cubin,
		       size_t size, const struct cu_image *ptx, bool hit)
{
	struct gpu_cache_entry *c = &cb->base.cache_entry;
	unsigned char d[CU_SHA256_BYTES];
	if (cu_cache_path(c->path, sizeof(c->path), cb->cache_dir, key, NULL) != TD_OK ||
	    cu_sha256(d, cubin, size, NULL) != TD_OK) {
		memset(c, 0, sizeof(*c));
		return;
	}
	cu_hex(c->key, key);
	cu_hex(c->sha256, d);
	snprintf(c->arch, sizeof(c->arch), "sm_%d%d", cb->cc_major, cb->cc_minor);
	c->size_bytes = size;
	c->src_bytes = ptx->size;
	c->hit = hit;
}

/* Compiles the PTX with the driver's JIT linker into cb->module (counted in
 * compiles); with a cache directory, also writes the cubin there under key. A
 * failed write costs the next process a compile, not this job: warned only. */
static td_err compile_ptx(struct cu_backend *cb, const struct cu_image *ptx,
			  const unsigned char *key, struct td_errbuf *eb)
{
	CUjit_option opt[] = {
#define CU_JIT_OPT_KEY_(k, v) k,
		CU_JIT_OPTION_LIST(CU_JIT_OPT_KEY_)
#undef CU_JIT_OPT_KEY_
	};
	void *val[] = {
#define CU_JIT_OPT_VAL_(k, v) (void *)(uintptr_t)(v),
		CU_JIT_OPTION_LIST(CU_JIT_OPT_VAL_)
#undef CU_JIT_OPT_VAL_
	};
	CUlinkState link;
	void *cubin = NULL;
	size_t size = 0;
	CUresult r = cb->drv.cuLinkCreate(sizeof(opt) / sizeof(opt[0]), opt, val, &link);
	if (r != CUDA_SUCCESS)
		return cu_err(cb, r, "compiling the kernels' PTX (cuLinkCreate)", eb);
	r = cb->drv.cuLinkAddData(link, CU_JIT_INPUT_PTX, (void *)ptx->data, ptx->size, "kernels.ptx",
				  0, NULL, NULL);
	if (r == CUDA_SUCCESS)
		r = cb->drv.cuLinkComplete(link, &cubin, &size);
	if (r == CUDA_SUCCESS)
		r = cb->drv.cuModuleLoadData(&cb->module, cubin);
	cb->base.compiles++;
	if (r == CUDA_SUCCESS && key) {
		struct td_errbuf why = {{0}};
		if (cu_cache_write(cb->cache_dir, key, cubin, size, &why) != TD_OK)
			td_warn("TD-CACHE-WRITE", "%s; the next process compiles again", why.msg);
		else
			note_entry(cb, key, cubin, size, ptx, false);
	}
	cb->drv.cuLinkDestroy(link); /* owns cubin */
	if (r != CUDA_SUCCESS)
		return cu_err(cb, r, "compiling the kernels' PTX", eb);
	return TD_OK;
}

/* The PTX path: with a cache directory, the cubin compiled for this device
 * and driver by an earlier process, verified (gpu/cuda/modcache.h); else, or
 * when the entry is missing or untrusted, a compile that writes it. */
static td_err load_ptx(struct cu_backend *cb, const struct cu_image *ptx, struct td_errbuf *eb)
{
	if (!cb->cache_dir[0])
		return compile_ptx(cb, ptx, NULL, eb);
	char opts[256];
	int n = 0;
#define CU_JIT_OPT_TEXT_(k, v) \
	n += snprintf(opts + n, sizeof(opts) - (size_t)n, "%s=%ld;", #k, (long)(v));
	CU_JIT_OPTION_LIST(CU_JIT_OPT_TEXT_)
#undef CU_JIT_OPT_TEXT_
	int driver = 0;
	CUresult r = cb->drv.cuDriverGetVersion(&driver);
	if (r != CUDA_SUCCESS)
		return cu_err(cb, r, "cuDriverGetVersion", eb);
	struct cu_cache_key_in in = {
		.ptx = ptx->data,
		.ptx_size = ptx->size,
		.options = opts,
		.cc_major = cb->cc_major,
		.cc_minor = cb->cc_minor,
		.driver_version = driver,
	};
	unsigned char key[CU_SHA256_BYTES];
	td_err e = cu_cache_key(key, &in, eb);
	if (e != TD_OK)
		return e;
	struct td_errbuf why = {{0}};
	void *cubin = NULL;
	size_t size = 0;
	e = cu_cache_read(cb->cache_dir, key, &cubin, &size, &why);
	if (e == TD_OK) {
		r = cb->drv.cuModuleLoadData(&cb->module, cubin);
		if (r == CUDA_SUCCESS)
			note_entry(cb, key, cubin, size, ptx, true);
		free(cubin);
		if (r == CUDA_SUCCESS) {
			cb->cache_hits++;
			return TD_OK;
		}
		cb->module = NULL;
		const char *name = "?";
		cb->drv.cuGetErrorName(r, &name);
		char path[4200];
		cu_cache_path(path, sizeof(path), cb->cache_dir, key, NULL);
		td_fail(&why, TD_EMISMATCH, "module cache: %s: the driver refuses the cubin (%s)",
			path, name);
		e = TD_EMISMATCH;
	}
	if (e == TD_ENOENT)
		td_debug("TD-CACHE-MISS", "%s", why.msg);
	else {
		/* Never trusted: compiled again, and the entry replaced. */
		cb->cache_rebuilds++;
		td_warn("TD-CACHE-REBUILD", "%s; compiling it again", why.msg);
	}
	return compile_ptx(cb, ptx, key, eb);
}

/* The image for this device (cu_image_cubin: its major, the highest minor
 * not above its own; an sm_90a cubin on compute capability 9.0 alone, where
 * image_specific lets its wgmma kernels be launched), else the PTX, which
 * the driver's JIT linker compiles (counted) or tier 2 of the module cache
 * has from an earlier process. TD_CUDA_FORCE_PTX=1 takes the PTX path
 * whatever the device: a test hook (tests/gpu/modcache.sh). */
static td_err load_kernels(struct cu_backend *cb, struct td_errbuf *eb)
{
	const char *force = getenv("TD_CUDA_FORCE_PTX");
	bool force_ptx = force && strcmp(force, "1") == 0;
	const struct cu_image *best =
		force_ptx ? NULL : cu_image_cubin(cu_images, cu_images_count, cb->cc_major, cb->cc_minor);
	const struct cu_image *ptx = cu_image_ptx(cu_images, cu_images_count, cb->cc_major, cb->cc_minor);
	CUresult r;
	td_err e;
	cb->image_specific = best && best->specific;
	if (best) {
		r = cb->drv.cuModuleLoadData(&cb->module, best->data);
		if (r != CUDA_SUCCESS)
			return cu_err(cb, r, "loading the kernels' cubin", eb);
	} else if (ptx) {
		if ((e = load_ptx(cb, ptx, eb)) != TD_OK)
			return e;
	} else {
		return td_fail(eb, TD_EUNSUPPORTED,
			       "no kernel image for compute capability %d.%d in this build",
			       cb->cc_major, cb->cc_minor);
	}
	static const char *const names[] = {
#define CU_KERNEL_NAME_(name) #name,
		CU_KERNEL_LIST(CU_KERNEL_NAME_)
#undef CU_KERNEL_NAME_
	};
	for (int k = 0; k < CU_K_COUNT_; k++) {
		r = cb->drv.cuModuleGetFunction(&cb->fn[k], cb->module, names[k]);
		if (r != CUDA_SUCCESS) {
			char what[160];
			snprintf(what, sizeof(what), "kernel %s is missing from the module", names[k]);
			return cu_err(cb, r, what, eb);
		}
	}
	cb->sealed = true;
	cu_flash_prepare(cb);
	return TD_OK;
}

/* --- graphs --- */

static bool cuda_graph_begin(struct gpu_backend *be)
{
	struct cu_backend *cb = cu_of(be);
	/* not under a profile, a trace or the fault hook, which count and time
	 * each op as it is enqueued */
	if (!cb->graphs || cb->capturing || be->trace || cb->prof || cb->fault_after ||
	    cb->first_error != CUDA_SUCCESS)
		return false;
	/* THREAD_LOCAL: the other jobs' threads on this context go on as they
	 * were; only this thread may not block while it records */
	if (cb->drv.cuStreamBeginCapture(cb->stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL) !=
	    CUDA_SUCCESS)
		return false;
	cb->capturing = true;
	cb->capture_error = CUDA_SUCCESS;
	cb->capture_error_where[0] = '\0';
	return true;
}

static bool cuda_graph_end(struct gpu_backend *be, void **exec)
{
	struct cu_backend *cb = cu_of(be);
	CUgraph g = NULL;
	CUresult r = cb->drv.cuStreamEndCapture(cb->stream, &g);
	cb->capturing = false;
	if (r != CUDA_SUCCESS && cb->capture_error == CUDA_SUCCESS) {
		cb->capture_error = r;
		snprintf(cb->capture_error_where, sizeof(cb->capture_error_where),
			 "cuStreamEndCapture");
	}
	CUgraphExec x = *exec;
	if (cb->capture_error == CUDA_SUCCESS && g) {
		/* the exec takes this recording's nodes and arguments where the
		 * two have the same shape; else it is made anew */
		CUgraphExecUpdateResultInfo info;
		if (x && cb->drv.cuGraphExecUpdate(x, g, &info) != CUDA_SUCCESS) {
			cb->drv.cuGraphExecDestroy(x);
			x = NULL;
		}
		if (!x && (r = cb->drv.cuGraphInstantiateWithFlags(&x, g, 0)) != CUDA_SUCCESS) {
			x = NULL;
			cb->capture_error = r;
			snprintf(cb->capture_error_where, sizeof(cb->capture_error_where),
				 "cuGraphInstantiate");
		}
	}
	if (g)
		cb->drv.cuGraphDestroy(g);
	*exec = x;
	if (cb->capture_error != CUDA_SUCCESS || !x) {
		/* once a backend: the caller runs those ops without a graph from
		 * now on, which is slower, not wrong */
		if (!cb->capture_told) {
			const char *name = "?";
			if (cb->drv.cuGetErrorName)
				cb->drv.cuGetErrorName(cb->capture_error, &name);
			fprintf(stderr, "traind: CUDA graphs: recording ops failed at %s (%s); they "
					"run without a graph\n",
				cb->capture_error_where, name);
			cb->capture_told = true;
		}
		return false;
	}
	cu_check(cb, cb->drv.cuGraphLaunch(x, cb->stream), "cuGraphLaunch");
	be->graph_launches++;
	return true;
}

static void cuda_graph_free(struct gpu_backend *be, void *exec)
{
	cu_of(be)->drv.cuGraphExecDestroy((CUgraphExec)exec);
}

/* --- creation --- */

static struct gpu_backend_ops cuda_ops = {
	.name = "cuda",
	.alloc = cuda_alloc,
	.free = cuda_free,
	.upload = cuda_upload,
	.download = cuda_download,
	.zero = cuda_zero,
	.sync = cuda_sync,
	.destroy = cuda_destroy,
	.mem_info = cuda_mem_info,
	.set_bf16 = cuda_set_bf16,
	.share_alloc = cuda_share_alloc,
	.share_free = cuda_share_free,
	.share_seal = cuda_share_seal,
	.host_alloc = cuda_host_alloc,
	.host_free = cuda_host_free,
	.copy_async = cuda_copy_async,
	.copy_wait = cuda_copy_wait,
	.graph_begin = cuda_graph_begin,
	.graph_end = cuda_graph_end,
	.graph_free = cuda_graph_free,
};

td_err cu_open_driver(struct cu_driver *d, struct td_errbuf *eb)
{
	/* $TD_CUDA_DRIVER: another driver library (tests use a missing one to
	 * exercise the no-driver path on any host). */
	const char *lib = getenv("TD_CUDA_DRIVER");
	d->lib = dlopen(lib && *lib ? lib : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!d->lib)
		return td_fail(eb, TD_EUNSUPPORTED, "no NVIDIA driver: %s", dlerror());
#define CU_DRIVER_SYM_(name)                                                                 \
	d->name = (__typeof__(&name))dlsym(d->lib, CU_STR_(name));                           \
	if (!d->name)                                                                        \
		return td_fail(eb, TD_EUNSUPPORTED, "libcuda.so.1 lacks %s (driver too old?)", \
			       CU_STR_(name));
	CU_DRIVER_LIST(CU_DRIVER_SYM_)
#undef CU_DRIVER_SYM_
#define CU_DRIVER_OPT_SYM_(name) d->name = (__typeof__(&name))dlsym(d->lib, CU_STR_(name));
	CU_DRIVER_OPT_LIST(CU_DRIVER_OPT_SYM_)
#undef CU_DRIVER_OPT_SYM_
	return TD_OK;
}

__attribute__((visibility("default"))) td_err gpu_cuda_backend_new(struct gpu_backend **out,
								   struct td_errbuf *eb);
__attribute__((visibility("default"))) td_err gpu_cuda_backend_new_on(struct gpu_backend **out,
								      int ordinal,
								      struct td_errbuf *eb);
__attribute__((visibility("default"))) td_err gpu_cuda_backend_new_opts(struct gpu_backend **out,
									int ordinal,
									const char *cache_dir,
									struct td_errbuf *eb);

/* ordinal < 0: $TD_CUDA_DEVICE, else 0. cache_dir: tier 2 of the module
 * cache, NULL or "" for none. */
static td_err backend_new(struct gpu_backend **out, int ordinal, const char *cache_dir,
			  struct td_errbuf *eb)
{
	static int ops_ready;
	if (!ops_ready) {
		cu_ops_fill(&cuda_ops);
		gpu_backend_check_ops(&cuda_ops);
		ops_ready = 1;
	}
	struct cu_backend *cb = calloc(1, sizeof(*cb));
	if (!cb)
		return td_fail(eb, TD_ENOMEM, "cuda backend: out of memory");
	cb->base.ops = &cuda_ops;
	cb->fp32_strict = true;
	td_err e = TD_OK;
	const char *fault = getenv("TD_CUDA_FAULT_AFTER_OPS");
	if (fault && *fault) {
		char *end;
		long long v = strtoll(fault, &end, 10);
		if (*end || v < 1)
			e = td_fail(eb, TD_EINVAL, "TD_CUDA_FAULT_AFTER_OPS: '%s' is not a count >= 1",
				    fault);
		cb->fault_after = v;
	}
	if (cache_dir && snprintf(cb->cache_dir, sizeof(cb->cache_dir), "%s", cache_dir) >=
				 (int)sizeof(cb->cache_dir))
		e = td_fail(eb, TD_EINVAL, "module cache directory: path too long: %.64s...", cache_dir);
	if (e == TD_OK)
		e = cu_open_driver(&cb->drv, eb);
	/* graphs where the driver records streams; TD_CUDA_NO_GRAPHS=1: every
	 * op launched as it comes (an A/B in one process, and a way back) */
	const char *no_graphs = getenv("TD_CUDA_NO_GRAPHS");
	cb->graphs = e == TD_OK && cb->drv.cuStreamBeginCapture && cb->drv.cuStreamEndCapture &&
		     cb->drv.cuGraphInstantiateWithFlags && cb->drv.cuGraphExecUpdate &&
		     cb->drv.cuGraphLaunch && cb->drv.cuGraphDestroy && cb->drv.cuGraphExecDestroy &&
		     !(no_graphs && *no_graphs && strcmp(no_graphs, "0"));
	CUresult r = CUDA_SUCCESS;
	int count = 0;
	const char *env = getenv("TD_CUDA_DEVICE");
	const char *which = "device ordinal";
	if (ordinal < 0) {
		ordinal = 0;
		if (e == TD_OK && env && *env) {
			char *end;
			long v = strtol(env, &end, 10);
			if (*end || v < 0 || v > 1024)
				e = td_fail(eb, TD_EINVAL, "TD_CUDA_DEVICE: '%s' is not a device ordinal", env);
			ordinal = (int)v;
			which = "TD_CUDA_DEVICE";
		}
	}
	if (e == TD_OK && (r = cb->drv.cuInit(0)) != CUDA_SUCCESS)
		e = cu_err(cb, r, "cuInit", eb);
	if (e == TD_OK && ((r = cb->drv.cuDeviceGetCount(&count)) != CUDA_SUCCESS || count == 0))
		e = r ? cu_err(cb, r, "cuDeviceGetCount", eb) : td_fail(eb, TD_EUNSUPPORTED, "no CUDA device");
	if (e == TD_OK && ordinal >= count)
		e = td_fail(eb, TD_EINVAL, "%s %d but there are %d devices", which, ordinal, count);
	if (e == TD_OK && (r = cb->drv.cuDeviceGet(&cb->dev, ordinal)) != CUDA_SUCCESS)
		e = cu_err(cb, r, "cuDeviceGet", eb);
	if (e == TD_OK) {
		cb->drv.cuDeviceGetName(cb->name, sizeof(cb->name), cb->dev);
		cb->drv.cuDeviceGetAttribute(&cb->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, cb->dev);
		cb->drv.cuDeviceGetAttribute(&cb->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, cb->dev);
		CUuuid u;
		if (cb->drv.cuDeviceGetUuid(&u, cb->dev) == CUDA_SUCCESS) {
			const unsigned char *b = (const unsigned char *)u.bytes;
			snprintf(cb->uuid, sizeof(cb->uuid),
				 "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
				 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
				 b[13], b[14], b[15]);
		}
		snprintf(cb->base.device, sizeof(cb->base.device), "%s", cb->name);
	}
	if (e == TD_OK && (r = cb->drv.cuDevicePrimaryCtxRetain(&cb->ctx, cb->dev)) != CUDA_SUCCESS) {
		cb->ctx = NULL;
		e = cu_err(cb, r, "cuDevicePrimaryCtxRetain", eb);
	}
	if (e == TD_OK && (r = cb->drv.cuCtxSetCurrent(cb->ctx)) != CUDA_SUCCESS)
		e = cu_err(cb, r, "cuCtxSetCurrent", eb);
	if (e == TD_OK && (r = cb->drv.cuStreamCreate(&cb->stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
		e = cu_err(cb, r, "cuStreamCreate", eb);
	if (e == TD_OK &&
	    (r = cb->drv.cuStreamCreate(&cb->copy_stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
		cb->copy_stream = NULL;
		e = cu_err(cb, r, "cuStreamCreate (copy stream)", eb);
	}
	if (e == TD_OK &&
	    (r = cb->drv.cuEventCreate(&cb->copy_mark, CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS) {
		cb->copy_mark = NULL;
		e = cu_err(cb, r, "cuEventCreate (copy stream)", eb);
	}
	for (int k = 0; e == TD_OK && k < GPU_COPY_SLOTS; k++)
		if ((r = cb->drv.cuEventCreate(&cb->copy_done[k], CU_EVENT_DISABLE_TIMING)) != CUDA_SUCCESS) {
			cb->copy_done[k] = NULL;
			e = cu_err(cb, r, "cuEventCreate (copy stream)", eb);
		}
	if (e == TD_OK)
		e = load_kernels(cb, eb);
	if (e == TD_OK)
		cu_prof_open(cb);

	if (e == TD_OK) {
		cublasStatus_t s = cublasCreate(&cb->blas);
		if (s == CUBLAS_STATUS_SUCCESS)
			s = cublasSetStream(cb->blas, (cudaStream_t)cb->stream);
		/* fp32 mode: no TF32 anywhere (parity with the CPU reference). */
		if (s == CUBLAS_STATUS_SUCCESS)
			s = cublasSetMathMode(cb->blas, CUBLAS_PEDANTIC_MATH);
		if (s != CUBLAS_STATUS_SUCCESS)
			e = td_fail(eb, TD_EDEVICE, "cuBLAS: %s", cublasGetStatusName(s));
		/* optional: without it a product with a residual addend takes a
		 * copy and cuBLAS (cuda_ops.c: cu_matmul_forward_residual) */
		if (e == TD_OK && cublasLtCreate(&cb->lt) != CUBLAS_STATUS_SUCCESS)
			cb->lt = NULL;
	}
	if (e == TD_OK) {
		/* 512K doubles: enough partials for the column sums of any width. */
		cb->reduce_cap = GPU_CUDA_REDUCE_DOUBLES;
		CUdeviceptr p;
		if ((r = cb->drv.cuMemAlloc(&p, cb->reduce_cap * sizeof(double))) != CUDA_SUCCESS)
			e = cu_err(cb, r, "cuMemAlloc (reduction scratch)", eb);
		else
			cb->reduce_buf = (double *)(uintptr_t)p;
	}
	if (e == TD_OK) {
		/* cuBLAS's workspace is ours, allocated now, so that nothing on the
		 * device grows after creation: a job's footprint is its plan plus
		 * these fixed bytes, which is what the ledger reserves (contract 1). */
		cb->blas_ws_bytes = GPU_CUDA_BLAS_WORKSPACE_BYTES;
		CUdeviceptr p;
		if ((r = cb->drv.cuMemAlloc(&p, cb->blas_ws_bytes)) != CUDA_SUCCESS)
			e = cu_err(cb, r, "cuMemAlloc (cuBLAS workspace)", eb);
		else {
			cb->blas_ws = (void *)(uintptr_t)p;
			cublasStatus_t s = cublasSetWorkspace(cb->blas, cb->blas_ws, cb->blas_ws_bytes);
			if (s != CUBLAS_STATUS_SUCCESS)
				e = td_fail(eb, TD_EDEVICE, "cublasSetWorkspace: %s", cublasGetStatusName(s));
		}
		cb->base.fixed_bytes = cb->reduce_cap * sizeof(double) + cb->blas_ws_bytes;
		_Static_assert(GPU_CUDA_FIXED_BYTES == GPU_CUDA_REDUCE_DOUBLES * sizeof(double) +
							       GPU_CUDA_BLAS_WORKSPACE_BYTES,
			       "gpu/select.h's GPU_CUDA_FIXED_BYTES is what is allocated here");
	}
	if (e != TD_OK) {
		cuda_destroy(&cb->base);
		return e;
	}
	*out = &cb->base;
	return TD_OK;
}

td_err gpu_cuda_backend_new(struct gpu_backend **out, struct td_errbuf *eb)
{
	return backend_new(out, -1, NULL, eb);
}

td_err gpu_cuda_backend_new_on(struct gpu_backend **out, int ordinal, struct td_errbuf *eb)
{
	return backend_new(out, ordinal < 0 ? -1 : ordinal, NULL, eb);
}

td_err gpu_cuda_backend_new_opts(struct gpu_backend **out, int ordinal, const char *cache_dir,
				 struct td_errbuf *eb)
{
	return backend_new(out, ordinal < 0 ? -1 : ordinal, cache_dir, eb);
}
