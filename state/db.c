/* The database handle: open, pragmas, schema migrations, sqlite error mapping
 * and the transaction helpers the other files of state/ use. Not the tables'
 * logic: jobs.c, ledger.c and cache.c own theirs. */
#include "state/internal.h"

#include "proto/log.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* PRAGMA application_id: 'TRND'. A sqlite file with another id is not ours. */
#define ST_APP_ID 0x54524e44

/* Migration N (1-based) brings user_version from N-1 to N. Append only; never
 * edit a released migration: a database in the field has already run it. */
static const char *const migrations[] = {
	/* 1: the first schema. */
	"CREATE TABLE jobs ("
	"  id INTEGER PRIMARY KEY AUTOINCREMENT,"
	"  name TEXT NOT NULL DEFAULT '',"
	"  spec BLOB NOT NULL,"
	"  uid INTEGER NOT NULL,"
	"  gid INTEGER NOT NULL,"
	"  state TEXT NOT NULL CHECK (state IN ('QUEUED','ADMITTED','PREPARING','RUNNING',"
	"                                       'SUCCEEDED','FAILED','CANCELLED','INTERRUPTED')),"
	"  reason TEXT NOT NULL DEFAULT '',"
	"  priority INTEGER NOT NULL DEFAULT 0,"
	"  submit_ms INTEGER NOT NULL,"
	"  start_ms INTEGER NOT NULL DEFAULT 0,"
	"  end_ms INTEGER NOT NULL DEFAULT 0,"
	"  updated_ms INTEGER NOT NULL,"
	"  device TEXT NOT NULL DEFAULT '',"
	"  ckpt_path TEXT NOT NULL DEFAULT '',"
	"  ckpt_step INTEGER NOT NULL DEFAULT 0,"
	"  attempts INTEGER NOT NULL DEFAULT 0,"
	"  cancel_requested INTEGER NOT NULL DEFAULT 0 CHECK (cancel_requested IN (0, 1))"
	") STRICT;"
	"CREATE INDEX jobs_by_state ON jobs(state, uid);"
	"CREATE INDEX jobs_by_uid ON jobs(uid, id);"
	"CREATE TABLE job_events ("
	"  id INTEGER PRIMARY KEY AUTOINCREMENT,"
	"  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
	"  time_ms INTEGER NOT NULL,"
	"  kind TEXT NOT NULL,"
	"  message TEXT NOT NULL"
	") STRICT;"
	"CREATE INDEX job_events_by_job ON job_events(job, id);"
	"CREATE TABLE metrics ("
	"  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
	"  step INTEGER NOT NULL,"
	"  time_ms INTEGER NOT NULL,"
	"  loss REAL, lr REAL, grad_norm REAL, tokens_per_s REAL, eval_loss REAL,"
	"  PRIMARY KEY (job, step)"
	") STRICT, WITHOUT ROWID;"
	"CREATE TABLE ledger ("
	"  id INTEGER PRIMARY KEY AUTOINCREMENT,"
	"  gpu_uuid TEXT NOT NULL CHECK (gpu_uuid <> ''),"
	"  bytes INTEGER NOT NULL CHECK (bytes > 0),"
	"  job INTEGER REFERENCES jobs(id) ON DELETE SET NULL,"
	"  uid INTEGER NOT NULL,"
	"  pid INTEGER NOT NULL CHECK (pid > 0),"
	"  pid_start INTEGER NOT NULL,"
	"  boot_id TEXT NOT NULL,"
	"  label TEXT NOT NULL DEFAULT '',"
	"  created_ms INTEGER NOT NULL,"
	"  heartbeat_ms INTEGER NOT NULL,"
	"  expires_ms INTEGER NOT NULL DEFAULT 0"
	") STRICT;"
	"CREATE INDEX ledger_by_gpu ON ledger(gpu_uuid);"
	"CREATE INDEX ledger_by_job ON ledger(job);"
	"CREATE TABLE module_cache ("
	"  key TEXT PRIMARY KEY,"
	"  path TEXT NOT NULL,"
	"  sha256 TEXT NOT NULL,"
	"  arch TEXT NOT NULL,"
	"  size_bytes INTEGER NOT NULL,"
	"  src_bytes INTEGER NOT NULL,"
	"  created_ms INTEGER NOT NULL,"
	"  used_ms INTEGER NOT NULL,"
	"  hits INTEGER NOT NULL DEFAULT 0"
	") STRICT;",

	/* 2: operating a shared host (issue 14): holds, dependencies, and the
	 * accounting. A job's usage is accrued into hourly buckets (usage) up
	 * to jobs.acct_ms, on every state change and on the housekeeping tick;
	 * a database of version 1 gets acct_ms 0, which the next accrual sets
	 * without counting the time before it. */
	"ALTER TABLE jobs ADD COLUMN held INTEGER NOT NULL DEFAULT 0 CHECK (held IN (0, 1));"
	"ALTER TABLE jobs ADD COLUMN acct_ms INTEGER NOT NULL DEFAULT 0;"
	"CREATE TABLE job_deps ("
	"  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
	"  dep INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
	"  PRIMARY KEY (job, dep)"
	") STRICT, WITHOUT ROWID;"
	"CREATE INDEX job_deps_by_dep ON job_deps(dep);"
	"CREATE TABLE usage ("
	"  job INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,"
	"  hour INTEGER NOT NULL,"
	"  uid INTEGER NOT NULL,"
	"  queued_ms INTEGER NOT NULL DEFAULT 0,"
	"  run_ms INTEGER NOT NULL DEFAULT 0,"
	"  gpu_ms INTEGER NOT NULL DEFAULT 0,"
	"  cpu_ms INTEGER NOT NULL DEFAULT 0,"
	"  gpu_mem_bs REAL NOT NULL DEFAULT 0,"
	"  tokens INTEGER NOT NULL DEFAULT 0,"
	"  PRIMARY KEY (job, hour)"
	") STRICT, WITHOUT ROWID;"
	"CREATE INDEX usage_by_uid ON usage(uid, hour);"
	"CREATE INDEX usage_by_hour ON usage(hour);",

	/* 3: shared frozen bases (issue 11, item 5). A block is memory on a GPU
	 * that several leases use at once (one frozen base, loaded once); it
	 * is reserved with its first holder's lease, counted once in the GPU's
	 * sum, and goes with its last holder (ledger.c: prune_shared_locked),
	 * so a reaped or released lease takes its share of a block with it. */
	"CREATE TABLE shared_blocks ("
	"  id INTEGER PRIMARY KEY AUTOINCREMENT,"
	"  gpu_uuid TEXT NOT NULL CHECK (gpu_uuid <> ''),"
	"  key TEXT NOT NULL CHECK (key <> ''),"
	"  bytes INTEGER NOT NULL CHECK (bytes > 0),"
	"  label TEXT NOT NULL DEFAULT '',"
	"  created_ms INTEGER NOT NULL,"
	"  UNIQUE (gpu_uuid, key)"
	") STRICT;"
	"CREATE TABLE shared_holders ("
	"  block INTEGER NOT NULL REFERENCES shared_blocks(id) ON DELETE CASCADE,"
	"  lease INTEGER NOT NULL REFERENCES ledger(id) ON DELETE CASCADE,"
	"  PRIMARY KEY (block, lease)"
	") STRICT, WITHOUT ROWID;"
	"CREATE INDEX shared_holders_by_lease ON shared_holders(lease);",
};
_Static_assert(sizeof(migrations) / sizeof(migrations[0]) == ST_SCHEMA_VERSION,
	       "one migration per schema version");

int64_t st_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

td_err st__map_sqlite(int rc)
{
	switch (rc & 0xff) {
	case SQLITE_OK:
	case SQLITE_ROW:
	case SQLITE_DONE:
		return TD_OK;
	case SQLITE_BUSY:
	case SQLITE_LOCKED:
		return TD_EBUSY;
	case SQLITE_NOMEM:
		return TD_ENOMEM;
	case SQLITE_CORRUPT:
	case SQLITE_NOTADB:
	case SQLITE_FORMAT:
		return TD_EFORMAT;
	case SQLITE_CANTOPEN:
		return TD_ENOENT;
	case SQLITE_PERM:
	case SQLITE_READONLY:
	case SQLITE_AUTH:
		return TD_EPERM;
	case SQLITE_IOERR:
	case SQLITE_FULL:
	case SQLITE_PROTOCOL:
		return TD_EIO;
	case SQLITE_CONSTRAINT:
	case SQLITE_MISMATCH:
		return TD_EINVAL;
	case SQLITE_TOOBIG:
	case SQLITE_RANGE:
		return TD_ERANGE;
	default:
		return TD_EINTERNAL;
	}
}

td_err st__sqlfail(struct st_db *db, int rc, struct td_errbuf *eb, const char *file, int line,
		   const char *fmt, ...)
{
	char what[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(what, sizeof(what), fmt, ap);
	va_end(ap);
	const char *smsg = db && db->h ? sqlite3_errmsg(db->h) : sqlite3_errstr(rc);
	/* errmsg may describe a later call than rc if the caller did more work;
	 * fall back to the code's own string when they disagree. */
	if (db && db->h && (sqlite3_extended_errcode(db->h) & 0xff) != (rc & 0xff))
		smsg = sqlite3_errstr(rc);
	td_err code = st__map_sqlite(rc);
	if (code == TD_ENOENT && db && db->h) {
		int e = sqlite3_system_errno(db->h);
		if (e == EACCES || e == EPERM || e == EROFS)
			code = TD_EPERM;
	}
	const char *path = db && db->path ? db->path : "state";
	td_log_write(TD_LOG_ERR, "TD-ST-SQLITE", file, line, "%s: %s: %s (sqlite %d)", path, what,
		     smsg, rc);
	return td_fail(eb, code, "%s: %s: %s", path, what, smsg);
}

void st__lock(struct st_db *db)
{
	pthread_mutex_lock(&db->mu);
}

void st__unlock(struct st_db *db)
{
	pthread_mutex_unlock(&db->mu);
}

static td_err exec_sql(struct st_db *db, const char *sql, const char *what, struct td_errbuf *eb)
{
	int rc = sqlite3_exec(db->h, sql, NULL, NULL, NULL);
	if (rc != SQLITE_OK)
		return ST_SQLFAIL(db, rc, eb, "%s", what);
	return TD_OK;
}

td_err st__begin(struct st_db *db, struct td_errbuf *eb)
{
	return exec_sql(db, "BEGIN IMMEDIATE", "begin transaction", eb);
}

td_err st__commit(struct st_db *db, struct td_errbuf *eb)
{
	int rc = sqlite3_exec(db->h, "COMMIT", NULL, NULL, NULL);
	if (rc != SQLITE_OK) {
		td_err e = ST_SQLFAIL(db, rc, eb, "commit");
		st__rollback(db);
		return e;
	}
	return TD_OK;
}

void st__rollback(struct st_db *db)
{
	if (!sqlite3_get_autocommit(db->h))
		sqlite3_exec(db->h, "ROLLBACK", NULL, NULL, NULL);
}

td_err st__prepare(struct st_db *db, const char *sql, sqlite3_stmt **st, struct td_errbuf *eb)
{
	int rc = sqlite3_prepare_v2(db->h, sql, -1, st, NULL);
	if (rc != SQLITE_OK) {
		*st = NULL;
		return ST_SQLFAIL(db, rc, eb, "prepare \"%.60s\"", sql);
	}
	return TD_OK;
}

char *st__col_strdup(sqlite3_stmt *st, int col)
{
	const unsigned char *t = sqlite3_column_text(st, col);
	return strdup(t ? (const char *)t : "");
}

void st__col_copy(sqlite3_stmt *st, int col, char *buf, size_t size)
{
	const unsigned char *t = sqlite3_column_text(st, col);
	snprintf(buf, size, "%s", t ? (const char *)t : "");
}

static td_err rows_v(struct st_db *db, sqlite3_stmt *st, const struct st__rowset *set,
		     void **items, size_t *n, struct td_errbuf *eb, const char *file, int line,
		     const char *fmt, va_list ap) __attribute__((format(printf, 9, 0)));

static td_err rows_v(struct st_db *db, sqlite3_stmt *st, const struct st__rowset *set,
		     void **items, size_t *n, struct td_errbuf *eb, const char *file, int line,
		     const char *fmt, va_list ap)
{
	unsigned char *arr = NULL;
	size_t cnt = 0, cap = 0;
	td_err e = TD_OK;
	bool oom = false;
	int rc;
	while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
		if (cnt == cap) {
			size_t nc = cap ? 2 * cap : 16;
			unsigned char *p = realloc(arr, nc * set->size);
			if (!p) {
				oom = true;
				break;
			}
			arr = p;
			cap = nc;
		}
		void *item = arr + cnt++ * set->size;
		memset(item, 0, set->size);
		if ((e = set->fill(db, st, item, eb)) != TD_OK)
			break;
	}
	if (!e && rc != SQLITE_DONE) {
		char what[512];
		vsnprintf(what, sizeof(what), fmt, ap);
		e = oom ? td_fail(eb, TD_ENOMEM, "%s: %s: out of memory", db->path, what)
			: st__sqlfail(db, rc, eb, file, line, "%s", what);
	}
	if (e) {
		if (set->free)
			set->free(arr, cnt);
		else
			free(arr);
		return e;
	}
	*items = arr;
	*n = cnt;
	return TD_OK;
}

td_err st__rows(struct st_db *db, sqlite3_stmt *st, const struct st__rowset *set, void **items,
		size_t *n, struct td_errbuf *eb, const char *file, int line, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	td_err e = rows_v(db, st, set, items, n, eb, file, line, fmt, ap);
	va_end(ap);
	return e;
}

td_err st__select(struct st_db *db, const char *sql, const struct st__arg *args, size_t nargs,
		  const struct st__rowset *set, void **items, size_t *n, struct td_errbuf *eb,
		  const char *file, int line, const char *fmt, ...)
{
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db, sql, &st, eb);
	if (!e) {
		for (size_t i = 0; i < nargs; i++) {
			int k = (int)i + 1;
			if (!args[i].text)
				sqlite3_bind_int64(st, k, args[i].i);
			else if (args[i].s)
				sqlite3_bind_text(st, k, args[i].s, -1, SQLITE_STATIC);
			else
				sqlite3_bind_null(st, k);
		}
		va_list ap;
		va_start(ap, fmt);
		e = rows_v(db, st, set, items, n, eb, file, line, fmt, ap);
		va_end(ap);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	return e;
}

/* The busy handler: short sleeps with jitter until the timeout. sqlite's own
 * handler backs off to 100 ms sleeps, which starves a waiter while locks are
 * held for well under a millisecond; this one keeps waiters close behind. */
static int busy_handler(void *arg, int count)
{
	struct st_db *db = arg;
	int64_t now = st_now_ms();
	if (count == 0)
		db->busy_since_ms = now;
	if (now - db->busy_since_ms >= db->busy_timeout_ms)
		return 0;
	/* 100 µs .. 2 ms, growing with the count, jittered by the address of a
	 * local and the count so that waiters spread out. */
	unsigned cap = count < 4 ? 250u << count : 2000u;
	unsigned jitter = (unsigned)(((uintptr_t)&now >> 4) * 2654435761u + (unsigned)count * 40503u);
	unsigned us = 100 + jitter % cap;
	struct timespec ts = {0, (long)us * 1000};
	nanosleep(&ts, NULL);
	return 1;
}

static td_err pragma_int(struct st_db *db, const char *sql, int *out, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, sql, &st, eb);
	if (e)
		return e;
	int rc = sqlite3_step(st);
	if (rc == SQLITE_ROW)
		*out = sqlite3_column_int(st, 0);
	else
		e = ST_SQLFAIL(db, rc, eb, "%s", sql);
	sqlite3_finalize(st);
	return e;
}

/* Refuses a sqlite file that is not ours: another application_id, or no id but
 * tables (someone's database at our path). */
static td_err check_identity(struct st_db *db, struct td_errbuf *eb)
{
	int app = 0, ver = 0, ntables = 0;
	td_err e = pragma_int(db, "PRAGMA application_id", &app, eb);
	if (!e)
		e = pragma_int(db, "PRAGMA user_version", &ver, eb);
	if (!e)
		e = pragma_int(db, "SELECT count(*) FROM sqlite_schema", &ntables, eb);
	if (e)
		return e;
	if (app != 0 && app != ST_APP_ID)
		return td_fail(eb, TD_EFORMAT,
			       "%s: a sqlite database of another application (application_id "
			       "0x%08x); move it aside or use another state directory",
			       db->path, (unsigned)app);
	if (app == 0 && ntables > 0)
		return td_fail(eb, TD_EFORMAT,
			       "%s: a sqlite database that is not traind's (%d schema objects, no "
			       "traind id); move it aside or use another state directory",
			       db->path, ntables);
	if (ver > ST_SCHEMA_VERSION)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "%s: schema version %d was written by a newer traind (this one "
			       "supports up to %d); upgrade traind or use another state directory",
			       db->path, ver, ST_SCHEMA_VERSION);
	return TD_OK;
}

/* Checks the file is ours, then runs migrations version+1 ..
 * ST_SCHEMA_VERSION, one transaction each. Both happen under the write lock: a
 * process that migrated the file while we waited has done the work, and we
 * never see half of it. */
static td_err migrate(struct st_db *db, struct td_errbuf *eb)
{
	for (;;) {
		td_err e = st__begin(db, eb);
		if (e)
			return e;
		/* Under the write lock: what we read is what a concurrent opener
		 * has committed, all of it. */
		e = check_identity(db, eb);
		if (e)
			goto fail;
		int v = 0;
		e = pragma_int(db, "PRAGMA user_version", &v, eb);
		if (e)
			goto fail;
		if (v == ST_SCHEMA_VERSION) {
			db->version = v;
			return st__commit(db, eb);
		}
		char what[64];
		snprintf(what, sizeof(what), "migration to schema version %d", v + 1);
		e = exec_sql(db, migrations[v], what, eb);
		if (e)
			goto fail;
		char sql[96];
		snprintf(sql, sizeof(sql), "PRAGMA user_version = %d; PRAGMA application_id = %d",
			 v + 1, ST_APP_ID);
		e = exec_sql(db, sql, what, eb);
		if (e)
			goto fail;
		e = st__commit(db, eb);
		if (e)
			return e;
		td_info("TD-ST-MIGRATE", "%s: schema migrated to version %d", db->path, v + 1);
		continue;
	fail:
		st__rollback(db);
		return e;
	}
}

static td_err quick_check(struct st_db *db, struct td_errbuf *eb)
{
	sqlite3_stmt *st;
	td_err e = st__prepare(db, "PRAGMA quick_check(5)", &st, eb);
	if (e)
		return e;
	char first[256] = "";
	int rows = 0, rc;
	while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
		if (rows++ == 0)
			st__col_copy(st, 0, first, sizeof(first));
	}
	if (rc != SQLITE_DONE)
		e = ST_SQLFAIL(db, rc, eb, "integrity check");
	else if (rows != 1 || strcmp(first, "ok") != 0)
		e = td_fail(eb, TD_EFORMAT,
			    "%s: the database is damaged (integrity check: %s); move it aside "
			    "(jobs in it are lost) or restore a backup",
			    db->path, first);
	sqlite3_finalize(st);
	return e;
}

/* Creates path with mode if it does not exist, so that the file (and the -wal
 * and -shm files sqlite gives the same mode) never depends on the umask. */
static td_err create_file(const char *path, unsigned mode, bool no_create, struct td_errbuf *eb)
{
	int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, (mode_t)mode);
	if (fd >= 0) {
		td_err e = TD_OK;
		if (fchmod(fd, (mode_t)mode) != 0)
			e = td_fail(eb, td_from_errno(errno), "%s: chmod %o: %s", path, mode,
				    strerror(errno));
		close(fd);
		return e;
	}
	if (errno == EEXIST)
		return TD_OK;
	(void)no_create;
	return td_fail(eb, td_from_errno(errno), "%s: cannot create the state database: %s", path,
		       strerror(errno));
}

td_err st_open(struct st_db **out, const char *path, const struct st_open_opts *opts,
	       struct td_errbuf *eb)
{
	static const struct st_open_opts defaults = {0};
	if (!opts)
		opts = &defaults;
	if (!path || !*path)
		return td_fail(eb, TD_EINVAL, "state database: empty path");

	struct stat sb;
	if (stat(path, &sb) != 0) {
		if (errno != ENOENT || opts->no_create)
			return td_fail(eb, td_from_errno(errno), "%s: %s", path, strerror(errno));
		td_err e = create_file(path, opts->file_mode ? opts->file_mode : 0600, false, eb);
		if (e)
			return e;
	} else if (!S_ISREG(sb.st_mode)) {
		return td_fail(eb, TD_EINVAL, "%s: not a regular file", path);
	}

	struct st_db *db = calloc(1, sizeof(*db));
	if (!db || !(db->path = strdup(path))) {
		free(db);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	}
	pthread_mutex_init(&db->mu, NULL);
	db->busy_timeout_ms = opts->busy_timeout_ms > 0 ? opts->busy_timeout_ms : ST_BUSY_TIMEOUT_MS;

	td_err e;
	int rc = sqlite3_open_v2(path, &db->h, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL);
	if (rc != SQLITE_OK) {
		e = ST_SQLFAIL(db, rc, eb, "open");
		goto fail;
	}
	sqlite3_extended_result_codes(db->h, 1);
	sqlite3_busy_handler(db->h, busy_handler, db);

	/* The first read of the file: a file that is not sqlite fails here.
	 * Switching a new file to WAL needs an exclusive lock, and sqlite does not
	 * run the busy handler for it: openers racing on a fresh file retry. */
	char mode[16] = "";
	int64_t deadline = st_now_ms() + db->busy_timeout_ms;
	for (int attempt = 0;; attempt++) {
		sqlite3_stmt *st = NULL;
		rc = sqlite3_prepare_v2(db->h, "PRAGMA journal_mode = WAL", -1, &st, NULL);
		if (rc == SQLITE_OK) {
			rc = sqlite3_step(st);
			if (rc == SQLITE_ROW)
				st__col_copy(st, 0, mode, sizeof(mode));
		}
		sqlite3_finalize(st);
		if ((rc & 0xff) != SQLITE_BUSY || st_now_ms() >= deadline)
			break;
		busy_handler(db, attempt);
	}
	if (rc != SQLITE_ROW) {
		e = ST_SQLFAIL(db, rc, eb, "open (set WAL journal)");
		goto fail_clear;
	}
	if (strcmp(mode, "wal") != 0) {
		e = td_fail(eb, TD_EUNSUPPORTED,
			    "%s: cannot use a WAL journal here (journal mode stays \"%s\"); put the "
			    "state directory on a local file system",
			    path, mode);
		goto fail;
	}
	e = exec_sql(db, "PRAGMA foreign_keys = ON; PRAGMA synchronous = NORMAL", "set pragmas", eb);
	if (e)
		goto fail;
	if (opts->integrity_check && (e = quick_check(db, eb)))
		goto fail;
	e = migrate(db, eb);
	if (e)
		goto fail;
	*out = db;
	return TD_OK;

fail_clear:
	/* A file that is not a database at all: say so plainly. */
	if (e == TD_EFORMAT)
		e = td_fail(eb, TD_EFORMAT,
			    "%s: not a traind state database (file is not a sqlite database or is "
			    "damaged); move it aside or use another state directory",
			    path);
fail:
	st_close(db);
	return e;
}

void st_close(struct st_db *db)
{
	if (!db)
		return;
	pthread_mutex_lock(&db->mu);
	if (db->h)
		sqlite3_close_v2(db->h);
	db->h = NULL;
	pthread_mutex_unlock(&db->mu);
	pthread_mutex_destroy(&db->mu);
	free(db->path);
	free(db);
}

const char *st_path(const struct st_db *db)
{
	return db->path;
}

int st_schema_version(struct st_db *db)
{
	return db->version;
}
