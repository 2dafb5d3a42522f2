/* parity DIR [--backend cpu|cuda] [--verbose]: run a reference fixture's
 * computation on a backend and compare with what transformers computed.
 *
 * DIR is laid out like shared/fixtures/<name>/: a Hugging Face model dir
 * (config.json + weights; or a manifest.json naming the model dir relative to
 * DIR under "base"/"model_dir"), reference.safetensors with input_ids and labels
 * (B, T) and the reference tensors, and manifest.json with the training
 * settings ("train": lr, betas, eps, weight_decay, clip_norm, steps) and the
 * per-step losses. Any sizes work: everything is read from the files.
 *
 * Groups and tolerances (shared/fixtures/README.md), error normwise per tensor
 * max|a-b|/max|b| unless stated:
 *   logits, hidden.N, loss     1e-5
 *   grad.*                     1e-4
 *   after1.*, after3.*, afterK 1e-4 absolute
 * Exit 0 when every group is within tolerance, 1 when one is not, 2 on error. */
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/backend.h"
#include "gpu/select.h"
#include "train/model.h"
#include "train/modeldir.h"

enum group { G_LOGITS, G_HIDDEN, G_LOSS, G_GRAD, G_AFTER, G_COUNT };

static const struct {
	const char *name;
	double tol;
	int absolute;
} groups[G_COUNT] = {
	[G_LOGITS] = {"logits", 1e-5, 0},
	[G_HIDDEN] = {"hidden", 1e-5, 0},
	[G_LOSS] = {"loss", 1e-5, 0},
	[G_GRAD] = {"grad", 1e-4, 0},
	[G_AFTER] = {"params after steps", 1e-4, 1},
};

struct stats {
	int count;
	double worst_norm, worst_abs;
	char worst_name[128];
	int failed;
};

static struct stats st[G_COUNT];
static int verbose;

static void compare(enum group g, const char *name, const float *got, const float *want, size_t n)
{
	double maxdiff = 0, maxref = 0;
	int nan = 0;
	for (size_t i = 0; i < n; i++) {
		double d = fabs((double)got[i] - (double)want[i]);
		if (!isfinite(got[i]))
			nan = 1;
		if (d > maxdiff)
			maxdiff = d;
		if (fabs(want[i]) > maxref)
			maxref = fabs(want[i]);
	}
	double norm = maxref > 0 ? maxdiff / maxref : maxdiff;
	double err = groups[g].absolute ? maxdiff : norm;
	struct stats *s = &st[g];
	s->count++;
	if (err > (groups[g].absolute ? s->worst_abs : s->worst_norm) || s->count == 1)
		snprintf(s->worst_name, sizeof(s->worst_name), "%s", name);
	if (norm > s->worst_norm)
		s->worst_norm = norm;
	if (maxdiff > s->worst_abs)
		s->worst_abs = maxdiff;
	int bad = nan || err > groups[g].tol;
	s->failed += bad;
	if (verbose || bad)
		printf("  %-4s %-58s normwise %.3e  abs %.3e\n", bad ? "FAIL" : "ok", name, norm,
		       maxdiff);
}

static void compare_scalar(enum group g, const char *name, double got, double want)
{
	float a = (float)got, b = (float)want;
	compare(g, name, &a, &b, 1);
}

static int die(const char *what, td_err e, const struct td_errbuf *eb)
{
	fprintf(stderr, "parity: %s: %s (%s)\n", what, eb->msg[0] ? eb->msg : td_strerror(e),
		td_errname(e));
	return 2;
}

static double jnum(struct json_object *o, const char *key, double dflt)
{
	struct json_object *v;
	if (o && json_object_object_get_ex(o, key, &v))
		return json_object_get_double(v);
	return dflt;
}

int main(int argc, char **argv)
{
	const char *dir = NULL, *backend = "cpu";
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
			backend = argv[++i];
		else if (strcmp(argv[i], "--verbose") == 0 || strcmp(argv[i], "-v") == 0)
			verbose = 1;
		else if (argv[i][0] != '-' && !dir)
			dir = argv[i];
		else {
			fprintf(stderr, "usage: parity DIR [--backend cpu|cuda] [--verbose]\n");
			return 2;
		}
	}
	if (!dir) {
		fprintf(stderr, "usage: parity DIR [--backend cpu|cuda] [--verbose]\n");
		return 2;
	}

	struct td_errbuf eb = {{0}};
	char path[4096], model_dir[4096];
	td_err e;

	/* manifest.json: training settings and the reference losses. */
	snprintf(path, sizeof(path), "%s/manifest.json", dir);
	struct json_object *man = json_object_from_file(path);
	if (!man) {
		fprintf(stderr, "parity: %s: cannot read or parse (%s)\n", path,
			json_util_get_last_err());
		return 2;
	}
	struct json_object *train = NULL, *losses = NULL, *norms = NULL, *v;
	json_object_object_get_ex(man, "train", &train);
	json_object_object_get_ex(man, "losses", &losses);
	json_object_object_get_ex(man, "grad_norms_before_clip", &norms);
	snprintf(model_dir, sizeof(model_dir), "%s", dir);
	if (json_object_object_get_ex(man, "model_dir", &v))
		snprintf(model_dir, sizeof(model_dir), "%s/%s", dir, json_object_get_string(v));
	/* The LoRA, classification and distillation layouts come with the methods issue. */
	static const char *const method_keys[] = {"base", "student", "teacher", "pooling"};
	for (size_t i = 0; i < sizeof(method_keys) / sizeof(method_keys[0]); i++) {
		if (json_object_object_get_ex(man, method_keys[i], &v)) {
			fprintf(stderr, "parity: %s: manifest key '%s': this build runs causal-LM fixtures only\n",
				dir, method_keys[i]);
			json_object_put(man);
			return 2;
		}
	}

	struct tr_model_config cfg;
	snprintf(path, sizeof(path), "%s/config.json", model_dir);
	if ((e = tr_config_load(&cfg, path, &eb)) != TD_OK)
		return die("config", e, &eb);
	struct tr_weights *w = NULL;
	if ((e = tr_weights_open(&w, model_dir, &eb)) != TD_OK)
		return die("weights", e, &eb);
	struct tr_st_file *ref = NULL;
	snprintf(path, sizeof(path), "%s/reference.safetensors", dir);
	if ((e = tr_st_open(&ref, path, &eb)) != TD_OK)
		return die("reference", e, &eb);

	const struct tr_st_tensor *tids = tr_st_find(ref, "input_ids");
	const struct tr_st_tensor *tlab = tr_st_find(ref, "labels");
	if (!tids || tids->ndim != 2 || (tlab && (tlab->ndim != 2 || tlab->numel != tids->numel))) {
		fprintf(stderr, "parity: %s: needs input_ids (B, T) and labels of the same shape\n", path);
		return 2;
	}
	int B = (int)tids->shape[0], T = (int)tids->shape[1];
	int32_t *ids = malloc((size_t)B * T * sizeof(int32_t));
	int32_t *labels = malloc((size_t)B * T * sizeof(int32_t));
	if ((e = tr_st_to_i32(ids, tids, &eb)) != TD_OK)
		return die("input_ids", e, &eb);
	if (tlab) {
		if ((e = tr_st_to_i32(labels, tlab, &eb)) != TD_OK)
			return die("labels", e, &eb);
	} else {
		memcpy(labels, ids, (size_t)B * T * sizeof(int32_t));
	}

	struct gpu_backend *be = NULL;
	if ((e = gpu_backend_open(&be, backend, &eb)) != TD_OK)
		return die("backend", e, &eb);
	struct tr_model *m = NULL;
	struct tr_plan_opts po = {.B = B, .T = T};
	if ((e = tr_model_new(&m, be, &cfg, &po, &eb)) != TD_OK)
		return die("model", e, &eb);
	if ((e = tr_model_load(m, w, &eb)) != TD_OK)
		return die("load", e, &eb);
	const struct tr_plan *plan = tr_model_plan(m);

	printf("parity %s on %s: %s, B=%d T=%d, %zu parameters\n", dir, be->ops->name,
	       cfg.model_type, B, T, plan->numel_params);

	size_t maxn = (size_t)B * T * (size_t)cfg.vocab_size;
	for (size_t i = 0; i < plan->nparams; i++)
		if (plan->params[i].numel > maxn)
			maxn = plan->params[i].numel;
	float *got = malloc(maxn * sizeof(float)), *want = malloc(maxn * sizeof(float));

	struct tr_adamw hp = {
		.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
	struct json_object *betas;
	if (train && json_object_object_get_ex(train, "betas", &betas) &&
	    json_object_array_length(betas) == 2) {
		hp.beta1 = (float)json_object_get_double(json_object_array_get_idx(betas, 0));
		hp.beta2 = (float)json_object_get_double(json_object_array_get_idx(betas, 1));
	}
	hp.eps = (float)jnum(train, "eps", hp.eps);
	hp.weight_decay = (float)jnum(train, "weight_decay", hp.weight_decay);
	float lr = (float)jnum(train, "lr", 1e-3);
	double clip = jnum(train, "clip_norm", 1.0);
	int steps = (int)jnum(train, "steps", 3);

	for (int step = 1; step <= steps; step++) {
		double loss_sum;
		int64_t nvalid;
		if ((e = tr_model_forward(m, ids, labels, &loss_sum, &nvalid, &eb)) != TD_OK)
			return die("forward", e, &eb);
		double loss = nvalid ? loss_sum / (double)nvalid : 0;
		char name[160];
		if (losses && (size_t)step <= json_object_array_length(losses)) {
			snprintf(name, sizeof(name), "loss (step %d)", step);
			compare_scalar(G_LOSS, name,
				       loss, json_object_get_double(json_object_array_get_idx(losses, step - 1)));
		}
		if (step == 1) {
			const struct tr_st_tensor *t = tr_st_find(ref, "logits");
			if (t && (size_t)t->numel == (size_t)B * T * cfg.vocab_size) {
				tr_model_get_logits(m, got);
				tr_st_to_f32(want, t, &eb);
				compare(G_LOGITS, "logits", got, want, (size_t)t->numel);
			}
			for (int i = 0; i <= cfg.num_layers; i++) {
				snprintf(name, sizeof(name), "hidden.%d", i);
				t = tr_st_find(ref, name);
				if (!t)
					continue;
				tr_model_get_hidden(m, i, got);
				tr_st_to_f32(want, t, &eb);
				compare(G_HIDDEN, name, got, want, (size_t)t->numel);
			}
		}
		tr_model_zero_grad(m);
		tr_model_backward(m, nvalid ? (float)(1.0 / (double)nvalid) : 0.0f);
		if (step == 1) {
			for (size_t i = 0; i < plan->nparams; i++) {
				const struct tr_param *p = &plan->params[i];
				snprintf(name, sizeof(name), "grad.%s", p->name);
				const struct tr_st_tensor *t = tr_st_find(ref, name);
				if (!t) {
					printf("  FAIL %s: no reference tensor\n", name);
					st[G_GRAD].failed++;
					continue;
				}
				tr_model_get_grad(m, p, got);
				tr_st_to_f32(want, t, &eb);
				compare(G_GRAD, name, got, want, p->numel);
			}
		}
		double norm = tr_model_clip_grads(m, clip);
		if (norms && (size_t)step <= json_object_array_length(norms)) {
			double rn = json_object_get_double(json_object_array_get_idx(norms, step - 1));
			if (verbose || fabs(norm - rn) > 1e-4 * rn)
				printf("  %-4s grad norm before clip (step %d): %.7g vs %.7g\n",
				       fabs(norm - rn) > 1e-4 * rn ? "FAIL" : "ok", step, norm, rn);
			st[G_GRAD].failed += fabs(norm - rn) > 1e-4 * rn;
		}
		tr_model_adamw(m, &hp, lr, step);
		for (size_t i = 0; i < plan->nparams; i++) {
			const struct tr_param *p = &plan->params[i];
			snprintf(name, sizeof(name), "after%d.%s", step, p->name);
			const struct tr_st_tensor *t = tr_st_find(ref, name);
			if (!t)
				continue;
			tr_model_get_param(m, p, got);
			tr_st_to_f32(want, t, &eb);
			compare(G_AFTER, name, got, want, p->numel);
		}
	}
	if ((e = gpu_sync(be, &eb)) != TD_OK)
		return die("backend", e, &eb);

	int failed = 0;
	printf("%-20s %8s %14s %14s %10s  %s\n", "group", "tensors", "max normwise", "max abs",
	       "tolerance", "result");
	for (int g = 0; g < G_COUNT; g++) {
		if (!st[g].count)
			continue;
		printf("%-20s %8d %14.3e %14.3e %9.0e%s  %s\n", groups[g].name, st[g].count,
		       st[g].worst_norm, st[g].worst_abs, groups[g].tol, groups[g].absolute ? "a" : " ",
		       st[g].failed ? "FAIL" : "pass");
		failed += st[g].failed;
	}
	if (!st[G_GRAD].count || !st[G_AFTER].count) {
		printf("parity: %s has no grad.* or after*.* references\n", dir);
		failed++;
	}
	printf("%s\n", failed ? "PARITY FAILED" : "PARITY OK");

	free(got);
	free(want);
	free(ids);
	free(labels);
	tr_model_free(m);
	gpu_backend_free(be);
	tr_st_close(ref);
	tr_weights_close(w);
	json_object_put(man);
	return failed ? 1 : 0;
}
