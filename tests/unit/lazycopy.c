/* Late copies (tests/unit/lazycopy.h): the installed backend's table with
 * the copy ops, and the ops that end a copy's life (sync, free), replaced. */
#include "tests/unit/lazycopy.h"

#include <assert.h>
#include <stdint.h>
#include <string.h>

struct queued {
	void *dst;
	const void *src;
	size_t bytes;
	int k;
};

/* The copy stream: copies queued, oldest first. */
#define QUEUE_MAX 64
static struct queued queue[QUEUE_MAX];
static size_t nqueued, done, most;
/* The backend's own table, whose ops the replacements end in. */
static const struct gpu_backend_ops *base;

size_t lazycopy_done(void)
{
	return done;
}

size_t lazycopy_most_queued(void)
{
	return most;
}

/* Runs the first n queued copies, in order. */
static void run(size_t n)
{
	assert(n <= nqueued);
	for (size_t i = 0; i < n; i++)
		if (queue[i].bytes)
			memcpy(queue[i].dst, queue[i].src, queue[i].bytes);
	memmove(queue, queue + n, (nqueued - n) * sizeof(queue[0]));
	nqueued -= n;
	done += n;
}

static void lazy_copy_async(struct gpu_backend *be, void *dst, const void *src, size_t bytes,
			    bool to_host, int k)
{
	(void)be;
	(void)to_host;
	if (nqueued == QUEUE_MAX)
		run(1); /* a full stream: the oldest copy is done by now */
	/* A queued copy that reads dst runs first (the stream is in order: it
	 * reads dst before this copy writes it). */
	const uintptr_t d = (uintptr_t)dst;
	size_t n = 0;
	for (size_t i = 0; i < nqueued; i++) {
		const uintptr_t s = (uintptr_t)queue[i].src;
		if (s < d + bytes && d < s + queue[i].bytes)
			n = i + 1;
	}
	run(n);
	/* Every op enqueued before has run (the CPU is synchronous): the
	 * destination is the copy's from here on, and holds NaN until it runs. */
	memset(dst, 0xff, bytes);
	queue[nqueued++] = (struct queued){dst, src, bytes, k};
	if (nqueued > most)
		most = nqueued;
}

static void lazy_copy_wait(struct gpu_backend *be, int k)
{
	(void)be;
	size_t n = 0;
	for (size_t i = 0; i < nqueued; i++)
		if (queue[i].k == k)
			n = i + 1;
	run(n);
}

static td_err lazy_sync(struct gpu_backend *be, struct td_errbuf *eb)
{
	run(nqueued);
	return base->sync(be, eb);
}

/* Memory a queued copy touches is freed only after it ran (CUDA's free
 * waits for both streams). */
static void lazy_free(struct gpu_backend *be, void *p, size_t bytes)
{
	run(nqueued);
	base->free(be, p, bytes);
}

static void lazy_host_free(struct gpu_backend *be, void *p, size_t bytes)
{
	run(nqueued);
	base->host_free(be, p, bytes);
}

void lazycopy_install(struct gpu_backend *be)
{
	/* One table for every backend installed into: all share base's ops
	 * (the CPU backend's, or emu16's table built on them). */
	static struct gpu_backend_ops ops;
	assert(!base || base == be->ops || be->ops == &ops);
	if (be->ops == &ops)
		return;
	base = be->ops;
	ops = *be->ops;
	ops.copy_async = lazy_copy_async;
	ops.copy_wait = lazy_copy_wait;
	ops.sync = lazy_sync;
	ops.free = lazy_free;
	ops.host_free = lazy_host_free;
	gpu_backend_check_ops(&ops);
	be->ops = &ops;
}
