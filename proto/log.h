/* Logging with stable message ids (they become journald MESSAGE_IDs under
 * systemd). Lines go to stderr as "traind[LEVEL] ID: text", or to td_log_sink
 * where one is set (the daemon's journald sink, daemon/journal.h). The level is
 * checked before anything is formatted. Thread-safe: one fprintf per line.
 *
 * This is not an error channel: errors are returned as td_err (proto/err.h). */
#ifndef PROTO_LOG_H
#define PROTO_LOG_H

#include <stddef.h>

enum td_log_level { TD_LOG_ERR = 3, TD_LOG_WARN = 4, TD_LOG_INFO = 6, TD_LOG_DEBUG = 7 };

extern enum td_log_level td_log_threshold;

void td_log_write(enum td_log_level lvl, const char *id, const char *file, int line,
		  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

/* Receives every line that passes the threshold, formatted, instead of
 * stderr; NULL (the default): stderr. Set once, before threads log. */
typedef void (*td_log_sink_fn)(enum td_log_level lvl, const char *id, const char *file, int line,
			       const char *text);
extern td_log_sink_fn td_log_sink;

/* The line as td_log_write prints it to stderr (no newline). */
void td_log_format(char *buf, size_t cap, enum td_log_level lvl, const char *id, const char *file,
		   int line, const char *text);

/* The journald MESSAGE_ID of a message id ("TD-JOB-FAIL"): 32 lowercase hex
 * digits (128 bits, as systemd's catalog wants), a fixed function of the id
 * alone, so `journalctl MESSAGE_ID=...` finds it on any host and release
 * (`traind --message-id ID` prints it). */
void td_log_message_id(const char *id, char out[33]);

#define td_log(lvl, id, ...)                                                  \
	do {                                                                  \
		if ((lvl) <= td_log_threshold)                                \
			td_log_write((lvl), (id), __FILE__, __LINE__, __VA_ARGS__); \
	} while (0)

#define td_err_log(id, ...) td_log(TD_LOG_ERR, id, __VA_ARGS__)
#define td_warn(id, ...) td_log(TD_LOG_WARN, id, __VA_ARGS__)
#define td_info(id, ...) td_log(TD_LOG_INFO, id, __VA_ARGS__)
#define td_debug(id, ...) td_log(TD_LOG_DEBUG, id, __VA_ARGS__)

#endif
