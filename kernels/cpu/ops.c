/* Reference ops in C, fp32: the implementations of kernels/cpu/ops.h.
 *
 * Single-threaded, deterministic C; the only parallelism is whatever OpenBLAS
 * does inside sgemm, which does not split the reduction dimension and so gives
 * the same bits run to run. The numerics follow Hugging Face transformers in
 * float32 (where rounding is done, and in what order), with reductions that
 * feed a single scalar (norms, softmax sums, losses) accumulated in double.
 * Not a fast path: attention is materialised as (T,T) per head, as in HF's
 * eager attention. Shapes and contracts are documented in ops.h.
 *
 * Key: B batch, T sequence, N = B*T rows, C channels, OC output channels,
 * V vocab, NH query heads, NKV key/value heads, HS head size. */
#include "kernels/cpu/ops.h"

#include <assert.h>
#include <cblas.h>
#include <math.h>
#include <string.h>

static float row_max(const float *x, int n);
static void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha,
		 const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);

/* ------------------------------------------------------------------ ops -- */

void embedding_forward(float *restrict out, const int32_t *restrict ids,
		       const float *restrict wte, int N, int C)
{
	for (int n = 0; n < N; n++)
		memcpy(out + (size_t)n * C, wte + (size_t)ids[n] * C, sizeof(float) * (size_t)C);
}

/* Rows are scattered in n order, so repeated ids sum in a fixed order. */
void embedding_backward(float *restrict dwte, const float *restrict dout,
			const int32_t *restrict ids, int N, int C)
{
	for (int n = 0; n < N; n++) {
		float *restrict d = dwte + (size_t)ids[n] * C;
		const float *restrict g = dout + (size_t)n * C;
		for (int c = 0; c < C; c++)
			d[c] += g[c];
	}
}

/* Row n's columns [*c0, *c1) whose elements lie in [lo, hi). */
static void part_cols(int32_t id, int C, size_t lo, size_t hi, int *c0, int *c1)
{
	const size_t e0 = (size_t)id * (size_t)C, e1 = e0 + (size_t)C;
	*c0 = e0 >= lo ? 0 : lo >= e1 ? C : (int)(lo - e0);
	*c1 = e1 <= hi ? C : hi <= e0 ? 0 : (int)(hi - e0);
}

void embedding_forward_part(float *restrict out, const int32_t *restrict ids,
			    const float *restrict part, int N, int C, size_t lo, size_t hi)
{
	for (int n = 0; n < N; n++) {
		float *restrict o = out + (size_t)n * C;
		int c0, c1;
		part_cols(ids[n], C, lo, hi, &c0, &c1);
		const size_t e0 = (size_t)ids[n] * (size_t)C;
		for (int c = 0; c < C; c++)
			o[c] = c >= c0 && c < c1 ? part[e0 + (size_t)c - lo] : 0.0f;
	}
}

void embedding_backward_part(float *restrict part, const float *restrict dout,
			     const int32_t *restrict ids, int N, int C, size_t lo, size_t hi)
{
	for (int n = 0; n < N; n++) {
		int c0, c1;
		part_cols(ids[n], C, lo, hi, &c0, &c1);
		const size_t e0 = (size_t)ids[n] * (size_t)C;
		const float *restrict g = dout + (size_t)n * C;
		for (int c = c0; c < c1; c++)
			part[e0 + (size_t)c - lo] += g[c];
	}
}

/* HF rounds x*rstd to float before multiplying by weight; so do we. */
void rmsnorm_forward(float *restrict out, float *restrict rstd, const float *restrict inp,
		     const float *restrict weight, int N, int C, float eps)
{
	for (int n = 0; n < N; n++) {
		const float *restrict x = inp + (size_t)n * C;
		float *restrict o = out + (size_t)n * C;
		double ss = 0.0;
		for (int c = 0; c < C; c++)
			ss += (double)x[c] * x[c];
		float var = (float)(ss / C);
		float r = 1.0f / sqrtf(var + eps);
		for (int c = 0; c < C; c++)
			o[c] = weight[c] * (x[c] * r);
		rstd[n] = r;
	}
}

/* With g = weight*dout and r = rstd:
 *   dinp = r*g - x * r^3 * mean(g*x)   (r depends on every x of the row)
 *   dweight = dout * x * r                                                  */
void rmsnorm_backward(float *restrict dinp, float *restrict dweight, const float *restrict dout,
		      const float *restrict inp, const float *restrict weight,
		      const float *restrict rstd, int N, int C)
{
	for (int n = 0; n < N; n++) {
		const float *restrict x = inp + (size_t)n * C;
		const float *restrict d = dout + (size_t)n * C;
		float *restrict dx = dinp + (size_t)n * C;
		float r = rstd[n];
		double dot = 0.0;
		for (int c = 0; c < C; c++)
			dot += (double)(weight[c] * d[c]) * x[c];
		float k = (float)(dot / C * r * r * r);
		for (int c = 0; c < C; c++)
			dx[c] += r * (weight[c] * d[c]) - k * x[c];
		if (dweight)
			for (int c = 0; c < C; c++)
				dweight[c] += d[c] * (x[c] * r);
	}
}

void matmul_forward(float *restrict out, const float *restrict inp, const float *restrict weight,
		    const float *restrict bias, int N, int C, int OC)
{
	gemm(CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC);
	if (bias)
		for (int n = 0; n < N; n++) {
			float *restrict o = out + (size_t)n * OC;
			for (int j = 0; j < OC; j++)
				o[j] += bias[j];
		}
}

void matmul_forward_add(float *restrict out, const float *restrict inp,
			const float *restrict weight, int N, int C, int OC)
{
	gemm(CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, 1.0f, out, OC);
}

void matmul_backward(float *restrict dinp, float *restrict dweight, float *restrict dbias,
		     const float *restrict dout, const float *restrict inp,
		     const float *restrict weight, int N, int C, int OC)
{
	if (dinp)
		gemm(CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp,
		     C);
	if (dweight)
		gemm(CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C);
	if (dbias)
		for (int n = 0; n < N; n++) {
			const float *restrict d = dout + (size_t)n * OC;
			for (int j = 0; j < OC; j++)
				dbias[j] += d[j];
		}
}

/* Every step in float32, as transformers does: inv_freq from a float pow,
 * angle = float(t) * inv_freq rounded to float, then cos/sin of that float.
 * Computing the angle in double would drift from HF by ~t*1e-7 radians. */
void rope_cache(float *restrict cos, float *restrict sin, int T, int HS, double theta)
{
	assert(HS % 2 == 0);
	int H2 = HS / 2;
	for (int i = 0; i < H2; i++) {
		float inv_freq = 1.0f / powf((float)theta, (float)(2 * i) / (float)HS);
		for (int t = 0; t < T; t++) {
			float angle = (float)t * inv_freq;
			cos[(size_t)t * H2 + i] = cosf(angle);
			sin[(size_t)t * H2 + i] = sinf(angle);
		}
	}
}

/* Each i reads x[i] and x[i+H2] before writing them, so out may alias inp:
 * hence no restrict on out/inp. */
void rope_forward(float *out, const float *inp, const float *restrict cos,
		  const float *restrict sin, int B, int T, int NH, int HS)
{
	int H2 = HS / 2;
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++) {
			const float *restrict c = cos + (size_t)t * H2;
			const float *restrict s = sin + (size_t)t * H2;
			for (int h = 0; h < NH; h++) {
				size_t off = (((size_t)b * T + t) * NH + h) * HS;
				const float *x = inp + off;
				float *o = out + off;
				for (int i = 0; i < H2; i++) {
					float x1 = x[i], x2 = x[i + H2];
					o[i] = x1 * c[i] - x2 * s[i];
					o[i + H2] = x2 * c[i] + x1 * s[i];
				}
			}
		}
}

void rope_backward(float *dinp, const float *dout, const float *restrict cos,
		   const float *restrict sin, int B, int T, int NH, int HS)
{
	int H2 = HS / 2;
	for (int b = 0; b < B; b++)
		for (int t = 0; t < T; t++) {
			const float *restrict c = cos + (size_t)t * H2;
			const float *restrict s = sin + (size_t)t * H2;
			for (int h = 0; h < NH; h++) {
				size_t off = (((size_t)b * T + t) * NH + h) * HS;
				const float *d = dout + off;
				float *dx = dinp + off;
				for (int i = 0; i < H2; i++) {
					float d1 = d[i], d2 = d[i + H2];
					dx[i] = d1 * c[i] + d2 * s[i];
					dx[i + H2] = d2 * c[i] - d1 * s[i];
				}
			}
		}
}

/* Per (b, h): S = Q K^T * scale (T,T), causal softmax in place in att,
 * out = P V. Q, K, V and out are strided views of the (B,T,heads,HS)
 * tensors: row t of head h starts at ((b*T+t)*NH+h)*HS, so the leading
 * dimension is NH*HS (NKV*HS for K, V) and nothing is copied. The full (T,T)
 * product is formed and the upper triangle then zeroed; that wastes half the
 * flops but keeps both products single sgemm calls. */
void attention_forward(float *restrict out, float *restrict att, const float *restrict q,
		       const float *restrict k, const float *restrict v, int B, int T, int NH,
		       int NKV, int HS)
{
	assert(NKV > 0 && NH % NKV == 0);
	int group = NH / NKV;
	int ldq = NH * HS, ldk = NKV * HS;
	float scale = 1.0f / sqrtf((float)HS);
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++) {
			int kh = h / group;
			const float *Q = q + (size_t)b * T * ldq + (size_t)h * HS;
			const float *K = k + (size_t)b * T * ldk + (size_t)kh * HS;
			const float *Vm = v + (size_t)b * T * ldk + (size_t)kh * HS;
			float *O = out + (size_t)b * T * ldq + (size_t)h * HS;
			float *P = att + ((size_t)b * NH + h) * T * T;

			gemm(CblasNoTrans, CblasTrans, T, T, HS, scale, Q, ldq, K, ldk, 0.0f, P, T);
			for (int t = 0; t < T; t++) {
				float *restrict row = P + (size_t)t * T;
				float max = row[0];
				for (int s = 1; s <= t; s++)
					max = row[s] > max ? row[s] : max;
				double sum = 0.0;
				for (int s = 0; s <= t; s++) {
					row[s] = expf(row[s] - max);
					sum += row[s];
				}
				float inv = (float)(1.0 / sum);
				for (int s = 0; s <= t; s++)
					row[s] *= inv;
				for (int s = t + 1; s < T; s++)
					row[s] = 0.0f;
			}
			gemm(CblasNoTrans, CblasNoTrans, T, HS, T, 1.0f, P, T, Vm, ldk, 0.0f, O, ldq);
		}
}

/* Per (b, h), with datt as dS:
 *   dP = dout V^T ; dS = P * (dP - D) with D = rowsum(dP * P), or dr's row
 *   where dr is given ;
 *   dq = dS K * scale ; dk += dS^T Q * scale ; dv += P^T dout.
 * dq slices belong to one query head, so they are written (beta 0); dk, dv
 * slices are shared by a group of query heads and summed over them in h
 * order, after zeroing. */
void attention_backward_dr(float *restrict dq, float *restrict dk, float *restrict dv,
			   float *restrict datt, const float *restrict dout,
			   const float *restrict q, const float *restrict k,
			   const float *restrict v, const float *restrict att,
			   const float *restrict dr, int B, int T, int NH, int NKV, int HS)
{
	assert(NKV > 0 && NH % NKV == 0);
	int group = NH / NKV;
	int ldq = NH * HS, ldk = NKV * HS;
	float scale = 1.0f / sqrtf((float)HS);
	size_t kv_size = (size_t)B * T * NKV * HS;
	memset(dk, 0, sizeof(float) * kv_size);
	memset(dv, 0, sizeof(float) * kv_size);
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++) {
			int kh = h / group;
			size_t qoff = (size_t)b * T * ldq + (size_t)h * HS;
			size_t koff = (size_t)b * T * ldk + (size_t)kh * HS;
			const float *P = att + ((size_t)b * NH + h) * T * T;
			float *dS = datt + ((size_t)b * NH + h) * T * T;

			gemm(CblasNoTrans, CblasTrans, T, T, HS, 1.0f, dout + qoff, ldq, v + koff, ldk,
			     0.0f, dS, T);
			const float *D = dr ? dr + ((size_t)b * NH + h) * T : NULL;
			for (int t = 0; t < T; t++) {
				const float *restrict p = P + (size_t)t * T;
				float *restrict d = dS + (size_t)t * T;
				double dot = 0.0;
				for (int s = 0; !D && s <= t; s++)
					dot += (double)p[s] * d[s];
				float fdot = D ? D[t] : (float)dot;
				for (int s = 0; s <= t; s++)
					d[s] = p[s] * (d[s] - fdot);
				for (int s = t + 1; s < T; s++)
					d[s] = 0.0f;
			}
			gemm(CblasNoTrans, CblasNoTrans, T, HS, T, scale, dS, T, k + koff, ldk, 0.0f,
			     dq + qoff, ldq);
			gemm(CblasTrans, CblasNoTrans, T, HS, T, scale, dS, T, q + qoff, ldq, 1.0f,
			     dk + koff, ldk);
			gemm(CblasTrans, CblasNoTrans, T, HS, T, 1.0f, P, T, dout + qoff, ldq, 1.0f,
			     dv + koff, ldk);
		}
}

void attention_backward(float *restrict dq, float *restrict dk, float *restrict dv,
			float *restrict datt, const float *restrict dout, const float *restrict q,
			const float *restrict k, const float *restrict v,
			const float *restrict att, int B, int T, int NH, int NKV, int HS)
{
	attention_backward_dr(dq, dk, dv, datt, dout, q, k, v, att, NULL, B, T, NH, NKV, HS);
}

/* silu written as torch writes it, x / (1 + exp(-x)); for x << 0, exp
 * overflows to inf and the quotient is -0, which is the right limit. */
void swiglu_forward(float *restrict out, const float *restrict gate, const float *restrict up,
		    size_t n)
{
	for (size_t i = 0; i < n; i++)
		out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* d silu(x)/dx = sig(x) * (1 + x * (1 - sig(x))). */
/* dout may alias dgate (each element read before it is written): no
 * restrict on those two. */
void swiglu_backward(float *dgate, float *restrict dup, const float *dout,
		     const float *restrict gate, const float *restrict up, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		float x = gate[i];
		float sig = 1.0f / (1.0f + expf(-x));
		dup[i] = dout[i] * (x * sig);
		dgate[i] = dout[i] * up[i] * (sig * (1.0f + x * (1.0f - sig)));
	}
}

void lora_dx_add(float *restrict dout, const float *const *du, const float *const *A, int G,
		 int N, int R, int cols)
{
	for (int n = 0; n < N; n++) {
		float *d = dout + (size_t)n * cols;
		for (int i = 0; i < cols; i++) {
			float t = 0.0f;
			for (int g = 0; g < G; g++) {
				const float *u = du[g] + (size_t)n * R;
				for (int r = 0; r < R; r++) {
					t = fmaf(u[r], A[g][(size_t)r * cols + i], t);
				}
			}
			d[i] = d[i] + t;
		}
	}
}

/* out may alias a or b: no restrict. */
void residual_forward(float *out, const float *a, const float *b, size_t n)
{
	for (size_t i = 0; i < n; i++)
		out[i] = a[i] + b[i];
}

void add_inplace(float *restrict y, const float *restrict x, size_t n)
{
	for (size_t i = 0; i < n; i++)
		y[i] += x[i];
}

/* logsumexp in double around the row max; the loss is returned in float. */
void crossentropy_forward(float *restrict losses, const float *restrict logits,
			  const int32_t *restrict targets, int N, int V)
{
	for (int n = 0; n < N; n++) {
		int32_t tgt = targets[n];
		if (tgt == -100) {
			losses[n] = 0.0f;
			continue;
		}
		assert(tgt >= 0 && tgt < V);
		const float *restrict x = logits + (size_t)n * V;
		float max = row_max(x, V);
		double sum = 0.0;
		for (int i = 0; i < V; i++)
			sum += exp((double)x[i] - max);
		losses[n] = (float)((double)max + log(sum) - (double)x[tgt]);
	}
}

/* In place is allowed (dlogits == logits): the row's max and sum are taken
 * before the row is overwritten, and each element is then read just before
 * it is written. Hence no restrict on dlogits/logits. */
void crossentropy_backward(float *dlogits, const float *logits, const int32_t *restrict targets,
			   float dloss, int N, int V)
{
	for (int n = 0; n < N; n++) {
		int32_t tgt = targets[n];
		float *d = dlogits + (size_t)n * V;
		if (tgt == -100) {
			memset(d, 0, sizeof(float) * (size_t)V);
			continue;
		}
		assert(tgt >= 0 && tgt < V);
		const float *x = logits + (size_t)n * V;
		float max = row_max(x, V);
		double sum = 0.0;
		for (int i = 0; i < V; i++)
			sum += exp((double)x[i] - max);
		float inv = (float)(1.0 / sum);
		for (int i = 0; i < V; i++)
			d[i] = dloss * (expf(x[i] - max) * inv);
		d[tgt] -= dloss;
	}
}

/* n values; grad NULL: a gradient of zeros */
static void adamw_span(float *restrict param, const float *restrict grad, float gscale,
		       float *restrict m, float *restrict v, size_t n, const struct adamw_scalars *k)
{
	for (size_t i = 0; i < n; i++) {
		float g = (grad ? grad[i] : 0.0f) * gscale;
		float p = param[i] * k->decay;
		float mi = m[i] + k->omb1 * (g - m[i]);
		float vi = v[i] * k->beta2 + k->omb2 * g * g;
		float denom = sqrtf(vi) / k->bc2_sqrt + k->eps;
		param[i] = p - k->step_size * mi / denom;
		m[i] = mi;
		v[i] = vi;
	}
}

void adamw_update(float *restrict param, const float *restrict grad, float gscale,
		  float *restrict m, float *restrict v, size_t n, float lr, float beta1, float beta2,
		  float eps, float weight_decay, int t)
{
	assert(t >= 1);
	const struct adamw_scalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
	adamw_span(param, grad, gscale, m, v, n, &k);
}

void adamw_update_rows(float *param, const float *rows, const int32_t *row_of, int C, float gscale,
		       float *m, float *v, size_t n, float lr, float beta1, float beta2, float eps,
		       float weight_decay, int t)
{
	assert(t >= 1);
	const struct adamw_scalars k = adamw_scalars(lr, beta1, beta2, eps, weight_decay, t);
	assert(C > 0 && n % (size_t)C == 0);
	for (size_t r = 0; r < n / (size_t)C; r++) {
		const size_t at = r * (size_t)C;
		adamw_span(param + at, row_of[r] >= 0 ? rows + (size_t)row_of[r] * C : NULL, gscale,
			   m + at, v + at, (size_t)C, &k);
	}
}

/* Four partial sums so the loop vectorises without -ffast-math; the order is
 * fixed, so the result is deterministic. */
double sumsq(const float *restrict x, size_t n)
{
	double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
	size_t i = 0;
	for (; i + 4 <= n; i += 4) {
		s0 += (double)x[i] * x[i];
		s1 += (double)x[i + 1] * x[i + 1];
		s2 += (double)x[i + 2] * x[i + 2];
		s3 += (double)x[i + 3] * x[i + 3];
	}
	for (; i < n; i++)
		s0 += (double)x[i] * x[i];
	return (s0 + s1) + (s2 + s3);
}

void scale_inplace(float *restrict x, float s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		x[i] *= s;
}

void bf16_round(uint16_t *restrict out, const float *restrict in, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t u;
		memcpy(&u, &in[i], sizeof(u));
		if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: the canonical quiet NaN, as CUDA's */
			out[i] = 0x7fffu;
		else /* nearest even; a carry out of the mantissa is the right rounding too */
			out[i] = (uint16_t)((u + 0x7fffu + (u >> 16 & 1u)) >> 16);
	}
}

/* No restrict: the in-place use of the contract aliases in and out. */
void bf16_widen(float *out, const uint16_t *in, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint32_t u = (uint32_t)in[i] << 16;
		memcpy(&out[i], &u, sizeof(u));
	}
}

/* -------------------------------------------------------------- helpers -- */

static float row_max(const float *restrict x, int n)
{
	float max = -INFINITY;
	for (int i = 0; i < n; i++)
		max = x[i] > max ? x[i] : max;
	return max;
}

/* Row-major sgemm, C = alpha * op(A) op(B) + beta * C with C (M,N). cblas
 * rejects a zero leading dimension, so empty products are handled here:
 * nothing to write when M or N is 0, and only the beta scaling when K is 0. */
static void gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha,
		 const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
	if (M <= 0 || N <= 0)
		return;
	if (K <= 0) {
		for (int i = 0; i < M; i++)
			for (int j = 0; j < N; j++)
				C[(size_t)i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[(size_t)i * ldc + j];
		return;
	}
	cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* -------------------------------------------------------------- methods -- */

/* bitsandbytes' NF4 table (the QLoRA paper's values, as float32). */
const float nf4_code[16] = {
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

/* The code nearest x by |x - code| in float, as a scan of all 16 finds it
 * (the lower of two at the same distance; 0 for NaN), in five comparisons:
 * the codes ascend, and fabsf(x - c) rounds monotonically in the exact
 * distance, so the nearest is one of the two codes around x (codes further
 * away are at least 0.079 further, far past a rounding step near 2). +inf
 * (a block whose absmax's inverse overflowed) is nearest 1.0, where a scan
 * found every distance infinite and kept code 0. */
static uint8_t nf4_nearest(float x)
{
	if (!(x > nf4_code[0])) /* NaN, x <= -1 */
		return 0;
	unsigned lo = 0; /* nf4_code[lo] < x; lo + step <= 8 + 4 + 2 + 1 */
	for (unsigned step = 8; step; step >>= 1) /* without branches: x is random */
		lo += (unsigned)(nf4_code[lo + step] < x) * step;
	if (lo == 15)
		return 15;
	/* nf4_code[lo] < x <= nf4_code[lo + 1] */
	return (uint8_t)(lo + (fabsf(x - nf4_code[lo + 1]) < fabsf(x - nf4_code[lo])));
}

void nf4_quantize(uint8_t *restrict codes, float *restrict absmax, const float *restrict inp,
		  size_t n)
{
	size_t nb = (n + NF4_BLOCK - 1) / NF4_BLOCK;
	memset(codes, 0, (n + 1) / 2);
	for (size_t b = 0; b < nb; b++) {
		size_t lo = b * NF4_BLOCK, hi = lo + NF4_BLOCK < n ? lo + NF4_BLOCK : n;
		float am = 0.0f;
		for (size_t i = lo; i < hi; i++)
			am = fabsf(inp[i]) > am ? fabsf(inp[i]) : am;
		absmax[b] = am;
		float inv = am > 0.0f ? 1.0f / am : 0.0f;
		for (size_t i = lo; i < hi; i++) {
			uint8_t k = nf4_nearest(inp[i] * inv);
			codes[i / 2] |= (uint8_t)(i % 2 ? k : k << 4);
		}
	}
}

void nf4_dequantize(float *restrict out, const uint8_t *restrict codes,
		    const float *restrict absmax, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint8_t byte = codes[i / 2];
		uint8_t k = i % 2 ? byte & 15 : byte >> 4;
		out[i] = nf4_code[k] * absmax[i / NF4_BLOCK];
	}
}

void absmax_quantize(int8_t *restrict q, float *restrict scale, const float *restrict absmax,
		     size_t nblocks)
{
	size_t ns = (nblocks + NF4_DQ_BLOCK - 1) / NF4_DQ_BLOCK;
	double sum = 0.0;
	for (size_t j = 0; j < nblocks; j++)
		sum += absmax[j];
	float offset = nblocks ? (float)(sum / (double)nblocks) : 0.0f;
	for (size_t s = 0; s < ns; s++) {
		size_t lo = s * NF4_DQ_BLOCK, hi = lo + NF4_DQ_BLOCK < nblocks ? lo + NF4_DQ_BLOCK : nblocks;
		float m = 0.0f;
		for (size_t j = lo; j < hi; j++)
			m = fabsf(absmax[j] - offset) > m ? fabsf(absmax[j] - offset) : m;
		float sc = m > 0.0f ? m / 127.0f : 1.0f;
		scale[s] = sc;
		for (size_t j = lo; j < hi; j++) {
			float r = rintf((absmax[j] - offset) / sc);
			q[j] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
		}
	}
	scale[ns] = offset;
}

void absmax_dequantize(float *restrict absmax, const int8_t *restrict q,
		       const float *restrict scale, size_t nblocks)
{
	size_t ns = (nblocks + NF4_DQ_BLOCK - 1) / NF4_DQ_BLOCK;
	float offset = scale[ns];
	for (size_t j = 0; j < nblocks; j++)
		absmax[j] = (float)q[j] * scale[j / NF4_DQ_BLOCK] + offset;
}

/* logsumexp of x/temp in double (temp 1: the plain one). */
static double row_lse(const float *x, int V, double temp)
{
	double max = (double)row_max(x, V) / temp, sum = 0.0;
	for (int i = 0; i < V; i++)
		sum += exp((double)x[i] / temp - max);
	return max + log(sum);
}

void distill_forward(float *restrict kl, float *restrict ce, const float *restrict logits,
		     const float *restrict tlogits, const int32_t *restrict targets,
		     float temperature, int N, int V)
{
	const double T = temperature;
	for (int n = 0; n < N; n++) {
		int32_t tgt = targets[n];
		if (tgt == -100) {
			kl[n] = ce[n] = 0.0f;
			continue;
		}
		assert(tgt >= 0 && tgt < V);
		const float *s = logits + (size_t)n * V, *t = tlogits + (size_t)n * V;
		double lse_s = row_lse(s, V, T), lse_t = row_lse(t, V, T), acc = 0.0;
		for (int i = 0; i < V; i++) {
			double lp = (double)t[i] / T - lse_t;
			acc += exp(lp) * (lp - ((double)s[i] / T - lse_s));
		}
		kl[n] = (float)acc;
		ce[n] = (float)(row_lse(s, V, 1.0) - (double)s[tgt]);
	}
}

/* In place is allowed: the row's normalisers are taken before it is
 * overwritten, and each element is read just before it is written. */
void distill_backward(float *dlogits, const float *logits, const float *tlogits,
		      const int32_t *restrict targets, float dloss, float alpha, float temperature,
		      int N, int V)
{
	const double T = temperature;
	const double wkd = (double)dloss * alpha * T, wce = (double)dloss * (1.0 - alpha);
	for (int n = 0; n < N; n++) {
		int32_t tgt = targets[n];
		float *d = dlogits + (size_t)n * V;
		if (tgt == -100) {
			memset(d, 0, sizeof(float) * (size_t)V);
			continue;
		}
		assert(tgt >= 0 && tgt < V);
		const float *s = logits + (size_t)n * V, *t = tlogits + (size_t)n * V;
		double lse_sT = row_lse(s, V, T), lse_tT = row_lse(t, V, T), lse_s = row_lse(s, V, 1.0);
		for (int i = 0; i < V; i++) {
			double x = s[i];
			double q = exp(x / T - lse_sT), p = exp((double)t[i] / T - lse_tT);
			double sm = exp(x - lse_s) - (i == tgt ? 1.0 : 0.0);
			d[i] = (float)(wkd * (q - p) + wce * sm);
		}
	}
}

void dropout_forward(float *out, const float *inp, float p, uint64_t seed, size_t n)
{
	assert(p >= 0.0f && p < 1.0f);
	const uint32_t threshold = (uint32_t)((double)p * 16777216.0);
	const float keep_scale = (float)(1.0 / (1.0 - (double)p));
	for (size_t i = 0; i < n; i++) {
		uint64_t z = seed + (uint64_t)(i + 1) * 0x9e3779b97f4a7c15ULL;
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
		z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
		z ^= z >> 31;
		out[i] = (uint32_t)(z >> 40) >= threshold ? inp[i] * keep_scale : 0.0f;
	}
}
