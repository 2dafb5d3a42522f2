/* The model stage (train/tokenizer/internal.h): tokenizer.json's "model" of
 * type BPE — the vocabulary, the merges by rank, ignore_merges, unk_token,
 * byte_fallback — and the encoding of one word. A word's initial symbols are
 * the ids of its bytes' byte-level characters (GPT-2's bytes_to_unicode),
 * merged lowest rank first, leftmost first on equal rank, through a priority
 * queue as tokenizers' word.rs does, with its rule for a stale queue entry
 * (it is applied when the pair now there merges into the same id). Results
 * are cached per word in the per-thread state.
 *
 * Not here: how a text is cut into words (pre_tokenizer.c); Unigram,
 * WordPiece and WordLevel, which are refused (a new model is a file beside
 * this one with the same four entry points). */
#include "train/tokenizer/internal.h"

#include <stdio.h>

#define CACHE_SLOTS (1u << 17)
#define CACHE_MAX_ENTRIES (CACHE_SLOTS / 2)
#define CACHE_MAX_WORD 128 /* bytes; longer words are not cached */
#define CACHE_BYTES (1u << 21)
#define CACHE_IDS (1u << 19)

static size_t pow2_at_least(size_t n)
{
	size_t c = 16;
	while (c < n)
		c <<= 1;
	return c;
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

/* ------------------------------------------------------------------------ */
/* Vocabulary and merges */

static td_err vocab_insert(struct tr__bpe *m, int32_t id)
{
	uint64_t h = tr__hash_bytes(m->strs + m->off[id], m->len[id], 1);
	size_t i = h & m->vocab_mask;
	while (m->vocab[i].id >= 0) {
		const struct tr__vslot *s = &m->vocab[i];
		if (s->hash == (uint32_t)h && m->len[s->id] == m->len[id] &&
		    memcmp(m->strs + m->off[s->id], m->strs + m->off[id], m->len[id]) == 0)
			return TD_EMISMATCH; /* the same token twice: JSON objects cannot, but be safe */
		i = (i + 1) & m->vocab_mask;
	}
	m->vocab[i] = (struct tr__vslot){ .hash = (uint32_t)h, .id = id };
	return TD_OK;
}

int32_t tr__bpe_token_id(const struct tr__bpe *m, const char *s, size_t n)
{
	if (!m->vocab)
		return -1;
	uint64_t h = tr__hash_bytes(s, n, 1);
	size_t i = h & m->vocab_mask;
	while (m->vocab[i].id >= 0) {
		const struct tr__vslot *v = &m->vocab[i];
		if (v->hash == (uint32_t)h && m->len[v->id] == n && memcmp(m->strs + m->off[v->id], s, n) == 0)
			return v->id;
		i = (i + 1) & m->vocab_mask;
	}
	return -1;
}

static inline const struct tr__mslot *merge_find(const struct tr__bpe *m, int32_t a, int32_t b)
{
	uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
	size_t i = tr__mix64(key) & m->merges_mask;
	for (;;) {
		const struct tr__mslot *s = &m->merges[i];
		if (s->key == key)
			return s;
		if (s->key == UINT64_MAX)
			return NULL;
		i = (i + 1) & m->merges_mask;
	}
}

/* tokenizers' BPE builder: a later duplicate of a pair replaces the earlier. */
static void merge_put(struct tr__bpe *m, int32_t a, int32_t b, int32_t rank, int32_t id)
{
	uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
	size_t i = tr__mix64(key) & m->merges_mask;
	while (m->merges[i].key != UINT64_MAX && m->merges[i].key != key)
		i = (i + 1) & m->merges_mask;
	m->merges[i] = (struct tr__mslot){ .key = key, .rank = rank, .id = id };
}

static td_err load_vocab(struct tr__bpe *m, const struct tr__load *L, struct json_object *vocab)
{
	if (!vocab || !json_object_is_type(vocab, json_type_object))
		return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab: expected an object of token -> id (got %s)",
			       L->origin, tr__jtype_name(vocab));
	size_t bytes = 0;
	int64_t maxid = -1;
	json_object_object_foreach(vocab, key, val)
	{
		if (!json_object_is_type(val, json_type_int))
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab[\"%s\"]: expected an integer id (got %s)",
				       L->origin, key, tr__jtype_name(val));
		int64_t id = json_object_get_int64(val);
		if (id < 0 || id >= TR__MAX_ID)
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab[\"%s\"]: id %lld is out of range", L->origin,
				       key, (long long)id);
		if (id > maxid)
			maxid = id;
		bytes += strlen(key) + 1;
	}
	size_t n = (size_t)(maxid + 1);
	size_t count = (size_t)json_object_object_length(vocab);
	if (n > count + TR__MAX_ID_GAP)
		return td_fail(L->eb, TD_EFORMAT,
			       "%s: model.vocab: id %lld is far past its %zu tokens (more than %d ids unused)", L->origin,
			       (long long)maxid, count, TR__MAX_ID_GAP);
	m->nmodel = (int)n;
	m->strs = malloc(bytes ? bytes : 1);
	m->off = malloc((n ? n : 1) * sizeof(uint32_t));
	m->len = malloc((n ? n : 1) * sizeof(uint32_t));
	m->vocab_mask = pow2_at_least(2 * count + 2) - 1;
	m->vocab = malloc((m->vocab_mask + 1) * sizeof(*m->vocab));
	if (!m->strs || !m->off || !m->len || !m->vocab || bytes > UINT32_MAX)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory for the vocabulary", L->origin);
	for (size_t i = 0; i < n; i++)
		m->len[i] = UINT32_MAX;
	for (size_t i = 0; i <= m->vocab_mask; i++)
		m->vocab[i].id = -1;
	size_t at = 0;
	json_object_object_foreach(vocab, key2, val2)
	{
		int32_t id = (int32_t)json_object_get_int64(val2);
		size_t kl = strlen(key2);
		if (m->len[id] != UINT32_MAX)
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab: id %d is given to both \"%.*s\" and \"%s\"",
				       L->origin, id, (int)m->len[id], m->strs + m->off[id], key2);
		memcpy(m->strs + at, key2, kl + 1);
		m->off[id] = (uint32_t)at;
		m->len[id] = (uint32_t)kl;
		at += kl + 1;
		if (vocab_insert(m, id))
			return td_fail(L->eb, TD_EFORMAT, "%s: model.vocab: \"%s\" appears twice", L->origin, key2);
	}
	return TD_OK;
}

/* A merge's two parts: "a b" (older files) or ["a", "b"]. */
static td_err merge_parts(const struct tr__load *L, struct json_object *j, size_t i, const char **a, size_t *na,
			  const char **b, size_t *nb)
{
	if (json_object_is_type(j, json_type_string)) {
		const char *s = json_object_get_string(j);
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
	if (json_object_is_type(j, json_type_array) && json_object_array_length(j) == 2) {
		struct json_object *x = json_object_array_get_idx(j, 0), *y = json_object_array_get_idx(j, 1);
		if (json_object_is_type(x, json_type_string) && json_object_is_type(y, json_type_string)) {
			*a = json_object_get_string(x);
			*na = (size_t)json_object_get_string_len(x);
			*b = json_object_get_string(y);
			*nb = (size_t)json_object_get_string_len(y);
			return TD_OK;
		}
	}
	return td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: expected \"a b\" or [\"a\", \"b\"] (got %s)", L->origin,
		       i, json_object_to_json_string(j));
}

static td_err load_merges(struct tr__bpe *m, const struct tr__load *L, struct json_object *merges)
{
	if (merges && !json_object_is_type(merges, json_type_array))
		return td_fail(L->eb, TD_EFORMAT, "%s: model.merges: expected an array (got %s)", L->origin,
			       tr__jtype_name(merges));
	size_t n = merges ? json_object_array_length(merges) : 0;
	if (n >= (size_t)TR__MAX_ID)
		return td_fail(L->eb, TD_EFORMAT, "%s: model.merges: %zu merges is too many", L->origin, n);
	m->merges_mask = pow2_at_least(2 * n + 2) - 1;
	m->merges = malloc((m->merges_mask + 1) * sizeof(*m->merges));
	if (!m->merges)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory for the merges", L->origin);
	for (size_t i = 0; i <= m->merges_mask; i++)
		m->merges[i].key = UINT64_MAX;
	char *cat = NULL;
	size_t catcap = 0;
	td_err e = TD_OK;
	for (size_t i = 0; i < n && !e; i++) {
		const char *a = NULL, *b = NULL;
		size_t na = 0, nb = 0;
		if ((e = merge_parts(L, json_object_array_get_idx(merges, i), i, &a, &na, &b, &nb)))
			break;
		int32_t ia = tr__bpe_token_id(m, a, na), ib = tr__bpe_token_id(m, b, nb);
		if (ia < 0 || ib < 0) {
			e = td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: \"%.*s\" is not in the vocabulary", L->origin,
				    i, ia < 0 ? (int)na : (int)nb, ia < 0 ? a : b);
			break;
		}
		if (!tr__grow((void **)&cat, &catcap, na + nb, 1)) {
			e = td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
			break;
		}
		memcpy(cat, a, na);
		memcpy(cat + na, b, nb);
		int32_t id = tr__bpe_token_id(m, cat, na + nb);
		if (id < 0) {
			e = td_fail(L->eb, TD_EFORMAT, "%s: model.merges[%zu]: the merged token \"%.*s\" is not in the vocabulary",
				    L->origin, i, (int)(na + nb), cat);
			break;
		}
		merge_put(m, ia, ib, (int32_t)i, id);
	}
	free(cat);
	return e;
}

td_err tr__bpe_load(struct tr__bpe *m, const struct tr__load *L, struct json_object *model)
{
	if (!model || !json_object_is_type(model, json_type_object))
		return td_fail(L->eb, TD_EFORMAT, "%s: model: expected an object (got %s)", L->origin,
			       tr__jtype_name(model));
	const char *type = tr__jstr(model, "type");
	if (!type && tr__jget(model, "merges"))
		type = "BPE"; /* files from before "type" was written */
	if (!type)
		return td_fail(L->eb, TD_EFORMAT, "%s: model.type: missing", L->origin);
	if (strcmp(type, "BPE") != 0)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: model type %s is not supported (traind reads byte-level BPE tokenizers only)", L->origin,
			       type);
	struct json_object *v = tr__jget(model, "dropout");
	if (v && json_object_get_double(v) > 0)
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: model.dropout %g: BPE dropout is not supported", L->origin,
			       json_object_get_double(v));
	static const char *const affixes[] = { "continuing_subword_prefix", "end_of_word_suffix" };
	for (size_t i = 0; i < 2; i++) {
		const char *s = tr__jstr(model, affixes[i]);
		if (s && *s)
			return td_fail(L->eb, TD_EUNSUPPORTED, "%s: model.%s \"%s\" is not supported (byte-level BPE has none)",
				       L->origin, affixes[i], s);
	}
	m->ignore_merges = tr__jbool(model, "ignore_merges", false);
	m->byte_fallback = tr__jbool(model, "byte_fallback", false);
	td_err e = load_vocab(m, L, tr__jget(model, "vocab"));
	if (e)
		return e;
	if ((e = load_merges(m, L, tr__jget(model, "merges"))))
		return e;
	m->unk_id = -1;
	const char *unk = tr__jstr(model, "unk_token");
	if (unk && (m->unk_id = tr__bpe_token_id(m, unk, strlen(unk))) < 0)
		return td_fail(L->eb, TD_EFORMAT, "%s: model.unk_token \"%s\" is not in the vocabulary", L->origin, unk);
	uint32_t cp[256];
	tr__byte_level_table(cp);
	for (int b = 0; b < 256; b++) {
		char s[8];
		size_t n = utf8_put(s, cp[b]);
		memcpy(m->bl_utf8[b], s, 2);
		m->bl_len[b] = (uint8_t)n;
		m->byte_id[b] = tr__bpe_token_id(m, s, n);
		n = (size_t)snprintf(s, sizeof(s), "<0x%02X>", b);
		m->fallback_id[b] = tr__bpe_token_id(m, s, n);
	}
	return TD_OK;
}

void tr__bpe_fini(struct tr__bpe *m)
{
	free(m->strs);
	free(m->off);
	free(m->len);
	free(m->vocab);
	free(m->merges);
	memset(m, 0, sizeof(*m));
}

/* ------------------------------------------------------------------------ */
/* Per-thread state: scratch and the word cache */

td_err tr__bpe_state_init(struct tr__bpe_state *s)
{
	s->cache = calloc(CACHE_SLOTS, sizeof(*s->cache));
	s->ckeys = malloc(CACHE_BYTES);
	s->cids = malloc(CACHE_IDS * sizeof(int32_t));
	return s->cache && s->ckeys && s->cids ? TD_OK : TD_ENOMEM;
}

void tr__bpe_state_fini(struct tr__bpe_state *s)
{
	free(s->syms);
	free(s->heap);
	free(s->mapped);
	free(s->cache);
	free(s->ckeys);
	free(s->cids);
	memset(s, 0, sizeof(*s));
}

static bool cache_get(struct tr__bpe_state *s, uint64_t h, const uint8_t *w, size_t n, struct tr_ids *out,
		      td_err *err)
{
	size_t i = h & (CACHE_SLOTS - 1);
	for (;;) {
		const struct tr__bpe_cslot *c = &s->cache[i];
		if (!c->h)
			return false;
		if (c->h == h && c->klen == n && memcmp(s->ckeys + c->koff, w, n) == 0) {
			if (!c->in)
				return true;
			if (tr__ids_reserve(out, c->in)) {
				*err = TD_ENOMEM;
				return true;
			}
			memcpy(out->v + out->n, s->cids + c->ioff, c->in * sizeof(int32_t));
			out->n += c->in;
			return true;
		}
		i = (i + 1) & (CACHE_SLOTS - 1);
	}
}

static void cache_put(struct tr__bpe_state *s, uint64_t h, const uint8_t *w, size_t n, const int32_t *ids,
		      size_t nids)
{
	if (s->cache_n >= CACHE_MAX_ENTRIES || s->ckeys_n + n > CACHE_BYTES || s->cids_n + nids > CACHE_IDS) {
		memset(s->cache, 0, CACHE_SLOTS * sizeof(*s->cache));
		s->cache_n = s->ckeys_n = s->cids_n = 0;
		if (n > CACHE_BYTES || nids > CACHE_IDS)
			return;
	}
	size_t i = h & (CACHE_SLOTS - 1);
	while (s->cache[i].h)
		i = (i + 1) & (CACHE_SLOTS - 1);
	memcpy(s->ckeys + s->ckeys_n, w, n);
	if (nids)
		memcpy(s->cids + s->cids_n, ids, nids * sizeof(int32_t));
	s->cache[i] = (struct tr__bpe_cslot){ .h = h, .koff = (uint32_t)s->ckeys_n, .klen = (uint32_t)n,
					      .ioff = (uint32_t)s->cids_n, .in = (uint32_t)nids };
	s->ckeys_n += n;
	s->cids_n += nids;
	s->cache_n++;
}

/* ------------------------------------------------------------------------ */
/* The merge queue */

static inline bool qless(const struct tr__bpe_qent *a, const struct tr__bpe_qent *b)
{
	return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct tr__bpe_qent *h, size_t *n, struct tr__bpe_qent x)
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

static struct tr__bpe_qent heap_pop(struct tr__bpe_qent *h, size_t *n)
{
	struct tr__bpe_qent top = h[0], x = h[--(*n)];
	size_t i = 0;
	for (;;) {
		size_t l = 2 * i + 1, r = l + 1, m = i;
		const struct tr__bpe_qent *best = &x;
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

static inline td_err push_id(struct tr_ids *out, int32_t id)
{
	if (out->n == out->cap && tr__ids_reserve(out, 1))
		return TD_ENOMEM;
	out->v[out->n++] = id;
	return TD_OK;
}

td_err tr__bpe_word(void *sink, const char *word, size_t n)
{
	const struct tr__bpe_sink *k = sink;
	const struct tr__bpe *m = k->m;
	struct tr__bpe_state *st = k->s;
	struct tr_ids *out = k->out;
	const uint8_t *w = (const uint8_t *)word;
	td_err err = TD_OK;
	uint64_t h = 0;
	if (n <= CACHE_MAX_WORD) {
		h = tr__hash_bytes(w, n, 7) | 1;
		if (cache_get(st, h, w, n, out, &err))
			return err;
	}
	size_t start = out->n;
	if (m->ignore_merges) {
		if (!tr__grow((void **)&st->mapped, &st->mapped_cap, 2 * n, 1))
			return TD_ENOMEM;
		size_t ml = 0;
		for (size_t i = 0; i < n; i++) {
			memcpy(st->mapped + ml, m->bl_utf8[w[i]], 2);
			ml += m->bl_len[w[i]];
		}
		int32_t id = tr__bpe_token_id(m, st->mapped, ml);
		if (id >= 0) {
			if (push_id(out, id))
				return TD_ENOMEM;
			if (h)
				cache_put(st, h, w, n, &id, 1);
			return TD_OK;
		}
	}
	if (!tr__grow((void **)&st->syms, &st->sym_cap, n, sizeof(*st->syms)) ||
	    !tr__grow((void **)&st->heap, &st->heap_cap, 2 * n + 2, sizeof(*st->heap)))
		return TD_ENOMEM;
	struct tr__bpe_sym *s = st->syms;
	int32_t ns = 0;
	for (size_t i = 0; i < n; i++) {
		int32_t id = m->byte_id[w[i]];
		if (id < 0 && m->byte_fallback)
			id = m->fallback_id[w[i]];
		if (id < 0)
			id = m->unk_id;
		if (id < 0)
			continue; /* tokenizers drops a character it has no id for */
		s[ns] = (struct tr__bpe_sym){ .c = id, .prev = ns - 1, .next = ns + 1, .len = 1 };
		ns++;
	}
	if (ns == 0)
		return TD_OK;
	s[ns - 1].next = -1;
	size_t hn = 0;
	for (int32_t i = 0; i + 1 < ns; i++) {
		const struct tr__mslot *ms = merge_find(m, s[i].c, s[i + 1].c);
		if (ms)
			heap_push(st->heap, &hn, (struct tr__bpe_qent){ ms->rank, i, ms->id });
	}
	while (hn) {
		struct tr__bpe_qent top = heap_pop(st->heap, &hn);
		struct tr__bpe_sym *a = &s[top.pos];
		if (a->len == 0 || a->next < 0)
			continue;
		struct tr__bpe_sym *b = &s[a->next];
		const struct tr__mslot *ms = merge_find(m, a->c, b->c);
		if (!ms || ms->id != top.id)
			continue; /* stale */
		a->c = top.id;
		a->len += b->len;
		a->next = b->next;
		b->len = 0;
		if (a->next >= 0)
			s[a->next].prev = top.pos;
		if (!tr__grow((void **)&st->heap, &st->heap_cap, hn + 2, sizeof(*st->heap)))
			return TD_ENOMEM;
		if (a->prev >= 0 && (ms = merge_find(m, s[a->prev].c, a->c)))
			heap_push(st->heap, &hn, (struct tr__bpe_qent){ ms->rank, a->prev, ms->id });
		if (a->next >= 0 && (ms = merge_find(m, a->c, s[a->next].c)))
			heap_push(st->heap, &hn, (struct tr__bpe_qent){ ms->rank, top.pos, ms->id });
	}
	for (int32_t i = 0; i >= 0; i = s[i].next)
		if (push_id(out, s[i].c))
			return TD_ENOMEM;
	if (h)
		cache_put(st, h, w, n, out->v + start, out->n - start);
	return TD_OK;
}
