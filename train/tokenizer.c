/* Byte-level BPE from tokenizer.json (train/tokenizer.h): the public API and
 * the walk of a text through the stages, each of which lives in its own file
 * under train/tokenizer/ (internal.h lists them).
 *
 * The road a text takes through tr_encode, as tokenizers' TokenizerImpl::encode:
 *   1. added tokens that are not `normalized` are cut out of the raw text
 *      (added_tokens.c);
 *   2. each remaining segment is normalized (normalizer.c), then `normalized`
 *      added tokens are cut out of it;
 *   3. the pre-tokenizer splits each segment into words: every Split step's
 *      regex in turn, then ByteLevel (pre_tokenizer.c);
 *   4. each word goes through BPE on its bytes, cached per word (bpe.c);
 *   5. the post-processor's ids go around the whole (post_processor.c).
 * Decoding maps each token back to its bytes (decoder.c), added tokens as
 * written, and replaces invalid UTF-8.
 *
 * Not here: datasets (train/data.c), chat templates (train/jsonl.c). */
#include "train/tokenizer.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <unistr.h>

#include "train/tokenizer/internal.h"

#define MAX_FILE_BYTES (1ull << 30)

struct tr_tokenizer {
	char origin[512];
	uint64_t digest[2];
	struct tr__bpe model;
	struct tr__normalizer normalizer;
	struct tr__pre_tokenizer pre_tokenizer;
	struct tr__added added;
	struct tr__post_processor post_processor;
	struct tr__decoder decoder;
	int vocab_size; /* the model's ids and the added ones */
};

struct tr_encoder {
	const struct tr_tokenizer *t;
	struct tr__norm_state norm;
	struct tr__pretok_state pretok;
	struct tr__bpe_state bpe;
	struct tr__bpe_sink sink; /* the model, bpe, and tr_encode's ids */
	/* the call in progress */
	unsigned flags;
	void (*fn)(void *ctx, const char *piece, size_t len, int32_t id); /* tr_pretokenize's */
	void *ctx;
	struct td_errbuf *eb;
};

/* ------------------------------------------------------------------------ */
/* Ids */

void tr_ids_fini(struct tr_ids *ids)
{
	free(ids->v);
	ids->v = NULL;
	ids->n = ids->cap = 0;
}

td_err tr_ids_push(struct tr_ids *ids, int32_t id)
{
	if (ids->n == ids->cap && tr__ids_reserve(ids, 1))
		return TD_ENOMEM;
	ids->v[ids->n++] = id;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Load, free, accessors */

void tr_tokenizer_free(struct tr_tokenizer *t)
{
	if (!t)
		return;
	tr__bpe_fini(&t->model);
	tr__pre_tokenizer_fini(&t->pre_tokenizer);
	tr__added_fini(&t->added);
	tr__post_processor_fini(&t->post_processor);
	tr__decoder_fini(&t->decoder);
	free(t);
}

/* The stages in the order their messages should come: the model first (the
 * added tokens and the post-processor name its ids), the normalizer before
 * the added tokens (their `normalized` contents go through it). */
static td_err load_stages(struct tr_tokenizer *t, const struct tr__load *L, struct json_object *root)
{
	td_err e;
	if ((e = tr__bpe_load(&t->model, L, tr__jget(root, "model"))))
		return e;
	if ((e = tr__normalizer_load(&t->normalizer, L, tr__jget(root, "normalizer"), "normalizer")))
		return e;
	if ((e = tr__pre_tokenizer_load(&t->pre_tokenizer, L, tr__jget(root, "pre_tokenizer"))))
		return e;
	if ((e = tr__added_load(&t->added, L, tr__jget(root, "added_tokens"), &t->normalizer)))
		return e;
	if ((e = tr__post_processor_load(&t->post_processor, L, tr__jget(root, "post_processor"), "post_processor")))
		return e;
	if ((e = tr__decoder_load(&t->decoder, L, tr__jget(root, "decoder"))))
		return e;
	/* The whole vocabulary, then what is built over it. */
	if ((e = tr__added_index(&t->added, L, t->model.nmodel, &t->vocab_size)))
		return e;
	if ((e = tr__post_processor_check(&t->post_processor, L, t->vocab_size, &t->model, &t->added)))
		return e;
	return tr__decoder_build(&t->decoder, L, t->vocab_size, &t->model, &t->added);
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
	t->digest[0] = tr__hash_bytes(json, len, 0x243f6a8885a308d3ull);
	t->digest[1] = tr__hash_bytes(json, len, 0x13198a2e03707344ull);
	const struct tr__load L = { .eb = eb, .origin = t->origin };
	td_err e;
	if (!json_object_is_type(root, json_type_object))
		e = td_fail(eb, TD_EFORMAT, "%s: expected a JSON object at the top", origin);
	else
		e = load_stages(t, &L, root);
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
	const struct tr__added *a = &t->added;
	size_t n = strlen(token);
	for (size_t i = 0; i < a->n; i++) {
		const struct tr__added_token *at = &a->tok[i];
		if (a->of[at->id] == (int32_t)i && at->orig_len == n && memcmp(at->orig, token, n) == 0)
			return at->id;
	}
	return tr__bpe_token_id(&t->model, token, n);
}

const char *tr_tokenizer_token(const struct tr_tokenizer *t, int id, size_t *len)
{
	if (id < 0 || id >= t->vocab_size)
		return NULL;
	if (t->added.of[id] >= 0) {
		const struct tr__added_token *a = &t->added.tok[t->added.of[id]];
		if (len)
			*len = a->orig_len;
		return a->orig;
	}
	size_t n;
	const char *s = tr__bpe_token(&t->model, id, &n);
	if (s && len)
		*len = n;
	return s;
}

bool tr_tokenizer_is_special(const struct tr_tokenizer *t, int id)
{
	return id >= 0 && id < t->vocab_size && t->added.special[id];
}

void tr_tokenizer_affixes(const struct tr_tokenizer *t, const int32_t **pre, size_t *npre, const int32_t **post,
			  size_t *npost)
{
	*pre = t->post_processor.pre;
	*npre = t->post_processor.npre;
	*post = t->post_processor.post;
	*npost = t->post_processor.npost;
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
	e->sink = (struct tr__bpe_sink){ .m = &t->model, .s = &e->bpe };
	if (tr__pretok_state_init(&e->pretok) || tr__bpe_state_init(&e->bpe)) {
		tr_encoder_free(e);
		return td_fail(eb, TD_ENOMEM, "encoder: out of memory");
	}
	*out = e;
	return TD_OK;
}

void tr_encoder_free(struct tr_encoder *e)
{
	if (!e)
		return;
	tr__norm_state_fini(&e->norm);
	tr__pretok_state_fini(&e->pretok);
	tr__bpe_state_fini(&e->bpe);
	free(e);
}

/* --- the pipeline, from the last stage to the first --- */

/* A word from the pre-tokenizer to tr_pretokenize's caller (tr_encode's go
 * straight to tr__bpe_word). */
static td_err piece_word(void *ctx, const char *p, size_t n)
{
	struct tr_encoder *e = ctx;
	e->fn(e->ctx, p, n, -1);
	return TD_OK;
}

/* An added token: its id, or its text and id to tr_pretokenize's caller. */
static td_err added_token(void *ctx, const char *p, size_t n, int32_t id)
{
	struct tr_encoder *e = ctx;
	if (e->fn) {
		e->fn(e->ctx, p, n, id);
		return TD_OK;
	}
	return tr_ids_push(e->sink.out, id);
}

/* Normalized text between added tokens: to the pre-tokenizer. */
static td_err normalized_segment(void *ctx, const char *p, size_t n)
{
	struct tr_encoder *e = ctx;
	if (e->fn)
		return tr__pretokenize(&e->t->pre_tokenizer, &e->pretok, p, n, piece_word, e, e->t->origin, e->eb);
	return tr__pretokenize(&e->t->pre_tokenizer, &e->pretok, p, n, tr__bpe_word, &e->sink, e->t->origin, e->eb);
}

/* A stretch of raw text between added tokens: normalize it, then cut out the
 * `normalized` added tokens. */
static td_err raw_segment(void *ctx, const char *p, size_t n)
{
	struct tr_encoder *e = ctx;
	const char *q = p;
	size_t qn = n;
	td_err err = tr__normalize(&e->t->normalizer, &e->norm, p, n, &q, &qn, e->t->origin, e->eb);
	if (err)
		return err;
	return tr__added_split(&e->t->added, true, e->flags, q, qn, normalized_segment, added_token, e);
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

static td_err run(struct tr_encoder *e, const char *text, size_t len, unsigned flags, struct td_errbuf *eb)
{
	const struct tr_tokenizer *t = e->t;
	e->eb = eb;
	e->flags = flags;
	size_t bad = utf8_invalid_at((const uint8_t *)text, len);
	if (bad < len)
		return td_fail(eb, TD_EFORMAT, "text is not valid UTF-8 (at byte %zu)", bad);
	td_err err = TD_OK;
	if ((flags & TR_ENC_ADD_PREFIX) && !e->fn && tr__post_processor_prefix(&t->post_processor, e->sink.out))
		return td_fail(eb, TD_ENOMEM, "encode: out of memory");
	err = tr__added_split(&t->added, false, flags, text, len, raw_segment, added_token, e);
	if (!err && (flags & TR_ENC_ADD_SUFFIX) && !e->fn)
		err = tr__post_processor_suffix(&t->post_processor, e->sink.out);
	if (err == TD_ENOMEM)
		return td_fail(eb, TD_ENOMEM, "encode: out of memory");
	return err;
}

td_err tr_encode(struct tr_encoder *e, const char *text, size_t len, unsigned flags, struct tr_ids *out,
		 struct td_errbuf *eb)
{
	e->fn = NULL;
	e->sink.out = out;
	td_err err = run(e, text, len, flags, eb);
	e->sink.out = NULL;
	return err;
}

td_err tr_pretokenize(struct tr_encoder *e, const char *text, size_t len, unsigned flags,
		      void (*fn)(void *ctx, const char *piece, size_t len, int32_t id), void *ctx,
		      struct td_errbuf *eb)
{
	e->fn = fn;
	e->ctx = ctx;
	e->sink.out = NULL;
	td_err err = run(e, text, len, flags & ~TR_ENC_ADD_SPECIAL, eb);
	e->fn = NULL;
	return err;
}

td_err tr_tokenizer_normalize(const struct tr_tokenizer *t, const char *text, size_t len, char **out,
			      size_t *out_len, struct td_errbuf *eb)
{
	uint8_t *r = NULL;
	size_t n = 0;
	td_err e = tr__normalize_alloc(&t->normalizer, (const uint8_t *)text, len, &r, &n);
	if (e != TD_OK)
		return td_fail(eb, e, "%s: %s", t->origin,
			       e == TD_ENOMEM ? "out of memory" : "normalization failed: not valid UTF-8");
	*out = (char *)r;
	*out_len = n;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Decode */

td_err tr_decode(const struct tr_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **out,
		 size_t *out_len, struct td_errbuf *eb)
{
	for (size_t i = 0; i < n; i++) {
		int32_t id = ids[i];
		size_t len;
		if (id < 0 || id >= t->vocab_size || (t->added.of[id] < 0 && !tr__bpe_token(&t->model, id, &len)))
			return td_fail(eb, TD_ERANGE, "decode: ids[%zu] = %d is not a token of %s", i, id, t->origin);
	}
	if (tr__decode(&t->decoder, ids, n, skip_special ? t->added.special : NULL, out, out_len))
		return td_fail(eb, TD_ENOMEM, "decode: out of memory");
	return TD_OK;
}
