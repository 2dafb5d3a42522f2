/* Inside the gang (gpu/comm.c) and its part across processes
 * (gpu/gangnet.c): not an API. */
#ifndef GPU_COMM_INTERNAL_H
#define GPU_COMM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "gpu/comm.h"
#include "gpu/nccl.h"

struct gpu__net;

struct gpu_gang {
	int n; /* the ranks of the whole gang */
	int timeout_ms;
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int arrived;
	uint64_t gen;
	atomic_bool failed;
	td_err err;
	int err_rank;
	char err_msg[1024];
	/* host comms: each rank's staging buffer, published before a barrier */
	float *slot[GPU_GANG_MAX];
	/* gpu_gang_exchange: each rank's doubles and flag, published likewise */
	double *dslot[GPU_GANG_MAX];
	bool fslot[GPU_GANG_MAX];
	/* nccl: rank 0's unique id, published before a barrier */
	struct gpu_nccl_id id;
	bool id_ok;
	/* A gang of a hub (gpu_gang_new_net): this process's connection to it;
	 * NULL in-process. Its ranks here are base .. base + nlocal - 1. */
	struct gpu__net *net;
	int base, nlocal;
	/* gpu_gang_set_abort */
	const atomic_bool *abort;
	const char *abort_why; /* read once *abort is true */
};

/* Fails the gang if its abort flag is set (and it has not failed yet);
 * true when it did. g->mu not held. */
bool gpu__gang_poll_abort(struct gpu_gang *g, int rank);

/* The first failure recorded (true: this call's) and the waiters woken. */
bool gpu__gang_fail_first(struct gpu_gang *g, int rank, td_err e, const char *msg);
/* The gang's failure as rank `rank` reports it (g->mu not held). */
td_err gpu__gang_stopped(struct gpu_gang *g, int rank, struct td_errbuf *eb);

/* gpu/gangnet.c: a gang of a hub. Each blocks until the hub answers or
 * the gang fails; a failure of this rank's own fails the gang. */
/* A barrier; rank 0's len bytes at buf (in) reach every rank's buf (out). */
td_err gpu__net_barrier(struct gpu_gang *g, int rank, void *buf, size_t len, struct td_errbuf *eb);
td_err gpu__net_exchange(struct gpu_gang *g, int rank, double *v, size_t n, bool *flag,
			 struct td_errbuf *eb);
/* The host comm's collectives over the hub (x in host memory: the
 * comm's staging buffer). all-reduce: n floats summed; reduce-scatter: x
 * holds nranks * count, afterwards this rank's part of the sum; all-gather:
 * x holds nranks * count, afterwards every rank's part. */
td_err gpu__net_all_reduce(struct gpu_gang *g, int rank, float *x, size_t n, struct td_errbuf *eb);
td_err gpu__net_reduce_scatter(struct gpu_gang *g, int rank, float *x, size_t count,
			       struct td_errbuf *eb);
td_err gpu__net_all_gather(struct gpu_gang *g, int rank, float *x, size_t count,
			   struct td_errbuf *eb);
/* This process's first failure, to the hub (which tells the others). */
void gpu__net_send_fail(struct gpu_gang *g, int rank, td_err e, const char *msg);
/* Closes the connection and joins its reader (gpu_gang_free). */
void gpu__net_close(struct gpu_gang *g);

#endif
