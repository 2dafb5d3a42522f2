/* Unit tests for train/safetensors: write/read round trips over every dtype,
 * fp16/bf16 conversions against hand-computed values (ties included), a table
 * of malformed files, a mutation loop that must never crash, and the qwen2
 * fixture. Files live in a mkdtemp directory removed at the end. */
#include "train/safetensors.h"

#include <fcntl.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/check.h"

static char tmpdir[] = "/tmp/td-test-st-XXXXXX";

static const char *tmp_path(const char *name)
{
	static char buf[4][512];
	static int next;
	char *p = buf[next++ % 4];
	snprintf(p, sizeof(buf[0]), "%s/%s", tmpdir, name);
	return p;
}

static void write_bytes(const char *path, const void *data, size_t len)
{
	FILE *f = fopen(path, "wb");
	CHECK(f != NULL);
	if (!f)
		return;
	CHECK(fwrite(data, 1, len, f) == len);
	fclose(f);
}

/* A file of an 8-byte length (hlen + delta), the header text, and data_len bytes. */
static void write_st(const char *path, const char *header, long long delta, size_t data_len)
{
	size_t hlen = strlen(header);
	unsigned char *buf = calloc(1, 8 + hlen + data_len + 1);
	uint64_t field = (uint64_t)((long long)hlen + delta);
	memcpy(buf, &field, 8);
	memcpy(buf + 8, header, hlen);
	write_bytes(path, buf, 8 + hlen + data_len);
	free(buf);
}

static uint32_t bits(float x)
{
	uint32_t u;
	memcpy(&u, &x, 4);
	return u;
}

static float from_bits(uint32_t u)
{
	float x;
	memcpy(&x, &u, 4);
	return x;
}

/* ---- round trip ---- */

static void test_round_trip(void)
{
	const float f32[6] = {1.5f, -2.25f, 0.0f, 3e-38f, 65504.0f, -1e30f};
	const uint16_t f16[4] = {0x3c00, 0xc000, 0x0001, 0x7bff};
	const uint16_t bf16[3] = {0x3f80, 0x4049, 0xff80};
	const double f64[2] = {3.141592653589793, -1e-300};
	const int64_t i64[2] = {-5, 1LL << 40};
	const int32_t i32[2] = {-7, 2147483647};
	const int16_t i16[3] = {-32768, 0, 12345};
	const int8_t i8[5] = {-128, -1, 0, 1, 127};
	const uint8_t boolean = 1;
	const float scalar = 42.0f;
	const struct tr_st_entry e[] = {
		{"f32", TR_DT_F32, 2, {2, 3}, f32},
		{"bf16 odd", TR_DT_BF16, 1, {3}, bf16}, /* 6 bytes: the next tensor would be misaligned */
		{"f16", TR_DT_F16, 2, {2, 2}, f16},
		{"f64", TR_DT_F64, 1, {2}, f64},
		{"i64", TR_DT_I64, 1, {2}, i64},
		{"i32", TR_DT_I32, 2, {1, 2}, i32},
		{"i16", TR_DT_I16, 1, {3}, i16},
		{"i8", TR_DT_I8, 1, {5}, i8},
		{"u8 empty", TR_DT_U8, 2, {0, 7}, NULL},
		{"bool scalar", TR_DT_BOOL, 0, {0}, &boolean},
		{"f32 scalar", TR_DT_F32, 0, {0}, &scalar},
		{"path/with \"quotes\"", TR_DT_F32, 1, {1}, &scalar},
	};
	const size_t n = sizeof(e) / sizeof(e[0]);
	const char *meta[] = {"format", "pt", "note", "a/b", NULL};
	const char *path = tmp_path("round.safetensors");
	struct td_errbuf eb = {{0}};
	td_err err = tr_st_write(path, e, n, meta, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	CHECK(access(tmp_path("round.safetensors.tmp"), F_OK) != 0);

	struct tr_st_file *f = NULL;
	err = tr_st_open(&f, path, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	if (err)
		return;
	CHECK_STR_EQ(tr_st_path(f), path);
	CHECK_EQ_INT(tr_st_count(f), n);
	CHECK_STR_EQ(tr_st_metadata(f, "format"), "pt");
	CHECK_STR_EQ(tr_st_metadata(f, "note"), "a/b");
	CHECK(tr_st_metadata(f, "absent") == NULL);
	CHECK(tr_st_find(f, "absent") == NULL);
	CHECK(tr_st_at(f, n) == NULL);

	size_t total = 0;
	for (size_t i = 0; i < n; i++) {
		const struct tr_st_tensor *t = tr_st_at(f, i);
		CHECK_STR_EQ(t->name, e[i].name); /* header order is the given order */
		CHECK(tr_st_find(f, e[i].name) == t);
		CHECK_EQ_INT(t->dtype, e[i].dtype);
		CHECK_EQ_INT(t->ndim, e[i].ndim);
		int64_t numel = 1;
		for (int d = 0; d < e[i].ndim; d++) {
			CHECK_EQ_INT(t->shape[d], e[i].shape[d]);
			numel *= e[i].shape[d];
		}
		CHECK_EQ_INT(t->numel, numel);
		CHECK_EQ_INT(t->nbytes, (size_t)numel * tr_dtype_size(e[i].dtype));
		CHECK_MSG(t->nbytes == 0 || memcmp(t->data, e[i].data, t->nbytes) == 0, "data of %s", t->name);
		/* The map is page-aligned and the data section 8-aligned. */
		CHECK_MSG((uintptr_t)t->data % tr_dtype_size(t->dtype) == 0, "%s misaligned", t->name);
		total += t->nbytes;
	}
	tr_st_close(f);

	/* What the reference reader demands: header padded to 8, data contiguous
	 * up to the end of the file. */
	FILE *fp = fopen(path, "rb");
	uint64_t hlen = 0;
	CHECK(fp && fread(&hlen, 8, 1, fp) == 1);
	fseek(fp, 0, SEEK_END);
	long size = ftell(fp);
	fclose(fp);
	CHECK_EQ_INT(hlen % 8, 0);
	CHECK_EQ_INT((uint64_t)size, 8 + hlen + total);

	/* Conversions through the reader. */
	CHECK(tr_st_open(&f, path, &eb) == TD_OK);
	float out[8];
	int32_t iv[8];
	CHECK(tr_st_to_f32(out, tr_st_find(f, "f16"), &eb) == TD_OK);
	CHECK(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0x1p-24f && out[3] == 65504.0f);
	CHECK(tr_st_to_f32(out, tr_st_find(f, "bf16 odd"), &eb) == TD_OK);
	CHECK(out[0] == 1.0f && out[1] == 3.140625f && out[2] == -INFINITY);
	CHECK(tr_st_to_f32(out, tr_st_find(f, "f64"), &eb) == TD_OK);
	CHECK(out[0] == (float)3.141592653589793 && out[1] == -0.0f);
	CHECK(tr_st_to_f32(out, tr_st_find(f, "f32"), &eb) == TD_OK);
	CHECK(memcmp(out, f32, sizeof(f32)) == 0);
	CHECK(tr_st_to_f32(out, tr_st_find(f, "f32 scalar"), &eb) == TD_OK);
	CHECK(out[0] == 42.0f);
	CHECK(tr_st_to_i32(iv, tr_st_find(f, "i16"), &eb) == TD_OK);
	CHECK(iv[0] == -32768 && iv[1] == 0 && iv[2] == 12345);
	CHECK(tr_st_to_i32(iv, tr_st_find(f, "i8"), &eb) == TD_OK);
	CHECK(iv[0] == -128 && iv[4] == 127);
	CHECK(tr_st_to_i32(iv, tr_st_find(f, "i32"), &eb) == TD_OK);
	CHECK(iv[0] == -7 && iv[1] == 2147483647);
	CHECK(tr_st_to_i32(iv, tr_st_find(f, "bool scalar"), &eb) == TD_OK);
	CHECK(iv[0] == 1);
	CHECK_EQ_INT(tr_st_to_i32(iv, tr_st_find(f, "i64"), &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "i64");
	CHECK_EQ_INT(tr_st_to_f32(out, tr_st_find(f, "i32"), &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "I32");
	CHECK_EQ_INT(tr_st_to_i32(iv, tr_st_find(f, "f32"), &eb), TD_EUNSUPPORTED);
	tr_st_close(f);
	tr_st_close(NULL);

	/* Writer refusals. */
	const struct tr_st_entry dup[] = {{"a", TR_DT_F32, 0, {0}, &scalar}, {"a", TR_DT_F32, 0, {0}, &scalar}};
	CHECK_EQ_INT(tr_st_write(tmp_path("dup.safetensors"), dup, 2, NULL, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "twice");
	const struct tr_st_entry reserved[] = {{"__metadata__", TR_DT_F32, 0, {0}, &scalar}};
	CHECK_EQ_INT(tr_st_write(tmp_path("res.safetensors"), reserved, 1, NULL, &eb), TD_EINVAL);
	CHECK_EQ_INT(tr_st_write("/nonexistent-dir/x.safetensors", e, 1, NULL, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "/nonexistent-dir/x.safetensors.tmp");

	/* No tensors at all is a valid file. */
	CHECK(tr_st_write(tmp_path("none.safetensors"), NULL, 0, NULL, &eb) == TD_OK);
	CHECK(tr_st_open(&f, tmp_path("none.safetensors"), &eb) == TD_OK);
	CHECK_EQ_INT(tr_st_count(f), 0);
	tr_st_close(f);
}

/* ---- conversions ---- */

static void test_conversions(void)
{
	const struct {
		uint32_t f32; /* input bits */
		uint16_t bf16, f16;
		const char *what;
	} cases[] = {
		{0x3f800000, 0x3f80, 0x3c00, "1"},
		{0xc0000000, 0xc000, 0xc000, "-2"},
		{0x00000000, 0x0000, 0x0000, "+0"},
		{0x80000000, 0x8000, 0x8000, "-0"},
		{0x7f800000, 0x7f80, 0x7c00, "+inf"},
		{0xff800000, 0xff80, 0xfc00, "-inf"},
		/* bf16 ties: 1 + 2^-8 is halfway between 0x3f80 and 0x3f81, goes to even
		 * 0x3f80; 1 + 3*2^-8 between 0x3f81 and 0x3f82 goes to 0x3f82. f16 of
		 * both is exact. */
		{0x3f808000, 0x3f80, 0x3c04, "1+2^-8"},
		{0x3f818000, 0x3f82, 0x3c0c, "1+3*2^-8"},
		{0x3f808001, 0x3f81, 0x3c04, "just above a bf16 tie"},
		/* f16 ties: 1 + 2^-11 between 0x3c00 and 0x3c01 -> 0x3c00; 1 + 3*2^-11 -> 0x3c02. */
		{0x3f801000, 0x3f80, 0x3c00, "1+2^-11"},
		{0x3f803000, 0x3f80, 0x3c02, "1+3*2^-11"},
		{0x3f801001, 0x3f80, 0x3c01, "just above an f16 tie"},
		/* f16 range: 65504 is the largest finite; 65520 is the tie to Inf. */
		{0x477fe000, 0x4780, 0x7bff, "65504"},
		{0x477fefff, 0x4780, 0x7bff, "just below 65520"},
		{0x477ff000, 0x4780, 0x7c00, "65520"},
		{0x49742400, 0x4974, 0x7c00, "1e6"},
		/* bf16 overflow: the largest float rounds up to Inf. */
		{0x7f7fffff, 0x7f80, 0x7c00, "FLT_MAX"},
		/* f16 subnormals, in units of 2^-24. */
		{0x33800000, 0x3380, 0x0001, "2^-24"},
		{0x33000000, 0x3300, 0x0000, "2^-25 ties to 0"},
		{0x33000001, 0x3300, 0x0001, "just above 2^-25"},
		{0x33c00000, 0x33c0, 0x0002, "3*2^-25 ties to 2"},
		{0x387fe000, 0x3880, 0x0400, "1023.5*2^-24 ties up to the smallest normal"},
		{0x38800000, 0x3880, 0x0400, "2^-14"},
		{0xb3800000, 0xb380, 0x8001, "-2^-24"},
		{0x32000000, 0x3200, 0x0000, "2^-27 underflows"},
		/* A float subnormal stays a bf16 subnormal. */
		{0x00012345, 0x0001, 0x0000, "f32 subnormal"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		float x = from_bits(cases[i].f32);
		uint16_t b = tr_f32_to_bf16(x), h = tr_f32_to_f16(x);
		CHECK_MSG(b == cases[i].bf16, "%s: bf16 0x%04x, want 0x%04x", cases[i].what, b, cases[i].bf16);
		CHECK_MSG(h == cases[i].f16, "%s: f16 0x%04x, want 0x%04x", cases[i].what, h, cases[i].f16);
	}

	/* NaN stays NaN, sign kept, never Inf. */
	uint16_t b = tr_f32_to_bf16(from_bits(0x7f800001)), h = tr_f32_to_f16(from_bits(0xff800001));
	CHECK_MSG((b & 0x7f80) == 0x7f80 && (b & 0x7f), "bf16 NaN 0x%04x", b);
	CHECK_MSG((h & 0xfc00) == 0xfc00 && (h & 0x3ff), "f16 NaN 0x%04x", h);
	CHECK(isnan(tr_bf16_to_f32(0x7fc0)) && isnan(tr_f16_to_f32(0x7e00)));

	/* Widening, by hand. */
	CHECK(tr_bf16_to_f32(0x3f81) == 1.0078125f);
	CHECK(tr_f16_to_f32(0x3555) == 0.333251953125f);
	CHECK(tr_f16_to_f32(0x0001) == 0x1p-24f);
	CHECK(tr_f16_to_f32(0x03ff) == 1023 * 0x1p-24f);
	CHECK(tr_f16_to_f32(0x8001) == -0x1p-24f);
	CHECK(tr_f16_to_f32(0x7bff) == 65504.0f);
	CHECK(tr_f16_to_f32(0xfc00) == -INFINITY);
	CHECK(bits(tr_f16_to_f32(0x8000)) == 0x80000000u);

	/* Every non-NaN half value survives widening then narrowing. */
	int bad_h = 0, bad_b = 0;
	for (uint32_t v = 0; v < 0x10000; v++) {
		uint16_t x = (uint16_t)v;
		if ((x & 0x7c00) != 0x7c00 || !(x & 0x3ff))
			bad_h += tr_f32_to_f16(tr_f16_to_f32(x)) != x;
		if ((x & 0x7f80) != 0x7f80 || !(x & 0x7f))
			bad_b += tr_f32_to_bf16(tr_bf16_to_f32(x)) != x;
	}
	CHECK_EQ_INT(bad_h, 0);
	CHECK_EQ_INT(bad_b, 0);

#ifdef __FLT16_MAX__
	/* The compiler's own conversion (round to nearest even) over random bits. */
	uint32_t s = 12345;
	int bad = 0;
	for (int i = 0; i < 2000000; i++) {
		s = s * 1664525u + 1013904223u;
		uint32_t u = (s & 0x8fffffffu) | ((s >> 3) & 0x70000000u); /* bias toward f16 range */
		float x = from_bits(u);
		if (isnan(x))
			continue;
		_Float16 r = (_Float16)x;
		uint16_t want;
		memcpy(&want, &r, 2);
		bad += tr_f32_to_f16(x) != want;
	}
	CHECK_EQ_INT(bad, 0);
#endif
}

/* ---- malformed files ---- */

struct bad_case {
	const char *name; /* the file is <name>.safetensors */
	const char *header;
	long long delta; /* added to the header length field */
	size_t data_len;
	td_err code;
	const char *word;
};

static const struct bad_case bad_cases[] = {
	{"hlen-past-eof", "{}", 100, 0, TD_EFORMAT, "exceeds the file size"},
	{"not-json", "{\"a\": ", 0, 0, TD_EFORMAT, "JSON"},
	{"trailing-junk", "{} x", 0, 0, TD_EFORMAT, "JSON"},
	{"not-utf8", "{\"\xff\xfe\": 1}", 0, 0, TD_EFORMAT, "JSON"},
	{"deep", "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
	 0, 0, TD_EFORMAT, "JSON"},
	{"not-object", "[1, 2]", 0, 0, TD_EFORMAT, "not an object"},
	{"entry-not-object", "{\"x\": 5}", 0, 0, TD_EFORMAT, "not an object"},
	{"unknown-dtype", "{\"x\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 0, 1,
	 TD_EUNSUPPORTED, "F8_E4M3"},
	{"dtype-not-string", "{\"x\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 0, 4, TD_EFORMAT,
	 "dtype"},
	{"negative-shape", "{\"x\":{\"dtype\":\"F32\",\"shape\":[-1,4],\"data_offsets\":[0,16]}}", 0, 16,
	 TD_EFORMAT, "negative"},
	{"float-shape", "{\"x\":{\"dtype\":\"F32\",\"shape\":[4.0],\"data_offsets\":[0,16]}}", 0, 16,
	 TD_EFORMAT, "shape[0]"},
	{"nine-dims", "{\"x\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}", 0, 1,
	 TD_EUNSUPPORTED, "9 dims"},
	{"numel-overflow",
	 "{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,16]}}", 0, 16,
	 TD_EFORMAT, "overflows"},
	{"bytes-overflow", "{\"x\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,8]}}",
	 0, 8, TD_EFORMAT, "overflows"},
	{"offsets-beyond", "{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,999]}}", 0, 16,
	 TD_EFORMAT, "data_offsets [0, 999] exceed the data section (16 bytes)"},
	{"huge-offsets", "{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[18446744073709551615,"
			  "18446744073709551615]}}",
	 0, 1, TD_EFORMAT, "exceed"},
	{"end-before-begin", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 0, 16,
	 TD_EFORMAT, "before"},
	{"negative-offset", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 0, 16,
	 TD_EFORMAT, "data_offsets"},
	{"offsets-not-pair", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 0, 16,
	 TD_EFORMAT, "data_offsets"},
	{"size-mismatch", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,16]}}", 0, 24,
	 TD_EFORMAT, "mismatch"},
	{"overlap",
	 "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
	 "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}",
	 0, 24, TD_EFORMAT, "overlap"},
	{"overlap-reversed",
	 "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]},"
	 "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
	 0, 24, TD_EFORMAT, "overlap"},
	{"truncated-data",
	 "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
	 "\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,32]}}",
	 0, 20, TD_EFORMAT, "exceed the data section (20 bytes)"},
	{"metadata-not-string", "{\"__metadata__\":{\"format\":1}}", 0, 0, TD_EFORMAT, "__metadata__"},
	{"metadata-not-object", "{\"__metadata__\":[]}", 0, 0, TD_EFORMAT, "__metadata__"},
};

static void expect_fail(const char *path, td_err code, const char *word)
{
	struct tr_st_file *f = NULL;
	struct td_errbuf eb = {{0}};
	td_err err = tr_st_open(&f, path, &eb);
	CHECK_MSG(err == code, "%s: got %s (%s), want %s", path, td_errname(err), eb.msg, td_errname(code));
	CHECK(f == NULL);
	CHECK_CONTAINS(eb.msg, strrchr(path, '/') + 1);
	CHECK_CONTAINS(eb.msg, word);
	if (!err)
		tr_st_close(f);
}

static void test_malformed(void)
{
	char name[128];
	for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
		const struct bad_case *c = &bad_cases[i];
		snprintf(name, sizeof(name), "%s.safetensors", c->name);
		write_st(tmp_path(name), c->header, c->delta, c->data_len);
		expect_fail(tmp_path(name), c->code, c->word);
	}

	/* Cases the table's layout cannot express. */
	write_bytes(tmp_path("empty.safetensors"), "", 0);
	expect_fail(tmp_path("empty.safetensors"), TD_EFORMAT, "empty");
	write_bytes(tmp_path("short.safetensors"), "\x05\0\0", 3);
	expect_fail(tmp_path("short.safetensors"), TD_EFORMAT, "too short");
	write_bytes(tmp_path("nul.safetensors"), "\x04\0\0\0\0\0\0\0{\0}\n", 12);
	expect_fail(tmp_path("nul.safetensors"), TD_EFORMAT, "NUL");
	expect_fail(tmp_path("absent.safetensors"), TD_ENOENT, "No such file");
	expect_fail(tmpdir, TD_EFORMAT, "not a regular file");

	/* A header length over the 100 MB limit that the (sparse) file could hold. */
	const char *big = tmp_path("huge-header.safetensors");
	int fd = open(big, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	uint64_t hlen = 100000008;
	CHECK(fd >= 0 && write(fd, &hlen, 8) == 8 && ftruncate(fd, 200000000) == 0);
	close(fd);
	expect_fail(big, TD_EFORMAT, "limit");
	unlink(big);
}

/* Mutated and truncated copies of a valid file: any answer but a crash (or an
 * ASan report) will do; whatever opens must be readable end to end. */
static void test_mutations(void)
{
	const float a[4] = {1, 2, 3, 4};
	const uint16_t b[3] = {1, 2, 3};
	const struct tr_st_entry e[] = {{"a", TR_DT_F32, 2, {2, 2}, a}, {"b", TR_DT_BF16, 1, {3}, b}};
	const char *meta[] = {"format", "pt", NULL};
	const char *src = tmp_path("mut-src.safetensors"), *dst = tmp_path("mut.safetensors");
	struct td_errbuf eb;
	CHECK(tr_st_write(src, e, 2, meta, &eb) == TD_OK);
	FILE *fp = fopen(src, "rb");
	unsigned char orig[512], buf[512];
	size_t len = fp ? fread(orig, 1, sizeof(orig), fp) : 0;
	if (fp)
		fclose(fp);
	CHECK(len > 16 && len < sizeof(orig));

	int opened = 0, total = 0;
	uint32_t s = 1;
	for (int iter = 0; iter < 3000; iter++) {
		memcpy(buf, orig, len);
		size_t n = len;
		if (iter < (int)len) {
			n = (size_t)iter; /* every truncation */
		} else {
			for (int k = 0; k < 1 + iter % 4; k++) {
				s = s * 1664525u + 1013904223u;
				size_t at = (s >> 8) % len;
				/* mostly digits and JSON punctuation: mutations that still parse */
				static const char pick[] = "0123456789[]{},:\"-FIU8e ";
				buf[at] = (s & 3) ? (unsigned char)pick[(s >> 4) % (sizeof(pick) - 1)] : (unsigned char)(s >> 24);
			}
		}
		write_bytes(dst, buf, n);
		struct tr_st_file *f = NULL;
		total++;
		if (tr_st_open(&f, dst, &eb) != TD_OK)
			continue;
		opened++;
		for (size_t i = 0; i < tr_st_count(f); i++) {
			const struct tr_st_tensor *t = tr_st_at(f, i);
			float *out = malloc((size_t)t->numel * sizeof(float) + 1);
			int32_t *iout = malloc((size_t)t->numel * sizeof(int32_t) + 1);
			if (out && iout && tr_st_to_f32(out, t, &eb) != TD_OK)
				tr_st_to_i32(iout, t, &eb);
			free(out);
			free(iout);
		}
		tr_st_close(f);
	}
	CHECK(opened > 0 && opened < total);
}

static void test_fixture(void)
{
	const char *dir = getenv("TD_FIXTURES");
	if (!dir) {
		fprintf(stderr, "TD_FIXTURES unset: fixture checks skipped\n");
		return;
	}
	char path[512];
	snprintf(path, sizeof(path), "%s/qwen2/model.safetensors", dir);
	struct tr_st_file *f = NULL;
	struct td_errbuf eb;
	td_err err = tr_st_open(&f, path, &eb);
	CHECK_MSG(err == TD_OK, "%s", eb.msg);
	if (err)
		return;
	CHECK_EQ_INT(tr_st_count(f), 26);
	CHECK_STR_EQ(tr_st_metadata(f, "format"), "pt");
	const struct tr_st_tensor *t = tr_st_find(f, "model.embed_tokens.weight");
	CHECK(t != NULL);
	if (t) {
		CHECK_EQ_INT(t->dtype, TR_DT_F32);
		CHECK_EQ_INT(t->ndim, 2);
		CHECK_EQ_INT(t->shape[0], 512);
		CHECK_EQ_INT(t->shape[1], 64);
		CHECK_EQ_INT(t->nbytes, 512 * 64 * 4);
	}
	t = tr_st_find(f, "model.layers.1.self_attn.q_proj.bias");
	CHECK(t && t->ndim == 1 && t->shape[0] == 64);
	tr_st_close(f);
}

int main(void)
{
	if (!mkdtemp(tmpdir)) {
		perror("mkdtemp");
		return 1;
	}
	test_round_trip();
	test_conversions();
	test_malformed();
	test_mutations();
	test_fixture();
	check_rm_tree(tmpdir);
	return check_status();
}
