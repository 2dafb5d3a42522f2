/* TD_CUDA_PROFILE=1: device time per op, for finding where a step goes.
 *
 * Each math op (through gpu/backend.h's trace hook) and each cuBLAS call
 * inside one (cu_prof_begin/cu_prof_end in cuda_ops.c) is bracketed by two
 * events on the backend's stream; the end event is waited for, so the times
 * are the device's own but the step is slower (the launch queue drains after
 * every op). The table goes to stderr when the backend is destroyed: label,
 * calls, total milliseconds and, for ops, their share of all op time. Off by
 * default; costs nothing then (the hook is NULL).
 *
 * TD_CUDA_TRACE=FILE (with TD_CUDA_PROFILE off): a timeline instead, the
 * step left to run as it does. An event is recorded on the stream before
 * and after each math op (no wait), for the first CU_TRACE_OPS ops of the
 * backend; when it is destroyed, FILE.K (K: the process's K-th backend, 0
 * first: one file a rank) gets a line per op, "op start_us end_us" from the
 * first op's start. The time between one op's end and the next one's
 * start is time the stream spent waiting: for the host's launches, another
 * stream (a collective, a copy) or an event. tests/bench/trace_gaps.py
 * sums them up. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/cuda/cuda_internal.h"

#define CU_PROF_ROWS 512
#define CU_PROF_DEPTH 2
#define CU_TRACE_OPS 16384

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

struct cu_trace {
	CUevent *ev;       /* 2 a traced op: its start, its end */
	const char **op;   /* the op names (gpu/backend.h's string literals) */
	int n, depth;
	char path[4096];
};

/* Only the outermost op (an op calling another counts once). */
static void timeline_hook(struct gpu_backend *be, const char *op, bool end)
{
	struct cu_backend *cb = cu_of(be);
	struct cu_trace *t = cb->tr;
	if (!end && t->depth++ == 0 && t->n < CU_TRACE_OPS)
		cb->drv.cuEventRecord(t->ev[2 * t->n], cb->stream);
	if (end && --t->depth == 0 && t->n < CU_TRACE_OPS) {
		cb->drv.cuEventRecord(t->ev[2 * t->n + 1], cb->stream);
		t->op[t->n++] = op;
	}
}

static void trace_free(struct cu_backend *cb, struct cu_trace *t, int events)
{
	for (int i = 0; i < events; i++)
		cb->drv.cuEventDestroy(t->ev[i]);
	free(t->ev);
	free(t->op);
	free(t);
}

static void timeline_open(struct cu_backend *cb, const char *path)
{
	static int backends; /* this process's, for the file's suffix */
	struct cu_trace *t = calloc(1, sizeof(*t));
	if (!t)
		return;
	t->ev = calloc(2 * CU_TRACE_OPS, sizeof(*t->ev));
	t->op = calloc(CU_TRACE_OPS, sizeof(*t->op));
	int made = 0;
	while (t->ev && t->op && made < 2 * CU_TRACE_OPS &&
	       cb->drv.cuEventCreate(&t->ev[made], CU_EVENT_DEFAULT) == CUDA_SUCCESS)
		made++;
	if (made < 2 * CU_TRACE_OPS) {
		fprintf(stderr, "TD_CUDA_TRACE: no events for the trace; not tracing\n");
		trace_free(cb, t, made);
		return;
	}
	snprintf(t->path, sizeof(t->path), "%s.%d", path,
		 __atomic_fetch_add(&backends, 1, __ATOMIC_RELAXED));
	cb->tr = t;
	cb->base.trace = timeline_hook;
}

/* The stream is idle (the backend's destroy synchronised it). */
static void timeline_close(struct cu_backend *cb)
{
	struct cu_trace *t = cb->tr;
	FILE *f = t->n ? fopen(t->path, "w") : NULL;
	if (t->n && !f)
		fprintf(stderr, "TD_CUDA_TRACE: %s: cannot write it\n", t->path);
	for (int i = 0; f && i < t->n; i++) {
		float a = 0.0f, b = 0.0f;
		if (cb->drv.cuEventElapsedTime(&a, t->ev[0], t->ev[2 * i]) != CUDA_SUCCESS ||
		    cb->drv.cuEventElapsedTime(&b, t->ev[0], t->ev[2 * i + 1]) != CUDA_SUCCESS)
			break;
		fprintf(f, "%s %.1f %.1f\n", t->op[i], 1e3 * a, 1e3 * b);
	}
	if (f && fclose(f) != 0)
		fprintf(stderr, "TD_CUDA_TRACE: %s: write failed\n", t->path);
	else if (f)
		fprintf(stderr, "TD_CUDA_TRACE: %d ops to %s\n", t->n, t->path);
	trace_free(cb, t, 2 * CU_TRACE_OPS);
	cb->tr = NULL;
	cb->base.trace = NULL;
}

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
	if (!env || !*env || strcmp(env, "0") == 0) {
		const char *path = getenv("TD_CUDA_TRACE");
		if (path && *path)
			timeline_open(cb, path);
		return;
	}
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
	if (cb->tr)
		timeline_close(cb);
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
	/* cuda_ops.c's lt_tune: per product shape timed, the reference's time
	 * (cublasGemmEx's default; a residual add's, cuBLASLt's first) and the
	 * one kept, of those with the reference's bits */
	for (int i = 0; i < cb->lt_nplans; i++) {
		const struct cu_lt_plan *lp = &cb->lt_plans[i];
		if (!lp->tuned || lp->ms_ref <= 0)
			continue;
		int same = 0;
		for (int j = 0; j < lp->nalgo; j++)
			same += lp->ms[j] >= 0 && j != (lp->resid ? 0 : -1);
		const float kept = lp->chosen < 0 ? lp->ms_ref : lp->ms[lp->chosen];
		char k[24];
		snprintf(k, sizeof(k), lp->chosen < 0 ? "reference" : "cuBLASLt #%d", lp->chosen);
		fprintf(stderr, "  GEMM %c%c %dx%dx%d%s: reference %.4f ms, kept %s %.4f ms (%.3fx; "
				"%d of %d others with its bits)\n",
			lp->ta == CUBLAS_OP_N ? 'N' : 'T', lp->tb == CUBLAS_OP_N ? 'N' : 'T', lp->m, lp->n,
			lp->k, lp->out16 ? " bf16 out" : lp->resid ? " + residual" : "", lp->ms_ref, k,
			kept, lp->ms_ref / kept, same, lp->nalgo - (lp->resid ? 1 : 0));
	}
	for (int i = 0; i < 2 * CU_PROF_DEPTH; i++)
		cb->drv.cuEventDestroy(p->ev[i]);
	free(p);
	cb->prof = NULL;
	cb->base.trace = NULL;
}
