/* config.json for llama, qwen2 and qwen3: parse and validate into
 * struct tr_model_config, and write one back (a copy of the source with the
 * dtype rewritten, or one generated from the struct).
 *
 * JSON null reads as absent, as transformers treats it. Every error names the
 * file and the key. This is not a general PretrainedConfig: keys the engine does
 * not use are ignored, except those that would change the math (rope scaling,
 * sliding-window attention, an activation other than SiLU), which are refused. */
#include "train/hfconfig.h"

#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CONFIG_MAX_BYTES (64u << 20)

static const struct {
	const char *model_type, *causal_lm, *classifier;
	int max_position_embeddings; /* transformers' default */
} archs[] = {
	[TR_ARCH_LLAMA] = {"llama", "LlamaForCausalLM", "LlamaForSequenceClassification", 2048},
	[TR_ARCH_QWEN2] = {"qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", 32768},
	[TR_ARCH_QWEN3] = {"qwen3", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", 32768},
};

static const struct {
	const char *name;
	enum tr_dtype dtype;
} torch_dtypes[] = {
	{"float32", TR_DT_F32},
	{"bfloat16", TR_DT_BF16},
	{"float16", TR_DT_F16},
};

/* ---- parsing ---- */

/* The value of key, or NULL when absent or null. */
static json_object *get(json_object *obj, const char *key)
{
	json_object *v = NULL;
	json_object_object_get_ex(obj, key, &v);
	return v;
}

static td_err wrong_type(const char *origin, const char *key, json_object *v, const char *want,
			 struct td_errbuf *eb)
{
	return td_fail(eb, TD_EFORMAT, "%s: \"%s\" is a JSON %s, expected %s", origin, key,
		       json_type_to_name(json_object_get_type(v)), want);
}

/* An int key; absent: def, or an error when def is INT_MIN (required). */
static td_err get_int(int *out, json_object *obj, const char *key, int def, const char *origin,
		      struct td_errbuf *eb)
{
	json_object *v = get(obj, key);
	if (!v) {
		if (def == INT_MIN)
			return td_fail(eb, TD_EFORMAT, "%s: \"%s\" is missing", origin, key);
		*out = def;
		return TD_OK;
	}
	if (!json_object_is_type(v, json_type_int))
		return wrong_type(origin, key, v, "an integer", eb);
	int64_t x = json_object_get_int64(v);
	if (x < INT_MIN || x > INT_MAX)
		return td_fail(eb, TD_EFORMAT, "%s: \"%s\" = %lld is out of range", origin, key, (long long)x);
	*out = (int)x;
	return TD_OK;
}

static td_err get_double(double *out, json_object *obj, const char *key, double def,
			 const char *origin, struct td_errbuf *eb)
{
	json_object *v = get(obj, key);
	if (!v) {
		*out = def;
		return TD_OK;
	}
	if (!json_object_is_type(v, json_type_double) && !json_object_is_type(v, json_type_int))
		return wrong_type(origin, key, v, "a number", eb);
	*out = json_object_get_double(v);
	return TD_OK;
}

static td_err get_bool(bool *out, json_object *obj, const char *key, bool def, const char *origin,
		       struct td_errbuf *eb)
{
	json_object *v = get(obj, key);
	if (!v) {
		*out = def;
		return TD_OK;
	}
	if (!json_object_is_type(v, json_type_boolean))
		return wrong_type(origin, key, v, "true or false", eb);
	*out = json_object_get_boolean(v);
	return TD_OK;
}

/* A token id: null or absent is -1; a list (eos) gives its first entry. */
static td_err get_token(int *out, json_object *obj, const char *key, const char *origin,
			struct td_errbuf *eb)
{
	json_object *v = get(obj, key);
	if (v && json_object_is_type(v, json_type_array)) {
		if (json_object_array_length(v) == 0) {
			*out = -1;
			return TD_OK;
		}
		v = json_object_array_get_idx(v, 0);
		if (!v || !json_object_is_type(v, json_type_int))
			return wrong_type(origin, key, v, "a list of integers", eb);
	}
	if (!v) {
		*out = -1;
		return TD_OK;
	}
	if (!json_object_is_type(v, json_type_int))
		return wrong_type(origin, key, v, "an integer, a list or null", eb);
	int64_t x = json_object_get_int64(v);
	if (x < 0 || x > INT_MAX)
		return td_fail(eb, TD_EFORMAT, "%s: \"%s\" = %lld is not a token id", origin, key, (long long)x);
	*out = (int)x;
	return TD_OK;
}

/* A rope_type (or legacy "type") inside obj must be "default": anything else
 * (linear, dynamic, yarn, llama3, ...) rescales the frequencies. */
static td_err check_rope_type(json_object *obj, const char *where, const char *origin,
			      struct td_errbuf *eb)
{
	if (!json_object_is_type(obj, json_type_object))
		return wrong_type(origin, where, obj, "an object", eb);
	static const char *const keys[] = {"rope_type", "type"};
	for (size_t i = 0; i < 2; i++) {
		json_object *v = get(obj, keys[i]);
		if (!v)
			continue;
		if (!json_object_is_type(v, json_type_string))
			return td_fail(eb, TD_EFORMAT, "%s: \"%s.%s\" is a JSON %s, expected a string", origin,
				       where, keys[i], json_type_to_name(json_object_get_type(v)));
		if (strcmp(json_object_get_string(v), "default") != 0)
			return td_fail(eb, TD_EUNSUPPORTED,
				       "%s: \"%s.%s\" is \"%s\": only \"default\" rope is supported", origin,
				       where, keys[i], json_object_get_string(v));
	}
	return TD_OK;
}

static td_err get_rope(struct tr_model_config *c, json_object *root, const char *origin,
		       struct td_errbuf *eb)
{
	td_err err;
	json_object *scaling = get(root, "rope_scaling"), *params = get(root, "rope_parameters");
	if (scaling && (err = check_rope_type(scaling, "rope_scaling", origin, eb)))
		return err;
	if ((err = get_double(&c->rope_theta, root, "rope_theta", 10000.0, origin, eb)))
		return err;
	/* transformers 5 moves rope_theta into rope_parameters; that one wins. */
	if (params) {
		if ((err = check_rope_type(params, "rope_parameters", origin, eb)))
			return err;
		json_object *v = get(params, "rope_theta");
		if (v && !json_object_is_type(v, json_type_double) && !json_object_is_type(v, json_type_int))
			return wrong_type(origin, "rope_parameters.rope_theta", v, "a number", eb);
		if (v)
			c->rope_theta = json_object_get_double(v);
	}
	return TD_OK;
}

/* Keys that would change the math and that the engine does not implement:
 * an activation other than SiLU, sliding-window attention. */
static td_err check_math(json_object *root, const char *origin, struct td_errbuf *eb)
{
	json_object *act = get(root, "hidden_act"), *types = get(root, "layer_types");
	if (act && !json_object_is_type(act, json_type_string))
		return wrong_type(origin, "hidden_act", act, "a string", eb);
	if (act && strcmp(json_object_get_string(act), "silu") != 0)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: \"hidden_act\" is \"%s\": only silu is supported",
			       origin, json_object_get_string(act));
	bool sliding = false;
	td_err err = get_bool(&sliding, root, "use_sliding_window", false, origin, eb);
	if (err)
		return err;
	if (sliding)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: \"use_sliding_window\" is true: only full attention is supported",
			       origin);
	if (types && !json_object_is_type(types, json_type_array))
		return wrong_type(origin, "layer_types", types, "a list", eb);
	for (size_t i = 0; types && i < json_object_array_length(types); i++) {
		const char *t = json_object_get_string(json_object_array_get_idx(types, i));
		if (!t || strcmp(t, "full_attention") != 0)
			return td_fail(eb, TD_EUNSUPPORTED,
				       "%s: \"layer_types\"[%zu] is \"%s\": only full_attention is supported", origin,
				       i, t ? t : "null");
	}
	return TD_OK;
}

static td_err get_dtype(enum tr_dtype *out, json_object *root, const char *origin,
			struct td_errbuf *eb)
{
	const char *key = get(root, "dtype") ? "dtype" : "torch_dtype";
	json_object *v = get(root, key);
	*out = TR_DT_F32;
	if (!v)
		return TD_OK;
	if (!json_object_is_type(v, json_type_string))
		return wrong_type(origin, key, v, "a string", eb);
	for (size_t i = 0; i < sizeof(torch_dtypes) / sizeof(torch_dtypes[0]); i++) {
		if (strcmp(json_object_get_string(v), torch_dtypes[i].name) == 0) {
			*out = torch_dtypes[i].dtype;
			return TD_OK;
		}
	}
	return td_fail(eb, TD_EUNSUPPORTED,
		       "%s: \"%s\" is \"%s\": supported are float32, bfloat16 and float16", origin, key,
		       json_object_get_string(v));
}

static td_err check_sizes(const struct tr_model_config *c, const char *origin, struct td_errbuf *eb)
{
	const struct {
		const char *key;
		int value;
	} sizes[] = {
		{"vocab_size", c->vocab_size},
		{"hidden_size", c->hidden_size},
		{"intermediate_size", c->intermediate_size},
		{"num_hidden_layers", c->num_layers},
		{"num_attention_heads", c->num_heads},
		{"num_key_value_heads", c->num_kv_heads},
		{"head_dim", c->head_dim},
		{"max_position_embeddings", c->max_position_embeddings},
	};
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
		if (sizes[i].value <= 0)
			return td_fail(eb, TD_EFORMAT, "%s: \"%s\" must be positive, not %d", origin,
				       sizes[i].key, sizes[i].value);
	if (c->num_heads % c->num_kv_heads)
		return td_fail(eb, TD_EFORMAT,
			       "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
			       origin, c->num_heads, c->num_kv_heads);
	if (c->head_dim % 2)
		return td_fail(eb, TD_EFORMAT, "%s: head_dim (%d) must be even: RoPE rotates pairs", origin,
			       c->head_dim);
	if (!(c->rope_theta > 0) || !isfinite(c->rope_theta))
		return td_fail(eb, TD_EFORMAT, "%s: rope_theta (%g) must be positive", origin, c->rope_theta);
	if (!(c->rms_norm_eps > 0) || !isfinite(c->rms_norm_eps))
		return td_fail(eb, TD_EFORMAT, "%s: rms_norm_eps (%g) must be positive", origin,
			       c->rms_norm_eps);
	if (c->num_labels < 0)
		return td_fail(eb, TD_EFORMAT, "%s: num_labels (%d) is negative", origin, c->num_labels);
	return TD_OK;
}

static td_err parse_root(struct tr_model_config *c, json_object *root, const char *origin,
			 struct td_errbuf *eb)
{
	if (!json_object_is_type(root, json_type_object))
		return td_fail(eb, TD_EFORMAT, "%s: a JSON %s, not an object", origin,
			       json_type_to_name(json_object_get_type(root)));
	json_object *mt = get(root, "model_type");
	if (!mt)
		return td_fail(eb, TD_EFORMAT, "%s: \"model_type\" is missing", origin);
	if (!json_object_is_type(mt, json_type_string))
		return wrong_type(origin, "model_type", mt, "a string", eb);
	const char *type = json_object_get_string(mt);
	size_t a = 0;
	while (a < sizeof(archs) / sizeof(archs[0]) && strcmp(type, archs[a].model_type) != 0)
		a++;
	if (a == sizeof(archs) / sizeof(archs[0]))
		return td_fail(eb, TD_EUNSUPPORTED,
			       "%s: model_type \"%s\" is not supported (llama, qwen2, qwen3)", origin, type);
	c->arch = (enum tr_arch)a;
	snprintf(c->model_type, sizeof(c->model_type), "%s", archs[a].model_type);

	td_err err;
	bool attention_bias = false;
	if ((err = get_int(&c->vocab_size, root, "vocab_size", INT_MIN, origin, eb)) ||
	    (err = get_int(&c->hidden_size, root, "hidden_size", INT_MIN, origin, eb)) ||
	    (err = get_int(&c->intermediate_size, root, "intermediate_size", INT_MIN, origin, eb)) ||
	    (err = get_int(&c->num_layers, root, "num_hidden_layers", INT_MIN, origin, eb)) ||
	    (err = get_int(&c->num_heads, root, "num_attention_heads", INT_MIN, origin, eb)) ||
	    (err = get_int(&c->num_kv_heads, root, "num_key_value_heads", c->num_heads, origin, eb)) ||
	    (err = get_int(&c->head_dim, root, "head_dim", 0, origin, eb)) ||
	    (err = get_int(&c->max_position_embeddings, root, "max_position_embeddings",
			   archs[a].max_position_embeddings, origin, eb)) ||
	    (err = get_double(&c->rms_norm_eps, root, "rms_norm_eps", 1e-6, origin, eb)) ||
	    (err = get_rope(c, root, origin, eb)) || (err = check_math(root, origin, eb)) ||
	    (err = get_bool(&c->tie_word_embeddings, root, "tie_word_embeddings", false, origin, eb)) ||
	    (err = get_bool(&attention_bias, root, "attention_bias", false, origin, eb)) ||
	    (err = get_bool(&c->mlp_bias, root, "mlp_bias", false, origin, eb)) ||
	    (err = get_dtype(&c->dtype, root, origin, eb)) ||
	    (err = get_token(&c->bos_token_id, root, "bos_token_id", origin, eb)) ||
	    (err = get_token(&c->eos_token_id, root, "eos_token_id", origin, eb)) ||
	    (err = get_token(&c->pad_token_id, root, "pad_token_id", origin, eb)))
		return err;

	/* Which biases exist is the architecture's, as in transformers' modules:
	 * qwen2 always has q/k/v biases and nothing else; llama and qwen3 put
	 * attention_bias on q, k, v and o; only llama has mlp_bias. */
	switch (c->arch) {
	case TR_ARCH_QWEN2:
		c->qkv_bias = true;
		c->o_bias = c->mlp_bias = c->qk_norm = false;
		break;
	case TR_ARCH_LLAMA:
		c->qkv_bias = c->o_bias = attention_bias;
		c->qk_norm = false;
		break;
	case TR_ARCH_QWEN3:
		c->qkv_bias = c->o_bias = attention_bias;
		c->mlp_bias = false;
		c->qk_norm = true;
		break;
	}

	if (!get(root, "head_dim") && c->num_heads > 0 && c->hidden_size > 0) {
		if (c->hidden_size % c->num_heads)
			return td_fail(eb, TD_EFORMAT,
				       "%s: hidden_size (%d) is not a multiple of num_attention_heads (%d) "
				       "and there is no head_dim",
				       origin, c->hidden_size, c->num_heads);
		c->head_dim = c->hidden_size / c->num_heads;
	}

	json_object *id2label = get(root, "id2label");
	if (id2label && !json_object_is_type(id2label, json_type_object))
		return wrong_type(origin, "id2label", id2label, "an object", eb);
	if ((err = get_int(&c->num_labels, root, "num_labels",
			   id2label ? json_object_object_length(id2label) : 0, origin, eb)))
		return err;
	return check_sizes(c, origin, eb);
}

td_err tr_config_parse(struct tr_model_config *out, const char *json, const char *origin,
		       struct td_errbuf *eb)
{
	json_object *root;
	td_err err = tr__json_parse(&root, json, strlen(json), origin, eb);
	if (err)
		return err;
	struct tr_model_config c = {0};
	err = parse_root(&c, root, origin, eb);
	json_object_put(root);
	if (!err)
		*out = c;
	return err;
}

td_err tr_config_load(struct tr_model_config *out, const char *path, struct td_errbuf *eb)
{
	char *text;
	size_t len;
	td_err err = tr__read_file(path, CONFIG_MAX_BYTES, &text, &len, eb);
	if (err)
		return err;
	if (strlen(text) != len)
		err = td_fail(eb, TD_EFORMAT, "%s: not valid JSON: it contains a NUL byte", path);
	else
		err = tr_config_parse(out, text, path, eb);
	free(text);
	return err;
}

/* ---- writing ---- */

/* A double as Python's json writes it (repr): the shortest digits that read
 * back exactly, fixed notation for exponents in [-4, 16), always with a point. */
static json_object *new_double(double d)
{
	char buf[64];
	int prec = 0;
	for (; prec < 17; prec++) {
		snprintf(buf, sizeof(buf), "%.*e", prec, d);
		if (strtod(buf, NULL) == d)
			break;
	}
	int exp = atoi(strchr(buf, 'e') + 1);
	if (exp >= -4 && exp < 16)
		snprintf(buf, sizeof(buf), "%.*f", prec - exp > 1 ? prec - exp : 1, d);
	return json_object_new_double_s(d, buf);
}

static json_object *new_token(int id)
{
	return id < 0 ? NULL : json_object_new_int(id);
}

/* Biases and norms the struct may claim but the model_type cannot express. */
static const char *inexpressible(const struct tr_model_config *c)
{
	switch (c->arch) {
	case TR_ARCH_QWEN2:
		return !c->qkv_bias || c->o_bias || c->mlp_bias || c->qk_norm
			       ? "qwen2 has q/k/v biases only and no q/k norm"
			       : NULL;
	case TR_ARCH_LLAMA:
		return c->qkv_bias != c->o_bias || c->qk_norm
			       ? "llama's attention_bias covers q, k, v and o together; it has no q/k norm"
			       : NULL;
	case TR_ARCH_QWEN3:
		return c->qkv_bias != c->o_bias || c->mlp_bias || !c->qk_norm
			       ? "qwen3's attention_bias covers q, k, v and o; it has q/k norm and no mlp_bias"
			       : NULL;
	}
	return "unknown arch";
}

/* Keys in sorted order, as transformers writes them. */
static json_object *generate(const struct tr_model_config *c, const char *dtype_name)
{
	const bool llama = c->arch == TR_ARCH_LLAMA, qwen2 = c->arch == TR_ARCH_QWEN2;
	json_object *root = json_object_new_object(), *arch, *id2label = NULL, *label2id = NULL, *rope;
	bool ok = root && (arch = tr__json_put(root, "architectures", json_object_new_array())) &&
		  tr__json_push(arch, json_object_new_string(c->num_labels > 0
								     ? archs[c->arch].classifier
								     : archs[c->arch].causal_lm)) &&
		  (qwen2 || tr__json_put(root, "attention_bias", json_object_new_boolean(c->qkv_bias))) &&
		  tr__json_put(root, "attention_dropout", new_double(0.0)) &&
		  (c->bos_token_id < 0 || tr__json_put(root, "bos_token_id", new_token(c->bos_token_id))) &&
		  tr__json_put(root, "dtype", json_object_new_string(dtype_name)) &&
		  (c->eos_token_id < 0 || tr__json_put(root, "eos_token_id", new_token(c->eos_token_id))) &&
		  tr__json_put(root, "head_dim", json_object_new_int(c->head_dim)) &&
		  tr__json_put(root, "hidden_act", json_object_new_string("silu")) &&
		  tr__json_put(root, "hidden_size", json_object_new_int(c->hidden_size)) &&
		  (c->num_labels <= 0 ||
		   (id2label = tr__json_put(root, "id2label", json_object_new_object()))) &&
		  tr__json_put(root, "initializer_range", new_double(0.02)) &&
		  tr__json_put(root, "intermediate_size", json_object_new_int(c->intermediate_size)) &&
		  (c->num_labels <= 0 ||
		   (label2id = tr__json_put(root, "label2id", json_object_new_object()))) &&
		  tr__json_put(root, "max_position_embeddings", json_object_new_int(c->max_position_embeddings)) &&
		  (!llama || tr__json_put(root, "mlp_bias", json_object_new_boolean(c->mlp_bias))) &&
		  tr__json_put(root, "model_type", json_object_new_string(c->model_type)) &&
		  tr__json_put(root, "num_attention_heads", json_object_new_int(c->num_heads)) &&
		  tr__json_put(root, "num_hidden_layers", json_object_new_int(c->num_layers)) &&
		  tr__json_put(root, "num_key_value_heads", json_object_new_int(c->num_kv_heads)) &&
		  (c->pad_token_id < 0 || tr__json_put(root, "pad_token_id", new_token(c->pad_token_id))) &&
		  tr__json_put(root, "rms_norm_eps", new_double(c->rms_norm_eps)) &&
		  (rope = tr__json_put(root, "rope_parameters", json_object_new_object())) &&
		  tr__json_put(rope, "rope_theta", new_double(c->rope_theta)) &&
		  tr__json_put(rope, "rope_type", json_object_new_string("default")) &&
		  tr__json_put(root, "tie_word_embeddings", json_object_new_boolean(c->tie_word_embeddings)) &&
		  tr__json_put(root, "use_cache", json_object_new_boolean(true)) &&
		  tr__json_put(root, "vocab_size", json_object_new_int(c->vocab_size));
	/* transformers' default labels: LABEL_0, LABEL_1, ... */
	for (int i = 0; ok && i < c->num_labels; i++) {
		char id[16], label[24];
		snprintf(id, sizeof(id), "%d", i);
		snprintf(label, sizeof(label), "LABEL_%d", i);
		ok = tr__json_put(id2label, id, json_object_new_string(label)) &&
		     tr__json_put(label2id, label, json_object_new_int(i));
	}
	if (!ok) {
		json_object_put(root);
		return NULL;
	}
	return root;
}

/* The source config with "dtype" (and "torch_dtype" where it is present) set. */
static td_err from_source(json_object **out, const char *src_path, const char *dtype_name,
			  struct td_errbuf *eb)
{
	json_object *root = NULL;
	td_err err = tr__json_read_file(&root, src_path, CONFIG_MAX_BYTES, eb);
	if (err)
		return err;
	if (!json_object_is_type(root, json_type_object)) {
		json_object_put(root);
		return td_fail(eb, TD_EFORMAT, "%s: a JSON %s, not an object", src_path,
			       json_type_to_name(json_object_get_type(root)));
	}
	if (!tr__json_put(root, "dtype", json_object_new_string(dtype_name)) ||
	    (json_object_object_get_ex(root, "torch_dtype", NULL) &&
	     !tr__json_put(root, "torch_dtype", json_object_new_string(dtype_name)))) {
		json_object_put(root);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", src_path);
	}
	*out = root;
	return TD_OK;
}

td_err tr_config_write(const struct tr_model_config *cfg, const char *src_path, enum tr_dtype dtype,
		       const char *path, struct td_errbuf *eb)
{
	const char *dtype_name = NULL;
	for (size_t i = 0; i < sizeof(torch_dtypes) / sizeof(torch_dtypes[0]); i++)
		if (torch_dtypes[i].dtype == dtype)
			dtype_name = torch_dtypes[i].name;
	if (!dtype_name)
		return td_fail(eb, TD_EINVAL, "%s: cannot save as %s: only F32, BF16 and F16", path,
			       tr_dtype_name(dtype) ? tr_dtype_name(dtype) : "?");

	json_object *root = NULL;
	td_err err;
	if (src_path) {
		if ((err = from_source(&root, src_path, dtype_name, eb)))
			return err;
	} else {
		const char *why = inexpressible(cfg);
		if (why)
			return td_fail(eb, TD_EINVAL, "%s: this config cannot be written: %s", path, why);
		if (!(root = generate(cfg, dtype_name)))
			return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	}
	size_t len;
	const char *text = json_object_to_json_string_length(
		root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED | JSON_C_TO_STRING_NOSLASHESCAPE, &len);
	if (!text)
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	else
		err = tr__write_atomic(path, (struct tr__chunk[]){{text, len}, {"\n", 1}}, 2, eb);
	json_object_put(root);
	return err;
}
