/* Datasets (train/data.h): token files and JSONL token caches, cut into
 * sequences, served in a shuffled order.
 *
 * Both sources become rows of tokens (a token file is one row; a JSONL cache
 * has one row a document) and one layout turns rows into sequences:
 *   packing   a virtual stream of the rows (each cut to T when truncating);
 *             vstart[r] is where row r starts in it, sequence s is the
 *             stream's tokens [s*T, (s+1)*T), found by binary search.
 *   padding   row r owns sequences vstart[r] .. vstart[r+1]-1 (one when
 *             truncating, ceil(len/T) when splitting), padded at the end.
 * Not here: tokenizing (tokcache.c, jsonl.c). */
#include "train/data.h"

#include "train/mapguard.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/hfconfig.h"
#include "train/rows.h"

struct tr_data {
	char *path;
	int T;
	uint64_t seed;
	bool shuffle, packing, truncate, drop_tail;
	int32_t pad_id;
	/* rows: a token file's map and its one row, or a JSONL cache */
	const uint32_t *tok;
	uint64_t ntok;
	const struct tr__rowent *row;
	uint64_t nrow;
	struct tr__rowent one_row;
	const uint8_t *map;
	size_t map_len;
	struct tr__cache cache;
	/* layout */
	uint64_t *vstart; /* nrow + 1 entries; NULL for padding + truncate */
	uint64_t nseq;
	uint64_t fingerprint;
	/* order */
	uint64_t perm_epoch; /* epoch whose order perm holds, or UINT64_MAX */
	uint64_t *perm;
};

static uint64_t splitmix64(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [0, n) without modulo bias (Lemire's rejection). */
static uint64_t below(uint64_t *s, uint64_t n)
{
	uint64_t threshold = -n % n, r;
	do
		r = splitmix64(s);
	while (r < threshold);
	return r % n;
}

static void build_perm(struct tr_data *d, uint64_t epoch)
{
	uint64_t s = d->seed * 0x100000001b3ull ^ (epoch + 1) * 0xcbf29ce484222325ull;
	for (uint64_t i = 0; i < d->nseq; i++)
		d->perm[i] = i;
	for (uint64_t i = d->nseq; i > 1; i--) {
		uint64_t j = below(&s, i);
		uint64_t t = d->perm[i - 1];
		d->perm[i - 1] = d->perm[j];
		d->perm[j] = t;
	}
	d->perm_epoch = epoch;
}

/* ------------------------------------------------------------------------ */
/* Layout */

static inline uint64_t eff_len(const struct tr_data *d, uint64_t r)
{
	uint64_t len = d->row[r].len;
	return d->truncate && len > (uint64_t)d->T ? (uint64_t)d->T : len;
}

static td_err build_layout(struct tr_data *d, struct td_errbuf *eb)
{
	uint64_t T = (uint64_t)d->T;
	if (!d->packing && d->truncate) {
		d->nseq = d->nrow;
	} else {
		d->vstart = malloc((d->nrow + 1) * sizeof(uint64_t));
		if (!d->vstart)
			return td_fail(eb, TD_ENOMEM, "%s: out of memory for %llu rows", d->path,
				       (unsigned long long)d->nrow);
		uint64_t at = 0;
		for (uint64_t r = 0; r < d->nrow; r++) {
			d->vstart[r] = at;
			at += d->packing ? eff_len(d, r) : (d->row[r].len + T - 1) / T;
		}
		d->vstart[d->nrow] = at;
		d->nseq = !d->packing ? at : d->drop_tail ? at / T : (at + T - 1) / T;
	}
	if (d->nseq == 0)
		return td_fail(eb, TD_EINVAL, "%s: %llu tokens, fewer than one sequence of %d", d->path,
			       (unsigned long long)d->ntok, d->T);
	d->perm = malloc(d->nseq * sizeof(uint64_t));
	if (!d->perm)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory for %llu sequences", d->path,
			       (unsigned long long)d->nseq);
	d->perm_epoch = UINT64_MAX;
	return TD_OK;
}

/* The row r with vstart[r] <= v < vstart[r + 1] (the last such r). */
static uint64_t row_at(const struct tr_data *d, uint64_t v)
{
	uint64_t lo = 0, hi = d->nrow; /* vstart[lo] <= v < vstart[hi] */
	while (hi - lo > 1) {
		uint64_t mid = lo + (hi - lo) / 2;
		if (d->vstart[mid] <= v)
			lo = mid;
		else
			hi = mid;
	}
	return lo;
}

static inline void put(const struct tr_data *d, uint32_t raw, int32_t *id, int32_t *label)
{
	*id = (int32_t)(raw & ~TR__NOLOSS);
	*label = raw & TR__NOLOSS ? -100 : *id;
	(void)d;
}

static void sequence(const struct tr_data *d, uint64_t s, int32_t *ids, int32_t *labels, int32_t *class_id)
{
	uint64_t T = (uint64_t)d->T, t = 0;
	int32_t cls = -1;
	if (d->packing) {
		uint64_t v = s * T;
		for (uint64_t r = row_at(d, v); t < T && r < d->nrow; r++) {
			uint64_t o = v + t - d->vstart[r], len = eff_len(d, r);
			if (o >= len)
				continue; /* an empty row */
			uint64_t take = len - o < T - t ? len - o : T - t;
			const uint32_t *src = d->tok + d->row[r].off + o;
			for (uint64_t k = 0; k < take; k++)
				put(d, src[k], &ids[t + k], &labels[t + k]);
			t += take;
		}
	} else {
		uint64_t r = d->vstart ? row_at(d, s) : s;
		uint64_t piece = d->vstart ? s - d->vstart[r] : 0;
		uint64_t o = piece * T, len = d->row[r].len;
		uint64_t take = len - o < T ? len - o : T;
		const uint32_t *src = d->tok + d->row[r].off + o;
		for (; t < take; t++)
			put(d, src[t], &ids[t], &labels[t]);
		cls = d->row[r].cls;
	}
	for (; t < T; t++) {
		ids[t] = d->pad_id;
		labels[t] = -100;
	}
	if (class_id)
		*class_id = cls;
}

/* The tokens and rows are read through mappings (the token file, or the
 * token cache): a file cut short under the job is its error, not the
 * daemon's death (train/mapguard.h). */
static td_err map_fail(const struct tr_data *d, struct td_errbuf *eb)
{
	return tr_map_fail(eb, d->path, d->map ? "reading its tokens" : "reading its token cache");
}

td_err tr_data_sequence(const struct tr_data *d, uint64_t s, int32_t *ids, int32_t *labels, int32_t *class_id,
			struct td_errbuf *eb)
{
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0))
		return map_fail(d, eb);
	sequence(d, s, ids, labels, class_id);
	tr_map_guard_pop(&g);
	return TD_OK;
}

td_err tr_data_next(struct tr_data *d, struct tr_data_pos *pos, int32_t *ids, int32_t *labels, int32_t *class_ids,
		    int B, struct td_errbuf *eb)
{
	for (int b = 0; b < B; b++) {
		if (pos->index >= d->nseq) {
			pos->epoch++;
			pos->index = 0;
		}
		uint64_t seq = pos->index++;
		if (d->shuffle) {
			if (d->perm_epoch != pos->epoch)
				build_perm(d, pos->epoch);
			seq = d->perm[seq];
		}
		td_err e = tr_data_sequence(d, seq, ids + (size_t)b * d->T, labels + (size_t)b * d->T,
					    class_ids ? &class_ids[b] : NULL, eb);
		if (e != TD_OK)
			return e;
	}
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Opening */

void tr_data_close(struct tr_data *d)
{
	if (!d)
		return;
	if (d->map)
		munmap((void *)d->map, d->map_len);
	tr__cache_close(&d->cache);
	free(d->vstart);
	free(d->perm);
	free(d->path);
	free(d);
}

static td_err open_token_file(struct tr_data *d, const struct tr_data_opts *o, struct td_errbuf *eb)
{
	const char *path = o->path;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "%s: cannot open: %s", path, strerror(errno));
	struct stat sb;
	if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
		close(fd);
		return td_fail(eb, TD_EFORMAT, "%s: not a regular file", path);
	}
	size_t len = (size_t)sb.st_size;
	if (len == 0 || len % 4) {
		close(fd);
		return td_fail(eb, TD_EFORMAT,
			       "%s: %zu bytes is not a token file (little-endian uint32 ids: a non-empty multiple of 4 bytes)",
			       path, len);
	}
	const uint8_t *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
	close(fd);
	if (map == MAP_FAILED)
		return td_fail(eb, TD_EIO, "%s: cannot map: %s", path, strerror(errno));
	d->map = map;
	d->map_len = len;
	uint64_t n = len / 4;
	/* The first id outside the vocabulary; n when none. */
	uint64_t bad = n;
	uint32_t bad_id = 0;
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0))
		return tr_map_fail(eb, path, "checking its tokens");
	for (uint64_t i = 0; i < n; i++) {
		const uint8_t *p = map + 4 * i;
		uint32_t id = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
		if (id >= (uint32_t)o->vocab) {
			bad = i;
			bad_id = id;
			break;
		}
	}
	tr_map_guard_pop(&g);
	if (bad < n)
		return td_fail(eb, TD_ERANGE,
			       "%s: token %llu (byte offset %llu) is %u, outside the model's vocabulary of %d", path,
			       (unsigned long long)bad, (unsigned long long)(4 * bad), bad_id, o->vocab);
	d->tok = (const uint32_t *)map; /* little-endian host (tokcache.c asserts it); ids < vocab < 2^31 */
	d->ntok = n;
	d->one_row = (struct tr__rowent){ .off = 0, .len = (uint32_t)(n > UINT32_MAX ? UINT32_MAX : n), .cls = -1 };
	if (n > UINT32_MAX)
		return td_fail(eb, TD_ERANGE, "%s: %llu tokens; a token file holds at most %u", path,
			       (unsigned long long)n, UINT32_MAX);
	d->row = &d->one_row;
	d->nrow = 1;
	d->packing = true;
	d->truncate = false;
	d->drop_tail = true;
	return TD_OK;
}

td_err tr_data_open(struct tr_data **out, const struct tr_data_opts *o, struct td_errbuf *eb)
{
	if (o->T < 2)
		return td_fail(eb, TD_EINVAL, "%s: sequence length %d is below 2", o->path, o->T);
	if (o->jsonl && (o->eos_id < 0 || o->eos_id >= o->vocab))
		return td_fail(eb, TD_ERANGE, "%s: EOS id %d is outside the model's vocabulary of %d (data.eos_id)",
			       o->path, o->eos_id, o->vocab);
	int32_t pad = o->pad_id >= 0 ? o->pad_id : o->eos_id;
	if (pad >= o->vocab || (pad < 0 && (o->jsonl || !o->packing)))
		return td_fail(eb, TD_ERANGE, "%s: pad id %d is outside the model's vocabulary of %d (data.pad_id)", o->path,
			       pad, o->vocab);
	if (o->rows == TR_ROWS_CLASSIFY && o->packing)
		return td_fail(eb, TD_EINVAL, "%s: classification needs one row a sequence (data.packing: false)", o->path);
	struct tr_data *d = calloc(1, sizeof(*d));
	if (!d || !(d->path = strdup(o->path))) {
		free(d);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", o->path);
	}
	d->T = o->T;
	d->seed = o->seed;
	d->shuffle = o->shuffle;
	d->pad_id = pad < 0 ? 0 : pad;
	td_err e;
	if (!o->jsonl) {
		e = open_token_file(d, o, eb);
	} else {
		d->packing = o->packing;
		d->truncate = o->truncate;
		e = tr__cache_open(&d->cache, o, eb);
		if (!e) {
			d->tok = d->cache.tok;
			d->ntok = d->cache.ntok;
			d->row = d->cache.row;
			d->nrow = d->cache.nrow;
		}
	}
	if (!e)
		e = build_layout(d, eb);
	if (e) {
		tr_data_close(d);
		return e;
	}
	/* Of what the sequences are, not where the file is: a copied or touched
	 * file still resumes. */
	uint64_t f = 0xcbf29ce484222325ull;
	const uint64_t parts[] = { d->ntok, d->nrow, d->nseq, (uint64_t)d->T,
				   (uint64_t)d->packing << 2 | (uint64_t)d->truncate << 1 | d->drop_tail,
				   d->row[0].len, d->row[d->nrow - 1].len, d->tok[0], d->tok[d->ntok - 1] };
	for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
		f = (f ^ parts[i]) * 0x100000001b3ull;
	d->fingerprint = f;
	*out = d;
	return TD_OK;
}

td_err tr_data_open_tokens(struct tr_data **out, const char *path, int T, int vocab, uint64_t seed,
			   struct td_errbuf *eb)
{
	struct tr_data_opts o = { .path = path, .T = T, .vocab = vocab, .seed = seed, .shuffle = true,
				  .packing = true, .eos_id = -1, .pad_id = 0 };
	return tr_data_open(out, &o, eb);
}

/* The EOS of a JSONL job: data.eos_id, the config's, or a well-known token. */
static int32_t job_eos(const Traind__JobSpec *spec, const struct tr_model_config *cfg, const struct tr_tokenizer *tok)
{
	if (spec->data->has_eos_id)
		return (int32_t)spec->data->eos_id;
	if (cfg->eos_token_id >= 0)
		return cfg->eos_token_id;
	static const char *const names[] = { "<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>" };
	for (size_t i = 0; tok && i < sizeof(names) / sizeof(names[0]); i++) {
		int id = tr_tokenizer_token_id(tok, names[i]);
		if (id >= 0)
			return id;
	}
	return -1;
}

td_err tr_data_open_job(struct tr_data **out, const Traind__JobSpec *spec, const struct tr_model_config *cfg,
			bool eval, FILE *log, struct td_errbuf *eb)
{
	const Traind__DataSpec *ds = spec->data;
	bool classify = spec->method == TRAIND__METHOD__METHOD_CLASSIFY;
	struct tr_data_opts o = {
		.path = eval ? ds->eval_file : ds->train_file,
		.jsonl = ds->format == TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL,
		.T = (int)ds->seq_len,
		.vocab = cfg->vocab_size,
		.seed = spec->hyper->seed,
		.shuffle = !eval,
		.packing = ds->packing,
		.truncate = ds->overflow == TRAIND__OVERFLOW__OVERFLOW_TRUNCATE,
		.pad_id = ds->has_pad_id ? (int32_t)ds->pad_id : cfg->pad_token_id,
		.eos_id = -1,
		.text_field = ds->text_field,
		.prompt_field = ds->prompt_field,
		.completion_field = ds->completion_field,
		.messages_field = ds->messages_field,
		.label_field = spec->classify->label_field,
		.chat_template = ds->chat_template,
		.assistant_only_loss = ds->assistant_only_loss,
		.add_special_tokens = ds->add_special_tokens,
		.label_names = classify ? spec->classify->label_names : NULL,
		.n_label_names = classify ? spec->classify->n_label_names : 0,
		.num_labels = classify ? (int)spec->classify->num_labels : 0,
		.log = log,
	};
	switch (ds->rows) {
	case TRAIND__ROW_FORMAT__ROWS_TEXT:
		o.rows = TR_ROWS_TEXT;
		break;
	case TRAIND__ROW_FORMAT__ROWS_PROMPT_COMPLETION:
		o.rows = TR_ROWS_PROMPT_COMPLETION;
		break;
	case TRAIND__ROW_FORMAT__ROWS_MESSAGES:
		o.rows = TR_ROWS_MESSAGES;
		break;
	default:
		o.rows = TR_ROWS_AUTO;
		break;
	}
	if (classify)
		o.rows = TR_ROWS_CLASSIFY;
	if (!o.path)
		return td_fail(eb, TD_EINVAL, "data.%s: not set", eval ? "eval_file" : "train_file");
	char cache_dir[PATH_MAX], tok_path[PATH_MAX];
	struct tr_tokenizer *tok = NULL;
	if (o.jsonl) {
		snprintf(tok_path, sizeof(tok_path), "%s/tokenizer.json", spec->model_dir);
		td_err e = tr_tokenizer_load(&tok, tok_path, eb);
		if (e)
			return e;
		snprintf(cache_dir, sizeof(cache_dir), "%s/data-cache", spec->output->dir);
		o.tok = tok;
		o.cache_dir = cache_dir;
	}
	o.eos_id = job_eos(spec, cfg, tok);
	if (o.jsonl && o.eos_id < 0) {
		tr_tokenizer_free(tok);
		return td_fail(eb, TD_EINVAL,
			       "%s: no EOS id: set data.eos_id (the model's config.json has no eos_token_id and %s has "
			       "none of <|endoftext|>, <|end_of_text|>, </s>, <eos>)",
			       o.path, tok_path);
	}
	if (o.pad_id < 0)
		o.pad_id = o.eos_id;
	td_err e = tr_data_open(out, &o, eb);
	tr_tokenizer_free(tok); /* the tokens are in the cache now */
	return e;
}

uint64_t tr_data_num_sequences(const struct tr_data *d)
{
	return d->nseq;
}

uint64_t tr_data_num_tokens(const struct tr_data *d)
{
	return d->ntok;
}

uint64_t tr_data_num_rows(const struct tr_data *d)
{
	return d->nrow;
}

int32_t tr_data_pad_id(const struct tr_data *d)
{
	return d->pad_id;
}

uint64_t tr_data_fingerprint(const struct tr_data *d)
{
	return d->fingerprint;
}
