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

/* Fills item, a zeroed element of the array st__rows grows, from the row st
 * stands on. An error stops the walk; the item counts as read all the same,
 * so it must be left as the set's free can take it (zeroed, or filled). */
typedef td_err (*st__row_fn)(struct st_db *db, sqlite3_stmt *st, void *item,
			     struct td_errbuf *eb);

/* What one query's rows become: items of size bytes, each filled by fill,
 * freed by free (the whole array of n; NULL: free() alone). */
struct st__rowset {
	size_t size;
	st__row_fn fill;
	void (*free)(void *items, size_t n);
};

/* Steps st (prepared and bound by the caller, who finalizes or resets it
 * afterwards) to its end, an item per row. On success *items (NULL when
 * there are no rows; the caller's to free) and *n are written; on failure
 * neither is, what was read is freed, and eb says "PATH: WHAT: out of
 * memory" or, under TD-ST-SQLITE, the sqlite error on WHAT (formatted from
 * the arguments after ST_ROWS's eb only then). Expects the handle's mutex
 * held. */
td_err st__rows(struct st_db *db, sqlite3_stmt *st, const struct st__rowset *set, void **items,
		size_t *n, struct td_errbuf *eb, const char *file, int line, const char *fmt, ...)
	__attribute__((format(printf, 9, 10)));
#define ST_ROWS(db, st, set, items, n, eb, ...) \
	st__rows((db), (st), (set), (items), (n), (eb), __FILE__, __LINE__, __VA_ARGS__)

/* A value for a query's parameter: ST_INT(v), or ST_TEXT(s) (NULL: SQL NULL;
 * the string must outlive the call). */
struct st__arg {
	bool text;
	int64_t i;
	const char *s;
};
#define ST_INT(v) ((struct st__arg){.i = (int64_t)(v)})
#define ST_TEXT(v) ((struct st__arg){.text = true, .s = (v)})
/* The parameters of a query, ?1, ?2, ... in order: ST_ARGS(ST_INT(job)), or ST_NO_ARGS. */
#define ST_ARGS(...)                             \
	((const struct st__arg[]){__VA_ARGS__}), \
		(sizeof((const struct st__arg[]){__VA_ARGS__}) / sizeof(struct st__arg))
#define ST_NO_ARGS NULL, 0

/* A whole read: takes the handle's mutex, prepares sql, binds args, collects
 * its rows as ST_ROWS (with what it says on failure), finalizes, unlocks. */
td_err st__select(struct st_db *db, const char *sql, const struct st__arg *args, size_t nargs,
		  const struct st__rowset *set, void **items, size_t *n, struct td_errbuf *eb,
		  const char *file, int line, const char *fmt, ...)
	__attribute__((format(printf, 11, 12)));
#define ST_SELECT(db, set, items, n, eb, sql, args, ...) \
	st__select((db), (sql), args, (set), (items), (n), (eb), __FILE__, __LINE__, __VA_ARGS__)

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
