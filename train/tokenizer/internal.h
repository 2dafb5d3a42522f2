/* The tokenizer's inside: one struct per stage of tokenizer.json, as Hugging
 * Face tokenizers is organised, and the helpers they share. Nothing outside
 * train/tokenizer.c and train/tokenizer/ includes this.
 *
 *   stage           file                 tokenizer.json key
 *   normalizer      normalizer.c         normalizer
 *   pre-tokenizer   pre_tokenizer.c      pre_tokenizer (Split steps, ByteLevel)
 *   model           bpe.c                model (vocabulary, merges, word cache)
 *   added tokens    added_tokens.c       added_tokens
 *   post-processor  post_processor.c     post_processor
 *   decoder         decoder.c            decoder
 *
 * Each stage has a config (a struct inside tr_tokenizer: immutable once
 * loaded, shared by threads) with its _load, which reads its part of the JSON
 * and owns every message about it, and its _fini, which frees it (safe on a
 * zeroed or half-loaded struct); a stage that keeps scratch per thread has a
 * _state (inside tr_encoder) with _state_init and _state_fini. tokenizer.c
 * keeps the public API and the walk of the pipeline from one stage to the
 * next. A new stage type (a WordPiece model, a Digits pre-tokenizer) is a
 * change to its stage's file and struct here, and to nothing else but the
 * dispatch in tokenizer.c if it is a new model. */
#ifndef TRAIN_TOKENIZER_INTERNAL_H
#define TRAIN_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8

#include <json-c/json.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>
#include <uninorm.h>

#include "train/tokenizer.h"

#define TR__MAX_ID (1 << 30) /* ids beyond this are refused: no real vocabulary is near */
/* Tables are kept per id (17 bytes each), so ids are held to the tokens the
 * file lists plus this many unused ones: real vocabularies are dense, and a
 * few bytes of JSON naming id 2^30 - 1 must not cost gigabytes. */
#define TR__MAX_ID_GAP 65536
#define TR__MAX_NORMS 8  /* forms in a normalizer Sequence */
#define TR__MAX_SPLITS 8 /* Split steps in a pre-tokenizer Sequence */

/* ------------------------------------------------------------------------ */
/* Shared helpers */

static inline uint64_t tr__mix64(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

/* The vocabulary's, the word cache's and the file digest's hash. */
static inline uint64_t tr__hash_bytes(const void *p, size_t n, uint64_t seed)
{
	const uint8_t *s = p;
	uint64_t h = seed ^ (n * 0x9e3779b97f4a7c15ull);
	for (; n >= 8; s += 8, n -= 8) {
		uint64_t w;
		memcpy(&w, s, 8);
		h = (h ^ w) * 0xbf58476d1ce4e5b9ull;
		h ^= h >> 29;
	}
	uint64_t w = 0;
	memcpy(&w, s, n);
	return tr__mix64(h ^ w ^ ((uint64_t)n << 56));
}

/* Grows *p (elements of elem bytes) to hold need of them, doubling from 64;
 * false when out of memory (*p and *cap unchanged). */
static inline bool tr__grow(void **p, size_t *cap, size_t need, size_t elem)
{
	if (need <= *cap)
		return true;
	size_t c = *cap ? *cap : 64;
	while (c < need)
		c *= 2;
	void *n = realloc(*p, c * elem);
	if (!n)
		return false;
	*p = n;
	*cap = c;
	return true;
}

/* Room for `more` ids in ids; TD_ENOMEM. */
static inline td_err tr__ids_reserve(struct tr_ids *ids, size_t more)
{
	if (ids->n + more <= ids->cap)
		return TD_OK;
	size_t cap = ids->cap ? ids->cap : 64;
	while (cap < ids->n + more)
		cap *= 2;
	int32_t *v = realloc(ids->v, cap * sizeof(*v));
	if (!v)
		return TD_ENOMEM;
	ids->v = v;
	ids->cap = cap;
	return TD_OK;
}

/* GPT-2's bytes_to_unicode, the ByteLevel mapping (pre_tokenizer.c): printable
 * Latin-1 bytes map to themselves, the others to 256, 257, ... in byte
 * order. BPE's initial symbols and the decoder's reverse are built from it. */
void tr__byte_level_table(uint32_t cp[256]);

/* ------------------------------------------------------------------------ */
/* Loading: every message names origin and the JSON path. */

struct tr__load {
	struct td_errbuf *eb;
	const char *origin;
};

static inline struct json_object *tr__jget(struct json_object *o, const char *key)
{
	struct json_object *v = NULL;
	if (!o || !json_object_is_type(o, json_type_object) || !json_object_object_get_ex(o, key, &v))
		return NULL;
	return v; /* NULL for a JSON null too */
}

static inline const char *tr__jstr(struct json_object *o, const char *key)
{
	struct json_object *v = tr__jget(o, key);
	return v && json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
}

static inline bool tr__jbool(struct json_object *o, const char *key, bool dflt)
{
	struct json_object *v = tr__jget(o, key);
	return v && json_object_is_type(v, json_type_boolean) ? json_object_get_boolean(v) : dflt;
}

static inline const char *tr__jtype_name(struct json_object *v)
{
	return v ? json_type_to_name(json_object_get_type(v)) : "null";
}

/* ------------------------------------------------------------------------ */
/* Normalizer (normalizer.c): none, NFC, NFD, NFKC, NFKD, or a Sequence of
 * those, through libunistring. Holds no memory: no _fini. */

struct tr__normalizer {
	uninorm_t forms[TR__MAX_NORMS]; /* applied in order */
	int n;                          /* 0: no normalizer */
};

/* Reads j (NULL: none) at JSON path `path`. TD_EFORMAT, TD_EUNSUPPORTED. */
td_err tr__normalizer_load(struct tr__normalizer *nz, const struct tr__load *L, struct json_object *j,
			   const char *path);

/* s normalized into a new NUL-terminated buffer (*out, malloc'd; *out_len
 * bytes before the NUL), a copy when there is no normalizer. TD_EFORMAT for
 * invalid UTF-8, TD_ENOMEM; no message (callers word it). *out is written
 * only on success. */
td_err tr__normalize_alloc(const struct tr__normalizer *nz, const uint8_t *s, size_t n, uint8_t **out,
			   size_t *out_len);

/* Per thread: two buffers, which a Sequence alternates. Zero-initialised. */
struct tr__norm_state {
	uint8_t *buf[2];
	size_t cap[2];
};

void tr__norm_state_fini(struct tr__norm_state *s);

/* p normalized; *q points into s's buffers (valid until the next call) or is
 * p itself where every form leaves p as it is. TD_ENOMEM without a message,
 * TD_EFORMAT naming origin. */
td_err tr__normalize(const struct tr__normalizer *nz, struct tr__norm_state *s, const char *p, size_t n,
		     const char **q, size_t *qn, const char *origin, struct td_errbuf *eb);

/* ------------------------------------------------------------------------ */
/* Pre-tokenizer (pre_tokenizer.c): Split steps in order, then ByteLevel. */

enum tr__split_behavior { TR__SPLIT_ISOLATED, TR__SPLIT_REMOVED, TR__SPLIT_MERGED_PREV, TR__SPLIT_MERGED_NEXT };

/* A compiled regex (\s and \S rewritten to Oniguruma's White_Space). */
struct tr__split {
	pcre2_code *re;
	bool jit;
	enum tr__split_behavior behavior;
};

struct tr__pre_tokenizer {
	struct tr__split splits[TR__MAX_SPLITS];
	int nsplits;
	bool prefix_space;        /* ByteLevel's add_prefix_space */
	struct tr__split bl_regex; /* GPT-2's regex; re NULL unless use_regex */
};

/* Reads j, which must be present: byte-level BPE needs ByteLevel.
 * TD_EFORMAT, TD_EUNSUPPORTED, TD_ENOMEM. */
td_err tr__pre_tokenizer_load(struct tr__pre_tokenizer *pt, const struct tr__load *L, struct json_object *j);
void tr__pre_tokenizer_fini(struct tr__pre_tokenizer *pt);

/* Per thread: PCRE2's match data and JIT stack, ByteLevel's prefix-space
 * copy, the spans of each step (the last slot is ByteLevel's regex). */
struct tr__pretok_span {
	size_t s, e;
};

struct tr__pretok_state {
	pcre2_match_data *md;
	pcre2_match_context *mctx;
	pcre2_jit_stack *jstack;
	char *pbuf;
	size_t pcap;
	struct tr__pretok_span *spans[TR__MAX_SPLITS + 1];
	size_t nspan_cap[TR__MAX_SPLITS + 1];
};

/* TD_ENOMEM (no message); on failure s is left for _fini. */
td_err tr__pretok_state_init(struct tr__pretok_state *s);
void tr__pretok_state_fini(struct tr__pretok_state *s);

/* Where the words go: each non-empty word's bytes, before the byte-level
 * mapping, in order. A non-zero return stops the walk and is returned. */
typedef td_err tr__word_fn(void *ctx, const char *p, size_t n);

/* Splits p into words for word(ctx, ...). TD_ENOMEM (no message),
 * TD_EINTERNAL when PCRE2 fails (its message, naming origin), or what word
 * returned. */
td_err tr__pretokenize(const struct tr__pre_tokenizer *pt, struct tr__pretok_state *s, const char *p, size_t n,
		       tr__word_fn *word, void *ctx, const char *origin, struct td_errbuf *eb);

/* ------------------------------------------------------------------------ */
/* The model (bpe.c): byte-level BPE, merges applied by rank through a
 * priority queue as tokenizers' word.rs does. */

struct tr__vslot { /* vocabulary hash slot */
	uint32_t hash;
	int32_t id; /* -1: empty */
};

struct tr__mslot { /* merges hash slot */
	uint64_t key; /* a << 32 | b; UINT64_MAX: empty */
	int32_t rank;
	int32_t id;
};

struct tr__bpe {
	/* the vocabulary: token i is strs[off[i] .. off[i] + len[i]) */
	char *strs;
	uint32_t *off, *len; /* len UINT32_MAX: no token has this id */
	int nmodel;          /* one more than the largest id */
	struct tr__vslot *vocab;
	size_t vocab_mask;

	struct tr__mslot *merges;
	size_t merges_mask;
	bool ignore_merges, byte_fallback;
	int32_t unk_id;
	int32_t byte_id[256];     /* the id of each byte's byte-level character, -1 if none */
	int32_t fallback_id[256]; /* "<0xXX>" ids for byte_fallback */
	char bl_utf8[256][2];     /* each byte's byte-level character, UTF-8 */
	uint8_t bl_len[256];
};

/* Reads model (its "type" must be BPE). TD_EFORMAT, TD_EUNSUPPORTED, TD_ENOMEM. */
td_err tr__bpe_load(struct tr__bpe *m, const struct tr__load *L, struct json_object *model);
void tr__bpe_fini(struct tr__bpe *m);

/* The id of the token spelled s[0 .. n), or -1. */
int32_t tr__bpe_token_id(const struct tr__bpe *m, const char *s, size_t n);

/* The spelling of id (NUL-terminated, *len its length), or NULL for an id
 * the vocabulary does not have. */
static inline const char *tr__bpe_token(const struct tr__bpe *m, int64_t id, size_t *len)
{
	if (id < 0 || id >= m->nmodel || m->len[id] == UINT32_MAX)
		return NULL;
	*len = m->len[id];
	return m->strs + m->off[id];
}

/* Per thread: the merge queue's scratch and a word -> ids cache. */
struct tr__bpe_sym {
	int32_t c, prev, next, len;
};

struct tr__bpe_qent {
	int32_t rank, pos, id;
};

struct tr__bpe_cslot {
	uint64_t h; /* 0: empty */
	uint32_t koff, klen, ioff, in;
};

struct tr__bpe_state {
	struct tr__bpe_sym *syms;
	size_t sym_cap;
	struct tr__bpe_qent *heap;
	size_t heap_cap;
	char *mapped; /* byte-level spelling of a word (ignore_merges) */
	size_t mapped_cap;
	struct tr__bpe_cslot *cache;
	size_t cache_n;
	uint8_t *ckeys;
	size_t ckeys_n;
	int32_t *cids;
	size_t cids_n;
};

/* TD_ENOMEM (no message); on failure s is left for _fini. */
td_err tr__bpe_state_init(struct tr__bpe_state *s);
void tr__bpe_state_fini(struct tr__bpe_state *s);

/* Where tr__bpe_word's ids go: one per encoder, out set per call. */
struct tr__bpe_sink {
	const struct tr__bpe *m;
	struct tr__bpe_state *s;
	struct tr_ids *out;
};

/* A tr__word_fn, ctx a struct tr__bpe_sink: appends the ids of word w (its
 * bytes, before the byte-level mapping) to out. The pre-tokenizer calls it
 * directly, one indirect call per word. TD_ENOMEM (no message). */
td_err tr__bpe_word(void *sink, const char *w, size_t n);

/* ------------------------------------------------------------------------ */
/* Added tokens (added_tokens.c): matched before the pre-tokenizer,
 * leftmost-longest over a byte trie, as tokenizers' AddedVocabulary does. */

struct tr__added_token {
	char *content; /* as matched: normalized for `normalized` tokens */
	size_t len;
	char *orig; /* as written in the file: what it decodes to */
	size_t orig_len;
	int32_t id;
	bool special, normalized, single_word, lstrip, rstrip;
};

/* A byte trie over added tokens' contents; node 0 is the root. */
struct tr__trie_node {
	int32_t child; /* first child, -1 if none */
	int32_t sibling;
	int32_t added; /* index into tok of the token ending here, -1 if none */
	uint8_t byte;
};

struct tr__trie {
	struct tr__trie_node *node;
	size_t n, cap;
	uint8_t first[32]; /* bitmap of first bytes */
	bool any;
};

struct tr__added {
	struct tr__added_token *tok; /* in the file's order */
	size_t n;
	struct tr__trie raw;    /* matched in the raw text */
	struct tr__trie normed; /* `normalized` ones: in the normalized text */
	/* per id of the whole vocabulary (vocab_size entries, tr__added_index) */
	uint8_t *special; /* 1 if a special added token */
	int32_t *of;      /* index into tok, -1 if none */
};

/* Reads list (NULL: none); `normalized` contents go through nz.
 * TD_EFORMAT, TD_ENOMEM. */
td_err tr__added_load(struct tr__added *a, const struct tr__load *L, struct json_object *list,
		      const struct tr__normalizer *nz);
/* The whole vocabulary's size (the model's nmodel ids and the added ones) in
 * *vocab_size, and the per-id tables. TD_EFORMAT for an added id far past
 * the rest (TR__MAX_ID_GAP), TD_ENOMEM. */
td_err tr__added_index(struct tr__added *a, const struct tr__load *L, int nmodel, int *vocab_size);
void tr__added_fini(struct tr__added *a);

/* What a split hands on: the text between matches to gap (non-empty, but
 * for the whole of an empty p when the trie is empty), each match (its text
 * as cut, with lstrip/rstrip's spaces) with its id to tok. A non-zero
 * return stops the split and is returned. */
typedef td_err tr__gap_fn(void *ctx, const char *p, size_t n);
typedef td_err tr__added_fn(void *ctx, const char *p, size_t n, int32_t id);

/* Cuts the added tokens of a's raw trie (normalized false) or normed trie
 * out of p (HF's AddedVocabulary::find_matches); special ones only with
 * TR_ENC_SPECIALS in flags. Returns what gap or tok returned. */
td_err tr__added_split(const struct tr__added *a, bool normalized, unsigned flags, const char *p, size_t n,
		       tr__gap_fn *gap, tr__added_fn *tok, void *ctx);

/* ------------------------------------------------------------------------ */
/* Post-processor (post_processor.c): the special ids around one sequence. */

struct tr__post_processor {
	int32_t *pre, *post;
	size_t npre, npost;
};

/* Reads j (NULL: none) at JSON path `path`. TD_EFORMAT, TD_EUNSUPPORTED,
 * TD_ENOMEM. */
td_err tr__post_processor_load(struct tr__post_processor *pp, const struct tr__load *L, struct json_object *j,
			       const char *path);
/* Every id must be a token of the whole vocabulary: below vocab_size, and
 * in the model or added (a gap in the vocabulary would be put in every
 * sequence and decode to nothing). TD_EFORMAT naming the id. */
td_err tr__post_processor_check(const struct tr__post_processor *pp, const struct tr__load *L, int vocab_size,
				const struct tr__bpe *m, const struct tr__added *a);
void tr__post_processor_fini(struct tr__post_processor *pp);

/* Appends the ids before (or after) a sequence to out. TD_ENOMEM. */
td_err tr__post_processor_prefix(const struct tr__post_processor *pp, struct tr_ids *out);
td_err tr__post_processor_suffix(const struct tr__post_processor *pp, struct tr_ids *out);

/* ------------------------------------------------------------------------ */
/* Decoder (decoder.c): ByteLevel, each id to the bytes it decodes to. */

struct tr__decoder {
	uint32_t *off; /* vocab_size + 1: id i decodes to bytes[off[i] .. off[i + 1]) */
	uint8_t *bytes;
};

/* Checks j (NULL: ByteLevel). TD_EFORMAT, TD_EUNSUPPORTED. */
td_err tr__decoder_load(struct tr__decoder *d, const struct tr__load *L, struct json_object *j);
/* The per-id bytes: an added token's text as written, a model token's
 * characters mapped back to bytes. TD_EFORMAT, TD_ENOMEM. */
td_err tr__decoder_build(struct tr__decoder *d, const struct tr__load *L, int vocab_size, const struct tr__bpe *m,
			 const struct tr__added *a);
void tr__decoder_fini(struct tr__decoder *d);

/* The ids' bytes (each a valid id below vocab_size; those with skip[id] set
 * left out when skip is non-NULL), invalid UTF-8 replaced as tokenizers'
 * ByteLevel decoder does, in a new NUL-terminated string. TD_ENOMEM (no
 * message); *out written only on success. */
td_err tr__decode(const struct tr__decoder *d, const int32_t *ids, size_t n, const uint8_t *skip, char **out,
		  size_t *out_len);

#endif
