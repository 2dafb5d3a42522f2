/* A stand-in for libcuda.so.1 with two devices that exist only here, for
 * testing the daemon's device discovery and placement on hosts without a GPU
 * ($TD_CUDA_DRIVER names it; see fake_driver.sh). It answers what the device
 * query asks (count, name, UUID, compute capability, total and free memory,
 * primary contexts); every other driver call is a stub in fake_cuda_stubs.c
 * that fails with CUDA_ERROR_NOT_SUPPORTED, so a backend opened on it fails at
 * its first stream, as a real driver would fail on a broken device.
 *
 * Device i: "Fake GPU i", compute capability 9.0, UUID bytes 16*i .. 16*i+15,
 * total FAKE_TOTAL(i), free FAKE_FREE(i) (fake_driver.sh checks these).
 *
 * A lost context (fault_fake.sh): while the file $TD_FAKE_CUDA_LOST exists,
 * cuStreamCreate waits 3 s (so that jobs overlap) and fails with the sticky
 * CUDA_ERROR_ILLEGAL_ADDRESS, as every call does on a real corrupt context;
 * cuDevicePrimaryCtxReset removes the file and appends "reset <device>" to
 * $TD_FAKE_CUDA_LOG. */
#include <cuda.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define FAKE_COUNT 2
#define FAKE_TOTAL(i) ((i) == 0 ? (size_t)80 << 30 : (size_t)16 << 30)
#define FAKE_FREE(i) ((i) == 0 ? (size_t)60 << 30 : (size_t)512 << 20)

static int inited;
static _Thread_local int current = -1; /* the device of the thread's context */

CUresult CUDAAPI cuInit(unsigned int flags)
{
	(void)flags;
	inited = 1;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDriverGetVersion(int *v)
{
	*v = 13000;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetCount(int *count)
{
	if (!inited)
		return CUDA_ERROR_NOT_INITIALIZED;
	*count = FAKE_COUNT;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGet(CUdevice *dev, int ordinal)
{
	if (ordinal < 0 || ordinal >= FAKE_COUNT)
		return CUDA_ERROR_INVALID_DEVICE;
	*dev = ordinal;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetName(char *name, int len, CUdevice dev)
{
	snprintf(name, (size_t)len, "Fake GPU %d", (int)dev);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetUuid(CUuuid *u, CUdevice dev)
{
	for (int k = 0; k < 16; k++)
		u->bytes[k] = (char)(16 * dev + k);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice dev)
{
	(void)dev;
	if (a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
		*v = 9;
	else if (a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
		*v = 0;
	else
		return CUDA_ERROR_NOT_SUPPORTED;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDeviceTotalMem(size_t *bytes, CUdevice dev)
{
	*bytes = FAKE_TOTAL(dev);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev)
{
	*ctx = (CUcontext)(uintptr_t)(0x1000 + dev);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev)
{
	(void)dev;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx)
{
	current = ctx ? (int)((uintptr_t)ctx - 0x1000) : -1;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
	if (current < 0 || current >= FAKE_COUNT)
		return CUDA_ERROR_INVALID_CONTEXT;
	*free_bytes = FAKE_FREE(current);
	*total_bytes = FAKE_TOTAL(current);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int flags)
{
	(void)s;
	(void)flags;
	const char *lost = getenv("TD_FAKE_CUDA_LOST");
	if (lost && *lost && access(lost, F_OK) == 0) {
		nanosleep(&(struct timespec){.tv_sec = 3}, NULL);
		return CUDA_ERROR_ILLEGAL_ADDRESS;
	}
	return CUDA_ERROR_NOT_SUPPORTED;
}

/* cuda.h names it cuDevicePrimaryCtxReset_v2, as the module looks it up. */
CUresult CUDAAPI cuDevicePrimaryCtxReset(CUdevice dev)
{
	const char *lost = getenv("TD_FAKE_CUDA_LOST"), *log = getenv("TD_FAKE_CUDA_LOG");
	if (dev < 0 || dev >= FAKE_COUNT)
		return CUDA_ERROR_INVALID_DEVICE;
	if (lost && *lost)
		unlink(lost);
	FILE *f = log && *log ? fopen(log, "a") : NULL;
	if (f) {
		fprintf(f, "reset %d\n", (int)dev);
		fclose(f);
	}
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorName(CUresult r, const char **s)
{
	*s = r == CUDA_ERROR_NOT_SUPPORTED     ? "CUDA_ERROR_NOT_SUPPORTED"
	     : r == CUDA_ERROR_ILLEGAL_ADDRESS ? "CUDA_ERROR_ILLEGAL_ADDRESS"
					       : "CUDA_ERROR_FAKE";
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuGetErrorString(CUresult r, const char **s)
{
	(void)r;
	*s = "the fake test driver does not do that";
	return CUDA_SUCCESS;
}
