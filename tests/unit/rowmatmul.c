/* Row-wise matmuls for tests (tests/unit/rowmatmul.h). */
#include "tests/unit/rowmatmul.h"

#include <assert.h>
#include <string.h>
#include <stdbool.h>
#include <stddef.h>

#include "gpu/backend.h"

/* out (N,OC) = inp (N,C) @ weight (OC,C)^T + bias: each element one sum over
 * c in order, then the bias. */
static void row_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, const float *inp,
			const gpu_bf16 *inp16, const float *weight, const gpu_bf16 *weight16,
			const float *bias, int N, int C, int OC)
{
	(void)be;
	assert(out && inp && weight && !out16 && !inp16 && !weight16);
	for (int n = 0; n < N; n++)
		for (int o = 0; o < OC; o++) {
			const float *x = inp + (size_t)n * C, *w = weight + (size_t)o * C;
			float s = 0.0f;
			for (int c = 0; c < C; c++)
				s += x[c] * w[c];
			out[(size_t)n * OC + o] = bias ? s + bias[o] : s;
		}
}

/* out (N,OC) += inp @ weight^T: each element's sum over c in order, added
 * once. */
static void row_forward_add(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			    const float *inp, const gpu_bf16 *inp16, const float *weight,
			    const gpu_bf16 *weight16, int N, int C, int OC)
{
	(void)be;
	assert(out && inp && weight && !out16 && !inp16 && !weight16);
	for (int n = 0; n < N; n++)
		for (int o = 0; o < OC; o++) {
			const float *x = inp + (size_t)n * C, *w = weight + (size_t)o * C;
			float s = 0.0f;
			for (int c = 0; c < C; c++)
				s += x[c] * w[c];
			out[(size_t)n * OC + o] += s;
		}
}

/* dinp (N,C) (+)= dout @ weight: one sum over o per element, added once;
 * dweight (OC,C) (+)= dout^T @ inp and dbias += sum_n dout, row n's
 * contribution added before row n+1's. */
static void row_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16, float *dweight,
			 float *dbias,
			 const float *dout, const gpu_bf16 *dout16, const float *inp,
			 const gpu_bf16 *inp16, const float *weight, const gpu_bf16 *weight16,
			 int N, int C, int OC, unsigned set)
{
	(void)be;
	const bool dinp_set = set & GPU_SET_DINP;
	assert(dout && inp && !dinp16 && !dout16 && !inp16 && !weight16);
	if (dweight && (set & GPU_SET_DWEIGHT))
		memset(dweight, 0, sizeof(float) * (size_t)OC * (size_t)C);
	for (int n = 0; n < N; n++) {
		const float *d = dout + (size_t)n * OC, *x = inp + (size_t)n * C;
		if (dinp)
			for (int c = 0; c < C; c++) {
				float s = 0.0f;
				for (int o = 0; o < OC; o++)
					s += d[o] * weight[(size_t)o * C + c];
				float *di = dinp + (size_t)n * C + c;
				*di = dinp_set ? s : *di + s;
			}
		if (dweight)
			for (int o = 0; o < OC; o++)
				for (int c = 0; c < C; c++)
					dweight[(size_t)o * C + c] += d[o] * x[c];
		if (dbias)
			for (int o = 0; o < OC; o++)
				dbias[o] += d[o];
	}
}

void rowmatmul_install(struct gpu_backend *be)
{
	/* One table for every backend a test installs into: all are CPU
	 * backends, whose other ops are the same functions. */
	static struct gpu_backend_ops ops;
	assert(!gpu_gemm_bf16(be));
	ops = *be->ops;
	ops.matmul_forward = row_forward;
	ops.matmul_forward_add = row_forward_add;
	ops.matmul_backward = row_backward;
	be->ops = &ops;
}
