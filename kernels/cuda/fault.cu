/* A test hook, not an op: fault_inject_f32 writes through the pointer it is
 * given. The CUDA backend launches it only under TD_CUDA_FAULT_AFTER_OPS
 * (gpu/cuda/cuda_backend.c), with a wild pointer, to raise a real
 * CUDA_ERROR_ILLEGAL_ADDRESS, the sticky error that corrupts the device's
 * primary context (tests/gpu/fault.sh). Nothing else uses it. */
#include "common.cuh"

extern "C" __global__ void fault_inject_f32(float *p)
{
	*(volatile float *)p = 1.0f;
}
