/* PEFT LoRA adapters: config and tensors, read, checked, written (train/lora.h).
 *
 * adapter_config.json is written with the keys PEFT has written since 0.10
 * (sorted, as PEFT's json.dumps does), so that older and newer PEFT versions
 * load it; keys PEFT added later are left to their defaults. */
#include "train/lora.h"

#include <errno.h>
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define CONFIG_MAX_BYTES (1u << 20)
#define PREFIX "base_model.model.model.layers."
#define HEAD_NAME "base_model.model.score.weight"

/* --- config --- */

static json_object *get(json_object *o, const char *key)
{
	json_object *v = NULL;
	return json_object_object_get_ex(o, key, &v) ? v : NULL;
}

static bool is_null(json_object *v)
{
	return !v || json_object_is_type(v, json_type_null);
}

static td_err want_number(json_object *root, const char *key, double dflt, double *out,
			  const char *path, struct td_errbuf *eb)
{
	json_object *v = get(root, key);
	if (is_null(v)) {
		*out = dflt;
		return TD_OK;
	}
	if (!json_object_is_type(v, json_type_int) && !json_object_is_type(v, json_type_double))
		return td_fail(eb, TD_EFORMAT, "%s: %s must be a number (got %s)", path, key,
			       json_object_to_json_string(v));
	*out = json_object_get_double(v);
	if (!isfinite(*out))
		return td_fail(eb, TD_EFORMAT, "%s: %s is not finite", path, key);
	return TD_OK;
}

static td_err want_bool(json_object *root, const char *key, bool *out, const char *path,
			struct td_errbuf *eb)
{
	json_object *v = get(root, key);
	*out = false;
	if (is_null(v))
		return TD_OK;
	if (!json_object_is_type(v, json_type_boolean))
		return td_fail(eb, TD_EFORMAT, "%s: %s must be true or false (got %s)", path, key,
			       json_object_to_json_string(v));
	*out = json_object_get_boolean(v);
	return TD_OK;
}

/* A PEFT option traind does not implement must be absent, null, false or empty. */
static td_err refuse_if_set(json_object *root, const char *key, const char *what, const char *path,
			    struct td_errbuf *eb)
{
	json_object *v = get(root, key);
	bool set = !is_null(v) &&
		   !(json_object_is_type(v, json_type_boolean) && !json_object_get_boolean(v)) &&
		   !(json_object_is_type(v, json_type_object) && json_object_object_length(v) == 0) &&
		   !(json_object_is_type(v, json_type_array) && json_object_array_length(v) == 0);
	if (set)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: %s = %s: %s is not supported", path, key,
			       json_object_to_json_string(v), what);
	return TD_OK;
}

/* The projection a target_modules entry names: "q_proj", or a dotted path
 * ending in one ("self_attn.q_proj"), as PEFT matches by suffix. */
static int target_lin(const char *s)
{
	const char *dot = strrchr(s, '.');
	return tr_lin_from_name(dot ? dot + 1 : s);
}

static td_err parse_config(struct tr_lora_config *c, json_object *root, const char *path,
			   struct td_errbuf *eb)
{
	td_err e;
	memset(c, 0, sizeof(*c));
	if (!json_object_is_type(root, json_type_object))
		return td_fail(eb, TD_EFORMAT, "%s: not a JSON object", path);
	json_object *v = get(root, "peft_type");
	if (!v || !json_object_is_type(v, json_type_string) ||
	    strcmp(json_object_get_string(v), "LORA") != 0)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: peft_type is %s; only LORA adapters are supported",
			       path, v ? json_object_to_json_string(v) : "missing");
	v = get(root, "r");
	if (!v || !json_object_is_type(v, json_type_int) || json_object_get_int64(v) < 1 ||
	    json_object_get_int64(v) > 65536)
		return td_fail(eb, TD_EFORMAT, "%s: r must be an integer in [1, 65536] (got %s)", path,
			       v ? json_object_to_json_string(v) : "nothing");
	c->r = (int)json_object_get_int64(v);
	if ((e = want_number(root, "lora_alpha", 8.0, &c->alpha, path, eb)))
		return e;
	if (!(c->alpha > 0))
		return td_fail(eb, TD_EFORMAT, "%s: lora_alpha must be > 0 (got %g)", path, c->alpha);
	if ((e = want_number(root, "lora_dropout", 0.0, &c->dropout, path, eb)))
		return e;
	if (!(c->dropout >= 0 && c->dropout < 1))
		return td_fail(eb, TD_EFORMAT, "%s: lora_dropout must be in [0, 1) (got %g)", path,
			       c->dropout);
	if ((e = want_bool(root, "use_rslora", &c->rslora, path, eb)))
		return e;

	v = get(root, "target_modules");
	if (v && json_object_is_type(v, json_type_string))
		return td_fail(eb, TD_EUNSUPPORTED,
			       "%s: target_modules \"%s\" is a pattern; list the projections instead "
			       "(q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)",
			       path, json_object_get_string(v));
	if (!v || !json_object_is_type(v, json_type_array) || json_object_array_length(v) == 0)
		return td_fail(eb, TD_EFORMAT, "%s: target_modules must be a non-empty list", path);
	for (size_t i = 0; i < json_object_array_length(v); i++) {
		json_object *s = json_object_array_get_idx(v, i);
		int lin = s && json_object_is_type(s, json_type_string)
				  ? target_lin(json_object_get_string(s))
				  : -1;
		if (lin < 0)
			return td_fail(eb, TD_EMISMATCH,
				       "%s: target_modules[%zu] = %s is not a projection of a llama, qwen2 "
				       "or qwen3 layer (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
				       "down_proj)",
				       path, i, s ? json_object_to_json_string(s) : "null");
		c->targets |= 1u << lin;
	}

	v = get(root, "bias");
	if (!is_null(v) && (!json_object_is_type(v, json_type_string) ||
			    strcmp(json_object_get_string(v), "none") != 0))
		return td_fail(eb, TD_EUNSUPPORTED, "%s: bias = %s: trained biases are not supported",
			       path, json_object_to_json_string(v));
	static const struct {
		const char *key, *what;
	} refused[] = {
		{"use_dora", "DoRA"},
		{"fan_in_fan_out", "a transposed (Conv1D) base"},
		{"rank_pattern", "a per-module rank"},
		{"alpha_pattern", "a per-module alpha"},
		{"layers_to_transform", "adapting only some layers"},
		{"layer_replication", "layer replication"},
		{"lora_bias", "a lora_B bias"},
		{"use_qalora", "QA-LoRA"},
	};
	for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
		if ((e = refuse_if_set(root, refused[i].key, refused[i].what, path, eb)))
			return e;

	v = get(root, "task_type");
	const char *task = is_null(v) ? "CAUSAL_LM" : json_object_get_string(v);
	if (!json_object_is_type(v, json_type_string) && !is_null(v))
		return td_fail(eb, TD_EFORMAT, "%s: task_type must be a string", path);
	if (strcmp(task, "CAUSAL_LM") != 0 && strcmp(task, "SEQ_CLS") != 0)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: task_type %s (CAUSAL_LM and SEQ_CLS are supported)",
			       path, task);
	snprintf(c->task_type, sizeof(c->task_type), "%s", task);

	v = get(root, "modules_to_save");
	if (!is_null(v)) {
		if (!json_object_is_type(v, json_type_array))
			return td_fail(eb, TD_EFORMAT, "%s: modules_to_save must be a list or null", path);
		for (size_t i = 0; i < json_object_array_length(v); i++) {
			json_object *s = json_object_array_get_idx(v, i);
			const char *n = s && json_object_is_type(s, json_type_string) ? json_object_get_string(s) : "";
			if (strcmp(n, "score") == 0)
				c->score = true;
			else if (strcmp(n, "classifier") != 0) /* PEFT lists it for every SEQ_CLS model */
				return td_fail(eb, TD_EUNSUPPORTED,
					       "%s: modules_to_save[%zu] = %s: only the classifier head "
					       "(score) can be saved with an adapter",
					       path, i, s ? json_object_to_json_string(s) : "null");
		}
	}
	v = get(root, "base_model_name_or_path");
	if (!is_null(v)) {
		if (!json_object_is_type(v, json_type_string))
			return td_fail(eb, TD_EFORMAT, "%s: base_model_name_or_path must be a string", path);
		snprintf(c->base_model, sizeof(c->base_model), "%s", json_object_get_string(v));
	}
	return TD_OK;
}

td_err tr_lora_config_load(struct tr_lora_config *c, const char *dir, struct td_errbuf *eb)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/adapter_config.json", dir);
	json_object *root = NULL;
	td_err e = tr__json_read_file(&root, path, CONFIG_MAX_BYTES, eb);
	if (e != TD_OK)
		return e;
	struct tr_lora_config tmp;
	e = parse_config(&tmp, root, path, eb);
	json_object_put(root);
	if (e == TD_OK)
		*c = tmp;
	return e;
}

double tr_lora_scale(const struct tr_lora_config *c)
{
	return c->rslora ? c->alpha / sqrt((double)c->r) : c->alpha / (double)c->r;
}

/* --- tensors --- */

bool tr_lora_parse_name(const char *name, int *layer, int *lin, bool *is_b)
{
	size_t np = strlen(PREFIX);
	if (strncmp(name, PREFIX, np) != 0)
		return false;
	const char *p = name + np;
	if (*p < '0' || *p > '9' || (*p == '0' && p[1] != '.'))
		return false;
	long l = 0;
	while (*p >= '0' && *p <= '9' && l < 1000000)
		l = l * 10 + (*p++ - '0');
	if (*p++ != '.')
		return false;
	for (int k = 0; k < TR_LIN_COUNT; k++) {
		const char *path = tr_lin_path(k);
		size_t n = strlen(path);
		if (strncmp(p, path, n) != 0)
			continue;
		const char *rest = p + n;
		if (strcmp(rest, ".lora_A.weight") != 0 && strcmp(rest, ".lora_B.weight") != 0)
			return false;
		*layer = (int)l;
		*lin = k;
		*is_b = rest[6] == 'B';
		return true;
	}
	return false;
}

static void fmt_shape(char *buf, size_t len, const struct tr_st_tensor *t)
{
	size_t o = 0;
	buf[0] = 0;
	for (int d = 0; d < t->ndim && o < len; d++)
		o += (size_t)snprintf(buf + o, len - o, "%s%lld", d ? ", " : "", (long long)t->shape[d]);
}

td_err tr_lora_check(const struct tr_lora_config *c, const struct tr_model_config *base,
		     int num_labels, const struct tr_st_file *f, struct td_errbuf *eb)
{
	const char *path = tr_st_path(f);
	const int L = base->num_layers;
	unsigned char *seen = calloc((size_t)L * TR_LIN_COUNT, 1); /* bit 0: A, bit 1: B */
	if (!seen)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	td_err e = TD_OK;
	bool head = false;
	char got[64];
	for (size_t i = 0; i < tr_st_count(f) && e == TD_OK; i++) {
		const struct tr_st_tensor *t = tr_st_at(f, i);
		fmt_shape(got, sizeof(got), t);
		if (strcmp(t->name, HEAD_NAME) == 0) {
			if (!c->score || num_labels <= 0)
				e = td_fail(eb, TD_EMISMATCH,
					    "%s: tensor '%s' is a classifier head, but %s", path, t->name,
					    !c->score ? "modules_to_save does not list score"
						      : "the model is not a classifier");
			else if (t->ndim != 2 || t->shape[0] != num_labels || t->shape[1] != base->hidden_size)
				e = td_fail(eb, TD_EMISMATCH,
					    "%s: tensor '%s' has shape [%s]; %d labels on hidden size %d "
					    "need [%d, %d]",
					    path, t->name, got, num_labels, base->hidden_size, num_labels,
					    base->hidden_size);
			head = true;
			continue;
		}
		int l, lin;
		bool is_b;
		if (!tr_lora_parse_name(t->name, &l, &lin, &is_b)) {
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' is not a LoRA tensor of a llama/qwen2/qwen3 projection "
				    "(" PREFIX "N.self_attn.q_proj.lora_A.weight ...)",
				    path, t->name);
			break;
		}
		if (l >= L) {
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' adapts layer %d, but the %s base model has %d layers",
				    path, t->name, l, base->model_type, L);
			break;
		}
		if (!(c->targets & (1u << lin))) {
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' adapts %s, which target_modules does not list", path,
				    t->name, tr_lin_name(lin));
			break;
		}
		int in, out;
		tr_lin_dims(base, lin, &in, &out);
		int64_t w0 = is_b ? out : c->r, w1 = is_b ? c->r : in;
		if (t->ndim != 2 || t->shape[0] != w0 || t->shape[1] != w1) {
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: tensor '%s' has shape [%s]; r = %d and %s (%d -> %d) of the %s "
				    "base model need [%lld, %lld]",
				    path, t->name, got, c->r, tr_lin_name(lin), in, out, base->model_type,
				    (long long)w0, (long long)w1);
			break;
		}
		seen[(size_t)l * TR_LIN_COUNT + lin] |= (unsigned char)(is_b ? 2 : 1);
	}
	for (int l = 0; l < L && e == TD_OK; l++)
		for (int lin = 0; lin < TR_LIN_COUNT && e == TD_OK; lin++) {
			if (!(c->targets & (1u << lin)))
				continue;
			unsigned char s = seen[(size_t)l * TR_LIN_COUNT + lin];
			if (s != 3)
				e = td_fail(eb, TD_EMISMATCH,
					    "%s: missing tensor " PREFIX "%d.%s.lora_%c.weight (target_modules "
					    "lists %s and the base has %d layers)",
					    path, l, tr_lin_path(lin), s & 1 ? 'B' : 'A', tr_lin_name(lin), L);
		}
	if (e == TD_OK && c->score && num_labels > 0 && !head)
		e = td_fail(eb, TD_EMISMATCH, "%s: missing tensor '%s' (modules_to_save lists score)", path,
			    HEAD_NAME);
	free(seen);
	return e;
}

static const char *targets_str(char *buf, size_t len, unsigned targets)
{
	size_t o = 0;
	buf[0] = 0;
	for (int k = 0; k < TR_LIN_COUNT && o < len; k++)
		if (targets & (1u << k))
			o += (size_t)snprintf(buf + o, len - o, "%s%s", o ? ", " : "", tr_lin_name(k));
	return buf;
}

td_err tr_lora_load(struct tr_model *m, const char *dir, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(m);
	const struct tr_plan_opts *o = &p->opts;
	struct tr_lora_config c;
	td_err e = tr_lora_config_load(&c, dir, eb);
	if (e != TD_OK)
		return e;
	char t1[96], t2[96];
	if (c.r != o->lora_rank || c.targets != o->lora_targets)
		return td_fail(eb, TD_EMISMATCH,
			       "%s/adapter_config.json: r = %d on %s, but the job's LoRA is rank %d on %s",
			       dir, c.r, targets_str(t1, sizeof(t1), c.targets), o->lora_rank,
			       targets_str(t2, sizeof(t2), o->lora_targets));
	if (fabs(tr_lora_scale(&c) - p->lora_scale) > 1e-6 * fabs(p->lora_scale))
		return td_fail(eb, TD_EMISMATCH,
			       "%s/adapter_config.json: lora_alpha %g (scale %g), but the job's scale is %g",
			       dir, c.alpha, tr_lora_scale(&c), (double)p->lora_scale);
	if (c.score && o->num_labels <= 0)
		return td_fail(eb, TD_EMISMATCH,
			       "%s: a classifier's adapter (modules_to_save: score), but the model is a "
			       "causal LM",
			       dir);
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
	struct tr_st_file *f = NULL;
	if ((e = tr_st_open(&f, path, eb)) != TD_OK)
		return e;
	if ((e = tr_lora_check(&c, &p->cfg, o->num_labels, f, eb)) != TD_OK) {
		tr_st_close(f);
		return e;
	}
	size_t maxn = 0;
	for (size_t i = 0; i < p->nparams; i++)
		if (p->params[i].kind != TR_P_BASE && p->params[i].numel > maxn)
			maxn = p->params[i].numel;
	float *host = malloc((maxn ? maxn : 1) * sizeof(float));
	if (!host)
		e = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	for (size_t i = 0; i < p->nparams && e == TD_OK; i++) {
		const struct tr_param *pp = &p->params[i];
		const char *name = pp->kind == TR_P_HEAD ? HEAD_NAME : pp->name;
		if (pp->kind == TR_P_BASE || (pp->kind == TR_P_HEAD && !c.score))
			continue;
		const struct tr_st_tensor *t = tr_st_find(f, name);
		assert(t); /* tr_lora_check found every one */
		if ((e = tr_st_to_f32(host, t, eb)) == TD_OK && (e = tr_model_set_param(m, pp, host)))
			e = td_fail(eb, e, "%s: cannot set '%s': %s", path, name, td_strerror(e));
	}
	free(host);
	tr_st_close(f);
	return e;
}

/* --- init and save --- */

static uint64_t splitmix(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

td_err tr_lora_init(struct tr_model *m, uint64_t seed, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(m);
	size_t maxn = 0;
	for (size_t i = 0; i < p->nparams; i++)
		if ((p->params[i].kind == TR_P_LORA_A || p->params[i].kind == TR_P_LORA_B) &&
		    p->params[i].numel > maxn)
			maxn = p->params[i].numel;
	float *host = malloc((maxn ? maxn : 1) * sizeof(float));
	if (!host)
		return td_fail(eb, TD_ENOMEM, "lora: out of memory");
	uint64_t s = seed;
	td_err e = TD_OK;
	for (size_t i = 0; i < p->nparams && e == TD_OK; i++) {
		const struct tr_param *pp = &p->params[i];
		if (pp->kind == TR_P_LORA_A) {
			double bound = 1.0 / sqrt((double)pp->shape[1]);
			for (size_t k = 0; k < pp->numel; k++)
				host[k] = (float)(bound * ((double)(splitmix(&s) >> 11) * 0x1.0p-52 - 1.0));
		} else if (pp->kind == TR_P_LORA_B) {
			memset(host, 0, pp->numel * sizeof(float));
		} else {
			continue;
		}
		if ((e = tr_model_set_param(m, pp, host)) != TD_OK)
			e = td_fail(eb, e, "lora: cannot set '%s': %s", pp->name, td_strerror(e));
	}
	free(host);
	return e;
}

/* json-c's null is the NULL pointer, which tr__json_put takes for a failed
 * allocation: nulls are added directly. Returns true, for && chains. */
static bool put_null(json_object *o, const char *key)
{
	json_object_object_add(o, key, NULL);
	return true;
}

/* A number as PEFT's json writes it: an integer when it is one. */
static json_object *json_num(double v)
{
	if (v == floor(v) && fabs(v) < 1e15)
		return json_object_new_int64((int64_t)v);
	return json_object_new_double(v);
}

/* The float dropout as the decimal it was given as ("0.1", not 0.100000001). */
static json_object *json_dropout(float p)
{
	char b[32];
	snprintf(b, sizeof(b), "%.7g", (double)p);
	if (!strpbrk(b, ".e"))
		strcat(b, ".0");
	return json_object_new_double_s(strtod(b, NULL), b);
}

static td_err write_config(const struct tr_plan *p, const char *path, const char *base_model,
			   struct td_errbuf *eb)
{
	const struct tr_plan_opts *o = &p->opts;
	bool cls = o->num_labels > 0;
	json_object *root = json_object_new_object(), *tm = NULL, *mts = NULL;
	/* Sorted keys, as PEFT writes them. */
	bool ok = root &&
		  tr__json_put(root, "alpha_pattern", json_object_new_object()) &&
		  put_null(root, "auto_mapping") &&
		  (base_model ? tr__json_put(root, "base_model_name_or_path", json_object_new_string(base_model)) != NULL
			      : put_null(root, "base_model_name_or_path")) &&
		  tr__json_put(root, "bias", json_object_new_string("none")) &&
		  tr__json_put(root, "fan_in_fan_out", json_object_new_boolean(false)) &&
		  tr__json_put(root, "inference_mode", json_object_new_boolean(true)) &&
		  tr__json_put(root, "init_lora_weights", json_object_new_boolean(true)) &&
		  put_null(root, "layer_replication") &&
		  put_null(root, "layers_pattern") &&
		  put_null(root, "layers_to_transform") &&
		  tr__json_put(root, "loftq_config", json_object_new_object()) &&
		  tr__json_put(root, "lora_alpha", json_num(o->lora_alpha)) &&
		  tr__json_put(root, "lora_dropout", json_dropout(o->lora_dropout)) &&
		  put_null(root, "megatron_config") &&
		  tr__json_put(root, "megatron_core", json_object_new_string("megatron.core")) &&
		  (cls ? (mts = tr__json_put(root, "modules_to_save", json_object_new_array())) != NULL
		       : put_null(root, "modules_to_save")) &&
		  (!cls || (tr__json_push(mts, json_object_new_string("classifier")) &&
			    tr__json_push(mts, json_object_new_string("score")))) &&
		  tr__json_put(root, "peft_type", json_object_new_string("LORA")) &&
		  tr__json_put(root, "r", json_object_new_int(o->lora_rank)) &&
		  tr__json_put(root, "rank_pattern", json_object_new_object()) &&
		  put_null(root, "revision") &&
		  (tm = tr__json_put(root, "target_modules", json_object_new_array())) != NULL;
	for (int k = 0; ok && k < TR_LIN_COUNT; k++)
		if (o->lora_targets & (1u << k))
			ok = tr__json_push(tm, json_object_new_string(tr_lin_name(k))) != NULL;
	ok = ok &&
	     tr__json_put(root, "task_type", json_object_new_string(cls ? "SEQ_CLS" : "CAUSAL_LM")) &&
	     tr__json_put(root, "use_dora", json_object_new_boolean(false)) &&
	     tr__json_put(root, "use_rslora", json_object_new_boolean(o->lora_rslora));
	td_err e;
	size_t len = 0;
	const char *text = ok ? json_object_to_json_string_length(
					root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
						      JSON_C_TO_STRING_NOSLASHESCAPE,
					&len)
			      : NULL;
	if (!text)
		e = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	else
		e = tr__write_atomic(path, (struct tr__chunk[]){{text, len}, {"\n", 1}}, 2, eb);
	json_object_put(root);
	return e;
}

/* mkdir -p */
static td_err make_dir(const char *dir, struct td_errbuf *eb)
{
	char tmp[PATH_MAX];
	if (snprintf(tmp, sizeof(tmp), "%s", dir) >= (int)sizeof(tmp))
		return td_fail(eb, TD_EINVAL, "%s: path too long", dir);
	for (char *p = tmp + 1;; p++) {
		if (*p && *p != '/')
			continue;
		char c = *p;
		*p = 0;
		if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
			return tr__errno_fail(eb, errno, tmp, "cannot create");
		if (!c)
			break;
		*p = c;
	}
	return TD_OK;
}

td_err tr_lora_save(struct tr_model *m, const char *dir, const char *base_model,
		    struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(m);
	if (p->opts.lora_rank <= 0)
		return td_fail(eb, TD_EINVAL, "%s: the model has no LoRA adapter to save", dir);
	size_t total = 0, n = 0;
	for (size_t i = 0; i < p->nparams; i++)
		if (p->params[i].kind != TR_P_BASE) {
			total += p->params[i].numel;
			n++;
		}
	float *host = malloc(total * sizeof(float));
	struct tr_st_entry *es = calloc(n, sizeof(*es));
	if (!host || !es) {
		free(host);
		free(es);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", dir);
	}
	size_t off = 0, k = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		if (pp->kind == TR_P_BASE)
			continue;
		tr_model_get_param(m, pp, host + off);
		es[k].name = pp->kind == TR_P_HEAD ? HEAD_NAME : pp->name;
		es[k].dtype = TR_DT_F32;
		es[k].ndim = pp->ndim;
		es[k].shape[0] = pp->shape[0];
		es[k].shape[1] = pp->shape[1];
		es[k].data = host + off;
		off += pp->numel;
		k++;
	}
	td_err e = gpu_sync(tr_model_backend(m), eb);
	if (e == TD_OK)
		e = make_dir(dir, eb);
	char path[PATH_MAX];
	static const char *const meta[] = {"format", "pt", NULL};
	if (e == TD_OK) {
		snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
		e = tr_st_write(path, es, n, meta, eb);
	}
	if (e == TD_OK) {
		snprintf(path, sizeof(path), "%s/adapter_config.json", dir);
		e = write_config(p, path, base_model, eb);
	}
	free(host);
	free(es);
	return e;
}
