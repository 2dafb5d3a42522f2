/* The GPUs the scheduler and the ledger place jobs on.
 *
 * Real devices come from the CUDA backend's device query once gpu/ exports
 * one (CUDA issue); until then a host's list holds only the simulated GPUs of
 * the `fake_gpus` setting, which exist so that the ledger, admission and the
 * scheduler can be exercised end to end on a machine without a GPU: a job
 * placed on one holds a real lease in the ledger and runs on the CPU backend.
 *
 * Loop thread only. */
#ifndef DAEMON_DEVICES_H
#define DAEMON_DEVICES_H

#include <stdbool.h>
#include <stdint.h>

#include "proto/err.h"

#define DMN_MAX_GPUS 16

struct dmn_gpu {
	int index;
	char uuid[96];
	char name[64];
	uint64_t total_bytes;
	bool fake; /* simulated: its jobs run on the CPU backend */
};

struct dmn_devices {
	struct dmn_gpu gpu[DMN_MAX_GPUS];
	int n;
};

/* Builds the list. fake_spec is the fake_gpus setting ("uuid:bytes,..."; bytes
 * may end in K, M, G or T, binary). TD_EINVAL names a bad entry. */
td_err dmn_devices_init(struct dmn_devices *d, const char *fake_spec, struct td_errbuf *eb);

/* The device called uuid, or the index given as a decimal string; NULL if
 * none. */
const struct dmn_gpu *dmn_devices_find(const struct dmn_devices *d, const char *name);

/* Free memory as the driver reports it now; UINT64_MAX when unknown. */
uint64_t dmn_gpu_free_bytes(const struct dmn_gpu *g);

#endif
