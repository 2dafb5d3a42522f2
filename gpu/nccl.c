/* The NCCL loader and the no-hang wait (gpu/nccl.h). */
#include "gpu/nccl.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static int64_t mono_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

td_err gpu_nccl_open(struct gpu_nccl *nc, const char *path, struct td_errbuf *eb)
{
	if (!nc)
		return td_fail(eb, TD_EINVAL, "NCCL: no table to fill");
	const char *env = getenv("TD_NCCL_LIBRARY");
	const char *lib = path && *path ? path : env && *env ? env : "libnccl.so.2";
	struct gpu_nccl t;
	memset(&t, 0, sizeof(t));
	snprintf(t.path, sizeof(t.path), "%s", lib);
	t.handle = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
	if (!t.handle)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "%s cannot be loaded: %s; install NCCL (the libnccl2 package, or NVIDIA's "
			       "nccl) to train on several GPUs",
			       lib, dlerror());
	static const struct {
		const char *name;
		size_t off;
		bool optional;
	} syms[] = {
#define SYM(field, name, opt) {name, offsetof(struct gpu_nccl, field), opt}
		SYM(get_version, "ncclGetVersion", false),
		SYM(get_unique_id, "ncclGetUniqueId", false),
		SYM(comm_init_rank, "ncclCommInitRank", false),
		SYM(comm_init_rank_config, "ncclCommInitRankConfig", false),
		SYM(comm_abort, "ncclCommAbort", false),
		SYM(comm_destroy, "ncclCommDestroy", false),
		SYM(comm_finalize, "ncclCommFinalize", false),
		SYM(comm_get_async_error, "ncclCommGetAsyncError", false),
		SYM(all_reduce, "ncclAllReduce", false),
		SYM(reduce_scatter, "ncclReduceScatter", false),
		SYM(all_gather, "ncclAllGather", false),
		SYM(broadcast, "ncclBroadcast", false),
		SYM(reduce, "ncclReduce", false),
		SYM(group_start, "ncclGroupStart", false),
		SYM(group_end, "ncclGroupEnd", false),
		SYM(get_error_string, "ncclGetErrorString", false),
		SYM(get_last_error, "ncclGetLastError", true),
#undef SYM
	};
	for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
		void *f = dlsym(t.handle, syms[i].name);
		if (!f && !syms[i].optional) {
			dlclose(t.handle);
			return td_fail(eb, TD_EUNSUPPORTED, "%s lacks %s (NCCL older than 2.14?)", lib,
				       syms[i].name);
		}
		/* Function pointers all share one representation on this ABI. */
		memcpy((char *)&t + syms[i].off, &f, sizeof(f));
	}
	gpu_nccl_result_t r = t.get_version(&t.version);
	if (r != GPU_NCCL_SUCCESS || t.version < GPU_NCCL_MIN_VERSION) {
		td_err e = td_fail(eb, TD_EUNSUPPORTED,
				   "%s is NCCL %d.%d.%d; traind needs 2.14 or later (nonblocking "
				   "communicators)",
				   lib, t.version / 10000, t.version / 100 % 100, t.version % 100);
		dlclose(t.handle);
		return e;
	}
	*nc = t;
	return TD_OK;
}

void gpu_nccl_close(struct gpu_nccl *nc)
{
	if (nc && nc->handle) {
		dlclose(nc->handle);
		nc->handle = NULL;
	}
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static struct gpu_nccl proc_nccl;
static td_err proc_err;
static struct td_errbuf proc_eb;

static void open_once(void)
{
	proc_err = gpu_nccl_open(&proc_nccl, NULL, &proc_eb);
}

td_err gpu_nccl_get(const struct gpu_nccl **out, struct td_errbuf *eb)
{
	pthread_once(&once, open_once);
	if (proc_err != TD_OK) {
		if (eb)
			*eb = proc_eb;
		return proc_err;
	}
	*out = &proc_nccl;
	return TD_OK;
}

static td_err map_result(gpu_nccl_result_t r)
{
	switch (r) {
	case GPU_NCCL_SUCCESS: return TD_OK;
	case GPU_NCCL_UNHANDLED_CUDA_ERROR: return TD_EDEVICE;
	case GPU_NCCL_SYSTEM_ERROR:
	case GPU_NCCL_REMOTE_ERROR: return TD_EIO;
	case GPU_NCCL_INVALID_ARGUMENT:
	case GPU_NCCL_INVALID_USAGE: return TD_EINVAL;
	case GPU_NCCL_IN_PROGRESS: return TD_EBUSY;
	default: return TD_EINTERNAL;
	}
}

td_err gpu_nccl_check(const struct gpu_nccl *nc, gpu_nccl_result_t r, gpu_nccl_comm comm,
		      const char *what, struct td_errbuf *eb)
{
	td_err e = map_result(r);
	if (e == TD_OK)
		return TD_OK;
	const char *s = nc->get_error_string ? nc->get_error_string(r) : NULL;
	const char *last = nc->get_last_error ? nc->get_last_error(comm) : NULL;
	return td_fail(eb, e, "%s: NCCL error %d (%s)%s%s", what ? what : "NCCL", r,
		       s ? s : "unknown", last && *last ? ": " : "", last && *last ? last : "");
}

void gpu_nccl_abort_all(const struct gpu_nccl *nc, gpu_nccl_comm *comms, int n)
{
	for (int i = 0; i < n; i++) {
		if (comms[i]) {
			nc->comm_abort(comms[i]);
			comms[i] = NULL;
		}
	}
}

td_err gpu_nccl_wait(const struct gpu_nccl *nc, gpu_nccl_comm *comms, int n, int timeout_ms,
		     gpu_nccl_done_fn done, void *ctx, const char *what, struct td_errbuf *eb)
{
	const char *op = what && *what ? what : "NCCL";
	int64_t start = mono_us();
	long sleep_ns = 2000;
	for (;;) {
		bool pending = false;
		for (int i = 0; i < n; i++) {
			if (!comms[i])
				continue;
			gpu_nccl_result_t async = GPU_NCCL_SUCCESS;
			gpu_nccl_result_t r = nc->comm_get_async_error(comms[i], &async);
			if (r == GPU_NCCL_SUCCESS && async == GPU_NCCL_IN_PROGRESS) {
				pending = true;
				continue;
			}
			if (r == GPU_NCCL_SUCCESS && async == GPU_NCCL_SUCCESS)
				continue;
			/* One rank failed: every rank of the job stops. */
			char where[160];
			snprintf(where, sizeof(where), "%s, rank %d of %d", op, i, n);
			td_err e = gpu_nccl_check(nc, r != GPU_NCCL_SUCCESS ? r : async, comms[i], where, eb);
			gpu_nccl_abort_all(nc, comms, n);
			return e;
		}
		if (!pending && done) {
			int d = done(ctx);
			if (d < 0) {
				gpu_nccl_abort_all(nc, comms, n);
				return td_fail(eb, TD_EDEVICE, "%s: the device work failed; the job's %d "
					       "communicator%s aborted",
					       op, n, n == 1 ? " was" : "s were");
			}
			pending = d == 0;
		}
		if (!pending)
			return TD_OK;
		int64_t waited_us = mono_us() - start;
		if (timeout_ms > 0 && waited_us >= (int64_t)timeout_ms * 1000) {
			gpu_nccl_abort_all(nc, comms, n);
			return td_fail(eb, TD_EDEVICE,
				       "%s: no progress in %d ms (a rank failed or stopped); the job's %d "
				       "communicator%s aborted",
				       op, timeout_ms, n, n == 1 ? " was" : "s were");
		}
		struct timespec ts = {0, sleep_ns};
		nanosleep(&ts, NULL);
		if (sleep_ns < 1000000)
			sleep_ns *= 2;
	}
}
