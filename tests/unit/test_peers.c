/* The daemons' peer protocol (daemon/peers.h): who a peer listens to.
 *
 * A peer end on loopback with a simulated GPU; requests built here with the
 * test's own HMAC-SHA256 (OpenSSL's, the reference) and sent raw over nng:
 * a signed heartbeat for a run the peer does not have is answered
 * TD_ENOENT (it got past the checks); the same bytes again are a replay
 * (TD_EPERM); a request signed with another secret, one with a byte changed
 * after signing, one without a MAC, one from 2 minutes ago and one of
 * another protocol are refused, each naming why; dmn_peer_call signs as
 * the peer expects. A PeerRun with a bad field is refused without a lease;
 * one whose GPU cannot fit the lease says so. And the secret file: refused
 * when group- or world-readable, short, or missing. 1200 connections
 * closed in the SP handshake (nng 1.5 goes deaf after such) leave the peer
 * answering within 45 s; a listener closed under the peer (the test hook
 * TD_PEER_DEAF_AFTER_S, as nng 1.5 leaves one) is found by its probe and
 * listened on again. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/devices.h"
#include "daemon/peers.h"
#include "daemon/settings.h"
#include "proto/rpc.h"
#include "state/state.h"
#include "tests/check.h"

static char tmp[256];
static struct dmn_peer_client pc;

static int64_t wall_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* req signed with secret (the reference MAC: over the encoding without mac),
 * encoded into *out. */
static size_t sign(Traind__PeerRequest *req, const char *secret, uint8_t **out, uint8_t *macbuf)
{
	req->has_mac = 0;
	size_t n = traind__peer_request__get_packed_size(req);
	uint8_t *b = malloc(n);
	traind__peer_request__pack(req, b);
	unsigned len = 0;
	HMAC(EVP_sha256(), secret, (int)strlen(secret), b, n, macbuf, &len);
	free(b);
	req->has_mac = 1;
	req->mac = (ProtobufCBinaryData){.len = len, .data = macbuf};
	n = traind__peer_request__get_packed_size(req);
	*out = malloc(n);
	traind__peer_request__pack(req, *out);
	return n;
}

/* Sends len bytes to the peer; its answer's status and message. */
static td_err send_raw(const uint8_t *buf, size_t len, char *msg, size_t cap)
{
	nng_socket s;
	CHECK(nng_req0_open(&s) == 0);
	nng_socket_set_ms(s, NNG_OPT_RECVTIMEO, 5000);
	CHECK(nng_dial(s, pc.self, NULL, 0) == 0);
	CHECK(nng_send(s, (void *)buf, len, 0) == 0);
	void *r = NULL;
	size_t rl = 0;
	td_err e = TD_EINTERNAL;
	if (nng_recv(s, &r, &rl, NNG_FLAG_ALLOC) == 0) {
		Traind__PeerReply *rep = traind__peer_reply__unpack(NULL, rl, r);
		if (rep) {
			e = rep->status;
			snprintf(msg, cap, "%s", rep->message ? rep->message : "");
			traind__peer_reply__free_unpacked(rep, NULL);
		}
		nng_free(r, rl);
	}
	nng_close(s);
	return e;
}

/* req encoded as it is (whatever its mac) and sent: send_raw's answer. */
static td_err send_req(const Traind__PeerRequest *req, char *msg, size_t cap)
{
	size_t n = traind__peer_request__get_packed_size(req);
	uint8_t *b = malloc(n);
	traind__peer_request__pack(req, b);
	td_err e = send_raw(b, n, msg, cap);
	free(b);
	return e;
}

static void heartbeat_req(Traind__PeerRequest *req, Traind__PeerJob *pj, uint8_t *nonce, int64_t t)
{
	traind__peer_request__init(req);
	traind__peer_job__init(pj);
	pj->has_job = pj->has_attempt = 1;
	pj->job = 42;
	pj->attempt = 1;
	req->has_protocol = 1;
	req->protocol = RPC_PROTOCOL;
	req->coordinator = "tcp://127.0.0.1:1";
	req->has_time_ms = 1;
	req->time_ms = t;
	req->has_nonce = 1;
	req->nonce = (ProtobufCBinaryData){.len = 16, .data = nonce};
	req->op_case = TRAIND__PEER_REQUEST__OP_HEARTBEAT;
	req->heartbeat = pj;
}

static void test_auth(void)
{
	char msg[1024];
	uint8_t nonce[16], mac[32], *buf;
	Traind__PeerRequest req;
	Traind__PeerJob pj;
	for (int i = 0; i < 16; i++)
		nonce[i] = (uint8_t)(i * 7 + 1);
	heartbeat_req(&req, &pj, nonce, wall_ms());
	size_t n = sign(&req, (const char *)pc.secret, &buf, mac);
	td_err e = send_raw(buf, n, msg, sizeof(msg));
	CHECK_MSG(e == TD_ENOENT && strstr(msg, "no run of job 42"), "signed: %s: %s", td_errname(e),
		  msg);
	e = send_raw(buf, n, msg, sizeof(msg));
	CHECK_MSG(e == TD_EPERM && strstr(msg, "replayed"), "replay: %s: %s", td_errname(e), msg);
	free(buf);

	nonce[0]++;
	n = sign(&req, "another secret of the wrong daemons", &buf, mac);
	e = send_raw(buf, n, msg, sizeof(msg));
	CHECK_MSG(e == TD_EPERM && strstr(msg, "its MAC does not match"), "other secret: %s", msg);
	free(buf);

	nonce[0]++;
	n = sign(&req, (const char *)pc.secret, &buf, mac);
	pj.job = 43; /* changed after signing */
	free(buf);
	e = send_req(&req, msg, sizeof(msg));
	CHECK_MSG(e == TD_EPERM && strstr(msg, "its MAC does not match"), "tampered: %s", msg);

	nonce[0]++;
	req.has_mac = 0;
	e = send_req(&req, msg, sizeof(msg));
	CHECK_MSG(e == TD_EPERM && strstr(msg, "its MAC does not match"), "no MAC: %s", msg);

	nonce[0]++;
	heartbeat_req(&req, &pj, nonce, wall_ms() - 120000);
	n = sign(&req, (const char *)pc.secret, &buf, mac);
	e = send_raw(buf, n, msg, sizeof(msg));
	CHECK_MSG(e == TD_EPERM && strstr(msg, "from this host's clock"), "old: %s", msg);
	free(buf);

	nonce[0]++;
	heartbeat_req(&req, &pj, nonce, wall_ms());
	req.protocol = RPC_PROTOCOL + 1;
	n = sign(&req, (const char *)pc.secret, &buf, mac);
	e = send_raw(buf, n, msg, sizeof(msg));
	CHECK_MSG(e == TD_EUNSUPPORTED && strstr(msg, "peer protocol"), "protocol: %s", msg);
	free(buf);

	/* dmn_peer_call signs as the peer expects */
	Traind__PeerRequest r2 = TRAIND__PEER_REQUEST__INIT;
	Traind__PeerJob j2 = TRAIND__PEER_JOB__INIT;
	j2.has_job = j2.has_attempt = 1;
	j2.job = 7;
	r2.op_case = TRAIND__PEER_REQUEST__OP_STOP;
	r2.stop = &j2;
	Traind__PeerReply *rep = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(dmn_peer_call(&pc, pc.self, &r2, 5000, &rep, &eb), TD_OK);
	CHECK_MSG(rep && rep->status == TD_ENOENT, "dmn_peer_call: %d %s", rep ? rep->status : 0,
		  rep && rep->message ? rep->message : "");
	if (rep)
		traind__peer_reply__free_unpacked(rep, NULL);
	/* nobody there */
	CHECK_EQ_INT(dmn_peer_call(&pc, "tcp://127.0.0.1:1", &r2, 2000, &rep, &eb), TD_EPEER_LOST);
	CHECK_MSG(strstr(eb.msg, "cannot reach the daemon at tcp://127.0.0.1:1"), "%s", eb.msg);
}

static void test_run_refused(struct st_db *db)
{
	Traind__PeerRequest req = TRAIND__PEER_REQUEST__INIT;
	Traind__PeerRun run = TRAIND__PEER_RUN__INIT;
	req.op_case = TRAIND__PEER_REQUEST__OP_RUN;
	req.run = &run;
	run.has_job = 1;
	run.job = 5; /* no spec, no hub */
	Traind__PeerReply *rep = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(dmn_peer_call(&pc, pc.self, &req, 5000, &rep, &eb), TD_OK);
	CHECK_MSG(rep && rep->status == TD_EINVAL && strstr(rep->message, "a field is missing"),
		  "bad run: %s", rep && rep->message ? rep->message : "");
	traind__peer_reply__free_unpacked(rep, NULL);
	struct st_lease *l = NULL;
	size_t nl = 9;
	CHECK_EQ_INT(st_ledger_list(db, NULL, &l, &nl, &eb), TD_OK);
	CHECK_EQ_INT(nl, 0);
	free(l);
}

/* nng 1.5's deaf listener: connections closed in the SP handshake (a port
 * scan) must not keep the peers out for good — the probe listens again.
 * Answered within 45 s of the storm (three probe misses of 5 s each, a
 * probe every 5 s, then a retry a second). */
static void test_storm(struct dmn_peers *p)
{
	int port = atoi(strrchr(pc.self, ':') + 1);
	for (int round = 0; round < 4; round++)
		for (int i = 0; i < 300; i++) {
			int fd = socket(AF_INET, SOCK_STREAM, 0);
			struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
						 .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
			/* rounds 0, 2: closed with a reset; 1, 3: with a FIN after half
			 * a handshake */
			struct linger lg = {.l_onoff = 1, .l_linger = 0};
			if (round % 2 == 0)
				setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
			if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0 && round % 2)
				(void)!write(fd, "\0SP\0", 4);
			close(fd);
		}
	Traind__PeerRequest r = TRAIND__PEER_REQUEST__INIT;
	Traind__PeerJob j = TRAIND__PEER_JOB__INIT;
	j.has_job = 1;
	j.job = 9;
	r.op_case = TRAIND__PEER_REQUEST__OP_STOP;
	r.stop = &j;
	td_err e = TD_EPEER_LOST;
	struct td_errbuf eb = {{0}};
	time_t t0 = time(NULL);
	while (e != TD_OK && time(NULL) - t0 < 45) {
		Traind__PeerReply *rep = NULL;
		e = dmn_peer_call(&pc, pc.self, &r, 2000, &rep, &eb);
		if (rep)
			traind__peer_reply__free_unpacked(rep, NULL);
		if (e != TD_OK)
			sleep(1);
	}
	CHECK_MSG(e == TD_OK, "no answer within 45 s of the storm: %s", eb.msg);
	printf("after 1200 connections closed in the handshake: answered after %ld s, %d relisten(s)\n",
	       (long)(time(NULL) - t0), dmn_peers_relistens(p));
}

/* The probe itself: a listener closed under it (TD_PEER_DEAF_AFTER_S, as
 * nng 1.5 leaves one) is found within three probes and listened on again:
 * refused at first, answered within 45 s, one relisten. */
static void test_deaf(struct dmn_peers *p)
{
	Traind__PeerRequest r = TRAIND__PEER_REQUEST__INIT;
	Traind__PeerJob j = TRAIND__PEER_JOB__INIT;
	j.has_job = 1;
	j.job = 9;
	r.op_case = TRAIND__PEER_REQUEST__OP_STOP;
	r.stop = &j;
	struct td_errbuf eb = {{0}};
	Traind__PeerReply *rep = NULL;
	time_t t0 = time(NULL);
	td_err e = TD_OK;
	while (e == TD_OK && time(NULL) - t0 < 10) { /* the hook closes it after 1 s */
		e = dmn_peer_call(&pc, pc.self, &r, 2000, &rep, &eb);
		if (rep)
			traind__peer_reply__free_unpacked(rep, NULL);
		rep = NULL;
		if (e == TD_OK)
			nanosleep(&(struct timespec){.tv_nsec = 200 * 1000 * 1000}, NULL);
	}
	CHECK_MSG(e == TD_EPEER_LOST, "the closed listener still answers: %s", td_errname(e));
	while (e != TD_OK && time(NULL) - t0 < 45) {
		e = dmn_peer_call(&pc, pc.self, &r, 2000, &rep, &eb);
		if (rep)
			traind__peer_reply__free_unpacked(rep, NULL);
		rep = NULL;
		if (e != TD_OK)
			sleep(1);
	}
	CHECK_MSG(e == TD_OK, "not answering again within 45 s: %s", eb.msg);
	CHECK_EQ_INT(dmn_peers_relistens(p), 1);
	printf("a deaf listener: answered again after %ld s\n", (long)(time(NULL) - t0));
}

/* The secret file's checks. */
static void test_secret_file(void)
{
	struct dmn_config cfg;
	memset(&cfg, 0, sizeof(cfg));
	snprintf(cfg.peer_listen, sizeof(cfg.peer_listen), "tcp://127.0.0.1:7");
	cfg.peer_lease_ttl_s = 60;
	snprintf(cfg.peer_secret_file, sizeof(cfg.peer_secret_file), "%s/s1", tmp);
	struct dmn_peer_client c;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(dmn_peer_client_init(&c, &cfg, &eb), TD_ENOENT);
	int fd = open(cfg.peer_secret_file, O_CREAT | O_WRONLY, 0640);
	CHECK(write(fd, "0123456789abcdef0123\n", 21) == 21);
	close(fd);
	chmod(cfg.peer_secret_file, 0640);
	CHECK_EQ_INT(dmn_peer_client_init(&c, &cfg, &eb), TD_EPERM);
	CHECK_MSG(strstr(eb.msg, "readable or writable by others (mode 0640)"), "%s", eb.msg);
	chmod(cfg.peer_secret_file, 0600);
	CHECK_MSG(dmn_peer_client_init(&c, &cfg, &eb) == TD_OK, "%s", eb.msg);
	CHECK_EQ_INT(c.secret_len, 20); /* the newline is not part of it */
	CHECK_STR_EQ(c.bind_host, "127.0.0.1");
	fd = open(cfg.peer_secret_file, O_TRUNC | O_WRONLY);
	CHECK(write(fd, "short\n", 6) == 6);
	close(fd);
	CHECK_EQ_INT(dmn_peer_client_init(&c, &cfg, &eb), TD_EINVAL);
	CHECK_MSG(strstr(eb.msg, "a secret is 16"), "%s", eb.msg);
	snprintf(cfg.peer_listen, sizeof(cfg.peer_listen), "127.0.0.1:7");
	CHECK_EQ_INT(dmn_peer_client_init(&c, &cfg, &eb), TD_EINVAL);
	CHECK_MSG(strstr(eb.msg, "peer_listen: '127.0.0.1:7' is not tcp://HOST:PORT"), "%s", eb.msg);
}

int main(void)
{
	snprintf(tmp, sizeof(tmp), "/tmp/td-peers-XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 2;
	}
	test_secret_file();

	struct dmn_config cfg;
	memset(&cfg, 0, sizeof(cfg));
	cfg.vram_factor = 0.9;
	cfg.peer_lease_ttl_s = 60;
	int port = 20000 + (int)(getpid() % 30000);
	snprintf(cfg.peer_listen, sizeof(cfg.peer_listen), "tcp://127.0.0.1:%d", port);
	snprintf(cfg.peer_secret_file, sizeof(cfg.peer_secret_file), "%s/secret", tmp);
	int fd = open(cfg.peer_secret_file, O_CREAT | O_WRONLY, 0600);
	CHECK(write(fd, "the daemons' shared secret, 40 bytes long", 41) == 41);
	close(fd);
	struct td_errbuf eb = {{0}};
	CHECK_MSG(dmn_peer_client_init(&pc, &cfg, &eb) == TD_OK, "%s", eb.msg);
	pc.secret[pc.secret_len] = 0; /* the test signs with it as a string */
	struct dmn_devices dev;
	CHECK_EQ_INT(dmn_devices_init_fake(&dev, "GPU-peer-t:64M", &eb), TD_OK);
	char db_path[512];
	snprintf(db_path, sizeof(db_path), "%s/traind.db", tmp);
	struct st_db *db = NULL;
	CHECK_MSG(st_open(&db, db_path, NULL, &eb) == TD_OK, "%s", eb.msg);
	struct dmn_peers *p = NULL;
	td_err e = dmn_peers_start(&p, &pc, &cfg, db_path, &dev, &eb);
	CHECK_MSG(e == TD_OK, "start: %s", eb.msg);
	if (e == TD_OK) {
		test_auth();
		test_run_refused(db);
		test_storm(p);
		CHECK_EQ_INT(dmn_peers_running(p), 0);
		dmn_peers_free(p);
	}
	/* again, with the hook that closes the listener after a second */
	setenv("TD_PEER_DEAF_AFTER_S", "1", 1);
	e = dmn_peers_start(&p, &pc, &cfg, db_path, &dev, &eb);
	unsetenv("TD_PEER_DEAF_AFTER_S");
	CHECK_MSG(e == TD_OK, "start again: %s", eb.msg);
	if (e == TD_OK) {
		test_deaf(p);
		dmn_peers_free(p);
	}
	st_close(db);
	if (!check_failures_)
		check_rm_tree(tmp);
	return check_status();
}
