/* Job runners: one thread per running job, calling tr_train() (train/trainer.h).
 *
 * The scheduler (loop thread) admits a job and hands it to dmn_runners_start();
 * from then on the runner thread owns the job until it ends: it moves it to
 * PREPARING and RUNNING, records metrics, checkpoints and the trainer's log
 * lines through its own database handle, writes the job's TensorBoard file,
 * and finally records SUCCEEDED, FAILED, CANCELLED or INTERRUPTED, releases
 * the job's ledger leases, and tells the loop (uv_async) so that the thread is
 * joined and the scheduler runs again.
 *
 * As root, the runner reads and writes the job's files with the submitter's
 * filesystem credentials (daemon/identity.h) for the whole tr_train() call,
 * and switches back only around its own database writes.
 *
 * Cancel, preemption and shutdown are flags polled by the trainer at step
 * boundaries (tr_hooks.should_stop): the trainer checkpoints and returns. The runner set
 * lives on the loop thread except where a function says otherwise. */
#ifndef DAEMON_RUNNER_H
#define DAEMON_RUNNER_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>
#include <uv.h>

#include "daemon/devices.h"
#include "proto/err.h"
#include "state/state.h"
#include "train/trainer.h"
#include "traind.pb-c.h"

struct dmn_runners;
struct dmn_peer_client;

/* One of a job's GPUs, with its lease. */
struct dmn_run_gpu {
	char uuid[96];
	int index;      /* in the daemon's device list */
	int ordinal;    /* real: the CUDA ordinal; simulated: -1 */
	bool fake;
	int64_t lease;  /* its ledger lease */
	uint64_t bytes; /* the lease's bytes */
};

/* What the scheduler decided for one job. */
struct dmn_run_request {
	int64_t job_id;
	uid_t uid;
	gid_t gid;
	int32_t attempts;           /* runs before this one */
	Traind__JobSpec *spec;      /* defaults applied, precision resolved; taken on success */
	const char *device;         /* "cpu", the GPU's uuid, or a gang's uuids joined by ',' */
	bool on_gpu;                /* counts against a GPU (its lease), not a CPU slot */
	/* pinned host memory the job's plan holds (memory.recompute
	 * full-offload's checkpoints), in no lease: the scheduler sums the
	 * running jobs' against the pinned_host_max_mib setting */
	uint64_t host_bytes;
	const char *backend;        /* for tr_train: "cpu" or "cuda" */
	int cuda_device;            /* "cuda": the device ordinal; -1 otherwise (set it) */
	const char *cache_dir;      /* the module cache's root (setting cache_dir); NULL: none */
	/* The job's GPUs (on_gpu), each with its lease. A gang (ngpus > 1)
	 * trains data parallel, one rank on each (cuda_device is gpu[0]'s
	 * ordinal; simulated GPUs' ranks run on the CPU). */
	int ngpus;
	struct dmn_run_gpu gpu[DMN_MAX_GPUS];
	/* A frozen base shared with the daemon's other jobs on its GPU
	 * (train/base.h): its ledger block's key and the GPU's uuid (the
	 * registry's key), the files' digest when it was made (preflight), its
	 * bytes (in no lease of this job's), and whether the block was there
	 * already. base_shared false: the job holds its own base. */
	bool base_shared, base_attached;
	uint64_t base_bytes;
	char base_key[200];
	const char *base_digest;
	/* resources.hosts: the peer client (daemon/peers.h) through which the
	 * runner starts the job's ranks on the other daemons; NULL otherwise. */
	const struct dmn_peer_client *peer;
};

/* Called on the loop thread after a runner thread ended and was joined.
 * final is the state it recorded, but ST_QUEUED: it recorded INTERRUPTED
 * because another job's sticky CUDA error lost its device, or because it
 * was preempted (dmn_runners_preempt), and asks to be requeued now
 * (INTERRUPTED -> QUEUED with requeue_reason, done on the loop thread so
 * that no pass admits the job again while this runner is still in the set).
 * requeue_reason is "" unless final is ST_QUEUED. retry_ms > 0: a job across
 * daemons that found one of them unreachable, busy or lost, requeued to be
 * placed again no sooner than that. */
typedef void (*dmn_runner_done_fn)(void *ctx, int64_t job_id, enum st_job_state final,
				   bool on_gpu, const char *requeue_reason, int64_t retry_ms);

/* A runner set whose threads open db_path for their own handles. */
td_err dmn_runners_new(struct dmn_runners **out, uv_loop_t *loop, const char *db_path,
		       dmn_runner_done_fn done, void *ctx, struct td_errbuf *eb);

/* Starts a thread for req. On success the set owns req->spec. TD_ENOMEM, or
 * TD_EINTERNAL when no thread can be created (the job stays ADMITTED: the
 * caller undoes the admission). */
td_err dmn_runners_start(struct dmn_runners *r, struct dmn_run_request *req, struct td_errbuf *eb);

/* Asks job's runner to stop at its next step boundary and end CANCELLED.
 * false if no runner has that job. */
bool dmn_runners_cancel(struct dmn_runners *r, int64_t job_id);

/* Preemption (issue 14): asks job's runner to stop at its next step
 * boundary, checkpoint (the trainer's own checkpoint on a stop) and end
 * INTERRUPTED, then be requeued (see dmn_runner_done_fn) with a reason
 * beginning with `why` ("preempted by job N (user U, priority P)"). A job
 * that finishes its last step first simply succeeds; a cancel or a shutdown
 * meanwhile wins. false if no runner has that job. */
bool dmn_runners_preempt(struct dmn_runners *r, int64_t job_id, const char *why);

/* What the scheduler needs to know of a running job to choose whom to
 * preempt: where it runs (its leases' GPUs and bytes, or a CPU slot) and
 * whether it was asked to stop already. */
struct dmn_run_info {
	int64_t job_id;
	uid_t uid;
	bool on_gpu;
	bool stopping;  /* cancel, preemption or shutdown asked */
	uint64_t host_bytes; /* pinned host memory (dmn_run_request) */
	int ngpus;
	struct dmn_run_gpu gpu[DMN_MAX_GPUS];
};
/* The running jobs, at most cap of them into out; returns how many there
 * are (may exceed cap). */
size_t dmn_runners_list(struct dmn_runners *r, struct dmn_run_info *out, size_t cap);

/* Shutdown: every runner stops at its next step boundary, checkpoints, and
 * ends INTERRUPTED (requeued at the next start). Returns immediately. */
void dmn_runners_stop_all(struct dmn_runners *r);

/* Device faults. A job whose CUDA backend reports TD_EDEVICE_LOST (a sticky
 * error: its device's primary context is corrupt for the whole process)
 * marks its CUDA ordinal lost and fails with the error; every other runner
 * on that ordinal is told to stop (should_stop), and those are recorded
 * INTERRUPTED and requeued (see dmn_runner_done_fn) whether they stop
 * cleanly or fail with the same loss. The scheduler admits nothing on a lost
 * ordinal; once no runner is left on it (dmn_runners_lost_idle), it resets
 * the context (gpu_device_reset) and clears the mark. Any thread. */
bool dmn_runners_lost(struct dmn_runners *r, int ordinal);
/* A lost ordinal with no runner left on it and not in the mask skip
 * (bit d: ordinal d), or -1. */
int dmn_runners_lost_idle(struct dmn_runners *r, uint64_t skip);
void dmn_runners_lost_clear(struct dmn_runners *r, int ordinal);

/* The pinned host memory (dmn_run_request.host_bytes) of the running job
 * job_id, or (job_id < 0) of all of them. Any thread. */
uint64_t dmn_runners_host_bytes(struct dmn_runners *r, int64_t job_id);

/* Running jobs: all, and those on CPU slots (not on a GPU). */
size_t dmn_runners_count(const struct dmn_runners *r);
size_t dmn_runners_count_cpu(const struct dmn_runners *r);

/* The job's latest progress, as the trainer reported it; false if the job has
 * no runner or has not finished a step yet. Any thread. */
bool dmn_runners_progress(struct dmn_runners *r, int64_t job_id, struct tr_progress *out);

/* Three steps, as nng does it: close stops new work (idempotent, no wait);
 * the loop must then run until the handle is closed; free releases memory
 * (TD_EBUSY, and nothing is freed, while a runner thread is alive). */
void dmn_runners_close(struct dmn_runners *r);
td_err dmn_runners_free(struct dmn_runners *r);

#endif
