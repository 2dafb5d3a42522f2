/* Every driver entry point the CUDA module resolves (CU_DRIVER_LIST), as a
 * weak stub that fails: fake_cuda.c's definitions override the ones it
 * implements. The asm labels give the versioned names cuda.h maps to
 * (cuMemAlloc -> cuMemAlloc_v2), as the module looks them up. */
#include "gpu/cuda/cuda_internal.h"

#define FAKE_STR2_(x) #x
#define FAKE_STR_(x) FAKE_STR2_(x)
#define FAKE_STUB_(name)                                                                   \
	__attribute__((weak, visibility("default"))) CUresult fake_stub_##name(void)       \
		__asm__(FAKE_STR_(name));                                                  \
	CUresult fake_stub_##name(void)                                                    \
	{                                                                                  \
		return CUDA_ERROR_NOT_SUPPORTED;                                           \
	}
CU_DRIVER_LIST(FAKE_STUB_)
