/* Frozen bases shared by the jobs of one process on one device (issue 11,
 * item 5): LoRA and QLoRA jobs whose frozen weights are the same files,
 * stored alike, hold one copy of them — the base arena of their plans
 * (train/plan.h: TR_ARENA_BASE) — refcounted, read-only once loaded.
 *
 * A registry (struct tr_bases, one per process: the daemon's) maps a key
 * and a device to an entry: the memory (gpu_share_alloc: it outlives the
 * backend that made it), the plan's base signature and size, the number of
 * models using it. The first model to acquire a key allocates it and loads
 * it (tr_model_new_shared, loaded false, then tr_model_load); the others
 * wait for that and attach (loaded true). The last release frees it.
 *
 * What the key is, the caller decides (the daemon: the files' digest, the
 * storage settings, the device; the same string its ledger holds for the
 * shared block, daemon/scheduler.c); the registry checks that every model
 * of a key has the same base signature and bytes. This is not the VRAM
 * ledger (state/: the shared block's row) nor a cache: nothing outlives
 * its last user. */
#ifndef TRAIN_BASE_H
#define TRAIN_BASE_H

#include <stdbool.h>
#include <stddef.h>

#include "gpu/backend.h"
#include "proto/err.h"

struct tr_bases;
struct tr_base;

td_err tr_bases_new(struct tr_bases **out, struct td_errbuf *eb);
/* tr_bases_free(NULL) is a no-op. Every entry must have been released (an
 * entry left is a bug: asserted). */
void tr_bases_free(struct tr_bases *r);

/* Blocking. The entry of (key, device) for a model whose plan's base is
 * bytes long with signature sig (tr_plan_base_signature). None: one is
 * made — bytes of gpu_share_alloc on be — and *load is true: the caller
 * loads it and then calls tr_base_ready. One being loaded by another
 * thread: waits for it (a failed load hands the loading to the first
 * waiter). One ready: *load false, the caller attaches. A reference is
 * taken either way (tr_bases_release). Errors: TD_EUNSUPPORTED (be cannot
 * share memory), TD_EMISMATCH (the key's entry has another signature or
 * size: the caller's key misses a setting), TD_ENOMEM (naming the bytes). */
td_err tr_bases_acquire(struct tr_bases *r, struct gpu_backend *be, int device, const char *key,
			const char sig[65], size_t bytes, struct tr_base **out, bool *load,
			struct td_errbuf *eb);
void *tr_base_ptr(const struct tr_base *b);
size_t tr_base_bytes(const struct tr_base *b);

/* The loader's end of a load (be synced by the caller's tr_model_load).
 * e == TD_OK: the base is sealed read-only (gpu_share_seal; *sealed, which
 * may be NULL, says whether the device could: see gpu/backend.h) and the
 * waiters attach. Otherwise the loader's reference is dropped as
 * tr_bases_release would, and a waiter, if any, loads it anew. */
void tr_base_ready(struct tr_bases *r, struct tr_base *b, struct gpu_backend *be, td_err e,
		   bool *sealed);

/* Drops a reference; the last frees the memory through be (a backend of
 * the entry's device; the caller's models that used it are freed or at
 * least synced). tr_bases_release(r, NULL, be) is a no-op. */
void tr_bases_release(struct tr_bases *r, struct tr_base *b, struct gpu_backend *be);

/* The models attached to (key, device) now; 0 when there is no entry. */
int tr_bases_refs(struct tr_bases *r, const char *key, int device);
/* Entries and their bytes now. */
void tr_bases_stat(struct tr_bases *r, size_t *entries, size_t *bytes);

/* Blocking (reads the files). The SHA-256, hex, of a model dir's weights:
 * config.json, model.safetensors.index.json and every *.safetensors file,
 * in name order, each as (name, size, SHA-256 of its bytes). Cached for the
 * process by each file's (device, inode, size, mtime, ctime): a second job
 * of the same files reads none of them again, and a file written since
 * gives another digest. TD_ENOENT/TD_EACCES naming the file. */
td_err tr_base_files_digest(const char *model_dir, char out[65], struct td_errbuf *eb);

#endif
