/* Sequence classification around the model: the output config that makes a
 * model dir load as transformers' *ForSequenceClassification, predictions, and
 * the evaluation metrics (accuracy, macro-F1).
 *
 * The math of the head (pooling, score, cross-entropy) is in train/model.c;
 * this is what the trainer and the merge tool need on the host. */
#ifndef TRAIN_CLASSIFY_H
#define TRAIN_CLASSIFY_H

#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"
#include "train/hfconfig.h"

/* Rewrites DIR/config.json (as tr_modeldir_save wrote it from the base's) for
 * a classifier: architectures [<Arch>ForSequenceClassification], id2label and
 * label2id (names[i], or LABEL_i when names is NULL), and pad_token_id when
 * pad_id >= 0. Atomic. */
td_err tr_classify_write_config(const char *dir, const struct tr_model_config *cfg,
				int num_labels, const char *const *names, int pad_id,
				struct td_errbuf *eb);

/* pred[b] = argmax over logits (B, NL) row b (the first of equal maxima). */
void tr_classify_argmax(int32_t *pred, const float *logits, int B, int NL);

struct tr_class_metrics {
	double accuracy;   /* correct / n */
	double macro_f1;   /* mean F1 over the labels that occur in gold or pred, as
			    * scikit-learn's f1_score(average="macro"); F1 = 0 for a
			    * label with no true positives */
	size_t n;          /* rows counted (gold != -100) */
};

/* Over n rows; rows whose gold is -100 are skipped. Labels must be in
 * [0, num_labels) (TD_ERANGE naming the row otherwise). */
td_err tr_classify_metrics(const int32_t *pred, const int32_t *gold, size_t n, int num_labels,
			   struct tr_class_metrics *out, struct td_errbuf *eb);

#endif
