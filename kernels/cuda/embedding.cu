/* Embedding lookup and its gradient, fp32: the CUDA twins of
 * embedding_forward / embedding_backward and of their parts,
 * embedding_forward_part / embedding_backward_part, in kernels/cpu/ops.h.
 * The lookup also reads a table stored in bf16 (a frozen embedding in the
 * bf16 mode). A part is the elements [lo, hi) of the flat (V,C) table (a
 * data-parallel rank's, which may cut a row); the whole table's backward
 * is the part [0, SIZE_MAX).
 *
 * The backward pass is deterministic without float atomics, and folds every
 * row with a given id into dwte[id] in increasing row order, starting from
 * dwte[id]'s old value — exactly the CPU's order, so the result is
 * bit-identical to it; exactly one block writes each touched dwte row. Two
 * ways to find an id's rows:
 * - sorted (embedding_sort_local / embedding_sort_step, then
 *   embedding_fold_f32): the keys (id << 32 | row) bitonic-sorted, padded to
 *   a power of two P with all-ones keys (above every real key: ids are
 *   31-bit), so an id's rows sit together in increasing row order; the block
 *   at a run's first key folds the run. ~log2(P)^2/2 compare-exchange
 *   passes, those within 2048 keys in shared memory: O(P log^2 P) work, for
 *   the rows of a data-parallel step (tens of thousands).
 * - scanned (embedding_backward_f32): the block that owns row n first checks
 *   that n is the first occurrence of its id (a scan of the rows before it),
 *   and if so collects the later rows with that id; O(N^2) compares. The
 *   launcher keeps it for where the sort's keys do not fit the backend's
 *   scratch.
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

/* --- the sorted scatter --- */

#define EMB_SORT_CHUNK 2048 /* keys a block sorts in shared memory */

/* One compare-exchange of the bitonic network's pass (k, j) over the pair
 * (i, i + j) of keys: ascending where bit k of i is clear. */
static __device__ __forceinline__ void emb_cmpx(unsigned long long *a, unsigned i, unsigned j,
						unsigned long long k, unsigned gi)
{
	unsigned long long x = a[i], y = a[i + j];
	const bool up = (((unsigned long long)gi) & k) == 0;
	if (up ? x > y : x < y) {
		a[i] = y;
		a[i + j] = x;
	}
}

/* Each block's chunk of min(P, EMB_SORT_CHUNK) keys (blockDim.x = half of
 * it) in shared memory, the passes (k, j) for k from k0 to k1 (doubling) and
 * j from min(k / 2, chunk / 2) down to 1. fill: first make the keys from
 * ids (rows n < N; the rest all ones) instead of reading them. */
extern "C" __global__ void embedding_sort_local(unsigned long long *keys, const int32_t *ids,
						int N, unsigned long long k0,
						unsigned long long k1, int fill)
{
	__shared__ unsigned long long a[EMB_SORT_CHUNK];
	const unsigned chunk = 2 * blockDim.x;
	const size_t base = (size_t)blockIdx.x * chunk;
	for (unsigned t = threadIdx.x; t < chunk; t += blockDim.x) {
		const size_t n = base + t;
		a[t] = !fill ? keys[n]
			     : n < (size_t)N ? ((unsigned long long)(uint32_t)ids[n] << 32) | n
					     : ~0ull;
	}
	__syncthreads();
	for (unsigned long long k = k0; k <= k1; k <<= 1)
		for (unsigned j = (unsigned)(k / 2 < chunk / 2 ? k / 2 : chunk / 2); j > 0; j >>= 1) {
			const unsigned t = threadIdx.x;
			const unsigned i = 2 * t - (t & (j - 1));
			emb_cmpx(a, i, j, k, (unsigned)(base + i));
			__syncthreads();
		}
	for (unsigned t = threadIdx.x; t < chunk; t += blockDim.x)
		keys[base + t] = a[t];
}

/* The pass (k, j) over all P keys, j >= EMB_SORT_CHUNK: a thread a pair. */
extern "C" __global__ void embedding_sort_step(unsigned long long *keys, unsigned P,
					       unsigned long long k, unsigned j)
{
	for (unsigned t = blockIdx.x * blockDim.x + threadIdx.x; t < P / 2;
	     t += gridDim.x * blockDim.x) {
		const unsigned i = 2 * t - (t & (j - 1));
		emb_cmpx(keys, i, j, k, i);
	}
}

/* The part [lo, hi) of dwte += the rows of dout by the sorted keys: the
 * block at the first key of an id's run adds the run's rows in order. */
extern "C" __global__ void embedding_fold_f32(float *dwte, const float *dout,
					      const unsigned long long *keys, int N, int C,
					      size_t lo, size_t hi)
{
	for (int s = blockIdx.x; s < N; s += gridDim.x) {
		const unsigned long long key = keys[s];
		const uint32_t id = (uint32_t)(key >> 32);
		if (s > 0 && (uint32_t)(keys[s - 1] >> 32) == id)
			continue; /* block-uniform: not the run's first */
		const size_t e0 = (size_t)id * (size_t)C;
		if (e0 + (size_t)C <= lo || e0 >= hi)
			continue;
		const int c0 = e0 >= lo ? 0 : (int)(lo - e0);
		const int c1 = e0 + (size_t)C <= hi ? C : (int)(hi - e0);
		float *dst = dwte + (e0 + (size_t)c0 - lo); /* dst[c - c0]: element e0 + c */
		for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
			float acc = dst[c - c0];
			for (int t = s; t < N; t++) {
				const unsigned long long kt = keys[t];
				if ((uint32_t)(kt >> 32) != id)
					break;
				acc += dout[(size_t)(uint32_t)kt * C + c];
			}
			dst[c - c0] = acc;
		}
	}
}
