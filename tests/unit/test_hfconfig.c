/* Unit tests for train/hfconfig: the three fixture configs field by field,
 * variants (top-level rope_theta, torch_dtype, eos lists, defaults), a table of
 * bad configs checked by code and message, and write round trips (generated
 * and copied from a source). */
#include "train/hfconfig.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"

static char tmpdir[] = "/tmp/td-test-cfg-XXXXXX";

static const char *tmp_path(const char *name)
{
	static char buf[4][512];
	static int next;
	char *p = buf[next++ % 4];
	snprintf(p, sizeof(buf[0]), "%s/%s", tmpdir, name);
	return p;
}

static char *slurp(const char *path)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	char *buf = calloc(1, 1 << 20);
	if (buf)
		fread(buf, 1, (1 << 20) - 1, f);
	fclose(f);
	return buf;
}

static void write_text(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	CHECK(f != NULL);
	if (f) {
		fputs(text, f);
		fclose(f);
	}
}

static void check_same(const struct tr_model_config *a, const struct tr_model_config *b)
{
	CHECK_EQ_INT(a->arch, b->arch);
	CHECK_STR_EQ(a->model_type, b->model_type);
	CHECK_EQ_INT(a->vocab_size, b->vocab_size);
	CHECK_EQ_INT(a->hidden_size, b->hidden_size);
	CHECK_EQ_INT(a->intermediate_size, b->intermediate_size);
	CHECK_EQ_INT(a->num_layers, b->num_layers);
	CHECK_EQ_INT(a->num_heads, b->num_heads);
	CHECK_EQ_INT(a->num_kv_heads, b->num_kv_heads);
	CHECK_EQ_INT(a->head_dim, b->head_dim);
	CHECK_EQ_INT(a->max_position_embeddings, b->max_position_embeddings);
	CHECK(a->rope_theta == b->rope_theta);
	CHECK(a->rms_norm_eps == b->rms_norm_eps);
	CHECK_EQ_INT(a->tie_word_embeddings, b->tie_word_embeddings);
	CHECK_EQ_INT(a->qkv_bias, b->qkv_bias);
	CHECK_EQ_INT(a->o_bias, b->o_bias);
	CHECK_EQ_INT(a->mlp_bias, b->mlp_bias);
	CHECK_EQ_INT(a->qk_norm, b->qk_norm);
	CHECK_EQ_INT(a->bos_token_id, b->bos_token_id);
	CHECK_EQ_INT(a->eos_token_id, b->eos_token_id);
	CHECK_EQ_INT(a->pad_token_id, b->pad_token_id);
	CHECK_EQ_INT(a->num_labels, b->num_labels);
}

/* ---- fixtures ---- */

static const struct fixture {
	const char *dir;
	struct tr_model_config want;
} fixtures[] = {
	{"qwen2",
	 {.arch = TR_ARCH_QWEN2, .model_type = "qwen2", .vocab_size = 512, .hidden_size = 64,
	  .intermediate_size = 176, .num_layers = 2, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16,
	  .max_position_embeddings = 256, .rope_theta = 1e6, .rms_norm_eps = 1e-6,
	  .tie_word_embeddings = true, .qkv_bias = true, .dtype = TR_DT_F32, .bos_token_id = -1,
	  .eos_token_id = -1, .pad_token_id = -1}},
	{"llama",
	 {.arch = TR_ARCH_LLAMA, .model_type = "llama", .vocab_size = 512, .hidden_size = 64,
	  .intermediate_size = 176, .num_layers = 2, .num_heads = 4, .num_kv_heads = 4, .head_dim = 16,
	  .max_position_embeddings = 256, .rope_theta = 1e4, .rms_norm_eps = 1e-5,
	  .tie_word_embeddings = false, .dtype = TR_DT_F32, .bos_token_id = 1, .eos_token_id = 2,
	  .pad_token_id = -1}},
	{"qwen3",
	 {.arch = TR_ARCH_QWEN3, .model_type = "qwen3", .vocab_size = 512, .hidden_size = 64,
	  .intermediate_size = 176, .num_layers = 2, .num_heads = 4, .num_kv_heads = 2, .head_dim = 32,
	  .max_position_embeddings = 256, .rope_theta = 1e6, .rms_norm_eps = 1e-6,
	  .tie_word_embeddings = true, .qk_norm = true, .dtype = TR_DT_F32, .bos_token_id = -1,
	  .eos_token_id = -1, .pad_token_id = -1}},
	{"qwen2-classify",
	 {.arch = TR_ARCH_QWEN2, .model_type = "qwen2", .vocab_size = 512, .hidden_size = 64,
	  .intermediate_size = 176, .num_layers = 2, .num_heads = 4, .num_kv_heads = 2, .head_dim = 16,
	  .max_position_embeddings = 256, .rope_theta = 1e6, .rms_norm_eps = 1e-6,
	  .tie_word_embeddings = false, .qkv_bias = true, .dtype = TR_DT_F32, .bos_token_id = -1,
	  .eos_token_id = -1, .pad_token_id = 0, .num_labels = 3}},
};

static void fixture_path(char *buf, size_t size, const char *dir, const char *file)
{
	snprintf(buf, size, "%s/%s/%s", getenv("TD_FIXTURES"), dir, file);
}

static void test_fixtures(void)
{
	for (size_t i = 0; i < sizeof(fixtures) / sizeof(fixtures[0]); i++) {
		char path[512];
		fixture_path(path, sizeof(path), fixtures[i].dir, "config.json");
		struct tr_model_config c;
		struct td_errbuf eb;
		td_err err = tr_config_load(&c, path, &eb);
		CHECK_MSG(err == TD_OK, "%s", eb.msg);
		if (err)
			continue;
		check_same(&c, &fixtures[i].want);
		CHECK_EQ_INT(c.dtype, fixtures[i].want.dtype);
	}
}

/* ---- variants ---- */

/* A valid llama config without the keys the variants play with; JSON keys
 * appended after it override it (json-c keeps the last of a duplicate key). */
#define BASE                                                                                   \
	"\"model_type\": \"llama\", \"vocab_size\": 100, \"hidden_size\": 64, "                \
	"\"intermediate_size\": 128, \"num_hidden_layers\": 3, \"num_attention_heads\": 8"

static td_err parse(struct tr_model_config *c, const char *extra, struct td_errbuf *eb)
{
	char json[2048];
	snprintf(json, sizeof(json), "{" BASE "%s%s}", *extra ? ", " : "", extra);
	return tr_config_parse(c, json, "case.json", eb);
}

static void test_variants(void)
{
	struct tr_model_config c;
	struct td_errbuf eb;

	/* Defaults. */
	CHECK(parse(&c, "", &eb) == TD_OK);
	CHECK_EQ_INT(c.num_kv_heads, 8);
	CHECK_EQ_INT(c.head_dim, 8);
	CHECK_EQ_INT(c.max_position_embeddings, 2048);
	CHECK(c.rope_theta == 10000.0);
	CHECK(c.rms_norm_eps == 1e-6);
	CHECK(!c.tie_word_embeddings && !c.qkv_bias && !c.o_bias && !c.mlp_bias && !c.qk_norm);
	CHECK_EQ_INT(c.dtype, TR_DT_F32);
	CHECK(c.bos_token_id == -1 && c.eos_token_id == -1 && c.pad_token_id == -1);
	CHECK_EQ_INT(c.num_labels, 0);

	/* transformers 4: top-level rope_theta, torch_dtype, a rope_scaling of null. */
	CHECK(parse(&c, "\"rope_theta\": 500000.0, \"torch_dtype\": \"bfloat16\", \"rope_scaling\": null", &eb) == TD_OK);
	CHECK(c.rope_theta == 500000.0);
	CHECK_EQ_INT(c.dtype, TR_DT_BF16);
	/* An integer theta, "dtype" over "torch_dtype", a default rope_scaling. */
	CHECK(parse(&c, "\"rope_theta\": 250000, \"dtype\": \"float16\", \"torch_dtype\": \"float32\", "
			"\"rope_scaling\": {\"rope_type\": \"default\"}", &eb) == TD_OK);
	CHECK(c.rope_theta == 250000.0);
	CHECK_EQ_INT(c.dtype, TR_DT_F16);
	/* rope_parameters wins over a stale top-level value. */
	CHECK(parse(&c, "\"rope_theta\": 1.0, \"rope_parameters\": {\"rope_theta\": 7.5e5}", &eb) == TD_OK);
	CHECK(c.rope_theta == 750000.0);

	/* Tokens: eos as a list, bos null, pad explicit. */
	CHECK(parse(&c, "\"eos_token_id\": [7, 8], \"bos_token_id\": null, \"pad_token_id\": 3", &eb) == TD_OK);
	CHECK(c.eos_token_id == 7 && c.bos_token_id == -1 && c.pad_token_id == 3);
	CHECK(parse(&c, "\"eos_token_id\": []", &eb) == TD_OK);
	CHECK_EQ_INT(c.eos_token_id, -1);

	/* Biases per architecture. */
	CHECK(parse(&c, "\"attention_bias\": true, \"mlp_bias\": true", &eb) == TD_OK);
	CHECK(c.qkv_bias && c.o_bias && c.mlp_bias && !c.qk_norm);
	CHECK(parse(&c, "\"model_type\": \"qwen3\", \"attention_bias\": true, \"head_dim\": 16", &eb) == TD_OK);
	CHECK(c.arch == TR_ARCH_QWEN3 && c.qkv_bias && c.o_bias && !c.mlp_bias && c.qk_norm);
	CHECK_EQ_INT(c.head_dim, 16);
	CHECK_EQ_INT(c.max_position_embeddings, 32768);
	CHECK(parse(&c, "\"model_type\": \"qwen2\", \"attention_bias\": true", &eb) == TD_OK);
	CHECK(c.arch == TR_ARCH_QWEN2 && c.qkv_bias && !c.o_bias && !c.qk_norm);

	/* Labels. */
	CHECK(parse(&c, "\"id2label\": {\"0\": \"neg\", \"1\": \"pos\"}", &eb) == TD_OK);
	CHECK_EQ_INT(c.num_labels, 2);
	CHECK(parse(&c, "\"id2label\": {\"0\": \"neg\", \"1\": \"pos\"}, \"num_labels\": 5", &eb) == TD_OK);
	CHECK_EQ_INT(c.num_labels, 5);

	/* The out-parameter is untouched on failure. */
	c.vocab_size = 12345;
	CHECK(parse(&c, "\"hidden_size\": -1", &eb) != TD_OK);
	CHECK_EQ_INT(c.vocab_size, 12345);
}

/* ---- bad configs ---- */

static const struct bad_case {
	const char *what;
	const char *json; /* "{BASE, <json>}" unless raw */
	bool raw;
	td_err code;
	const char *word;
} bad_cases[] = {
	{"not JSON", "{\"model_type\": ", true, TD_EFORMAT, "not valid JSON"},
	{"trailing junk", "{} {}", true, TD_EFORMAT, "not valid JSON"},
	{"not an object", "[1]", true, TD_EFORMAT, "not an object"},
	{"no model_type", "{\"hidden_size\": 1}", true, TD_EFORMAT, "\"model_type\" is missing"},
	{"unknown model_type", "\"model_type\": \"gpt2\"", false, TD_EUNSUPPORTED, "\"gpt2\""},
	{"model_type a number", "\"model_type\": 7", false, TD_EFORMAT, "model_type"},
	{"hidden_size a string", "\"hidden_size\": \"64\"", false, TD_EFORMAT, "\"hidden_size\" is a JSON string"},
	{"hidden_size a float", "\"hidden_size\": 64.5", false, TD_EFORMAT, "hidden_size"},
	{"missing hidden_size", "\"hidden_size\": null", false, TD_EFORMAT, "\"hidden_size\" is missing"},
	{"hidden_size too big", "\"hidden_size\": 4294967296", false, TD_EFORMAT, "out of range"},
	{"heads not dividing", "\"num_key_value_heads\": 3", false, TD_EFORMAT, "num_key_value_heads (3)"},
	{"zero kv heads", "\"num_key_value_heads\": 0", false, TD_EFORMAT, "num_key_value_heads"},
	{"zero vocab", "\"vocab_size\": 0", false, TD_EFORMAT, "\"vocab_size\" must be positive"},
	{"negative layers", "\"num_hidden_layers\": -2", false, TD_EFORMAT, "num_hidden_layers"},
	{"odd head_dim", "\"head_dim\": 7", false, TD_EFORMAT, "head_dim (7) must be even"},
	{"zero head_dim", "\"head_dim\": 0", false, TD_EFORMAT, "head_dim"},
	{"hidden not a multiple", "\"hidden_size\": 60", false, TD_EFORMAT, "no head_dim"},
	{"rope_type yarn", "\"rope_parameters\": {\"rope_theta\": 1e6, \"rope_type\": \"yarn\"}", false,
	 TD_EUNSUPPORTED, "\"rope_parameters.rope_type\" is \"yarn\""},
	{"rope_scaling linear", "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}", false,
	 TD_EUNSUPPORTED, "rope_scaling.type"},
	{"rope_scaling llama3", "\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8.0}", false,
	 TD_EUNSUPPORTED, "llama3"},
	{"rope_parameters a list", "\"rope_parameters\": [1]", false, TD_EFORMAT, "rope_parameters"},
	{"rope_theta a string", "\"rope_theta\": \"1e4\"", false, TD_EFORMAT, "rope_theta"},
	{"rope_theta zero", "\"rope_parameters\": {\"rope_theta\": 0}", false, TD_EFORMAT, "rope_theta"},
	{"eps negative", "\"rms_norm_eps\": -1e-6", false, TD_EFORMAT, "rms_norm_eps"},
	{"tie a string", "\"tie_word_embeddings\": \"yes\"", false, TD_EFORMAT, "tie_word_embeddings"},
	{"attention_bias a number", "\"attention_bias\": 1", false, TD_EFORMAT, "attention_bias"},
	{"eos a string", "\"eos_token_id\": \"2\"", false, TD_EFORMAT, "eos_token_id"},
	{"eos list of strings", "\"eos_token_id\": [\"2\"]", false, TD_EFORMAT, "eos_token_id"},
	{"pad negative", "\"pad_token_id\": -5", false, TD_EFORMAT, "pad_token_id"},
	{"dtype float64", "\"dtype\": \"float64\"", false, TD_EUNSUPPORTED, "float64"},
	{"torch_dtype a number", "\"torch_dtype\": 32", false, TD_EFORMAT, "torch_dtype"},
	{"gelu", "\"hidden_act\": \"gelu\"", false, TD_EUNSUPPORTED, "hidden_act"},
	{"sliding window", "\"use_sliding_window\": true", false, TD_EUNSUPPORTED, "use_sliding_window"},
	{"sliding layer", "\"layer_types\": [\"full_attention\", \"sliding_attention\"]", false,
	 TD_EUNSUPPORTED, "\"layer_types\"[1] is \"sliding_attention\""},
	{"id2label a list", "\"id2label\": [\"a\"]", false, TD_EFORMAT, "id2label"},
};

static void test_bad(void)
{
	for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
		const struct bad_case *b = &bad_cases[i];
		struct tr_model_config c;
		struct td_errbuf eb = {{0}};
		td_err err = b->raw ? tr_config_parse(&c, b->json, "case.json", &eb) : parse(&c, b->json, &eb);
		CHECK_MSG(err == b->code, "%s: got %s (%s), want %s", b->what, td_errname(err), eb.msg,
			  td_errname(b->code));
		CHECK_CONTAINS(eb.msg, "case.json");
		CHECK_CONTAINS(eb.msg, b->word);
	}

	/* From files: the message names the path. */
	struct tr_model_config c;
	struct td_errbuf eb;
	CHECK_EQ_INT(tr_config_load(&c, tmp_path("absent.json"), &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "absent.json");
	write_text(tmp_path("bad.json"), "{\"model_type\": \"mistral\"}");
	CHECK_EQ_INT(tr_config_load(&c, tmp_path("bad.json"), &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "bad.json");
	CHECK_CONTAINS(eb.msg, "mistral");
}

/* ---- writing ---- */

static void test_write(void)
{
	struct td_errbuf eb;
	for (size_t i = 0; i < sizeof(fixtures) / sizeof(fixtures[0]); i++) {
		char src[512];
		fixture_path(src, sizeof(src), fixtures[i].dir, "config.json");
		struct tr_model_config c, back;
		if (tr_config_load(&c, src, &eb) != TD_OK)
			continue;

		/* Generated from the struct. */
		const char *gen = tmp_path("gen.json");
		td_err err = tr_config_write(&c, NULL, TR_DT_BF16, gen, &eb);
		CHECK_MSG(err == TD_OK, "%s", eb.msg);
		err = tr_config_load(&back, gen, &eb);
		CHECK_MSG(err == TD_OK, "%s: %s", fixtures[i].dir, eb.msg);
		if (!err) {
			check_same(&back, &c);
			CHECK_EQ_INT(back.dtype, TR_DT_BF16);
		}
		char *text = slurp(gen);
		CHECK_CONTAINS(text, c.num_labels ? "ForSequenceClassification\"" : "ForCausalLM\"");
		CHECK_CONTAINS(text, "\"rope_type\": \"default\"");
		CHECK_CONTAINS(text, "\"rms_norm_eps\": 1e-0"); /* shortest repr, not 9.99...e-07 */
		CHECK(text && text[strlen(text) - 1] == '\n');
		free(text);

		/* Copied from the source: unknown keys survive, the dtype changes. */
		const char *copy = tmp_path("copy.json");
		err = tr_config_write(&c, src, TR_DT_F16, copy, &eb);
		CHECK_MSG(err == TD_OK, "%s", eb.msg);
		err = tr_config_load(&back, copy, &eb);
		CHECK_MSG(err == TD_OK, "%s", eb.msg);
		if (!err) {
			check_same(&back, &c);
			CHECK_EQ_INT(back.dtype, TR_DT_F16);
		}
		text = slurp(copy);
		CHECK_CONTAINS(text, "\"transformers_version\": \"5.17.0\"");
		CHECK_CONTAINS(text, "\"dtype\": \"float16\"");
		CHECK(text && !strstr(text, "torch_dtype"));
		free(text);
	}

	/* A transformers 4 source: torch_dtype is rewritten too, dtype added. */
	write_text(tmp_path("old.json"), "{" BASE ", \"torch_dtype\": \"float32\"}");
	struct tr_model_config c;
	CHECK(tr_config_load(&c, tmp_path("old.json"), &eb) == TD_OK);
	CHECK(tr_config_write(&c, tmp_path("old.json"), TR_DT_BF16, tmp_path("new.json"), &eb) == TD_OK);
	char *text = slurp(tmp_path("new.json"));
	CHECK_CONTAINS(text, "\"torch_dtype\": \"bfloat16\"");
	CHECK_CONTAINS(text, "\"dtype\": \"bfloat16\"");
	free(text);

	/* Refusals: a save dtype we do not write, a struct no config.json can say,
	 * a source that is not JSON. */
	CHECK_EQ_INT(tr_config_write(&c, NULL, TR_DT_F64, tmp_path("x.json"), &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "F64");
	struct tr_model_config odd = c;
	odd.o_bias = true; /* llama: q/k/v and o biases come together */
	CHECK_EQ_INT(tr_config_write(&odd, NULL, TR_DT_F32, tmp_path("x.json"), &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "attention_bias");
	write_text(tmp_path("junk.json"), "not json");
	CHECK_EQ_INT(tr_config_write(&c, tmp_path("junk.json"), TR_DT_F32, tmp_path("x.json"), &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "junk.json");

	/* Odd numbers print back exactly. */
	c.rope_theta = 123456.789;
	c.rms_norm_eps = 1.0 / 3.0;
	c.eos_token_id = 5;
	CHECK(tr_config_write(&c, NULL, TR_DT_F32, tmp_path("odd.json"), &eb) == TD_OK);
	struct tr_model_config back;
	CHECK(tr_config_load(&back, tmp_path("odd.json"), &eb) == TD_OK);
	check_same(&back, &c);
}

int main(void)
{
	if (!getenv("TD_FIXTURES"))
		return check_skip("TD_FIXTURES is not set");
	if (!mkdtemp(tmpdir)) {
		perror("mkdtemp");
		return 1;
	}
	test_fixtures();
	test_variants();
	test_bad();
	test_write();
	check_rm_tree(tmpdir);
	return check_status();
}
