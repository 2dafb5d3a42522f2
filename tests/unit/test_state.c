/* Unit test of state/ (jobs, events, metrics, module cache, the database):
 * the state-machine table, transitions and their side effects, the
 * compare-and-set, cancel, recovery after a daemon is killed, persistence
 * across close/reopen, migrations (empty file, concurrent openers, a future
 * version refused, a foreign or corrupt file refused), the scheduler's queue
 * order and one handle shared by threads.
 *
 * Every database lives in a mkdtemp() directory removed at the end. Expected
 * values come from this file's own tables and bookkeeping, never from the
 * module under test. The ledger has its own tests (test_ledger.c,
 * test_ledger_stress.c). */
#include "state/state.h"

#include "tests/check.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char tmpdir[64];

/* tmpdir/name (static storage, one at a time per slot). */
static const char *tpath(const char *name)
{
	static char slots[4][256];
	static int next;
	char *p = slots[next++ & 3];
	snprintf(p, 256, "%s/%s", tmpdir, name);
	return p;
}

static struct st_db *open_db(const char *name)
{
	struct st_db *db = NULL;
	struct td_errbuf eb = {{0}};
	td_err e = st_open(&db, tpath(name), NULL, &eb);
	if (e) {
		fprintf(stderr, "st_open %s: %s: %s\n", name, td_errname(e), eb.msg);
		exit(1);
	}
	return db;
}

/* A spec blob with a NUL inside, to prove it is stored as bytes. */
static const uint8_t spec_bytes[] = {0x0a, 0x03, 'j', 0x00, 'b', 0x12, 0x01, 0xff};

static int64_t submit(struct st_db *db, const char *name, uid_t uid, int32_t prio)
{
	struct st_job_new n = {.name = name, .uid = uid, .gid = uid + 100, .priority = prio,
			       .spec = spec_bytes, .spec_len = sizeof(spec_bytes)};
	int64_t id = 0;
	struct td_errbuf eb = {{0}};
	td_err e = st_job_submit(db, &n, &id, &eb);
	CHECK_MSG(e == TD_OK, "submit %s: %s", name, eb.msg);
	return id;
}

static enum st_job_state state_of(struct st_db *db, int64_t id)
{
	struct st_job j;
	struct td_errbuf eb;
	if (st_job_get(db, id, &j, &eb) != TD_OK) {
		fprintf(stderr, "get job %lld: %s\n", (long long)id, eb.msg);
		return ST_JOB_STATE_COUNT;
	}
	enum st_job_state s = j.state;
	st_job_fini(&j);
	return s;
}

/* Drives a fresh job to `target` along legal transitions. */
static void drive_to(struct st_db *db, int64_t id, enum st_job_state target)
{
	static const enum st_job_state path_run[] = {ST_ADMITTED, ST_PREPARING, ST_RUNNING};
	struct td_errbuf eb;
	enum st_job_state cur = ST_QUEUED;
	for (size_t i = 0; i < 3 && cur != target; i++) {
		if (target == ST_CANCELLED || target == ST_FAILED)
			break;
		CHECK_EQ_INT(st_job_transition(db, id, cur, path_run[i], "t", "cpu", &eb), TD_OK);
		cur = path_run[i];
	}
	if (cur != target) {
		td_err e = st_job_transition(db, id, cur, target, "t", NULL, &eb);
		CHECK_MSG(e == TD_OK, "drive %s -> %s: %s", st_job_state_name(cur),
			  st_job_state_name(target), eb.msg);
	}
	CHECK_EQ_INT(state_of(db, id), target);
}

/* ------------------------------------------------------------------------ */
/* The state machine */

/* issue 5 and state.h, written out independently of state/jobs.c's table. */
static const char *const legal_pairs[] = {
	"QUEUED>ADMITTED",     "QUEUED>FAILED",        "QUEUED>CANCELLED",
	"ADMITTED>PREPARING",  "ADMITTED>QUEUED",      "ADMITTED>FAILED",
	"ADMITTED>CANCELLED",  "ADMITTED>INTERRUPTED", "PREPARING>RUNNING",
	"PREPARING>FAILED",    "PREPARING>CANCELLED",  "PREPARING>INTERRUPTED",
	"RUNNING>SUCCEEDED",   "RUNNING>FAILED",       "RUNNING>CANCELLED",
	"RUNNING>INTERRUPTED", "INTERRUPTED>QUEUED",   "INTERRUPTED>FAILED",
	"INTERRUPTED>CANCELLED",
};

static bool expect_legal(enum st_job_state a, enum st_job_state b)
{
	char key[64];
	snprintf(key, sizeof(key), "%s>%s", st_job_state_name(a), st_job_state_name(b));
	for (size_t i = 0; i < sizeof(legal_pairs) / sizeof(legal_pairs[0]); i++)
		if (strcmp(legal_pairs[i], key) == 0)
			return true;
	return false;
}

static void test_state_names(void)
{
	static const char *const names[] = {"QUEUED",    "ADMITTED", "PREPARING", "RUNNING",
					    "SUCCEEDED", "FAILED",   "CANCELLED", "INTERRUPTED"};
	CHECK_EQ_INT(sizeof(names) / sizeof(names[0]), ST_JOB_STATE_COUNT);
	for (int i = 0; i < ST_JOB_STATE_COUNT; i++) {
		CHECK_STR_EQ(st_job_state_name((enum st_job_state)i), names[i]);
		enum st_job_state s = ST_JOB_STATE_COUNT;
		CHECK(st_job_state_parse(names[i], &s));
		CHECK_EQ_INT(s, i);
	}
	enum st_job_state s = ST_QUEUED;
	CHECK(st_job_state_parse("running", &s) && s == ST_RUNNING);
	CHECK(!st_job_state_parse("RUN", &s));
	CHECK(!st_job_state_parse(NULL, &s));
	CHECK_STR_EQ(st_job_state_name((enum st_job_state)99), "?");
	CHECK(st_job_state_terminal(ST_SUCCEEDED) && st_job_state_terminal(ST_FAILED) &&
	      st_job_state_terminal(ST_CANCELLED));
	CHECK(!st_job_state_terminal(ST_INTERRUPTED) && !st_job_state_terminal(ST_RUNNING));
}

/* Every pair, both in the pure table and through the database (from
 * ST_ANY_STATE): a legal one moves the job, an illegal one is TD_ESTATE naming
 * both states and leaves it where it was. */
static void test_transition_table(void)
{
	struct st_db *db = open_db("table.db");
	int legal = 0;
	for (int a = 0; a < ST_JOB_STATE_COUNT; a++) {
		for (int b = 0; b < ST_JOB_STATE_COUNT; b++) {
			enum st_job_state from = (enum st_job_state)a, to = (enum st_job_state)b;
			bool want = expect_legal(from, to);
			legal += want;
			CHECK_MSG(st_job_transition_ok(from, to) == want, "%s -> %s: table says %d",
				  st_job_state_name(from), st_job_state_name(to), !want);
			int64_t id = submit(db, "t", 1000, 0);
			drive_to(db, id, from);
			struct td_errbuf eb = {{0}};
			td_err e = st_job_transition(db, id, ST_ANY_STATE, to, "why", NULL, &eb);
			if (want) {
				CHECK_MSG(e == TD_OK, "%s -> %s: %s", st_job_state_name(from),
					  st_job_state_name(to), eb.msg);
				CHECK_EQ_INT(state_of(db, id), to);
			} else {
				CHECK_EQ_INT(e, TD_ESTATE);
				CHECK_CONTAINS(eb.msg, st_job_state_name(from));
				CHECK_CONTAINS(eb.msg, st_job_state_name(to));
				CHECK_EQ_INT(state_of(db, id), from);
				/* The same with an explicit from: refused before the database. */
				memset(&eb, 0, sizeof(eb));
				CHECK_EQ_INT(st_job_transition(db, id, from, to, NULL, NULL, &eb), TD_ESTATE);
				CHECK_CONTAINS(eb.msg, "illegal transition");
			}
		}
	}
	CHECK_EQ_INT(legal, sizeof(legal_pairs) / sizeof(legal_pairs[0]));
	struct td_errbuf eb;
	CHECK_EQ_INT(st_job_transition(db, 1, ST_QUEUED, (enum st_job_state)42, NULL, NULL, &eb),
		     TD_EINVAL);
	st_close(db);
}

/* Side effects of transitions, the compare-and-set and the events they log. */
static void test_transitions(void)
{
	struct st_db *db = open_db("trans.db");
	struct td_errbuf eb = {{0}};
	int64_t t0 = st_now_ms();
	int64_t id = submit(db, "side", 1000, 5);
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, id, &j, &eb), TD_OK);
	CHECK_EQ_INT(j.state, ST_QUEUED);
	CHECK_STR_EQ(j.name, "side");
	CHECK_EQ_INT(j.uid, 1000);
	CHECK_EQ_INT(j.gid, 1100);
	CHECK_EQ_INT(j.priority, 5);
	CHECK_EQ_INT(j.spec_len, sizeof(spec_bytes));
	CHECK(j.spec && memcmp(j.spec, spec_bytes, sizeof(spec_bytes)) == 0);
	CHECK(j.submit_ms >= t0 && j.submit_ms <= st_now_ms());
	CHECK_EQ_INT(j.start_ms, 0);
	CHECK_EQ_INT(j.end_ms, 0);
	CHECK_EQ_INT(j.attempts, 0);
	CHECK_STR_EQ(j.device, "");
	st_job_fini(&j);

	/* The claim: compare-and-set QUEUED → ADMITTED with a device. */
	CHECK_EQ_INT(st_job_transition(db, id, ST_QUEUED, ST_ADMITTED, "fits", "cuda:0", &eb), TD_OK);
	/* Losing the race: the job is no longer QUEUED. */
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_transition(db, id, ST_QUEUED, ST_ADMITTED, NULL, NULL, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "is ADMITTED, not QUEUED");
	/* Admission undone: device cleared. */
	CHECK_EQ_INT(st_job_transition(db, id, ST_ADMITTED, ST_QUEUED, "ledger full", NULL, &eb), TD_OK);
	CHECK_EQ_INT(st_job_get(db, id, &j, &eb), TD_OK);
	CHECK_STR_EQ(j.device, "");
	CHECK_STR_EQ(j.reason, "ledger full");
	st_job_fini(&j);
	CHECK_EQ_INT(st_job_transition(db, id, ST_QUEUED, ST_ADMITTED, NULL, "cuda:1", &eb), TD_OK);
	CHECK_EQ_INT(st_job_transition(db, id, ST_ADMITTED, ST_PREPARING, NULL, NULL, &eb), TD_OK);
	CHECK_EQ_INT(st_job_transition(db, id, ST_PREPARING, ST_RUNNING, NULL, NULL, &eb), TD_OK);
	CHECK_EQ_INT(st_job_get(db, id, &j, &eb), TD_OK);
	CHECK_STR_EQ(j.device, "cuda:1");
	CHECK_EQ_INT(j.attempts, 1);
	CHECK(j.start_ms >= t0);
	CHECK_EQ_INT(j.end_ms, 0);
	st_job_fini(&j);
	/* Checkpoints only while running. */
	CHECK_EQ_INT(st_job_set_checkpoint(db, id, "/out/checkpoints/step-20", 20, &eb), TD_OK);
	CHECK_EQ_INT(st_job_set_checkpoint(db, id, "", 30, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_job_set_checkpoint(db, id, "/x", -1, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_job_transition(db, id, ST_RUNNING, ST_SUCCEEDED, "done", NULL, &eb), TD_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_set_checkpoint(db, id, "/out/x", 30, &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "SUCCEEDED");
	CHECK_EQ_INT(st_job_get(db, id, &j, &eb), TD_OK);
	CHECK_EQ_INT(j.state, ST_SUCCEEDED);
	CHECK(j.end_ms >= j.start_ms && j.end_ms > 0);
	CHECK_STR_EQ(j.ckpt_path, "/out/checkpoints/step-20");
	CHECK_EQ_INT(j.ckpt_step, 20);
	CHECK(j.updated_ms >= j.end_ms);
	st_job_fini(&j);

	/* The log of a job, in order, written by the same transactions. */
	static const char *const want[][2] = {
		{"submitted", "submitted by uid 1000"},
		{"state", "QUEUED \u2192 ADMITTED: fits"},
		{"state", "ADMITTED \u2192 QUEUED: ledger full"},
		{"state", "QUEUED \u2192 ADMITTED"},
		{"state", "ADMITTED \u2192 PREPARING"},
		{"state", "PREPARING \u2192 RUNNING"},
		{"checkpoint", "step 20: /out/checkpoints/step-20"},
		{"state", "RUNNING \u2192 SUCCEEDED: done"},
	};
	struct st_event *ev = NULL;
	size_t n = 0;
	CHECK_EQ_INT(st_event_list(db, id, 0, 0, &ev, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, sizeof(want) / sizeof(want[0]));
	for (size_t i = 0; i < n && i < sizeof(want) / sizeof(want[0]); i++) {
		CHECK_STR_EQ(ev[i].kind, want[i][0]);
		CHECK_CONTAINS(ev[i].message, want[i][1]);
		CHECK_EQ_INT(ev[i].job, id);
		if (i)
			CHECK(ev[i].id > ev[i - 1].id && ev[i].time_ms >= ev[i - 1].time_ms);
	}
	/* "QUEUED → ADMITTED" with no reason ends there. */
	if (n > 3)
		CHECK_STR_EQ(ev[3].message, "QUEUED \u2192 ADMITTED");
	/* The cursor: after the 5th event, 2 at a time. */
	struct st_event *ev2 = NULL;
	size_t n2 = 0;
	if (n >= 5) {
		CHECK_EQ_INT(st_event_list(db, id, ev[4].id, 2, &ev2, &n2, &eb), TD_OK);
		CHECK_EQ_INT(n2, 2);
		if (n2 == 2)
			CHECK(ev2[0].id == ev[5].id && ev2[1].id == ev[6].id);
		st_events_free(ev2, n2);
	}
	st_events_free(ev, n);

	/* Events of the daemon's own kinds; bad input. */
	CHECK_EQ_INT(st_event_addf(db, id, "warn", &eb, "loss spike at step %d", 7), TD_OK);
	CHECK_EQ_INT(st_event_list(db, id, 0, 0, &ev, &n, &eb), TD_OK);
	CHECK(n > 0 && strcmp(ev[n - 1].kind, "warn") == 0 &&
	      strcmp(ev[n - 1].message, "loss spike at step 7") == 0);
	st_events_free(ev, n);
	CHECK_EQ_INT(st_event_add(db, id, "", "x", &eb), TD_EINVAL);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_event_add(db, 999999, "info", "x", &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "job 999999");
	CHECK_EQ_INT(st_event_list(db, 999999, 0, 0, &ev, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	CHECK(ev == NULL);

	/* Unknown jobs everywhere. */
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_get(db, 999999, &j, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "job 999999 does not exist");
	CHECK_EQ_INT(st_job_transition(db, 999999, ST_QUEUED, ST_ADMITTED, NULL, NULL, &eb), TD_ENOENT);
	CHECK_EQ_INT(st_job_cancel(db, 999999, NULL, NULL, &eb), TD_ENOENT);
	CHECK_EQ_INT(st_job_set_checkpoint(db, 999999, "/x", 1, &eb), TD_ENOENT);
	struct st_metric m = {.step = 1, .loss = 1, .lr = NAN, .grad_norm = NAN,
			      .tokens_per_s = NAN, .eval_loss = NAN};
	CHECK_EQ_INT(st_metrics_add(db, 999999, &m, 1, &eb), TD_ENOENT);

	/* Submit without a spec. */
	struct st_job_new bad = {.name = "x", .uid = 1};
	int64_t bid = -1;
	CHECK_EQ_INT(st_job_submit(db, &bad, &bid, &eb), TD_EINVAL);
	CHECK_EQ_INT(bid, -1);
	st_close(db);
}

static void test_cancel(void)
{
	struct st_db *db = open_db("cancel.db");
	struct td_errbuf eb = {{0}};
	enum st_job_state s = ST_JOB_STATE_COUNT;

	int64_t q = submit(db, "q", 1000, 0);
	CHECK_EQ_INT(st_job_cancel(db, q, "user asked", &s, &eb), TD_OK);
	CHECK_EQ_INT(s, ST_CANCELLED);
	CHECK_EQ_INT(state_of(db, q), ST_CANCELLED);
	/* Twice: not an error. */
	s = ST_JOB_STATE_COUNT;
	CHECK_EQ_INT(st_job_cancel(db, q, NULL, &s, &eb), TD_OK);
	CHECK_EQ_INT(s, ST_CANCELLED);

	/* Running: only the request is recorded; the runner finishes it. */
	int64_t r = submit(db, "r", 1000, 0);
	drive_to(db, r, ST_RUNNING);
	CHECK_EQ_INT(st_job_cancel(db, r, "stop", &s, &eb), TD_OK);
	CHECK_EQ_INT(s, ST_RUNNING);
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, r, &j, &eb), TD_OK);
	CHECK(j.cancel_requested);
	CHECK_EQ_INT(j.state, ST_RUNNING);
	st_job_fini(&j);
	CHECK_EQ_INT(st_job_cancel(db, r, "stop", &s, &eb), TD_OK);
	CHECK_EQ_INT(st_job_transition(db, r, ST_RUNNING, ST_CANCELLED, "cancelled at step 3", NULL,
				       &eb),
		     TD_OK);
	struct st_event *ev;
	size_t n;
	CHECK_EQ_INT(st_event_list(db, r, 0, 0, &ev, &n, &eb), TD_OK);
	size_t ncancel = 0;
	for (size_t i = 0; i < n; i++)
		ncancel += strcmp(ev[i].kind, "cancel") == 0;
	CHECK_EQ_INT(ncancel, 1); /* the second request adds nothing */
	st_events_free(ev, n);

	/* Finished: nothing to cancel. */
	int64_t done = submit(db, "d", 1000, 0);
	drive_to(db, done, ST_SUCCEEDED);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_cancel(db, done, NULL, &s, &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "already SUCCEEDED");

	/* Interrupted: cancelled at once. */
	int64_t in = submit(db, "i", 1000, 0);
	drive_to(db, in, ST_INTERRUPTED);
	CHECK_EQ_INT(st_job_cancel(db, in, NULL, &s, &eb), TD_OK);
	CHECK_EQ_INT(s, ST_CANCELLED);
	st_close(db);
}

/* ------------------------------------------------------------------------ */
/* Recovery */

static void test_recover(void)
{
	struct st_db *db = open_db("recover.db");
	struct td_errbuf eb = {{0}};
	/* One job per state, plus a running one whose cancel was requested. */
	int64_t id[ST_JOB_STATE_COUNT], rc_id;
	for (int s = 0; s < ST_JOB_STATE_COUNT; s++) {
		id[s] = submit(db, st_job_state_name((enum st_job_state)s), 1000, 0);
		drive_to(db, id[s], (enum st_job_state)s);
	}
	CHECK_EQ_INT(st_job_set_checkpoint(db, id[ST_RUNNING], "/o/ck/step-40", 40, &eb), TD_OK);
	rc_id = submit(db, "running-cancel", 1000, 0);
	drive_to(db, rc_id, ST_RUNNING);
	CHECK_EQ_INT(st_job_cancel(db, rc_id, NULL, NULL, &eb), TD_OK);
	/* Leases the dead daemon held: one for the running job, one not a job's. */
	struct st_device_cap cap = {.total_bytes = 1u << 30, .factor = 1.0, .free_bytes_now = UINT64_MAX};
	struct st_lease_req lr = {.gpu_uuid = "GPU-r", .bytes = 1000, .job_id = id[ST_RUNNING],
				  .uid = 0, .pid = getpid(), .label = "job"};
	int64_t l1, l2;
	CHECK_EQ_INT(st_ledger_reserve(db, &lr, &cap, &l1, &eb), TD_OK);
	lr.job_id = 0;
	lr.label = "other";
	CHECK_EQ_INT(st_ledger_reserve(db, &lr, &cap, &l2, &eb), TD_OK);

	struct st_job *before;
	size_t nbefore;
	CHECK_EQ_INT(st_job_list(db, NULL, &before, &nbefore, &eb), TD_OK);

	struct st_recover_stats rs = {0};
	CHECK_EQ_INT(st_jobs_recover(db, &rs, &eb), TD_OK);
	CHECK_EQ_INT(rs.interrupted, 4); /* ADMITTED, PREPARING, RUNNING, running-cancel */
	CHECK_EQ_INT(rs.requeued, 4);    /* those but the cancelled one, plus INTERRUPTED */
	CHECK_EQ_INT(rs.cancelled, 1);
	CHECK_EQ_INT(rs.leases, 1);

	static const enum st_job_state after[ST_JOB_STATE_COUNT] = {
		[ST_QUEUED] = ST_QUEUED,       [ST_ADMITTED] = ST_QUEUED,
		[ST_PREPARING] = ST_QUEUED,    [ST_RUNNING] = ST_QUEUED,
		[ST_SUCCEEDED] = ST_SUCCEEDED, [ST_FAILED] = ST_FAILED,
		[ST_CANCELLED] = ST_CANCELLED, [ST_INTERRUPTED] = ST_QUEUED,
	};
	for (int s = 0; s < ST_JOB_STATE_COUNT; s++)
		CHECK_MSG(state_of(db, id[s]) == after[s], "job that was %s is now %s",
			  st_job_state_name((enum st_job_state)s), st_job_state_name(state_of(db, id[s])));
	CHECK_EQ_INT(state_of(db, rc_id), ST_CANCELLED);
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, id[ST_RUNNING], &j, &eb), TD_OK);
	CHECK_STR_EQ(j.ckpt_path, "/o/ck/step-40");
	CHECK_EQ_INT(j.ckpt_step, 40);
	CHECK_EQ_INT(j.attempts, 1);
	CHECK_STR_EQ(j.device, "");
	CHECK_CONTAINS(j.reason, "resumes from checkpoint /o/ck/step-40 (step 40)");
	st_job_fini(&j);
	CHECK_EQ_INT(st_job_get(db, id[ST_ADMITTED], &j, &eb), TD_OK);
	CHECK_CONTAINS(j.reason, "starts from step 0");
	st_job_fini(&j);
	struct st_event *ev;
	size_t n;
	CHECK_EQ_INT(st_event_list(db, id[ST_RUNNING], 0, 0, &ev, &n, &eb), TD_OK);
	CHECK(n >= 2);
	if (n >= 2) {
		CHECK_CONTAINS(ev[n - 2].message, "RUNNING \u2192 INTERRUPTED: daemon stopped while RUNNING");
		CHECK_CONTAINS(ev[n - 1].message, "INTERRUPTED \u2192 QUEUED");
	}
	st_events_free(ev, n);

	/* No job lost or duplicated: the same ids, the same specs. */
	struct st_job *now;
	size_t nnow;
	CHECK_EQ_INT(st_job_list(db, NULL, &now, &nnow, &eb), TD_OK);
	CHECK_EQ_INT(nnow, nbefore);
	for (size_t i = 0; i < nnow && i < nbefore; i++)
		CHECK_EQ_INT(now[i].id, before[i].id);
	st_jobs_free(now, nnow);
	st_jobs_free(before, nbefore);
	/* The other lease is not a job's: recovery leaves it to the reaper. */
	struct st_lease *ls;
	CHECK_EQ_INT(st_ledger_list(db, NULL, &ls, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 1);
	if (n == 1)
		CHECK_EQ_INT(ls[0].id, l2);
	free(ls);

	/* Idempotent. */
	CHECK_EQ_INT(st_jobs_recover(db, &rs, &eb), TD_OK);
	CHECK(rs.interrupted == 0 && rs.requeued == 0 && rs.cancelled == 0 && rs.leases == 0);
	st_close(db);
}

/* A daemon SIGKILLed in the middle of a job (a child that never closes its
 * handle), then a new one opening the file: the job is requeued with its
 * checkpoint and its lease is gone. */
static void test_recover_after_kill(void)
{
	const char *path = tpath("killed.db");
	int fds[2];
	if (pipe(fds) != 0) {
		perror("pipe");
		exit(1);
	}
	pid_t pid = fork();
	if (pid == 0) {
		close(fds[0]);
		struct st_db *db = NULL;
		struct td_errbuf eb;
		int64_t id = 0, lease = 0;
		if (st_open(&db, path, NULL, &eb) != TD_OK)
			_exit(2);
		struct st_job_new nj = {.name = "victim", .uid = 1000, .gid = 1000,
					.spec = spec_bytes, .spec_len = sizeof(spec_bytes)};
		struct st_device_cap cap = {.total_bytes = 1u << 30, .factor = 1.0,
					    .free_bytes_now = UINT64_MAX};
		if (st_job_submit(db, &nj, &id, &eb) ||
		    st_job_transition(db, id, ST_QUEUED, ST_ADMITTED, NULL, "cpu", &eb))
			_exit(3);
		struct st_lease_req lr = {.gpu_uuid = "GPU-k", .bytes = 4096, .job_id = id,
					  .uid = 1000, .pid = getpid()};
		if (st_ledger_reserve(db, &lr, &cap, &lease, &eb) ||
		    st_job_transition(db, id, ST_ADMITTED, ST_PREPARING, NULL, NULL, &eb) ||
		    st_job_transition(db, id, ST_PREPARING, ST_RUNNING, NULL, NULL, &eb) ||
		    st_job_set_checkpoint(db, id, "/ck/step-10", 10, &eb))
			_exit(4);
		if (write(fds[1], &id, sizeof(id)) != sizeof(id))
			_exit(5);
		pause(); /* killed here, handle open */
		_exit(6);
	}
	close(fds[1]);
	int64_t id = 0;
	ssize_t got = read(fds[0], &id, sizeof(id));
	close(fds[0]);
	CHECK_EQ_INT(got, sizeof(id));
	kill(pid, SIGKILL);
	int status = 0;
	waitpid(pid, &status, 0);
	CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

	struct st_db *db = open_db("killed.db");
	struct td_errbuf eb;
	CHECK_EQ_INT(state_of(db, id), ST_RUNNING);
	struct st_recover_stats rs;
	CHECK_EQ_INT(st_jobs_recover(db, &rs, &eb), TD_OK);
	CHECK_EQ_INT(rs.interrupted, 1);
	CHECK_EQ_INT(rs.requeued, 1);
	CHECK_EQ_INT(rs.leases, 1);
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, id, &j, &eb), TD_OK);
	CHECK_EQ_INT(j.state, ST_QUEUED);
	CHECK_STR_EQ(j.ckpt_path, "/ck/step-10");
	CHECK_EQ_INT(j.ckpt_step, 10);
	st_job_fini(&j);
	uint64_t reserved = 1;
	CHECK_EQ_INT(st_ledger_reserved(db, "GPU-k", &reserved, &eb), TD_OK);
	CHECK_EQ_INT(reserved, 0);
	st_close(db);
}

/* ------------------------------------------------------------------------ */
/* Persistence and the database file */

static void test_persistence(void)
{
	struct st_db *db = open_db("persist.db");
	struct td_errbuf eb = {{0}};
	int64_t a = submit(db, "a", 1000, 1), b = submit(db, "b", 1001, -3);
	drive_to(db, b, ST_RUNNING);
	CHECK_EQ_INT(st_job_set_checkpoint(db, b, "/ck/b", 7, &eb), TD_OK);
	struct st_metric m[3] = {
		{.step = 1, .loss = 2.5, .lr = 1e-4, .grad_norm = 0.5, .tokens_per_s = 1000, .eval_loss = NAN},
		{.step = 2, .loss = 2.25, .lr = 2e-4, .grad_norm = NAN, .tokens_per_s = 1100, .eval_loss = NAN},
		{.step = 3, .loss = 2.0, .lr = 3e-4, .grad_norm = 0.25, .tokens_per_s = 1200, .eval_loss = 2.1},
	};
	CHECK_EQ_INT(st_metrics_add(db, b, m, 3, &eb), TD_OK);
	struct st_cache_entry ce = {.key = "k1", .path = "/cache/k1.cubin", .sha256 = "ab", .arch = "sm_90",
				    .size_bytes = 4096, .src_bytes = 100};
	CHECK_EQ_INT(st_cache_put(db, &ce, &eb), TD_OK);
	st_close(db);

	db = open_db("persist.db");
	CHECK_EQ_INT(st_schema_version(db), ST_SCHEMA_VERSION);
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, a, &j, &eb), TD_OK);
	CHECK(j.state == ST_QUEUED && j.priority == 1 && strcmp(j.name, "a") == 0);
	st_job_fini(&j);
	CHECK_EQ_INT(st_job_get(db, b, &j, &eb), TD_OK);
	CHECK(j.state == ST_RUNNING && j.priority == -3 && j.uid == 1001 && j.ckpt_step == 7);
	CHECK(j.spec_len == sizeof(spec_bytes) && memcmp(j.spec, spec_bytes, sizeof(spec_bytes)) == 0);
	st_job_fini(&j);
	struct st_metric *got;
	size_t n;
	CHECK_EQ_INT(st_metrics_list(db, b, 0, 0, &got, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 3);
	for (size_t i = 0; i < n && i < 3; i++) {
		CHECK_EQ_INT(got[i].step, m[i].step);
		CHECK(got[i].time_ms > 0);
		CHECK_NEAR(got[i].loss, m[i].loss, 0);
		CHECK_NEAR(got[i].lr, m[i].lr, 0);
		CHECK(isnan(m[i].grad_norm) ? isnan(got[i].grad_norm) : got[i].grad_norm == m[i].grad_norm);
		CHECK(isnan(m[i].eval_loss) ? isnan(got[i].eval_loss) : got[i].eval_loss == m[i].eval_loss);
	}
	free(got);
	/* A resumed job replays step 3 with only loss: lr and eval_loss stay. */
	struct st_metric replay = {.step = 3, .loss = 1.9, .lr = NAN, .grad_norm = NAN,
				   .tokens_per_s = NAN, .eval_loss = NAN};
	CHECK_EQ_INT(st_metrics_add(db, b, &replay, 1, &eb), TD_OK);
	struct st_metric last;
	CHECK_EQ_INT(st_metrics_last(db, b, &last, &eb), TD_OK);
	CHECK_EQ_INT(last.step, 3);
	CHECK_NEAR(last.loss, 1.9, 0);
	CHECK_NEAR(last.lr, 3e-4, 0);
	CHECK_NEAR(last.eval_loss, 2.1, 0);
	CHECK_EQ_INT(st_metrics_list(db, b, 1, 1, &got, &n, &eb), TD_OK);
	CHECK(n == 1 && got[0].step == 2);
	free(got);
	CHECK_EQ_INT(st_metrics_last(db, a, &last, &eb), TD_ENOENT);
	struct st_cache_entry g;
	CHECK_EQ_INT(st_cache_get(db, "k1", &g, &eb), TD_OK);
	CHECK_STR_EQ(g.path, "/cache/k1.cubin");
	st_cache_entry_fini(&g);
	st_close(db);
}

static int raw_exec(const char *path, const char *sql)
{
	sqlite3 *h = NULL;
	int rc = sqlite3_open(path, &h);
	if (rc == SQLITE_OK)
		rc = sqlite3_exec(h, sql, NULL, NULL, NULL);
	if (rc != SQLITE_OK)
		fprintf(stderr, "raw sqlite on %s: %s\n", path, sqlite3_errmsg(h));
	sqlite3_close(h);
	return rc;
}

static int raw_int(const char *path, const char *sql)
{
	sqlite3 *h = NULL;
	sqlite3_stmt *st = NULL;
	int v = -1;
	if (sqlite3_open(path, &h) == SQLITE_OK && sqlite3_prepare_v2(h, sql, -1, &st, NULL) == SQLITE_OK &&
	    sqlite3_step(st) == SQLITE_ROW)
		v = sqlite3_column_int(st, 0);
	sqlite3_finalize(st);
	sqlite3_close(h);
	return v;
}

/* A text result into buf ("" on failure). */
static const char *raw_str(const char *path, const char *sql, char *buf, size_t size)
{
	sqlite3 *h = NULL;
	sqlite3_stmt *st = NULL;
	buf[0] = 0;
	if (sqlite3_open(path, &h) == SQLITE_OK && sqlite3_prepare_v2(h, sql, -1, &st, NULL) == SQLITE_OK &&
	    sqlite3_step(st) == SQLITE_ROW && sqlite3_column_text(st, 0))
		snprintf(buf, size, "%s", (const char *)sqlite3_column_text(st, 0));
	sqlite3_finalize(st);
	sqlite3_close(h);
	return buf;
}

static void write_file(const char *path, const void *data, size_t len)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(data, 1, len, f) != len) {
		fprintf(stderr, "cannot write %s\n", path);
		exit(1);
	}
	fclose(f);
}

static void test_migrations(void)
{
	struct td_errbuf eb = {{0}};
	struct st_db *db = NULL;

	/* A missing file with no_create; an empty path. */
	struct st_open_opts nc = {.no_create = true};
	CHECK_EQ_INT(st_open(&db, tpath("missing.db"), &nc, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "missing.db");
	CHECK(db == NULL);
	CHECK_EQ_INT(st_open(&db, "", NULL, &eb), TD_EINVAL);
	CHECK_EQ_INT(st_open(&db, tmpdir, NULL, &eb), TD_EINVAL); /* a directory */

	/* A new file: created 0600 whatever the umask, at the current version. */
	mode_t old = umask(0);
	db = open_db("new.db");
	umask(old);
	struct stat sb;
	CHECK(stat(tpath("new.db"), &sb) == 0 && (sb.st_mode & 0777) == 0600);
	CHECK_EQ_INT(st_schema_version(db), ST_SCHEMA_VERSION);
	st_close(db);
	CHECK_EQ_INT(raw_int(tpath("new.db"), "PRAGMA user_version"), ST_SCHEMA_VERSION);
	CHECK_EQ_INT(raw_int(tpath("new.db"), "PRAGMA application_id"), 0x54524e44);
	char txt[32];
	CHECK_STR_EQ(raw_str(tpath("new.db"), "PRAGMA journal_mode", txt, sizeof(txt)), "wal");
	CHECK_EQ_INT(raw_int(tpath("new.db"),
			     "SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN "
			     "('jobs','job_events','metrics','ledger','module_cache')"),
		     5);

	/* An empty (0-byte) file, as `touch` leaves it: migrated. */
	write_file(tpath("empty.db"), "", 0);
	db = open_db("empty.db");
	CHECK_EQ_INT(st_schema_version(db), ST_SCHEMA_VERSION);
	st_close(db);

	/* Four processes opening one fresh file at once: every one succeeds, the
	 * migration runs once. */
	pid_t kids[4];
	for (int i = 0; i < 4; i++) {
		kids[i] = fork();
		if (kids[i] == 0) {
			struct st_db *d = NULL;
			struct td_errbuf e2;
			td_err e = st_open(&d, tpath("race.db"), NULL, &e2);
			if (e)
				fprintf(stderr, "race open: %s\n", e2.msg);
			st_close(d);
			_exit(e ? 1 : 0);
		}
	}
	for (int i = 0; i < 4; i++) {
		int status = -1;
		waitpid(kids[i], &status, 0);
		CHECK_MSG(WIFEXITED(status) && WEXITSTATUS(status) == 0, "racing opener %d failed", i);
	}
	CHECK_EQ_INT(raw_int(tpath("race.db"), "PRAGMA user_version"), ST_SCHEMA_VERSION);

	/* A database from the future: refused, and left as it was. */
	char sql[64];
	snprintf(sql, sizeof(sql), "PRAGMA user_version = %d", ST_SCHEMA_VERSION + 1);
	CHECK_EQ_INT(raw_exec(tpath("new.db"), sql), SQLITE_OK);
	memset(&eb, 0, sizeof(eb));
	db = NULL;
	CHECK_EQ_INT(st_open(&db, tpath("new.db"), NULL, &eb), TD_EUNSUPPORTED);
	CHECK(db == NULL);
	CHECK_CONTAINS(eb.msg, "new.db");
	CHECK_CONTAINS(eb.msg, "newer traind");
	CHECK_EQ_INT(raw_int(tpath("new.db"), "PRAGMA user_version"), ST_SCHEMA_VERSION + 1);

	/* Someone else's sqlite database at our path. */
	CHECK_EQ_INT(raw_exec(tpath("foreign.db"), "CREATE TABLE t (x); INSERT INTO t VALUES (1)"),
		     SQLITE_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_open(&db, tpath("foreign.db"), NULL, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "not traind's");
	CHECK_EQ_INT(raw_exec(tpath("other-app.db"), "PRAGMA application_id = 1234"), SQLITE_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_open(&db, tpath("other-app.db"), NULL, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "another application");
}

static void test_corrupt(void)
{
	struct td_errbuf eb = {{0}};
	struct st_db *db = NULL;
	/* Not a database at all. */
	char junk[4096];
	for (size_t i = 0; i < sizeof(junk); i++)
		junk[i] = (char)(i * 131 + 7);
	write_file(tpath("junk.db"), junk, sizeof(junk));
	CHECK_EQ_INT(st_open(&db, tpath("junk.db"), NULL, &eb), TD_EFORMAT);
	CHECK(db == NULL);
	CHECK_CONTAINS(eb.msg, "junk.db");
	CHECK_CONTAINS(eb.msg, "not a traind state database");
	/* Truncated inside the header. */
	write_file(tpath("trunc.db"), "SQLite format 3", 15);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_open(&db, tpath("trunc.db"), NULL, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "trunc.db");

	/* A real database with a damaged page: the integrity check finds it. */
	db = open_db("damaged.db");
	char name[64];
	for (int i = 0; i < 300; i++) {
		snprintf(name, sizeof(name), "job-with-a-longish-name-%d", i);
		submit(db, name, 1000, 0);
	}
	st_close(db); /* last close checkpoints the WAL into the file */
	const char *p = tpath("damaged.db");
	struct stat sb;
	CHECK(stat(p, &sb) == 0 && sb.st_size >= 8 * 4096);
	int page = raw_int(p, "PRAGMA page_size");
	int fd = open(p, O_WRONLY);
	CHECK(fd >= 0 && page > 0);
	if (fd >= 0 && page > 0) {
		/* Overwrite pages 3.. with junk; page 1 (the header) stays valid. */
		for (off_t off = 2 * page; off + (off_t)sizeof(junk) <= sb.st_size && off < 8 * page;
		     off += page)
			CHECK(pwrite(fd, junk, sizeof(junk) < (size_t)page ? sizeof(junk) : (size_t)page,
				     off) > 0);
		close(fd);
	}
	struct st_open_opts chk = {.integrity_check = true};
	memset(&eb, 0, sizeof(eb));
	td_err e = st_open(&db, p, &chk, &eb);
	CHECK_EQ_INT(e, TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "damaged.db");
	if (e == TD_OK)
		st_close(db);
}

/* ------------------------------------------------------------------------ */
/* Listing, counting, the queue */

static void test_list_and_queue(void)
{
	struct st_db *db = open_db("queue.db");
	struct td_errbuf eb = {{0}};
	/* uid, priority, then the state to leave it in. */
	static const struct {
		uid_t uid;
		int32_t prio;
		enum st_job_state s;
	} jobs[] = {
		{1000, 0, ST_QUEUED},  {1001, 0, ST_QUEUED},  {1000, 0, ST_RUNNING},
		{1002, 5, ST_QUEUED},  {1001, 0, ST_QUEUED},  {1000, 5, ST_QUEUED},
		{1002, 0, ST_QUEUED},  {1000, 0, ST_ADMITTED}, {1001, 0, ST_SUCCEEDED},
		{1003, -1, ST_QUEUED}, {1002, 0, ST_PREPARING},
	};
	enum { NJ = sizeof(jobs) / sizeof(jobs[0]) };
	int64_t ids[NJ];
	for (int i = 0; i < NJ; i++) {
		ids[i] = submit(db, "q", jobs[i].uid, jobs[i].prio);
		drive_to(db, ids[i], jobs[i].s);
	}
	/* The expected order, computed here: priority desc, the user's active jobs
	 * asc, age (submit order = id order here). */
	int active[2000] = {0};
	for (int i = 0; i < NJ; i++)
		if (jobs[i].s == ST_ADMITTED || jobs[i].s == ST_PREPARING || jobs[i].s == ST_RUNNING)
			active[jobs[i].uid]++;
	int order[NJ], nq = 0;
	for (int i = 0; i < NJ; i++)
		if (jobs[i].s == ST_QUEUED)
			order[nq++] = i;
	for (int a = 1; a < nq; a++) /* insertion sort by the key */
		for (int b = a; b > 0; b--) {
			int x = order[b - 1], y = order[b];
			bool swap = jobs[x].prio < jobs[y].prio ||
				    (jobs[x].prio == jobs[y].prio && active[jobs[x].uid] > active[jobs[y].uid]);
			if (!swap)
				break;
			order[b - 1] = y;
			order[b] = x;
		}
	struct st_queued *q;
	size_t n;
	CHECK_EQ_INT(st_job_queue(db, &q, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, nq);
	for (size_t i = 0; i < n && (int)i < nq; i++) {
		int k = order[i];
		CHECK_MSG(q[i].id == ids[k], "queue[%zu] = job %lld, want %lld", i, (long long)q[i].id,
			  (long long)ids[k]);
		CHECK_EQ_INT(q[i].user_active, active[q[i].uid]);
		CHECK(q[i].spec_len == sizeof(spec_bytes) && memcmp(q[i].spec, spec_bytes, q[i].spec_len) == 0);
		int queued_of_user = 0;
		for (int m = 0; m < NJ; m++)
			queued_of_user += jobs[m].s == ST_QUEUED && jobs[m].uid == q[i].uid;
		CHECK_EQ_INT(q[i].user_queued, queued_of_user);
	}
	st_queue_free(q, n);

	/* Listing: mine, by state, newest-limited; counts. */
	struct st_job_filter f = {.uid = 1000};
	struct st_job *l;
	CHECK_EQ_INT(st_job_list(db, &f, &l, &n, &eb), TD_OK);
	int want = 0;
	for (int i = 0; i < NJ; i++)
		want += jobs[i].uid == 1000;
	CHECK_EQ_INT(n, want);
	for (size_t i = 0; i < n; i++) {
		CHECK_EQ_INT(l[i].uid, 1000);
		CHECK(l[i].spec == NULL);
		if (i)
			CHECK(l[i].id > l[i - 1].id);
	}
	st_jobs_free(l, n);
	f = (struct st_job_filter){.all_users = true, .state_mask = ST_MASK_ACTIVE, .with_spec = true};
	CHECK_EQ_INT(st_job_list(db, &f, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 3);
	for (size_t i = 0; i < n; i++)
		CHECK(l[i].spec_len == sizeof(spec_bytes));
	st_jobs_free(l, n);
	f = (struct st_job_filter){.all_users = true, .limit = 3};
	CHECK_EQ_INT(st_job_list(db, &f, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 3);
	if (n == 3)
		CHECK(l[0].id == ids[NJ - 3] && l[2].id == ids[NJ - 1]);
	st_jobs_free(l, n);
	uint32_t c = 0;
	CHECK_EQ_INT(st_job_count(db, 1000, ST_MASK(ST_QUEUED), &c, &eb), TD_OK);
	CHECK_EQ_INT(c, 2);
	CHECK_EQ_INT(st_job_count(db, 1000, 0, &c, &eb), TD_OK);
	CHECK_EQ_INT(c, want);

	/* The per-user cap on queued jobs, checked with the insert. */
	struct st_job_new nj = {.uid = 1000, .spec = spec_bytes, .spec_len = sizeof(spec_bytes),
				.max_queued_per_user = 3};
	int64_t id;
	CHECK_EQ_INT(st_job_submit(db, &nj, &id, &eb), TD_OK); /* 3rd queued */
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_submit(db, &nj, &id, &eb), TD_EBUSY);
	CHECK_CONTAINS(eb.msg, "user 1000 has 3 queued jobs (limit 3)");
	nj.uid = 1003;
	CHECK_EQ_INT(st_job_submit(db, &nj, &id, &eb), TD_OK);
	st_close(db);
}

/* ------------------------------------------------------------------------ */
/* Module cache */

static void test_cache(void)
{
	struct st_db *db = open_db("cache.db");
	struct td_errbuf eb = {{0}};
	struct st_cache_entry a = {.key = "b-key", .path = "/c/b.cubin", .sha256 = "00ff", .arch = "sm_80",
				   .size_bytes = 123456, .src_bytes = 789};
	struct st_cache_entry b = {.key = "a-key", .path = "/c/a.cubin", .sha256 = "11ee", .arch = "sm_90",
				   .size_bytes = 42, .src_bytes = 7};
	CHECK_EQ_INT(st_cache_put(db, &a, &eb), TD_OK);
	CHECK_EQ_INT(st_cache_put(db, &b, &eb), TD_OK);
	struct st_cache_entry g;
	CHECK_EQ_INT(st_cache_get(db, "b-key", &g, &eb), TD_OK);
	CHECK_EQ_INT(g.hits, 1);
	st_cache_entry_fini(&g);
	CHECK_EQ_INT(st_cache_get(db, "b-key", &g, &eb), TD_OK);
	CHECK_STR_EQ(g.path, "/c/b.cubin");
	CHECK_STR_EQ(g.sha256, "00ff");
	CHECK_STR_EQ(g.arch, "sm_80");
	CHECK_EQ_INT(g.size_bytes, 123456);
	CHECK_EQ_INT(g.src_bytes, 789);
	CHECK_EQ_INT(g.hits, 2);
	CHECK(g.used_ms >= g.created_ms && g.created_ms > 0);
	st_cache_entry_fini(&g);
	/* Rebuilt: the entry is replaced and its count restarts. */
	a.sha256 = "abcd";
	CHECK_EQ_INT(st_cache_put(db, &a, &eb), TD_OK);
	CHECK_EQ_INT(st_cache_get(db, "b-key", &g, &eb), TD_OK);
	CHECK_STR_EQ(g.sha256, "abcd");
	CHECK_EQ_INT(g.hits, 1);
	st_cache_entry_fini(&g);
	struct st_cache_entry *l;
	size_t n;
	CHECK_EQ_INT(st_cache_list(db, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 2);
	if (n == 2)
		CHECK(strcmp(l[0].key, "a-key") == 0 && strcmp(l[1].key, "b-key") == 0);
	st_cache_entries_free(l, n);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_cache_get(db, "nope", &g, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "nope");
	CHECK_EQ_INT(st_cache_del(db, "a-key", &eb), TD_OK);
	CHECK_EQ_INT(st_cache_del(db, "a-key", &eb), TD_ENOENT);
	struct st_cache_entry bad = {.key = "x"};
	CHECK_EQ_INT(st_cache_put(db, &bad, &eb), TD_EINVAL);
	size_t cleared = 0;
	CHECK_EQ_INT(st_cache_clear(db, &cleared, &eb), TD_OK);
	CHECK_EQ_INT(cleared, 1);
	CHECK_EQ_INT(st_cache_list(db, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	st_close(db);
}

/* ------------------------------------------------------------------------ */
/* One handle, many threads */

enum { NTHREADS = 4, PER_THREAD = 50 };
static struct st_db *shared_db;
static int64_t thread_ids[NTHREADS][PER_THREAD];

static void *submitter(void *arg)
{
	int t = (int)(intptr_t)arg;
	for (int i = 0; i < PER_THREAD; i++) {
		struct st_job_new n = {.name = "thr", .uid = 2000 + (uid_t)t, .spec = spec_bytes,
				       .spec_len = sizeof(spec_bytes)};
		struct td_errbuf eb;
		if (st_job_submit(shared_db, &n, &thread_ids[t][i], &eb) != TD_OK)
			thread_ids[t][i] = -1;
		st_event_add(shared_db, thread_ids[t][i], "info", "hello", &eb);
	}
	return NULL;
}

static void test_threads(void)
{
	shared_db = open_db("threads.db");
	pthread_t th[NTHREADS];
	for (int t = 0; t < NTHREADS; t++)
		pthread_create(&th[t], NULL, submitter, (void *)(intptr_t)t);
	for (int t = 0; t < NTHREADS; t++)
		pthread_join(th[t], NULL);
	struct st_job *l;
	size_t n;
	struct td_errbuf eb;
	CHECK_EQ_INT(st_job_list(shared_db, NULL, &l, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, NTHREADS * PER_THREAD);
	/* Every id handed out once, each in the list. */
	for (int t = 0; t < NTHREADS; t++)
		for (int i = 0; i < PER_THREAD; i++) {
			int64_t id = thread_ids[t][i];
			int seen = 0;
			for (size_t k = 0; k < n; k++)
				seen += l[k].id == id && l[k].uid == 2000 + (uid_t)t;
			CHECK_MSG(seen == 1, "thread %d job %d (id %lld) seen %d times", t, i,
				  (long long)id, seen);
		}
	st_jobs_free(l, n);
	st_close(shared_db);
}

/* ------------------------------------------------------------------------ */
/* Operating a shared host (issue 14): holds, requeue, priority, dependencies,
 * the accounting, and a version-1 database opened by this build. */

static bool has_event(struct st_db *db, int64_t id, const char *kind, const char *needle)
{
	struct st_event *ev = NULL;
	size_t n = 0;
	struct td_errbuf eb;
	bool found = false;
	if (st_event_list(db, id, 0, 0, &ev, &n, &eb) != TD_OK)
		return false;
	for (size_t i = 0; i < n; i++)
		found = found || (strcmp(ev[i].kind, kind) == 0 && strstr(ev[i].message, needle));
	st_events_free(ev, n);
	return found;
}

static const struct st_queued *queued_find(const struct st_queued *q, size_t n, int64_t id)
{
	for (size_t i = 0; i < n; i++)
		if (q[i].id == id)
			return &q[i];
	return NULL;
}

static void test_operations(void)
{
	struct st_db *db = open_db("ops.db");
	struct td_errbuf eb = {{0}};
	bool changed = false;

	/* Hold and release. */
	int64_t a = submit(db, "a", 1000, 0);
	CHECK_EQ_INT(st_job_hold(db, a, true, "uid 1000", &changed, &eb), TD_OK);
	CHECK(changed);
	CHECK_EQ_INT(st_job_hold(db, a, true, "uid 1000", &changed, &eb), TD_OK);
	CHECK(!changed);
	CHECK(has_event(db, a, "hold", "held by uid 1000"));
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, a, &j, &eb), TD_OK);
	CHECK(j.held && j.state == ST_QUEUED);
	st_job_fini(&j);
	struct st_queued *q;
	size_t n;
	CHECK_EQ_INT(st_job_queue(db, &q, &n, &eb), TD_OK);
	CHECK(queued_find(q, n, a) && queued_find(q, n, a)->held);
	st_queue_free(q, n);
	CHECK_EQ_INT(st_job_hold(db, a, false, "uid 0", &changed, &eb), TD_OK);
	CHECK(changed);
	CHECK(has_event(db, a, "hold", "released by uid 0"));
	drive_to(db, a, ST_RUNNING);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_hold(db, a, true, "uid 1000", NULL, &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "is RUNNING; only a queued job can be held");

	/* Priority: column, spec and event; refused once ended. */
	static const uint8_t spec2[] = {0x0a, 0x01, 'z'};
	CHECK_EQ_INT(st_job_set_priority(db, a, 7, spec2, sizeof(spec2), "uid 0", &eb), TD_OK);
	CHECK_EQ_INT(st_job_get(db, a, &j, &eb), TD_OK);
	CHECK_EQ_INT(j.priority, 7);
	CHECK(j.spec_len == sizeof(spec2) && memcmp(j.spec, spec2, sizeof(spec2)) == 0);
	st_job_fini(&j);
	CHECK(has_event(db, a, "priority", "priority 0 \u2192 7 by uid 0"));

	/* Dependencies: b and c wait on a; d on c; a chain fails as a whole. */
	int64_t after_a[] = {a};
	struct st_job_new nb = {.name = "b", .uid = 1000, .spec = spec_bytes,
				.spec_len = sizeof(spec_bytes), .after = after_a, .nafter = 1};
	int64_t b = 0, c = 0, d = 0;
	CHECK_EQ_INT(st_job_submit(db, &nb, &b, &eb), TD_OK);
	CHECK_EQ_INT(st_job_submit(db, &nb, &c, &eb), TD_OK);
	int64_t after_c[] = {c};
	nb.after = after_c;
	CHECK_EQ_INT(st_job_submit(db, &nb, &d, &eb), TD_OK);
	CHECK(has_event(db, d, "submitted", "starts after job(s) "));
	CHECK_EQ_INT(st_job_queue(db, &q, &n, &eb), TD_OK);
	CHECK(queued_find(q, n, b) && queued_find(q, n, b)->deps_pending == 1 &&
	      queued_find(q, n, b)->dep_waiting == a);
	st_queue_free(q, n);
	struct st_dep *deps;
	CHECK_EQ_INT(st_job_deps(db, d, &deps, &n, &eb), TD_OK);
	CHECK(n == 1 && deps[0].id == c && deps[0].state == ST_QUEUED);
	free(deps);
	/* Bad dependencies at submit. */
	int64_t bad[] = {999999};
	nb.after = bad;
	memset(&eb, 0, sizeof(eb));
	int64_t x = 0;
	CHECK_EQ_INT(st_job_submit(db, &nb, &x, &eb), TD_ENOENT);
	CHECK_CONTAINS(eb.msg, "job 999999 does not exist");
	int64_t twice[] = {a, a};
	nb.after = twice;
	nb.nafter = 2;
	CHECK_EQ_INT(st_job_submit(db, &nb, &x, &eb), TD_EINVAL);
	nb.nafter = 1;

	/* a fails: b, c and (through c) d fail with it, in one transaction. */
	CHECK_EQ_INT(st_job_transition(db, a, ST_RUNNING, ST_FAILED, "boom", NULL, &eb), TD_OK);
	CHECK_EQ_INT(state_of(db, b), ST_FAILED);
	CHECK_EQ_INT(state_of(db, c), ST_FAILED);
	CHECK_EQ_INT(state_of(db, d), ST_FAILED);
	CHECK(has_event(db, d, "state", "dependency: job"));
	nb.after = after_a;
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_submit(db, &nb, &x, &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "is FAILED, so this job could never start");

	/* Requeue: b refused while a is FAILED; a, then b, then b waits again. */
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_requeue(db, b, "requeued by uid 1000", &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "requeue job");
	CHECK_EQ_INT(st_job_requeue(db, a, "requeued by uid 1000", &eb), TD_OK);
	CHECK_EQ_INT(st_job_get(db, a, &j, &eb), TD_OK);
	CHECK(j.state == ST_QUEUED && j.end_ms == 0 && !j.cancel_requested && j.attempts == 1);
	st_job_fini(&j);
	CHECK_EQ_INT(st_job_requeue(db, b, "requeued by uid 1000", &eb), TD_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_requeue(db, b, "again", &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "is QUEUED");
	drive_to(db, a, ST_SUCCEEDED);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(st_job_requeue(db, a, "again", &eb), TD_ESTATE);
	CHECK_CONTAINS(eb.msg, "submit a new job");
	CHECK_EQ_INT(st_job_queue(db, &q, &n, &eb), TD_OK);
	CHECK(queued_find(q, n, b) && queued_find(q, n, b)->deps_pending == 0);
	st_queue_free(q, n);
	CHECK_EQ_INT(st_job_set_priority(db, a, 1, NULL, 0, "uid 0", &eb), TD_ESTATE);
	/* A cancelled job is requeued too; a cancel request is forgotten. */
	int64_t e1 = submit(db, "e", 1000, 0);
	CHECK_EQ_INT(st_job_cancel(db, e1, "by me", NULL, &eb), TD_OK);
	CHECK_EQ_INT(st_job_requeue(db, e1, "requeued", &eb), TD_OK);
	CHECK_EQ_INT(state_of(db, e1), ST_QUEUED);
	st_close(db);
}

static void test_usage(void)
{
	struct st_db *db = open_db("usage.db");
	struct td_errbuf eb = {{0}};
	/* Two jobs of two users; one holds two leases (a gang) of 1 MiB. */
	int64_t a = submit(db, "a", 1000, 0), b = submit(db, "b", 1001, 0);
	int64_t t0 = st_now_ms();
	CHECK_EQ_INT(st_usage_accrue(db, t0 + 1000, &eb), TD_OK); /* 1 s queued each (about) */
	drive_to(db, a, ST_ADMITTED);
	int64_t lease[2];
	struct st_lease_req lr[2] = {
		{.gpu_uuid = "GPU-u0", .bytes = 1 << 20, .job_id = a, .uid = 1000, .pid = getpid()},
		{.gpu_uuid = "GPU-u1", .bytes = 1 << 20, .job_id = a, .uid = 1000, .pid = getpid()},
	};
	struct st_device_cap cap[2] = {{.total_bytes = 1u << 30, .factor = 1, .free_bytes_now = UINT64_MAX},
				       {.total_bytes = 1u << 30, .factor = 1, .free_bytes_now = UINT64_MAX}};
	CHECK_EQ_INT(st_ledger_reserve_gang(db, lr, cap, 2, lease, &eb), TD_OK);
	drive_to(db, b, ST_ADMITTED); /* b: a CPU job, no lease */
	int64_t t1 = st_now_ms();
	CHECK_EQ_INT(st_usage_accrue(db, t1 + 10000, &eb), TD_OK);
	CHECK_EQ_INT(st_usage_add_tokens(db, a, 4096, &eb), TD_OK);
	CHECK_EQ_INT(st_usage_add_tokens(db, 424242, 1, &eb), TD_ENOENT);
	struct st_usage u;
	CHECK_EQ_INT(st_usage_of_job(db, a, &u, &eb), TD_OK);
	/* About 10 s active (from the transition to the accrual), × 2 GPUs. */
	CHECK_MSG(u.run_ms >= 9900 && u.run_ms <= 10100, "run_ms %lld", (long long)u.run_ms);
	CHECK_EQ_INT(u.gpu_ms, 2 * u.run_ms);
	CHECK_EQ_INT(u.cpu_ms, 0);
	CHECK_NEAR(u.gpu_mem_bs, (double)u.run_ms / 1000.0 * 2 * (1 << 20), 1.0);
	CHECK_EQ_INT(u.tokens, 4096);
	CHECK(u.queued_ms >= 1000);
	CHECK_EQ_INT(st_usage_of_job(db, b, &u, &eb), TD_OK);
	CHECK_EQ_INT(u.gpu_ms, 0);
	CHECK_EQ_INT(u.cpu_ms, u.run_ms);
	/* Per user, per job, one user, a window from the future. */
	struct st_usage_row *r;
	size_t n;
	CHECK_EQ_INT(st_usage_list(db, 0, false, true, 0, &r, &n, &eb), TD_OK);
	CHECK(n == 2 && r[0].uid == 1000 && r[1].uid == 1001 && r[0].u.jobs == 1 && r[0].u.gpu_ms > 0);
	free(r);
	CHECK_EQ_INT(st_usage_list(db, 0, true, false, 1001, &r, &n, &eb), TD_OK);
	CHECK(n == 1 && r[0].job == b && r[0].uid == 1001);
	free(r);
	CHECK_EQ_INT(st_usage_list(db, t1 + 7200 * 1000, false, true, 0, &r, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	free(r);
	/* The end accrues in the transition's own transaction: no time is
	 * counted after it. */
	CHECK_EQ_INT(st_job_transition(db, a, ST_ADMITTED, ST_FAILED, "x", NULL, &eb), TD_OK);
	struct st_usage u1, u2;
	CHECK_EQ_INT(st_usage_of_job(db, a, &u1, &eb), TD_OK);
	CHECK_EQ_INT(st_usage_accrue(db, st_now_ms() + 60000, &eb), TD_OK);
	CHECK_EQ_INT(st_usage_of_job(db, a, &u2, &eb), TD_OK);
	CHECK_EQ_INT(u2.run_ms, u1.run_ms);
	st_close(db);

	/* A version-1 database (this build's schema less migrations 2 and 3)
	 * opens, keeps its jobs, and accrues from its first accrual on. */
	db = open_db("v1.db");
	int64_t old = submit(db, "old", 1000, 0);
	st_close(db);
	CHECK_EQ_INT(raw_exec(tpath("v1.db"),
			      "DROP TABLE shared_holders; DROP TABLE shared_blocks;"
			      " DROP TABLE usage; DROP TABLE job_deps; ALTER TABLE jobs DROP COLUMN held;"
			      " ALTER TABLE jobs DROP COLUMN acct_ms; PRAGMA user_version = 1"),
		     SQLITE_OK);
	CHECK_EQ_INT(raw_int(tpath("v1.db"), "PRAGMA user_version"), 1);
	db = open_db("v1.db");
	CHECK_EQ_INT(st_schema_version(db), ST_SCHEMA_VERSION);
	struct st_job j;
	CHECK_EQ_INT(st_job_get(db, old, &j, &eb), TD_OK);
	CHECK(j.state == ST_QUEUED && !j.held && strcmp(j.name, "old") == 0);
	st_job_fini(&j);
	CHECK_EQ_INT(st_usage_accrue(db, st_now_ms(), &eb), TD_OK);
	CHECK_EQ_INT(st_usage_of_job(db, old, &u, &eb), TD_OK);
	CHECK_EQ_INT(u.queued_ms, 0); /* acct_ms 0: nothing before the first accrual */
	CHECK_EQ_INT(st_usage_accrue(db, st_now_ms() + 5000, &eb), TD_OK);
	CHECK_EQ_INT(st_usage_of_job(db, old, &u, &eb), TD_OK);
	CHECK(u.queued_ms >= 4900);
	st_close(db);
}

int main(void)
{
	const char *base = getenv("TMPDIR");
	snprintf(tmpdir, sizeof(tmpdir), "%s/td-state-XXXXXX", base && *base && strlen(base) < 40 ? base : "/tmp");
	if (!mkdtemp(tmpdir)) {
		fprintf(stderr, "mkdtemp %s: %s\n", tmpdir, strerror(errno));
		return 1;
	}
	test_state_names();
	test_transition_table();
	test_transitions();
	test_cancel();
	test_recover();
	test_recover_after_kill();
	test_persistence();
	test_migrations();
	test_corrupt();
	test_list_and_queue();
	test_cache();
	test_threads();
	test_operations();
	test_usage();
	check_rm_tree(tmpdir);
	return check_status();
}
