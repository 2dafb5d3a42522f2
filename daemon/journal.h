/* The daemon's journald sink for proto/log.h: under systemd, when stderr is
 * the journal's stream (JOURNAL_STREAM names its device and inode), each line
 * goes to journald with its fields — MESSAGE, PRIORITY, MESSAGE_ID (from the
 * message id, proto/log.h: td_log_message_id), TD_ID (the id itself),
 * CODE_FILE and CODE_LINE — so `journalctl -u traind TD_ID=TD-JOB-FAIL` or
 * `MESSAGE_ID=...` finds them. A line journald refuses goes to stderr. */
#ifndef DAEMON_JOURNAL_H
#define DAEMON_JOURNAL_H

#include <stdbool.h>

/* Whether stderr is the journal's stream (JOURNAL_STREAM matches it). */
bool dmn_journal_stream(void);

/* Installs the sink when dmn_journal_stream() and traind was built with
 * libsystemd; returns whether it did. */
bool dmn_journal_attach(void);

#endif
