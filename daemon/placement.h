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
 * Not here: ordering jobs, holding GPUs for a waiting job, choosing whom a
 * job may preempt (the scheduler); here only which of those to stop. */
#ifndef DAEMON_PLACEMENT_H
#define DAEMON_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>
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

/* Preemption (daemon/scheduler.h): a running job that may be stopped to make
 * room, as its leases: bytes[k] on GPU gpu[k] (a gang has several; a job on
 * a CPU slot none). */
struct dmn_place_victim {
	int ngpus;
	int gpu[DMN_PLACE_MAX];
	uint64_t bytes[DMN_PLACE_MAX];
};

/* The victims to stop so that every GPU i of mask grants need[i], where GPU i
 * grants base[i] now (signed: a GPU over its share is negative) and a
 * victim's leases add to what their GPUs grant. v[0 .. nv) is in the order
 * victims are taken (the scheduler's: lowest priority, then newest): each one
 * with a lease on a GPU of mask still short is taken, until none is short;
 * then, from the last taken back, each one the others cover is dropped, so no
 * victim is taken that is not needed. A victim is taken whole (a gang with
 * all its leases) or not at all. Writes their indices (ascending order of
 * taking) to pick, and returns how many; 0 when nothing is short, or when all
 * of v would not do. */
size_t dmn_place_victims(const struct dmn_place_victim *v, size_t nv, int ng, uint32_t mask,
			 const int64_t *need, const int64_t *base, size_t *pick);

#endif
