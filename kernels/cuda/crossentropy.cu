/* Cross-entropy over the vocabulary, fp32: the CUDA twins of
 * crossentropy_forward / crossentropy_backward in kernels/cpu/ops.h, fused
 * with the softmax so that no probability tensor is stored.
 *
 * One block per row of V logits (V up to ~152k), grid-stride over rows. The
 * row's max and sum of exp come from one online pass (ce_row_ms) (cu_ms_push: running
 * max, sum rescaled when the max grows), merged by a fixed tree over the
 * block; each exp is fp32 and the sum double, as the CPU op sums (a thread
 * adds ~300 terms of a 152k row, whose fp32 sum would drift by ~1e-6). The
 * _bf16 kernels read bf16 logits (the bf16 mode's head GEMM writes them, as
 * transformers' head does under autocast), widened: the same fp32/double
 * math on the rounded values. The backward pass may run in place (dlogits ==
 * logits, or dlogits16 == logits16): every read of the normalising pass
 * happens before the block barrier inside cu_block_ms, and afterwards each
 * element is read by the one thread that then writes it.
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

static __device__ __forceinline__ float ce_grad(float x, float m, float inv, float dloss, int i,
						int tgt)
{
	const float g = dloss * (expf(x - m) * inv);
	return i == tgt ? g - dloss : g;
}

/* ce_row_ms over a row of bf16 logits: eight values a load (rows whose
 * start is 16-byte aligned: V a multiple of 8), two loads in flight. The
 * order of the pushes is a function of (V, blockDim) only. */
static __device__ __forceinline__ void ce_row_ms(const __nv_bfloat16 *x, int V, float &m,
						 double &s)
{
	m = -INFINITY;
	s = 0.0;
	int i = threadIdx.x;
	if (((uintptr_t)x & 15) == 0) {
		const uint4 *x8 = reinterpret_cast<const uint4 *>(x);
		const int V8 = V / 8, step = blockDim.x;
		float f[8];
		for (; i + step < V8; i += 2 * step) {
			const uint4 a = x8[i], b = x8[i + step];
			cu_widen_bf16x8(a, f);
#pragma unroll
			for (int k = 0; k < 8; k++)
				cu_ms_push(m, s, f[k]);
			cu_widen_bf16x8(b, f);
#pragma unroll
			for (int k = 0; k < 8; k++)
				cu_ms_push(m, s, f[k]);
		}
		if (i < V8) {
			cu_widen_bf16x8(x8[i], f);
#pragma unroll
			for (int k = 0; k < 8; k++)
				cu_ms_push(m, s, f[k]);
		}
		i = V8 * 8 + threadIdx.x;
	}
	for (; i < V; i += blockDim.x)
		cu_ms_push(m, s, __bfloat162float(x[i]));
	cu_block_ms(m, s);
}

/* A logit as a float (bf16 widened). */
static __device__ __forceinline__ float ce_at(const float *x, int i)
{
	return x[i];
}

static __device__ __forceinline__ float ce_at(const __nv_bfloat16 *x, int i)
{
	return __bfloat162float(x[i]);
}

/* losses[n] = logsumexp(logits[n]) - logits[n][targets[n]], 0 where -100. */
template <typename T>
static __device__ __forceinline__ void ce_forward(float *losses, const T *logits,
						  const int32_t *targets, int N, int V)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		if (tgt == -100) { /* block-uniform */
			if (threadIdx.x == 0)
				losses[n] = 0.0f;
			continue;
		}
		const T *x = logits + (size_t)n * V;
		float m;
		double s;
		ce_row_ms(x, V, m, s);
		if (threadIdx.x == 0) {
			bool ok = tgt >= 0 && tgt < V;
			/* the final combine in double, as the CPU forms it */
			losses[n] = ok ? (float)((double)m + log(s) - (double)ce_at(x, ok ? tgt : 0))
				       : NAN;
		}
	}
}

/* The gradient of one row, written by the thread that read each logit:
 * four floats a load (16-byte aligned rows) or eight bf16 values. */
static __device__ __forceinline__ void ce_grad_row(const float *x, float *d, __nv_bfloat16 *d16,
						   int V, float m, float inv, float dloss, int tgt)
{
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

static __device__ __forceinline__ void ce_grad_row(const __nv_bfloat16 *x, float *d,
						   __nv_bfloat16 *d16, int V, float m, float inv,
						   float dloss, int tgt)
{
	int i = threadIdx.x;
	if ((((uintptr_t)x | (uintptr_t)d | (uintptr_t)d16) & 15) == 0) {
		const uint4 *x8 = reinterpret_cast<const uint4 *>(x);
		for (; i < V / 8; i += blockDim.x) {
			float f[8];
			cu_widen_bf16x8(x8[i], f);
			const int j = 8 * i;
			const float4 g0 = make_float4(ce_grad(f[0], m, inv, dloss, j, tgt),
						      ce_grad(f[1], m, inv, dloss, j + 1, tgt),
						      ce_grad(f[2], m, inv, dloss, j + 2, tgt),
						      ce_grad(f[3], m, inv, dloss, j + 3, tgt));
			const float4 g1 = make_float4(ce_grad(f[4], m, inv, dloss, j + 4, tgt),
						      ce_grad(f[5], m, inv, dloss, j + 5, tgt),
						      ce_grad(f[6], m, inv, dloss, j + 6, tgt),
						      ce_grad(f[7], m, inv, dloss, j + 7, tgt));
			if (d) {
				cu_put4(d, d16, 2 * i, g0);
				cu_put4(d, d16, 2 * i + 1, g1);
			} else if (d16) { /* one 16-byte store */
				const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
				reinterpret_cast<uint4 *>(d16)[i] = cu_pack_bf16x8(g);
			}
		}
		i = V / 8 * 8 + threadIdx.x;
	}
	for (; i < V; i += blockDim.x)
		cu_put(d, d16, i, ce_grad(__bfloat162float(x[i]), m, inv, dloss, i, tgt));
}

/* dlogits[n] = dloss * (softmax(logits[n]) - onehot(targets[n])), 0 where
 * -100. Overwrite; dlogits may alias fp32 logits, dlogits16 bf16 ones (each
 * element read, after the row's barrier, by the thread that then writes it).
 * losses: NULL, or also the forward's losses (the target's logit is read
 * before the row's barrier, so before any thread overwrites it in place).
 * dlogits16: the gradient's bf16 twin, or NULL; dlogits may be NULL when it
 * is not. */
template <typename T>
static __device__ __forceinline__ void ce_backward(float *losses, float *dlogits,
						   __nv_bfloat16 *dlogits16, const T *logits,
						   const int32_t *targets, float dloss, int N, int V)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		float *d = dlogits ? dlogits + (size_t)n * V : NULL;
		__nv_bfloat16 *d16 = dlogits16 ? dlogits16 + (size_t)n * V : NULL;
		if (tgt == -100) { /* block-uniform; zeros read nothing */
			if (losses && threadIdx.x == 0)
				losses[n] = 0.0f;
			for (int i = threadIdx.x; i < V; i += blockDim.x)
				cu_put(d, d16, i, 0.0f);
			/* the next row's reads are of other bytes: no barrier */
			continue;
		}
		const T *x = logits + (size_t)n * V;
		const bool ok = tgt >= 0 && tgt < V;
		const float xt = losses && threadIdx.x == 0 ? ce_at(x, ok ? tgt : 0) : 0.0f;
		float m;
		double s;
		ce_row_ms(x, V, m, s);
		if (losses && threadIdx.x == 0) /* as ce_forward */
			losses[n] = ok ? (float)((double)m + log(s) - (double)xt) : NAN;
		const float inv = ok ? (float)(1.0 / s) : NAN;
		ce_grad_row(x, d, d16, V, m, inv, dloss, tgt);
	}
}

extern "C" __global__ void crossentropy_forward_f32(float *losses, const float *logits,
						    const int32_t *targets, int N, int V)
{
	ce_forward(losses, logits, targets, N, V);
}

extern "C" __global__ void crossentropy_forward_bf16(float *losses, const __nv_bfloat16 *logits,
						     const int32_t *targets, int N, int V)
{
	ce_forward(losses, logits, targets, N, V);
}

extern "C" __global__ void crossentropy_backward_f32(float *losses, float *dlogits,
						     __nv_bfloat16 *dlogits16, const float *logits,
						     const int32_t *targets, float dloss, int N, int V)
{
	ce_backward(losses, dlogits, dlogits16, logits, targets, dloss, N, V);
}

extern "C" __global__ void crossentropy_backward_bf16(float *losses, float *dlogits,
						      __nv_bfloat16 *dlogits16,
						      const __nv_bfloat16 *logits,
						      const int32_t *targets, float dloss, int N, int V)
{
	ce_backward(losses, dlogits, dlogits16, logits, targets, dloss, N, V);
}
