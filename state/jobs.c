/* Jobs, their state machine, events and metrics: the tables behind contract 6.
 * Every change is one BEGIN IMMEDIATE transaction with its event written in
 * the same transaction, so the log never disagrees with the state. Not the
 * scheduler: ordering policy and permissions are the daemon's. */
#include "state/internal.h"

#include "proto/log.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define ST_EVENT_MAX 4096

static const char *const state_names[ST_JOB_STATE_COUNT] = {
	[ST_QUEUED] = "QUEUED",       [ST_ADMITTED] = "ADMITTED",   [ST_PREPARING] = "PREPARING",
	[ST_RUNNING] = "RUNNING",     [ST_SUCCEEDED] = "SUCCEEDED", [ST_FAILED] = "FAILED",
	[ST_CANCELLED] = "CANCELLED", [ST_INTERRUPTED] = "INTERRUPTED",
};

/* legal[from] = the set of states `from` may move to (state.h's table). */
static const unsigned legal[ST_JOB_STATE_COUNT] = {
	[ST_QUEUED] = ST_MASK(ST_ADMITTED) | ST_MASK(ST_FAILED) | ST_MASK(ST_CANCELLED),
	[ST_ADMITTED] = ST_MASK(ST_PREPARING) | ST_MASK(ST_QUEUED) | ST_MASK(ST_FAILED) |
			ST_MASK(ST_CANCELLED) | ST_MASK(ST_INTERRUPTED),
	[ST_PREPARING] = ST_MASK(ST_RUNNING) | ST_MASK(ST_FAILED) | ST_MASK(ST_CANCELLED) |
			 ST_MASK(ST_INTERRUPTED),
	[ST_RUNNING] = ST_MASK(ST_SUCCEEDED) | ST_MASK(ST_FAILED) | ST_MASK(ST_CANCELLED) |
		       ST_MASK(ST_INTERRUPTED),
	[ST_INTERRUPTED] = ST_MASK(ST_QUEUED) | ST_MASK(ST_FAILED) | ST_MASK(ST_CANCELLED),
};

const char *st_job_state_name(enum st_job_state s)
{
	return (unsigned)s < ST_JOB_STATE_COUNT ? state_names[s] : "?";
}

bool st_job_state_parse(const char *name, enum st_job_state *out)
{
	for (int i = 0; name && i < ST_JOB_STATE_COUNT; i++)
		if (strcasecmp(name, state_names[i]) == 0) {
			*out = (enum st_job_state)i;
			return true;
		}
	return false;
}

bool st_job_transition_ok(enum st_job_state from, enum st_job_state to)
{
	if ((unsigned)from >= ST_JOB_STATE_COUNT || (unsigned)to >= ST_JOB_STATE_COUNT)
		return false;
	return (legal[from] & ST_MASK(to)) != 0;
}

/* "state IN ('QUEUED','RUNNING')" for mask (names are our constants, never input). */
static void state_in_sql(unsigned mask, char *buf, size_t size)
{
	size_t n = (size_t)snprintf(buf, size, "state IN (");
	bool first = true;
	for (int i = 0; i < ST_JOB_STATE_COUNT; i++) {
		if (!(mask & ST_MASK(i)))
			continue;
		n += (size_t)snprintf(buf + n, size - n, "%s'%s'", first ? "" : ",", state_names[i]);
		first = false;
	}
	snprintf(buf + n, size - n, ")");
	if (first)
		snprintf(buf, size, "1");
}

/* ------------------------------------------------------------------------ */
/* Records */

void st_job_fini(struct st_job *j)
{
	if (!j)
		return;
	free(j->name);
	free(j->reason);
	free(j->device);
	free(j->ckpt_path);
	free(j->spec);
	memset(j, 0, sizeof(*j));
}

void st_jobs_free(struct st_job *jobs, size_t n)
{
	if (!jobs)
		return;
	for (size_t i = 0; i < n; i++)
		st_job_fini(&jobs[i]);
	free(jobs);
}

#define JOB_COLS                                                                             \
	"id, name, uid, gid, state, reason, priority, submit_ms, start_ms, end_ms, updated_ms, " \
	"device, ckpt_path, ckpt_step, attempts, cancel_requested, held"
#define JOB_COL_SPEC 17

/* Fills j from a row selected with JOB_COLS (then optionally spec at JOB_COL_SPEC). */
static td_err job_from_row(struct st_db *db, sqlite3_stmt *st, bool with_spec, struct st_job *j,
			   struct td_errbuf *eb)
{
	memset(j, 0, sizeof(*j));
	j->id = sqlite3_column_int64(st, 0);
	j->name = st__col_strdup(st, 1);
	j->uid = (uid_t)sqlite3_column_int64(st, 2);
	j->gid = (gid_t)sqlite3_column_int64(st, 3);
	const char *sname = (const char *)sqlite3_column_text(st, 4);
	if (!st_job_state_parse(sname, &j->state)) {
		st_job_fini(j);
		return td_fail(eb, TD_EFORMAT, "%s: job %lld has an unknown state \"%s\"", db->path,
			       (long long)sqlite3_column_int64(st, 0), sname ? sname : "");
	}
	j->reason = st__col_strdup(st, 5);
	j->priority = sqlite3_column_int(st, 6);
	j->submit_ms = sqlite3_column_int64(st, 7);
	j->start_ms = sqlite3_column_int64(st, 8);
	j->end_ms = sqlite3_column_int64(st, 9);
	j->updated_ms = sqlite3_column_int64(st, 10);
	j->device = st__col_strdup(st, 11);
	j->ckpt_path = st__col_strdup(st, 12);
	j->ckpt_step = sqlite3_column_int64(st, 13);
	j->attempts = sqlite3_column_int(st, 14);
	j->cancel_requested = sqlite3_column_int(st, 15) != 0;
	j->held = sqlite3_column_int(st, 16) != 0;
	bool oom = !j->name || !j->reason || !j->device || !j->ckpt_path;
	if (with_spec && !oom) {
		int len = sqlite3_column_bytes(st, JOB_COL_SPEC);
		const void *b = sqlite3_column_blob(st, JOB_COL_SPEC);
		j->spec = malloc(len > 0 ? (size_t)len : 1);
		oom = !j->spec;
		if (!oom && len > 0)
			memcpy(j->spec, b, (size_t)len);
		j->spec_len = (size_t)(len > 0 ? len : 0);
	}
	if (oom) {
		st_job_fini(j);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory reading job", db->path);
	}
	return TD_OK;
}

/* A row of JOB_COLS, with the spec where the query selected it. */
static td_err job_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	return job_from_row(db, st, sqlite3_column_count(st) > JOB_COL_SPEC, item, eb);
}

static void jobs_free(void *jobs, size_t n)
{
	st_jobs_free(jobs, n);
}

static const struct st__rowset job_rows = {
	.size = sizeof(struct st_job), .fill = job_row, .free = jobs_free};

/* Reads the state of job inside the caller's transaction; TD_ENOENT if none. */
static td_err job_state_locked(struct st_db *db, int64_t id, enum st_job_state *state,
			       bool *cancel_requested, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "SELECT state, cancel_requested FROM jobs WHERE id = ?", &st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, id);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW) {
		const char *s = (const char *)sqlite3_column_text(st, 0);
		if (!st_job_state_parse(s, state))
			e = td_fail(eb, TD_EFORMAT, "%s: job %lld has an unknown state \"%s\"",
				    db->path, (long long)id, s ? s : "");
		if (cancel_requested)
			*cancel_requested = sqlite3_column_int(st, 1) != 0;
	} else if (rc == SQLITE_DONE) {
		e = td_fail(eb, TD_ENOENT, "job %lld does not exist", (long long)id);
	} else {
		e = ST_SQLFAIL(db, rc, eb, "read job %lld", (long long)id);
	}
	sqlite3_finalize(st);
	return e;
}

td_err st__job_exists_locked(struct st_db *db, int64_t job, bool *exists, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "SELECT 1 FROM jobs WHERE id = ?", &st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, job);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW || rc == SQLITE_DONE)
		*exists = rc == SQLITE_ROW;
	else
		e = ST_SQLFAIL(db, rc, eb, "read job %lld", (long long)job);
	sqlite3_finalize(st);
	return e;
}

td_err st__event_insert_locked(struct st_db *db, int64_t job, int64_t now, const char *kind,
			       const char *message, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "INSERT INTO job_events (job, time_ms, kind, message) VALUES (?, ?, ?, ?)",
			       &st, eb);
	if (e)
		return e;
	size_t mlen = message ? strnlen(message, ST_EVENT_MAX) : 0;
	sqlite3_bind_int64(st, 1, job);
	sqlite3_bind_int64(st, 2, now);
	sqlite3_bind_text(st, 3, kind, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 4, message ? message : "", (int)mlen, SQLITE_STATIC);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_CONSTRAINT_FOREIGNKEY)
		e = td_fail(eb, TD_ENOENT, "job %lld does not exist", (long long)job);
	else if (rc != SQLITE_DONE)
		e = ST_SQLFAIL(db, rc, eb, "add event to job %lld", (long long)job);
	sqlite3_finalize(st);
	return e;
}

/* ------------------------------------------------------------------------ */
/* Submit, get, list, count */

td_err st_job_submit(struct st_db *db, const struct st_job_new *n, int64_t *id_out,
		     struct td_errbuf *eb)
{
	if (!n || !n->spec || n->spec_len == 0)
		return td_fail(eb, TD_EINVAL, "submit: the job has no spec");
	if (n->spec_len > (size_t)INT32_MAX)
		return td_fail(eb, TD_ERANGE, "submit: spec of %zu bytes is too large", n->spec_len);
	if (n->nafter > ST_DEPS_MAX)
		return td_fail(eb, TD_EINVAL, "submit --after: %zu jobs, more than the %d allowed",
			       n->nafter, ST_DEPS_MAX);
	for (size_t i = 0; i < n->nafter; i++) {
		if (n->after[i] <= 0)
			return td_fail(eb, TD_EINVAL, "submit --after: %lld is not a job id",
				       (long long)n->after[i]);
		for (size_t k = 0; k < i; k++)
			if (n->after[k] == n->after[i])
				return td_fail(eb, TD_EINVAL, "submit --after: job %lld named twice",
					       (long long)n->after[i]);
	}
	sqlite3_stmt *st = NULL;
	int64_t now = st_now_ms();
	st__lock(db);
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	if (n->max_queued_per_user) {
		uint32_t count = 0;
		e = st__prepare(db,
				"SELECT count(*) FROM jobs WHERE uid = ? AND state IN ('QUEUED','INTERRUPTED')",
				&st, eb);
		if (e)
			goto fail;
		sqlite3_bind_int64(st, 1, n->uid);
		int rc = sqlite3_step(st);
		if (rc != SQLITE_ROW) {
			e = ST_SQLFAIL(db, rc, eb, "count queued jobs of uid %u", (unsigned)n->uid);
			goto fail;
		}
		count = (uint32_t)sqlite3_column_int64(st, 0);
		sqlite3_finalize(st);
		st = NULL;
		if (count >= n->max_queued_per_user) {
			e = td_fail(eb, TD_EBUSY,
				    "user %u has %u queued jobs (limit %u); wait for some to start or "
				    "cancel one",
				    (unsigned)n->uid, count, n->max_queued_per_user);
			goto fail;
		}
	}
	/* Dependencies: each exists and can still succeed. */
	char deps[ST_DEPS_MAX * 22 + 1] = "";
	size_t dlen = 0;
	for (size_t i = 0; i < n->nafter; i++) {
		enum st_job_state ds;
		if ((e = job_state_locked(db, n->after[i], &ds, NULL, eb)) != TD_OK) {
			if (e == TD_ENOENT)
				td_fail(eb, TD_ENOENT, "submit --after: job %lld does not exist",
					(long long)n->after[i]);
			goto fail;
		}
		if (ds == ST_FAILED || ds == ST_CANCELLED) {
			e = td_fail(eb, TD_ESTATE,
				    "submit --after: job %lld is %s, so this job could never start; "
				    "requeue it first (trainctl requeue %lld)",
				    (long long)n->after[i], state_names[ds], (long long)n->after[i]);
			goto fail;
		}
		dlen += (size_t)snprintf(deps + dlen, sizeof(deps) - dlen, "%s%lld", i ? ", " : "",
					 (long long)n->after[i]);
	}
	e = st__prepare(db,
			"INSERT INTO jobs (name, spec, uid, gid, state, priority, submit_ms, updated_ms,"
			" held, acct_ms) VALUES (?, ?, ?, ?, 'QUEUED', ?, ?, ?, ?, ?)",
			&st, eb);
	if (e)
		goto fail;
	sqlite3_bind_text(st, 1, n->name ? n->name : "", -1, SQLITE_STATIC);
	sqlite3_bind_blob(st, 2, n->spec, (int)n->spec_len, SQLITE_STATIC);
	sqlite3_bind_int64(st, 3, n->uid);
	sqlite3_bind_int64(st, 4, n->gid);
	sqlite3_bind_int(st, 5, n->priority);
	sqlite3_bind_int64(st, 6, now);
	sqlite3_bind_int64(st, 7, now);
	sqlite3_bind_int(st, 8, n->held);
	sqlite3_bind_int64(st, 9, now);
	int rc = sqlite3_step(st);
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "insert job");
		goto fail;
	}
	int64_t id = sqlite3_last_insert_rowid(db->h);
	sqlite3_finalize(st);
	st = NULL;
	if (n->nafter) {
		if ((e = st__prepare(db, "INSERT INTO job_deps (job, dep) VALUES (?, ?)", &st, eb)))
			goto fail;
		for (size_t i = 0; i < n->nafter; i++) {
			sqlite3_reset(st);
			sqlite3_bind_int64(st, 1, id);
			sqlite3_bind_int64(st, 2, n->after[i]);
			if ((rc = sqlite3_step(st)) != SQLITE_DONE) {
				e = ST_SQLFAIL(db, rc, eb, "record the dependencies of job %lld", (long long)id);
				goto fail;
			}
		}
	}
	char msg[sizeof(deps) + 256];
	snprintf(msg, sizeof(msg), "submitted by uid %u (priority %d)%s%s%s", (unsigned)n->uid,
		 (int)n->priority, n->nafter ? "; starts after job(s) " : "", deps,
		 n->held ? "; held" : "");
	e = st__event_insert_locked(db, id, now, "submitted", msg, eb);
	if (e)
		goto fail;
	e = st__commit(db, eb);
	if (!e)
		*id_out = id;
	goto out;
fail:
	st__rollback(db);
out:
	sqlite3_finalize(st);
	st__unlock(db);
	return e;
}

td_err st_job_get(struct st_db *db, int64_t id, struct st_job *out, struct td_errbuf *eb)
{
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "SELECT " JOB_COLS ", spec FROM jobs WHERE id = ?", &st, eb);
	if (e)
		goto out;
	sqlite3_bind_int64(st, 1, id);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW)
		e = job_from_row(db, st, true, out, eb);
	else if (rc == SQLITE_DONE)
		e = td_fail(eb, TD_ENOENT, "job %lld does not exist", (long long)id);
	else
		e = ST_SQLFAIL(db, rc, eb, "read job %lld", (long long)id);
	sqlite3_finalize(st);
out:
	st__unlock(db);
	return e;
}

/* Grows *arr (of elem-sized items) to hold at least n+1; false when out of memory. */
static bool grow(void **arr, size_t *cap, size_t n, size_t elem)
{
	if (n < *cap)
		return true;
	size_t nc = *cap ? *cap * 2 : 16;
	void *p = realloc(*arr, nc * elem);
	if (!p)
		return false;
	*arr = p;
	*cap = nc;
	return true;
}

td_err st_job_list(struct st_db *db, const struct st_job_filter *f, struct st_job **out,
		   size_t *n, struct td_errbuf *eb)
{
	static const struct st_job_filter all = {.all_users = true};
	if (!f)
		f = &all;
	char where[256], sql[768];
	state_in_sql(f->state_mask, where, sizeof(where));
	/* The newest `limit` rows, then ascending by the outer ORDER BY. */
	snprintf(sql, sizeof(sql),
		 "SELECT * FROM (SELECT " JOB_COLS "%s FROM jobs WHERE (?1 OR uid = ?2) AND %s "
		 "ORDER BY id DESC LIMIT ?3) ORDER BY id",
		 f->with_spec ? ", spec" : "", where);
	void *rows;
	td_err e = ST_SELECT(db, &job_rows, &rows, n, eb, sql,
			     ST_ARGS(ST_INT(f->all_users), ST_INT(f->uid),
				     ST_INT(f->limit ? (int64_t)f->limit : -1)),
			     "list jobs");
	if (!e)
		*out = rows;
	return e;
}

td_err st_job_counts(struct st_db *db, uint32_t counts[ST_JOB_STATE_COUNT], uint32_t *held,
		     struct td_errbuf *eb)
{
	uint32_t c[ST_JOB_STATE_COUNT] = {0}, h = 0;
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "SELECT state, count(*), sum(held) FROM jobs GROUP BY state", &st, eb);
	if (!e) {
		int rc;
		while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
			enum st_job_state s;
			if (!st_job_state_parse((const char *)sqlite3_column_text(st, 0), &s))
				continue;
			c[s] = (uint32_t)sqlite3_column_int64(st, 1);
			if (s == ST_QUEUED)
				h = (uint32_t)sqlite3_column_int64(st, 2);
		}
		if (rc != SQLITE_DONE)
			e = ST_SQLFAIL(db, rc, eb, "count jobs by state");
		sqlite3_finalize(st);
	}
	st__unlock(db);
	if (e)
		return e;
	memcpy(counts, c, sizeof(c));
	if (held)
		*held = h;
	return TD_OK;
}

td_err st_job_count(struct st_db *db, uid_t uid, unsigned mask, uint32_t *count,
		    struct td_errbuf *eb)
{
	char where[256], sql[384];
	state_in_sql(mask, where, sizeof(where));
	snprintf(sql, sizeof(sql), "SELECT count(*) FROM jobs WHERE uid = ? AND %s", where);
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db, sql, &st, eb);
	if (!e) {
		sqlite3_bind_int64(st, 1, uid);
		int rc = sqlite3_step(st);
		if (rc == SQLITE_ROW)
			*count = (uint32_t)sqlite3_column_int64(st, 0);
		else
			e = ST_SQLFAIL(db, rc, eb, "count jobs of uid %u", (unsigned)uid);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	return e;
}

/* ------------------------------------------------------------------------ */
/* State changes */

/* set_state_locked's flags. */
enum {
	SS_NO_ACCRUE = 1,  /* the time since the last accrual is not counted (a dead daemon's) */
	SS_NO_CASCADE = 2, /* the caller fails the dependents itself */
};

static td_err fail_dependents_locked(struct st_db *db, int64_t id, enum st_job_state how,
				     int64_t now, struct td_errbuf *eb);

/* Moves job id from `cur` to `to` inside the caller's transaction: its usage
 * accrued up to now, the row, its "state" event, and, when `to` is not an
 * active state, the release of its leases (*leases gets how many; may be
 * NULL); FAILED and CANCELLED fail the jobs waiting on it. */
static td_err set_state_locked(struct st_db *db, int64_t id, enum st_job_state cur,
			       enum st_job_state to, const char *reason, const char *device,
			       int64_t now, size_t *leases, int flags, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = TD_OK;
	if (!(flags & SS_NO_ACCRUE) && (e = st__usage_accrue_locked(db, id, now, eb)))
		return e;
	e = st__prepare(
		db,
		"UPDATE jobs SET state = ?2, reason = ?3, updated_ms = ?4, acct_ms = ?4,"
		" device = CASE WHEN ?5 THEN '' ELSE coalesce(?6, device) END,"
		" attempts = attempts + ?7,"
		" start_ms = CASE WHEN ?8 THEN ?4 ELSE start_ms END,"
		" end_ms = CASE WHEN ?9 THEN ?4 ELSE end_ms END"
		" WHERE id = ?1",
		&st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, id);
	sqlite3_bind_text(st, 2, state_names[to], -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 3, reason ? reason : "", -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 4, now);
	sqlite3_bind_int(st, 5, to == ST_QUEUED);
	if (device)
		sqlite3_bind_text(st, 6, device, -1, SQLITE_STATIC);
	else
		sqlite3_bind_null(st, 6);
	sqlite3_bind_int(st, 7, to == ST_PREPARING);
	sqlite3_bind_int(st, 8, to == ST_RUNNING);
	sqlite3_bind_int(st, 9, st_job_state_terminal(to));
	int rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE)
		return ST_SQLFAIL(db, rc, eb, "update job %lld", (long long)id);
	char msg[ST_EVENT_MAX];
	snprintf(msg, sizeof(msg), "%s \u2192 %s%s%s", state_names[cur], state_names[to],
		 reason && *reason ? ": " : "", reason ? reason : "");
	e = st__event_insert_locked(db, id, now, "state", msg, eb);
	size_t freed = 0;
	if (!e && !(ST_MASK(to) & ST_MASK_ACTIVE))
		e = st__ledger_delete_job_locked(db, id, &freed, eb);
	if (!e && freed)
		td_info("TD-ST-LEASE-JOB", "%s: job %lld is %s; %zu lease(s) released with it",
			db->path, (long long)id, state_names[to], freed);
	if (!e && leases)
		*leases = freed;
	if (!e && !(flags & SS_NO_CASCADE) && (to == ST_FAILED || to == ST_CANCELLED))
		e = fail_dependents_locked(db, id, to, now, eb);
	return e;
}

/* A row of (id, state) into a struct st_dep; a state that is none of ours
 * (the schema's CHECK allows none) reads as ST_JOB_STATE_COUNT. */
static td_err dep_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	(void)db, (void)eb;
	struct st_dep *d = item;
	d->id = sqlite3_column_int64(st, 0);
	if (!st_job_state_parse((const char *)sqlite3_column_text(st, 1), &d->state))
		d->state = ST_JOB_STATE_COUNT;
	return TD_OK;
}

static const struct st__rowset dep_rows = {.size = sizeof(struct st_dep), .fill = dep_row};

/* Fails, inside the caller's transaction, every QUEUED or INTERRUPTED job
 * that waits on job id, which just ended `how`, and the jobs waiting on
 * those in turn (a work list, not recursion: a chain may be long). */
static td_err fail_dependents_locked(struct st_db *db, int64_t id, enum st_job_state how,
				     int64_t now, struct td_errbuf *eb)
{
	struct item {
		int64_t id;
		enum st_job_state how;
	};
	struct item *work = malloc(sizeof(*work));
	size_t nw = 0, cap = 1;
	if (!work)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", db->path);
	work[nw++] = (struct item){id, how};
	sqlite3_stmt *st = NULL;
	td_err e = st__prepare(db,
			       "SELECT j.id, j.state FROM job_deps d JOIN jobs j ON j.id = d.job"
			       " WHERE d.dep = ? AND j.state IN ('QUEUED','INTERRUPTED') ORDER BY j.id",
			       &st, eb);
	while (!e && nw) {
		struct item x = work[--nw];
		/* Read the dependents first; they change below. */
		void *rows = NULL;
		size_t nd = 0;
		sqlite3_reset(st);
		sqlite3_bind_int64(st, 1, x.id);
		e = ST_ROWS(db, st, &dep_rows, &rows, &nd, eb, "read the jobs waiting on job %lld",
			    (long long)x.id);
		struct st_dep *deps = rows;
		for (size_t i = 0; i < nd && !e; i++) {
			if (deps[i].state == ST_JOB_STATE_COUNT) /* none of ours: left alone */
				continue;
			char why[160];
			snprintf(why, sizeof(why),
				 "dependency: job %lld ended %s, and this job starts only after it "
				 "succeeds (requeue job %lld, then this one)",
				 (long long)x.id, state_names[x.how], (long long)x.id);
			e = set_state_locked(db, deps[i].id, deps[i].state, ST_FAILED, why, NULL, now,
					     NULL, SS_NO_CASCADE, eb);
			if (!e && grow((void **)&work, &cap, nw, sizeof(*work)))
				work[nw++] = (struct item){deps[i].id, ST_FAILED};
			else if (!e)
				e = td_fail(eb, TD_ENOMEM, "%s: out of memory", db->path);
		}
		free(rows);
	}
	sqlite3_finalize(st);
	free(work);
	return e;
}

td_err st_job_transition(struct st_db *db, int64_t id, enum st_job_state from,
			 enum st_job_state to, const char *reason, const char *device,
			 struct td_errbuf *eb)
{
	if ((unsigned)to >= ST_JOB_STATE_COUNT ||
	    (from != ST_ANY_STATE && (unsigned)from >= ST_JOB_STATE_COUNT))
		return td_fail(eb, TD_EINVAL, "job %lld: transition to an unknown state %d",
			       (long long)id, (int)to);
	if (from != ST_ANY_STATE && !st_job_transition_ok(from, to))
		return td_fail(eb, TD_ESTATE, "job %lld: illegal transition %s \u2192 %s",
			       (long long)id, state_names[from], state_names[to]);
	st__lock(db);
	enum st_job_state cur;
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	e = job_state_locked(db, id, &cur, NULL, eb);
	if (e)
		goto fail;
	if (from != ST_ANY_STATE && cur != from) {
		e = td_fail(eb, TD_EBUSY, "job %lld is %s, not %s", (long long)id, state_names[cur],
			    state_names[from]);
		goto fail;
	}
	if (!st_job_transition_ok(cur, to)) {
		e = td_fail(eb, TD_ESTATE, "job %lld: illegal transition %s \u2192 %s", (long long)id,
			    state_names[cur], state_names[to]);
		goto fail;
	}
	e = set_state_locked(db, id, cur, to, reason, device, st_now_ms(), NULL, 0, eb);
	if (e)
		goto fail;
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

td_err st_job_cancel(struct st_db *db, int64_t id, const char *reason,
		     enum st_job_state *state_out, struct td_errbuf *eb)
{
	st__lock(db);
	enum st_job_state cur, after;
	bool requested = false;
	int64_t now = st_now_ms();
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	e = job_state_locked(db, id, &cur, &requested, eb);
	if (e)
		goto fail;
	after = cur;
	if (cur == ST_CANCELLED) {
		st__rollback(db); /* nothing to do: cancelling twice is not an error */
		goto done;
	}
	if (st_job_state_terminal(cur)) {
		e = td_fail(eb, TD_ESTATE, "job %lld already %s; nothing to cancel", (long long)id,
			    state_names[cur]);
		goto fail;
	}
	if (cur == ST_QUEUED || cur == ST_INTERRUPTED) {
		after = ST_CANCELLED;
		e = set_state_locked(db, id, cur, ST_CANCELLED,
				     reason && *reason ? reason : "cancelled", NULL, now, NULL, 0, eb);
	} else if (!requested) {
		sqlite3_stmt *st;
		e = st__prepare(db, "UPDATE jobs SET cancel_requested = 1, updated_ms = ? WHERE id = ?",
				&st, eb);
		if (e)
			goto fail;
		sqlite3_bind_int64(st, 1, now);
		sqlite3_bind_int64(st, 2, id);
		int rc = sqlite3_step(st);
		sqlite3_finalize(st);
		if (rc != SQLITE_DONE) {
			e = ST_SQLFAIL(db, rc, eb, "request cancel of job %lld", (long long)id);
			goto fail;
		}
		char msg[ST_EVENT_MAX];
		snprintf(msg, sizeof(msg), "cancel requested while %s%s%s", state_names[cur],
			 reason && *reason ? ": " : "", reason ? reason : "");
		e = st__event_insert_locked(db, id, now, "cancel", msg, eb);
	}
	if (e)
		goto fail;
	e = st__commit(db, eb);
	if (e)
		goto out;
done:
	if (state_out)
		*state_out = after;
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

/* Runs one UPDATE of job id with a text (may be NULL) and an int64 bound as
 * ?2 and ?3, ?1 being the id; inside the caller's transaction. */
static td_err update_locked(struct st_db *db, const char *sql, int64_t id, const char *text,
			    int64_t v, const char *what, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, sql, &st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, id);
	if (text)
		sqlite3_bind_text(st, 2, text, -1, SQLITE_STATIC);
	else
		sqlite3_bind_null(st, 2);
	sqlite3_bind_int64(st, 3, v);
	int rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE)
		return ST_SQLFAIL(db, rc, eb, "%s of job %lld", what, (long long)id);
	return TD_OK;
}

td_err st_job_hold(struct st_db *db, int64_t id, bool hold, const char *who, bool *changed,
		   struct td_errbuf *eb)
{
	st__lock(db);
	int64_t now = st_now_ms();
	enum st_job_state cur;
	bool did = false;
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	if ((e = job_state_locked(db, id, &cur, NULL, eb)))
		goto fail;
	sqlite3_stmt *st;
	if ((e = st__prepare(db, "SELECT held FROM jobs WHERE id = ?", &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, id);
	bool held = sqlite3_step(st) == SQLITE_ROW && sqlite3_column_int(st, 0) != 0;
	sqlite3_finalize(st);
	if (hold && !held && cur != ST_QUEUED && cur != ST_INTERRUPTED) {
		e = td_fail(eb, TD_ESTATE,
			    "job %lld is %s; only a queued job can be held (trainctl cancel stops a "
			    "running one)",
			    (long long)id, state_names[cur]);
		goto fail;
	}
	if (hold != held) {
		if ((e = update_locked(db, "UPDATE jobs SET held = ?3 WHERE id = ?1", id, NULL, hold,
				       "hold", eb)) ||
		    (e = update_locked(db, "UPDATE jobs SET updated_ms = ?3 WHERE id = ?1", id, NULL,
				       now, "hold", eb)))
			goto fail;
		char msg[256];
		snprintf(msg, sizeof(msg), "%s by %s%s", hold ? "held" : "released",
			 who && *who ? who : "?",
			 hold ? "; not admitted until released (trainctl release)" : "");
		if ((e = st__event_insert_locked(db, id, now, "hold", msg, eb)))
			goto fail;
		did = true;
	}
	if ((e = st__commit(db, eb)))
		goto out;
	if (changed)
		*changed = did;
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

td_err st_job_requeue(struct st_db *db, int64_t id, const char *reason, struct td_errbuf *eb)
{
	st__lock(db);
	int64_t now = st_now_ms();
	enum st_job_state cur;
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	if ((e = job_state_locked(db, id, &cur, NULL, eb)))
		goto fail;
	if (cur != ST_FAILED && cur != ST_CANCELLED) {
		e = td_fail(eb, TD_ESTATE, "job %lld is %s; only a FAILED or CANCELLED job can be "
					   "requeued%s",
			    (long long)id, state_names[cur],
			    cur == ST_SUCCEEDED ? " (submit a new job to train again)"
						: " (it has not ended)");
		goto fail;
	}
	sqlite3_stmt *st;
	if ((e = st__prepare(db,
			     "SELECT j.id, j.state FROM job_deps d JOIN jobs j ON j.id = d.dep"
			     " WHERE d.job = ? AND j.state IN ('FAILED','CANCELLED') ORDER BY j.id LIMIT 1",
			     &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, id);
	if (sqlite3_step(st) == SQLITE_ROW) {
		long long dep = sqlite3_column_int64(st, 0);
		e = td_fail(eb, TD_ESTATE,
			    "job %lld starts only after job %lld succeeds, and job %lld is %s; requeue "
			    "job %lld first",
			    (long long)id, dep, dep, (const char *)sqlite3_column_text(st, 1), dep);
	}
	sqlite3_finalize(st);
	if (e)
		goto fail;
	char why[ST_EVENT_MAX];
	int64_t step = 0;
	char ckpt[1024] = "";
	if ((e = st__prepare(db, "SELECT ckpt_path, ckpt_step FROM jobs WHERE id = ?", &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, id);
	if (sqlite3_step(st) == SQLITE_ROW) {
		st__col_copy(st, 0, ckpt, sizeof(ckpt));
		step = sqlite3_column_int64(st, 1);
	}
	sqlite3_finalize(st);
	if (step > 0)
		snprintf(why, sizeof(why), "%s; resumes from checkpoint %s (step %lld)",
			 reason && *reason ? reason : "requeued", ckpt, (long long)step);
	else
		snprintf(why, sizeof(why), "%s; resumes from the newest checkpoint in its output dir, "
					   "if any",
			 reason && *reason ? reason : "requeued");
	if ((e = set_state_locked(db, id, cur, ST_QUEUED, why, NULL, now, NULL, 0, eb)) ||
	    (e = update_locked(db, "UPDATE jobs SET cancel_requested = 0, end_ms = 0 WHERE id = ?1",
			       id, NULL, 0, "requeue", eb)))
		goto fail;
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

td_err st_job_set_priority(struct st_db *db, int64_t id, int32_t priority, const void *spec,
			   size_t spec_len, const char *who, struct td_errbuf *eb)
{
	if (spec && (spec_len == 0 || spec_len > (size_t)INT32_MAX))
		return td_fail(eb, TD_EINVAL, "job %lld: priority: a spec of %zu bytes", (long long)id,
			       spec_len);
	st__lock(db);
	int64_t now = st_now_ms();
	enum st_job_state cur;
	sqlite3_stmt *st = NULL;
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	if ((e = job_state_locked(db, id, &cur, NULL, eb)))
		goto fail;
	if (st_job_state_terminal(cur)) {
		e = td_fail(eb, TD_ESTATE, "job %lld already %s; its priority no longer matters",
			    (long long)id, state_names[cur]);
		goto fail;
	}
	if ((e = st__prepare(db, "SELECT priority FROM jobs WHERE id = ?", &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, id);
	int old = sqlite3_step(st) == SQLITE_ROW ? sqlite3_column_int(st, 0) : 0;
	sqlite3_finalize(st);
	if ((e = st__prepare(db,
			     "UPDATE jobs SET priority = ?2, spec = coalesce(?3, spec), updated_ms = ?4"
			     " WHERE id = ?1",
			     &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, id);
	sqlite3_bind_int(st, 2, priority);
	if (spec)
		sqlite3_bind_blob(st, 3, spec, (int)spec_len, SQLITE_STATIC);
	else
		sqlite3_bind_null(st, 3);
	sqlite3_bind_int64(st, 4, now);
	int rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "set the priority of job %lld", (long long)id);
		goto fail;
	}
	char msg[256];
	snprintf(msg, sizeof(msg), "priority %d → %d by %s", old, (int)priority,
		 who && *who ? who : "?");
	if ((e = st__event_insert_locked(db, id, now, "priority", msg, eb)))
		goto fail;
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

td_err st_job_preempt(struct st_db *db, int64_t victim, int64_t by, const char *victim_msg,
		      const char *by_msg, struct td_errbuf *eb)
{
	st__lock(db);
	int64_t now = st_now_ms();
	enum st_job_state cur, other;
	bool requested = false;
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	if ((e = job_state_locked(db, victim, &cur, &requested, eb)) ||
	    (e = job_state_locked(db, by, &other, NULL, eb)))
		goto fail;
	if (!(ST_MASK(cur) & ST_MASK_ACTIVE) || requested) {
		e = td_fail(eb, TD_EBUSY, "job %lld is %s%s; it needs no preempting", (long long)victim,
			    state_names[cur], requested ? " with its cancel requested" : "");
		goto fail;
	}
	if ((e = st__event_insert_locked(db, victim, now, "preempted", victim_msg, eb)) ||
	    (e = st__event_insert_locked(db, by, now, "preempt", by_msg, eb)))
		goto fail;
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

td_err st_job_preempted_ms(struct st_db *db, int64_t job, int64_t *ms, struct td_errbuf *eb)
{
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "SELECT MAX(time_ms) FROM job_events WHERE job = ? AND kind = 'preempted'",
			       &st, eb);
	if (!e) {
		sqlite3_bind_int64(st, 1, job);
		int rc = sqlite3_step(st);
		if (rc == SQLITE_ROW)
			*ms = sqlite3_column_type(st, 0) == SQLITE_NULL ? 0 : sqlite3_column_int64(st, 0);
		else
			e = ST_SQLFAIL(db, rc, eb, "read the events of job %lld", (long long)job);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	return e;
}

td_err st_job_deps(struct st_db *db, int64_t job, struct st_dep **out, size_t *n,
		   struct td_errbuf *eb)
{
	void *rows;
	size_t cnt;
	td_err e = ST_SELECT(db, &dep_rows, &rows, &cnt, eb,
			     "SELECT j.id, j.state FROM job_deps d JOIN jobs j ON j.id = d.dep"
			     " WHERE d.job = ? ORDER BY j.id",
			     ST_ARGS(ST_INT(job)), "read the dependencies of job %lld", (long long)job);
	if (e)
		return e;
	struct st_dep *deps = rows;
	for (size_t i = 0; i < cnt; i++)
		if (deps[i].state == ST_JOB_STATE_COUNT)
			deps[i].state = ST_QUEUED;
	*out = deps;
	*n = cnt;
	return TD_OK;
}

td_err st_job_set_checkpoint(struct st_db *db, int64_t id, const char *path, int64_t step,
			     struct td_errbuf *eb)
{
	if (!path || !*path)
		return td_fail(eb, TD_EINVAL, "job %lld: checkpoint without a path", (long long)id);
	if (step < 0)
		return td_fail(eb, TD_EINVAL, "job %lld: checkpoint at negative step %lld",
			       (long long)id, (long long)step);
	st__lock(db);
	enum st_job_state cur;
	int64_t now = st_now_ms();
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	e = job_state_locked(db, id, &cur, NULL, eb);
	if (e)
		goto fail;
	if (cur != ST_RUNNING && cur != ST_PREPARING) {
		e = td_fail(eb, TD_ESTATE, "job %lld is %s; only a RUNNING job records checkpoints",
			    (long long)id, state_names[cur]);
		goto fail;
	}
	sqlite3_stmt *st;
	e = st__prepare(db,
			"UPDATE jobs SET ckpt_path = ?, ckpt_step = ?, updated_ms = ? WHERE id = ?",
			&st, eb);
	if (e)
		goto fail;
	sqlite3_bind_text(st, 1, path, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 2, step);
	sqlite3_bind_int64(st, 3, now);
	sqlite3_bind_int64(st, 4, id);
	int rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "record checkpoint of job %lld", (long long)id);
		goto fail;
	}
	char msg[ST_EVENT_MAX];
	snprintf(msg, sizeof(msg), "checkpoint at step %lld: %s", (long long)step, path);
	e = st__event_insert_locked(db, id, now, "checkpoint", msg, eb);
	if (e)
		goto fail;
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

static td_err id_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	(void)db, (void)eb;
	*(int64_t *)item = sqlite3_column_int64(st, 0);
	return TD_OK;
}

static const struct st__rowset id_rows = {.size = sizeof(int64_t), .fill = id_row};

/* ids of jobs in the states of mask, inside the caller's transaction. */
static td_err ids_in_states_locked(struct st_db *db, unsigned mask, int64_t **ids, size_t *n,
				   struct td_errbuf *eb)
{
	char where[256], sql[384];
	state_in_sql(mask, where, sizeof(where));
	snprintf(sql, sizeof(sql), "SELECT id FROM jobs WHERE %s ORDER BY id", where);
	sqlite3_stmt *st;
	td_err e = st__prepare(db, sql, &st, eb);
	if (e)
		return e;
	void *rows;
	e = ST_ROWS(db, st, &id_rows, &rows, n, eb, "select jobs");
	sqlite3_finalize(st);
	if (!e)
		*ids = rows;
	return e;
}

td_err st_jobs_recover(struct st_db *db, struct st_recover_stats *stats, struct td_errbuf *eb)
{
	struct st_recover_stats s = {0};
	int64_t *ids = NULL;
	size_t n = 0;
	int64_t now = st_now_ms();
	st__lock(db);
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	/* 1. Whatever was active when the daemon died is INTERRUPTED, and its
	 *    leases (held by the dead daemon) go. */
	e = ids_in_states_locked(db, ST_MASK_ACTIVE, &ids, &n, eb);
	if (e)
		goto fail;
	for (size_t i = 0; i < n; i++) {
		enum st_job_state cur;
		if ((e = job_state_locked(db, ids[i], &cur, NULL, eb)))
			goto fail;
		char why[64];
		snprintf(why, sizeof(why), "daemon stopped while %s", state_names[cur]);
		size_t nl = 0;
		/* The time since the last accrual includes the time the daemon
		 * was down: not counted. */
		if ((e = set_state_locked(db, ids[i], cur, ST_INTERRUPTED, why, NULL, now, &nl,
					  SS_NO_ACCRUE, eb)))
			goto fail;
		s.interrupted++;
		s.leases += nl;
	}
	free(ids);
	ids = NULL;
	/* 2. Every INTERRUPTED job (just now, or stopped cleanly before) is
	 *    requeued with its checkpoint, or cancelled if that was asked. */
	e = ids_in_states_locked(db, ST_MASK(ST_INTERRUPTED), &ids, &n, eb);
	if (e)
		goto fail;
	for (size_t i = 0; i < n; i++) {
		sqlite3_stmt *st;
		if ((e = st__prepare(db,
				     "SELECT cancel_requested, ckpt_path, ckpt_step FROM jobs WHERE id = ?",
				     &st, eb)))
			goto fail;
		sqlite3_bind_int64(st, 1, ids[i]);
		int rc = sqlite3_step(st);
		if (rc != SQLITE_ROW) {
			e = ST_SQLFAIL(db, rc, eb, "read job %lld", (long long)ids[i]);
			sqlite3_finalize(st);
			goto fail;
		}
		bool cancel = sqlite3_column_int(st, 0) != 0;
		char why[ST_EVENT_MAX];
		if (cancel)
			snprintf(why, sizeof(why), "cancel was requested before the daemon stopped");
		else if (sqlite3_column_int64(st, 2) > 0)
			snprintf(why, sizeof(why), "requeued at daemon start; resumes from checkpoint %s (step %lld)",
				 (const char *)sqlite3_column_text(st, 1),
				 (long long)sqlite3_column_int64(st, 2));
		else
			snprintf(why, sizeof(why),
				 "requeued at daemon start; no checkpoint yet, starts from step 0");
		sqlite3_finalize(st);
		size_t nl = 0;
		e = set_state_locked(db, ids[i], ST_INTERRUPTED, cancel ? ST_CANCELLED : ST_QUEUED, why,
				     NULL, now, &nl, 0, eb);
		if (e)
			goto fail;
		s.leases += nl;
		if (cancel)
			s.cancelled++;
		else
			s.requeued++;
	}
	e = st__commit(db, eb);
	if (e)
		goto out;
	if (s.interrupted || s.requeued || s.cancelled)
		td_info("TD-ST-RECOVER",
			"%s: %zu job(s) interrupted, %zu requeued, %zu cancelled, %zu lease(s) freed",
			db->path, s.interrupted, s.requeued, s.cancelled, s.leases);
	if (stats)
		*stats = s;
	goto out;
fail:
	st__rollback(db);
out:
	free(ids);
	st__unlock(db);
	return e;
}

/* ------------------------------------------------------------------------ */
/* The scheduler's view */

void st_queue_free(struct st_queued *q, size_t n)
{
	if (!q)
		return;
	for (size_t i = 0; i < n; i++)
		free(q[i].spec);
	free(q);
}

/* A row of st_job_queue's query. */
static td_err queued_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	struct st_queued *q = item;
	q->id = sqlite3_column_int64(st, 0);
	q->uid = (uid_t)sqlite3_column_int64(st, 1);
	q->gid = (gid_t)sqlite3_column_int64(st, 2);
	q->priority = sqlite3_column_int(st, 3);
	q->submit_ms = sqlite3_column_int64(st, 4);
	q->attempts = sqlite3_column_int(st, 5);
	q->ckpt_step = sqlite3_column_int64(st, 6);
	q->user_active = (uint32_t)sqlite3_column_int64(st, 7);
	q->user_queued = (uint32_t)sqlite3_column_int64(st, 8);
	q->held = sqlite3_column_int(st, 10) != 0;
	q->deps_pending = (uint32_t)sqlite3_column_int64(st, 11);
	q->dep_waiting = sqlite3_column_int64(st, 12);
	int len = sqlite3_column_bytes(st, 9);
	const void *b = sqlite3_column_blob(st, 9);
	q->spec = malloc(len > 0 ? (size_t)len : 1);
	if (!q->spec)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory reading the queue", db->path);
	if (len > 0)
		memcpy(q->spec, b, (size_t)len);
	q->spec_len = (size_t)(len > 0 ? len : 0);
	return TD_OK;
}

static void queue_free(void *q, size_t n)
{
	st_queue_free(q, n);
}

td_err st_job_queue(struct st_db *db, struct st_queued **out, size_t *n, struct td_errbuf *eb)
{
	static const struct st__rowset queued_rows = {
		.size = sizeof(struct st_queued), .fill = queued_row, .free = queue_free};
	static const char sql[] =
		"WITH act AS (SELECT uid, count(*) AS n FROM jobs"
		"             WHERE state IN ('ADMITTED','PREPARING','RUNNING') GROUP BY uid),"
		"     q AS (SELECT uid, count(*) AS n FROM jobs WHERE state = 'QUEUED' GROUP BY uid)"
		" SELECT j.id, j.uid, j.gid, j.priority, j.submit_ms, j.attempts, j.ckpt_step,"
		"        coalesce(act.n, 0) AS active, q.n, j.spec, j.held,"
		"        (SELECT count(*) FROM job_deps d JOIN jobs p ON p.id = d.dep"
		"         WHERE d.job = j.id AND p.state <> 'SUCCEEDED'),"
		"        (SELECT min(d.dep) FROM job_deps d JOIN jobs p ON p.id = d.dep"
		"         WHERE d.job = j.id AND p.state <> 'SUCCEEDED')"
		" FROM jobs j JOIN q ON q.uid = j.uid LEFT JOIN act ON act.uid = j.uid"
		" WHERE j.state = 'QUEUED'"
		" ORDER BY j.priority DESC, active ASC, j.submit_ms ASC, j.id ASC";
	void *rows;
	td_err e = ST_SELECT(db, &queued_rows, &rows, n, eb, sql, ST_NO_ARGS, "read the queue");
	if (!e)
		*out = rows;
	return e;
}

/* ------------------------------------------------------------------------ */
/* Events */

td_err st_event_add(struct st_db *db, int64_t job, const char *kind, const char *message,
		    struct td_errbuf *eb)
{
	if (!kind || !*kind)
		return td_fail(eb, TD_EINVAL, "job %lld: event without a kind", (long long)job);
	st__lock(db);
	td_err e = st__begin(db, eb);
	if (!e) {
		e = st__event_insert_locked(db, job, st_now_ms(), kind, message, eb);
		if (e)
			st__rollback(db);
		else
			e = st__commit(db, eb);
	}
	st__unlock(db);
	return e;
}

td_err st_event_addf(struct st_db *db, int64_t job, const char *kind, struct td_errbuf *eb,
		     const char *fmt, ...)
{
	char msg[ST_EVENT_MAX];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return st_event_add(db, job, kind, msg, eb);
}

void st_events_free(struct st_event *ev, size_t n)
{
	if (!ev)
		return;
	for (size_t i = 0; i < n; i++) {
		free(ev[i].kind);
		free(ev[i].message);
	}
	free(ev);
}

static td_err event_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	struct st_event *v = item;
	v->id = sqlite3_column_int64(st, 0);
	v->job = sqlite3_column_int64(st, 1);
	v->time_ms = sqlite3_column_int64(st, 2);
	v->kind = st__col_strdup(st, 3);
	v->message = st__col_strdup(st, 4);
	if (!v->kind || !v->message)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory reading events", db->path);
	return TD_OK;
}

static void events_free(void *ev, size_t n)
{
	st_events_free(ev, n);
}

td_err st_event_list(struct st_db *db, int64_t job, int64_t after_id, size_t limit,
		     struct st_event **out, size_t *n, struct td_errbuf *eb)
{
	static const struct st__rowset event_rows = {
		.size = sizeof(struct st_event), .fill = event_row, .free = events_free};
	void *rows;
	td_err e = ST_SELECT(db, &event_rows, &rows, n, eb,
			     "SELECT id, job, time_ms, kind, message FROM job_events"
			     " WHERE job = ? AND id > ? ORDER BY id LIMIT ?",
			     ST_ARGS(ST_INT(job), ST_INT(after_id), ST_INT(limit ? (int64_t)limit : -1)),
			     "read events of job %lld", (long long)job);
	if (!e)
		*out = rows;
	return e;
}

/* ------------------------------------------------------------------------ */
/* Metrics */

static void bind_measure(sqlite3_stmt *st, int col, double v)
{
	if (isnan(v))
		sqlite3_bind_null(st, col);
	else
		sqlite3_bind_double(st, col, v);
}

static double col_measure(sqlite3_stmt *st, int col)
{
	return sqlite3_column_type(st, col) == SQLITE_NULL ? NAN : sqlite3_column_double(st, col);
}

td_err st_metrics_add(struct st_db *db, int64_t job, const struct st_metric *m, size_t n,
		      struct td_errbuf *eb)
{
	if (n == 0)
		return TD_OK;
	st__lock(db);
	sqlite3_stmt *st = NULL;
	int64_t now = st_now_ms();
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	bool exists = false;
	if ((e = st__job_exists_locked(db, job, &exists, eb)))
		goto fail;
	if (!exists) {
		e = td_fail(eb, TD_ENOENT, "job %lld does not exist", (long long)job);
		goto fail;
	}
	e = st__prepare(db,
			"INSERT INTO metrics (job, step, time_ms, loss, lr, grad_norm, tokens_per_s, eval_loss)"
			" VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
			" ON CONFLICT (job, step) DO UPDATE SET time_ms = excluded.time_ms,"
			"  loss = coalesce(excluded.loss, loss), lr = coalesce(excluded.lr, lr),"
			"  grad_norm = coalesce(excluded.grad_norm, grad_norm),"
			"  tokens_per_s = coalesce(excluded.tokens_per_s, tokens_per_s),"
			"  eval_loss = coalesce(excluded.eval_loss, eval_loss)",
			&st, eb);
	if (e)
		goto fail;
	for (size_t i = 0; i < n; i++) {
		sqlite3_reset(st);
		sqlite3_bind_int64(st, 1, job);
		sqlite3_bind_int64(st, 2, m[i].step);
		sqlite3_bind_int64(st, 3, m[i].time_ms ? m[i].time_ms : now);
		bind_measure(st, 4, m[i].loss);
		bind_measure(st, 5, m[i].lr);
		bind_measure(st, 6, m[i].grad_norm);
		bind_measure(st, 7, m[i].tokens_per_s);
		bind_measure(st, 8, m[i].eval_loss);
		int rc = sqlite3_step(st);
		if (rc != SQLITE_DONE) {
			e = ST_SQLFAIL(db, rc, eb, "insert metrics of job %lld step %lld",
				       (long long)job, (long long)m[i].step);
			goto fail;
		}
	}
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	sqlite3_finalize(st);
	st__unlock(db);
	return e;
}

static void metric_from_row(sqlite3_stmt *st, struct st_metric *m)
{
	m->step = sqlite3_column_int64(st, 0);
	m->time_ms = sqlite3_column_int64(st, 1);
	m->loss = col_measure(st, 2);
	m->lr = col_measure(st, 3);
	m->grad_norm = col_measure(st, 4);
	m->tokens_per_s = col_measure(st, 5);
	m->eval_loss = col_measure(st, 6);
}

static td_err metric_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	(void)db, (void)eb;
	metric_from_row(st, item);
	return TD_OK;
}

#define METRIC_COLS "step, time_ms, loss, lr, grad_norm, tokens_per_s, eval_loss"

td_err st_metrics_list(struct st_db *db, int64_t job, int64_t after_step, size_t limit,
		       struct st_metric **out, size_t *n, struct td_errbuf *eb)
{
	static const struct st__rowset metric_rows = {.size = sizeof(struct st_metric),
						      .fill = metric_row};
	void *rows;
	td_err e = ST_SELECT(db, &metric_rows, &rows, n, eb,
			     "SELECT " METRIC_COLS " FROM metrics WHERE job = ? AND step > ?"
			     " ORDER BY step LIMIT ?",
			     ST_ARGS(ST_INT(job), ST_INT(after_step), ST_INT(limit ? (int64_t)limit : -1)),
			     "read metrics of job %lld", (long long)job);
	if (!e)
		*out = rows;
	return e;
}

td_err st_metrics_last(struct st_db *db, int64_t job, struct st_metric *out, struct td_errbuf *eb)
{
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "SELECT " METRIC_COLS " FROM metrics WHERE job = ? ORDER BY step DESC LIMIT 1",
			       &st, eb);
	if (!e) {
		sqlite3_bind_int64(st, 1, job);
		int rc = sqlite3_step(st);
		if (rc == SQLITE_ROW)
			metric_from_row(st, out);
		else if (rc == SQLITE_DONE)
			e = td_fail(eb, TD_ENOENT, "job %lld has no metrics yet", (long long)job);
		else
			e = ST_SQLFAIL(db, rc, eb, "read metrics of job %lld", (long long)job);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	return e;
}
