/* Logging with stable message ids (they become journald MESSAGE_IDs under
 * systemd). Lines go to stderr as "traind[LEVEL] ID: text". The level is checked
 * before anything is formatted. Thread-safe: one fprintf per line.
 *
 * This is not an error channel: errors are returned as td_err (proto/err.h). */
#ifndef PROTO_LOG_H
#define PROTO_LOG_H

enum td_log_level { TD_LOG_ERR = 3, TD_LOG_WARN = 4, TD_LOG_INFO = 6, TD_LOG_DEBUG = 7 };

extern enum td_log_level td_log_threshold;

void td_log_write(enum td_log_level lvl, const char *id, const char *file, int line,
		  const char *fmt, ...) __attribute__((format(printf, 5, 6)));

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
