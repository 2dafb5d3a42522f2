/* The gang and the comms of data parallel (gpu/comm.h).
 *
 * Locking: the gang's mutex guards its barrier, its slots and its first
 * failure; `failed` is also an atomic, read without the lock by the polls.
 * A comm belongs to its rank's thread. */
#include "gpu/comm.h"

#include <assert.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/comm_internal.h"
#include "gpu/nccl.h"
#include "gpu/select.h"

/* The gang's shared state lives in gpu/comm_internal.h (the gang of a hub,
 * gpu/gangnet.c, reads it too). */

td_err gpu_gang_new(struct gpu_gang **out, int nranks, int timeout_ms, struct td_errbuf *eb)
{
	if (nranks < 1 || nranks > GPU_GANG_MAX)
		return td_fail(eb, TD_EINVAL, "a gang of %d ranks (1 to %d)", nranks, GPU_GANG_MAX);
	struct gpu_gang *g = calloc(1, sizeof(*g));
	if (!g)
		return td_fail(eb, TD_ENOMEM, "gang: out of memory");
	g->n = nranks;
	g->timeout_ms = timeout_ms > 0 ? timeout_ms : GPU_COMM_TIMEOUT_MS;
	pthread_mutex_init(&g->mu, NULL);
	pthread_cond_init(&g->cv, NULL);
	atomic_init(&g->failed, false);
	*out = g;
	return TD_OK;
}

void gpu_gang_free(struct gpu_gang *g)
{
	if (!g)
		return;
	if (g->net)
		gpu__net_close(g);
	pthread_cond_destroy(&g->cv);
	pthread_mutex_destroy(&g->mu);
	free(g);
}

int gpu_gang_size(const struct gpu_gang *g)
{
	return g->n;
}

bool gpu__gang_fail_first(struct gpu_gang *g, int rank, td_err e, const char *msg)
{
	bool first = false;
	pthread_mutex_lock(&g->mu);
	if (!atomic_load(&g->failed)) {
		g->err = e != TD_OK ? e : TD_EINTERNAL;
		g->err_rank = rank;
		snprintf(g->err_msg, sizeof(g->err_msg), "%s", msg && *msg ? msg : td_strerror(g->err));
		atomic_store(&g->failed, true);
		first = true;
	}
	pthread_cond_broadcast(&g->cv);
	pthread_mutex_unlock(&g->mu);
	return first;
}

void gpu_gang_fail(struct gpu_gang *g, int rank, td_err e, const char *msg)
{
	/* A gang of a hub: the other processes hear of this process's first
	 * failure through it. */
	if (gpu__gang_fail_first(g, rank, e, msg) && g->net)
		gpu__net_send_fail(g, rank, e, msg);
}

void gpu_gang_refine(struct gpu_gang *g, int rank, td_err e, const char *msg)
{
	pthread_mutex_lock(&g->mu);
	if (atomic_load(&g->failed) && g->err_rank == rank && e != TD_OK) {
		g->err = e;
		snprintf(g->err_msg, sizeof(g->err_msg), "%s", msg && *msg ? msg : td_strerror(e));
	}
	pthread_mutex_unlock(&g->mu);
}

bool gpu_gang_failed(const struct gpu_gang *g)
{
	return atomic_load(&((struct gpu_gang *)g)->failed);
}

td_err gpu_gang_error(struct gpu_gang *g, int *rank, struct td_errbuf *eb)
{
	pthread_mutex_lock(&g->mu);
	td_err e = atomic_load(&g->failed) ? g->err : TD_OK;
	if (e != TD_OK) {
		if (rank)
			*rank = g->err_rank;
		if (eb)
			snprintf(eb->msg, sizeof(eb->msg), "%s", g->err_msg);
	}
	pthread_mutex_unlock(&g->mu);
	return e;
}

/* The failure as rank `rank` reports it; with the gang's mutex held. */
static td_err stopped_locked(struct gpu_gang *g, int rank, struct td_errbuf *eb)
{
	if (rank == g->err_rank)
		return td_fail(eb, g->err, "%s", g->err_msg);
	return td_fail(eb, g->err, "rank %d of %d stopped: rank %d failed: %s", rank, g->n,
		       g->err_rank, g->err_msg);
}

static td_err gang_stopped(struct gpu_gang *g, int rank, struct td_errbuf *eb)
{
	pthread_mutex_lock(&g->mu);
	td_err e = stopped_locked(g, rank, eb);
	pthread_mutex_unlock(&g->mu);
	return e;
}

td_err gpu__gang_stopped(struct gpu_gang *g, int rank, struct td_errbuf *eb)
{
	return gang_stopped(g, rank, eb);
}

td_err gpu_gang_barrier(struct gpu_gang *g, int rank, struct td_errbuf *eb)
{
	if (g->net)
		return gpu__net_barrier(g, rank, NULL, 0, eb);
	pthread_mutex_lock(&g->mu);
	td_err e = TD_OK;
	if (atomic_load(&g->failed)) {
		e = stopped_locked(g, rank, eb);
	} else if (++g->arrived == g->n) {
		g->arrived = 0;
		g->gen++;
		pthread_cond_broadcast(&g->cv);
	} else {
		uint64_t gen = g->gen;
		while (gen == g->gen && !atomic_load(&g->failed))
			pthread_cond_wait(&g->cv, &g->mu);
		if (gen == g->gen)
			e = stopped_locked(g, rank, eb);
	}
	pthread_mutex_unlock(&g->mu);
	return e;
}

bool gpu_gang_is_net(const struct gpu_gang *g)
{
	return g->net != NULL;
}

void gpu_gang_set_abort(struct gpu_gang *g, const atomic_bool *flag, const char *why)
{
	g->abort = flag;
	g->abort_why = why;
}

bool gpu__gang_poll_abort(struct gpu_gang *g, int rank)
{
	if (!g->abort || !atomic_load(g->abort) || atomic_load(&g->failed))
		return false;
	gpu_gang_fail(g, rank, TD_EPEER_LOST, g->abort_why && *g->abort_why ? g->abort_why : "aborted");
	return true;
}

td_err gpu_gang_exchange(struct gpu_gang *g, int rank, double *v, size_t n, bool *flag,
			 struct td_errbuf *eb)
{
	if (g->net)
		return gpu__net_exchange(g, rank, v, n, flag, eb);
	/* In-process: every rank's v and flag published, each rank sums them
	 * all into a copy of its own; the second barrier keeps them alive
	 * until all have read. */
	double *sum = n ? malloc(n * sizeof(double)) : NULL;
	if (n && !sum) {
		td_err e = td_fail(eb, TD_ENOMEM, "exchange: out of memory");
		gpu_gang_fail(g, rank, e, eb ? eb->msg : NULL);
		return e;
	}
	pthread_mutex_lock(&g->mu);
	g->dslot[rank] = v;
	g->fslot[rank] = *flag;
	pthread_mutex_unlock(&g->mu);
	td_err e = gpu_gang_barrier(g, rank, eb);
	if (e == TD_OK) {
		bool any = false;
		for (size_t i = 0; i < n; i++) {
			double x = g->dslot[0][i];
			for (int j = 1; j < g->n; j++)
				x += g->dslot[j][i];
			sum[i] = x;
		}
		for (int j = 0; j < g->n; j++)
			any = any || g->fslot[j];
		e = gpu_gang_barrier(g, rank, eb);
		if (e == TD_OK) {
			if (n)
				memcpy(v, sum, n * sizeof(double));
			*flag = any;
		}
	}
	free(sum);
	return e;
}

bool gpu_comm_kind_parse(const char *s, enum gpu_comm_kind *out)
{
	static const char *const names[] = {"auto", "host", "nccl"};
	for (int k = 0; k < 3; k++)
		if (s && strcmp(s, names[k]) == 0) {
			*out = (enum gpu_comm_kind)k;
			return true;
		}
	return false;
}

/* ------------------------------------------------------------------------ */
/* The comm */

/* The CUDA module's side streams (gpu/cuda/cuda_side.c). */
struct cu_side;
struct side_fns {
	td_err (*new_)(struct gpu_backend *be, struct cu_side **out, struct td_errbuf *eb);
	void *(*stream)(struct cu_side *s);
	void (*fork)(struct cu_side *s);
	int (*query)(struct cu_side *s);
	td_err (*error)(struct cu_side *s, struct td_errbuf *eb);
	void (*free_)(struct cu_side *s);
	void (*record)(struct cu_side *s, int k);
	int (*event_query)(struct cu_side *s, int k);
	void (*join)(struct cu_side *s, int k);
};

/* NCCL: the events recorded after the last collectives, one each, in a
 * ring (gpu_comm_wait_for); the CUDA module's side stream has as many. */
#define COMM_EVENTS 16

struct gpu_comm {
	enum gpu_comm_kind kind; /* HOST or NCCL */
	struct gpu_gang *g;
	int rank;
	struct gpu_backend *be;
	char name[32];
	struct gpu_comm_stats stats;
	/* host */
	float *buf;
	size_t cap;
	/* nccl */
	const struct gpu_nccl *nc;
	gpu_nccl_comm comm;
	struct side_fns side_fn;
	struct cu_side *side;
	bool pending; /* sums enqueued since the last wait */
	uint64_t started; /* collectives started (gpu_comm_mark) */
	uint64_t done;    /* those known complete */
	/* gpu_comm_group_begin .. _end: NCCL's group open, the first
	 * collective's index in it (its events are recorded at the end) */
	bool grouped;
	uint64_t group_first;
};

static int64_t mono_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* This rank's own failure: the gang hears of it (the first one is the job's
 * error) and the error goes back to the caller. */
static td_err rank_fail(struct gpu_comm *c, td_err e, struct td_errbuf *eb)
{
	gpu_gang_fail(c->g, c->rank, e, eb ? eb->msg : NULL);
	return e;
}

static void nccl_abort(struct gpu_comm *c)
{
	if (c->comm) {
		c->nc->comm_abort(c->comm);
		c->comm = NULL;
	}
}

/* Polls until the communicator has nothing in progress and (side) the side
 * stream is done: NCCL's nonblocking calls, and the completion of the sums.
 * On the gang's failure, an error, or the timeout: aborts this rank's
 * communicator (which drains its stream), fails the gang, returns the error. */
static td_err nccl_poll(struct gpu_comm *c, bool side, int timeout_ms, const char *what,
			struct td_errbuf *eb)
{
	int64_t start = mono_us();
	long sleep_ns = 2000;
	for (;;) {
		gpu__gang_poll_abort(c->g, c->rank);
		if (gpu_gang_failed(c->g)) {
			nccl_abort(c);
			return gang_stopped(c->g, c->rank, eb);
		}
		if (!c->comm)
			return rank_fail(c, td_fail(eb, TD_EDEVICE, "%s: rank %d: the communicator was aborted",
						    what, c->rank), eb);
		gpu_nccl_result_t async = GPU_NCCL_SUCCESS;
		gpu_nccl_result_t r = c->nc->comm_get_async_error(c->comm, &async);
		if (r != GPU_NCCL_SUCCESS || (async != GPU_NCCL_SUCCESS && async != GPU_NCCL_IN_PROGRESS)) {
			char where[160];
			snprintf(where, sizeof(where), "%s, rank %d of %d", what, c->rank, c->g->n);
			td_err e = gpu_nccl_check(c->nc, r != GPU_NCCL_SUCCESS ? r : async, c->comm, where, eb);
			nccl_abort(c);
			return rank_fail(c, e, eb);
		}
		bool pending = async == GPU_NCCL_IN_PROGRESS;
		if (!pending && side) {
			int d = c->side_fn.query(c->side);
			if (d < 0) {
				char err[sizeof(eb->msg)];
				struct td_errbuf why = {{0}};
				td_err e = c->side_fn.error(c->side, &why);
				snprintf(err, sizeof(err), "%s", why.msg);
				nccl_abort(c);
				return rank_fail(c, td_fail(eb, e, "%s, rank %d of %d: %s", what, c->rank, c->g->n,
							    err), eb);
			}
			pending = d == 0;
		}
		if (!pending)
			return TD_OK;
		if (mono_us() - start >= (int64_t)timeout_ms * 1000) {
			nccl_abort(c);
			return rank_fail(c, td_fail(eb, TD_EDEVICE,
						    "%s, rank %d of %d: no progress in %d ms (a rank is stuck); "
						    "its communicator was aborted",
						    what, c->rank, c->g->n, timeout_ms), eb);
		}
		/* A collective's enqueue (a nonblocking communicator's call runs on
		 * NCCL's own thread) takes tens of microseconds, and a backward
		 * makes a hundred: spun for, yielding, the first 200 us — a sleep
		 * lasts the timer's slack (~50 us) at least. Then sleeps. */
		if (!side && mono_us() - start < 200) {
			sched_yield();
			continue;
		}
		struct timespec ts = {0, sleep_ns};
		nanosleep(&ts, NULL);
		if (sleep_ns < 50000) /* at most 64 us late: the step waits on it */
			sleep_ns *= 2;
	}
}

static td_err side_resolve(struct side_fns *f, struct td_errbuf *eb)
{
	static const char *const names[] = {"gpu_cuda_side_new",   "gpu_cuda_side_stream",
					    "gpu_cuda_side_fork",  "gpu_cuda_side_query",
					    "gpu_cuda_side_error", "gpu_cuda_side_free",
					    "gpu_cuda_side_record", "gpu_cuda_side_event_query",
					    "gpu_cuda_side_join"};
	void *p[9];
	for (int k = 0; k < 9; k++)
		if (!(p[k] = gpu_cuda_module_sym(names[k], eb)))
			return TD_EUNSUPPORTED;
	/* Function pointers all share one representation on this ABI. */
	memcpy(&f->new_, &p[0], sizeof(p[0]));
	memcpy(&f->stream, &p[1], sizeof(p[1]));
	memcpy(&f->fork, &p[2], sizeof(p[2]));
	memcpy(&f->query, &p[3], sizeof(p[3]));
	memcpy(&f->error, &p[4], sizeof(p[4]));
	memcpy(&f->free_, &p[5], sizeof(p[5]));
	memcpy(&f->record, &p[6], sizeof(p[6]));
	memcpy(&f->event_query, &p[7], sizeof(p[7]));
	memcpy(&f->join, &p[8], sizeof(p[8]));
	return TD_OK;
}

/* The NCCL end of rank c->rank; collective (the id goes from rank 0 to the
 * others through the gang). */
static td_err nccl_new(struct gpu_comm *c, struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	td_err e = TD_OK;
	if (strcmp(c->be->ops->name, "cuda") != 0)
		e = td_fail(eb, TD_EUNSUPPORTED, "NCCL collectives need the CUDA backend, not %s",
			    c->be->ops->name);
	if (e == TD_OK)
		e = gpu_nccl_get(&c->nc, eb);
	if (e == TD_OK)
		e = side_resolve(&c->side_fn, eb);
	if (e == TD_OK)
		e = c->side_fn.new_(c->be, &c->side, eb);
	if (e == TD_OK && c->rank == 0) {
		pthread_mutex_lock(&g->mu);
		e = gpu_nccl_check(c->nc, c->nc->get_unique_id(&g->id), NULL, "ncclGetUniqueId", eb);
		g->id_ok = e == TD_OK;
		pthread_mutex_unlock(&g->mu);
	}
	if (e != TD_OK)
		return rank_fail(c, e, eb);
	/* The id to every rank: through memory, or (a gang of a hub) rank 0's
	 * bytes broadcast by the hub with the barrier. */
	struct gpu_nccl_id id;
	if (g->net) {
		pthread_mutex_lock(&g->mu);
		id = g->id; /* rank 0's; the others' is overwritten */
		pthread_mutex_unlock(&g->mu);
		if ((e = gpu__net_barrier(g, c->rank, &id, sizeof(id), eb)) != TD_OK)
			return e;
	} else {
		if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
			return e;
		pthread_mutex_lock(&g->mu);
		id = g->id;
		pthread_mutex_unlock(&g->mu);
	}
	snprintf(c->name, sizeof(c->name), "nccl %d.%d.%d", c->nc->version / 10000,
		 c->nc->version / 100 % 100, c->nc->version % 100);
	struct gpu_nccl_config cfg = gpu_nccl_config_init(false);
	gpu_nccl_result_t r = c->nc->comm_init_rank_config(&c->comm, g->n, id, c->rank, &cfg);
	if (r != GPU_NCCL_SUCCESS && r != GPU_NCCL_IN_PROGRESS) {
		char where[96];
		snprintf(where, sizeof(where), "ncclCommInitRankConfig, rank %d of %d", c->rank, g->n);
		e = gpu_nccl_check(c->nc, r, NULL, where, eb);
		c->comm = NULL;
		return rank_fail(c, e, eb);
	}
	/* Set-up connects the ranks: never held to less than a minute, whatever
	 * a test asks of the collectives. */
	int setup_ms = g->timeout_ms > 60000 ? g->timeout_ms : 60000;
	if ((e = nccl_poll(c, false, setup_ms, "NCCL communicator set-up", eb)) != TD_OK)
		return e;
	/* Every rank's communicator is ready before any sum is enqueued. */
	return gpu_gang_barrier(g, c->rank, eb);
}

td_err gpu_comm_new(struct gpu_comm **out, struct gpu_gang *g, int rank, struct gpu_backend *be,
		    enum gpu_comm_kind kind, struct td_errbuf *eb)
{
	struct gpu_comm *c = calloc(1, sizeof(*c));
	if (!c) {
		td_err e = td_fail(eb, TD_ENOMEM, "comm: out of memory");
		gpu_gang_fail(g, rank, e, eb ? eb->msg : NULL);
		return e;
	}
	if (kind == GPU_COMM_AUTO)
		kind = strcmp(be->ops->name, "cuda") == 0 ? GPU_COMM_NCCL : GPU_COMM_HOST;
	c->kind = kind;
	c->g = g;
	c->rank = rank;
	c->be = be;
	snprintf(c->name, sizeof(c->name), "host");
	td_err e = kind == GPU_COMM_NCCL ? nccl_new(c, eb) : gpu_gang_barrier(g, rank, eb);
	if (e != TD_OK) {
		gpu_comm_free(c);
		return e;
	}
	*out = c;
	return TD_OK;
}

void gpu_comm_free(struct gpu_comm *c)
{
	if (!c)
		return;
	/* Every sum was waited for, or the job failed: an abort frees the
	 * communicator without a rendezvous with peers that may be gone. */
	nccl_abort(c);
	if (c->side)
		c->side_fn.free_(c->side);
	free(c->buf);
	free(c);
}

const char *gpu_comm_name(const struct gpu_comm *c)
{
	return c->name;
}

bool gpu_comm_async(const struct gpu_comm *c)
{
	return c->kind == GPU_COMM_NCCL;
}

bool gpu_comm_can_broadcast(const struct gpu_comm *c)
{
	return c->kind == GPU_COMM_NCCL || !c->g->net;
}

void gpu_comm_stats(const struct gpu_comm *c, struct gpu_comm_stats *out)
{
	*out = c->stats;
}

/* Host: room for n floats in the staging buffer. */
static td_err host_reserve(struct gpu_comm *c, size_t n, const char *what, struct td_errbuf *eb)
{
	if (n <= c->cap)
		return TD_OK;
	float *b = realloc(c->buf, n * sizeof(float));
	if (!b)
		return rank_fail(c, td_fail(eb, TD_ENOMEM, "%s: out of memory for %zu floats", what, n),
				 eb);
	c->buf = b;
	c->cap = n;
	return TD_OK;
}

/* Host: download, sum slices in rank order, upload. */
static td_err host_all_reduce(struct gpu_comm *c, float *x, size_t n, struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	td_err e = host_reserve(c, n, "all-reduce", eb);
	if (e != TD_OK)
		return e;
	gpu_download(c->be, c->buf, x, n * sizeof(float));
	if (g->net) {
		if ((e = gpu__net_all_reduce(g, c->rank, c->buf, n, eb)) == TD_OK)
			gpu_upload(c->be, x, c->buf, n * sizeof(float));
		return e;
	}
	pthread_mutex_lock(&g->mu);
	g->slot[c->rank] = c->buf;
	pthread_mutex_unlock(&g->mu);
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	/* This rank's slice of every buffer; the others' slices are theirs. */
	size_t lo = n * (size_t)c->rank / (size_t)g->n, hi = n * (size_t)(c->rank + 1) / (size_t)g->n;
	float *s[GPU_GANG_MAX];
	for (int j = 0; j < g->n; j++)
		s[j] = g->slot[j];
	for (size_t i = lo; i < hi; i++) {
		float v = s[0][i];
		for (int j = 1; j < g->n; j++)
			v += s[j][i];
		for (int j = 0; j < g->n; j++)
			s[j][i] = v;
	}
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	gpu_upload(c->be, x, c->buf, n * sizeof(float));
	return TD_OK;
}

/* Host reduce-scatter: every rank's whole buffer published, each rank sums
 * its own part over the ranks in rank order (the all-reduce's bits) and
 * uploads it. The second barrier keeps the slots alive until all have read. */
static td_err host_reduce_scatter(struct gpu_comm *c, float *x, size_t count, struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	size_t n = count * (size_t)g->n;
	td_err e = host_reserve(c, n, "reduce-scatter", eb);
	if (e != TD_OK)
		return e;
	gpu_download(c->be, c->buf, x, n * sizeof(float));
	size_t lo = count * (size_t)c->rank;
	if (g->net) {
		if ((e = gpu__net_reduce_scatter(g, c->rank, c->buf, count, eb)) == TD_OK)
			gpu_upload(c->be, x + lo, c->buf + lo, count * sizeof(float));
		return e;
	}
	pthread_mutex_lock(&g->mu);
	g->slot[c->rank] = c->buf;
	pthread_mutex_unlock(&g->mu);
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	float *own = g->slot[c->rank];
	for (size_t i = lo; i < lo + count; i++) {
		float v = g->slot[0][i];
		for (int j = 1; j < g->n; j++)
			v += g->slot[j][i];
		own[i] = v; /* read by no other rank: its part is this rank's */
	}
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	gpu_upload(c->be, x + lo, c->buf + lo, count * sizeof(float));
	return TD_OK;
}

/* Host all-gather: every rank's own part (read from send: x + rank *
 * count in place) published, each rank uploads the others' into its x,
 * and its own where it came from elsewhere. Bytes: no arithmetic. */
static td_err host_all_gather(struct gpu_comm *c, const float *send, float *x, size_t count,
			      struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	const size_t lo = count * (size_t)c->rank;
	const bool own = send != x + lo;
	if (g->net) {
		size_t n = count * (size_t)g->n;
		td_err e = host_reserve(c, n, "all-gather", eb);
		if (e != TD_OK)
			return e;
		gpu_download(c->be, c->buf + lo, send, count * sizeof(float));
		if ((e = gpu__net_all_gather(g, c->rank, c->buf, count, eb)) != TD_OK)
			return e;
		if (own)
			gpu_upload(c->be, x, c->buf, n * sizeof(float));
		if (!own && lo)
			gpu_upload(c->be, x, c->buf, lo * sizeof(float));
		if (!own && lo + count < n)
			gpu_upload(c->be, x + lo + count, c->buf + lo + count,
				   (n - lo - count) * sizeof(float));
		return TD_OK;
	}
	td_err e = host_reserve(c, count, "all-gather", eb);
	if (e != TD_OK)
		return e;
	gpu_download(c->be, c->buf, send, count * sizeof(float));
	pthread_mutex_lock(&g->mu);
	g->slot[c->rank] = c->buf;
	pthread_mutex_unlock(&g->mu);
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	for (int j = 0; j < g->n; j++)
		if (j != c->rank || own)
			gpu_upload(c->be, x + count * (size_t)j, g->slot[j], count * sizeof(float));
	return gpu_gang_barrier(g, c->rank, eb);
}

/* Host reduce: every rank's x published, the root sums them in rank order
 * and uploads the sum into y; the second barrier keeps the others' copies
 * alive until it has read them. */
static td_err host_reduce(struct gpu_comm *c, const float *x, size_t n, int root, float *y,
			  struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	td_err e = host_reserve(c, n, "reduce", eb);
	if (e != TD_OK)
		return e;
	gpu_download(c->be, c->buf, x, n * sizeof(float));
	if (g->net) { /* across processes: the hub's all-reduce, the same sums; the root keeps its */
		if ((e = gpu__net_all_reduce(g, c->rank, c->buf, n, eb)) == TD_OK && c->rank == root)
			gpu_upload(c->be, y, c->buf, n * sizeof(float));
		return e;
	}
	pthread_mutex_lock(&g->mu);
	g->slot[c->rank] = c->buf;
	pthread_mutex_unlock(&g->mu);
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	if (c->rank == root)
		for (size_t i = 0; i < n; i++) {
			float v = g->slot[0][i];
			for (int j = 1; j < g->n; j++)
				v += g->slot[j][i];
			c->buf[i] = v; /* the root's own slot: read by no other rank */
		}
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	if (c->rank == root)
		gpu_upload(c->be, y, c->buf, n * sizeof(float));
	return TD_OK;
}

/* Host broadcast: the root's x published, every rank uploads it into its
 * y; the second barrier keeps the root's copy alive until all have read. */
static td_err host_broadcast(struct gpu_comm *c, const float *x, size_t n, int root, float *y,
			     struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	if (g->net) /* sharded state stays in one process (proto/jobspec.c) */
		return rank_fail(c, td_fail(eb, TD_EUNSUPPORTED,
					    "broadcast: not across processes (sharded weights)"), eb);
	td_err e = host_reserve(c, n, "broadcast", eb);
	if (e != TD_OK)
		return e;
	if (c->rank == root)
		gpu_download(c->be, c->buf, x, n * sizeof(float));
	pthread_mutex_lock(&g->mu);
	g->slot[c->rank] = c->buf;
	pthread_mutex_unlock(&g->mu);
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	gpu_upload(c->be, y, g->slot[root], n * sizeof(float));
	return gpu_gang_barrier(g, c->rank, eb);
}

/* Host broadcast of n bf16 values (bytes: no arithmetic), as host_broadcast. */
static td_err host_broadcast16(struct gpu_comm *c, const void *x, size_t n, int root, void *y,
			       struct td_errbuf *eb)
{
	struct gpu_gang *g = c->g;
	if (g->net)
		return rank_fail(c, td_fail(eb, TD_EUNSUPPORTED,
					    "broadcast: not across processes (sharded weights)"), eb);
	td_err e = host_reserve(c, (n + 1) / 2, "broadcast", eb);
	if (e != TD_OK)
		return e;
	if (c->rank == root)
		gpu_download(c->be, c->buf, x, n * 2);
	pthread_mutex_lock(&g->mu);
	g->slot[c->rank] = c->buf;
	pthread_mutex_unlock(&g->mu);
	if ((e = gpu_gang_barrier(g, c->rank, eb)) != TD_OK)
		return e;
	if (c->rank != root) /* the root's y is x, or written by its caller */
		gpu_upload(c->be, y, g->slot[root], n * 2);
	return gpu_gang_barrier(g, c->rank, eb);
}

enum coll { COLL_ALL_REDUCE, COLL_REDUCE_SCATTER, COLL_ALL_GATHER, COLL_REDUCE, COLL_BROADCAST,
	    COLL_BROADCAST16 };

/* One NCCL collective enqueued on the side stream (after the backend's work
 * so far); n: x's floats; COLL_REDUCE: onto rank root's y. */
static td_err nccl_coll(struct gpu_comm *c, enum coll k, float *x, size_t n, size_t count,
			int root, float *y, struct td_errbuf *eb)
{
	static const char *const names[] = {"all-reduce", "reduce-scatter", "all-gather", "reduce",
					    "broadcast", "broadcast"};
	if (!c->comm)
		return rank_fail(c, td_fail(eb, TD_EDEVICE, "%s, rank %d: no communicator", names[k],
					    c->rank), eb);
	c->side_fn.fork(c->side);
	void *st = c->side_fn.stream(c->side);
	float *own = x + count * (size_t)c->rank;
	gpu_nccl_result_t r;
	if (k == COLL_ALL_REDUCE)
		r = c->nc->all_reduce(x, x, n, GPU_NCCL_FLOAT32, GPU_NCCL_SUM, c->comm, st);
	else if (k == COLL_REDUCE_SCATTER) /* in place: recv is send + rank * count */
		r = c->nc->reduce_scatter(x, own, count, GPU_NCCL_FLOAT32, GPU_NCCL_SUM, c->comm, st);
	else if (k == COLL_ALL_GATHER) /* send: y, or in place (recv + rank * count) */
		r = c->nc->all_gather(y ? y : own, x, count, GPU_NCCL_FLOAT32, c->comm, st);
	else if (k == COLL_REDUCE) /* recv is read on the root only */
		r = c->nc->reduce(x, c->rank == root ? y : x, n, GPU_NCCL_FLOAT32, GPU_NCCL_SUM, root,
				  c->comm, st);
	else if (k == COLL_BROADCAST) /* send is read on the root only */
		r = c->nc->broadcast(c->rank == root ? x : y, y, n, GPU_NCCL_FLOAT32, root, c->comm, st);
	else /* n bf16 values */
		r = c->nc->broadcast(c->rank == root ? x : y, y, n, GPU_NCCL_BFLOAT16, root, c->comm, st);
	c->pending = true;
	if (c->grouped && (r == GPU_NCCL_SUCCESS || r == GPU_NCCL_IN_PROGRESS))
		return TD_OK; /* launched, and its event recorded, by gpu_comm_group_end */
	if (r == GPU_NCCL_IN_PROGRESS) { /* complete the call before the next one */
		td_err e = nccl_poll(c, false, c->g->timeout_ms, names[k], eb);
		if (e != TD_OK)
			return e;
		r = GPU_NCCL_SUCCESS;
	}
	/* its completion, for gpu_comm_wait_for: an event after it on the side
	 * stream (the call is enqueued by now) */
	if (r == GPU_NCCL_SUCCESS)
		c->side_fn.record(c->side, (int)((c->started - 1) % COMM_EVENTS));
	if (r != GPU_NCCL_SUCCESS) {
		char where[96];
		snprintf(where, sizeof(where), "%s of %zu floats, rank %d of %d", names[k], n, c->rank,
			 c->g->n);
		td_err e = gpu_nccl_check(c->nc, r, c->comm, where, eb);
		nccl_abort(c);
		return rank_fail(c, e, eb);
	}
	return TD_OK;
}

/* Every collective's start: a failed gang stops it (aborting NCCL), else
 * the call and its n floats are counted. */
static td_err coll_begin(struct gpu_comm *c, size_t n, struct td_errbuf *eb)
{
	if (gpu_gang_failed(c->g)) {
		nccl_abort(c);
		return gang_stopped(c->g, c->rank, eb);
	}
	c->stats.calls++;
	c->stats.floats += n;
	c->started++;
	if (c->kind == GPU_COMM_HOST)
		c->done = c->started; /* complete when the call returns */
	return TD_OK;
}

td_err gpu_comm_reduce_scatter_sum(struct gpu_comm *c, float *x, size_t count,
				   struct td_errbuf *eb)
{
	size_t n = count * (size_t)c->g->n;
	td_err e = coll_begin(c, n, eb);
	if (e != TD_OK)
		return e;
	if (c->kind == GPU_COMM_HOST)
		return host_reduce_scatter(c, x, count, eb);
	return nccl_coll(c, COLL_REDUCE_SCATTER, x, n, count, 0, NULL, eb);
}

td_err gpu_comm_all_gather(struct gpu_comm *c, float *x, size_t count, struct td_errbuf *eb)
{
	return gpu_comm_all_gather_from(c, x + count * (size_t)c->rank, x, count, eb);
}

td_err gpu_comm_all_gather_from(struct gpu_comm *c, const float *send, float *x, size_t count,
				struct td_errbuf *eb)
{
	size_t n = count * (size_t)c->g->n;
	td_err e = coll_begin(c, n, eb);
	if (e != TD_OK)
		return e;
	if (c->kind == GPU_COMM_HOST)
		return host_all_gather(c, send, x, count, eb);
	float *own = x + count * (size_t)c->rank;
	return nccl_coll(c, COLL_ALL_GATHER, x, n, count, 0, send == own ? NULL : (float *)send, eb);
}

td_err gpu_comm_all_reduce_sum(struct gpu_comm *c, float *x, size_t n, struct td_errbuf *eb)
{
	td_err e = coll_begin(c, n, eb);
	if (e != TD_OK)
		return e;
	if (c->kind == GPU_COMM_HOST)
		return host_all_reduce(c, x, n, eb);
	return nccl_coll(c, COLL_ALL_REDUCE, x, n, 0, 0, NULL, eb);
}

/* coll_begin for a collective with a root: the root is one of the gang's
 * ranks (what: "reduce onto", "broadcast from"), else the rank fails. */
static td_err rooted_begin(struct gpu_comm *c, const char *what, int root, size_t n,
			   struct td_errbuf *eb)
{
	if (root < 0 || root >= c->g->n)
		return rank_fail(c, td_fail(eb, TD_EINTERNAL, "%s rank %d of %d", what, root, c->g->n),
				 eb);
	return coll_begin(c, n, eb);
}

td_err gpu_comm_reduce_sum(struct gpu_comm *c, const float *x, size_t n, int root, float *y,
			   struct td_errbuf *eb)
{
	td_err e = rooted_begin(c, "reduce onto", root, n, eb);
	if (e != TD_OK)
		return e;
	if (c->kind == GPU_COMM_HOST)
		return host_reduce(c, x, n, root, y, eb);
	return nccl_coll(c, COLL_REDUCE, (float *)x, n, 0, root, y, eb);
}

td_err gpu_comm_broadcast(struct gpu_comm *c, const float *x, size_t n, int root, float *y,
			  struct td_errbuf *eb)
{
	td_err e = rooted_begin(c, "broadcast from", root, n, eb);
	if (e != TD_OK)
		return e;
	if (c->kind == GPU_COMM_HOST)
		return host_broadcast(c, x, n, root, y, eb);
	return nccl_coll(c, COLL_BROADCAST, (float *)x, n, 0, root, y, eb);
}

td_err gpu_comm_broadcast16(struct gpu_comm *c, const void *x, size_t n, int root, void *y,
			    struct td_errbuf *eb)
{
	td_err e = rooted_begin(c, "broadcast from", root, (n + 1) / 2, eb);
	if (e != TD_OK)
		return e;
	if (c->kind == GPU_COMM_HOST)
		return host_broadcast16(c, x, n, root, y, eb);
	return nccl_coll(c, COLL_BROADCAST16, (float *)x, n, 0, root, (float *)y, eb);
}

td_err gpu_comm_sum_host(struct gpu_comm *c, double *v, struct td_errbuf *eb)
{
	bool any = false;
	return gpu_gang_exchange(c->g, c->rank, v, 1, &any, eb);
}

void gpu_comm_group_begin(struct gpu_comm *c)
{
	assert(!c->grouped);
	if (c->kind != GPU_COMM_NCCL || !c->comm)
		return;
	if (c->nc->group_start() != GPU_NCCL_SUCCESS)
		return; /* not grouped: each call then launches on its own */
	c->grouped = true;
	c->group_first = c->started;
}

td_err gpu_comm_group_end(struct gpu_comm *c, struct td_errbuf *eb)
{
	if (!c->grouped)
		return TD_OK;
	c->grouped = false;
	if (!c->comm) /* aborted inside the group: the call said why */
		return rank_fail(c, td_fail(eb, TD_EDEVICE, "rank %d: the communicator was aborted",
					    c->rank), eb);
	gpu_nccl_result_t r = c->nc->group_end();
	if (r == GPU_NCCL_IN_PROGRESS) {
		td_err e = nccl_poll(c, false, c->g->timeout_ms, "a group of collectives", eb);
		if (e != TD_OK)
			return e;
		r = GPU_NCCL_SUCCESS;
	}
	if (r != GPU_NCCL_SUCCESS) {
		char where[96];
		snprintf(where, sizeof(where), "a group of %llu collectives, rank %d of %d",
			 (unsigned long long)(c->started - c->group_first), c->rank, c->g->n);
		td_err e = gpu_nccl_check(c->nc, r, c->comm, where, eb);
		nccl_abort(c);
		return rank_fail(c, e, eb);
	}
	/* every grouped collective's event, after all of them (launched now) */
	for (uint64_t i = c->group_first; i < c->started; i++)
		c->side_fn.record(c->side, (int)(i % COMM_EVENTS));
	return TD_OK;
}

uint64_t gpu_comm_mark(const struct gpu_comm *c)
{
	return c->started;
}

/* What waiting for the collectives before mark takes: -1 nothing more
 * (*e says how it went: a failed gang stopped, complete already, or waited
 * for on the host with every other, its event having been recorded again
 * since), else the side stream's event k to wait on (collective mark - 1's:
 * the side stream is in order, so the earlier ones are complete with it). */
static int mark_event(struct gpu_comm *c, uint64_t mark, td_err *e, struct td_errbuf *eb)
{
	*e = TD_OK;
	if (gpu_gang_failed(c->g)) {
		nccl_abort(c);
		*e = gang_stopped(c->g, c->rank, eb);
		return -1;
	}
	if (mark <= c->done || c->kind == GPU_COMM_HOST || !c->pending)
		return -1;
	if (c->started - mark >= COMM_EVENTS) {
		*e = gpu_comm_wait(c, eb);
		return -1;
	}
	return (int)((mark - 1) % COMM_EVENTS);
}

td_err gpu_comm_wait_for(struct gpu_comm *c, uint64_t mark, struct td_errbuf *eb)
{
	td_err e;
	const int k = mark_event(c, mark, &e, eb);
	if (k < 0)
		return e;
	/* polled as nccl_poll polls */
	int64_t start = mono_us();
	long sleep_ns = 2000;
	for (;;) {
		int d = c->side_fn.event_query(c->side, k);
		if (d == 1) {
			c->done = mark;
			return TD_OK;
		}
		if (d < 0 || gpu_gang_failed(c->g))
			return gpu_comm_wait(c, eb); /* says why, aborting as it does */
		if (mono_us() - start >= (int64_t)c->g->timeout_ms * 1000) {
			nccl_abort(c);
			return rank_fail(c, td_fail(eb, TD_EDEVICE,
						    "collective %llu, rank %d of %d: not complete in %d ms "
						    "(a rank is stuck); its communicator was aborted",
						    (unsigned long long)mark - 1, c->rank, c->g->n,
						    c->g->timeout_ms), eb);
		}
		struct timespec ts = {0, sleep_ns};
		nanosleep(&ts, NULL);
		if (sleep_ns < 50000)
			sleep_ns *= 2;
	}
}

td_err gpu_comm_after(struct gpu_comm *c, uint64_t mark, struct td_errbuf *eb)
{
	td_err e;
	const int k = mark_event(c, mark, &e, eb);
	if (k >= 0)
		c->side_fn.join(c->side, k);
	return e;
}

td_err gpu_comm_wait(struct gpu_comm *c, struct td_errbuf *eb)
{
	if (gpu_gang_failed(c->g)) {
		nccl_abort(c);
		return gang_stopped(c->g, c->rank, eb);
	}
	if (c->kind == GPU_COMM_HOST || !c->pending)
		return TD_OK;
	td_err e = nccl_poll(c, true, c->g->timeout_ms, "collectives of the step", eb);
	if (e == TD_OK) {
		c->pending = false;
		c->done = c->started;
	}
	return e;
}
