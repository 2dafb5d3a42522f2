#!/bin/bash
# One job across daemons (issue 12, item 4), on the CPU: two daemons on this
# host, each with one simulated GPU (fake_gpus), talking over loopback
# (peer_listen, one shared peer_secret_file); the job's ranks sum through the
# gang's hub (the CPU backend's transport across processes).
#
#  1. Refusals: a daemon without peer_listen refuses resources.hosts at
#     submit, naming the field; a bad peer address is the spec's error;
#     traind --run refuses such a job; a daemon refuses to start with a
#     secret file others may read.
#  2. A job submitted to A with hosts [B] runs ranks 0 on A and 1 on B: B's
#     ledger holds a lease labelled with the job while it runs and none after;
#     it succeeds, and its model is the bytes of the same job on two
#     simulated GPUs of one daemon (an in-process gang of 2: the same sums).
#  3. kill -9 of B mid-job (after a checkpoint): the job is requeued on A with
#     the lost daemon named, A's ledger keeps no lease of it, it waits while B
#     is down (tried again every few seconds), and once B is back it resumes
#     from its checkpoint and ends with the uninterrupted run's model bytes.
#  4. kill -9 of A mid-job: B's ranks fail at once and B's lease goes; A,
#     restarted, requeues the job, which resumes and ends with the same bytes.
#     SIGSTOP of A (silent, connections open): B gives the run up once A's
#     heartbeats stop for peer_lease_ttl_s and frees its lease; A, continued,
#     requeues the job, which resumes and ends with the same bytes, given up
#     no more (A heartbeats at a quarter of B's ttl, not of its own).
#     A rank's error on B fails the job on every rank, naming rank 1, with no
#     lease left; both daemons serve on.
#  5. B's GPU taken (a ledger lease on B): the job waits, saying why, and runs
#     once it is released.
#  6. A daemon C with another secret: B refuses C's request (its MAC), and
#     C's job fails saying so.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
JOB=$TD_SRC/tests/integration/job.txtpb
STEPS=600
EVERY=20

# hjob FILE HOSTS...: the test job on simulated GPUs, grad_accum 2 (one
# micro-batch a rank), with resources.hosts.
hjob() {
	local f=$1
	shift
	{
		sed -e "s/^  micro_batch: 2\$/  micro_batch: 2\n  grad_accum: 2/" \
			-e 's/^  keep_last: 2$/  keep_last: 1000/' -e '/^resources {/,$d' "$JOB"
		echo "resources {"
		echo "  device: DEVICE_ANY"
		echo "  allow_cpu: false"
		for h in "$@"; do echo "  hosts: \"$h\""; done
		echo "}"
	} >"$f"
}

# free_port: a loopback TCP port nobody listens on now.
free_port() {
	local p
	for _ in $(seq 1 200); do
		p=$((20000 + RANDOM % 40000))
		if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
			echo "$p"
			return 0
		fi
	done
	return 1
}

# --- 1. refusals ---
start_daemon --user --cpu-slots 0 --fake-gpus GPU-host-a:64M
hjob "$WORK/h1.txtpb" tcp://127.0.0.1:1
ctl submit "$WORK/h1.txtpb" --output "$WORK/r1" >/dev/null 2>"$WORK/err"
expect_eq "hosts on a daemon without peer_listen: exit 2" "$?" 2
expect_contains "the refusal names the field and the setting" "$(cat "$WORK/err")" \
	"resources.hosts: this daemon takes no part in jobs across daemons (it has no peer_listen setting)"
hjob "$WORK/h2.txtpb" 127.0.0.1:7001
ctl submit "$WORK/h2.txtpb" --output "$WORK/r2" >/dev/null 2>"$WORK/err"
expect_eq "a bad peer address: exit 2" "$?" 2
expect_contains "the refusal names the entry" "$(cat "$WORK/err")" \
	"resources.hosts[0]: '127.0.0.1:7001' is not a peer address tcp://HOST:PORT"
stop_daemon
"$TRAIND" --run "$WORK/h1.txtpb" >/dev/null 2>"$WORK/err"
expect_eq "traind --run of a job across daemons: exit 2" "$?" 2
expect_contains "saying why" "$(cat "$WORK/err")" "resources.hosts: --run trains in this process only"

SECRET=$WORK/peer.secret
(umask 077 && head -c 48 /dev/urandom | base64 >"$SECRET")
PA=$(free_port) && PB=$(free_port) && PC=$(free_port) || { echo "FAIL: no free port"; exit 1; }
chmod 644 "$SECRET"
"$TRAIND" --socket "$WORK/x.sock" --state-dir "$WORK/x" --cache-dir "$WORK/x-cache" --user --fake-gpus GPU-x:64M \
	--peer-listen "tcp://127.0.0.1:$PA" --peer-secret-file "$SECRET" >"$WORK/x.log" 2>&1
expect_eq "a daemon with a secret others may read does not start" "$?" 1
expect_contains "and says why" "$(cat "$WORK/x.log")" "peer_secret_file: $SECRET is readable or writable by others (mode 0644)"
chmod 600 "$SECRET"

# B: the peer daemon, by hand (lib.sh runs A).
BSOCK=$WORK/b.sock
BSTATE=$WORK/b-state
BLOG=$WORK/b.log
BPID=
CPID=
extra_cleanup() {
	for p in $BPID $CPID; do
		kill -TERM "$p" 2>/dev/null
		for _ in $(seq 1 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
		kill -KILL "$p" 2>/dev/null
	done
	if [ "$FAILS" -ne 0 ] && [ -f "$BLOG" ]; then
		echo "---- daemon B's log ----"
		tail -n 60 "$BLOG"
	fi
}
ctlb() { "$TRAINCTL" --socket "$BSOCK" "$@"; }
start_b() {
	"$TRAIND" --socket "$BSOCK" --state-dir "$BSTATE" --cache-dir "$WORK/cache-b" --user \
		--cpu-slots 0 --fake-gpus GPU-host-b:64M --peer-listen "tcp://127.0.0.1:$PB" \
		--peer-secret-file "$SECRET" "$@" >>"$BLOG" 2>&1 &
	BPID=$!
	for _ in $(seq 1 300); do
		ctlb info >/dev/null 2>&1 && return 0
		kill -0 "$BPID" 2>/dev/null || break
		sleep 0.1
	done
	echo "FAIL: daemon B did not start"
	cat "$BLOG"
	exit 1
}
start_a() {
	start_daemon --user --cpu-slots 0 --fake-gpus GPU-host-a:64M \
		--peer-listen "tcp://127.0.0.1:$PA" --peer-secret-file "$SECRET"
}
kill9_b() {
	kill -KILL "$BPID"
	wait "$BPID" 2>/dev/null
	BPID=
}
# ckpt DIR: the job has written a checkpoint (the kills come right after
# its first: the job must still be running, however fast this host trains).
ckpt() { compgen -G "$1/checkpoints/step-[0-9][0-9][0-9][0-9][0-9][0-9][0-9][0-9]" >/dev/null; }
# b_leases: B's ledger lines of A's jobs.
b_leases() { ctlb ledger | grep -c "of tcp://127.0.0.1:$PA" ; }
no_b_lease() { [ "$(b_leases)" = 0 ]; }
# a_lease ID: A's ledger names the job.
a_lease() { ctl ledger | grep -q "job $1\b"; }

start_b
start_a
hjob "$WORK/h.txtpb" "tcp://127.0.0.1:$PB"

# --- 2. a run across A and B, against one daemon's gang of 2 ---
j=$(ctl submit "$WORK/h.txtpb" --output "$WORK/out-run" --steps "$STEPS" --checkpoint-every "$EVERY")
check "the job runs" wait_for 30 job_is "$j" RUNNING
check "B's ledger holds its lease while it runs" wait_for 10 test "$(b_leases)" = 1
expect_contains "labelled with the job and its coordinator" "$(ctlb ledger)" \
	"job $j of tcp://127.0.0.1:$PA, rank 1"
expect_contains "A's events say where the ranks run" "$(ctl logs "$j")" \
	"across daemons: 2 ranks; this daemon's 1 (ranks 0 to 0), tcp://127.0.0.1:$PB (ranks 1 to 1: GPU-host-b)"
check "it succeeds" wait_for 120 job_is "$j" SUCCEEDED
check "B's lease is gone" wait_for 10 no_b_lease
check "A's lease is gone" sh -c "! $TRAINCTL --socket $SOCK ledger | grep -q 'job $j\b'"
# B logs its ranks' end when they stop, which may come after A has seen the
# job succeed: waited for, not read at once
check "B logged its ranks' end" wait_for 10 grep -qF \
	"job $j of tcp://127.0.0.1:$PA (attempt 1): ranks 1 to 1 done at step $STEPS" "$BLOG"

# --- 3. kill -9 of B mid-job ---
j3=$(ctl submit "$WORK/h.txtpb" --output "$WORK/out-kb" --steps "$STEPS" --checkpoint-every "$EVERY")
check "running, past its first checkpoint" wait_for 60 ckpt "$WORK/out-kb"
kill9_b
check "the job is requeued" wait_for 20 job_is "$j3" QUEUED
show=$(ctl show "$j3")
expect_contains "naming the lost daemon" "$show" "a daemon of the job was lost at step"
expect_contains "and how" "$show" "lost tcp://127.0.0.1:$PB (ranks 1 to 1)"
check "A keeps no lease of it" sh -c "! $TRAINCTL --socket $SOCK ledger | grep -q 'job $j3\b'"
# While B is down each try (every few seconds) finds it unreachable.
check "it waits while B is down, saying B cannot be reached" wait_for 30 sh -c \
	"$TRAINCTL --socket $SOCK show $j3 | grep -q 'waits for the daemons of resources.hosts: resources.hosts\[0\] (tcp://127.0.0.1:$PB): cannot reach'"
start_b
check "once B is back it runs and succeeds" wait_for 120 job_is "$j3" SUCCEEDED
logs=$(ctl logs "$j3")
expect_contains "resumed from its checkpoint" "$logs" "resumed from $WORK/out-kb/checkpoints/step-"
check "with the uninterrupted run's model" cmp -s "$WORK/out-run/model.safetensors" "$WORK/out-kb/model.safetensors"
check "no lease left on B" wait_for 10 no_b_lease

# --- 4. kill -9 of A mid-job ---
j4=$(ctl submit "$WORK/h.txtpb" --output "$WORK/out-ka" --steps "$STEPS" --checkpoint-every "$EVERY")
check "running, past its first checkpoint" wait_for 60 ckpt "$WORK/out-ka"
check "B holds its lease" test "$(b_leases)" = 1
kill9_daemon
check "B's ranks end and its lease goes" wait_for 10 no_b_lease
check "B says its coordinator was lost" wait_for 10 grep -qF \
	"job $j4 of tcp://127.0.0.1:$PA (attempt 1): ranks 1 to 1 ended: lost the gang's hub" "$BLOG"
start_a
check "A, back, runs it again to the end" wait_for 120 job_is "$j4" SUCCEEDED
expect_contains "resumed from its checkpoint" "$(ctl logs "$j4")" "resumed from $WORK/out-ka/checkpoints/step-"
check "with the uninterrupted run's model" cmp -s "$WORK/out-run/model.safetensors" "$WORK/out-ka/model.safetensors"
check "no lease left on B" wait_for 10 no_b_lease

# --- 4b. A stops answering without closing anything (SIGSTOP): B gives up
# the run once A's heartbeats stop for peer_lease_ttl_s, its lease goes;
# A, continued, hears it and requeues the job, which resumes and ends with
# the same bytes ---
kill -TERM "$BPID"
wait "$BPID"
BPID=
start_b --peer-lease-ttl-s 3
j7=$(ctl submit "$WORK/h.txtpb" --output "$WORK/out-stop" --steps "$STEPS" --checkpoint-every "$EVERY")
check "running, past its first checkpoint" wait_for 60 ckpt "$WORK/out-stop"
kill -STOP "$DPID"
check "A stopped: B gives the run up and its lease goes" wait_for 20 no_b_lease
# (the ledger's ttl may free the lease before B's ranks have ended)
check "B says why" wait_for 20 grep -q \
	"job $j7 of tcp://127.0.0.1:$PA: no heartbeat from its coordinator for 3 s" "$BLOG"
check "its ranks end on it" wait_for 20 grep -q \
	"job $j7 of tcp://127.0.0.1:$PA (attempt [0-9]*): ranks 1 to 1 ended: .*stopped renewing its leases for 3 s (peer_lease_ttl_s)" "$BLOG"
kill -CONT "$DPID"
check "A, continued, runs the job again to the end" wait_for 120 job_is "$j7" SUCCEEDED
# The requeue names B's reason, or (when the hub, continued, wrote to B's
# closed connection before reading the reason B left there) B itself.
check "after a requeue naming B's reason or B" sh -c "$TRAINCTL --socket $SOCK logs $j7 | grep 'INTERRUPTED' |
	grep -q -e 'stopped renewing its leases' -e 'tcp://127.0.0.1:$PB (ranks 1 to 1)'"
check "with the uninterrupted run's model" cmp -s "$WORK/out-run/model.safetensors" "$WORK/out-stop/model.safetensors"
check "no lease left on B" wait_for 10 no_b_lease
# A's own ttl is the default 60 s; it heartbeats at a quarter of B's (which
# B's reply to the run said), so the run after the stop is never given up
expect_eq "B gave the job up once, while A was stopped" \
	"$(grep -c "TD-PEER-EXPIRE: job $j7 of tcp://127.0.0.1:$PA:" "$BLOG")" 1

# --- 4c. a rank's error on B (TD_DDP_FAIL_AT, the trainer's test hook, on
# B only): the job fails on every rank, naming rank 1 and B's reason, not
# requeued; no lease is left on either daemon, and both serve on ---
kill -TERM "$BPID"
wait "$BPID"
BPID=
TD_DDP_FAIL_AT=1:5 start_b
j8=$(ctl submit "$WORK/h.txtpb" --output "$WORK/out-fail" --steps 40 --checkpoint-every 0)
check "a rank's error on B fails the job" wait_for 60 job_is "$j8" FAILED
expect_contains "naming rank 1 and its error" "$(ctl show "$j8")" \
	"rank 1 of 2: TD_DDP_FAIL_AT: rank 1 failed at step 5 (test hook)"
check "no lease left on B" wait_for 10 no_b_lease
check "nor on A" sh -c "! $TRAINCTL --socket $SOCK ledger | grep -q 'job $j8\b'"
kill -TERM "$BPID"
wait "$BPID"
BPID=
start_b

# --- 5. B's GPU taken: the job waits, then runs ---
lease=$(ctlb ledger reserve --gpu 0 --bytes 56M --pid $$ --note "outside traind")
check "B's GPU taken" test -n "$lease"
hjob "$WORK/h0.txtpb" # no hosts in the file: trainctl submit --hosts names them
j5=$(ctl submit "$WORK/h0.txtpb" --hosts "tcp://127.0.0.1:$PB" --output "$WORK/out-busy" --steps 40 \
	--checkpoint-every 0)
expect_contains "show lists the host and its ranks" "$(ctl show "$j5")" \
	"hosts:       tcp://127.0.0.1:$PB (ranks 1 to 1)"
check "the job waits" wait_for 20 sh -c "$TRAINCTL --socket $SOCK show $j5 | grep -q 'waits for the daemons of resources.hosts'"
expect_contains "saying B has no room" "$(ctl show "$j5")" "has no 1 GPU(s) with"
ctlb ledger release "$lease" >/dev/null
check "once released it runs to the end" wait_for 60 job_is "$j5" SUCCEEDED

# --- 5b. two hosts, the second unreachable: each try starts B's ranks,
# then fails at the second host, and the end of a start that failed midway
# stops B's run (dmn_peer_job_end, a thread a host); nothing is left on B ---
sed 's/^  grad_accum: 2$/  grad_accum: 3/' "$WORK/h0.txtpb" >"$WORK/h3.txtpb" # a micro-batch a rank
j5b=$(ctl submit "$WORK/h3.txtpb" --hosts "tcp://127.0.0.1:$PB,tcp://127.0.0.1:1" \
	--output "$WORK/out-2h" --steps 40 --checkpoint-every 0)
check "two hosts, one unreachable: the job waits, naming it" wait_for 30 sh -c \
	"$TRAINCTL --socket $SOCK show $j5b | grep -q 'resources.hosts\[1\] (tcp://127.0.0.1:1): cannot reach'"
check "B's ranks of a try ended" wait_for 30 grep -qF "job $j5b of tcp://127.0.0.1:$PA (attempt" "$BLOG"
ctl cancel "$j5b" >/dev/null
check "cancelled" wait_for 30 job_is "$j5b" CANCELLED
check "no lease left on B" wait_for 10 no_b_lease
check "A serves on" ctl info >/dev/null

# --- 6. a daemon of another secret ---
(umask 077 && head -c 48 /dev/urandom | base64 >"$WORK/other.secret")
"$TRAIND" --socket "$WORK/c.sock" --state-dir "$WORK/c-state" --user --cpu-slots 0 \
	--fake-gpus GPU-host-c:64M --peer-listen "tcp://127.0.0.1:$PC" \
	--peer-secret-file "$WORK/other.secret" >"$WORK/c.log" 2>&1 &
CPID=$!
check "daemon C starts" wait_for 30 sh -c "$TRAINCTL --socket $WORK/c.sock info >/dev/null 2>&1"
j6=$("$TRAINCTL" --socket "$WORK/c.sock" submit "$WORK/h.txtpb" --output "$WORK/out-c" --steps 40)
check "C's job fails" wait_for 30 sh -c "$TRAINCTL --socket $WORK/c.sock show $j6 | grep -q 'state: *FAILED'"
expect_contains "B refused it: the MAC" "$("$TRAINCTL" --socket "$WORK/c.sock" show "$j6")" \
	"refused the request: its MAC does not match this daemon's peer secret"
expect_contains "B logged the refusal" "$(cat "$BLOG")" "TD-PEER-AUTH"
check "B holds no lease of it" no_b_lease
kill -TERM "$CPID"
wait "$CPID"
expect_eq "C exits 0 after SIGTERM" "$?" 0
CPID=
kill -TERM "$BPID"
wait "$BPID"
expect_eq "B exits 0 after SIGTERM (under ASan: without leaks)" "$?" 0
BPID=

# --- the reference: the same job on one daemon's gang of two simulated GPUs ---
stop_daemon
start_daemon --user --cpu-slots 0 --fake-gpus GPU-ref-0:64M,GPU-ref-1:64M
sed -e '/^  hosts:/d' "$WORK/h.txtpb" >"$WORK/g.txtpb"
jr=$(ctl submit "$WORK/g.txtpb" --gpus 2 --output "$WORK/out-ref" --steps "$STEPS" --checkpoint-every "$EVERY")
check "the reference gang succeeds" wait_for 120 job_is "$jr" SUCCEEDED
check "two daemons' model is one daemon's gang of 2's, byte for byte" \
	cmp -s "$WORK/out-ref/model.safetensors" "$WORK/out-run/model.safetensors"
stop_daemon
finish
