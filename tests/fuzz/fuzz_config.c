/* libFuzzer target: config.json (train/hfconfig.h), read from a file as a job
 * reads it; and, for one that loads, both ways of writing it back: the copy
 * with the dtype rewritten (what a finished job writes beside its weights) and
 * the one generated from the struct.
 *
 * What must hold besides no crash, leak or UB: an error says what is wrong,
 * and what is written loads again to the same config (the copy with the new
 * dtype, the generated one exactly). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz_util.h"
#include "train/hfconfig.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool same(const struct tr_model_config *a, const struct tr_model_config *b, bool dtype)
{
	return a->arch == b->arch && strcmp(a->model_type, b->model_type) == 0 && a->vocab_size == b->vocab_size &&
	       a->hidden_size == b->hidden_size && a->intermediate_size == b->intermediate_size &&
	       a->num_layers == b->num_layers && a->num_heads == b->num_heads && a->num_kv_heads == b->num_kv_heads &&
	       a->head_dim == b->head_dim && a->max_position_embeddings == b->max_position_embeddings &&
	       a->rope_theta == b->rope_theta && a->rms_norm_eps == b->rms_norm_eps &&
	       a->tie_word_embeddings == b->tie_word_embeddings && a->qkv_bias == b->qkv_bias &&
	       a->o_bias == b->o_bias && a->mlp_bias == b->mlp_bias && a->qk_norm == b->qk_norm &&
	       (!dtype || a->dtype == b->dtype) && a->bos_token_id == b->bos_token_id &&
	       a->eos_token_id == b->eos_token_id && a->pad_token_id == b->pad_token_id &&
	       a->num_labels == b->num_labels;
}

/* Writes cfg (from src, or generated when src is NULL) as dtype and loads it
 * back: it must load, and to the same config. */
static void round_trip(const struct tr_model_config *cfg, const char *src, enum tr_dtype dtype)
{
	char out[PATH_MAX];
	struct td_errbuf eb = {{0}};
	fuzz_path(out, "out.json");
	if (tr_config_write(cfg, src, dtype, out, &eb) != TD_OK) {
		if (!eb.msg[0])
			__builtin_trap();
		return;
	}
	struct tr_model_config again;
	if (tr_config_load(&again, out, &eb) != TD_OK) {
		fprintf(stderr, "written config does not load: %s\n", eb.msg);
		__builtin_trap();
	}
	if (!same(cfg, &again, false) || again.dtype != dtype) {
		fprintf(stderr, "written config loads as another config\n");
		__builtin_trap();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char path[PATH_MAX];
	fuzz_write(fuzz_path(path, "config.json"), data, size);
	struct tr_model_config cfg;
	struct td_errbuf eb = {{0}};
	if (tr_config_load(&cfg, path, &eb) != TD_OK) {
		if (!eb.msg[0])
			__builtin_trap();
		return 0;
	}
	/* In memory, from the same text, the same config. */
	char *text = fuzz_strndup(data, size);
	struct tr_model_config mem;
	if (tr_config_parse(&mem, text, "config.json", &eb) != TD_OK || !same(&cfg, &mem, true))
		__builtin_trap();
	free(text);
	round_trip(&cfg, path, TR_DT_BF16);
	/* Generating writes one id2label entry a label: a config that claims
	 * millions is for the plan to refuse, not for this run to spend on. */
	if (cfg.num_labels <= 4096)
		round_trip(&cfg, NULL, cfg.dtype);
	return 0;
}
