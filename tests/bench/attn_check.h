/* The sanity check of bench_attn: the CUDA backend's fused causal attention
 * (kernels/cuda/flash.cu, bf16 mode) against a double-precision reference
 * on sampled rows of the problem it was run on, each element held to a
 * bound derived from the kernels' arithmetic (attn_check.c). On the host,
 * from the problem's inputs and the op's outputs as downloaded; it knows
 * nothing of a device. tests/unit/test_attn_check.c holds it to an
 * emulation of the kernels (passes) and to wrong results (fails).
 *
 * Layout as kernels/cpu/ops.h: q, out, dout, dq (B,T,NH,HS); k, v, dk, dv
 * (B,T,NKV,HS); L and D (B,NH,T). */
#ifndef TESTS_BENCH_ATTN_CHECK_H
#define TESTS_BENCH_ATTN_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct attn_shape {
	int B, T, NH, NKV, HS;
};

/* The op's inputs and outputs, read only. q, k, v: the bf16 operands (bit
 * patterns); dout: the fp32 output gradient; o: the forward's out16; lse:
 * its row statistics L (log2 units: log2 sum_s 2^(q.k_s log2(e)/sqrt(HS)));
 * dr: the backward's D = rowsum(dout * out16 widened) (datt's first B*NH*T
 * floats); dq, dk, dv: the gradients. */
struct attn_host {
	struct attn_shape s;
	const uint16_t *q, *k, *v, *o;
	const float *dout, *lse, *dr, *dq, *dk, *dv;
};

/* One direction's result: elements checked, those over their bound (or not
 * finite), the largest err/bound and where it was. */
struct attn_check {
	double worst;
	char what[160];
	size_t bad, n;
};

/* Checks the forward (out16 and L on sampled query rows, every value
 * finite) into fwd and the backward (D on every row, dq on sampled query
 * rows, dk and dv on sampled key rows, every value finite) into bwd, both
 * zeroed first; prints the first few elements over their bounds to stderr.
 * false: out of host memory (then nothing is checked). */
bool attn_check(const struct attn_host *h, struct attn_check *fwd, struct attn_check *bwd);

/* A bf16 bit pattern widened to float (exact). */
float attn_widen(uint16_t b);

#endif
