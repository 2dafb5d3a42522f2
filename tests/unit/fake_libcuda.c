/* A fake libcuda.so.1 for test_modcache_backend: just enough of the driver
 * API for the CUDA module to create a device, context and stream and load
 * its kernels, so that the module-cache path of load_kernels runs on a
 * machine without a GPU. It reports each cuLinkCreate and cuModuleLoadData
 * as a line of $FAKE_LOG. The device is sm_$FAKE_CC (default 90); the driver
 * version $FAKE_DRV (default 12080); while the file $FAKE_REFUSE exists,
 * cuModuleLoadData refuses the next JIT cubin (and removes the file). The
 * JIT's "cubin" is the text "FAKECUBIN:ptx<PTX bytes>", cleared by
 * cuLinkDestroy. cuBLAS, which this fake does not serve, then fails the
 * backend: the test reads the log and the cache, not the backend. */
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static void lg(const char *what)
{
	const char *p = getenv("FAKE_LOG");
	FILE *f = p ? fopen(p, "a") : NULL;
	if (f) {
		fprintf(f, "%s\n", what);
		fclose(f);
	}
}
static char cubin[256];
CUresult cuInit(unsigned f)
{
	(void)f;
	return CUDA_SUCCESS;
}
CUresult cuDriverGetVersion(int *v)
{
	const char *e = getenv("FAKE_DRV");
	*v = e ? atoi(e) : 12080;
	return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int *n)
{
	*n = 1;
	return CUDA_SUCCESS;
}
CUresult cuDeviceGet(CUdevice *d, int o)
{
	*d = o;
	return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char *n, int len, CUdevice d)
{
	(void)d;
	snprintf(n, len, "Fake GPU");
	return CUDA_SUCCESS;
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d)
{
	(void)d;
	memset(u, 0, sizeof(*u));
	return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d)
{
	(void)d;
	const char *e = getenv("FAKE_CC");
	int cc = e ? atoi(e) : 90;
	*v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR	 ? cc / 10
	     : a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? cc % 10
								 : 0;
	return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem(size_t *b, CUdevice d)
{
	(void)d;
	*b = 1ull << 34;
	return CUDA_SUCCESS;
}
static int ctxobj;
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d)
{
	(void)d;
	*c = (CUcontext)&ctxobj;
	return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease(CUdevice d)
{
	(void)d;
	return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(CUcontext c)
{
	(void)c;
	return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize(void)
{
	return CUDA_SUCCESS;
}
CUresult cuStreamCreate(CUstream *s, unsigned f)
{
	(void)f;
	*s = (CUstream)&ctxobj;
	return CUDA_SUCCESS;
}
CUresult cuStreamDestroy(CUstream s)
{
	(void)s;
	return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(CUstream s)
{
	(void)s;
	return CUDA_SUCCESS;
}
CUresult cuMemAlloc(CUdeviceptr *p, size_t b)
{
	*p = (CUdeviceptr)(uintptr_t)malloc(b);
	return CUDA_SUCCESS;
}
CUresult cuMemFree(CUdeviceptr p)
{
	free((void *)(uintptr_t)p);
	return CUDA_SUCCESS;
}
CUresult cuMemGetInfo(size_t *f, size_t *t)
{
	*f = *t = 1ull << 34;
	return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync(CUdeviceptr d, const void *s, size_t b, CUstream st)
{
	(void)d;
	(void)s;
	(void)b;
	(void)st;
	return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync(void *d, CUdeviceptr s, size_t b, CUstream st)
{
	(void)d;
	(void)s;
	(void)b;
	(void)st;
	return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoDAsync(CUdeviceptr d, CUdeviceptr s, size_t b, CUstream st)
{
	(void)d;
	(void)s;
	(void)b;
	(void)st;
	return CUDA_SUCCESS;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream st)
{
	(void)d;
	(void)v;
	(void)n;
	(void)st;
	return CUDA_SUCCESS;
}
static int modobj;
CUresult cuModuleLoadData(CUmodule *m, const void *img)
{
	if (memcmp(img, "\177ELF", 4) == 0) {
		lg("load elf");
		*m = (CUmodule)&modobj;
		return CUDA_SUCCESS;
	}
	if (strncmp(img, "FAKECUBIN:", 10) == 0) {
		char b[300];
		snprintf(b, sizeof b, "load %s", (const char *)img);
		lg(b);
		*m = (CUmodule)&modobj;
		const char *r = getenv("FAKE_REFUSE");
		if (r && unlink(r) == 0) {
			lg("refused");
			return CUDA_ERROR_INVALID_IMAGE;
		}
		return CUDA_SUCCESS;
	}
	lg("load refused");
	return CUDA_ERROR_INVALID_IMAGE;
}
CUresult cuModuleUnload(CUmodule m)
{
	(void)m;
	return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *n)
{
	(void)m;
	(void)n;
	*f = (CUfunction)&modobj;
	return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v)
{
	(void)f;
	(void)a;
	(void)v;
	return CUDA_SUCCESS;
}
CUresult cuLaunchKernel(CUfunction f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e,
			unsigned g, unsigned s, CUstream st, void **p, void **x)
{
	(void)f;
	(void)a;
	(void)b;
	(void)c;
	(void)d;
	(void)e;
	(void)g;
	(void)s;
	(void)st;
	(void)p;
	(void)x;
	return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult r, const char **s)
{
	*s = r == CUDA_ERROR_INVALID_IMAGE ? "CUDA_ERROR_INVALID_IMAGE" : "CUDA_ERROR_FAKE";
	return CUDA_SUCCESS;
}
CUresult cuGetErrorString(CUresult r, const char **s)
{
	(void)r;
	*s = "fake";
	return CUDA_SUCCESS;
}
static size_t ptxlen;
CUresult cuLinkCreate(unsigned n, CUjit_option *o, void **v, CUlinkState *s)
{
	char b[128];
	snprintf(b, sizeof b, "link n=%u opt0=%d val0=%ld", n, n ? (int)o[0] : -1,
		 n ? (long)(uintptr_t)v[0] : -1);
	lg(b);
	*s = (CUlinkState)&modobj;
	return CUDA_SUCCESS;
}
CUresult cuLinkAddData(CUlinkState s, CUjitInputType t, void *d, size_t z, const char *nm,
		       unsigned n, CUjit_option *o, void **v)
{
	(void)s;
	(void)t;
	(void)d;
	(void)nm;
	(void)n;
	(void)o;
	(void)v;
	ptxlen = z;
	return CUDA_SUCCESS;
}
CUresult cuLinkComplete(CUlinkState s, void **c, size_t *z)
{
	(void)s;
	snprintf(cubin, sizeof cubin, "FAKECUBIN:ptx%zu", ptxlen);
	*c = cubin;
	*z = strlen(cubin) + 1;
	return CUDA_SUCCESS;
}
CUresult cuLinkDestroy(CUlinkState s)
{
	(void)s;
	memset(cubin, 0, sizeof cubin);
	return CUDA_SUCCESS;
}
CUresult cuEventCreate(CUevent *e, unsigned f)
{
	(void)e;
	(void)f;
	return CUDA_SUCCESS;
}
CUresult cuEventRecord(CUevent e, CUstream s)
{
	(void)e;
	(void)s;
	return CUDA_SUCCESS;
}
CUresult cuEventSynchronize(CUevent e)
{
	(void)e;
	return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime(float *m, CUevent a, CUevent b)
{
	(void)a;
	(void)b;
	*m = 0;
	return CUDA_SUCCESS;
}
CUresult cuEventDestroy(CUevent e)
{
	(void)e;
	return CUDA_SUCCESS;
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned f)
{
	(void)s;
	(void)e;
	(void)f;
	return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void **p, size_t b, unsigned f)
{
	(void)f;
	*p = malloc(b);
	return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult cuMemFreeHost(void *p)
{
	free(p);
	return CUDA_SUCCESS;
}
