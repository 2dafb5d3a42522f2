#!/bin/sh
# Runs one libFuzzer target for a bounded time from its seeds.
# usage: run_fuzz.sh TARGET FUZZER|"" SECONDS [libFuzzer flags...]
#   TARGET   request, safetensors, config, tokenizer, jsonl, jobspec, tokcache
#   FUZZER   the built binary; "" or missing: exit 77 (skip), saying why
# Seeds are tests/fuzz/seeds/TARGET/ (a .txtpb seed is also encoded with
# protoc as the target's message, where the target reads protobuf), the
# dictionary tests/fuzz/TARGET.dict when there is one. The corpus grows in a
# temporary dir, removed at the end; a crashing input is written to
# $FUZZ_ARTIFACTS (default: the current dir) as fuzz-TARGET-crash-<sha1>.
# The last line is "fuzz-TARGET: N executions in S s (rc R)".
target=$1 fuzzer=$2 secs=${3:-20}
shift 3 2>/dev/null || shift $#
here=$(cd "$(dirname "$0")" && pwd)
if [ -z "$fuzzer" ] || [ ! -x "$fuzzer" ]; then
	echo "SKIP: no libFuzzer build: clang with -fsanitize=fuzzer was not found (apt install clang)"
	exit 77
fi
case $target in
request) message=traind.Request max_len=4096 ;;
jobspec) message=traind.JobSpec max_len=4096 ;;
tokenizer) message= max_len=16384 ;;
safetensors) message= max_len=8192 ;;
*) message= max_len=4096 ;;
esac
seeds=$here/seeds/$target
corpus=$(mktemp -d "${TMPDIR:-/tmp}/td-fuzz-$target.XXXXXX") || exit 1
log=$corpus.log
trap 'rm -rf "$corpus" "$log"' EXIT
cp "$seeds"/* "$corpus"/ 2>/dev/null
protoc=$(command -v protoc)
if [ -n "$message" ] && [ -n "$protoc" ]; then
	for s in "$seeds"/*.txtpb; do
		[ -f "$s" ] || continue
		# A seed that is not the message (a text-format error on purpose) stays text only.
		"$protoc" --proto_path="$here/../../proto" --encode="$message" traind.proto \
			<"$s" >"$corpus/$(basename "$s" .txtpb).pb" 2>/dev/null || rm -f "$corpus/$(basename "$s" .txtpb).pb"
	done
fi
dict=
[ -f "$here/$target.dict" ] && dict=-dict=$here/$target.dict
# Leak detection stays on; -timeout catches a hang on one input.
start=$(date +%s)
"$fuzzer" -error_exitcode=1 -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	-max_len="$max_len" -artifact_prefix="${FUZZ_ARTIFACTS:-./}fuzz-$target-" ${dict:+"$dict"} "$@" \
	"$corpus" >"$log" 2>&1
rc=$?
end=$(date +%s)
# The fuzzer's log: its end when all went well, more of it (the report) when not.
if [ "$rc" -eq 0 ]; then tail -n 15 "$log"; else tail -n 150 "$log"; fi
execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
echo "fuzz-$target: ${execs:-0} executions in $((end - start)) s (rc $rc)"
exit $rc
