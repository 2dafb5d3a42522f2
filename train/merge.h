/* Merging a PEFT LoRA adapter into its base: W' = W + scale * B A for every
 * adapted projection (scale = lora_alpha / r, as PEFT's merge_and_unload),
 * written as a complete Hugging Face model dir that transformers loads without
 * PEFT. A classifier's adapter (task_type SEQ_CLS with the score head) gives
 * a *ForSequenceClassification dir.
 *
 * The products run on a backend (B A is a matmul), one projection at a time;
 * the output is written in the base's dtype with its config and tokenizer
 * files. This is not training: see train/lora.h for adapters in a model. */
#ifndef TRAIN_MERGE_H
#define TRAIN_MERGE_H

#include <stdio.h>

#include "proto/err.h"

/* Checks the adapter against the base (rank, targets, layers, shapes: the
 * errors of tr_lora_check) before anything is written. backend: "cpu", "cuda"
 * or "auto". log (may be NULL) gets one line per merged projection count and
 * the output. */
td_err tr_merge(const char *base_dir, const char *adapter_dir, const char *out_dir,
		const char *backend, FILE *log, struct td_errbuf *eb);

#endif
