#!/bin/sh
# Runs the request-decoding fuzzer for a bounded time from the seed requests.
# usage: run_fuzz.sh FUZZER|"" PROTOC PROTO SEEDS_DIR SECONDS
# Exit 77 (skip) with the reason when the fuzzer could not be built here.
fuzzer=$1 protoc=$2 proto=$3 seeds=$4 secs=${5:-20}
if [ -z "$fuzzer" ] || [ ! -x "$fuzzer" ]; then
	echo "SKIP: no libFuzzer build: clang with -fsanitize=fuzzer was not found (apt install clang)"
	exit 77
fi
corpus=$(mktemp -d "${TMPDIR:-/tmp}/td-fuzz.XXXXXX") || exit 1
trap 'rm -rf "$corpus"' EXIT
if [ -x "$protoc" ]; then
	for s in "$seeds"/*.txtpb; do
		"$protoc" --proto_path="$(dirname "$proto")" --encode=traind.Request "$(basename "$proto")" \
			<"$s" >"$corpus/$(basename "$s" .txtpb)" || exit 1
	done
fi
# Leak detection stays on; -timeout catches a hang on one input.
exec "$fuzzer" -error_exitcode=1 -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	-max_len=4096 "$corpus"
