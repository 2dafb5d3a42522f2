/* Tier 2 of the module cache (contract 3): cubins compiled on this host,
 * kept in files that verify themselves.
 *
 * A key is one function (cu_cache_key) of everything that decides the cubin:
 * the PTX bytes, the JIT options, the device's compute capability, the driver
 * version and CU_MODCACHE_FORMAT. An entry is <dir>/modules/<hex key>.cubin:
 * a header of CU_MODCACHE_HEADER bytes, then the cubin. The header holds, little-
 * endian: the magic "TDMODC\0\0" (8 bytes), the format (u32), the header size
 * (u32), the cubin's size (u64), the key (32 bytes) and the SHA-256 of the
 * cubin (32 bytes). A file is trusted only when every field agrees with the key
 * it was looked up by and with the bytes that follow; anything else (a bad
 * digest, a truncated file, another key's entry) is reported as untrusted and
 * the caller rebuilds it. Writes are atomic: temp file, fsync, rename, fsync of
 * the directory — a reader sees the old entry or the new one, never a mix.
 *
 * Plain C and libcrypto, no CUDA: the backend (cuda_backend.c) and the unit
 * test (tests/unit/test_modcache.c) share it. Not the sqlite index: that is
 * state/'s module_cache table; these files need no index to be checked. */
#ifndef GPU_CUDA_MODCACHE_H
#define GPU_CUDA_MODCACHE_H

#include <stddef.h>

#include "proto/err.h"

/* Bump when the key's inputs or the file layout change: old entries then
 * stop matching (their keys differ) and are rebuilt. */
#define CU_MODCACHE_FORMAT 1
#define CU_MODCACHE_HEADER 88
#define CU_SHA256_BYTES 32
/* The largest cubin read back: anything bigger is not one of ours. */
#define CU_MODCACHE_MAX_BYTES ((size_t)1 << 30)

struct cu_cache_key_in {
	const void *ptx;         /* the PTX text as handed to the JIT */
	size_t ptx_size;
	const char *options;     /* the JIT options, as text (see cuda_backend.c); NULL = "" */
	int cc_major, cc_minor;  /* the device's compute capability */
	int driver_version;      /* cuDriverGetVersion */
};

/* key = SHA-256 of: "traind-modcache-key" and its NUL, then as u32 LE
 * CU_MODCACHE_FORMAT, cc_major, cc_minor, driver_version, then as u64 LE the
 * length of options followed by its bytes, then the length of the PTX
 * followed by its bytes. The only place keys are made. TD_EINTERNAL if
 * libcrypto fails. */
td_err cu_cache_key(unsigned char key[CU_SHA256_BYTES], const struct cu_cache_key_in *in,
		    struct td_errbuf *eb);

/* SHA-256 of data. TD_EINTERNAL if libcrypto fails. */
td_err cu_sha256(unsigned char out[CU_SHA256_BYTES], const void *data, size_t size,
		 struct td_errbuf *eb);

/* Lowercase hex of a digest: 64 characters and a NUL. */
void cu_hex(char out[2 * CU_SHA256_BYTES + 1], const unsigned char d[CU_SHA256_BYTES]);

/* The entry's path, <dir>/modules/<hex key>.cubin. TD_EINVAL if it does not fit. */
td_err cu_cache_path(char *out, size_t cap, const char *dir, const unsigned char key[CU_SHA256_BYTES],
		     struct td_errbuf *eb);

/* Reads the entry for key under dir. TD_OK: *data (malloc'd, the caller frees)
 * holds the verified cubin, *size its bytes. TD_ENOENT: no entry (a miss).
 * TD_EFORMAT (not an entry of this format, truncated, too big) or TD_EMISMATCH
 * (another key's entry, or the digest disagrees): untrusted, to be rebuilt.
 * TD_EIO, TD_EPERM: the file cannot be read. TD_ENOMEM. eb names the file. */
td_err cu_cache_read(const char *dir, const unsigned char key[CU_SHA256_BYTES], void **data,
		     size_t *size, struct td_errbuf *eb);

/* Writes the entry for key under dir (creating dir/modules and any missing
 * parent, mode 0700), replacing any old one atomically. No temp file is left
 * behind, on success or failure. eb names the file and the failing call. */
td_err cu_cache_write(const char *dir, const unsigned char key[CU_SHA256_BYTES], const void *data,
		      size_t size, struct td_errbuf *eb);

#endif
