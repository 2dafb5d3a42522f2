/* trainctl's internals: talking to traind, and printing what it says.
 *
 * trainctl is a thin client: it builds one traind.Request per call (proto/rpc.h),
 * sends it over nng REQ to the daemon's ipc:// socket, and prints the
 * traind.Response for people (tables, a progress bar) or for programs (--json).
 * It never decides anything the daemon decides. */
#ifndef CLIENT_CTL_H
#define CLIENT_CTL_H

#include <json-c/json.h>
#include <protobuf-c/protobuf-c.h>
#include <stdbool.h>
#include <stdio.h>

#include "proto/err.h"
#include "proto/rpc.h"

/* Exit codes (also in `trainctl help`). */
enum ctl_exit {
	CTL_OK = 0,         /* done; watch: the job SUCCEEDED */
	CTL_FAILED = 1,     /* the daemon refused or failed the request; watch: the job FAILED */
	CTL_USAGE = 2,      /* bad arguments or a bad job file */
	CTL_NODAEMON = 3,   /* cannot reach traind */
	CTL_PERM = 4,       /* permission denied */
	CTL_NOTFOUND = 5,   /* no such job, lease or GPU */
	CTL_CANCELLED = 6,  /* watch: the job was CANCELLED */
	CTL_BUSY = 7,       /* does not fit now, over a limit, or the daemon is stopping: retry later */
};

/* A connection to traind. */
struct ctl_conn;

/* The socket: --socket, else $TRAIND_SOCKET, else $XDG_RUNTIME_DIR/traind.sock
 * when it exists (a user's daemon), else /run/traind/traind.sock. */
const char *ctl_default_socket(char *buf, size_t cap);

/* Dials path. TD_EIO with a message that says how to start a daemon. */
td_err ctl_connect(struct ctl_conn **out, const char *path, int timeout_ms, struct td_errbuf *eb);
void ctl_close(struct ctl_conn *c);

/* One call: sends req, waits for the response. Transport failures are
 * TD_EIO (message says so); otherwise TD_OK and *resp holds the decoded
 * response (whose status may be an error). */
td_err ctl_call(struct ctl_conn *c, Traind__Request *req, Traind__Response **resp,
		struct td_errbuf *eb);

/* Exit code for a td_err status. */
int ctl_exit_for(td_err status);

/* Any message as JSON: present fields only, enums by name, bytes as base64
 * would be, but none is sent; 64-bit integers as JSON numbers. */
struct json_object *ctl_json(const ProtobufCMessage *m);

/* Prints o to f, pretty or one line. */
void ctl_json_print(FILE *f, struct json_object *o, bool pretty);

#endif
