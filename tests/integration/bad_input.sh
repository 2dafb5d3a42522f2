#!/bin/bash
# Bad requests get an error response that names the problem, and the daemon
# serves on: garbage bytes, a truncated message, an empty one, one over the
# size limit, one without the protocol field, specs with invalid or missing
# fields or relative paths, a model dir that does not exist, a job file that
# does not parse. One far over the limit is dropped by nng without a reply.
# A token file truncated under its running job fails that job alone.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
: "${RPC_RAW:?}"

start_daemon --user

raw_case() {
	local what=$1 needle=$2
	shift 2
	local out
	out=$("$RPC_RAW" "$SOCK" "$@")
	expect_eq "$what: a response" "$?" 0
	expect_contains "$what: the message" "$out" "$needle"
	check "$what: the daemon serves on" ctl info >/dev/null
}

raw_case "garbage bytes" "not a valid traind.Request" garbage
raw_case "a truncated submit" "not a valid traind.Request" truncated
raw_case "an empty message" "empty message" empty
raw_case "an oversized message" "2000000 bytes, more than the 1052672" oversized 2000000
raw_case "no protocol field" "request.protocol: missing" no-protocol
raw_case "an invalid spec" "hyper.lr" bad-spec
raw_case "a spec without data" "data.train_file" no-data
raw_case "a relative path" "model_dir: 'models/m' is a relative path" relative-path
raw_case "a model dir that does not exist" "model_dir: /nonexistent/model: no such directory" \
	missing-model /nonexistent/model "$TD_FIXTURES/demo/fortunes.tokens" "$WORK/o"
raw_case "a data file that does not exist" "data.train_file: /nonexistent/data.tokens: no such file" \
	missing-model "$TD_FIXTURES/qwen2" /nonexistent/data.tokens "$WORK/o"

# Far over nng's receive limit: the connection is dropped, nothing else.
RPC_RAW_TIMEOUT_MS=2000 "$RPC_RAW" "$SOCK" oversized 40000000 >/dev/null 2>&1
expect_eq "a 40 MB message gets no reply" "$?" 3
check "and the daemon serves on" ctl info >/dev/null

# Through trainctl: a job file that does not parse, a model dir that is not there.
printf 'model_dir: "x"\nhyper { lr: oops }\n' >"$WORK/bad.txtpb"
ctl submit "$WORK/bad.txtpb" >/dev/null 2>"$WORK/err"
expect_eq "a job file that does not parse: exit 2" "$?" 2
expect_contains "its error names the file and line" "$(cat "$WORK/err")" "bad.txtpb:2:"
ctl submit tests/integration/job.txtpb --model /nonexistent/model --output "$WORK/o" >/dev/null 2>"$WORK/err"
expect_eq "a model dir that is not there: exit 5" "$?" 5
expect_contains "its error" "$(cat "$WORK/err")" "model_dir: /nonexistent/model: no such directory"
expect_contains "nothing was queued" "$(ctl ls)" "no jobs"
check "the daemon is still running" kill -0 "$DPID"

# A token file truncated under a running job (it is read through a mapping:
# unguarded, the next read would kill traind with SIGBUS): that job fails
# with an error naming the file, and the daemon serves on and runs the next.
cp tests/fixtures/demo/fortunes.tokens "$WORK/shrink.tokens"
sid=$(ctl submit tests/integration/job.txtpb --data "$WORK/shrink.tokens" --output "$WORK/shrink" \
	--steps 1000000 --name shrink)
stepped() { [ "$(json_field "$(ctl --json show "$sid")" step)" -gt 2 ] 2>/dev/null; }
if check "the job is training" wait_for 30 stepped; then
	: >"$WORK/shrink.tokens"
	check "it fails once its file shrank" wait_for 30 job_is "$sid" FAILED
	expect_contains "its error names the file" "$(ctl show "$sid")" "$WORK/shrink.tokens"
	expect_contains "and what happened" "$(ctl show "$sid")" "shrank while in use"
	check "the daemon is still running" kill -0 "$DPID"
	nid=$(ctl submit tests/integration/job.txtpb --output "$WORK/after")
	check "the next job runs to the end" wait_for 60 job_is "$nid" SUCCEEDED
fi
stop_daemon
finish
