#!/bin/bash
# The accounting (issue 14, item 3) with a real daemon, a simulated GPU and
# two real users (created here; needs root, else skipped): per job, GPU
# seconds (running time × GPUs held), GPU memory seconds (× the lease's
# bytes), CPU-slot seconds, tokens trained, time queued and running, in
# `trainctl show` and `trainctl usage` (per user, --jobs, --since, --json);
# users see their own usage only, admins everyone's. Fair share counts the
# same numbers: of two users with one job each queued, the one who used less
# starts first, older job or not. quota_gpu_hours: a user at the quota gets
# no job admitted (the reason says so) until the quota is raised.
if [ "$(id -u)" != 0 ]; then
	echo "SKIP: needs root to create users with useradd (run the suite as root)"
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

A=tdusa$$
B=tdusb$$
extra_cleanup() {
	userdel "$A" 2>/dev/null
	userdel "$B" 2>/dev/null
}
useradd -M -U -s /bin/false "$A" && useradd -M -U -s /bin/false "$B" || exit 1
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
# sub USER NAME [FLAGS]: a job of USER's; prints its id.
sub() {
	local u=$1 n=$2
	shift 2
	as_user "$u" "$UCTL" --socket "$SOCK" submit "$UJOB" --model "$WORK/$u/model" \
		--data "$WORK/$u/data.tokens" --output "$WORK/$u/$n" "$@"
}
started_order() { sed -n 's/.*TD-JOB-START: job \([0-9]*\) .*/\1/p' "$LOG" | tr '\n' ' ' | sed 's/ $//'; }
# usage_of ID FIELD: a field of show's usage (--json, nested: the last match).
usage_of() {
	ctl --json show "$1" | sed -n "s/^ *\"$2\": *\([0-9.e+-]*\),\{0,1\}$/\1/p" | tail -n 1
}
# near A B REL: |A - B| <= REL × |B|
near() { awk -v a="$1" -v b="$2" -v r="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; m = b < 0 ? -b : b; exit !(d <= r * m) }'; }

CONF=$WORK/traind.conf
printf 'cpu_slots = 1\n' >"$CONF"
start_daemon --system --config "$CONF" --fake-gpus GPU-usage-0:64M

# --- one job on the (simulated) GPU, one on a CPU slot ---
g=$(sub "$A" g --device any --recompute none)
check "A's GPU job succeeds" wait_for 60 job_is "$g" SUCCEEDED
plan=$(ctl logs "$g" | sed -n 's/.*plan: \([0-9]*\) bytes;.*/\1/p' | head -n 1)
check "its plan is in its events ($plan bytes)" test -n "$plan"
gpu_s=$(usage_of "$g" gpu_s)
run_s=$(usage_of "$g" running_s)
mem_bs=$(usage_of "$g" gpu_mem_byte_s)
check "GPU seconds ($gpu_s) > 0" awk -v a="$gpu_s" 'BEGIN { exit !(a > 0) }'
check "one GPU: GPU seconds ($gpu_s) = running seconds ($run_s)" near "$gpu_s" "$run_s" 0.001
check "GPU memory seconds ($mem_bs) = the lease's bytes ($plan) x GPU seconds" \
	awk -v m="$mem_bs" -v p="$plan" -v s="$gpu_s" 'BEGIN { d = m - p * s; if (d < 0) d = -d; exit !(d <= 0.001 * p * s) }'
expect_eq "tokens: 40 steps x 2 sequences x 32 tokens" "$(usage_of "$g" tokens)" 2560
expect_eq "no CPU-slot time" "$(usage_of "$g" cpu_s)" 0.0
# show prints GPU hours to 3 decimals: within half a unit of the last one
# (plus the JSON's own rounding of the seconds) of GPU seconds / 3600, however
# long a loaded host took to run the job
shown=$(ctl show "$g" | sed -n 's/^usage: *\([0-9.]*\) GPU-h.*/\1/p')
check "show prints the usage ($shown GPU-h for $gpu_s s)" \
	awk -v h="$shown" -v s="$gpu_s" 'BEGIN { d = h - s / 3600; if (d < 0) d = -d; exit !(h != "" && d <= 0.0005 + 1e-9) }'
c=$(sub "$A" c --device cpu)
check "A's CPU job succeeds" wait_for 60 job_is "$c" SUCCEEDED
cpu_s=$(usage_of "$c" cpu_s)
check "its CPU-slot seconds ($cpu_s) > 0" awk -v a="$cpu_s" 'BEGIN { exit !(a > 0) }'
expect_eq "and no GPU seconds" "$(usage_of "$c" gpu_s)" 0.0

# --- trainctl usage: own, everyone's (admins), per job, --since, --json ---
ua=$(ctlA usage --jobs)
expect_contains "A's usage lists A" "$ua" "$A"
expect_contains "per job: the GPU job" "$ua" "$g          it-qwen2-tiny (SUCCEEDED)"
expect_contains "per job: its tokens" "$ua" " 2560 "
ctlA usage --all >/dev/null 2>"$WORK/err"
expect_eq "A may not see everyone's usage: exit 4" "$?" 4
expect_contains "and is told who may" "$(cat "$WORK/err")" "only root and the admin group"
ctlA usage --user root >/dev/null 2>&1
expect_eq "nor root's: exit 4" "$?" 4
ctlA usage --since yesterday-ish >/dev/null 2>"$WORK/err"
expect_eq "a bad --since: exit 2" "$?" 2
expect_contains "the error names the flag" "$(cat "$WORK/err")" "usage: --since: 'yesterday-ish' is not a date"
ctlA usage --user nosuchuser$$ >/dev/null 2>&1
expect_eq "an unknown --user: exit 2" "$?" 2
tomorrow=$(date -d tomorrow +%Y-%m-%d)
expect_contains "--since tomorrow: nothing" "$(ctlA usage --since "$tomorrow")" "(none)"
expect_contains "--since 1d: A's jobs" "$(ctlA usage --since 1d)" "$A"
js=$(ctl --json usage --all --jobs --since 2000-01-01)
expect_contains "--json: the users" "$js" "\"uid\": $(id -u "$A")"
expect_contains "--json: tokens" "$js" "\"tokens\": 5120"
expect_contains "--json: the jobs" "$js" "\"id\": $g"
if command -v python3 >/dev/null; then
	printf '%s' "$js" | python3 -c 'import json,sys; json.load(sys.stdin)' 2>/dev/null
	expect_eq "--json is JSON" "$?" 0
fi

# --- fair share counts usage: B (nothing used) before A, though A's is older ---
# CPU jobs, queued while there is no CPU slot, then one slot for both: one
# pass admits in fair share's order. (Not GPU jobs: the first job waiting
# for GPUs has them held for it, whatever fair share says of later ones.)
printf 'cpu_slots = 0\n' >"$CONF"
reload_daemon
a2=$(sub "$A" a2 --device cpu)
sleep 0.1
b1=$(sub "$B" b1 --device cpu)
: >"$LOG"
printf 'cpu_slots = 1\n' >"$CONF"
reload_daemon
both_done() { job_is "$a2" SUCCEEDED && job_is "$b1" SUCCEEDED; }
check "both succeed" wait_for 90 both_done
expect_eq "B's job (no usage) started first" "$(started_order)" "$b1 $a2"

# --- why a GPU job waits: the GPU filled by a reservation of a sleeping process ---
printf 'cpu_slots = 0\n' >"$CONF"
reload_daemon
sleep 300 &
HOLDER=$!
lease=$(ctl ledger reserve --gpu 0 --bytes 56M --pid "$HOLDER" --note "it-usage")
check "the GPU is filled by a reservation" test -n "$lease"
w1=$(sub "$A" w1 --device any)
w2=$(sub "$B" w2 --device any)
sleep 1.5
expect_contains "the first waits with the GPU held for it" "$(ctl show "$w1")" "waiting:     GPU 0 held for it until they drain"
expect_contains "the second: no room outside the held GPU" "$(ctl show "$w2")" "no GPU has room for 1 x"
expect_contains "naming the job it is held for" "$(ctl show "$w2")" "held for job $w1"
ctl ledger release "$lease" >/dev/null
kill "$HOLDER"
w_done() { job_is "$w1" SUCCEEDED && job_is "$w2" SUCCEEDED; }
check "both run once the reservation is gone" wait_for 90 w_done

# --- quota_gpu_hours: set to half what A used; A's next job waits ---
a_gpu_s=$(ctl --json usage --user "$A" | sed -n 's/^ *"gpu_s": *\([0-9.e+-]*\),\{0,1\}$/\1/p' | head -n 1)
check "A used GPU time ($a_gpu_s s)" awk -v a="$a_gpu_s" 'BEGIN { exit !(a > 0) }'
quota=$(awk -v a="$a_gpu_s" 'BEGIN { printf "%.9f", a / 2 / 3600 }')
printf 'cpu_slots = 0\nquota_gpu_hours = %s\n' "$quota" >"$CONF"
reload_daemon
a3=$(sub "$A" a3 --device any)
sleep 2.5
expect_eq "A's job over the quota is not admitted" "$(job_state "$a3")" QUEUED
expect_contains "it says why" "$(ctl show "$a3")" "quota_gpu_hours: uid $(id -u "$A") used"
expect_contains "usage shows the quota" "$(ctlA usage)" "; quota $(awk -v q="$quota" 'BEGIN { printf "%.3f", q }')"
printf 'cpu_slots = 0\nquota_gpu_hours = 100\n' >"$CONF"
reload_daemon
check "with the quota raised it runs" wait_for 60 job_is "$a3" SUCCEEDED
stop_daemon
finish
