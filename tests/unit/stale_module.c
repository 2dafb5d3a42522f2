/* A CUDA backend module from another build, for test_module_abi: it stamps
 * another GPU interface (STALE_ABI) or none (no STALE_ABI), and has the
 * entry point traind would call next, which must never run. */
#include <stdlib.h>

#define EXPORT __attribute__((visibility("default")))

#ifdef STALE_ABI
EXPORT const char gpu_cuda_abi[] = STALE_ABI;
#endif

EXPORT int gpu_cuda_backend_new(void **out, void *eb);
int gpu_cuda_backend_new(void **out, void *eb)
{
	(void)out;
	(void)eb;
	abort(); /* a refused module is never called */
}
