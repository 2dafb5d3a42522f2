/* JSONL rows to tokens (train/rows.h): the four row kinds of train/data.h,
 * the chat template, the label set.
 *
 * Not here: reading the file, threads and the cache (tokcache.c), sequences
 * and order (data.c). */
#include "train/rows.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static td_err msgf(char *msg, size_t cap, td_err code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static td_err msgf(char *msg, size_t cap, td_err code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, cap, fmt, ap);
	va_end(ap);
	return code;
}

/* ------------------------------------------------------------------------ */
/* The template */

td_err tr__rowfmt_init(struct tr__rowfmt *f, const struct tr_data_opts *o, struct td_errbuf *eb)
{
	memset(f, 0, sizeof(*f));
	f->o = o;
	f->kind = o->rows;
	const char *tpl = o->chat_template ? o->chat_template : TR_CHATML_TEMPLATE;
	size_t n = strlen(tpl);
	f->lits = malloc(n + 1);
	f->head = calloc(n + 1, sizeof(*f->head));
	f->foot = calloc(n + 1, sizeof(*f->foot));
	if (!f->lits || !f->head || !f->foot) {
		tr__rowfmt_fini(f);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", o->path);
	}
	size_t at = 0, ncontent = 0;
	struct tr__tpl_part *parts = f->head;
	size_t *np = &f->nhead;
	for (size_t i = 0; i < n;) {
		if (strncmp(tpl + i, "{role}", 6) == 0) {
			parts[(*np)++] = (struct tr__tpl_part){ .role = true };
			i += 6;
			continue;
		}
		if (strncmp(tpl + i, "{content}", 9) == 0) {
			if (ncontent++) {
				tr__rowfmt_fini(f);
				return td_fail(eb, TD_EINVAL, "data.chat_template: {content} appears more than once");
			}
			parts = f->foot;
			np = &f->nfoot;
			i += 9;
			continue;
		}
		char c = tpl[i];
		if ((c == '{' || c == '}') && tpl[i + 1] == c) {
			i += 2;
		} else if (c == '{' || c == '}') {
			tr__rowfmt_fini(f);
			return td_fail(eb, TD_EINVAL,
				       "data.chat_template: '%c' at byte %zu is not a placeholder (use {role}, {content}, {{ "
				       "and }})",
				       c, i);
		} else {
			i++;
		}
		/* a literal byte: extend the last literal part or start one */
		if (*np && !parts[*np - 1].role && parts[*np - 1].s + parts[*np - 1].n == f->lits + at) {
			parts[*np - 1].n++;
		} else {
			parts[(*np)++] = (struct tr__tpl_part){ .s = f->lits + at, .n = 1 };
		}
		f->lits[at++] = c;
	}
	if (ncontent != 1) {
		tr__rowfmt_fini(f);
		return td_fail(eb, TD_EINVAL, "data.chat_template: needs {content} exactly once");
	}
	if (o->tok) {
		const int32_t *pre, *post;
		size_t npre, npost;
		tr_tokenizer_affixes(o->tok, &pre, &npre, &post, &npost);
		f->suffix_has_eos = o->add_special_tokens && npost && post[npost - 1] == o->eos_id;
	}
	return TD_OK;
}

void tr__rowfmt_fini(struct tr__rowfmt *f)
{
	free(f->lits);
	free(f->head);
	free(f->foot);
	f->lits = NULL;
	f->head = f->foot = NULL;
}

/* ------------------------------------------------------------------------ */
/* Parsing a line */

static bool blank_line(const char *s, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (s[i] != ' ' && s[i] != '\t' && s[i] != '\r')
			return false;
	return true;
}

/* The JSON object of a line, or NULL with msg set. */
static struct json_object *parse_line(json_tokener *jt, const char *line, size_t len, char *msg, size_t cap)
{
	if (len > (size_t)INT32_MAX - 1) {
		msgf(msg, cap, TD_EFORMAT, "line of %zu bytes is too long", len);
		return NULL;
	}
	json_tokener_reset(jt);
	struct json_object *o = json_tokener_parse_ex(jt, line, (int)len);
	enum json_tokener_error err = json_tokener_get_error(jt);
	size_t end = json_tokener_get_parse_end(jt);
	if (err == json_tokener_continue) {
		json_object_put(o);
		msgf(msg, cap, TD_EFORMAT, "not valid JSON: the line ends inside a value");
		return NULL;
	}
	if (err != json_tokener_success || !o) {
		json_object_put(o);
		msgf(msg, cap, TD_EFORMAT, "not valid JSON: %s (at byte %zu)", json_tokener_error_desc(err), end);
		return NULL;
	}
	if (!blank_line(line + end, len - end)) {
		json_object_put(o);
		msgf(msg, cap, TD_EFORMAT, "not valid JSON: text after the object (at byte %zu)", end);
		return NULL;
	}
	if (!json_object_is_type(o, json_type_object)) {
		msgf(msg, cap, TD_EFORMAT, "expected a JSON object, got %s", json_type_to_name(json_object_get_type(o)));
		json_object_put(o);
		return NULL;
	}
	return o;
}

static bool has_field(struct json_object *o, const char *name)
{
	return json_object_object_get_ex(o, name, NULL);
}

/* A string field; NULL with msg set when missing or not a string. */
static const char *str_field(struct json_object *o, const char *name, const char *what, size_t *len, char *msg,
			     size_t cap)
{
	struct json_object *v;
	if (!json_object_object_get_ex(o, name, &v)) {
		msgf(msg, cap, TD_EFORMAT, "no \"%s\" field (%s)", name, what);
		return NULL;
	}
	if (!json_object_is_type(v, json_type_string)) {
		msgf(msg, cap, TD_EFORMAT, "\"%s\" is %s, expected a string", name,
		     v ? json_type_to_name(json_object_get_type(v)) : "null");
		return NULL;
	}
	*len = (size_t)json_object_get_string_len(v);
	return json_object_get_string(v);
}

td_err tr__rowfmt_detect(struct tr__rowfmt *f, const char *line, size_t len, char *msg, size_t cap)
{
	const struct tr_data_opts *o = f->o;
	if (f->kind != TR_ROWS_AUTO)
		return TD_OK;
	json_tokener *jt = json_tokener_new();
	if (!jt)
		return msgf(msg, cap, TD_ENOMEM, "out of memory");
	json_tokener_set_flags(jt, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
	struct json_object *obj = parse_line(jt, line, len, msg, cap);
	json_tokener_free(jt);
	if (!obj)
		return TD_EFORMAT;
	td_err e = TD_OK;
	if (has_field(obj, o->messages_field))
		f->kind = TR_ROWS_MESSAGES;
	else if (has_field(obj, o->prompt_field) && has_field(obj, o->completion_field))
		f->kind = TR_ROWS_PROMPT_COMPLETION;
	else if (has_field(obj, o->text_field))
		f->kind = TR_ROWS_TEXT;
	else
		e = msgf(msg, cap, TD_EFORMAT,
			 "the first row has none of \"%s\", \"%s\" + \"%s\" or \"%s\" (data.text_field, "
			 "data.prompt_field + data.completion_field, data.messages_field)",
			 o->text_field, o->prompt_field, o->completion_field, o->messages_field);
	json_object_put(obj);
	return e;
}

/* ------------------------------------------------------------------------ */
/* Encoding */

td_err tr__rowctx_init(struct tr__rowctx *c, const struct tr__rowfmt *f, struct td_errbuf *eb)
{
	memset(c, 0, sizeof(*c));
	c->f = f;
	c->jt = json_tokener_new();
	if (!c->jt)
		return td_fail(eb, TD_ENOMEM, "out of memory");
	json_tokener_set_flags(c->jt, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
	td_err e = tr_encoder_new(&c->enc, f->o->tok, eb);
	if (e)
		tr__rowctx_fini(c);
	return e;
}

void tr__rowctx_fini(struct tr__rowctx *c)
{
	tr_encoder_free(c->enc);
	if (c->jt)
		json_tokener_free(c->jt);
	tr_ids_fini(&c->part);
	free(c->buf);
	memset(c, 0, sizeof(*c));
}

/* Encodes text and appends it to out, marking every id no-loss if masked,
 * and checking each against the model's vocabulary. */
static td_err put_text(struct tr__rowctx *c, const char *s, size_t n, unsigned flags, bool masked, struct tr_ids *out,
		       char *msg, size_t cap)
{
	const struct tr_data_opts *o = c->f->o;
	struct td_errbuf eb;
	c->part.n = 0;
	td_err e = tr_encode(c->enc, s, n, flags, &c->part, &eb);
	if (e)
		return msgf(msg, cap, e, "%s", eb.msg);
	if (out->cap - out->n < c->part.n) {
		size_t need = out->n + c->part.n;
		size_t ncap = out->cap ? out->cap : 256;
		while (ncap < need)
			ncap *= 2;
		int32_t *v = realloc(out->v, ncap * sizeof(int32_t));
		if (!v)
			return msgf(msg, cap, TD_ENOMEM, "out of memory");
		out->v = v;
		out->cap = ncap;
	}
	for (size_t i = 0; i < c->part.n; i++) {
		int32_t id = c->part.v[i];
		if (id >= o->vocab) {
			const char *spell = tr_tokenizer_token(o->tok, id, NULL);
			return msgf(msg, cap, TD_ERANGE, "token %d (\"%s\") is outside the model's vocabulary of %d", id,
				    spell ? spell : "?", o->vocab);
		}
		out->v[out->n++] = (int32_t)((uint32_t)id | (masked ? TR__NOLOSS : 0));
	}
	return TD_OK;
}

static td_err put_eos(struct tr__rowctx *c, struct tr_ids *out, char *msg, size_t cap)
{
	if (c->f->suffix_has_eos)
		return TD_OK;
	if (tr_ids_push(out, c->f->o->eos_id))
		return msgf(msg, cap, TD_ENOMEM, "out of memory");
	return TD_OK;
}

/* The template's head or foot with {role} filled in, into c->buf (len *n). */
static td_err render(struct tr__rowctx *c, const struct tr__tpl_part *parts, size_t nparts, const char *role,
		     size_t rlen, const char *pre, size_t npre, size_t *n, char *msg, size_t cap)
{
	size_t need = npre;
	for (size_t i = 0; i < nparts; i++)
		need += parts[i].role ? rlen : parts[i].n;
	if (need + 1 > c->bufcap) {
		char *b = realloc(c->buf, need + 1);
		if (!b)
			return msgf(msg, cap, TD_ENOMEM, "out of memory");
		c->buf = b;
		c->bufcap = need + 1;
	}
	size_t at = 0;
	memcpy(c->buf, pre, npre);
	at += npre;
	for (size_t i = 0; i < nparts; i++) {
		const char *s = parts[i].role ? role : parts[i].s;
		size_t k = parts[i].role ? rlen : parts[i].n;
		memcpy(c->buf + at, s, k);
		at += k;
	}
	c->buf[at] = 0;
	*n = at;
	return TD_OK;
}

static td_err row_messages(struct tr__rowctx *c, struct json_object *obj, struct tr_ids *out, char *msg, size_t cap)
{
	const struct tr__rowfmt *f = c->f;
	const struct tr_data_opts *o = f->o;
	struct json_object *list;
	if (!json_object_object_get_ex(obj, o->messages_field, &list))
		return msgf(msg, cap, TD_EFORMAT, "no \"%s\" field (data.messages_field)", o->messages_field);
	if (!json_object_is_type(list, json_type_array))
		return msgf(msg, cap, TD_EFORMAT, "\"%s\" is %s, expected an array of {\"role\", \"content\"}",
			    o->messages_field, list ? json_type_to_name(json_object_get_type(list)) : "null");
	size_t n = json_object_array_length(list);
	if (n == 0)
		return msgf(msg, cap, TD_EFORMAT, "\"%s\" is empty", o->messages_field);
	for (size_t i = 0; i < n; i++) {
		struct json_object *m = json_object_array_get_idx(list, i);
		char what[96];
		if (!json_object_is_type(m, json_type_object))
			return msgf(msg, cap, TD_EFORMAT, "%s[%zu] is %s, expected {\"role\", \"content\"}", o->messages_field,
				    i, m ? json_type_to_name(json_object_get_type(m)) : "null");
		size_t rl, cl;
		snprintf(what, sizeof(what), "in %s[%zu]", o->messages_field, i);
		const char *role = str_field(m, "role", what, &rl, msg, cap);
		if (!role)
			return TD_EFORMAT;
		const char *content = str_field(m, "content", what, &cl, msg, cap);
		if (!content)
			return TD_EFORMAT;
		if (memchr(role, 0, rl))
			return msgf(msg, cap, TD_EFORMAT, "%s[%zu].role contains a NUL character", o->messages_field, i);
		bool trained = !o->assistant_only_loss || strcmp(role, "assistant") == 0;
		size_t len;
		td_err e = render(c, f->head, f->nhead, role, rl, "", 0, &len, msg, cap);
		if (!e && len)
			e = put_text(c, c->buf, len, TR_ENC_SPECIALS, o->assistant_only_loss, out, msg, cap);
		if (!e)
			e = render(c, f->foot, f->nfoot, role, rl, content, cl, &len, msg, cap);
		if (!e && len)
			e = put_text(c, c->buf, len, TR_ENC_SPECIALS, !trained, out, msg, cap);
		if (e)
			return e;
	}
	if (tr_ids_push(out, o->eos_id))
		return msgf(msg, cap, TD_ENOMEM, "out of memory");
	return TD_OK;
}

static td_err label_of(const struct tr_data_opts *o, struct json_object *obj, int32_t *cls, char *msg, size_t cap)
{
	struct json_object *v;
	if (!json_object_object_get_ex(obj, o->label_field, &v))
		return msgf(msg, cap, TD_EFORMAT, "no \"%s\" field (classify.label_field)", o->label_field);
	if (json_object_is_type(v, json_type_int)) {
		int64_t id = json_object_get_int64(v);
		if (id < 0 || id >= o->num_labels)
			return msgf(msg, cap, TD_ERANGE, "label %lld is outside the label set 0 .. %d (classify.num_labels %d)",
				    (long long)id, o->num_labels - 1, o->num_labels);
		*cls = (int32_t)id;
		return TD_OK;
	}
	if (json_object_is_type(v, json_type_string)) {
		const char *name = json_object_get_string(v);
		for (size_t i = 0; i < o->n_label_names; i++)
			if (strcmp(name, o->label_names[i]) == 0) {
				*cls = (int32_t)i;
				return TD_OK;
			}
		if (!o->n_label_names)
			return msgf(msg, cap, TD_ERANGE,
				    "label \"%s\" is a name, but the job has no classify.label_names (or give ids 0 .. %d)",
				    name, o->num_labels - 1);
		char names[256];
		size_t at = 0;
		names[0] = 0;
		for (size_t i = 0; i < o->n_label_names && at + 8 < sizeof(names); i++) {
			int w = snprintf(names + at, sizeof(names) - at, "%s%s", i ? ", " : "", o->label_names[i]);
			at = w < 0 ? at : at + (size_t)w >= sizeof(names) ? sizeof(names) - 1 : at + (size_t)w;
		}
		return msgf(msg, cap, TD_ERANGE, "label \"%s\" is not in the label set (classify.label_names: %s)", name,
			    names);
	}
	return msgf(msg, cap, TD_EFORMAT, "\"%s\" is %s, expected a label name or an integer id", o->label_field,
		    v ? json_type_to_name(json_object_get_type(v)) : "null");
}

td_err tr__row(struct tr__rowctx *c, const char *line, size_t len, struct tr_ids *out, int32_t *cls, bool *blank,
	       char *msg, size_t cap)
{
	const struct tr__rowfmt *f = c->f;
	const struct tr_data_opts *o = f->o;
	*cls = -1;
	*blank = blank_line(line, len);
	if (*blank)
		return TD_OK;
	struct json_object *obj = parse_line(c->jt, line, len, msg, cap);
	if (!obj)
		return TD_EFORMAT;
	unsigned add = o->add_special_tokens ? TR_ENC_ADD_SPECIAL : 0;
	size_t start = out->n, n1, n2;
	const char *s1, *s2;
	td_err e = TD_OK;
	switch (f->kind) {
	case TR_ROWS_TEXT:
		if (!(s1 = str_field(obj, o->text_field, "data.text_field", &n1, msg, cap)))
			e = TD_EFORMAT;
		if (!e)
			e = put_text(c, s1, n1, TR_ENC_SPECIALS | add, false, out, msg, cap);
		if (!e)
			e = put_eos(c, out, msg, cap);
		break;
	case TR_ROWS_PROMPT_COMPLETION:
		if (!(s1 = str_field(obj, o->prompt_field, "data.prompt_field", &n1, msg, cap)) ||
		    !(s2 = str_field(obj, o->completion_field, "data.completion_field", &n2, msg, cap)))
			e = TD_EFORMAT;
		if (!e)
			e = put_text(c, s1, n1, TR_ENC_SPECIALS | (add & TR_ENC_ADD_PREFIX), true, out, msg, cap);
		if (!e)
			e = put_text(c, s2, n2, TR_ENC_SPECIALS | (add & TR_ENC_ADD_SUFFIX), false, out, msg, cap);
		if (!e)
			e = put_eos(c, out, msg, cap);
		break;
	case TR_ROWS_MESSAGES:
		e = row_messages(c, obj, out, msg, cap);
		break;
	case TR_ROWS_CLASSIFY:
		if (!(s1 = str_field(obj, o->text_field, "data.text_field", &n1, msg, cap)))
			e = TD_EFORMAT;
		if (!e)
			e = label_of(o, obj, cls, msg, cap);
		if (!e)
			e = put_text(c, s1, n1, TR_ENC_SPECIALS | add, false, out, msg, cap);
		if (!e && out->n == start)
			e = msgf(msg, cap, TD_EFORMAT, "\"%s\" is empty: nothing to classify", o->text_field);
		break;
	case TR_ROWS_AUTO:
		e = msgf(msg, cap, TD_EINTERNAL, "row kind not decided");
		break;
	}
	json_object_put(obj);
	if (!e && out->n - start > UINT32_MAX)
		e = msgf(msg, cap, TD_ERANGE, "%zu tokens in one row is more than a row may hold", out->n - start);
	return e;
}
