/* Hugging Face tokenizer.json: byte-level BPE, encode and decode, token for
 * token as the `tokenizers` library does.
 *
 * What a tokenizer.json may hold (anything else is refused at load with a
 * message that names the kind and the file):
 *   model          BPE (merges applied by rank through a priority queue, as
 *                  tokenizers' word.rs does; `ignore_merges`; `unk_token`);
 *                  Unigram, WordPiece and WordLevel are refused
 *   normalizer     none, NFC, NFD, NFKC, NFKD, or a Sequence of those
 *                  (libunistring's u8_normalize)
 *   pre_tokenizer  ByteLevel (with its GPT-2 regex when use_regex is true), or
 *                  a Sequence of Split (Regex or String pattern; Isolated,
 *                  Removed, MergedWithPrevious or MergedWithNext) steps ending
 *                  in ByteLevel — Qwen2's and Llama-3's layout
 *   added_tokens   matched in the raw text (or, for `normalized` ones, in the
 *                  normalized text) before the pre-tokenizer, leftmost-longest,
 *                  honouring single_word / lstrip / rstrip
 *   post_processor none, ByteLevel, TemplateProcessing (its `single` template:
 *                  the special ids around one sequence), or a Sequence of those
 *   decoder        ByteLevel (none is taken as ByteLevel: the vocabulary is
 *                  byte-level either way)
 *
 * Regexes run through PCRE2 in UTF + UCP mode with its JIT. tokenizers uses
 * Oniguruma, whose \s is Unicode White_Space; PCRE2's \s also matches U+180E,
 * so \s and \S are rewritten to the explicit White_Space set before compiling.
 *
 * A tr_tokenizer is immutable once loaded and may be shared by threads. Each
 * thread encodes through its own tr_encoder (match data, scratch buffers and
 * a word -> ids cache). This is not a dataset reader: see train/data.h. */
#ifndef TRAIN_TOKENIZER_H
#define TRAIN_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/err.h"

struct tr_tokenizer;
struct tr_encoder;

/* A growable array of token ids; zero-initialise, free with tr_ids_fini. */
struct tr_ids {
	int32_t *v;
	size_t n, cap;
};

void tr_ids_fini(struct tr_ids *ids);
/* Appends one id; TD_ENOMEM. */
td_err tr_ids_push(struct tr_ids *ids, int32_t id);

enum tr_encode_flags {
	/* Match special added tokens in the text ("<|im_end|>" becomes its id).
	 * tokenizers always does (unless split_special_tokens is set); without
	 * this flag special tokens are encoded as the text they spell. Added
	 * tokens that are not special are matched either way. */
	TR_ENC_SPECIALS = 1u << 0,
	/* Add the post-processor's special tokens before / after the text
	 * (Llama-3's <|begin_of_text|>); both: tokenizers' add_special_tokens. */
	TR_ENC_ADD_PREFIX = 1u << 1,
	TR_ENC_ADD_SUFFIX = 1u << 2,
	TR_ENC_ADD_SPECIAL = TR_ENC_ADD_PREFIX | TR_ENC_ADD_SUFFIX,
};

/* Reads and checks a tokenizer.json (at most 1 GiB). Errors name the file and
 * the JSON path: TD_EUNSUPPORTED for a kind this module does not implement
 * ("model type Unigram"), TD_EFORMAT for a malformed or inconsistent file (a
 * merge naming a token that is not in the vocabulary), TD_ENOENT/TD_EIO,
 * TD_ENOMEM. On success *out owns a new tokenizer. */
td_err tr_tokenizer_load(struct tr_tokenizer **out, const char *path, struct td_errbuf *eb);
/* The same from text; origin names it in messages. */
td_err tr_tokenizer_parse(struct tr_tokenizer **out, const char *json, size_t len, const char *origin,
			  struct td_errbuf *eb);
/* tr_tokenizer_free(NULL) is a no-op. No encoder may outlive its tokenizer. */
void tr_tokenizer_free(struct tr_tokenizer *t);

/* One more than the largest id of the vocabulary and the added tokens. */
int tr_tokenizer_vocab_size(const struct tr_tokenizer *t);
/* The id of a token spelled as in the vocabulary ("<|endoftext|>", "Ġthe"),
 * added tokens first; -1 if there is none. */
int tr_tokenizer_token_id(const struct tr_tokenizer *t, const char *token);
/* The spelling of id (NUL-terminated; *len set if len is non-NULL), or NULL
 * for an id no token has. */
const char *tr_tokenizer_token(const struct tr_tokenizer *t, int id, size_t *len);
bool tr_tokenizer_is_special(const struct tr_tokenizer *t, int id);
/* The post-processor's ids before and after one sequence (TR_ENC_ADD_*);
 * the arrays belong to t. */
void tr_tokenizer_affixes(const struct tr_tokenizer *t, const int32_t **pre, size_t *npre, const int32_t **post,
			  size_t *npost);
/* A 128-bit digest of the tokenizer.json bytes, for cache keys. */
void tr_tokenizer_digest(const struct tr_tokenizer *t, uint64_t out[2]);

/* A per-thread encoder. TD_ENOMEM. */
td_err tr_encoder_new(struct tr_encoder **out, const struct tr_tokenizer *t, struct td_errbuf *eb);
void tr_encoder_free(struct tr_encoder *e);

/* Encodes len bytes of UTF-8 text and appends the ids to out. TD_EFORMAT for
 * invalid UTF-8 (naming the byte offset), TD_ENOMEM, TD_EINTERNAL if PCRE2
 * fails at run time (its message). On failure out may hold part of the ids. */
td_err tr_encode(struct tr_encoder *e, const char *text, size_t len, unsigned flags, struct tr_ids *out,
		 struct td_errbuf *eb);

/* What the pre-tokenizer hands to BPE, for tests and debugging: fn gets each
 * word (its bytes, before the byte-level mapping) with id -1, or an added
 * token's text with its id, in order. Same flags and errors as tr_encode. */
td_err tr_pretokenize(struct tr_encoder *e, const char *text, size_t len, unsigned flags,
		      void (*fn)(void *ctx, const char *piece, size_t len, int32_t id), void *ctx,
		      struct td_errbuf *eb);

/* The tokenizer's normalizer (none, or its forms in order) applied to text:
 * a new NUL-terminated string in *out (malloc'd; *out_len bytes before the
 * NUL). What decode(encode(text)) gives back for text without added tokens.
 * TD_EFORMAT for text that is not valid UTF-8 under a normalizer, TD_ENOMEM;
 * *out is written only on success. */
td_err tr_tokenizer_normalize(const struct tr_tokenizer *t, const char *text, size_t len, char **out,
			      size_t *out_len, struct td_errbuf *eb);

/* Decodes ids to a new NUL-terminated UTF-8 string (*out, malloc'd; *out_len
 * bytes before the NUL) as tokenizers' ByteLevel decoder does: bytes that do
 * not form valid UTF-8 become U+FFFD, one per maximal invalid subsequence.
 * Special tokens are left out when skip_special. TD_ERANGE naming the position
 * of an id no token has; TD_ENOMEM. */
td_err tr_decode(const struct tr_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **out,
		 size_t *out_len, struct td_errbuf *eb);

#endif
