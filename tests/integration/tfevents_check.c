/* tfevents_check FILE: reads a TensorBoard event file as TensorBoard's reader
 * does — length, masked CRC-32C of the length, data, masked CRC-32C of the
 * data — decodes every Event, and prints
 *   records=N first_step=A last_step=B last_loss=X evals=E last_eval=Y
 * (last_loss: the "train/loss" value of the last step, evals: how many
 * "eval/loss" values, last_eval the last of them). Exit 1 on any
 * framing, CRC or decoding error, naming the record. For the integration
 * tests; the CRC here is a bitwise one, independent of the daemon's table. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tfevents.pb-c.h"

static uint32_t crc32c(const uint8_t *p, size_t n)
{
	uint32_t crc = 0xffffffffu;
	for (size_t i = 0; i < n; i++) {
		crc ^= p[i];
		for (int k = 0; k < 8; k++)
			crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
	}
	return ~crc;
}

static uint32_t masked(uint32_t c)
{
	return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static uint64_t le(const uint8_t *p, int n)
{
	uint64_t v = 0;
	for (int i = n - 1; i >= 0; i--)
		v = (v << 8) | p[i];
	return v;
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: tfevents_check FILE\n");
		return 2;
	}
	FILE *f = fopen(argv[1], "rb");
	if (!f) {
		perror(argv[1]);
		return 1;
	}
	size_t cap = 1 << 20, n = 0;
	uint8_t *d = malloc(cap);
	size_t r;
	while (d && (r = fread(d + n, 1, cap - n, f)) > 0) {
		n += r;
		if (n == cap)
			d = realloc(d, cap *= 2);
	}
	fclose(f);
	if (!d)
		return 1;
	size_t off = 0, recs = 0;
	long long first = -1, last = -1;
	double last_loss = -1, last_eval = -1;
	size_t evals = 0;
	while (off < n) {
		if (off + 12 > n) {
			fprintf(stderr, "record %zu: truncated header\n", recs);
			return 1;
		}
		uint64_t len = le(d + off, 8);
		if (le(d + off + 8, 4) != masked(crc32c(d + off, 8))) {
			fprintf(stderr, "record %zu: bad length CRC\n", recs);
			return 1;
		}
		if (len > n || off + 12 + len + 4 > n) {
			fprintf(stderr, "record %zu: truncated data\n", recs);
			return 1;
		}
		const uint8_t *body = d + off + 12;
		if (le(body + len, 4) != masked(crc32c(body, len))) {
			fprintf(stderr, "record %zu: bad data CRC\n", recs);
			return 1;
		}
		Tensorboard__Event *ev = tensorboard__event__unpack(NULL, len, body);
		if (!ev) {
			fprintf(stderr, "record %zu: not an Event\n", recs);
			return 1;
		}
		if (recs == 0 && (ev->what_case != TENSORBOARD__EVENT__WHAT_FILE_VERSION ||
				  strcmp(ev->file_version, "brain.Event:2") != 0)) {
			fprintf(stderr, "record 0: not the file_version record\n");
			return 1;
		}
		if (ev->what_case == TENSORBOARD__EVENT__WHAT_SUMMARY) {
			if (first < 0)
				first = ev->step;
			last = ev->step;
			for (size_t i = 0; i < ev->summary->n_value; i++)
				if (strcmp(ev->summary->value[i]->tag, "train/loss") == 0)
					last_loss = ev->summary->value[i]->simple_value;
				else if (strcmp(ev->summary->value[i]->tag, "eval/loss") == 0)
					last_eval = ev->summary->value[i]->simple_value, evals++;
		}
		tensorboard__event__free_unpacked(ev, NULL);
		off += 12 + len + 4;
		recs++;
	}
	printf("records=%zu first_step=%lld last_step=%lld last_loss=%.4f evals=%zu last_eval=%.4f\n", recs,
	       first, last, last_loss, evals, last_eval);
	free(d);
	return 0;
}
