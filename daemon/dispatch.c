/* The RPC dispatch table, the shared checks, and the handlers
 * (daemon/dispatch.h).
 *
 * A handler fills c->resp with pointers into memory the call owns (its arena,
 * the rows it read) and returns TD_OK, or returns an error with the message in
 * c->eb, or returns CALL_PENDING and finishes the call later. */
#include "daemon/dispatch.h"

#include "config.h"

#include <dirent.h>
#include <math.h>
#include <nng/nng.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/preflight.h"
#include "daemon/runner.h"
#include "proto/log.h"
#include "proto/rpc.h"

#define CALL_PENDING ((td_err)1)
#define WATCH_EVENTS_DEFAULT 500
#define WATCH_METRICS_DEFAULT 2000
#define WATCH_MAX 20000

struct dmn_call {
	struct dmn_env *env;
	struct dmn_peer peer;
	bool admin;
	const char *name;
	int entry;  /* rpc_table index; -1 before the request is understood */
	Traind__Request *req;
	Traind__Response resp;
	dmn_reply_fn reply;
	void *ctx;
	struct td_errbuf eb;

	/* what the response points into */
	struct st_job job;
	bool has_job;
	struct st_job *jobs;
	size_t njobs;
	struct st_event *events;
	size_t nevents;
	struct st_metric *metrics;
	struct st_lease *leases;
	struct st_shared *shared;
	struct st_cache_entry *cache;
	size_t ncache;
	void **allocs;
	size_t nallocs, capallocs;
	Traind__JobSpec **specs;  /* decoded for the response */
	size_t nspecs;

	/* submit, across its worker */
	uv_work_t work;
	Traind__JobSpec *spec;
	struct dmn_plan_bytes plan;
	td_err werr;
	struct td_errbuf web;
	int64_t claim;
};

/* ------------------------------------------------------------------------ */
/* The call's memory */

static void *cz(struct dmn_call *c, size_t n)
{
	if (c->nallocs == c->capallocs) {
		size_t cap = c->capallocs ? 2 * c->capallocs : 16;
		void **a = realloc(c->allocs, cap * sizeof(*a));
		if (!a)
			return NULL;
		c->allocs = a;
		c->capallocs = cap;
	}
	void *p = calloc(1, n ? n : 1);
	if (p)
		c->allocs[c->nallocs++] = p;
	return p;
}

static char *cstr(struct dmn_call *c, const char *s)
{
	size_t n = strlen(s) + 1;
	char *d = cz(c, n);
	if (d)
		memcpy(d, s, n);
	return d;
}

static Traind__JobSpec *keep_spec(struct dmn_call *c, Traind__JobSpec *s)
{
	Traind__JobSpec **a = realloc(c->specs, (c->nspecs + 1) * sizeof(*a));
	if (!a) {
		rpc_jobspec_free(s);
		return NULL;
	}
	c->specs = a;
	c->specs[c->nspecs++] = s;
	return s;
}

static void call_free(struct dmn_call *c)
{
	if (c->has_job)
		st_job_fini(&c->job);
	st_jobs_free(c->jobs, c->njobs);
	st_events_free(c->events, c->nevents);
	free(c->metrics);
	free(c->leases);
	free(c->shared);
	st_cache_entries_free(c->cache, c->ncache);
	for (size_t i = 0; i < c->nallocs; i++)
		free(c->allocs[i]);
	free(c->allocs);
	for (size_t i = 0; i < c->nspecs; i++)
		rpc_jobspec_free(c->specs[i]);
	free(c->specs);
	rpc_jobspec_free(c->spec);
	rpc_request_free(c->req);
	free(c);
}

uint8_t *dmn_error_reply(td_err code, const char *msg, size_t *len)
{
	uint8_t *buf = NULL;
	if (rpc_error_encode(code, msg, &buf, len) != TD_OK)
		return NULL;
	return buf;
}

static void finish(struct dmn_call *c, td_err e)
{
	uint8_t *buf = NULL;
	size_t len = 0;
	if (e == TD_OK) {
		c->resp.has_status = true;
		c->resp.status = TD_OK;
		if (rpc_response_encode(&c->resp, &buf, &len) != TD_OK) {
			e = TD_ENOMEM;
			snprintf(c->eb.msg, sizeof(c->eb.msg), "the daemon ran out of memory answering");
		}
	}
	if (e != TD_OK) {
		if (!c->eb.msg[0])
			snprintf(c->eb.msg, sizeof(c->eb.msg), "%s", td_strerror(e));
		td_debug("TD-RPC-ERR", "uid %u %s: %s", (unsigned)c->peer.uid, c->name, c->eb.msg);
		buf = dmn_error_reply(e, c->eb.msg, &len);
	}
	int k = c->entry >= 0 && c->entry < DMN_RPC_MAX ? c->entry : DMN_RPC_MAX;
	c->env->rpc_requests[k]++;
	if (e != TD_OK)
		c->env->rpc_errors[k]++;
	c->env->pending--;
	c->reply(c->ctx, buf, len);
	call_free(c);
}

/* ------------------------------------------------------------------------ */
/* Conversions */

static double secs(int64_t ms)
{
	return (double)ms / 1000.0;
}

static Traind__JobState wire_state(enum st_job_state s)
{
	switch (s) {
	case ST_QUEUED: return TRAIND__JOB_STATE__JOB_STATE_QUEUED;
	case ST_ADMITTED: return TRAIND__JOB_STATE__JOB_STATE_ADMITTED;
	case ST_PREPARING: return TRAIND__JOB_STATE__JOB_STATE_PREPARING;
	case ST_RUNNING: return TRAIND__JOB_STATE__JOB_STATE_RUNNING;
	case ST_SUCCEEDED: return TRAIND__JOB_STATE__JOB_STATE_SUCCEEDED;
	case ST_FAILED: return TRAIND__JOB_STATE__JOB_STATE_FAILED;
	case ST_CANCELLED: return TRAIND__JOB_STATE__JOB_STATE_CANCELLED;
	case ST_INTERRUPTED: return TRAIND__JOB_STATE__JOB_STATE_INTERRUPTED;
	default: return TRAIND__JOB_STATE__JOB_STATE_UNSPECIFIED;
	}
}

#define SETF(msg, field, value)            \
	do {                               \
		(msg)->has_##field = true; \
		(msg)->field = (value);    \
	} while (0)

/* JobInfo for j. The spec is decoded for its paths (and returned whole when
 * with_spec); progress comes from the job's runner, or the last metrics row
 * when with_metrics. */
static Traind__JobInfo *job_info(struct dmn_call *c, const struct st_job *j, bool with_spec,
				 bool with_metrics)
{
	Traind__JobInfo *ji = cz(c, sizeof(*ji));
	if (!ji)
		return NULL;
	traind__job_info__init(ji);
	SETF(ji, id, (uint64_t)j->id);
	ji->name = j->name;
	SETF(ji, uid, (uint32_t)j->uid);
	SETF(ji, gid, (uint32_t)j->gid);
	SETF(ji, state, wire_state(j->state));
	ji->reason = j->reason;
	SETF(ji, priority, j->priority);
	ji->device = j->device;
	SETF(ji, submit_time, secs(j->submit_ms));
	if (j->start_ms)
		SETF(ji, start_time, secs(j->start_ms));
	if (j->end_ms)
		SETF(ji, end_time, secs(j->end_ms));
	if (*j->ckpt_path)
		ji->checkpoint = j->ckpt_path;
	SETF(ji, cancel_requested, j->cancel_requested);
	SETF(ji, attempts, (uint32_t)j->attempts);
	if (j->held)
		SETF(ji, held, true);
	/* Dependencies, and why a queued job waits (issue 14). */
	const struct st_dep *pending = NULL; /* the first dependency not SUCCEEDED */
	struct st_dep *deps = NULL;
	size_t nd = 0;
	if ((!st_job_state_terminal(j->state) || with_spec) &&
	    st_job_deps(c->env->db, j->id, &deps, &nd, NULL) == TD_OK && nd) {
		uint64_t *after = cz(c, nd * sizeof(*after));
		for (size_t i = 0; after && i < nd; i++) {
			after[i] = (uint64_t)deps[i].id;
			if (!pending && deps[i].state != ST_SUCCEEDED)
				pending = &deps[i];
		}
		if (after) {
			ji->after = after;
			ji->n_after = nd;
		}
	}
	if (j->state == ST_QUEUED) {
		/* Held and dependencies from the database (true even before a pass
		 * looked at the job); the rest from the scheduler's last pass. */
		char why[256];
		if (j->held)
			snprintf(why, sizeof(why), "held (trainctl release %lld starts it)", (long long)j->id);
		else if (pending)
			snprintf(why, sizeof(why), "waits for job %lld (%s) to succeed (submit --after)",
				 (long long)pending->id, st_job_state_name(pending->state));
		else
			dmn_sched_waiting(c->env->sched, j->id, why, sizeof(why));
		/* A preempted job says so first (its reason: "preempted by job N
		 * (user U, priority P) at step ..."), then what it waits for. */
		const char *at = strchr(j->reason, ')');
		if (strncmp(j->reason, "preempted by job ", 17) == 0 && at) {
			char both[512];
			snprintf(both, sizeof(both), "%.*s; %s", (int)(at + 1 - j->reason), j->reason, why);
			ji->waiting = cstr(c, both);
		} else {
			ji->waiting = cstr(c, why);
		}
	}
	free(deps);
	if (j->spec) {
		Traind__JobSpec *spec = NULL;
		if (rpc_jobspec_decode(&spec, j->spec, j->spec_len, NULL) == TD_OK &&
		    (spec = keep_spec(c, spec))) {
			SETF(ji, method, spec->method ? spec->method : TRAIND__METHOD__METHOD_FULL);
			ji->model_dir = spec->model_dir;
			ji->output_dir = spec->output ? spec->output->dir : NULL;
			if (spec->hyper && spec->hyper->has_max_steps && spec->hyper->max_steps)
				SETF(ji, total_steps, spec->hyper->max_steps);
			if (with_spec)
				ji->spec = spec;
		}
	}
	struct tr_progress p;
	if (dmn_runners_progress(dmn_sched_runners(c->env->sched), j->id, &p)) {
		SETF(ji, step, p.step);
		SETF(ji, total_steps, p.total_steps);
		SETF(ji, loss, p.loss);
		SETF(ji, lr, p.lr);
		SETF(ji, tokens_per_s, p.tokens_per_s);
		SETF(ji, eta_s, p.eta_s);
	} else if (with_metrics) {
		struct st_metric m;
		if (st_metrics_last(c->env->db, j->id, &m, NULL) == TD_OK) {
			SETF(ji, step, (uint64_t)m.step);
			if (!isnan(m.loss))
				SETF(ji, loss, m.loss);
			if (!isnan(m.lr))
				SETF(ji, lr, m.lr);
			if (!isnan(m.tokens_per_s))
				SETF(ji, tokens_per_s, m.tokens_per_s);
		}
	}
	return ji;
}

static td_err set_job_result(struct dmn_call *c, const struct st_job *j, bool with_spec)
{
	Traind__JobInfo *ji = job_info(c, j, with_spec, true);
	if (!ji)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	c->resp.result_case = TRAIND__RESPONSE__RESULT_JOB;
	c->resp.job = ji;
	return TD_OK;
}

static void fill_lease(Traind__Lease *l, const struct st_lease *s)
{
	traind__lease__init(l);
	SETF(l, id, (uint64_t)s->id);
	l->gpu = (char *)s->gpu_uuid;
	SETF(l, bytes, s->bytes);
	SETF(l, job_id, (uint64_t)s->job_id);
	SETF(l, uid, (uint32_t)s->uid);
	SETF(l, pid, (int32_t)s->holder.pid);
	SETF(l, since, secs(s->created_ms));
	SETF(l, expires, secs(s->expires_ms));
	l->note = (char *)s->label;
}

static td_err fill_devices(struct dmn_call *c, Traind__GpuDevice ***out, size_t *n)
{
	const struct dmn_devices *d = c->env->dev;
	*n = 0;
	if (!d->n)
		return TD_OK;
	Traind__GpuDevice **arr = cz(c, (size_t)d->n * sizeof(*arr));
	Traind__GpuDevice *gd = cz(c, (size_t)d->n * sizeof(*gd));
	if (!arr || !gd)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	for (int i = 0; i < d->n; i++) {
		const struct dmn_gpu *g = &d->gpu[i];
		traind__gpu_device__init(&gd[i]);
		SETF(&gd[i], index, g->index);
		gd[i].uuid = (char *)g->uuid;
		gd[i].name = (char *)g->name;
		SETF(&gd[i], total_bytes, g->total_bytes);
		uint64_t fr = dmn_gpu_free_bytes(g);
		if (fr != UINT64_MAX)
			SETF(&gd[i], free_bytes, fr);
		uint64_t res = 0;
		if (st_ledger_reserved(c->env->db, g->uuid, &res, NULL) == TD_OK)
			SETF(&gd[i], reserved_bytes, res);
		uint32_t links = d->nvlink[i];
		if (links) {
			int32_t *peers = cz(c, (size_t)__builtin_popcount(links) * sizeof(*peers));
			if (!peers)
				return td_fail(&c->eb, TD_ENOMEM, "out of memory");
			for (int j = 0; j < d->n; j++)
				if (links >> j & 1)
					peers[gd[i].n_nvlink++] = j;
			gd[i].nvlink = peers;
		}
		arr[i] = &gd[i];
	}
	*out = arr;
	*n = (size_t)d->n;
	return TD_OK;
}

static Traind__Usage *usage_msg(struct dmn_call *c, const struct st_usage *u)
{
	Traind__Usage *m = cz(c, sizeof(*m));
	if (!m)
		return NULL;
	traind__usage__init(m);
	SETF(m, queued_s, secs(u->queued_ms));
	SETF(m, running_s, secs(u->run_ms));
	SETF(m, gpu_s, secs(u->gpu_ms));
	SETF(m, cpu_s, secs(u->cpu_ms));
	SETF(m, gpu_mem_byte_s, u->gpu_mem_bs);
	SETF(m, tokens, (uint64_t)(u->tokens > 0 ? u->tokens : 0));
	SETF(m, jobs, u->jobs);
	return m;
}

/* "the admin group 'traind-admin'" or "nobody else (admin_group is empty)". */
static const char *admins(const struct dmn_call *c, char *buf, size_t cap)
{
	const char *g = c->env->cfg->admin_group;
	snprintf(buf, cap, "root and the admin group%s%s%s", *g ? " '" : "", g, *g ? "'" : "");
	return buf;
}

/* The highest priority the caller may give a job. */
static int32_t priority_max(const struct dmn_call *c)
{
	return c->admin ? 100 : (int32_t)c->env->cfg->user_priority_max;
}

/* ------------------------------------------------------------------------ */
/* Handlers */

static void submit_work(uv_work_t *req)
{
	struct dmn_call *c = req->data;
	struct dmn_fscreds creds;
	c->werr = dmn_fscreds_of(&creds, c->peer.uid, c->peer.gid, &c->web);
	if (c->werr == TD_OK)
		c->werr = dmn_preflight(c->spec, &creds, &c->plan, &c->web);
}

static void submit_done(uv_work_t *req, int status)
{
	struct dmn_call *c = req->data;
	struct dmn_env *env = c->env;
	td_err e = c->werr;
	if (status != 0)
		e = td_fail(&c->eb, TD_EINTERNAL, "submit: the check was cancelled (%s)",
			    uv_strerror(status));
	else if (e != TD_OK)
		memcpy(c->eb.msg, c->web.msg, sizeof(c->eb.msg));
	else if (env->stopping)
		e = td_fail(&c->eb, TD_EBUSY, "traind is shutting down; submit again when it is back");
	int64_t id = 0;
	if (e == TD_OK) {
		uint8_t *bytes = NULL;
		size_t len = 0;
		if ((e = rpc_jobspec_encode(c->spec, &bytes, &len)) != TD_OK) {
			td_fail(&c->eb, e, "submit: cannot encode the spec");
		} else {
			struct st_job_new nj = {
				.name = c->spec->name,
				.uid = c->peer.uid,
				.gid = c->peer.gid,
				.priority = c->spec->resources->priority,
				.spec = bytes,
				.spec_len = len,
				.max_queued_per_user = (uint32_t)env->cfg->max_queued_per_user,
				.after = (const int64_t *)c->req->submit->after,
				.nafter = c->req->submit->n_after,
				.held = c->req->submit->has_hold && c->req->submit->hold,
			};
			e = st_job_submit(env->db, &nj, &id, &c->eb);
			free(bytes);
		}
	}
	if (e != TD_OK) {
		dmn_sched_claim_drop(env->sched, c->claim);
		finish(c, e);
		return;
	}
	dmn_sched_claim_bind(env->sched, c->claim, id);
	dmn_sched_set_plan(env->sched, id, &c->plan);
	char sharded[480] = ""; /* memory.shard AUTO: the plans of each sharding */
	for (int sk = TR_SHARD_OPTIMIZER, len = 0; c->plan.auto_shard && sk < TR_SHARD_BUILT &&
						   len < (int)sizeof(sharded); sk++) {
		if (c->plan.auto_policy)
			len += snprintf(sharded + len, sizeof(sharded) - (size_t)len,
					"; with memory.shard %s %llu bytes with recompute none, %llu selective, "
					"%llu full",
					tr_shard_name((enum tr_shard)sk),
					(unsigned long long)c->plan.shard_by_policy[sk][TR_RECOMPUTE_NONE],
					(unsigned long long)c->plan.shard_by_policy[sk][TR_RECOMPUTE_SELECTIVE],
					(unsigned long long)c->plan.shard_by_policy[sk][TR_RECOMPUTE_FULL]);
		else
			len += snprintf(sharded + len, sizeof(sharded) - (size_t)len,
					"; with memory.shard %s %llu bytes", tr_shard_name((enum tr_shard)sk),
					(unsigned long long)c->plan.shard_bytes[sk]);
		if (sk == TR_SHARD_BUILT - 1 && len < (int)sizeof(sharded))
			len += snprintf(sharded + len, sizeof(sharded) - (size_t)len, " (memory.shard AUTO)");
	}
	if (c->plan.auto_policy)
		st_event_addf(env->db, id, "info", NULL,
			      "plan: %llu bytes with recompute none, %llu selective, %llu full, "
			      "%llu full-offload (and %llu pinned on the host) "
			      "(memory.recompute AUTO: the fastest that fits where the job is "
			      "placed)%s; %s job on %s",
			      (unsigned long long)c->plan.by_policy[TR_RECOMPUTE_NONE],
			      (unsigned long long)c->plan.by_policy[TR_RECOMPUTE_SELECTIVE],
			      (unsigned long long)c->plan.by_policy[TR_RECOMPUTE_FULL],
			      (unsigned long long)c->plan.by_policy[TR_RECOMPUTE_FULL_OFFLOAD],
			      (unsigned long long)c->plan.host_by_policy[TR_RECOMPUTE_FULL_OFFLOAD], sharded,
			      rpc_method_name(c->spec->method), c->spec->model_dir);
	else
		st_event_addf(env->db, id, "info", NULL, "plan: %llu bytes%s; %s job on %s",
			      (unsigned long long)c->plan.bytes, sharded, rpc_method_name(c->spec->method),
			      c->spec->model_dir);
	td_info("TD-JOB-SUBMIT", "job %lld submitted by uid %u: %s", (long long)id,
		(unsigned)c->peer.uid, c->spec->name);
	dmn_sched_kick(env->sched);
	if ((e = st_job_get(env->db, id, &c->job, &c->eb)) == TD_OK) {
		c->has_job = true;
		e = set_job_result(c, &c->job, false);
	}
	finish(c, e);
}

static td_err h_submit(struct dmn_call *c)
{
	td_err e = rpc_jobspec_copy(&c->spec, c->req->submit->spec);
	if (e != TD_OK)
		return td_fail(&c->eb, e, "submit: out of memory");
	if ((e = rpc_jobspec_apply_defaults(c->spec, &c->eb)) != TD_OK ||
	    (e = rpc_jobspec_validate(c->spec, &c->eb)) != TD_OK ||
	    (e = dmn_devices_check_gpus(c->env->dev, c->spec->resources->gpus, &c->eb)) != TD_OK ||
	    (e = dmn_spec_check_paths(c->spec, &c->eb)) != TD_OK)
		return e;
	if (c->spec->resources->n_hosts && !c->env->cfg->peer_listen[0])
		return td_fail(&c->eb, TD_EINVAL,
			       "resources.hosts: this daemon takes no part in jobs across daemons "
			       "(it has no peer_listen setting)");
	if (c->spec->resources->priority > priority_max(c)) {
		char who[128];
		return td_fail(&c->eb, TD_EPERM,
			       "resources.priority: %d is above %d, the highest a user may give "
			       "(user_priority_max); %s may give more",
			       c->spec->resources->priority, priority_max(c), admins(c, who, sizeof(who)));
	}
	/* submit --after: jobs that exist and that the caller may see (state/
	 * checks again in the transaction that they can still succeed). */
	const Traind__SubmitRequest *sr = c->req->submit;
	if (sr->n_after > ST_DEPS_MAX)
		return td_fail(&c->eb, TD_EINVAL, "submit --after: %zu jobs, more than the %d allowed",
			       sr->n_after, ST_DEPS_MAX);
	for (size_t i = 0; i < sr->n_after; i++) {
		struct st_job d;
		if (sr->after[i] == 0 || sr->after[i] > INT64_MAX)
			return td_fail(&c->eb, TD_EINVAL, "submit --after: %llu is not a job id",
				       (unsigned long long)sr->after[i]);
		if ((e = st_job_get(c->env->db, (int64_t)sr->after[i], &d, &c->eb)) != TD_OK)
			return e == TD_ENOENT ? td_fail(&c->eb, TD_ENOENT,
							"submit --after: job %llu does not exist",
							(unsigned long long)sr->after[i])
					      : e;
		bool mine = d.uid == c->peer.uid;
		st_job_fini(&d);
		if (!mine && !c->admin)
			return td_fail(&c->eb, TD_EPERM,
				       "submit --after: job %llu belongs to another user; a job may wait "
				       "only on its owner's jobs (or, submitted by an admin, on any)",
				       (unsigned long long)sr->after[i]);
	}
	if ((e = dmn_sched_claim_output(c->env->sched, c->spec->output->dir, &c->claim, &c->eb)) != TD_OK)
		return e;
	c->work.data = c;
	int rv = uv_queue_work(c->env->loop, &c->work, submit_work, submit_done);
	if (rv != 0) {
		dmn_sched_claim_drop(c->env->sched, c->claim);
		return td_fail(&c->eb, TD_EINTERNAL, "submit: cannot queue the check: %s", uv_strerror(rv));
	}
	return CALL_PENDING;
}

static td_err h_list(struct dmn_call *c)
{
	const Traind__ListRequest *lr = c->req->list;
	bool all = lr && lr->has_all && lr->all;
	if (all && !c->admin)
		return td_fail(&c->eb, TD_EPERM,
			       "ls --all: only root and members of the admin group%s%s%s may list every "
			       "user's jobs; `trainctl ls` lists yours",
			       *c->env->cfg->admin_group ? " '" : "", c->env->cfg->admin_group,
			       *c->env->cfg->admin_group ? "'" : "");
	struct st_job_filter f = {
		.all_users = all,
		.uid = c->peer.uid,
		.limit = lr && lr->has_limit && lr->limit ? lr->limit : (size_t)c->env->cfg->list_limit,
		.with_spec = true,
	};
	td_err e = st_job_list(c->env->db, &f, &c->jobs, &c->njobs, &c->eb);
	if (e != TD_OK)
		return e;
	Traind__JobList *jl = cz(c, sizeof(*jl));
	Traind__JobInfo **arr = cz(c, (c->njobs ? c->njobs : 1) * sizeof(*arr));
	if (!jl || !arr)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	traind__job_list__init(jl);
	for (size_t i = 0; i < c->njobs; i++) {
		/* Newest first. */
		if (!(arr[i] = job_info(c, &c->jobs[c->njobs - 1 - i], false, true)))
			return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	}
	jl->jobs = arr;
	jl->n_jobs = c->njobs;
	c->resp.result_case = TRAIND__RESPONSE__RESULT_LIST;
	c->resp.list = jl;
	return TD_OK;
}

static td_err h_show(struct dmn_call *c)
{
	td_err e = set_job_result(c, &c->job, true);
	if (e != TD_OK)
		return e;
	/* Every lease the job holds: one per GPU, a gang's all. */
	size_t n = 0;
	if ((e = st_ledger_list_job(c->env->db, c->job.id, &c->leases, &n, &c->eb)) != TD_OK)
		return e;
	Traind__Lease **arr = cz(c, (n + 1) * sizeof(*arr));
	Traind__Lease *ls = cz(c, (n + 1) * sizeof(*ls));
	if (!arr || !ls)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++) {
		fill_lease(&ls[i], &c->leases[i]);
		arr[i] = &ls[i];
	}
	c->resp.job->leases = arr;
	c->resp.job->n_leases = n;
	struct st_usage u;
	if (st_usage_of_job(c->env->db, c->job.id, &u, NULL) == TD_OK)
		c->resp.job->usage = usage_msg(c, &u);
	return TD_OK;
}

static td_err h_cancel(struct dmn_call *c)
{
	char reason[96];
	snprintf(reason, sizeof(reason), "cancelled by uid %u", (unsigned)c->peer.uid);
	enum st_job_state st;
	td_err e = st_job_cancel(c->env->db, c->job.id, reason, &st, &c->eb);
	if (e != TD_OK)
		return e;
	if (ST_MASK(st) & ST_MASK_ACTIVE)
		dmn_runners_cancel(dmn_sched_runners(c->env->sched), c->job.id);
	else if (st_job_state_terminal(st))
		dmn_sched_job_ended(c->env->sched, c->job.id);
	td_info("TD-JOB-CANCEL", "job %lld: cancel by uid %u (%s)", (long long)c->job.id,
		(unsigned)c->peer.uid, st_job_state_name(st));
	st_job_fini(&c->job);
	c->has_job = false;
	if ((e = st_job_get(c->env->db, c->req->cancel->id, &c->job, &c->eb)) != TD_OK)
		return e;
	c->has_job = true;
	return set_job_result(c, &c->job, false);
}

/* Re-reads the job after a change and answers with it. */
static td_err job_reply(struct dmn_call *c)
{
	int64_t id = c->job.id;
	st_job_fini(&c->job);
	c->has_job = false;
	td_err e = st_job_get(c->env->db, id, &c->job, &c->eb);
	if (e != TD_OK)
		return e;
	c->has_job = true;
	return set_job_result(c, &c->job, false);
}

static td_err h_hold(struct dmn_call *c)
{
	bool hold = !(c->req->hold->has_release && c->req->hold->release);
	char who[64];
	snprintf(who, sizeof(who), "uid %u", (unsigned)c->peer.uid);
	bool changed = false;
	td_err e = st_job_hold(c->env->db, c->job.id, hold, who, &changed, &c->eb);
	if (e != TD_OK)
		return e;
	if (changed)
		td_info("TD-JOB-HOLD", "job %lld %s by uid %u", (long long)c->job.id,
			hold ? "held" : "released", (unsigned)c->peer.uid);
	dmn_sched_kick(c->env->sched);
	return job_reply(c);
}

static td_err h_requeue(struct dmn_call *c)
{
	/* Its output dir is claimed again, as at submit: no live job may be
	 * writing there. */
	Traind__JobSpec *spec = NULL;
	struct td_errbuf deb = {{0}};
	td_err e = rpc_jobspec_decode(&spec, c->job.spec, c->job.spec_len, &deb);
	if (e != TD_OK)
		return td_fail(&c->eb, e, "requeue: job %lld's stored spec cannot be read: %s",
			       (long long)c->job.id, deb.msg);
	if (!spec->output || !spec->output->dir) {
		rpc_jobspec_free(spec);
		return td_fail(&c->eb, TD_EFORMAT, "requeue: job %lld's stored spec has no output.dir",
			       (long long)c->job.id);
	}
	int64_t claim = 0;
	bool claimed = false;
	if (st_job_state_terminal(c->job.state)) {
		e = dmn_sched_claim_output(c->env->sched, spec->output->dir, &claim, &c->eb);
		claimed = e == TD_OK;
	}
	rpc_jobspec_free(spec);
	if (e != TD_OK)
		return e;
	char reason[96];
	snprintf(reason, sizeof(reason), "requeued by uid %u", (unsigned)c->peer.uid);
	if ((e = st_job_requeue(c->env->db, c->job.id, reason, &c->eb)) != TD_OK) {
		if (claimed)
			dmn_sched_claim_drop(c->env->sched, claim);
		return e;
	}
	if (claimed)
		dmn_sched_claim_bind(c->env->sched, claim, c->job.id);
	td_info("TD-JOB-REQUEUE", "job %lld requeued by uid %u (was %s)", (long long)c->job.id,
		(unsigned)c->peer.uid, st_job_state_name(c->job.state));
	dmn_sched_kick(c->env->sched);
	return job_reply(c);
}

static td_err h_priority(struct dmn_call *c)
{
	int32_t p = c->req->priority->priority;
	if (p < -100 || p > 100)
		return td_fail(&c->eb, TD_EINVAL, "priority: %d is out of range -100 .. 100", (int)p);
	if (p > priority_max(c)) {
		char who[128];
		return td_fail(&c->eb, TD_EPERM,
			       "priority: %d is above %d, the highest a user may give "
			       "(user_priority_max); %s may give more",
			       (int)p, priority_max(c), admins(c, who, sizeof(who)));
	}
	/* The spec says the priority too (show prints it): changed with the
	 * column, in one transaction. */
	Traind__JobSpec *spec = NULL;
	uint8_t *bytes = NULL;
	size_t len = 0;
	td_err e = rpc_jobspec_decode(&spec, c->job.spec, c->job.spec_len, &c->eb);
	if (e == TD_OK && !spec->resources) {
		spec->resources = malloc(sizeof(*spec->resources));
		if (spec->resources)
			traind__resources__init(spec->resources);
		else
			e = td_fail(&c->eb, TD_ENOMEM, "out of memory");
	}
	if (e == TD_OK) {
		spec->resources->has_priority = true;
		spec->resources->priority = p;
		if ((e = rpc_jobspec_encode(spec, &bytes, &len)) != TD_OK)
			td_fail(&c->eb, e, "priority: cannot encode the spec");
	}
	rpc_jobspec_free(spec);
	if (e != TD_OK)
		return e;
	char who[64];
	snprintf(who, sizeof(who), "uid %u", (unsigned)c->peer.uid);
	e = st_job_set_priority(c->env->db, c->job.id, p, bytes, len, who, &c->eb);
	free(bytes);
	if (e != TD_OK)
		return e;
	td_info("TD-JOB-PRIORITY", "job %lld: priority %d -> %d by uid %u", (long long)c->job.id,
		(int)c->job.priority, (int)p, (unsigned)c->peer.uid);
	dmn_sched_kick(c->env->sched);
	return job_reply(c);
}

static td_err h_usage(struct dmn_call *c)
{
	const Traind__UsageRequest *ur = c->req->usage;
	bool all = ur && ur->has_all && ur->all;
	uid_t uid = ur && ur->has_uid ? (uid_t)ur->uid : c->peer.uid;
	if ((all || uid != c->peer.uid) && !c->admin) {
		char who[128];
		return td_fail(&c->eb, TD_EPERM,
			       "usage --%s: only %s may see other users' usage; `trainctl usage` shows "
			       "yours",
			       all ? "all" : "user", admins(c, who, sizeof(who)));
	}
	int64_t since_ms = ur && ur->has_since ? (int64_t)(ur->since * 1000.0) : 0;
	int64_t window_ms = c->env->cfg->usage_window_hours * 3600000L;
	struct st_usage_row *rows = NULL, *win = NULL, *jobs = NULL;
	size_t n = 0, nw = 0, nj = 0;
	td_err e = st_usage_list(c->env->db, since_ms, false, all, uid, &rows, &n, &c->eb);
	if (e == TD_OK)
		e = st_usage_list(c->env->db, st_now_ms() - window_ms, false, all, uid, &win, &nw, &c->eb);
	if (e == TD_OK && ur && ur->has_by_job && ur->by_job)
		e = st_usage_list(c->env->db, since_ms, true, all, uid, &jobs, &nj, &c->eb);
	Traind__UsageReply *r = cz(c, sizeof(*r));
	Traind__UserUsage **uu = cz(c, (n + 1) * sizeof(*uu));
	Traind__JobUsage **ju = cz(c, (nj + 1) * sizeof(*ju));
	if (e == TD_OK && (!r || !uu || !ju))
		e = td_fail(&c->eb, TD_ENOMEM, "out of memory");
	for (size_t i = 0; e == TD_OK && i < n; i++) {
		Traind__UserUsage *x = cz(c, sizeof(*x));
		if (!x || !(uu[i] = x)) {
			e = td_fail(&c->eb, TD_ENOMEM, "out of memory");
			break;
		}
		traind__user_usage__init(x);
		SETF(x, uid, (uint32_t)rows[i].uid);
		x->usage = usage_msg(c, &rows[i].u);
		struct st_usage zero = {0};
		x->window = usage_msg(c, &zero);
		for (size_t k = 0; k < nw; k++)
			if (win[k].uid == rows[i].uid)
				x->window = usage_msg(c, &win[k].u);
	}
	size_t nju = 0;
	for (size_t i = 0; e == TD_OK && i < nj; i++) {
		Traind__JobUsage *x = cz(c, sizeof(*x));
		if (!x) {
			e = td_fail(&c->eb, TD_ENOMEM, "out of memory");
			break;
		}
		traind__job_usage__init(x);
		SETF(x, id, (uint64_t)jobs[i].job);
		SETF(x, uid, (uint32_t)jobs[i].uid);
		struct st_job j;
		if (st_job_get(c->env->db, jobs[i].job, &j, NULL) == TD_OK) {
			x->name = cstr(c, j.name);
			SETF(x, state, wire_state(j.state));
			st_job_fini(&j);
		}
		x->usage = usage_msg(c, &jobs[i].u);
		ju[nju++] = x;
	}
	free(rows);
	free(win);
	free(jobs);
	if (e != TD_OK)
		return e;
	traind__usage_reply__init(r);
	SETF(r, since, since_ms > 0 ? secs(since_ms - since_ms % 3600000) : 0);
	r->users = uu;
	r->n_users = n;
	r->jobs = ju;
	r->n_jobs = nju;
	SETF(r, window_s, secs(window_ms));
	SETF(r, quota_gpu_s, c->env->cfg->quota_gpu_hours * 3600.0);
	c->resp.result_case = TRAIND__RESPONSE__RESULT_USAGE;
	c->resp.usage = r;
	return TD_OK;
}

static td_err h_watch(struct dmn_call *c)
{
	const Traind__WatchRequest *w = c->req->watch;
	size_t max_ev = w->has_max_events && w->max_events ? w->max_events : WATCH_EVENTS_DEFAULT;
	size_t max_m = w->has_max_metrics && w->max_metrics ? w->max_metrics : WATCH_METRICS_DEFAULT;
	if (max_ev > WATCH_MAX)
		max_ev = WATCH_MAX;
	if (max_m > WATCH_MAX)
		max_m = WATCH_MAX;
	int64_t after_ev = w->has_after_event && w->after_event <= INT64_MAX ? (int64_t)w->after_event : 0;
	int64_t after_step = w->has_after_step && w->after_step <= INT64_MAX ? (int64_t)w->after_step : 0;
	size_t nm = 0;
	td_err e = st_event_list(c->env->db, c->job.id, after_ev, max_ev, &c->events, &c->nevents, &c->eb);
	if (e == TD_OK)
		e = st_metrics_list(c->env->db, c->job.id, after_step, max_m, &c->metrics, &nm, &c->eb);
	if (e != TD_OK)
		return e;
	Traind__WatchReply *wr = cz(c, sizeof(*wr));
	Traind__JobEvent **ev = cz(c, (c->nevents + 1) * sizeof(*ev));
	Traind__JobEvent *evs = cz(c, (c->nevents + 1) * sizeof(*evs));
	Traind__JobMetric **mt = cz(c, (nm + 1) * sizeof(*mt));
	Traind__JobMetric *mts = cz(c, (nm + 1) * sizeof(*mts));
	if (!wr || !ev || !evs || !mt || !mts)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	traind__watch_reply__init(wr);
	if (!(wr->job = job_info(c, &c->job, false, true)))
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	for (size_t i = 0; i < c->nevents; i++) {
		traind__job_event__init(&evs[i]);
		SETF(&evs[i], seq, (uint64_t)c->events[i].id);
		SETF(&evs[i], time, secs(c->events[i].time_ms));
		evs[i].kind = c->events[i].kind;
		evs[i].message = c->events[i].message;
		ev[i] = &evs[i];
	}
	for (size_t i = 0; i < nm; i++) {
		const struct st_metric *m = &c->metrics[i];
		traind__job_metric__init(&mts[i]);
		SETF(&mts[i], step, (uint64_t)m->step);
		SETF(&mts[i], time, secs(m->time_ms));
		if (!isnan(m->loss))
			SETF(&mts[i], loss, m->loss);
		if (!isnan(m->lr))
			SETF(&mts[i], lr, m->lr);
		if (!isnan(m->grad_norm))
			SETF(&mts[i], grad_norm, m->grad_norm);
		if (!isnan(m->tokens_per_s))
			SETF(&mts[i], tokens_per_s, m->tokens_per_s);
		if (!isnan(m->eval_loss))
			SETF(&mts[i], eval_loss, m->eval_loss);
		mt[i] = &mts[i];
	}
	wr->events = ev;
	wr->n_events = c->nevents;
	wr->metrics = mt;
	wr->n_metrics = nm;
	SETF(wr, more, c->nevents == max_ev || nm == max_m);
	c->resp.result_case = TRAIND__RESPONSE__RESULT_WATCH;
	c->resp.watch = wr;
	return TD_OK;
}

static td_err ledger_reply(struct dmn_call *c, Traind__LedgerReply **out)
{
	Traind__LedgerReply *lr = cz(c, sizeof(*lr));
	if (!lr)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	traind__ledger_reply__init(lr);
	td_err e = fill_devices(c, &lr->devices, &lr->n_devices);
	if (e != TD_OK)
		return e;
	c->resp.result_case = TRAIND__RESPONSE__RESULT_LEDGER;
	c->resp.ledger = lr;
	*out = lr;
	return TD_OK;
}

static td_err h_ledger_list(struct dmn_call *c)
{
	st_ledger_reap(c->env->db, NULL, NULL);
	size_t n = 0;
	td_err e = st_ledger_list(c->env->db, NULL, &c->leases, &n, &c->eb);
	if (e != TD_OK)
		return e;
	Traind__LedgerReply *lr = NULL;
	if ((e = ledger_reply(c, &lr)) != TD_OK)
		return e;
	Traind__Lease **arr = cz(c, (n + 1) * sizeof(*arr));
	Traind__Lease *ls = cz(c, (n + 1) * sizeof(*ls));
	if (!arr || !ls)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	for (size_t i = 0; i < n; i++) {
		fill_lease(&ls[i], &c->leases[i]);
		arr[i] = &ls[i];
	}
	lr->leases = arr;
	lr->n_leases = n;
	/* The shared blocks, each with its holders. */
	size_t ns = 0;
	if ((e = st_ledger_list_shared(c->env->db, NULL, &c->shared, &ns, &c->eb)) != TD_OK)
		return e;
	Traind__SharedBlock **sa = cz(c, (ns + 1) * sizeof(*sa));
	Traind__SharedBlock *sb = cz(c, (ns + 1) * sizeof(*sb));
	if (!sa || !sb)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	for (size_t i = 0; i < ns; i++) {
		const struct st_shared *s = &c->shared[i];
		Traind__SharedBlock *b = &sb[i];
		traind__shared_block__init(b);
		SETF(b, id, (uint64_t)s->id);
		b->gpu = (char *)s->gpu_uuid;
		SETF(b, bytes, s->bytes);
		b->key = (char *)s->key;
		b->note = (char *)s->label;
		SETF(b, since, secs(s->created_ms));
		size_t nh = s->nholders < ST_SHARED_HOLDERS_MAX ? s->nholders : ST_SHARED_HOLDERS_MAX;
		uint64_t *ids = cz(c, (nh + 1) * sizeof(*ids));
		uint64_t *jobs = cz(c, (nh + 1) * sizeof(*jobs));
		uint32_t *uids = cz(c, (nh + 1) * sizeof(*uids));
		if (!ids || !jobs || !uids)
			return td_fail(&c->eb, TD_ENOMEM, "out of memory");
		for (size_t k = 0; k < nh; k++) {
			ids[k] = (uint64_t)s->holders[k].lease;
			jobs[k] = (uint64_t)s->holders[k].job;
			uids[k] = (uint32_t)s->holders[k].uid;
		}
		b->lease_ids = ids;
		b->n_lease_ids = nh;
		b->job_ids = jobs;
		b->n_job_ids = nh;
		b->uids = uids;
		b->n_uids = nh;
		sa[i] = b;
	}
	lr->shared = sa;
	lr->n_shared = ns;
	return TD_OK;
}

static td_err h_ledger_reserve(struct dmn_call *c)
{
	const Traind__LedgerReserve *r = c->req->ledger->reserve;
	const struct dmn_gpu *g = dmn_devices_find(c->env->dev, r->gpu);
	if (!g)
		return td_fail(&c->eb, TD_ENOENT, "ledger reserve: no GPU '%s' on this host%s", r->gpu,
			       c->env->dev->n ? " (`trainctl info` lists them)" : " (it has none)");
	pid_t pid = r->has_pid && r->pid > 0 ? r->pid : c->peer.pid;
	if (pid <= 0)
		return td_fail(&c->eb, TD_EINVAL,
			       "ledger reserve: no holder pid (give --pid PID of the process that "
			       "uses the memory)");
	if (!c->admin && !dmn_pid_owned_by(pid, c->peer.uid))
		return td_fail(&c->eb, TD_EPERM,
			       "ledger reserve: pid %d is not one of your processes; the holder must "
			       "be the process that uses the memory",
			       (int)pid);
	char label[128];
	snprintf(label, sizeof(label), "%s", r->note && *r->note ? r->note : "trainctl ledger");
	struct st_lease_req lr = {
		.gpu_uuid = g->uuid,
		.bytes = r->bytes,
		.uid = c->peer.uid,
		.pid = pid,
		.label = label,
		.ttl_ms = r->has_ttl_s ? (int64_t)r->ttl_s * 1000 : 0,
	};
	struct st_device_cap cap = {
		.total_bytes = g->total_bytes,
		.factor = c->env->cfg->vram_factor,
		.free_bytes_now = dmn_gpu_free_bytes(g),
	};
	int64_t id = 0;
	td_err e = st_ledger_reserve(c->env->db, &lr, &cap, &id, &c->eb);
	if (e != TD_OK)
		return e;
	td_info("TD-LEDGER-RESERVE", "lease %lld: %llu bytes on %s for uid %u pid %d", (long long)id,
		(unsigned long long)r->bytes, g->uuid, (unsigned)c->peer.uid, (int)pid);
	size_t n = 0;
	if ((e = st_ledger_list(c->env->db, g->uuid, &c->leases, &n, &c->eb)) != TD_OK)
		return e;
	Traind__LedgerReply *rep = NULL;
	if ((e = ledger_reply(c, &rep)) != TD_OK)
		return e;
	for (size_t i = 0; i < n; i++) {
		if (c->leases[i].id == id) {
			Traind__Lease *l = cz(c, sizeof(*l));
			if (!l)
				return td_fail(&c->eb, TD_ENOMEM, "out of memory");
			fill_lease(l, &c->leases[i]);
			rep->lease = l;
		}
	}
	return TD_OK;
}

static td_err h_ledger_release(struct dmn_call *c)
{
	int64_t id = (int64_t)c->req->ledger->release->lease_id;
	td_err e = st_ledger_release(c->env->db, id, c->peer.uid, c->admin, &c->eb);
	if (e != TD_OK)
		return e;
	td_info("TD-LEDGER-RELEASE", "lease %lld released by uid %u", (long long)id,
		(unsigned)c->peer.uid);
	Traind__LedgerReply *rep = NULL;
	return ledger_reply(c, &rep);
}

/* --- the module cache --- */

/* <cache_dir>/modules, where the CUDA backend keeps its cubins; "" without a
 * cache dir. */
static void modules_dir(const struct dmn_call *c, char *buf, size_t cap)
{
	const char *d = c->env->cfg->cache_dir;
	snprintf(buf, cap, "%s%s", d && *d ? d : "", d && *d ? "/modules" : "");
}

/* The reply with the index's entries (list) or only their totals (stats). */
static td_err h_cache_list(struct dmn_call *c)
{
	td_err e = st_cache_list(c->env->db, &c->cache, &c->ncache, &c->eb);
	if (e != TD_OK)
		return e;
	Traind__CacheReply *cr = cz(c, sizeof(*cr));
	bool list = c->req->cache->op_case == TRAIND__CACHE_REQUEST__OP_LIST;
	Traind__CacheEntry *ents = cz(c, (c->ncache + 1) * sizeof(*ents));
	Traind__CacheEntry **arr = cz(c, (c->ncache + 1) * sizeof(*arr));
	char dir[4200];
	modules_dir(c, dir, sizeof(dir));
	if (!cr || !ents || !arr)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	traind__cache_reply__init(cr);
	cr->dir = cstr(c, dir);
	uint64_t bytes = 0, hits = 0;
	for (size_t i = 0; i < c->ncache; i++) {
		const struct st_cache_entry *s = &c->cache[i];
		bytes += s->size_bytes;
		hits += s->hits;
		if (!list)
			continue;
		Traind__CacheEntry *x = &ents[i];
		traind__cache_entry__init(x);
		x->key = s->key;
		x->path = s->path;
		x->sha256 = s->sha256;
		x->arch = s->arch;
		SETF(x, size_bytes, s->size_bytes);
		SETF(x, src_bytes, s->src_bytes);
		SETF(x, created, secs(s->created_ms));
		SETF(x, used, secs(s->used_ms));
		SETF(x, hits, s->hits);
		arr[i] = x;
	}
	if (list) {
		cr->entries = arr;
		cr->n_entries = c->ncache;
	}
	SETF(cr, count, (uint64_t)c->ncache);
	SETF(cr, bytes, bytes);
	SETF(cr, hits, hits);
	c->resp.result_case = TRAIND__RESPONSE__RESULT_CACHE;
	c->resp.cache = cr;
	return TD_OK;
}

/* Deletes path if it is a cubin directly in dir (nothing else, whatever the
 * index says). */
static bool remove_cubin(const char *dir, const char *path)
{
	size_t n = strlen(dir), len = strlen(path);
	if (!*dir || strncmp(path, dir, n) != 0 || path[n] != '/' || strchr(path + n + 1, '/') ||
	    len < 6 || strcmp(path + len - 6, ".cubin") != 0)
		return false;
	return unlink(path) == 0;
}

/* Every entry of the index and every cubin in the modules dir: the next job
 * compiles what it needs again. Root, the admin group, or the user a
 * user-mode daemon runs as. */
static td_err h_cache_clear(struct dmn_call *c)
{
	if (!c->admin && c->peer.uid != geteuid())
		return td_fail(&c->eb, TD_EPERM,
			       "cache clear: only root, the admin group and the daemon's own user may "
			       "clear the module cache");
	char dir[4200];
	modules_dir(c, dir, sizeof(dir));
	td_err e = st_cache_list(c->env->db, &c->cache, &c->ncache, &c->eb);
	if (e != TD_OK)
		return e;
	uint64_t files = 0;
	for (size_t i = 0; i < c->ncache; i++)
		files += c->cache[i].path && remove_cubin(dir, c->cache[i].path);
	DIR *d = *dir ? opendir(dir) : NULL;
	struct dirent *de;
	while (d && (de = readdir(d))) {
		char p[4200 + 256];
		snprintf(p, sizeof(p), "%s/%s", dir, de->d_name);
		files += remove_cubin(dir, p);
	}
	if (d)
		closedir(d);
	size_t n = 0;
	if ((e = st_cache_clear(c->env->db, &n, &c->eb)) != TD_OK)
		return e;
	td_info("TD-CACHE-CLEAR", "module cache cleared by uid %u: %zu entries, %llu files in %s",
		(unsigned)c->peer.uid, n, (unsigned long long)files, *dir ? dir : "(no cache dir)");
	Traind__CacheReply *cr = cz(c, sizeof(*cr));
	if (!cr)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	traind__cache_reply__init(cr);
	cr->dir = cstr(c, dir);
	SETF(cr, removed, (uint64_t)n);
	SETF(cr, files_removed, files);
	c->resp.result_case = TRAIND__RESPONSE__RESULT_CACHE;
	c->resp.cache = cr;
	return TD_OK;
}

static td_err h_info(struct dmn_call *c)
{
	const struct dmn_config *cfg = c->env->cfg;
	Traind__InfoReply *ir = cz(c, sizeof(*ir));
	char **backends = cz(c, 2 * sizeof(char *));
	if (!ir || !backends)
		return td_fail(&c->eb, TD_ENOMEM, "out of memory");
	traind__info_reply__init(ir);
	ir->version = (char *)TD_VERSION;
	SETF(ir, protocol, RPC_PROTOCOL);
	ir->mode = (char *)dmn_mode_name(cfg->mode);
	ir->socket = (char *)cfg->socket;
	ir->state_dir = (char *)cfg->state_dir;
	ir->cache_dir = (char *)cfg->cache_dir;
	td_err e = fill_devices(c, &ir->devices, &ir->n_devices);
	if (e != TD_OK)
		return e;
	backends[0] = (char *)"cpu";
	ir->backends = backends;
	ir->n_backends = 1;
	if (c->env->dev->nreal > 0)
		backends[ir->n_backends++] = (char *)"cuda";
	else if (c->env->dev->why_none[0])
		ir->gpu_note = (char *)c->env->dev->why_none;
	struct dmn_runners *run = dmn_sched_runners(c->env->sched);
	SETF(ir, queued, dmn_sched_queued(c->env->sched));
	SETF(ir, running, (uint32_t)dmn_runners_count(run));
	SETF(ir, cpu_slots, (uint32_t)cfg->cpu_slots);
	ir->preempt = (char *)(cfg->preempt == DMN_PREEMPT_PRIORITY ? "priority"
			       : cfg->preempt == DMN_PREEMPT_USER   ? "user"
								    : "off");
	SETF(ir, preempt_grace_s, (uint32_t)cfg->preempt_grace_s);
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	SETF(ir, uptime_s, (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 - c->env->start_time);
	SETF(ir, caller_uid, (uint32_t)c->peer.uid);
	SETF(ir, caller_admin, c->admin);
	char libs[256];
	snprintf(libs, sizeof(libs), "nng %s, libuv %s, sqlite %s, protobuf-c %s", nng_version(),
		 uv_version_string(), sqlite3_libversion(), protobuf_c_version());
	ir->libraries = cstr(c, libs);
	SETF(ir, pid, (uint32_t)getpid());
	c->resp.result_case = TRAIND__RESPONSE__RESULT_INFO;
	c->resp.info = ir;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* The table and the shared checks */

enum who { WHO_ANYONE, WHO_ADMIN };

struct rpc_entry {
	const char *name;
	td_err (*fn)(struct dmn_call *c);
	enum who who;
	bool mutates;
	bool names_job;  /* the request carries a job id: load it, check the owner */
};

enum {
	RPC_SUBMIT, RPC_LIST, RPC_SHOW, RPC_CANCEL, RPC_WATCH,
	RPC_LEDGER_LIST, RPC_LEDGER_RESERVE, RPC_LEDGER_RELEASE, RPC_INFO,
	RPC_CACHE_LIST, RPC_CACHE_STATS, RPC_CACHE_CLEAR,
	RPC_HOLD, RPC_RELEASE, RPC_REQUEUE, RPC_PRIORITY, RPC_USAGE, RPC_COUNT
};
_Static_assert(RPC_COUNT <= DMN_RPC_MAX, "raise DMN_RPC_MAX");

static const struct rpc_entry rpc_table[RPC_COUNT] = {
	[RPC_SUBMIT] = {"submit", h_submit, WHO_ANYONE, true, false},
	[RPC_LIST] = {"list", h_list, WHO_ANYONE, false, false},
	[RPC_SHOW] = {"show", h_show, WHO_ANYONE, false, true},
	[RPC_CANCEL] = {"cancel", h_cancel, WHO_ANYONE, true, true},
	[RPC_WATCH] = {"watch", h_watch, WHO_ANYONE, false, true},
	[RPC_LEDGER_LIST] = {"ledger.list", h_ledger_list, WHO_ANYONE, false, false},
	[RPC_LEDGER_RESERVE] = {"ledger.reserve", h_ledger_reserve, WHO_ANYONE, true, false},
	[RPC_LEDGER_RELEASE] = {"ledger.release", h_ledger_release, WHO_ANYONE, true, false},
	[RPC_INFO] = {"info", h_info, WHO_ANYONE, false, false},
	[RPC_CACHE_LIST] = {"cache.list", h_cache_list, WHO_ANYONE, false, false},
	[RPC_CACHE_STATS] = {"cache.stats", h_cache_list, WHO_ANYONE, false, false},
	/* its own check: admins or the daemon's user */
	[RPC_CACHE_CLEAR] = {"cache.clear", h_cache_clear, WHO_ANYONE, true, false},
	/* issue 14: on a job of one's own, or any for admins (the shared check) */
	[RPC_HOLD] = {"hold", h_hold, WHO_ANYONE, true, true},
	[RPC_RELEASE] = {"release", h_hold, WHO_ANYONE, true, true},
	[RPC_REQUEUE] = {"requeue", h_requeue, WHO_ANYONE, true, true},
	[RPC_PRIORITY] = {"priority", h_priority, WHO_ANYONE, true, true},
	/* its own check: others' usage for admins */
	[RPC_USAGE] = {"usage", h_usage, WHO_ANYONE, false, false},
};

const char *dmn_dispatch_call_name(int k)
{
	return k >= 0 && k < RPC_COUNT ? rpc_table[k].name : "undecodable";
}

int dmn_dispatch_ncalls(void)
{
	return RPC_COUNT;
}

/* The table entry and, for a call about a job, its id. */
static int entry_of(const Traind__Request *r, uint64_t *job_id)
{
	*job_id = 0;
	switch (r->call_case) {
	case TRAIND__REQUEST__CALL_SUBMIT: return RPC_SUBMIT;
	case TRAIND__REQUEST__CALL_LIST: return RPC_LIST;
	case TRAIND__REQUEST__CALL_SHOW: *job_id = r->show->id; return RPC_SHOW;
	case TRAIND__REQUEST__CALL_CANCEL: *job_id = r->cancel->id; return RPC_CANCEL;
	case TRAIND__REQUEST__CALL_WATCH: *job_id = r->watch->id; return RPC_WATCH;
	case TRAIND__REQUEST__CALL_INFO: return RPC_INFO;
	case TRAIND__REQUEST__CALL_HOLD:
		*job_id = r->hold->id;
		return r->hold->has_release && r->hold->release ? RPC_RELEASE : RPC_HOLD;
	case TRAIND__REQUEST__CALL_REQUEUE: *job_id = r->requeue->id; return RPC_REQUEUE;
	case TRAIND__REQUEST__CALL_PRIORITY: *job_id = r->priority->id; return RPC_PRIORITY;
	case TRAIND__REQUEST__CALL_USAGE: return RPC_USAGE;
	case TRAIND__REQUEST__CALL_CACHE:
		switch (r->cache->op_case) {
		case TRAIND__CACHE_REQUEST__OP_LIST: return RPC_CACHE_LIST;
		case TRAIND__CACHE_REQUEST__OP_STATS: return RPC_CACHE_STATS;
		case TRAIND__CACHE_REQUEST__OP_CLEAR: return RPC_CACHE_CLEAR;
		default: return -1;
		}
	case TRAIND__REQUEST__CALL_LEDGER:
		switch (r->ledger->op_case) {
		case TRAIND__LEDGER_REQUEST__OP_LIST: return RPC_LEDGER_LIST;
		case TRAIND__LEDGER_REQUEST__OP_RESERVE: return RPC_LEDGER_RESERVE;
		case TRAIND__LEDGER_REQUEST__OP_RELEASE: return RPC_LEDGER_RELEASE;
		default: return -1;
		}
	default:
		return -1;
	}
}

static td_err shared_checks(struct dmn_call *c, const struct rpc_entry *ent, uint64_t job_id)
{
	if (ent->who == WHO_ADMIN && !c->admin)
		return td_fail(&c->eb, TD_EPERM, "%s: only root and the admin group may do this",
			       ent->name);
	if (ent->mutates && c->env->stopping)
		return td_fail(&c->eb, TD_EBUSY, "traind is shutting down; try again when it is back");
	if (ent->names_job) {
		if (job_id > INT64_MAX)
			return td_fail(&c->eb, TD_ENOENT, "job %llu does not exist", (unsigned long long)job_id);
		td_err e = st_job_get(c->env->db, (int64_t)job_id, &c->job, &c->eb);
		if (e == TD_ENOENT)
			return td_fail(&c->eb, TD_ENOENT, "job %llu does not exist (`trainctl ls` lists yours)",
				       (unsigned long long)job_id);
		if (e != TD_OK)
			return e;
		c->has_job = true;
		if (c->job.uid != c->peer.uid && !c->admin) {
			/* trainctl logs reads through watch: say what the user ran */
			bool logs = c->req->call_case == TRAIND__REQUEST__CALL_WATCH &&
				    c->req->watch->command && strcmp(c->req->watch->command, "logs") == 0;
			bool prio = c->req->call_case == TRAIND__REQUEST__CALL_PRIORITY;
			return td_fail(&c->eb, TD_EPERM,
				       "job %llu belongs to another user; only its owner, root and the "
				       "admin group may %s %s",
				       (unsigned long long)job_id,
				       logs ? "read" : prio ? "change" : ent->name,
				       logs ? "its logs" : prio ? "its priority" : "it");
		}
	}
	return TD_OK;
}

void dmn_dispatch(struct dmn_env *env, const struct dmn_peer *peer, const uint8_t *buf,
		  size_t len, dmn_reply_fn reply, void *ctx)
{
	struct dmn_call *c = calloc(1, sizeof(*c));
	if (!c) {
		size_t n = 0;
		uint8_t *b = dmn_error_reply(TD_ENOMEM, "the daemon is out of memory", &n);
		reply(ctx, b, n);
		return;
	}
	c->env = env;
	c->peer = *peer;
	c->reply = reply;
	c->ctx = ctx;
	c->name = "request";
	c->entry = -1;
	traind__response__init(&c->resp);
	env->pending++;

	td_err e = rpc_request_decode(&c->req, buf, len, (size_t)env->cfg->max_request_bytes, &c->eb);
	if (e != TD_OK) {
		td_warn("TD-RPC-BAD", "uid %u pid %d: %s", (unsigned)peer->uid, (int)peer->pid, c->eb.msg);
		finish(c, e);
		return;
	}
	uint64_t job_id;
	int k = entry_of(c->req, &job_id);
	if (k < 0) {
		finish(c, td_fail(&c->eb, TD_EINVAL, "request: unknown call"));
		return;
	}
	const struct rpc_entry *ent = &rpc_table[k];
	c->name = ent->name;
	c->entry = k;
	c->admin = dmn_is_admin(peer->uid, peer->gid, env->cfg->admin_group);
	td_debug("TD-RPC", "uid %u pid %d: %s", (unsigned)peer->uid, (int)peer->pid, ent->name);
	if ((e = shared_checks(c, ent, job_id)) == TD_OK)
		e = ent->fn(c);
	if (e != CALL_PENDING)
		finish(c, e);
}
