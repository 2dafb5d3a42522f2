/* libFuzzer target: JSONL rows to tokens (train/rows.h, the rules in
 * train/data.h), as each tokenizing worker does it: the chat template
 * parsed, the kind of an AUTO dataset detected from its first row, then
 * every line to tokens. The tokenizer is the fixture's (tests/fixtures/
 * tokenizer), loaded once: it is read-only, as the workers share it.
 *
 * Input: one options byte, then the lines.
 *   bits 0-2  the row kind: 1 text, 2 prompt/completion, 3 messages,
 *             4 text/label; anything else AUTO (from the first row)
 *   bit 3     add_special_tokens
 *   bit 4     assistant_only_loss
 *   bit 5     the first line is the chat template (else ChatML)
 *   bit 6     labels by name (neg, pos, neutral) as well as by id
 *   bit 7     a model vocabulary of 300 (the tokenizer's is 512), so that
 *             some tokens are outside it
 *
 * What must hold besides no crash, leak or UB: a bad row says what is wrong;
 * a good one has at least one token, every id below the model's vocabulary,
 * and a class in the label set exactly when the rows are classification. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "train/rows.h"

#ifndef TD_FUZZ_FIXTURES
#define TD_FUZZ_FIXTURES "tests/fixtures"
#endif

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct tr_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
	(void)argc;
	(void)argv;
	const char *dir = getenv("TD_FIXTURES");
	char path[4096];
	snprintf(path, sizeof(path), "%s/tokenizer/tokenizer.json", dir && *dir ? dir : TD_FUZZ_FIXTURES);
	struct td_errbuf eb;
	if (tr_tokenizer_load(&tok, path, &eb) != TD_OK) {
		fprintf(stderr, "fuzz_jsonl: %s\n", eb.msg);
		abort();
	}
	return 0;
}

static char *const label_names[] = { "neg", "pos", "neutral" };

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (size < 1)
		return 0;
	unsigned opt = data[0];
	const char *p = (const char *)data + 1, *end = (const char *)data + size;
	static const enum tr_rows kinds[8] = { TR_ROWS_AUTO, TR_ROWS_TEXT, TR_ROWS_PROMPT_COMPLETION, TR_ROWS_MESSAGES,
					       TR_ROWS_CLASSIFY, TR_ROWS_AUTO, TR_ROWS_AUTO, TR_ROWS_AUTO };
	struct tr_data_opts o = {
		.path = "data.jsonl",
		.jsonl = true,
		.T = 16,
		.vocab = opt & 0x80 ? 300 : tr_tokenizer_vocab_size(tok),
		.eos_id = tr_tokenizer_token_id(tok, "<|endoftext|>"),
		.pad_id = -1,
		.tok = tok,
		.rows = kinds[opt & 7],
		.text_field = "text",
		.prompt_field = "prompt",
		.completion_field = "completion",
		.messages_field = "messages",
		.label_field = "label",
		.assistant_only_loss = opt & 0x10,
		.add_special_tokens = opt & 0x08,
		.label_names = opt & 0x40 ? label_names : NULL,
		.n_label_names = opt & 0x40 ? 3 : 0,
		.num_labels = 3,
	};
	char *tpl = NULL;
	if (opt & 0x20) {
		const char *nl = memchr(p, '\n', (size_t)(end - p));
		size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
		if (!(tpl = malloc(n + 1)))
			return 0;
		memcpy(tpl, p, n);
		tpl[n] = '\0'; /* a job spec's string: up to its first NUL */
		o.chat_template = tpl;
		p = nl ? nl + 1 : end;
	}
	struct td_errbuf eb = {{0}};
	struct tr__rowfmt fmt;
	if (tr__rowfmt_init(&fmt, &o, &eb) != TD_OK) {
		if (!eb.msg[0])
			__builtin_trap();
		free(tpl);
		return 0;
	}
	/* Lines are handed over as the workers do: copied out, without the newline. */
	size_t cap = (size_t)(end - p) + 1;
	char *line = malloc(cap), msg[768];
	struct tr__rowctx ctx;
	struct tr_ids ids = { 0 };
	bool detected = fmt.kind != TR_ROWS_AUTO, ctx_ok = false;
	for (const char *at = p; line && at < end;) {
		const char *nl = memchr(at, '\n', (size_t)(end - at));
		size_t len = nl ? (size_t)(nl - at) : (size_t)(end - at);
		memcpy(line, at, len);
		line[len] = '\0';
		at = nl ? nl + 1 : end;
		msg[0] = '\0';
		if (!detected) {
			bool blank = true;
			for (size_t i = 0; i < len && blank; i++)
				blank = line[i] == ' ' || line[i] == '\t' || line[i] == '\r';
			if (blank)
				continue;
			if (tr__rowfmt_detect(&fmt, line, len, msg, sizeof(msg)) != TD_OK) {
				if (!msg[0])
					__builtin_trap();
				break;
			}
			if (fmt.kind == TR_ROWS_AUTO)
				__builtin_trap();
			detected = true;
		}
		if (!ctx_ok) {
			if (tr__rowctx_init(&ctx, &fmt, &eb) != TD_OK)
				break;
			ctx_ok = true;
		}
		int32_t cls = -2;
		bool blank = false;
		ids.n = 0;
		td_err e = tr__row(&ctx, line, len, &ids, &cls, &blank, msg, sizeof(msg));
		if (e) {
			if (!msg[0])
				__builtin_trap();
			continue; /* the worker stops here; later lines still must not crash */
		}
		if (blank) {
			if (ids.n)
				__builtin_trap();
			continue;
		}
		if (ids.n == 0)
			__builtin_trap(); /* the row index holds no empty rows */
		for (size_t i = 0; i < ids.n; i++) {
			uint32_t id = (uint32_t)ids.v[i] & ~TR__NOLOSS;
			if (id >= (uint32_t)o.vocab) {
				fprintf(stderr, "row gave id %u, outside the vocabulary of %d\n", id, o.vocab);
				__builtin_trap();
			}
		}
		if (fmt.kind == TR_ROWS_CLASSIFY ? cls < 0 || cls >= o.num_labels : cls != -1) {
			fprintf(stderr, "row gave class %d\n", cls);
			__builtin_trap();
		}
	}
	if (ctx_ok)
		tr__rowctx_fini(&ctx);
	tr_ids_fini(&ids);
	free(line);
	tr__rowfmt_fini(&fmt);
	free(tpl);
	return 0;
}
