/* Reference ops in C, fp32: the math of the transformer, forward and backward.
 *
 * These are the CPU backend's kernels and the ground truth the CUDA kernels
 * are checked against. Every op is single-call, synchronous, allocates nothing
 * and keeps no state. Argument order is llm.c's: outputs, then inputs, then
 * sizes; gradients take a `d` prefix.
 *
 * Key to the shape letters:
 *   B batch, T sequence, N = B*T rows, C channels (hidden), OC output channels,
 *   V vocab, NH query heads, NKV key/value heads (NH % NKV == 0), HS head size,
 *   I intermediate (MLP) size.
 *
 * Tensors are row-major and contiguous. Per-token head tensors are laid out
 * (B, T, NH, HS), which is exactly the (N, NH*HS) output of matmul_forward.
 *
 * Accumulate (+=) versus overwrite is stated per op; "may be NULL" means the
 * op skips that output (a frozen weight, an input that needs no gradient). */
#ifndef KERNELS_CPU_OPS_H
#define KERNELS_CPU_OPS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* out (N,C) = wte[ids[n]] ; ids (N) in [0, V) (the caller has checked). */
void embedding_forward(float *out, const int32_t *ids, const float *wte, int N, int C);
/* dwte (V,C) += scatter of dout (N,C) by ids. */
void embedding_backward(float *dwte, const float *dout, const int32_t *ids, int N, int C);
/* A part of a table: the elements [lo, hi) of the flat (V,C) table, at
 * part[e - lo] for element e = id * C + c (a data-parallel rank's part of
 * the sharded trainable floats, which may cut a row; train/ddp.h).
 * forward: out (N,C) = wte's element where the part holds it, else 0
 * (overwrite: the ranks' outs sum to the lookup). backward: the part +=
 * the scatter of dout (N,C) by ids, restricted to its elements, rows in n
 * order (embedding_backward's order, element by element). */
void embedding_forward_part(float *out, const int32_t *ids, const float *part, int N, int C,
			    size_t lo, size_t hi);
void embedding_backward_part(float *part, const float *dout, const int32_t *ids, int N, int C,
			     size_t lo, size_t hi);

/* HF RMSNorm: rstd[n] = 1/sqrt(mean(inp[n]^2) + eps); out = weight * (inp * rstd).
 * out (N,C) overwrite, rstd (N) overwrite, inp (N,C), weight (C). out may not alias inp. */
void rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C,
		     float eps);
/* dinp (N,C) += ; dweight (C) += (may be NULL). */
void rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp,
		      const float *weight, const float *rstd, int N, int C);

/* out (N,OC) = inp (N,C) @ weight(OC,C)^T + bias (OC, may be NULL). Overwrite. */
void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
		    int C, int OC);
/* out (N,OC) += inp (N,C) @ weight(OC,C)^T: one GEMM with beta 1. */
void matmul_forward_add(float *out, const float *inp, const float *weight, int N, int C, int OC);
/* dinp (N,C) += dout @ weight ; dweight (OC,C) += dout^T @ inp ; dbias (OC) += sum_n dout.
 * Each of dinp, dweight, dbias may be NULL. */
void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
		     const float *weight, int N, int C, int OC);

/* HF default RoPE tables: inv_freq[i] = 1 / theta^(2i/HS) (computed in float32 as
 * transformers does), angle = t * inv_freq[i]; cos, sin (T, HS/2). HS even. */
void rope_cache(float *cos, float *sin, int T, int HS, double theta);
/* HF rotate_half: for each (b,t,h), with x1 = x[:HS/2], x2 = x[HS/2:]:
 *   out[:HS/2] = x1*cos - x2*sin ; out[HS/2:] = x2*cos + x1*sin  (cos, sin at row t).
 * inp/out (B,T,NH,HS), overwrite; out may alias inp. */
void rope_forward(float *out, const float *inp, const float *cos, const float *sin, int B, int T,
		  int NH, int HS);
/* The transpose (rotation by -angle). dinp overwrite; may alias dout. */
void rope_backward(float *dinp, const float *dout, const float *cos, const float *sin, int B,
		   int T, int NH, int HS);

/* Causal grouped-query attention, scale 1/sqrt(HS). Query head h reads kv head
 * h / (NH/NKV).  q (B,T,NH,HS), k, v (B,T,NKV,HS), out (B,T,NH,HS) overwrite,
 * att (B,NH,T,T) overwrite: the softmax probabilities, zero above the diagonal
 * (kept for the backward pass). */
void attention_forward(float *out, float *att, const float *q, const float *k, const float *v,
		       int B, int T, int NH, int NKV, int HS);
/* dq (B,T,NH,HS), dk, dv (B,T,NKV,HS): overwrite. datt (B,NH,T,T) is scratch. */
void attention_backward(float *dq, float *dk, float *dv, float *datt, const float *dout,
			const float *q, const float *k, const float *v, const float *att, int B,
			int T, int NH, int NKV, int HS);
/* attention_backward with the softmax backward's row sums D (B,NH,T) given
 * in dr (each rowsum(dout * out) of its (b, h, t)) instead of formed as
 * rowsum(dP * P), as the fused kernels do; dr NULL: attention_backward. */
void attention_backward_dr(float *dq, float *dk, float *dv, float *datt, const float *dout,
			   const float *q, const float *k, const float *v, const float *att,
			   const float *dr, int B, int T, int NH, int NKV, int HS);

/* out = silu(gate) * up, elementwise over n values; silu(x) = x / (1 + exp(-x)). */
void swiglu_forward(float *out, const float *gate, const float *up, size_t n);
/* dgate, dup overwrite; dout may be dgate. */
void swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate,
		     const float *up, size_t n);

/* Adapters' share of an input gradient: dout (N, cols) += the sum over
 * g < G of du[g] (N, R) @ A[g] (R, cols), where each element's share is
 * summed over g, then r = 0..R-1, from 0 (t = fmaf(du[g][n][r],
 * A[g][r][i], t): one rounding a term) and then added to dout once. The LoRA
 * projections' input gradients (train/model.c), added where an op reads
 * them or in one pass for the adapters that share an input (gpu/backend.h:
 * gpu_lora_dx). */
void lora_dx_add(float *dout, const float *const *du, const float *const *A, int G, int N, int R,
		 int cols);

/* out = a + b over n values (out may alias a or b). */
void residual_forward(float *out, const float *a, const float *b, size_t n);
/* y += x over n values. */
void add_inplace(float *y, const float *x, size_t n);

/* Per-row cross-entropy: losses[n] = logsumexp(logits[n]) - logits[n][targets[n]],
 * or 0 where targets[n] == -100. logits (N,V), targets (N) in [0,V) or -100. */
void crossentropy_forward(float *losses, const float *logits, const int32_t *targets, int N,
			  int V);
/* dlogits[n] = dloss * (softmax(logits[n]) - onehot(targets[n])), or 0 where the
 * target is -100. Overwrite; dlogits may alias logits (the fused, in-place form). */
void crossentropy_backward(float *dlogits, const float *logits, const int32_t *targets,
			   float dloss, int N, int V);

/* PyTorch's AdamW (torch.optim.AdamW, foreach=False), step t >= 1, in this order
 * (grad: the gradient times gscale, rounded to float as scale_inplace
 * rounds it — a clip's coefficient applied here instead of in a pass of its
 * own; 1 leaves it as it is):
 *   param *= 1 - lr*weight_decay
 *   m = m + (1-beta1)*(grad - m) ; v = beta2*v + (1-beta2)*grad*grad
 *   denom = sqrt(v) / sqrt(1 - beta2^t) + eps
 *   param -= (lr / (1 - beta1^t)) * m / denom                                   */
void adamw_update(float *param, const float *grad, float gscale, float *m, float *v, size_t n,
		  float lr,
		  float beta1, float beta2, float eps, float weight_decay, int t);
/* adamw_update's scalars for step t, formed in double as Python forms them
 * and rounded to float where torch hands a Python scalar to a float32
 * kernel. Both backends take them from here, so their AdamW has the same
 * bits; the fields are in the CUDA kernels' argument order. */
struct adamw_scalars {
	float decay, omb1, omb2, beta2, bc2_sqrt, step_size, eps;
};
static inline struct adamw_scalars adamw_scalars(float lr, float beta1, float beta2, float eps,
						 float weight_decay, int t)
{
	return (struct adamw_scalars){
		.decay = (float)(1.0 - (double)lr * weight_decay),
		.omb1 = (float)(1.0 - (double)beta1),
		.omb2 = (float)(1.0 - (double)beta2),
		.beta2 = beta2,
		.bc2_sqrt = (float)sqrt(1.0 - pow(beta2, t)),
		.step_size = (float)((double)lr / (1.0 - pow(beta1, t))),
		.eps = eps,
	};
}
/* adamw_update over n = R*C values (R rows of C) whose gradient is kept by
 * rows: row r's is rows[row_of[r]] (C values), or zeros where row_of[r] < 0
 * (an untied embedding's gradient, train/plan.h: emb_slots) — the same bits
 * as adamw_update over that gradient written out as a table. */
void adamw_update_rows(float *param, const float *rows, const int32_t *row_of, int C, float gscale,
		       float *m, float *v, size_t n, float lr, float beta1, float beta2, float eps,
		       float weight_decay, int t);

/* bf16, the bf16 mode's storage of frozen weights and of the GEMMs' operands:
 * the upper 16 bits of an fp32. bf16_round: out (n) = in rounded to nearest
 * even (a NaN becomes the quiet NaN 0x7fff, as CUDA's host code makes it;
 * infinities stay); the same bits as CUDA's __float2bfloat16_rn for every
 * number. bf16_widen: out (n) = in exactly (a
 * bf16 is an fp32 with 16 zero low bits). Overwrite. bf16_widen may run in
 * place over the second half of out's bytes (in == (uint16_t *)out + n):
 * element i is read before out[i] is written, and out[i] ends before in[i+1]
 * begins. */
void bf16_round(uint16_t *out, const float *in, size_t n);
void bf16_widen(float *out, const uint16_t *in, size_t n);

/* Sum of squares, accumulated in double. */
double sumsq(const float *x, size_t n);
/* x *= s over n values. */
void scale_inplace(float *x, float s, size_t n);

/* ------------------------------------------------------------ methods -- */
/* LoRA, QLoRA, distillation and classification (train/ issue 4). LoRA itself
 * is matmuls and a scale; classification pools with embedding_forward (a
 * gather of rows) and uses crossentropy_* over the labels. */

/* NF4 (QLoRA paper, Dettmers et al. 2023; bitsandbytes' table): the 16 values
 * of the 4-bit NormalFloat code book, ascending, nf4_code[7] == 0. */
extern const float nf4_code[16];
#define NF4_BLOCK 64   /* elements per absmax */
#define NF4_DQ_BLOCK 256 /* absmax values per double-quantization scale */

/* Host-side quantizer (not a device op; weights are quantized once, at load).
 * For each block of NF4_BLOCK values: absmax[b] = max|x|, and each x is coded
 * as the index of the nearest nf4_code to x/absmax (ties to the lower index;
 * an all-zero block codes 0.0). codes (ceil(n/2) bytes): element 2i in the
 * high nibble of byte i, 2i+1 in the low nibble (bitsandbytes' order); an odd
 * tail leaves the last low nibble 0. absmax (ceil(n/NF4_BLOCK)). */
void nf4_quantize(uint8_t *codes, float *absmax, const float *inp, size_t n);
/* out (n) = nf4_code[code of i] * absmax[i / NF4_BLOCK]. Overwrite. */
void nf4_dequantize(float *out, const uint8_t *codes, const float *absmax, size_t n);

/* Double quantization of the absmax values (host side, at load): offset =
 * mean(absmax), then per block of NF4_DQ_BLOCK values a scale s = max|a -
 * offset| / 127 and q = round((a - offset) / s) in [-127, 127] (linear int8;
 * bitsandbytes uses its 8-bit dynamic map instead). scale has
 * ceil(nblocks / NF4_DQ_BLOCK) + 1 floats: the scales, then the offset. */
void absmax_quantize(int8_t *q, float *scale, const float *absmax, size_t nblocks);
/* absmax (nblocks) = q[j] * scale[j / NF4_DQ_BLOCK] + offset. Overwrite. */
void absmax_dequantize(float *absmax, const int8_t *q, const float *scale, size_t nblocks);

/* Distillation, per row n whose target is not -100 (else both 0), with
 * p = softmax(tlogits[n] / temperature), q = softmax(logits[n] / temperature):
 *   kl[n] = sum_i p_i (log p_i - log q_i)        (KL(p || q))
 *   ce[n] = logsumexp(logits[n]) - logits[n][targets[n]]
 * logits, tlogits (N,V); kl, ce (N) overwrite. Sums in double. */
void distill_forward(float *kl, float *ce, const float *logits, const float *tlogits,
		     const int32_t *targets, float temperature, int N, int V);
/* The gradient of dloss * (alpha*T^2*kl[n] + (1-alpha)*ce[n]) summed over rows:
 *   dlogits[n] = dloss * (alpha*T*(q - p) + (1-alpha)*(softmax(logits[n]) - onehot))
 * and 0 where the target is -100. Overwrite; dlogits may alias logits. */
void distill_backward(float *dlogits, const float *logits, const float *tlogits,
		      const int32_t *targets, float dloss, float alpha, float temperature, int N,
		      int V);

/* Inverted dropout with a stateless mask: element i is kept when the top 24
 * bits of splitmix64(seed + (i+1) * 0x9e3779b97f4a7c15) are >= p * 2^24, and
 * then scaled by 1/(1-p); dropped elements are 0. The mask is a function of
 * (seed, i) only, so the backward pass is the same call on dout. p in [0, 1).
 * out may alias inp. */
void dropout_forward(float *out, const float *inp, float p, uint64_t seed, size_t n);

#endif
