/* Cross-entropy over the vocabulary, fp32: the CUDA twins of
 * crossentropy_forward / crossentropy_backward in kernels/cpu/ops.h, fused
 * with the softmax so that no probability tensor is stored.
 *
 * One block per row of V logits (V up to ~152k), grid-stride over rows. The
 * row's max and sum of exp come from one online pass (cu_ms_push: running
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
		float m = -INFINITY;
		double s = 0.0;
		for (int i = threadIdx.x; i < V; i += blockDim.x)
			cu_ms_push(m, s, x[i]);
		cu_block_ms(m, s);
		if (threadIdx.x == 0) {
			bool ok = tgt >= 0 && tgt < V;
			/* the final combine in double, as the CPU forms it */
			losses[n] = ok ? (float)((double)m + log(s) - (double)x[ok ? tgt : 0])
				       : NAN;
		}
	}
}

/* dlogits[n] = dloss * (softmax(logits[n]) - onehot(targets[n])), 0 where
 * -100. Overwrite; dlogits may alias logits. */
extern "C" __global__ void crossentropy_backward_f32(float *dlogits, const float *logits,
						     const int32_t *targets, float dloss, int N,
						     int V)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		float *d = dlogits + (size_t)n * V;
		if (tgt == -100) { /* block-uniform */
			for (int i = threadIdx.x; i < V; i += blockDim.x)
				d[i] = 0.0f;
			continue;
		}
		const float *x = logits + (size_t)n * V;
		float m = -INFINITY;
		double s = 0.0;
		for (int i = threadIdx.x; i < V; i += blockDim.x)
			cu_ms_push(m, s, x[i]);
		cu_block_ms(m, s);
		const bool ok = tgt >= 0 && tgt < V;
		const float inv = ok ? (float)(1.0 / s) : NAN;
		for (int i = threadIdx.x; i < V; i += blockDim.x) {
			float g = dloss * (expf(x[i] - m) * inv);
			d[i] = i == tgt ? g - dloss : g;
		}
	}
}
