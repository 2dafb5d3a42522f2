/* NCCL, the engine of the collectives a job on several GPUs needs
 * (all-reduce of gradients, reduce-scatter and all-gather of sharded state,
 * broadcast of the initial weights), loaded at run time.
 *
 * As libcuda and cuBLAS are (contract 5), libnccl.so.2 is opened with dlopen,
 * never linked: traind, trainctl and the tests start and run on a host
 * without it, and a job that needs it fails with TD_EUNSUPPORTED naming the
 * library. Its entry points are resolved once into a typed table
 * (struct gpu_nccl); the types and constants used are declared here, with
 * NCCL's values, so that no nccl.h is needed to build (tests/unit/
 * test_nccl_abi.c checks them against a real nccl.h where one is found).
 *
 * No hang: a communicator is made nonblocking (config.blocking = 0), so that
 * no NCCL call waits on a peer; gpu_nccl_wait polls each communicator's
 * asynchronous error (and the caller's own completion test, e.g. a stream
 * query) until done, and on an error of any rank or a timeout aborts every
 * communicator of the job (ncclCommAbort) and returns the error. One rank's
 * CUDA or NCCL failure thus fails the job on every rank, in bounded time.
 *
 * Not here: which buffers are reduced, streams, ranks' threads (the
 * data-parallel trainer's business), and no collective of our own. */
#ifndef GPU_NCCL_H
#define GPU_NCCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"

/* ------------------------------------------------------------------------ */
/* NCCL's types, as nccl.h declares them (ABI-compatible, our names) */

/* ncclResult_t */
enum gpu_nccl_result {
	GPU_NCCL_SUCCESS = 0,
	GPU_NCCL_UNHANDLED_CUDA_ERROR = 1,
	GPU_NCCL_SYSTEM_ERROR = 2,
	GPU_NCCL_INTERNAL_ERROR = 3,
	GPU_NCCL_INVALID_ARGUMENT = 4,
	GPU_NCCL_INVALID_USAGE = 5,
	GPU_NCCL_REMOTE_ERROR = 6,
	GPU_NCCL_IN_PROGRESS = 7,
};
typedef int gpu_nccl_result_t; /* an enum gpu_nccl_result as the library returns it */

/* ncclDataType_t */
enum gpu_nccl_dtype {
	GPU_NCCL_INT8 = 0,
	GPU_NCCL_UINT8 = 1,
	GPU_NCCL_INT32 = 2,
	GPU_NCCL_UINT32 = 3,
	GPU_NCCL_INT64 = 4,
	GPU_NCCL_UINT64 = 5,
	GPU_NCCL_FLOAT16 = 6,
	GPU_NCCL_FLOAT32 = 7,
	GPU_NCCL_FLOAT64 = 8,
	GPU_NCCL_BFLOAT16 = 9,
};

/* ncclRedOp_t */
enum gpu_nccl_op {
	GPU_NCCL_SUM = 0,
	GPU_NCCL_PROD = 1,
	GPU_NCCL_MAX = 2,
	GPU_NCCL_MIN = 3,
	GPU_NCCL_AVG = 4,
};

/* ncclComm_t: an opaque pointer. */
typedef struct gpu_nccl_comm_s *gpu_nccl_comm;

/* ncclUniqueId: what rank 0 makes and every rank passes to init. */
#define GPU_NCCL_UNIQUE_ID_BYTES 128
struct gpu_nccl_id {
	char internal[GPU_NCCL_UNIQUE_ID_BYTES];
};

/* ncclConfig_t as of NCCL 2.14, the first with nonblocking communicators.
 * NCCL reads a config by its size and version, and gives the fields a later
 * version added their defaults, so this prefix is valid for every NCCL
 * since. Fill it with gpu_nccl_config_init. */
struct gpu_nccl_config {
	size_t size;
	unsigned int magic;   /* GPU_NCCL_CONFIG_MAGIC */
	unsigned int version; /* GPU_NCCL_CONFIG_VERSION */
	int blocking;         /* 0: nonblocking (calls may return IN_PROGRESS) */
	int cga_cluster_size;
	int min_ctas;
	int max_ctas;
	const char *net_name;
};
#define GPU_NCCL_CONFIG_MAGIC 0xcafebeefu
#define GPU_NCCL_VERSION_CODE(x, y, z) ((x) * 10000 + (y) * 100 + (z)) /* for 2.9 and later */
#define GPU_NCCL_CONFIG_VERSION GPU_NCCL_VERSION_CODE(2, 14, 3)
#define GPU_NCCL_CONFIG_UNDEF_INT INT32_MIN

/* The oldest NCCL this loader accepts: nonblocking communicators and
 * ncclCommInitRankConfig. */
#define GPU_NCCL_MIN_VERSION GPU_NCCL_VERSION_CODE(2, 14, 0)

/* Every field NCCL's default, blocking as given. */
static inline struct gpu_nccl_config gpu_nccl_config_init(bool blocking)
{
	return (struct gpu_nccl_config){
		.size = sizeof(struct gpu_nccl_config),
		.magic = GPU_NCCL_CONFIG_MAGIC,
		.version = GPU_NCCL_CONFIG_VERSION,
		.blocking = blocking ? 1 : 0,
		.cga_cluster_size = GPU_NCCL_CONFIG_UNDEF_INT,
		.min_ctas = GPU_NCCL_CONFIG_UNDEF_INT,
		.max_ctas = GPU_NCCL_CONFIG_UNDEF_INT,
		.net_name = NULL,
	};
}

/* ------------------------------------------------------------------------ */
/* The library */

/* The resolved entry points. Streams are CUDA streams (cudaStream_t /
 * CUstream), passed as void *. Every call may return IN_PROGRESS on a
 * nonblocking communicator: complete it with gpu_nccl_wait before the next
 * call on that communicator. */
struct gpu_nccl {
	void *handle;    /* dlopen's */
	char path[256];  /* what was opened */
	int version;     /* ncclGetVersion: 22809 for 2.28.9 */

	gpu_nccl_result_t (*get_version)(int *version);
	gpu_nccl_result_t (*get_unique_id)(struct gpu_nccl_id *id);
	gpu_nccl_result_t (*comm_init_rank)(gpu_nccl_comm *comm, int nranks, struct gpu_nccl_id id,
					    int rank);
	gpu_nccl_result_t (*comm_init_rank_config)(gpu_nccl_comm *comm, int nranks,
						   struct gpu_nccl_id id, int rank,
						   struct gpu_nccl_config *config);
	gpu_nccl_result_t (*comm_abort)(gpu_nccl_comm comm);
	gpu_nccl_result_t (*comm_destroy)(gpu_nccl_comm comm);
	gpu_nccl_result_t (*comm_finalize)(gpu_nccl_comm comm);
	gpu_nccl_result_t (*comm_get_async_error)(gpu_nccl_comm comm, gpu_nccl_result_t *async_error);
	gpu_nccl_result_t (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op,
					gpu_nccl_comm comm, void *stream);
	gpu_nccl_result_t (*reduce_scatter)(const void *send, void *recv, size_t recv_count,
					    int dtype, int op, gpu_nccl_comm comm, void *stream);
	gpu_nccl_result_t (*all_gather)(const void *send, void *recv, size_t send_count, int dtype,
					gpu_nccl_comm comm, void *stream);
	gpu_nccl_result_t (*broadcast)(const void *send, void *recv, size_t count, int dtype,
				       int root, gpu_nccl_comm comm, void *stream);
	gpu_nccl_result_t (*reduce)(const void *send, void *recv, size_t count, int dtype, int op,
				    int root, gpu_nccl_comm comm, void *stream);
	gpu_nccl_result_t (*group_start)(void);
	gpu_nccl_result_t (*group_end)(void);
	const char *(*get_error_string)(gpu_nccl_result_t result);
	/* Optional (NULL when the library lacks it): the last error's text. */
	const char *(*get_last_error)(gpu_nccl_comm comm);
};

/* Opens the library at path (NULL: $TD_NCCL_LIBRARY when set, else
 * "libnccl.so.2", found as the dynamic loader finds libraries), resolves
 * every entry point above and checks the version (>= GPU_NCCL_MIN_VERSION).
 * The caller owns *nc (caller-allocated) until gpu_nccl_close.
 *
 * Errors: TD_EUNSUPPORTED when the library cannot be loaded ("libnccl.so.2
 * cannot be loaded: ...; install NCCL (the libnccl2 package) to train on
 * several GPUs"), lacks an entry point (named) or is older than 2.14. *nc is
 * written only on success. Blocks on dlopen only. */
td_err gpu_nccl_open(struct gpu_nccl *nc, const char *path, struct td_errbuf *eb);

/* dlcloses the library; nc may be NULL or never opened (zeroed). Every
 * communicator must be destroyed or aborted first. */
void gpu_nccl_close(struct gpu_nccl *nc);

/* The process's library, opened once (thread-safe) with gpu_nccl_open(NULL)
 * and kept for the process's life. On failure the same error and message
 * are returned to every caller. */
td_err gpu_nccl_get(const struct gpu_nccl **out, struct td_errbuf *eb);

/* r as a td_err (SUCCESS: TD_OK; UNHANDLED_CUDA_ERROR: TD_EDEVICE; SYSTEM
 * and REMOTE: TD_EIO; INVALID_ARGUMENT and INVALID_USAGE: TD_EINVAL;
 * IN_PROGRESS: TD_EBUSY; others: TD_EINTERNAL) with a message "what: NCCL
 * <error string>[: <last error>]" in eb. comm may be NULL. */
td_err gpu_nccl_check(const struct gpu_nccl *nc, gpu_nccl_result_t r, gpu_nccl_comm comm,
		      const char *what, struct td_errbuf *eb);

/* The caller's own test of completion, polled with the communicators':
 * > 0 done, 0 not yet, < 0 failed (the wait then aborts). NULL: none (the
 * communicators being ready is all that is waited for: an init, a group). */
typedef int (*gpu_nccl_done_fn)(void *ctx);

/* Waits, polling, until every one of comms[0 .. n) reports no pending work
 * and no error (ncclCommGetAsyncError gives SUCCESS) and done (if any) says
 * done; at most timeout_ms (0: no limit; a daemon always sets one).
 * Polls every few microseconds at first, backing off to 1 ms.
 *
 * On an asynchronous error of any communicator, done < 0, or the timeout:
 * every communicator of comms is aborted (ncclCommAbort), its slot set to
 * NULL, and the error is returned: TD_EDEVICE/TD_EIO/... as gpu_nccl_check
 * maps NCCL's error (the message names the rank, i.e. the index in comms);
 * TD_EDEVICE from done < 0, and on the timeout ("no progress in N ms; the
 * job's N communicators were aborted"). NULL slots are skipped.
 * what names the operation in messages ("all-reduce of gradients"). */
td_err gpu_nccl_wait(const struct gpu_nccl *nc, gpu_nccl_comm *comms, int n, int timeout_ms,
		     gpu_nccl_done_fn done, void *ctx, const char *what, struct td_errbuf *eb);

/* Aborts every non-NULL communicator of comms and sets it NULL. */
void gpu_nccl_abort_all(const struct gpu_nccl *nc, gpu_nccl_comm *comms, int n);

#endif
