/* The NCCL loader and its no-hang wait (gpu/nccl.h), without a GPU.
 *
 * usage: test_nccl FAKE_LIBNCCL FAKE_LIBNCCL_NO_BROADCAST
 *
 * NCCL absent (a path that does not exist, by argument and by
 * $TD_NCCL_LIBRARY): a clear TD_EUNSUPPORTED naming the library, also from
 * the process-wide gpu_nccl_get, every time. A library lacking an entry point
 * or older than 2.14 is refused, naming it. Against the fake library
 * (fake_libnccl.c): nonblocking communicators come up (the config NCCL gets
 * says blocking 0, with NCCL's magic, size and version), work completes
 * through gpu_nccl_wait (with and without the caller's completion test); a
 * communicator that never completes is aborted at the timeout, on every
 * rank, in bounded time; one rank's error aborts every rank and names that
 * rank and NCCL's message; a failed completion test aborts too. Where the
 * real libnccl.so.2 loads, its entry points resolve and its version is at
 * least 2.14 (skipped, said so, where it does not). */
#include "gpu/nccl.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <time.h>

#include "tests/check.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void (*fake_set)(const char *mode, int polls, int rank);
static int (*fake_aborts)(void);
static int (*fake_destroys)(void);
static void (*fake_config)(size_t *size, unsigned *magic, unsigned *version, int *blocking);

static void test_absent(void)
{
	struct gpu_nccl nc;
	memset(&nc, 0x33, sizeof(nc));
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_nccl_open(&nc, "/nonexistent/libnccl.so.2", &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "/nonexistent/libnccl.so.2 cannot be loaded");
	CHECK_CONTAINS(eb.msg, "install NCCL");
	CHECK(nc.handle == (void *)0x3333333333333333ull); /* untouched */
	setenv("TD_NCCL_LIBRARY", "/nonexistent/by-env/libnccl.so.2", 1);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(gpu_nccl_open(&nc, NULL, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "/nonexistent/by-env/libnccl.so.2 cannot be loaded");
	/* The process's library: the same answer every time. */
	const struct gpu_nccl *p = NULL;
	for (int i = 0; i < 2; i++) {
		memset(&eb, 0, sizeof(eb));
		CHECK_EQ_INT(gpu_nccl_get(&p, &eb), TD_EUNSUPPORTED);
		CHECK_CONTAINS(eb.msg, "/nonexistent/by-env/libnccl.so.2 cannot be loaded");
	}
	CHECK(p == NULL);
	unsetenv("TD_NCCL_LIBRARY");
	gpu_nccl_close(NULL);
}

static void test_refused(const char *fake, const char *nobcast)
{
	struct gpu_nccl nc;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_nccl_open(&nc, nobcast, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "lacks ncclBroadcast");
	setenv("FAKE_NCCL_VERSION", "21301", 1);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(gpu_nccl_open(&nc, fake, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "is NCCL 2.13.1; traind needs 2.14 or later");
	unsetenv("FAKE_NCCL_VERSION");
}

/* A completion test that says "not yet" a few times, then done (or failed). */
struct countdown {
	int left, result, calls;
};
static int countdown(void *ctx)
{
	struct countdown *c = ctx;
	c->calls++;
	return c->left-- > 0 ? 0 : c->result;
}

/* Two ranks' nonblocking communicators on the fake. */
static void init2(const struct gpu_nccl *nc, gpu_nccl_comm comms[2])
{
	struct gpu_nccl_id id;
	CHECK_EQ_INT(nc->get_unique_id(&id), GPU_NCCL_SUCCESS);
	struct gpu_nccl_config cfg = gpu_nccl_config_init(false);
	nc->group_start();
	for (int r = 0; r < 2; r++)
		CHECK_EQ_INT(nc->comm_init_rank_config(&comms[r], 2, id, r, &cfg), GPU_NCCL_IN_PROGRESS);
	nc->group_end();
}

static void test_fake(const char *fake)
{
	struct gpu_nccl nc;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_nccl_open(&nc, fake, &eb), TD_OK);
	if (!nc.handle)
		return;
	CHECK_EQ_INT(nc.version, 22809);
	CHECK_STR_EQ(nc.path, fake);
	CHECK(nc.get_last_error != NULL);
	*(void **)&fake_set = dlsym(nc.handle, "fake_nccl_set");
	*(void **)&fake_aborts = dlsym(nc.handle, "fake_nccl_aborts");
	*(void **)&fake_destroys = dlsym(nc.handle, "fake_nccl_destroys");
	*(void **)&fake_config = dlsym(nc.handle, "fake_nccl_last_config");
	CHECK(fake_set && fake_aborts && fake_destroys && fake_config);
	if (!fake_set || !fake_aborts || !fake_destroys || !fake_config)
		return;

	/* Up and working. */
	fake_set("ok", 3, -1);
	gpu_nccl_comm comms[2] = {NULL, NULL};
	init2(&nc, comms);
	size_t size;
	unsigned magic, version;
	int blocking;
	fake_config(&size, &magic, &version, &blocking);
	CHECK_EQ_INT(blocking, 0);
	CHECK_EQ_INT(size, sizeof(struct gpu_nccl_config));
	CHECK_EQ_INT(magic, 0xcafebeefu);
	CHECK_EQ_INT(version, 21403);
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 1000, NULL, NULL, "init", &eb), TD_OK);
	CHECK(comms[0] && comms[1]);
	float buf[4] = {0};
	for (int r = 0; r < 2; r++)
		CHECK_EQ_INT(nc.all_reduce(buf, buf, 4, GPU_NCCL_FLOAT32, GPU_NCCL_SUM, comms[r], NULL),
			     GPU_NCCL_IN_PROGRESS);
	struct countdown cd = {.left = 2, .result = 1};
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 1000, countdown, &cd, "all-reduce", &eb), TD_OK);
	CHECK_EQ_INT(cd.calls, 3);
	CHECK_EQ_INT(fake_aborts(), 0);
	for (int r = 0; r < 2; r++)
		nc.comm_destroy(comms[r]);
	CHECK_EQ_INT(fake_destroys(), 2);

	/* A communicator that never completes: aborted at the timeout, both ranks. */
	fake_set("hang", 0, -1);
	init2(&nc, comms);
	double t0 = now_s();
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 100, NULL, NULL, "all-reduce of gradients", &eb),
		     TD_EDEVICE);
	double dt = now_s() - t0;
	CHECK_MSG(dt >= 0.1 && dt < 2.0, "waited %.3f s for a 100 ms timeout", dt);
	CHECK_CONTAINS(eb.msg, "all-reduce of gradients: no progress in 100 ms");
	CHECK_CONTAINS(eb.msg, "2 communicators were aborted");
	CHECK_EQ_INT(fake_aborts(), 2);
	CHECK(!comms[0] && !comms[1]);

	/* Rank 1 fails: every rank is aborted, at once, and rank 1 is named. */
	fake_set("error", 2, 1);
	init2(&nc, comms);
	t0 = now_s();
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 5000, NULL, NULL, "init", &eb), TD_EIO);
	CHECK(now_s() - t0 < 1.0);
	CHECK_CONTAINS(eb.msg, "init, rank 1 of 2: NCCL error 6 (remote process exited");
	CHECK_CONTAINS(eb.msg, "fake: rank failed on purpose");
	CHECK_EQ_INT(fake_aborts(), 2);
	CHECK(!comms[0] && !comms[1]);

	/* The caller's own completion test fails (a CUDA error on the stream). */
	fake_set("ok", 1, -1);
	init2(&nc, comms);
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 1000, NULL, NULL, "init", &eb), TD_OK);
	cd = (struct countdown){.left = 1, .result = -1};
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 1000, countdown, &cd, "broadcast", &eb),
		     TD_EDEVICE);
	CHECK_CONTAINS(eb.msg, "broadcast: the device work failed");
	CHECK_EQ_INT(fake_aborts(), 2);
	/* A completion test that never finishes times out like a hang. */
	fake_set("ok", 0, -1);
	init2(&nc, comms);
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 1000, NULL, NULL, "init", &eb), TD_OK);
	cd = (struct countdown){.left = 1000000, .result = 1};
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 50, countdown, &cd, "step", &eb), TD_EDEVICE);
	CHECK_EQ_INT(fake_aborts(), 2);
	/* Nothing to wait for. */
	CHECK_EQ_INT(gpu_nccl_wait(&nc, comms, 2, 50, NULL, NULL, "none", &eb), TD_OK);

	/* NCCL's results as td_err. */
	static const struct {
		int r;
		td_err e;
	} map[] = {{0, TD_OK}, {1, TD_EDEVICE}, {2, TD_EIO}, {3, TD_EINTERNAL}, {4, TD_EINVAL},
		   {5, TD_EINVAL}, {6, TD_EIO}, {7, TD_EBUSY}, {99, TD_EINTERNAL}};
	for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++) {
		memset(&eb, 0, sizeof(eb));
		CHECK_EQ_INT(gpu_nccl_check(&nc, map[i].r, NULL, "x", &eb), map[i].e);
		if (map[i].r)
			CHECK_CONTAINS(eb.msg, "x: NCCL error");
	}
	gpu_nccl_close(&nc);
	CHECK(nc.handle == NULL);
}

/* The host's own NCCL, where there is one. */
static void test_real(void)
{
	void *probe = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
	if (!probe) {
		fprintf(stderr, "# no libnccl.so.2 on this host (%s): the real library is not checked\n",
			dlerror());
		return;
	}
	dlclose(probe);
	struct gpu_nccl nc;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_nccl_open(&nc, "libnccl.so.2", &eb), TD_OK);
	if (!nc.handle) {
		fprintf(stderr, "%s\n", eb.msg);
		return;
	}
	CHECK(nc.version >= GPU_NCCL_MIN_VERSION);
	CHECK(nc.get_unique_id && nc.comm_init_rank_config && nc.comm_abort && nc.all_reduce &&
	      nc.reduce_scatter && nc.all_gather && nc.broadcast && nc.group_start && nc.group_end &&
	      nc.comm_get_async_error && nc.get_error_string);
	const char *s = nc.get_error_string(GPU_NCCL_REMOTE_ERROR);
	CHECK(s && *s);
	fprintf(stderr, "# libnccl.so.2: NCCL %d.%d.%d, every entry point resolved\n",
		nc.version / 10000, nc.version / 100 % 100, nc.version % 100);
	gpu_nccl_close(&nc);
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: test_nccl FAKE_LIBNCCL FAKE_LIBNCCL_NO_BROADCAST\n");
		return 2;
	}
	test_absent();
	test_refused(argv[1], argv[2]);
	test_fake(argv[1]);
	test_real();
	return check_status();
}
