/* traind: the training daemon's entry point.
 *
 * This build runs one job in the foreground (`--run JOB`), prints a job's
 * memory plan without loading weights (`--plan JOB`), and checks a spec
 * (`--check JOB`). Serving trainctl over nng comes with the control-plane
 * issue. Exit codes: 0 success, 1 the job failed, 2 bad usage or a bad spec,
 * 3 the job stopped early (a checkpoint holds its progress). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "proto/err.h"
#include "proto/jobspec.h"
#include "proto/log.h"
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
		"usage: traind --run JOB [--backend cpu|cuda|auto] [--stop-after N] [--quiet]\n"
		"       traind --plan JOB\n"
		"       traind --check JOB\n"
		"       traind --version\n"
		"\n"
		"JOB is a traind.JobSpec as binary protobuf (.pb) or text format (.txtpb),\n"
		"the latter converted with protoc and the installed traind.proto.\n"
		"--run trains in the foreground: progress on stdout, checkpoints every\n"
		"output.checkpoint_every steps, the final model in output.dir. Run it again\n"
		"with the same spec to resume from the newest checkpoint. SIGINT/SIGTERM\n"
		"checkpoint and stop at the next step boundary (exit 3).\n"
		"--stop-after N stops the same way after N steps of this run.\n");
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

int main(int argc, char **argv)
{
	const char *run = NULL, *plan = NULL, *check = NULL, *backend = NULL;
	unsigned long long stop_after = 0;
	bool quiet = false;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (strcmp(a, "--run") == 0 && i + 1 < argc)
			run = argv[++i];
		else if (strcmp(a, "--plan") == 0 && i + 1 < argc)
			plan = argv[++i];
		else if (strcmp(a, "--check") == 0 && i + 1 < argc)
			check = argv[++i];
		else if (strcmp(a, "--backend") == 0 && i + 1 < argc)
			backend = argv[++i];
		else if (strcmp(a, "--stop-after") == 0 && i + 1 < argc)
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
	if (!!run + !!plan + !!check != 1) {
		fprintf(stderr, "traind: give exactly one of --run, --plan, --check (serving comes with the control plane)\n");
		usage(stderr);
		return 2;
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
		td_err e = tr_train_plan(spec, stdout, &eb);
		if (e != TD_OK)
			fprintf(stderr, "traind: %s: %s\n", plan, eb.msg[0] ? eb.msg : td_strerror(e));
		rpc_jobspec_free(spec);
		return e == TD_OK ? 0 : 2;
	}

	struct sigaction sa = {.sa_handler = on_signal};
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	setvbuf(stdout, NULL, _IOLBF, 0);

	struct tr_train_opts opts = {.backend = backend, .log = quiet ? NULL : stdout, .stop_after = stop_after};
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
