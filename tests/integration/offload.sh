#!/bin/bash
# memory.recompute FULL_OFFLOAD through the daemon (the layer inputs in host
# memory: train/plan.h), on the CPU backend.
# 1. traind --plan of a full-offload job prints the plan's host arena beside
#    the device total, and a device total below FULL's.
# 2. trainctl submit --recompute full-offload trains the job with that plan
#    (its log lines say so) to the bits of --recompute none: the same model
#    file, byte for byte.
# 3. AUTO on a simulated GPU whose size lies between FULL_OFFLOAD's plan and
#    FULL's (vram_factor 1: a simulated GPU's share is its size) takes
#    full-offload, says so with its host memory, and trains.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
U0=GPU-00000000-0000-0000-0000-000000000000

# The integration job in fp32 whatever the device (the simulated GPU's job
# runs on the CPU backend; --plan then plans what preflight plans).
spec() { # FILE [MEMORY]
	sed -e 's/^  seed: 1$/  seed: 1\n  precision: PRECISION_FP32/' tests/integration/job.txtpb >"$1"
	[ -n "${2:-}" ] && printf '%s\n' "$2" >>"$1"
	return 0
}

# --- 1: traind --plan ---
total() { # the plan's device total in bytes, from traind --plan's output
	printf '%s\n' "$1" | sed -n 's/^total  *[^(]*(\([0-9]*\) bytes)$/\1/p'
}
spec "$WORK/full.txtpb" "memory { recompute: RECOMPUTE_FULL }"
spec "$WORK/off.txtpb" "memory { recompute: RECOMPUTE_FULL_OFFLOAD }"
pfull=$("$TRAIND" --plan "$WORK/full.txtpb" 2>&1)
poff=$("$TRAIND" --plan "$WORK/off.txtpb" 2>&1)
expect_contains "traind --plan names the policy" "$poff" "recompute  full-offload;"
expect_contains "traind --plan prints the host arena" "$poff" "of pinned host memory beside the device's total"
expect_eq "FULL's plan has no host arena" "$(printf '%s\n' "$pfull" | grep -c '^host ')" 0
full=$(total "$pfull")
off=$(total "$poff")
note "device plans: full $full, full-offload $off bytes"
if [ -z "$full" ] || [ -z "$off" ]; then
	bad "traind --plan gives the totals: '$pfull' '$poff'"
	finish
	exit 1
fi
check "FULL_OFFLOAD's device plan is below FULL's" test "$off" -lt "$full"

# --- 2: the same bits as NONE ---
start_daemon --user --cpu-slots 2
jn=$(ctl submit tests/integration/job.txtpb --steps 8 --checkpoint-every 0 --output "$WORK/none" \
	--name none --recompute none)
jo=$(ctl submit tests/integration/job.txtpb --steps 8 --checkpoint-every 0 --output "$WORK/off" \
	--name off --recompute full-offload)
both_succeeded() { job_is "$jn" SUCCEEDED && job_is "$jo" SUCCEEDED; }
check "both jobs finish" wait_for 120 both_succeeded
ev=$(ctl logs "$jo")
expect_contains "the job trained with full-offload" "$ev" "recompute  full-offload;"
expect_contains "and held the host arena" "$ev" "of pinned host memory beside the device's total"
check "full-offload's model is none's, byte for byte" \
	cmp "$WORK/none/model.safetensors" "$WORK/off/model.safetensors"
stop_daemon

# --- 3: AUTO takes full-offload where only its plan fits ---
rm -rf "$STATE"
g0=$(((full + off) / 2))
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:$g0"
spec "$WORK/auto.txtpb"
ja=$(ctl submit "$WORK/auto.txtpb" --device any --steps 8 --checkpoint-every 0 --output "$WORK/auto" \
	--name auto)
check "the AUTO job finishes" wait_for 120 job_is "$ja" SUCCEEDED
ev=$(ctl logs "$ja")
expect_contains "placed on the simulated GPU" "$ev" "placed on $U0"
expect_contains "AUTO chose full-offload" "$ev" "memory.recompute AUTO chose full-offload"
expect_contains "naming its host memory" "$ev" "MiB of pinned host memory)"
expect_contains "and trained with it" "$ev" "recompute  full-offload;"
stop_daemon
finish
