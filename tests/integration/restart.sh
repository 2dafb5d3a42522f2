#!/bin/bash
# Contract 6 and the ledger (contract 7) across a daemon killed with -9:
#  - trainctl ledger reserve/release on a simulated GPU; over-asking is refused;
#    a dead holder's reservation is reclaimed;
#  - a job holding a lease on that GPU, killed mid-run after a checkpoint,
#    resumes from the checkpoint when the daemon starts again and succeeds
#    with weights identical to an uninterrupted `traind --run`; no lease is
#    left behind, the job is neither lost nor duplicated;
#  - a job whose run finished before the kill but whose end was not recorded
#    is recorded as succeeded at the restart, without training again; one
#    killed after its last step's checkpoint, before its model was written,
#    writes it at the restart and succeeds.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
GPU=GPU-fake-0
SETTINGS=(--user --cpu-slots 1 --fake-gpus "$GPU:4G")

start_daemon "${SETTINGS[@]}"

# --- the ledger by hand ---
sleep 600 &
holder=$!
lease=$(ctl ledger reserve --gpu "$GPU" --bytes 1G --pid "$holder" --note it-restart)
check "reserve prints a lease id" test -n "$lease"
ledger_out=$(ctl ledger)
expect_contains "ledger lists the lease" "$ledger_out" "it-restart"
expect_contains "ledger shows the GPU's reserved bytes" "$ledger_out" "1.0 GiB"
ctl ledger reserve --gpu 0 --bytes 3G --pid "$holder" >/dev/null 2>"$WORK/err"
expect_eq "3 GiB more on a 4 GiB GPU (factor 0.9) does not fit: exit 7" "$?" 7
expect_contains "the refusal says what is available" "$(cat "$WORK/err")" "available"
kill "$holder"
wait "$holder" 2>/dev/null
expect_contains "a dead holder's lease is reclaimed" "$(ctl ledger)" "no reservations"
lease2=$(ctl ledger reserve --gpu "$GPU" --bytes 512M --ttl 60)
expect_contains "release" "$(ctl ledger release "$lease2")" "released"
ctl ledger release "$lease2" >/dev/null 2>&1
expect_eq "releasing it twice: exit 5" "$?" 5

# --- the job ---
sed -e "s|\"it-out\"|\"$WORK/ref\"|" -e 's|max_steps: 40|max_steps: 1000|' \
	-e 's|checkpoint_every: 10|checkpoint_every: 50|' tests/integration/job.txtpb >"$WORK/ref.txtpb"
"$TRAIND" --run "$WORK/ref.txtpb" --quiet >/dev/null
check "the uninterrupted reference run" test -f "$WORK/ref/model.safetensors"

sed -e 's|max_steps: 40|max_steps: 1000|' -e 's|checkpoint_every: 10|checkpoint_every: 50|' \
	tests/integration/job.txtpb >"$WORK/job.txtpb"
id=$(ctl submit "$WORK/job.txtpb" --device any --output "$WORK/out")
has_checkpoint() {
	local j
	j=$(ctl --json show "${1:-$id}")
	[ -n "$(json_field "$j" checkpoint)" ] && [ "$(json_field "$j" state)" = JOB_STATE_RUNNING ]
}
check "the job runs and records a checkpoint" wait_for 60 has_checkpoint
expect_contains "it holds a lease on the simulated GPU" "$(ctl --json ledger)" "\"job_id\": $id"
step=$(json_field "$(ctl --json show "$id")" step)
note "kill -9 at step $step"
check "killed mid-run (step $step of 1000)" test "${step:-0}" -lt 1000
kill9_daemon

start_daemon "${SETTINGS[@]}"
ctl watch "$id" >"$WORK/watch.out"
expect_eq "after the restart the job succeeds" "$?" 0
show_json=$(ctl --json show "$id")
expect_eq "it ran twice in all: once before the kill, once after" "$(json_field "$show_json" attempts)" 2
logs=$(ctl logs "$id")
expect_contains "it was requeued at start" "$logs" "INTERRUPTED"
expect_contains "it resumed from its checkpoint, not from zero" "$logs" "resumed from $WORK/out/checkpoints/step-"
expect_eq "one SUCCEEDED, not two" "$(printf '%s\n' "$logs" | grep -c '→ SUCCEEDED')" 1
check "the weights equal the uninterrupted run's, byte for byte" \
	cmp "$WORK/ref/model.safetensors" "$WORK/out/model.safetensors"
expect_contains "no reservation is left" "$(ctl ledger)" "no reservations"
expect_eq "exactly one job in the queue's history" "$(ctl --json ls --all | grep -c '"id":')" 1

# --- a run that finished with its end unrecorded: the daemon killed after
# the trainer wrote the final model and state but before the job's end
# reached the database (made here by putting the finished run's output in
# place while the daemon is down: the first job's, the same spec's). Resumed, it is recorded as succeeded
# without training again. ---
id2=$(ctl submit "$WORK/job.txtpb" --device any --output "$WORK/out2")
check "a second job runs and records a checkpoint" wait_for 60 has_checkpoint "$id2"
kill9_daemon
cp "$WORK/out/model.safetensors" "$WORK/out/trainer_state.json" "$WORK/out2/"
start_daemon "${SETTINGS[@]}"
check "after the restart it ends" wait_for 60 ended "$id2"
expect_eq "it succeeded" "$(json_field "$(ctl --json show "$id2")" state)" JOB_STATE_SUCCEEDED
logs=$(ctl logs "$id2")
expect_contains "saying the previous run had finished" "$logs" \
	"the previous run finished before the daemon restarted; the model is in $WORK/out2"
expect_eq "recorded once" "$(printf '%s\n' "$logs" | grep -c '→ SUCCEEDED')" 1
expect_eq "two attempts" "$(json_field "$(ctl --json show "$id2")" attempts)" 2
check "its model is the finished run's" cmp "$WORK/out/model.safetensors" "$WORK/out2/model.safetensors"
expect_contains "no reservation is left" "$(ctl ledger)" "no reservations"

# --- a run killed after its last step's checkpoint, before its model was
# written (made here by putting the first job's last checkpoint in place
# while the daemon is down): resumed, it trains no step, writes the model
# and is recorded as succeeded ---
id3=$(ctl submit "$WORK/job.txtpb" --device any --output "$WORK/out3")
check "a third job runs and records a checkpoint" wait_for 60 has_checkpoint "$id3"
kill9_daemon
last=$(ls -d "$WORK/out/checkpoints/step-"* | tail -n 1)
check "the first job kept its last step's checkpoint" test "$(basename "$last")" = step-00001000
cp -r "$last" "$WORK/out3/checkpoints/"
start_daemon "${SETTINGS[@]}"
check "after the restart it ends" wait_for 60 ended "$id3"
expect_eq "it succeeded" "$(json_field "$(ctl --json show "$id3")" state)" JOB_STATE_SUCCEEDED
expect_contains "resumed from the last step's checkpoint" "$(ctl logs "$id3")" \
	"resumed from $WORK/out3/checkpoints/step-00001000"
check "its model is the first job's" cmp "$WORK/out/model.safetensors" "$WORK/out3/model.safetensors"
expect_contains "no reservation is left" "$(ctl ledger)" "no reservations"
stop_daemon
finish
