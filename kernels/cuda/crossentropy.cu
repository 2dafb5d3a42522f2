/* Cross-entropy over the vocabulary, fp32: the CUDA twins of
 * crossentropy_forward / crossentropy_backward in kernels/cpu/ops.h, fused
 * with the softmax so that no probability tensor is stored.
 *
 * One block per row of V logits (V up to ~152k), grid-stride over rows. The
 * row's max and sum of exp come from one online pass (ce_row_ms) (cu_ms_push: running
 * max, sum rescaled when the max grows), merged by a fixed tree over the
 * block; each exp is fp32 and the sum double, as the CPU op sums (a thread
 * adds ~300 terms of a 152k row, whose fp32 sum would drift by ~1e-6). The backward pass may run in place (dlogits == logits): every read of
 * the normalising pass happens before the block barrier inside cu_block_ms,
 * and afterwards each element is read by the one thread that then writes it.
 * A row whose target is -100 gives loss 0 and a zero gradient row.
 *
 * Key: N rows, V vocab. logits (N,V) with N*V beyond 2^31 (64-bit offsets);
 * targets (N) in [0, V) or -100. A target outside both (a caller bug the CPU
 * op asserts on) gives NaN, which the engine's loss check reports. */
#include "common.cuh"

/* The row's (max, sum of exp) over the block. Rows whose start is 16-byte
 * aligned (V a multiple of 4) are read four floats a load, two loads in
 * flight: a row pass is bound by how many bytes each thread has outstanding.
 * The order of the pushes is a function of (V, blockDim) only. */
static __device__ __forceinline__ void ce_row_ms(const float *x, int V, float &m, double &s)
{
	m = -INFINITY;
	s = 0.0;
	int i = threadIdx.x;
	if (((uintptr_t)x & 15) == 0) {
		const float4 *x4 = reinterpret_cast<const float4 *>(x);
		const int V4 = V / 4, step = blockDim.x;
		for (; i + step < V4; i += 2 * step) {
			const float4 a = x4[i], b = x4[i + step];
			cu_ms_push(m, s, a.x), cu_ms_push(m, s, a.y);
			cu_ms_push(m, s, a.z), cu_ms_push(m, s, a.w);
			cu_ms_push(m, s, b.x), cu_ms_push(m, s, b.y);
			cu_ms_push(m, s, b.z), cu_ms_push(m, s, b.w);
		}
		if (i < V4) {
			const float4 a = x4[i];
			cu_ms_push(m, s, a.x), cu_ms_push(m, s, a.y);
			cu_ms_push(m, s, a.z), cu_ms_push(m, s, a.w);
		}
		i = V4 * 4 + threadIdx.x;
	}
	for (; i < V; i += blockDim.x)
		cu_ms_push(m, s, x[i]);
	cu_block_ms(m, s);
}

/* losses[n] = logsumexp(logits[n]) - logits[n][targets[n]], 0 where -100. */
extern "C" __global__ void crossentropy_forward_f32(float *losses, const float *logits,
						    const int32_t *targets, int N, int V)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		if (tgt == -100) { /* block-uniform */
			if (threadIdx.x == 0)
				losses[n] = 0.0f;
			continue;
		}
		const float *x = logits + (size_t)n * V;
		float m;
		double s;
		ce_row_ms(x, V, m, s);
		if (threadIdx.x == 0) {
			bool ok = tgt >= 0 && tgt < V;
			/* the final combine in double, as the CPU forms it */
			losses[n] = ok ? (float)((double)m + log(s) - (double)x[ok ? tgt : 0])
				       : NAN;
		}
	}
}

static __device__ __forceinline__ float ce_grad(float x, float m, float inv, float dloss, int i,
						int tgt)
{
	const float g = dloss * (expf(x - m) * inv);
	return i == tgt ? g - dloss : g;
}

/* dlogits[n] = dloss * (softmax(logits[n]) - onehot(targets[n])), 0 where
 * -100. Overwrite; dlogits may alias logits. losses: NULL, or also the
 * forward's losses (the target's logit is read before the row's barrier, so
 * before any thread overwrites it in place). dlogits16: the gradient's bf16
 * twin, or NULL; dlogits may be NULL when it is not. dlogits16 == logits
 * (and dlogits NULL): the bf16 gradient in place over the logits, row n's
 * in the first half of that row's fp32 bytes (rows 2V bf16 values apart):
 * element j's bf16 lands on the bytes of float j / 2, which the same thread
 * round or an earlier one has read, so each round reads, meets a block
 * barrier, then writes (ce_grad_rounds). */
/* The bf16 gradient of one row in place over its fp32 logits: rounds of
 * CE_ROUND float4s a thread (then of single floats for the V % 4 tail, or
 * for all of a row that is not 16-byte aligned), each read before a block
 * barrier and written after it, several loads in flight a thread. Round r
 * covers float4s [r K, (r + 1) K), K = CE_ROUND blockDim.x; its writes land
 * on float4s of indices under (r + 1) K / 2, read in round r or before; the
 * tail's, on floats the vector rounds read (V >= 8) or the tail round
 * itself. Every thread runs every round (the barrier's condition). */
#define CE_ROUND 4
static __device__ __forceinline__ void ce_grad_rounds(const float *x, __nv_bfloat16 *d16, int V,
						      float m, float inv, float dloss, int tgt)
{
	int start = 0;
	if (((uintptr_t)x & 15) == 0) {
		const float4 *x4 = reinterpret_cast<const float4 *>(x);
		const int V4 = V / 4, step = blockDim.x;
		for (int base = 0; base < V4; base += CE_ROUND * step) {
			float4 g[CE_ROUND];
#pragma unroll
			for (int u = 0; u < CE_ROUND; u++) {
				const int i = base + u * step + threadIdx.x, j = 4 * i;
				if (i < V4) {
					const float4 a = x4[i];
					g[u] = make_float4(ce_grad(a.x, m, inv, dloss, j, tgt),
							   ce_grad(a.y, m, inv, dloss, j + 1, tgt),
							   ce_grad(a.z, m, inv, dloss, j + 2, tgt),
							   ce_grad(a.w, m, inv, dloss, j + 3, tgt));
				}
			}
			__syncthreads();
#pragma unroll
			for (int u = 0; u < CE_ROUND; u++) {
				const int i = base + u * step + threadIdx.x;
				if (i < V4)
					cu_put4(NULL, d16, i, g[u]);
			}
		}
		start = V4 * 4;
	}
	for (int base = start; base < V; base += blockDim.x) {
		const int i = base + threadIdx.x;
		const float g = i < V ? ce_grad(x[i], m, inv, dloss, i, tgt) : 0.0f;
		__syncthreads();
		if (i < V)
			cu_put(NULL, d16, i, g);
	}
}

extern "C" __global__ void crossentropy_backward_f32(float *losses, float *dlogits,
						     __nv_bfloat16 *dlogits16, const float *logits,
						     const int32_t *targets, float dloss, int N, int V)
{
	/* block-uniform: the bf16 gradient over the logits (see above) */
	const bool over = dlogits16 && (const void *)dlogits16 == (const void *)logits;
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		float *d = dlogits ? dlogits + (size_t)n * V : NULL;
		__nv_bfloat16 *d16 =
			!dlogits16 ? NULL
			: over	   ? reinterpret_cast<__nv_bfloat16 *>(
				       reinterpret_cast<float *>(dlogits16) + (size_t)n * V)
				   : dlogits16 + (size_t)n * V;
		if (tgt == -100) { /* block-uniform; zeros read nothing */
			if (losses && threadIdx.x == 0)
				losses[n] = 0.0f;
			for (int i = threadIdx.x; i < V; i += blockDim.x)
				cu_put(d, d16, i, 0.0f);
			/* the next row's reads are of other bytes: no barrier */
			continue;
		}
		const float *x = logits + (size_t)n * V;
		const bool ok = tgt >= 0 && tgt < V;
		const float xt = losses && threadIdx.x == 0 ? x[ok ? tgt : 0] : 0.0f;
		float m;
		double s;
		ce_row_ms(x, V, m, s);
		if (losses && threadIdx.x == 0) /* as crossentropy_forward_f32 */
			losses[n] = ok ? (float)((double)m + log(s) - (double)xt) : NAN;
		const float inv = ok ? (float)(1.0 / s) : NAN;
		if (over) {
			ce_grad_rounds(x, d16, V, m, inv, dloss, tgt);
			continue;
		}
		int i = threadIdx.x;
		if ((((uintptr_t)x | (uintptr_t)d | (uintptr_t)d16) & 15) == 0) {
			const float4 *x4 = reinterpret_cast<const float4 *>(x);
			for (; i < V / 4; i += blockDim.x) {
				const float4 a = x4[i];
				const int j = 4 * i;
				const float4 g = make_float4(ce_grad(a.x, m, inv, dloss, j, tgt),
							     ce_grad(a.y, m, inv, dloss, j + 1, tgt),
							     ce_grad(a.z, m, inv, dloss, j + 2, tgt),
							     ce_grad(a.w, m, inv, dloss, j + 3, tgt));
				cu_put4(d, d16, i, g);
			}
			i = V / 4 * 4 + threadIdx.x;
		}
		for (; i < V; i += blockDim.x)
			cu_put(d, d16, i, ce_grad(x[i], m, inv, dloss, i, tgt));
	}
}
