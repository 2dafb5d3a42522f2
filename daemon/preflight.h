/* What the daemon checks about a submitted job before it queues it, and the
 * memory plan's bytes that admission reserves.
 *
 * dmn_spec_check_paths() is cheap and runs anywhere: every path in the spec
 * must be absolute (trainctl makes them so; the daemon has no idea of the
 * client's working directory). dmn_preflight() touches the file system as the
 * submitter — it must run on a worker thread: model_dir and its config.json,
 * the data files, adapter and teacher dirs must be readable, the output dir
 * writable (or creatable), and the plan is built from config.json. Every
 * error names the spec field and the path ("model_dir: /x: no such
 * directory"). A check passing here does not make the job's run succeed (files
 * change); the runner reports what happens then. */
#ifndef DAEMON_PREFLIGHT_H
#define DAEMON_PREFLIGHT_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/identity.h"
#include "proto/err.h"
#include "train/plan.h"
#include "traind.pb-c.h"

/* A job's memory plan as admission sees it (contract 1). With
 * memory.recompute AUTO (or unset) and no memory.max_bytes the scheduler
 * chooses the recompute policy where it places the job — the fastest whose
 * plan the GPU can grant — so the plan's total is known per policy:
 * by_policy[k] under enum tr_recompute k (teacher included), and bytes is
 * NONE's. Otherwise auto_policy is false and bytes is the plan of the
 * policy the spec fixes (or that memory.max_bytes chose). The host bytes
 * beside them (train/plan.h: TR_ARENA_HOST, FULL_OFFLOAD's pinned memory)
 * are in no lease: host_bytes, host_by_policy, for what the job says. */
struct dmn_plan_bytes {
	uint64_t bytes;
	bool auto_policy;
	uint64_t by_policy[TR_RECOMPUTE_COUNT];
	uint64_t host_bytes;
	uint64_t host_by_policy[TR_RECOMPUTE_COUNT];
};

/* Whether spec leaves the recompute policy to placement: memory.recompute
 * AUTO or unset, and no memory.max_bytes. */
bool dmn_recompute_is_auto(const Traind__JobSpec *spec);

/* spec has defaults applied. TD_EINVAL naming the first relative path. */
td_err dmn_spec_check_paths(const Traind__JobSpec *spec, struct td_errbuf *eb);

/* Blocking (file system, NSS); any thread but the loop. Switches the calling
 * thread to creds for the checks and back. *plan gets the plan's bytes on
 * success. */
td_err dmn_preflight(const Traind__JobSpec *spec, const struct dmn_fscreds *creds,
		     struct dmn_plan_bytes *plan, struct td_errbuf *eb);

#endif
