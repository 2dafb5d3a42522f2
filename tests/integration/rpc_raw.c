/* rpc_raw SOCKET KIND [ARG]: sends one hand-made request to traind, the way a
 * broken or hostile client would, and prints the response as
 *   status=CODE NAME message=TEXT
 * Exit 0 when a response came back, 3 when none did.
 *
 * KIND: garbage, truncated, oversized BYTES, empty, no-protocol, bad-spec,
 * no-data, missing-model DIR, relative-path, good-spec MODEL DATA OUTPUT;
 * issue 14's calls without what they need: hold-no-id, priority-no-value,
 * usage-bad-since, after-huge MODEL DATA OUTPUT (submit --after 2^63);
 * storm N: N connections closed at once, every other one after sending the
 * SP header (no request; exit 0).
 * For the integration tests (bad_input.sh); not a client anyone should use. */
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "proto/rpc.h"
#include "proto/rpc_nng.h"

static Traind__JobSpec *spec_for(const char *model, const char *data, const char *out)
{
	static Traind__JobSpec s;
	static Traind__DataSpec d;
	static Traind__Hyper h;
	static Traind__OutputSpec o;
	static Traind__Resources r;
	traind__job_spec__init(&s);
	traind__data_spec__init(&d);
	traind__hyper__init(&h);
	traind__output_spec__init(&o);
	traind__resources__init(&r);
	s.model_dir = (char *)model;
	d.train_file = (char *)data;
	d.has_seq_len = true;
	d.seq_len = 32;
	h.has_max_steps = true;
	h.max_steps = 2;
	o.dir = (char *)out;
	r.has_device = true;
	r.device = TRAIND__DEVICE__DEVICE_CPU;
	s.data = &d;
	s.hyper = &h;
	s.output = &o;
	s.resources = &r;
	return &s;
}

static uint8_t *submit_bytes(Traind__JobSpec *spec, size_t *len)
{
	Traind__SubmitRequest sr = TRAIND__SUBMIT_REQUEST__INIT;
	sr.spec = spec;
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_SUBMIT;
	req.submit = &sr;
	uint8_t *buf = NULL;
	if (rpc_request_encode(&req, &buf, len) != TD_OK)
		exit(2);
	return buf;
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: rpc_raw SOCKET KIND [ARG...]\n");
		return 2;
	}
	const char *kind = argv[2];
	uint8_t *buf = NULL;
	size_t len = 0;
	if (strcmp(kind, "storm") == 0 && argc > 3) {
		/* what made nng 1.5's listener stop accepting (daemon/server.c:
		 * listener_probe): clients that close during the handshake */
		static const uint8_t head[8] = {0, 'S', 'P', 0, 0x00, 0x30, 0, 0};
		struct sockaddr_un sa = {.sun_family = AF_UNIX};
		snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", argv[1]);
		for (long i = 0, n = atol(argv[3]); i < n; i++) {
			int fd = socket(AF_UNIX, SOCK_STREAM, 0);
			if (fd < 0)
				return 2;
			if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && i % 2)
				(void)!write(fd, head, sizeof(head));
			close(fd);
		}
		return 0;
	}
	if (strcmp(kind, "garbage") == 0) {
		len = 300;
		buf = malloc(len);
		for (size_t i = 0; i < len; i++)
			buf[i] = (uint8_t)(0xff - (i * 37) % 11); /* tags with invalid wire types */
	} else if (strcmp(kind, "truncated") == 0) {
		buf = submit_bytes(spec_for("/models/m", "/data/d.tokens", "/out/o"), &len);
		len /= 2;
	} else if (strcmp(kind, "oversized") == 0 && argc > 3) {
		len = strtoull(argv[3], NULL, 10);
		buf = calloc(1, len);
		/* A valid start: the protocol field, then a long unknown string field. */
		buf[0] = 0x08;
		buf[1] = 0x01;
	} else if (strcmp(kind, "empty") == 0) {
		buf = malloc(1);
		len = 0;
	} else if (strcmp(kind, "no-protocol") == 0) {
		Traind__InfoRequest ir = TRAIND__INFO_REQUEST__INIT;
		Traind__Request req = TRAIND__REQUEST__INIT;
		req.call_case = TRAIND__REQUEST__CALL_INFO;
		req.info = &ir;
		len = traind__request__get_packed_size(&req);
		buf = malloc(len + 1);
		traind__request__pack(&req, buf);
	} else if (strcmp(kind, "bad-spec") == 0) {
		Traind__JobSpec *s = spec_for("/models/m", "/data/d.tokens", "/out/o");
		s->hyper->has_lr = true;
		s->hyper->lr = -1;
		buf = submit_bytes(s, &len);
	} else if (strcmp(kind, "no-data") == 0) {
		Traind__JobSpec *s = spec_for("/models/m", "/data/d.tokens", "/out/o");
		s->data = NULL;
		buf = submit_bytes(s, &len);
	} else if (strcmp(kind, "relative-path") == 0) {
		buf = submit_bytes(spec_for("models/m", "/data/d.tokens", "/out/o"), &len);
	} else if (strcmp(kind, "hold-no-id") == 0 || strcmp(kind, "priority-no-value") == 0 ||
		   strcmp(kind, "usage-bad-since") == 0) {
		Traind__HoldRequest hr = TRAIND__HOLD_REQUEST__INIT;
		Traind__PriorityRequest pr = TRAIND__PRIORITY_REQUEST__INIT;
		Traind__UsageRequest ur = TRAIND__USAGE_REQUEST__INIT;
		Traind__Request req = TRAIND__REQUEST__INIT;
		if (kind[0] == 'h') {
			req.call_case = TRAIND__REQUEST__CALL_HOLD;
			req.hold = &hr;
		} else if (kind[0] == 'p') {
			pr.has_id = true;
			pr.id = 1;
			req.call_case = TRAIND__REQUEST__CALL_PRIORITY;
			req.priority = &pr;
		} else {
			ur.has_since = true;
			ur.since = -5;
			req.call_case = TRAIND__REQUEST__CALL_USAGE;
			req.usage = &ur;
		}
		if (rpc_request_encode(&req, &buf, &len) != TD_OK)
			return 2;
	} else if (strcmp(kind, "after-huge") == 0 && argc > 5) {
		uint64_t after[] = {(uint64_t)1 << 63};
		Traind__SubmitRequest sr = TRAIND__SUBMIT_REQUEST__INIT;
		sr.spec = spec_for(argv[3], argv[4], argv[5]);
		sr.after = after;
		sr.n_after = 1;
		Traind__Request req = TRAIND__REQUEST__INIT;
		req.call_case = TRAIND__REQUEST__CALL_SUBMIT;
		req.submit = &sr;
		if (rpc_request_encode(&req, &buf, &len) != TD_OK)
			return 2;
	} else if (strcmp(kind, "missing-model") == 0 && argc > 5) {
		buf = submit_bytes(spec_for(argv[3], argv[4], argv[5]), &len);
	} else {
		fprintf(stderr, "rpc_raw: unknown kind '%s'\n", kind);
		return 2;
	}

	nng_socket s;
	char url[300];
	snprintf(url, sizeof(url), "ipc://%s", argv[1]);
	/* no redial after the daemon drops the connection (the 40 MB case) */
	if (nng_req0_open(&s) != 0 || rpc_req_once(s) != 0 || nng_dial(s, url, NULL, 0) != 0) {
		fprintf(stderr, "rpc_raw: cannot reach %s\n", argv[1]);
		return 3;
	}
	const char *tmo = getenv("RPC_RAW_TIMEOUT_MS");
	nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, tmo ? atoi(tmo) : 30000);
	/* A send the daemon never takes (it stopped reading) must not hang the
	 * test either. */
	nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, tmo ? atoi(tmo) : 30000);
	int rv = nng_send(s, buf, len, 0);
	free(buf);
	if (rv != 0) {
		fprintf(stderr, "rpc_raw: send: %s\n", nng_strerror(rv));
		return 3;
	}
	void *rbuf;
	size_t rlen;
	if ((rv = nng_recv(s, &rbuf, &rlen, NNG_FLAG_ALLOC)) != 0) {
		fprintf(stderr, "rpc_raw: no response: %s\n", nng_strerror(rv));
		nng_close(s);
		return 3;
	}
	Traind__Response *resp = NULL;
	struct td_errbuf eb = {{0}};
	if (rpc_response_decode(&resp, rbuf, rlen, &eb) != TD_OK) {
		fprintf(stderr, "rpc_raw: %s\n", eb.msg);
		nng_free(rbuf, rlen);
		nng_close(s);
		return 3;
	}
	printf("status=%d %s message=%s\n", resp->status, td_errname((td_err)resp->status),
	       resp->message ? resp->message : "");
	rpc_response_free(resp);
	nng_free(rbuf, rlen);
	nng_close(s);
	return 0;
}
