/* A Hugging Face model directory: open its weights (one file or an index of
 * shards) as one name -> tensor table, and save a directory transformers loads.
 *
 * Opening prefers model.safetensors over the index, as transformers does; saving
 * therefore writes the new layout before it removes the other one, so a crash
 * midway leaves a directory that reads as the old model or the new one, never
 * a mix. This is not the engine's parameter table, and it does not convert or
 * check names against an architecture: train/ does that. */
#include "train/modeldir.h"

#include <dirent.h>
#include <errno.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define SINGLE_NAME "model.safetensors"
#define INDEX_NAME "model.safetensors.index.json"
#define INDEX_MAX_BYTES (256u << 20)
#define AUX_MAX_BYTES (1u << 30)

/* Files copied from the source dir when present, besides config.json. */
static const char *const aux_files[] = {
	"generation_config.json", "tokenizer.json", "tokenizer_config.json",
	"special_tokens_map.json", "vocab.json", "merges.txt",
};

struct wentry {
	const struct tr_st_tensor *t;
	size_t file;
};

struct tr_weights {
	size_t nfiles;
	struct tr_st_file **files;
	size_t count;
	struct wentry *order;    /* files in order, each in header order */
	struct wentry **by_name; /* sorted by tensor name */
};

static td_err join(char *buf, const char *dir, const char *name, struct td_errbuf *eb)
{
	if (snprintf(buf, PATH_MAX, "%s/%s", dir, name) >= PATH_MAX)
		return td_fail(eb, TD_EINVAL, "%s/%s: path too long", dir, name);
	return TD_OK;
}

/* 1 if path exists, 0 if not, a (negative) td_err if it cannot be told. */
static int exists(const char *path, struct td_errbuf *eb)
{
	struct stat st;
	if (stat(path, &st) == 0)
		return 1;
	if (errno == ENOENT)
		return 0;
	return tr__errno_fail(eb, errno, path, "stat");
}

/* ---- reading ---- */

static int cmp_wentry_name(const void *a, const void *b)
{
	const struct wentry *x = *(const struct wentry *const *)a, *y = *(const struct wentry *const *)b;
	return strcmp(x->t->name, y->t->name);
}

void tr_weights_close(struct tr_weights *w)
{
	if (!w)
		return;
	for (size_t i = 0; i < w->nfiles; i++)
		tr_st_close(w->files[i]);
	free(w->files);
	free(w->order);
	free(w->by_name);
	free(w);
}

/* Opens dir/name as file number w->nfiles; the index names it for messages. */
static td_err open_file(struct tr_weights *w, const char *dir, const char *name, const char *index,
			struct td_errbuf *eb)
{
	char path[PATH_MAX];
	td_err err = join(path, dir, name, eb);
	if (err)
		return err;
	if (index) {
		int e = exists(path, eb);
		if (e < 0)
			return (td_err)e;
		if (!e)
			return td_fail(eb, TD_EFORMAT, "%s: shard %s is missing", index, path);
	}
	return tr_st_open(&w->files[w->nfiles++], path, eb);
}

/* A shard name from the index: a plain file name in the same directory. */
static bool plain_name(const char *s)
{
	return *s && !strchr(s, '/') && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

/* Opens every shard the index names, once each, and checks every entry is in
 * its shard. */
static td_err open_index(struct tr_weights *w, const char *dir, const char *index,
			 struct td_errbuf *eb)
{
	json_object *root = NULL, *map = NULL;
	td_err err = tr__json_read_file(&root, index, INDEX_MAX_BYTES, eb);
	if (err)
		return err;
	const char **shards = NULL;
	if (!json_object_is_type(root, json_type_object) ||
	    !json_object_object_get_ex(root, "weight_map", &map) ||
	    !json_object_is_type(map, json_type_object)) {
		err = td_fail(eb, TD_EFORMAT, "%s: no \"weight_map\" object", index);
		goto out;
	}
	size_t n = (size_t)json_object_object_length(map);
	shards = calloc(n + 1, sizeof(*shards));
	w->files = calloc(n + 1, sizeof(*w->files));
	if (!shards || !w->files) {
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory", index);
		goto out;
	}
	/* Distinct shards in order of first mention; few enough for a linear scan. */
	size_t nshards = 0;
	json_object_object_foreach(map, name, v) {
		if (!json_object_is_type(v, json_type_string) || !plain_name(json_object_get_string(v))) {
			err = td_fail(eb, TD_EFORMAT, "%s: weight_map[\"%s\"] is not a file name", index, name);
			goto out;
		}
		const char *s = json_object_get_string(v);
		size_t k = 0;
		while (k < nshards && strcmp(shards[k], s) != 0)
			k++;
		if (k == nshards)
			shards[nshards++] = s;
	}
	for (size_t k = 0; k < nshards; k++)
		if ((err = open_file(w, dir, shards[k], index, eb)))
			goto out;
	json_object_object_foreach(map, tname, sv) {
		size_t k = 0;
		while (strcmp(shards[k], json_object_get_string(sv)) != 0)
			k++;
		if (!tr_st_find(w->files[k], tname)) {
			err = td_fail(eb, TD_EFORMAT, "%s: tensor '%s' is listed in %s but not there", index,
				      tname, tr_st_path(w->files[k]));
			goto out;
		}
	}
out:
	free(shards);
	json_object_put(root);
	return err;
}

/* Builds the name table over all files; a name in two files is an error. */
static td_err build_table(struct tr_weights *w, struct td_errbuf *eb)
{
	for (size_t k = 0; k < w->nfiles; k++)
		w->count += tr_st_count(w->files[k]);
	w->order = calloc(w->count + 1, sizeof(*w->order));
	w->by_name = calloc(w->count + 1, sizeof(*w->by_name));
	if (!w->order || !w->by_name)
		return td_fail(eb, TD_ENOMEM, "out of memory for %zu tensors", w->count);
	size_t at = 0;
	for (size_t k = 0; k < w->nfiles; k++) {
		for (size_t i = 0; i < tr_st_count(w->files[k]); i++) {
			w->order[at] = (struct wentry){tr_st_at(w->files[k], i), k};
			w->by_name[at] = &w->order[at];
			at++;
		}
	}
	qsort(w->by_name, w->count, sizeof(*w->by_name), cmp_wentry_name);
	for (size_t i = 1; i < w->count; i++)
		if (strcmp(w->by_name[i - 1]->t->name, w->by_name[i]->t->name) == 0)
			return td_fail(eb, TD_EFORMAT, "tensor '%s' is in both %s and %s",
				       w->by_name[i]->t->name, tr_st_path(w->files[w->by_name[i - 1]->file]),
				       tr_st_path(w->files[w->by_name[i]->file]));
	return TD_OK;
}

td_err tr_weights_open(struct tr_weights **out, const char *model_dir, struct td_errbuf *eb)
{
	char single[PATH_MAX], index[PATH_MAX];
	td_err err;
	if ((err = join(single, model_dir, SINGLE_NAME, eb)) || (err = join(index, model_dir, INDEX_NAME, eb)))
		return err;
	int has_single = exists(single, eb), has_index = has_single ? 0 : exists(index, eb);
	if (has_single < 0 || has_index < 0)
		return (td_err)(has_single < 0 ? has_single : has_index);
	if (!has_single && !has_index)
		return td_fail(eb, TD_ENOENT, "%s: neither %s nor %s exists", model_dir, SINGLE_NAME,
			       INDEX_NAME);

	struct tr_weights *w = calloc(1, sizeof(*w));
	if (!w)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", model_dir);
	if (has_single) {
		w->files = calloc(1, sizeof(*w->files));
		err = w->files ? open_file(w, model_dir, SINGLE_NAME, NULL, eb)
			       : td_fail(eb, TD_ENOMEM, "%s: out of memory", model_dir);
	} else {
		err = open_index(w, model_dir, index, eb);
	}
	if (!err)
		err = build_table(w, eb);
	if (err) {
		tr_weights_close(w);
		return err;
	}
	*out = w;
	return TD_OK;
}

size_t tr_weights_count(const struct tr_weights *w)
{
	return w->count;
}

const struct tr_st_tensor *tr_weights_at(const struct tr_weights *w, size_t i)
{
	return i < w->count ? w->order[i].t : NULL;
}

static const struct wentry *lookup(const struct tr_weights *w, const char *name)
{
	size_t lo = 0, hi = w->count;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		int c = strcmp(name, w->by_name[mid]->t->name);
		if (c == 0)
			return w->by_name[mid];
		if (c < 0)
			hi = mid;
		else
			lo = mid + 1;
	}
	return NULL;
}

const struct tr_st_tensor *tr_weights_find(const struct tr_weights *w, const char *name)
{
	const struct wentry *e = lookup(w, name);
	return e ? e->t : NULL;
}

const char *tr_weights_file_of(const struct tr_weights *w, const char *name)
{
	const struct wentry *e = lookup(w, name);
	return e ? tr_st_path(w->files[e->file]) : NULL;
}

/* ---- saving ---- */

td_err tr__mkdir_p(const char *dir, struct td_errbuf *eb)
{
	char buf[PATH_MAX];
	if (!*dir)
		return td_fail(eb, TD_EINVAL, "empty output directory name");
	if (snprintf(buf, sizeof(buf), "%s", dir) >= (int)sizeof(buf))
		return td_fail(eb, TD_EINVAL, "%s: path too long", dir);
	for (char *p = buf + 1;; p++) {
		if (*p != '/' && *p != '\0')
			continue;
		char c = *p;
		*p = '\0';
		if (mkdir(buf, 0755) < 0 && errno != EEXIST)
			return tr__errno_fail(eb, errno, buf, "mkdir");
		*p = c;
		if (!c)
			break;
	}
	struct stat st;
	if (stat(dir, &st) < 0)
		return tr__errno_fail(eb, errno, dir, "stat");
	if (!S_ISDIR(st.st_mode))
		return td_fail(eb, TD_EINVAL, "%s: exists and is not a directory", dir);
	return TD_OK;
}

static td_err remove_if_there(const char *dir, const char *name, struct td_errbuf *eb)
{
	char path[PATH_MAX];
	td_err err = join(path, dir, name, eb);
	if (!err && unlink(path) < 0 && errno != ENOENT)
		err = tr__errno_fail(eb, errno, path, "unlink");
	return err;
}

/* Removes shards named model-NNNNN-of-MMMMM.safetensors whose MMMMM is not
 * keep_of (0: all of them): what a save with another layout left behind. */
static td_err remove_stale_shards(const char *dir, size_t keep_of, struct td_errbuf *eb)
{
	DIR *d = opendir(dir);
	if (!d)
		return tr__errno_fail(eb, errno, dir, "opendir");
	td_err err = TD_OK;
	struct dirent *de;
	while (!err && (de = readdir(d))) {
		char idx[8], of[8];
		int end = -1;
		if (sscanf(de->d_name, "model-%5[0-9]-of-%5[0-9].safetensors%n", idx, of, &end) != 2 ||
		    end < 0 || de->d_name[end] || strlen(idx) != 5 || strlen(of) != 5)
			continue;
		if (strtoul(of, NULL, 10) != keep_of)
			err = remove_if_there(dir, de->d_name, eb);
	}
	closedir(d);
	return err;
}

static int cmp_save_name(const void *a, const void *b)
{
	const struct tr_save_tensor *x = *(const struct tr_save_tensor *const *)a;
	const struct tr_save_tensor *y = *(const struct tr_save_tensor *const *)b;
	return strcmp(x->name, y->name);
}

/* Writes the tensors [first, last) to path in dtype, converting from fp32. */
static td_err write_file(const char *path, const struct tr_save_tensor *t, const size_t *nbytes,
			 size_t first, size_t last, enum tr_dtype dtype, struct td_errbuf *eb)
{
	static const char *const meta[] = {"format", "pt", NULL};
	size_t k = last - first, total = 0;
	for (size_t i = first; i < last; i++)
		total += nbytes[i];
	struct tr_st_entry *e = calloc(k + 1, sizeof(*e));
	uint16_t *half = dtype == TR_DT_F32 ? NULL : malloc(total + 1);
	if (!e || (dtype != TR_DT_F32 && !half)) {
		free(e);
		free(half);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory converting %zu bytes", path, total);
	}
	uint16_t *h = half;
	for (size_t i = 0; i < k; i++) {
		const struct tr_save_tensor *s = &t[first + i];
		e[i] = (struct tr_st_entry){.name = s->name, .dtype = dtype, .ndim = s->ndim, .data = s->data};
		memcpy(e[i].shape, s->shape, sizeof(e[i].shape));
		if (dtype == TR_DT_F32)
			continue;
		size_t numel = nbytes[first + i] / 2;
		for (size_t j = 0; j < numel; j++)
			h[j] = dtype == TR_DT_BF16 ? tr_f32_to_bf16(s->data[j]) : tr_f32_to_f16(s->data[j]);
		e[i].data = h;
		h += numel;
	}
	td_err err = tr_st_write(path, e, k, meta, eb);
	free(half);
	free(e);
	return err;
}

/* {"metadata": {"total_size": N}, "weight_map": {name: file, ...}} with the
 * names sorted, as save_pretrained writes it. */
static td_err write_index(const char *path, const struct tr_save_tensor *const *sorted,
			  const size_t *shard_of_sorted, size_t n, size_t nshards, uint64_t total,
			  struct td_errbuf *eb)
{
	json_object *root = json_object_new_object(), *meta, *map;
	bool ok = root && (meta = tr__json_put(root, "metadata", json_object_new_object())) &&
		  tr__json_put(meta, "total_size", json_object_new_int64((int64_t)total)) &&
		  (map = tr__json_put(root, "weight_map", json_object_new_object()));
	for (size_t i = 0; ok && i < n; i++) {
		char name[64];
		snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", shard_of_sorted[i] + 1, nshards);
		ok = tr__json_put(map, sorted[i]->name, json_object_new_string(name));
	}
	size_t len = 0;
	const char *text = ok ? json_object_to_json_string_length(root,
								   JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
									   JSON_C_TO_STRING_NOSLASHESCAPE,
								   &len)
			      : NULL;
	td_err err = text ? tr__write_atomic(path, (struct tr__chunk[]){{text, len}, {"\n", 1}}, 2, eb)
			  : td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	json_object_put(root);
	return err;
}

/* Checks names and shapes, sizes each tensor, and sorts them by name. */
static td_err check_tensors(const char *out_dir, const struct tr_save_tensor *t, size_t n,
			    size_t esize, size_t *nbytes, const struct tr_save_tensor **sorted,
			    struct td_errbuf *eb)
{
	for (size_t i = 0; i < n; i++) {
		if (!t[i].name || t[i].ndim < 0 || t[i].ndim > TR_ST_MAX_DIMS)
			return td_fail(eb, TD_EINVAL, "%s: tensor %zu: bad name or ndim", out_dir, i);
		uint64_t numel = 1;
		bool overflow = false;
		for (int d = 0; d < t[i].ndim; d++) {
			if (t[i].shape[d] < 0)
				return td_fail(eb, TD_EINVAL, "%s: tensor '%s': negative shape", out_dir, t[i].name);
			overflow |= __builtin_mul_overflow(numel, (uint64_t)t[i].shape[d], &numel);
		}
		if (overflow || __builtin_mul_overflow(numel, esize, &nbytes[i]))
			return td_fail(eb, TD_EINVAL, "%s: tensor '%s': shape overflows", out_dir, t[i].name);
		if (numel && !t[i].data)
			return td_fail(eb, TD_EINVAL, "%s: tensor '%s': no data", out_dir, t[i].name);
		sorted[i] = &t[i];
	}
	qsort(sorted, n, sizeof(*sorted), cmp_save_name);
	for (size_t i = 1; i < n; i++)
		if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0)
			return td_fail(eb, TD_EINVAL, "%s: tensor '%s' given twice", out_dir, sorted[i]->name);
	return TD_OK;
}

/* Greedy in the given order, as huggingface_hub splits a state dict: a shard
 * closes when the next tensor would take it past the limit; a tensor bigger
 * than the limit gets a shard of its own. Returns the number of shards. */
static size_t plan_shards(const size_t *nbytes, size_t n, uint64_t limit, size_t *shard_of)
{
	size_t shard = 0;
	uint64_t size = 0;
	for (size_t i = 0; i < n; i++) {
		if (size > 0 && size + nbytes[i] > limit) {
			shard++;
			size = 0;
		}
		shard_of[i] = shard;
		size += nbytes[i];
	}
	return n ? shard + 1 : 1;
}

static td_err write_weights(const char *out_dir, const struct tr_save_tensor *t, size_t n,
			    enum tr_dtype dtype, uint64_t shard_bytes, const size_t *nbytes,
			    const struct tr_save_tensor *const *sorted, size_t *shard_of,
			    struct td_errbuf *eb)
{
	char path[PATH_MAX];
	uint64_t total = 0;
	td_err err;
	for (size_t i = 0; i < n; i++)
		total += nbytes[i];
	size_t nshards = shard_bytes && total > shard_bytes ? plan_shards(nbytes, n, shard_bytes, shard_of) : 1;
	if (nshards == 1) {
		if ((err = join(path, out_dir, SINGLE_NAME, eb)) ||
		    (err = write_file(path, t, nbytes, 0, n, dtype, eb)) ||
		    (err = remove_if_there(out_dir, INDEX_NAME, eb)))
			return err;
		return remove_stale_shards(out_dir, 0, eb);
	}

	for (size_t first = 0, s = 0; s < nshards; s++) {
		size_t last = first;
		while (last < n && shard_of[last] == s)
			last++;
		char name[64];
		snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, nshards);
		if ((err = join(path, out_dir, name, eb)) ||
		    (err = write_file(path, t, nbytes, first, last, dtype, eb)))
			return err;
		first = last;
	}
	/* The index in name order wants each name's shard. */
	size_t *by_sorted = malloc(n * sizeof(*by_sorted));
	if (!by_sorted)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", out_dir);
	for (size_t i = 0; i < n; i++)
		by_sorted[i] = shard_of[sorted[i] - t];
	err = join(path, out_dir, INDEX_NAME, eb);
	if (!err)
		err = write_index(path, sorted, by_sorted, n, nshards, total, eb);
	free(by_sorted);
	if (!err)
		err = remove_if_there(out_dir, SINGLE_NAME, eb);
	if (!err)
		err = remove_stale_shards(out_dir, nshards, eb);
	return err;
}

/* Copies src_dir/name to out_dir/name atomically when the source exists. */
static td_err copy_aux(const char *out_dir, const char *src_dir, const char *name,
		       struct td_errbuf *eb)
{
	char src[PATH_MAX], dst[PATH_MAX];
	td_err err;
	if ((err = join(src, src_dir, name, eb)) || (err = join(dst, out_dir, name, eb)))
		return err;
	int e = exists(src, eb);
	if (e <= 0)
		return (td_err)e;
	char *text;
	size_t len;
	if ((err = tr__read_file(src, AUX_MAX_BYTES, &text, &len, eb)))
		return err;
	err = tr__write_atomic(dst, &(struct tr__chunk){text, len}, 1, eb);
	free(text);
	return err;
}

static bool same_dir(const char *a, const char *b)
{
	struct stat sa, sb;
	return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

td_err tr_modeldir_save(const char *out_dir, const char *src_dir,
			const struct tr_model_config *cfg, const struct tr_save_tensor *tensors,
			size_t n, enum tr_dtype dtype, uint64_t shard_bytes, struct td_errbuf *eb)
{
	if (dtype != TR_DT_F32 && dtype != TR_DT_BF16 && dtype != TR_DT_F16)
		return td_fail(eb, TD_EINVAL, "%s: cannot save as %s: only F32, BF16 and F16", out_dir,
			       tr_dtype_name(dtype) ? tr_dtype_name(dtype) : "?");
	size_t *nbytes = calloc(n + 1, sizeof(*nbytes)), *shard_of = calloc(n + 1, sizeof(*shard_of));
	const struct tr_save_tensor **sorted = calloc(n + 1, sizeof(*sorted));
	td_err err = TD_OK;
	if (!nbytes || !shard_of || !sorted) {
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory", out_dir);
		goto out;
	}
	if ((err = check_tensors(out_dir, tensors, n, tr_dtype_size(dtype), nbytes, sorted, eb)) ||
	    (err = tr__mkdir_p(out_dir, eb)) ||
	    (err = write_weights(out_dir, tensors, n, dtype, shard_bytes, nbytes, sorted, shard_of, eb)))
		goto out;

	char src_cfg[PATH_MAX], dst_cfg[PATH_MAX];
	int has_src_cfg = 0;
	if (src_dir && (err = join(src_cfg, src_dir, "config.json", eb)))
		goto out;
	if (src_dir && (has_src_cfg = exists(src_cfg, eb)) < 0) {
		err = (td_err)has_src_cfg;
		goto out;
	}
	if (!has_src_cfg && !cfg) {
		err = td_fail(eb, TD_EINVAL, "%s: no config to write: no cfg and no source config.json", out_dir);
		goto out;
	}
	if ((err = join(dst_cfg, out_dir, "config.json", eb)) ||
	    (err = tr_config_write(cfg, has_src_cfg ? src_cfg : NULL, dtype, dst_cfg, eb)))
		goto out;
	/* Saving over the source: the files are already there. */
	if (src_dir && !same_dir(src_dir, out_dir))
		for (size_t i = 0; i < sizeof(aux_files) / sizeof(aux_files[0]) && !err; i++)
			err = copy_aux(out_dir, src_dir, aux_files[i], eb);
out:
	free(sorted);
	free(shard_of);
	free(nbytes);
	return err;
}
