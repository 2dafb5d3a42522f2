/* A TensorBoard event file writer: scalars per step (loss, lr, grad norm,
 * tokens/s, eval loss), in the format TensorBoard reads.
 *
 * The file is a sequence of records: uint64 length (little-endian), uint32
 * masked CRC-32C of the length bytes, the data (an encoded tensorboard.Event),
 * uint32 masked CRC-32C of the data. The mask is ((crc >> 15) | (crc << 17)) +
 * 0xa282ead8. The first record is an Event with file_version "brain.Event:2".
 *
 * Blocks on file I/O; one writer per job, used from one thread. Files are
 * created with the calling thread's filesystem credentials (the runner's: the
 * submitting user's). Not a reader: tests read files back themselves. */
#ifndef DAEMON_TFEVENTS_H
#define DAEMON_TFEVENTS_H

#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"

struct dmn_tfevents;

/* Creates DIR (and missing parents, mode 0755) and in it a new file
 * events.out.tfevents.<unix seconds>.<host>.<pid>.<tag> with the version
 * record. TD_EPERM/TD_ENOENT/TD_EIO name the path. */
td_err dmn_tfevents_open(struct dmn_tfevents **out, const char *dir, const char *tag,
			 struct td_errbuf *eb);

/* One Event at step with n scalar values (tags[i], values[i]); a NaN value is
 * left out. Written and flushed to the kernel before returning. */
td_err dmn_tfevents_scalars(struct dmn_tfevents *w, int64_t step, double wall_time,
			    const char *const *tags, const double *values, size_t n,
			    struct td_errbuf *eb);

/* The file's path (owned by w). */
const char *dmn_tfevents_path(const struct dmn_tfevents *w);

/* Closes the file. NULL is a no-op. */
void dmn_tfevents_close(struct dmn_tfevents *w);

/* CRC-32C (Castagnoli) of n bytes, continuing from crc (0 to start). */
uint32_t dmn_crc32c(uint32_t crc, const void *buf, size_t n);

/* TensorFlow's masking of a CRC stored next to the data it covers. */
static inline uint32_t dmn_crc32c_mask(uint32_t crc)
{
	return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

#endif
