/* Choosing a backend by name: "cpu", "cuda", or "auto" (CUDA when its module
 * and a device are there, else the CPU), and the host's CUDA devices.
 *
 * The CUDA backend is a shared module loaded with dlopen (contract 5), so that
 * the same binaries start on hosts without a GPU driver. The device query goes
 * through the same module: on a host without the module, the driver or a GPU
 * it reports no device, which is normal, not an error. */
#ifndef GPU_SELECT_H
#define GPU_SELECT_H

#include <stdint.h>

#include "gpu/backend.h"

td_err gpu_backend_open(struct gpu_backend **out, const char *name, struct td_errbuf *eb);

/* As gpu_backend_open, on CUDA device ordinal `device` when the backend is
 * CUDA ("cuda", or "auto" that finds it). device < 0: the default, which is
 * $TD_CUDA_DEVICE, else 0. The CPU backend ignores device. */
td_err gpu_backend_open_on(struct gpu_backend **out, const char *name, int device,
			   struct td_errbuf *eb);

/* How to open a backend: gpu_backend_open_opts. Zeroed but for name means
 * device 0 (set device = -1 for the default) and no module cache. */
struct gpu_open_opts {
	const char *name;      /* "cpu", "cuda" or "auto", as for gpu_backend_open; NULL: "cpu" */
	int device;            /* as for gpu_backend_open_on; < 0: the default */
	/* The module cache's directory (contract 3): cubins the CUDA backend
	 * compiles from PTX on this host are kept in <cache_dir>/modules and
	 * loaded from there by later backends and processes. NULL or "": none,
	 * every PTX load compiles. The CPU backend ignores it. */
	const char *cache_dir;
};

/* gpu_backend_open_on with the options of o (which the call does not keep). */
td_err gpu_backend_open_opts(struct gpu_backend **out, const struct gpu_open_opts *o,
			     struct td_errbuf *eb);

/* A symbol the CUDA backend module exports beside its backends (the side
 * streams of gpu/comm.c: gpu/cuda/cuda_side.c), from the module
 * gpu_backend_open loads. NULL, with the reason in eb, when the module or
 * the symbol is missing. Any thread. */
void *gpu_cuda_module_sym(const char *name, struct td_errbuf *eb);

/* Device bytes the CUDA backend allocates at creation whatever the job, i.e.
 * its struct gpu_backend's fixed_bytes: the reduction scratch (512K doubles,
 * 4 MiB, see cu_backend.reduce_buf) and cuBLAS's workspace (32 MiB, handed to
 * cublasSetWorkspace so that cuBLAS allocates nothing later). gpu/cuda/
 * cuda_backend.c allocates exactly these; the daemon reserves them in the
 * ledger with each job's plan (contract 1). The CUDA context and the loaded
 * modules are not in here: the daemon's cuda_context_mib setting covers them. */
#define GPU_CUDA_REDUCE_DOUBLES ((size_t)512 * 1024)
#define GPU_CUDA_BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define GPU_CUDA_FIXED_BYTES \
	(GPU_CUDA_REDUCE_DOUBLES * sizeof(double) + GPU_CUDA_BLAS_WORKSPACE_BYTES)

struct gpu_device_info {
	int index;          /* the CUDA ordinal (cuDeviceGet) */
	char uuid[64];      /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", as nvidia-smi prints it */
	char name[128];
	int cc_major, cc_minor;
	uint64_t total_bytes, free_bytes; /* free: cuMemGetInfo at the query */
};

/* The host's CUDA devices, at most max of them, into out[0 .. *n). Loads the
 * CUDA module and the driver and retains each device's primary context (the
 * process's one context per device, which the backends then share). A host
 * without the module, the driver or a device gets *n = 0 and TD_OK; the reason
 * is then what gpu_devices_why() returns. TD_EINVAL for bad arguments only.
 * Not concurrent with itself. */
td_err gpu_devices_query(struct gpu_device_info *out, int max, int *n, struct td_errbuf *eb);

/* Why the last gpu_devices_query found no device ("the CUDA backend module
 * cannot be loaded: ...", "no NVIDIA driver: ..."), "" when it found some or
 * never ran. Copied into buf (cap bytes, NUL-terminated). */
void gpu_devices_why(char *buf, size_t cap);

/* Device ordinal index's free and total memory now (cuMemGetInfo in its
 * primary context). TD_EUNSUPPORTED unless gpu_devices_query found it; any
 * thread. */
td_err gpu_device_mem(int index, uint64_t *free_bytes, uint64_t *total_bytes,
		      struct td_errbuf *eb);

/* Resets device ordinal index's primary context (cuDevicePrimaryCtxReset):
 * after a sticky error (TD_EDEVICE_LOST: an illegal address, a launch
 * failure...) the context is unusable by every backend of the process until
 * then. Frees everything in it: call it only when no backend is alive on
 * that device. TD_EUNSUPPORTED unless gpu_devices_query found it, TD_EDEVICE
 * when the driver refuses (the device then stays unusable). Any thread. */
td_err gpu_device_reset(int index, struct td_errbuf *eb);

#endif
