# Shared by the integration tests: a real traind on a temporary socket with a
# temporary state dir, on the CPU backend, driven through trainctl.
#
# Environment (from tests/integration/meson.build): TRAIND, TRAINCTL, RPC_RAW,
# TD_FIXTURES. Each test sources this file, calls start_daemon, checks things
# with check/expect_*, and ends with `finish`. The daemon is stopped (and,
# if it still runs, killed) and the work dir removed on exit.

set -u
: "${TRAIND:?}" "${TRAINCTL:?}" "${TD_FIXTURES:?}"

# Short: a socket path must fit in 107 bytes.
WORK=$(mktemp -d /tmp/td-it.XXXXXX) || exit 1
chmod 755 "$WORK"
SOCK=$WORK/traind.sock
STATE=$WORK/state
LOG=$WORK/traind.log
DPID=
LOG_SHOWN=
FAILS=0
CHECKS=0
# The test's own stdout, where a FAIL line goes even from a check whose
# output the caller sends elsewhere (`check ... ctl info >/dev/null`).
exec 8>&1

cleanup() {
	kill $(pgrep -P "$WATCHDOG" 2>/dev/null) "$WATCHDOG" 2>/dev/null
	if [ -n "$DPID" ] && kill -0 "$DPID" 2>/dev/null; then
		kill -TERM "$DPID" 2>/dev/null
		for _ in $(seq 1 100); do kill -0 "$DPID" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$DPID" 2>/dev/null
	fi
	if declare -F extra_cleanup >/dev/null; then extra_cleanup; fi
	if [ "$FAILS" -ne 0 ] && [ -f "$LOG" ] && [ -z "${LOG_SHOWN:-}" ]; then
		echo "---- traind log ----"
		tail -n 150 "$LOG"
	fi
	rm -rf "$WORK"
}
trap cleanup EXIT

# stacks_brief: gdb's "thread apply all bt" as a line a thread, innermost
# first, the functions only (libc's waits and unnamed frames left out),
# identical threads counted once.
stacks_brief() {
	awk '/^Thread /{ if (t != "") print t; t = ""; next }
	     /^#/{ f = ($3 == "in") ? $4 : $2
		   if (f ~ /^(__|\?\?|start_thread|clone)/) next
		   t = t (t == "" ? "" : " < ") f }
	     END { if (t != "") print t }' | sort | uniq -c | sort -rn | cut -c1-300 | head -n 30
}

# The watchdog: a test still running 25 s before its limit (TD_TEST_TIMEOUT,
# which meson.build sets to the test's timeout; none where it is unset)
# shows, while its daemons still run, which check it is in, each daemon's
# threads (gdb, where installed) and the log's tail. At the limit meson's
# SIGTERM reaches the daemons too, so this is the one look at a hang seen
# once in CI. Silent where the test ends in time.
watchdog() {
	local after=$((${TD_TEST_TIMEOUT:-0} - 25))
	[ "$after" -gt 0 ] || return
	sleep "$after" >/dev/null 2>&1 || return
	echo "---- watchdog: still running after $after s, in: $(cat "$WORK/current" 2>/dev/null) ----"
	local p
	for p in $(pgrep -f -- "$WORK"); do
		[ "$(cat "/proc/$p/comm" 2>/dev/null)" = traind ] || continue
		echo "-- traind $p: $(tr '\0' ' ' <"/proc/$p/cmdline" | cut -c1-200)"
		DPID=$p dump_daemon "watchdog" | stacks_brief
	done
	[ -f "$LOG" ] && tail -n 40 "$LOG" | sed 's/^/log: /'
	: >"$WORK/dumped"
}
# Killed from outside (meson's timeout sends SIGTERM to the whole process
# group, the daemon's included, and SIGKILL half a second later): say at
# once which check was running; cleanup then prints the daemon's log, so
# that a hang seen once in CI can be read afterwards.
on_term() {
	trap - TERM
	if [ -f "$LOG" ] && [ ! -e "$WORK/dumped" ]; then
		echo "---- traind log ----"
		tail -n 80 "$LOG"
	fi
	LOG_SHOWN=1
	bad "killed by SIGTERM (a timeout?) during: $(cat "$WORK/current" 2>/dev/null || echo "(before the first check)")"
	exit 1
}
trap on_term TERM

note() { echo "# $*"; }

bad() {
	FAILS=$((FAILS + 1))
	echo "FAIL: $*" >&8
}

# check DESCRIPTION COMMAND...: the command must succeed.
check() {
	local what=$1
	shift
	CHECKS=$((CHECKS + 1))
	printf '%s\n' "$what" >"$WORK/current" # for the watchdog and on_term
	if ! "$@"; then
		bad "$what"
		return 1
	fi
}

# expect_eq DESCRIPTION GOT WANT
expect_eq() {
	CHECKS=$((CHECKS + 1))
	if [ "$2" != "$3" ]; then bad "$1: got '$2', want '$3'"; fi
}

# expect_contains DESCRIPTION TEXT NEEDLE
expect_contains() {
	CHECKS=$((CHECKS + 1))
	case "$2" in
	*"$3"*) ;;
	*) bad "$1: '$2' does not contain '$3'" ;;
	esac
}

ctl() { "$TRAINCTL" --socket "$SOCK" "$@"; }

# dump_daemon WHY: when the daemon stopped answering, its threads' stacks
# (gdb, where installed) into the test's output, so that a hang seen once in
# CI can be read afterwards.
dump_daemon() {
	echo "---- traind stopped answering ($1): its threads ----"
	if [ -n "$DPID" ] && command -v gdb >/dev/null; then
		gdb -batch -p "$DPID" -ex "thread apply all bt" 2>&1 | grep -E '^(Thread|#)' | head -n 200
	else
		echo "(gdb is not installed)"
	fi
}

# For tests that act as other users: what those users run and read comes
# from $WORK (0755), never from the checkout or the build dir, which may sit
# where other users cannot enter (a clone under /root, mode 0700). Copies
# trainctl, the test job file and the .proto that trainctl hands protoc into
# $WORK/shared and sets UCTL and UJOB to them; as_user USER CMD... runs CMD
# in $WORK as USER, with trainctl reading that .proto.
share_with_users() {
	mkdir -p "$WORK/shared" || return 1
	cp "$TRAINCTL" "$WORK/shared/trainctl" &&
		cp "$TD_SRC/tests/integration/job.txtpb" "$TD_SRC/proto/traind.proto" "$WORK/shared/" &&
		chmod -R a+rX "$WORK/shared" || return 1
	UCTL=$WORK/shared/trainctl
	UJOB=$WORK/shared/job.txtpb
}
as_user() {
	local u=$1
	shift
	(cd "$WORK" && TD_PROTO_PATH="$WORK/shared/traind.proto" \
		setpriv --reuid="$u" --regid="$u" --init-groups "$@")
}

# json_field JSON NAME: the value of "NAME" in trainctl's --json output (a
# flat lookup, enough for the scalar fields the tests read).
json_field() {
	printf '%s\n' "$1" | sed -n "s/^ *\"$2\": *\"\{0,1\}\([^\",]*\)\"\{0,1\},\{0,1\}$/\1/p" | head -n 1
}

# start_daemon [SETTINGS...]: starts traind and waits until it answers.
start_daemon() {
	"$TRAIND" --socket "$SOCK" --state-dir "$STATE" --cache-dir "$WORK/cache" "$@" >>"$LOG" 2>&1 &
	DPID=$!
	for _ in $(seq 1 300); do
		if ctl info >/dev/null 2>&1; then return 0; fi
		if ! kill -0 "$DPID" 2>/dev/null; then
			echo "FAIL: traind exited at start:"
			cat "$LOG"
			exit 1
		fi
		sleep 0.1
	done
	echo "FAIL: traind did not answer within 30 s"
	exit 1
}

# stop_daemon: SIGTERM; the daemon must exit 0 (under ASan: without leaks).
# A daemon still there after 75 s (its own shutdown_timeout_s is 60 s by
# default) is a hang: its threads' stacks are shown, and it is killed.
stop_daemon() {
	kill -TERM "$DPID"
	printf '%s\n' "traind stops on SIGTERM" >"$WORK/current"
	local _
	for _ in $(seq 1 750); do
		kill -0 "$DPID" 2>/dev/null || break
		sleep 0.1
	done
	if kill -0 "$DPID" 2>/dev/null; then
		bad "traind did not exit within 75 s of SIGTERM"
		dump_daemon "SIGTERM did not stop it"
		kill -KILL "$DPID"
	fi
	wait "$DPID"
	local rc=$?
	expect_eq "traind exit status after SIGTERM" "$rc" 0
	DPID=
}

# kill9_daemon: the daemon dies without a word.
kill9_daemon() {
	kill -KILL "$DPID"
	wait "$DPID" 2>/dev/null
	DPID=
}

# wait_for SECONDS COMMAND...: polls until the command succeeds.
wait_for() {
	local secs=$1
	shift
	for _ in $(seq 1 $((secs * 10))); do
		if "$@"; then return 0; fi
		sleep 0.1
	done
	return 1
}

# reload_daemon: SIGHUP, then wait until the daemon has logged that it read
# its settings again (or kept the old ones) — not a fixed sleep, which a
# loaded host's event loop may outlast. A daemon that never logs it fails
# the check.
reload_daemon() {
	local n
	n=$(grep -c "TD-CONFIG-RELOAD" "$LOG")
	kill -HUP "$DPID"
	check "SIGHUP: the daemon read its settings again" wait_for 30 \
		sh -c "[ \"\$(grep -c TD-CONFIG-RELOAD '$LOG')\" -gt $n ]"
}

# job_state ID: QUEUED, RUNNING, SUCCEEDED, ...
job_state() {
	json_field "$(ctl --json show "$1")" state | sed 's/^JOB_STATE_//'
}

# job_is ID STATE: whether the job is in STATE now.
job_is() {
	[ "$(job_state "$1")" = "$2" ]
}

# ended ID: whether the job has ended (SUCCEEDED, FAILED or CANCELLED).
ended() { case $(job_state "$1") in SUCCEEDED | FAILED | CANCELLED) return 0 ;; esac; return 1; }

finish() {
	echo "$CHECKS checks, $FAILS failed"
	[ "$FAILS" -eq 0 ]
}

# Started last, when every function it calls is defined (a background
# subshell sees only what was defined before it forked).
watchdog &
WATCHDOG=$!
