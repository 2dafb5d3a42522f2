/* Collectives among the ranks of one data-parallel job (issue 12): N threads
 * of this process, each with its own backend on its own device, that sum
 * their gradients before every optimizer step.
 *
 * A gang is what the ranks share: a barrier, the NCCL unique id and the
 * first failure. A rank that fails calls gpu_gang_fail; from then on every
 * barrier and every collective wait of every rank returns that failure at
 * once, and a rank blocked in NCCL aborts its communicator, so no rank
 * waits for one that will never come: the job fails on every rank in
 * bounded time and the process serves on.
 *
 * A comm is one rank's end of the collectives (all-reduce; reduce-scatter
 * and all-gather for sharded state). Two kinds:
 *   host  in-process, through host memory: each rank downloads its buffer,
 *         the ranks sum slices of the N buffers in rank order (x0 + x1 + ...
 *         from the left, in fp32: the same bits on every rank, whatever the
 *         bucketing) and upload the sums (a reduce-scatter: each rank
 *         its part's; an all-gather copies the parts). Any backend (the CPU's, simulated
 *         GPUs), blocking; for tests and for checking the NCCL path.
 *   nccl  ncclAllReduce, ncclReduceScatter, ncclAllGather (fp32, sum)
 *         on a stream of its own beside the backend's (the CUDA module's side stream: it waits for the
 *         backend's work enqueued so far), nonblocking communicators, every
 *         wait polled against the gang's failure, NCCL's asynchronous error,
 *         the stream's error and a timeout. The CUDA backend only.
 * Summing, not averaging: the trainer scales each rank's loss gradient by
 * 1 / (the global batch's valid tokens), so the sum is the mean gradient.
 *
 * Not here: which buffers are reduced and when (train/ddp.h), the ranks'
 * threads (train/trainer.c). */
#ifndef GPU_COMM_H
#define GPU_COMM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/backend.h"
#include "proto/err.h"

/* The most ranks of one gang (the daemon's DMN_MAX_GPUS is larger; a host
 * with more GPUs than this runs gangs of at most this many). */
#define GPU_GANG_MAX 16

/* Default bound of one collective wait, and of the communicators' set-up:
 * ranks run the same work between two collectives, so a wait this long
 * means a rank is stuck (a hung device), not slow. */
#define GPU_COMM_TIMEOUT_MS 300000

/* What NCCL allocates on each GPU of a gang beside the job's plan (its
 * channels' buffers for the peers, its kernels): an allowance the daemon
 * adds to each lease of a gang on real GPUs (contract 1). An estimate, held
 * to the peak tests/gpu/ddp.sh measures on the GPU machine. */
#define GPU_NCCL_RESERVE_BYTES ((uint64_t)1 << 30)

struct gpu_gang;
struct gpu_comm;

/* A gang of nranks (1 .. GPU_GANG_MAX). timeout_ms bounds every NCCL wait
 * (0: GPU_COMM_TIMEOUT_MS). Free it after every rank has freed its comm and
 * left the barriers. */
td_err gpu_gang_new(struct gpu_gang **out, int nranks, int timeout_ms, struct td_errbuf *eb);
/* gpu_gang_free(NULL) is a no-op. */
void gpu_gang_free(struct gpu_gang *g);
/* The ranks of the whole gang (across processes for a gang of a hub). */
int gpu_gang_size(const struct gpu_gang *g);

/* A gang across processes (one job across daemons: resources.hosts).
 *
 * The hub is one process's (the coordinating daemon's) thread that the
 * processes of the gang connect to over TCP, one connection each: it passes
 * the barriers (with rank 0's bytes broadcast: the NCCL unique id), the
 * first failure (a rank's gpu_gang_fail, or a connection that closes: a
 * process or host gone, TD_EPEER_LOST) and, for CPU ranks (the host comm,
 * simulated GPUs), the collectives themselves: it sums the ranks' buffers
 * in rank order from the left, the bits the in-process host comm gives the
 * same ranks. That sum is the CPU backend's transport across processes;
 * GPUs always sum through NCCL (its own bootstrap and TCP or InfiniBand
 * transport between hosts), the hub carrying only the id and the barriers.
 * A process joins with the hub's token (32 random bytes the coordinator
 * hands to its peers over their authenticated channel): a connection without
 * it is closed. No other security: the sums travel in the clear.
 *
 * gpu_hub_new listens on bind_host (a numeric address or a name; port 0:
 * any free port) for world ranks; gpu_hub_addr gives "HOST:PORT" to hand
 * out. Every rank must join within join_ms of gpu_hub_new (0: 60 s), or the
 * gang fails. gpu_hub_free closes it (any rank still connected sees its
 * connection close and fails). Not collective; any thread. */
#define GPU_HUB_TOKEN_BYTES 32
struct gpu_hub;
td_err gpu_hub_new(struct gpu_hub **out, const char *bind_host, int world,
		   const uint8_t token[GPU_HUB_TOKEN_BYTES], int join_ms, struct td_errbuf *eb);
const char *gpu_hub_addr(const struct gpu_hub *h);
/* Whether the gang of the hub failed, and the first failure (into eb, may
 * be NULL): the hub's view, for the coordinator's log. */
bool gpu_hub_failed(struct gpu_hub *h, td_err *code, struct td_errbuf *eb);
void gpu_hub_free(struct gpu_hub *h);

/* This process's part of a gang of world ranks joined through the hub at
 * hub ("HOST:PORT"): ranks base .. base + nlocal - 1, each on a thread of
 * this process, calling the gang's functions with its global rank. label
 * names this process in the others' errors ("the daemon at tcp://..."). Connects
 * (retrying for up to 5 s while refused), joins with token, and returns
 * once the hub has accepted; TD_EPEER_LOST when it cannot. Barriers, the
 * first failure and host comms then go through the hub; the barrier of a
 * gang of a hub never times out either, but a connection that closes fails
 * it at once, and TCP keepalive (and TCP_USER_TIMEOUT) close a connection to
 * a host that stopped answering within about 30 s. */
td_err gpu_gang_new_net(struct gpu_gang **out, int world, int base, int nlocal, const char *hub,
			const uint8_t token[GPU_HUB_TOKEN_BYTES], const char *label, int timeout_ms,
			struct td_errbuf *eb);
/* Whether g spans processes (gpu_gang_new_net). */
bool gpu_gang_is_net(const struct gpu_gang *g);
/* Once *flag is true the gang fails with TD_EPEER_LOST and why, at the
 * next wait of any rank of this process (a wait for the hub polls it twice a
 * second; an NCCL wait at each poll): for a process whose coordinator went
 * silent without closing its connections (a stopped or wedged daemon).
 * Set it before the ranks start; flag and why outlive the gang, and why is
 * read once *flag is true (it may be written until then). */
void gpu_gang_set_abort(struct gpu_gang *g, const atomic_bool *flag, const char *why);

/* Every rank calls it with n doubles at v and a flag: afterwards v holds
 * the sums over the ranks (in rank order from the left) and *flag whether
 * any rank's was set. A barrier besides (it fails as one). What the ranks
 * of a step agree on: the micro-batches' losses, whether to stop. */
td_err gpu_gang_exchange(struct gpu_gang *g, int rank, double *v, size_t n, bool *flag,
			 struct td_errbuf *eb);

/* Rank `rank` failed with e and message msg. The first failure is kept (the
 * job's error); later calls only wake the waiters. Any thread. */
void gpu_gang_fail(struct gpu_gang *g, int rank, td_err e, const char *msg);
/* Rank `rank` learned better why it failed (its device's error behind an
 * NCCL one): where the gang's first failure is that rank's, it becomes e
 * and msg. Any thread. */
void gpu_gang_refine(struct gpu_gang *g, int rank, td_err e, const char *msg);
/* Whether a rank failed. Any thread, lock-free. */
bool gpu_gang_failed(const struct gpu_gang *g);
/* The first failure: its code (TD_OK when none), its rank (*rank, may be
 * NULL) and message (into eb, may be NULL). */
td_err gpu_gang_error(struct gpu_gang *g, int *rank, struct td_errbuf *eb);

/* Blocks until every rank has called it (the calls pair up by order), or
 * until the gang fails: then returns the first failure's code with "rank R
 * of N stopped: rank K failed: ..." in eb. No timeout of its own: every rank
 * either arrives or fails the gang (train/trainer.c holds to that). A gang
 * that failed never passes a barrier again. */
td_err gpu_gang_barrier(struct gpu_gang *g, int rank, struct td_errbuf *eb);

enum gpu_comm_kind {
	GPU_COMM_AUTO, /* nccl on the CUDA backend, host elsewhere */
	GPU_COMM_HOST,
	GPU_COMM_NCCL,
};

/* "auto", "host", "nccl" -> *out; false if none of them. */
bool gpu_comm_kind_parse(const char *s, enum gpu_comm_kind *out);

/* Rank `rank`'s comm on backend be. Collective: every rank of g calls it,
 * each on its own thread (the one that created be: its device is current
 * there), and it returns once all have made theirs (or one failed; then it
 * fails the gang too). TD_EUNSUPPORTED: NCCL asked for on another backend,
 * or its library or the CUDA module's side streams are missing (named). */
td_err gpu_comm_new(struct gpu_comm **out, struct gpu_gang *g, int rank, struct gpu_backend *be,
		    enum gpu_comm_kind kind, struct td_errbuf *eb);
/* Frees the comm (aborting a communicator with work in flight).
 * gpu_comm_free(NULL) is a no-op. Not collective. */
void gpu_comm_free(struct gpu_comm *c);
/* "host", or "nccl 2.28.9". */
const char *gpu_comm_name(const struct gpu_comm *c);
/* Whether gpu_comm_all_reduce_sum returns before the sum is done, so that
 * the backend's later work overlaps it (NCCL); false: it blocks (host). */
bool gpu_comm_async(const struct gpu_comm *c);

/* Sums n floats at x (on the comm's backend) over the ranks, in place.
 * Every rank makes the same calls, in the same order, with the same n. x
 * is read as the work enqueued on the backend so far leaves it. Async: the
 * call returns once the sum is enqueued, and the backend must neither read
 * nor write x before gpu_comm_wait returns. Errors fail the gang. */
td_err gpu_comm_all_reduce_sum(struct gpu_comm *c, float *x, size_t n, struct td_errbuf *eb);

/* Sharded state (ZeRO, train/ddp.h): x holds nranks * count floats on
 * every rank, rank r's part at x + r * count.
 *
 * reduce-scatter: sums x over the ranks, each rank getting its part only:
 * afterwards x[rank * count, (rank + 1) * count) holds the sum of every
 * rank's floats there (host: in rank order from the left, the bits
 * gpu_comm_all_reduce_sum gives them); the rest of x is left undefined.
 * all-gather: every rank's part to every rank: afterwards x holds part r of
 * rank r for every r (this rank's own part unchanged).
 * Both in place, with all-reduce's rules: every rank makes the same calls in
 * the same order with the same count; async on NCCL (gpu_comm_wait), errors
 * fail the gang. */
td_err gpu_comm_reduce_scatter_sum(struct gpu_comm *c, float *x, size_t count,
				   struct td_errbuf *eb);
td_err gpu_comm_all_gather(struct gpu_comm *c, float *x, size_t count, struct td_errbuf *eb);
/* The same with this rank's part read from send (count floats, or any 4-byte
 * values: the gather copies bytes; not overlapping x unless it is x +
 * rank * count) and written to x + rank * count too. On NCCL send is read
 * by the side stream until the gather completes (gpu_comm_wait_for). */
td_err gpu_comm_all_gather_from(struct gpu_comm *c, const float *send, float *x, size_t count,
				struct td_errbuf *eb);

/* Sharded gradients (train/ddp.h): sums n floats at x over the ranks onto
 * rank `root` only: afterwards y (on root; may be x) holds the sum (host:
 * in rank order from the left, the bits gpu_comm_all_reduce_sum gives); y
 * is not read nor written on the other ranks. All-reduce's rules: the same
 * calls in the same order with the same n and root on every rank; async on
 * NCCL (gpu_comm_wait, gpu_comm_wait_for), errors fail the gang. */
td_err gpu_comm_reduce_sum(struct gpu_comm *c, const float *x, size_t n, int root, float *y,
			   struct td_errbuf *eb);

/* Sharded weights (train/ddp.h): n floats at x on rank `root` to every
 * rank's y (root's too; x is read on root only, and may be y there).
 * All-reduce's rules; in one process only (a gang of a hub: TD_EUNSUPPORTED). */
td_err gpu_comm_broadcast(struct gpu_comm *c, const float *x, size_t n, int root, float *y,
			  struct td_errbuf *eb);
/* Whether this comm has the broadcasts: NCCL, or host memory in one
 * process (a gang of a hub's CPU ranks has none). */
bool gpu_comm_can_broadcast(const struct gpu_comm *c);
/* The same for n bf16 values (2n bytes; the stats count n / 2 floats). */
td_err gpu_comm_broadcast16(struct gpu_comm *c, const void *x, size_t n, int root, void *y,
			    struct td_errbuf *eb);

/* A host value summed over the ranks, in rank order (v0 + v1 + ... from
 * the left, in double: the same bits on every rank): *v is this rank's on
 * entry, the sum on return. Blocking on both kinds (the ranks are threads
 * of this process: through the gang's memory, not NCCL). Errors: the
 * gang's failure. */
td_err gpu_comm_sum_host(struct gpu_comm *c, double *v, struct td_errbuf *eb);

/* The collectives started between begin and end launch together (NCCL:
 * one group — one enqueue, on NCCL's thread for a nonblocking
 * communicator, where each call alone makes its own; their events are
 * recorded at the end); every rank groups the same calls. Between them a
 * collective returns as soon as it is queued: no mark taken inside may be
 * waited for before the end. The host kind runs each call as it comes.
 * end returns the group's launch error (the gang failed, as a call's). */
void gpu_comm_group_begin(struct gpu_comm *c);
td_err gpu_comm_group_end(struct gpu_comm *c, struct td_errbuf *eb);
/* The collectives this rank has started so far, as a count: a mark that
 * gpu_comm_wait_for takes. */
uint64_t gpu_comm_mark(const struct gpu_comm *c);
/* Blocks until the collectives started before `mark` (gpu_comm_mark then)
 * are complete, leaving later ones in flight where the kind can (NCCL: an
 * event recorded after each; the host kind's calls are complete when they
 * return). Bounded and failing as gpu_comm_wait. */
td_err gpu_comm_wait_for(struct gpu_comm *c, uint64_t mark, struct td_errbuf *eb);
/* The same order without holding the host: the work enqueued on the
 * backend from now on runs after the collectives started before `mark`
 * (NCCL: the backend's stream waits for the event after them, on the
 * device; host: complete already). Nothing here is bounded: a rank that
 * never arrives stalls that stream, so before the host blocks on the
 * backend (a sync, a download) it must wait for `mark` with
 * gpu_comm_wait_for or gpu_comm_wait, which time out and abort. */
td_err gpu_comm_after(struct gpu_comm *c, uint64_t mark, struct td_errbuf *eb);

/* Blocks until every sum this rank started is complete: work enqueued on
 * the backend from then on sees them. Bounded: another rank's failure, an
 * NCCL error (asynchronous, of a peer too), an error of the stream or no
 * completion within the gang's timeout aborts this rank's communicator,
 * fails the gang and returns the error. */
td_err gpu_comm_wait(struct gpu_comm *c, struct td_errbuf *eb);

/* Collectives since the comm was made: calls, and floats of x each
 * call covered (all-reduce: n; reduce-scatter, all-gather: nranks * count). */
struct gpu_comm_stats {
	uint64_t calls, floats;
};
void gpu_comm_stats(const struct gpu_comm *c, struct gpu_comm_stats *out);

#endif
