/* The scheduler: which queued job runs next, and where.
 *
 * Order: priority (higher first), then fair share (the user with the least
 * running work first, counting what this pass already started; then the one
 * who used the least in the usage window), then age.
 * Placement: resources.gpus GPUs (a gang when more than one) where the ledger
 * grants the plan's lease on each, all in one transaction or none
 * (st_ledger_reserve_gang checks each device's total × vram_factor and free
 * memory, contract 7), chosen by daemon/placement.h (NVLink-joined GPUs
 * first, then the lowest indices); else, for a job of one GPU, the CPU if the
 * spec allows it and a CPU slot is free (CPU jobs need no lease). A gang
 * trains data parallel, one rank a GPU: on real GPUs where NCCL loads
 * (dmn_gpu_gang_ok; each lease then adds GPU_NCCL_RESERVE_BYTES), or on
 * simulated ones. A plan larger than every GPU's share fails the job.
 *
 * Waiting: a job that cannot start now does not block the ones behind it
 * that can, except on the GPUs held for the first job of the order that
 * waits for GPUs: the set it fits once they drain, closed to every other job
 * of its priority or lower until it starts. Held GPUs only drain, so the
 * holder starts in finite time (unless higher-priority work, which may take
 * the hold over, or programs reserving outside traind keep coming): no job,
 * a gang of 4 behind a stream of 1-GPU jobs included, is starved. Per-user
 * limits: max_running_per_user here, and max_queued_per_user at submit
 * (st_job_submit).
 *
 * Not admitted at all (issue 14): a held job, a job whose dependencies have
 * not all SUCCEEDED, and the jobs of a user whose GPU time within
 * usage_window_hours reached quota_gpu_hours. Fair share's second key, after
 * the running jobs, is each user's GPU + CPU-slot time within that window
 * (state/: the accounting). Why each job waits is kept for list and show
 * (dmn_sched_waiting).
 *
 * Preemption (issue 14; setting preempt, off by default; Slurm's
 * PreemptMode=REQUEUE): a queued job that the pass leaves waiting for room —
 * not one that is held, waits on a dependency or a per-user limit — may stop
 * running jobs of a strictly lower priority (preempt = user: only its own
 * user's; priority: anyone's). The victims are chosen minimally: lowest
 * priority first, then the newest (the least work lost), only as many as make
 * the job fit (on the GPUs where it fits once they go, the set whose victims
 * are cheapest for one GPU; a CPU slot for a CPU job), always a whole job (a
 * gang goes whole or not at all), never one preempted within
 * preempt_grace_s, nor one stopping already. Each victim and the job get an
 * event (st_job_preempt: "preempted by job N (user U, priority P)", "preempted
 * job M ..."); the victim's runner stops at its next step boundary with the
 * trainer's normal checkpoint (written atomically: a crash during it loses
 * nothing), ends INTERRUPTED and is requeued at once (QUEUED, its reason
 * naming the preemptor; attempts and accounting kept), and resumes from that
 * checkpoint later, bit-identical to an uninterrupted run. On GPUs the job
 * takes the hold of the GPUs it waits for, so the room goes to it. One
 * preemption decision at a time: none while a victim is still stopping.
 *
 * It owns the runner set (daemon/runner.h) and hears from it when a job ends.
 * It also keeps which output dirs belong to jobs that have not ended, so that
 * two live jobs never write into the same directory.
 *
 * Loop thread only. Passes run on a kick (submit, cancel, a job ended, SIGHUP)
 * and on the housekeeping tick. */
#ifndef DAEMON_SCHEDULER_H
#define DAEMON_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/settings.h"
#include "daemon/devices.h"
#include "daemon/preflight.h"
#include "daemon/runner.h"
#include "proto/err.h"
#include "state/state.h"

struct dmn_sched;

struct dmn_peer_client;

struct dmn_sched_deps {
	uv_loop_t *loop;
	struct st_db *db;               /* the loop thread's handle */
	const char *db_path;            /* for the runners' own handles */
	const struct dmn_config *cfg;   /* live settings (SIGHUP may change them) */
	const struct dmn_devices *dev;
	/* peer_listen set: this daemon coordinates jobs across daemons
	 * (daemon/peers.h); NULL: it refuses them. Outlives the scheduler. */
	const struct dmn_peer_client *peer;
};

/* Reads the jobs that have not ended (after st_jobs_recover) to know their
 * output dirs. */
td_err dmn_sched_new(struct dmn_sched **out, const struct dmn_sched_deps *d, struct td_errbuf *eb);

struct dmn_runners *dmn_sched_runners(struct dmn_sched *s);

/* Runs a pass soon (once, however often it is kicked before). */
void dmn_sched_kick(struct dmn_sched *s);

/* The housekeeping tick: reaps dead leases, then a pass. */
void dmn_sched_tick(struct dmn_sched *s);

/* The plan's bytes of a job (from its submit-time preflight), per recompute
 * policy where the spec leaves the policy to placement (preflight.h). */
void dmn_sched_set_plan(struct dmn_sched *s, int64_t job_id, const struct dmn_plan_bytes *plan);

/* What a job whose memory plan is plan_bytes reserves on g: the plan on a
 * simulated GPU; on a real one the plan + GPU_CUDA_FIXED_BYTES (the CUDA
 * backend's workspaces, gpu/select.h) + cfg->cuda_context_mib MiB. */
uint64_t dmn_sched_lease_bytes(const struct dmn_config *cfg, const struct dmn_gpu *g,
			       uint64_t plan_bytes);

/* Claims dir for a job being submitted. TD_EBUSY naming the job that holds
 * it. *claim identifies the claim until dmn_sched_claim_bind (the job was
 * stored) or dmn_sched_claim_drop (it was not). */
td_err dmn_sched_claim_output(struct dmn_sched *s, const char *dir, int64_t *claim,
			      struct td_errbuf *eb);
void dmn_sched_claim_bind(struct dmn_sched *s, int64_t claim, int64_t job_id);
void dmn_sched_claim_drop(struct dmn_sched *s, int64_t claim);

/* A job ended outside a runner (cancelled while queued): drop its claim,
 * its plan, and run a pass. */
void dmn_sched_job_ended(struct dmn_sched *s, int64_t job_id);

/* Why job_id, QUEUED, is not running: held, its dependencies, a per-user
 * limit, the usage quota, no GPU with room (or GPUs held for another job),
 * every CPU slot busy, as the last pass decided. Writes buf either way; false
 * when the last pass did not look at the job (the text then says what it
 * can). */
bool dmn_sched_waiting(const struct dmn_sched *s, int64_t job_id, char *buf, size_t cap);

/* Jobs QUEUED as of the last pass. */
uint32_t dmn_sched_queued(const struct dmn_sched *s);
/* True once a lost CUDA device's context could not be reset in this process
 * (the driver keeps a sticky error for the process's life): the daemon then
 * stops its jobs, as for SIGTERM, and re-executes itself (server.c). */
bool dmn_sched_restart_wanted(const struct dmn_sched *s);

/* Shutdown: no more passes; the runners are told to stop. */
void dmn_sched_stop(struct dmn_sched *s);

/* Three steps: close (the loop must then run until the handles are closed),
 * free (TD_EBUSY while a runner is alive or a plan is being computed). */
void dmn_sched_close(struct dmn_sched *s);
td_err dmn_sched_free(struct dmn_sched *s);

#endif
