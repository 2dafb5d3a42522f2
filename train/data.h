/* Training data: token files and JSONL, cut into fixed-length sequences,
 * visited in a deterministic shuffled order.
 *
 * Sources:
 *   token file  little-endian uint32 ids, documents separated by the EOS id,
 *               nothing else. Packed: the stream is cut into sequences of T
 *               tokens and the tail shorter than T is dropped.
 *   JSONL       one JSON object a line (blank lines are skipped), one of:
 *                 {"text"}                  causal LM: every token trained
 *                 {"prompt","completion"}   labels -100 over the prompt's tokens
 *                 {"messages":[{"role","content"}]}
 *                                           rendered message by message with
 *                                           the chat template (below)
 *                 {"text","label"}          classification: one row a
 *                                           sequence, the label a name of
 *                                           label_names or an id
 *               The field names are the job's. The kind is the job's, or that
 *               of the first row (messages, then prompt + completion, then
 *               text); every row must have its fields.
 *
 * Tokenization (JSONL). A text is encoded with special tokens matched and,
 * with add_special_tokens, the tokenizer's post-processor tokens around it
 * (Llama-3's <|begin_of_text|>). A prompt and its completion are encoded
 * separately, so that the prompt's tokens are exactly encode(prompt): the
 * completion's own tokens follow them (what the model sees at inference,
 * where it continues after the prompt's tokens). Every causal document ends in
 * EOS (trained: the model learns to stop), unless the post-processor already
 * ends it so. Classification rows get no EOS.
 *
 * The chat template is applied to each message; placeholders:
 *   {role}     the message's role
 *   {content}  its content (exactly once)
 *   {{ }}      literal braces
 * The default is ChatML, as Qwen uses: "<|im_start|>{role}\n{content}<|im_end|>\n".
 * A message is encoded in two parts, the text before {content} (its header)
 * and the rest (content and footer). With assistant_only_loss the headers and
 * every non-"assistant" message are masked (-100); otherwise all is trained.
 * Encoding in parts equals encoding the whole conversation at once whenever the
 * header ends in a special token or a newline and the content does not begin
 * with a newline — always so for ChatML in practice.
 *
 * Sequences. Packing: the documents, each followed by its EOS, form one stream
 * cut into sequences of T; a document longer than T is split across sequences,
 * or truncated to its first T tokens. The last, partial sequence is padded.
 * Padding (no packing): each document starts its own sequence, padded to T
 * with the pad id (labels -100); a longer one is split into several sequences
 * or truncated. labels equal ids except -100 where there is no loss; the model
 * shifts them.
 *
 * Order: sequence order in epoch e is a Fisher-Yates permutation drawn from
 * splitmix64 seeded by (seed, e): a function of the seed and the epoch only,
 * so a data position (epoch, index) is all a checkpoint needs to resume.
 *
 * Scale. A JSONL file is tokenized once, by worker threads (each with its own
 * encoder, over its own byte range of the file), into a token cache beside the
 * job's output: <cache_dir>/<key>.tokens (uint32 ids; bit 31 set where there
 * is no loss) and <key>.rows (header and one 16-byte entry a row: token offset,
 * length, class). The key hashes the file's identity (path, size, mtime,
 * inode), the tokenizer.json bytes and every setting that changes the tokens,
 * so a resumed job maps the cache without tokenizing again. Memory while
 * tokenizing is bounded by the largest line; afterwards the cache is mapped
 * and only 8 bytes a row and 8 a sequence are held.
 *
 * Errors (bad JSON, a missing or mistyped field, an empty file, a label not in
 * the label set, a token outside the model's vocabulary) name the file and the
 * line; the first such line in the file is the one reported.
 *
 * Not thread-safe: one tr_data belongs to one runner thread. */
#ifndef TRAIN_DATA_H
#define TRAIN_DATA_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "proto/err.h"
#include "traind.pb-c.h"

struct tr_data;
struct tr_tokenizer;
struct tr_model_config;

struct tr_data_pos {
	uint64_t epoch;
	uint64_t index; /* next sequence within the epoch's order */
};

enum tr_rows {
	TR_ROWS_AUTO,              /* from the first row */
	TR_ROWS_TEXT,
	TR_ROWS_PROMPT_COMPLETION,
	TR_ROWS_MESSAGES,
	TR_ROWS_CLASSIFY,          /* text + label */
};

/* The ChatML template, the default chat_template. */
#define TR_CHATML_TEMPLATE "<|im_start|>{role}\n{content}<|im_end|>\n"

struct tr_data_opts {
	const char *path;            /* the data file */
	bool jsonl;                  /* else a token file */
	int T;                       /* sequence length, >= 2 */
	int vocab;                   /* the model's vocabulary: every id must be below it */
	uint64_t seed;
	bool shuffle;                /* false: file order (eval sets) */
	bool packing;                /* JSONL; token files are always packed */
	bool truncate;               /* documents longer than T: truncated, else split */
	int32_t eos_id;              /* JSONL: the separator; required */
	int32_t pad_id;              /* < 0: eos_id */
	/* JSONL only */
	const struct tr_tokenizer *tok;
	enum tr_rows rows;
	const char *text_field, *prompt_field, *completion_field, *messages_field, *label_field;
	const char *chat_template;   /* NULL: TR_CHATML_TEMPLATE */
	bool assistant_only_loss;
	bool add_special_tokens;
	char *const *label_names;    /* classification: names by id, or NULL */
	size_t n_label_names;
	int num_labels;              /* classification: labels are ids in 0 .. num_labels - 1 */
	const char *cache_dir;       /* where the token cache goes; created if missing */
	int threads;                 /* tokenizing workers; <= 0: up to 4, by file size */
	FILE *log;                   /* progress and throughput lines; NULL: silent */
};

/* Opens (and, for JSONL, tokenizes or maps from the cache) a dataset. Blocks
 * until the data is ready: every error of the file surfaces here, before a
 * caller allocates model memory. Errors name the file (and line): TD_ENOENT,
 * TD_EFORMAT (bad JSON, bad field, a token file whose size is not a multiple
 * of 4), TD_ERANGE (an id or label out of range), TD_EINVAL (no sequence at
 * all, a bad template or option), TD_EIO, TD_ENOMEM. */
td_err tr_data_open(struct tr_data **out, const struct tr_data_opts *o, struct td_errbuf *eb);

/* A token file, shuffled by seed, packed into sequences of T: the checks of
 * tr_data_open (size a multiple of 4, every id < vocab — the error names the
 * token index and byte offset — at least one sequence of T). */
td_err tr_data_open_tokens(struct tr_data **out, const char *path, int T, int vocab, uint64_t seed,
			   struct td_errbuf *eb);

/* The job's training data (eval false) or eval data (eval_file; file order),
 * as its spec says: the tokenizer is model_dir/tokenizer.json, the cache
 * <output.dir>/data-cache, EOS data.eos_id or the model's eos_token_id (or
 * the tokenizer's <|endoftext|>, </s> or <|end_of_text|>), padding data.pad_id
 * or the model's pad_token_id or EOS. spec has had defaults applied. */
td_err tr_data_open_job(struct tr_data **out, const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			bool eval, FILE *log, struct td_errbuf *eb);

/* tr_data_close(NULL) is a no-op. */
void tr_data_close(struct tr_data *d);

uint64_t tr_data_num_sequences(const struct tr_data *d);
uint64_t tr_data_num_tokens(const struct tr_data *d); /* in the file or cache, before cutting */
uint64_t tr_data_num_rows(const struct tr_data *d);   /* documents (JSONL rows; 1 for a token file) */
int32_t tr_data_pad_id(const struct tr_data *d);
/* A 64-bit fingerprint of the sequences this dataset serves (its cache key and
 * layout), which a checkpoint records so a resume on other data is refused. */
uint64_t tr_data_fingerprint(const struct tr_data *d);

/* Fills B rows of ids and labels (B, T) from *pos and advances it, rolling
 * into the next epoch (with its own order) when this one runs out.
 * class_ids (B) may be NULL; it gets each row's class (classification) or -1.
 * In a classification row labels are the ids over the text and -100 over the
 * padding, so the last non-pad token is the last t with labels[t] != -100. */
td_err tr_data_next(struct tr_data *d, struct tr_data_pos *pos, int32_t *ids, int32_t *labels, int32_t *class_ids,
		    int B, struct td_errbuf *eb);

/* Sequence s (< tr_data_num_sequences) in file order, unshuffled: one row of
 * T ids and labels, and its class (-1 if none) when class_id is non-NULL.
 * Both fail (TD_EIO, naming the file) only when the token file or cache
 * shrank under the job: it is read through a mapping. */
td_err tr_data_sequence(const struct tr_data *d, uint64_t s, int32_t *ids, int32_t *labels, int32_t *class_id,
			struct td_errbuf *eb);

#endif
