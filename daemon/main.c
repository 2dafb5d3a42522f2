/* traind: the training daemon's entry point.
 *
 * With no mode flag it serves trainctl (daemon/server.h), configured from the
 * settings table (daemon/settings.h). One-shot modes, for a single job without
 * a daemon: `--run JOB` trains in the foreground, `--plan JOB` prints the
 * memory plan without loading weights, `--check JOB` prints the effective
 * spec. Exit codes of the one-shot modes: 0 success, 1 the job failed, 2 bad
 * usage or a bad spec, 3 the job stopped early (a checkpoint holds its
 * progress). Serving: 0 after a clean stop, 1 when it cannot start, 2 for bad
 * settings. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "daemon/journal.h"
#include "daemon/preflight.h"
#include "daemon/settings.h"
#include "daemon/server.h"
#include "gpu/comm.h"
#include "gpu/select.h"
#include "train/hfconfig.h"
#include "train/method.h"
#include "proto/err.h"
#include "proto/jobspec.h"
#include "proto/log.h"
#include "train/merge.h"
#include "train/trainer.h"

static volatile sig_atomic_t stop_requested;

static void on_signal(int sig)
{
	(void)sig;
	stop_requested = 1;
}

static bool should_stop(void *ctx)
{
	(void)ctx;
	return stop_requested != 0;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: traind [--system | --user] [--config FILE] [SETTINGS...]   serve trainctl\n"
		"       traind --dump-config [SETTINGS...]   print the effective settings\n"
		"       traind --run JOB [--backend cpu|cuda|auto] [--stop-after N] [--quiet]\n"
		"                [--cache-dir DIR] [--gpus N] [--devices I,J,...]\n"
		"       traind --plan JOB [--gpus N]\n"
		"       traind --check JOB\n"
		"       traind --merge BASE ADAPTER OUT [--backend cpu|cuda|auto]   (default cpu: fp32)\n"
		"       traind --message-id ID   the journald MESSAGE_ID of a message id\n"
		"       traind --version\n"
		"\n"
		"JOB is a traind.JobSpec as binary protobuf (.pb) or text format (.txtpb),\n"
		"the latter converted with protoc and the installed traind.proto.\n"
		"--run trains in the foreground: progress on stdout, checkpoints every\n"
		"output.checkpoint_every steps, the final model in output.dir. Run it again\n"
		"with the same spec to resume from the newest checkpoint. SIGINT/SIGTERM\n"
		"checkpoint and stop at the next step boundary (exit 3).\n"
		"--stop-after N stops the same way after N steps of this run.\n"
		"--gpus N trains data parallel on N GPUs (default: the job's resources.gpus),\n"
		"CUDA devices 0 .. N-1 or --devices; each runs its share of a step's\n"
		"hyper.grad_accum micro-batches (so grad_accum >= N). With --backend cpu\n"
		"the N ranks run on the CPU (for tests).\n"
		"--cache-dir DIR keeps the kernels compiled on this host (the module cache;\n"
		"default $XDG_CACHE_HOME/traind, else ~/.cache/traind; \"\" for none).\n"
		"--merge writes BASE (an HF model dir) with the PEFT LoRA adapter ADAPTER\n"
		"folded in (W + alpha/r * B A) as a full HF model dir OUT.\n"
		"\n"
		"Serving: SIGTERM/SIGINT checkpoint the running jobs and exit (they resume at\n"
		"the next start); SIGHUP reloads the settings marked [hup].\n"
		"\n");
	dmn_config_help(f);
}

/* The one-shot modes; anything else on the command line is serving. A new
 * mode goes here and into run_oneshot()'s argument loop. */
static const char *const oneshot_flags[] = {"--run", "--plan", "--check", "--merge",
					    "--message-id", NULL};

static bool is_oneshot(int argc, char **argv)
{
	for (int i = 1; i < argc; i++)
		for (const char *const *f = oneshot_flags; *f; f++)
			if (strcmp(argv[i], *f) == 0)
				return true;
	return false;
}

static int load_spec(const char *path, Traind__JobSpec **spec)
{
	struct td_errbuf eb = {{0}};
	td_err e = rpc_jobspec_load(spec, path, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_apply_defaults(*spec, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_validate(*spec, &eb);
	if (e != TD_OK) {
		fprintf(stderr, "traind: %s: %s\n", path, eb.msg[0] ? eb.msg : td_strerror(e));
		rpc_jobspec_free(*spec);
		*spec = NULL;
		return 2;
	}
	return 0;
}

static int serve_main(int argc, char **argv)
{
	bool dump = false;
	/* The settings parser sees everything but the actions. */
	char **args = calloc((size_t)argc + 1, sizeof(char *));
	int nargs = 0;
	if (!args) {
		fprintf(stderr, "traind: out of memory\n");
		return 1;
	}
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
			usage(stdout);
			free(args);
			return 0;
		} else if (strcmp(argv[i], "--version") == 0) {
			printf("traind %s\n", TD_VERSION);
			free(args);
			return 0;
		} else if (strcmp(argv[i], "--dump-config") == 0) {
			dump = true;
		} else {
			args[nargs++] = argv[i];
		}
	}
	static struct dmn_config cfg;
	struct td_errbuf eb = {{0}};
	if (dmn_config_load(&cfg, nargs, args, &eb) != TD_OK) {
		fprintf(stderr, "traind: %s\n", eb.msg);
		free(args);
		return 2;
	}
	int rc = 0;
	if (dump) {
		dmn_config_dump(&cfg, stdout);
	} else {
		dmn_journal_attach(); /* under systemd: structured lines */
		rc = dmn_serve(&cfg, nargs, args);
	}
	free(args);
	if (rc == DMN_SERVE_REEXEC) {
		/* The fault-injection test hook fires once per daemon, not once per
		 * process image: the new image must not fault again. */
		unsetenv("TD_CUDA_FAULT_AFTER_OPS");
		td_warn("TD-REEXEC", "re-executing traind to recover a GPU");
		fflush(NULL);
		execv("/proc/self/exe", argv);
		td_err_log("TD-REEXEC", "cannot re-execute /proc/self/exe: %s", strerror(errno));
		rc = 1;
	}
	return rc;
}

/* --run's module cache when --cache-dir is not given: the user's cache
 * directory, as the user-mode daemon's default cache_dir. NULL when neither
 * $XDG_CACHE_HOME nor $HOME says where (then nothing is cached). */
static const char *default_cache_dir(char *buf, size_t cap)
{
	const char *x = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
	int n;
	if (x && *x == '/')
		n = snprintf(buf, cap, "%s/traind", x);
	else if (home && *home == '/')
		n = snprintf(buf, cap, "%s/.cache/traind", home);
	else
		return NULL;
	return n > 0 && (size_t)n < cap ? buf : NULL;
}

/* traind --plan's last lines: what memory.recompute AUTO (and a gang's
 * memory.shard AUTO) takes on each GPU of this host, as the scheduler
 * would place the job now — the fastest combination whose lease (plan +
 * backend + context allowance, + NCCL's for a gang) the GPU grants (its
 * memory x vram_factor, and what is free now), in the scheduler's order:
 * each recompute policy with each sharding in dmn_auto_shard's order. The
 * settings are the daemon's (config file, environment); a teacher's plan
 * is not counted. */
static void print_auto_on_host(Traind__JobSpec *spec, FILE *out)
{
	const bool arc = dmn_recompute_is_auto(spec), ash = dmn_shard_is_auto(spec);
	if (!arc && !ash) {
		fprintf(out, "auto       memory.recompute is fixed by the spec (or bounded by memory.max_bytes)%s\n",
			spec->resources->gpus > 1 ? ", and so is memory.shard" : "");
		return;
	}
	struct td_errbuf eb = {{0}};
	struct dmn_config cfg;
	char *noargs[] = {NULL};
	if (dmn_config_load(&cfg, 0, noargs, &eb) != TD_OK) {
		fprintf(out, "auto       (the daemon's settings cannot be read: %s)\n", eb.msg);
		return;
	}
	struct gpu_device_info dev[16];
	int n = 0;
	if (gpu_devices_query(dev, 16, &n, &eb) != TD_OK || n == 0) {
		char why[512];
		gpu_devices_why(why, sizeof(why));
		fprintf(out, "auto       no CUDA GPU on this host (%s): on the CPU the policy is none\n",
			why[0] ? why : eb.msg);
		return;
	}
	char path[4096];
	snprintf(path, sizeof(path), "%s/config.json", spec->model_dir);
	struct tr_model_config mc;
	struct tr_plan_opts po;
	/* [shard][recompute]: the plans' totals and host bytes */
	size_t acts[TR_RECOMPUTE_COUNT], total[TR_SHARD_BUILT][TR_RECOMPUTE_COUNT],
		host[TR_SHARD_BUILT][TR_RECOMPUTE_COUNT];
	if (rpc_jobspec_resolve_precision(spec, true, &eb) != TD_OK ||
	    tr_config_load(&mc, path, &eb) != TD_OK ||
	    tr_method_plan_opts(spec, &mc, (int)spec->hyper->micro_batch, (int)spec->data->seq_len,
				&po, &eb) != TD_OK ||
	    tr_plan_policy_bytes(&mc, &po, acts, total[0], host[0], &eb) != TD_OK) {
		fprintf(out, "auto       (%s)\n", eb.msg);
		return;
	}
	struct tr_plan_opts so = po;
	for (int sk = TR_SHARD_OPTIMIZER; ash && sk < TR_SHARD_BUILT; sk++) {
		so.shard = (enum tr_shard)sk;
		if (tr_plan_policy_bytes(&mc, &so, acts, total[sk], host[sk], &eb) != TD_OK) {
			fprintf(out, "auto       (%s)\n", eb.msg);
			return;
		}
	}
	const unsigned ngpus = spec->resources->gpus;
	const uint64_t extra = (uint64_t)GPU_CUDA_FIXED_BYTES + ((uint64_t)cfg.cuda_context_mib << 20) +
			       (ngpus > 1 ? GPU_NCCL_RESERVE_BYTES : 0);
	const int k0 = arc ? 0 : (int)po.recompute, k1 = arc ? TR_RECOMPUTE_COUNT : k0 + 1;
	const int nsh = ash ? TR_SHARD_BUILT : 1;
	for (int i = 0; i < n; i++) {
		uint64_t share = (uint64_t)((long double)dev[i].total_bytes * (long double)cfg.vram_factor);
		uint64_t avail = share < dev[i].free_bytes ? share : dev[i].free_bytes;
		/* combination c: policy c / nsh with AUTO's (c % nsh)-th sharding */
#define SHARD_OF(c) (ash ? (int)dmn_auto_shard((c) % nsh) : 0)
		int c = k0 * nsh;
		while (c < k1 * nsh && total[SHARD_OF(c)][c / nsh] + extra > avail)
			c++;
		fprintf(out, "auto       GPU %d (%s): grants %.2f GiB now (%.2f GiB x vram_factor %.2f, "
			"%.2f GiB free): ",
			dev[i].index, dev[i].name, (double)avail / (1 << 30),
			(double)dev[i].total_bytes / (1 << 30), cfg.vram_factor,
			(double)dev[i].free_bytes / (1 << 30));
		if (c == k1 * nsh)
			c = k1 * nsh - 1; /* the smallest lease, which does not fit */
		int k = c / nsh;
		const int sh = SHARD_OF(c);
#undef SHARD_OF
		/* AUTO on FULL or FULL_OFFLOAD, one GPU: the selective layers
		 * the scheduler adds while the GPU grants them (each the same
		 * bytes: tr_method_selective_layer_bytes) */
		uint64_t per = 0, lease = total[sh][k] + extra;
		int more = 0;
		if (arc && lease <= avail &&
		    tr_method_selective_layer_bytes(spec, &mc, &po, k, total[sh][k], &per, &eb) == TD_OK &&
		    per) {
			more = tr_method_selective_fit(avail - lease, per,
						       mc.num_layers - po.selective_layers);
			lease += (uint64_t)more * per;
		}
		/* FULL_OFFLOAD in FULL's place where the bytes FULL was granted
		 * hold more selective layers with the checkpoints on the host
		 * (and the pinned bytes are left: here, with no job running) */
		const int fo = TR_RECOMPUTE_FULL_OFFLOAD;
		const uint64_t lease_fo = total[sh][fo] + extra;
		uint64_t per_fo = 0;
		int over = -1; /* FULL's selective layers, where FULL_OFFLOAD took over */
		if (arc && k == TR_RECOMPUTE_FULL && per && ngpus <= 1 && lease <= avail &&
		    host[sh][fo] && host[sh][fo] <= dmn_config_pinned_max(&cfg) && lease_fo <= avail &&
		    tr_method_selective_layer_bytes(spec, &mc, &po, fo, total[sh][fo], &per_fo, &eb) ==
			    TD_OK &&
		    per_fo) {
			const int m = tr_method_selective_fit(avail - lease_fo, per_fo,
							      mc.num_layers - po.selective_layers);
			if (m > more) {
				over = po.selective_layers + more;
				k = fo;
				more = m;
				lease = lease_fo + (uint64_t)m * per_fo;
			}
		}
		char what[160], sel[64] = "";
		if (more > 0)
			snprintf(sel, sizeof(sel), " with its first %d layers selective",
				 po.selective_layers + more);
		snprintf(what, sizeof(what), "%s%s%s%s", tr_recompute_name((enum tr_recompute)k), sel,
			 ngpus > 1 ? ", shard " : "",
			 ngpus > 1 ? tr_shard_name(ash ? (enum tr_shard)sh : po.shard) : "");
		if (lease > avail)
			fprintf(out, "nothing fits (%s's lease is %.2f GiB)\n", what,
				(double)(total[sh][k] + extra) / (1 << 30));
		else if (host[sh][k] && over >= 0)
			fprintf(out,
				"%s (lease %.2f GiB, and %.2f GiB of pinned host memory; full would "
				"have %d selective layers)\n",
				what, (double)lease / (1 << 30), (double)host[sh][k] / (1 << 30), over);
		else if (host[sh][k])
			fprintf(out, "%s (lease %.2f GiB, and %.2f GiB of pinned host memory)\n", what,
				(double)lease / (1 << 30), (double)host[sh][k] / (1 << 30));
		else
			fprintf(out, "%s (lease %.2f GiB)\n", what, (double)lease / (1 << 30));
	}
}

static int run_oneshot(int argc, char **argv)
{
	const char *run = NULL, *plan = NULL, *check = NULL, *backend = NULL;
	const char *cache_dir = NULL;
	bool has_cache_dir = false;
	const char *merge[3] = {NULL, NULL, NULL}; /* BASE ADAPTER OUT */
	unsigned long long stop_after = 0;
	bool quiet = false;
	int gpus = 0, devices[GPU_GANG_MAX], ndevices = 0;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--run") == 0 && i + 1 < argc)
			run = argv[++i];
		else if (strcmp(a, "--plan") == 0 && i + 1 < argc)
			plan = argv[++i];
		else if (strcmp(a, "--check") == 0 && i + 1 < argc)
			check = argv[++i];
		else if (strcmp(a, "--merge") == 0 && i + 3 < argc) {
			merge[0] = argv[++i];
			merge[1] = argv[++i];
			merge[2] = argv[++i];
		}
		else if (strcmp(a, "--message-id") == 0 && i + 1 < argc) {
			/* journalctl MESSAGE_ID=$(traind --message-id TD-JOB-FAIL) */
			char mid[33];
			td_log_message_id(argv[++i], mid);
			printf("%s\n", mid);
			return 0;
		} else if (strcmp(a, "--backend") == 0 && i + 1 < argc)
			backend = argv[++i];
		else if (strcmp(a, "--cache-dir") == 0 && i + 1 < argc) {
			cache_dir = argv[++i];
			has_cache_dir = true;
		} else if (strcmp(a, "--gpus") == 0 && i + 1 < argc) {
			char *end;
			long v = strtol(argv[++i], &end, 10);
			if (*end || v < 1 || v > GPU_GANG_MAX) {
				fprintf(stderr, "traind: --gpus: '%s' is not a count of 1 to %d\n", argv[i],
					GPU_GANG_MAX);
				return 2;
			}
			gpus = (int)v;
		} else if (strcmp(a, "--devices") == 0 && i + 1 < argc) {
			char *p = argv[++i], *end;
			for (ndevices = 0; *p;) {
				long v = strtol(p, &end, 10);
				if (end == p || v < 0 || v > 1024 || ndevices == GPU_GANG_MAX ||
				    (*end && *end != ',')) {
					fprintf(stderr, "traind: --devices: '%s' is not a list of CUDA "
							"ordinals (0,1,...)\n", argv[i]);
					return 2;
				}
				devices[ndevices++] = (int)v;
				p = *end ? end + 1 : end;
			}
		} else if (strcmp(a, "--stop-after") == 0 && i + 1 < argc)
			stop_after = strtoull(argv[++i], NULL, 10);
		else if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0)
			quiet = true;
		else if (strcmp(a, "--version") == 0) {
			printf("traind %s\n", TD_VERSION);
			return 0;
		} else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
			usage(stdout);
			return 0;
		} else {
			fprintf(stderr, "traind: unknown or incomplete argument '%s'\n", a);
			usage(stderr);
			return 2;
		}
	}
	if (!!run + !!plan + !!check + !!merge[0] != 1) {
		fprintf(stderr, "traind: give exactly one of --run, --plan, --check, --merge (or none of them to serve)\n");
		usage(stderr);
		return 2;
	}
	if (merge[0]) {
		struct td_errbuf meb = {{0}};
		/* fp32 by default: B A is small next to W, and a merged model is forever. */
		td_err e = tr_merge(merge[0], merge[1], merge[2], backend ? backend : "cpu",
				    quiet ? NULL : stdout, &meb);
		if (e != TD_OK)
			fprintf(stderr, "traind: merge: %s\n", meb.msg[0] ? meb.msg : td_strerror(e));
		return e == TD_OK ? 0 : 1;
	}

	Traind__JobSpec *spec = NULL;
	int rc = load_spec(run ? run : plan ? plan : check, &spec);
	if (rc)
		return rc;
	struct td_errbuf eb = {{0}};
	if (check) {
		rpc_jobspec_print(spec, stdout);
		rpc_jobspec_free(spec);
		return 0;
	}
	if (plan) {
		if (gpus) { /* --plan --gpus N: each GPU's plan in a gang of N */
			spec->resources->has_gpus = true;
			spec->resources->gpus = (uint32_t)gpus;
		}
		td_err e = tr_train_plan(spec, stdout, &eb);
		if (e != TD_OK)
			fprintf(stderr, "traind: %s: %s\n", plan, eb.msg[0] ? eb.msg : td_strerror(e));
		else
			print_auto_on_host(spec, stdout);
		rpc_jobspec_free(spec);
		return e == TD_OK ? 0 : 2;
	}

	if (spec->resources->n_hosts) {
		/* Its other ranks would wait for daemons that are never asked. */
		fprintf(stderr,
			"traind: %s: resources.hosts: --run trains in this process only; submit a job "
			"across daemons to a daemon with peer_listen\n",
			run);
		rpc_jobspec_free(spec);
		return 2;
	}
	struct sigaction sa = {.sa_handler = on_signal};
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	setvbuf(stdout, NULL, _IOLBF, 0);

	char cache_buf[4096];
	if (!has_cache_dir)
		cache_dir = default_cache_dir(cache_buf, sizeof(cache_buf));
	struct tr_train_opts opts = {.backend = backend,
				     .log = quiet ? NULL : stdout,
				     .stop_after = stop_after,
				     .cache_dir = cache_dir && *cache_dir ? cache_dir : NULL};
	/* Data parallel: --gpus, else the job's resources.gpus. */
	if (!gpus)
		gpus = ndevices ? ndevices : spec->resources->gpus > 1 ? (int)spec->resources->gpus : 1;
	if (ndevices && ndevices != gpus) {
		fprintf(stderr, "traind: --devices names %d devices for %d GPUs\n", ndevices, gpus);
		rpc_jobspec_free(spec);
		return 2;
	}
	if (gpus > GPU_GANG_MAX) {
		fprintf(stderr, "traind: resources.gpus %d: at most %d\n", gpus, GPU_GANG_MAX);
		rpc_jobspec_free(spec);
		return 2;
	}
	opts.ranks = gpus;
	opts.devices = ndevices ? devices : NULL;
	struct tr_hooks hooks = {.should_stop = should_stop};
	struct tr_train_result res;
	td_err e = tr_train(spec, &opts, &hooks, &res, &eb);
	if (e != TD_OK) {
		td_err_log("TD-JOB-FAIL", "job %s failed: %s", spec->name, eb.msg[0] ? eb.msg : td_strerror(e));
		fprintf(stderr, "traind: job %s failed: %s\n", spec->name, eb.msg[0] ? eb.msg : td_strerror(e));
		rpc_jobspec_free(spec);
		return 1;
	}
	if (res.stopped) {
		printf("stopped at step %llu/%llu; run again to resume from the checkpoint\n",
		       (unsigned long long)res.steps_done, (unsigned long long)res.total_steps);
		rpc_jobspec_free(spec);
		return 3;
	}
	printf("done: %llu steps, loss %.4f -> %.4f, model in %s\n",
	       (unsigned long long)res.steps_done, res.first_loss, res.last_loss, res.output_dir);
	rpc_jobspec_free(spec);
	return 0;
}

int main(int argc, char **argv)
{
	/* NCCL's NVLink multicast (NVLS) stays off unless asked for: on a
	 * host of shared GPUs a program using it can put them out of service.
	 * Set before any thread: NCCL reads it when a gang's communicators
	 * are made. */
	setenv("NCCL_NVLS_ENABLE", "0", 0);
	return is_oneshot(argc, argv) ? run_oneshot(argc, argv) : serve_main(argc, argv);
}
