/* The CUDA module's use of the module cache, without a GPU: the module is
 * loaded against a fake driver (fake_libcuda.c, found through
 * LD_LIBRARY_PATH), which logs every JIT link and module load. Checked: a
 * device with a cubin loads it and touches no cache; TD_CUDA_FORCE_PTX=1
 * takes the PTX path; without a cache dir every backend compiles; with one,
 * the first compiles and writes one verified entry and the next loads it
 * without compiling; another driver version is another key; a corrupt,
 * truncated or driver-refused entry is compiled again and replaced; an
 * unwritable cache dir costs a compile, never the backend.
 * usage: test_modcache_backend LIBTRAIND-CUDA.SO */
#include "gpu/cuda/modcache.h"

#include "tests/check.h"

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

struct gpu_backend;
typedef td_err (*new_opts_fn)(struct gpu_backend **out, int ordinal, const char *cache_dir,
			      struct td_errbuf *eb);
typedef void (*free_fn)(struct gpu_backend *be);

static char tmpdir[128], logpath[256], cache[256], mdir[300];
static new_opts_fn backend_new;

/* Creates a backend (which fails at cuBLAS on the fake) and returns the
 * driver calls it made, one per line, in log (cap bytes). */
static void create(const char *cache_dir, char *log, size_t cap)
{
	unlink(logpath);
	struct gpu_backend *be = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = backend_new(&be, 0, cache_dir, &eb);
	CHECK_MSG(e != TD_OK, "the fake driver cannot serve cuBLAS, yet the backend was created");
	CHECK_MSG(!strstr(eb.msg, "kernel"), "backend creation failed at the kernels: %s", eb.msg);
	FILE *f = fopen(logpath, "r");
	size_t n = f ? fread(log, 1, cap - 1, f) : 0;
	log[n] = '\0';
	if (f)
		fclose(f);
}

static int count(const char *hay, const char *needle)
{
	int n = 0;
	for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

/* The entries in the cache: their number; the path of the first, which must
 * verify as the entry of the key its name says. */
static int entries(char *first, size_t cap)
{
	DIR *d = opendir(mdir);
	int n = 0;
	for (struct dirent *de; d && (de = readdir(d));) {
		size_t len = strlen(de->d_name);
		if (len != 64 + 6 || strcmp(de->d_name + 64, ".cubin") != 0)
			continue;
		n++;
		unsigned char key[CU_SHA256_BYTES];
		for (int i = 0; i < CU_SHA256_BYTES; i++)
			sscanf(de->d_name + 2 * i, "%2hhx", &key[i]);
		void *data = NULL;
		size_t size = 0;
		struct td_errbuf eb = {{0}};
		td_err e = cu_cache_read(cache, key, &data, &size, &eb);
		if (first && n == 1)
			snprintf(first, cap, "%s/%s", mdir, de->d_name);
		if (e == TD_OK) { /* (a corrupted one is the cases' business) */
			CHECK_MSG(size > 10 && memcmp(data, "FAKECUBIN:", 10) == 0,
				  "%s does not hold the JIT's cubin", de->d_name);
			free(data);
		}
	}
	if (d)
		closedir(d);
	return n;
}

static void flip(const char *path, long off)
{
	FILE *f = fopen(path, "r+b");
	CHECK(f != NULL);
	if (!f)
		return;
	fseek(f, off, SEEK_SET);
	int c = fgetc(f);
	fseek(f, off, SEEK_SET);
	fputc(c ^ 0x20, f);
	fclose(f);
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: test_modcache_backend LIBTRAIND-CUDA.SO\n");
		return 2;
	}
	const char *base = getenv("TMPDIR");
	snprintf(tmpdir, sizeof(tmpdir), "%s/td-mcbe-XXXXXX",
		 base && *base && strlen(base) < 80 ? base : "/tmp");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "mkdtemp %s: %s\n", tmpdir, strerror(errno));
		return 1;
	}
	snprintf(logpath, sizeof(logpath), "%s/driver.log", tmpdir);
	snprintf(cache, sizeof(cache), "%s/cache", tmpdir);
	snprintf(mdir, sizeof(mdir), "%s/modules", cache);
	setenv("FAKE_LOG", logpath, 1);
	unsetenv("FAKE_DRV");
	unsetenv("FAKE_REFUSE");
	unsetenv("FAKE_CC");
	unsetenv("TD_CUDA_FORCE_PTX");
	void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		fprintf(stderr, "%s\n", dlerror());
		return 1;
	}
	backend_new = (new_opts_fn)dlsym(h, "gpu_cuda_backend_new_opts");
	CHECK(backend_new != NULL);
	if (!backend_new)
		return check_status();

	char log[4096], path[600];

	/* sm_90 has a cubin: loaded as is, the cache untouched. */
	create(cache, log, sizeof(log));
	CHECK_STR_EQ(log, "load elf\n");
	CHECK_EQ_INT(entries(NULL, 0), 0);

	/* Forced PTX without a cache: a compile every time. */
	setenv("TD_CUDA_FORCE_PTX", "1", 1);
	for (int i = 0; i < 2; i++) {
		create(NULL, log, sizeof(log));
		CHECK_EQ_INT(count(log, "link"), 1);
		CHECK_EQ_INT(count(log, "load FAKECUBIN"), 1);
	}
	CHECK_EQ_INT(entries(NULL, 0), 0);

	/* With a cache: compiled once, with the options of the key, then loaded. */
	create(cache, log, sizeof(log));
	CHECK_CONTAINS(log, "link n=1 opt0=7 val0=4"); /* CU_JIT_OPTIMIZATION_LEVEL = 4 */
	CHECK_EQ_INT(count(log, "link"), 1);
	CHECK_EQ_INT(entries(path, sizeof(path)), 1);
	for (int i = 0; i < 2; i++) {
		create(cache, log, sizeof(log));
		CHECK_EQ_INT(count(log, "link"), 0);
		CHECK_EQ_INT(count(log, "load FAKECUBIN"), 1);
	}

	/* Another driver version, another device: other keys, compiled once each. */
	setenv("FAKE_DRV", "12090", 1);
	create(cache, log, sizeof(log));
	CHECK_EQ_INT(count(log, "link"), 1);
	CHECK_EQ_INT(entries(NULL, 0), 2);
	create(cache, log, sizeof(log));
	CHECK_EQ_INT(count(log, "link"), 0);
	setenv("FAKE_CC", "100", 1);
	create(cache, log, sizeof(log));
	CHECK_EQ_INT(count(log, "link"), 1);
	CHECK_EQ_INT(entries(NULL, 0), 3);
	unsetenv("FAKE_CC");
	unsetenv("FAKE_DRV");

	/* The first entry (driver 12080's, as path says) corrupted three ways:
	 * each is compiled again, replaced, and trusted after. */
	create(cache, log, sizeof(log));
	CHECK_EQ_INT(count(log, "link"), 0);
	struct stat st;
	CHECK(stat(path, &st) == 0);
	char cmd[128];
	for (int how = 0; how < 3; how++) {
		if (how == 0)
			flip(path, st.st_size - 3); /* a cubin byte */
		else if (how == 1)
			CHECK(truncate(path, st.st_size - 1) == 0);
		else { /* a verified file that the driver refuses (once) */
			char marker[300];
			snprintf(marker, sizeof(marker), "%s/refuse", tmpdir);
			FILE *m = fopen(marker, "w");
			CHECK(m != NULL);
			if (m)
				fclose(m);
			setenv("FAKE_REFUSE", marker, 1);
		}
		create(cache, log, sizeof(log));
		snprintf(cmd, sizeof(cmd), "corruption %d", how);
		CHECK_MSG(count(log, "link") == 1, "%s: %d compiles, want 1", cmd, count(log, "link"));
		if (how == 2)
			CHECK_CONTAINS(log, "refused");
		unsetenv("FAKE_REFUSE");
		create(cache, log, sizeof(log));
		CHECK_MSG(count(log, "link") == 0, "%s: the rebuilt entry is not trusted", cmd);
		CHECK_EQ_INT(entries(NULL, 0), 3);
	}

	/* An unwritable cache costs a compile each time, not the backend. */
	char file[300];
	snprintf(file, sizeof(file), "%s/driver.log.notadir", tmpdir);
	FILE *f = fopen(file, "w");
	if (f)
		fclose(f);
	for (int i = 0; i < 2; i++) {
		create(file, log, sizeof(log));
		CHECK_EQ_INT(count(log, "link"), 1);
		CHECK_EQ_INT(count(log, "load FAKECUBIN"), 1);
	}

	unsetenv("TD_CUDA_FORCE_PTX");
	check_rm_tree(tmpdir);
	return check_status();
}
