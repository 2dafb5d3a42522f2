/* The GPU list (daemon/devices.h). */
#include "daemon/devices.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/nccl.h"
#include "gpu/select.h"
#include "gpu/topo.h"
#include "proto/log.h"

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

td_err dmn_devices_init_fake(struct dmn_devices *d, const char *fake_spec, struct td_errbuf *eb)
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
		g->ordinal = -1;
		d->n++;
	}
	return TD_OK;
}

td_err dmn_devices_init(struct dmn_devices *d, const char *fake_spec, struct td_errbuf *eb)
{
	td_err e = dmn_devices_init_fake(d, fake_spec, eb);
	if (e != TD_OK)
		return e;
	struct gpu_device_info info[DMN_MAX_GPUS];
	int n = 0;
	if ((e = gpu_devices_query(info, DMN_MAX_GPUS - d->n, &n, eb)) != TD_OK)
		return e;
	if (!n) {
		gpu_devices_why(d->why_none, sizeof(d->why_none));
		td_info("TD-GPU-NONE", "no CUDA GPU: %s", d->why_none);
		return TD_OK;
	}
	for (int i = 0; i < n; i++) {
		if (dmn_devices_find(d, info[i].uuid)) {
			/* A simulated GPU took a real one's UUID: the ledger would mix them. */
			return td_fail(eb, TD_EINVAL, "fake_gpus: '%s' is the UUID of this host's GPU %d",
				       info[i].uuid, info[i].index);
		}
		struct dmn_gpu *g = &d->gpu[d->n];
		g->index = d->n;
		snprintf(g->uuid, sizeof(g->uuid), "%s", info[i].uuid);
		snprintf(g->name, sizeof(g->name), "%s", info[i].name);
		g->total_bytes = info[i].total_bytes;
		g->fake = false;
		g->ordinal = info[i].index;
		g->cc_major = info[i].cc_major;
		g->cc_minor = info[i].cc_minor;
		d->n++;
		d->nreal++;
		td_info("TD-GPU-FOUND", "GPU %d: %s %s, compute capability %d.%d, %.1f GiB (%.1f GiB free)",
			g->index, g->uuid, g->name, g->cc_major, g->cc_minor,
			(double)info[i].total_bytes / (1 << 30), (double)info[i].free_bytes / (1 << 30));
	}
	/* Gangs of real GPUs sum their gradients through NCCL: without it, a
	 * job asking for several is refused at submit, naming why. */
	if (d->nreal > 1) {
		const struct gpu_nccl *nc = NULL;
		struct td_errbuf why = {{0}};
		bool ok = gpu_nccl_get(&nc, &why) == TD_OK;
		if (ok)
			snprintf(d->nccl_note, sizeof(d->nccl_note), "NCCL %d.%d.%d (%s)", nc->version / 10000,
				 nc->version / 100 % 100, nc->version % 100, nc->path);
		else
			snprintf(d->nccl_note, sizeof(d->nccl_note), "%s", why.msg);
		for (int i = 0; i < d->n; i++)
			d->gpu[i].gang = ok && !d->gpu[i].fake;
		td_info("TD-GPU-NCCL", "%s: %s", ok ? "data parallel over" : "no data parallel on the real GPUs",
			d->nccl_note);
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
	if (g->fake)
		return g->total_bytes;
	uint64_t fr = 0, total = 0;
	struct td_errbuf eb = {{0}};
	if (gpu_device_mem(g->ordinal, &fr, &total, &eb) != TD_OK) {
		td_warn("TD-GPU-MEMINFO", "GPU %d (%s): free memory unknown: %s", g->index, g->uuid,
			eb.msg);
		return UINT64_MAX;
	}
	return fr;
}

const char *dmn_devices_mask_str(uint32_t mask, char *buf, size_t cap)
{
	size_t n = 0;
	buf[0] = 0;
	for (int i = 0; i < 32 && n < cap; i++)
		if (mask >> i & 1)
			n += (size_t)snprintf(buf + n, cap - n, "%s%d", n ? "+" : "", i);
	return buf;
}

/* The links of the simulated GPUs from the setting (dmn_devices_links). */
static td_err fake_links(struct dmn_devices *d, const char *spec, struct td_errbuf *eb)
{
	const char *p = spec ? spec : "";
	while (*p) {
		size_t len = strcspn(p, ",");
		char item[160];
		if (len >= sizeof(item))
			return td_fail(eb, TD_EINVAL, "fake_nvlink: entry '%.*s...' is too long", 40, p);
		memcpy(item, p, len);
		item[len] = 0;
		p += len + (p[len] == ',');
		if (!len)
			continue;
		uint32_t group = 0;
		int count = 0;
		for (char *q = item, *tok; (tok = strsep(&q, "+"));) {
			char *end;
			errno = 0;
			long idx = strtol(tok, &end, 10);
			if (!*tok || *end || errno || idx < 0 || idx >= d->n || !d->gpu[idx].fake)
				return td_fail(eb, TD_EINVAL,
					       "fake_nvlink: '%s' is not the index of a simulated GPU "
					       "(fake_gpus lists %d; groups look like 0+1,2+3)",
					       tok, d->n - d->nreal);
			group |= (uint32_t)1 << idx;
			count++;
		}
		if (count < 2 || __builtin_popcount(group) != count)
			return td_fail(eb, TD_EINVAL,
				       "fake_nvlink: '%s' does not name two or more different GPUs",
				       item);
		for (int i = 0; i < d->n; i++)
			if (group >> i & 1)
				d->nvlink[i] |= group & ~((uint32_t)1 << i);
	}
	return TD_OK;
}

td_err dmn_devices_links(struct dmn_devices *d, const char *fake_nvlink, struct td_errbuf *eb)
{
	memset(d->nvlink, 0, sizeof(d->nvlink));
	d->topo_note[0] = 0;
	td_err e = fake_links(d, fake_nvlink, eb);
	if (e != TD_OK)
		return e;
	if (d->nreal > 1) {
		const char *uuid[DMN_MAX_GPUS];
		int idx[DMN_MAX_GPUS], n = 0;
		for (int i = 0; i < d->n; i++) {
			if (!d->gpu[i].fake) {
				idx[n] = i;
				uuid[n++] = d->gpu[i].uuid;
			}
		}
		uint32_t links[DMN_MAX_GPUS];
		struct td_errbuf teb = {{0}};
		if (gpu_topo_nvlink(uuid, n, links, &teb) == TD_OK) {
			for (int a = 0; a < n; a++)
				for (int b = 0; b < n; b++)
					if (links[a] >> b & 1)
						d->nvlink[idx[a]] |= (uint32_t)1 << idx[b];
			snprintf(d->topo_note, sizeof(d->topo_note), "NVLink read through NVML");
		} else {
			snprintf(d->topo_note, sizeof(d->topo_note), "%s", teb.msg);
		}
	}
	char buf[128];
	for (int i = 0; i < d->n; i++)
		if (d->nvlink[i] >> (i + 1))
			td_info("TD-GPU-TOPO", "GPU %d is joined by NVLink to GPU %s", i,
				dmn_devices_mask_str(d->nvlink[i], buf, sizeof(buf)));
	if (d->topo_note[0])
		td_info("TD-GPU-TOPO", "%s", d->topo_note);
	return TD_OK;
}

td_err dmn_devices_check_gpus(const struct dmn_devices *d, unsigned n, struct td_errbuf *eb)
{
	if (n <= 1)
		return TD_OK;
	if (!d->n)
		return td_fail(eb, TD_EINVAL, "resources.gpus: %u GPUs asked for; this host has none", n);
	if ((int)n > d->n)
		return td_fail(eb, TD_EINVAL,
			       "resources.gpus: %u GPUs asked for; this host has %d (`trainctl info` "
			       "lists them)",
			       n, d->n);
	int ok = 0;
	for (int i = 0; i < d->n; i++)
		ok += dmn_gpu_gang_ok(&d->gpu[i], n);
	if ((int)n > ok && d->nreal > 1 && !d->gpu[d->n - 1].gang)
		return td_fail(eb, TD_EINVAL,
			       "resources.gpus: %u: training on several CUDA GPUs (data parallel) needs "
			       "NCCL: %s; ask for gpus: 1%s",
			       n, d->nccl_note, ok > 1 ? " (or as many as the simulated GPUs)" : "");
	if ((int)n > ok)
		return td_fail(eb, TD_EINVAL,
			       "resources.gpus: %u: at most %d of this host's GPUs can train one job "
			       "together (a gang needs two real GPUs or more and NCCL, or simulated "
			       "ones)",
			       n, ok);
	return TD_OK;
}
