/* Causal attention fused flash-style (FlashAttention-2's algorithm), for the
 * bf16 compute mode: the (T,T) scores and probabilities never reach memory.
 * fp32 in and out (the engine's storage); the products run on the tensor
 * cores as bf16 mma.sync m16n8k16 with fp32 accumulation, the softmax in
 * fp32. The fp32 mode keeps the exact path of attention.cu + cuBLAS.
 *
 * Forward: one block per (64 queries, head, batch), a warp per 16 queries;
 * the keys in tiles of 64 up to the diagonal with the online softmax; out
 * and, per query row, L = log2 of the sum of 2^(s - m) plus m, where s is the
 * score times log2(e)/sqrt(HS): what the backward needs to rebuild P.
 * Backward, deterministic (no atomics, fixed orders): flash_rowdot forms
 * Dr = rowsum(dout * out); flash_bwd_dkdv, a block per (64 keys, kv head,
 * batch), rebuilds P^T and dS^T tile by tile over every query head of the kv
 * group and every query tile at or past the keys, and owns dK and dV
 * outright; flash_bwd_dq, a block per (64 queries, head, batch), rebuilds P
 * and dS over the keys up to the diagonal for dQ. The cost is computing P
 * twice in the backward instead of adding dQ with float atomics.
 *
 * Fragment layout of mma.m16n8k16 (PTX ISA), g = lane / 4, t = lane % 4:
 * A (16x16, row-major) a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..),
 * a3 = (g+8, 2t+8..); B (16x8, k x n) b0 = (k 2t..2t+1, n g), b1 = (k
 * 2t+8.., n g); C (16x8) c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1).
 * So a B operand is read as pairs from a tile stored [n][k], and the C tiles
 * of a 16x64 product are, two by two, the A fragments of the next product.
 *
 * Shapes: q, out, dq (B,T,NH,HS); k, v, dk, dv (B,T,NKV,HS); L and Dr
 * (B,NH,T). HS is a template parameter (16, 32, 64: gpu/backend.h's
 * gpu_flash_head_size); T is anything (tiles past T are zero-padded and
 * masked). Rows of q, k, v, dout are 16-byte aligned (the plan's buffers are,
 * and HS is a multiple of 4). */
#include "common.cuh"

#include <cuda_bf16.h>

#define FA_TILE 64 /* queries per block and keys per tile */
#define FA_PAD 8   /* bf16 padding per shared row (bank spread, 16-byte rows) */
#define FA_THREADS 128
#define FA_LOG2E 1.4426950408889634f

static __device__ __forceinline__ uint32_t fa_pack(float lo, float hi)
{
	__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<uint32_t *>(&v);
}

static __device__ __forceinline__ uint32_t fa_ld(const __nv_bfloat16 *p)
{
	return *reinterpret_cast<const uint32_t *>(p);
}

static __device__ __forceinline__ void fa_mma(float c[4], const uint32_t a[4], uint32_t b0,
					      uint32_t b1)
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

static __device__ __forceinline__ float fa_quad_max(float v)
{
	v = fmaxf(v, __shfl_xor_sync(CU_FULL_MASK, v, 1));
	return fmaxf(v, __shfl_xor_sync(CU_FULL_MASK, v, 2));
}

static __device__ __forceinline__ float fa_quad_sum(float v)
{
	v += __shfl_xor_sync(CU_FULL_MASK, v, 1);
	return v + __shfl_xor_sync(CU_FULL_MASK, v, 2);
}

/* dst[r][c] = src row (r0 + r), column c, as bf16; zero past T. src points at
 * row 0 of this (batch, head); rows are ld floats apart. */
template <int D>
static __device__ __forceinline__ void fa_load(__nv_bfloat16 (*dst)[D + FA_PAD], const float *src,
					       int ld, int r0, int T)
{
	for (int i = threadIdx.x; i < FA_TILE * D / 4; i += FA_THREADS) {
		const int r = i / (D / 4), c = (i % (D / 4)) * 4;
		float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
		if (r0 + r < T)
			x = *reinterpret_cast<const float4 *>(src + (size_t)(r0 + r) * ld + c);
		uint2 p;
		p.x = fa_pack(x.x, x.y);
		p.y = fa_pack(x.z, x.w);
		*reinterpret_cast<uint2 *>(&dst[r][c]) = p;
	}
}

/* The same tile transposed: dst[c][r]. */
template <int D>
static __device__ __forceinline__ void fa_load_t(__nv_bfloat16 (*dst)[FA_TILE + FA_PAD],
						 const float *src, int ld, int r0, int T)
{
	for (int i = threadIdx.x; i < FA_TILE * D / 4; i += FA_THREADS) {
		const int r = i % FA_TILE, c = (i / FA_TILE) * 4;
		float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
		if (r0 + r < T)
			x = *reinterpret_cast<const float4 *>(src + (size_t)(r0 + r) * ld + c);
		dst[c + 0][r] = __float2bfloat16_rn(x.x);
		dst[c + 1][r] = __float2bfloat16_rn(x.y);
		dst[c + 2][r] = __float2bfloat16_rn(x.z);
		dst[c + 3][r] = __float2bfloat16_rn(x.w);
	}
}

/* The A fragments of 16 rows (from row r) of a [row][k] tile, D/16 k-steps. */
template <int D>
static __device__ __forceinline__ void fa_frag_a(uint32_t a[D / 16][4],
						 __nv_bfloat16 (*s)[D + FA_PAD], int r, int g, int t)
{
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++) {
		a[kk][0] = fa_ld(&s[r + g][kk * 16 + 2 * t]);
		a[kk][1] = fa_ld(&s[r + g + 8][kk * 16 + 2 * t]);
		a[kk][2] = fa_ld(&s[r + g][kk * 16 + 2 * t + 8]);
		a[kk][3] = fa_ld(&s[r + g + 8][kk * 16 + 2 * t + 8]);
	}
}

/* acc[n] (16 x 64 as 8 tiles of 8 columns) = A (16 x D) times the [n][k] tile
 * s (64 x D) transposed. */
template <int D>
static __device__ __forceinline__ void fa_mm_nt(float acc[8][4], const uint32_t a[D / 16][4],
						__nv_bfloat16 (*s)[D + FA_PAD], int g, int t)
{
#pragma unroll
	for (int n = 0; n < 8; n++) {
		acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
#pragma unroll
		for (int kk = 0; kk < D / 16; kk++)
			fa_mma(acc[n], a[kk], fa_ld(&s[n * 8 + g][kk * 16 + 2 * t]),
			       fa_ld(&s[n * 8 + g][kk * 16 + 2 * t + 8]));
	}
}

/* acc (16 x D as D/8 tiles) += P (16 x 64, the C tiles p) times the
 * [n][k] tile s (D x 64) transposed. */
template <int D>
static __device__ __forceinline__ void fa_mm_pv(float acc[D / 8][4], const float p[8][4],
						__nv_bfloat16 (*s)[FA_TILE + FA_PAD], int g, int t)
{
#pragma unroll
	for (int j = 0; j < 4; j++) {
		uint32_t a[4] = {fa_pack(p[2 * j][0], p[2 * j][1]), fa_pack(p[2 * j][2], p[2 * j][3]),
				 fa_pack(p[2 * j + 1][0], p[2 * j + 1][1]),
				 fa_pack(p[2 * j + 1][2], p[2 * j + 1][3])};
#pragma unroll
		for (int d = 0; d < D / 8; d++)
			fa_mma(acc[d], a, fa_ld(&s[d * 8 + g][j * 16 + 2 * t]),
			       fa_ld(&s[d * 8 + g][j * 16 + 2 * t + 8]));
	}
}

template <int D>
static __device__ __forceinline__ void flash_fwd(float *out, float *lse, const float *q,
						 const float *k, const float *v, int T, int NH,
						 int NKV)
{
	__shared__ __align__(16) __nv_bfloat16 sQK[FA_TILE][D + FA_PAD];
	__shared__ __align__(16) __nv_bfloat16 sVt[D][FA_TILE + FA_PAD];
	const int q0 = blockIdx.x * FA_TILE, h = blockIdx.y, b = blockIdx.z;
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const float *qb = q + (size_t)b * T * ldq + h * D;
	const float *kb = k + (size_t)b * T * ldk + kvh * D;
	const float *vb = v + (size_t)b * T * ldk + kvh * D;

	fa_load<D>(sQK, qb, ldq, q0, T);
	__syncthreads();
	uint32_t qa[D / 16][4];
	fa_frag_a<D>(qa, sQK, warp * 16, g, t);

	const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
	float o[D / 8][4];
#pragma unroll
	for (int d = 0; d < D / 8; d++)
		o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
	float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
	const int last = min(T, q0 + FA_TILE) - 1;
	for (int k0 = 0; k0 <= last; k0 += FA_TILE) {
		__syncthreads();
		fa_load<D>(sQK, kb, ldk, k0, T);
		fa_load_t<D>(sVt, vb, ldk, k0, T);
		__syncthreads();
		if (k0 > q0 + warp * 16 + 15)
			continue; /* every key of the tile is past this warp's queries */
		float s[8][4];
		fa_mm_nt<D>(s, qa, sQK, g, t);
		float mx0 = m0, mx1 = m1;
#pragma unroll
		for (int n = 0; n < 8; n++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int col = k0 + n * 8 + 2 * t + (e & 1), row = e < 2 ? row0 : row1;
				float x = s[n][e] * sl2;
				if (col > row || col >= T)
					x = -INFINITY;
				s[n][e] = x;
				if (e < 2)
					mx0 = fmaxf(mx0, x);
				else
					mx1 = fmaxf(mx1, x);
			}
		mx0 = fa_quad_max(mx0);
		mx1 = fa_quad_max(mx1);
		const float c0 = exp2f(m0 - mx0), c1 = exp2f(m1 - mx1);
		m0 = mx0;
		m1 = mx1;
		float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
		for (int n = 0; n < 8; n++) {
			s[n][0] = exp2f(s[n][0] - m0);
			s[n][1] = exp2f(s[n][1] - m0);
			s[n][2] = exp2f(s[n][2] - m1);
			s[n][3] = exp2f(s[n][3] - m1);
			rs0 += s[n][0] + s[n][1];
			rs1 += s[n][2] + s[n][3];
		}
		l0 = l0 * c0 + rs0;
		l1 = l1 * c1 + rs1;
#pragma unroll
		for (int d = 0; d < D / 8; d++) {
			o[d][0] *= c0;
			o[d][1] *= c0;
			o[d][2] *= c1;
			o[d][3] *= c1;
		}
		fa_mm_pv<D>(o, s, sVt, g, t);
	}
	l0 = fa_quad_sum(l0);
	l1 = fa_quad_sum(l1);
	const float i0 = 1.f / l0, i1 = 1.f / l1;
	float *ob = out + (size_t)b * T * ldq + h * D;
#pragma unroll
	for (int d = 0; d < D / 8; d++) {
		const int c = d * 8 + 2 * t;
		if (row0 < T)
			*reinterpret_cast<float2 *>(ob + (size_t)row0 * ldq + c) =
				make_float2(o[d][0] * i0, o[d][1] * i0);
		if (row1 < T)
			*reinterpret_cast<float2 *>(ob + (size_t)row1 * ldq + c) =
				make_float2(o[d][2] * i1, o[d][3] * i1);
	}
	if (t == 0) {
		float *lb = lse + ((size_t)b * NH + h) * T;
		if (row0 < T)
			lb[row0] = m0 + log2f(l0);
		if (row1 < T)
			lb[row1] = m1 + log2f(l1);
	}
}

/* Dr[(b*NH + h)*T + t] = sum over the head's HS columns of dout * out: a
 * warp per (row, head), lanes over the columns, a fixed shuffle tree. */
extern "C" __global__ void flash_rowdot_f32(float *dr, const float *dout, const float *out, int B,
					    int T, int NH, int HS)
{
	const int lane = threadIdx.x & 31;
	const size_t n = (size_t)B * T * NH;
	const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
	for (size_t w = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < n; w += warps) {
		const size_t row = w / NH; /* b*T + t */
		const int h = (int)(w % NH);
		const float *a = dout + row * NH * HS + (size_t)h * HS;
		const float *o = out + row * NH * HS + (size_t)h * HS;
		float s = 0.f;
		for (int c = lane; c < HS; c += 32)
			s += a[c] * o[c];
		s = cu_warp_sum(s);
		if (lane == 0) {
			const size_t b = row / T, t = row % T;
			dr[(b * NH + h) * T + t] = s;
		}
	}
}

template <int D>
static __device__ __forceinline__ void flash_bwd_dkdv(float *dk, float *dv, const float *dout,
						      const float *q, const float *k,
						      const float *v, const float *lse,
						      const float *dr, int T, int NH, int NKV)
{
	__shared__ __align__(16) __nv_bfloat16 sQ[FA_TILE][D + FA_PAD];
	__shared__ __align__(16) __nv_bfloat16 sdO[FA_TILE][D + FA_PAD];
	__shared__ __align__(16) __nv_bfloat16 sQt[D][FA_TILE + FA_PAD];
	__shared__ __align__(16) __nv_bfloat16 sdOt[D][FA_TILE + FA_PAD];
	__shared__ float sL[FA_TILE], sD[FA_TILE];
	const int k0 = blockIdx.x * FA_TILE, kvh = blockIdx.y, b = blockIdx.z;
	const int rep = NH / NKV, ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const float *kb = k + (size_t)b * T * ldk + kvh * D;
	const float *vb = v + (size_t)b * T * ldk + kvh * D;

	/* This warp's 16 keys and values as A fragments (through sQ, sdO). */
	fa_load<D>(sQ, kb, ldk, k0, T);
	fa_load<D>(sdO, vb, ldk, k0, T);
	__syncthreads();
	uint32_t ka[D / 16][4], va[D / 16][4];
	fa_frag_a<D>(ka, sQ, warp * 16, g, t);
	fa_frag_a<D>(va, sdO, warp * 16, g, t);

	const int key0 = k0 + warp * 16 + g, key1 = key0 + 8;
	float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
	for (int d = 0; d < D / 8; d++)
		for (int e = 0; e < 4; e++)
			dka[d][e] = dva[d][e] = 0.f;
	for (int h = kvh * rep; h < (kvh + 1) * rep; h++) {
		const float *qb = q + (size_t)b * T * ldq + h * D;
		const float *ob = dout + (size_t)b * T * ldq + h * D;
		const float *lb = lse + ((size_t)b * NH + h) * T;
		const float *db = dr + ((size_t)b * NH + h) * T;
		for (int q0 = k0; q0 < T; q0 += FA_TILE) {
			__syncthreads();
			fa_load<D>(sQ, qb, ldq, q0, T);
			fa_load_t<D>(sQt, qb, ldq, q0, T);
			fa_load<D>(sdO, ob, ldq, q0, T);
			fa_load_t<D>(sdOt, ob, ldq, q0, T);
			for (int i = threadIdx.x; i < FA_TILE; i += FA_THREADS) {
				sL[i] = q0 + i < T ? lb[q0 + i] : 0.f;
				sD[i] = q0 + i < T ? db[q0 + i] : 0.f;
			}
			__syncthreads();
			if (q0 + FA_TILE - 1 < k0 + warp * 16)
				continue; /* every query of the tile is before this warp's keys */
			float p[8][4], ds[8][4];
			fa_mm_nt<D>(p, ka, sQ, g, t);   /* S^T: keys x queries */
			fa_mm_nt<D>(ds, va, sdO, g, t); /* dP^T = V dO^T */
#pragma unroll
			for (int n = 0; n < 8; n++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int qi = n * 8 + 2 * t + (e & 1);
					const int key = e < 2 ? key0 : key1;
					const int qr = q0 + qi;
					float pe = 0.f;
					if (qr >= key && qr < T)
						pe = exp2f(p[n][e] * sl2 - sL[qi]);
					p[n][e] = pe;
					ds[n][e] = pe * (ds[n][e] - sD[qi]);
				}
			fa_mm_pv<D>(dva, p, sdOt, g, t);  /* dV += P^T dO */
			fa_mm_pv<D>(dka, ds, sQt, g, t);  /* dK += dS^T Q */
		}
	}
	const float scale = rsqrtf((float)D);
	float *dkb = dk + (size_t)b * T * ldk + kvh * D;
	float *dvb = dv + (size_t)b * T * ldk + kvh * D;
#pragma unroll
	for (int d = 0; d < D / 8; d++) {
		const int c = d * 8 + 2 * t;
		if (key0 < T) {
			*reinterpret_cast<float2 *>(dkb + (size_t)key0 * ldk + c) =
				make_float2(dka[d][0] * scale, dka[d][1] * scale);
			*reinterpret_cast<float2 *>(dvb + (size_t)key0 * ldk + c) =
				make_float2(dva[d][0], dva[d][1]);
		}
		if (key1 < T) {
			*reinterpret_cast<float2 *>(dkb + (size_t)key1 * ldk + c) =
				make_float2(dka[d][2] * scale, dka[d][3] * scale);
			*reinterpret_cast<float2 *>(dvb + (size_t)key1 * ldk + c) =
				make_float2(dva[d][2], dva[d][3]);
		}
	}
}

template <int D>
static __device__ __forceinline__ void flash_bwd_dq(float *dq, const float *dout, const float *q,
						    const float *k, const float *v,
						    const float *lse, const float *dr, int T,
						    int NH, int NKV)
{
	__shared__ __align__(16) __nv_bfloat16 sK[FA_TILE][D + FA_PAD];
	__shared__ __align__(16) __nv_bfloat16 sV[FA_TILE][D + FA_PAD];
	__shared__ __align__(16) __nv_bfloat16 sKt[D][FA_TILE + FA_PAD];
	const int q0 = blockIdx.x * FA_TILE, h = blockIdx.y, b = blockIdx.z;
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const float *qb = q + (size_t)b * T * ldq + h * D;
	const float *ob = dout + (size_t)b * T * ldq + h * D;
	const float *kb = k + (size_t)b * T * ldk + kvh * D;
	const float *vb = v + (size_t)b * T * ldk + kvh * D;

	fa_load<D>(sK, qb, ldq, q0, T);
	fa_load<D>(sV, ob, ldq, q0, T);
	__syncthreads();
	uint32_t qa[D / 16][4], oa[D / 16][4];
	fa_frag_a<D>(qa, sK, warp * 16, g, t);
	fa_frag_a<D>(oa, sV, warp * 16, g, t);
	const int row0 = q0 + warp * 16 + g, row1 = row0 + 8;
	const float *lb = lse + ((size_t)b * NH + h) * T;
	const float *db = dr + ((size_t)b * NH + h) * T;
	const float L0 = row0 < T ? lb[row0] : 0.f, L1 = row1 < T ? lb[row1] : 0.f;
	const float D0 = row0 < T ? db[row0] : 0.f, D1 = row1 < T ? db[row1] : 0.f;
	float dqa[D / 8][4];
#pragma unroll
	for (int d = 0; d < D / 8; d++)
		dqa[d][0] = dqa[d][1] = dqa[d][2] = dqa[d][3] = 0.f;
	const int last = min(T, q0 + FA_TILE) - 1;
	for (int k0 = 0; k0 <= last; k0 += FA_TILE) {
		__syncthreads();
		fa_load<D>(sK, kb, ldk, k0, T);
		fa_load<D>(sV, vb, ldk, k0, T);
		fa_load_t<D>(sKt, kb, ldk, k0, T);
		__syncthreads();
		if (k0 > q0 + warp * 16 + 15)
			continue;
		float p[8][4], ds[8][4];
		fa_mm_nt<D>(p, qa, sK, g, t);  /* S */
		fa_mm_nt<D>(ds, oa, sV, g, t); /* dP = dO V^T */
#pragma unroll
		for (int n = 0; n < 8; n++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int col = k0 + n * 8 + 2 * t + (e & 1);
				const int row = e < 2 ? row0 : row1;
				float pe = 0.f;
				if (col <= row && col < T)
					pe = exp2f(p[n][e] * sl2 - (e < 2 ? L0 : L1));
				ds[n][e] = pe * (ds[n][e] - (e < 2 ? D0 : D1));
			}
		fa_mm_pv<D>(dqa, ds, sKt, g, t); /* dQ += dS K */
	}
	const float scale = rsqrtf((float)D);
	float *dqb = dq + (size_t)b * T * ldq + h * D;
#pragma unroll
	for (int d = 0; d < D / 8; d++) {
		const int c = d * 8 + 2 * t;
		if (row0 < T)
			*reinterpret_cast<float2 *>(dqb + (size_t)row0 * ldq + c) =
				make_float2(dqa[d][0] * scale, dqa[d][1] * scale);
		if (row1 < T)
			*reinterpret_cast<float2 *>(dqb + (size_t)row1 * ldq + c) =
				make_float2(dqa[d][2] * scale, dqa[d][3] * scale);
	}
}

/* The kernels, one per head size. Grid (ceil(T/64), NH or NKV, B), 128 threads. */
#define FA_KERNELS(D)                                                                         \
	extern "C" __global__ void __launch_bounds__(FA_THREADS)                              \
		flash_fwd_d##D(float *out, float *lse, const float *q, const float *k,        \
			       const float *v, int T, int NH, int NKV)                        \
	{                                                                                     \
		flash_fwd<D>(out, lse, q, k, v, T, NH, NKV);                                  \
	}                                                                                     \
	extern "C" __global__ void __launch_bounds__(FA_THREADS)                              \
		flash_bwd_dkdv_d##D(float *dk, float *dv, const float *dout, const float *q,  \
				    const float *k, const float *v, const float *lse,         \
				    const float *dr, int T, int NH, int NKV)                  \
	{                                                                                     \
		flash_bwd_dkdv<D>(dk, dv, dout, q, k, v, lse, dr, T, NH, NKV);                \
	}                                                                                     \
	extern "C" __global__ void __launch_bounds__(FA_THREADS)                              \
		flash_bwd_dq_d##D(float *dq, const float *dout, const float *q, const float *k, \
				  const float *v, const float *lse, const float *dr, int T,   \
				  int NH, int NKV)                                            \
	{                                                                                     \
		flash_bwd_dq<D>(dq, dout, q, k, v, lse, dr, T, NH, NKV);                      \
	}

FA_KERNELS(16)
FA_KERNELS(32)
FA_KERNELS(64)
