/* What the daemon checks about a submitted job before it queues it, and the
 * memory plan's bytes that admission reserves.
 *
 * dmn_spec_check_paths() is cheap and runs anywhere: every path in the spec
 * must be absolute (trainctl makes them so; the daemon has no idea of the
 * client's working directory). dmn_preflight() touches the file system as the
 * submitter — it must run on a worker thread: model_dir and its config.json,
 * the data files, adapter and teacher dirs must be readable, the output dir
 * writable (or creatable), and the plan is built from config.json. Every
 * error names the spec field and the path ("model_dir: /x: no such
 * directory"). A check passing here does not make the job's run succeed (files
 * change); the runner reports what happens then. */
#ifndef DAEMON_PREFLIGHT_H
#define DAEMON_PREFLIGHT_H

#include <stdbool.h>
#include <stdint.h>

#include "daemon/identity.h"
#include "proto/err.h"
#include "train/plan.h"
#include "traind.pb-c.h"

/* A job's memory plan as admission sees it (contract 1). With
 * memory.recompute AUTO (or unset) and no memory.max_bytes the scheduler
 * chooses the recompute policy where it places the job — the fastest whose
 * plan the GPU can grant — so the plan's total is known per policy:
 * by_policy[k] under enum tr_recompute k (teacher included), and bytes is
 * NONE's. Otherwise auto_policy is false and bytes is the plan of the
 * policy the spec fixes (or that memory.max_bytes chose). The host bytes
 * beside them (train/plan.h: TR_ARENA_HOST, FULL_OFFLOAD's pinned memory)
 * are in no lease: host_bytes, host_by_policy, for what the job says. */
struct dmn_plan_bytes {
	uint64_t bytes;
	bool auto_policy;
	uint64_t by_policy[TR_RECOMPUTE_COUNT];
	uint64_t host_bytes;
	uint64_t host_by_policy[TR_RECOMPUTE_COUNT];
	/* A frozen base the job may share with others on its GPU (train/base.h:
	 * a LoRA or QLoRA job of one GPU with memory.share_base): the base
	 * arena's bytes (part of bytes and of each by_policy) and the model
	 * dir's files digest; 0 and "" when it may not. */
	uint64_t base_bytes;
	char base_digest[65];
	/* memory.shard AUTO (or unset) on a gang (resources.gpus > 1) without
	 * memory.max_bytes: the scheduler chooses the sharding with the
	 * recompute policy, so the plans of every sharding this build has
	 * (train/plan.h: enum tr_shard, from TR_SHARD_OPTIMIZER to
	 * TR_SHARD_BUILT - 1) are known too: shard_bytes[s] beside bytes,
	 * shard_by_policy[s][k] beside by_policy[k] (the host bytes are the
	 * same; [TR_SHARD_NONE] is unused). Otherwise auto_shard is false and
	 * these are 0: bytes and by_policy are the plans of the sharding the
	 * spec fixes. */
	bool auto_shard;
	uint64_t shard_bytes[TR_SHARD_COUNT];
	uint64_t shard_by_policy[TR_SHARD_COUNT][TR_RECOMPUTE_COUNT];
	/* memory.selective_layers as the plans took it (the method's choice
	 * under memory.max_bytes where the spec does not say: train/method.c),
	 * part of by_policy's FULL and FULL_OFFLOAD plans: what the scheduler
	 * writes into the spec beside a policy it chooses, so that the job
	 * plans what its lease holds. */
	int selective_layers;
	/* AUTO on one GPU where the spec does not fix the selective layers:
	 * what one more selective layer adds to by_policy[k]'s plan (FULL and
	 * FULL_OFFLOAD, each layer alike up to the model's num_layers: checked
	 * against the plan with all of them), for the scheduler to add as many
	 * as the GPU grants (tr_method_selective_layer_bytes); 0 elsewhere
	 * (none added). */
	uint64_t sel_layer_bytes[TR_RECOMPUTE_COUNT];
	int num_layers;
};

/* The plan of sharding sh (enum tr_shard; NONE: the unsharded one) and
 * recompute policy k (ignored unless auto_policy): what placement offers. */
uint64_t dmn_plan_of(const struct dmn_plan_bytes *pb, int sh, int k);

/* The ledger's key of pb's base on a GPU of this kind (fake: the job runs
 * on the CPU backend), for spec: the files' digest, the method's storage
 * (LoRA: bf16 or fp32 by the precision the job gets there; QLoRA: NF4 and
 * its double quantization), hashed, hex. Jobs with equal keys have equal
 * base arenas (the registry checks the layouts too). false when the job
 * cannot share there (no base, or a precision that GPU refuses). */
bool dmn_base_key(const Traind__JobSpec *spec, const struct dmn_plan_bytes *pb, bool fake,
		  char out[65]);

/* memory.shard AUTO's i-th sharding (0 <= i < TR_SHARD_BUILT) for each
 * recompute policy: the gradients sharded first — they move fewer bytes
 * than an all-reduce (each rank sends its part's sums, then receives the
 * bf16 weights of the others' parts: train/plan.h masters_part) and step
 * half of AdamW, and their plan is smaller than the unsharded one but on
 * a model of few layers — then unsharded, then the optimizer sharded (its
 * fp32 all-gather after AdamW: slower than unsharded on two GPUs), then
 * the weights too (their gathers a layer ahead, forward and backward). */
enum tr_shard dmn_auto_shard(int i);
/* The plan AUTO waits with: the smallest it may take (the last policy's,
 * FULL_OFFLOAD, with the most sharded state where that is AUTO too), else
 * the fixed plan's bytes. */
uint64_t dmn_plan_smallest(const struct dmn_plan_bytes *pb);

/* Whether spec leaves the sharding of a gang to placement: resources.gpus
 * > 1, memory.shard AUTO or unset, and no memory.max_bytes. */
bool dmn_shard_is_auto(const Traind__JobSpec *spec);

/* Whether spec leaves the recompute policy to placement: memory.recompute
 * AUTO or unset, and no memory.max_bytes. */
bool dmn_recompute_is_auto(const Traind__JobSpec *spec);

/* spec has defaults applied. TD_EINVAL naming the first relative path. */
td_err dmn_spec_check_paths(const Traind__JobSpec *spec, struct td_errbuf *eb);

/* Blocking (file system, NSS); any thread but the loop. Switches the calling
 * thread to creds for the checks and back. *plan gets the plan's bytes on
 * success. */
td_err dmn_preflight(const Traind__JobSpec *spec, const struct dmn_fscreds *creds,
		     struct dmn_plan_bytes *plan, struct td_errbuf *eb);

#endif
