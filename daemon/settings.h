/* traind's settings: one table (daemon/config.c) that the command line, the
 * environment, the config file, `traind --help` and `traind --dump-config`
 * all read.
 *
 * Each setting has a name (`cpu_slots`), a field of struct dmn_config, a
 * default, bounds, and whether SIGHUP may change it while the daemon runs.
 * Sources, lowest first: the default; the config file (`name = value` lines,
 * `#` comments); the environment (TRAIND_CPU_SLOTS); the command line
 * (`--cpu-slots 2` or `--cpu-slots=2`). Path settings whose default depends on
 * the mode (system service or user) are resolved last, from DESIGN.md's
 * default places, systemd's $STATE_DIRECTORY & co., and the XDG variables.
 *
 * This is not the daemon: nothing here opens a socket or a database. */
#ifndef DAEMON_SETTINGS_H
#define DAEMON_SETTINGS_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/err.h"

enum dmn_mode { DMN_MODE_AUTO, DMN_MODE_SYSTEM, DMN_MODE_USER };

/* Which running jobs a queued job that cannot fit may preempt (setting
 * preempt): none; its own user's of a lower priority; anyone's of a lower
 * priority. */
enum dmn_preempt { DMN_PREEMPT_OFF, DMN_PREEMPT_USER, DMN_PREEMPT_PRIORITY };

/* Where a setting's value came from (for the dump and the SIGHUP log). */
enum dmn_source { DMN_SRC_DEFAULT, DMN_SRC_FILE, DMN_SRC_ENV, DMN_SRC_FLAG };

#define DMN_NSETTINGS_MAX 32

struct dmn_config {
	/* immutable: read at start */
	int mode;                   /* enum dmn_mode; AUTO is resolved by dmn_config_load */
	char socket[108];           /* an AF_UNIX path (sun_path's size) */
	char state_dir[PATH_MAX];
	char cache_dir[PATH_MAX];
	long socket_mode;           /* octal; 0 = by mode (0666 system, 0600 user) */
	long rpc_contexts;          /* requests in flight at once */
	long max_request_bytes;
	char fake_gpus[1024];       /* testing: "uuid:bytes[,uuid:bytes]" */
	char fake_nvlink[256];      /* testing: "0+1,2+3": simulated GPUs joined by NVLink */
	/* mutable: SIGHUP reloads them */
	char admin_group[64];
	long cpu_slots;             /* CPU jobs at once */
	long max_running_per_user;  /* 0: no limit */
	long max_queued_per_user;   /* 0: no limit */
	double vram_factor;         /* the share of a GPU the ledger hands out */
	long cuda_context_mib;      /* per job on a real GPU, reserved on top of plan + backend */
	long pinned_host_max_mib;   /* pinned host memory of all running jobs; -1: half of RAM */
	long share_bases;           /* 1: LoRA jobs of the same base files share one copy */
	long shutdown_timeout_s;
	long tick_ms;
	long list_limit;            /* `trainctl ls` without a limit */
	char log_level[8];          /* err, warn, info, debug */
	long user_priority_max;     /* users' jobs: priority at most this (admins: any) */
	long usage_window_hours;    /* fair share and the quota count usage over this window */
	double quota_gpu_hours;     /* per user within the window; 0: no quota */
	int preempt;                /* enum dmn_preempt */
	long preempt_grace_s;       /* a preempted job is not preempted again within this */
	char metrics_textfile[PATH_MAX]; /* Prometheus exposition written each tick; "": none */
	long metrics_port;          /* immutable: 127.0.0.1:PORT/metrics; 0: none */
	char peer_listen[256];      /* immutable: "tcp://HOST:PORT" for other daemons; "": none */
	char peer_secret_file[PATH_MAX]; /* immutable: their shared secret (daemon/peers.h) */
	long peer_lease_ttl_s;      /* immutable: a peer's leases expire without a heartbeat */

	/* not settings: how this config came to be */
	char config_file[PATH_MAX]; /* "" if none was read */
	enum dmn_source src[DMN_NSETTINGS_MAX];
	char src_where[DMN_NSETTINGS_MAX][64]; /* "FILE:LINE", "TRAIND_X", "--x" */
};

/* Builds a config from the defaults, the config file, the environment and
 * args (argv-style, without the program name: the settings' flags plus
 * `--config FILE`, `--system`, `--user`). The config file is --config, else
 * $TRAIND_CONFIG, else the mode's default (TD_SYSCONFDIR/traind/traind.conf
 * for the system service, $XDG_CONFIG_HOME/traind/traind.conf for a user),
 * which may be absent. Errors name the source: "FILE:LINE: cpu_slots: 'x' is
 * not an integer", "--cpu-slots: 5000 is out of range 0 .. 1024",
 * "TRAIND_SOCKET: ...". TD_EINVAL for a bad value or an unknown name. */
td_err dmn_config_load(struct dmn_config *c, int argc, char **argv, struct td_errbuf *eb);

/* SIGHUP: loads again with the same args and copies the mutable settings into
 * live. An immutable setting that changed is left alone and named in a
 * warning ("needs a restart"). On error live is unchanged. */
td_err dmn_config_reload(struct dmn_config *live, int argc, char **argv, struct td_errbuf *eb);

/* `traind --dump-config`: every setting as `name = value` with its source,
 * in a form the config file accepts. */
void dmn_config_dump(const struct dmn_config *c, FILE *f);

/* The settings part of `traind --help`: flag, environment name, default,
 * bounds, mutability and a line of help per setting. */
void dmn_config_help(FILE *f);

/* "system" or "user". */
const char *dmn_mode_name(int mode);

/* The pinned host memory all running jobs may hold together: the
 * pinned_host_max_mib setting in bytes, or (-1) half of this host's physical
 * memory. */
uint64_t dmn_config_pinned_max(const struct dmn_config *cfg);

#endif
