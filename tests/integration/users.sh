#!/bin/bash
# Contract 8 with two real users (created here; needs root, else skipped):
# B cannot see A's job, cancel it, list everyone's jobs, make the daemon read
# a file only A can read (at submit, and at run time through a symlink swapped
# in after the submit), or write into A's directory. A's job writes its files
# as A. The system-mode socket (0666) admits both; identity is the socket's.
if [ "$(id -u)" != 0 ]; then
	echo "SKIP: needs root to create two users with useradd (run the suite as root to test contract 8)"
	exit 77
fi
for tool in useradd userdel setpriv; do
	if ! command -v "$tool" >/dev/null; then
		echo "SKIP: $tool is not installed"
		exit 77
	fi
done
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1

A=tdita$$
B=tditb$$
extra_cleanup() {
	userdel "$A" 2>/dev/null
	userdel "$B" 2>/dev/null
}
useradd -M -U -s /bin/false "$A" || exit 1
useradd -M -U -s /bin/false "$B" || exit 1

for u in "$A" "$B"; do
	d=$WORK/$u
	mkdir -p "$d"
	cp -r tests/fixtures/qwen2 "$d/model"
	cp tests/fixtures/demo/fortunes.tokens "$d/data.tokens"
	chown -R "$u:$u" "$d"
	chmod 700 "$d"
done
share_with_users || exit 1
JOB=$UJOB
ctlA() { as_user "$A" "$UCTL" --socket "$SOCK" "$@"; }
ctlB() { as_user "$B" "$UCTL" --socket "$SOCK" "$@"; }

start_daemon --system --cpu-slots 1
check "the socket admits every user (0666)" test "$(stat -c %a "$SOCK")" = 666

idA=$(ctlA submit "$JOB" --model "$WORK/$A/model" --data "$WORK/$A/data.tokens" \
	--output "$WORK/$A/out" --steps 100000 --checkpoint-every 0)
check "A submits" test -n "$idA"
check "A's job runs" wait_for 30 job_is "$idA" RUNNING

# --- B and A's job ---
ctlB show "$idA" >/dev/null 2>"$WORK/err"
expect_eq "B: show A's job: exit 4" "$?" 4
expect_contains "B: show's error" "$(cat "$WORK/err")" "belongs to another user"
ctlB cancel "$idA" >/dev/null 2>&1
expect_eq "B: cancel A's job: exit 4" "$?" 4
ctlB watch "$idA" >/dev/null 2>"$WORK/err"
expect_eq "B: watch A's job: exit 4" "$?" 4
expect_contains "B: watch's error" "$(cat "$WORK/err")" "may watch it"
ctlB logs "$idA" >/dev/null 2>"$WORK/err"
expect_eq "B: logs of A's job: exit 4" "$?" 4
expect_contains "B: logs' error says logs" "$(cat "$WORK/err")" "may read its logs"
expect_contains "B: ls shows none of A's jobs" "$(ctlB ls)" "no jobs"
ctlB ls --all >/dev/null 2>&1
expect_eq "B: ls --all: exit 4" "$?" 4
expect_eq "A's job still runs" "$(job_state "$idA")" RUNNING
expect_contains "root sees A's job" "$(ctl show "$idA")" "state:       RUNNING"

# --- B and A's files, at submit ---
ctlB submit "$JOB" --model "$WORK/$A/model" --data "$WORK/$B/data.tokens" --output "$WORK/$B/o1" \
	>/dev/null 2>"$WORK/err"
expect_eq "B: A's model dir: exit 4" "$?" 4
expect_contains "B: the error names the field" "$(cat "$WORK/err")" "model_dir: $WORK/$A/model"
ctlB submit "$JOB" --model "$WORK/$B/model" --data "$WORK/$A/data.tokens" --output "$WORK/$B/o2" \
	>/dev/null 2>"$WORK/err"
expect_eq "B: A's data file: exit 4" "$?" 4
expect_contains "B: the error names the field" "$(cat "$WORK/err")" "data.train_file: $WORK/$A/data.tokens"
ctlB submit "$JOB" --model "$WORK/$B/model" --data "$WORK/$B/data.tokens" --output "$WORK/$A/from-b" \
	>/dev/null 2>"$WORK/err"
expect_eq "B: output into A's dir: exit 4" "$?" 4
expect_contains "B: the error names the field" "$(cat "$WORK/err")" "output.dir: $WORK/$A"
check "nothing of B's appeared in A's dir" test ! -e "$WORK/$A/from-b"

# --- at run time: a symlink to A's data swapped in after the submit ---
idB=$(ctlB submit "$JOB" --model "$WORK/$B/model" --data "$WORK/$B/data.tokens" --output "$WORK/$B/out")
check "B submits a job of its own" test -n "$idB"
expect_eq "it waits behind A's (one CPU slot)" "$(job_state "$idB")" QUEUED
as_user "$B" ln -sf "$WORK/$A/data.tokens" "$WORK/$B/data.tokens"
ctlA cancel "$idA" >/dev/null
expect_eq "A cancels its own job" "$?" 0
check "A's job ends CANCELLED" wait_for 30 job_is "$idA" CANCELLED
ctlB watch "$idB" >/dev/null 2>&1
expect_eq "B's job fails: watch exits 1" "$?" 1
showB=$(ctlB show "$idB")
expect_contains "B's job failed reading A's file as B" "$showB" "ermission denied"
expect_contains "its reason names the file (B's symlink to A's)" "$showB" "$WORK/$B/data.tokens: cannot open"

# --- what A's job wrote is A's ---
check "A's job wrote its checkpoint" test -d "$WORK/$A/out/checkpoints"

# --- the module cache: anyone may look, only admins clear it ---
expect_contains "B may list the module cache" "$(ctlB cache)" "0 modules"
ctlB cache clear >/dev/null 2>"$WORK/err"
expect_eq "B may not clear it: exit 4" "$?" 4
expect_contains "and is told who may" "$(cat "$WORK/err")" "only root, the admin group"
check "A's output dir belongs to A" test "$(stat -c %U "$WORK/$A/out")" = "$A"
expect_eq "every file A's job wrote belongs to A" "$(find "$WORK/$A/out" ! -user "$A" | wc -l)" 0
stop_daemon
finish
