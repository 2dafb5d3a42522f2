/* The settings table and its readers (daemon/settings.h).
 *
 * Adding a setting is one line in `settings[]` and a field in struct
 * dmn_config; the flag, the environment variable, the config-file key, --help
 * and --dump-config follow from the line. */
#include "daemon/settings.h"

#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "proto/log.h"
#include "proto/rpc.h"

enum stype { T_STR, T_PATH, T_INT, T_OCTAL, T_DBL, T_ENUM };

struct setting {
	const char *name;
	enum stype type;
	size_t off, size;
	const char *dflt; /* as text; "" for a path: resolved by mode */
	double min, max;  /* numbers: inclusive bounds */
	const char *choices; /* T_ENUM: comma-separated, the index is stored */
	bool mut;
	const char *help;
};

#define F(field) offsetof(struct dmn_config, field), sizeof(((struct dmn_config *)0)->field)
/* max_request_bytes' default, as text for the table. */
_Static_assert(RPC_MAX_REQUEST_BYTES == 1052672, "update max_request_bytes' default");

static const struct setting settings[] = {
	{"mode", T_ENUM, F(mode), "auto", 0, 0, "auto,system,user", false,
	 "system service or one user's daemon; auto: system when run as root"},
	{"socket", T_PATH, F(socket), "", 0, 0, NULL, false,
	 "the ipc socket (system: $RUNTIME_DIRECTORY/traind.sock or /run/traind/traind.sock; "
	 "user: $XDG_RUNTIME_DIR/traind.sock)"},
	{"state_dir", T_PATH, F(state_dir), "", 0, 0, NULL, false,
	 "the database and job logs (system: $STATE_DIRECTORY or /var/lib/traind; user: "
	 "$XDG_STATE_HOME/traind)"},
	{"cache_dir", T_PATH, F(cache_dir), "", 0, 0, NULL, false,
	 "compiled GPU modules (system: $CACHE_DIRECTORY or /var/cache/traind; user: "
	 "$XDG_CACHE_HOME/traind)"},
	{"socket_mode", T_OCTAL, F(socket_mode), "0", 0, 0777, NULL, false,
	 "the socket's permissions; 0: 0666 for the system service (identity comes from the "
	 "socket), 0600 for a user's daemon"},
	{"rpc_contexts", T_INT, F(rpc_contexts), "16", 1, 256, NULL, false,
	 "requests served at once"},
	{"max_request_bytes", T_INT, F(max_request_bytes), "1052672", 4096,
	 64 << 20, NULL, false, "larger requests get an error response"},
	{"fake_gpus", T_STR, F(fake_gpus), "", 0, 0, NULL, false,
	 "testing only: simulated GPUs 'uuid:bytes[,uuid:bytes...]' for the ledger and the "
	 "scheduler; their jobs run on the CPU backend"},
	{"fake_nvlink", T_STR, F(fake_nvlink), "", 0, 0, NULL, false,
	 "testing only: which simulated GPUs are joined by NVLink, as groups of their indices "
	 "'0+1,2+3' (a real GPU's links come from NVML)"},
	{"admin_group", T_STR, F(admin_group), "traind-admin", 0, 0, NULL, true,
	 "members see and cancel every job (root always does); empty: nobody but root"},
	{"cpu_slots", T_INT, F(cpu_slots), "1", 0, 1024, NULL, true,
	 "jobs running on the CPU backend at once; 0: none"},
	{"max_running_per_user", T_INT, F(max_running_per_user), "0", 0, 1000000, NULL, true,
	 "running jobs per user; 0: no limit"},
	{"max_queued_per_user", T_INT, F(max_queued_per_user), "1000", 0, 1000000, NULL, true,
	 "queued jobs per user; 0: no limit"},
	{"vram_factor", T_DBL, F(vram_factor), "0.9", 0.05, 1.0, NULL, true,
	 "the share of each GPU's memory the ledger hands out"},
	{"cuda_context_mib", T_INT, F(cuda_context_mib), "768", 0, 65536, NULL, true,
	 "MiB the ledger reserves for each job on a real GPU besides its memory plan and the "
	 "CUDA backend's fixed 36 MiB: the CUDA context's share (driver state, the kernel "
	 "module, cuBLAS's handle and lazily loaded kernels). Measured on an H200 with "
	 "driver 580 / CUDA 13: the whole process 650 MiB for a 21 MiB plan, i.e. ~593 MiB "
	 "of context and code; 768 leaves room for the cuBLAS kernels larger shapes load"},
	{"pinned_host_max_mib", T_INT, F(pinned_host_max_mib), "-1", -1, 1L << 40, NULL, true,
	 "MiB of pinned host memory the running jobs may hold together (memory.recompute "
	 "full-offload keeps each layer's checkpoint there): a job that needs more than is left "
	 "waits, memory.recompute AUTO chooses another policy, and one that needs more than the "
	 "whole fails; -1: half of this host's physical memory; 0: none (no job offloads)"},
	{"share_bases", T_INT, F(share_bases), "1", 0, 1, NULL, true,
	 "1: LoRA and QLoRA jobs on one GPU whose frozen base is the same files stored alike "
	 "share one read-only copy of it (the ledger holds it once, as a shared block; each "
	 "job's lease its own bytes); 0: every job holds its own (a job opts out with "
	 "memory.share_base: false)"},
	{"shutdown_timeout_s", T_INT, F(shutdown_timeout_s), "60", 1, 3600, NULL, true,
	 "on SIGTERM, how long running jobs get to checkpoint before the daemon exits"},
	{"tick_ms", T_INT, F(tick_ms), "1000", 50, 60000, NULL, true,
	 "housekeeping period: scheduling, lease reaping, watchdog"},
	{"list_limit", T_INT, F(list_limit), "200", 1, 100000, NULL, true,
	 "jobs `trainctl ls` shows when it asks for no limit"},
	{"log_level", T_ENUM, F(log_level), "info", 0, 0, "err,warn,info,debug", true,
	 "least important log level written"},
	{"user_priority_max", T_INT, F(user_priority_max), "100", -100, 100, NULL, true,
	 "the highest priority a user who is not an admin may give a job (at submit and with "
	 "`trainctl priority`); admins may use -100 .. 100"},
	{"usage_window_hours", T_INT, F(usage_window_hours), "168", 1, 87600, NULL, true,
	 "the window over which fair share and the quota count each user's usage (GPU and "
	 "CPU-slot seconds)"},
	{"quota_gpu_hours", T_DBL, F(quota_gpu_hours), "0", 0, 1e9, NULL, true,
	 "GPU-hours a user may use within usage_window_hours; a user at or over it gets no "
	 "job admitted until the window slides (running jobs go on); 0: no quota"},
	{"preempt", T_ENUM, F(preempt), "off", 0, 0, "off,user,priority", true,
	 "whether a queued job that cannot fit may stop running jobs of a lower priority to make "
	 "room (they checkpoint at their next step, go back to the queue and resume from that "
	 "checkpoint): off; user: only its own user's jobs; priority: anyone's"},
	{"preempt_grace_s", T_INT, F(preempt_grace_s), "300", 0, 604800, NULL, true,
	 "a job preempted is not preempted again within this many seconds (so that the queue "
	 "cannot thrash); 0: no grace"},
	{"metrics_textfile", T_PATH, F(metrics_textfile), "", 0, 0, NULL, true,
	 "Prometheus text exposition written here (atomically) every tick, for node_exporter's "
	 "textfile collector (name it *.prom); empty: not written"},
	{"metrics_port", T_INT, F(metrics_port), "0", 0, 65535, NULL, false,
	 "serve the Prometheus exposition at http://127.0.0.1:PORT/metrics (loopback only); "
	 "0: not served"},
	{"peer_listen", T_STR, F(peer_listen), "", 0, 0, NULL, false,
	 "take part in jobs across daemons (resources.hosts): listen for the other daemons at this "
	 "address, tcp://HOST:PORT (HOST one they reach; the job's gang hub listens there too, on a "
	 "free port); empty: no such jobs. Needs peer_secret_file"},
	{"peer_secret_file", T_PATH, F(peer_secret_file), "", 0, 0, NULL, false,
	 "the secret every daemon of a job across daemons shares (16 .. 4096 bytes; a file of the "
	 "daemon's own user, mode 0600): each request between daemons is signed with it"},
	{"peer_lease_ttl_s", T_INT, F(peer_lease_ttl_s), "60", 2, 3600, NULL, false,
	 "a peer's leases for a job across daemons expire, and its ranks stop, when the job's "
	 "coordinating daemon has not renewed them for this many seconds (it renews every quarter)"},
};
#define NSETTINGS (sizeof(settings) / sizeof(settings[0]))
_Static_assert(NSETTINGS <= DMN_NSETTINGS_MAX, "raise DMN_NSETTINGS_MAX");

const char *dmn_mode_name(int mode)
{
	return mode == DMN_MODE_SYSTEM ? "system" : mode == DMN_MODE_USER ? "user" : "auto";
}

/* The n-th comma-separated choice into buf. */
static const char *choice_at(const char *choices, int n, char *buf, size_t cap)
{
	const char *p = choices;
	for (int i = 0; i < n && p; i++) {
		p = strchr(p, ',');
		if (p)
			p++;
	}
	if (!p)
		return NULL;
	size_t len = strcspn(p, ",");
	if (len >= cap)
		len = cap - 1;
	memcpy(buf, p, len);
	buf[len] = 0;
	return buf;
}

static int choice_index(const char *choices, const char *v)
{
	char buf[32];
	for (int i = 0; choice_at(choices, i, buf, sizeof(buf)); i++)
		if (strcmp(buf, v) == 0)
			return i;
	return -1;
}

/* Parses text into the setting's field. where names the source for errors. */
static td_err set_value(struct dmn_config *c, const struct setting *s, const char *v,
			const char *where, struct td_errbuf *eb)
{
	char *field = (char *)c + s->off;
	char *end;
	switch (s->type) {
	case T_STR:
	case T_PATH: {
		size_t len = strlen(v);
		if (len >= s->size)
			return td_fail(eb, TD_EINVAL, "%s: %s: %zu bytes, longer than the %zu allowed",
				       where, s->name, len, s->size - 1);
		if (s->type == T_PATH && *v && *v != '/')
			return td_fail(eb, TD_EINVAL, "%s: %s: '%s' is not an absolute path", where,
				       s->name, v);
		memcpy(field, v, len + 1);
		return TD_OK;
	}
	case T_INT:
	case T_OCTAL: {
		errno = 0;
		long n = strtol(v, &end, s->type == T_OCTAL ? 8 : 10);
		if (!*v || *end || errno)
			return td_fail(eb, TD_EINVAL, "%s: %s: '%s' is not %s", where, s->name, v,
				       s->type == T_OCTAL ? "an octal number (like 0660)" : "an integer");
		if ((double)n < s->min || (double)n > s->max) {
			if (s->type == T_OCTAL)
				return td_fail(eb, TD_EINVAL, "%s: %s: %s is out of range %04o .. %04o",
					       where, s->name, v, (unsigned)s->min, (unsigned)s->max);
			return td_fail(eb, TD_EINVAL, "%s: %s: %s is out of range %.0f .. %.0f", where,
				       s->name, v, s->min, s->max);
		}
		*(long *)field = n;
		return TD_OK;
	}
	case T_DBL: {
		errno = 0;
		double d = strtod(v, &end);
		if (!*v || *end || errno || !isfinite(d))
			return td_fail(eb, TD_EINVAL, "%s: %s: '%s' is not a number", where, s->name, v);
		if (d < s->min || d > s->max)
			return td_fail(eb, TD_EINVAL, "%s: %s: %s is out of range %g .. %g", where,
				       s->name, v, s->min, s->max);
		*(double *)field = d;
		return TD_OK;
	}
	case T_ENUM: {
		int i = choice_index(s->choices, v);
		if (i < 0)
			return td_fail(eb, TD_EINVAL, "%s: %s: '%s' is not one of %s", where, s->name, v,
				       s->choices);
		if (s->size == sizeof(int))
			*(int *)field = i;
		else
			snprintf(field, s->size, "%s", v);
		return TD_OK;
	}
	}
	return TD_EINTERNAL;
}

static void format_value(const struct dmn_config *c, const struct setting *s, char *buf,
			 size_t cap)
{
	const char *field = (const char *)c + s->off;
	switch (s->type) {
	case T_STR:
	case T_PATH:
		snprintf(buf, cap, "%s", field);
		break;
	case T_INT:
		snprintf(buf, cap, "%ld", *(const long *)field);
		break;
	case T_OCTAL:
		snprintf(buf, cap, "%04lo", *(const long *)field);
		break;
	case T_DBL:
		snprintf(buf, cap, "%g", *(const double *)field);
		break;
	case T_ENUM:
		if (s->size == sizeof(int))
			choice_at(s->choices, *(const int *)field, buf, cap);
		else
			snprintf(buf, cap, "%s", field);
		break;
	}
}

static const struct setting *find_setting(const char *name, size_t len)
{
	for (size_t i = 0; i < NSETTINGS; i++)
		if (strlen(settings[i].name) == len && strncmp(settings[i].name, name, len) == 0)
			return &settings[i];
	return NULL;
}

static void note_source(struct dmn_config *c, const struct setting *s, enum dmn_source src,
			const char *where)
{
	size_t i = (size_t)(s - settings);
	c->src[i] = src;
	snprintf(c->src_where[i], sizeof(c->src_where[i]), "%s", where);
}

static char *trim(char *s)
{
	while (isspace((unsigned char)*s))
		s++;
	size_t n = strlen(s);
	while (n && isspace((unsigned char)s[n - 1]))
		s[--n] = 0;
	return s;
}

static td_err read_file(struct dmn_config *c, const char *path, bool must_exist,
			struct td_errbuf *eb)
{
	FILE *f = fopen(path, "re");
	if (!f) {
		if (errno == ENOENT && !must_exist)
			return TD_OK;
		return td_fail(eb, td_from_errno(errno), "%s: cannot read the config file: %s", path,
			       strerror(errno));
	}
	snprintf(c->config_file, sizeof(c->config_file), "%s", path);
	char line[4096];
	td_err e = TD_OK;
	for (int lineno = 1; e == TD_OK && fgets(line, sizeof(line), f); lineno++) {
		char where[64];
		snprintf(where, sizeof(where), "%s:%d", path, lineno);
		if (!strchr(line, '\n') && !feof(f)) {
			e = td_fail(eb, TD_EINVAL, "%s: line longer than %zu bytes", where, sizeof(line) - 2);
			break;
		}
		/* A comment is a line starting with '#', or the rest of a line
		 * after whitespace and '#' (how --dump-config annotates). */
		for (char *h = strchr(line, '#'); h; h = strchr(h + 1, '#')) {
			if (h == line || isspace((unsigned char)h[-1])) {
				*h = 0;
				break;
			}
		}
		char *p = trim(line);
		if (!*p)
			continue;
		char *eq = strchr(p, '=');
		if (!eq) {
			e = td_fail(eb, TD_EINVAL, "%s: expected 'name = value', got '%s'", where, p);
			break;
		}
		*eq = 0;
		char *name = trim(p), *val = trim(eq + 1);
		size_t vl = strlen(val);
		if (vl >= 2 && val[0] == '"' && val[vl - 1] == '"') {
			val[vl - 1] = 0;
			val++;
		}
		const struct setting *s = find_setting(name, strlen(name));
		if (!s) {
			e = td_fail(eb, TD_EINVAL, "%s: unknown setting '%s' (traind --help lists them)",
				    where, name);
			break;
		}
		if ((e = set_value(c, s, val, where, eb)) == TD_OK)
			note_source(c, s, DMN_SRC_FILE, where);
	}
	if (e == TD_OK && ferror(f))
		e = td_fail(eb, TD_EIO, "%s: read error", path);
	fclose(f);
	return e;
}

static void env_name(const struct setting *s, char *buf, size_t cap)
{
	size_t i = (size_t)snprintf(buf, cap, "TRAIND_");
	for (const char *p = s->name; *p && i + 1 < cap; p++)
		buf[i++] = (char)toupper((unsigned char)*p);
	buf[i] = 0;
}

static td_err read_env(struct dmn_config *c, struct td_errbuf *eb)
{
	for (size_t i = 0; i < NSETTINGS; i++) {
		char name[64];
		env_name(&settings[i], name, sizeof(name));
		const char *v = getenv(name);
		if (!v)
			continue;
		td_err e = set_value(c, &settings[i], v, name, eb);
		if (e != TD_OK)
			return e;
		note_source(c, &settings[i], DMN_SRC_ENV, name);
	}
	return TD_OK;
}

/* One pass over args. With apply false only --config/--system/--user/--mode
 * are looked at (they decide which file is read). */
static td_err read_args(struct dmn_config *c, int argc, char **argv, bool apply,
			const char **config_path, struct td_errbuf *eb)
{
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i];
		if (strncmp(a, "--", 2) != 0)
			return td_fail(eb, TD_EINVAL, "unexpected argument '%s' (traind --help)", a);
		if (strcmp(a, "--system") == 0 || strcmp(a, "--user") == 0) {
			c->mode = a[2] == 's' ? DMN_MODE_SYSTEM : DMN_MODE_USER;
			note_source(c, &settings[0], DMN_SRC_FLAG, a);
			continue;
		}
		const char *name = a + 2, *eqs = strchr(name, '=');
		size_t nlen = eqs ? (size_t)(eqs - name) : strlen(name);
		const char *val = eqs ? eqs + 1 : NULL;
		if (!val) {
			if (i + 1 >= argc)
				return td_fail(eb, TD_EINVAL, "%s: needs a value", a);
			val = argv[++i];
		}
		char key[64];
		if (nlen >= sizeof(key))
			return td_fail(eb, TD_EINVAL, "unknown option '%.*s' (traind --help)", (int)nlen, a);
		for (size_t k = 0; k < nlen; k++)
			key[k] = name[k] == '-' ? '_' : name[k];
		key[nlen] = 0;
		if (strcmp(key, "config") == 0) {
			*config_path = val;
			continue;
		}
		const struct setting *s = find_setting(key, nlen);
		if (!s)
			return td_fail(eb, TD_EINVAL, "unknown option '--%.*s' (traind --help lists them)",
				       (int)nlen, name);
		if (!apply && s != &settings[0])
			continue;
		char where[64];
		snprintf(where, sizeof(where), "--%.*s", (int)nlen, name);
		td_err e = set_value(c, s, val, where, eb);
		if (e != TD_OK)
			return e;
		note_source(c, s, DMN_SRC_FLAG, where);
	}
	return TD_OK;
}

/* The first path of a systemd *_DIRECTORY variable (they may list several). */
static bool systemd_dir(const char *var, const char *leaf, char *out, size_t cap)
{
	const char *v = getenv(var);
	if (!v || *v != '/')
		return false;
	size_t n = strcspn(v, ":");
	snprintf(out, cap, "%.*s%s%s", (int)n, v, leaf ? "/" : "", leaf ? leaf : "");
	return true;
}

static td_err xdg_dir(const char *var, const char *home_rel, char *out, size_t cap,
		      struct td_errbuf *eb)
{
	const char *v = getenv(var);
	if (v && *v == '/') {
		snprintf(out, cap, "%s/traind", v);
		return TD_OK;
	}
	const char *home = getenv("HOME");
	if (!home || *home != '/')
		return td_fail(eb, TD_EINVAL, "neither $%s nor $HOME is set: give the path with a flag",
			       var);
	snprintf(out, cap, "%s/%s/traind", home, home_rel);
	return TD_OK;
}

static td_err resolve_paths(struct dmn_config *c, struct td_errbuf *eb)
{
	td_err e = TD_OK;
	if (c->mode == DMN_MODE_SYSTEM) {
		if (!*c->socket && !systemd_dir("RUNTIME_DIRECTORY", "traind.sock", c->socket,
						sizeof(c->socket)))
			snprintf(c->socket, sizeof(c->socket), "/run/traind/traind.sock");
		if (!*c->state_dir &&
		    !systemd_dir("STATE_DIRECTORY", NULL, c->state_dir, sizeof(c->state_dir)))
			snprintf(c->state_dir, sizeof(c->state_dir), "/var/lib/traind");
		if (!*c->cache_dir &&
		    !systemd_dir("CACHE_DIRECTORY", NULL, c->cache_dir, sizeof(c->cache_dir)))
			snprintf(c->cache_dir, sizeof(c->cache_dir), "/var/cache/traind");
		if (!c->socket_mode)
			c->socket_mode = 0666;
	} else {
		if (!*c->socket) {
			const char *rt = getenv("XDG_RUNTIME_DIR");
			if (!rt || *rt != '/')
				return td_fail(eb, TD_EINVAL,
					       "socket: $XDG_RUNTIME_DIR is not set; give --socket PATH "
					       "or TRAIND_SOCKET");
			if ((size_t)snprintf(c->socket, sizeof(c->socket), "%s/traind.sock", rt) >=
			    sizeof(c->socket))
				return td_fail(eb, TD_EINVAL,
					       "socket: $XDG_RUNTIME_DIR/traind.sock is longer than %zu "
					       "bytes; give a shorter --socket",
					       sizeof(c->socket) - 1);
		}
		if (!*c->state_dir)
			e = xdg_dir("XDG_STATE_HOME", ".local/state", c->state_dir, sizeof(c->state_dir), eb);
		if (e == TD_OK && !*c->cache_dir)
			e = xdg_dir("XDG_CACHE_HOME", ".cache", c->cache_dir, sizeof(c->cache_dir), eb);
		if (!c->socket_mode)
			c->socket_mode = 0600;
	}
	return e;
}

td_err dmn_config_load(struct dmn_config *c, int argc, char **argv, struct td_errbuf *eb)
{
	memset(c, 0, sizeof(*c));
	for (size_t i = 0; i < NSETTINGS; i++) {
		td_err e = set_value(c, &settings[i], settings[i].dflt, "default", eb);
		if (e != TD_OK)
			return e; /* a bug in the table */
	}
	/* Which file, and the mode that decides its default, come first. */
	const char *config_path = NULL;
	td_err e = read_args(c, argc, argv, false, &config_path, eb);
	if (e != TD_OK)
		return e;
	const char *envmode = getenv("TRAIND_MODE");
	if (envmode && c->src[0] != DMN_SRC_FLAG && (e = set_value(c, &settings[0], envmode, "TRAIND_MODE", eb)))
		return e;
	if (c->mode == DMN_MODE_AUTO)
		c->mode = geteuid() == 0 ? DMN_MODE_SYSTEM : DMN_MODE_USER;
	int mode = c->mode;

	bool must_exist = true;
	char defpath[PATH_MAX];
	if (!config_path)
		config_path = getenv("TRAIND_CONFIG");
	if (!config_path) {
		must_exist = false;
		if (mode == DMN_MODE_SYSTEM) {
			snprintf(defpath, sizeof(defpath), "%s/traind/traind.conf", TD_SYSCONFDIR);
		} else {
			const char *x = getenv("XDG_CONFIG_HOME"), *home = getenv("HOME");
			if (x && *x == '/')
				snprintf(defpath, sizeof(defpath), "%s/traind/traind.conf", x);
			else if (home && *home == '/')
				snprintf(defpath, sizeof(defpath), "%s/.config/traind/traind.conf", home);
			else
				defpath[0] = 0;
		}
		config_path = defpath[0] ? defpath : NULL;
	}
	if (config_path && (e = read_file(c, config_path, must_exist, eb)) != TD_OK)
		return e;
	if ((e = read_env(c, eb)) != TD_OK)
		return e;
	if ((e = read_args(c, argc, argv, true, &config_path, eb)) != TD_OK)
		return e;
	if (c->mode == DMN_MODE_AUTO)
		c->mode = geteuid() == 0 ? DMN_MODE_SYSTEM : DMN_MODE_USER;
	if (c->mode != mode)
		return td_fail(eb, TD_EINVAL,
			       "mode: set to %s in the config file, but the file was chosen for %s "
			       "mode; give --system or --user",
			       dmn_mode_name(c->mode), dmn_mode_name(mode));
	return resolve_paths(c, eb);
}

td_err dmn_config_reload(struct dmn_config *live, int argc, char **argv, struct td_errbuf *eb)
{
	struct dmn_config *next = malloc(sizeof(*next));
	if (!next)
		return td_fail(eb, TD_ENOMEM, "config reload: out of memory");
	td_err e = dmn_config_load(next, argc, argv, eb);
	if (e != TD_OK) {
		free(next);
		return e;
	}
	for (size_t i = 0; i < NSETTINGS; i++) {
		const struct setting *s = &settings[i];
		char *dst = (char *)live + s->off;
		const char *src = (const char *)next + s->off;
		if (memcmp(dst, src, s->size) == 0)
			continue;
		char was[256], now[256];
		format_value(live, s, was, sizeof(was));
		format_value(next, s, now, sizeof(now));
		if (!s->mut) {
			td_warn("TD-CONFIG-RESTART", "%s: %s -> %s needs a restart; keeping %s", s->name,
				was, now, was);
			continue;
		}
		memcpy(dst, src, s->size);
		live->src[i] = next->src[i];
		memcpy(live->src_where[i], next->src_where[i], sizeof(live->src_where[i]));
		td_info("TD-CONFIG-SET", "%s: %s -> %s (%s)", s->name, was, now, next->src_where[i]);
	}
	free(next);
	return TD_OK;
}

void dmn_config_dump(const struct dmn_config *c, FILE *f)
{
	fprintf(f, "# traind %s settings (%s mode)%s%s\n", TD_VERSION, dmn_mode_name(c->mode),
		c->config_file[0] ? "; config file " : "; no config file", c->config_file);
	for (size_t i = 0; i < NSETTINGS; i++) {
		char v[1100];
		format_value(c, &settings[i], v, sizeof(v));
		const char *src = c->src[i] == DMN_SRC_DEFAULT ? "default" : c->src_where[i];
		fprintf(f, "%-22s = %-28s # %s%s\n", settings[i].name, v, src,
			settings[i].mut ? "" : ", restart to change");
	}
}

void dmn_config_help(FILE *f)
{
	fprintf(f, "Settings (flag --NAME VALUE, environment TRAIND_NAME, config file 'name = value';\n"
		   "flags win over the environment, which wins over the file; [hup]: SIGHUP reloads it):\n");
	for (size_t i = 0; i < NSETTINGS; i++) {
		const struct setting *s = &settings[i];
		char flag[64], env[64], bounds[96] = "";
		snprintf(flag, sizeof(flag), "--%s", s->name);
		for (char *p = flag; *p; p++)
			if (*p == '_')
				*p = '-';
		env_name(s, env, sizeof(env));
		if (s->type == T_INT)
			snprintf(bounds, sizeof(bounds), ", %.0f..%.0f", s->min, s->max);
		else if (s->type == T_DBL)
			snprintf(bounds, sizeof(bounds), ", %g..%g", s->min, s->max);
		else if (s->type == T_ENUM)
			snprintf(bounds, sizeof(bounds), ", one of %s", s->choices);
		fprintf(f, "  %-24s %s (default %s%s)%s\n      %s\n", flag, env,
			*s->dflt ? s->dflt : "by mode", bounds, s->mut ? " [hup]" : "", s->help);
	}
}

uint64_t dmn_config_pinned_max(const struct dmn_config *cfg)
{
	if (cfg->pinned_host_max_mib >= 0)
		return (uint64_t)cfg->pinned_host_max_mib << 20;
	const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGESIZE);
	return pages > 0 && size > 0 ? (uint64_t)pages * (uint64_t)size / 2 : 0;
}
