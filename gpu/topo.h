/* Which of the host's CUDA GPUs are joined by NVLink, for the scheduler's
 * placement of jobs that need several GPUs.
 *
 * Read through NVML (libnvidia-ml.so.1, which the NVIDIA driver installs),
 * opened with dlopen at run time as libcuda is (contract 5): a host without it
 * still runs, with no link known. Two GPUs count as joined when NVML's
 * peer-to-peer status for the NVLINK capability is OK between them (a direct
 * link or an NVSwitch fabric); PCIe peer access does not count. Not a
 * bandwidth model: one bit per pair.
 *
 * Not the simulated GPUs' links: those come from the daemon's test setting
 * (daemon/devices.h). Any thread; not concurrent with itself. */
#ifndef GPU_TOPO_H
#define GPU_TOPO_H

#include <stdint.h>

#include "proto/err.h"

/* The most devices one call handles (the bits of a links word). */
#define GPU_TOPO_MAX 32

/* For the n (<= GPU_TOPO_MAX) devices named by uuid[] ("GPU-xxxxxxxx-...",
 * as nvidia-smi prints them), links[i] gets bit j set when devices i and j
 * are joined by NVLink (never bit i). The library is $TD_NVML_LIBRARY when
 * set (tests), else libnvidia-ml.so.1; it is loaded, initialised and shut
 * down again within the call.
 *
 * Errors: TD_EUNSUPPORTED when the library cannot be loaded, lacks an entry
 * point or fails to initialise (the message names the library and NVML's
 * reason); TD_ENOENT when NVML does not know one of the UUIDs; TD_EINVAL for
 * bad arguments. links is written only on success. */
td_err gpu_topo_nvlink(const char *const *uuid, int n, uint32_t *links, struct td_errbuf *eb);

#endif
