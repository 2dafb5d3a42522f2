/* The normalizer stage (train/tokenizer/internal.h): tokenizer.json's
 * "normalizer" — none, NFC, NFD, NFKC, NFKD, or a Sequence of those — run
 * through libunistring's u8_normalize. Llama-3's and DeepSeek-V3's files
 * have none; Qwen2's has NFC.
 *
 * Not here: the added tokens matched in the normalized text
 * (added_tokens.c); lowercasing, stripping, Replace and the other HF
 * normalizers, which are refused at load. */
#include "train/tokenizer/internal.h"

#include <errno.h>
#include <stdio.h>

td_err tr__normalizer_load(struct tr__normalizer *nz, const struct tr__load *L, struct json_object *j,
			   const char *path)
{
	if (!j)
		return TD_OK;
	const char *type = tr__jstr(j, "type");
	if (!type)
		return td_fail(L->eb, TD_EFORMAT, "%s: %s.type: missing", L->origin, path);
	if (strcmp(type, "Sequence") == 0) {
		struct json_object *list = tr__jget(j, "normalizers");
		if (!list || !json_object_is_type(list, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: %s.normalizers: expected an array", L->origin, path);
		for (size_t i = 0; i < json_object_array_length(list); i++) {
			char sub[128];
			snprintf(sub, sizeof(sub), "%s.normalizers[%zu]", path, i);
			td_err e = tr__normalizer_load(nz, L, json_object_array_get_idx(list, i), sub);
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
		if (nz->n == TR__MAX_NORMS)
			return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s: more than %d normalizers", L->origin, path,
				       TR__MAX_NORMS);
		nz->forms[nz->n++] = forms[i];
		return TD_OK;
	}
	return td_fail(L->eb, TD_EUNSUPPORTED,
		       "%s: %s: normalizer %s is not supported (NFC, NFD, NFKC, NFKD or a Sequence of those)", L->origin,
		       path, type);
}

td_err tr__normalize_alloc(const struct tr__normalizer *nz, const uint8_t *s, size_t n, uint8_t **out,
			   size_t *out_len)
{
	uint8_t *cur = NULL;
	size_t curn = n;
	const uint8_t *src = s;
	for (int i = 0; i < nz->n; i++) {
		size_t len = 0;
		uint8_t *r = u8_normalize(nz->forms[i], src, curn, NULL, &len);
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

void tr__norm_state_fini(struct tr__norm_state *s)
{
	free(s->buf[0]);
	free(s->buf[1]);
	s->buf[0] = s->buf[1] = NULL;
	s->cap[0] = s->cap[1] = 0;
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

td_err tr__normalize(const struct tr__normalizer *nz, struct tr__norm_state *s, const char *p, size_t n,
		     const char **q, size_t *qn, const char *origin, struct td_errbuf *eb)
{
	const uint8_t *src = (const uint8_t *)p;
	size_t len = n;
	int which = 0;
	for (int i = 0; i < nz->n; i++) {
		if (norm_is_identity(nz->forms[i], src, len))
			continue;
		size_t cap = s->cap[which];
		uint8_t *r = u8_normalize(nz->forms[i], src, len, s->buf[which], &cap);
		if (!r)
			return errno == ENOMEM ? TD_ENOMEM
					       : td_fail(eb, TD_EFORMAT, "%s: normalization failed: %s", origin,
							 strerror(errno));
		if (r != s->buf[which]) {
			free(s->buf[which]);
			s->buf[which] = r;
			s->cap[which] = cap;
		}
		src = r;
		len = cap;
		which ^= 1;
	}
	*q = (const char *)src;
	*qn = len;
	return TD_OK;
}
