/* The logger of proto/log.h: stderr (journald picks it up under systemd),
 * or the sink the daemon sets. */
#include "proto/log.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>

enum td_log_level td_log_threshold = TD_LOG_INFO;
td_log_sink_fn td_log_sink;

void td_log_format(char *buf, size_t cap, enum td_log_level lvl, const char *id, const char *file,
		   int line, const char *text)
{
	static const char *names[8] = {"emerg", "alert", "crit", "error", "warn", "notice", "info", "debug"};
	if (lvl <= TD_LOG_ERR)
		snprintf(buf, cap, "traind[%s] %s: %s (%s:%d)", names[lvl & 7], id, text, file, line);
	else
		snprintf(buf, cap, "traind[%s] %s: %s", names[lvl & 7], id, text);
}

void td_log_write(enum td_log_level lvl, const char *id, const char *file, int line,
		  const char *fmt, ...)
{
	char text[2048];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	if (td_log_sink) {
		td_log_sink(lvl, id, file, line, text);
		return;
	}
	char out[2048 + 256];
	td_log_format(out, sizeof(out), lvl, id, file, line, text);
	fprintf(stderr, "%s\n", out);
}

/* FNV-1a over "traind:" and the id from two offset bases, each mixed by
 * splitmix64's finalizer: 128 well-spread bits from a short string. Not a
 * secret and not a checksum: only stable and distinct. */
static uint64_t fnv_mix(const char *id, uint64_t h)
{
	static const char prefix[] = "traind:";
	for (const char *p = prefix; *p; p++)
		h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
	for (const char *p = id; *p; p++)
		h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
	h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
	h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
	return h ^ (h >> 31);
}

void td_log_message_id(const char *id, char out[33])
{
	snprintf(out, 33, "%016llx%016llx", (unsigned long long)fnv_mix(id, 0xcbf29ce484222325ULL),
		 (unsigned long long)fnv_mix(id, 0x84222325cbf29ce4ULL));
}
