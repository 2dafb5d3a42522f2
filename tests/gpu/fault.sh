#!/bin/bash
# A real sticky CUDA error in the daemon, on the GPU machine. The CUDA
# backend's test hook TD_CUDA_FAULT_AFTER_OPS=N (gpu/cuda/cuda_backend.c)
# makes the first backend of the process to reach N kernel launches write
# through a wild pointer: CUDA_ERROR_ILLEGAL_ADDRESS, which corrupts the
# device's primary context for every job on it. Two GPU jobs of the qwen2
# fixture: A, submitted first, faults mid-run; B, running beside it with
# checkpoints, is told to stop or fails with the same loss. Then: A FAILED
# naming CUDA_ERROR_ILLEGAL_ADDRESS; B was INTERRUPTED and requeued at once,
# placed again after the daemon reset the context (TD-GPU-RESET in its log),
# resumed from its checkpoint and SUCCEEDED; no lease is left; the daemon
# still answers. Skips (77) without a GPU.
#
# N is calibrated first: a `traind --run` of A alone with the hook at C
# launches says at which step launch C falls and how fast A runs, so that in
# the daemon A faults about FAULT_AFTER_S seconds into its run, long after B
# has checkpointed, and B (2 x that long) is still running then.
# Environment as the integration tests (tests/integration/lib.sh).
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1
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
spec fault-a "$WORK/outa" 1000000 1000 >"$WORK/a.txtpb"
spec fault-b "$WORK/outb" "$bsteps" "$bckpt" >"$WORK/b.txtpb"
a=$(ctl submit "$WORK/a.txtpb")
check "job A is submitted" test -n "$a"
check "job A runs" wait_for 120 job_is "$a" RUNNING
b=$(ctl submit "$WORK/b.txtpb")
check "job B is submitted" test -n "$b"
ckpt() { ctl logs "$b" | grep -q "checkpoint .*/step-"; }
check "job B checkpoints before A faults" wait_for 120 ckpt
check "A is still running then" job_is "$a" RUNNING
ended() {
	for id in "$a" "$b"; do
		case $(job_state "$id") in SUCCEEDED | FAILED | CANCELLED) ;; *) return 1 ;; esac
	done
}
check "both jobs end" wait_for 240 ended
la=$(ctl logs "$a")
lb=$(ctl logs "$b")
expect_eq "job A FAILED" "$(job_state "$a")" FAILED
check "A's reason names CUDA_ERROR_ILLEGAL_ADDRESS" grep -qE "→ FAILED: .*CUDA_ERROR_ILLEGAL_ADDRESS" <<<"$la"
check "B stopped or failed by A's fault, recorded INTERRUPTED" \
	grep -qE "→ INTERRUPTED: .*CUDA device [0-9]+ lost its context by another job's fault" <<<"$lb"
check "B was requeued at once" grep -qF "INTERRUPTED → QUEUED: requeued after its CUDA device lost its context" <<<"$lb"
check "B ran again (attempt 2)" grep -qE "\(cuda backend, CUDA device [0-9]+\), attempt 2" <<<"$lb"
check "B resumed from a checkpoint" grep -qE "resumed from step [1-9]" <<<"$lb"
expect_eq "job B SUCCEEDED" "$(job_state "$b")" SUCCEEDED
check "the daemon logged TD-GPU-RESET" grep -q "TD-GPU-RESET.*primary context reset" "$LOG"
check "the hook fired once" test "$(grep -c TD-GPU-FAULT-INJECT "$LOG")" -eq 1
expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
expect_contains "trainctl info still answers" "$(ctl info)" "backends:    cpu cuda"
printf '%s\n' "$la" | grep -e "→ FAILED" | sed 's/^/# A: /'
printf '%s\n' "$lb" | grep -e "→ INTERRUPTED" -e "→ QUEUED" -e "resumed from" -e "→ SUCCEEDED" | sed 's/^/# B: /'
grep -e TD-GPU-RESET -e TD-GPU-FAULT-INJECT "$LOG" | sed 's/^/# log: /'
if [ "$FAILS" -ne 0 ]; then
	printf '%s\n' "--- job $a" "$la" | tail -n 30
	printf '%s\n' "--- job $b" "$lb" | tail -n 40
	echo "--- daemon log"
	tail -n 40 "$LOG"
fi
stop_daemon
finish
