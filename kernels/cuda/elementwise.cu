/* Elementwise ops of the MLP and the residual stream, fp32: the CUDA twins of
 * swiglu_forward / swiglu_backward / residual_forward in kernels/cpu/ops.h.
 *
 * Each element's arithmetic is the CPU op's, in the same order, with the _rn
 * intrinsics where nvcc would otherwise contract a multiply and an add into
 * an FMA; the only difference left is expf, which CUDA and glibc each round
 * to within 2 ulp. Grid-stride loops over size_t indices.
 *
 * Key: n values. */
#include "common.cuh"

/* out = a + b; out may alias a or b (each element is read then written by
 * one thread). */
extern "C" __global__ void residual_forward_f32(float *out, const float *a, const float *b,
						size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		out[i] = a[i] + b[i];
}

/* out = silu(gate) * up, silu(x) = x / (1 + exp(-x)) as torch writes it: for
 * x << 0 exp overflows to inf and the quotient is -0, the right limit. */
extern "C" __global__ void swiglu_forward_f32(float *out, const float *gate, const float *up,
					      size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float x = gate[i];
		out[i] = __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))), up[i]);
	}
}

/* dup = dout * silu(gate) ; dgate = dout * up * sig * (1 + x * (1 - sig)).
 * Overwrite. */
extern "C" __global__ void swiglu_backward_f32(float *dgate, float *dup, const float *dout,
					       const float *gate, const float *up, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float x = gate[i], d = dout[i];
		const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
		dup[i] = __fmul_rn(d, __fmul_rn(x, sig));
		const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(x, 1.0f - sig)));
		dgate[i] = __fmul_rn(__fmul_rn(d, up[i]), dsilu);
	}
}

/* out[i] = in[i] rounded to bf16 (nearest even): a GEMM operand for the
 * tensor cores in the bf16 mode. Four values per thread step (a 16-byte load,
 * an 8-byte store) where in and out are aligned for it; the launcher sizes
 * the grid for n / 4. */
#include <cuda_bf16.h>
extern "C" __global__ void cast_bf16_f32(__nv_bfloat16 *out, const float *in, size_t n)
{
	const size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t done = 0;
	if (((uintptr_t)in & 15) == 0 && ((uintptr_t)out & 7) == 0) {
		const size_t n4 = n / 4;
		for (size_t j = i; j < n4; j += stride) {
			const float4 x = reinterpret_cast<const float4 *>(in)[j];
			__nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y);
			__nv_bfloat162 hi = __floats2bfloat162_rn(x.z, x.w);
			uint2 u;
			u.x = *reinterpret_cast<uint32_t *>(&lo);
			u.y = *reinterpret_cast<uint32_t *>(&hi);
			reinterpret_cast<uint2 *>(out)[j] = u;
		}
		done = n4 * 4;
	}
	for (size_t j = done + i; j < n; j += stride)
		out[j] = __float2bfloat16_rn(in[j]);
}
