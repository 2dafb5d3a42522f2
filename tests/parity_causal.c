/* parity for a causal-LM fixture: one batch (input_ids, labels from
 * reference.safetensors), forward (logits, hidden states, loss), backward
 * (every gradient of step 1), then the manifest's number of clipped AdamW
 * steps on the same batch (parameters after each step that has a reference,
 * losses and gradient norms per step from the manifest). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/select.h"
#include "tests/parity.h"
#include "train/model.h"
#include "train/modeldir.h"

int parity_causal(const struct parity_opts *o)
{
	const char *dir = o->dir;
	struct td_errbuf eb = {{0}};
	char path[4096], name[192];
	td_err e;
	struct json_object *train = NULL, *losses = NULL, *norms = NULL;
	if (o->manifest) {
		json_object_object_get_ex(o->manifest, "train", &train);
		json_object_object_get_ex(o->manifest, "losses", &losses);
		json_object_object_get_ex(o->manifest, "grad_norms_before_clip", &norms);
	}
	const int g_logits = parity_group("logits", PARITY_TOL_FORWARD, false);
	const int g_hidden = parity_group("hidden", PARITY_TOL_FORWARD, false);
	const int g_loss = parity_group("loss", PARITY_TOL_LOSS, false);
	const int g_grad = parity_group("grad", PARITY_TOL_GRAD, false);
	const int g_norm = parity_group("grad norm before clip", PARITY_TOL_GRAD, false);
	const int g_after = parity_group("params after steps", PARITY_TOL_AFTER, true);

	struct tr_model_config cfg;
	snprintf(path, sizeof(path), "%s/config.json", dir);
	if ((e = tr_config_load(&cfg, path, &eb)) != TD_OK)
		return parity_die("config", e, &eb);
	struct tr_weights *w = NULL;
	if ((e = tr_weights_open(&w, dir, &eb)) != TD_OK)
		return parity_die("weights", e, &eb);
	struct tr_st_file *ref = NULL;
	snprintf(path, sizeof(path), "%s/reference.safetensors", dir);
	if ((e = tr_st_open(&ref, path, &eb)) != TD_OK)
		return parity_die("reference", e, &eb);

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
		return parity_die("input_ids", e, &eb);
	if (tlab) {
		if ((e = tr_st_to_i32(labels, tlab, &eb)) != TD_OK)
			return parity_die("labels", e, &eb);
	} else {
		memcpy(labels, ids, (size_t)B * T * sizeof(int32_t));
	}

	struct gpu_backend *be = NULL;
	if ((e = parity_open_backend(o, &be, &eb)) != TD_OK)
		return parity_die("backend", e, &eb);
	struct tr_model *m = NULL;
	struct tr_plan_opts po = {.B = B, .T = T};
	if ((e = tr_model_new(&m, be, &cfg, &po, &eb)) != TD_OK)
		return parity_die("model", e, &eb);
	if ((e = tr_model_load(m, w, &eb)) != TD_OK)
		return parity_die("load", e, &eb);
	const struct tr_plan *plan = tr_model_plan(m);
	printf("parity %s on %s: %s, B=%d T=%d, %zu parameters\n", dir, be->ops->name,
	       cfg.model_type, B, T, plan->numel_params);

	size_t maxn = (size_t)B * T * (size_t)cfg.vocab_size;
	for (size_t i = 0; i < plan->nparams; i++)
		if (plan->params[i].numel > maxn)
			maxn = plan->params[i].numel;
	float *got = malloc(maxn * sizeof(float)), *want = malloc(maxn * sizeof(float));

	struct tr_adamw hp = {.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
	struct json_object *betas;
	if (train && json_object_object_get_ex(train, "betas", &betas) &&
	    json_object_array_length(betas) == 2) {
		hp.beta1 = (float)json_object_get_double(json_object_array_get_idx(betas, 0));
		hp.beta2 = (float)json_object_get_double(json_object_array_get_idx(betas, 1));
	}
	hp.eps = (float)parity_jnum(train, "eps", hp.eps);
	hp.weight_decay = (float)parity_jnum(train, "weight_decay", hp.weight_decay);
	float lr = (float)parity_jnum(train, "lr", 1e-3);
	double clip = parity_jnum(train, "clip_norm", 1.0);
	int steps = (int)parity_jnum(train, "steps", 3);

	for (int step = 1; step <= steps; step++) {
		double loss_sum;
		int64_t nvalid;
		if ((e = tr_model_forward(m, ids, labels, &loss_sum, &nvalid, &eb)) != TD_OK)
			return parity_die("forward", e, &eb);
		double loss = nvalid ? loss_sum / (double)nvalid : 0;
		if (losses && (size_t)step <= json_object_array_length(losses)) {
			snprintf(name, sizeof(name), "loss (step %d)", step);
			parity_compare_scalar(g_loss, name, loss,
					      json_object_get_double(json_object_array_get_idx(losses, step - 1)));
		}
		if (step == 1) {
			const struct tr_st_tensor *t = tr_st_find(ref, "logits");
			if (t && (size_t)t->numel == (size_t)B * T * cfg.vocab_size) {
				tr_model_get_logits(m, got);
				tr_st_to_f32(want, t, &eb);
				parity_compare(g_logits, "logits", got, want, (size_t)t->numel);
			}
			for (int i = 0; i <= cfg.num_layers; i++) {
				snprintf(name, sizeof(name), "hidden.%d", i);
				t = tr_st_find(ref, name);
				if (!t)
					continue;
				tr_model_get_hidden(m, i, got);
				tr_st_to_f32(want, t, &eb);
				parity_compare(g_hidden, name, got, want, (size_t)t->numel);
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
					parity_fail(g_grad, "%s: no reference tensor", name);
					continue;
				}
				tr_model_get_grad(m, p, got);
				tr_st_to_f32(want, t, &eb);
				parity_compare(g_grad, name, got, want, p->numel);
			}
		}
		double norm = tr_model_clip_grads(m, clip);
		if (norms && (size_t)step <= json_object_array_length(norms)) {
			snprintf(name, sizeof(name), "grad norm (step %d)", step);
			parity_compare_scalar(g_norm, name, norm,
					      json_object_get_double(json_object_array_get_idx(norms, step - 1)));
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
			parity_compare(g_after, name, got, want, p->numel);
		}
	}
	if ((e = gpu_sync(be, &eb)) != TD_OK)
		return parity_die("backend", e, &eb);

	int failed = parity_report();
	free(got);
	free(want);
	free(ids);
	free(labels);
	tr_model_free(m);
	gpu_backend_free(be);
	tr_st_close(ref);
	tr_weights_close(w);
	return failed ? 1 : 0;
}
