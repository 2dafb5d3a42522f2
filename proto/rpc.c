/* The RPC envelope: pack, unpack and check (proto/rpc.h).
 *
 * Not here: what the calls do (daemon/), who may make them (the daemon's
 * dispatch table), and the job spec's own rules (proto/jobspec.c). */
#include "proto/rpc.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

static const char *const state_names[] = {
	[TRAIND__JOB_STATE__JOB_STATE_UNSPECIFIED] = "UNSPECIFIED",
	[TRAIND__JOB_STATE__JOB_STATE_QUEUED] = "QUEUED",
	[TRAIND__JOB_STATE__JOB_STATE_ADMITTED] = "ADMITTED",
	[TRAIND__JOB_STATE__JOB_STATE_PREPARING] = "PREPARING",
	[TRAIND__JOB_STATE__JOB_STATE_RUNNING] = "RUNNING",
	[TRAIND__JOB_STATE__JOB_STATE_SUCCEEDED] = "SUCCEEDED",
	[TRAIND__JOB_STATE__JOB_STATE_FAILED] = "FAILED",
	[TRAIND__JOB_STATE__JOB_STATE_CANCELLED] = "CANCELLED",
	[TRAIND__JOB_STATE__JOB_STATE_INTERRUPTED] = "INTERRUPTED",
};
#define NSTATES (sizeof(state_names) / sizeof(state_names[0]))

const char *rpc_job_state_name(Traind__JobState s)
{
	if ((unsigned)s < NSTATES && state_names[s])
		return state_names[s];
	return "UNKNOWN";
}

td_err rpc_job_state_from_name(const char *name, Traind__JobState *out)
{
	if (!name)
		return TD_EINVAL;
	for (unsigned i = 1; i < NSTATES; i++) {
		if (strcasecmp(name, state_names[i]) == 0) {
			*out = (Traind__JobState)i;
			return TD_OK;
		}
	}
	return TD_EINVAL;
}

bool rpc_job_state_final(Traind__JobState s)
{
	return s == TRAIND__JOB_STATE__JOB_STATE_SUCCEEDED || s == TRAIND__JOB_STATE__JOB_STATE_FAILED ||
	       s == TRAIND__JOB_STATE__JOB_STATE_CANCELLED;
}

const char *rpc_call_name(Traind__Request__CallCase c)
{
	switch (c) {
	case TRAIND__REQUEST__CALL__NOT_SET:
		return "none";
	case TRAIND__REQUEST__CALL_SUBMIT:
		return "submit";
	case TRAIND__REQUEST__CALL_LIST:
		return "list";
	case TRAIND__REQUEST__CALL_SHOW:
		return "show";
	case TRAIND__REQUEST__CALL_CANCEL:
		return "cancel";
	case TRAIND__REQUEST__CALL_WATCH:
		return "watch";
	case TRAIND__REQUEST__CALL_LEDGER:
		return "ledger";
	case TRAIND__REQUEST__CALL_INFO:
		return "info";
	case TRAIND__REQUEST__CALL_CACHE:
		return "cache";
	case TRAIND__REQUEST__CALL_HOLD:
		return "hold";
	case TRAIND__REQUEST__CALL_REQUEUE:
		return "requeue";
	case TRAIND__REQUEST__CALL_PRIORITY:
		return "priority";
	case TRAIND__REQUEST__CALL_USAGE:
		return "usage";
	default:
		return "unknown";
	}
}

/* ------------------------------------------------------------------------ */
/* Requests */

static td_err check_id(bool has, uint64_t id, const char *path, struct td_errbuf *eb)
{
	if (!has)
		return td_fail(eb, TD_EINVAL, "%s: missing (give a job id; `trainctl ls` lists them)", path);
	if (id == 0)
		return td_fail(eb, TD_EINVAL, "%s: 0 is not a job id (ids start at 1)", path);
	return TD_OK;
}

static td_err check_ledger(const Traind__LedgerRequest *l, struct td_errbuf *eb)
{
	switch (l->op_case) {
	case TRAIND__LEDGER_REQUEST__OP_LIST:
		return TD_OK;
	case TRAIND__LEDGER_REQUEST__OP_RESERVE: {
		const Traind__LedgerReserve *r = l->reserve;
		if (!r || !r->gpu || !*r->gpu)
			return td_fail(eb, TD_EINVAL,
				       "request.ledger.reserve.gpu: missing (a GPU uuid or index; "
				       "`trainctl info` lists them)");
		if (!r->has_bytes || r->bytes == 0)
			return td_fail(eb, TD_EINVAL, "request.ledger.reserve.bytes: missing or 0");
		return TD_OK;
	}
	case TRAIND__LEDGER_REQUEST__OP_RELEASE:
		if (!l->release || !l->release->has_lease_id || l->release->lease_id == 0)
			return td_fail(eb, TD_EINVAL,
				       "request.ledger.release.lease_id: missing (`trainctl ledger` "
				       "lists the leases)");
		return TD_OK;
	default:
		return td_fail(eb, TD_EINVAL, "request.ledger: no operation (list, reserve or release)");
	}
}

td_err rpc_request_check(const Traind__Request *r, struct td_errbuf *eb)
{
	if (!r)
		return td_fail(eb, TD_EINVAL, "request: none");
	if (!r->has_protocol)
		return td_fail(eb, TD_EINVAL,
			       "request.protocol: missing (is the client a traind trainctl?)");
	if (r->protocol != RPC_PROTOCOL)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "request.protocol: %u, but this daemon speaks %u; use the trainctl "
			       "installed with it",
			       r->protocol, RPC_PROTOCOL);
	switch (r->call_case) {
	case TRAIND__REQUEST__CALL_SUBMIT:
		if (!r->submit || !r->submit->spec)
			return td_fail(eb, TD_EINVAL, "request.submit.spec: missing");
		return TD_OK;
	case TRAIND__REQUEST__CALL_LIST:
	case TRAIND__REQUEST__CALL_INFO:
		return TD_OK;
	case TRAIND__REQUEST__CALL_SHOW:
		return check_id(r->show && r->show->has_id, r->show ? r->show->id : 0,
				"request.show.id", eb);
	case TRAIND__REQUEST__CALL_CANCEL:
		return check_id(r->cancel && r->cancel->has_id, r->cancel ? r->cancel->id : 0,
				"request.cancel.id", eb);
	case TRAIND__REQUEST__CALL_WATCH:
		return check_id(r->watch && r->watch->has_id, r->watch ? r->watch->id : 0,
				"request.watch.id", eb);
	case TRAIND__REQUEST__CALL_LEDGER:
		if (!r->ledger)
			return td_fail(eb, TD_EINVAL, "request.ledger: missing");
		return check_ledger(r->ledger, eb);
	case TRAIND__REQUEST__CALL_CACHE:
		if (!r->cache || r->cache->op_case == TRAIND__CACHE_REQUEST__OP__NOT_SET)
			return td_fail(eb, TD_EINVAL,
				       "request.cache: no operation (expected list, stats or clear)");
		return TD_OK;
	case TRAIND__REQUEST__CALL_HOLD:
		return check_id(r->hold && r->hold->has_id, r->hold ? r->hold->id : 0,
				"request.hold.id", eb);
	case TRAIND__REQUEST__CALL_REQUEUE:
		return check_id(r->requeue && r->requeue->has_id, r->requeue ? r->requeue->id : 0,
				"request.requeue.id", eb);
	case TRAIND__REQUEST__CALL_PRIORITY:
		if (!r->priority || !r->priority->has_priority)
			return td_fail(eb, TD_EINVAL, "request.priority.priority: missing");
		return check_id(r->priority->has_id, r->priority->id, "request.priority.id", eb);
	case TRAIND__REQUEST__CALL_USAGE:
		if (r->usage && r->usage->has_since &&
		    !(r->usage->since >= 0 && r->usage->since < 1e11))
			return td_fail(eb, TD_EINVAL,
				       "request.usage.since: %g is not a time (Unix seconds, >= 0)",
				       r->usage->since);
		return TD_OK;
	default:
		return td_fail(eb, TD_EINVAL,
			       "request: no call set (expected one of submit, list, show, cancel, "
			       "watch, ledger, cache, info, hold, requeue, priority, usage; is the "
			       "daemon older than the client?)");
	}
}

static td_err pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len);

/* protobuf-c keeps unknown fields as they came, and accepts a tag written in
 * more bytes than it needs (field 0 as 0x80 0x00) that it rejects once
 * written back canonically. The daemon re-encodes what it accepts (a spec is
 * copied and stored), so a request must survive that: one that does not is
 * refused here rather than failing later in a confusing place (the fuzzer
 * found it). */
static td_err check_reencodes(const Traind__Request *r, size_t len, struct td_errbuf *eb)
{
	uint8_t *buf = NULL;
	size_t n = 0;
	td_err e = pack(&r->base, &buf, &n);
	if (e != TD_OK)
		return td_fail(eb, e, "request: out of memory");
	Traind__Request *again = traind__request__unpack(NULL, n, buf);
	free(buf);
	if (!again)
		return td_fail(eb, TD_EFORMAT,
			       "request: malformed field tags (%zu bytes; an unknown field with an "
			       "invalid number?)",
			       len);
	protobuf_c_message_free_unpacked(&again->base, NULL);
	return TD_OK;
}

td_err rpc_request_decode(Traind__Request **out, const uint8_t *buf, size_t len, size_t max,
			  struct td_errbuf *eb)
{
	static const uint8_t empty[1];
	if (!out || (!buf && len))
		return td_fail(eb, TD_EINVAL, "request: no buffer");
	if (!max)
		max = RPC_MAX_REQUEST_BYTES;
	if (len > max)
		return td_fail(eb, TD_ERANGE, "request: %zu bytes, more than the %zu a request may have",
			       len, max);
	if (len == 0)
		return td_fail(eb, TD_EFORMAT, "request: empty message (expected a traind.Request)");
	/* protobuf-c says NULL both for bad bytes and for a failed allocation;
	 * within the size bound the first is what happened. */
	Traind__Request *r = traind__request__unpack(NULL, len, buf ? buf : empty);
	if (!r)
		return td_fail(eb, TD_EFORMAT,
			       "request: not a valid traind.Request protobuf (%zu bytes; truncated or "
			       "not from trainctl?)",
			       len);
	td_err e = rpc_request_check(r, eb);
	if (e == TD_OK)
		e = check_reencodes(r, len, eb);
	if (e != TD_OK) {
		rpc_request_free(r);
		return e;
	}
	*out = r;
	return TD_OK;
}

void rpc_request_free(Traind__Request *r)
{
	if (r)
		protobuf_c_message_free_unpacked(&r->base, NULL);
}

static td_err pack(const ProtobufCMessage *m, uint8_t **buf, size_t *len)
{
	if (!m || !buf || !len)
		return TD_EINVAL;
	size_t n = protobuf_c_message_get_packed_size(m);
	uint8_t *b = malloc(n ? n : 1);
	if (!b)
		return TD_ENOMEM;
	size_t w = protobuf_c_message_pack(m, b);
	if (w != n) {
		free(b);
		return TD_EINTERNAL;
	}
	*buf = b;
	*len = n;
	return TD_OK;
}

td_err rpc_request_encode(Traind__Request *r, uint8_t **buf, size_t *len)
{
	if (!r)
		return TD_EINVAL;
	if (!r->has_protocol) {
		r->has_protocol = true;
		r->protocol = RPC_PROTOCOL;
	}
	return pack(&r->base, buf, len);
}

/* ------------------------------------------------------------------------ */
/* Responses */

td_err rpc_response_encode(const Traind__Response *r, uint8_t **buf, size_t *len)
{
	return pack(r ? &r->base : NULL, buf, len);
}

td_err rpc_error_encode(td_err code, const char *msg, uint8_t **buf, size_t *len)
{
	Traind__Response r = TRAIND__RESPONSE__INIT;
	r.has_status = true;
	r.status = code;
	r.message = (char *)(msg && *msg ? msg : td_strerror(code));
	return rpc_response_encode(&r, buf, len);
}

td_err rpc_response_decode(Traind__Response **out, const uint8_t *buf, size_t len,
			   struct td_errbuf *eb)
{
	static const uint8_t empty[1];
	if (!out || (!buf && len))
		return td_fail(eb, TD_EINVAL, "response: no buffer");
	if (len > RPC_MAX_RESPONSE_BYTES)
		return td_fail(eb, TD_ERANGE, "response: %zu bytes, more than the %u accepted", len,
			       RPC_MAX_RESPONSE_BYTES);
	Traind__Response *r = traind__response__unpack(NULL, len, buf ? buf : empty);
	if (!r)
		return td_fail(eb, TD_EFORMAT,
			       "response: not a valid traind.Response protobuf (%zu bytes; is this "
			       "socket a traind?)",
			       len);
	if (!r->has_status || r->status > 0) {
		rpc_response_free(r);
		return td_fail(eb, TD_EFORMAT, "response.status: missing or not a td_err code");
	}
	*out = r;
	return TD_OK;
}

void rpc_response_free(Traind__Response *r)
{
	if (r)
		protobuf_c_message_free_unpacked(&r->base, NULL);
}
