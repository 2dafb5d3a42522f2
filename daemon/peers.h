/* One job across daemons (resources.hosts, issue 12 item 4): the daemons'
 * own protocol, both ends.
 *
 * The coordinating daemon (the one the job was submitted to) runs the job's
 * first ranks; its runner thread (daemon/runner.c) opens the gang's hub
 * (gpu/comm.h: gpu_hub, a listening socket on its peer_listen host), then
 * asks each daemon of resources.hosts, over nng REQ/REP on tcp://, to run its
 * ranks (PeerRun: the spec, the submitter, the hub's address and token, its
 * ranks, each GPU's lease bytes), and while the job runs renews the peers'
 * leases (heartbeat, every peer_lease_ttl_s / 4). A peer reserves its GPUs in
 * its own ledger (one transaction, a lease of job 0 labelled with the job and
 * the coordinator, expiring after peer_lease_ttl_s unless renewed) and runs
 * the ranks on a thread of its own, as the submitter, until the job ends,
 * fails or is lost; then it releases the leases. It keeps no job row: the
 * job is the coordinator's (its state, events, checkpoints, output).
 *
 * Authentication: every request carries HMAC-SHA256 under the secret that
 * every daemon of the job reads from its peer_secret_file (a file of the
 * daemon's own user, readable by nobody else: a local user can neither read
 * it nor make a request a peer accepts, so no one injects a job under
 * another's uid), a timestamp within 60 s and a nonce not seen in that
 * window (no replay). Nothing is encrypted: the specs and the hub's traffic
 * cross the network in the clear (DESIGN.md: many hosts).
 *
 * Threads: the peer end is one thread on the listening socket (requests one
 * at a time, and once a second the housekeeping: a guest whose coordinator
 * stopped renewing is stopped), one that probes the listener (nng 1.5 can
 * go deaf; it listens again) and one thread per guest run; the coordinator
 * end runs on the job's runner thread, plus one heartbeat thread a run. */
#ifndef DAEMON_PEERS_H
#define DAEMON_PEERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "daemon/devices.h"
#include "daemon/settings.h"
#include "proto/err.h"
#include "traind.pb-c.h"

#define DMN_PEER_SECRET_MAX 4096

/* What both ends need: this daemon's peer address and the shared secret. */
struct dmn_peer_client {
	char self[256];       /* peer_listen: "tcp://HOST:PORT" */
	char bind_host[256];  /* its HOST: where a coordinator's hubs listen */
	uint8_t secret[DMN_PEER_SECRET_MAX];
	size_t secret_len;
	long ttl_s;           /* peer_lease_ttl_s at start */
};

/* Reads cfg's peer_listen and peer_secret_file into c. The secret file must
 * be a regular file of the daemon's own user with no permission for group or
 * others, of 16 .. 4096 bytes (a trailing newline is not part of it).
 * TD_EINVAL / TD_EPERM naming the setting. */
td_err dmn_peer_client_init(struct dmn_peer_client *c, const struct dmn_config *cfg,
			    struct td_errbuf *eb);

/* --- the peer end ------------------------------------------------------- */

struct dmn_peers;

/* Listens on c->self and serves until dmn_peers_free. db_path: the state
 * database (the thread's own handles); dev: this daemon's GPUs; cfg: its
 * live settings (vram_factor, cuda_context_mib). All outlive the set. */
td_err dmn_peers_start(struct dmn_peers **out, const struct dmn_peer_client *c,
		       const struct dmn_config *cfg, const char *db_path,
		       const struct dmn_devices *dev, struct td_errbuf *eb);
/* Shutdown: every guest run stops at its next step (the job's ranks stop
 * together and its rank 0 checkpoints); new runs are refused. Returns at
 * once. */
void dmn_peers_stop(struct dmn_peers *p);
/* Guest runs not ended yet. Any thread. */
size_t dmn_peers_running(struct dmn_peers *p);
/* How often the listener was found deaf and listened on again (nng 1.5's
 * bug after a client closes in the handshake; peers.c). Any thread. */
int dmn_peers_relistens(struct dmn_peers *p);
/* Closes the socket, joins every thread (after dmn_peers_stop they end at
 * their next step; a guest run whose coordinator is gone ends when the
 * gang notices). dmn_peers_free(NULL) is a no-op. */
void dmn_peers_free(struct dmn_peers *p);

/* --- the coordinator end ------------------------------------------------ */

struct dmn_peer_job;

/* The job's run on its other daemons: opens the hub for world = gpus x (1 +
 * hosts) ranks, asks each host to run its ranks, starts the heartbeats.
 * TD_OK: the peers run their ranks and wait in the hub (tr_train joins it
 * with dmn_peer_job_hub, _token, _world; rank_base 0). Otherwise every peer
 * that had started is stopped and *retry says whether the job should be
 * requeued and tried again (a peer unreachable, busy or still ending its
 * last run: TD_EBUSY / TD_EPEER_LOST) or fail (a peer refused it: bad
 * secret, bad spec there, no GPU). */
td_err dmn_peer_job_start(struct dmn_peer_job **out, const struct dmn_peer_client *c, int64_t job,
			  uint32_t attempt, uid_t uid, gid_t gid, const Traind__JobSpec *spec,
			  uint64_t lease_bytes, bool *retry, struct td_errbuf *eb);
const char *dmn_peer_job_hub(const struct dmn_peer_job *j);
const uint8_t *dmn_peer_job_token(const struct dmn_peer_job *j);
int dmn_peer_job_world(const struct dmn_peer_job *j);
/* "tcp://a (GPU-x), tcp://b (GPU-y)": where the peers run, for the events. */
const char *dmn_peer_job_where(const struct dmn_peer_job *j);
/* Stops the heartbeats, tells every peer to stop (its ranks have ended,
 * or end now that the hub closes) and closes the hub. NULL: a no-op. */
void dmn_peer_job_end(struct dmn_peer_job *j);

/* One request to the daemon at addr (the coordinator end's calls; a test's
 * too): signed with c's secret, answered within timeout_ms. *reply is the
 * peer's answer (free with traind__peer_reply__free_unpacked); TD_EPEER_LOST
 * when it cannot be reached or does not answer. */
td_err dmn_peer_call(const struct dmn_peer_client *c, const char *addr, Traind__PeerRequest *req,
		     int timeout_ms, Traind__PeerReply **reply, struct td_errbuf *eb);

#endif
