/* safetensors: the validating mmap reader, the atomic writer, the fp16/bf16
 * conversions, and the small file helpers (tr__) the other model I/O files share.
 *
 * The reader trusts nothing in the file: every length and offset is checked
 * before it is used, and tensor data is only ever read with memcpy because the
 * format does not promise alignment. It is not a model loader (train/modeldir.c)
 * and it does not convert on open: callers convert with tr_st_to_f32/_i32. */
#include "train/safetensors.h"

#include "train/mapguard.h"

#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <json-c/json.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; this code loads it as host order"
#endif

/* The reference implementation's limit: a bigger header is an attack, not a model. */
#define ST_MAX_HEADER 100000000u

static const struct {
	const char *name;
	size_t size;
} dtypes[TR_DT_COUNT_] = {
	[TR_DT_F32] = {"F32", 4}, [TR_DT_F16] = {"F16", 2}, [TR_DT_BF16] = {"BF16", 2},
	[TR_DT_F64] = {"F64", 8}, [TR_DT_I64] = {"I64", 8}, [TR_DT_I32] = {"I32", 4},
	[TR_DT_I16] = {"I16", 2}, [TR_DT_I8] = {"I8", 1},   [TR_DT_U8] = {"U8", 1},
	[TR_DT_BOOL] = {"BOOL", 1},
};

const char *tr_dtype_name(enum tr_dtype dt)
{
	return (unsigned)dt < TR_DT_COUNT_ ? dtypes[dt].name : NULL;
}

size_t tr_dtype_size(enum tr_dtype dt)
{
	return (unsigned)dt < TR_DT_COUNT_ ? dtypes[dt].size : 0;
}

int tr_dtype_parse(const char *name, enum tr_dtype *out)
{
	for (int i = 0; i < TR_DT_COUNT_; i++) {
		if (strcmp(name, dtypes[i].name) == 0) {
			*out = (enum tr_dtype)i;
			return 0;
		}
	}
	return -1;
}

/* ---- conversions ---- */

uint16_t tr_f32_to_bf16(float x)
{
	uint32_t u;
	memcpy(&u, &x, 4);
	if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep it a (quiet) NaN, rounding could make it Inf */
		return (uint16_t)((u >> 16) | 0x0040u);
	u += 0x7fffu + ((u >> 16) & 1u); /* ties to even; overflow carries into Inf as it should */
	return (uint16_t)(u >> 16);
}

uint16_t tr_f32_to_f16(float x)
{
	uint32_t u;
	memcpy(&u, &x, 4);
	uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
	uint32_t a = u & 0x7fffffffu;
	if (a > 0x7f800000u) /* NaN: quiet, keeping the top payload bits */
		return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu);
	if (a >= 0x477ff000u) /* >= 65520, halfway past the largest f16 (65504): Inf */
		return sign | 0x7c00u;
	if (a >= 0x38800000u) { /* >= 2^-14: normal; rebias the exponent from 127 to 15 */
		a -= 0x38000000u;
		a += 0xfffu + ((a >> 13) & 1u);
		return sign | (uint16_t)(a >> 13);
	}
	if (a <= 0x33000000u) /* <= 2^-25, half the smallest subnormal: the tie goes to 0 */
		return sign;
	/* Subnormal: the value in units of 2^-24 is m >> (126 - e), rounded to even. */
	uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u;
	uint32_t shift = 126 - e; /* 14..24 */
	uint32_t r = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
	if (rem > half || (rem == half && (r & 1u)))
		r++;
	return sign | (uint16_t)r;
}

float tr_bf16_to_f32(uint16_t x)
{
	uint32_t u = (uint32_t)x << 16;
	float f;
	memcpy(&f, &u, 4);
	return f;
}

float tr_f16_to_f32(uint16_t x)
{
	uint32_t sign = (uint32_t)(x & 0x8000u) << 16, e = (x >> 10) & 0x1fu, m = x & 0x3ffu, u;
	if (e == 0x1f)
		u = sign | 0x7f800000u | (m << 13);
	else if (e)
		u = sign | ((e + 112) << 23) | (m << 13);
	else {
		float f = (float)m * 0x1p-24f; /* subnormal (or zero): exact */
		return sign ? -f : f;
	}
	float f;
	memcpy(&f, &u, 4);
	return f;
}

static td_err to_f32_(void *out, const struct tr_st_tensor *t, struct td_errbuf *eb)
{
	float *dst = out;
	const unsigned char *p = t->data;
	size_t n = (size_t)t->numel;
	assert(n * tr_dtype_size(t->dtype) == t->nbytes);
	switch (t->dtype) {
	case TR_DT_F32:
		if (n)
			memcpy(dst, p, n * 4);
		return TD_OK;
	case TR_DT_F16:
	case TR_DT_BF16:
		for (size_t i = 0; i < n; i++) {
			uint16_t h;
			memcpy(&h, p + 2 * i, 2);
			dst[i] = t->dtype == TR_DT_F16 ? tr_f16_to_f32(h) : tr_bf16_to_f32(h);
		}
		return TD_OK;
	case TR_DT_F64:
		for (size_t i = 0; i < n; i++) {
			double d;
			memcpy(&d, p + 8 * i, 8);
			dst[i] = (float)d;
		}
		return TD_OK;
	default:
		return td_fail(eb, TD_EUNSUPPORTED, "tensor '%s': dtype %s is not a float type",
			       t->name, tr_dtype_name(t->dtype));
	}
}

static td_err to_i32_(void *out, const struct tr_st_tensor *t, struct td_errbuf *eb)
{
	int32_t *dst = out;
	const unsigned char *p = t->data;
	size_t n = (size_t)t->numel;
	assert(n * tr_dtype_size(t->dtype) == t->nbytes);
	switch (t->dtype) {
	case TR_DT_I32:
		if (n)
			memcpy(dst, p, n * 4);
		return TD_OK;
	case TR_DT_I64:
		for (size_t i = 0; i < n; i++) {
			int64_t v;
			memcpy(&v, p + 8 * i, 8);
			if (v < INT32_MIN || v > INT32_MAX)
				return td_fail(eb, TD_ERANGE, "tensor '%s': element %zu = %lld does not fit in int32",
					       t->name, i, (long long)v);
			dst[i] = (int32_t)v;
		}
		return TD_OK;
	case TR_DT_I16:
		for (size_t i = 0; i < n; i++) {
			int16_t v;
			memcpy(&v, p + 2 * i, 2);
			dst[i] = v;
		}
		return TD_OK;
	case TR_DT_I8:
		for (size_t i = 0; i < n; i++)
			dst[i] = (int8_t)p[i];
		return TD_OK;
	case TR_DT_U8:
	case TR_DT_BOOL:
		for (size_t i = 0; i < n; i++)
			dst[i] = p[i];
		return TD_OK;
	default:
		return td_fail(eb, TD_EUNSUPPORTED, "tensor '%s': dtype %s is not an integer type",
			       t->name, tr_dtype_name(t->dtype));
	}
}

/* The conversions read the mapping: a file cut short under us (SIGBUS) is
 * this tensor's error, not the daemon's death (train/mapguard.h). */
static td_err map_fail(const struct tr_st_tensor *t, struct td_errbuf *eb)
{
	char what[320];
	snprintf(what, sizeof(what), "tensor '%s'", t->name);
	return tr_map_fail(eb, t->path ? t->path : "safetensors file", what);
}

/* fn(dst, t, eb) with reads of the mapping guarded. */
static td_err convert(td_err (*fn)(void *, const struct tr_st_tensor *, struct td_errbuf *),
		      void *dst, const struct tr_st_tensor *t, struct td_errbuf *eb)
{
	struct tr_map_guard g;
	tr_map_guard_push(&g);
	if (sigsetjmp(g.jb, 0))
		return map_fail(t, eb);
	td_err e = fn(dst, t, eb);
	tr_map_guard_pop(&g);
	return e;
}

td_err tr_st_to_f32(float *dst, const struct tr_st_tensor *t, struct td_errbuf *eb)
{
	return convert(to_f32_, dst, t, eb);
}

td_err tr_st_to_i32(int32_t *dst, const struct tr_st_tensor *t, struct td_errbuf *eb)
{
	return convert(to_i32_, dst, t, eb);
}

/* ---- file helpers ---- */

td_err tr__errno_fail(struct td_errbuf *eb, int errnum, const char *path, const char *what)
{
	char buf[128];
	return td_fail(eb, td_from_errno(errnum), "%s: %s: %s", path, what,
		       strerror_r(errnum, buf, sizeof(buf)));
}

td_err tr__json_read_file(struct json_object **out, const char *path, size_t max,
			  struct td_errbuf *eb)
{
	char *text;
	size_t len;
	td_err e = tr__read_file(path, max, &text, &len, eb);
	if (e != TD_OK)
		return e;
	e = tr__json_parse(out, text, len, path, eb);
	free(text);
	return e;
}

td_err tr__json_parse(struct json_object **out, const char *text, size_t len, const char *origin,
		      struct td_errbuf *eb)
{
	if (len > INT_MAX - 1)
		return td_fail(eb, TD_EFORMAT, "%s: not valid JSON: %zu bytes is too long", origin, len);
	if (memchr(text, '\0', len))
		return td_fail(eb, TD_EFORMAT, "%s: not valid JSON: it contains a NUL byte", origin);
	json_tokener *tok = json_tokener_new();
	if (!tok)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory parsing JSON", origin);
	json_tokener_set_flags(tok, JSON_TOKENER_STRICT | JSON_TOKENER_VALIDATE_UTF8);
	/* Passing the NUL too ends a bare top-level value and refuses trailing junk. */
	json_object *root = json_tokener_parse_ex(tok, text, (int)len + 1);
	enum json_tokener_error jerr = json_tokener_get_error(tok);
	size_t end = json_tokener_get_parse_end(tok);
	json_tokener_free(tok);
	if (jerr != json_tokener_success) {
		json_object_put(root);
		return td_fail(eb, TD_EFORMAT, "%s: not valid JSON: %s at byte %zu", origin,
			       json_tokener_error_desc(jerr), end);
	}
	*out = root;
	return TD_OK;
}

json_object *tr__json_put(json_object *o, const char *key, json_object *v)
{
	if (v && json_object_object_add(o, key, v) == 0)
		return v;
	json_object_put(v);
	return NULL;
}

json_object *tr__json_push(json_object *a, json_object *v)
{
	if (v && json_object_array_add(a, v) == 0)
		return v;
	json_object_put(v);
	return NULL;
}

static bool write_all(int fd, const void *data, size_t len)
{
	const char *p = data;
	while (len) {
		/* Linux writes at most ~2 GiB per call; ask for less and loop. */
		ssize_t w = write(fd, p, len < (1u << 30) ? len : (1u << 30));
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return false;
		}
		p += w;
		len -= (size_t)w;
	}
	return true;
}

/* Makes the rename durable. A filesystem that cannot fsync a directory says
 * EINVAL; the rename is as durable as it can make it, so that is no failure. */
static td_err fsync_dir_of(const char *path, struct td_errbuf *eb)
{
	char dir[PATH_MAX];
	const char *slash = strrchr(path, '/');
	if (!slash)
		strcpy(dir, ".");
	else if (slash == path)
		strcpy(dir, "/");
	else if ((size_t)(slash - path) < sizeof(dir))
		snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
	else
		return td_fail(eb, TD_EINVAL, "%s: path too long", path);
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd < 0)
		return tr__errno_fail(eb, errno, dir, "open");
	if (fsync(fd) < 0 && errno != EINVAL) {
		int e = errno;
		close(fd);
		return tr__errno_fail(eb, e, dir, "fsync");
	}
	close(fd);
	return TD_OK;
}

td_err tr__write_atomic(const char *path, const struct tr__chunk *chunks, size_t n,
			struct td_errbuf *eb)
{
	char tmp[PATH_MAX];
	if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp))
		return td_fail(eb, TD_EINVAL, "%s: path too long", path);
	int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return tr__errno_fail(eb, errno, tmp, "open");
	const char *what = "write";
	for (size_t i = 0; i < n; i++)
		if (chunks[i].len && !write_all(fd, chunks[i].data, chunks[i].len))
			goto fail;
	what = "fsync";
	if (fsync(fd) < 0)
		goto fail;
	what = "close";
	int rc = close(fd);
	fd = -1;
	if (rc < 0)
		goto fail;
	what = "rename";
	if (rename(tmp, path) < 0)
		goto fail;
	return fsync_dir_of(path, eb);
fail:;
	int e = errno;
	if (fd >= 0)
		close(fd);
	unlink(tmp);
	return tr__errno_fail(eb, e, tmp, what);
}

td_err tr__read_file(const char *path, size_t max, char **out, size_t *len, struct td_errbuf *eb)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return tr__errno_fail(eb, errno, path, "open");
	struct stat st;
	td_err err = TD_OK;
	char *buf = NULL;
	if (fstat(fd, &st) < 0) {
		err = tr__errno_fail(eb, errno, path, "stat");
		goto out;
	}
	if (!S_ISREG(st.st_mode)) {
		err = td_fail(eb, TD_EFORMAT, "%s: not a regular file", path);
		goto out;
	}
	if ((uint64_t)st.st_size > max) {
		err = td_fail(eb, TD_EFORMAT, "%s: %lld bytes, more than the %zu this file may have",
			      path, (long long)st.st_size, max);
		goto out;
	}
	size_t size = (size_t)st.st_size, got = 0;
	buf = malloc(size + 1);
	if (!buf) {
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory reading %zu bytes", path, size);
		goto out;
	}
	while (got < size) {
		ssize_t r = read(fd, buf + got, size - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			err = tr__errno_fail(eb, errno, path, "read");
			goto out;
		}
		if (r == 0) /* shrank under us: take what is there */
			break;
		got += (size_t)r;
	}
	buf[got] = '\0';
	*out = buf;
	*len = got;
	buf = NULL;
out:
	free(buf);
	close(fd);
	return err;
}

/* ---- reader ---- */

struct tr_st_file {
	char *path;
	void *map;
	size_t map_len;
	size_t count;
	struct tr_st_tensor *tensors;        /* header order */
	const struct tr_st_tensor **by_name; /* sorted by name, for tr_st_find */
	size_t nmeta;
	const char **meta; /* key, value, key, value, ... */
};

/* Everything above lives in the one allocation that holds the struct. */
static_assert(sizeof(struct tr_st_file) % _Alignof(struct tr_st_tensor) == 0, "layout");
static_assert(sizeof(struct tr_st_tensor) % _Alignof(void *) == 0, "layout");

static int cmp_name(const void *a, const void *b)
{
	const struct tr_st_tensor *x = *(const struct tr_st_tensor *const *)a;
	const struct tr_st_tensor *y = *(const struct tr_st_tensor *const *)b;
	return strcmp(x->name, y->name);
}

/* By position in the data section, then by size, so that an empty tensor sorts
 * before a non-empty one at the same offset. */
static int cmp_offset(const void *a, const void *b)
{
	const struct tr_st_tensor *x = *(const struct tr_st_tensor *const *)a;
	const struct tr_st_tensor *y = *(const struct tr_st_tensor *const *)b;
	const char *px = x->data, *py = y->data;
	if (px != py)
		return px < py ? -1 : 1;
	return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

static void fmt_shape(char *buf, size_t size, const int64_t *shape, int ndim)
{
	size_t at = (size_t)snprintf(buf, size, "[");
	for (int i = 0; i < ndim && at < size; i++)
		at += (size_t)snprintf(buf + at, size - at, "%s%lld", i ? ", " : "", (long long)shape[i]);
	if (at < size)
		snprintf(buf + at, size - at, "]");
}

/* Fills t from one header entry; base/data_len describe the data section. */
static td_err parse_tensor(struct tr_st_tensor *t, const char *path, const char *name,
			   json_object *v, const unsigned char *base, size_t data_len,
			   struct td_errbuf *eb)
{
	json_object *dt, *shape, *offs;
	if (!json_object_is_type(v, json_type_object))
		return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': entry is a JSON %s, not an object",
			       path, name, json_type_to_name(json_object_get_type(v)));
	if (!json_object_object_get_ex(v, "dtype", &dt) || !json_object_is_type(dt, json_type_string))
		return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': \"dtype\" missing or not a string", path, name);
	if (tr_dtype_parse(json_object_get_string(dt), &t->dtype) < 0)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: tensor '%s': unknown dtype '%s'", path, name,
			       json_object_get_string(dt));

	if (!json_object_object_get_ex(v, "shape", &shape) || !json_object_is_type(shape, json_type_array))
		return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': \"shape\" missing or not an array", path, name);
	size_t ndim = json_object_array_length(shape);
	if (ndim > TR_ST_MAX_DIMS)
		return td_fail(eb, TD_EUNSUPPORTED, "%s: tensor '%s': shape has %zu dims, more than %d",
			       path, name, ndim, TR_ST_MAX_DIMS);
	t->ndim = (int)ndim;
	int64_t numel = 1;
	bool overflow = false;
	for (size_t i = 0; i < ndim; i++) {
		json_object *d = json_object_array_get_idx(shape, i);
		if (!json_object_is_type(d, json_type_int))
			return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': shape[%zu] is not an integer",
				       path, name, i);
		t->shape[i] = json_object_get_int64(d);
		if (t->shape[i] < 0)
			return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': shape[%zu] is negative (%lld)",
				       path, name, i, (long long)t->shape[i]);
		overflow |= __builtin_mul_overflow(numel, t->shape[i], &numel);
	}
	size_t nbytes;
	char sh[200];
	fmt_shape(sh, sizeof(sh), t->shape, t->ndim);
	if (overflow || __builtin_mul_overflow((uint64_t)numel, tr_dtype_size(t->dtype), &nbytes))
		return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': shape %s overflows", path, name, sh);
	t->numel = numel;

	json_object *jb, *je;
	if (!json_object_object_get_ex(v, "data_offsets", &offs) ||
	    !json_object_is_type(offs, json_type_array) || json_object_array_length(offs) != 2 ||
	    !json_object_is_type(jb = json_object_array_get_idx(offs, 0), json_type_int) ||
	    !json_object_is_type(je = json_object_array_get_idx(offs, 1), json_type_int) ||
	    json_object_get_int64(jb) < 0 || json_object_get_int64(je) < 0)
		return td_fail(eb, TD_EFORMAT,
			       "%s: tensor '%s': \"data_offsets\" is not two non-negative integers", path, name);
	uint64_t begin = (uint64_t)json_object_get_int64(jb), end = (uint64_t)json_object_get_int64(je);
	if (end < begin)
		return td_fail(eb, TD_EFORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before begin",
			       path, name, (unsigned long long)begin, (unsigned long long)end);
	if (end > data_len)
		return td_fail(eb, TD_EFORMAT,
			       "%s: tensor '%s': data_offsets [%llu, %llu] exceed the data section (%zu bytes)",
			       path, name, (unsigned long long)begin, (unsigned long long)end, data_len);
	if (end - begin != nbytes)
		return td_fail(eb, TD_EFORMAT,
			       "%s: tensor '%s': size mismatch: data_offsets [%llu, %llu] hold %llu bytes, "
			       "%s %s needs %zu",
			       path, name, (unsigned long long)begin, (unsigned long long)end,
			       (unsigned long long)(end - begin), tr_dtype_name(t->dtype), sh, nbytes);
	t->data = base + begin;
	t->nbytes = nbytes;
	return TD_OK;
}

static td_err check_metadata(const char *path, json_object *meta, size_t *count, size_t *strbytes,
			     struct td_errbuf *eb)
{
	if (!json_object_is_type(meta, json_type_object))
		return td_fail(eb, TD_EFORMAT, "%s: __metadata__ is a JSON %s, not an object", path,
			       json_type_to_name(json_object_get_type(meta)));
	json_object_object_foreach(meta, k, v) {
		if (!json_object_is_type(v, json_type_string))
			return td_fail(eb, TD_EFORMAT, "%s: __metadata__ key '%s' is not a string", path, k);
		*count += 1;
		*strbytes += strlen(k) + 1 + (size_t)json_object_get_string_len(v) + 1;
	}
	return TD_OK;
}

/* Parses and checks the header, then builds f in one allocation. */
static td_err parse_header(struct tr_st_file **out, const char *path, const unsigned char *map,
			   size_t size, struct td_errbuf *eb)
{
	uint64_t hlen;
	td_err e = tr_map_copy(&hlen, map, 8, path, "header", eb);
	if (e != TD_OK)
		return e;
	if (hlen > size - 8)
		return td_fail(eb, TD_EFORMAT, "%s: header length %llu exceeds the file size (%zu bytes)",
			       path, (unsigned long long)hlen, size);
	if (hlen > ST_MAX_HEADER)
		return td_fail(eb, TD_EFORMAT, "%s: header length %llu exceeds the limit of %u bytes",
			       path, (unsigned long long)hlen, ST_MAX_HEADER);
	/* json-c wants the NUL after the text; the map has none. */
	char *text = malloc(hlen + 1), origin[PATH_MAX + 16];
	if (!text)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory for the header", path);
	if ((e = tr_map_copy(text, map + 8, hlen, path, "header", eb)) != TD_OK) {
		free(text);
		return e;
	}
	text[hlen] = '\0';
	snprintf(origin, sizeof(origin), "%s: header", path);
	json_object *root = NULL;
	struct tr_st_file *f = NULL;
	td_err err = tr__json_parse(&root, text, hlen, origin, eb);
	free(text);
	if (err)
		return err;
	if (!json_object_is_type(root, json_type_object)) {
		err = td_fail(eb, TD_EFORMAT, "%s: header is a JSON %s, not an object", path,
			      json_type_to_name(json_object_get_type(root)));
		goto out;
	}

	/* Pass 1: count, size the strings, check the metadata. */
	size_t nt = 0, nm = 0, strbytes = strlen(path) + 1;
	json_object *meta = NULL;
	json_object_object_foreach(root, key, val) {
		if (strcmp(key, "__metadata__") == 0) {
			meta = val;
			if ((err = check_metadata(path, val, &nm, &strbytes, eb)))
				goto out;
		} else {
			nt++;
			strbytes += strlen(key) + 1;
		}
	}

	size_t bytes = sizeof(*f) + nt * sizeof(*f->tensors) + nt * sizeof(*f->by_name) +
		       2 * nm * sizeof(*f->meta) + strbytes;
	f = calloc(1, bytes);
	if (!f) {
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory for %zu tensors", path, nt);
		goto out;
	}
	f->tensors = (struct tr_st_tensor *)(f + 1);
	f->by_name = (const struct tr_st_tensor **)(f->tensors + nt);
	f->meta = (const char **)(f->by_name + nt);
	char *s = (char *)(f->meta + 2 * nm);
#define COPY_STR(dst, src)                        \
	do {                                      \
		size_t l_ = strlen(src) + 1;      \
		memcpy(s, (src), l_);             \
		(dst) = s;                        \
		s += l_;                          \
	} while (0)
	COPY_STR(f->path, path);
	if (meta) {
		json_object_object_foreach(meta, k, v) {
			COPY_STR(f->meta[2 * f->nmeta], k);
			COPY_STR(f->meta[2 * f->nmeta + 1], json_object_get_string(v));
			f->nmeta++;
		}
	}

	/* Pass 2: the tensors, in header order. */
	const unsigned char *base = map + 8 + hlen;
	size_t data_len = size - 8 - (size_t)hlen;
	json_object_object_foreach(root, name, v) {
		if (strcmp(name, "__metadata__") == 0)
			continue;
		struct tr_st_tensor *t = &f->tensors[f->count];
		if ((err = parse_tensor(t, path, name, v, base, data_len, eb)))
			goto out;
		COPY_STR(t->name, name);
		t->path = f->path;
		f->by_name[f->count++] = t;
	}
#undef COPY_STR

	/* Overlap: sorted by offset, each non-empty tensor starts at or after the
	 * end of the previous non-empty one. */
	qsort(f->by_name, nt, sizeof(*f->by_name), cmp_offset);
	const struct tr_st_tensor *prev = NULL;
	for (size_t i = 0; i < nt; i++) {
		const struct tr_st_tensor *t = f->by_name[i];
		if (!t->nbytes)
			continue;
		if (prev && (const unsigned char *)t->data < (const unsigned char *)prev->data + prev->nbytes) {
			size_t pb = (size_t)((const unsigned char *)prev->data - base);
			size_t tb = (size_t)((const unsigned char *)t->data - base);
			err = td_fail(eb, TD_EFORMAT, "%s: tensors '%s' [%zu, %zu] and '%s' [%zu, %zu] overlap",
				      path, prev->name, pb, pb + prev->nbytes, t->name, tb, tb + t->nbytes);
			goto out;
		}
		prev = t;
	}
	qsort(f->by_name, nt, sizeof(*f->by_name), cmp_name);
	*out = f;
	f = NULL;
out:
	free(f);
	json_object_put(root);
	return err;
}

td_err tr_st_open(struct tr_st_file **out, const char *path, struct td_errbuf *eb)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return tr__errno_fail(eb, errno, path, "open");
	struct stat st;
	if (fstat(fd, &st) < 0) {
		int e = errno;
		close(fd);
		return tr__errno_fail(eb, e, path, "stat");
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return td_fail(eb, TD_EFORMAT, "%s: not a regular file", path);
	}
	size_t size = (size_t)st.st_size;
	if (size == 0) {
		close(fd);
		return td_fail(eb, TD_EFORMAT, "%s: file is empty, not safetensors", path);
	}
	if (size < 8) {
		close(fd);
		return td_fail(eb, TD_EFORMAT, "%s: file is %zu bytes, too short for the 8-byte header length",
			       path, size);
	}
	void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
	int e = errno;
	close(fd); /* the mapping keeps the file */
	if (map == MAP_FAILED)
		return tr__errno_fail(eb, e, path, "mmap");

	struct tr_st_file *f;
	td_err err = parse_header(&f, path, map, size, eb);
	if (err) {
		munmap(map, size);
		return err;
	}
	f->map = map;
	f->map_len = size;
	*out = f;
	return TD_OK;
}

void tr_st_close(struct tr_st_file *f)
{
	if (!f)
		return;
	munmap(f->map, f->map_len);
	free(f);
}

const char *tr_st_path(const struct tr_st_file *f)
{
	return f->path;
}

size_t tr_st_count(const struct tr_st_file *f)
{
	return f->count;
}

const struct tr_st_tensor *tr_st_at(const struct tr_st_file *f, size_t i)
{
	return i < f->count ? &f->tensors[i] : NULL;
}

const struct tr_st_tensor *tr_st_find(const struct tr_st_file *f, const char *name)
{
	size_t lo = 0, hi = f->count;
	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		int c = strcmp(name, f->by_name[mid]->name);
		if (c == 0)
			return f->by_name[mid];
		if (c < 0)
			hi = mid;
		else
			lo = mid + 1;
	}
	return NULL;
}

const char *tr_st_metadata(const struct tr_st_file *f, const char *key)
{
	for (size_t i = 0; i < f->nmeta; i++)
		if (strcmp(f->meta[2 * i], key) == 0)
			return f->meta[2 * i + 1];
	return NULL;
}

/* ---- writer ---- */

static int cmp_str_ptr(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks the entries (names unique, shapes sane) and computes their sizes. */
static td_err check_entries(const char *path, const struct tr_st_entry *e, size_t n, size_t *nbytes,
			    struct td_errbuf *eb)
{
	for (size_t i = 0; i < n; i++) {
		if (!e[i].name || strcmp(e[i].name, "__metadata__") == 0)
			return td_fail(eb, TD_EINVAL, "%s: entry %zu: invalid name '%s'", path, i,
				       e[i].name ? e[i].name : "(null)");
		if (!tr_dtype_name(e[i].dtype) || e[i].ndim < 0 || e[i].ndim > TR_ST_MAX_DIMS)
			return td_fail(eb, TD_EINVAL, "%s: tensor '%s': bad dtype or ndim", path, e[i].name);
		uint64_t numel = 1;
		bool overflow = false;
		for (int d = 0; d < e[i].ndim; d++) {
			if (e[i].shape[d] < 0)
				return td_fail(eb, TD_EINVAL, "%s: tensor '%s': negative shape", path, e[i].name);
			overflow |= __builtin_mul_overflow(numel, (uint64_t)e[i].shape[d], &numel);
		}
		if (overflow || numel > INT64_MAX ||
		    __builtin_mul_overflow(numel, tr_dtype_size(e[i].dtype), &nbytes[i]))
			return td_fail(eb, TD_EINVAL, "%s: tensor '%s': shape overflows", path, e[i].name);
		if (nbytes[i] && !e[i].data)
			return td_fail(eb, TD_EINVAL, "%s: tensor '%s': no data", path, e[i].name);
	}
	const char **names = malloc(n * sizeof(*names) + 1);
	if (!names)
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	for (size_t i = 0; i < n; i++)
		names[i] = e[i].name;
	qsort(names, n, sizeof(*names), cmp_str_ptr);
	td_err err = TD_OK;
	for (size_t i = 1; i < n && !err; i++)
		if (strcmp(names[i - 1], names[i]) == 0)
			err = td_fail(eb, TD_EINVAL, "%s: tensor '%s' given twice", path, names[i]);
	free(names);
	return err;
}

td_err tr_st_write(const char *path, const struct tr_st_entry *entries, size_t n,
		   const char *const *meta, struct td_errbuf *eb)
{
	td_err err = TD_OK;
	size_t *nbytes = calloc(n + 1, sizeof(*nbytes));
	size_t *offset = calloc(n + 1, sizeof(*offset));
	struct tr__chunk *chunks = calloc(n + 2, sizeof(*chunks));
	json_object *root = json_object_new_object();
	char *header = NULL;
	if (!nbytes || !offset || !chunks || !root) {
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
		goto out;
	}
	if ((err = check_entries(path, entries, n, nbytes, eb)))
		goto out;

	/* Place by element size, largest first, stable: contiguous and naturally
	 * aligned, since the data section starts 8-aligned. */
	size_t nchunks = 2, at = 0;
	for (size_t esize = 8; esize >= 1; esize /= 2) {
		for (size_t i = 0; i < n; i++) {
			if (tr_dtype_size(entries[i].dtype) != esize)
				continue;
			offset[i] = at;
			at += nbytes[i];
			chunks[nchunks++] = (struct tr__chunk){entries[i].data, nbytes[i]};
		}
	}

	bool ok = true;
	if (meta && meta[0]) {
		json_object *m = tr__json_put(root, "__metadata__", json_object_new_object());
		ok = m != NULL;
		for (size_t i = 0; ok && meta[i] && meta[i + 1]; i += 2)
			ok = tr__json_put(m, meta[i], json_object_new_string(meta[i + 1]));
	}
	for (size_t i = 0; i < n && ok; i++) {
		json_object *t, *shape = NULL, *offs;
		ok = (t = tr__json_put(root, entries[i].name, json_object_new_object())) &&
		     tr__json_put(t, "dtype", json_object_new_string(tr_dtype_name(entries[i].dtype))) &&
		     (shape = tr__json_put(t, "shape", json_object_new_array())) &&
		     (offs = tr__json_put(t, "data_offsets", json_object_new_array())) &&
		     tr__json_push(offs, json_object_new_int64((int64_t)offset[i])) &&
		     tr__json_push(offs, json_object_new_int64((int64_t)(offset[i] + nbytes[i])));
		for (int d = 0; ok && d < entries[i].ndim; d++)
			ok = tr__json_push(shape, json_object_new_int64(entries[i].shape[d]));
	}
	size_t jlen = 0;
	const char *json = !ok ? NULL
			       : json_object_to_json_string_length(
					 root, JSON_C_TO_STRING_PLAIN | JSON_C_TO_STRING_NOSLASHESCAPE, &jlen);
	/* Spaces pad the header so the data section starts 8-aligned, as the
	 * reference writer does. */
	size_t hlen = (jlen + 7) & ~(size_t)7;
	if (!json || !(header = malloc(hlen))) {
		err = td_fail(eb, TD_ENOMEM, "%s: out of memory building the header", path);
		goto out;
	}
	memcpy(header, json, jlen);
	memset(header + jlen, ' ', hlen - jlen);
	uint64_t hlen_le = hlen;
	chunks[0] = (struct tr__chunk){&hlen_le, 8};
	chunks[1] = (struct tr__chunk){header, hlen};
	err = tr__write_atomic(path, chunks, nchunks, eb);
out:
	json_object_put(root);
	free(header);
	free(chunks);
	free(offset);
	free(nbytes);
	return err;
}
