/* The backend ops table: the operations the training engine needs from a
 * device, implemented once per device kind (contract 4 of DESIGN.md).
 *
 * The CPU backend (gpu/cpu_backend.c, fp32, the reference) and the CUDA
 * backend (a module loaded at run time, CUDA issue) fill the same table, op for
 * op. The engine calls ops only through the inline gpu_* wrappers below and
 * never includes a CUDA header; it never dereferences a buffer it got from
 * gpu_alloc — it moves data with gpu_upload / gpu_download.
 *
 * Ops take the arguments of kernels/cpu/ops.h (outputs, inputs, sizes; the
 * shape letters are explained there) after the backend. Ops are enqueued on the
 * backend's stream in order and may run asynchronously; gpu_download,
 * gpu_sumsq and gpu_sync block until all earlier work is done (gpu_sync also
 * until every copy of the copy stream, below, is). An op cannot
 * fail by itself: a device error is sticky and is reported by the next
 * blocking call (gpu_sync): TD_EDEVICE naming the driver's error, or
 * TD_EDEVICE_LOST when it corrupted the device's context for the whole
 * process (every backend on that device fails from then on; gpu/select.h's
 * gpu_device_reset recovers it once none is left).
 *
 * This is not an allocator policy: the engine asks for whole arenas sized by
 * the memory plan (contract 1), one gpu_alloc per arena, and one
 * gpu_host_alloc for the plan's host arena (pinned memory that a second,
 * copy stream moves to and from the device beside the math: gpu_copy_*). */
#ifndef GPU_BACKEND_H
#define GPU_BACKEND_H

#include <assert.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"

struct gpu_backend;

/* A bf16 value as the bf16 mode's GEMMs read it: the upper half of the fp32,
 * rounded to nearest even. A "twin" argument (x16 beside x) is the same
 * tensor in bf16: ops that produce a GEMM operand can write it, and the
 * matmuls read it instead of rounding x again. A weight's twin is its bf16
 * copy (a trainable weight's, rounded at each update) or the weight itself
 * where it is stored in bf16 only (a frozen one: train/plan.h frozen_bf16).
 * Twins are for a backend whose gpu_gemm_bf16 is true (the CUDA backend in
 * bf16 mode); elsewhere they are NULL. Where an op says so, the fp32 tensor
 * may then be NULL too (stored only as bf16). */
typedef uint16_t gpu_bf16;

/* The copies a backend tells apart (gpu_copy_to_host, gpu_copy_wait): copy
 * k, 0 <= k < this, is the last one enqueued under that number. */
#define GPU_COPY_SLOTS 4

/* matmul_backward's set flags */
#define GPU_SET_DINP 1u
#define GPU_SET_DWEIGHT 2u

/* An adapter's share of an input gradient, added where an op reads that
 * gradient instead of in a pass of its own (swiglu_backward: the LoRA down
 * projection's d(h), whose frozen product then comes in bf16): dout (rows,
 * cols) + du (rows, R) @ A (R, cols), each element's share summed in fp32
 * and added to dout's value once (kernels/cpu/ops.h: lora_dx_add, whose
 * order of the sum the fp32 forms keep to the bit). In the bf16 mode A is
 * read from its copy A16 and du rounded to bf16 (the operands the adapter's
 * GEMM would take), and the sum may be the tensor cores' (as the GEMM's
 * was); elsewhere A16 is NULL and both are fp32. */
#define GPU_LORA_DX_RMAX 64 /* R's bound */
#define GPU_LORA_DX_GROUP 3 /* lora_dx_add's adapters at most (q, k, v) */
struct gpu_lora_dx {
	const float *du;
	const float *A;
	const gpu_bf16 *A16;
	int R, cols;
};

struct gpu_backend_ops {
	const char *name;

	/* Memory. alloc returns zeroed memory; the backend counts the bytes. */
	td_err (*alloc)(struct gpu_backend *be, size_t bytes, void **out);
	void (*free)(struct gpu_backend *be, void *p, size_t bytes);
	void (*upload)(struct gpu_backend *be, void *dst, const void *src, size_t bytes);
	void (*download)(struct gpu_backend *be, void *dst, const void *src, size_t bytes);
	void (*zero)(struct gpu_backend *be, void *dst, size_t bytes);
	td_err (*sync)(struct gpu_backend *be, struct td_errbuf *eb);
	void (*destroy)(struct gpu_backend *be);
	/* Blocking: the device's free and total memory right now (cuMemGetInfo on
	 * a GPU: what every process on it leaves free; the host's RAM on the CPU). */
	td_err (*mem_info)(struct gpu_backend *be, size_t *free_bytes, size_t *total_bytes);
	/* Compute precision of the math ops from now on: false = fp32 (the
	 * reference; no TF32), true = bf16 compute with fp32 storage and fp32
	 * accumulation. TD_EUNSUPPORTED where the backend has no bf16 mode. */
	td_err (*set_bf16)(struct gpu_backend *be, bool bf16, struct td_errbuf *eb);

	/* Host memory for the copy stream (memory.recompute FULL_OFFLOAD,
	 * train/plan.h). host_alloc: zeroed host memory that copy_async moves
	 * at full speed (page-locked on a GPU: cuMemHostAlloc; the CPU backend:
	 * malloc), counted in host_bytes_in_use, never in bytes_in_use;
	 * TD_ENOMEM when the host cannot give it (the caller names the bytes).
	 * The engine may read and write it directly while no copy that touches
	 * it is in flight (after gpu_sync). host_free waits for every copy and
	 * op, then frees. */
	td_err (*host_alloc)(struct gpu_backend *be, size_t bytes, void **out);
	void (*host_free)(struct gpu_backend *be, void *p, size_t bytes);
	/* Enqueues on the backend's copy stream — after every op enqueued on its
	 * stream so far, beside the ops enqueued after — a copy of bytes from
	 * src to dst: device memory (alloc's) to host memory (host_alloc's)
	 * where to_host, else host to device; it becomes copy k (0 <= k <
	 * GPU_COPY_SLOTS), the last copy k before it is forgotten. Copies run
	 * in the order they are enqueued. Never blocks. Until copy k is done
	 * its source must not be written, and its destination neither read nor
	 * written, by an op: only copy_wait(k) orders an op after it. */
	void (*copy_async)(struct gpu_backend *be, void *dst, const void *src, size_t bytes,
			   bool to_host, int k);
	/* Ops enqueued from now on start once the last copy k (and every copy
	 * enqueued before it) is done; at once where there was none. Never
	 * blocks. */
	void (*copy_wait)(struct gpu_backend *be, int k);

	/* Graphs (CUDA graphs; optional, NULL where the backend has none):
	 * a run of ops recorded and launched as one, which saves the device
	 * the gap it leaves between launches (about 0.75 us a kernel on an
	 * H200). graph_begin: the ops enqueued from now on are recorded, not
	 * run; false (nothing recorded) where it cannot record now — the ops
	 * then run as usual. graph_end: the recording ends and is launched
	 * through *exec, the caller's executable graph (NULL at first: made
	 * here; else updated to this recording, or made anew where its shape
	 * changed), so each launch runs exactly the ops just recorded, with
	 * this call's arguments. False where the recording failed (an op that
	 * blocks, or one that failed): nothing of it ran, and the caller runs
	 * the ops again without a graph. graph_free frees an exec (NULL:
	 * nothing). Never blocks. */
	bool (*graph_begin)(struct gpu_backend *be);
	bool (*graph_end)(struct gpu_backend *be, void **exec);
	void (*graph_free)(struct gpu_backend *be, void *exec);

	/* Device memory that outlives the backend that allocates it: a frozen
	 * base shared by the jobs of one process on one device (train/base.h).
	 * share_alloc: zeroed, counted in no backend's bytes_in_use (the
	 * owner, train/base.c, counts it); share_free: through any backend of
	 * the same device (the last user's), after that backend's ops that
	 * read it are done (it syncs). share_seal: from now on the memory is
	 * read-only to every op and copy (the CPU backend: mprotect PROT_READ,
	 * a write faults; CUDA: the VMM mapping's access made read-only where
	 * the driver grants it); TD_EUNSUPPORTED where the device cannot (the
	 * memory stays writable: only the engine's construction keeps it
	 * unchanged — the ops take weights as const, and a model attached to
	 * a shared base writes none of it, train/model.h). Optional: a backend
	 * without share_alloc gives every model its own base. */
	td_err (*share_alloc)(struct gpu_backend *be, size_t bytes, void **out);
	void (*share_free)(struct gpu_backend *be, void *p, size_t bytes);
	td_err (*share_seal)(struct gpu_backend *be, void *p, size_t bytes, struct td_errbuf *eb);

	/* Math: see kernels/cpu/ops.h for each op's contract. */
	/* wte16: a table stored in bf16 only (wte NULL; the rows are widened
	 * exactly), else NULL. */
	void (*embedding_forward)(struct gpu_backend *be, float *out, const int32_t *ids,
				  const float *wte, const gpu_bf16 *wte16, int N, int C);
	void (*embedding_backward)(struct gpu_backend *be, float *dwte, const float *dout,
				   const int32_t *ids, int N, int C);
	/* A part [lo, hi) of a table's flat elements (data parallel's rows:
	 * train/ddp.h); the backward in embedding_backward's order. */
	void (*embedding_forward_part)(struct gpu_backend *be, float *out, const int32_t *ids,
				       const float *part, int N, int C, size_t lo, size_t hi);
	void (*embedding_backward_part)(struct gpu_backend *be, float *part, const float *dout,
					const int32_t *ids, int N, int C, size_t lo, size_t hi);
	/* out16: twin of out, or NULL; out may be NULL when out16 is not. */
	void (*rmsnorm_forward)(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *rstd,
				const float *inp, const float *weight, int N, int C, float eps);
	/* dinp16: NULL, or dinp's twin, written with dinp's new values
	 * rounded (the next products' operand: no rounding pass of their own) */
	void (*rmsnorm_backward)(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				 float *dweight, const float *dout, const float *inp,
				 const float *weight, const float *rstd, int N, int C);
	/* inp16, dout16, weight16: twins of inp, dout, weight, or NULL; each
	 * fp32 tensor may be NULL when its twin is not (dout only without
	 * dbias). out16: NULL, or the product written in bf16 instead of fp32
	 * (out NULL, no bias). Operands without a twin are rounded into
	 * gemm_scratch (gpu_matmul_scratch_elems). set: matmul_backward
	 * overwrites dinp (GPU_SET_DINP; true converts to it) and/or dweight
	 * (GPU_SET_DWEIGHT) instead of adding to them (no zeroing pass, no read
	 * of the old values; an overwrite may leave -0 where 0 + -0 gave +0,
	 * which no sum or AdamW step tells apart); dbias always accumulates.
	 * matmul_backward's dinp16: the input's gradient written in bf16
	 * instead (dinp NULL; GPU_SET_DINP: a bf16 output is overwritten, not
	 * added to; the bf16 mode). */
	void (*matmul_forward)(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const float *inp, const gpu_bf16 *inp16, const float *weight,
			       const gpu_bf16 *weight16, const float *bias, int N, int C, int OC);
	void (*matmul_backward)(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				float *dweight, float *dbias,
				const float *dout, const gpu_bf16 *dout16, const float *inp,
				const gpu_bf16 *inp16, const float *weight,
				const gpu_bf16 *weight16, int N, int C, int OC, unsigned set);
	/* Optional (NULL: never). matmul_backward's products (dinp in fp32,
	 * no bias) with dout given as a bf16 matrix alone whose rows are ldo
	 * values apart (ldo >= OC): a column block of a wider one, such as
	 * attention_backward_rope16's rows. The same bits as matmul_backward
	 * given those values as a dense twin, or as fp32 values that round to
	 * them. alpha_in: dinp is alpha_in times the product (GPU_SET_DINP
	 * where it is not 1), as matmul_backward then scale give it. */
	void (*matmul_backward_ld16)(struct gpu_backend *be, float *dinp, float *dweight,
				     const gpu_bf16 *dout16, size_t ldo, const float *inp,
				     const gpu_bf16 *inp16, const float *weight,
				     const gpu_bf16 *weight16, int N, int C, int OC, unsigned set,
				     float alpha_in);
	/* Optional (NULL: never). dbias (OC) += the column sums of dout16's
	 * N rows of OC bf16 values, ldo apart (a block of columns of the fused
	 * q, k, v products' operand), each widened and summed in fp32: the
	 * bias gradient of the bf16 gradient the weight's products read (as
	 * PyTorch's autocast takes it from its bf16 output gradient), so that
	 * no fp32 gradient need be written for it. */
	void (*bias_backward_ld16)(struct gpu_backend *be, float *dbias, const gpu_bf16 *dout16,
				   size_t ldo, int N, int OC);
	/* Optional (NULL: never). out (N,OC) = alpha (inp (N,C) @ weight
	 * (OC,C)^T), fp32, no bias: the GEMM's alpha, as matmul_forward then
	 * scale give it (a LoRA adapter's u = scale x A^T in one op). Operands
	 * as matmul_forward's. */
	void (*matmul_forward_scaled)(struct gpu_backend *be, float *out, const float *inp,
				      const gpu_bf16 *inp16, const float *weight,
				      const gpu_bf16 *weight16, int N, int C, int OC, float alpha);
	/* out (N,OC) += inp (N,C) @ weight (OC,C)^T, fp32 out, no bias: the
	 * GEMM adds its product to out as it writes it (beta 1), one pass
	 * over out instead of a product written and then residual_forward's
	 * three. Operands as matmul_forward's (twins, or rounded into
	 * gemm_scratch in the bf16 mode). Each element is the product's fp32
	 * sum added to out in one rounding where the GEMM's epilogue is
	 * alpha * acc + beta * out (cuBLAS, OpenBLAS), as the two ops give.
	 * out16 (out NULL; the bf16 mode): the sum in bf16 instead, out16 =
	 * bf16(inp W^T + out16) — the old values widened, added to the fp32
	 * product, rounded once (a LoRA projection's bf16 output: its
	 * adapter's product first, then the weight's onto it). */
	void (*matmul_forward_add)(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				   const float *inp, const gpu_bf16 *inp16, const float *weight,
				   const gpu_bf16 *weight16, int N, int C, int OC);
	/* out (N,OC) = res + inp (N,C) @ weight (OC,C)^T, fp32, no bias: the
	 * residual stream's add (res the layer's input, out the next one),
	 * each element res plus the product's fp32 sum in one rounding, as
	 * matmul_forward then residual_forward give. out != res; operands as
	 * matmul_forward_add's. Where the GEMM can take its addend apart from
	 * its output (CUDA's cuBLASLt) one pass writes out; else res is
	 * copied to out and the product added. */
	void (*matmul_forward_residual)(struct gpu_backend *be, float *out, const float *res,
					const float *inp, const gpu_bf16 *inp16,
					const float *weight, const gpu_bf16 *weight16, int N, int C,
					int OC);
	/* out16: twin of out, or NULL; out may be NULL when it is not (the
	 * fused attention's q16, k16 written from the fp32 product). */
	void (*rope_forward)(struct gpu_backend *be, float *out, gpu_bf16 *out16, const float *inp,
			     const float *cos, const float *sin, int B, int T, int NH, int HS);
	void (*rope_backward)(struct gpu_backend *be, float *dinp, const float *dout,
			      const float *cos, const float *sin, int B, int T, int NH, int HS);
	/* Optional (NULL: never). The fused attention's q16, k16 and v16 from
	 * one product's rows: qkv (B*T, W), W = (NH + 2 NKV) HS, each row q, k
	 * and v side by side (their projections as one GEMM over weights that
	 * lie so); q and k rotated and rounded as rope_forward's out16, v
	 * rounded as bf16_round: the same bits as those three ops on q, k and v
	 * apart. */
	void (*rope_qkv16)(struct gpu_backend *be, gpu_bf16 *q16, gpu_bf16 *k16, gpu_bf16 *v16,
			   const float *qkv, const float *cos, const float *sin, int B, int T,
			   int NH, int NKV, int HS);
	/* Causal attention. Where attention_flash(HS) says false, att is the
	 * (B,NH,T,T) probabilities and datt (B,NH,T,T) scratch, as in
	 * kernels/cpu/ops.h. Where it says true (the CUDA backend's fused kernels,
	 * bf16 mode), the (T,T) matrices are never stored: att holds B*NH*T
	 * per-row statistics the backward needs and datt is scratch of
	 * gpu_flash_datt_floats (below). The backward's out and out16 are
	 * the forward's output and its bf16 twin: the fused backward forms
	 * its row sums rowsum(dout * out) from out16 widened where it is
	 * given (as FlashAttention-2 does from its bf16 output), else from
	 * out; the unfused backward reads neither (its probabilities are in
	 * att). */
	bool (*attention_flash)(struct gpu_backend *be, int HS);
	/* Whether the GEMMs of matmul_forward/backward round their operands to
	 * bf16 into gemm_scratch (below) in the current precision. */
	bool (*gemm_bf16)(struct gpu_backend *be);
	/* out16: twin of out, or NULL. out may be NULL where attention is
	 * fused and out16 is given (the output then kept in bf16 only: what
	 * the projection after it and the fused backward read); else it is
	 * written. q16, k16, v16: only where attention is fused, the twins
	 * of q, k, v (after RoPE) or NULL; q, k, v are then NULL (kept in bf16
	 * only: what the fused kernels read), and the kernels need room in
	 * gemm_scratch for dout's copy only (gpu_flash_scratch_bytes). */
	void (*attention_forward)(struct gpu_backend *be, float *out, gpu_bf16 *out16, float *att,
				  const float *q, const gpu_bf16 *q16, const float *k,
				  const gpu_bf16 *k16, const float *v, const gpu_bf16 *v16, int B,
				  int T, int NH, int NKV, int HS);
	void (*attention_backward)(struct gpu_backend *be, float *dq, float *dk, float *dv,
				   float *datt, const float *dout, const float *out,
				   const gpu_bf16 *out16, const float *q, const gpu_bf16 *q16, const float *k, const gpu_bf16 *k16,
				   const float *v, const gpu_bf16 *v16, const float *att, int B,
				   int T, int NH, int NKV, int HS);
	/* Optional (NULL: never). attention_backward, then rope_backward of dq
	 * and dk (cos, sin: rope_backward's tables), then dq, dk and dv
	 * rounded to bf16 into the rows of d16 (ld16 values a row: dq at
	 * column 0, dk at NH*HS, dv at (NH+NKV)*HS), as those five ops give,
	 * bit for bit, in fewer passes (the attention kernels rotate and round
	 * what they write). dq, dk, dv: each written where not NULL (all
	 * three or none). d16 may hold dout's bytes (read first, before any
	 * of d16 is written). ds (else NULL): ds_bytes of the caller's that
	 * nothing else of the call reads or writes (not dq, dk, dv, d16 or
	 * dout), which the backend may use as scratch (CUDA on Hopper: the
	 * probabilities' gradient between its kernels). False, and nothing
	 * done, where the backend does not fuse them at these shapes: the
	 * caller runs the five ops. */
	bool (*attention_backward_rope16)(struct gpu_backend *be, float *dq, float *dk, float *dv,
					  float *datt, const float *dout, const float *out,
					  const gpu_bf16 *out16, const gpu_bf16 *q16,
					  const gpu_bf16 *k16, const gpu_bf16 *v16, const float *att,
					  const float *cos, const float *sin, gpu_bf16 *d16,
					  size_t ld16, void *ds, size_t ds_bytes, int B, int T,
					  int NH, int NKV, int HS);
	/* Twins: out16, dgate16, dup16, or NULL; each fp32 output may be NULL
	 * when its twin is not. gate and up are read in fp32, or (gate NULL and
	 * up NULL) from gate16 and up16, a product kept in bf16 only; the
	 * backward's dout likewise, or (dout NULL) from dout16. */
	void (*swiglu_forward)(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const float *gate, const float *up, const gpu_bf16 *gate16,
			       const gpu_bf16 *up16, size_t n);
	/* dinp (rows, ad->cols) += the shares of G adapters (struct
	 * gpu_lora_dx, the same R and cols; 1 <= G <= GPU_LORA_DX_GROUP),
	 * summed over the adapters' ranks and added once (struct gpu_lora_dx's
	 * sums): the input gradient of the projections that share an input,
	 * one pass for all their adapters. */
	void (*lora_dx_add)(struct gpu_backend *be, float *dinp, const struct gpu_lora_dx *ad,
			    int G, int rows);
	/* ad: NULL, or an adapter's share of dout added as it is read (struct
	 * gpu_lora_dx; n = its rows * cols) */
	void (*swiglu_backward)(struct gpu_backend *be, float *dgate, float *dup,
				gpu_bf16 *dgate16, gpu_bf16 *dup16, const float *dout,
				const gpu_bf16 *dout16, const float *gate, const float *up,
				const gpu_bf16 *gate16, const gpu_bf16 *up16, size_t n,
				const struct gpu_lora_dx *ad);
	void (*residual_forward)(struct gpu_backend *be, float *out, const float *a, const float *b,
				 size_t n);
	/* logits16: the logits in bf16 (a bf16-output GEMM's), read instead of
	 * logits (NULL then); the row's sums are fp32/double as for fp32 logits. */
	void (*crossentropy_forward)(struct gpu_backend *be, float *losses, const float *logits,
				     const gpu_bf16 *logits16, const int32_t *targets, int N, int V);
	/* losses: NULL, or also crossentropy_forward's losses (the fused head
	 * of train/model.c: one read of the logits for both). dlogits16: twin
	 * of dlogits, or NULL; dlogits may be NULL when it is not. Either may
	 * alias its own kind of logits (in place): dlogits == logits, or
	 * dlogits16 == logits16 (bf16 logits, their bf16 gradient over them). */
	void (*crossentropy_backward)(struct gpu_backend *be, float *losses, float *dlogits,
				      gpu_bf16 *dlogits16, const float *logits,
				      const gpu_bf16 *logits16, const int32_t *targets, float dloss,
				      int N, int V);
	/* param16: param's twin (its bf16 copy), or NULL: written with the
	 * new values as param is. gscale: the gradient is read times it
	 * (kernels/cpu/ops.h: adamw_update), a clip's coefficient. */
	void (*adamw_update)(struct gpu_backend *be, float *param, gpu_bf16 *param16,
			     const float *grad, float gscale, float *m, float *v, size_t n, float lr,
			     float beta1,
			     float beta2, float eps, float weight_decay, int t);
	/* adamw_update without a bf16 copy over n values, R rows of C, whose
	 * gradient is kept by rows (kernels/cpu/ops.h: adamw_update_rows):
	 * row r's is rows[row_of[r]], or zeros where row_of[r] < 0. */
	void (*adamw_update_rows)(struct gpu_backend *be, float *param, const float *rows,
				  const int32_t *row_of, int C, float gscale, float *m, float *v,
				  size_t n, float lr, float beta1, float beta2, float eps,
				  float weight_decay, int t);
	/* Blocking: sum of squares of x (n values), accumulated in double. */
	double (*sumsq)(struct gpu_backend *be, const float *x, size_t n);
	void (*scale)(struct gpu_backend *be, float *x, float s, size_t n);

	/* bf16 conversions (kernels/cpu/ops.h: bf16_round, bf16_widen): a
	 * trainable weight's copy rounded after an upload; a weight stored in
	 * bf16 widened for a backend whose GEMMs read fp32. Any backend. */
	void (*bf16_round)(struct gpu_backend *be, gpu_bf16 *out, const float *in, size_t n);
	void (*bf16_widen)(struct gpu_backend *be, float *out, const gpu_bf16 *in, size_t n);
	/* rows of cols floats (in, row r at in + r * cols) rounded as
	 * bf16_round rounds them into row r of out at out + r * ldo (ldo >=
	 * cols): tensors side by side in one bf16 matrix, one GEMM operand
	 * (the q, k and v gradients of a layer's fused input-gradient and
	 * weight-gradient products, train/model.c). */
	void (*bf16_round_rows)(struct gpu_backend *be, gpu_bf16 *out, size_t ldo, const float *in,
				size_t rows, size_t cols);

	/* Methods (LoRA, QLoRA, distillation, classification): kernels/cpu/ops.h.
	 * codes, absmax, q, scale: device buffers the engine uploaded at load.
	 * nf4_dequantize's out16: the values rounded to bf16 instead of out (a
	 * twin; out NULL). */
	void (*nf4_dequantize)(struct gpu_backend *be, float *out, gpu_bf16 *out16,
			       const uint8_t *codes, const float *absmax, size_t n);
	void (*absmax_dequantize)(struct gpu_backend *be, float *absmax, const int8_t *q,
				  const float *scale, size_t nblocks);
	void (*distill_forward)(struct gpu_backend *be, float *kl, float *ce, const float *logits,
				const float *tlogits, const int32_t *targets, float temperature,
				int N, int V);
	void (*distill_backward)(struct gpu_backend *be, float *dlogits, const float *logits,
				 const float *tlogits, const int32_t *targets, float dloss,
				 float alpha, float temperature, int N, int V);
	void (*dropout)(struct gpu_backend *be, float *out, const float *inp, float p,
			uint64_t seed, size_t n);
};

/* A module-cache entry (contract 3) that a backend loaded or wrote at
 * creation, reported for the daemon's sqlite index (state/: st_cache_put). */
struct gpu_cache_entry {
	char key[65];         /* hex, gpu/cuda/modcache.h's cu_cache_key; "" when none */
	char path[4096];      /* the entry's file */
	char sha256[65];      /* hex SHA-256 of the cubin (the digest in the file's header) */
	char arch[16];        /* "sm_90" */
	uint64_t size_bytes;  /* of the cubin */
	uint64_t src_bytes;   /* of the PTX it was compiled from */
	bool hit;             /* loaded from the cache; false: compiled and written */
};

/* The common head of every backend object. */
struct gpu_backend {
	const struct gpu_backend_ops *ops;
	size_t bytes_in_use;  /* what alloc has handed out and free has not taken back */
	size_t bytes_peak;    /* high-water mark of bytes_in_use */
	size_t host_bytes_in_use, host_bytes_peak; /* the same for host_alloc */
	int64_t op_count;     /* math ops enqueued (a cheap progress/sanity counter) */
	int64_t graph_launches; /* graphs launched (graph_end) */
	/* Kernel compiles (PTX JIT, NVRTC) by this backend, and those after the
	 * kernel table was sealed: contract 2 says the latter stays 0. */
	int64_t compiles;
	int64_t compiles_after_seal;
	char device[128];     /* "cpu", or the GPU's name */
	/* Device bytes the backend holds whatever the job (workspaces, reduction
	 * scratch), allocated at creation: a reservation is plan + fixed_bytes. */
	size_t fixed_bytes;
	/* The module-cache entry used at creation (CUDA's PTX path with a cache
	 * directory); cache_entry.key "" when none. */
	struct gpu_cache_entry cache_entry;
	/* Op tracing (a profiler's hook): called before (end false) and after
	 * (end true) every math op with the op's name; NULL when off. */
	void (*trace)(struct gpu_backend *be, const char *op, bool end);
	/* Device scratch for the bf16 GEMM operands that come without a twin
	 * (gpu_matmul_scratch_elems) and the fused attention's bf16 copies
	 * (gpu_flash_scratch_bytes), set by the model that planned it
	 * (train/plan.c: scratch.gemm_bf16); NULL: none. Fused attention
	 * without room for its copies fails the stream (TD_EDEVICE at the next
	 * sync, naming it). A GEMM whose operands do not fit takes the slower
	 * path that reads the fp32 operands directly where they all exist, and
	 * fails the stream where one is bf16 only: never a fault, never an
	 * allocation. */
	void *gemm_scratch;
	size_t gemm_scratch_bytes;
};

/* The bf16 mode's GEMM operand scratch, as the CUDA backend lays it out
 * (gpu/cuda/cuda_ops.c) and the memory plan sizes it (train/plan.c): only
 * the operands without a twin are rounded into it, the first at element 0
 * and the second after the first's slot (rounded up to 128 elements). */
static inline size_t gpu_gemm_slot(size_t n)
{
	return (n + 127) / 128 * 128;
}

/* bf16 elements of gemm_scratch a matmul of N rows, C -> OC needs in the bf16
 * mode. Forward (backward false): the weight (OC*C) unless w16, then the
 * input (N*C) unless x16. Backward: one slot for the weight (when dinp is
 * wanted, unless w16) and then the input (when dweight is, unless x16),
 * one after the other, and the output gradient (N*OC) after it unless d16. */
static inline size_t gpu_matmul_scratch_elems(size_t N, size_t C, size_t OC, bool backward,
					      bool dinp, bool dweight, bool w16, bool x16,
					      bool d16)
{
	size_t w = (backward ? dinp : true) && !w16 ? OC * C : 0;
	size_t x = (backward ? dweight : true) && !x16 ? N * C : 0;
	if (!backward)
		return gpu_gemm_slot(w) + x;
	return gpu_gemm_slot(w > x ? w : x) + (d16 ? 0 : N * OC);
}

/* Asserts that every op of the table is set; called by each backend's
 * constructor once (a missing op is a bug, not an input error). */
void gpu_backend_check_ops(const struct gpu_backend_ops *ops);

/* The CPU backend: fp32, kernels/cpu, GEMMs through the BLAS. */
td_err gpu_cpu_backend_new(struct gpu_backend **out, struct td_errbuf *eb);

/* gpu_backend_free(NULL) is a no-op. Arenas must have been freed. */
static inline void gpu_backend_free(struct gpu_backend *be)
{
	if (be)
		be->ops->destroy(be);
}

static inline td_err gpu_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	return be->ops->alloc(be, bytes, out);
}
static inline void gpu_free(struct gpu_backend *be, void *p, size_t bytes)
{
	if (p)
		be->ops->free(be, p, bytes);
}
static inline bool gpu_can_share(struct gpu_backend *be)
{
	return be->ops->share_alloc != NULL;
}
static inline td_err gpu_share_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	return be->ops->share_alloc ? be->ops->share_alloc(be, bytes, out) : TD_EUNSUPPORTED;
}
static inline void gpu_share_free(struct gpu_backend *be, void *p, size_t bytes)
{
	if (p && be->ops->share_free)
		be->ops->share_free(be, p, bytes);
}
static inline td_err gpu_share_seal(struct gpu_backend *be, void *p, size_t bytes,
				    struct td_errbuf *eb)
{
	if (!be->ops->share_seal)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: no read-only device memory", be->ops->name);
	return be->ops->share_seal(be, p, bytes, eb);
}
static inline void gpu_upload(struct gpu_backend *be, void *dst, const void *src, size_t bytes)
{
	be->ops->upload(be, dst, src, bytes);
}
static inline void gpu_download(struct gpu_backend *be, void *dst, const void *src, size_t bytes)
{
	be->ops->download(be, dst, src, bytes);
}
static inline void gpu_zero(struct gpu_backend *be, void *dst, size_t bytes)
{
	be->ops->zero(be, dst, bytes);
}
static inline td_err gpu_sync(struct gpu_backend *be, struct td_errbuf *eb)
{
	return be->ops->sync(be, eb);
}
static inline td_err gpu_set_bf16(struct gpu_backend *be, bool bf16, struct td_errbuf *eb)
{
	return be->ops->set_bf16(be, bf16, eb);
}
static inline td_err gpu_mem_info(struct gpu_backend *be, size_t *free_bytes, size_t *total_bytes)
{
	return be->ops->mem_info(be, free_bytes, total_bytes);
}
static inline td_err gpu_host_alloc(struct gpu_backend *be, size_t bytes, void **out)
{
	return be->ops->host_alloc(be, bytes, out);
}
static inline void gpu_host_free(struct gpu_backend *be, void *p, size_t bytes)
{
	if (p)
		be->ops->host_free(be, p, bytes);
}
/* host (host_alloc's) = dev, as copy k, after the ops enqueued so far. */
static inline void gpu_copy_to_host(struct gpu_backend *be, void *host, const void *dev,
				    size_t bytes, int k)
{
	assert(k >= 0 && k < GPU_COPY_SLOTS);
	be->ops->copy_async(be, host, dev, bytes, true, k);
}
/* dev = host (host_alloc's), as copy k, after the ops enqueued so far. */
static inline void gpu_copy_to_device(struct gpu_backend *be, void *dev, const void *host,
				      size_t bytes, int k)
{
	assert(k >= 0 && k < GPU_COPY_SLOTS);
	be->ops->copy_async(be, dev, host, bytes, false, k);
}
/* The ops enqueued from now on wait for copy k. */
static inline void gpu_copy_wait(struct gpu_backend *be, int k)
{
	assert(k >= 0 && k < GPU_COPY_SLOTS);
	be->ops->copy_wait(be, k);
}

static inline bool gpu_graph_begin(struct gpu_backend *be)
{
	return be->ops->graph_begin && be->ops->graph_begin(be);
}

static inline bool gpu_graph_end(struct gpu_backend *be, void **exec)
{
	return be->ops->graph_end(be, exec);
}

static inline void gpu_graph_free(struct gpu_backend *be, void *exec)
{
	if (exec)
		be->ops->graph_free(be, exec);
}

#define GPU_OP_(name, ...)                          \
	do {                                        \
		be->op_count++;                     \
		if (be->trace)                      \
			be->trace(be, #name, false); \
		be->ops->name(be, __VA_ARGS__);     \
		if (be->trace)                      \
			be->trace(be, #name, true);  \
	} while (0)

static inline void gpu_embedding_forward(struct gpu_backend *be, float *out, const int32_t *ids,
					 const float *wte, const gpu_bf16 *wte16, int N, int C)
{
	GPU_OP_(embedding_forward, out, ids, wte, wte16, N, C);
}
static inline void gpu_embedding_backward(struct gpu_backend *be, float *dwte, const float *dout,
					  const int32_t *ids, int N, int C)
{
	GPU_OP_(embedding_backward, dwte, dout, ids, N, C);
}
static inline void gpu_embedding_forward_part(struct gpu_backend *be, float *out,
					      const int32_t *ids, const float *part, int N, int C,
					      size_t lo, size_t hi)
{
	GPU_OP_(embedding_forward_part, out, ids, part, N, C, lo, hi);
}
static inline void gpu_embedding_backward_part(struct gpu_backend *be, float *part,
					       const float *dout, const int32_t *ids, int N, int C,
					       size_t lo, size_t hi)
{
	GPU_OP_(embedding_backward_part, part, dout, ids, N, C, lo, hi);
}
static inline void gpu_rmsnorm_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				       float *rstd, const float *inp, const float *weight, int N,
				       int C, float eps)
{
	GPU_OP_(rmsnorm_forward, out, out16, rstd, inp, weight, N, C, eps);
}
static inline void gpu_rmsnorm_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
					float *dweight, const float *dout, const float *inp,
					const float *weight, const float *rstd, int N, int C)
{
	GPU_OP_(rmsnorm_backward, dinp, dinp16, dweight, dout, inp, weight, rstd, N, C);
}
static inline void gpu_matmul_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				      const float *inp, const gpu_bf16 *inp16, const float *weight,
				      const gpu_bf16 *weight16, const float *bias, int N, int C,
				      int OC)
{
	GPU_OP_(matmul_forward, out, out16, inp, inp16, weight, weight16, bias, N, C, OC);
}
static inline void gpu_matmul_forward_add(struct gpu_backend *be, float *out, gpu_bf16 *out16,
					  const float *inp, const gpu_bf16 *inp16,
					  const float *weight, const gpu_bf16 *weight16, int N, int C,
					  int OC)
{
	GPU_OP_(matmul_forward_add, out, out16, inp, inp16, weight, weight16, N, C, OC);
}
static inline void gpu_matmul_forward_residual(struct gpu_backend *be, float *out,
					       const float *res, const float *inp,
					       const gpu_bf16 *inp16, const float *weight,
					       const gpu_bf16 *weight16, int N, int C, int OC)
{
	GPU_OP_(matmul_forward_residual, out, res, inp, inp16, weight, weight16, N, C, OC);
}
static inline void gpu_matmul_backward(struct gpu_backend *be, float *dinp, gpu_bf16 *dinp16,
				       float *dweight, float *dbias, const float *dout,
				       const gpu_bf16 *dout16, const float *inp,
				       const gpu_bf16 *inp16, const float *weight,
				       const gpu_bf16 *weight16, int N, int C, int OC,
				       unsigned set)
{
	GPU_OP_(matmul_backward, dinp, dinp16, dweight, dbias, dout, dout16, inp, inp16, weight,
		weight16, N, C, OC, set);
}
static inline void gpu_matmul_backward_ld16(struct gpu_backend *be, float *dinp, float *dweight,
					    const gpu_bf16 *dout16, size_t ldo, const float *inp,
					    const gpu_bf16 *inp16, const float *weight,
					    const gpu_bf16 *weight16, int N, int C, int OC,
					    unsigned set, float alpha_in)
{
	GPU_OP_(matmul_backward_ld16, dinp, dweight, dout16, ldo, inp, inp16, weight, weight16, N, C,
		OC, set, alpha_in);
}
static inline void gpu_bias_backward_ld16(struct gpu_backend *be, float *dbias,
					  const gpu_bf16 *dout16, size_t ldo, int N, int OC)
{
	GPU_OP_(bias_backward_ld16, dbias, dout16, ldo, N, OC);
}
static inline void gpu_matmul_forward_scaled(struct gpu_backend *be, float *out, const float *inp,
					     const gpu_bf16 *inp16, const float *weight,
					     const gpu_bf16 *weight16, int N, int C, int OC,
					     float alpha)
{
	GPU_OP_(matmul_forward_scaled, out, inp, inp16, weight, weight16, N, C, OC, alpha);
}
static inline void gpu_rope_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				    const float *inp, const float *cos, const float *sin, int B,
				    int T, int NH, int HS)
{
	GPU_OP_(rope_forward, out, out16, inp, cos, sin, B, T, NH, HS);
}
static inline void gpu_rope_qkv16(struct gpu_backend *be, gpu_bf16 *q16, gpu_bf16 *k16,
				  gpu_bf16 *v16, const float *qkv, const float *cos,
				  const float *sin, int B, int T, int NH, int NKV, int HS)
{
	GPU_OP_(rope_qkv16, q16, k16, v16, qkv, cos, sin, B, T, NH, NKV, HS);
}
static inline void gpu_rope_backward(struct gpu_backend *be, float *dinp, const float *dout,
				     const float *cos, const float *sin, int B, int T, int NH,
				     int HS)
{
	GPU_OP_(rope_backward, dinp, dout, cos, sin, B, T, NH, HS);
}
static inline void gpu_attention_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
					 float *att, const float *q, const gpu_bf16 *q16,
					 const float *k, const gpu_bf16 *k16, const float *v,
					 const gpu_bf16 *v16, int B, int T, int NH, int NKV, int HS)
{
	GPU_OP_(attention_forward, out, out16, att, q, q16, k, k16, v, v16, B, T, NH, NKV, HS);
}
static inline void gpu_attention_backward(struct gpu_backend *be, float *dq, float *dk, float *dv,
					  float *datt, const float *dout, const float *out,
					  const gpu_bf16 *out16, const float *q, const gpu_bf16 *q16,
					  const float *k, const gpu_bf16 *k16, const float *v,
					  const gpu_bf16 *v16, const float *att, int B, int T, int NH,
					  int NKV, int HS)
{
	GPU_OP_(attention_backward, dq, dk, dv, datt, dout, out, out16, q, q16, k, k16, v, v16, att,
		B, T, NH, NKV, HS);
}
static inline bool gpu_attention_backward_rope16(struct gpu_backend *be, float *dq, float *dk,
						 float *dv, float *datt, const float *dout,
						 const float *out, const gpu_bf16 *out16,
						 const gpu_bf16 *q16, const gpu_bf16 *k16,
						 const gpu_bf16 *v16, const float *att, const float *cos,
						 const float *sin, gpu_bf16 *d16, size_t ld16, void *ds,
						 size_t ds_bytes, int B, int T, int NH, int NKV, int HS)
{
	if (!be->ops->attention_backward_rope16)
		return false;
	be->op_count++;
	if (be->trace)
		be->trace(be, "attention_backward_rope16", false);
	bool r = be->ops->attention_backward_rope16(be, dq, dk, dv, datt, dout, out, out16, q16, k16,
						    v16, att, cos, sin, d16, ld16, ds, ds_bytes, B, T,
						    NH, NKV, HS);
	if (be->trace)
		be->trace(be, "attention_backward_rope16", true);
	return r;
}

/* The fused attention backward's scratch (datt): B*NH*T row statistics and,
 * where query heads share kv heads (NH > NKV), two (B,T,NH,HS) per-head dK
 * and dV partials from float gpu_flash_part_offset on (64-float aligned). */
static inline size_t gpu_flash_part_offset(int B, int T, int NH)
{
	return ((size_t)B * NH * T + 63) / 64 * 64;
}
static inline size_t gpu_flash_datt_floats(int B, int T, int NH, int NKV, int HS)
{
	if (NH == NKV)
		return (size_t)B * NH * T;
	return gpu_flash_part_offset(B, T, NH) + 2 * (size_t)B * T * NH * HS;
}

/* Bytes of the dS the CUDA backend's Hopper attention backward keeps for a
 * (batch, head) pair, where attention_backward_rope16 is lent room (ds): a
 * 64 x 64 bf16 tile a (query tile, key tile <= it). The memory plan sizes
 * that room by it (train/plan.c: scratch.att_ds). */
static inline size_t gpu_flash_ds_pair_bytes(int T)
{
	const size_t tiles = ((size_t)T + 63) / 64;
	return tiles * (tiles + 1) / 2 * 8192;
}

/* Bytes of gemm_scratch the fused attention needs for its bf16 copies of q,
 * dout (B,T,NH,HS) and k, v (B,T,NKV,HS), each padded to 128 elements, in
 * that order; where q, k and v come as twins (qkv16), of dout only. The
 * memory plan makes the scratch at least this big (train/plan.c). */
static inline size_t gpu_flash_scratch_bytes(int B, int T, int NH, int NKV, int HS, bool qkv16)
{
	size_t n = (size_t)B * T * HS;
	size_t q = (n * NH + 127) / 128 * 128, k = (n * NKV + 127) / 128 * 128;
	return qkv16 ? 2 * q : 2 * (2 * q + 2 * k);
}

/* The head sizes the CUDA backend's fused attention kernels are built for
 * (kernels/cuda/flash.cu); others take the stored-probabilities path. */
static inline bool gpu_flash_head_size(int HS)
{
	return HS == 16 || HS == 32 || HS == 64 || HS == 128;
}

/* Whether attention on be, in its current precision, is fused (att then
 * holds B*NH*T floats instead of B*NH*T*T, datt gpu_flash_datt_floats). The
 * memory plan follows it (train/plan.h: attention_lse). */
static inline bool gpu_attention_flash(struct gpu_backend *be, int HS)
{
	return be->ops->attention_flash(be, HS);
}

static inline bool gpu_gemm_bf16(struct gpu_backend *be)
{
	return be->ops->gemm_bf16(be);
}
static inline void gpu_swiglu_forward(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				      const float *gate, const float *up, const gpu_bf16 *gate16,
				      const gpu_bf16 *up16, size_t n)
{
	GPU_OP_(swiglu_forward, out, out16, gate, up, gate16, up16, n);
}
static inline void gpu_lora_dx_add(struct gpu_backend *be, float *dinp,
				   const struct gpu_lora_dx *ad, int G, int rows)
{
	assert(dinp && G >= 1 && G <= GPU_LORA_DX_GROUP && rows >= 0);
	for (int g = 0; g < G; g++)
		assert(ad[g].du && (ad[g].A || ad[g].A16) && ad[g].R == ad[0].R &&
		       ad[g].cols == ad[0].cols && !ad[g].A16 == !ad[0].A16 && ad[g].R > 0 &&
		       ad[g].R <= GPU_LORA_DX_RMAX);
	GPU_OP_(lora_dx_add, dinp, ad, G, rows);
}
static inline void gpu_swiglu_backward(struct gpu_backend *be, float *dgate, float *dup,
				       gpu_bf16 *dgate16, gpu_bf16 *dup16, const float *dout,
				       const gpu_bf16 *dout16, const float *gate, const float *up,
				       const gpu_bf16 *gate16, const gpu_bf16 *up16, size_t n,
				       const struct gpu_lora_dx *ad)
{
	assert(!ad || (ad->du && ad->R > 0 && ad->R <= GPU_LORA_DX_RMAX && ad->cols > 0 &&
		       (ad->A || ad->A16) &&
		       n % (size_t)ad->cols == 0));
	GPU_OP_(swiglu_backward, dgate, dup, dgate16, dup16, dout, dout16, gate, up, gate16, up16,
		n, ad);
}
static inline void gpu_residual_forward(struct gpu_backend *be, float *out, const float *a,
					const float *b, size_t n)
{
	GPU_OP_(residual_forward, out, a, b, n);
}
static inline void gpu_crossentropy_forward(struct gpu_backend *be, float *losses,
					    const float *logits, const gpu_bf16 *logits16,
					    const int32_t *targets, int N, int V)
{
	GPU_OP_(crossentropy_forward, losses, logits, logits16, targets, N, V);
}
static inline void gpu_crossentropy_backward(struct gpu_backend *be, float *losses,
					     float *dlogits, gpu_bf16 *dlogits16,
					     const float *logits, const gpu_bf16 *logits16,
					     const int32_t *targets, float dloss, int N, int V)
{
	GPU_OP_(crossentropy_backward, losses, dlogits, dlogits16, logits, logits16, targets,
		dloss, N, V);
}
static inline void gpu_adamw_update(struct gpu_backend *be, float *param, gpu_bf16 *param16,
				    const float *grad, float gscale, float *m, float *v, size_t n,
				    float lr, float beta1, float beta2, float eps, float weight_decay,
				    int t)
{
	GPU_OP_(adamw_update, param, param16, grad, gscale, m, v, n, lr, beta1, beta2, eps,
		weight_decay, t);
}
static inline void gpu_adamw_update_rows(struct gpu_backend *be, float *param, const float *rows,
					 const int32_t *row_of, int C, float gscale, float *m,
					 float *v, size_t n, float lr, float beta1, float beta2,
					 float eps, float weight_decay, int t)
{
	GPU_OP_(adamw_update_rows, param, rows, row_of, C, gscale, m, v, n, lr, beta1, beta2, eps,
		weight_decay, t);
}
static inline double gpu_sumsq(struct gpu_backend *be, const float *x, size_t n)
{
	be->op_count++;
	if (be->trace)
		be->trace(be, "sumsq", false);
	double r = be->ops->sumsq(be, x, n);
	if (be->trace)
		be->trace(be, "sumsq", true);
	return r;
}
static inline void gpu_scale(struct gpu_backend *be, float *x, float s, size_t n)
{
	GPU_OP_(scale, x, s, n);
}

static inline void gpu_bf16_round(struct gpu_backend *be, gpu_bf16 *out, const float *in,
				  size_t n)
{
	GPU_OP_(bf16_round, out, in, n);
}

static inline void gpu_bf16_round_rows(struct gpu_backend *be, gpu_bf16 *out, size_t ldo,
				       const float *in, size_t rows, size_t cols)
{
	GPU_OP_(bf16_round_rows, out, ldo, in, rows, cols);
}
static inline void gpu_bf16_widen(struct gpu_backend *be, float *out, const gpu_bf16 *in,
				  size_t n)
{
	GPU_OP_(bf16_widen, out, in, n);
}
static inline void gpu_nf4_dequantize(struct gpu_backend *be, float *out, gpu_bf16 *out16,
				      const uint8_t *codes, const float *absmax, size_t n)
{
	GPU_OP_(nf4_dequantize, out, out16, codes, absmax, n);
}
static inline void gpu_absmax_dequantize(struct gpu_backend *be, float *absmax, const int8_t *q,
					 const float *scale, size_t nblocks)
{
	GPU_OP_(absmax_dequantize, absmax, q, scale, nblocks);
}
static inline void gpu_distill_forward(struct gpu_backend *be, float *kl, float *ce,
				       const float *logits, const float *tlogits,
				       const int32_t *targets, float temperature, int N, int V)
{
	GPU_OP_(distill_forward, kl, ce, logits, tlogits, targets, temperature, N, V);
}
static inline void gpu_distill_backward(struct gpu_backend *be, float *dlogits,
					const float *logits, const float *tlogits,
					const int32_t *targets, float dloss, float alpha,
					float temperature, int N, int V)
{
	GPU_OP_(distill_backward, dlogits, logits, tlogits, targets, dloss, alpha, temperature, N,
		V);
}
static inline void gpu_dropout(struct gpu_backend *be, float *out, const float *inp, float p,
			       uint64_t seed, size_t n)
{
	GPU_OP_(dropout, out, inp, p, seed, n);
}

#undef GPU_OP_

#endif
