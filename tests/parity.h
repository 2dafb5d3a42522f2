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
	bool verbose;
	struct json_object *manifest; /* NULL when DIR has none */
};

/* The float32 tolerances of the shared fixtures. */
#define PARITY_TOL_FORWARD 1e-5 /* logits, hidden states, losses */
#define PARITY_TOL_GRAD 1e-4    /* gradients, normwise */
#define PARITY_TOL_AFTER 1e-4   /* parameters after optimizer steps, absolute */

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
