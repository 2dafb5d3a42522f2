/* A gang across processes (issue 12, item 4: one job across daemons), on
 * the CPU: the hub and its connections (gpu/gangnet.c) over loopback TCP.
 *
 * - Barriers pass rank 0's bytes to every rank; the exchange sums doubles
 *   and ORs a flag; the host comm's all-reduce, reduce-scatter and
 *   all-gather through the hub give the bits of the in-process host comm
 *   for the same ranks (both sum in rank order from the left), and those
 *   bits are the test's own left-to-right float sums.
 * - A rank's failure reaches the other process's ranks with its code and
 *   message; a process killed with SIGKILL (a forked child) fails the
 *   others with TD_EPEER_LOST; a hub that goes away does too; a wrong token
 *   is refused; a rank that never joins fails the gang after the join time;
 *   a process whose abort flag is set (its coordinator silent) gives up its
 *   wait within a second and the others hear why; strangers on the hub's
 *   port (idle, more than its slots, or announcing a huge frame) neither
 *   keep the ranks out nor fail the gang.
 * - tr_train with the ranks in two "processes" (two gangs of a hub in this
 *   process, one rank each) against tr_train with two in-process ranks: the
 *   same curve bit for bit and the same model bytes; a stop asked by the
 *   second process only stops both at the same step with rank 0's
 *   checkpoint, and the resumed run ends with the uninterrupted one's bits;
 *   a rank's failure in the second process fails the job in the first,
 *   naming it. */
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "gpu/comm.h"
#include "gpu/comm_internal.h" /* gpu__net_barrier: rank 0's bytes */
#include "gpu/select.h"
#include "proto/jobspec.h"
#include "tests/check.h"
#include "train/trainer.h"

static char tmp[256];
static const char *fx;
static const uint8_t token[GPU_HUB_TOKEN_BYTES] = "0123456789abcdef0123456789abcde";

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------ */
/* Collectives through the hub against in-process */

enum { W = 3, N = 1000, COUNT = 7 };

static float val(int r, int i)
{
	/* Values whose sums round: the order shows in the bits. */
	return 1.0f / (float)(r + 1) + (float)i * 0.3771f / (float)(r + 2) + 1e-3f * (float)(i % 7);
}

struct coll_arg {
	struct gpu_gang *g;
	int r;
	float ar[N];                 /* all-reduce result */
	float rs[W * COUNT];         /* reduce-scatter: own part */
	float ag[W * COUNT];         /* all-gather */
	double ex[2];
	bool flag;
	char bcast[16];
	td_err e;
	struct td_errbuf eb;
};

static void *coll_rank(void *p)
{
	struct coll_arg *a = p;
	struct gpu_backend *be = NULL;
	struct gpu_comm *c = NULL;
	float *x = NULL;
	struct gpu_open_opts bo = {.name = "cpu", .device = -1};
	if ((a->e = gpu_backend_open_opts(&be, &bo, &a->eb)) != TD_OK) {
		gpu_gang_fail(a->g, a->r, a->e, a->eb.msg);
		return NULL;
	}
	if ((a->e = gpu_comm_new(&c, a->g, a->r, be, GPU_COMM_HOST, &a->eb)) != TD_OK)
		goto out;
	if ((a->e = gpu_alloc(be, N * sizeof(float), (void **)&x)) != TD_OK)
		goto out;
	float h[N];
	for (int i = 0; i < N; i++)
		h[i] = val(a->r, i);
	gpu_upload(be, x, h, sizeof(h));
	if ((a->e = gpu_comm_all_reduce_sum(c, x, N, &a->eb)) != TD_OK)
		goto out;
	gpu_download(be, a->ar, x, sizeof(a->ar));
	/* reduce-scatter of W * COUNT */
	gpu_upload(be, x, h, W * COUNT * sizeof(float));
	if ((a->e = gpu_comm_reduce_scatter_sum(c, x, COUNT, &a->eb)) != TD_OK)
		goto out;
	gpu_download(be, a->rs, x, W * COUNT * sizeof(float));
	/* all-gather: own part = val(r, i) at r * COUNT */
	float g[W * COUNT];
	for (int i = 0; i < W * COUNT; i++)
		g[i] = i / COUNT == a->r ? val(a->r, i) : -1.0f;
	gpu_upload(be, x, g, sizeof(g));
	if ((a->e = gpu_comm_all_gather(c, x, COUNT, &a->eb)) != TD_OK)
		goto out;
	gpu_download(be, a->ag, x, sizeof(a->ag));
	a->ex[0] = a->r + 1;
	a->ex[1] = 0.1 * a->r;
	a->flag = a->r == W - 1;
	if ((a->e = gpu_gang_exchange(a->g, a->r, a->ex, 2, &a->flag, &a->eb)) != TD_OK)
		goto out;
	if (a->r == 0)
		snprintf(a->bcast, sizeof(a->bcast), "from rank 0");
	a->e = gpu_gang_barrier(a->g, a->r, &a->eb);
out:
	if (a->e != TD_OK)
		gpu_gang_fail(a->g, a->r, a->e, a->eb.msg);
	if (x)
		gpu_free(be, x, N * sizeof(float));
	gpu_comm_free(c);
	gpu_backend_free(be);
	return NULL;
}

static void run_ranks(struct coll_arg *a, int n)
{
	pthread_t t[W];
	for (int r = 0; r < n; r++)
		pthread_create(&t[r], NULL, coll_rank, &a[r]);
	for (int r = 0; r < n; r++)
		pthread_join(t[r], NULL);
}

static void test_collectives(void)
{
	static struct coll_arg in[W], net[W];
	struct td_errbuf eb = {{0}};
	/* in-process */
	struct gpu_gang *g = NULL;
	CHECK_EQ_INT(gpu_gang_new(&g, W, 0, &eb), TD_OK);
	for (int r = 0; r < W; r++)
		in[r] = (struct coll_arg){.g = g, .r = r};
	run_ranks(in, W);
	gpu_gang_free(g);
	/* through a hub: "process" A has ranks 0 and 1, B rank 2 */
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", W, token, 0, &eb), TD_OK);
	struct gpu_gang *ga = NULL, *gb = NULL;
	CHECK_MSG(gpu_gang_new_net(&ga, W, 0, 2, gpu_hub_addr(h), token, "process A", 0, &eb) == TD_OK,
		  "%s", eb.msg);
	CHECK_MSG(gpu_gang_new_net(&gb, W, 2, 1, gpu_hub_addr(h), token, "process B", 0, &eb) == TD_OK,
		  "%s", eb.msg);
	CHECK(gpu_gang_is_net(ga) && gpu_gang_size(ga) == W);
	for (int r = 0; r < W; r++)
		net[r] = (struct coll_arg){.g = r < 2 ? ga : gb, .r = r};
	run_ranks(net, W);
	for (int r = 0; r < W; r++) {
		CHECK_MSG(in[r].e == TD_OK, "in-process rank %d: %s", r, in[r].eb.msg);
		CHECK_MSG(net[r].e == TD_OK, "hub rank %d: %s", r, net[r].eb.msg);
	}
	int bad_ar = 0, bad_rs = 0, bad_ag = 0;
	for (int r = 0; r < W; r++) {
		for (int i = 0; i < N; i++) {
			float want = val(0, i);
			for (int k = 1; k < W; k++)
				want += val(k, i);
			bad_ar += memcmp(&net[r].ar[i], &want, 4) != 0 || memcmp(&in[r].ar[i], &want, 4) != 0;
		}
		for (int i = r * COUNT; i < (r + 1) * COUNT; i++) {
			float want = val(0, i);
			for (int k = 1; k < W; k++)
				want += val(k, i);
			bad_rs += memcmp(&net[r].rs[i], &want, 4) != 0 || memcmp(&in[r].rs[i], &want, 4) != 0;
		}
		for (int i = 0; i < W * COUNT; i++) {
			float want = val(i / COUNT, i);
			bad_ag += memcmp(&net[r].ag[i], &want, 4) != 0 || memcmp(&in[r].ag[i], &want, 4) != 0;
		}
		/* 1 + 2 + 3 and 0 + 0.1 + 0.2 in that order */
		double e1 = 0.0 + 0.1 * 1 + 0.1 * 2;
		CHECK_MSG(net[r].ex[0] == 6.0 && net[r].ex[1] == e1 && net[r].flag,
			  "exchange at rank %d: %.17g %.17g %d", r, net[r].ex[0], net[r].ex[1], net[r].flag);
		CHECK_MSG(in[r].ex[0] == 6.0 && in[r].ex[1] == e1 && in[r].flag,
			  "in-process exchange at rank %d", r);
	}
	CHECK_MSG(bad_ar == 0, "all-reduce: %d floats differ from the left-to-right sum", bad_ar);
	CHECK_MSG(bad_rs == 0, "reduce-scatter: %d floats differ", bad_rs);
	CHECK_MSG(bad_ag == 0, "all-gather: %d floats differ", bad_ag);
	CHECK_EQ_INT(gpu_hub_failed(h, NULL, NULL), false);
	gpu_gang_free(ga);
	gpu_gang_free(gb);
	gpu_hub_free(h);
	printf("collectives through the hub: the in-process bits (%d ranks in 2 processes)\n", W);
}

/* ------------------------------------------------------------------------ */
/* Failures */

struct bar_arg {
	struct gpu_gang *g;
	int r;
	int rounds;
	char buf[32];
	td_err e;
	struct td_errbuf eb;
	double t_end;
};

static void *bar_rank(void *p)
{
	struct bar_arg *a = p;
	for (int k = 0; k < a->rounds && a->e == TD_OK; k++) {
		if (a->r == 0)
			snprintf(a->buf, sizeof(a->buf), "round %d", k);
		a->e = gpu_gang_barrier(a->g, a->r, &a->eb);
	}
	a->t_end = now_s();
	return NULL;
}

struct bc_arg {
	struct gpu_gang *g;
	int r;
	char id[24];
	td_err e;
	struct td_errbuf eb;
};

static void *bc_rank(void *p)
{
	struct bc_arg *a = p;
	a->e = gpu__net_barrier(a->g, a->r, a->id, sizeof(a->id), &a->eb);
	return NULL;
}

static void test_bcast_and_fail(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 0, &eb), TD_OK);
	struct gpu_gang *ga = NULL, *gb = NULL;
	CHECK_EQ_INT(gpu_gang_new_net(&ga, 2, 0, 1, gpu_hub_addr(h), token, "A", 0, &eb), TD_OK);
	CHECK_EQ_INT(gpu_gang_new_net(&gb, 2, 1, 1, gpu_hub_addr(h), token, "B", 0, &eb), TD_OK);
	/* rank 0's bytes reach rank 1 with a barrier: the NCCL unique id's way */
	struct bc_arg c0 = {.g = ga, .r = 0, .id = "rank 0's unique id"}, c1 = {.g = gb, .r = 1};
	pthread_t t;
	pthread_create(&t, NULL, bc_rank, &c1);
	bc_rank(&c0);
	pthread_join(t, NULL);
	CHECK_MSG(c0.e == TD_OK && c1.e == TD_OK, "%s / %s", c0.eb.msg, c1.eb.msg);
	CHECK_STR_EQ(c1.id, "rank 0's unique id");
	/* rank 1 fails: rank 0's barrier returns its code and message */
	struct bar_arg b0 = {.g = ga, .r = 0, .rounds = 1000000};
	pthread_create(&t, NULL, bar_rank, &b0);
	gpu_gang_fail(gb, 1, TD_ENUMERIC, "rank 1's loss is NaN (a test)");
	double t0 = now_s();
	pthread_join(t, NULL);
	CHECK_EQ_INT(b0.e, TD_ENUMERIC);
	CHECK_MSG(strstr(b0.eb.msg, "rank 1's loss is NaN (a test)") != NULL, "rank 0 says: %s",
		  b0.eb.msg);
	CHECK_MSG(b0.t_end - t0 < 5.0, "rank 0 stopped %.1f s after the failure", b0.t_end - t0);
	CHECK(gpu_gang_failed(ga));
	td_err hc = TD_OK;
	CHECK(gpu_hub_failed(h, &hc, NULL) && hc == TD_ENUMERIC);
	gpu_gang_free(ga);
	gpu_gang_free(gb);
	gpu_hub_free(h);
}

/* A process killed with SIGKILL: the other's barrier fails at once. */
static void test_process_killed(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 0, &eb), TD_OK);
	int pfd[2];
	CHECK(pipe(pfd) == 0);
	pid_t pid = fork();
	if (pid == 0) {
		struct gpu_gang *gc = NULL;
		struct td_errbuf ceb = {{0}};
		char b = gpu_gang_new_net(&gc, 2, 1, 1, gpu_hub_addr(h), token, "the child", 0, &ceb) ==
				 TD_OK
			 ? 'j'
			 : 'x';
		ssize_t w = write(pfd[1], &b, 1);
		(void)w;
		raise(SIGKILL);
		_exit(3);
	}
	struct gpu_gang *ga = NULL;
	CHECK_EQ_INT(gpu_gang_new_net(&ga, 2, 0, 1, gpu_hub_addr(h), token, "the parent", 0, &eb),
		     TD_OK);
	char b = 0;
	CHECK(read(pfd[0], &b, 1) == 1 && b == 'j');
	int st = 0;
	waitpid(pid, &st, 0);
	CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
	double t0 = now_s();
	td_err e = gpu_gang_barrier(ga, 0, &eb);
	CHECK_MSG(e == TD_EPEER_LOST, "barrier after the child's death: %s: %s", td_errname(e), eb.msg);
	CHECK_MSG(strstr(eb.msg, "lost the child (ranks 1 to 1)") != NULL, "says: %s", eb.msg);
	CHECK(now_s() - t0 < 5.0);
	gpu_gang_free(ga);
	gpu_hub_free(h);
	close(pfd[0]);
	close(pfd[1]);

	/* The hub goes away (its daemon died): a rank waiting in a barrier
	 * fails with TD_EPEER_LOST. */
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 0, &eb), TD_OK);
	CHECK_EQ_INT(gpu_gang_new_net(&ga, 2, 0, 1, gpu_hub_addr(h), token, "A", 0, &eb), TD_OK);
	struct bar_arg b0 = {.g = ga, .r = 0, .rounds = 1};
	pthread_t t;
	pthread_create(&t, NULL, bar_rank, &b0);
	nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
	gpu_hub_free(h);
	pthread_join(t, NULL);
	CHECK_EQ_INT(b0.e, TD_EPEER_LOST);
	CHECK_MSG(strstr(b0.eb.msg, "lost the gang's hub") != NULL, "says: %s", b0.eb.msg);
	gpu_gang_free(ga);
}

/* A silent coordinator (gpu_gang_set_abort): a rank waiting for the hub
 * gives up within a second of the flag, with TD_EPEER_LOST and the reason,
 * and the other process hears it. */
static void test_abort(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 0, &eb), TD_OK);
	struct gpu_gang *ga = NULL, *gb = NULL;
	CHECK_EQ_INT(gpu_gang_new_net(&ga, 2, 0, 1, gpu_hub_addr(h), token, "A", 0, &eb), TD_OK);
	CHECK_EQ_INT(gpu_gang_new_net(&gb, 2, 1, 1, gpu_hub_addr(h), token, "B", 0, &eb), TD_OK);
	static atomic_bool flag;
	atomic_init(&flag, false);
	gpu_gang_set_abort(gb, &flag, "the coordinator went silent (a test)");
	struct bar_arg b1 = {.g = gb, .r = 1, .rounds = 1};
	pthread_t t;
	pthread_create(&t, NULL, bar_rank, &b1); /* rank 0 never comes */
	nanosleep(&(struct timespec){.tv_nsec = 200 * 1000 * 1000}, NULL);
	double t0 = now_s();
	atomic_store(&flag, true);
	pthread_join(t, NULL);
	CHECK_EQ_INT(b1.e, TD_EPEER_LOST);
	CHECK_MSG(strstr(b1.eb.msg, "the coordinator went silent (a test)") != NULL, "says: %s",
		  b1.eb.msg);
	CHECK_MSG(b1.t_end - t0 < 2.0, "gave up %.2f s after the flag", b1.t_end - t0);
	/* Rank 0 hears it at this barrier, or at the next: rank 1 had arrived
	 * at this one before it gave up, and where the hub's poll finds rank
	 * 0's arrival and rank 1's FAIL waiting together (a loaded machine: it
	 * failed 1 run in 15 beside three busy loops on two cores), it reads
	 * the connections in order and the barrier is whole before the FAIL. */
	td_err e = gpu_gang_barrier(ga, 0, &eb);
	if (e == TD_OK)
		e = gpu_gang_barrier(ga, 0, &eb);
	CHECK_MSG(e == TD_EPEER_LOST && strstr(eb.msg, "went silent"), "rank 0 hears: %s: %s",
		  td_errname(e), eb.msg);
	gpu_gang_free(ga);
	gpu_gang_free(gb);
	gpu_hub_free(h);
}

/* Strangers on the hub's port: idle connections (more than it has
 * slots) and one that announces a huge frame neither keep the ranks out nor
 * fail the gang. */
static void test_strangers(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 0, &eb), TD_OK);
	int port = atoi(strrchr(gpu_hub_addr(h), ':') + 1);
	enum { NS = GPU_GANG_MAX + 8 };
	int fds[NS];
	for (int i = 0; i < NS; i++) {
		fds[i] = socket(AF_INET, SOCK_STREAM, 0);
		struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
					 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
		CHECK(fds[i] >= 0 && connect(fds[i], (struct sockaddr *)&sa, sizeof(sa)) == 0);
	}
	/* the last one: a header claiming 1 TiB */
	struct {
		uint32_t magic;
		uint16_t type, op;
		int32_t rank, code;
		uint32_t flag, world;
		uint64_t len;
	} hdr = {0x474e4454u, 1, 0, 0, 1, 0, 2, (uint64_t)1 << 40};
	CHECK(write(fds[NS - 1], &hdr, sizeof(hdr)) == (ssize_t)sizeof(hdr));
	nanosleep(&(struct timespec){.tv_nsec = 200 * 1000 * 1000}, NULL);
	struct gpu_gang *ga = NULL, *gb = NULL;
	CHECK_MSG(gpu_gang_new_net(&ga, 2, 0, 1, gpu_hub_addr(h), token, "A", 0, &eb) == TD_OK, "%s",
		  eb.msg);
	CHECK_MSG(gpu_gang_new_net(&gb, 2, 1, 1, gpu_hub_addr(h), token, "B", 0, &eb) == TD_OK, "%s",
		  eb.msg);
	struct bar_arg b1 = {.g = gb, .r = 1, .rounds = 3};
	pthread_t t;
	pthread_create(&t, NULL, bar_rank, &b1);
	struct bar_arg b0 = {.g = ga, .r = 0, .rounds = 3};
	bar_rank(&b0);
	pthread_join(t, NULL);
	CHECK_MSG(b0.e == TD_OK && b1.e == TD_OK, "with strangers about: %s / %s", b0.eb.msg,
		  b1.eb.msg);
	CHECK(!gpu_hub_failed(h, NULL, NULL));
	for (int i = 0; i < NS; i++)
		close(fds[i]);
	gpu_gang_free(ga);
	gpu_gang_free(gb);
	gpu_hub_free(h);
}

static void test_refusals(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 300, &eb), TD_OK);
	uint8_t wrong[GPU_HUB_TOKEN_BYTES];
	memcpy(wrong, token, sizeof(wrong));
	wrong[5] ^= 1;
	struct gpu_gang *g = NULL;
	td_err e = gpu_gang_new_net(&g, 2, 1, 1, gpu_hub_addr(h), wrong, "intruder", 0, &eb);
	CHECK_MSG(e == TD_EPEER_LOST && strstr(eb.msg, "not this gang's token"), "wrong token: %s",
		  eb.msg);
	e = gpu_gang_new_net(&g, 3, 1, 1, gpu_hub_addr(h), token, "confused", 0, &eb);
	CHECK_MSG(e == TD_EPEER_LOST && strstr(eb.msg, "the gang has 2"), "wrong world: %s", eb.msg);
	/* rank 1 never joins: rank 0's barrier fails once the join time is up */
	CHECK_EQ_INT(gpu_gang_new_net(&g, 2, 0, 1, gpu_hub_addr(h), token, "A", 0, &eb), TD_OK);
	double t0 = now_s();
	e = gpu_gang_barrier(g, 0, &eb);
	CHECK_MSG(e == TD_EPEER_LOST && strstr(eb.msg, "1 of the gang's 2 ranks joined"),
		  "join timeout: %s: %s", td_errname(e), eb.msg);
	CHECK(now_s() - t0 < 5.0);
	gpu_gang_free(g);
	gpu_hub_free(h);
	/* nobody listens */
	e = gpu_gang_new_net(&g, 2, 0, 1, "127.0.0.1:1", token, "A", 0, &eb);
	CHECK_MSG(e == TD_EPEER_LOST && strstr(eb.msg, "cannot reach the gang's hub at 127.0.0.1:1"),
		  "no hub: %s", eb.msg);
}

/* ------------------------------------------------------------------------ */
/* The trainer across two processes */

static void write_file(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, n, f) != n) {
		perror(path);
		exit(2);
	}
	fclose(f);
}

static Traind__JobSpec *spec(const char *name, const char *hyper, const char *output)
{
	char path[512], text[4096];
	snprintf(path, sizeof(path), "%s/%s.txtpb", tmp, name);
	snprintf(text, sizeof(text),
		 "name: \"%s\"\nmodel_dir: \"%s/qwen2\"\n"
		 "data { train_file: \"%s/demo/fortunes.tokens\" format: DATA_FORMAT_TOKENS seq_len: 16 }\n"
		 "hyper { schedule: SCHEDULE_CONSTANT lr: 1e-3 weight_decay: 0.01 seed: 7 micro_batch: 2 %s }\n"
		 "output { dir: \"%s/%s\" %s }\nresources { device: DEVICE_CPU }\n",
		 name, fx, fx, hyper, tmp, name, output);
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

#define MAX_STEPS 64
struct curve {
	int n;
	double loss[MAX_STEPS + 1];
};

static void on_step(void *ctx, const struct tr_progress *p)
{
	struct curve *c = ctx;
	if (p->step <= MAX_STEPS) {
		c->loss[p->step] = p->loss;
		if ((int)p->step > c->n)
			c->n = (int)p->step;
	}
}

struct proc {
	const Traind__JobSpec *s;
	const char *hub;
	int world, base;
	uint64_t stop_after;
	struct curve c;
	struct tr_train_result res;
	td_err e;
	struct td_errbuf eb;
};

static void *proc_main(void *p)
{
	struct proc *a = p;
	struct tr_train_opts o = {.backend = "cpu", .ranks = 1, .stop_after = a->stop_after,
				  .hub = a->hub, .hub_token = token, .hub_label = "a test process",
				  .world = a->world, .rank_base = a->base};
	struct tr_hooks h = {.on_step = on_step, .ctx = &a->c};
	a->e = tr_train(a->s, &o, &h, &a->res, &a->eb);
	return NULL;
}

/* Two processes of one rank each through a fresh hub. */
static void train_net(const Traind__JobSpec *s, struct proc *p0, struct proc *p1)
{
	struct td_errbuf eb = {{0}};
	struct gpu_hub *h = NULL;
	CHECK_EQ_INT(gpu_hub_new(&h, "127.0.0.1", 2, token, 0, &eb), TD_OK);
	p0->s = p1->s = s;
	p0->hub = p1->hub = gpu_hub_addr(h);
	p0->world = p1->world = 2;
	p0->base = 0;
	p1->base = 1;
	pthread_t t0, t1;
	pthread_create(&t0, NULL, proc_main, p0);
	pthread_create(&t1, NULL, proc_main, p1);
	pthread_join(t0, NULL);
	pthread_join(t1, NULL);
	gpu_hub_free(h);
}

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

static void test_train(void)
{
	enum { STEPS = 8 };
	const char *hyper = "max_steps: 8 grad_accum: 2";
	struct td_errbuf eb = {{0}};
	/* in-process: two ranks */
	Traind__JobSpec *s = spec("in", hyper, "checkpoint_every: 4");
	struct curve ref = {0};
	struct tr_train_result r;
	struct tr_train_opts o = {.backend = "cpu", .ranks = 2};
	struct tr_hooks hk = {.on_step = on_step, .ctx = &ref};
	CHECK_MSG(tr_train(s, &o, &hk, &r, &eb) == TD_OK, "in-process: %s", eb.msg);
	rpc_jobspec_free(s);
	CHECK_EQ_INT(ref.n, STEPS);

	/* two processes, one rank each */
	s = spec("net", hyper, "checkpoint_every: 4");
	static struct proc p0, p1;
	memset(&p0, 0, sizeof(p0));
	memset(&p1, 0, sizeof(p1));
	train_net(s, &p0, &p1);
	CHECK_MSG(p0.e == TD_OK, "process 0: %s", p0.eb.msg);
	CHECK_MSG(p1.e == TD_OK, "process 1: %s", p1.eb.msg);
	CHECK_EQ_INT(p0.c.n, STEPS);
	CHECK_EQ_INT(p1.c.n, 0); /* only rank 0 calls on_step */
	CHECK_EQ_INT(p0.res.ranks, 2);
	int same = 1;
	for (int k = 1; k <= STEPS; k++)
		same &= p0.c.loss[k] == ref.loss[k];
	CHECK_MSG(same, "two processes: the curve is not two in-process ranks' (step 1 %.17g vs %.17g)",
		  p0.c.loss[1], ref.loss[1]);
	CHECK_MSG(p1.res.last_loss == p0.res.last_loss, "rank 1's loss %.17g, rank 0's %.17g",
		  p1.res.last_loss, p0.res.last_loss);
	char a[600], b[600];
	snprintf(a, sizeof(a), "%s/in/model.safetensors", tmp);
	snprintf(b, sizeof(b), "%s/net/model.safetensors", tmp);
	CHECK_MSG(diff_files(a, b) == 0, "the models of two processes and of two ranks differ");
	rpc_jobspec_free(s);
	printf("two processes: %d steps, the curve and model of two in-process ranks (loss %.4f)\n",
	       STEPS, p0.res.last_loss);

	/* process 1 asks to stop after 3 steps: both stop there, rank 0
	 * checkpoints; the resumed run ends with the straight run's bits */
	s = spec("stop", hyper, "checkpoint_every: 4");
	memset(&p0, 0, sizeof(p0));
	memset(&p1, 0, sizeof(p1));
	p1.stop_after = 3;
	train_net(s, &p0, &p1);
	CHECK_MSG(p0.e == TD_OK && p1.e == TD_OK, "stop: %s / %s", p0.eb.msg, p1.eb.msg);
	CHECK(p0.res.stopped && p1.res.stopped);
	CHECK_EQ_INT(p0.res.steps_done, 3);
	CHECK_EQ_INT(p1.res.steps_done, 3);
	snprintf(a, sizeof(a), "%s/stop/checkpoints/step-00000003", tmp);
	CHECK_MSG(access(a, F_OK) == 0, "no checkpoint %s", a);
	struct proc q0 = {0}, q1 = {0};
	train_net(s, &q0, &q1);
	CHECK_MSG(q0.e == TD_OK && q1.e == TD_OK, "resume: %s / %s", q0.eb.msg, q1.eb.msg);
	CHECK_EQ_INT(q0.res.resumed_from, 3);
	CHECK_EQ_INT(q1.res.resumed_from, 3);
	same = 1;
	for (int k = 4; k <= STEPS; k++)
		same &= q0.c.loss[k] == ref.loss[k];
	CHECK_MSG(same, "resumed across processes: the curve is not the straight run's");
	snprintf(b, sizeof(b), "%s/stop/model.safetensors", tmp);
	snprintf(a, sizeof(a), "%s/in/model.safetensors", tmp);
	CHECK_MSG(diff_files(a, b) == 0, "the resumed model differs from the straight run's");
	rpc_jobspec_free(s);

	/* rank 1 (process 1) fails at step 2: process 0's job fails, naming it */
	s = spec("fail", hyper, "checkpoint_every: 4");
	memset(&p0, 0, sizeof(p0));
	memset(&p1, 0, sizeof(p1));
	setenv("TD_DDP_FAIL_AT", "1:2", 1);
	double t0 = now_s();
	train_net(s, &p0, &p1);
	unsetenv("TD_DDP_FAIL_AT");
	CHECK_EQ_INT(p1.e, TD_EDEVICE);
	CHECK_EQ_INT(p0.e, TD_EDEVICE);
	CHECK_MSG(strstr(p0.eb.msg, "rank 1 of 2") && strstr(p0.eb.msg, "rank 1 failed at step 2"),
		  "process 0 says: %s", p0.eb.msg);
	CHECK_EQ_INT(p0.res.failed_rank, 1);
	CHECK(now_s() - t0 < 60);
	rpc_jobspec_free(s);
}

int main(void)
{
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	snprintf(tmp, sizeof(tmp), "/tmp/td-hosts-XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 2;
	}
	unsetenv("TD_DDP_COMM");
	unsetenv("TD_DDP_FAIL_AT");
	unsetenv("TD_DDP_BUCKET_FLOATS");
	signal(SIGPIPE, SIG_IGN);
	test_collectives();
	test_bcast_and_fail();
	test_process_killed();
	test_refusals();
	test_strangers();
	test_abort();
	test_train();
	if (!check_failures_)
		check_rm_tree(tmp);
	return check_status();
}
