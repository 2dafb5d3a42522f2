/* proto/log.h and the daemon's journald sink (daemon/journal.h): message
 * ids map to stable, distinct 128-bit MESSAGE_IDs; a sink receives every line
 * that passes the threshold, with its level, id, place and text; the journal
 * is used only when stderr is the stream JOURNAL_STREAM names. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "daemon/journal.h"
#include "proto/log.h"
#include "tests/check.h"

static void test_message_ids(void)
{
	char a[33], b[33];
	td_log_message_id("TD-JOB-FAIL", a);
	td_log_message_id("TD-JOB-FAIL", b);
	CHECK_EQ_INT(strlen(a), 32);
	for (int i = 0; i < 32; i++)
		CHECK_MSG(isxdigit((unsigned char)a[i]) && !isupper((unsigned char)a[i]),
			  "MESSAGE_ID %s: not lowercase hex at %d", a, i);
	CHECK_MSG(strcmp(a, b) == 0, "the same id gives %s and %s", a, b);
	/* distinct over many ids, near-identical ones included */
	enum { N = 200 };
	static char ids[N][33];
	for (int i = 0; i < N; i++) {
		char id[32];
		snprintf(id, sizeof(id), "TD-X-%d", i);
		td_log_message_id(id, ids[i]);
		for (int j = 0; j < i; j++)
			CHECK_MSG(strcmp(ids[i], ids[j]) != 0, "TD-X-%d and TD-X-%d share %s", i, j,
				  ids[i]);
	}
	td_log_message_id("TD-JOB-FAI", b);
	CHECK_MSG(strcmp(a, b) != 0, "a prefix of the id gives the same MESSAGE_ID");
}

static struct {
	int n;
	enum td_log_level lvl;
	char id[64], file[256], text[256];
	int line;
} got;

static void capture(enum td_log_level lvl, const char *id, const char *file, int line,
		    const char *text)
{
	got.n++;
	got.lvl = lvl;
	got.line = line;
	snprintf(got.id, sizeof(got.id), "%s", id);
	snprintf(got.file, sizeof(got.file), "%s", file);
	snprintf(got.text, sizeof(got.text), "%s", text);
}

static void test_sink(void)
{
	td_log_sink = capture;
	td_info("TD-TEST-INFO", "x=%d", 5);
	CHECK_EQ_INT(got.n, 1);
	CHECK_EQ_INT(got.lvl, TD_LOG_INFO);
	CHECK(strcmp(got.id, "TD-TEST-INFO") == 0);
	CHECK(strcmp(got.text, "x=5") == 0);
	CHECK_CONTAINS(got.file, "test_log.c");
	CHECK(got.line > 0);
	td_debug("TD-TEST-DEBUG", "below the threshold"); /* the default threshold is info */
	CHECK_EQ_INT(got.n, 1);
	td_err_log("TD-TEST-ERR", "bad %s", "thing");
	CHECK_EQ_INT(got.n, 2);
	CHECK_EQ_INT(got.lvl, TD_LOG_ERR);
	td_log_sink = NULL;

	char line[512];
	td_log_format(line, sizeof(line), TD_LOG_ERR, "TD-E", "f.c", 12, "broken");
	CHECK(strcmp(line, "traind[error] TD-E: broken (f.c:12)") == 0);
	td_log_format(line, sizeof(line), TD_LOG_WARN, "TD-W", "f.c", 12, "odd");
	CHECK(strcmp(line, "traind[warn] TD-W: odd") == 0);
}

static void test_journal_stream(void)
{
	unsetenv("JOURNAL_STREAM");
	CHECK(!dmn_journal_stream());
	CHECK(!dmn_journal_attach());
	CHECK(td_log_sink == NULL);
	struct stat st;
	CHECK(fstat(STDERR_FILENO, &st) == 0);
	char v[64];
	snprintf(v, sizeof(v), "%llu:%llu", (unsigned long long)st.st_dev,
		 (unsigned long long)st.st_ino + 1);
	setenv("JOURNAL_STREAM", v, 1);
	CHECK(!dmn_journal_stream()); /* another stream: stderr was redirected */
	snprintf(v, sizeof(v), "%llu:%llu", (unsigned long long)st.st_dev,
		 (unsigned long long)st.st_ino);
	setenv("JOURNAL_STREAM", v, 1);
	CHECK(dmn_journal_stream());
	CHECK_EQ_INT(dmn_journal_attach(), TD_HAVE_SYSTEMD);
	CHECK((td_log_sink != NULL) == TD_HAVE_SYSTEMD);
	/* without a journald to take it (CI), a line falls back to stderr */
	td_info("TD-TEST-JOURNAL", "one line through the sink");
	td_log_sink = NULL;
	unsetenv("JOURNAL_STREAM");
}

int main(void)
{
	test_message_ids();
	test_sink();
	test_journal_stream();
	return check_status();
}
