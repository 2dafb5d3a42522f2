/* Elementwise ops of the MLP and the residual stream, fp32: the CUDA twins of
 * swiglu_forward / swiglu_backward / residual_forward in kernels/cpu/ops.h.
 *
 * Each element's arithmetic is the CPU op's, in the same order, with the _rn
 * intrinsics where nvcc would otherwise contract a multiply and an add into
 * an FMA; the only difference left is expf, which CUDA and glibc each round
 * to within 2 ulp. Grid-stride loops over size_t indices.
 *
 * Key: n values. */
#include "common.cuh"

/* Vector access: four floats at a time where every pointer of the op is
 * 16-byte aligned (the plan's buffers are; a view into one may not be), the
 * rest one at a time. Each element's arithmetic is the same either way. */
/* NULL counts as aligned (an output not written). bf16 twins hold half the
 * bytes, so a 16-byte aligned fp32 index i is an 8-byte aligned bf16 one. */
static __device__ __forceinline__ bool cu_al16(const void *p)
{
	return ((uintptr_t)p & 15) == 0;
}

#define CU_GRID_STRIDE(i, start, n)                                                     \
	for (size_t i = (start) + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
	     i += (size_t)gridDim.x * blockDim.x)

static __device__ __forceinline__ float4 cu_ld4(const float *p, size_t i)
{
	return reinterpret_cast<const float4 *>(p)[i];
}

static __device__ __forceinline__ void cu_st4(float *p, size_t i, float4 v)
{
	reinterpret_cast<float4 *>(p)[i] = v;
}

/* out = a + b; out may alias a or b (each element is read then written by
 * one thread). */
extern "C" __global__ void residual_forward_f32(float *out, const float *a, const float *b,
						size_t n)
{
	size_t done = 0;
	if (cu_al16(out) && cu_al16(a) && cu_al16(b)) {
		CU_GRID_STRIDE(i, 0, n / 4)
		{
			const float4 x = cu_ld4(a, i), y = cu_ld4(b, i);
			cu_st4(out, i, make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w));
		}
		done = n / 4 * 4;
	}
	CU_GRID_STRIDE(i, done, n)
	out[i] = a[i] + b[i];
}

/* out = silu(gate) * up, silu(x) = x / (1 + exp(-x)) as torch writes it: for
 * x << 0 exp overflows to inf and the quotient is -0, the right limit. */
static __device__ __forceinline__ float cu_swiglu(float x, float u)
{
	return __fmul_rn(__fdiv_rn(x, __fadd_rn(1.0f, expf(-x))), u);
}

/* out16, dgate16, dup16: bf16 twins, or NULL; an fp32 output may be NULL
 * when its twin is not (common.cuh: cu_put, cu_put4). */
/* gate, up: fp32, or (those NULL) bf16 in gate16, up16: a product kept in
 * bf16 only. Four at a time from either. */
static __device__ __forceinline__ float4 cu_in4(const float *p, const __nv_bfloat16 *p16, size_t i)
{
	if (p)
		return cu_ld4(p, i);
	const uint2 u = reinterpret_cast<const uint2 *>(p16)[i];
	const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162 *>(&u.x);
	const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162 *>(&u.y);
	return make_float4(__low2float(lo), __high2float(lo), __low2float(hi), __high2float(hi));
}

static __device__ __forceinline__ float cu_in(const float *p, const __nv_bfloat16 *p16, size_t i)
{
	return p ? p[i] : __bfloat162float(p16[i]);
}

extern "C" __global__ void swiglu_forward_f32(float *out, __nv_bfloat16 *out16, const float *gate,
					      const float *up, const __nv_bfloat16 *gate16,
					      const __nv_bfloat16 *up16, size_t n)
{
	size_t done = 0;
	if (cu_al16(out) && cu_al16(out16) && cu_al16(gate) && cu_al16(up) && cu_al16(gate16) &&
	    cu_al16(up16)) {
		CU_GRID_STRIDE(i, 0, n / 4)
		{
			const float4 x = cu_in4(gate, gate16, i), u = cu_in4(up, up16, i);
			cu_put4(out, out16, i,
				make_float4(cu_swiglu(x.x, u.x), cu_swiglu(x.y, u.y),
					    cu_swiglu(x.z, u.z), cu_swiglu(x.w, u.w)));
		}
		done = n / 4 * 4;
	}
	CU_GRID_STRIDE(i, done, n)
	cu_put(out, out16, i, cu_swiglu(cu_in(gate, gate16, i), cu_in(up, up16, i)));
}

/* dup = dout * silu(gate) ; dgate = dout * up * sig * (1 + x * (1 - sig)).
 * Overwrite. */
static __device__ __forceinline__ void cu_swiglu_grad(float x, float u, float d, float &dgate,
						      float &dup)
{
	const float sig = __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
	dup = __fmul_rn(d, __fmul_rn(x, sig));
	const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(x, 1.0f - sig)));
	dgate = __fmul_rn(__fmul_rn(d, u), dsilu);
}

/* dout: fp32, or (dout NULL) dout16, the down projection's input gradient
 * in bf16. */
extern "C" __global__ void swiglu_backward_f32(float *dgate, float *dup, __nv_bfloat16 *dgate16,
					       __nv_bfloat16 *dup16, const float *dout,
					       const __nv_bfloat16 *dout16, const float *gate,
					       const float *up, const __nv_bfloat16 *gate16,
					       const __nv_bfloat16 *up16, size_t n)
{
	size_t done = 0;
	if (cu_al16(dgate) && cu_al16(dup) && cu_al16(dgate16) && cu_al16(dup16) && cu_al16(dout) &&
	    cu_al16(dout16) && cu_al16(gate) && cu_al16(up) && cu_al16(gate16) && cu_al16(up16)) {
		CU_GRID_STRIDE(i, 0, n / 4)
		{
			const float4 x = cu_in4(gate, gate16, i), u = cu_in4(up, up16, i);
			const float4 d = cu_in4(dout, dout16, i);
			float4 g, p;
			cu_swiglu_grad(x.x, u.x, d.x, g.x, p.x);
			cu_swiglu_grad(x.y, u.y, d.y, g.y, p.y);
			cu_swiglu_grad(x.z, u.z, d.z, g.z, p.z);
			cu_swiglu_grad(x.w, u.w, d.w, g.w, p.w);
			cu_put4(dgate, dgate16, i, g);
			cu_put4(dup, dup16, i, p);
		}
		done = n / 4 * 4;
	}
	CU_GRID_STRIDE(i, done, n)
	{
		float g, p;
		cu_swiglu_grad(cu_in(gate, gate16, i), cu_in(up, up16, i), cu_in(dout, dout16, i), g,
			       p);
		cu_put(dgate, dgate16, i, g);
		cu_put(dup, dup16, i, p);
	}
}

/* The bf16 mode's SwiGLU, every input and output bf16 (no fp32 one): eight
 * values a thread step, 16-byte loads and stores (every pointer 16-byte
 * aligned: the launcher checks), each element's arithmetic
 * swiglu_forward_f32's and swiglu_backward_f32's (cu_swiglu,
 * cu_swiglu_grad), so the same bits; the tail past n / 8 * 8 one at a time. */
extern "C" __global__ void swiglu_forward_bf16x8(__nv_bfloat16 *out16,
						 const __nv_bfloat16 *__restrict__ gate16,
						 const __nv_bfloat16 *__restrict__ up16, size_t n)
{
	CU_GRID_STRIDE(i, 0, n / 8)
	{
		float x[8], u[8], h[8];
		cu_widen_bf16x8(reinterpret_cast<const uint4 *>(gate16)[i], x);
		cu_widen_bf16x8(reinterpret_cast<const uint4 *>(up16)[i], u);
		for (int j = 0; j < 8; j++)
			h[j] = cu_swiglu(x[j], u[j]);
		reinterpret_cast<uint4 *>(out16)[i] = cu_pack_bf16x8(h);
	}
	CU_GRID_STRIDE(i, n / 8 * 8, n)
	out16[i] = __float2bfloat16_rn(
		cu_swiglu(__bfloat162float(gate16[i]), __bfloat162float(up16[i])));
}

/* dgate16 may be dout16 (train/plan.c: dgate_over_dh): each element is
 * read, then written, by one thread. */
extern "C" __global__ void swiglu_backward_bf16x8(__nv_bfloat16 *dgate16, __nv_bfloat16 *dup16,
						  const __nv_bfloat16 *dout16,
						  const __nv_bfloat16 *__restrict__ gate16,
						  const __nv_bfloat16 *__restrict__ up16, size_t n)
{
	CU_GRID_STRIDE(i, 0, n / 8)
	{
		float x[8], u[8], d[8], g[8], p[8];
		cu_widen_bf16x8(reinterpret_cast<const uint4 *>(gate16)[i], x);
		cu_widen_bf16x8(reinterpret_cast<const uint4 *>(up16)[i], u);
		cu_widen_bf16x8(reinterpret_cast<const uint4 *>(dout16)[i], d);
		for (int j = 0; j < 8; j++)
			cu_swiglu_grad(x[j], u[j], d[j], g[j], p[j]);
		reinterpret_cast<uint4 *>(dgate16)[i] = cu_pack_bf16x8(g);
		reinterpret_cast<uint4 *>(dup16)[i] = cu_pack_bf16x8(p);
	}
	CU_GRID_STRIDE(i, n / 8 * 8, n)
	{
		float g, p;
		cu_swiglu_grad(__bfloat162float(gate16[i]), __bfloat162float(up16[i]),
			       __bfloat162float(dout16[i]), g, p);
		dgate16[i] = __float2bfloat16_rn(g);
		dup16[i] = __float2bfloat16_rn(p);
	}
}

/* swiglu_backward_f32 with an adapter's share of dout added as it is read
 * (gpu/backend.h: gpu_lora_dx): dout (rows, cols) + du (rows, R) @ A (R,
 * cols), each element's share summed over r = 0..R-1 from 0 by fused
 * multiply-adds, then added to dout once: kernels/cpu/ops.h's
 * lora_dx_add, to the bit. A16 given (the bf16 mode): A read from it and du
 * rounded to bf16, the operands the adapter's GEMM would take. A block is
 * SL_COLS columns (a thread each) by SL_ROWS rows: its rows of du, rounded
 * once, in shared memory (read four at a time, the same address across the
 * warp); a thread holds SL_RC of its column's A values at a time and its
 * rows' running shares, so that A (R x cols, in L2) is read once a block;
 * then its rows' elements SL_RB rows at a time, their loads issued
 * together. */
#define SL_COLS 256
#define SL_ROWS 32
#define SL_RC 16
#define SL_RB 8
#define SL_RMAX 64 /* GPU_LORA_DX_RMAX: SL_ROWS x R floats of shared memory */
extern "C" __global__ void __launch_bounds__(SL_COLS)
	swiglu_backward_lora_f32(float *__restrict__ dgate, float *__restrict__ dup,
				 __nv_bfloat16 *__restrict__ dgate16, __nv_bfloat16 *__restrict__ dup16,
				 const float *__restrict__ dout, const __nv_bfloat16 *__restrict__ dout16,
				 const float *__restrict__ gate, const float *__restrict__ up,
				 const __nv_bfloat16 *__restrict__ gate16,
				 const __nv_bfloat16 *__restrict__ up16, const float *__restrict__ du,
				 const float *__restrict__ A, const __nv_bfloat16 *__restrict__ A16,
				 int R, int rows, int cols)
{
	__shared__ __align__(16) float su[SL_ROWS * SL_RMAX];
	const int i = blockIdx.x * SL_COLS + threadIdx.x;
	const int n0 = blockIdx.y * SL_ROWS;
	const int nr = min(SL_ROWS, rows - n0);
	/* the rows' du, rounded where the GEMM would round it; rows past the
	 * end as zeros. Row j's values at su[j * R4 ..], R4 = R rounded up to
	 * four for aligned four-value reads (the values past R are not added) */
	const int R4 = (R + 3) & ~3;
	for (int e = threadIdx.x; e < SL_ROWS * R4; e += SL_COLS) {
		const int j = e / R4, r = e % R4;
		float x = j < nr && r < R ? du[(size_t)(n0 + j) * (size_t)R + r] : 0.0f;
		if (A16)
			x = __bfloat162float(__float2bfloat16_rn(x));
		su[e] = x;
	}
	__syncthreads();
	if (i >= cols)
		return;
	float t[SL_ROWS];
#pragma unroll
	for (int j = 0; j < SL_ROWS; j++)
		t[j] = 0.0f;
	for (int r0 = 0; r0 < R4; r0 += SL_RC) {
		float a[SL_RC];
#pragma unroll
		for (int k = 0; k < SL_RC; k++) {
			const size_t e = (size_t)(r0 + k) * (size_t)cols + (size_t)i;
			a[k] = r0 + k >= R ? 0.0f : A16 ? __bfloat162float(A16[e]) : A[e];
		}
		const int rc = min(SL_RC, R - r0);
#pragma unroll
		for (int j = 0; j < SL_ROWS; j++) {
			const float4 *u = reinterpret_cast<const float4 *>(su + j * R4 + r0);
#pragma unroll
			for (int k = 0; k < SL_RC; k += 4) {
				if (k < rc) {
					const float4 x = u[k / 4];
					t[j] = __fmaf_rn(x.x, a[k], t[j]);
					if (k + 1 < rc)
						t[j] = __fmaf_rn(x.y, a[k + 1], t[j]);
					if (k + 2 < rc)
						t[j] = __fmaf_rn(x.z, a[k + 2], t[j]);
					if (k + 3 < rc)
						t[j] = __fmaf_rn(x.w, a[k + 3], t[j]);
				}
			}
		}
	}
#pragma unroll
	for (int j0 = 0; j0 < SL_ROWS; j0 += SL_RB) {
		float d[SL_RB], x[SL_RB], u[SL_RB];
#pragma unroll
		for (int j = 0; j < SL_RB; j++) {
			const size_t e = (size_t)(n0 + j0 + j) * (size_t)cols + (size_t)i;
			const bool in = j0 + j < nr;
			d[j] = in ? cu_in(dout, dout16, e) : 0.0f;
			x[j] = in ? cu_in(gate, gate16, e) : 0.0f;
			u[j] = in ? cu_in(up, up16, e) : 0.0f;
		}
#pragma unroll
		for (int j = 0; j < SL_RB; j++) {
			if (j0 + j >= nr)
				break;
			const size_t e = (size_t)(n0 + j0 + j) * (size_t)cols + (size_t)i;
			float g, p;
			cu_swiglu_grad(x[j], u[j], __fadd_rn(d[j], t[j0 + j]), g, p);
			cu_put(dgate, dgate16, e, g);
			cu_put(dup, dup16, e, p);
		}
	}
}

/* lora_dx_add_f32's tiles: 256 columns by 16 rows */
#define SLB_COLS 256
#define SLB_ROWS 16
/* dinp (rows, cols) += the shares of G adapters (gpu/backend.h:
 * lora_dx_add): each element's share summed over g, then r = 0..R-1, from 0
 * by fused multiply-adds, then added to dinp once: kernels/cpu/ops.h's
 * lora_dx_add, to the bit. A16 given (the bf16 mode): each A read from its
 * copy and each du rounded to bf16 (the launcher takes lora_dx_add_mma
 * for that where cols is even). A thread takes four adjacent columns of four
 * rows, a block 256 columns by 16
 * rows, the block's du (every adapter's) and one adapter's 16 ranks of A at
 * a time in shared memory; dinp read and written four floats at a time
 * where cols is a multiple of four and dinp 16-byte aligned (vec). */
#define LDX_G 3 /* GPU_LORA_DX_GROUP */
extern "C" __global__ void __launch_bounds__(256)
	lora_dx_add_f32(float *__restrict__ dinp, const float *du0, const float *du1,
			const float *du2, const float *A0, const float *A1, const float *A2,
			const __nv_bfloat16 *A160, const __nv_bfloat16 *A161,
			const __nv_bfloat16 *A162, int G, int R, int rows, int cols, int vec)
{
	__shared__ __align__(16) float su[SLB_ROWS * LDX_G * SL_RMAX];
	__shared__ __align__(16) float sa[SL_RC * SLB_COLS];
	const int tx = threadIdx.x % 64, ty = threadIdx.x / 64; /* a warp: one ty */
	const int c0 = blockIdx.x * SLB_COLS, n0 = blockIdx.y * SLB_ROWS;
	const int col = c0 + 4 * tx;
	const bool b16 = A160 != nullptr;
	const int R4 = (R + 3) & ~3, GR4 = G * R4;
	for (int e = threadIdx.x; e < SLB_ROWS * GR4; e += 256) {
		const int j = e / GR4, g = e % GR4 / R4, r = e % R4;
		const int n = n0 + j;
		const float *du = g == 0 ? du0 : g == 1 ? du1 : du2;
		float x = n < rows && r < R ? du[(size_t)n * (size_t)R + r] : 0.0f;
		su[e] = b16 ? __bfloat162float(__float2bfloat16_rn(x)) : x;
	}
	float t[4][4]; /* [row][column] */
#pragma unroll
	for (int j = 0; j < 4; j++)
#pragma unroll
		for (int q = 0; q < 4; q++)
			t[j][q] = 0.0f;
	for (int g = 0; g < G; g++) {
		const float *A = g == 0 ? A0 : g == 1 ? A1 : A2;
		const __nv_bfloat16 *A16 = g == 0 ? A160 : g == 1 ? A161 : A162;
		for (int r0 = 0; r0 < R; r0 += SL_RC) {
			const int rc = min(SL_RC, R - r0);
			__syncthreads(); /* su written (first pass), sa read (later ones) */
			for (int e = threadIdx.x; e < SL_RC * SLB_COLS; e += 256) {
				const int k = e / SLB_COLS, c = c0 + e % SLB_COLS;
				const size_t at = (size_t)(r0 + k) * (size_t)cols + (size_t)c;
				sa[e] = k < rc && c < cols ? (b16 ? __bfloat162float(A16[at]) : A[at]) : 0.0f;
			}
			__syncthreads();
#pragma unroll
			for (int k = 0; k < SL_RC; k += 4) {
				if (k >= rc)
					break;
				float a[4][4]; /* [rank][column] */
#pragma unroll
				for (int kk = 0; kk < 4; kk++) {
					const float4 v =
						reinterpret_cast<const float4 *>(sa + (k + kk) * SLB_COLS)[tx];
					a[kk][0] = v.x, a[kk][1] = v.y, a[kk][2] = v.z, a[kk][3] = v.w;
				}
#pragma unroll
				for (int j = 0; j < 4; j++) {
					const float4 x4 = reinterpret_cast<const float4 *>(
						su + (4 * ty + j) * GR4 + g * R4 + r0)[k / 4];
					const float x[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
					for (int kk = 0; kk < 4; kk++) {
						if (k + kk < rc) {
#pragma unroll
							for (int q = 0; q < 4; q++)
								t[j][q] = __fmaf_rn(x[kk], a[kk][q],
										    t[j][q]);
						}
					}
				}
			}
		}
	}
	if (col >= cols)
		return;
#pragma unroll
	for (int j = 0; j < 4; j++) {
		const int n = n0 + 4 * ty + j;
		if (n >= rows)
			break;
		float *d = dinp + (size_t)n * (size_t)cols + (size_t)col;
		if (vec) {
			float4 v = *reinterpret_cast<float4 *>(d);
			v.x = __fadd_rn(v.x, t[j][0]), v.y = __fadd_rn(v.y, t[j][1]);
			v.z = __fadd_rn(v.z, t[j][2]), v.w = __fadd_rn(v.w, t[j][3]);
			*reinterpret_cast<float4 *>(d) = v;
		} else {
#pragma unroll
			for (int q = 0; q < 4; q++)
				if (col + q < cols)
					d[q] = __fadd_rn(d[q], t[j][q]);
		}
	}
}

/* lora_dx_add_f32's sum on the tensor cores, the bf16 mode's (every A
 * from its bf16 copy, du rounded to bf16: the operands the adapters' GEMMs
 * would take): the G adapters' ranks are one K = G * R (zeros past it, to a
 * multiple of 16) of bf16 mma.sync m16n8k16 with fp32 accumulation, then
 * added to dinp once. The products are exact; the fp32 sum's order is the
 * tensor cores' (as cuBLAS's, which this replaces), not lora_dx_add's. A
 * warp takes 16 rows by 64 columns, a block 64 rows; the sums staged in
 * shared memory, then dinp read and written a row at a time across the
 * warp, two floats a lane (cols even, dinp 8-byte aligned: the launcher's
 * condition). Fragment layout: kernels/cuda/flash.cu's header. */
#define LXM_ROWS 64
#define LXM_COLS 64
static __device__ __forceinline__ uint32_t lx_pack(float lo, float hi)
{
	__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<uint32_t *>(&v);
}

static __device__ __forceinline__ uint32_t lx_pack16(__nv_bfloat16 lo, __nv_bfloat16 hi)
{
	return (uint32_t)__bfloat16_as_ushort(lo) | (uint32_t)__bfloat16_as_ushort(hi) << 16;
}

/* acc (a warp's 16 rows from r0 by LXM_COLS columns from c0, as
 * LXM_COLS / 8 C tiles) = the shares of G adapters (du rounded to bf16, A
 * from A16) over K = G * R ranks, zeros past K, rows and cols. */
static __device__ __forceinline__ void lx_share(float (*acc)[4], const float *du0,
						const float *du1, const float *du2,
						const __nv_bfloat16 *A160, const __nv_bfloat16 *A161,
						const __nv_bfloat16 *A162, int G, int R, int rows,
						int cols, int r0, int c0)
{
	const int lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
	const int K = G * R, KC = (K + 15) / 16;
	const __nv_bfloat16 zero = __float2bfloat16_rn(0.0f);
#pragma unroll
	for (int nt = 0; nt < LXM_COLS / 8; nt++)
		acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
	for (int kc = 0; kc < KC; kc++) {
		/* A (16 rows x 16 ranks): a0 (gq, 2tq..), a1 (gq+8, 2tq..), a2 (gq,
		 * 2tq+8..), a3 (gq+8, 2tq+8..) */
		uint32_t a[4];
#pragma unroll
		for (int h = 0; h < 4; h++) {
			const int row = r0 + gq + (h & 1) * 8, k = kc * 16 + 2 * tq + (h >> 1) * 8;
			float v[2];
#pragma unroll
			for (int e = 0; e < 2; e++) {
				const int kk = k + e, g = kk / R, r = kk - g * R;
				const float *du = g == 0 ? du0 : g == 1 ? du1 : du2;
				v[e] = kk < K && row < rows ? du[(size_t)row * (size_t)R + r] : 0.0f;
			}
			a[h] = lx_pack(v[0], v[1]);
		}
		/* B (16 ranks x 8 columns): b0 (ranks 2tq.., column gq), b1 (ranks
		 * 2tq+8..) */
		const __nv_bfloat16 *bp[4];
		bool bk[4];
#pragma unroll
		for (int e = 0; e < 4; e++) {
			const int kk = kc * 16 + 2 * tq + (e & 1) + (e >> 1) * 8, g = kk / R, r = kk - g * R;
			bk[e] = kk < K;
			const __nv_bfloat16 *A16 = g == 0 ? A160 : g == 1 ? A161 : A162;
			bp[e] = bk[e] ? A16 + (size_t)r * (size_t)cols : A160;
		}
#pragma unroll
		for (int nt = 0; nt < LXM_COLS / 8; nt++) {
			const int col = c0 + nt * 8 + gq;
			const bool in = col < cols;
			__nv_bfloat16 b[4];
#pragma unroll
			for (int e = 0; e < 4; e++)
				b[e] = in && bk[e] ? bp[e][col] : zero;
			const uint32_t b0 = lx_pack16(b[0], b[1]), b1 = lx_pack16(b[2], b[3]);
			asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
				     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
				     : "+f"(acc[nt][0]), "+f"(acc[nt][1]), "+f"(acc[nt][2]),
				       "+f"(acc[nt][3])
				     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
		}
	}
}

/* The warp's C tiles (16 rows by LXM_COLS columns) into its part of st,
 * row by row, so that the epilogue reads a row's columns across the warp
 * (whole 128-byte lines) instead of the fragments' eight-column pieces. */
#define LXM_ST (LXM_COLS + 4) /* a row's floats in st: rows 16 bytes apart in banks */
static __device__ __forceinline__ void lx_stage(float (*st)[LXM_ST], const float (*acc)[4])
{
	const int lane = threadIdx.x % 32, gq = lane / 4, tq = lane % 4;
#pragma unroll
	for (int nt = 0; nt < LXM_COLS / 8; nt++) {
		*reinterpret_cast<float2 *>(&st[gq][nt * 8 + 2 * tq]) = make_float2(acc[nt][0], acc[nt][1]);
		*reinterpret_cast<float2 *>(&st[gq + 8][nt * 8 + 2 * tq]) =
			make_float2(acc[nt][2], acc[nt][3]);
	}
	__syncwarp();
}

extern "C" __global__ void __launch_bounds__(128)
	lora_dx_add_mma(float *__restrict__ dinp, const float *du0, const float *du1,
			const float *du2, const __nv_bfloat16 *A160, const __nv_bfloat16 *A161,
			const __nv_bfloat16 *A162, int G, int R, int rows, int cols)
{
	__shared__ __align__(16) float st[4][16][LXM_ST];
	const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
	const int r0 = blockIdx.y * LXM_ROWS + w * 16, c0 = blockIdx.x * LXM_COLS;
	/* the warp's 16 rows' loads issued first, in flight while the shares
	 * are formed, then the adds and stores (a row at a time after the
	 * shares left each lane one 8-byte load in flight: 1.7 TB/s on the 8B
	 * shapes' q, k, v) */
	const int col = c0 + 2 * lane, nr = min(16, rows - r0);
	float2 v[16];
#pragma unroll
	for (int j = 0; j < 16; j++)
		if (j < nr && col < cols)
			v[j] = *reinterpret_cast<const float2 *>(dinp + (size_t)(r0 + j) * (size_t)cols +
								 col);
	float acc[LXM_COLS / 8][4];
	lx_share(acc, du0, du1, du2, A160, A161, A162, G, R, rows, cols, r0, c0);
	lx_stage(st[w], acc);
	if (col >= cols)
		return;
#pragma unroll
	for (int j = 0; j < 16; j++)
		if (j < nr) {
			const float2 s = *reinterpret_cast<const float2 *>(&st[w][j][2 * lane]);
			v[j].x = __fadd_rn(v[j].x, s.x);
			v[j].y = __fadd_rn(v[j].y, s.y);
			*reinterpret_cast<float2 *>(dinp + (size_t)(r0 + j) * (size_t)cols + col) = v[j];
		}
}

/* swiglu_backward_lora_f32's bf16 form with the share on the tensor cores
 * (lora_dx_add_mma's tiles, sum and staging; cols even, every bf16 row
 * 4-byte aligned: the launcher's condition), then each element's swiglu
 * gradient from dout + share, two columns a lane. */
extern "C" __global__ void __launch_bounds__(128)
	swiglu_backward_lora_mma(__nv_bfloat16 *__restrict__ dgate16,
				 __nv_bfloat16 *__restrict__ dup16,
				 const __nv_bfloat16 *__restrict__ dout16,
				 const __nv_bfloat16 *__restrict__ gate16,
				 const __nv_bfloat16 *__restrict__ up16, const float *du,
				 const __nv_bfloat16 *A16, int R, int rows, int cols)
{
	__shared__ __align__(16) float st[4][16][LXM_ST];
	const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
	const int r0 = blockIdx.y * LXM_ROWS + w * 16, c0 = blockIdx.x * LXM_COLS;
	float acc[LXM_COLS / 8][4];
	lx_share(acc, du, nullptr, nullptr, A16, nullptr, nullptr, 1, R, rows, cols, r0, c0);
	lx_stage(st[w], acc);
	if (cols % 8 == 0 && (((uintptr_t)dgate16 | (uintptr_t)dup16 | (uintptr_t)dout16 |
			       (uintptr_t)gate16 | (uintptr_t)up16) & 15) == 0) {
		/* eight columns a lane, 16-byte loads and stores: a row's 64
		 * columns over 8 lanes, four rows at a time; each element's
		 * arithmetic as below (the same bits) */
		const int jj = lane / 8, cl = (lane % 8) * 8, col = c0 + cl;
		if (col >= cols)
			return;
		for (int j = jj; j < 16 && r0 + j < rows; j += 4) {
			const size_t e = ((size_t)(r0 + j) * (size_t)cols + (size_t)col) / 8;
			const float4 sa = *reinterpret_cast<const float4 *>(&st[w][j][cl]);
			const float4 sb = *reinterpret_cast<const float4 *>(&st[w][j][cl + 4]);
			const float sh[8] = {sa.x, sa.y, sa.z, sa.w, sb.x, sb.y, sb.z, sb.w};
			float x[8], u[8], d[8], g[8], q[8];
			cu_widen_bf16x8(reinterpret_cast<const uint4 *>(gate16)[e], x);
			cu_widen_bf16x8(reinterpret_cast<const uint4 *>(up16)[e], u);
			cu_widen_bf16x8(reinterpret_cast<const uint4 *>(dout16)[e], d);
#pragma unroll
			for (int k = 0; k < 8; k++)
				cu_swiglu_grad(x[k], u[k], __fadd_rn(d[k], sh[k]), g[k], q[k]);
			reinterpret_cast<uint4 *>(dgate16)[e] = cu_pack_bf16x8(g);
			reinterpret_cast<uint4 *>(dup16)[e] = cu_pack_bf16x8(q);
		}
		return;
	}
	const int col = c0 + 2 * lane;
	if (col >= cols)
		return;
	/* a row at a time: the 16 rows' loads issued first (as lora_dx_add_mma
	 * does) ran this kernel at half the speed on an H100 (0.62 -> 1.14 ms
	 * on the 8B shapes' MLP) */
	for (int j = 0; j < 16 && r0 + j < rows; j++) {
		const size_t e = ((size_t)(r0 + j) * (size_t)cols + (size_t)col) / 2;
		const float2 s = *reinterpret_cast<const float2 *>(&st[w][j][2 * lane]);
		const __nv_bfloat162 d2 = reinterpret_cast<const __nv_bfloat162 *>(dout16)[e];
		const __nv_bfloat162 g2 = reinterpret_cast<const __nv_bfloat162 *>(gate16)[e];
		const __nv_bfloat162 u2 = reinterpret_cast<const __nv_bfloat162 *>(up16)[e];
		float g0, p0, g1, p1;
		cu_swiglu_grad(__low2float(g2), __low2float(u2), __fadd_rn(__low2float(d2), s.x), g0,
			       p0);
		cu_swiglu_grad(__high2float(g2), __high2float(u2), __fadd_rn(__high2float(d2), s.y),
			       g1, p1);
		reinterpret_cast<__nv_bfloat162 *>(dgate16)[e] = __floats2bfloat162_rn(g0, g1);
		reinterpret_cast<__nv_bfloat162 *>(dup16)[e] = __floats2bfloat162_rn(p0, p1);
	}
}

/* out[i] = in[i] rounded to bf16 (nearest even): a GEMM operand for the
 * tensor cores in the bf16 mode. Four values per thread step (a 16-byte load,
 * an 8-byte store) where in and out are aligned for it; the launcher sizes
 * the grid for n / 4. */
extern "C" __global__ void cast_bf16_f32(__nv_bfloat16 *out, const float *in, size_t n)
{
	const size_t stride = (size_t)gridDim.x * blockDim.x;
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t done = 0;
	if (((uintptr_t)in & 15) == 0 && ((uintptr_t)out & 7) == 0) {
		const size_t n4 = n / 4;
		for (size_t j = i; j < n4; j += stride) {
			reinterpret_cast<uint2 *>(out)[j] =
				cu_pack_bf16x4(reinterpret_cast<const float4 *>(in)[j]);
		}
		done = n4 * 4;
	}
	for (size_t j = done + i; j < n; j += stride)
		out[j] = __float2bfloat16_rn(in[j]);
}

/* Row r of in (rows of cols floats) rounded into out + r * ldo, as
 * cast_bf16_f32 rounds each value: a block a row, grid-stride over rows.
 * Overwrite. */
extern "C" __global__ void cast_bf16_f32_rows(__nv_bfloat16 *out, size_t ldo, const float *in,
					      size_t rows, size_t cols)
{
	for (size_t r = blockIdx.x; r < rows; r += gridDim.x)
		for (size_t c = threadIdx.x; c < cols; c += blockDim.x)
			out[r * ldo + c] = __float2bfloat16_rn(in[r * cols + c]);
}

/* cast_bf16_f32_rows four values a thread (cols and ldo multiples of 4,
 * in 16-byte and out 8-byte aligned: the launcher checks), grid-stride over
 * the rows * cols / 4 quads: a row of Qwen2-0.5B's k (128 values) was a
 * block of 128 threads, each with one value in flight. */
extern "C" __global__ void cast_bf16_f32_rows4(__nv_bfloat16 *out, size_t ldo, const float *in,
					       size_t rows, size_t cols)
{
	const size_t q = cols / 4, n = rows * q;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const size_t r = i / q, c = i - r * q;
		const float4 v = reinterpret_cast<const float4 *>(in)[i];
		reinterpret_cast<uint2 *>(out + r * ldo)[c] = cu_pack_bf16x4(v);
	}
}

/* out (n) = in (bf16) widened to fp32, exactly. Overwrite. */
extern "C" __global__ void cast_f32_bf16(float *out, const __nv_bfloat16 *in, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		out[i] = __bfloat162float(in[i]);
}
