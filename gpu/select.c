/* Backend selection by name. */
#include "gpu/select.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"

#include "proto/log.h"

/* The CUDA module exports one constructor with this name and signature. */
typedef td_err (*gpu_cuda_new_fn)(struct gpu_backend **out, struct td_errbuf *eb);

/* The module: $TD_CUDA_MODULE, else the build tree's (tests, a build used in
 * place), else the installed one. */
static void *open_module(struct td_errbuf *eb)
{
	const char *env = getenv("TD_CUDA_MODULE");
	const char *paths[] = {env, TD_CUDA_MODULE_BUILD_PATH, TD_CUDA_MODULE_INSTALL_PATH};
	const char *last = "not built (configure with nvcc for -Dcuda)";
	for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
		if (!paths[i] || access(paths[i], F_OK) != 0)
			continue;
		void *h = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
		if (h)
			return h;
		last = dlerror();
	}
	td_fail(eb, TD_EUNSUPPORTED, "the CUDA backend module cannot be loaded: %s", last);
	return NULL;
}

static td_err open_cuda(struct gpu_backend **out, struct td_errbuf *eb)
{
	void *h = open_module(eb);
	if (!h)
		return TD_EUNSUPPORTED;
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
