/* Embedding lookup and its gradient, fp32: the CUDA twins of
 * embedding_forward / embedding_backward in kernels/cpu/ops.h. The lookup
 * also reads a table stored in bf16 (a frozen embedding in the bf16 mode).
 *
 * The backward pass is deterministic without sorting and without float
 * atomics: the block that owns row n first checks that n is the first
 * occurrence of its id, and if so folds every row m >= n with that id into
 * dwte[id] in increasing m, starting from dwte[id]'s old value — exactly the
 * CPU's order, so the result is bit-identical to it. Exactly one block writes
 * each touched dwte row. The price is a scan of the ids per row (O(N^2) cheap
 * integer compares, ~N^2/blockDim barriers in all), which is small next to
 * the (N, C) traffic for the N of a training step (a few thousand tokens); it
 * is not meant for N in the millions.
 *
 * Key: N = B*T rows, C channels, V vocab. ids (N) are in [0, V) (the caller
 * has checked). Launch (gpu/cuda/cuda_ops.c): one block per row, grid-stride
 * over rows, blockDim a multiple of 32 and at most 1024. */
#include "common.cuh"

/* out (N,C) = wte[ids[n]], or from wte16 (a table stored in bf16 only, each
 * value widened exactly) when wte is NULL. Overwrite. */
extern "C" __global__ void embedding_forward_f32(float *out, const int32_t *ids, const float *wte,
						 const __nv_bfloat16 *wte16, int N, int C)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		float *dst = out + (size_t)n * C;
		if (!wte) { /* grid-uniform */
			const __nv_bfloat16 *src = wte16 + (size_t)ids[n] * C;
			for (int c = threadIdx.x; c < C; c += blockDim.x)
				dst[c] = __bfloat162float(src[c]);
			continue;
		}
		const float *src = wte + (size_t)ids[n] * C;
		for (int c = threadIdx.x; c < C; c += blockDim.x)
			dst[c] = src[c];
	}
}

/* dwte (V,C) += scatter of dout (N,C) by ids, in increasing n per id. */
extern "C" __global__ void embedding_backward_f32(float *dwte, const float *dout,
						  const int32_t *ids, int N, int C)
{
	__shared__ int rows[1024];    /* rows m of this id in the current segment, ascending */
	__shared__ int warp_hits[32]; /* matches per warp in the current segment */
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int nwarps = blockDim.x >> 5;
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t id = ids[n];
		/* Is there an m < n with the same id? Then that row's block owns it.
		 * seen is block-uniform (it comes from __syncthreads_or). */
		int seen = 0;
		for (int base = 0; base < n && !seen; base += blockDim.x) {
			int m = base + threadIdx.x;
			seen = __syncthreads_or(m < n && ids[m] == id);
		}
		if (seen)
			continue;
		float *dst = dwte + (size_t)id * C;
		for (int base = n; base < N; base += blockDim.x) {
			int m = base + threadIdx.x;
			bool hit = m < N && ids[m] == id;
			unsigned mask = __ballot_sync(CU_FULL_MASK, hit);
			__syncthreads(); /* the previous segment is done with rows[] */
			if (lane == 0)
				warp_hits[warp] = __popc(mask);
			__syncthreads();
			int before = 0, total = 0;
			for (int w = 0; w < nwarps; w++) {
				before += w < warp ? warp_hits[w] : 0;
				total += warp_hits[w];
			}
			if (hit)
				rows[before + __popc(mask & ((1u << lane) - 1u))] = m;
			__syncthreads();
			if (total == 0)
				continue; /* block-uniform */
			for (int c = threadIdx.x; c < C; c += blockDim.x) {
				float acc = dst[c];
				for (int j = 0; j < total; j++)
					acc += dout[(size_t)rows[j] * C + c];
				dst[c] = acc;
			}
		}
	}
}
