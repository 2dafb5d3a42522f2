#!/bin/sh
# 100 steps of the qwen2 fixture on the GPU and on the CPU (fp32, the
# reference): the two loss curves must agree within the stated bound, for
# every step. PRECISION fp32 (the CUDA backend's fp32 mode): relative 1e-3, the
# float32 forward tolerance of the shared fixtures (1e-5) given room to compound
# over 100 steps. PRECISION bf16: relative 2e-2, the bf16 loss bound of
# tests/parity.h (1e-2 on one step) given the same room. Skips (77) where
# there is no GPU. METHOD: full (default); lora-dropout (LoRA r=8 on all seven
# projections with dropout 0.1: the masks are the same on both backends, and
# the bf16 mode keeps fp32 inputs for them); qlora (an NF4 base with LoRA on
# q and v); distill (from the distillation fixture's teacher). RECOMPUTE: the
# GPU run's activation recompute policy (none, selective, full or
# full-offload; default the spec's default), held to the same bound as without.
# usage: loss_curve.sh TRAIND FIXTURES [fp32|bf16] [full|lora-dropout|qlora|distill] [none|selective|full|full-offload]
set -eu
traind=$1 fx=$2 prec=${3:-fp32} method=${4:-full} recompute=${5:-}
case $method in
full) M="" ;;
lora-dropout) M='method: METHOD_LORA lora { rank: 8 dropout: 0.1 target_modules: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] }' ;;
qlora) M='method: METHOD_QLORA lora { rank: 8 }' ;;
distill) M="method: METHOD_DISTILL distill { teacher_dir: \"$fx/distill/teacher\" temperature: 2 alpha: 0.5 }" ;;
*) echo "bad method $method"; exit 2 ;;
esac
R=""
case $recompute in
"") ;;
none | selective | full | full-offload) R="memory { recompute: RECOMPUTE_$(echo "$recompute" | tr a-z- A-Z_) }" ;;
*) echo "bad recompute policy $recompute"; exit 2 ;;
esac
case $prec in fp32) bound=1e-3 P=PRECISION_FP32 ;; bf16) bound=2e-2 P=PRECISION_BF16 ;; *) echo "bad precision $prec"; exit 2 ;; esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for be in cpu cuda; do
	p=$P; dev=DEVICE_GPU
	r=$R
	[ $be = cpu ] && { p=PRECISION_FP32; dev=DEVICE_CPU; r=""; }
	cat >"$tmp/$be.txtpb" <<SPEC
$M
$r
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 24 }
hyper { lr: 1e-3 schedule: SCHEDULE_CONSTANT max_steps: 100 micro_batch: 2 seed: 3 weight_decay: 0.01 precision: $p }
output { dir: "$tmp/out-$be" }
resources { device: $dev allow_cpu: true }
SPEC
done
"$traind" --run "$tmp/cpu.txtpb" --backend cpu >"$tmp/cpu.log"
if ! "$traind" --run "$tmp/cuda.txtpb" --backend cuda >"$tmp/cuda.log" 2>"$tmp/cuda.err"; then
	if grep -q -e "cannot be loaded" -e "no NVIDIA driver" -e "no CUDA device" "$tmp/cuda.err"; then
		echo "SKIP: $(cat "$tmp/cuda.err")"
		exit 77
	fi
	cat "$tmp/cuda.err"
	exit 1
fi
# step lines: "step N/100  loss X ..."
awk '/^step /{print $4}' "$tmp/cpu.log" >"$tmp/cpu.loss"
awk '/^step /{print $4}' "$tmp/cuda.log" >"$tmp/cuda.loss"
paste "$tmp/cpu.loss" "$tmp/cuda.loss" | awk -v bound="$bound" -v prec="$prec" -v method="$method${recompute:+ recompute $recompute}" '
	{ n++; d = $1 - $2; if (d < 0) d = -d; r = d / $1; if (r > worst) { worst = r; at = n }
	  if (n == 1 || n % 20 == 0) printf "step %3d  cpu %.4f  cuda %.4f\n", n, $1, $2 }
	END { printf "%d steps, GPU %s vs CPU fp32: worst relative loss difference %.2e at step %d (bound %s)\n", n, prec " " method, worst, at, bound
	      exit !(n == 100 && worst <= bound + 0) }'
