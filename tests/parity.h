/* The parity tool's shared parts: tolerance groups, comparison, report.
 *
 * `parity DIR` dispatches on DIR's layout to one runner (causal LM, tokenizer,
 * LoRA / classification / distillation); each runner computes with traind and
 * calls parity_compare() per reference tensor. Errors are normwise per tensor,
 * max|a-b| / max|b|, or absolute where the group says so
 * (shared/fixtures/README.md). */
#ifndef TESTS_PARITY_H
#define TESTS_PARITY_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stddef.h>

#include "proto/err.h"

struct parity_opts {
	const char *dir;
	const char *backend;   /* "cpu" or "cuda" */
	bool bf16;             /* --precision bf16: the backend's bf16 compute mode */
	bool verbose;
	struct json_object *manifest; /* NULL when DIR has none */
};

/* The float32 tolerances of the shared fixtures, and the bounds of the bf16
 * compute mode (GEMM operands rounded to bf16, 8 significant bits: a relative
 * error of up to 2^-8 per operand, growing through the layers to ~1e-3..1e-2):
 *   forward (logits, hidden)  2e-2 normwise, loss 1e-2 relative;
 *   gradients                 5e-2 normwise;
 *   parameters after k steps  absolute 2 * lr * k (6e-3 at the fixtures'
 *     lr 1e-3, k = 3): Adam's step is lr * m^/(sqrt(v^) + eps), and with
 *     bias correction |m^| / sqrt(v^) <= 1.004 for k <= 3 (Cauchy-Schwarz on
 *     its weights), whatever the gradient. A component whose gradient is
 *     mostly rounding error can take its steps in the opposite direction on
 *     each side, so no bound below 2 * lr * k holds for every parameter; the
 *     gradients themselves are held to 5e-2 above. */
extern bool parity_bf16;
#define PARITY_TOL_FORWARD (parity_bf16 ? 2e-2 : 1e-5) /* logits, hidden states */
#define PARITY_TOL_LOSS (parity_bf16 ? 1e-2 : 1e-5)    /* losses */
#define PARITY_TOL_GRAD (parity_bf16 ? 5e-2 : 1e-4)    /* gradients, normwise */
#define PARITY_TOL_AFTER (parity_bf16 ? 6e-3 : 1e-4)   /* parameters after 3 steps, absolute */

struct gpu_backend;
/* Opens o->backend and sets its precision (o->bf16). */
td_err parity_open_backend(const struct parity_opts *o, struct gpu_backend **be, struct td_errbuf *eb);

/* A group of checks reported on one line; created on first use. */
int parity_group(const char *name, double tol, bool absolute);
/* Compares got with want (n floats) in group g; prints a line for failures
 * (and for every tensor with --verbose). */
void parity_compare(int g, const char *name, const float *got, const float *want, size_t n);
void parity_compare_scalar(int g, const char *name, double got, double want);
/* Counts a failure that is not a numeric comparison (a missing reference...). */
void parity_fail(int g, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints the table; returns the number of failed checks. */
int parity_report(void);

/* Prints "parity: WHAT: message" and returns 2 (the "could not run" exit code). */
int parity_die(const char *what, td_err e, const struct td_errbuf *eb);
/* A number from a JSON object, or dflt. */
double parity_jnum(struct json_object *o, const char *key, double dflt);

/* Runners: return 0 (all within tolerance), 1 (some are not) or 2 (could not run). */
int parity_causal(const struct parity_opts *o);
int parity_tokenizer(const struct parity_opts *o);
int parity_methods(const struct parity_opts *o);

#endif
