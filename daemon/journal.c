/* journald sink (daemon/journal.h). */
#include "daemon/journal.h"

#include "config.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include "proto/log.h"

#if TD_HAVE_SYSTEMD
#include <systemd/sd-journal.h>
#endif

bool dmn_journal_stream(void)
{
	/* systemd sets JOURNAL_STREAM=<device>:<inode> of the stream it connected
	 * stdout/stderr to; a redirected stderr no longer matches. */
	const char *js = getenv("JOURNAL_STREAM");
	unsigned long long dev, ino;
	struct stat st;
	if (!js || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
		return false;
	return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

#if TD_HAVE_SYSTEMD
static void journal_sink(enum td_log_level lvl, const char *id, const char *file, int line,
			 const char *text)
{
	char mid[33];
	td_log_message_id(id, mid);
	int r = sd_journal_send("MESSAGE=%s: %s", id, text, "PRIORITY=%d", (int)lvl,
				"MESSAGE_ID=%s", mid, "TD_ID=%s", id, "CODE_FILE=%s", file,
				"CODE_LINE=%d", line, "SYSLOG_IDENTIFIER=traind", NULL);
	if (r < 0) {
		char out[2048 + 256];
		td_log_format(out, sizeof(out), lvl, id, file, line, text);
		fprintf(stderr, "%s\n", out);
	}
}
#endif

bool dmn_journal_attach(void)
{
#if TD_HAVE_SYSTEMD
	if (!dmn_journal_stream())
		return false;
	td_log_sink = journal_sink;
	return true;
#else
	return false;
#endif
}
