/* Late copies: a CPU backend whose copy stream (gpu/backend.h: copy_async,
 * copy_wait) runs each copy as late as the contract lets a GPU run it, for
 * tests of the engine's ordering of copies and ops on a machine without
 * one.
 *
 * The CPU backend copies at once, when the copy is enqueued: the earliest a
 * GPU can. Here a copy is only queued: its destination is filled with NaN
 * bytes at once (nothing may read it before copy_wait), and the copy runs,
 * with every copy queued before it (one copy stream, in order), at the
 * first copy_wait of its number, at gpu_sync, or before memory is freed. An
 * op that writes a copy's source before waiting for it then sends the new
 * values; an op that reads a copy's destination before waiting for it reads
 * NaN: either changes the results that the tests compare bit for bit.
 *
 * Not thread-safe (one queue for the process); not for timing. */
#ifndef TESTS_UNIT_LAZYCOPY_H
#define TESTS_UNIT_LAZYCOPY_H

#include <stddef.h>

#include "gpu/backend.h"

/* Replaces be's copy ops (be: the CPU backend, or one built on its table
 * such as emu16's). */
void lazycopy_install(struct gpu_backend *be);

/* Copies run so far, and the most that were queued at once. */
size_t lazycopy_done(void);
size_t lazycopy_most_queued(void);

#endif
