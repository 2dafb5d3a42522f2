/* Metrics for the host's monitoring (issue 14, item 5): the Prometheus text
 * exposition (format 0.0.4) of the daemon's state, written atomically to a
 * file for node_exporter's textfile collector (setting metrics_textfile, on
 * the housekeeping tick) and/or served at http://127.0.0.1:PORT/metrics
 * (setting metrics_port). Both off by default.
 *
 * The families (every name prefixed traind_):
 *   up, uptime_seconds, requests_total{call}, request_errors_total{call}
 *   jobs{state}                 jobs per state (queue lengths); jobs_held
 *   gpu_total_bytes, gpu_share_bytes (total x vram_factor),
 *   gpu_reserved_bytes (the ledger), gpu_used_bytes (total - the driver's
 *   free; absent where unknown)                    {gpu, uuid, name}
 *   pinned_host_bytes (the running jobs' plans'), pinned_host_max_bytes
 *   (the setting pinned_host_max_mib)
 *   job_step, job_total_steps, job_loss, job_tokens_per_second,
 *   job_eta_seconds, job_gpus, job_pinned_host_bytes
 *                                          {job, user, name}: running jobs
 *   user_gpu_seconds_total, user_cpu_seconds_total,
 *   user_gpu_memory_byte_seconds_total, user_tokens_total   {user}
 * Label values are escaped as the format says (\\, \", \n): job names are
 * users' text.
 *
 * Not here: what the numbers mean (state/, the scheduler, the runners).
 * Loop thread only. */
#ifndef DAEMON_METRICS_H
#define DAEMON_METRICS_H

#include <stddef.h>
#include <uv.h>

#include "daemon/dispatch.h"
#include "proto/err.h"

/* The exposition now, into a new malloc'd NUL-terminated buffer (*len
 * without the NUL). TD_ENOMEM only: a source that cannot be read (the
 * database) leaves its families without samples and is logged. */
td_err dmn_metrics_render(const struct dmn_env *env, char **out, size_t *len, struct td_errbuf *eb);

/* Renders and writes to path as redis saves: PATH.tmp in the same dir,
 * fsync, rename over PATH, fsync the dir. Errors name the path. */
td_err dmn_metrics_write_textfile(const struct dmn_env *env, const char *path,
				  struct td_errbuf *eb);

/* The HTTP endpoint: GET /metrics on 127.0.0.1:port (loopback only: the
 * numbers name users and jobs), 404 for another path, 405 for another
 * method, one request per connection, at most 16 connections, each closed
 * after 5 s. env must outlive it. */
struct dmn_metrics_http;
td_err dmn_metrics_http_start(struct dmn_metrics_http **out, uv_loop_t *loop, int port,
			      const struct dmn_env *env, struct td_errbuf *eb);
/* close: stops listening and closes the connections (no wait; the loop
 * must then run); free after the loop has run: frees the rest. NULL is a
 * no-op for both. */
void dmn_metrics_http_close(struct dmn_metrics_http *h);
void dmn_metrics_http_free(struct dmn_metrics_http *h);

#endif
