#!/bin/bash
# Metrics for the host's monitoring (issue 14, item 5): a real daemon with a
# simulated GPU, metrics_port and metrics_textfile set, a job running with a
# name that needs escaping. The exposition, from http://127.0.0.1:PORT/metrics
# and from the textfile (written atomically each tick: no temp file left,
# mode 0644, rewritten), passes `promtool check metrics` (Debian's
# prometheus package; the test reports itself skipped, 77, after its other
# checks, where promtool is absent) and says: the GPU's reserved bytes (the
# job's lease) and used bytes, the running job's step, loss and tokens/s, the
# queue's length, requests and errors per call, uptime. Only GET /metrics is
# served (404, 405), on the loopback only; a textfile that cannot be written
# is logged once and the daemon serves on.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
JOB=$TD_SRC/tests/integration/job.txtpb

PROMTOOL=$(command -v promtool)
[ -n "$PROMTOOL" ] || note "promtool not found (Debian package prometheus): the exposition is not checked by it"

# A free port on the loopback.
PORT=
for p in $(seq $((20000 + $$ % 20000)) $((20100 + $$ % 20000))); do
	if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
		PORT=$p
		break
	fi
done
check "a free port" test -n "$PORT"
# http METHOD PATH: the response (head and body), HTTP/1.0 over bash's /dev/tcp.
http() {
	exec 3<>"/dev/tcp/127.0.0.1/$PORT" || return 1
	printf '%s %s HTTP/1.0\r\nHost: localhost\r\n\r\n' "$1" "$2" >&3
	timeout 10 cat <&3
	exec 3<&-
}
body() { sed '1,/^\r$/d'; }

mkdir -p "$WORK/textfile"
TEXTFILE=$WORK/textfile/traind.prom
CONF=$WORK/traind.conf
printf 'metrics_textfile = %s\n' "$TEXTFILE" >"$CONF"
start_daemon --user --config "$CONF" --cpu-slots 0 --fake-gpus GPU-metrics-0:64M \
	--metrics-port "$PORT" --pinned-host-max-mib 1024
expect_contains "the daemon says where" "$(cat "$LOG")" "Prometheus metrics at http://127.0.0.1:$PORT/metrics"

id=$(ctl submit "$JOB" --device any --steps 100000 --checkpoint-every 0 --output "$WORK/o" \
	--name 'odd "name" \ here')
check "a job is submitted" test -n "$id"
q=$(ctl submit "$JOB" --device cpu --output "$WORK/q")
stepped() { [ "$(json_field "$(ctl --json show "$id")" step)" -gt 0 ] 2>/dev/null; }
check "it runs on the simulated GPU" wait_for 60 stepped
ctl show 999999 >/dev/null 2>&1 # an error, counted
# a tick since the error (the textfile is rewritten each tick): waited for,
# not slept through — a loaded host's ticks come late
check "a tick counts the error" wait_for 20 grep -qF 'traind_request_errors_total{call="show"} 1' "$TEXTFILE"

resp=$(http GET /metrics)
expect_contains "GET /metrics: 200" "$(printf '%s' "$resp" | head -n 1)" "200 OK"
expect_contains "the text format's content type" "$resp" "Content-Type: text/plain; version=0.0.4"
m=$(printf '%s\n' "$resp" | body)
printf '%s\n' "$m" >"$WORK/http.prom"
lease=$(ctl --json ledger | sed -n 's/^ *"bytes": *\([0-9]*\),\{0,1\}$/\1/p' | head -n 1)
check "the job holds a lease ($lease bytes)" test -n "$lease"
expect_contains "reserved bytes: the lease" "$m" \
	"traind_gpu_reserved_bytes{gpu=\"0\",uuid=\"GPU-metrics-0\",name=\"simulated GPU\"} $lease"
expect_contains "used bytes" "$m" "traind_gpu_used_bytes{gpu=\"0\",uuid=\"GPU-metrics-0\""
expect_contains "total bytes" "$m" "traind_gpu_total_bytes{gpu=\"0\",uuid=\"GPU-metrics-0\",name=\"simulated GPU\"} 67108864"
esc='job="'$id'",user="'$(id -un)'",name="odd \"name\" \\ here"'
expect_contains "the job's step, its name escaped" "$m" "traind_job_step{$esc}"
expect_contains "the job's loss" "$m" "traind_job_loss{$esc}"
expect_contains "the job's tokens/s" "$m" "traind_job_tokens_per_second{$esc}"
expect_contains "the job's GPUs" "$m" "traind_job_gpus{$esc} 1"
# it does not offload: no pinned host memory; the budget is the setting's
expect_contains "the job's pinned host memory" "$m" "traind_job_pinned_host_bytes{$esc} 0"
expect_contains "the running jobs' pinned host memory" "$m" "traind_pinned_host_bytes 0"
expect_contains "the pinned host memory budget" "$m" "traind_pinned_host_max_bytes 1073741824"
expect_contains "the queue's length" "$m" 'traind_jobs{state="QUEUED"} 1'
expect_contains "running jobs" "$m" 'traind_jobs{state="RUNNING"} 1'
expect_contains "requests per call" "$m" 'traind_requests_total{call="submit"} 2'
expect_contains "errors per call" "$m" 'traind_request_errors_total{call="show"} 1'
expect_contains "uptime" "$m" "traind_uptime_seconds "
expect_contains "usage per user" "$m" "traind_user_gpu_seconds_total{user=\"$(id -un)\"}"

check "the textfile is there" test -f "$TEXTFILE"
expect_eq "its mode is 0644" "$(stat -c %a "$TEXTFILE")" 644
# A tick may be writing its temp file right now (it is renamed over the
# textfile when complete): look again until a listing falls between two
# writes. A temp file that is never renamed stays in every listing.
left=$(ls "$WORK/textfile")
for _ in $(seq 1 50); do
	[ "$left" = traind.prom ] && break
	sleep 0.05
	left=$(ls "$WORK/textfile")
done
expect_eq "no temp file is left" "$left" "traind.prom"
expect_contains "it holds the job" "$(cat "$TEXTFILE")" "traind_job_step{$esc}"
up1=$(sed -n 's/^traind_uptime_seconds //p' "$TEXTFILE")
newer() {
	up2=$(sed -n 's/^traind_uptime_seconds //p' "$TEXTFILE")
	awk -v a="$up1" -v b="$up2" 'BEGIN { exit !(b > a) }'
}
check "it is rewritten by the next ticks (uptime $up1, then more)" wait_for 20 newer

if [ -n "$PROMTOOL" ]; then
	"$PROMTOOL" check metrics <"$WORK/http.prom" >"$WORK/pt" 2>&1
	expect_eq "promtool check metrics: the HTTP exposition" "$?" 0
	[ -s "$WORK/pt" ] && cat "$WORK/pt"
	"$PROMTOOL" check metrics <"$TEXTFILE" >"$WORK/pt" 2>&1
	expect_eq "promtool check metrics: the textfile" "$?" 0
	[ -s "$WORK/pt" ] && cat "$WORK/pt"
	# promtool is no rubber stamp: a broken exposition fails it.
	printf 'traind_x{a="b} 1\n' | "$PROMTOOL" check metrics >/dev/null 2>&1
	check "promtool refuses a broken line" test $? -ne 0
fi

# --- only GET /metrics, only on the loopback ---
expect_contains "another path: 404" "$(http GET /other | head -n 1)" "404"
expect_contains "another method: 405" "$(http POST /metrics | head -n 1)" "405"
expect_contains "HEAD: 200" "$(http HEAD /metrics | head -n 1)" "200"
if command -v ss >/dev/null; then
	listen=$(ss -Hltn "sport = :$PORT" | awk '{print $4}')
	expect_eq "it listens on 127.0.0.1 only" "$listen" "127.0.0.1:$PORT"
fi

# --- a textfile that cannot be written: logged once, the daemon serves on ---
printf 'metrics_textfile = %s\n' "$WORK/nosuchdir/traind.prom" >"$CONF"
reload_daemon
check "the error is logged" wait_for 20 grep -qF "TD-METRICS: metrics_textfile: $WORK/nosuchdir" "$LOG"
sleep 2.5 # more ticks, each failing to write
expect_eq "the error is logged once" "$(grep -c "TD-METRICS: metrics_textfile: $WORK/nosuchdir" "$LOG")" 1
check "the daemon answers" ctl info
ctl cancel "$id" >/dev/null
ctl cancel "$q" >/dev/null
check "the job stops" wait_for 30 job_is "$id" CANCELLED
stop_daemon
finish
rc=$?
if [ "$rc" -eq 0 ] && [ -z "$PROMTOOL" ]; then
	echo "SKIP: promtool is not installed (apt-get install prometheus); every other check passed"
	exit 77
fi
exit "$rc"
