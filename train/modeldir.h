/* A Hugging Face model directory's weights: one model.safetensors, or shards
 * listed by model.safetensors.index.json ("weight_map": name -> shard file).
 *
 * Reading maps every file and builds one name -> tensor index; a name in two
 * files, a shard the index names that is missing, or an index entry whose
 * tensor is not in its shard is TD_EFORMAT naming both files.
 * Writing produces what transformers' save_pretrained produces: config.json,
 * model.safetensors (or model-00001-of-0000N.safetensors shards plus the index
 * when the total exceeds shard_bytes), generation_config.json and tokenizer
 * files copied from the source dir when present.
 * This is not the engine's parameter table: train/ builds that from these. */
#ifndef TRAIN_MODELDIR_H
#define TRAIN_MODELDIR_H

#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"
#include "train/hfconfig.h"
#include "train/safetensors.h"

struct tr_weights;

td_err tr_weights_open(struct tr_weights **out, const char *model_dir, struct td_errbuf *eb);
/* tr_weights_close(NULL) is a no-op. */
void tr_weights_close(struct tr_weights *w);
size_t tr_weights_count(const struct tr_weights *w);
const struct tr_st_tensor *tr_weights_at(const struct tr_weights *w, size_t i);
/* NULL when absent. */
const struct tr_st_tensor *tr_weights_find(const struct tr_weights *w, const char *name);
/* The file a tensor came from (for messages). */
const char *tr_weights_file_of(const struct tr_weights *w, const char *name);

struct tr_save_tensor {
	const char *name;
	int ndim;
	int64_t shape[TR_ST_MAX_DIMS];
	const float *data; /* host fp32; converted to the save dtype */
};

/* Writes a model dir at out_dir (created if needed; files replaced atomically).
 * src_dir (may be NULL) is where config.json, generation_config.json and the
 * tokenizer files (tokenizer.json, tokenizer_config.json,
 * special_tokens_map.json, vocab.json, merges.txt) are copied from.
 * dtype is F32, BF16 or F16. shard_bytes 0 means never shard. */
td_err tr_modeldir_save(const char *out_dir, const char *src_dir,
			const struct tr_model_config *cfg, const struct tr_save_tensor *tensors,
			size_t n, enum tr_dtype dtype, uint64_t shard_bytes, struct td_errbuf *eb);

#endif
