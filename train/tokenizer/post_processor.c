/* The post-processor stage (train/tokenizer/internal.h): tokenizer.json's
 * "post_processor" — none, ByteLevel (offsets only: nothing to do here),
 * TemplateProcessing (its `single` template: the special ids before and
 * after one sequence, Llama-3's <|begin_of_text|>), RobertaProcessing and
 * BertProcessing (cls and sep), or a Sequence of those.
 *
 * Not here: pair templates (traind encodes one sequence at a time);
 * truncation and padding, which the dataset does (train/data.c). */
#include "train/tokenizer/internal.h"

#include <stdio.h>

static td_err push_id(const struct tr__load *L, int32_t **v, size_t *n, int64_t id, const char *path)
{
	if (id < 0 || id >= TR__MAX_ID)
		return td_fail(L->eb, TD_EFORMAT, "%s: %s: id %lld is out of range", L->origin, path, (long long)id);
	int32_t *nv = realloc(*v, (*n + 1) * sizeof(**v));
	if (!nv)
		return td_fail(L->eb, TD_ENOMEM, "%s: out of memory", L->origin);
	nv[(*n)++] = (int32_t)id;
	*v = nv;
	return TD_OK;
}

/* RobertaProcessing / BertProcessing: "cls": ["<s>", 0], "sep": ["</s>", 2]. */
static td_err load_cls_sep(struct tr__post_processor *pp, const struct tr__load *L, struct json_object *p,
			   const char *path)
{
	struct json_object *cls = tr__jget(p, "cls"), *sep = tr__jget(p, "sep");
	struct json_object *ci = cls && json_object_is_type(cls, json_type_array) ? json_object_array_get_idx(cls, 1) : NULL;
	struct json_object *si = sep && json_object_is_type(sep, json_type_array) ? json_object_array_get_idx(sep, 1) : NULL;
	if (!ci || !si || !json_object_is_type(ci, json_type_int) || !json_object_is_type(si, json_type_int))
		return td_fail(L->eb, TD_EFORMAT, "%s: %s: expected \"cls\" and \"sep\" as [token, id]", L->origin, path);
	td_err e = push_id(L, &pp->pre, &pp->npre, json_object_get_int64(ci), path);
	return e ? e : push_id(L, &pp->post, &pp->npost, json_object_get_int64(si), path);
}

static td_err load_template(struct tr__post_processor *pp, const struct tr__load *L, struct json_object *p,
			    const char *path)
{
	struct json_object *single = tr__jget(p, "single"), *specials = tr__jget(p, "special_tokens");
	if (!single || !json_object_is_type(single, json_type_array))
		return td_fail(L->eb, TD_EFORMAT, "%s: %s.single: expected an array", L->origin, path);
	bool seen_seq = false;
	for (size_t i = 0; i < json_object_array_length(single); i++) {
		struct json_object *item = json_object_array_get_idx(single, i);
		if (tr__jget(item, "Sequence")) {
			seen_seq = true;
			continue;
		}
		const char *name = tr__jstr(tr__jget(item, "SpecialToken"), "id");
		struct json_object *st = name ? tr__jget(specials, name) : NULL;
		struct json_object *ids = tr__jget(st, "ids");
		if (!ids || !json_object_is_type(ids, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: %s.single[%zu]: special token %s is not in special_tokens",
				       L->origin, path, i, name ? name : "(unnamed)");
		for (size_t k = 0; k < json_object_array_length(ids); k++) {
			int64_t id = json_object_get_int64(json_object_array_get_idx(ids, k));
			td_err e = seen_seq ? push_id(L, &pp->post, &pp->npost, id, path)
					    : push_id(L, &pp->pre, &pp->npre, id, path);
			if (e)
				return e;
		}
	}
	return TD_OK;
}

td_err tr__post_processor_load(struct tr__post_processor *pp, const struct tr__load *L, struct json_object *p,
			       const char *path)
{
	if (!p)
		return TD_OK;
	const char *type = tr__jstr(p, "type");
	if (type && strcmp(type, "ByteLevel") == 0)
		return TD_OK; /* offsets only */
	if (type && strcmp(type, "TemplateProcessing") == 0)
		return load_template(pp, L, p, path);
	if (type && (strcmp(type, "RobertaProcessing") == 0 || strcmp(type, "BertProcessing") == 0))
		return load_cls_sep(pp, L, p, path);
	if (type && strcmp(type, "Sequence") == 0) {
		struct json_object *list = tr__jget(p, "processors");
		/* json-c's array calls on another type read it as an array. */
		if (list && !json_object_is_type(list, json_type_array))
			return td_fail(L->eb, TD_EFORMAT, "%s: %s.processors: expected an array (got %s)", L->origin, path,
				       tr__jtype_name(list));
		for (size_t i = 0; list && i < json_object_array_length(list); i++) {
			char sub[96];
			snprintf(sub, sizeof(sub), "%s.processors[%zu]", path, i);
			td_err e = tr__post_processor_load(pp, L, json_object_array_get_idx(list, i), sub);
			if (e)
				return e;
		}
		return TD_OK;
	}
	return td_fail(L->eb, TD_EUNSUPPORTED,
		       "%s: %s %s is not supported (ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing)",
		       L->origin, path, type ? type : "(no type)");
}

td_err tr__post_processor_check(const struct tr__post_processor *pp, const struct tr__load *L, int vocab_size,
				const struct tr__bpe *m, const struct tr__added *a)
{
	size_t n = pp->npre + pp->npost;
	for (size_t i = 0; i < n; i++) {
		int32_t id = i < pp->npre ? pp->pre[i] : pp->post[i - pp->npre];
		if (id >= vocab_size)
			return td_fail(L->eb, TD_EFORMAT, "%s: post_processor: id %d has no token", L->origin, id);
	}
	/* Below the vocabulary size is not enough: an id in a gap of the
	 * vocabulary would be put in every sequence and decode to nothing. */
	for (size_t i = 0; i < n; i++) {
		int32_t id = i < pp->npre ? pp->pre[i] : pp->post[i - pp->npre];
		size_t len;
		if (a->of[id] < 0 && !tr__bpe_token(m, id, &len))
			return td_fail(L->eb, TD_EFORMAT, "%s: post_processor: id %d has no token", L->origin, id);
	}
	return TD_OK;
}

void tr__post_processor_fini(struct tr__post_processor *pp)
{
	free(pp->pre);
	free(pp->post);
	memset(pp, 0, sizeof(*pp));
}

static td_err append(struct tr_ids *out, const int32_t *ids, size_t n)
{
	if (!n)
		return TD_OK;
	if (tr__ids_reserve(out, n))
		return TD_ENOMEM;
	memcpy(out->v + out->n, ids, n * sizeof(int32_t));
	out->n += n;
	return TD_OK;
}

td_err tr__post_processor_prefix(const struct tr__post_processor *pp, struct tr_ids *out)
{
	return append(out, pp->pre, pp->npre);
}

td_err tr__post_processor_suffix(const struct tr__post_processor *pp, struct tr_ids *out)
{
	return append(out, pp->post, pp->npost);
}
