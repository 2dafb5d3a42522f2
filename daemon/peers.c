/* One job across daemons: the peer end and the coordinator end of the
 * daemons' protocol (daemon/peers.h). */
#include "daemon/peers.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/rep.h>
#include <nng/protocol/reqrep0/req.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/identity.h"
#include "daemon/placement.h"
#include "daemon/scheduler.h"
#include "gpu/comm.h"
#include "proto/jobspec.h"
#include "proto/log.h"
#include "proto/rpc.h"
#include "proto/rpc_nng.h"
#include "state/state.h"
#include "train/trainer.h"

#define PEER_MAX_REQUEST (64u << 20) /* a spec is far smaller */
#define PEER_CLOCK_SKEW_MS 60000
#define PEER_NONCE_BYTES 16
#define PEER_SEEN_MAX 4096
#define PEER_MAX_HOSTS 15 /* 16 ranks at least one each */

static int64_t wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t mono_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ------------------------------------------------------------------------ */
/* The secret and the MAC */

td_err dmn_peer_client_init(struct dmn_peer_client *c, const struct dmn_config *cfg,
			    struct td_errbuf *eb)
{
	memset(c, 0, sizeof(*c));
	const char *a = cfg->peer_listen;
	if (strncmp(a, "tcp://", 6) != 0 || !strrchr(a + 6, ':') || strrchr(a + 6, ':') == a + 6)
		return td_fail(eb, TD_EINVAL, "peer_listen: '%s' is not tcp://HOST:PORT", a);
	snprintf(c->self, sizeof(c->self), "%s", a);
	const char *h = a + 6, *colon = strrchr(h, ':');
	size_t hl = (size_t)(colon - h);
	if (*h == '[' && hl >= 2 && h[hl - 1] == ']')
		h++, hl -= 2;
	if (hl >= sizeof(c->bind_host))
		return td_fail(eb, TD_EINVAL, "peer_listen: host too long");
	memcpy(c->bind_host, h, hl);
	c->bind_host[hl] = 0;
	c->ttl_s = cfg->peer_lease_ttl_s;

	const char *path = cfg->peer_secret_file;
	if (!*path)
		return td_fail(eb, TD_EINVAL,
			       "peer_secret_file: required with peer_listen (a file of this daemon's user, "
			       "mode 0600, holding the secret every daemon of a job shares)");
	int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0)
		return td_fail(eb, errno == ENOENT ? TD_ENOENT : TD_EPERM, "peer_secret_file: %s: %s", path,
			       strerror(errno));
	struct stat st;
	td_err e = TD_OK;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
		e = td_fail(eb, TD_EINVAL, "peer_secret_file: %s is not a regular file", path);
	else if (st.st_uid != geteuid())
		e = td_fail(eb, TD_EPERM, "peer_secret_file: %s belongs to uid %u, not to the daemon's "
					  "user (uid %u)",
			    path, (unsigned)st.st_uid, (unsigned)geteuid());
	else if (st.st_mode & 077)
		e = td_fail(eb, TD_EPERM,
			    "peer_secret_file: %s is readable or writable by others (mode %04o): chmod 600 "
			    "it; whoever reads it can run jobs in any user's name on this daemon's GPUs",
			    path, (unsigned)(st.st_mode & 07777));
	else if (st.st_size < 16 || st.st_size > DMN_PEER_SECRET_MAX)
		e = td_fail(eb, TD_EINVAL, "peer_secret_file: %s holds %lld bytes; a secret is 16 .. %d",
			    path, (long long)st.st_size, DMN_PEER_SECRET_MAX);
	ssize_t n = e == TD_OK ? read(fd, c->secret, sizeof(c->secret)) : -1;
	close(fd);
	if (e != TD_OK)
		return e;
	if (n < 16)
		return td_fail(eb, TD_EIO, "peer_secret_file: %s: short read", path);
	while (n > 0 && (c->secret[n - 1] == '\n' || c->secret[n - 1] == '\r'))
		n--;
	if (n < 16)
		return td_fail(eb, TD_EINVAL, "peer_secret_file: %s: a secret is at least 16 bytes", path);
	c->secret_len = (size_t)n;
	return TD_OK;
}

/* HMAC-SHA256 of req encoded without its mac, into out[32]. */
static bool request_mac(const struct dmn_peer_client *c, Traind__PeerRequest *req, uint8_t out[32])
{
	ProtobufCBinaryData saved = req->mac;
	protobuf_c_boolean had = req->has_mac;
	req->has_mac = 0;
	req->mac = (ProtobufCBinaryData){0};
	size_t n = traind__peer_request__get_packed_size(req);
	uint8_t *buf = malloc(n ? n : 1);
	bool ok = buf != NULL;
	if (ok) {
		traind__peer_request__pack(req, buf);
		unsigned len = 0;
		ok = HMAC(EVP_sha256(), c->secret, (int)c->secret_len, buf, n, out, &len) && len == 32;
	}
	free(buf);
	req->has_mac = had;
	req->mac = saved;
	return ok;
}

/* ------------------------------------------------------------------------ */
/* A call */

td_err dmn_peer_call(const struct dmn_peer_client *c, const char *addr, Traind__PeerRequest *req,
		     int timeout_ms, Traind__PeerReply **reply, struct td_errbuf *eb)
{
	*reply = NULL;
	uint8_t nonce[PEER_NONCE_BYTES], mac[32];
	if (RAND_bytes(nonce, sizeof(nonce)) != 1)
		return td_fail(eb, TD_EINTERNAL, "peer call: no random bytes");
	req->has_protocol = 1;
	req->protocol = RPC_PROTOCOL;
	req->coordinator = (char *)c->self;
	req->has_time_ms = 1;
	req->time_ms = wall_ms();
	req->has_nonce = 1;
	req->nonce = (ProtobufCBinaryData){.len = sizeof(nonce), .data = nonce};
	req->has_mac = 0;
	if (!request_mac(c, req, mac))
		return td_fail(eb, TD_EINTERNAL, "peer call: cannot sign the request");
	req->has_mac = 1;
	req->mac = (ProtobufCBinaryData){.len = sizeof(mac), .data = mac};
	size_t n = traind__peer_request__get_packed_size(req);
	uint8_t *buf = malloc(n);
	if (!buf)
		return td_fail(eb, TD_ENOMEM, "peer call: out of memory");
	traind__peer_request__pack(req, buf);
	req->coordinator = NULL; /* the caller's message owns none of these */
	req->nonce = (ProtobufCBinaryData){0};
	req->mac = (ProtobufCBinaryData){0};
	req->has_nonce = req->has_mac = 0;

	nng_socket s;
	int rv = nng_req0_open(&s);
	if (rv != 0) {
		free(buf);
		return td_fail(eb, TD_EIO, "peer call: nng: %s", nng_strerror(rv));
	}
	rpc_req_once(s);
	nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, timeout_ms);
	nng_socket_set_ms(s, NNG_OPT_SENDTIMEO, timeout_ms);
	nng_socket_set_size(s, NNG_OPT_RECVMAXSZ, 1 << 20);
	td_err e = TD_OK;
	void *rbuf = NULL;
	size_t rlen = 0;
	if ((rv = nng_dial(s, addr, NULL, 0)) != 0)
		e = td_fail(eb, TD_EPEER_LOST, "cannot reach the daemon at %s: %s", addr, nng_strerror(rv));
	else if ((rv = nng_send(s, buf, n, 0)) != 0)
		e = td_fail(eb, TD_EPEER_LOST, "cannot send to the daemon at %s: %s", addr,
			    nng_strerror(rv));
	else if ((rv = nng_recv(s, &rbuf, &rlen, NNG_FLAG_ALLOC)) != 0)
		e = td_fail(eb, TD_EPEER_LOST, "no answer from the daemon at %s: %s", addr,
			    nng_strerror(rv));
	free(buf);
	if (e == TD_OK) {
		*reply = traind__peer_reply__unpack(NULL, rlen, rbuf);
		nng_free(rbuf, rlen);
		if (!*reply)
			e = td_fail(eb, TD_EFORMAT, "the daemon at %s answered something else", addr);
	}
	nng_close(s);
	return e;
}

/* ------------------------------------------------------------------------ */
/* The peer end */

struct guest {
	struct dmn_peers *p;
	struct guest *next;
	int64_t job;
	uint32_t attempt;
	char coord[256];
	uid_t uid;
	gid_t gid;
	Traind__JobSpec *spec;
	char hub[96];
	uint8_t token[GPU_HUB_TOKEN_BYTES];
	int world, base;
	int ngpus;
	bool fake;
	int64_t lease[DMN_MAX_GPUS];
	int devices[DMN_MAX_GPUS];
	char gpus[DMN_MAX_GPUS * 97];
	atomic_bool stop, done, expired;
	char why_expired[400];
	_Atomic int64_t last_hb_ms; /* monotonic */
	pthread_t thread;
};

struct dmn_peers {
	const struct dmn_peer_client *c;
	const struct dmn_config *cfg;
	char db_path[PATH_MAX];
	const struct dmn_devices *dev;
	nng_socket sock;
	nng_listener listener; /* the probe thread's once started */
	pthread_t thread, probe;
	bool started, probe_started;
	atomic_int relistens;
	/* TD_PEER_DEAF_AFTER_S=N, a test hook: N s after start the listener is
	 * closed, as nng 1.5's bug leaves it, for the probe to find; -1: off. */
	int64_t deaf_at_ms;
	atomic_bool stopping, closing;
	pthread_mutex_t mu;
	struct guest *guests; /* under mu */
	size_t running;       /* under mu */
	struct st_db *db;     /* the server thread's */
	struct {
		uint8_t nonce[PEER_NONCE_BYTES];
		int64_t t;
	} seen[PEER_SEEN_MAX];
	size_t nseen;
};

static bool guest_should_stop(void *ctx)
{
	struct guest *g = ctx;
	return atomic_load(&g->stop) || atomic_load(&g->p->stopping);
}

static void *guest_main(void *arg)
{
	struct guest *g = arg;
	struct dmn_peers *p = g->p;
	struct td_errbuf eb = {{0}};
	struct dmn_fscreds creds;
	td_err e = dmn_fscreds_of(&creds, g->uid, g->gid, &eb);
	bool as_user = e == TD_OK && dmn_fscreds_needed(&creds);
	if (e == TD_OK)
		e = dmn_fscreds_enter(&creds, &eb);
	struct tr_train_result res;
	memset(&res, 0, sizeof(res));
	if (e == TD_OK) {
		struct tr_train_opts opts = {
			.backend = g->fake ? "cpu" : "cuda",
			.has_device = !g->fake,
			.device_index = g->fake ? -1 : g->devices[0],
			.cache_dir = !as_user && p->cfg->cache_dir[0] ? p->cfg->cache_dir : NULL,
			.ranks = g->ngpus,
			.devices = g->devices,
			.hub = g->hub,
			.hub_token = g->token,
			.hub_label = p->c->self,
			.world = g->world,
			.rank_base = g->base,
			.abort = &g->expired,
			.abort_why = g->why_expired,
		};
		struct tr_hooks hooks = {.should_stop = guest_should_stop, .ctx = g};
		e = tr_train(g->spec, &opts, &hooks, &res, &eb);
		dmn_fscreds_leave(&creds);
	} else {
		/* The ranks never started: the gang hears why from here (else the
		 * coordinator would wait out the hub's join time and take it for a
		 * lost daemon). */
		struct gpu_gang *gang = NULL;
		struct td_errbuf jeb = {{0}};
		char msg[sizeof(eb.msg) + 64];
		snprintf(msg, sizeof(msg), "the daemon at %s: %s", p->c->self, eb.msg);
		if (gpu_gang_new_net(&gang, g->world, g->base, g->ngpus, g->hub, g->token, p->c->self, 0,
				     &jeb) == TD_OK) {
			gpu_gang_fail(gang, g->base, e, msg);
			gpu_gang_free(gang);
		}
	}
	if (e == TD_OK)
		td_info("TD-PEER-END", "job %lld of %s (attempt %u): ranks %d to %d %s at step %llu",
			(long long)g->job, g->coord, g->attempt, g->base, g->base + g->ngpus - 1,
			res.stopped ? "stopped" : "done", (unsigned long long)res.steps_done);
	else
		td_warn("TD-PEER-END", "job %lld of %s (attempt %u): ranks %d to %d ended: %s",
			(long long)g->job, g->coord, g->attempt, g->base, g->base + g->ngpus - 1, eb.msg);
	/* The leases go with the run, whatever became of it. */
	struct st_db *db = NULL;
	if (st_open(&db, p->db_path, NULL, &eb) == TD_OK) {
		for (int k = 0; k < g->ngpus; k++) {
			struct td_errbuf reb = {{0}};
			td_err re = st_ledger_release(db, g->lease[k], 0, true, &reb);
			if (re != TD_OK && re != TD_ENOENT)
				td_warn("TD-PEER-LEASE", "job %lld of %s: lease %lld: %s", (long long)g->job,
					g->coord, (long long)g->lease[k], reb.msg);
		}
		st_close(db);
	} else {
		td_err_log("TD-PEER-LEASE", "job %lld of %s: cannot release its leases (they expire): %s",
			   (long long)g->job, g->coord, eb.msg);
	}
	pthread_mutex_lock(&p->mu);
	p->running--;
	pthread_mutex_unlock(&p->mu);
	atomic_store(&g->done, true);
	return NULL;
}

static void guest_free(struct guest *g)
{
	rpc_jobspec_free(g->spec);
	free(g);
}

/* Joins and frees the guests that ended. */
static void reap_guests(struct dmn_peers *p)
{
	pthread_mutex_lock(&p->mu);
	struct guest **pp = &p->guests;
	while (*pp) {
		struct guest *g = *pp;
		if (atomic_load(&g->done)) {
			*pp = g->next;
			pthread_mutex_unlock(&p->mu);
			pthread_join(g->thread, NULL);
			guest_free(g);
			pthread_mutex_lock(&p->mu);
		} else {
			pp = &g->next;
		}
	}
	pthread_mutex_unlock(&p->mu);
}

/* A run whose coordinator stopped renewing (its daemon or host gone, the
 * network cut): stopped; its leases expire in the ledger meanwhile. */
static void expire_guests(struct dmn_peers *p)
{
	int64_t now = mono_ms(), ttl = (int64_t)p->c->ttl_s * 1000;
	pthread_mutex_lock(&p->mu);
	for (struct guest *g = p->guests; g; g = g->next)
		if (!atomic_load(&g->done) && now - atomic_load(&g->last_hb_ms) > ttl &&
		    !atomic_load(&g->expired)) {
			/* The reason first: the gang reads it once the flag is set. */
			snprintf(g->why_expired, sizeof(g->why_expired),
				 "the daemon at %s gave up job %lld: its coordinator %s stopped renewing "
				 "its leases for %ld s (peer_lease_ttl_s)",
				 p->c->self, (long long)g->job, g->coord, p->c->ttl_s);
			atomic_store(&g->expired, true);
			atomic_store(&g->stop, true);
			td_warn("TD-PEER-EXPIRE",
				"job %lld of %s: no heartbeat from its coordinator for %ld s; its ranks "
				"stop and its leases expire",
				(long long)g->job, g->coord, p->c->ttl_s);
		}
	pthread_mutex_unlock(&p->mu);
}

static struct guest *guest_find(struct dmn_peers *p, const char *coord, int64_t job)
{
	for (struct guest *g = p->guests; g; g = g->next)
		if (g->job == job && strcmp(g->coord, coord) == 0 && !atomic_load(&g->done))
			return g;
	return NULL;
}

/* GPUs for g: ranks of them whose share has lease_bytes now, reserved in
 * one transaction with a ttl. */
static td_err reserve(struct dmn_peers *p, struct guest *g, uint64_t lease_bytes,
		      struct td_errbuf *eb)
{
	const struct dmn_devices *dev = p->dev;
	if (dev->n == 0)
		return td_fail(eb, TD_EUNSUPPORTED, "the daemon at %s has no GPU", p->c->self);
	struct dmn_place_gpu pg[DMN_MAX_GPUS];
	uint64_t free_now[DMN_MAX_GPUS];
	for (int i = 0; i < dev->n; i++) {
		const struct dmn_gpu *d = &dev->gpu[i];
		uint64_t share = (uint64_t)((double)d->total_bytes * p->cfg->vram_factor), used = 0;
		struct td_errbuf reb = {{0}};
		bool known = st_ledger_reserved(p->db, d->uuid, &used, &reb) == TD_OK;
		free_now[i] = d->fake ? UINT64_MAX : dmn_gpu_free_bytes(d);
		uint64_t avail = known && share > used ? share - used : 0;
		if (avail > free_now[i])
			avail = free_now[i];
		pg[i] = (struct dmn_place_gpu){.usable = dmn_gpu_gang_ok(d, (unsigned)g->ngpus),
					       .need = lease_bytes,
					       .avail = avail,
					       .share = share};
	}
	uint32_t mask = dmn_place_pick(pg, dev->n, dev->nvlink, g->ngpus, DMN_PLACE_NOW);
	if (!mask) {
		if (!dmn_place_pick(pg, dev->n, dev->nvlink, g->ngpus, DMN_PLACE_EMPTY))
			return td_fail(eb, TD_EINVAL,
				       "the daemon at %s: no set of %d of its GPUs can ever grant %.1f MiB "
				       "each (memory x vram_factor)",
				       p->c->self, g->ngpus, (double)lease_bytes / (1 << 20));
		return td_fail(eb, TD_EBUSY, "the daemon at %s has no %d GPU(s) with %.1f MiB free now",
			       p->c->self, g->ngpus, (double)lease_bytes / (1 << 20));
	}
	struct st_lease_req lr[DMN_MAX_GPUS];
	struct st_device_cap cap[DMN_MAX_GPUS];
	char label[DMN_MAX_GPUS][160];
	int k = 0;
	size_t len = 0;
	g->gpus[0] = 0;
	for (int i = 0; i < dev->n; i++) {
		if (!(mask >> i & 1))
			continue;
		const struct dmn_gpu *d = &dev->gpu[i];
		snprintf(label[k], sizeof(label[k]), "job %lld of %s, rank %d", (long long)g->job,
			 g->coord, g->base + k);
		lr[k] = (struct st_lease_req){.gpu_uuid = d->uuid,
					      .bytes = lease_bytes,
					      .uid = g->uid,
					      .pid = getpid(),
					      .label = label[k],
					      .ttl_ms = (int64_t)p->c->ttl_s * 1000};
		cap[k] = (struct st_device_cap){.total_bytes = d->total_bytes,
						.factor = p->cfg->vram_factor,
						.free_bytes_now = free_now[i]};
		g->devices[k] = d->fake ? -1 : d->ordinal;
		g->fake = d->fake;
		len += (size_t)snprintf(g->gpus + len, sizeof(g->gpus) - len, "%s%s", k ? "," : "",
					d->uuid);
		k++;
	}
	return st_ledger_reserve_gang(p->db, lr, cap, (size_t)k, g->lease, eb);
}

static td_err handle_run(struct dmn_peers *p, const char *coord, const Traind__PeerRun *r,
			 Traind__PeerReply *rep, char *gpus, size_t gcap, struct td_errbuf *eb)
{
	if (atomic_load(&p->stopping))
		return td_fail(eb, TD_EBUSY, "the daemon at %s is stopping", p->c->self);
	if (!r->has_job || r->job <= 0 || !r->spec || !r->hub || !*r->hub || !r->has_token ||
	    r->token.len != GPU_HUB_TOKEN_BYTES || !r->has_world || r->world < 1 ||
	    r->world > GPU_GANG_MAX || !r->has_ranks || r->ranks < 1 || r->ranks > DMN_MAX_GPUS ||
	    !r->has_rank_base || r->rank_base + r->ranks > r->world || !r->has_lease_bytes)
		return td_fail(eb, TD_EINVAL, "peer run: a field is missing or out of range");
	pthread_mutex_lock(&p->mu);
	struct guest *old = guest_find(p, coord, r->job);
	uint32_t old_attempt = old ? old->attempt : 0;
	pthread_mutex_unlock(&p->mu);
	if (old)
		return td_fail(eb, TD_EBUSY,
			       "the daemon at %s still runs ranks of job %lld of %s (attempt %u) that are "
			       "ending",
			       p->c->self, (long long)r->job, coord, old_attempt);
	struct guest *g = calloc(1, sizeof(*g));
	if (!g)
		return td_fail(eb, TD_ENOMEM, "peer run: out of memory");
	g->p = p;
	g->job = r->job;
	g->attempt = r->attempt;
	snprintf(g->coord, sizeof(g->coord), "%s", coord);
	g->uid = r->uid;
	g->gid = r->gid;
	snprintf(g->hub, sizeof(g->hub), "%s", r->hub);
	memcpy(g->token, r->token.data, GPU_HUB_TOKEN_BYTES);
	g->world = (int)r->world;
	g->base = (int)r->rank_base;
	g->ngpus = (int)r->ranks;
	atomic_init(&g->last_hb_ms, mono_ms());
	td_err e = rpc_jobspec_copy(&g->spec, r->spec);
	if (e == TD_OK && (e = rpc_jobspec_apply_defaults(g->spec, eb)) == TD_OK)
		e = rpc_jobspec_validate(g->spec, eb);
	if (e == TD_OK && g->spec->resources->gpus != r->ranks)
		e = td_fail(eb, TD_EINVAL, "peer run: %u ranks, resources.gpus %u", r->ranks,
			    g->spec->resources->gpus);
	if (e == TD_OK && (e = reserve(p, g, r->lease_bytes, eb)) == TD_OK) {
		pthread_mutex_lock(&p->mu);
		int rv = pthread_create(&g->thread, NULL, guest_main, g);
		if (rv == 0) {
			g->next = p->guests;
			p->guests = g;
			p->running++;
		}
		pthread_mutex_unlock(&p->mu);
		if (rv != 0) {
			e = td_fail(eb, TD_EINTERNAL, "peer run: cannot start a thread: %s", strerror(rv));
			for (int k = 0; k < g->ngpus; k++)
				st_ledger_release(p->db, g->lease[k], 0, true, NULL);
		}
	}
	if (e != TD_OK) {
		guest_free(g);
		return e;
	}
	snprintf(gpus, gcap, "%s", g->gpus);
	rep->gpus = gpus;
	rep->has_lease_ttl_ms = 1;
	rep->lease_ttl_ms = (int64_t)p->c->ttl_s * 1000;
	td_info("TD-PEER-RUN",
		"job %lld of %s (attempt %u, uid %u): ranks %d to %d of %d on %s; hub %s", (long long)r->job,
		coord, r->attempt, (unsigned)r->uid, g->base, g->base + g->ngpus - 1, g->world, g->gpus,
		g->hub);
	return TD_OK;
}

/* Renews a run's leases; TD_ENOENT when it ended. */
static td_err handle_heartbeat(struct dmn_peers *p, const char *coord, const Traind__PeerJob *j,
			       struct td_errbuf *eb)
{
	pthread_mutex_lock(&p->mu);
	struct guest *g = guest_find(p, coord, j->job);
	if (g && g->attempt == j->attempt && !atomic_load(&g->expired))
		atomic_store(&g->last_hb_ms, mono_ms());
	int n = g ? g->ngpus : 0;
	int64_t lease[DMN_MAX_GPUS];
	if (g)
		memcpy(lease, g->lease, sizeof(lease));
	bool ok = g && g->attempt == j->attempt && !atomic_load(&g->expired);
	pthread_mutex_unlock(&p->mu);
	if (!ok)
		return td_fail(eb, TD_ENOENT, "no run of job %lld of %s here", (long long)j->job, coord);
	for (int k = 0; k < n; k++) {
		td_err e = st_ledger_heartbeat(p->db, lease[k], (int64_t)p->c->ttl_s * 1000, 0, true, eb);
		if (e != TD_OK)
			return e;
	}
	return TD_OK;
}

static td_err handle_stop(struct dmn_peers *p, const char *coord, const Traind__PeerJob *j,
			  struct td_errbuf *eb)
{
	pthread_mutex_lock(&p->mu);
	struct guest *g = guest_find(p, coord, j->job);
	if (g && g->attempt == j->attempt)
		atomic_store(&g->stop, true);
	pthread_mutex_unlock(&p->mu);
	return g ? TD_OK : td_fail(eb, TD_ENOENT, "no run of job %lld of %s here", (long long)j->job,
				   coord);
}

/* The request's MAC, clock and nonce. */
static td_err authenticate(struct dmn_peers *p, Traind__PeerRequest *req, struct td_errbuf *eb)
{
	uint8_t mac[32];
	if (!req->has_mac || req->mac.len != sizeof(mac) || !request_mac(p->c, req, mac) ||
	    CRYPTO_memcmp(mac, req->mac.data, sizeof(mac)) != 0)
		return td_fail(eb, TD_EPERM,
			       "the daemon at %s refused the request: its MAC does not match this "
			       "daemon's peer secret (peer_secret_file): every daemon of a job must "
			       "share one",
			       p->c->self);
	int64_t now = wall_ms();
	if (!req->has_time_ms || req->time_ms < now - PEER_CLOCK_SKEW_MS ||
	    req->time_ms > now + PEER_CLOCK_SKEW_MS)
		return td_fail(eb, TD_EPERM,
			       "the daemon at %s refused the request: its time is %.1f s from this "
			       "host's clock (more than %d s: set the clocks by NTP)",
			       p->c->self, (double)(req->time_ms - now) / 1000, PEER_CLOCK_SKEW_MS / 1000);
	if (!req->has_nonce || req->nonce.len != PEER_NONCE_BYTES)
		return td_fail(eb, TD_EPERM, "the daemon at %s refused the request: no nonce", p->c->self);
	size_t keep = 0;
	for (size_t i = 0; i < p->nseen; i++) {
		if (p->seen[i].t < now - 2 * PEER_CLOCK_SKEW_MS)
			continue;
		if (memcmp(p->seen[i].nonce, req->nonce.data, PEER_NONCE_BYTES) == 0)
			return td_fail(eb, TD_EPERM, "the daemon at %s refused a replayed request",
				       p->c->self);
		p->seen[keep++] = p->seen[i];
	}
	p->nseen = keep;
	if (p->nseen == PEER_SEEN_MAX)
		return td_fail(eb, TD_EBUSY, "the daemon at %s: too many requests in %d s", p->c->self,
			       2 * PEER_CLOCK_SKEW_MS / 1000);
	memcpy(p->seen[p->nseen].nonce, req->nonce.data, PEER_NONCE_BYTES);
	p->seen[p->nseen++].t = now;
	return TD_OK;
}

static void serve_one(struct dmn_peers *p, const void *buf, size_t len)
{
	Traind__PeerReply rep = TRAIND__PEER_REPLY__INIT;
	struct td_errbuf eb = {{0}};
	char gpus[DMN_MAX_GPUS * 97] = "";
	td_err e = TD_OK;
	Traind__PeerRequest *req = traind__peer_request__unpack(NULL, len, buf);
	if (!req)
		e = td_fail(&eb, TD_EFORMAT, "not a peer request");
	else if (!req->has_protocol || req->protocol != RPC_PROTOCOL)
		e = td_fail(&eb, TD_EUNSUPPORTED, "peer protocol %u, this daemon speaks %d",
			    req->has_protocol ? req->protocol : 0, RPC_PROTOCOL);
	else if ((e = authenticate(p, req, &eb)) != TD_OK)
		td_warn("TD-PEER-AUTH", "%s (from one claiming to be %s)", eb.msg,
			req->coordinator ? req->coordinator : "?");
	else if (!req->coordinator || !*req->coordinator)
		e = td_fail(&eb, TD_EINVAL, "peer request: no coordinator");
	else if (req->op_case == TRAIND__PEER_REQUEST__OP_RUN)
		e = handle_run(p, req->coordinator, req->run, &rep, gpus, sizeof(gpus), &eb);
	else if (req->op_case == TRAIND__PEER_REQUEST__OP_HEARTBEAT)
		e = handle_heartbeat(p, req->coordinator, req->heartbeat, &eb);
	else if (req->op_case == TRAIND__PEER_REQUEST__OP_STOP)
		e = handle_stop(p, req->coordinator, req->stop, &eb);
	else
		e = td_fail(&eb, TD_EINVAL, "peer request: no operation");
	rep.has_status = 1;
	rep.status = e;
	if (e != TD_OK)
		rep.message = eb.msg;
	size_t n = traind__peer_reply__get_packed_size(&rep);
	uint8_t *out = nng_alloc(n ? n : 1);
	if (out) {
		traind__peer_reply__pack(&rep, out);
		if (nng_send(p->sock, out, n, NNG_FLAG_ALLOC) != 0)
			nng_free(out, n ? n : 1);
	}
	if (req)
		traind__peer_request__free_unpacked(req, NULL);
}

static void *peers_main(void *arg)
{
	struct dmn_peers *p = arg;
	while (!atomic_load(&p->closing)) {
		void *buf = NULL;
		size_t len = 0;
		int rv = nng_recv(p->sock, &buf, &len, NNG_FLAG_ALLOC);
		if (rv == 0) {
			serve_one(p, buf, len);
			nng_free(buf, len);
		} else if (rv != NNG_ETIMEDOUT) {
			if (rv == NNG_ECLOSED)
				break;
			td_warn("TD-PEER-RECV", "peer socket %s: %s", p->c->self, nng_strerror(rv));
			nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
		}
		expire_guests(p);
		reap_guests(p);
	}
	return NULL;
}

/* nng 1.5 (Debian 12's) stops accepting on a listener for good when a
 * client closes its connection during the SP handshake (nng #1518; the main
 * socket's workaround is daemon/server.c's listener_probe): a port scan of
 * peer_listen would make the daemon deaf to its peers. So a thread asks the
 * daemon's own peer socket for a heartbeat of job 0 every PROBE_EVERY_MS
 * (any reply proves the listener hands connections up); after PROBE_FAILS
 * misses in a row it closes the listener and listens again. */
enum { PROBE_EVERY_MS = 5000, PROBE_TIMEOUT_MS = 5000, PROBE_FAILS = 3 };

static td_err peers_listen(struct dmn_peers *p, struct td_errbuf *eb)
{
	int rv = nng_listener_create(&p->listener, p->sock, p->c->self);
	if (rv == 0 && (rv = nng_listener_start(p->listener, 0)) != 0)
		nng_listener_close(p->listener);
	if (rv != 0)
		return td_fail(eb, TD_EIO, "peer_listen: cannot listen on %s: %s", p->c->self,
			       nng_strerror(rv));
	return TD_OK;
}

static void *probe_main(void *arg)
{
	struct dmn_peers *p = arg;
	int fails = 0;
	int64_t next = mono_ms() + PROBE_EVERY_MS;
	int64_t deaf_at = p->deaf_at_ms;
	while (!atomic_load(&p->closing)) {
		if (deaf_at >= 0 && mono_ms() >= deaf_at) {
			td_warn("TD-PEER-DEAF", "TD_PEER_DEAF_AFTER_S: the peer listener is closed (test hook)");
			nng_listener_close(p->listener);
			deaf_at = -1;
		}
		if (mono_ms() < next) {
			nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
			continue;
		}
		next = mono_ms() + PROBE_EVERY_MS;
		Traind__PeerRequest req = TRAIND__PEER_REQUEST__INIT;
		Traind__PeerJob pj = TRAIND__PEER_JOB__INIT;
		pj.has_job = 1;
		pj.job = 0; /* no such run: the answer is TD_ENOENT */
		req.op_case = TRAIND__PEER_REQUEST__OP_HEARTBEAT;
		req.heartbeat = &pj;
		Traind__PeerReply *rep = NULL;
		struct td_errbuf eb = {{0}};
		td_err e = dmn_peer_call(p->c, p->c->self, &req, PROBE_TIMEOUT_MS, &rep, &eb);
		if (rep)
			traind__peer_reply__free_unpacked(rep, NULL);
		if (e != TD_EPEER_LOST) { /* answered (or the probe itself could not run) */
			fails = 0;
			continue;
		}
		if (++fails < PROBE_FAILS || atomic_load(&p->closing))
			continue;
		fails = 0;
		td_warn("TD-PEER-RELISTEN",
			"peer socket %s accepts no connection (%d probes in a row: %s): listening on it "
			"again (nng 1.5 stops accepting after a client closes its connection in the "
			"handshake)",
			p->c->self, PROBE_FAILS, eb.msg);
		nng_listener_close(p->listener);
		if (peers_listen(p, &eb) != TD_OK)
			td_err_log("TD-PEER-RELISTEN", "%s; the next probe tries again", eb.msg);
		else
			atomic_fetch_add(&p->relistens, 1);
	}
	return NULL;
}

td_err dmn_peers_start(struct dmn_peers **out, const struct dmn_peer_client *c,
		       const struct dmn_config *cfg, const char *db_path,
		       const struct dmn_devices *dev, struct td_errbuf *eb)
{
	struct dmn_peers *p = calloc(1, sizeof(*p));
	if (!p)
		return td_fail(eb, TD_ENOMEM, "peers: out of memory");
	p->c = c;
	p->cfg = cfg;
	p->dev = dev;
	const char *deaf = getenv("TD_PEER_DEAF_AFTER_S");
	p->deaf_at_ms = deaf && *deaf ? mono_ms() + atoll(deaf) * 1000 : -1;
	snprintf(p->db_path, sizeof(p->db_path), "%s", db_path);
	pthread_mutex_init(&p->mu, NULL);
	td_err e = st_open(&p->db, db_path, NULL, eb);
	int rv = 0;
	if (e == TD_OK && (rv = nng_rep0_open(&p->sock)) != 0)
		e = td_fail(eb, TD_EIO, "peer_listen: nng: %s", nng_strerror(rv));
	if (e == TD_OK) {
		nng_socket_set_ms(p->sock, NNG_OPT_RECVTIMEO, 1000);
		nng_socket_set_ms(p->sock, NNG_OPT_SENDTIMEO, 5000);
		nng_socket_set_size(p->sock, NNG_OPT_RECVMAXSZ, PEER_MAX_REQUEST);
		if ((e = peers_listen(p, eb)) != TD_OK)
			nng_close(p->sock);
	}
	if (e == TD_OK && (rv = pthread_create(&p->thread, NULL, peers_main, p)) != 0) {
		e = td_fail(eb, TD_EINTERNAL, "peers: cannot start a thread: %s", strerror(rv));
		nng_close(p->sock);
	}
	if (e == TD_OK) {
		/* Without its probe the socket still serves: only the workaround is lost. */
		p->probe_started = pthread_create(&p->probe, NULL, probe_main, p) == 0;
		if (!p->probe_started)
			td_warn("TD-PEER-RELISTEN", "peers: cannot start the listener's probe");
	}
	if (e != TD_OK) {
		st_close(p->db);
		pthread_mutex_destroy(&p->mu);
		free(p);
		return e;
	}
	p->started = true;
	*out = p;
	return TD_OK;
}

void dmn_peers_stop(struct dmn_peers *p)
{
	if (p)
		atomic_store(&p->stopping, true);
}

int dmn_peers_relistens(struct dmn_peers *p)
{
	return p ? atomic_load(&p->relistens) : 0;
}

size_t dmn_peers_running(struct dmn_peers *p)
{
	if (!p)
		return 0;
	pthread_mutex_lock(&p->mu);
	size_t n = p->running;
	pthread_mutex_unlock(&p->mu);
	return n;
}

void dmn_peers_free(struct dmn_peers *p)
{
	if (!p)
		return;
	atomic_store(&p->stopping, true);
	atomic_store(&p->closing, true);
	if (p->probe_started)
		pthread_join(p->probe, NULL); /* it uses the listener */
	nng_close(p->sock);
	pthread_join(p->thread, NULL);
	/* The loop waited shutdown_timeout_s for them to stop at a step; one
	 * still here waits on a coordinator that does not answer: given up. */
	for (struct guest *g = p->guests; g; g = g->next) {
		atomic_store(&g->stop, true);
		if (!atomic_load(&g->done) && !atomic_load(&g->expired)) {
			snprintf(g->why_expired, sizeof(g->why_expired),
				 "the daemon at %s gave up job %lld: it is stopping", p->c->self,
				 (long long)g->job);
			atomic_store(&g->expired, true);
		}
	}
	while (p->guests) {
		struct guest *g = p->guests;
		p->guests = g->next;
		pthread_join(g->thread, NULL);
		guest_free(g);
	}
	st_close(p->db);
	pthread_mutex_destroy(&p->mu);
	free(p);
}

/* ------------------------------------------------------------------------ */
/* The coordinator end */

struct dmn_peer_job {
	const struct dmn_peer_client *c;
	struct gpu_hub *hub;
	uint8_t token[GPU_HUB_TOKEN_BYTES];
	int world;
	int64_t job;
	uint32_t attempt;
	int nhosts;
	char host[PEER_MAX_HOSTS][256];
	bool started[PEER_MAX_HOSTS];
	char where[PEER_MAX_HOSTS * 400];
	/* a heartbeat thread for each host: a slow or dead one delays no other's */
	struct peer_hb {
		struct dmn_peer_job *j;
		int k;
		pthread_t thread;
		bool started;
	} hb[PEER_MAX_HOSTS];
	pthread_mutex_t mu;
	pthread_cond_t cv;
	bool ending;
	int64_t ttl_ms; /* the shortest lease ttl of this daemon's and its peers' */
};

static void peer_job_op(struct dmn_peer_job *j, int k, bool stop, int timeout_ms)
{
	Traind__PeerRequest req = TRAIND__PEER_REQUEST__INIT;
	Traind__PeerJob pj = TRAIND__PEER_JOB__INIT;
	pj.has_job = pj.has_attempt = 1;
	pj.job = j->job;
	pj.attempt = j->attempt;
	if (stop) {
		req.op_case = TRAIND__PEER_REQUEST__OP_STOP;
		req.stop = &pj;
	} else {
		req.op_case = TRAIND__PEER_REQUEST__OP_HEARTBEAT;
		req.heartbeat = &pj;
	}
	Traind__PeerReply *rep = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = dmn_peer_call(j->c, j->host[k], &req, timeout_ms, &rep, &eb);
	if (e == TD_OK && rep->status != 0)
		snprintf(eb.msg, sizeof(eb.msg), "%s", rep->message ? rep->message : "?");
	if (e != TD_OK || rep->status != 0)
		td_debug("TD-PEER-HEARTBEAT", "job %lld: %s to %s: %s", (long long)j->job,
			 stop ? "stop" : "heartbeat", j->host[k], eb.msg);
	if (rep)
		traind__peer_reply__free_unpacked(rep, NULL);
}

/* Host k's heartbeats, a quarter of the shortest ttl apart: each peer keeps
 * the run through three lost or late heartbeats in a row. A call waits up
 * to twice the period, so a slow host's answer is still a renewal while the
 * round stays within the ttl (period + 2 periods < 4), and fewer calls are
 * given up mid-handshake, which can leave nng 1.5's listener deaf
 * (probe_main). Each host has its own thread: one that does not answer
 * costs the others nothing. */
static void *heartbeat_main(void *arg)
{
	struct peer_hb *hb = arg;
	struct dmn_peer_job *j = hb->j;
	int64_t period = j->ttl_ms / 4;
	if (period < 250)
		period = 250;
	pthread_mutex_lock(&j->mu);
	while (!j->ending) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		int64_t ns = ts.tv_nsec + period % 1000 * 1000000;
		ts.tv_sec += period / 1000 + ns / 1000000000;
		ts.tv_nsec = ns % 1000000000;
		pthread_cond_timedwait(&j->cv, &j->mu, &ts);
		if (j->ending)
			break;
		pthread_mutex_unlock(&j->mu);
		peer_job_op(j, hb->k, false, (int)(2 * period));
		pthread_mutex_lock(&j->mu);
	}
	pthread_mutex_unlock(&j->mu);
	return NULL;
}

/* Host k's stop, at the run's end. */
static void *stop_main(void *arg)
{
	struct peer_hb *hb = arg;
	peer_job_op(hb->j, hb->k, true, 5000);
	return NULL;
}

td_err dmn_peer_job_start(struct dmn_peer_job **out, const struct dmn_peer_client *c, int64_t job,
			  uint32_t attempt, uid_t uid, gid_t gid, const Traind__JobSpec *spec,
			  uint64_t lease_bytes, bool *retry, struct td_errbuf *eb)
{
	*retry = false;
	const Traind__Resources *r = spec->resources;
	if (r->n_hosts < 1 || r->n_hosts > PEER_MAX_HOSTS)
		return td_fail(eb, TD_EINVAL, "resources.hosts: %zu hosts", r->n_hosts);
	struct dmn_peer_job *j = calloc(1, sizeof(*j));
	if (!j)
		return td_fail(eb, TD_ENOMEM, "peers: out of memory");
	j->c = c;
	j->job = job;
	j->attempt = attempt;
	j->nhosts = (int)r->n_hosts;
	j->ttl_ms = (int64_t)c->ttl_s * 1000;
	j->world = (int)(r->gpus * (1 + r->n_hosts));
	pthread_mutex_init(&j->mu, NULL);
	pthread_cond_init(&j->cv, NULL);
	for (int k = 0; k < j->nhosts; k++) {
		snprintf(j->host[k], sizeof(j->host[k]), "%s", r->hosts[k]);
		j->hb[k].j = j;
		j->hb[k].k = k;
	}
	td_err e = TD_OK;
	if (RAND_bytes(j->token, sizeof(j->token)) != 1)
		e = td_fail(eb, TD_EINTERNAL, "peers: no random bytes for the hub's token");
	if (e == TD_OK)
		e = gpu_hub_new(&j->hub, c->bind_host, j->world, j->token, 0, eb);
	size_t wl = 0;
	for (int k = 0; k < j->nhosts && e == TD_OK; k++) {
		if (strcmp(j->host[k], c->self) == 0) {
			e = td_fail(eb, TD_EINVAL,
				    "resources.hosts[%d]: %s is this daemon (its peer_listen); name the "
				    "other daemons only",
				    k, j->host[k]);
			break;
		}
		Traind__PeerRequest req = TRAIND__PEER_REQUEST__INIT;
		Traind__PeerRun run = TRAIND__PEER_RUN__INIT;
		run.has_job = run.has_attempt = run.has_uid = run.has_gid = 1;
		run.job = job;
		run.attempt = attempt;
		run.uid = uid;
		run.gid = gid;
		run.spec = (Traind__JobSpec *)spec;
		run.hub = (char *)gpu_hub_addr(j->hub);
		run.has_token = 1;
		run.token = (ProtobufCBinaryData){.len = sizeof(j->token), .data = j->token};
		run.has_world = run.has_rank_base = run.has_ranks = run.has_lease_bytes = 1;
		run.world = (uint32_t)j->world;
		run.rank_base = r->gpus * (uint32_t)(k + 1);
		run.ranks = r->gpus;
		run.lease_bytes = lease_bytes;
		req.op_case = TRAIND__PEER_REQUEST__OP_RUN;
		req.run = &run;
		Traind__PeerReply *rep = NULL;
		struct td_errbuf ceb = {{0}};
		e = dmn_peer_call(c, j->host[k], &req, 30000, &rep, &ceb);
		if (e == TD_OK && rep->status != 0)
			e = td_fail(&ceb, rep->status < 0 && rep->status > TD_ERR_FIRST_ ? rep->status
											   : TD_EINTERNAL,
				    "%s", rep->message ? rep->message : "refused");
		if (e == TD_OK) {
			j->started[k] = true;
			/* a peer of an older version says nothing: this daemon's own */
			if (rep->has_lease_ttl_ms && rep->lease_ttl_ms > 0 && rep->lease_ttl_ms < j->ttl_ms)
				j->ttl_ms = rep->lease_ttl_ms;
			wl += (size_t)snprintf(j->where + wl, sizeof(j->where) - wl, "%s%s (ranks %u to %u: %s)",
					       k ? ", " : "", j->host[k], run.rank_base,
					       run.rank_base + run.ranks - 1, rep->gpus ? rep->gpus : "?");
		} else {
			*retry = e == TD_EBUSY || e == TD_EPEER_LOST;
			td_fail(eb, e, "resources.hosts[%d] (%s): %s", k, j->host[k], ceb.msg);
		}
		if (rep)
			traind__peer_reply__free_unpacked(rep, NULL);
	}
	for (int k = 0; k < j->nhosts && e == TD_OK; k++) {
		int rv = pthread_create(&j->hb[k].thread, NULL, heartbeat_main, &j->hb[k]);
		if (rv != 0)
			e = td_fail(eb, TD_EINTERNAL, "peers: cannot start the heartbeats to %s: %s",
				    j->host[k], strerror(rv));
		j->hb[k].started = rv == 0;
	}
	if (e != TD_OK) {
		dmn_peer_job_end(j);
		return e;
	}
	*out = j;
	return TD_OK;
}

const char *dmn_peer_job_hub(const struct dmn_peer_job *j)
{
	return gpu_hub_addr(j->hub);
}

const uint8_t *dmn_peer_job_token(const struct dmn_peer_job *j)
{
	return j->token;
}

int dmn_peer_job_world(const struct dmn_peer_job *j)
{
	return j->world;
}

const char *dmn_peer_job_where(const struct dmn_peer_job *j)
{
	return j->where;
}

void dmn_peer_job_end(struct dmn_peer_job *j)
{
	if (!j)
		return;
	pthread_mutex_lock(&j->mu);
	j->ending = true;
	pthread_cond_broadcast(&j->cv);
	pthread_mutex_unlock(&j->mu);
	for (int k = 0; k < j->nhosts; k++)
		if (j->hb[k].started)
			pthread_join(j->hb[k].thread, NULL);
	/* Closing the hub fails any rank still in it; the stop reaches a run
	 * that had not joined yet. */
	gpu_hub_free(j->hub);
	/* The stops at once, a thread a host (each waits up to 5 s): hosts that
	 * do not answer cost the end 5 s, not 5 s each. */
	for (int k = 0; k < j->nhosts; k++)
		j->hb[k].started = j->started[k] &&
				   pthread_create(&j->hb[k].thread, NULL, stop_main, &j->hb[k]) == 0;
	for (int k = 0; k < j->nhosts; k++) {
		if (j->hb[k].started)
			pthread_join(j->hb[k].thread, NULL);
		else if (j->started[k])
			peer_job_op(j, k, true, 5000);
	}
	pthread_cond_destroy(&j->cv);
	pthread_mutex_destroy(&j->mu);
	free(j);
}
