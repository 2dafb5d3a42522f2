/* The row-wise parts of causal attention, fp32: the softmax of
 * attention_forward and its backward in attention_backward
 * (kernels/cpu/ops.h). The products around them (S = Q K^T * scale, out =
 * P V, dP = dout V^T, dQ, dK, dV) are cuBLAS strided-batched GEMMs in
 * gpu/cuda/cuda_ops.c, which also sums dK and dV over the query heads of a
 * kv group in a fixed order.
 *
 * att (B,NH,T,T) holds rows of T scores; row r is query position
 * t = r % T, which sees keys s <= t. The GEMM fills the whole row; these
 * kernels own the upper triangle and write it as 0, as the CPU op does.
 * One warp per row (warps in a block take consecutive rows), grid-stride over
 * rows; the row's reductions are fp32 lane partials merged by a shuffle tree
 * (the CPU sums in double).
 *
 * Not here: a flash-style fused kernel that never stores (T,T); that comes
 * with the bf16 path.
 *
 * Key: B batch, T sequence, NH query heads. rows = B*NH*T. */
#include "common.cuh"

/* In place: att[r, s] = softmax over s <= t of att[r, :t+1], 0 for s > t.
 * Max-subtracted; the sum of exp is taken before any element is written. */
extern "C" __global__ void attention_softmax_f32(float *att, size_t rows, int T)
{
	const int lane = threadIdx.x & 31;
	const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
	for (size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows;
	     r += warps) {
		const int t = (int)(r % (size_t)T);
		float *row = att + r * T;
		float m = -INFINITY, s = 0.0f;
		for (int j = lane; j <= t; j += 32)
			cu_ms_push(m, s, row[j]);
		cu_warp_ms(m, s);
		const float inv = 1.0f / s;
		for (int j = lane; j < T; j += 32)
			row[j] = j <= t ? expf(row[j] - m) * inv : 0.0f;
	}
}

/* In place on datt: dS[r, s] = P[r, s] * (dP[r, s] - sum_{s'<=t} P dP) for
 * s <= t, 0 above. datt holds dP on entry and dS on exit; att holds P. */
extern "C" __global__ void attention_softmax_backward_f32(float *datt, const float *att,
							  size_t rows, int T)
{
	const int lane = threadIdx.x & 31;
	const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
	for (size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows;
	     r += warps) {
		const int t = (int)(r % (size_t)T);
		float *d = datt + r * T;
		const float *p = att + r * T;
		float dot = 0.0f;
		for (int j = lane; j <= t; j += 32)
			dot += p[j] * d[j];
		dot = cu_warp_sum(dot);
		for (int j = lane; j < T; j += 32)
			d[j] = j <= t ? p[j] * (d[j] - dot) : 0.0f;
	}
}
