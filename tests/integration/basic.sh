#!/bin/bash
# Submit → watch → SUCCEEDED with the output model, checked against the same
# job run by `traind --run` (bit-identical weights, the same final loss, which
# the TensorBoard file and the daemon's metrics also carry); then ls, show,
# logs, cancel (a running and a queued job), info, ledger and cache, each through
# trainctl, in text and --json.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
TFCHECK=${TFEVENTS_CHECK:?}

# The reference: the job in the foreground, into its own dir.
sed -e "s|\"it-out\"|\"$WORK/ref\"|" tests/integration/job.txtpb >"$WORK/ref.txtpb"
ref_out=$("$TRAIND" --run "$WORK/ref.txtpb" --quiet)
check "traind --run of the reference job" test -f "$WORK/ref/model.safetensors"
ref_loss=$(printf '%s\n' "$ref_out" | sed -n 's/^done: .* -> \([0-9.]*\), model in .*/\1/p')
note "reference: $ref_out"

start_daemon --user --cpu-slots 1

# --- submit, watch ---
# With an eval file: evaluated at each checkpoint (every 10 steps); forward
# only, so the weights stay those of the reference.
id=$(ctl submit tests/integration/job.txtpb --output "$WORK/out1" --eval tests/fixtures/demo/fortunes.tokens)
expect_eq "submit prints the job id" "$id" 1
watch_out=$(ctl watch "$id")
rc=$?
expect_eq "watch exits 0 for a job that succeeded" "$rc" 0
expect_contains "watch's last line" "$(printf '%s\n' "$watch_out" | tail -n 1)" "job 1 SUCCEEDED"
expect_contains "watch prints plain step lines when piped" "$watch_out" "step 40/40"
check "the output model is there" test -f "$WORK/out1/model.safetensors" -a -f "$WORK/out1/config.json"
check "the daemon's model equals traind --run's, byte for byte" \
	cmp "$WORK/ref/model.safetensors" "$WORK/out1/model.safetensors"
check "trainer_state.json says final" grep -q '"final": *true' "$WORK/out1/trainer_state.json"

# --- the numbers: metrics in the database, the TensorBoard file ---
show_json=$(ctl --json show "$id")
expect_eq "show --json: state" "$(json_field "$show_json" state)" JOB_STATE_SUCCEEDED
expect_eq "show --json: step" "$(json_field "$show_json" step)" 40
db_loss=$(printf '%.4f' "$(json_field "$show_json" loss)")
expect_eq "the last loss in the metrics equals traind --run's" "$db_loss" "$ref_loss"
tf=$(ls "$WORK"/out1/runs/events.out.tfevents.* 2>/dev/null | head -n 1)
check "a TensorBoard event file in the output dir" test -n "$tf"
tf_out=$("$TFCHECK" "$tf")
check "the TensorBoard file parses (framing, CRCs, Events)" test $? -eq 0
expect_contains "TensorBoard file: the version, 40 steps, 4 evaluations" "$tf_out" \
	"records=45 first_step=1 last_step=40"
expect_contains "TensorBoard file: the evaluations" "$tf_out" "evals=4"
eval_line=$(ctl logs "$id" | grep -E ' log +eval +40 ' | head -n 1)
log_eval=$(printf '%s\n' "$eval_line" | sed -n 's/.* loss \([0-9.]*\).*/\1/p')
tf_eval=$(printf '%s\n' "$tf_out" | sed -n 's/.*last_eval=\([0-9.]*\).*/\1/p')
check "the trainer's eval line is in the logs ($eval_line)" test -n "$log_eval"
# The log line prints 4 decimals (half a unit: 5e-5) of the float32 that the
# event file holds exactly (its own rounding: 2^-24 of a loss < 10, 6e-7).
check "TensorBoard's eval loss ($tf_eval) is the trainer's ($log_eval)" \
	awk -v a="$tf_eval" -v b="$log_eval" 'BEGIN { d = a - b; exit !(d < 1e-4 && d > -1e-4) }'
expect_contains "the eval loss is in the metrics" "$(ctl --json logs "$id")" "\"eval_loss\""
tf_loss=$(printf '%s\n' "$tf_out" | sed -n 's/.*last_loss=\([0-9.]*\).*/\1/p')
# traind --run prints the loss to 4 decimals: the same bound.
check "TensorBoard's last loss ($tf_loss) matches ($ref_loss) to float precision" \
	awk -v a="$tf_loss" -v b="$ref_loss" 'BEGIN { d = a - b; exit !(d < 1e-4 && d > -1e-4) }'

# --- ls, show, logs ---
ls_out=$(ctl ls)
expect_contains "ls lists the job" "$ls_out" "it-qwen2-tiny"
expect_contains "ls shows its state" "$ls_out" "SUCCEEDED"
expect_contains "ls --json" "$(ctl --json ls)" "\"state\": \"JOB_STATE_SUCCEEDED\""
show_out=$(ctl show "$id")
expect_contains "show: state" "$show_out" "state:       SUCCEEDED"
expect_contains "show: the output dir" "$show_out" "output:      $WORK/out1"
expect_contains "show: the effective spec" "$show_out" "hyper.max_steps: 40"
logs_out=$(ctl logs "$id")
expect_contains "logs: the state changes" "$logs_out" "RUNNING → SUCCEEDED"
expect_contains "logs: the steps" "$logs_out" "step 40/40"
expect_contains "logs: the checkpoints" "$logs_out" "checkpoint at step 40"
expect_contains "logs --json: one object per line" "$(ctl --json logs "$id" | head -n 1)" "\"type\":\"event\""
ctl show 999 >/dev/null 2>"$WORK/err"
expect_eq "show of a job that does not exist: exit 5" "$?" 5
expect_contains "show 999's error" "$(cat "$WORK/err")" "job 999 does not exist"

# --- cancel: a running job and a queued one (one CPU slot) ---
long=$(ctl submit tests/integration/job.txtpb --output "$WORK/long" --steps 100000 --name long)
queued=$(ctl submit tests/integration/job.txtpb --output "$WORK/queued" --name queued)
check "the long job starts" wait_for 30 job_is "$long" RUNNING
expect_eq "the second job waits for the slot" "$(job_state "$queued")" QUEUED
ctl submit tests/integration/job.txtpb --output "$WORK/long" >/dev/null 2>"$WORK/err"
expect_eq "a second job into the same output dir: exit 7" "$?" 7
expect_contains "its error names the job that owns the dir" "$(cat "$WORK/err")" "output of job $long"
cancel_out=$(ctl cancel "$queued")
expect_contains "cancel of a queued job" "$cancel_out" "CANCELLED"
expect_eq "the queued job is CANCELLED at once" "$(job_state "$queued")" CANCELLED
ctl cancel "$long" >/dev/null
ctl watch "$long" >/dev/null
expect_eq "watch exits 6 for a cancelled job" "$?" 6
expect_eq "the running job ends CANCELLED" "$(job_state "$long")" CANCELLED
expect_contains "its reason" "$(ctl show "$long")" "cancelled at step"
ctl cancel "$id" >/dev/null 2>"$WORK/err"
expect_eq "cancel of a finished job: exit 1" "$?" 1
expect_contains "cancel of a finished job says why" "$(cat "$WORK/err")" "SUCCEEDED"

# --- info, ledger (this host has no GPU) ---
info_out=$(ctl info)
expect_contains "info: the mode" "$info_out" "user mode"
expect_contains "info: the queue" "$info_out" "0 running, 0 queued, 1 CPU slot(s)"
expect_contains "info --json" "$(ctl --json info)" "\"cpu_slots\": 1"
expect_contains "ledger without GPUs" "$(ctl ledger)" "no reservations"
ctl ledger reserve --gpu GPU-nope --bytes 1G >/dev/null 2>"$WORK/err"
expect_eq "reserve on a GPU that is not there: exit 5" "$?" 5
expect_contains "its error" "$(cat "$WORK/err")" "no GPU 'GPU-nope' on this host"

# --- the module cache: empty on the CPU; clear removes the cubins in its
# modules dir and nothing else ---
expect_contains "cache: empty, and where" "$(ctl cache)" "0 modules, 0 B, 0 loads from the cache; in $WORK/cache/modules"
expect_contains "cache stats --json" "$(ctl --json cache stats)" "\"count\": 0"
mkdir -p "$WORK/cache/modules"
: >"$WORK/cache/modules/0123abcd.cubin"
: >"$WORK/cache/modules/notes.txt"
expect_contains "cache clear" "$(ctl cache clear)" "module cache cleared: 0 entries, 1 files in $WORK/cache/modules"
check "the cubin is gone" test ! -e "$WORK/cache/modules/0123abcd.cubin"
check "what is not a cubin stays" test -e "$WORK/cache/modules/notes.txt"
ctl cache purge >/dev/null 2>"$WORK/err"
expect_eq "cache: an unknown operation: exit 2" "$?" 2

# --- journald MESSAGE_IDs: 32 hex digits, the same every time ---
mid=$("$TRAIND" --message-id TD-JOB-FAIL)
check "traind --message-id prints 32 hex digits" eval '[[ "$mid" =~ ^[0-9a-f]{32}$ ]]'
expect_eq "and the same one again" "$("$TRAIND" --message-id TD-JOB-FAIL)" "$mid"

stop_daemon
ctl info >/dev/null 2>"$WORK/err"
expect_eq "no daemon at the socket: exit 3" "$?" 3
expect_contains "and the error says how to start one" "$(cat "$WORK/err")" "traind --user"
finish
