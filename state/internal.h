/* state/'s inside: the handle, sqlite error mapping, transaction helpers.
 * Nothing outside state/ includes this. Functions named st__*_locked expect the
 * handle's mutex held (and, where they write, a transaction open). */
#ifndef STATE_INTERNAL_H
#define STATE_INTERNAL_H

#include <pthread.h>
#include <sqlite3.h>

#include "state/state.h"

struct st_db {
	sqlite3 *h;
	pthread_mutex_t mu;
	char *path;
	int busy_timeout_ms;
	int64_t busy_since_ms; /* start of the current busy wait (busy handler) */
	int version;
};

/* Maps a sqlite result code (primary or extended) to td_err. */
td_err st__map_sqlite(int rc);

/* Fails with the mapped code: eb gets "PATH: what: sqlite message", the log
 * gets the same with the caller's file:line under "TD-ST-SQLITE". */
td_err st__sqlfail(struct st_db *db, int rc, struct td_errbuf *eb, const char *file, int line,
		   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
#define ST_SQLFAIL(db, rc, eb, ...) st__sqlfail((db), (rc), (eb), __FILE__, __LINE__, __VA_ARGS__)

void st__lock(struct st_db *db);
void st__unlock(struct st_db *db);

/* BEGIN IMMEDIATE (every write transaction: taking the write lock up front
 * means the busy handler applies and no read snapshot has to be upgraded). */
td_err st__begin(struct st_db *db, struct td_errbuf *eb);
td_err st__commit(struct st_db *db, struct td_errbuf *eb);
/* Rolls back if a transaction is open; never fails the caller. */
void st__rollback(struct st_db *db);

td_err st__prepare(struct st_db *db, const char *sql, sqlite3_stmt **st, struct td_errbuf *eb);

/* strdup of a text column, "" for NULL; NULL only when out of memory. */
char *st__col_strdup(sqlite3_stmt *st, int col);
/* Copies a text column into buf (truncating, always terminated). */
void st__col_copy(sqlite3_stmt *st, int col, char *buf, size_t size);

/* Appends an event (message truncated to 4 KiB) inside the caller's transaction. */
td_err st__event_insert_locked(struct st_db *db, int64_t job, int64_t now, const char *kind,
			       const char *message, struct td_errbuf *eb);

/* Whether job exists (TD_OK and *exists) inside the caller's transaction. */
td_err st__job_exists_locked(struct st_db *db, int64_t job, bool *exists, struct td_errbuf *eb);

/* Accrues the usage of job (0: every QUEUED and active job) up to now and
 * moves its acct_ms there (state/usage.c), inside the caller's transaction. */
td_err st__usage_accrue_locked(struct st_db *db, int64_t job, int64_t now, struct td_errbuf *eb);

/* Ledger rows of jobs in `ids` removed; used by st_jobs_recover. */
td_err st__ledger_delete_job_locked(struct st_db *db, int64_t job, size_t *n,
				    struct td_errbuf *eb);

#endif
