/* nccl_smoke: gpu/nccl.c and gpu/topo.c against the real NCCL, NVML and
 * driver of a host with two or more GPUs (issue 12), without the rest of
 * traind, so that it builds with a bare compiler:
 *   cc -I. tests/gpu/nccl_smoke.c gpu/nccl.c gpu/topo.c proto/err.c -ldl -lpthread
 *
 * 1. NVLink topology of the first two GPUs through NVML (gpu_topo_nvlink).
 * 2. Two nonblocking communicators, one per GPU, made from one thread in a
 *    group, waited for with gpu_nccl_wait.
 * 3. An all-reduce (sum) of 64 Mi floats, rank r holding r + 1: every
 *    element must come back 3; its time and bus bandwidth are printed.
 * 3b. The bandwidth of the patterns train/ddp.c uses, each timed over 10
 *    calls enqueued in a row and waited for once, after one: every rank's 64 MB bf16 piece broadcast from it in
 *    one group (tr_ddp_step's pieces) against an all-gather of the same
 *    bytes and a send and a receive a rank in one group, on streams of
 *    the device's highest priority as traind's side stream; a 60 MB fp32 layer reduced onto one rank (GRADIENTS) against
 *    a reduce-scatter of it; each alone and beside a 2 GiB memset on
 *    another stream of each GPU (memory traffic as AdamW's). Printed,
 *    never checked: the numbers are the device's.
 * 4. No hang: rank 0 alone starts an all-reduce that rank 1 never joins;
 *    gpu_nccl_wait (timeout 3 s, polling rank 0's stream) must abort both
 *    communicators and return TD_EDEVICE within a few seconds, and the GPU
 *    must serve on (the stream drains, a copy works).
 * Exit 0 when all hold; 77 (skip) with fewer than two GPUs or no NCCL.
 * Keep NCCL_NVLS_ENABLE=0 in the environment (multicast stays off). */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/nccl.h"
#include "gpu/topo.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_READY = 600 };

static struct {
	CUresult (*init)(unsigned);
	CUresult (*count)(int *);
	CUresult (*get)(CUdevice *, int);
	CUresult (*uuid)(unsigned char *, CUdevice);
	CUresult (*retain)(CUcontext *, CUdevice);
	CUresult (*set)(CUcontext);
	CUresult (*alloc)(CUdeviceptr *, size_t);
	CUresult (*htod)(CUdeviceptr, const void *, size_t);
	CUresult (*dtoh)(void *, CUdeviceptr, size_t);
	CUresult (*stream)(CUstream *, unsigned);
	CUresult (*query)(CUstream);
	CUresult (*sync)(CUstream);
	CUresult (*memset32)(CUdeviceptr, unsigned, size_t, CUstream);
	CUresult (*stream_prio)(CUstream *, unsigned, int);
} cu;

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define CU(call)                                                                        \
	do {                                                                            \
		CUresult r_ = (call);                                                   \
		if (r_ != CUDA_SUCCESS) {                                               \
			fprintf(stderr, "FAIL: %s: CUresult %d\n", #call, r_);          \
			return 1;                                                       \
		}                                                                       \
	} while (0)

static CUstream streams[2];
static CUcontext ctx[2];
static int nstreams;

/* Both streams done: 1; one not yet: 0; an error: -1. */
static int streams_done(void *arg)
{
	(void)arg;
	for (int r = 0; r < nstreams; r++) {
		cu.set(ctx[r]);
		CUresult q = cu.query(streams[r]);
		if (q == CUDA_ERROR_NOT_READY)
			return 0;
		if (q != CUDA_SUCCESS)
			return -1;
	}
	return 1;
}

int main(void)
{
	void *h = dlopen("libcuda.so.1", RTLD_NOW);
	if (!h) {
		printf("SKIP: no libcuda.so.1: %s\n", dlerror());
		return 77;
	}
	void **slot[] = {(void **)&cu.init, (void **)&cu.count, (void **)&cu.get, (void **)&cu.uuid,
			 (void **)&cu.retain, (void **)&cu.set, (void **)&cu.alloc, (void **)&cu.htod,
			 (void **)&cu.dtoh, (void **)&cu.stream, (void **)&cu.query, (void **)&cu.sync,
			 (void **)&cu.memset32};
	const char *names[] = {"cuInit", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetUuid_v2",
			       "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent", "cuMemAlloc_v2",
			       "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2", "cuStreamCreate", "cuStreamQuery",
			       "cuStreamSynchronize", "cuMemsetD32Async"};
	cu.stream_prio = (CUresult(*)(CUstream *, unsigned, int))dlsym(h, "cuStreamCreateWithPriority");
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if (!(*slot[i] = dlsym(h, names[i]))) {
			fprintf(stderr, "FAIL: libcuda.so.1 lacks %s\n", names[i]);
			return 1;
		}
	CU(cu.init(0));
	int ndev = 0;
	CU(cu.count(&ndev));
	if (ndev < 2) {
		printf("SKIP: %d GPU(s); the smoke test needs two\n", ndev);
		return 77;
	}
	int fails = 0;

	/* 1. Topology. */
	char uuid[2][48];
	const char *uuids[2] = {uuid[0], uuid[1]};
	for (int r = 0; r < 2; r++) {
		CUdevice d;
		unsigned char u[16];
		CU(cu.get(&d, r));
		CU(cu.uuid(u, d));
		snprintf(uuid[r], sizeof(uuid[r]),
			 "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
			 u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13],
			 u[14], u[15]);
		CU(cu.retain(&ctx[r], d));
	}
	uint32_t links[2] = {0, 0};
	struct td_errbuf eb = {{0}};
	td_err e = gpu_topo_nvlink(uuids, 2, links, &eb);
	if (e == TD_OK)
		printf("topology: %s and %s %s joined by NVLink (NVML)\n", uuid[0], uuid[1],
		       links[0] & 2 ? "are" : "are NOT");
	else
		printf("topology: %s (%s)\n", eb.msg, td_errname(e));

	/* 2. Communicators. */
	struct gpu_nccl nc;
	if ((e = gpu_nccl_open(&nc, NULL, &eb)) != TD_OK) {
		printf("SKIP: %s\n", eb.msg);
		return 77;
	}
	printf("nccl: %s, NCCL %d.%d.%d\n", nc.path, nc.version / 10000, nc.version / 100 % 100,
	       nc.version % 100);
	struct gpu_nccl_id id;
	if (gpu_nccl_check(&nc, nc.get_unique_id(&id), NULL, "ncclGetUniqueId", &eb) != TD_OK) {
		fprintf(stderr, "FAIL: %s\n", eb.msg);
		return 1;
	}
	gpu_nccl_comm comms[2] = {NULL, NULL};
	struct gpu_nccl_config cfg = gpu_nccl_config_init(false);
	double t0 = now_s();
	nc.group_start();
	for (int r = 0; r < 2; r++) {
		cu.set(ctx[r]);
		gpu_nccl_result_t res = nc.comm_init_rank_config(&comms[r], 2, id, r, &cfg);
		if (res != GPU_NCCL_SUCCESS && res != GPU_NCCL_IN_PROGRESS) {
			gpu_nccl_check(&nc, res, NULL, "ncclCommInitRankConfig", &eb);
			fprintf(stderr, "FAIL: %s\n", eb.msg);
			return 1;
		}
	}
	gpu_nccl_result_t ge = nc.group_end();
	if (ge != GPU_NCCL_SUCCESS && ge != GPU_NCCL_IN_PROGRESS) {
		gpu_nccl_check(&nc, ge, NULL, "ncclGroupEnd", &eb);
		fprintf(stderr, "FAIL: %s\n", eb.msg);
		return 1;
	}
	if ((e = gpu_nccl_wait(&nc, comms, 2, 60000, NULL, NULL, "init", &eb)) != TD_OK) {
		fprintf(stderr, "FAIL: %s\n", eb.msg);
		return 1;
	}
	printf("init: 2 nonblocking communicators in %.3f s (group end returned %s)\n", now_s() - t0,
	       ge == GPU_NCCL_IN_PROGRESS ? "in progress" : "success");

	/* 3. All-reduce. */
	const size_t n = (size_t)64 << 20;
	float *host = malloc(n * sizeof(float));
	CUdeviceptr buf[2];
	for (int r = 0; r < 2; r++) {
		cu.set(ctx[r]);
		if (cu.stream_prio) /* the side stream's priority in traind (gpu/cuda/cuda_side.c) */
			CU(cu.stream_prio(&streams[r], 1, -5));
		else
			CU(cu.stream(&streams[r], 1 /* non-blocking */));
		CU(cu.alloc(&buf[r], n * sizeof(float)));
		for (size_t i = 0; i < n; i++)
			host[i] = (float)(r + 1);
		CU(cu.htod(buf[r], host, n * sizeof(float)));
	}
	nstreams = 2;
	t0 = now_s();
	nc.group_start();
	for (int r = 0; r < 2; r++) {
		cu.set(ctx[r]);
		nc.all_reduce((void *)buf[r], (void *)buf[r], n, GPU_NCCL_FLOAT32, GPU_NCCL_SUM, comms[r],
			      streams[r]);
	}
	nc.group_end();
	if ((e = gpu_nccl_wait(&nc, comms, 2, 60000, streams_done, NULL, "all-reduce", &eb)) != TD_OK) {
		fprintf(stderr, "FAIL: %s\n", eb.msg);
		return 1;
	}
	double ar = now_s() - t0;
	printf("all-reduce: %zu floats in %.3f ms (the first call, setup included)\n", n, ar * 1e3);
	for (int r = 0; r < 2; r++) {
		cu.set(ctx[r]);
		CU(cu.dtoh(host, buf[r], n * sizeof(float)));
		size_t wrong = 0;
		for (size_t i = 0; i < n; i++)
			wrong += host[i] != 3.0f;
		printf("all-reduce: rank %d: %zu of %zu elements are not 1 + 2\n", r, wrong, n);
		fails += wrong != 0;
	}

	/* 3b. Bandwidth of ddp's patterns (printed only). */
	{
		const size_t P = (size_t)32 << 20;    /* bf16 values a rank's piece */
		const size_t LF = (size_t)15 << 20;   /* fp32 floats of a layer */
		const size_t load = (size_t)512 << 20; /* 2 GiB of 4-byte words */
		CUdeviceptr big[2], loadbuf[2];
		CUstream side[2];
		for (int r = 0; r < 2; r++) {
			cu.set(ctx[r]);
			CU(cu.alloc(&big[r], 2 * P * 2 + 2 * LF * 4));
			CU(cu.alloc(&loadbuf[r], load * 4));
			CU(cu.stream(&side[r], 1));
		}
		const char *pat[] = {"broadcast16 x2 (group)", "all-gather16", "reduce fp32 onto 1",
				     "reduce-scatter fp32", "send16/recv16 (group)"};
		typedef gpu_nccl_result_t (*p2p_fn)(void *, size_t, int, int, gpu_nccl_comm, void *);
		p2p_fn nsend = (p2p_fn)dlsym(nc.handle, "ncclSend");
		p2p_fn nrecv = (p2p_fn)dlsym(nc.handle, "ncclRecv");
		for (int beside = 0; beside < 2; beside++)
			for (int k = 0; k < (nsend && nrecv ? 5 : 4); k++) {
				double sum = 0;
				for (int it = 0; it < 2; it++) {
				const int reps = it ? 10 : 1; /* one to warm, then ten waited for once */
				double t = now_s();
				for (int rep = 0; rep < reps; rep++) {
					if (beside)
						for (int r = 0; r < 2; r++) {
							cu.set(ctx[r]);
							cu.memset32(loadbuf[r], (unsigned)rep, load, side[r]);
						}
					nc.group_start();
					for (int r = 0; r < 2; r++) {
						cu.set(ctx[r]);
						char *b = (char *)big[r];
						if (k == 0)
							for (int root = 0; root < 2; root++)
								nc.broadcast(b + root * P * 2, b + root * P * 2, P,
									     GPU_NCCL_BFLOAT16, root, comms[r],
									     streams[r]);
						else if (k == 1)
							nc.all_gather(b + r * P * 2, b, P, GPU_NCCL_BFLOAT16,
								      comms[r], streams[r]);
						else if (k == 2)
							nc.reduce(b + 4 * P, b + 4 * P + LF * 4, LF,
								  GPU_NCCL_FLOAT32, GPU_NCCL_SUM, 1, comms[r],
								  streams[r]);
						else if (k == 4) {
							nsend(b + r * P * 2, P, GPU_NCCL_BFLOAT16, 1 - r,
							      comms[r], streams[r]);
							nrecv(b + (1 - r) * P * 2, P, GPU_NCCL_BFLOAT16, 1 - r,
							      comms[r], streams[r]);
						} else
							nc.reduce_scatter(b + 4 * P, b + 4 * P + LF * 4 + r * LF * 2,
									  LF / 2, GPU_NCCL_FLOAT32, GPU_NCCL_SUM,
									  comms[r], streams[r]);
					}
					nc.group_end();
					if ((e = gpu_nccl_wait(&nc, comms, 2, 60000, NULL, NULL, pat[k], &eb)) !=
					    TD_OK) {
						fprintf(stderr, "FAIL: %s\n", eb.msg);
						return 1;
					}
				}
				for (int r = 0; r < 2; r++) {
					cu.set(ctx[r]);
					CU(cu.sync(streams[r]));
				}
				t = now_s() - t;
				for (int r = 0; beside && r < 2; r++) {
					cu.set(ctx[r]);
					CU(cu.sync(side[r]));
				}
				if (it)
					sum = t;
				}
				const double bytes = k < 2 || k == 4 ? (double)P * 2 : k == 2 ? (double)LF * 4 : LF * 2.0;
				printf("bandwidth: %-24s %s: %.3f ms each of 10 in a row; %.0f GB/s a "
				       "direction (%.0f MB each way)\n",
				       pat[k], beside ? "beside memsets" : "alone         ", sum / 10 * 1e3,
				       bytes / (sum / 10) / 1e9, bytes / 1e6);
			}
	}

	/* 4. Rank 1 never joins: abort, no hang. */
	cu.set(ctx[0]);
	gpu_nccl_result_t res = nc.all_reduce((void *)buf[0], (void *)buf[0], n, GPU_NCCL_FLOAT32,
					      GPU_NCCL_SUM, comms[0], streams[0]);
	printf("hang: rank 0 alone started an all-reduce (%d)\n", res);
	nstreams = 1;
	t0 = now_s();
	memset(&eb, 0, sizeof(eb));
	e = gpu_nccl_wait(&nc, comms, 2, 3000, streams_done, NULL, "all-reduce rank 1 never joins",
			  &eb);
	double dt = now_s() - t0;
	printf("hang: gpu_nccl_wait returned %s after %.2f s: %s\n", td_errname(e), dt, eb.msg);
	if (e != TD_EDEVICE || dt > 10 || comms[0] || comms[1]) {
		fprintf(stderr, "FAIL: the hang was not aborted as expected\n");
		fails++;
	}
	/* The device serves on: the aborted kernel is gone from the stream. */
	t0 = now_s();
	CUresult q = CUDA_ERROR_NOT_READY;
	while ((q = cu.query(streams[0])) == CUDA_ERROR_NOT_READY && now_s() - t0 < 10) {
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	printf("after abort: rank 0's stream %s after %.3f s\n",
	       q == CUDA_SUCCESS ? "drained" : "did NOT drain", now_s() - t0);
	fails += q != CUDA_SUCCESS;
	host[0] = 42.0f;
	CUresult c1 = cu.htod(buf[0], host, sizeof(float));
	float back = 0;
	CUresult c2 = cu.dtoh(&back, buf[0], sizeof(float));
	printf("after abort: a copy on GPU 0 %s (%d, %d, %g)\n",
	       c1 == CUDA_SUCCESS && c2 == CUDA_SUCCESS && back == 42.0f ? "works" : "FAILS", c1, c2,
	       back);
	fails += !(c1 == CUDA_SUCCESS && c2 == CUDA_SUCCESS && back == 42.0f);
	free(host);
	gpu_nccl_close(&nc);
	printf("%s\n", fails ? "FAIL" : "OK");
	return fails ? 1 : 0;
}
