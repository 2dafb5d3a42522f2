/* The scheduler (daemon/scheduler.h). */
#include "daemon/scheduler.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/identity.h"
#include "daemon/preflight.h"
#include "gpu/select.h"
#include "proto/jobspec.h"
#include "proto/log.h"

struct claim {
	int64_t key;  /* the job id, or a negative provisional key */
	char *dir;
};

struct plan {
	int64_t job_id;
	uint64_t bytes;
	int state;    /* PLAN_* */
	char err[512];
};
enum { PLAN_PENDING = 1, PLAN_DONE, PLAN_FAILED };

struct plan_work {
	uv_work_t req;
	struct dmn_sched *s;
	int64_t job_id;
	uid_t uid;
	gid_t gid;
	Traind__JobSpec *spec;
	uint64_t bytes;
	td_err err;
	struct td_errbuf eb;
};

struct dmn_sched {
	uv_loop_t *loop;
	struct st_db *db;
	const struct dmn_config *cfg;
	const struct dmn_devices *dev;
	struct dmn_runners *run;
	uv_timer_t kick;
	bool kicked, stopping, closed;
	struct claim *claims;
	size_t nclaims, capclaims;
	int64_t next_provisional;
	struct plan *plans;
	size_t nplans, capplans;
	size_t plans_in_flight;
	uint32_t queued;
	uint64_t reset_failed; /* lost CUDA ordinals whose reset failed: retried each tick */
};

/* ------------------------------------------------------------------------ */
/* Output dir claims and plans */

static struct claim *claim_find_key(struct dmn_sched *s, int64_t key)
{
	for (size_t i = 0; i < s->nclaims; i++)
		if (s->claims[i].key == key)
			return &s->claims[i];
	return NULL;
}

static void claim_remove(struct dmn_sched *s, int64_t key)
{
	struct claim *c = claim_find_key(s, key);
	if (!c)
		return;
	free(c->dir);
	*c = s->claims[--s->nclaims];
}

static td_err claim_add(struct dmn_sched *s, int64_t key, const char *dir, struct td_errbuf *eb)
{
	if (s->nclaims == s->capclaims) {
		size_t cap = s->capclaims ? 2 * s->capclaims : 64;
		struct claim *c = realloc(s->claims, cap * sizeof(*c));
		if (!c)
			return td_fail(eb, TD_ENOMEM, "scheduler: out of memory");
		s->claims = c;
		s->capclaims = cap;
	}
	char *d = strdup(dir);
	if (!d)
		return td_fail(eb, TD_ENOMEM, "scheduler: out of memory");
	s->claims[s->nclaims++] = (struct claim){key, d};
	return TD_OK;
}

td_err dmn_sched_claim_output(struct dmn_sched *s, const char *dir, int64_t *claim,
			      struct td_errbuf *eb)
{
	/* Trailing slashes do not make another directory. */
	char norm[4096];
	snprintf(norm, sizeof(norm), "%s", dir);
	for (size_t n = strlen(norm); n > 1 && norm[n - 1] == '/'; n--)
		norm[n - 1] = 0;
	for (size_t i = 0; i < s->nclaims; i++) {
		if (strcmp(s->claims[i].dir, norm) == 0) {
			if (s->claims[i].key > 0)
				return td_fail(eb, TD_EBUSY,
					       "output.dir: %s is the output of job %lld, which has not "
					       "ended; choose another dir or cancel that job",
					       norm, (long long)s->claims[i].key);
			return td_fail(eb, TD_EBUSY,
				       "output.dir: %s is the output of a job being submitted right "
				       "now; choose another dir",
				       norm);
		}
	}
	int64_t key = --s->next_provisional;
	td_err e = claim_add(s, key, norm, eb);
	if (e == TD_OK)
		*claim = key;
	return e;
}

void dmn_sched_claim_bind(struct dmn_sched *s, int64_t claim, int64_t job_id)
{
	struct claim *c = claim_find_key(s, claim);
	if (c)
		c->key = job_id;
}

void dmn_sched_claim_drop(struct dmn_sched *s, int64_t claim)
{
	claim_remove(s, claim);
}

static struct plan *plan_find(struct dmn_sched *s, int64_t job_id)
{
	for (size_t i = 0; i < s->nplans; i++)
		if (s->plans[i].job_id == job_id)
			return &s->plans[i];
	return NULL;
}

static struct plan *plan_get(struct dmn_sched *s, int64_t job_id)
{
	struct plan *p = plan_find(s, job_id);
	if (p)
		return p;
	if (s->nplans == s->capplans) {
		size_t cap = s->capplans ? 2 * s->capplans : 64;
		struct plan *np = realloc(s->plans, cap * sizeof(*np));
		if (!np)
			return NULL;
		s->plans = np;
		s->capplans = cap;
	}
	p = &s->plans[s->nplans++];
	memset(p, 0, sizeof(*p));
	p->job_id = job_id;
	return p;
}

static void plan_remove(struct dmn_sched *s, int64_t job_id)
{
	struct plan *p = plan_find(s, job_id);
	if (p && p->state != PLAN_PENDING)
		*p = s->plans[--s->nplans];
}

void dmn_sched_set_plan(struct dmn_sched *s, int64_t job_id, uint64_t bytes)
{
	struct plan *p = plan_get(s, job_id);
	if (p) {
		p->bytes = bytes;
		p->state = PLAN_DONE;
	}
}

static void plan_work(uv_work_t *req)
{
	struct plan_work *w = req->data;
	struct dmn_fscreds creds;
	w->err = dmn_fscreds_of(&creds, w->uid, w->gid, &w->eb);
	if (w->err == TD_OK)
		w->err = dmn_preflight(w->spec, &creds, &w->bytes, &w->eb);
}

static void plan_done(uv_work_t *req, int status)
{
	struct plan_work *w = req->data;
	struct dmn_sched *s = w->s;
	s->plans_in_flight--;
	struct plan *p = plan_find(s, w->job_id);
	if (p) {
		if (status == 0 && w->err == TD_OK) {
			p->state = PLAN_DONE;
			p->bytes = w->bytes;
		} else {
			p->state = PLAN_FAILED;
			snprintf(p->err, sizeof(p->err), "%s",
				 status ? uv_strerror(status) : w->eb.msg[0] ? w->eb.msg : td_strerror(w->err));
		}
	}
	rpc_jobspec_free(w->spec);
	free(w);
	dmn_sched_kick(s);
}

/* A job queued before this daemon started has no plan in memory: compute it
 * on a worker, as its owner. */
static void plan_request(struct dmn_sched *s, const struct st_queued *q, const Traind__JobSpec *spec)
{
	struct plan *p = plan_get(s, q->id);
	struct plan_work *w = calloc(1, sizeof(*w));
	if (!p || !w || rpc_jobspec_copy(&w->spec, spec) != TD_OK) {
		free(w);
		return; /* out of memory: tried again next pass */
	}
	w->req.data = w;
	w->s = s;
	w->job_id = q->id;
	w->uid = q->uid;
	w->gid = q->gid;
	if (uv_queue_work(s->loop, &w->req, plan_work, plan_done) != 0) {
		rpc_jobspec_free(w->spec);
		free(w);
		return;
	}
	p->state = PLAN_PENDING;
	s->plans_in_flight++;
}

/* ------------------------------------------------------------------------ */
/* A pass */

static void fail_job(struct dmn_sched *s, int64_t id, const char *reason)
{
	struct td_errbuf eb = {{0}};
	if (st_job_transition(s->db, id, ST_QUEUED, ST_FAILED, reason, NULL, &eb) != TD_OK)
		td_warn("TD-SCHED-STATE", "job %lld: %s", (long long)id, eb.msg);
	else
		td_warn("TD-JOB-FAIL", "job %lld failed: %s", (long long)id, reason);
	dmn_sched_job_ended(s, id);
}

struct user_count {
	uid_t uid;
	uint32_t started;
};

static uint32_t *started_for(struct user_count *uc, size_t *nuc, size_t cap, uid_t uid)
{
	for (size_t i = 0; i < *nuc; i++)
		if (uc[i].uid == uid)
			return &uc[i].started;
	if (*nuc == cap)
		return NULL;
	uc[*nuc] = (struct user_count){uid, 0};
	return &uc[(*nuc)++].started;
}

uint64_t dmn_sched_lease_bytes(const struct dmn_config *cfg, const struct dmn_gpu *g,
			       uint64_t plan_bytes)
{
	/* A simulated GPU's job runs on the CPU backend: its plan is all it holds
	 * in the ledger. A real one's: the plan, the CUDA backend's fixed
	 * allocations (gpu/select.h) and the context allowance (contract 1). */
	if (g->fake)
		return plan_bytes;
	uint64_t extra = (uint64_t)GPU_CUDA_FIXED_BYTES + ((uint64_t)cfg->cuda_context_mib << 20);
	return plan_bytes > UINT64_MAX - extra ? UINT64_MAX : plan_bytes + extra;
}

enum place { PLACE_WAIT, PLACE_STARTED, PLACE_ENDED };

/* Tries to start q now. */
static enum place try_place(struct dmn_sched *s, const struct st_queued *q)
{
	struct td_errbuf eb = {{0}};
	Traind__JobSpec *spec = NULL;
	if (rpc_jobspec_decode(&spec, q->spec, q->spec_len, &eb) != TD_OK ||
	    rpc_jobspec_apply_defaults(spec, &eb) != TD_OK) {
		rpc_jobspec_free(spec);
		char reason[1100];
		snprintf(reason, sizeof(reason), "its stored spec cannot be read: %s", eb.msg);
		fail_job(s, q->id, reason);
		return PLACE_ENDED;
	}
	Traind__Device want = spec->resources->device;
	bool allow_cpu = want == TRAIND__DEVICE__DEVICE_CPU || spec->resources->allow_cpu;
	bool gpu_ok = want != TRAIND__DEVICE__DEVICE_CPU && s->dev->n > 0;
	if (!gpu_ok && !allow_cpu) {
		rpc_jobspec_free(spec);
		fail_job(s, q->id,
			 "resources.device: the job needs a GPU and this host has none; set "
			 "resources.allow_cpu: true (or device: DEVICE_CPU) to run it on the CPU");
		return PLACE_ENDED;
	}

	const struct dmn_gpu *gpu = NULL;
	int64_t lease = 0;
	uint64_t lease_bytes = 0;
	if (gpu_ok) {
		struct plan *p = plan_find(s, q->id);
		if (!p || p->state == 0) {
			plan_request(s, q, spec);
			rpc_jobspec_free(spec);
			return PLACE_WAIT;
		}
		if (p->state == PLAN_PENDING) {
			rpc_jobspec_free(spec);
			return PLACE_WAIT;
		}
		if (p->state == PLAN_FAILED) {
			char reason[600];
			snprintf(reason, sizeof(reason), "%s", p->err);
			rpc_jobspec_free(spec);
			fail_job(s, q->id, reason);
			return PLACE_ENDED;
		}
		for (int i = 0; i < s->dev->n && !gpu; i++) {
			const struct dmn_gpu *g = &s->dev->gpu[i];
			if (!g->fake && dmn_runners_lost(s->run, g->ordinal))
				continue; /* its context is being reset (reset_lost) */
			char label[64];
			snprintf(label, sizeof(label), "job %lld", (long long)q->id);
			uint64_t bytes = dmn_sched_lease_bytes(s->cfg, g, p->bytes);
			struct st_lease_req lr = {
				.gpu_uuid = g->uuid,
				.bytes = bytes,
				.job_id = q->id,
				.uid = q->uid,
				.pid = getpid(),
				.label = label,
			};
			struct st_device_cap cap = {
				.total_bytes = g->total_bytes,
				.factor = s->cfg->vram_factor,
				.free_bytes_now = dmn_gpu_free_bytes(g),
			};
			td_err e = st_ledger_reserve(s->db, &lr, &cap, &lease, &eb);
			if (e == TD_OK) {
				gpu = g;
				lease_bytes = bytes;
			} else if (e != TD_EBUSY)
				td_warn("TD-SCHED-LEDGER", "job %lld on %s: %s", (long long)q->id, g->uuid,
					eb.msg);
		}
	}
	bool cpu = false;
	if (!gpu) {
		if (!allow_cpu || (long)dmn_runners_count_cpu(s->run) >= s->cfg->cpu_slots) {
			rpc_jobspec_free(spec);
			return PLACE_WAIT;
		}
		cpu = true;
	}

	/* Fixes the precision for where the job goes; simulated GPUs run on
	 * the CPU backend. */
	bool real_gpu = gpu && !gpu->fake;
	if (rpc_jobspec_resolve_precision(spec, real_gpu, &eb) != TD_OK) {
		if (lease)
			st_ledger_release(s->db, lease, 0, true, NULL);
		rpc_jobspec_free(spec);
		char reason[1100];
		snprintf(reason, sizeof(reason), "%s", eb.msg);
		fail_job(s, q->id, reason);
		return PLACE_ENDED;
	}
	const char *device = cpu ? "cpu" : gpu->uuid;
	char reason[400];
	if (real_gpu)
		snprintf(reason, sizeof(reason),
			 "placed on %s (GPU %d, %s): lease %lld of %.1f MiB (plan %.1f MiB + CUDA "
			 "backend %.1f MiB + context %ld MiB)",
			 device, gpu->index, gpu->name, (long long)lease, (double)lease_bytes / (1 << 20),
			 (double)(lease_bytes - (uint64_t)GPU_CUDA_FIXED_BYTES -
				  ((uint64_t)s->cfg->cuda_context_mib << 20)) / (1 << 20),
			 (double)GPU_CUDA_FIXED_BYTES / (1 << 20), s->cfg->cuda_context_mib);
	else
		snprintf(reason, sizeof(reason), "placed on %s%s", device,
			 gpu && gpu->fake ? " (simulated)" : "");
	td_err e = st_job_transition(s->db, q->id, ST_QUEUED, ST_ADMITTED, reason, device, &eb);
	if (e != TD_OK) {
		/* Cancelled since the queue was read: nothing to do. */
		if (lease)
			st_ledger_release(s->db, lease, 0, true, NULL);
		rpc_jobspec_free(spec);
		return PLACE_ENDED;
	}
	struct dmn_run_request rr = {
		.job_id = q->id,
		.uid = q->uid,
		.gid = q->gid,
		.attempts = q->attempts,
		.spec = spec,
		.device = device,
		.on_gpu = gpu != NULL,
		.backend = real_gpu ? "cuda" : "cpu",
		.cuda_device = real_gpu ? gpu->ordinal : -1,
		.cache_dir = s->cfg->cache_dir,
	};
	if ((e = dmn_runners_start(s->run, &rr, &eb)) != TD_OK) {
		td_err_log("TD-SCHED-START", "job %lld: %s", (long long)q->id, eb.msg);
		struct td_errbuf eb2 = {{0}};
		st_job_transition(s->db, q->id, ST_ADMITTED, ST_QUEUED, "could not start a runner; queued again", NULL, &eb2);
		if (lease)
			st_ledger_release(s->db, lease, 0, true, NULL);
		rpc_jobspec_free(spec);
		return PLACE_WAIT;
	}
	td_info("TD-JOB-START", "job %lld (uid %u) admitted on %s", (long long)q->id,
		(unsigned)q->uid, device);
	return PLACE_STARTED;
}

/* Counts the queued jobs without reading their specs. */
static void count_queued(struct dmn_sched *s)
{
	struct st_job_filter f = {.all_users = true, .state_mask = ST_MASK(ST_QUEUED)};
	struct st_job *jobs = NULL;
	size_t n = 0;
	if (st_job_list(s->db, &f, &jobs, &n, NULL) == TD_OK) {
		s->queued = (uint32_t)n;
		st_jobs_free(jobs, n);
	}
}

static bool capacity(const struct dmn_sched *s)
{
	return (long)dmn_runners_count_cpu(s->run) < s->cfg->cpu_slots || s->dev->n > 0;
}

static void pass(struct dmn_sched *s, bool from_tick)
{
	if (s->stopping)
		return;
	/* Nothing could start: do not read every queued spec (a long queue on
	 * a full host would cost each submit that much). */
	if (!capacity(s)) {
		if (from_tick)
			count_queued(s);
		return;
	}
	struct td_errbuf eb = {{0}};
	struct st_queued *q = NULL;
	size_t n = 0;
	if (st_job_queue(s->db, &q, &n, &eb) != TD_OK) {
		td_warn("TD-SCHED-QUEUE", "cannot read the queue: %s", eb.msg);
		return;
	}
	s->queued = (uint32_t)n;
	enum { MAXU = 256 };
	struct user_count uc[MAXU];
	size_t nuc = 0;
	bool *done = calloc(n ? n : 1, sizeof(bool));
	if (!done) {
		st_queue_free(q, n);
		return;
	}
	for (;;) {
		if (!capacity(s))
			break; /* nothing else could start */
		/* The best candidate left, by (priority, running work, age). */
		ssize_t best = -1;
		uint64_t best_active = 0;
		for (size_t i = 0; i < n; i++) {
			if (done[i])
				continue;
			uint32_t *st = started_for(uc, &nuc, MAXU, q[i].uid);
			uint64_t active = (uint64_t)q[i].user_active + (st ? *st : 0);
			if (best < 0 || q[i].priority > q[best].priority ||
			    (q[i].priority == q[best].priority &&
			     (active < best_active ||
			      (active == best_active && (q[i].submit_ms < q[best].submit_ms ||
							 (q[i].submit_ms == q[best].submit_ms &&
							  q[i].id < q[best].id)))))) {
				best = (ssize_t)i;
				best_active = active;
			}
		}
		if (best < 0)
			break;
		done[best] = true;
		const struct st_queued *c = &q[best];
		uint32_t *st = started_for(uc, &nuc, MAXU, c->uid);
		if (s->cfg->max_running_per_user &&
		    (long)(c->user_active + (st ? *st : 0)) >= s->cfg->max_running_per_user)
			continue;
		if (try_place(s, c) == PLACE_STARTED && st)
			(*st)++;
	}
	/* user_active in the snapshot already counts jobs started before this
	 * pass; `started` counts this pass's. */
	free(done);
	st_queue_free(q, n);
}

static void kick_cb(uv_timer_t *t)
{
	struct dmn_sched *s = t->data;
	s->kicked = false;
	pass(s, false);
}

void dmn_sched_kick(struct dmn_sched *s)
{
	if (s->kicked || s->closed || s->stopping)
		return;
	s->kicked = true;
	uv_timer_start(&s->kick, kick_cb, 0, 0);
}

/* Resets the primary context of every lost CUDA ordinal (daemon/runner.h)
 * that no runner uses any more, then admits jobs there again. A failed
 * reset leaves the device out of placement; tick retries it (all=true). */
static void reset_lost(struct dmn_sched *s, bool all)
{
	int d;
	uint64_t tried = all ? 0 : s->reset_failed;
	while ((d = dmn_runners_lost_idle(s->run, tried)) >= 0) {
		uint64_t bit = (uint64_t)1 << d;
		tried |= bit;
		const char *uuid = "?";
		for (int i = 0; i < s->dev->n; i++)
			if (!s->dev->gpu[i].fake && s->dev->gpu[i].ordinal == d)
				uuid = s->dev->gpu[i].uuid;
		struct td_errbuf eb = {{0}};
		if (gpu_device_reset(d, &eb) != TD_OK) {
			if (!(s->reset_failed & bit))
				td_err_log("TD-GPU-RESET", "CUDA device %d (%s): %s; the driver keeps "
					   "this error for the process's life, so the daemon stops its "
					   "jobs and re-executes itself to recover the device",
					   d, uuid, eb.msg);
			s->reset_failed |= bit;
			continue;
		}
		s->reset_failed &= ~bit;
		dmn_runners_lost_clear(s->run, d);
		td_warn("TD-GPU-RESET", "CUDA device %d (%s): primary context reset after a sticky "
			"error; placing jobs there again", d, uuid);
		dmn_sched_kick(s);
	}
}

bool dmn_sched_restart_wanted(const struct dmn_sched *s)
{
	return s->reset_failed != 0;
}

void dmn_sched_tick(struct dmn_sched *s)
{
	reset_lost(s, true);
	struct td_errbuf eb = {{0}};
	size_t reaped = 0;
	if (st_ledger_reap(s->db, &reaped, &eb) != TD_OK)
		td_warn("TD-SCHED-REAP", "lease reaping: %s", eb.msg);
	pass(s, true);
}

/* ------------------------------------------------------------------------ */
/* Runner ends */

static void runner_done(void *ctx, int64_t job_id, enum st_job_state final, bool on_gpu)
{
	struct dmn_sched *s = ctx;
	struct td_errbuf eb = {{0}};
	struct st_job j;
	bool requeue = final == ST_QUEUED; /* daemon/runner.h: after a device loss */
	if (requeue)
		final = ST_INTERRUPTED;
	/* The runner records its end itself; if it could not (no database
	 * handle), do it here so that no job is left looking active. */
	if (st_job_get(s->db, job_id, &j, &eb) == TD_OK) {
		if (requeue && j.state == ST_INTERRUPTED) {
			if (st_job_transition(s->db, job_id, ST_INTERRUPTED, ST_QUEUED,
					      "requeued after its CUDA device lost its context; "
					      "resumes from its last checkpoint",
					      NULL, &eb) == TD_OK)
				j.state = ST_QUEUED;
			else
				td_err_log("TD-SCHED-STATE", "job %lld: cannot requeue it: %s; it is "
					   "requeued at the next start", (long long)job_id, eb.msg);
		}
		if (ST_MASK(j.state) & ST_MASK_ACTIVE) {
			if (st_job_transition(s->db, job_id, ST_ANY_STATE, final,
					      "the runner ended without recording its state", NULL, &eb) != TD_OK)
				td_err_log("TD-SCHED-STATE", "job %lld: %s", (long long)job_id, eb.msg);
			size_t nrel;
			st_ledger_release_job(s->db, job_id, &nrel, NULL);
		}
		final = j.state;
		st_job_fini(&j);
	}
	(void)on_gpu;
	if (st_job_state_terminal(final)) {
		claim_remove(s, job_id);
		plan_remove(s, job_id);
	}
	if (!s->stopping)
		reset_lost(s, false);
	dmn_sched_kick(s);
}

/* ------------------------------------------------------------------------ */

td_err dmn_sched_new(struct dmn_sched **out, const struct dmn_sched_deps *d, struct td_errbuf *eb)
{
	struct dmn_sched *s = calloc(1, sizeof(*s));
	if (!s)
		return td_fail(eb, TD_ENOMEM, "scheduler: out of memory");
	s->loop = d->loop;
	s->db = d->db;
	s->cfg = d->cfg;
	s->dev = d->dev;
	td_err e = dmn_runners_new(&s->run, d->loop, d->db_path, runner_done, s, eb);
	if (e != TD_OK) {
		free(s);
		return e;
	}
	uv_timer_init(d->loop, &s->kick);
	s->kick.data = s;

	/* Output dirs of the jobs that have not ended. */
	struct st_job_filter f = {.all_users = true, .state_mask = ~ST_MASK_TERMINAL & ((1u << ST_JOB_STATE_COUNT) - 1), .with_spec = true};
	struct st_job *jobs = NULL;
	size_t n = 0;
	if ((e = st_job_list(s->db, &f, &jobs, &n, eb)) != TD_OK) {
		dmn_sched_close(s);
		*out = s;
		return e;
	}
	for (size_t i = 0; i < n && e == TD_OK; i++) {
		Traind__JobSpec *spec = NULL;
		struct td_errbuf eb2 = {{0}};
		if (rpc_jobspec_decode(&spec, jobs[i].spec, jobs[i].spec_len, &eb2) == TD_OK &&
		    spec->output && spec->output->dir)
			e = claim_add(s, jobs[i].id, spec->output->dir, eb);
		rpc_jobspec_free(spec);
	}
	st_jobs_free(jobs, n);
	*out = s;
	return e;
}

struct dmn_runners *dmn_sched_runners(struct dmn_sched *s)
{
	return s->run;
}

void dmn_sched_job_ended(struct dmn_sched *s, int64_t job_id)
{
	claim_remove(s, job_id);
	plan_remove(s, job_id);
	dmn_sched_kick(s);
}

uint32_t dmn_sched_queued(const struct dmn_sched *s)
{
	return s->queued;
}

void dmn_sched_stop(struct dmn_sched *s)
{
	s->stopping = true;
	uv_timer_stop(&s->kick);
	s->kicked = false;
	dmn_runners_stop_all(s->run);
}

void dmn_sched_close(struct dmn_sched *s)
{
	if (!s || s->closed)
		return;
	s->closed = true;
	uv_timer_stop(&s->kick);
	uv_close((uv_handle_t *)&s->kick, NULL);
	dmn_runners_close(s->run);
}

td_err dmn_sched_free(struct dmn_sched *s)
{
	if (!s)
		return TD_OK;
	if (s->plans_in_flight)
		return TD_EBUSY;
	td_err e = dmn_runners_free(s->run);
	if (e != TD_OK)
		return e;
	for (size_t i = 0; i < s->nclaims; i++)
		free(s->claims[i].dir);
	free(s->claims);
	free(s->plans);
	free(s);
	return TD_OK;
}
