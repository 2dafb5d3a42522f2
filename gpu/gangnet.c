/* A gang across processes (gpu/comm.h: gpu_hub, gpu_gang_new_net): the hub,
 * and each process's connection to it.
 *
 * The wire: frames of a fixed header (struct frame) and `len` bytes, in the
 * hosts' own byte order (the hosts of one job share it: x86-64 and arm64
 * are both little-endian; a frame with another magic is refused). A process
 * sends HELLO (the token, the world, its label; its ranks in the header) and
 * gets WELCOME or REJECT; then each of its ranks sends OP frames (one
 * collective each: a barrier, a sum of floats or doubles, a reduce-scatter,
 * an all-gather), and the hub answers every rank with a DONE frame once
 * every rank of the world has sent the same op; FAIL frames go both ways (a
 * rank's failure to the hub, the first failure from the hub to everyone); a
 * process whose ranks are done sends BYE before it closes (a connection
 * that closes without it is a process lost).
 *
 * The hub is one thread: poll() over its listening socket and the
 * connections; it reads a whole frame once its header is readable (a peer
 * that stalls mid-frame holds it for at most the socket's receive timeout,
 * then its connection is dropped and the gang fails). Each process has one
 * reader thread that puts each rank's DONE in that rank's mailbox and turns
 * a FAIL, or the connection's end, into the gang's failure.
 *
 * Not here: who the ranks are and what they sum (train/trainer.c), the
 * daemons' own protocol that hands out the hub's address and token
 * (daemon/peers.c). */
#include "gpu/comm_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "proto/log.h"

#define NET_MAGIC 0x474e4454u /* "TDNG" */
/* The most one frame carries: a CPU rank's gradients of a model the CPU
 * trains are far below it; a corrupt header is not. */
#define NET_MAX_PAYLOAD ((uint64_t)1 << 36)
#define NET_LABEL_MAX 200
/* A peer that stops mid-frame, or does not read: dropped after this. */
#define NET_IO_TIMEOUT_S 60
/* A connection that has not joined: it must say HELLO within this (and
 * finish any frame within it), else it is dropped, so that idle or slow
 * connections of strangers neither hold the hub's slots nor its thread. */
#define NET_JOIN_TIMEOUT_MS 5000

enum { M_HELLO = 1, M_WELCOME, M_REJECT, M_OP, M_DONE, M_FAIL, M_BYE };
enum { OP_BARRIER = 1, OP_SUM_F32, OP_RS_F32, OP_AG_F32, OP_SUM_F64 };

struct frame {
	uint32_t magic;
	uint16_t type, op;
	int32_t rank;  /* HELLO: the first of the process's ranks */
	int32_t code;  /* HELLO: how many; FAIL: the td_err */
	uint32_t flag; /* OP_BARRIER, OP_SUM_F64: OR'd over the ranks */
	uint32_t world;
	uint64_t len;
};

static const char *op_name(int op)
{
	static const char *const names[] = {"?", "barrier", "all-reduce", "reduce-scatter",
					    "all-gather", "exchange"};
	return op >= 1 && op <= OP_SUM_F64 ? names[op] : names[0];
}

/* --- I/O ---------------------------------------------------------------- */

static bool write_all(int fd, const void *buf, size_t n)
{
	const char *p = buf;
	while (n) {
		ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			return false;
		p += w;
		n -= (size_t)w;
	}
	return true;
}

static bool read_all(int fd, void *buf, size_t n)
{
	char *p = buf;
	while (n) {
		ssize_t r = recv(fd, p, n, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return false;
		p += r;
		n -= (size_t)r;
	}
	return true;
}

static bool send_frame(int fd, const struct frame *f, const void *payload)
{
	return write_all(fd, f, sizeof(*f)) && (!f->len || write_all(fd, payload, f->len));
}

/* A frame's header and its payload (malloc'd; NULL when len is 0), of at
 * most max bytes. false: the connection ended or sent nonsense (why in err). */
static bool recv_frame_max(int fd, struct frame *f, void **payload, uint64_t max, char *err,
			   size_t cap)
{
	*payload = NULL;
	if (!read_all(fd, f, sizeof(*f))) {
		snprintf(err, cap, "connection closed");
		return false;
	}
	if (f->magic != NET_MAGIC || f->len > max) {
		snprintf(err, cap, "not a gang frame (magic 0x%08x, %llu bytes)", f->magic,
			 (unsigned long long)f->len);
		return false;
	}
	if (!f->len)
		return true;
	if (!(*payload = malloc(f->len))) {
		snprintf(err, cap, "out of memory for a frame of %llu bytes", (unsigned long long)f->len);
		return false;
	}
	if (!read_all(fd, *payload, f->len)) {
		free(*payload);
		*payload = NULL;
		snprintf(err, cap, "connection closed mid-frame");
		return false;
	}
	return true;
}

static bool recv_frame(int fd, struct frame *f, void **payload, char *err, size_t cap)
{
	return recv_frame_max(fd, f, payload, NET_MAX_PAYLOAD, err, cap);
}

/* Keepalive and timeouts: a host that stops answering (powered off, cut
 * off) closes the connection within about 30 s instead of never. */
static void tune_socket(int fd)
{
	int one = 1, idle = 10, intvl = 5, cnt = 3;
	unsigned user_ms = 30000;
	setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
	setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
	setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof(user_ms));
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	struct timeval tv = {.tv_sec = NET_IO_TIMEOUT_S};
	setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

static int64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* "HOST:PORT" (HOST may be [v6]) into host and port. */
static bool split_addr(const char *a, char *host, size_t cap, char *port, size_t pcap)
{
	const char *colon = strrchr(a, ':');
	if (!colon || colon == a || !colon[1])
		return false;
	const char *h = a;
	size_t hl = (size_t)(colon - a);
	if (*h == '[' && hl >= 2 && h[hl - 1] == ']')
		h++, hl -= 2;
	if (hl >= cap || strlen(colon + 1) >= pcap)
		return false;
	memcpy(host, h, hl);
	host[hl] = 0;
	snprintf(port, pcap, "%s", colon + 1);
	return true;
}

/* --- the hub ------------------------------------------------------------ */

struct hub_conn {
	int fd;
	int64_t accepted_ms; /* monotonic */
	bool joined;
	bool left; /* said BYE: its ranks are done */
	int base, nlocal;
	char label[NET_LABEL_MAX + 1];
};

struct gpu_hub {
	int lfd;
	int wake[2];
	char addr[96];
	uint8_t token[GPU_HUB_TOKEN_BYTES];
	int world;
	int64_t join_deadline_ms;
	pthread_t thread;
	bool started;

	/* hub thread only */
	struct hub_conn conn[GPU_GANG_MAX + 4];
	int nconn;
	int owner[GPU_GANG_MAX]; /* rank -> conn index; -1 */
	int joined;              /* ranks joined */
	int op, arrived;
	uint32_t flag;
	void *in[GPU_GANG_MAX];
	uint64_t in_len[GPU_GANG_MAX];
	bool has[GPU_GANG_MAX];

	pthread_mutex_t mu; /* the failure, read by gpu_hub_failed */
	bool failed;
	td_err fail_code;
	int fail_rank;
	char fail_msg[1024];
};

static void hub_drop(struct gpu_hub *h, int k)
{
	struct hub_conn *c = &h->conn[k];
	if (c->fd >= 0)
		close(c->fd);
	c->fd = -1;
	if (c->joined)
		for (int r = c->base; r < c->base + c->nlocal; r++)
			if (h->owner[r] == k)
				h->owner[r] = -1;
	c->joined = false;
}

static void hub_reset_op(struct gpu_hub *h)
{
	for (int r = 0; r < h->world; r++) {
		free(h->in[r]);
		h->in[r] = NULL;
		h->in_len[r] = 0;
		h->has[r] = false;
	}
	h->op = 0;
	h->arrived = 0;
	h->flag = 0;
}

/* The gang's first failure: every connection hears it. */
static void hub_fail(struct gpu_hub *h, int rank, td_err code, const char *fmt, ...)
	__attribute__((format(printf, 4, 5)));
static void hub_fail(struct gpu_hub *h, int rank, td_err code, const char *fmt, ...)
{
	pthread_mutex_lock(&h->mu);
	if (h->failed) {
		pthread_mutex_unlock(&h->mu);
		return;
	}
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(h->fail_msg, sizeof(h->fail_msg), fmt, ap);
	va_end(ap);
	h->failed = true;
	h->fail_code = code;
	h->fail_rank = rank;
	pthread_mutex_unlock(&h->mu);
	td_warn("TD-GANG-FAIL", "gang of %d ranks (hub %s): rank %d: %s", h->world, h->addr, rank,
		h->fail_msg);
	struct frame f = {.magic = NET_MAGIC, .type = M_FAIL, .rank = rank, .code = code,
			  .len = strlen(h->fail_msg) + 1};
	for (int k = 0; k < h->nconn; k++)
		if (h->conn[k].fd >= 0 && h->conn[k].joined && !send_frame(h->conn[k].fd, &f, h->fail_msg))
			hub_drop(h, k);
	hub_reset_op(h);
}

static bool hub_is_failed(struct gpu_hub *h)
{
	pthread_mutex_lock(&h->mu);
	bool f = h->failed;
	pthread_mutex_unlock(&h->mu);
	return f;
}

/* Connection k cannot be written to: a FAIL it sent before it went (a
 * process that gave up, saying why) is the better reason; read what it left. */
static bool hub_drain_fail(struct gpu_hub *h, int k)
{
	for (;;) {
		struct pollfd pf = {.fd = h->conn[k].fd, .events = POLLIN};
		if (poll(&pf, 1, 0) != 1 || !(pf.revents & POLLIN))
			return false;
		struct frame f;
		void *p = NULL;
		char err[160];
		if (!recv_frame(h->conn[k].fd, &f, &p, err, sizeof(err)))
			return false;
		if (f.type == M_FAIL) {
			char msg[1024];
			snprintf(msg, sizeof(msg), "%.*s", (int)(f.len < 1023 ? f.len : 1023),
				 p ? (char *)p : "");
			free(p);
			hub_fail(h, f.rank, f.code < 0 ? f.code : TD_EINTERNAL, "%s", msg);
			return true;
		}
		free(p);
	}
}

/* DONE to rank r with len bytes at p. */
static void hub_done(struct gpu_hub *h, int r, const void *p, uint64_t len)
{
	int k = h->owner[r];
	if (k < 0)
		return;
	struct frame f = {.magic = NET_MAGIC, .type = M_DONE, .op = (uint16_t)h->op, .rank = r,
			  .flag = h->flag, .len = len};
	if (!send_frame(h->conn[k].fd, &f, p)) {
		const struct hub_conn *c = &h->conn[k];
		if (!hub_drain_fail(h, k))
			hub_fail(h, r, TD_EPEER_LOST,
				 "%s (ranks %d to %d) stopped reading the gang's answers", c->label,
				 c->base, c->base + c->nlocal - 1);
		hub_drop(h, k);
	}
}

/* Every rank sent the op: compute and answer each. Sums run in rank order
 * from the left, as the in-process host comm's do (gpu/comm.c). */
static void hub_complete(struct gpu_hub *h)
{
	const int W = h->world;
	uint64_t len = h->in_len[0];
	for (int r = 1; r < W && h->op != OP_BARRIER && h->op != OP_AG_F32; r++)
		if (h->in_len[r] != len) {
			hub_fail(h, r, TD_EINTERNAL,
				 "%s: rank %d gave %llu bytes, rank 0 %llu (the ranks are out of step)",
				 op_name(h->op), r, (unsigned long long)h->in_len[r], (unsigned long long)len);
			return;
		}
	if (h->op == OP_BARRIER) {
		for (int r = 0; r < W; r++)
			hub_done(h, r, h->in[0], h->in_len[0]);
	} else if (h->op == OP_SUM_F32 || h->op == OP_RS_F32) {
		size_t n = len / sizeof(float);
		float *out = h->in[0];
		for (size_t i = 0; i < n; i++) {
			float v = out[i];
			for (int r = 1; r < W; r++)
				v += ((const float *)h->in[r])[i];
			out[i] = v;
		}
		if (h->op == OP_SUM_F32) {
			for (int r = 0; r < W; r++)
				hub_done(h, r, out, len);
		} else {
			if (n % (size_t)W) {
				hub_fail(h, 0, TD_EINTERNAL, "reduce-scatter of %zu floats over %d ranks", n, W);
				return;
			}
			size_t count = n / (size_t)W;
			for (int r = 0; r < W; r++)
				hub_done(h, r, out + count * (size_t)r, count * sizeof(float));
		}
	} else if (h->op == OP_SUM_F64) {
		size_t n = len / sizeof(double);
		double *out = h->in[0];
		for (size_t i = 0; i < n; i++) {
			double v = out[i];
			for (int r = 1; r < W; r++)
				v += ((const double *)h->in[r])[i];
			out[i] = v;
		}
		for (int r = 0; r < W; r++)
			hub_done(h, r, out, len);
	} else { /* OP_AG_F32: each rank's part, in rank order */
		for (int r = 1; r < W; r++)
			if (h->in_len[r] != len) {
				hub_fail(h, r, TD_EINTERNAL, "all-gather: rank %d gave %llu bytes, rank 0 %llu",
					 r, (unsigned long long)h->in_len[r], (unsigned long long)len);
				return;
			}
		char *out = len ? malloc(len * (uint64_t)W) : NULL;
		if (len && !out) {
			hub_fail(h, 0, TD_ENOMEM, "all-gather: out of memory at the hub");
			return;
		}
		for (int r = 0; r < W; r++)
			if (len)
				memcpy(out + len * (uint64_t)r, h->in[r], len);
		for (int r = 0; r < W; r++)
			hub_done(h, r, out, len * (uint64_t)W);
		free(out);
	}
	if (!hub_is_failed(h))
		hub_reset_op(h);
}

static bool token_eq(const uint8_t *a, const uint8_t *b)
{
	uint8_t d = 0; /* constant time */
	for (int i = 0; i < GPU_HUB_TOKEN_BYTES; i++)
		d |= a[i] ^ b[i];
	return d == 0;
}

static void hub_reject(struct gpu_hub *h, int k, const char *why)
{
	struct frame f = {.magic = NET_MAGIC, .type = M_REJECT, .len = strlen(why) + 1};
	send_frame(h->conn[k].fd, &f, why);
	td_warn("TD-GANG-REJECT", "gang hub %s: a connection refused: %s", h->addr, why);
	hub_drop(h, k);
}

/* A frame from connection k. */
static void hub_frame(struct gpu_hub *h, int k)
{
	struct hub_conn *c = &h->conn[k];
	struct frame f;
	void *p = NULL;
	char err[160];
	/* Before HELLO only a HELLO's size is read: a stranger allocates nothing. */
	uint64_t max = c->joined ? NET_MAX_PAYLOAD : GPU_HUB_TOKEN_BYTES + NET_LABEL_MAX;
	if (!recv_frame_max(c->fd, &f, &p, max, err, sizeof(err))) {
		if (c->joined)
			hub_fail(h, c->base, TD_EPEER_LOST,
				 "lost %s (ranks %d to %d): %s; its daemon or host is gone", c->label,
				 c->base, c->base + c->nlocal - 1, err);
		hub_drop(h, k);
		return;
	}
	if (!c->joined) {
		char why[160] = "";
		if (f.type != M_HELLO || f.len < GPU_HUB_TOKEN_BYTES ||
		    f.len > GPU_HUB_TOKEN_BYTES + NET_LABEL_MAX || !token_eq(p, h->token))
			snprintf(why, sizeof(why), "not this gang's token");
		else if ((int)f.world != h->world || f.rank < 0 || f.code < 1 ||
			 f.rank + f.code > h->world)
			snprintf(why, sizeof(why), "ranks %d + %d of %u, the gang has %d", f.rank, f.code,
				 f.world, h->world);
		for (int r = f.rank; !why[0] && r < f.rank + f.code; r++)
			if (h->owner[r] >= 0)
				snprintf(why, sizeof(why), "rank %d joined already", r);
		if (why[0]) {
			free(p);
			hub_reject(h, k, why);
			return;
		}
		size_t ll = (size_t)f.len - GPU_HUB_TOKEN_BYTES;
		memcpy(c->label, (char *)p + GPU_HUB_TOKEN_BYTES, ll);
		c->label[ll] = 0;
		free(p);
		c->joined = true;
		struct timeval tv = {.tv_sec = NET_IO_TIMEOUT_S};
		setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
		c->base = f.rank;
		c->nlocal = f.code;
		for (int r = c->base; r < c->base + c->nlocal; r++)
			h->owner[r] = k;
		h->joined += c->nlocal;
		struct frame w = {.magic = NET_MAGIC, .type = M_WELCOME, .world = (uint32_t)h->world};
		if (!send_frame(c->fd, &w, NULL)) {
			hub_fail(h, c->base, TD_EPEER_LOST, "lost %s as it joined", c->label);
			hub_drop(h, k);
			return;
		}
		td_info("TD-GANG-JOIN", "gang hub %s: %s joined (ranks %d to %d; %d of %d)", h->addr,
			c->label, c->base, c->base + c->nlocal - 1, h->joined, h->world);
		if (hub_is_failed(h)) { /* it learns at once */
			pthread_mutex_lock(&h->mu);
			char msg[1024];
			snprintf(msg, sizeof(msg), "%s", h->fail_msg);
			struct frame ff = {.magic = NET_MAGIC, .type = M_FAIL, .rank = h->fail_rank,
					   .code = h->fail_code, .len = strlen(msg) + 1};
			pthread_mutex_unlock(&h->mu);
			send_frame(c->fd, &ff, msg);
		}
		return;
	}
	if (f.type == M_BYE) {
		free(p);
		c->left = true;
		if (h->arrived && !hub_is_failed(h))
			for (int r = c->base; r < c->base + c->nlocal; r++)
				if (!h->has[r]) {
					hub_fail(h, r, TD_EINTERNAL,
						 "%s left (rank %d done) while the others are in a %s",
						 c->label, r, op_name(h->op));
					break;
				}
		hub_drop(h, k);
		return;
	}
	if (f.type == M_FAIL) {
		char msg[1024];
		snprintf(msg, sizeof(msg), "%.*s", (int)(f.len < 1023 ? f.len : 1023), p ? (char *)p : "");
		free(p);
		hub_fail(h, f.rank, f.code < 0 ? f.code : TD_EINTERNAL, "%s", msg);
		return;
	}
	if (f.type != M_OP || f.rank < c->base || f.rank >= c->base + c->nlocal) {
		free(p);
		hub_fail(h, c->base, TD_EINTERNAL, "%s sent frame type %u for rank %d", c->label, f.type,
			 f.rank);
		hub_drop(h, k);
		return;
	}
	if (hub_is_failed(h)) { /* the FAIL was sent; nothing completes again */
		free(p);
		return;
	}
	if (h->arrived && f.op != h->op) {
		free(p);
		hub_fail(h, f.rank, TD_EINTERNAL,
			 "rank %d asked for a %s while the others are in a %s (the ranks are out of step)",
			 f.rank, op_name(f.op), op_name(h->op));
		return;
	}
	if (h->has[f.rank]) {
		free(p);
		hub_fail(h, f.rank, TD_EINTERNAL, "rank %d sent a %s twice", f.rank, op_name(f.op));
		return;
	}
	for (int r = 0; r < h->world; r++)
		if (h->owner[r] < 0 && h->joined == h->world) {
			/* its process said BYE: it will never come */
			free(p);
			hub_fail(h, r, TD_EINTERNAL, "rank %d asked for a %s, and rank %d is done",
				 f.rank, op_name(f.op), r);
			return;
		}
	h->op = f.op;
	h->in[f.rank] = p;
	h->in_len[f.rank] = f.len;
	h->has[f.rank] = true;
	h->flag |= f.flag;
	if (++h->arrived == h->world)
		hub_complete(h);
}

static void *hub_main(void *arg)
{
	struct gpu_hub *h = arg;
	struct pollfd pf[GPU_GANG_MAX + 6];
	for (;;) {
		int np = 0;
		pf[np++] = (struct pollfd){.fd = h->wake[0], .events = POLLIN};
		pf[np++] = (struct pollfd){.fd = h->lfd, .events = POLLIN};
		int idx[GPU_GANG_MAX + 4];
		for (int k = 0; k < h->nconn; k++)
			if (h->conn[k].fd >= 0) {
				idx[np - 2] = k;
				pf[np++] = (struct pollfd){.fd = h->conn[k].fd, .events = POLLIN};
			}
		int timeout = -1;
		/* Strangers that did not join in time go. */
		int64_t now = mono_ms();
		for (int k = 0; k < h->nconn; k++)
			if (h->conn[k].fd >= 0 && !h->conn[k].joined) {
				int64_t left = h->conn[k].accepted_ms + NET_JOIN_TIMEOUT_MS - now;
				if (left <= 0)
					hub_drop(h, k);
				else if (timeout < 0 || left < timeout)
					timeout = (int)left;
			}
		if (h->joined < h->world && !hub_is_failed(h)) {
			int64_t left = h->join_deadline_ms - mono_ms();
			if (left <= 0) {
				hub_fail(h, -1, TD_EPEER_LOST,
					 "%d of the gang's %d ranks joined its hub %s within the time allowed "
					 "(a daemon of the job did not start its ranks)",
					 h->joined, h->world, h->addr);
				continue;
			}
			if (timeout < 0 || left < timeout)
				timeout = (int)left;
		}
		int rv = poll(pf, (nfds_t)np, timeout);
		if (rv < 0 && errno == EINTR)
			continue;
		if (rv < 0)
			break;
		if (pf[0].revents)
			break; /* gpu_hub_free */
		if (pf[1].revents & POLLIN) {
			int fd = accept4(h->lfd, NULL, NULL, SOCK_CLOEXEC);
			int k = -1, oldest = -1;
			for (int i = 0; fd >= 0 && i < h->nconn; i++) {
				if (h->conn[i].fd < 0)
					k = i;
				else if (!h->conn[i].joined &&
					 (oldest < 0 || h->conn[i].accepted_ms < h->conn[oldest].accepted_ms))
					oldest = i;
			}
			if (fd >= 0 && k < 0 && h->nconn < GPU_GANG_MAX + 4)
				k = h->nconn++;
			if (fd >= 0 && k < 0 && oldest >= 0) { /* full: the oldest stranger goes */
				hub_drop(h, oldest);
				k = oldest;
			}
			if (fd >= 0 && k < 0) {
				close(fd); /* more connections than ranks: none of ours */
			} else if (fd >= 0) {
				tune_socket(fd);
				struct timeval tv = {.tv_sec = NET_JOIN_TIMEOUT_MS / 1000};
				setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
				h->conn[k] = (struct hub_conn){.fd = fd, .accepted_ms = mono_ms()};
			}
		}
		for (int i = 2; i < np; i++)
			if (pf[i].revents && h->conn[idx[i - 2]].fd == pf[i].fd)
				hub_frame(h, idx[i - 2]);
	}
	return NULL;
}

td_err gpu_hub_new(struct gpu_hub **out, const char *bind_host, int world,
		   const uint8_t token[GPU_HUB_TOKEN_BYTES], int join_ms, struct td_errbuf *eb)
{
	if (world < 1 || world > GPU_GANG_MAX)
		return td_fail(eb, TD_EINVAL, "a gang of %d ranks (1 to %d)", world, GPU_GANG_MAX);
	struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				 .ai_flags = AI_PASSIVE}, *ai = NULL;
	int gr = getaddrinfo(bind_host, "0", &hints, &ai);
	if (gr != 0)
		return td_fail(eb, TD_EINVAL, "gang hub: %s: %s", bind_host, gai_strerror(gr));
	int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	int one = 1;
	if (fd >= 0)
		setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 64) != 0) {
		int en = errno;
		if (fd >= 0)
			close(fd);
		freeaddrinfo(ai);
		return td_fail(eb, TD_EIO, "gang hub: cannot listen on %s: %s", bind_host, strerror(en));
	}
	freeaddrinfo(ai);
	struct sockaddr_storage ss;
	socklen_t sl = sizeof(ss);
	char host[64] = "?", port[16] = "0";
	if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0)
		getnameinfo((struct sockaddr *)&ss, sl, host, sizeof(host), port, sizeof(port),
			    NI_NUMERICHOST | NI_NUMERICSERV);
	struct gpu_hub *h = calloc(1, sizeof(*h));
	if (!h || pipe2(h->wake, O_CLOEXEC) != 0) {
		close(fd);
		free(h);
		return td_fail(eb, TD_ENOMEM, "gang hub: out of memory");
	}
	h->lfd = fd;
	h->world = world;
	memcpy(h->token, token, GPU_HUB_TOKEN_BYTES);
	snprintf(h->addr, sizeof(h->addr), strchr(host, ':') ? "[%s]:%s" : "%s:%s", host, port);
	h->join_deadline_ms = mono_ms() + (join_ms > 0 ? join_ms : 60000);
	for (int r = 0; r < GPU_GANG_MAX; r++)
		h->owner[r] = -1;
	pthread_mutex_init(&h->mu, NULL);
	int rv = pthread_create(&h->thread, NULL, hub_main, h);
	if (rv != 0) {
		gpu_hub_free(h);
		return td_fail(eb, TD_EINTERNAL, "gang hub: cannot start its thread: %s", strerror(rv));
	}
	h->started = true;
	*out = h;
	return TD_OK;
}

const char *gpu_hub_addr(const struct gpu_hub *h)
{
	return h->addr;
}

bool gpu_hub_failed(struct gpu_hub *h, td_err *code, struct td_errbuf *eb)
{
	pthread_mutex_lock(&h->mu);
	bool f = h->failed;
	if (f && code)
		*code = h->fail_code;
	if (f && eb)
		snprintf(eb->msg, sizeof(eb->msg), "%s", h->fail_msg);
	pthread_mutex_unlock(&h->mu);
	return f;
}

void gpu_hub_free(struct gpu_hub *h)
{
	if (!h)
		return;
	if (h->started) {
		char b = 1;
		ssize_t w = write(h->wake[1], &b, 1);
		(void)w;
		pthread_join(h->thread, NULL);
	}
	for (int k = 0; k < h->nconn; k++)
		if (h->conn[k].fd >= 0)
			close(h->conn[k].fd);
	hub_reset_op(h);
	close(h->lfd);
	close(h->wake[0]);
	close(h->wake[1]);
	pthread_mutex_destroy(&h->mu);
	free(h);
}

/* --- a process's end ---------------------------------------------------- */

struct gpu__net {
	int fd;
	char hub[96];
	pthread_mutex_t send_mu;
	pthread_t rx;
	bool rx_started;
	atomic_bool closing;
	/* under the gang's mutex: each local rank's answer */
	struct {
		bool ready;
		void *buf;
		uint64_t len;
		uint32_t flag;
	} box[GPU_GANG_MAX];
};

static void *net_rx(void *arg)
{
	struct gpu_gang *g = arg;
	struct gpu__net *nt = g->net;
	for (;;) {
		struct frame f;
		void *p = NULL;
		char err[160];
		if (!recv_frame(nt->fd, &f, &p, err, sizeof(err))) {
			if (!atomic_load(&nt->closing)) {
				char msg[400];
				snprintf(msg, sizeof(msg),
					 "lost the gang's hub at %s (the coordinating daemon or its host is "
					 "gone): %s",
					 nt->hub, err);
				gpu__gang_fail_first(g, g->base, TD_EPEER_LOST, msg);
			}
			return NULL;
		}
		if (f.type == M_FAIL) {
			char msg[1024];
			snprintf(msg, sizeof(msg), "%.*s", (int)(f.len < 1023 ? f.len : 1023),
				 p ? (char *)p : "");
			free(p);
			/* The hub's first failure: not sent back. */
			gpu__gang_fail_first(g, f.rank, f.code < 0 ? f.code : TD_EINTERNAL, msg);
			continue;
		}
		int k = f.rank - g->base;
		if (f.type != M_DONE || k < 0 || k >= g->nlocal) {
			free(p);
			char msg[160];
			snprintf(msg, sizeof(msg), "the gang's hub at %s sent frame type %u for rank %d",
				 nt->hub, f.type, f.rank);
			gpu__gang_fail_first(g, g->base, TD_EINTERNAL, msg);
			continue;
		}
		pthread_mutex_lock(&g->mu);
		free(nt->box[k].buf);
		nt->box[k].buf = p;
		nt->box[k].len = f.len;
		nt->box[k].flag = f.flag;
		nt->box[k].ready = true;
		pthread_cond_broadcast(&g->cv);
		pthread_mutex_unlock(&g->mu);
	}
}

/* Rank `rank` sends op with len bytes at in (flag OR'd), then waits for its
 * answer: *out (malloc'd, the caller frees; may be NULL when empty). */
static td_err net_op(struct gpu_gang *g, int rank, int op, const void *in, uint64_t len,
		     uint32_t flag, void **out, uint64_t *out_len, uint32_t *out_flag,
		     struct td_errbuf *eb)
{
	struct gpu__net *nt = g->net;
	int k = rank - g->base;
	if (gpu_gang_failed(g))
		return gpu__gang_stopped(g, rank, eb);
	struct frame f = {.magic = NET_MAGIC, .type = M_OP, .op = (uint16_t)op, .rank = rank,
			  .flag = flag, .world = (uint32_t)g->n, .len = len};
	pthread_mutex_lock(&nt->send_mu);
	bool ok = send_frame(nt->fd, &f, in);
	pthread_mutex_unlock(&nt->send_mu);
	if (!ok) {
		char msg[300];
		snprintf(msg, sizeof(msg),
			 "lost the gang's hub at %s (the coordinating daemon or its host is gone): rank "
			 "%d's %s: %s",
			 nt->hub, rank, op_name(op), strerror(errno));
		gpu__gang_fail_first(g, rank, TD_EPEER_LOST, msg);
		return gpu__gang_stopped(g, rank, eb);
	}
	pthread_mutex_lock(&g->mu);
	while (!nt->box[k].ready && !atomic_load(&g->failed)) {
		if (!g->abort) {
			pthread_cond_wait(&g->cv, &g->mu);
			continue;
		}
		/* Polls the abort flag twice a second (gpu_gang_set_abort). */
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += 500 * 1000 * 1000;
		if (ts.tv_nsec >= 1000000000)
			ts.tv_sec++, ts.tv_nsec -= 1000000000;
		pthread_cond_timedwait(&g->cv, &g->mu, &ts);
		if (atomic_load(g->abort) && !atomic_load(&g->failed)) {
			pthread_mutex_unlock(&g->mu);
			gpu__gang_poll_abort(g, rank);
			pthread_mutex_lock(&g->mu);
		}
	}
	if (atomic_load(&g->failed)) {
		pthread_mutex_unlock(&g->mu);
		return gpu__gang_stopped(g, rank, eb);
	}
	void *p = nt->box[k].buf;
	uint64_t n = nt->box[k].len;
	uint32_t fl = nt->box[k].flag;
	nt->box[k].buf = NULL;
	nt->box[k].ready = false;
	pthread_mutex_unlock(&g->mu);
	if (out)
		*out = p;
	else
		free(p);
	if (out_len)
		*out_len = n;
	if (out_flag)
		*out_flag = fl;
	return TD_OK;
}

/* An answer of the wrong size: the ranks disagree (a bug, or mixed builds). */
static td_err net_mismatch(struct gpu_gang *g, int rank, const char *what, uint64_t got,
			   uint64_t want, struct td_errbuf *eb)
{
	td_err e = td_fail(eb, TD_EINTERNAL, "%s: rank %d got %llu bytes from the gang's hub, not %llu",
			   what, rank, (unsigned long long)got, (unsigned long long)want);
	gpu_gang_fail(g, rank, e, eb ? eb->msg : NULL);
	return e;
}

td_err gpu__net_barrier(struct gpu_gang *g, int rank, void *buf, size_t len, struct td_errbuf *eb)
{
	void *p = NULL;
	uint64_t n = 0;
	td_err e = net_op(g, rank, OP_BARRIER, rank == 0 ? buf : NULL, rank == 0 ? len : 0, 0, &p,
			  &n, NULL, eb);
	if (e == TD_OK && n != len)
		e = net_mismatch(g, rank, "barrier", n, len, eb);
	if (e == TD_OK && len)
		memcpy(buf, p, len);
	free(p);
	return e;
}

td_err gpu__net_exchange(struct gpu_gang *g, int rank, double *v, size_t n, bool *flag,
			 struct td_errbuf *eb)
{
	void *p = NULL;
	uint64_t got = 0;
	uint32_t fl = 0;
	td_err e = net_op(g, rank, OP_SUM_F64, v, n * sizeof(double), *flag ? 1 : 0, &p, &got, &fl,
			  eb);
	if (e == TD_OK && got != n * sizeof(double))
		e = net_mismatch(g, rank, "exchange", got, n * sizeof(double), eb);
	if (e == TD_OK) {
		if (n)
			memcpy(v, p, n * sizeof(double));
		*flag = fl != 0;
	}
	free(p);
	return e;
}

td_err gpu__net_all_reduce(struct gpu_gang *g, int rank, float *x, size_t n, struct td_errbuf *eb)
{
	void *p = NULL;
	uint64_t got = 0;
	td_err e = net_op(g, rank, OP_SUM_F32, x, n * sizeof(float), 0, &p, &got, NULL, eb);
	if (e == TD_OK && got != n * sizeof(float))
		e = net_mismatch(g, rank, "all-reduce", got, n * sizeof(float), eb);
	if (e == TD_OK && n)
		memcpy(x, p, n * sizeof(float));
	free(p);
	return e;
}

td_err gpu__net_reduce_scatter(struct gpu_gang *g, int rank, float *x, size_t count,
			       struct td_errbuf *eb)
{
	void *p = NULL;
	uint64_t got = 0;
	size_t n = count * (size_t)g->n;
	td_err e = net_op(g, rank, OP_RS_F32, x, n * sizeof(float), 0, &p, &got, NULL, eb);
	if (e == TD_OK && got != count * sizeof(float))
		e = net_mismatch(g, rank, "reduce-scatter", got, count * sizeof(float), eb);
	if (e == TD_OK && count)
		memcpy(x + count * (size_t)rank, p, count * sizeof(float));
	free(p);
	return e;
}

td_err gpu__net_all_gather(struct gpu_gang *g, int rank, float *x, size_t count,
			   struct td_errbuf *eb)
{
	void *p = NULL;
	uint64_t got = 0;
	size_t n = count * (size_t)g->n;
	td_err e = net_op(g, rank, OP_AG_F32, x + count * (size_t)rank, count * sizeof(float), 0, &p,
			  &got, NULL, eb);
	if (e == TD_OK && got != n * sizeof(float))
		e = net_mismatch(g, rank, "all-gather", got, n * sizeof(float), eb);
	if (e == TD_OK && n)
		memcpy(x, p, n * sizeof(float));
	free(p);
	return e;
}

void gpu__net_send_fail(struct gpu_gang *g, int rank, td_err e, const char *msg)
{
	struct gpu__net *nt = g->net;
	const char *m = msg && *msg ? msg : td_strerror(e);
	struct frame f = {.magic = NET_MAGIC, .type = M_FAIL, .rank = rank, .code = e,
			  .len = strlen(m) + 1};
	pthread_mutex_lock(&nt->send_mu);
	send_frame(nt->fd, &f, m); /* a hub that is gone fails the gang anyway */
	pthread_mutex_unlock(&nt->send_mu);
}

void gpu__net_close(struct gpu_gang *g)
{
	struct gpu__net *nt = g->net;
	atomic_store(&nt->closing, true);
	if (!gpu_gang_failed(g)) { /* done, not lost */
		struct frame f = {.magic = NET_MAGIC, .type = M_BYE, .rank = g->base};
		pthread_mutex_lock(&nt->send_mu);
		send_frame(nt->fd, &f, NULL);
		pthread_mutex_unlock(&nt->send_mu);
	}
	shutdown(nt->fd, SHUT_RDWR);
	if (nt->rx_started)
		pthread_join(nt->rx, NULL);
	close(nt->fd);
	for (int k = 0; k < GPU_GANG_MAX; k++)
		free(nt->box[k].buf);
	pthread_mutex_destroy(&nt->send_mu);
	free(nt);
	g->net = NULL;
}

/* Connects to hub, retrying while refused until deadline; -1 with why. */
static int net_connect(const char *hub, int64_t deadline_ms, char *why, size_t cap)
{
	char host[80], port[16];
	if (!split_addr(hub, host, sizeof(host), port, sizeof(port))) {
		snprintf(why, cap, "'%s' is not HOST:PORT", hub);
		return -1;
	}
	for (long sleep_ms = 20;; sleep_ms = sleep_ms < 500 ? sleep_ms * 2 : 500) {
		struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
		int gr = getaddrinfo(host, port, &hints, &ai);
		if (gr != 0) {
			snprintf(why, cap, "%s: %s", host, gai_strerror(gr));
		} else {
			int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
			if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
				freeaddrinfo(ai);
				tune_socket(fd);
				return fd;
			}
			snprintf(why, cap, "%s", strerror(errno));
			if (fd >= 0)
				close(fd);
			freeaddrinfo(ai);
		}
		if (mono_ms() + sleep_ms > deadline_ms)
			return -1;
		nanosleep(&(struct timespec){.tv_sec = sleep_ms / 1000,
					     .tv_nsec = sleep_ms % 1000 * 1000000},
			  NULL);
	}
}

td_err gpu_gang_new_net(struct gpu_gang **out, int world, int base, int nlocal, const char *hub,
			const uint8_t token[GPU_HUB_TOKEN_BYTES], const char *label, int timeout_ms,
			struct td_errbuf *eb)
{
	if (nlocal < 1 || base < 0 || base + nlocal > world)
		return td_fail(eb, TD_EINVAL, "gang: ranks %d to %d of %d", base, base + nlocal - 1, world);
	struct gpu_gang *g;
	td_err e = gpu_gang_new(&g, world, timeout_ms, eb);
	if (e != TD_OK)
		return e;
	struct gpu__net *nt = calloc(1, sizeof(*nt));
	if (!nt) {
		gpu_gang_free(g);
		return td_fail(eb, TD_ENOMEM, "gang: out of memory");
	}
	snprintf(nt->hub, sizeof(nt->hub), "%s", hub);
	pthread_mutex_init(&nt->send_mu, NULL);
	atomic_init(&nt->closing, false);
	char why[200] = "";
	nt->fd = net_connect(hub, mono_ms() + 5000, why, sizeof(why));
	if (nt->fd < 0) {
		pthread_mutex_destroy(&nt->send_mu);
		free(nt);
		gpu_gang_free(g);
		return td_fail(eb, TD_EPEER_LOST, "cannot reach the gang's hub at %s: %s", hub, why);
	}
	g->net = nt;
	g->base = base;
	g->nlocal = nlocal;
	/* HELLO: the token, then the label. */
	char hello[GPU_HUB_TOKEN_BYTES + NET_LABEL_MAX];
	size_t ll = label ? strlen(label) : 0;
	if (ll > NET_LABEL_MAX)
		ll = NET_LABEL_MAX;
	memcpy(hello, token, GPU_HUB_TOKEN_BYTES);
	if (ll)
		memcpy(hello + GPU_HUB_TOKEN_BYTES, label, ll);
	struct frame f = {.magic = NET_MAGIC, .type = M_HELLO, .rank = base, .code = nlocal,
			  .world = (uint32_t)world, .len = GPU_HUB_TOKEN_BYTES + ll};
	struct frame r = {0};
	void *p = NULL;
	char err[160] = "";
	if (!send_frame(nt->fd, &f, hello) || !recv_frame(nt->fd, &r, &p, err, sizeof(err)) ||
	    r.type != M_WELCOME) {
		if (r.type == M_REJECT && p)
			snprintf(err, sizeof(err), "refused: %.*s", (int)(r.len < 150 ? r.len : 150),
				 (char *)p);
		else if (!err[0])
			snprintf(err, sizeof(err), "no welcome");
		free(p);
		gpu_gang_free(g);
		return td_fail(eb, TD_EPEER_LOST, "cannot join the gang's hub at %s: %s", hub, err);
	}
	free(p);
	int rv = pthread_create(&nt->rx, NULL, net_rx, g);
	if (rv != 0) {
		gpu_gang_free(g);
		return td_fail(eb, TD_EINTERNAL, "gang: cannot start its reader: %s", strerror(rv));
	}
	nt->rx_started = true;
	*out = g;
	return TD_OK;
}
