/* CPU training throughput: tokens/s of full fine-tuning steps (forward,
 * backward, clip, AdamW) on the CPU backend, for the tiny fixture model and a
 * ~25M-parameter Qwen2-shaped model with random weights.
 *
 * A benchmark, not a test: it prints numbers and asserts nothing about them.
 * bench_cpu [--steps N] [--only fixture|25m] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/backend.h"
#include "train/model.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double uniform(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return (double)(rng >> 11) / 9007199254740992.0;
}
static float normal(void)
{
	double u = uniform(), v = uniform();
	return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(2 * M_PI * v));
}

static int run(const char *label, const char *config_json, int B, int T, int steps)
{
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	if (tr_config_parse(&cfg, config_json, label, &eb) != TD_OK) {
		fprintf(stderr, "%s: %s\n", label, eb.msg);
		return 1;
	}
	struct gpu_backend *be = NULL;
	struct tr_model *m = NULL;
	struct tr_plan_opts po = {.B = B, .T = T};
	if (gpu_cpu_backend_new(&be, &eb) || tr_model_new(&m, be, &cfg, &po, &eb)) {
		fprintf(stderr, "%s: %s\n", label, eb.msg);
		return 1;
	}
	const struct tr_plan *p = tr_model_plan(m);
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		float *h = malloc(pp->numel * sizeof(float));
		for (size_t k = 0; k < pp->numel; k++)
			h[k] = pp->ndim == 1 ? 1.0f : 0.02f * normal();
		tr_model_set_param(m, pp, h);
		free(h);
	}
	int32_t *ids = malloc((size_t)B * T * sizeof(int32_t));
	struct tr_adamw hp = {0.9f, 0.999f, 1e-8f, 0.01f};
	double t0 = 0, first = 0, last = 0;
	for (int s = 0; s <= steps; s++) {
		if (s == 1)
			t0 = now_s(); /* step 0 warms caches and BLAS threads */
		for (int k = 0; k < B * T; k++)
			ids[k] = (int32_t)(uniform() * cfg.vocab_size);
		double ls;
		int64_t nv;
		tr_model_zero_grad(m);
		if (tr_model_forward(m, ids, ids, &ls, &nv, &eb) != TD_OK) {
			fprintf(stderr, "%s: %s\n", label, eb.msg);
			return 1;
		}
		tr_model_backward(m, 1.0f / (float)nv);
		tr_model_clip_grads(m, 1.0);
		tr_model_adamw(m, &hp, 1e-4f, s + 1);
		if (s == 0)
			first = ls / (double)nv;
		last = ls / (double)nv;
	}
	double el = now_s() - t0;
	char mem[32];
	printf("%-8s %11zu params  B=%d T=%-4d  %6.1f ms/step  %9.0f tokens/s  plan %s  loss %.3f -> %.3f\n",
	       label, p->numel_params, B, T, 1e3 * el / steps, (double)steps * B * T / el,
	       tr_fmt_bytes(mem, sizeof(mem), tr_plan_total_bytes(p)), first, last);
	free(ids);
	tr_model_free(m);
	gpu_backend_free(be);
	return 0;
}

int main(int argc, char **argv)
{
	int steps = 10;
	const char *only = NULL;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
			steps = atoi(argv[++i]);
		else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc)
			only = argv[++i];
	}
	/* The shared fixtures' tiny Qwen2: hidden 64, 2 layers, vocab 512. */
	static const char fixture[] =
		"{\"model_type\":\"qwen2\",\"vocab_size\":512,\"hidden_size\":64,\"intermediate_size\":176,"
		"\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
		"\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true}";
	/* ~25.7M parameters: hidden 512, 8 layers, GQA 8/4, vocab 4096, tied. */
	static const char m25[] =
		"{\"model_type\":\"qwen2\",\"vocab_size\":4096,\"hidden_size\":512,\"intermediate_size\":1408,"
		"\"num_hidden_layers\":8,\"num_attention_heads\":8,\"num_key_value_heads\":4,"
		"\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true}";
	int rc = 0;
	if (!only || strcmp(only, "fixture") == 0)
		rc |= run("fixture", fixture, 8, 64, steps * 10);
	if (!only || strcmp(only, "25m") == 0)
		rc |= run("25m", m25, 4, 256, steps);
	return rc;
}
