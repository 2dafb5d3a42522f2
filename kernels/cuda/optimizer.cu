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

/* param *= decay ; m += omb1*(g - m) ; v = v*beta2 + omb2*g*g ;
 * param -= step_size * m / (sqrt(v) / bc2_sqrt + eps), with decay =
 * 1 - lr*wd, omb = 1 - beta, bc2_sqrt = sqrt(1 - beta2^t), step_size =
 * lr / (1 - beta1^t). param16: NULL, or the parameters' bf16 copy, which
 * gets the new values rounded (the bf16 mode's GEMMs read it). */
extern "C" __global__ void adamw_update_f32(float *param, __nv_bfloat16 *param16,
					    const float *grad, float *m, float *v, size_t n,
					    float decay, float omb1, float omb2, float beta2,
					    float bc2_sqrt, float step_size, float eps)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x) {
		const float g = grad[i], m0 = m[i], v0 = v[i];
		const float p = __fmul_rn(param[i], decay);
		const float mi = __fadd_rn(m0, __fmul_rn(omb1, __fsub_rn(g, m0)));
		const float vi = __fadd_rn(__fmul_rn(v0, beta2), __fmul_rn(__fmul_rn(omb2, g), g));
		const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
		const float pn = __fsub_rn(p, __fdiv_rn(__fmul_rn(step_size, mi), denom));
		param[i] = pn;
		if (param16)
			param16[i] = __float2bfloat16_rn(pn);
		m[i] = mi;
		v[i] = vi;
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

/* x *= s. */
extern "C" __global__ void scale_f32(float *x, float s, size_t n)
{
	for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
	     i += (size_t)gridDim.x * blockDim.x)
		x[i] *= s;
}
