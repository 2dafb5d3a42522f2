/* The RPC envelope: pack, unpack and check traind.Request / traind.Response.
 *
 * One Request carries one call (a oneof); one Response carries a status (a
 * td_err code), a one-line message for failures, and a oneof result. Both the
 * daemon and trainctl use these helpers, so that a message that one side
 * accepts the other side built.
 *
 * What "check" means here: the bytes decode, the protocol version matches,
 * exactly one call is set and the fields a call cannot do without are there
 * (a job id, a spec, a ledger op) — each failure named by its field path
 * ("request.show.id: missing"). It is not the job spec's validation (see
 * proto/jobspec.h: the daemon runs it on the submitted spec) and not
 * authorisation (the daemon's dispatch table).
 *
 * Ownership: a message from rpc_*_decode is protobuf-c's unpacked form, freed
 * with rpc_*_free. Messages built by hand (stack structs pointing at the
 * caller's strings) are only ever packed, never freed here. */
#ifndef PROTO_RPC_H
#define PROTO_RPC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"
#include "proto/jobspec.h"
#include "traind.pb-c.h"

/* Bumped when a change to the envelope would be misread by the other side. */
#define RPC_PROTOCOL 1

/* The largest request a client sends: a job spec at its limit plus the
 * envelope. The daemon's own limit (a setting) defaults to this. */
#define RPC_MAX_REQUEST_BYTES (RPC_JOBSPEC_MAX_BYTES + 4096u)

/* The largest response a client accepts (a long job list, a log chunk). */
#define RPC_MAX_RESPONSE_BYTES (16u << 20)

/* Decodes a request and checks its envelope (see above). max is the size
 * limit (0: RPC_MAX_REQUEST_BYTES). Errors: TD_ERANGE (over max), TD_EFORMAT
 * (not a traind.Request), TD_EUNSUPPORTED (another protocol version),
 * TD_EINVAL (no call, or a call without a field it needs), TD_ENOMEM. The
 * message in eb names the problem and, where it helps, what to do. On success
 * *out owns the request. Never reads past buf[len - 1]; buf may be NULL when
 * len is 0. */
td_err rpc_request_decode(Traind__Request **out, const uint8_t *buf, size_t len, size_t max,
			  struct td_errbuf *eb);

/* Checks an envelope already in memory (what decode checks after unpacking). */
td_err rpc_request_check(const Traind__Request *r, struct td_errbuf *eb);

/* rpc_request_free(NULL) is a no-op. Only for decoded requests. */
void rpc_request_free(Traind__Request *r);

/* Serialises a message to a new malloc'd buffer (*buf non-NULL even when *len
 * is 0). TD_EINVAL for NULL, TD_ENOMEM. The request is stamped with
 * RPC_PROTOCOL if it has none. */
td_err rpc_request_encode(Traind__Request *r, uint8_t **buf, size_t *len);
td_err rpc_response_encode(const Traind__Response *r, uint8_t **buf, size_t *len);

/* Decodes a response. TD_ERANGE over RPC_MAX_RESPONSE_BYTES, TD_EFORMAT for
 * bytes that are not a traind.Response, or one whose status is not a td_err
 * code; TD_ENOMEM. */
td_err rpc_response_decode(Traind__Response **out, const uint8_t *buf, size_t len,
			   struct td_errbuf *eb);
void rpc_response_free(Traind__Response *r);

/* A response with no result: status code, message msg (may be NULL). */
td_err rpc_error_encode(td_err code, const char *msg, uint8_t **buf, size_t *len);

/* "submit", "list", ...; "none" for NOT_SET, "unknown" otherwise. Static. */
const char *rpc_call_name(Traind__Request__CallCase c);

/* "QUEUED", "RUNNING", ...; "UNKNOWN" for a value not in the enum. Static. */
const char *rpc_job_state_name(Traind__JobState s);

/* The inverse (case-insensitive). TD_EINVAL if unknown; *out only on success. */
td_err rpc_job_state_from_name(const char *name, Traind__JobState *out);

/* SUCCEEDED, FAILED, CANCELLED: nothing will happen to the job any more. */
bool rpc_job_state_final(Traind__JobState s);

#endif
