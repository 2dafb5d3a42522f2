/* Causal attention fused flash-style (FlashAttention-2's algorithm), for the
 * bf16 compute mode: the (T,T) scores and probabilities never reach memory.
 * q, k, v and dout come in as bf16 copies (the launcher rounds the engine's
 * fp32 into its scratch; flash_rowdot writes dout's), out and its bf16
 * twin (either may be NULL), the statistics and the gradients go out fp32; the
 * products run on the tensor cores as bf16 mma.sync m16n8k16 with fp32
 * accumulation, the softmax in fp32. The
 * fp32 mode keeps the exact path of attention.cu + cuBLAS.
 *
 * Forward: one block per (128 queries, head, batch), a warp per 32 queries
 * (two m16 tiles, interleaved: rows 16 w and 64 + 16 w of the block), so
 * that every K and V fragment read from shared memory feeds two mma's; the
 * heaviest (last) query tiles of every head launched first; the keys in
 * tiles of 64 up to the diagonal with the online softmax, the next tile
 * copied in (cp.async) while this one is used; out and, per query row, L =
 * log2 of the sum of 2^(s - m) plus m, where s is the score times
 * log2(e)/sqrt(HS): what the backward needs to rebuild P. (The forward's
 * own section below says more.)
 * Backward, deterministic (no atomics, fixed orders): flash_rowdot forms
 * Dr = rowsum(dout * out) (out read from its bf16 twin where given);
 * flash_bwd_dkdv, a block per (128 keys, head, batch) with a warp per 32
 * keys up to HS 64 (at HS 128 8 warps of 16 keys, flash_bwd_dkdv8_d128,
 * where a block may have its 137 KiB of shared memory, sm_80/90/100; else
 * 64 keys, 4 warps of 16),
 * rebuilds P^T and dS^T tile by tile over every query tile at or past
 * the keys and owns that head's share of dK and dV outright: with one query
 * head per kv head it is dK and dV; with a group of rep query heads it is a
 * per-head partial ((B,T,NH,HS), rep times more blocks than a block per kv
 * head, whose longest block would walk rep times as many tiles), and
 * flash_kv_reduce adds the group's partials in head order; flash_bwd_dq,
 * a block per (128 queries, head, batch) with a warp per 32 queries as in
 * the forward up to HS 64 (8 warps of 16 queries at HS 128), rebuilds
 * P and dS over the keys up to the diagonal for dQ (its own section below
 * says more). Both rebuild P as the forward forms its powers (fa_bwd_p).
 * On Hopper (the sm_90a image) head sizes 64 and 128, forward and backward,
 * run the same split on warpgroup products instead: flash_wg.cuh, included
 * at the end.
 * The cost is computing P twice in the backward instead of adding dQ with
 * float atomics.
 *
 * Fragment layout of mma.m16n8k16 (PTX ISA), g = lane / 4, t = lane % 4:
 * A (16x16, row-major) a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..),
 * a3 = (g+8, 2t+8..); B (16x8, k x n) b0 = (k 2t..2t+1, n g), b1 = (k
 * 2t+8.., n g); C (16x8) c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1).
 * Every tile sits in shared memory row-major as it is in global memory
 * ([row][head dim]). ldmatrix reads B fragments from it: plain where the
 * product runs over the head dimension (S = Q K^T: B[k=d][n=key] is the
 * tile [key][d] itself), .trans where it runs over the rows (P V: B[k=key]
 * [n=d] is the tile [key][d] transposed). The C tiles of a 16x64 product
 * are, two by two, the A fragments of the next product.
 *
 * Shapes: q, out, dq (B,T,NH,HS); k, v, dk, dv (B,T,NKV,HS); L and Dr
 * (B,NH,T). HS is a template parameter (16, 32, 64, 128: gpu/backend.h's
 * gpu_flash_head_size); T is anything (tiles past T are zero-filled and
 * masked). The bf16 copies start 16-byte aligned (a row is HS * 2 bytes, a
 * multiple of 32), as cp.async needs; fp32 rows are 8-byte aligned. */
#include "common.cuh"

#include <cuda_bf16.h>

#define FA_TILE 64 /* queries per block and keys per tile */
#define FA_PAD 8   /* bf16 padding per shared row: rows stay 16-byte aligned, and the
                    * 8 rows an ldmatrix reads fall in distinct banks */
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

typedef __nv_bfloat16 fa_bf16;

static __device__ __forceinline__ void fa_cp16(void *dst, const void *src)
{
	const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}

/* cp.async of one float (L, Dr rows): no register holds it on the way. */
static __device__ __forceinline__ void fa_cp4(void *dst, const void *src)
{
	const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
}

static __device__ __forceinline__ void fa_commit()
{
	asm volatile("cp.async.commit_group;\n" ::);
}

/* Waits until at most N committed copy groups of this thread are pending. */
template <int N> static __device__ __forceinline__ void fa_wait()
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Shared memory: dynamic, FA_TILE x (D + FA_PAD) bf16 tiles carved from
 * fa_smem. Head sizes up to 64 double-buffer the streamed tiles (the next
 * copied while this one is used) and keep a block's own rows as fragments in
 * registers; at 128 dkdv streams through one buffer and reads its keys and
 * values from shared memory (fa_cfg), dq double-buffers its four tiles as
 * below 128, so every kernel fits the 99 KiB a block may have on
 * sm_86/89/120. gpu/cuda/cuda_ops.c's flash_smem_bytes mirrors these
 * layouts. */
extern __shared__ __align__(16) unsigned char fa_smem[];

template <int D> struct fa_cfg {
	static constexpr int stages = D <= 64 ? 2 : 1;
	static constexpr bool a_smem = D > 64;
};

template <int D> static __device__ __forceinline__ fa_bf16 (*fa_tiles())[FA_TILE][D + FA_PAD]
{
	return reinterpret_cast<fa_bf16(*)[FA_TILE][D + FA_PAD]>(fa_smem);
}

/* Starts copying rows r0.. of a (T, ld) bf16 matrix (src at row 0, this
 * head's column) into dst; rows at or past T are zeroed. NT: the block's
 * threads. */
template <int D, int NT = FA_THREADS>
static __device__ __forceinline__ void fa_tile(fa_bf16 (*dst)[D + FA_PAD], const fa_bf16 *src,
					       int ld, int r0, int T)
{
	for (int i = threadIdx.x; i < FA_TILE * D / 8; i += NT) {
		const int r = i / (D / 8), c = (i % (D / 8)) * 8;
		if (r0 + r < T)
			fa_cp16(&dst[r][c], src + (size_t)(r0 + r) * ld + c);
		else
			*reinterpret_cast<uint4 *>(&dst[r][c]) = make_uint4(0u, 0u, 0u, 0u);
	}
}

static __device__ __forceinline__ void fa_ldm(uint32_t r[4], const fa_bf16 *p)
{
	const unsigned a = (unsigned)__cvta_generic_to_shared(p);
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(a));
}

static __device__ __forceinline__ void fa_ldm_t(uint32_t r[4], const fa_bf16 *p)
{
	const unsigned a = (unsigned)__cvta_generic_to_shared(p);
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
		     : "r"(a));
}

/* The A fragments of 16 rows (from row r) of a tile, D/16 k-steps. */
template <int D>
static __device__ __forceinline__ void fa_frag_a(uint32_t a[D / 16][4],
						 fa_bf16 (*s)[D + FA_PAD], int r, int g, int t)
{
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++) {
		a[kk][0] = fa_ld(&s[r + g][kk * 16 + 2 * t]);
		a[kk][1] = fa_ld(&s[r + g + 8][kk * 16 + 2 * t]);
		a[kk][2] = fa_ld(&s[r + g][kk * 16 + 2 * t + 8]);
		a[kk][3] = fa_ld(&s[r + g + 8][kk * 16 + 2 * t + 8]);
	}
}

/* acc (16 x 64 as 8 C tiles) = A (16 x D) times the tile s (64 rows x D)
 * transposed. One ldmatrix.x4 gives the B fragments of two column blocks
 * (lanes 0-15 address block n, 16-31 block n + 1; lanes 8-15 and 24-31 the
 * upper 8 of the k-step). */
template <int D>
static __device__ __forceinline__ void fa_mm_nt(float acc[8][4], const uint32_t a[D / 16][4],
						fa_bf16 (*s)[D + FA_PAD], int lane)
{
#pragma unroll
	for (int n = 0; n < 8; n++)
		acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
	const int row = (lane & 7) + (lane >> 4) * 8, col = ((lane >> 3) & 1) * 8;
#pragma unroll
	for (int n = 0; n < 8; n += 2)
#pragma unroll
		for (int kk = 0; kk < D / 16; kk++) {
			uint32_t b[4];
			fa_ldm(b, &s[n * 8 + row][kk * 16 + col]);
			fa_mma(acc[n], a[kk], b[0], b[1]);
			fa_mma(acc[n + 1], a[kk], b[2], b[3]);
		}
}

/* fa_mm_nt with A read from shared memory a k-step at a time (16 rows from
 * row r of the tile sa) instead of held in registers: for head size 128,
 * whose dK/dV accumulators leave no room for the keys' and values'
 * fragments. ldmatrix.x4: lanes 0-7 rows 0-7, 8-15 rows 8-15, 16-31 the same
 * 8 columns on: a0..a3 of the k-step. */
template <int D>
static __device__ __forceinline__ void fa_mm_nt_s(float acc[8][4], fa_bf16 (*sa)[D + FA_PAD],
						  int r, fa_bf16 (*s)[D + FA_PAD], int lane)
{
#pragma unroll
	for (int n = 0; n < 8; n++)
		acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
	const int arow = r + (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
	const int row = (lane & 7) + (lane >> 4) * 8, col = ((lane >> 3) & 1) * 8;
#pragma unroll
	for (int kk = 0; kk < D / 16; kk++) {
		uint32_t a[4];
		fa_ldm(a, &sa[arow][kk * 16 + acol]);
#pragma unroll
		for (int n = 0; n < 8; n += 2) {
			uint32_t b[4];
			fa_ldm(b, &s[n * 8 + row][kk * 16 + col]);
			fa_mma(acc[n], a, b[0], b[1]);
			fa_mma(acc[n + 1], a, b[2], b[3]);
		}
	}
}

/* acc (16 x D as D/8 C tiles) += P (16 x 64, the C tiles p, rounded to bf16)
 * times the tile s (64 rows x D). ldmatrix.trans: lanes 0-7 address rows
 * 0-7 of the k-step, 8-15 rows 8-15 (b0, b1 of column block d), 16-31 the
 * same for block d + 1. */
template <int D>
static __device__ __forceinline__ void fa_mm_pv(float acc[D / 8][4], const float p[8][4],
						fa_bf16 (*s)[D + FA_PAD], int lane)
{
	const int row = (lane & 7) + ((lane >> 3) & 1) * 8, col = (lane >> 4) * 8;
#pragma unroll
	for (int j = 0; j < 4; j++) {
		uint32_t a[4] = {fa_pack(p[2 * j][0], p[2 * j][1]), fa_pack(p[2 * j][2], p[2 * j][3]),
				 fa_pack(p[2 * j + 1][0], p[2 * j + 1][1]),
				 fa_pack(p[2 * j + 1][2], p[2 * j + 1][3])};
#pragma unroll
		for (int d = 0; d < D / 8; d += 2) {
			uint32_t b[4];
			fa_ldm_t(b, &s[j * 16 + row][d * 8 + col]);
			fa_mma(acc[d], a, b[0], b[1]);
			fa_mma(acc[d + 1], a, b[2], b[3]);
		}
	}
}

/* Rows r0 = the thread's first row (g within the warp's 16) and r0 + 8 of a
 * warp's 16 x D accumulator, times scale, to dst (rows ld floats apart);
 * rows at or past T are skipped. */
/* The C tiles c[2j], c[2j+1] (16 x 16, fp32) rounded to bf16 as the A
 * fragment a of a 16-wide k-step: the fragment layouts above. */
static __device__ __forceinline__ void fa_pack_a(uint32_t a[4], const float (*c)[4], int j)
{
	a[0] = fa_pack(c[2 * j][0], c[2 * j][1]);
	a[1] = fa_pack(c[2 * j][2], c[2 * j][3]);
	a[2] = fa_pack(c[2 * j + 1][0], c[2 * j + 1][1]);
	a[3] = fa_pack(c[2 * j + 1][2], c[2 * j + 1][3]);
}

/* For the warp's m-tiles M0 <= mt < M1 (A fragments a1[mt], a2[mt] over the
 * head dimension): x[mt] = A1 B1^T and y[mt] = A2 B2^T (zeroed first) over
 * rows r0 .. r0 + 8 NB - 1 of the shared tiles b1, b2, each ldmatrix.x4 of
 * a B fragment read once for every m-tile; each element's k-steps in
 * increasing order, as fa_mm_nt's. */
template <int D, int NB, int M0, int M1>
static __device__ __forceinline__ void
fa_mm2_nt(float x[2][NB][4], float y[2][NB][4], const uint32_t a1[2][D / 16][4],
	  const uint32_t a2[2][D / 16][4], fa_bf16 (*b1)[D + FA_PAD], fa_bf16 (*b2)[D + FA_PAD],
	  int r0, int lane)
{
#pragma unroll
	for (int mt = M0; mt < M1; mt++)
#pragma unroll
		for (int n = 0; n < NB; n++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				x[mt][n][e] = y[mt][n][e] = 0.f;
	const int row = (lane & 7) + (lane >> 4) * 8, col = ((lane >> 3) & 1) * 8;
#pragma unroll
	for (int n = 0; n < NB; n += 2)
#pragma unroll
		for (int kk = 0; kk < D / 16; kk++) {
			uint32_t b[4];
			fa_ldm(b, &b1[r0 + n * 8 + row][kk * 16 + col]);
#pragma unroll
			for (int mt = M0; mt < M1; mt++) {
				fa_mma(x[mt][n], a1[mt][kk], b[0], b[1]);
				fa_mma(x[mt][n + 1], a1[mt][kk], b[2], b[3]);
			}
			fa_ldm(b, &b2[r0 + n * 8 + row][kk * 16 + col]);
#pragma unroll
			for (int mt = M0; mt < M1; mt++) {
				fa_mma(y[mt][n], a2[mt][kk], b[0], b[1]);
				fa_mma(y[mt][n + 1], a2[mt][kk], b[2], b[3]);
			}
		}
}

template <int D>
static __device__ __forceinline__ void fa_store(float *dst, int ld, const float acc[D / 8][4],
						float scale, int r0, int T, int t)
{
#pragma unroll
	for (int d = 0; d < D / 8; d++) {
		const int c = d * 8 + 2 * t;
		if (r0 < T)
			*reinterpret_cast<float2 *>(dst + (size_t)r0 * ld + c) =
				make_float2(acc[d][0] * scale, acc[d][1] * scale);
		if (r0 + 8 < T)
			*reinterpret_cast<float2 *>(dst + (size_t)(r0 + 8) * ld + c) =
				make_float2(acc[d][2] * scale, acc[d][3] * scale);
	}
}

/* fa_store's rows as bf16 (a bf16 twin of the output), unscaled. */
template <int D>
static __device__ __forceinline__ void fa_store16(fa_bf16 *dst, int ld, const float acc[D / 8][4],
						  int r0, int T, int t)
{
#pragma unroll
	for (int d = 0; d < D / 8; d++) {
		const int c = d * 8 + 2 * t;
		if (r0 < T)
			*reinterpret_cast<uint32_t *>(dst + (size_t)r0 * ld + c) =
				fa_pack(acc[d][0], acc[d][1]);
		if (r0 + 8 < T)
			*reinterpret_cast<uint32_t *>(dst + (size_t)(r0 + 8) * ld + c) =
				fa_pack(acc[d][2], acc[d][3]);
	}
}

/* --- The forward ---
 * A block per (128 queries, head, batch), 4 warps; warp w owns two m16 tiles
 * of the block's rows, 16 w.. and 64 + 16 w.. (interleaved rather than 32
 * rows in a row, so that every warp has the same share of the causal
 * triangle: in the block's last key tile, k0 = q0 + 64, every warp's first
 * m-tile lies past the diagonal and is skipped, its second is on it). Every
 * K and V fragment a warp reads (ldmatrix) feeds the mma's of both m-tiles.
 * Each query row meets the same key tiles (64 keys, from 0 up to the one
 * holding the row's diagonal, inside T) in the same order as under the
 * 16-rows-a-warp layout before it, each element's products summed in the
 * same order; the softmax spends fewer instructions an element
 * (fa_fwd_softmax: an FFMA and ex2.approx.ftz for the power), an arithmetic
 * tests/bench/attn_check.c derives its forward bounds from. Shared memory,
 * four 64-row tiles in both layouts (flash_smem_bytes' FLASH_FWD):
 *  - up to HS 64 Q's A fragments stay in registers (D / 4 a thread for the
 *    warp's 32 rows), staged once through tiles 2, 3; K, V double-buffered
 *    (tiles 0, 1 and 2, 3), the next pair copied while this one is used;
 *  - at HS 128 the O accumulator (32 x 128 fp32: 128 registers a thread)
 *    and the scores (64) leave no room for Q's 64: Q stays in tiles 0, 1
 *    and is read a k-step at a time (ldmatrix), K and V have one tile each
 *    (2, 3) and their copies are staggered as FlashAttention-2 does: V's
 *    while S = Q K^T and the softmax run, the next K's while P V runs. Two
 *    buffers each would not fit the 99 KiB a block may have on
 *    sm_86/89/120. */
#define FA_FWD_ROWS 128 /* queries per forward block */

/* Q held as A fragments in registers (else read from shared memory). Read
 * from shared memory, the k-steps of S = Q K^T are unrolled fully up to
 * sm_90 (ptxas 13.0: 255 registers at HS 128, no spills) and by two from
 * sm_100 on, where fully unrolled they spilled ~100 bytes (sm_120 still
 * spills 4). */
template <int D> struct fa_fwd_cfg {
	static constexpr bool q_regs = D <= 64;
	static constexpr int qk = q_regs ? D / 16 : 1; /* k-steps of Q held */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
	static constexpr int kstep_unroll = 2;
#else
	static constexpr int kstep_unroll = D / 16;
#endif
};

/* s[mt] (16 x 64 as 8 C tiles) = the scores of m-tile mt, M0 <= mt < 2, of
 * the warp against the key tile sK (64 rows x D): Q from qa (q_regs) or from
 * sQ (128 rows; m-tile mt at row 64 mt + 16 warp). The B fragments as in
 * fa_mm_nt, each ldmatrix.x4 read once for both m-tiles; each element's sum
 * over the head dimension runs its k-steps in increasing order from 0. */
template <int D, int M0>
static __device__ __forceinline__ void fa_fwd_scores(float s[2][8][4],
						     const uint32_t (*qa)[fa_fwd_cfg<D>::qk][4],
						     fa_bf16 (*sQ)[D + FA_PAD],
						     fa_bf16 (*sK)[D + FA_PAD], int warp, int lane)
{
#pragma unroll
	for (int mt = M0; mt < 2; mt++)
#pragma unroll
		for (int n = 0; n < 8; n++)
			s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
	const int row = (lane & 7) + (lane >> 4) * 8, col = ((lane >> 3) & 1) * 8;
	if constexpr (fa_fwd_cfg<D>::q_regs) {
#pragma unroll
		for (int n = 0; n < 8; n += 2)
#pragma unroll
			for (int kk = 0; kk < D / 16; kk++) {
				uint32_t b[4];
				fa_ldm(b, &sK[n * 8 + row][kk * 16 + col]);
#pragma unroll
				for (int mt = M0; mt < 2; mt++) {
					fa_mma(s[mt][n], qa[mt][kk], b[0], b[1]);
					fa_mma(s[mt][n + 1], qa[mt][kk], b[2], b[3]);
				}
			}
	} else {
		/* A by ldmatrix.x4 as in fa_mm_nt_s */
		const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;
#pragma unroll(fa_fwd_cfg<D>::kstep_unroll)
		for (int kk = 0; kk < D / 16; kk++) {
			uint32_t a[2][4];
#pragma unroll
			for (int mt = M0; mt < 2; mt++)
				fa_ldm(a[mt], &sQ[mt * 64 + warp * 16 + arow][kk * 16 + acol]);
#pragma unroll
			for (int n = 0; n < 8; n += 2) {
				uint32_t b[4];
				fa_ldm(b, &sK[n * 8 + row][kk * 16 + col]);
#pragma unroll
				for (int mt = M0; mt < 2; mt++) {
					fa_mma(s[mt][n], a[mt], b[0], b[1]);
					fa_mma(s[mt][n + 1], a[mt], b[2], b[3]);
				}
			}
		}
	}
}

/* 2^x by ex2.approx.ftz.f32: the instruction exp2f is built on (2 ulp,
 * CUDA C Programming Guide), without exp2f's fix-up of results under
 * 2^-126, which become 0. */
static __device__ __forceinline__ float fa_ex2(float x)
{
	float y;
	asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
	return y;
}

/* The online softmax of one m-tile over the key tile at k0: s (its raw
 * scores, q . k) becomes P = 2^(s sl2 - m), sl2 = log2(e)/sqrt(HS), masked to
 * 0 past the diagonal and past T; the running max m (log2 units) and sum l
 * of rows r + g and r + g + 8 (r the m-tile's first row) move to this tile,
 * and o is rescaled by 2^(m_old - m_new). The max is taken over the raw
 * scores and scaled once a row: sl2 > 0 and rounding is monotonic, so
 * fl(sl2 max s) = max fl(sl2 s). Each exponent is one FFMA, fl(s sl2 - m),
 * and each power fa_ex2: per element a max, an FFMA, an ex2, an add and
 * half a pack, the mask's compares only in tiles on the diagonal or past T.
 * Every row the loop gives this function has key k0 unmasked (k0 <= the
 * m-tile's first row, k0 < T): the tile's max is finite. */
template <int D>
static __device__ __forceinline__ void fa_fwd_softmax(float s[8][4], float o[D / 8][4], float m[2],
						      float l[2], int k0, int r, int T, float sl2,
						      int g, int t)
{
	if (!(k0 + FA_TILE - 1 <= r && k0 + FA_TILE <= T)) { /* else below the diagonal, inside T */
		const int row0 = r + g, row1 = row0 + 8;
#pragma unroll
		for (int n = 0; n < 8; n++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int col = k0 + n * 8 + 2 * t + (e & 1);
				if (col > (e < 2 ? row0 : row1) || col >= T)
					s[n][e] = -INFINITY;
			}
	}
	float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
	for (int n = 0; n < 8; n++) {
		mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
		mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
	}
	mx0 = fmaxf(m[0], fa_quad_max(mx0) * sl2);
	mx1 = fmaxf(m[1], fa_quad_max(mx1) * sl2);
	const float c0 = exp2f(m[0] - mx0), c1 = exp2f(m[1] - mx1);
	m[0] = mx0;
	m[1] = mx1;
	float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
	for (int n = 0; n < 8; n++) {
		s[n][0] = fa_ex2(fmaf(s[n][0], sl2, -mx0));
		s[n][1] = fa_ex2(fmaf(s[n][1], sl2, -mx0));
		s[n][2] = fa_ex2(fmaf(s[n][2], sl2, -mx1));
		s[n][3] = fa_ex2(fmaf(s[n][3], sl2, -mx1));
		rs0 += s[n][0] + s[n][1];
		rs1 += s[n][2] + s[n][3];
	}
	l[0] = l[0] * c0 + rs0;
	l[1] = l[1] * c1 + rs1;
#pragma unroll
	for (int d = 0; d < D / 8; d++) {
		o[d][0] *= c0;
		o[d][1] *= c0;
		o[d][2] *= c1;
		o[d][3] *= c1;
	}
}

/* P[mt] (16 x 64, the C tiles s[mt]) rounded to bf16 as the A fragments of
 * its four k-steps (16 keys each), M0 <= mt < 2: half the registers of the
 * fp32 scores, which die here. */
template <int M0>
static __device__ __forceinline__ void fa_fwd_pack(uint32_t pa[2][4][4], const float s[2][8][4])
{
#pragma unroll
	for (int mt = M0; mt < 2; mt++)
#pragma unroll
		for (int j = 0; j < 4; j++)
			fa_pack_a(pa[mt][j], s[mt], j);
}

/* o[mt] += P[mt] (its A fragments pa[mt]) times the tile sV (64 rows x D),
 * M0 <= mt < 2; the B fragments as in fa_mm_pv, each ldmatrix.trans read
 * once for both m-tiles; each element's k-steps (16 keys) in increasing
 * order. */
template <int D, int M0>
static __device__ __forceinline__ void fa_fwd_pv(float o[2][D / 8][4], const uint32_t pa[2][4][4],
						 fa_bf16 (*sV)[D + FA_PAD], int lane)
{
	const int row = (lane & 7) + ((lane >> 3) & 1) * 8, col = (lane >> 4) * 8;
#pragma unroll
	for (int j = 0; j < 4; j++)
#pragma unroll
		for (int d = 0; d < D / 8; d += 2) {
			uint32_t b[4];
			fa_ldm_t(b, &sV[j * 16 + row][d * 8 + col]);
#pragma unroll
			for (int mt = M0; mt < 2; mt++) {
				fa_mma(o[mt][d], pa[mt][j], b[0], b[1]);
				fa_mma(o[mt][d + 1], pa[mt][j], b[2], b[3]);
			}
		}
}

/* One key tile (k0) for m-tiles M0.. of the warp: M0 = 1 in the block's
 * last tile, k0 = q0 + 64, past every row of the first m-tiles. sK, sV:
 * this tile's keys and values. Without q_regs (HS 128) sV is still being
 * copied on entry: the copy is waited for after the softmax, and then, with
 * next, the next key tile's copy started into sK, once every warp is done
 * with it. */
template <int D, int M0>
static __device__ __forceinline__ void
fa_fwd_tile(float o[2][D / 8][4], float m[2][2], float l[2][2],
	    const uint32_t (*qa)[fa_fwd_cfg<D>::qk][4], fa_bf16 (*sQ)[D + FA_PAD],
	    fa_bf16 (*sK)[D + FA_PAD], fa_bf16 (*sV)[D + FA_PAD], const fa_bf16 *kb, int ldk,
	    bool next, int k0, int q0, int T, float sl2, int warp, int lane)
{
	const int g = lane >> 2, t = lane & 3;
	float s[2][8][4];
	fa_fwd_scores<D, M0>(s, qa, sQ, sK, warp, lane);
#pragma unroll
	for (int mt = M0; mt < 2; mt++)
		fa_fwd_softmax<D>(s[mt], o[mt], m[mt], l[mt], k0, q0 + mt * 64 + warp * 16, T, sl2,
				  g, t);
	uint32_t pa[2][4][4];
	fa_fwd_pack<M0>(pa, s);
	if constexpr (!fa_fwd_cfg<D>::q_regs) {
		fa_wait<0>();
		__syncthreads(); /* V has landed; every warp is done with K */
		if (next) {
			fa_tile<D>(sK, kb, ldk, k0 + FA_TILE, T);
			fa_commit();
		}
	}
	fa_fwd_pv<D, M0>(o, pa, sV, lane);
}

template <int D>
static __device__ __forceinline__ void flash_fwd(float *out, fa_bf16 *out16, float *lse,
						 const fa_bf16 *q, const fa_bf16 *k, const fa_bf16 *v,
						 int T, int NH, int NKV)
{
	constexpr bool QR = fa_fwd_cfg<D>::q_regs;
	fa_bf16(*tl)[FA_TILE][D + FA_PAD] = fa_tiles<D>();
	/* the heaviest (last) query tiles first, for every head and batch */
	const int h = blockIdx.x, b = blockIdx.y;
	const int q0 = (gridDim.z - 1 - blockIdx.z) * FA_FWD_ROWS;
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D;
	const fa_bf16 *vb = v + (size_t)b * T * ldk + kvh * D;
	/* Q's 128 rows: two consecutive tiles, one [128][D + FA_PAD] array */
	fa_bf16(*sQ)[D + FA_PAD] = tl[QR ? 2 : 0];

	fa_tile<D>(tl[QR ? 2 : 0], qb, ldq, q0, T);
	fa_tile<D>(tl[QR ? 3 : 1], qb, ldq, q0 + FA_TILE, T);
	fa_tile<D>(tl[QR ? 0 : 2], kb, ldk, 0, T);
	if (QR)
		fa_tile<D>(tl[1], vb, ldk, 0, T);
	fa_commit();

	uint32_t qa[2][fa_fwd_cfg<D>::qk][4];
	if constexpr (QR) {
		fa_wait<0>();
		__syncthreads();
#pragma unroll
		for (int mt = 0; mt < 2; mt++)
			fa_frag_a<D>(qa[mt], sQ, mt * 64 + warp * 16, g, t);
		__syncthreads(); /* tiles 2, 3 are free for the second buffers */
	}

	float o[2][D / 8][4], m[2][2], l[2][2];
#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
#pragma unroll
		for (int d = 0; d < D / 8; d++)
			o[mt][d][0] = o[mt][d][1] = o[mt][d][2] = o[mt][d][3] = 0.f;
		m[mt][0] = m[mt][1] = -INFINITY;
		l[mt][0] = l[mt][1] = 0.f;
	}
	const int tiles = (min(T, q0 + FA_FWD_ROWS) - 1) / FA_TILE + 1;
	for (int it = 0; it < tiles; it++) {
		const int k0 = it * FA_TILE;
		const bool next = it + 1 < tiles;
		fa_bf16(*sK)[D + FA_PAD], (*sV)[D + FA_PAD];
		if constexpr (QR) {
			const int buf = it & 1;
			sK = tl[2 * buf];
			sV = tl[2 * buf + 1];
			if (next) {
				fa_tile<D>(tl[2 * (buf ^ 1)], kb, ldk, k0 + FA_TILE, T);
				fa_tile<D>(tl[2 * (buf ^ 1) + 1], vb, ldk, k0 + FA_TILE, T);
				fa_commit();
				fa_wait<1>();
			} else {
				fa_wait<0>();
			}
			__syncthreads();
		} else {
			sK = tl[2];
			sV = tl[3];
			fa_wait<0>();
			__syncthreads(); /* K (and Q) landed; every warp is done with V */
			fa_tile<D>(sV, vb, ldk, k0, T);
			fa_commit();
		}
		/* k0 <= q0: both m-tiles; else (k0 = q0 + 64) the second only */
		if (k0 <= q0)
			fa_fwd_tile<D, 0>(o, m, l, qa, sQ, sK, sV, kb, ldk, next, k0, q0, T, sl2,
					  warp, lane);
		else
			fa_fwd_tile<D, 1>(o, m, l, qa, sQ, sK, sV, kb, ldk, next, k0, q0, T, sl2,
					  warp, lane);
		if constexpr (QR)
			__syncthreads(); /* before the next copy overwrites this buffer */
	}
#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		const int row0 = q0 + mt * 64 + warp * 16 + g, row1 = row0 + 8;
		const float l0 = fa_quad_sum(l[mt][0]), l1 = fa_quad_sum(l[mt][1]);
		const float i0 = 1.f / l0, i1 = 1.f / l1;
#pragma unroll
		for (int d = 0; d < D / 8; d++) {
			o[mt][d][0] *= i0, o[mt][d][1] *= i0;
			o[mt][d][2] *= i1, o[mt][d][3] *= i1;
		}
		if (out)
			fa_store<D>(out + (size_t)b * T * ldq + h * D, ldq, o[mt], 1.f, row0, T, t);
		if (out16)
			fa_store16<D>(out16 + (size_t)b * T * ldq + h * D, ldq, o[mt], row0, T, t);
		if (t == 0) {
			float *lb = lse + ((size_t)b * NH + h) * T;
			if (row0 < T)
				lb[row0] = m[mt][0] + log2f(l0);
			if (row1 < T)
				lb[row1] = m[mt][1] + log2f(l1);
		}
	}
}

/* Dr[(b*NH + h)*T + t] = sum over the head's HS columns of dout * out, and
 * dout16 = dout rounded to bf16 (the backward kernels' copy): a warp per
 * (row, head), lanes over the columns, a fixed shuffle tree. out is read
 * as out16 widened where out16 is not NULL (the forward's bf16 twin: each
 * term then within 2^-8 of dout * out relatively), else in fp32. */
extern "C" __global__ void flash_rowdot_f32(float *dr, fa_bf16 *dout16, const float *dout,
					    const float *out, const fa_bf16 *out16, int B, int T,
					    int NH, int HS)
{
	const int lane = threadIdx.x & 31;
	const size_t n = (size_t)B * T * NH;
	const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
	for (size_t w = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < n; w += warps) {
		const size_t row = w / NH; /* b*T + t */
		const int h = (int)(w % NH);
		const size_t at = row * NH * HS + (size_t)h * HS;
		float s = 0.f;
		for (int c = lane; c < HS; c += 32) {
			const float a = dout[at + c];
			s += a * (out16 ? __bfloat162float(out16[at + c]) : out[at + c]);
			dout16[at + c] = __float2bfloat16_rn(a);
		}
		s = cu_warp_sum(s);
		if (lane == 0) {
			const size_t b = row / T, t = row % T;
			dr[(b * NH + h) * T + t] = s;
		}
	}
}

/* flash_rowdot four columns a lane (HS a power of two, 4 to 128; dout and
 * out 16-byte aligned, out16 and dout16 8-byte: the launcher's test): G =
 * HS / 4 lanes a (row, head), a warp 32 / G of them at once; a lane's four
 * products summed in column order, then the G lanes' xor tree; dout16
 * written four values a lane. The pairs a warp takes are one run (a group
 * past the last pair reads nothing and adds zeros: the shuffles need every
 * lane). The same terms as flash_rowdot's, summed in another fixed order. */
extern "C" __global__ void flash_rowdot4_f32(float *dr, fa_bf16 *dout16, const float *dout,
					     const float *out, const fa_bf16 *out16, int B, int T,
					     int NH, int HS)
{
	const int G = HS / 4, lane = threadIdx.x & 31, sub = lane % G, per = 32 / G;
	const size_t n = (size_t)B * T * NH;
	const size_t warps = ((size_t)gridDim.x * blockDim.x) >> 5;
	for (size_t wb = (((size_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5) * per; wb < n;
	     wb += warps * per) {
		const size_t w = wb + lane / G; /* (b*T + t)*NH + h: row w of HS values */
		float s = 0.f;
		if (w < n) {
			const size_t at = w * HS + 4 * sub;
			const float4 a = *reinterpret_cast<const float4 *>(dout + at);
			float4 o;
			if (out16) {
				const uint2 u = *reinterpret_cast<const uint2 *>(out16 + at);
				o = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
						__uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
			} else {
				o = *reinterpret_cast<const float4 *>(out + at);
			}
			s = a.x * o.x;
			s += a.y * o.y;
			s += a.z * o.z;
			s += a.w * o.w;
			*reinterpret_cast<uint2 *>(dout16 + at) = cu_pack_bf16x4(a);
		}
		for (int off = G / 2; off > 0; off >>= 1)
			s += __shfl_xor_sync(CU_FULL_MASK, s, off);
		if (w < n && sub == 0) {
			const size_t row = w / NH, b = row / T, t = row % T;
			dr[(b * NH + w % NH) * T + t] = s;
		}
	}
}

/* The backward's P rebuilt from a raw score s (q . k) and its row's L:
 * 2^fl(s sl2 - L), one FFMA and fa_ex2 (powers under 2^-126 become 0), as
 * the forward's powers are formed; tests/bench/attn_check.c's backward
 * bounds describe this arithmetic. The caller masks. */
static __device__ __forceinline__ float fa_bwd_p(float s, float sl2, float L)
{
	return fa_ex2(fmaf(s, sl2, -L));
}

/* --- dK, dV with 32 keys a warp (HS <= FA_KV32_MAX = 64) ---
 * A block per (128 keys, head, batch): warp w owns the m16 tiles of keys
 * 16 w and 64 + 16 w of the block, so every Q and dO fragment read (for S^T,
 * dP^T, dV += P^T dO, dK += dS^T Q) feeds the mma's of both; in the block's
 * first query tile (q0 = k0) the second m-tiles' keys are past every query
 * and skipped. Each query tile is taken in parts of fa_kv_cfg<D>::queries
 * queries. Each dK, dV element sums the same products in the same order as
 * under 16 keys a warp (the query tiles, then their 16-query k-steps,
 * increasing), each S and dP element its k-steps from 0: the same values. */
#define FA_KV32_MAX 64
#define FA_KV_ROWS(D) ((D) <= FA_KV32_MAX ? 128 : 64)

/* queries: the part of a query tile flash_bwd_dkdv32 takes at a time (S^T
 * and dP^T of both m-tiles, queries / 2 registers a thread each), the parts
 * in a loop not unrolled; P^T is packed to bf16 before dS^T replaces dP^T.
 * ptxas 13.0 at HS 64 (dK and dV accumulators 128 registers, K's and V's
 * fragments 64): 255 registers on sm_80/90/100, no spills; sm_120 spills 16
 * bytes (20 of loads). */
template <int D> struct fa_kv_cfg {
	static constexpr int queries = D == 64 ? 16 : 32;
};

/* Starts copying rows n0 .. n0 + 63 of the queries qb and their output
 * gradients ob (leading dimension ldq) into the tiles sq, so (one cp.async
 * group), and writes their L and Dr (lb, db) into sl, sd: zeros at or past
 * T. 128 threads. */
template <int D>
static __device__ __forceinline__ void
fa_qdo_load(fa_bf16 (*sq)[D + FA_PAD], fa_bf16 (*so)[D + FA_PAD], float *sl, float *sd,
	    const fa_bf16 *qb, const fa_bf16 *ob, int ldq, const float *lb, const float *db, int n0,
	    int T)
{
	fa_tile<D>(sq, qb, ldq, n0, T);
	fa_tile<D>(so, ob, ldq, n0, T);
	fa_commit();
	for (int i = threadIdx.x; i < FA_TILE; i += FA_THREADS) {
		sl[i] = n0 + i < T ? lb[n0 + i] : 0.f;
		sd[i] = n0 + i < T ? db[n0 + i] : 0.f;
	}
}

/* Part h2 (queries q0 + QP h2..) of the query tile sQ, sdO (their L and Dr
 * in sl, sd) for m-tiles 0..M1-1 of the warp: S^T and dP^T, P^T = fa_bwd_p,
 * masked where the tile needs it, dS^T = P^T (dP^T - Dr), then dV[mt] +=
 * P^T[mt] dO and dK[mt] += dS^T[mt] Q over the part's rows. */
template <int D, int M1>
static __device__ __forceinline__ void
fa_kv_part(float dka[2][D / 8][4], float dva[2][D / 8][4], const uint32_t ka[2][D / 16][4],
	   const uint32_t va[2][D / 16][4], fa_bf16 (*sQ)[D + FA_PAD], fa_bf16 (*sdO)[D + FA_PAD],
	   const float *sl, const float *sd, int h2, int q0, int k0, int T, float sl2, int warp,
	   int lane)
{
	constexpr int QP = fa_kv_cfg<D>::queries, NB = QP / 8;
	const int g = lane >> 2, t = lane & 3;
	float p[2][NB][4], ds[2][NB][4];
	uint32_t pa[2][QP / 16][4];
	/* S^T = K Q^T and dP^T = V dO^T */
	fa_mm2_nt<D, NB, 0, M1>(p, ds, ka, va, sQ, sdO, h2 * QP, lane);
#pragma unroll
	for (int mt = 0; mt < M1; mt++) {
		const int key = k0 + mt * 64 + warp * 16; /* the m-tile's first key */
#pragma unroll
		for (int n = 0; n < NB; n++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				p[mt][n][e] = fa_bwd_p(p[mt][n][e], sl2, sl[h2 * QP + n * 8 + 2 * t + (e & 1)]);
		/* the mask only where some query is before a key of the m-tile or
		 * past T */
		if (!(q0 >= key + 15 && q0 + FA_TILE <= T)) {
#pragma unroll
			for (int n = 0; n < NB; n++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int qr = q0 + h2 * QP + n * 8 + 2 * t + (e & 1);
					if (qr < key + g + (e >> 1) * 8 || qr >= T)
						p[mt][n][e] = 0.f;
				}
		}
		/* P^T rounded to bf16 as the A fragments of the part's k-steps
		 * (the fp32 P^T dies with dS^T) */
#pragma unroll
		for (int j = 0; j < QP / 16; j++)
			fa_pack_a(pa[mt][j], p[mt], j);
#pragma unroll
		for (int n = 0; n < NB; n++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				ds[mt][n][e] =
					p[mt][n][e] * (ds[mt][n][e] - sd[h2 * QP + n * 8 + 2 * t + (e & 1)]);
	}
	/* B fragments as in fa_mm_pv, each ldmatrix.trans read once for both
	 * m-tiles */
	const int trow = (lane & 7) + ((lane >> 3) & 1) * 8, tcol = (lane >> 4) * 8;
#pragma unroll
	for (int j = 0; j < QP / 16; j++)
#pragma unroll
		for (int d = 0; d < D / 8; d += 2) {
			uint32_t b[4];
			fa_ldm_t(b, &sdO[h2 * QP + j * 16 + trow][d * 8 + tcol]);
#pragma unroll
			for (int mt = 0; mt < M1; mt++) {
				fa_mma(dva[mt][d], pa[mt][j], b[0], b[1]); /* dV += P^T dO */
				fa_mma(dva[mt][d + 1], pa[mt][j], b[2], b[3]);
			}
		}
#pragma unroll
	for (int j = 0; j < QP / 16; j++) {
		uint32_t a[2][4];
#pragma unroll
		for (int mt = 0; mt < M1; mt++)
			fa_pack_a(a[mt], ds[mt], j);
#pragma unroll
		for (int d = 0; d < D / 8; d += 2) {
			uint32_t b[4];
			fa_ldm_t(b, &sQ[h2 * QP + j * 16 + trow][d * 8 + tcol]);
#pragma unroll
			for (int mt = 0; mt < M1; mt++) {
				fa_mma(dka[mt][d], a[mt], b[0], b[1]); /* dK += dS^T Q */
				fa_mma(dka[mt][d + 1], a[mt], b[2], b[3]);
			}
		}
	}
}

/* dK, dV with 32 keys a warp: tiles Q[2], dO[2], then L[2][64], Dr[2][64]
 * floats (flash_bwd_dkdv16's layout at two stages); the block's 128 keys and
 * values staged through Q[0..1], dO[0..1] on their way to registers. */
template <int D>
static __device__ __forceinline__ void flash_bwd_dkdv32(float *dk, float *dv, const fa_bf16 *dout,
							const fa_bf16 *q, const fa_bf16 *k,
							const fa_bf16 *v, const float *lse,
							const float *dr, int T, int NH, int NKV)
{
	static_assert(D <= 64 && fa_cfg<D>::stages == 2, "flash_bwd_dkdv32: two stages");
	fa_bf16(*tl)[FA_TILE][D + FA_PAD] = fa_tiles<D>();
	float(*sL)[FA_TILE] = reinterpret_cast<float(*)[FA_TILE]>(tl[4]);
	float(*sD)[FA_TILE] = sL + 2;
	const int k0 = blockIdx.x * FA_KV_ROWS(D), h = blockIdx.y, b = blockIdx.z;
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D;
	const fa_bf16 *ob = dout + (size_t)b * T * ldq + h * D;
	const float *lb = lse + ((size_t)b * NH + h) * T;
	const float *db = dr + ((size_t)b * NH + h) * T;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D;
	const fa_bf16 *vb = v + (size_t)b * T * ldk + kvh * D;

	/* the keys (tiles 0, 1) and values (2, 3): one [128][D + FA_PAD] array
	 * each */
	fa_tile<D>(tl[0], kb, ldk, k0, T);
	fa_tile<D>(tl[1], kb, ldk, k0 + FA_TILE, T);
	fa_tile<D>(tl[2], vb, ldk, k0, T);
	fa_tile<D>(tl[3], vb, ldk, k0 + FA_TILE, T);
	fa_commit();
	fa_wait<0>();
	__syncthreads();
	uint32_t ka[2][D / 16][4], va[2][D / 16][4];
#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		fa_frag_a<D>(ka[mt], tl[0], mt * 64 + warp * 16, g, t);
		fa_frag_a<D>(va[mt], tl[2], mt * 64 + warp * 16, g, t);
	}
	__syncthreads(); /* the staging tiles are free */
	/* the first query tile: q0 = k0 */
	fa_qdo_load<D>(tl[0], tl[2], sL[0], sD[0], qb, ob, ldq, lb, db, k0, T);

	float dka[2][D / 8][4], dva[2][D / 8][4];
#pragma unroll
	for (int mt = 0; mt < 2; mt++)
#pragma unroll
		for (int d = 0; d < D / 8; d++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				dka[mt][d][e] = dva[mt][d][e] = 0.f;
	const int tiles = (T - 1) / FA_TILE + 1 - k0 / FA_TILE;
	for (int it = 0; it < tiles; it++) {
		const int q0 = k0 + it * FA_TILE, buf = it & 1;
		if (it + 1 < tiles) {
			const int n0 = q0 + FA_TILE;
			fa_qdo_load<D>(tl[buf ^ 1], tl[2 + (buf ^ 1)], sL[buf ^ 1], sD[buf ^ 1], qb,
				       ob, ldq, lb, db, n0, T);
			fa_wait<1>();
		} else {
			fa_wait<0>();
		}
		__syncthreads();
		fa_bf16(*sQ)[D + FA_PAD] = tl[buf];
		fa_bf16(*sdO)[D + FA_PAD] = tl[2 + buf];
		/* it 0 (q0 = k0): the first m-tiles only, the second's keys
		 * being past every query of the tile */
		if (it == 0) {
#pragma unroll 1
			for (int h2 = 0; h2 < FA_TILE / fa_kv_cfg<D>::queries; h2++)
				fa_kv_part<D, 1>(dka, dva, ka, va, sQ, sdO, sL[buf], sD[buf], h2, q0, k0,
						 T, sl2, warp, lane);
		} else {
#pragma unroll 1
			for (int h2 = 0; h2 < FA_TILE / fa_kv_cfg<D>::queries; h2++)
				fa_kv_part<D, 2>(dka, dva, ka, va, sQ, sdO, sL[buf], sD[buf], h2, q0, k0,
						 T, sl2, warp, lane);
		}
		__syncthreads(); /* before the next copy overwrites this buffer */
	}
	const float scale = rsqrtf((float)D);
	const int ldo = NH == NKV ? ldk : ldq;
#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		const int key0 = k0 + mt * 64 + warp * 16 + g;
		fa_store<D>(dk + (size_t)b * T * ldo + h * D, ldo, dka[mt], scale, key0, T, t);
		fa_store<D>(dv + (size_t)b * T * ldo + h * D, ldo, dva[mt], 1.f, key0, T, t);
	}
}

/* dK, dV with 16 keys a warp, a block per 64 keys (HS > FA_KV32_MAX). */
/* One warp's part of a query tile for dK and dV at 16 keys a warp (flash_bwd_dkdv16,
 * flash_bwd_dkdv16x8): its keys kw.. are rows wrow.. of sK, sV (AS) or in
 * its A fragments ka, va; the queries q0.. are sQ, sdO with their L, Dr
 * in sl, sd. S^T and dP^T, P^T = 2^fl(s sl2 - L) (fa_bwd_p) masked only
 * where some query is before a key of this warp or past T, dS^T, then
 * dV += P^T dO and dK += dS^T Q. */
template <int D, bool AS>
static __device__ __forceinline__ void
fa_kv16_tile(float dka[D / 8][4], float dva[D / 8][4], fa_bf16 (*sK)[D + FA_PAD],
	     fa_bf16 (*sV)[D + FA_PAD], int wrow, const uint32_t (*ka)[4], const uint32_t (*va)[4],
	     fa_bf16 (*sQ)[D + FA_PAD], fa_bf16 (*sdO)[D + FA_PAD], const float *sl,
	     const float *sd, int q0, int kw, int T, float sl2, int lane)
{
	const int g = lane >> 2, t = lane & 3, key0 = kw + g, key1 = key0 + 8;
	float p[8][4], ds[8][4];
	if constexpr (AS) {
		fa_mm_nt_s<D>(p, sK, wrow, sQ, lane);   /* S^T: keys x queries */
		fa_mm_nt_s<D>(ds, sV, wrow, sdO, lane); /* dP^T = V dO^T */
	} else {
		fa_mm_nt<D>(p, ka, sQ, lane);
		fa_mm_nt<D>(ds, va, sdO, lane);
	}
#pragma unroll
	for (int n = 0; n < 8; n++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			p[n][e] = fa_bwd_p(p[n][e], sl2, sl[n * 8 + 2 * t + (e & 1)]);
	if (!(q0 >= kw + 15 && q0 + FA_TILE <= T)) {
#pragma unroll
		for (int n = 0; n < 8; n++)
#pragma unroll
			for (int e = 0; e < 4; e++) {
				const int qr = q0 + n * 8 + 2 * t + (e & 1);
				if (qr < (e < 2 ? key0 : key1) || qr >= T)
					p[n][e] = 0.f;
			}
	}
#pragma unroll
	for (int n = 0; n < 8; n++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			ds[n][e] = p[n][e] * (ds[n][e] - sd[n * 8 + 2 * t + (e & 1)]);
	fa_mm_pv<D>(dva, p, sdO, lane); /* dV += P^T dO */
	fa_mm_pv<D>(dka, ds, sQ, lane); /* dK += dS^T Q */
}

template <int D>
static __device__ __forceinline__ void flash_bwd_dkdv16(float *dk, float *dv, const fa_bf16 *dout,
						      const fa_bf16 *q, const fa_bf16 *k,
						      const fa_bf16 *v, const float *lse,
						      const float *dr, int T, int NH, int NKV)
{
	constexpr int ST = fa_cfg<D>::stages;
	constexpr bool AS = fa_cfg<D>::a_smem;
	/* tiles: Q[ST], dO[ST], then K, V when read from shared memory (AS);
	 * then L[ST][64], Dr[ST][64] floats. Without AS, K and V pass through
	 * Q[1], dO[1] on their way to registers. */
	fa_bf16(*tl)[FA_TILE][D + FA_PAD] = fa_tiles<D>();
	fa_bf16(*sK)[D + FA_PAD] = AS ? tl[2 * ST] : tl[1];
	fa_bf16(*sV)[D + FA_PAD] = AS ? tl[2 * ST + 1] : tl[ST + 1];
	float(*sL)[FA_TILE] = reinterpret_cast<float(*)[FA_TILE]>(tl[2 * ST + (AS ? 2 : 0)]);
	float(*sD)[FA_TILE] = sL + ST;
	const int k0 = blockIdx.x * FA_TILE, h = blockIdx.y, b = blockIdx.z;
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D;
	const fa_bf16 *ob = dout + (size_t)b * T * ldq + h * D;
	const float *lb = lse + ((size_t)b * NH + h) * T;
	const float *db = dr + ((size_t)b * NH + h) * T;

	/* The keys and values, and the first query tile. */
	fa_tile<D>(sK, k + (size_t)b * T * ldk + kvh * D, ldk, k0, T);
	fa_tile<D>(sV, v + (size_t)b * T * ldk + kvh * D, ldk, k0, T);
	fa_qdo_load<D>(tl[0], tl[ST], sL[0], sD[0], qb, ob, ldq, lb, db, k0, T);
	fa_wait<0>();
	__syncthreads();
	uint32_t ka[AS ? 1 : D / 16][4], va[AS ? 1 : D / 16][4];
	if constexpr (!AS) {
		fa_frag_a<D>(ka, sK, warp * 16, g, t);
		fa_frag_a<D>(va, sV, warp * 16, g, t);
		__syncthreads(); /* Q[1], dO[1] are free */
	}

	const int key0 = k0 + warp * 16 + g;
	float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
	for (int d = 0; d < D / 8; d++)
		for (int e = 0; e < 4; e++)
			dka[d][e] = dva[d][e] = 0.f;
	const int tiles = (T - 1) / FA_TILE + 1 - blockIdx.x;
	for (int it = 0; it < tiles; it++) {
		const int q0 = k0 + it * FA_TILE, buf = ST == 2 ? it & 1 : 0;
		if (ST == 2 && it + 1 < tiles) {
			const int n0 = q0 + FA_TILE;
			fa_qdo_load<D>(tl[buf ^ 1], tl[ST + (buf ^ 1)], sL[buf ^ 1], sD[buf ^ 1], qb,
				       ob, ldq, lb, db, n0, T);
			fa_wait<1>();
		} else {
			fa_wait<0>();
		}
		__syncthreads();
		fa_bf16(*sQ)[D + FA_PAD] = tl[buf];
		fa_bf16(*sdO)[D + FA_PAD] = tl[ST + buf];
		if (q0 + FA_TILE - 1 >= k0 + warp * 16) /* else every query is before these keys */
			fa_kv16_tile<D, AS>(dka, dva, sK, sV, warp * 16, ka, va, sQ, sdO, sL[buf], sD[buf],
					    q0, k0 + warp * 16, T, sl2, lane);
		__syncthreads();
		if (ST == 1 && it + 1 < tiles) {
			const int n0 = q0 + FA_TILE;
			fa_qdo_load<D>(tl[0], tl[1], sL[0], sD[0], qb, ob, ldq, lb, db, n0, T);
		}
	}
	const float scale = rsqrtf((float)D);
	const int ldo = NH == NKV ? ldk : ldq;
	fa_store<D>(dk + (size_t)b * T * ldo + h * D, ldo, dka, scale, key0, T, t);
	fa_store<D>(dv + (size_t)b * T * ldo + h * D, ldo, dva, 1.f, key0, T, t);
}

/* dK, dV with 16 keys a warp and FA_KV16_WARPS = 8 warps, a block per 128
 * keys (HS 128 where a block may have FA_KV16X8_SMEM bytes of shared
 * memory: sm_80/90/100; gpu/cuda/cuda_ops.c falls back to flash_bwd_dkdv16
 * where it may not). Warp w owns keys 16 w.. of the block, as a warp of
 * flash_bwd_dkdv16 does; each query tile copied serves twice the warps, and
 * is double-buffered (the next copied while this one is used). Tiles: Q[2]
 * (0, 1), dO[2] (2, 3), the block's keys (4, 5) and values (6, 7) as
 * [128][D + FA_PAD] arrays, then L[2][64], Dr[2][64] floats. Each warp
 * walks the query tiles from the one at its keys on (warps 4-7 skip the
 * block's first, every query of it being before their keys), its keys
 * meeting the same tiles in the same order with the same arithmetic as in
 * flash_bwd_dkdv16: the same bits. */
#define FA_KV16_WARPS 8
#define FA_KV16X8_SMEM(D) (8 * FA_TILE * ((D) + FA_PAD) * 2 + 2 * 2 * FA_TILE * 4)

/* Starts copying L and Dr of queries n0..n0+63 into sl, sd (threads 0-127,
 * one float each); those at or past T are zeroed. */
static __device__ __forceinline__ void fa_rows(float *sl, float *sd, const float *lb,
					       const float *db, int n0, int T)
{
	const int i = threadIdx.x & (FA_TILE - 1);
	float *dst = threadIdx.x < FA_TILE ? sl : sd;
	const float *src = threadIdx.x < FA_TILE ? lb : db;
	if (threadIdx.x < 2 * FA_TILE) {
		if (n0 + i < T)
			fa_cp4(dst + i, src + n0 + i);
		else
			dst[i] = 0.f;
	}
}

template <int D>
static __device__ __forceinline__ void flash_bwd_dkdv16x8(float *dk, float *dv,
							  const fa_bf16 *dout, const fa_bf16 *q,
							  const fa_bf16 *k, const fa_bf16 *v,
							  const float *lse, const float *dr, int T,
							  int NH, int NKV)
{
	constexpr int NT = FA_KV16_WARPS * 32, ROWS = FA_KV16_WARPS * 16;
	fa_bf16(*tl)[FA_TILE][D + FA_PAD] = fa_tiles<D>();
	fa_bf16(*sK)[D + FA_PAD] = tl[4];
	fa_bf16(*sV)[D + FA_PAD] = tl[6];
	float(*sL)[FA_TILE] = reinterpret_cast<float(*)[FA_TILE]>(tl[8]);
	float(*sD)[FA_TILE] = sL + 2;
	const int k0 = blockIdx.x * ROWS, h = blockIdx.y, b = blockIdx.z;
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D;
	const fa_bf16 *ob = dout + (size_t)b * T * ldq + h * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D;
	const fa_bf16 *vb = v + (size_t)b * T * ldk + kvh * D;
	const float *lb = lse + ((size_t)b * NH + h) * T;
	const float *db = dr + ((size_t)b * NH + h) * T;

	/* The keys and values, and the first query tile (q0 = k0). */
	fa_tile<D, NT>(tl[4], kb, ldk, k0, T);
	fa_tile<D, NT>(tl[5], kb, ldk, k0 + FA_TILE, T);
	fa_tile<D, NT>(tl[6], vb, ldk, k0, T);
	fa_tile<D, NT>(tl[7], vb, ldk, k0 + FA_TILE, T);
	fa_tile<D, NT>(tl[0], qb, ldq, k0, T);
	fa_tile<D, NT>(tl[2], ob, ldq, k0, T);
	fa_rows(sL[0], sD[0], lb, db, k0, T);
	fa_commit();

	const int kw = k0 + warp * 16; /* the warp's first key */
	const int key0 = kw + g;
	float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
	for (int d = 0; d < D / 8; d++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			dka[d][e] = dva[d][e] = 0.f;
	const int tiles = (T - 1) / FA_TILE + 1 - k0 / FA_TILE;
	for (int it = 0; it < tiles; it++) {
		const int q0 = k0 + it * FA_TILE, buf = it & 1;
		if (it + 1 < tiles) {
			const int n0 = q0 + FA_TILE;
			fa_tile<D, NT>(tl[buf ^ 1], qb, ldq, n0, T);
			fa_tile<D, NT>(tl[2 + (buf ^ 1)], ob, ldq, n0, T);
			fa_rows(sL[buf ^ 1], sD[buf ^ 1], lb, db, n0, T);
			fa_commit();
			fa_wait<1>();
		} else {
			fa_wait<0>();
		}
		__syncthreads();
		fa_bf16(*sQ)[D + FA_PAD] = tl[buf];
		fa_bf16(*sdO)[D + FA_PAD] = tl[2 + buf];
		if (q0 + FA_TILE - 1 >= kw) /* else every query is before these keys */
			fa_kv16_tile<D, true>(dka, dva, sK, sV, warp * 16, nullptr, nullptr, sQ, sdO,
					      sL[buf], sD[buf], q0, kw, T, sl2, lane);
		__syncthreads(); /* before the next copy overwrites this buffer */
	}
	const float scale = rsqrtf((float)D);
	const int ldo = NH == NKV ? ldk : ldq;
	fa_store<D>(dk + (size_t)b * T * ldo + h * D, ldo, dka, scale, key0, T, t);
	fa_store<D>(dv + (size_t)b * T * ldo + h * D, ldo, dva, 1.f, key0, T, t);
}

/* dk, dv: (B,T,NH,HS) when NH > NKV (the per-head partials), else the
 * (B,T,NKV,HS) gradients themselves; block (key tile of FA_KV_ROWS(D),
 * query head h, b). */
template <int D>
static __device__ __forceinline__ void flash_bwd_dkdv(float *dk, float *dv, const fa_bf16 *dout,
						      const fa_bf16 *q, const fa_bf16 *k,
						      const fa_bf16 *v, const float *lse,
						      const float *dr, int T, int NH, int NKV)
{
	if constexpr (D <= FA_KV32_MAX)
		flash_bwd_dkdv32<D>(dk, dv, dout, q, k, v, lse, dr, T, NH, NKV);
	else
		flash_bwd_dkdv16<D>(dk, dv, dout, q, k, v, lse, dr, T, NH, NKV);
}

/* dk[b,t,j,:] = sum over the rep query heads of kv head j, in head order, of
 * the partials pk[b,t,j*rep + r,:] (flash_bwd_dkdv); dv likewise. A thread
 * per 4 values of (B*T, NKV, HS). */
extern "C" __global__ void flash_kv_reduce_f32(float *dk, float *dv, const float *pk,
					       const float *pv, int rows, int NH, int NKV, int HS)
{
	const int rep = NH / NKV, q4 = NKV * HS / 4;
	const size_t n = (size_t)rows * q4;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const size_t row = i / q4;
		const int c = (int)(i % q4) * 4, j = c / HS, d = c % HS;
		const size_t src = row * NH * HS + (size_t)j * rep * HS + d;
		float4 sk = *reinterpret_cast<const float4 *>(pk + src);
		float4 sv = *reinterpret_cast<const float4 *>(pv + src);
		for (int r = 1; r < rep; r++) {
			const float4 a = *reinterpret_cast<const float4 *>(pk + src + (size_t)r * HS);
			const float4 w = *reinterpret_cast<const float4 *>(pv + src + (size_t)r * HS);
			sk.x += a.x, sk.y += a.y, sk.z += a.z, sk.w += a.w;
			sv.x += w.x, sv.y += w.y, sv.z += w.z, sv.w += w.w;
		}
		*reinterpret_cast<float4 *>(dk + row * NKV * HS + c) = sk;
		*reinterpret_cast<float4 *>(dv + row * NKV * HS + c) = sv;
	}
}

/* flash_kv_reduce_f32's sums (the same order: value by value over the
 * partials in head order), then dk rotated back as rope_backward4_f32
 * rotates it (rope.cu: the pair (d, d + HS/2) at position row % T, the
 * tables rc, rs of (T, HS/2), the sine negated), and both rounded to bf16
 * into the rows of d16 (ld16 values a row, dk's kv head j at column ok + j
 * HS, dv's at ov + j HS) as cast_bf16_f32_rows4 rounds them; dk, dv
 * written where not NULL. A thread per four pairs of (B*T, NKV): HS/2 a
 * multiple of 4, every row of d16 and the tables 8- and 16-byte aligned
 * (the launcher's condition). */
extern "C" __global__ void flash_kv_reduce_rope_f32(float *dk, float *dv, const float *pk,
						    const float *pv, const float *rc,
						    const float *rs, __nv_bfloat16 *d16, int ld16,
						    int ok, int ov, int rows, int T, int NH, int NKV,
						    int HS)
{
	const int rep = NH / NKV, H2 = HS / 2, q4 = NKV * H2 / 4;
	const size_t n = (size_t)rows * q4;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const size_t row = i / q4;
		const int u = (int)(i % q4) * 4, j = u / H2, d = u % H2;
		const size_t src = row * NH * HS + (size_t)j * rep * HS + d;
		float4 k1 = *reinterpret_cast<const float4 *>(pk + src);
		float4 k2 = *reinterpret_cast<const float4 *>(pk + src + H2);
		float4 v1 = *reinterpret_cast<const float4 *>(pv + src);
		float4 v2 = *reinterpret_cast<const float4 *>(pv + src + H2);
		for (int r = 1; r < rep; r++) {
			const size_t o = src + (size_t)r * HS;
			const float4 a1 = *reinterpret_cast<const float4 *>(pk + o);
			const float4 a2 = *reinterpret_cast<const float4 *>(pk + o + H2);
			const float4 w1 = *reinterpret_cast<const float4 *>(pv + o);
			const float4 w2 = *reinterpret_cast<const float4 *>(pv + o + H2);
			k1.x += a1.x, k1.y += a1.y, k1.z += a1.z, k1.w += a1.w;
			k2.x += a2.x, k2.y += a2.y, k2.z += a2.z, k2.w += a2.w;
			v1.x += w1.x, v1.y += w1.y, v1.z += w1.z, v1.w += w1.w;
			v2.x += w2.x, v2.y += w2.y, v2.z += w2.z, v2.w += w2.w;
		}
		const int t = (int)(row % (size_t)T);
		const float4 c = *reinterpret_cast<const float4 *>(rc + (size_t)t * H2 + d);
		float4 s = *reinterpret_cast<const float4 *>(rs + (size_t)t * H2 + d);
		s = make_float4(-1.0f * s.x, -1.0f * s.y, -1.0f * s.z, -1.0f * s.w);
		float4 y1, y2;
		cu_rope4(k1, k2, c, s, y1, y2);
		const size_t dst = row * NKV * HS + (size_t)j * HS + d;
		if (dk) {
			*reinterpret_cast<float4 *>(dk + dst) = y1;
			*reinterpret_cast<float4 *>(dk + dst + H2) = y2;
		}
		if (dv) {
			*reinterpret_cast<float4 *>(dv + dst) = v1;
			*reinterpret_cast<float4 *>(dv + dst + H2) = v2;
		}
		__nv_bfloat16 *o16 = d16 + row * (size_t)ld16 + (size_t)j * HS + d;
		*reinterpret_cast<uint2 *>(o16 + ok) = cu_pack_bf16x4(y1);
		*reinterpret_cast<uint2 *>(o16 + ok + H2) = cu_pack_bf16x4(y2);
		*reinterpret_cast<uint2 *>(o16 + ov) = cu_pack_bf16x4(v1);
		*reinterpret_cast<uint2 *>(o16 + ov + H2) = cu_pack_bf16x4(v2);
	}
}

/* --- dQ ---
 * A block per (FA_DQ_ROWS(D) queries, head, batch), grid (NH, B, query
 * tiles) with the heaviest (last) query tiles of every head first; the keys
 * in tiles of 64 up to the diagonal, the next tile copied while this one is
 * used; each block owns its dQ
 * rows and adds its key tiles in increasing order. Up to HS 64, as in the
 * forward, warp w owns two m16 tiles, rows 16 w and 64 + 16 w of the
 * block's 128, so every K and V fragment read feeds the mma's of both; each
 * key tile is taken in parts of 32 keys (16 at HS 64: fa_dq_cfg; S and dP
 * of both m-tiles, 16 x 32 each, then dQ += dS K over the part's k-steps),
 * which keeps S and dP at 64 registers (32) beside dQ's accumulators (D / 2
 * a thread) and Q's and dO's fragments (D / 4 each). At HS 128 dQ's
 * accumulator alone would be 128 registers a thread for 32 rows: a warp
 * keeps 16 rows, and a block of 128 queries has 8 warps (flash_bwd_dq16,
 * FA_DQ_THREADS).
 * Either way each dQ element sums the same products in the same order (the
 * key tiles, then their 16-key k-steps, in increasing order), and each S
 * and dP element its head dimension's k-steps from 0 up: the same values. */
#define FA_DQ_ROWS(D) 128
#define FA_DQ_THREADS(D) ((D) <= 64 ? FA_THREADS : 256) /* flash_bwd_dq16: 8 warps */

/* keys: the part of a key tile flash_bwd_dq32 takes at a time (S and dP of
 * both m-tiles: keys / 2 registers a thread each), the parts in a loop not
 * unrolled. ptxas 13.0, sm_90: at HS 64, parts of 32 keys spilled (16 bytes,
 * 44 with the loop unrolled) at 255 registers; of 16, 226 and none. */
template <int D> struct fa_dq_cfg {
	static constexpr int keys = D == 64 ? 16 : 32;
};

/* Part h2 (keys k0 + KP h2.., KP = fa_dq_cfg<D>::keys) of the key tile sK,
 * sV for m-tiles M0.. of the warp (M0 = 1 in the block's last tile, k0 = q0
 * + 64, past every row of the first m-tiles): S and dP, dS = P (dP - Dr)
 * with P = fa_bwd_p of L, masked where the tile needs it, and dQ[mt] +=
 * dS[mt] K (the part's KP rows). L, Dr: the rows g and g + 8 of each
 * m-tile. */
template <int D, int M0>
static __device__ __forceinline__ void
fa_dq_part(float dqa[2][D / 8][4], const uint32_t qa[2][D / 16][4], const uint32_t oa[2][D / 16][4],
	   fa_bf16 (*sK)[D + FA_PAD], fa_bf16 (*sV)[D + FA_PAD], int h2, int k0, int q0, int T,
	   float sl2, const float L[2][2], const float Dr[2][2], int warp, int lane)
{
	constexpr int KP = fa_dq_cfg<D>::keys, NB = KP / 8; /* its 8-key blocks */
	const int g = lane >> 2, t = lane & 3;
	float s[2][NB][4], ds[2][NB][4];
	/* S = Q K^T and dP = dO V^T */
	fa_mm2_nt<D, NB, M0, 2>(s, ds, qa, oa, sK, sV, h2 * KP, lane);
#pragma unroll
	for (int mt = M0; mt < 2; mt++) {
		const int r = q0 + mt * 64 + warp * 16; /* the m-tile's first row */
#pragma unroll
		for (int n = 0; n < NB; n++)
#pragma unroll
			for (int e = 0; e < 4; e++)
				ds[mt][n][e] = fa_bwd_p(s[mt][n][e], sl2, L[mt][e >> 1]) *
					       (ds[mt][n][e] - Dr[mt][e >> 1]);
		/* the mask on dS (as in flash_bwd_dq16) only in tiles on the
		 * diagonal or past T */
		if (!(k0 + FA_TILE - 1 <= r && k0 + FA_TILE <= T)) {
#pragma unroll
			for (int n = 0; n < NB; n++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int c = k0 + h2 * KP + n * 8 + 2 * t + (e & 1);
					if (c > r + g + (e >> 1) * 8 || c >= T)
						ds[mt][n][e] = 0.f;
				}
		}
	}
	/* dQ += dS K: B fragments as in fa_mm_pv (the part's k-steps of 16
	 * keys), each ldmatrix.trans read once for both m-tiles */
	const int trow = (lane & 7) + ((lane >> 3) & 1) * 8, tcol = (lane >> 4) * 8;
#pragma unroll
	for (int j = 0; j < KP / 16; j++) {
		uint32_t a[2][4];
#pragma unroll
		for (int mt = M0; mt < 2; mt++)
			fa_pack_a(a[mt], ds[mt], j);
#pragma unroll
		for (int d = 0; d < D / 8; d += 2) {
			uint32_t b[4];
			fa_ldm_t(b, &sK[h2 * KP + j * 16 + trow][d * 8 + tcol]);
#pragma unroll
			for (int mt = M0; mt < 2; mt++) {
				fa_mma(dqa[mt][d], a[mt], b[0], b[1]);
				fa_mma(dqa[mt][d + 1], a[mt], b[2], b[3]);
			}
		}
	}
}

/* dQ with 32 rows a warp (HS <= 64): K and V double-buffered in tiles 0, 1
 * and 2, 3; the block's queries and output gradients (128 rows each) staged
 * through tiles 0, 1 and 2, 3 on their way to registers. */
template <int D>
static __device__ __forceinline__ void flash_bwd_dq32(float *dq, const fa_bf16 *dout,
						      const fa_bf16 *q, const fa_bf16 *k,
						      const fa_bf16 *v, const float *lse,
						      const float *dr, int T, int NH, int NKV)
{
	static_assert(D <= 64, "flash_bwd_dq32: Q's and dO's fragments in registers");
	fa_bf16(*tl)[FA_TILE][D + FA_PAD] = fa_tiles<D>();
	const int h = blockIdx.x, b = blockIdx.y;
	const int q0 = (gridDim.z - 1 - blockIdx.z) * FA_DQ_ROWS(D);
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D;
	const fa_bf16 *ob = dout + (size_t)b * T * ldq + h * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D;
	const fa_bf16 *vb = v + (size_t)b * T * ldk + kvh * D;

	/* Q's 128 rows in tiles 0, 1, dO's in 2, 3: one [128][D + FA_PAD]
	 * array each */
	fa_tile<D>(tl[0], qb, ldq, q0, T);
	fa_tile<D>(tl[1], qb, ldq, q0 + FA_TILE, T);
	fa_tile<D>(tl[2], ob, ldq, q0, T);
	fa_tile<D>(tl[3], ob, ldq, q0 + FA_TILE, T);
	fa_commit();
	const float *lb = lse + ((size_t)b * NH + h) * T;
	const float *db = dr + ((size_t)b * NH + h) * T;
	float L[2][2], Dr[2][2];
#pragma unroll
	for (int mt = 0; mt < 2; mt++)
#pragma unroll
		for (int i = 0; i < 2; i++) {
			const int r = q0 + mt * 64 + warp * 16 + g + 8 * i;
			L[mt][i] = r < T ? lb[r] : 0.f;
			Dr[mt][i] = r < T ? db[r] : 0.f;
		}
	fa_wait<0>();
	__syncthreads();
	uint32_t qa[2][D / 16][4], oa[2][D / 16][4];
#pragma unroll
	for (int mt = 0; mt < 2; mt++) {
		fa_frag_a<D>(qa[mt], tl[0], mt * 64 + warp * 16, g, t);
		fa_frag_a<D>(oa[mt], tl[2], mt * 64 + warp * 16, g, t);
	}
	__syncthreads(); /* the staging tiles are free */
	fa_tile<D>(tl[0], kb, ldk, 0, T);
	fa_tile<D>(tl[2], vb, ldk, 0, T);
	fa_commit();

	float dqa[2][D / 8][4];
#pragma unroll
	for (int mt = 0; mt < 2; mt++)
#pragma unroll
		for (int d = 0; d < D / 8; d++)
			dqa[mt][d][0] = dqa[mt][d][1] = dqa[mt][d][2] = dqa[mt][d][3] = 0.f;
	const int tiles = (min(T, q0 + FA_DQ_ROWS(D)) - 1) / FA_TILE + 1;
	for (int it = 0; it < tiles; it++) {
		const int k0 = it * FA_TILE, buf = it & 1;
		if (it + 1 < tiles) {
			fa_tile<D>(tl[buf ^ 1], kb, ldk, k0 + FA_TILE, T);
			fa_tile<D>(tl[2 + (buf ^ 1)], vb, ldk, k0 + FA_TILE, T);
			fa_commit();
			fa_wait<1>();
		} else {
			fa_wait<0>();
		}
		__syncthreads();
		fa_bf16(*sK)[D + FA_PAD] = tl[buf];
		fa_bf16(*sV)[D + FA_PAD] = tl[2 + buf];
		/* k0 <= q0: both m-tiles; else (k0 = q0 + 64) the second only */
		if (k0 <= q0) {
#pragma unroll 1
			for (int h2 = 0; h2 < FA_TILE / fa_dq_cfg<D>::keys; h2++)
				fa_dq_part<D, 0>(dqa, qa, oa, sK, sV, h2, k0, q0, T, sl2, L, Dr, warp,
						 lane);
		} else {
#pragma unroll 1
			for (int h2 = 0; h2 < FA_TILE / fa_dq_cfg<D>::keys; h2++)
				fa_dq_part<D, 1>(dqa, qa, oa, sK, sV, h2, k0, q0, T, sl2, L, Dr, warp,
						 lane);
		}
		__syncthreads(); /* before the next copy overwrites this buffer */
	}
	const float scale = rsqrtf((float)D);
#pragma unroll
	for (int mt = 0; mt < 2; mt++)
		fa_store<D>(dq + (size_t)b * T * ldq + h * D, ldq, dqa[mt], scale,
			    q0 + mt * 64 + warp * 16 + g, T, t);
}

/* dQ with 16 rows a warp (HS 128), FA_DQ16_WARPS = 8 warps: a block per 128
 * queries, warp w owning rows 16 w.. of them, so that each K and V tile
 * copied to shared memory serves twice the warps (the block of 64 queries
 * and 4 warps before it copied every tile twice as often). K and V
 * double-buffered in tiles 0, 1 and 2, 3 (the next pair copied while this
 * one is used: 4 tiles, 68 KiB, within the 99 KiB of sm_86/89/120); the
 * block's queries and output gradients (128 rows each) staged through them
 * on their way to registers, as in flash_bwd_dq32. Each warp walks the key
 * tiles from 0 up to the one holding its last row's diagonal (it skips the
 * block's last tile, k0 = q0 + 64, when its rows are before it), its rows
 * meeting the same tiles in the same order with the same arithmetic as
 * under 64-query blocks of 4 warps: the same bits. */
#define FA_DQ16_WARPS 8

template <int D>
static __device__ __forceinline__ void flash_bwd_dq16(float *dq, const fa_bf16 *dout,
						      const fa_bf16 *q, const fa_bf16 *k,
						      const fa_bf16 *v, const float *lse,
						      const float *dr, int T, int NH, int NKV)
{
	constexpr int NT = FA_DQ16_WARPS * 32;
	static_assert(FA_DQ_ROWS(D) == FA_DQ16_WARPS * 16, "flash_bwd_dq16: 16 rows a warp");
	fa_bf16(*tl)[FA_TILE][D + FA_PAD] = fa_tiles<D>();
	const int h = blockIdx.x, b = blockIdx.y;
	const int q0 = (gridDim.z - 1 - blockIdx.z) * FA_DQ_ROWS(D);
	const int kvh = h / (NH / NKV), ldq = NH * D, ldk = NKV * D;
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D;
	const fa_bf16 *ob = dout + (size_t)b * T * ldq + h * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D;
	const fa_bf16 *vb = v + (size_t)b * T * ldk + kvh * D;

	/* Q's 128 rows in tiles 0, 1, dO's in 2, 3: one [128][D + FA_PAD]
	 * array each */
	fa_tile<D, NT>(tl[0], qb, ldq, q0, T);
	fa_tile<D, NT>(tl[1], qb, ldq, q0 + FA_TILE, T);
	fa_tile<D, NT>(tl[2], ob, ldq, q0, T);
	fa_tile<D, NT>(tl[3], ob, ldq, q0 + FA_TILE, T);
	fa_commit();
	const int r0 = q0 + warp * 16; /* the warp's first row */
	const int row0 = r0 + g, row1 = row0 + 8;
	const float *lb = lse + ((size_t)b * NH + h) * T;
	const float *db = dr + ((size_t)b * NH + h) * T;
	const float L0 = row0 < T ? lb[row0] : 0.f, L1 = row1 < T ? lb[row1] : 0.f;
	const float D0 = row0 < T ? db[row0] : 0.f, D1 = row1 < T ? db[row1] : 0.f;
	fa_wait<0>();
	__syncthreads();
	uint32_t qa[D / 16][4], oa[D / 16][4];
	fa_frag_a<D>(qa, tl[0], warp * 16, g, t);
	fa_frag_a<D>(oa, tl[2], warp * 16, g, t);
	__syncthreads(); /* the staging tiles are free */
	fa_tile<D, NT>(tl[0], kb, ldk, 0, T);
	fa_tile<D, NT>(tl[2], vb, ldk, 0, T);
	fa_commit();

	float dqa[D / 8][4];
#pragma unroll
	for (int d = 0; d < D / 8; d++)
		dqa[d][0] = dqa[d][1] = dqa[d][2] = dqa[d][3] = 0.f;
	const int tiles = (min(T, q0 + FA_DQ_ROWS(D)) - 1) / FA_TILE + 1;
	for (int it = 0; it < tiles; it++) {
		const int k0 = it * FA_TILE, buf = it & 1;
		if (it + 1 < tiles) {
			fa_tile<D, NT>(tl[buf ^ 1], kb, ldk, k0 + FA_TILE, T);
			fa_tile<D, NT>(tl[2 + (buf ^ 1)], vb, ldk, k0 + FA_TILE, T);
			fa_commit();
			fa_wait<1>();
		} else {
			fa_wait<0>();
		}
		__syncthreads();
		fa_bf16(*sK)[D + FA_PAD] = tl[buf];
		fa_bf16(*sV)[D + FA_PAD] = tl[2 + buf];
		if (k0 <= r0 + 15) { /* else every key is past the warp's rows */
			float p[8][4], ds[8][4];
			fa_mm_nt<D>(p, qa, sK, lane);  /* S */
			fa_mm_nt<D>(ds, oa, sV, lane); /* dP = dO V^T */
#pragma unroll
			for (int n = 0; n < 8; n++)
#pragma unroll
				for (int e = 0; e < 4; e++)
					ds[n][e] = fa_bwd_p(p[n][e], sl2, e < 2 ? L0 : L1) *
						   (ds[n][e] - (e < 2 ? D0 : D1));
			/* the mask (on dS: P is not needed past it; a masked power
			 * may be inf, and its dS is replaced, not scaled) only in
			 * tiles on the diagonal or past T */
			if (!(k0 + FA_TILE - 1 <= r0 && k0 + FA_TILE <= T)) {
#pragma unroll
				for (int n = 0; n < 8; n++)
#pragma unroll
					for (int e = 0; e < 4; e++) {
						const int col = k0 + n * 8 + 2 * t + (e & 1);
						if (col > (e < 2 ? row0 : row1) || col >= T)
							ds[n][e] = 0.f;
					}
			}
			fa_mm_pv<D>(dqa, ds, sK, lane); /* dQ += dS K */
		}
		__syncthreads(); /* before the next copy overwrites this buffer */
	}
	fa_store<D>(dq + (size_t)b * T * ldq + h * D, ldq, dqa, rsqrtf((float)D), row0, T, t);
}

template <int D>
static __device__ __forceinline__ void flash_bwd_dq(float *dq, const fa_bf16 *dout,
						    const fa_bf16 *q, const fa_bf16 *k,
						    const fa_bf16 *v, const float *lse,
						    const float *dr, int T, int NH, int NKV)
{
	static_assert(FA_DQ_THREADS(D) == (D <= 64 ? FA_THREADS : FA_DQ16_WARPS * 32),
		      "FA_DQ_THREADS and the kernels agree");
	if constexpr (D <= 64)
		flash_bwd_dq32<D>(dq, dout, q, k, v, lse, dr, T, NH, NKV);
	else
		flash_bwd_dq16<D>(dq, dout, q, k, v, lse, dr, T, NH, NKV);
}

/* The kernels, one per head size. Grid: dkdv (ceil(T/FA_KV_ROWS(D)), NH,
 * B); the forward (NH, B, ceil(T/128)); dq (NH, B, ceil(T/FA_DQ_ROWS(D))). 128
 * threads (dq: FA_DQ_THREADS(D), 256 at HS 128), flash_smem_bytes
 * (gpu/cuda/cuda_ops.c) of dynamic shared memory. */
#define FA_KERNELS(D)                                                                         \
	extern "C" __global__ void __launch_bounds__(FA_THREADS)                              \
		flash_fwd_d##D(float *out, fa_bf16 *out16, float *lse, const fa_bf16 *q,      \
			       const fa_bf16 *k, const fa_bf16 *v, int T, int NH, int NKV)    \
	{                                                                                     \
		flash_fwd<D>(out, out16, lse, q, k, v, T, NH, NKV);                           \
	}                                                                                     \
	extern "C" __global__ void __launch_bounds__(FA_THREADS)                              \
		flash_bwd_dkdv_d##D(float *dk, float *dv, const fa_bf16 *dout,                \
				    const fa_bf16 *q, const fa_bf16 *k, const fa_bf16 *v,     \
				    const float *lse, const float *dr, int T, int NH, int NKV) \
	{                                                                                     \
		flash_bwd_dkdv<D>(dk, dv, dout, q, k, v, lse, dr, T, NH, NKV);                \
	}                                                                                     \
	extern "C" __global__ void __launch_bounds__(FA_DQ_THREADS(D))                        \
		flash_bwd_dq_d##D(float *dq, const fa_bf16 *dout, const fa_bf16 *q,           \
				  const fa_bf16 *k, const fa_bf16 *v, const float *lse,       \
				  const float *dr, int T, int NH, int NKV)                    \
	{                                                                                     \
		flash_bwd_dq<D>(dq, dout, q, k, v, lse, dr, T, NH, NKV);                      \
	}

FA_KERNELS(16)
FA_KERNELS(32)
FA_KERNELS(64)
FA_KERNELS(128)

/* dK, dV at HS 128 with 8 warps a block of 128 keys (flash_bwd_dkdv16x8):
 * grid (ceil(T/128), NH, B), 256 threads, FA_KV16X8_SMEM(128) bytes of
 * dynamic shared memory. */
extern "C" __global__ void __launch_bounds__(FA_KV16_WARPS * 32)
	flash_bwd_dkdv8_d128(float *dk, float *dv, const fa_bf16 *dout, const fa_bf16 *q,
			     const fa_bf16 *k, const fa_bf16 *v, const float *lse, const float *dr,
			     int T, int NH, int NKV)
{
	flash_bwd_dkdv16x8<128>(dk, dv, dout, q, k, v, lse, dr, T, NH, NKV);
}

#include "flash_wg.cuh"
