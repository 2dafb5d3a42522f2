/* The step loop, checkpoints and resume (train/trainer.h).
 *
 * On disk, under the job's output dir:
 *   checkpoints/step-00000030/   config.json, model.safetensors (F32 master
 *                                weights), optimizer.safetensors (exp_avg.NAME,
 *                                exp_avg_sq.NAME), trainer_state.json
 *   config.json, model.safetensors, tokenizer files, trainer_state.json
 *                                the final model, in the source dtype
 * A checkpoint directory is complete when it has its final name: it is written
 * as step-N.tmp and renamed. trainer_state.json records the step, the data
 * position and the settings a resume must agree with. */
#include "train/trainer.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <json-c/json.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gpu/comm.h"
#include "gpu/select.h"
#include "proto/log.h"
#include "train/data.h"
#include "train/ddp.h"
#include "train/method.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/base.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
	(void)sb;
	(void)flag;
	(void)ftw;
	return remove(path);
}

static void rm_rf(const char *path)
{
	nftw(path, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void fsync_dir(const char *path)
{
	int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd >= 0) {
		fsync(fd);
		close(fd);
	}
}

/* Writes JSON atomically (tr__write_atomic: tmp, fsync, rename, fsync the dir). */
static td_err write_json(const char *path, struct json_object *o, struct td_errbuf *eb)
{
	size_t len;
	const char *text = json_object_to_json_string_length(
		o, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_NOSLASHESCAPE, &len);
	return tr__write_atomic(path, (struct tr__chunk[]){{text, len}, {"\n", 1}}, 2, eb);
}

/* --- the schedule --- */

double tr_lr_at(const Traind__Hyper *h, uint64_t s, uint64_t total)
{
	double lr = h->lr, min_lr = h->has_min_lr ? h->min_lr : 0.0;
	uint64_t warm = h->warmup_steps;
	if (s < warm)
		return lr * (double)s / (double)warm;
	if (total <= warm)
		return lr;
	double progress = (double)(s - warm) / (double)(total - warm);
	if (progress > 1.0)
		progress = 1.0;
	switch (h->schedule) {
	case TRAIND__SCHEDULE__SCHEDULE_CONSTANT:
		return lr;
	case TRAIND__SCHEDULE__SCHEDULE_LINEAR:
		return min_lr + (lr - min_lr) * (1.0 - progress);
	case TRAIND__SCHEDULE__SCHEDULE_COSINE:
	default:
		return min_lr + (lr - min_lr) * 0.5 * (1.0 + cos(M_PI * progress));
	}
}

/* --- checkpoints --- */

struct job {
	const Traind__JobSpec *spec;
	struct tr_model_config cfg;
	struct tr_method *meth;     /* the method's models; m is the one AdamW steps */
	struct tr_model *m;
	struct gpu_backend *be;
	struct tr_data *data;
	struct tr_data *eval;       /* data.eval_file, or NULL */
	struct tr_data_pos pos;
	uint64_t step, total;
	int B, T, accum;
	char ckpt_root[PATH_MAX];
	FILE *log;
	/* A frozen base shared with the process's other jobs (train/base.h):
	 * its entry, and whether this job is loading it (tr_base_ready due). */
	struct tr_bases *bases;
	struct tr_base *base;
	bool base_loading;
};

/* The trained weights: a model dir, or a PEFT adapter (train/method.h). */
static td_err save_params(struct job *j, const char *dir, enum tr_dtype dtype,
			  struct td_errbuf *eb)
{
	return tr_method_save(j->meth, dir, dtype, eb);
}

/* AdamW's moments by tensor name, every trainable float's: all_m1 and
 * all_m2 (numel_trainable floats each) where a sharded gang gathered them
 * (gather_moments), else this model's own (then all of them). */
static td_err save_optimizer(struct job *j, const char *dir, const float *all_m1,
			     const float *all_m2, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(j->m);
	size_t nt = p->numel_trainable;
	assert(all_m1 || (p->shard_lo == 0 && p->shard_hi == nt));
	float *m1 = all_m1 ? NULL : malloc(nt * sizeof(float) + 1);
	float *m2 = all_m1 ? NULL : malloc(nt * sizeof(float) + 1);
	struct tr_st_entry *es = calloc(2 * p->nparams, sizeof(*es));
	char(*names)[112] = calloc(2 * p->nparams, sizeof(*names));
	if ((!all_m1 && (!m1 || !m2)) || !es || !names) {
		free(m1);
		free(m2);
		free(es);
		free(names);
		return td_fail(eb, TD_ENOMEM, "checkpoint: out of memory");
	}
	if (!all_m1)
		tr_model_get_moments(j->m, m1, m2);
	const float *s1 = all_m1 ? all_m1 : m1, *s2 = all_m1 ? all_m2 : m2;
	size_t n = 0;
	for (size_t i = 0; i < p->nparams; i++) {
		const struct tr_param *pp = &p->params[i];
		if (!pp->trainable)
			continue;
		for (int k = 0; k < 2; k++) {
			snprintf(names[n], sizeof(names[n]), "%s.%s", k ? "exp_avg_sq" : "exp_avg", pp->name);
			es[n].name = names[n];
			es[n].dtype = TR_DT_F32;
			es[n].ndim = pp->ndim;
			es[n].shape[0] = pp->shape[0];
			es[n].shape[1] = pp->shape[1];
			es[n].data = (k ? s2 : s1) + pp->goffset;
			n++;
		}
	}
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/optimizer.safetensors", dir);
	static const char *const meta[] = {"format", "traind-adamw", NULL};
	td_err e = tr_st_write(path, es, n, meta, eb);
	free(m1);
	free(m2);
	free(es);
	free(names);
	return e;
}

static struct json_object *state_json(const struct job *j, bool final, double loss)
{
	struct json_object *o = json_object_new_object();
	json_object_object_add(o, "step", json_object_new_int64((int64_t)j->step));
	json_object_object_add(o, "total_steps", json_object_new_int64((int64_t)j->total));
	json_object_object_add(o, "final", json_object_new_boolean(final));
	json_object_object_add(o, "loss", json_object_new_double(loss));
	json_object_object_add(o, "data_epoch", json_object_new_int64((int64_t)j->pos.epoch));
	json_object_object_add(o, "data_index", json_object_new_int64((int64_t)j->pos.index));
	/* The data order is a function of (seed, epoch) and nothing else is random. */
	json_object_object_add(o, "seed", json_object_new_int64((int64_t)j->spec->hyper->seed));
	json_object_object_add(o, "micro_batch", json_object_new_int(j->B));
	json_object_object_add(o, "grad_accum", json_object_new_int(j->accum));
	json_object_object_add(o, "seq_len", json_object_new_int(j->T));
	json_object_object_add(o, "model_dir", json_object_new_string(j->spec->model_dir));
	json_object_object_add(o, "train_file", json_object_new_string(j->spec->data->train_file));
	char fp[24];
	snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)tr_data_fingerprint(j->data));
	json_object_object_add(o, "data_fingerprint", json_object_new_string(fp));
	return o;
}

static td_err write_checkpoint(struct job *j, double loss, const float *all_m1,
			       const float *all_m2, struct td_errbuf *eb)
{
	char tmp[PATH_MAX], fin[PATH_MAX], path[PATH_MAX];
	snprintf(fin, sizeof(fin), "%s/step-%08llu", j->ckpt_root, (unsigned long long)j->step);
	snprintf(tmp, sizeof(tmp), "%s.tmp", fin);
	rm_rf(tmp);
	td_err e = tr__mkdir_p(tmp, eb);
	if (e == TD_OK)
		e = save_params(j, tmp, TR_DT_F32, eb);
	if (e == TD_OK)
		e = save_optimizer(j, tmp, all_m1, all_m2, eb);
	/* A device error during the downloads left garbage in the files: never
	 * rename those into place. */
	if (e == TD_OK)
		e = gpu_sync(j->be, eb);
	if (e == TD_OK) {
		snprintf(path, sizeof(path), "%s/trainer_state.json", tmp);
		struct json_object *o = state_json(j, false, loss);
		e = write_json(path, o, eb);
		json_object_put(o);
	}
	if (e == TD_OK) {
		rm_rf(fin); /* a checkpoint of the same step from an interrupted earlier run */
		if (rename(tmp, fin) != 0)
			e = td_fail(eb, td_from_errno(errno), "%s: cannot rename into place: %s", fin,
				    strerror(errno));
		else
			fsync_dir(j->ckpt_root);
	}
	if (e != TD_OK)
		rm_rf(tmp);
	return e;
}

/* Steps of the complete checkpoints, ascending. */
static size_t list_checkpoints(const char *root, uint64_t *steps, size_t cap)
{
	DIR *d = opendir(root);
	if (!d)
		return 0;
	size_t n = 0;
	struct dirent *de;
	while ((de = readdir(d)) && n < cap) {
		unsigned long long s;
		int len = 0;
		if (sscanf(de->d_name, "step-%llu%n", &s, &len) == 1 && de->d_name[len] == 0)
			steps[n++] = s;
	}
	closedir(d);
	for (size_t i = 1; i < n; i++)
		for (size_t k = i; k > 0 && steps[k - 1] > steps[k]; k--) {
			uint64_t t = steps[k];
			steps[k] = steps[k - 1];
			steps[k - 1] = t;
		}
	return n;
}

static void prune_checkpoints(struct job *j)
{
	uint64_t steps[4096];
	size_t n = list_checkpoints(j->ckpt_root, steps, 4096);
	uint32_t keep = j->spec->output->keep_last ? j->spec->output->keep_last : 1;
	for (size_t i = 0; i + keep < n; i++) {
		char path[PATH_MAX];
		snprintf(path, sizeof(path), "%s/step-%08llu", j->ckpt_root, (unsigned long long)steps[i]);
		rm_rf(path);
	}
}

static int64_t jint(struct json_object *o, const char *k)
{
	struct json_object *v;
	return json_object_object_get_ex(o, k, &v) ? json_object_get_int64(v) : -1;
}

static td_err load_checkpoint(struct job *j, uint64_t step, struct td_errbuf *eb)
{
	char dir[PATH_MAX], path[PATH_MAX];
	snprintf(dir, sizeof(dir), "%s/step-%08llu", j->ckpt_root, (unsigned long long)step);
	snprintf(path, sizeof(path), "%s/trainer_state.json", dir);
	struct json_object *o = json_object_from_file(path);
	if (!o)
		return td_fail(eb, TD_EFORMAT, "%s: cannot read: %s", path, json_util_get_last_err());
	td_err e = TD_OK;
	const struct {
		const char *key;
		int64_t want;
	} must[] = {
		{"micro_batch", j->B},
		{"grad_accum", j->accum},
		{"seq_len", j->T},
		{"seed", (int64_t)j->spec->hyper->seed},
		{"step", (int64_t)step},
	};
	for (size_t i = 0; i < sizeof(must) / sizeof(must[0]) && e == TD_OK; i++)
		if (jint(o, must[i].key) != must[i].want)
			e = td_fail(eb, TD_EMISMATCH,
				    "%s: %s is %lld but the job has %lld; resume needs the same setting "
				    "(or another output.dir)",
				    path, must[i].key, (long long)jint(o, must[i].key), (long long)must[i].want);
	/* The position means something only in the same sequences. */
	struct json_object *fpv;
	char fp[24];
	snprintf(fp, sizeof(fp), "%016llx", (unsigned long long)tr_data_fingerprint(j->data));
	if (e == TD_OK && json_object_object_get_ex(o, "data_fingerprint", &fpv) &&
	    strcmp(json_object_get_string(fpv), fp) != 0)
		e = td_fail(eb, TD_EMISMATCH,
			    "%s: the data differs from the checkpointed run's (fingerprint %s, now %s); resume "
			    "needs the same data and data settings (or another output.dir)",
			    path, json_object_get_string(fpv), fp);
	int64_t ep = jint(o, "data_epoch"), ix = jint(o, "data_index");
	json_object_put(o);
	if (e != TD_OK)
		return e;
	if (ep < 0 || ix < 0)
		return td_fail(eb, TD_EFORMAT, "%s: no data position", path);

	if ((e = tr_method_load_saved(j->meth, dir, eb)) != TD_OK)
		return e;

	/* The moments of this model's part of the trainable floats (all of
	 * them unsharded): a checkpoint holds every tensor's whole, so it
	 * resumes on any number of ranks and any sharding. */
	struct tr_st_file *f = NULL;
	snprintf(path, sizeof(path), "%s/optimizer.safetensors", dir);
	if ((e = tr_st_open(&f, path, eb)) != TD_OK)
		return e;
	const struct tr_plan *p = tr_model_plan(j->m);
	const size_t lo = p->shard_lo, hi = p->shard_hi;
	float *m1 = malloc((hi - lo) * sizeof(float) + 1), *m2 = malloc((hi - lo) * sizeof(float) + 1);
	float *whole = NULL; /* a tensor that straddles the part's ends */
	size_t whole_cap = 0;
	if (!m1 || !m2)
		e = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	for (size_t i = 0; i < p->nparams && e == TD_OK; i++) {
		const struct tr_param *pp = &p->params[i];
		if (!pp->trainable)
			continue;
		const size_t a = pp->goffset, b = a + pp->numel;
		for (int k = 0; k < 2 && e == TD_OK; k++) {
			char name[112];
			snprintf(name, sizeof(name), "%s.%s", k ? "exp_avg_sq" : "exp_avg", pp->name);
			const struct tr_st_tensor *t = tr_st_find(f, name);
			float *dst = k ? m2 : m1;
			if (!t || (size_t)t->numel != pp->numel) {
				e = td_fail(eb, TD_EFORMAT, "%s: tensor '%s' is missing or has the wrong size",
					    path, name);
			} else if (b <= lo || a >= hi) {
				continue; /* another rank's */
			} else if (a >= lo && b <= hi) {
				e = tr_st_to_f32(dst + (a - lo), t, eb);
			} else {
				if (pp->numel > whole_cap) {
					float *w = realloc(whole, pp->numel * sizeof(float));
					if (!w) {
						e = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
						break;
					}
					whole = w;
					whole_cap = pp->numel;
				}
				if ((e = tr_st_to_f32(whole, t, eb)) == TD_OK) {
					size_t from = a > lo ? a : lo, to = b < hi ? b : hi;
					memcpy(dst + (from - lo), whole + (from - a), (to - from) * sizeof(float));
				}
			}
		}
	}
	if (e == TD_OK)
		tr_model_set_moments(j->m, m1, m2);
	free(whole);
	free(m1);
	free(m2);
	tr_st_close(f);
	if (e != TD_OK)
		return e;
	j->step = step;
	j->pos.epoch = (uint64_t)ep;
	j->pos.index = (uint64_t)ix;
	return TD_OK;
}

/* --- the job --- */

static td_err open_job(struct job *j, const Traind__JobSpec *spec, struct td_errbuf *eb)
{
	char path[PATH_MAX];
	j->spec = spec;
	snprintf(path, sizeof(path), "%s/config.json", spec->model_dir);
	td_err e = tr_config_load(&j->cfg, path, eb);
	if (e != TD_OK)
		return e;
	if ((e = tr_method_check(spec, &j->cfg, eb)) != TD_OK)
		return e;
	j->B = (int)spec->hyper->micro_batch;
	j->T = (int)spec->data->seq_len;
	j->accum = (int)spec->hyper->grad_accum;
	if (j->cfg.max_position_embeddings > 0 && j->T > j->cfg.max_position_embeddings)
		td_warn("TD-JOB-SEQ", "data.seq_len %d exceeds the model's max_position_embeddings %d",
			j->T, j->cfg.max_position_embeddings);
	snprintf(j->ckpt_root, sizeof(j->ckpt_root), "%s/checkpoints", spec->output->dir);
	return TD_OK;
}

td_err tr_train_plan(const Traind__JobSpec *spec, FILE *out, struct td_errbuf *eb)
{
	struct job j = {0};
	td_err e = open_job(&j, spec, eb);
	if (e != TD_OK)
		return e;
	fprintf(out, "job        %s (%s)\n", spec->name, spec->model_dir);
	return tr_method_print_plan(spec, &j.cfg, j.B, j.T, out, eb);
}

/* The mean token loss of the model as it is on data.eval_file (file order, at
 * most data.eval_batches micro-batches), forward only; logged with its
 * perplexity. ids and labels hold one micro-batch. A classifier's loss is per
 * row instead, with accuracy and macro-F1 (train/method.h). */
static td_err evaluate(struct job *j, int32_t *ids, int32_t *labels, FILE *log, double *out,
		       struct td_errbuf *eb)
{
	if (tr_method_has_eval(j->meth)) /* a classifier's: loss per row, accuracy, macro-F1 */
		return tr_method_eval(j->meth, j->eval, j->spec->data->eval_batches, j->step, log, out,
				      eb);
	uint64_t n = tr_data_num_sequences(j->eval), B = (uint64_t)j->B, T = (uint64_t)j->T;
	uint64_t batches = (n + B - 1) / B;
	if (j->spec->data->eval_batches && batches > j->spec->data->eval_batches)
		batches = j->spec->data->eval_batches;
	double sum = 0;
	int64_t count = 0;
	for (uint64_t k = 0; k < batches; k++) {
		for (uint64_t b = 0; b < B; b++) {
			if (k * B + b < n) {
				td_err e = tr_data_sequence(j->eval, k * B + b, ids + b * T, labels + b * T,
							    NULL, eb);
				if (e != TD_OK)
					return e;
				continue;
			}
			for (uint64_t t = 0; t < T; t++) { /* past the end: no loss */
				ids[b * T + t] = tr_data_pad_id(j->eval);
				labels[b * T + t] = -100;
			}
		}
		double ls;
		int64_t nv;
		td_err e = tr_model_forward(j->m, ids, labels, &ls, &nv, eb);
		if (e != TD_OK)
			return e;
		sum += ls;
		count += nv;
	}
	*out = count ? sum / (double)count : NAN;
	if (log)
		fprintf(log, "eval   %6llu  loss %.4f  ppl %.3f  (%llu sequences, %lld tokens of %s)\n",
			(unsigned long long)j->step, *out, exp(*out),
			(unsigned long long)(batches * B < n ? batches * B : n), (long long)count,
			j->spec->data->eval_file);
	return TD_OK;
}

static const char *backend_for(const Traind__JobSpec *spec, const struct tr_train_opts *o)
{
	if (o && o->backend)
		return o->backend;
	switch (spec->resources->device) {
	case TRAIND__DEVICE__DEVICE_CPU:
		return "cpu";
	case TRAIND__DEVICE__DEVICE_GPU:
		return spec->resources->allow_cpu ? "auto" : "cuda";
	default:
		return spec->resources->allow_cpu ? "auto" : "cuda";
	}
}

static void close_job(struct job *j)
{
	tr_method_free(j->meth);
	if (j->base && j->base_loading) /* a load that did not finish: a waiter loads it */
		tr_base_ready(j->bases, j->base, j->be, TD_ESTATE, NULL);
	else if (j->base)
		tr_bases_release(j->bases, j->base, j->be);
	gpu_backend_free(j->be);
	tr_data_close(j->data);
	tr_data_close(j->eval);
}

/* --- data parallel: what the ranks of one job share --- */

struct rank;

struct gang {
	struct gpu_gang *g;
	int n;                  /* the ranks of the whole gang */
	int base;               /* this process's first rank (ranks[k] is rank base + k) */
	bool net;               /* across processes (gpu_gang_new_net) */
	enum gpu_comm_kind comm;
	size_t bucket_floats;
	bool overlap;           /* bucket even where the comm is not asynchronous */
	/* Written before a step's closing barrier, read after it, by step
	 * parity: a rank may be writing the next step's while another still
	 * reads these (never two steps ahead: it would have passed a barrier
	 * the reader has not reached). */
	double *ls;             /* [2][grad_accum]: each micro-batch's loss sum, by the rank that ran it */
	bool stop[2];           /* rank 0's decision at a step's end */
	/* A sharded gang's checkpoint: rank 0's host copy of every trainable
	 * float's moments, each rank writing its part (gather_moments). */
	float *ck_m1, *ck_m2;
	/* PARAMETERS: rank 0's host copy of every trainable weight for a
	 * checkpoint or the output, each rank writing its part (gather_weights). */
	float *ck_w;
	struct rank *ranks;     /* [this process's ranks] */
	/* TD_DDP_FAIL_AT=RANK:STEP[:stall], a test hook: that rank fails (or
	 * stalls, as on a hung device, until the others give up) in that step,
	 * before its gradients are summed. fail_rank -1: off. */
	int fail_rank;
	uint64_t fail_step;
	bool fail_stall;
};

struct rank {
	struct gang *gang;
	int r;
	int device;             /* CUDA ordinal, or -1 */
	bool cuda;              /* its backend is CUDA's (device is its GPU) */
	const Traind__JobSpec *spec;
	const struct tr_train_opts *opts;
	struct tr_train_result res;
	struct td_errbuf eb;
	td_err e;
	pthread_t thread;
};

/* The test hook's failure, in rank r at step `step` (1-based). */
static td_err injected_failure(struct gang *G, int r, uint64_t step, struct td_errbuf *eb)
{
	if (!G || G->fail_rank != r || G->fail_step != step)
		return TD_OK;
	td_warn("TD-DDP-FAIL-INJECT", "TD_DDP_FAIL_AT: rank %d %s at step %llu (test hook)", r,
		G->fail_stall ? "stalls" : "fails", (unsigned long long)step);
	if (G->fail_stall) {
		/* A rank that never arrives: the others must give up on it. */
		while (!gpu_gang_failed(G->g))
			nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
		return gpu_gang_barrier(G->g, r, eb);
	}
	return td_fail(eb, TD_EDEVICE, "TD_DDP_FAIL_AT: rank %d failed at step %llu (test hook)", r,
		       (unsigned long long)step);
}

/* A sharded gang's moments into rank 0's host copy (G->ck_m1, ck_m2: every
 * trainable float's), each rank downloading its own part; every rank calls
 * it before a checkpoint. Rank 0 frees the copy once it is written. Host
 * memory as one device's checkpoint takes (save_optimizer), on rank 0. */
static td_err gather_moments(struct job *j, struct gang *G, int r, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(j->m);
	size_t nt = p->numel_trainable;
	if (r == 0) {
		G->ck_m1 = malloc(nt * sizeof(float) + 1);
		G->ck_m2 = malloc(nt * sizeof(float) + 1);
		if (!G->ck_m1 || !G->ck_m2) {
			free(G->ck_m1);
			free(G->ck_m2);
			G->ck_m1 = G->ck_m2 = NULL;
		}
	}
	td_err e = gpu_gang_barrier(G->g, r, eb); /* the copy exists (or not) */
	if (e != TD_OK)
		return e;
	if (G->ck_m1) /* disjoint parts: no lock */
		tr_model_get_moments(j->m, G->ck_m1 + p->shard_lo, G->ck_m2 + p->shard_lo);
	if ((e = gpu_gang_barrier(G->g, r, eb)) != TD_OK) /* every part is in */
		return e;
	if (r == 0 && !G->ck_m1)
		return td_fail(eb, TD_ENOMEM, "checkpoint: out of memory for the moments of %zu floats", nt);
	return TD_OK;
}

/* PARAMETERS and plan.masters_part: the sharded weights into rank 0's host
 * copy (G->ck_w), each rank downloading its part, which rank 0's model then saves from
 * (tr_model_set_whole_weights); every rank calls it before a checkpoint and
 * the output. Rank 0 frees it (drop_weights) once written. */
static td_err gather_weights(struct job *j, struct gang *G, int r, struct td_errbuf *eb)
{
	const struct tr_plan *p = tr_model_plan(j->m);
	size_t nt = p->numel_trainable;
	if (r == 0 && !(G->ck_w = malloc(nt * sizeof(float) + 1)))
		(void)0;
	td_err e = gpu_gang_barrier(G->g, r, eb); /* the copy exists (or not) */
	if (e != TD_OK)
		return e;
	/* the part: all of params (PARAMETERS), or its run of them (masters_part) */
	const float *part = tr_model_params(j->m) +
			    (tr_shard_params(p->opts.shard, p->opts.shard_ranks) ? 0 : p->shard_lo);
	if (G->ck_w && p->shard_hi > p->shard_lo) /* disjoint parts: no lock */
		gpu_download(j->be, G->ck_w + p->shard_lo, part,
			     (p->shard_hi - p->shard_lo) * sizeof(float));
	if ((e = gpu_gang_barrier(G->g, r, eb)) != TD_OK) /* every part is in */
		return e;
	if (r == 0 && !G->ck_w)
		return td_fail(eb, TD_ENOMEM, "checkpoint: out of memory for the weights of %zu floats", nt);
	if (r == 0)
		tr_model_set_whole_weights(j->m, G->ck_w);
	return TD_OK;
}

static void drop_weights(struct job *j, struct gang *G)
{
	if (G && G->ck_w) {
		tr_model_set_whole_weights(j->m, NULL);
		free(G->ck_w);
		G->ck_w = NULL;
	}
}

/* One rank's run (the whole job when G is NULL): rank 0 alone logs, calls
 * the hooks, evaluates and writes checkpoints and the output; every rank
 * reads every micro-batch of a step (the loss is a mean over the valid
 * tokens of all of them) and runs its share. Any failure fails the gang,
 * which every other rank's next barrier or collective wait returns. */
static td_err train_rank(const Traind__JobSpec *spec, const struct tr_train_opts *opts,
			 const struct tr_hooks *hooks, struct tr_train_result *res, struct gang *G,
			 int r, struct td_errbuf *eb)
{
	struct job j = {0};
	const bool lead = r == 0;
	/* This process's first rank: it polls should_stop (a gang of one
	 * process: the lead). */
	const bool head = !G || r == G->base;
	struct rank *self = G ? &G->ranks[r - G->base] : NULL;
	double *lsv = NULL; /* a gang across processes: this rank's micro-batch losses */
	FILE *log = lead && opts ? opts->log : NULL;
	struct gpu_comm *comm = NULL;
	struct tr_ddp *ddp = NULL;
	int32_t *ids = NULL, *labels = NULL, *cls = NULL;
	memset(res, 0, sizeof(*res));
	snprintf(res->output_dir, sizeof(res->output_dir), "%s", spec->output->dir);
	res->eval_loss = NAN;
	double t_start = now_s();
	td_err e = open_job(&j, spec, eb);
	if (e != TD_OK)
		goto out;

	/* A finished output is never silently overwritten or trained again. */
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/trainer_state.json", spec->output->dir);
	struct json_object *done = lead ? json_object_from_file(path) : NULL;
	if (done) {
		struct json_object *v;
		bool final = json_object_object_get_ex(done, "final", &v) && json_object_get_boolean(v);
		json_object_put(done);
		if (final) {
			e = td_fail(eb, TD_ESTATE,
				    "output.dir: %s already holds a finished run; choose another "
				    "output dir or remove it",
				    spec->output->dir);
			goto out;
		}
	}

	/* Data first: a bad row fails the job before any model memory exists.
	 * Rank 0 opens it first (a JSONL file is tokenized into the cache
	 * once); the others then map what it wrote. Only rank 0 evaluates. */
	if (G && !lead && (e = gpu_gang_barrier(G->g, r, eb)) != TD_OK)
		goto out;
	if ((e = tr_data_open_job(&j.data, spec, &j.cfg, false, log, eb)) != TD_OK ||
	    ((lead || (G && tr_method_shard(spec) == TR_SHARD_PARAMETERS)) && spec->data->eval_file &&
	     (e = tr_data_open_job(&j.eval, spec, &j.cfg, true, log, eb)) != TD_OK))
		goto out;
	if (G && lead && (e = gpu_gang_barrier(G->g, r, eb)) != TD_OK)
		goto out;
	uint64_t per_step = (uint64_t)j.B * (uint64_t)j.accum;
	if (spec->hyper->has_max_steps && spec->hyper->max_steps)
		j.total = spec->hyper->max_steps;
	else
		j.total = (uint64_t)ceil(spec->hyper->epochs * (double)tr_data_num_sequences(j.data) /
					 (double)per_step);
	if (j.total == 0)
		j.total = 1;

	struct tr_weights *w = NULL;
	if ((e = tr_weights_open(&w, spec->model_dir, eb)) != TD_OK)
		goto out;
	int device = G ? self->device
		       : opts && opts->has_device && opts->device_index >= 0 ? opts->device_index : -1;
	struct gpu_open_opts bo = {.name = backend_for(spec, opts), .device = device,
				   .cache_dir = opts ? opts->cache_dir : NULL};
	if ((e = gpu_backend_open_opts(&j.be, &bo, eb)) != TD_OK) {
		tr_weights_close(w);
		goto out;
	}
	if (G)
		self->cuda = strcmp(j.be->ops->name, "cuda") == 0;
	/* Precision: as asked; unset means bf16 on a GPU and fp32 on the CPU.
	 * Set before the model is built: its plan follows the attention the
	 * backend runs in this precision. */
	Traind__Precision prec = spec->hyper->precision;
	bool bf16 = prec == TRAIND__PRECISION__PRECISION_BF16 ||
		    (prec == TRAIND__PRECISION__PRECISION_UNSPECIFIED && strcmp(j.be->ops->name, "cpu") != 0);
	if ((e = gpu_set_bf16(j.be, bf16, eb)) != TD_OK) {
		tr_weights_close(w);
		goto out;
	}
	/* One device, a LoRA base and a key from the daemon: the base is
	 * the process's shared one for that key, loaded by the first job. */
	bool share = !G && opts && opts->bases && opts->base_key && opts->base_key[0] &&
		     tr_method_can_share_base(spec) && gpu_can_share(j.be);
	if (share) {
		char sig[65];
		size_t bytes = 0;
		bool load = false;
		if ((e = tr_method_base_layout(spec, &j.cfg, j.be, j.B, j.T, sig, &bytes, eb)) != TD_OK ||
		    (e = tr_bases_acquire(opts->bases, j.be, device, opts->base_key, sig, bytes, &j.base,
					  &load, eb)) != TD_OK) {
			tr_weights_close(w);
			goto out;
		}
		j.bases = opts->bases;
		j.base_loading = load;
		char now[65];
		if (load && opts->base_digest &&
		    ((e = tr_base_files_digest(spec->model_dir, now, eb)) != TD_OK ||
		     (strcmp(now, opts->base_digest) != 0 &&
		      (e = td_fail(eb, TD_ESTATE,
				   "model_dir: %s: its weights changed since the job was queued "
				   "(digest %.16s..., then %.16s...); submit it again",
				   spec->model_dir, now, opts->base_digest)) != TD_OK))) {
			tr_weights_close(w);
			goto out;
		}
		e = tr_method_new_shared(&j.meth, spec, &j.cfg, j.be, j.B, j.T, tr_base_ptr(j.base),
					 bytes, !load, eb);
		res->base_shared = true;
		res->base_loaded = load;
		res->base_bytes = bytes;
	} else {
		e = tr_method_new(&j.meth, spec, &j.cfg, j.be, j.B, j.T, r, G ? G->n : 1, eb);
	}
	if (e != TD_OK) {
		tr_weights_close(w);
		goto out;
	}
	j.m = tr_method_model(j.meth);
	tr_method_set_pad_id(j.meth, tr_data_pad_id(j.data)); /* what a classifier pools past */
	if (log) {
		fprintf(log, "job %s: %s on %s (%s, %s), %llu steps of %d x %d x %d tokens\n", spec->name,
			j.cfg.model_type, j.be->ops->name, j.be->device, bf16 ? "bf16" : "fp32",
			(unsigned long long)j.total, j.accum, j.B, j.T);
		tr_method_print(j.meth, log);
	}

	/* Every rank loads the same weights (the checkpoint's, or the model
	 * dir's and the method's seeded initialisation): identical from the
	 * start, and the same sums and updates keep them so. */
	uint64_t steps[4096];
	size_t nck = list_checkpoints(j.ckpt_root, steps, 4096);
	if (nck) {
		tr_weights_close(w);
		w = NULL;
		if ((e = load_checkpoint(&j, steps[nck - 1], eb)) != TD_OK)
			goto out;
		res->resumed_from = j.step;
		if (log)
			fprintf(log, "resumed from %s/step-%08llu (data epoch %llu, sequence %llu)\n",
				j.ckpt_root, (unsigned long long)j.step, (unsigned long long)j.pos.epoch,
				(unsigned long long)j.pos.index);
	} else {
		e = tr_method_load_initial(j.meth, w, eb);
		tr_weights_close(w);
		w = NULL;
		if (e != TD_OK)
			goto out;
	}
	if (j.base_loading) {
		/* Loaded (a checkpoint's load reads the base from model_dir too):
		 * sealed read-only, and the jobs waiting for it attach. */
		if ((e = gpu_sync(j.be, eb)) != TD_OK)
			goto out;
		bool sealed = false;
		tr_base_ready(j.bases, j.base, j.be, TD_OK, &sealed);
		j.base_loading = false;
		res->base_sealed = sealed;
	}
	if (j.base && log)
		fprintf(log, "frozen base: shared (%s; %d jobs on it now)%s\n",
			res->base_loaded ? "loaded by this job" : "attached",
			tr_bases_refs(j.bases, opts->base_key, device),
			res->base_loaded ? res->base_sealed ? ", read-only to the device"
							    : ", writable (the device cannot map it read-only)"
					 : "");

	/* Across processes every rank must start from the same step: the
	 * newest checkpoint of one directory, seen alike from every host. Each
	 * rank holds its step against the gang's sum of them. */
	if (G && G->net) {
		double v = (double)j.step;
		bool no = false;
		if ((e = gpu_gang_exchange(G->g, r, &v, 1, &no, eb)) != TD_OK)
			goto out;
		if (v != (double)j.step * G->n) {
			e = td_fail(eb, TD_ESTATE,
				    "rank %d resumed from step %llu, and the gang's %d ranks did not all "
				    "(their steps sum to %.0f): output.dir %s must be the same directory on "
				    "every host of the job",
				    r, (unsigned long long)j.step, G->n, v, spec->output->dir);
			goto out;
		}
	}

	/* This rank's micro-batches of each step, and its end of the sums. */
	int a0 = 0, a1 = j.accum;
	if (G) {
		tr_ddp_share(j.accum, G->n, r, &a0, &a1);
		if ((e = gpu_comm_new(&comm, G->g, r, j.be, G->comm, eb)) != TD_OK ||
		    (e = tr_ddp_new(&ddp, j.m, comm, G->bucket_floats, G->overlap, eb)) != TD_OK)
			goto out;
		tr_ddp_set_accum(ddp, j.accum);
		if (log)
			fprintf(log, "data parallel: %d ranks (%s), %d micro-batches of each step's %d on "
				     "each%s; gradients summed over %s%s\n",
				G->n, j.be->ops->name, a1 - a0, j.accum,
				j.accum % G->n ? " or one more (grad_accum is not a multiple of the ranks)" : "",
				gpu_comm_name(comm),
				gpu_comm_async(comm) ? ", by buckets during the backward" : "");
	}
	const struct tr_plan *jp = tr_model_plan(j.m);
	const bool sharded = G && jp->opts.shard != TR_SHARD_NONE && jp->opts.shard_ranks > 1;
	/* PARAMETERS: every rank takes part in each forward's gathers, so
	 * every rank runs the evaluation (the same batches); rank 0 reports.
	 * The same where the masters are the part's (plan.masters_part: the
	 * lookup goes by rows); both save from the parts gathered. */
	const bool wpart = G && tr_shard_params(jp->opts.shard, jp->opts.shard_ranks);
	const bool wsharded = wpart || (G && jp->masters_part);
	if (sharded && G->net) {
		e = td_fail(eb, TD_EINVAL,
			    "memory.shard: %s across processes is not built (a checkpoint gathers the "
			    "moments in one process); NONE",
			    tr_shard_name(jp->opts.shard));
		goto out;
	}
	if (sharded && log)
		fprintf(log, "sharded: %s; each rank keeps the AdamW moments%s of %zu of the %zu trainable "
			     "floats and steps them; %s\n",
			tr_shard_name(jp->opts.shard),
			wsharded ? ", summed gradients and fp32 weights"
			: tr_shard_grads(jp->opts.shard, jp->opts.shard_ranks) ? " and summed gradients"
									       : "",
			jp->shard_numel, jp->numel_trainable,
			wpart ? "a layer's weights are gathered a layer ahead of each use"
			: wsharded ? "their bf16 copy and the norms' and biases' weights are all-gathered "
				     "after each step"
				   : "the weights are all-gathered after each step");

	struct tr_adamw hp = {
		.beta1 = (float)spec->hyper->beta1,
		.beta2 = (float)spec->hyper->beta2,
		.eps = (float)spec->hyper->eps,
		.weight_decay = (float)spec->hyper->weight_decay,
	};
	size_t rows = (size_t)j.B * (size_t)j.T;
	ids = malloc(rows * (size_t)j.accum * sizeof(int32_t));
	labels = malloc(rows * (size_t)j.accum * sizeof(int32_t));
	cls = malloc((size_t)j.B * (size_t)j.accum * sizeof(int32_t));
	if (G && G->net)
		lsv = calloc((size_t)j.accum, sizeof(double));
	if (!ids || !labels || !cls || (G && G->net && !lsv)) {
		e = td_fail(eb, TD_ENOMEM, "trainer: out of memory");
		goto out;
	}
	double t0 = now_s(), loss = 0;
	uint64_t start_step = j.step, ckpt_every = spec->output->checkpoint_every;
	while (j.step < j.total) {
		/* All micro-batches first: the loss is a mean over every valid
		 * token of the step, so their count must be known before backward.
		 * Every rank reads them all (and so keeps the data position). */
		int64_t valid = 0;
		for (int a = 0; a < j.accum && e == TD_OK; a++) {
			e = tr_data_next(j.data, &j.pos, ids + a * rows, labels + a * rows, cls + (size_t)a * j.B,
					 j.B, eb);
			if (e == TD_OK)
				valid += tr_method_count_valid(j.meth, labels + a * rows, cls + (size_t)a * j.B);
		}
		if (e != TD_OK)
			break;
		tr_model_zero_grad(j.m);
		double loss_sum = 0;
		if (lsv)
			memset(lsv, 0, (size_t)j.accum * sizeof(double));
		const float dloss = valid ? (float)(1.0 / (double)valid) : 0.0f;
		/* Sharded gradients are summed every micro-batch: every rank runs
		 * as many rounds as the largest share, a short one an empty
		 * round (train/ddp.h). */
		const bool gr = ddp && tr_ddp_sharded_grads(ddp);
		const int rounds = gr ? (j.accum + G->n - 1) / G->n : a1 - a0;
		for (int k = 0; k < rounds && e == TD_OK; k++) {
			const int a = a0 + k;
			double ls;
			int64_t nv;
			if (a >= a1) {
				e = tr_ddp_micro_empty(ddp, eb);
				continue;
			}
			if (gr && (e = tr_ddp_micro_begin(ddp, eb)) != TD_OK)
				break;
			tr_method_fuse_head(j.meth, dloss);
			e = tr_method_forward(j.meth, ids + a * rows, labels + a * rows, cls + (size_t)a * j.B,
					      j.step * (uint64_t)j.accum + (uint64_t)a, &ls, &nv, eb);
			if (e == TD_OK && a == a1 - 1)
				e = injected_failure(G, r, j.step + 1, eb);
			if (e == TD_OK) {
				loss_sum += ls;
				if (lsv)
					lsv[a] = ls;
				else if (G)
					G->ls[(j.step & 1) * (uint64_t)j.accum + (uint64_t)a] = ls;
				if (ddp && a == a1 - 1)
					tr_ddp_arm(ddp); /* its layers' sums overlap the layers below */
				tr_model_backward(j.m, dloss);
				if (gr)
					e = tr_ddp_micro_end(ddp, eb);
			}
		}
		/* The ranks' gradients summed: every rank holds the step's. */
		if (e == TD_OK && ddp && (e = tr_ddp_finish(ddp, eb)) != TD_OK) {
			/* Behind an NCCL error may be this device's own (a lost
			 * context): the job's error names that, as a sync would. */
			struct td_errbuf why = {{0}};
			td_err de = gpu_sync(j.be, &why);
			if (de != TD_OK) {
				e = de;
				*eb = why;
				gpu_gang_refine(G->g, r, e, eb->msg);
			}
		}
		if (e != TD_OK)
			break;
		/* The step's last stage (train/plan.h: TR_STAGE_OPTIMIZER), after
		 * each micro-batch's forward and backward stages. */
		assert(tr_model_plan(j.m)->stages[tr_model_plan(j.m)->nstages - 1].kind ==
		       TR_STAGE_OPTIMIZER);
		double norm;
		if (gr) { /* the ranks' parts' norm */
			if ((e = tr_ddp_grad_norm(ddp, &norm, eb)) != TD_OK)
				break;
			tr_model_clip_grads_by(j.m, spec->hyper->clip_norm, norm);
		} else {
			norm = tr_model_clip_grads(j.m, spec->hyper->clip_norm);
		}
		if (!isfinite(norm)) {
			/* A device fault makes the reduction NaN too: report the
			 * fault (its name, and whether the context is lost), not NaN. */
			if ((e = gpu_sync(j.be, eb)) == TD_OK)
				e = td_fail(eb, TD_ENUMERIC, "step %llu: gradient norm is %g",
					    (unsigned long long)j.step + 1, norm);
			break;
		}
		double lr = tr_lr_at(spec->hyper, j.step, j.total);
		/* Sharded: each rank steps its part; the weights made whole. */
		if (ddp)
			e = tr_ddp_step(ddp, &hp, (float)lr, (int)(j.step + 1), eb);
		else
			tr_model_adamw(j.m, &hp, (float)lr, (int)(j.step + 1));
		if (e != TD_OK)
			break;
		if ((e = gpu_sync(j.be, eb)) != TD_OK)
			break;
		j.step++;

		/* Rank 0 asks whether to stop; the ranks agree at the step's end
		 * (and learn the other ranks' losses there). */
		bool stop = head && ((hooks && hooks->should_stop && hooks->should_stop(hooks->ctx)) ||
				     (opts && opts->stop_after && j.step - start_step >= opts->stop_after));
		if (G && G->net) {
			/* Across processes: the losses and any process's stop,
			 * through the hub. Each micro-batch's loss is one rank's,
			 * the others' 0: the sums are those losses exactly. */
			if ((e = gpu_gang_exchange(G->g, r, lsv, (size_t)j.accum, &stop, eb)) != TD_OK)
				break;
			loss_sum = 0; /* in micro-batch order, as one device sums them */
			for (int a = 0; a < j.accum; a++)
				loss_sum += lsv[a];
		} else if (G) {
			uint64_t par = (j.step - 1) & 1;
			if (lead)
				G->stop[par] = stop;
			if ((e = gpu_gang_barrier(G->g, r, eb)) != TD_OK)
				break;
			stop = G->stop[par];
			loss_sum = 0; /* in micro-batch order, as one device sums them */
			for (int a = 0; a < j.accum; a++)
				loss_sum += G->ls[par * (uint64_t)j.accum + (uint64_t)a];
		}
		loss = valid ? loss_sum / (double)valid : 0;
		if (j.step == start_step + 1) {
			res->first_loss = loss;
			res->first_step_s = now_s() - t_start;
		}
		res->last_loss = loss;

		double el = now_s() - t0;
		struct tr_progress pr = {
			.step = j.step,
			.total_steps = j.total,
			.loss = loss,
			.lr = lr,
			.grad_norm = norm,
			.elapsed_s = el,
			.tokens_per_s = (double)(j.step - start_step) * (double)(rows * j.accum) / el,
			.eta_s = el / (double)(j.step - start_step) * (double)(j.total - j.step),
		};
		if (log)
			fprintf(log, "step %6llu/%llu  loss %.4f  lr %.3e  grad_norm %.3f  tok/s %.0f  eta %.0fs\n",
				(unsigned long long)pr.step, (unsigned long long)pr.total_steps, pr.loss,
				pr.lr, pr.grad_norm, pr.tokens_per_s, pr.eta_s);
		if (lead && hooks && hooks->on_step)
			hooks->on_step(hooks->ctx, &pr);
		uint64_t eval_every = spec->data->eval_every ? spec->data->eval_every : ckpt_every;
		bool eval_due = spec->data->eval_file && ((eval_every && j.step % eval_every == 0) ||
							  j.step == j.total);
		bool ckpt_due = (ckpt_every && j.step % ckpt_every == 0) || (stop && j.step < j.total);
		/* Sharded moments (and weights): every rank's part into rank 0's
		 * copy first. */
		if (ckpt_due && G && sharded && (e = gather_moments(&j, G, r, eb)) != TD_OK)
			break;
		if (ckpt_due && G && wsharded && (e = gather_weights(&j, G, r, eb)) != TD_OK)
			break;
		if ((lead || wsharded) && eval_due) {
			e = evaluate(&j, ids, labels, log, &res->eval_loss, eb);
			if (e == TD_OK && wsharded)
				e = tr_ddp_check(ddp, eb);
		}
		if (lead && ckpt_due && e == TD_OK) {
			if ((e = tr__mkdir_p(j.ckpt_root, eb)) == TD_OK &&
			    (e = write_checkpoint(&j, loss, G ? G->ck_m1 : NULL, G ? G->ck_m2 : NULL,
						  eb)) == TD_OK) {
				prune_checkpoints(&j);
				if (log)
					fprintf(log, "checkpoint %s/step-%08llu\n", j.ckpt_root,
						(unsigned long long)j.step);
				if (hooks && hooks->on_checkpoint) {
					snprintf(path, sizeof(path), "%s/step-%08llu", j.ckpt_root,
						 (unsigned long long)j.step);
					hooks->on_checkpoint(hooks->ctx, j.step, path);
				}
			}
		}
		if (lead && G && G->ck_m1) {
			free(G->ck_m1);
			free(G->ck_m2);
			G->ck_m1 = G->ck_m2 = NULL;
		}
		if (lead)
			drop_weights(&j, G);
		/* The others wait for rank 0's evaluation and checkpoint here, not
		 * in a collective wait (which has a timeout). */
		if (G && e != TD_OK)
			gpu_gang_fail(G->g, r, e, eb->msg);
		if (G && (eval_due || ckpt_due) && e == TD_OK)
			e = gpu_gang_barrier(G->g, r, eb);
		if (e != TD_OK)
			break;
		if (stop && j.step < j.total) {
			res->stopped = true;
			break;
		}
	}
	res->steps_done = j.step;
	res->total_steps = j.total;
	if (ddp && log && e == TD_OK) {
		struct tr_ddp_stats st;
		tr_ddp_get_stats(ddp, &st);
		if (st.steps)
			fprintf(log, "data parallel: %.1f sums a step during the backward, %.1f after it, "
				     "%.1f M floats a step; the embedding's rows %.1f M floats a step\n",
				(double)st.overlapped / (double)st.steps, (double)st.at_finish / (double)st.steps,
				(double)st.floats / (double)st.steps / 1e6, (double)st.rows / (double)st.steps / 1e6);
	}
	/* PARAMETERS, masters_part: the output is saved from the gathered weights */
	if (wsharded && e == TD_OK && !res->stopped)
		e = gather_weights(&j, G, r, eb);
	if (lead && e == TD_OK && !res->stopped) {
		if ((e = save_params(&j, spec->output->dir, j.cfg.dtype, eb)) != TD_OK ||
		    (e = gpu_sync(j.be, eb)) != TD_OK) /* a device error: not a finished model */
			goto out;
		struct json_object *o = state_json(&j, true, loss);
		snprintf(path, sizeof(path), "%s/trainer_state.json", spec->output->dir);
		e = write_json(path, o, eb);
		json_object_put(o);
		if (e == TD_OK && log)
			fprintf(log, "wrote %s (%s, step %llu, loss %.4f)\n", spec->output->dir,
				tr_dtype_name(j.cfg.dtype), (unsigned long long)j.step, loss);
	}
out:
	if (G && e != TD_OK)
		gpu_gang_fail(G->g, r, e, eb->msg);
	if (lead)
		drop_weights(&j, G);
	free(lsv);
	free(ids);
	free(labels);
	free(cls);
	tr_ddp_free(ddp);
	gpu_comm_free(comm); /* aborts a communicator with sums in flight */
	if (j.be) {
		snprintf(res->device, sizeof(res->device), "%s", j.be->device);
		res->compiles = j.be->compiles;
		res->compiles_after_seal = j.be->compiles_after_seal;
		res->cache = j.be->cache_entry;
		if (log) {
			fprintf(log, "backend %s (%s): %lld kernel compiles, %lld after seal; first step %.2fs after start",
				j.be->ops->name, j.be->device, (long long)res->compiles,
				(long long)res->compiles_after_seal, res->first_step_s);
			/* where the backend records graphs: how many layer stages ran as
			 * one (train/model.c: STAGED) */
			if (j.be->ops->graph_begin)
				fprintf(log, "; %lld layer stages launched as graphs",
					(long long)j.be->graph_launches);
			fputc('\n', log);
		}
	}
	close_job(&j);
	return e;
}

static void *rank_main(void *arg)
{
	struct rank *rk = arg;
	rk->e = train_rank(rk->spec, rk->opts, NULL, &rk->res, rk->gang, rk->r, &rk->eb);
	return NULL;
}

/* $name as a decimal count, or def. */
static long long env_count(const char *name, long long def)
{
	const char *v = getenv(name);
	char *end;
	long long x = v && *v ? strtoll(v, &end, 10) : -1;
	return v && *v && !*end && x >= 0 ? x : def;
}

td_err tr_train(const Traind__JobSpec *spec, const struct tr_train_opts *opts,
		const struct tr_hooks *hooks, struct tr_train_result *res, struct td_errbuf *eb)
{
	int n = opts && opts->ranks > 1 ? opts->ranks : 1; /* this process's ranks */
	const bool net = opts && opts->hub;
	if (n == 1 && !net) {
		td_err e = train_rank(spec, opts, hooks, res, NULL, 0, eb);
		res->ranks = 1;
		res->failed_rank = e != TD_OK ? 0 : -1;
		res->failed_device = e != TD_OK && opts && opts->has_device ? opts->device_index : -1;
		return e;
	}
	memset(res, 0, sizeof(*res));
	res->failed_rank = res->failed_device = -1;
	res->eval_loss = NAN;
	snprintf(res->output_dir, sizeof(res->output_dir), "%s", spec->output->dir);
	const int world = net ? opts->world : n, base = net ? opts->rank_base : 0;
	if (world > GPU_GANG_MAX)
		return td_fail(eb, TD_EINVAL, "resources.gpus: %d; data parallel runs at most %d ranks",
			       world, GPU_GANG_MAX);
	if (net && (base < 0 || base + n > world || !opts->hub_token))
		return td_fail(eb, TD_EINVAL, "ranks %d to %d of a gang of %d", base, base + n - 1, world);
	uint32_t accum = spec->hyper->grad_accum ? spec->hyper->grad_accum : 1;
	if (accum < (uint32_t)world)
		return td_fail(eb, TD_EINVAL,
			       "hyper.grad_accum: %u micro-batches a step cannot be shared by %d GPUs "
			       "(resources.gpus%s): each runs at least one, so the step is one GPU's; set "
			       "grad_accum to a multiple of %d",
			       accum, world, net ? " on each of resources.hosts and this daemon" : "",
			       world);

	struct gang G = {.n = world, .base = base, .net = net, .fail_rank = -1};
	G.comm = opts->comm == GPU_COMM_HOST || opts->comm == GPU_COMM_NCCL ? (enum gpu_comm_kind)opts->comm
									    : GPU_COMM_AUTO;
	const char *ck = getenv("TD_DDP_COMM");
	enum gpu_comm_kind k;
	if (G.comm == GPU_COMM_AUTO && ck && *ck && gpu_comm_kind_parse(ck, &k))
		G.comm = k;
	long long bf = env_count("TD_DDP_BUCKET_FLOATS", 0);
	G.bucket_floats = opts->bucket_floats ? opts->bucket_floats : (size_t)bf;
	G.overlap = bf > 0 && !opts->bucket_floats;
	const char *fa = getenv("TD_DDP_FAIL_AT");
	if (fa && *fa) {
		unsigned long long st = 0;
		char how[16] = "";
		if (sscanf(fa, "%d:%llu:%15s", &G.fail_rank, &st, how) < 2 || st == 0)
			return td_fail(eb, TD_EINVAL, "TD_DDP_FAIL_AT: '%s' is not RANK:STEP[:stall]", fa);
		G.fail_step = st;
		G.fail_stall = strcmp(how, "stall") == 0;
	}
	int timeout = opts->comm_timeout_ms > 0 ? opts->comm_timeout_ms
						: (int)env_count("TD_DDP_TIMEOUT_MS", 0);
	G.ls = calloc(2 * (size_t)accum, sizeof(double));
	G.ranks = calloc((size_t)n, sizeof(*G.ranks));
	td_err e = TD_OK;
	if (!G.ls || !G.ranks)
		e = td_fail(eb, TD_ENOMEM, "data parallel: out of memory");
	if (e == TD_OK)
		e = net ? gpu_gang_new_net(&G.g, world, base, n, opts->hub, opts->hub_token,
					   opts->hub_label, timeout, eb)
			: gpu_gang_new(&G.g, n, timeout, eb);
	if (e == TD_OK && net && opts->abort)
		gpu_gang_set_abort(G.g, opts->abort, opts->abort_why);
	if (e != TD_OK) {
		free(G.ls);
		free(G.ranks);
		return e;
	}
	for (int k = 0; k < n; k++)
		G.ranks[k] = (struct rank){.gang = &G, .r = base + k, .spec = spec, .opts = opts,
					   .device = opts->devices ? opts->devices[k] : k};
	/* Ranks 1.. on threads of their own (which inherit this thread's file
	 * credentials: a daemon's runner has taken the submitter's), rank 0
	 * here. */
	int started = 1;
	for (int r = 1; r < n; r++, started++) {
		int rv = pthread_create(&G.ranks[r].thread, NULL, rank_main, &G.ranks[r]);
		if (rv != 0) {
			char msg[160];
			snprintf(msg, sizeof(msg), "data parallel: cannot start rank %d's thread: %s", r,
				 strerror(rv));
			gpu_gang_fail(G.g, r, TD_EINTERNAL, msg);
			break;
		}
	}
	td_err e0 = train_rank(spec, opts, hooks, res, &G, base, eb);
	for (int r = 1; r < started; r++)
		pthread_join(G.ranks[r].thread, NULL);
	res->failed_rank = res->failed_device = -1;
	int fr = -1;
	e = gpu_gang_error(G.g, &fr, eb);
	if (e == TD_OK)
		e = e0;
	else if (fr >= 0 && fr < world) {
		char msg[sizeof(eb->msg)];
		snprintf(msg, sizeof(msg), "%s", eb->msg);
		res->failed_rank = fr;
		/* Another process's rank: its GPU is that daemon's. */
		bool here = fr >= base && fr < base + n;
		res->failed_device = here && G.ranks[fr - base].cuda ? G.ranks[fr - base].device : -1;
		if (fr == base)
			td_fail(eb, e, "%s", msg);
		else if (res->failed_device >= 0)
			td_fail(eb, e, "rank %d of %d (CUDA device %d): %s", fr, world, res->failed_device,
				msg);
		else
			td_fail(eb, e, "rank %d of %d: %s", fr, world, msg);
	}
	res->ranks = world;
	for (int r = 1; r < started; r++) {
		res->compiles += G.ranks[r].res.compiles;
		res->compiles_after_seal += G.ranks[r].res.compiles_after_seal;
	}
	if (res->device[0]) {
		size_t l = strlen(res->device);
		if (net)
			snprintf(res->device + l, sizeof(res->device) - l, " (x%d of %d ranks)", n, world);
		else
			snprintf(res->device + l, sizeof(res->device) - l, " (x%d)", n);
	}
	gpu_gang_free(G.g);
	free(G.ck_w);
	free(G.ck_m1); /* a checkpoint's gather that a failure cut short */
	free(G.ck_m2);
	free(G.ls);
	free(G.ranks);
	return e;
}
