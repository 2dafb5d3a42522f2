/* The scheduler (daemon/scheduler.h). */
#include "daemon/scheduler.h"

#include <limits.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/identity.h"
#include "daemon/placement.h"
#include "daemon/preflight.h"
#include "gpu/comm.h"
#include "gpu/select.h"
#include "proto/jobspec.h"
#include "proto/log.h"

struct claim {
	int64_t key;  /* the job id, or a negative provisional key */
	char *dir;
};

struct plan {
	int64_t job_id;
	struct dmn_plan_bytes pb;
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
	struct dmn_plan_bytes pb;
	td_err err;
	struct td_errbuf eb;
};

/* A preemption asked for whose victim's runner has not ended yet. */
struct preemption {
	int64_t victim, by;
};
#define PREEMPT_MAX 64
#define DEFER_MAX 256

/* A running job (for preemption: scheduler.h). */
struct cand {
	struct dmn_run_info run;
	int32_t priority;
	int64_t start_ms;     /* its last start; INT64_MAX for one not running yet (newest) */
	int64_t preempted_ms; /* when it was last preempted; 0: never */
	bool cancelling;      /* its cancel was requested */
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
	/* The GPUs held for the first job that waits for GPUs (see pass): no
	 * other job of its priority or lower is placed on them. 0: none. */
	int64_t hold_job;
	int32_t hold_prio;
	uint32_t hold_mask;
	/* This pass's view of the ledger: each GPU's reserved bytes (UINT64_MAX:
	 * unknown, the GPU is skipped) and free memory (dmn_gpu_free_bytes). */
	uint64_t reserved[DMN_MAX_GPUS], free_now[DMN_MAX_GPUS];
	bool pass_blocked; /* a job of this pass waits for GPUs (wait_for_gpus) */
	/* The last offer's: whether the job would hold GPU i's shared block of
	 * its base that is there already (its need then without the block). */
	bool attach[DMN_MAX_GPUS];
	/* Why each queued job waits, as of the last pass (dmn_sched_waiting). */
	struct why *why;
	size_t nwhy, capwhy;
	/* Preemptions in flight: no other is decided until they end. */
	struct preemption preempting[PREEMPT_MAX];
	size_t npreempting;
	/* This pass's running jobs, for preemption (SIZE_MAX: not read yet). */
	struct cand *running;
	size_t nrunning;
	/* Jobs across daemons (resources.hosts): the peer client (NULL: this
	 * daemon has no peer_listen), whether the job being offered GPUs runs
	 * NCCL (a gang, or ranks on other daemons: its leases hold NCCL's
	 * buffers), and the jobs whose last try found a daemon of theirs
	 * unreachable or busy: not placed again before until_ms. */
	const struct dmn_peer_client *peer;
	bool cur_nccl;
	struct defer {
		int64_t job_id, until_ms;
		char why[240];
	} defer[DEFER_MAX];
	size_t ndefer;
};

struct why {
	int64_t job_id;
	char text[240];
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

static bool ended_in_db(struct dmn_sched *s, int64_t id);
static void plan_remove(struct dmn_sched *s, int64_t job_id);

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
			if (s->claims[i].key > 0 && ended_in_db(s, s->claims[i].key)) {
				/* Its job ended unheard of (sweep_ended): the dir is free. */
				int64_t key = s->claims[i].key;
				claim_remove(s, key);
				plan_remove(s, key);
				break;
			}
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

void dmn_sched_set_plan(struct dmn_sched *s, int64_t job_id, const struct dmn_plan_bytes *plan)
{
	struct plan *p = plan_get(s, job_id);
	if (p) {
		p->pb = *plan;
		p->state = PLAN_DONE;
	}
}

static void plan_work(uv_work_t *req)
{
	struct plan_work *w = req->data;
	struct dmn_fscreds creds;
	w->err = dmn_fscreds_of(&creds, w->uid, w->gid, &w->eb);
	if (w->err == TD_OK)
		w->err = dmn_preflight(w->spec, &creds, &w->pb, &w->eb);
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
			p->pb = w->pb;
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

/* floor(total × factor), as the ledger computes a device's share. */
static uint64_t share_of(const struct dmn_config *cfg, const struct dmn_gpu *g)
{
	uint64_t l = (uint64_t)((long double)g->total_bytes * (long double)cfg->vram_factor);
	return l > g->total_bytes ? g->total_bytes : l;
}

/* Reads every GPU's reserved bytes and free memory for this pass. */
static void snapshot(struct dmn_sched *s)
{
	for (int i = 0; i < s->dev->n; i++) {
		const struct dmn_gpu *g = &s->dev->gpu[i];
		struct td_errbuf eb = {{0}};
		if (st_ledger_reserved(s->db, g->uuid, &s->reserved[i], &eb) != TD_OK) {
			td_warn("TD-SCHED-LEDGER", "%s: %s", g->uuid, eb.msg);
			s->reserved[i] = UINT64_MAX;
		}
		s->free_now[i] = dmn_gpu_free_bytes(g);
	}
}

/* A job's frozen base that it may share on its GPU (daemon/preflight.h:
 * dmn_base_key): the ledger's key on a real GPU ([0]) and a simulated one
 * ([1]), where ok, and its bytes. */
struct share {
	bool ok[2];
	char key[2][65];
	uint64_t bytes;
	char label[160];
};

/* What each GPU offers job q (plan_bytes, want GPUs). holds: whether the
 * GPUs held for another job are closed to it; lost: whether GPUs whose
 * context is being reset are. sh: the job's shareable base, or NULL: where
 * the GPU has its block already the job needs its plan without it
 * (s->attach). */
static void offer(struct dmn_sched *s, const struct st_queued *q, uint64_t plan_bytes,
		  unsigned want, bool holds, bool lost, struct dmn_place_gpu *pg,
		  const struct share *sh)
{
	for (int i = 0; i < s->dev->n; i++) {
		const struct dmn_gpu *g = &s->dev->gpu[i];
		s->attach[i] = false;
		if (sh && sh->ok[g->fake]) {
			bool found = false;
			struct td_errbuf eb = {{0}};
			if (st_ledger_shared_find(s->db, g->uuid, sh->key[g->fake], &found, NULL, &eb) ==
			    TD_OK)
				s->attach[i] = found;
		}
		uint64_t share = share_of(s->cfg, g);
		uint64_t avail = s->reserved[i] == UINT64_MAX ? 0
				 : share > s->reserved[i]	      ? share - s->reserved[i]
								      : 0;
		if (avail > s->free_now[i])
			avail = s->free_now[i];
		bool held = holds && (s->hold_mask >> i & 1) && s->hold_job != q->id &&
			    q->priority <= s->hold_prio;
		pg[i] = (struct dmn_place_gpu){
			.usable = dmn_gpu_gang_ok(g, want) && !held &&
				  !(lost && !g->fake && dmn_runners_lost(s->run, g->ordinal)),
			/* A gang's real GPUs hold NCCL's buffers too (gpu/comm.h). */
			.need = dmn_sched_lease_bytes(s->cfg, g, plan_bytes) +
				((want > 1 || s->cur_nccl) && !g->fake ? GPU_NCCL_RESERVE_BYTES : 0) -
				(s->attach[i] ? sh->bytes : 0),
			.avail = avail,
			.share = share,
		};
	}
}

static void hold_clear(struct dmn_sched *s)
{
	s->hold_job = 0;
	s->hold_mask = 0;
	s->hold_prio = 0;
}

/* q waits for GPUs: none of its kind has room for it now. If it could never
 * fit (its plan exceeds a GPU's share, on every set of `want`) it fails,
 * unless the CPU may take it. Otherwise, if no job holds GPUs, or it has a
 * higher priority than the one that does, the GPUs it waits for are held
 * for it: the set it fits once they drain (NVLink first, the nearest to
 * fitting next), closed to every other job of its priority or lower. Held
 * GPUs only lose leases (their jobs end; none of those jobs is placed there),
 * so the holder starts in finite time, however many small jobs queue behind
 * it: no starvation of a gang by a stream of single-GPU jobs. Only the
 * first job of a pass's order that waits for GPUs may take a free hold, so
 * that the hold follows the order (priority, fair share, age) and a job that
 * waited on another's hold is next. */
/* smallest: 0, the job's plan; 1, AUTO's smallest (FULL_OFFLOAD's); 2,
 * AUTO's smallest without FULL_OFFLOAD, whose pinned bytes are more than
 * pinned_host_max_mib (FULL's) */
static enum place wait_for_gpus(struct dmn_sched *s, const struct st_queued *q, uint64_t plan_bytes,
				unsigned want, bool allow_cpu, int smallest, const struct share *sh)
{
	struct dmn_place_gpu pg[DMN_MAX_GPUS];
	/* sh: a job that could hold a GPU's shared block of its base needs
	 * less there (it never fails as too big where it fits beside it). */
	offer(s, q, plan_bytes, want, false, false, pg, sh);
	if (!dmn_place_pick(pg, s->dev->n, s->dev->nvlink, (int)want, DMN_PLACE_EMPTY)) {
		if (allow_cpu && s->cfg->cpu_slots > 0)
			return PLACE_WAIT; /* for a CPU slot (a host without any never gives one) */
		uint64_t most = 0, need = 0;
		for (int i = 0; i < s->dev->n; i++) {
			if (!dmn_gpu_gang_ok(&s->dev->gpu[i], want))
				continue;
			if (pg[i].share > most)
				most = pg[i].share, need = pg[i].need;
		}
		char reason[600];
		snprintf(reason, sizeof(reason),
			 "resources: the job needs %.1f MiB on each of %u GPU%s%s, and no %s of this "
			 "host's GPUs can ever grant that much (the most one grants is %.1f MiB: its "
			 "memory \u00d7 vram_factor %.2f)",
			 (double)need / (1 << 20), want, want == 1 ? "" : "s",
			 smallest == 1 ? " with its smallest plan (memory.recompute AUTO tried none, "
					 "selective, full and full-offload; full-offload's is the smallest)"
			 : smallest == 2 ? " with its smallest plan (memory.recompute AUTO tried none, "
					   "selective and full; full-offload pins more host memory than "
					   "pinned_host_max_mib allows)"
					 : "",
			 want == 1 ? "one" : "set", (double)most / (1 << 20), s->cfg->vram_factor);
		if (s->hold_job == q->id)
			hold_clear(s);
		fail_job(s, q->id, reason);
		return PLACE_ENDED;
	}
	bool first = !s->pass_blocked;
	s->pass_blocked = true;
	if (s->hold_job && s->hold_job != q->id && q->priority <= s->hold_prio)
		return PLACE_WAIT;
	offer(s, q, plan_bytes, want, false, true, pg, sh);
	if (s->hold_job == q->id) {
		/* Keep the set while it still can take the job (vram_factor may have
		 * changed, a GPU may be lost). */
		bool still = true;
		for (int i = 0; i < s->dev->n; i++)
			if (s->hold_mask >> i & 1)
				still = still && pg[i].usable && pg[i].need <= pg[i].share;
		if (still)
			return PLACE_WAIT;
	} else if (!first) {
		/* A job before it in this pass's order waits for GPUs too (the
		 * hold it waited on went to a job placed since): the hold is that
		 * job's, at the next pass, which comes before any other placement. */
		return PLACE_WAIT;
	}
	uint32_t mask = dmn_place_pick(pg, s->dev->n, s->dev->nvlink, (int)want, DMN_PLACE_EMPTY);
	if (!mask)
		return PLACE_WAIT; /* its GPUs are being reset */
	int64_t before = s->hold_job;
	s->hold_job = q->id;
	s->hold_prio = q->priority;
	s->hold_mask = mask;
	char gpus[64];
	dmn_devices_mask_str(mask, gpus, sizeof(gpus));
	if (before && before != q->id)
		td_info("TD-SCHED-HOLD", "job %lld (priority %d) takes the GPUs held for job %lld",
			(long long)q->id, q->priority, (long long)before);
	td_info("TD-SCHED-HOLD", "job %lld waits for GPU %s, held for it", (long long)q->id, gpus);
	st_event_addf(s->db, q->id, "info", NULL,
		      "waiting for GPU %s: held for this job, no job of priority %d or lower is "
		      "placed there until it starts",
		      gpus, q->priority);
	return PLACE_WAIT;
}

/* Leases on every GPU of mask for q, in one transaction. */
static td_err reserve_gpus(struct dmn_sched *s, const struct st_queued *q, uint32_t mask,
			   const struct dmn_place_gpu *pg, const struct share *sh,
			   struct dmn_run_request *rr, struct td_errbuf *eb)
{
	struct st_lease_req lr[DMN_MAX_GPUS];
	struct st_device_cap cap[DMN_MAX_GPUS];
	char label[DMN_MAX_GPUS][64];
	int n = __builtin_popcount(mask), k = 0;
	for (int i = 0; i < s->dev->n; i++) {
		if (!(mask >> i & 1))
			continue;
		const struct dmn_gpu *g = &s->dev->gpu[i];
		if (n > 1)
			snprintf(label[k], sizeof(label[k]), "job %lld, GPU %d of %d", (long long)q->id,
				 k + 1, n);
		else
			snprintf(label[k], sizeof(label[k]), "job %lld", (long long)q->id);
		lr[k] = (struct st_lease_req){
			.gpu_uuid = g->uuid,
			.bytes = pg[i].need,
			.job_id = q->id,
			.uid = q->uid,
			.pid = getpid(),
			.label = label[k],
		};
		cap[k] = (struct st_device_cap){
			.total_bytes = g->total_bytes,
			.factor = s->cfg->vram_factor,
			.free_bytes_now = s->free_now[i],
		};
		rr->gpu[k] = (struct dmn_run_gpu){.index = i, .ordinal = g->ordinal, .fake = g->fake,
						  .bytes = pg[i].need};
		if (sh && n == 1 && sh->ok[g->fake]) {
			/* The lease is the job's own bytes; the base is the GPU's
			 * block of its key, held, or reserved with it. */
			uint64_t own = s->attach[i] ? pg[i].need : pg[i].need - sh->bytes;
			lr[k].bytes = own;
			lr[k].share_key = sh->key[g->fake];
			lr[k].share_bytes = sh->bytes;
			lr[k].share_label = sh->label;
			rr->gpu[k].bytes = own;
			rr->base_shared = true;
			rr->base_attached = s->attach[i];
			rr->base_bytes = sh->bytes;
			snprintf(rr->base_key, sizeof(rr->base_key), "%s:%s", sh->key[g->fake], g->uuid);
		}
		snprintf(rr->gpu[k].uuid, sizeof(rr->gpu[k].uuid), "%s", g->uuid);
		k++;
	}
	int64_t ids[DMN_MAX_GPUS];
	td_err e = st_ledger_reserve_gang(s->db, lr, cap, (size_t)n, ids, eb);
	if (e != TD_OK)
		return e;
	rr->ngpus = n;
	for (k = 0; k < n; k++) {
		rr->gpu[k].lease = ids[k];
		int i = rr->gpu[k].index;
		s->reserved[i] += pg[i].need;
		if (!s->dev->gpu[i].fake && s->free_now[i] != UINT64_MAX)
			s->free_now[i] = s->free_now[i] > pg[i].need ? s->free_now[i] - pg[i].need : 0;
	}
	return TD_OK;
}

static void release_gpus(struct dmn_sched *s, const struct dmn_run_request *rr)
{
	for (int k = 0; k < rr->ngpus; k++) {
		st_ledger_release(s->db, rr->gpu[k].lease, 0, true, NULL);
		int i = rr->gpu[k].index;
		s->reserved[i] = s->reserved[i] > rr->gpu[k].bytes ? s->reserved[i] - rr->gpu[k].bytes : 0;
	}
}

/* Pinned host memory (memory.recompute FULL_OFFLOAD's checkpoints, in no
 * lease): what the running jobs may hold together (dmn_config_pinned_max),
 * and what they hold. */
static uint64_t pinned_max(const struct dmn_sched *s)
{
	return dmn_config_pinned_max(s->cfg);
}

static uint64_t pinned_held(struct dmn_sched *s)
{
	return dmn_runners_host_bytes(s->run, -1);
}

/* What a job whose policy the spec fixes pins beyond what is left (0: it
 * fits, or it pins nothing), and the budget and what is held, for the
 * reasons. */
static uint64_t pinned_short(struct dmn_sched *s, const struct plan *p, uint64_t *max,
			     uint64_t *held)
{
	*max = *held = 0;
	if (!p || p->state != PLAN_DONE || p->pb.auto_policy || !p->pb.host_bytes)
		return 0;
	*max = pinned_max(s);
	*held = pinned_held(s);
	const uint64_t left = *max > *held ? *max - *held : 0;
	return p->pb.host_bytes > left ? p->pb.host_bytes - left : 0;
}

/* How many more of a one-GPU job's first layers selective (each per bytes
 * on its plan of base bytes) a GPU grants now, up to all of them. */
static int selective_granted(struct dmn_sched *s, const struct st_queued *q, const struct plan *p,
			     uint64_t base, uint64_t per, struct dmn_place_gpu *pg,
			     const struct share *sh)
{
	int lo = 0, hi = p->pb.num_layers - p->pb.selective_layers;
	while (lo < hi) {
		const int mid = lo + (hi - lo + 1) / 2;
		offer(s, q, base + (uint64_t)mid * per, 1, true, true, pg, sh);
		if (dmn_place_pick(pg, s->dev->n, s->dev->nvlink, 1, DMN_PLACE_NOW))
			lo = mid;
		else
			hi = mid - 1;
	}
	return lo;
}

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
	unsigned ngpus = spec->resources->gpus ? spec->resources->gpus : 1;
	/* Ranks on other daemons too (resources.hosts): a gang across them. */
	const bool hosts = spec->resources->n_hosts > 0;
	if (hosts && !s->peer) {
		rpc_jobspec_free(spec);
		fail_job(s, q->id,
			 "resources.hosts: this daemon takes no part in jobs across daemons (it has no "
			 "peer_listen setting now)");
		return PLACE_ENDED;
	}
	s->cur_nccl = ngpus > 1 || hosts;
	/* A gang never runs on the CPU: it asked for several GPUs. */
	bool allow_cpu = ngpus == 1 && !hosts &&
			 (want == TRAIND__DEVICE__DEVICE_CPU || spec->resources->allow_cpu);
	bool gpu_ok = want != TRAIND__DEVICE__DEVICE_CPU && s->dev->n > 0;
	if (!gpu_ok && !allow_cpu) {
		rpc_jobspec_free(spec);
		fail_job(s, q->id,
			 hosts ? "resources.hosts: the job runs on GPUs and this host has none"
			 : ngpus > 1 ? "resources.gpus: the job needs several GPUs and this host has none"
				   : "resources.device: the job needs a GPU and this host has none; set "
				     "resources.allow_cpu: true (or device: DEVICE_CPU) to run it on the CPU");
		return PLACE_ENDED;
	}
	if (gpu_ok && dmn_devices_check_gpus(s->dev, ngpus, &eb) != TD_OK) {
		/* Submitted to a daemon with other GPUs (restarted since). */
		rpc_jobspec_free(spec);
		char reason[1100];
		snprintf(reason, sizeof(reason), "%s", eb.msg);
		fail_job(s, q->id, reason);
		return PLACE_ENDED;
	}

	struct dmn_run_request rr = {0};
	uint64_t plan_bytes = 0;
	int policy = -1; /* AUTO's choice (enum tr_recompute) where it placed the job */
	int shard = -1;  /* memory.shard AUTO's (enum tr_shard) */
	int sel_more = 0; /* selective layers AUTO added to its plan's (policy's) */
	int full_more = -1; /* where AUTO took FULL_OFFLOAD for more of them: FULL's */
	bool fo_never = false; /* AUTO: FULL_OFFLOAD pins more than pinned_host_max_mib */
	const struct plan *p = NULL;
	struct share sh = {0};
	bool shares = false;
	if (gpu_ok) {
		p = plan_find(s, q->id);
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
		/* Pinned host memory: a FULL_OFFLOAD job the spec fixes needs its
		 * checkpoints' bytes left under pinned_host_max_mib (more than all
		 * of it: it fails); AUTO passes over FULL_OFFLOAD where they are not
		 * left. */
		uint64_t pin_max = 0, pin_held = 0;
		const uint64_t pin_short = pinned_short(s, p, &pin_max, &pin_held);
		if (pin_short && p->pb.host_bytes > pin_max) {
			char reason[600];
			snprintf(reason, sizeof(reason),
				 "memory.recompute full-offload: its plan pins %.1f MiB of host memory, "
				 "more than the %.1f MiB that the pinned_host_max_mib setting lets all "
				 "running jobs hold together (choose full, or AUTO)",
				 (double)p->pb.host_bytes / (1 << 20), (double)pin_max / (1 << 20));
			rpc_jobspec_free(spec);
			fail_job(s, q->id, reason);
			return PLACE_ENDED;
		}
		if (pin_short) {
			rpc_jobspec_free(spec);
			return PLACE_WAIT; /* explain_wait says why */
		}
		if (p->pb.auto_policy) {
			pin_max = pinned_max(s);
			pin_held = pinned_held(s);
		}
		const uint64_t pin_left = pin_max > pin_held ? pin_max - pin_held : 0;
		/* memory.recompute AUTO: the fastest policy whose plan a GPU grants
		 * now — NONE, SELECTIVE, FULL, then FULL_OFFLOAD (each keeps less and
		 * recomputes more); a gang's memory.shard AUTO tries each policy
		 * with each sharding in dmn_auto_shard's order (each sharding's
		 * collectives cost less than the next policy's recompute). Not
		 * placed, it waits with the smallest plan (dmn_plan_smallest),
		 * which fits soonest. */
		const int npol = p->pb.auto_policy ? TR_RECOMPUTE_COUNT : 1;
		/* Across daemons the optimizer state is whole on every rank. */
		const int nsh = p->pb.auto_shard && !hosts ? TR_SHARD_BUILT : 1;
		struct dmn_place_gpu pg[DMN_MAX_GPUS];
		uint32_t mask = 0;
		/* A base it may share (memory.share_base, the share_bases setting):
		 * a GPU that has it needs the job's plan less the base. */
		sh.bytes = p->pb.base_bytes;
		shares = s->cfg->share_bases && ngpus == 1 && p->pb.base_bytes;
		for (int fake = 0; shares && fake < 2; fake++)
			sh.ok[fake] = dmn_base_key(spec, &p->pb, fake, sh.key[fake]);
		if (shares)
			snprintf(sh.label, sizeof(sh.label), "base of %s (%s)", spec->model_dir,
				 rpc_method_name(spec->method));
		bool pin_later = false; /* a plan passed over while others hold its pinned bytes */
		for (int k = 0; k < npol * nsh && !mask; k++) {
			const int pk = k / nsh, sk = nsh > 1 ? (int)dmn_auto_shard(k % nsh) : 0;
			const uint64_t hb = p->pb.auto_policy ? p->pb.host_by_policy[pk] : 0;
			if (hb > pin_max) {
				fo_never = true;
				continue; /* never: it waits with another plan */
			}
			plan_bytes = dmn_plan_of(&p->pb, sk, pk);
			if (hb > pin_left) {
				pin_later = true;
				continue;
			}
			offer(s, q, plan_bytes, ngpus, true, true, pg, shares ? &sh : NULL);
			mask = dmn_place_pick(pg, s->dev->n, s->dev->nvlink, (int)ngpus, DMN_PLACE_NOW);
			if (mask && p->pb.auto_policy)
				policy = pk;
			if (mask && (p->pb.auto_shard || hosts))
				shard = hosts ? TR_SHARD_NONE : sk;
		}
		/* Only the plan whose pinned bytes are held fits a GPU now: the
		 * job waits for those bytes (explain_wait), holding no GPU. */
		if (!mask && pin_later) {
			offer(s, q, plan_bytes, ngpus, true, true, pg, shares ? &sh : NULL);
			if (dmn_place_pick(pg, s->dev->n, s->dev->nvlink, (int)ngpus, DMN_PLACE_NOW)) {
				rpc_jobspec_free(spec);
				return PLACE_WAIT;
			}
		}
		/* AUTO on FULL or FULL_OFFLOAD, one GPU: as many more of the
		 * first layers selective as the GPUs grant now (each a layer's
		 * products not recomputed: the fastest plan between the policy's
		 * and the next faster one's, a layer at a time). */
		const bool one = mask && ngpus == 1 && !hosts && nsh == 1;
		const uint64_t per = one && policy >= 0 ? p->pb.sel_layer_bytes[policy] : 0;
		if (per) {
			sel_more = selective_granted(s, q, p, plan_bytes, per, pg, shares ? &sh : NULL);
			plan_bytes += (uint64_t)sel_more * per;
			/* FULL_OFFLOAD keeps each layer's checkpoint on the host: in
			 * the bytes FULL was granted it has room for more selective
			 * layers. More of them is the faster plan (each a layer's
			 * products not recomputed: ~4.9 ms a Llama-3-8B step on an
			 * H200, where the checkpoints' copies hide behind the
			 * layers' work), where the pinned bytes are left. */
			const int off = TR_RECOMPUTE_FULL_OFFLOAD;
			const uint64_t per_off = p->pb.sel_layer_bytes[off];
			if (policy == TR_RECOMPUTE_FULL && p->pb.auto_policy && per_off &&
			    p->pb.host_by_policy[off] && p->pb.host_by_policy[off] <= pin_left) {
				const uint64_t base_off = dmn_plan_of(&p->pb, 0, off);
				offer(s, q, base_off, ngpus, true, true, pg, shares ? &sh : NULL);
				if (dmn_place_pick(pg, s->dev->n, s->dev->nvlink, 1, DMN_PLACE_NOW)) {
					const int more = selective_granted(s, q, p, base_off, per_off, pg,
									   shares ? &sh : NULL);
					if (more > sel_more) {
						full_more = sel_more;
						policy = off;
						sel_more = more;
						plan_bytes = base_off + (uint64_t)more * per_off;
					}
				}
			}
			offer(s, q, plan_bytes, ngpus, true, true, pg, shares ? &sh : NULL);
			mask = dmn_place_pick(pg, s->dev->n, s->dev->nvlink, (int)ngpus, DMN_PLACE_NOW);
		}
		if (mask) {
			td_err e = reserve_gpus(s, q, mask, pg, shares ? &sh : NULL, &rr, &eb);
			if (e != TD_OK && e != TD_EBUSY)
				td_warn("TD-SCHED-LEDGER", "job %lld: %s", (long long)q->id, eb.msg);
			else if (e == TD_EBUSY)
				td_debug("TD-SCHED-LEDGER", "job %lld: %s", (long long)q->id, eb.msg);
		}
	}
	const struct dmn_gpu *gpu = rr.ngpus ? &s->dev->gpu[rr.gpu[0].index] : NULL;
	bool cpu = false;
	if (!gpu) {
		if (!allow_cpu || (long)dmn_runners_count_cpu(s->run) >= s->cfg->cpu_slots) {
			enum place w = gpu_ok ? wait_for_gpus(s, q, plan_bytes, ngpus, allow_cpu,
							      !(p && p->pb.auto_policy) ? 0
							      : fo_never		? 2
										: 1,
							      shares ? &sh : NULL)
					      : PLACE_WAIT;
			rpc_jobspec_free(spec);
			return w;
		}
		cpu = true;
	}
	if (s->hold_job == q->id)
		hold_clear(s);

	/* Fixes the precision for where the job goes; simulated GPUs run on
	 * the CPU backend. */
	bool real_gpu = gpu && !gpu->fake;
	if (rpc_jobspec_resolve_precision(spec, real_gpu, &eb) != TD_OK) {
		release_gpus(s, &rr);
		rpc_jobspec_free(spec);
		char reason[1100];
		snprintf(reason, sizeof(reason), "%s", eb.msg);
		fail_job(s, q->id, reason);
		return PLACE_ENDED;
	}
	/* AUTO's choice goes into the spec the runner trains: the trainer's
	 * method would take NONE (AUTO without a bound). */
	char chose[480] = "";
	if (gpu && (policy >= 0 || shard >= 0) && !spec->memory) {
		spec->memory = malloc(sizeof(*spec->memory));
		if (!spec->memory) {
			release_gpus(s, &rr);
			rpc_jobspec_free(spec);
			return PLACE_WAIT; /* out of memory: the next pass */
		}
		traind__memory_spec__init(spec->memory);
	}
	if (gpu && policy >= 0) {
		spec->memory->has_recompute = true;
		spec->memory->recompute = (Traind__Recompute)(TRAIND__RECOMPUTE__RECOMPUTE_NONE + policy);
		/* the selective layers by_policy's plan took, said even where 0
		 * (else the job would choose its own under memory.max_bytes:
		 * train/method.c); none beside NONE and SELECTIVE, which the
		 * spec's check refuses them with */
		const bool full = tr_recompute_full((enum tr_recompute)policy);
		spec->memory->has_selective_layers = full;
		spec->memory->selective_layers = full ? (uint32_t)(p->pb.selective_layers + sel_more) : 0;
		char host[96] = ""; /* FULL_OFFLOAD's, in no lease */
		if (p->pb.host_by_policy[policy])
			snprintf(host, sizeof(host), " (and %.1f MiB of pinned host memory)",
				 (double)p->pb.host_by_policy[policy] / (1 << 20));
		char sel[64] = "";
		if (full && spec->memory->selective_layers > 0)
			snprintf(sel, sizeof(sel), " with its first %u layers selective",
				 spec->memory->selective_layers);
		char over[160] = ""; /* FULL_OFFLOAD taken over FULL for more selective layers */
		if (full_more >= 0)
			snprintf(over, sizeof(over),
				 "; full-offload rather than full, whose plan the GPU granted with %d "
				 "selective layers: each one more is a layer not recomputed",
				 p->pb.selective_layers + full_more);
		if (policy > 0)
			snprintf(chose, sizeof(chose),
				 "; memory.recompute AUTO chose %s%s: its plan of %.1f MiB fits%s, none's "
				 "%.1f MiB does not%s",
				 tr_recompute_name((enum tr_recompute)policy), sel,
				 (double)plan_bytes / (1 << 20), host,
				 (double)p->pb.by_policy[TR_RECOMPUTE_NONE] / (1 << 20), over);
		else
			snprintf(chose, sizeof(chose),
				 "; memory.recompute AUTO chose none: its plan of %.1f MiB fits",
				 (double)plan_bytes / (1 << 20));
	}
	if (gpu && shard >= 0 && hosts) {
		spec->memory->has_shard = true;
		spec->memory->shard = TRAIND__SHARD__SHARD_NONE;
		size_t len = strlen(chose);
		snprintf(chose + len, sizeof(chose) - len,
			 "; memory.shard: none (across daemons every rank keeps the whole optimizer "
			 "state)");
	} else if (gpu && shard >= 0) {
		spec->memory->has_shard = true;
		static const Traind__Shard wire[TR_SHARD_COUNT] = {
			TRAIND__SHARD__SHARD_NONE, TRAIND__SHARD__SHARD_OPTIMIZER,
			TRAIND__SHARD__SHARD_GRADIENTS, TRAIND__SHARD__SHARD_PARAMETERS};
		spec->memory->shard = wire[shard];
		size_t len = strlen(chose);
		len += (size_t)snprintf(chose + len, sizeof(chose) - len,
					"; memory.shard AUTO chose %s (plan %.1f MiB a GPU; unsharded %.1f MiB",
					tr_shard_name((enum tr_shard)shard), (double)plan_bytes / (1 << 20),
					(double)dmn_plan_of(&p->pb, TR_SHARD_NONE, policy) / (1 << 20));
		for (int sk = TR_SHARD_OPTIMIZER; sk < TR_SHARD_BUILT && len < sizeof(chose); sk++)
			len += (size_t)snprintf(chose + len, sizeof(chose) - len, ", %s sharded %.1f MiB",
						sk == TR_SHARD_OPTIMIZER ? "the optimizer"
						: sk == TR_SHARD_GRADIENTS ? "the gradients"
									   : "the parameters",
						(double)dmn_plan_of(&p->pb, sk, policy) / (1 << 20));
		if (len < sizeof(chose))
			snprintf(chose + len, sizeof(chose) - len, ")");
	}
	/* The job's device: "cpu", its GPU's uuid, or a gang's uuids joined by ','. */
	char device[DMN_MAX_GPUS * 97] = "cpu";
	if (!cpu) {
		size_t len = 0;
		for (int k = 0; k < rr.ngpus; k++)
			len += (size_t)snprintf(device + len, sizeof(device) - len, "%s%s", k ? "," : "",
						rr.gpu[k].uuid);
	}
	char reason[1400];
	uint64_t lease_bytes = rr.ngpus ? rr.gpu[0].bytes : 0;
	if (rr.ngpus > 1) {
		uint32_t mask = 0;
		size_t len = 0;
		char ids[DMN_MAX_GPUS * 24] = "";
		for (int k = 0; k < rr.ngpus; k++) {
			mask |= (uint32_t)1 << rr.gpu[k].index;
			len += (size_t)snprintf(ids + len, sizeof(ids) - len, "%s%lld", k ? ", " : "",
						(long long)rr.gpu[k].lease);
		}
		char gpus[64];
		int pairs = dmn_place_nvlink_pairs(mask, s->dev->nvlink, s->dev->n);
		int all = rr.ngpus * (rr.ngpus - 1) / 2;
		snprintf(reason, sizeof(reason),
			 "placed on a gang of %d %sGPUs, GPU %s (%s)%s: leases %s of %.1f MiB each", rr.ngpus,
			 gpu->fake ? "simulated " : "", dmn_devices_mask_str(mask, gpus, sizeof(gpus)),
			 device,
			 pairs == all ? ", all joined by NVLink"
			 : pairs	  ? ", partly joined by NVLink"
				  : "",
			 ids, (double)lease_bytes / (1 << 20));
	} else if (real_gpu) {
		snprintf(reason, sizeof(reason),
			 "placed on %s (GPU %d, %s): lease %lld of %.1f MiB (plan %.1f MiB + CUDA "
			 "backend %.1f MiB + context %ld MiB)",
			 device, gpu->index, gpu->name, (long long)rr.gpu[0].lease,
			 (double)lease_bytes / (1 << 20),
			 (double)(lease_bytes - (uint64_t)GPU_CUDA_FIXED_BYTES -
				  ((uint64_t)s->cfg->cuda_context_mib << 20)) / (1 << 20),
			 (double)GPU_CUDA_FIXED_BYTES / (1 << 20), s->cfg->cuda_context_mib);
	} else {
		snprintf(reason, sizeof(reason), "placed on %s%s", device,
			 gpu && gpu->fake ? " (simulated)" : "");
	}
	size_t rl = strlen(reason);
	if (rr.base_shared)
		rl += (size_t)snprintf(reason + rl, sizeof(reason) - rl,
				       "; its frozen base (%.1f MiB) is the GPU's shared block, %s, in "
				       "no lease of its own",
				       (double)rr.base_bytes / (1 << 20),
				       rr.base_attached ? "held with the jobs already on it"
							: "reserved with this lease");
	snprintf(reason + rl, sizeof(reason) - rl, "%s", chose);
	td_err e = st_job_transition(s->db, q->id, ST_QUEUED, ST_ADMITTED, reason, device, &eb);
	if (e != TD_OK) {
		/* Cancelled since the queue was read: nothing to do. */
		release_gpus(s, &rr);
		rpc_jobspec_free(spec);
		return PLACE_ENDED;
	}
	rr.job_id = q->id;
	rr.uid = q->uid;
	rr.gid = q->gid;
	rr.attempts = q->attempts;
	rr.spec = spec;
	rr.device = device;
	rr.on_gpu = gpu != NULL;
	rr.backend = real_gpu ? "cuda" : "cpu";
	rr.cuda_device = real_gpu ? gpu->ordinal : -1;
	rr.cache_dir = s->cfg->cache_dir;
	rr.base_digest = rr.base_shared ? p->pb.base_digest : NULL;
	rr.peer = hosts ? s->peer : NULL;
	/* the pinned host memory its plan holds (pinned_held sums them) */
	if (gpu && p)
		rr.host_bytes = policy >= 0 ? p->pb.host_by_policy[policy] : p->pb.host_bytes;
	if ((e = dmn_runners_start(s->run, &rr, &eb)) != TD_OK) {
		td_err_log("TD-SCHED-START", "job %lld: %s", (long long)q->id, eb.msg);
		struct td_errbuf eb2 = {{0}};
		st_job_transition(s->db, q->id, ST_ADMITTED, ST_QUEUED, "could not start a runner; queued again", NULL, &eb2);
		release_gpus(s, &rr);
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

/* Whether job id has ended, as the database says (a job that waited on
 * another fails with it inside state/, without a word to the scheduler). */
static bool ended_in_db(struct dmn_sched *s, int64_t id)
{
	struct st_job j;
	td_err e = st_job_get(s->db, id, &j, NULL);
	if (e == TD_ENOENT)
		return true;
	if (e != TD_OK)
		return false;
	bool ended = st_job_state_terminal(j.state);
	st_job_fini(&j);
	return ended;
}

/* Drops the claims and plans of jobs that ended without the scheduler
 * hearing of it (their dependency failed: state/ failed them in the same
 * transaction). Only when there are more of them than jobs that could need
 * them (the queue and the runners), so that a pass reads nothing more in
 * the usual case. */
static void sweep_ended(struct dmn_sched *s, const struct st_queued *q, size_t n)
{
	size_t live = n + dmn_runners_count(s->run);
	for (size_t i = 0; s->nplans > live && i < s->nplans;) {
		const struct plan *p = &s->plans[i];
		bool queued = false;
		for (size_t k = 0; k < n && !queued; k++)
			queued = q[k].id == p->job_id;
		if (!queued && p->state != PLAN_PENDING && ended_in_db(s, p->job_id))
			plan_remove(s, p->job_id); /* moves the last plan here */
		else
			i++;
	}
	size_t claims = 0;
	for (size_t i = 0; i < s->nclaims; i++)
		claims += s->claims[i].key > 0;
	for (size_t i = 0; claims > live && i < s->nclaims;) {
		int64_t key = s->claims[i].key;
		bool queued = false;
		for (size_t k = 0; k < n && !queued; k++)
			queued = q[k].id == key;
		if (key > 0 && !queued && ended_in_db(s, key)) {
			claim_remove(s, key);
			claims--;
		} else {
			i++;
		}
	}
}

/* ------------------------------------------------------------------------ */
/* Why a job waits (issue 14): held, dependencies, a per-user limit, the
 * quota — decided in the pass before placement — or what placement left it
 * waiting for (explain_wait). Rebuilt by each pass that reads the queue. */

static void why_set(struct dmn_sched *s, int64_t id, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
static void why_set(struct dmn_sched *s, int64_t id, const char *fmt, ...)
{
	struct why *w = NULL;
	for (size_t i = 0; i < s->nwhy && !w; i++)
		if (s->why[i].job_id == id)
			w = &s->why[i];
	if (!w) {
		if (s->nwhy == s->capwhy) {
			size_t cap = s->capwhy ? 2 * s->capwhy : 64;
			struct why *a = realloc(s->why, cap * sizeof(*a));
			if (!a)
				return; /* out of memory: the reason is only information */
			s->why = a;
			s->capwhy = cap;
		}
		w = &s->why[s->nwhy++];
		w->job_id = id;
	}
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(w->text, sizeof(w->text), fmt, ap);
	va_end(ap);
}

bool dmn_sched_waiting(const struct dmn_sched *s, int64_t job_id, char *buf, size_t cap)
{
	for (size_t i = 0; i < s->nwhy; i++) {
		if (s->why[i].job_id == job_id) {
			snprintf(buf, cap, "%s", s->why[i].text);
			return true;
		}
	}
	if (!capacity(s))
		snprintf(buf, cap, "every CPU slot is busy (cpu_slots = %ld) and the host has no GPU",
			 s->cfg->cpu_slots);
	else
		snprintf(buf, cap, "not looked at yet: the scheduler's next pass decides");
	return false;
}

/* After try_place left q waiting: what for, from the decisions it made. */
static void explain_wait(struct dmn_sched *s, const struct st_queued *q)
{
	Traind__JobSpec *spec = NULL;
	if (rpc_jobspec_decode(&spec, q->spec, q->spec_len, NULL) != TD_OK ||
	    rpc_jobspec_apply_defaults(spec, NULL) != TD_OK) {
		rpc_jobspec_free(spec);
		return;
	}
	Traind__Device want = spec->resources->device;
	unsigned ngpus = spec->resources->gpus ? spec->resources->gpus : 1;
	bool allow_cpu = ngpus == 1 && (want == TRAIND__DEVICE__DEVICE_CPU || spec->resources->allow_cpu);
	bool gpu_ok = want != TRAIND__DEVICE__DEVICE_CPU && s->dev->n > 0;
	rpc_jobspec_free(spec);
	const struct plan *p = plan_find(s, q->id);
	char gpu[160] = "", cpu[96] = "";
	if (gpu_ok && (!p || p->state != PLAN_DONE)) {
		why_set(s, q->id, "its memory plan is being computed");
		return;
	}
	uint64_t pin_max, pin_held;
	const uint64_t pin_short = gpu_ok ? pinned_short(s, p, &pin_max, &pin_held) : 0;
	char pins[200] = ""; /* AUTO: full-offload's pinned bytes held by others */
	const uint64_t hfo = gpu_ok && p->pb.auto_policy ? p->pb.host_by_policy[TR_RECOMPUTE_FULL_OFFLOAD] : 0;
	if (hfo) {
		const uint64_t mx = pinned_max(s), held = pinned_held(s);
		if (hfo <= mx && hfo > (mx > held ? mx - held : 0))
			snprintf(pins, sizeof(pins),
				 "; full-offload's plan pins %.1f MiB of host memory and the running jobs "
				 "hold %.1f of the %.1f MiB that pinned_host_max_mib allows",
				 (double)hfo / (1 << 20), (double)held / (1 << 20), (double)mx / (1 << 20));
	}
	if (pin_short) {
		why_set(s, q->id,
			"pinned host memory: its plan (memory.recompute full-offload) pins %.1f MiB and "
			"the running jobs hold %.1f of the %.1f MiB that pinned_host_max_mib allows",
			(double)p->pb.host_bytes / (1 << 20), (double)pin_held / (1 << 20),
			(double)pin_max / (1 << 20));
		return;
	}
	if (gpu_ok) {
		/* AUTO waits with its smallest plan, the last policy's (FULL_OFFLOAD) */
		uint64_t bytes = dmn_plan_smallest(&p->pb);
		char set[64];
		if (s->hold_job == q->id)
			snprintf(gpu, sizeof(gpu),
				 "GPU %s held for it until they drain (%u GPU(s), plan %.1f MiB each)",
				 dmn_devices_mask_str(s->hold_mask, set, sizeof(set)), ngpus,
				 (double)bytes / (1 << 20));
		else if (s->hold_job && q->priority <= s->hold_prio)
			snprintf(gpu, sizeof(gpu),
				 "no GPU has room for %u x %.1f MiB outside GPU %s, held for job %lld (a "
				 "job waiting for GPUs before it)",
				 ngpus, (double)bytes / (1 << 20),
				 dmn_devices_mask_str(s->hold_mask, set, sizeof(set)), (long long)s->hold_job);
		else
			snprintf(gpu, sizeof(gpu), "no GPU has room for %u x %.1f MiB now", ngpus,
				 (double)bytes / (1 << 20));
	}
	if (allow_cpu)
		snprintf(cpu, sizeof(cpu), "%severy CPU slot is busy (cpu_slots = %ld)",
			 gpu_ok ? "; " : "", s->cfg->cpu_slots);
	why_set(s, q->id, "%s%s%s", gpu, pins, cpu);
}

/* ------------------------------------------------------------------------ */
/* Preemption (issue 14; scheduler.h says the contract). */


/* The order victims are taken in: lowest priority first, then the newest. */
static int cand_cmp(const void *a, const void *b)
{
	const struct cand *x = a, *y = b;
	if (x->priority != y->priority)
		return x->priority < y->priority ? -1 : 1;
	if (x->start_ms != y->start_ms)
		return x->start_ms > y->start_ms ? -1 : 1;
	return x->run.job_id > y->run.job_id ? -1 : x->run.job_id < y->run.job_id;
}

static const char *user_name(uid_t uid, char *buf, size_t cap)
{
	struct passwd pw, *pwp = NULL;
	char tmp[1024];
	if (getpwuid_r(uid, &pw, tmp, sizeof(tmp), &pwp) == 0 && pwp)
		snprintf(buf, cap, "%s", pw.pw_name);
	else
		snprintf(buf, cap, "uid %u", (unsigned)uid);
	return buf;
}

static bool preempting_by(const struct dmn_sched *s, int64_t by, int64_t *victim, size_t *n)
{
	*n = 0;
	for (size_t i = 0; i < s->npreempting; i++)
		if (s->preempting[i].by == by && (*n)++ == 0)
			*victim = s->preempting[i].victim;
	return *n > 0;
}

/* The running jobs as this pass found them (read once a pass, at the first
 * job that may preempt), in cand_cmp's order. */
static void running_read(struct dmn_sched *s)
{
	if (s->nrunning != SIZE_MAX)
		return;
	struct dmn_run_info run[PREEMPT_MAX];
	size_t nrun = dmn_runners_list(s->run, run, PREEMPT_MAX), n = 0;
	if (nrun > PREEMPT_MAX)
		nrun = PREEMPT_MAX; /* the others are not candidates this pass */
	for (size_t i = 0; i < nrun; i++) {
		struct st_job j;
		if (run[i].stopping || st_job_get(s->db, run[i].job_id, &j, NULL) != TD_OK)
			continue;
		struct cand *c = &s->running[n];
		*c = (struct cand){
			.run = run[i],
			.priority = j.priority,
			.start_ms = j.state == ST_RUNNING && j.start_ms ? j.start_ms : INT64_MAX,
			.cancelling = j.cancel_requested || !(ST_MASK(j.state) & ST_MASK_ACTIVE),
		};
		st_job_fini(&j);
		if (st_job_preempted_ms(s->db, c->run.job_id, &c->preempted_ms, NULL) != TD_OK)
			c->preempted_ms = 0;
		n++;
	}
	qsort(s->running, n, sizeof(*s->running), cand_cmp);
	s->nrunning = n;
}

/* The running jobs q may preempt under the policy, in cand_cmp's order.
 * *graced gets one left out for preempt_grace_s only (0: none). */
static size_t victims_for(struct dmn_sched *s, const struct st_queued *q, struct cand *c,
			  int64_t *graced)
{
	running_read(s);
	int64_t now = st_now_ms();
	size_t n = 0;
	*graced = 0;
	for (size_t i = 0; i < s->nrunning; i++) {
		const struct cand *r = &s->running[i];
		if (r->cancelling || r->priority >= q->priority ||
		    (s->cfg->preempt == DMN_PREEMPT_USER && r->run.uid != q->uid))
			continue;
		if (r->preempted_ms && now - r->preempted_ms < s->cfg->preempt_grace_s * 1000L) {
			*graced = r->run.job_id;
			continue;
		}
		c[n++] = *r;
	}
	return n;
}

/* The fewest of c (in its order) whose leases make room for q's need[i] on
 * every GPU i of mask (dmn_place_victims); pick[] gets their indices. */
static size_t pick_gpu_victims(const struct dmn_sched *s, const struct cand *c, size_t nc,
			       uint32_t mask, const int64_t *need, const int64_t *base,
			       size_t *pick)
{
	struct dmn_place_victim v[PREEMPT_MAX];
	for (size_t k = 0; k < nc && k < PREEMPT_MAX; k++) {
		v[k].ngpus = c[k].run.ngpus;
		for (int g = 0; g < c[k].run.ngpus; g++) {
			v[k].gpu[g] = c[k].run.gpu[g].index;
			v[k].bytes[g] = c[k].run.gpu[g].bytes;
		}
	}
	return dmn_place_victims(v, nc < PREEMPT_MAX ? nc : PREEMPT_MAX, s->dev->n, mask, need, base,
				 pick);
}

/* Whether victim set a (na of c) is cheaper than b: its highest priority
 * lower, then fewer jobs. */
static bool cheaper(const struct cand *c, const size_t *a, size_t na, const size_t *b, size_t nb)
{
	int32_t pa = INT32_MIN, pb = INT32_MIN;
	for (size_t k = 0; k < na; k++)
		pa = c[a[k]].priority > pa ? c[a[k]].priority : pa;
	for (size_t k = 0; k < nb; k++)
		pb = c[b[k]].priority > pb ? c[b[k]].priority : pb;
	return pa != pb ? pa < pb : na < nb;
}

/* The victims that make room for q on GPUs (the set into *mask), or 0. */
static size_t gpu_victims(struct dmn_sched *s, const struct st_queued *q, uint64_t plan_bytes,
			  unsigned want, const struct cand *c, size_t nc, size_t *pick,
			  uint32_t *mask)
{
	struct dmn_place_gpu pg[DMN_MAX_GPUS];
	offer(s, q, plan_bytes, want, true, true, pg, NULL);
	int64_t need[DMN_MAX_GPUS], base[DMN_MAX_GPUS], freeable[DMN_MAX_GPUS] = {0};
	for (int i = 0; i < s->dev->n; i++) {
		need[i] = (int64_t)pg[i].need;
		/* What GPU i grants now, signed: its share less its leases, at
		 * most its free memory; a victim's lease adds to both. */
		int64_t room = s->reserved[i] == UINT64_MAX
				       ? INT64_MIN / 4
				       : (int64_t)pg[i].share - (int64_t)s->reserved[i];
		int64_t fr = s->free_now[i] > (uint64_t)INT64_MAX / 4 ? INT64_MAX / 4
								      : (int64_t)s->free_now[i];
		base[i] = room < fr ? room : fr;
	}
	for (size_t k = 0; k < nc; k++)
		for (int g = 0; g < c[k].run.ngpus; g++)
			freeable[c[k].run.gpu[g].index] += (int64_t)c[k].run.gpu[g].bytes;
	/* Where it would fit were every candidate gone. */
	struct dmn_place_gpu after[DMN_MAX_GPUS];
	for (int i = 0; i < s->dev->n; i++) {
		after[i] = pg[i];
		int64_t a = base[i] + freeable[i];
		after[i].avail = a < 0 ? 0 : (uint64_t)a;
	}
	size_t np = 0;
	if (want == 1) {
		/* One GPU: the one whose victims are cheapest. */
		size_t best[PREEMPT_MAX], nbest = 0;
		for (int i = 0; i < s->dev->n; i++) {
			if (!after[i].usable || after[i].need > after[i].avail)
				continue;
			size_t got[PREEMPT_MAX];
			size_t ng = pick_gpu_victims(s, c, nc, 1u << i, need, base, got);
			if (ng && (!nbest || cheaper(c, got, ng, best, nbest))) {
				memcpy(best, got, ng * sizeof(*got));
				nbest = ng;
				*mask = 1u << i;
			}
		}
		memcpy(pick, best, nbest * sizeof(*pick));
		np = nbest;
	} else {
		uint32_t m = dmn_place_pick(after, s->dev->n, s->dev->nvlink, (int)want, DMN_PLACE_NOW);
		if (m && (np = pick_gpu_victims(s, c, nc, m, need, base, pick)))
			*mask = m;
	}
	return np;
}

/* q was left waiting for room: under the preempt setting, stop the fewest
 * running jobs of a lower priority that make room for it (scheduler.h).
 * true if it preempted. */
static bool maybe_preempt(struct dmn_sched *s, const struct st_queued *q)
{
	if (s->cfg->preempt == DMN_PREEMPT_OFF || s->npreempting)
		return false;
	Traind__JobSpec *spec = NULL;
	if (rpc_jobspec_decode(&spec, q->spec, q->spec_len, NULL) != TD_OK ||
	    rpc_jobspec_apply_defaults(spec, NULL) != TD_OK) {
		rpc_jobspec_free(spec);
		return false;
	}
	Traind__Device dev = spec->resources->device;
	unsigned want = spec->resources->gpus ? spec->resources->gpus : 1;
	s->cur_nccl = want > 1 || spec->resources->n_hosts > 0;
	bool allow_cpu = want == 1 && !spec->resources->n_hosts &&
			 (dev == TRAIND__DEVICE__DEVICE_CPU || spec->resources->allow_cpu);
	bool gpu_ok = dev != TRAIND__DEVICE__DEVICE_CPU && s->dev->n > 0;
	rpc_jobspec_free(spec);
	/* waiting for pinned host memory, not GPU memory: no GPU job's stop
	 * gives it that */
	uint64_t pin_max, pin_held;
	if (gpu_ok && pinned_short(s, plan_find(s, q->id), &pin_max, &pin_held))
		return false;

	struct cand c[PREEMPT_MAX];
	int64_t graced = 0;
	size_t nc = victims_for(s, q, c, &graced);
	size_t pick[PREEMPT_MAX], np = 0;
	uint32_t mask = 0;
	const struct plan *p = plan_find(s, q->id);
	if (gpu_ok && p && p->state == PLAN_DONE) {
		/* The smallest plan (AUTO's last policy): the fewest victims. */
		uint64_t bytes = p->pb.auto_policy ? p->pb.by_policy[TR_RECOMPUTE_COUNT - 1] : p->pb.bytes;
		struct cand g[PREEMPT_MAX];
		size_t ng = 0, map[PREEMPT_MAX];
		for (size_t k = 0; k < nc; k++)
			if (c[k].run.on_gpu)
				map[ng] = k, g[ng++] = c[k];
		size_t gp[PREEMPT_MAX];
		np = gpu_victims(s, q, bytes, want, g, ng, gp, &mask);
		for (size_t k = 0; k < np; k++)
			pick[k] = map[gp[k]];
	}
	long busy = (long)dmn_runners_count_cpu(s->run);
	if (!np && allow_cpu && s->cfg->cpu_slots > 0 && busy >= s->cfg->cpu_slots) {
		/* A CPU slot: the first victims on CPU slots, as many as free one. */
		size_t need = (size_t)(busy - s->cfg->cpu_slots + 1);
		for (size_t k = 0; k < nc && np < need; k++)
			if (!c[k].run.on_gpu)
				pick[np++] = k;
		if (np < need)
			np = 0;
	}
	if (!np) {
		if (graced) {
			/* Say so: the job would go first but for the grace. */
			char why[240] = "";
			dmn_sched_waiting(s, q->id, why, sizeof(why));
			why_set(s, q->id, "job %lld was preempted less than preempt_grace_s = %ld s ago and "
				"is not preempted again yet; %s", (long long)graced, s->cfg->preempt_grace_s, why);
		}
		return false;
	}
	char me[64], them[64], where[64] = "a CPU slot";
	user_name(q->uid, me, sizeof(me));
	if (mask)
		snprintf(where, sizeof(where), "GPU %s", dmn_devices_mask_str(mask, them, sizeof(them)));
	size_t done = 0;
	for (size_t k = 0; k < np; k++) {
		const struct cand *v = &c[pick[k]];
		char vmsg[512], bmsg[512], why[256];
		user_name(v->run.uid, them, sizeof(them));
		snprintf(why, sizeof(why), "preempted by job %lld (user %s, priority %d)",
			 (long long)q->id, me, q->priority);
		snprintf(vmsg, sizeof(vmsg), "%s, which needs %s: checkpoints at its next step, goes "
			 "back to the queue and resumes from that checkpoint (preempt = %s)",
			 why, where, s->cfg->preempt == DMN_PREEMPT_USER ? "user" : "priority");
		snprintf(bmsg, sizeof(bmsg), "preempted job %lld (user %s, priority %d) to make room on %s",
			 (long long)v->run.job_id, them, v->priority, where);
		struct td_errbuf eb = {{0}};
		if (st_job_preempt(s->db, v->run.job_id, q->id, vmsg, bmsg, &eb) != TD_OK) {
			td_warn("TD-SCHED-PREEMPT", "job %lld: %s", (long long)v->run.job_id, eb.msg);
			continue; /* it ended meanwhile: its room is free anyway */
		}
		if (!dmn_runners_preempt(s->run, v->run.job_id, why))
			continue;
		s->preempting[s->npreempting++] = (struct preemption){v->run.job_id, q->id};
		done++;
		td_info("TD-SCHED-PREEMPT", "job %lld (uid %u, priority %d) preempts job %lld (uid %u, "
			"priority %d) for %s", (long long)q->id, (unsigned)q->uid, q->priority,
			(long long)v->run.job_id, (unsigned)v->run.uid, v->priority, where);
	}
	/* The room goes to q: hold the GPUs for it, as wait_for_gpus would. */
	if (done && mask && (!s->hold_job || s->hold_job == q->id || q->priority > s->hold_prio)) {
		s->hold_job = q->id;
		s->hold_prio = q->priority;
		s->hold_mask = mask;
	}
	return done > 0;
}

/* q waits for the jobs it preempted: say so. */
static void explain_preempting(struct dmn_sched *s, const struct st_queued *q)
{
	int64_t v = 0;
	size_t n = 0;
	if (preempting_by(s, q->id, &v, &n))
		why_set(s, q->id, "preempting job %lld%s: %s at %s next step, then this job starts there",
			(long long)v, n > 1 ? " and others" : "", n > 1 ? "they checkpoint" : "it checkpoints",
			n > 1 ? "their" : "its");
}

/* Job across daemons: not placed again for ms (its requeue said why). */
static void defer_add(struct dmn_sched *s, int64_t job_id, int64_t ms, const char *why)
{
	int64_t until = st_now_ms() + ms;
	size_t k = 0;
	while (k < s->ndefer && s->defer[k].job_id != job_id)
		k++;
	if (k == s->ndefer) {
		if (s->ndefer == DEFER_MAX)
			return; /* placed again at once: no harm but the retries */
		s->ndefer++;
	}
	s->defer[k] = (struct defer){.job_id = job_id, .until_ms = until};
	snprintf(s->defer[k].why, sizeof(s->defer[k].why), "%s", why);
	why_set(s, job_id, "%s", why);
}

/* The deferral job waits out (expired ones are dropped), or NULL. */
static const struct defer *deferred(struct dmn_sched *s, int64_t job_id)
{
	int64_t now = st_now_ms();
	const struct defer *found = NULL;
	for (size_t k = 0; k < s->ndefer;) {
		if (s->defer[k].until_ms <= now) {
			s->defer[k] = s->defer[--s->ndefer];
			continue;
		}
		if (s->defer[k].job_id == job_id)
			found = &s->defer[k];
		k++;
	}
	return found;
}

static void pass(struct dmn_sched *s, bool from_tick)
{
	if (s->stopping)
		return;
	/* Nothing could start: do not read every queued spec (a long queue on
	 * a full host would cost each submit that much). */
	bool preempt = s->cfg->preempt != DMN_PREEMPT_OFF;
	if (!capacity(s) && (!preempt || s->npreempting)) {
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
	s->nwhy = 0;
	s->nrunning = SIZE_MAX;
	sweep_ended(s, q, n);
	if (s->dev->n)
		snapshot(s);
	s->pass_blocked = false;
	/* Each user's usage within usage_window_hours: fair share's second key
	 * and the quota. */
	int64_t now = st_now_ms();
	struct st_usage_row *use = NULL;
	size_t nuse = 0;
	if (st_usage_list(s->db, now - s->cfg->usage_window_hours * 3600000L, false, true, 0, &use,
			  &nuse, &eb) != TD_OK)
		td_warn("TD-SCHED-USAGE", "cannot read the usage: %s", eb.msg);
	/* The held GPUs' job left the queue (placed, cancelled, failed). */
	bool holder_queued = false;
	for (size_t i = 0; i < n && s->hold_job; i++)
		holder_queued = holder_queued || q[i].id == s->hold_job;
	if (s->hold_job && !holder_queued)
		hold_clear(s);
	enum { MAXU = 256 };
	struct user_count uc[MAXU];
	size_t nuc = 0;
	bool *done = calloc(n ? n : 1, sizeof(bool));
	int64_t *used = calloc(n ? n : 1, sizeof(int64_t));
	if (!done || !used) {
		free(done);
		free(used);
		free(use);
		st_queue_free(q, n);
		return;
	}
	/* Not admitted, whatever the GPUs: held, waiting on a dependency, or
	 * its user at the quota. */
	const double quota_ms = s->cfg->quota_gpu_hours * 3600e3;
	for (size_t i = 0; i < n; i++) {
		int64_t gpu_ms = 0;
		const struct defer *df;
		for (size_t k = 0; k < nuse; k++) {
			if (use[k].uid == q[i].uid) {
				used[i] = use[k].u.gpu_ms + use[k].u.cpu_ms;
				gpu_ms = use[k].u.gpu_ms;
			}
		}
		if (q[i].held)
			why_set(s, q[i].id, "held (trainctl release %lld starts it)", (long long)q[i].id);
		else if (q[i].deps_pending)
			why_set(s, q[i].id, "waits for job %lld%s to succeed (submit --after)",
				(long long)q[i].dep_waiting,
				q[i].deps_pending > 1 ? " and others" : "");
		else if ((df = deferred(s, q[i].id)) != NULL)
			why_set(s, q[i].id, "%s", df->why); /* its requeue's reason */
		else if (quota_ms > 0 && (double)gpu_ms >= quota_ms)
			why_set(s, q[i].id,
				"quota_gpu_hours: uid %u used %.2f of its %.2f GPU-hours in the last %ld "
				"hours; it starts as the window slides",
				(unsigned)q[i].uid, (double)gpu_ms / 3600e3, s->cfg->quota_gpu_hours,
				s->cfg->usage_window_hours);
		else
			continue;
		done[i] = true;
		if (s->hold_job == q[i].id)
			hold_clear(s);
	}
	free(use);
	for (;;) {
		if (!capacity(s) && (!preempt || s->npreempting))
			break; /* nothing else could start, nor make room by preempting */
		/* The best candidate left, by (priority, running work, usage in
		 * the window, age). */
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
			      (active == best_active &&
			       (used[i] < used[best] ||
				(used[i] == used[best] &&
				 (q[i].submit_ms < q[best].submit_ms ||
				  (q[i].submit_ms == q[best].submit_ms && q[i].id < q[best].id)))))))) {
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
		    (long)(c->user_active + (st ? *st : 0)) >= s->cfg->max_running_per_user) {
			/* Waiting for its user's own jobs, not for GPUs: it holds none. */
			if (s->hold_job == c->id)
				hold_clear(s);
			why_set(s, c->id, "max_running_per_user: uid %u has %u running (limit %ld)",
				(unsigned)c->uid, c->user_active + (st ? *st : 0),
				s->cfg->max_running_per_user);
			continue;
		}
		enum place pl = try_place(s, c);
		if (pl == PLACE_STARTED && st)
			(*st)++;
		else if (pl == PLACE_WAIT) {
			explain_wait(s, c);
			if (preempt) {
				maybe_preempt(s, c);
				explain_preempting(s, c);
			}
		}
	}
	/* user_active in the snapshot already counts jobs started before this
	 * pass; `started` counts this pass's. */
	for (size_t i = 0; i < n; i++)
		if (!done[i])
			why_set(s, q[i].id, "every CPU slot is busy (cpu_slots = %ld)%s", s->cfg->cpu_slots,
				s->dev->n ? "" : " and the host has no GPU");
	free(done);
	free(used);
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

static void runner_done(void *ctx, int64_t job_id, enum st_job_state final, bool on_gpu,
			const char *requeue_reason, int64_t retry_ms)
{
	struct dmn_sched *s = ctx;
	if (final == ST_QUEUED && retry_ms > 0)
		defer_add(s, job_id, retry_ms, requeue_reason);
	for (size_t i = 0; i < s->npreempting;) {
		if (s->preempting[i].victim == job_id)
			s->preempting[i] = s->preempting[--s->npreempting];
		else
			i++;
	}
	struct td_errbuf eb = {{0}};
	struct st_job j;
	bool requeue = final == ST_QUEUED; /* daemon/runner.h: after a device loss */
	if (requeue)
		final = ST_INTERRUPTED;
	/* The runner records its end itself; if it could not (no database
	 * handle), do it here so that no job is left looking active. */
	if (st_job_get(s->db, job_id, &j, &eb) == TD_OK) {
		if (requeue && j.state == ST_INTERRUPTED) {
			if (st_job_transition(s->db, job_id, ST_INTERRUPTED, ST_QUEUED, requeue_reason,
					      NULL, &eb) == TD_OK)
				j.state = ST_QUEUED;
			else
				td_err_log("TD-SCHED-STATE", "job %lld: cannot requeue it: %s; it is "
					   "requeued at the next start", (long long)job_id, eb.msg);
		}
		if (ST_MASK(j.state) & ST_MASK_ACTIVE) {
			if (st_job_transition(s->db, job_id, ST_ANY_STATE, final,
					      "the runner ended without recording its state", NULL, &eb) == TD_OK) {
				j.state = final;
			} else {
				td_err_log("TD-SCHED-STATE", "job %lld: %s", (long long)job_id, eb.msg);
				/* never left looking active (it would hold its place, and
				 * be run again at each start): failed, saying why */
				char why[sizeof(eb.msg) + 96];
				snprintf(why, sizeof(why), "the runner ended as %s, which %s cannot move to: %s",
					 st_job_state_name(final), st_job_state_name(j.state), eb.msg);
				if (st_job_transition(s->db, job_id, ST_ANY_STATE, ST_FAILED, why, NULL, &eb) ==
				    TD_OK)
					j.state = ST_FAILED;
				else
					td_err_log("TD-SCHED-STATE", "job %lld: %s", (long long)job_id, eb.msg);
			}
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
	s->running = calloc(PREEMPT_MAX, sizeof(*s->running));
	if (!s->running) {
		free(s);
		return td_fail(eb, TD_ENOMEM, "scheduler: out of memory");
	}
	s->loop = d->loop;
	s->db = d->db;
	s->cfg = d->cfg;
	s->dev = d->dev;
	s->peer = d->peer;
	td_err e = dmn_runners_new(&s->run, d->loop, d->db_path, runner_done, s, eb);
	if (e != TD_OK) {
		free(s->running);
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
	if (s->hold_job == job_id)
		hold_clear(s);
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
	free(s->why);
	free(s->running);
	free(s);
	return TD_OK;
}
