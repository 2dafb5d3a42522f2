/* TensorBoard event files (daemon/tfevents.h). */
#include "daemon/tfevents.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "tfevents.pb-c.h"

struct dmn_tfevents {
	FILE *f;
	char path[PATH_MAX];
};

/* Table-driven CRC-32C, reflected polynomial 0x82F63B78. */
static uint32_t crc_table[256];

static void crc_init(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
		crc_table[i] = c;
	}
}

uint32_t dmn_crc32c(uint32_t crc, const void *buf, size_t n)
{
	static int ready; /* idempotent; a race writes the same values */
	if (!ready) {
		crc_init();
		ready = 1;
	}
	const uint8_t *p = buf;
	crc = ~crc;
	while (n--)
		crc = crc_table[(crc ^ *p++) & 0xff] ^ (crc >> 8);
	return ~crc;
}

static void put_le(uint8_t *p, uint64_t v, int bytes)
{
	for (int i = 0; i < bytes; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static td_err write_record(struct dmn_tfevents *w, const Tensorboard__Event *ev,
			   struct td_errbuf *eb)
{
	size_t n = tensorboard__event__get_packed_size(ev);
	uint8_t *buf = malloc(12 + n + 4);
	if (!buf)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", w->path);
	put_le(buf, n, 8);
	put_le(buf + 8, dmn_crc32c_mask(dmn_crc32c(0, buf, 8)), 4);
	tensorboard__event__pack(ev, buf + 12);
	put_le(buf + 12 + n, dmn_crc32c_mask(dmn_crc32c(0, buf + 12, n)), 4);
	bool ok = fwrite(buf, 1, 12 + n + 4, w->f) == 12 + n + 4 && fflush(w->f) == 0;
	int err = errno;
	free(buf);
	if (!ok)
		return td_fail(eb, td_from_errno(err), "%s: cannot write: %s", w->path, strerror(err));
	return TD_OK;
}

static td_err mkdirs(const char *dir, struct td_errbuf *eb)
{
	char tmp[PATH_MAX];
	if (snprintf(tmp, sizeof(tmp), "%s", dir) >= (int)sizeof(tmp))
		return td_fail(eb, TD_EINVAL, "%s: path too long", dir);
	for (char *p = tmp + 1;; p++) {
		if (*p != '/' && *p)
			continue;
		char c = *p;
		*p = 0;
		if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
			return td_fail(eb, td_from_errno(errno), "%s: cannot create: %s", tmp,
				       strerror(errno));
		if (!c)
			return TD_OK;
		*p = c;
	}
}

static double wall_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

td_err dmn_tfevents_open(struct dmn_tfevents **out, const char *dir, const char *tag,
			 struct td_errbuf *eb)
{
	td_err e = mkdirs(dir, eb);
	if (e != TD_OK)
		return e;
	struct dmn_tfevents *w = calloc(1, sizeof(*w));
	if (!w)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", dir);
	char host[256] = "localhost";
	gethostname(host, sizeof(host) - 1);
	snprintf(w->path, sizeof(w->path), "%s/events.out.tfevents.%lld.%s.%d.%s", dir,
		 (long long)time(NULL), host, (int)getpid(), tag ? tag : "traind");
	/* O_EXCL: a new file, never someone else's (a symlink planted there). */
	int fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
	if (fd < 0 || !(w->f = fdopen(fd, "wb"))) {
		int err = errno;
		if (fd >= 0)
			close(fd);
		e = td_fail(eb, td_from_errno(err), "%s: cannot create: %s", w->path, strerror(err));
		free(w);
		return e;
	}
	Tensorboard__Event ev = TENSORBOARD__EVENT__INIT;
	ev.has_wall_time = true;
	ev.wall_time = wall_now();
	ev.what_case = TENSORBOARD__EVENT__WHAT_FILE_VERSION;
	ev.file_version = (char *)"brain.Event:2";
	if ((e = write_record(w, &ev, eb)) != TD_OK) {
		dmn_tfevents_close(w);
		return e;
	}
	*out = w;
	return TD_OK;
}

td_err dmn_tfevents_scalars(struct dmn_tfevents *w, int64_t step, double wall_time,
			    const char *const *tags, const double *values, size_t n,
			    struct td_errbuf *eb)
{
	enum { MAXV = 16 };
	Tensorboard__SummaryValue vals[MAXV], *pv[MAXV];
	size_t k = 0;
	for (size_t i = 0; i < n && k < MAXV; i++) {
		if (isnan(values[i]))
			continue;
		tensorboard__summary_value__init(&vals[k]);
		vals[k].tag = (char *)tags[i];
		vals[k].has_simple_value = true;
		vals[k].simple_value = (float)values[i];
		pv[k] = &vals[k];
		k++;
	}
	Tensorboard__Summary sum = TENSORBOARD__SUMMARY__INIT;
	sum.n_value = k;
	sum.value = pv;
	Tensorboard__Event ev = TENSORBOARD__EVENT__INIT;
	ev.has_wall_time = true;
	ev.wall_time = wall_time;
	ev.has_step = true;
	ev.step = step;
	ev.what_case = TENSORBOARD__EVENT__WHAT_SUMMARY;
	ev.summary = &sum;
	return write_record(w, &ev, eb);
}

const char *dmn_tfevents_path(const struct dmn_tfevents *w)
{
	return w->path;
}

void dmn_tfevents_close(struct dmn_tfevents *w)
{
	if (!w)
		return;
	if (w->f)
		fclose(w->f);
	free(w);
}
