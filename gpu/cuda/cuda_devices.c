/* The host's CUDA devices, for the daemon's device list and admission
 * (gpu/select.h: gpu_devices_query, gpu_device_mem).
 *
 * Compiled into libtraind-cuda.so. The driver is opened once per process and
 * kept; each device's primary context is retained at the query and kept too:
 * it is the process's one context per device, which every backend on that
 * device then shares (cuDevicePrimaryCtxRetain counts), and cuMemGetInfo needs
 * a context. Its memory is therefore used from the first query on, and
 * cuMemGetInfo's free bytes are net of it. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "gpu/cuda/cuda_internal.h"
#include "gpu/select.h"

#define CU_MAX_DEVICES 64

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct cu_driver drv;
static bool drv_ok;
static CUcontext ctx[CU_MAX_DEVICES];
static int nctx;

static td_err drv_fail(CUresult r, const char *what, struct td_errbuf *eb)
{
	const char *name = "?", *str = "?";
	if (drv.cuGetErrorName)
		drv.cuGetErrorName(r, &name);
	if (drv.cuGetErrorString)
		drv.cuGetErrorString(r, &str);
	return td_fail(eb, TD_EDEVICE, "%s: %s (%s)", what, name, str);
}

/* Under mu. */
static td_err ensure_driver(struct td_errbuf *eb)
{
	if (drv_ok)
		return TD_OK;
	if (drv.lib) {
		dlclose(drv.lib);
		memset(&drv, 0, sizeof(drv));
	}
	td_err e = cu_open_driver(&drv, eb);
	if (e != TD_OK)
		return e;
	CUresult r = drv.cuInit(0);
	if (r == CUDA_ERROR_NO_DEVICE)
		return td_fail(eb, TD_EUNSUPPORTED, "cuInit: the NVIDIA driver reports no CUDA device");
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuInit", eb);
	drv_ok = true;
	return TD_OK;
}

/* nvidia-smi's form of a device UUID. */
static void uuid_format(const CUuuid *u, char *buf, size_t cap)
{
	const unsigned char *b = (const unsigned char *)u->bytes;
	snprintf(buf, cap,
		 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
		 b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
		 b[14], b[15]);
}

/* Under mu, driver open: device i's primary context, retained once. */
static td_err device_ctx(int i, CUcontext *out, struct td_errbuf *eb)
{
	if (i < nctx && ctx[i]) {
		*out = ctx[i];
		return TD_OK;
	}
	CUdevice dev;
	CUresult r = drv.cuDeviceGet(&dev, i);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuDeviceGet", eb);
	CUcontext c = NULL;
	if ((r = drv.cuDevicePrimaryCtxRetain(&c, dev)) != CUDA_SUCCESS)
		return drv_fail(r, "cuDevicePrimaryCtxRetain", eb);
	ctx[i] = c;
	if (i >= nctx)
		nctx = i + 1;
	*out = c;
	return TD_OK;
}

static td_err mem_of(int i, uint64_t *free_bytes, uint64_t *total_bytes, struct td_errbuf *eb)
{
	CUcontext c = NULL;
	td_err e = device_ctx(i, &c, eb);
	if (e != TD_OK)
		return e;
	CUresult r = drv.cuCtxSetCurrent(c);
	size_t fr = 0, tot = 0;
	if (r == CUDA_SUCCESS)
		r = drv.cuMemGetInfo(&fr, &tot);
	if (r != CUDA_SUCCESS)
		return drv_fail(r, "cuMemGetInfo", eb);
	*free_bytes = fr;
	*total_bytes = tot;
	return TD_OK;
}

__attribute__((visibility("default"))) td_err gpu_cuda_device_reset(int ordinal,
								    struct td_errbuf *eb);
__attribute__((visibility("default"))) td_err gpu_cuda_devices(struct gpu_device_info *out, int max,
							       int *n, struct td_errbuf *eb);
__attribute__((visibility("default"))) td_err gpu_cuda_device_mem(int ordinal, uint64_t *free_bytes,
								  uint64_t *total_bytes,
								  struct td_errbuf *eb);

td_err gpu_cuda_devices(struct gpu_device_info *out, int max, int *n, struct td_errbuf *eb)
{
	*n = 0;
	pthread_mutex_lock(&mu);
	td_err e = ensure_driver(eb);
	int count = 0;
	CUresult r = CUDA_SUCCESS;
	if (e == TD_OK && (r = drv.cuDeviceGetCount(&count)) != CUDA_SUCCESS)
		e = drv_fail(r, "cuDeviceGetCount", eb);
	if (count > CU_MAX_DEVICES)
		count = CU_MAX_DEVICES;
	if (count > max)
		count = max;
	for (int i = 0; e == TD_OK && i < count; i++) {
		struct gpu_device_info *d = &out[i];
		memset(d, 0, sizeof(*d));
		d->index = i;
		CUdevice dev;
		CUuuid u;
		size_t total = 0;
		if ((r = drv.cuDeviceGet(&dev, i)) != CUDA_SUCCESS ||
		    (r = drv.cuDeviceGetName(d->name, (int)sizeof(d->name), dev)) != CUDA_SUCCESS ||
		    (r = drv.cuDeviceGetUuid(&u, dev)) != CUDA_SUCCESS ||
		    (r = drv.cuDeviceGetAttribute(&d->cc_major,
						  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) !=
			    CUDA_SUCCESS ||
		    (r = drv.cuDeviceGetAttribute(&d->cc_minor,
						  CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)) !=
			    CUDA_SUCCESS ||
		    (r = drv.cuDeviceTotalMem(&total, dev)) != CUDA_SUCCESS) {
			char what[64];
			snprintf(what, sizeof(what), "CUDA device %d", i);
			e = drv_fail(r, what, eb);
			break;
		}
		d->name[sizeof(d->name) - 1] = 0;
		uuid_format(&u, d->uuid, sizeof(d->uuid));
		d->total_bytes = total;
		uint64_t fr = 0, tot = 0;
		if ((e = mem_of(i, &fr, &tot, eb)) != TD_OK) {
			char msg[sizeof(eb->msg)];
			snprintf(msg, sizeof(msg), "%s", eb->msg);
			e = td_fail(eb, e, "CUDA device %d (%s): %s", i, d->uuid, msg);
			break;
		}
		d->free_bytes = fr;
	}
	pthread_mutex_unlock(&mu);
	if (e == TD_OK)
		*n = count;
	return e;
}

td_err gpu_cuda_device_mem(int ordinal, uint64_t *free_bytes, uint64_t *total_bytes,
			   struct td_errbuf *eb)
{
	pthread_mutex_lock(&mu);
	td_err e = ensure_driver(eb);
	if (e == TD_OK && (ordinal < 0 || ordinal >= CU_MAX_DEVICES))
		e = td_fail(eb, TD_EINVAL, "CUDA device %d: no such ordinal", ordinal);
	if (e == TD_OK)
		e = mem_of(ordinal, free_bytes, total_bytes, eb);
	pthread_mutex_unlock(&mu);
	return e;
}

#define CU_RESET_STR2_(x) #x
#define CU_RESET_STR_(x) CU_RESET_STR2_(x)

/* Resets ordinal's primary context after a sticky error (gpu/select.h,
 * gpu_device_reset). The reference this file keeps for discovery is
 * released first and taken again after, so that the retain counts stay
 * balanced and cuMemGetInfo has a context; cuDevicePrimaryCtxReset itself
 * ignores the count. The context must then answer (cuMemGetInfo), else
 * TD_EDEVICE. Resolved here, not in CU_DRIVER_LIST, so that drivers without
 * it (the test fakes) still load the module. */
td_err gpu_cuda_device_reset(int ordinal, struct td_errbuf *eb)
{
	pthread_mutex_lock(&mu);
	td_err e = ensure_driver(eb);
	if (e == TD_OK && (ordinal < 0 || ordinal >= CU_MAX_DEVICES))
		e = td_fail(eb, TD_EINVAL, "CUDA device %d: no such ordinal", ordinal);
	CUresult (*reset)(CUdevice) = NULL;
	if (e == TD_OK) {
		*(void **)&reset = dlsym(drv.lib, CU_RESET_STR_(cuDevicePrimaryCtxReset));
		if (!reset)
			e = td_fail(eb, TD_EUNSUPPORTED, "libcuda.so.1 lacks %s (driver too old?)",
				    CU_RESET_STR_(cuDevicePrimaryCtxReset));
	}
	CUdevice dev = 0;
	CUresult r = CUDA_SUCCESS;
	if (e == TD_OK && (r = drv.cuDeviceGet(&dev, ordinal)) != CUDA_SUCCESS)
		e = drv_fail(r, "cuDeviceGet", eb);
	if (e == TD_OK) {
		if (ordinal < nctx && ctx[ordinal]) {
			drv.cuCtxSetCurrent(NULL);
			drv.cuDevicePrimaryCtxRelease(dev);
			ctx[ordinal] = NULL;
		}
		if ((r = reset(dev)) != CUDA_SUCCESS) {
			char what[64];
			snprintf(what, sizeof(what), "CUDA device %d: cuDevicePrimaryCtxReset", ordinal);
			e = drv_fail(r, what, eb);
		}
		/* Retained again whatever the reset said: discovery needs it. */
		CUcontext c;
		td_err e2 = device_ctx(ordinal, &c, e == TD_OK ? eb : NULL);
		if (e == TD_OK)
			e = e2;
		/* Some drivers leave a sticky error in place: the context must
		 * then answer again before any job is placed there. */
		size_t fr, tot;
		if (e == TD_OK && ((r = drv.cuCtxSetCurrent(c)) != CUDA_SUCCESS ||
				   (r = drv.cuMemGetInfo(&fr, &tot)) != CUDA_SUCCESS)) {
			char what[96];
			snprintf(what, sizeof(what), "CUDA device %d: still unusable after the reset",
				 ordinal);
			e = drv_fail(r, what, eb);
		}
	}
	pthread_mutex_unlock(&mu);
	return e;
}
