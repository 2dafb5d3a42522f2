/* Unit test of proto/rpc: the RPC envelope's encode/decode round trips, and
 * the checks every request goes through (a table of bad requests, each with
 * the code and the field its message must name). */
#include "proto/rpc.h"

#include "tests/check.h"

#include <stdint.h>

/* Encodes r and decodes it again; returns decode's code, *msg its message. */
static td_err roundtrip(Traind__Request *r, Traind__Request **out, char *msg, size_t cap)
{
	uint8_t *buf = NULL;
	size_t len = 0;
	CHECK_EQ_INT(rpc_request_encode(r, &buf, &len), TD_OK);
	struct td_errbuf eb = {{0}};
	td_err e = rpc_request_decode(out, buf, len, 0, &eb);
	snprintf(msg, cap, "%s", eb.msg);
	free(buf);
	return e;
}

static void test_good_requests(void)
{
	char msg[1024];
	Traind__Request *d = NULL;

	/* show 42 */
	Traind__JobRef ref = TRAIND__JOB_REF__INIT;
	ref.has_id = true;
	ref.id = 42;
	Traind__Request r = TRAIND__REQUEST__INIT;
	r.call_case = TRAIND__REQUEST__CALL_SHOW;
	r.show = &ref;
	CHECK_EQ_INT(roundtrip(&r, &d, msg, sizeof(msg)), TD_OK);
	if (d) {
		CHECK_EQ_INT(d->protocol, RPC_PROTOCOL);
		CHECK_EQ_INT(d->call_case, TRAIND__REQUEST__CALL_SHOW);
		CHECK_EQ_INT(d->show->id, 42);
		CHECK_STR_EQ(rpc_call_name(d->call_case), "show");
		rpc_request_free(d);
		d = NULL;
	}

	/* submit with a spec */
	Traind__JobSpec spec = TRAIND__JOB_SPEC__INIT;
	spec.model_dir = (char *)"/models/m";
	spec.name = (char *)"n";
	Traind__SubmitRequest sr = TRAIND__SUBMIT_REQUEST__INIT;
	sr.spec = &spec;
	Traind__Request r2 = TRAIND__REQUEST__INIT;
	r2.call_case = TRAIND__REQUEST__CALL_SUBMIT;
	r2.submit = &sr;
	CHECK_EQ_INT(roundtrip(&r2, &d, msg, sizeof(msg)), TD_OK);
	if (d) {
		CHECK_STR_EQ(d->submit->spec->model_dir, "/models/m");
		rpc_request_free(d);
		d = NULL;
	}

	/* ledger reserve */
	Traind__LedgerReserve lr = TRAIND__LEDGER_RESERVE__INIT;
	lr.gpu = (char *)"GPU-1";
	lr.has_bytes = true;
	lr.bytes = 1ull << 33;
	Traind__LedgerRequest l = TRAIND__LEDGER_REQUEST__INIT;
	l.op_case = TRAIND__LEDGER_REQUEST__OP_RESERVE;
	l.reserve = &lr;
	Traind__Request r3 = TRAIND__REQUEST__INIT;
	r3.call_case = TRAIND__REQUEST__CALL_LEDGER;
	r3.ledger = &l;
	CHECK_EQ_INT(roundtrip(&r3, &d, msg, sizeof(msg)), TD_OK);
	if (d) {
		CHECK_EQ_INT(d->ledger->reserve->bytes, 1ull << 33);
		rpc_request_free(d);
	}
}

struct bad_case {
	const char *what;
	td_err code;
	const char *needle; /* the message names this */
};

static void check_bad(Traind__Request *r, const struct bad_case *c)
{
	char msg[1024];
	Traind__Request *d = NULL;
	td_err e = roundtrip(r, &d, msg, sizeof(msg));
	CHECK_MSG(e == c->code, "%s: got %s, want %s (%s)", c->what, td_errname(e), td_errname(c->code), msg);
	CHECK_MSG(strstr(msg, c->needle) != NULL, "%s: message '%s' does not name '%s'", c->what, msg,
		  c->needle);
	CHECK(d == NULL);
	rpc_request_free(d);
}

static void test_bad_envelopes(void)
{
	static const struct bad_case cases[] = {
		{"no call", TD_EINVAL, "no call set"},
		{"show without id", TD_EINVAL, "request.show.id: missing"},
		{"cancel id 0", TD_EINVAL, "request.cancel.id: 0 is not a job id"},
		{"watch without id", TD_EINVAL, "request.watch.id"},
		{"submit without spec", TD_EINVAL, "request.submit.spec: missing"},
		{"ledger without op", TD_EINVAL, "request.ledger: no operation"},
		{"reserve without gpu", TD_EINVAL, "request.ledger.reserve.gpu"},
		{"reserve 0 bytes", TD_EINVAL, "request.ledger.reserve.bytes"},
		{"release without id", TD_EINVAL, "request.ledger.release.lease_id"},
		{"other protocol", TD_EUNSUPPORTED, "request.protocol: 99"},
	};
	Traind__Request r;
	Traind__JobRef ref;
	Traind__SubmitRequest sr;
	Traind__LedgerRequest l;
	Traind__LedgerReserve lr;
	Traind__LedgerRelease rel;
	Traind__WatchRequest w;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		traind__request__init(&r);
		traind__job_ref__init(&ref);
		traind__submit_request__init(&sr);
		traind__ledger_request__init(&l);
		traind__ledger_reserve__init(&lr);
		traind__ledger_release__init(&rel);
		traind__watch_request__init(&w);
		switch (i) {
		case 0:
			break;
		case 1:
			r.call_case = TRAIND__REQUEST__CALL_SHOW;
			r.show = &ref;
			break;
		case 2:
			ref.has_id = true;
			r.call_case = TRAIND__REQUEST__CALL_CANCEL;
			r.cancel = &ref;
			break;
		case 3:
			r.call_case = TRAIND__REQUEST__CALL_WATCH;
			r.watch = &w;
			break;
		case 4:
			r.call_case = TRAIND__REQUEST__CALL_SUBMIT;
			r.submit = &sr;
			break;
		case 5:
			r.call_case = TRAIND__REQUEST__CALL_LEDGER;
			r.ledger = &l;
			break;
		case 6:
		case 7:
			lr.gpu = i == 7 ? (char *)"0" : NULL;
			l.op_case = TRAIND__LEDGER_REQUEST__OP_RESERVE;
			l.reserve = &lr;
			r.call_case = TRAIND__REQUEST__CALL_LEDGER;
			r.ledger = &l;
			break;
		case 8:
			l.op_case = TRAIND__LEDGER_REQUEST__OP_RELEASE;
			l.release = &rel;
			r.call_case = TRAIND__REQUEST__CALL_LEDGER;
			r.ledger = &l;
			break;
		case 9:
			r.has_protocol = true;
			r.protocol = 99;
			r.call_case = TRAIND__REQUEST__CALL_INFO;
			break;
		}
		Traind__InfoRequest ir = TRAIND__INFO_REQUEST__INIT;
		if (r.call_case == TRAIND__REQUEST__CALL_INFO)
			r.info = &ir;
		check_bad(&r, &cases[i]);
	}
}

static void test_bad_bytes(void)
{
	struct td_errbuf eb = {{0}};
	Traind__Request *d = NULL;
	/* Garbage: a field tag with wire type 7 (invalid). */
	static const uint8_t garbage[] = {0xff, 0xff, 0xff, 0xff, 0x0f, 0x07, 0x01};
	CHECK_EQ_INT(rpc_request_decode(&d, garbage, sizeof(garbage), 0, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "not a valid traind.Request");
	CHECK(d == NULL);

	/* A valid request cut short. */
	Traind__JobSpec spec = TRAIND__JOB_SPEC__INIT;
	spec.model_dir = (char *)"/a/rather/long/model/directory/name";
	Traind__SubmitRequest sr = TRAIND__SUBMIT_REQUEST__INIT;
	sr.spec = &spec;
	Traind__Request r = TRAIND__REQUEST__INIT;
	r.call_case = TRAIND__REQUEST__CALL_SUBMIT;
	r.submit = &sr;
	uint8_t *buf;
	size_t len;
	CHECK_EQ_INT(rpc_request_encode(&r, &buf, &len), TD_OK);
	for (size_t cut = 1; cut < len; cut++) {
		memset(&eb, 0, sizeof(eb));
		td_err e = rpc_request_decode(&d, buf, cut, 0, &eb);
		/* A prefix may happen to be a complete shorter message (it then
		 * lacks the call); it must never be accepted as the submit. */
		CHECK_MSG(e != TD_OK, "a %zu-byte prefix of a %zu-byte request decoded", cut, len);
		if (e == TD_OK)
			rpc_request_free(d);
		d = NULL;
	}
	free(buf);

	/* Empty, and over the limit. */
	CHECK_EQ_INT(rpc_request_decode(&d, NULL, 0, 0, &eb), TD_EFORMAT);
	uint8_t big[64] = {0};
	CHECK_EQ_INT(rpc_request_decode(&d, big, sizeof(big), 32, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "64 bytes, more than the 32");
}

static void test_responses(void)
{
	uint8_t *buf;
	size_t len;
	CHECK_EQ_INT(rpc_error_encode(TD_EPERM, "job 3 belongs to another user", &buf, &len), TD_OK);
	Traind__Response *r = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(rpc_response_decode(&r, buf, len, &eb), TD_OK);
	if (r) {
		CHECK_EQ_INT(r->status, TD_EPERM);
		CHECK_STR_EQ(r->message, "job 3 belongs to another user");
		rpc_response_free(r);
	}
	free(buf);

	/* A status that is not a td_err code. */
	Traind__Response bad = TRAIND__RESPONSE__INIT;
	bad.has_status = true;
	bad.status = 5;
	CHECK_EQ_INT(rpc_response_encode(&bad, &buf, &len), TD_OK);
	r = NULL;
	CHECK_EQ_INT(rpc_response_decode(&r, buf, len, &eb), TD_EFORMAT);
	CHECK(r == NULL);
	free(buf);
}

static void test_states(void)
{
	for (int s = TRAIND__JOB_STATE__JOB_STATE_QUEUED; s <= TRAIND__JOB_STATE__JOB_STATE_INTERRUPTED; s++) {
		Traind__JobState back;
		const char *name = rpc_job_state_name((Traind__JobState)s);
		CHECK_EQ_INT(rpc_job_state_from_name(name, &back), TD_OK);
		CHECK_EQ_INT(back, s);
		/* The wire names are the enum's, minus the prefix. */
		const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(&traind__job_state__descriptor, s);
		CHECK(v && strcmp(v->name + strlen("JOB_STATE_"), name) == 0);
	}
	CHECK(rpc_job_state_final(TRAIND__JOB_STATE__JOB_STATE_CANCELLED));
	CHECK(!rpc_job_state_final(TRAIND__JOB_STATE__JOB_STATE_INTERRUPTED));
	CHECK_STR_EQ(rpc_job_state_name((Traind__JobState)77), "UNKNOWN");
}

int main(void)
{
	test_good_requests();
	test_bad_envelopes();
	test_bad_bytes();
	test_responses();
	test_states();
	return check_status();
}
