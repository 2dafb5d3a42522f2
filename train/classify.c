/* Sequence classification on the host: output config, argmax, metrics
 * (train/classify.h). */
#include "train/classify.h"

#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/safetensors.h"

#define CONFIG_MAX_BYTES (16u << 20)

static const char *classifier_arch(enum tr_arch a)
{
	switch (a) {
	case TR_ARCH_LLAMA:
		return "LlamaForSequenceClassification";
	case TR_ARCH_QWEN2:
		return "Qwen2ForSequenceClassification";
	case TR_ARCH_QWEN3:
		return "Qwen3ForSequenceClassification";
	}
	return "?";
}

td_err tr_classify_write_config(const char *dir, const struct tr_model_config *cfg,
				int num_labels, const char *const *names, int pad_id,
				struct td_errbuf *eb)
{
	char path[PATH_MAX];
	snprintf(path, sizeof(path), "%s/config.json", dir);
	json_object *root = NULL;
	td_err e = tr__json_read_file(&root, path, CONFIG_MAX_BYTES, eb);
	if (e != TD_OK)
		return e;
	if (!json_object_is_type(root, json_type_object)) {
		json_object_put(root);
		return td_fail(eb, TD_EFORMAT, "%s: not a JSON object", path);
	}
	json_object *arch, *id2label, *label2id;
	bool ok = (arch = tr__json_put(root, "architectures", json_object_new_array())) &&
		  tr__json_push(arch, json_object_new_string(classifier_arch(cfg->arch))) &&
		  (id2label = tr__json_put(root, "id2label", json_object_new_object())) &&
		  (label2id = tr__json_put(root, "label2id", json_object_new_object())) &&
		  (pad_id < 0 || tr__json_put(root, "pad_token_id", json_object_new_int(pad_id)));
	for (int i = 0; ok && i < num_labels; i++) {
		char id[16], dflt[24];
		snprintf(id, sizeof(id), "%d", i);
		snprintf(dflt, sizeof(dflt), "LABEL_%d", i);
		const char *name = names ? names[i] : dflt;
		ok = tr__json_put(id2label, id, json_object_new_string(name)) &&
		     tr__json_put(label2id, name, json_object_new_int(i));
	}
	/* A causal config may say num_labels too; id2label is what counts. */
	json_object_object_del(root, "num_labels");
	size_t len;
	const char *out = ok ? json_object_to_json_string_length(
				       root, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
						     JSON_C_TO_STRING_NOSLASHESCAPE,
				       &len)
			     : NULL;
	if (!out)
		e = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	else
		e = tr__write_atomic(path, (struct tr__chunk[]){{out, len}, {"\n", 1}}, 2, eb);
	json_object_put(root);
	return e;
}

void tr_classify_argmax(int32_t *pred, const float *logits, int B, int NL)
{
	for (int b = 0; b < B; b++) {
		const float *x = logits + (size_t)b * NL;
		int best = 0;
		for (int k = 1; k < NL; k++)
			if (x[k] > x[best])
				best = k;
		pred[b] = best;
	}
}

td_err tr_classify_metrics(const int32_t *pred, const int32_t *gold, size_t n, int num_labels,
			   struct tr_class_metrics *out, struct td_errbuf *eb)
{
	size_t *tp = calloc((size_t)num_labels * 3, sizeof(size_t));
	if (!tp)
		return td_fail(eb, TD_ENOMEM, "metrics: out of memory");
	size_t *fp = tp + num_labels, *fn = fp + num_labels;
	size_t rows = 0, correct = 0;
	for (size_t i = 0; i < n; i++) {
		if (gold[i] == -100)
			continue;
		if (gold[i] < 0 || gold[i] >= num_labels || pred[i] < 0 || pred[i] >= num_labels) {
			free(tp);
			return td_fail(eb, TD_ERANGE, "metrics: row %zu: label %d, prediction %d, outside [0, %d)",
				       i, gold[i], pred[i], num_labels);
		}
		rows++;
		if (pred[i] == gold[i]) {
			correct++;
			tp[gold[i]]++;
		} else {
			fp[pred[i]]++;
			fn[gold[i]]++;
		}
	}
	double f1_sum = 0;
	int present = 0;
	for (int k = 0; k < num_labels; k++) {
		if (!tp[k] && !fp[k] && !fn[k])
			continue;
		present++;
		f1_sum += 2.0 * (double)tp[k] / (double)(2 * tp[k] + fp[k] + fn[k]);
	}
	free(tp);
	out->n = rows;
	out->accuracy = rows ? (double)correct / (double)rows : 0.0;
	out->macro_f1 = present ? f1_sum / present : 0.0;
	return TD_OK;
}
