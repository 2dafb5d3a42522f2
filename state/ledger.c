/* The VRAM ledger (contract 7): leases on GPU memory, granted under
 * BEGIN IMMEDIATE so that check-then-insert is atomic across every process on
 * the host, and reaped when their holder is gone. Not the device query: the
 * caller says what the device has (st_device_cap). */
#include "state/internal.h"

#include "proto/log.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------------ */
/* Holders: /proc */

/* Reads a small file into buf (terminated); -errno on failure. */
static int read_small(const char *path, char *buf, size_t size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	size_t n = 0;
	while (n + 1 < size) {
		ssize_t r = read(fd, buf + n, size - 1 - n);
		if (r < 0) {
			if (errno == EINTR)
				continue;
			int err = errno;
			close(fd);
			return -err;
		}
		if (r == 0)
			break;
		n += (size_t)r;
	}
	close(fd);
	buf[n] = 0;
	return 0;
}

static td_err read_boot_id(char out[40], struct td_errbuf *eb)
{
	static const char path[] = "/proc/sys/kernel/random/boot_id";
	char buf[64];
	int r = read_small(path, buf, sizeof(buf));
	if (r < 0)
		return td_fail(eb, td_from_errno(-r), "%s: %s", path, strerror(-r));
	buf[strcspn(buf, "\n")] = 0;
	size_t len = strlen(buf);
	if (len < 32 || len > 39)
		return td_fail(eb, TD_EFORMAT, "%s: unexpected content \"%s\"", path, buf);
	memcpy(out, buf, len + 1);
	return TD_OK;
}

/* pid's start time (field 22) and state letter (field 3) from /proc/PID/stat.
 * -ENOENT when there is no such process; -EACCES/-EPERM when hidden;
 * -EINVAL when the line cannot be parsed. */
static int read_pid_stat(pid_t pid, uint64_t *start, char *state)
{
	char path[64], buf[1024];
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	int r = read_small(path, buf, sizeof(buf));
	if (r < 0)
		return r == -ESRCH ? -ENOENT : r;
	/* "pid (comm) S ppid …": comm may hold spaces and parentheses; the
	 * fields resume after the last ')'. */
	char *p = strrchr(buf, ')');
	if (!p || p[1] != ' ' || !p[2])
		return -EINVAL;
	p += 2;
	*state = *p;
	/* p is field 3; advance to field 22. */
	for (int field = 3; field < 22; field++) {
		p = strchr(p, ' ');
		if (!p)
			return -EINVAL;
		p++;
	}
	char *end;
	errno = 0;
	unsigned long long v = strtoull(p, &end, 10);
	if (errno || end == p)
		return -EINVAL;
	*start = v;
	return 0;
}

td_err st_holder_of(pid_t pid, struct st_holder *out, struct td_errbuf *eb)
{
	if (pid <= 0)
		return td_fail(eb, TD_EINVAL, "holder pid %d is not a process id", (int)pid);
	struct st_holder h = {.pid = pid};
	char state = 0;
	int r = read_pid_stat(pid, &h.start_time, &state);
	if (r == -ENOENT || (r == 0 && (state == 'Z' || state == 'X')))
		return td_fail(eb, TD_ENOENT, "holder pid %d does not exist", (int)pid);
	if (r == -EINVAL)
		return td_fail(eb, TD_EFORMAT, "/proc/%d/stat: cannot parse the start time", (int)pid);
	if (r < 0)
		return td_fail(eb, td_from_errno(-r), "/proc/%d/stat: %s", (int)pid, strerror(-r));
	td_err e = read_boot_id(h.boot_id, eb);
	if (e)
		return e;
	*out = h;
	return TD_OK;
}

/* Why holder h is dead (a static string), or NULL while it lives. boot is the
 * current boot id. */
static const char *holder_dead(const struct st_holder *h, const char *boot)
{
	if (strcmp(h->boot_id, boot) != 0)
		return "holder ran in an earlier boot";
	uint64_t start = 0;
	char state = 0;
	int r = read_pid_stat(h->pid, &start, &state);
	if (r == 0) {
		if (state == 'Z' || state == 'X')
			return "holder exited";
		return start == h->start_time ? NULL : "holder pid reused by another process";
	}
	if (r == -ENOENT)
		return "holder exited";
	if (r == -EACCES || r == -EPERM) {
		/* /proc hidden (hidepid): existence is all we can learn. */
		if (kill(h->pid, 0) == 0 || errno == EPERM)
			return NULL;
		return "holder exited";
	}
	return NULL; /* unreadable for another reason: never reap what we cannot prove dead */
}

bool st_holder_alive(const struct st_holder *h)
{
	char boot[40];
	if (read_boot_id(boot, NULL) != TD_OK)
		return true;
	return holder_dead(h, boot) == NULL;
}

/* ------------------------------------------------------------------------ */
/* Helpers */

static const char *fmt_bytes(uint64_t b, char *buf, size_t size)
{
	if (b >= (1ull << 30))
		snprintf(buf, size, "%.2f GiB", (double)b / (double)(1ull << 30));
	else if (b >= (1ull << 20))
		snprintf(buf, size, "%.1f MiB", (double)b / (double)(1ull << 20));
	else
		snprintf(buf, size, "%" PRIu64 " B", b);
	return buf;
}

static td_err sum_locked(struct st_db *db, const char *gpu, uint64_t *sum, uint32_t *count,
			 struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "SELECT (SELECT coalesce(sum(bytes), 0) FROM ledger WHERE gpu_uuid = ?1) +"
			       " (SELECT coalesce(sum(bytes), 0) FROM shared_blocks WHERE gpu_uuid = ?1),"
			       " (SELECT count(*) FROM ledger WHERE gpu_uuid = ?1)",
			       &st, eb);
	if (e)
		return e;
	sqlite3_bind_text(st, 1, gpu, -1, SQLITE_STATIC);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW) {
		*sum = (uint64_t)sqlite3_column_int64(st, 0);
		if (count)
			*count = (uint32_t)sqlite3_column_int64(st, 1);
	} else {
		e = ST_SQLFAIL(db, rc, eb, "sum of leases on %s", gpu);
	}
	sqlite3_finalize(st);
	return e;
}

/* Drops the holders whose lease is gone and the blocks left without a
 * holder, inside the caller's transaction (after any lease is deleted:
 * foreign keys cascade the first where they are on, this does both
 * wherever the database is written from). */
static td_err prune_shared_locked(struct st_db *db, struct td_errbuf *eb)
{
	char *err = NULL;
	int rc = sqlite3_exec(db->h,
			      "DELETE FROM shared_holders WHERE lease NOT IN (SELECT id FROM ledger);"
			      "DELETE FROM shared_blocks WHERE id NOT IN (SELECT block FROM shared_holders);",
			      NULL, NULL, &err);
	sqlite3_free(err);
	if (rc != SQLITE_OK)
		return ST_SQLFAIL(db, rc, eb, "drop shared blocks without holders");
	return TD_OK;
}

/* Removes dead leases inside the caller's transaction. */
static td_err reap_locked(struct st_db *db, size_t *n_reaped, struct td_errbuf *eb)
{
	char boot[40];
	td_err e = read_boot_id(boot, eb);
	if (e)
		return e;
	int64_t now = st_now_ms();
	sqlite3_stmt *st, *del = NULL;
	e = st__prepare(db,
			"SELECT id, pid, pid_start, boot_id, expires_ms, gpu_uuid, bytes, uid, label"
			" FROM ledger ORDER BY id",
			&st, eb);
	if (e)
		return e;
	e = st__prepare(db, "DELETE FROM ledger WHERE id = ?", &del, eb);
	if (e) {
		sqlite3_finalize(st);
		return e;
	}
	size_t n = 0;
	int rc;
	while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
		struct st_holder h = {
			.pid = (pid_t)sqlite3_column_int64(st, 1),
			.start_time = (uint64_t)sqlite3_column_int64(st, 2),
		};
		st__col_copy(st, 3, h.boot_id, sizeof(h.boot_id));
		int64_t expires = sqlite3_column_int64(st, 4);
		const char *why = expires > 0 && expires <= now ? "lease expired" : holder_dead(&h, boot);
		if (!why)
			continue;
		int64_t id = sqlite3_column_int64(st, 0);
		sqlite3_reset(del);
		sqlite3_bind_int64(del, 1, id);
		int drc = sqlite3_step(del);
		if (drc != SQLITE_DONE) {
			e = ST_SQLFAIL(db, drc, eb, "reap lease %lld", (long long)id);
			break;
		}
		char b[32];
		td_info("TD-ST-LEASE-REAP", "%s: lease %lld reaped (%s): %s on %s, uid %lld, pid %d%s%s",
			db->path, (long long)id, why,
			fmt_bytes((uint64_t)sqlite3_column_int64(st, 6), b, sizeof(b)),
			(const char *)sqlite3_column_text(st, 5), (long long)sqlite3_column_int64(st, 7),
			(int)h.pid, sqlite3_column_bytes(st, 8) ? ", " : "",
			(const char *)sqlite3_column_text(st, 8));
		n++;
	}
	if (!e && rc != SQLITE_DONE)
		e = ST_SQLFAIL(db, rc, eb, "read leases");
	sqlite3_finalize(st);
	sqlite3_finalize(del);
	if (!e)
		e = prune_shared_locked(db, eb);
	if (!e && n_reaped)
		*n_reaped = n;
	return e;
}

td_err st__ledger_delete_job_locked(struct st_db *db, int64_t job, size_t *n, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "DELETE FROM ledger WHERE job = ?", &st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, job);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_DONE)
		*n = (size_t)sqlite3_changes(db->h);
	else
		e = ST_SQLFAIL(db, rc, eb, "release leases of job %lld", (long long)job);
	sqlite3_finalize(st);
	if (!e)
		e = prune_shared_locked(db, eb);
	return e;
}

/* ------------------------------------------------------------------------ */
/* Reserve, renew, release, reap */

/* Checks one request of a reservation and its device's cap; *limit gets the
 * share the ledger may hand out on that device, floor(total × factor). */
static td_err check_req(const struct st_lease_req *r, const struct st_device_cap *cap,
			uint64_t *limit, struct td_errbuf *eb)
{
	if (!r || !cap)
		return td_fail(eb, TD_EINVAL, "ledger reserve: no request");
	if (!r->gpu_uuid || !*r->gpu_uuid)
		return td_fail(eb, TD_EINVAL, "ledger reserve: no GPU UUID");
	if (r->bytes == 0 || r->bytes > (uint64_t)INT64_MAX)
		return td_fail(eb, TD_EINVAL, "ledger reserve on %s: %" PRIu64 " bytes is not a size",
			       r->gpu_uuid, r->bytes);
	if (!(cap->factor > 0.0 && cap->factor <= 1.0))
		return td_fail(eb, TD_EINVAL, "ledger reserve on %s: factor %g is not in (0, 1]",
			       r->gpu_uuid, cap->factor);
	if (cap->total_bytes == 0 || cap->total_bytes > (uint64_t)INT64_MAX)
		return td_fail(eb, TD_EINVAL, "ledger reserve on %s: device total %" PRIu64 " bytes",
			       r->gpu_uuid, cap->total_bytes);
	if (r->ttl_ms < 0)
		return td_fail(eb, TD_EINVAL, "ledger reserve on %s: negative ttl", r->gpu_uuid);
	uint64_t l = (uint64_t)((long double)cap->total_bytes * (long double)cap->factor);
	*limit = l > cap->total_bytes ? cap->total_bytes : l;
	return TD_OK;
}

/* Inserts the lease of r held by h inside the caller's transaction. */
static td_err insert_locked(struct st_db *db, const struct st_lease_req *r,
			    const struct st_holder *h, int64_t now, int64_t *id, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "INSERT INTO ledger (gpu_uuid, bytes, job, uid, pid, pid_start, boot_id, label,"
			       " created_ms, heartbeat_ms, expires_ms) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
			       &st, eb);
	if (e)
		return e;
	sqlite3_bind_text(st, 1, r->gpu_uuid, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 2, (int64_t)r->bytes);
	if (r->job_id)
		sqlite3_bind_int64(st, 3, r->job_id);
	else
		sqlite3_bind_null(st, 3);
	sqlite3_bind_int64(st, 4, r->uid);
	sqlite3_bind_int64(st, 5, h->pid);
	sqlite3_bind_int64(st, 6, (int64_t)h->start_time);
	sqlite3_bind_text(st, 7, h->boot_id, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 8, r->label ? r->label : "", -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 9, now);
	sqlite3_bind_int64(st, 10, now);
	sqlite3_bind_int64(st, 11, r->ttl_ms > 0 ? now + r->ttl_ms : 0);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_DONE)
		*id = sqlite3_last_insert_rowid(db->h);
	else
		e = ST_SQLFAIL(db, rc, eb, "insert lease on %s", r->gpu_uuid);
	sqlite3_finalize(st);
	return e;
}

/* The block of key on gpu: *id its id (0: none), *bytes its size. */
static td_err block_find_locked(struct st_db *db, const char *gpu, const char *key, int64_t *id,
				uint64_t *bytes, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "SELECT id, bytes FROM shared_blocks WHERE gpu_uuid = ? AND key = ?",
			       &st, eb);
	if (e)
		return e;
	sqlite3_bind_text(st, 1, gpu, -1, SQLITE_STATIC);
	sqlite3_bind_text(st, 2, key, -1, SQLITE_STATIC);
	int rc = sqlite3_step(st);
	*id = 0;
	if (rc == SQLITE_ROW) {
		*id = sqlite3_column_int64(st, 0);
		if (bytes)
			*bytes = (uint64_t)sqlite3_column_int64(st, 1);
	} else if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "read the shared block %s on %s", key, gpu);
	}
	sqlite3_finalize(st);
	return e;
}

/* Lease id holds r's block: the block found (block > 0), or a new one. */
static td_err hold_block_locked(struct st_db *db, const struct st_lease_req *r, int64_t block,
				int64_t lease, int64_t now, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e;
	int rc;
	if (!block) {
		if ((e = st__prepare(db,
				     "INSERT INTO shared_blocks (gpu_uuid, key, bytes, label, created_ms)"
				     " VALUES (?, ?, ?, ?, ?)",
				     &st, eb)))
			return e;
		sqlite3_bind_text(st, 1, r->gpu_uuid, -1, SQLITE_STATIC);
		sqlite3_bind_text(st, 2, r->share_key, -1, SQLITE_STATIC);
		sqlite3_bind_int64(st, 3, (int64_t)r->share_bytes);
		sqlite3_bind_text(st, 4, r->share_label ? r->share_label : "", -1, SQLITE_STATIC);
		sqlite3_bind_int64(st, 5, now);
		rc = sqlite3_step(st);
		sqlite3_finalize(st);
		if (rc != SQLITE_DONE)
			return ST_SQLFAIL(db, rc, eb, "insert a shared block on %s", r->gpu_uuid);
		block = sqlite3_last_insert_rowid(db->h);
	}
	if ((e = st__prepare(db, "INSERT INTO shared_holders (block, lease) VALUES (?, ?)", &st, eb)))
		return e;
	sqlite3_bind_int64(st, 1, block);
	sqlite3_bind_int64(st, 2, lease);
	rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE)
		return ST_SQLFAIL(db, rc, eb, "hold shared block %lld", (long long)block);
	return TD_OK;
}

td_err st_ledger_reserve(struct st_db *db, const struct st_lease_req *r,
			 const struct st_device_cap *cap, int64_t *lease_id, struct td_errbuf *eb)
{
	return st_ledger_reserve_gang(db, r, cap, 1, lease_id, eb);
}

td_err st_ledger_reserve_gang(struct st_db *db, const struct st_lease_req *r,
			      const struct st_device_cap *cap, size_t n, int64_t *lease_ids,
			      struct td_errbuf *eb)
{
	if (!r || !cap || n == 0)
		return td_fail(eb, TD_EINVAL, "ledger reserve: no request");
	if (n > ST_LEDGER_GANG_MAX)
		return td_fail(eb, TD_EINVAL, "ledger reserve: %zu leases at once, more than %d", n,
			       ST_LEDGER_GANG_MAX);
	uint64_t limit[ST_LEDGER_GANG_MAX];
	struct st_holder h[ST_LEDGER_GANG_MAX];
	td_err e;
	for (size_t i = 0; i < n; i++) {
		if ((e = check_req(&r[i], &cap[i], &limit[i], eb)))
			return e;
		if (r[i].share_key && (!*r[i].share_key || r[i].share_bytes == 0 ||
				       r[i].share_bytes > (uint64_t)INT64_MAX - r[i].bytes))
			return td_fail(eb, TD_EINVAL, "ledger reserve on %s: a shared block needs a key "
				       "and a size", r[i].gpu_uuid);
		/* One lease per GPU: a second one would be checked against a sum
		 * that does not hold the first. */
		for (size_t k = 0; k < i; k++)
			if (strcmp(r[k].gpu_uuid, r[i].gpu_uuid) == 0)
				return td_fail(eb, TD_EINVAL, "ledger reserve: %s is named twice in one "
					       "reservation", r[i].gpu_uuid);
	}
	for (size_t i = 0; i < n; i++) {
		if (i && r[i].pid == r[i - 1].pid) {
			h[i] = h[i - 1];
			continue;
		}
		if ((e = st_holder_of(r[i].pid, &h[i], eb)))
			return e;
	}
	char gang[48] = "";
	if (n > 1)
		snprintf(gang, sizeof(gang), "gang of %zu GPUs, none granted: ", n);

	st__lock(db);
	e = st__begin(db, eb);
	if (e)
		goto out;
	size_t reaped = 0;
	if ((e = reap_locked(db, &reaped, eb)))
		goto fail;
	for (size_t i = 0; i < n; i++) {
		if (!r[i].job_id || (i && r[i].job_id == r[i - 1].job_id))
			continue;
		bool exists = false;
		if ((e = st__job_exists_locked(db, r[i].job_id, &exists, eb)))
			goto fail;
		if (!exists) {
			e = td_fail(eb, TD_ENOENT, "ledger reserve on %s: job %lld does not exist",
				    r[i].gpu_uuid, (long long)r[i].job_id);
			goto fail;
		}
	}
	/* Every GPU's own check before any insert: all or none. A lease that
	 * makes its shared block brings the block's bytes too. */
	int64_t block[ST_LEDGER_GANG_MAX] = {0};
	for (size_t i = 0; i < n; i++) {
		uint64_t reserved = 0;
		uint32_t nleases = 0;
		if ((e = sum_locked(db, r[i].gpu_uuid, &reserved, &nleases, eb)))
			goto fail;
		if (r[i].share_key &&
		    (e = block_find_locked(db, r[i].gpu_uuid, r[i].share_key, &block[i], NULL, eb)))
			goto fail;
		uint64_t want = r[i].bytes + (r[i].share_key && !block[i] ? r[i].share_bytes : 0);
		uint64_t avail = limit[i] > reserved ? limit[i] - reserved : 0;
		if (want <= avail && want <= cap[i].free_bytes_now)
			continue;
		char b1[32], b2[32], b3[32], b4[32];
		if (want > avail)
			e = td_fail(eb, TD_EBUSY,
				    "%s%s: %s requested, %s available (%s \u00d7 %.2f \u2212 %s reserved by "
				    "%u lease%s)",
				    gang, r[i].gpu_uuid, fmt_bytes(want, b1, sizeof(b1)),
				    fmt_bytes(avail, b2, sizeof(b2)),
				    fmt_bytes(cap[i].total_bytes, b3, sizeof(b3)), cap[i].factor,
				    fmt_bytes(reserved, b4, sizeof(b4)), nleases, nleases == 1 ? "" : "s");
		else
			e = td_fail(eb, TD_EBUSY,
				    "%s%s: %s requested, but the device has only %s free (memory used "
				    "outside the ledger)",
				    gang, r[i].gpu_uuid, fmt_bytes(want, b1, sizeof(b1)),
				    fmt_bytes(cap[i].free_bytes_now, b2, sizeof(b2)));
		/* Keep what the reaping freed: commit it, then report the refusal. */
		struct td_errbuf ceb;
		if (reaped && st__commit(db, &ceb) == TD_OK)
			goto out;
		goto fail;
	}
	int64_t now = st_now_ms();
	int64_t ids[ST_LEDGER_GANG_MAX];
	for (size_t i = 0; i < n; i++)
		if ((e = insert_locked(db, &r[i], &h[i], now, &ids[i], eb)) ||
		    (r[i].share_key && (e = hold_block_locked(db, &r[i], block[i], ids[i], now, eb))))
			goto fail;
	/* The invariant, checked where it must hold: inside the transaction that
	 * would break it, on every GPU of the reservation. */
	for (size_t i = 0; i < n; i++) {
		uint64_t after = 0;
		if ((e = sum_locked(db, r[i].gpu_uuid, &after, NULL, eb)))
			goto fail;
		if (after > limit[i]) {
			td_err_log("TD-ST-LEDGER-INVARIANT", "%s: %s oversubscribed: %" PRIu64 " > %" PRIu64,
				   db->path, r[i].gpu_uuid, after, limit[i]);
			e = td_fail(eb, TD_EINTERNAL,
				    "%s: ledger invariant broken (%" PRIu64 " > %" PRIu64 ")",
				    r[i].gpu_uuid, after, limit[i]);
			goto fail;
		}
	}
	e = st__commit(db, eb);
	if (!e)
		memcpy(lease_ids, ids, n * sizeof(*ids));
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

/* Checks that caller may act on lease id (inside the caller's transaction). */
static td_err check_holder_locked(struct st_db *db, int64_t id, uid_t caller_uid, bool admin,
				  const char *verb, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "SELECT uid FROM ledger WHERE id = ?", &st, eb);
	if (e)
		return e;
	sqlite3_bind_int64(st, 1, id);
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW) {
		uid_t owner = (uid_t)sqlite3_column_int64(st, 0);
		if (owner != caller_uid && caller_uid != 0 && !admin)
			e = td_fail(eb, TD_EPERM, "lease %lld belongs to uid %u; uid %u may not %s it",
				    (long long)id, (unsigned)owner, (unsigned)caller_uid, verb);
	} else if (rc == SQLITE_DONE) {
		e = td_fail(eb, TD_ENOENT, "lease %lld does not exist (released or reaped)",
			    (long long)id);
	} else {
		e = ST_SQLFAIL(db, rc, eb, "read lease %lld", (long long)id);
	}
	sqlite3_finalize(st);
	return e;
}

/* Runs one write statement on lease id after the holder check. */
static td_err lease_write(struct st_db *db, int64_t id, uid_t caller_uid, bool admin,
			  const char *verb, const char *sql, int64_t a, int64_t b,
			  struct td_errbuf *eb)
{
	st__lock(db);
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	if ((e = check_holder_locked(db, id, caller_uid, admin, verb, eb)))
		goto fail;
	sqlite3_stmt *st;
	if ((e = st__prepare(db, sql, &st, eb)))
		goto fail;
	sqlite3_bind_int64(st, 1, id);
	if (sqlite3_bind_parameter_count(st) >= 3) {
		sqlite3_bind_int64(st, 2, a);
		sqlite3_bind_int64(st, 3, b);
	}
	int rc = sqlite3_step(st);
	sqlite3_finalize(st);
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "%s lease %lld", verb, (long long)id);
		goto fail;
	}
	if ((e = prune_shared_locked(db, eb)))
		goto fail;
	e = st__commit(db, eb);
	goto out;
fail:
	st__rollback(db);
out:
	st__unlock(db);
	return e;
}

td_err st_ledger_heartbeat(struct st_db *db, int64_t lease_id, int64_t ttl_ms, uid_t caller_uid,
			   bool caller_is_admin, struct td_errbuf *eb)
{
	if (ttl_ms < 0)
		return td_fail(eb, TD_EINVAL, "lease %lld: negative ttl", (long long)lease_id);
	int64_t now = st_now_ms();
	return lease_write(db, lease_id, caller_uid, caller_is_admin, "renew",
			   "UPDATE ledger SET heartbeat_ms = ?2, expires_ms = ?3 WHERE id = ?1", now,
			   ttl_ms > 0 ? now + ttl_ms : 0, eb);
}

td_err st_ledger_release(struct st_db *db, int64_t lease_id, uid_t caller_uid,
			 bool caller_is_admin, struct td_errbuf *eb)
{
	return lease_write(db, lease_id, caller_uid, caller_is_admin, "release",
			   "DELETE FROM ledger WHERE id = ?1", 0, 0, eb);
}

td_err st_ledger_release_job(struct st_db *db, int64_t job, size_t *n, struct td_errbuf *eb)
{
	st__lock(db);
	size_t cnt = 0;
	td_err e = st__begin(db, eb);
	if (!e) {
		e = st__ledger_delete_job_locked(db, job, &cnt, eb);
		if (e)
			st__rollback(db);
		else
			e = st__commit(db, eb);
	}
	st__unlock(db);
	if (!e && n)
		*n = cnt;
	return e;
}

td_err st_ledger_reap(struct st_db *db, size_t *n, struct td_errbuf *eb)
{
	st__lock(db);
	size_t cnt = 0;
	td_err e = st__begin(db, eb);
	if (!e) {
		e = reap_locked(db, &cnt, eb);
		if (e)
			st__rollback(db);
		else
			e = st__commit(db, eb);
	}
	st__unlock(db);
	if (!e && n)
		*n = cnt;
	return e;
}

/* ------------------------------------------------------------------------ */
/* Reading */

static td_err lease_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	(void)db, (void)eb;
	struct st_lease *l = item;
	l->id = sqlite3_column_int64(st, 0);
	st__col_copy(st, 1, l->gpu_uuid, sizeof(l->gpu_uuid));
	l->bytes = (uint64_t)sqlite3_column_int64(st, 2);
	l->job_id = sqlite3_column_int64(st, 3);
	l->uid = (uid_t)sqlite3_column_int64(st, 4);
	l->holder.pid = (pid_t)sqlite3_column_int64(st, 5);
	l->holder.start_time = (uint64_t)sqlite3_column_int64(st, 6);
	st__col_copy(st, 7, l->holder.boot_id, sizeof(l->holder.boot_id));
	st__col_copy(st, 8, l->label, sizeof(l->label));
	l->created_ms = sqlite3_column_int64(st, 9);
	l->heartbeat_ms = sqlite3_column_int64(st, 10);
	l->expires_ms = sqlite3_column_int64(st, 11);
	return TD_OK;
}

/* Leases on gpu_uuid (NULL: any) of job (0: any). */
static td_err list_leases(struct st_db *db, const char *gpu_uuid, int64_t job,
			  struct st_lease **out, size_t *n, struct td_errbuf *eb)
{
	static const struct st__rowset lease_rows = {.size = sizeof(struct st_lease),
						     .fill = lease_row};
	void *rows;
	td_err e = ST_SELECT(db, &lease_rows, &rows, n, eb,
			     "SELECT id, gpu_uuid, bytes, coalesce(job, 0), uid, pid, pid_start, boot_id,"
			     " label, created_ms, heartbeat_ms, expires_ms FROM ledger"
			     " WHERE (?1 IS NULL OR gpu_uuid = ?1) AND (?2 = 0 OR job = ?2) ORDER BY id",
			     ST_ARGS(ST_TEXT(gpu_uuid), ST_INT(job)), "list leases");
	if (!e)
		*out = rows;
	return e;
}

td_err st_ledger_list(struct st_db *db, const char *gpu_uuid, struct st_lease **out, size_t *n,
		      struct td_errbuf *eb)
{
	return list_leases(db, gpu_uuid, 0, out, n, eb);
}

td_err st_ledger_list_job(struct st_db *db, int64_t job, struct st_lease **out, size_t *n,
			  struct td_errbuf *eb)
{
	if (job <= 0)
		return td_fail(eb, TD_EINVAL, "ledger: job %lld is not a job id", (long long)job);
	return list_leases(db, NULL, job, out, n, eb);
}

td_err st_ledger_reserved(struct st_db *db, const char *gpu_uuid, uint64_t *bytes,
			  struct td_errbuf *eb)
{
	if (!gpu_uuid || !*gpu_uuid)
		return td_fail(eb, TD_EINVAL, "ledger: no GPU UUID");
	st__lock(db);
	uint64_t sum = 0;
	td_err e = sum_locked(db, gpu_uuid, &sum, NULL, eb);
	st__unlock(db);
	if (!e)
		*bytes = sum;
	return e;
}

td_err st_ledger_shared_find(struct st_db *db, const char *gpu_uuid, const char *key, bool *found,
			     uint64_t *bytes, struct td_errbuf *eb)
{
	if (!gpu_uuid || !*gpu_uuid || !key || !*key)
		return td_fail(eb, TD_EINVAL, "ledger: no GPU UUID or key");
	st__lock(db);
	int64_t id = 0;
	td_err e = block_find_locked(db, gpu_uuid, key, &id, bytes, eb);
	st__unlock(db);
	if (!e)
		*found = id != 0;
	return e;
}

/* A shared block and its holders (a second statement, under the lock
 * ST_SELECT holds). */
static td_err shared_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	struct st_shared *b = item;
	memset(b, 0, sizeof(*b));
	b->id = sqlite3_column_int64(st, 0);
	st__col_copy(st, 1, b->gpu_uuid, sizeof(b->gpu_uuid));
	st__col_copy(st, 2, b->key, sizeof(b->key));
	b->bytes = (uint64_t)sqlite3_column_int64(st, 3);
	st__col_copy(st, 4, b->label, sizeof(b->label));
	b->created_ms = sqlite3_column_int64(st, 5);
	sqlite3_stmt *hs;
	td_err e = st__prepare(db,
			       "SELECT h.lease, coalesce(l.job, 0), l.uid FROM shared_holders h"
			       " JOIN ledger l ON l.id = h.lease WHERE h.block = ? ORDER BY h.lease",
			       &hs, eb);
	if (e)
		return e;
	sqlite3_bind_int64(hs, 1, b->id);
	int rc;
	while ((rc = sqlite3_step(hs)) == SQLITE_ROW) {
		if (b->nholders < ST_SHARED_HOLDERS_MAX) {
			b->holders[b->nholders].lease = sqlite3_column_int64(hs, 0);
			b->holders[b->nholders].job = sqlite3_column_int64(hs, 1);
			b->holders[b->nholders].uid = (uid_t)sqlite3_column_int64(hs, 2);
		}
		b->nholders++;
	}
	if (rc != SQLITE_DONE)
		e = ST_SQLFAIL(db, rc, eb, "read the holders of shared block %lld", (long long)b->id);
	sqlite3_finalize(hs);
	return e;
}

td_err st_ledger_list_shared(struct st_db *db, const char *gpu_uuid, struct st_shared **out,
			     size_t *n, struct td_errbuf *eb)
{
	static const struct st__rowset shared_rows = {.size = sizeof(struct st_shared),
						      .fill = shared_row};
	void *rows;
	td_err e = ST_SELECT(db, &shared_rows, &rows, n, eb,
			     "SELECT id, gpu_uuid, key, bytes, label, created_ms FROM shared_blocks"
			     " WHERE ?1 IS NULL OR gpu_uuid = ?1 ORDER BY id",
			     ST_ARGS(ST_TEXT(gpu_uuid)), "list shared blocks");
	if (!e)
		*out = rows;
	return e;
}
