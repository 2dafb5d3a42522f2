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
 * TD_EFORMAT with a message naming the file and the fault.
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
/* Same for integer tensors (I32, I64) into int32 (values outside int32: TD_ERANGE). */
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
 * directory. Tensors are laid out in the given order, each data offset aligned
 * to 8 bytes. meta is NULL or pairs {key, value, key, value, ..., NULL}. */
td_err tr_st_write(const char *path, const struct tr_st_entry *entries, size_t n,
		   const char *const *meta, struct td_errbuf *eb);

#endif
