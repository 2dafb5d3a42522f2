/* Device helpers shared by the kernel files of kernels/cuda: warp and block
 * reductions, the online (max, sum-of-exp) pair of a softmax, and the tile
 * that column sums are built from.
 *
 * Only static inline device code (templates included) and no kernels: every .cu file includes it,
 * and kernels/cuda/kernels.cu includes them all into one translation unit, so
 * it must be harmless to see twice. Every reduction here is deterministic: a
 * fixed tree for a given launch shape, the same bits on every lane and every
 * run (xor-butterfly shuffles are symmetric, and a + b == b + a exactly).
 *
 * Launch assumptions, which the launchers in gpu/cuda/cuda_ops.c honour: block
 * sizes are whole warps (a multiple of 32, at most 1024), so full-mask
 * shuffles are valid.
 *
 * Key to the shape letters: see kernels/cpu/ops.h. */
#ifndef KERNELS_CUDA_COMMON_CUH
#define KERNELS_CUDA_COMMON_CUH

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>

#define CU_FULL_MASK 0xffffffffu

/* Four floats rounded to bf16 (nearest even), packed for one 8-byte store:
 * the bf16 twins and copies of the bf16 mode. */
/* RoPE's rotation of four pairs (x1, x2) by (c, s) (rope.cu: Hugging
 * Face's rotate_half): y1 = x1 c - x2 s, y2 = x2 c + x1 s, each product
 * and sum rounded on its own (no contraction into FMAs): the CPU op's
 * bits. */
static __device__ __forceinline__ void cu_rope4(float4 x1, float4 x2, float4 c, float4 s,
						float4 &y1, float4 &y2)
{
	y1 = make_float4(__fsub_rn(__fmul_rn(x1.x, c.x), __fmul_rn(x2.x, s.x)),
			 __fsub_rn(__fmul_rn(x1.y, c.y), __fmul_rn(x2.y, s.y)),
			 __fsub_rn(__fmul_rn(x1.z, c.z), __fmul_rn(x2.z, s.z)),
			 __fsub_rn(__fmul_rn(x1.w, c.w), __fmul_rn(x2.w, s.w)));
	y2 = make_float4(__fadd_rn(__fmul_rn(x2.x, c.x), __fmul_rn(x1.x, s.x)),
			 __fadd_rn(__fmul_rn(x2.y, c.y), __fmul_rn(x1.y, s.y)),
			 __fadd_rn(__fmul_rn(x2.z, c.z), __fmul_rn(x1.z, s.z)),
			 __fadd_rn(__fmul_rn(x2.w, c.w), __fmul_rn(x1.w, s.w)));
}

static __device__ __forceinline__ uint2 cu_pack_bf16x4(float4 v)
{
	__nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
	uint2 u;
	u.x = *reinterpret_cast<uint32_t *>(&lo);
	u.y = *reinterpret_cast<uint32_t *>(&hi);
	return u;
}

/* Eight bf16 values of one 16-byte load, widened (exactly). */
static __device__ __forceinline__ void cu_widen_bf16x8(uint4 u, float f[8])
{
	const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
	for (int k = 0; k < 4; k++) {
		const float2 t = __bfloat1622float2(h[k]);
		f[2 * k] = t.x;
		f[2 * k + 1] = t.y;
	}
}

/* Eight floats rounded to bf16 (nearest even) for one 16-byte store. */
static __device__ __forceinline__ uint4 cu_pack_bf16x8(const float f[8])
{
	const uint2 lo = cu_pack_bf16x4(make_float4(f[0], f[1], f[2], f[3]));
	const uint2 hi = cu_pack_bf16x4(make_float4(f[4], f[5], f[6], f[7]));
	return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

/* An output written in fp32 (p), as a bf16 twin (p16), or both; either may be
 * NULL. cu_put4 takes index i in units of four values (16-byte aligned p,
 * 8-byte aligned p16). */
static __device__ __forceinline__ void cu_put(float *p, __nv_bfloat16 *p16, size_t i, float v)
{
	if (p)
		p[i] = v;
	if (p16)
		p16[i] = __float2bfloat16_rn(v);
}

static __device__ __forceinline__ void cu_put4(float *p, __nv_bfloat16 *p16, size_t i, float4 v)
{
	if (p)
		reinterpret_cast<float4 *>(p)[i] = v;
	if (p16)
		reinterpret_cast<uint2 *>(p16)[i] = cu_pack_bf16x4(v);
}

template <typename T> static __device__ __forceinline__ T cu_warp_sum(T v)
{
	for (int o = 16; o > 0; o >>= 1)
		v += __shfl_xor_sync(CU_FULL_MASK, v, o);
	return v;
}

/* The sum of v over the block, returned to every thread. Every warp reduces the
 * per-warp partials itself (in the same order), so no broadcast slot is
 * needed; the leading barrier lets a kernel call this more than once. */
template <typename T> static __device__ __forceinline__ T cu_block_sum(T v)
{
	__shared__ T partial[32];
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int nwarps = (blockDim.x + 31) >> 5;
	v = cu_warp_sum(v);
	__syncthreads();
	if (lane == 0)
		partial[warp] = v;
	__syncthreads();
	v = lane < nwarps ? partial[lane] : (T)0;
	return cu_warp_sum(v);
}

/* Online softmax normaliser: m is the running max, s the sum of exp(x - m),
 * kept in S (float, or double where a long row's sum must stay exact to
 * ~1e-7: cross-entropy and distillation over the vocabulary). The empty pair
 * is (-inf, 0). */
template <typename S> static __device__ __forceinline__ void cu_ms_push(float &m, S &s, float x)
{
	if (x > m) {
		s = s * (S)expf(m - x) + (S)1;
		m = x;
	} else {
		s += (S)expf(x - m);
	}
}

/* Merges (m2, s2) into (m, s). An empty side contributes 0 (never exp(-inf -
 * -inf)); the merge is symmetric, so butterfly lanes agree bit for bit. */
template <typename S>
static __device__ __forceinline__ void cu_ms_merge(float &m, S &s, float m2, S s2)
{
	float M = fmaxf(m, m2);
	S a = s == (S)0 ? (S)0 : s * (S)expf(m - M);
	S b = s2 == (S)0 ? (S)0 : s2 * (S)expf(m2 - M);
	m = M;
	s = a + b;
}

template <typename S> static __device__ __forceinline__ void cu_warp_ms(float &m, S &s)
{
	for (int o = 16; o > 0; o >>= 1) {
		float m2 = __shfl_xor_sync(CU_FULL_MASK, m, o);
		S s2 = __shfl_xor_sync(CU_FULL_MASK, s, o);
		cu_ms_merge(m, s, m2, s2);
	}
}

/* (m, s) over the block, returned to every thread. */
template <typename S> static __device__ __forceinline__ void cu_block_ms(float &m, S &s)
{
	__shared__ float pm[32];
	__shared__ S ps[32];
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int nwarps = (blockDim.x + 31) >> 5;
	cu_warp_ms(m, s);
	__syncthreads();
	if (lane == 0) {
		pm[warp] = m;
		ps[warp] = s;
	}
	__syncthreads();
	m = lane < nwarps ? pm[lane] : -INFINITY;
	s = lane < nwarps ? ps[lane] : (S)0;
	cu_warp_ms(m, s);
}

/* One tile of a column sum over rows [n0, n1) of an (N, C) matrix: block
 * (32, BY) with BY <= 32, columns blockIdx.x*32 + threadIdx.x. Thread (x, y)
 * sums rows n0 + y, n0 + y + BY, ... of its column (a warp reads 32 adjacent
 * floats of one row), then row y == 0 adds the BY partials in y order. The
 * value at (n, c) is term(n, c). Returns the column's sum on threads with
 * threadIdx.y == 0 (0 elsewhere and past C). */
template <typename Term>
static __device__ __forceinline__ float cu_colsum_tile(Term term, int n0, int n1, int C)
{
	__shared__ float part[32][33];
	const int c = blockIdx.x * 32 + threadIdx.x;
	float acc = 0.0f;
	if (c < C)
		for (int n = n0 + (int)threadIdx.y; n < n1; n += blockDim.y)
			acc += term(n, c);
	part[threadIdx.y][threadIdx.x] = acc;
	__syncthreads();
	float sum = 0.0f;
	if (threadIdx.y == 0)
		for (unsigned y = 0; y < blockDim.y; y++)
			sum += part[y][threadIdx.x];
	return sum;
}

#endif
