/* safetensors: read (mmap, validated) and write (atomic).
 *
 * Format: 8-byte little-endian header length H, then H bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
 *  "__metadata__": {"k": "v"}}, then the data section; offsets are relative to
 * the start of the data section.
 *
 * Opening validates everything a malicious or truncated file could get wrong:
 * header length (against the file size), JSON syntax, unknown dtype, shape
 * entries (non-negative, product overflow), offsets out of range, end < begin,
 * size != product(shape) * dtype size, overlapping tensors. Each failure is
 * TD_EFORMAT with a message naming the file and the fault, except a dtype we do
 * not know (F8_E4M3, ...) and more than TR_ST_MAX_DIMS dims: TD_EUNSUPPORTED.
 * Gaps between tensors and trailing bytes are tolerated.
 * This is not a model loader: see train/modeldir.h. */
#ifndef TRAIN_SAFETENSORS_H
#define TRAIN_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"

enum tr_dtype {
	TR_DT_F32,
	TR_DT_F16,
	TR_DT_BF16,
	TR_DT_F64,
	TR_DT_I64,
	TR_DT_I32,
	TR_DT_I16,
	TR_DT_I8,
	TR_DT_U8,
	TR_DT_BOOL,
	TR_DT_COUNT_
};

#define TR_ST_MAX_DIMS 8

/* "F32" etc.; NULL for an out-of-range value. */
const char *tr_dtype_name(enum tr_dtype dt);
/* Bytes per element. */
size_t tr_dtype_size(enum tr_dtype dt);
/* Parses "F32", "BF16", ...; returns 0 and sets *out, or -1 for an unknown name. */
int tr_dtype_parse(const char *name, enum tr_dtype *out);

struct tr_st_tensor {
	const char *name;
	enum tr_dtype dtype;
	int ndim;
	int64_t shape[TR_ST_MAX_DIMS];
	int64_t numel;
	const void *data; /* into the mapping; valid until tr_st_close */
	size_t nbytes;
	const char *path; /* the file's (tr_st_path), for errors */
};

struct tr_st_file;

/* Maps and validates path. On success *out owns the mapping. */
td_err tr_st_open(struct tr_st_file **out, const char *path, struct td_errbuf *eb);
/* tr_st_close(NULL) is a no-op. */
void tr_st_close(struct tr_st_file *f);
const char *tr_st_path(const struct tr_st_file *f);
size_t tr_st_count(const struct tr_st_file *f);
/* Tensors in header order. */
const struct tr_st_tensor *tr_st_at(const struct tr_st_file *f, size_t i);
/* NULL when absent. */
const struct tr_st_tensor *tr_st_find(const struct tr_st_file *f, const char *name);
/* Value of a __metadata__ key, or NULL. */
const char *tr_st_metadata(const struct tr_st_file *f, const char *key);

/* Converts a F32, F16, BF16 or F64 tensor into dst (numel floats). Other dtypes:
 * TD_EUNSUPPORTED naming the tensor. */
td_err tr_st_to_f32(float *dst, const struct tr_st_tensor *t, struct td_errbuf *eb);
/* Same for integer tensors (I64, I32, I16, I8, U8, BOOL) into int32 (values
 * outside int32: TD_ERANGE naming the tensor and the element). */
td_err tr_st_to_i32(int32_t *dst, const struct tr_st_tensor *t, struct td_errbuf *eb);

/* Round-to-nearest-even conversions used when saving in a narrower dtype. */
uint16_t tr_f32_to_bf16(float x);
uint16_t tr_f32_to_f16(float x);
float tr_bf16_to_f32(uint16_t x);
float tr_f16_to_f32(uint16_t x);

struct tr_st_entry {
	const char *name;
	enum tr_dtype dtype;
	int ndim;
	int64_t shape[TR_ST_MAX_DIMS];
	const void *data; /* numel * dtype size bytes, already in dtype */
};

/* Writes a safetensors file atomically: path.tmp, fsync, rename, fsync of the
 * directory. The header lists the tensors in the given order and is padded with
 * spaces so the data section starts 8-byte aligned. The data is contiguous, as
 * the reference reader demands (it rejects gaps): tensors are placed by element
 * size, largest first, keeping the given order within a size, so every tensor
 * is aligned to its element size. meta is NULL or pairs {key, value, key,
 * value, ..., NULL}. Names must be unique and not "__metadata__" (TD_EINVAL). */
td_err tr_st_write(const char *path, const struct tr_st_entry *entries, size_t n,
		   const char *const *meta, struct td_errbuf *eb);

/* Internal to train/ (tr__): file helpers shared by the model I/O files. */

struct tr__chunk {
	const void *data;
	size_t len;
};

/* Writes the chunks, in order, to path atomically (path.tmp, fsync, rename,
 * fsync of the directory); path.tmp is removed on failure. */
td_err tr__write_atomic(const char *path, const struct tr__chunk *chunks, size_t n,
			struct td_errbuf *eb);
/* mkdir -p: creates dir and its missing parents (0755); an existing
 * non-directory is TD_EINVAL naming it. */
td_err tr__mkdir_p(const char *dir, struct td_errbuf *eb);
/* Reads a regular file of at most max bytes into a NUL-terminated malloc'd
 * buffer; *len excludes the NUL. The caller frees *out. */
td_err tr__read_file(const char *path, size_t max, char **out, size_t *len, struct td_errbuf *eb);
struct json_object;
/* Parses text (len bytes, NUL at text[len]) as strict JSON; on failure
 * TD_EFORMAT "<origin>: not valid JSON: <why> at byte N". The caller puts *out. */
td_err tr__json_parse(struct json_object **out, const char *text, size_t len, const char *origin,
		      struct td_errbuf *eb);
/* tr__read_file (at most max bytes) then tr__json_parse, naming path in errors. */
td_err tr__json_read_file(struct json_object **out, const char *path, size_t max,
			  struct td_errbuf *eb);
/* Adds v under key (tr__json_put) or at the end of array a (tr__json_push) and
 * returns v, now owned by its parent; on failure, or when v is NULL (a failed
 * allocation), frees v and returns NULL. Attaching each node as soon as it is
 * made means a failure midway leaks nothing. */
struct json_object *tr__json_put(struct json_object *o, const char *key, struct json_object *v);
struct json_object *tr__json_push(struct json_object *a, struct json_object *v);
/* td_fail for a failed system call: "<path>: <what>: <strerror>", code from errnum. */
td_err tr__errno_fail(struct td_errbuf *eb, int errnum, const char *path, const char *what);

#endif
