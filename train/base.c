/* Frozen bases shared by the models of one process (train/base.h). */
#include "train/base.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/plan.h"

enum { BASE_LOADING, BASE_READY };

struct tr_base {
	struct tr_base *next;
	char *key;
	int device;
	char sig[65];
	void *ptr;
	size_t bytes;
	int refs;      /* models that acquired it and have not released it */
	int state;     /* BASE_LOADING until the loader's tr_base_ready */
};

struct tr_bases {
	pthread_mutex_t mu;
	pthread_cond_t cv; /* an entry became ready or was dropped */
	struct tr_base *head;
};

td_err tr_bases_new(struct tr_bases **out, struct td_errbuf *eb)
{
	struct tr_bases *r = calloc(1, sizeof(*r));
	if (!r)
		return td_fail(eb, TD_ENOMEM, "bases: out of memory");
	pthread_mutex_init(&r->mu, NULL);
	pthread_cond_init(&r->cv, NULL);
	*out = r;
	return TD_OK;
}

void tr_bases_free(struct tr_bases *r)
{
	if (!r)
		return;
	assert(!r->head);
	pthread_cond_destroy(&r->cv);
	pthread_mutex_destroy(&r->mu);
	free(r);
}

static struct tr_base *find(struct tr_bases *r, const char *key, int device)
{
	for (struct tr_base *b = r->head; b; b = b->next)
		if (b->device == device && strcmp(b->key, key) == 0)
			return b;
	return NULL;
}

static void unlink_entry(struct tr_bases *r, struct tr_base *b)
{
	for (struct tr_base **pp = &r->head; *pp; pp = &(*pp)->next)
		if (*pp == b) {
			*pp = b->next;
			return;
		}
}

td_err tr_bases_acquire(struct tr_bases *r, struct gpu_backend *be, int device, const char *key,
			const char sig[65], size_t bytes, struct tr_base **out, bool *load,
			struct td_errbuf *eb)
{
	if (!gpu_can_share(be))
		return td_fail(eb, TD_EUNSUPPORTED, "bases: the %s backend cannot share memory",
			       be->ops->name);
	pthread_mutex_lock(&r->mu);
	struct tr_base *b;
	for (;;) {
		b = find(r, key, device);
		if (!b || b->state == BASE_READY)
			break;
		/* Being loaded: wait for the loader's tr_base_ready. */
		pthread_cond_wait(&r->cv, &r->mu);
	}
	if (b) {
		if (strcmp(b->sig, sig) != 0 || b->bytes != bytes) {
			pthread_mutex_unlock(&r->mu);
			return td_fail(eb, TD_EMISMATCH,
				       "bases: the shared base %s holds another layout (%zu bytes, "
				       "signature %.16s) than this model's (%zu bytes, %.16s)",
				       key, b->bytes, b->sig, bytes, sig);
		}
		b->refs++;
		pthread_mutex_unlock(&r->mu);
		*out = b;
		*load = false;
		return TD_OK;
	}
	b = calloc(1, sizeof(*b));
	char *k = strdup(key);
	td_err e = b && k ? gpu_share_alloc(be, bytes, &b->ptr) : TD_ENOMEM;
	if (e != TD_OK) {
		pthread_mutex_unlock(&r->mu);
		free(k);
		free(b);
		char h[32];
		return td_fail(eb, e, "bases: cannot allocate a shared base of %s on %s",
			       tr_fmt_bytes(h, sizeof(h), bytes), be->ops->name);
	}
	b->key = k;
	b->device = device;
	memcpy(b->sig, sig, 65);
	b->bytes = bytes;
	b->refs = 1;
	b->state = BASE_LOADING;
	b->next = r->head;
	r->head = b;
	pthread_mutex_unlock(&r->mu);
	*out = b;
	*load = true;
	return TD_OK;
}

void *tr_base_ptr(const struct tr_base *b)
{
	return b->ptr;
}

size_t tr_base_bytes(const struct tr_base *b)
{
	return b->bytes;
}

/* The last reference gone: unlinked and freed (r->mu held). */
static void drop_locked(struct tr_bases *r, struct tr_base *b, struct gpu_backend *be)
{
	if (--b->refs > 0)
		return;
	unlink_entry(r, b);
	gpu_share_free(be, b->ptr, b->bytes);
	free(b->key);
	free(b);
}

void tr_base_ready(struct tr_bases *r, struct tr_base *b, struct gpu_backend *be, td_err e,
		   bool *sealed)
{
	bool ro = false;
	if (e == TD_OK) {
		struct td_errbuf eb = {{0}};
		ro = gpu_share_seal(be, b->ptr, b->bytes, &eb) == TD_OK;
	}
	pthread_mutex_lock(&r->mu);
	if (e == TD_OK) {
		b->state = BASE_READY;
	} else {
		/* Waiters take no reference before it is ready: the loader's is
		 * the only one, and the first waiter to wake loads it anew. */
		assert(b->refs == 1);
		drop_locked(r, b, be);
	}
	pthread_cond_broadcast(&r->cv);
	pthread_mutex_unlock(&r->mu);
	if (sealed)
		*sealed = ro;
}

void tr_bases_release(struct tr_bases *r, struct tr_base *b, struct gpu_backend *be)
{
	if (!b)
		return;
	pthread_mutex_lock(&r->mu);
	drop_locked(r, b, be);
	pthread_mutex_unlock(&r->mu);
}

int tr_bases_refs(struct tr_bases *r, const char *key, int device)
{
	pthread_mutex_lock(&r->mu);
	struct tr_base *b = find(r, key, device);
	int n = b ? b->refs : 0;
	pthread_mutex_unlock(&r->mu);
	return n;
}

void tr_bases_stat(struct tr_bases *r, size_t *entries, size_t *bytes)
{
	size_t n = 0, t = 0;
	pthread_mutex_lock(&r->mu);
	for (struct tr_base *b = r->head; b; b = b->next) {
		n++;
		t += b->bytes;
	}
	pthread_mutex_unlock(&r->mu);
	*entries = n;
	*bytes = t;
}

/* ------------------------------------------------------------------------ */
/* The files' digest */

struct digest_memo {
	struct digest_memo *next;
	dev_t dev;
	ino_t ino;
	off_t size;
	struct timespec mtime, ctime;
	unsigned char sha[32];
};

static pthread_mutex_t memo_mu = PTHREAD_MUTEX_INITIALIZER;
static struct digest_memo *memo_head;

static bool memo_match(const struct digest_memo *d, const struct stat *st)
{
	return d->dev == st->st_dev && d->ino == st->st_ino && d->size == st->st_size &&
	       d->mtime.tv_sec == st->st_mtim.tv_sec && d->mtime.tv_nsec == st->st_mtim.tv_nsec &&
	       d->ctime.tv_sec == st->st_ctim.tv_sec && d->ctime.tv_nsec == st->st_ctim.tv_nsec;
}

/* SHA-256 of one file's bytes, from the memo or read (memo_mu held: two
 * jobs of the same files read them once). */
static td_err file_sha(const char *path, unsigned char sha[32], off_t *size, struct td_errbuf *eb)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "%s: %s", path, strerror(errno));
	struct stat st;
	if (fstat(fd, &st) != 0) {
		int err = errno;
		close(fd);
		return td_fail(eb, td_from_errno(err), "%s: %s", path, strerror(err));
	}
	*size = st.st_size;
	for (struct digest_memo *d = memo_head; d; d = d->next)
		if (memo_match(d, &st)) {
			memcpy(sha, d->sha, 32);
			close(fd);
			return TD_OK;
		}
	enum { CHUNK = 8 << 20 };
	unsigned char *buf = malloc(CHUNK);
	EVP_MD_CTX *c = EVP_MD_CTX_new();
	td_err e = TD_OK;
	if (!buf || !c || !EVP_DigestInit_ex(c, EVP_sha256(), NULL)) {
		e = td_fail(eb, TD_ENOMEM, "%s: cannot start a SHA-256", path);
		goto out;
	}
	for (;;) {
		ssize_t n = read(fd, buf, CHUNK);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			e = td_fail(eb, td_from_errno(errno), "%s: %s", path, strerror(errno));
			goto out;
		}
		if (n == 0)
			break;
		EVP_DigestUpdate(c, buf, (size_t)n);
	}
	unsigned int len = 0;
	if (!EVP_DigestFinal_ex(c, sha, &len) || len != 32) {
		e = td_fail(eb, TD_EINTERNAL, "%s: SHA-256 failed", path);
		goto out;
	}
	struct digest_memo *d = calloc(1, sizeof(*d));
	if (d) {
		*d = (struct digest_memo){memo_head, st.st_dev, st.st_ino, st.st_size, st.st_mtim,
					  st.st_ctim, {0}};
		memcpy(d->sha, sha, 32);
		memo_head = d;
	}
out:
	EVP_MD_CTX_free(c);
	free(buf);
	close(fd);
	return e;
}

static bool weight_file(const char *n)
{
	size_t l = strlen(n);
	return strcmp(n, "config.json") == 0 || strcmp(n, "model.safetensors.index.json") == 0 ||
	       (l > 12 && strcmp(n + l - 12, ".safetensors") == 0);
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
	return strcmp((*a)->d_name, (*b)->d_name);
}

static int pick(const struct dirent *d)
{
	return weight_file(d->d_name);
}

td_err tr_base_files_digest(const char *model_dir, char out[65], struct td_errbuf *eb)
{
	struct dirent **names = NULL;
	int n = scandir(model_dir, &names, pick, by_name);
	if (n < 0)
		return td_fail(eb, td_from_errno(errno), "%s: %s", model_dir, strerror(errno));
	EVP_MD_CTX *c = EVP_MD_CTX_new();
	td_err e = TD_OK;
	if (!c || !EVP_DigestInit_ex(c, EVP_sha256(), NULL))
		e = td_fail(eb, TD_ENOMEM, "%s: cannot start a SHA-256", model_dir);
	pthread_mutex_lock(&memo_mu);
	for (int i = 0; i < n && e == TD_OK; i++) {
		char path[4096];
		snprintf(path, sizeof(path), "%s/%s", model_dir, names[i]->d_name);
		unsigned char sha[32];
		off_t size = 0;
		if ((e = file_sha(path, sha, &size, eb)) != TD_OK)
			break;
		char line[512];
		int len = snprintf(line, sizeof(line), "%s %lld ", names[i]->d_name, (long long)size);
		EVP_DigestUpdate(c, line, (size_t)len);
		EVP_DigestUpdate(c, sha, 32);
	}
	pthread_mutex_unlock(&memo_mu);
	unsigned char d[32];
	unsigned int len = 0;
	if (e == TD_OK && (!EVP_DigestFinal_ex(c, d, &len) || len != 32))
		e = td_fail(eb, TD_EINTERNAL, "%s: SHA-256 failed", model_dir);
	if (e == TD_OK)
		for (int i = 0; i < 32; i++)
			snprintf(out + 2 * i, 3, "%02x", d[i]);
	EVP_MD_CTX_free(c);
	for (int i = 0; i < n; i++)
		free(names[i]);
	free(names);
	return e;
}
