/* parity for the method fixtures, by what manifest.json names:
 *   "base"               LoRA (PEFT) on the base model dir: the adapter in
 *                        adapter_init/, one batch, the manifest's steps of
 *                        clipped AdamW on the adapters only; then the adapter
 *                        saved after the steps against adapter_after3/ (tensor
 *                        for tensor, and adapter_config.json's keys) and
 *                        merged into the base against merged_after3.safetensors
 *   "student", "teacher" distillation: the teacher's logits, the student's
 *                        loss, KL and CE terms, every student gradient
 *   "pooling"            sequence classification (DIR is the model dir):
 *                        logits (B, labels), loss, every gradient
 * Every tensor of reference.safetensors must be compared (a reference tensor
 * no check consumed is a failure), so a fixture with more references than this
 * runner knows fails rather than passing silently. Sizes come from the files. */
#include <ftw.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/select.h"
#include "tests/check.h"
#include "tests/parity.h"
#include "train/lora.h"
#include "train/merge.h"
#include "train/model.h"
#include "train/modeldir.h"

struct run {
	const struct parity_opts *o;
	struct tr_st_file *ref;
	bool *used;           /* per reference tensor */
	struct gpu_backend *be;
	struct tr_model *m, *teacher;
	int32_t *ids, *labels;
	int B, T;
	float *got, *want;
	size_t cap;
	int g_logits, g_hidden, g_loss, g_grad, g_norm, g_after, g_cover;
};

static void ensure(struct run *r, size_t n)
{
	if (n <= r->cap)
		return;
	r->got = realloc(r->got, n * sizeof(float));
	r->want = realloc(r->want, n * sizeof(float));
	if (!r->got || !r->want) {
		fprintf(stderr, "parity: out of memory\n");
		exit(2);
	}
	r->cap = n;
}

/* The reference tensor called name (marked as compared), or NULL. */
static const struct tr_st_tensor *ref_take(struct run *r, const char *name)
{
	for (size_t i = 0; i < tr_st_count(r->ref); i++) {
		const struct tr_st_tensor *t = tr_st_at(r->ref, i);
		if (strcmp(t->name, name) == 0) {
			r->used[i] = true;
			return t;
		}
	}
	return NULL;
}

/* Compares host values got (n) with reference tensor name in group g. */
static void cmp_ref(struct run *r, int g, const char *name, const float *got, size_t n)
{
	const struct tr_st_tensor *t = ref_take(r, name);
	struct td_errbuf eb = {{0}};
	if (!t) {
		parity_fail(g, "%s: no reference tensor", name);
		return;
	}
	if ((size_t)t->numel != n) {
		parity_fail(g, "%s: %zu values, the reference has %lld", name, n, (long long)t->numel);
		return;
	}
	ensure(r, n);
	if (tr_st_to_f32(r->want, t, &eb) != TD_OK) {
		parity_fail(g, "%s: %s", name, eb.msg);
		return;
	}
	parity_compare(g, name, got, r->want, n);
}

static double jnum_at(struct json_object *arr, int i, bool *ok)
{
	*ok = arr && json_object_is_type(arr, json_type_array) &&
	      (size_t)i < json_object_array_length(arr);
	return *ok ? json_object_get_double(json_object_array_get_idx(arr, (size_t)i)) : 0;
}

static const char *jstr(struct json_object *o, const char *key)
{
	struct json_object *v;
	return o && json_object_object_get_ex(o, key, &v) && json_object_is_type(v, json_type_string)
		       ? json_object_get_string(v)
		       : NULL;
}

/* A fixture-relative path ("../qwen2", "teacher/") joined to DIR. */
static void rel(char *out, size_t len, const char *dir, const char *p)
{
	snprintf(out, len, "%s/%s", dir, p);
	size_t n = strlen(out);
	while (n > 1 && out[n - 1] == '/')
		out[--n] = 0;
}

static int open_common(struct run *r, const struct parity_opts *o)
{
	char path[PATH_MAX];
	struct td_errbuf eb = {{0}};
	td_err e;
	r->o = o;
	snprintf(path, sizeof(path), "%s/reference.safetensors", o->dir);
	if ((e = tr_st_open(&r->ref, path, &eb)) != TD_OK)
		return parity_die("reference", e, &eb);
	r->used = calloc(tr_st_count(r->ref) + 1, sizeof(bool));
	const struct tr_st_tensor *tids = ref_take(r, "input_ids");
	if (!tids || tids->ndim != 2) {
		fprintf(stderr, "parity: %s: needs input_ids (B, T)\n", path);
		return 2;
	}
	r->B = (int)tids->shape[0];
	r->T = (int)tids->shape[1];
	r->ids = malloc((size_t)r->B * r->T * sizeof(int32_t));
	r->labels = malloc((size_t)r->B * r->T * sizeof(int32_t));
	if (!r->used || !r->ids || !r->labels)
		return parity_die("reference", TD_ENOMEM, NULL);
	if ((e = tr_st_to_i32(r->ids, tids, &eb)) != TD_OK)
		return parity_die("input_ids", e, &eb);
	if ((e = parity_open_backend(o, &r->be, &eb)) != TD_OK)
		return parity_die("backend", e, &eb);
	r->g_logits = parity_group("logits", PARITY_TOL_FORWARD, false);
	r->g_hidden = parity_group("hidden", PARITY_TOL_FORWARD, false);
	r->g_loss = parity_group("loss", PARITY_TOL_LOSS, false);
	r->g_grad = parity_group("grad", PARITY_TOL_GRAD, false);
	r->g_norm = parity_group("grad norm before clip", PARITY_TOL_GRAD, false);
	r->g_after = parity_group("params after steps", PARITY_TOL_AFTER, true);
	r->g_cover = parity_group("reference coverage", 0, true);
	return 0;
}

static int close_common(struct run *r)
{
	for (size_t i = 0; i < tr_st_count(r->ref); i++) {
		const char *name = tr_st_at(r->ref, i)->name;
		if (!r->used[i])
			parity_fail(r->g_cover, "reference tensor '%s' was not compared", name);
		else
			parity_compare_scalar(r->g_cover, name, 0, 0);
	}
	int failed = parity_report();
	tr_model_free(r->m);
	tr_model_free(r->teacher);
	gpu_backend_free(r->be);
	tr_st_close(r->ref);
	free(r->used);
	free(r->ids);
	free(r->labels);
	free(r->got);
	free(r->want);
	return failed ? 1 : 0;
}

/* The reference's name of a parameter: PEFT's in-model names carry the
 * adapter name (lora_A.default.weight); the files do not. */
static void ref_name(char *out, size_t len, const char *prefix, const char *name)
{
	const char *a = strstr(name, ".lora_A.weight"), *b = strstr(name, ".lora_B.weight");
	const char *at = a ? a : b;
	if (at)
		snprintf(out, len, "%s%.*s.lora_%c.default.weight", prefix, (int)(at - name), name,
			 a ? 'A' : 'B');
	else
		snprintf(out, len, "%s%s", prefix, name);
}

static void forward_refs(struct run *r, int num_labels, int V)
{
	const struct tr_plan *p = tr_model_plan(r->m);
	size_t n = num_labels > 0 ? (size_t)r->B * num_labels : (size_t)r->B * r->T * V;
	ensure(r, n);
	tr_model_get_logits(r->m, r->got);
	cmp_ref(r, r->g_logits, "logits", r->got, n);
	for (int i = 0; i <= p->cfg.num_layers; i++) {
		char name[32];
		snprintf(name, sizeof(name), "hidden.%d", i);
		if (!tr_st_find(r->ref, name))
			continue;
		size_t nh = (size_t)r->B * r->T * p->cfg.hidden_size;
		ensure(r, nh);
		tr_model_get_hidden(r->m, i, r->got);
		cmp_ref(r, r->g_hidden, name, r->got, nh);
	}
}

static void grads_and_step(struct run *r, int step, struct json_object *train,
			   struct json_object *norms)
{
	const struct tr_plan *p = tr_model_plan(r->m);
	char name[256];
	if (step == 1)
		for (size_t i = 0; i < p->nparams; i++) {
			const struct tr_param *pp = &p->params[i];
			if (!pp->trainable)
				continue;
			ensure(r, pp->numel);
			tr_model_get_grad(r->m, pp, r->got);
			ref_name(name, sizeof(name), "grad.", pp->name);
			cmp_ref(r, r->g_grad, name, r->got, pp->numel);
		}
	struct tr_adamw hp = {.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
	struct json_object *betas;
	if (train && json_object_object_get_ex(train, "betas", &betas) &&
	    json_object_array_length(betas) == 2) {
		hp.beta1 = (float)json_object_get_double(json_object_array_get_idx(betas, 0));
		hp.beta2 = (float)json_object_get_double(json_object_array_get_idx(betas, 1));
	}
	hp.eps = (float)parity_jnum(train, "eps", hp.eps);
	hp.weight_decay = (float)parity_jnum(train, "weight_decay", hp.weight_decay);
	double norm = tr_model_clip_grads(r->m, parity_jnum(train, "clip_norm", 1.0));
	bool ok;
	double want = jnum_at(norms, step - 1, &ok);
	if (ok) {
		snprintf(name, sizeof(name), "grad norm (step %d)", step);
		parity_compare_scalar(r->g_norm, name, norm, want);
	}
	tr_model_adamw(r->m, &hp, (float)parity_jnum(train, "lr", 1e-3), step);
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		char prefix[16];
		snprintf(prefix, sizeof(prefix), "after%d.", step);
		ref_name(name, sizeof(name), prefix, pp->name);
		if (!tr_st_find(r->ref, name))
			continue;
		ensure(r, pp->numel);
		tr_model_get_param(r->m, pp, r->got);
		cmp_ref(r, r->g_after, name, r->got, pp->numel);
	}
}

/* --- LoRA --- */

/* Every tensor of file a against file b (same names, shapes, values). */
static void cmp_files(struct run *r, int g, const char *what, struct tr_weights *a,
		      const struct tr_st_file *b, const char *skip_absent)
{
	struct td_errbuf eb = {{0}};
	size_t matched = 0;
	for (size_t i = 0; i < tr_weights_count(a); i++) {
		const struct tr_st_tensor *t = tr_weights_at(a, i);
		const struct tr_st_tensor *u = tr_st_find(b, t->name);
		if (!u) {
			if (!skip_absent || strcmp(t->name, skip_absent) != 0)
				parity_fail(g, "%s: '%s' is not in the reference", what, t->name);
			continue;
		}
		matched++;
		bool shape = t->ndim == u->ndim;
		for (int d = 0; shape && d < t->ndim; d++)
			shape = t->shape[d] == u->shape[d];
		if (!shape) {
			parity_fail(g, "%s: '%s' has another shape than the reference", what, t->name);
			continue;
		}
		ensure(r, (size_t)t->numel);
		if (tr_st_to_f32(r->got, t, &eb) || tr_st_to_f32(r->want, u, &eb)) {
			parity_fail(g, "%s: %s", what, eb.msg);
			continue;
		}
		char name[256];
		snprintf(name, sizeof(name), "%s %s", what, t->name);
		parity_compare(g, name, r->got, r->want, (size_t)t->numel);
	}
	if (matched != tr_st_count(b))
		parity_fail(g, "%s: %zu of the reference's %zu tensors were written", what, matched,
			    tr_st_count(b));
}

/* Keys of our adapter_config.json against PEFT's. */
static void cmp_adapter_config(int g, const char *ours, const char *theirs, const char *base)
{
	struct json_object *a = json_object_from_file(ours), *b = json_object_from_file(theirs);
	if (!a || !b) {
		parity_fail(g, "adapter_config.json: cannot parse %s", a ? theirs : ours);
		json_object_put(a);
		json_object_put(b);
		return;
	}
	static const char *const keys[] = {"r", "lora_alpha", "peft_type", "task_type", "lora_dropout",
					   "bias", "fan_in_fan_out", "use_dora", "use_rslora"};
	for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		struct json_object *x, *y;
		bool hx = json_object_object_get_ex(a, keys[i], &x), hy = json_object_object_get_ex(b, keys[i], &y);
		bool same = hx && hy &&
			    (json_object_equal(x, y) ||
			     (json_object_is_type(x, json_type_double) || json_object_is_type(y, json_type_double)
				      ? json_object_get_double(x) == json_object_get_double(y)
				      : false));
		if (!same)
			parity_fail(g, "adapter_config.json: %s is %s, PEFT wrote %s", keys[i],
				    hx ? json_object_to_json_string(x) : "absent",
				    hy ? json_object_to_json_string(y) : "absent");
		else
			parity_compare_scalar(g, keys[i], 0, 0);
	}
	/* target_modules: the same set (PEFT keeps a set; its order is not meaningful). */
	struct json_object *x, *y;
	bool same = json_object_object_get_ex(a, "target_modules", &x) &&
		    json_object_object_get_ex(b, "target_modules", &y) &&
		    json_object_array_length(x) == json_object_array_length(y);
	for (size_t i = 0; same && i < json_object_array_length(x); i++) {
		bool found = false;
		for (size_t k = 0; k < json_object_array_length(y); k++)
			found |= json_object_equal(json_object_array_get_idx(x, i), json_object_array_get_idx(y, k));
		same = found;
	}
	if (!same)
		parity_fail(g, "adapter_config.json: target_modules differ from PEFT's");
	else
		parity_compare_scalar(g, "target_modules", 0, 0);
	const char *bm = jstr(a, "base_model_name_or_path");
	if (!bm || strcmp(bm, base) != 0)
		parity_fail(g, "adapter_config.json: base_model_name_or_path is %s, not %s", bm ? bm : "absent", base);
	else
		parity_compare_scalar(g, "base_model_name_or_path", 0, 0);
	json_object_put(a);
	json_object_put(b);
}

static int run_lora(struct run *r, const char *base_rel)
{
	const struct parity_opts *o = r->o;
	struct td_errbuf eb = {{0}};
	char base[PATH_MAX], path[PATH_MAX], name[64];
	td_err e;
	rel(base, sizeof(base), o->dir, base_rel);
	struct tr_model_config cfg;
	snprintf(path, sizeof(path), "%s/config.json", base);
	if ((e = tr_config_load(&cfg, path, &eb)) != TD_OK)
		return parity_die("base config", e, &eb);
	const struct tr_st_tensor *tlab = ref_take(r, "labels");
	if (!tlab || tlab->numel != (int64_t)r->B * r->T || tr_st_to_i32(r->labels, tlab, &eb))
		return parity_die("labels (B, T)", TD_EFORMAT, &eb);
	char init[PATH_MAX];
	snprintf(init, sizeof(init), "%s/adapter_init", o->dir);
	struct tr_lora_config lc;
	if ((e = tr_lora_config_load(&lc, init, &eb)) != TD_OK)
		return parity_die("adapter_init", e, &eb);
	struct tr_plan_opts po = {.B = r->B, .T = r->T, .lora_rank = lc.r, .lora_alpha = lc.alpha,
				  .lora_targets = lc.targets, .lora_rslora = lc.rslora};
	struct tr_weights *w = NULL;
	if ((e = tr_weights_open(&w, base, &eb)) != TD_OK)
		return parity_die("base weights", e, &eb);
	if ((e = tr_model_new(&r->m, r->be, &cfg, &po, &eb)) != TD_OK ||
	    (e = tr_model_load(r->m, w, &eb)) != TD_OK || (e = tr_lora_load(r->m, init, &eb)) != TD_OK)
		return parity_die("model", e, &eb);
	tr_weights_close(w);
	const struct tr_plan *plan = tr_model_plan(r->m);
	printf("parity %s on %s: LoRA r=%d alpha=%g on %s, B=%d T=%d, %zu of %zu parameters train\n",
	       o->dir, r->be->ops->name, lc.r, lc.alpha, cfg.model_type, r->B, r->T,
	       plan->numel_trainable, plan->numel_params);

	struct json_object *train = NULL, *losses = NULL, *norms = NULL;
	json_object_object_get_ex(o->manifest, "train", &train);
	json_object_object_get_ex(o->manifest, "losses", &losses);
	json_object_object_get_ex(o->manifest, "grad_norms_before_clip", &norms);
	int steps = (int)parity_jnum(train, "steps", 3);
	for (int step = 1; step <= steps; step++) {
		double ls;
		int64_t nv;
		if ((e = tr_model_forward(r->m, r->ids, r->labels, &ls, &nv, &eb)) != TD_OK)
			return parity_die("forward", e, &eb);
		bool ok;
		double want = jnum_at(losses, step - 1, &ok);
		if (ok) {
			snprintf(name, sizeof(name), "loss (step %d)", step);
			parity_compare_scalar(r->g_loss, name, nv ? ls / (double)nv : 0, want);
		}
		if (step == 1)
			forward_refs(r, 0, cfg.vocab_size);
		tr_model_zero_grad(r->m);
		tr_model_backward(r->m, nv ? (float)(1.0 / (double)nv) : 0.0f);
		grads_and_step(r, step, train, norms);
	}

	/* Save, compare with PEFT's own save; merge, compare with PEFT's merge. */
	char tmpl[] = "/tmp/parity-lora-XXXXXX";
	const char *tmp = mkdtemp(tmpl);
	if (!tmp)
		return parity_die("mkdtemp", TD_EIO, NULL);
	const int g_save = parity_group("adapter after steps", PARITY_TOL_AFTER, true);
	const int g_cfg = parity_group("adapter config", 0, true);
	const int g_merge = parity_group("merged after steps", PARITY_TOL_AFTER, true);
	char want_dir[PATH_MAX], out_dir[PATH_MAX];
	snprintf(want_dir, sizeof(want_dir), "%s/adapter_after%d", o->dir, steps);
	if ((e = tr_lora_save(r->m, tmp, base, &eb)) != TD_OK) {
		parity_fail(g_save, "saving the adapter: %s", eb.msg);
	} else {
		struct tr_st_file *theirs = NULL;
		snprintf(path, sizeof(path), "%s/adapter_model.safetensors", want_dir);
		if (tr_st_open(&theirs, path, &eb) != TD_OK) {
			parity_fail(g_save, "%s", eb.msg);
		} else {
			snprintf(path, sizeof(path), "%s/adapter_model.safetensors", tmp);
			struct tr_st_file *of = NULL;
			if (tr_st_open(&of, path, &eb) != TD_OK) {
				parity_fail(g_save, "%s", eb.msg);
			} else {
				/* tr_weights wants a model dir: compare the file directly. */
				for (size_t i = 0; i < tr_st_count(of); i++) {
					const struct tr_st_tensor *t = tr_st_at(of, i);
					const struct tr_st_tensor *u = tr_st_find(theirs, t->name);
					if (!u || u->numel != t->numel || u->ndim != t->ndim ||
					    u->shape[0] != t->shape[0] || u->shape[1] != t->shape[1]) {
						parity_fail(g_save, "adapter: '%s' is not in PEFT's save with this shape",
							    t->name);
						continue;
					}
					ensure(r, (size_t)t->numel);
					tr_st_to_f32(r->got, t, &eb);
					tr_st_to_f32(r->want, u, &eb);
					char nm[256];
					snprintf(nm, sizeof(nm), "adapter %s", t->name);
					parity_compare(g_save, nm, r->got, r->want, (size_t)t->numel);
				}
				if (tr_st_count(of) != tr_st_count(theirs))
					parity_fail(g_save, "adapter: %zu tensors, PEFT saved %zu", tr_st_count(of),
						    tr_st_count(theirs));
				tr_st_close(of);
			}
			snprintf(path, sizeof(path), "%s/adapter_config.json", tmp);
			char theirs_cfg[PATH_MAX];
			snprintf(theirs_cfg, sizeof(theirs_cfg), "%s/adapter_config.json", want_dir);
			cmp_adapter_config(g_cfg, path, theirs_cfg, base);
			tr_st_close(theirs);
		}
		snprintf(out_dir, sizeof(out_dir), "%s/merged", tmp);
		snprintf(path, sizeof(path), "%s/merged_after%d.safetensors", o->dir, steps);
		struct tr_st_file *mref = NULL;
		struct tr_weights *merged = NULL;
		if (tr_merge(base, tmp, out_dir, o->backend, NULL, &eb) != TD_OK)
			parity_fail(g_merge, "merge: %s", eb.msg);
		else if (tr_st_open(&mref, path, &eb) != TD_OK || tr_weights_open(&merged, out_dir, &eb) != TD_OK)
			parity_fail(g_merge, "%s", eb.msg);
		else
			cmp_files(r, g_merge, "merged", merged, mref, "lm_head.weight");
		tr_weights_close(merged);
		tr_st_close(mref);
	}
	check_rm_tree(tmp);
	return close_common(r);
}

/* --- classification --- */

static int run_classify(struct run *r)
{
	const struct parity_opts *o = r->o;
	struct td_errbuf eb = {{0}};
	char path[PATH_MAX];
	td_err e;
	struct tr_model_config cfg;
	snprintf(path, sizeof(path), "%s/config.json", o->dir);
	if ((e = tr_config_load(&cfg, path, &eb)) != TD_OK)
		return parity_die("config", e, &eb);
	if (cfg.num_labels < 2) {
		fprintf(stderr, "parity: %s: not a classifier (no id2label / num_labels)\n", path);
		return 2;
	}
	const struct tr_st_tensor *tlab = ref_take(r, "labels");
	if (!tlab || tlab->numel != r->B || tr_st_to_i32(r->labels, tlab, &eb))
		return parity_die("labels (B)", TD_EFORMAT, &eb);
	struct tr_plan_opts po = {.B = r->B, .T = r->T, .num_labels = cfg.num_labels};
	struct tr_weights *w = NULL;
	if ((e = tr_weights_open(&w, o->dir, &eb)) != TD_OK)
		return parity_die("weights", e, &eb);
	if ((e = tr_model_new(&r->m, r->be, &cfg, &po, &eb)) != TD_OK ||
	    (e = tr_model_load(r->m, w, &eb)) != TD_OK)
		return parity_die("model", e, &eb);
	tr_weights_close(w);
	if (!tr_model_head_loaded(r->m))
		return parity_die("model: no score.weight in the weights", TD_EFORMAT, NULL);
	printf("parity %s on %s: %s classifier, %d labels, pad id %d, B=%d T=%d\n", o->dir,
	       r->be->ops->name, cfg.model_type, cfg.num_labels, cfg.pad_token_id, r->B, r->T);

	struct json_object *train = NULL;
	json_object_object_get_ex(o->manifest, "train", &train);
	int steps = (int)parity_jnum(train, "steps", 1);
	for (int step = 1; step <= steps; step++) {
		double ls;
		int64_t nv;
		if ((e = tr_model_forward_classify(r->m, r->ids, r->labels, &ls, &nv, &eb)) != TD_OK)
			return parity_die("forward", e, &eb);
		double loss = nv ? ls / (double)nv : 0;
		if (step == 1) {
			cmp_ref(r, r->g_loss, "loss", (float[]){(float)loss}, 1);
			struct json_object *lv;
			if (json_object_object_get_ex(o->manifest, "loss_value", &lv))
				parity_compare_scalar(r->g_loss, "loss (manifest)", loss, json_object_get_double(lv));
			forward_refs(r, cfg.num_labels, cfg.vocab_size);
		}
		tr_model_zero_grad(r->m);
		tr_model_backward(r->m, nv ? (float)(1.0 / (double)nv) : 0.0f);
		grads_and_step(r, step, train, NULL);
	}
	return close_common(r);
}

/* --- distillation --- */

static int run_distill(struct run *r, const char *student_rel, const char *teacher_rel)
{
	const struct parity_opts *o = r->o;
	struct td_errbuf eb = {{0}};
	char sdir[PATH_MAX], tdir[PATH_MAX], path[PATH_MAX];
	td_err e;
	rel(sdir, sizeof(sdir), o->dir, student_rel);
	rel(tdir, sizeof(tdir), o->dir, teacher_rel);
	struct tr_model_config scfg, tcfg;
	snprintf(path, sizeof(path), "%s/config.json", sdir);
	if ((e = tr_config_load(&scfg, path, &eb)) != TD_OK)
		return parity_die("student config", e, &eb);
	snprintf(path, sizeof(path), "%s/config.json", tdir);
	if ((e = tr_config_load(&tcfg, path, &eb)) != TD_OK)
		return parity_die("teacher config", e, &eb);
	if (scfg.vocab_size != tcfg.vocab_size) {
		fprintf(stderr, "parity: teacher vocabulary %d != student vocabulary %d\n", tcfg.vocab_size,
			scfg.vocab_size);
		return 2;
	}
	const struct tr_st_tensor *tlab = ref_take(r, "labels");
	if (!tlab || tlab->numel != (int64_t)r->B * r->T || tr_st_to_i32(r->labels, tlab, &eb))
		return parity_die("labels (B, T)", TD_EFORMAT, &eb);
	float temp = (float)parity_jnum(o->manifest, "temperature", 2.0);
	float alpha = (float)parity_jnum(o->manifest, "alpha", 0.5);

	struct tr_plan_opts so = {.B = r->B, .T = r->T, .distill = true};
	struct tr_plan_opts to = {.B = r->B, .T = r->T, .inference = true};
	struct tr_weights *sw = NULL, *tw = NULL;
	if ((e = tr_weights_open(&sw, sdir, &eb)) != TD_OK || (e = tr_weights_open(&tw, tdir, &eb)) != TD_OK)
		return parity_die("weights", e, &eb);
	if ((e = tr_model_new(&r->m, r->be, &scfg, &so, &eb)) != TD_OK ||
	    (e = tr_model_load(r->m, sw, &eb)) != TD_OK ||
	    (e = tr_model_new(&r->teacher, r->be, &tcfg, &to, &eb)) != TD_OK ||
	    (e = tr_model_load(r->teacher, tw, &eb)) != TD_OK)
		return parity_die("models", e, &eb);
	tr_weights_close(sw);
	tr_weights_close(tw);
	printf("parity %s on %s: distill %s (C=%d, L=%d) into %s (C=%d, L=%d), T=%g alpha=%g, B=%d T=%d\n",
	       o->dir, r->be->ops->name, tdir, tcfg.hidden_size, tcfg.num_layers, sdir,
	       scfg.hidden_size, scfg.num_layers, (double)temp, (double)alpha, r->B, r->T);

	const int g_teacher = parity_group("teacher logits", PARITY_TOL_FORWARD, false);
	struct json_object *train = NULL;
	json_object_object_get_ex(o->manifest, "train", &train);
	int steps = (int)parity_jnum(train, "steps", 1);
	for (int step = 1; step <= steps; step++) {
		if ((e = tr_model_forward_logits(r->teacher, r->ids, &eb)) != TD_OK)
			return parity_die("teacher forward", e, &eb);
		size_t nl = (size_t)r->B * r->T * tcfg.vocab_size;
		if (step == 1) {
			ensure(r, nl);
			tr_model_get_logits(r->teacher, r->got);
			cmp_ref(r, g_teacher, "teacher_logits", r->got, nl);
		}
		struct tr_distill_sums s;
		if ((e = tr_model_forward_distill(r->m, r->ids, r->labels, r->teacher, temp, alpha, &s,
						  &eb)) != TD_OK)
			return parity_die("student forward", e, &eb);
		double n = s.n_valid ? (double)s.n_valid : 1.0;
		if (step == 1) {
			cmp_ref(r, r->g_loss, "loss", (float[]){(float)(s.loss_sum / n)}, 1);
			cmp_ref(r, r->g_loss, "kd", (float[]){(float)(s.kl_sum / n)}, 1);
			cmp_ref(r, r->g_loss, "ce", (float[]){(float)(s.ce_sum / n)}, 1);
			struct json_object *lv;
			if (json_object_object_get_ex(o->manifest, "loss_value", &lv))
				parity_compare_scalar(r->g_loss, "loss (manifest)", s.loss_sum / n,
						      json_object_get_double(lv));
			if (tr_st_find(r->ref, "logits"))
				forward_refs(r, 0, scfg.vocab_size);
		}
		tr_model_zero_grad(r->m);
		tr_model_backward(r->m, (float)(1.0 / n));
		grads_and_step(r, step, train, NULL);
	}
	return close_common(r);
}

int parity_methods(const struct parity_opts *o)
{
	struct run r = {0};
	const char *base = jstr(o->manifest, "base"), *student = jstr(o->manifest, "student");
	const char *teacher = jstr(o->manifest, "teacher");
	struct json_object *pooling;
	bool classify = json_object_object_get_ex(o->manifest, "pooling", &pooling);
	if (!base && !(student && teacher) && !classify) {
		fprintf(stderr, "parity: %s/manifest.json: names neither base, student and teacher, nor pooling\n",
			o->dir);
		return 2;
	}
	int rc = open_common(&r, o);
	if (rc)
		return rc;
	if (base)
		return run_lora(&r, base);
	if (student && teacher)
		return run_distill(&r, student, teacher);
	return run_classify(&r);
}
