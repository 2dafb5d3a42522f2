/* RMSNorm forward and backward, fp32: the CUDA twins of rmsnorm_forward /
 * rmsnorm_backward in kernels/cpu/ops.h (Hugging Face's RMSNorm).
 *
 * One block per row for the row-wise parts; the row's reductions are fp32
 * per-thread partials combined by a fixed warp-shuffle tree (the CPU sums in
 * double: the two agree to a few ulp of the row's sum for the C of a model).
 * dweight, a sum over all N rows, has an order fixed by the launch shape,
 * so the gradient is the same bits on every run: on the vector path each
 * block of the row pass keeps partial column sums of its rows and
 * bias_grad_f32 (matmul.cu) adds them up (rmsnorm_backward_dwV_f32: one pass
 * over dout and inp); otherwise a separate column-sum kernel, either
 * straight into dweight or by chunks of rows into the backend's scratch
 * that colsum_reduce_f32 (matmul.cu) then adds in chunk order.
 *
 * Rows of up to 1024 channels in the forward, and of up to 256 in the
 * backward (C a multiple of 4, every pointer 16-byte aligned), take the
 * warp-a-row kernels below instead (rmsnorm_*_wV_f32): a row's float4s
 * spread over one warp's lanes, V a lane, its sums a warp's shuffle tree
 * alone — no block barrier between a row's loads and its stores, and V
 * loads of each tensor in flight a lane (a block a row held one, and
 * waited on two barriers a row; at C 128, Qwen3's per-head norms, it
 * also left three of its four warps idle).
 *
 * Not here: fused residual + norm (a bf16-path optimisation for later).
 *
 * Key: N rows, C channels. */
#include "common.cuh"

#define RMS_VEC 4 /* float4s a thread keeps in registers on the vector path */

/* weight * (x * r) of float4 i of a row, each product rounded as the CPU
 * op's (the _rn intrinsics keep nvcc from contracting them) */
static __device__ __forceinline__ float4 rms_scale4(const float *weight, int i, float4 x, float r)
{
	const float4 w = reinterpret_cast<const float4 *>(weight)[i];
	return make_float4(__fmul_rn(w.x, __fmul_rn(x.x, r)), __fmul_rn(w.y, __fmul_rn(x.y, r)),
			   __fmul_rn(w.z, __fmul_rn(x.z, r)), __fmul_rn(w.w, __fmul_rn(x.w, r)));
}

/* rstd[n] = 1/sqrt(mean(inp[n]^2) + eps); out = weight * (inp * rstd).
 * out (N,C), rstd (N) overwrite; out may not alias inp. Rounding as the CPU
 * op: x*r rounded before the multiply by weight (the _rn intrinsics keep
 * nvcc from contracting or approximating). out16: out's bf16 twin, or NULL;
 * out may be NULL when it is not. The sum of squares is fp32 partials over
 * a block-wide tree, in an order fixed by the launch shape. */
extern "C" __global__ void rmsnorm_forward_f32(float *out, __nv_bfloat16 *out16, float *rstd,
					       const float *inp, const float *weight, int N, int C,
					       float eps)
{
	/* The vector path: rows of float4s (C a multiple of 4, every pointer
	 * 16-byte aligned) short enough to stay in registers between the sum
	 * and the scaling, so the row is read once. */
	const bool vec = (C & 3) == 0 && C / 4 <= RMS_VEC * (int)blockDim.x &&
			 (((uintptr_t)inp | (uintptr_t)weight | (uintptr_t)out | (uintptr_t)out16) & 15) == 0;
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const float *x = inp + (size_t)n * C;
		float ss = 0.0f;
		float4 xv[RMS_VEC];
		if (vec) {
#pragma unroll
			for (int k = 0; k < RMS_VEC; k++) {
				const int i = threadIdx.x + k * blockDim.x;
				if (i < C / 4) {
					xv[k] = reinterpret_cast<const float4 *>(x)[i];
					ss += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z +
					      xv[k].w * xv[k].w;
				}
			}
		} else {
			for (int c = threadIdx.x; c < C; c += blockDim.x)
				ss += x[c] * x[c];
		}
		ss = cu_block_sum(ss);
		float var = __fdiv_rn(ss, (float)C);
		float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
		if (vec) {
			const size_t row4 = (size_t)n * (C / 4);
#pragma unroll
			for (int k = 0; k < RMS_VEC; k++) {
				const int i = threadIdx.x + k * blockDim.x;
				if (i < C / 4) {
					cu_put4(out, out16, row4 + i, rms_scale4(weight, i, xv[k], r));
				}
			}
		} else {
			for (int c = threadIdx.x; c < C; c += blockDim.x) {
				cu_put(out, out16, (size_t)n * C + c,
				       __fmul_rn(weight[c], __fmul_rn(x[c], r)));
			}
		}
		if (threadIdx.x == 0)
			rstd[n] = r;
	}
}

/* dinp (N,C) += r*g - x * r^3 * mean(g*x), with g = weight*dout, r = rstd[n].
 * dinp may not alias dout or inp. The vector path as in the forward: the
 * row's x and g stay in registers between the dot product and the update,
 * VEC float4s a thread (the launcher's: the fewest that hold a row, so
 * that the registers of unused ones do not cut the blocks an SM holds —
 * at VEC 4, 56 of them a thread on sm_90). The float4s a thread holds are
 * the same whatever VEC, and so are the sums. */
template <int VEC>
static __device__ __forceinline__ void rms_backward(float *dinp, __nv_bfloat16 *dinp16,
						    const float *dout, const float *inp,
						    const float *weight, const float *rstd, int N,
						    int C)
{
	const bool vec = (C & 3) == 0 && C / 4 <= VEC * (int)blockDim.x &&
			 (((uintptr_t)dinp | (uintptr_t)dout | (uintptr_t)inp | (uintptr_t)weight) & 15) == 0 &&
			 ((uintptr_t)dinp16 & 7) == 0;
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const float *x = inp + (size_t)n * C;
		const float *d = dout + (size_t)n * C;
		float *dx = dinp + (size_t)n * C;
		const float r = rstd[n];
		float dot = 0.0f;
		if (vec) {
			float4 xv[VEC], gv[VEC];
#pragma unroll
			for (int k = 0; k < VEC; k++) {
				const int i = threadIdx.x + k * blockDim.x;
				if (i < C / 4) {
					const float4 w = reinterpret_cast<const float4 *>(weight)[i];
					const float4 dd = reinterpret_cast<const float4 *>(d)[i];
					xv[k] = reinterpret_cast<const float4 *>(x)[i];
					gv[k] = make_float4(w.x * dd.x, w.y * dd.y, w.z * dd.z, w.w * dd.w);
					dot += gv[k].x * xv[k].x + gv[k].y * xv[k].y + gv[k].z * xv[k].z +
					       gv[k].w * xv[k].w;
				}
			}
			dot = cu_block_sum(dot);
			const float kk = dot / (float)C * r * r * r;
#pragma unroll
			for (int k = 0; k < VEC; k++) {
				const int i = threadIdx.x + k * blockDim.x;
				if (i < C / 4) {
					float4 o = reinterpret_cast<float4 *>(dx)[i];
					o.x += r * gv[k].x - kk * xv[k].x;
					o.y += r * gv[k].y - kk * xv[k].y;
					o.z += r * gv[k].z - kk * xv[k].z;
					o.w += r * gv[k].w - kk * xv[k].w;
					reinterpret_cast<float4 *>(dx)[i] = o;
					if (dinp16)
						reinterpret_cast<uint2 *>(dinp16 + (size_t)n * C)[i] =
							cu_pack_bf16x4(o);
				}
			}
			continue;
		}
		for (int c = threadIdx.x; c < C; c += blockDim.x)
			dot += (weight[c] * d[c]) * x[c];
		dot = cu_block_sum(dot);
		const float k = dot / (float)C * r * r * r;
		for (int c = threadIdx.x; c < C; c += blockDim.x) {
			dx[c] += r * (weight[c] * d[c]) - k * x[c];
			if (dinp16)
				dinp16[(size_t)n * C + c] = __float2bfloat16_rn(dx[c]);
		}
	}
}

/* rms_backward's vector path with dweight's partial sums fused in: block b
 * takes rows b, b + G, b + 2G, ... (G = gridDim.x) and, beside each row's
 * dinp, adds dout * (inp * rstd) of its columns into registers, in row
 * order; at the end it writes its partial row part[b * C + c] (every
 * column, zeros where it had no rows). bias_grad_f32 then adds the G
 * partials to dweight in block order. The order is fixed by G, which the
 * launcher derives from N, C and the scratch alone (not from VEC), so
 * dweight is the same bits on every run; one pass over dout and inp
 * instead of two. The launcher uses it only where the vector path applies
 * (its conditions checked there, as rms_backward's here). */
template <int VEC>
static __device__ __forceinline__ void rms_backward_dw(float *dinp, __nv_bfloat16 *dinp16,
						       float *part, const float *dout,
						       const float *inp, const float *weight,
						       const float *rstd, int N, int C)
{
	float4 wacc[VEC];
#pragma unroll
	for (int k = 0; k < VEC; k++)
		wacc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const float *x = inp + (size_t)n * C;
		const float *d = dout + (size_t)n * C;
		float *dx = dinp + (size_t)n * C;
		const float r = rstd[n];
		float dot = 0.0f;
		float4 xv[VEC], gv[VEC];
#pragma unroll
		for (int k = 0; k < VEC; k++) {
			const int i = threadIdx.x + k * blockDim.x;
			if (i < C / 4) {
				const float4 w = reinterpret_cast<const float4 *>(weight)[i];
				const float4 dd = reinterpret_cast<const float4 *>(d)[i];
				xv[k] = reinterpret_cast<const float4 *>(x)[i];
				gv[k] = make_float4(w.x * dd.x, w.y * dd.y, w.z * dd.z, w.w * dd.w);
				dot += gv[k].x * xv[k].x + gv[k].y * xv[k].y + gv[k].z * xv[k].z +
				       gv[k].w * xv[k].w;
				wacc[k].x += dd.x * (xv[k].x * r);
				wacc[k].y += dd.y * (xv[k].y * r);
				wacc[k].z += dd.z * (xv[k].z * r);
				wacc[k].w += dd.w * (xv[k].w * r);
			}
		}
		dot = cu_block_sum(dot);
		const float kk = dot / (float)C * r * r * r;
#pragma unroll
		for (int k = 0; k < VEC; k++) {
			const int i = threadIdx.x + k * blockDim.x;
			if (i < C / 4) {
				float4 o = reinterpret_cast<float4 *>(dx)[i];
				o.x += r * gv[k].x - kk * xv[k].x;
				o.y += r * gv[k].y - kk * xv[k].y;
				o.z += r * gv[k].z - kk * xv[k].z;
				o.w += r * gv[k].w - kk * xv[k].w;
				reinterpret_cast<float4 *>(dx)[i] = o;
				if (dinp16)
					reinterpret_cast<uint2 *>(dinp16 + (size_t)n * C)[i] = cu_pack_bf16x4(o);
			}
		}
	}
#pragma unroll
	for (int k = 0; k < VEC; k++) {
		const int i = threadIdx.x + k * blockDim.x;
		if (i < C / 4)
			reinterpret_cast<float4 *>(part + (size_t)blockIdx.x * C)[i] = wacc[k];
	}
}

#define RMS_BWD(V)                                                                              \
	extern "C" __global__ void rmsnorm_backward##V##_f32(                                   \
		float *dinp, __nv_bfloat16 *dinp16, const float *dout, const float *inp,        \
		const float *weight, const float *rstd, int N, int C)                           \
	{                                                                                       \
		rms_backward<V>(dinp, dinp16, dout, inp, weight, rstd, N, C);                   \
	}                                                                                       \
	extern "C" __global__ void rmsnorm_backward_dw##V##_f32(                                \
		float *dinp, __nv_bfloat16 *dinp16, float *part, const float *dout,             \
		const float *inp, const float *weight, const float *rstd, int N, int C)         \
	{                                                                                       \
		rms_backward_dw<V>(dinp, dinp16, part, dout, inp, weight, rstd, N, C);          \
	}
RMS_BWD(1)
RMS_BWD(2)
RMS_BWD(4)

/* dweight (C) = sum over rows of dout * (inp * rstd), by column tiles: block
 * (32, BY <= 32), grid (ceil(C/32), P). Tile (x, p) sums rows
 * [p*rows_per_part, (p+1)*rows_per_part). With direct != 0 (P == 1) it adds
 * into dst = dweight; otherwise it writes its partial to dst[p*C + c] (the
 * scratch) and colsum_reduce_f32 finishes. */
extern "C" __global__ void rmsnorm_dweight_f32(float *dst, const float *dout, const float *inp,
					       const float *rstd, int N, int C, int rows_per_part,
					       int direct)
{
	const int n0 = blockIdx.y * rows_per_part;
	const int n1 = min(N, n0 + rows_per_part);
	auto term = [=](int n, int c) {
		size_t i = (size_t)n * C + c;
		return dout[i] * (inp[i] * rstd[n]);
	};
	float sum = cu_colsum_tile(term, n0, n1, C);
	const int c = blockIdx.x * 32 + threadIdx.x;
	if (threadIdx.y != 0 || c >= C)
		return;
	if (direct)
		dst[c] += sum;
	else
		dst[(size_t)blockIdx.y * C + c] = sum;
}

/* ------------------------------------------------ warp-a-row kernels -- */

/* Blocks of 8 warps (the launcher's RMS_WARP_ROWS). Rows of C = 4 * C4 <= 128 * V channels, one warp each (row n to warp n
 * of the grid's, striding by the grid's warps); float4 i of a row is lane
 * i % 32's, its k = i / 32-th. The same arithmetic per value as the block
 * kernels above; a row's sums are each lane's float4s in k order, then the
 * warp's xor tree (an order fixed by C: the same bits on every run). */
template <int V>
static __device__ __forceinline__ void rms_fwd_warp(float *out, __nv_bfloat16 *out16, float *rstd,
						    const float *inp, const float *weight, int N,
						    int C, float eps)
{
	const int lane = threadIdx.x & 31, C4 = C / 4, wpb = blockDim.x / 32;
	for (int n = blockIdx.x * wpb + threadIdx.x / 32; n < N; n += gridDim.x * wpb) {
		const float4 *x = reinterpret_cast<const float4 *>(inp + (size_t)n * C);
		float4 xv[V];
		float ss = 0.0f;
#pragma unroll
		for (int k = 0; k < V; k++) {
			const int i = lane + 32 * k;
			if (i < C4) {
				xv[k] = x[i];
				ss += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z +
				      xv[k].w * xv[k].w;
			}
		}
		ss = cu_warp_sum(ss);
		const float var = __fdiv_rn(ss, (float)C);
		const float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
		const size_t row4 = (size_t)n * C4;
#pragma unroll
		for (int k = 0; k < V; k++) {
			const int i = lane + 32 * k;
			if (i < C4) {
				cu_put4(out, out16, row4 + i, rms_scale4(weight, i, xv[k], r));
			}
		}
		if (lane == 0)
			rstd[n] = r;
	}
}

/* dinp += as rms_backward's; block b's warp w takes rows 8 b + w, 8 b +
 * w + 8 G, ... (G blocks, 8 warps each: RMS_WARP_ROWS of the launcher).
 * With part (not NULL), also dweight's partial row of the block's rows:
 * each warp adds dout * (inp * rstd) of its rows in row order (into its
 * row of shared memory), then the
 * block adds its warps' in warp order into part[b * C + c] (bias_grad_f32
 * then adds the G rows in block order). G comes from the launcher's N, C
 * and scratch alone: the same order on every run. */
template <int V>
static __device__ __forceinline__ void rms_bwd_warp(float *dinp, __nv_bfloat16 *dinp16, float *part,
						    const float *dout, const float *inp,
						    const float *weight, const float *rstd, int N,
						    int C)
{
	const int lane = threadIdx.x & 31, w = threadIdx.x / 32, C4 = C / 4;
	/* warp w's partial row (its lanes' own float4s: no barrier until the
	 * block's sum), in shared memory rather than registers: 32 V more a
	 * thread would cut the blocks an SM holds to one */
	__shared__ float4 red[8][32 * V];
	if (part)
#pragma unroll
		for (int k = 0; k < V; k++)
			red[w][lane + 32 * k] = make_float4(0.f, 0.f, 0.f, 0.f);
	for (int n = blockIdx.x * 8 + w; n < N; n += gridDim.x * 8) {
		const float4 *x = reinterpret_cast<const float4 *>(inp + (size_t)n * C);
		const float4 *d = reinterpret_cast<const float4 *>(dout + (size_t)n * C);
		float4 *dx = reinterpret_cast<float4 *>(dinp + (size_t)n * C);
		const float r = rstd[n];
		float dot = 0.0f;
		float4 xv[V], gv[V];
#pragma unroll
		for (int k = 0; k < V; k++) {
			const int i = lane + 32 * k;
			if (i < C4) {
				const float4 wt = reinterpret_cast<const float4 *>(weight)[i];
				const float4 dd = d[i];
				xv[k] = x[i];
				gv[k] = make_float4(wt.x * dd.x, wt.y * dd.y, wt.z * dd.z, wt.w * dd.w);
				dot += gv[k].x * xv[k].x + gv[k].y * xv[k].y + gv[k].z * xv[k].z +
				       gv[k].w * xv[k].w;
				if (part) {
					float4 a = red[w][i];
					a.x += dd.x * (xv[k].x * r);
					a.y += dd.y * (xv[k].y * r);
					a.z += dd.z * (xv[k].z * r);
					a.w += dd.w * (xv[k].w * r);
					red[w][i] = a;
				}
			}
		}
		dot = cu_warp_sum(dot);
		const float kk = dot / (float)C * r * r * r;
#pragma unroll
		for (int k = 0; k < V; k++) {
			const int i = lane + 32 * k;
			if (i < C4) {
				float4 o = dx[i];
				o.x += r * gv[k].x - kk * xv[k].x;
				o.y += r * gv[k].y - kk * xv[k].y;
				o.z += r * gv[k].z - kk * xv[k].z;
				o.w += r * gv[k].w - kk * xv[k].w;
				dx[i] = o;
				if (dinp16)
					reinterpret_cast<uint2 *>(dinp16 + (size_t)n * C)[i] = cu_pack_bf16x4(o);
			}
		}
	}
	if (!part)
		return;
	__syncthreads();
	for (int i = threadIdx.x; i < C4; i += blockDim.x) {
		float4 t = red[0][i];
		for (int j = 1; j < 8; j++) {
			t.x += red[j][i].x;
			t.y += red[j][i].y;
			t.z += red[j][i].z;
			t.w += red[j][i].w;
		}
		reinterpret_cast<float4 *>(part + (size_t)blockIdx.x * C)[i] = t;
	}
}

#define RMS_WARP_FWD(V)                                                                         \
	extern "C" __global__ void rmsnorm_forward_w##V##_f32(                                   \
		float *out, __nv_bfloat16 *out16, float *rstd, const float *inp, const float *weight, \
		int N, int C, float eps)                                                        \
	{                                                                                       \
		rms_fwd_warp<V>(out, out16, rstd, inp, weight, N, C, eps);                      \
	}
#define RMS_WARP_BWD(V)                                                                         \
	extern "C" __global__ void rmsnorm_backward_w##V##_f32(                                  \
		float *dinp, __nv_bfloat16 *dinp16, float *part, const float *dout,             \
		const float *inp, const float *weight, const float *rstd, int N, int C)         \
	{                                                                                       \
		rms_bwd_warp<V>(dinp, dinp16, part, dout, inp, weight, rstd, N, C);             \
	}
/* the backward for rows of up to 256 channels only (the launcher's) */
RMS_WARP_FWD(1) RMS_WARP_FWD(2) RMS_WARP_FWD(4) RMS_WARP_FWD(8)
RMS_WARP_BWD(1) RMS_WARP_BWD(2)
