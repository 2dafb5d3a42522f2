/* The parts of matmul_forward / matmul_backward (kernels/cpu/ops.h) that are
 * not GEMMs, fp32; the GEMMs themselves are cuBLAS calls in
 * gpu/cuda/cuda_ops.c. Also the column-sum reduce that rmsnorm's dweight
 * shares.
 *
 * The bias gradient is a column sum over N rows with a fixed order (no float
 * atomics), so it is the same bits on every run: one pass straight into
 * dbias, or per-chunk partials in the backend's scratch reduced in chunk
 * order by colsum_reduce_f32.
 *
 * Key: N rows, C input channels, OC output channels. */
#include "common.cuh"

/* out (N,OC) += bias (OC) broadcast over rows: the GEMM result rounded first,
 * then the bias added, as the CPU op does. One block per row, grid-stride. */
extern "C" __global__ void add_bias_f32(float *out, const float *bias, int N, int OC)
{
	for (int n = blockIdx.x; n < N; n += gridDim.x) {
		float *o = out + (size_t)n * OC;
		for (int j = threadIdx.x; j < OC; j += blockDim.x)
			o[j] += bias[j];
	}
}

/* A value widened to float (bf16 exactly). */
static __device__ __forceinline__ float mm_widen(float x)
{
	return x;
}

static __device__ __forceinline__ float mm_widen(__nv_bfloat16 x)
{
	return __bfloat162float(x);
}

/* dbias (OC) = sum over rows of dout (N rows ldo apart), by column tiles as
 * rmsnorm_dweight_f32: block (32, BY <= 32), grid (ceil(OC/32), P); direct
 * (P == 1) adds into dst = dbias, else partials go to dst[p*OC + j]. */
template <typename T>
static __device__ __forceinline__ void bias_grad(float *dst, const T *dout, size_t ldo, int N,
						 int OC, int rows_per_part, int direct)
{
	const int n0 = blockIdx.y * rows_per_part;
	const int n1 = min(N, n0 + rows_per_part);
	auto term = [=](int n, int j) { return mm_widen(dout[(size_t)n * ldo + j]); };
	float sum = cu_colsum_tile(term, n0, n1, OC);
	const int j = blockIdx.x * 32 + threadIdx.x;
	if (threadIdx.y != 0 || j >= OC)
		return;
	if (direct)
		dst[j] += sum;
	else
		dst[(size_t)blockIdx.y * OC + j] = sum;
}

extern "C" __global__ void bias_grad_f32(float *dst, const float *dout, int N, int OC,
					 int rows_per_part, int direct)
{
	bias_grad(dst, dout, (size_t)OC, N, OC, rows_per_part, direct);
}

/* bias_grad_f32 over bf16 rows ldo apart (gpu/backend.h:
 * bias_backward_ld16), each value widened: the same tiles and order. */
extern "C" __global__ void bias_grad_bf16(float *dst, const __nv_bfloat16 *dout16, size_t ldo,
					  int N, int OC, int rows_per_part, int direct)
{
	bias_grad(dst, dout16, ldo, N, OC, rows_per_part, direct);
}

/* bias_grad_bf16 four columns a thread (OC and ldo multiples of 4, dout16
 * 8-byte aligned: the launcher checks), a block 128 columns: each column's
 * terms summed in bias_grad_f32's order (thread row y takes rows n0 + y,
 * n0 + y + 32, ..., then row 0 adds the 32 partials in y order), so the
 * same bits, with a warp reading 256 bytes of a row instead of 64. A
 * thread's rows are loaded four at a time before they are added (in the
 * same order): one 8-byte load in flight a thread left the op at about
 * 1 TB/s on an H200 (Qwen2-0.5B's 72 blocks a layer). */
static __device__ __forceinline__ void bias_add4(float *acc, uint2 u)
{
	const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
	const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
	acc[0] += a.x;
	acc[1] += a.y;
	acc[2] += b.x;
	acc[3] += b.y;
}

extern "C" __global__ void bias_grad_bf16x4(float *dst, const __nv_bfloat16 *dout16, size_t ldo,
					    int N, int OC, int rows_per_part, int direct)
{
	__shared__ float part[32][129];
	const int n0 = blockIdx.y * rows_per_part;
	const int n1 = min(N, n0 + rows_per_part);
	const int c = blockIdx.x * 128 + 4 * threadIdx.x;
	const int S = (int)blockDim.y;
	float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
	if (c < OC) {
		int n = n0 + (int)threadIdx.y;
		for (; n + 3 * S < n1; n += 4 * S) {
			uint2 u[4];
#pragma unroll
			for (int k = 0; k < 4; k++)
				u[k] = *reinterpret_cast<const uint2 *>(dout16 + (size_t)(n + k * S) * ldo + c);
#pragma unroll
			for (int k = 0; k < 4; k++)
				bias_add4(acc, u[k]);
		}
		for (; n < n1; n += S)
			bias_add4(acc, *reinterpret_cast<const uint2 *>(dout16 + (size_t)n * ldo + c));
	}
#pragma unroll
	for (int k = 0; k < 4; k++)
		part[threadIdx.y][4 * threadIdx.x + k] = acc[k];
	__syncthreads();
	if (threadIdx.y >= 4)
		return;
	/* rows 0..3 of the block finish a quarter of its 128 columns each */
	const int j = blockIdx.x * 128 + threadIdx.y * 32 + threadIdx.x;
	float sum = 0.0f;
	for (unsigned y = 0; y < blockDim.y; y++)
		sum += part[y][threadIdx.y * 32 + threadIdx.x];
	if (j >= OC)
		return;
	if (direct)
		dst[j] += sum;
	else
		dst[(size_t)blockIdx.y * OC + j] = sum;
}

/* out (C) += sum over p < P of partial (P, C), in p order. Grid-stride over c. */
extern "C" __global__ void colsum_reduce_f32(float *out, const float *partial, int P, int C)
{
	for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
		float s = 0.0f;
		for (int p = 0; p < P; p++)
			s += partial[(size_t)p * C + c];
		out[c] += s;
	}
}

/* out += the sum, modulo 2^64, of a mix of each 16-bit word of x (n words)
 * with its index: a fingerprint of x's bits, the same whatever order the
 * threads add in (integer sums), for gpu/cuda/cuda_ops.c's lt_tune, which
 * keeps only the cuBLASLt algorithms whose output has the reference's bits;
 * x NULL: n zero words (what an output of zeros would give). out is zeroed
 * by the caller. */
extern "C" __global__ void hash_u16(unsigned long long *out, const unsigned short *x, size_t n)
{
	unsigned long long h = 0;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		unsigned long long z = ((unsigned long long)i << 16 | (x ? x[i] : 0)) + 0x9e3779b97f4a7c15ull;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
		h += z ^ (z >> 31);
	}
	for (int o = 16; o > 0; o /= 2)
		h += __shfl_down_sync(0xffffffffu, h, o);
	if (threadIdx.x % 32 == 0)
		atomicAdd(out, h);
}
