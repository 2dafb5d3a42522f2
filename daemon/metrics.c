/* The Prometheus exposition, its textfile and its HTTP endpoint
 * (daemon/metrics.h). */
#include "daemon/metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/runner.h"
#include "proto/log.h"
#include "state/state.h"

/* ------------------------------------------------------------------------ */
/* A growing text buffer */

struct sb {
	char *p;
	size_t len, cap;
	bool oom;
};

static void sb_printf(struct sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct sb *b, const char *fmt, ...)
{
	if (b->oom)
		return;
	for (;;) {
		va_list ap;
		va_start(ap, fmt);
		int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
		va_end(ap);
		if (n < 0) {
			b->oom = true;
			return;
		}
		if (b->p && b->len + (size_t)n < b->cap) {
			b->len += (size_t)n;
			return;
		}
		size_t cap = b->cap ? b->cap : 4096;
		while (cap <= b->len + (size_t)n)
			cap *= 2;
		char *q = realloc(b->p, cap);
		if (!q) {
			b->oom = true;
			return;
		}
		b->p = q;
		b->cap = cap;
	}
}

/* A label value as the text format wants it: \\, \" and \n escaped. */
static void sb_label(struct sb *b, const char *v)
{
	for (; v && *v; v++) {
		if (*v == '\\')
			sb_printf(b, "\\\\");
		else if (*v == '"')
			sb_printf(b, "\\\"");
		else if (*v == '\n')
			sb_printf(b, "\\n");
		else
			sb_printf(b, "%c", *v);
	}
}

/* A sample value: Go's ParseFloat reads %.17g, NaN and +Inf/-Inf. */
static void sb_value(struct sb *b, double v)
{
	if (isnan(v))
		sb_printf(b, " NaN\n");
	else if (isinf(v))
		sb_printf(b, " %sInf\n", v > 0 ? "+" : "-");
	else
		sb_printf(b, " %.17g\n", v);
}

static void family(struct sb *b, const char *name, const char *type, const char *help)
{
	sb_printf(b, "# HELP traind_%s %s\n# TYPE traind_%s %s\n", name, help, name, type);
}

static const char *user_name(uid_t uid, char *buf, size_t cap)
{
	struct passwd pw, *pwp = NULL;
	char tmp[4096];
	if (getpwuid_r(uid, &pw, tmp, sizeof(tmp), &pwp) == 0 && pwp)
		snprintf(buf, cap, "%s", pwp->pw_name);
	else
		snprintf(buf, cap, "%u", (unsigned)uid);
	return buf;
}

/* ------------------------------------------------------------------------ */
/* The exposition */

static void render_gpus(struct sb *b, const struct dmn_env *env)
{
	static const struct {
		const char *name, *help;
	} fams[] = {
		{"gpu_total_bytes", "The GPU's memory."},
		{"gpu_share_bytes", "What the ledger may hand out on the GPU: total x vram_factor."},
		{"gpu_reserved_bytes", "Bytes reserved in the ledger on the GPU (jobs' leases and others')."},
		{"gpu_used_bytes", "Bytes in use on the GPU as its driver says (total - free), "
				   "whoever uses them."},
	};
	const struct dmn_devices *d = env->dev;
	uint64_t reserved[DMN_MAX_GPUS], used[DMN_MAX_GPUS];
	bool has_res[DMN_MAX_GPUS], has_used[DMN_MAX_GPUS];
	for (int i = 0; i < d->n; i++) {
		const struct dmn_gpu *g = &d->gpu[i];
		has_res[i] = st_ledger_reserved(env->db, g->uuid, &reserved[i], NULL) == TD_OK;
		uint64_t fr = dmn_gpu_free_bytes(g);
		has_used[i] = fr != UINT64_MAX;
		used[i] = has_used[i] && fr < g->total_bytes ? g->total_bytes - fr : 0;
	}
	for (size_t f = 0; f < sizeof(fams) / sizeof(fams[0]); f++) {
		family(b, fams[f].name, "gauge", fams[f].help);
		for (int i = 0; i < d->n; i++) {
			const struct dmn_gpu *g = &d->gpu[i];
			double v;
			if (f == 0)
				v = (double)g->total_bytes;
			else if (f == 1)
				v = floor((double)g->total_bytes * env->cfg->vram_factor);
			else if (f == 2 && has_res[i])
				v = (double)reserved[i];
			else if (f == 3 && has_used[i])
				v = (double)used[i];
			else
				continue;
			sb_printf(b, "traind_%s{gpu=\"%d\",uuid=\"", fams[f].name, g->index);
			sb_label(b, g->uuid);
			sb_printf(b, "\",name=\"");
			sb_label(b, g->name);
			sb_printf(b, "\"}");
			sb_value(b, v);
		}
	}
}

static void render_jobs(struct sb *b, const struct dmn_env *env)
{
	uint32_t counts[ST_JOB_STATE_COUNT], held = 0;
	struct td_errbuf eb = {{0}};
	bool have = st_job_counts(env->db, counts, &held, &eb) == TD_OK;
	if (!have)
		td_warn("TD-METRICS", "cannot count the jobs: %s", eb.msg);
	family(b, "jobs", "gauge", "Jobs per state (QUEUED: the queue's length).");
	for (int s = 0; have && s < ST_JOB_STATE_COUNT; s++) {
		sb_printf(b, "traind_jobs{state=\"%s\"}", st_job_state_name((enum st_job_state)s));
		sb_value(b, counts[s]);
	}
	family(b, "jobs_held", "gauge", "QUEUED jobs that are held (trainctl hold).");
	if (have) {
		sb_printf(b, "traind_jobs_held");
		sb_value(b, held);
	}

	/* Running jobs: their runner's latest step. */
	static const struct {
		const char *name, *help;
	} fams[] = {
		{"job_step", "The running job's last step."},
		{"job_total_steps", "The running job's steps in all."},
		{"job_loss", "The running job's training loss at its last step."},
		{"job_tokens_per_second", "The running job's training throughput."},
		{"job_eta_seconds", "The running job's estimated time to its end."},
		{"job_gpus", "GPUs the running job holds (0: a CPU slot)."},
		{"job_pinned_host_bytes", "Pinned host memory the running job's plan holds "
					  "(memory.recompute full-offload's layer inputs)."},
	};
	struct st_job_filter f = {.all_users = true, .state_mask = ST_MASK_ACTIVE};
	struct st_job *jobs = NULL;
	size_t n = 0;
	if (st_job_list(env->db, &f, &jobs, &n, &eb) != TD_OK) {
		td_warn("TD-METRICS", "cannot list the running jobs: %s", eb.msg);
		n = 0;
	}
	struct tr_progress *pr = calloc(n ? n : 1, sizeof(*pr));
	bool *has = calloc(n ? n : 1, sizeof(*has));
	if (!pr || !has)
		b->oom = true;
	for (size_t i = 0; pr && has && i < n; i++)
		has[i] = dmn_runners_progress(dmn_sched_runners(env->sched), jobs[i].id, &pr[i]);
	for (size_t k = 0; pr && has && k < sizeof(fams) / sizeof(fams[0]); k++) {
		family(b, fams[k].name, "gauge", fams[k].help);
		for (size_t i = 0; i < n; i++) {
			double v;
			const struct tr_progress *p = &pr[i];
			if (k == 5) {
				const char *dv = jobs[i].device;
				v = !*dv || strcmp(dv, "cpu") == 0 ? 0 : 1;
				for (; *dv; dv++)
					v += *dv == ',';
			} else if (k == 6) {
				if (!has[i])
					continue;
				v = (double)dmn_runners_host_bytes(dmn_sched_runners(env->sched), jobs[i].id);
			} else if (!has[i]) {
				continue;
			} else {
				v = k == 0   ? (double)p->step
				    : k == 1 ? (double)p->total_steps
				    : k == 2 ? p->loss
				    : k == 3 ? p->tokens_per_s
					     : p->eta_s;
			}
			char u[64];
			sb_printf(b, "traind_%s{job=\"%lld\",user=\"", fams[k].name, (long long)jobs[i].id);
			sb_label(b, user_name(jobs[i].uid, u, sizeof(u)));
			sb_printf(b, "\",name=\"");
			sb_label(b, jobs[i].name);
			sb_printf(b, "\"}");
			sb_value(b, v);
		}
	}
	free(pr);
	free(has);
	st_jobs_free(jobs, n);
}

static void render_usage(struct sb *b, const struct dmn_env *env)
{
	static const struct {
		const char *name, *help;
	} fams[] = {
		{"user_gpu_seconds_total", "GPU seconds the user's jobs used (running time x GPUs)."},
		{"user_cpu_seconds_total", "CPU-slot seconds the user's jobs used."},
		{"user_gpu_memory_byte_seconds_total", "The user's jobs' lease bytes x seconds."},
		{"user_tokens_total", "Tokens the user's jobs trained."},
	};
	struct st_usage_row *rows = NULL;
	size_t n = 0;
	struct td_errbuf eb = {{0}};
	if (st_usage_list(env->db, 0, false, true, 0, &rows, &n, &eb) != TD_OK) {
		td_warn("TD-METRICS", "cannot read the usage: %s", eb.msg);
		n = 0;
	}
	for (size_t k = 0; k < sizeof(fams) / sizeof(fams[0]); k++) {
		family(b, fams[k].name, "counter", fams[k].help);
		for (size_t i = 0; i < n; i++) {
			const struct st_usage *u = &rows[i].u;
			double v = k == 0   ? (double)u->gpu_ms / 1000
				   : k == 1 ? (double)u->cpu_ms / 1000
				   : k == 2 ? u->gpu_mem_bs
					    : (double)u->tokens;
			char name[64];
			sb_printf(b, "traind_%s{user=\"", fams[k].name);
			sb_label(b, user_name(rows[i].uid, name, sizeof(name)));
			sb_printf(b, "\"}");
			sb_value(b, v);
		}
	}
	free(rows);
}

td_err dmn_metrics_render(const struct dmn_env *env, char **out, size_t *len, struct td_errbuf *eb)
{
	struct sb b = {0};
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	family(&b, "up", "gauge", "1 while traind serves.");
	sb_printf(&b, "traind_up 1\n");
	family(&b, "uptime_seconds", "gauge", "Seconds since traind started.");
	sb_printf(&b, "traind_uptime_seconds");
	sb_value(&b, (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 - env->start_time);
	family(&b, "requests_total", "counter", "RPC requests answered, by call.");
	int nc = dmn_dispatch_ncalls();
	for (int k = 0; k <= nc; k++) {
		int slot = k < nc ? k : DMN_RPC_MAX;
		sb_printf(&b, "traind_requests_total{call=\"%s\"}", dmn_dispatch_call_name(k < nc ? k : -1));
		sb_value(&b, (double)env->rpc_requests[slot]);
	}
	family(&b, "request_errors_total", "counter", "RPC requests answered with an error, by call.");
	for (int k = 0; k <= nc; k++) {
		int slot = k < nc ? k : DMN_RPC_MAX;
		sb_printf(&b, "traind_request_errors_total{call=\"%s\"}",
			  dmn_dispatch_call_name(k < nc ? k : -1));
		sb_value(&b, (double)env->rpc_errors[slot]);
	}
	render_gpus(&b, env);
	family(&b, "pinned_host_bytes", "gauge",
	       "Pinned host memory the running jobs' plans hold together (in no lease).");
	sb_printf(&b, "traind_pinned_host_bytes");
	sb_value(&b, (double)dmn_runners_host_bytes(dmn_sched_runners(env->sched), -1));
	family(&b, "pinned_host_max_bytes", "gauge",
	       "What they may hold together: the pinned_host_max_mib setting.");
	sb_printf(&b, "traind_pinned_host_max_bytes");
	sb_value(&b, (double)dmn_config_pinned_max(env->cfg));
	render_jobs(&b, env);
	render_usage(&b, env);
	if (b.oom || !b.p) {
		free(b.p);
		return td_fail(eb, TD_ENOMEM, "metrics: out of memory");
	}
	*out = b.p;
	*len = b.len;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* The textfile */

td_err dmn_metrics_write_textfile(const struct dmn_env *env, const char *path,
				  struct td_errbuf *eb)
{
	char *text = NULL;
	size_t len = 0;
	td_err e = dmn_metrics_render(env, &text, &len, eb);
	if (e != TD_OK)
		return e;
	char tmp[PATH_MAX + 8], dir[PATH_MAX];
	snprintf(tmp, sizeof(tmp), "%s.tmp", path);
	snprintf(dir, sizeof(dir), "%s", path);
	char *slash = strrchr(dir, '/');
	if (slash)
		*(slash == dir ? slash + 1 : slash) = 0;
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
	if (fd < 0) {
		e = td_fail(eb, td_from_errno(errno), "metrics_textfile: %s: %s", tmp, strerror(errno));
		free(text);
		return e;
	}
	size_t off = 0;
	while (off < len) {
		ssize_t w = write(fd, text + off, len - off);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			break;
		off += (size_t)w;
	}
	free(text);
	if (off < len || fsync(fd) != 0) {
		e = td_fail(eb, td_from_errno(errno), "metrics_textfile: writing %s: %s", tmp,
			    strerror(errno));
		close(fd);
		unlink(tmp);
		return e;
	}
	fchmod(fd, 0644); /* whatever the umask: node_exporter runs as another user */
	close(fd);
	if (rename(tmp, path) != 0) {
		e = td_fail(eb, td_from_errno(errno), "metrics_textfile: rename %s to %s: %s", tmp, path,
			    strerror(errno));
		unlink(tmp);
		return e;
	}
	int dfd = open(slash ? dir : ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd >= 0) {
		fsync(dfd);
		close(dfd);
	}
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* The HTTP endpoint */

#define HTTP_MAX_CONNS 16
#define HTTP_MAX_REQUEST 8192
#define HTTP_TIMEOUT_MS 5000

struct http_conn {
	struct dmn_metrics_http *h;
	uv_tcp_t tcp;
	uv_timer_t timer;
	uv_write_t wr;
	char req[HTTP_MAX_REQUEST];
	size_t len;
	char *resp;
	bool answered, closing;
	int open_handles;
	struct http_conn *next;
};

struct dmn_metrics_http {
	uv_tcp_t server;
	const struct dmn_env *env;
	struct http_conn *conns;
	size_t nconns;
	bool closed;
};

static void conn_handle_closed(uv_handle_t *hd)
{
	struct http_conn *c = hd->data;
	if (--c->open_handles > 0)
		return;
	struct dmn_metrics_http *h = c->h;
	for (struct http_conn **pp = &h->conns; *pp; pp = &(*pp)->next) {
		if (*pp == c) {
			*pp = c->next;
			break;
		}
	}
	h->nconns--;
	free(c->resp);
	free(c);
}

static void conn_close(struct http_conn *c)
{
	if (c->closing)
		return;
	c->closing = true;
	uv_timer_stop(&c->timer);
	uv_close((uv_handle_t *)&c->timer, conn_handle_closed);
	uv_close((uv_handle_t *)&c->tcp, conn_handle_closed);
}

static void conn_written(uv_write_t *w, int status)
{
	(void)status;
	conn_close(w->data);
}

static void conn_send(struct http_conn *c, int code, const char *reason, const char *type,
		      const char *body, size_t blen)
{
	c->answered = true;
	uv_read_stop((uv_stream_t *)&c->tcp);
	char head[256];
	int hl = snprintf(head, sizeof(head),
			  "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
			  "Connection: close\r\n\r\n",
			  code, reason, type, blen);
	c->resp = malloc((size_t)hl + blen);
	if (!c->resp) {
		conn_close(c);
		return;
	}
	memcpy(c->resp, head, (size_t)hl);
	memcpy(c->resp + hl, body, blen);
	uv_buf_t buf = uv_buf_init(c->resp, (unsigned)((size_t)hl + blen));
	c->wr.data = c;
	if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &buf, 1, conn_written) != 0)
		conn_close(c);
}

static void conn_text(struct http_conn *c, int code, const char *reason, const char *msg)
{
	conn_send(c, code, reason, "text/plain; charset=utf-8", msg, strlen(msg));
}

/* A whole request head is in c->req: answer it. */
static void conn_answer(struct http_conn *c)
{
	char method[16] = "", target[256] = "";
	if (sscanf(c->req, "%15s %255s", method, target) != 2) {
		conn_text(c, 400, "Bad Request", "bad request\n");
		return;
	}
	char *q = strchr(target, '?');
	if (q)
		*q = 0;
	if (strcmp(target, "/metrics") != 0) {
		conn_text(c, 404, "Not Found", "traind serves /metrics only\n");
		return;
	}
	if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0) {
		conn_text(c, 405, "Method Not Allowed", "GET /metrics\n");
		return;
	}
	char *text = NULL;
	size_t len = 0;
	struct td_errbuf eb = {{0}};
	if (dmn_metrics_render(c->h->env, &text, &len, &eb) != TD_OK) {
		conn_text(c, 500, "Internal Server Error", "out of memory\n");
		return;
	}
	conn_send(c, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", text,
		  strcmp(method, "HEAD") == 0 ? 0 : len);
	free(text);
}

static void conn_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
	(void)suggested;
	struct http_conn *c = hd->data;
	*buf = uv_buf_init(c->req + c->len, (unsigned)(sizeof(c->req) - 1 - c->len));
}

static void conn_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
	(void)buf;
	struct http_conn *c = s->data;
	if (n < 0) {
		conn_close(c);
		return;
	}
	if (c->answered || n == 0)
		return;
	c->len += (size_t)n;
	c->req[c->len] = 0;
	if (strstr(c->req, "\r\n\r\n") || strstr(c->req, "\n\n"))
		conn_answer(c);
	else if (c->len >= sizeof(c->req) - 1)
		conn_text(c, 431, "Request Header Fields Too Large", "request too large\n");
}

static void conn_timeout(uv_timer_t *t)
{
	conn_close(t->data);
}

static void on_connection(uv_stream_t *server, int status)
{
	struct dmn_metrics_http *h = server->data;
	if (status != 0 || h->closed)
		return;
	struct http_conn *c = calloc(1, sizeof(*c));
	if (!c)
		return;
	c->h = h;
	uv_tcp_init(server->loop, &c->tcp);
	uv_timer_init(server->loop, &c->timer);
	c->tcp.data = c->timer.data = c;
	c->open_handles = 2;
	c->next = h->conns;
	h->conns = c;
	h->nconns++;
	if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0 || h->nconns > HTTP_MAX_CONNS) {
		conn_close(c);
		return;
	}
	uv_timer_start(&c->timer, conn_timeout, HTTP_TIMEOUT_MS, 0);
	uv_read_start((uv_stream_t *)&c->tcp, conn_alloc, conn_read);
}

td_err dmn_metrics_http_start(struct dmn_metrics_http **out, uv_loop_t *loop, int port,
			      const struct dmn_env *env, struct td_errbuf *eb)
{
	if (port <= 0 || port > 65535)
		return td_fail(eb, TD_EINVAL, "metrics_port: %d is not a TCP port", port);
	struct dmn_metrics_http *h = calloc(1, sizeof(*h));
	if (!h)
		return td_fail(eb, TD_ENOMEM, "metrics: out of memory");
	h->env = env;
	uv_tcp_init(loop, &h->server);
	h->server.data = h;
	struct sockaddr_in addr;
	uv_ip4_addr("127.0.0.1", port, &addr);
	int rv = uv_tcp_bind(&h->server, (const struct sockaddr *)&addr, 0);
	if (rv == 0)
		rv = uv_listen((uv_stream_t *)&h->server, 16, on_connection);
	if (rv != 0) {
		/* Closed by the caller's dmn_metrics_http_close, freed after the loop. */
		*out = h;
		return td_fail(eb, rv == UV_EADDRINUSE ? TD_EBUSY : TD_EIO,
			       "metrics_port: cannot listen on 127.0.0.1:%d: %s%s", port, uv_strerror(rv),
			       rv == UV_EAFNOSUPPORT || rv == UV_EPERM
				       ? " (as the systemd service: add AF_INET to RestrictAddressFamilies "
					 "in a drop-in, or use metrics_textfile)"
				       : rv == UV_EADDRINUSE ? " (choose another metrics_port)" : "");
	}
	*out = h;
	return TD_OK;
}

void dmn_metrics_http_close(struct dmn_metrics_http *h)
{
	if (!h || h->closed)
		return;
	h->closed = true;
	uv_close((uv_handle_t *)&h->server, NULL);
	for (struct http_conn *c = h->conns; c; c = c->next)
		conn_close(c);
}

void dmn_metrics_http_free(struct dmn_metrics_http *h)
{
	free(h);
}
