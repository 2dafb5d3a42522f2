#!/bin/bash
# The live view (issue 14, item 4). `trainctl top` in a real terminal (tmux:
# new-session, capture-pane, send-keys): the simulated GPU with its reserved
# memory, the running jobs with progress, tokens/s and ETA, the queue with
# why each job waits (held, a dependency); it refreshes (the step moves), shows
# the daemon unreachable while it restarts and comes back with it, and q
# quits. Its snapshots for scripts: --once (plain, no escapes) and --json.
# `trainctl watch`: plain lines carry an ETA, and a daemon killed and
# restarted under it is waited for (the job resumes; watch exits with its
# outcome instead of code 3). Skipped (77) where tmux is not installed.
if ! command -v tmux >/dev/null; then
	echo "SKIP: tmux is not installed (apt-get install tmux): trainctl top needs a real terminal"
	exit 77
fi
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
JOB=$TD_SRC/tests/integration/job.txtpb
TMUX_SRV=tdit-top-$$
tm() { tmux -L "$TMUX_SRV" "$@"; }
extra_cleanup() { tm kill-server 2>/dev/null; }
screen() { tm capture-pane -p -t top; }
step_of() { # the step of job NAME on the screen
	screen | sed -n "s/.* $1 .*\] \([0-9]*\)\/.*/\1/p" | head -n 1
}

start_daemon --user --cpu-slots 1 --fake-gpus GPU-top-0:64M
g=$(ctl submit "$JOB" --device any --steps 100000 --checkpoint-every 0 --output "$WORK/g" --name gpujob)
c=$(ctl submit "$JOB" --device cpu --steps 100000 --checkpoint-every 0 --output "$WORK/c" --name cpujob)
h=$(ctl submit "$JOB" --hold --output "$WORK/h" --name heldjob)
d=$(ctl submit "$JOB" --after "$c" --output "$WORK/d" --name depjob)
check "four jobs submitted" test -n "$g" -a -n "$c" -a -n "$h" -a -n "$d"
check "the GPU job runs" wait_for 30 job_is "$g" RUNNING
check "the CPU job runs" wait_for 30 job_is "$c" RUNNING

# --- the screen ---
tm new-session -d -s top -x 160 -y 40 \
	"env TERM=xterm-256color '$TRAINCTL' --socket '$SOCK' top --interval 0.5; sleep 60"
has_rows() { screen | grep -q "gpujob"; }
check "top draws" wait_for 10 has_rows
s1=$(screen)
expect_contains "the header" "$s1" "2 running, 2 queued, 1 CPU slot(s)"
expect_contains "the GPU table" "$s1" "RESERVED"
lease=$(ctl --json ledger | sed -n 's/^ *"reserved_bytes": *\([0-9]*\),\{0,1\}$/\1/p' | head -n 1)
mib=$(awk -v b="$lease" 'BEGIN { printf "%.1f MiB", b / 1048576 }')
expect_contains "the GPU's reserved memory ($mib)" "$(printf '%s\n' "$s1" | grep "simulated GPU")" "$mib"
expect_contains "running: the GPU job on its GPU" "$(printf '%s\n' "$s1" | grep gpujob)" "GPU-top-0"
expect_contains "running: the CPU job on the CPU" "$(printf '%s\n' "$s1" | grep cpujob)" " cpu"
row=$(printf '%s\n' "$s1" | grep gpujob)
row_ok() { local re='/100000 +[0-9.]+ +[0-9]+ +[0-9]+:[0-9]{2}'; [[ $row =~ $re ]]; }
check "the job's row has loss, tokens/s and an ETA ($row)" row_ok
expect_contains "the queue: why the held job waits" "$s1" "held (trainctl release $h starts it)"
expect_contains "the queue: why the dependent job waits" "$s1" "waits for job $c (RUNNING) to succeed"
expect_contains "the footer" "$s1" "q: quit"
st1=$(step_of gpujob)
sleep 1.5
st2=$(step_of gpujob)
check "it refreshes: the step moves ($st1, then $st2)" test "${st2:-0}" -gt "${st1:-0}"

# --- the daemon restarts under it ---
kill9_daemon
gone() { screen | grep -q "traind unreachable"; }
check "top says the daemon is unreachable" wait_for 10 gone
start_daemon --user --cpu-slots 1 --fake-gpus GPU-top-0:64M
back() { screen | grep -q "gpujob" && ! screen | grep -q "unreachable"; }
check "and shows the jobs again once it is back" wait_for 30 back

# --- q quits, and the terminal is given back ---
tm send-keys -t top q
quit() { ! pgrep -f "trainctl --socket $SOCK top" >/dev/null; }
check "q quits" wait_for 10 quit
expect_contains "the normal screen is back (no alternate buffer)" "$(tm display-message -p -t top '#{alternate_on}')" "0"
tm kill-session -t top 2>/dev/null

# --- snapshots ---
once=$(ctl top --once)
expect_contains "--once: the running jobs" "$once" "gpujob"
expect_contains "--once: the queue" "$once" "held (trainctl release $h starts it)"
expect_eq "--once: no escape sequences" "$(printf '%s' "$once" | grep -c $'\033')" 0
js=$(ctl --json top)
expect_contains "--json: the devices" "$js" "\"uuid\": \"GPU-top-0\""
expect_contains "--json: why a job waits" "$js" "\"waiting\": \"held (trainctl release $h starts it)\""
expect_eq "--json: the four jobs that have not ended" "$(printf '%s\n' "$js" | grep -c '"name": "[a-z]*job"')" 4
ctl top --interval 0.01 >/dev/null 2>"$WORK/err"
expect_eq "a bad --interval: exit 2" "$?" 2
expect_contains "named" "$(cat "$WORK/err")" "top: --interval: '0.01'"

for j in "$g" "$c" "$h" "$d"; do ctl cancel "$j" >/dev/null; done
check "the jobs stop" wait_for 30 job_is "$g" CANCELLED

# --- watch: an ETA, and a daemon that restarts is waited for ---
w=$(ctl submit "$JOB" --steps 2000 --checkpoint-every 50 --output "$WORK/w" --name watched)
"$TRAINCTL" --socket "$SOCK" --timeout 2 watch "$w" >"$WORK/watch.out" 2>"$WORK/watch.err" &
WATCH=$!
ckpt() { ctl logs "$w" | grep -q "checkpoint at step"; }
check "the watched job checkpoints" wait_for 60 ckpt
kill9_daemon
sleep 4 # past watch's --timeout: its request fails, it must dial again
start_daemon --user --cpu-slots 1 --fake-gpus GPU-top-0:64M
wait "$WATCH"
expect_eq "watch exits with the job's outcome (0), not 3" "$?" 0
expect_contains "it said it reconnects" "$(cat "$WORK/watch.err")" "traind went away"
expect_contains "and that it did" "$(cat "$WORK/watch.err")" "reconnected to traind"
expect_contains "it followed the resumed job to its end" "$(cat "$WORK/watch.out")" "job $w SUCCEEDED"
expect_contains "the job resumed from its checkpoint" "$(ctl logs "$w")" "resumed from"
check "its lines carry an ETA" grep -Eq "step [0-9]+/2000 .* eta [0-9]+:[0-9]{2}" "$WORK/watch.out"
"$TRAINCTL" --socket "$WORK/nosuch.sock" watch "$w" >/dev/null 2>&1
expect_eq "no daemon at all: exit 3 at once" "$?" 3
stop_daemon
finish
