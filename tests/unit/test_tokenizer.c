/* The tokenizer: pre-tokenizer splits of Qwen2's, Llama-3's and GPT-2's
 * regexes on strings whose splits are derived by hand from the regexes; BPE
 * merge order; ignore_merges; added tokens (specials on and off, lstrip,
 * rstrip, single_word); NFC; the post-processor's BOS; decoding (lossy
 * UTF-8, skipped specials); the word cache; and the tokenizer.json kinds and
 * faults that are refused, each naming what.
 *
 * The fixture tokenizer (tests/fixtures/tokenizer) is checked id for id
 * against Hugging Face tokenizers by `parity` (tests/parity_tokenizer.c);
 * here the test tokenizers are built in memory: a byte-level vocabulary
 * where byte b has id b, then one id per merge (256 + its rank), so every
 * expected id below follows from the merges by hand. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/check.h"
#include "train/tokenizer.h"

static const char *fx;

/* ------------------------------------------------------------------------ */
/* Building test tokenizers */

/* GPT-2's bytes_to_unicode, as UTF-8. */
static void bl_char(int b, char out[4])
{
	int n = 0, cp = b;
	bool keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
	if (!keep) {
		for (int k = 0; k < b; k++)
			if (!((k >= 0x21 && k <= 0x7e) || (k >= 0xa1 && k <= 0xac) || (k >= 0xae && k <= 0xff)))
				n++;
		cp = 256 + n;
	}
	if (cp < 0x80) {
		out[0] = (char)cp;
		out[1] = 0;
	} else {
		out[0] = (char)(0xc0 | cp >> 6);
		out[1] = (char)(0x80 | (cp & 0x3f));
		out[2] = 0;
	}
}

struct sb {
	char *s;
	size_t n, cap;
};

static void sbf(struct sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sbf(struct sb *b, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int need = vsnprintf(NULL, 0, fmt, ap);
	va_end(ap);
	if (b->n + (size_t)need + 1 > b->cap) {
		b->cap = (b->n + (size_t)need + 1) * 2;
		b->s = realloc(b->s, b->cap);
	}
	va_start(ap, fmt);
	vsnprintf(b->s + b->n, b->cap - b->n, fmt, ap);
	va_end(ap);
	b->n += (size_t)need;
}

/* A JSON string literal of s (bytes as they are, " and \ escaped). */
static void sbq(struct sb *b, const char *s)
{
	sbf(b, "\"");
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			sbf(b, "\\%c", *s);
		else
			sbf(b, "%c", *s);
	}
	sbf(b, "\"");
}

struct spec {
	const char *normalizer;     /* JSON, or NULL */
	const char *pre_tokenizer;  /* JSON */
	const char *post_processor; /* JSON, or NULL */
	const char *added;          /* JSON array body, or NULL */
	const char *const *merges;  /* pairs "a", "b", ... NULL-terminated */
	const char *const *extra;   /* more vocabulary (ids after the merges), NULL-terminated */
	bool ignore_merges;
};

static char *build(const struct spec *sp)
{
	struct sb b = { 0 };
	sbf(&b, "{\"version\":\"1.0\",\"added_tokens\":[%s],\"normalizer\":%s,\"pre_tokenizer\":%s,"
		"\"post_processor\":%s,\"decoder\":{\"type\":\"ByteLevel\"},"
		"\"model\":{\"type\":\"BPE\",\"dropout\":null,\"unk_token\":null,\"ignore_merges\":%s,\"vocab\":{",
	    sp->added ? sp->added : "", sp->normalizer ? sp->normalizer : "null", sp->pre_tokenizer,
	    sp->post_processor ? sp->post_processor : "null", sp->ignore_merges ? "true" : "false");
	for (int i = 0; i < 256; i++) {
		char c[4];
		bl_char(i, c);
		sbf(&b, "%s", i ? "," : "");
		sbq(&b, c);
		sbf(&b, ":%d", i);
	}
	int id = 256;
	for (size_t i = 0; sp->merges && sp->merges[i]; i += 2) {
		char tok[64];
		snprintf(tok, sizeof(tok), "%s%s", sp->merges[i], sp->merges[i + 1]);
		sbf(&b, ",");
		sbq(&b, tok);
		sbf(&b, ":%d", id++);
	}
	for (size_t i = 0; sp->extra && sp->extra[i]; i++) {
		sbf(&b, ",");
		sbq(&b, sp->extra[i]);
		sbf(&b, ":%d", id++);
	}
	sbf(&b, "},\"merges\":[");
	for (size_t i = 0; sp->merges && sp->merges[i]; i += 2) {
		sbf(&b, "%s[", i ? "," : "");
		sbq(&b, sp->merges[i]);
		sbf(&b, ",");
		sbq(&b, sp->merges[i + 1]);
		sbf(&b, "]");
	}
	sbf(&b, "]}}");
	return b.s;
}

static struct tr_tokenizer *make(const struct spec *sp)
{
	char *json = build(sp);
	struct tr_tokenizer *t = NULL;
	struct td_errbuf eb = { { 0 } };
	td_err e = tr_tokenizer_parse(&t, json, strlen(json), "test.json", &eb);
	CHECK_MSG(e == TD_OK, "parse: %s", eb.msg);
	free(json);
	return t;
}

/* ------------------------------------------------------------------------ */
/* Pre-tokenizer splits */

#define QWEN2_RE                                                                                       \
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| "              \
	"?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+"
#define LLAMA3_RE                                                                                      \
	"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}{1,3}| "         \
	"?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+"
#define SPLIT_SEQ(re)                                                                                  \
	"{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"" re   \
	"\"},\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":"  \
	"false,\"trim_offsets\":true,\"use_regex\":false}]}"
#define GPT2_PRE "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":true,\"use_regex\":true}"

struct pieces {
	char s[32][48];
	int32_t id[32];
	int n;
};

static void collect(void *ctx, const char *p, size_t n, int32_t id)
{
	struct pieces *ps = ctx;
	if (ps->n < 32) {
		snprintf(ps->s[ps->n], sizeof(ps->s[0]), "%.*s", (int)n, p);
		ps->id[ps->n] = id;
	}
	ps->n++;
}

/* Checks the pieces of text against want ("|"-separated; "\x01" is never in a
 * test string). */
static void check_split(struct tr_encoder *e, const char *name, const char *text, unsigned flags,
			const char *const *want)
{
	struct pieces ps = { .n = 0 };
	struct td_errbuf eb = { { 0 } };
	td_err rc = tr_pretokenize(e, text, strlen(text), flags, collect, &ps, &eb);
	CHECK_MSG(rc == TD_OK, "%s: %s", name, eb.msg);
	int nwant = 0;
	while (want[nwant])
		nwant++;
	bool same = ps.n == nwant;
	for (int i = 0; same && i < nwant; i++)
		same = strcmp(ps.s[i], want[i]) == 0;
	if (!same) {
		fprintf(stderr, "%s: \"%s\" split into %d pieces:", name, text, ps.n);
		for (int i = 0; i < ps.n && i < 32; i++)
			fprintf(stderr, " [%s]", ps.s[i]);
		fprintf(stderr, "\n  want %d:", nwant);
		for (int i = 0; i < nwant; i++)
			fprintf(stderr, " [%s]", want[i]);
		fprintf(stderr, "\n");
	}
	CHECK_MSG(same, "%s: split of \"%s\"", name, text);
}

#define W(...) ((const char *const[]){ __VA_ARGS__, NULL })

static void test_regex_splits(void)
{
	static const char *const none[] = { NULL };
	struct spec qwen2 = { .normalizer = "{\"type\":\"NFC\"}", .pre_tokenizer = SPLIT_SEQ(QWEN2_RE), .merges = none };
	struct spec llama3 = { .pre_tokenizer = SPLIT_SEQ(LLAMA3_RE), .merges = none, .ignore_merges = true };
	struct spec gpt2 = { .pre_tokenizer = GPT2_PRE, .merges = none };
	struct tr_tokenizer *tq = make(&qwen2), *tl = make(&llama3), *tg = make(&gpt2);
	if (!tq || !tl || !tg)
		return;
	struct tr_encoder *eq, *el, *eg;
	struct td_errbuf eb;
	tr_encoder_new(&eq, tq, &eb);
	tr_encoder_new(&el, tl, &eb);
	tr_encoder_new(&eg, tg, &eb);

	/* Qwen2: one digit a piece; contractions case-insensitive; a letter run
	 * takes one leading non-letter; newlines group; trailing spaces. */
	check_split(eq, "qwen2", "Hello world", 0, W("Hello", " world"));
	check_split(eq, "qwen2", "1234567 apples", 0, W("1", "2", "3", "4", "5", "6", "7", " apples"));
	check_split(eq, "qwen2", "I'M here's", 0, W("I", "'M", " here", "'s"));
	check_split(eq, "qwen2", "hello\n\nworld", 0, W("hello", "\n\n", "world"));
	check_split(eq, "qwen2", "  leading", 0, W(" ", " leading"));
	check_split(eq, "qwen2", "x!!  \n", 0, W("x", "!!", "  \n"));
	check_split(eq, "qwen2", "a+b", 0, W("a", "+b"));
	check_split(eq, "qwen2", "end.  ", 0, W("end", ".", "  "));
	check_split(eq, "qwen2", "(a) {b}", 0, W("(a", ")", " {", "b", "}"));
	/* \s is White_Space (Oniguruma), which U+180E is not: it groups with
	 * the punctuation after it instead of splitting from it. */
	check_split(eq, "qwen2", "x\xe1\xa0\x8e!", 0, W("x", "\xe1\xa0\x8e!"));
	/* U+00A0 is White_Space: it stays apart from the word after it. */
	check_split(eq, "qwen2", "a\xc2\xa0\xc2\xa0" "b", 0, W("a", "\xc2\xa0", "\xc2\xa0" "b"));

	/* Llama-3: digits in runs of up to three. */
	check_split(el, "llama3", "1234567 apples", 0, W("123", "456", "7", " apples"));
	check_split(el, "llama3", "I'M here's", 0, W("I", "'M", " here", "'s"));
	check_split(el, "llama3", "  leading", 0, W(" ", " leading"));
	check_split(el, "llama3", "v1.25\r\n", 0, W("v", "1", ".", "25", "\r\n"));

	/* GPT-2 (ByteLevel's own regex): the space goes with what follows;
	 * digit runs are whole; contractions are lower-case only. */
	check_split(eg, "gpt2", "Hello world", 0, W("Hello", " world"));
	check_split(eg, "gpt2", "abc 123 4567", 0, W("abc", " 123", " 4567"));
	check_split(eg, "gpt2", "I'm I'M", 0, W("I", "'m", " I", "'", "M"));
	check_split(eg, "gpt2", "a  b", 0, W("a", " ", " b"));
	check_split(eg, "gpt2", "x!!  \n", 0, W("x", "!!", "  \n"));

	tr_encoder_free(eq);
	tr_encoder_free(el);
	tr_encoder_free(eg);
	tr_tokenizer_free(tq);
	tr_tokenizer_free(tl);
	tr_tokenizer_free(tg);
}

/* Split behaviours on "the-final--countdown", as tokenizers documents them. */
static void test_split_behaviors(void)
{
	static const char *const none[] = { NULL };
	const struct {
		const char *behavior;
		const char *const *want;
	} cases[] = {
		{ "Isolated", W("the", "-", "final", "-", "-", "countdown") },
		{ "Removed", W("the", "final", "countdown") },
		{ "MergedWithPrevious", W("the-", "final-", "-", "countdown") },
		{ "MergedWithNext", W("the", "-final", "-", "-countdown") },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char pre[512];
		snprintf(pre, sizeof(pre),
			 "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"String\":\"-\"},"
			 "\"behavior\":\"%s\",\"invert\":false},{\"type\":\"ByteLevel\",\"use_regex\":false}]}",
			 cases[i].behavior);
		struct spec sp = { .pre_tokenizer = pre, .merges = none };
		struct tr_tokenizer *t = make(&sp);
		if (!t)
			continue;
		struct tr_encoder *e;
		struct td_errbuf eb;
		tr_encoder_new(&e, t, &eb);
		check_split(e, cases[i].behavior, "the-final--countdown", 0, cases[i].want);
		check_split(e, cases[i].behavior, "-x-", 0,
			    strcmp(cases[i].behavior, "Removed") == 0		 ? W("x")
			    : strcmp(cases[i].behavior, "Isolated") == 0	 ? W("-", "x", "-")
			    : strcmp(cases[i].behavior, "MergedWithPrevious") == 0 ? W("-", "x-")
										   : W("-x", "-"));
		tr_encoder_free(e);
		tr_tokenizer_free(t);
	}
}

/* ------------------------------------------------------------------------ */
/* BPE */

static void check_ids(struct tr_encoder *e, const char *name, const char *text, unsigned flags, const int32_t *want,
		      size_t nwant)
{
	struct tr_ids ids = { 0 };
	struct td_errbuf eb = { { 0 } };
	td_err rc = tr_encode(e, text, strlen(text), flags, &ids, &eb);
	CHECK_MSG(rc == TD_OK, "%s: %s", name, eb.msg);
	bool same = ids.n == nwant && (nwant == 0 || memcmp(ids.v, want, nwant * sizeof(int32_t)) == 0);
	if (!same) {
		fprintf(stderr, "%s: \"%s\" ->", name, text);
		for (size_t i = 0; i < ids.n; i++)
			fprintf(stderr, " %d", ids.v[i]);
		fprintf(stderr, "; want");
		for (size_t i = 0; i < nwant; i++)
			fprintf(stderr, " %d", want[i]);
		fprintf(stderr, "\n");
	}
	CHECK_MSG(same, "%s: ids of \"%s\"", name, text);
	tr_ids_fini(&ids);
}

#define IDS(...) ((const int32_t[]){ __VA_ARGS__ }), (sizeof((const int32_t[]){ __VA_ARGS__ }) / sizeof(int32_t))

static void test_bpe(void)
{
	/* ids: 256 he, 257 ll, 258 hell, 259 hello, 260 Ġw, 261 or, 262 Ġwor, 263 ld,
	 * 264 Ġworld, 265 aa, 266 bc, 267 ab */
	static const char *const merges[] = { "h", "e", "l", "l", "he", "ll", "hell", "o", "Ġ", "w", "o", "r",
					      "Ġw", "or", "l", "d", "Ġwor", "ld", "a", "a", "b", "c", "a", "b", NULL };
	struct spec sp = { .pre_tokenizer = GPT2_PRE, .merges = merges };
	struct tr_tokenizer *t = make(&sp);
	if (!t)
		return;
	struct tr_encoder *e;
	struct td_errbuf eb;
	tr_encoder_new(&e, t, &eb);
	check_ids(e, "bpe", "hello world", 0, IDS(259, 264));
	check_ids(e, "bpe", "hello", 0, IDS(259));
	check_ids(e, "bpe", "help", 0, IDS(256, 'l', 'p'));     /* he, then no (he,l) merge */
	check_ids(e, "bpe", "aaa", 0, IDS(265, 'a'));          /* equal ranks: leftmost first */
	check_ids(e, "bpe", "aaaa", 0, IDS(265, 265));
	check_ids(e, "bpe", "abc", 0, IDS('a', 266));          /* (b,c) ranks before (a,b) */
	check_ids(e, "bpe", "abd", 0, IDS(267, 'd'));
	check_ids(e, "bpe", " world", 0, IDS(264));
	check_ids(e, "bpe", "\n", 0, IDS('\n'));               /* byte 10 is id 10 */
	check_ids(e, "bpe", "\xc3\xa9", 0, IDS(0xc3, 0xa9));   /* bytes of é */
	check_ids(e, "bpe", "", 0, NULL, 0);
	/* again: from the word cache, the same */
	check_ids(e, "bpe", "hello world", 0, IDS(259, 264));
	tr_encoder_free(e);
	tr_tokenizer_free(t);

	/* ignore_merges: a word that is itself in the vocabulary is one token
	 * whatever the merges say (Llama-3); others go through BPE. */
	static const char *const extra[] = { "abc", NULL };
	static const char *const m2[] = { "a", "b", NULL };
	struct spec sl = { .pre_tokenizer = SPLIT_SEQ(LLAMA3_RE), .merges = m2, .extra = extra, .ignore_merges = true };
	struct spec sn = sl;
	sn.ignore_merges = false;
	struct tr_tokenizer *tl = make(&sl), *tn = make(&sn);
	if (!tl || !tn)
		return;
	struct tr_encoder *el, *en;
	tr_encoder_new(&el, tl, &eb);
	tr_encoder_new(&en, tn, &eb);
	check_ids(el, "ignore_merges", "abc", 0, IDS(257));
	check_ids(en, "merges", "abc", 0, IDS(256, 'c'));
	check_ids(el, "ignore_merges", "abcd", 0, IDS(256, 'c', 'd'));
	tr_encoder_free(el);
	tr_encoder_free(en);
	tr_tokenizer_free(tl);
	tr_tokenizer_free(tn);
}

/* ------------------------------------------------------------------------ */
/* Added tokens, post-processor */

static void test_added_tokens(void)
{
	static const char *const none[] = { NULL };
	/* 256 <|bos|> (special), 257 <m> (lstrip, rstrip), 258 foo (single_word),
	 * 259 <|e|> (special, normalized) */
	struct spec sp = {
		.pre_tokenizer = GPT2_PRE,
		.merges = none,
		.added = "{\"id\":256,\"content\":\"<|bos|>\",\"special\":true,\"normalized\":false},"
			 "{\"id\":257,\"content\":\"<m>\",\"lstrip\":true,\"rstrip\":true,\"special\":false,\"normalized\":false},"
			 "{\"id\":258,\"content\":\"foo\",\"single_word\":true,\"special\":false,\"normalized\":false}",
		.post_processor = "{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<|bos|>\","
				  "\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],"
				  "\"special_tokens\":{\"<|bos|>\":{\"id\":\"<|bos|>\",\"ids\":[256],\"tokens\":[\"<|bos|>\"]}}}",
	};
	struct tr_tokenizer *t = make(&sp);
	if (!t)
		return;
	CHECK_EQ_INT(tr_tokenizer_vocab_size(t), 259);
	CHECK_EQ_INT(tr_tokenizer_token_id(t, "<|bos|>"), 256);
	CHECK(tr_tokenizer_is_special(t, 256));
	CHECK(!tr_tokenizer_is_special(t, 257));
	struct tr_encoder *e;
	struct td_errbuf eb;
	tr_encoder_new(&e, t, &eb);
	check_ids(e, "special", "<|bos|>hi", TR_ENC_SPECIALS, IDS(256, 'h', 'i'));
	/* specials off: spelled out as text (GPT-2 splits "<|" "bos" "|>") */
	check_ids(e, "special off", "<|bos|>hi", 0, IDS('<', '|', 'b', 'o', 's', '|', '>', 'h', 'i'));
	/* lstrip and rstrip absorb the spaces around */
	check_ids(e, "strip", "a <m> b", TR_ENC_SPECIALS, IDS('a', 257, 'b'));
	/* non-special added tokens are matched with specials off too */
	check_ids(e, "strip off", "a <m> b", 0, IDS('a', 257, 'b'));
	/* single_word: only as a word of its own */
	check_ids(e, "single", "foo bar", 0, IDS(258, 0x20 /* Ġ is byte 0x20 */, 'b', 'a', 'r'));
	check_ids(e, "single inside", "foobar", 0, IDS('f', 'o', 'o', 'b', 'a', 'r'));
	check_ids(e, "single after", "xfoo", 0, IDS('x', 'f', 'o', 'o'));
	/* the post-processor's BOS */
	check_ids(e, "bos", "hi", TR_ENC_SPECIALS | TR_ENC_ADD_SPECIAL, IDS(256, 'h', 'i'));
	check_ids(e, "bos only prefix", "", TR_ENC_ADD_PREFIX, IDS(256));
	tr_encoder_free(e);
	tr_tokenizer_free(t);
}

/* fuzz_tokenizer's crash, minimized: an added token whose content holds
 * U+0000 was copied with strndup, which stops there, and then read to its
 * JSON length (a heap overflow in the trie, and in decode). It is matched
 * and decoded whole. */
static void test_added_nul(void)
{
	static const char json[] = "{\"added_tokens\":[{\"id\":1,\"content\":\"\\u0000>\"}],"
				   "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":{}}}";
	struct tr_tokenizer *t = NULL;
	struct td_errbuf eb = { { 0 } };
	CHECK_MSG(tr_tokenizer_parse(&t, json, sizeof(json) - 1, "nul.json", &eb) == TD_OK, "%s", eb.msg);
	if (!t)
		return;
	size_t len = 0;
	const char *spell = tr_tokenizer_token(t, 1, &len);
	CHECK(spell && len == 2 && memcmp(spell, "\0>", 2) == 0);
	struct tr_encoder *e = NULL;
	CHECK(tr_encoder_new(&e, t, &eb) == TD_OK);
	struct tr_ids ids = { 0 };
	CHECK_MSG(tr_encode(e, "\0>", 2, TR_ENC_SPECIALS, &ids, &eb) == TD_OK, "%s", eb.msg);
	CHECK(ids.n == 1 && ids.v[0] == 1);
	char *text = NULL;
	size_t n = 0;
	CHECK_MSG(tr_decode(t, (const int32_t[]){ 1 }, 1, false, &text, &n, &eb) == TD_OK, "%s", eb.msg);
	CHECK(text && n == 2 && memcmp(text, "\0>", 2) == 0);
	free(text);
	tr_ids_fini(&ids);
	tr_encoder_free(e);
	tr_tokenizer_free(t);
}

/* ------------------------------------------------------------------------ */
/* The fixture tokenizer: NFC, specials, decode, the cache */

static struct tr_tokenizer *fixture(void)
{
	char path[512];
	snprintf(path, sizeof(path), "%s/tokenizer/tokenizer.json", fx);
	struct tr_tokenizer *t = NULL;
	struct td_errbuf eb = { { 0 } };
	CHECK_MSG(tr_tokenizer_load(&t, path, &eb) == TD_OK, "%s", eb.msg);
	return t;
}

static void encode(struct tr_encoder *e, const char *s, unsigned flags, struct tr_ids *out)
{
	struct td_errbuf eb = { { 0 } };
	out->n = 0;
	CHECK_MSG(tr_encode(e, s, strlen(s), flags, out, &eb) == TD_OK, "%s", eb.msg);
}

static bool same_ids(const struct tr_ids *a, const struct tr_ids *b)
{
	return a->n == b->n && (a->n == 0 || memcmp(a->v, b->v, a->n * sizeof(int32_t)) == 0);
}

static void test_fixture(void)
{
	struct tr_tokenizer *t = fixture();
	if (!t)
		return;
	struct tr_encoder *e;
	struct td_errbuf eb = { { 0 } };
	tr_encoder_new(&e, t, &eb);
	struct tr_ids a = { 0 }, b = { 0 };

	/* NFC: e + combining acute is é */
	encode(e, "caf\xc3\xa9", TR_ENC_SPECIALS, &a);
	encode(e, "cafe\xcc\x81", TR_ENC_SPECIALS, &b);
	CHECK(a.n > 0 && same_ids(&a, &b));

	/* specials: <|im_start|> and <|im_end|> are 1 and 2; between them the
	 * text encodes as it does alone */
	encode(e, "<|im_start|>user\nhi<|im_end|>", TR_ENC_SPECIALS, &a);
	encode(e, "user\nhi", TR_ENC_SPECIALS, &b);
	CHECK(a.n == b.n + 2 && a.v[0] == 1 && a.v[a.n - 1] == 2 && memcmp(a.v + 1, b.v, b.n * sizeof(int32_t)) == 0);
	encode(e, "<|im_start|>user", 0, &a);
	bool none = true;
	for (size_t i = 0; i < a.n; i++)
		none &= a.v[i] > 2;
	CHECK_MSG(none, "specials off: no special id in the ids");

	/* decode: round trip, skip_special, and lossy bytes */
	char *s = NULL;
	size_t n = 0;
	encode(e, "<|endoftext|>Hello \xe6\x97\xa5\xe6\x9c\xac!", TR_ENC_SPECIALS, &a);
	CHECK_EQ_INT(tr_decode(t, a.v, a.n, false, &s, &n, &eb), TD_OK);
	CHECK_STR_EQ(s, "<|endoftext|>Hello \xe6\x97\xa5\xe6\x9c\xac!");
	free(s);
	CHECK_EQ_INT(tr_decode(t, a.v, a.n, true, &s, &n, &eb), TD_OK);
	CHECK_STR_EQ(s, "Hello \xe6\x97\xa5\xe6\x9c\xac!");
	free(s);
	/* the byte-level tokens of E6 97 A5 (日) one at a time: the byte 0xE6
	 * alone is one U+FFFD; E6 97 (a truncated sequence) is one too; a lone
	 * continuation byte 0x97 is one */
	int32_t e6 = -1, b97 = -1, a5 = -1;
	{
		struct tr_ids bytes = { 0 };
		encode(e, "\xe6\x97\xa5", 0, &bytes); /* the fixture has no merge for it */
		if (bytes.n == 3) {
			e6 = bytes.v[0];
			b97 = bytes.v[1];
			a5 = bytes.v[2];
		}
		tr_ids_fini(&bytes);
	}
	CHECK(e6 >= 0);
	if (e6 >= 0) {
		static const struct {
			int n;
			int which[4];
			const char *want;
		} lossy[] = {
			{ 1, { 0 }, "\xef\xbf\xbd" },
			{ 2, { 0, 1 }, "\xef\xbf\xbd" },
			{ 1, { 1 }, "\xef\xbf\xbd" },
			{ 3, { 1, 0, 1 }, "\xef\xbf\xbd\xef\xbf\xbd" },
			{ 3, { 0, 1, 2 }, "\xe6\x97\xa5" },
			{ 4, { 0, 1, 2, 2 }, "\xe6\x97\xa5\xef\xbf\xbd" },
		};
		int32_t map[3] = { e6, b97, a5 };
		for (size_t i = 0; i < sizeof(lossy) / sizeof(lossy[0]); i++) {
			int32_t ids[4];
			for (int k = 0; k < lossy[i].n; k++)
				ids[k] = map[lossy[i].which[k]];
			CHECK_EQ_INT(tr_decode(t, ids, (size_t)lossy[i].n, false, &s, &n, &eb), TD_OK);
			CHECK_MSG(strcmp(s, lossy[i].want) == 0, "lossy case %zu", i);
			free(s);
		}
	}
	int32_t bad[] = { 5, 100000 };
	CHECK_EQ_INT(tr_decode(t, bad, 2, false, &s, &n, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "ids[1] = 100000");

	/* invalid UTF-8 is refused with its offset */
	a.n = 0;
	CHECK_EQ_INT(tr_encode(e, "ab\xff", 3, 0, &a, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "byte 2");

	/* The word cache never changes an answer: 40000 distinct words (more than
	 * it holds, so it is cleared on the way) encoded as one text equal the
	 * words encoded one by one by a fresh encoder each time round. */
	size_t nw = 40000;
	char *text = malloc(nw * 10), *p = text;
	uint64_t rng = 12345;
	for (size_t i = 0; i < nw; i++) {
		*p++ = ' ';
		int len = 3 + (int)(rng % 5);
		for (int k = 0; k < len; k++) {
			rng = rng * 6364136223846793005ull + 1442695040888963407ull;
			*p++ = (char)('a' + (rng >> 33) % 26);
		}
	}
	*p = 0;
	encode(e, text, 0, &a);
	struct tr_encoder *fresh;
	tr_encoder_new(&fresh, t, &eb);
	struct tr_ids one = { 0 };
	b.n = 0;
	for (const char *w = text; *w;) {
		const char *end = strchr(w + 1, ' ');
		size_t len = end ? (size_t)(end - w) : strlen(w);
		char word[16];
		snprintf(word, sizeof(word), "%.*s", (int)len, w);
		encode(fresh, word, 0, &one);
		for (size_t k = 0; k < one.n; k++)
			tr_ids_push(&b, one.v[k]);
		w += len;
	}
	CHECK_MSG(same_ids(&a, &b), "cached and word-by-word encodings differ (%zu vs %zu ids)", a.n, b.n);
	encode(e, text, 0, &b); /* again, with a warm cache */
	CHECK(same_ids(&a, &b));
	free(text);
	tr_ids_fini(&one);
	tr_encoder_free(fresh);

	tr_ids_fini(&a);
	tr_ids_fini(&b);
	tr_encoder_free(e);
	tr_tokenizer_free(t);
}

/* ------------------------------------------------------------------------ */
/* What is refused */

static void test_refused(void)
{
	static const struct {
		const char *json;
		td_err code;
		const char *msg;
	} cases[] = {
		{ "{\"model\":{\"type\":\"Unigram\",\"vocab\":[]}}", TD_EUNSUPPORTED, "model type Unigram is not supported" },
		{ "{\"model\":{\"type\":\"WordPiece\",\"vocab\":{}}}", TD_EUNSUPPORTED, "model type WordPiece" },
		{ "{\"model\":{\"type\":\"WordLevel\",\"vocab\":{}}}", TD_EUNSUPPORTED, "model type WordLevel" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"Metaspace\"}}",
		  TD_EUNSUPPORTED, "pre_tokenizer Metaspace is not supported" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":null}", TD_EUNSUPPORTED,
		  "needs a ByteLevel pre-tokenizer" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"Sequence\","
		  "\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"String\":\" \"},\"behavior\":\"Isolated\"}]}}",
		  TD_EUNSUPPORTED, "does not end in ByteLevel" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"Sequence\","
		  "\"pretokenizers\":[{\"type\":\"Digits\"},{\"type\":\"ByteLevel\"}]}}",
		  TD_EUNSUPPORTED, "pretokenizers[0]: pre-tokenizer Digits is not supported" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"normalizer\":{\"type\":\"Lowercase\"},"
		  "\"pre_tokenizer\":{\"type\":\"ByteLevel\"}}",
		  TD_EUNSUPPORTED, "normalizer Lowercase is not supported" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
		  "\"decoder\":{\"type\":\"WordPiece\"}}",
		  TD_EUNSUPPORTED, "decoder WordPiece is not supported" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a b\"]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"}}",
		  TD_EFORMAT, "model.merges[0]: \"b\" is not in the vocabulary" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1},\"merges\":[\"a b\"]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"}}",
		  TD_EFORMAT, "the merged token \"ab\" is not in the vocabulary" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"}}}", TD_EFORMAT, "model.vocab[\"a\"]: expected an integer id" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"Sequence\","
		  "\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(a\"},\"behavior\":\"Isolated\"},"
		  "{\"type\":\"ByteLevel\"}]}}",
		  TD_EFORMAT, "pretokenizers[0]: the regex does not compile" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
		  "\"added_tokens\":[{\"id\":5}]}",
		  TD_EFORMAT, "added_tokens[0].content" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
		  "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\"}}],"
		  "\"special_tokens\":{}}}",
		  TD_EFORMAT, "special token <s> is not in special_tokens" },
		/* fuzz_tokenizer's crashes, minimized. A Sequence whose list is not
		 * an array: json-c read the boolean as an array (type confusion). */
		{ "{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"post_processor\":{\"type\":\"Sequence\","
		  "\"processors\":true},\"model\":{\"type\":\"BPE\",\"vocab\":{}}}",
		  TD_EFORMAT, "post_processor.processors: expected an array (got boolean)" },
		{ "{\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"decoder\":{\"type\":\"Sequence\",\"decoders\":{}},"
		  "\"model\":{\"type\":\"BPE\",\"vocab\":{}}}",
		  TD_EFORMAT, "decoder.decoders: expected an array (got object)" },
		/* A post-processor id in a gap of the vocabulary (below its size):
		 * encode put it in every sequence and decode refused it. */
		{ "{\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"ByteLevel\"}]},"
		  "\"post_processor\":{\"type\":\"Sequence\",\"processors\":[{\"type\":\"RobertaProcessing\","
		  "\"cls\":[\"\",0],\"sep\":[\"\",1]}]},\"model\":{\"vocab\":{\"\":8},\"merges\":[]}}",
		  TD_EFORMAT, "post_processor: id 0 has no token" },
		/* fuzz_tokenizer's out-of-memory, minimized: 47 bytes naming id
		 * 1055555558 cost 17 bytes of tables per id up to it (18 GB). */
		{ "{\"model\":{\"vocab\":{\"\":1055555558},\"merges\":[]}}", TD_EFORMAT,
		  "model.vocab: id 1055555558 is far past its 1 tokens (more than 65536 ids unused)" },
		{ "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[]},\"pre_tokenizer\":{\"type\":\"ByteLevel\"},"
		  "\"added_tokens\":[{\"id\":1073741823,\"content\":\"x\"}]}",
		  TD_EFORMAT, "added_tokens: id 1073741823 is far past the 1 model ids and 1 added tokens" },
		{ "{\"model\": {", TD_EFORMAT, "not valid JSON" },
		{ "[1, 2]", TD_EFORMAT, "expected a JSON object" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		struct tr_tokenizer *t = NULL;
		struct td_errbuf eb = { { 0 } };
		td_err e = tr_tokenizer_parse(&t, cases[i].json, strlen(cases[i].json), "bad.json", &eb);
		CHECK_MSG(e == cases[i].code, "case %zu: %s, want %s (%s)", i, td_errname(e), td_errname(cases[i].code), eb.msg);
		CHECK_CONTAINS(eb.msg, "bad.json");
		CHECK_CONTAINS(eb.msg, cases[i].msg);
		CHECK(t == NULL);
		tr_tokenizer_free(t);
	}
	/* A gap of unused ids within MAX_ID_GAP still loads. */
	static const char gap[] = "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":65536},\"merges\":[]},"
				  "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"added_tokens\":[{\"id\":131073,\"content\":\"x\"}]}";
	struct tr_tokenizer *t = NULL;
	struct td_errbuf eb = { { 0 } };
	CHECK_MSG(tr_tokenizer_parse(&t, gap, sizeof(gap) - 1, "gap.json", &eb) == TD_OK, "%s", eb.msg);
	CHECK(t && tr_tokenizer_vocab_size(t) == 131074);
	tr_tokenizer_free(t);
	t = NULL;
	CHECK_EQ_INT(tr_tokenizer_load(&t, "/nonexistent/tokenizer.json", &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "/nonexistent/tokenizer.json");
}

int main(void)
{
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	test_regex_splits();
	test_split_behaviors();
	test_bpe();
	test_added_tokens();
	test_added_nul();
	test_fixture();
	test_refused();
	return check_status();
}
