/* Training throughput and memory: full fine-tune or LoRA steps (forward,
 * backward, clip, AdamW) of a random-init model on a backend.
 *
 * A benchmark, not a test: it prints one JSON line per run (the fields of
 * shared/bench/peer_hf.py's lines, so the two compare line by line) and
 * asserts nothing about the numbers.
 *
 *   bench_train [--backend cpu|cuda]
 *               [--shape fixture|25m|qwen2-0.5b|qwen3-0.6b|qwen2-1.5b|llama3-8b-4l|llama3-8b]
 *               [--batch B] [--seq T] [--steps N] [--warm N] [--lora-rank R]
 *               [--lora-targets qv|all] [--precision fp32|bf16] [--phases]
 *               [--recompute none|selective|full|full-offload] [--qlora]
 *
 * --qlora: with --lora-rank, the frozen projections in NF4 with double
 * quantization (QLoRA).
 *
 * Memory: reserve_gib is the memory plan plus the backend's fixed bytes
 * (workspaces, allocated at its creation); the daemon's lease adds its
 * cuda_context_mib (768 MiB by default) for the context on a GPU.
 * used_gib is the measured footprint: those fixed bytes plus what the device
 * lost between the backend's creation and the lowest free memory seen after
 * any step (cuMemGetInfo on a GPU; the backend's own count on the CPU). The
 * CUDA context itself is in neither. host_gib: the plan's pinned host memory
 * (full-offload's layer inputs), which is in neither either. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/select.h"
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

static const struct {
	const char *name;
	const char *json;
	int B, T;
} shapes[] = {
	/* The shared fixtures' tiny Qwen2. */
	{"fixture",
	 "{\"model_type\":\"qwen2\",\"vocab_size\":512,\"hidden_size\":64,\"intermediate_size\":176,"
	 "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,"
	 "\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true}",
	 8, 64},
	/* ~25.7M parameters: hidden 512, 8 layers, GQA 8/4, vocab 4096. */
	{"25m",
	 "{\"model_type\":\"qwen2\",\"vocab_size\":4096,\"hidden_size\":512,\"intermediate_size\":1408,"
	 "\"num_hidden_layers\":8,\"num_attention_heads\":8,\"num_key_value_heads\":4,"
	 "\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true}",
	 4, 256},
	/* Qwen2-0.5B, as peer_hf.py builds it. */
	{"qwen2-0.5b",
	 "{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":896,\"intermediate_size\":4864,"
	 "\"num_hidden_layers\":24,\"num_attention_heads\":14,\"num_key_value_heads\":2,"
	 "\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true,"
	 "\"max_position_embeddings\":4096}",
	 8, 1024},
	/* Qwen3-0.6B (Qwen/Qwen3-0.6B's config.json): head size 128, q/k norms. */
	{"qwen3-0.6b",
	 "{\"model_type\":\"qwen3\",\"vocab_size\":151936,\"hidden_size\":1024,"
	 "\"intermediate_size\":3072,\"num_hidden_layers\":28,\"num_attention_heads\":16,"
	 "\"num_key_value_heads\":8,\"head_dim\":128,\"rope_theta\":1000000.0,"
	 "\"rms_norm_eps\":1e-6,\"tie_word_embeddings\":true,\"max_position_embeddings\":40960}",
	 8, 1024},
	/* Qwen2-1.5B (Qwen/Qwen2-1.5B's config.json): head size 128, 12/2 heads. */
	{"qwen2-1.5b",
	 "{\"model_type\":\"qwen2\",\"vocab_size\":151936,\"hidden_size\":1536,"
	 "\"intermediate_size\":8960,\"num_hidden_layers\":28,\"num_attention_heads\":12,"
	 "\"num_key_value_heads\":2,\"rope_theta\":1000000.0,\"rms_norm_eps\":1e-6,"
	 "\"tie_word_embeddings\":true,\"max_position_embeddings\":32768}",
	 4, 1024},
	/* Llama-3-8B's shapes (meta-llama/Meta-Llama-3-8B's config.json) with 4 of its 32
	 * layers: the big GEMMs, 32/8 heads of 128, the 128k vocabulary, untied head. */
	{"llama3-8b-4l",
	 "{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,"
	 "\"intermediate_size\":14336,\"num_hidden_layers\":4,\"num_attention_heads\":32,"
	 "\"num_key_value_heads\":8,\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,"
	 "\"tie_word_embeddings\":false,\"max_position_embeddings\":8192}",
	 2, 2048},
	/* All 32 layers of Llama-3-8B, at peer_big.py's B4 x T2048 (the memory
	 * issue's shape: LoRA r16 on the seven projections). */
	{"llama3-8b",
	 "{\"model_type\":\"llama\",\"vocab_size\":128256,\"hidden_size\":4096,"
	 "\"intermediate_size\":14336,\"num_hidden_layers\":32,\"num_attention_heads\":32,"
	 "\"num_key_value_heads\":8,\"rope_theta\":500000.0,\"rms_norm_eps\":1e-5,"
	 "\"tie_word_embeddings\":false,\"max_position_embeddings\":8192}",
	 4, 2048},
};

int main(int argc, char **argv)
{
	const char *backend = "cpu", *shape = "25m", *targets = "qv";
	int B = 0, T = 0, steps = 10, warm = 2, rank = 0;
	bool bf16 = false, phases = false, qlora = false;
	enum tr_recompute recompute = TR_RECOMPUTE_NONE;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--phases")) {
			phases = true;
			continue;
		}
		if (!strcmp(a, "--qlora")) {
			qlora = true;
			continue;
		}
		if (!v) {
			fprintf(stderr, "bench_train: %s needs a value\n", a);
			return 2;
		}
		i++;
		if (!strcmp(a, "--backend")) backend = v;
		else if (!strcmp(a, "--shape")) shape = v;
		else if (!strcmp(a, "--batch")) B = atoi(v);
		else if (!strcmp(a, "--seq")) T = atoi(v);
		else if (!strcmp(a, "--steps")) steps = atoi(v);
		else if (!strcmp(a, "--warm")) warm = atoi(v);
		else if (!strcmp(a, "--lora-rank")) rank = atoi(v);
		else if (!strcmp(a, "--lora-targets")) targets = v;
		else if (!strcmp(a, "--precision")) bf16 = !strcmp(v, "bf16");
		else if (!strcmp(a, "--recompute")) {
			int r = 0;
			while (r < TR_RECOMPUTE_COUNT && strcmp(tr_recompute_name((enum tr_recompute)r), v))
				r++;
			if (r == TR_RECOMPUTE_COUNT) {
				fprintf(stderr, "bench_train: --recompute none|selective|full|full-offload, not %s\n", v);
				return 2;
			}
			recompute = (enum tr_recompute)r;
		}
		else {
			fprintf(stderr, "bench_train: unknown option %s\n", a);
			return 2;
		}
	}
	size_t si = 0;
	while (si < sizeof(shapes) / sizeof(shapes[0]) && strcmp(shapes[si].name, shape))
		si++;
	if (si == sizeof(shapes) / sizeof(shapes[0])) {
		fprintf(stderr, "bench_train: unknown shape %s (fixture, 25m, qwen2-0.5b, qwen3-0.6b, qwen2-1.5b, llama3-8b-4l, llama3-8b)\n", shape);
		return 2;
	}
	if (!B) B = shapes[si].B;
	if (!T) T = shapes[si].T;

	struct td_errbuf eb = {{0}};
	struct tr_model_config cfg;
	if (tr_config_parse(&cfg, shapes[si].json, shape, &eb) != TD_OK) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	struct gpu_backend *be = NULL;
	if (gpu_backend_open(&be, backend, &eb) != TD_OK) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	if (gpu_set_bf16(be, bf16, &eb) != TD_OK) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	size_t free0 = 0, total = 0, free_min;
	gpu_mem_info(be, &free0, &total);
	free_min = free0;

	struct tr_plan_opts po = {.B = B, .T = T, .recompute = recompute};
	if (rank > 0) {
		po.lora_rank = rank;
		po.lora_alpha = 2.0 * rank;
		po.lora_targets = strcmp(targets, "all") == 0 ? (1u << TR_LIN_COUNT) - 1
							      : (1u << TR_LIN_Q) | (1u << TR_LIN_V);
		if (qlora) {
			po.base_quant = TR_QUANT_NF4;
			po.nf4_double_quant = true;
		}
	} else if (qlora) {
		fprintf(stderr, "bench_train: --qlora needs --lora-rank\n");
		return 2;
	}
	struct tr_model *m = NULL;
	if (tr_model_new(&m, be, &cfg, &po, &eb) != TD_OK) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	const struct tr_plan *p = tr_model_plan(m);
	/* Random init from a pool of normals, read at a different offset per
	 * tensor: drawing 8e9 of them one by one would take minutes. */
	enum { POOL = 1 << 20 };
	float *pool = malloc(POOL * sizeof(float));
	for (int k = 0; k < POOL; k++)
		pool[k] = 0.02f * normal();
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		float *h = malloc(pp->numel * sizeof(float));
		const size_t off = (size_t)(uniform() * POOL);
		for (size_t k = 0; k < pp->numel; k++)
			h[k] = pp->ndim == 1 ? 1.0f : pool[(k + off) & (POOL - 1)];
		if (tr_model_set_param(m, pp, h) != TD_OK) {
			fprintf(stderr, "bench_train: cannot set %s\n", pp->name);
			return 1;
		}
		free(h);
	}
	free(pool);
	int32_t *ids = malloc((size_t)B * T * sizeof(int32_t));
	struct tr_adamw hp = {0.9f, 0.999f, 1e-8f, 0.01f};
	double t0 = now_s(), loss = 0;
	/* --phases: a sync after each phase and its share of the step (the
	 * syncs cost a little; tokens/s is then measured without them). */
	double ph[4] = {0, 0, 0, 0};
	for (int s = 0; s < warm + steps; s++) {
		if (s == warm) {
			if (gpu_sync(be, &eb) != TD_OK)
				break;
			t0 = now_s();
		}
		for (int k = 0; k < B * T; k++)
			ids[k] = (int32_t)(uniform() * cfg.vocab_size);
		double ls;
		int64_t nv;
		double tp = now_s();
		tr_model_zero_grad(m);
		/* As the trainer: every position but each row's last is a target
		 * (ids are their own labels), so dloss is known before the
		 * forward, which also runs the head's backward. */
		const float dloss = 1.0f / (float)(B * (T - 1));
		tr_model_fuse_head_backward(m, dloss);
		if (tr_model_forward(m, ids, ids, &ls, &nv, &eb) != TD_OK)
			break;
		if (nv != (int64_t)B * (T - 1)) {
			fprintf(stderr, "bench_train: %lld valid positions, expected %lld\n",
				(long long)nv, (long long)B * (T - 1));
			return 1;
		}
		if (phases && s >= warm) {
			ph[0] += now_s() - tp; /* forward (with the head's backward) blocks for the loss */
			tp = now_s();
		}
		tr_model_backward(m, dloss);
		if (phases && s >= warm) {
			gpu_sync(be, &eb);
			ph[1] += now_s() - tp;
			tp = now_s();
		}
		tr_model_clip_grads(m, 1.0); /* blocking: the step's end */
		if (phases && s >= warm) {
			ph[2] += now_s() - tp;
			tp = now_s();
		}
		tr_model_adamw(m, &hp, 1e-5f, s + 1);
		if (phases && s >= warm) {
			gpu_sync(be, &eb);
			ph[3] += now_s() - tp;
		}
		loss = ls / (double)nv;
		size_t fr, tot;
		if (gpu_mem_info(be, &fr, &tot) == TD_OK && fr < free_min)
			free_min = fr;
	}
	td_err e = gpu_sync(be, &eb);
	double dt = (now_s() - t0) / steps;
	if (e != TD_OK || eb.msg[0]) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	printf("{\"name\": \"traind-%s%s\", \"precision\": \"%s\", \"recompute\": \"%s\", \"backend\": \"%s\", \"device\": \"%s\", \"batch\": %d, \"seq\": %d, "
	       "\"layers\": %d, \"params_total\": %zu, \"params_trainable\": %zu, \"ms_per_step\": %.2f, "
	       "\"tokens_per_s\": %.1f, \"plan_gib\": %.3f, \"reserve_gib\": %.3f, \"used_gib\": %.3f, "
	       "\"host_gib\": %.3f, \"loss\": %.4f}\n",
	       rank ? (qlora ? "qlora-" : "lora-") : "full-", rank ? targets : bf16 ? "bf16" : "fp32", bf16 ? "bf16" : "fp32",
	       tr_recompute_name(recompute), be->ops->name, be->device, B, T,
	       cfg.num_layers, p->numel_params, p->numel_trainable, dt * 1e3, (double)B * T / dt,
	       (double)tr_plan_total_bytes(p) / (1 << 30),
	       (double)(tr_plan_total_bytes(p) + be->fixed_bytes) / (1 << 30),
	       (double)(be->fixed_bytes + (strcmp(backend, "cpu") ? free0 - free_min : be->bytes_peak)) / (1 << 30),
	       (double)tr_plan_host_bytes(p) / (1 << 30), loss);
	if (phases)
		fprintf(stderr, "phases (ms/step): forward+loss %.1f  backward %.1f  clip %.1f  adamw %.1f\n",
			1e3 * ph[0] / steps, 1e3 * ph[1] / steps, 1e3 * ph[2] / steps, 1e3 * ph[3] / steps);
	free(ids);
	tr_model_free(m);
	gpu_backend_free(be);
	return 0;
}
