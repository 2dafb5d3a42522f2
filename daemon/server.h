/* traind serving: the libuv loop, the nng REP socket, signals, housekeeping.
 *
 * Threads: nng's own threads receive requests on rpc_contexts REP contexts
 * and hand them to the loop thread through a queue and a uv_async; the loop
 * thread runs the dispatch table (daemon/dispatch.h), the scheduler and the
 * housekeeping tick, and hands replies back to nng (an asynchronous send).
 * Job runs live on runner threads (daemon/runner.h); checks that touch users'
 * files on libuv's worker pool. Nothing on the loop thread waits for a job.
 *
 * Start: create the state and cache dirs, take the state dir's lock file (one
 * daemon per state dir), open the database and requeue what was running when
 * the last daemon died (st_jobs_recover), listen on the socket (mode from
 * socket_mode), tell systemd READY=1.
 *
 * SIGTERM/SIGINT: stop admitting and refuse changes, ask the running jobs to
 * checkpoint and stop (they end INTERRUPTED and resume at the next start),
 * keep answering reads, exit 0 when they have stopped — or exit 1 after
 * shutdown_timeout_s with whatever did not stop recorded INTERRUPTED.
 * SIGHUP: reload the mutable settings (daemon/settings.h).
 * A CUDA context lost beyond reset: the same stop, then DMN_SERVE_REEXEC. */
#ifndef DAEMON_SERVER_H
#define DAEMON_SERVER_H

#include "daemon/settings.h"

/* Serves until a signal ends it. argc/argv are the settings arguments, kept
 * for SIGHUP reloads. Returns the process exit code: 0 after a clean stop, 1
 * when it could not start (the reason is logged) or had to force its exit. */
int dmn_serve(struct dmn_config *cfg, int argc, char **argv);

/* dmn_serve's return when the daemon stopped to be started again: a CUDA
 * device's context was lost to a sticky error that the driver cannot reset
 * in this process. Every job has checkpointed or been recorded INTERRUPTED;
 * the caller re-executes the program (same pid, so systemd's notify
 * bookkeeping holds), and the new process requeues them (contract 6). */
#define DMN_SERVE_REEXEC 75

#endif
