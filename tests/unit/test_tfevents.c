/* Unit test of daemon/tfevents: a TensorBoard event file written by the
 * daemon's writer is read back record by record, its framing and CRCs checked
 * against an independent bitwise CRC-32C, and its Events decoded and compared
 * with what was written. The CRC itself is checked against the standard check
 * value of CRC-32C (RFC 3720, "123456789" → 0xE3069283). */
#include "daemon/tfevents.h"

#include "tests/check.h"

#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "tfevents.pb-c.h"

/* The reference: CRC-32C one bit at a time, no table. */
static uint32_t crc32c_bitwise(const uint8_t *p, size_t n)
{
	uint32_t crc = 0xffffffffu;
	for (size_t i = 0; i < n; i++) {
		crc ^= p[i];
		for (int k = 0; k < 8; k++)
			crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
	}
	return ~crc;
}

static uint32_t masked(uint32_t crc)
{
	return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

static uint64_t get_le(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = n - 1; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

static void test_crc(void)
{
	CHECK_EQ_INT(dmn_crc32c(0, "123456789", 9), 0xE3069283u);
	CHECK_EQ_INT(crc32c_bitwise((const uint8_t *)"123456789", 9), 0xE3069283u);
	/* Incremental equals one-shot, and the table equals the bit loop. */
	uint8_t buf[1000];
	for (size_t i = 0; i < sizeof(buf); i++)
		buf[i] = (uint8_t)(i * 131 + 7);
	uint32_t c = dmn_crc32c(dmn_crc32c(0, buf, 333), buf + 333, sizeof(buf) - 333);
	CHECK_EQ_INT(c, crc32c_bitwise(buf, sizeof(buf)));
}

struct written {
	int64_t step;
	double vals[3];
};

static void test_file(void)
{
	char dir[64] = "/tmp/td-tfevents.XXXXXX";
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		exit(1);
	}
	char sub[128];
	snprintf(sub, sizeof(sub), "%s/out/runs", dir); /* created by open */
	struct dmn_tfevents *w = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(dmn_tfevents_open(&w, sub, "job7", &eb), TD_OK);
	if (!w)
		return;
	static const char *const tags[] = {"train/loss", "train/learning_rate", "train/grad_norm"};
	const struct written rows[] = {
		{1, {6.25, 1e-4, 0.5}},
		{2, {5.5, 2e-4, NAN}}, /* a NaN is left out */
		{3, {4.75, 3e-4, 0.25}},
	};
	for (size_t i = 0; i < 3; i++)
		CHECK_EQ_INT(dmn_tfevents_scalars(w, rows[i].step, 1000.0 + (double)i, tags, rows[i].vals, 3, &eb),
			     TD_OK);
	char path[512];
	snprintf(path, sizeof(path), "%s", dmn_tfevents_path(w));
	dmn_tfevents_close(w);
	CHECK_CONTAINS(path, "/out/runs/events.out.tfevents.");
	CHECK_CONTAINS(path, ".job7");

	FILE *f = fopen(path, "rb");
	CHECK(f != NULL);
	if (!f)
		return;
	uint8_t *data = malloc(1 << 16);
	size_t n = fread(data, 1, 1 << 16, f);
	fclose(f);
	size_t off = 0, nrec = 0;
	while (off + 12 <= n) {
		uint64_t len = get_le(data + off, 8);
		CHECK_EQ_INT(get_le(data + off + 8, 4), masked(crc32c_bitwise(data + off, 8)));
		CHECK(off + 12 + len + 4 <= n);
		if (off + 12 + len + 4 > n)
			break;
		const uint8_t *body = data + off + 12;
		CHECK_EQ_INT(get_le(body + len, 4), masked(crc32c_bitwise(body, len)));
		Tensorboard__Event *ev = tensorboard__event__unpack(NULL, len, body);
		CHECK(ev != NULL);
		if (ev) {
			if (nrec == 0) {
				CHECK_EQ_INT(ev->what_case, TENSORBOARD__EVENT__WHAT_FILE_VERSION);
				CHECK_STR_EQ(ev->file_version, "brain.Event:2");
			} else {
				const struct written *r = &rows[nrec - 1];
				CHECK_EQ_INT(ev->what_case, TENSORBOARD__EVENT__WHAT_SUMMARY);
				CHECK_EQ_INT(ev->step, r->step);
				CHECK_NEAR(ev->wall_time, 1000.0 + (double)(nrec - 1), 0);
				size_t want = 0;
				for (int k = 0; k < 3; k++) {
					if (isnan(r->vals[k]))
						continue;
					CHECK(want < ev->summary->n_value);
					if (want >= ev->summary->n_value)
						break;
					const Tensorboard__SummaryValue *v = ev->summary->value[want++];
					CHECK_STR_EQ(v->tag, tags[k]);
					CHECK(v->has_simple_value);
					CHECK_NEAR(v->simple_value, (float)r->vals[k], 0);
				}
				CHECK_EQ_INT(ev->summary->n_value, want);
			}
			tensorboard__event__free_unpacked(ev, NULL);
		}
		off += 12 + len + 4;
		nrec++;
	}
	CHECK_EQ_INT(off, n);
	CHECK_EQ_INT(nrec, 4);
	free(data);

	/* An existing file is never reused (O_EXCL): a second writer gets its
	 * own file even within the same second. */
	struct dmn_tfevents *w2 = NULL;
	CHECK_EQ_INT(dmn_tfevents_open(&w2, sub, "job8", &eb), TD_OK);
	if (w2)
		CHECK(strcmp(dmn_tfevents_path(w2), path) != 0);
	dmn_tfevents_close(w2);

	char cmd[128];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd) != 0)
		fprintf(stderr, "warning: could not remove %s\n", dir);
}

int main(void)
{
	test_crc();
	test_file();
	return check_status();
}
