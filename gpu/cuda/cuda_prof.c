/* TD_CUDA_PROFILE=1: device time per op, for finding where a step goes.
 *
 * Each math op (through gpu/backend.h's trace hook) and each cuBLAS call
 * inside one (cu_prof_begin/cu_prof_end in cuda_ops.c) is bracketed by two
 * events on the backend's stream; the end event is waited for, so the times
 * are the device's own but the step is slower (the launch queue drains after
 * every op). The table goes to stderr when the backend is destroyed: label,
 * calls, total milliseconds and, for ops, their share of all op time. Off by
 * default; costs nothing then (the hook is NULL). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_internal.h"

#define CU_PROF_ROWS 512
#define CU_PROF_DEPTH 2

struct cu_prof_row {
	char label[120];
	int level;
	long long calls;
	double ms, min_ms;
};

struct cu_prof {
	struct cu_prof_row rows[CU_PROF_ROWS];
	int nrows;
	CUevent ev[2 * CU_PROF_DEPTH];
	int depth;
};

static void trace_hook(struct gpu_backend *be, const char *op, bool end)
{
	struct cu_backend *cb = cu_of(be);
	if (end)
		cu_prof_end(cb, "%s", op);
	else
		cu_prof_begin(cb);
}

void cu_prof_open(struct cu_backend *cb)
{
	const char *env = getenv("TD_CUDA_PROFILE");
	if (!env || !*env || strcmp(env, "0") == 0)
		return;
	struct cu_prof *p = calloc(1, sizeof(*p));
	if (!p)
		return;
	for (int i = 0; i < 2 * CU_PROF_DEPTH; i++)
		if (cb->drv.cuEventCreate(&p->ev[i], CU_EVENT_DEFAULT) != CUDA_SUCCESS) {
			while (i-- > 0)
				cb->drv.cuEventDestroy(p->ev[i]);
			free(p);
			return;
		}
	cb->prof = p;
	cb->base.trace = trace_hook;
}

void cu_prof_begin(struct cu_backend *cb)
{
	struct cu_prof *p = cb->prof;
	if (!p)
		return;
	if (p->depth < CU_PROF_DEPTH)
		cb->drv.cuEventRecord(p->ev[2 * p->depth], cb->stream);
	p->depth++;
}

void cu_prof_end(struct cu_backend *cb, const char *fmt, ...)
{
	struct cu_prof *p = cb->prof;
	if (!p || p->depth == 0)
		return;
	int level = --p->depth;
	if (level >= CU_PROF_DEPTH)
		return;
	CUevent b = p->ev[2 * level], e = p->ev[2 * level + 1];
	float ms = 0.0f;
	cb->drv.cuEventRecord(e, cb->stream);
	if (cb->drv.cuEventSynchronize(e) != CUDA_SUCCESS ||
	    cb->drv.cuEventElapsedTime(&ms, b, e) != CUDA_SUCCESS)
		return;
	char label[sizeof(p->rows[0].label)];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(label, sizeof(label), fmt, ap);
	va_end(ap);
	int i;
	for (i = 0; i < p->nrows; i++)
		if (p->rows[i].level == level && strcmp(p->rows[i].label, label) == 0)
			break;
	if (i == p->nrows) {
		if (p->nrows == CU_PROF_ROWS)
			return;
		p->nrows++;
		snprintf(p->rows[i].label, sizeof(p->rows[i].label), "%s", label);
		p->rows[i].level = level;
	}
	if (p->rows[i].calls == 0 || ms < p->rows[i].min_ms)
		p->rows[i].min_ms = ms;
	p->rows[i].calls++;
	p->rows[i].ms += ms;
}

static int by_time(const void *a, const void *b)
{
	const struct cu_prof_row *x = a, *y = b;
	if (x->level != y->level)
		return x->level - y->level;
	return x->ms < y->ms ? 1 : x->ms > y->ms ? -1 : 0;
}

void cu_prof_close(struct cu_backend *cb)
{
	struct cu_prof *p = cb->prof;
	if (!p)
		return;
	qsort(p->rows, (size_t)p->nrows, sizeof(p->rows[0]), by_time);
	double total = 0.0;
	for (int i = 0; i < p->nrows; i++)
		if (p->rows[i].level == 0)
			total += p->rows[i].ms;
	fprintf(stderr, "TD_CUDA_PROFILE: device ms per op (all steps, warm-up included); "
			"cuBLAS calls below, m x n x k [x batch]\n");
	for (int i = 0; i < p->nrows; i++) {
		const struct cu_prof_row *r = &p->rows[i];
		if (r->level == 0)
			fprintf(stderr, "  %-28s %8lld calls %10.1f ms %5.1f%% (min %.3f)\n", r->label,
				r->calls, r->ms, total > 0 ? 100.0 * r->ms / total : 0.0, r->min_ms);
		else
			fprintf(stderr, "    %-70s %8lld %10.1f ms (min %.3f)\n", r->label, r->calls,
				r->ms, r->min_ms);
	}
	fprintf(stderr, "  %-28s %19s %10.1f ms\n", "total", "", total);
	for (int i = 0; i < 2 * CU_PROF_DEPTH; i++)
		cb->drv.cuEventDestroy(p->ev[i]);
	free(p);
	cb->prof = NULL;
	cb->base.trace = NULL;
}
