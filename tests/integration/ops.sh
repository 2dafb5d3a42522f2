#!/bin/bash
# Operating a shared host (issue 14, item 2) with a real daemon and real
# users (created here; needs root, else skipped): A and B own jobs, C is in
# the admin group. hold / release (a held job is not admitted while a slot is
# free), requeue (a cancelled job runs again from its last checkpoint),
# priority (within user_priority_max for users, any for admins; it changes
# the order of admission) and submit --after (starts once its dependencies
# succeeded; fails, with the jobs waiting on it, when one fails). Each with
# its refusals: B cannot hold, release, requeue or re-prioritise A's job, nor
# wait on it; C, an admin, can. Last, the README's backup: sqlite3 .backup
# while the daemon runs, restored in place; a damaged database refused.
if [ "$(id -u)" != 0 ]; then
	echo "SKIP: needs root to create users with useradd (run the suite as root)"
	exit 77
fi
for tool in useradd userdel groupadd groupdel setpriv; do
	if ! command -v "$tool" >/dev/null; then
		echo "SKIP: $tool is not installed"
		exit 77
	fi
done
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1

A=tdopa$$
B=tdopb$$
C=tdopc$$
G=tdopg$$
extra_cleanup() {
	for u in "$A" "$B" "$C"; do userdel "$u" 2>/dev/null; done
	groupdel "$G" 2>/dev/null
}
groupadd "$G" || exit 1
useradd -M -U -s /bin/false "$A" && useradd -M -U -s /bin/false "$B" &&
	useradd -M -U -G "$G" -s /bin/false "$C" || exit 1
for u in "$A" "$B"; do
	mkdir -p "$WORK/$u"
	cp -r tests/fixtures/qwen2 "$WORK/$u/model"
	cp tests/fixtures/demo/fortunes.tokens "$WORK/$u/data.tokens"
	chown -R "$u:$u" "$WORK/$u"
	chmod 700 "$WORK/$u"
done
share_with_users || exit 1
ctlA() { as_user "$A" "$UCTL" --socket "$SOCK" "$@"; }
ctlB() { as_user "$B" "$UCTL" --socket "$SOCK" "$@"; }
ctlC() { as_user "$C" "$UCTL" --socket "$SOCK" "$@"; }
# subA NAME [FLAGS]: one of A's jobs; prints its id.
subA() {
	local n=$1
	shift
	ctlA submit "$UJOB" --model "$WORK/$A/model" --data "$WORK/$A/data.tokens" \
		--output "$WORK/$A/$n" "$@"
}
started_order() { sed -n 's/.*TD-JOB-START: job \([0-9]*\) .*/\1/p' "$LOG" | tr '\n' ' ' | sed 's/ $//'; }
all_ended() {
	for j in "$@"; do ended "$j" || return 1; done
}
waiting_of() { ctl show "$1" | sed -n 's/^waiting: *//p'; }

CONF=$WORK/traind.conf
printf 'cpu_slots = 1\nuser_priority_max = 10\n' >"$CONF"
start_daemon --system --config "$CONF" --admin-group "$G"
expect_contains "C is an admin" "$(ctlC info)" "admin: you see every job"

# --- hold and release ---
h=$(subA held --hold)
check "A submits a held job" test -n "$h"
sleep 2.5
expect_eq "a held job is not admitted while the slot is free" "$(job_state "$h")" QUEUED
expect_contains "show says why it waits" "$(ctl show "$h")" "waiting:     held (trainctl release $h starts it)"
expect_contains "ls says it too" "$(ctlA ls)" "held (trainctl release $h"
ctlB release "$h" >/dev/null 2>"$WORK/err"
expect_eq "B may not release A's job: exit 4" "$?" 4
expect_contains "and is told whose it is" "$(cat "$WORK/err")" "belongs to another user"
ctlB hold "$h" >/dev/null 2>&1
expect_eq "nor hold it: exit 4" "$?" 4
expect_contains "A releases it" "$(ctlA release "$h")" "job $h released"
check "released, it runs to the end" wait_for 60 job_is "$h" SUCCEEDED
expect_contains "its events say who held and released it" "$(ctl logs "$h")" "released by uid $(id -u "$A")"

# A's queued job, held by the admin C, then by A; held twice is no error.
printf 'cpu_slots = 0\nuser_priority_max = 10\n' >"$CONF"
reload_daemon
q=$(subA q)
expect_contains "C (an admin) holds A's job" "$(ctlC hold "$q")" "job $q held"
expect_contains "holding it again changes nothing" "$(ctlA hold "$q")" "job $q held"
expect_contains "the event names C" "$(ctl logs "$q")" "held by uid $(id -u "$C")"
ctlA hold 999999 >/dev/null 2>&1
expect_eq "hold of a job that does not exist: exit 5" "$?" 5
ctlA hold 0 >/dev/null 2>&1
expect_eq "hold 0: exit 2" "$?" 2
ctlA hold "$h" >/dev/null 2>"$WORK/err"
expect_eq "hold of a job that ended: exit 1" "$?" 1
expect_contains "its error names the state" "$(cat "$WORK/err")" "is SUCCEEDED; only a queued job can be held"
ctlA cancel "$q" >/dev/null

# --- priority: within user_priority_max for A, any for C; it orders admission ---
p1=$(subA p1)
p2=$(subA p2)
p3=$(subA p3)
expect_contains "A raises p3 to 10" "$(ctlA priority "$p3" 10)" "job $p3: priority 10"
ctlA priority "$p2" 50 >/dev/null 2>"$WORK/err"
expect_eq "A may not go over user_priority_max: exit 4" "$?" 4
expect_contains "the error names the setting" "$(cat "$WORK/err")" "user_priority_max"
subA p4 --priority 50 >/dev/null 2>"$WORK/err"
expect_eq "nor submit over it: exit 4" "$?" 4
expect_contains "that error names the field" "$(cat "$WORK/err")" "resources.priority: 50"
ctlB priority "$p1" 1 >/dev/null 2>"$WORK/err"
expect_eq "B may not change A's priority: exit 4" "$?" 4
expect_contains "B is told" "$(cat "$WORK/err")" "may change its priority"
expect_contains "C (an admin) gives p2 50" "$(ctlC priority "$p2" 50)" "job $p2: priority 50"
ctlC priority "$p2" 101 >/dev/null 2>"$WORK/err"
expect_eq "101 is out of range even for admins: exit 2" "$?" 2
ctlA priority "$p2" x >/dev/null 2>&1
expect_eq "a priority that is not a number: exit 2" "$?" 2
expect_contains "the spec says the new priority" "$(ctl show "$p2")" "priority:    50"
expect_contains "the events say who changed it" "$(ctl logs "$p2")" "priority 0 → 50 by uid $(id -u "$C")"
: >"$LOG"
printf 'cpu_slots = 1\nuser_priority_max = 10\n' >"$CONF"
reload_daemon
check "the three run to the end" wait_for 90 all_ended "$p1" "$p2" "$p3"
expect_eq "admitted by the new priorities: 50, 10, then 0" "$(started_order)" "$p2 $p3 $p1"

# --- requeue: a cancelled job runs again from its last checkpoint ---
r=$(subA r --steps 400 --checkpoint-every 10)
has_ckpt() { [ -n "$(json_field "$(ctl --json show "$1")" checkpoint)" ]; }
check "it checkpoints" wait_for 60 has_ckpt "$r"
ctlA cancel "$r" >/dev/null
check "A cancels it" wait_for 30 job_is "$r" CANCELLED
step_c=$(json_field "$(ctl --json show "$r")" step)
ctlB requeue "$r" >/dev/null 2>"$WORK/err"
expect_eq "B may not requeue A's job: exit 4" "$?" 4
expect_contains "B is told" "$(cat "$WORK/err")" "may requeue it"
ctlC requeue "$r" >"$WORK/out"
expect_eq "C (an admin) requeues it" "$?" 0
expect_contains "it resumes from its checkpoint" "$(cat "$WORK/out")" "resumes from checkpoint"
ctlA requeue "$r" >/dev/null 2>"$WORK/err"
expect_eq "requeue of a queued job: exit 1" "$?" 1
expect_contains "the error names the state" "$(cat "$WORK/err")" "only a FAILED or CANCELLED job"
check "the requeued job runs to the end" wait_for 120 job_is "$r" SUCCEEDED
logs=$(ctl logs "$r")
expect_contains "the trainer resumed from the checkpoint" "$logs" "resumed from $WORK/$A/r/checkpoints/step-"
expect_contains "the requeue is in its events" "$logs" "CANCELLED → QUEUED: requeued by uid $(id -u "$C")"
expect_eq "two attempts" "$(json_field "$(ctl --json show "$r")" attempts)" 2
check "it had stepped ($step_c) before the cancel" test "${step_c:-0}" -gt 0
ctlA requeue "$r" >/dev/null 2>"$WORK/err"
expect_eq "a SUCCEEDED job is not requeued: exit 1" "$?" 1
expect_contains "it says to submit anew" "$(cat "$WORK/err")" "submit a new job"

# --- submit --after ---
printf 'cpu_slots = 0\nuser_priority_max = 10\n' >"$CONF"
reload_daemon
d1=$(subA d1)
d2=$(subA d2 --after "$d1")
check "A submits a job after another" test -n "$d2"
expect_contains "it waits for its dependency" "$(waiting_of "$d2")" "waits for job $d1 (QUEUED) to succeed"
expect_contains "show lists it" "$(ctl show "$d2")" "after:       $d1"
subB=$(ctlB submit "$UJOB" --model "$WORK/$B/model" --data "$WORK/$B/data.tokens" \
	--output "$WORK/$B/x" --after "$d1" 2>"$WORK/err")
expect_eq "B may not wait on A's job: exit 4" "$?" 4
expect_contains "B is told" "$(cat "$WORK/err")" "submit --after: job $d1 belongs to another user"
check "nothing was queued for B" test -z "$subB"
subA bad1 --after 999999 >/dev/null 2>"$WORK/err"
expect_eq "--after a job that does not exist: exit 5" "$?" 5
expect_contains "the error names the flag" "$(cat "$WORK/err")" "submit --after: job 999999 does not exist"
subA bad2 --after "$d1,x" >/dev/null 2>"$WORK/err"
expect_eq "--after that is not a list of ids: exit 2" "$?" 2
expect_contains "the error names the flag" "$(cat "$WORK/err")" "--after: '$d1,x' is not a valid value"
# f1 is cancelled: f2 after it, and f3 after f2, fail with it.
f1=$(subA f1)
f2=$(subA f2 --after "$f1")
f3=$(subA f3 --after "$f2,$d1")
ctlA cancel "$f1" >/dev/null
expect_eq "f2 fails when its dependency is cancelled" "$(job_state "$f2")" FAILED
expect_contains "its reason names the dependency" "$(ctl show "$f2")" "dependency: job $f1 ended CANCELLED"
expect_eq "f3, after f2, fails too" "$(job_state "$f3")" FAILED
expect_contains "its reason names f2" "$(ctl show "$f3")" "dependency: job $f2 ended FAILED"
subA bad3 --after "$f1" >/dev/null 2>"$WORK/err"
expect_eq "--after a cancelled job: exit 1" "$?" 1
expect_contains "the error says why" "$(cat "$WORK/err")" "is CANCELLED, so this job could never start"
ctlA requeue "$f2" >/dev/null 2>"$WORK/err"
expect_eq "f2 cannot be requeued before f1: exit 1" "$?" 1
expect_contains "the error says which first" "$(cat "$WORK/err")" "requeue job $f1 first"
# root, an admin, may make a job of its own wait on A's.
d3=$(ctl submit "$TD_SRC/tests/integration/job.txtpb" --output "$WORK/d3" --after "$d1")
check "root submits a job after A's" test -n "$d3"
: >"$LOG"
printf 'cpu_slots = 1\nuser_priority_max = 10\n' >"$CONF"
reload_daemon
check "d1, then d2 and d3 run to the end" wait_for 120 all_ended "$d1" "$d2" "$d3"
expect_eq "root's job after A's succeeded" "$(job_state "$d3")" SUCCEEDED
expect_eq "d1 succeeded" "$(job_state "$d1")" SUCCEEDED
expect_eq "d2 succeeded after it" "$(job_state "$d2")" SUCCEEDED
s1=$(json_field "$(ctl --json show "$d1")" end_time)
s2=$(json_field "$(ctl --json show "$d2")" start_time)
check "d2 started ($s2) after d1 ended ($s1)" awk -v a="$s2" -v b="$s1" 'BEGIN { exit !(a >= b) }'

# --- what trainctl would never send: refused, naming the field ---
raw() { "$RPC_RAW" "$SOCK" "$@"; }
expect_contains "hold without an id" "$(raw hold-no-id)" "request.hold.id: missing"
expect_contains "priority without a value" "$(raw priority-no-value)" "request.priority.priority: missing"
expect_contains "usage since a negative time" "$(raw usage-bad-since)" "request.usage.since: -5"
expect_contains "submit after job 2^63" "$(raw after-huge "$TD_SRC/tests/fixtures/qwen2" \
	"$TD_SRC/tests/fixtures/demo/fortunes.tokens" "$WORK/huge")" "submit --after: 9223372036854775808 is not a job id"
check "the daemon serves on" ctl info >/dev/null

# --- the README's backup and restore: sqlite3 .backup online, then restored ---
if command -v sqlite3 >/dev/null; then
	njobs=$(ctl --json ls --all | grep -c '"id":')
	sqlite3 "$STATE/traind.db" ".backup '$WORK/backup.db'"
	expect_eq "an online backup while the daemon runs" "$?" 0
	expect_eq "the backup passes quick_check" "$(sqlite3 "$WORK/backup.db" 'PRAGMA quick_check')" ok
	stop_daemon
	mkdir "$WORK/aside" && mv "$STATE"/traind.db* "$WORK/aside/"
	cp "$WORK/backup.db" "$STATE/traind.db" && chmod 600 "$STATE/traind.db"
	start_daemon --system --config "$CONF" --admin-group "$G"
	expect_eq "the restored daemon has every job" "$(ctl --json ls --all | grep -c '"id":')" "$njobs"
	expect_contains "with its state" "$(ctl show "$r")" "state:       SUCCEEDED"
	stop_daemon
	printf 'garbage' >"$STATE/traind.db"
	rm -f "$STATE"/traind.db-wal "$STATE"/traind.db-shm
	"$TRAIND" --socket "$SOCK" --state-dir "$STATE" --cache-dir "$WORK/cache" >"$WORK/bad.out" 2>&1
	expect_eq "a damaged database is refused at start: exit 1" "$?" 1
	expect_contains "saying what to do" "$(cat "$WORK/bad.out")" "move it aside"
else
	note "sqlite3 not installed: the backup and restore are not checked"
	stop_daemon
fi
finish
