/* parity for a tokenizer fixture: a dir with tokenizer.json and cases.json
 * ({"cases": [{"text": ..., "ids": [...]}, ...], "special": {"<|endoftext|>": 0}}),
 * as Hugging Face tokenizers wrote it (encode without added special tokens,
 * special tokens in the text matched, as tokenizers does by default).
 *
 * Groups: encode (every case's ids, exactly), decode (decode(ids) equals the
 * text under the tokenizer's own normalizer: NFC for Qwen's, none for
 * Llama-3's or DeepSeek-V3's, as HF tokenizers gives it back), special (each listed special token's id). Any size of
 * vocabulary and any number of cases work: everything is read from the files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/parity.h"
#include "train/tokenizer.h"

/* A short, printable form of a string for messages. */
static void shorten(char *dst, size_t cap, const char *s)
{
	size_t o = 0;
	for (const unsigned char *p = (const unsigned char *)s; *p && o + 5 < cap; p++) {
		if (*p == '\n')
			o += (size_t)snprintf(dst + o, cap - o, "\\n");
		else if (*p < 0x20)
			o += (size_t)snprintf(dst + o, cap - o, "\\x%02x", *p);
		else
			dst[o++] = (char)*p;
		if (o > 48) {
			o += (size_t)snprintf(dst + o, cap - o, "...");
			break;
		}
	}
	dst[o < cap ? o : cap - 1] = '\0';
}

static void print_ids(const char *label, const int32_t *v, size_t n)
{
	printf("       %s (%zu):", label, n);
	for (size_t i = 0; i < n && i < 40; i++)
		printf(" %d", v[i]);
	printf("%s\n", n > 40 ? " ..." : "");
}

int parity_tokenizer(const struct parity_opts *o)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/tokenizer.json", o->dir);
	struct td_errbuf eb = { { 0 } };
	struct tr_tokenizer *tok = NULL;
	td_err e = tr_tokenizer_load(&tok, path, &eb);
	if (e)
		return parity_die("tokenizer", e, &eb);
	struct tr_encoder *enc = NULL;
	if ((e = tr_encoder_new(&enc, tok, &eb))) {
		tr_tokenizer_free(tok);
		return parity_die("encoder", e, &eb);
	}
	snprintf(path, sizeof(path), "%s/cases.json", o->dir);
	struct json_object *root = json_object_from_file(path), *cases = NULL, *special = NULL;
	if (!root || !json_object_object_get_ex(root, "cases", &cases) || !json_object_is_type(cases, json_type_array)) {
		fprintf(stderr, "parity: %s: expected {\"cases\": [...]}: %s\n", path,
			root ? "no cases array" : json_util_get_last_err());
		json_object_put(root);
		tr_encoder_free(enc);
		tr_tokenizer_free(tok);
		return 2;
	}
	int g_enc = parity_group("encode", 0, true);
	int g_dec = parity_group("decode", 0, true);
	struct tr_ids ids = { 0 };
	size_t n = json_object_array_length(cases);
	for (size_t i = 0; i < n; i++) {
		struct json_object *c = json_object_array_get_idx(cases, i), *tv, *iv;
		if (!json_object_object_get_ex(c, "text", &tv) || !json_object_is_type(tv, json_type_string) ||
		    !json_object_object_get_ex(c, "ids", &iv) || !json_object_is_type(iv, json_type_array)) {
			parity_fail(g_enc, "cases[%zu]: expected {\"text\": string, \"ids\": [...]}", i);
			continue;
		}
		const char *text = json_object_get_string(tv);
		size_t tlen = (size_t)json_object_get_string_len(tv);
		char name[96], shown[64];
		shorten(shown, sizeof(shown), text);
		snprintf(name, sizeof(name), "cases[%zu] \"%s\"", i, shown);

		size_t nwant = json_object_array_length(iv);
		int32_t *want = malloc((nwant ? nwant : 1) * sizeof(int32_t));
		if (!want) {
			fprintf(stderr, "parity: out of memory\n");
			break;
		}
		for (size_t k = 0; k < nwant; k++)
			want[k] = (int32_t)json_object_get_int64(json_object_array_get_idx(iv, k));

		ids.n = 0;
		e = tr_encode(enc, text, tlen, TR_ENC_SPECIALS, &ids, &eb);
		size_t first = 0;
		while (first < ids.n && first < nwant && ids.v[first] == want[first])
			first++;
		if (e) {
			parity_fail(g_enc, "%s: %s", name, eb.msg);
		} else if (ids.n != nwant || first != nwant) {
			parity_fail(g_enc, "%s: %zu ids, want %zu; first difference at %zu", name, ids.n, nwant, first);
			print_ids("got ", ids.v, ids.n);
			print_ids("want", want, nwant);
		} else {
			parity_compare_scalar(g_enc, name, 0, 0);
		}

		/* decode(want) == normalizer(text) */
		char *dec = NULL, *nfc = NULL;
		size_t dlen = 0, nlen = 0;
		e = tr_tokenizer_normalize(tok, text, tlen, &nfc, &nlen, &eb);
		if (e == TD_OK)
			e = tr_decode(tok, want, nwant, false, &dec, &dlen, &eb);
		if (e) {
			parity_fail(g_dec, "%s: %s", name, eb.msg);
		} else if (dlen != nlen || memcmp(dec, nfc, nlen) != 0) {
			char got[64];
			shorten(got, sizeof(got), dec);
			parity_fail(g_dec, "%s: decodes to \"%s\" (%zu bytes, want %zu)", name, got, dlen, nlen);
		} else {
			parity_compare_scalar(g_dec, name, 0, 0);
		}
		free(nfc);
		free(dec);
		free(want);
	}
	if (json_object_object_get_ex(root, "special", &special) && json_object_is_type(special, json_type_object)) {
		int g_sp = parity_group("special", 0, true);
		json_object_object_foreach(special, key, val)
		{
			int got = tr_tokenizer_token_id(tok, key), want = json_object_get_int(val);
			char name[96];
			snprintf(name, sizeof(name), "special %s", key);
			if (got != want || !tr_tokenizer_is_special(tok, got))
				parity_fail(g_sp, "%s: id %d (special: %s), want %d", name, got,
					    tr_tokenizer_is_special(tok, got) ? "yes" : "no", want);
			else
				parity_compare_scalar(g_sp, name, got, want);
		}
	}
	tr_ids_fini(&ids);
	json_object_put(root);
	tr_encoder_free(enc);
	tr_tokenizer_free(tok);
	return parity_report() ? 1 : 0;
}
