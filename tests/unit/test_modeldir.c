/* Unit tests for train/modeldir: open the qwen2 fixture dir, save it sharded,
 * unsharded and in BF16/F16 and read it back bit for bit, stale layouts
 * removed, and the errors of broken dirs (missing shard, duplicate names, an
 * index entry not in its shard, neither file). */
#include "train/modeldir.h"

#include <ftw.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tests/check.h"

static char tmpdir[] = "/tmp/td-test-md-XXXXXX";

static const char *tmp_path(const char *name)
{
	static char buf[8][512];
	static int next;
	char *p = buf[next++ % 8];
	snprintf(p, sizeof(buf[0]), "%s/%s", tmpdir, name);
	return p;
}

static bool file_exists(const char *dir, const char *name)
{
	char path[1024];
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	return access(path, F_OK) == 0;
}

/* The fixture's tensors as fp32, in file order. */
struct model {
	size_t n;
	struct tr_save_tensor *t;
	float *data;
	size_t total_f32;
};

static bool load_model(struct model *m, const char *dir)
{
	struct tr_weights *w;
	struct td_errbuf eb;
	td_err err = tr_weights_open(&w, dir, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	if (err)
		return false;
	m->n = tr_weights_count(w);
	m->t = calloc(m->n, sizeof(*m->t));
	m->total_f32 = 0;
	for (size_t i = 0; i < m->n; i++)
		m->total_f32 += (size_t)tr_weights_at(w, i)->numel;
	m->data = malloc(m->total_f32 * sizeof(float));
	float *p = m->data;
	for (size_t i = 0; i < m->n; i++) {
		const struct tr_st_tensor *t = tr_weights_at(w, i);
		m->t[i].name = strdup(t->name);
		m->t[i].ndim = t->ndim;
		memcpy(m->t[i].shape, t->shape, sizeof(t->shape));
		CHECK(tr_st_to_f32(p, t, &eb) == TD_OK);
		m->t[i].data = p;
		p += t->numel;
	}
	tr_weights_close(w);
	return true;
}

static void free_model(struct model *m)
{
	for (size_t i = 0; i < m->n; i++)
		free((char *)m->t[i].name);
	free(m->t);
	free(m->data);
}

/* Reopens dir and compares every tensor with m after rounding through dtype. */
static void check_reopen(const char *dir, const struct model *m, enum tr_dtype dtype)
{
	struct tr_weights *w;
	struct td_errbuf eb;
	td_err err = tr_weights_open(&w, dir, &eb);
	CHECK_MSG(err == TD_OK, "%s: %s", dir, eb.msg);
	if (err)
		return;
	CHECK_EQ_INT(tr_weights_count(w), m->n);
	int mismatched = 0;
	for (size_t i = 0; i < m->n; i++) {
		const struct tr_st_tensor *t = tr_weights_find(w, m->t[i].name);
		CHECK_MSG(t != NULL, "%s missing", m->t[i].name);
		if (!t)
			continue;
		CHECK_EQ_INT(t->dtype, dtype);
		CHECK_EQ_INT(t->ndim, m->t[i].ndim);
		CHECK(memcmp(t->shape, m->t[i].shape, sizeof(int64_t) * (size_t)t->ndim) == 0);
		float *got = malloc((size_t)t->numel * sizeof(float) + 1);
		CHECK(tr_st_to_f32(got, t, &eb) == TD_OK);
		for (int64_t j = 0; j < t->numel; j++) {
			float x = m->t[i].data[j], want = dtype == TR_DT_BF16 ? tr_bf16_to_f32(tr_f32_to_bf16(x))
							 : dtype == TR_DT_F16  ? tr_f16_to_f32(tr_f32_to_f16(x))
									       : x;
			mismatched += memcmp(&got[j], &want, 4) != 0;
		}
		free(got);
	}
	CHECK_EQ_INT(mismatched, 0);
	tr_weights_close(w);
}

static void test_open_fixture(const char *fixture)
{
	struct tr_weights *w;
	struct td_errbuf eb;
	td_err err = tr_weights_open(&w, fixture, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	if (err)
		return;
	CHECK_EQ_INT(tr_weights_count(w), 26);
	const struct tr_st_tensor *t = tr_weights_find(w, "model.embed_tokens.weight");
	CHECK(t && t->dtype == TR_DT_F32 && t->ndim == 2 && t->shape[0] == 512 && t->shape[1] == 64);
	CHECK(tr_weights_at(w, 0) == t);
	CHECK(tr_weights_at(w, 26) == NULL);
	CHECK(tr_weights_find(w, "lm_head.weight") == NULL); /* tied */
	CHECK_CONTAINS(tr_weights_file_of(w, "model.norm.weight"), "qwen2/model.safetensors");
	CHECK(tr_weights_file_of(w, "nope") == NULL);
	tr_weights_close(w);
	tr_weights_close(NULL);
}

static void test_save(const char *fixture, const struct model *m)
{
	struct tr_model_config cfg;
	struct td_errbuf eb;
	char path[1024];
	snprintf(path, sizeof(path), "%s/config.json", fixture);
	CHECK(tr_config_load(&cfg, path, &eb) == TD_OK);

	/* 200000 bytes per shard splits the 502016 of qwen2 in three. */
	const char *out = tmp_path("sharded/deep");
	td_err err = tr_modeldir_save(out, fixture, &cfg, m->t, m->n, TR_DT_F32, 200000, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	CHECK(file_exists(out, "model-00001-of-00003.safetensors"));
	CHECK(file_exists(out, "model-00002-of-00003.safetensors"));
	CHECK(file_exists(out, "model-00003-of-00003.safetensors"));
	CHECK(!file_exists(out, "model-00004-of-00003.safetensors"));
	CHECK(file_exists(out, "model.safetensors.index.json"));
	CHECK(!file_exists(out, "model.safetensors"));
	CHECK(file_exists(out, "config.json"));
	CHECK(file_exists(out, "generation_config.json"));
	CHECK(file_exists(out, "tokenizer.json"));
	CHECK(!file_exists(out, "merges.txt")); /* absent in the source */
	check_reopen(out, m, TR_DT_F32);

	/* The index as save_pretrained writes it; every shard says format pt. */
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", out);
	json_object *idx = json_object_from_file(path), *meta, *total, *map;
	CHECK(idx && json_object_object_get_ex(idx, "metadata", &meta) &&
	      json_object_object_get_ex(meta, "total_size", &total) &&
	      json_object_object_get_ex(idx, "weight_map", &map));
	if (idx) {
		CHECK_EQ_INT(json_object_get_int64(total), m->total_f32 * 4);
		CHECK_EQ_INT(json_object_object_length(map), m->n);
		const char *prev = "";
		json_object_object_foreach(map, k, v) {
			CHECK_MSG(strcmp(prev, k) < 0, "weight_map not sorted at %s", k);
			prev = k;
			CHECK_CONTAINS(json_object_get_string(v), "-of-00003.safetensors");
		}
		json_object_put(idx);
	}
	struct tr_weights *w;
	CHECK(tr_weights_open(&w, out, &eb) == TD_OK);
	CHECK_CONTAINS(tr_weights_file_of(w, "model.embed_tokens.weight"), "model-00001-of-00003.safetensors");
	tr_weights_close(w);
	struct tr_st_file *f;
	snprintf(path, sizeof(path), "%s/model-00002-of-00003.safetensors", out);
	CHECK(tr_st_open(&f, path, &eb) == TD_OK);
	CHECK_STR_EQ(tr_st_metadata(f, "format"), "pt");
	tr_st_close(f);

	/* config.json copied with only the dtype changed. */
	struct tr_model_config back;
	snprintf(path, sizeof(path), "%s/config.json", out);
	CHECK(tr_config_load(&back, path, &eb) == TD_OK);
	CHECK(back.rope_theta == cfg.rope_theta && back.tie_word_embeddings == cfg.tie_word_embeddings);

	/* Over the same dir unsharded: the index and the shards go. */
	err = tr_modeldir_save(out, fixture, &cfg, m->t, m->n, TR_DT_F32, 0, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	CHECK(file_exists(out, "model.safetensors"));
	CHECK(!file_exists(out, "model.safetensors.index.json"));
	CHECK(!file_exists(out, "model-00001-of-00003.safetensors"));
	check_reopen(out, m, TR_DT_F32);

	/* And sharded again, in four: the single file goes. A big limit is no shard. */
	err = tr_modeldir_save(out, NULL, &cfg, m->t, m->n, TR_DT_F32, 150000, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	CHECK(!file_exists(out, "model.safetensors"));
	CHECK(file_exists(out, "model-00004-of-00004.safetensors"));
	check_reopen(out, m, TR_DT_F32);
	err = tr_modeldir_save(out, NULL, &cfg, m->t, m->n, TR_DT_F32, 1 << 20, &eb);
	CHECK(err == TD_OK && file_exists(out, "model.safetensors"));
	CHECK(!file_exists(out, "model-00004-of-00004.safetensors"));

	/* Narrower dtypes: equal to the rounding of tr_f32_to_bf16 / _f16. */
	const char *bf = tmp_path("bf16");
	err = tr_modeldir_save(bf, fixture, &cfg, m->t, m->n, TR_DT_BF16, 0, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	check_reopen(bf, m, TR_DT_BF16);
	snprintf(path, sizeof(path), "%s/config.json", bf);
	CHECK(tr_config_load(&back, path, &eb) == TD_OK);
	CHECK_EQ_INT(back.dtype, TR_DT_BF16);
	const char *h = tmp_path("f16-sharded");
	err = tr_modeldir_save(h, fixture, &cfg, m->t, m->n, TR_DT_F16, 100000, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	check_reopen(h, m, TR_DT_F16);

	/* No source dir: the config is generated and loads the same. */
	const char *gen = tmp_path("generated");
	CHECK(tr_modeldir_save(gen, NULL, &cfg, m->t, m->n, TR_DT_F32, 0, &eb) == TD_OK);
	snprintf(path, sizeof(path), "%s/config.json", gen);
	CHECK(tr_config_load(&back, path, &eb) == TD_OK);
	CHECK(back.num_kv_heads == cfg.num_kv_heads && back.qkv_bias && back.tie_word_embeddings);
	CHECK(!file_exists(gen, "tokenizer.json"));

	/* Refusals. */
	CHECK_EQ_INT(tr_modeldir_save(tmp_path("x"), NULL, &cfg, m->t, m->n, TR_DT_I32, 0, &eb), TD_EINVAL);
	CHECK_EQ_INT(tr_modeldir_save(tmp_path("x"), NULL, NULL, m->t, m->n, TR_DT_F32, 0, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "config");
	struct tr_save_tensor dup[2] = {m->t[1], m->t[1]};
	CHECK_EQ_INT(tr_modeldir_save(tmp_path("x"), NULL, &cfg, dup, 2, TR_DT_F32, 0, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "twice");
	snprintf(path, sizeof(path), "%s/config.json", fixture);
	CHECK_EQ_INT(tr_modeldir_save(path, NULL, &cfg, m->t, m->n, TR_DT_F32, 0, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "not a directory");
}

static void write_index(const char *dir, const char *json)
{
	char path[1024];
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
	FILE *f = fopen(path, "w");
	if (f) {
		fputs(json, f);
		fclose(f);
	}
}

static void expect_open_fail(const char *dir, td_err code, const char *w1, const char *w2)
{
	struct tr_weights *w = NULL;
	struct td_errbuf eb = {{0}};
	td_err err = tr_weights_open(&w, dir, &eb);
	CHECK_MSG(err == code, "%s: got %s (%s), want %s", dir, td_errname(err), eb.msg, td_errname(code));
	CHECK(w == NULL);
	CHECK_CONTAINS(eb.msg, w1);
	CHECK_CONTAINS(eb.msg, w2);
	if (!err)
		tr_weights_close(w);
}

static void test_broken(const char *fixture, const struct model *m)
{
	struct tr_model_config cfg;
	struct td_errbuf eb;
	char path[1024];
	snprintf(path, sizeof(path), "%s/config.json", fixture);
	CHECK(tr_config_load(&cfg, path, &eb) == TD_OK);

	/* Neither file. */
	const char *empty = tmp_path("empty");
	mkdir(empty, 0755);
	expect_open_fail(empty, TD_ENOENT, "model.safetensors.index.json", "empty");
	expect_open_fail(tmp_path("no-such-dir"), TD_ENOENT, "model.safetensors", "no-such-dir");

	/* A shard gone. */
	const char *miss = tmp_path("missing");
	CHECK(tr_modeldir_save(miss, NULL, &cfg, m->t, m->n, TR_DT_F32, 200000, &eb) == TD_OK);
	snprintf(path, sizeof(path), "%s/model-00002-of-00003.safetensors", miss);
	unlink(path);
	expect_open_fail(miss, TD_EFORMAT, "model-00002-of-00003.safetensors is missing",
			 "model.safetensors.index.json");

	/* Two shards that both hold "a"; an index entry not in its shard; a shard
	 * outside the dir; an index that is not JSON; a shard that is not safetensors. */
	const char *dupdir = tmp_path("dup");
	mkdir(dupdir, 0755);
	const float v[2] = {1, 2};
	const struct tr_st_entry s1[] = {{"a", TR_DT_F32, 1, {2}, v}};
	const struct tr_st_entry s2[] = {{"a", TR_DT_F32, 1, {2}, v}, {"b", TR_DT_F32, 1, {2}, v}};
	snprintf(path, sizeof(path), "%s/one.safetensors", dupdir);
	CHECK(tr_st_write(path, s1, 1, NULL, &eb) == TD_OK);
	snprintf(path, sizeof(path), "%s/two.safetensors", dupdir);
	CHECK(tr_st_write(path, s2, 2, NULL, &eb) == TD_OK);
	write_index(dupdir, "{\"weight_map\": {\"a\": \"one.safetensors\", \"b\": \"two.safetensors\"}}");
	expect_open_fail(dupdir, TD_EFORMAT, "tensor 'a' is in both", "two.safetensors");
	write_index(dupdir, "{\"weight_map\": {\"b\": \"one.safetensors\"}}");
	expect_open_fail(dupdir, TD_EFORMAT, "tensor 'b' is listed in", "one.safetensors");
	write_index(dupdir, "{\"weight_map\": {\"b\": \"../dup/two.safetensors\"}}");
	expect_open_fail(dupdir, TD_EFORMAT, "not a file name", "model.safetensors.index.json");
	write_index(dupdir, "{\"weight_map\": ");
	expect_open_fail(dupdir, TD_EFORMAT, "not valid JSON", "model.safetensors.index.json");
	write_index(dupdir, "{\"metadata\": {}}");
	expect_open_fail(dupdir, TD_EFORMAT, "weight_map", "model.safetensors.index.json");
	snprintf(path, sizeof(path), "%s/junk.safetensors", dupdir);
	FILE *f = fopen(path, "w");
	if (f) {
		fputs("junk", f);
		fclose(f);
	}
	write_index(dupdir, "{\"weight_map\": {\"b\": \"junk.safetensors\"}}");
	expect_open_fail(dupdir, TD_EFORMAT, "junk.safetensors", "short");

	/* A good index over the same shards: two files, one table. */
	write_index(dupdir, "{\"weight_map\": {\"b\": \"two.safetensors\"}}");
	struct tr_weights *w;
	CHECK(tr_weights_open(&w, dupdir, &eb) == TD_OK);
	CHECK_EQ_INT(tr_weights_count(w), 2);
	CHECK_CONTAINS(tr_weights_file_of(w, "a"), "two.safetensors");
	tr_weights_close(w);
}

int main(void)
{
	const char *fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set");
	if (!mkdtemp(tmpdir)) {
		perror("mkdtemp");
		return 1;
	}
	char fixture[512];
	snprintf(fixture, sizeof(fixture), "%s/qwen2", fx);
	test_open_fixture(fixture);
	struct model m;
	if (load_model(&m, fixture)) {
		test_save(fixture, &m);
		test_broken(fixture, &m);
		free_model(&m);
	}
	check_rm_tree(tmpdir);
	return check_status();
}
