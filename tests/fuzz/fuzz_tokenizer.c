/* libFuzzer target: tokenizer.json (train/tokenizer.h), parsed from memory as
 * tr_tokenizer_load parses the file; then what it loaded put to work: text
 * encoded (with and without special tokens and the post-processor's),
 * pre-tokenized and normalized, the ids decoded, ids from the input decoded,
 * and tokens looked up by id and by spelling.
 *
 * Input: the tokenizer.json, then optionally a NUL byte and the text to
 * encode (JSON text holds no NUL); without one a fixed text is encoded.
 *
 * What must hold besides no crash, leak or UB: a failed load says what is
 * wrong; every id encode gives is below the vocabulary size and decodes
 * (decode fails only for an id no token has, which encode never gives). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char sample[] = "Hello, world! It's 2024 <|im_start|>user\n  caf\xc3\xa9 \xe2\x80\x94 \xe4\xbd\xa0\xe5\xa5\xbd"
			     "<|endoftext|> \t\r\n x";

static void count_piece(void *ctx, const char *piece, size_t len, int32_t id)
{
	(void)piece;
	(void)id;
	*(size_t *)ctx += len;
}

static void check_ids(const struct tr_tokenizer *t, const struct tr_ids *ids)
{
	struct td_errbuf eb = {{0}};
	int vs = tr_tokenizer_vocab_size(t);
	for (size_t i = 0; i < ids->n; i++) {
		if (ids->v[i] < 0 || ids->v[i] >= vs) {
			fprintf(stderr, "encode gave id %d, outside 0 .. %d\n", ids->v[i], vs - 1);
			__builtin_trap();
		}
	}
	for (int skip = 0; skip < 2; skip++) {
		char *s = NULL;
		size_t n;
		if (tr_decode(t, ids->v, ids->n, skip, &s, &n, &eb) != TD_OK) {
			fprintf(stderr, "encode's ids do not decode: %s\n", eb.msg);
			__builtin_trap();
		}
		if (strlen(s) > n)
			__builtin_trap();
		free(s);
	}
}

static void use(const struct tr_tokenizer *t, const char *text, size_t len)
{
	struct td_errbuf eb = {{0}};
	struct tr_encoder *e = NULL;
	if (tr_encoder_new(&e, t, &eb) != TD_OK)
		return;
	static const unsigned flags[] = { 0, TR_ENC_SPECIALS, TR_ENC_SPECIALS | TR_ENC_ADD_SPECIAL };
	for (size_t f = 0; f < sizeof(flags) / sizeof(flags[0]); f++) {
		struct tr_ids ids = { 0 };
		/* Twice: the second run is served from the encoder's word cache. */
		for (int k = 0; k < 2; k++) {
			ids.n = 0;
			if (tr_encode(e, text, len, flags[f], &ids, &eb) == TD_OK)
				check_ids(t, &ids);
			else if (!eb.msg[0])
				__builtin_trap();
		}
		tr_ids_fini(&ids);
	}
	size_t pieces = 0;
	tr_pretokenize(e, text, len, TR_ENC_SPECIALS, count_piece, &pieces, &eb);
	tr_encoder_free(e);

	char *norm = NULL;
	size_t nlen;
	if (tr_tokenizer_normalize(t, text, len, &norm, &nlen, &eb) == TD_OK)
		free(norm);

	/* The text's bytes as ids: most are no token, and must say so. */
	size_t nids = len / 4;
	int32_t *raw = malloc(nids * sizeof(int32_t) + 1);
	if (raw) {
		memcpy(raw, text, nids * sizeof(int32_t));
		char *s = NULL;
		if (tr_decode(t, raw, nids, true, &s, NULL, &eb) == TD_OK)
			free(s);
		free(raw);
	}
	int vs = tr_tokenizer_vocab_size(t);
	for (int id = -1; id <= vs && id < 64; id++) {
		size_t n;
		const char *s = tr_tokenizer_token(t, id, &n);
		if (s && strlen(s) == n && tr_tokenizer_token_id(t, s) < 0)
			__builtin_trap(); /* a token's spelling finds a token */
		tr_tokenizer_is_special(t, id >= 0 && id < vs ? id : 0);
	}
	const int32_t *pre, *post;
	size_t npre, npost;
	tr_tokenizer_affixes(t, &pre, &npre, &post, &npost);
	uint64_t d[2];
	tr_tokenizer_digest(t, d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const uint8_t *nul = memchr(data, 0, size);
	size_t jlen = nul ? (size_t)(nul - data) : size;
	/* tr_tokenizer_load hands the parser a NUL-terminated copy. */
	char *json = malloc(jlen + 1);
	if (!json)
		return 0;
	memcpy(json, data, jlen);
	json[jlen] = '\0';
	struct tr_tokenizer *t = NULL;
	struct td_errbuf eb = {{0}};
	if (tr_tokenizer_parse(&t, json, jlen, "tokenizer.json", &eb) == TD_OK) {
		if (nul)
			use(t, (const char *)nul + 1, size - jlen - 1);
		else
			use(t, sample, sizeof(sample) - 1);
		tr_tokenizer_free(t);
	} else if (!eb.msg[0]) {
		__builtin_trap();
	}
	free(json);
	return 0;
}
