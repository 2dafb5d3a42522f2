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
 *               [--recompute none|selective|full|full-offload [--selective-layers S]]
 *               [--qlora] [--clip NORM]
 *               [--gpus N [--comm auto|host|nccl] [--shard none|optimizer|gradients|parameters]
 *                [--bucket-mfloats M]]
 *
 * --gpus N: data parallel, N ranks (threads of this process) on CUDA
 * devices 0 .. N-1 (the CPU backend: N CPU ranks), each B x T of its own
 * tokens a step, the gradients summed (NCCL on CUDA, by buckets during the
 * backward: train/ddp.h) before clip and AdamW; tokens_per_s counts every
 * rank's (N x B x T a step), used_gib is the largest rank's. --shard
 * optimizer: each rank keeps the AdamW moments of 1/N of the weights and
 * steps them, and the weights are all-gathered after each step
 * (memory.shard OPTIMIZER; the gather is in the "adamw" phase). --shard
 * gradients: the summed gradients too (memory.shard GRADIENTS: each
 * layer's reduced onto its owners during the backward, the rest after it:
 * in the "backward" phase). --shard parameters: the weights too
 * (memory.shard PARAMETERS: each layer's gathered a layer ahead of its use,
 * in the forward and backward phases). --bucket-mfloats M: the unsharded
 * sums' bucket, M million floats (default train/ddp.h's
 * TR_DDP_BUCKET_FLOATS).
 *
 * --phases: each phase's time a step (synchronised at its end), and the
 * backward's host time before that sync (launching its kernels and
 * collectives: where it nears the backward's, the GPU waits for the host).
 *
 * --selective-layers S: under recompute full or full-offload, the first S
 * layers keep what selective keeps (memory.selective_layers); the line's
 * "selective_layers" field says how many.
 *
 * --clip NORM: clip the gradients to this global norm before AdamW
 * (PyTorch's clip_grad_norm_; default 1.0, as shared/bench/peer_hf.py
 * does); 0: no clipping and no norm (AdamW straight after the backward, as
 * peer_big.py and peer_dist.py step, so the runs set beside them do the same
 * work). The line's "clip" field says which.
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
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu/comm.h"
#include "gpu/select.h"
#include "train/ddp.h"
#include "train/model.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* xorshift64; one state per rank. */
static double uniform(uint64_t *rng)
{
	*rng ^= *rng << 13;
	*rng ^= *rng >> 7;
	*rng ^= *rng << 17;
	return (double)(*rng >> 11) / 9007199254740992.0;
}
static float normal(uint64_t *rng)
{
	double u = uniform(rng), v = uniform(rng);
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

/* What every rank runs with (--gpus N: N ranks, threads of this process,
 * one device each, summing their gradients through gpu/comm.h). */
struct bench {
	const char *backend, *targets;
	struct tr_model_config cfg;
	int B, T, steps, warm, lora_rank, gpus;
	bool bf16, phases, qlora;
	double clip;          /* max norm; 0: no clipping (--clip) */
	size_t bucket_floats; /* 0: TR_DDP_BUCKET_FLOATS */
	enum tr_recompute recompute;
	int selective_layers; /* --selective-layers */
	int logits_rows;      /* --logits-rows: the head's chunks (0: the plan's rule) */
	enum tr_shard shard;
	struct gpu_gang *gang;
	enum gpu_comm_kind comm;
};

/* One rank's run and what it measured. */
struct rank_run {
	const struct bench *b;
	int r;
	pthread_t thread;
	td_err e;
	struct td_errbuf eb;
	double dt, loss;
	double ph[5];           /* forward, backward, sum (ranks), clip, adamw: seconds */
	double bwd_host;        /* the backward's calls on the host, before its sync */
	size_t plan_bytes, host_bytes, fixed_bytes, used_bytes;
	int64_t graph_launches; /* the layer stages launched as graphs (gpu/backend.h) */
	size_t numel_params, numel_trainable;
	char backend[16], device[128], comm[32];
	struct tr_ddp_stats st;
};

static td_err rank_fail(struct rank_run *rr, td_err e)
{
	if (rr->b->gang)
		gpu_gang_fail(rr->b->gang, rr->r, e, rr->eb.msg);
	return e;
}

static td_err bench_rank(struct rank_run *rr)
{
	const struct bench *b = rr->b;
	struct td_errbuf *eb = &rr->eb;
	const int B = b->B, T = b->T, steps = b->steps, warm = b->warm;
	struct gpu_backend *be = NULL;
	struct tr_model *m = NULL;
	struct gpu_comm *comm = NULL;
	struct tr_ddp *ddp = NULL;
	int32_t *ids = NULL;
	td_err e = gpu_backend_open_on(&be, b->backend, b->gpus > 1 ? rr->r : -1, eb);
	if (e == TD_OK)
		e = gpu_set_bf16(be, b->bf16, eb);
	if (e != TD_OK)
		return rank_fail(rr, e);
	size_t free0 = 0, total = 0, free_min;
	gpu_mem_info(be, &free0, &total);
	free_min = free0;

	struct tr_plan_opts po = {.B = B, .T = T, .recompute = b->recompute,
				  .selective_layers = b->selective_layers, .shard = b->shard,
				  .logits_rows = b->logits_rows,
				  .shard_ranks = b->gpus > 1 ? b->gpus : 0, .shard_rank = rr->r,
				  .grad_accum = 1 /* a micro-batch a step (a rank) */};
	if (b->lora_rank > 0) {
		po.lora_rank = b->lora_rank;
		po.lora_alpha = 2.0 * b->lora_rank;
		po.lora_targets = strcmp(b->targets, "all") == 0 ? (1u << TR_LIN_COUNT) - 1
								 : (1u << TR_LIN_Q) | (1u << TR_LIN_V);
		if (b->qlora) {
			po.base_quant = TR_QUANT_NF4;
			po.nf4_double_quant = true;
		}
	}
	if ((e = tr_model_new(&m, be, &b->cfg, &po, eb)) != TD_OK) {
		gpu_backend_free(be);
		return rank_fail(rr, e);
	}
	const struct tr_plan *p = tr_model_plan(m);
	/* Random init from a pool of normals, read at a different offset per
	 * tensor: drawing 8e9 of them one by one would take minutes. The same
	 * seed on every rank: the same weights. */
	uint64_t rng = 0x2545F4914F6CDD1Dull;
	enum { POOL = 1 << 20 };
	float *pool = malloc(POOL * sizeof(float));
	for (int k = 0; k < POOL; k++)
		pool[k] = 0.02f * normal(&rng);
	for (size_t i = 0; i < p->nparams && e == TD_OK; i++) {
		const struct tr_param *pp = &p->params[i];
		float *h = malloc(pp->numel * sizeof(float));
		const size_t off = (size_t)(uniform(&rng) * POOL);
		for (size_t k = 0; k < pp->numel; k++)
			h[k] = pp->ndim == 1 ? 1.0f : pool[(k + off) & (POOL - 1)];
		if (tr_model_set_param(m, pp, h) != TD_OK)
			e = td_fail(eb, TD_ENOMEM, "cannot set %s", pp->name);
		free(h);
	}
	free(pool);
	if (e == TD_OK && b->gang) {
		if ((e = gpu_comm_new(&comm, b->gang, rr->r, be, b->comm, eb)) == TD_OK)
			e = tr_ddp_new(&ddp, m, comm, b->bucket_floats, false, eb);
		if (e == TD_OK) /* one micro-batch a rank */
			tr_ddp_set_accum(ddp, b->gpus);
		if (e == TD_OK)
			snprintf(rr->comm, sizeof(rr->comm), "%s", gpu_comm_name(comm));
	}
	/* Each rank its own tokens (its share of a global batch of gpus x B). */
	rng = 0x9E3779B97F4A7C15ull * (uint64_t)(rr->r + 1);
	ids = malloc((size_t)B * T * sizeof(int32_t));
	struct tr_adamw hp = {0.9f, 0.999f, 1e-8f, 0.01f};
	double t0 = now_s(), loss = 0;
	/* --phases: a sync after each phase and its share of the step (the
	 * syncs cost a little; tokens/s is then measured without them). */
	for (int s = 0; s < warm + steps && e == TD_OK; s++) {
		if (s == warm) {
			if ((e = gpu_sync(be, eb)) != TD_OK ||
			    (b->gang && (e = gpu_gang_barrier(b->gang, rr->r, eb)) != TD_OK))
				break;
			t0 = now_s();
		}
		for (int k = 0; k < B * T; k++)
			ids[k] = (int32_t)(uniform(&rng) * b->cfg.vocab_size);
		double ls;
		int64_t nv;
		double tp = now_s();
		bool timed = b->phases && s >= warm;
		tr_model_zero_grad(m);
		/* As the trainer: every position but each row's last is a target
		 * (ids are their own labels), so dloss is known before the
		 * forward, which also runs the head's backward; over the global
		 * batch (gpus x B rows) with several ranks. */
		const float dloss = 1.0f / (float)((int64_t)b->gpus * B * (T - 1));
		if (ddp && (e = tr_ddp_micro_begin(ddp, eb)) != TD_OK)
			break;
		tr_model_fuse_head_backward(m, dloss);
		if ((e = tr_model_forward(m, ids, ids, &ls, &nv, eb)) != TD_OK)
			break;
		if (nv != (int64_t)B * (T - 1)) {
			e = td_fail(eb, TD_EINTERNAL, "%lld valid positions, expected %lld", (long long)nv,
				    (long long)B * (T - 1));
			break;
		}
		if (timed) {
			rr->ph[0] += now_s() - tp; /* forward (with the head's backward) blocks for the loss */
			tp = now_s();
		}
		if (ddp)
			tr_ddp_arm(ddp);
		tr_model_backward(m, dloss);
		if (ddp && (e = tr_ddp_micro_end(ddp, eb)) != TD_OK)
			break;
		if (timed) {
			rr->bwd_host += now_s() - tp;
			gpu_sync(be, eb);
			rr->ph[1] += now_s() - tp;
			tp = now_s();
		}
		if (ddp && (e = tr_ddp_finish(ddp, eb)) != TD_OK)
			break;
		if (timed) {
			rr->ph[2] += now_s() - tp;
			tp = now_s();
		}
		/* --clip 0: no norm either, AdamW next */
		if (b->clip > 0.0 && ddp && tr_ddp_sharded_grads(ddp)) { /* the ranks' parts' norm */
			double norm;
			if ((e = tr_ddp_grad_norm(ddp, &norm, eb)) != TD_OK)
				break;
			tr_model_clip_grads_by(m, b->clip, norm);
		} else if (b->clip > 0.0) {
			tr_model_clip_grads(m, b->clip); /* blocking: the step's end */
		}
		if (timed) {
			rr->ph[3] += now_s() - tp;
			tp = now_s();
		}
		if (ddp) /* sharded: each rank steps its part; the weights made whole */
			e = tr_ddp_step(ddp, &hp, 1e-5f, s + 1, eb);
		else
			tr_model_adamw(m, &hp, 1e-5f, s + 1);
		if (e != TD_OK)
			break;
		if (timed) {
			gpu_sync(be, eb);
			rr->ph[4] += now_s() - tp;
		}
		loss = ls / (double)nv;
		size_t fr, tot;
		if (gpu_mem_info(be, &fr, &tot) == TD_OK && fr < free_min)
			free_min = fr;
	}
	if (e == TD_OK)
		e = gpu_sync(be, eb);
	if (e == TD_OK && b->gang)
		e = gpu_gang_barrier(b->gang, rr->r, eb);
	rr->dt = (now_s() - t0) / steps;
	rr->loss = loss;
	rr->plan_bytes = tr_plan_total_bytes(p);
	rr->host_bytes = tr_plan_host_bytes(p);
	rr->fixed_bytes = be->fixed_bytes;
	rr->graph_launches = be->graph_launches;
	rr->used_bytes = be->fixed_bytes + (strcmp(b->backend, "cpu") ? free0 - free_min : be->bytes_peak);
	rr->numel_params = p->numel_params;
	rr->numel_trainable = p->numel_trainable;
	snprintf(rr->backend, sizeof(rr->backend), "%s", be->ops->name);
	snprintf(rr->device, sizeof(rr->device), "%s", be->device);
	if (ddp)
		tr_ddp_get_stats(ddp, &rr->st);
	free(ids);
	tr_ddp_free(ddp);
	gpu_comm_free(comm);
	tr_model_free(m);
	gpu_backend_free(be);
	return e != TD_OK ? rank_fail(rr, e) : TD_OK;
}

static void *rank_main(void *arg)
{
	struct rank_run *rr = arg;
	rr->e = bench_rank(rr);
	return NULL;
}

int main(int argc, char **argv)
{
	setenv("NCCL_NVLS_ENABLE", "0", 0); /* multicast off unless asked for (traind does the same) */
	const char *shape = "25m", *comm = "auto";
	struct bench b = {.backend = "cpu", .targets = "qv", .steps = 10, .warm = 2, .gpus = 1,
			  .recompute = TR_RECOMPUTE_NONE, .clip = 1.0};
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (!strcmp(a, "--phases")) {
			b.phases = true;
			continue;
		}
		if (!strcmp(a, "--qlora")) {
			b.qlora = true;
			continue;
		}
		if (!v) {
			fprintf(stderr, "bench_train: %s needs a value\n", a);
			return 2;
		}
		i++;
		if (!strcmp(a, "--backend")) b.backend = v;
		else if (!strcmp(a, "--shape")) shape = v;
		else if (!strcmp(a, "--batch")) b.B = atoi(v);
		else if (!strcmp(a, "--seq")) b.T = atoi(v);
		else if (!strcmp(a, "--steps")) b.steps = atoi(v);
		else if (!strcmp(a, "--warm")) b.warm = atoi(v);
		else if (!strcmp(a, "--lora-rank")) b.lora_rank = atoi(v);
		else if (!strcmp(a, "--lora-targets")) b.targets = v;
		else if (!strcmp(a, "--precision")) b.bf16 = !strcmp(v, "bf16");
		else if (!strcmp(a, "--gpus")) b.gpus = atoi(v);
		else if (!strcmp(a, "--clip")) {
			char *end;
			b.clip = strtod(v, &end);
			if (end == v || *end || !(b.clip >= 0.0) || b.clip > 1e30) {
				fprintf(stderr, "bench_train: --clip takes a norm >= 0 (0: none), not %s\n", v);
				return 2;
			}
		}
		else if (!strcmp(a, "--comm")) comm = v;
		else if (!strcmp(a, "--bucket-mfloats")) {
			double mf = atof(v);
			if (!(mf > 0 && mf <= 4096)) {
				fprintf(stderr, "bench_train: --bucket-mfloats takes (0, 4096], not %s\n", v);
				return 2;
			}
			b.bucket_floats = (size_t)(mf * 1e6);
		}
		else if (!strcmp(a, "--shard")) {
			int k = 0;
			while (k < TR_SHARD_BUILT && strcmp(tr_shard_name((enum tr_shard)k), v))
				k++;
			if (k == TR_SHARD_BUILT) {
				fprintf(stderr, "bench_train: --shard none|optimizer|gradients|parameters, not %s\n", v);
				return 2;
			}
			b.shard = (enum tr_shard)k;
		}
		else if (!strcmp(a, "--recompute")) {
			int r = 0;
			while (r < TR_RECOMPUTE_COUNT && strcmp(tr_recompute_name((enum tr_recompute)r), v))
				r++;
			if (r == TR_RECOMPUTE_COUNT) {
				fprintf(stderr, "bench_train: --recompute none|selective|full|full-offload, not %s\n", v);
				return 2;
			}
			b.recompute = (enum tr_recompute)r;
		}
		else if (!strcmp(a, "--selective-layers"))
			b.selective_layers = atoi(v);
		else if (!strcmp(a, "--logits-rows"))
			b.logits_rows = atoi(v);
		else {
			fprintf(stderr, "bench_train: unknown option %s\n", a);
			return 2;
		}
	}
	if (b.qlora && b.lora_rank <= 0) {
		fprintf(stderr, "bench_train: --qlora needs --lora-rank\n");
		return 2;
	}
	if (b.gpus < 1 || b.gpus > GPU_GANG_MAX || !gpu_comm_kind_parse(comm, &b.comm)) {
		fprintf(stderr, "bench_train: --gpus 1..%d, --comm auto|host|nccl\n", GPU_GANG_MAX);
		return 2;
	}
	if (b.steps < 1)
		b.steps = 1;
	size_t si = 0;
	while (si < sizeof(shapes) / sizeof(shapes[0]) && strcmp(shapes[si].name, shape))
		si++;
	if (si == sizeof(shapes) / sizeof(shapes[0])) {
		fprintf(stderr, "bench_train: unknown shape %s (fixture, 25m, qwen2-0.5b, qwen3-0.6b, qwen2-1.5b, llama3-8b-4l, llama3-8b)\n", shape);
		return 2;
	}
	if (!b.B) b.B = shapes[si].B;
	if (!b.T) b.T = shapes[si].T;

	struct td_errbuf eb = {{0}};
	if (tr_config_parse(&b.cfg, shapes[si].json, shape, &eb) != TD_OK) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	if (b.gpus > 1 && gpu_gang_new(&b.gang, b.gpus, 0, &eb) != TD_OK) {
		fprintf(stderr, "bench_train: %s\n", eb.msg);
		return 1;
	}
	struct rank_run *rr = calloc((size_t)b.gpus, sizeof(*rr));
	if (!rr) {
		fprintf(stderr, "bench_train: out of memory\n");
		return 1;
	}
	int started = 1;
	for (int r = 0; r < b.gpus; r++)
		rr[r] = (struct rank_run){.b = &b, .r = r};
	for (int r = 1; r < b.gpus; r++, started++)
		if (pthread_create(&rr[r].thread, NULL, rank_main, &rr[r]) != 0) {
			gpu_gang_fail(b.gang, r, TD_EINTERNAL, "cannot start a rank's thread");
			break;
		}
	rr[0].e = bench_rank(&rr[0]);
	for (int r = 1; r < started; r++)
		pthread_join(rr[r].thread, NULL);
	int fr = 0;
	td_err e = b.gang ? gpu_gang_error(b.gang, &fr, &eb) : rr[0].e;
	if (!b.gang && e != TD_OK)
		eb = rr[0].eb;
	if (e != TD_OK) {
		fprintf(stderr, "bench_train: rank %d: %s\n", fr, eb.msg);
		return 1;
	}
	const struct rank_run *r0 = &rr[0];
	size_t used = 0;
	for (int r = 0; r < b.gpus; r++)
		used = rr[r].used_bytes > used ? rr[r].used_bytes : used;
	const int lr = b.lora_rank;
	printf("{\"name\": \"traind-%s%s\", \"precision\": \"%s\", \"recompute\": \"%s\", \"shard\": \"%s\", \"backend\": \"%s\", \"device\": \"%s\", "
	       "\"gpus\": %d, \"batch\": %d, \"seq\": %d, "
	       "\"layers\": %d, \"params_total\": %zu, \"params_trainable\": %zu, \"ms_per_step\": %.2f, "
	       "\"tokens_per_s\": %.1f, \"plan_gib\": %.3f, \"reserve_gib\": %.3f, \"used_gib\": %.3f, "
	       "\"host_gib\": %.3f, \"clip\": %g, \"selective_layers\": %d, ",
	       lr ? (b.qlora ? "qlora-" : "lora-") : "full-", lr ? b.targets : b.bf16 ? "bf16" : "fp32",
	       b.bf16 ? "bf16" : "fp32", tr_recompute_name(b.recompute),
	       tr_shard_name(b.gpus > 1 ? b.shard : TR_SHARD_NONE), r0->backend, r0->device, b.gpus,
	       b.B, b.T, b.cfg.num_layers, r0->numel_params, r0->numel_trainable, r0->dt * 1e3,
	       (double)b.gpus * b.B * b.T / r0->dt, (double)r0->plan_bytes / (1 << 30),
	       (double)(r0->plan_bytes + r0->fixed_bytes) / (1 << 30), (double)used / (1 << 30),
	       (double)r0->host_bytes / (1 << 30), b.clip,
	       tr_recompute_full(b.recompute) ? b.selective_layers : 0);
	if (b.gang)
		printf("\"comm\": \"%s\", \"sums_in_backward\": %.1f, \"sums_after\": %.1f, "
		       "\"summed_mfloats\": %.1f, \"embed_rows_mfloats\": %.1f, ", r0->comm,
		       (double)r0->st.overlapped / (double)(r0->st.steps ? r0->st.steps : 1),
		       (double)r0->st.at_finish / (double)(r0->st.steps ? r0->st.steps : 1),
		       (double)r0->st.floats / 1e6 / (double)(r0->st.steps ? r0->st.steps : 1),
		       (double)r0->st.rows / 1e6 / (double)(r0->st.steps ? r0->st.steps : 1));
	printf("\"graph_launches\": %lld, \"loss\": %.4f, \"loss_exact\": %.17g}\n",
	       (long long)r0->graph_launches, r0->loss, r0->loss);
	if (b.phases)
		fprintf(stderr, "phases (ms/step, rank 0): forward+loss %.1f  backward %.1f (host %.1f)  "
			"sum %.1f  clip %.1f  adamw %.1f\n",
			1e3 * r0->ph[0] / b.steps, 1e3 * r0->ph[1] / b.steps, 1e3 * r0->bwd_host / b.steps,
			1e3 * r0->ph[2] / b.steps, 1e3 * r0->ph[3] / b.steps, 1e3 * r0->ph[4] / b.steps);
	free(rr);
	gpu_gang_free(b.gang);
	return 0;
}
