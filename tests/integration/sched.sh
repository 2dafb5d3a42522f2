#!/bin/bash
# The scheduler's order — priority, then fair share between users (the one
# with the least running work first), then age — and the per-user limits.
# Jobs are queued while cpu_slots is 0, then SIGHUP opens the slots and the
# order in which they start (the daemon's TD-JOB-START lines) is checked.
# The fair-share part needs a second user (root only; skipped otherwise).
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
CONF=$WORK/traind.conf
JOB=$TD_SRC/tests/integration/job.txtpb

started_order() { # the job ids in the order they were admitted
	sed -n 's/.*TD-JOB-START: job \([0-9]*\) .*/\1/p' "$LOG" | tr '\n' ' ' | sed 's/ $//'
}
all_done() {
	for j in "$@"; do
		case "$(job_state "$j")" in SUCCEEDED | FAILED | CANCELLED) ;; *) return 1 ;; esac
	done
}
reset_log() { : >"$LOG"; }

# --- priority, then age; max_queued_per_user ---
printf 'cpu_slots = 0\nmax_queued_per_user = 3\n' >"$CONF"
start_daemon --user --config "$CONF"
j1=$(ctl submit "$JOB" --output "$WORK/p1")
j2=$(ctl submit "$JOB" --output "$WORK/p2" --priority 5)
j3=$(ctl submit "$JOB" --output "$WORK/p3")
ctl submit "$JOB" --output "$WORK/p4" >/dev/null 2>"$WORK/err"
expect_eq "a 4th queued job over max_queued_per_user=3: exit 7" "$?" 7
expect_contains "the limit is named" "$(cat "$WORK/err")" "limit 3"
expect_eq "with cpu_slots 0 nothing starts" "$(job_state "$j2")" QUEUED
reset_log
printf 'cpu_slots = 1\nmax_queued_per_user = 3\n' >"$CONF"
reload_daemon
check "all three run to the end" wait_for 60 all_done "$j1" "$j2" "$j3"
expect_eq "priority first, then the oldest" "$(started_order)" "$j2 $j1 $j3"

# --- max_running_per_user: two slots, but one job at a time for this user ---
printf 'cpu_slots = 0\nmax_running_per_user = 1\n' >"$CONF"
reload_daemon
k1=$(ctl submit "$JOB" --output "$WORK/r1")
k2=$(ctl submit "$JOB" --output "$WORK/r2")
printf 'cpu_slots = 2\nmax_running_per_user = 1\n' >"$CONF"
reload_daemon
check "both run to the end" wait_for 60 all_done "$k1" "$k2"
end1=$(json_field "$(ctl --json show "$k1")" end_time)
start2=$(json_field "$(ctl --json show "$k2")" start_time)
check "the second started ($start2) after the first ended ($end1)" \
	awk -v a="$start2" -v b="$end1" 'BEGIN { exit !(a >= b) }'
stop_daemon

# --- fair share between two users ---
if [ "$(id -u)" != 0 ] || ! command -v useradd >/dev/null || ! command -v setpriv >/dev/null; then
	note "fair share between users skipped: needs root, useradd and setpriv to create a second user"
	finish
	exit $?
fi
U=tditc$$
extra_cleanup() { userdel "$U" 2>/dev/null; }
useradd -M -U -s /bin/false "$U" || exit 1
mkdir -p "$WORK/$U"
cp -r tests/fixtures/qwen2 "$WORK/$U/model"
cp tests/fixtures/demo/fortunes.tokens "$WORK/$U/data.tokens"
chown -R "$U:$U" "$WORK/$U"
rm -rf "$STATE"
printf 'cpu_slots = 0\n' >"$CONF"
start_daemon --system --config "$CONF"
a1=$(ctl submit "$JOB" --output "$WORK/a1")
a2=$(ctl submit "$JOB" --output "$WORK/a2")
share_with_users || exit 1
b1=$(as_user "$U" "$UCTL" --socket "$SOCK" submit "$UJOB" --model "$WORK/$U/model" \
	--data "$WORK/$U/data.tokens" --output "$WORK/$U/b1")
check "the second user submits" test -n "$b1"
reset_log
printf 'cpu_slots = 2\n' >"$CONF"
reload_daemon
check "all three run to the end" wait_for 60 all_done "$a1" "$a2" "$b1"
expect_eq "root's oldest, then the user with nothing running, then root's second" \
	"$(started_order)" "$a1 $b1 $a2"
stop_daemon
finish
