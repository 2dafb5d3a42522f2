/* The module-cache index (contract 3): which cubin file holds the module for
 * a key. Only the rows; the files, their verification and eviction belong to
 * the CUDA backend's cache. */
#include "state/internal.h"

#include <stdlib.h>
#include <string.h>

void st_cache_entry_fini(struct st_cache_entry *e)
{
	if (!e)
		return;
	free(e->key);
	free(e->path);
	free(e->sha256);
	free(e->arch);
	memset(e, 0, sizeof(*e));
}

void st_cache_entries_free(struct st_cache_entry *e, size_t n)
{
	if (!e)
		return;
	for (size_t i = 0; i < n; i++)
		st_cache_entry_fini(&e[i]);
	free(e);
}

#define CACHE_COLS "key, path, sha256, arch, size_bytes, src_bytes, created_ms, used_ms, hits"

static td_err entry_from_row(struct st_db *db, sqlite3_stmt *st, struct st_cache_entry *e,
			     struct td_errbuf *eb)
{
	memset(e, 0, sizeof(*e));
	e->key = st__col_strdup(st, 0);
	e->path = st__col_strdup(st, 1);
	e->sha256 = st__col_strdup(st, 2);
	e->arch = st__col_strdup(st, 3);
	e->size_bytes = (uint64_t)sqlite3_column_int64(st, 4);
	e->src_bytes = (uint64_t)sqlite3_column_int64(st, 5);
	e->created_ms = sqlite3_column_int64(st, 6);
	e->used_ms = sqlite3_column_int64(st, 7);
	e->hits = (uint64_t)sqlite3_column_int64(st, 8);
	if (!e->key || !e->path || !e->sha256 || !e->arch) {
		st_cache_entry_fini(e);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory reading the module cache", db->path);
	}
	return TD_OK;
}

static td_err entry_row(struct st_db *db, sqlite3_stmt *st, void *item, struct td_errbuf *eb)
{
	return entry_from_row(db, st, item, eb);
}

static void entries_free(void *entries, size_t n)
{
	st_cache_entries_free(entries, n);
}

/* One write statement in its own transaction; *changes gets the rows touched. */
static td_err write1(struct st_db *db, sqlite3_stmt *st, const char *what, int *changes,
		     struct td_errbuf *eb)
{
	td_err e = st__begin(db, eb);
	if (e)
		return e;
	int rc = sqlite3_step(st);
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "%s", what);
		st__rollback(db);
		return e;
	}
	if (changes)
		*changes = sqlite3_changes(db->h);
	return st__commit(db, eb);
}

td_err st_cache_put(struct st_db *db, const struct st_cache_entry *c, struct td_errbuf *eb)
{
	if (!c || !c->key || !*c->key || !c->path || !*c->path || !c->sha256 || !c->arch)
		return td_fail(eb, TD_EINVAL, "module cache: an entry needs key, path, sha256 and arch");
	if (c->size_bytes > (uint64_t)INT64_MAX || c->src_bytes > (uint64_t)INT64_MAX)
		return td_fail(eb, TD_ERANGE, "module cache %s: size out of range", c->key);
	int64_t now = st_now_ms();
	st__lock(db);
	sqlite3_stmt *st;
	td_err e = st__prepare(db,
			       "INSERT OR REPLACE INTO module_cache (" CACHE_COLS ")"
			       " VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
			       &st, eb);
	if (!e) {
		sqlite3_bind_text(st, 1, c->key, -1, SQLITE_STATIC);
		sqlite3_bind_text(st, 2, c->path, -1, SQLITE_STATIC);
		sqlite3_bind_text(st, 3, c->sha256, -1, SQLITE_STATIC);
		sqlite3_bind_text(st, 4, c->arch, -1, SQLITE_STATIC);
		sqlite3_bind_int64(st, 5, (int64_t)c->size_bytes);
		sqlite3_bind_int64(st, 6, (int64_t)c->src_bytes);
		sqlite3_bind_int64(st, 7, now);
		sqlite3_bind_int64(st, 8, now);
		e = write1(db, st, "store module cache entry", NULL, eb);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	return e;
}

td_err st_cache_get(struct st_db *db, const char *key, struct st_cache_entry *out,
		    struct td_errbuf *eb)
{
	if (!key)
		return td_fail(eb, TD_EINVAL, "module cache: no key");
	st__lock(db);
	sqlite3_stmt *st = NULL;
	struct st_cache_entry got;
	td_err e = st__begin(db, eb);
	if (e)
		goto out;
	e = st__prepare(db,
			"UPDATE module_cache SET hits = hits + 1, used_ms = ?2 WHERE key = ?1"
			" RETURNING " CACHE_COLS,
			&st, eb);
	if (e)
		goto fail;
	sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
	sqlite3_bind_int64(st, 2, st_now_ms());
	int rc = sqlite3_step(st);
	if (rc == SQLITE_DONE) {
		e = td_fail(eb, TD_ENOENT, "module cache: no entry for %s", key);
		goto fail;
	}
	if (rc != SQLITE_ROW) {
		e = ST_SQLFAIL(db, rc, eb, "read module cache entry %s", key);
		goto fail;
	}
	if ((e = entry_from_row(db, st, &got, eb)))
		goto fail;
	rc = sqlite3_step(st);
	sqlite3_finalize(st);
	st = NULL;
	if (rc != SQLITE_DONE) {
		e = ST_SQLFAIL(db, rc, eb, "update module cache entry %s", key);
		st_cache_entry_fini(&got);
		goto fail;
	}
	if ((e = st__commit(db, eb))) {
		st_cache_entry_fini(&got);
		goto out;
	}
	*out = got;
	goto out;
fail:
	st__rollback(db);
out:
	sqlite3_finalize(st);
	st__unlock(db);
	return e;
}

td_err st_cache_del(struct st_db *db, const char *key, struct td_errbuf *eb)
{
	if (!key)
		return td_fail(eb, TD_EINVAL, "module cache: no key");
	st__lock(db);
	sqlite3_stmt *st;
	int changes = 0;
	td_err e = st__prepare(db, "DELETE FROM module_cache WHERE key = ?", &st, eb);
	if (!e) {
		sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
		e = write1(db, st, "delete module cache entry", &changes, eb);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	if (!e && changes == 0)
		e = td_fail(eb, TD_ENOENT, "module cache: no entry for %s", key);
	return e;
}

td_err st_cache_list(struct st_db *db, struct st_cache_entry **out, size_t *n,
		     struct td_errbuf *eb)
{
	static const struct st__rowset entry_rows = {
		.size = sizeof(struct st_cache_entry), .fill = entry_row, .free = entries_free};
	void *rows;
	td_err e = ST_SELECT(db, &entry_rows, &rows, n, eb,
			     "SELECT " CACHE_COLS " FROM module_cache ORDER BY key", ST_NO_ARGS,
			     "list the module cache");
	if (!e)
		*out = rows;
	return e;
}

td_err st_cache_clear(struct st_db *db, size_t *n, struct td_errbuf *eb)
{
	st__lock(db);
	sqlite3_stmt *st;
	int changes = 0;
	td_err e = st__prepare(db, "DELETE FROM module_cache", &st, eb);
	if (!e) {
		e = write1(db, st, "clear the module cache", &changes, eb);
		sqlite3_finalize(st);
	}
	st__unlock(db);
	if (!e && n)
		*n = (size_t)changes;
	return e;
}
