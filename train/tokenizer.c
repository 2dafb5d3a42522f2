/* Byte-level BPE from tokenizer.json (train/tokenizer.h).
 *
 * The road a text takes through tr_encode, as tokenizers' TokenizerImpl::encode:
 *   1. added tokens that are not `normalized` are cut out of the raw text
 *      (leftmost-longest over a byte trie);
 *   2. each remaining segment is normalized (NFC...), then `normalized` added
 *      tokens are cut out of it;
 *   3. the pre-tokenizer splits each segment into words: every Split step's
 *      regex in turn, then ByteLevel (prefix space, its own regex if use_regex);
 *   4. each word goes through BPE on its bytes: the initial symbols are the ids
 *      of the byte-level characters (GPT-2's bytes_to_unicode), merged lowest
 *      rank first, leftmost first on equal rank, with tokenizers' rule for a
 *      stale queue entry (it is applied when the pair now there merges into the
 *      same id). Results are cached per word.
 * Decoding maps each token's characters back to bytes (ByteLevel decoder),
 * passes added tokens through as written, and replaces invalid UTF-8.
 *
 * Not here: datasets (train/data.c), chat templates (train/jsonl.c). */
#include "train/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8

#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unictype.h>
#include <uninorm.h>
#include <unistd.h>
#include <unistr.h>

#define MAX_FILE_BYTES (1ull << 30)
#define MAX_SPLITS 8      /* Split steps in a pre-tokenizer Sequence */
#define MAX_NORMS 8       /* forms in a normalizer Sequence */
#define MAX_ID (1 << 30)  /* ids beyond this are refused: no real vocabulary is near */
/* Tables are kept per id (17 bytes each), so ids are held to the tokens the
 * file lists plus this many unused ones: real vocabularies are dense, and a
 * few bytes of JSON naming id 2^30 - 1 must not cost gigabytes. */
#define MAX_ID_GAP 65536
#define CACHE_SLOTS (1u << 17)
#define CACHE_MAX_ENTRIES (CACHE_SLOTS / 2)
#define CACHE_MAX_WORD 128 /* bytes; longer words are not cached */
#define CACHE_BYTES (1u << 21)
#define CACHE_IDS (1u << 19)

/* GPT-2's pre-tokenizer regex, which ByteLevel uses when use_regex is true. */
static const char gpt2_pattern[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ------------------------------------------------------------------------ */
/* Hashing */

static inline uint64_t mix64(uint64_t x)
{
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ull;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebull;
	return x ^ (x >> 31);
}

static uint64_t hash_bytes(const void *p, size_t n, uint64_t seed)
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
	return mix64(h ^ w ^ ((uint64_t)n << 56));
}

static size_t pow2_at_least(size_t n)
{
	size_t c = 16;
	while (c < n)
		c <<= 1;
	return c;
}

/* ------------------------------------------------------------------------ */
/* The tokenizer */

enum split_behavior { SPLIT_ISOLATED, SPLIT_REMOVED, SPLIT_MERGED_PREV, SPLIT_MERGED_NEXT };

struct split {
	pcre2_code *re;
	bool jit;
	enum split_behavior behavior;
};

struct added {
	char *content; /* as matched: normalized for `normalized` tokens */
	size_t len;
	char *orig; /* as written in the file: what it decodes to */
	size_t orig_len;
	int32_t id;
	bool special, normalized, single_word, lstrip, rstrip;
};

/* A byte trie over added tokens' contents; node 0 is the root. */
struct trie_node {
	int32_t child; /* first child, -1 if none */
	int32_t sibling;
	int32_t added;  /* index into t->added of the token ending here, -1 if none */
	uint8_t byte;
};

struct trie {
	struct trie_node *node;
	size_t n, cap;
	uint8_t first[32]; /* bitmap of first bytes */
	bool any;
};

struct vslot { /* vocabulary hash slot */
	uint32_t hash;
	int32_t id; /* -1: empty */
};

struct mslot { /* merges hash slot */
	uint64_t key; /* a << 32 | b; UINT64_MAX: empty */
	int32_t rank;
	int32_t id;
};

struct tr_tokenizer {
	char origin[512];
	uint64_t digest[2];

	/* the model's vocabulary: model token i is strs[off[i] .. off[i] + len[i]) */
	char *strs;
	uint32_t *off, *len; /* len UINT32_MAX: no model token has this id */
	int nmodel;          /* one more than the largest model id */
	struct vslot *vocab;
	size_t vocab_mask;

	struct mslot *merges;
	size_t merges_mask;
	bool ignore_merges, byte_fallback;
	int32_t unk_id;
	int32_t byte_id[256];  /* the id of each byte's byte-level character, -1 if none */
	int32_t fallback_id[256]; /* "<0xXX>" ids for byte_fallback */
	char bl_utf8[256][2];     /* each byte's byte-level character, UTF-8 */
	uint8_t bl_len[256];

	uninorm_t norms[MAX_NORMS];
	int nnorms;

	struct split splits[MAX_SPLITS];
	int nsplits;
	bool bl_prefix_space;
	struct split bl_regex; /* re NULL unless use_regex */

	struct added *added;
	size_t nadded;
	struct trie raw, normed;

	int32_t *pre, *post; /* the post-processor's ids around one sequence */
	size_t npre, npost;

	int vocab_size;
	uint8_t *special;   /* per id: 1 if a special added token */
	int32_t *added_of;  /* per id: index into added, -1 if none */
	/* per id: the bytes it decodes to */
	uint32_t *dec_off;  /* vocab_size + 1 */
	uint8_t *dec;
};

struct tr_encoder {
	const struct tr_tokenizer *t;
	pcre2_match_data *md;
	pcre2_match_context *mctx;
	pcre2_jit_stack *jstack;
	/* normalization buffers (two: a Sequence alternates) */
	uint8_t *nbuf[2];
	size_t ncap[2];
	/* ByteLevel's prefix-space copy */
	char *pbuf;
	size_t pcap;
	/* spans of each Split stage */
	struct span {
		size_t s, e;
	} *spans[MAX_SPLITS + 1];
	size_t nspan_cap[MAX_SPLITS + 1];
	/* BPE scratch */
	struct sym {
		int32_t c, prev, next, len;
	} *syms;
	size_t sym_cap;
	struct qent {
		int32_t rank, pos, id;
	} *heap;
	size_t heap_cap;
	char *mapped; /* byte-level spelling of a word (ignore_merges) */
	size_t mapped_cap;
	/* word -> ids cache */
	struct cslot {
		uint64_t h; /* 0: empty */
		uint32_t koff, klen, ioff, in;
	} *cache;
	size_t cache_n;
	uint8_t *ckeys;
	size_t ckeys_n;
	int32_t *cids;
	size_t cids_n;
	unsigned flags; /* of the call in progress */
	/* where words go */
	void (*fn)(void *ctx, const char *piece, size_t len, int32_t id);
	void *ctx;
	struct tr_ids *out;
	struct td_errbuf *eb;
};

/* ------------------------------------------------------------------------ */
/* Small helpers */

void tr_ids_fini(struct tr_ids *ids)
{
	free(ids->v);
	ids->v = NULL;
	ids->n = ids->cap = 0;
}

static td_err ids_reserve(struct tr_ids *ids, size_t more)
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

td_err tr_ids_push(struct tr_ids *ids, int32_t id)
{
	if (ids->n == ids->cap && ids_reserve(ids, 1))
		return TD_ENOMEM;
	ids->v[ids->n++] = id;
	return TD_OK;
}

static bool grow(void **p, size_t *cap, size_t need, size_t elem)
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

/* n bytes and a NUL: a JSON string may hold U+0000, where strndup would stop. */
static char *memdup_z(const void *p, size_t n)
{
	char *s = malloc(n + 1);
	if (s) {
		memcpy(s, p, n);
		s[n] = '\0';
	}
	return s;
}

/* GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the
 * others to 256, 257, ... in byte order. */
static void byte_level_table(uint32_t cp[256])
{
	int n = 0;
	for (int b = 0; b < 256; b++) {
		bool keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
		cp[b] = keep ? (uint32_t)b : (uint32_t)(256 + n++);
	}
}

static size_t utf8_put(char *dst, uint32_t cp)
{
	if (cp < 0x80) {
		dst[0] = (char)cp;
		return 1;
	}
	if (cp < 0x800) {
		dst[0] = (char)(0xc0 | cp >> 6);
		dst[1] = (char)(0x80 | (cp & 0x3f));
		return 2;
	}
	if (cp < 0x10000) {
		dst[0] = (char)(0xe0 | cp >> 12);
		dst[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
		dst[2] = (char)(0x80 | (cp & 0x3f));
		return 3;
	}
	dst[0] = (char)(0xf0 | cp >> 18);
	dst[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
	dst[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
	dst[3] = (char)(0x80 | (cp & 0x3f));
	return 4;
}

/* The byte offset of the first invalid UTF-8 sequence, or n if it is valid. */
static size_t utf8_invalid_at(const uint8_t *s, size_t n)
{
	size_t i = 0;
	while (i + 8 <= n) {
		uint64_t w;
		memcpy(&w, s + i, 8);
		if (w & 0x8080808080808080ull)
			break;
		i += 8;
	}
	const uint8_t *bad = u8_check(s + i, n - i);
	return bad ? (size_t)(bad - s) : n;
}

/* ------------------------------------------------------------------------ */
/* Loading: JSON helpers. Every message names origin and the JSON path. */

struct load {
	struct tr_tokenizer *t;
	struct td_errbuf *eb;
	const char *origin;
};

static struct json_object *jget(struct json_object *o, const char *key)
{
	struct json_object *v = NULL;
	if (!o || !json_object_is_type(o, json_type_object) || !json_object_object_get_ex(o, key, &v))
		return NULL;
	return v; /* NULL for a JSON null too */
}

static const char *jstr(struct json_object *o, const char *key)
{
	struct json_object *v = jget(o, key);
	return v && json_object_is_type(v, json_type_string) ? json_object_get_string(v) : NULL;
}

static bool jbool(struct json_object *o, const char *key, bool dflt)
{
	struct json_object *v = jget(o, key);
	return v && json_object_is_type(v, json_type_boolean) ? json_object_get_boolean(v) : dflt;
}

static const char *jtype_name(struct json_object *v)
{
	return v ? json_type_to_name(json_object_get_type(v)) : "null";
}

/* ------------------------------------------------------------------------ */
/* Vocabulary and merges */

static td_err vocab_insert(struct tr_tokenizer *t, int32_t id)
{
	uint64_t h = hash_bytes(t->strs + t->off[id], t->len[id], 1);
	size_t i = h & t->vocab_mask;
	while (t->vocab[i].id >= 0) {
		const struct vslot *s = &t->vocab[i];
		if (s->hash == (uint32_t)h && t->len[s->id] == t->len[id] &&
		    memcmp(t->strs + t->off[s->id], t->strs + t->off[id], t->len[id]) == 0)
			return TD_EMISMATCH; /* the same token twice: JSON objects cannot, but be safe */
		i = (i + 1) & t->vocab_mask;
	}
	t->vocab[i] = (struct vslot){ .hash = (uint32_t)h, .id = id };
	return TD_OK;
}

static int32_t vocab_find(const struct tr_tokenizer *t, const char *s, size_t n)
{
	if (!t->vocab)
		return -1;
	uint64_t h = hash_bytes(s, n, 1);
	size_t i = h & t->vocab_mask;
	while (t->vocab[i].id >= 0) {
		const struct vslot *v = &t->vocab[i];
		if (v->hash == (uint32_t)h && t->len[v->id] == n && memcmp(t->strs + t->off[v->id], s, n) == 0)
			return v->id;
		i = (i + 1) & t->vocab_mask;
	}
	return -1;
}

static inline const struct mslot *merge_find(const struct tr_tokenizer *t, int32_t a, int32_t b)
{
	uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
	size_t i = mix64(key) & t->merges_mask;
	for (;;) {
		const struct mslot *s = &t->merges[i];
		if (s->key == key)
			return s;
		if (s->key == UINT64_MAX)
			return NULL;
		i = (i + 1) & t->merges_mask;
	}
}

/* tokenizers' BPE builder: a later duplicate of a pair replaces the earlier. */
static void merge_put(struct tr_tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t id)
{
	uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
	size_t i = mix64(key) & t->merges_mask;
	while (t->merges[i].key != UINT64_MAX && t->merges[i].key != key)
		i = (i + 1) & t->merges_mask;
	t->merges[i] = (struct mslot){ .key = key, .rank = rank, .id = id };
}

static td_err load_vocab(struct load *L, struct json_object *vocab)
{
	struct tr_tokenizer *t = L->t;
	if (!vocab || !json_object_is_type(vocab, json_type_object))
		return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab: expected an object of token -> id (got %s)",
			       L->origin, jtype_name(vocab));
	size_t bytes = 0;
	int64_t maxid = -1;
	json_object_object_foreach(vocab, key, val)
	{
		if (!json_object_is_type(val, json_type_int))
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab[\"%s\"]: expected an integer id (got %s)",
				       L->origin, key, jtype_name(val));
		int64_t id = json_object_get_int64(val);
		if (id < 0 || id >= MAX_ID)
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab[\"%s\"]: id %lld is out of range", L->origin,
				       key, (long long)id);
		if (id > maxid)
			maxid = id;
		bytes += strlen(key) + 1;
	}
	size_t n = (size_t)(maxid + 1);
	size_t count = (size_t)json_object_object_length(vocab);
	if (n > count + MAX_ID_GAP)
		return td_fail(L->eb, TD_EFORMAT,
			       "%s: model.vocab: id %lld is far past its %zu tokens (more than %d ids unused)", L->origin,
			       (long long)maxid, count, MAX_ID_GAP);
	t->nmodel = (int)n;
	t->strs = malloc(bytes ? bytes : 1);
	t->off = malloc((n ? n : 1) * sizeof(uint32_t));
	t->len = malloc((n ? n : 1) * sizeof(uint32_t));
	t->vocab_mask = pow2_at_least(2 * count + 2) - 1;
	t->vocab = malloc((t->vocab_mask + 1) * sizeof(*t->vocab));
	if (!t->strs || !t->off || !t->len || !t->vocab || bytes > UINT32_MAX)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory for the vocabulary", L->origin);
	for (size_t i = 0; i < n; i++)
		t->len[i] = UINT32_MAX;
	for (size_t i = 0; i <= t->vocab_mask; i++)
		t->vocab[i].id = -1;
	size_t at = 0;
	json_object_object_foreach(vocab, key2, val2)
	{
		int32_t id = (int32_t)json_object_get_int64(val2);
		size_t kl = strlen(key2);
		if (t->len[id] != UINT32_MAX)
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab: id %d is given to both \"%.*s\" and \"%s\"",
				       L->origin, id, (int)t->len[id], t->strs + t->off[id], key2);
		memcpy(t->strs + at, key2, kl + 1);
		t->off[id] = (uint32_t)at;
		t->len[id] = (uint32_t)kl;
		at += kl + 1;
		if (vocab_insert(t, id))
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab: \"%s\" appears twice", L->origin, key2);
	}
	return TD_OK;
}

/* A merge's two parts: "a b" (older files) or ["a", "b"]. */
static td_err merge_parts(struct load *L, struct json_object *m, size_t i, const char **a, size_t *na,
			  const char **b, size_t *nb)
{
	if (json_object_is_type(m, json_type_string)) {
		const char *s = json_object_get_string(m);
		const char *sp = strchr(s, ' ');
		if (!sp || strchr(sp + 1, ' '))
			return td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: \"%s\" is not two tokens separated by one space",
				       L->origin, i, s);
		*a = s;
		*na = (size_t)(sp - s);
		*b = sp + 1;
		*nb = strlen(sp + 1);
		return TD_OK;
	}
	if (json_object_is_type(m, json_type_array) && json_object_array_length(m) == 2) {
		struct json_object *x = json_object_array_get_idx(m, 0), *y = json_object_array_get_idx(m, 1);
		if (json_object_is_type(x, json_type_string) && json_object_is_type(y, json_type_string)) {
			*a = json_object_get_string(x);
			*na = (size_t)json_object_get_string_len(x);
			*b = json_object_get_string(y);
			*nb = (size_t)json_object_get_string_len(y);
			return TD_OK;
		}
	}
	return td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"] (got %s)", L->origin,
		       i, json_object_to_json_string(m));
}

static td_err load_merges(struct load *L, struct json_object *merges)
{
	struct tr_tokenizer *t = L->t;
	if (merges && !json_object_is_type(merges, json_type_array))
		return td_fail(L->eb, TD_EFORMAT, "%s: model.merges: expected an array (got %s)", L->origin,
			       jtype_name(merges));
	size_t n = merges ? json_object_array_length(merges) : 0;
	if (n >= (size_t)MAX_ID)
		return td_fail(L->eb, TD_EFORMAT, "%s: model.merges: %zu merges is too many", L->origin, n);
	t->merges_mask = pow2_at_least(2 * n + 2) - 1;
	t->merges = malloc((t->merges_mask + 1) * sizeof(*t->merges));
	if (!t->merges)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory for the merges", L->origin);
	for (size_t i = 0; i <= t->merges_mask; i++)
		t->merges[i].key = UINT64_MAX;
	char *cat = NULL;
	size_t catcap = 0;
	td_err e = TD_OK;
	for (size_t i = 0; i < n && !e; i++) {
		const char *a = NULL, *b = NULL;
		size_t na = 0, nb = 0;
		if ((e = merge_parts(L, json_object_array_get_idx(merges, i), i, &a, &na, &b, &nb)))
			break;
		int32_t ia = vocab_find(t, a, na), ib = vocab_find(t, b, nb);
		if (ia < 0 || ib < 0) {
			e = td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: \"%.*s\" is not in the vocabulary", L->origin,
				    i, ia < 0 ? (int)na : (int)nb, ia < 0 ? a : b);
			break;
		}
		if (!grow((void **)&cat, &catcap, na + nb, 1)) {
			e = td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
			break;
		}
		memcpy(cat, a, na);
		memcpy(cat + na, b, nb);
		int32_t id = vocab_find(t, cat, na + nb);
		if (id < 0) {
			e = td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: the merged token \"%.*s\" is not in the vocabulary",
				    L->origin, i, (int)(na + nb), cat);
			break;
		}
		merge_put(t, ia, ib, (int32_t)i, id);
	}
	free(cat);
	return e;
}

static td_err load_model(struct load *L, struct json_object *model)
{
	struct tr_tokenizer *t = L->t;
	if (!model || !json_object_is_type(model, json_type_object))
		return td_fail(L->eb, TD_EFORMAT, "%s: model: expected an object (got %s)", L->origin, jtype_name(model));
	const char *type = jstr(model, "type");
	if (!type && jget(model, "merges"))
		type = "BPE"; /* files from before "type" was written */
	if (!type)
		return td_fail(L->eb, TD_EFORMAT, "%s: model.type: missing", L->origin);
	if (strcmp(type, "BPE") != 0)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: model type %s is not supported (traind reads byte-level BPE tokenizers only)", L->origin,
			       type);
	struct json_object *v = jget(model, "dropout");
	if (v && json_object_get_double(v) > 0)
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: model.dropout %g: BPE dropout is not supported", L->origin,
			       json_object_get_double(v));
	static const char *const affixes[] = { "continuing_subword_prefix", "end_of_word_suffix" };
	for (size_t i = 0; i < 2; i++) {
		const char *s = jstr(model, affixes[i]);
		if (s && *s)
			return td_fail(L->eb, TD_EUNSUPPORTED, "%s: model.%s \"%s\" is not supported (byte-level BPE has none)",
				       L->origin, affixes[i], s);
	}
	t->ignore_merges = jbool(model, "ignore_merges", false);
	t->byte_fallback = jbool(model, "byte_fallback", false);
	td_err e = load_vocab(L, jget(model, "vocab"));
	if (e)
		return e;
	if ((e = load_merges(L, jget(model, "merges"))))
		return e;
	t->unk_id = -1;
	const char *unk = jstr(model, "unk_token");
	if (unk && (t->unk_id = vocab_find(t, unk, strlen(unk))) < 0)
		return td_fail(L->eb, TD_EFORMAT, "%s: model.unk_token \"%s\" is not in the vocabulary", L->origin, unk);
	uint32_t cp[256];
	byte_level_table(cp);
	for (int b = 0; b < 256; b++) {
		char s[8];
		size_t n = utf8_put(s, cp[b]);
		memcpy(t->bl_utf8[b], s, 2);
		t->bl_len[b] = (uint8_t)n;
		t->byte_id[b] = vocab_find(t, s, n);
		n = (size_t)snprintf(s, sizeof(s), "<0x%02X>", b);
		t->fallback_id[b] = vocab_find(t, s, n);
	}
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Normalizer */

static td_err load_normalizer(struct load *L, struct json_object *n, const char *path)
{
	struct tr_tokenizer *t = L->t;
	if (!n)
		return TD_OK;
	const char *type = jstr(n, "type");
	if (!type)
		return td_fail(L->eb, TD_EFORMAT, "%s: %s.type: missing", L->origin, path);
	if (strcmp(type, "Sequence") == 0) {
		struct json_object *list = jget(n, "normalizers");
		if (!list || !json_object_is_type(list, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: %s.normalizers: expected an array", L->origin, path);
		for (size_t i = 0; i < json_object_array_length(list); i++) {
			char sub[128];
			snprintf(sub, sizeof(sub), "%s.normalizers[%zu]", path, i);
			td_err e = load_normalizer(L, json_object_array_get_idx(list, i), sub);
			if (e)
				return e;
		}
		return TD_OK;
	}
	static const char *const names[] = { "NFC", "NFD", "NFKC", "NFKD" };
	const uninorm_t forms[] = { UNINORM_NFC, UNINORM_NFD, UNINORM_NFKC, UNINORM_NFKD };
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
		if (strcmp(type, names[i]) != 0)
			continue;
		if (t->nnorms == MAX_NORMS)
			return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s: more than %d normalizers", L->origin, path, MAX_NORMS);
		t->norms[t->nnorms++] = forms[i];
		return TD_OK;
	}
	return td_fail(L->eb, TD_EUNSUPPORTED,
		       "%s: %s: normalizer %s is not supported (NFC, NFD, NFKC, NFKD or a Sequence of those)", L->origin,
		       path, type);
}

/* ------------------------------------------------------------------------ */
/* Regexes */

/* Oniguruma's \s (what tokenizers runs) is White_Space; PCRE2's adds U+180E. */
static const char ws_class[] = "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}"
			       "\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}";

/* Rewrites \s (in and out of classes) and \S (outside classes) to the
 * explicit White_Space set. Returns a new string, NULL when out of memory. */
static char *rewrite_pattern(const char *p)
{
	size_t n = strlen(p), cap = n * 4 + 256, o = 0;
	size_t wl = strlen(ws_class);
	char *out = malloc(cap + (n + 1) * wl);
	if (!out)
		return NULL;
	bool in_class = false;
	for (size_t i = 0; i < n;) {
		char c = p[i];
		if (c == '\\' && i + 1 < n) {
			char d = p[i + 1];
			if (d == 's') {
				if (!in_class)
					out[o++] = '[';
				memcpy(out + o, ws_class, wl);
				o += wl;
				if (!in_class)
					out[o++] = ']';
				i += 2;
				continue;
			}
			if (d == 'S' && !in_class) {
				memcpy(out + o, "[^", 2);
				o += 2;
				memcpy(out + o, ws_class, wl);
				o += wl;
				out[o++] = ']';
				i += 2;
				continue;
			}
			if (d == 'Q') { /* literal up to \E */
				const char *end = strstr(p + i + 2, "\\E");
				size_t stop = end ? (size_t)(end - p) + 2 : n;
				memcpy(out + o, p + i, stop - i);
				o += stop - i;
				i = stop;
				continue;
			}
			out[o++] = c;
			out[o++] = d;
			i += 2;
			continue;
		}
		if (!in_class && c == '[') {
			in_class = true;
			out[o++] = c;
			i++;
			if (i < n && p[i] == '^')
				out[o++] = p[i++];
			if (i < n && p[i] == ']') /* a leading ] is literal */
				out[o++] = p[i++];
			continue;
		}
		if (in_class && c == '[' && i + 1 < n && p[i + 1] == ':') { /* [:alpha:] */
			const char *end = strstr(p + i + 2, ":]");
			size_t stop = end ? (size_t)(end - p) + 2 : i + 1;
			memcpy(out + o, p + i, stop - i);
			o += stop - i;
			i = stop;
			continue;
		}
		if (in_class && c == ']')
			in_class = false;
		out[o++] = c;
		i++;
	}
	out[o] = '\0';
	return out;
}

static td_err compile_regex(struct load *L, struct split *s, const char *pattern, bool literal, const char *path)
{
	char *rewritten = literal ? strdup(pattern) : rewrite_pattern(pattern);
	if (!rewritten)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	int errcode;
	PCRE2_SIZE erroff;
	/* PCRE2_LITERAL takes no UCP (a literal has no classes to widen). */
	uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
	s->re = pcre2_compile((PCRE2_SPTR)rewritten, PCRE2_ZERO_TERMINATED, opts, &errcode, &erroff, NULL);
	free(rewritten);
	if (!s->re) {
		PCRE2_UCHAR msg[256];
		pcre2_get_error_message(errcode, msg, sizeof(msg));
		return td_fail(L->eb, TD_EFORMAT, "%s: %s: the regex does not compile: %s (pattern \"%s\")", L->origin, path,
			       (const char *)msg, pattern);
	}
	s->jit = pcre2_jit_compile(s->re, PCRE2_JIT_COMPLETE) == 0;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Pre-tokenizer */

static td_err load_byte_level(struct load *L, struct json_object *p, const char *path)
{
	struct tr_tokenizer *t = L->t;
	t->bl_prefix_space = jbool(p, "add_prefix_space", false);
	if (jbool(p, "use_regex", true))
		return compile_regex(L, &t->bl_regex, gpt2_pattern, false, path);
	return TD_OK;
}

static td_err load_split(struct load *L, struct json_object *p, const char *path)
{
	struct tr_tokenizer *t = L->t;
	if (t->nsplits == MAX_SPLITS)
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s: more than %d Split steps", L->origin, path, MAX_SPLITS);
	struct json_object *pat = jget(p, "pattern");
	const char *re = jstr(pat, "Regex"), *lit = jstr(pat, "String");
	if (!re && !lit)
		return td_fail(L->eb, TD_EFORMAT, "%s: %s.pattern: expected {\"Regex\": ...} or {\"String\": ...}", L->origin,
			       path);
	if (jbool(p, "invert", false))
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s.invert: an inverted Split is not supported", L->origin, path);
	const char *b = jstr(p, "behavior");
	static const struct {
		const char *name;
		enum split_behavior b;
	} behaviors[] = {
		{ "Isolated", SPLIT_ISOLATED },
		{ "Removed", SPLIT_REMOVED },
		{ "MergedWithPrevious", SPLIT_MERGED_PREV },
		{ "MergedWithNext", SPLIT_MERGED_NEXT },
	};
	size_t k = 0;
	while (k < 4 && !(b && strcmp(b, behaviors[k].name) == 0))
		k++;
	if (k == 4)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: %s.behavior: %s is not supported (Isolated, Removed, MergedWithPrevious, MergedWithNext)",
			       L->origin, path, b ? b : "(missing)");
	struct split *s = &t->splits[t->nsplits];
	s->behavior = behaviors[k].b;
	td_err e = compile_regex(L, s, re ? re : lit, !re, path);
	if (!e)
		t->nsplits++;
	return e;
}

static td_err load_pre_tokenizer(struct load *L, struct json_object *p)
{
	if (!p)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: pre_tokenizer: none; traind reads byte-level BPE, which needs a ByteLevel pre-tokenizer",
			       L->origin);
	const char *type = jstr(p, "type");
	if (type && strcmp(type, "ByteLevel") == 0)
		return load_byte_level(L, p, "pre_tokenizer");
	if (!type || strcmp(type, "Sequence") != 0)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: pre_tokenizer %s is not supported (ByteLevel, or a Sequence of Split steps and ByteLevel)",
			       L->origin, type ? type : "(no type)");
	struct json_object *list = jget(p, "pretokenizers");
	size_t n = list && json_object_is_type(list, json_type_array) ? json_object_array_length(list) : 0;
	for (size_t i = 0; i < n; i++) {
		struct json_object *s = json_object_array_get_idx(list, i);
		const char *st = jstr(s, "type");
		char path[96];
		snprintf(path, sizeof(path), "pre_tokenizer.pretokenizers[%zu]", i);
		td_err e;
		if (st && strcmp(st, "Split") == 0) {
			e = load_split(L, s, path);
		} else if (st && strcmp(st, "ByteLevel") == 0) {
			if (i + 1 != n)
				return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s: ByteLevel must be the last pre-tokenizer",
					       L->origin, path);
			e = load_byte_level(L, s, path);
		} else {
			return td_fail(L->eb, TD_EUNSUPPORTED,
				       "%s: %s: pre-tokenizer %s is not supported (Split and ByteLevel only)", L->origin, path,
				       st ? st : "(no type)");
		}
		if (e)
			return e;
		if (i + 1 == n && (!st || strcmp(st, "ByteLevel") != 0))
			return td_fail(L->eb, TD_EUNSUPPORTED,
				       "%s: pre_tokenizer: the Sequence does not end in ByteLevel; traind reads byte-level BPE only",
				       L->origin);
	}
	if (n == 0)
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: pre_tokenizer: an empty Sequence; byte-level BPE needs ByteLevel",
			       L->origin);
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Added tokens */

static td_err trie_add(struct trie *tr, const char *s, size_t n, int32_t added)
{
	if (!tr->node) {
		if (!(tr->node = malloc(64 * sizeof(*tr->node))))
			return TD_ENOMEM;
		tr->cap = 64;
		tr->node[0] = (struct trie_node){ .child = -1, .sibling = -1, .added = -1 };
		tr->n = 1;
	}
	int32_t cur = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t b = (uint8_t)s[i];
		int32_t c = tr->node[cur].child;
		while (c >= 0 && tr->node[c].byte != b)
			c = tr->node[c].sibling;
		if (c < 0) {
			if (!grow((void **)&tr->node, &tr->cap, tr->n + 1, sizeof(*tr->node)))
				return TD_ENOMEM;
			c = (int32_t)tr->n++;
			tr->node[c] = (struct trie_node){ .child = -1, .sibling = tr->node[cur].child, .added = -1, .byte = b };
			tr->node[cur].child = c;
		}
		cur = c;
	}
	/* Two added tokens with the same content: the first listed wins. */
	if (tr->node[cur].added < 0)
		tr->node[cur].added = added;
	tr->first[(uint8_t)s[0] >> 3] |= (uint8_t)(1u << ((uint8_t)s[0] & 7));
	tr->any = true;
	return TD_OK;
}

/* The longest added token starting at p[i], or -1; *mlen its length. */
static int32_t trie_match(const struct trie *tr, const uint8_t *p, size_t n, size_t i, size_t *mlen)
{
	int32_t cur = 0, best = -1;
	for (size_t k = i; k < n; k++) {
		int32_t c = tr->node[cur].child;
		while (c >= 0 && tr->node[c].byte != p[k])
			c = tr->node[c].sibling;
		if (c < 0)
			break;
		cur = c;
		if (tr->node[cur].added >= 0) {
			best = tr->node[cur].added;
			*mlen = k + 1 - i;
		}
	}
	return best;
}

static td_err normalize_with(const struct tr_tokenizer *t, const uint8_t *s, size_t n, uint8_t **out, size_t *out_len);

static td_err load_added(struct load *L, struct json_object *list)
{
	struct tr_tokenizer *t = L->t;
	if (!list)
		return TD_OK;
	if (!json_object_is_type(list, json_type_array))
		return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens: expected an array (got %s)", L->origin, jtype_name(list));
	size_t n = json_object_array_length(list);
	t->added = calloc(n ? n : 1, sizeof(*t->added));
	if (!t->added)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	for (size_t i = 0; i < n; i++) {
		struct json_object *a = json_object_array_get_idx(list, i);
		struct json_object *idv = jget(a, "id"), *cv = jget(a, "content");
		if (!idv || !json_object_is_type(idv, json_type_int) || json_object_get_int64(idv) < 0 ||
		    json_object_get_int64(idv) >= MAX_ID)
			return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens[%zu].id: expected an id in 0 .. %d", L->origin, i,
				       MAX_ID - 1);
		if (!cv || !json_object_is_type(cv, json_type_string) || json_object_get_string_len(cv) == 0)
			return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens[%zu].content: expected a non-empty string",
				       L->origin, i);
		struct added *ad = &t->added[t->nadded++];
		ad->id = (int32_t)json_object_get_int64(idv);
		ad->special = jbool(a, "special", false);
		ad->normalized = jbool(a, "normalized", !ad->special);
		ad->single_word = jbool(a, "single_word", false);
		ad->lstrip = jbool(a, "lstrip", false);
		ad->rstrip = jbool(a, "rstrip", false);
		const uint8_t *c = (const uint8_t *)json_object_get_string(cv);
		size_t cl = (size_t)json_object_get_string_len(cv);
		if (!(ad->orig = memdup_z(c, cl)))
			return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
		ad->orig_len = cl;
		if (ad->normalized && t->nnorms) {
			uint8_t *nc;
			size_t nl;
			if (normalize_with(t, c, cl, &nc, &nl))
				return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens[%zu].content: cannot be normalized",
					       L->origin, i);
			ad->content = (char *)nc;
			ad->len = nl;
		} else {
			ad->content = memdup_z(c, cl);
			ad->len = cl;
		}
		if (!ad->content)
			return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
		if (ad->len == 0)
			continue; /* normalized away: never matches */
		struct trie *tr = ad->normalized ? &t->normed : &t->raw;
		if (trie_add(tr, ad->content, ad->len, (int32_t)(t->nadded - 1)))
			return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	}
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Post-processor */

static td_err push_id(struct load *L, int32_t **v, size_t *n, int64_t id, const char *path)
{
	if (id < 0 || id >= MAX_ID)
		return td_fail(L->eb, TD_EFORMAT, "%s: %s: id %lld is out of range", L->origin, path, (long long)id);
	int32_t *nv = realloc(*v, (*n + 1) * sizeof(**v));
	if (!nv)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	nv[(*n)++] = (int32_t)id;
	*v = nv;
	return TD_OK;
}

/* RobertaProcessing / BertProcessing: "cls": ["<s>", 0], "sep": ["</s>", 2]. */
static td_err load_cls_sep(struct load *L, struct json_object *p, const char *path)
{
	struct tr_tokenizer *t = L->t;
	struct json_object *cls = jget(p, "cls"), *sep = jget(p, "sep");
	struct json_object *ci = cls && json_object_is_type(cls, json_type_array) ? json_object_array_get_idx(cls, 1) : NULL;
	struct json_object *si = sep && json_object_is_type(sep, json_type_array) ? json_object_array_get_idx(sep, 1) : NULL;
	if (!ci || !si || !json_object_is_type(ci, json_type_int) || !json_object_is_type(si, json_type_int))
		return td_fail(L->eb, TD_EFORMAT, "%s: %s: expected \"cls\" and \"sep\" as [token, id]", L->origin, path);
	td_err e = push_id(L, &t->pre, &t->npre, json_object_get_int64(ci), path);
	return e ? e : push_id(L, &t->post, &t->npost, json_object_get_int64(si), path);
}

static td_err load_template(struct load *L, struct json_object *p, const char *path)
{
	struct tr_tokenizer *t = L->t;
	struct json_object *single = jget(p, "single"), *specials = jget(p, "special_tokens");
	if (!single || !json_object_is_type(single, json_type_array))
		return td_fail(L->eb, TD_EFORMAT, "%s: %s.single: expected an array", L->origin, path);
	bool seen_seq = false;
	for (size_t i = 0; i < json_object_array_length(single); i++) {
		struct json_object *item = json_object_array_get_idx(single, i);
		if (jget(item, "Sequence")) {
			seen_seq = true;
			continue;
		}
		const char *name = jstr(jget(item, "SpecialToken"), "id");
		struct json_object *st = name ? jget(specials, name) : NULL;
		struct json_object *ids = jget(st, "ids");
		if (!ids || !json_object_is_type(ids, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: %s.single[%zu]: special token %s is not in special_tokens",
				       L->origin, path, i, name ? name : "(unnamed)");
		for (size_t k = 0; k < json_object_array_length(ids); k++) {
			td_err e = seen_seq ? push_id(L, &t->post, &t->npost, json_object_get_int64(json_object_array_get_idx(ids, k)), path)
					    : push_id(L, &t->pre, &t->npre, json_object_get_int64(json_object_array_get_idx(ids, k)), path);
			if (e)
				return e;
		}
	}
	return TD_OK;
}

static td_err load_post_processor(struct load *L, struct json_object *p, const char *path)
{
	if (!p)
		return TD_OK;
	const char *type = jstr(p, "type");
	if (type && strcmp(type, "ByteLevel") == 0)
		return TD_OK; /* offsets only */
	if (type && strcmp(type, "TemplateProcessing") == 0)
		return load_template(L, p, path);
	if (type && (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0))
		return load_cls_sep(L, p, path);
	if (type && strcmp(type, "Sequence") == 0) {
		struct json_object *list = jget(p, "processors");
		/* json-c's array calls on another type read it as an array. */
		if (list && !json_object_is_type(list, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: %s.processors: expected an array (got %s)", L->origin, path,
				       jtype_name(list));
		for (size_t i = 0; list && i < json_object_array_length(list); i++) {
			char sub[96];
			snprintf(sub, sizeof(sub), "%s.processors[%zu]", path, i);
			td_err e = load_post_processor(L, json_object_array_get_idx(list, i), sub);
			if (e)
				return e;
		}
		return TD_OK;
	}
	return td_fail(L->eb, TD_EUNSUPPORTED,
		       "%s: %s %s is not supported (ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing)",
		       L->origin, path, type ? type : "(no type)");
}

static td_err load_decoder(struct load *L, struct json_object *d)
{
	if (!d)
		return TD_OK;
	const char *type = jstr(d, "type");
	if (type && strcmp(type, "ByteLevel") == 0)
		return TD_OK;
	if (type && strcmp(type, "Sequence") == 0) {
		struct json_object *list = jget(d, "decoders");
		if (list && !json_object_is_type(list, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: decoder.decoders: expected an array (got %s)", L->origin,
				       jtype_name(list));
		for (size_t i = 0; list && i < json_object_array_length(list); i++) {
			const char *st = jstr(json_object_array_get_idx(list, i), "type");
			if (!st || strcmp(st, "ByteLevel") != 0)
				return td_fail(L->eb, TD_EUNSUPPORTED, "%s: decoder.decoders[%zu]: decoder %s is not supported (ByteLevel only)",
					       L->origin, i, st ? st : "(no type)");
		}
		return TD_OK;
	}
	return td_fail(L->eb, TD_EUNSUPPORTED, "%s: decoder %s is not supported (ByteLevel only)", L->origin,
		       type ? type : "(no type)");
}

/* Per id: special flag, added index and the bytes it decodes to. */
static td_err build_id_tables(struct load *L)
{
	struct tr_tokenizer *t = L->t;
	int64_t vs = t->nmodel;
	for (size_t i = 0; i < t->nadded; i++)
		if (t->added[i].id + 1 > vs)
			vs = t->added[i].id + 1;
	/* An added token may sit past the model's ids, but not far past them
	 * (MAX_ID_GAP): the tables below are per id. */
	if ((uint64_t)vs > (uint64_t)t->nmodel + t->nadded + MAX_ID_GAP)
		return td_fail(L->eb, TD_EFORMAT,
			       "%s: added_tokens: id %lld is far past the %d model ids and %zu added tokens "
			       "(more than %d ids unused)",
			       L->origin, (long long)vs - 1, t->nmodel, t->nadded, MAX_ID_GAP);
	for (size_t i = 0; i < t->npre; i++)
		if (t->pre[i] >= vs)
			return td_fail(L->eb, TD_EFORMAT, "%s: post_processor: id %d has no token", L->origin, t->pre[i]);
	for (size_t i = 0; i < t->npost; i++)
		if (t->post[i] >= vs)
			return td_fail(L->eb, TD_EFORMAT, "%s: post_processor: id %d has no token", L->origin, t->post[i]);
	t->vocab_size = (int)vs;
	size_t n = (size_t)vs;
	t->special = calloc(n ? n : 1, 1);
	t->added_of = malloc((n ? n : 1) * sizeof(int32_t));
	t->dec_off = malloc((n + 1) * sizeof(uint32_t));
	if (!t->special || !t->added_of || !t->dec_off)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	for (size_t i = 0; i < n; i++)
		t->added_of[i] = -1;
	/* The last entry for an id wins, as tokenizers' added vocabulary does. */
	for (size_t i = 0; i < t->nadded; i++) {
		t->added_of[t->added[i].id] = (int32_t)i;
		t->special[t->added[i].id] = t->added[i].special;
	}
	/* Below the vocabulary size is not enough: an id in a gap of the
	 * vocabulary would be put in every sequence and decode to nothing. */
	for (size_t i = 0; i < t->npre + t->npost; i++) {
		int32_t id = i < t->npre ? t->pre[i] : t->post[i - t->npre];
		if (t->added_of[id] < 0 && (id >= t->nmodel || t->len[id] == UINT32_MAX))
			return td_fail(L->eb, TD_EFORMAT, "%s: post_processor: id %d has no token", L->origin, id);
	}
	uint32_t cp[256];
	byte_level_table(cp);
	int16_t rev[512];
	for (int i = 0; i < 512; i++)
		rev[i] = -1;
	for (int b = 0; b < 256; b++)
		rev[cp[b]] = (int16_t)b;
	/* Decoded bytes are never longer than the spelling. */
	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		if (t->added_of[i] >= 0) {
			total += t->added[t->added_of[i]].orig_len;
		} else if (i < (size_t)t->nmodel && t->len[i] != UINT32_MAX) {
			total += t->len[i];
		}
	}
	if (total > UINT32_MAX)
		return td_fail(L->eb, TD_EFORMAT, "%s: the vocabulary is too large", L->origin);
	t->dec = malloc(total ? total : 1);
	if (!t->dec)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	uint32_t at = 0;
	for (size_t i = 0; i < n; i++) {
		t->dec_off[i] = at;
		if (t->added_of[i] >= 0) {
			const struct added *ad = &t->added[t->added_of[i]];
			memcpy(t->dec + at, ad->orig, ad->orig_len);
			at += (uint32_t)ad->orig_len;
			continue;
		}
		if (i >= (size_t)t->nmodel || t->len[i] == UINT32_MAX)
			continue;
		const uint8_t *s = (const uint8_t *)t->strs + t->off[i];
		size_t len = t->len[i], k = 0;
		uint32_t start = at;
		bool all = true;
		while (k < len) {
			ucs4_t c;
			int m = u8_mbtouc(&c, s + k, len - k);
			if (c >= 512 || rev[c] < 0) {
				all = false;
				break;
			}
			t->dec[at++] = (uint8_t)rev[c];
			k += (size_t)m;
		}
		if (!all) { /* tokenizers keeps such a token's text as it is */
			at = start;
			memcpy(t->dec + at, s, len);
			at += (uint32_t)len;
		}
	}
	t->dec_off[n] = at;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Load, free, accessors */

static void split_free(struct split *s)
{
	pcre2_code_free(s->re);
	s->re = NULL;
}

void tr_tokenizer_free(struct tr_tokenizer *t)
{
	if (!t)
		return;
	free(t->strs);
	free(t->off);
	free(t->len);
	free(t->vocab);
	free(t->merges);
	for (int i = 0; i < t->nsplits; i++)
		split_free(&t->splits[i]);
	split_free(&t->bl_regex);
	for (size_t i = 0; i < t->nadded; i++) {
		free(t->added[i].content);
		free(t->added[i].orig);
	}
	free(t->added);
	free(t->raw.node);
	free(t->normed.node);
	free(t->pre);
	free(t->post);
	free(t->special);
	free(t->added_of);
	free(t->dec_off);
	free(t->dec);
	free(t);
}

td_err tr_tokenizer_parse(struct tr_tokenizer **out, const char *json, size_t len, const char *origin,
			  struct td_errbuf *eb)
{
	if (len > INT32_MAX)
		return td_fail(eb, TD_ERANGE, "%s: %zu bytes is too large for a tokenizer.json", origin, len);
	json_tokener *tok = json_tokener_new_ex(64);
	if (!tok)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", origin);
	json_tokener_set_flags(tok, JSON_TOKENER_VALIDATE_UTF8);
	struct json_object *root = json_tokener_parse_ex(tok, json, (int)len);
	enum json_tokener_error jerr = json_tokener_get_error(tok);
	size_t end = json_tokener_get_parse_end(tok);
	json_tokener_free(tok);
	if (jerr != json_tokener_success || !root) {
		json_object_put(root);
		return td_fail(eb, TD_EFORMAT, "%s: not valid JSON: %s (near byte %zu)", origin,
			       jerr == json_tokener_continue ? "unexpected end of file" : json_tokener_error_desc(jerr), end);
	}
	struct tr_tokenizer *t = calloc(1, sizeof(*t));
	if (!t) {
		json_object_put(root);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", origin);
	}
	snprintf(t->origin, sizeof(t->origin), "%s", origin);
	t->digest[0] = hash_bytes(json, len, 0x243f6a8885a308d3ull);
	t->digest[1] = hash_bytes(json, len, 0x13198a2e03707344ull);
	struct load L = { .t = t, .eb = eb, .origin = t->origin };
	td_err e = TD_OK;
	if (!json_object_is_type(root, json_type_object))
		e = td_fail(eb, TD_EFORMAT, "%s: expected a JSON object at the top", origin);
	if (!e)
		e = load_model(&L, jget(root, "model"));
	if (!e)
		e = load_normalizer(&L, jget(root, "normalizer"), "normalizer");
	if (!e)
		e = load_pre_tokenizer(&L, jget(root, "pre_tokenizer"));
	if (!e)
		e = load_added(&L, jget(root, "added_tokens"));
	if (!e)
		e = load_post_processor(&L, jget(root, "post_processor"), "post_processor");
	if (!e)
		e = load_decoder(&L, jget(root, "decoder"));
	if (!e)
		e = build_id_tables(&L);
	json_object_put(root);
	if (e) {
		tr_tokenizer_free(t);
		return e;
	}
	*out = t;
	return TD_OK;
}

td_err tr_tokenizer_load(struct tr_tokenizer **out, const char *path, struct td_errbuf *eb)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "%s: cannot open: %s", path, strerror(errno));
	struct stat st;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return td_fail(eb, TD_EFORMAT, "%s: not a regular file", path);
	}
	if ((unsigned long long)st.st_size > MAX_FILE_BYTES) {
		close(fd);
		return td_fail(eb, TD_ERANGE, "%s: %lld bytes is too large for a tokenizer.json", path,
			       (long long)st.st_size);
	}
	size_t n = (size_t)st.st_size, got = 0;
	char *buf = malloc(n + 1);
	if (!buf) {
		close(fd);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	}
	while (got < n) {
		ssize_t r = read(fd, buf + got, n - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			int err = r < 0 ? errno : EIO;
			free(buf);
			close(fd);
			return td_fail(eb, td_from_errno(err), "%s: cannot read: %s", path, strerror(err));
		}
		got += (size_t)r;
	}
	close(fd);
	buf[n] = '\0';
	td_err e = tr_tokenizer_parse(out, buf, n, path, eb);
	free(buf);
	return e;
}

int tr_tokenizer_vocab_size(const struct tr_tokenizer *t)
{
	return t->vocab_size;
}

int tr_tokenizer_token_id(const struct tr_tokenizer *t, const char *token)
{
	size_t n = strlen(token);
	for (size_t i = 0; i < t->nadded; i++) {
		const struct added *a = &t->added[i];
		if (t->added_of[a->id] == (int32_t)i && a->orig_len == n && memcmp(a->orig, token, n) == 0)
			return a->id;
	}
	return vocab_find(t, token, n);
}

const char *tr_tokenizer_token(const struct tr_tokenizer *t, int id, size_t *len)
{
	if (id < 0 || id >= t->vocab_size)
		return NULL;
	if (t->added_of[id] >= 0) {
		const struct added *a = &t->added[t->added_of[id]];
		if (len)
			*len = a->orig_len;
		return a->orig;
	}
	if (id >= t->nmodel || t->len[id] == UINT32_MAX)
		return NULL;
	if (len)
		*len = t->len[id];
	return t->strs + t->off[id];
}

bool tr_tokenizer_is_special(const struct tr_tokenizer *t, int id)
{
	return id >= 0 && id < t->vocab_size && t->special[id];
}

void tr_tokenizer_affixes(const struct tr_tokenizer *t, const int32_t **pre, size_t *npre, const int32_t **post,
			  size_t *npost)
{
	*pre = t->pre;
	*npre = t->npre;
	*post = t->post;
	*npost = t->npost;
}

void tr_tokenizer_digest(const struct tr_tokenizer *t, uint64_t out[2])
{
	out[0] = t->digest[0];
	out[1] = t->digest[1];
}

/* ------------------------------------------------------------------------ */
/* Encoder */

td_err tr_encoder_new(struct tr_encoder **out, const struct tr_tokenizer *t, struct td_errbuf *eb)
{
	struct tr_encoder *e = calloc(1, sizeof(*e));
	if (!e)
		return td_fail(eb, TD_ENOMEM, "encoder: out of memory");
	e->t = t;
	e->md = pcre2_match_data_create(8, NULL);
	e->mctx = pcre2_match_context_create(NULL);
	e->jstack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, NULL);
	e->cache = calloc(CACHE_SLOTS, sizeof(*e->cache));
	e->ckeys = malloc(CACHE_BYTES);
	e->cids = malloc(CACHE_IDS * sizeof(int32_t));
	if (!e->md || !e->mctx || !e->jstack || !e->cache || !e->ckeys || !e->cids) {
		tr_encoder_free(e);
		return td_fail(eb, TD_ENOMEM, "encoder: out of memory");
	}
	pcre2_jit_stack_assign(e->mctx, NULL, e->jstack);
	*out = e;
	return TD_OK;
}

void tr_encoder_free(struct tr_encoder *e)
{
	if (!e)
		return;
	pcre2_match_data_free(e->md);
	pcre2_match_context_free(e->mctx);
	pcre2_jit_stack_free(e->jstack);
	free(e->nbuf[0]);
	free(e->nbuf[1]);
	free(e->pbuf);
	for (int i = 0; i <= MAX_SPLITS; i++)
		free(e->spans[i]);
	free(e->syms);
	free(e->heap);
	free(e->mapped);
	free(e->cache);
	free(e->ckeys);
	free(e->cids);
	free(e);
}

/* --- the word cache --- */

static bool cache_get(struct tr_encoder *e, uint64_t h, const uint8_t *w, size_t n, struct tr_ids *out, td_err *err)
{
	size_t i = h & (CACHE_SLOTS - 1);
	for (;;) {
		const struct cslot *s = &e->cache[i];
		if (!s->h)
			return false;
		if (s->h == h && s->klen == n && memcmp(e->ckeys + s->koff, w, n) == 0) {
			if (!s->in)
				return true;
			if (ids_reserve(out, s->in)) {
				*err = TD_ENOMEM;
				return true;
			}
			memcpy(out->v + out->n, e->cids + s->ioff, s->in * sizeof(int32_t));
			out->n += s->in;
			return true;
		}
		i = (i + 1) & (CACHE_SLOTS - 1);
	}
}

static void cache_put(struct tr_encoder *e, uint64_t h, const uint8_t *w, size_t n, const int32_t *ids, size_t nids)
{
	if (e->cache_n >= CACHE_MAX_ENTRIES || e->ckeys_n + n > CACHE_BYTES || e->cids_n + nids > CACHE_IDS) {
		memset(e->cache, 0, CACHE_SLOTS * sizeof(*e->cache));
		e->cache_n = e->ckeys_n = e->cids_n = 0;
		if (n > CACHE_BYTES || nids > CACHE_IDS)
			return;
	}
	size_t i = h & (CACHE_SLOTS - 1);
	while (e->cache[i].h)
		i = (i + 1) & (CACHE_SLOTS - 1);
	memcpy(e->ckeys + e->ckeys_n, w, n);
	if (nids)
		memcpy(e->cids + e->cids_n, ids, nids * sizeof(int32_t));
	e->cache[i] = (struct cslot){ .h = h, .koff = (uint32_t)e->ckeys_n, .klen = (uint32_t)n,
				      .ioff = (uint32_t)e->cids_n, .in = (uint32_t)nids };
	e->ckeys_n += n;
	e->cids_n += nids;
	e->cache_n++;
}

/* --- BPE --- */

static inline bool qless(const struct qent *a, const struct qent *b)
{
	return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct qent *h, size_t *n, struct qent x)
{
	size_t i = (*n)++;
	while (i) {
		size_t p = (i - 1) / 2;
		if (!qless(&x, &h[p]))
			break;
		h[i] = h[p];
		i = p;
	}
	h[i] = x;
}

static struct qent heap_pop(struct qent *h, size_t *n)
{
	struct qent top = h[0], x = h[--(*n)];
	size_t i = 0;
	for (;;) {
		size_t l = 2 * i + 1, r = l + 1, m = i;
		const struct qent *best = &x;
		if (l < *n && qless(&h[l], best)) {
			m = l;
			best = &h[l];
		}
		if (r < *n && qless(&h[r], best))
			m = r;
		if (m == i)
			break;
		h[i] = h[m];
		i = m;
	}
	if (*n)
		h[i] = x;
	return top;
}

static td_err bpe(struct tr_encoder *e, const uint8_t *w, size_t n)
{
	const struct tr_tokenizer *t = e->t;
	struct tr_ids *out = e->out;
	td_err err = TD_OK;
	uint64_t h = 0;
	if (n <= CACHE_MAX_WORD) {
		h = hash_bytes(w, n, 7) | 1;
		if (cache_get(e, h, w, n, out, &err))
			return err;
	}
	size_t start = out->n;
	if (t->ignore_merges) {
		if (!grow((void **)&e->mapped, &e->mapped_cap, 2 * n, 1))
			return TD_ENOMEM;
		size_t m = 0;
		for (size_t i = 0; i < n; i++) {
			memcpy(e->mapped + m, t->bl_utf8[w[i]], 2);
			m += t->bl_len[w[i]];
		}
		int32_t id = vocab_find(t, e->mapped, m);
		if (id >= 0) {
			if (tr_ids_push(out, id))
				return TD_ENOMEM;
			if (h)
				cache_put(e, h, w, n, &id, 1);
			return TD_OK;
		}
	}
	if (!grow((void **)&e->syms, &e->sym_cap, n, sizeof(*e->syms)) ||
	    !grow((void **)&e->heap, &e->heap_cap, 2 * n + 2, sizeof(*e->heap)))
		return TD_ENOMEM;
	struct sym *s = e->syms;
	int32_t m = 0;
	for (size_t i = 0; i < n; i++) {
		int32_t id = t->byte_id[w[i]];
		if (id < 0 && t->byte_fallback)
			id = t->fallback_id[w[i]];
		if (id < 0)
			id = t->unk_id;
		if (id < 0)
			continue; /* tokenizers drops a character it has no id for */
		s[m] = (struct sym){ .c = id, .prev = m - 1, .next = m + 1, .len = 1 };
		m++;
	}
	if (m == 0)
		return TD_OK;
	s[m - 1].next = -1;
	size_t hn = 0;
	for (int32_t i = 0; i + 1 < m; i++) {
		const struct mslot *ms = merge_find(t, s[i].c, s[i + 1].c);
		if (ms)
			heap_push(e->heap, &hn, (struct qent){ ms->rank, i, ms->id });
	}
	while (hn) {
		struct qent top = heap_pop(e->heap, &hn);
		struct sym *a = &s[top.pos];
		if (a->len == 0 || a->next < 0)
			continue;
		struct sym *b = &s[a->next];
		const struct mslot *ms = merge_find(t, a->c, b->c);
		if (!ms || ms->id != top.id)
			continue; /* stale */
		a->c = top.id;
		a->len += b->len;
		a->next = b->next;
		b->len = 0;
		if (a->next >= 0)
			s[a->next].prev = top.pos;
		if (!grow((void **)&e->heap, &e->heap_cap, hn + 2, sizeof(*e->heap)))
			return TD_ENOMEM;
		if (a->prev >= 0 && (ms = merge_find(t, s[a->prev].c, a->c)))
			heap_push(e->heap, &hn, (struct qent){ ms->rank, a->prev, ms->id });
		if (a->next >= 0 && (ms = merge_find(t, a->c, s[a->next].c)))
			heap_push(e->heap, &hn, (struct qent){ ms->rank, top.pos, ms->id });
	}
	for (int32_t i = 0; i >= 0; i = s[i].next)
		if (tr_ids_push(out, s[i].c))
			return TD_ENOMEM;
	if (h)
		cache_put(e, h, w, n, out->v + start, out->n - start);
	return TD_OK;
}

/* --- the pipeline --- */

static td_err word(struct tr_encoder *e, const char *p, size_t n)
{
	if (n == 0)
		return TD_OK;
	if (e->fn) {
		e->fn(e->ctx, p, n, -1);
		return TD_OK;
	}
	return bpe(e, (const uint8_t *)p, n);
}

static td_err regex_spans(struct tr_encoder *e, const struct split *sp, const char *p, size_t n, int stage,
			  size_t *nspans)
{
	size_t cnt = 0, off = 0;
	for (;;) {
		if (off > n)
			break;
		int rc = sp->jit ? pcre2_jit_match(sp->re, (PCRE2_SPTR)p, n, off, PCRE2_NO_UTF_CHECK, e->md, e->mctx)
				 : pcre2_match(sp->re, (PCRE2_SPTR)p, n, off, PCRE2_NO_UTF_CHECK, e->md, e->mctx);
		if (rc == PCRE2_ERROR_NOMATCH)
			break;
		if (rc < 0) {
			PCRE2_UCHAR msg[256];
			pcre2_get_error_message(rc, msg, sizeof(msg));
			return td_fail(e->eb, TD_EINTERNAL, "%s: pre-tokenizer regex failed: %s", e->t->origin,
				       (const char *)msg);
		}
		PCRE2_SIZE *ov = pcre2_get_ovector_pointer(e->md);
		size_t s = ov[0], t = ov[1];
		if (t == s) { /* empty match: step over one character */
			if (s >= n)
				break;
			off = s + 1;
			while (off < n && ((uint8_t)p[off] & 0xc0) == 0x80)
				off++;
			continue;
		}
		if (!grow((void **)&e->spans[stage], &e->nspan_cap[stage], cnt + 1, sizeof(struct span)))
			return TD_ENOMEM;
		e->spans[stage][cnt++] = (struct span){ s, t };
		off = t;
	}
	*nspans = cnt;
	return TD_OK;
}

static td_err pretok(struct tr_encoder *e, int stage, const char *p, size_t n);

static td_err byte_level(struct tr_encoder *e, const char *p, size_t n)
{
	const struct tr_tokenizer *t = e->t;
	if (n == 0)
		return TD_OK;
	if (t->bl_prefix_space && p[0] != ' ') {
		if (!grow((void **)&e->pbuf, &e->pcap, n + 1, 1))
			return TD_ENOMEM;
		e->pbuf[0] = ' ';
		memmove(e->pbuf + 1, p, n);
		p = e->pbuf;
		n++;
	}
	if (!t->bl_regex.re)
		return word(e, p, n);
	size_t ns;
	td_err err = regex_spans(e, &t->bl_regex, p, n, MAX_SPLITS, &ns);
	if (err)
		return err;
	/* Isolated: the gaps between matches are words too. Spans of this stage
	 * are not touched by word(), so iterating them here is safe. */
	size_t prev = 0;
	for (size_t i = 0; i < ns && !err; i++) {
		struct span sp = e->spans[MAX_SPLITS][i];
		if (sp.s > prev)
			err = word(e, p + prev, sp.s - prev);
		if (!err)
			err = word(e, p + sp.s, sp.e - sp.s);
		prev = sp.e;
	}
	if (!err && prev < n)
		err = word(e, p + prev, n - prev);
	return err;
}

/* Applies Split step `stage` to p, then the later steps to each piece. */
static td_err pretok(struct tr_encoder *e, int stage, const char *p, size_t n)
{
	const struct tr_tokenizer *t = e->t;
	if (n == 0)
		return TD_OK;
	if (stage == t->nsplits)
		return byte_level(e, p, n);
	const struct split *sp = &t->splits[stage];
	size_t ns;
	td_err err = regex_spans(e, sp, p, n, stage, &ns);
	if (err)
		return err;
	/* e->spans[stage] stays valid while later stages run: they write
	 * e->spans[stage + 1 ...] (ByteLevel's regex uses the last slot).
	 * Walk the (gap, match) sequence, as tokenizers' find_matches lists it,
	 * and cut pieces by the behaviour. `pend` is a piece not yet emitted
	 * (MergedWithPrevious may extend it; MergedWithNext carries a match
	 * start into the next gap). */
	size_t prev = 0, pend_s = 0, pend_e = 0;
	bool have_pend = false, prev_match = false;
	for (size_t i = 0; i <= ns && !err; i++) {
		size_t gs = prev, ge = i < ns ? e->spans[stage][i].s : n;
		/* the gap before match i (or the tail) */
		if (ge > gs) {
			switch (sp->behavior) {
			case SPLIT_MERGED_NEXT:
				if (have_pend) { /* a match waiting for its next piece */
					gs = pend_s;
					have_pend = false;
				}
				/* fallthrough */
			case SPLIT_ISOLATED:
			case SPLIT_REMOVED:
				err = pretok(e, stage + 1, p + gs, ge - gs);
				break;
			case SPLIT_MERGED_PREV:
				if (have_pend)
					err = pretok(e, stage + 1, p + pend_s, pend_e - pend_s);
				pend_s = gs;
				pend_e = ge;
				have_pend = true;
				break;
			}
			prev_match = false;
		}
		if (err || i == ns)
			break;
		size_t ms = e->spans[stage][i].s, me = e->spans[stage][i].e;
		switch (sp->behavior) {
		case SPLIT_ISOLATED:
			err = pretok(e, stage + 1, p + ms, me - ms);
			break;
		case SPLIT_REMOVED:
			break;
		case SPLIT_MERGED_PREV:
			if (have_pend && !prev_match) {
				pend_e = me; /* appended to the piece before */
			} else {
				if (have_pend)
					err = pretok(e, stage + 1, p + pend_s, pend_e - pend_s);
				pend_s = ms;
				pend_e = me;
				have_pend = true;
			}
			break;
		case SPLIT_MERGED_NEXT:
			/* A match followed by another match stands alone. */
			if (have_pend)
				err = pretok(e, stage + 1, p + pend_s, pend_e - pend_s);
			pend_s = ms;
			pend_e = me;
			have_pend = true;
			break;
		}
		prev_match = true;
		prev = me;
	}
	if (!err && have_pend)
		err = pretok(e, stage + 1, p + pend_s, pend_e - pend_s);
	return err;
}

static td_err normalize_with(const struct tr_tokenizer *t, const uint8_t *s, size_t n, uint8_t **out, size_t *out_len)
{
	uint8_t *cur = NULL;
	size_t curn = n;
	const uint8_t *src = s;
	for (int i = 0; i < t->nnorms; i++) {
		size_t len = 0;
		uint8_t *r = u8_normalize(t->norms[i], src, curn, NULL, &len);
		if (!r) {
			free(cur);
			return TD_EFORMAT;
		}
		free(cur);
		cur = r;
		src = r;
		curn = len;
	}
	if (!cur) {
		cur = malloc(n + 1);
		if (!cur)
			return TD_ENOMEM;
		memcpy(cur, s, n);
	} else {
		uint8_t *c = realloc(cur, curn + 1);
		if (!c) {
			free(cur);
			return TD_ENOMEM;
		}
		cur = c;
	}
	cur[curn] = 0;
	*out = cur;
	*out_len = curn;
	return TD_OK;
}

td_err tr_tokenizer_normalize(const struct tr_tokenizer *t, const char *text, size_t len, char **out,
			      size_t *out_len, struct td_errbuf *eb)
{
	uint8_t *r = NULL;
	size_t n = 0;
	td_err e = normalize_with(t, (const uint8_t *)text, len, &r, &n);
	if (e != TD_OK)
		return td_fail(eb, e, "%s: %s", t->origin,
			       e == TD_ENOMEM ? "out of memory" : "normalization failed: not valid UTF-8");
	*out = (char *)r;
	*out_len = n;
	return TD_OK;
}

/* Whether form leaves s unchanged for sure, without running it: code points
 * below U+0300 are all NFC-stable (lead bytes < 0xCC), ASCII is stable under
 * every form. */
static bool norm_is_identity(uninorm_t f, const uint8_t *s, size_t n)
{
	uint8_t limit = f == UNINORM_NFC ? 0xcc : 0x80;
	for (size_t i = 0; i < n; i++)
		if (s[i] >= limit)
			return false;
	return true;
}

static td_err normalize_segment(struct tr_encoder *e, const char *p, size_t n, const char **q, size_t *qn)
{
	const struct tr_tokenizer *t = e->t;
	const uint8_t *src = (const uint8_t *)p;
	size_t len = n;
	int which = 0;
	for (int i = 0; i < t->nnorms; i++) {
		if (norm_is_identity(t->norms[i], src, len))
			continue;
		size_t cap = e->ncap[which];
		uint8_t *r = u8_normalize(t->norms[i], src, len, e->nbuf[which], &cap);
		if (!r)
			return errno == ENOMEM ? TD_ENOMEM
					       : td_fail(e->eb, TD_EFORMAT, "%s: normalization failed: %s", e->t->origin,
							 strerror(errno));
		if (r != e->nbuf[which]) {
			free(e->nbuf[which]);
			e->nbuf[which] = r;
			e->ncap[which] = cap;
		}
		src = r;
		len = cap;
		which ^= 1;
	}
	*q = (const char *)src;
	*qn = len;
	return TD_OK;
}

static bool is_word_char(ucs4_t c)
{
	return uc_is_property_alphabetic(c) || uc_is_general_category(c, UC_CATEGORY_N) || c == '_';
}

/* Cuts the added tokens of trie tr out of p (HF's AddedVocabulary::find_matches)
 * and hands the rest to next. */
static td_err split_added(struct tr_encoder *e, const struct trie *tr, unsigned flags,
			  const char *p, size_t n, td_err (*next)(struct tr_encoder *, const char *, size_t))
{
	const struct tr_tokenizer *t = e->t;
	if (!tr->any)
		return next(e, p, n);
	const uint8_t *u = (const uint8_t *)p;
	size_t emitted = 0, i = 0;
	while (i < n) {
		if (!(tr->first[u[i] >> 3] & (1u << (u[i] & 7)))) {
			i++;
			continue;
		}
		size_t mlen = 0;
		int32_t ai = trie_match(tr, u, n, i, &mlen);
		if (ai < 0) {
			i++;
			continue;
		}
		const struct added *a = &t->added[ai];
		size_t start = i, stop = i + mlen;
		i = stop; /* matches never overlap: the scan resumes after this one */
		if (a->special && !(flags & TR_ENC_SPECIALS))
			continue;
		if (a->single_word) {
			bool lw = false, rw = false;
			ucs4_t c;
			if (start > 0 && u8_prev(&c, u + start, u))
				lw = is_word_char(c);
			if (stop < n && u8_mbtouc(&c, u + stop, n - stop) > 0)
				rw = is_word_char(c);
			if (lw || rw)
				continue;
		}
		if (a->lstrip) {
			while (start > emitted) {
				ucs4_t c;
				const uint8_t *q = u8_prev(&c, u + start, u + emitted);
				if (!q || !uc_is_property_white_space(c))
					break;
				start = (size_t)(q - u);
			}
		}
		if (a->rstrip) {
			while (stop < n) {
				ucs4_t c;
				int m = u8_mbtouc(&c, u + stop, n - stop);
				if (!uc_is_property_white_space(c))
					break;
				stop += (size_t)m;
			}
			i = stop;
		}
		td_err err = TD_OK;
		if (start > emitted)
			err = next(e, p + emitted, start - emitted);
		if (!err) {
			if (e->fn)
				e->fn(e->ctx, p + start, stop - start, a->id);
			else if (tr_ids_push(e->out, a->id))
				err = TD_ENOMEM;
		}
		if (err)
			return err;
		emitted = stop;
	}
	return emitted < n ? next(e, p + emitted, n - emitted) : TD_OK;
}

static td_err after_normalize(struct tr_encoder *e, const char *p, size_t n)
{
	return pretok(e, 0, p, n);
}

/* A stretch of raw text between added tokens: normalize it, then cut out the
 * `normalized` added tokens. */
static td_err raw_segment(struct tr_encoder *e, const char *p, size_t n)
{
	const char *q = p;
	size_t qn = n;
	td_err err = normalize_segment(e, p, n, &q, &qn);
	if (err)
		return err;
	return split_added(e, &e->t->normed, e->flags, q, qn, after_normalize);
}

static td_err run(struct tr_encoder *e, const char *text, size_t len, unsigned flags, struct td_errbuf *eb)
{
	const struct tr_tokenizer *t = e->t;
	e->eb = eb;
	e->flags = flags;
	size_t bad = utf8_invalid_at((const uint8_t *)text, len);
	if (bad < len)
		return td_fail(eb, TD_EFORMAT, "text is not valid UTF-8 (at byte %zu)", bad);
	td_err err = TD_OK;
	if ((flags & TR_ENC_ADD_PREFIX) && t->npre && !e->fn) {
		if (ids_reserve(e->out, t->npre))
			return td_fail(eb, TD_ENOMEM, "encode: out of memory");
		memcpy(e->out->v + e->out->n, t->pre, t->npre * sizeof(int32_t));
		e->out->n += t->npre;
	}
	err = split_added(e, &t->raw, flags, text, len, raw_segment);
	if (!err && (flags & TR_ENC_ADD_SUFFIX) && t->npost && !e->fn) {
		if (ids_reserve(e->out, t->npost))
			err = TD_ENOMEM;
		else {
			memcpy(e->out->v + e->out->n, t->post, t->npost * sizeof(int32_t));
			e->out->n += t->npost;
		}
	}
	if (err == TD_ENOMEM)
		return td_fail(eb, TD_ENOMEM, "encode: out of memory");
	return err;
}

td_err tr_encode(struct tr_encoder *e, const char *text, size_t len, unsigned flags, struct tr_ids *out,
		 struct td_errbuf *eb)
{
	e->fn = NULL;
	e->out = out;
	td_err err = run(e, text, len, flags, eb);
	e->out = NULL;
	return err;
}

td_err tr_pretokenize(struct tr_encoder *e, const char *text, size_t len, unsigned flags,
		      void (*fn)(void *ctx, const char *piece, size_t len, int32_t id), void *ctx,
		      struct td_errbuf *eb)
{
	e->fn = fn;
	e->ctx = ctx;
	e->out = NULL;
	td_err err = run(e, text, len, flags & ~TR_ENC_ADD_SPECIAL, eb);
	e->fn = NULL;
	return err;
}

/* ------------------------------------------------------------------------ */
/* Decode */

/* Appends s to out with each maximal invalid UTF-8 subsequence replaced by
 * U+FFFD (Rust's String::from_utf8_lossy). out has room for 3 * n bytes. */
static size_t utf8_lossy(uint8_t *out, const uint8_t *s, size_t n)
{
	size_t o = 0, i = 0;
	while (i < n) {
		uint8_t b = s[i];
		if (b < 0x80) {
			out[o++] = b;
			i++;
			continue;
		}
		size_t need;
		uint8_t lo = 0x80, hi = 0xbf;
		if (b >= 0xc2 && b <= 0xdf)
			need = 1;
		else if (b == 0xe0)
			need = 2, lo = 0xa0;
		else if ((b >= 0xe1 && b <= 0xec) || b == 0xee || b == 0xef)
			need = 2;
		else if (b == 0xed)
			need = 2, hi = 0x9f;
		else if (b == 0xf0)
			need = 3, lo = 0x90;
		else if (b >= 0xf1 && b <= 0xf3)
			need = 3;
		else if (b == 0xf4)
			need = 3, hi = 0x8f;
		else
			need = 0;
		size_t k = 1;
		bool ok = need > 0;
		for (; ok && k <= need; k++) {
			if (i + k >= n) {
				ok = false;
				break;
			}
			uint8_t c = s[i + k];
			uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xbf;
			if (c < l || c > h) {
				ok = false;
				break;
			}
		}
		if (ok) {
			memcpy(out + o, s + i, need + 1);
			o += need + 1;
			i += need + 1;
		} else {
			out[o++] = 0xef;
			out[o++] = 0xbf;
			out[o++] = 0xbd;
			i += k; /* the lead byte and the valid continuation bytes seen */
		}
	}
	return o;
}

td_err tr_decode(const struct tr_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **out,
		 size_t *out_len, struct td_errbuf *eb)
{
	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		int32_t id = ids[i];
		if (id < 0 || id >= t->vocab_size ||
		    (t->added_of[id] < 0 && (id >= t->nmodel || t->len[id] == UINT32_MAX)))
			return td_fail(eb, TD_ERANGE, "decode: ids[%zu] = %d is not a token of %s", i, id, t->origin);
		total += t->dec_off[id + 1] - t->dec_off[id];
	}
	uint8_t *raw = malloc(total + 1), *res = malloc(3 * total + 1);
	if (!raw || !res) {
		free(raw);
		free(res);
		return td_fail(eb, TD_ENOMEM, "decode: out of memory");
	}
	size_t at = 0;
	for (size_t i = 0; i < n; i++) {
		int32_t id = ids[i];
		if (skip_special && t->special[id])
			continue;
		size_t len = t->dec_off[id + 1] - t->dec_off[id];
		memcpy(raw + at, t->dec + t->dec_off[id], len);
		at += len;
	}
	size_t m = utf8_lossy(res, raw, at);
	free(raw);
	res[m] = 0;
	*out = (char *)res;
	if (out_len)
		*out_len = m;
	return TD_OK;
}
