/* The optimizer step and the global-norm clip, fp32: the CUDA twins of
 * adamw_update, sumsq and scale_inplace in kernels/cpu/ops.h.
 *
 * AdamW runs PyTorch's order (torch.optim.AdamW, foreach=False) element by
 * element with the scalars the launcher formed on the host exactly as the CPU
 * op forms them, and the _rn intrinsics keep every rounding where the CPU has
 * it (no FMA contraction; IEEE sqrt and division whatever the nvcc flags), so
 * parameters and moments are bit-identical to the CPU backend's.
 *
 * sumsq leaves one double per block in a scratch the launcher downloads and
 * adds up on the host in block order: deterministic for a given grid, which
 * the launcher derives from n alone.
 *
 * Key: n values. */
#include "common.cuh"

/* One element of the AdamW kernels, exactly as the CPU's adamw_update rounds it. */
static __device__ __forceinline__ void adamw_one(float &p, float g0, float gscale, float &m,
						 float &v,
						 float decay, float omb1, float omb2, float beta2,
						 float bc2_sqrt, float step_size, float eps)
{
	const float g = __fmul_rn(g0, gscale), m0 = m, v0 = v;
	const float pd = __fmul_rn(p, decay);
	const float mi = __fadd_rn(m0, __fmul_rn(omb1, __fsub_rn(g, m0)));
	const float vi = __fadd_rn(__fmul_rn(v0, beta2), __fmul_rn(__fmul_rn(omb2, g), g));
	const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
	p = __fsub_rn(pd, __fdiv_rn(__fmul_rn(step_size, mi), denom));
	m = mi;
	v = vi;
}

/* g = grad * gscale (a clip's coefficient, rounded as scale_f32 rounds it;
 * 1: the gradient as it is) ; param *= decay ; m += omb1*(g - m) ; v = v*beta2 + omb2*g*g ;
 * param -= step_size * m / (sqrt(v) / bc2_sqrt + eps), with decay =
 * 1 - lr*wd, omb = 1 - beta, bc2_sqrt = sqrt(1 - beta2^t), step_size =
 * lr / (1 - beta1^t). param16: NULL, or the parameters' bf16 copy, which
 * gets the new values rounded (the bf16 mode's GEMMs read it). */
extern "C" __global__ void adamw_update_f32(float *param, __nv_bfloat16 *param16,
					    const float *grad, float gscale, float *m, float *v, size_t n,
					    float decay, float omb1, float omb2, float beta2,
					    float bc2_sqrt, float step_size, float eps)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		float p = param[i], mm = m[i], vv = v[i];
		adamw_one(p, grad[i], gscale, mm, vv, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
		param[i] = p;
		if (param16)
			param16[i] = __float2bfloat16_rn(p);
		m[i] = mm;
		v[i] = vv;
	}
}

/* adamw_update_f32 over n values, rows of C, whose gradient is kept by rows
 * (kernels/cpu/ops.h: adamw_update_rows): value i's is rows[row_of[i / C]]'s
 * i % C, or zero where row_of is negative; the same arithmetic (adamw_one),
 * so the bits of adamw_update_f32 over the gradient as a table. */
extern "C" __global__ void adamw_update_rows_f32(float *param, const float *rows,
						 const int32_t *row_of, int C, float gscale, float *m,
						 float *v, size_t n, float decay, float omb1, float omb2,
						 float beta2, float bc2_sqrt, float step_size, float eps)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const size_t r = i / (size_t)C;
		const int32_t s = row_of[r];
		const float g = s >= 0 ? rows[(size_t)s * C + (i - r * C)] : 0.0f;
		float p = param[i], mm = m[i], vv = v[i];
		adamw_one(p, g, gscale, mm, vv, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
		param[i] = p;
		m[i] = mm;
		v[i] = vv;
	}
}

/* adamw_update_rows_f32 by rows, four values a thread (C a multiple of 4,
 * param, rows, m and v 16-byte aligned: the launcher checks): a block takes
 * a row at a time, grid-stride over the n / C rows, its threads over the
 * row's C / 4 quads, so the row's slot is read once and no value divides
 * its index. The same arithmetic (adamw_one), so the same bits; the scalar
 * kernel's index division and one value a load ran the Llama-3-8B shapes'
 * embedding (525 M values, 24 bytes each) at 2.6 TB/s. */
extern "C" __global__ void adamw_update_rows_v4_f32(float *param, const float *rows,
						    const int32_t *row_of, int C, float gscale,
						    float *m, float *v, size_t n, float decay,
						    float omb1, float omb2, float beta2,
						    float bc2_sqrt, float step_size, float eps)
{
	const size_t nrows = n / (size_t)C;
	const int q = C / 4;
	for (size_t r = blockIdx.x; r < nrows; r += gridDim.x) {
		const int32_t s = row_of[r];
		const float4 *g4 = s >= 0 ? reinterpret_cast<const float4 *>(rows + (size_t)s * C) : NULL;
		float4 *p4 = reinterpret_cast<float4 *>(param + r * (size_t)C);
		float4 *m4 = reinterpret_cast<float4 *>(m + r * (size_t)C);
		float4 *v4 = reinterpret_cast<float4 *>(v + r * (size_t)C);
		for (int c = threadIdx.x; c < q; c += blockDim.x) {
			const float4 g = g4 ? g4[c] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
			float4 p = p4[c], mm = m4[c], vv = v4[c];
			adamw_one(p.x, g.x, gscale, mm.x, vv.x, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
			adamw_one(p.y, g.y, gscale, mm.y, vv.y, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
			adamw_one(p.z, g.z, gscale, mm.z, vv.z, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
			adamw_one(p.w, g.w, gscale, mm.w, vv.w, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
			p4[c] = p;
			m4[c] = mm;
			v4[c] = vv;
		}
	}
}

/* adamw_update_f32 four values a thread step, for the launcher where every
 * pointer is 16-byte aligned (param16 8-byte): the same arithmetic element
 * by element, so the same bits; a streaming kernel moving 30 bytes a value
 * wants the wide loads to come near the memory's bandwidth. The n % 4 last
 * values are the first thread's. */
extern "C" __global__ void adamw_update_v4_f32(float *param, __nv_bfloat16 *param16,
					       const float *grad, float gscale, float *m, float *v, size_t n,
					       float decay, float omb1, float omb2, float beta2,
					       float bc2_sqrt, float step_size, float eps)
{
	const size_t n4 = n / 4;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
	     i += (size_t)gridDim.x * blockDim.x) {
		float4 p = reinterpret_cast<const float4 *>(param)[i];
		const float4 g = reinterpret_cast<const float4 *>(grad)[i];
		float4 mm = reinterpret_cast<const float4 *>(m)[i];
		float4 vv = reinterpret_cast<const float4 *>(v)[i];
		adamw_one(p.x, g.x, gscale, mm.x, vv.x, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
		adamw_one(p.y, g.y, gscale, mm.y, vv.y, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
		adamw_one(p.z, g.z, gscale, mm.z, vv.z, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
		adamw_one(p.w, g.w, gscale, mm.w, vv.w, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
		reinterpret_cast<float4 *>(param)[i] = p;
		reinterpret_cast<float4 *>(m)[i] = mm;
		reinterpret_cast<float4 *>(v)[i] = vv;
		if (param16) {
			__nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y);
			__nv_bfloat162 hi = __floats2bfloat162_rn(p.z, p.w);
			uint2 packed;
			packed.x = *reinterpret_cast<uint32_t *>(&lo);
			packed.y = *reinterpret_cast<uint32_t *>(&hi);
			reinterpret_cast<uint2 *>(param16)[i] = packed;
		}
	}
	if (blockIdx.x == 0 && threadIdx.x == 0)
		for (size_t i = n4 * 4; i < n; i++) {
			float p = param[i], mm = m[i], vv = v[i];
			adamw_one(p, grad[i], gscale, mm, vv, decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps);
			param[i] = p;
			m[i] = mm;
			v[i] = vv;
			if (param16)
				param16[i] = __float2bfloat16_rn(p);
		}
}

/* partial[blockIdx.x] = sum of x[i]^2 over this block's grid-stride share,
 * in double. */
extern "C" __global__ void sumsq_f32(double *partial, const float *x, size_t n)
{
	double acc = 0.0;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const double xi = x[i];
		acc += xi * xi;
	}
	acc = cu_block_sum(acc);
	if (threadIdx.x == 0)
		partial[blockIdx.x] = acc;
}

/* sumsq_f32 four values a thread step (x 16-byte aligned), two float4s a
 * thread in flight: a thread's float4s i, i + 2 S, ... (S the grid's
 * threads) add their squares in x, y, z, w order into one sum, those at i +
 * S, i + 3 S, ... into another, added at the end; the n % 4 last values go
 * to the first thread. A different order from sumsq_f32's, fixed as well by
 * the grid (the launcher's, from n alone). One float4 at a time kept the
 * reads of a Qwen2-0.5B step's 2 GB of gradients at 3.3 TB/s on an H200. */
static __device__ __forceinline__ void sumsq_add4(double &acc, float4 q)
{
	acc += (double)q.x * q.x;
	acc += (double)q.y * q.y;
	acc += (double)q.z * q.z;
	acc += (double)q.w * q.w;
}

extern "C" __global__ void sumsq_v4_f32(double *partial, const float *x, size_t n)
{
	double acc = 0.0, acc2 = 0.0;
	const size_t n4 = n / 4, S = (size_t)gridDim.x * blockDim.x;
	const float4 *x4 = reinterpret_cast<const float4 *>(x);
	size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
	for (; i + S < n4; i += 2 * S) {
		const float4 a = x4[i], b = x4[i + S];
		sumsq_add4(acc, a);
		sumsq_add4(acc2, b);
	}
	if (i < n4)
		sumsq_add4(acc, x4[i]);
	acc += acc2;
	if (blockIdx.x == 0 && threadIdx.x == 0)
		for (size_t i = n4 * 4; i < n; i++)
			acc += (double)x[i] * x[i];
	acc = cu_block_sum(acc);
	if (threadIdx.x == 0)
		partial[blockIdx.x] = acc;
}

/* scale_f32 four values a thread step (x 16-byte aligned). */
extern "C" __global__ void scale_v4_f32(float *x, float s, size_t n)
{
	const size_t n4 = n / 4;
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
	     i += (size_t)gridDim.x * blockDim.x) {
		float4 q = reinterpret_cast<float4 *>(x)[i];
		q.x *= s, q.y *= s, q.z *= s, q.w *= s;
		reinterpret_cast<float4 *>(x)[i] = q;
	}
	if (blockIdx.x == 0 && threadIdx.x == 0)
		for (size_t i = n4 * 4; i < n; i++)
			x[i] *= s;
}

/* x *= s. */
extern "C" __global__ void scale_f32(float *x, float s, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		x[i] *= s;
}
