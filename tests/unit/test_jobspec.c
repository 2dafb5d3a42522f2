/* Unit test of proto/jobspec: loading (text through protoc, and binary),
 * defaults, validation, encode/decode, printing.
 *
 * Text-format cases are written to a mkdtemp() directory and loaded through
 * protoc; where protoc is not installed they are skipped with a reason and the
 * binary cases still run. Everything else builds specs in C. */
#include "proto/jobspec.h"

#include "config.h"
#include "tests/check.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[64];

/* Writes tmpdir/name; returns its path (static storage, one at a time). */
static const char *write_tmp(const char *name, const void *data, size_t len)
{
	static char path[256];
	snprintf(path, sizeof(path), "%s/%s", tmpdir, name);
	FILE *f = fopen(path, "wb");
	if (!f) {
		fprintf(stderr, "cannot write %s: %s\n", path, strerror(errno));
		exit(1);
	}
	if (len)
		fwrite(data, 1, len, f);
	fclose(f);
	return path;
}

/* ------------------------------------------------------------------------ */
/* Building specs in C */

static Traind__DataSpec *da(Traind__JobSpec *s)
{
	if (!s->data) {
		s->data = malloc(sizeof(*s->data));
		traind__data_spec__init(s->data);
	}
	return s->data;
}
static Traind__Hyper *hy(Traind__JobSpec *s)
{
	if (!s->hyper) {
		s->hyper = malloc(sizeof(*s->hyper));
		traind__hyper__init(s->hyper);
	}
	return s->hyper;
}
static Traind__LoraSpec *lo(Traind__JobSpec *s)
{
	if (!s->lora) {
		s->lora = malloc(sizeof(*s->lora));
		traind__lora_spec__init(s->lora);
	}
	return s->lora;
}
static Traind__DistillSpec *di(Traind__JobSpec *s)
{
	if (!s->distill) {
		s->distill = malloc(sizeof(*s->distill));
		traind__distill_spec__init(s->distill);
	}
	return s->distill;
}
static Traind__ClassifySpec *cl(Traind__JobSpec *s)
{
	if (!s->classify) {
		s->classify = malloc(sizeof(*s->classify));
		traind__classify_spec__init(s->classify);
	}
	return s->classify;
}
static Traind__OutputSpec *ou(Traind__JobSpec *s)
{
	if (!s->output) {
		s->output = malloc(sizeof(*s->output));
		traind__output_spec__init(s->output);
	}
	return s->output;
}
static Traind__Resources *re(Traind__JobSpec *s)
{
	if (!s->resources) {
		s->resources = malloc(sizeof(*s->resources));
		traind__resources__init(s->resources);
	}
	return s->resources;
}

static Traind__MemorySpec *me(Traind__JobSpec *s)
{
	if (!s->memory) {
		s->memory = malloc(sizeof(*s->memory));
		traind__memory_spec__init(s->memory);
	}
	return s->memory;
}

/* String fields may point at a descriptor's static default: never free those. */
static bool static_default(const char *p)
{
	return p == traind__data_spec__text_field__default_value ||
	       p == traind__data_spec__prompt_field__default_value ||
	       p == traind__data_spec__completion_field__default_value ||
	       p == traind__classify_spec__label_field__default_value;
}

static void set_str(char **field, const char *v)
{
	if (*field && !static_default(*field))
		free(*field);
	*field = v ? strdup(v) : NULL;
}

/* Replaces a repeated string field with the NULL-terminated list v. */
static void set_list(size_t *n, char ***arr, const char *const *v)
{
	for (size_t i = 0; i < *n; i++)
		free((*arr)[i]);
	free(*arr);
	size_t k = 0;
	while (v[k])
		k++;
	*arr = k ? calloc(k, sizeof(char *)) : NULL;
	for (size_t i = 0; i < k; i++)
		(*arr)[i] = strdup(v[i]);
	*n = k;
}

#define SET(msg, f, v)              \
	do {                        \
		(msg)->f = (v);     \
		(msg)->has_##f = 1; \
	} while (0)

/* The smallest valid spec: model_dir, data.train_file and output.dir. */
static Traind__JobSpec *minimal(void)
{
	Traind__JobSpec *s = rpc_jobspec_new();
	set_str(&s->model_dir, "/models/qwen2-0.5b/");
	set_str(&da(s)->train_file, "/data/train.jsonl");
	set_str(&ou(s)->dir, "/runs/out");
	return s;
}

/* The same, as protobuf-c unpacks it (strings at their static defaults). */
static Traind__JobSpec *reencode(Traind__JobSpec *s)
{
	uint8_t *b;
	size_t n;
	CHECK_EQ_INT(rpc_jobspec_encode(s, &b, &n), TD_OK);
	Traind__JobSpec *d = NULL;
	struct td_errbuf eb = { "" };
	CHECK_EQ_INT(rpc_jobspec_decode(&d, b, n, &eb), TD_OK);
	free(b);
	rpc_jobspec_free(s);
	return d;
}

static bool same_bytes(const Traind__JobSpec *a, const Traind__JobSpec *b)
{
	uint8_t *x, *y;
	size_t nx, ny;
	if (rpc_jobspec_encode(a, &x, &nx) || rpc_jobspec_encode(b, &y, &ny))
		return false;
	bool same = nx == ny && memcmp(x, y, nx) == 0;
	free(x);
	free(y);
	return same;
}

/* ------------------------------------------------------------------------ */
/* Defaults */

static void test_defaults_minimal(void)
{
	Traind__JobSpec *s = reencode(minimal());
	struct td_errbuf eb = { "" };
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);

	CHECK_STR_EQ(s->name, "qwen2-0.5b");
	CHECK(s->has_method);
	CHECK_EQ_INT(s->method, TRAIND__METHOD__METHOD_FULL);
	CHECK_STR_EQ(s->model_dir, "/models/qwen2-0.5b/");

	const Traind__DataSpec *d = s->data;
	CHECK_STR_EQ(d->train_file, "/data/train.jsonl");
	CHECK(d->eval_file == NULL);
	CHECK(d->has_format);
	CHECK_EQ_INT(d->format, TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL);
	CHECK_STR_EQ(d->text_field, "text");
	CHECK_STR_EQ(d->prompt_field, "prompt");
	CHECK_STR_EQ(d->completion_field, "completion");
	CHECK(d->text_field != traind__data_spec__text_field__default_value); /* own copy, encoded */
	CHECK(d->has_packing);
	CHECK_EQ_INT(d->packing, 1);
	CHECK(d->has_seq_len);
	CHECK_EQ_INT(d->seq_len, 512);
	CHECK(!d->has_eos_id); /* from the model's config, later */

	const Traind__Hyper *h = s->hyper;
	CHECK(h->has_lr);
	CHECK_NEAR(h->lr, 1e-4, 0);
	CHECK(h->has_schedule);
	CHECK_EQ_INT(h->schedule, TRAIND__SCHEDULE__SCHEDULE_COSINE);
	CHECK(h->has_warmup_steps);
	CHECK_EQ_INT(h->warmup_steps, 0);
	CHECK(h->has_min_lr);
	CHECK_NEAR(h->min_lr, 0, 0);
	CHECK(!h->has_max_steps);
	CHECK(h->has_epochs);
	CHECK_NEAR(h->epochs, 1.0, 0);
	CHECK(h->has_micro_batch);
	CHECK_EQ_INT(h->micro_batch, 1);
	CHECK(h->has_grad_accum);
	CHECK_EQ_INT(h->grad_accum, 1);
	CHECK(h->has_weight_decay);
	CHECK_NEAR(h->weight_decay, 0, 0);
	CHECK(h->has_beta1);
	CHECK_NEAR(h->beta1, 0.9, 0);
	CHECK(h->has_beta2);
	CHECK_NEAR(h->beta2, 0.999, 0);
	CHECK(h->has_eps);
	CHECK_NEAR(h->eps, 1e-8, 0);
	CHECK(h->has_clip_norm);
	CHECK_NEAR(h->clip_norm, 1.0, 0);
	CHECK(h->has_seed);
	CHECK_EQ_INT(h->seed, 42);
	CHECK(!h->has_precision); /* device ANY: decided at placement */

	const Traind__LoraSpec *l = s->lora;
	CHECK(l != NULL);
	CHECK(l->has_rank);
	CHECK_EQ_INT(l->rank, 8);
	CHECK(l->has_alpha);
	CHECK_NEAR(l->alpha, 16.0, 0);
	CHECK(l->has_dropout);
	CHECK_NEAR(l->dropout, 0, 0);
	CHECK_EQ_INT(l->n_target_modules, 2);
	if (l->n_target_modules == 2) {
		CHECK_STR_EQ(l->target_modules[0], "q_proj");
		CHECK_STR_EQ(l->target_modules[1], "v_proj");
	}
	CHECK(l->init_adapter == NULL);

	const Traind__DistillSpec *ds = s->distill;
	CHECK(ds != NULL);
	CHECK(ds->teacher_dir == NULL);
	CHECK(ds->has_temperature);
	CHECK_NEAR(ds->temperature, 2.0, 0);
	CHECK(ds->has_alpha);
	CHECK_NEAR(ds->alpha, 0.5, 0);

	const Traind__ClassifySpec *c = s->classify;
	CHECK(c != NULL);
	CHECK(!c->has_num_labels);
	CHECK_STR_EQ(c->label_field, "label");
	CHECK_EQ_INT(c->n_label_names, 0);

	const Traind__OutputSpec *o = s->output;
	CHECK_STR_EQ(o->dir, "/runs/out");
	CHECK(o->has_checkpoint_every);
	CHECK_EQ_INT(o->checkpoint_every, 0);
	CHECK(o->has_keep_last);
	CHECK_EQ_INT(o->keep_last, 2);
	CHECK(o->has_shard_bytes);
	CHECK_EQ_INT(o->shard_bytes, 5368709120LL);

	const Traind__Resources *r = s->resources;
	CHECK(r != NULL);
	CHECK(r->has_device);
	CHECK_EQ_INT(r->device, TRAIND__DEVICE__DEVICE_ANY);
	CHECK(r->has_allow_cpu);
	CHECK_EQ_INT(r->allow_cpu, 1);
	CHECK(r->has_priority);
	CHECK_EQ_INT(r->priority, 0);
	CHECK(r->has_gpus);
	CHECK_EQ_INT(r->gpus, 1);

	CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_OK);

	/* Idempotent, and the defaults survive the wire. */
	Traind__JobSpec *c2;
	CHECK_EQ_INT(rpc_jobspec_copy(&c2, s), TD_OK);
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(c2, &eb), TD_OK);
	CHECK(same_bytes(s, c2));
	CHECK_EQ_INT(c2->hyper->seed, 42);
	CHECK(c2->hyper->has_seed);
	rpc_jobspec_free(c2);
	rpc_jobspec_free(s);
}

/* Defaults that depend on other fields, one table row each. */
struct derived_case {
	const char *model_dir;
	const char *train_file;
	Traind__Device device; /* 0: leave absent */
	uint32_t rank;         /* 0: leave absent */
	uint64_t max_steps;    /* 0: leave absent */
	const char *name;      /* expected; NULL: stays absent */
	Traind__DataFormat format;
	int precision; /* -1: stays absent */
	double alpha;
	bool epochs; /* expected has_epochs */
};

static const struct derived_case derived_cases[] = {
	{ "/m/llama-3-8b", "/d/a.jsonl", 0, 0, 0, "llama-3-8b", TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL, -1, 16, true },
	{ "/m/x//", "/d/A.JSONL", TRAIND__DEVICE__DEVICE_CPU, 4, 0, "x", TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL,
	  TRAIND__PRECISION__PRECISION_FP32, 8, true },
	{ "rel", "/d/tokens.bin", TRAIND__DEVICE__DEVICE_GPU, 1, 100, "rel", TRAIND__DATA_FORMAT__DATA_FORMAT_TOKENS,
	  TRAIND__PRECISION__PRECISION_BF16, 2, false },
	{ "/", "/d/a.jsonl.bak", TRAIND__DEVICE__DEVICE_ANY, 0, 5, NULL, TRAIND__DATA_FORMAT__DATA_FORMAT_TOKENS, -1,
	  16, false },
	{ "/m/q", NULL, 0, 0, 0, "q", TRAIND__DATA_FORMAT__DATA_FORMAT_TOKENS, -1, 16, true },
};

static void test_defaults_derived(void)
{
	for (size_t i = 0; i < sizeof(derived_cases) / sizeof(derived_cases[0]); i++) {
		const struct derived_case *t = &derived_cases[i];
		Traind__JobSpec *s = rpc_jobspec_new();
		set_str(&s->model_dir, t->model_dir);
		if (t->train_file)
			set_str(&da(s)->train_file, t->train_file);
		if (t->device)
			SET(re(s), device, t->device);
		if (t->rank)
			SET(lo(s), rank, t->rank);
		if (t->max_steps)
			SET(hy(s), max_steps, t->max_steps);
		struct td_errbuf eb = { "" };
		CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
		if (t->name)
			CHECK_STR_EQ(s->name, t->name);
		else
			CHECK(s->name == NULL);
		CHECK_EQ_INT(s->data->format, t->format);
		CHECK_EQ_INT(s->hyper->has_precision, t->precision >= 0);
		if (t->precision >= 0)
			CHECK_EQ_INT(s->hyper->precision, t->precision);
		CHECK_NEAR(s->lora->alpha, t->alpha, 0);
		CHECK_EQ_INT(s->hyper->has_epochs, t->epochs);
		CHECK_EQ_INT(s->hyper->has_max_steps, t->max_steps != 0);
		rpc_jobspec_free(s);
	}

	/* Given values are kept; UNSPECIFIED enums count as absent. */
	Traind__JobSpec *s = minimal();
	set_str(&s->name, "mine");
	SET(s, method, TRAIND__METHOD__METHOD_UNSPECIFIED);
	SET(hy(s), schedule, TRAIND__SCHEDULE__SCHEDULE_LINEAR);
	SET(hy(s), lr, 3e-5);
	SET(hy(s), precision, TRAIND__PRECISION__PRECISION_UNSPECIFIED);
	SET(lo(s), alpha, 5.0);
	static const char *const mods[] = { "o_proj", NULL };
	set_list(&lo(s)->n_target_modules, &lo(s)->target_modules, mods);
	SET(da(s), format, TRAIND__DATA_FORMAT__DATA_FORMAT_TOKENS);
	set_str(&da(s)->text_field, "body");
	struct td_errbuf eb = { "" };
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	CHECK_STR_EQ(s->name, "mine");
	CHECK_EQ_INT(s->method, TRAIND__METHOD__METHOD_FULL);
	CHECK_EQ_INT(s->hyper->schedule, TRAIND__SCHEDULE__SCHEDULE_LINEAR);
	CHECK_NEAR(s->hyper->lr, 3e-5, 0);
	CHECK(!s->hyper->has_precision);
	CHECK_NEAR(s->lora->alpha, 5.0, 0);
	CHECK_EQ_INT(s->lora->n_target_modules, 1);
	CHECK_STR_EQ(s->lora->target_modules[0], "o_proj");
	CHECK_EQ_INT(s->data->format, TRAIND__DATA_FORMAT__DATA_FORMAT_TOKENS);
	CHECK_STR_EQ(s->data->text_field, "body");
	rpc_jobspec_free(s);
}

static void test_resolve_precision(void)
{
	static const struct {
		int given; /* -1: absent */
		bool on_gpu;
		td_err rc;
		int want;
	} cases[] = {
		{ -1, true, TD_OK, TRAIND__PRECISION__PRECISION_BF16 },
		{ -1, false, TD_OK, TRAIND__PRECISION__PRECISION_FP32 },
		{ TRAIND__PRECISION__PRECISION_UNSPECIFIED, false, TD_OK, TRAIND__PRECISION__PRECISION_FP32 },
		{ TRAIND__PRECISION__PRECISION_FP32, true, TD_OK, TRAIND__PRECISION__PRECISION_FP32 },
		{ TRAIND__PRECISION__PRECISION_BF16, true, TD_OK, TRAIND__PRECISION__PRECISION_BF16 },
		{ TRAIND__PRECISION__PRECISION_BF16, false, TD_EUNSUPPORTED, TRAIND__PRECISION__PRECISION_BF16 },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		Traind__JobSpec *s = rpc_jobspec_new();
		if (cases[i].given >= 0)
			SET(hy(s), precision, (Traind__Precision)cases[i].given);
		struct td_errbuf eb = { "" };
		td_err rc = rpc_jobspec_resolve_precision(s, cases[i].on_gpu, &eb);
		CHECK_EQ_INT(rc, cases[i].rc);
		CHECK(s->hyper != NULL && s->hyper->has_precision);
		if (s->hyper)
			CHECK_EQ_INT(s->hyper->precision, cases[i].want);
		if (rc)
			CHECK_CONTAINS(eb.msg, "hyper.precision");
		rpc_jobspec_free(s);
	}
}

/* ------------------------------------------------------------------------ */
/* Validation: invalid specs, each a change to minimal(); the message must
 * begin with the field's path. */

#define M(fn, ...)                                      \
	static void fn(Traind__JobSpec *s)              \
	{                                               \
		__VA_ARGS__;                            \
	}

M(m_lr_neg, SET(hy(s), lr, -0.001))
M(m_lr_zero, SET(hy(s), lr, 0))
M(m_lr_nan, SET(hy(s), lr, NAN))
M(m_lr_inf, SET(hy(s), lr, INFINITY))
M(m_min_lr_gt, SET(hy(s), lr, 1e-4); SET(hy(s), min_lr, 1e-3))
M(m_min_lr_neg, SET(hy(s), min_lr, -1e-6))
M(m_min_lr_gt_default, SET(hy(s), min_lr, 0.5))
M(m_beta1_one, SET(hy(s), beta1, 1.0))
M(m_beta2_neg, SET(hy(s), beta2, -0.1))
M(m_beta2_nan, SET(hy(s), beta2, NAN))
M(m_eps_zero, SET(hy(s), eps, 0))
M(m_wd_neg, SET(hy(s), weight_decay, -0.01))
M(m_clip_neg, SET(hy(s), clip_norm, -1))
M(m_clip_nan, SET(hy(s), clip_norm, NAN))
M(m_micro0, SET(hy(s), micro_batch, 0))
M(m_accum0, SET(hy(s), grad_accum, 0))
M(m_both, SET(hy(s), max_steps, 10); SET(hy(s), epochs, 2))
M(m_steps0, SET(hy(s), max_steps, 0))
M(m_epochs0, SET(hy(s), epochs, 0))
M(m_epochs_nan, SET(hy(s), epochs, NAN))
M(m_warmup, SET(hy(s), max_steps, 50); SET(hy(s), warmup_steps, 100))
M(m_schedule, SET(hy(s), schedule, (Traind__Schedule)7))
M(m_precision, SET(hy(s), precision, (Traind__Precision)5))
M(m_seq1, SET(da(s), seq_len, 1))
M(m_seq_big, SET(da(s), seq_len, 1048577))
M(m_no_data, traind__data_spec__free_unpacked(s->data, NULL); s->data = NULL)
M(m_no_train, set_str(&da(s)->train_file, NULL))
M(m_train_empty, set_str(&da(s)->train_file, ""))
M(m_eval_empty, set_str(&da(s)->eval_file, ""))
M(m_text_field_empty, set_str(&da(s)->text_field, ""))
M(m_format, SET(da(s), format, (Traind__DataFormat)9))
M(m_no_model, set_str(&s->model_dir, NULL))
M(m_model_empty, set_str(&s->model_dir, ""))
M(m_name_empty, set_str(&s->name, ""))
M(m_name_ctrl, set_str(&s->name, "a\nb"))
M(m_name_root, set_str(&s->model_dir, "/"))
M(m_method, SET(s, method, (Traind__Method)42))
M(m_no_output, traind__output_spec__free_unpacked(s->output, NULL); s->output = NULL)
M(m_out_empty, set_str(&ou(s)->dir, ""))
M(m_keep0, SET(ou(s), keep_last, 0))
M(m_shard0, SET(ou(s), shard_bytes, 0))
M(m_prio_hi, SET(re(s), priority, 101))
M(m_prio_lo, SET(re(s), priority, -101))
M(m_device, SET(re(s), device, (Traind__Device)9))
M(m_cpu_noallow, SET(re(s), device, TRAIND__DEVICE__DEVICE_CPU); SET(re(s), allow_cpu, 0))
M(m_gpus0, SET(re(s), gpus, 0))
M(m_gpus17, SET(re(s), gpus, 17))
M(m_gpus_cpu, SET(re(s), device, TRAIND__DEVICE__DEVICE_CPU); SET(re(s), gpus, 2))
M(m_gpus_accum, SET(re(s), gpus, 2); SET(hy(s), grad_accum, 1))
#define HOSTS(...)                                                                  \
	static const char *const hv[] = { __VA_ARGS__, NULL };                      \
	set_list(&re(s)->n_hosts, &re(s)->hosts, hv)
M(m_host_empty, HOSTS(""))
M(m_host_scheme, HOSTS("127.0.0.1:7001"))
M(m_host_noport, HOSTS("tcp://127.0.0.1"))
M(m_host_port0, HOSTS("tcp://127.0.0.1:0"))
M(m_host_port_big, HOSTS("tcp://host:65536"))
M(m_host_space, HOSTS("tcp://a b:7001"))
M(m_host_dup, HOSTS("tcp://h1:7001", "tcp://h2:7001", "tcp://h1:7001"))
M(m_host_world, SET(re(s), gpus, 8); SET(hy(s), grad_accum, 32); HOSTS("tcp://h1:7001", "tcp://h2:7001"))
M(m_host_cpu, SET(re(s), device, TRAIND__DEVICE__DEVICE_CPU); SET(hy(s), grad_accum, 2);
  HOSTS("tcp://h1:7001"))
M(m_host_accum, SET(re(s), gpus, 2); SET(hy(s), grad_accum, 2); HOSTS("tcp://h1:7001"))
M(m_host_shard, SET(hy(s), grad_accum, 2); SET(me(s), shard, TRAIND__SHARD__SHARD_OPTIMIZER);
  HOSTS("tcp://h1:7001"))
M(m_sel_none, SET(me(s), recompute, TRAIND__RECOMPUTE__RECOMPUTE_NONE);
  SET(me(s), selective_layers, 2))
M(m_sel_selective, SET(me(s), recompute, TRAIND__RECOMPUTE__RECOMPUTE_SELECTIVE);
  SET(me(s), selective_layers, 1))
M(m_cpu_bf16, SET(re(s), device, TRAIND__DEVICE__DEVICE_CPU);
  SET(hy(s), precision, TRAIND__PRECISION__PRECISION_BF16))
M(m_rank0, SET(s, method, TRAIND__METHOD__METHOD_LORA); SET(lo(s), rank, 0))
M(m_lora_alpha_nan, SET(s, method, TRAIND__METHOD__METHOD_LORA); SET(lo(s), alpha, NAN))
M(m_lora_alpha_neg, SET(lo(s), alpha, -1))
M(m_dropout1, SET(s, method, TRAIND__METHOD__METHOD_QLORA); SET(lo(s), dropout, 1.0))
M(m_dropout_neg, SET(lo(s), dropout, -0.1))
M(m_qkv, static const char *const v[] = { "q_proj", "v_proj", "qkv", NULL };
  set_list(&lo(s)->n_target_modules, &lo(s)->target_modules, v))
M(m_mod_dup, static const char *const v[] = { "up_proj", "up_proj", NULL };
  set_list(&lo(s)->n_target_modules, &lo(s)->target_modules, v))
M(m_mod_short, static const char *const v[] = { "q", NULL };
  set_list(&lo(s)->n_target_modules, &lo(s)->target_modules, v))
M(m_adapter_empty, set_str(&lo(s)->init_adapter, ""))
M(m_no_teacher, SET(s, method, TRAIND__METHOD__METHOD_DISTILL))
M(m_teacher_empty, SET(s, method, TRAIND__METHOD__METHOD_DISTILL); set_str(&di(s)->teacher_dir, ""))
M(m_temp0, SET(di(s), temperature, 0))
M(m_temp_nan, SET(di(s), temperature, NAN))
M(m_dalpha, SET(di(s), alpha, 1.5))
M(m_dalpha_nan, SET(di(s), alpha, NAN))
M(m_no_labels, SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY))
M(m_labels1, SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY); SET(cl(s), num_labels, 1))
M(m_labels1_full, SET(cl(s), num_labels, 1))
M(m_names_count, static const char *const v[] = { "a", "b", "c", NULL }; SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY);
  SET(cl(s), num_labels, 2); set_list(&cl(s)->n_label_names, &cl(s)->label_names, v))
M(m_names_nonum, static const char *const v[] = { "a", "b", NULL };
  set_list(&cl(s)->n_label_names, &cl(s)->label_names, v))
M(m_names_empty, static const char *const v[] = { "a", "", NULL }; SET(cl(s), num_labels, 2);
  set_list(&cl(s)->n_label_names, &cl(s)->label_names, v))
M(m_names_dup, static const char *const v[] = { "x", "y", "z", "y", "x", NULL }; SET(cl(s), num_labels, 5);
  set_list(&cl(s)->n_label_names, &cl(s)->label_names, v))
M(m_label_field_empty, set_str(&cl(s)->label_field, ""))
M(m_classify_tokens, SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY); SET(cl(s), num_labels, 2);
  set_str(&da(s)->train_file, "/d/train.tok"))

struct bad_case {
	void (*mut)(Traind__JobSpec *);
	const char *expect; /* the start of the message */
};

static const struct bad_case bad_cases[] = {
	{ m_lr_neg, "hyper.lr: must be > 0 (got -0.001)" },
	{ m_lr_zero, "hyper.lr: must be > 0 (got 0)" },
	{ m_lr_nan, "hyper.lr: must be a finite number (got nan)" },
	{ m_lr_inf, "hyper.lr: must be a finite number" },
	{ m_min_lr_gt, "hyper.min_lr: must be <= hyper.lr" },
	{ m_min_lr_neg, "hyper.min_lr: must be >= 0" },
	{ m_min_lr_gt_default, "hyper.min_lr: must be <= hyper.lr (got 0.5 > 0.0001)" },
	{ m_beta1_one, "hyper.beta1: must be in [0, 1) (got 1)" },
	{ m_beta2_neg, "hyper.beta2: must be in [0, 1)" },
	{ m_beta2_nan, "hyper.beta2:" },
	{ m_eps_zero, "hyper.eps: must be > 0" },
	{ m_wd_neg, "hyper.weight_decay: must be >= 0" },
	{ m_clip_neg, "hyper.clip_norm: must be >= 0" },
	{ m_clip_nan, "hyper.clip_norm:" },
	{ m_micro0, "hyper.micro_batch: must be >= 1 (got 0)" },
	{ m_accum0, "hyper.grad_accum: must be >= 1" },
	{ m_both, "hyper: set max_steps or epochs, not both" },
	{ m_steps0, "hyper.max_steps: must be >= 1" },
	{ m_epochs0, "hyper.epochs: must be > 0" },
	{ m_epochs_nan, "hyper.epochs:" },
	{ m_warmup, "hyper.warmup_steps: must be <= hyper.max_steps (got 100 > 50)" },
	{ m_schedule, "hyper.schedule: unknown value 7" },
	{ m_precision, "hyper.precision: unknown value 5" },
	{ m_seq1, "data.seq_len: must be in 2 .. 1048576 (got 1)" },
	{ m_seq_big, "data.seq_len: must be in 2 .. 1048576" },
	{ m_no_data, "data.train_file: required" },
	{ m_no_train, "data.train_file: required" },
	{ m_train_empty, "data.train_file: must not be empty" },
	{ m_eval_empty, "data.eval_file: must not be empty" },
	{ m_text_field_empty, "data.text_field: must not be empty" },
	{ m_format, "data.format: unknown value 9" },
	{ m_no_model, "model_dir: required" },
	{ m_model_empty, "model_dir: must not be empty" },
	{ m_name_empty, "name: must not be empty" },
	{ m_name_ctrl, "name: control character" },
	{ m_name_root, "name: required (model_dir '/' has no base name)" },
	{ m_method, "method: unknown value 42" },
	{ m_no_output, "output.dir: required" },
	{ m_out_empty, "output.dir: must not be empty" },
	{ m_keep0, "output.keep_last: must be >= 1" },
	{ m_shard0, "output.shard_bytes:" },
	{ m_prio_hi, "resources.priority: must be in -100 .. 100 (got 101)" },
	{ m_prio_lo, "resources.priority: must be in -100 .. 100 (got -101)" },
	{ m_device, "resources.device: unknown value 9" },
	{ m_cpu_noallow, "resources.allow_cpu:" },
	{ m_gpus0, "resources.gpus: must be in 1 .. 16 (got 0)" },
	{ m_gpus17, "resources.gpus: must be in 1 .. 16 (got 17)" },
	{ m_gpus_cpu, "resources.gpus: 2 GPUs, but resources.device is CPU" },
	{ m_gpus_accum, "resources.gpus: 2 GPUs share each step's hyper.grad_accum micro-batches, at "
			"least one each, and grad_accum is 1; set it to 2" },
	{ m_cpu_bf16, "hyper.precision: BF16 needs a GPU" },
	{ m_host_empty, "resources.hosts[0]: must not be empty" },
	{ m_host_scheme, "resources.hosts[0]: '127.0.0.1:7001' is not a peer address tcp://HOST:PORT" },
	{ m_host_noport, "resources.hosts[0]: 'tcp://127.0.0.1' is not a peer address" },
	{ m_host_port0, "resources.hosts[0]: 'tcp://127.0.0.1:0' is not a peer address" },
	{ m_host_port_big, "resources.hosts[0]: 'tcp://host:65536' is not a peer address" },
	{ m_host_space, "resources.hosts[0]: 'tcp://a b:7001' is not a peer address" },
	{ m_host_dup, "resources.hosts[2]: 'tcp://h1:7001' is named twice (also resources.hosts[0])" },
	{ m_host_world, "resources.hosts: 2 hosts beside this daemon, 8 GPUs each: 24 ranks, and a job "
			"runs at most 16" },
	{ m_host_cpu, "resources.hosts: a job across daemons runs on their GPUs, but resources.device "
		      "is CPU" },
	{ m_host_accum, "resources.hosts: 4 ranks (2 GPUs on each of 2 daemons) share each step's "
			"hyper.grad_accum micro-batches, at least one each, and grad_accum is 2; set it "
			"to 4" },
	{ m_host_shard, "memory.shard: a job across daemons (resources.hosts) keeps whole optimizer "
			"state" },
	{ m_sel_none, "memory.selective_layers: 2, but memory.recompute none keeps every layer alike" },
	{ m_sel_selective, "memory.selective_layers: 1, but memory.recompute selective keeps every "
			   "layer alike" },
	{ m_rank0, "lora.rank: must be >= 1 (got 0)" },
	{ m_lora_alpha_nan, "lora.alpha:" },
	{ m_lora_alpha_neg, "lora.alpha: must be > 0" },
	{ m_dropout1, "lora.dropout: must be in [0, 1) (got 1)" },
	{ m_dropout_neg, "lora.dropout:" },
	{ m_qkv, "lora.target_modules[2]: unknown module 'qkv' (expected one of q_proj, k_proj, v_proj, o_proj, "
		 "gate_proj, up_proj, down_proj)" },
	{ m_mod_dup, "lora.target_modules[1]: 'up_proj' is listed twice" },
	{ m_mod_short, "lora.target_modules[0]: unknown module 'q'" },
	{ m_adapter_empty, "lora.init_adapter: must not be empty" },
	{ m_no_teacher, "distill.teacher_dir: required for method DISTILL" },
	{ m_teacher_empty, "distill.teacher_dir: must not be empty" },
	{ m_temp0, "distill.temperature: must be > 0" },
	{ m_temp_nan, "distill.temperature:" },
	{ m_dalpha, "distill.alpha: must be in [0, 1] (got 1.5)" },
	{ m_dalpha_nan, "distill.alpha:" },
	{ m_no_labels, "classify.num_labels: required for method CLASSIFY" },
	{ m_labels1, "classify.num_labels: must be >= 2 (got 1)" },
	{ m_labels1_full, "classify.num_labels: must be >= 2" },
	{ m_names_count, "classify.label_names: 3 names given for 2 labels" },
	{ m_names_nonum, "classify.label_names: given without classify.num_labels" },
	{ m_names_empty, "classify.label_names[1]: must not be empty" },
	{ m_names_dup, "classify.label_names[3]: 'y' is also label 1" },
	{ m_label_field_empty, "classify.label_field: must not be empty" },
	{ m_classify_tokens, "data.format: method CLASSIFY reads text and labels from JSONL" },
};

static void test_invalid(void)
{
	for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
		const struct bad_case *t = &bad_cases[i];
		/* Both as built and as the daemon sees it after the wire. */
		for (int wire = 0; wire < 2; wire++) {
			Traind__JobSpec *s = minimal();
			t->mut(s);
			if (wire)
				s = reencode(s);
			struct td_errbuf eb = { "" };
			uint8_t *before;
			size_t nbefore;
			CHECK_EQ_INT(rpc_jobspec_encode(s, &before, &nbefore), TD_OK);
			td_err rc = rpc_jobspec_validate(s, &eb);
			CHECK_MSG(rc == TD_EINVAL, "bad_cases[%zu] (%s): rc = %s, msg \"%s\"", i, t->expect,
				  td_errname(rc), eb.msg);
			CHECK_MSG(strncmp(eb.msg, t->expect, strlen(t->expect)) == 0,
				  "bad_cases[%zu]: \"%s\" does not begin with \"%s\"", i, eb.msg, t->expect);
			/* validate leaves the spec alone */
			uint8_t *after;
			size_t nafter;
			CHECK_EQ_INT(rpc_jobspec_encode(s, &after, &nafter), TD_OK);
			CHECK(nbefore == nafter && memcmp(before, after, nafter) == 0);
			free(before);
			free(after);
			/* and so does a failing spec after apply_defaults */
			CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
			CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_EINVAL);
			rpc_jobspec_free(s);
		}
	}
	fprintf(stderr, "invalid: %zu cases\n", sizeof(bad_cases) / sizeof(bad_cases[0]));
}

/* Valid edge cases: each must pass. */
M(v_minimal, (void)s)
M(v_warmup_epochs, SET(hy(s), warmup_steps, 1000))
M(v_warmup_eq, SET(hy(s), max_steps, 50); SET(hy(s), warmup_steps, 50))
M(v_edges, SET(hy(s), beta1, 0); SET(hy(s), beta2, 0.999999); SET(hy(s), clip_norm, 0); SET(hy(s), min_lr, 1e-4);
  SET(da(s), seq_len, 2); SET(re(s), priority, -100); SET(hy(s), epochs, 0.25))
M(v_edges2, SET(da(s), seq_len, 1048576); SET(re(s), priority, 100); SET(lo(s), dropout, 0.999);
  SET(di(s), alpha, 1.0))
M(v_classify, static const char *const v[] = { "neg", "pos", NULL }; SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY);
  SET(cl(s), num_labels, 2); set_list(&cl(s)->n_label_names, &cl(s)->label_names, v))
M(v_classify_nonames, SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY); SET(cl(s), num_labels, 1000))
M(v_distill, SET(s, method, TRAIND__METHOD__METHOD_DISTILL); set_str(&di(s)->teacher_dir, "/m/teacher"))
M(v_lora_all, static const char *const v[] = { "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
					       "down_proj", NULL };
  SET(s, method, TRAIND__METHOD__METHOD_LORA); set_list(&lo(s)->n_target_modules, &lo(s)->target_modules, v))
M(v_qlora, SET(s, method, TRAIND__METHOD__METHOD_QLORA))
M(v_cpu, SET(re(s), device, TRAIND__DEVICE__DEVICE_CPU); SET(hy(s), precision, TRAIND__PRECISION__PRECISION_FP32))
M(v_gpu_noallow, SET(re(s), device, TRAIND__DEVICE__DEVICE_GPU); SET(re(s), allow_cpu, 0))
M(v_relative, set_str(&s->model_dir, "models/m"); set_str(&da(s)->train_file, "t.bin"))
M(v_root_named, set_str(&s->model_dir, "/"); set_str(&s->name, "root"))
M(v_hosts, SET(re(s), gpus, 2); SET(hy(s), grad_accum, 8);
  HOSTS("tcp://127.0.0.1:7001", "tcp://gpu-b.example:7001", "tcp://[::1]:7002"))
M(v_hosts_16, SET(hy(s), grad_accum, 16); SET(me(s), shard, TRAIND__SHARD__SHARD_NONE);
  HOSTS("tcp://h1:1", "tcp://h2:1", "tcp://h3:1", "tcp://h4:1", "tcp://h5:1", "tcp://h6:1",
	"tcp://h7:1", "tcp://h8:1", "tcp://h9:1", "tcp://h10:1", "tcp://h11:1", "tcp://h12:1",
	"tcp://h13:1", "tcp://h14:1", "tcp://h15:65535"))

static void (*const good_cases[])(Traind__JobSpec *) = {
	v_minimal, v_warmup_epochs, v_warmup_eq, v_edges,    v_edges2, v_classify,      v_classify_nonames,
	v_distill, v_lora_all,      v_qlora,     v_cpu,      v_gpu_noallow, v_relative, v_root_named,
	v_hosts,   v_hosts_16,
};

static void test_valid(void)
{
	for (size_t i = 0; i < sizeof(good_cases) / sizeof(good_cases[0]); i++) {
		Traind__JobSpec *s = minimal();
		good_cases[i](s);
		struct td_errbuf eb = { "" };
		td_err rc = rpc_jobspec_validate(s, &eb);
		CHECK_MSG(rc == TD_OK, "good_cases[%zu]: %s: %s", i, td_errname(rc), eb.msg);
		rpc_jobspec_free(s);
	}
}

/* ------------------------------------------------------------------------ */
/* Binary: decode, load, round trip */

static void test_roundtrip(void)
{
	Traind__JobSpec *s = minimal();
	set_str(&s->name, "rt \"quoted\"");
	SET(s, method, TRAIND__METHOD__METHOD_CLASSIFY);
	SET(hy(s), lr, 1.2345678901234e-5);
	SET(hy(s), max_steps, 1ull << 40);
	SET(hy(s), seed, UINT64_MAX);
	SET(re(s), priority, -7);
	SET(cl(s), num_labels, 3);
	static const char *const v[] = { "a", "b", "c", NULL };
	set_list(&cl(s)->n_label_names, &cl(s)->label_names, v);
	struct td_errbuf eb = { "" };
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_OK);

	uint8_t *b;
	size_t n;
	CHECK_EQ_INT(rpc_jobspec_encode(s, &b, &n), TD_OK);
	Traind__JobSpec *d = NULL;
	CHECK_EQ_INT(rpc_jobspec_decode(&d, b, n, &eb), TD_OK);
	if (d) {
		CHECK(same_bytes(s, d));
		CHECK_STR_EQ(d->name, "rt \"quoted\"");
		CHECK_EQ_INT(d->method, TRAIND__METHOD__METHOD_CLASSIFY);
		CHECK_NEAR(d->hyper->lr, 1.2345678901234e-5, 0);
		CHECK(d->hyper->seed == UINT64_MAX);
		CHECK(d->hyper->max_steps == 1ull << 40);
		CHECK_EQ_INT(d->resources->priority, -7);
		CHECK_EQ_INT(d->classify->n_label_names, 3);
		CHECK_STR_EQ(d->classify->label_names[2], "c");
		CHECK(d->lora && d->lora->n_target_modules == 2);
		CHECK_STR_EQ(d->data->text_field, "text");
		CHECK(d->hyper->has_beta2);
	}

	/* through a .pb file */
	const char *p = write_tmp("rt.pb", b, n);
	Traind__JobSpec *f = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_OK);
	if (f)
		CHECK(same_bytes(s, f));
	rpc_jobspec_free(f);
	p = write_tmp("rt.binpb", b, n);
	f = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_OK);
	rpc_jobspec_free(f);

	/* print: one field per line, method's sections only */
	char *text = NULL;
	size_t tlen = 0;
	FILE *mf = open_memstream(&text, &tlen);
	rpc_jobspec_print(d, mf);
	fclose(mf);
	CHECK_CONTAINS(text, "name: \"rt \\\"quoted\\\"\"\n");
	CHECK_CONTAINS(text, "method: classify\n");
	CHECK_CONTAINS(text, "hyper.lr: 1.2345678901234e-05\n");
	CHECK_CONTAINS(text, "hyper.max_steps: 1099511627776\n");
	CHECK_CONTAINS(text, "hyper.epochs: (unset: by max_steps)\n");
	CHECK_CONTAINS(text, "hyper.precision: (auto");
	CHECK_CONTAINS(text, "classify.label_names[2]: \"c\"\n");
	CHECK_CONTAINS(text, "data.format: jsonl\n");
	CHECK_CONTAINS(text, "resources.priority: -7\n");
	CHECK_CONTAINS(text, "resources.gpus: 1\n");
	CHECK_CONTAINS(text, "output.shard_bytes: 5368709120\n");
	CHECK(text && strstr(text, "lora.") == NULL);
	free(text);

	free(b);
	rpc_jobspec_free(d);
	rpc_jobspec_free(s);
}

struct bytes_case {
	const char *what;
	uint8_t b[16];
	size_t n;
	td_err rc;
};

static const struct bytes_case bytes_cases[] = {
	{ "empty", { 0 }, 0, TD_OK },
	{ "lone 0xff", { 0xff }, 1, TD_EFORMAT },
	{ "truncated tag varint", { 0x80 }, 1, TD_EFORMAT },
	{ "string cut short", { 0x0a, 0x05, 'a' }, 3, TD_EFORMAT },
	{ "length past the end", { 0x1a, 0x7f, '/', 'm' }, 4, TD_EFORMAT },
	{ "tag without a value", { 0x0a }, 1, TD_EFORMAT },
	{ "name with wire type varint", { 0x08, 0x01 }, 2, TD_EFORMAT },
	{ "sub-message of garbage", { 0x22, 0x02, 0xff, 0xff }, 4, TD_EFORMAT },
	{ "overlong varint", { 0x10, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01 }, 12, TD_EFORMAT },
	{ "group wire type", { 0x0b, 0x0c }, 2, TD_EFORMAT },
	{ "field number 0", { 0x00, 0x01 }, 2, TD_EFORMAT },
	/* fuzz_jobspec's crash: field 0 in two bytes, which protobuf-c takes and
	 * writes back as 0x00, which it refuses; at the top and in data. */
	{ "field number 0 written in two bytes", { 0x80, 0x00, 0x00 }, 3, TD_EFORMAT },
	{ "field number 0 in two bytes inside data", { 0x22, 0x03, 0x80, 0x00, 0x00 }, 5, TD_EFORMAT },
	{ "unknown field is kept", { 0xf8, 0x06, 0x01 }, 3, TD_OK },
	{ "unknown enum value", { 0x10, 0x63 }, 2, TD_OK },
	{ "valid model_dir", { 0x1a, 0x02, '/', 'm' }, 4, TD_OK },
};

/* Decoding must never crash; whatever decodes must survive every other call. */
static void exercise(const uint8_t *b, size_t n, td_err *rc_out)
{
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = { "" };
	td_err rc = rpc_jobspec_decode(&s, b, n, &eb);
	if (rc_out)
		*rc_out = rc;
	if (rc != TD_OK) {
		CHECK_MSG(rc == TD_EFORMAT, "decode: %s", td_errname(rc));
		CHECK(s == NULL);
		return;
	}
	(void)rpc_jobspec_validate(s, &eb);
	FILE *null = fopen("/dev/null", "w");
	rpc_jobspec_print(s, null);
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	(void)rpc_jobspec_validate(s, &eb);
	(void)rpc_jobspec_resolve_precision(s, false, &eb);
	rpc_jobspec_print(s, null);
	fclose(null);
	uint8_t *e;
	size_t en;
	CHECK_EQ_INT(rpc_jobspec_encode(s, &e, &en), TD_OK);
	Traind__JobSpec *again = NULL;
	CHECK_EQ_INT(rpc_jobspec_decode(&again, e, en, &eb), TD_OK); /* what decoded decodes again */
	rpc_jobspec_free(again);
	free(e);
	rpc_jobspec_free(s);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (uint32_t)(rng >> 11);
}

static void test_bad_bytes(void)
{
	for (size_t i = 0; i < sizeof(bytes_cases) / sizeof(bytes_cases[0]); i++) {
		const struct bytes_case *t = &bytes_cases[i];
		td_err rc;
		exercise(t->b, t->n, &rc);
		CHECK_MSG(rc == t->rc, "bytes_cases[%zu] (%s): %s, want %s", i, t->what, td_errname(rc),
			  td_errname(t->rc));
	}
	/* An unknown enum value decodes, and validation names it. */
	{
		static const uint8_t b[] = { 0x10, 0x63 };
		Traind__JobSpec *s = NULL;
		struct td_errbuf eb = { "" };
		CHECK_EQ_INT(rpc_jobspec_decode(&s, b, sizeof(b), &eb), TD_OK);
		CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_EINVAL);
		rpc_jobspec_free(s);
	}
	/* Every truncation of a full spec: decodes or TD_EFORMAT, never a crash;
	 * cut inside the last sub-message, it is TD_EFORMAT. */
	Traind__JobSpec *s = minimal();
	struct td_errbuf eb = { "" };
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	uint8_t *b;
	size_t n;
	CHECK_EQ_INT(rpc_jobspec_encode(s, &b, &n), TD_OK);
	size_t bad = 0;
	for (size_t k = 0; k < n; k++) {
		uint8_t *cut = malloc(k ? k : 1); /* exact size: ASan catches a read past it */
		memcpy(cut, b, k);
		td_err rc;
		exercise(cut, k, &rc);
		bad += rc == TD_EFORMAT;
		free(cut);
	}
	CHECK(bad > n / 2);
	{
		uint8_t *cut = malloc(n - 1);
		memcpy(cut, b, n - 1);
		td_err rc;
		exercise(cut, n - 1, &rc);
		CHECK_EQ_INT(rc, TD_EFORMAT);
		const char *p = write_tmp("truncated.pb", cut, n - 1);
		Traind__JobSpec *f = NULL;
		CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_EFORMAT);
		CHECK(f == NULL);
		CHECK_CONTAINS(eb.msg, p);
		free(cut);
	}
	/* Random bytes, and random damage to a valid encoding. */
	for (int it = 0; it < 3000; it++) {
		size_t len = rnd() % 48;
		uint8_t buf[48];
		for (size_t k = 0; k < len; k++)
			buf[k] = (uint8_t)rnd();
		uint8_t *heap = malloc(len ? len : 1);
		memcpy(heap, buf, len);
		exercise(heap, len, NULL);
		free(heap);

		uint8_t *dmg = malloc(n);
		memcpy(dmg, b, n);
		for (int f = 1 + (int)(rnd() % 3); f > 0; f--)
			dmg[rnd() % n] = (uint8_t)rnd();
		exercise(dmg, n, NULL);
		free(dmg);
	}
	free(b);
	rpc_jobspec_free(s);

	/* Garbage in a .pb file. */
	static const uint8_t junk[] = { 0xde, 0xad, 0xbe, 0xef, 0x00, 0xff };
	const char *p = write_tmp("junk.pb", junk, sizeof(junk));
	Traind__JobSpec *f = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "junk.pb");
	p = write_tmp("tag0.pb", (const uint8_t[]){ 0x80, 0x00, 0x00 }, 3);
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "tag0.pb: malformed field tags");

	/* Over the size limit, in a buffer and in a file. */
	uint8_t *big = calloc(RPC_JOBSPEC_MAX_BYTES + 1, 1);
	CHECK_EQ_INT(rpc_jobspec_decode(&f, big, RPC_JOBSPEC_MAX_BYTES + 1, &eb), TD_ERANGE);
	free(big);
	p = write_tmp("big.pb", "", 0);
	CHECK_EQ_INT(truncate(p, RPC_JOBSPEC_MAX_BYTES + 1), 0);
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "big.pb");

	/* An empty file is an empty spec, which does not validate. */
	p = write_tmp("empty.pb", "", 0);
	f = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_OK);
	CHECK_EQ_INT(rpc_jobspec_validate(f, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "model_dir: required");
	rpc_jobspec_free(f);
	f = NULL;

	/* Files that are not there, not regular, or not named for a format. */
	char path[256];
	snprintf(path, sizeof(path), "%s/missing.pb", tmpdir);
	CHECK_EQ_INT(rpc_jobspec_load(&f, path, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "missing.pb");
	snprintf(path, sizeof(path), "%s/dir.pb", tmpdir);
	CHECK_EQ_INT(mkdir(path, 0700), 0);
	CHECK_EQ_INT(rpc_jobspec_load(&f, path, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "not a regular file");
	snprintf(path, sizeof(path), "%s/fifo.txtpb", tmpdir);
	CHECK_EQ_INT(mkfifo(path, 0600), 0);
	CHECK_EQ_INT(rpc_jobspec_load(&f, path, &eb), TD_EINVAL); /* and does not hang */
	p = write_tmp("job.json", "{}", 2);
	CHECK_EQ_INT(rpc_jobspec_load(&f, p, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "job.json");
	CHECK_EQ_INT(rpc_jobspec_load(&f, "", &eb), TD_EINVAL);
	CHECK(f == NULL);
}

/* ------------------------------------------------------------------------ */
/* Text format, through protoc */

#define MIN_TEXT                                                                                           \
	"model_dir: \"/models/qwen2-0.5b\"\n"                                                              \
	"data { train_file: \"/data/train.jsonl\" }\n"                                                      \
	"output { dir: \"/runs/out\" }\n"

struct text_case {
	const char *file; /* written to tmpdir; the extension picks the loader */
	const char *text;
	td_err load;        /* expected from rpc_jobspec_load */
	td_err valid;       /* expected from rpc_jobspec_validate, when loaded */
	const char *expect; /* in the message; a leading '@' stands for the file's path */
};

static const struct text_case text_cases[] = {
	{ "min.txtpb", MIN_TEXT, TD_OK, TD_OK, NULL },
	{ "min.textproto", MIN_TEXT, TD_OK, TD_OK, NULL },
	{ "min.txt", MIN_TEXT, TD_OK, TD_OK, NULL },
	{ "MIN.TXTPB", MIN_TEXT, TD_OK, TD_OK, NULL },
	{ "empty.txtpb", "", TD_OK, TD_EINVAL, "model_dir: required" },
	{ "comments.txtpb", "# only a comment\n\n", TD_OK, TD_EINVAL, "model_dir: required" },
	{ "lora.txtpb",
	  MIN_TEXT "method: METHOD_LORA\nlora { rank: 4 target_modules: \"k_proj\" target_modules: \"down_proj\" }\n",
	  TD_OK, TD_OK, NULL },
	{ "lr.txtpb", MIN_TEXT "hyper { lr: -0.001 }\n", TD_OK, TD_EINVAL, "hyper.lr: must be > 0 (got -0.001)" },
	{ "nan.txtpb", MIN_TEXT "hyper { beta1: nan }\n", TD_OK, TD_EINVAL, "hyper.beta1: must be a finite number" },
	{ "qkv.txtpb", MIN_TEXT "lora { target_modules: [\"q_proj\", \"v_proj\", \"qkv\"] }\n", TD_OK, TD_EINVAL,
	  "lora.target_modules[2]: unknown module 'qkv' (expected one of q_proj, k_proj, v_proj, o_proj, gate_proj, "
	  "up_proj, down_proj)" },
	{ "distill.txtpb", MIN_TEXT "method: METHOD_DISTILL\n", TD_OK, TD_EINVAL,
	  "distill.teacher_dir: required for method DISTILL" },
	{ "both.txtpb", MIN_TEXT "hyper { max_steps: 10 epochs: 2 }\n", TD_OK, TD_EINVAL,
	  "hyper: set max_steps or epochs, not both" },
	{ "notrain.txtpb", "model_dir: \"/m\"\ndata { }\noutput { dir: \"/o\" }\n", TD_OK, TD_EINVAL,
	  "data.train_file: required" },
	{ "classify.txtpb",
	  MIN_TEXT "method: METHOD_CLASSIFY\nclassify { num_labels: 2 label_names: [\"a\", \"b\", \"c\"] }\n", TD_OK,
	  TD_EINVAL, "classify.label_names: 3 names given for 2 labels" },
	{ "prio.txtpb", MIN_TEXT "resources { priority: 1000 }\n", TD_OK, TD_EINVAL, "resources.priority" },
	{ "syntax.txtpb", "model_dir: \"/m\"\nhyper {\n  lr: abc\n}\n", TD_EFORMAT, TD_OK, "@:3:" },
	{ "unknown.txtpb", "model_dir: \"/m\"\nbogus_field: 1\n", TD_EFORMAT, TD_OK, "@:2:" },
	{ "unknown2.txtpb", "model_dir: \"/m\"\nbogus_field: 1\n", TD_EFORMAT, TD_OK, "bogus_field" },
	{ "enum.textproto", "method: METHOD_NOPE\n", TD_EFORMAT, TD_OK, "METHOD_NOPE" },
	{ "unclosed.txt", "model_dir: \"/m\"\ndata {\n  train_file: \"/t\"\n", TD_EFORMAT, TD_OK, "@:" },
	{ "string.txtpb", "model_dir: \"/m\n", TD_EFORMAT, TD_OK, "@:1:" },
	{ "range.txtpb", "data { seq_len: 4294967296 }\n", TD_EFORMAT, TD_OK, "@:1:" },
	{ "negative.txtpb", "hyper { micro_batch: -1 }\n", TD_EFORMAT, TD_OK, "@:1:" },
	{ "type.txtpb", "data: \"x\"\n", TD_EFORMAT, TD_OK, "@:1:" },
};

/* Loads text through protoc. Returns false (after printing why) where protoc
 * is not available, so that the text cases are skipped, not failed. */
static bool protoc_works(void)
{
	const char *p = write_tmp("probe.txtpb", MIN_TEXT, strlen(MIN_TEXT));
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = { "" };
	td_err rc = rpc_jobspec_load(&s, p, &eb);
	rpc_jobspec_free(s);
	if (rc == TD_EUNSUPPORTED) {
		fprintf(stderr, "SKIP: text-format cases: %s\n", eb.msg);
		return false;
	}
	CHECK_MSG(rc == TD_OK, "probe: %s: %s", td_errname(rc), eb.msg);
	return rc == TD_OK;
}

static void test_text(void)
{
	for (size_t i = 0; i < sizeof(text_cases) / sizeof(text_cases[0]); i++) {
		const struct text_case *t = &text_cases[i];
		const char *p = write_tmp(t->file, t->text, strlen(t->text));
		char path[256], expect[512];
		snprintf(path, sizeof(path), "%s", p);
		if (t->expect && t->expect[0] == '@')
			snprintf(expect, sizeof(expect), "%s%s", path, t->expect + 1);
		else
			snprintf(expect, sizeof(expect), "%s", t->expect ? t->expect : "");
		Traind__JobSpec *s = NULL;
		struct td_errbuf eb = { "" };
		td_err rc = rpc_jobspec_load(&s, path, &eb);
		CHECK_MSG(rc == t->load, "text_cases[%zu] %s: load %s, want %s: %s", i, t->file, td_errname(rc),
			  td_errname(t->load), eb.msg);
		if (rc == TD_OK) {
			rc = rpc_jobspec_validate(s, &eb);
			CHECK_MSG(rc == t->valid, "text_cases[%zu] %s: validate %s, want %s: %s", i, t->file,
				  td_errname(rc), td_errname(t->valid), rc ? eb.msg : "");
		} else {
			CHECK(s == NULL);
		}
		if (rc && t->expect)
			CHECK_CONTAINS(eb.msg, expect);
		if (t->load == TD_EFORMAT) /* names the file first, as "PATH:LINE:COL: what" */
			CHECK_MSG(strncmp(eb.msg, path, strlen(path)) == 0 && eb.msg[strlen(path)] == ':',
				  "\"%s\" does not begin with \"%s:\"", eb.msg, path);
		if (rc == TD_EFORMAT)
			fprintf(stderr, "  %s -> %s\n", t->file, eb.msg);
		rpc_jobspec_free(s);
	}

	/* What the text said arrives. */
	static const char fields[] = MIN_TEXT
		"method: METHOD_QLORA\nhyper { lr: 3e-5 max_steps: 7 precision: PRECISION_FP32 }\n"
		"lora { rank: 2 }\nresources { device: DEVICE_CPU priority: -3 }\n";
	const char *p = write_tmp("fields.txtpb", fields, strlen(fields));
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = { "" };
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_OK);
	if (s) {
		CHECK_EQ_INT(s->method, TRAIND__METHOD__METHOD_QLORA);
		CHECK_NEAR(s->hyper->lr, 3e-5, 0);
		CHECK(s->hyper->has_max_steps && s->hyper->max_steps == 7);
		CHECK(!s->hyper->has_epochs);
		CHECK_EQ_INT(s->resources->priority, -3);
		CHECK(!s->hyper->has_seed); /* as decoded: defaults not yet applied */
		CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
		CHECK_NEAR(s->lora->alpha, 4.0, 0);
		CHECK_EQ_INT(s->hyper->precision, TRAIND__PRECISION__PRECISION_FP32);
		CHECK(!s->hyper->has_epochs);
		CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_OK);
	}
	rpc_jobspec_free(s);

	/* A spec larger than a pipe holds goes through protoc whole (stdin and
	 * stdout are serviced together); the label check stays fast. */
	enum { NL = 20000 };
	size_t cap = strlen(MIN_TEXT) + 128 + (size_t)NL * 32, len = 0;
	char *big = malloc(cap);
	len += (size_t)snprintf(big + len, cap - len, "%smethod: METHOD_CLASSIFY\nclassify {\n  num_labels: %d\n",
				MIN_TEXT, NL);
	for (int i = 0; i < NL; i++)
		len += (size_t)snprintf(big + len, cap - len, "  label_names: \"label_%05d\"\n", i == NL - 1 ? 7 : i);
	len += (size_t)snprintf(big + len, cap - len, "}\n");
	p = write_tmp("big.txtpb", big, len);
	s = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_OK);
	if (s) {
		CHECK_EQ_INT(s->classify->n_label_names, NL);
		CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_EINVAL);
		CHECK_CONTAINS(eb.msg, "classify.label_names[19999]: 'label_00007' is also label 7");
	}
	rpc_jobspec_free(s);
	free(big);
	/* Over the limit, text is refused before protoc runs. */
	big = malloc(RPC_JOBSPEC_MAX_BYTES + 2);
	memset(big, '#', RPC_JOBSPEC_MAX_BYTES + 1);
	p = write_tmp("huge.txtpb", big, RPC_JOBSPEC_MAX_BYTES + 1);
	s = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_ERANGE);
	CHECK(s == NULL);
	free(big);

	/* TD_PROTO_PATH picks the .proto; a wrong one is reported. */
	p = write_tmp("fields.txtpb", fields, strlen(fields));
	char srcproto[] = TD_PROTO_SRC_PATH;
	setenv("TD_PROTO_PATH", srcproto, 1);
	s = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_OK);
	rpc_jobspec_free(s);
	setenv("TD_PROTO_PATH", "/nonexistent/traind.proto", 1);
	s = NULL;
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "/nonexistent/traind.proto");
	unsetenv("TD_PROTO_PATH");
}

static void test_no_protoc(void)
{
	/* Runs with or without protoc: a missing one is TD_EUNSUPPORTED with a hint. */
	const char *p = write_tmp("noprotoc.txtpb", MIN_TEXT, strlen(MIN_TEXT));
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = { "" };
	char *saved = getenv("TD_PROTOC") ? strdup(getenv("TD_PROTOC")) : NULL;
	setenv("TD_PROTOC", "/nonexistent/protoc", 1);
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "/nonexistent/protoc");
	CHECK_CONTAINS(eb.msg, "noprotoc.txtpb");
	setenv("TD_PROTOC", "no-such-protoc-binary", 1);
	CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_EUNSUPPORTED);
	/* A program that fails without reading its input: no SIGPIPE, a clear error. */
	if (access("/bin/false", X_OK) == 0) {
		setenv("TD_PROTOC", "/bin/false", 1);
		CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_EFORMAT);
		CHECK_CONTAINS(eb.msg, "exit 1");
	}
	/* A program that prints garbage and succeeds: decoded, and refused. */
	if (access("/bin/echo", X_OK) == 0) {
		setenv("TD_PROTOC", "/bin/echo", 1);
		CHECK_EQ_INT(rpc_jobspec_load(&s, p, &eb), TD_EFORMAT);
		CHECK_CONTAINS(eb.msg, "noprotoc.txtpb");
	}
	/* Stand-ins for a misbehaving protoc. */
	static const struct {
		const char *name, *script;
		td_err rc;
		const char *expect;
	} fakes[] = {
		/* more output than a spec may have: drained, refused */
		{ "fake-big-out", "#!/bin/sh\nhead -c 3000000 /dev/zero\n", TD_ERANGE, "noprotoc.txtpb" },
		/* a flood on stderr: the first lines kept, "input:" renamed */
		{ "fake-big-err",
		  "#!/bin/sh\ni=1; while [ $i -le 3000 ]; do echo \"input:$i:1: error $i\" >&2; i=$((i+1)); done; exit 1\n",
		  TD_EFORMAT, "noprotoc.txtpb:1:1: error 1; " },
		/* exits at once without reading a large input: EPIPE, not SIGPIPE */
		{ "fake-no-read", "#!/bin/sh\nexit 0\n", TD_OK, NULL },
	};
	enum { PAD = 400000 };
	size_t min_len = strlen(MIN_TEXT);
	char *padded = malloc(min_len + PAD + 1);
	if (!padded)
		exit(1);
	memcpy(padded, MIN_TEXT, min_len);
	memset(padded + min_len, '\n', PAD);
	padded[min_len + PAD] = '\0';
	const char *big = write_tmp("noprotoc.txtpb", padded, strlen(padded));
	char bigpath[256];
	snprintf(bigpath, sizeof(bigpath), "%s", big);
	free(padded);
	for (size_t i = 0; i < sizeof(fakes) / sizeof(fakes[0]); i++) {
		const char *fp = write_tmp(fakes[i].name, fakes[i].script, strlen(fakes[i].script));
		CHECK_EQ_INT(chmod(fp, 0700), 0);
		setenv("TD_PROTOC", fp, 1);
		s = NULL;
		td_err rc = rpc_jobspec_load(&s, bigpath, &eb);
		CHECK_MSG(rc == fakes[i].rc, "%s: %s, want %s: %s", fakes[i].name, td_errname(rc),
			  td_errname(fakes[i].rc), eb.msg);
		if (rc && fakes[i].expect)
			CHECK_CONTAINS(eb.msg, fakes[i].expect);
		if (rc)
			CHECK(strlen(eb.msg) < sizeof(eb.msg));
		rpc_jobspec_free(s);
		s = NULL;
	}

	if (saved)
		setenv("TD_PROTOC", saved, 1);
	else
		unsetenv("TD_PROTOC");
	free(saved);
	CHECK(s == NULL);
}

static void test_example(void)
{
	char path[512];
	const char *src = getenv("TD_SRC");
	if (src && *src) {
		snprintf(path, sizeof(path), "%s/proto/example-job.txtpb", src);
	} else {
		snprintf(path, sizeof(path), "%s", TD_PROTO_SRC_PATH);
		char *slash = strrchr(path, '/');
		snprintf(slash + 1, sizeof(path) - (size_t)(slash + 1 - path), "example-job.txtpb");
	}
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = { "" };
	td_err rc = rpc_jobspec_load(&s, path, &eb);
	CHECK_MSG(rc == TD_OK, "%s: %s", td_errname(rc), eb.msg);
	if (!s)
		return;
	CHECK_EQ_INT(rpc_jobspec_validate(s, &eb), TD_OK);
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	CHECK_MSG(rpc_jobspec_validate(s, &eb) == TD_OK, "%s", eb.msg);
	/* Every field is set in the example (except the alternative epochs). */
	CHECK_STR_EQ(s->name, "qwen2-0.5b-support-lora");
	CHECK_EQ_INT(s->method, TRAIND__METHOD__METHOD_LORA);
	CHECK(s->data->eval_file && s->data->has_eos_id && s->data->seq_len == 1024);
	CHECK(s->hyper->has_max_steps && !s->hyper->has_epochs && s->hyper->micro_batch == 4);
	CHECK_EQ_INT(s->hyper->precision, TRAIND__PRECISION__PRECISION_BF16);
	CHECK_EQ_INT(s->lora->rank, 16);
	CHECK_EQ_INT(s->lora->n_target_modules, 4);
	CHECK(s->lora->init_adapter != NULL);
	CHECK(s->distill->teacher_dir != NULL);
	CHECK_EQ_INT(s->classify->n_label_names, 3);
	CHECK_EQ_INT(s->output->checkpoint_every, 200);
	CHECK_EQ_INT(s->resources->device, TRAIND__DEVICE__DEVICE_GPU);
	CHECK_EQ_INT(s->resources->allow_cpu, 0);

	char *text = NULL;
	size_t tlen = 0;
	FILE *mf = open_memstream(&text, &tlen);
	rpc_jobspec_print(s, mf);
	fclose(mf);
	CHECK_CONTAINS(text, "method: lora\n");
	CHECK_CONTAINS(text, "lora.target_modules[3]: \"o_proj\"\n");
	CHECK_CONTAINS(text, "hyper.precision: bf16\n");
	CHECK_CONTAINS(text, "resources.device: gpu\n");
	CHECK(text && strstr(text, "distill.") == NULL);
	fputs(text, stderr);
	free(text);
	rpc_jobspec_free(s);
}

static void test_method_names(void)
{
	static const struct {
		Traind__Method m;
		const char *name;
	} t[] = {
		{ TRAIND__METHOD__METHOD_UNSPECIFIED, "full" }, { TRAIND__METHOD__METHOD_FULL, "full" },
		{ TRAIND__METHOD__METHOD_LORA, "lora" },        { TRAIND__METHOD__METHOD_QLORA, "qlora" },
		{ TRAIND__METHOD__METHOD_DISTILL, "distill" },  { TRAIND__METHOD__METHOD_CLASSIFY, "classify" },
		{ (Traind__Method)77, "unknown" },              { (Traind__Method)-1, "unknown" },
	};
	for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
		CHECK_STR_EQ(rpc_method_name(t[i].m), t[i].name);
		Traind__Method m = (Traind__Method)99;
		td_err rc = rpc_method_from_name(t[i].name, &m);
		if (strcmp(t[i].name, "unknown") == 0) {
			CHECK_EQ_INT(rc, TD_EINVAL);
			CHECK_EQ_INT(m, 99);
		} else {
			CHECK_EQ_INT(rc, TD_OK);
			CHECK_STR_EQ(rpc_method_name(m), t[i].name);
		}
	}
	Traind__Method m;
	CHECK_EQ_INT(rpc_method_from_name("QLoRA", &m), TD_OK);
	CHECK_EQ_INT(m, TRAIND__METHOD__METHOD_QLORA);
	CHECK_EQ_INT(rpc_method_from_name(NULL, &m), TD_EINVAL);
	rpc_jobspec_free(NULL);
}

int main(void)
{
	snprintf(tmpdir, sizeof(tmpdir), "/tmp/td-jobspec-XXXXXX");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
		return 1;
	}
	test_method_names();
	test_defaults_minimal();
	test_defaults_derived();
	test_resolve_precision();
	test_invalid();
	test_valid();
	test_roundtrip();
	test_bad_bytes();
	test_no_protoc();
	if (protoc_works()) {
		test_text();
		test_example();
	} else {
		fprintf(stderr, "SKIP: the example spec (%s) needs protoc\n", "proto/example-job.txtpb");
	}
	check_rm_tree(tmpdir);
	return check_status();
}
