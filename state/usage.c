/* The accounting (state.h, "Accounting"): what each job used, in hourly
 * buckets, accrued by state changes (jobs.c, in their transaction) and by the
 * daemon's tick, and summed per user or per job over a window. Not the
 * policy: fair share and the quota are the scheduler's; this file only
 * counts. */
#include "state/internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define HOUR_MS 3600000LL

static int64_t hour_of(int64_t ms)
{
	return ms - ms % HOUR_MS;
}

td_err st__usage_accrue_locked(struct st_db *db, int64_t job, int64_t now, struct td_errbuf *eb)
{
	/* Active time × the job's leases now: leases are granted at admission
	 * and released with the state that ends the activity, so between two
	 * accruals they do not change but for that state change itself, which
	 * accrues first. A job without a lease while active holds a CPU slot. */
	static const char ins[] =
		"WITH a AS (SELECT j.id, j.uid, j.state, ?1 - j.acct_ms AS dt,"
		"    (SELECT count(*) FROM ledger l WHERE l.job = j.id) AS n,"
		"    (SELECT coalesce(sum(l.bytes), 0) FROM ledger l WHERE l.job = j.id) AS b"
		"  FROM jobs j"
		"  WHERE j.state IN ('QUEUED','ADMITTED','PREPARING','RUNNING')"
		"    AND j.acct_ms > 0 AND j.acct_ms < ?1 AND (?3 = 0 OR j.id = ?3))"
		" INSERT INTO usage (job, hour, uid, queued_ms, run_ms, gpu_ms, cpu_ms, gpu_mem_bs)"
		" SELECT id, ?2, uid,"
		"   CASE WHEN state = 'QUEUED' THEN dt ELSE 0 END,"
		"   CASE WHEN state <> 'QUEUED' THEN dt ELSE 0 END,"
		"   CASE WHEN state <> 'QUEUED' THEN dt * n ELSE 0 END,"
		"   CASE WHEN state <> 'QUEUED' AND n = 0 THEN dt ELSE 0 END,"
		"   CASE WHEN state <> 'QUEUED' THEN dt / 1000.0 * b ELSE 0 END"
		" FROM a WHERE true"
		" ON CONFLICT (job, hour) DO UPDATE SET"
		"   queued_ms = queued_ms + excluded.queued_ms, run_ms = run_ms + excluded.run_ms,"
		"   gpu_ms = gpu_ms + excluded.gpu_ms, cpu_ms = cpu_ms + excluded.cpu_ms,"
		"   gpu_mem_bs = gpu_mem_bs + excluded.gpu_mem_bs";
	static const char upd[] =
		"UPDATE jobs SET acct_ms = ?1"
		" WHERE state IN ('QUEUED','ADMITTED','PREPARING','RUNNING') AND (?2 = 0 OR id = ?2)";
	sqlite3_stmt *st;
	td_err e = st__prepare(db, ins, &st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, now);
	sqlite3_bind_int64(st, 2, hour_of(now));
	sqlite3_bind_int64(st, 3, job);
	int rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE)
		return ST_SQLFAIL(db, rc, eb, "accrue usage%s", job ? " of a job" : "");
	if ((e = st__prepare(db, upd, &st, eb)))
		return e;
	sqlite3_bind_int64(st, 1, now);
	sqlite3_bind_int64(st, 2, job);
	rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE)
		return ST_SQLFAIL(db, rc, eb, "accrue usage");
	return TD_OK;
}

td_err st_usage_accrue(struct st_db *db, int64_t now_ms, struct td_errbuf *eb)
{
	st__lock(db);
	td_err e = st__begin(db, eb);
	if (!e) {
		if ((e = st__usage_accrue_locked(db, 0, now_ms, eb)))
			st__rollback(db);
		else
			e = st__commit(db, eb);
	}
	st__unlock(db);
	return e;
}

td_err st_usage_add_tokens(struct st_db *db, int64_t job, int64_t tokens, struct td_errbuf *eb)
{
	if (tokens <= 0)
		return TD_OK;
	st__lock(db);
	int64_t now = st_now_ms();
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	sqlite3_stmt *st;
	if ((e = st__prepare(db,
			     "INSERT INTO usage (job, hour, uid, tokens)"
			     " SELECT id, ?2, uid, ?3 FROM jobs WHERE id = ?1"
			     " ON CONFLICT (job, hour) DO UPDATE SET tokens = tokens + excluded.tokens",
			     &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, job);
	sqlite3_bind_int64(st, 2, hour_of(now));
	sqlite3_bind_int64(st, 3, tokens);
	int rc = sqlite3_step(st);
	int changed = sqlite3_changes(db->h);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "add tokens to job %lld", (long long)job);
		goto fail;
	}
	if (!changed) {
		e = td_fail(eb, TD_ENOENT, "job %lld does not exist", (long long)job);
		goto fail;
	}
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

#define USAGE_SUMS                                                                    \
	"sum(queued_ms), sum(run_ms), sum(gpu_ms), sum(cpu_ms), sum(gpu_mem_bs), sum(tokens)"

static void usage_from_row(sqlite3_stmt *st, int col, struct st_usage *u)
{
	u->queued_ms = sqlite3_column_int64(st, col);
	u->run_ms = sqlite3_column_int64(st, col + 1);
	u->gpu_ms = sqlite3_column_int64(st, col + 2);
	u->cpu_ms = sqlite3_column_int64(st, col + 3);
	u->gpu_mem_bs = sqlite3_column_double(st, col + 4);
	u->tokens = sqlite3_column_int64(st, col + 5);
}

/* A row of (uid, job, jobs, USAGE_SUMS). */
static td_err usage_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	(void)db, (void)eb;
	struct st_usage_row *r = item;
	r->uid = (uid_t)sqlite3_column_int64(st, 0);
	r->job = sqlite3_column_int64(st, 1);
	usage_from_row(st, 3, &r->u);
	r->u.jobs = (uint32_t)sqlite3_column_int64(st, 2);
	return TD_OK;
}

td_err st_usage_list(struct st_db *db, int64_t since_ms, bool by_job, bool all_users, uid_t uid,
		     struct st_usage_row **out, size_t *n, struct td_errbuf *eb)
{
	static const struct st__rowset usage_rows = {.size = sizeof(struct st_usage_row),
						     .fill = usage_row};
	const char *sql =
		by_job ? "SELECT uid, job, 1, " USAGE_SUMS " FROM usage"
			 " WHERE hour >= ?1 AND (?2 OR uid = ?3) GROUP BY job ORDER BY job"
		       : "SELECT uid, 0, count(DISTINCT job), " USAGE_SUMS " FROM usage"
			 " WHERE hour >= ?1 AND (?2 OR uid = ?3) GROUP BY uid ORDER BY uid";
	void *rows;
	td_err e = ST_SELECT(db, &usage_rows, &rows, n, eb, sql,
			     ST_ARGS(ST_INT(since_ms > 0 ? hour_of(since_ms) : 0), ST_INT(all_users),
				     ST_INT(uid)),
			     "read usage");
	if (!e)
		*out = rows;
	return e;
}

td_err st_usage_of_job(struct st_db *db, int64_t job, struct st_usage *out, struct td_errbuf *eb)
{
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "SELECT " USAGE_SUMS " FROM usage WHERE job = ?", &st, eb);
	if (!e) {
		sqlite3_bind_int64(st, 1, job);
		int rc = sqlite3_step(st);
		if (rc == SQLITE_ROW) {
			memset(out, 0, sizeof(*out));
			usage_from_row(st, 0, out);
			out->jobs = 1;
		} else {
			e = ST_SQLFAIL(db, rc, eb, "read the usage of job %lld", (long long)job);
		}
		sqlite3_finalize(st);
	}
	st__unlock(db);
	return e;
}
