/* Data parallel on the CPU (issue 12, item 2): the gang (barriers, a rank's
 * failure reaching every other rank), the in-process all-reduce (sums in
 * rank order, the same bits on every rank and for any bucketing), and the
 * trainer with several ranks against one rank with the same spec: the same
 * global batch, data order and loss normalisation, so the first step's loss
 * is the same bits and the curve stays within float32 rounding; summing by
 * buckets during the backward (each only once its gradients are final)
 * gives the bits of one sum after it; LoRA dropout masks follow the global
 * micro-batch; a checkpoint of 2 ranks resumes on 2 (bit-identical) and on
 * 1; a rank that fails fails the job on every rank, naming it, at once.
 * With the argument "shard" (meson's ddp-shard), sharded state (issue 12,
 * item 3): reduce-scatter, all-gather, reduce onto one rank and the host
 * sum, the plan of a sharded rank, memory.shard OPTIMIZER against NONE —
 * the same bits, in training and through checkpoints resumed on 1, 2 and 3
 * ranks — and GRADIENTS and PARAMETERS against NONE: the same bits with
 * one micro-batch a rank (2, 3, 4 ranks, recompute, LoRA, a 5-layer model
 * whose slots are reused), a derived bound with more, and their
 * checkpoints resumed on 1 to 4 ranks; the plans of each at Llama-3-8B's
 * shapes.
 *
 * Every rank here is a CPU backend on a thread of this process, summing
 * through gpu/comm.h's host comm; the NCCL comm is the same interface on
 * CUDA backends (tests/gpu/ddp.sh). Uses the tiny qwen2 fixture. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "gpu/comm.h"
#include "proto/jobspec.h"
#include "tests/check.h"
#include "tests/unit/emu16.h"
#include "train/ddp.h"
#include "train/hfconfig.h"
#include "train/plan.h"
#include "train/safetensors.h"
#include "train/trainer.h"

static char tmp[256];
static const char *fx;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------ */
/* The gang */

struct gang_arg {
	struct gpu_gang *g;
	int r;
	int fail_at;     /* this rank fails before barrier fail_at (-1: never) */
	int passed;      /* barriers passed */
	td_err e;
	struct td_errbuf eb;
};

static void *gang_rank(void *p)
{
	struct gang_arg *a = p;
	for (int k = 0; k < 5; k++) {
		if (k == a->fail_at) {
			usleep(50 * 1000); /* the others are waiting by then */
			gpu_gang_fail(a->g, a->r, TD_EDEVICE, "boom");
			a->e = TD_EDEVICE;
			return NULL;
		}
		if ((a->e = gpu_gang_barrier(a->g, a->r, &a->eb)) != TD_OK)
			return NULL;
		a->passed++;
	}
	return NULL;
}

static void test_gang(void)
{
	for (int fail = -1; fail < 3; fail += 3) { /* nobody fails; rank 2 fails at barrier 2 */
		struct gpu_gang *g = NULL;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(gpu_gang_new(&g, 3, 0, &eb), TD_OK);
		struct gang_arg a[3];
		pthread_t t[3];
		for (int r = 0; r < 3; r++) {
			a[r] = (struct gang_arg){.g = g, .r = r, .fail_at = fail >= 0 && r == 2 ? 2 : -1};
			pthread_create(&t[r], NULL, gang_rank, &a[r]);
		}
		for (int r = 0; r < 3; r++)
			pthread_join(t[r], NULL);
		for (int r = 0; r < 3; r++) {
			CHECK_EQ_INT(a[r].e, fail < 0 ? TD_OK : TD_EDEVICE);
			CHECK_EQ_INT(a[r].passed, fail < 0 ? 5 : 2);
		}
		if (fail >= 0) {
			CHECK_CONTAINS(a[0].eb.msg, "rank 0 of 3 stopped: rank 2 failed: boom");
			int fr = -1;
			CHECK_EQ_INT(gpu_gang_error(g, &fr, &eb), TD_EDEVICE);
			CHECK_EQ_INT(fr, 2);
			CHECK_STR_EQ(eb.msg, "boom");
			/* A failed gang never passes a barrier again. */
			CHECK_EQ_INT(gpu_gang_barrier(g, 1, &eb), TD_EDEVICE);
		}
		gpu_gang_free(g);
	}
	struct gpu_gang *g = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_gang_new(&g, GPU_GANG_MAX + 1, 0, &eb), TD_EINVAL);
	enum gpu_comm_kind k;
	CHECK(gpu_comm_kind_parse("nccl", &k) && k == GPU_COMM_NCCL);
	CHECK(!gpu_comm_kind_parse("mpi", &k));
}

/* ------------------------------------------------------------------------ */
/* The in-process all-reduce */

enum { AR_RANKS = 3, AR_N = 1003 };

struct ar_arg {
	struct gpu_gang *g;
	int r;
	bool buckets;
	float out[AR_N];
	td_err e;
	struct td_errbuf eb;
};

static float ar_value(int r, int i)
{
	return (float)sin(0.37 * i + r) * (float)(1 + r * 1000) + (float)i * 1e-3f;
}

static void *ar_rank(void *p)
{
	struct ar_arg *a = p;
	struct gpu_backend *be = NULL;
	struct gpu_comm *c = NULL;
	float *x = NULL, host[AR_N];
	if ((a->e = gpu_cpu_backend_new(&be, &a->eb)) != TD_OK)
		return NULL;
	if ((a->e = gpu_alloc(be, AR_N * sizeof(float), (void **)&x)) == TD_OK)
		a->e = gpu_comm_new(&c, a->g, a->r, be, GPU_COMM_AUTO, &a->eb);
	if (a->e == TD_OK) {
		for (int i = 0; i < AR_N; i++)
			host[i] = ar_value(a->r, i);
		gpu_upload(be, x, host, sizeof(host));
		if (!a->buckets)
			a->e = gpu_comm_all_reduce_sum(c, x, AR_N, &a->eb);
		else /* three uneven buckets, not in order */
			if ((a->e = gpu_comm_all_reduce_sum(c, x + 500, AR_N - 500, &a->eb)) == TD_OK &&
			    (a->e = gpu_comm_all_reduce_sum(c, x + 7, 493, &a->eb)) == TD_OK)
				a->e = gpu_comm_all_reduce_sum(c, x, 7, &a->eb);
		if (a->e == TD_OK)
			a->e = gpu_comm_wait(c, &a->eb);
		gpu_download(be, a->out, x, sizeof(a->out));
	}
	gpu_comm_free(c);
	if (x)
		gpu_free(be, x, AR_N * sizeof(float));
	gpu_backend_free(be);
	return NULL;
}

static void test_all_reduce(void)
{
	static struct ar_arg a[2][AR_RANKS];
	for (int b = 0; b < 2; b++) {
		struct gpu_gang *g = NULL;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(gpu_gang_new(&g, AR_RANKS, 0, &eb), TD_OK);
		pthread_t t[AR_RANKS];
		for (int r = 0; r < AR_RANKS; r++) {
			a[b][r].g = g;
			a[b][r].r = r;
			a[b][r].buckets = b == 1;
			pthread_create(&t[r], NULL, ar_rank, &a[b][r]);
		}
		for (int r = 0; r < AR_RANKS; r++)
			pthread_join(t[r], NULL);
		gpu_gang_free(g);
	}
	int wrong = 0;
	for (int b = 0; b < 2; b++)
		for (int r = 0; r < AR_RANKS; r++) {
			CHECK_EQ_INT(a[b][r].e, TD_OK);
			for (int i = 0; i < AR_N; i++) {
				/* x0 + x1 + x2 from the left, in float: one device's
				 * accumulation of three micro-batches. */
				float want = ar_value(0, i);
				for (int k = 1; k < AR_RANKS; k++)
					want += ar_value(k, i);
				wrong += memcmp(&a[b][r].out[i], &want, sizeof(float)) != 0;
			}
		}
	CHECK_MSG(wrong == 0, "%d sums are not x0 + x1 + x2 in float, bit for bit", wrong);
}

/* Reduce-scatter and all-gather (sharded state): 3 ranks, parts of
 * RS_COUNT floats. A reduce-scatter leaves in each rank's part the bits the
 * all-reduce gives there (x0 + x1 + x2 from the left); an all-gather of
 * those parts then gives every rank the all-reduce's whole result; an
 * all-gather alone copies each rank's part, bit for bit, whatever the others
 * held there (NaN here, so a part left unwritten shows). */
enum { RS_COUNT = 337, RS_N = AR_RANKS * RS_COUNT };

struct rs_arg {
	struct gpu_gang *g;
	int r;
	float reduced[RS_N];  /* after reduce-scatter, then all-gather */
	float own[RS_COUNT];  /* this rank's part after the reduce-scatter */
	float gathered[RS_N]; /* the all-gather of parts ar_value(r, .) */
	float rooted[RS_COUNT]; /* a reduce onto rank 1 (NaN where not its) */
	double hsum;          /* gpu_comm_sum_host of r + 0.25 */
	td_err e;
	struct td_errbuf eb;
};

static void *rs_rank(void *p)
{
	struct rs_arg *a = p;
	struct gpu_backend *be = NULL;
	struct gpu_comm *c = NULL;
	float *x = NULL;
	float host[RS_N];
	if ((a->e = gpu_cpu_backend_new(&be, &a->eb)) != TD_OK)
		return NULL;
	if ((a->e = gpu_alloc(be, RS_N * sizeof(float), (void **)&x)) == TD_OK)
		a->e = gpu_comm_new(&c, a->g, a->r, be, GPU_COMM_AUTO, &a->eb);
	if (a->e == TD_OK) {
		for (int i = 0; i < RS_N; i++)
			host[i] = ar_value(a->r, i);
		gpu_upload(be, x, host, sizeof(host));
		a->e = gpu_comm_reduce_scatter_sum(c, x, RS_COUNT, &a->eb);
	}
	if (a->e == TD_OK) {
		gpu_download(be, a->own, x + (size_t)a->r * RS_COUNT, sizeof(a->own));
		a->e = gpu_comm_all_gather(c, x, RS_COUNT, &a->eb);
	}
	if (a->e == TD_OK) {
		gpu_download(be, a->reduced, x, sizeof(a->reduced));
		for (int i = 0; i < RS_N; i++)
			host[i] = i / RS_COUNT == a->r ? ar_value(a->r, i) : NAN;
		gpu_upload(be, x, host, sizeof(host));
		a->e = gpu_comm_all_gather(c, x, RS_COUNT, &a->eb);
	}
	if (a->e == TD_OK && (a->e = gpu_comm_wait(c, &a->eb)) == TD_OK)
		gpu_download(be, a->gathered, x, sizeof(a->gathered));
	/* Sharded gradients: a reduce onto rank 1, into another buffer there
	 * (the others' left as they were: NaN), and a host sum. */
	if (a->e == TD_OK) {
		for (int i = 0; i < RS_N; i++)
			host[i] = i < RS_COUNT ? ar_value(a->r, i) : NAN;
		gpu_upload(be, x, host, sizeof(host));
		a->e = gpu_comm_reduce_sum(c, x, RS_COUNT, 1, x + RS_COUNT, &a->eb);
	}
	a->hsum = a->r + 0.25;
	if (a->e == TD_OK && (a->e = gpu_comm_wait_for(c, gpu_comm_mark(c), &a->eb)) == TD_OK &&
	    (a->e = gpu_comm_sum_host(c, &a->hsum, &a->eb)) == TD_OK)
		gpu_download(be, a->rooted, x + RS_COUNT, sizeof(a->rooted));
	if (c) {
		struct gpu_comm_stats st;
		gpu_comm_stats(c, &st);
		if (a->e == TD_OK &&
		    (st.calls != 4 || st.floats != 3 * (uint64_t)RS_N + RS_COUNT || gpu_comm_mark(c) != 4))
			a->e = td_fail(&a->eb, TD_EINTERNAL, "stats: %llu calls, %llu floats",
				       (unsigned long long)st.calls, (unsigned long long)st.floats);
	}
	gpu_comm_free(c);
	if (x)
		gpu_free(be, x, RS_N * sizeof(float));
	gpu_backend_free(be);
	return NULL;
}

static void test_shard_collectives(void)
{
	static struct rs_arg a[AR_RANKS];
	struct gpu_gang *g = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_gang_new(&g, AR_RANKS, 0, &eb), TD_OK);
	pthread_t t[AR_RANKS];
	for (int r = 0; r < AR_RANKS; r++) {
		a[r].g = g;
		a[r].r = r;
		pthread_create(&t[r], NULL, rs_rank, &a[r]);
	}
	for (int r = 0; r < AR_RANKS; r++)
		pthread_join(t[r], NULL);
	gpu_gang_free(g);
	int wrong_own = 0, wrong_all = 0, wrong_gather = 0;
	for (int r = 0; r < AR_RANKS; r++) {
		CHECK_MSG(a[r].e == TD_OK, "rank %d: %s", r, a[r].eb.msg);
		for (int i = 0; i < RS_N; i++) {
			float want = ar_value(0, i); /* the all-reduce's sum, from the left */
			for (int k = 1; k < AR_RANKS; k++)
				want += ar_value(k, i);
			if (i / RS_COUNT == r)
				wrong_own += memcmp(&a[r].own[i % RS_COUNT], &want, sizeof(float)) != 0;
			wrong_all += memcmp(&a[r].reduced[i], &want, sizeof(float)) != 0;
			float part = ar_value(i / RS_COUNT, i);
			wrong_gather += memcmp(&a[r].gathered[i], &part, sizeof(float)) != 0;
		}
	}
	CHECK_MSG(wrong_own == 0, "%d floats of a rank's reduce-scattered part are not the sum", wrong_own);
	CHECK_MSG(wrong_all == 0, "%d floats of reduce-scatter + all-gather are not the all-reduce's",
		  wrong_all);
	CHECK_MSG(wrong_gather == 0, "%d floats of the all-gather are not their owner's", wrong_gather);
	int wrong_root = 0;
	for (int r = 0; r < AR_RANKS; r++) {
		for (int i = 0; i < RS_COUNT; i++) {
			float want = ar_value(0, i); /* from the left, as the all-reduce */
			for (int k = 1; k < AR_RANKS; k++)
				want += ar_value(k, i);
			wrong_root += r == 1 ? memcmp(&a[r].rooted[i], &want, sizeof(float)) != 0
					     : !isnan(a[r].rooted[i]);
		}
		/* r + 0.25 summed in rank order: exact in double */
		CHECK_MSG(a[r].hsum == 0.25 * AR_RANKS + AR_RANKS * (AR_RANKS - 1) / 2.0,
			  "rank %d: host sum %.17g", r, a[r].hsum);
	}
	CHECK_MSG(wrong_root == 0, "%d floats of the reduce onto rank 1 are wrong (or written elsewhere)",
		  wrong_root);
}

/* ------------------------------------------------------------------------ */
/* The trainer */

static void write_file(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, n, f) != n) {
		perror(path);
		exit(2);
	}
	fclose(f);
}

/* More of the data section for the next specs (an eval file): "" none. */
static const char *extra_data = "";

static Traind__JobSpec *spec_model(const char *name, const char *model, const char *hyper,
				   const char *output, const char *top)
{
	char path[512], text[4096];
	snprintf(path, sizeof(path), "%s/%s.txtpb", tmp, name);
	snprintf(text, sizeof(text),
		 "name: \"%s\"\nmodel_dir: \"%s%s%s\"\n"
		 "data { train_file: \"%s/demo/fortunes.tokens\" format: DATA_FORMAT_TOKENS seq_len: 16 %s }\n"
		 "hyper { schedule: SCHEDULE_CONSTANT lr: 1e-3 weight_decay: 0.01 seed: 7 micro_batch: 2 %s }\n"
		 "output { dir: \"%s/%s\" %s }\nresources { device: DEVICE_CPU }\n%s\n",
		 name, model[0] == '/' ? "" : fx, model[0] == '/' ? "" : "/", model, fx, extra_data, hyper,
		 tmp, name, output, top);
	write_file(path, text, strlen(text));
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = rpc_jobspec_load(&s, path, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_apply_defaults(s, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_validate(s, &eb);
	if (e != TD_OK) {
		fprintf(stderr, "spec %s: %s\n", name, eb.msg);
		exit(2);
	}
	return s;
}

/* The qwen2 fixture (tied embedding). */
static Traind__JobSpec *spec(const char *name, const char *hyper, const char *output,
			     const char *top)
{
	return spec_model(name, "qwen2", hyper, output, top);
}

#define MAX_STEPS 64

struct curve {
	int n;
	double loss[MAX_STEPS + 1], norm[MAX_STEPS + 1]; /* by step */
};

static void on_step(void *ctx, const struct tr_progress *p)
{
	struct curve *c = ctx;
	if (p->step <= MAX_STEPS) {
		c->loss[p->step] = p->loss;
		c->norm[p->step] = p->grad_norm;
		if ((int)p->step > c->n)
			c->n = (int)p->step;
	}
}

/* Trains s on `ranks` CPU ranks; TD_DDP_BUCKET_FLOATS set to buckets (0:
 * unset: one sum after the backward). */
static td_err train(const Traind__JobSpec *s, int ranks, size_t buckets, uint64_t stop_after,
		    struct curve *c, struct tr_train_result *r, struct td_errbuf *eb)
{
	char b[32];
	snprintf(b, sizeof(b), "%zu", buckets);
	if (buckets)
		setenv("TD_DDP_BUCKET_FLOATS", b, 1);
	else
		unsetenv("TD_DDP_BUCKET_FLOATS");
	struct tr_train_opts o = {.backend = "cpu", .ranks = ranks, .stop_after = stop_after};
	struct tr_hooks h = {.on_step = on_step, .ctx = c};
	td_err e = tr_train(s, &o, &h, r, eb);
	unsetenv("TD_DDP_BUCKET_FLOATS");
	return e;
}

/* Whether two outputs' weights (a model dir's model.safetensors, or a
 * LoRA job's adapter_model.safetensors) differ in any byte: 0 same, 1
 * differ, -1 missing. */
static int diff_models(const char *a, const char *b)
{
	static const char *const files[] = {"model.safetensors", "adapter_model.safetensors"};
	for (int k = 0; k < 2; k++) {
		char pa[512], pb[512];
		snprintf(pa, sizeof(pa), "%s/%s/%s", tmp, a, files[k]);
		snprintf(pb, sizeof(pb), "%s/%s/%s", tmp, b, files[k]);
		FILE *fa = fopen(pa, "rb"), *fb = fopen(pb, "rb");
		if (!fa || !fb) {
			if (fa)
				fclose(fa);
			if (fb)
				fclose(fb);
			continue;
		}
		int ca, cb, d = 0;
		do {
			ca = getc(fa);
			cb = getc(fb);
			d = ca != cb;
		} while (!d && ca != EOF);
		fclose(fa);
		fclose(fb);
		return d;
	}
	fprintf(stderr, "diff_models: no weights in %s or %s\n", a, b);
	return -1;
}

/* The bound of a loss curve trained on the same global batches with the
 * gradients summed in another order. The first step's loss is the same
 * bits: the same weights, each micro-batch's forward in the same GEMM
 * shapes, the sums of the loss in micro-batch order. From then on the
 * weights differ by rounding: a rank's gradient is its micro-batches' sum,
 * added to the others' after the backward, where one device adds each
 * micro-batch into the running sum inside every op — two orders of the same
 * float32 sum, within 2 gamma_k of its terms' magnitude (tests/check.h).
 * AdamW's first steps are lr * g / |g| (near sign(g)), so such a difference
 * moves a weight only where g is within rounding of zero — by up to lr,
 * on a weight whose gradient is rounding-sized, so the loss moves by about
 * that gradient times lr: test_train's accumulation case, which holds the
 * loss to F32_FORWARD_RTOL and the weights to 5e-5 after 2 steps. Over N
 * steps such moves add up, each step's no more than the first's: N times
 * F32_FORWARD_RTOL (20 steps: 2e-4; tests/gpu/loss_curve.sh allows 1e-3 over
 * 100 for the GPU's fp32 against the CPU, every sum reordered). */
static void check_curves(const char *what, const struct curve *ref, const struct curve *c, int steps)
{
	CHECK_EQ_INT(c->n, steps);
	CHECK_MSG(c->loss[1] == ref->loss[1], "%s: first loss %.17g, one rank %.17g", what, c->loss[1],
		  ref->loss[1]);
	double worst = 0;
	int at = 0;
	for (int s = 1; s <= steps; s++) {
		double d = fabs(c->loss[s] - ref->loss[s]) / ref->loss[s];
		if (d > worst)
			worst = d, at = s;
	}
	double bound = steps * F32_FORWARD_RTOL;
	CHECK_MSG(worst <= bound, "%s: loss differs by %.3g (relative) at step %d, bound %.3g", what,
		  worst, at, bound);
	printf("%-44s worst relative loss difference %.2e at step %d (bound %.1e)\n", what, worst, at,
	       bound);
}

static void test_curves(void)
{
	enum { STEPS = 20 };
	static const struct {
		const char *name, *model, *hyper, *top;
		int accum, ranks[3];
	} cases[] = {
		{"full", "qwen2", "", "", 2, {2, 0, 0}},
		{"full-accum4", "qwen2", "", "", 4, {2, 4, 3}}, /* 3: shares of 1, 1 and 2 */
		/* Untied: lm_head is summed after the head's backward (the fused
		 * head's: the forward), the embedding at the end. */
		{"llama-untied", "llama", "", "", 2, {2, 0, 0}},
		{"lora-dropout", "qwen2", "",
		 "method: METHOD_LORA lora { rank: 4 dropout: 0.1 target_modules: [\"q_proj\", \"v_proj\", "
		 "\"down_proj\"] }",
		 2, {2, 0, 0}},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char hyper[256], name[96];
		snprintf(hyper, sizeof(hyper), "max_steps: %d grad_accum: %d %s", STEPS, cases[i].accum,
			 cases[i].hyper);
		snprintf(name, sizeof(name), "%s-1", cases[i].name);
		Traind__JobSpec *s1 = spec_model(name, cases[i].model, hyper, "", cases[i].top);
		struct curve ref = {0};
		struct tr_train_result r;
		struct td_errbuf eb = {{0}};
		CHECK_MSG(train(s1, 1, 0, 0, &ref, &r, &eb) == TD_OK, "%s: %s", name, eb.msg);
		rpc_jobspec_free(s1);
		for (int k = 0; k < 3 && cases[i].ranks[k]; k++) {
			int n = cases[i].ranks[k];
			struct curve c[2] = {{0}};
			for (int b = 0; b < 2; b++) { /* one sum after the backward; buckets during it */
				snprintf(name, sizeof(name), "%s-%d%s", cases[i].name, n, b ? "-buckets" : "");
				Traind__JobSpec *s = spec_model(name, cases[i].model, hyper, "", cases[i].top);
				memset(&eb, 0, sizeof(eb));
				CHECK_MSG(train(s, n, b ? 1 : 0, 0, &c[b], &r, &eb) == TD_OK, "%s: %s", name,
					  eb.msg);
				CHECK_EQ_INT(r.ranks, n);
				rpc_jobspec_free(s);
				char what[128];
				snprintf(what, sizeof(what), "%s: %d ranks%s vs 1", cases[i].name, n,
					 b ? " (buckets)" : "");
				check_curves(what, &ref, &c[b], STEPS);
			}
			/* Buckets summed as they become final: the same bits. */
			int same = 1;
			for (int s = 1; s <= STEPS; s++)
				same &= c[0].loss[s] == c[1].loss[s] && c[0].norm[s] == c[1].norm[s];
			CHECK_MSG(same, "%s, %d ranks: summing by buckets during the backward changed the curve",
				  cases[i].name, n);
			char a[96], b[96];
			snprintf(a, sizeof(a), "%s-%d", cases[i].name, n);
			snprintf(b, sizeof(b), "%s-%d-buckets", cases[i].name, n);
			CHECK_EQ_INT(diff_models(a, b), 0);
		}
	}
}

/* A checkpoint of 2 ranks: resumed on 2, the same bits as never stopping;
 * on 1 (grad_accum 2: the same global batch), within the curve's bound. */
static void test_resume(void)
{
	enum { STEPS = 8 };
	const char *hyper = "max_steps: 8 grad_accum: 2";
	struct curve straight = {0}, c = {0};
	struct tr_train_result r;
	struct td_errbuf eb = {{0}};
	Traind__JobSpec *s = spec("rs-straight", hyper, "checkpoint_every: 4", "");
	CHECK_EQ_INT(train(s, 2, 0, 0, &straight, &r, &eb), TD_OK);
	rpc_jobspec_free(s);
	for (int n = 2; n >= 1; n--) {
		char name[64];
		snprintf(name, sizeof(name), "rs-on%d", n);
		s = spec(name, hyper, "checkpoint_every: 4", "");
		memset(&c, 0, sizeof(c));
		CHECK_EQ_INT(train(s, 2, 0, 3, &c, &r, &eb), TD_OK); /* stops after 3: checkpoint */
		CHECK(r.stopped);
		CHECK_EQ_INT(r.steps_done, 3);
		CHECK_MSG(train(s, n, 0, 0, &c, &r, &eb) == TD_OK, "resume on %d: %s", n, eb.msg);
		CHECK_EQ_INT(r.resumed_from, 3);
		CHECK_EQ_INT(r.steps_done, STEPS);
		rpc_jobspec_free(s);
		if (n == 2) {
			int same = 1;
			for (int k = 1; k <= STEPS; k++)
				same &= c.loss[k] == straight.loss[k];
			CHECK_MSG(same, "resumed on 2 ranks: the curve is not the uninterrupted run's");
			CHECK_EQ_INT(diff_models("rs-straight", name), 0);
		} else {
			check_curves("2-rank checkpoint resumed on 1 rank", &straight, &c, STEPS);
		}
	}
}

/* Whether two files differ in any byte (0 same, 1 differ, -1 missing). */
static int diff_files(const char *a, const char *b)
{
	FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
	int d = -1;
	if (fa && fb) {
		int ca, cb;
		do {
			ca = getc(fa);
			cb = getc(fb);
			d = ca != cb;
		} while (!d && ca != EOF);
	}
	if (fa)
		fclose(fa);
	if (fb)
		fclose(fb);
	return d;
}

#define SHARD_OPT "memory { shard: SHARD_OPTIMIZER }"

/* The plan of a sharded rank: the parts tile the trainable floats in rank
 * order, each shard_numel = ceil(trainable / ranks) long but the last
 * (clipped); the moments are shard_numel floats each, on every rank; the
 * params buffer (the trainable tensors) is padded to N parts, the frozen
 * fp32 floats unchanged; the other arenas are the unsharded plan's.
 * A sharding past the enum's is refused. */
/* The grads arena's bytes for the embedding's rows of NR tokens of C
 * (train/plan.h: embed_rows), aligned as the plan aligns its buffers. */
static size_t rows_bytes(size_t NR, size_t C)
{
	const size_t a = TR_PLAN_ALIGN;
	return (NR * C * sizeof(float) + a - 1) / a * a + (NR * sizeof(int32_t) + a - 1) / a * a;
}

static void test_shard_plan(void)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/qwen2/config.json", fx);
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_config_load(&cfg, path, &eb), TD_OK);
	struct tr_plan base;
	struct tr_plan_opts o = {.B = 2, .T = 16};
	CHECK_EQ_INT(tr_plan_build(&base, &cfg, &o, &eb), TD_OK);
	const size_t nt = base.numel_trainable;
	for (int n = 2; n <= 5; n++) {
		size_t next = 0, part = (nt + (size_t)n - 1) / (size_t)n;
		for (int r = 0; r < n; r++) {
			struct tr_plan p;
			struct tr_plan_opts so = o;
			so.shard = TR_SHARD_OPTIMIZER;
			so.shard_ranks = n;
			so.shard_rank = r;
			CHECK_EQ_INT(tr_plan_build(&p, &cfg, &so, &eb), TD_OK);
			CHECK_EQ_INT(p.shard_numel, part);
			CHECK_EQ_INT(p.shard_lo, next);
			CHECK_EQ_INT(p.shard_hi, r == n - 1 ? nt : next + part);
			next = p.shard_hi;
			CHECK_EQ_INT(p.numel_trainable_padded, part * (size_t)n);
			CHECK_EQ_INT(p.numel_f32, base.numel_f32);
			CHECK_EQ_INT(tr_plan_find(&p, "params")->bytes, part * (size_t)n * sizeof(float));
			CHECK_EQ_INT(tr_plan_find(&p, "optim.m")->bytes, part * sizeof(float));
			CHECK_EQ_INT(tr_plan_find(&p, "optim.v")->bytes, part * sizeof(float));
			CHECK_EQ_INT(tr_plan_find(&base, "optim.m")->bytes, nt * sizeof(float));
			CHECK_EQ_INT(p.arena_bytes[TR_ARENA_ACTS], base.arena_bytes[TR_ARENA_ACTS]);
			/* and the embedding's rows: every rank's B*T ids and rows of C */
			const size_t NR = (size_t)n * o.B * o.T, C = (size_t)cfg.hidden_size;
			CHECK(p.embed_rows && !base.embed_rows && !p.embed_lookup_rows);
			CHECK_EQ_INT(tr_plan_find(&p, "grads.rows")->bytes, NR * C * sizeof(float));
			CHECK_EQ_INT(tr_plan_find(&p, "grads.rows_ids")->bytes, NR * sizeof(int32_t));
			CHECK_EQ_INT(p.arena_bytes[TR_ARENA_GRADS],
				     base.arena_bytes[TR_ARENA_GRADS] + rows_bytes(NR, C));
			tr_plan_fini(&p);
		}
		CHECK_EQ_INT(next, nt);
	}
	struct tr_plan p;
	struct tr_plan_opts so = o;
	so.shard = TR_SHARD_COUNT;
	so.shard_ranks = 2;
	CHECK_EQ_INT(tr_plan_build(&p, &cfg, &so, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "unknown sharding");
	tr_plan_fini(&base);
}

/* Llama-3-8B full fine-tuning, bf16 (bf16 GEMMs, fused attention), B2 x
 * T2048 on 2 ranks, recompute FULL: the trainable floats from the shapes
 * (embedding and lm_head V x C; per layer q, o C x C, k, v C x KV, gate,
 * up, down C x I, two norms; the final norm), each sharding's plan smaller
 * than the one before it, and the state the sharding keeps per rank as
 * its part: OPTIMIZER's moments, GRADIENTS' summed gradients,
 * PARAMETERS' fp32 masters, each ceil(n / 2) floats; the MLP's backward
 * by halves of the rows. Printed beside PyTorch FSDP2's measured peak
 * (64.8 GiB a GPU, issue 12), and held to it with the weights sharded and
 * FULL_OFFLOAD (FULL's plan keeps the fp32 layer inputs too): PARAMETERS'
 * plan keeps a layer's fp32 gradients (two slots, the halves'), the
 * head's gradients and gathered weights whole (the head's bf16 weights in
 * the gradient slots' memory, over layer L - 2's gathered bf16 slot), and
 * not the embedding's fp32 copy (its lookup and gradient go by rows). */
static void test_shard_8b_plan(void)
{
	char dir[512], path[600];
	snprintf(dir, sizeof(dir), "%s/l8b", tmp);
	mkdir(dir, 0755);
	snprintf(path, sizeof(path), "%s/config.json", dir);
	const char *json =
		"{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,"
		"\"intermediate_size\":14336,\"num_hidden_layers\":32,\"num_attention_heads\":32,"
		"\"num_key_value_heads\":8,\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,"
		"\"tie_word_embeddings\":false,\"max_position_embeddings\":8192}";
	write_file(path, json, strlen(json));
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_config_load(&cfg, path, &eb), TD_OK);
	const size_t V = 128256, C = 4096, I = 14336, KV = 8 * 128, L = 32;
	const size_t nt = 2 * V * C + L * (2 * C * C + 2 * C * KV + 3 * C * I + 2 * C) + C;
	const size_t S = (nt + 1) / 2;
	size_t prev = SIZE_MAX;
	for (int k = 0; k < TR_SHARD_COUNT; k++) {
		struct tr_plan p;
		struct tr_plan_opts o = {.B = 2, .T = 2048, .gemm_bf16 = true, .attention_lse = true,
					 .recompute = TR_RECOMPUTE_FULL, .shard = (enum tr_shard)k,
					 .shard_ranks = 2, .shard_rank = 1};
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &o, &eb), TD_OK);
		CHECK_EQ_INT(p.numel_trainable, nt);
		CHECK_EQ_INT(p.shard_numel, k ? S : nt);
		if (k >= TR_SHARD_OPTIMIZER)
			CHECK_EQ_INT(tr_plan_find(&p, "optim.m")->bytes, S * sizeof(float));
		if (k >= TR_SHARD_GRADIENTS)
			CHECK_EQ_INT(tr_plan_find(&p, "grads")->bytes, S * sizeof(float));
		if (k >= TR_SHARD_PARAMETERS)
			CHECK_EQ_INT(tr_plan_find(&p, "params")->bytes, S * sizeof(float));
		/* The bf16 copy (not of the untied embedding, which no product
		 * reads): under FULL the layers' matrices in a ring of
		 * TR_COPY16_RING layers' (train/plan.h: copy16_ring), the head's
		 * and the norms' whole; none with the weights sharded (the
		 * gathers round them) */
		const size_t per = 2 * C * C + 2 * C * KV + 3 * C * I;
		const struct tr_plan_buf *c16 = tr_plan_find(&p, "scratch.params_bf16");
		CHECK_EQ_INT(p.copy16_ring, k < TR_SHARD_PARAMETERS);
		if (k < TR_SHARD_PARAMETERS)
			CHECK_EQ_INT(c16->bytes, (nt - V * C - (L - TR_COPY16_RING) * per) * 2);
		else
			CHECK(!c16);
		const size_t total = tr_plan_total_bytes(&p);
		CHECK_MSG(total < prev, "8B: %s's plan %zu is not below the one before it (%zu)",
			  tr_shard_name((enum tr_shard)k), total, prev);
		printf("8B full bf16 B2 x T2048, 2 ranks, recompute full, shard %-10s %7.2f GiB a rank "
		       "(PyTorch FSDP2 with checkpointing: 64.8 GiB peak)\n",
		       tr_shard_name((enum tr_shard)k), (double)total / (1 << 30));
		prev = total;
		/* the MLP's backward over all 4096 rows: d(h) and d(up) bf16, I
		 * wide, d(gate) written over d(h) (the three would take more
		 * scratch than the head's logits chunk, the two do not) */
		CHECK_EQ_INT(p.mlp_rows, 4096);
		CHECK(p.dh16 && !tr_plan_find(&p, "scratch.dh"));
		CHECK_EQ_INT(tr_plan_find(&p, "scratch.dh16")->bytes, 4096 * I * 2);
		CHECK_EQ_INT(tr_plan_find(&p, "scratch.dup16")->bytes, 4096 * I * 2);
		CHECK_EQ_INT(tr_plan_find(&p, "scratch.dgate16")->offset,
			     tr_plan_find(&p, "scratch.dh16")->offset);
		tr_plan_fini(&p);
	}
	/* The weights sharded with full-offload: within FSDP2's measured peak
	 * (64.8 GiB a GPU, issue 12; 64.8 * 2^30 bytes) */
	struct tr_plan p;
	struct tr_plan_opts o = {.B = 2, .T = 2048, .gemm_bf16 = true, .attention_lse = true,
				 .recompute = TR_RECOMPUTE_FULL_OFFLOAD, .shard = TR_SHARD_PARAMETERS,
				 .shard_ranks = 2, .shard_rank = 1};
	CHECK_EQ_INT(tr_plan_build(&p, &cfg, &o, &eb), TD_OK);
	const size_t total = tr_plan_total_bytes(&p);
	CHECK_MSG((double)total <= 64.8 * (1 << 30), "8B full-offload, weights sharded: %zu bytes (%.3f GiB) "
		  "a rank, over FSDP2's 64.8 GiB", total, (double)total / (1 << 30));
	printf("8B full bf16 B2 x T2048, 2 ranks, full-offload, shard parameters %7.3f GiB a rank\n",
	       (double)total / (1 << 30));
	tr_plan_fini(&p);
	/* an adapter on the MLP keeps its backward whole (its kept product and
	 * dropout are the batch's), one elsewhere takes whole rows here as
	 * full fine-tuning does (above); d(h) stays bf16 with one on down (its
	 * share added as swiglu_backward reads d(h)), except through dropout's
	 * mask (then fp32: the share added by a GEMM); d(gate) is written over
	 * d(h) only without one on down (swiglu_backward's plain kernel) */
	for (int mlp = 0; mlp < 3; mlp++) {
		struct tr_plan_opts lo = {.B = 2, .T = 2048, .gemm_bf16 = true, .attention_lse = true,
					  .lora_rank = 8, .lora_alpha = 16,
					  .lora_targets = 1u << TR_LIN_Q | (mlp ? 1u << TR_LIN_DOWN : 0),
					  .lora_dropout = mlp == 2 ? 0.1f : 0.0f};
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &lo, &eb), TD_OK);
		CHECK_EQ_INT(p.mlp_rows, 4096);
		CHECK_EQ_INT(p.dh16, mlp < 2);
		CHECK_EQ_INT(tr_plan_find(&p, "scratch.dgate16")->offset ==
				     tr_plan_find(&p, p.dh16 ? "scratch.dh16" : "scratch.dh")->offset,
			     mlp == 0);
		tr_plan_fini(&p);
	}
}

/* Whether t is its layer's MLP half's, by its name (the test's own
 * reading of train/plan.h: tr_param.gunit): post_attention_layernorm, and
 * mlp.* (the projections' weights, biases and adapters). */
static bool mlp_named(const struct tr_param *t)
{
	return t->layer >= 0 && (strstr(t->name, ".mlp.") || strstr(t->name, ".post_attention_layernorm."));
}

/* Checks that the tensors of plan p whose unit (by unit_of) is u tile [0,
 * want) of their slot (by off_of) in goffset order, each float once. */
static int tiles(const struct tr_plan *p, int u, size_t want, int (*unit_of)(const struct tr_param *),
		 size_t (*off_of)(const struct tr_param *))
{
	unsigned char *hit = calloc(want + 1, 1);
	int bad = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *t = &p->params[i];
		if (!t->trainable || unit_of(t) != u)
			continue;
		for (size_t j = 0; j < p->nparams; j++) {
			const struct tr_param *v = &p->params[j];
			if (v->trainable && unit_of(v) == u && v->goffset < t->goffset)
				bad += off_of(v) >= off_of(t);
		}
		if (off_of(t) + t->numel > want) {
			bad++;
			continue;
		}
		for (size_t f = 0; f < t->numel; f++)
			bad += hit[off_of(t) + f]++ != 0;
	}
	for (size_t f = 0; f < want; f++)
		bad += hit[f] != 1;
	free(hit);
	return bad;
}

static int gunit_of(const struct tr_param *t)
{
	return t->gunit;
}

static size_t gsoff_of(const struct tr_param *t)
{
	return t->gsoff;
}

static int wunit_of(const struct tr_param *t)
{
	return t->wunit;
}

static size_t w16off_of(const struct tr_param *t)
{
	return t->w16off;
}

/* The plan of a rank with sharded gradients, against the unsharded plan's
 * parameter table: the grads buffer is the part (shard_numel floats); each
 * decoder layer's trainable tensors are two units, its attention half's
 * (unit 2l) and its MLP half's (2l + 1, by the names: mlp_named), packed
 * into ring slot u % TR_GRAD_RING, whose size is the largest of its units'
 * trainable floats (with a ring of two: one slot the attention halves',
 * the other the MLP halves'), the others' into grads.rest; every trainable
 * float has one place in its slot (no two tensors of a unit overlap), in
 * goffset order; the grads arena is those buffers, aligned; the other
 * arenas are OPTIMIZER's. PARAMETERS gathers by layer: each layer's
 * tensors one unit, in ring slot l % TR_GRAD_RING, laid out the same way
 * (params16.*: all of them; params.*: the ones gathered in fp32). On 5
 * layers (tests/unit: deep_model's config) with and without LoRA. */
static void test_shard_grads_plan(const char *model_dir)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/config.json", model_dir);
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_config_load(&cfg, path, &eb), TD_OK);
	CHECK(cfg.num_layers > TR_GRAD_RING);
	for (int lora = 0; lora < 2; lora++) {
		struct tr_plan_opts o = {.B = 2, .T = 16};
		if (lora) {
			o.lora_rank = 4;
			o.lora_alpha = 8;
			o.lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_DOWN;
		}
		struct tr_plan base;
		CHECK_EQ_INT(tr_plan_build(&base, &cfg, &o, &eb), TD_OK);
		const int L = cfg.num_layers;
		/* unit_floats: the gradients' units; layer_floats: the gathers' */
		size_t unit_floats[132] = {0}, layer_floats[66] = {0}, rest = 0;
		size_t slot_want[TR_GRAD_RING + 1] = {0}, w16_want[TR_GRAD_RING + 1] = {0};
		const struct tr_param *emb = tr_plan_param(&base, "model.embed_tokens.weight");
		int mlp_tensors = 0;
		for (size_t i = 0; i < base.nparams; i++) {
			const struct tr_param *t = &base.params[i];
			CHECK_EQ_INT(t->gslot, -1);
			CHECK_EQ_INT(t->wslot, -1);
			if (!t->trainable)
				continue;
			if (t->layer >= 0) {
				layer_floats[t->layer] += t->numel;
				unit_floats[2 * t->layer + mlp_named(t)] += t->numel;
				mlp_tensors += mlp_named(t);
			} else {
				rest += t->numel;
			}
		}
		CHECK(mlp_tensors > 0); /* both halves have tensors, with LoRA too (down) */
		/* an untied trainable embedding has no unit: its rows go to the
		 * parts, and its lookup under PARAMETERS (train/plan.h: embed_rows) */
		const bool apart = emb->trainable && !cfg.tie_word_embeddings;
		layer_floats[L] = unit_floats[2 * L] = apart ? rest - emb->numel : rest;
		for (int u = 0; u < 2 * L; u++)
			if (unit_floats[u] > slot_want[u % TR_GRAD_RING])
				slot_want[u % TR_GRAD_RING] = unit_floats[u];
		slot_want[TR_GRAD_RING] = unit_floats[2 * L];
		for (int l = 0; l < L; l++)
			if (layer_floats[l] > w16_want[l % TR_GRAD_RING])
				w16_want[l % TR_GRAD_RING] = layer_floats[l];
		w16_want[TR_GRAD_RING] = slot_want[TR_GRAD_RING];
		/* the ring holds a layer, not two: the largest attention half and
		 * the largest MLP half (every layer alike here) */
		CHECK_EQ_INT(slot_want[0] + slot_want[1], layer_floats[0]);
		CHECK(lora || apart); /* the 5-layer model is untied */
		for (int n = 2; n <= 4; n++) {
			struct tr_plan p, po;
			struct tr_plan_opts so = o;
			so.shard = TR_SHARD_GRADIENTS;
			so.shard_ranks = n;
			so.shard_rank = n - 1;
			CHECK_EQ_INT(tr_plan_build(&p, &cfg, &so, &eb), TD_OK);
			so.shard = TR_SHARD_OPTIMIZER;
			CHECK_EQ_INT(tr_plan_build(&po, &cfg, &so, &eb), TD_OK);
			CHECK_EQ_INT(tr_plan_find(&p, "grads")->bytes, p.shard_numel * sizeof(float));
			size_t arena = (p.shard_numel * sizeof(float) + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
			CHECK_EQ_INT(p.embed_rows, emb->trainable);
			if (emb->trainable)
				arena += rows_bytes((size_t)n * o.B * o.T, (size_t)cfg.hidden_size);
			for (int k = 0; k <= TR_GRAD_RING; k++) {
				char nm[32];
				if (k < TR_GRAD_RING)
					snprintf(nm, sizeof(nm), "grads.ring.%d", k);
				else
					snprintf(nm, sizeof(nm), "grads.rest");
				const struct tr_plan_buf *b = tr_plan_find(&p, nm);
				CHECK_EQ_INT(p.grad_slot_numel[k], slot_want[k]);
				CHECK_MSG(slot_want[k] ? b && b->bytes == slot_want[k] * sizeof(float) : !b,
					  "%s: %zu bytes, want %zu floats", nm, b ? b->bytes : 0, slot_want[k]);
				arena += (slot_want[k] * sizeof(float) + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
			}
			CHECK_EQ_INT(p.arena_bytes[TR_ARENA_GRADS], arena);
			for (int a = 0; a < TR_ARENA_ALL; a++)
				if (a != TR_ARENA_GRADS)
					CHECK_EQ_INT(p.arena_bytes[a], po.arena_bytes[a]);
			/* PARAMETERS: the params arena is the part's masters and the
			 * gathered weights in per-layer slots (and their bf16
			 * rounding in the bf16 mode, where the unsharded bf16 copy of
			 * every trainable weight goes from scratch); the gradients
			 * as GRADIENTS'; the rest as GRADIENTS' */
			for (int g16 = 0; g16 < 2; g16++) {
				struct tr_plan pp, pg;
				struct tr_plan_opts sp = so;
				sp.gemm_bf16 = g16;
				sp.shard = TR_SHARD_GRADIENTS;
				CHECK_EQ_INT(tr_plan_build(&pg, &cfg, &sp, &eb), TD_OK);
				sp.shard = TR_SHARD_PARAMETERS;
				CHECK_EQ_INT(tr_plan_build(&pp, &cfg, &sp, &eb), TD_OK);
				/* fp32: the tensors gathered so — all of them, or in the
				 * bf16 mode the vectors and the embedding (the other
				 * matrices come in bf16 only) — per layer, per slot */
				size_t f32_unit[66] = {0}, f32_want[TR_GRAD_RING + 1] = {0};
				for (size_t i = 0; i < pp.nparams; i++) {
					const struct tr_param *t = &pp.params[i];
					const bool only16 = g16 && t->ndim == 2 && t != tr_plan_param(&pp, emb->name);
					CHECK_EQ_INT(tr_plan_gathered16(&pp, t), t->trainable && only16);
					/* an untied embedding: never gathered (looked up by rows) */
					const bool byrows = apart && t == tr_plan_param(&pp, emb->name);
					CHECK_EQ_INT(t->wunit < 0, !t->trainable || byrows);
					if (t->trainable && !only16 && !byrows)
						f32_unit[t->wunit] += t->numel;
				}
				for (int u = 0; u < L + 1; u++) {
					const int k = u < L ? u % TR_GRAD_RING : TR_GRAD_RING;
					f32_want[k] = f32_unit[u] > f32_want[k] ? f32_unit[u] : f32_want[k];
					CHECK_MSG(tiles(&pp, u, layer_floats[u], wunit_of, w16off_of) == 0,
						  "lora %d, %d ranks, gathered unit %d: floats misplaced in its slot",
						  lora, n, u);
				}
				for (size_t i = 0; i < pp.nparams; i++) {
					const struct tr_param *t = &pp.params[i];
					if (!t->trainable)
						continue;
					const int w = t->layer >= 0 ? t->layer
						      : apart && t == tr_plan_param(&pp, emb->name) ? -1 : L;
					CHECK_EQ_INT(t->wunit, w);
					CHECK_EQ_INT(t->wslot, w < 0 ? -1 : w < L ? w % TR_GRAD_RING : TR_GRAD_RING);
				}
				size_t want = (pp.shard_numel * sizeof(float) + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN *
					      TR_PLAN_ALIGN;
				/* the bf16 mode: params16.rest in the gradient ring's
				 * region (grads.ring), not in the params arena */
				const bool in_ring = g16 && w16_want[TR_GRAD_RING] && (slot_want[0] || slot_want[1]);
				CHECK_EQ_INT(pp.rest16_in_ring, in_ring);
				/* ... and layer L - 2's bf16 slot with it, where the
				 * head's unit has no embedding (the lookup's) */
				const int kl = L >= 2 ? (L - 2) % TR_GRAD_RING : -1;
				const bool emb_in_head = emb->trainable && !apart;
				const int late = in_ring && kl >= 0 && w16_want[kl] && !emb_in_head ? kl : -1;
				CHECK_EQ_INT(pp.rest16_slot, late);
				for (int k = 0; k <= TR_GRAD_RING; k++) {
					CHECK_EQ_INT(pp.wslot_numel[k], f32_want[k]);
					CHECK_EQ_INT(pp.wslot16_numel[k], w16_want[k]);
					want += (f32_want[k] * 4 + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
					if (g16 && w16_want[k] && !(k == TR_GRAD_RING && in_ring) && k != late)
						want += (w16_want[k] * 2 + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN *
							TR_PLAN_ALIGN;
				}
				CHECK_EQ_INT(pp.arena_bytes[TR_ARENA_PARAMS], want);
				/* ... whose bytes are the larger of the ring's and
				 * params16.rest's, the ring's slots and params16.rest
				 * each inside it, params16.rest from its start */
				size_t gwant = pg.arena_bytes[TR_ARENA_GRADS];
				if (in_ring) {
					size_t ring = 0;
					for (int k = 0; k < TR_GRAD_RING; k++)
						ring += (slot_want[k] * 4 + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN;
					const size_t r16 = (w16_want[TR_GRAD_RING] * 2 + TR_PLAN_ALIGN - 1) /
							   TR_PLAN_ALIGN * TR_PLAN_ALIGN;
					/* late: the ring's slots, then layer L - 2's bf16
					 * slot; params16.rest ends with the region */
					const size_t s16 = late >= 0 ? (w16_want[late] * 2 + TR_PLAN_ALIGN - 1) /
									   TR_PLAN_ALIGN * TR_PLAN_ALIGN
								 : 0;
					const size_t rbytes = ring + s16 > r16 ? ring + s16 : r16;
					gwant = gwant - ring + rbytes;
					const struct tr_plan_buf *rg = tr_plan_find(&pp, "grads.ring");
					const struct tr_plan_buf *r16b = tr_plan_find(&pp, "params16.rest");
					CHECK(rg && r16b && r16b->arena == TR_ARENA_GRADS && rg->arena == TR_ARENA_GRADS);
					if (rg && late >= 0) {
						char nm[32];
						snprintf(nm, sizeof(nm), "params16.ring.%d", late);
						const struct tr_plan_buf *b = tr_plan_find(&pp, nm);
						CHECK(b && b->arena == TR_ARENA_GRADS);
						/* after the gradient slots, inside the region, and
						 * under params16.rest (its gather's reason to wait) */
						CHECK_MSG(b && b->offset == rg->offset + ring &&
								  b->bytes == w16_want[late] * 2 &&
								  b->offset + b->bytes <= rg->offset + rg->bytes &&
								  r16b && r16b->offset < b->offset + b->bytes,
							  "lora %d, %d ranks: %s misplaced in grads.ring", lora, n, nm);
					}
					if (rg && r16b) {
						CHECK_EQ_INT(r16b->offset, late >= 0 ? rg->offset + rbytes - r16 : rg->offset);
						CHECK_EQ_INT(r16b->bytes, w16_want[TR_GRAD_RING] * 2);
						CHECK(r16b->bytes <= rg->bytes);
						for (int k = 0; k < TR_GRAD_RING; k++) {
							char nm[32];
							snprintf(nm, sizeof(nm), "grads.ring.%d", k);
							const struct tr_plan_buf *b = tr_plan_find(&pp, nm);
							CHECK_MSG(!slot_want[k] || (b && b->offset >= rg->offset &&
										    b->offset + b->bytes <= rg->offset + rg->bytes),
								  "%s is not inside grads.ring", nm);
						}
					}
				}
				CHECK_EQ_INT(pp.arena_bytes[TR_ARENA_GRADS], gwant);
				CHECK_EQ_INT(pp.embed_lookup_rows, apart);
				CHECK_EQ_INT(tr_plan_param(&pp, emb->name)->gslot < 0, !emb->trainable || apart);
				CHECK_EQ_INT(tr_plan_find(&pp, "params")->bytes, pp.shard_numel * sizeof(float));
				CHECK(!tr_plan_find(&pp, "scratch.params_bf16"));
				const struct tr_plan_buf *c16 = tr_plan_find(&pg, "scratch.params_bf16");
				CHECK(!g16 || c16);
				size_t c16b = c16 ? (c16->bytes + TR_PLAN_ALIGN - 1) / TR_PLAN_ALIGN * TR_PLAN_ALIGN : 0;
				CHECK_EQ_INT(pp.arena_bytes[TR_ARENA_SCRATCH] + c16b, pg.arena_bytes[TR_ARENA_SCRATCH]);
				for (int a = 0; a < TR_ARENA_ALL; a++)
					if (a != TR_ARENA_PARAMS && a != TR_ARENA_SCRATCH && a != TR_ARENA_GRADS)
						CHECK_EQ_INT(pp.arena_bytes[a], pg.arena_bytes[a]);
				tr_plan_fini(&pp);
				tr_plan_fini(&pg);
			}
			/* each unit's tensors tile [0, its floats) of its slot, each
			 * float once, a tensor after another where its goffset is */
			CHECK_EQ_INT(p.grad_units, 2 * L + 1);
			for (size_t i = 0; i < p.nparams; i++) {
				const struct tr_param *t = &p.params[i];
				if (!t->trainable)
					continue;
				const int tu = t->layer >= 0 ? 2 * t->layer + mlp_named(t)
					       : apart && t == tr_plan_param(&p, emb->name) ? -1 : 2 * L;
				CHECK_EQ_INT(t->gunit, tu);
				CHECK_EQ_INT(t->gslot, tu < 0 ? -1 : tu < 2 * L ? tu % TR_GRAD_RING : TR_GRAD_RING);
				CHECK_EQ_INT(tr_plan_mlp_half(t), mlp_named(t));
			}
			for (int u = 0; u < 2 * L + 1; u++)
				CHECK_MSG(tiles(&p, u, unit_floats[u], gunit_of, gsoff_of) == 0,
					  "lora %d, %d ranks, unit %d: floats misplaced in its slot", lora, n, u);
			tr_plan_fini(&p);
			tr_plan_fini(&po);
		}
		tr_plan_fini(&base);
	}
}

/* memory.shard OPTIMIZER against NONE on the same ranks: the same bits.
 * Each rank keeps the moments of its part of the trainable floats and steps
 * that part; the gradients are the same all-reduced sums (the host comm's,
 * in rank order), the norm and clipping read them whole as before, AdamW is
 * elementwise (each float's update reads only that float's weight,
 * gradient and moments, and the same scalars), and the all-gather copies
 * the parts: so every weight and moment, every loss and norm is the
 * unsharded run's, bit for bit. Cases: an even split, 3 ranks of a
 * trainable count that 3 may not divide (the padding), an untied head, and
 * LoRA (a tiny trainable set: a part may be empty). */
static void test_shard_optimizer(void)
{
	enum { STEPS = 10 };
	static const struct {
		const char *name, *model, *top;
		int accum, ranks;
	} cases[] = {
		{"zo-full", "qwen2", "", 2, 2},
		{"zo-full3", "qwen2", "", 3, 3},
		{"zo-llama", "llama", "", 2, 2},
		{"zo-lora", "qwen2",
		 "method: METHOD_LORA lora { rank: 4 dropout: 0.1 target_modules: [\"q_proj\", \"v_proj\"] }",
		 4, 4},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char hyper[128], top[512], name[2][96];
		/* clip_norm 0.01: every step clips, so the scaled gradients are what AdamW reads */
		snprintf(hyper, sizeof(hyper), "max_steps: %d grad_accum: %d clip_norm: 0.01", STEPS,
			 cases[i].accum);
		struct curve c[2] = {{0}};
		for (int sh = 0; sh < 2; sh++) {
			snprintf(name[sh], sizeof(name[sh]), "%s-%s", cases[i].name, sh ? "opt" : "none");
			snprintf(top, sizeof(top), "%s\n%s", cases[i].top,
				 sh ? SHARD_OPT : "memory { shard: SHARD_NONE }");
			Traind__JobSpec *s = spec_model(name[sh], cases[i].model, hyper, "", top);
			struct tr_train_result r;
			struct td_errbuf eb = {{0}};
			CHECK_MSG(train(s, cases[i].ranks, 0, 0, &c[sh], &r, &eb) == TD_OK, "%s: %s", name[sh],
				  eb.msg);
			CHECK_EQ_INT(r.ranks, cases[i].ranks);
			rpc_jobspec_free(s);
		}
		CHECK_EQ_INT(c[1].n, STEPS);
		int same = c[0].n == c[1].n;
		for (int k = 1; k <= STEPS; k++)
			same &= c[0].loss[k] == c[1].loss[k] && c[0].norm[k] == c[1].norm[k];
		CHECK_MSG(same, "%s: the sharded optimizer's curve (losses, norms) is not NONE's", cases[i].name);
		CHECK_MSG(c[1].norm[1] > 0.01, "%s: step 1's norm %g does not clip", cases[i].name,
			  c[1].norm[1]);
		CHECK_EQ_INT(diff_models(name[0], name[1]), 0);
		printf("%-12s %d ranks, shard optimizer: %d steps, weights and curve NONE's bits\n",
		       cases[i].name, cases[i].ranks, STEPS);
	}
}

/* A model dir of the llama fixture's shapes with `layers` decoder layers
 * (its layers' weights repeated: layer l is layer l % 2's), in dir: deeper
 * than the fixtures' two, so that a ring slot of sharded gradients is
 * used again (train/plan.h: TR_GRAD_RING). */
static void deep_model(const char *dir, int layers)
{
	char src[512], dst[512];
	mkdir(dir, 0755);
	snprintf(src, sizeof(src), "%s/llama/config.json", fx);
	FILE *f = fopen(src, "rb");
	static char text[8192];
	size_t n = f ? fread(text, 1, sizeof(text) - 1, f) : 0;
	if (f)
		fclose(f);
	text[n] = 0;
	char *at = strstr(text, "\"num_hidden_layers\": 2,");
	if (!at) {
		fprintf(stderr, "deep_model: %s has no \"num_hidden_layers\": 2\n", src);
		exit(2);
	}
	at[strlen("\"num_hidden_layers\": ")] = (char)('0' + layers);
	snprintf(dst, sizeof(dst), "%s/config.json", dir);
	write_file(dst, text, n);
	snprintf(src, sizeof(src), "%s/llama/model.safetensors", fx);
	struct tr_st_file *st = NULL;
	struct td_errbuf eb = {{0}};
	if (tr_st_open(&st, src, &eb) != TD_OK) {
		fprintf(stderr, "deep_model: %s\n", eb.msg);
		exit(2);
	}
	size_t cnt = tr_st_count(st);
	struct tr_st_entry *es = calloc(cnt * (size_t)layers, sizeof(*es));
	char(*names)[128] = calloc(cnt * (size_t)layers, sizeof(*names));
	size_t k = 0;
	for (size_t i = 0; i < cnt; i++) {
		const struct tr_st_tensor *t = tr_st_at(st, i);
		int l = -1, used = 0;
		if (sscanf(t->name, "model.layers.%d.%n", &l, &used) == 1 && used > 0) {
			for (int m = l; m < layers; m += 2) {
				snprintf(names[k], sizeof(names[k]), "model.layers.%d.%s", m, t->name + used);
				es[k] = (struct tr_st_entry){names[k], t->dtype, t->ndim, {0}, t->data};
				memcpy(es[k].shape, t->shape, sizeof(es[k].shape));
				k++;
			}
			continue;
		}
		snprintf(names[k], sizeof(names[k]), "%s", t->name);
		es[k] = (struct tr_st_entry){names[k], t->dtype, t->ndim, {0}, t->data};
		memcpy(es[k].shape, t->shape, sizeof(es[k].shape));
		k++;
	}
	snprintf(dst, sizeof(dst), "%s/model.safetensors", dir);
	if (tr_st_write(dst, es, k, NULL, &eb) != TD_OK) {
		fprintf(stderr, "deep_model: %s\n", eb.msg);
		exit(2);
	}
	tr_st_close(st);
	free(es);
	free(names);
}

#define SHARD_GRADS "memory { shard: SHARD_GRADIENTS }"

/* memory.shard GRADIENTS against NONE on the same ranks. Each rank's
 * backward writes a micro-batch's gradients into work buffers that are
 * summed onto their owners' parts (train/ddp.h): where every rank runs one
 * micro-batch of the step (grad_accum = ranks), each sum is the host
 * all-reduce's, x0 + x1 + ... in rank order (the owner's term its
 * gradient plus its zero part: exact), so the losses, the weights and a
 * checkpoint's moments are NONE's bits. The norm is the square root of the
 * parts' sums of squares added in rank order, where NONE sums all of them
 * in one order (kernels/cpu/ops.c: sumsq, four double partials): each
 * square is exact in double (24-bit significands), and two orders of a sum
 * of n non-negative doubles differ by at most 2 gamma_n (double) of it,
 * so the norms by gamma_n + a rounding of the square root:
 * (n + 1) * 2^-53 relative, n the trainable floats. The clip factor is
 * rounded to float from them, so the weights stay NONE's bits unless that
 * difference straddles a float rounding boundary (a 1e-9 chance at this
 * n; it would show as a weight difference here, never silently).
 * Where ranks run more micro-batches than one (grad_accum > ranks, and
 * shares that differ: a short rank runs an empty round), a micro-batch's
 * sums come before the next one's instead of after each rank's own
 * accumulation: another order of the step's float sum, check_curves'
 * bound against NONE. Cases: 2, 3 and 4 ranks, a 5-layer model (its ring
 * slots reused, lm_head and the embedding untied), recompute FULL,
 * SELECTIVE and FULL_OFFLOAD, LoRA with dropout, a tied head. */
/* The spec text of sharding k's memory section: "memory { shard: SHARD_K }". */
static const char *shard_text(enum tr_shard k)
{
	return k == TR_SHARD_PARAMETERS ? "memory { shard: SHARD_PARAMETERS }" : SHARD_GRADS;
}

/* src with "SHARD_GRADIENTS" replaced by sharding k's name (and a case
 * name's "zg" by "zp" for PARAMETERS), into out. */
static void as_shard(char *out, size_t cap, const char *src, enum tr_shard k)
{
	const char *sp = strstr(src, "SHARD_GRADIENTS");
	if (k == TR_SHARD_PARAMETERS && sp)
		snprintf(out, cap, "%.*sSHARD_PARAMETERS%s", (int)(sp - src), src, sp + 15);
	else if (k == TR_SHARD_PARAMETERS && strncmp(src, "zg", 2) == 0)
		snprintf(out, cap, "zp%s", src + 2);
	else
		snprintf(out, cap, "%s", src);
}

/* The same for PARAMETERS (test_shard_sharded(deep, TR_SHARD_PARAMETERS)):
 * each rank also keeps only its part of the fp32 weights, and each unit's
 * weights are broadcast from their owners into the ring before each use,
 * forward and backward — exact copies of the masters that an unsharded
 * run holds, so the same cases are NONE's bits (or within the same bound)
 * again; the checkpoint's model.safetensors is written from the weights
 * gathered to rank 0. */
static void test_shard_gradients(const char *deep, enum tr_shard kind)
{
	enum { STEPS = 6 };
	static const struct {
		const char *name, *model, *top;
		int accum, ranks;
	} cases[] = {
		{"zg-full", "qwen2", "", 2, 2},
		{"zg-full3", "qwen2", "", 3, 3},
		{"zg-deep", NULL, "", 2, 2},
		{"zg-deep-full", NULL, "memory { recompute: RECOMPUTE_FULL shard: SHARD_GRADIENTS }", 3, 3},
		{"zg-deep-sel", NULL, "memory { recompute: RECOMPUTE_SELECTIVE shard: SHARD_GRADIENTS }", 2, 2},
		{"zg-deep-off", NULL, "memory { recompute: RECOMPUTE_FULL_OFFLOAD shard: SHARD_GRADIENTS }", 2, 2},
		{"zg-lora", "qwen2",
		 "method: METHOD_LORA lora { rank: 4 dropout: 0.1 target_modules: [\"q_proj\", \"v_proj\"] }",
		 4, 4},
		{"zg-deep-lora", NULL,
		 "method: METHOD_LORA lora { rank: 4 target_modules: [\"q_proj\", \"down_proj\"] }", 2, 2},
		/* more micro-batches than ranks: a bound, not the bits */
		{"zg-accum5", NULL, "", 5, 2},
		{"zg-accum7", "qwen2", "", 7, 3},
		{"zg-accum6-full", NULL, "memory { recompute: RECOMPUTE_FULL shard: SHARD_GRADIENTS }", 6, 4},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char hyper[160], top[512], name[2][96];
		const bool exact = cases[i].accum == cases[i].ranks;
		const char *model = cases[i].model ? cases[i].model : deep;
		/* clip_norm 0.01: every step clips, so the scaled gradients are what AdamW reads */
		snprintf(hyper, sizeof(hyper), "max_steps: %d grad_accum: %d clip_norm: 0.01", STEPS,
			 cases[i].accum);
		struct curve c[2] = {{0}};
		size_t nt = 0;
		char cname[64], memk[512];
		as_shard(cname, sizeof(cname), cases[i].name, kind);
		as_shard(memk, sizeof(memk), cases[i].top, kind);
		for (int sh = 0; sh < 2; sh++) {
			snprintf(name[sh], sizeof(name[sh]), "%s-%s", cname, sh ? tr_shard_name(kind) : "none");
			const char *mem = memk;
			char none_top[512];
			/* NONE: the case's memory section with the sharding NONE */
			snprintf(none_top, sizeof(none_top), "%s", mem);
			char *sp = strstr(none_top, "SHARD_GRADIENTS");
			if (!sp)
				sp = strstr(none_top, "SHARD_PARAMETERS");
			if (sp)
				memcpy(sp, "SHARD_NONE     ", 15), sp[15] = sp[15] == 'S' ? ' ' : sp[15];
			if (sh)
				snprintf(top, sizeof(top), "%s\n%s", mem,
					 strstr(mem, "memory") ? "" : shard_text(kind));
			else
				snprintf(top, sizeof(top), "%s\n%s", none_top,
					 strstr(mem, "memory") ? "" : "memory { shard: SHARD_NONE }");
			Traind__JobSpec *s = spec_model(name[sh], model, hyper, exact ? "checkpoint_every: 5" : "",
							top);
			struct tr_train_result r;
			struct td_errbuf eb = {{0}};
			CHECK_MSG(train(s, cases[i].ranks, 0, 0, &c[sh], &r, &eb) == TD_OK, "%s: %s", name[sh],
				  eb.msg);
			CHECK_EQ_INT(r.ranks, cases[i].ranks);
			rpc_jobspec_free(s);
		}
		{
			/* n: the trainable floats, from the plan of the case's model */
			char path[512];
			snprintf(path, sizeof(path), "%s%s%s/config.json", model[0] == '/' ? "" : fx,
				 model[0] == '/' ? "" : "/", model);
			struct tr_model_config cfg;
			struct td_errbuf eb = {{0}};
			struct tr_plan p;
			struct tr_plan_opts o = {.B = 2, .T = 16};
			if (strstr(cases[i].top, "LORA")) {
				o.lora_rank = 4;
				o.lora_alpha = 8;
				o.lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_V | 1u << TR_LIN_DOWN;
			}
			CHECK_EQ_INT(tr_config_load(&cfg, path, &eb), TD_OK);
			CHECK_EQ_INT(tr_plan_build(&p, &cfg, &o, &eb), TD_OK);
			nt = p.numel_trainable; /* LoRA: at least this case's adapters */
			tr_plan_fini(&p);
		}
		CHECK_EQ_INT(c[1].n, STEPS);
		CHECK_MSG(c[1].norm[1] > 0.01, "%s: step 1's norm %g does not clip", cname,
			  c[1].norm[1]);
		if (!exact) {
			char what[96];
			snprintf(what, sizeof(what), "%s: %d ranks, accum %d", cname, cases[i].ranks,
				 cases[i].accum);
			check_curves(what, &c[0], &c[1], STEPS);
			continue;
		}
		const double nbound = (double)(nt + 1) * 0x1p-53;
		int same = c[0].n == c[1].n;
		double worst = 0;
		for (int k = 1; k <= STEPS; k++) {
			same &= c[0].loss[k] == c[1].loss[k];
			double d = fabs(c[0].norm[k] - c[1].norm[k]) / c[0].norm[k];
			worst = d > worst ? d : worst;
		}
		CHECK_MSG(same, "%s: the sharded run's losses are not NONE's", cname);
		CHECK_MSG(worst <= nbound, "%s: the norms differ by %.3g (relative), bound %.3g",
			  cname, worst, nbound);
		CHECK_EQ_INT(diff_models(name[0], name[1]), 0);
		static const char *const files[] = {"model.safetensors", "adapter_model.safetensors",
						    "optimizer.safetensors"};
		int compared = 0;
		for (int f = 0; f < 3; f++) {
			char a[512], b[512];
			snprintf(a, sizeof(a), "%s/%s/checkpoints/step-00000005/%s", tmp, name[0], files[f]);
			snprintf(b, sizeof(b), "%s/%s/checkpoints/step-00000005/%s", tmp, name[1], files[f]);
			struct stat st;
			if (stat(a, &st) != 0)
				continue;
			compared++;
			CHECK_MSG(diff_files(a, b) == 0, "%s: the checkpoint's %s is not NONE's", cname,
				  files[f]);
		}
		CHECK_EQ_INT(compared, 2);
		printf("%-16s %d ranks, shard %s: %d steps, weights, losses and checkpoint NONE's "
		       "bits; norms within %.1e (worst %.1e)\n",
		       cname, cases[i].ranks, tr_shard_name(kind), STEPS, nbound, worst);
	}
}

/* A checkpoint of sharded gradients is one device's: a 2-rank GRADIENTS
 * run (grad_accum 6: three micro-batches a rank, each summed) stopped at
 * step 3 resumes on 1, 2, 3 and 4 ranks, GRADIENTS (on 1: unsharded) and
 * OPTIMIZER, each rank reading its part of the moments. On 2 ranks
 * GRADIENTS the curve and the weights are the uninterrupted run's bits
 * (contract 6); elsewhere the sums' order follows the ranks and the
 * sharding: check_curves' bound. On the 5-layer model. The same for a
 * PARAMETERS checkpoint (kind), resumed as PARAMETERS and OPTIMIZER. */
static void test_shard_grads_resume(const char *deep, enum tr_shard kind)
{
	enum { STEPS = 8 };
	const char *hyper = "max_steps: 8 grad_accum: 6";
	struct curve straight = {0};
	struct tr_train_result r;
	struct td_errbuf eb = {{0}};
	const char *pre = kind == TR_SHARD_PARAMETERS ? "zpr" : "zgr";
	char straight_name[32];
	snprintf(straight_name, sizeof(straight_name), "%s-straight", pre);
	Traind__JobSpec *s = spec_model(straight_name, deep, hyper, "checkpoint_every: 4", shard_text(kind));
	CHECK_MSG(train(s, 2, 0, 0, &straight, &r, &eb) == TD_OK, "straight: %s", eb.msg);
	rpc_jobspec_free(s);
	for (int n = 1; n <= 4; n++)
		for (int opt = 0; opt < 2; opt++) {
			if (n == 1 && opt)
				continue;
			char name[64];
			snprintf(name, sizeof(name), "%s-on%d%s", pre, n, opt ? "-opt" : "");
			s = spec_model(name, deep, hyper, "checkpoint_every: 4", shard_text(kind));
			struct curve c = {0};
			memset(&eb, 0, sizeof(eb));
			CHECK_MSG(train(s, 2, 0, 3, &c, &r, &eb) == TD_OK, "%s: %s", name, eb.msg);
			CHECK_EQ_INT(r.steps_done, 3);
			rpc_jobspec_free(s);
			/* the same output dir, resumed with the other settings */
			s = spec_model(name, deep, hyper, "checkpoint_every: 4", opt ? SHARD_OPT : shard_text(kind));
			CHECK_MSG(train(s, n, 0, 0, &c, &r, &eb) == TD_OK, "%s: resume on %d: %s", name, n,
				  eb.msg);
			CHECK_EQ_INT(r.resumed_from, 3);
			CHECK_EQ_INT(r.steps_done, STEPS);
			rpc_jobspec_free(s);
			if (n == 2 && !opt) {
				int same = 1;
				for (int k = 1; k <= STEPS; k++)
					same &= c.loss[k] == straight.loss[k];
				CHECK_MSG(same, "resumed on 2 ranks: the curve is not the uninterrupted run's");
				CHECK_EQ_INT(diff_models(straight_name, name), 0);
			} else {
				char what[96];
				snprintf(what, sizeof(what), "%s 2-rank checkpoint on %d%s", tr_shard_name(kind), n,
					 opt ? " (optimizer)" : "");
				check_curves(what, &straight, &c, STEPS);
			}
		}
}

/* The bf16 mode's paths of sharded weights on CPU ranks that play the
 * CUDA backend's bf16 mode (tests/unit/emu16.h: bf16 GEMM operands, and a
 * check that every bf16 twin passed beside its fp32 tensor is that tensor
 * rounded — a stale twin is a violation): each rank a model of the 5-layer
 * model (recompute full, and none: GRADIENTS then keeps its part's masters
 * only, plan.masters_part; fused attention), driven as the trainer drives it
 * (micro_begin, the forward with the head's backward fused, the backward,
 * micro_end, finish, the ranks' norm, clip, AdamW, the gather), 3 steps of
 * one micro-batch a rank, full fine-tuning and LoRA, under each sharding.
 * PARAMETERS' GEMMs read the matrices their owners round and broadcast in
 * bf16 (the norms gathered in fp32); the others' the bf16 copy AdamW
 * writes with each weight, or (a full fine-tune: copy16_ring) the layer's
 * matrices rounded into their ring slot before its use: the same rounding
 * of the same floats, so the losses and norms of every step are the same
 * bits where the same sums are made (GRADIENTS and PARAMETERS; NONE and
 * OPTIMIZER), and no twin is stale. */
enum { EM_MAX_RANKS = 4, EM_STEPS = 3 };

struct em_arg {
	struct gpu_gang *g;
	const char *dir;
	enum tr_shard shard;
	int r, ranks;
	bool lora;
	double loss[EM_STEPS], norm[EM_STEPS];
	bool ring;    /* the plan's copy16_ring */
	bool full;    /* recompute FULL (else NONE) */
	bool masters; /* the plan's masters_part */
	bool whole16; /* and its bf16 copy from float 0, the parts even */
	size_t piece;   /* tr_ddp_step's pieces (0: its default) */
	size_t pieces;  /* how many a part took (masters_part) */
	int layers;
	td_err e;
	struct td_errbuf eb;
};

static void *em_rank(void *p)
{
	struct em_arg *a = p;
	struct gpu_backend *be = NULL;
	struct gpu_comm *c = NULL;
	struct tr_model *m = NULL;
	struct tr_ddp *d = NULL;
	struct tr_model_config cfg;
	char path[600];
	snprintf(path, sizeof(path), "%s/config.json", a->dir);
	if ((a->e = tr_config_load(&cfg, path, &a->eb)) != TD_OK ||
	    (a->e = emu16_flash_backend_new(&be, &a->eb)) != TD_OK ||
	    (a->e = gpu_set_bf16(be, true, &a->eb)) != TD_OK)
		goto out;
	struct tr_plan_opts o = {.B = 2, .T = 16, .gemm_bf16 = true,
				 .recompute = a->full ? TR_RECOMPUTE_FULL : TR_RECOMPUTE_NONE,
				 .shard = a->shard, .shard_ranks = a->ranks, .shard_rank = a->r};
	if (a->lora) {
		o.lora_rank = 4;
		o.lora_alpha = 8;
		o.lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_DOWN;
	}
	if ((a->e = tr_model_new(&m, be, &cfg, &o, &a->eb)) != TD_OK)
		goto out;
	const struct tr_plan *pl = tr_model_plan(m);
	a->ring = pl->copy16_ring;
	a->masters = pl->masters_part;
	a->whole16 = pl->masters_part && !pl->copy16_lo && pl->shard_numel % 2 == 0;
	a->layers = pl->cfg.num_layers;
	for (size_t i = 0; i < pl->nparams && a->e == TD_OK; i++) { /* every rank the same weights */
		const struct tr_param *t = &pl->params[i];
		float *h = malloc(t->numel * sizeof(float));
		for (size_t k = 0; k < t->numel; k++)
			h[k] = t->ndim == 1 ? 1.0f + 0.01f * (float)((k * 7 + i) % 13)
					    : 0.02f * (float)((int)((k * 2654435761u + i * 97) % 2001) - 1000) / 1000.0f;
		a->e = tr_model_set_param(m, t, h);
		free(h);
	}
	if (a->e != TD_OK || (a->e = gpu_comm_new(&c, a->g, a->r, be, GPU_COMM_HOST, &a->eb)) != TD_OK ||
	    (a->e = tr_ddp_new(&d, m, c, 0, false, &a->eb)) != TD_OK)
		goto out;
	tr_ddp_set_step_piece(d, a->piece);
	if (a->piece)
		a->pieces = (pl->shard_numel + (a->piece + 63) / 64 * 64 - 1) / ((a->piece + 63) / 64 * 64);
	int32_t ids[2 * 16];
	const struct tr_adamw hp = {0.9f, 0.999f, 1e-8f, 0.01f};
	for (int s = 0; s < EM_STEPS && a->e == TD_OK; s++) {
		for (int k = 0; k < 2 * 16; k++) /* this rank's tokens of step s */
			ids[k] = (int32_t)((k * 31 + s * 17 + a->r * 101) % cfg.vocab_size);
		const float dloss = 1.0f / (float)(a->ranks * 2 * 15);
		double ls, norm;
		int64_t nv;
		tr_model_zero_grad(m);
		if ((a->e = tr_ddp_micro_begin(d, &a->eb)) != TD_OK)
			break;
		tr_model_fuse_head_backward(m, dloss);
		if ((a->e = tr_model_forward(m, ids, ids, &ls, &nv, &a->eb)) != TD_OK)
			break;
		tr_model_backward(m, dloss);
		if ((a->e = tr_ddp_micro_end(d, &a->eb)) != TD_OK || (a->e = tr_ddp_finish(d, &a->eb)) != TD_OK ||
		    (a->e = tr_ddp_grad_norm(d, &norm, &a->eb)) != TD_OK)
			break;
		tr_model_clip_grads_by(m, 0.01, norm);
		/* the trainer's way (AdamW with its gathers, in pieces), or the
		 * whole part stepped and then gathered */
		if (a->piece) {
			a->e = tr_ddp_step(d, &hp, 1e-3f, s + 1, &a->eb);
		} else {
			tr_model_adamw(m, &hp, 1e-3f, s + 1);
			a->e = tr_ddp_gather_params(d, &a->eb);
		}
		if (a->e != TD_OK)
			break;
		a->loss[s] = ls;
		a->norm[s] = norm;
	}
out:
	if (a->e != TD_OK)
		gpu_gang_fail(a->g, a->r, a->e, a->eb.msg);
	tr_ddp_free(d);
	gpu_comm_free(c);
	tr_model_free(m);
	gpu_backend_free(be);
	return NULL;
}

/* The embedding's gradient by rows (train/ddp.h: tr_ddp_arm), element by
 * element against the same float sums made on the host. Each rank a CPU
 * model (B2 x T8, the same synthetic weights), driven as the trainer
 * drives it for one step of A micro-batches over R ranks (tr_ddp_share;
 * sharded gradients: ceil(A / R) rounds, a short share's last empty);
 * then the summed gradient of the embedding — whole on every rank
 * unsharded, else the parts put together — against the host's sums of
 * what one unsharded model gives for each micro-batch alone: its head's
 * part of a tied table (the backward with the rows left to the caller:
 * the table then holds only the head's GEMM) and its d(res[0]) rows.
 * The host adds them in the order the ranks must:
 *   sharded gradients: each round, a tied table's head parts reduced onto
 *     each float's owner in rank order (the owner's term its own plus its
 *     running part), then every rank's rows of the round in rank order
 *     (an empty round's: id 0, zeros);
 *   unsharded: each rank scatters its earlier micro-batches' rows into its
 *     own table, the tables are summed in rank order (an untied one only
 *     where a rank ran more than one micro-batch), then every rank's last
 *     rows in rank order; a tied table's head parts summed before them.
 * These are the same float operations, so the result must be the same
 * bits. Unsharded, tied, with more than one micro-batch a rank, a rank's
 * table is its head GEMMs added into the running table (beta 1), which no
 * host sum of H repeats: that rank's sequence is replayed on the reference
 * model instead (the same ops in the same order) and its table summed. Ids repeat within
 * and across ranks, and the parts' boundaries
 * are reported where they cut an embedding row (one case must). Each
 * micro-batch's loss is the reference's bits (PARAMETERS: the lookup by
 * rows). */
struct er_arg {
	struct gpu_gang *g;
	const struct tr_model_config *cfg;
	enum tr_shard shard;
	int r, R, A;
	const int32_t *ids;   /* A micro-batches of 16 */
	float *out;           /* the embedding's summed gradient (every float once) */
	float *whole;         /* unsharded: this rank's copy, to compare between ranks */
	double loss[16];
	size_t lo, hi;        /* the part's floats of the embedding [lo, hi) */
	td_err e;
	struct td_errbuf eb;
};

enum { ER_B = 2, ER_T = 8, ER_N = ER_B * ER_T };

static void er_weights(struct tr_model *m, td_err *e)
{
	const struct tr_plan *pl = tr_model_plan(m);
	for (size_t i = 0; i < pl->nparams && *e == TD_OK; i++) {
		const struct tr_param *t = &pl->params[i];
		float *h = malloc(t->numel * sizeof(float));
		for (size_t k = 0; k < t->numel; k++)
			h[k] = t->ndim == 1 ? 1.0f + 0.01f * (float)((k * 7 + i) % 13)
					    : 0.05f * (float)((int)((k * 2654435761u + i * 97) % 2001) - 1000) / 1000.0f;
		*e = tr_model_set_param(m, t, h);
		free(h);
	}
}

static void *er_rank(void *p)
{
	struct er_arg *a = p;
	struct gpu_backend *be = NULL;
	struct gpu_comm *c = NULL;
	struct tr_model *m = NULL;
	struct tr_ddp *d = NULL;
	struct tr_plan_opts o = {.B = ER_B, .T = ER_T, .shard = a->shard, .shard_ranks = a->R,
				 .shard_rank = a->r};
	if ((a->e = gpu_cpu_backend_new(&be, &a->eb)) != TD_OK ||
	    (a->e = tr_model_new(&m, be, a->cfg, &o, &a->eb)) != TD_OK)
		goto out;
	er_weights(m, &a->e);
	if (a->e != TD_OK || (a->e = gpu_comm_new(&c, a->g, a->r, be, GPU_COMM_HOST, &a->eb)) != TD_OK ||
	    (a->e = tr_ddp_new(&d, m, c, 0, false, &a->eb)) != TD_OK)
		goto out;
	tr_ddp_set_accum(d, a->A);
	int a0, a1;
	tr_ddp_share(a->A, a->R, a->r, &a0, &a1);
	const bool gr = tr_ddp_sharded_grads(d);
	const int rounds = gr ? (a->A + a->R - 1) / a->R : a1 - a0;
	const float dloss = 1.0f / (float)(a->A * ER_N);
	tr_model_zero_grad(m);
	for (int k = 0; k < rounds && a->e == TD_OK; k++) {
		const int mb = a0 + k;
		if (mb >= a1) {
			a->e = tr_ddp_micro_empty(d, &a->eb);
			continue;
		}
		if (gr && (a->e = tr_ddp_micro_begin(d, &a->eb)) != TD_OK)
			break;
		int64_t nv;
		const int32_t *ids = a->ids + (size_t)mb * ER_N;
		if ((a->e = tr_model_forward(m, ids, ids, &a->loss[mb], &nv, &a->eb)) != TD_OK)
			break;
		if (!gr && mb == a1 - 1)
			tr_ddp_arm(d);
		tr_model_backward(m, dloss);
		if (gr)
			a->e = tr_ddp_micro_end(d, &a->eb);
	}
	if (a->e != TD_OK || (a->e = tr_ddp_finish(d, &a->eb)) != TD_OK)
		goto out;
	const struct tr_plan *pl = tr_model_plan(m);
	const struct tr_param *emb = tr_plan_param(pl, "model.embed_tokens.weight");
	if (!gr) {
		gpu_download(be, a->whole, tr_model_grads(m) + emb->goffset, emb->numel * sizeof(float));
		a->lo = emb->goffset;
		a->hi = emb->goffset + emb->numel;
		if (a->r == 0)
			memcpy(a->out, a->whole, emb->numel * sizeof(float));
		goto out;
	}
	a->lo = pl->shard_lo > emb->goffset ? pl->shard_lo : emb->goffset;
	a->hi = pl->shard_hi < emb->goffset + emb->numel ? pl->shard_hi : emb->goffset + emb->numel;
	if (a->hi > a->lo)
		gpu_download(be, a->out + (a->lo - emb->goffset), tr_model_grads(m) + (a->lo - pl->shard_lo),
			     (a->hi - a->lo) * sizeof(float));
out:
	if (a->e != TD_OK)
		gpu_gang_fail(a->g, a->r, a->e, a->eb.msg);
	tr_ddp_free(d);
	gpu_comm_free(c);
	tr_model_free(m);
	gpu_backend_free(be);
	return NULL;
}

/* rows (16, C) by ids into the table t, in n order (embedding_backward's) */
static void er_scatter(float *t, const float *rows, const int32_t *ids, size_t C)
{
	for (int n = 0; n < ER_N; n++)
		for (size_t c = 0; c < C; c++)
			t[(size_t)ids[n] * C + c] += rows[(size_t)n * C + c];
}

static int er_cut_rows;

static void er_case(const char *model_dir, enum tr_shard shard, int R, int A)
{
	char path[600];
	snprintf(path, sizeof(path), "%s/config.json", model_dir);
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_config_load(&cfg, path, &eb), TD_OK);
	const size_t C = (size_t)cfg.hidden_size, V = (size_t)cfg.vocab_size, VC = V * C;
	const bool tied = cfg.tie_word_embeddings;
	/* A micro-batches of ids: the same 8 ids in each (each twice, in
	 * other places) and 4 of its own, so ids repeat within a micro-batch
	 * and across micro-batches (so across ranks) */
	int32_t *ids = malloc((size_t)A * ER_N * sizeof(int32_t));
	for (int mb = 0; mb < A; mb++)
		for (int n = 0; n < ER_N; n++)
			ids[mb * ER_N + n] = (int32_t)(n % 4 == 3 ? (300 + mb * 11) % (int)V
								  : ((n * 5 + mb * 3) % 8) * 37 % (int)V);
	/* the reference: each micro-batch alone on one unsharded model */
	float *H = calloc((size_t)A * VC, sizeof(float)), *D = malloc((size_t)A * ER_N * C * sizeof(float));
	double rloss[16];
	struct gpu_backend *be = NULL;
	struct tr_model *m = NULL;
	struct tr_plan_opts o = {.B = ER_B, .T = ER_T};
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_new(&m, be, &cfg, &o, &eb), TD_OK);
	td_err e = TD_OK;
	er_weights(m, &e);
	CHECK_EQ_INT(e, TD_OK);
	const struct tr_param *emb = tr_plan_param(tr_model_plan(m), "model.embed_tokens.weight");
	for (int mb = 0; mb < A; mb++) {
		int64_t nv;
		tr_model_zero_grad(m);
		CHECK_EQ_INT(tr_model_forward(m, ids + mb * ER_N, ids + mb * ER_N, &rloss[mb], &nv, &eb), TD_OK);
		tr_model_take_embed_rows(m, true); /* the table: the head's part only */
		tr_model_backward(m, 1.0f / (float)(A * ER_N));
		tr_model_take_embed_rows(m, false);
		gpu_download(be, H + (size_t)mb * VC, tr_model_grads(m) + emb->goffset, VC * sizeof(float));
		const int32_t *di;
		float *res0, *dres;
		tr_model_embed_io(m, &di, &res0, &dres);
		gpu_download(be, D + (size_t)mb * ER_N * C, dres, ER_N * C * sizeof(float));
	}
	const size_t nt = tr_model_plan(m)->numel_trainable, S = (nt + (size_t)R - 1) / (size_t)R;
	const size_t eoff = emb->goffset;
	int a0[GPU_GANG_MAX], a1[GPU_GANG_MAX];
	for (int r = 0; r < R; r++)
		tr_ddp_share(A, R, r, &a0[r], &a1[r]);
	/* Unsharded, tied, several micro-batches a rank: a rank's table is its
	 * head GEMMs added into the running table (beta 1) with its earlier
	 * micro-batches' rows scattered between them, which the host's float
	 * sums of H cannot repeat bit for bit; so each rank's sequence is
	 * replayed on the reference model (the same ops in the same order)
	 * and its table taken as it is before the ranks' sum. */
	const bool gr = tr_shard_grads(shard, R);
	float *rtab = NULL;
	if (tied && !gr && A > R) {
		rtab = calloc((size_t)R * VC, sizeof(float));
		float *tmp = malloc(VC * sizeof(float));
		for (int r = 0; r < R; r++) {
			tr_model_zero_grad(m);
			for (int mb = a0[r]; mb < a1[r]; mb++) {
				int64_t nv;
				double ls;
				CHECK_EQ_INT(tr_model_forward(m, ids + mb * ER_N, ids + mb * ER_N, &ls, &nv, &eb),
					     TD_OK);
				tr_model_take_embed_rows(m, true);
				tr_model_backward(m, 1.0f / (float)(A * ER_N));
				tr_model_take_embed_rows(m, false);
				if (mb == a1[r] - 1)
					break;
				gpu_download(be, tmp, tr_model_grads(m) + emb->goffset, VC * sizeof(float));
				er_scatter(tmp, D + (size_t)mb * ER_N * C, ids + mb * ER_N, C);
				gpu_upload(be, tr_model_grads(m) + emb->goffset, tmp, VC * sizeof(float));
			}
			gpu_download(be, rtab + (size_t)r * VC, tr_model_grads(m) + emb->goffset,
				     VC * sizeof(float));
		}
		free(tmp);
	}
	tr_model_free(m);
	gpu_backend_free(be);
	if (!tied)
		for (size_t i = 0; i < (size_t)A * VC; i++)
			CHECK_MSG(H[i] == 0.0f, "untied: the table got a head part at %zu", i); /* no head */
	/* the host's sums, in the ranks' order */
	float *want = calloc(VC, sizeof(float)), *zero = calloc(ER_N * C, sizeof(float));
	int32_t zid[ER_N] = {0};
	if (gr) {
		for (int k = 0; k < (A + R - 1) / R; k++) {
			for (size_t x = 0; tied && x < VC; x++) {
				const int own = (int)((eoff + x) / S);
				float s = 0.0f;
				for (int r = 0; r < R; r++) {
					const int mb = a0[r] + k;
					float t = mb < a1[r] ? H[(size_t)mb * VC + x] : 0.0f;
					if (r == own)
						t += want[x];
					s = r ? s + t : t;
				}
				want[x] = s;
			}
			for (int r = 0; r < R; r++) {
				const int mb = a0[r] + k;
				if (mb < a1[r])
					er_scatter(want, D + (size_t)mb * ER_N * C, ids + mb * ER_N, C);
				else
					er_scatter(want, zero, zid, C);
			}
		}
	} else {
		float *tab = rtab ? rtab : calloc((size_t)R * VC, sizeof(float));
		for (int r = 0; !rtab && r < R; r++)
			for (int mb = a0[r]; mb < a1[r]; mb++) {
				float *t = tab + (size_t)r * VC;
				for (size_t x = 0; tied && x < VC; x++)
					t[x] += H[(size_t)mb * VC + x];
				if (mb < a1[r] - 1)
					er_scatter(t, D + (size_t)mb * ER_N * C, ids + mb * ER_N, C);
			}
		for (size_t x = 0; x < VC; x++) {
			float s = tab[x];
			for (int r = 1; r < R; r++)
				s += tab[(size_t)r * VC + x];
			want[x] = s;
		}
		for (int r = 0; r < R; r++)
			er_scatter(want, D + (size_t)(a1[r] - 1) * ER_N * C, ids + (a1[r] - 1) * ER_N, C);
		free(tab);
	}
	/* the ranks */
	static struct er_arg a[GPU_GANG_MAX];
	float *out = malloc(VC * sizeof(float));
	for (size_t x = 0; x < VC; x++)
		out[x] = NAN; /* every float must be written by its rank */
	struct gpu_gang *g = NULL;
	CHECK_EQ_INT(gpu_gang_new(&g, R, 0, &eb), TD_OK);
	pthread_t t[GPU_GANG_MAX];
	for (int r = 0; r < R; r++) {
		a[r] = (struct er_arg){.g = g, .cfg = &cfg, .shard = shard, .r = r, .R = R, .A = A, .ids = ids,
				       .out = out, .whole = malloc(VC * sizeof(float))};
		pthread_create(&t[r], NULL, er_rank, &a[r]);
	}
	for (int r = 0; r < R; r++)
		pthread_join(t[r], NULL);
	gpu_gang_free(g);
	char what[96];
	snprintf(what, sizeof(what), "%s, %s, %d ranks, %d micro-batches", tied ? "tied" : "untied",
		 tr_shard_name(shard), R, A);
	int cuts = 0;
	for (int r = 0; r < R; r++) {
		CHECK_MSG(a[r].e == TD_OK, "%s, rank %d: %s", what, r, a[r].eb.msg);
		for (int mb = a0[r]; mb < a1[r]; mb++)
			CHECK_MSG(a[r].loss[mb] == rloss[mb], "%s: micro-batch %d's loss %.17g, one model's %.17g",
				  what, mb, a[r].loss[mb], rloss[mb]);
		if (!gr && r > 0)
			CHECK_MSG(memcmp(a[r].whole, a[0].whole, VC * sizeof(float)) == 0,
				  "%s: rank %d's summed embedding gradient is not rank 0's", what, r);
		/* a part that starts inside an embedding row */
		if (gr && r > 0 && a[r].lo < a[r].hi && (a[r].lo - eoff) % C != 0)
			cuts++;
	}
	for (int r = 0; r < R; r++)
		free(a[r].whole);
	size_t bad = 0, worst = 0;
	for (size_t x = 0; x < VC; x++)
		if (memcmp(&out[x], &want[x], sizeof(float)) != 0 && bad++ == 0)
			worst = x;
	CHECK_MSG(bad == 0,
		  "%s: %zu of the embedding's %zu summed gradient floats are not the host's bits "
		  "(first: float %zu, row %zu col %zu: %.9g, want %.9g)",
		  what, bad, VC, worst, worst / C, worst % C, (double)out[worst], (double)want[worst]);
	er_cut_rows += cuts;
	printf("%-52s the host's bits%s\n", what, cuts ? ", a part starting inside a row" : "");
	free(out);
	free(want);
	free(zero);
	free(H);
	free(D);
	free(ids);
}

static void test_embed_rows(const char *deep)
{
	char qwen[512];
	snprintf(qwen, sizeof(qwen), "%s/qwen2", fx);
	static const struct {
		int R, A;
	} shapes[] = {{2, 2}, {3, 3}, {4, 4}, {2, 5}, {3, 7}};
	const char *models[] = {qwen, deep};
	for (int mi = 0; mi < 2; mi++)
		for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++)
			for (int sh = 0; sh < TR_SHARD_COUNT; sh++)
				er_case(models[mi], (enum tr_shard)sh, shapes[k].R, shapes[k].A);
	CHECK_MSG(er_cut_rows > 0, "no case's part boundary cuts an embedding row");
}

/* ranks: 2 or 3; piece: tr_ddp_step's pieces (0: its default, one a part
 * here) */
static void test_shard_emu16(const char *deep, int ranks, bool lora, bool full, bool whole16,
			     size_t piece)
{
	static struct em_arg a[TR_SHARD_COUNT][EM_MAX_RANKS];
	const size_t v0 = emu16_violations();
	for (int k = 0; k < TR_SHARD_COUNT; k++) {
		struct gpu_gang *g = NULL;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(gpu_gang_new(&g, ranks, 0, &eb), TD_OK);
		pthread_t t[EM_MAX_RANKS];
		for (int r = 0; r < ranks; r++) {
			a[k][r] = (struct em_arg){.g = g, .dir = deep, .r = r, .ranks = ranks, .lora = lora,
						  .full = full, .shard = (enum tr_shard)k, .piece = piece};
			pthread_create(&t[r], NULL, em_rank, &a[k][r]);
		}
		for (int r = 0; r < ranks; r++) {
			pthread_join(t[r], NULL);
			CHECK_MSG(a[k][r].e == TD_OK, "emu16 %s rank %d: %s",
				  tr_shard_name((enum tr_shard)k), r, a[k][r].eb.msg);
			/* the layers' bf16 copy in a ring but where the weights are
			 * sharded (train/plan.h: copy16_ring) */
			CHECK_EQ_INT(a[k][r].ring, full && !lora && k < TR_SHARD_PARAMETERS);
			/* GRADIENTS without the ring keeps the masters of its part
			 * only and gathers the bf16 copy (train/plan.h: masters_part) */
			CHECK_EQ_INT(a[k][r].masters, !full && !lora && k == TR_SHARD_GRADIENTS);
			/* both layouts of the copy the gathers cut: from float 0
			 * with even parts (a tied embedding), and after an untied
			 * embedding (the 5-layer model's); on 2 ranks */
			if (ranks == 2)
				CHECK_EQ_INT(a[k][r].whole16, a[k][r].masters && whole16);
			/* small pieces: the part stepped and gathered in several */
			if (piece && a[k][r].masters)
				CHECK_MSG(a[k][r].pieces > 2, "emu16: %zu pieces of %zu floats a part",
					  a[k][r].pieces, piece);
		}
		gpu_gang_free(g);
	}
	/* Pairs that sum the same floats: NONE and OPTIMIZER (the whole
	 * gradient summed on every rank, the norm over it), GRADIENTS and
	 * PARAMETERS (the parts, the norm summed over them) */
	for (int k = 0; k < TR_SHARD_COUNT; k += 2) {
		int same = 1;
		for (int s = 0; s < EM_STEPS; s++)
			for (int r = 0; r < ranks; r++)
				same &= a[k][r].loss[s] == a[k + 1][r].loss[s] &&
					a[k][r].norm[s] == a[k + 1][r].norm[s] &&
					a[k][r].norm[s] == a[k][0].norm[s];
		CHECK_MSG(same, "emu16: %s's losses or norms are not %s's bits",
			  tr_shard_name((enum tr_shard)(k + 1)), tr_shard_name((enum tr_shard)k));
	}
	CHECK(a[3][0].loss[EM_STEPS - 1] != a[3][0].loss[0]); /* the steps moved the weights */
	CHECK_MSG(emu16_violations() == v0, "emu16: %zu stale bf16 twins or scratch overflows",
		  emu16_violations() - v0);
	printf("emu16 (bf16 mode), %d ranks, %d layers%s, recompute %s%s: parameters' %d steps are "
	       "gradients' bits and optimizer's none's (loss %.6f -> %.6f), no stale twin\n",
	       ranks, a[0][0].layers, lora ? ", LoRA" : "", full ? "full" : "none",
	       piece && a[2][0].masters ? ", AdamW and its gathers in pieces" : "", EM_STEPS,
	       a[3][0].loss[0] / 30, a[3][0].loss[EM_STEPS - 1] / 30);
}

/* Evaluation with sharded weights: every rank runs the evaluation's
 * forwards (each gathers the weights it reads), rank 0 reports. On the
 * 5-layer model, 2 ranks, evaluating every 2 steps: the eval loss and the
 * curve are NONE's bits, and so is the model. */
static void test_shard_eval(const char *deep)
{
	char data[600];
	snprintf(data, sizeof(data), "eval_file: \"%s/demo/fortunes.tokens\" eval_every: 2 eval_batches: 3",
		 fx);
	extra_data = data;
	struct curve c[2] = {{0}};
	struct tr_train_result r[2];
	for (int sh = 0; sh < 2; sh++) {
		char name[32];
		snprintf(name, sizeof(name), "zpe-%s", sh ? "parameters" : "none");
		Traind__JobSpec *s = spec_model(name, deep, "max_steps: 4 grad_accum: 2", "",
						sh ? shard_text(TR_SHARD_PARAMETERS) : "memory { shard: SHARD_NONE }");
		struct td_errbuf eb = {{0}};
		CHECK_MSG(train(s, 2, 0, 0, &c[sh], &r[sh], &eb) == TD_OK, "%s: %s", name, eb.msg);
		rpc_jobspec_free(s);
	}
	extra_data = "";
	CHECK_MSG(isfinite(r[1].eval_loss) && r[1].eval_loss == r[0].eval_loss,
		  "eval loss with the weights sharded %.17g, unsharded %.17g", r[1].eval_loss, r[0].eval_loss);
	int same = c[0].n == 4 && c[1].n == 4;
	for (int k = 1; k <= 4; k++)
		same &= c[0].loss[k] == c[1].loss[k];
	CHECK_MSG(same, "evaluating with the weights sharded: the curve is not NONE's");
	CHECK_EQ_INT(diff_models("zpe-none", "zpe-parameters"), 0);
	printf("parameters, evaluating on every rank: eval loss %.6f, NONE's bits\n", r[1].eval_loss);
}

/* A sharded checkpoint is one device's, and resumes on any number of ranks.
 * Compared, each exactly (the same bits, by construction as above):
 *  - the checkpoint of 2 ranks sharded at step 3 against 2 ranks unsharded:
 *    model.safetensors and optimizer.safetensors byte for byte (the moments
 *    gathered from both ranks' parts into one device's layout);
 *  - that checkpoint resumed on n = 1, 2, 3 ranks sharded against the
 *    unsharded checkpoint resumed on n unsharded: the curve and the final
 *    weights (each rank read its part of the saved moments).
 * Against the uninterrupted 2-rank run the resumed ones on 1 and 3 ranks
 * are not the same bits — a rank sums its micro-batches' gradients before
 * the ranks' sums, so the order of the step's float sum follows the ranks —
 * and are held to check_curves' bound; on 2 they are its bits. */
static void test_shard_resume(void)
{
	enum { STEPS = 8 };
	const char *hyper = "max_steps: 8 grad_accum: 6";
	struct curve straight = {0};
	struct tr_train_result r;
	struct td_errbuf eb = {{0}};
	Traind__JobSpec *s = spec("zr-straight", hyper, "checkpoint_every: 4", SHARD_OPT);
	CHECK_EQ_INT(train(s, 2, 0, 0, &straight, &r, &eb), TD_OK);
	rpc_jobspec_free(s);
	for (int n = 1; n <= 3; n++) {
		struct curve c[2] = {{0}};
		char name[2][64];
		Traind__JobSpec *ss[2];
		for (int sh = 0; sh < 2; sh++) {
			snprintf(name[sh], sizeof(name[sh]), "zr-on%d-%s", n, sh ? "opt" : "none");
			ss[sh] = spec(name[sh], hyper, "checkpoint_every: 4", sh ? SHARD_OPT : "");
			memset(&eb, 0, sizeof(eb));
			CHECK_EQ_INT(train(ss[sh], 2, 0, 3, &c[sh], &r, &eb), TD_OK); /* stops after 3: checkpoint */
			CHECK_EQ_INT(r.steps_done, 3);
		}
		static const char *const files[] = {"model.safetensors", "optimizer.safetensors"};
		for (int f = 0; f < 2; f++) {
			char a[512], b[512];
			snprintf(a, sizeof(a), "%s/%s/checkpoints/step-00000003/%s", tmp, name[0], files[f]);
			snprintf(b, sizeof(b), "%s/%s/checkpoints/step-00000003/%s", tmp, name[1], files[f]);
			CHECK_MSG(diff_files(a, b) == 0,
				  "the sharded 2-rank checkpoint's %s is not the unsharded one's", files[f]);
		}
		for (int sh = 0; sh < 2; sh++) {
			CHECK_MSG(train(ss[sh], n, 0, 0, &c[sh], &r, &eb) == TD_OK, "%s: resume on %d: %s",
				  name[sh], n, eb.msg);
			CHECK_EQ_INT(r.resumed_from, 3);
			CHECK_EQ_INT(r.steps_done, STEPS);
			rpc_jobspec_free(ss[sh]);
		}
		int same = 1;
		for (int k = 1; k <= STEPS; k++)
			same &= c[0].loss[k] == c[1].loss[k] && c[0].norm[k] == c[1].norm[k];
		CHECK_MSG(same, "resumed on %d ranks: the sharded curve is not the unsharded one's", n);
		CHECK_EQ_INT(diff_models(name[0], name[1]), 0);
		if (n == 2) {
			for (int k = 1; k <= STEPS; k++)
				same &= c[1].loss[k] == straight.loss[k];
			CHECK_MSG(same, "resumed on 2 ranks: the curve is not the uninterrupted run's");
			CHECK_EQ_INT(diff_models("zr-straight", name[1]), 0);
		} else {
			char what[96];
			snprintf(what, sizeof(what), "sharded 2-rank checkpoint resumed on %d", n);
			check_curves(what, &straight, &c[1], STEPS);
		}
	}
}

/* One rank fails (TD_DDP_FAIL_AT): the job fails on every rank, with the
 * failing rank's error, promptly, and writes no final model. */
static void test_failure(void)
{
	static const char *const at[] = {"1:2", "0:3"};
	for (int k = 0; k < 2; k++) {
		char name[64];
		snprintf(name, sizeof(name), "fail-%d", k);
		Traind__JobSpec *s = spec(name, "max_steps: 6 grad_accum: 2", "", "");
		setenv("TD_DDP_FAIL_AT", at[k], 1);
		struct curve c = {0};
		struct tr_train_result r;
		struct td_errbuf eb = {{0}};
		double t0 = now_s();
		td_err e = train(s, 2, 0, 0, &c, &r, &eb);
		double dt = now_s() - t0;
		unsetenv("TD_DDP_FAIL_AT");
		CHECK_EQ_INT(e, TD_EDEVICE);
		CHECK_CONTAINS(eb.msg, "TD_DDP_FAIL_AT");
		CHECK_CONTAINS(eb.msg, k == 0 ? "rank 1 of 2: " : "rank 0 failed");
		CHECK_EQ_INT(r.failed_rank, k == 0 ? 1 : 0);
		CHECK_EQ_INT(r.failed_device, -1);
		CHECK_EQ_INT(c.n, k == 0 ? 1 : 2);
		CHECK_MSG(dt < 30, "the failure took %.1f s to end the job", dt);
		char path[512];
		struct stat st;
		snprintf(path, sizeof(path), "%s/%s/trainer_state.json", tmp, name);
		CHECK(stat(path, &st) != 0);
		rpc_jobspec_free(s);
	}
	/* Each rank needs a micro-batch of the step. */
	Traind__JobSpec *s = spec("too-few", "max_steps: 2", "", "");
	struct tr_train_result r;
	struct td_errbuf eb = {{0}};
	struct curve c = {0};
	CHECK_EQ_INT(train(s, 2, 0, 0, &c, &r, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "hyper.grad_accum");
	rpc_jobspec_free(s);
}

/* tr_ddp_share: contiguous, in order, every micro-batch once. */
static void test_share(void)
{
	for (int accum = 1; accum <= 9; accum++)
		for (int n = 1; n <= accum; n++) {
			int next = 0, lo = accum, hi = 0;
			for (int r = 0; r < n; r++) {
				int a0, a1;
				tr_ddp_share(accum, n, r, &a0, &a1);
				CHECK_EQ_INT(a0, next);
				next = a1;
				lo = a1 - a0 < lo ? a1 - a0 : lo;
				hi = a1 - a0 > hi ? a1 - a0 : hi;
			}
			CHECK_EQ_INT(next, accum);
			CHECK(lo >= 1 && hi - lo <= 1);
		}
}

int main(int argc, char **argv)
{
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	snprintf(tmp, sizeof(tmp), "/tmp/td-ddp-XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 2;
	}
	unsetenv("TD_DDP_COMM");
	unsetenv("TD_DDP_FAIL_AT");
	if (argc > 1 && strcmp(argv[1], "shard") == 0) { /* meson's ddp-shard: sharded state */
		char deep[512];
		snprintf(deep, sizeof(deep), "%s/deep5", tmp);
		deep_model(deep, 5);
		test_shard_collectives();
		test_shard_plan();
		test_shard_grads_plan(deep);
		test_shard_8b_plan();
		test_embed_rows(deep);
		test_shard_emu16(deep, 2, false, true, false, 0);
		test_shard_emu16(deep, 2, true, true, false, 0);
		/* GRADIENTS' masters of the part: the untied 5-layer model, and
		 * the tied qwen2 fixture */
		test_shard_emu16(deep, 2, false, false, false, 0);
		/* and stepped in pieces, each gathered as it is stepped
		 * (tr_ddp_step): pieces cut inside tensors, across the copy's
		 * start and the undecayed floats */
		test_shard_emu16(deep, 2, false, false, false, 1000);
		test_shard_emu16(deep, 3, false, false, false, 1000); /* any number of ranks */
		char qwen[600];
		snprintf(qwen, sizeof(qwen), "%s/qwen2", fx);
		test_shard_emu16(qwen, 2, false, false, true, 0);
		test_shard_emu16(qwen, 2, false, false, true, 1000);
		test_shard_emu16(qwen, 3, false, false, true, 1000);
		/* up to 3 ranks one part holds the tied table, whose lookup
		 * rows it broadcasts (train/ddp.c: lookup_owned); on 4 a part's
		 * edge cuts it (31,376 floats a part, the table 32,768), and
		 * the rows are summed over the parts */
		test_shard_emu16(qwen, 4, false, false, true, 1000);
		test_shard_optimizer();
		test_shard_resume();
		test_shard_gradients(deep, TR_SHARD_GRADIENTS);
		test_shard_grads_resume(deep, TR_SHARD_GRADIENTS);
		test_shard_gradients(deep, TR_SHARD_PARAMETERS);
		test_shard_eval(deep);
		test_shard_grads_resume(deep, TR_SHARD_PARAMETERS);
	} else {
		test_gang();
		test_all_reduce();
		test_share();
		test_curves();
		test_resume();
		test_failure();
	}
	if (!check_failures_)
		check_rm_tree(tmp);
	return check_status();
}
