/* The step loop: one job from its spec to its output directory.
 *
 * Load config and weights, open the data, build the plan, allocate, resume from
 * the newest complete checkpoint in <output>/checkpoints if there is one, then
 * loop { micro-batches: forward, loss, backward } clip, schedule, AdamW,
 * metrics, checkpoint — and write the final model. Checkpoints are written to a
 * temporary directory and renamed into place, so a crash leaves the previous
 * checkpoint intact; resuming from one reproduces the uninterrupted run bit for
 * bit (same backend, same build).
 *
 * Runs on the calling thread and blocks until the job ends. The daemon's runner
 * threads call it with hooks; `traind --run` calls it directly. */
#ifndef TRAIN_TRAINER_H
#define TRAIN_TRAINER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "gpu/backend.h"
#include "proto/err.h"
#include "traind.pb-c.h"

struct tr_bases;

struct tr_progress {
	uint64_t step, total_steps;
	double loss;        /* mean over the step's valid tokens */
	double lr;
	double grad_norm;   /* before clipping */
	double tokens_per_s;
	double elapsed_s;   /* since this process started the job */
	double eta_s;
};

struct tr_hooks {
	/* Called after every optimizer step (on the training thread). */
	void (*on_step)(void *ctx, const struct tr_progress *p);
	/* Called after a checkpoint is complete on disk. */
	void (*on_checkpoint)(void *ctx, uint64_t step, const char *dir);
	/* Polled at step boundaries; true stops the job after a checkpoint. */
	bool (*should_stop)(void *ctx);
	void *ctx;
};

struct tr_train_opts {
	const char *backend;    /* "cpu", "cuda", "auto"; NULL: from resources.device */
	FILE *log;              /* plan and progress lines; NULL: silent */
	uint64_t stop_after;    /* stop (as if asked) after this many steps in this run; 0: never */
	/* The CUDA device ordinal, used when has_device (zeroed opts mean no
	 * choice: $TD_CUDA_DEVICE, else device 0, as before). The daemon sets it
	 * to the GPU the job was placed on. The CPU backend ignores it. */
	bool has_device;
	int device_index;
	/* The module cache's directory (gpu/select.h: gpu_open_opts.cache_dir):
	 * kernels the CUDA backend compiles on this host are kept there for the
	 * next job and process. NULL: no cache, PTX is compiled every time. */
	const char *cache_dir;
	/* Data parallel (issue 12): ranks > 1 trains on that many devices at
	 * once, one thread, backend and model each (rank 0 is the calling
	 * thread: it alone logs, calls the hooks, evaluates and writes the
	 * checkpoints and the output). The step's hyper.grad_accum micro-batches
	 * are split between the ranks (train/ddp.h: tr_ddp_share; at least one
	 * each, so grad_accum >= ranks), so the global batch, the data order and
	 * the loss's normalisation are one device's with the same spec; the
	 * gradients are summed (gpu/comm.h) and every rank steps AdamW alike.
	 * devices: the ranks' CUDA ordinals (NULL: 0 .. ranks - 1); the CPU
	 * backend runs every rank on the CPU. comm: GPU_COMM_AUTO (NCCL on the
	 * CUDA backend, in-process elsewhere), or forced; $TD_DDP_COMM=host|nccl
	 * overrides AUTO. bucket_floats: 0 for TR_DDP_BUCKET_FLOATS
	 * ($TD_DDP_BUCKET_FLOATS sets it, and makes even the in-process comm sum
	 * by buckets during the backward: a test hook). comm_timeout_ms: each
	 * collective wait's bound (0: $TD_DDP_TIMEOUT_MS, else
	 * GPU_COMM_TIMEOUT_MS). A checkpoint of ranks > 1 is the same as one
	 * device's: it resumes on any number of ranks. */
	int ranks;
	const int *devices;
	/* A frozen base shared with the process's other jobs (train/base.h):
	 * a LoRA or QLoRA job of one rank whose base_key is set takes its
	 * base from bases under that key on its device (the CUDA ordinal; -1
	 * the CPU), loading it if it is the first, instead of holding its
	 * own; its results are the same bits either way. base_digest: the
	 * model dir's tr_base_files_digest when the key was made; the job that
	 * loads the base checks it again (TD_ESTATE when the files changed).
	 * NULL: the job holds its own base. */
	struct tr_bases *bases;
	const char *base_key;
	const char *base_digest;
	int comm;               /* enum gpu_comm_kind */
	size_t bucket_floats;
	int comm_timeout_ms;
	/* One job across processes (daemons: resources.hosts): hub set, this
	 * process runs ranks rank_base .. rank_base + ranks - 1 of world (ranks
	 * may be 1), joined through the gang's hub at hub ("HOST:PORT",
	 * gpu/comm.h: gpu_hub) with hub_token; hub_label names this process in
	 * the others' errors. Rank 0 (rank_base 0) alone logs, calls on_step and
	 * on_checkpoint, evaluates and writes; every process's first rank polls
	 * should_stop, and the ranks stop together when any asks (the job's
	 * checkpoint is rank 0's). Every rank resumes from the newest checkpoint
	 * under output.dir, which must be the same directory for all (they check
	 * that they resumed the same step). memory.shard must be NONE. */
	const char *hub;
	const uint8_t *hub_token; /* GPU_HUB_TOKEN_BYTES */
	const char *hub_label;
	int world, rank_base;
	/* Across processes: once *abort is true the run fails at its next
	 * wait for the others with TD_EPEER_LOST and abort_why, read then
	 * (gpu/comm.h: gpu_gang_set_abort); NULL: never. */
	const atomic_bool *abort;
	const char *abort_why;
};

struct tr_train_result {
	uint64_t resumed_from;  /* step of the checkpoint resumed from, 0 if none */
	uint64_t steps_done;    /* the step reached */
	uint64_t total_steps;
	double first_loss, last_loss;
	double eval_loss;       /* the last evaluation of data.eval_file (mean token loss); NAN if none ran */
	bool stopped;           /* stopped early (should_stop / stop_after) */
	double first_step_s;    /* from the call to the end of the first step: start-up cost */
	char device[128];       /* the backend's device ("cpu" or the GPU's name) */
	int64_t compiles;       /* kernel compiles by the backend during the job */
	int64_t compiles_after_seal; /* of those, after the kernel table was sealed: 0 (contract 2) */
	struct gpu_cache_entry cache; /* the module-cache entry the backend used; key "" if none */
	char output_dir[4096];
	int ranks;              /* data parallel: how many ranks trained (1: one device) */
	/* A failed job of several ranks: the rank whose error is returned (the
	 * first to fail) and its CUDA ordinal (-1: none, or not on a GPU). */
	int failed_rank, failed_device;
	/* The frozen base: shared through tr_train_opts.bases; loaded by this
	 * job (else attached to one loaded); sealed read-only by the device;
	 * its bytes (in none of this job's own). */
	bool base_shared, base_loaded, base_sealed;
	size_t base_bytes;
};

/* spec must have had rpc_jobspec_apply_defaults and pass rpc_jobspec_validate. */
td_err tr_train(const Traind__JobSpec *spec, const struct tr_train_opts *opts,
		const struct tr_hooks *hooks, struct tr_train_result *res, struct td_errbuf *eb);

/* The plan for spec without loading weights (reads config.json only). */
td_err tr_train_plan(const Traind__JobSpec *spec, FILE *out, struct td_errbuf *eb);

/* Learning rate at 0-based optimizer step s of total, as transformers'
 * schedulers compute it (the scheduler steps after the optimizer, so the first
 * step of a warmup uses s = 0). */
double tr_lr_at(const Traind__Hyper *h, uint64_t s, uint64_t total);

#endif
