/* The decoder stage (train/tokenizer/internal.h): tokenizer.json's
 * "decoder", ByteLevel (none is taken as ByteLevel: the vocabulary is
 * byte-level either way). Each id decodes to fixed bytes — an added token to
 * its text as written, a model token to its characters mapped back through
 * GPT-2's bytes_to_unicode — built once at load; decoding concatenates them
 * and replaces invalid UTF-8 as tokenizers does.
 *
 * Not here: which ids are valid or special (the caller, tokenizer.c, checks
 * and says). */
#include "train/tokenizer/internal.h"

#include <unistr.h>

td_err tr__decoder_load(struct tr__decoder *d, const struct tr__load *L, struct json_object *j)
{
	(void)d;
	if (!j)
		return TD_OK;
	const char *type = tr__jstr(j, "type");
	if (type && strcmp(type, "ByteLevel") == 0)
		return TD_OK;
	if (type && strcmp(type, "Sequence") == 0) {
		struct json_object *list = tr__jget(j, "decoders");
		if (list && !json_object_is_type(list, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: decoder.decoders: expected an array (got %s)", L->origin,
				       tr__jtype_name(list));
		for (size_t i = 0; list && i < json_object_array_length(list); i++) {
			const char *st = tr__jstr(json_object_array_get_idx(list, i), "type");
			if (!st || strcmp(st, "ByteLevel") != 0)
				return td_fail(L->eb, TD_EUNSUPPORTED, "%s: decoder.decoders[%zu]: decoder %s is not supported (ByteLevel only)",
					       L->origin, i, st ? st : "(no type)");
		}
		return TD_OK;
	}
	return td_fail(L->eb, TD_EUNSUPPORTED, "%s: decoder %s is not supported (ByteLevel only)", L->origin,
		       type ? type : "(no type)");
}

td_err tr__decoder_build(struct tr__decoder *d, const struct tr__load *L, int vocab_size, const struct tr__bpe *m,
			 const struct tr__added *a)
{
	size_t n = (size_t)vocab_size;
	d->off = malloc((n + 1) * sizeof(uint32_t));
	if (!d->off)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	uint32_t cp[256];
	tr__byte_level_table(cp);
	int16_t rev[512];
	for (int i = 0; i < 512; i++)
		rev[i] = -1;
	for (int b = 0; b < 256; b++)
		rev[cp[b]] = (int16_t)b;
	/* Decoded bytes are never longer than the spelling. */
	size_t total = 0, len;
	for (size_t i = 0; i < n; i++) {
		if (a->of[i] >= 0)
			total += a->tok[a->of[i]].orig_len;
		else if (tr__bpe_token(m, (int64_t)i, &len))
			total += len;
	}
	if (total > UINT32_MAX)
		return td_fail(L->eb, TD_EFORMAT, "%s: the vocabulary is too large", L->origin);
	d->bytes = malloc(total ? total : 1);
	if (!d->bytes)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	uint32_t at = 0;
	for (size_t i = 0; i < n; i++) {
		d->off[i] = at;
		if (a->of[i] >= 0) {
			const struct tr__added_token *ad = &a->tok[a->of[i]];
			memcpy(d->bytes + at, ad->orig, ad->orig_len);
			at += (uint32_t)ad->orig_len;
			continue;
		}
		const uint8_t *s = (const uint8_t *)tr__bpe_token(m, (int64_t)i, &len);
		if (!s)
			continue;
		size_t k = 0;
		uint32_t start = at;
		bool all = true;
		while (k < len) {
			ucs4_t c;
			int cl = u8_mbtouc(&c, s + k, len - k);
			if (c >= 512 || rev[c] < 0) {
				all = false;
				break;
			}
			d->bytes[at++] = (uint8_t)rev[c];
			k += (size_t)cl;
		}
		if (!all) { /* tokenizers keeps such a token's text as it is */
			at = start;
			memcpy(d->bytes + at, s, len);
			at += (uint32_t)len;
		}
	}
	d->off[n] = at;
	return TD_OK;
}

void tr__decoder_fini(struct tr__decoder *d)
{
	free(d->off);
	free(d->bytes);
	d->off = NULL;
	d->bytes = NULL;
}

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

td_err tr__decode(const struct tr__decoder *d, const int32_t *ids, size_t n, const uint8_t *skip, char **out,
		  size_t *out_len)
{
	size_t total = 0;
	for (size_t i = 0; i < n; i++)
		total += d->off[ids[i] + 1] - d->off[ids[i]];
	uint8_t *raw = malloc(total + 1), *res = malloc(3 * total + 1);
	if (!raw || !res) {
		free(raw);
		free(res);
		return TD_ENOMEM;
	}
	size_t at = 0;
	for (size_t i = 0; i < n; i++) {
		int32_t id = ids[i];
		if (skip && skip[id])
			continue;
		size_t len = d->off[id + 1] - d->off[id];
		memcpy(raw + at, d->bytes + d->off[id], len);
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
