/* Causal attention at head sizes 64 and 128 on Hopper's warpgroup products (wgmma,
 * sm_90a; issue 13): the same deterministic split and the same arithmetic
 * per element as flash.cu's kernels (it includes this file at its end and
 * lends it fa_pack, fa_ex2, fa_bwd_p, fa_quad_*, the cp.async helpers), on
 * the tensor cores' asynchronous path instead of mma.sync:
 *   flash_fwd_wg_d*: a block (one warpgroup, 128 threads) per (64
 *     queries, head, batch): S = Q K^T, the online softmax, O += P V;
 *   flash_bwd_dkdv_wg_d*: a block per (64 keys, head, batch) owns those
 *     keys' dK and dV (with kv groups, that query head's partials, as
 *     flash_bwd_dkdv; flash_kv_reduce adds them), over
 *     the query tiles at or past its keys: S^T = K Q^T and dP^T = V dO^T
 *     (both operands K-major in shared memory), P^T = fa_bwd_p and dS^T =
 *     P^T (dP^T - Dr) in registers, then dV += P^T dO and dK += dS^T Q with
 *     P^T and dS^T as A fragments in registers and dO, Q read MN-major from
 *     the same shared bytes;
 *   flash_bwd_dq_wg_d*: a block per (64 queries, head, batch), heaviest
 *     first, over the key tiles up to them: S = Q K^T, dP = dO V^T, dS in
 *     registers, dQ += dS K with K read MN-major;
 *   flash_bwd_dqs_wg_d128: where the caller lends room for dS (the packed
 *     backward at head size 128), the dK dV kernel leaves each tile's dS
 *     there and this one forms dQ += dS K alone, the same sums.
 * Each block's next tile (Q and dO, or K and V, and the row statistics) is
 * copied in (cp.async) while this one is used: double-buffered. Seven
 * products per tile pair over both kernels (S and dP twice; five with the
 * dS room), no atomics: each gradient element is one block's fixed-order
 * sum, as in flash.cu.
 *
 * Shared memory: 64-row tiles of HS bf16 in wgmma's 128-byte swizzle, each
 * 1024-byte aligned: a row's 64-value (128-byte) runs of the head dimension
 * in regions of 64 rows x 128 bytes (8 KiB apart; one at HS 64), the
 * 16-byte chunk c of row r at chunk c ^ (r % 8). A K-major operand (the head dimension the
 * reduction) steps 32 bytes a k16 in its region (descriptor LBO unused, SBO
 * 1024: 8 rows); an MN-major one (the rows the reduction, imm-trans-b 1)
 * steps 16 rows (2 KiB) a k16, LBO 8192 between the N runs, SBO 1024 — the
 * readings tests/bench/wgmma_probe.cu checked on an H100.
 *
 * Accumulator layout of wgmma m64nN (f32): warp w of the group owns rows
 * 16 w .. 16 w + 15; its n-block j (8 columns) is d[4j .. 4j + 3] = (g, 8j +
 * 2t), (g, 8j + 2t + 1), (g + 8, 8j + 2t), (g + 8, 8j + 2t + 1), g = lane /
 * 4, t = lane % 4: mma.sync's C fragment, so two n-blocks pack into one A
 * fragment for the next product (flash.cu's fragment comment).
 *
 * Compiled for every architecture the module is built for; only the
 * sm_90a cubin holds their bodies (elsewhere they trap), and the launcher
 * (gpu/cuda/cuda_ops.c) uses them only when that cubin is loaded. */
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FA_WG 1
#else
#define FA_WG 0
#endif

#define FA_WG_TILE(D) (64 * (D) * 2) /* bytes of a 64 x D bf16 tile */
/* Dynamic shared memory of every kernel here at head size D: six tiles (the
 * block's own rows, two, and the streamed pair twice), the row statistics
 * twice, and 1 KiB to align the tiles to 1024 bytes. */
#define FA_WG_SMEM(D) (6 * FA_WG_TILE(D) + 2 * 2 * 64 * 4 + 1024)
/* fa_wg_dkdv's: FA_WG_SMEM and the staging tile of dS (8 KiB) */
#define FA_WG_DKDV_SMEM(D) (FA_WG_SMEM(D) + 8192)
/* fa_wg_dqs's: a ring of FA_WG_DQS_STAGES slots of two dS tiles (8 KiB
 * each) and a K tile, aligned */
#define FA_WG_DQS_STAGES 3
#define FA_WG_DQS_SMEM(D) (FA_WG_DQS_STAGES * (2 * 8192 + FA_WG_TILE(D)) + 1024)

#if FA_WG
static __device__ __forceinline__ unsigned fa_wg_swz(int r, int k)
{
	return (unsigned)((k / 64) * 8192 + r * 128 + ((((k % 64) / 8) ^ (r & 7)) * 16) + (k % 8) * 2);
}

/* A shared-memory matrix descriptor, 128-byte swizzle. */
static __device__ __forceinline__ uint64_t fa_wg_desc(const void *p, unsigned lbo, unsigned sbo)
{
	const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
	return (uint64_t)((a & 0x3FFFF) >> 4) | (uint64_t)((lbo & 0x3FFFF) >> 4) << 16 |
	       (uint64_t)((sbo & 0x3FFFF) >> 4) << 32 | 1ull << 62;
}

static __device__ __forceinline__ void fa_wg_fence()
{
	asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void fa_wg_commit()
{
	asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
static __device__ __forceinline__ void fa_wg_wait0()
{
	asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}
/* this thread's completed copies made visible to the async proxy (wgmma) */
static __device__ __forceinline__ void fa_wg_proxy()
{
	asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* cp.async of 16 bytes that copies n of them (16 or 0) and zero-fills the rest */
static __device__ __forceinline__ void fa_wg_cp16z(void *dst, const void *src, unsigned n)
{
	const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(n));
}
static __device__ __forceinline__ void fa_wg_cp4z(void *dst, const void *src, unsigned n)
{
	const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(src), "r"(n));
}

/* 64 rows from r0 of a (B, T, heads, D) bf16 tensor (src: the head's row
 * 0, ld: a row's stride in values) into a swizzled tile, D / 16 chunks of
 * 16 bytes a thread; rows past T zero-filled (their source clamped to row
 * 0). */
template <int D>
static __device__ __forceinline__ void fa_wg_tile(unsigned char *dst, const fa_bf16 *src, size_t ld,
						  int r0, int T)
{
#pragma unroll
	for (int j = 0; j < D / 16; j++) {
		const int i = threadIdx.x + 128 * j, r = i / (D / 8), c = i % (D / 8);
		const bool in = r0 + r < T;
		fa_wg_cp16z(dst + fa_wg_swz(r, c * 8), src + (in ? (size_t)(r0 + r) * ld : 0) + c * 8,
			    in ? 16u : 0u);
	}
}

/* 64 floats of a row statistic from r0 (zero past T) */
static __device__ __forceinline__ void fa_wg_rows(float *dst, const float *src, int r0, int T)
{
	const int i = threadIdx.x & 63;
	const bool in = r0 + i < T;
	fa_wg_cp4z(dst + i, src + (in ? r0 + i : 0), in ? 4u : 0u);
}

#define FA_WG_D32                                                                                 \
	"{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
	"%25,%26,%27,%28,%29,%30,%31}"
#define FA_WG_D64                                                                                 \
	"{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
	"%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,"   \
	"%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define FA_WG_O8(d, i)                                                                              \
	"+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
		"+f"(d[i + 6]), "+f"(d[i + 7])

/* d (64 x 64) (+)= A B^T over one k16 step, both K-major in shared memory;
 * acc 0: d = A B^T */
static __device__ __forceinline__ void fa_wg_ss64(float d[32], uint64_t da, uint64_t db, int acc)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FA_WG_D32
		     ", %32, %33, p, 1, 1, 0, 0;\n}\n"
		     : FA_WG_O8(d, 0), FA_WG_O8(d, 8), FA_WG_O8(d, 16), FA_WG_O8(d, 24)
		     : "l"(da), "l"(db), "r"(acc));
}

/* d (64 x 128) += A B over one k16 step, A (this warp's 16 rows) from
 * registers, B MN-major in shared memory */
static __device__ __forceinline__ void fa_wg_rs128(float d[64], const uint32_t a[4], uint64_t db)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FA_WG_D64
		     ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
		     : FA_WG_O8(d, 0), FA_WG_O8(d, 8), FA_WG_O8(d, 16), FA_WG_O8(d, 24),
		       FA_WG_O8(d, 32), FA_WG_O8(d, 40), FA_WG_O8(d, 48), FA_WG_O8(d, 56)
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/* d (64 x 64) += A B, as fa_wg_rs128 at head size 64 */
static __device__ __forceinline__ void fa_wg_rs64(float d[32], const uint32_t a[4], uint64_t db)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FA_WG_D32
		     ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
		     : FA_WG_O8(d, 0), FA_WG_O8(d, 8), FA_WG_O8(d, 16), FA_WG_O8(d, 24)
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/* d (64 x 128) += A B over one k16 step, A and B both MN-major in shared
 * memory (imm-trans-a 1, imm-trans-b 1) */
static __device__ __forceinline__ void fa_wg_tt128(float d[64], uint64_t da, uint64_t db)
{
	asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
		     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FA_WG_D64
		     ", %64, %65, p, 1, 1, 1, 1;\n}\n"
		     : FA_WG_O8(d, 0), FA_WG_O8(d, 8), FA_WG_O8(d, 16), FA_WG_O8(d, 24),
		       FA_WG_O8(d, 32), FA_WG_O8(d, 40), FA_WG_O8(d, 48), FA_WG_O8(d, 56)
		     : "l"(da), "l"(db), "r"(1));
}

/* x (64 x 64) = the product of two K-major 64 x D tiles, D / 16 k16 steps
 * (regions of four) */
template <int D>
static __device__ __forceinline__ void fa_wg_nt(float x[32], const unsigned char *a, const unsigned char *b)
{
#pragma unroll
	for (int j = 0; j < D / 16; j++)
		fa_wg_ss64(x, fa_wg_desc(a + (j / 4) * 8192 + (j % 4) * 32, 16, 1024),
			   fa_wg_desc(b + (j / 4) * 8192 + (j % 4) * 32, 16, 1024), j > 0);
}

/* x (64 x 64 fp32 accumulators) rounded to bf16 as A fragments, four k16
 * steps (before the wgmma.fence of the products that read them) */
static __device__ __forceinline__ void fa_wg_pack(uint32_t a[4][4], const float x[32])
{
#pragma unroll
	for (int kk = 0; kk < 4; kk++)
#pragma unroll
		for (int e = 0; e < 4; e++)
			a[kk][e] = fa_pack(x[8 * kk + 2 * e], x[8 * kk + 2 * e + 1]);
}

/* acc (64 x D) += A (64 x 64, fragments) times the MN-major tile b (a k16
 * step is 16 rows of 128 bytes in every region; at D 64 one region, LBO
 * unused) */
template <int D>
static __device__ __forceinline__ void fa_wg_pv(float acc[D / 2], const uint32_t a[4][4], const unsigned char *b)
{
#pragma unroll
	for (int kk = 0; kk < 4; kk++) {
		if constexpr (D == 128)
			fa_wg_rs128(acc, a[kk], fa_wg_desc(b + kk * 16 * 128, 8192, 1024));
		else
			fa_wg_rs64(acc, a[kk], fa_wg_desc(b + kk * 16 * 128, 8192, 1024));
	}
}

/* acc (64 x D) += x (64 x 64 accumulators, packed to bf16 fragments
 * before the fence) times the MN-major tile b, issued and waited for */
template <int D>
static __device__ __forceinline__ void fa_wg_xv(float acc[D / 2], const float x[32], const unsigned char *b)
{
	uint32_t a[4][4];
	fa_wg_pack(a, x);
	fa_wg_fence();
	fa_wg_pv<D>(acc, a, b);
	fa_wg_commit();
	fa_wg_wait0();
}

/* The pipeline's turn: the copies just issued (the next tile's, maybe
 * none) committed as a group, this thread's previous group (this tile's)
 * waited for and made visible to wgmma, then every thread's. */
static __device__ __forceinline__ void fa_wg_landed()
{
	fa_commit();
	fa_wait<1>();
	fa_wg_proxy();
	__syncthreads();
}

/* x = a1 b1^T and y = a2 b2^T (64 x 64 each, K-major 64 x D tiles), issued
 * together and waited for */
template <int D>
static __device__ __forceinline__ void fa_wg_nt2(float x[32], const unsigned char *a1, const unsigned char *b1,
						 float y[32], const unsigned char *a2, const unsigned char *b2)
{
	fa_wg_fence();
	fa_wg_nt<D>(x, a1, b1);
	fa_wg_nt<D>(y, a2, b2);
	fa_wg_commit();
	fa_wg_wait0();
}

/* The block's aligned shared memory. */
static __device__ __forceinline__ unsigned char *fa_wg_smem()
{
	extern __shared__ __align__(16) unsigned char fa_wg_dyn[];
	const uint32_t a = (uint32_t)__cvta_generic_to_shared(fa_wg_dyn);
	return fa_wg_dyn + (((a + 1023u) & ~1023u) - a);
}
#endif

#if FA_WG
/* The probabilities' gradient dS of one (query tile, key tile) pair of a
 * (batch, head) pair, where fa_wg_dkdv leaves it for fa_wg_dqs: 64 x 64
 * bf16 (8 KiB), a row per key, its 64 queries in the 128-byte swizzle
 * (fa_wg_swz), so that the tile copied as it lies is dQ's product's A
 * operand MN-major; a pair's tiles (qt, kt <= qt) in row order of that
 * triangle, pairs one after another from the chunk's first (p0)
 * (gpu/backend.h: gpu_flash_ds_pair_bytes). The tile's offset in values. */
static __device__ __forceinline__ size_t fa_wg_ds_tile(int pair, int tiles, int qt, int kt)
{
	return ((size_t)pair * ((size_t)tiles * (tiles + 1) / 2) + (size_t)qt * (qt + 1) / 2 + kt) * 4096;
}

/* dK, dV (scaled by 1/sqrt(D)) or, with kv groups, the query head's
 * partials ((B,T,NH,D)); grid (ceil(T/64), pairs): block y the (batch,
 * head) pair p0 + y, b = pair / NH, h = pair % NH; a head's key tiles
 * start together (x fastest), so that the Q and dO rows they all stream
 * are read from memory about once and then from L2. (A grid with the heads
 * fastest, every head's heaviest tile first, streamed each head's rows
 * from memory: 2.5 TB/s on an H100, the bound.) ds (else NULL): each
 * tile's dS as bf16 (the A fragments of dK's product), fa_wg_ds_tile's
 * place for the chunk's pair, zero at keys past T; then the grid is
 * (pairs, ceil(T/64)), the heaviest tiles first across a chunk's pairs
 * (few enough that their Q and dO rows stay in L2): the chunks' launches
 * end on light blocks, not on heavy ones started late. */
template <int D>
static __device__ __forceinline__ void fa_wg_dkdv(float *dk, float *dv, const fa_bf16 *dout, const fa_bf16 *q,
			       const fa_bf16 *k, const fa_bf16 *v, const float *lse, const float *dr,
			       int T, int NH, int NKV, fa_bf16 *ds, int p0)
{
	const bool pf = ds != nullptr; /* grid (pairs, tiles) */
	const int pl = pf ? blockIdx.x : blockIdx.y, kt = pf ? blockIdx.y : blockIdx.x;
	const int ntile = pf ? gridDim.y : gridDim.x; /* of T */
	const int pair = p0 + pl, h = pair % NH, b = pair / NH, k0 = kt * 64;
	const int kvh = h / (NH / NKV);
	const size_t ldq = (size_t)NH * D, ldk = (size_t)NKV * D;
	const fa_bf16 *qb = q + (size_t)b * T * ldq + h * D, *ob = dout + (size_t)b * T * ldq + h * D;
	const float *lb = lse + ((size_t)b * NH + h) * T, *db = dr + ((size_t)b * NH + h) * T;
	unsigned char *sm = fa_wg_smem(), *sk = sm, *sv = sm + FA_WG_TILE(D);
	float *rows = reinterpret_cast<float *>(sm + 6 * FA_WG_TILE(D)); /* [buf][L 64, Dr 64] */
	unsigned char *stage = sm + 6 * FA_WG_TILE(D) + 2 * 2 * 64 * 4; /* dS's, with ds */
	fa_wg_tile<D>(sk, k + (size_t)b * T * ldk + kvh * D, ldk, k0, T);
	fa_wg_tile<D>(sv, v + (size_t)b * T * ldk + kvh * D, ldk, k0, T);
	fa_wg_tile<D>(sm + 2 * FA_WG_TILE(D), qb, ldq, k0, T);
	fa_wg_tile<D>(sm + 4 * FA_WG_TILE(D), ob, ldq, k0, T);
	fa_wg_rows(rows + (threadIdx.x < 64 ? 0 : 64), threadIdx.x < 64 ? lb : db, k0, T);
	fa_commit();
	const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const int key0 = k0 + 16 * w + g; /* this thread's keys: key0, key0 + 8 */
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	float dK[D / 2], dV[D / 2];
#pragma unroll
	for (int i = 0; i < D / 2; i++)
		dK[i] = dV[i] = 0.0f;
	const int tiles = (T - k0 + 63) / 64;
	for (int it = 0; it < tiles; it++) {
		const int q0 = k0 + 64 * it, buf = it & 1;
		__syncthreads(); /* every warp's products of tile it - 1 are done */
		if (it + 1 < tiles) { /* the next query tile into the other buffer */
			unsigned char *nq = sm + (2 + (buf ^ 1)) * FA_WG_TILE(D);
			fa_wg_tile<D>(nq, qb, ldq, q0 + 64, T);
			fa_wg_tile<D>(nq + 2 * FA_WG_TILE(D), ob, ldq, q0 + 64, T);
			fa_wg_rows(rows + 128 * (buf ^ 1) + (threadIdx.x < 64 ? 0 : 64),
				   threadIdx.x < 64 ? lb : db, q0 + 64, T);
		}
		fa_wg_landed();
		const unsigned char *sq = sm + (2 + buf) * FA_WG_TILE(D), *so = sq + 2 * FA_WG_TILE(D);
		const float *sl = rows + 128 * buf, *sd = sl + 64;
		float st[32], dpt[32];
		fa_wg_nt2<D>(st, sk, sq, dpt, sv, so);
		/* (key, query) of accumulator i: key0 + 8 ((i >> 1) & 1), q0 + qc.
		 * Queries past T read L = Dr = 0 with Q, dO rows of zeros: dS^T
		 * is 0 there and P^T meets a zero dO row. */
		const bool diag = q0 == k0;
#pragma unroll
		for (int i = 0; i < 32; i++) {
			const int qc = 8 * (i / 4) + 2 * t + (i & 1);
			const float p = diag && key0 + 8 * ((i >> 1) & 1) > q0 + qc ? 0.0f
										    : fa_bwd_p(st[i], sl2, sl[qc]);
			st[i] = p;
			dpt[i] = p * (dpt[i] - sd[qc]);
		}
		uint32_t ap[4][4], as[4][4];
		fa_wg_pack(ap, st);
		fa_wg_pack(as, dpt);
		fa_wg_fence();
		fa_wg_pv<D>(dV, ap, so);
		fa_wg_pv<D>(dK, as, sq);
		fa_wg_commit();
		if (ds) {
			/* dS^T's fragments into the staging tile in its final
			 * layout (as[kk][e]: key row 16 w + g + 8 (e & 1),
			 * queries 16 kk + 8 (e >> 1) + 2 t and + 1; the swizzle
			 * puts a warp's 32 words in 32 banks), then copied out
			 * 16 bytes a thread, 512 a warp, while the products run */
#pragma unroll
			for (int kk = 0; kk < 4; kk++)
#pragma unroll
				for (int e = 0; e < 4; e++) {
					const int r = 16 * w + g + 8 * (e & 1);
					*reinterpret_cast<uint32_t *>(stage + fa_wg_swz(r, 16 * kk + 8 * (e >> 1) + 2 * t)) =
						k0 + r < T ? as[kk][e] : 0u;
				}
			__syncthreads();
			uint4 *dt = reinterpret_cast<uint4 *>(ds + fa_wg_ds_tile(pl, ntile, q0 / 64, kt));
#pragma unroll
			for (int j = 0; j < 4; j++)
				dt[threadIdx.x + 128 * j] = reinterpret_cast<const uint4 *>(stage)[threadIdx.x + 128 * j];
		}
		fa_wg_wait0();
	}
	const float sc = rsqrtf((float)D);
	float *kb = dk + (size_t)b * T * ldq + h * D, *vb = dv + (size_t)b * T * ldq + h * D;
#pragma unroll
	for (int j = 0; j < D / 8; j++)
#pragma unroll
		for (int hi = 0; hi < 2; hi++) {
			const int key = key0 + 8 * hi, c = 8 * j + 2 * t;
			if (key < T) {
				*reinterpret_cast<float2 *>(kb + (size_t)key * ldq + c) =
					make_float2(dK[4 * j + 2 * hi] * sc, dK[4 * j + 2 * hi + 1] * sc);
				*reinterpret_cast<float2 *>(vb + (size_t)key * ldq + c) =
					make_float2(dV[4 * j + 2 * hi], dV[4 * j + 2 * hi + 1]);
			}
		}
}

/* dQ's accumulators (rows row0, row0 + 8 of this thread; queries past T
 * skipped) scaled by 1/sqrt(D) into dq, or with d16 rotated back and
 * rounded as fa_wg_dq's comment says. */
template <int D>
static __device__ __forceinline__ void fa_wg_dq_store(const float dQ[D / 2], float *dq, int b, int h, int row0,
						      int T, int NH, const float *rc, const float *rs,
						      fa_bf16 *d16, int ld16)
{
	const int t = threadIdx.x % 4;
	const size_t ldq = (size_t)NH * D;
	const float sc = rsqrtf((float)D);
	if (d16) {
		float *qo = dq ? dq + (size_t)b * T * ldq + h * D : nullptr;
		fa_bf16 *o16 = d16 + (size_t)b * T * ld16 + h * D;
#pragma unroll
		for (int j = 0; j < D / 16; j++)
#pragma unroll
			for (int hi = 0; hi < 2; hi++) {
				const int row = row0 + 8 * hi, c = 8 * j + 2 * t, J = j + D / 16;
				if (row >= T)
					continue;
				float y1[2], y2[2];
#pragma unroll
				for (int e = 0; e < 2; e++) {
					const float x1 = __fmul_rn(dQ[4 * j + 2 * hi + e], sc);
					const float x2 = __fmul_rn(dQ[4 * J + 2 * hi + e], sc);
					const float ci = rc[(size_t)row * (D / 2) + c + e];
					const float si = -1.0f * rs[(size_t)row * (D / 2) + c + e];
					y1[e] = __fsub_rn(__fmul_rn(x1, ci), __fmul_rn(x2, si));
					y2[e] = __fadd_rn(__fmul_rn(x2, ci), __fmul_rn(x1, si));
				}
				if (qo) {
					*reinterpret_cast<float2 *>(qo + (size_t)row * ldq + c) = make_float2(y1[0], y1[1]);
					*reinterpret_cast<float2 *>(qo + (size_t)row * ldq + c + D / 2) =
						make_float2(y2[0], y2[1]);
				}
				*reinterpret_cast<uint32_t *>(o16 + (size_t)row * ld16 + c) = fa_pack(y1[0], y1[1]);
				*reinterpret_cast<uint32_t *>(o16 + (size_t)row * ld16 + c + D / 2) =
					fa_pack(y2[0], y2[1]);
			}
		return;
	}
	float *qo = dq + (size_t)b * T * ldq + h * D;
#pragma unroll
	for (int j = 0; j < D / 8; j++)
#pragma unroll
		for (int hi = 0; hi < 2; hi++) {
			const int row = row0 + 8 * hi, c = 8 * j + 2 * t;
			if (row < T)
				*reinterpret_cast<float2 *>(qo + (size_t)row * ldq + c) =
					make_float2(dQ[4 * j + 2 * hi] * sc, dQ[4 * j + 2 * hi + 1] * sc);
		}
}


/* dQ (scaled by 1/sqrt(D)); grid (ceil(T/64), NH, B), a head's query
 * tiles together, its last (heaviest) first: they stream the same K and V
 * rows (and a kv group's heads follow one another). d16 (else NULL): dQ
 * rotated back as rope_backward_f32 rotates it (rope.cu: the pair (c, c +
 * D/2) of a row, at position row, by the tables rc, rs of (T, D/2) with the
 * sine negated; the thread holds both halves: n-blocks j and j + D/16),
 * written so to dq where dq is not NULL and rounded to bf16 into row
 * (b, row) of d16 (ld16 values a row, head h at column h D), as
 * cast_bf16_f32_rows rounds it. */
template <int D>
static __device__ __forceinline__ void fa_wg_dq(float *dq, const fa_bf16 *dout, const fa_bf16 *q, const fa_bf16 *k,
			     const fa_bf16 *v, const float *lse, const float *dr, int T, int NH, int NKV,
			     const float *rc, const float *rs, fa_bf16 *d16, int ld16)
{
	const int h = blockIdx.y, b = blockIdx.z, q0 = (gridDim.x - 1 - blockIdx.x) * 64;
	const int kvh = h / (NH / NKV);
	const size_t ldq = (size_t)NH * D, ldk = (size_t)NKV * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D, *vb = v + (size_t)b * T * ldk + kvh * D;
	unsigned char *sm = fa_wg_smem(), *sq = sm, *so = sm + FA_WG_TILE(D);
	fa_wg_tile<D>(sq, q + (size_t)b * T * ldq + h * D, ldq, q0, T);
	fa_wg_tile<D>(so, dout + (size_t)b * T * ldq + h * D, ldq, q0, T);
	fa_wg_tile<D>(sm + 2 * FA_WG_TILE(D), kb, ldk, 0, T);
	fa_wg_tile<D>(sm + 4 * FA_WG_TILE(D), vb, ldk, 0, T);
	fa_commit();
	const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const int row0 = q0 + 16 * w + g; /* this thread's queries: row0, row0 + 8 */
	const float *lb = lse + ((size_t)b * NH + h) * T, *db = dr + ((size_t)b * NH + h) * T;
	float lr[2], drr[2];
#pragma unroll
	for (int r = 0; r < 2; r++) { /* queries past T: L = Dr = 0, dO zero, dS 0 */
		const int row = row0 + 8 * r;
		lr[r] = row < T ? lb[row] : 0.0f;
		drr[r] = row < T ? db[row] : 0.0f;
	}
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	float dQ[D / 2];
#pragma unroll
	for (int i = 0; i < D / 2; i++)
		dQ[i] = 0.0f;
	const int tiles = q0 / 64 + 1;
	for (int it = 0; it < tiles; it++) {
		const int k0 = 64 * it, buf = it & 1;
		__syncthreads();
		if (it + 1 < tiles) {
			unsigned char *nk = sm + (2 + (buf ^ 1)) * FA_WG_TILE(D);
			fa_wg_tile<D>(nk, kb, ldk, k0 + 64, T);
			fa_wg_tile<D>(nk + 2 * FA_WG_TILE(D), vb, ldk, k0 + 64, T);
		}
		fa_wg_landed();
		const unsigned char *sk = sm + (2 + buf) * FA_WG_TILE(D), *sv = sk + 2 * FA_WG_TILE(D);
		float s[32], dp[32];
		fa_wg_nt2<D>(s, sq, sk, dp, so, sv);
		const bool diag = k0 == q0;
#pragma unroll
		for (int i = 0; i < 32; i++) { /* (query, key) of accumulator i */
			const int key = k0 + 8 * (i / 4) + 2 * t + (i & 1), r = (i >> 1) & 1;
			const float p = diag && key > row0 + 8 * r ? 0.0f : fa_bwd_p(s[i], sl2, lr[r]);
			dp[i] = p * (dp[i] - drr[r]);
		}
		fa_wg_xv<D>(dQ, dp, sk);
	}
	fa_wg_dq_store<D>(dQ, dq, b, h, row0, T, NH, rc, rs, d16, ld16);
}

/* dQ from the dS that fa_wg_dkdv left (ds, fa_wg_ds_tile's places from the
 * chunk's first pair p0): one product per tile pair, dQ += dS K, instead of
 * fa_wg_dq's three. A block per two query tiles (2 m, 2 m + 1) of a pair,
 * which share each K tile they read; grid (pairs, ceil(tiles / 2)): block x
 * the pair p0 + x, the heaviest tiles first (y 0: the last two) across the
 * chunk's pairs, whose K rows (0.5 MiB a pair at T 2048, HS 128) L2 holds.
 * Per key tile up to the diagonal, the two dS tiles (copied as they lie: A,
 * MN-major) and K (B, MN-major), in a ring of FA_WG_DQS_STAGES (the loop
 * waits on memory, not on its small products: two in flight while one is
 * used); the same k16 steps in the same order as fa_wg_dq's product over
 * the same bf16 dS, so the same sums where the two kernels' dS are the
 * same. Then fa_wg_dq_store, as fa_wg_dq. */
template <int D>
static __device__ __forceinline__ void fa_wg_dqs(float *dq, const fa_bf16 *ds, const fa_bf16 *k, int T, int NH,
						 int NKV, int p0, const float *rc, const float *rs, fa_bf16 *d16,
						 int ld16)
{
	static_assert(D == 128, "dQ from dS: head size 128 only (cuda_ops.c says why)");
	constexpr int S = FA_WG_DQS_STAGES, ST = 2 * 8192 + FA_WG_TILE(D); /* a slot's bytes */
	const int pair = p0 + blockIdx.x, h = pair % NH, b = pair / NH, tiles = (T + 63) / 64;
	const int qa = 2 * (gridDim.y - 1 - blockIdx.y), qb = qa + 1 < tiles ? qa + 1 : qa;
	const int kvh = h / (NH / NKV);
	const size_t ldk = (size_t)NKV * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D;
	unsigned char *sm = fa_wg_smem(); /* slot: [dS of qa][dS of qb][K] */
	const auto load = [&](int kt) { /* key tile kt into slot kt % S, if any; one group */
		if (kt <= qb) {
			unsigned char *slot = sm + (kt % S) * ST;
#pragma unroll
			for (int t2 = 0; t2 < 2; t2++) {
				const int q = t2 ? qb : qa;
				if (kt > q || (t2 && qb == qa))
					continue;
				const fa_bf16 *src = ds + fa_wg_ds_tile(blockIdx.x, tiles, q, kt);
#pragma unroll
				for (int j = 0; j < 4; j++) {
					const int i = threadIdx.x + 128 * j;
					fa_wg_cp16z(slot + t2 * 8192 + i * 16, src + i * 8, 16u);
				}
			}
			fa_wg_tile<D>(slot + 2 * 8192, kb, ldk, kt * 64, T);
		}
		fa_commit();
	};
#pragma unroll
	for (int kt = 0; kt < S - 1; kt++)
		load(kt);
	float dQa[D / 2], dQb[D / 2];
#pragma unroll
	for (int i = 0; i < D / 2; i++)
		dQa[i] = dQb[i] = 0.0f;
	for (int it = 0; it <= qb; it++) {
		fa_wait<S - 2>(); /* tile it's group landed */
		fa_wg_proxy();
		__syncthreads(); /* ... every thread's, and slot (it - 1) % S's products are done */
		load(it + S - 1);
		const unsigned char *slot = sm + (it % S) * ST, *sk = slot + 2 * 8192;
		fa_wg_fence();
#pragma unroll
		for (int kk = 0; kk < 4; kk++) {
			const uint64_t db = fa_wg_desc(sk + kk * 16 * 128, 8192, 1024);
			const uint64_t da = fa_wg_desc(slot + kk * 16 * 128, 8192, 1024);
			const uint64_t dbb = fa_wg_desc(slot + 8192 + kk * 16 * 128, 8192, 1024);
			if (it <= qa)
				fa_wg_tt128(dQa, da, db);
			if (qb != qa)
				fa_wg_tt128(dQb, dbb, db);
		}
		fa_wg_commit();
		fa_wg_wait0();
	}
	const int w = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
	fa_wg_dq_store<D>(dQa, dq, b, h, qa * 64 + 16 * w + g, T, NH, rc, rs, d16, ld16);
	if (qb != qa)
		fa_wg_dq_store<D>(dQb, dq, b, h, qb * 64 + 16 * w + g, T, NH, rc, rs, d16, ld16);
}

/* The forward, a block (one warpgroup) per (64 queries, head, batch); grid
 * (ceil(T/64), NH, B), a head's query tiles together, its last (heaviest)
 * first. The key tiles up to the diagonal, K and V double-buffered; per
 * tile S = Q K^T (both K-major), the online softmax in registers as
 * flash.cu's fa_fwd_softmax forms it (the max over the raw scores scaled
 * once, each power fa_ex2 of one FFMA, the mask only on the diagonal tile
 * or past T), P rounded to bf16 as A fragments, O += P V with V MN-major.
 * out and out16 written where not NULL, and L = m + log2(l) per row. */
template <int D>
static __device__ __forceinline__ void fa_wg_fwd(float *out, fa_bf16 *out16, float *lse, const fa_bf16 *q, const fa_bf16 *k,
			  const fa_bf16 *v, int T, int NH, int NKV)
{
	const int h = blockIdx.y, b = blockIdx.z, q0 = (gridDim.x - 1 - blockIdx.x) * 64;
	const int kvh = h / (NH / NKV);
	const size_t ldq = (size_t)NH * D, ldk = (size_t)NKV * D;
	const fa_bf16 *kb = k + (size_t)b * T * ldk + kvh * D, *vb = v + (size_t)b * T * ldk + kvh * D;
	unsigned char *sm = fa_wg_smem(), *sq = sm;
	fa_wg_tile<D>(sq, q + (size_t)b * T * ldq + h * D, ldq, q0, T);
	fa_wg_tile<D>(sm + FA_WG_TILE(D), kb, ldk, 0, T);
	fa_wg_tile<D>(sm + 3 * FA_WG_TILE(D), vb, ldk, 0, T);
	fa_commit();
	const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
	const int r = q0 + 16 * w, row0 = r + g; /* this warp's first row; the thread's: row0, row0 + 8 */
	const float sl2 = FA_LOG2E * rsqrtf((float)D);
	float o[D / 2], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
	for (int i = 0; i < D / 2; i++)
		o[i] = 0.0f;
	const int tiles = (min(T, q0 + 64) - 1) / 64 + 1;
	for (int it = 0; it < tiles; it++) {
		const int k0 = 64 * it, buf = it & 1;
		__syncthreads();
		if (it + 1 < tiles) {
			fa_wg_tile<D>(sm + (1 + (buf ^ 1)) * FA_WG_TILE(D), kb, ldk, k0 + 64, T);
			fa_wg_tile<D>(sm + (3 + (buf ^ 1)) * FA_WG_TILE(D), vb, ldk, k0 + 64, T);
		}
		fa_wg_landed();
		const unsigned char *sk = sm + (1 + buf) * FA_WG_TILE(D), *sv = sm + (3 + buf) * FA_WG_TILE(D);
		float s[32];
		fa_wg_fence();
		fa_wg_nt<D>(s, sq, sk);
		fa_wg_commit();
		fa_wg_wait0();
		if (!(k0 + 63 <= r && k0 + 64 <= T)) { /* else below the diagonal, inside T */
#pragma unroll
			for (int i = 0; i < 32; i++) {
				const int col = k0 + 8 * (i / 4) + 2 * t + (i & 1);
				if (col > row0 + 8 * ((i >> 1) & 1) || col >= T)
					s[i] = -INFINITY;
			}
		}
		float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
		for (int i = 0; i < 32; i++)
			mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
		float c[2], rs[2] = {0.0f, 0.0f};
#pragma unroll
		for (int hi = 0; hi < 2; hi++) {
			mx[hi] = fmaxf(m[hi], fa_quad_max(mx[hi]) * sl2);
			c[hi] = exp2f(m[hi] - mx[hi]);
			m[hi] = mx[hi];
		}
#pragma unroll
		for (int i = 0; i < 32; i++) {
			s[i] = fa_ex2(fmaf(s[i], sl2, -mx[(i >> 1) & 1]));
			rs[(i >> 1) & 1] += s[i];
		}
#pragma unroll
		for (int hi = 0; hi < 2; hi++)
			l[hi] = l[hi] * c[hi] + rs[hi];
#pragma unroll
		for (int i = 0; i < D / 2; i++)
			o[i] *= c[(i >> 1) & 1];
		fa_wg_xv<D>(o, s, sv);
	}
	float inv[2];
#pragma unroll
	for (int hi = 0; hi < 2; hi++) {
		l[hi] = fa_quad_sum(l[hi]);
		inv[hi] = 1.0f / l[hi];
	}
	const size_t ob = (size_t)b * T * ldq + h * D;
#pragma unroll
	for (int j = 0; j < D / 8; j++)
#pragma unroll
		for (int hi = 0; hi < 2; hi++) {
			const int row = row0 + 8 * hi, col = 8 * j + 2 * t;
			if (row >= T)
				continue;
			const float x0 = o[4 * j + 2 * hi] * inv[hi], x1 = o[4 * j + 2 * hi + 1] * inv[hi];
			if (out)
				*reinterpret_cast<float2 *>(out + ob + (size_t)row * ldq + col) = make_float2(x0, x1);
			if (out16)
				*reinterpret_cast<uint32_t *>(out16 + ob + (size_t)row * ldq + col) = fa_pack(x0, x1);
		}
	if (t == 0) {
		float *lb = lse + ((size_t)b * NH + h) * T;
#pragma unroll
		for (int hi = 0; hi < 2; hi++)
			if (row0 + 8 * hi < T)
				lb[row0 + 8 * hi] = m[hi] + log2f(l[hi]);
	}
}
#define FA_WG_CALL(x) x
#else
#define FA_WG_CALL(x) __trap()
#endif

/* The kernels, head sizes 64 and 128: grid (ceil(T/64), NH, B) (the
 * forward, dQ) or (ceil(T/64), (batch, head) pairs) (dK dV; (pairs,
 * ceil(T/64)) with ds), 128 threads, FA_WG_SMEM(D) bytes of dynamic shared
 * memory (FA_WG_DKDV_SMEM(D) for dK dV). */
#define FA_WG_KERNELS(D)                                                                          \
	extern "C" __global__ void __launch_bounds__(128)                                         \
		flash_fwd_wg_d##D(float *out, fa_bf16 *out16, float *lse, const fa_bf16 *q,       \
				  const fa_bf16 *k, const fa_bf16 *v, int T, int NH, int NKV)     \
	{                                                                                         \
		FA_WG_CALL((fa_wg_fwd<D>(out, out16, lse, q, k, v, T, NH, NKV)));                 \
	}                                                                                         \
	extern "C" __global__ void __launch_bounds__(128)                                         \
		flash_bwd_dkdv_wg_d##D(float *dk, float *dv, const fa_bf16 *dout, const fa_bf16 *q, \
				       const fa_bf16 *k, const fa_bf16 *v, const float *lse,      \
				       const float *dr, int T, int NH, int NKV, fa_bf16 *ds, int p0) \
	{                                                                                         \
		FA_WG_CALL((fa_wg_dkdv<D>(dk, dv, dout, q, k, v, lse, dr, T, NH, NKV, ds, p0)));  \
	}                                                                                         \
	extern "C" __global__ void __launch_bounds__(128)                                         \
		flash_bwd_dq_wg_d##D(float *dq, const fa_bf16 *dout, const fa_bf16 *q,            \
				     const fa_bf16 *k, const fa_bf16 *v, const float *lse,        \
				     const float *dr, int T, int NH, int NKV, const float *rc,    \
				     const float *rs, fa_bf16 *d16, int ld16)                     \
	{                                                                                         \
		FA_WG_CALL((fa_wg_dq<D>(dq, dout, q, k, v, lse, dr, T, NH, NKV, rc, rs, d16, ld16))); \
	}

FA_WG_KERNELS(64)
FA_WG_KERNELS(128)

/* dQ from dS (fa_wg_dqs), head size 128 only: grid (pairs, ceil(tiles / 2)),
 * 128 threads, FA_WG_DQS_SMEM(128) bytes of dynamic shared memory. */
extern "C" __global__ void __launch_bounds__(128)
	flash_bwd_dqs_wg_d128(float *dq, const fa_bf16 *ds, const fa_bf16 *k, int T, int NH, int NKV, int p0,
			      const float *rc, const float *rs, fa_bf16 *d16, int ld16)
{
	FA_WG_CALL((fa_wg_dqs<128>(dq, ds, k, T, NH, NKV, p0, rc, rs, d16, ld16)));
}
