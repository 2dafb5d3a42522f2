/* RMSNorm forward and backward, fp32: the CUDA twins of rmsnorm_forward /
 * rmsnorm_backward in kernels/cpu/ops.h (Hugging Face's RMSNorm).
 *
 * One block per row for the row-wise parts; the row's reductions are fp32
 * per-thread partials combined by a fixed warp-shuffle tree (the CPU sums in
 * double: the two agree to a few ulp of the row's sum for the C of a model).
 * dweight, a sum over all N rows, is a separate column-sum kernel whose
 * order is fixed by its launch shape, so the gradient is the same bits on
 * every run: either one pass straight into dweight, or partial sums per
 * chunk of rows into the backend's scratch that colsum_reduce_f32
 * (matmul.cu) then adds to dweight in chunk order.
 *
 * Not here: fused residual + norm (a bf16-path optimisation for later).
 *
 * Key: N rows, C channels. */
#include "common.cuh"

#include <cuda_bf16.h>

/* rstd[n] = 1/sqrt(mean(inp[n]^2) + eps); out = weight * (inp * rstd).
 * out (N,C), rstd (N) overwrite; out may not alias inp. Rounding as the CPU
 * op: x*r rounded before the multiply by weight (the _rn intrinsics keep
 * nvcc from contracting or approximating). out16: out's bf16 twin, or NULL;
 * out may be NULL when it is not. */
extern "C" __global__ void rmsnorm_forward_f32(float *out, __nv_bfloat16 *out16, float *rstd,
					       const float *inp, const float *weight, int N, int C,
					       float eps)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const float *x = inp + (size_t)n * C;
		float ss = 0.0f;
		for (int c = threadIdx.x; c < C; c += blockDim.x)
			ss += x[c] * x[c];
		ss = cu_block_sum(ss);
		float var = __fdiv_rn(ss, (float)C);
		float r = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(var, eps)));
		for (int c = threadIdx.x; c < C; c += blockDim.x) {
			const float y = __fmul_rn(weight[c], __fmul_rn(x[c], r));
			if (out)
				out[(size_t)n * C + c] = y;
			if (out16)
				out16[(size_t)n * C + c] = __float2bfloat16_rn(y);
		}
		if (threadIdx.x == 0)
			rstd[n] = r;
	}
}

/* dinp (N,C) += r*g - x * r^3 * mean(g*x), with g = weight*dout, r = rstd[n].
 * dinp may not alias dout or inp. */
extern "C" __global__ void rmsnorm_backward_f32(float *dinp, const float *dout, const float *inp,
						const float *weight, const float *rstd, int N, int C)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const float *x = inp + (size_t)n * C;
		const float *d = dout + (size_t)n * C;
		float *dx = dinp + (size_t)n * C;
		const float r = rstd[n];
		float dot = 0.0f;
		for (int c = threadIdx.x; c < C; c += blockDim.x)
			dot += (weight[c] * d[c]) * x[c];
		dot = cu_block_sum(dot);
		const float k = dot / (float)C * r * r * r;
		for (int c = threadIdx.x; c < C; c += blockDim.x)
			dx[c] += r * (weight[c] * d[c]) - k * x[c];
	}
}

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
