#!/bin/sh
# On the GPU: 6 steps straight and 3 steps + checkpoint + resume + 3 steps give
# bit-identical models (the CUDA kernels are deterministic: no float atomics);
# every run compiles no kernel after the table is sealed, the second process
# included. Skips (77) where there is no GPU.
# usage: resume_cuda.sh TRAIND FIXTURES
set -eu
traind=$1 fx=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for run in straight resumed; do
	cat >"$tmp/$run.txtpb" <<SPEC
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }
hyper { lr: 1e-3 max_steps: 6 micro_batch: 4 seed: 5 weight_decay: 0.01 }
output { dir: "$tmp/$run" checkpoint_every: 3 }
SPEC
done
if ! "$traind" --run "$tmp/straight.txtpb" --backend cuda >"$tmp/a.log" 2>"$tmp/a.err"; then
	if grep -q -e "cannot be loaded" -e "no NVIDIA driver" -e "no CUDA device" "$tmp/a.err"; then
		echo "SKIP: $(cat "$tmp/a.err")"
		exit 77
	fi
	cat "$tmp/a.err"; exit 1
fi
rc=0
"$traind" --run "$tmp/resumed.txtpb" --backend cuda --stop-after 3 >"$tmp/b.log" || rc=$?
[ "$rc" = 3 ] || { echo "FAIL: the first half should stop with exit 3, got $rc"; exit 1; }
"$traind" --run "$tmp/resumed.txtpb" --backend cuda >"$tmp/c.log"
grep -q "resumed from" "$tmp/c.log" || { echo "FAIL: the second half did not resume"; exit 1; }
fail=0
cmp "$tmp/straight/model.safetensors" "$tmp/resumed/model.safetensors" || { echo "FAIL: models differ"; fail=1; }
for log in a b c; do
	line=$(grep "kernel compiles" "$tmp/$log.log")
	echo "$log: $line"
	case $line in *" 0 after seal"*) ;; *) echo "FAIL: compiles after seal"; fail=1 ;; esac
done
[ $fail = 0 ] && echo "6 steps straight == 3 + resume + 3, bit for bit, on $(grep -o '(NVIDIA[^)]*)' "$tmp/a.log" | head -1)"
exit $fail
