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

#include <stdint.h>

#include "daemon/identity.h"
#include "proto/err.h"
#include "traind.pb-c.h"

/* spec has defaults applied. TD_EINVAL naming the first relative path. */
td_err dmn_spec_check_paths(const Traind__JobSpec *spec, struct td_errbuf *eb);

/* Blocking (file system, NSS); any thread but the loop. Switches the calling
 * thread to creds for the checks and back. *plan_bytes gets the plan's total
 * (contract 1) on success. */
td_err dmn_preflight(const Traind__JobSpec *spec, const struct dmn_fscreds *creds,
		     uint64_t *plan_bytes, struct td_errbuf *eb);

#endif
