/* stderr logger for proto/log.h. journald picks stderr up under systemd. */
#include "proto/log.h"

#include <stdarg.h>
#include <stdio.h>

enum td_log_level td_log_threshold = TD_LOG_INFO;

void td_log_write(enum td_log_level lvl, const char *id, const char *file, int line,
		  const char *fmt, ...)
{
	static const char *names[8] = {"emerg", "alert", "crit", "error", "warn", "notice", "info", "debug"};
	char text[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	if (lvl <= TD_LOG_ERR)
		fprintf(stderr, "traind[%s] %s: %s (%s:%d)\n", names[lvl & 7], id, text, file, line);
	else
		fprintf(stderr, "traind[%s] %s: %s\n", names[lvl & 7], id, text);
}
