#!/bin/sh
# `make demo`: starts a user-mode traind in the background with a temporary
# state dir, submits the demo job (tests/fixtures/demo/job.txtpb) with
# trainctl, watches it to its end, shows the ledger and the output, and stops
# the daemon — whatever happens on the way. Exits with the job's outcome
# (trainctl watch's exit code: 0 succeeded). Run from the repository root.
# usage: client/demo.sh [BUILD_DIR]
set -u
build=${1:-build}
traind=$build/daemon/traind
trainctl=$build/client/trainctl
tmp=$(mktemp -d "${TMPDIR:-/tmp}/traind-demo.XXXXXX") || exit 1
sock=$tmp/traind.sock
pid=

stop() {
	if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid"
		wait "$pid"
	fi
	pid=
	rm -rf "$tmp"
}
trap stop EXIT
trap 'exit 130' INT TERM

ctl() {
	echo "\$ trainctl $*" >&2
	"$trainctl" --socket "$sock" "$@"
}

rm -rf demo-out/qwen2-tiny
echo "starting traind (user mode, state in $tmp)"
"$traind" --user --socket "$sock" --state-dir "$tmp/state" --cache-dir "$tmp/cache" \
	2>"$tmp/traind.log" &
pid=$!
tries=0
until "$trainctl" --socket "$sock" info >/dev/null 2>&1; do
	tries=$((tries + 1))
	if [ "$tries" -gt 200 ] || ! kill -0 "$pid" 2>/dev/null; then
		echo "demo: traind did not start:" >&2
		cat "$tmp/traind.log" >&2
		exit 1
	fi
	sleep 0.1
done

ctl info
echo
id=$(ctl submit tests/fixtures/demo/job.txtpb) || exit 1
echo "job $id queued"
ctl watch "$id"
rc=$?
echo
ctl ledger
echo
ctl show "$id" | sed -n '1,/^spec:/p' | sed '$d'
echo
if [ "$rc" -eq 0 ]; then
	echo "output (loads in transformers: AutoModelForCausalLM.from_pretrained('demo-out/qwen2-tiny')):"
	ls -l demo-out/qwen2-tiny demo-out/qwen2-tiny/checkpoints
else
	echo "demo: the job did not succeed; traind's log:" >&2
	tail -n 20 "$tmp/traind.log" >&2
fi
exit "$rc"
