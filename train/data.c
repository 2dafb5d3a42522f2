/* Token-file datasets: mmap, validate once, serve shuffled packed sequences. */
#include "train/data.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct tr_data {
	char *path;
	const uint8_t *map;
	size_t map_len;
	uint64_t ntokens, nseq;
	int T;
	uint64_t seed;
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

static uint32_t load_le32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

td_err tr_data_open_tokens(struct tr_data **out, const char *path, int T, int vocab, uint64_t seed,
			   struct td_errbuf *eb)
{
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
	uint64_t n = len / 4;
	for (uint64_t i = 0; i < n; i++) {
		uint32_t id = load_le32(map + 4 * i);
		if (id >= (uint32_t)vocab) {
			munmap((void *)map, len);
			return td_fail(eb, TD_ERANGE,
				       "%s: token %llu (byte offset %llu) is %u, outside the model's vocabulary of %d",
				       path, (unsigned long long)i, (unsigned long long)(4 * i), id, vocab);
		}
	}
	if (n < (uint64_t)T) {
		munmap((void *)map, len);
		return td_fail(eb, TD_EINVAL, "%s: %llu tokens, fewer than one sequence of %d", path,
			       (unsigned long long)n, T);
	}
	struct tr_data *d = calloc(1, sizeof(*d));
	uint64_t nseq = n / (uint64_t)T;
	uint64_t *perm = d ? malloc(nseq * sizeof(uint64_t)) : NULL;
	char *p = d ? strdup(path) : NULL;
	if (!d || !perm || !p) {
		free(d);
		free(perm);
		free(p);
		munmap((void *)map, len);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	}
	d->path = p;
	d->map = map;
	d->map_len = len;
	d->ntokens = n;
	d->nseq = nseq;
	d->T = T;
	d->seed = seed;
	d->perm = perm;
	d->perm_epoch = UINT64_MAX;
	*out = d;
	return TD_OK;
}

void tr_data_close(struct tr_data *d)
{
	if (!d)
		return;
	munmap((void *)d->map, d->map_len);
	free(d->perm);
	free(d->path);
	free(d);
}

uint64_t tr_data_num_sequences(const struct tr_data *d)
{
	return d->nseq;
}

uint64_t tr_data_num_tokens(const struct tr_data *d)
{
	return d->ntokens;
}

td_err tr_data_next(struct tr_data *d, struct tr_data_pos *pos, int32_t *ids, int32_t *labels,
		    int B, struct td_errbuf *eb)
{
	for (int b = 0; b < B; b++) {
		if (pos->index >= d->nseq) {
			pos->epoch++;
			pos->index = 0;
		}
		if (d->perm_epoch != pos->epoch)
			build_perm(d, pos->epoch);
		uint64_t seq = d->perm[pos->index++];
		const uint8_t *src = d->map + seq * (uint64_t)d->T * 4;
		for (int t = 0; t < d->T; t++) {
			int32_t id = (int32_t)load_le32(src + 4 * (size_t)t);
			ids[(size_t)b * d->T + t] = id;
			labels[(size_t)b * d->T + t] = id;
		}
	}
	(void)eb;
	return TD_OK;
}
