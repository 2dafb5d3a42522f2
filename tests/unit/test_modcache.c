/* Unit test of tier 2 of the module cache (gpu/cuda/modcache.h), no GPU
 * needed: SHA-256 against the FIPS 180-2 vectors; the key against the
 * documented serialization built here byte by byte, its stability, and its
 * change with each input; the entry files: round trip, header layout, and
 * every way an entry must be refused (a flipped cubin byte, a flipped digest,
 * truncation, padding, another key's entry, a foreign format), atomic
 * replacement leaving no temp file, and failures that name the path. */
#include "gpu/cuda/modcache.h"

#include "tests/check.h"

#include <dirent.h>
#include <errno.h>
#include <ftw.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static char tmpdir[128];

static void hex_of(char *out, const unsigned char *d)
{
	cu_hex(out, d);
}

/* --- SHA-256: FIPS 180-2, appendix B --- */

static void test_sha256(void)
{
	static const struct {
		const char *msg;
		const char *hex;
	} cases[] = {
		{"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
		{"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
		{"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
		 "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		unsigned char d[CU_SHA256_BYTES];
		char hex[2 * CU_SHA256_BYTES + 1];
		CHECK_EQ_INT(cu_sha256(d, cases[i].msg, strlen(cases[i].msg), NULL), TD_OK);
		hex_of(hex, d);
		CHECK_STR_EQ(hex, cases[i].hex);
	}
}

/* --- the key --- */

static size_t put_le(unsigned char *p, uint64_t v, int bytes)
{
	for (int i = 0; i < bytes; i++)
		p[i] = (unsigned char)(v >> (8 * i));
	return (size_t)bytes;
}

/* The serialization modcache.h documents, built independently. */
static void key_reference(unsigned char out[CU_SHA256_BYTES], const struct cu_cache_key_in *in)
{
	const char *opt = in->options ? in->options : "";
	size_t cap = 64 + strlen(opt) + in->ptx_size, n = 0;
	unsigned char *b = malloc(cap);
	memcpy(b, "traind-modcache-key", 20); /* with its NUL */
	n += 20;
	n += put_le(b + n, CU_MODCACHE_FORMAT, 4);
	n += put_le(b + n, (uint32_t)in->cc_major, 4);
	n += put_le(b + n, (uint32_t)in->cc_minor, 4);
	n += put_le(b + n, (uint32_t)in->driver_version, 4);
	n += put_le(b + n, strlen(opt), 8);
	memcpy(b + n, opt, strlen(opt));
	n += strlen(opt);
	n += put_le(b + n, in->ptx_size, 8);
	memcpy(b + n, in->ptx, in->ptx_size);
	n += in->ptx_size;
	cu_sha256(out, b, n, NULL);
	free(b);
}

static void test_key(void)
{
	static const char ptx[] = ".version 8.0\n.target sm_80\n.address_size 64\n";
	static const char ptx2[] = ".version 8.0\n.target sm_80\n.address_size 32\n";
	const struct cu_cache_key_in base = {
		.ptx = ptx, .ptx_size = sizeof(ptx), .options = "CU_JIT_OPTIMIZATION_LEVEL=4;",
		.cc_major = 9, .cc_minor = 0, .driver_version = 12080,
	};
	unsigned char k0[CU_SHA256_BYTES], k1[CU_SHA256_BYTES], ref[CU_SHA256_BYTES];
	CHECK_EQ_INT(cu_cache_key(k0, &base, NULL), TD_OK);
	key_reference(ref, &base);
	CHECK_MSG(memcmp(k0, ref, sizeof(ref)) == 0, "the key is not the documented serialization's hash");
	CHECK_EQ_INT(cu_cache_key(k1, &base, NULL), TD_OK);
	CHECK_MSG(memcmp(k0, k1, sizeof(k0)) == 0, "the key is not stable");

	/* Each input, changed alone, changes the key. */
	struct {
		const char *what;
		struct cu_cache_key_in in;
	} cases[] = {
		{"a PTX byte", base}, {"the PTX length", base}, {"the options", base},
		{"cc major", base},   {"cc minor", base},       {"the driver", base},
		{"no options", base},
	};
	cases[0].in.ptx = ptx2;
	cases[1].in.ptx_size = sizeof(ptx) - 1;
	cases[2].in.options = "CU_JIT_OPTIMIZATION_LEVEL=3;";
	cases[3].in.cc_major = 10;
	cases[4].in.cc_minor = 9;
	cases[5].in.driver_version = 12090;
	cases[6].in.options = NULL;
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		unsigned char k[CU_SHA256_BYTES];
		CHECK_EQ_INT(cu_cache_key(k, &cases[i].in, NULL), TD_OK);
		CHECK_MSG(memcmp(k, k0, sizeof(k)) != 0, "changing %s leaves the key as it was",
			  cases[i].what);
		key_reference(ref, &cases[i].in);
		CHECK_MSG(memcmp(k, ref, sizeof(ref)) == 0, "%s: not the documented serialization",
			  cases[i].what);
	}
	/* NULL options are "" options; the length prefixes keep the boundary
	 * between options and PTX (options "ab" + PTX "c" vs "a" + "bc"). */
	struct cu_cache_key_in a = base, b = base;
	a.options = NULL;
	b.options = "";
	CHECK_EQ_INT(cu_cache_key(k0, &a, NULL), TD_OK);
	CHECK_EQ_INT(cu_cache_key(k1, &b, NULL), TD_OK);
	CHECK(memcmp(k0, k1, sizeof(k0)) == 0);
	a.options = "ab", a.ptx = "c", a.ptx_size = 1;
	b.options = "a", b.ptx = "bc", b.ptx_size = 2;
	CHECK_EQ_INT(cu_cache_key(k0, &a, NULL), TD_OK);
	CHECK_EQ_INT(cu_cache_key(k1, &b, NULL), TD_OK);
	CHECK(memcmp(k0, k1, sizeof(k0)) != 0);
}

/* --- entry files --- */

static void key_of(unsigned char key[CU_SHA256_BYTES], const char *seed)
{
	cu_sha256(key, seed, strlen(seed), NULL);
}

static size_t file_size(const char *path)
{
	struct stat st;
	return stat(path, &st) == 0 ? (size_t)st.st_size : (size_t)-1;
}

static void flip_byte(const char *path, long off)
{
	FILE *f = fopen(path, "r+b");
	CHECK_MSG(f != NULL, "%s: %s", path, strerror(errno));
	if (!f)
		return;
	fseek(f, off, SEEK_SET);
	int c = fgetc(f);
	fseek(f, off, SEEK_SET);
	fputc(c ^ 0x01, f);
	fclose(f);
}

static void copy_file(const char *from, const char *to)
{
	FILE *a = fopen(from, "rb"), *b = fopen(to, "wb");
	CHECK(a && b);
	int c;
	while (a && b && (c = fgetc(a)) != EOF)
		fputc(c, b);
	if (a)
		fclose(a);
	if (b)
		fclose(b);
}

/* Reads key back: the code, and on TD_OK that the bytes are want. */
static td_err read_back(const char *dir, const unsigned char *key, const void *want, size_t n,
			char *msg)
{
	void *data = NULL;
	size_t size = 0;
	struct td_errbuf eb = {{0}};
	td_err e = cu_cache_read(dir, key, &data, &size, &eb);
	if (e == TD_OK) {
		CHECK_EQ_INT(size, n);
		CHECK(size == n && (n == 0 || memcmp(data, want, n) == 0));
		free(data);
	}
	if (msg)
		snprintf(msg, sizeof(eb.msg), "%s", eb.msg);
	return e;
}

static int count_entries(const char *dir)
{
	DIR *d = opendir(dir);
	int n = 0;
	for (struct dirent *de; d && (de = readdir(d));)
		n += de->d_name[0] != '.' || (de->d_name[1] && strcmp(de->d_name, ".."));
	if (d)
		closedir(d);
	return n;
}

static void test_files(void)
{
	char dir[256], mdir[300], path[512], other[512], msg[1024];
	snprintf(dir, sizeof(dir), "%s/cache/deeper", tmpdir); /* parents made as needed */
	snprintf(mdir, sizeof(mdir), "%s/modules", dir);
	unsigned char key[CU_SHA256_BYTES], key2[CU_SHA256_BYTES];
	key_of(key, "one");
	key_of(key2, "two");
	unsigned char cubin[3000];
	for (size_t i = 0; i < sizeof(cubin); i++)
		cubin[i] = (unsigned char)(i * 131 + 7);

	/* A miss: no directory, then no file. */
	CHECK_EQ_INT(read_back(dir, key, NULL, 0, msg), TD_ENOENT);
	CHECK_EQ_INT(cu_cache_path(path, sizeof(path), dir, key, NULL), TD_OK);
	char hex[2 * CU_SHA256_BYTES + 1];
	hex_of(hex, key);
	char want_path[512];
	snprintf(want_path, sizeof(want_path), "%s/modules/%s.cubin", dir, hex);
	CHECK_STR_EQ(path, want_path);

	/* Round trip, and the header as documented. */
	CHECK_EQ_INT(cu_cache_write(dir, key, cubin, sizeof(cubin), NULL), TD_OK);
	CHECK_EQ_INT(file_size(path), CU_MODCACHE_HEADER + sizeof(cubin));
	CHECK_EQ_INT(read_back(dir, key, cubin, sizeof(cubin), msg), TD_OK);
	CHECK_EQ_INT(read_back(dir, key2, NULL, 0, msg), TD_ENOENT);
	FILE *f = fopen(path, "rb");
	unsigned char h[CU_MODCACHE_HEADER] = {0}, d[CU_SHA256_BYTES];
	CHECK(f && fread(h, 1, sizeof(h), f) == sizeof(h));
	if (f)
		fclose(f);
	CHECK(memcmp(h, "TDMODC\0\0", 8) == 0);
	CHECK_EQ_INT(h[8] | h[9] << 8, CU_MODCACHE_FORMAT);
	CHECK_EQ_INT(h[12] | h[13] << 8, CU_MODCACHE_HEADER);
	CHECK_EQ_INT(h[16] | h[17] << 8 | h[18] << 16, sizeof(cubin));
	CHECK(memcmp(h + 24, key, CU_SHA256_BYTES) == 0);
	cu_sha256(d, cubin, sizeof(cubin), NULL);
	CHECK(memcmp(h + 56, d, CU_SHA256_BYTES) == 0);
	struct stat st;
	CHECK(stat(mdir, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 0777) == 0700);
	CHECK(stat(path, &st) == 0 && (st.st_mode & 077) == 0);

	/* A flipped cubin byte, then a flipped digest byte: refused, and the
	 * message names the file. */
	static const struct {
		const char *what;
		long off;
		td_err want;
	} flips[] = {
		{"a cubin byte", CU_MODCACHE_HEADER + 1234, TD_EMISMATCH},
		{"the last cubin byte", CU_MODCACHE_HEADER + sizeof(cubin) - 1, TD_EMISMATCH},
		{"a digest byte", 56 + 5, TD_EMISMATCH},
		{"a key byte", 24, TD_EMISMATCH},
		{"the magic", 0, TD_EFORMAT},
		{"the format", 8, TD_EFORMAT},
		{"the size", 16, TD_EFORMAT},
	};
	for (size_t i = 0; i < sizeof(flips) / sizeof(flips[0]); i++) {
		flip_byte(path, flips[i].off);
		td_err e = read_back(dir, key, cubin, sizeof(cubin), msg);
		CHECK_MSG(e == flips[i].want, "%s flipped: got %s, want %s", flips[i].what,
			  td_errname(e), td_errname(flips[i].want));
		CHECK_CONTAINS(msg, path);
		flip_byte(path, flips[i].off); /* restored: trusted again */
		CHECK_EQ_INT(read_back(dir, key, cubin, sizeof(cubin), msg), TD_OK);
	}

	/* Truncated by one byte, to the header, to half the header, to nothing;
	 * padded by one byte. */
	static const long sizes[] = {CU_MODCACHE_HEADER + sizeof(cubin) - 1, CU_MODCACHE_HEADER,
				     CU_MODCACHE_HEADER / 2, 0, CU_MODCACHE_HEADER + sizeof(cubin) + 1};
	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		CHECK_EQ_INT(cu_cache_write(dir, key, cubin, sizeof(cubin), NULL), TD_OK);
		CHECK(truncate(path, sizes[i]) == 0);
		td_err e = read_back(dir, key, cubin, sizeof(cubin), msg);
		CHECK_MSG(e == TD_EFORMAT, "a file of %ld bytes: got %s", sizes[i], td_errname(e));
		CHECK_CONTAINS(msg, path);
	}

	/* A rebuild replaces the bad entry. */
	CHECK_EQ_INT(cu_cache_write(dir, key, cubin, sizeof(cubin), NULL), TD_OK);
	CHECK_EQ_INT(read_back(dir, key, cubin, sizeof(cubin), msg), TD_OK);

	/* Another key's entry under this key's name. */
	CHECK_EQ_INT(cu_cache_path(other, sizeof(other), dir, key2, NULL), TD_OK);
	copy_file(path, other);
	CHECK_EQ_INT(read_back(dir, key2, cubin, sizeof(cubin), msg), TD_EMISMATCH);
	CHECK_CONTAINS(msg, "another key");

	/* Atomic replacement: the new bytes, and no temp file left behind. */
	unsigned char cubin2[100];
	memset(cubin2, 0x5a, sizeof(cubin2));
	CHECK_EQ_INT(cu_cache_write(dir, key, cubin2, sizeof(cubin2), NULL), TD_OK);
	CHECK_EQ_INT(read_back(dir, key, cubin2, sizeof(cubin2), msg), TD_OK);
	CHECK_EQ_INT(cu_cache_write(dir, key2, cubin, 0, NULL), TD_OK); /* an empty cubin */
	CHECK_EQ_INT(read_back(dir, key2, cubin, 0, msg), TD_OK);
	CHECK_EQ_INT(count_entries(mdir), 2);

	/* Failures name the path and leave nothing behind. */
	char file_dir[300];
	snprintf(file_dir, sizeof(file_dir), "%s/afile", tmpdir);
	f = fopen(file_dir, "w");
	if (f)
		fclose(f);
	struct td_errbuf eb = {{0}};
	CHECK(cu_cache_write(file_dir, key, cubin, sizeof(cubin), &eb) != TD_OK);
	CHECK_CONTAINS(eb.msg, file_dir);
	CHECK_EQ_INT(read_back(file_dir, key, NULL, 0, msg), TD_ENOENT);
	CHECK_EQ_INT(cu_cache_write("", key, cubin, sizeof(cubin), NULL), TD_EINVAL);
	CHECK_EQ_INT(read_back("", key, NULL, 0, msg), TD_EINVAL);
	if (geteuid() != 0) { /* root reads and writes through modes */
		CHECK(chmod(mdir, 0500) == 0);
		CHECK(cu_cache_write(dir, key, cubin, sizeof(cubin), &eb) != TD_OK);
		CHECK_CONTAINS(eb.msg, mdir);
		CHECK_EQ_INT(count_entries(mdir), 2);
		CHECK(chmod(mdir, 0700) == 0);
	}
}

int main(void)
{
	const char *base = getenv("TMPDIR");
	snprintf(tmpdir, sizeof(tmpdir), "%s/td-modcache-XXXXXX",
		 base && *base && strlen(base) < 80 ? base : "/tmp");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "mkdtemp %s: %s\n", tmpdir, strerror(errno));
		return 1;
	}
	test_sha256();
	test_key();
	test_files();
	check_rm_tree(tmpdir);
	return check_status();
}
