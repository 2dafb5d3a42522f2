/* The CPU backend: the ops table over kernels/cpu (fp32) and plain host memory.
 *
 * It is the reference the CUDA backend is checked against, and the backend of
 * hosts without a GPU. Everything runs synchronously on the calling thread
 * (OpenBLAS may use its own threads inside a GEMM), so sync never has a
 * deferred error to report, and a copy of the copy stream is done when it
 * is enqueued. It counts the bytes it hands out, device and host apart, which
 * is how the tests hold the memory plan to what is really allocated. */
#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "kernels/cpu/ops.h"

static td_err cpu_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	/* 64-byte alignment: whole cache lines, and what vector loads like. */
	size_t rounded = (bytes + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, rounded ? rounded : 64);
	if (!p)
		return TD_ENOMEM;
	memset(p, 0, rounded ? rounded : 64);
	be->bytes_in_use += bytes;
	if (be->bytes_in_use > be->bytes_peak)
		be->bytes_peak = be->bytes_in_use;
	*out = p;
	return TD_OK;
}

static void cpu_free(struct gpu_backend *be, void *p, size_t bytes)
{
	assert(be->bytes_in_use >= bytes);
	be->bytes_in_use -= bytes;
	free(p);
}

/* Shared memory (a frozen base, train/base.h) is whole pages of an
 * anonymous mapping, so that share_seal can make it read-only: a write
 * after it faults (SIGSEGV), which a test provokes. */
static td_err cpu_share_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	(void)be;
	void *p = mmap(NULL, bytes ? bytes : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
		       -1, 0);
	if (p == MAP_FAILED)
		return TD_ENOMEM;
	*out = p;
	return TD_OK;
}

static void cpu_share_free(struct gpu_backend *be, void *p, size_t bytes)
{
	(void)be;
	munmap(p, bytes ? bytes : 1);
}

static td_err cpu_share_seal(struct gpu_backend *be, void *p, size_t bytes, struct td_errbuf *eb)
{
	(void)be;
	if (mprotect(p, bytes ? bytes : 1, PROT_READ) != 0)
		return td_fail(eb, td_from_errno(errno), "cpu: mprotect(PROT_READ) of a shared base: %s",
			       strerror(errno));
	return TD_OK;
}

/* Host memory (gpu_host_alloc) is plain memory here, counted apart. */
static td_err cpu_host_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	size_t rounded = (bytes + 63) & ~(size_t)63;
	void *p = aligned_alloc(64, rounded ? rounded : 64);
	if (!p)
		return TD_ENOMEM;
	memset(p, 0, rounded ? rounded : 64);
	be->host_bytes_in_use += bytes;
	if (be->host_bytes_in_use > be->host_bytes_peak)
		be->host_bytes_peak = be->host_bytes_in_use;
	*out = p;
	return TD_OK;
}

static void cpu_host_free(struct gpu_backend *be, void *p, size_t bytes)
{
	assert(be->host_bytes_in_use >= bytes);
	be->host_bytes_in_use -= bytes;
	free(p);
}

/* Synchronous: done before the next op is enqueued, so there is nothing to
 * wait for. */
static void cpu_copy_async(struct gpu_backend *be, void *dst, const void *src, size_t bytes,
			   bool to_host, int k)
{
	(void)be;
	(void)to_host;
	(void)k;
	if (bytes)
		memcpy(dst, src, bytes);
}

static void cpu_copy_wait(struct gpu_backend *be, int k)
{
	(void)be;
	(void)k;
}

static void cpu_copy(struct gpu_backend *be, void *dst, const void *src, size_t bytes)
{
	(void)be;
	if (bytes)
		memcpy(dst, src, bytes);
}

static void cpu_zero(struct gpu_backend *be, void *dst, size_t bytes)
{
	(void)be;
	if (bytes)
		memset(dst, 0, bytes);
}

static td_err cpu_sync(struct gpu_backend *be, struct td_errbuf *eb)
{
	(void)be;
	(void)eb;
	return TD_OK;
}

static td_err cpu_mem_info(struct gpu_backend *be, size_t *free_bytes, size_t *total_bytes)
{
	(void)be;
	long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
	long page = sysconf(_SC_PAGESIZE);
	if (pages < 0 || avail < 0 || page < 0)
		return TD_EIO;
	*free_bytes = (size_t)avail * (size_t)page;
	*total_bytes = (size_t)pages * (size_t)page;
	return TD_OK;
}

static td_err cpu_set_bf16(struct gpu_backend *be, bool bf16, struct td_errbuf *eb)
{
	(void)be;
	if (bf16)
		return td_fail(eb, TD_EUNSUPPORTED, "the CPU backend computes in fp32 only (precision BF16 needs a GPU)");
	return TD_OK;
}

static void cpu_destroy(struct gpu_backend *be)
{
	assert(be->bytes_in_use == 0 && be->host_bytes_in_use == 0);
	free(be);
}

/* Adapters: drop the backend argument. */
/* fp32 only: gpu_gemm_bf16 is false here, so every twin is NULL (a weight
 * stored in bf16 is widened by the engine, bf16_widen, before its use). */
static void cpu_embedding_forward(struct gpu_backend *be, float *out, const int32_t *ids,
				  const float *wte, const gpu_bf16 *wte16, int N, int C)
{
	assert(wte && !wte16);
	embedding_forward(out, ids, wte, N, C);
}
static void cpu_embedding_backward(struct gpu_backend *be, float *dwte, const float *dout,
				   const int32_t *ids, int N, int C)
{
	embedding_backward(dwte, dout, ids, N, C);
}
static void cpu_embedding_forward_part(struct gpu_backend *be, float *out, const int32_t *ids,
				       const float *part, int N, int C, size_t lo, size_t hi)
{
	embedding_forward_part(out, ids, part, N, C, lo, hi);
}
static void cpu_embedding_backward_part(struct gpu_backend *be, float *part, const float *dout,
					const int32_t *ids, int N, int C, size_t lo, size_t hi)
{
	embedding_backward_part(part, dout, ids, N, C, lo, hi);
}
static void cpu_rmsnorm_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *rstd,
				const float *inp, const float *weight, int N, int C, float eps)
{
	assert(out && !out16);
	rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
}
static void cpu_rmsnorm_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				 float *dweight, const float *dout, const float *inp,
				 const float *weight, const float *rstd, int N, int C)
{
	rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C);
	if (dinp16)
		bf16_round(dinp16, dinp, (size_t)N * (size_t)C);
}
static void cpu_matmul_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const float *inp, const gpu_bf16 *inp16, const float *weight,
			       const gpu_bf16 *weight16, const float *bias, int N, int C, int OC)
{
	assert(out && inp && weight && !out16 && !inp16 && !weight16);
	matmul_forward(out, inp, weight, bias, N, C, OC);
}
static void cpu_matmul_forward_add(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				   const float *inp, const gpu_bf16 *inp16, const float *weight,
				   const gpu_bf16 *weight16, int N, int C, int OC)
{
	assert(out && inp && weight && !out16 && !inp16 && !weight16);
	matmul_forward_add(out, inp, weight, N, C, OC);
}
static void cpu_matmul_forward_residual(struct gpu_backend *be, float *out, const float *res,
					const float *inp, const gpu_bf16 *inp16, const float *weight,
					const gpu_bf16 *weight16, int N, int C, int OC)
{
	assert(out != res);
	memcpy(out, res, (size_t)N * (size_t)OC * sizeof(float));
	be->ops->matmul_forward_add(be, out, NULL, inp, inp16, weight, weight16, N, C, OC);
}
static void cpu_matmul_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				float *dweight, float *dbias,
				const float *dout, const gpu_bf16 *dout16, const float *inp,
				const gpu_bf16 *inp16, const float *weight, const gpu_bf16 *weight16,
				int N, int C, int OC, unsigned set)
{
	assert(dout && inp && !dinp16 && !dout16 && !inp16 && !weight16 && (weight || !dinp));
	if (dinp && (set & GPU_SET_DINP) && N > 0 && C > 0)
		memset(dinp, 0, sizeof(float) * (size_t)N * (size_t)C);
	if (dweight && (set & GPU_SET_DWEIGHT) && OC > 0 && C > 0)
		memset(dweight, 0, sizeof(float) * (size_t)OC * (size_t)C);
	matmul_backward(dinp, dweight, dbias, dout, inp, weight, N, C, OC);
}
static void cpu_rope_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			     const float *inp, const float *cos, const float *sin, int B, int T,
			     int NH, int HS)
{
	assert(out && !out16);
	rope_forward(out, inp, cos, sin, B, T, NH, HS);
}
static void cpu_rope_backward(struct gpu_backend *be, float *dinp, const float *dout,
			      const float *cos, const float *sin, int B, int T, int NH, int HS)
{
	rope_backward(dinp, dout, cos, sin, B, T, NH, HS);
}
/* The CPU keeps the probabilities: it is the reference the fused kernels
 * are checked against. */
static bool cpu_attention_flash(struct gpu_backend *be, int HS)
{
	return false;
}
static bool cpu_gemm_bf16(struct gpu_backend *be)
{
	return false;
}
static void cpu_attention_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *att,
				  const float *q, const gpu_bf16 *q16, const float *k,
				  const gpu_bf16 *k16, const float *v, const gpu_bf16 *v16, int B,
				  int T, int NH, int NKV, int HS)
{
	assert(!out16 && !q16 && !k16 && !v16); /* twins are the fused attention's */
	attention_forward(out, att, q, k, v, B, T, NH, NKV, HS);
}
static void cpu_attention_backward(struct gpu_backend *be, float *dq, float *dk, float *dv,
				   float *datt, const float *dout, const float *out,
				   const gpu_bf16 *out16, const float *q, const gpu_bf16 *q16,
				   const float *k, const gpu_bf16 *k16, const float *v,
				   const gpu_bf16 *v16, const float *att, int B, int T, int NH,
				   int NKV, int HS)
{
	/* never fused: the probabilities in att, out and out16 not read */
	assert(!q16 && !k16 && !v16);
	attention_backward(dq, dk, dv, datt, dout, q, k, v, att, B, T, NH, NKV, HS);
}
static void cpu_swiglu_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const float *gate, const float *up, const gpu_bf16 *gate16,
			       const gpu_bf16 *up16, size_t n)
{
	assert(out && gate && up && !out16 && !gate16 && !up16);
	swiglu_forward(out, gate, up, n);
}
static void cpu_swiglu_backward(struct gpu_backend *be, float *dgate, float *dup,
				gpu_bf16 *dgate16, gpu_bf16 *dup16, const float *dout,
				const gpu_bf16 *dout16, const float *gate, const float *up,
				const gpu_bf16 *gate16, const gpu_bf16 *up16, size_t n,
				const struct gpu_lora_dx *ad)
{
	assert(dgate && dup && dout && gate && up && !dgate16 && !dup16 && !dout16 && !gate16 &&
	       !up16);
	if (!ad) {
		swiglu_backward(dgate, dup, dout, gate, up, n);
		return;
	}
	/* dout + the adapter's share, in dgate until swiglu_backward reads it
	 * (it reads each element before it writes it) */
	assert(ad->A && !ad->A16);
	memcpy(dgate, dout, n * sizeof(float));
	lora_dx_add(dgate, &ad->du, &ad->A, 1, (int)(n / (size_t)ad->cols), ad->R, ad->cols);
	swiglu_backward(dgate, dup, dgate, gate, up, n);
}
static void cpu_lora_dx_add(struct gpu_backend *be, float *dinp, const struct gpu_lora_dx *ad,
			    int G, int rows)
{
	const float *du[GPU_LORA_DX_GROUP], *A[GPU_LORA_DX_GROUP];
	for (int g = 0; g < G; g++) {
		assert(ad[g].A && !ad[g].A16); /* fp32 only */
		du[g] = ad[g].du;
		A[g] = ad[g].A;
	}
	lora_dx_add(dinp, du, A, G, rows, ad[0].R, ad[0].cols);
}
static void cpu_residual_forward(struct gpu_backend *be, float *out, const float *a,
				 const float *b, size_t n)
{
	residual_forward(out, a, b, n);
}
static void cpu_crossentropy_forward(struct gpu_backend *be, float *losses, const float *logits,
				     const gpu_bf16 *logits16, const int32_t *targets, int N, int V)
{
	assert(logits && !logits16); /* fp32 only (no bf16 mode) */
	crossentropy_forward(losses, logits, targets, N, V);
}
static void cpu_crossentropy_backward(struct gpu_backend *be, float *losses, float *dlogits,
				      gpu_bf16 *dlogits16, const float *logits,
				      const gpu_bf16 *logits16, const int32_t *targets, float dloss,
				      int N, int V)
{
	assert(dlogits && !dlogits16 && logits && !logits16);
	if (losses) /* before dlogits may overwrite the logits */
		crossentropy_forward(losses, logits, targets, N, V);
	crossentropy_backward(dlogits, logits, targets, dloss, N, V);
}
static void cpu_adamw_update(struct gpu_backend *be, float *param, gpu_bf16 *param16,
			     const float *grad, float gscale, float *m, float *v, size_t n, float lr,
			     float beta1, float beta2, float eps, float weight_decay, int t)
{
	assert(!param16);
	adamw_update(param, grad, gscale, m, v, n, lr, beta1, beta2, eps, weight_decay, t);
}
static void cpu_adamw_update_rows(struct gpu_backend *be, float *param, const float *rows,
				  const int32_t *row_of, int C, float gscale, float *m, float *v,
				  size_t n, float lr, float beta1, float beta2, float eps,
				  float weight_decay, int t)
{
	adamw_update_rows(param, rows, row_of, C, gscale, m, v, n, lr, beta1, beta2, eps,
			  weight_decay, t);
}
static double cpu_sumsq(struct gpu_backend *be, const float *x, size_t n)
{
	return sumsq(x, n);
}
static void cpu_scale(struct gpu_backend *be, float *x, float s, size_t n)
{
	scale_inplace(x, s, n);
}

static void cpu_bf16_round(struct gpu_backend *be, gpu_bf16 *out, const float *in, size_t n)
{
	bf16_round(out, in, n);
}
static void cpu_bf16_round_rows(struct gpu_backend *be, gpu_bf16 *out, size_t ldo, const float *in,
				size_t rows, size_t cols)
{
	for (size_t r = 0; r < rows; r++)
		bf16_round(out + r * ldo, in + r * cols, cols);
}
static void cpu_bf16_widen(struct gpu_backend *be, float *out, const gpu_bf16 *in, size_t n)
{
	bf16_widen(out, in, n);
}

static void cpu_nf4_dequantize(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const uint8_t *codes, const float *absmax, size_t n)
{
	assert(out && !out16);
	nf4_dequantize(out, codes, absmax, n);
}
static void cpu_absmax_dequantize(struct gpu_backend *be, float *absmax, const int8_t *q,
				  const float *scale, size_t nblocks)
{
	absmax_dequantize(absmax, q, scale, nblocks);
}
static void cpu_distill_forward(struct gpu_backend *be, float *kl, float *ce, const float *logits,
				const float *tlogits, const int32_t *targets, float temperature,
				int N, int V)
{
	distill_forward(kl, ce, logits, tlogits, targets, temperature, N, V);
}
static void cpu_distill_backward(struct gpu_backend *be, float *dlogits, const float *logits,
				 const float *tlogits, const int32_t *targets, float dloss,
				 float alpha, float temperature, int N, int V)
{
	distill_backward(dlogits, logits, tlogits, targets, dloss, alpha, temperature, N, V);
}
static void cpu_dropout(struct gpu_backend *be, float *out, const float *inp, float p,
			uint64_t seed, size_t n)
{
	dropout_forward(out, inp, p, seed, n);
}

static const struct gpu_backend_ops cpu_ops = {
	.name = "cpu",
	.alloc = cpu_alloc,
	.free = cpu_free,
	.upload = cpu_copy,
	.download = cpu_copy,
	.zero = cpu_zero,
	.sync = cpu_sync,
	.destroy = cpu_destroy,
	.mem_info = cpu_mem_info,
	.set_bf16 = cpu_set_bf16,
	.share_alloc = cpu_share_alloc,
	.share_free = cpu_share_free,
	.share_seal = cpu_share_seal,
	.host_alloc = cpu_host_alloc,
	.host_free = cpu_host_free,
	.copy_async = cpu_copy_async,
	.copy_wait = cpu_copy_wait,
	.embedding_forward = cpu_embedding_forward,
	.embedding_backward = cpu_embedding_backward,
	.embedding_forward_part = cpu_embedding_forward_part,
	.embedding_backward_part = cpu_embedding_backward_part,
	.rmsnorm_forward = cpu_rmsnorm_forward,
	.rmsnorm_backward = cpu_rmsnorm_backward,
	.matmul_forward = cpu_matmul_forward,
	.matmul_forward_add = cpu_matmul_forward_add,
	.matmul_forward_residual = cpu_matmul_forward_residual,
	.matmul_backward = cpu_matmul_backward,
	.rope_forward = cpu_rope_forward,
	.rope_backward = cpu_rope_backward,
	.attention_flash = cpu_attention_flash,
	.gemm_bf16 = cpu_gemm_bf16,
	.attention_forward = cpu_attention_forward,
	.attention_backward = cpu_attention_backward,
	.swiglu_forward = cpu_swiglu_forward,
	.swiglu_backward = cpu_swiglu_backward,
	.lora_dx_add = cpu_lora_dx_add,
	.residual_forward = cpu_residual_forward,
	.crossentropy_forward = cpu_crossentropy_forward,
	.crossentropy_backward = cpu_crossentropy_backward,
	.adamw_update = cpu_adamw_update,
	.adamw_update_rows = cpu_adamw_update_rows,
	.sumsq = cpu_sumsq,
	.scale = cpu_scale,
	.bf16_round = cpu_bf16_round,
	.bf16_widen = cpu_bf16_widen,
	.bf16_round_rows = cpu_bf16_round_rows,
	.nf4_dequantize = cpu_nf4_dequantize,
	.absmax_dequantize = cpu_absmax_dequantize,
	.distill_forward = cpu_distill_forward,
	.distill_backward = cpu_distill_backward,
	.dropout = cpu_dropout,
};

td_err gpu_cpu_backend_new(struct gpu_backend **out, struct td_errbuf *eb)
{
	gpu_backend_check_ops(&cpu_ops);
	struct gpu_backend *be = calloc(1, sizeof(*be));
	if (!be)
		return td_fail(eb, TD_ENOMEM, "cpu backend: out of memory");
	be->ops = &cpu_ops;
	snprintf(be->device, sizeof(be->device), "cpu");
	*out = be;
	return TD_OK;
}
