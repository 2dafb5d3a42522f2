/* Job runner threads (daemon/runner.h).
 *
 * Locking: the set's mutex guards the list of runners, each runner's progress
 * snapshot and the done list; the cancel and shutdown flags are atomics. A
 * runner thread touches the database only through its own handle. */
#include "daemon/runner.h"

#include <errno.h>
#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/identity.h"
#include "daemon/peers.h"
#include "daemon/tfevents.h"
#include "proto/jobspec.h"
#include "proto/log.h"
#include "train/base.h"

/* Metrics go to the database in batches: at most this many steps or this many
 * milliseconds late (watch polls; a resume replays the steps anyway). */
#define METRICS_BATCH 32
#define METRICS_FLUSH_MS 1000
/* A job across daemons requeued because one of them was unreachable, busy or
 * lost is placed again no sooner than this. */
#define PEER_RETRY_MS 3000

struct dmn_runner {
	struct dmn_runners *set;
	struct dmn_runner *next, *next_done;
	pthread_t thread;
	int64_t job_id;
	uid_t uid;
	gid_t gid;
	int32_t attempts;
	bool on_gpu;
	char device[DMN_MAX_GPUS * 97]; /* as dmn_run_request.device */
	uint64_t host_bytes; /* pinned host memory its plan holds (dmn_run_request) */
	int ngpus;
	struct dmn_run_gpu gpu[DMN_MAX_GPUS];
	char backend[16];
	int cuda_device;  /* the CUDA ordinal; -1: none */
	char cache_dir[PATH_MAX]; /* the module cache's root; "": none */
	char base_key[200];       /* the shared base's registry key; "": its own base */
	char base_digest[65];
	Traind__JobSpec *spec;
	struct dmn_fscreds creds;
	bool as_user;     /* creds differ from the daemon's: switch around DB writes */
	atomic_bool cancel, shutdown, creds_lost;
	/* Another job's sticky error lost this job's CUDA device: stop and be
	 * requeued (dmn_runners_lost). */
	atomic_bool device_lost;
	bool requeue;     /* runner thread: INTERRUPTED, then QUEUED at once */
	/* Preempted (dmn_runners_preempt): stop, checkpoint, be requeued. */
	atomic_bool preempt;
	char preempt_why[256];     /* under set->mu */
	char requeue_reason[1024]; /* runner thread, then the loop's after the join */
	int64_t retry_ms;          /* with requeue: not placed again before (ms) */
	const struct dmn_peer_client *peer; /* resources.hosts: the other daemons' ranks */

	/* runner thread only */
	struct st_db *db;
	bool running;     /* moved to RUNNING */
	struct dmn_tfevents *tb;
	bool tb_failed;
	struct st_metric batch[METRICS_BATCH];
	size_t nbatch;
	int64_t tokens;   /* trained since the last flush (the accounting) */
	int64_t last_flush_ms;
	char line[1024];  /* the trainer's log, assembled into lines */
	size_t linelen;

	/* under set->mu */
	struct tr_progress progress;
	bool has_progress;
	enum st_job_state final;
};

struct dmn_runners {
	uv_loop_t *loop;
	uv_async_t async;
	char *db_path;
	dmn_runner_done_fn done;
	void *ctx;
	pthread_mutex_t mu;
	struct dmn_runner *list;      /* alive (thread not joined) */
	struct dmn_runner *done_list; /* thread finished, waiting for join */
	size_t n, ncpu;
	bool closed;
	uint64_t lost;                /* CUDA ordinals (< 64) whose context is lost */
	struct tr_bases *bases;       /* the frozen bases the jobs share (train/base.h) */
};

/* ------------------------------------------------------------------------ */
/* Database writes from the runner thread, with the daemon's credentials */

static void db_enter(struct dmn_runner *rn)
{
	if (rn->as_user)
		dmn_fscreds_leave(&rn->creds);
}

static void db_leave(struct dmn_runner *rn)
{
	if (!rn->as_user)
		return;
	struct td_errbuf eb = {{0}};
	if (dmn_fscreds_enter(&rn->creds, &eb) != TD_OK) {
		/* Never keep training with root's file access. */
		atomic_store(&rn->creds_lost, true);
		td_err_log("TD-RUN-CREDS", "job %lld: %s", (long long)rn->job_id, eb.msg);
	}
}

static void event(struct dmn_runner *rn, const char *kind, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

static void event(struct dmn_runner *rn, const char *kind, const char *fmt, ...)
{
	char msg[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	struct td_errbuf eb = {{0}};
	if (st_event_add(rn->db, rn->job_id, kind, msg, &eb) != TD_OK)
		td_warn("TD-RUN-EVENT", "job %lld: cannot record event: %s", (long long)rn->job_id,
			eb.msg);
}

static void flush_metrics(struct dmn_runner *rn)
{
	struct td_errbuf eb = {{0}};
	if (rn->tokens) {
		if (st_usage_add_tokens(rn->db, rn->job_id, rn->tokens, &eb) != TD_OK)
			td_warn("TD-RUN-USAGE", "job %lld: cannot record tokens: %s",
				(long long)rn->job_id, eb.msg);
		rn->tokens = 0;
	}
	if (!rn->nbatch)
		return;
	if (st_metrics_add(rn->db, rn->job_id, rn->batch, rn->nbatch, &eb) != TD_OK)
		td_warn("TD-RUN-METRICS", "job %lld: cannot record metrics: %s", (long long)rn->job_id,
			eb.msg);
	rn->nbatch = 0;
	rn->last_flush_ms = st_now_ms();
}

/* Indexes the module-cache entry the job's backend used (contract 3): a
 * hit counts in its row (a row is added for an entry another process wrote,
 * e.g. traind --run), a fresh entry replaces its row. The files verify
 * themselves; the index is for `trainctl cache` and is never what the
 * backend trusts, so a failure here is a warning. */
static void index_module_cache(struct dmn_runner *rn, const struct gpu_cache_entry *c)
{
	if (!c->key[0])
		return;
	struct td_errbuf eb = {{0}};
	struct st_cache_entry got;
	td_err e = TD_ENOENT;
	if (c->hit && (e = st_cache_get(rn->db, c->key, &got, &eb)) == TD_OK)
		st_cache_entry_fini(&got);
	if (e == TD_ENOENT) {
		struct st_cache_entry row = {
			.key = (char *)c->key,
			.path = (char *)c->path,
			.sha256 = (char *)c->sha256,
			.arch = (char *)c->arch,
			.size_bytes = c->size_bytes,
			.src_bytes = c->src_bytes,
		};
		e = st_cache_put(rn->db, &row, &eb);
	}
	if (e != TD_OK)
		td_warn("TD-CACHE-INDEX", "job %lld: cannot index module cache entry %s: %s",
			(long long)rn->job_id, c->path, eb.msg);
}

/* ------------------------------------------------------------------------ */
/* Hooks (on the runner thread, inside tr_train, with the user's credentials) */

static bool hook_should_stop(void *ctx)
{
	struct dmn_runner *rn = ctx;
	return atomic_load(&rn->cancel) || atomic_load(&rn->shutdown) ||
	       atomic_load(&rn->creds_lost) || atomic_load(&rn->device_lost) ||
	       atomic_load(&rn->preempt);
}

static void write_tensorboard(struct dmn_runner *rn, const struct tr_progress *p)
{
	if (rn->tb_failed)
		return;
	struct td_errbuf eb = {{0}};
	if (!rn->tb) {
		char dir[PATH_MAX], tag[32];
		snprintf(dir, sizeof(dir), "%s/runs", rn->spec->output->dir);
		snprintf(tag, sizeof(tag), "job%lld", (long long)rn->job_id);
		if (dmn_tfevents_open(&rn->tb, dir, tag, &eb) != TD_OK) {
			rn->tb_failed = true;
			db_enter(rn);
			event(rn, "warn", "no TensorBoard file: %s", eb.msg);
			db_leave(rn);
			return;
		}
	}
	static const char *const tags[] = {"train/loss", "train/learning_rate", "train/grad_norm",
					   "train/tokens_per_second"};
	double vals[] = {p->loss, p->lr, p->grad_norm, p->tokens_per_s};
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	double wall = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
	if (dmn_tfevents_scalars(rn->tb, (int64_t)p->step, wall, tags, vals, 4, &eb) != TD_OK) {
		rn->tb_failed = true;
		db_enter(rn);
		event(rn, "warn", "TensorBoard file stopped: %s", eb.msg);
		db_leave(rn);
	}
}

/* PREPARING -> RUNNING, once: at the run's first step, or before a run that
 * trained no step ends as succeeded (PREPARING may not end so). With the
 * daemon's file credentials (db_enter where the user's are in force). */
static void mark_running(struct dmn_runner *rn)
{
	if (rn->running)
		return;
	rn->running = true;
	struct td_errbuf eb = {{0}};
	if (st_job_transition(rn->db, rn->job_id, ST_PREPARING, ST_RUNNING, NULL, NULL, &eb) !=
	    TD_OK)
		td_warn("TD-RUN-STATE", "job %lld: %s", (long long)rn->job_id, eb.msg);
}

static void hook_on_step(void *ctx, const struct tr_progress *p)
{
	struct dmn_runner *rn = ctx;
	pthread_mutex_lock(&rn->set->mu);
	rn->progress = *p;
	rn->has_progress = true;
	pthread_mutex_unlock(&rn->set->mu);

	write_tensorboard(rn, p);
	/* A step trains micro_batch × grad_accum sequences of seq_len tokens
	 * (packed; a padded row counts whole). */
	rn->tokens += (int64_t)rn->spec->hyper->micro_batch * (int64_t)rn->spec->hyper->grad_accum *
		      (int64_t)rn->spec->data->seq_len;

	if (rn->nbatch == METRICS_BATCH) {
		db_enter(rn);
		flush_metrics(rn);
		db_leave(rn);
	}
	struct st_metric *m = &rn->batch[rn->nbatch++];
	*m = (struct st_metric){
		.step = (int64_t)p->step,
		.time_ms = st_now_ms(),
		.loss = p->loss,
		.lr = p->lr,
		.grad_norm = p->grad_norm,
		.tokens_per_s = p->tokens_per_s,
		.eval_loss = NAN,
	};
	bool first = !rn->running;
	if (first || rn->nbatch == METRICS_BATCH || m->time_ms - rn->last_flush_ms >= METRICS_FLUSH_MS ||
	    p->step == p->total_steps) {
		db_enter(rn);
		mark_running(rn);
		flush_metrics(rn);
		db_leave(rn);
	}
}

static void hook_on_checkpoint(void *ctx, uint64_t step, const char *dir)
{
	struct dmn_runner *rn = ctx;
	struct td_errbuf eb = {{0}};
	db_enter(rn);
	flush_metrics(rn);
	if (st_job_set_checkpoint(rn->db, rn->job_id, dir, (int64_t)step, &eb) != TD_OK)
		td_warn("TD-RUN-CKPT", "job %lld: cannot record checkpoint %s: %s",
			(long long)rn->job_id, dir, eb.msg);
	db_leave(rn);
}

/* An evaluation: a metrics row with the eval loss only (the stored row of
 * that step keeps its other values) and an "eval/loss" scalar. The trainer
 * reports evaluations only in its log ("eval STEP loss X ..."), so they are
 * read from there; a tr_hooks callback would be sturdier. */
static void record_eval(struct dmn_runner *rn, uint64_t step, double loss)
{
	if (rn->tb) {
		static const char *const tag[] = {"eval/loss"};
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		struct td_errbuf eb = {{0}};
		dmn_tfevents_scalars(rn->tb, (int64_t)step, (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9,
				     tag, &loss, 1, &eb);
	}
	if (rn->nbatch == METRICS_BATCH) {
		db_enter(rn);
		flush_metrics(rn);
		db_leave(rn);
	}
	rn->batch[rn->nbatch++] = (struct st_metric){
		.step = (int64_t)step,
		.time_ms = st_now_ms(),
		.loss = NAN,
		.lr = NAN,
		.grad_norm = NAN,
		.tokens_per_s = NAN,
		.eval_loss = loss,
	};
}

/* The trainer's log FILE: whole lines become "log" events, except the
 * per-step lines, which are metrics already. */
static void log_line(struct dmn_runner *rn, const char *line)
{
	if (!*line || strncmp(line, "step ", 5) == 0)
		return;
	unsigned long long step;
	double loss;
	if (sscanf(line, "eval %llu loss %lf", &step, &loss) == 2)
		record_eval(rn, step, loss);
	db_enter(rn);
	event(rn, "log", "%s", line);
	db_leave(rn);
}

static ssize_t log_write(void *cookie, const char *buf, size_t n)
{
	struct dmn_runner *rn = cookie;
	for (size_t i = 0; i < n; i++) {
		if (buf[i] == '\n' || rn->linelen + 1 == sizeof(rn->line)) {
			rn->line[rn->linelen] = 0;
			log_line(rn, rn->line);
			rn->linelen = 0;
			if (buf[i] == '\n')
				continue;
		}
		rn->line[rn->linelen++] = buf[i];
	}
	return (ssize_t)n;
}

static int log_close(void *cookie)
{
	struct dmn_runner *rn = cookie;
	if (rn->linelen) {
		rn->line[rn->linelen] = 0;
		log_line(rn, rn->line);
		rn->linelen = 0;
	}
	return 0;
}

/* ------------------------------------------------------------------------ */
/* The thread */

/* A resumed run whose output already holds the finished model: the previous
 * run completed and the daemon died before it could record that. */
static bool finished_before(struct dmn_runner *rn)
{
	if (rn->attempts < 1)
		return false;
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/trainer_state.json", rn->spec->output->dir);
	struct json_object *o = json_object_from_file(path), *v;
	if (!o)
		return false;
	bool done = json_object_object_get_ex(o, "final", &v) && json_object_get_boolean(v) &&
		    json_object_object_get_ex(o, "model_dir", &v) &&
		    strcmp(json_object_get_string(v), rn->spec->model_dir) == 0 &&
		    json_object_object_get_ex(o, "train_file", &v) &&
		    strcmp(json_object_get_string(v), rn->spec->data->train_file) == 0;
	json_object_put(o);
	return done;
}

/* Whether rn runs on CUDA ordinal d: its device, or one of its gang's. */
static bool runs_on(const struct dmn_runner *rn, int d)
{
	if (d < 0)
		return false;
	if (rn->cuda_device == d)
		return true;
	for (int k = 0; k < rn->ngpus; k++)
		if (!rn->gpu[k].fake && rn->gpu[k].ordinal == d)
			return true;
	return false;
}

/* Runner thread: CUDA ordinal `ordinal` of rn's lost its context. Marks the
 * device lost (the scheduler admits nothing there until it has reset it)
 * and asks every other runner on it to stop. true if rn is the first job to
 * report it: the one whose fault it is taken to be (CUDA does not say which
 * stream faulted; the others see the same error from then on). */
static bool device_lost_first(struct dmn_runner *rn, int ordinal)
{
	struct dmn_runners *set = rn->set;
	uint64_t bit = ordinal >= 0 && ordinal < 64 ? (uint64_t)1 << ordinal : 0;
	pthread_mutex_lock(&set->mu);
	bool first = !(set->lost & bit) && !atomic_load(&rn->device_lost);
	set->lost |= bit;
	for (struct dmn_runner *o = set->list; o; o = o->next)
		if (o != rn && runs_on(o, ordinal))
			atomic_store(&o->device_lost, true);
	pthread_mutex_unlock(&set->mu);
	return first;
}

#define DEVICE_LOST_REQUEUE \
	"requeued after its CUDA device lost its context; resumes from its last checkpoint"

static enum st_job_state run_job(struct dmn_runner *rn, char *reason, size_t cap)
{
	struct td_errbuf eb = {{0}};
	td_err e = st_job_transition(rn->db, rn->job_id, ST_ADMITTED, ST_PREPARING, NULL, NULL, &eb);
	if (e == TD_EBUSY) {
		/* Cancelled between admission and now. */
		snprintf(reason, cap, "%s", eb.msg);
		return ST_CANCELLED;
	}
	if (e != TD_OK) {
		snprintf(reason, cap, "cannot start: %s", eb.msg);
		return ST_FAILED;
	}
	if (atomic_load(&rn->cancel)) {
		snprintf(reason, cap, "cancelled before it started");
		return ST_CANCELLED;
	}
	if (atomic_load(&rn->shutdown)) {
		snprintf(reason, cap, "the daemon stopped before the job started");
		return ST_INTERRUPTED;
	}
	if (atomic_load(&rn->preempt)) {
		pthread_mutex_lock(&rn->set->mu);
		snprintf(reason, cap, "%s before it started", rn->preempt_why);
		snprintf(rn->requeue_reason, sizeof(rn->requeue_reason), "%s before it started; queued "
			 "again", rn->preempt_why);
		pthread_mutex_unlock(&rn->set->mu);
		rn->requeue = true;
		return ST_INTERRUPTED;
	}
	int devices[DMN_MAX_GPUS];
	if (rn->ngpus > 1) {
		char leases[DMN_MAX_GPUS * 24], ords[DMN_MAX_GPUS * 8];
		size_t len = 0, lo = 0;
		ords[0] = 0;
		for (int k = 0; k < rn->ngpus; k++) {
			len += (size_t)snprintf(leases + len, sizeof(leases) - len, "%s%lld",
						k ? ", " : "", (long long)rn->gpu[k].lease);
			devices[k] = rn->gpu[k].fake ? -1 : rn->gpu[k].ordinal;
			if (!rn->gpu[k].fake)
				lo += (size_t)snprintf(ords + lo, sizeof(ords) - lo, "%s%d", k ? ", " : "",
						       rn->gpu[k].ordinal);
		}
		if (rn->gpu[0].fake)
			event(rn, "info",
			      "data parallel on a gang of %d simulated GPUs (%s; leases %s): %d ranks on the "
			      "CPU; attempt %d, as uid %u",
			      rn->ngpus, rn->device, leases, rn->ngpus, rn->attempts + 1, (unsigned)rn->uid);
		else
			event(rn, "info",
			      "data parallel on a gang of %d GPUs (%s; leases %s): %d ranks with the %s "
			      "backend on CUDA devices %s; attempt %d, as uid %u",
			      rn->ngpus, rn->device, leases, rn->ngpus, rn->backend, ords, rn->attempts + 1,
			      (unsigned)rn->uid);
	} else if (rn->cuda_device >= 0)
		event(rn, "info", "running on %s (%s backend, CUDA device %d), attempt %d, as uid %u",
		      rn->device, rn->backend, rn->cuda_device, rn->attempts + 1, (unsigned)rn->uid);
	else
		event(rn, "info", "running on %s (%s backend), attempt %d, as uid %u", rn->device,
		      rn->backend, rn->attempts + 1, (unsigned)rn->uid);

	/* A resumed run whose output already holds the finished model: recorded
	 * as succeeded, through RUNNING (the previous attempt ran; PREPARING
	 * may not end in SUCCEEDED), before any other daemon is asked to start
	 * ranks for it. */
	if ((e = dmn_fscreds_enter(&rn->creds, &eb)) != TD_OK) {
		snprintf(reason, cap, "%s", eb.msg);
		return ST_FAILED;
	}
	bool finished = finished_before(rn);
	dmn_fscreds_leave(&rn->creds);
	if (finished) {
		mark_running(rn);
		snprintf(reason, cap, "the previous run finished before the daemon restarted; the "
				      "model is in %s",
			 rn->spec->output->dir);
		return ST_SUCCEEDED;
	}

	/* Across daemons: the other daemons reserve their GPUs and start their
	 * ranks, which wait in this run's hub. One unreachable, busy or still
	 * ending its last run: requeued and tried again shortly. */
	struct dmn_peer_job *pj = NULL;
	if (rn->peer) {
		bool retry = false;
		e = dmn_peer_job_start(&pj, rn->peer, rn->job_id, (uint32_t)rn->attempts + 1, rn->uid,
				       rn->gid, rn->spec, rn->ngpus ? rn->gpu[0].bytes : 0, &retry, &eb);
		if (e != TD_OK && retry) {
			rn->requeue = true;
			rn->retry_ms = PEER_RETRY_MS;
			snprintf(rn->requeue_reason, sizeof(rn->requeue_reason),
				 "waits for the daemons of resources.hosts: %s; tried again every %d s",
				 eb.msg, PEER_RETRY_MS / 1000);
			snprintf(reason, cap, "%s; requeued", eb.msg);
			return ST_INTERRUPTED;
		}
		if (e != TD_OK) {
			snprintf(reason, cap, "%s", eb.msg);
			return ST_FAILED;
		}
		event(rn, "info",
		      "across daemons: %d ranks; this daemon's %d (ranks 0 to %d), %s; their gang's hub "
		      "%s",
		      dmn_peer_job_world(pj), rn->ngpus, rn->ngpus - 1, dmn_peer_job_where(pj),
		      dmn_peer_job_hub(pj));
		if (rn->ngpus == 1)
			devices[0] = rn->gpu[0].fake ? -1 : rn->gpu[0].ordinal;
	}
	if ((e = dmn_fscreds_enter(&rn->creds, &eb)) != TD_OK) {
		dmn_peer_job_end(pj);
		snprintf(reason, cap, "%s", eb.msg);
		return ST_FAILED;
	}
	cookie_io_functions_t io = {.write = log_write, .close = log_close};
	FILE *log = fopencookie(rn, "w", io);
	if (log)
		setvbuf(log, NULL, _IOLBF, 0);
	struct tr_train_opts opts = {.backend = rn->backend,
				     .log = log,
				     .has_device = rn->cuda_device >= 0,
				     .device_index = rn->cuda_device,
				     /* The module cache is the daemon's, written with its
				      * credentials: a job run with a user's file credentials
				      * could neither read nor write it (and must not plant
				      * cubins other users' jobs load), so it compiles. */
				     .cache_dir = rn->cache_dir[0] && !rn->as_user ? rn->cache_dir : NULL,
				     /* a gang: one rank on each of its GPUs */
				     .ranks = rn->ngpus > 1 ? rn->ngpus : 1,
				     .devices = rn->ngpus > 1 || pj ? devices : NULL,
				     /* across daemons: ranks 0 .. ngpus - 1 of the job's */
				     .hub = pj ? dmn_peer_job_hub(pj) : NULL,
				     .hub_token = pj ? dmn_peer_job_token(pj) : NULL,
				     .hub_label = pj ? rn->peer->self : NULL,
				     .world = pj ? dmn_peer_job_world(pj) : 0,
				     .bases = rn->base_key[0] ? rn->set->bases : NULL,
				     .base_key = rn->base_key[0] ? rn->base_key : NULL,
				     .base_digest = rn->base_digest[0] ? rn->base_digest : NULL};
	struct tr_hooks hooks = {
		.on_step = hook_on_step,
		.on_checkpoint = hook_on_checkpoint,
		.should_stop = hook_should_stop,
		.ctx = rn,
	};
	struct tr_train_result res;
	e = tr_train(rn->spec, &opts, &hooks, &res, &eb);
	if (log)
		fclose(log);
	dmn_tfevents_close(rn->tb);
	rn->tb = NULL;
	dmn_fscreds_leave(&rn->creds);
	dmn_peer_job_end(pj);
	flush_metrics(rn);
	index_module_cache(rn, &res.cache);

	if (atomic_load(&rn->creds_lost)) {
		snprintf(reason, cap, "stopped: could not keep the submitter's file credentials");
		return ST_FAILED;
	}
	/* A sticky CUDA error: the device's context is lost for every job on
	 * it. The first job to report it fails with the error; the others
	 * (their own sync fails the same way, or they were told to stop) are
	 * requeued and resume from their last checkpoint once the scheduler has
	 * reset the device. */
	bool dev_err = e == TD_EDEVICE_LOST || ((e == TD_EDEVICE || e == TD_ENOMEM) &&
						 atomic_load(&rn->device_lost));
	/* A gang's error is its first failing rank's, on that rank's GPU. */
	int lost_dev = rn->ngpus > 1 || pj ? res.failed_device : rn->cuda_device;
	if (lost_dev >= 0 && dev_err) {
		if (device_lost_first(rn, lost_dev)) {
			snprintf(reason, cap, "%s (CUDA device %d: the other jobs on it are requeued and "
					      "its context is reset)",
				 eb.msg[0] ? eb.msg : td_strerror(e), lost_dev);
			return ST_FAILED;
		}
		if (atomic_load(&rn->cancel)) {
			snprintf(reason, cap, "cancelled; CUDA device %d had lost its context: %s",
				 lost_dev, eb.msg);
			return ST_CANCELLED;
		}
		rn->requeue = true;
		snprintf(rn->requeue_reason, sizeof(rn->requeue_reason), "%s", DEVICE_LOST_REQUEUE);
		snprintf(reason, cap, "CUDA device %d lost its context by another job's fault (%s); "
				      "requeued, resumes from its last checkpoint",
			 lost_dev, eb.msg[0] ? eb.msg : td_strerror(e));
		return ST_INTERRUPTED;
	}
	/* A daemon of the job lost (its process, its host, the network): no
	 * rank's fault; the job goes back to the queue and resumes from its
	 * last checkpoint once every daemon answers again. */
	if (e == TD_EPEER_LOST && pj && !atomic_load(&rn->cancel) && !atomic_load(&rn->shutdown)) {
		rn->requeue = true;
		rn->retry_ms = PEER_RETRY_MS;
		snprintf(rn->requeue_reason, sizeof(rn->requeue_reason),
			 "a daemon of the job was lost at step %llu (%s); requeued, resumes from its last "
			 "checkpoint once every daemon of resources.hosts answers",
			 (unsigned long long)res.steps_done, eb.msg);
		snprintf(reason, cap, "%s; requeued", eb.msg);
		return ST_INTERRUPTED;
	}
	if (e != TD_OK) {
		snprintf(reason, cap, "%s", eb.msg[0] ? eb.msg : td_strerror(e));
		return ST_FAILED;
	}
	if (res.stopped && atomic_load(&rn->cancel)) {
		snprintf(reason, cap, "cancelled at step %llu/%llu", (unsigned long long)res.steps_done,
			 (unsigned long long)res.total_steps);
		return ST_CANCELLED;
	}
	if (res.stopped && atomic_load(&rn->device_lost) && !atomic_load(&rn->shutdown)) {
		rn->requeue = true;
		snprintf(rn->requeue_reason, sizeof(rn->requeue_reason), "%s", DEVICE_LOST_REQUEUE);
		snprintf(reason, cap, "stopped at step %llu/%llu: CUDA device %d lost its context by "
				      "another job's fault; requeued, resumes from its last checkpoint",
			 (unsigned long long)res.steps_done, (unsigned long long)res.total_steps,
			 rn->cuda_device);
		return ST_INTERRUPTED;
	}
	if (res.stopped && atomic_load(&rn->preempt) && !atomic_load(&rn->shutdown)) {
		/* Requeued at once, with the checkpoint the trainer just wrote at
		 * this step boundary: the resumed run is bit-identical. */
		char why[256];
		pthread_mutex_lock(&rn->set->mu);
		snprintf(why, sizeof(why), "%s", rn->preempt_why);
		pthread_mutex_unlock(&rn->set->mu);
		rn->requeue = true;
		snprintf(reason, cap, "%s at step %llu/%llu; checkpointed, back in the queue",
			 why, (unsigned long long)res.steps_done, (unsigned long long)res.total_steps);
		snprintf(rn->requeue_reason, sizeof(rn->requeue_reason),
			 "%s at step %llu/%llu; resumes from its checkpoint at step %llu", why,
			 (unsigned long long)res.steps_done, (unsigned long long)res.total_steps,
			 (unsigned long long)res.steps_done);
		return ST_INTERRUPTED;
	}
	if (res.stopped && pj && !atomic_load(&rn->shutdown)) {
		/* Another daemon of the job asked its ranks to stop (it is
		 * stopping): the ranks stopped together after rank 0's
		 * checkpoint. */
		rn->requeue = true;
		rn->retry_ms = PEER_RETRY_MS;
		snprintf(rn->requeue_reason, sizeof(rn->requeue_reason),
			 "a daemon of resources.hosts stopped the job at step %llu/%llu (it is "
			 "stopping); resumes from its checkpoint once every daemon answers",
			 (unsigned long long)res.steps_done, (unsigned long long)res.total_steps);
		snprintf(reason, cap, "stopped at step %llu/%llu by another daemon of the job; requeued",
			 (unsigned long long)res.steps_done, (unsigned long long)res.total_steps);
		return ST_INTERRUPTED;
	}
	if (res.stopped) {
		snprintf(reason, cap, "the daemon stopped at step %llu/%llu; resumes from its "
				      "checkpoint at the next start",
			 (unsigned long long)res.steps_done, (unsigned long long)res.total_steps);
		return ST_INTERRUPTED;
	}
	if (res.resumed_from)
		event(rn, "info", "resumed from step %llu", (unsigned long long)res.resumed_from);
	/* a run resumed from its last step's checkpoint (killed before its
	 * model was written) trained no step: on_step never came */
	mark_running(rn);
	snprintf(reason, cap, "%llu steps, loss %.4f -> %.4f; model in %s",
		 (unsigned long long)res.steps_done, res.first_loss, res.last_loss, res.output_dir);
	return ST_SUCCEEDED;
}

static void *runner_main(void *arg)
{
	struct dmn_runner *rn = arg;
	struct dmn_runners *set = rn->set;
	struct td_errbuf eb = {{0}};
	char reason[1024] = "";
	enum st_job_state final = ST_FAILED;

	td_err e = st_open(&rn->db, set->db_path, NULL, &eb);
	if (e != TD_OK) {
		td_err_log("TD-RUN-DB", "job %lld: cannot open the database: %s", (long long)rn->job_id,
			   eb.msg);
		final = ST_INTERRUPTED; /* the loop records it (see done_cb) */
	} else {
		rn->last_flush_ms = st_now_ms();
		final = run_job(rn, reason, sizeof(reason));
		td_err te = st_job_transition(rn->db, rn->job_id, ST_ANY_STATE, final, reason, NULL, &eb);
		if (te != TD_OK && te != TD_ESTATE)
			td_err_log("TD-RUN-STATE", "job %lld: cannot record %s: %s", (long long)rn->job_id,
				   st_job_state_name(final), eb.msg);
		size_t nrel = 0;
		if (st_ledger_release_job(rn->db, rn->job_id, &nrel, &eb) != TD_OK)
			td_err_log("TD-RUN-LEASE", "job %lld: cannot release its leases: %s",
				   (long long)rn->job_id, eb.msg);
		if (final == ST_FAILED)
			td_warn("TD-JOB-FAIL", "job %lld failed: %s", (long long)rn->job_id, reason);
		else
			td_info("TD-JOB-END", "job %lld %s: %s", (long long)rn->job_id,
				st_job_state_name(final), reason);
		if (te == TD_OK && rn->requeue)
			final = ST_QUEUED; /* recorded INTERRUPTED; the loop requeues it (runner.h) */
		st_close(rn->db);
		rn->db = NULL;
	}

	pthread_mutex_lock(&set->mu);
	rn->final = final;
	rn->next_done = set->done_list;
	set->done_list = rn;
	pthread_mutex_unlock(&set->mu);
	uv_async_send(&set->async);
	return NULL;
}

static void runner_free(struct dmn_runner *rn)
{
	rpc_jobspec_free(rn->spec);
	free(rn);
}

/* Loop thread: join the finished threads, tell the scheduler. */
static void done_cb(uv_async_t *h)
{
	struct dmn_runners *set = h->data;
	pthread_mutex_lock(&set->mu);
	struct dmn_runner *done = set->done_list;
	set->done_list = NULL;
	for (struct dmn_runner *d = done; d; d = d->next_done) {
		for (struct dmn_runner **pp = &set->list; *pp; pp = &(*pp)->next) {
			if (*pp == d) {
				*pp = d->next;
				break;
			}
		}
		set->n--;
		if (!d->on_gpu)
			set->ncpu--;
	}
	pthread_mutex_unlock(&set->mu);
	while (done) {
		struct dmn_runner *d = done;
		done = d->next_done;
		pthread_join(d->thread, NULL);
		if (set->done)
			set->done(set->ctx, d->job_id, d->final, d->on_gpu,
				  d->final == ST_QUEUED ? d->requeue_reason : "",
				  d->final == ST_QUEUED ? d->retry_ms : 0);
		runner_free(d);
	}
}

td_err dmn_runners_new(struct dmn_runners **out, uv_loop_t *loop, const char *db_path,
		       dmn_runner_done_fn done, void *ctx, struct td_errbuf *eb)
{
	struct dmn_runners *r = calloc(1, sizeof(*r));
	if (!r || !(r->db_path = strdup(db_path)) || tr_bases_new(&r->bases, eb) != TD_OK) {
		if (r)
			free(r->db_path);
		free(r);
		return td_fail(eb, TD_ENOMEM, "runners: out of memory");
	}
	r->loop = loop;
	r->done = done;
	r->ctx = ctx;
	pthread_mutex_init(&r->mu, NULL);
	int rv = uv_async_init(loop, &r->async, done_cb);
	if (rv != 0) {
		pthread_mutex_destroy(&r->mu);
		tr_bases_free(r->bases);
		free(r->db_path);
		free(r);
		return td_fail(eb, TD_EINTERNAL, "runners: uv_async_init: %s", uv_strerror(rv));
	}
	r->async.data = r;
	*out = r;
	return TD_OK;
}

td_err dmn_runners_start(struct dmn_runners *r, struct dmn_run_request *req, struct td_errbuf *eb)
{
	if (r->closed)
		return td_fail(eb, TD_ESTATE, "job %lld: the daemon is stopping", (long long)req->job_id);
	struct dmn_runner *rn = calloc(1, sizeof(*rn));
	if (!rn)
		return td_fail(eb, TD_ENOMEM, "job %lld: out of memory", (long long)req->job_id);
	rn->set = r;
	rn->job_id = req->job_id;
	rn->uid = req->uid;
	rn->gid = req->gid;
	rn->attempts = req->attempts;
	rn->on_gpu = req->on_gpu;
	snprintf(rn->device, sizeof(rn->device), "%s", req->device);
	snprintf(rn->backend, sizeof(rn->backend), "%s", req->backend);
	rn->cuda_device = req->cuda_device;
	rn->peer = req->peer;
	rn->host_bytes = req->host_bytes;
	rn->ngpus = req->ngpus > 0 && req->ngpus <= DMN_MAX_GPUS ? req->ngpus : 0;
	memcpy(rn->gpu, req->gpu, (size_t)rn->ngpus * sizeof(rn->gpu[0]));
	if (req->cache_dir)
		snprintf(rn->cache_dir, sizeof(rn->cache_dir), "%s", req->cache_dir);
	if (req->base_shared) {
		snprintf(rn->base_key, sizeof(rn->base_key), "%s", req->base_key);
		snprintf(rn->base_digest, sizeof(rn->base_digest), "%s",
			 req->base_digest ? req->base_digest : "");
	}
	td_err e = dmn_fscreds_of(&rn->creds, req->uid, req->gid, eb);
	if (e != TD_OK) {
		free(rn);
		return e;
	}
	rn->as_user = dmn_fscreds_needed(&rn->creds);
	rn->spec = req->spec;

	pthread_mutex_lock(&r->mu);
	int rv = pthread_create(&rn->thread, NULL, runner_main, rn);
	if (rv == 0) {
		rn->next = r->list;
		r->list = rn;
		r->n++;
		if (!rn->on_gpu)
			r->ncpu++;
	}
	pthread_mutex_unlock(&r->mu);
	if (rv != 0) {
		free(rn);
		return td_fail(eb, TD_EINTERNAL, "job %lld: cannot start a thread: %s",
			       (long long)req->job_id, strerror(rv));
	}
	req->spec = NULL;
	return TD_OK;
}

bool dmn_runners_cancel(struct dmn_runners *r, int64_t job_id)
{
	bool found = false;
	pthread_mutex_lock(&r->mu);
	for (struct dmn_runner *rn = r->list; rn; rn = rn->next) {
		if (rn->job_id == job_id) {
			atomic_store(&rn->cancel, true);
			found = true;
		}
	}
	pthread_mutex_unlock(&r->mu);
	return found;
}

bool dmn_runners_preempt(struct dmn_runners *r, int64_t job_id, const char *why)
{
	bool found = false;
	pthread_mutex_lock(&r->mu);
	for (struct dmn_runner *rn = r->list; rn; rn = rn->next) {
		if (rn->job_id == job_id) {
			snprintf(rn->preempt_why, sizeof(rn->preempt_why), "%s", why);
			atomic_store(&rn->preempt, true);
			found = true;
		}
	}
	pthread_mutex_unlock(&r->mu);
	return found;
}

size_t dmn_runners_list(struct dmn_runners *r, struct dmn_run_info *out, size_t cap)
{
	size_t n = 0;
	pthread_mutex_lock(&r->mu);
	for (struct dmn_runner *rn = r->list; rn; rn = rn->next, n++) {
		if (n >= cap)
			continue;
		struct dmn_run_info *o = &out[n];
		*o = (struct dmn_run_info){
			.job_id = rn->job_id,
			.uid = rn->uid,
			.on_gpu = rn->on_gpu,
			.stopping = atomic_load(&rn->cancel) || atomic_load(&rn->preempt) ||
				    atomic_load(&rn->shutdown) || atomic_load(&rn->device_lost),
			.ngpus = rn->ngpus,
			.host_bytes = rn->host_bytes,
		};
		memcpy(o->gpu, rn->gpu, (size_t)rn->ngpus * sizeof(rn->gpu[0]));
	}
	pthread_mutex_unlock(&r->mu);
	return n;
}

void dmn_runners_stop_all(struct dmn_runners *r)
{
	pthread_mutex_lock(&r->mu);
	for (struct dmn_runner *rn = r->list; rn; rn = rn->next)
		atomic_store(&rn->shutdown, true);
	pthread_mutex_unlock(&r->mu);
}

bool dmn_runners_lost(struct dmn_runners *r, int ordinal)
{
	if (ordinal < 0 || ordinal >= 64)
		return false;
	pthread_mutex_lock(&r->mu);
	bool lost = (r->lost >> ordinal) & 1;
	pthread_mutex_unlock(&r->mu);
	return lost;
}

int dmn_runners_lost_idle(struct dmn_runners *r, uint64_t skip)
{
	int found = -1;
	pthread_mutex_lock(&r->mu);
	for (int d = 0; d < 64 && found < 0; d++) {
		if (!((r->lost >> d) & 1) || ((skip >> d) & 1))
			continue;
		bool busy = false;
		for (struct dmn_runner *rn = r->list; rn && !busy; rn = rn->next)
			busy = runs_on(rn, d);
		if (!busy)
			found = d;
	}
	pthread_mutex_unlock(&r->mu);
	return found;
}

void dmn_runners_lost_clear(struct dmn_runners *r, int ordinal)
{
	if (ordinal < 0 || ordinal >= 64)
		return;
	pthread_mutex_lock(&r->mu);
	r->lost &= ~((uint64_t)1 << ordinal);
	pthread_mutex_unlock(&r->mu);
}

uint64_t dmn_runners_host_bytes(struct dmn_runners *r, int64_t job_id)
{
	uint64_t sum = 0;
	pthread_mutex_lock(&r->mu);
	for (struct dmn_runner *rn = r->list; rn; rn = rn->next)
		if (job_id < 0 || rn->job_id == job_id)
			sum += rn->host_bytes;
	pthread_mutex_unlock(&r->mu);
	return sum;
}

size_t dmn_runners_count(const struct dmn_runners *r)
{
	return r->n;
}

size_t dmn_runners_count_cpu(const struct dmn_runners *r)
{
	return r->ncpu;
}

bool dmn_runners_progress(struct dmn_runners *r, int64_t job_id, struct tr_progress *out)
{
	bool found = false;
	pthread_mutex_lock(&r->mu);
	for (struct dmn_runner *rn = r->list; rn; rn = rn->next) {
		if (rn->job_id == job_id && rn->has_progress) {
			*out = rn->progress;
			found = true;
			break;
		}
	}
	pthread_mutex_unlock(&r->mu);
	return found;
}

void dmn_runners_close(struct dmn_runners *r)
{
	if (!r || r->closed)
		return;
	r->closed = true;
	uv_close((uv_handle_t *)&r->async, NULL);
}

td_err dmn_runners_free(struct dmn_runners *r)
{
	if (!r)
		return TD_OK;
	pthread_mutex_lock(&r->mu);
	bool busy = r->list != NULL;
	pthread_mutex_unlock(&r->mu);
	if (busy)
		return TD_EBUSY;
	pthread_mutex_destroy(&r->mu);
	tr_bases_free(r->bases); /* every job released its base with its end */
	free(r->db_path);
	free(r);
	return TD_OK;
}
