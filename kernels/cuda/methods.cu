/* The ops of the training methods, fp32: the CUDA twins of nf4_dequantize,
 * absmax_dequantize, distill_forward, distill_backward and dropout_forward in
 * kernels/cpu/ops.h (QLoRA's 4-bit weights, knowledge distillation,
 * dropout). LoRA itself needs no kernel of its own (matmuls and a scale).
 *
 * The dequantizers and dropout are elementwise with the CPU op's arithmetic
 * (one multiply, or a multiply then an add, rounded as the CPU rounds them),
 * so they are bit-identical to it; dropout's mask is the same stateless
 * function of (seed, i). Distillation is one block per row of V logits, like
 * cross-entropy (crossentropy.cu): one online pass for the three normalisers
 * (logits/T, tlogits/T, logits), merged by a fixed tree, then a pass for the
 * KL sum or the gradient. The CPU op works in double; here each exponential
 * is fp32 and max-subtracted (a few ulp; v/T is v times 1/T, an ulp from
 * the quotient), while the sums and the per-row scalars are double. distill_backward may run in place on logits: all reads of the first pass
 * precede the barrier inside cu_block_ms, and afterwards each element is read
 * by the thread that writes it.
 *
 * Key: n values, N rows, V vocab. NF4 blocks of 64 values share an absmax;
 * double-quantization blocks of 256 absmax values share a scale (the
 * constants of kernels/cpu/ops.h, NF4_BLOCK and NF4_DQ_BLOCK, repeated
 * below). */
#include "common.cuh"

#define CU_NF4_BLOCK 64
#define CU_NF4_DQ_BLOCK 256

/* bitsandbytes' NF4 code book: the float32 values of nf4_code in
 * kernels/cpu/ops.c, which the gpu test compares bit for bit. */
__constant__ float cu_nf4_code[16] = {
	-1.0f,
	-0.6961928009986877f,
	-0.5250730514526367f,
	-0.39491748809814453f,
	-0.28444138169288635f,
	-0.18477343022823334f,
	-0.09105003625154495f,
	0.0f,
	0.07958029955625534f,
	0.16093020141124725f,
	0.24611230194568634f,
	0.33791524171829224f,
	0.44070982933044434f,
	0.5626170039176941f,
	0.7229568362236023f,
	1.0f,
};

/* out (n) = code(i) * absmax[i / 64]; element 2i is the high nibble of
 * codes[i], 2i+1 the low one. Overwrite. out16 (or both): the same values
 * rounded to bf16 (nearest even), the bf16 mode's GEMM operand. */
extern "C" __global__ void nf4_dequantize_f32(float *out, __nv_bfloat16 *out16,
					      const uint8_t *codes, const float *absmax, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const unsigned byte = codes[i / 2];
		const unsigned k = i % 2 ? byte & 15u : byte >> 4;
		cu_put(out, out16, i, __fmul_rn(cu_nf4_code[k], absmax[i / CU_NF4_BLOCK]));
	}
}

/* absmax (nblocks) = q[j] * scale[j / 256] + offset, offset = scale[ns] with
 * ns = ceil(nblocks / 256). Overwrite. */
extern "C" __global__ void absmax_dequantize_f32(float *absmax, const int8_t *q,
						 const float *scale, size_t nblocks)
{
	const size_t ns = (nblocks + CU_NF4_DQ_BLOCK - 1) / CU_NF4_DQ_BLOCK;
	for (size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x; j < nblocks;
	     j += (size_t)gridDim.x * blockDim.x)
		absmax[j] = __fadd_rn(__fmul_rn((float)q[j], scale[j / CU_NF4_DQ_BLOCK]), scale[ns]);
}

/* Inverted dropout: element i is kept when the top 24 bits of
 * splitmix64(seed + (i+1) * golden) are >= threshold (= p * 2^24), and then
 * scaled by keep_scale (= 1/(1-p)); dropped elements are 0. out may alias
 * inp. */
extern "C" __global__ void dropout_f32(float *out, const float *inp, unsigned threshold,
				       float keep_scale, uint64_t seed, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		uint64_t z = seed + (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ull;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		z ^= z >> 31;
		out[i] = (unsigned)(z >> 40) >= threshold ? __fmul_rn(inp[i], keep_scale) : 0.0f;
	}
}

/* The three softmax normalisers of a distillation row, as (max, log of the
 * sum of exp(v - max)) of logits/T (a), tlogits/T (b) and logits (c),
 * returned to every thread of the block; the sums are double (see
 * crossentropy.cu). Kept apart rather than added into one logsumexp: a
 * probability is then exp((v - max) - log_sum), where v - max is exact or
 * nearly, instead of exp(v - lse) with the rounding of lse (an ulp of
 * ~|lse|) in its exponent. */
struct distill_norm {
	float ma, mb, mc;
	double la, lb, lc;
};

static __device__ __forceinline__ struct distill_norm distill_norms(const float *x, const float *t,
								    int V, float temperature)
{
	const float inv_t = 1.0f / temperature;
	float ma = -INFINITY, mb = -INFINITY, mc = -INFINITY;
	double sa = 0.0, sb = 0.0, sc = 0.0;
	for (int i = threadIdx.x; i < V; i += blockDim.x) {
		const float xi = x[i];
		cu_ms_push(ma, sa, xi * inv_t);
		cu_ms_push(mb, sb, t[i] * inv_t);
		cu_ms_push(mc, sc, xi);
	}
	cu_block_ms(ma, sa);
	cu_block_ms(mb, sb);
	cu_block_ms(mc, sc);
	return (struct distill_norm){ma, mb, mc, log(sa), log(sb), log(sc)};
}

/* Per row n whose target is not -100 (else both 0), p = softmax(tlogits/T),
 * q = softmax(logits/T): kl[n] = sum p (log p - log q) ; ce[n] =
 * logsumexp(logits) - logits[target]. kl, ce (N) overwrite.
 * KL = sum p (t - x)/T - (lse(t/T) - lse(x/T)) sum p: both parts are small
 * next to the log-probabilities themselves, so the KL of a student near its
 * teacher keeps its relative precision (the difference of the logsumexps is
 * formed in double). sum p is 1 but for the rounding common to every p
 * (that of log_sum to float), which would otherwise be amplified by the
 * size of sum p (t - x) — large when the two rows are offset — and here
 * cancels. */
extern "C" __global__ void distill_forward_f32(float *kl, float *ce, const float *logits,
					       const float *tlogits, const int32_t *targets,
					       float temperature, int N, int V)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		if (tgt == -100) { /* block-uniform */
			if (threadIdx.x == 0)
				kl[n] = ce[n] = 0.0f;
			continue;
		}
		const float *x = logits + (size_t)n * V, *t = tlogits + (size_t)n * V;
		const struct distill_norm z = distill_norms(x, t, V, temperature);
		const float lb = (float)z.lb, inv_t = 1.0f / temperature;
		double acc = 0.0, psum = 0.0;
		for (int i = threadIdx.x; i < V; i += blockDim.x) {
			const float ti = t[i];
			const float p = expf((ti * inv_t - z.mb) - lb);
			acc += (double)(p * (ti - x[i]));
			psum += (double)p;
		}
		acc = cu_block_sum(acc);
		psum = cu_block_sum(psum);
		if (threadIdx.x == 0) {
			const bool ok = tgt >= 0 && tgt < V;
			const double dlse = ((double)z.mb - (double)z.ma) + (z.lb - z.la);
			kl[n] = (float)(acc / (double)temperature - dlse * psum);
			ce[n] = ok ? (float)((double)z.mc + z.lc - (double)x[ok ? tgt : 0]) : NAN;
		}
	}
}

/* dlogits[n] = wkd * (q - p) + wce * (softmax(logits[n]) - onehot), with
 * wkd = dloss*alpha*T and wce = dloss*(1-alpha) formed on the host; 0 where
 * the target is -100. Overwrite; dlogits may alias logits. */
extern "C" __global__ void distill_backward_f32(float *dlogits, const float *logits,
						const float *tlogits, const int32_t *targets,
						float wkd, float wce, float temperature, int N, int V)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		const int32_t tgt = targets[n];
		float *d = dlogits + (size_t)n * V;
		if (tgt == -100) { /* block-uniform */
			for (int i = threadIdx.x; i < V; i += blockDim.x)
				d[i] = 0.0f;
			continue;
		}
		const float *x = logits + (size_t)n * V, *t = tlogits + (size_t)n * V;
		const struct distill_norm z = distill_norms(x, t, V, temperature);
		const float bad = tgt >= 0 && tgt < V ? 0.0f : NAN;
		const float la = (float)z.la, lb = (float)z.lb, lc = (float)z.lc;
		const float inv_t = 1.0f / temperature;
		for (int i = threadIdx.x; i < V; i += blockDim.x) {
			const float xi = x[i];
			const float q = expf((xi * inv_t - z.ma) - la);
			const float p = expf((t[i] * inv_t - z.mb) - lb);
			const float sm = expf((xi - z.mc) - lc) - (i == tgt ? 1.0f : 0.0f);
			d[i] = wkd * (q - p) + wce * sm + bad;
		}
	}
}
