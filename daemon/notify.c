/* sd_notify wrappers (daemon/notify.h). */
#include "daemon/notify.h"

#include "config.h"

#include <stdarg.h>
#include <stdio.h>

#if TD_HAVE_SYSTEMD
#include <systemd/sd-daemon.h>
#define NOTIFY(s) sd_notify(0, (s))
#else
#define NOTIFY(s) ((void)(s))
#endif

void dmn_notify_ready(void)
{
	NOTIFY("READY=1");
}

void dmn_notify_reloading(void)
{
	NOTIFY("RELOADING=1");
}

void dmn_notify_stopping(void)
{
	NOTIFY("STOPPING=1");
}

void dmn_notify_status(const char *fmt, ...)
{
	char buf[512];
	int n = snprintf(buf, sizeof(buf), "STATUS=");
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
	va_end(ap);
	NOTIFY(buf);
}

void dmn_notify_watchdog(void)
{
	NOTIFY("WATCHDOG=1");
}

uint64_t dmn_notify_watchdog_usec(void)
{
#if TD_HAVE_SYSTEMD
	uint64_t usec = 0;
	if (sd_watchdog_enabled(0, &usec) > 0)
		return usec;
#endif
	return 0;
}
