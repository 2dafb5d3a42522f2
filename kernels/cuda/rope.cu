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
