/* Unit test of the VRAM ledger in state/ (contract 7): holder identity from
 * /proc, the admission arithmetic (total × factor − reserved, and the device's
 * free memory), refusals that say why, release and renew permissions, expiry,
 * and reaping of holders that exited (zombie or reaped), whose pid was reused,
 * or that ran in another boot; gangs (several GPUs' leases granted together
 * or not at all), also from several processes at once. The multi-process
 * stress test of one GPU is test_ledger_stress.c.
 *
 * Expected values are computed here from the test's own bookkeeping. */
#include "state/state.h"

#include "tests/check.h"

#include <errno.h>
#include <ftw.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MiB (1ull << 20)
#define GiB (1ull << 30)

static char tmpdir[64];
static char dbpath[128];

static struct st_db *open_db(void)
{
	struct st_db *db = NULL;
	struct td_errbuf eb;
	if (st_open(&db, dbpath, NULL, &eb) != TD_OK) {
		fprintf(stderr, "st_open: %s\n", eb.msg);
		exit(1);
	}
	return db;
}

static int raw_exec(const char *sql)
{
	sqlite3 *h = NULL;
	int rc = sqlite3_open(dbpath, &h);
	if (rc == SQLITE_OK) {
		sqlite3_busy_timeout(h, 5000);
		rc = sqlite3_exec(h, sql, NULL, NULL, NULL);
	}
	if (rc != SQLITE_OK)
		fprintf(stderr, "raw sqlite: %s\n", sqlite3_errmsg(h));
	sqlite3_close(h);
	return rc;
}

static size_t lease_count(struct st_db *db, const char *gpu)
{
	struct st_lease *l = NULL;
	size_t n = 0;
	struct td_errbuf eb;
	if (st_ledger_list(db, gpu, &l, &n, &eb) != TD_OK)
		fprintf(stderr, "list: %s\n", eb.msg);
	free(l);
	return n;
}

static uint64_t reserved(struct st_db *db, const char *gpu)
{
	uint64_t b = UINT64_MAX;
	struct td_errbuf eb;
	if (st_ledger_reserved(db, gpu, &b, &eb) != TD_OK)
		fprintf(stderr, "reserved: %s\n", eb.msg);
	return b;
}

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
	nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------------ */

/* Field 22 of /proc/PID/stat, parsed here by a different route than
 * state/ledger.c: sscanf of the fields after the comm's closing paren. */
static unsigned long long start_time_of(pid_t pid)
{
	char path[64], buf[1024] = "";
	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	char *p = strrchr(buf, ')');
	unsigned long long v = 0;
	if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d "
				"%*d %*d %llu",
			&v) == 1)
		return v;
	return 0;
}

static void test_holder(void)
{
	struct st_holder h;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(st_holder_of(getpid(), &h, &eb), TD_OK);
	CHECK_EQ_INT(h.pid, getpid());
	CHECK_EQ_INT(h.start_time, start_time_of(getpid()));
	char boot[64] = "";
	FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
	if (f) {
		if (!fgets(boot, sizeof(boot), f))
			boot[0] = 0;
		fclose(f);
	}
	boot[strcspn(boot, "\n")] = 0;
	CHECK_STR_EQ(h.boot_id, boot);
	CHECK(st_holder_alive(&h));
	struct st_holder other = h;
	other.start_time++;
	CHECK(!st_holder_alive(&other));
	other = h;
	other.boot_id[0] = other.boot_id[0] == '0' ? '1' : '0';
	CHECK(!st_holder_alive(&other));

	/* A process that has exited and been waited for. */
	pid_t kid = fork();
	if (kid == 0)
		_exit(0);
	waitpid(kid, NULL, 0);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_holder_of(kid, &h, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "does not exist");
	CHECK_EQ_INT(st_holder_of(0, &h, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_holder_of(-5, &h, &eb), TD_EINVAL);
}

/* The admission arithmetic and its refusals. */
static void test_fit(void)
{
	struct st_db *db = open_db();
	struct td_errbuf eb = {{0}};
	/* 8 GiB × 0.75 = 6 GiB for the ledger. */
	struct st_device_cap cap = {.total_bytes = 8 * GiB, .factor = 0.75, .free_bytes_now = UINT64_MAX};
	const uint64_t limit = 6 * GiB;
	struct st_lease_req r = {.gpu_uuid = "GPU-fit", .uid = getuid(), .pid = getpid(), .label = "t"};
	int64_t l1 = 0, l2 = 0, l3 = 0, lx = -7;

	r.bytes = 4 * GiB;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &l1, &eb), TD_OK);
	r.bytes = 2 * GiB;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &l2, &eb), TD_OK);
	CHECK(l2 > l1 && l1 > 0);
	CHECK_EQ_INT(reserved(db, "GPU-fit"), limit);
	/* Full: one more byte is refused, and the message says why. */
	r.bytes = 1;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &lx, &eb), TD_EBUSY);
	CHECK_EQ_INT(lx, -7); /* untouched on failure */
	CHECK_CONTAINS(eb.msg, "GPU-fit");
	CHECK_CONTAINS(eb.msg, "1 B requested, 0 B available");
	CHECK_CONTAINS(eb.msg, "8.00 GiB \u00d7 0.75 \u2212 6.00 GiB reserved by 2 leases");
	/* Another device is not affected. */
	r.gpu_uuid = "GPU-other";
	r.bytes = limit;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &l3, &eb), TD_OK);
	r.gpu_uuid = "GPU-fit";
	/* Release 2 GiB: 2 GiB fit again, 2 GiB + 1 does not. */
	CHECK_EQ_INT(st_ledger_release(db, l2, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, "GPU-fit"), 4 * GiB);
	r.bytes = 2 * GiB + 1;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &lx, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "2.00 GiB available");
	r.bytes = 2 * GiB;
	/* ... and the device's free memory is respected too. */
	cap.free_bytes_now = 1 * GiB;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &lx, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "only 1.00 GiB free");
	cap.free_bytes_now = 2 * GiB;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &l2, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, "GPU-fit"), limit);

	/* factor 1: the whole device. */
	struct st_device_cap whole = {.total_bytes = 10 * MiB, .factor = 1.0, .free_bytes_now = UINT64_MAX};
	r.gpu_uuid = "GPU-whole";
	r.bytes = 10 * MiB;
	int64_t lw = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &whole, &lw, &eb), TD_OK);
	r.bytes = 1;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &whole, &lx, &eb), TD_EBUSY);

	/* Bad requests. */
	struct st_lease_req bad = r;
	bad.bytes = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &bad, &cap, &lx, &eb), TD_EINVAL);
	bad = r;
	bad.gpu_uuid = "";
	CHECK_EQ_INT(st_ledger_reserve(db, &bad, &cap, &lx, &eb), TD_EINVAL);
	bad = r;
	bad.pid = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &bad, &cap, &lx, &eb), TD_EINVAL);
	bad = r;
	bad.ttl_ms = -1;
	CHECK_EQ_INT(st_ledger_reserve(db, &bad, &cap, &lx, &eb), TD_EINVAL);
	bad = r;
	bad.job_id = 424242;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve(db, &bad, &whole, &lx, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "job 424242");
	struct st_device_cap badcap = cap;
	badcap.factor = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &badcap, &lx, &eb), TD_EINVAL);
	badcap.factor = 1.5;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &badcap, &lx, &eb), TD_EINVAL);
	badcap = cap;
	badcap.total_bytes = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &badcap, &lx, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_ledger_reserve(db, NULL, &cap, &lx, &eb), TD_EINVAL);
	CHECK_EQ_INT(lx, -7);

	/* The list: what was reserved, by whom. */
	struct st_lease *l;
	size_t n;
	CHECK_EQ_INT(st_ledger_list(db, "GPU-fit", &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	if (n == 2) {
		CHECK_EQ_INT(l[0].id, l1);
		CHECK_EQ_INT(l[0].bytes, 4 * GiB);
		CHECK_EQ_INT(l[0].uid, getuid());
		CHECK_EQ_INT(l[0].holder.pid, getpid());
		CHECK_EQ_INT(l[0].holder.start_time, start_time_of(getpid()));
		CHECK_EQ_INT(l[0].job_id, 0);
		CHECK_STR_EQ(l[0].label, "t");
		CHECK_EQ_INT(l[0].expires_ms, 0);
		CHECK(l[0].created_ms > 0 && l[0].heartbeat_ms == l[0].created_ms);
		CHECK_EQ_INT(l[1].id, l2);
	}
	free(l);
	CHECK_EQ_INT(lease_count(db, NULL), 4);
	CHECK_EQ_INT(st_ledger_release(db, l1, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_release(db, l2, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_release(db, l3, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_release(db, lw, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(lease_count(db, NULL), 0);
	st_close(db);
}

/* Who may release or renew, and leases of jobs. */
static void test_release(void)
{
	struct st_db *db = open_db();
	struct td_errbuf eb = {{0}};
	struct st_device_cap cap = {.total_bytes = GiB, .factor = 1.0, .free_bytes_now = UINT64_MAX};
	struct st_lease_req r = {.gpu_uuid = "GPU-rel", .bytes = MiB, .uid = 1000, .pid = getpid()};
	int64_t a, b, c;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &a, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &b, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &c, &eb), TD_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_release(db, a, 1001, false, &eb), TD_EPERM);
	CHECK_CONTAINS(eb.msg, "lease");
	CHECK_CONTAINS(eb.msg, "uid 1000");
	CHECK_EQ_INT(st_ledger_heartbeat(db, a, 1000, 1001, false, &eb), TD_EPERM);
	CHECK_EQ_INT(lease_count(db, "GPU-rel"), 3);
	CHECK_EQ_INT(st_ledger_release(db, a, 1000, false, &eb), TD_OK); /* the holder */
	CHECK_EQ_INT(st_ledger_release(db, b, 0, false, &eb), TD_OK);    /* root */
	CHECK_EQ_INT(st_ledger_release(db, c, 1001, true, &eb), TD_OK);  /* an admin */
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_release(db, a, 1000, false, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "does not exist");
	CHECK_EQ_INT(st_ledger_heartbeat(db, a, 1000, 1000, false, &eb), TD_ENOENT);
	CHECK_EQ_INT(reserved(db, "GPU-rel"), 0);

	/* A job's leases go together. */
	struct st_job_new nj = {.name = "j", .uid = 1000, .spec = "x", .spec_len = 1};
	int64_t job;
	CHECK_EQ_INT(st_job_submit(db, &nj, &job, &eb), TD_OK);
	r.job_id = job;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &a, &eb), TD_OK);
	r.gpu_uuid = "GPU-rel2";
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &b, &eb), TD_OK);
	r.job_id = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &c, &eb), TD_OK);
	size_t n = 0;
	CHECK_EQ_INT(st_ledger_release_job(db, job, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	CHECK_EQ_INT(lease_count(db, NULL), 1);
	CHECK_EQ_INT(st_ledger_release_job(db, job, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	CHECK_EQ_INT(st_ledger_release(db, c, 1000, false, &eb), TD_OK);

	/* The safety net: a job leaving the active states takes its leases along;
	 * while active it keeps them. */
	CHECK_EQ_INT(st_job_transition(db, job, ST_QUEUED, ST_ADMITTED, NULL, "cuda:0", &eb), TD_OK);
	r.job_id = job;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &a, &eb), TD_OK);
	CHECK_EQ_INT(st_job_transition(db, job, ST_ADMITTED, ST_PREPARING, NULL, NULL, &eb), TD_OK);
	CHECK_EQ_INT(st_job_transition(db, job, ST_PREPARING, ST_RUNNING, NULL, NULL, &eb), TD_OK);
	CHECK_EQ_INT(lease_count(db, NULL), 1);
	CHECK_EQ_INT(st_job_transition(db, job, ST_RUNNING, ST_FAILED, "boom", NULL, &eb), TD_OK);
	CHECK_EQ_INT(lease_count(db, NULL), 0);
	r.job_id = 0;
	st_close(db);
}

/* Gangs: several GPUs' leases in one transaction, all or none. */
static void test_gang(void)
{
	struct st_db *db = open_db();
	struct td_errbuf eb = {{0}};
	static const char *const gpu[] = {"GPU-g0", "GPU-g1", "GPU-g2", "GPU-g3"};
	struct st_device_cap cap[4];
	for (int i = 0; i < 4; i++)
		cap[i] = (struct st_device_cap){.total_bytes = GiB, .factor = 1.0,
						.free_bytes_now = UINT64_MAX};
	struct st_job_new nj = {.name = "gang", .uid = 1000, .spec = "x", .spec_len = 1};
	int64_t ja, jb;
	CHECK_EQ_INT(st_job_submit(db, &nj, &ja, &eb), TD_OK);
	CHECK_EQ_INT(st_job_submit(db, &nj, &jb, &eb), TD_OK);
	struct st_lease_req r[4];
	for (int i = 0; i < 4; i++)
		r[i] = (struct st_lease_req){.gpu_uuid = gpu[i], .bytes = 600 * MiB, .uid = 1000,
					     .pid = getpid(), .label = "gang", .job_id = ja};
	int64_t ids[4] = {-7, -7, -7, -7};

	/* Job A on GPUs 0 and 1. */
	CHECK_EQ_INT(st_ledger_reserve_gang(db, r, cap, 2, ids, &eb), TD_OK);
	CHECK(ids[0] > 0 && ids[1] > ids[0]);
	struct st_lease *l = NULL;
	size_t n = 0;
	CHECK_EQ_INT(st_ledger_list_job(db, ja, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	if (n == 2) {
		CHECK_STR_EQ(l[0].gpu_uuid, "GPU-g0");
		CHECK_STR_EQ(l[1].gpu_uuid, "GPU-g1");
		CHECK_EQ_INT(l[0].job_id, ja);
		CHECK_EQ_INT(l[1].bytes, 600 * MiB);
	}
	free(l);
	CHECK_EQ_INT(st_ledger_list_job(db, jb, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	free(l);
	CHECK_EQ_INT(st_ledger_list_job(db, 0, &l, &n, &eb), TD_EINVAL);

	/* Job B on GPUs 1 and 2: GPU 1 is full, so GPU 2 gets nothing either. */
	for (int i = 0; i < 4; i++)
		r[i].job_id = jb;
	int64_t idb[2] = {-7, -7};
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve_gang(db, r + 1, cap + 1, 2, idb, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "gang of 2 GPUs, none granted: GPU-g1: 600.0 MiB requested");
	CHECK_EQ_INT(idb[0], -7);
	CHECK_EQ_INT(reserved(db, "GPU-g2"), 0);
	CHECK_EQ_INT(lease_count(db, NULL), 2);
	/* The same with the full GPU last: the first is not granted alone. */
	struct st_lease_req rr[2] = {r[2], r[1]};
	struct st_device_cap cc[2] = {cap[2], cap[1]};
	CHECK_EQ_INT(st_ledger_reserve_gang(db, rr, cc, 2, idb, &eb), TD_EBUSY);
	CHECK_EQ_INT(reserved(db, "GPU-g2"), 0);
	/* Each GPU's free memory is checked too. */
	cc[1] = cap[3];
	rr[1] = r[3];
	cc[1].free_bytes_now = 100 * MiB;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve_gang(db, rr, cc, 2, idb, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "GPU-g3: 600.0 MiB requested, but the device has only 100.0 MiB free");
	CHECK_EQ_INT(lease_count(db, NULL), 2);
	/* Job B on GPUs 2 and 3. */
	CHECK_EQ_INT(st_ledger_reserve_gang(db, r + 2, cap + 2, 2, idb, &eb), TD_OK);
	CHECK_EQ_INT(lease_count(db, NULL), 4);

	/* Bad gangs: none, too many, a GPU twice, a job that does not exist
	 * (in the second request only): nothing is inserted. */
	CHECK_EQ_INT(st_ledger_reserve_gang(db, r, cap, 0, ids, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_ledger_reserve_gang(db, r, cap, ST_LEDGER_GANG_MAX + 1, ids, &eb), TD_EINVAL);
	rr[0] = r[3];
	rr[1] = r[3];
	rr[0].bytes = rr[1].bytes = 1;
	cc[0] = cc[1] = cap[3];
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve_gang(db, rr, cc, 2, ids, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "GPU-g3 is named twice");
	rr[0] = r[0];
	rr[1] = r[1];
	rr[0].bytes = rr[1].bytes = 1;
	rr[0].job_id = 0;
	rr[1].job_id = 999999;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_ledger_reserve_gang(db, rr, cap, 2, ids, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "job 999999");
	CHECK_EQ_INT(lease_count(db, NULL), 4);

	/* A gang's leases go together: released by job, and by the job leaving
	 * the active states (admission undone). */
	CHECK_EQ_INT(st_ledger_release_job(db, ja, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	CHECK_EQ_INT(lease_count(db, NULL), 2);
	CHECK_EQ_INT(st_job_transition(db, jb, ST_QUEUED, ST_ADMITTED, NULL, "GPU-g2,GPU-g3", &eb),
		     TD_OK);
	CHECK_EQ_INT(lease_count(db, NULL), 2);
	CHECK_EQ_INT(st_job_transition(db, jb, ST_ADMITTED, ST_QUEUED, "undone", NULL, &eb), TD_OK);
	CHECK_EQ_INT(lease_count(db, NULL), 0);

	/* A dead holder's lease is reaped inside the gang's transaction. */
	pid_t kid = fork();
	if (kid == 0) {
		struct st_db *cdb = NULL;
		struct td_errbuf ceb;
		struct st_lease_req cr = {.gpu_uuid = "GPU-g1", .bytes = 900 * MiB, .uid = 1000,
					  .pid = getpid(), .label = "dead"};
		int64_t id;
		_exit(st_open(&cdb, dbpath, NULL, &ceb) == TD_OK &&
				      st_ledger_reserve(cdb, &cr, &cap[1], &id, &ceb) == TD_OK
			      ? 0
			      : 1);
	}
	int status = -1;
	waitpid(kid, &status, 0);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	CHECK_EQ_INT(reserved(db, "GPU-g1"), 900 * MiB);
	r[0].job_id = r[1].job_id = ja;
	CHECK_EQ_INT(st_ledger_reserve_gang(db, r, cap, 4, ids, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, "GPU-g1"), 600 * MiB);
	CHECK_EQ_INT(st_ledger_release_job(db, ja, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	CHECK_EQ_INT(st_ledger_release_job(db, jb, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	CHECK_EQ_INT(lease_count(db, NULL), 0);
	st_close(db);
}

/* Gangs of 1, 2 and 4 of 4 GPUs from several processes at once, each lease
 * more than half a GPU: at most one holder per GPU at any time, which a
 * counter per GPU in shared memory checks (raised after a grant, lowered
 * before the release); every process gets its grants (no deadlock: a gang
 * never holds part of its set). */
enum { GANG_PROCS = 4, GANG_GRANTS = 40 };
struct gang_shared {
	_Atomic int held[4];
	_Atomic int violations;
	_Atomic int granted;
	_Atomic int refused;
};

static int gang_worker(struct gang_shared *sh, int index)
{
	struct st_db *db = NULL;
	struct td_errbuf eb;
	if (st_open(&db, dbpath, NULL, &eb) != TD_OK)
		return 1;
	static const char *const gpu[] = {"GPU-c0", "GPU-c1", "GPU-c2", "GPU-c3"};
	struct st_device_cap cap[4];
	for (int i = 0; i < 4; i++)
		cap[i] = (struct st_device_cap){.total_bytes = GiB, .factor = 1.0,
						.free_bytes_now = UINT64_MAX};
	static const int sizes[] = {1, 2, 4, 2};
	int granted = 0, tries = 0, rc = 0;
	while (granted < GANG_GRANTS && rc == 0 && tries++ < 200000) {
		int k = sizes[(index + tries) % 4], first = (index + tries) % 4;
		struct st_lease_req r[4];
		int g[4];
		for (int i = 0; i < k; i++) {
			/* Each process walks the GPUs in its own direction. */
			g[i] = (first + (index % 2 ? -i + 4 : i)) % 4;
			r[i] = (struct st_lease_req){.gpu_uuid = gpu[g[i]], .bytes = 600 * MiB,
						     .uid = getuid(), .pid = getpid()};
		}
		int64_t ids[4];
		td_err e = st_ledger_reserve_gang(db, r, cap, (size_t)k, ids, &eb);
		if (e == TD_EBUSY) {
			atomic_fetch_add(&sh->refused, 1);
			struct timespec ts = {0, 100000};
			nanosleep(&ts, NULL);
			continue;
		}
		if (e != TD_OK) {
			fprintf(stderr, "gang worker %d: %s\n", index, eb.msg);
			rc = 1;
			break;
		}
		granted++;
		atomic_fetch_add(&sh->granted, 1);
		for (int i = 0; i < k; i++)
			if (atomic_fetch_add(&sh->held[g[i]], 1) != 0)
				atomic_fetch_add(&sh->violations, 1);
		struct timespec ts = {0, 200000};
		nanosleep(&ts, NULL);
		for (int i = 0; i < k; i++) {
			atomic_fetch_sub(&sh->held[g[i]], 1);
			if (st_ledger_release(db, ids[i], getuid(), false, &eb) != TD_OK)
				rc = 1;
		}
	}
	st_close(db);
	return rc || granted < GANG_GRANTS;
}

static void test_gang_contention(void)
{
	struct gang_shared *sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE,
				      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	CHECK(sh != MAP_FAILED);
	if (sh == MAP_FAILED)
		return;
	memset(sh, 0, sizeof(*sh));
	pid_t kids[GANG_PROCS];
	for (int i = 0; i < GANG_PROCS; i++) {
		kids[i] = fork();
		if (kids[i] == 0)
			_exit(gang_worker(sh, i));
	}
	for (int i = 0; i < GANG_PROCS; i++) {
		int status = -1;
		waitpid(kids[i], &status, 0);
		CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "gang worker %d status 0x%x",
			  i, status);
	}
	CHECK_EQ_INT(atomic_load(&sh->violations), 0);
	CHECK_EQ_INT(atomic_load(&sh->granted), GANG_PROCS * GANG_GRANTS);
	/* Contention really happened: otherwise the test proves nothing. */
	CHECK(atomic_load(&sh->refused) > 0);
	struct st_db *db = open_db();
	CHECK_EQ_INT(lease_count(db, NULL), 0);
	st_close(db);
	munmap(sh, sizeof(*sh));
}

/* Expiry and heartbeats. */
static void test_expiry(void)
{
	struct st_db *db = open_db();
	struct td_errbuf eb = {{0}};
	struct st_device_cap cap = {.total_bytes = GiB, .factor = 1.0, .free_bytes_now = UINT64_MAX};
	struct st_lease_req r = {.gpu_uuid = "GPU-exp", .bytes = GiB, .uid = getuid(), .pid = getpid(),
				 .ttl_ms = 60000};
	int64_t a, b;
	int64_t t0 = st_now_ms();
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &a, &eb), TD_OK);
	struct st_lease *l;
	size_t n;
	CHECK_EQ_INT(st_ledger_list(db, "GPU-exp", &l, &n, &eb), TD_OK);
	CHECK(n == 1 && l[0].expires_ms >= t0 + 60000 && l[0].expires_ms <= st_now_ms() + 60000);
	free(l);
	/* Renewed with a 1 ms ttl, then let it pass: the next reserve reaps it. */
	CHECK_EQ_INT(st_ledger_heartbeat(db, a, 1, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_list(db, "GPU-exp", &l, &n, &eb), TD_OK);
	CHECK(n == 1 && l[0].heartbeat_ms >= t0 && l[0].expires_ms == l[0].heartbeat_ms + 1);
	free(l);
	sleep_ms(5);
	r.ttl_ms = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &b, &eb), TD_OK); /* the whole GiB again */
	CHECK_EQ_INT(lease_count(db, "GPU-exp"), 1);
	/* ttl 0 never expires; heartbeat with ttl 0 keeps it so. */
	CHECK_EQ_INT(st_ledger_heartbeat(db, b, 0, getuid(), false, &eb), TD_OK);
	size_t reaped = 99;
	CHECK_EQ_INT(st_ledger_reap(db, &reaped, &eb), TD_OK);
	CHECK_EQ_INT(reaped, 0);
	CHECK_EQ_INT(st_ledger_heartbeat(db, b, -1, getuid(), false, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_ledger_release(db, b, getuid(), false, &eb), TD_OK);
	st_close(db);
}

/* Holders that are gone: exited (zombie, then reaped), pid reused, another
 * boot. No handle is open across a fork (see state.h). */
static void test_reap(void)
{
	struct st_db *db = NULL;
	struct td_errbuf eb = {{0}};
	struct st_device_cap cap = {.total_bytes = 4 * GiB, .factor = 1.0, .free_bytes_now = UINT64_MAX};
	int fds[2];
	if (pipe(fds) != 0) {
		perror("pipe");
		exit(1);
	}
	/* A child takes 3 GiB and dies without releasing. */
	pid_t kid = fork();
	if (kid == 0) {
		close(fds[0]);
		struct st_db *cdb = NULL;
		struct td_errbuf ceb;
		int64_t id = -1;
		if (st_open(&cdb, dbpath, NULL, &ceb) == TD_OK) {
			struct st_lease_req r = {.gpu_uuid = "GPU-reap", .bytes = 3 * GiB,
						 .uid = getuid(), .pid = getpid(), .label = "dies"};
			if (st_ledger_reserve(cdb, &r, &cap, &id, &ceb) != TD_OK)
				id = -1;
		}
		if (write(fds[1], &id, sizeof(id)) != sizeof(id))
			_exit(2);
		_exit(0); /* no st_close, no release */
	}
	close(fds[1]);
	int64_t dead = -1;
	CHECK_EQ_INT(read(fds[0], &dead, sizeof(dead)), sizeof(dead));
	close(fds[0]);
	CHECK(dead > 0);
	/* Wait until the child is a zombie (exited, not yet waited for). */
	siginfo_t si;
	memset(&si, 0, sizeof(si));
	CHECK_EQ_INT(waitid(P_PID, (id_t)kid, &si, WEXITED | WNOWAIT), 0);
	db = open_db();
	CHECK_EQ_INT(reserved(db, "GPU-reap"), 3 * GiB); /* still booked */
	/* A reservation that needs the space gets it: the zombie's lease is reaped
	 * inside the reserve transaction. */
	struct st_lease_req r = {.gpu_uuid = "GPU-reap", .bytes = 2 * GiB, .uid = getuid(),
				 .pid = getpid()};
	int64_t mine;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &mine, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, "GPU-reap"), 2 * GiB);
	waitpid(kid, NULL, 0);

	/* A reaped child's lease, this time by the periodic call. */
	st_close(db);
	kid = fork();
	if (kid == 0) {
		struct st_db *cdb = NULL;
		struct td_errbuf ceb;
		int64_t id;
		struct st_lease_req cr = {.gpu_uuid = "GPU-reap", .bytes = GiB, .uid = getuid(),
					  .pid = getpid()};
		_exit(st_open(&cdb, dbpath, NULL, &ceb) == TD_OK &&
				      st_ledger_reserve(cdb, &cr, &cap, &id, &ceb) == TD_OK
			      ? 0
			      : 1);
	}
	int status = -1;
	waitpid(kid, &status, 0);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	db = open_db();
	CHECK_EQ_INT(lease_count(db, "GPU-reap"), 2);
	size_t n = 0;
	CHECK_EQ_INT(st_ledger_reap(db, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 1);
	CHECK_EQ_INT(lease_count(db, "GPU-reap"), 1);

	/* A lease held by a live process of another kind (our parent): kept. */
	r.pid = getppid();
	r.bytes = MiB;
	int64_t parent_lease;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &parent_lease, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_reap(db, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	/* The same pid with another start time: the pid was reused. */
	char sql[160];
	snprintf(sql, sizeof(sql), "UPDATE ledger SET pid_start = pid_start + 1 WHERE id = %lld",
		 (long long)parent_lease);
	CHECK_EQ_INT(raw_exec(sql), SQLITE_OK);
	CHECK_EQ_INT(st_ledger_reap(db, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 1);
	/* A lease from another boot. */
	snprintf(sql, sizeof(sql),
		 "UPDATE ledger SET boot_id = '00000000-0000-0000-0000-000000000000' WHERE id = %lld",
		 (long long)mine);
	CHECK_EQ_INT(raw_exec(sql), SQLITE_OK);
	CHECK_EQ_INT(st_ledger_reap(db, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 1);
	CHECK_EQ_INT(lease_count(db, NULL), 0);
	st_close(db);
}

/* Shared blocks (a frozen base several jobs use, train/base.h): reserved
 * with the first holder's lease, in the same check; a second lease of the
 * same key on the GPU holds it and brings only its own bytes; another key
 * or another GPU makes its own; counted once in the GPU's sum; gone with
 * its last holder, whether released, released by job or reaped (a dead
 * holder: what a daemon restart finds). */
static void test_shared(void)
{
	struct st_db *db = open_db();
	struct td_errbuf eb = {{0}};
	struct st_device_cap cap = {.total_bytes = 10 * GiB, .factor = 1.0, .free_bytes_now = UINT64_MAX};
	const char *g = "GPU-share";
	struct st_lease_req r = {.gpu_uuid = g, .bytes = GiB, .uid = getuid(), .pid = getpid(),
				 .label = "a", .share_key = "base-K", .share_bytes = 4 * GiB,
				 .share_label = "base of K"};
	int64_t a, b, c, d;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &a, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, g), 5 * GiB);
	bool found = false;
	uint64_t bytes = 0;
	CHECK_EQ_INT(st_ledger_shared_find(db, g, "base-K", &found, &bytes, &eb), TD_OK);
	CHECK(found && bytes == 4 * GiB);
	/* 5 GiB left: a second holder needs its 1 GiB only... */
	r.label = "b";
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &b, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, g), 6 * GiB);
	/* ...where another key needs its block too: 4 + 1 > 4 GiB left. */
	r.share_key = "base-L";
	r.label = "c";
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &c, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "5.00 GiB requested");
	r.share_bytes = 2 * GiB;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &c, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, g), 9 * GiB);
	/* The same key on another GPU is another block. */
	r.gpu_uuid = "GPU-other";
	r.share_key = "base-K";
	r.share_bytes = 4 * GiB;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &d, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, "GPU-other"), 5 * GiB);

	struct st_shared *sh = NULL;
	size_t n = 0;
	CHECK_EQ_INT(st_ledger_list_shared(db, g, &sh, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	if (n == 2) {
		CHECK(strcmp(sh[0].key, "base-K") == 0);
		CHECK(strcmp(sh[0].label, "base of K") == 0);
		CHECK_EQ_INT(sh[0].bytes, 4 * GiB);
		CHECK_EQ_INT(sh[0].nholders, 2);
		CHECK(sh[0].holders[0].lease == a && sh[0].holders[1].lease == b);
		CHECK_EQ_INT(sh[1].nholders, 1);
		CHECK_EQ_INT(sh[1].holders[0].lease, c);
	}
	free(sh);
	CHECK_EQ_INT(st_ledger_list_shared(db, NULL, &sh, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 3);
	free(sh);

	/* The first holder goes: the block stays for the second. */
	CHECK_EQ_INT(st_ledger_release(db, a, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, g), 8 * GiB);
	CHECK_EQ_INT(st_ledger_shared_find(db, g, "base-K", &found, NULL, &eb), TD_OK);
	CHECK(found);
	/* The last: the block goes in the same transaction. */
	CHECK_EQ_INT(st_ledger_release(db, b, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(st_ledger_shared_find(db, g, "base-K", &found, NULL, &eb), TD_OK);
	CHECK(!found);
	CHECK_EQ_INT(reserved(db, g), 3 * GiB);
	/* A dead holder's lease is reaped, and its block with it (a daemon
	 * killed and restarted: its pid is gone). */
	char sql[160];
	snprintf(sql, sizeof(sql),
		 "UPDATE ledger SET boot_id = '00000000-0000-0000-0000-000000000000' WHERE id = %lld",
		 (long long)c);
	CHECK_EQ_INT(raw_exec(sql), SQLITE_OK);
	CHECK_EQ_INT(st_ledger_reap(db, &n, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, g), 0);
	CHECK_EQ_INT(st_ledger_list_shared(db, g, &sh, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	free(sh);
	CHECK_EQ_INT(st_ledger_release(db, d, getuid(), false, &eb), TD_OK);
	CHECK_EQ_INT(reserved(db, "GPU-other"), 0);
	/* A shared key needs its size. */
	r.share_bytes = 0;
	CHECK_EQ_INT(st_ledger_reserve(db, &r, &cap, &d, &eb), TD_EINVAL);
	st_close(db);
}

int main(void)
{
	const char *base = getenv("TMPDIR");
	snprintf(tmpdir, sizeof(tmpdir), "%s/td-ledger-XXXXXX",
		 base && *base && strlen(base) < 40 ? base : "/tmp");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "mkdtemp %s: %s\n", tmpdir, strerror(errno));
		return 1;
	}
	snprintf(dbpath, sizeof(dbpath), "%s/%s", tmpdir, ST_DB_FILE);
	test_holder();
	test_fit();
	test_release();
	test_gang();
	test_gang_contention();
	test_expiry();
	test_reap();
	test_shared();
	check_rm_tree(tmpdir);
	return check_status();
}
