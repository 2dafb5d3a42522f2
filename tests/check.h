/* Minimal assertion macros for traind's test programs.
 *
 * Each failed check prints the file, line, expression and both values, and
 * counts; a test's main returns check_status() so that any failure fails the
 * program. Exit code 77 means "skipped" to meson (check_skip). Not a framework:
 * one test program per unit, with a table of cases. */
#ifndef TESTS_CHECK_H
#define TESTS_CHECK_H

#include <errno.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check_failures_;
static int check_count_;

#define CHECK(cond)                                                                    \
	do {                                                                           \
		check_count_++;                                                        \
		if (!(cond)) {                                                         \
			check_failures_++;                                             \
			fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
		}                                                                      \
	} while (0)

#define CHECK_MSG(cond, ...)                                                           \
	do {                                                                           \
		check_count_++;                                                        \
		if (!(cond)) {                                                         \
			check_failures_++;                                             \
			fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                  \
			fputc('\n', stderr);                                           \
		}                                                                      \
	} while (0)

#define CHECK_EQ_INT(a, b)                                                             \
	do {                                                                           \
		long long a_ = (long long)(a), b_ = (long long)(b);                   \
		CHECK_MSG(a_ == b_, "%s = %lld, %s = %lld", #a, a_, #b, b_);          \
	} while (0)

#define CHECK_NEAR(a, b, tol)                                                          \
	do {                                                                           \
		double a_ = (double)(a), b_ = (double)(b), t_ = (double)(tol);        \
		CHECK_MSG(fabs(a_ - b_) <= t_, "%s = %.9g, %s = %.9g, |diff| = %.3g > %.3g", \
			  #a, a_, #b, b_, fabs(a_ - b_), t_);                          \
	} while (0)

#define CHECK_STR_EQ(a, b)                                                             \
	do {                                                                           \
		const char *a_ = (a), *b_ = (b);                                      \
		CHECK_MSG(a_ && b_ && strcmp(a_, b_) == 0, "%s = \"%s\", %s = \"%s\"", #a, \
			  a_ ? a_ : "(null)", #b, b_ ? b_ : "(null)");                 \
	} while (0)

/* hay contains needle */
#define CHECK_CONTAINS(hay, needle)                                                    \
	do {                                                                           \
		const char *h_ = (hay), *n_ = (needle);                               \
		CHECK_MSG(h_ && n_ && strstr(h_, n_) != NULL, "\"%s\" does not contain \"%s\"", \
			  h_ ? h_ : "(null)", n_ ? n_ : "(null)");                     \
	} while (0)

static inline int check_status(void)
{
	fprintf(stderr, "%d checks, %d failed\n", check_count_, check_failures_);
	return check_failures_ ? 1 : 0;
}

static inline int check_skip(const char *why)
{
	fprintf(stderr, "SKIP: %s\n", why);
	return 77;
}

/* Float32 arithmetic, for tolerances derived from it. F32_U is the unit
 * roundoff of round-to-nearest float32 (2^-24): one rounding moves a value by
 * at most u times its magnitude. f32_gamma(n) = n u / (1 - n u) bounds a
 * float32 sum or dot product of n terms, in any order and with or without
 * FMA: |computed - exact| <= gamma_n * sum |term| (Higham, Accuracy and
 * Stability of Numerical Algorithms, 2nd ed., section 3.1). Two orders of
 * the same sum therefore differ by at most 2 gamma_n sum |term|. */
#define F32_U 0x1p-24
/* The same float32 forward (logits, hidden states, loss) computed in another
 * summation order, e.g. with GEMMs of other shapes or another BLAS: the shared
 * fixtures' float32 bound for logits, hidden states and losses against
 * PyTorch (tests/fixtures/README.md), which is this situation exactly. */
#define F32_FORWARD_RTOL 1e-5
static inline double f32_gamma(double n)
{
	return n * F32_U / (1.0 - n * F32_U);
}

/* Removes a test's own temporary tree, deepest first and without following
 * links; "" does nothing. What will not go is reported, not fatal. */
static inline int check_rm_entry_(const char *path, const struct stat *st, int flag,
				  struct FTW *ftw)
{
	(void)st;
	(void)flag;
	(void)ftw;
	if (remove(path) != 0)
		fprintf(stderr, "warning: could not remove %s: %s\n", path, strerror(errno));
	return 0;
}

static inline void check_rm_tree(const char *dir)
{
	if (dir && *dir)
		nftw(dir, check_rm_entry_, 16, FTW_DEPTH | FTW_PHYS);
}

#endif
