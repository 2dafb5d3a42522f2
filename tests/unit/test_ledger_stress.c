/* Multi-process stress test of the VRAM ledger (issue 5: "at least 8
 * processes making 200 reservations each never oversubscribe a device; a dead
 * holder's reservation is reclaimed").
 *
 * NPROC forked workers, each with its own connection, reserve random sizes on
 * one device whose ledger share is LIMIT and release at random, holding up to
 * HOLD leases each, so that together they ask for several times LIMIT and
 * refusals are the normal case. Oversubscription is checked three ways:
 *   - by the ledger itself, inside every reserve transaction (a violation
 *     would come back as TD_EINTERNAL);
 *   - independently of the database: a counter in shared memory is raised
 *     after each granted reserve and lowered before each release, so it never
 *     exceeds the ledger's true sum; it must never exceed LIMIT;
 *   - by a consistent snapshot of the ledger after each grant, and at the end.
 * Before the workers start, a child reserves a large lease and exits without
 * releasing it; the workers must reclaim it (it would otherwise block them),
 * and at the end the ledger must be empty. */
#include "state/state.h"

#include "tests/check.h"

#include <errno.h>
#include <ftw.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MiB (1ull << 20)
enum { NPROC = 8, PER_PROC = 200, HOLD = 4 };
static const uint64_t TOTAL = 1024 * MiB;
static const double FACTOR = 0.5;
static const uint64_t LIMIT = 512 * MiB; /* TOTAL × FACTOR, exact */
static const char GPU[] = "GPU-stress-0000";

struct shared {
	_Atomic uint64_t held;      /* bytes granted and not yet released, by the counter */
	_Atomic uint64_t max_held;
	_Atomic int violations;     /* counter or snapshot above LIMIT */
	_Atomic uint64_t granted;
	_Atomic uint64_t refused;
};

static char tmpdir[64];
static char dbpath[128];
static struct shared *sh;

static uint64_t xorshift(uint64_t *s)
{
	uint64_t x = *s;
	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *s = x;
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct held {
	int64_t id;
	uint64_t bytes;
};

static int release_one(struct st_db *db, struct held *h, int *nh, uint64_t *rng)
{
	int k = (int)(xorshift(rng) % (uint64_t)*nh);
	struct td_errbuf eb;
	/* Lower the counter first: it must never exceed the ledger's sum. */
	atomic_fetch_sub(&sh->held, h[k].bytes);
	td_err e = st_ledger_release(db, h[k].id, getuid(), false, &eb);
	if (e) {
		fprintf(stderr, "worker %d: release lease %lld: %s\n", (int)getpid(),
			(long long)h[k].id, eb.msg);
		return 1;
	}
	h[k] = h[--*nh];
	return 0;
}

static int worker(int index)
{
	struct st_db *db = NULL;
	struct td_errbuf eb;
	if (st_open(&db, dbpath, NULL, &eb) != TD_OK) {
		fprintf(stderr, "worker %d: %s\n", index, eb.msg);
		return 1;
	}
	uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(index + 1);
	struct st_device_cap cap = {.total_bytes = TOTAL, .factor = FACTOR, .free_bytes_now = UINT64_MAX};
	struct held h[HOLD];
	int nh = 0, granted = 0, rc = 0;
	char label[32];
	snprintf(label, sizeof(label), "stress-%d", index);
	while (granted < PER_PROC && rc == 0) {
		if (nh == HOLD || (nh > 0 && xorshift(&rng) % 2 == 0)) {
			rc = release_one(db, h, &nh, &rng);
			continue;
		}
		struct st_lease_req r = {.gpu_uuid = GPU, .uid = getuid(), .pid = getpid(),
					 .label = label, .bytes = (16 + xorshift(&rng) % 49) * MiB};
		int64_t id = 0;
		td_err e = st_ledger_reserve(db, &r, &cap, &id, &eb);
		if (e == TD_OK) {
			h[nh++] = (struct held){id, r.bytes};
			granted++;
			atomic_fetch_add(&sh->granted, 1);
			uint64_t now = atomic_fetch_add(&sh->held, r.bytes) + r.bytes;
			uint64_t m = atomic_load(&sh->max_held);
			while (now > m && !atomic_compare_exchange_weak(&sh->max_held, &m, now))
				;
			if (now > LIMIT) {
				fprintf(stderr, "worker %d: %llu bytes held > limit %llu\n", index,
					(unsigned long long)now, (unsigned long long)LIMIT);
				atomic_fetch_add(&sh->violations, 1);
			}
			uint64_t snap = 0;
			if (st_ledger_reserved(db, GPU, &snap, &eb) != TD_OK) {
				fprintf(stderr, "worker %d: %s\n", index, eb.msg);
				rc = 1;
			} else if (snap > LIMIT) {
				fprintf(stderr, "worker %d: ledger snapshot %llu > limit %llu\n", index,
					(unsigned long long)snap, (unsigned long long)LIMIT);
				atomic_fetch_add(&sh->violations, 1);
			}
		} else if (e == TD_EBUSY) {
			atomic_fetch_add(&sh->refused, 1);
			if (nh > 0) {
				rc = release_one(db, h, &nh, &rng);
			} else {
				struct timespec ts = {0, 200000};
				nanosleep(&ts, NULL);
			}
		} else {
			fprintf(stderr, "worker %d: reserve: %s: %s\n", index, td_errname(e), eb.msg);
			rc = 1;
		}
	}
	while (nh > 0 && rc == 0)
		rc = release_one(db, h, &nh, &rng);
	st_close(db);
	return rc;
}

int main(void)
{
	const char *base = getenv("TMPDIR");
	snprintf(tmpdir, sizeof(tmpdir), "%s/td-stress-XXXXXX",
		 base && *base && strlen(base) < 40 ? base : "/tmp");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "mkdtemp %s: %s\n", tmpdir, strerror(errno));
		return 1;
	}
	snprintf(dbpath, sizeof(dbpath), "%s/%s", tmpdir, ST_DB_FILE);
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	memset(sh, 0, sizeof(*sh));

	/* Create the schema once, so the workers do not all migrate at once
	 * (that race has its own test in test_state). No handle stays open
	 * across a fork (see state.h). */
	struct st_db *db = NULL;
	struct td_errbuf eb;
	if (st_open(&db, dbpath, NULL, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		return 1;
	}
	st_close(db);

	/* The dead holder: 3/4 of the limit, never released. */
	pid_t dead = fork();
	if (dead == 0) {
		struct st_db *cdb = NULL;
		struct td_errbuf ceb;
		struct st_device_cap cap = {.total_bytes = TOTAL, .factor = FACTOR,
					    .free_bytes_now = UINT64_MAX};
		struct st_lease_req r = {.gpu_uuid = GPU, .uid = getuid(), .pid = getpid(),
					 .label = "dead holder", .bytes = LIMIT / 4 * 3};
		int64_t id;
		_exit(st_open(&cdb, dbpath, NULL, &ceb) == TD_OK &&
				      st_ledger_reserve(cdb, &r, &cap, &id, &ceb) == TD_OK
			      ? 0
			      : 1);
	}
	int status = -1;
	waitpid(dead, &status, 0);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	uint64_t booked = 0;
	db = NULL;
	if (st_open(&db, dbpath, NULL, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		return 1;
	}
	CHECK_EQ_INT(st_ledger_reserved(db, GPU, &booked, &eb), TD_OK);
	CHECK_EQ_INT(booked, LIMIT / 4 * 3);
	st_close(db);

	double t0 = now_s();
	pid_t kids[NPROC];
	for (int i = 0; i < NPROC; i++) {
		kids[i] = fork();
		if (kids[i] < 0) {
			perror("fork");
			return 1;
		}
		if (kids[i] == 0)
			_exit(worker(i));
	}
	for (int i = 0; i < NPROC; i++) {
		status = -1;
		waitpid(kids[i], &status, 0);
		CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "worker %d status 0x%x", i,
			  status);
	}
	double secs = now_s() - t0;
	if (st_open(&db, dbpath, NULL, &eb) != TD_OK) {
		fprintf(stderr, "%s\n", eb.msg);
		return 1;
	}

	CHECK_EQ_INT(atomic_load(&sh->violations), 0);
	CHECK_EQ_INT(atomic_load(&sh->granted), NPROC * PER_PROC);
	CHECK_EQ_INT(atomic_load(&sh->held), 0);
	CHECK(atomic_load(&sh->max_held) <= LIMIT);
	/* Contention really happened: otherwise the test proves nothing. */
	CHECK(atomic_load(&sh->refused) > 0);
	/* Everyone released, and the dead holder was reclaimed. */
	struct st_lease *l = NULL;
	size_t n = 99;
	CHECK_EQ_INT(st_ledger_list(db, NULL, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	free(l);
	CHECK_EQ_INT(st_ledger_reserved(db, GPU, &booked, &eb), TD_OK);
	CHECK_EQ_INT(booked, 0);
	st_close(db);
	fprintf(stderr,
		"%d processes x %d grants in %.2f s: %llu refusals, peak %llu MiB of %llu MiB\n",
		NPROC, PER_PROC, secs, (unsigned long long)atomic_load(&sh->refused),
		(unsigned long long)(atomic_load(&sh->max_held) / MiB),
		(unsigned long long)(LIMIT / MiB));
	check_rm_tree(tmpdir);
	return check_status();
}
