/* parity DIR [--backend cpu|cuda] [--verbose]: run a reference fixture's
 * computation with traind and compare with what the reference implementations
 * (transformers, PEFT, tokenizers) computed.
 *
 * DIR's layout decides what runs:
 *   tokenizer.json + cases.json                  the tokenizer (parity_tokenizer.c)
 *   manifest.json naming base/student/teacher,
 *   or a classification manifest (pooling)        LoRA, distillation, classification (parity_methods.c)
 *   config.json + reference.safetensors          a causal LM (parity_causal.c)
 * Any sizes work: everything is read from the files. Exit 0 when every group
 * is within tolerance, 1 when one is not, 2 when the fixture could not be run,
 * 77 (skipped) when the asked-for GPU backend is not available here. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/select.h"
#include "tests/parity.h"

#define MAX_GROUPS 24

static struct group {
	char name[48];
	double tol;
	bool absolute;
	int count, failed;
	double worst_norm, worst_abs;
} groups[MAX_GROUPS];
static int ngroups;
static bool verbose;
bool parity_bf16;

td_err parity_open_backend(const struct parity_opts *o, struct gpu_backend **be, struct td_errbuf *eb)
{
	td_err e = gpu_backend_open(be, o->backend, eb);
	if (e == TD_OK && (e = gpu_set_bf16(*be, o->bf16, eb)) != TD_OK) {
		gpu_backend_free(*be);
		*be = NULL;
	}
	return e;
}

int parity_group(const char *name, double tol, bool absolute)
{
	for (int i = 0; i < ngroups; i++)
		if (strcmp(groups[i].name, name) == 0)
			return i;
	if (ngroups == MAX_GROUPS) {
		fprintf(stderr, "parity: too many groups\n");
		exit(2);
	}
	struct group *g = &groups[ngroups];
	snprintf(g->name, sizeof(g->name), "%s", name);
	g->tol = tol;
	g->absolute = absolute;
	return ngroups++;
}

void parity_compare(int gi, const char *name, const float *got, const float *want, size_t n)
{
	struct group *g = &groups[gi];
	double maxdiff = 0, maxref = 0;
	bool nonfinite = false;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - (double)want[i]);
		if (!isfinite(got[i]) || !isfinite(d))
			nonfinite = true;
		if (d > maxdiff)
			maxdiff = d;
		if (fabs(want[i]) > maxref)
			maxref = fabs(want[i]);
	}
	double norm = maxref > 0 ? maxdiff / maxref : maxdiff;
	double err = g->absolute ? maxdiff : norm;
	g->count++;
	if (norm > g->worst_norm)
		g->worst_norm = norm;
	if (maxdiff > g->worst_abs)
		g->worst_abs = maxdiff;
	bool bad = nonfinite || err > g->tol;
	g->failed += bad;
	if (verbose || bad)
		printf("  %-4s %-60s normwise %.3e  abs %.3e\n", bad ? "FAIL" : "ok", name, norm, maxdiff);
}

void parity_compare_scalar(int g, const char *name, double got, double want)
{
	float a = (float)got, b = (float)want;
	parity_compare(g, name, &a, &b, 1);
}

void parity_fail(int g, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	printf("  FAIL ");
	vprintf(fmt, ap);
	printf("\n");
	va_end(ap);
	groups[g].count++;
	groups[g].failed++;
}

int parity_report(void)
{
	int failed = 0;
	printf("%-24s %8s %14s %14s %10s  %s\n", "group", "checks", "max normwise", "max abs",
	       "tolerance", "result");
	for (int i = 0; i < ngroups; i++) {
		const struct group *g = &groups[i];
		printf("%-24s %8d %14.3e %14.3e %9.0e%s  %s\n", g->name, g->count, g->worst_norm,
		       g->worst_abs, g->tol, g->absolute ? "a" : " ", g->failed ? "FAIL" : "pass");
		failed += g->failed;
	}
	printf("%s\n", failed ? "PARITY FAILED" : "PARITY OK");
	return failed;
}

int parity_die(const char *what, td_err e, const struct td_errbuf *eb)
{
	fprintf(stderr, "parity: %s: %s (%s)\n", what, eb && eb->msg[0] ? eb->msg : td_strerror(e),
		td_errname(e));
	return 2;
}

double parity_jnum(struct json_object *o, const char *key, double dflt)
{
	struct json_object *v;
	if (o && json_object_object_get_ex(o, key, &v))
		return json_object_get_double(v);
	return dflt;
}

static bool exists(const char *dir, const char *file)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/%s", dir, file);
	return access(path, F_OK) == 0;
}

static int usage(void)
{
	fprintf(stderr, "usage: parity DIR [--backend cpu|cuda] [--precision fp32|bf16] [--verbose]\n");
	return 2;
}

int main(int argc, char **argv)
{
	struct parity_opts o = {.backend = "cpu"};
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
			o.backend = argv[++i];
		else if (strcmp(argv[i], "--precision") == 0 && i + 1 < argc) {
			const char *p = argv[++i];
			if (strcmp(p, "bf16") && strcmp(p, "fp32"))
				return usage();
			o.bf16 = strcmp(p, "bf16") == 0;
		} else if (strcmp(argv[i], "--verbose") == 0 || strcmp(argv[i], "-v") == 0)
			o.verbose = true;
		else if (argv[i][0] != '-' && !o.dir)
			o.dir = argv[i];
		else
			return usage();
	}
	if (!o.dir)
		return usage();
	verbose = o.verbose;
	parity_bf16 = o.bf16;

	/* No GPU here: the gpu suite reports itself skipped, not passed. */
	if (strcmp(o.backend, "cpu") != 0) {
		struct gpu_backend *be = NULL;
		struct td_errbuf eb = {{0}};
		td_err e = gpu_backend_open(&be, o.backend, &eb);
		if (e == TD_EUNSUPPORTED && strcmp(o.backend, "cpu") != 0) {
			printf("SKIP: %s\n", eb.msg);
			return 77;
		}
		if (e != TD_OK)
			return parity_die("backend", e, &eb);
		gpu_backend_free(be);
	}

	if (exists(o.dir, "cases.json") && exists(o.dir, "tokenizer.json"))
		return parity_tokenizer(&o);

	char path[4096];
	snprintf(path, sizeof(path), "%s/manifest.json", o.dir);
	if (exists(o.dir, "manifest.json")) {
		o.manifest = json_object_from_file(path);
		if (!o.manifest) {
			fprintf(stderr, "parity: %s: cannot parse: %s\n", path, json_util_get_last_err());
			return 2;
		}
	}
	static const char *const method_keys[] = {"base", "student", "teacher", "pooling"};
	int rc = -1;
	for (size_t i = 0; o.manifest && i < sizeof(method_keys) / sizeof(method_keys[0]); i++) {
		struct json_object *v;
		if (json_object_object_get_ex(o.manifest, method_keys[i], &v)) {
			rc = parity_methods(&o);
			break;
		}
	}
	if (rc < 0) {
		if (!exists(o.dir, "reference.safetensors")) {
			fprintf(stderr, "parity: %s: not a fixture dir (no cases.json + tokenizer.json, no reference.safetensors)\n",
				o.dir);
			rc = 2;
		} else {
			rc = parity_causal(&o);
		}
	}
	json_object_put(o.manifest);
	return rc;
}
