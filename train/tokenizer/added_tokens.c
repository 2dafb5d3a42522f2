/* The added tokens (train/tokenizer/internal.h): tokenizer.json's
 * "added_tokens", matched before the pre-tokenizer as tokenizers'
 * AddedVocabulary does — leftmost-longest over a byte trie, in the raw text
 * (or, for `normalized` ones, in the normalized text), honouring
 * single_word, lstrip and rstrip; special ones only when the caller asks.
 * Also the per-id view of the whole vocabulary (which ids are added, which
 * special), which the accessors and the decoder read.
 *
 * Not here: the text between added tokens, which goes on to the normalizer
 * and the pre-tokenizer through the caller's gap function (tokenizer.c). */
#include "train/tokenizer/internal.h"

#include <unictype.h>
#include <unistr.h>

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

/* ------------------------------------------------------------------------ */
/* The trie */

static td_err trie_add(struct tr__trie *tr, const char *s, size_t n, int32_t added)
{
	if (!tr->node) {
		if (!(tr->node = malloc(64 * sizeof(*tr->node))))
			return TD_ENOMEM;
		tr->cap = 64;
		tr->node[0] = (struct tr__trie_node){ .child = -1, .sibling = -1, .added = -1 };
		tr->n = 1;
	}
	int32_t cur = 0;
	for (size_t i = 0; i < n; i++) {
		uint8_t b = (uint8_t)s[i];
		int32_t c = tr->node[cur].child;
		while (c >= 0 && tr->node[c].byte != b)
			c = tr->node[c].sibling;
		if (c < 0) {
			if (!tr__grow((void **)&tr->node, &tr->cap, tr->n + 1, sizeof(*tr->node)))
				return TD_ENOMEM;
			c = (int32_t)tr->n++;
			tr->node[c] =
				(struct tr__trie_node){ .child = -1, .sibling = tr->node[cur].child, .added = -1, .byte = b };
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
static int32_t trie_match(const struct tr__trie *tr, const uint8_t *p, size_t n, size_t i, size_t *mlen)
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

/* ------------------------------------------------------------------------ */
/* Loading */

td_err tr__added_load(struct tr__added *a, const struct tr__load *L, struct json_object *list,
		      const struct tr__normalizer *nz)
{
	if (!list)
		return TD_OK;
	if (!json_object_is_type(list, json_type_array))
		return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens: expected an array (got %s)", L->origin,
			       tr__jtype_name(list));
	size_t n = json_object_array_length(list);
	a->tok = calloc(n ? n : 1, sizeof(*a->tok));
	if (!a->tok)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	for (size_t i = 0; i < n; i++) {
		struct json_object *j = json_object_array_get_idx(list, i);
		struct json_object *idv = tr__jget(j, "id"), *cv = tr__jget(j, "content");
		if (!idv || !json_object_is_type(idv, json_type_int) || json_object_get_int64(idv) < 0 ||
		    json_object_get_int64(idv) >= TR__MAX_ID)
			return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens[%zu].id: expected an id in 0 .. %d", L->origin, i,
				       TR__MAX_ID - 1);
		if (!cv || !json_object_is_type(cv, json_type_string) || json_object_get_string_len(cv) == 0)
			return td_fail(L->eb, TD_EFORMAT, "%s: added_tokens[%zu].content: expected a non-empty string",
				       L->origin, i);
		struct tr__added_token *ad = &a->tok[a->n++];
		ad->id = (int32_t)json_object_get_int64(idv);
		ad->special = tr__jbool(j, "special", false);
		ad->normalized = tr__jbool(j, "normalized", !ad->special);
		ad->single_word = tr__jbool(j, "single_word", false);
		ad->lstrip = tr__jbool(j, "lstrip", false);
		ad->rstrip = tr__jbool(j, "rstrip", false);
		const uint8_t *c = (const uint8_t *)json_object_get_string(cv);
		size_t cl = (size_t)json_object_get_string_len(cv);
		if (!(ad->orig = memdup_z(c, cl)))
			return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
		ad->orig_len = cl;
		if (ad->normalized && nz->n) {
			uint8_t *nc;
			size_t nl;
			if (tr__normalize_alloc(nz, c, cl, &nc, &nl))
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
		struct tr__trie *tr = ad->normalized ? &a->normed : &a->raw;
		if (trie_add(tr, ad->content, ad->len, (int32_t)(a->n - 1)))
			return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	}
	return TD_OK;
}

td_err tr__added_index(struct tr__added *a, const struct tr__load *L, int nmodel, int *vocab_size)
{
	int64_t vs = nmodel;
	for (size_t i = 0; i < a->n; i++)
		if (a->tok[i].id + 1 > vs)
			vs = a->tok[i].id + 1;
	/* An added token may sit past the model's ids, but not far past them
	 * (TR__MAX_ID_GAP): the tables are per id. */
	if ((uint64_t)vs > (uint64_t)nmodel + a->n + TR__MAX_ID_GAP)
		return td_fail(L->eb, TD_EFORMAT,
			       "%s: added_tokens: id %lld is far past the %d model ids and %zu added tokens "
			       "(more than %d ids unused)",
			       L->origin, (long long)vs - 1, nmodel, a->n, TR__MAX_ID_GAP);
	size_t n = (size_t)vs;
	a->special = calloc(n ? n : 1, 1);
	a->of = malloc((n ? n : 1) * sizeof(int32_t));
	if (!a->special || !a->of)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	for (size_t i = 0; i < n; i++)
		a->of[i] = -1;
	/* The last entry for an id wins, as tokenizers' added vocabulary does. */
	for (size_t i = 0; i < a->n; i++) {
		a->of[a->tok[i].id] = (int32_t)i;
		a->special[a->tok[i].id] = a->tok[i].special;
	}
	*vocab_size = (int)vs;
	return TD_OK;
}

void tr__added_fini(struct tr__added *a)
{
	for (size_t i = 0; i < a->n; i++) {
		free(a->tok[i].content);
		free(a->tok[i].orig);
	}
	free(a->tok);
	free(a->raw.node);
	free(a->normed.node);
	free(a->special);
	free(a->of);
	memset(a, 0, sizeof(*a));
}

/* ------------------------------------------------------------------------ */
/* Splitting */

static bool is_word_char(ucs4_t c)
{
	return uc_is_property_alphabetic(c) || uc_is_general_category(c, UC_CATEGORY_N) || c == '_';
}

td_err tr__added_split(const struct tr__added *a, bool normalized, unsigned flags, const char *p, size_t n,
		       tr__gap_fn *gap, tr__added_fn *tok, void *ctx)
{
	const struct tr__trie *tr = normalized ? &a->normed : &a->raw;
	if (!tr->any)
		return gap(ctx, p, n);
	const uint8_t *u = (const uint8_t *)p;
	size_t emitted = 0, i = 0;
	for (;;) {
		/* Most bytes start no added token: a tight loop over the bitmap. */
		while (i < n && !(tr->first[u[i] >> 3] & (1u << (u[i] & 7))))
			i++;
		if (i == n)
			break;
		size_t mlen = 0;
		int32_t ai = trie_match(tr, u, n, i, &mlen);
		if (ai < 0) {
			i++;
			continue;
		}
		const struct tr__added_token *t = &a->tok[ai];
		size_t start = i, stop = i + mlen;
		i = stop; /* matches never overlap: the scan resumes after this one */
		if (t->special && !(flags & TR_ENC_SPECIALS))
			continue;
		if (t->single_word) {
			bool lw = false, rw = false;
			ucs4_t c;
			if (start > 0 && u8_prev(&c, u + start, u))
				lw = is_word_char(c);
			if (stop < n && u8_mbtouc(&c, u + stop, n - stop) > 0)
				rw = is_word_char(c);
			if (lw || rw)
				continue;
		}
		if (t->lstrip) {
			while (start > emitted) {
				ucs4_t c;
				const uint8_t *q = u8_prev(&c, u + start, u + emitted);
				if (!q || !uc_is_property_white_space(c))
					break;
				start = (size_t)(q - u);
			}
		}
		if (t->rstrip) {
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
			err = gap(ctx, p + emitted, start - emitted);
		if (!err)
			err = tok(ctx, p + start, stop - start, t->id);
		if (err)
			return err;
		emitted = stop;
	}
	return emitted < n ? gap(ctx, p + emitted, n - emitted) : TD_OK;
}
