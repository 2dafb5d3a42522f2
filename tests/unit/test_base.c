/* Shared frozen bases (train/base.h, issue 11 item 5) on the CPU backend:
 *
 * - two LoRA jobs (and two QLoRA jobs) of the same model dir, run at once on
 *   two threads through one registry under one key, hold one base between
 *   them, and each one's losses and adapter are the bits of the same job run
 *   alone with its own base; the entry is gone after the last ends;
 * - the base is read-only once loaded: a write to it faults (SIGSEGV, in a
 *   child), its bytes are unchanged by training (a checksum), and a model
 *   attached to it refuses to set a frozen tensor;
 * - what keeps bases apart: another storage (fp32 vs bf16, NF4 with and
 *   without double quantization) gives another plan signature and the
 *   registry refuses it under a key it does not fit; a modified file gives
 *   another files digest, a copy of the files the same one.
 *
 * Uses the tiny qwen2 fixture and the demo token file.
 *
 * test_base --backend cuda (the gpu suite; skipped without a GPU): the same
 * on the CUDA backend in the bf16 mode — the jobs' bits, and the base's
 * checksum after training; whether the driver mapped the base read-only is
 * printed (where it refuses, only the construction keeps it unchanged, which
 * the checksum checks); no write is provoked (a fault would end the
 * context). */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "gpu/select.h"
#include "proto/jobspec.h"
#include "tests/check.h"
#include "train/base.h"
#include "train/hfconfig.h"
#include "train/method.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/plan.h"
#include "train/trainer.h"

static char tmp[256];
static const char *fx;
static const char *backend = "cpu";
static char model[512], data[512];

static void write_file(const char *path, const void *d, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(d, 1, n, f) != n) {
		perror(path);
		exit(2);
	}
	fclose(f);
}

static char *read_all(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return NULL;
	fseek(f, 0, SEEK_END);
	long len = ftell(f);
	fseek(f, 0, SEEK_SET);
	char *b = malloc((size_t)len + 1);
	if (b && fread(b, 1, (size_t)len, f) != (size_t)len) {
		free(b);
		b = NULL;
	}
	fclose(f);
	*n = (size_t)len;
	return b;
}

/* A LoRA or QLoRA job on the CPU, loaded, defaulted, validated. */
static Traind__JobSpec *lora_spec(const char *name, const char *method, const char *extra)
{
	char path[512], text[4096];
	snprintf(path, sizeof(path), "%s/%s.txtpb", tmp, name);
	snprintf(text, sizeof(text),
		 "name: \"%s\"\nmodel_dir: \"%s\"\nmethod: %s\n"
		 "data { train_file: \"%s\" format: DATA_FORMAT_TOKENS seq_len: 16 }\n"
		 "hyper { schedule: SCHEDULE_CONSTANT lr: 0.01 seed: 7 max_steps: 6 micro_batch: 2 }\n"
		 "lora { rank: 4 dropout: 0.1 target_modules: [\"q_proj\", \"v_proj\", \"down_proj\"] %s }\n"
		 "output { dir: \"%s/%s\" checkpoint_every: 0 }\nresources { device: DEVICE_CPU }\n",
		 name, model, method, data, extra, tmp, name);
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

#define MAX_STEPS 16

/* Where two jobs wait for each other after their first step, so that both
 * hold the shared base at once: otherwise, on a loaded host, the first
 * could end (and free the base) before the second attached, and the second
 * would load it again. A job waits at most MEET_S (the other failed before
 * its first step: the test's checks then say so). */
#define MEET_S 120
struct meet {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int arrived;
};

struct run {
	Traind__JobSpec *spec;
	struct tr_bases *bases; /* NULL: alone, its own base */
	const char *key;
	struct meet *meet; /* NULL: runs alone */
	struct tr_train_result res;
	double loss[MAX_STEPS];
	int nloss;
	td_err e;
	char msg[1024];
};

static void meet_other(struct meet *m)
{
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += MEET_S;
	pthread_mutex_lock(&m->mu);
	m->arrived++;
	pthread_cond_broadcast(&m->cv);
	while (m->arrived < 2 && pthread_cond_timedwait(&m->cv, &m->mu, &until) != ETIMEDOUT)
		;
	pthread_mutex_unlock(&m->mu);
}

static void on_step(void *ctx, const struct tr_progress *p)
{
	struct run *r = ctx;
	if (r->nloss < MAX_STEPS)
		r->loss[r->nloss++] = p->loss;
	if (r->meet && r->nloss == 1)
		meet_other(r->meet);
}

static void *run_job(void *arg)
{
	struct run *r = arg;
	struct tr_train_opts o = {.backend = backend, .bases = r->bases, .base_key = r->key};
	struct tr_hooks h = {.on_step = on_step, .ctx = r};
	struct td_errbuf eb = {{0}};
	r->e = tr_train(r->spec, &o, &h, &r->res, &eb);
	snprintf(r->msg, sizeof(r->msg), "%s", eb.msg);
	return NULL;
}

static bool same_file(const char *a, const char *b)
{
	size_t na = 0, nb = 0;
	char *x = read_all(a, &na), *y = read_all(b, &nb);
	bool same = x && y && na == nb && memcmp(x, y, na) == 0;
	free(x);
	free(y);
	return same;
}

/* Two jobs of method at once under one key against each alone. */
static void test_two_jobs(const char *method, const char *extra, const char *tag)
{
	char n[4][64];
	for (int i = 0; i < 4; i++)
		snprintf(n[i], sizeof(n[i]), "%s-%s", tag, (const char *[]){"alone0", "alone1", "shared0", "shared1"}[i]);
	/* Jobs 0 and 1 differ (seed), so "the same bits" is not one job's. */
	char seed1[64];
	snprintf(seed1, sizeof(seed1), "%s", extra);
	struct run r[4];
	memset(r, 0, sizeof(r));
	struct tr_bases *bases = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_bases_new(&bases, &eb), TD_OK);
	for (int i = 0; i < 4; i++) {
		r[i].spec = lora_spec(n[i], method, extra);
		r[i].spec->hyper->seed = 7 + (uint64_t)(i % 2);
		r[i].bases = i >= 2 ? bases : NULL;
		r[i].key = i >= 2 ? "the-key" : NULL;
	}
	run_job(&r[0]);
	run_job(&r[1]);
	struct meet meet = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
	r[2].meet = r[3].meet = &meet;
	pthread_t t[2];
	for (int i = 0; i < 2; i++)
		CHECK_EQ_INT(pthread_create(&t[i], NULL, run_job, &r[2 + i]), 0);
	for (int i = 0; i < 2; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < 4; i++)
		CHECK_MSG(r[i].e == TD_OK, "%s: %s", n[i], r[i].msg);
	/* One loaded it, the other attached; neither alone shared. */
	CHECK(!r[0].res.base_shared && !r[1].res.base_shared);
	CHECK(r[2].res.base_shared && r[3].res.base_shared);
	CHECK_EQ_INT((int)r[2].res.base_loaded + (int)r[3].res.base_loaded, 1);
	CHECK(r[2].res.base_bytes > 0 && r[2].res.base_bytes == r[3].res.base_bytes);
	bool sealed = r[2].res.base_loaded ? r[2].res.base_sealed : r[3].res.base_sealed;
	if (strcmp(backend, "cpu") == 0)
		CHECK(sealed); /* mprotect */
	else
		printf("# %s %s: the shared base was %s\n", backend, tag,
		       sealed ? "mapped read-only" : "left writable (the driver refused read-only)");
	for (int i = 0; i < 2; i++) {
		CHECK_EQ_INT(r[2 + i].nloss, r[i].nloss);
		for (int s = 0; s < r[i].nloss; s++)
			CHECK_MSG(r[2 + i].loss[s] == r[i].loss[s], "%s step %d: loss %.9g shared, %.9g alone",
				  tag, s + 1, r[2 + i].loss[s], r[i].loss[s]);
		char a[600], b[600];
		snprintf(a, sizeof(a), "%s/%s/adapter_model.safetensors", tmp, n[i]);
		snprintf(b, sizeof(b), "%s/%s/adapter_model.safetensors", tmp, n[2 + i]);
		CHECK_MSG(same_file(a, b), "%s: the adapter of job %d shared differs from alone", tag, i);
	}
	CHECK(r[0].loss[r[0].nloss - 1] != r[1].loss[r[1].nloss - 1]); /* two different jobs */
	size_t entries = 1, bytes = 1;
	tr_bases_stat(bases, &entries, &bytes);
	CHECK_EQ_INT(entries, 0); /* freed with the last */
	CHECK_EQ_INT(bytes, 0);
	tr_bases_free(bases);
	for (int i = 0; i < 4; i++)
		rpc_jobspec_free(r[i].spec);
}

/* The base of a LoRA model on the CPU backend, loaded through the
 * registry as the trainer does; its bytes' FNV-1a for a checksum. */
static uint64_t fnv(const void *p, size_t n)
{
	const unsigned char *b = p;
	uint64_t h = 0xcbf29ce484222325ull;
	for (size_t i = 0; i < n; i++) {
		h ^= b[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

static void test_read_only(void)
{
	Traind__JobSpec *s = lora_spec("ro", "METHOD_LORA", "");
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	char cpath[600];
	snprintf(cpath, sizeof(cpath), "%s/config.json", model);
	CHECK_EQ_INT(tr_config_load(&cfg, cpath, &eb), TD_OK);
	struct gpu_backend *be = NULL;
	CHECK_EQ_INT(gpu_backend_open(&be, backend, &eb), TD_OK);
	const bool cpu = strcmp(backend, "cpu") == 0;
	if (!cpu)
		CHECK_EQ_INT(gpu_set_bf16(be, true, &eb), TD_OK); /* the mode a GPU job runs in */
	size_t used0 = be->bytes_in_use;
	struct tr_bases *bases = NULL;
	CHECK_EQ_INT(tr_bases_new(&bases, &eb), TD_OK);
	char sig[65];
	size_t bytes = 0;
	CHECK_EQ_INT(tr_method_base_layout(s, &cfg, be, 2, 16, sig, &bytes, &eb), TD_OK);
	struct tr_base *b = NULL;
	bool load = false;
	CHECK_EQ_INT(tr_bases_acquire(bases, be, -1, "k", sig, bytes, &b, &load, &eb), TD_OK);
	CHECK(load);
	struct tr_method *mt = NULL;
	CHECK_EQ_INT(tr_method_new_shared(&mt, s, &cfg, be, 2, 16, tr_base_ptr(b), bytes, false, &eb),
		     TD_OK);
	size_t used = be->bytes_in_use;
	struct tr_weights *w = NULL;
	CHECK_EQ_INT(tr_weights_open(&w, model, &eb), TD_OK);
	CHECK_EQ_INT(tr_method_load_initial(mt, w, &eb), TD_OK);
	bool sealed = false;
	CHECK_EQ_INT(gpu_sync(be, &eb), TD_OK);
	tr_base_ready(bases, b, be, TD_OK, &sealed);
	if (cpu)
		CHECK(sealed);
	else
		printf("# %s: the shared base is %s\n", backend,
		       sealed ? "mapped read-only (CU_MEM_ACCESS_FLAGS_PROT_READ)"
			      : "writable: the driver refused a read-only mapping");
	/* The model's own arenas are all it allocated on the backend: the plan
	 * less its base. */
	const struct tr_plan *p = tr_model_plan(tr_method_model(mt));
	CHECK_EQ_INT(used - used0, tr_plan_total_bytes(p) - tr_plan_base_bytes(p));
	/* The base's bytes as the device holds them (the CPU backend's are
	 * host memory: the download is a copy there too). */
	unsigned char *img = malloc(bytes);
	CHECK(img != NULL);
	gpu_download(be, img, tr_base_ptr(b), bytes);
	uint64_t sum0 = fnv(img, bytes);

	/* A second model attaches: loading it writes nothing of the base, and
	 * setting a frozen tensor is refused. */
	struct tr_base *b2 = NULL;
	CHECK_EQ_INT(tr_bases_acquire(bases, be, -1, "k", sig, bytes, &b2, &load, &eb), TD_OK);
	CHECK(!load && b2 == b);
	CHECK_EQ_INT(tr_bases_refs(bases, "k", -1), 2);
	struct tr_method *mt2 = NULL;
	CHECK_EQ_INT(tr_method_new_shared(&mt2, s, &cfg, be, 2, 16, tr_base_ptr(b), bytes, true, &eb),
		     TD_OK);
	CHECK_EQ_INT(tr_method_load_initial(mt2, w, &eb), TD_OK);
	const struct tr_param *embed = tr_plan_param(p, "model.embed_tokens.weight");
	float *host = calloc(embed->numel, sizeof(float));
	CHECK_EQ_INT(tr_model_set_param(tr_method_model(mt2), embed, host), TD_EPERM);
	free(host);
	/* The same key with another layout (QLoRA's NF4 projections) is refused. */
	Traind__JobSpec *q = lora_spec("ro-q", "METHOD_QLORA", "");
	char qsig[65];
	size_t qbytes = 0;
	CHECK_EQ_INT(tr_method_base_layout(q, &cfg, be, 2, 16, qsig, &qbytes, &eb), TD_OK);
	struct tr_base *b3 = NULL;
	CHECK_EQ_INT(tr_bases_acquire(bases, be, -1, "k", qsig, qbytes, &b3, &load, &eb), TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "another layout");

	/* A step of each trains the adapters and leaves the base's bytes. */
	int32_t ids[32], labels[32];
	for (int i = 0; i < 32; i++)
		ids[i] = labels[i] = (i * 37 + 11) % cfg.vocab_size;
	struct tr_method *each[2] = {mt, mt2};
	struct tr_adamw h = {.beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
	for (int k = 0; k < 2; k++) {
		struct tr_model *m = tr_method_model(each[k]);
		double ls = 0;
		int64_t nv = 0;
		tr_model_zero_grad(m);
		CHECK_EQ_INT(tr_model_forward(m, ids, labels, &ls, &nv, &eb), TD_OK);
		tr_model_backward(m, 1.0f / (float)nv);
		tr_model_adamw(m, &h, 0.01f, 1);
		CHECK_EQ_INT(gpu_sync(be, &eb), TD_OK);
	}
	gpu_download(be, img, tr_base_ptr(b), bytes);
	CHECK_MSG(fnv(img, bytes) == sum0, "the shared base changed under training");
	free(img);

	/* A write to the sealed base faults (in a child: the fault is the
	 * result). The CPU backend's only: on a GPU it would end the context. */
	fflush(NULL);
	pid_t kid = cpu ? fork() : -1;
	if (kid == 0) {
		signal(SIGSEGV, SIG_DFL);
		((volatile unsigned char *)tr_base_ptr(b))[bytes / 2] ^= 1;
		_exit(0); /* not reached where the base is read-only */
	}
	int st = 0;
	if (cpu) {
		waitpid(kid, &st, 0);
		CHECK_MSG(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV,
			  "a write to the sealed base: status %#x, not SIGSEGV", st);
	}

	tr_method_free(mt2);
	tr_bases_release(bases, b2, be);
	CHECK_EQ_INT(tr_bases_refs(bases, "k", -1), 1);
	tr_method_free(mt);
	tr_bases_release(bases, b, be);
	CHECK_EQ_INT(tr_bases_refs(bases, "k", -1), 0);
	CHECK_EQ_INT(be->bytes_in_use, used0);
	tr_weights_close(w);
	tr_bases_free(bases);
	gpu_backend_free(be);
	rpc_jobspec_free(s);
	rpc_jobspec_free(q);
}

/* Signatures: the storage settings that change the base's bytes change
 * it; the adapters' settings do not. */
static void test_signatures(void)
{
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	char cpath[600];
	snprintf(cpath, sizeof(cpath), "%s/config.json", model);
	CHECK_EQ_INT(tr_config_load(&cfg, cpath, &eb), TD_OK);
	struct {
		struct tr_plan_opts po;
		int group; /* equal groups, equal signatures */
	} c[] = {
		{{.B = 2, .T = 16, .lora_rank = 4, .lora_alpha = 8, .lora_targets = 1}, 0},
		{{.B = 4, .T = 32, .lora_rank = 8, .lora_alpha = 8, .lora_targets = 0x7f,
		  .recompute = TR_RECOMPUTE_FULL},
		 0},
		{{.B = 2, .T = 16, .lora_rank = 4, .lora_alpha = 8, .lora_targets = 1, .frozen_bf16 = true},
		 1},
		{{.B = 2, .T = 16, .lora_rank = 4, .lora_alpha = 8, .lora_targets = 1,
		  .base_quant = TR_QUANT_NF4, .nf4_double_quant = true},
		 2},
		{{.B = 2, .T = 16, .lora_rank = 4, .lora_alpha = 8, .lora_targets = 1,
		  .base_quant = TR_QUANT_NF4},
		 3},
	};
	const size_t n = sizeof(c) / sizeof(c[0]);
	char sig[8][65];
	for (size_t i = 0; i < n; i++) {
		struct tr_plan p;
		CHECK_EQ_INT(tr_plan_build(&p, &cfg, &c[i].po, &eb), TD_OK);
		tr_plan_base_signature(&p, sig[i]);
		CHECK_EQ_INT(strlen(sig[i]), 64);
		tr_plan_fini(&p);
	}
	for (size_t i = 0; i < n; i++)
		for (size_t k = 0; k < i; k++)
			CHECK_MSG((strcmp(sig[i], sig[k]) == 0) == (c[i].group == c[k].group),
				  "cases %zu and %zu: signatures %s equal", k, i,
				  strcmp(sig[i], sig[k]) == 0 ? "" : "not");
}

/* The files' digest: a copy gives the same, a changed byte another. */
static void test_digest(void)
{
	char copy[600], cmd[1400], d0[65], d1[65], d2[65];
	struct td_errbuf eb = {{0}};
	snprintf(copy, sizeof(copy), "%s/model-copy", tmp);
	snprintf(cmd, sizeof(cmd), "cp -r '%s' '%s'", model, copy);
	CHECK_EQ_INT(system(cmd), 0);
	CHECK_EQ_INT(tr_base_files_digest(model, d0, &eb), TD_OK);
	CHECK_EQ_INT(tr_base_files_digest(copy, d1, &eb), TD_OK);
	CHECK(strcmp(d0, d1) == 0);
	/* One byte of the last tensor's data, in place: same size. */
	char st[700];
	snprintf(st, sizeof(st), "%s/model.safetensors", copy);
	FILE *f = fopen(st, "r+b");
	CHECK(f != NULL);
	if (f) {
		fseek(f, -1, SEEK_END);
		int ch = fgetc(f);
		fseek(f, -1, SEEK_END);
		fputc(ch ^ 0x40, f);
		fclose(f);
	}
	CHECK_EQ_INT(tr_base_files_digest(copy, d2, &eb), TD_OK);
	CHECK(strcmp(d0, d2) != 0);
	CHECK_EQ_INT(tr_base_files_digest(model, d1, &eb), TD_OK); /* memo hit: unchanged */
	CHECK(strcmp(d0, d1) == 0);
	snprintf(cmd, sizeof(cmd), "%s/nowhere", tmp);
	CHECK_EQ_INT(tr_base_files_digest(cmd, d1, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "nowhere");
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
			backend = argv[++i];
		} else {
			fprintf(stderr, "usage: test_base [--backend cpu|cuda]\n");
			return 2;
		}
	}
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	if (strcmp(backend, "cpu") != 0) {
		struct gpu_backend *be = NULL;
		struct td_errbuf eb = {{0}};
		td_err e = gpu_backend_open(&be, backend, &eb);
		if (e == TD_EUNSUPPORTED)
			return check_skip(eb.msg);
		gpu_backend_free(be);
	}
	snprintf(tmp, sizeof(tmp), "/tmp/td-base-XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 2;
	}
	snprintf(model, sizeof(model), "%s/qwen2", fx);
	snprintf(data, sizeof(data), "%s/demo/fortunes.tokens", fx);
	if (strcmp(backend, "cpu") == 0) {
		test_signatures();
		test_digest();
	}
	test_read_only();
	test_two_jobs("METHOD_LORA", "", "lora");
	test_two_jobs("METHOD_QLORA", "", "qlora");
	check_rm_tree(tmp);
	return check_status();
}
