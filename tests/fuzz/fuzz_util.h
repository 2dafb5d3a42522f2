/* Helpers the file-parser fuzz targets share: a private scratch directory
 * (tmpfs where there is one, so a run costs no disk I/O), writing an input
 * out as a file, and cutting an input into parts at a separator.
 *
 * Not a fuzzing framework: libFuzzer drives each target; this only turns its
 * bytes into the files the parsers read by path. */
#ifndef TESTS_FUZZ_FUZZ_UTIL_H
#define TESTS_FUZZ_FUZZ_UTIL_H

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char fuzz_dir_[PATH_MAX];

/* Removes every plain file in dir (the targets make no subdirectories but
 * those they remove themselves). */
static inline void fuzz_clear_dir(const char *dir)
{
	DIR *d = opendir(dir);
	if (!d)
		return;
	struct dirent *e;
	char p[PATH_MAX];
	while ((e = readdir(d))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
		if (unlink(p) != 0) {
			fuzz_clear_dir(p);
			rmdir(p);
		}
	}
	closedir(d);
}

static inline void fuzz_remove_dir_(void)
{
	if (fuzz_dir_[0]) {
		fuzz_clear_dir(fuzz_dir_);
		rmdir(fuzz_dir_);
	}
}

/* The process's scratch directory, made on first use and removed at exit:
 * /dev/shm when writable, else $TMPDIR or /tmp. Aborts if none can be made
 * (a harness fault, not a finding). */
static inline const char *fuzz_dir(void)
{
	if (fuzz_dir_[0])
		return fuzz_dir_;
	const char *bases[] = { "/dev/shm", getenv("TMPDIR"), "/tmp" };
	for (size_t i = 0; i < sizeof(bases) / sizeof(bases[0]); i++) {
		if (!bases[i] || access(bases[i], W_OK) != 0)
			continue;
		snprintf(fuzz_dir_, sizeof(fuzz_dir_), "%s/td-fuzz.XXXXXX", bases[i]);
		if (mkdtemp(fuzz_dir_)) {
			atexit(fuzz_remove_dir_);
			return fuzz_dir_;
		}
	}
	fprintf(stderr, "fuzz: cannot make a scratch directory\n");
	abort();
}

/* dir/name in buf (PATH_MAX). */
static inline const char *fuzz_path(char *buf, const char *name)
{
	snprintf(buf, PATH_MAX, "%s/%s", fuzz_dir(), name);
	return buf;
}

/* Writes (replaces) path with n bytes. Aborts on failure (a harness fault). */
static inline void fuzz_write(const char *path, const void *data, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	const char *p = data;
	while (fd >= 0 && n) {
		ssize_t w = write(fd, p, n);
		if (w <= 0) {
			close(fd);
			fd = -1;
			break;
		}
		p += w;
		n -= (size_t)w;
	}
	if (fd < 0 || close(fd) != 0) {
		fprintf(stderr, "fuzz: cannot write %s\n", path);
		abort();
	}
}

/* The next part of [*at, end) up to sep (or the end): *part, *len; *at moves
 * past the separator. False when nothing is left. */
static inline bool fuzz_next_part(const uint8_t **at, const uint8_t *end, const char *sep, const uint8_t **part,
				  size_t *len)
{
	if (!*at)
		return false;
	size_t sl = strlen(sep);
	const uint8_t *s = *at;
	const uint8_t *hit = memmem(s, (size_t)(end - s), sep, sl);
	*part = s;
	*len = hit ? (size_t)(hit - s) : (size_t)(end - s);
	*at = hit ? hit + sl : NULL;
	return true;
}

/* A NUL-terminated malloc'd copy of n bytes (aborts when out of memory). */
static inline char *fuzz_strndup(const void *p, size_t n)
{
	char *s = malloc(n + 1);
	if (!s)
		abort();
	if (n)
		memcpy(s, p, n);
	s[n] = '\0';
	return s;
}

#endif
