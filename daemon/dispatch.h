/* The RPC dispatch table: one line per call (name, handler, who may make it,
 * whether it changes anything, whether it names a job), and the checks every
 * request goes through once before its handler:
 *
 *   decode and check the envelope (proto/rpc.h) → find the table entry →
 *   admin-only calls: root or the admin group → a mutating call while the
 *   daemon is stopping: refused → a call that names a job: the job exists and
 *   the caller owns it (or is root or in the admin group) → the handler.
 *
 * Every request gets exactly one response: a status (td_err), a one-line
 * message that says what to do, and the call's result. Bad bytes never get
 * further than the decode. Handlers run on the loop thread and do not block,
 * except on the database (fast, WAL); submit's file checks as the user run on
 * a libuv worker and the reply follows when they are done. */
#ifndef DAEMON_DISPATCH_H
#define DAEMON_DISPATCH_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "daemon/settings.h"
#include "daemon/devices.h"
#include "daemon/identity.h"
#include "daemon/scheduler.h"
#include "state/state.h"

/* Calls counted per table entry (dmn_dispatch_call_name); the last slot,
 * DMN_RPC_MAX, counts requests that were not understood. */
#define DMN_RPC_MAX 32

/* What the handlers work with (passed in, never global). */
struct dmn_env {
	uv_loop_t *loop;
	const struct dmn_config *cfg;
	struct st_db *db;
	struct dmn_sched *sched;
	const struct dmn_devices *dev;
	double start_time;  /* Unix seconds */
	bool stopping;
	size_t pending;     /* requests whose reply is not sent yet */
	/* Requests answered and those answered with an error, per call (the
	 * metrics: daemon/metrics.h). */
	uint64_t rpc_requests[DMN_RPC_MAX + 1], rpc_errors[DMN_RPC_MAX + 1];
};

/* The name of table entry k ("submit", "ledger.list", ...; "undecodable" for
 * DMN_RPC_MAX), and how many entries there are. */
const char *dmn_dispatch_call_name(int k);
int dmn_dispatch_ncalls(void);

/* Receives the encoded response (malloc'd; the callee owns it). Called once
 * per request, on the loop thread, possibly after dmn_dispatch returned. */
typedef void (*dmn_reply_fn)(void *ctx, uint8_t *buf, size_t len);

/* Handles one request from peer. */
void dmn_dispatch(struct dmn_env *env, const struct dmn_peer *peer, const uint8_t *buf,
		  size_t len, dmn_reply_fn reply, void *ctx);

/* A reply for a request that could not even be read (no credentials, no
 * memory): status code and message, encoded. NULL when out of memory. */
uint8_t *dmn_error_reply(td_err code, const char *msg, size_t *len);

#endif
