#!/bin/bash
# A lost device context, on any host: fake_cuda.c plays a device 0 whose
# primary context is corrupt (cuStreamCreate fails with the sticky
# CUDA_ERROR_ILLEGAL_ADDRESS while $TD_FAKE_CUDA_LOST exists). Two GPU jobs
# overlap on it: the first to report the loss FAILS naming the error; the
# other is recorded INTERRUPTED and requeued at once; once neither runs, the
# daemon resets the device's context (cuDevicePrimaryCtxReset, which the fake
# logs and which clears the fault), logs TD-GPU-RESET and places the requeued
# job there again — where it fails, as every job does on the fake driver, with
# CUDA_ERROR_NOT_SUPPORTED. No lease is left and the daemon still answers.
# usage: fault_fake.sh LIBFAKECUDA (environment as tests/integration/lib.sh)
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1
export TD_CUDA_DRIVER=$1
export TD_FAKE_CUDA_LOST=$WORK/lost TD_FAKE_CUDA_LOG=$WORK/fake.log
: >"$TD_FAKE_CUDA_LOST"

start_daemon --user --cpu-slots 1
fx=$TD_FIXTURES
for k in 1 2; do
	cat >"$WORK/job$k.txtpb" <<SPEC
name: "fault-$k"
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }
hyper { max_steps: 3 micro_batch: 2 }
output { dir: "$WORK/out$k" }
resources { device: DEVICE_GPU allow_cpu: false }
SPEC
done
a=$(ctl submit "$WORK/job1.txtpb")
b=$(ctl submit "$WORK/job2.txtpb")
check "both jobs are submitted" test -n "$a" -a -n "$b"
ended() {
	for id in "$a" "$b"; do
		case $(job_state "$id") in SUCCEEDED | FAILED | CANCELLED) ;; *) return 1 ;; esac
	done
}
check "both jobs end" wait_for 90 ended
la=$(ctl logs "$a")
lb=$(ctl logs "$b")
# Which one reported the loss first is a race; the checks are the same.
case $la in *"→ FAILED: "*CUDA_ERROR_ILLEGAL_ADDRESS*) first=$a other=$b lo=$lb lf=$la ;;
*) first=$b other=$a lo=$la lf=$lb ;; esac
expect_eq "the job that reported the loss FAILED" "$(job_state "$first")" FAILED
check "its reason names CUDA_ERROR_ILLEGAL_ADDRESS" grep -qE "→ FAILED: .*CUDA_ERROR_ILLEGAL_ADDRESS" <<<"$lf"
check "its reason says the context is lost" grep -qF "the device's context is lost" <<<"$lf"
check "the other job was recorded INTERRUPTED (another job's fault)" \
	grep -qE "→ INTERRUPTED: CUDA device 0 lost its context by another job's fault" <<<"$lo"
check "and requeued at once" grep -qF "INTERRUPTED → QUEUED: requeued after its CUDA device lost its context" <<<"$lo"
check "the daemon logged TD-GPU-RESET" grep -q "TD-GPU-RESET.*CUDA device 0 .*primary context reset" "$LOG"
expect_eq "the driver was asked to reset device 0 once" "$(cat "$WORK/fake.log" 2>/dev/null)" "reset 0"
check "the requeued job ran again on device 0 after the reset (attempt 2)" \
	grep -qF "(cuda backend, CUDA device 0), attempt 2" <<<"$lo"
check "there it failed as the fake driver fails every job" \
	grep -qE "→ FAILED: .*CUDA_ERROR_NOT_SUPPORTED" <<<"$lo"
expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
expect_contains "the daemon still answers" "$(ctl info)" "backends:    cpu cuda"
if [ "$FAILS" -ne 0 ]; then
	printf '%s\n' "--- job $a" "$la" "--- job $b" "$lb" "--- daemon log"
	tail -n 40 "$LOG"
fi
stop_daemon
finish
