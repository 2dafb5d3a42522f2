/* systemd service notification (Type=notify): READY, STATUS, WATCHDOG,
 * RELOADING, STOPPING through libsystemd's sd_notify. Without libsystemd, or
 * when not started by systemd ($NOTIFY_SOCKET unset), every call does nothing.
 * Not a logger. Loop thread. */
#ifndef DAEMON_NOTIFY_H
#define DAEMON_NOTIFY_H

#include <stdint.h>

void dmn_notify_ready(void);
void dmn_notify_reloading(void);
void dmn_notify_stopping(void);
void dmn_notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void dmn_notify_watchdog(void);
/* The watchdog period systemd expects pings within; 0 when it is off. */
uint64_t dmn_notify_watchdog_usec(void);

#endif
