/* Files that shrink under a reader that maps them (train/mapguard.h): a
 * user truncating their dataset or model while a job runs gets that job an
 * error naming the file, and the daemon lives on. Each case maps a real file,
 * truncates it, and reads through the public entry points that use the
 * guard; a SIGBUS outside any guard must still kill the process (checked in
 * a child), so the handler hides no other crash. */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/check.h"
#include "train/data.h"
#include "train/mapguard.h"
#include "train/safetensors.h"

static char dir[] = "/tmp/td-mapguard.XXXXXX";

static void path_in(char *buf, size_t size, const char *name)
{
	snprintf(buf, size, "%s/%s", dir, name);
}

static void write_bytes(const char *path, const void *data, size_t n)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, n, f) != n || fclose(f) != 0) {
		perror(path);
		exit(2);
	}
}

static void shrink(const char *path, off_t size)
{
	if (truncate(path, size) != 0) {
		perror(path);
		exit(2);
	}
}

/* A page of a mapping past the file's new end: tr_map_copy and tr_map_chr
 * fail with TD_EIO and the file's name; the bytes still there read fine. */
static void test_primitives(void)
{
	char path[512];
	path_in(path, sizeof(path), "raw.bin");
	long page = sysconf(_SC_PAGESIZE);
	size_t n = 4 * (size_t)page;
	char *data = malloc(n);
	memset(data, 'x', n);
	write_bytes(path, data, n);
	int fd = open(path, O_RDONLY);
	CHECK(fd >= 0);
	const char *map = mmap(NULL, n, PROT_READ, MAP_PRIVATE, fd, 0);
	close(fd);
	CHECK(map != MAP_FAILED);
	shrink(path, page);

	struct td_errbuf eb = {{0}};
	char head[16];
	CHECK_EQ_INT(tr_map_copy(head, map, sizeof(head), path, "reading", &eb), TD_OK);
	CHECK(memcmp(head, "xxxxxxxxxxxxxxxx", 16) == 0);
	CHECK_EQ_INT(tr_map_copy(data, map, n, path, "reading", &eb), TD_EIO);
	CHECK_CONTAINS(eb.msg, path);
	CHECK_CONTAINS(eb.msg, "shrank");
	const char *nl = map;
	CHECK_EQ_INT(tr_map_chr(&nl, map, '\n', n, path, &eb), TD_EIO);
	/* the guard is gone after it fired: a second one works the same */
	CHECK_EQ_INT(tr_map_copy(data, map + 2 * page, 8, NULL, "again", &eb), TD_EIO);
	CHECK_CONTAINS(eb.msg, "again: the file shrank");
	munmap((void *)map, n);
	free(data);
}

/* A token file cut short after the dataset opened: the next batch is an
 * error naming the file. */
static void test_token_file(void)
{
	char path[512];
	path_in(path, sizeof(path), "tokens.bin");
	size_t n = 1 << 16; /* 256 KiB of ids */
	uint32_t *ids = malloc(n * sizeof(uint32_t));
	for (size_t i = 0; i < n; i++)
		ids[i] = (uint32_t)(i % 1000);
	write_bytes(path, ids, n * sizeof(uint32_t));
	struct tr_data_opts o = {.path = path, .T = 64, .vocab = 1000, .seed = 1, .shuffle = true};
	struct tr_data *d = NULL;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_data_open(&d, &o, &eb), TD_OK);
	if (!d) {
		free(ids);
		return;
	}
	int32_t x[4 * 64], y[4 * 64];
	struct tr_data_pos pos = {0};
	CHECK_EQ_INT(tr_data_next(d, &pos, x, y, NULL, 4, &eb), TD_OK);
	shrink(path, 0);
	td_err e = TD_OK;
	for (int k = 0; k < 64 && e == TD_OK; k++) /* shuffled: some batch reads a lost page */
		e = tr_data_next(d, &pos, x, y, NULL, 4, &eb);
	CHECK_EQ_INT(e, TD_EIO);
	CHECK_CONTAINS(eb.msg, path);
	CHECK_CONTAINS(eb.msg, "shrank");
	CHECK_EQ_INT(tr_data_sequence(d, 0, x, y, NULL, &eb), TD_EIO);
	tr_data_close(d);
	free(ids);
}

/* A safetensors file cut short after it was opened: converting a tensor is
 * an error naming the file and the tensor. */
static void test_safetensors(void)
{
	char path[512];
	path_in(path, sizeof(path), "w.safetensors");
	size_t n = 1 << 16;
	float *w = malloc(n * sizeof(float));
	for (size_t i = 0; i < n; i++)
		w[i] = (float)i;
	struct tr_st_entry e = {.name = "model.w", .dtype = TR_DT_F32, .ndim = 1, .shape = {(int64_t)n}, .data = w};
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_st_write(path, &e, 1, NULL, &eb), TD_OK);
	struct tr_st_file *f = NULL;
	CHECK_EQ_INT(tr_st_open(&f, path, &eb), TD_OK);
	if (!f) {
		free(w);
		return;
	}
	const struct tr_st_tensor *t = tr_st_find(f, "model.w");
	CHECK(t != NULL);
	float *back = malloc(n * sizeof(float));
	CHECK_EQ_INT(tr_st_to_f32(back, t, &eb), TD_OK);
	CHECK(memcmp(back, w, n * sizeof(float)) == 0);
	shrink(path, 4096);
	CHECK_EQ_INT(tr_st_to_f32(back, t, &eb), TD_EIO);
	CHECK_CONTAINS(eb.msg, path);
	CHECK_CONTAINS(eb.msg, "model.w");
	tr_st_close(f);
	free(back);
	free(w);
}

/* With the handler installed, a SIGBUS outside every guard still kills the
 * process by SIGBUS (in a child). */
static void test_unguarded_still_dies(void)
{
	char path[512];
	path_in(path, sizeof(path), "bare.bin");
	long page = sysconf(_SC_PAGESIZE);
	char *data = calloc(2, (size_t)page);
	write_bytes(path, data, 2 * (size_t)page);
	free(data);
	pid_t pid = fork();
	if (pid == 0) {
		int fd = open(path, O_RDONLY);
		const volatile char *map = mmap(NULL, 2 * (size_t)page, PROT_READ, MAP_PRIVATE, fd, 0);
		if (map == MAP_FAILED)
			_exit(3);
		shrink(path, 0);
		char c = map[page]; /* no guard */
		(void)c;
		_exit(0);
	}
	int status = 0;
	CHECK(waitpid(pid, &status, 0) == pid);
	CHECK_MSG(WIFSIGNALED(status) && WTERMSIG(status) == SIGBUS,
		  "an unguarded SIGBUS: child status %#x, want death by SIGBUS", status);
}

int main(void)
{
	if (!mkdtemp(dir)) {
		perror("mkdtemp");
		return 1;
	}
	test_primitives();
	test_token_file();
	test_safetensors();
	test_unguarded_still_dies();
	check_rm_tree(dir);
	return check_status();
}
