/* A CPU backend whose matmuls do not depend on how many rows one call covers.
 *
 * OpenBLAS picks its kernels and its thread split by the shape of a product,
 * so the same row of a product can come out with different float32 rounding
 * when it is computed in a call of 5 rows or of 48 (chunked against whole
 * logits), and differently again with OPENBLAS_NUM_THREADS or
 * OPENBLAS_CORETYPE. Tests that hold a chunked computation to the whole one
 * install these matmuls instead: each output element is one plain C sum in a
 * fixed order, and weight and bias gradients add one row's contribution at a
 * time, in row order, so a chunked pass performs exactly the float operations
 * of the whole pass and the comparison can be for equal bits. Not a fast path
 * and not the production numerics: only the chunking logic is under test. */
#ifndef TESTS_UNIT_ROWMATMUL_H
#define TESTS_UNIT_ROWMATMUL_H

struct gpu_backend;

/* Replaces be's matmul_forward and matmul_backward (a CPU backend: fp32, no
 * bf16 twins) by the row-wise ones; every other op stays be's own. */
void rowmatmul_install(struct gpu_backend *be);

#endif
