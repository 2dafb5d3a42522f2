/* trainctl: queue, follow and manage training jobs on a traind daemon.
 *
 * Each command is one line of `commands[]`; each sends one or more
 * traind.Requests and prints the responses. Errors are one line on stderr
 * ("trainctl: what happened; what to do") and an exit code from enum ctl_exit.
 * Not here: anything the daemon decides (permissions, scheduling). */
#include "client/ctl.h"

#include "config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include "proto/jobspec.h"

#define WATCH_POLL_MS 500

struct opts {
	const char *socket;
	bool json;
	int timeout_ms;
	int reconnect_s; /* watch, logs --follow: how long to wait for a daemon that went away */
};

static const char *prog = "trainctl";

static int cmd_watch(const struct opts *o, int argc, char **argv);

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "%s: ", prog);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	return code;
}

/* ------------------------------------------------------------------------ */
/* Calling the daemon */

/* Connects, calls, and turns a failed status into a message and exit code.
 * On CTL_OK *resp holds the response. */
static int call(const struct opts *o, Traind__Request *req, Traind__Response **resp)
{
	char sock[256];
	const char *path = o->socket ? o->socket : ctl_default_socket(sock, sizeof(sock));
	struct ctl_conn *c = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = ctl_connect(&c, path, o->timeout_ms, &eb);
	if (e != TD_OK)
		return fail(CTL_NODAEMON, "%s", eb.msg);
	e = ctl_call(c, req, resp, &eb);
	ctl_close(c);
	if (e != TD_OK)
		return fail(CTL_NODAEMON, "%s", eb.msg);
	if ((*resp)->status != TD_OK) {
		int code = ctl_exit_for((td_err)(*resp)->status);
		fail(code, "%s", (*resp)->message && *(*resp)->message ? (*resp)->message
								     : td_strerror((td_err)(*resp)->status));
		rpc_response_free(*resp);
		*resp = NULL;
		return code;
	}
	return CTL_OK;
}

/* One connection reused across polls (watch, logs). */
static int call_on(struct ctl_conn *c, Traind__Request *req, Traind__Response **resp)
{
	struct td_errbuf eb = {{0}};
	td_err e = ctl_call(c, req, resp, &eb);
	if (e != TD_OK)
		return fail(CTL_NODAEMON, "%s", eb.msg);
	if ((*resp)->status != TD_OK) {
		int code = ctl_exit_for((td_err)(*resp)->status);
		fail(code, "%s", (*resp)->message ? (*resp)->message : td_strerror((td_err)(*resp)->status));
		rpc_response_free(*resp);
		*resp = NULL;
		return code;
	}
	return CTL_OK;
}

/* ------------------------------------------------------------------------ */
/* Formatting */

static const char *user_name(uint32_t uid, char *buf, size_t cap)
{
	struct passwd pw, *pwp = NULL;
	char tmp[4096];
	if (getpwuid_r((uid_t)uid, &pw, tmp, sizeof(tmp), &pwp) == 0 && pwp)
		snprintf(buf, cap, "%s", pwp->pw_name);
	else
		snprintf(buf, cap, "%u", uid);
	return buf;
}

static const char *fmt_bytes(uint64_t b, char *buf, size_t cap)
{
	const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
	double v = (double)b;
	int i = 0;
	while (v >= 1024 && i < 4) {
		v /= 1024;
		i++;
	}
	snprintf(buf, cap, i ? "%.1f %s" : "%.0f %s", v, u[i]);
	return buf;
}

static const char *fmt_time(double t, char *buf, size_t cap)
{
	if (t <= 0) {
		snprintf(buf, cap, "-");
		return buf;
	}
	time_t s = (time_t)t;
	struct tm tm;
	localtime_r(&s, &tm);
	strftime(buf, cap, "%Y-%m-%d %H:%M:%S", &tm);
	return buf;
}

static const char *fmt_dur(double s, char *buf, size_t cap)
{
	if (!isfinite(s) || s < 0) {
		snprintf(buf, cap, "?");
		return buf;
	}
	long t = (long)(s + 0.5);
	if (t >= 3600)
		snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
	else
		snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60);
	return buf;
}

static const char *state_name(const Traind__JobInfo *j)
{
	return rpc_job_state_name(j->has_state ? j->state : TRAIND__JOB_STATE__JOB_STATE_UNSPECIFIED);
}

static const char *fmt_progress(const Traind__JobInfo *j, char *buf, size_t cap)
{
	if (j->has_step && j->has_total_steps)
		snprintf(buf, cap, "%llu/%llu", (unsigned long long)j->step,
			 (unsigned long long)j->total_steps);
	else if (j->has_step)
		snprintf(buf, cap, "%llu", (unsigned long long)j->step);
	else if (j->has_total_steps)
		snprintf(buf, cap, "-/%llu", (unsigned long long)j->total_steps);
	else
		snprintf(buf, cap, "-");
	return buf;
}

static void print_job(const Traind__JobInfo *j)
{
	char a[64], b[64];
	printf("id:          %llu\n", (unsigned long long)j->id);
	printf("name:        %s\n", j->name ? j->name : "");
	printf("user:        %s (uid %u, gid %u)\n", user_name(j->uid, a, sizeof(a)), j->uid, j->gid);
	printf("state:       %s%s%s\n", state_name(j), j->cancel_requested ? " (cancel requested)" : "",
	       j->held ? " (held)" : "");
	if (j->reason && *j->reason)
		printf("reason:      %s\n", j->reason);
	if (j->waiting && *j->waiting)
		printf("waiting:     %s\n", j->waiting);
	if (j->n_after) {
		printf("after:      ");
		for (size_t i = 0; i < j->n_after; i++)
			printf(" %llu", (unsigned long long)j->after[i]);
		printf(" (starts once these succeeded)\n");
	}
	printf("priority:    %d\n", j->priority);
	if (j->has_method)
		printf("method:      %s\n", rpc_method_name(j->method));
	if (j->model_dir)
		printf("model:       %s\n", j->model_dir);
	if (j->output_dir)
		printf("output:      %s\n", j->output_dir);
	if (j->device && *j->device)
		printf("device:      %s\n", j->device);
	if (j->spec && j->spec->resources && j->spec->resources->gpus > 1)
		printf("gpus:        %u (a gang: all at once or none; data parallel, a rank on each)\n",
		       j->spec->resources->gpus);
	if (j->spec && j->spec->resources && j->spec->resources->n_hosts) {
		const Traind__Resources *r = j->spec->resources;
		for (size_t i = 0; i < r->n_hosts; i++)
			printf("%s %s (ranks %u to %u)\n", i ? "            " : "hosts:      ", r->hosts[i],
			       r->gpus * (unsigned)(i + 1), r->gpus * (unsigned)(i + 2) - 1);
	}
	for (size_t i = 0; i < j->n_leases; i++) {
		const Traind__Lease *l = j->leases[i];
		char b[32];
		printf("%s lease %llu on %s, %s\n", i ? "            " : "leases:     ",
		       (unsigned long long)l->id, l->gpu ? l->gpu : "", fmt_bytes(l->bytes, b, sizeof(b)));
	}
	printf("progress:    %s", fmt_progress(j, a, sizeof(a)));
	if (j->has_loss)
		printf("  loss %.4f", j->loss);
	if (j->has_lr)
		printf("  lr %.3e", j->lr);
	if (j->has_tokens_per_s)
		printf("  %.0f tok/s", j->tokens_per_s);
	if (j->has_eta_s && !rpc_job_state_final(j->state))
		printf("  eta %s", fmt_dur(j->eta_s, b, sizeof(b)));
	printf("\n");
	if (j->checkpoint && *j->checkpoint)
		printf("checkpoint:  %s\n", j->checkpoint);
	printf("attempts:    %u\n", j->attempts);
	if (j->usage) {
		const Traind__Usage *u = j->usage;
		char q[32], r[32];
		printf("usage:       %.3f GPU-h, %.3f GiB-h of GPU memory, %.3f CPU-slot-h, %llu tokens; "
		       "queued %s, running %s\n",
		       u->gpu_s / 3600, u->gpu_mem_byte_s / 3600 / (1 << 30), u->cpu_s / 3600,
		       (unsigned long long)u->tokens, fmt_dur(u->queued_s, q, sizeof(q)),
		       fmt_dur(u->running_s, r, sizeof(r)));
	}
	printf("submitted:   %s\n", fmt_time(j->submit_time, a, sizeof(a)));
	if (j->has_start_time)
		printf("started:     %s\n", fmt_time(j->start_time, a, sizeof(a)));
	if (j->has_end_time)
		printf("ended:       %s\n", fmt_time(j->end_time, a, sizeof(a)));
	if (j->spec) {
		printf("spec:\n");
		fflush(stdout);
		rpc_jobspec_print(j->spec, stdout);
	}
}

static int print_result(const struct opts *o, const ProtobufCMessage *m, void (*human)(const void *))
{
	if (o->json) {
		struct json_object *js = ctl_json(m);
		ctl_json_print(stdout, js, true);
		json_object_put(js);
	} else {
		human(m);
	}
	return CTL_OK;
}

static void human_job(const void *m)
{
	print_job(m);
}

/* ------------------------------------------------------------------------ */
/* Arguments */

static bool parse_u64(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!s || !*s || *s == '-')
		return false;
	unsigned long long v = strtoull(s, &end, 10);
	if (*end || errno)
		return false;
	*out = v;
	return true;
}

static bool parse_bytes(const char *s, uint64_t *out)
{
	char *end;
	errno = 0;
	if (!s || !*s || *s == '-')
		return false;
	double v = strtod(s, &end);
	if (end == s || errno || !(v > 0))
		return false;
	while (*end == ' ')
		end++;
	double mul = 1;
	if (*end) {
		switch (*end) {
		case 'K': case 'k': mul = 1024.0; break;
		case 'M': mul = 1024.0 * 1024; break;
		case 'G': mul = 1024.0 * 1024 * 1024; break;
		case 'T': mul = 1024.0 * 1024 * 1024 * 1024; break;
		case 'B': break;
		default: return false;
		}
		end++;
		if (*end && strcmp(end, "iB") != 0 && strcmp(end, "B") != 0)
			return false;
	}
	v *= mul;
	if (v >= 18446744073709551615.0)
		return false;
	*out = (uint64_t)v;
	return true;
}

static bool job_id_arg(const char *s, uint64_t *id)
{
	return parse_u64(s, id) && *id > 0;
}

/* ------------------------------------------------------------------------ */
/* submit */

static char *absolute(const char *p)
{
	if (!p || !*p || *p == '/')
		return p ? strdup(p) : NULL;
	char cwd[PATH_MAX];
	if (!getcwd(cwd, sizeof(cwd)))
		return NULL;
	while (p[0] == '.' && p[1] == '/')
		p += 2;
	size_t n = strlen(cwd) + strlen(p) + 2;
	char *r = malloc(n);
	if (r)
		snprintf(r, n, "%s/%s", strcmp(cwd, "/") == 0 ? "" : cwd, p);
	return r;
}

static bool make_abs(char **field)
{
	if (!*field || **field == '/')
		return true;
	char *a = absolute(*field);
	if (!a)
		return false;
	/* None of the path fields has a default: the old string is malloc'd. */
	free(*field);
	*field = a;
	return true;
}

#define SUBMSG(parent, field, type, init)                     \
	do {                                                  \
		if (!(parent)->field) {                       \
			(parent)->field = malloc(sizeof(type)); \
			if (!(parent)->field)                 \
				return false;                 \
			init((parent)->field);                \
		}                                             \
	} while (0)

static bool ensure_sections(Traind__JobSpec *s)
{
	SUBMSG(s, data, Traind__DataSpec, traind__data_spec__init);
	SUBMSG(s, hyper, Traind__Hyper, traind__hyper__init);
	SUBMSG(s, output, Traind__OutputSpec, traind__output_spec__init);
	SUBMSG(s, resources, Traind__Resources, traind__resources__init);
	SUBMSG(s, memory, Traind__MemorySpec, traind__memory_spec__init);
	return true;
}

static bool set_str(char **field, const char *v)
{
	char *d = strdup(v);
	if (!d)
		return false;
	/* Only fields without a [default] come here: the old string, if
	 * any, is malloc'd (from unpack or from here). */
	free(*field);
	*field = d;
	return true;
}

static int cmd_submit(const struct opts *o, int argc, char **argv)
{
	const char *file = NULL;
	bool watch = false, hold = false;
	uint64_t after[64];
	size_t nafter = 0;
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = {{0}};
	/* The job file first, so that flags override it. */
	for (int i = 0; i < argc; i++) {
		if (argv[i][0] != '-') {
			if (file)
				return fail(CTL_USAGE, "submit: more than one job file ('%s', '%s')", file, argv[i]);
			file = argv[i];
		} else if (i + 1 < argc && strcmp(argv[i], "--watch") != 0 &&
			   strcmp(argv[i], "--hold") != 0) {
			i++;
		}
	}
	if (file) {
		if (rpc_jobspec_load(&s, file, &eb) != TD_OK)
			return fail(CTL_USAGE, "%s", eb.msg);
	} else if (!(s = rpc_jobspec_new())) {
		return fail(CTL_FAILED, "out of memory");
	}
	int rc = CTL_OK;
	if (!ensure_sections(s)) {
		rc = fail(CTL_FAILED, "out of memory");
		goto out;
	}
	for (int i = 0; i < argc && rc == CTL_OK; i++) {
		const char *a = argv[i];
		if (a[0] != '-')
			continue;
		if (strcmp(a, "--watch") == 0) {
			watch = true;
			continue;
		}
		if (strcmp(a, "--hold") == 0) {
			hold = true;
			continue;
		}
		if (i + 1 >= argc) {
			rc = fail(CTL_USAGE, "submit: %s needs a value", a);
			break;
		}
		const char *v = argv[++i];
		uint64_t u;
		char *end;
		bool ok = true;
		if (strcmp(a, "--model") == 0) {
			ok = set_str(&s->model_dir, v);
		} else if (strcmp(a, "--data") == 0) {
			ok = set_str(&s->data->train_file, v);
		} else if (strcmp(a, "--eval") == 0) {
			ok = set_str(&s->data->eval_file, v);
		} else if (strcmp(a, "--output") == 0) {
			ok = set_str(&s->output->dir, v);
		} else if (strcmp(a, "--name") == 0) {
			ok = set_str(&s->name, v);
		} else if (strcmp(a, "--method") == 0) {
			Traind__Method m;
			if (rpc_method_from_name(v, &m) != TD_OK) {
				rc = fail(CTL_USAGE, "submit: --method %s: expected full, lora, qlora, distill or classify", v);
				break;
			}
			s->has_method = true;
			s->method = m;
		} else if (strcmp(a, "--steps") == 0 && (ok = parse_u64(v, &u))) {
			s->hyper->has_max_steps = true;
			s->hyper->max_steps = u;
		} else if (strcmp(a, "--lr") == 0) {
			double d = strtod(v, &end);
			if ((ok = *v && !*end)) {
				s->hyper->has_lr = true;
				s->hyper->lr = d;
			}
		} else if (strcmp(a, "--batch") == 0 && (ok = parse_u64(v, &u) && u <= UINT32_MAX)) {
			s->hyper->has_micro_batch = true;
			s->hyper->micro_batch = (uint32_t)u;
		} else if (strcmp(a, "--grad-accum") == 0 && (ok = parse_u64(v, &u) && u >= 1 && u <= UINT32_MAX)) {
			s->hyper->has_grad_accum = true;
			s->hyper->grad_accum = (uint32_t)u;
		} else if (strcmp(a, "--seq-len") == 0 && (ok = parse_u64(v, &u) && u <= UINT32_MAX)) {
			s->data->has_seq_len = true;
			s->data->seq_len = (uint32_t)u;
		} else if (strcmp(a, "--checkpoint-every") == 0 && (ok = parse_u64(v, &u))) {
			s->output->has_checkpoint_every = true;
			s->output->checkpoint_every = u;
		} else if (strcmp(a, "--priority") == 0) {
			long p = strtol(v, &end, 10);
			if ((ok = *v && !*end && p >= INT32_MIN && p <= INT32_MAX)) {
				s->resources->has_priority = true;
				s->resources->priority = (int32_t)p;
			}
		} else if (strcmp(a, "--recompute") == 0) {
			static const struct { const char *name; Traind__Recompute r; } rc_names[] = {
				{"auto", TRAIND__RECOMPUTE__RECOMPUTE_AUTO},
				{"none", TRAIND__RECOMPUTE__RECOMPUTE_NONE},
				{"selective", TRAIND__RECOMPUTE__RECOMPUTE_SELECTIVE},
				{"full", TRAIND__RECOMPUTE__RECOMPUTE_FULL},
				{"full-offload", TRAIND__RECOMPUTE__RECOMPUTE_FULL_OFFLOAD},
			};
			ok = false;
			for (size_t k = 0; k < sizeof(rc_names) / sizeof(rc_names[0]); k++)
				if (strcasecmp(v, rc_names[k].name) == 0) {
					s->memory->has_recompute = true;
					s->memory->recompute = rc_names[k].r;
					ok = true;
				}
		} else if (strcmp(a, "--shard") == 0) {
			static const struct { const char *name; Traind__Shard v; } sh_names[] = {
				{"auto", TRAIND__SHARD__SHARD_AUTO},
				{"none", TRAIND__SHARD__SHARD_NONE},
				{"optimizer", TRAIND__SHARD__SHARD_OPTIMIZER},
				{"gradients", TRAIND__SHARD__SHARD_GRADIENTS},
				{"parameters", TRAIND__SHARD__SHARD_PARAMETERS},
			};
			ok = false;
			for (size_t k = 0; k < sizeof(sh_names) / sizeof(sh_names[0]); k++)
				if (strcasecmp(v, sh_names[k].name) == 0) {
					s->memory->has_shard = true;
					s->memory->shard = sh_names[k].v;
					ok = true;
				}
		} else if (strcmp(a, "--selective-layers") == 0 &&
			   (ok = parse_u64(v, &u) && u <= UINT32_MAX)) {
			s->memory->has_selective_layers = true;
			s->memory->selective_layers = (uint32_t)u;
		} else if (strcmp(a, "--max-memory") == 0 && (ok = parse_bytes(v, &u))) {
			s->memory->has_max_bytes = true;
			s->memory->max_bytes = u;
		} else if (strcmp(a, "--gpus") == 0 && (ok = parse_u64(v, &u) && u >= 1 && u <= UINT32_MAX)) {
			s->resources->has_gpus = true;
			s->resources->gpus = (uint32_t)u;
		} else if (strcmp(a, "--hosts") == 0) {
			/* ADDR[,ADDR...]: replaces resources.hosts ("" clears it) */
			Traind__Resources *r = s->resources;
			for (size_t k = 0; k < r->n_hosts; k++)
				free(r->hosts[k]);
			free(r->hosts);
			r->hosts = NULL;
			r->n_hosts = 0;
			size_t cap = 1;
			for (const char *c = v; *c; c++)
				cap += *c == ',';
			r->hosts = *v ? calloc(cap, sizeof(char *)) : NULL;
			ok = !*v || r->hosts;
			char *buf = strdup(v), *save = NULL;
			ok = ok && buf;
			for (char *t = buf ? strtok_r(buf, ",", &save) : NULL; t && ok;
			     t = strtok_r(NULL, ",", &save))
				ok = (r->hosts[r->n_hosts++] = strdup(t)) != NULL;
			free(buf);
		} else if (strcmp(a, "--after") == 0) {
			/* ID[,ID...], each a job id */
			char buf[1024];
			snprintf(buf, sizeof(buf), "%s", v);
			char *save = NULL;
			for (char *t = strtok_r(buf, ",", &save); t && ok; t = strtok_r(NULL, ",", &save)) {
				if (nafter == sizeof(after) / sizeof(after[0])) {
					rc = fail(CTL_USAGE, "submit: --after: more than %zu jobs",
						  sizeof(after) / sizeof(after[0]));
					break;
				}
				ok = job_id_arg(t, &after[nafter]);
				nafter += ok;
			}
			ok = ok && nafter > 0;
		} else if (strcmp(a, "--device") == 0) {
			s->resources->has_device = true;
			if (strcasecmp(v, "cpu") == 0)
				s->resources->device = TRAIND__DEVICE__DEVICE_CPU;
			else if (strcasecmp(v, "gpu") == 0)
				s->resources->device = TRAIND__DEVICE__DEVICE_GPU;
			else if (strcasecmp(v, "any") == 0)
				s->resources->device = TRAIND__DEVICE__DEVICE_ANY;
			else
				ok = false;
		} else if (strncmp(a, "--", 2) == 0 && (strcmp(a, "--steps") == 0 || strcmp(a, "--batch") == 0 ||
							 strcmp(a, "--seq-len") == 0 ||
							 strcmp(a, "--checkpoint-every") == 0)) {
			ok = false;
		} else {
			rc = fail(CTL_USAGE, "submit: unknown option '%s' (trainctl help)", a);
			break;
		}
		if (!ok && rc == CTL_OK)
			rc = fail(CTL_USAGE, "submit: %s: '%s' is not a valid value", a, v);
	}
	if (rc != CTL_OK)
		goto out;
	if (!file && !s->model_dir)
		rc = fail(CTL_USAGE, "submit: give a job file (job.pb or job.txtpb) or at least --model DIR "
				     "--data FILE --output DIR");
	/* The daemon cannot know this shell's directory: paths go absolute. */
	if (rc == CTL_OK &&
	    (!make_abs(&s->model_dir) || !make_abs(&s->data->train_file) || !make_abs(&s->data->eval_file) ||
	     !make_abs(&s->output->dir) || (s->lora && !make_abs(&s->lora->init_adapter)) ||
	     (s->distill && !make_abs(&s->distill->teacher_dir))))
		rc = fail(CTL_FAILED, "cannot make the paths absolute: %s", strerror(errno));
	if (rc == CTL_OK && (rpc_jobspec_apply_defaults(s, &eb) != TD_OK || rpc_jobspec_validate(s, &eb) != TD_OK))
		rc = fail(CTL_USAGE, "%s%s%s", file ? file : "", file ? ": " : "", eb.msg);
	if (rc != CTL_OK)
		goto out;

	Traind__Request req = TRAIND__REQUEST__INIT;
	Traind__SubmitRequest sr = TRAIND__SUBMIT_REQUEST__INIT;
	sr.spec = s;
	sr.after = after;
	sr.n_after = nafter;
	if (hold)
		sr.has_hold = sr.hold = true;
	req.call_case = TRAIND__REQUEST__CALL_SUBMIT;
	req.submit = &sr;
	Traind__Response *resp = NULL;
	if ((rc = call(o, &req, &resp)) != CTL_OK)
		goto out;
	uint64_t id = resp->job ? resp->job->id : 0;
	if (o->json)
		print_result(o, &resp->job->base, human_job);
	else if (!watch)
		printf("%llu\n", (unsigned long long)id);
	else
		printf("job %llu submitted\n", (unsigned long long)id);
	rpc_response_free(resp);
	if (watch) {
		char idbuf[32];
		snprintf(idbuf, sizeof(idbuf), "%llu", (unsigned long long)id);
		char *wargv[] = {idbuf};
		rc = cmd_watch(o, 1, wargv);
	}
out:
	rpc_jobspec_free(s);
	return rc;
}

/* ------------------------------------------------------------------------ */
/* ls, show, cancel */

static int cmd_ls(const struct opts *o, int argc, char **argv)
{
	Traind__ListRequest lr = TRAIND__LIST_REQUEST__INIT;
	for (int i = 0; i < argc; i++) {
		uint64_t u;
		if (strcmp(argv[i], "--all") == 0 || strcmp(argv[i], "-a") == 0) {
			lr.has_all = lr.all = true;
		} else if (strcmp(argv[i], "--limit") == 0 && i + 1 < argc && parse_u64(argv[i + 1], &u) &&
			   u <= UINT32_MAX) {
			lr.has_limit = true;
			lr.limit = (uint32_t)u;
			i++;
		} else {
			return fail(CTL_USAGE, "ls: unknown argument '%s' (ls [--all] [--limit N])", argv[i]);
		}
	}
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_LIST;
	req.list = &lr;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	const Traind__JobList *l = resp->list;
	size_t n = l ? l->n_jobs : 0;
	if (o->json) {
		struct json_object *arr = json_object_new_array();
		for (size_t i = 0; i < n; i++)
			json_object_array_add(arr, ctl_json(&l->jobs[i]->base));
		ctl_json_print(stdout, arr, true);
		json_object_put(arr);
	} else if (!n) {
		printf("no jobs%s\n", lr.all ? "" : " (of yours; --all lists everyone's, for admins)");
	} else {
		printf("%-6s %-24s %-10s %-11s %-13s %-10s %-19s %s\n", "ID", "NAME", "USER", "STATE",
		       "STEP", "LOSS", "SUBMITTED", "DEVICE, OR WHY IT WAITS");
		for (size_t i = 0; i < n; i++) {
			const Traind__JobInfo *j = l->jobs[i];
			char u[64], p[64], t[64], loss[32] = "-";
			if (j->has_loss)
				snprintf(loss, sizeof(loss), "%.4f", j->loss);
			printf("%-6llu %-24.24s %-10.10s %-11s %-13s %-10s %-19s %s\n",
			       (unsigned long long)j->id, j->name ? j->name : "", user_name(j->uid, u, sizeof(u)),
			       state_name(j), fmt_progress(j, p, sizeof(p)), loss,
			       fmt_time(j->submit_time, t, sizeof(t)),
			       j->device && *j->device ? j->device
			       : j->waiting && *j->waiting ? j->waiting
							   : "-");
		}
	}
	rpc_response_free(resp);
	return CTL_OK;
}

static int job_call(const struct opts *o, const char *cmd, int argc, char **argv,
		    Traind__Request__CallCase which)
{
	uint64_t id;
	if (argc != 1 || !job_id_arg(argv[0], &id))
		return fail(CTL_USAGE, "%s: give one job id (`trainctl ls` lists them)", cmd);
	Traind__JobRef ref = TRAIND__JOB_REF__INIT;
	ref.has_id = true;
	ref.id = id;
	Traind__HoldRequest hr = TRAIND__HOLD_REQUEST__INIT;
	hr.has_id = true;
	hr.id = id;
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = which;
	if (which == TRAIND__REQUEST__CALL_SHOW)
		req.show = &ref;
	else if (which == TRAIND__REQUEST__CALL_REQUEUE)
		req.requeue = &ref;
	else if (which == TRAIND__REQUEST__CALL_HOLD) {
		req.hold = &hr;
		hr.has_release = hr.release = strcmp(cmd, "release") == 0;
	} else
		req.cancel = &ref;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	if (!resp->job) {
		rpc_response_free(resp);
		return fail(CTL_FAILED, "%s: the daemon sent no job", cmd);
	}
	if (o->json) {
		print_result(o, &resp->job->base, human_job);
	} else if (which == TRAIND__REQUEST__CALL_HOLD) {
		const Traind__JobInfo *j = resp->job;
		printf("job %llu %s (%s)\n", (unsigned long long)j->id, j->held ? "held" : "released",
		       state_name(j));
	} else if (which == TRAIND__REQUEST__CALL_REQUEUE) {
		const Traind__JobInfo *j = resp->job;
		printf("job %llu requeued: %s\n", (unsigned long long)j->id, j->reason ? j->reason : "");
	} else if (which == TRAIND__REQUEST__CALL_CANCEL) {
		const Traind__JobInfo *j = resp->job;
		if (rpc_job_state_final(j->state))
			printf("job %llu %s\n", (unsigned long long)j->id, state_name(j));
		else
			printf("job %llu: cancel requested; it stops at its next step boundary\n",
			       (unsigned long long)j->id);
	} else {
		print_result(o, &resp->job->base, human_job);
	}
	rpc_response_free(resp);
	return CTL_OK;
}

static int cmd_show(const struct opts *o, int argc, char **argv)
{
	return job_call(o, "show", argc, argv, TRAIND__REQUEST__CALL_SHOW);
}

static int cmd_cancel(const struct opts *o, int argc, char **argv)
{
	return job_call(o, "cancel", argc, argv, TRAIND__REQUEST__CALL_CANCEL);
}

static int cmd_hold(const struct opts *o, int argc, char **argv)
{
	return job_call(o, "hold", argc, argv, TRAIND__REQUEST__CALL_HOLD);
}

static int cmd_release(const struct opts *o, int argc, char **argv)
{
	return job_call(o, "release", argc, argv, TRAIND__REQUEST__CALL_HOLD);
}

static int cmd_requeue(const struct opts *o, int argc, char **argv)
{
	return job_call(o, "requeue", argc, argv, TRAIND__REQUEST__CALL_REQUEUE);
}

static int cmd_priority(const struct opts *o, int argc, char **argv)
{
	uint64_t id;
	char *end;
	if (argc != 2 || !job_id_arg(argv[0], &id))
		return fail(CTL_USAGE, "priority: give a job id and a priority (priority ID N)");
	errno = 0;
	long p = strtol(argv[1], &end, 10);
	if (!*argv[1] || *end || errno || p < -100 || p > 100)
		return fail(CTL_USAGE, "priority: '%s' is not a priority (an integer, -100 .. 100)",
			    argv[1]);
	Traind__PriorityRequest pr = TRAIND__PRIORITY_REQUEST__INIT;
	pr.has_id = pr.has_priority = true;
	pr.id = id;
	pr.priority = (int32_t)p;
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_PRIORITY;
	req.priority = &pr;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	if (!resp->job)
		rc = fail(CTL_FAILED, "priority: the daemon sent no job");
	else if (o->json)
		print_result(o, &resp->job->base, human_job);
	else
		printf("job %llu: priority %d\n", (unsigned long long)resp->job->id, resp->job->priority);
	rpc_response_free(resp);
	return rc;
}

/* --since: YYYY-MM-DD[ HH:MM[:SS]] (local time), Nd or Nh ago, or @UNIX. */
static bool parse_since(const char *v, double *out)
{
	char *end;
	errno = 0;
	if (v[0] == '@') {
		double d = strtod(v + 1, &end);
		if (!v[1] || *end || errno || !(d >= 0))
			return false;
		*out = d;
		return true;
	}
	size_t n = strlen(v);
	if (n >= 2 && (v[n - 1] == 'd' || v[n - 1] == 'h') && v[0] != '-') {
		double d = strtod(v, &end);
		if (end != v + n - 1 || errno || !(d >= 0))
			return false;
		*out = (double)time(NULL) - d * (v[n - 1] == 'd' ? 86400 : 3600);
		return *out >= 0;
	}
	struct tm tm = {0};
	const char *r = strptime(v, "%Y-%m-%d", &tm);
	if (!r)
		return false;
	if (*r) {
		const char *r2 = strptime(r, " %H:%M:%S", &tm);
		if (!r2)
			r2 = strptime(r, " %H:%M", &tm);
		if (!r2 || *r2)
			return false;
	}
	tm.tm_isdst = -1;
	time_t t = mktime(&tm);
	if (t == (time_t)-1)
		return false;
	*out = (double)t;
	return true;
}

static bool uid_of(const char *name, uint32_t *uid)
{
	struct passwd pw, *pwp = NULL;
	char tmp[4096];
	uint64_t u;
	if (getpwnam_r(name, &pw, tmp, sizeof(tmp), &pwp) == 0 && pwp) {
		*uid = (uint32_t)pwp->pw_uid;
		return true;
	}
	if (parse_u64(name, &u) && u <= UINT32_MAX) {
		*uid = (uint32_t)u;
		return true;
	}
	return false;
}

static void print_usage_line(const char *first, const char *second, const Traind__Usage *u)
{
	char q[32], r[32];
	printf("%-10.10s %-30.30s %10.4f %14.4f %10.4f %12llu %10s %10s\n", first, second,
	       u ? u->gpu_s / 3600 : 0, u ? u->gpu_mem_byte_s / 3600 / (1 << 30) : 0,
	       u ? u->cpu_s / 3600 : 0, (unsigned long long)(u ? u->tokens : 0),
	       fmt_dur(u ? u->queued_s : 0, q, sizeof(q)), fmt_dur(u ? u->running_s : 0, r, sizeof(r)));
}

static void human_usage(const void *m)
{
	const Traind__UsageReply *r = m;
	char t[64], u[64];
	if (r->since > 0)
		printf("usage since %s\n", fmt_time(r->since, t, sizeof(t)));
	else
		printf("usage since the first job\n");
	const char *hdr = "%-10s %-30s %10s %14s %10s %12s %10s %10s\n";
	printf(hdr, "USER", "JOBS", "GPU-H", "GPU-MEM GIB-H", "CPU-H", "TOKENS", "QUEUED", "RUNNING");
	if (!r->n_users)
		printf("(none)\n");
	for (size_t i = 0; i < r->n_users; i++) {
		char jobs[32];
		snprintf(jobs, sizeof(jobs), "%u", r->users[i]->usage ? r->users[i]->usage->jobs : 0);
		print_usage_line(user_name(r->users[i]->uid, u, sizeof(u)), jobs, r->users[i]->usage);
	}
	if (r->n_jobs) {
		printf("\n");
		printf(hdr, "JOB", "NAME (STATE)", "GPU-H", "GPU-MEM GIB-H", "CPU-H", "TOKENS", "QUEUED",
		       "RUNNING");
		for (size_t i = 0; i < r->n_jobs; i++) {
			const Traind__JobUsage *j = r->jobs[i];
			char id[32], name[64];
			snprintf(id, sizeof(id), "%llu", (unsigned long long)j->id);
			snprintf(name, sizeof(name), "%s (%s)", j->name ? j->name : "",
				 j->has_state ? rpc_job_state_name(j->state) : "?");
			print_usage_line(id, name, j->usage);
		}
	}
	printf("\nfair share and the quota count the last %.0f hours:", r->window_s / 3600);
	for (size_t i = 0; i < r->n_users; i++) {
		const Traind__Usage *w = r->users[i]->window;
		printf(" %s %.3f GPU-h%s", user_name(r->users[i]->uid, u, sizeof(u)), w ? w->gpu_s / 3600 : 0,
		       i + 1 < r->n_users ? "," : "");
	}
	if (r->quota_gpu_s > 0)
		printf("; quota %.3f GPU-h a user\n", r->quota_gpu_s / 3600);
	else
		printf("; no quota\n");
}

static int cmd_usage(const struct opts *o, int argc, char **argv)
{
	Traind__UsageRequest ur = TRAIND__USAGE_REQUEST__INIT;
	for (int i = 0; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(a, "--all") == 0 || strcmp(a, "-a") == 0) {
			ur.has_all = ur.all = true;
		} else if (strcmp(a, "--jobs") == 0) {
			ur.has_by_job = ur.by_job = true;
		} else if (strcmp(a, "--user") == 0) {
			if (!v || !uid_of(v, &ur.uid))
				return fail(CTL_USAGE, "usage: --user: '%s' is not a user name or uid",
					    v ? v : "");
			ur.has_uid = true;
			i++;
		} else if (strcmp(a, "--since") == 0) {
			if (!v || !parse_since(v, &ur.since))
				return fail(CTL_USAGE,
					    "usage: --since: '%s' is not a date (YYYY-MM-DD[ HH:MM[:SS]], Nd "
					    "or Nh ago, or @UNIX-SECONDS)",
					    v ? v : "");
			ur.has_since = true;
			i++;
		} else {
			return fail(CTL_USAGE,
				    "usage: unknown argument '%s' (usage [--user U | --all] [--since DATE] "
				    "[--jobs])",
				    a);
		}
	}
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_USAGE;
	req.usage = &ur;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	if (!resp->usage)
		rc = fail(CTL_FAILED, "usage: the daemon sent nothing");
	else
		print_result(o, &resp->usage->base, human_usage);
	rpc_response_free(resp);
	return rc;
}

/* ------------------------------------------------------------------------ */
/* watch, logs */

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig)
{
	(void)sig;
	interrupted = 1;
}

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static int outcome_code(const Traind__JobInfo *j)
{
	switch (j->state) {
	case TRAIND__JOB_STATE__JOB_STATE_SUCCEEDED:
		return CTL_OK;
	case TRAIND__JOB_STATE__JOB_STATE_CANCELLED:
		return CTL_CANCELLED;
	default:
		return CTL_FAILED;
	}
}

static void print_event(const Traind__JobEvent *e)
{
	char t[64];
	printf("%s %-10s %s\n", fmt_time(e->time, t, sizeof(t)), e->kind ? e->kind : "",
	       e->message ? e->message : "");
}

static void print_metric(const Traind__JobMetric *m, uint64_t total)
{
	char t[64], eta[32] = "";
	printf("%s step %llu", fmt_time(m->time, t, sizeof(t)), (unsigned long long)m->step);
	if (total)
		printf("/%llu", (unsigned long long)total);
	if (m->has_loss)
		printf("  loss %.4f", m->loss);
	if (m->has_lr)
		printf("  lr %.3e", m->lr);
	if (m->has_grad_norm)
		printf("  grad_norm %.3f", m->grad_norm);
	if (m->has_tokens_per_s)
		printf("  tok/s %.0f", m->tokens_per_s);
	if (m->has_eval_loss)
		printf("  eval_loss %.4f", m->eval_loss);
	if (m->has_eta_s)
		printf("  eta %s", fmt_dur(m->eta_s, eta, sizeof(eta)));
	printf("\n");
}

static void draw_bar(const Traind__JobInfo *j)
{
	char line[256], eta[32];
	int width = 30;
	double frac = j->has_total_steps && j->total_steps ? (double)j->step / (double)j->total_steps : 0;
	if (frac > 1)
		frac = 1;
	int fill = (int)(frac * width + 0.5);
	int n = snprintf(line, sizeof(line), "\r[");
	for (int i = 0; i < width && n < (int)sizeof(line) - 1; i++)
		line[n++] = i < fill ? '#' : '.';
	n += snprintf(line + n, sizeof(line) - (size_t)n, "] %llu/%llu",
		      (unsigned long long)j->step, (unsigned long long)j->total_steps);
	if (j->has_loss)
		n += snprintf(line + n, sizeof(line) - (size_t)n, "  loss %.4f", j->loss);
	if (j->has_lr)
		n += snprintf(line + n, sizeof(line) - (size_t)n, "  lr %.2e", j->lr);
	if (j->has_tokens_per_s)
		n += snprintf(line + n, sizeof(line) - (size_t)n, "  %.0f tok/s", j->tokens_per_s);
	if (j->has_eta_s)
		n += snprintf(line + n, sizeof(line) - (size_t)n, "  ETA %s", fmt_dur(j->eta_s, eta, sizeof(eta)));
	else
		n += snprintf(line + n, sizeof(line) - (size_t)n, "  %s", state_name(j));
	fputs(line, stdout);
	fputs("\033[K", stdout);
	fflush(stdout);
}

/* Follows a job's events and metrics until it ends (follow) or once.
 * command: "watch" or "logs", which the daemon's errors name. */
/* The daemon went away under a watch (it restarts: a kill, an upgrade, a
 * re-exec): dials again every half second for up to o->reconnect_s. */
static bool reconnect(const struct opts *o, const char *path, struct ctl_conn **c, const char *why)
{
	fprintf(stderr, "%s: traind went away (%s); reconnecting for up to %d s\n", prog, why,
		o->reconnect_s);
	ctl_close(*c);
	*c = NULL;
	struct timespec t0, t;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		clock_gettime(CLOCK_MONOTONIC, &t);
		if (interrupted || t.tv_sec - t0.tv_sec >= o->reconnect_s)
			return false;
		sleep_ms(500);
		struct td_errbuf eb = {{0}};
		if (ctl_connect(c, path, o->timeout_ms, &eb) == TD_OK) {
			fprintf(stderr, "%s: reconnected to traind at %s\n", prog, path);
			return true;
		}
	}
}

static int follow(const struct opts *o, const char *command, uint64_t id, bool until_final, bool bar,
		  bool events_too, bool metric_lines)
{
	char sock[256];
	const char *path = o->socket ? o->socket : ctl_default_socket(sock, sizeof(sock));
	struct ctl_conn *c = NULL;
	struct td_errbuf eb = {{0}};
	if (ctl_connect(&c, path, o->timeout_ms, &eb) != TD_OK)
		return fail(CTL_NODAEMON, "%s", eb.msg);
	struct sigaction sa = {.sa_handler = on_sigint};
	sigaction(SIGINT, &sa, NULL);
	uint64_t after_ev = 0, after_step = 0;
	bool bar_drawn = false;
	int rc = CTL_OK;
	for (;;) {
		Traind__WatchRequest w = TRAIND__WATCH_REQUEST__INIT;
		w.has_id = true;
		w.id = id;
		w.has_after_event = true;
		w.after_event = after_ev;
		w.has_after_step = true;
		w.after_step = after_step;
		w.command = (char *)command;
		Traind__Request req = TRAIND__REQUEST__INIT;
		req.call_case = TRAIND__REQUEST__CALL_WATCH;
		req.watch = &w;
		Traind__Response *resp = NULL;
		/* A daemon that goes away while we follow is waited for: its jobs
		 * come back with it, and the cursors go on where they were. */
		struct td_errbuf ceb = {{0}};
		if (until_final && o->reconnect_s > 0 && ctl_call(c, &req, &resp, &ceb) != TD_OK) {
			if (bar_drawn)
				fputs("\n", stdout);
			bar_drawn = false;
			fflush(stdout);
			if (reconnect(o, path, &c, ceb.msg))
				continue;
			rc = interrupted ? fail(130, "interrupted; the job goes on (trainctl watch %llu)",
						(unsigned long long)id)
					 : fail(CTL_NODAEMON, "traind did not come back within %d s (%s)",
						o->reconnect_s, ceb.msg);
			break;
		}
		if (resp && resp->status != TD_OK) {
			int code = ctl_exit_for((td_err)resp->status);
			fail(code, "%s", resp->message ? resp->message : td_strerror((td_err)resp->status));
			rpc_response_free(resp);
			rc = code;
			break;
		}
		if (!resp && (rc = call_on(c, &req, &resp)) != CTL_OK)
			break;
		const Traind__WatchReply *wr = resp->watch;
		const Traind__JobInfo *j = wr ? wr->job : NULL;
		if (!j) {
			rpc_response_free(resp);
			rc = fail(CTL_FAILED, "watch: the daemon sent no job");
			break;
		}
		uint64_t total = j->has_total_steps ? j->total_steps : 0;
		/* Events and metrics in time order. */
		size_t ie = 0, im = 0;
		while (ie < wr->n_events || im < wr->n_metrics) {
			bool ev = im >= wr->n_metrics ||
				  (ie < wr->n_events && wr->events[ie]->time <= wr->metrics[im]->time);
			/* The newest metric carries the job's ETA (the runner's estimate). */
			if (!ev && im + 1 == wr->n_metrics && j->has_eta_s && !rpc_job_state_final(j->state)) {
				wr->metrics[im]->has_eta_s = true;
				wr->metrics[im]->eta_s = j->eta_s;
			}
			if (o->json) {
				struct json_object *js = ctl_json(ev ? &wr->events[ie]->base : &wr->metrics[im]->base);
				json_object_object_add(js, "type", json_object_new_string(ev ? "event" : "metric"));
				ctl_json_print(stdout, js, false);
				json_object_put(js);
			} else if (ev && events_too) {
				if (bar_drawn)
					fputs("\r\033[K", stdout);
				print_event(wr->events[ie]);
				bar_drawn = false;
			} else if (!ev && metric_lines) {
				print_metric(wr->metrics[im], total);
			}
			if (ev)
				after_ev = wr->events[ie++]->seq;
			else
				after_step = wr->metrics[im++]->step;
		}
		bool final = rpc_job_state_final(j->state);
		if (bar && !o->json && (j->has_step || !final)) {
			draw_bar(j);
			bar_drawn = true;
		}
		bool more = wr->has_more && wr->more;
		if (!more && (final || !until_final)) {
			if (bar_drawn)
				fputs("\n", stdout);
			if (until_final && !o->json)
				printf("job %llu %s%s%s\n", (unsigned long long)j->id, state_name(j),
				       j->reason && *j->reason ? ": " : "", j->reason ? j->reason : "");
			if (until_final && o->json) {
				struct json_object *js = ctl_json(&j->base);
				json_object_object_add(js, "type", json_object_new_string("job"));
				ctl_json_print(stdout, js, false);
				json_object_put(js);
			}
			rc = until_final ? outcome_code(j) : CTL_OK;
			rpc_response_free(resp);
			break;
		}
		rpc_response_free(resp);
		fflush(stdout);
		if (interrupted) {
			if (bar_drawn)
				fputs("\n", stdout);
			rc = fail(130, "interrupted; the job goes on (trainctl watch %llu)", (unsigned long long)id);
			break;
		}
		if (!more)
			sleep_ms(WATCH_POLL_MS);
	}
	ctl_close(c);
	return rc;
}

/* Takes --reconnect SECONDS out of argv (watch, logs --follow). */
static int reconnect_arg(const char *cmd, struct opts *o, int *argc, char **argv)
{
	int n = 0;
	for (int i = 0; i < *argc; i++) {
		if (strcmp(argv[i], "--reconnect") != 0) {
			argv[n++] = argv[i];
			continue;
		}
		uint64_t u;
		if (i + 1 >= *argc || !parse_u64(argv[i + 1], &u) || u > 86400)
			return fail(CTL_USAGE, "%s: --reconnect: give seconds, 0 .. 86400", cmd);
		o->reconnect_s = (int)u;
		i++;
	}
	*argc = n;
	return CTL_OK;
}

static int cmd_watch(const struct opts *o0, int argc, char **argv)
{
	struct opts o = *o0;
	uint64_t id;
	int rc = reconnect_arg("watch", &o, &argc, argv);
	if (rc != CTL_OK)
		return rc;
	if (argc != 1 || !job_id_arg(argv[0], &id))
		return fail(CTL_USAGE, "watch: give one job id (`trainctl ls` lists them)");
	bool tty = isatty(STDOUT_FILENO);
	setvbuf(stdout, NULL, _IOLBF, 0);
	return follow(&o, "watch", id, true, tty, true, !tty);
}

static int cmd_logs(const struct opts *o0, int argc, char **argv)
{
	struct opts o1 = *o0;
	const struct opts *o = &o1;
	int rc0 = reconnect_arg("logs", &o1, &argc, argv);
	if (rc0 != CTL_OK)
		return rc0;
	bool fol = false;
	const char *idarg = NULL;
	for (int i = 0; i < argc; i++) {
		if (strcmp(argv[i], "--follow") == 0 || strcmp(argv[i], "-f") == 0)
			fol = true;
		else if (!idarg)
			idarg = argv[i];
		else
			return fail(CTL_USAGE, "logs: unexpected argument '%s' (logs ID [--follow])", argv[i]);
	}
	uint64_t id;
	if (!idarg || !job_id_arg(idarg, &id))
		return fail(CTL_USAGE, "logs: give one job id (`trainctl ls` lists them)");
	setvbuf(stdout, NULL, _IOLBF, 0);
	int rc = follow(o, "logs", id, fol, false, true, true);
	/* logs prints what there is; the job's outcome is watch's business. */
	return fol || rc == CTL_NODAEMON || rc >= CTL_USAGE ? rc : CTL_OK;
}

/* ------------------------------------------------------------------------ */
/* ledger, info */

static void print_devices(Traind__GpuDevice **d, size_t n)
{
	if (!n) {
		printf("no GPUs (jobs run on the CPU backend)\n");
		return;
	}
	printf("%-4s %-40s %-12s %-12s %-12s %s\n", "GPU", "UUID", "TOTAL", "FREE", "RESERVED", "NAME");
	bool links = false;
	for (size_t i = 0; i < n; i++) {
		char a[32], b[32] = "?", r[32];
		if (d[i]->has_free_bytes)
			fmt_bytes(d[i]->free_bytes, b, sizeof(b));
		printf("%-4d %-40s %-12s %-12s %-12s %s\n", d[i]->index, d[i]->uuid ? d[i]->uuid : "",
		       fmt_bytes(d[i]->total_bytes, a, sizeof(a)), b,
		       fmt_bytes(d[i]->reserved_bytes, r, sizeof(r)), d[i]->name ? d[i]->name : "");
		links = links || d[i]->n_nvlink;
	}
	/* Each pair once. */
	if (links) {
		printf("NVLink:     ");
		for (size_t i = 0; i < n; i++)
			for (size_t k = 0; k < d[i]->n_nvlink; k++)
				if (d[i]->nvlink[k] > d[i]->index)
					printf(" %d-%d", d[i]->index, d[i]->nvlink[k]);
		printf("\n");
	}
}

/* Shared blocks: once each, with the leases (jobs, users) that hold them;
 * those leases' BYTES are their own, without the block. */
static void print_shared(Traind__SharedBlock **s, size_t n)
{
	if (!n)
		return;
	printf("\n%-6s %-32s %-12s %-19s %-40s %s\n", "SHARED", "GPU", "BYTES", "SINCE", "HOLDERS (LEASE/JOB/USER)",
	       "NOTE");
	for (size_t i = 0; i < n; i++) {
		char b[32], t[64], holders[512] = "";
		size_t len = 0;
		for (size_t k = 0; k < s[i]->n_lease_ids && len < sizeof(holders); k++) {
			char u[64];
			len += (size_t)snprintf(holders + len, sizeof(holders) - len, "%s%llu/%llu/%s",
						k ? " " : "", (unsigned long long)s[i]->lease_ids[k],
						k < s[i]->n_job_ids ? (unsigned long long)s[i]->job_ids[k] : 0ull,
						user_name(k < s[i]->n_uids ? s[i]->uids[k] : 0, u, sizeof(u)));
		}
		printf("%-6llu %-32.32s %-12s %-19s %-40s %s\n", (unsigned long long)s[i]->id,
		       s[i]->gpu ? s[i]->gpu : "", fmt_bytes(s[i]->bytes, b, sizeof(b)),
		       fmt_time(s[i]->since, t, sizeof(t)), holders, s[i]->note ? s[i]->note : "");
	}
}

static void print_leases(Traind__Lease **l, size_t n)
{
	if (!n) {
		printf("no reservations\n");
		return;
	}
	printf("%-6s %-32s %-12s %-6s %-10s %-8s %-19s %s\n", "LEASE", "GPU", "BYTES", "JOB", "USER",
	       "PID", "SINCE", "NOTE");
	for (size_t i = 0; i < n; i++) {
		char b[32], u[64], t[64], job[24] = "-";
		if (l[i]->job_id)
			snprintf(job, sizeof(job), "%llu", (unsigned long long)l[i]->job_id);
		printf("%-6llu %-32.32s %-12s %-6s %-10.10s %-8d %-19s %s\n", (unsigned long long)l[i]->id,
		       l[i]->gpu ? l[i]->gpu : "", fmt_bytes(l[i]->bytes, b, sizeof(b)), job,
		       user_name(l[i]->uid, u, sizeof(u)), l[i]->pid, fmt_time(l[i]->since, t, sizeof(t)),
		       l[i]->note ? l[i]->note : "");
	}
}

static int cmd_ledger(const struct opts *o, int argc, char **argv)
{
	Traind__LedgerRequest lr = TRAIND__LEDGER_REQUEST__INIT;
	Traind__LedgerReserve rs = TRAIND__LEDGER_RESERVE__INIT;
	Traind__LedgerRelease rl = TRAIND__LEDGER_RELEASE__INIT;
	const char *op = argc ? argv[0] : "list";
	if (strcmp(op, "list") == 0 || strcmp(op, "ls") == 0) {
		if (argc > 1)
			return fail(CTL_USAGE, "ledger: unexpected argument '%s'", argv[1]);
		lr.op_case = TRAIND__LEDGER_REQUEST__OP_LIST;
		lr.list = true;
	} else if (strcmp(op, "reserve") == 0) {
		lr.op_case = TRAIND__LEDGER_REQUEST__OP_RESERVE;
		lr.reserve = &rs;
		rs.has_pid = true;
		rs.pid = (int32_t)getppid(); /* the program that ran trainctl holds it */
		for (int i = 1; i < argc; i++) {
			uint64_t u;
			const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
			if (!v)
				return fail(CTL_USAGE, "ledger reserve: %s needs a value", a);
			i++;
			if (strcmp(a, "--gpu") == 0)
				rs.gpu = (char *)v;
			else if (strcmp(a, "--bytes") == 0 && parse_bytes(v, &u))
				rs.has_bytes = true, rs.bytes = u;
			else if (strcmp(a, "--pid") == 0 && parse_u64(v, &u) && u > 0 && u <= INT32_MAX)
				rs.pid = (int32_t)u;
			else if (strcmp(a, "--ttl") == 0 && parse_u64(v, &u) && u <= UINT32_MAX)
				rs.has_ttl_s = true, rs.ttl_s = (uint32_t)u;
			else if (strcmp(a, "--note") == 0)
				rs.note = (char *)v;
			else
				return fail(CTL_USAGE, "ledger reserve: bad argument '%s %s' (--gpu G --bytes N[K|M|G] "
						       "[--pid PID] [--ttl SECONDS] [--note TEXT])",
					    a, v);
		}
		if (!rs.gpu || !rs.has_bytes)
			return fail(CTL_USAGE, "ledger reserve: give --gpu UUID|INDEX and --bytes N[K|M|G]");
	} else if (strcmp(op, "release") == 0) {
		uint64_t u;
		if (argc != 2 || !parse_u64(argv[1], &u) || !u)
			return fail(CTL_USAGE, "ledger release: give one lease id (`trainctl ledger` lists them)");
		lr.op_case = TRAIND__LEDGER_REQUEST__OP_RELEASE;
		lr.release = &rl;
		rl.has_lease_id = true;
		rl.lease_id = u;
	} else {
		return fail(CTL_USAGE, "ledger: unknown operation '%s' (list, reserve, release)", op);
	}
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_LEDGER;
	req.ledger = &lr;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	const Traind__LedgerReply *r = resp->ledger;
	if (!r) {
		rc = fail(CTL_FAILED, "ledger: the daemon sent no ledger");
	} else if (o->json) {
		struct json_object *js = ctl_json(&r->base);
		ctl_json_print(stdout, js, true);
		json_object_put(js);
	} else if (lr.op_case == TRAIND__LEDGER_REQUEST__OP_RESERVE && r->lease) {
		printf("%llu\n", (unsigned long long)r->lease->id);
	} else if (lr.op_case == TRAIND__LEDGER_REQUEST__OP_RELEASE) {
		printf("lease %llu released\n", (unsigned long long)rl.lease_id);
	} else {
		print_devices(r->devices, r->n_devices);
		printf("\n");
		print_leases(r->leases, r->n_leases);
		print_shared(r->shared, r->n_shared);
	}
	rpc_response_free(resp);
	return rc;
}

/* ------------------------------------------------------------------------ */
/* cache */

static void human_cache(const void *m)
{
	const Traind__CacheReply *r = m;
	const char *dir = r->dir && *r->dir ? r->dir : "(no cache dir)";
	char b[32], t[64];
	if (r->has_removed) { /* clear */
		printf("module cache cleared: %llu entries, %llu files in %s\n",
		       (unsigned long long)r->removed, (unsigned long long)r->files_removed, dir);
		return;
	}
	if (r->n_entries) { /* list */
		printf("%-16s %-7s %-10s %-6s %-19s %s\n", "KEY", "ARCH", "SIZE", "HITS", "LAST USED",
		       "PATH");
		for (size_t i = 0; i < r->n_entries; i++) {
			const Traind__CacheEntry *e = r->entries[i];
			printf("%-16.16s %-7s %-10s %-6llu %-19s %s\n", e->key ? e->key : "",
			       e->arch ? e->arch : "", fmt_bytes(e->size_bytes, b, sizeof(b)),
			       (unsigned long long)e->hits, fmt_time(e->used, t, sizeof(t)),
			       e->path ? e->path : "");
		}
		printf("\n");
	}
	printf("%llu module%s, %s, %llu load%s from the cache; in %s\n", (unsigned long long)r->count,
	       r->count == 1 ? "" : "s", fmt_bytes(r->bytes, b, sizeof(b)), (unsigned long long)r->hits,
	       r->hits == 1 ? "" : "s", dir);
}

static int cmd_cache(const struct opts *o, int argc, char **argv)
{
	Traind__CacheRequest cr = TRAIND__CACHE_REQUEST__INIT;
	const char *op = argc ? argv[0] : "list";
	if (argc > 1)
		return fail(CTL_USAGE, "cache %s: unexpected argument '%s'", op, argv[1]);
	if (strcmp(op, "list") == 0 || strcmp(op, "ls") == 0)
		cr.op_case = TRAIND__CACHE_REQUEST__OP_LIST, cr.list = true;
	else if (strcmp(op, "stats") == 0)
		cr.op_case = TRAIND__CACHE_REQUEST__OP_STATS, cr.stats = true;
	else if (strcmp(op, "clear") == 0)
		cr.op_case = TRAIND__CACHE_REQUEST__OP_CLEAR, cr.clear = true;
	else
		return fail(CTL_USAGE, "cache: unknown operation '%s' (list, stats, clear)", op);
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_CACHE;
	req.cache = &cr;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	if (!resp->cache)
		rc = fail(CTL_FAILED, "cache: the daemon sent nothing");
	else
		print_result(o, &resp->cache->base, human_cache);
	rpc_response_free(resp);
	return rc;
}

/* ------------------------------------------------------------------------ */
/* top: GPUs, running jobs and the queue, refreshed (nvtop and squeue in one) */

#define TOP_ENDED 5 /* ended jobs shown under the queue */

struct top_snap {
	Traind__Response *info, *list;
	char err[600]; /* why there is no snapshot now */
};

static void top_snap_free(struct top_snap *t)
{
	rpc_response_free(t->info);
	rpc_response_free(t->list);
	t->info = t->list = NULL;
}

/* One call on *c, which is dialled again when it is NULL and dropped on a
 * transport error (the daemon restarting): top waits for it. */
static bool top_call(const struct opts *o, const char *path, struct ctl_conn **c,
		     Traind__Request *req, Traind__Response **resp, char *err, size_t cap)
{
	struct td_errbuf eb = {{0}};
	/* At most 5 s a call: a daemon that died under a request shows as
	 * unreachable in the next frame instead of freezing this one. */
	int tmo = o->timeout_ms < 5000 ? o->timeout_ms : 5000;
	if (!*c && ctl_connect(c, path, tmo, &eb) != TD_OK) {
		snprintf(err, cap, "%s", eb.msg);
		return false;
	}
	if (ctl_call(*c, req, resp, &eb) != TD_OK) {
		ctl_close(*c);
		*c = NULL;
		snprintf(err, cap, "%s", eb.msg);
		return false;
	}
	if ((*resp)->status != TD_OK) {
		snprintf(err, cap, "%s",
			 (*resp)->message ? (*resp)->message : td_strerror((td_err)(*resp)->status));
		rpc_response_free(*resp);
		*resp = NULL;
		return false;
	}
	return true;
}

/* info, then the jobs: everyone's for an admin, the caller's otherwise. */
static bool top_fetch(const struct opts *o, const char *path, struct ctl_conn **c,
		      struct top_snap *t)
{
	top_snap_free(t);
	Traind__InfoRequest ir = TRAIND__INFO_REQUEST__INIT;
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_INFO;
	req.info = &ir;
	if (!top_call(o, path, c, &req, &t->info, t->err, sizeof(t->err)))
		return false;
	if (!t->info->info) {
		snprintf(t->err, sizeof(t->err), "the daemon sent no info");
		return false;
	}
	Traind__ListRequest lr = TRAIND__LIST_REQUEST__INIT;
	lr.has_all = true;
	lr.all = t->info->info->caller_admin;
	lr.has_limit = true;
	lr.limit = 1000;
	req.call_case = TRAIND__REQUEST__CALL_LIST;
	req.list = &lr;
	if (!top_call(o, path, c, &req, &t->list, t->err, sizeof(t->err)))
		return false;
	t->err[0] = 0;
	return true;
}

/* Where top draws: a terminal (escapes, lines cut at its width) or plain. */
struct top_out {
	bool tty;
	int cols, rows, line;
};

static void tline(struct top_out *w, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void tline(struct top_out *w, const char *fmt, ...)
{
	if (w->tty && w->line >= w->rows - 1)
		return; /* the last row is the footer's */
	char buf[1024];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (w->tty) {
		/* Cut at the width, counting UTF-8 sequences as one column. */
		int col = 0;
		size_t i = 0;
		for (; buf[i]; i++) {
			if (((unsigned char)buf[i] & 0xc0) != 0x80 && col++ == w->cols)
				break;
		}
		buf[i] = 0;
		fputs(buf, stdout);
		fputs("\033[K\n", stdout);
	} else {
		puts(buf);
	}
	w->line++;
}

static const char *bar(double frac, int width, char *buf, size_t cap)
{
	if (!(frac >= 0))
		frac = 0;
	if (frac > 1)
		frac = 1;
	int fill = (int)(frac * width + 0.5), n = 0;
	for (int i = 0; i < width && n + 1 < (int)cap; i++)
		buf[n++] = i < fill ? '#' : '.';
	buf[n] = 0;
	return buf;
}

static void top_draw(struct top_out *w, const struct top_snap *t, double interval)
{
	char a[64], b[64], c[64], d[64], e[64];
	time_t now = time(NULL);
	struct tm tm;
	localtime_r(&now, &tm);
	char clock[16];
	strftime(clock, sizeof(clock), "%H:%M:%S", &tm);
	const Traind__InfoReply *i = t->info ? t->info->info : NULL;
	if (!i) {
		tline(w, "trainctl top %s: traind unreachable: %s", clock, t->err);
		tline(w, "(retrying every %.1f s)", interval);
		return;
	}
	tline(w, "traind %s (%s mode, pid %u), up %s: %u running, %u queued, %u CPU slot(s)%s  %s",
	      i->version ? i->version : "?", i->mode ? i->mode : "?", i->pid,
	      fmt_dur(i->uptime_s, a, sizeof(a)), i->running, i->queued, i->cpu_slots,
	      i->caller_admin ? "" : "; your jobs", clock);
	tline(w, "%s", "");
	if (!i->n_devices) {
		bool note = i->gpu_note && *i->gpu_note;
		tline(w, "no GPUs: jobs run on CPU slots%s%s%s", note ? " (" : "", note ? i->gpu_note : "",
		      note ? ")" : "");
	} else {
		tline(w, "%-4s %-22s %10s %10s %10s %10s  %s", "GPU", "NAME", "TOTAL", "RESERVED", "USED",
		      "FREE", "RESERVED/TOTAL");
		for (size_t k = 0; k < i->n_devices; k++) {
			const Traind__GpuDevice *g = i->devices[k];
			uint64_t used = g->has_free_bytes && g->free_bytes <= g->total_bytes
						? g->total_bytes - g->free_bytes
						: 0;
			char bb[32];
			tline(w, "%-4d %-22.22s %10s %10s %10s %10s  [%s]", g->index, g->name ? g->name : "",
			      fmt_bytes(g->total_bytes, a, sizeof(a)), fmt_bytes(g->reserved_bytes, b, sizeof(b)),
			      g->has_free_bytes ? fmt_bytes(used, c, sizeof(c)) : "?",
			      g->has_free_bytes ? fmt_bytes(g->free_bytes, d, sizeof(d)) : "?",
			      bar(g->total_bytes ? (double)g->reserved_bytes / (double)g->total_bytes : 0, 20,
				  bb, sizeof(bb)));
		}
	}
	const Traind__JobList *l = t->list ? t->list->list : NULL;
	size_t n = l ? l->n_jobs : 0;
	size_t nrun = 0, nq = 0;
	for (size_t k = 0; k < n; k++) {
		Traind__JobState s = l->jobs[k]->state;
		nrun += s == TRAIND__JOB_STATE__JOB_STATE_ADMITTED ||
			s == TRAIND__JOB_STATE__JOB_STATE_PREPARING || s == TRAIND__JOB_STATE__JOB_STATE_RUNNING;
		nq += s == TRAIND__JOB_STATE__JOB_STATE_QUEUED || s == TRAIND__JOB_STATE__JOB_STATE_INTERRUPTED;
	}
	tline(w, "%s", "");
	tline(w, "RUNNING (%zu)", nrun);
	if (nrun)
		tline(w, "%-6s %-10s %-20s %-10s %-24s %8s %9s %8s  %s", "ID", "USER", "NAME", "STATE",
		      "PROGRESS", "LOSS", "TOK/S", "ETA", "DEVICE");
	/* The list is newest first: oldest first reads better here. */
	for (size_t k = n; k-- > 0;) {
		const Traind__JobInfo *j = l->jobs[k];
		Traind__JobState s = j->state;
		if (s != TRAIND__JOB_STATE__JOB_STATE_ADMITTED && s != TRAIND__JOB_STATE__JOB_STATE_PREPARING &&
		    s != TRAIND__JOB_STATE__JOB_STATE_RUNNING)
			continue;
		char bb[16], prog[48], loss[16] = "-", tok[16] = "-", eta[16] = "-";
		snprintf(prog, sizeof(prog), "[%s] %s",
			 bar(j->has_total_steps && j->total_steps ? (double)j->step / (double)j->total_steps : 0,
			     10, bb, sizeof(bb)),
			 fmt_progress(j, a, sizeof(a)));
		if (j->has_loss)
			snprintf(loss, sizeof(loss), "%.4f", j->loss);
		if (j->has_tokens_per_s)
			snprintf(tok, sizeof(tok), "%.0f", j->tokens_per_s);
		if (j->has_eta_s)
			fmt_dur(j->eta_s, eta, sizeof(eta));
		tline(w, "%-6llu %-10.10s %-20.20s %-10s %-24s %8s %9s %8s  %s", (unsigned long long)j->id,
		      user_name(j->uid, b, sizeof(b)), j->name ? j->name : "", state_name(j), prog, loss, tok,
		      eta, j->device && *j->device ? j->device : "-");
	}
	tline(w, "%s", "");
	tline(w, "QUEUED (%zu)", nq);
	if (nq)
		tline(w, "%-6s %-10s %-20s %4s %-8s  %s", "ID", "USER", "NAME", "PRIO", "WAITED", "WHY IT WAITS");
	for (size_t k = n; k-- > 0;) {
		const Traind__JobInfo *j = l->jobs[k];
		if (j->state != TRAIND__JOB_STATE__JOB_STATE_QUEUED &&
		    j->state != TRAIND__JOB_STATE__JOB_STATE_INTERRUPTED)
			continue;
		tline(w, "%-6llu %-10.10s %-20.20s %4d %-8s  %s", (unsigned long long)j->id,
		      user_name(j->uid, b, sizeof(b)), j->name ? j->name : "", j->priority,
		      fmt_dur((double)now - j->submit_time, e, sizeof(e)),
		      j->waiting && *j->waiting ? j->waiting : state_name(j));
	}
	size_t shown = 0;
	for (size_t k = 0; k < n && shown < TOP_ENDED; k++)
		shown += rpc_job_state_final(l->jobs[k]->state);
	if (shown) {
		tline(w, "%s", "");
		tline(w, "ENDED (the last %zu)", shown);
		shown = 0;
		for (size_t k = 0; k < n && shown < TOP_ENDED; k++) {
			const Traind__JobInfo *j = l->jobs[k];
			if (!rpc_job_state_final(j->state))
				continue;
			shown++;
			tline(w, "%-6llu %-10.10s %-20.20s %-10s %-19s  %s", (unsigned long long)j->id,
			      user_name(j->uid, b, sizeof(b)), j->name ? j->name : "", state_name(j),
			      fmt_time(j->end_time, a, sizeof(a)), j->reason ? j->reason : "");
		}
	}
	if (t->err[0])
		tline(w, "(stale: %s)", t->err);
}

static struct termios top_saved;
static bool top_raw;

static void top_restore(void)
{
	if (top_raw) {
		fputs("\033[?25h\033[?1049l", stdout);
		fflush(stdout);
		tcsetattr(STDIN_FILENO, TCSANOW, &top_saved);
		top_raw = false;
	}
}

static void on_winch(int sig)
{
	(void)sig; /* poll() returns; the next frame reads the new size */
}

static int cmd_top(const struct opts *o, int argc, char **argv)
{
	bool once = false;
	double interval = 1.0;
	for (int i = 0; i < argc; i++) {
		char *end;
		if (strcmp(argv[i], "--once") == 0) {
			once = true;
		} else if (strcmp(argv[i], "--interval") == 0 && i + 1 < argc) {
			interval = strtod(argv[++i], &end);
			if (!*argv[i] || *end || !(interval >= 0.2 && interval <= 3600))
				return fail(CTL_USAGE, "top: --interval: '%s' is not seconds (0.2 .. 3600)", argv[i]);
		} else {
			return fail(CTL_USAGE, "top: unknown argument '%s' (top [--once] [--interval S])",
				    argv[i]);
		}
	}
	char sock[256];
	const char *path = o->socket ? o->socket : ctl_default_socket(sock, sizeof(sock));
	struct ctl_conn *c = NULL;
	struct top_snap t = {0};
	bool tty = isatty(STDOUT_FILENO) && isatty(STDIN_FILENO);
	/* A snapshot: --once, --json, or not on a terminal. */
	if (once || o->json || !tty) {
		bool ok = top_fetch(o, path, &c, &t);
		ctl_close(c);
		if (!ok) {
			top_snap_free(&t);
			return fail(strstr(t.err, "cannot reach") ? CTL_NODAEMON : CTL_FAILED, "top: %s", t.err);
		}
		if (o->json) {
			struct json_object *js = json_object_new_object();
			json_object_object_add(js, "info", ctl_json(&t.info->info->base));
			struct json_object *jobs = json_object_new_array();
			for (size_t k = 0; t.list->list && k < t.list->list->n_jobs; k++)
				if (!rpc_job_state_final(t.list->list->jobs[k]->state))
					json_object_array_add(jobs, ctl_json(&t.list->list->jobs[k]->base));
			json_object_object_add(js, "jobs", jobs);
			ctl_json_print(stdout, js, true);
			json_object_put(js);
		} else {
			struct top_out w = {.tty = false};
			top_draw(&w, &t, interval);
		}
		top_snap_free(&t);
		return CTL_OK;
	}
	/* The screen: the alternate buffer, keys read raw, q quits. */
	if (tcgetattr(STDIN_FILENO, &top_saved) == 0) {
		struct termios raw = top_saved;
		raw.c_lflag &= (tcflag_t) ~(ICANON | ECHO);
		raw.c_cc[VMIN] = 0;
		raw.c_cc[VTIME] = 0;
		tcsetattr(STDIN_FILENO, TCSANOW, &raw);
		top_raw = true;
		atexit(top_restore);
	}
	struct sigaction sa = {.sa_handler = on_sigint};
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	struct sigaction sw = {.sa_handler = on_winch};
	sigaction(SIGWINCH, &sw, NULL);
	fputs("\033[?1049h\033[?25l", stdout);
	bool quit = false;
	while (!quit && !interrupted) {
		top_fetch(o, path, &c, &t);
		struct winsize ws = {0};
		struct top_out w = {.tty = true, .cols = 80, .rows = 24};
		if (ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col && ws.ws_row) {
			w.cols = ws.ws_col;
			w.rows = ws.ws_row;
		}
		fputs("\033[H", stdout);
		top_draw(&w, &t, interval);
		fputs("\033[J", stdout); /* clear what the last frame left below */
		printf("\033[%d;1H\033[7m q: quit   refresh: %.1f s   %s \033[0m\033[K", w.rows, interval,
		       t.info && t.info->info && t.info->info->caller_admin ? "every user's jobs"
									 : "your jobs");
		fflush(stdout);
		/* Wait for the next frame, or a key. */
		struct timespec t0, t1;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		for (;;) {
			clock_gettime(CLOCK_MONOTONIC, &t1);
			double left = interval - ((double)(t1.tv_sec - t0.tv_sec) +
						  (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9);
			if (left <= 0 || interrupted)
				break;
			struct pollfd pf = {.fd = STDIN_FILENO, .events = POLLIN};
			int r = poll(&pf, 1, (int)(left * 1000) + 1);
			if (r > 0) {
				char k[32];
				ssize_t got = read(STDIN_FILENO, k, sizeof(k));
				if (got <= 0) {
					quit = got == 0; /* the terminal went away */
					break;
				}
				for (ssize_t x = 0; x < got; x++)
					quit = quit || k[x] == 'q' || k[x] == 'Q';
				if (quit)
					break;
				if (memchr(k, ' ', (size_t)got) || memchr(k, 'r', (size_t)got))
					break; /* space or r: refresh now */
			} else if (r < 0) {
				break; /* a signal: SIGWINCH redraws at once */
			}
		}
	}
	top_restore();
	top_snap_free(&t);
	ctl_close(c);
	return CTL_OK;
}

static void human_info(const void *m)
{
	const Traind__InfoReply *i = m;
	char u[64], d[32];
	printf("traind:      %s (protocol %u, pid %u), %s mode, up %s\n", i->version ? i->version : "?",
	       i->protocol, i->pid, i->mode ? i->mode : "?", fmt_dur(i->uptime_s, d, sizeof(d)));
	printf("trainctl:    %s (protocol %d)\n", TD_VERSION, RPC_PROTOCOL);
	printf("socket:      %s\n", i->socket ? i->socket : "");
	printf("state:       %s\n", i->state_dir ? i->state_dir : "");
	printf("cache:       %s\n", i->cache_dir ? i->cache_dir : "");
	printf("libraries:   %s\n", i->libraries ? i->libraries : "");
	printf("backends:   ");
	for (size_t k = 0; k < i->n_backends; k++)
		printf(" %s", i->backends[k]);
	printf("\nqueue:       %u running, %u queued, %u CPU slot(s)\n", i->running, i->queued, i->cpu_slots);
	if (i->preempt && strcmp(i->preempt, "off") != 0)
		printf("preemption:  %s: a waiting job stops running jobs of a lower priority%s (not one "
		       "preempted in the last %u s)\n",
		       i->preempt, strcmp(i->preempt, "user") == 0 ? " of its own user" : "",
		       i->preempt_grace_s);
	else if (i->preempt)
		printf("preemption:  off: a running job is never stopped for another\n");
	printf("you:         %s (uid %u)%s\n", user_name(i->caller_uid, u, sizeof(u)), i->caller_uid,
	       i->caller_admin ? ", admin: you see every job" : "");
	printf("\n");
	print_devices(i->devices, i->n_devices);
	if (i->gpu_note && *i->gpu_note)
		printf("no CUDA GPU: %s\n", i->gpu_note);
}

static int cmd_info(const struct opts *o, int argc, char **argv)
{
	if (argc)
		return fail(CTL_USAGE, "info: takes no arguments");
	Traind__InfoRequest ir = TRAIND__INFO_REQUEST__INIT;
	Traind__Request req = TRAIND__REQUEST__INIT;
	req.call_case = TRAIND__REQUEST__CALL_INFO;
	req.info = &ir;
	Traind__Response *resp = NULL;
	int rc = call(o, &req, &resp);
	if (rc != CTL_OK)
		return rc;
	if (!resp->info)
		rc = fail(CTL_FAILED, "info: the daemon sent nothing");
	else
		print_result(o, &resp->info->base, human_info);
	rpc_response_free(resp);
	return rc;
}

/* ------------------------------------------------------------------------ */

static int cmd_help(const struct opts *o, int argc, char **argv);

static const struct command {
	const char *name;
	int (*fn)(const struct opts *o, int argc, char **argv);
	const char *usage;
} commands[] = {
	{"submit", cmd_submit,
	 "submit JOB.pb|JOB.txtpb [FLAGS] [--watch]\n"
	 "  submit --model DIR --data FILE --output DIR [--method full|lora|qlora|distill|classify]\n"
	 "         [--steps N] [--lr X] [--batch N] [--seq-len N] [--checkpoint-every N]\n"
	 "         [--eval FILE] [--name NAME] [--priority N] [--device cpu|gpu|any] [--gpus N]\n"
	 "         [--grad-accum N] (a step's micro-batches, shared by a gang's GPUs)\n"
	 "         [--recompute auto|none|selective|full|full-offload] [--selective-layers N]\n"
	 "         [--max-memory BYTES[K|M|G|T]]\n"
	 "         [--shard auto|none|optimizer|gradients|parameters] (a gang's state split over its GPUs)\n"
	 "         [--hosts tcp://HOST:PORT[,...]] (other daemons that run the job's next ranks)\n"
	 "         [--after ID[,ID...]] [--hold] [--watch]\n"
	 "      queue a job (flags override the file; relative paths are taken from here);\n"
	 "      prints its id"},
	{"ls", cmd_ls, "ls [--all] [--limit N]      your jobs, newest first (--all: everyone's; admins)"},
	{"show", cmd_show, "show ID                     a job, with its effective spec"},
	{"cancel", cmd_cancel, "cancel ID                   stop a job at its next step boundary"},
	{"hold", cmd_hold, "hold ID                     keep a queued job from starting"},
	{"release", cmd_release, "release ID                  let a held job start"},
	{"requeue", cmd_requeue,
	 "requeue ID                  run a FAILED or CANCELLED job again, from its last checkpoint"},
	{"priority", cmd_priority,
	 "priority ID N               a job's new priority (-100 .. 100; users up to the daemon's\n"
	 "                            user_priority_max)"},
	{"usage", cmd_usage,
	 "usage [--user U | --all] [--since DATE] [--jobs]\n"
	 "                            GPU-hours, GPU memory GiB-hours, CPU-slot hours, tokens, time\n"
	 "                            queued and running, per user (--jobs: per job too); DATE is\n"
	 "                            YYYY-MM-DD[ HH:MM], Nd or Nh ago, or @UNIX-SECONDS"},
	{"logs", cmd_logs, "logs ID [--follow]          a job's events and steps (--follow: as watch)"},
	{"watch", cmd_watch,
	 "watch ID [--reconnect S]    follow a job to its end: a progress bar with its ETA on a\n"
	 "                            terminal, lines otherwise; exits with the job's outcome. A\n"
	 "                            daemon that goes away is waited for S seconds (600; 0: exit 3)"},
	{"ledger", cmd_ledger,
	 "ledger                      GPUs and their VRAM reservations\n"
	 "  ledger reserve --gpu G --bytes N[K|M|G] [--pid PID] [--ttl S] [--note TEXT]\n"
	 "                            reserve VRAM for a program outside traind (held while PID,\n"
	 "                            default trainctl's parent, lives); prints the lease id\n"
	 "  ledger release LEASE"},
	{"cache", cmd_cache,
	 "cache [list|stats|clear]    the compiled GPU modules traind keeps (clear: root, the\n"
	 "                            admin group, or a user daemon's own user)"},
	{"info", cmd_info, "info                        the daemon, its devices and its queue"},
	{"top", cmd_top,
	 "top [--once] [--interval S] GPUs (reserved and used memory), running jobs (progress,\n"
	 "                            tokens/s, ETA) and the queue with why each job waits,\n"
	 "                            refreshed every S seconds (1) on a terminal, q quits; --once\n"
	 "                            or not on a terminal: one plain snapshot; --json: one JSON\n"
	 "                            object (info and the jobs that have not ended)"},
	{"help", cmd_help, "help                        this text"},
};
#define NCOMMANDS (sizeof(commands) / sizeof(commands[0]))

static void usage(FILE *f)
{
	fprintf(f, "usage: trainctl [--socket PATH] [--json] [--timeout SECONDS] COMMAND [ARGS]\n\n");
	for (size_t i = 0; i < NCOMMANDS; i++)
		fprintf(f, "  %s\n", commands[i].usage);
	fprintf(f,
		"\n--json prints JSON (watch and logs: one object per line).\n"
		"The socket is --socket, $TRAIND_SOCKET, $XDG_RUNTIME_DIR/traind.sock when a user\n"
		"daemon runs, else /run/traind/traind.sock.\n"
		"\nExit codes: 0 done (watch: the job succeeded); 1 the daemon refused or failed the\n"
		"request (watch: the job failed); 2 bad arguments or job file; 3 traind cannot be\n"
		"reached; 4 permission denied; 5 no such job, lease or GPU; 6 watch: the job was\n"
		"cancelled; 7 busy: over a limit, does not fit, or the daemon is stopping.\n");
}

static int cmd_help(const struct opts *o, int argc, char **argv)
{
	(void)o;
	(void)argc;
	(void)argv;
	usage(stdout);
	return CTL_OK;
}

int main(int argc, char **argv)
{
	struct opts o = {.timeout_ms = 60000, .reconnect_s = 600};
	int i = 1;
	for (; i < argc && argv[i][0] == '-'; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--json") == 0) {
			o.json = true;
		} else if (strcmp(a, "--socket") == 0 && i + 1 < argc) {
			o.socket = argv[++i];
		} else if (strcmp(a, "--timeout") == 0 && i + 1 < argc) {
			uint64_t s;
			if (!parse_u64(argv[++i], &s) || s == 0 || s > 86400)
				return fail(CTL_USAGE, "--timeout: give seconds, 1 .. 86400");
			o.timeout_ms = (int)s * 1000;
		} else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			usage(stdout);
			return CTL_OK;
		} else if (strcmp(a, "--version") == 0) {
			printf("trainctl %s (protocol %d)\n", TD_VERSION, RPC_PROTOCOL);
			return CTL_OK;
		} else {
			return fail(CTL_USAGE, "unknown option '%s' (trainctl help)", a);
		}
	}
	if (i >= argc) {
		usage(stderr);
		return CTL_USAGE;
	}
	/* --json may also follow the command. */
	int n = 0;
	char **rest = argv + i + 1;
	for (int k = 0; k < argc - i - 1; k++) {
		if (strcmp(rest[k], "--json") == 0)
			o.json = true;
		else
			rest[n++] = rest[k];
	}
	for (size_t k = 0; k < NCOMMANDS; k++)
		if (strcmp(argv[i], commands[k].name) == 0)
			return commands[k].fn(&o, n, rest);
	return fail(CTL_USAGE, "unknown command '%s' (trainctl help lists them)", argv[i]);
}
