/* The GPUs the scheduler and the ledger place jobs on.
 *
 * A host's list holds the simulated GPUs of the test-only `fake_gpus` setting
 * first (indices 0, 1, ... as listed), then the real CUDA devices that
 * gpu_devices_query (gpu/select.h) finds. Fake ones first, so that a test
 * naming `--gpu 0` or placing on a simulated GPU means the same on a host with
 * GPUs. A simulated GPU exists so that the ledger, admission and the scheduler
 * can be exercised end to end on a machine without a GPU: a job placed on one
 * holds a real lease in the ledger and runs on the CPU backend. A job placed
 * on a real GPU runs on the CUDA backend on that device's ordinal.
 *
 * The device query retains each real GPU's primary CUDA context in the daemon
 * for its lifetime (one context per device, shared by the jobs' backends).
 *
 * Topology: which GPUs are joined by NVLink, for placing jobs that need
 * several GPUs (a gang). Real GPUs' links come from NVML (gpu/topo.h);
 * simulated GPUs' from the test-only `fake_nvlink` setting. A real and a
 * simulated GPU are never joined.
 *
 * Loop thread only. */
#ifndef DAEMON_DEVICES_H
#define DAEMON_DEVICES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"

#define DMN_MAX_GPUS 16

struct dmn_gpu {
	int index;           /* in the list: what `--gpu N` names */
	char uuid[96];
	char name[128];
	uint64_t total_bytes;
	bool fake;           /* simulated: its jobs run on the CPU backend */
	int ordinal;         /* real: the CUDA device ordinal; fake: -1 */
	int cc_major, cc_minor;
	/* real: may be one of a gang's GPUs: the host has several and NCCL
	 * loads (data parallel, gpu/comm.h) */
	bool gang;
};

struct dmn_devices {
	struct dmn_gpu gpu[DMN_MAX_GPUS];
	int n;
	int nreal;
	char why_none[512];  /* no real GPU: why (no module, no driver, ...); else "" */
	/* nvlink[i] bit j: GPUs i and j are joined by NVLink (symmetric, never
	 * bit i); all 0 until dmn_devices_links. */
	uint32_t nvlink[DMN_MAX_GPUS];
	char topo_note[512]; /* how the links were learned, or why the real ones are unknown */
	/* Several real GPUs: the NCCL their gangs use ("NCCL 2.28.9 (libnccl.so.2)"),
	 * or why gangs cannot run on them; else "". */
	char nccl_note[512];
};

/* Builds the list. fake_spec is the fake_gpus setting ("uuid:bytes,..."; bytes
 * may end in K, M, G or T, binary). TD_EINVAL names a bad entry. Then queries
 * the real GPUs; their absence is not an error (why_none says why). */
td_err dmn_devices_init(struct dmn_devices *d, const char *fake_spec, struct td_errbuf *eb);

/* As dmn_devices_init without the real GPUs (tests of placement). */
td_err dmn_devices_init_fake(struct dmn_devices *d, const char *fake_spec, struct td_errbuf *eb);

/* Reads the links: the real GPUs' through NVML (not an error when NVML is
 * absent: topo_note says why, and no real link is known) and the simulated
 * GPUs' from fake_nvlink, the setting: groups of indices joined by '+' and
 * separated by ',' ("0+1,2+3": 0 and 1 are joined, 2 and 3 are; "0+1+2+3":
 * every pair of the four). TD_EINVAL names a bad entry, an index that is not
 * a simulated GPU, or a group of one. */
td_err dmn_devices_links(struct dmn_devices *d, const char *fake_nvlink, struct td_errbuf *eb);

/* Whether g may be one of the GPUs of a job that needs n of them, which
 * trains data parallel on all n (train/trainer.h: tr_train_opts.ranks): a
 * real GPU where NCCL loads (g->gang), or a simulated one (its ranks run on
 * the CPU, summing in-process). */
static inline bool dmn_gpu_gang_ok(const struct dmn_gpu *g, unsigned n)
{
	return n <= 1 || g->fake || g->gang;
}

/* Whether this host can ever run a job that needs n GPUs: n of them that
 * dmn_gpu_gang_ok allows. TD_EINVAL naming resources.gpus and the reason
 * (the host has fewer GPUs; or several real GPUs and no NCCL). */
td_err dmn_devices_check_gpus(const struct dmn_devices *d, unsigned n, struct td_errbuf *eb);

/* "0+1" for the GPUs of mask (bit i: GPU i), into buf. */
const char *dmn_devices_mask_str(uint32_t mask, char *buf, size_t cap);

/* The device called uuid, or the index given as a decimal string; NULL if
 * none. */
const struct dmn_gpu *dmn_devices_find(const struct dmn_devices *d, const char *name);

/* Free memory as the driver reports it now (a real GPU: cuMemGetInfo, which
 * counts every process's use, contract 7); a simulated one: its total;
 * UINT64_MAX when unknown (the driver failed; logged). */
uint64_t dmn_gpu_free_bytes(const struct dmn_gpu *g);

#endif
