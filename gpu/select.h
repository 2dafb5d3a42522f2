/* Choosing a backend by name: "cpu", "cuda", or "auto" (CUDA when its module
 * and a device are there, else the CPU).
 *
 * The CUDA backend is a shared module loaded with dlopen (contract 5), so that
 * the same binaries start on hosts without a GPU driver. This is not device
 * discovery for the ledger (CUDA issue). */
#ifndef GPU_SELECT_H
#define GPU_SELECT_H

#include "gpu/backend.h"

td_err gpu_backend_open(struct gpu_backend **out, const char *name, struct td_errbuf *eb);

#endif
