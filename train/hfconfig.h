/* Hugging Face config.json for causal LMs: llama, qwen2, qwen3.
 *
 * Parses what the engine needs and validates it (positive sizes, heads that
 * divide, an even head_dim). rope theta comes from top-level `rope_theta` or
 * `rope_parameters.rope_theta` (transformers 5); rope scaling other than
 * "default" is refused. Errors name the file and the key.
 * This is not a weight loader: see train/modeldir.h. */
#ifndef TRAIN_HFCONFIG_H
#define TRAIN_HFCONFIG_H

#include <stdbool.h>

#include "proto/err.h"
#include "train/safetensors.h"

enum tr_arch { TR_ARCH_LLAMA, TR_ARCH_QWEN2, TR_ARCH_QWEN3 };

struct tr_model_config {
	enum tr_arch arch;
	char model_type[32];          /* "llama", "qwen2", "qwen3" */
	int vocab_size;               /* V */
	int hidden_size;              /* C */
	int intermediate_size;        /* I */
	int num_layers;               /* L */
	int num_heads;                /* NH */
	int num_kv_heads;             /* NKV; default NH */
	int head_dim;                 /* HS; default C / NH */
	int max_position_embeddings;
	double rope_theta;            /* default 10000 */
	double rms_norm_eps;          /* default 1e-6 */
	bool tie_word_embeddings;     /* default false for llama, qwen2 and qwen3 as in transformers */
	bool qkv_bias;                /* qwen2 always; llama `attention_bias` */
	bool o_bias;                  /* llama `attention_bias` */
	bool mlp_bias;                /* llama `mlp_bias` */
	bool qk_norm;                 /* qwen3 */
	enum tr_dtype dtype;          /* `dtype` or `torch_dtype`; default F32 */
	int bos_token_id;             /* -1 when null or absent */
	int eos_token_id;             /* -1 when null or absent; first of a list */
	int pad_token_id;             /* -1 when null or absent */
	int num_labels;               /* from id2label / num_labels; 0 if absent */
};

/* Reads and validates path (a config.json). */
td_err tr_config_load(struct tr_model_config *out, const char *path, struct td_errbuf *eb);
/* Same from text; `origin` names the source in messages. */
td_err tr_config_parse(struct tr_model_config *out, const char *json, const char *origin,
		       struct td_errbuf *eb);
/* Writes config.json atomically. When src_path is non-NULL its JSON is copied
 * with only "dtype"/"torch_dtype" rewritten to `dtype`; otherwise a complete
 * config is generated from cfg. */
td_err tr_config_write(const struct tr_model_config *cfg, const char *src_path, enum tr_dtype dtype,
		       const char *path, struct td_errbuf *eb);

#endif
