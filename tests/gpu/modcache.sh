#!/bin/sh
# Tier 2 of the module cache persists across processes (contract 3). With the
# PTX path forced (TD_CUDA_FORCE_PTX=1, the test hook) and an empty cache dir:
# run 1 compiles the kernels (>= 1 compile) and writes the cubin; run 2, a new
# process, loads it: 0 compiles. Then one byte of the cached cubin is flipped:
# run 3 must refuse the entry (TD-CACHE-REBUILD), compile once, replace it and
# finish; run 4 trusts the rebuilt entry (0 compiles). Every run: 0 compiles
# after seal. Prints the first-step times of the compiling and cached runs.
# Run 2 finds the cache through $XDG_CACHE_HOME (traind --run's default), the
# others through --cache-dir. Skips (77) where there is no GPU.
# usage: modcache.sh TRAIND FIXTURES
set -eu
traind=$1 fx=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cache=$tmp/xdg/traind
export TD_CUDA_FORCE_PTX=1

# run N [traind args...]: a 5-step job into its own output dir; its stdout in
# $tmp/N.log, stderr in $tmp/N.err; sets compiles, after_seal, first.
run() {
	n=$1
	shift
	cat >"$tmp/$n.txtpb" <<SPEC
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }
hyper { lr: 1e-3 max_steps: 5 micro_batch: 4 seed: 5 }
output { dir: "$tmp/out$n" }
SPEC
	if ! "$traind" --run "$tmp/$n.txtpb" --backend cuda "$@" >"$tmp/$n.log" 2>"$tmp/$n.err"; then
		if [ "$n" = 1 ] && grep -q -e "cannot be loaded" -e "no NVIDIA driver" -e "no CUDA device" "$tmp/$n.err"; then
			echo "SKIP: $(cat "$tmp/$n.err")"
			exit 77
		fi
		echo "FAIL: run $n failed:"; cat "$tmp/$n.err"; exit 1
	fi
	line=$(grep "kernel compiles" "$tmp/$n.log" || true)
	[ -n "$line" ] || { echo "FAIL: run $n printed no compile count"; cat "$tmp/$n.log"; exit 1; }
	# shellcheck disable=SC2046 # splitting the three numbers is the point
	set -- $(echo "$line" | sed -n 's/.*: \([0-9]*\) kernel compiles, \([0-9]*\) after seal; first step \([0-9.]*\)s.*/\1 \2 \3/p')
	[ $# = 3 ] || { echo "FAIL: run $n: cannot read '$line'"; exit 1; }
	compiles=$1 after_seal=$2 first=$3
	echo "run $n: $line"
	[ "$after_seal" = 0 ] || { echo "FAIL: run $n compiled after seal"; exit 1; }
}

# shellcheck disable=SC2010 # the names are hex keys
entries() { ls "$cache/modules" 2>/dev/null | grep -c '\.cubin$' || true; }

run 1 --cache-dir "$cache"
[ "$compiles" -ge 1 ] || { echo "FAIL: run 1 (empty cache, PTX forced) compiled nothing"; exit 1; }
[ "$(entries)" = 1 ] || { echo "FAIL: run 1 left $(entries) entries in $cache/modules, want 1"; ls -la "$cache/modules"; exit 1; }
t1=$first
XDG_CACHE_HOME=$tmp/xdg
export XDG_CACHE_HOME
run 2
unset XDG_CACHE_HOME
[ "$compiles" = 0 ] || { echo "FAIL: run 2 compiled $compiles times with the cache warm"; cat "$tmp/2.err"; exit 1; }
t2=$first
echo "first step: ${t1}s compiling, ${t2}s from the cache"

# Flip one byte in the middle of the cached cubin (past the 88-byte header).
f=$(ls "$cache"/modules/*.cubin)
size=$(wc -c <"$f")
off=$((88 + (size - 88) / 2))
b=$(od -An -tu1 -j"$off" -N1 "$f" | tr -d ' ')
printf "$(printf '\\%03o' $((b ^ 0x40)))" | dd of="$f" bs=1 seek="$off" conv=notrunc 2>/dev/null
[ "$(od -An -tu1 -j"$off" -N1 "$f" | tr -d ' ')" != "$b" ] || { echo "FAIL: could not corrupt $f"; exit 1; }

run 3 --cache-dir "$cache"
[ "$compiles" = 1 ] || { echo "FAIL: run 3 (corrupt entry) compiled $compiles times, want 1"; exit 1; }
grep -q "TD-CACHE-REBUILD" "$tmp/3.err" || { echo "FAIL: run 3 did not log TD-CACHE-REBUILD"; cat "$tmp/3.err"; exit 1; }
grep "TD-CACHE-REBUILD" "$tmp/3.err"
[ "$(entries)" = 1 ] || { echo "FAIL: $(entries) entries after the rebuild, want 1"; exit 1; }
run 4 --cache-dir "$cache"
[ "$compiles" = 0 ] || { echo "FAIL: run 4 compiled $compiles times after the rebuild"; exit 1; }
echo "module cache: compile once, load after, corrupt entry rebuilt ($(grep -o '(NVIDIA[^)]*)' "$tmp/1.log" | head -1))"
