/* The job spec: load, decode, default, validate, encode, print.
 *
 * A Traind__JobSpec (generated from proto/traind.proto) is what a user submits:
 * `trainctl submit job.pb` or `job.txtpb`. This module turns bytes or a file into
 * one, fills in the documented defaults, and checks it, naming the offending field
 * by its path in the spec ("hyper.lr", "lora.target_modules[2]").
 *
 * It is not the RPC envelope, and it never looks at the file system beyond the
 * spec file itself: whether model_dir, the data files or the output directory
 * exist, and whether the submitting user may read or write them, is for the
 * code that opens them (train/, as that user).
 *
 * Ownership: every spec handled here lives on the heap the way
 * protobuf_c_message_unpack() builds it (the protobuf-c default allocator, i.e.
 * malloc): each sub-message, string and repeated array is its own allocation, or
 * a string field points at its descriptor's static default value.
 * rpc_jobspec_apply_defaults() adds allocations of the same kind, so
 * rpc_jobspec_free() (protobuf_c_message_free_unpacked) frees a spec whatever
 * has been done to it. A spec built by hand must follow the same rule: start from
 * rpc_jobspec_new(), set strings with strdup(). */
#ifndef PROTO_JOBSPEC_H
#define PROTO_JOBSPEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/err.h"
#include "traind.pb-c.h"

/* The largest spec file or encoded spec accepted, text or binary. A real spec
 * is a few hundred bytes; this bound keeps a wrong path (a model shard, a
 * dataset) from being read into memory. */
#define RPC_JOBSPEC_MAX_BYTES (1u << 20)

/* A new, empty spec (every field absent), or NULL when out of memory. */
Traind__JobSpec *rpc_jobspec_new(void);

/* Frees a spec from rpc_jobspec_new/load/decode/copy. NULL is a no-op. */
void rpc_jobspec_free(Traind__JobSpec *s);

/* Loads a spec file. By extension:
 *   .pb, .binpb                  binary protobuf
 *   .txtpb, .textproto, .txt     protobuf text format, converted by running
 *                                `protoc --encode=traind.JobSpec` (no shell)
 * protoc is TD_PROTOC from config.h, or $TD_PROTOC. The .proto it reads is
 * $TD_PROTO_PATH if set, else TD_PROTO_INSTALL_PATH if that file exists, else
 * TD_PROTO_SRC_PATH. A text-format error comes back as "PATH:LINE:COL: what".
 *
 * Blocks: reads the file and, for text, waits for protoc (at most 30 s; it is
 * killed after that). Safe in a threaded process (the child only dup2()s and
 * exec()s; SIGPIPE is never raised).
 *
 * Errors: TD_ENOENT/TD_EPERM/TD_EIO (the file), TD_EINVAL (unknown extension,
 * not a regular file), TD_ERANGE (over RPC_JOBSPEC_MAX_BYTES), TD_EFORMAT (bad
 * bytes, or protoc rejected the text), TD_EUNSUPPORTED (protoc or the .proto
 * cannot be found), TD_ENOMEM. On success *out owns a new spec, as decoded: no
 * defaults applied, not validated. */
td_err rpc_jobspec_load(Traind__JobSpec **out, const char *path, struct td_errbuf *eb);

/* Decodes binary protobuf. TD_EFORMAT for malformed bytes (including a
 * truncated message), TD_ERANGE over RPC_JOBSPEC_MAX_BYTES. buf may be NULL when
 * len is 0 (an empty spec). Never reads past buf[len - 1]. */
td_err rpc_jobspec_decode(Traind__JobSpec **out, const uint8_t *buf, size_t len, struct td_errbuf *eb);

/* Serialises to a new malloc'd buffer (*buf non-NULL even when *len is 0).
 * TD_EINVAL for a NULL spec, TD_ENOMEM. */
td_err rpc_jobspec_encode(const Traind__JobSpec *s, uint8_t **buf, size_t *len);

/* A deep copy (through encode and decode). TD_ENOMEM, or TD_EINVAL for NULL. */
td_err rpc_jobspec_copy(Traind__JobSpec **out, const Traind__JobSpec *s);

/* Fills every absent field and sub-message with its default, so that afterwards
 * s->data, hyper, lora, distill, classify, output and resources are non-NULL
 * (whatever the method: code may read them unconditionally) and every has_* is
 * true for a scalar field with a default. Enums left at *_UNSPECIFIED count as
 * absent. Defaults that depend on other fields:
 *   name                 the base name of model_dir ("/" has none: name stays
 *                        absent and validation asks for one)
 *   method               FULL
 *   data.format          JSONL if train_file ends in .jsonl, else TOKENS
 *   hyper.schedule       COSINE
 *   hyper.epochs         1, when neither max_steps nor epochs is set
 *   hyper.precision      FP32 for device CPU, BF16 for device GPU; for device
 *                        ANY it stays absent until the scheduler places the
 *                        job (rpc_jobspec_resolve_precision)
 *   lora.alpha           2 * rank
 *   lora.target_modules  q_proj, v_proj
 *   resources.device     ANY
 * The rest are the [default = ...] values of traind.proto. Left absent: fields
 * with no default (data.eval_file, data.eos_id — the model's eos_token_id,
 * known only when its config is read —, hyper.max_steps, lora.init_adapter,
 * distill.teacher_dir, classify.num_labels) and string defaults (text_field...),
 * which are copied so that they are encoded with the spec.
 *
 * Does not validate, and is idempotent. TD_ENOMEM (the spec is then partly
 * defaulted, still valid to free), TD_EINVAL for NULL. */
td_err rpc_jobspec_apply_defaults(Traind__JobSpec *s, struct td_errbuf *eb);

/* Fixes hyper.precision once the device is known: absent -> BF16 on a GPU, FP32
 * on the CPU. TD_EUNSUPPORTED if BF16 was asked for and the job is placed on the
 * CPU (whose backend is fp32 only); TD_ENOMEM. */
td_err rpc_jobspec_resolve_precision(Traind__JobSpec *s, bool on_gpu, struct td_errbuf *eb);

/* Checks the effective spec (the spec as rpc_jobspec_apply_defaults would leave
 * it; s itself is not changed) and reports the first problem as TD_EINVAL with
 * "FIELD.PATH: what (got VALUE)" in eb. Checks presence of required fields,
 * the ranges of traind.proto, consistency between fields, enum values and
 * NaN/Inf; no file system access. Fields of a section the method does not use
 * (lora for a FULL job) are range-checked too but never required.
 * TD_ENOMEM is possible (it works on a copy). */
td_err rpc_jobspec_validate(const Traind__JobSpec *s, struct td_errbuf *eb);

/* Writes the effective spec (defaults applied to a copy), one "path: value" per
 * line, to f. Sections the method does not use (lora for a FULL job) are left
 * out. */
void rpc_jobspec_print(const Traind__JobSpec *s, FILE *f);

/* "full", "lora", "qlora", "distill", "classify"; UNSPECIFIED is "full" (its
 * default); an unknown value "unknown". Static, never NULL. */
const char *rpc_method_name(Traind__Method m);

/* The inverse of rpc_method_name (case-insensitive). TD_EINVAL if unknown;
 * *out is written only on success. */
td_err rpc_method_from_name(const char *name, Traind__Method *out);

#endif
