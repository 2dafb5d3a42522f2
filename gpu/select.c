/* Backend selection by name. */
#include "gpu/select.h"

#include <dlfcn.h>
#include <string.h>

#include "proto/log.h"

/* The CUDA module exports one constructor with this name and signature. */
typedef td_err (*gpu_cuda_new_fn)(struct gpu_backend **out, struct td_errbuf *eb);

static td_err open_cuda(struct gpu_backend **out, struct td_errbuf *eb)
{
	void *h = dlopen("libtraind-cuda.so", RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "the CUDA backend module (libtraind-cuda.so) is not installed in this build: %s",
			       dlerror());
	gpu_cuda_new_fn fn = (gpu_cuda_new_fn)dlsym(h, "gpu_cuda_backend_new");
	if (!fn) {
		dlclose(h);
		return td_fail(eb, TD_EUNSUPPORTED, "libtraind-cuda.so has no gpu_cuda_backend_new");
	}
	return fn(out, eb);
}

td_err gpu_backend_open(struct gpu_backend **out, const char *name, struct td_errbuf *eb)
{
	if (!name || strcmp(name, "cpu") == 0)
		return gpu_cpu_backend_new(out, eb);
	if (strcmp(name, "cuda") == 0)
		return open_cuda(out, eb);
	if (strcmp(name, "auto") == 0) {
		struct td_errbuf why = {{0}};
		if (open_cuda(out, &why) == TD_OK)
			return TD_OK;
		td_debug("TD-GPU-FALLBACK", "using the CPU backend: %s", why.msg);
		return gpu_cpu_backend_new(out, eb);
	}
	return td_fail(eb, TD_EINVAL, "unknown backend '%s' (expected cpu, cuda or auto)", name);
}
