/* Reading a file through a mapping, safely: if the file shrinks under the
 * reader (a user truncates or rewrites their dataset or model while a job
 * runs), touching a page past its new end raises SIGBUS, which by default
 * kills the whole daemon with every job in it. A guard turns that signal, in
 * the thread that holds the guard, into an error for the one job.
 *
 *	struct tr_map_guard g;
 *	tr_map_guard_push(&g);
 *	if (sigsetjmp(g.jb, 0))
 *		return td_fail(eb, TD_EIO, "%s: ...", path);  (already popped)
 *	... read the mapping: leaf code only, no locks, no allocation,
 *	    nothing written that the failure path reads ...
 *	tr_map_guard_pop(&g);
 *
 * Guards nest (per thread). A SIGBUS outside any guard keeps its default
 * action (the process dies with a core), as if there were no handler. The
 * handler is installed process-wide on the first push. */
#ifndef TRAIN_MAPGUARD_H
#define TRAIN_MAPGUARD_H

#include <setjmp.h>
#include <stddef.h>

#include "proto/err.h"

struct tr_map_guard {
	sigjmp_buf jb;
	struct tr_map_guard *prev;
};

void tr_map_guard_push(struct tr_map_guard *g);
void tr_map_guard_pop(struct tr_map_guard *g);

/* memcpy from a mapping of path; TD_EIO naming path (and what) when the file
 * no longer covers the bytes. */
td_err tr_map_copy(void *dst, const void *src, size_t n, const char *path, const char *what,
		   struct td_errbuf *eb);
/* memchr over a mapping of path, guarded the same way: *found is the match
 * or NULL. */
td_err tr_map_chr(const char **found, const char *s, int c, size_t n, const char *path,
		  struct td_errbuf *eb);

/* The error of a guard that fired: "<path>: <what>: the file shrank while
 * in use (truncated or rewritten?)"; path NULL leaves it out (the caller
 * adds it). Likewise for the path of tr_map_copy and tr_map_chr. */
td_err tr_map_fail(struct td_errbuf *eb, const char *path, const char *what);

#endif
