/* Backend selection by name. */
#include "gpu/select.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "gpu/gpu_abi.h"

#include "proto/log.h"

/* The CUDA module's exports (gpu/cuda/cuda_backend.c, cuda_devices.c). */
typedef td_err (*gpu_cuda_new_fn)(struct gpu_backend **out, struct td_errbuf *eb);
typedef td_err (*gpu_cuda_new_on_fn)(struct gpu_backend **out, int ordinal, struct td_errbuf *eb);
typedef td_err (*gpu_cuda_new_opts_fn)(struct gpu_backend **out, int ordinal, const char *cache_dir,
				       struct td_errbuf *eb);
typedef td_err (*gpu_cuda_devices_fn)(struct gpu_device_info *out, int max, int *n,
				      struct td_errbuf *eb);
typedef td_err (*gpu_cuda_device_reset_fn)(int ordinal, struct td_errbuf *eb);
typedef td_err (*gpu_cuda_device_mem_fn)(int ordinal, uint64_t *free_bytes, uint64_t *total_bytes,
					 struct td_errbuf *eb);

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
		if (!h) {
			last = dlerror();
			continue;
		}
		/* built from this traind's GPU interface (gpu/abi.py), or refused:
		 * an ops table of other sources would be called with the wrong
		 * arguments, silently */
		const char *abi = (const char *)dlsym(h, "gpu_cuda_abi");
		if (abi && strcmp(abi, TD_GPU_ABI) == 0)
			return h;
		td_fail(eb, TD_EUNSUPPORTED,
			"the CUDA backend module %s was built from other sources than this traind "
			"(GPU interface %.12s, this traind's %.12s): install the module of this build, "
			"or point TD_CUDA_MODULE at it",
			paths[i], abi ? abi : "unstamped", TD_GPU_ABI);
		dlclose(h); /* after the message: abi is the module's */
		return NULL;
	}
	td_fail(eb, TD_EUNSUPPORTED, "the CUDA backend module cannot be loaded: %s", last);
	return NULL;
}

/* device < 0: the module's default ($TD_CUDA_DEVICE, else 0). cache_dir:
 * the module cache's directory, NULL or "" for none. */
static td_err open_cuda(struct gpu_backend **out, int device, const char *cache_dir,
			struct td_errbuf *eb)
{
	void *h = open_module(eb);
	if (!h)
		return TD_EUNSUPPORTED;
	if (cache_dir && *cache_dir) {
		gpu_cuda_new_opts_fn fn = (gpu_cuda_new_opts_fn)dlsym(h, "gpu_cuda_backend_new_opts");
		if (!fn) {
			dlclose(h);
			return td_fail(eb, TD_EUNSUPPORTED, "libtraind-cuda.so has no gpu_cuda_backend_new_opts");
		}
		return fn(out, device, cache_dir, eb);
	}
	if (device < 0) {
		gpu_cuda_new_fn fn = (gpu_cuda_new_fn)dlsym(h, "gpu_cuda_backend_new");
		if (!fn) {
			dlclose(h);
			return td_fail(eb, TD_EUNSUPPORTED, "libtraind-cuda.so has no gpu_cuda_backend_new");
		}
		return fn(out, eb);
	}
	gpu_cuda_new_on_fn fn = (gpu_cuda_new_on_fn)dlsym(h, "gpu_cuda_backend_new_on");
	if (!fn) {
		dlclose(h);
		return td_fail(eb, TD_EUNSUPPORTED, "libtraind-cuda.so has no gpu_cuda_backend_new_on");
	}
	return fn(out, device, eb);
}

void *gpu_cuda_module_sym(const char *name, struct td_errbuf *eb)
{
	void *h = open_module(eb);
	if (!h)
		return NULL;
	/* The module stays loaded (dlopen counts: a backend holds it too). */
	void *f = dlsym(h, name);
	if (!f)
		td_fail(eb, TD_EUNSUPPORTED, "libtraind-cuda.so has no %s (an older module?)", name);
	return f;
}

td_err gpu_backend_open(struct gpu_backend **out, const char *name, struct td_errbuf *eb)
{
	return gpu_backend_open_on(out, name, -1, eb);
}

td_err gpu_backend_open_on(struct gpu_backend **out, const char *name, int device,
			   struct td_errbuf *eb)
{
	struct gpu_open_opts o = {.name = name, .device = device};
	return gpu_backend_open_opts(out, &o, eb);
}

td_err gpu_backend_open_opts(struct gpu_backend **out, const struct gpu_open_opts *o,
			     struct td_errbuf *eb)
{
	if (!o)
		return td_fail(eb, TD_EINVAL, "gpu_backend_open_opts: no options");
	const char *name = o->name;
	int device = o->device;
	if (!name || strcmp(name, "cpu") == 0)
		return gpu_cpu_backend_new(out, eb);
	if (strcmp(name, "cuda") == 0)
		return open_cuda(out, device, o->cache_dir, eb);
	if (strcmp(name, "auto") == 0) {
		struct td_errbuf why = {{0}};
		if (open_cuda(out, device, o->cache_dir, &why) == TD_OK)
			return TD_OK;
		td_debug("TD-GPU-FALLBACK", "using the CPU backend: %s", why.msg);
		return gpu_cpu_backend_new(out, eb);
	}
	return td_fail(eb, TD_EINVAL, "unknown backend '%s' (expected cpu, cuda or auto)", name);
}

/* --- devices --- */

/* The query's result, for gpu_devices_why and gpu_device_mem. */
static pthread_mutex_t dev_mu = PTHREAD_MUTEX_INITIALIZER;
static char dev_why[512];
static int dev_found;                     /* devices the last query found */
static gpu_cuda_device_mem_fn dev_mem_fn; /* from the module, once found */
static gpu_cuda_device_reset_fn dev_reset_fn;

td_err gpu_devices_query(struct gpu_device_info *out, int max, int *n, struct td_errbuf *eb)
{
	if (!n || max < 0 || (max > 0 && !out))
		return td_fail(eb, TD_EINVAL, "gpu_devices_query: bad arguments");
	*n = 0;
	if (max == 0)
		return TD_OK;
	struct td_errbuf why = {{0}};
	int found = 0;
	gpu_cuda_device_mem_fn mem = NULL;
	gpu_cuda_device_reset_fn reset = NULL;
	/* The module stays loaded: it holds the driver and the retained contexts. */
	void *h = open_module(&why);
	if (h) {
		gpu_cuda_devices_fn fn = (gpu_cuda_devices_fn)dlsym(h, "gpu_cuda_devices");
		mem = (gpu_cuda_device_mem_fn)dlsym(h, "gpu_cuda_device_mem");
		reset = (gpu_cuda_device_reset_fn)dlsym(h, "gpu_cuda_device_reset");
		if (!fn || !mem)
			td_fail(&why, TD_EUNSUPPORTED,
				"libtraind-cuda.so has no gpu_cuda_devices (an older module?)");
		else if (fn(out, max, &found, &why) != TD_OK)
			found = 0;
		else if (found == 0)
			td_fail(&why, TD_EUNSUPPORTED, "the NVIDIA driver reports no CUDA device");
	}
	pthread_mutex_lock(&dev_mu);
	dev_found = found;
	dev_mem_fn = found ? mem : NULL;
	dev_reset_fn = found ? reset : NULL;
	snprintf(dev_why, sizeof(dev_why), "%s", found ? "" : why.msg);
	pthread_mutex_unlock(&dev_mu);
	if (!found)
		td_debug("TD-GPU-NONE", "no CUDA device: %s", why.msg);
	*n = found;
	return TD_OK;
}

void gpu_devices_why(char *buf, size_t cap)
{
	if (!buf || !cap)
		return;
	pthread_mutex_lock(&dev_mu);
	snprintf(buf, cap, "%s", dev_why);
	pthread_mutex_unlock(&dev_mu);
}

td_err gpu_device_mem(int index, uint64_t *free_bytes, uint64_t *total_bytes,
		      struct td_errbuf *eb)
{
	pthread_mutex_lock(&dev_mu);
	gpu_cuda_device_mem_fn fn = index >= 0 && index < dev_found ? dev_mem_fn : NULL;
	pthread_mutex_unlock(&dev_mu);
	if (!fn)
		return td_fail(eb, TD_EUNSUPPORTED, "no CUDA device %d (the device query did not find it)",
			       index);
	return fn(index, free_bytes, total_bytes, eb);
}

td_err gpu_device_reset(int index, struct td_errbuf *eb)
{
	pthread_mutex_lock(&dev_mu);
	gpu_cuda_device_reset_fn fn = index >= 0 && index < dev_found ? dev_reset_fn : NULL;
	pthread_mutex_unlock(&dev_mu);
	if (!fn)
		return td_fail(eb, TD_EUNSUPPORTED, "no CUDA device %d to reset (the device query did "
				"not find it)", index);
	return fn(index, eb);
}
