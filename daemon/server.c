/* traind serving (daemon/server.h). */
#include "daemon/server.h"

#include "config.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/transport/ipc/ipc.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

#include "daemon/devices.h"
#include "daemon/dispatch.h"
#include "daemon/identity.h"
#include "daemon/metrics.h"
#include "daemon/notify.h"
#include "daemon/peers.h"
#include "daemon/scheduler.h"
#include "proto/log.h"
#include "state/state.h"

/* How often a stopping daemon looks whether its jobs have stopped. */
#define STOP_POLL_MS 100

enum rctx_state { RCTX_RECV, RCTX_WORK, RCTX_SEND };

struct rctx {
	struct server *srv;
	nng_ctx ctx;
	nng_aio *aio;
	nng_msg *msg;          /* the request, between RECV and WORK */
	enum rctx_state state;
	struct rctx *next;     /* in the inbox */
};

struct server {
	struct dmn_config *cfg;
	int argc;
	char **argv;
	uv_loop_t loop;
	uv_async_t wake;
	uv_signal_t sig_term, sig_int, sig_hup;
	uv_timer_t tick, stop_poll, deadline;
	nng_socket sock;
	bool sock_open;
	struct rctx *ctxs;
	int nctx;
	pthread_mutex_t inbox_mu;
	struct rctx *inbox;
	struct st_db *db;
	struct dmn_devices dev;
	struct dmn_sched *sched;
	struct dmn_env env;
	int lock_fd;
	bool loop_ready, started, stopping, closing;
	bool reexec; /* stopping to re-execute (a GPU context that cannot be reset) */
	struct dmn_metrics_http *metrics_http; /* metrics_port */
	/* peer_listen: jobs across daemons (daemon/peers.h) */
	struct dmn_peer_client peerc;
	struct dmn_peers *peers;
	char metrics_err[256];                 /* the textfile's last error, logged once */
	int exit_code;
	char db_path[PATH_MAX];
	/* The socket's listener, and its probe (listener_probe below). */
	nng_listener listener;
	uv_work_t probe;
	bool probing;
	int probe_result; /* probe_socket's: 1 answered, 0 did not, -1 unknown */
	int probe_fails;  /* in a row */
	uint64_t probe_at;
	char probe_why[160];
	/* Listeners replaced by a relisten, kept open (with the connections
	 * they accepted) until RETIRE_MS after: retire_listener below. */
	nng_listener retired[4];
	uint64_t retired_at[4];
	int nretired;
};

/* ------------------------------------------------------------------------ */
/* Requests: nng threads → loop thread → nng */

static void ctx_cb(void *arg)
{
	struct rctx *r = arg;
	struct server *srv = r->srv;
	int rv = nng_aio_result(r->aio);
	if (r->state == RCTX_SEND) {
		if (rv != 0) /* the client went away; the message is still ours */
			nng_msg_free(nng_aio_get_msg(r->aio));
		if (rv == NNG_ECLOSED)
			return;
		r->state = RCTX_RECV;
		nng_ctx_recv(r->ctx, r->aio);
		return;
	}
	if (rv == NNG_ECLOSED || rv == NNG_ECANCELED)
		return;
	if (rv != 0) {
		nng_ctx_recv(r->ctx, r->aio);
		return;
	}
	r->msg = nng_aio_get_msg(r->aio);
	r->state = RCTX_WORK;
	pthread_mutex_lock(&srv->inbox_mu);
	r->next = srv->inbox;
	srv->inbox = r;
	pthread_mutex_unlock(&srv->inbox_mu);
	uv_async_send(&srv->wake);
}

static void reply_cb(void *arg, uint8_t *buf, size_t len)
{
	struct rctx *r = arg;
	nng_msg *m = NULL;
	if (!buf || nng_msg_alloc(&m, 0) != 0 || nng_msg_append(m, buf, len) != 0) {
		/* Out of memory: no reply; the client's request times out. */
		if (m)
			nng_msg_free(m);
		free(buf);
		td_err_log("TD-RPC-OOM", "cannot build a reply");
		r->state = RCTX_RECV;
		nng_ctx_recv(r->ctx, r->aio);
		return;
	}
	free(buf);
	nng_aio_set_msg(r->aio, m);
	r->state = RCTX_SEND;
	nng_ctx_send(r->ctx, r->aio);
}

/* The body of the probe's request, and of the reply handle() gives it (listener_probe, below). */
static const char probe_body[] = "traind-listener-probe";

static void handle(struct server *srv, struct rctx *r)
{
	nng_msg *msg = r->msg;
	r->msg = NULL;
	struct dmn_peer peer;
	struct td_errbuf eb = {{0}};
	if (dmn_peer_of(msg, &peer, &eb) != TD_OK) {
		/* Never serve a request whose sender is unknown (contract 8). */
		td_warn("TD-RPC-NOCRED", "%s", eb.msg);
		size_t len = 0;
		uint8_t *buf = dmn_error_reply(TD_EPERM, eb.msg, &len);
		nng_msg_free(msg);
		reply_cb(r, buf, len);
		return;
	}
	if (peer.pid == getpid() && nng_msg_len(msg) == sizeof(probe_body) &&
	    memcmp(nng_msg_body(msg), probe_body, sizeof(probe_body)) == 0) {
		/* the listener's probe (listener_probe), from this process */
		nng_msg_free(msg);
		uint8_t *buf = malloc(sizeof(probe_body));
		if (buf)
			memcpy(buf, probe_body, sizeof(probe_body));
		reply_cb(r, buf, sizeof(probe_body));
		return;
	}
	dmn_dispatch(&srv->env, &peer, nng_msg_body(msg), nng_msg_len(msg), reply_cb, r);
	nng_msg_free(msg);
}

static void wake_cb(uv_async_t *h)
{
	struct server *srv = h->data;
	pthread_mutex_lock(&srv->inbox_mu);
	struct rctx *list = srv->inbox;
	srv->inbox = NULL;
	pthread_mutex_unlock(&srv->inbox_mu);
	/* The inbox is LIFO; serve in arrival order. */
	struct rctx *rev = NULL;
	while (list) {
		struct rctx *n = list->next;
		list->next = rev;
		rev = list;
		list = n;
	}
	while (rev) {
		struct rctx *r = rev;
		rev = r->next;
		handle(srv, r);
	}
}

/* ------------------------------------------------------------------------ */
/* Start */

static td_err mkdirs(const char *path, mode_t mode, struct td_errbuf *eb)
{
	char tmp[PATH_MAX];
	snprintf(tmp, sizeof(tmp), "%s", path);
	for (char *p = tmp + 1;; p++) {
		if (*p && *p != '/')
			continue;
		char c = *p;
		*p = 0;
		if (mkdir(tmp, c ? 0755 : mode) != 0 && errno != EEXIST)
			return td_fail(eb, td_from_errno(errno), "%s: cannot create: %s", tmp, strerror(errno));
		if (!c)
			break;
		*p = c;
	}
	struct stat st;
	if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
		return td_fail(eb, TD_EINVAL, "%s: not a directory", path);
	return TD_OK;
}

static td_err take_lock(struct server *srv, struct td_errbuf *eb)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/traind.lock", srv->cfg->state_dir);
	int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "%s: %s", path, strerror(errno));
	if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
		char pid[32] = "?";
		ssize_t n = pread(fd, pid, sizeof(pid) - 1, 0);
		pid[n > 0 ? n : 1] = 0;
		pid[strcspn(pid, "\n")] = 0;
		close(fd);
		return td_fail(eb, TD_EBUSY,
			       "another traind (pid %s) serves state dir %s; stop it first or give "
			       "another --state-dir",
			       pid, srv->cfg->state_dir);
	}
	char buf[32];
	int n = snprintf(buf, sizeof(buf), "%d\n", (int)getpid());
	if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n)
		td_warn("TD-LOCK", "%s: cannot write the pid: %s", path, strerror(errno));
	srv->lock_fd = fd;
	return TD_OK;
}

/* A socket file left by a daemon that died is removed; one that answers is
 * another daemon's. */
static td_err clear_socket(const char *path, struct td_errbuf *eb)
{
	struct stat st;
	if (lstat(path, &st) != 0)
		return errno == ENOENT ? TD_OK
				       : td_fail(eb, td_from_errno(errno), "socket: %s: %s", path, strerror(errno));
	if (!S_ISSOCK(st.st_mode))
		return td_fail(eb, TD_EINVAL, "socket: %s exists and is not a socket; remove it", path);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "socket: %s", strerror(errno));
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	int rv = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
	close(fd);
	if (rv == 0)
		return td_fail(eb, TD_EBUSY,
			       "socket: %s is in use by another daemon; stop it or give another --socket",
			       path);
	if (unlink(path) != 0 && errno != ENOENT)
		return td_fail(eb, td_from_errno(errno), "socket: cannot remove the stale %s: %s", path,
			       strerror(errno));
	return TD_OK;
}

/* The socket's listener on cfg->socket, with its mode. */
static td_err start_listener(struct server *srv, struct td_errbuf *eb)
{
	const struct dmn_config *cfg = srv->cfg;
	char url[sizeof(cfg->socket) + 8];
	snprintf(url, sizeof(url), "ipc://%s", cfg->socket);
	int rv;
	if ((rv = nng_listener_create(&srv->listener, srv->sock, url)) != 0)
		return td_fail(eb, TD_EINVAL, "socket: %s: %s", cfg->socket, nng_strerror(rv));
	if ((rv = nng_listener_set_int(srv->listener, NNG_OPT_IPC_PERMISSIONS, (int)cfg->socket_mode)) != 0)
		td_warn("TD-SOCKET-MODE", "socket: cannot set mode %04lo through nng: %s", cfg->socket_mode,
			nng_strerror(rv));
	if ((rv = nng_listener_start(srv->listener, 0)) != 0)
		return td_fail(eb, rv == NNG_EPERM ? TD_EPERM : TD_EIO, "socket: cannot listen on %s: %s",
			       cfg->socket, nng_strerror(rv));
	if (chmod(cfg->socket, (mode_t)cfg->socket_mode) != 0)
		return td_fail(eb, td_from_errno(errno), "socket: chmod %s: %s", cfg->socket, strerror(errno));
	return TD_OK;
}

static td_err listen_socket(struct server *srv, struct td_errbuf *eb)
{
	const struct dmn_config *cfg = srv->cfg;
	char dir[PATH_MAX];
	snprintf(dir, sizeof(dir), "%s", cfg->socket);
	char *slash = strrchr(dir, '/');
	if (slash && slash != dir) {
		*slash = 0;
		td_err e = mkdirs(dir, cfg->mode == DMN_MODE_SYSTEM ? 0755 : 0700, eb);
		if (e != TD_OK)
			return e;
	}
	td_err e = clear_socket(cfg->socket, eb);
	if (e != TD_OK)
		return e;
	int rv = nng_rep0_open(&srv->sock);
	if (rv != 0)
		return td_fail(eb, TD_EINTERNAL, "nng: cannot open a REP socket: %s", nng_strerror(rv));
	srv->sock_open = true;
	/* Requests a bit over the limit still get an error reply that says so;
	 * beyond this nng drops the connection without reading it all. */
	size_t hard = (size_t)cfg->max_request_bytes * 4;
	if (hard < (8u << 20))
		hard = 8u << 20;
	nng_socket_set_size(srv->sock, NNG_OPT_RECVMAXSZ, hard);
	if ((e = start_listener(srv, eb)) != TD_OK)
		return e;

	srv->nctx = (int)cfg->rpc_contexts;
	srv->ctxs = calloc((size_t)srv->nctx, sizeof(*srv->ctxs));
	if (!srv->ctxs)
		return td_fail(eb, TD_ENOMEM, "out of memory");
	for (int i = 0; i < srv->nctx; i++) {
		struct rctx *r = &srv->ctxs[i];
		r->srv = srv;
		if ((rv = nng_ctx_open(&r->ctx, srv->sock)) != 0 ||
		    (rv = nng_aio_alloc(&r->aio, ctx_cb, r)) != 0) {
			srv->nctx = i + (r->aio == NULL ? 0 : 1);
			return td_fail(eb, TD_EINTERNAL, "nng: %s", nng_strerror(rv));
		}
		r->state = RCTX_RECV;
		nng_ctx_recv(r->ctx, r->aio);
	}
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* The listener's probe.
 *
 * nng 1.5 (Debian 12's) stops accepting on a listener for good when a client
 * closes its connection during the SP handshake (nng #1518, fixed in 1.6):
 * the handshake's write fails with EPIPE, which nng reports as NNG_ECLOSED,
 * which the listener takes for its own close. Any local user could make the
 * daemon deaf to every new trainctl with a storm of connect-and-close (and
 * it-bad_input's clients, timing out under load, sometimes did). So the
 * tick probes the socket as a client would, off the loop thread (a work
 * item: a request over a new connection, answered within PROBE_TIMEOUT_MS);
 * after PROBE_FAILS failures in a row the socket is listened on again by a
 * new listener, and the old one is retired (kept with the connections it
 * accepted for a while, then closed). A probe that could not even open an
 * nng socket says nothing about the listener. */
/* A loaded host answers late: three misses of 5 s each before a relisten
 * (~15-25 s deaf). The old listener keeps its connections (retire_listener),
 * so a relisten where the listener was fine costs no client its answer. */
enum { PROBE_EVERY_MS = 2000, PROBE_TIMEOUT_MS = 5000, PROBE_FAILS = 3 };

/* The probe speaks SP over IPC itself, on a plain unix socket: no nng
 * socket of its own to close. nng 1.5's close can hang for good where its
 * dialer is making a pipe at that moment (nng #1498: an endpoint's pipe
 * orphaned at close), and a probe left hanging would keep the loop from
 * ever ending (a work item in flight). The wire: each side's 8-byte header
 * (0, 'S', 'P', 0, the protocol, 0, 0: REQ 0x30, REP 0x31), then messages
 * of a type byte 1, a 64-bit big-endian length and the payload: a request
 * id (4 bytes, the top bit set), then the body; the reply echoes the id. */
static const uint8_t sp_req_header[8] = {0, 'S', 'P', 0, 0x00, 0x30, 0, 0};
static const uint8_t sp_rep_header[8] = {0, 'S', 'P', 0, 0x00, 0x31, 0, 0};

/* libuv's monotonic clock, in ms (safe off the loop's thread) */
static int64_t mono_ms(void)
{
	return (int64_t)(uv_hrtime() / 1000000);
}

/* All n bytes written (out) or read (!out) by the deadline; 0 or an errno
 * (ETIMEDOUT, or EPIPE where the other end closed). */
static int probe_io(int fd, uint8_t *buf, size_t n, bool out, int64_t deadline)
{
	size_t done = 0;
	while (done < n) {
		ssize_t k = out ? send(fd, buf + done, n - done, MSG_NOSIGNAL) : recv(fd, buf + done, n - done, 0);
		if (k > 0) {
			done += (size_t)k;
			continue;
		}
		if (k == 0)
			return EPIPE;
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			return errno;
		int64_t left = deadline - mono_ms();
		if (left <= 0)
			return ETIMEDOUT;
		struct pollfd pf = {.fd = fd, .events = out ? POLLOUT : POLLIN};
		if (poll(&pf, 1, (int)left) < 0 && errno != EINTR)
			return errno;
	}
	return 0;
}

/* v as n big-endian bytes */
static void put_be(uint8_t *p, uint64_t v, int n)
{
	for (int i = n - 1; i >= 0; i--, v >>= 8)
		p[i] = (uint8_t)v;
}

/* 1: a request over a new connection got the daemon's reply; 0: it did
 * not (why says what happened); -1: the probe could not run. A client of
 * the daemon's own socket, in this process (handle() answers a request
 * from this pid itself, nothing dispatched, counted or logged); the SP
 * handshake alone proves nothing: nng 1.5's transport completes it for a
 * listener that no longer hands connections up. Blocks up to
 * PROBE_TIMEOUT_MS. */
static int probe_socket(const char *path, char *why, size_t n)
{
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		snprintf(why, n, "socket: %s", strerror(errno));
		return -1;
	}
	const int64_t deadline = mono_ms() + PROBE_TIMEOUT_MS;
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
	enum { BODY = sizeof(probe_body), ID = 0x80000001u };
	uint8_t head[8], msg[1 + 8 + 4 + BODY], rep[1 + 8 + 4 + BODY];
	msg[0] = 1;
	put_be(msg + 1, 4 + BODY, 8);
	put_be(msg + 9, ID, 4);
	memcpy(msg + 13, probe_body, BODY);
	int rv, result = 0;
	if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
		snprintf(why, n, "connect: %s", strerror(errno));
	else if ((rv = probe_io(fd, (uint8_t *)sp_req_header, sizeof(sp_req_header), true, deadline)) != 0 ||
		 (rv = probe_io(fd, head, sizeof(head), false, deadline)) != 0)
		snprintf(why, n, "handshake: %s", strerror(rv));
	else if (memcmp(head, sp_rep_header, sizeof(head)) != 0)
		snprintf(why, n, "handshake: not a REP socket's header");
	else if ((rv = probe_io(fd, msg, sizeof(msg), true, deadline)) != 0)
		snprintf(why, n, "send: %s", strerror(rv));
	else if ((rv = probe_io(fd, rep, sizeof(rep), false, deadline)) != 0)
		snprintf(why, n, "no reply: %s", strerror(rv));
	else if (memcmp(rep, msg, sizeof(rep)) != 0)
		snprintf(why, n, "another reply");
	else
		result = 1;
	close(fd);
	return result;
}

static void probe_work(uv_work_t *w)
{
	struct server *srv = w->data;
	srv->probe_why[0] = 0;
	srv->probe_result = probe_socket(srv->cfg->socket, srv->probe_why, sizeof(srv->probe_why));
}

/* A replaced listener's life: open for RETIRE_MS after its relisten, then
 * closed. nng closes a listener's connections with it, and unlinks its
 * path, which is the new listener's socket file by then: the file is kept
 * under a second name across the close and renamed back (a client that
 * connects in those microseconds finds no socket, as it would while the
 * daemon restarts). At most RETIRED_MAX at once: a storm of relistens
 * closes the oldest early. */
enum { RETIRE_MS = 60000, RETIRED_MAX = 4 };

static void close_retired(struct server *srv, int i)
{
	char keep[sizeof(srv->cfg->socket) + 16];
	snprintf(keep, sizeof(keep), "%s.relisten", srv->cfg->socket);
	(void)unlink(keep);
	bool kept = link(srv->cfg->socket, keep) == 0;
	nng_listener_close(srv->retired[i]);
	if (kept && rename(keep, srv->cfg->socket) != 0)
		td_warn("TD-RPC-RELISTEN", "socket: rename %s to %s: %s", keep, srv->cfg->socket,
			strerror(errno));
	srv->nretired--;
	memmove(&srv->retired[i], &srv->retired[i + 1], (size_t)(srv->nretired - i) * sizeof(srv->retired[0]));
	memmove(&srv->retired_at[i], &srv->retired_at[i + 1],
		(size_t)(srv->nretired - i) * sizeof(srv->retired_at[0]));
}

static void retire_listener(struct server *srv, nng_listener l)
{
	_Static_assert(RETIRED_MAX <= sizeof(srv->retired) / sizeof(srv->retired[0]), "retired[]");
	if (srv->nretired == RETIRED_MAX)
		close_retired(srv, 0);
	srv->retired[srv->nretired] = l;
	srv->retired_at[srv->nretired++] = uv_now(&srv->loop);
}

/* From the tick: the replaced listeners whose time is up. */
static void reap_retired(struct server *srv)
{
	/* TD_RELISTEN_RETIRE_MS: a test hook (it-bad_input), a shorter life. */
	static long long retire_ms = -1;
	if (retire_ms < 0) {
		const char *v = getenv("TD_RELISTEN_RETIRE_MS");
		char *end;
		long long x = v && *v ? strtoll(v, &end, 10) : -1;
		retire_ms = v && *v && !*end && x >= 0 ? x : RETIRE_MS;
	}
	uint64_t now = uv_now(&srv->loop);
	while (srv->nretired > 0 && now - srv->retired_at[0] >= (uint64_t)retire_ms)
		close_retired(srv, 0);
}

static void probe_done(uv_work_t *w, int status)
{
	struct server *srv = w->data;
	srv->probing = false;
	if (status != 0 || srv->stopping || srv->probe_result < 0)
		return;
	if (srv->probe_result == 1) {
		srv->probe_fails = 0;
		return;
	}
	if (++srv->probe_fails < PROBE_FAILS)
		return;
	td_warn("TD-RPC-RELISTEN",
		"socket %s accepts no connection (%d probes in a row: %s): listening on it again "
		"(nng 1.5 stops accepting after a client closes its connection in the handshake)",
		srv->cfg->socket, srv->probe_fails, srv->probe_why);
	srv->probe_fails = 0;
	/* The new listener binds a new socket file in the path's place (an
	 * unlinked path is what lets it bind while the old one still
	 * listens); the old one keeps the connections it accepted, so a
	 * client in the middle of a request is answered even where the probe
	 * only missed because the host is loaded. */
	nng_listener old = srv->listener;
	if (unlink(srv->cfg->socket) != 0 && errno != ENOENT) {
		td_err_log("TD-RPC-RELISTEN", "socket: unlink %s: %s; the next probe tries again",
			   srv->cfg->socket, strerror(errno));
		return;
	}
	struct td_errbuf eb = {{0}};
	if (start_listener(srv, &eb) != TD_OK) {
		td_err_log("TD-RPC-RELISTEN", "%s; the next probe tries again", eb.msg);
		srv->listener = old; /* still the one to retire next time */
		return;
	}
	retire_listener(srv, old);
}

/* From the tick: a probe every PROBE_EVERY_MS, one at a time. */
static void listener_probe(struct server *srv)
{
	uint64_t now = uv_now(&srv->loop);
	if (srv->probing || srv->stopping || !srv->sock_open || now - srv->probe_at < PROBE_EVERY_MS)
		return;
	srv->probe_at = now;
	srv->probe.data = srv;
	if (uv_queue_work(&srv->loop, &srv->probe, probe_work, probe_done) == 0)
		srv->probing = true;
}

/* ------------------------------------------------------------------------ */
/* Housekeeping, signals, stop */

static void notify_status(struct server *srv)
{
	struct dmn_runners *run = dmn_sched_runners(srv->sched);
	dmn_notify_status("%s%zu running, %u queued", srv->stopping ? "stopping: " : "",
			  dmn_runners_count(run), dmn_sched_queued(srv->sched));
}

static void begin_stop(struct server *srv, const char *why);

static void tick_cb(uv_timer_t *t)
{
	struct server *srv = t->data;
	dmn_notify_watchdog();
	/* The accounting: every queued and running job's usage up to now. */
	struct td_errbuf eb = {{0}};
	if (st_usage_accrue(srv->db, st_now_ms(), &eb) != TD_OK)
		td_warn("TD-USAGE", "cannot accrue usage: %s", eb.msg);
	if (!srv->stopping)
		dmn_sched_tick(srv->sched);
	listener_probe(srv);
	if (!srv->stopping)
		reap_retired(srv);
	/* metrics_textfile: the exposition, atomically, each tick. An error is
	 * logged when it first happens and when it changes. */
	if (*srv->cfg->metrics_textfile) {
		struct td_errbuf meb = {{0}};
		if (dmn_metrics_write_textfile(&srv->env, srv->cfg->metrics_textfile, &meb) != TD_OK) {
			if (strcmp(meb.msg, srv->metrics_err) != 0)
				td_warn("TD-METRICS", "%s", meb.msg);
			snprintf(srv->metrics_err, sizeof(srv->metrics_err), "%s", meb.msg);
		} else {
			srv->metrics_err[0] = 0;
		}
	}
	if (!srv->stopping && dmn_sched_restart_wanted(srv->sched)) {
		srv->reexec = true;
		begin_stop(srv, "a GPU's context cannot be reset in this process");
	}
	notify_status(srv);
}

static void close_handles(struct server *srv);

static void stop_poll_cb(uv_timer_t *t)
{
	struct server *srv = t->data;
	if (srv->closing)
		return;
	if (dmn_runners_count(dmn_sched_runners(srv->sched)) == 0 && srv->env.pending == 0 &&
	    dmn_peers_running(srv->peers) == 0) {
		td_info("TD-STOP", "every job stopped; exiting");
		close_handles(srv);
	}
}

static void deadline_cb(uv_timer_t *t)
{
	struct server *srv = t->data;
	struct dmn_runners *run = dmn_sched_runners(srv->sched);
	size_t n = dmn_runners_count(run);
	td_err_log("TD-STOP-TIMEOUT",
		   "%zu job(s) did not stop within shutdown_timeout_s=%ld; recording them INTERRUPTED "
		   "and exiting",
		   n, srv->cfg->shutdown_timeout_s);
	struct st_job_filter f = {.all_users = true, .state_mask = ST_MASK_ACTIVE};
	struct st_job *jobs = NULL;
	size_t nj = 0;
	if (st_job_list(srv->db, &f, &jobs, &nj, NULL) == TD_OK) {
		for (size_t i = 0; i < nj; i++)
			st_job_transition(srv->db, jobs[i].id, ST_ANY_STATE, ST_INTERRUPTED,
					  "the daemon stopped before the job could checkpoint; it "
					  "resumes from its last checkpoint",
					  NULL, NULL);
		st_jobs_free(jobs, nj);
	}
	st_close(srv->db);
	unlink(srv->cfg->socket);
	/* Runner threads are still inside tr_train: leave without unwinding. */
	_exit(1);
}

static void begin_stop(struct server *srv, const char *why)
{
	if (srv->stopping)
		return;
	srv->stopping = true;
	srv->env.stopping = true;
	size_t n = dmn_runners_count(dmn_sched_runners(srv->sched));
	td_info("TD-STOP", "%s: stopping; %zu running job(s) checkpoint and stop", why, n);
	dmn_notify_stopping();
	dmn_sched_stop(srv->sched);
	dmn_peers_stop(srv->peers); /* other daemons' jobs' ranks here: they stop together */
	notify_status(srv);
	uv_timer_start(&srv->stop_poll, stop_poll_cb, 0, STOP_POLL_MS);
	uv_timer_start(&srv->deadline, deadline_cb, (uint64_t)srv->cfg->shutdown_timeout_s * 1000, 0);
}

static void apply_log_level(const struct dmn_config *cfg)
{
	static const struct {
		const char *name;
		enum td_log_level lvl;
	} lv[] = {{"err", TD_LOG_ERR}, {"warn", TD_LOG_WARN}, {"info", TD_LOG_INFO}, {"debug", TD_LOG_DEBUG}};
	for (size_t i = 0; i < sizeof(lv) / sizeof(lv[0]); i++)
		if (strcmp(cfg->log_level, lv[i].name) == 0)
			td_log_threshold = lv[i].lvl;
}

static void signal_cb(uv_signal_t *h, int signum)
{
	struct server *srv = h->data;
	if (signum == SIGHUP) {
		dmn_notify_reloading();
		struct td_errbuf eb = {{0}};
		if (dmn_config_reload(srv->cfg, srv->argc, srv->argv, &eb) != TD_OK)
			td_err_log("TD-CONFIG-RELOAD", "SIGHUP: keeping the current settings: %s", eb.msg);
		else
			td_info("TD-CONFIG-RELOAD", "SIGHUP: settings reloaded");
		apply_log_level(srv->cfg);
		dmn_identity_flush();
		uv_timer_set_repeat(&srv->tick, (uint64_t)srv->cfg->tick_ms);
		dmn_notify_ready();
		if (!srv->stopping)
			dmn_sched_kick(srv->sched);
		return;
	}
	begin_stop(srv, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* The exit's guard. Once every job has stopped and been recorded, nothing
 * is left to lose, but nng 1.5's close can hang for good where a listener
 * is making a pipe at that moment (nng #1498: a client connecting as the
 * daemon stops); a daemon that never exits holds its socket, its state dir
 * and its systemd unit. So the last stretch has EXIT_GRACE_S: past it the
 * process logs and leaves, with the status it would have had (1 where it
 * meant to re-execute: systemd's Restart=on-failure starts it again). */
enum { EXIT_GRACE_S = 30 };

static int exit_grace_s = EXIT_GRACE_S;

static void *exit_guard_main(void *arg)
{
	int code = (int)(intptr_t)arg;
	struct timespec ts = {.tv_sec = exit_grace_s};
	while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
		;
	td_err_log("TD-STOP",
		   "still not exited %d s after every job stopped (a hang in closing; nng 1.5's "
		   "close is one known); leaving now",
		   exit_grace_s);
	_exit(code);
	return NULL;
}

static void start_exit_guard(int code)
{
	/* Test hooks (it-signals): TD_EXIT_GRACE_S, a shorter grace, and
	 * TD_TEST_EXIT_HANG, a close that never returns. */
	const char *g = getenv("TD_EXIT_GRACE_S");
	if (g && atoi(g) > 0)
		exit_grace_s = atoi(g);
	pthread_t t;
	pthread_attr_t a;
	pthread_attr_init(&a);
	pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
	if (pthread_create(&t, &a, exit_guard_main, (void *)(intptr_t)code) != 0)
		td_warn("TD-STOP", "cannot start the exit's guard thread");
	pthread_attr_destroy(&a);
}

static void close_handles(struct server *srv)
{
	if (srv->closing)
		return;
	srv->closing = true;
	start_exit_guard(srv->reexec || !srv->started ? 1 : 0);
	if (getenv("TD_TEST_EXIT_HANG")) {
		td_warn("TD-STOP", "TD_TEST_EXIT_HANG: the close hangs (test hook)");
		for (;;)
			pause();
	}
	if (srv->sock_open) {
		nng_close(srv->sock); /* aborts every receive; callbacks see NNG_ECLOSED */
		srv->sock_open = false;
	}
	for (int i = 0; i < srv->nctx; i++)
		nng_aio_free(srv->ctxs[i].aio); /* waits for a callback in progress */
	srv->nctx = 0;
	/* A request queued between the close and now gets no reply. */
	pthread_mutex_lock(&srv->inbox_mu);
	for (struct rctx *r = srv->inbox; r; r = r->next)
		nng_msg_free(r->msg);
	srv->inbox = NULL;
	pthread_mutex_unlock(&srv->inbox_mu);
	uv_handle_t *hs[] = {(uv_handle_t *)&srv->wake,      (uv_handle_t *)&srv->sig_term,
			     (uv_handle_t *)&srv->sig_int,   (uv_handle_t *)&srv->sig_hup,
			     (uv_handle_t *)&srv->tick,      (uv_handle_t *)&srv->stop_poll,
			     (uv_handle_t *)&srv->deadline};
	for (size_t i = 0; i < sizeof(hs) / sizeof(hs[0]); i++)
		if (hs[i]->loop && !uv_is_closing(hs[i]))
			uv_close(hs[i], NULL);
	dmn_metrics_http_close(srv->metrics_http);
	dmn_sched_close(srv->sched);
}

/* ------------------------------------------------------------------------ */

static double wall_now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static td_err start(struct server *srv, struct td_errbuf *eb)
{
	struct dmn_config *cfg = srv->cfg;
	td_err e;
	if ((e = mkdirs(cfg->state_dir, 0700, eb)) != TD_OK ||
	    (e = mkdirs(cfg->cache_dir, 0700, eb)) != TD_OK || (e = take_lock(srv, eb)) != TD_OK)
		return e;
	snprintf(srv->db_path, sizeof(srv->db_path), "%s/%s", cfg->state_dir, ST_DB_FILE);
	/* A damaged database (a bad restore, a disk error) is refused with what
	 * to do, before any job is touched (state.h: integrity_check). */
	struct st_open_opts oo = {.integrity_check = true};
	if ((e = st_open(&srv->db, srv->db_path, &oo, eb)) != TD_OK)
		return e;
	/* Jobs the last daemon left running go back to the queue and resume
	 * from their checkpoints; state/ logs what it did (TD-ST-RECOVER). */
	if ((e = st_jobs_recover(srv->db, NULL, eb)) != TD_OK)
		return e;
	st_ledger_reap(srv->db, NULL, NULL);
	if ((e = dmn_devices_init(&srv->dev, cfg->fake_gpus, eb)) != TD_OK ||
	    (e = dmn_devices_links(&srv->dev, cfg->fake_nvlink, eb)) != TD_OK)
		return e;

	int rv = uv_loop_init(&srv->loop);
	if (rv != 0)
		return td_fail(eb, TD_EINTERNAL, "uv_loop_init: %s", uv_strerror(rv));
	srv->loop_ready = true;
	if (cfg->peer_listen[0] && (e = dmn_peer_client_init(&srv->peerc, cfg, eb)) != TD_OK)
		return e;
	struct dmn_sched_deps deps = {.loop = &srv->loop,
				      .db = srv->db,
				      .db_path = srv->db_path,
				      .cfg = cfg,
				      .dev = &srv->dev,
				      .peer = cfg->peer_listen[0] ? &srv->peerc : NULL};
	if ((e = dmn_sched_new(&srv->sched, &deps, eb)) != TD_OK)
		return e;
	srv->env = (struct dmn_env){
		.loop = &srv->loop,
		.cfg = cfg,
		.db = srv->db,
		.sched = srv->sched,
		.dev = &srv->dev,
		.start_time = wall_now(),
	};
	uv_async_init(&srv->loop, &srv->wake, wake_cb);
	srv->wake.data = srv;
	uv_signal_t *sigs[] = {&srv->sig_term, &srv->sig_int, &srv->sig_hup};
	int signums[] = {SIGTERM, SIGINT, SIGHUP};
	for (int i = 0; i < 3; i++) {
		uv_signal_init(&srv->loop, sigs[i]);
		sigs[i]->data = srv;
		uv_signal_start(sigs[i], signal_cb, signums[i]);
	}
	uv_timer_t *timers[] = {&srv->tick, &srv->stop_poll, &srv->deadline};
	for (int i = 0; i < 3; i++) {
		uv_timer_init(&srv->loop, timers[i]);
		timers[i]->data = srv;
	}
	uint64_t tick = (uint64_t)cfg->tick_ms, wd = dmn_notify_watchdog_usec();
	if (wd && wd / 2000 < tick)
		tick = wd / 2000 ? wd / 2000 : 1;
	uv_timer_start(&srv->tick, tick_cb, tick, tick);

	if ((e = listen_socket(srv, eb)) != TD_OK)
		return e;
	if (cfg->metrics_port) {
		if ((e = dmn_metrics_http_start(&srv->metrics_http, &srv->loop, (int)cfg->metrics_port,
						&srv->env, eb)) != TD_OK)
			return e;
		td_info("TD-METRICS", "Prometheus metrics at http://127.0.0.1:%ld/metrics",
			cfg->metrics_port);
	}
	if (cfg->peer_listen[0]) {
		if ((e = dmn_peers_start(&srv->peers, &srv->peerc, cfg, srv->db_path, &srv->dev, eb)) !=
		    TD_OK)
			return e;
		td_info("TD-PEER-LISTEN", "other daemons' jobs (resources.hosts) at %s",
			srv->peerc.self);
	}
	dmn_sched_kick(srv->sched);
	td_info("TD-READY",
		"traind %s serving %s (%s mode, state %s, %d GPU(s), %d simulated GPU(s), %ld CPU "
		"slot(s))",
		TD_VERSION, cfg->socket, dmn_mode_name(cfg->mode), cfg->state_dir, srv->dev.nreal,
		srv->dev.n - srv->dev.nreal, cfg->cpu_slots);
	dmn_notify_ready();
	notify_status(srv);
	return TD_OK;
}

int dmn_serve(struct dmn_config *cfg, int argc, char **argv)
{
	struct server *srv = calloc(1, sizeof(*srv));
	if (!srv) {
		fprintf(stderr, "traind: out of memory\n");
		return 1;
	}
	srv->cfg = cfg;
	srv->argc = argc;
	srv->argv = argv;
	srv->lock_fd = -1;
	pthread_mutex_init(&srv->inbox_mu, NULL);
	apply_log_level(cfg);
	signal(SIGPIPE, SIG_IGN);

	struct td_errbuf eb = {{0}};
	td_err e = start(srv, &eb);
	srv->started = e == TD_OK;
	int code = 0;
	if (e != TD_OK) {
		td_err_log("TD-START", "cannot start: %s", eb.msg);
		fprintf(stderr, "traind: %s\n", eb.msg);
		code = 1;
		if (srv->loop_ready)
			close_handles(srv);
	}
	if (srv->loop_ready) {
		uv_run(&srv->loop, UV_RUN_DEFAULT);
		if (srv->sched && dmn_sched_free(srv->sched) != TD_OK)
			td_err_log("TD-STOP", "the scheduler still had work at exit");
		if (uv_loop_close(&srv->loop) != 0)
			td_err_log("TD-STOP", "libuv handles were left open at exit");
	}
	dmn_peers_free(srv->peers);
	dmn_metrics_http_free(srv->metrics_http);
	free(srv->ctxs);
	st_close(srv->db);
	if (e == TD_OK)
		unlink(cfg->socket);
	if (srv->lock_fd >= 0)
		close(srv->lock_fd);
	pthread_mutex_destroy(&srv->inbox_mu);
	if (srv->reexec && code == 0)
		code = DMN_SERVE_REEXEC;
	free(srv);
	return code;
}
