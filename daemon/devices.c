/* The GPU list (daemon/devices.h). */
#include "daemon/devices.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static td_err parse_bytes(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	unsigned long long v = strtoull(s, &end, 10);
	if (end == s || errno || *s == '-')
		return TD_EINVAL;
	unsigned shift = 0;
	switch (*end) {
	case 0:
		break;
	case 'K': shift = 10; end++; break;
	case 'M': shift = 20; end++; break;
	case 'G': shift = 30; end++; break;
	case 'T': shift = 40; end++; break;
	default:
		return TD_EINVAL;
	}
	if (*end && strcmp(end, "iB") != 0 && strcmp(end, "B") != 0)
		return TD_EINVAL;
	if (shift && v > (UINT64_MAX >> shift))
		return TD_ERANGE;
	*out = (uint64_t)v << shift;
	return TD_OK;
}

td_err dmn_devices_init(struct dmn_devices *d, const char *fake_spec, struct td_errbuf *eb)
{
	memset(d, 0, sizeof(*d));
	const char *p = fake_spec ? fake_spec : "";
	while (*p) {
		size_t len = strcspn(p, ",");
		char item[160];
		if (len >= sizeof(item))
			return td_fail(eb, TD_EINVAL, "fake_gpus: entry '%.*s...' is too long", 40, p);
		memcpy(item, p, len);
		item[len] = 0;
		p += len + (p[len] == ',');
		if (!len)
			continue;
		char *colon = strrchr(item, ':');
		uint64_t bytes = 0;
		if (!colon || colon == item || parse_bytes(colon + 1, &bytes) != TD_OK || !bytes)
			return td_fail(eb, TD_EINVAL,
				       "fake_gpus: '%s' is not UUID:BYTES (like GPU-test-0:16G)", item);
		*colon = 0;
		if (d->n == DMN_MAX_GPUS)
			return td_fail(eb, TD_ERANGE, "fake_gpus: more than %d devices", DMN_MAX_GPUS);
		if (dmn_devices_find(d, item))
			return td_fail(eb, TD_EINVAL, "fake_gpus: '%s' is listed twice", item);
		struct dmn_gpu *g = &d->gpu[d->n];
		g->index = d->n;
		snprintf(g->uuid, sizeof(g->uuid), "%s", item);
		snprintf(g->name, sizeof(g->name), "simulated GPU");
		g->total_bytes = bytes;
		g->fake = true;
		d->n++;
	}
	return TD_OK;
}

const struct dmn_gpu *dmn_devices_find(const struct dmn_devices *d, const char *name)
{
	if (!name || !*name)
		return NULL;
	for (int i = 0; i < d->n; i++)
		if (strcmp(d->gpu[i].uuid, name) == 0)
			return &d->gpu[i];
	char *end;
	long idx = strtol(name, &end, 10);
	if (!*end && idx >= 0 && idx < d->n)
		return &d->gpu[idx];
	return NULL;
}

uint64_t dmn_gpu_free_bytes(const struct dmn_gpu *g)
{
	/* A simulated device has nobody outside the ledger using it. */
	return g->fake ? g->total_bytes : UINT64_MAX;
}
