#!/bin/bash
# A real sticky CUDA error in the daemon, on the GPU machine. The CUDA
# backend's test hook TD_CUDA_FAULT_AFTER_OPS=N (gpu/cuda/cuda_backend.c)
# makes the first backend of the process to reach N kernel launches write
# through a wild pointer: CUDA_ERROR_ILLEGAL_ADDRESS, which corrupts the
# device's primary context for every job on it. Two GPU jobs of the qwen2
# fixture run side by side with checkpoints; the hook counts launches across
# the process, so either may be the one that faults. Then: that job FAILED
# naming CUDA_ERROR_ILLEGAL_ADDRESS; the other was INTERRUPTED and requeued;
# the daemon recovered the device (the driver cannot reset a context after
# such an error in the same process — seen with driver 580 — so the daemon
# stops its jobs and re-executes itself, TD-REEXEC); the requeued job resumed
# from its checkpoint in the new process and SUCCEEDED; no lease is left; the
# daemon still answers. Skips (77) without a GPU.
#
# N is calibrated first: a `traind --run` of A alone with the hook at C
# launches says at which step launch C falls and how fast A runs, so that in
# the daemon A faults about FAULT_AFTER_S seconds into its run, long after B
# has checkpointed, and B (2 x that long) is still running then.
# Environment as the integration tests (tests/integration/lib.sh).
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1
# One GPU (the first visible, else 0): the scenario is two jobs on the
# same device, which a host of several GPUs would place apart (on two H100s
# the high-priority job ran on the second GPU instead of preempting).
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}
fx=$TD_FIXTURES
FAULT_AFTER_S=${FAULT_AFTER_S:-15}
C=20000
SEQ=32 MB=4

spec() { # NAME DIR MAX_STEPS CKPT_EVERY
	cat <<SPEC
name: "$1"
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: $SEQ }
hyper { lr: 1e-3 max_steps: $3 micro_batch: $MB seed: 3 weight_decay: 0.01 }
output { dir: "$2" checkpoint_every: $4 }
resources { device: DEVICE_GPU allow_cpu: false }
SPEC
}

# 1. Calibration, outside the daemon.
spec calib "$WORK/calib" 1000000 0 >"$WORK/calib.txtpb"
TD_CUDA_FAULT_AFTER_OPS=$C "$TRAIND" --run "$WORK/calib.txtpb" --backend cuda >"$WORK/calib.log" 2>&1
rc=$?
if grep -q -e "cannot be loaded" -e "no NVIDIA driver" -e "no CUDA device" "$WORK/calib.log"; then
	echo "SKIP: no CUDA GPU: $(grep -m1 -e "cannot be loaded" -e "no NVIDIA driver" -e "no CUDA device" "$WORK/calib.log")"
	exit 77
fi
check "calibration: the hook fails the run (exit $rc)" test "$rc" -ne 0
check "calibration: with CUDA_ERROR_ILLEGAL_ADDRESS" grep -q CUDA_ERROR_ILLEGAL_ADDRESS "$WORK/calib.log"
last=$(grep -E '^ *step +[0-9]+/' "$WORK/calib.log" | tail -n 1)
s0=$(printf '%s\n' "$last" | sed -n 's/^ *step *\([0-9]*\)\/.*/\1/p')
tps=$(printf '%s\n' "$last" | sed -n 's/.*tok\/s \([0-9]*\).*/\1/p')
if [ -z "$s0" ] || [ -z "$tps" ] || [ "$s0" -lt 2 ] || [ "$tps" -lt 1 ]; then
	bad "calibration: no step line before launch $C: $(tail -n 5 "$WORK/calib.log")"
	finish
fi
# Launches per step, steps per second alone; A's fault at FAULT_AFTER_S.
n=$(awk -v c=$C -v s="$s0" -v t="$tps" -v w=$FAULT_AFTER_S -v tok=$((SEQ * MB)) \
	'BEGIN { printf "%d", c / s * (w * t / tok) }')
bsteps=$(awk -v t="$tps" -v w=$FAULT_AFTER_S -v tok=$((SEQ * MB)) 'BEGIN { printf "%d", 2 * w * t / tok }')
bckpt=$((bsteps / 15 > 10 ? bsteps / 15 : 10)) # about every 2 s alone
note "calibration: launch $C at step $s0, $tps tok/s alone: TD_CUDA_FAULT_AFTER_OPS=$n, job B $bsteps steps, checkpoint every $bckpt"

# 2. The daemon, with the hook.
export TD_CUDA_FAULT_AFTER_OPS=$n
start_daemon --user --cpu-slots 1
case "$(ctl info)" in *"backends:    cpu cuda"*) ;; *) bad "the daemon found no CUDA GPU"; stop_daemon; finish ;; esac
spec fault-a "$WORK/outa" "$bsteps" "$bckpt" >"$WORK/a.txtpb"
spec fault-b "$WORK/outb" "$bsteps" "$bckpt" >"$WORK/b.txtpb"
a=$(ctl submit "$WORK/a.txtpb")
check "job A is submitted" test -n "$a"
check "job A runs" wait_for 120 job_is "$a" RUNNING
b=$(ctl submit "$WORK/b.txtpb")
check "job B is submitted" test -n "$b"
ckpt() { ctl logs "$a" | grep -q "checkpoint .*/step-" && ctl logs "$b" | grep -q "checkpoint .*/step-"; }
check "both jobs checkpoint before the fault" wait_for 120 ckpt
ended() {
	for id in "$a" "$b"; do
		case $(job_state "$id") in SUCCEEDED | FAILED | CANCELLED) ;; *) return 1 ;; esac
	done
}
check "both jobs end" wait_for 300 ended
la=$(ctl logs "$a")
lb=$(ctl logs "$b")
# Which job faulted: the one that FAILED.
if [ "$(job_state "$a")" = FAILED ]; then f=$a lf=$la o=$b lo=$lb; else f=$b lf=$lb o=$a lo=$la; fi
expect_eq "the faulting job (job $f) FAILED" "$(job_state "$f")" FAILED
check "its reason names CUDA_ERROR_ILLEGAL_ADDRESS" grep -qE "→ FAILED: .*CUDA_ERROR_ILLEGAL_ADDRESS" <<<"$lf"
check "the other (job $o) was stopped by it, recorded INTERRUPTED" \
	grep -qE "→ INTERRUPTED: .*(lost its context|daemon)" <<<"$lo"
check "and requeued" grep -qE "INTERRUPTED → QUEUED" <<<"$lo"
check "it ran again (attempt 2)" grep -qE "attempt 2" <<<"$lo"
check "it resumed from a checkpoint" grep -qE "resumed from step [1-9]" <<<"$lo"
expect_eq "job $o SUCCEEDED" "$(job_state "$o")" SUCCEEDED
check "the daemon recovered the device (reset, or re-executed)" \
	grep -qE "TD-GPU-RESET.*primary context reset|TD-REEXEC: re-executing" "$LOG"
check "the hook fired once" test "$(grep -c TD-GPU-FAULT-INJECT "$LOG")" -eq 1
expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
expect_contains "trainctl info still answers" "$(ctl info)" "backends:    cpu cuda"
printf '%s\n' "$lf" | grep -e "→ FAILED" | sed "s/^/# job $f: /"
printf '%s\n' "$lo" | grep -e "→ INTERRUPTED" -e "→ QUEUED" -e "resumed from" -e "→ SUCCEEDED" | sed "s/^/# job $o: /"
grep -e TD-GPU-RESET -e TD-GPU-FAULT-INJECT -e TD-REEXEC "$LOG" | sed 's/^/# log: /'
if [ "$FAILS" -ne 0 ]; then
	printf '%s\n' "--- job $a" "$la" | tail -n 30
	printf '%s\n' "--- job $b" "$lb" | tail -n 40
	echo "--- daemon log"
	tail -n 40 "$LOG"
fi
stop_daemon
finish
