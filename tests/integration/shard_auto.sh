#!/bin/bash
# memory.shard AUTO chooses where a gang is placed, with the recompute
# policy: for each policy in its order, each sharding in
# daemon/preflight.h's dmn_auto_shard order — the gradients sharded, then
# unsharded, the optimizer, the weights (issue 12, item 3). On simulated
# GPUs (fake_gpus: the ranks train on the CPU, summing in-process).
# 1. Two GPUs too small for any plan: a gang of 2 fails naming its smallest
#    plan; its submit event gives the plans unsharded and sharded, which
#    size the GPUs of:
# 2. Two GPUs between the sharded NONE plans (the optimizer's, the
#    gradients') and the unsharded one (and above SELECTIVE's unsharded:
#    sharding comes before recompute): the gang is placed with memory.shard
#    gradients (the first sharding in AUTO's order, and it fits) and
#    recompute none, says so in its events, trains sharded (its log) and
#    succeeds; the same gang fixed at --shard optimizer trains with its
#    optimizer sharded and succeeds; with --shard none --recompute none it
#    fails (no GPU can ever grant its plan).
# 3. Two larger GPUs: a gang fixed at --shard parameters, evaluating
#    (every rank runs the evaluation's forwards), trains with its weights
#    sharded and succeeds, its eval loss logged.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
JOB=tests/integration/job.txtpb
U0=GPU-00000000-0000-0000-0000-000000000000
U1=GPU-11111111-1111-1111-1111-111111111111

submit() {
	ctl submit "$JOB" --device any --gpus 2 --grad-accum 2 --steps 20 --checkpoint-every 10 \
		--output "$WORK/$1" --name "$1" "${@:2}"
}

# --- 1: no GPU can take even the smallest plan ---
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:4096,$U1:4096"
jp=$(submit probe)
check "a gang whose smallest plan fits no GPU fails" wait_for 30 job_is "$jp" FAILED
ev=$(ctl logs "$jp")
line=$(printf '%s\n' "$ev" | grep 'plan: [0-9]* bytes with recompute none')
none=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective.*/\1/p')
sel=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective.*/\2/p')
snone=$(printf '%s\n' "$line" | sed -n 's/.*with memory.shard optimizer \([0-9]*\) bytes with recompute none.*/\1/p')
gnone=$(printf '%s\n' "$line" | sed -n 's/.*with memory.shard gradients \([0-9]*\) bytes with recompute none.*/\1/p')
pnone=$(printf '%s\n' "$line" | sed -n 's/.*with memory.shard parameters \([0-9]*\) bytes with recompute none.*/\1/p')
if [ -z "$none" ] || [ -z "$sel" ] || [ -z "$snone" ] || [ -z "$gnone" ] || [ -z "$pnone" ]; then
	bad "the submit event gives the plans unsharded and sharded: '$line'"
	finish
	exit 1
fi
note "plans: none $none, selective $sel, none with the optimizer sharded $snone bytes, the gradients $gnone, the weights $pnone"
check "sharded NONE < NONE" test "$snone" -lt "$none"
check "gradients-sharded NONE < NONE" test "$gnone" -lt "$none"
stop_daemon

# --- 2: the GPUs grant the sharded plans only ---
rm -rf "$STATE"
lo=$snone
[ "$sel" -gt "$lo" ] && lo=$sel
[ "$gnone" -gt "$lo" ] && lo=$gnone
g=$(((lo + none) / 2))
check "a GPU size above sharded NONE's and selective's, below NONE's" test "$g" -gt "$lo" -a "$g" -lt "$none"
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:$g,$U1:$g"
j=$(submit s1)
check "the gang succeeds" wait_for 120 job_is "$j" SUCCEEDED
ev=$(ctl logs "$j")
expect_contains "AUTO kept recompute none" "$ev" "memory.recompute AUTO chose none"
expect_contains "AUTO sharded the gradients" "$ev" "memory.shard AUTO chose gradients"
expect_contains "and the ranks trained sharded" "$ev" "sharded: gradients"
check "a model was written" test -s "$WORK/s1/model.safetensors"
jg=$(submit opt --shard optimizer --recompute none)
check "the gang with its optimizer sharded succeeds" wait_for 120 job_is "$jg" SUCCEEDED
expect_contains "and trained so" "$(ctl logs "$jg")" "sharded: optimizer"
check "a model was written" test -s "$WORK/opt/model.safetensors"
jn=$(submit fixed --shard none --recompute none)
check "a fixed shard none (and recompute none) fails" wait_for 30 job_is "$jn" FAILED
expect_contains "naming what it needs" "$(ctl logs "$jn")" "can ever grant"
expect_contains "its effective spec shows the sharding" "$(ctl show "$jn")" "memory.shard: none"
ctl submit "$JOB" --device any --gpus 2 --grad-accum 2 --shard sometimes --output "$WORK/m" \
	>/dev/null 2>"$WORK/err"
expect_eq "an unknown sharding: exit 2" "$?" 2
expect_contains "naming the flag" "$(cat "$WORK/err")" "--shard"
stop_daemon

# --- 3: the weights sharded too (on this two-layer model its plan is not
# the smallest: the slots of the layers and of the other tensors hold as
# much as the weights and gradients it shards): GPUs with room for it ---
rm -rf "$STATE"
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:$((4 * none)),$U1:$((4 * none))"
jw=$(submit weights --shard parameters --recompute none --eval "$TD_FIXTURES/demo/fortunes.tokens")
check "the gang with its weights sharded succeeds" wait_for 120 job_is "$jw" SUCCEEDED
expect_contains "and trained so" "$(ctl logs "$jw")" "sharded: parameters"
expect_contains "evaluating" "$(ctl logs "$jw")" "eval "
check "a model was written" test -s "$WORK/weights/model.safetensors"
stop_daemon
finish
