/* Where a job that needs n GPUs goes: the choice of a set of GPUs, as a pure
 * function of what each GPU offers, so that it can be tested without a
 * daemon. The scheduler (daemon/scheduler.h) builds the table from the
 * ledger and the device list, and the ledger's transaction
 * (st_ledger_reserve_gang) has the last word.
 *
 * The order of preference among the sets that qualify: the most pairs of
 * GPUs joined by NVLink (a gang of 4 on 0+1+2+3 all joined beats one with a
 * PCIe hop), then, when choosing GPUs to wait for, the most bytes the ledger
 * could grant now (the set nearest to fitting), then the lowest indices (so
 * that a job of one GPU goes to the first that fits, as before gangs).
 *
 * Not here: ordering jobs, holding GPUs for a waiting job (the scheduler). */
#ifndef DAEMON_PLACEMENT_H
#define DAEMON_PLACEMENT_H

#include <stdbool.h>
#include <stdint.h>

/* The most GPUs one choice looks at (the sets of n among them are
 * enumerated: at most C(16, 8) = 12870). */
#define DMN_PLACE_MAX 16

/* What one GPU offers the job being placed. */
struct dmn_place_gpu {
	bool usable;    /* may hold this job: the right kind, not lost, not held for another job */
	uint64_t need;  /* the job's lease there (its plan, and a real GPU's allowances) */
	uint64_t avail; /* what the ledger can grant there now: share − leases, at most the free memory */
	uint64_t share; /* what it could grant empty: total × vram_factor */
};

enum dmn_place_when {
	DMN_PLACE_NOW,   /* every GPU of the set has need <= avail */
	DMN_PLACE_EMPTY, /* every GPU of the set has need <= share: the job fits once they drain */
};

/* A set of n GPUs among g[0 .. ng) (ng <= DMN_PLACE_MAX) as a mask (bit i:
 * GPU i), or 0 when no set qualifies. links[i] bit j: GPUs i and j are joined
 * by NVLink (links may be NULL: none are). Exhaustive over the sets of n
 * usable GPUs that qualify each on its own. */
uint32_t dmn_place_pick(const struct dmn_place_gpu *g, int ng, const uint32_t *links, int n,
			enum dmn_place_when when);

/* Pairs of GPUs of mask joined by NVLink. */
int dmn_place_nvlink_pairs(uint32_t mask, const uint32_t *links, int ng);

#endif
