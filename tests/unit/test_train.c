/* The trainer end to end on the CPU backend: resume is bit-identical, gradient
 * accumulation equals the larger batch, the loss falls, the memory plan is
 * what the backend allocates, schedules match transformers', and bad inputs
 * (data, weights, a finished output) fail with messages that name them.
 *
 * Uses the tiny qwen2 fixture and the demo token file. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "kernels/cpu/ops.h"
#include "proto/jobspec.h"
#include "tests/check.h"
#include "tests/unit/rowmatmul.h"
#include "train/data.h"
#include "train/method.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/trainer.h"

static char tmp[256];
static const char *fx;

static void write_file(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, n, f) != n) {
		perror(path);
		exit(2);
	}
	fclose(f);
}

/* A text spec with the given extra hyper/data/output lines and top-level
 * fields, loaded, defaulted, validated. */
static Traind__JobSpec *spec_with(const char *name, const char *model, const char *data,
				  const char *hyper, const char *output, const char *top)
{
	char path[512], text[4096];
	snprintf(path, sizeof(path), "%s/%s.txtpb", tmp, name);
	snprintf(text, sizeof(text),
		 "name: \"%s\"\nmodel_dir: \"%s\"\n"
		 "data { train_file: \"%s\" format: DATA_FORMAT_TOKENS seq_len: 16 }\n"
		 "hyper { schedule: SCHEDULE_CONSTANT weight_decay: 0.01 seed: 7 %s }\n"
		 "output { dir: \"%s/%s\" %s }\nresources { device: DEVICE_CPU }\n%s\n",
		 name, model, data, hyper, tmp, name, output, top);
	write_file(path, text, strlen(text));
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = rpc_jobspec_load(&s, path, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_apply_defaults(s, &eb);
	if (e == TD_OK)
		e = rpc_jobspec_validate(s, &eb);
	if (e != TD_OK) {
		fprintf(stderr, "spec %s: %s\n", name, eb.msg);
		exit(2);
	}
	return s;
}

static Traind__JobSpec *spec(const char *name, const char *model, const char *data,
			     const char *hyper, const char *output)
{
	return spec_with(name, model, data, hyper, output, "");
}

static td_err train(const Traind__JobSpec *s, uint64_t stop_after, struct tr_train_result *r,
		    struct td_errbuf *eb)
{
	struct tr_train_opts o = {.backend = "cpu", .stop_after = stop_after};
	return tr_train(s, &o, NULL, r, eb);
}

/* Compares two model dirs' tensors bit for bit; returns the number that differ. */
static int diff_models(const char *a, const char *b, double *maxdiff)
{
	struct tr_weights *wa = NULL, *wb = NULL;
	struct td_errbuf eb = {{0}};
	if (tr_weights_open(&wa, a, &eb) || tr_weights_open(&wb, b, &eb)) {
		fprintf(stderr, "diff_models: %s\n", eb.msg);
		return -1;
	}
	int ndiff = 0;
	*maxdiff = 0;
	for (size_t i = 0; i < tr_weights_count(wa); i++) {
		const struct tr_st_tensor *ta = tr_weights_at(wa, i);
		const struct tr_st_tensor *tb = tr_weights_find(wb, ta->name);
		if (!tb || tb->nbytes != ta->nbytes) {
			ndiff++;
			continue;
		}
		if (memcmp(ta->data, tb->data, ta->nbytes) != 0)
			ndiff++;
		float *fa = malloc(ta->numel * sizeof(float)), *fb = malloc(ta->numel * sizeof(float));
		tr_st_to_f32(fa, ta, &eb);
		tr_st_to_f32(fb, tb, &eb);
		for (int64_t k = 0; k < ta->numel; k++) {
			double d = fabs((double)fa[k] - fb[k]);
			if (d > *maxdiff)
				*maxdiff = d;
		}
		free(fa);
		free(fb);
	}
	ndiff += tr_weights_count(wa) != tr_weights_count(wb);
	tr_weights_close(wa);
	tr_weights_close(wb);
	return ndiff;
}

static void test_resume_bit_identical(const char *model, const char *data)
{
	Traind__JobSpec *straight = spec("straight", model, data, "lr: 1e-3 max_steps: 6 micro_batch: 2",
					 "checkpoint_every: 3");
	Traind__JobSpec *resumed = spec("resumed", model, data, "lr: 1e-3 max_steps: 6 micro_batch: 2",
					"checkpoint_every: 3");
	struct tr_train_result r1, r2, r3;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(train(straight, 0, &r1, &eb), TD_OK);
	CHECK_EQ_INT(r1.steps_done, 6);
	/* First run of the second job stops after 3 steps (a checkpoint is written). */
	CHECK_EQ_INT(train(resumed, 3, &r2, &eb), TD_OK);
	CHECK(r2.stopped);
	CHECK_EQ_INT(r2.steps_done, 3);
	CHECK_EQ_INT(train(resumed, 0, &r3, &eb), TD_OK);
	CHECK_EQ_INT(r3.resumed_from, 3);
	CHECK_EQ_INT(r3.steps_done, 6);
	CHECK_MSG(r3.last_loss == r1.last_loss, "final loss %.9g vs %.9g", r3.last_loss, r1.last_loss);
	char a[512], b[512];
	snprintf(a, sizeof(a), "%s/straight", tmp);
	snprintf(b, sizeof(b), "%s/resumed", tmp);
	double md;
	CHECK_EQ_INT(diff_models(a, b, &md), 0);
	/* Checkpoints too: step 6 was not written (end), step 3 is in both. */
	snprintf(a, sizeof(a), "%s/straight/checkpoints/step-00000003", tmp);
	snprintf(b, sizeof(b), "%s/resumed/checkpoints/step-00000003", tmp);
	CHECK_EQ_INT(diff_models(a, b, &md), 0);

	/* A finished output is not trained again. */
	CHECK_EQ_INT(train(straight, 0, &r1, &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "already holds a finished run");
	rpc_jobspec_free(straight);
	rpc_jobspec_free(resumed);
}

static void test_grad_accum(const char *model, const char *data)
{
	Traind__JobSpec *big = spec("big", model, data, "lr: 1e-3 max_steps: 2 micro_batch: 2", "");
	Traind__JobSpec *acc = spec("acc", model, data, "lr: 1e-3 max_steps: 2 micro_batch: 1 grad_accum: 2", "");
	struct tr_train_result r1, r2;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(train(big, 0, &r1, &eb), TD_OK);
	CHECK_EQ_INT(train(acc, 0, &r2, &eb), TD_OK);
	/* The same forward in GEMMs of 2 and of 1 sequence(s). The second
	 * step's parameters differ too, but only where a gradient within
	 * rounding of zero made Adam step differently, and such a parameter
	 * moves the loss by its (rounding-sized) gradient times the step. */
	CHECK_NEAR(r1.first_loss, r2.first_loss, F32_FORWARD_RTOL * r1.first_loss);
	CHECK_NEAR(r1.last_loss, r2.last_loss, F32_FORWARD_RTOL * r1.last_loss);
	char a[512], b[512];
	snprintf(a, sizeof(a), "%s/big", tmp);
	snprintf(b, sizeof(b), "%s/acc", tmp);
	double md = 1;
	CHECK_EQ_INT(diff_models(a, b, &md) >= 0, 1);
	/* Same sequences, same token-weighted mean: gradients equal up to summation
	 * order. Adam divides by sqrt(v), so a parameter whose gradient is nearly
	 * zero turns a rounding difference into up to a learning-rate step (1e-3
	 * here); 5e-5 after two steps is 5% of one step (the shared fixtures allow
	 * 1e-4 against PyTorch for the same reason). */
	CHECK_NEAR(md, 0, 5e-5);
	rpc_jobspec_free(big);
	rpc_jobspec_free(acc);
}

/* Every policy's plan bytes (and host bytes, where host) for the job at
 * micro-batch 2 x 16 with sel selective layers (FULL's and FULL_OFFLOAD's). */
static void policy_bytes(const char *model, const char *data, const struct tr_model_config *cfg,
			 int sel, size_t total[TR_RECOMPUTE_COUNT], size_t host[TR_RECOMPUTE_COUNT])
{
	Traind__JobSpec *s = spec_with("rc-bytes", model, data, "micro_batch: 2", "", "");
	struct td_errbuf eb = {{0}};
	struct tr_plan_opts po;
	CHECK_EQ_INT(tr_method_plan_opts(s, cfg, 2, 16, &po, &eb), TD_OK);
	po.selective_layers = sel;
	CHECK_EQ_INT(tr_plan_policy_bytes(cfg, &po, NULL, total, host, &eb), TD_OK);
	rpc_jobspec_free(s);
}

/* memory.recompute through the job spec: SELECTIVE, FULL and FULL_OFFLOAD
 * train the same bits as NONE (test_recompute holds every method to it op by op);
 * memory.max_bytes picks the least recompute that fits, or fails the job
 * naming it. */
static void test_recompute_job(const char *model, const char *data)
{
	static const struct {
		const char *name, *memory;
		td_err code;
		enum tr_recompute rc;
	} cases[] = {
		{"rc-none", "memory { recompute: RECOMPUTE_NONE }", TD_OK, TR_RECOMPUTE_NONE},
		{"rc-selective", "memory { recompute: RECOMPUTE_SELECTIVE }", TD_OK, TR_RECOMPUTE_SELECTIVE},
		{"rc-full", "memory { recompute: RECOMPUTE_FULL }", TD_OK, TR_RECOMPUTE_FULL},
		{"rc-full-offload", "memory { recompute: RECOMPUTE_FULL_OFFLOAD }", TD_OK,
		 TR_RECOMPUTE_FULL_OFFLOAD},
		/* the first layer of FULL's kept as SELECTIVE keeps it
		 * (memory.selective_layers): the same bits again */
		{"rc-full-sel", "memory { recompute: RECOMPUTE_FULL selective_layers: 1 }", TD_OK,
		 TR_RECOMPUTE_FULL},
		{"rc-tiny", "memory { max_bytes: 1000 }", TD_ERANGE, 0},
	};
	enum { NCASES = sizeof(cases) / sizeof(cases[0]) };
	char cfgpath[512];
	snprintf(cfgpath, sizeof(cfgpath), "%s/config.json", model);
	struct tr_model_config cfg;
	struct td_errbuf eb0 = {{0}};
	CHECK_EQ_INT(tr_config_load(&cfg, cfgpath, &eb0), TD_OK);
	struct tr_train_result r[NCASES];
	for (size_t i = 0; i < NCASES; i++) {
		Traind__JobSpec *s = spec_with(cases[i].name, model, data,
					       "lr: 1e-3 max_steps: 3 micro_batch: 2 grad_accum: 2", "",
					       cases[i].memory);
		struct td_errbuf eb = {{0}};
		struct tr_plan_opts po;
		CHECK_EQ_INT(tr_method_plan_opts(s, &cfg, 2, 16, &po, &eb), cases[i].code);
		if (cases[i].code == TD_OK) {
			CHECK_EQ_INT(po.recompute, cases[i].rc);
			CHECK_EQ_INT(po.selective_layers, strstr(cases[i].memory, "selective_layers") != NULL);
		}
		CHECK_EQ_INT(train(s, 0, &r[i], &eb), cases[i].code);
		if (cases[i].code != TD_OK)
			CHECK_CONTAINS(eb.msg, "memory.max_bytes: 1000 B (1000 bytes), but the job's plan needs");
		rpc_jobspec_free(s);
	}
	/* A bound that FULL_OFFLOAD's plan fits and FULL's does not: AUTO takes
	 * FULL_OFFLOAD (its host bytes are in no bound: they are not the GPU's). */
	{
		struct td_errbuf eb = {{0}};
		struct tr_plan_opts po;
		size_t total[TR_RECOMPUTE_COUNT], host[TR_RECOMPUTE_COUNT];
		policy_bytes(model, data, &cfg, 0, total, host);
		CHECK(total[TR_RECOMPUTE_FULL_OFFLOAD] < total[TR_RECOMPUTE_FULL] &&
		      host[TR_RECOMPUTE_FULL_OFFLOAD] > 0 && host[TR_RECOMPUTE_FULL] == 0);
		char mem[96];
		snprintf(mem, sizeof(mem), "memory { max_bytes: %zu }", total[TR_RECOMPUTE_FULL_OFFLOAD]);
		Traind__JobSpec *s = spec_with("rc-bound", model, data, "micro_batch: 2", "", mem);
		CHECK_EQ_INT(tr_method_plan_opts(s, &cfg, 2, 16, &po, &eb), TD_OK);
		CHECK_EQ_INT(po.recompute, TR_RECOMPUTE_FULL_OFFLOAD);
		rpc_jobspec_free(s);
	}
	/* Selective layers in the bound: a bound FULL's plan fits and FULL
	 * with a selective layer does not fails the job naming both; more
	 * layers than the model has fail its plan, naming the field. */
	{
		struct td_errbuf eb = {{0}};
		struct tr_plan_opts po;
		size_t full[TR_RECOMPUTE_COUNT], sel[TR_RECOMPUTE_COUNT];
		policy_bytes(model, data, &cfg, 0, full, NULL);
		policy_bytes(model, data, &cfg, 1, sel, NULL);
		CHECK(sel[TR_RECOMPUTE_FULL] > full[TR_RECOMPUTE_FULL] &&
		      sel[TR_RECOMPUTE_NONE] == full[TR_RECOMPUTE_NONE] &&
		      sel[TR_RECOMPUTE_SELECTIVE] == full[TR_RECOMPUTE_SELECTIVE]);
		char mem[128];
		snprintf(mem, sizeof(mem),
			 "memory { recompute: RECOMPUTE_FULL selective_layers: 1 max_bytes: %zu }",
			 full[TR_RECOMPUTE_FULL]);
		Traind__JobSpec *s = spec_with("rc-sel", model, data, "micro_batch: 2", "", mem);
		CHECK_EQ_INT(tr_method_plan_opts(s, &cfg, 2, 16, &po, &eb), TD_ERANGE);
		CHECK_CONTAINS(eb.msg, "with recompute full, memory.selective_layers 1 at micro-batch");
		rpc_jobspec_free(s);
		/* unset, FULL under a bound takes the most selective layers that
		 * fit: one at its plan's bytes, none a byte under them or where
		 * the spec says 0 */
		const struct {
			size_t max;
			const char *sel;
			int want;
		} bound[] = {
			{sel[TR_RECOMPUTE_FULL], "", 1},
			{sel[TR_RECOMPUTE_FULL] - 1, "", 0},
			{sel[TR_RECOMPUTE_FULL], "selective_layers: 0", 0},
		};
		for (size_t b = 0; b < sizeof(bound) / sizeof(bound[0]); b++) {
			snprintf(mem, sizeof(mem), "memory { recompute: RECOMPUTE_FULL max_bytes: %zu %s }",
				 bound[b].max, bound[b].sel);
			s = spec_with("rc-sel", model, data, "micro_batch: 2", "", mem);
			CHECK_EQ_INT(tr_method_plan_opts(s, &cfg, 2, 16, &po, &eb), TD_OK);
			CHECK_MSG(po.recompute == TR_RECOMPUTE_FULL && po.selective_layers == bound[b].want,
				  "%s: recompute %s, %d selective layers (want %d)", mem,
				  tr_recompute_name(po.recompute), po.selective_layers, bound[b].want);
			rpc_jobspec_free(s);
		}
		snprintf(mem, sizeof(mem), "memory { recompute: RECOMPUTE_FULL selective_layers: %d }",
			 cfg.num_layers + 1);
		s = spec_with("rc-sel", model, data, "micro_batch: 2", "", mem);
		struct tr_plan p;
		CHECK_EQ_INT(tr_method_plan_opts(s, &cfg, 2, 16, &po, &eb), TD_OK);
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_EINVAL);
		CHECK_CONTAINS(eb.msg, "selective layers (memory.selective_layers: 0 to the model's");
		rpc_jobspec_free(s);
	}
	for (size_t i = 1; i < NCASES - 1; i++) {
		CHECK_MSG(r[i].last_loss == r[0].last_loss, "%s: loss %.17g, none's %.17g", cases[i].name,
			  r[i].last_loss, r[0].last_loss);
		char a[512], b[512];
		snprintf(a, sizeof(a), "%s/%s", tmp, cases[i].name);
		snprintf(b, sizeof(b), "%s/%s", tmp, cases[0].name);
		double md;
		CHECK_EQ_INT(diff_models(a, b, &md), 0);
	}
}

static void test_loss_falls(const char *model, const char *data)
{
	Traind__JobSpec *s = spec("falls", model, data, "max_steps: 30 micro_batch: 4 lr: 3e-3", "");
	struct tr_train_result r;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(train(s, 0, &r, &eb), TD_OK);
	CHECK_MSG(r.last_loss < r.first_loss - 0.5, "loss %.4f -> %.4f did not fall by 0.5",
		  r.first_loss, r.last_loss);
	rpc_jobspec_free(s);
}

static void test_plan_equals_allocation(void)
{
	static const char *const models[] = {"qwen2", "llama", "qwen3"};
	for (size_t i = 0; i < 3 * TR_RECOMPUTE_COUNT; i++) {
		const enum tr_recompute rc = (enum tr_recompute)(i / 3);
		char path[512];
		snprintf(path, sizeof(path), "%s/%s/config.json", fx, models[i % 3]);
		struct tr_model_config cfg;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(tr_config_load(&cfg, path, &eb), TD_OK);
		struct gpu_backend *be = NULL;
		CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
		struct tr_model *m = NULL;
		struct tr_plan_opts po = {.B = 3, .T = 20, .recompute = rc};
		CHECK_EQ_INT(tr_model_new(&m, be, &cfg, &po, &eb), TD_OK);
		const struct tr_plan *p = tr_model_plan(m);
		CHECK_EQ_INT(be->bytes_in_use, tr_plan_total_bytes(p));
		CHECK_EQ_INT(be->host_bytes_in_use, tr_plan_host_bytes(p)); /* FULL_OFFLOAD's, else 0 */
		/* A whole step allocates nothing beyond the plan. */
		snprintf(path, sizeof(path), "%s/%s", fx, models[i % 3]);
		struct tr_weights *w = NULL;
		CHECK_EQ_INT(tr_weights_open(&w, path, &eb), TD_OK);
		CHECK_EQ_INT(tr_model_load(m, w, &eb), TD_OK);
		int32_t ids[60];
		for (int k = 0; k < 60; k++)
			ids[k] = (k * 37 + 11) % cfg.vocab_size;
		double ls;
		int64_t nv;
		CHECK_EQ_INT(tr_model_forward(m, ids, ids, &ls, &nv, &eb), TD_OK);
		CHECK_EQ_INT(nv, 3 * 19);
		tr_model_backward(m, 1.0f / (float)nv);
		tr_model_clip_grads(m, 1.0);
		struct tr_adamw h = {0.9f, 0.999f, 1e-8f, 0.01f};
		tr_model_adamw(m, &h, 1e-3f, 1);
		CHECK_EQ_INT(be->bytes_peak, tr_plan_total_bytes(p));
		CHECK_EQ_INT(be->host_bytes_peak, tr_plan_host_bytes(p));
		/* Every parameter the file has is in the plan, with its size. */
		size_t numel = 0;
		for (size_t k = 0; k < tr_weights_count(w); k++)
			numel += (size_t)tr_weights_at(w, k)->numel;
		CHECK_EQ_INT(numel, p->numel_params);
		tr_weights_close(w);
		tr_model_free(m);
		CHECK_EQ_INT(be->bytes_in_use, 0);
		gpu_backend_free(be);
	}
}

/* The qwen2 fixture (its config and weights) and 48 token ids (B2 x T24),
 * for the tests that hold a step's parts to the whole. */
struct rows_case {
	struct tr_model_config cfg;
	struct tr_weights *w;
	int32_t ids[2 * 24];
};

static void rows_case_open(struct rows_case *rc)
{
	char path[512];
	struct td_errbuf eb = {{0}};
	snprintf(path, sizeof(path), "%s/qwen2/config.json", fx);
	CHECK_EQ_INT(tr_config_load(&rc->cfg, path, &eb), TD_OK);
	snprintf(path, sizeof(path), "%s/qwen2", fx);
	rc->w = NULL;
	CHECK_EQ_INT(tr_weights_open(&rc->w, path, &eb), TD_OK);
	for (int k = 0; k < 48; k++)
		rc->ids[k] = (k * 131 + 7) % rc->cfg.vocab_size;
}

/* One forward and backward of the case under po on a CPU backend with
 * rowmatmul.h's matmuls (fused: the head's backward in the forward): the
 * loss, the trainable gradients (*g, malloc'd, *numel floats) and the
 * plan's logits_rows and mlp_rows. */
static double rows_case_step(const struct rows_case *rc, const struct tr_plan_opts *po, bool fused,
			     float **g, size_t *numel, int *logits_rows, int *mlp_rows)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	rowmatmul_install(be);
	struct tr_model *m = NULL;
	CHECK_EQ_INT(tr_model_new(&m, be, &rc->cfg, po, &eb), TD_OK);
	const struct tr_plan *p = tr_model_plan(m);
	*logits_rows = p->logits_rows;
	*mlp_rows = p->mlp_rows;
	CHECK_EQ_INT(tr_model_load(m, rc->w, &eb), TD_OK);
	int64_t nv;
	double loss = 0.0;
	tr_model_zero_grad(m);
	const float dloss = 1.0f / (float)(2 * 23); /* every position but each row's last */
	if (fused)
		tr_model_fuse_head_backward(m, dloss);
	CHECK_EQ_INT(tr_model_forward(m, rc->ids, rc->ids, &loss, &nv, &eb), TD_OK);
	CHECK_EQ_INT(nv, 2 * 23);
	tr_model_backward(m, dloss);
	*numel = p->numel_trainable;
	*g = malloc(*numel * sizeof(float));
	for (size_t i = 0; i < p->nparams; i++)
		if (p->params[i].trainable)
			tr_model_get_grad(m, &p->params[i], *g + p->params[i].goffset);
	tr_model_free(m);
	gpu_backend_free(be);
	return loss;
}

/* A head computed in chunks of rows (plan.logits_rows < N, with a remainder)
 * gives the loss and every gradient of the whole-logits head. The head's
 * backward fused into the forward (tr_model_fuse_head_backward) gives the
 * same bits as the separate backward, chunked or not. The matmuls are the
 * row-wise ones of rowmatmul.h, which do not round a row differently in a
 * call of 5 rows than in one of 48 (OpenBLAS may, by shape, thread count and
 * core type): the chunked pass then performs the whole pass's float
 * operations, so every comparison is for equal bits. */
static void test_chunked_head(void)
{
	struct rows_case rc;
	rows_case_open(&rc);
	float *g[4] = {NULL, NULL, NULL, NULL};
	double loss[4];
	size_t numel = 0;
	for (int v = 0; v < 4; v++) {
		const bool chunked = v & 1, fused = v & 2;
		/* 5 rows a chunk: 48 = 9 x 5 + 3 */
		struct tr_plan_opts po = {.B = 2, .T = 24,
					  .logits_chunk_floats = chunked ? 5 * (size_t)rc.cfg.vocab_size : 0};
		int lrows, mrows;
		loss[v] = rows_case_step(&rc, &po, fused, &g[v], &numel, &lrows, &mrows);
		CHECK_EQ_INT(lrows, chunked ? 5 : 48);
	}
	CHECK_MSG(loss[1] == loss[0], "chunked head: loss %.17g vs %.17g", loss[1], loss[0]);
	CHECK_MSG(memcmp(g[1], g[0], numel * sizeof(float)) == 0,
		  "chunked head: gradients differ from the whole head's");
	for (int v = 0; v < 2; v++) {
		CHECK_MSG(loss[v + 2] == loss[v], "fused head: loss %.17g vs %.17g", loss[v + 2], loss[v]);
		CHECK_MSG(memcmp(g[v + 2], g[v], numel * sizeof(float)) == 0,
			  "fused head (%s): gradients differ from the separate backward",
			  v ? "chunked" : "whole");
	}
	for (int v = 0; v < 4; v++)
		free(g[v]);
	tr_weights_close(rc.w);
}

/* The MLP's backward in parts of rows (plan.mlp_rows < N: three parts of 16
 * of 48 rows, 40 then 8, and the plan's own two of 24 for this fixture on
 * the CPU) gives the loss and every gradient of whole rows (forced: 48):
 * each part's d(h), d(gate) and d(up), its input gradients, its weight
 * gradients added onto the last part's. With rowmatmul.h's matmuls (a
 * weight gradient one row's contribution at a time, in row order) the parts
 * perform the whole pass's float operations, so the comparison is for
 * equal bits. Parts are what a plan keeps where whole rows would take more
 * scratch (train/plan.c: tr_plan_build). */
static void test_mlp_parts(void)
{
	struct rows_case rc;
	rows_case_open(&rc);
	static const int parts[] = {48, 16, 40, 0};
	float *g[4] = {NULL, NULL, NULL, NULL};
	double loss[4];
	int rows[4];
	size_t numel = 0;
	for (int v = 0; v < 4; v++) {
		struct tr_plan_opts po = {.B = 2, .T = 24, .mlp_rows = parts[v]};
		int lrows;
		loss[v] = rows_case_step(&rc, &po, false, &g[v], &numel, &lrows, &rows[v]);
		CHECK_EQ_INT(rows[v], parts[v] ? parts[v] : 24);
	}
	for (int v = 1; v < 4; v++) {
		CHECK_MSG(loss[v] == loss[0], "MLP in parts of %d rows: loss %.17g vs %.17g", rows[v],
			  loss[v], loss[0]);
		CHECK_MSG(memcmp(g[v], g[0], numel * sizeof(float)) == 0,
			  "MLP in parts of %d rows: gradients differ from whole rows'", rows[v]);
	}
	/* a part that is not a multiple of 8 rows is refused, by name */
	struct td_errbuf eb = {{0}};
	struct tr_plan bad;
	struct tr_plan_opts bo = {.B = 2, .T = 24, .mlp_rows = 12};
	CHECK_EQ_INT(tr_plan_build(&bad, &rc.cfg, &bo, &eb), TD_EINVAL);
	CHECK(strstr(eb.msg, "MLP") != NULL);
	for (int v = 0; v < 4; v++)
		free(g[v]);
	tr_weights_close(rc.w);
}

/* Published parameter counts of real models, from their configs alone. */
static void test_plan_real_shapes(void)
{
	static const struct {
		const char *json;
		size_t params;
	} cases[] = {
		{"{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":896,\"intermediate_size\":4864,"
		 "\"num_hidden_layers\":24,\"num_attention_heads\":14,\"num_key_value_heads\":2,"
		 "\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true,"
		 "\"max_position_embeddings\":32768,\"torch_dtype\":\"bfloat16\"}",
		 494032768}, /* Qwen2-0.5B */
		{"{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":1536,\"intermediate_size\":8960,"
		 "\"num_hidden_layers\":28,\"num_attention_heads\":12,\"num_key_value_heads\":2,"
		 "\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true,"
		 "\"max_position_embeddings\":131072,\"torch_dtype\":\"bfloat16\"}",
		 1543714304}, /* Qwen2-1.5B */
		{"{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,\"intermediate_size\":14336,"
		 "\"num_hidden_layers\":32,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
		 "\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,\"tie_word_embeddings\":false,"
		 "\"max_position_embeddings\":8192,\"torch_dtype\":\"bfloat16\"}",
		 8030261248}, /* Meta-Llama-3-8B */
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct tr_model_config cfg;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(tr_config_parse(&cfg, cases[i].json, "case", &eb), TD_OK);
		struct tr_plan p;
		struct tr_plan_opts po = {.B = 8, .T = 1024};
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
		CHECK_EQ_INT(p.numel_params, cases[i].params);
		/* Weights, grads and two moments in fp32: 16 bytes a parameter at least. */
		CHECK(tr_plan_total_bytes(&p) > 16 * cases[i].params);
		tr_plan_fini(&p);
	}
}

/* The fused attention backward's dS room (train/plan.c: scratch.att_ds): at
 * head size 128 with kv groups in the bf16 mode, a view from dq on over dq,
 * dk and dv (which the packed backward does not write) and at most what
 * phase 1 leaves below the region's largest phase: inside
 * scratch.layer_backward, clear of d(y) and datt, which that backward reads
 * and writes. Llama-3-8B's shape (4 layers, B4 x T2048, the benchmark's) and
 * Qwen2-0.5B's (head size 64: none). */
static void test_plan_attention_room(void)
{
	static const char *llama = "{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,"
				   "\"intermediate_size\":14336,\"num_hidden_layers\":4,\"num_attention_heads\":32,"
				   "\"num_key_value_heads\":8,\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,"
				   "\"tie_word_embeddings\":false,\"max_position_embeddings\":8192}";
	static const char *qwen2 = "{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":896,"
				   "\"intermediate_size\":4864,\"num_hidden_layers\":24,\"num_attention_heads\":14,"
				   "\"num_key_value_heads\":2,\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,"
				   "\"tie_word_embeddings\":true,\"max_position_embeddings\":32768}";
	struct td_errbuf eb = {{0}};
	struct tr_model_config cfg;
	CHECK_EQ_INT(tr_config_parse(&cfg, llama, "llama", &eb), TD_OK);
	struct tr_plan p;
	struct tr_plan_opts po = {.B = 4, .T = 2048, .gemm_bf16 = true, .attention_lse = true};
	CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
	const struct tr_plan_buf *ds = tr_plan_find(&p, "scratch.att_ds");
	const struct tr_plan_buf *dq = tr_plan_find(&p, "scratch.dq"), *dk = tr_plan_find(&p, "scratch.dk");
	const struct tr_plan_buf *dv = tr_plan_find(&p, "scratch.dv"), *dy = tr_plan_find(&p, "scratch.dy");
	const struct tr_plan_buf *datt = tr_plan_find(&p, "scratch.datt");
	const struct tr_plan_buf *reg = tr_plan_find(&p, "scratch.layer_backward");
	CHECK(ds && dq && dk && dv && dy && datt && reg);
	if (ds && dq && dk && dv && dy && datt && reg) {
		CHECK_EQ_INT(ds->offset, dq->offset);
		CHECK(ds->bytes >= dq->bytes + dk->bytes + dv->bytes);
		CHECK(dk->offset > dq->offset && dv->offset > dk->offset && dv->offset + dv->bytes <= ds->offset + ds->bytes);
		CHECK(ds->offset >= reg->offset && ds->offset + ds->bytes <= reg->offset + reg->bytes);
		for (const struct tr_plan_buf *o = dy; o; o = o == dy ? datt : NULL)
			CHECK(o->offset >= ds->offset + ds->bytes || o->offset + o->bytes <= ds->offset);
	}
	tr_plan_fini(&p);
	CHECK_EQ_INT(tr_config_parse(&cfg, qwen2, "qwen2", &eb), TD_OK);
	po = (struct tr_plan_opts){.B = 8, .T = 1024, .gemm_bf16 = true, .attention_lse = true};
	CHECK_EQ_INT(tr_plan_build(&p, &cfg, &po, &eb), TD_OK);
	CHECK(tr_plan_find(&p, "scratch.att_ds") == NULL);
	tr_plan_fini(&p);
}

/* transformers' get_{constant,linear,cosine}_schedule_with_warmup multipliers for
 * warmup 2, 10 steps (values from the closed forms in transformers/optimization.py). */
static void test_schedules(void)
{
	Traind__Hyper h = TRAIND__HYPER__INIT;
	h.lr = 1.0;
	h.warmup_steps = 2;
	h.has_warmup_steps = 1;
	static const struct {
		Traind__Schedule sched;
		uint64_t s;
		double want;
	} cases[] = {
		{TRAIND__SCHEDULE__SCHEDULE_COSINE, 0, 0.0},
		{TRAIND__SCHEDULE__SCHEDULE_COSINE, 1, 0.5},
		{TRAIND__SCHEDULE__SCHEDULE_COSINE, 2, 1.0},
		{TRAIND__SCHEDULE__SCHEDULE_COSINE, 4, 0.853553390593}, /* 0.5(1+cos(pi/4)) */
		{TRAIND__SCHEDULE__SCHEDULE_COSINE, 6, 0.5},
		{TRAIND__SCHEDULE__SCHEDULE_COSINE, 9, 0.038060233744}, /* 0.5(1+cos(7pi/8)) */
		{TRAIND__SCHEDULE__SCHEDULE_LINEAR, 1, 0.5},
		{TRAIND__SCHEDULE__SCHEDULE_LINEAR, 6, 0.5},
		{TRAIND__SCHEDULE__SCHEDULE_LINEAR, 9, 0.125},
		{TRAIND__SCHEDULE__SCHEDULE_CONSTANT, 1, 0.5},
		{TRAIND__SCHEDULE__SCHEDULE_CONSTANT, 9, 1.0},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		h.schedule = cases[i].sched;
		/* tr_lr_at computes in double; the wanted values are written
		 * to 12 significant digits */
		CHECK_NEAR(tr_lr_at(&h, cases[i].s, 10), cases[i].want, 1e-12);
	}
}

static void test_bad_data(const char *model)
{
	char path[512];
	static const struct {
		const char *name;
		uint32_t ids[8];
		size_t bytes;
		td_err code;
		const char *msg;
	} cases[] = {
		{"empty", {0}, 0, TD_EFORMAT, "not a token file"},
		{"odd", {1, 2}, 7, TD_EFORMAT, "multiple of 4"},
		{"vocab", {1, 2, 3, 900, 4}, 20, TD_ERANGE, "token 3 (byte offset 12) is 900"},
		{"short", {1, 2, 3}, 12, TD_EINVAL, "fewer than one sequence"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		snprintf(path, sizeof(path), "%s/%s.tokens", tmp, cases[i].name);
		write_file(path, cases[i].ids, cases[i].bytes);
		struct tr_data *d = NULL;
		struct td_errbuf eb = {{0}};
		CHECK_EQ_INT(tr_data_open_tokens(&d, path, 16, 512, 1, &eb), cases[i].code);
		CHECK_CONTAINS(eb.msg, cases[i].name);
		CHECK_CONTAINS(eb.msg, cases[i].msg);
		CHECK(d == NULL);
	}
	snprintf(path, sizeof(path), "%s/missing.tokens", tmp);
	struct tr_data *d = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_data_open_tokens(&d, path, 16, 512, 1, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "missing.tokens");
	(void)model;
}

/* A model dir whose weights contradict its config fails to load, naming the tensor. */
static void test_bad_weights(const char *model)
{
	struct tr_weights *w = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_weights_open(&w, model, &eb), TD_OK);
	char cfgpath[512];
	snprintf(cfgpath, sizeof(cfgpath), "%s/config.json", model);
	struct tr_model_config cfg;
	CHECK_EQ_INT(tr_config_load(&cfg, cfgpath, &eb), TD_OK);

	static const struct {
		const char *name;
		const char *drop;     /* tensor left out */
		const char *reshape;  /* tensor given a wrong shape */
		const char *extra;    /* tensor added */
		td_err code;
		const char *msg;
	} cases[] = {
		{"missing", "model.layers.1.mlp.up_proj.weight", NULL, NULL, TD_EFORMAT,
		 "missing tensor 'model.layers.1.mlp.up_proj.weight'"},
		{"shape", NULL, "model.layers.0.self_attn.k_proj.weight", NULL, TD_EMISMATCH,
		 "has shape [64, 32], the config implies [32, 64]"},
		{"extra", NULL, NULL, "model.layers.2.mlp.up_proj.weight", TD_EMISMATCH,
		 "is not part of a qwen2 model"},
	};
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		size_t n = tr_weights_count(w);
		struct tr_save_tensor *ts = calloc(n + 1, sizeof(*ts));
		float **bufs = calloc(n + 1, sizeof(*bufs));
		size_t k = 0;
		for (size_t i = 0; i < n; i++) {
			const struct tr_st_tensor *t = tr_weights_at(w, i);
			if (cases[c].drop && strcmp(t->name, cases[c].drop) == 0)
				continue;
			bufs[k] = malloc(t->numel * sizeof(float));
			tr_st_to_f32(bufs[k], t, &eb);
			ts[k].name = t->name;
			ts[k].ndim = t->ndim;
			memcpy(ts[k].shape, t->shape, sizeof(ts[k].shape));
			if (cases[c].reshape && strcmp(t->name, cases[c].reshape) == 0) {
				ts[k].shape[0] = t->shape[1];
				ts[k].shape[1] = t->shape[0];
			}
			ts[k].data = bufs[k];
			k++;
			if (cases[c].extra && strcmp(t->name, "model.layers.1.mlp.up_proj.weight") == 0) {
				ts[k] = ts[k - 1];
				ts[k].name = cases[c].extra;
				k++;
			}
		}
		char out[512];
		snprintf(out, sizeof(out), "%s/badw-%s", tmp, cases[c].name);
		CHECK_EQ_INT(tr_modeldir_save(out, model, &cfg, ts, k, TR_DT_F32, 0, &eb), TD_OK);
		struct tr_weights *bw = NULL;
		CHECK_EQ_INT(tr_weights_open(&bw, out, &eb), TD_OK);
		struct gpu_backend *be = NULL;
		gpu_cpu_backend_new(&be, &eb);
		struct tr_model *m = NULL;
		struct tr_plan_opts po = {.B = 1, .T = 8};
		CHECK_EQ_INT(tr_model_new(&m, be, &cfg, &po, &eb), TD_OK);
		memset(eb.msg, 0, sizeof(eb.msg));
		CHECK_EQ_INT(tr_model_load(m, bw, &eb), cases[c].code);
		CHECK_CONTAINS(eb.msg, cases[c].msg);
		tr_model_free(m);
		gpu_backend_free(be);
		tr_weights_close(bw);
		for (size_t i = 0; i <= n; i++) /* n + 1 slots: the extra case shifts them */
			free(bufs[i]);
		free(bufs);
		free(ts);
	}
	tr_weights_close(w);
}

static void test_bad_ids(const char *model)
{
	char cfgpath[512];
	snprintf(cfgpath, sizeof(cfgpath), "%s/config.json", model);
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_config_load(&cfg, cfgpath, &eb), TD_OK);
	struct gpu_backend *be = NULL;
	gpu_cpu_backend_new(&be, &eb);
	struct tr_model *m = NULL;
	struct tr_plan_opts po = {.B = 1, .T = 4};
	CHECK_EQ_INT(tr_model_new(&m, be, &cfg, &po, &eb), TD_OK);
	int32_t ids[4] = {1, 2, 512, 3}, labels[4] = {1, 2, 3, -7};
	double ls;
	int64_t nv;
	CHECK_EQ_INT(tr_model_forward(m, ids, NULL, &ls, &nv, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "input_ids[0][2] = 512");
	ids[2] = 5;
	CHECK_EQ_INT(tr_model_forward(m, ids, labels, &ls, &nv, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "labels[0][3] = -7");
	tr_model_free(m);
	gpu_backend_free(be);
}

/* bf16_round_rows on the CPU backend: each row rounded as bf16_round
 * rounds it, into its place in a wider matrix, the columns around it
 * untouched (the fused q, k and v backward's operand, train/model.c). */
static void test_bf16_round_rows(void)
{
	struct gpu_backend *be = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(gpu_cpu_backend_new(&be, &eb), TD_OK);
	if (!be)
		return;
	enum { R = 7, COLS = 5, LD = 12, OFF = 4 };
	float x[R * COLS];
	for (int i = 0; i < R * COLS; i++)
		x[i] = 1.0f / (float)(i + 3) - 0.1f * (float)i;
	gpu_bf16 got[R * LD], want[R * LD];
	for (int i = 0; i < R * LD; i++)
		got[i] = want[i] = 0x7fa5u; /* a NaN no rounding writes */
	for (int r = 0; r < R; r++)
		bf16_round(want + r * LD + OFF, x + r * COLS, COLS);
	gpu_bf16_round_rows(be, got + OFF, LD, x, R, COLS);
	CHECK(memcmp(got, want, sizeof(got)) == 0);
	gpu_backend_free(be);
}

int main(void)
{
	test_bf16_round_rows();
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	snprintf(tmp, sizeof(tmp), "/tmp/td-train-XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 2;
	}
	char model[512], data[512];
	snprintf(model, sizeof(model), "%s/qwen2", fx);
	snprintf(data, sizeof(data), "%s/demo/fortunes.tokens", fx);

	test_schedules();
	test_plan_real_shapes();
	test_plan_attention_room();
	test_plan_equals_allocation();
	test_chunked_head();
	test_mlp_parts();
	test_bad_data(model);
	test_bad_ids(model);
	test_bad_weights(model);
	test_grad_accum(model, data);
	test_resume_bit_identical(model, data);
	test_recompute_job(model, data);
	test_loss_falls(model, data);

	char cmd[600];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
	if (!check_failures_ && system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", tmp);
	return check_status();
}
