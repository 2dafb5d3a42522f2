#!/bin/bash
# The daemon's GPU discovery and placement against fake_cuda.c, a stand-in
# driver with two devices ($TD_CUDA_DRIVER), on any host: `trainctl info` and
# `trainctl ledger` list both with nvidia-smi's UUIDs, names, totals and the
# driver's free memory; a reservation over a device's free memory is refused
# (contract 7); a job with device GPU is placed on device 0 with a lease of
# plan + 36 MiB (CUDA backend) + 768 MiB (cuda_context_mib, its default), is run with the
# CUDA backend on ordinal 0 — which fails there, the fake driver runs nothing —
# and leaves no lease behind. A job asking for both GPUs (a gang, data
# parallel) is placed on both with a lease each of plan + backend + context
# + NCCL's allowance (1 GiB) and runs a rank on each ordinal — which fails
# there too, naming the rank — where NCCL loads; a daemon that cannot load
# it ($TD_NCCL_LIBRARY pointing nowhere) refuses the gang at submit, naming
# NCCL. traind --plan's AUTO lines on the fake devices add the selective
# layers a device grants (an 8B config alone).
# usage: fake_driver.sh LIBFAKECUDA (environment as tests/integration/lib.sh)
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1
export TD_CUDA_DRIVER=$1
U0=GPU-00010203-0405-0607-0809-0a0b0c0d0e0f
U1=GPU-10111213-1415-1617-1819-1a1b1c1d1e1f

start_daemon --user --cpu-slots 1
info=$(ctl info)
expect_contains "the CUDA backend is offered" "$info" "backends:    cpu cuda"
row0=$(printf '%s\n' "$info" | grep "^0 ")
row1=$(printf '%s\n' "$info" | grep "^1 ")
for want in "$U0" "80.0 GiB" "60.0 GiB" "Fake GPU 0"; do
	expect_contains "info: device 0 shows $want" "$row0" "$want"
done
for want in "$U1" "16.0 GiB" "512.0 MiB" "Fake GPU 1"; do
	expect_contains "info: device 1 shows $want" "$row1" "$want"
done
expect_contains "the ledger lists the devices" "$(ctl ledger)" "$U1"

# Contract 7: 1 GiB fits device 1's ledger share (16 GiB x 0.9) but not its
# free memory (512 MiB).
ctl ledger reserve --gpu "$U1" --bytes 1G --ttl 60 >/dev/null 2>"$WORK/err"
expect_eq "over the driver's free memory: exit 7" "$?" 7
expect_contains "the refusal names the free memory" "$(cat "$WORK/err")" "free"
lease=$(ctl ledger reserve --gpu "$U1" --bytes 256M --ttl 60)
check "256 MiB fits" test -n "$lease"
ctl ledger release "$lease" >/dev/null

fx=$TD_FIXTURES
cat >"$WORK/job.txtpb" <<SPEC
name: "fake-driver"
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }
hyper { max_steps: 3 micro_batch: 2 }
output { dir: "$WORK/out" }
resources { device: DEVICE_GPU allow_cpu: false }
SPEC
id=$(ctl submit "$WORK/job.txtpb")
check "the job is submitted" test -n "$id"
ended() { case $(job_state "$id") in SUCCEEDED | FAILED | CANCELLED) return 0 ;; esac; return 1; }
check "the job ends" wait_for 60 ended
logs=$(ctl logs "$id")
plan=$(printf '%s\n' "$logs" | sed -n 's/.*plan: \([0-9]*\) bytes.*/\1/p' | head -n 1)
want=$(awk -v p="$plan" 'BEGIN { printf "%.1f", (p + 36 * 1048576 + 768 * 1048576) / 1048576 }')
has() { printf '%s\n' "$logs" | grep -qF -e "$1"; }
check "placed on device 0 with a lease of plan + 36 MiB + 768 MiB ($want MiB)" \
	grep -qE "placed on $U0 \(GPU 0, Fake GPU 0\): lease [0-9]+ of $want MiB \(plan" <<<"$logs"
check "run with the CUDA backend on ordinal 0" has "(cuda backend, CUDA device 0)"
expect_eq "the fake driver cannot run it" "$(job_state "$id")" FAILED
check "the failure is the driver's" has "CUDA_ERROR_NOT_SUPPORTED"
expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
# Issue 12: a gang of the two real GPUs trains data parallel where NCCL
# loads; each step's 2 micro-batches, one a rank.
sed 's/^hyper { max_steps: 3 micro_batch: 2 }$/hyper { max_steps: 3 micro_batch: 2 grad_accum: 2 }/' \
	"$WORK/job.txtpb" >"$WORK/job2.txtpb"
if grep -q "TD-GPU-NCCL: data parallel over" "$LOG"; then
	gid=$(ctl submit "$WORK/job2.txtpb" --gpus 2 --output "$WORK/out2" 2>"$WORK/err")
	check "the gang of both real GPUs is accepted where NCCL loads" test -n "$gid"
	# Device 1 has 512 MiB free, less than a gang's lease there (plan +
	# 36 MiB + 768 MiB + NCCL's 1 GiB): the gang waits, holding the pair.
	held() { ctl logs "$gid" | grep -q "waiting for GPU 0+1: held for this job"; }
	check "it waits for both GPUs, held for it" wait_for 20 held
	ctl cancel "$gid" >/dev/null
	gended() { case $(job_state "$gid") in CANCELLED | FAILED) return 0 ;; esac; return 1; }
	check "it is cancelled" wait_for 20 gended
	expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
else
	note "NCCL does not load on this host: $(grep -o 'TD-GPU-NCCL.*' "$LOG")"
fi
[ "$FAILS" -eq 0 ] || printf '%s\n' "$logs"
stop_daemon
# Without NCCL, a gang of real GPUs is refused at submit, naming it.
TD_NCCL_LIBRARY=$WORK/no-libnccl.so.2 start_daemon --user --cpu-slots 1
ctl submit "$WORK/job2.txtpb" --gpus 2 --output "$WORK/out3" >/dev/null 2>"$WORK/err"
expect_eq "a gang of 2 real GPUs without NCCL: exit 2" "$?" 2
expect_contains "the refusal names the field and NCCL" "$(cat "$WORK/err")" \
	"resources.gpus: 2: training on several CUDA GPUs (data parallel) needs NCCL: $WORK/no-libnccl.so.2 cannot be loaded"
stop_daemon

# traind --plan's AUTO lines on the fake devices, for Llama-3-8B's shapes
# (a config alone: --plan reads no weights) with LoRA on all seven at B8 x
# T2048: device 0's 60 GiB grant full (none's and selective's plans are
# larger) with as many of its first layers selective as fit — the layers
# the scheduler would add — and device 1's 0.5 GiB nothing.
mkdir -p "$WORK/l8b"
cat >"$WORK/l8b/config.json" <<'EOF2'
{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"rope_theta":500000.0,"rms_norm_eps":1e-5,"tie_word_embeddings":false,"max_position_embeddings":8192,"torch_dtype":"bfloat16"}
EOF2
echo '{"text": "hello"}' >"$WORK/l8b/d.jsonl"
cat >"$WORK/l8b/job.txtpb" <<EOF2
name: "l8b" method: METHOD_LORA model_dir: "$WORK/l8b"
data { train_file: "$WORK/l8b/d.jsonl" seq_len: 2048 }
hyper { micro_batch: 8 precision: PRECISION_BF16 max_steps: 1 }
lora { rank: 16 target_modules: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] }
output { dir: "$WORK/l8b/out" }
resources { device: DEVICE_GPU }
EOF2
# With no pinned host memory to give (pinned_host_max_mib 0) full-offload
# is out; with 16 GiB of it, full-offload (its checkpoints on the host)
# takes FULL's place with more selective layers in the same grant.
pl=$(TRAIND_PINNED_HOST_MAX_MIB=0 "$TRAIND" --plan "$WORK/l8b/job.txtpb" 2>&1)
auto0=$(printf '%s\n' "$pl" | grep '^auto       GPU 0')
nsel=$(printf '%s\n' "$auto0" | sed -n 's/.*: full with its first \([0-9]*\) layers selective (lease \([0-9.]*\) GiB).*/\1/p')
lease=$(printf '%s\n' "$auto0" | sed -n 's/.*: full with its first \([0-9]*\) layers selective (lease \([0-9.]*\) GiB).*/\2/p')
check "--plan: device 0 takes full with 1 to 31 selective layers ('$auto0')" \
	test "${nsel:-0}" -ge 1 -a "${nsel:-0}" -le 31
check "--plan: within device 0's 60 GiB (lease $lease)" awk -v l="${lease:-99}" 'BEGIN { exit !(l <= 60) }'
plo=$(TRAIND_PINNED_HOST_MAX_MIB=16384 "$TRAIND" --plan "$WORK/l8b/job.txtpb" 2>&1 | grep '^auto       GPU 0')
noff=$(printf '%s\n' "$plo" | sed -n 's/.*: full-offload with its first \([0-9]*\) layers selective (lease \([0-9.]*\) GiB, and [0-9.]* GiB of pinned host memory; full would have \([0-9]*\) selective layers).*/\1/p')
lo=$(printf '%s\n' "$plo" | sed -n 's/.*: full-offload with its first \([0-9]*\) layers selective (lease \([0-9.]*\) GiB.*/\2/p')
nfull=$(printf '%s\n' "$plo" | sed -n 's/.*; full would have \([0-9]*\) selective layers).*/\1/p')
check "--plan: with pinned memory, device 0 takes full-offload with more selective layers than full's $nsel ('$plo')" \
	test "${noff:-0}" -gt "${nsel:-99}" -a "${nfull:-0}" = "${nsel:-x}"
check "--plan: full-offload's lease within device 0's 60 GiB (lease $lo)" awk -v l="${lo:-99}" 'BEGIN { exit !(l <= 60) }'
expect_contains "--plan: device 1 takes nothing" "$(printf '%s\n' "$pl" | grep '^auto       GPU 1')" \
	"nothing fits"
finish
