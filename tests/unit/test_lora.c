/* PEFT adapters (train/lora.h) and merging (train/merge.h) on the CPU backend:
 *   - bad adapters get errors that name the file, the tensor and what does
 *     not fit: a rank other than the tensors', a target that is not a
 *     projection, a layer the base does not have, shapes of another base,
 *     a tensor for a module target_modules does not list, a missing tensor,
 *     an adapter of another rank or targets than the job's, PEFT options
 *     traind does not implement
 *   - save then load gives the same bits; the written adapter_config.json
 *     reads back with what was saved
 *   - PEFT's initialisation: B = 0 (the model equals its base, bit for bit),
 *     A within kaiming-uniform's bound, deterministic in the seed
 *   - a merged model computes what the adapted model computes
 * Fixtures: tests/fixtures/qwen2, llama, qwen2-lora. */
#include <ftw.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "tests/check.h"
#include "train/lora.h"
#include "train/merge.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/safetensors.h"

static char tmp[256];
static const char *fx;

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
		perror(path);
		exit(2);
	}
}

/* adapter_init's adapter_config.json with one key replaced (JSON text). */
static void write_config(const char *dir, const char *key, const char *json_value)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/qwen2-lora/adapter_init/adapter_config.json", fx);
	struct json_object *o = json_object_from_file(path);
	if (!o)
		exit(2);
	if (key)
		json_object_object_add(o, key, json_tokener_parse(json_value));
	mkdir(dir, 0755);
	snprintf(path, sizeof(path), "%s/adapter_config.json", dir);
	write_file(path, json_object_to_json_string(o));
	json_object_put(o);
}

/* An adapter file of the tensors of adapter_init, renamed/reshaped by edit. */
typedef bool (*edit_fn)(struct tr_st_entry *e, float *data);

static void write_tensors(const char *dir, edit_fn edit)
{
	char path[PATH_MAX];
	struct td_errbuf eb = {{0}};
	snprintf(path, sizeof(path), "%s/qwen2-lora/adapter_init/adapter_model.safetensors", fx);
	struct tr_st_file *f = NULL;
	if (tr_st_open(&f, path, &eb) != TD_OK)
		exit(2);
	size_t n = tr_st_count(f);
	struct tr_st_entry *es = calloc(n, sizeof(*es));
	char(*names)[160] = calloc(n, sizeof(*names));
	float **bufs = calloc(n, sizeof(*bufs));
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		const struct tr_st_tensor *t = tr_st_at(f, i);
		bufs[k] = calloc((size_t)t->numel * 2 + 1, sizeof(float)); /* room to grow */
		tr_st_to_f32(bufs[k], t, &eb);
		snprintf(names[k], sizeof(names[k]), "%s", t->name);
		es[k] = (struct tr_st_entry){.name = names[k], .dtype = TR_DT_F32, .ndim = t->ndim,
					     .shape = {t->shape[0], t->shape[1]}, .data = bufs[k]};
		if (edit && !edit(&es[k], bufs[k]))
			continue; /* dropped */
		k++;
	}
	mkdir(dir, 0755);
	snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
	if (tr_st_write(path, es, k, NULL, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		exit(2);
	}
	for (size_t i = 0; i < n; i++)
		free(bufs[i]);
	free(bufs);
	free(names);
	free(es);
	tr_st_close(f);
}

static bool edit_layer5(struct tr_st_entry *e, float *d)
{
	(void)d;
	char *p = strstr((char *)e->name, "layers.1.");
	if (p)
		p[7] = '5';
	return true;
}

static bool edit_drop_vB(struct tr_st_entry *e, float *d)
{
	(void)d;
	return !strstr(e->name, "layers.1.self_attn.v_proj.lora_B");
}

static bool edit_rank8(struct tr_st_entry *e, float *d)
{
	(void)d;
	if (strstr(e->name, "lora_A"))
		e->shape[0] = 8; /* [8, 64]: twice the floats; the buffer has room */
	else
		e->shape[1] = 8;
	return true;
}

static bool edit_junk(struct tr_st_entry *e, float *d)
{
	(void)d;
	if (strstr(e->name, "layers.0.self_attn.q_proj.lora_A"))
		e->name = "base_model.model.model.layers.0.self_attn.q_proj.weight";
	return true;
}

struct tr_model_config qwen2_cfg;

static td_err check_adapter(const char *dir, struct td_errbuf *eb)
{
	struct tr_lora_config lc;
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
	td_err e = tr_lora_config_load(&lc, dir, eb);
	if (e != TD_OK)
		return e;
	struct tr_st_file *f = NULL;
	if ((e = tr_st_open(&f, path, eb)) != TD_OK)
		return e;
	e = tr_lora_check(&lc, &qwen2_cfg, 0, f, eb);
	tr_st_close(f);
	return e;
}

static void test_bad_adapters(void)
{
	static const struct {
		const char *name;
		const char *key, *value; /* config edit */
		edit_fn edit;            /* tensor edit */
		td_err code;
		const char *msg;
	} cases[] = {
		{"ok", NULL, NULL, NULL, TD_OK, ""},
		{"rank-config", "r", "8", NULL, TD_EMISMATCH,
		 "lora_A.weight' has shape [4, 64]; r = 8 and q_proj (64 -> 64) of the qwen2 base model need [8, 64]"},
		{"rank-tensors", NULL, NULL, edit_rank8, TD_EMISMATCH, "has shape [8, 64]; r = 4"},
		{"target-unknown", "target_modules", "[\"q_proj\", \"c_attn\"]", NULL, TD_EMISMATCH,
		 "target_modules[1] = \"c_attn\" is not a projection"},
		{"target-unlisted", "target_modules", "[\"q_proj\"]", NULL, TD_EMISMATCH,
		 "adapts v_proj, which target_modules does not list"},
		{"target-missing", "target_modules", "[\"q_proj\", \"v_proj\", \"o_proj\"]", NULL, TD_EMISMATCH,
		 "missing tensor base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"},
		{"layer", NULL, NULL, edit_layer5, TD_EMISMATCH, "adapts layer 5, but the qwen2 base model has 2 layers"},
		{"dropped", NULL, NULL, edit_drop_vB, TD_EMISMATCH,
		 "missing tensor base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"},
		{"junk", NULL, NULL, edit_junk, TD_EMISMATCH,
		 "'base_model.model.model.layers.0.self_attn.q_proj.weight' is not a LoRA tensor"},
		{"regex", "target_modules", "\"all-linear\"", NULL, TD_EUNSUPPORTED, "is a pattern"},
		{"dora", "use_dora", "true", NULL, TD_EUNSUPPORTED, "use_dora = true: DoRA is not supported"},
		{"fan", "fan_in_fan_out", "true", NULL, TD_EUNSUPPORTED, "fan_in_fan_out"},
		{"pattern", "rank_pattern", "{\"q_proj\": 8}", NULL, TD_EUNSUPPORTED, "a per-module rank"},
		{"peft-type", "peft_type", "\"IA3\"", NULL, TD_EUNSUPPORTED, "only LORA adapters"},
		{"r-zero", "r", "0", NULL, TD_EFORMAT, "r must be an integer in [1, 65536] (got 0)"},
		{"alpha", "lora_alpha", "-1", NULL, TD_EFORMAT, "lora_alpha must be > 0"},
		{"bias", "bias", "\"all\"", NULL, TD_EUNSUPPORTED, "trained biases"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char dir[PATH_MAX];
		snprintf(dir, sizeof(dir), "%s/bad-%s", tmp, cases[i].name);
		write_config(dir, cases[i].key, cases[i].value);
		write_tensors(dir, cases[i].edit);
		struct td_errbuf eb = {{0}};
		td_err e = check_adapter(dir, &eb);
		CHECK_MSG(e == cases[i].code, "%s: %s, want %s (%s)", cases[i].name, td_errname(e),
			  td_errname(cases[i].code), eb.msg);
		if (cases[i].code != TD_OK) {
			CHECK_CONTAINS(eb.msg, cases[i].msg);
			CHECK_CONTAINS(eb.msg, dir); /* the file is named */
		}
	}

	/* Another base: qwen2's adapter on llama (v_proj 64 -> 64 there). */
	char path[PATH_MAX], adir[PATH_MAX];
	struct td_errbuf eb = {{0}};
	snprintf(adir, sizeof(adir), "%s/qwen2-lora/adapter_init", fx);
	snprintf(path, sizeof(path), "%s/llama", fx);
	td_err e = tr_merge(path, adir, "/nonexistent/never-written", "cpu", NULL, &eb);
	CHECK_EQ_INT(e, TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "v_proj.lora_B.weight' has shape [32, 4]; r = 4 and v_proj (64 -> 64) of the llama base model need [64, 4]");
	CHECK(access("/nonexistent/never-written", F_OK) != 0);

	/* An adapter of another rank or targets than the model's plan. */
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct tr_model *m = NULL;
	struct tr_plan_opts po = {.B = 1, .T = 4, .lora_rank = 8, .lora_alpha = 16,
				  .lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_V};
	CHECK_EQ_INT(tr_model_new(&m, be, &qwen2_cfg, &po, &eb), TD_OK);
	e = tr_lora_load(m, adir, &eb);
	CHECK_EQ_INT(e, TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "r = 4 on q_proj, v_proj, but the job's LoRA is rank 8 on q_proj, v_proj");
	tr_model_free(m);
	po.lora_rank = 4;
	po.lora_alpha = 8;
	po.lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_K;
	CHECK_EQ_INT(tr_model_new(&m, be, &qwen2_cfg, &po, &eb), TD_OK);
	CHECK_EQ_INT(tr_lora_load(m, adir, &eb), TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "but the job's LoRA is rank 4 on q_proj, k_proj");
	tr_model_free(m);
	gpu_backend_free(be);
}

static void test_save_load_init_merge(void)
{
	struct td_errbuf eb = {{0}};
	char base[PATH_MAX], adir[PATH_MAX], out[PATH_MAX], merged[PATH_MAX];
	snprintf(base, sizeof(base), "%s/qwen2", fx);
	snprintf(adir, sizeof(adir), "%s/qwen2-lora/adapter_init", fx);
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	struct tr_weights *w = NULL;
	CHECK_EQ_INT(tr_weights_open(&w, base, &eb), TD_OK);
	const int B = 2, T = 12;
	struct tr_plan_opts po = {.B = B, .T = T, .lora_rank = 4, .lora_alpha = 8,
				  .lora_targets = 1u << TR_LIN_Q | 1u << TR_LIN_V};
	struct tr_plan_opts full = {.B = B, .T = T};
	struct tr_model *m = NULL, *m2 = NULL, *plain = NULL;
	CHECK_EQ_INT(tr_model_new(&m, be, &qwen2_cfg, &po, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_new(&m2, be, &qwen2_cfg, &po, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_new(&plain, be, &qwen2_cfg, &full, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_load(m, w, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_load(m2, w, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_load(plain, w, &eb), TD_OK);
	int32_t ids[24];
	for (int i = 0; i < B * T; i++)
		ids[i] = (i * 131 + 7) % qwen2_cfg.vocab_size;
	size_t nl = (size_t)B * T * qwen2_cfg.vocab_size;
	float *la = malloc(nl * sizeof(float)), *lb = malloc(nl * sizeof(float));

	/* PEFT's init: the adapted model is its base, bit for bit. */
	CHECK_EQ_INT(tr_lora_init(m, 99, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_forward_logits(m, ids, &eb), TD_OK);
	tr_model_get_logits(m, la);
	CHECK_EQ_INT(tr_model_forward_logits(plain, ids, &eb), TD_OK);
	tr_model_get_logits(plain, lb);
	CHECK_MSG(memcmp(la, lb, nl * sizeof(float)) == 0, "B = 0 must leave the model unchanged");
	const struct tr_plan *p = tr_model_plan(m);
	float buf[4 * 64], buf2[4 * 64];
	int distinct = 0, out_of_bound = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		if (pp->kind != TR_P_LORA_A && pp->kind != TR_P_LORA_B)
			continue;
		tr_model_get_param(m, pp, buf);
		double bound = 1.0 / sqrt((double)pp->shape[1]);
		for (size_t k = 0; k < pp->numel; k++) {
			if (pp->kind == TR_P_LORA_B)
				out_of_bound += buf[k] != 0.0f;
			else
				out_of_bound += !(fabs(buf[k]) <= bound);
			distinct += k && buf[k] != buf[0];
		}
	}
	CHECK_EQ_INT(out_of_bound, 0);
	CHECK(distinct > 100);
	CHECK_EQ_INT(tr_lora_init(m2, 99, &eb), TD_OK);
	const struct tr_param *a0 = tr_plan_param(p, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight");
	CHECK(a0 != NULL);
	tr_model_get_param(m, a0, buf);
	tr_model_get_param(m2, a0, buf2);
	CHECK_MSG(memcmp(buf, buf2, a0->numel * sizeof(float)) == 0, "init is not deterministic in the seed");

	/* Save -> load: the same bits; the config reads back. */
	CHECK_EQ_INT(tr_lora_load(m, adir, &eb), TD_OK);
	snprintf(out, sizeof(out), "%s/saved", tmp);
	mkdir(out, 0755);
	CHECK_EQ_INT(tr_lora_save(m, out, "/models/qwen2", &eb), TD_OK);
	CHECK_EQ_INT(tr_lora_load(m2, out, &eb), TD_OK);
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		if (pp->kind == TR_P_BASE)
			continue;
		tr_model_get_param(m, pp, buf);
		tr_model_get_param(m2, pp, buf2);
		CHECK_MSG(memcmp(buf, buf2, pp->numel * sizeof(float)) == 0, "%s differs after save/load", pp->name);
	}
	struct tr_lora_config lc;
	CHECK_EQ_INT(tr_lora_config_load(&lc, out, &eb), TD_OK);
	CHECK_EQ_INT(lc.r, 4);
	CHECK_NEAR(lc.alpha, 8, 0);
	CHECK_EQ_INT(lc.targets, 1u << TR_LIN_Q | 1u << TR_LIN_V);
	CHECK_STR_EQ(lc.task_type, "CAUSAL_LM");
	CHECK_STR_EQ(lc.base_model, "/models/qwen2");

	/* Merge: the full model computes what the adapted one does. */
	snprintf(merged, sizeof(merged), "%s/merged", tmp);
	CHECK_EQ_INT(tr_merge(base, out, merged, "cpu", NULL, &eb), TD_OK);
	struct tr_weights *mw = NULL;
	CHECK_EQ_INT(tr_weights_open(&mw, merged, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_load(plain, mw, &eb), TD_OK);
	tr_weights_close(mw);
	CHECK_EQ_INT(tr_model_forward_logits(m, ids, &eb), TD_OK);
	tr_model_get_logits(m, la);
	CHECK_EQ_INT(tr_model_forward_logits(plain, ids, &eb), TD_OK);
	tr_model_get_logits(plain, lb);
	double maxd = 0, maxr = 0;
	for (size_t i = 0; i < nl; i++) {
		maxd = fmax(maxd, fabs((double)la[i] - lb[i]));
		maxr = fmax(maxr, fabs((double)lb[i]));
	}
	/* W + s B A rounded into one float32 matrix computes the adapted
	 * model's x W^T + s (x A^T) B^T in another order */
	CHECK_MSG(maxd / maxr < F32_FORWARD_RTOL, "merged logits differ from the adapted model's: %g normwise", maxd / maxr);
	/* and differ from the base (the adapter does something). */
	CHECK_EQ_INT(tr_model_load(plain, w, &eb), TD_OK);
	CHECK_EQ_INT(tr_model_forward_logits(plain, ids, &eb), TD_OK);
	tr_model_get_logits(plain, lb);
	CHECK(memcmp(la, lb, nl * sizeof(float)) != 0);

	free(la);
	free(lb);
	tr_weights_close(w);
	tr_model_free(m);
	tr_model_free(m2);
	tr_model_free(plain);
	CHECK_EQ_INT(be->bytes_in_use, 0);
	gpu_backend_free(be);
}

int main(void)
{
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set");
	snprintf(tmp, sizeof(tmp), "/tmp/test_lora-XXXXXX");
	if (!mkdtemp(tmp))
		return 2;
	char path[PATH_MAX];
	struct td_errbuf eb = {{0}};
	snprintf(path, sizeof(path), "%s/qwen2/config.json", fx);
	if (tr_config_load(&qwen2_cfg, path, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		return 2;
	}
	test_bad_adapters();
	test_save_load_init_merge();
	check_rm_tree(tmp);
	return check_status();
}
