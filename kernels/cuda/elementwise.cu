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

/* Vector access: four floats at a time where every pointer of the op is
 * 16-byte aligned (the plan's buffers are; a view into one may not be), the
 * rest one at a time. Each element's arithmetic is the same either way. */
/* NULL counts as aligned (an output not written). bf16 twins hold half the
 * bytes, so a 16-byte aligned fp32 index i is an 8-byte aligned bf16 one. */
static __device__ __forceinline__ bool cu_al16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

#define CU_GRID_STRIDE(i, start, n)                                                     \
	for (size_t i = (start) + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
	     i += (size_t)gridDim.x * blockDim.x)

static __device__ __forceinline__ float4 cu_ld4(const float *p, size_t i)
{
	return reinterpret_cast<const float4 *>(p)[i];
}

static __device__ __forceinline__ void cu_st4(float *p, size_t i, float4 v)
{
	reinterpret_cast<float4 *>(p)[i] = v;
}

/* out = a + b; out may alias a or b (each element is read then written by
 * one thread). */
extern "C" __global__ void residual_forward_f32(float *out, const float *a, const float *b,
						size_t n)
{
	size_t done = 0;
	if (cu_al16(out) && cu_al16(a) && cu_al16(b)) {
		CU_GRID_STRIDE(i, 0, n / 4)
		{
			const float4 x = cu_ld4(a, i), y = cu_ld4(b, i);
			cu_st4(out, i, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
		}
		done = n / 4 * 4;
	}
	CU_GRID_STRIDE(i, done, n)
	out[i] = a[i] + b[i];
}

/* out = silu(gate) * up, silu(x) = x / (1 + exp(-x)) as torch writes it: for
 * x << 0 exp overflows to inf and the quotient is -0, the right limit. */
static __device__ __forceinline__ float cu_swiglu(float x, float u)
{
	return __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))), u);
}

/* out16, dgate16, dup16: bf16 twins, or NULL; an fp32 output may be NULL
 * when its twin is not (common.cuh: cu_put, cu_put4). */
/* gate, up: fp32, or (those NULL) bf16 in gate16, up16: a product kept in
 * bf16 only. Four at a time from either. */
static __device__ __forceinline__ float4 cu_in4(const float *p, const __nv_bfloat16 *p16, size_t i)
{
	if (p)
		return cu_ld4(p, i);
	const uint2 u = reinterpret_cast<const uint2 *>(p16)[i];
	const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162 *>(&u.x);
	const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162 *>(&u.y);
	return make_float4(__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi));
}

static __device__ __forceinline__ float cu_in(const float *p, const __nv_bfloat16 *p16, size_t i)
{
	return p ? p[i] : __bfloat162float(p16[i]);
}

extern "C" __global__ void swiglu_forward_f32(float *out, __nv_bfloat16 *out16, const float *gate,
					      const float *up, const __nv_bfloat16 *gate16,
					      const __nv_bfloat16 *up16, size_t n)
{
	size_t done = 0;
	if (cu_al16(out) && cu_al16(out16) && cu_al16(gate) && cu_al16(up) && cu_al16(gate16) &&
	    cu_al16(up16)) {
		CU_GRID_STRIDE(i, 0, n / 4)
		{
			const float4 x = cu_in4(gate, gate16, i), u = cu_in4(up, up16, i);
			cu_put4(out, out16, i,
				make_float4(cu_swiglu(x.x, u.x), cu_swiglu(x.y, u.y),
					    cu_swiglu(x.z, u.z), cu_swiglu(x.w, u.w)));
		}
		done = n / 4 * 4;
	}
	CU_GRID_STRIDE(i, done, n)
	cu_put(out, out16, i, cu_swiglu(cu_in(gate, gate16, i), cu_in(up, up16, i)));
}

/* dup = dout * silu(gate) ; dgate = dout * up * sig * (1 + x * (1 - sig)).
 * Overwrite. */
static __device__ __forceinline__ void cu_swiglu_grad(float x, float u, float d, float &dgate,
						      float &dup)
{
	const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
	dup = __fmul_rn(d, __fmul_rn(x, sig));
	const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(x, 1.0f - sig)));
	dgate = __fmul_rn(__fmul_rn(d, u), dsilu);
}

/* dout: fp32, or (dout NULL) dout16, the down projection's input gradient
 * in bf16. */
extern "C" __global__ void swiglu_backward_f32(float *dgate, float *dup, __nv_bfloat16 *dgate16,
					       __nv_bfloat16 *dup16, const float *dout,
					       const __nv_bfloat16 *dout16, const float *gate,
					       const float *up, const __nv_bfloat16 *gate16,
					       const __nv_bfloat16 *up16, size_t n)
{
	size_t done = 0;
	if (cu_al16(dgate) && cu_al16(dup) && cu_al16(dgate16) && cu_al16(dup16) && cu_al16(dout) &&
	    cu_al16(dout16) && cu_al16(gate) && cu_al16(up) && cu_al16(gate16) && cu_al16(up16)) {
		CU_GRID_STRIDE(i, 0, n / 4)
		{
			const float4 x = cu_in4(gate, gate16, i), u = cu_in4(up, up16, i);
			const float4 d = cu_in4(dout, dout16, i);
			float4 g, p;
			cu_swiglu_grad(x.x, u.x, d.x, g.x, p.x);
			cu_swiglu_grad(x.y, u.y, d.y, g.y, p.y);
			cu_swiglu_grad(x.z, u.z, d.z, g.z, p.z);
			cu_swiglu_grad(x.w, u.w, d.w, g.w, p.w);
			cu_put4(dgate, dgate16, i, g);
			cu_put4(dup, dup16, i, p);
		}
		done = n / 4 * 4;
	}
	CU_GRID_STRIDE(i, done, n)
	{
		float g, p;
		cu_swiglu_grad(cu_in(gate, gate16, i), cu_in(up, up16, i), cu_in(dout, dout16, i), g,
			       p);
		cu_put(dgate, dgate16, i, g);
		cu_put(dup, dup16, i, p);
	}
}

/* out[i] = in[i] rounded to bf16 (nearest even): a GEMM operand for the
 * tensor cores in the bf16 mode. Four values per thread step (a 16-byte load,
 * an 8-byte store) where in and out are aligned for it; the launcher sizes
 * the grid for n / 4. */
extern "C" __global__ void cast_bf16_f32(__nv_bfloat16 *out, const float *in, size_t n)
{
	const size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t done = 0;
	if (((uintptr_t)in & 15) == 0 && ((uintptr_t)out & 7) == 0) {
		const size_t n4 = n / 4;
		for (size_t j = i; j < n4; j += stride) {
			reinterpret_cast<uint2 *>(out)[j] =
				cu_pack_bf16x4(reinterpret_cast<const float4 *>(in)[j]);
		}
		done = n4 * 4;
	}
	for (size_t j = done + i; j < n; j += stride)
		out[j] = __float2bfloat16_rn(in[j]);
}

/* out (n) = in (bf16) widened to fp32, exactly. Overwrite. */
extern "C" __global__ void cast_f32_bf16(float *out, const __nv_bfloat16 *in, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		out[i] = __bfloat162float(in[i]);
}
