/* Attention alone: the CUDA backend's fused causal attention (bf16 mode,
 * kernels/cuda/flash.cu) forward and backward through the ops table, timed,
 * after a sanity check of its results at the timed shape. Compare with
 * tests/bench/peer_attn.py (PyTorch SDPA's flash backend), which prints the
 * same JSON fields for the same shapes: tests/gpu/device-run.sh attn runs
 * both and prints the ratios.
 *
 * A benchmark, not a test: it asserts nothing about the times. It does fail
 * (exit 1, an "error" line instead of the times) when the sanity check
 * fails, so that no time is reported for a kernel that computes something
 * else. Without a GPU (no module, no driver, no device) it says so and
 * exits 77.
 *
 *   bench_attn [--seq 2048,8192] [--hs 128,64] [--heads 32] [--kv-heads 8]
 *              [--tokens 16384] [--no-check]
 *
 * Shapes: for each T of --seq and head size HS of --hs, B = tokens / T
 * (at least 1), NH query heads sharing NKV kv heads (GQA; Llama-3-8B's 32
 * and 8 by default). Layout as the engine keeps it (kernels/cpu/ops.h):
 * q, out, dout, dq (B,T,NH,HS); k, v, dk, dv (B,T,NKV,HS); the row
 * statistics L (B,NH,T).
 *
 * What is timed is the op as training calls it in the bf16 mode
 * (train/model.c with attention fused): the forward reads q, k, v as bf16
 * twins and writes the output in bf16 only (out NULL, out16) and the row
 * statistics; the backward reads dout in fp32 (the engine's gradients are
 * fp32), out16, q, k, v and L, and writes dq, dk, dv in fp32: its time
 * includes flash_rowdot (D = rowsum(dout * out16) and dout's bf16 copy) and,
 * with GQA, flash_kv_reduce beside the two main kernels. The peer's backward
 * takes bf16 dout and writes bf16 gradients.
 *
 * FLOPs, FlashAttention's count (its benchmarks, and peer_attn.py): the
 * forward is two products of 2*T*T*HS per head, halved by the causal mask:
 * 4*B*NH*T*T*HS / 2; the backward is 2.5 times that (five such products:
 * FlashAttention-2's count, whatever a kernel recomputes — ours computes
 * seven, S and dP twice). TFLOP/s = that count / the median time.
 *
 * Timing: three warm-up calls, then n calls (n from one timed call, so that
 * a group takes ~0.2 s; 3 <= n <= 200) in 5 groups, each between a
 * gpu_sync and a monotonic clock; ms is the median of the 5 groups' mean,
 * ms_min the smallest. The calls are back to back on the backend's stream,
 * so host launch costs hide behind the kernels of the previous call.
 *
 * The sanity check (see check_forward and check_backward for the bounds,
 * derived from the kernels' arithmetic): on sampled rows of the timed
 * problem, out16 and L against a double-precision reference computed here
 * from the same bf16 q, k, v; dq on sampled query rows, dk and dv on
 * sampled key rows; D (datt's first B*NH*T floats) on every row; and every
 * output finite. Each element is held to |gpu - ref| <= bound, and the
 * largest err/bound is reported (check_worst). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/select.h"
#include "tests/bench/attn_check.h"

#define MAX_LIST 8

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* xorshift64 and Box-Muller: normals of mean 0, variance 1 (as torch.randn). */
static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double uniform01(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return ((double)(rng >> 11) + 0.5) / 9007199254740992.0;
}
static void normals(float *x, size_t n)
{
	for (size_t i = 0; i < n; i += 2) {
		double r = sqrt(-2.0 * log(uniform01())), a = 2.0 * M_PI * uniform01();
		x[i] = (float)(r * cos(a));
		if (i + 1 < n)
			x[i + 1] = (float)(r * sin(a));
	}
}

/* The problem on the device and, after the check's downloads, on the host. */
struct prob {
	struct attn_shape s;
	size_t nq, nk, nl, ndatt;
	/* device */
	gpu_bf16 *d_q16, *d_k16, *d_v16, *d_o16;
	float *d_lse, *d_dout, *d_dq, *d_dk, *d_dv, *d_datt;
	void *d_scratch;
	size_t scratch_bytes;
	/* host */
	uint16_t *q, *k, *v, *o;
	float *dout, *lse, *dr, *dq, *dk, *dv;
};

static void forward(struct gpu_backend *be, struct prob *p)
{
	const struct attn_shape *s = &p->s;
	gpu_attention_forward(be, NULL, p->d_o16, p->d_lse, NULL, p->d_q16, NULL, p->d_k16, NULL,
			      p->d_v16, s->B, s->T, s->NH, s->NKV, s->HS);
}

static void backward(struct gpu_backend *be, struct prob *p)
{
	const struct attn_shape *s = &p->s;
	gpu_attention_backward(be, p->d_dq, p->d_dk, p->d_dv, p->d_datt, p->d_dout, NULL, p->d_o16,
			       NULL, p->d_q16, NULL, p->d_k16, NULL, p->d_v16, p->d_lse, s->B, s->T,
			       s->NH, s->NKV, s->HS);
}

static void *dev(struct gpu_backend *be, size_t bytes, td_err *e)
{
	void *ptr = NULL;
	if (*e == TD_OK && (*e = gpu_alloc(be, bytes, &ptr)) != TD_OK)
		fprintf(stderr, "bench_attn: gpu_alloc(%zu bytes) failed\n", bytes);
	return ptr;
}

static void prob_free(struct gpu_backend *be, struct prob *p)
{
	const size_t f = sizeof(float), h = sizeof(gpu_bf16);
	gpu_free(be, p->d_q16, p->nq * h);
	gpu_free(be, p->d_k16, p->nk * h);
	gpu_free(be, p->d_v16, p->nk * h);
	gpu_free(be, p->d_o16, p->nq * h);
	gpu_free(be, p->d_lse, p->nl * f);
	gpu_free(be, p->d_dout, p->nq * f);
	gpu_free(be, p->d_dq, p->nq * f);
	gpu_free(be, p->d_dk, p->nk * f);
	gpu_free(be, p->d_dv, p->nk * f);
	gpu_free(be, p->d_datt, p->ndatt * f);
	gpu_free(be, p->d_scratch, p->scratch_bytes);
	be->gemm_scratch = NULL;
	be->gemm_scratch_bytes = 0;
	free(p->q), free(p->k), free(p->v), free(p->o);
	free(p->dout), free(p->lse), free(p->dr), free(p->dq), free(p->dk), free(p->dv);
	memset(p, 0, sizeof(*p));
}

/* Random q, k, v (rounded to bf16 on the device, as the engine's twins are)
 * and dout; the scratch for dout's bf16 copy (what the plan gives when q, k,
 * v come as twins: gpu_flash_scratch_bytes(..., true)). */
static td_err prob_new(struct gpu_backend *be, struct prob *p, const struct attn_shape *s)
{
	memset(p, 0, sizeof(*p));
	p->s = *s;
	p->nq = (size_t)s->B * s->T * s->NH * s->HS;
	p->nk = (size_t)s->B * s->T * s->NKV * s->HS;
	p->nl = (size_t)s->B * s->NH * s->T;
	p->ndatt = gpu_flash_datt_floats(s->B, s->T, s->NH, s->NKV, s->HS);
	p->scratch_bytes = gpu_flash_scratch_bytes(s->B, s->T, s->NH, s->NKV, s->HS, true);
	const size_t f = sizeof(float), h = sizeof(gpu_bf16);
	td_err e = TD_OK;
	p->d_q16 = dev(be, p->nq * h, &e);
	p->d_k16 = dev(be, p->nk * h, &e);
	p->d_v16 = dev(be, p->nk * h, &e);
	p->d_o16 = dev(be, p->nq * h, &e);
	p->d_lse = dev(be, p->nl * f, &e);
	p->d_dout = dev(be, p->nq * f, &e);
	p->d_dq = dev(be, p->nq * f, &e);
	p->d_dk = dev(be, p->nk * f, &e);
	p->d_dv = dev(be, p->nk * f, &e);
	p->d_datt = dev(be, p->ndatt * f, &e);
	p->d_scratch = dev(be, p->scratch_bytes, &e);
	p->dout = malloc(p->nq * f);
	float *x = malloc(p->nq * f);
	if (e != TD_OK || !p->dout || !x) {
		free(x);
		if (e == TD_OK)
			fprintf(stderr, "bench_attn: out of host memory\n");
		return e != TD_OK ? e : TD_ENOMEM;
	}
	be->gemm_scratch = p->d_scratch;
	be->gemm_scratch_bytes = p->scratch_bytes;
	/* q, k, v through an fp32 staging buffer (dq's, not yet used) */
	gpu_bf16 *dst[] = {p->d_q16, p->d_k16, p->d_v16};
	size_t n[] = {p->nq, p->nk, p->nk};
	for (int i = 0; i < 3; i++) {
		normals(x, n[i]);
		gpu_upload(be, p->d_dq, x, n[i] * f);
		gpu_bf16_round(be, dst[i], p->d_dq, n[i]);
	}
	normals(p->dout, p->nq);
	gpu_upload(be, p->d_dout, p->dout, p->nq * f);
	free(x);
	return TD_OK;
}

/* ------------------------------------------------------------- check -- */

static bool download(struct gpu_backend *be, void **host, const void *d, size_t bytes)
{
	if (!*host && !(*host = malloc(bytes))) {
		fprintf(stderr, "bench_attn: out of host memory\n");
		return false;
	}
	gpu_download(be, *host, d, bytes);
	return true;
}

/* Runs the forward and the backward once and checks them (attn_check.h). */
static td_err check_run(struct gpu_backend *be, struct prob *p, struct attn_check *cf,
			struct attn_check *cb, struct td_errbuf *eb)
{
	const size_t f = sizeof(float), h = sizeof(uint16_t);
	forward(be, p);
	backward(be, p);
	td_err e = gpu_sync(be, eb);
	if (e != TD_OK)
		return e;
	if (!download(be, (void **)&p->q, p->d_q16, p->nq * h) ||
	    !download(be, (void **)&p->k, p->d_k16, p->nk * h) ||
	    !download(be, (void **)&p->v, p->d_v16, p->nk * h) ||
	    !download(be, (void **)&p->o, p->d_o16, p->nq * h) ||
	    !download(be, (void **)&p->lse, p->d_lse, p->nl * f) ||
	    !download(be, (void **)&p->dr, p->d_datt, p->nl * f) ||
	    !download(be, (void **)&p->dq, p->d_dq, p->nq * f) ||
	    !download(be, (void **)&p->dk, p->d_dk, p->nk * f) ||
	    !download(be, (void **)&p->dv, p->d_dv, p->nk * f))
		return td_fail(eb, TD_ENOMEM, "out of host memory for the check's copies");
	struct attn_host ah = {.s = p->s, .q = p->q, .k = p->k, .v = p->v, .o = p->o,
			       .dout = p->dout, .lse = p->lse, .dr = p->dr, .dq = p->dq,
			       .dk = p->dk, .dv = p->dv};
	if (!attn_check(&ah, cf, cb))
		return td_fail(eb, TD_ENOMEM, "out of host memory for the check");
	return TD_OK;
}

/* ------------------------------------------------------------ timing -- */

struct timing {
	double ms, ms_min;
	int iters;
};

static int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static td_err time_op(struct gpu_backend *be, struct prob *p, bool bwd, struct timing *tm,
		      struct td_errbuf *eb)
{
	void (*op)(struct gpu_backend *, struct prob *) = bwd ? backward : forward;
	td_err e;
	for (int i = 0; i < 3; i++)
		op(be, p);
	if ((e = gpu_sync(be, eb)) != TD_OK)
		return e;
	double t0 = now_s();
	op(be, p);
	if ((e = gpu_sync(be, eb)) != TD_OK)
		return e;
	const double one = now_s() - t0;
	int n = one > 0 ? (int)ceil(0.2 / one) : 200;
	n = n < 3 ? 3 : n > 200 ? 200 : n;
	double g[5];
	for (int k = 0; k < 5; k++) {
		t0 = now_s();
		for (int i = 0; i < n; i++)
			op(be, p);
		if ((e = gpu_sync(be, eb)) != TD_OK)
			return e;
		g[k] = (now_s() - t0) / n * 1e3;
	}
	qsort(g, 5, sizeof(g[0]), cmp_double);
	tm->ms = g[2];
	tm->ms_min = g[0];
	tm->iters = 5 * n;
	return TD_OK;
}

/* -------------------------------------------------------------- main -- */

static int parse_list(const char *opt, const char *v, int *out, int lo, int hi)
{
	int n = 0;
	const char *at = v;
	while (*at) {
		char *end;
		long x = strtol(at, &end, 10);
		if (end == at || (*end && *end != ',') || x < lo || x > hi || n == MAX_LIST) {
			fprintf(stderr, "bench_attn: %s: '%s' is not a list of up to %d integers in %d..%d\n",
				opt, v, MAX_LIST, lo, hi);
			return -1;
		}
		out[n++] = (int)x;
		at = *end ? end + 1 : end;
	}
	if (n == 0)
		fprintf(stderr, "bench_attn: %s: empty list\n", opt);
	return n ? n : -1;
}

static void json_line(const char *dir, const struct attn_shape *s, double flop, const struct timing *tm,
		      const char *device, const struct attn_check *c, bool checked)
{
	printf("{\"name\": \"traind-flash\", \"dir\": \"%s\", \"B\": %d, \"T\": %d, \"NH\": %d, "
	       "\"NKV\": %d, \"HS\": %d, \"causal\": true, \"dtype\": \"bf16\", \"ms\": %.4f, "
	       "\"ms_min\": %.4f, \"tflops\": %.2f, \"flop\": %.6g, \"iters\": %d, \"device\": \"%s\", ",
	       dir, s->B, s->T, s->NH, s->NKV, s->HS, tm->ms, tm->ms_min, flop / (tm->ms * 1e-3) / 1e12,
	       flop, tm->iters, device);
	if (checked)
		printf("\"check\": \"ok\", \"check_worst\": %.3g, \"check_n\": %zu, ", c->worst, c->n);
	else
		printf("\"check\": \"skipped\", ");
	printf("\"io\": \"%s\"}\n",
	       strcmp(dir, "fwd") == 0
		       ? "q,k,v bf16 in; out bf16, L fp32 out"
		       : "dout fp32, out bf16, q,k,v bf16, L in; dq,dk,dv fp32 out; rowdot and GQA reduce included");
	fflush(stdout);
}

int main(int argc, char **argv)
{
	int seqs[MAX_LIST] = {2048, 8192}, hss[MAX_LIST] = {128, 64}, nseq = 2, nhs = 2;
	int NH = 32, NKV = 8, tokens = 16384;
	bool do_check = true;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--no-check") == 0) {
			do_check = false;
			continue;
		}
		if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			printf("usage: bench_attn [--seq 2048,8192] [--hs 128,64] [--heads 32] "
			       "[--kv-heads 8] [--tokens 16384] [--no-check]\n");
			return 0;
		}
		if (i + 1 >= argc) {
			fprintf(stderr, "bench_attn: %s needs a value (or unknown option)\n", a);
			return 2;
		}
		const char *v = argv[++i];
		int one[MAX_LIST];
		if (strcmp(a, "--seq") == 0) {
			if ((nseq = parse_list(a, v, seqs, 1, 1 << 20)) < 0)
				return 2;
		} else if (strcmp(a, "--hs") == 0) {
			if ((nhs = parse_list(a, v, hss, 1, 1024)) < 0)
				return 2;
		} else if (strcmp(a, "--heads") == 0 || strcmp(a, "--kv-heads") == 0 ||
			   strcmp(a, "--tokens") == 0) {
			if (parse_list(a, v, one, 1, 1 << 24) != 1) {
				fprintf(stderr, "bench_attn: %s takes one integer\n", a);
				return 2;
			}
			*(strcmp(a, "--heads") == 0 ? &NH : strcmp(a, "--tokens") == 0 ? &tokens : &NKV) = one[0];
		} else {
			fprintf(stderr, "bench_attn: unknown option %s\n", a);
			return 2;
		}
	}
	if (NH % NKV != 0) {
		fprintf(stderr, "bench_attn: --heads (%d) must be a multiple of --kv-heads (%d)\n", NH,
			NKV);
		return 2;
	}
	for (int i = 0; i < nhs; i++)
		if (!gpu_flash_head_size(hss[i])) {
			fprintf(stderr, "bench_attn: --hs %d: the fused kernels are built for 16, 32, 64, 128\n",
				hss[i]);
			return 2;
		}

	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	if (gpu_backend_open(&be, "cuda", &eb) != TD_OK) {
		fprintf(stderr, "bench_attn: SKIP: no CUDA backend: %s\n", eb.msg);
		return 77;
	}
	if (gpu_set_bf16(be, true, &eb) != TD_OK) {
		fprintf(stderr, "bench_attn: bf16 mode: %s\n", eb.msg);
		gpu_backend_free(be);
		return 1;
	}
	fprintf(stderr, "bench_attn: device %s\n", be->device);
	/* A shape whose check fails is reported and the next one runs; an error
	 * of the device (sticky: every later call would fail too) or of memory
	 * ends the run. */
	int status = 0;
	bool stop = false;
	for (int ih = 0; ih < nhs && !stop; ih++)
		for (int is = 0; is < nseq && !stop; is++) {
			struct attn_shape s = {.T = seqs[is], .NH = NH, .NKV = NKV, .HS = hss[ih]};
			s.B = tokens / s.T > 0 ? tokens / s.T : 1;
			if (!gpu_attention_flash(be, s.HS)) {
				fprintf(stderr, "bench_attn: HS %d: the backend's attention is not fused "
						"(its kernels could not get their shared memory)\n", s.HS);
				status = 1;
				continue;
			}
			struct prob p;
			struct attn_check cf = {0}, cbk = {0};
			struct timing tf = {0}, tb = {0};
			bool bad = false;
			fprintf(stderr, "bench_attn: B=%d T=%d NH=%d NKV=%d HS=%d\n", s.B, s.T, s.NH,
				s.NKV, s.HS);
			td_err e = prob_new(be, &p, &s);
			if (e == TD_OK && do_check)
				e = check_run(be, &p, &cf, &cbk, &eb);
			if (e == TD_OK && do_check) {
				fprintf(stderr,
					"bench_attn: check: forward %zu values, worst err/bound %.3g at %s; "
					"backward %zu values, worst %.3g at %s\n",
					cf.n, cf.worst, cf.what, cbk.n, cbk.worst, cbk.what);
				if (cf.bad || cbk.bad) {
					printf("{\"name\": \"traind-flash\", \"B\": %d, \"T\": %d, \"NH\": %d, "
					       "\"NKV\": %d, \"HS\": %d, \"error\": \"check failed: forward "
					       "%zu of %zu, backward %zu of %zu values off their bounds\"}\n",
					       s.B, s.T, s.NH, s.NKV, s.HS, cf.bad, cf.n, cbk.bad, cbk.n);
					fflush(stdout);
					bad = true;
				}
			}
			if (e == TD_OK && !bad)
				e = time_op(be, &p, false, &tf, &eb);
			if (e == TD_OK && !bad)
				e = time_op(be, &p, true, &tb, &eb);
			if (e != TD_OK) {
				fprintf(stderr, "bench_attn: %s\n", eb.msg[0] ? eb.msg : td_strerror(e));
				stop = bad = true;
			} else if (!bad) {
				/* FlashAttention's count (above) */
				const double fwd = 4.0 * s.B * s.NH * (double)s.T * s.T * s.HS / 2;
				json_line("fwd", &s, fwd, &tf, be->device, &cf, do_check);
				json_line("bwd", &s, 2.5 * fwd, &tb, be->device, &cbk, do_check);
			}
			if (bad)
				status = 1;
			prob_free(be, &p);
		}
	gpu_backend_free(be);
	return status;
}
