/* The pre-tokenizer stage (train/tokenizer/internal.h): tokenizer.json's
 * "pre_tokenizer" — ByteLevel (with GPT-2's regex when use_regex is true),
 * or a Sequence of Split steps (a Regex or String pattern; Isolated,
 * Removed, MergedWithPrevious or MergedWithNext) ending in ByteLevel, the
 * layout of Qwen2's, Llama-3's and DeepSeek-V3's files. Each step's regex
 * cuts a piece, the later steps cut what it gives, and ByteLevel hands the
 * words on, as tokenizers' PreTokenizedString::split does.
 *
 * Regexes run through PCRE2 in UTF + UCP mode with its JIT. tokenizers uses
 * Oniguruma, whose \s is Unicode White_Space; PCRE2's \s also matches U+180E,
 * so \s and \S are rewritten to the explicit White_Space set before
 * compiling.
 *
 * Not here: the byte-level mapping of a word's bytes to the vocabulary's
 * characters, which BPE does (bpe.c) from tr__byte_level_table. A new
 * pre-tokenizer type (Digits, Whitespace, Punctuation) is a step kind here. */
#include "train/tokenizer/internal.h"

#include <stdio.h>

/* GPT-2's pre-tokenizer regex, which ByteLevel uses when use_regex is true. */
static const char gpt2_pattern[] =
	"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

void tr__byte_level_table(uint32_t cp[256])
{
	int n = 0;
	for (int b = 0; b < 256; b++) {
		bool keep = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
		cp[b] = keep ? (uint32_t)b : (uint32_t)(256 + n++);
	}
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

static td_err compile_regex(const struct tr__load *L, struct tr__split *s, const char *pattern, bool literal,
			    const char *path)
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
/* Loading */

static td_err load_byte_level(struct tr__pre_tokenizer *pt, const struct tr__load *L, struct json_object *p,
			      const char *path)
{
	pt->prefix_space = tr__jbool(p, "add_prefix_space", false);
	if (tr__jbool(p, "use_regex", true))
		return compile_regex(L, &pt->bl_regex, gpt2_pattern, false, path);
	return TD_OK;
}

static td_err load_split(struct tr__pre_tokenizer *pt, const struct tr__load *L, struct json_object *p,
			 const char *path)
{
	if (pt->nsplits == TR__MAX_SPLITS)
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s: more than %d Split steps", L->origin, path,
			       TR__MAX_SPLITS);
	struct json_object *pat = tr__jget(p, "pattern");
	const char *re = tr__jstr(pat, "Regex"), *lit = tr__jstr(pat, "String");
	if (!re && !lit)
		return td_fail(L->eb, TD_EFORMAT, "%s: %s.pattern: expected {\"Regex\": ...} or {\"String\": ...}", L->origin,
			       path);
	if (tr__jbool(p, "invert", false))
		return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s.invert: an inverted Split is not supported", L->origin, path);
	const char *b = tr__jstr(p, "behavior");
	static const struct {
		const char *name;
		enum tr__split_behavior b;
	} behaviors[] = {
		{ "Isolated", TR__SPLIT_ISOLATED },
		{ "Removed", TR__SPLIT_REMOVED },
		{ "MergedWithPrevious", TR__SPLIT_MERGED_PREV },
		{ "MergedWithNext", TR__SPLIT_MERGED_NEXT },
	};
	size_t k = 0;
	while (k < 4 && !(b && strcmp(b, behaviors[k].name) == 0))
		k++;
	if (k == 4)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: %s.behavior: %s is not supported (Isolated, Removed, MergedWithPrevious, MergedWithNext)",
			       L->origin, path, b ? b : "(missing)");
	struct tr__split *s = &pt->splits[pt->nsplits];
	s->behavior = behaviors[k].b;
	td_err e = compile_regex(L, s, re ? re : lit, !re, path);
	if (!e)
		pt->nsplits++;
	return e;
}

td_err tr__pre_tokenizer_load(struct tr__pre_tokenizer *pt, const struct tr__load *L, struct json_object *p)
{
	if (!p)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: pre_tokenizer: none; traind reads byte-level BPE, which needs a ByteLevel pre-tokenizer",
			       L->origin);
	const char *type = tr__jstr(p, "type");
	if (type && strcmp(type, "ByteLevel") == 0)
		return load_byte_level(pt, L, p, "pre_tokenizer");
	if (!type || strcmp(type, "Sequence") != 0)
		return td_fail(L->eb, TD_EUNSUPPORTED,
			       "%s: pre_tokenizer %s is not supported (ByteLevel, or a Sequence of Split steps and ByteLevel)",
			       L->origin, type ? type : "(no type)");
	struct json_object *list = tr__jget(p, "pretokenizers");
	size_t n = list && json_object_is_type(list, json_type_array) ? json_object_array_length(list) : 0;
	for (size_t i = 0; i < n; i++) {
		struct json_object *s = json_object_array_get_idx(list, i);
		const char *st = tr__jstr(s, "type");
		char path[96];
		snprintf(path, sizeof(path), "pre_tokenizer.pretokenizers[%zu]", i);
		td_err e;
		if (st && strcmp(st, "Split") == 0) {
			e = load_split(pt, L, s, path);
		} else if (st && strcmp(st, "ByteLevel") == 0) {
			if (i + 1 != n)
				return td_fail(L->eb, TD_EUNSUPPORTED, "%s: %s: ByteLevel must be the last pre-tokenizer",
					       L->origin, path);
			e = load_byte_level(pt, L, s, path);
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

static void split_fini(struct tr__split *s)
{
	pcre2_code_free(s->re);
	s->re = NULL;
}

void tr__pre_tokenizer_fini(struct tr__pre_tokenizer *pt)
{
	for (int i = 0; i < pt->nsplits; i++)
		split_fini(&pt->splits[i]);
	pt->nsplits = 0;
	split_fini(&pt->bl_regex);
}

/* ------------------------------------------------------------------------ */
/* Per-thread state */

td_err tr__pretok_state_init(struct tr__pretok_state *s)
{
	s->md = pcre2_match_data_create(8, NULL);
	s->mctx = pcre2_match_context_create(NULL);
	s->jstack = pcre2_jit_stack_create(32 * 1024, 1024 * 1024, NULL);
	if (!s->md || !s->mctx || !s->jstack)
		return TD_ENOMEM;
	pcre2_jit_stack_assign(s->mctx, NULL, s->jstack);
	return TD_OK;
}

void tr__pretok_state_fini(struct tr__pretok_state *s)
{
	pcre2_match_data_free(s->md);
	pcre2_match_context_free(s->mctx);
	pcre2_jit_stack_free(s->jstack);
	free(s->pbuf);
	for (int i = 0; i <= TR__MAX_SPLITS; i++)
		free(s->spans[i]);
	memset(s, 0, sizeof(*s));
}

/* ------------------------------------------------------------------------ */
/* The walk */

/* One call of tr__pretokenize. */
struct walk {
	const struct tr__pre_tokenizer *pt;
	struct tr__pretok_state *s;
	tr__word_fn *word;
	void *ctx;
	const char *origin;
	struct td_errbuf *eb;
};

static inline td_err emit(const struct walk *w, const char *p, size_t n)
{
	return n ? w->word(w->ctx, p, n) : TD_OK;
}

/* The non-empty matches of sp in p, into spans[stage]. An empty match steps
 * over one character, as tokenizers' find_matches does. */
static td_err regex_spans(const struct walk *w, const struct tr__split *sp, const char *p, size_t n, int stage,
			  size_t *nspans)
{
	struct tr__pretok_state *st = w->s;
	size_t cnt = 0, off = 0;
	for (;;) {
		if (off > n)
			break;
		int rc = sp->jit ? pcre2_jit_match(sp->re, (PCRE2_SPTR)p, n, off, PCRE2_NO_UTF_CHECK, st->md, st->mctx)
				 : pcre2_match(sp->re, (PCRE2_SPTR)p, n, off, PCRE2_NO_UTF_CHECK, st->md, st->mctx);
		if (rc == PCRE2_ERROR_NOMATCH)
			break;
		if (rc < 0) {
			PCRE2_UCHAR msg[256];
			pcre2_get_error_message(rc, msg, sizeof(msg));
			return td_fail(w->eb, TD_EINTERNAL, "%s: pre-tokenizer regex failed: %s", w->origin,
				       (const char *)msg);
		}
		PCRE2_SIZE *ov = pcre2_get_ovector_pointer(st->md);
		size_t s = ov[0], t = ov[1];
		if (t == s) { /* empty match: step over one character */
			if (s >= n)
				break;
			off = s + 1;
			while (off < n && ((uint8_t)p[off] & 0xc0) == 0x80)
				off++;
			continue;
		}
		if (!tr__grow((void **)&st->spans[stage], &st->nspan_cap[stage], cnt + 1, sizeof(struct tr__pretok_span)))
			return TD_ENOMEM;
		st->spans[stage][cnt++] = (struct tr__pretok_span){ s, t };
		off = t;
	}
	*nspans = cnt;
	return TD_OK;
}

static td_err byte_level(const struct walk *w, const char *p, size_t n)
{
	const struct tr__pre_tokenizer *pt = w->pt;
	struct tr__pretok_state *st = w->s;
	if (n == 0)
		return TD_OK;
	if (pt->prefix_space && p[0] != ' ') {
		if (!tr__grow((void **)&st->pbuf, &st->pcap, n + 1, 1))
			return TD_ENOMEM;
		st->pbuf[0] = ' ';
		memmove(st->pbuf + 1, p, n);
		p = st->pbuf;
		n++;
	}
	if (!pt->bl_regex.re)
		return emit(w, p, n);
	size_t ns;
	td_err err = regex_spans(w, &pt->bl_regex, p, n, TR__MAX_SPLITS, &ns);
	if (err)
		return err;
	/* Isolated: the gaps between matches are words too. Spans of this stage
	 * are not touched by the word sink, so iterating them here is safe. */
	size_t prev = 0;
	for (size_t i = 0; i < ns && !err; i++) {
		struct tr__pretok_span sp = st->spans[TR__MAX_SPLITS][i];
		if (sp.s > prev)
			err = emit(w, p + prev, sp.s - prev);
		if (!err)
			err = emit(w, p + sp.s, sp.e - sp.s);
		prev = sp.e;
	}
	if (!err && prev < n)
		err = emit(w, p + prev, n - prev);
	return err;
}

/* Applies Split step `stage` to p, then the later steps to each piece. */
static td_err pretok(const struct walk *w, int stage, const char *p, size_t n)
{
	const struct tr__pre_tokenizer *pt = w->pt;
	if (n == 0)
		return TD_OK;
	if (stage == pt->nsplits)
		return byte_level(w, p, n);
	const struct tr__split *sp = &pt->splits[stage];
	size_t ns;
	td_err err = regex_spans(w, sp, p, n, stage, &ns);
	if (err)
		return err;
	const struct tr__pretok_span *spans = w->s->spans[stage];
	/* spans stays valid while later stages run: they write spans[stage + 1
	 * ...] (ByteLevel's regex uses the last slot). Walk the (gap, match)
	 * sequence, as tokenizers' find_matches lists it, and cut pieces by the
	 * behaviour. `pend` is a piece not yet emitted (MergedWithPrevious may
	 * extend it; MergedWithNext carries a match start into the next gap). */
	size_t prev = 0, pend_s = 0, pend_e = 0;
	bool have_pend = false, prev_match = false;
	for (size_t i = 0; i <= ns && !err; i++) {
		size_t gs = prev, ge = i < ns ? spans[i].s : n;
		/* the gap before match i (or the tail) */
		if (ge > gs) {
			switch (sp->behavior) {
			case TR__SPLIT_MERGED_NEXT:
				if (have_pend) { /* a match waiting for its next piece */
					gs = pend_s;
					have_pend = false;
				}
				/* fallthrough */
			case TR__SPLIT_ISOLATED:
			case TR__SPLIT_REMOVED:
				err = pretok(w, stage + 1, p + gs, ge - gs);
				break;
			case TR__SPLIT_MERGED_PREV:
				if (have_pend)
					err = pretok(w, stage + 1, p + pend_s, pend_e - pend_s);
				pend_s = gs;
				pend_e = ge;
				have_pend = true;
				break;
			}
			prev_match = false;
		}
		if (err || i == ns)
			break;
		size_t ms = spans[i].s, me = spans[i].e;
		switch (sp->behavior) {
		case TR__SPLIT_ISOLATED:
			err = pretok(w, stage + 1, p + ms, me - ms);
			break;
		case TR__SPLIT_REMOVED:
			break;
		case TR__SPLIT_MERGED_PREV:
			if (have_pend && !prev_match) {
				pend_e = me; /* appended to the piece before */
			} else {
				if (have_pend)
					err = pretok(w, stage + 1, p + pend_s, pend_e - pend_s);
				pend_s = ms;
				pend_e = me;
				have_pend = true;
			}
			break;
		case TR__SPLIT_MERGED_NEXT:
			/* A match followed by another match stands alone. */
			if (have_pend)
				err = pretok(w, stage + 1, p + pend_s, pend_e - pend_s);
			pend_s = ms;
			pend_e = me;
			have_pend = true;
			break;
		}
		prev_match = true;
		prev = me;
	}
	if (!err && have_pend)
		err = pretok(w, stage + 1, p + pend_s, pend_e - pend_s);
	return err;
}

td_err tr__pretokenize(const struct tr__pre_tokenizer *pt, struct tr__pretok_state *s, const char *p, size_t n,
		       tr__word_fn *word, void *ctx, const char *origin, struct td_errbuf *eb)
{
	const struct walk w = { .pt = pt, .s = s, .word = word, .ctx = ctx, .origin = origin, .eb = eb };
	return pretok(&w, 0, p, n);
}
