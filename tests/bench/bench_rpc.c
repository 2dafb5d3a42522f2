/* bench_rpc TRAIND FIXTURES: the RPC path under load. Starts a user-mode
 * traind on a temporary socket and state dir with no CPU slots (jobs queue and
 * never run, so only the control plane is measured), then 8 client threads,
 * each on its own connection, make 1000 submits in all, then 10 000 status
 * calls (show of a random job of the ones submitted). Prints per phase the
 * calls/s and the p50/p99/max latency, and the daemon's resident memory
 * (now and peak). A benchmark, not a test: it asserts only that calls
 * succeed. */
#include <errno.h>
#include <limits.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "proto/rpc.h"

#define CLIENTS 8
#define SUBMITS 1000
#define STATUS 10000

static char sock_path[128], url[160], fixtures[PATH_MAX], tmpdir[64];
static uint64_t job_ids[SUBMITS];
static double lat_submit[SUBMITS], lat_status[STATUS];
static pthread_barrier_t barrier;
static int failures;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int call(nng_socket s, Traind__Request *req, Traind__Response **resp)
{
	uint8_t *buf;
	size_t len;
	if (rpc_request_encode(req, &buf, &len) != TD_OK)
		return -1;
	int rv = nng_send(s, buf, len, 0);
	free(buf);
	if (rv)
		return rv;
	void *r;
	size_t rl;
	if ((rv = nng_recv(s, &r, &rl, NNG_FLAG_ALLOC)) != 0)
		return rv;
	struct td_errbuf eb = {{0}};
	td_err e = rpc_response_decode(resp, r, rl, &eb);
	nng_free(r, rl);
	if (e != TD_OK)
		return -1;
	if ((*resp)->status != TD_OK) {
		static int shown;
		if (__atomic_add_fetch(&shown, 1, __ATOMIC_RELAXED) <= 3)
			fprintf(stderr, "bench_rpc: %s\n", (*resp)->message);
		rpc_response_free(*resp);
		return -1;
	}
	return 0;
}

static int open_client(nng_socket *s)
{
	if (nng_req0_open(s) != 0)
		return -1;
	nng_socket_set_ms(*s, NNG_OPT_RECVTIMEO, 60000);
	nng_socket_set_ms(*s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
	return nng_dial(*s, url, NULL, 0);
}

static void *client(void *arg)
{
	int k = (int)(intptr_t)arg;
	nng_socket s;
	if (open_client(&s) != 0) {
		__atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
		pthread_barrier_wait(&barrier);
		pthread_barrier_wait(&barrier);
		return NULL;
	}
	char model[PATH_MAX], data[PATH_MAX], out[PATH_MAX];
	snprintf(model, sizeof(model), "%s/qwen2", fixtures);
	snprintf(data, sizeof(data), "%s/demo/fortunes.tokens", fixtures);
	for (int i = k; i < SUBMITS; i += CLIENTS) {
		snprintf(out, sizeof(out), "%s/out/%d", tmpdir, i);
		Traind__DataSpec d = TRAIND__DATA_SPEC__INIT;
		d.train_file = data;
		d.has_seq_len = true;
		d.seq_len = 32;
		Traind__Hyper h = TRAIND__HYPER__INIT;
		h.has_max_steps = true;
		h.max_steps = 10;
		Traind__OutputSpec o = TRAIND__OUTPUT_SPEC__INIT;
		o.dir = out;
		Traind__Resources res = TRAIND__RESOURCES__INIT;
		res.has_device = true;
		res.device = TRAIND__DEVICE__DEVICE_CPU;
		Traind__JobSpec spec = TRAIND__JOB_SPEC__INIT;
		spec.model_dir = model;
		spec.data = &d;
		spec.hyper = &h;
		spec.output = &o;
		spec.resources = &res;
		Traind__SubmitRequest sr = TRAIND__SUBMIT_REQUEST__INIT;
		sr.spec = &spec;
		Traind__Request req = TRAIND__REQUEST__INIT;
		req.call_case = TRAIND__REQUEST__CALL_SUBMIT;
		req.submit = &sr;
		Traind__Response *resp = NULL;
		double t0 = now_s();
		if (call(s, &req, &resp) != 0 || !resp->job) {
			__atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
			continue;
		}
		lat_submit[i] = now_s() - t0;
		job_ids[i] = resp->job->id;
		rpc_response_free(resp);
	}
	pthread_barrier_wait(&barrier); /* submits done */
	pthread_barrier_wait(&barrier); /* timer started */
	unsigned seed = (unsigned)k * 7919u + 1;
	for (int i = k; i < STATUS; i += CLIENTS) {
		Traind__JobRef ref = TRAIND__JOB_REF__INIT;
		ref.has_id = true;
		ref.id = job_ids[rand_r(&seed) % SUBMITS];
		Traind__Request req = TRAIND__REQUEST__INIT;
		req.call_case = TRAIND__REQUEST__CALL_SHOW;
		req.show = &ref;
		Traind__Response *resp = NULL;
		double t0 = now_s();
		if (call(s, &req, &resp) != 0) {
			__atomic_add_fetch(&failures, 1, __ATOMIC_RELAXED);
			continue;
		}
		lat_status[i] = now_s() - t0;
		rpc_response_free(resp);
	}
	nng_close(s);
	return NULL;
}

static int cmp_d(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;
	return x < y ? -1 : x > y;
}

static void report(const char *what, double *lat, int n, double wall)
{
	qsort(lat, (size_t)n, sizeof(double), cmp_d);
	printf("%-7s %5d calls from %d clients: %7.0f calls/s, latency p50 %.3f ms, p99 %.3f ms, max %.3f ms\n",
	       what, n, CLIENTS, n / wall, 1e3 * lat[n / 2], 1e3 * lat[(int)(n * 0.99)], 1e3 * lat[n - 1]);
}

static void rss(pid_t pid, const char *when)
{
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return;
	long rss = -1, hwm = -1;
	while (fgets(line, sizeof(line), f)) {
		sscanf(line, "VmRSS: %ld", &rss);
		sscanf(line, "VmHWM: %ld", &hwm);
	}
	fclose(f);
	printf("traind RSS %s: %.1f MiB (peak %.1f MiB)\n", when, rss / 1024.0, hwm / 1024.0);
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: bench_rpc TRAIND FIXTURES\n");
		return 2;
	}
	if (!realpath(argv[2], fixtures)) {
		perror(argv[2]);
		return 2;
	}
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/td-bench.XXXXXX");
	if (!mkdtemp(tmpdir)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(sock_path, sizeof(sock_path), "%s/traind.sock", tmpdir);
	snprintf(url, sizeof(url), "ipc://%s", sock_path);
	char state[128], cache[128], out[128], logp[128];
	snprintf(state, sizeof(state), "%s/state", tmpdir);
	snprintf(cache, sizeof(cache), "%s/cache", tmpdir);
	snprintf(out, sizeof(out), "%s/out", tmpdir);
	snprintf(logp, sizeof(logp), "%s/traind.log", tmpdir);
	pid_t pid = fork();
	if (pid == 0) {
		FILE *lf = freopen(logp, "w", stderr);
		(void)lf;
		execl(argv[1], argv[1], "--user", "--socket", sock_path, "--state-dir", state, "--cache-dir", cache,
		      "--cpu-slots", "0", "--max-queued-per-user", "0", "--log-level", "warn", (char *)NULL);
		_exit(127);
	}
	/* Wait until it answers. */
	int up = 0;
	for (int i = 0; i < 300 && !up; i++) {
		nng_socket s;
		if (open_client(&s) == 0) {
			Traind__InfoRequest ir = TRAIND__INFO_REQUEST__INIT;
			Traind__Request req = TRAIND__REQUEST__INIT;
			req.call_case = TRAIND__REQUEST__CALL_INFO;
			req.info = &ir;
			Traind__Response *resp = NULL;
			if (call(s, &req, &resp) == 0) {
				up = 1;
				rpc_response_free(resp);
			}
		}
		nng_close(s);
		if (!up)
			usleep(100000);
	}
	int rc = 0;
	if (!up) {
		fprintf(stderr, "bench_rpc: traind did not start (log: %s)\n", logp);
		rc = 1;
		goto out;
	}
	rss(pid, "idle");
	pthread_barrier_init(&barrier, NULL, CLIENTS + 1);
	pthread_t th[CLIENTS];
	double t0 = now_s();
	for (int k = 0; k < CLIENTS; k++)
		pthread_create(&th[k], NULL, client, (void *)(intptr_t)k);
	pthread_barrier_wait(&barrier);
	double t1 = now_s();
	pthread_barrier_wait(&barrier);
	for (int k = 0; k < CLIENTS; k++)
		pthread_join(th[k], NULL);
	double t2 = now_s();
	if (failures) {
		fprintf(stderr, "bench_rpc: %d calls failed\n", failures);
		rc = 1;
	}
	report("submit", lat_submit, SUBMITS, t1 - t0);
	report("status", lat_status, STATUS, t2 - t1);
	rss(pid, "with 1000 queued jobs");
out:
	kill(pid, SIGTERM);
	int st;
	waitpid(pid, &st, 0);
	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
	if (system(cmd) != 0)
		fprintf(stderr, "bench_rpc: could not remove %s\n", tmpdir);
	return rc;
}
