/* LoRA adapters in PEFT's format: adapter_config.json + adapter_model.safetensors.
 *
 * Tensor names are those PEFT writes (no adapter name):
 *   base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight  [r, in]
 *   base_model.model.model.layers.N.self_attn.q_proj.lora_B.weight  [out, r]
 *   base_model.model.score.weight   a classifier's head (task_type SEQ_CLS)
 * and they are the names of the adapter tensors in a tr_plan. The scale is
 * lora_alpha / r (lora_alpha / sqrt(r) with use_rslora), as PEFT's.
 *
 * Reading validates the config (peft_type LORA, r, lora_alpha, target_modules
 * among the seven projections; features traind does not implement — DoRA,
 * fan_in_fan_out, per-module rank or alpha patterns, layers_to_transform,
 * trained biases, a target_modules regex — are refused by name) and every
 * tensor against the base model's config: a name that is not an adapter of a
 * targeted projection of an existing layer, a shape that does not fit r and
 * the projection's size, a missing tensor. Errors name the file and tensor.
 * This is not the math: train/model.c applies adapters; train/merge.h folds
 * them into the base. */
#ifndef TRAIN_LORA_H
#define TRAIN_LORA_H

#include <limits.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto/err.h"
#include "train/hfconfig.h"
#include "train/model.h"
#include "train/safetensors.h"

struct tr_lora_config {
	int r;
	double alpha;
	double dropout;
	unsigned targets;       /* bits of enum tr_lin */
	bool rslora;
	bool score;             /* modules_to_save holds the classifier head (SEQ_CLS) */
	char task_type[32];     /* "CAUSAL_LM", "SEQ_CLS" */
	char base_model[PATH_MAX]; /* base_model_name_or_path; "" when null */
};

/* Reads and validates DIR/adapter_config.json. */
td_err tr_lora_config_load(struct tr_lora_config *c, const char *dir, struct td_errbuf *eb);

/* PEFT's scale for c. */
double tr_lora_scale(const struct tr_lora_config *c);

/* Checks the tensors of an adapter file f (path for messages) against c and
 * the base config: each is an adapter of a targeted projection of a layer the
 * base has, with shape [r, in] or [out, r], or the head [num_labels, C] when
 * c->score (num_labels > 0 then; pass 0 otherwise); and every adapter the
 * config implies is there. TD_EMISMATCH / TD_EFORMAT naming the tensor. */
td_err tr_lora_check(const struct tr_lora_config *c, const struct tr_model_config *base,
		     int num_labels, const struct tr_st_file *f, struct td_errbuf *eb);

/* Parses an adapter tensor name; returns true with the layer, projection and
 * B (false: A) when name is one. */
bool tr_lora_parse_name(const char *name, int *layer, int *lin, bool *is_b);

/* Loads DIR (config and tensors) into m, whose plan must have the adapter's
 * rank, targets and scale (TD_EMISMATCH naming both otherwise) and whose base
 * config the adapter must fit. Also the head when the adapter has one. */
td_err tr_lora_load(struct tr_model *m, const char *dir, struct td_errbuf *eb);

/* PEFT's initialisation from seed: lora_A ~ U(-1/sqrt(in), 1/sqrt(in))
 * (kaiming_uniform_ with a = sqrt(5)), lora_B = 0, so the model starts as the
 * base. Deterministic in seed. */
td_err tr_lora_init(struct tr_model *m, uint64_t seed, struct td_errbuf *eb);

/* Writes m's adapter (and head, for a classifier) to DIR as PEFT does:
 * adapter_config.json (r, lora_alpha, lora_dropout, target_modules,
 * base_model_name_or_path = base_model, peft_type LORA, task_type CAUSAL_LM or
 * SEQ_CLS, ...) and adapter_model.safetensors (F32). DIR is created if
 * needed; both files are replaced atomically. */
td_err tr_lora_save(struct tr_model *m, const char *dir, const char *base_model,
		    struct td_errbuf *eb);

#endif
