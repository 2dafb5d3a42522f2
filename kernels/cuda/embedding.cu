/* Embedding lookup and its gradient, fp32: the CUDA twins of
 * embedding_forward / embedding_backward and of their parts,
 * embedding_forward_part / embedding_backward_part, in kernels/cpu/ops.h.
 * The lookup also reads a table stored in bf16 (a frozen embedding in the
 * bf16 mode). A part is the elements [lo, hi) of the flat (V,C) table (a
 * data-parallel rank's, which may cut a row); the whole table's backward
 * is the part [0, SIZE_MAX).
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

/* out (N,C) = the part's element (part[e - lo] for e = ids[n] * C + c in
 * [lo, hi)), else 0. Overwrite. */
extern "C" __global__ void embedding_forward_part_f32(float *out, const int32_t *ids,
						      const float *part, int N, int C, size_t lo,
						      size_t hi)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		float *dst = out + (size_t)n * C;
		const size_t e0 = (size_t)ids[n] * (size_t)C;
		for (int c = threadIdx.x; c < C; c += blockDim.x) {
			const size_t e = e0 + (size_t)c;
			dst[c] = e >= lo && e < hi ? part[e - lo] : 0.0f;
		}
	}
}

/* The part [lo, hi) of dwte (element e at dwte[e - lo]) += scatter of
 * dout (N,C) by ids, in increasing n per id; a row's elements outside the
 * part are skipped (a row outside it wholly, at once). */
extern "C" __global__ void embedding_backward_f32(float *dwte, const float *dout,
						  const int32_t *ids, int N, int C, size_t lo,
						  size_t hi)
{
	__shared__ int rows[1024];    /* rows m of this id in the current segment, ascending */
	__shared__ int warp_hits[32]; /* matches per warp in the current segment */
	const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
	const int nwarps = blockDim.x >> 5;
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t id = ids[n];
		const size_t e0 = (size_t)id * (size_t)C;
		if (e0 + (size_t)C <= lo || e0 >= hi)
			continue; /* block-uniform: the row is not the part's */
		const int c0 = e0 >= lo ? 0 : (int)(lo - e0);
		const int c1 = e0 + (size_t)C <= hi ? C : (int)(hi - e0);
		/* Is there an m < n with the same id? Then that row's block owns it.
		 * seen is block-uniform (it comes from __syncthreads_or). */
		int seen = 0;
		for (int base = 0; base < n && !seen; base += blockDim.x) {
			int m = base + threadIdx.x;
			seen = __syncthreads_or(m < n && ids[m] == id);
		}
		if (seen)
			continue;
		float *dst = dwte + (e0 + (size_t)c0 - lo); /* dst[c - c0]: element e0 + c */
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
			for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
				float acc = dst[c - c0];
				for (int j = 0; j < total; j++)
					acc += dout[(size_t)rows[j] * C + c];
				dst[c - c0] = acc;
			}
		}
	}
}
