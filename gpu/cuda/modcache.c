/* Tier 2 of the module cache: keys and self-verifying entry files
 * (gpu/cuda/modcache.h). No CUDA here; the backend decides what to compile. */
#include "gpu/cuda/modcache.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

static const char magic[8] = {'T', 'D', 'M', 'O', 'D', 'C', 0, 0};

static void put_u32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p)
{
	uint32_t v = 0;
	for (int i = 0; i < 4; i++)
		v |= (uint32_t)p[i] << (8 * i);
	return v;
}

static uint64_t get_u64(const unsigned char *p)
{
	uint64_t v = 0;
	for (int i = 0; i < 8; i++)
		v |= (uint64_t)p[i] << (8 * i);
	return v;
}

td_err cu_cache_key(unsigned char key[CU_SHA256_BYTES], const struct cu_cache_key_in *in,
		    struct td_errbuf *eb)
{
	static const char tag[] = "traind-modcache-key"; /* hashed with its NUL */
	const char *opt = in->options ? in->options : "";
	unsigned char fixed[4 * 4], len[8];
	put_u32(fixed, CU_MODCACHE_FORMAT);
	put_u32(fixed + 4, (uint32_t)in->cc_major);
	put_u32(fixed + 8, (uint32_t)in->cc_minor);
	put_u32(fixed + 12, (uint32_t)in->driver_version);
	EVP_MD_CTX *c = EVP_MD_CTX_new();
	int ok = c && EVP_DigestInit_ex(c, EVP_sha256(), NULL) &&
		 EVP_DigestUpdate(c, tag, sizeof(tag)) && EVP_DigestUpdate(c, fixed, sizeof(fixed));
	put_u64(len, strlen(opt));
	ok = ok && EVP_DigestUpdate(c, len, sizeof(len)) && EVP_DigestUpdate(c, opt, strlen(opt));
	put_u64(len, in->ptx_size);
	ok = ok && EVP_DigestUpdate(c, len, sizeof(len)) &&
	     (in->ptx_size == 0 || EVP_DigestUpdate(c, in->ptx, in->ptx_size));
	unsigned n = 0;
	ok = ok && EVP_DigestFinal_ex(c, key, &n) && n == CU_SHA256_BYTES;
	EVP_MD_CTX_free(c);
	return ok ? TD_OK : td_fail(eb, TD_EINTERNAL, "module cache: SHA-256 (libcrypto) failed");
}

td_err cu_sha256(unsigned char out[CU_SHA256_BYTES], const void *data, size_t size,
		 struct td_errbuf *eb)
{
	unsigned n = 0;
	if (!EVP_Digest(data, size, out, &n, EVP_sha256(), NULL) || n != CU_SHA256_BYTES)
		return td_fail(eb, TD_EINTERNAL, "module cache: SHA-256 (libcrypto) failed");
	return TD_OK;
}

void cu_hex(char out[2 * CU_SHA256_BYTES + 1], const unsigned char d[CU_SHA256_BYTES])
{
	static const char digits[] = "0123456789abcdef";
	for (int i = 0; i < CU_SHA256_BYTES; i++) {
		out[2 * i] = digits[d[i] >> 4];
		out[2 * i + 1] = digits[d[i] & 15];
	}
	out[2 * CU_SHA256_BYTES] = '\0';
}

td_err cu_cache_path(char *out, size_t cap, const char *dir, const unsigned char key[CU_SHA256_BYTES],
		     struct td_errbuf *eb)
{
	if (!dir || !*dir)
		return td_fail(eb, TD_EINVAL, "module cache: no directory");
	char hex[2 * CU_SHA256_BYTES + 1];
	cu_hex(hex, key);
	int n = snprintf(out, cap, "%s/modules/%s.cubin", dir, hex);
	if (n < 0 || (size_t)n >= cap)
		return td_fail(eb, TD_EINVAL, "module cache: %s: path too long", dir);
	return TD_OK;
}

static td_err errno_fail(struct td_errbuf *eb, int err, const char *path, const char *what)
{
	return td_fail(eb, td_from_errno(err), "module cache: %s: %s: %s", path, what, strerror(err));
}

td_err cu_cache_read(const char *dir, const unsigned char key[CU_SHA256_BYTES], void **data,
		     size_t *size, struct td_errbuf *eb)
{
	char path[PATH_MAX];
	td_err e = cu_cache_path(path, sizeof(path), dir, key, eb);
	if (e != TD_OK)
		return e;
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT || errno == ENOTDIR)
			return td_fail(eb, TD_ENOENT, "module cache: %s: no entry", path);
		return errno_fail(eb, errno, path, "open");
	}
	unsigned char *buf = NULL;
	struct stat st;
	if (fstat(fd, &st) < 0) {
		e = errno_fail(eb, errno, path, "fstat");
		goto out;
	}
	if (!S_ISREG(st.st_mode) || st.st_size < CU_MODCACHE_HEADER ||
	    (uint64_t)st.st_size - CU_MODCACHE_HEADER > CU_MODCACHE_MAX_BYTES) {
		e = td_fail(eb, TD_EFORMAT, "module cache: %s: %lld bytes is not an entry", path,
			    (long long)st.st_size);
		goto out;
	}
	size_t total = (size_t)st.st_size;
	if (!(buf = malloc(total))) {
		e = td_fail(eb, TD_ENOMEM, "module cache: %s: out of memory", path);
		goto out;
	}
	size_t got = 0;
	while (got < total) {
		ssize_t r = read(fd, buf + got, total - got);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			e = errno_fail(eb, errno, path, "read");
			goto out;
		}
		if (r == 0)
			break;
		got += (size_t)r;
	}
	if (got != total) {
		e = td_fail(eb, TD_EFORMAT, "module cache: %s: shrank while read (%zu of %zu bytes)",
			    path, got, total);
		goto out;
	}
	if (memcmp(buf, magic, sizeof(magic)) != 0 || get_u32(buf + 8) != CU_MODCACHE_FORMAT ||
	    get_u32(buf + 12) != CU_MODCACHE_HEADER) {
		e = td_fail(eb, TD_EFORMAT, "module cache: %s: not an entry of format %d", path,
			    CU_MODCACHE_FORMAT);
		goto out;
	}
	uint64_t want = get_u64(buf + 16);
	if (want != total - CU_MODCACHE_HEADER) {
		e = td_fail(eb, TD_EFORMAT,
			    "module cache: %s: truncated or padded: the header says %llu bytes of "
			    "cubin, the file holds %zu",
			    path, (unsigned long long)want, total - CU_MODCACHE_HEADER);
		goto out;
	}
	if (memcmp(buf + 24, key, CU_SHA256_BYTES) != 0) {
		e = td_fail(eb, TD_EMISMATCH, "module cache: %s: holds another key's entry", path);
		goto out;
	}
	unsigned char d[CU_SHA256_BYTES];
	if ((e = cu_sha256(d, buf + CU_MODCACHE_HEADER, total - CU_MODCACHE_HEADER, eb)) != TD_OK)
		goto out;
	if (memcmp(d, buf + 24 + CU_SHA256_BYTES, CU_SHA256_BYTES) != 0) {
		e = td_fail(eb, TD_EMISMATCH, "module cache: %s: the cubin's SHA-256 disagrees with "
					      "its header (corrupt)",
			    path);
		goto out;
	}
	memmove(buf, buf + CU_MODCACHE_HEADER, total - CU_MODCACHE_HEADER);
	*data = buf;
	*size = total - CU_MODCACHE_HEADER;
	buf = NULL;
	e = TD_OK;
out:
	free(buf);
	close(fd);
	return e;
}

/* mkdir -p, new directories 0700; path fits PATH_MAX (checked by the caller). */
static td_err mkdir_p(const char *path, struct td_errbuf *eb)
{
	char buf[PATH_MAX];
	snprintf(buf, sizeof(buf), "%s", path);
	for (char *p = buf + 1;; p++) {
		if (*p != '/' && *p != '\0')
			continue;
		char c = *p;
		*p = '\0';
		if (mkdir(buf, 0700) < 0 && errno != EEXIST)
			return errno_fail(eb, errno, buf, "mkdir");
		*p = c;
		if (!c)
			break;
	}
	return TD_OK;
}

static td_err write_all(int fd, const void *p, size_t n, const char *path, struct td_errbuf *eb)
{
	const unsigned char *b = p;
	while (n) {
		ssize_t w = write(fd, b, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return errno_fail(eb, errno, path, "write");
		b += w;
		n -= (size_t)w;
	}
	return TD_OK;
}

td_err cu_cache_write(const char *dir, const unsigned char key[CU_SHA256_BYTES], const void *data,
		      size_t size, struct td_errbuf *eb)
{
	char path[PATH_MAX], mdir[PATH_MAX], tmp[PATH_MAX + 16];
	td_err e = cu_cache_path(path, sizeof(path), dir, key, eb);
	if (e != TD_OK)
		return e;
	if (size > CU_MODCACHE_MAX_BYTES)
		return td_fail(eb, TD_ERANGE, "module cache: %s: a %zu-byte cubin is too big", path, size);
	snprintf(mdir, sizeof(mdir), "%s/modules", dir); /* shorter than path */
	if ((e = mkdir_p(mdir, eb)) != TD_OK)
		return e;

	unsigned char h[CU_MODCACHE_HEADER] = {0};
	memcpy(h, magic, sizeof(magic));
	put_u32(h + 8, CU_MODCACHE_FORMAT);
	put_u32(h + 12, CU_MODCACHE_HEADER);
	put_u64(h + 16, size);
	memcpy(h + 24, key, CU_SHA256_BYTES);
	if ((e = cu_sha256(h + 24 + CU_SHA256_BYTES, data, size, eb)) != TD_OK)
		return e;
	_Static_assert(24 + 2 * CU_SHA256_BYTES == CU_MODCACHE_HEADER, "the header's layout");

	snprintf(tmp, sizeof(tmp), "%s.XXXXXX", path);
	int fd = mkostemp(tmp, O_CLOEXEC);
	if (fd < 0)
		return errno_fail(eb, errno, tmp, "mkostemp");
	if ((e = write_all(fd, h, sizeof(h), tmp, eb)) == TD_OK &&
	    (e = write_all(fd, data, size, tmp, eb)) == TD_OK && fsync(fd) < 0)
		e = errno_fail(eb, errno, tmp, "fsync");
	if (close(fd) < 0 && e == TD_OK)
		e = errno_fail(eb, errno, tmp, "close");
	if (e == TD_OK && rename(tmp, path) < 0)
		e = errno_fail(eb, errno, path, "rename");
	if (e != TD_OK) {
		unlink(tmp);
		return e;
	}
	/* The rename is durable once the directory is. */
	int dfd = open(mdir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0)
		return errno_fail(eb, errno, mdir, "open");
	if (fsync(dfd) < 0)
		e = errno_fail(eb, errno, mdir, "fsync");
	close(dfd);
	return e;
}
