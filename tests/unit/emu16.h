/* A CPU backend that plays the CUDA backend's bf16 mode, for tests of the
 * engine's bf16 paths on a machine without a GPU.
 *
 * Its gpu_gemm_bf16 is true, so the engine plans and runs as in the bf16
 * mode: twins written and read, frozen weights stored in bf16, trainable
 * weights' bf16 copies passed to the GEMMs, NF4 dequantized to bf16, the
 * GEMM operand scratch handed over. Each GEMM rounds its operands to bf16 (a
 * twin as given) and multiplies in fp32, as the tensor cores do up to the
 * order of the additions; every other op is the CPU's fp32 op with its
 * twins rounded from its fp32 results. Attention is not fused (the stored
 * probabilities: gpu_attention_flash is false).
 *
 * And it checks what a GPU would only show as a failed stream or drifting
 * numbers: every GEMM's operands that come without a twin fit the scratch
 * the model lent (gpu_matmul_scratch_elems against gemm_scratch_bytes), and
 * every twin passed beside its fp32 tensor is that tensor rounded (a stale
 * bf16 copy of a weight is caught at its next use). Violations are counted
 * (emu16_violations) and the first few printed. Not production numerics. */
#ifndef TESTS_UNIT_EMU16_H
#define TESTS_UNIT_EMU16_H

#include <stddef.h>

#include "gpu/backend.h"

/* A fresh emulating backend (free with gpu_backend_free). */
td_err emu16_backend_new(struct gpu_backend **out, struct td_errbuf *eb);
/* The same with the attention fused where the CUDA backend fuses it (head
 * sizes 16, 32, 64, 128: gpu_flash_head_size): what the engine keeps and
 * passes is what the fused kernels read — q, k, v in bf16, B*NH*T row
 * statistics in att, gemm_scratch room for the copies — and the backward
 * checks that it gets the forward's own out and statistics (violations
 * otherwise). The math is the CPU's on bf16 q, k, v, not the kernels'. */
td_err emu16_flash_backend_new(struct gpu_backend **out, struct td_errbuf *eb);
/* Scratch overflows and stale twins seen by every emulating backend so far. */
size_t emu16_violations(void);

#endif
