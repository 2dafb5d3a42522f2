#!/bin/bash
# One job across daemons (issue 12, item 4), on the CPU: resources.hosts
# names the other daemons of a job. A daemon without peer_listen refuses such
# a job at submit, naming the field; a bad peer address is refused by the
# spec's validation.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
JOB=$TD_SRC/tests/integration/job.txtpb

# hjob FILE HOSTS...: the test job on a simulated GPU, grad_accum 2, with
# resources.hosts.
hjob() {
	local f=$1
	shift
	{
		sed -e "s/^  micro_batch: 2\$/  micro_batch: 2\n  grad_accum: 2/" \
			-e '/^resources {/,$d' "$JOB"
		echo "resources {"
		echo "  device: DEVICE_GPU"
		echo "  allow_cpu: false"
		for h in "$@"; do echo "  hosts: \"$h\""; done
		echo "}"
	} >"$f"
}

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
finish
