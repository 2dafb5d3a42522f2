/* Rotary position embedding, forward and backward, fp32: the CUDA twins of
 * rope_forward / rope_backward in kernels/cpu/ops.h (Hugging Face's
 * rotate_half layout; the cos/sin tables come from rope_cache on the host).
 *
 * Each thread rotates one pair (i, i + HS/2) of one head: it reads both
 * values before writing either, and no other thread touches them, so out may
 * alias inp (no __restrict__ here). The products and sums are the CPU op's,
 * rounded the same way (_rn intrinsics: no contraction into FMAs), so the
 * result is bit-identical to it. The backward pass is the rotation by -angle,
 * i.e. the forward formula with sin negated, which is exact in IEEE
 * arithmetic (x - y*(-s) == x + y*s).
 *
 * Key: B batch, T sequence, NH heads, HS head size (even). inp/out
 * (B,T,NH,HS); cos, sin (T, HS/2). out16: the forward's result rounded to
 * bf16 (the fused attention's q and k), beside out or instead of it (out
 * NULL). Launch: one block per (b, t) token, grid-stride over tokens,
 * threads over the NH*HS/2 pairs. */
#include "common.cuh"

static __device__ __forceinline__ void rope_rotate(float *out, __nv_bfloat16 *out16,
						   const float *inp, const float *cos,
						   const float *sin, int B, int T, int NH, int HS,
						   float sign)
{
	const int H2 = HS / 2, pairs = NH * H2;
	const size_t tokens = (size_t)B * T;
	for (size_t row = blockIdx.x; row < tokens; row += gridDim.x) {
		const int t = (int)(row % (size_t)T);
		const float *c = cos + (size_t)t * H2;
		const float *s = sin + (size_t)t * H2;
		for (int j = threadIdx.x; j < pairs; j += blockDim.x) {
			const int h = j / H2, i = j - h * H2;
			const size_t off = (row * NH + h) * HS;
			const float x1 = inp[off + i], x2 = inp[off + i + H2];
			const float ci = c[i], si = sign * s[i];
			cu_put(out, out16, off + i, __fsub_rn(__fmul_rn(x1, ci), __fmul_rn(x2, si)));
			cu_put(out, out16, off + i + H2,
			       __fadd_rn(__fmul_rn(x2, ci), __fmul_rn(x1, si)));
		}
	}
}

/* The same rotation four pairs a thread (HS/2 a multiple of 4; inp, out,
 * cos and sin 16-byte aligned, out16 8-byte: the launcher checks), grid-stride over the
 * (token, head, quad) units: four 16-byte loads a thread (x1, x2, and the
 * row's cos and sin, which L1 and L2 serve) before its stores, so a thread
 * has them all in flight at once, where one pair a thread at a block a token
 * kept the memory at half its bandwidth on Qwen2-0.5B's q (14 heads of 64)
 * and k (2 heads). Each value is the scalar path's, bit for bit. */
static __device__ __forceinline__ void rope_rotate4(float *out, __nv_bfloat16 *out16,
						    const float *inp, const float *cos,
						    const float *sin, int B, int T, int NH, int HS,
						    float sign)
{
	const int H2 = HS / 2, Q = H2 / 4; /* quads a head */
	const size_t units = (size_t)B * T * NH * Q;
	for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < units;
	     u += (size_t)gridDim.x * blockDim.x) {
		const size_t head = u / Q; /* (b*T + t)*NH + h */
		const int i = (int)(u - head * Q) * 4;
		const int t = (int)((head / NH) % (size_t)T);
		const size_t off = head * HS + i;
		const float4 x1 = *reinterpret_cast<const float4 *>(inp + off);
		const float4 x2 = *reinterpret_cast<const float4 *>(inp + off + H2);
		const float4 c = *reinterpret_cast<const float4 *>(cos + (size_t)t * H2 + i);
		float4 s = *reinterpret_cast<const float4 *>(sin + (size_t)t * H2 + i);
		s = make_float4(sign * s.x, sign * s.y, sign * s.z, sign * s.w);
		float4 y1, y2;
		cu_rope4(x1, x2, c, s, y1, y2);
		cu_put4(out, out16, off / 4, y1);
		cu_put4(out, out16, (off + H2) / 4, y2);
	}
}

/* The forward and backward kernels of a rotation (rope_rotate or
 * rope_rotate4), named with its suffix:
 * out[:HS/2] = x1*cos - x2*sin ; out[HS/2:] = x2*cos + x1*sin, and
 * dinp[:HS/2] = d1*cos + d2*sin ; dinp[HS/2:] = d2*cos - d1*sin. Overwrite.
 * rope_forward_f32 and rope_backward_f32 take a block a token;
 * rope_forward4_f32 and rope_backward4_f32 a thread a unit, grid-stride. */
#define ROPE_KERNELS(sfx, rotate)                                                                  \
	extern "C" __global__ void rope_forward##sfx(float *out, __nv_bfloat16 *out16,             \
						     const float *inp, const float *cos,           \
						     const float *sin, int B, int T, int NH, int HS) \
	{                                                                                          \
		rotate(out, out16, inp, cos, sin, B, T, NH, HS, 1.0f);                             \
	}                                                                                          \
	extern "C" __global__ void rope_backward##sfx(float *dinp, const float *dout,              \
						      const float *cos, const float *sin, int B,   \
						      int T, int NH, int HS)                       \
	{                                                                                          \
		rotate(dinp, NULL, dout, cos, sin, B, T, NH, HS, -1.0f);                           \
	}

ROPE_KERNELS(_f32, rope_rotate)
ROPE_KERNELS(4_f32, rope_rotate4)

/* The fused attention's q16, k16 and v16 from one product's rows: q, k and v
 * projected by one GEMM over their side-by-side weights (train/model.c:
 * qkv_forward_fused), qkv (B*T, W) with W = (NH + 2 NKV) HS, each row
 * [q | k | v]. q's and k's heads rotated and rounded as rope_forward's out16
 * gives them (the same products and sums: the same bits), v rounded as
 * bf16_round. One launch instead of three; q16 (B,T,NH,HS), k16 and v16
 * (B,T,NKV,HS). A row's NH + NKV rotated heads are rows of HS values of qkv
 * in turn (k's follow q's), so a head hh of row r starts at r W + hh HS.
 * rope_qkv16_f32: a thread a pair or one of v's values, grid-stride;
 * rope_qkv16x4_f32: four of either (HS/2 a multiple of 4, qkv, cos and sin
 * 16-byte aligned, the bf16 outputs 8-byte: the launcher checks). */
extern "C" __global__ void rope_qkv16_f32(__nv_bfloat16 *q16, __nv_bfloat16 *k16,
					  __nv_bfloat16 *v16, const float *qkv, const float *cos,
					  const float *sin, int B, int T, int NH, int NKV, int HS)
{
	const int H2 = HS / 2, NR = NH + NKV;
	const size_t W = (size_t)(NH + 2 * NKV) * HS, KV = (size_t)NKV * HS;
	const size_t tokens = (size_t)B * T, rot = tokens * NR * H2, units = rot + tokens * KV;
	for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < units;
	     u += (size_t)gridDim.x * blockDim.x) {
		if (u >= rot) {
			const size_t r = (u - rot) / KV, j = (u - rot) - r * KV;
			v16[r * KV + j] = __float2bfloat16_rn(qkv[r * W + (size_t)NR * HS + j]);
			continue;
		}
		const size_t head = u / H2; /* r * NR + hh */
		const int i = (int)(u - head * H2);
		const size_t r = head / NR;
		const int hh = (int)(head - r * NR), t = (int)(r % (size_t)T);
		const float *x = qkv + r * W + (size_t)hh * HS;
		__nv_bfloat16 *o = hh < NH ? q16 + (r * NH + hh) * HS : k16 + (r * NKV + hh - NH) * HS;
		const float x1 = x[i], x2 = x[i + H2];
		const float ci = cos[(size_t)t * H2 + i], si = sin[(size_t)t * H2 + i];
		o[i] = __float2bfloat16_rn(__fsub_rn(__fmul_rn(x1, ci), __fmul_rn(x2, si)));
		o[i + H2] = __float2bfloat16_rn(__fadd_rn(__fmul_rn(x2, ci), __fmul_rn(x1, si)));
	}
}

extern "C" __global__ void rope_qkv16x4_f32(__nv_bfloat16 *q16, __nv_bfloat16 *k16,
					    __nv_bfloat16 *v16, const float *qkv, const float *cos,
					    const float *sin, int B, int T, int NH, int NKV, int HS)
{
	const int H2 = HS / 2, Q = H2 / 4, NR = NH + NKV;
	const size_t W = (size_t)(NH + 2 * NKV) * HS, KV4 = (size_t)NKV * HS / 4;
	const size_t tokens = (size_t)B * T, rot = tokens * NR * Q, units = rot + tokens * KV4;
	for (size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x; u < units;
	     u += (size_t)gridDim.x * blockDim.x) {
		if (u >= rot) {
			const size_t r = (u - rot) / KV4, j = (u - rot) - r * KV4;
			const float4 x = *reinterpret_cast<const float4 *>(qkv + r * W +
									   (size_t)NR * HS + 4 * j);
			cu_put4(NULL, v16, r * KV4 + j, x);
			continue;
		}
		const size_t head = u / Q; /* r * NR + hh */
		const int i = (int)(u - head * Q) * 4;
		const size_t r = head / NR;
		const int hh = (int)(head - r * NR), t = (int)(r % (size_t)T);
		const float *x = qkv + r * W + (size_t)hh * HS + i;
		const float4 x1 = *reinterpret_cast<const float4 *>(x);
		const float4 x2 = *reinterpret_cast<const float4 *>(x + H2);
		const float4 c = *reinterpret_cast<const float4 *>(cos + (size_t)t * H2 + i);
		const float4 s = *reinterpret_cast<const float4 *>(sin + (size_t)t * H2 + i);
		float4 y1, y2;
		cu_rope4(x1, x2, c, s, y1, y2);
		__nv_bfloat16 *o = hh < NH ? q16 + (r * NH + hh) * HS : k16 + (r * NKV + hh - NH) * HS;
		cu_put4(NULL, o + i, 0, y1);
		cu_put4(NULL, o + i + H2, 0, y2);
	}
}
