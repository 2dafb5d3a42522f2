/* The token cache of a JSONL dataset (train/rows.h, formats in train/data.h).
 *
 * Building: the file is mapped and cut into byte ranges at line starts; each
 * worker thread tokenizes its range with its own encoder into part files
 * (tokens, row index), in file order. A worker that meets a bad row records it
 * and stops the workers after it; those before it finish, so the error
 * reported is always the first bad row of the file. The parts are then joined
 * (copy_file_range) into <key>.tokens and <key>.rows, written as .tmp, fsynced
 * and renamed — the .rows file last, as the mark of a complete cache.
 *
 * Opening: a cache whose header, key and sizes agree is mapped as it is;
 * anything else is rebuilt, never trusted. */
#include "train/mapguard.h"
#include "train/rows.h"
#include "train/safetensors.h" /* tr__mkdir_p */

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "proto/log.h"

#define CACHE_MAGIC "TDROWS1"
#define MAX_THREADS 16
#define MIN_CHUNK (1u << 20) /* bytes of JSONL a worker is worth */
#define MAX_LINE (1ull << 30)

_Static_assert(sizeof(struct tr__rowent) == 16, "the row index is 16 bytes a row");
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the token cache is written in host order, which must be little-endian"
#endif

struct header {
	char magic[8];
	uint64_t key[2];
	uint64_t nrow, ntok;
	uint64_t source_bytes;
	uint32_t kind;
	uint32_t reserved;
};

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------ */
/* The key */

static uint64_t mix(uint64_t h, uint64_t v)
{
	h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
	h ^= h >> 31;
	h *= 0xbf58476d1ce4e5b9ull;
	return h ^ (h >> 29);
}

static uint64_t mix_str(uint64_t h, const char *s)
{
	if (!s)
		return mix(h, 0x5bd1e995);
	size_t n = strlen(s);
	h = mix(h, n);
	for (size_t i = 0; i < n; i += 8) {
		uint64_t w = 0;
		memcpy(&w, s + i, n - i < 8 ? n - i : 8);
		h = mix(h, w);
	}
	return h;
}

static void cache_key(const struct tr_data_opts *o, const struct stat *st, const char *real, enum tr_rows kind,
		      uint64_t key[2])
{
	uint64_t tokd[2];
	tr_tokenizer_digest(o->tok, tokd);
	for (int k = 0; k < 2; k++) {
		uint64_t h = k ? 0x3243f6a8885a308dull : 0x452821e638d01377ull;
		h = mix(h, 2); /* the cache format and tokenization rules' version */
		h = mix_str(h, real);
		h = mix(h, (uint64_t)st->st_size);
		h = mix(h, (uint64_t)st->st_mtim.tv_sec);
		h = mix(h, (uint64_t)st->st_mtim.tv_nsec);
		h = mix(h, (uint64_t)st->st_ino);
		h = mix(h, (uint64_t)st->st_dev);
		h = mix(h, tokd[0]);
		h = mix(h, tokd[1]);
		h = mix(h, (uint64_t)kind);
		h = mix(h, (uint64_t)o->vocab);
		h = mix(h, (uint64_t)(uint32_t)o->eos_id);
		h = mix(h, (uint64_t)o->add_special_tokens << 1 | (uint64_t)o->assistant_only_loss);
		h = mix_str(h, o->text_field);
		h = mix_str(h, o->prompt_field);
		h = mix_str(h, o->completion_field);
		h = mix_str(h, o->messages_field);
		h = mix_str(h, o->label_field);
		h = mix_str(h, o->chat_template ? o->chat_template : TR_CHATML_TEMPLATE);
		h = mix(h, (uint64_t)o->num_labels);
		for (size_t i = 0; i < o->n_label_names; i++)
			h = mix_str(h, o->label_names[i]);
		key[k] = h;
	}
}

/* ------------------------------------------------------------------------ */
/* Mapping a complete cache */

void tr__cache_close(struct tr__cache *c)
{
	if (c->tok_map)
		munmap(c->tok_map, c->tok_map_len);
	if (c->row_map)
		munmap(c->row_map, c->row_map_len);
	memset(c, 0, sizeof(*c));
}

static void *map_file(const char *path, size_t *len)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return NULL;
	struct stat st;
	void *m = NULL;
	if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_size > 0) {
		m = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
		if (m == MAP_FAILED)
			m = NULL;
		else
			*len = (size_t)st.st_size;
	}
	close(fd);
	return m;
}

/* True when both files are there and agree with key, with each other and
 * with the job: the rows tile the tokens, every id is below o->vocab, every
 * class is in o's label set (classification, kind) or -1 (the other kinds).
 * The files lie in the job's output dir, which its user can write: what
 * fails any of this is rebuilt, never served (an id past the vocabulary
 * would index past the embedding, a class past the label set past the
 * classifier's logits). */
static bool cache_map(struct tr__cache *c, const struct tr_data_opts *o, enum tr_rows kind, const char *tok_path,
		      const char *row_path, const uint64_t key[2])
{
	memset(c, 0, sizeof(*c));
	c->row_map = map_file(row_path, &c->row_map_len);
	if (!c->row_map)
		return false;
	const struct header *h = c->row_map;
	/* Reading our own cache files, which should not shrink; if one does
	 * (SIGBUS), it is not a usable cache. */
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0)) {
		tr__cache_close(c);
		return false;
	}
	bool ok = c->row_map_len >= sizeof(*h) && memcmp(h->magic, CACHE_MAGIC, 8) == 0 && h->key[0] == key[0] &&
		  h->key[1] == key[1] && h->kind == (uint32_t)kind && h->nrow > 0 &&
		  (c->row_map_len - sizeof(*h)) / sizeof(struct tr__rowent) == h->nrow &&
		  (c->row_map_len - sizeof(*h)) % sizeof(struct tr__rowent) == 0;
	if (ok)
		c->tok_map = map_file(tok_path, &c->tok_map_len);
	/* ntok * 4 could wrap: compare in the other direction. */
	ok = ok && c->tok_map && c->tok_map_len % 4 == 0 && c->tok_map_len / 4 == h->ntok;
	if (ok) {
		c->row = (const struct tr__rowent *)(h + 1);
		c->nrow = h->nrow;
		c->tok = c->tok_map;
		c->ntok = h->ntok;
		uint64_t at = 0;
		bool classify = kind == TR_ROWS_CLASSIFY;
		for (uint64_t i = 0; i < c->nrow && ok; i++) {
			int32_t cls = c->row[i].cls;
			ok = c->row[i].off == at && c->row[i].len > 0 &&
			     (classify ? cls >= 0 && cls < o->num_labels : cls == -1);
			at += c->row[i].len;
		}
		ok = ok && at == c->ntok;
		for (uint64_t i = 0; i < c->ntok && ok; i++)
			ok = (c->tok[i] & ~TR__NOLOSS) < (uint32_t)o->vocab;
	}
	tr_map_guard_pop(&g);
	if (!ok) {
		tr__cache_close(c);
		return false;
	}
	c->key[0] = key[0];
	c->key[1] = key[1];
	madvise(c->tok_map, c->tok_map_len, MADV_RANDOM);
	return true;
}

/* ------------------------------------------------------------------------ */
/* Building */

struct worker {
	pthread_t th;
	int index;
	const struct tr__rowfmt *fmt;
	const char *base; /* the mapped JSONL */
	size_t begin, end;
	char tok_path[PATH_MAX], row_path[PATH_MAX];
	uint64_t ntok, nrow;
	_Atomic size_t done; /* bytes of the range read */
	atomic_bool finished; /* the fields below are then final */
	atomic_int *first_bad; /* the lowest index of a worker that failed */
	td_err err;
	size_t err_at; /* byte offset of the bad line */
	char msg[768];
};

static bool write_all(FILE *f, const void *p, size_t n)
{
	return n == 0 || fwrite(p, 1, n, f) == n;
}

static void *work(void *arg)
{
	struct worker *w = arg;
	struct tr__rowctx ctx;
	struct td_errbuf eb;
	struct tr_ids ids = { 0 };
	FILE *ft = NULL, *fr = NULL;
	char *line = NULL;
	size_t line_cap = 0;
	if ((w->err = tr__rowctx_init(&ctx, w->fmt, &eb))) {
		snprintf(w->msg, sizeof(w->msg), "%s", eb.msg);
		w->err_at = w->begin;
		goto fail;
	}
	ft = fopen(w->tok_path, "wbe");
	fr = fopen(w->row_path, "wbe");
	if (!ft || !fr) {
		w->err = td_from_errno(errno);
		snprintf(w->msg, sizeof(w->msg), "cannot write the token cache %s: %s", ft ? w->row_path : w->tok_path,
			 strerror(errno));
		w->err_at = w->begin;
		goto fail;
	}
	setvbuf(ft, NULL, _IOFBF, 1 << 20);
	size_t pos = w->begin;
	while (pos < w->end) {
		if (atomic_load_explicit(w->first_bad, memory_order_relaxed) < w->index)
			break; /* an earlier range failed: its error is the one reported */
		/* The line is copied out of the mapping (guarded: the file may
		 * shrink under us) and parsed from the copy. */
		const char *nl;
		if ((w->err = tr_map_chr(&nl, w->base + pos, '\n', w->end - pos, NULL, &eb))) {
			snprintf(w->msg, sizeof(w->msg), "%s", eb.msg);
			w->err_at = pos;
			break;
		}
		size_t len = nl ? (size_t)(nl - (w->base + pos)) : w->end - pos;
		if (len > MAX_LINE) {
			w->err = TD_EFORMAT;
			snprintf(w->msg, sizeof(w->msg), "line of %zu bytes is longer than %llu", len, MAX_LINE);
			w->err_at = pos;
			break;
		}
		if (len + 1 > line_cap) {
			size_t cap = line_cap ? line_cap : 4096;
			while (cap < len + 1)
				cap *= 2;
			char *grown = realloc(line, cap);
			if (!grown) {
				w->err = TD_ENOMEM;
				snprintf(w->msg, sizeof(w->msg), "out of memory for a line of %zu bytes", len);
				w->err_at = pos;
				break;
			}
			line = grown;
			line_cap = cap;
		}
		if ((w->err = tr_map_copy(line, w->base + pos, len, NULL, "reading", &eb))) {
			snprintf(w->msg, sizeof(w->msg), "%s", eb.msg);
			w->err_at = pos;
			break;
		}
		int32_t cls;
		bool blank;
		ids.n = 0;
		td_err e = tr__row(&ctx, line, len, &ids, &cls, &blank, w->msg, sizeof(w->msg));
		if (e) {
			w->err = e;
			w->err_at = pos;
			break;
		}
		if (!blank) {
			struct tr__rowent r = { .off = w->ntok, .len = (uint32_t)ids.n, .cls = cls };
			if (!write_all(ft, ids.v, ids.n * sizeof(int32_t)) || !write_all(fr, &r, sizeof(r))) {
				w->err = TD_EIO;
				snprintf(w->msg, sizeof(w->msg), "cannot write the token cache %s: %s", w->tok_path,
					 strerror(errno));
				w->err_at = pos;
				break;
			}
			w->ntok += ids.n;
			w->nrow++;
		}
		pos += len + (nl != NULL);
		atomic_store_explicit(&w->done, pos - w->begin, memory_order_relaxed);
	}
	if (!w->err && ((ft && fflush(ft) != 0) || (fr && fflush(fr) != 0))) {
		w->err = TD_EIO;
		snprintf(w->msg, sizeof(w->msg), "cannot write the token cache %s: %s", w->tok_path, strerror(errno));
		w->err_at = w->end;
	}
fail:
	free(line);
	if (ft)
		fclose(ft);
	if (fr)
		fclose(fr);
	tr_ids_fini(&ids);
	if (ctx.f)
		tr__rowctx_fini(&ctx);
	if (w->err) {
		int cur = atomic_load(w->first_bad);
		while (w->index < cur && !atomic_compare_exchange_weak(w->first_bad, &cur, w->index))
			;
	}
	atomic_store(&w->finished, true);
	return NULL;
}

/* Appends the whole of src to the fd dst (kernel copy where it can). */
static bool append_file(int dst, const char *src)
{
	int fd = open(src, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return false;
	struct stat st;
	bool ok = fstat(fd, &st) == 0;
	size_t left = ok ? (size_t)st.st_size : 0;
	while (ok && left) {
		ssize_t n = copy_file_range(fd, NULL, dst, NULL, left, 0);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0) { /* not supported here: copy through a buffer */
			char buf[1 << 16];
			ssize_t r = read(fd, buf, sizeof(buf));
			if (r <= 0) {
				ok = false;
				break;
			}
			for (ssize_t w = 0; w < r;) {
				ssize_t k = write(dst, buf + w, (size_t)(r - w));
				if (k < 0 && errno == EINTR)
					continue;
				if (k <= 0) {
					ok = false;
					break;
				}
				w += k;
			}
			left -= (size_t)r;
			continue;
		}
		left -= (size_t)n;
	}
	close(fd);
	return ok;
}

static void fsync_path(const char *path, int flags)
{
	int fd = open(path, flags | O_CLOEXEC);
	if (fd >= 0) {
		fsync(fd);
		close(fd);
	}
}

/* Joins the parts into tok_path and row_path (through .tmp and rename). */
static td_err join_parts(struct worker *w, int n, const char *tok_path, const char *row_path, const uint64_t key[2],
			 enum tr_rows kind, size_t source_bytes, const char *dir, struct td_errbuf *eb)
{
	char tok_tmp[PATH_MAX + 8], row_tmp[PATH_MAX + 8];
	snprintf(tok_tmp, sizeof(tok_tmp), "%s.tmp", tok_path);
	snprintf(row_tmp, sizeof(row_tmp), "%s.tmp", row_path);
	td_err e = TD_OK;
	int ft = -1;
	FILE *fr = NULL;
	if (n == 1) { /* one part: it is the token file */
		if (rename(w[0].tok_path, tok_tmp) != 0)
			e = td_fail(eb, td_from_errno(errno), "%s: cannot rename: %s", tok_tmp, strerror(errno));
	} else {
		ft = open(tok_tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
		if (ft < 0)
			e = td_fail(eb, td_from_errno(errno), "%s: cannot create: %s", tok_tmp, strerror(errno));
		for (int i = 0; i < n && !e; i++)
			if (!append_file(ft, w[i].tok_path))
				e = td_fail(eb, TD_EIO, "%s: cannot write: %s", tok_tmp, strerror(errno));
		if (ft >= 0 && !e && fsync(ft) != 0)
			e = td_fail(eb, TD_EIO, "%s: cannot write: %s", tok_tmp, strerror(errno));
		if (ft >= 0)
			close(ft);
	}
	if (!e && n == 1)
		fsync_path(tok_tmp, O_RDONLY);
	struct header h = { .magic = CACHE_MAGIC, .key = { key[0], key[1] }, .source_bytes = source_bytes,
			    .kind = (uint32_t)kind };
	for (int i = 0; i < n; i++) {
		h.nrow += w[i].nrow;
		h.ntok += w[i].ntok;
	}
	if (!e && !(fr = fopen(row_tmp, "wbe")))
		e = td_fail(eb, td_from_errno(errno), "%s: cannot create: %s", row_tmp, strerror(errno));
	if (!e && !write_all(fr, &h, sizeof(h)))
		e = td_fail(eb, TD_EIO, "%s: cannot write: %s", row_tmp, strerror(errno));
	uint64_t base = 0;
	for (int i = 0; i < n && !e; i++) {
		FILE *in = fopen(w[i].row_path, "rbe");
		if (!in) {
			e = td_fail(eb, TD_EIO, "%s: cannot read: %s", w[i].row_path, strerror(errno));
			break;
		}
		struct tr__rowent r[1024];
		size_t k;
		while (!e && (k = fread(r, sizeof(r[0]), 1024, in)) > 0) {
			for (size_t j = 0; j < k; j++)
				r[j].off += base;
			if (!write_all(fr, r, k * sizeof(r[0])))
				e = td_fail(eb, TD_EIO, "%s: cannot write: %s", row_tmp, strerror(errno));
		}
		fclose(in);
		base += w[i].ntok;
	}
	if (fr) {
		if (!e && (fflush(fr) != 0 || fsync(fileno(fr)) != 0))
			e = td_fail(eb, TD_EIO, "%s: cannot write: %s", row_tmp, strerror(errno));
		fclose(fr);
	}
	if (!e && rename(tok_tmp, tok_path) != 0)
		e = td_fail(eb, td_from_errno(errno), "%s: cannot rename: %s", tok_path, strerror(errno));
	if (!e && rename(row_tmp, row_path) != 0)
		e = td_fail(eb, td_from_errno(errno), "%s: cannot rename: %s", row_path, strerror(errno));
	if (!e)
		fsync_path(dir, O_RDONLY | O_DIRECTORY);
	unlink(tok_tmp);
	unlink(row_tmp);
	return e;
}

/* The 1-based line number of byte offset at. */
/* The 1-based line of byte at; 0 when the file shrank under us. */
static uint64_t line_of(const char *base, size_t at)
{
	struct td_errbuf eb;
	uint64_t line = 1;
	const char *p = base, *end = base + at;
	while (p < end) {
		if (tr_map_chr(&p, p, '\n', (size_t)(end - p), NULL, &eb) != TD_OK)
			return 0;
		if (!p)
			break;
		line++;
		p++;
	}
	return line;
}

/* The first line of the mapping that is not blank (spaces, tabs, CR): its
 * start and length; *at = size when there is none. Guarded: the file may
 * shrink under us. */
static td_err first_row(const char *base, size_t size, const char *path, size_t *at, size_t *len,
			struct td_errbuf *eb)
{
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0))
		return tr_map_fail(eb, path, "reading");
	*at = size;
	*len = 0;
	for (size_t pos = 0; pos < size;) {
		const char *nl = memchr(base + pos, '\n', size - pos);
		size_t n = nl ? (size_t)(nl - base) - pos : size - pos;
		bool blank = true;
		for (size_t i = 0; i < n && blank; i++)
			blank = base[pos + i] == ' ' || base[pos + i] == '\t' || base[pos + i] == '\r';
		if (!blank) {
			*at = pos;
			*len = n;
			break;
		}
		pos += n + 1;
	}
	tr_map_guard_pop(&g);
	return TD_OK;
}

static int auto_threads(size_t bytes)
{
	long cpus = sysconf(_SC_NPROCESSORS_ONLN);
	size_t by_size = bytes / MIN_CHUNK + 1;
	long n = cpus < 4 ? cpus : 4;
	if ((size_t)n > by_size)
		n = (long)by_size;
	return n < 1 ? 1 : (int)n;
}

static td_err build(struct tr__cache *c, const struct tr_data_opts *o, struct tr__rowfmt *fmt, const char *base,
		    size_t size, const uint64_t key[2], const char *tok_path, const char *row_path,
		    struct td_errbuf *eb)
{
	int n = o->threads > 0 ? o->threads : auto_threads(size);
	if (n > MAX_THREADS)
		n = MAX_THREADS;
	if ((size_t)n > size)
		n = 1;
	struct worker *w = calloc((size_t)n, sizeof(*w));
	if (!w)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", o->path);
	atomic_int first_bad = n;
	size_t at = 0;
	for (int i = 0; i < n; i++) {
		w[i].index = i;
		w[i].fmt = fmt;
		w[i].base = base;
		w[i].first_bad = &first_bad;
		w[i].begin = at;
		size_t end = i + 1 == n ? size : size / (size_t)n * (size_t)(i + 1);
		if (end < at)
			end = at;
		const char *nl = NULL;
		if (end < size && tr_map_chr(&nl, base + end, '\n', size - end, o->path, eb) != TD_OK) {
			free(w);
			return TD_EIO;
		}
		end = i + 1 == n ? size : nl ? (size_t)(nl - base) + 1 : size;
		w[i].end = end;
		at = end;
		snprintf(w[i].tok_path, sizeof(w[i].tok_path), "%s.%d.%d.part", tok_path, (int)getpid(), i);
		snprintf(w[i].row_path, sizeof(w[i].row_path), "%s.%d.%d.part", row_path, (int)getpid(), i);
	}
	if (o->log)
		fprintf(o->log, "data: tokenizing %s (%.1f MB) on %d thread%s\n", o->path, (double)size / 1e6, n,
			n == 1 ? "" : "s");
	double t0 = now_s(), last = t0;
	int started = 0;
	td_err e = TD_OK;
	for (; started < n; started++)
		if (pthread_create(&w[started].th, NULL, work, &w[started]) != 0) {
			e = td_fail(eb, TD_ENOMEM, "%s: cannot start a tokenizing thread", o->path);
			atomic_store(&first_bad, -1);
			break;
		}
	/* Progress while they work: polled, so that no worker waits on us. */
	long nap = 1000 * 1000; /* 1 ms, doubling to 100 ms: small files are not made to wait */
	for (bool running = started > 0; running;) {
		struct timespec ts = { 0, nap };
		nanosleep(&ts, NULL);
		nap = nap * 2 > 100 * 1000 * 1000 ? 100 * 1000 * 1000 : nap * 2;
		size_t done = 0;
		running = false;
		for (int i = 0; i < started; i++) {
			done += atomic_load_explicit(&w[i].done, memory_order_relaxed);
			running |= !atomic_load(&w[i].finished);
		}
		if (atomic_load(&first_bad) < n)
			running = false; /* joined below; the workers stop by themselves */
		double t = now_s();
		if (o->log && running && t - last >= 10.0) {
			fprintf(o->log, "data: %s: %.0f%% (%.1f MB/s)\n", o->path, 100.0 * (double)done / (double)size,
				(double)done / 1e6 / (t - t0));
			last = t;
		}
	}
	for (int i = 0; i < started; i++)
		pthread_join(w[i].th, NULL);
	double secs = now_s() - t0;
	int bad = atomic_load(&first_bad);
	if (!e && bad >= 0 && bad < n) {
		const struct worker *b = &w[bad];
		uint64_t line = line_of(base, b->err_at);
		if (line)
			e = td_fail(eb, b->err, "%s:%llu: %s", o->path, (unsigned long long)line, b->msg);
		else /* the file shrank under us */
			e = td_fail(eb, b->err, "%s: %s", o->path, b->msg);
	}
	uint64_t nrow = 0, ntok = 0;
	for (int i = 0; i < n; i++) {
		nrow += w[i].nrow;
		ntok += w[i].ntok;
	}
	if (!e && nrow == 0)
		e = td_fail(eb, TD_EINVAL, "%s: empty: no rows (the file has only blank lines)", o->path);
	if (!e) {
		char dir[PATH_MAX];
		snprintf(dir, sizeof(dir), "%s", o->cache_dir);
		e = join_parts(w, n, tok_path, row_path, key, fmt->kind, size, dir, eb);
	}
	for (int i = 0; i < n; i++) {
		unlink(w[i].tok_path);
		unlink(w[i].row_path);
	}
	free(w);
	if (e)
		return e;
	if (!cache_map(c, o, fmt->kind, tok_path, row_path, key))
		return td_fail(eb, TD_EIO, "%s: the token cache just written does not read back", row_path);
	double mbs = (double)size / 1e6 / (secs > 0 ? secs : 1e-9);
	if (o->log)
		fprintf(o->log, "data: %s: %llu rows, %llu tokens in %.2f s (%.1f MB/s, %d thread%s) -> %s\n", o->path,
			(unsigned long long)nrow, (unsigned long long)ntok, secs, mbs, n, n == 1 ? "" : "s", tok_path);
	td_info("TD-DATA-TOKENIZED", "%s: %llu rows, %llu tokens in %.2f s (%.1f MB/s, %d threads) -> %s", o->path,
		(unsigned long long)nrow, (unsigned long long)ntok, secs, mbs, n, tok_path);
	return TD_OK;
}

td_err tr__cache_open(struct tr__cache *c, const struct tr_data_opts *o, struct td_errbuf *eb)
{
	memset(c, 0, sizeof(*c));
	if (!o->tok)
		return td_fail(eb, TD_EINVAL, "%s: JSONL needs a tokenizer", o->path);
	if (!o->cache_dir)
		return td_fail(eb, TD_EINVAL, "%s: JSONL needs a directory for its token cache", o->path);
	int fd = open(o->path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "%s: cannot open: %s", o->path, strerror(errno));
	struct stat st;
	if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return td_fail(eb, TD_EFORMAT, "%s: not a regular file", o->path);
	}
	if (st.st_size == 0) {
		close(fd);
		return td_fail(eb, TD_EINVAL, "%s: empty: no rows", o->path);
	}
	size_t size = (size_t)st.st_size;
	const char *base = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
	close(fd);
	if (base == MAP_FAILED)
		return td_fail(eb, TD_EIO, "%s: cannot map: %s", o->path, strerror(errno));
	madvise((void *)base, size, MADV_SEQUENTIAL);

	struct tr__rowfmt fmt;
	td_err e = tr__rowfmt_init(&fmt, o, eb);
	if (e) {
		munmap((void *)base, size);
		return e;
	}
	/* The kind of an AUTO dataset comes from its first row, before the key. */
	if (fmt.kind == TR_ROWS_AUTO) {
		size_t pos, len;
		if ((e = first_row(base, size, o->path, &pos, &len, eb)) == TD_OK && pos == size)
			e = td_fail(eb, TD_EINVAL, "%s: empty: no rows (the file has only blank lines)", o->path);
		char *row = NULL;
		if (e == TD_OK && len > MAX_LINE)
			e = td_fail(eb, TD_EFORMAT, "%s:%llu: line of %zu bytes is longer than %llu", o->path,
				    (unsigned long long)line_of(base, pos), len, MAX_LINE);
		if (e == TD_OK && !(row = malloc(len + 1)))
			e = td_fail(eb, TD_ENOMEM, "%s: out of memory", o->path);
		if (e == TD_OK)
			e = tr_map_copy(row, base + pos, len, o->path, "reading", eb);
		if (e == TD_OK) {
			char msg[512];
			if ((e = tr__rowfmt_detect(&fmt, row, len, msg, sizeof(msg))))
				e = td_fail(eb, e, "%s:%llu: %s", o->path, (unsigned long long)line_of(base, pos), msg);
		}
		free(row);
	}
	char real[PATH_MAX], tok_path[PATH_MAX], row_path[PATH_MAX];
	uint64_t key[2];
	if (!e) {
		if (!realpath(o->path, real))
			snprintf(real, sizeof(real), "%s", o->path);
		cache_key(o, &st, real, fmt.kind, key);
		snprintf(tok_path, sizeof(tok_path), "%s/%016llx%016llx.tokens", o->cache_dir, (unsigned long long)key[0],
			 (unsigned long long)key[1]);
		snprintf(row_path, sizeof(row_path), "%s/%016llx%016llx.rows", o->cache_dir, (unsigned long long)key[0],
			 (unsigned long long)key[1]);
		if (cache_map(c, o, fmt.kind, tok_path, row_path, key)) {
			if (o->log)
				fprintf(o->log, "data: %s: token cache %s (%llu rows, %llu tokens)\n", o->path, tok_path,
					(unsigned long long)c->nrow, (unsigned long long)c->ntok);
		} else {
			e = tr__mkdir_p(o->cache_dir, eb);
			if (!e)
				e = build(c, o, &fmt, base, size, key, tok_path, row_path, eb);
		}
	}
	tr__rowfmt_fini(&fmt);
	munmap((void *)base, size);
	return e;
}
