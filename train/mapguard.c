/* SIGBUS guards for reads through file mappings (train/mapguard.h). */
#include "train/mapguard.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>

/* The innermost guard of this thread. Initial-exec TLS in a static library,
 * so the handler may read it. */
static __thread struct tr_map_guard *top;
static pthread_once_t installed = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig, siginfo_t *si, void *uc)
{
	(void)si;
	(void)uc;
	struct tr_map_guard *g = top;
	if (g) {
		top = g->prev;
		siglongjmp(g->jb, 1);
	}
	/* Not a guarded read: the default action, as if unhandled. */
	signal(sig, SIG_DFL);
	raise(sig);
}

static void install(void)
{
	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_sigaction = on_sigbus;
	/* NODEFER: SIGBUS stays unblocked after the jump, so sigsetjmp need
	 * not save the mask (a system call per guard). */
	sa.sa_flags = SA_SIGINFO | SA_NODEFER;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGBUS, &sa, NULL);
}

void tr_map_guard_push(struct tr_map_guard *g)
{
	pthread_once(&installed, install);
	g->prev = top;
	top = g;
}

void tr_map_guard_pop(struct tr_map_guard *g)
{
	top = g->prev;
}

td_err tr_map_fail(struct td_errbuf *eb, const char *path, const char *what)
{
	if (!path)
		return td_fail(eb, TD_EIO, "%s: the file shrank while in use (truncated or rewritten?)",
			       what);
	return td_fail(eb, TD_EIO, "%s: %s: the file shrank while in use (truncated or rewritten?)",
		       path, what);
}

td_err tr_map_copy(void *dst, const void *src, size_t n, const char *path, const char *what,
		   struct td_errbuf *eb)
{
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0))
		return tr_map_fail(eb, path, what);
	if (n)
		memcpy(dst, src, n);
	tr_map_guard_pop(&g);
	return TD_OK;
}

td_err tr_map_chr(const char **found, const char *s, int c, size_t n, const char *path,
		  struct td_errbuf *eb)
{
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0))
		return tr_map_fail(eb, path, "reading");
	*found = n ? memchr(s, c, n) : NULL;
	tr_map_guard_pop(&g);
	return TD_OK;
}
