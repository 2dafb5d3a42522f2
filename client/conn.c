/* trainctl's connection to traind (client/ctl.h): nng REQ over ipc://, and
 * protobuf messages as JSON. */
#include "client/ctl.h"

#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "proto/rpc_nng.h"

struct ctl_conn {
	nng_socket sock;
	char path[256];
	atomic_bool lost; /* its one connection closed (no redial: ctl_connect) */
};

static void pipe_removed(nng_pipe p, nng_pipe_ev ev, void *arg)
{
	(void)p;
	(void)ev;
	atomic_store(&((struct ctl_conn *)arg)->lost, true);
}

const char *ctl_default_socket(char *buf, size_t cap)
{
	const char *env = getenv("TRAIND_SOCKET");
	if (env && *env) {
		snprintf(buf, cap, "%s", env);
		return buf;
	}
	const char *rt = getenv("XDG_RUNTIME_DIR");
	struct stat st;
	if (rt && *rt == '/') {
		snprintf(buf, cap, "%s/traind.sock", rt);
		if (stat(buf, &st) == 0 && S_ISSOCK(st.st_mode))
			return buf;
	}
	snprintf(buf, cap, "/run/traind/traind.sock");
	return buf;
}

td_err ctl_connect(struct ctl_conn **out, const char *path, int timeout_ms, struct td_errbuf *eb)
{
	struct ctl_conn *c = calloc(1, sizeof(*c));
	if (!c)
		return td_fail(eb, TD_ENOMEM, "out of memory");
	snprintf(c->path, sizeof(c->path), "%s", path);
	int rv = nng_req0_open(&c->sock);
	if (rv != 0) {
		free(c);
		return td_fail(eb, TD_EIO, "cannot open an nng socket: %s", nng_strerror(rv));
	}
	rpc_req_once(c->sock);
	/* a call after the connection closed fails at once, and a watch
	 * dials again (trainctl.c: reconnect) instead of waiting out --timeout */
	atomic_init(&c->lost, false);
	nng_pipe_notify(c->sock, NNG_PIPE_EV_REM_POST, pipe_removed, c);
	nng_socket_set_ms(c->sock, NNG_OPT_RECVTIMEO, timeout_ms);
	nng_socket_set_ms(c->sock, NNG_OPT_SENDTIMEO, timeout_ms);
	nng_socket_set_size(c->sock, NNG_OPT_RECVMAXSZ, RPC_MAX_RESPONSE_BYTES);
	char url[300];
	snprintf(url, sizeof(url), "ipc://%s", path);
	if ((rv = nng_dial(c->sock, url, NULL, 0)) != 0) {
		nng_close(c->sock);
		free(c);
		return td_fail(eb, TD_EIO,
			       "cannot reach traind at %s (%s); is it running? Start your own with "
			       "`traind --user &`, or `systemctl start traind` for the system service; "
			       "--socket PATH or $TRAIND_SOCKET name another",
			       path, nng_strerror(rv));
	}
	*out = c;
	return TD_OK;
}

void ctl_close(struct ctl_conn *c)
{
	if (!c)
		return;
	nng_close(c->sock);
	free(c);
}

td_err ctl_call(struct ctl_conn *c, Traind__Request *req, Traind__Response **resp,
		struct td_errbuf *eb)
{
	uint8_t *buf = NULL;
	size_t len = 0;
	td_err e = rpc_request_encode(req, &buf, &len);
	if (e != TD_OK)
		return td_fail(eb, e, "cannot encode the request");
	if (len > RPC_MAX_REQUEST_BYTES) {
		free(buf);
		return td_fail(eb, TD_ERANGE, "the request is %zu bytes, more than the %u traind accepts",
			       len, RPC_MAX_REQUEST_BYTES);
	}
	if (atomic_load(&c->lost)) {
		free(buf);
		return td_fail(eb, TD_EIO, "traind at %s closed the connection", c->path);
	}
	int rv = nng_send(c->sock, buf, len, 0);
	free(buf);
	if (rv != 0)
		return td_fail(eb, TD_EIO, "cannot send to traind at %s: %s", c->path, nng_strerror(rv));
	void *rbuf = NULL;
	size_t rlen = 0;
	if ((rv = nng_recv(c->sock, &rbuf, &rlen, NNG_FLAG_ALLOC)) != 0)
		return td_fail(eb, TD_EIO, "no answer from traind at %s: %s%s", c->path, nng_strerror(rv),
			       rv == NNG_ETIMEDOUT ? " (--timeout gives it longer)" : "");
	e = rpc_response_decode(resp, rbuf, rlen, eb);
	nng_free(rbuf, rlen);
	return e;
}

int ctl_exit_for(td_err status)
{
	switch (status) {
	case TD_OK:
		return CTL_OK;
	case TD_EPERM:
		return CTL_PERM;
	case TD_ENOENT:
		return CTL_NOTFOUND;
	case TD_EBUSY:
		return CTL_BUSY;
	case TD_EINVAL:
	case TD_EFORMAT:
	case TD_ERANGE:
		return CTL_USAGE;
	default:
		return CTL_FAILED;
	}
}

/* ------------------------------------------------------------------------ */
/* Messages as JSON, through the descriptors */

static struct json_object *json_value(const ProtobufCFieldDescriptor *f, const void *p)
{
	switch (f->type) {
	case PROTOBUF_C_TYPE_INT32:
	case PROTOBUF_C_TYPE_SINT32:
	case PROTOBUF_C_TYPE_SFIXED32:
		return json_object_new_int(*(const int32_t *)p);
	case PROTOBUF_C_TYPE_UINT32:
	case PROTOBUF_C_TYPE_FIXED32:
		return json_object_new_int64(*(const uint32_t *)p);
	case PROTOBUF_C_TYPE_INT64:
	case PROTOBUF_C_TYPE_SINT64:
	case PROTOBUF_C_TYPE_SFIXED64:
		return json_object_new_int64(*(const int64_t *)p);
	case PROTOBUF_C_TYPE_UINT64:
	case PROTOBUF_C_TYPE_FIXED64:
		return json_object_new_uint64(*(const uint64_t *)p);
	case PROTOBUF_C_TYPE_FLOAT:
		return json_object_new_double(*(const float *)p);
	case PROTOBUF_C_TYPE_DOUBLE:
		return json_object_new_double(*(const double *)p);
	case PROTOBUF_C_TYPE_BOOL:
		return json_object_new_boolean(*(const protobuf_c_boolean *)p);
	case PROTOBUF_C_TYPE_ENUM: {
		const ProtobufCEnumValue *v =
			protobuf_c_enum_descriptor_get_value(f->descriptor, *(const int *)p);
		return v ? json_object_new_string(v->name) : json_object_new_int(*(const int *)p);
	}
	case PROTOBUF_C_TYPE_STRING: {
		const char *s = *(char *const *)p;
		return s ? json_object_new_string(s) : NULL;
	}
	case PROTOBUF_C_TYPE_BYTES: {
		const ProtobufCBinaryData *b = p;
		return json_object_new_string_len((const char *)b->data, (int)b->len);
	}
	case PROTOBUF_C_TYPE_MESSAGE: {
		const ProtobufCMessage *m = *(ProtobufCMessage *const *)p;
		return m ? ctl_json(m) : NULL;
	}
	}
	return NULL;
}

static size_t type_size(ProtobufCType t)
{
	switch (t) {
	case PROTOBUF_C_TYPE_INT64:
	case PROTOBUF_C_TYPE_SINT64:
	case PROTOBUF_C_TYPE_SFIXED64:
	case PROTOBUF_C_TYPE_UINT64:
	case PROTOBUF_C_TYPE_FIXED64:
	case PROTOBUF_C_TYPE_DOUBLE:
		return 8;
	case PROTOBUF_C_TYPE_BOOL:
		return sizeof(protobuf_c_boolean);
	case PROTOBUF_C_TYPE_ENUM:
		return sizeof(int);
	case PROTOBUF_C_TYPE_STRING:
	case PROTOBUF_C_TYPE_MESSAGE:
		return sizeof(void *);
	case PROTOBUF_C_TYPE_BYTES:
		return sizeof(ProtobufCBinaryData);
	default:
		return 4;
	}
}

struct json_object *ctl_json(const ProtobufCMessage *m)
{
	struct json_object *o = json_object_new_object();
	const ProtobufCMessageDescriptor *d = m->descriptor;
	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		const char *base = (const char *)m;
		const void *p = base + f->offset;
		if (f->label == PROTOBUF_C_LABEL_REPEATED) {
			size_t n = *(const size_t *)(base + f->quantifier_offset);
			if (!n)
				continue;
			struct json_object *arr = json_object_new_array();
			const char *items = *(char *const *)p;
			for (size_t k = 0; k < n; k++) {
				struct json_object *v = json_value(f, items + k * type_size(f->type));
				if (v)
					json_object_array_add(arr, v);
			}
			json_object_object_add(o, f->name, arr);
			continue;
		}
		if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
			if (*(const uint32_t *)(base + f->quantifier_offset) != f->id)
				continue;
		} else if (f->quantifier_offset &&
			   (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE) &&
			   !*(const protobuf_c_boolean *)(base + f->quantifier_offset)) {
			continue; /* optional scalar not present */
		}
		struct json_object *v = json_value(f, p);
		if (v)
			json_object_object_add(o, f->name, v);
	}
	return o;
}

void ctl_json_print(FILE *f, struct json_object *o, bool pretty)
{
	fprintf(f, "%s\n",
		json_object_to_json_string_ext(o, (pretty ? JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED : JSON_C_TO_STRING_PLAIN) |
						       JSON_C_TO_STRING_NOSLASHESCAPE));
}
