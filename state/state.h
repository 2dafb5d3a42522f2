/* traind's persistent state: one sqlite database (contracts 6 and 7 of DESIGN.md).
 *
 * What it holds: the jobs and their state machine, each job's events (what
 * `trainctl logs` prints), per-step metrics, the VRAM ledger (leases), and the
 * index of the CUDA module cache. Every state change is one sqlite transaction;
 * a daemon killed at any instant leaves the database at the last committed change.
 *
 * What it is not: the scheduler (ordering, fair share, limits are the daemon's;
 * this module gives it the primitives: a queue query and a compare-and-set
 * transition), the permission model (the daemon decides who may see or cancel a
 * job; only the ledger checks a caller uid, because other programs reach it
 * directly), and not a protobuf user: a job's spec is stored as the opaque bytes
 * of an encoded Traind__JobSpec, which this module never decodes.
 *
 * The database: WAL journal, synchronous=NORMAL (a commit survives a process
 * crash; a power cut may lose the last commits, never corrupt the file),
 * foreign keys on, a busy timeout, application_id 'TRND', and `PRAGMA
 * user_version` as the schema version. st_open() applies missing migrations, each
 * in one transaction; a database from a newer traind is refused, never touched.
 *
 * Threads and processes: a struct st_db is one sqlite connection guarded by a
 * mutex; any thread may call any function on it and calls are serialised per
 * handle. For concurrency open one handle per thread (runner threads, the loop
 * thread). Many processes may open the same file (the daemon, `trainctl ledger`,
 * tests); writers exclude each other with `BEGIN IMMEDIATE`. fork(): a child
 * that will use sqlite must be forked while this process holds no open handle
 * (sqlite's per-process lock bookkeeping would be inherited and lie to the
 * child's own connection); a child that only exec()s is fine.
 *
 * Blocking: every call does file I/O and may wait up to the busy timeout
 * (default ST_BUSY_TIMEOUT_MS) for another connection's write lock; without
 * contention a write is well under a millisecond on a local disk (no fsync per
 * commit in WAL+NORMAL; checkpoints fsync). Keep calls off a latency-critical
 * loop thread if a slow disk is expected; never hold a lock of your own across
 * a call that waits on a thread that is itself inside st_*.
 *
 * Errors: every function returns td_err (TD_OK = 0) and, on failure, writes a
 * message into eb (may be NULL) that names the database path and the object
 * ("job 12", "lease 7 on GPU-…"). sqlite codes are mapped at this boundary:
 * BUSY/LOCKED → TD_EBUSY, NOMEM → TD_ENOMEM, CORRUPT/NOTADB → TD_EFORMAT,
 * CANTOPEN → TD_ENOENT or TD_EPERM (from errno), READONLY/PERM/AUTH → TD_EPERM,
 * IOERR/FULL → TD_EIO, CONSTRAINT → TD_EINVAL, TOOBIG → TD_ERANGE, anything else
 * TD_EINTERNAL; the sqlite message and our file:line are logged with id
 * "TD-ST-SQLITE". An out-parameter is written only on success.
 *
 * Ownership: strings and blobs passed in are copied; structs filled by a getter
 * are caller-owned and released with the matching *_fini / *_free function.
 *
 * Times are int64 milliseconds since the Unix epoch (CLOCK_REALTIME); 0 = never. */
#ifndef STATE_STATE_H
#define STATE_STATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "proto/err.h"

/* ======================================================================== */
/* The database */

/* The schema version this build writes and understands (PRAGMA user_version). */
#define ST_SCHEMA_VERSION 3
#define ST_BUSY_TIMEOUT_MS 5000
/* File name of the database inside the state directory. */
#define ST_DB_FILE "traind.db"

struct st_db;

struct st_open_opts {
	int busy_timeout_ms; /* 0 = ST_BUSY_TIMEOUT_MS */
	bool no_create;      /* fail with TD_ENOENT instead of creating the file */
	unsigned file_mode;  /* mode of a newly created file; 0 = 0600 */
	/* Run PRAGMA quick_check (reads the whole file: O(size), ~0.1 s per
	 * 100 MB) and refuse a damaged database with TD_EFORMAT. The daemon sets
	 * it at start; short-lived callers (trainctl ledger) need not. */
	bool integrity_check;
};

/* Opens (creating if needed) the database at path and brings its schema to
 * ST_SCHEMA_VERSION. opts may be NULL. A new file gets mode 0600 (or
 * opts->file_mode, e.g. 0660 for a group-shared ledger) regardless of umask.
 *
 * Blocks: migrations may wait for the busy timeout if another process is
 * migrating the same file; the second process then finds the work done.
 *
 * Errors: TD_ENOENT/TD_EPERM (path or its directory), TD_EFORMAT (not a sqlite
 * file, corrupt, or a sqlite database that is not traind's: its message says to
 * move the file aside), TD_EUNSUPPORTED (schema version newer than
 * ST_SCHEMA_VERSION: "written by a newer traind"), TD_EBUSY, TD_EIO, TD_ENOMEM.
 * On success *out owns a new handle; close it with st_close(). */
td_err st_open(struct st_db **out, const char *path, const struct st_open_opts *opts,
	       struct td_errbuf *eb);

/* Closes the handle (waiting for a call in progress on another thread to end).
 * NULL is a no-op. The last connection to close checkpoints the WAL. */
void st_close(struct st_db *db);

/* The path given to st_open (owned by db). */
const char *st_path(const struct st_db *db);

/* The schema version of the open database (== ST_SCHEMA_VERSION after st_open). */
int st_schema_version(struct st_db *db);

/* Now, in ms since the epoch (CLOCK_REALTIME). */
int64_t st_now_ms(void);

/* ======================================================================== */
/* Jobs */

/* The state machine. Values are stored in the database by name, so they may be
 * renumbered freely.
 *
 *   QUEUED ──▶ ADMITTED ──▶ PREPARING ──▶ RUNNING ──▶ SUCCEEDED | FAILED | CANCELLED
 *     ▲  ▲         │             │           │
 *     │  └─────────┘ (admission  │           │
 *     │   undone: QUEUED)        ▼           ▼
 *     └──────────────────── INTERRUPTED ◀────┘  (daemon died or stopped)
 *
 * Legal transitions (anything else is TD_ESTATE naming both states):
 *   QUEUED      → ADMITTED, FAILED (can never run, e.g. fits no device), CANCELLED
 *   ADMITTED    → PREPARING, QUEUED (admission undone), FAILED, CANCELLED, INTERRUPTED
 *   PREPARING   → RUNNING, FAILED, CANCELLED, INTERRUPTED (a resumed run with no
 *                 step left to train still passes through RUNNING: daemon/runner.c)
 *   RUNNING     → SUCCEEDED, FAILED, CANCELLED, INTERRUPTED
 *   INTERRUPTED → QUEUED (at restart, keeping the checkpoint; at once after a
 *                 device loss or a preemption), FAILED, CANCELLED
 *   SUCCEEDED, FAILED, CANCELLED: terminal for st_job_transition; FAILED and
 *   CANCELLED go back to QUEUED only through st_job_requeue (an operator's
 *   decision, never a side effect). */
enum st_job_state {
	ST_QUEUED,
	ST_ADMITTED,
	ST_PREPARING,
	ST_RUNNING,
	ST_SUCCEEDED,
	ST_FAILED,
	ST_CANCELLED,
	ST_INTERRUPTED,
	ST_JOB_STATE_COUNT
};

/* For st_job_transition's `from`: whatever the job is in now. */
#define ST_ANY_STATE ((enum st_job_state) - 1)
/* A set of states for filters: ST_MASK(ST_QUEUED) | ST_MASK(ST_RUNNING). */
#define ST_MASK(s) (1u << (unsigned)(s))
#define ST_MASK_ACTIVE (ST_MASK(ST_ADMITTED) | ST_MASK(ST_PREPARING) | ST_MASK(ST_RUNNING))
#define ST_MASK_TERMINAL (ST_MASK(ST_SUCCEEDED) | ST_MASK(ST_FAILED) | ST_MASK(ST_CANCELLED))

/* "QUEUED", …; "?" for a value out of range. Never NULL. */
const char *st_job_state_name(enum st_job_state s);
/* Parses a name (case-insensitive); false if unknown. *out written on success. */
bool st_job_state_parse(const char *name, enum st_job_state *out);
/* Whether from → to is a legal transition (the table above). */
bool st_job_transition_ok(enum st_job_state from, enum st_job_state to);
static inline bool st_job_state_terminal(enum st_job_state s)
{
	return s == ST_SUCCEEDED || s == ST_FAILED || s == ST_CANCELLED;
}

/* One job as stored. Strings are heap-allocated, never NULL ("" when unset),
 * except spec, which is NULL when not asked for (list without with_spec).
 * Free the contents with st_job_fini(). */
struct st_job {
	int64_t id; /* > 0, never reused (AUTOINCREMENT) */
	char *name;
	uid_t uid; /* owner (the submitter, from the socket) */
	gid_t gid;
	enum st_job_state state;
	char *reason; /* why it is in this state ("" if no reason was given) */
	int32_t priority;
	int64_t submit_ms, start_ms, end_ms; /* start: last entry into RUNNING; end: entry into a terminal state */
	int64_t updated_ms;                 /* last change of any field */
	char *device;                       /* e.g. "cuda:0", "cpu"; "" before admission */
	char *ckpt_path;                    /* last checkpoint written; "" if none */
	int64_t ckpt_step;                  /* its step; 0 if none */
	int32_t attempts;                   /* times it entered PREPARING */
	bool cancel_requested;              /* set by st_job_cancel on an active job */
	bool held;                          /* st_job_hold: not admitted while set */
	uint8_t *spec;                      /* encoded Traind__JobSpec */
	size_t spec_len;
};
void st_job_fini(struct st_job *j);
/* Frees an array from st_job_list (each element's contents, then the array). NULL is a no-op. */
void st_jobs_free(struct st_job *jobs, size_t n);

/* What a submit stores. spec/spec_len: the encoded Traind__JobSpec (required,
 * copied). name may be NULL (""). */
struct st_job_new {
	const char *name;
	uid_t uid;
	gid_t gid;
	int32_t priority;
	const void *spec;
	size_t spec_len;
	/* Per-user cap on QUEUED + INTERRUPTED jobs, checked in the same
	 * transaction as the insert; 0 = no cap. */
	uint32_t max_queued_per_user;
	/* Jobs this one starts after (`submit --after`): it is admitted only
	 * once every one of them SUCCEEDED, and fails when one of them ends
	 * FAILED or CANCELLED (see st_job_transition). Whether the caller may
	 * name them is the daemon's business. At most ST_DEPS_MAX. */
	const int64_t *after;
	size_t nafter;
	bool held; /* submitted held (st_job_hold) */
};
#define ST_DEPS_MAX 64

/* Persists a new job in QUEUED with an event "submitted". *id_out gets its id.
 * Errors: TD_EINVAL (no spec, too many or repeated dependencies), TD_EBUSY
 * ("user U has N queued jobs (limit N)", or the database is locked past the
 * busy timeout), TD_ENOENT (a dependency does not exist), TD_ESTATE (a
 * dependency already FAILED or CANCELLED: the job could never start),
 * sqlite errors as above. */
td_err st_job_submit(struct st_db *db, const struct st_job_new *n, int64_t *id_out,
		     struct td_errbuf *eb);

/* Reads job id into *out (caller-owned; st_job_fini it). The spec is included.
 * Errors: TD_ENOENT ("job 12 does not exist"). */
td_err st_job_get(struct st_db *db, int64_t id, struct st_job *out, struct td_errbuf *eb);

struct st_job_filter {
	bool all_users;     /* false: only jobs of uid */
	uid_t uid;
	unsigned state_mask; /* ST_MASK()s; 0 = every state */
	size_t limit;        /* 0 = no limit; the newest `limit` jobs are returned */
	bool with_spec;      /* fill st_job.spec (listings usually do not need it) */
};

/* Jobs matching f, in ascending id order. *out is a new array of *n jobs
 * (NULL when n = 0); free with st_jobs_free. */
td_err st_job_list(struct st_db *db, const struct st_job_filter *f, struct st_job **out,
		   size_t *n, struct td_errbuf *eb);

/* The compare-and-set state change, one transaction: if the job is in `from`
 * (or from is ST_ANY_STATE) and from → to is legal, it moves to `to`, its
 * reason becomes `reason` (NULL keeps ""), device is set if non-NULL, and an
 * event of kind "state" ("QUEUED → ADMITTED: reason") is appended. Side effects
 * by target: PREPARING increments attempts; RUNNING sets start_ms; a terminal
 * state sets end_ms; QUEUED clears device (cancel_requested is kept); the
 * job's usage is accrued up to now (st_usage_accrue). FAILED and CANCELLED
 * also fail, in the same transaction, every QUEUED or INTERRUPTED job that
 * waits on this one (st_job_new.after), and theirs in turn, each with an
 * event naming the dependency ("dependency: job 5 ended FAILED"). Entering
 * any state but ADMITTED/PREPARING/RUNNING also releases the job's ledger
 * leases in the same transaction — a safety net: the runner should release
 * (st_ledger_release_job) once its buffers are freed, before the final state,
 * so that the ledger never under-counts memory still in use.
 *
 * Errors: TD_ESTATE for an illegal pair ("job 12: illegal transition RUNNING →
 * QUEUED"); TD_EBUSY when the job is not in `from` — another actor won the race
 * (a cancel, the other scheduler pass): "job 12 is CANCELLED, not QUEUED" — the
 * caller re-reads and moves on; TD_ENOENT for an unknown job. A scheduler
 * "claims" a job with st_job_transition(db, id, ST_QUEUED, ST_ADMITTED, …). */
td_err st_job_transition(struct st_db *db, int64_t id, enum st_job_state from,
			 enum st_job_state to, const char *reason, const char *device,
			 struct td_errbuf *eb);

/* Holds (hold) or releases a job, one transaction with an event of kind
 * "hold" naming who (free text, e.g. "uid 1000"). A held job stays QUEUED
 * (or INTERRUPTED) and the scheduler does not admit it until it is released;
 * the flag survives restarts and requeues. Only a QUEUED or INTERRUPTED job
 * may be held (TD_ESTATE names its state: a running job is stopped with
 * cancel); any job may be released. Holding a held job, or releasing one that
 * is not held, changes nothing and is not an error: *changed (may be NULL)
 * says whether anything changed. Errors: TD_ENOENT, TD_ESTATE. */
td_err st_job_hold(struct st_db *db, int64_t id, bool hold, const char *who, bool *changed,
		   struct td_errbuf *eb);

/* Requeues a FAILED or CANCELLED job, one transaction: it moves to QUEUED
 * (the one way out of those states) with its spec, attempts and checkpoint
 * (the trainer resumes from the newest checkpoint in its output dir),
 * cancel_requested and end_ms cleared, and a "state" event with reason.
 * Errors: TD_ENOENT; TD_ESTATE when the job is in another state ("job 12 is
 * SUCCEEDED; ...") or one of its dependencies FAILED or was CANCELLED
 * ("requeue job 5 first"). */
td_err st_job_requeue(struct st_db *db, int64_t id, const char *reason, struct td_errbuf *eb);

/* Changes a job's priority, one transaction: the priority column, the spec
 * (spec/spec_len, the encoded spec with resources.priority changed: state/
 * never decodes it; NULL keeps the stored spec) and an event of kind
 * "priority" ("priority 0 -> 5 by WHO"). Errors: TD_ENOENT; TD_ESTATE for a
 * job that ended (SUCCEEDED, FAILED, CANCELLED). */
td_err st_job_set_priority(struct st_db *db, int64_t id, int32_t priority, const void *spec,
			   size_t spec_len, const char *who, struct td_errbuf *eb);

/* Records a preemption (issue 14), one transaction: job `victim`, which must
 * be active (ADMITTED, PREPARING or RUNNING) without a cancel requested, gets
 * an event of kind "preempted" (victim_msg: "preempted by job N (user U,
 * priority P) ..."), and job `by` one of kind "preempt" (by_msg: "preempted
 * job M ..."). The state does not change here: the victim's runner stops at
 * its next step boundary, checkpoints, and moves it RUNNING -> INTERRUPTED ->
 * QUEUED itself. Errors: TD_ENOENT (either job), TD_EBUSY when the victim is
 * not active or its cancel was requested ("job 12 is QUEUED"): it needs no
 * preempting. */
td_err st_job_preempt(struct st_db *db, int64_t victim, int64_t by, const char *victim_msg,
		      const char *by_msg, struct td_errbuf *eb);

/* When job was last preempted (its newest "preempted" event), in *ms; 0 if
 * never. The scheduler's grace period (preempt_grace_s) reads it. */
td_err st_job_preempted_ms(struct st_db *db, int64_t job, int64_t *ms, struct td_errbuf *eb);

/* A job's dependency (st_job_new.after) and its state now. */
struct st_dep {
	int64_t id;
	enum st_job_state state;
};
/* The dependencies of job, ascending id. *out is malloc'd (free()), NULL
 * when n = 0. */
td_err st_job_deps(struct st_db *db, int64_t job, struct st_dep **out, size_t *n,
		   struct td_errbuf *eb);

/* Cancels a job, one transaction. QUEUED or INTERRUPTED → CANCELLED at once;
 * ADMITTED/PREPARING/RUNNING → cancel_requested is set (the runner stops at its
 * next step boundary and moves the job to CANCELLED with st_job_transition; the
 * state is unchanged here). An event is appended either way. *state_out (may be
 * NULL) gets the state after the call. Cancelling twice is not an error.
 * Permission is the caller's business (contract 8). Errors: TD_ENOENT,
 * TD_ESTATE ("job 12 already SUCCEEDED"). */
td_err st_job_cancel(struct st_db *db, int64_t id, const char *reason,
		     enum st_job_state *state_out, struct td_errbuf *eb);

/* Records the last checkpoint (path copied, step) and appends a "checkpoint"
 * event. Errors: TD_ENOENT; TD_ESTATE unless the job is RUNNING or PREPARING. */
td_err st_job_set_checkpoint(struct st_db *db, int64_t id, const char *path, int64_t step,
			     struct td_errbuf *eb);

struct st_recover_stats {
	size_t interrupted; /* ADMITTED/PREPARING/RUNNING found (daemon died under them) */
	size_t requeued;    /* INTERRUPTED → QUEUED (checkpoint kept) */
	size_t cancelled;   /* INTERRUPTED with cancel_requested → CANCELLED */
	size_t leases;      /* ledger leases of those jobs released */
};

/* Call once at daemon start, before the scheduler runs: in ONE transaction,
 * every ADMITTED/PREPARING/RUNNING job becomes INTERRUPTED (event "daemon
 * restarted while RUNNING"), then every INTERRUPTED job becomes QUEUED (event
 * naming the checkpoint it resumes from) — or CANCELLED if its cancel was
 * requested — and leases held for those jobs are removed. Jobs keep their id,
 * spec, attempts and checkpoint; none is lost or duplicated. Idempotent.
 * stats may be NULL. Must not run while another daemon serves the same
 * database (the daemon holds a lock file for that). */
td_err st_jobs_recover(struct st_db *db, struct st_recover_stats *stats, struct td_errbuf *eb);

/* A QUEUED job with what the scheduler orders by. spec is heap (free with
 * st_queue_free). */
struct st_queued {
	int64_t id;
	uid_t uid;
	gid_t gid;
	int32_t priority;
	int64_t submit_ms;
	int32_t attempts;
	int64_t ckpt_step;         /* > 0: resumes from a checkpoint */
	uint32_t user_active;      /* this uid's ADMITTED+PREPARING+RUNNING jobs now */
	uint32_t user_queued;      /* this uid's QUEUED jobs now */
	bool held;                 /* st_job_hold: not to be admitted */
	uint32_t deps_pending;     /* dependencies that have not SUCCEEDED yet */
	int64_t dep_waiting;       /* the lowest of them (0: none) */
	uint8_t *spec;
	size_t spec_len;
};
/* Every QUEUED job, read in one query (one consistent snapshot), ordered as
 * issue 5's scheduler orders: priority descending, then user_active ascending
 * (fair share: the user with the least running work first), then submit time,
 * then id. The scheduler may reorder; it then claims with st_job_transition.
 * *out is NULL when n = 0. */
td_err st_job_queue(struct st_db *db, struct st_queued **out, size_t *n, struct td_errbuf *eb);
void st_queue_free(struct st_queued *q, size_t n);

/* How many jobs are in each state (counts[state]) and how many of the QUEUED
 * ones are held (*held; may be NULL), one query. */
td_err st_job_counts(struct st_db *db, uint32_t counts[ST_JOB_STATE_COUNT], uint32_t *held,
		     struct td_errbuf *eb);

/* Counts jobs of uid in the states of mask (mask 0 = every state). */
td_err st_job_count(struct st_db *db, uid_t uid, unsigned mask, uint32_t *count,
		    struct td_errbuf *eb);

/* ======================================================================== */
/* Accounting (`trainctl usage`, fair share, the usage quota)
 *
 * What a job used, accrued into hourly buckets (one row per job and UTC hour,
 * with its uid) so that any window can be summed to the hour: wall time
 * QUEUED, wall time active (ADMITTED, PREPARING, RUNNING), GPU time (active
 * time × the job's ledger leases: a gang of 4 counts 4 GPUs), CPU-slot time
 * (active time without a lease), GPU memory time (active time × its leases'
 * bytes, in byte-seconds) and tokens trained (added by the runner). A job is
 * accrued up to now by every state change (same transaction) and by
 * st_usage_accrue on the daemon's tick; time is counted in the bucket of the
 * hour it is accrued in (one tick off at most). A daemon that dies loses the
 * time since its last accrual of the jobs it ran (st_jobs_recover does not
 * count the time it was down). */
struct st_usage {
	int64_t queued_ms, run_ms, gpu_ms, cpu_ms;
	double gpu_mem_bs;  /* lease bytes × seconds */
	int64_t tokens;
	uint32_t jobs;      /* per user: jobs with usage in the window */
};

/* Accrues every QUEUED and active job's usage up to now_ms, one
 * transaction. */
td_err st_usage_accrue(struct st_db *db, int64_t now_ms, struct td_errbuf *eb);

/* Adds tokens trained by job (the runner, as it records metrics). */
td_err st_usage_add_tokens(struct st_db *db, int64_t job, int64_t tokens, struct td_errbuf *eb);

struct st_usage_row {
	uid_t uid;
	int64_t job;        /* per job; 0 in per-user rows */
	struct st_usage u;
};
/* Usage in the buckets from since_ms (rounded down to its hour; 0: all),
 * summed per user (by_job false; ascending uid) or per job (ascending id),
 * of every user (all_users) or of uid only. *out is malloc'd (free()), NULL
 * when n = 0. */
td_err st_usage_list(struct st_db *db, int64_t since_ms, bool by_job, bool all_users, uid_t uid,
		     struct st_usage_row **out, size_t *n, struct td_errbuf *eb);

/* The whole usage of one job (every bucket). TD_OK with zeros if none. */
td_err st_usage_of_job(struct st_db *db, int64_t job, struct st_usage *out, struct td_errbuf *eb);

/* ======================================================================== */
/* Job events (`trainctl logs`, `watch`) */

/* Kinds used by this module: "submitted", "state" (every transition, also
 * those of st_jobs_recover), "cancel", "checkpoint", "hold", "priority",
 * "preempted" and "preempt" (st_job_preempt). The daemon adds its own ("info", "warn", "error", "log"); a kind
 * is a short word, a message one line (truncated to 4 KiB). */
struct st_event {
	int64_t id; /* increasing across all jobs: a cursor */
	int64_t job;
	int64_t time_ms;
	char *kind;
	char *message;
};

/* Appends an event. Errors: TD_ENOENT (no such job), TD_EINVAL (empty kind). */
td_err st_event_add(struct st_db *db, int64_t job, const char *kind, const char *message,
		    struct td_errbuf *eb);
td_err st_event_addf(struct st_db *db, int64_t job, const char *kind, struct td_errbuf *eb,
		     const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Events of job with id > after_id, ascending, at most limit (0 = all). Poll
 * with after_id = the last id seen. *out is NULL when n = 0; free with
 * st_events_free. A job that does not exist has no events (not an error). */
td_err st_event_list(struct st_db *db, int64_t job, int64_t after_id, size_t limit,
		     struct st_event **out, size_t *n, struct td_errbuf *eb);
void st_events_free(struct st_event *ev, size_t n);

/* ======================================================================== */
/* Metrics (one row per job and step) */

/* A value not measured at this step is NAN (stored as NULL). */
struct st_metric {
	int64_t step;
	int64_t time_ms; /* 0 = now at insert */
	double loss, lr, grad_norm, tokens_per_s, eval_loss;
};

/* Inserts n rows in one transaction (batch them: a runner flushes every few
 * steps or seconds). A row for a step already stored (a resumed job replays
 * steps after its checkpoint) merges: measured values replace, NAN keeps the
 * stored one. Errors: TD_ENOENT (no such job). */
td_err st_metrics_add(struct st_db *db, int64_t job, const struct st_metric *m, size_t n,
		      struct td_errbuf *eb);

/* Rows of job with step > after_step, ascending, at most limit (0 = all).
 * *out is malloc'd (free()), NULL when n = 0. */
td_err st_metrics_list(struct st_db *db, int64_t job, int64_t after_step, size_t limit,
		       struct st_metric **out, size_t *n, struct td_errbuf *eb);

/* The row with the highest step, for progress and ETA. TD_ENOENT if none. */
td_err st_metrics_last(struct st_db *db, int64_t job, struct st_metric *out,
		       struct td_errbuf *eb);

/* ======================================================================== */
/* The VRAM ledger (contract 7)
 *
 * A lease reserves `bytes` on one GPU (by UUID) for a holder process, named by
 * pid + the pid's start time (field 22 of /proc/PID/stat, in clock ticks since
 * boot) + the boot id (/proc/sys/kernel/random/boot_id). A lease is live while
 * that process exists with that start time in this boot and its expiry (if any)
 * has not passed; a dead lease is reaped inside every reserve transaction and by
 * st_ledger_reap() (call it from the daemon's periodic tick). So a daemon that
 * is kill -9'd leaks nothing: its leases name its pid, which is gone.
 *
 * Where /proc/PID is not readable (hidepid mounts) but kill(pid, 0) says the
 * pid exists, the lease is kept (we cannot prove it dead); its expiry still
 * applies.
 *
 * Who reserves: the daemon for its jobs (holder = the daemon's own pid, job =
 * the job id, ttl 0: lives as long as the daemon), and other programs on the
 * host through `trainctl ledger reserve` (holder = the program that will use the
 * memory, usually trainctl's parent, so the lease dies with it; a ttl makes it
 * expire unless renewed with st_ledger_heartbeat).
 *
 * Direct access vs RPC (the daemon engineer's choice; both use these calls):
 *   - Direct (trainctl opens the database itself): works with no daemon running
 *     and costs one transaction, but every user of it needs write access to the
 *     database file, its -wal/-shm files and its directory. That exposes the
 *     jobs table to any such user's sqlite3 shell, and the uid stored in a lease
 *     is whatever that process says. Fit for user mode (one user owns the file)
 *     or a trusted group (create with st_open_opts.file_mode 0660).
 *   - Through the daemon's RPC: the uid comes from the socket (contract 8), the
 *     holder pid from NNG_OPT_IPC_PEER_PID (or a pid the caller names, which the
 *     daemon should accept only if it belongs to the same uid), the database
 *     stays 0600 under the daemon's user. Fit for the system service; needs the
 *     daemon up.
 * Both see the same truth: a lease is a row whichever path wrote it. */

/* The identity of a live process. */
struct st_holder {
	pid_t pid;
	uint64_t start_time; /* /proc/PID/stat field 22 (clock ticks since boot) */
	char boot_id[40];    /* "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
};

/* Reads pid's start time and the boot id. Errors: TD_ENOENT (no such pid),
 * TD_EPERM (/proc/PID hidden), TD_EFORMAT (unparsable /proc file). */
td_err st_holder_of(pid_t pid, struct st_holder *out, struct td_errbuf *eb);

/* Whether the lease holder h is still alive (same pid start time, same boot). */
bool st_holder_alive(const struct st_holder *h);

struct st_lease_req {
	const char *gpu_uuid; /* required, e.g. "GPU-5f1c…" (any non-empty string) */
	uint64_t bytes;       /* > 0 */
	int64_t job_id;       /* 0 = not a traind job (stored NULL); else must exist */
	uid_t uid;            /* who holds it (from the socket, or getuid() directly) */
	pid_t pid;            /* holder process; its start time and the boot id are read here */
	const char *label;    /* free text for `trainctl ledger` ("job 12", "vllm"); may be NULL */
	int64_t ttl_ms;       /* > 0: expires unless renewed; 0: lives while the holder lives */
	/* A shared block the lease uses beside its own bytes (a frozen base
	 * that several jobs share, train/base.h): share_key names it on this
	 * GPU (NULL: none). Where the GPU has a block of that key the lease
	 * becomes one more of its holders and only bytes are checked; where
	 * not, the block (share_bytes, share_label) is reserved with the lease,
	 * in the same check (bytes + share_bytes) and transaction. A block
	 * lasts while it has a holder: releasing or reaping its last lease
	 * removes it in the same transaction. */
	const char *share_key;
	uint64_t share_bytes;
	const char *share_label;
};

/* What the device offers, from the daemon's device query. */
struct st_device_cap {
	uint64_t total_bytes;    /* device total memory */
	double factor;           /* the share the ledger may hand out, 0 < factor <= 1 */
	uint64_t free_bytes_now; /* free memory reported by the driver now; UINT64_MAX if unknown */
};

/* Reserves, one BEGIN IMMEDIATE transaction: reap dead leases (all GPUs), then
 * grant iff bytes <= total × factor − sum(live leases on gpu) and bytes <=
 * free_bytes_now; the lease row is inserted, and the sum is checked again before
 * commit (a violation is TD_EINTERNAL and rolls back). *lease_id gets the id.
 *
 * Errors: TD_EBUSY when it does not fit — the message says how much was asked,
 * how much is available and why ("GPU-…: 6.0 GiB requested, 2.5 GiB available
 * (80.0 GiB × 0.90 − 69.5 GiB reserved)" or "… device has 1.2 GiB free"); the
 * caller waits and retries (a job stays QUEUED). TD_EINVAL (bad request or cap),
 * TD_ENOENT (holder pid does not exist, job does not exist), TD_EBUSY also for a
 * lock held past the busy timeout (message says "database is locked"). */
td_err st_ledger_reserve(struct st_db *db, const struct st_lease_req *r,
			 const struct st_device_cap *cap, int64_t *lease_id, struct td_errbuf *eb);

/* The most leases one st_ledger_reserve_gang grants at once. */
#define ST_LEDGER_GANG_MAX 64

/* Reserves a gang: n leases, r[i] on cap[i]'s device, granted all in ONE
 * BEGIN IMMEDIATE transaction or none (a job that needs several GPUs never
 * holds part of its set while it waits, so two such jobs cannot deadlock).
 * Each GPU is checked on its own as st_ledger_reserve checks one (its share
 * total × factor minus its live leases, and its free memory now), every check
 * before any insert; after the inserts each GPU's sum is checked again before
 * commit. The r[i].gpu_uuid must differ (TD_EINVAL otherwise); job, uid, pid,
 * label and ttl are per request (a daemon's gang names the same job in each).
 * lease_ids[0 .. n) get the ids, in the order of r, only on success.
 *
 * Errors as st_ledger_reserve; the TD_EBUSY message names the first GPU that
 * does not fit, prefixed for n > 1 by "gang of N GPUs, none granted: ".
 * st_ledger_reserve is this call with n = 1. */
td_err st_ledger_reserve_gang(struct st_db *db, const struct st_lease_req *r,
			      const struct st_device_cap *cap, size_t n, int64_t *lease_ids,
			      struct td_errbuf *eb);

/* Renews a lease: heartbeat = now, expiry = now + ttl_ms (ttl_ms 0: no expiry).
 * Only the holder uid or root (caller_uid 0) or an admin may renew.
 * Errors: TD_ENOENT (no such lease, or already reaped: the caller must reserve
 * again), TD_EPERM. */
td_err st_ledger_heartbeat(struct st_db *db, int64_t lease_id, int64_t ttl_ms, uid_t caller_uid,
			   bool caller_is_admin, struct td_errbuf *eb);

/* Releases a lease. Only the lease's uid, root (caller_uid 0) or an admin
 * (caller_is_admin: the daemon knows the admin group) may release.
 * Errors: TD_ENOENT ("lease 7 does not exist"), TD_EPERM ("lease 7 belongs to
 * uid 1000"). */
td_err st_ledger_release(struct st_db *db, int64_t lease_id, uid_t caller_uid,
			 bool caller_is_admin, struct td_errbuf *eb);

/* Releases every lease of job (the daemon, when a job ends), a gang's all
 * together: one DELETE in one transaction. *n (may be NULL) gets how many.
 * Not an error if there were none. */
td_err st_ledger_release_job(struct st_db *db, int64_t job, size_t *n, struct td_errbuf *eb);

/* Reaps dead leases (holder gone, pid reused, other boot, expired), one
 * transaction. *n (may be NULL) gets how many were removed; each is logged
 * ("TD-ST-LEASE-REAP"). */
td_err st_ledger_reap(struct st_db *db, size_t *n, struct td_errbuf *eb);

struct st_lease {
	int64_t id;
	char gpu_uuid[96];
	uint64_t bytes;
	int64_t job_id; /* 0 = none */
	uid_t uid;
	struct st_holder holder;
	char label[128];
	int64_t created_ms, heartbeat_ms, expires_ms; /* expires 0 = never */
};

/* Leases (live or not yet reaped) on gpu_uuid, or on every GPU if NULL,
 * ascending id. Call st_ledger_reap first for a view without the dead.
 * *out is malloc'd (free()), NULL when n = 0. */
td_err st_ledger_list(struct st_db *db, const char *gpu_uuid, struct st_lease **out, size_t *n,
		      struct td_errbuf *eb);

/* The leases of job (> 0; TD_EINVAL otherwise), every GPU, ascending id: all
 * of a gang's leases, as st_ledger_reserve_gang granted them. *out as above. */
td_err st_ledger_list_job(struct st_db *db, int64_t job, struct st_lease **out, size_t *n,
			  struct td_errbuf *eb);

/* Sum of the bytes of leases on gpu_uuid (dead ones not yet reaped included)
 * and of its shared blocks (each once). */
td_err st_ledger_reserved(struct st_db *db, const char *gpu_uuid, uint64_t *bytes,
			  struct td_errbuf *eb);

/* The most holders st_ledger_list_shared reports of one block (nholders
 * counts them all). */
#define ST_SHARED_HOLDERS_MAX 32

/* A shared block (st_lease_req.share_key) and the leases that hold it. */
struct st_shared {
	int64_t id;
	char gpu_uuid[96];
	char key[128];
	uint64_t bytes;
	char label[160];
	int64_t created_ms;
	size_t nholders;
	struct {
		int64_t lease, job; /* job 0: none */
		uid_t uid;
	} holders[ST_SHARED_HOLDERS_MAX];
};

/* Shared blocks on gpu_uuid (NULL: every GPU), ascending id, each with its
 * holders (ascending lease id). *out malloc'd (free()), NULL when n = 0. */
td_err st_ledger_list_shared(struct st_db *db, const char *gpu_uuid, struct st_shared **out,
			     size_t *n, struct td_errbuf *eb);

/* Whether gpu_uuid has a shared block of key now; *bytes (may be NULL) its
 * size. */
td_err st_ledger_shared_find(struct st_db *db, const char *gpu_uuid, const char *key, bool *found,
			     uint64_t *bytes, struct td_errbuf *eb);

/* ======================================================================== */
/* Module cache index (contract 3; used by the CUDA backend's tier 2) */

struct st_cache_entry {
	char *key;    /* the cache key (hash of source/PTX, options, arch, compiler, driver) */
	char *path;   /* the cubin file in the cache directory */
	char *sha256; /* of the file's bytes, hex */
	char *arch;   /* e.g. "sm_90" */
	uint64_t size_bytes;  /* of the cubin */
	uint64_t src_bytes;   /* of the source or PTX it was built from */
	int64_t created_ms, used_ms;
	uint64_t hits;
};
void st_cache_entry_fini(struct st_cache_entry *e);
void st_cache_entries_free(struct st_cache_entry *e, size_t n);

/* Inserts or replaces the entry for e->key (created_ms/used_ms/hits are set here). */
td_err st_cache_put(struct st_db *db, const struct st_cache_entry *e, struct td_errbuf *eb);
/* Looks key up; on success counts a hit and updates used_ms. TD_ENOENT if absent.
 * The caller still verifies the file against sha256 (a mismatch: st_cache_del). */
td_err st_cache_get(struct st_db *db, const char *key, struct st_cache_entry *out,
		    struct td_errbuf *eb);
/* Removes key. TD_ENOENT if absent. */
td_err st_cache_del(struct st_db *db, const char *key, struct td_errbuf *eb);
/* Every entry, ascending key. */
td_err st_cache_list(struct st_db *db, struct st_cache_entry **out, size_t *n,
		     struct td_errbuf *eb);
/* Removes every entry; *n (may be NULL) gets how many. The files are the caller's. */
td_err st_cache_clear(struct st_db *db, size_t *n, struct td_errbuf *eb);

#endif
