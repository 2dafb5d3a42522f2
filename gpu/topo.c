/* NVLink topology through NVML (gpu/topo.h). The few NVML types and entry
 * points used are declared here, as nvml.h has them: no NVML header is needed
 * to build. */
#include "gpu/topo.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

typedef int nvml_return;          /* nvmlReturn_t: NVML_SUCCESS = 0 */
typedef struct nvml_device *nvml_device; /* nvmlDevice_t */
enum {
	NVML_SUCCESS = 0,
	NVML_P2P_CAPS_INDEX_NVLINK = 2, /* nvmlGpuP2PCapsIndex_t */
	NVML_P2P_STATUS_OK = 0,         /* nvmlGpuP2PStatus_t */
};

struct nvml {
	nvml_return (*init)(void);
	nvml_return (*shutdown)(void);
	const char *(*error_string)(nvml_return r);
	nvml_return (*by_uuid)(const char *uuid, nvml_device *dev);
	nvml_return (*p2p_status)(nvml_device a, nvml_device b, int caps_index, int *status);
};

static const char *nvml_why(const struct nvml *f, nvml_return r)
{
	const char *s = f->error_string ? f->error_string(r) : NULL;
	return s ? s : "unknown NVML error";
}

td_err gpu_topo_nvlink(const char *const *uuid, int n, uint32_t *links, struct td_errbuf *eb)
{
	if (!uuid || !links || n < 0 || n > GPU_TOPO_MAX)
		return td_fail(eb, TD_EINVAL, "NVLink topology: %d devices (at most %d)", n,
			       GPU_TOPO_MAX);
	const char *env = getenv("TD_NVML_LIBRARY");
	const char *lib = env && *env ? env : "libnvidia-ml.so.1";
	void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!h)
		return td_fail(eb, TD_EUNSUPPORTED, "NVLink topology unknown: %s cannot be loaded: %s",
			       lib, dlerror());
	struct nvml f;
	static const char *const names[] = {"nvmlInit_v2", "nvmlShutdown", "nvmlErrorString",
					    "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetP2PStatus"};
	void **slot[] = {(void **)&f.init, (void **)&f.shutdown, (void **)&f.error_string,
			 (void **)&f.by_uuid, (void **)&f.p2p_status};
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		if (!(*slot[i] = dlsym(h, names[i]))) {
			dlclose(h);
			return td_fail(eb, TD_EUNSUPPORTED, "NVLink topology unknown: %s lacks %s", lib,
				       names[i]);
		}
	}
	nvml_return r = f.init();
	if (r != NVML_SUCCESS) {
		td_err e = td_fail(eb, TD_EUNSUPPORTED, "NVLink topology unknown: %s: nvmlInit: %s",
				   lib, nvml_why(&f, r));
		dlclose(h);
		return e;
	}
	td_err e = TD_OK;
	nvml_device dev[GPU_TOPO_MAX];
	uint32_t out[GPU_TOPO_MAX] = {0};
	for (int i = 0; i < n && e == TD_OK; i++)
		if ((r = f.by_uuid(uuid[i], &dev[i])) != NVML_SUCCESS)
			e = td_fail(eb, TD_ENOENT, "NVLink topology: NVML does not know %s: %s", uuid[i],
				    nvml_why(&f, r));
	for (int i = 0; i < n && e == TD_OK; i++) {
		for (int j = i + 1; j < n; j++) {
			int st = -1;
			/* A pair NVML cannot judge is taken as not joined. */
			if (f.p2p_status(dev[i], dev[j], NVML_P2P_CAPS_INDEX_NVLINK, &st) == NVML_SUCCESS &&
			    st == NVML_P2P_STATUS_OK) {
				out[i] |= (uint32_t)1 << j;
				out[j] |= (uint32_t)1 << i;
			}
		}
	}
	f.shutdown();
	dlclose(h);
	if (e == TD_OK)
		memcpy(links, out, (size_t)n * sizeof(*links));
	return e;
}
