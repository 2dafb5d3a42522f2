#!/bin/bash
# Preemption on a GPU (issue 14, item 1): two GPU jobs that cannot both fit
# one GPU's ledger share. The share is shrunk as an admin would for a test:
# vram_factor 0.05 and a cuda_context_mib that makes one job's lease 60% of
# the share (on a real GPU: lease = plan + the CUDA backend's 36 MiB +
# cuda_context_mib), so a second lease never fits beside the first.
#  - an uninterrupted run of the low-priority job's spec, alone: the
#    reference model;
#  - preempt = off: a low-priority job runs, the high-priority one waits (on
#    the GPU held for it); the running job is not stopped;
#  - preempt = priority (SIGHUP): a low-priority job checkpoints at its
#    next step, its lease is released and it goes back to the queue with a
#    reason naming the preemptor; the high-priority job is placed on that GPU
#    (its event names the job it preempted), finishes; the first resumes from
#    its checkpoint and its final model equals the reference byte for byte;
#    no lease is left.
# PREEMPT_BACKEND=fake runs the same on a simulated GPU (the CPU backend,
# the ledger and the scheduler's GPU path: it-preempt-fake in the integration
# suite), and then a gang of two simulated GPUs preempted whole by a job of
# one; otherwise it needs a CUDA GPU and skips (77) without one.
# Environment as the integration tests (tests/integration/lib.sh).
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1
# One GPU (the first visible, else 0): the scenario is two jobs on the
# same device, which a host of several GPUs would place apart (on two H100s
# the high-priority job ran on the second GPU instead of preempting).
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*}
fake=0 PREC=
# A simulated GPU's jobs run on the CPU backend: fp32 (a real GPU's default
# is bf16, left as it is).
[ "${PREEMPT_BACKEND:-cuda}" = fake ] && fake=1 PREC="precision: PRECISION_FP32 "

fx=$TD_FIXTURES
# job NAME STEPS PRIORITY [GPUS]: a job file for the GPU only (no CPU
# fallback); a gang of GPUS shares grad_accum GPUS micro-batches a step.
job() {
	local g=${4:-1} acc= res=
	[ "$g" -gt 1 ] && acc="grad_accum: $g " res="gpus: $g "
	cat >"$WORK/$1.txtpb" <<SPEC
name: "preempt-$1"
method: METHOD_FULL
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }
hyper { lr: 3e-3 warmup_steps: 5 max_steps: $2 micro_batch: 2 seed: 1 weight_decay: 0.01 clip_norm: 1.0 $acc$PREC}
memory { recompute: RECOMPUTE_NONE }
output { dir: "$WORK/$1" checkpoint_every: 1000000 }
resources { device: DEVICE_GPU allow_cpu: false priority: $3 $res}
SPEC
	ctl submit "$WORK/$1.txtpb"
}

CONF=$WORK/traind.conf
if [ $fake = 1 ]; then
	# The simulated GPU's share (0.9 of it) fits one plan, not two.
	printf 'name: "p"\nmodel_dir: "%s/qwen2"\ndata { train_file: "%s/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }\nhyper { max_steps: 1 micro_batch: 2 }\nmemory { recompute: RECOMPUTE_NONE }\noutput { dir: "%s/p" }\n' \
		"$fx" "$fx" "$WORK" >"$WORK/p.txtpb"
	plan=$("$TRAIND" --plan "$WORK/p.txtpb" | sed -n 's/^total .*(\([0-9]*\) bytes).*/\1/p')
	check "traind --plan gives the plan's bytes" test -n "$plan"
	size=$((plan * 3 / 2 * 10 / 9 + 1))
	note "plan $plan bytes; a simulated GPU of $size bytes (share $((size * 9 / 10)))"
	STEPS=${STEPS:-600}
	printf 'cpu_slots = 0\n' >"$CONF"
	start_daemon --user --config "$CONF" --fake-gpus "GPU-fake-0:$size"
	uuid=GPU-fake-0
else
	STEPS=${STEPS:-3000}
	printf 'cpu_slots = 0\n' >"$CONF"
	start_daemon --user --config "$CONF"
	info=$(ctl info)
	case "$info" in
	*"backends:    cpu cuda"*) ;;
	*)
		echo "SKIP: the daemon found no CUDA GPU"
		exit 77
		;;
	esac
	js=$(ctl --json info)
	uuid=$(json_field "$js" uuid)
	total=$(json_field "$js" total_bytes)
	check "trainctl info gives the first GPU's total memory" test -n "$total"
	# share = total x 0.05; a lease of 60% of it: plan (a few MiB) + 36 MiB +
	# cuda_context_mib.
	share_mib=$((total / 20 / 1048576))
	ctx=$((share_mib * 6 / 10 - 36))
	note "GPU $uuid: $total bytes; share $share_mib MiB; cuda_context_mib $ctx"
	printf 'cpu_slots = 0\nvram_factor = 0.05\ncuda_context_mib = %d\n' "$ctx" >"$CONF"
	reload_daemon
fi
placed() { ctl logs "$1" | grep -q "placed on $uuid"; }
ended() { case $(job_state "$1") in SUCCEEDED | FAILED | CANCELLED) return 0 ;; esac; return 1; }
lease_of() { ctl --json ledger | grep -c "\"job_id\": $1"; }
running_past() { job_is "$1" RUNNING && [ "$(json_field "$(ctl --json show "$1")" step)" -ge "$2" ] 2>/dev/null; }

# --- the reference: the low-priority job's spec, alone ---
ref=$(job ref "$STEPS" 0)
wait_for 600 ended "$ref"
expect_eq "the reference run succeeds" "$(job_state "$ref")" SUCCEEDED
job_is "$ref" SUCCEEDED || ctl show "$ref" | head -n 20
check "it was placed on $uuid" placed "$ref"

# --- off: the second job waits ---
# On a job that runs far longer than this part takes (cancelled at its end):
# nothing here depends on how fast the GPU steps.
G=$(job G 1000000 0)
check "a low-priority job runs" wait_for 120 running_past "$G" 5
expect_eq "it holds one lease" "$(lease_of "$G")" 1
high=$(job high 40 10)
sleep 2.5
expect_eq "preempt = off: the low-priority job runs on" "$(job_state "$G")" RUNNING
expect_eq "the high-priority job waits" "$(job_state "$high")" QUEUED
expect_contains "for its GPU, held for it" "$(ctl show "$high")" "held for it until they drain"
ctl hold "$high" >/dev/null
ctl cancel "$G" >/dev/null
check "the long job is cancelled" wait_for 60 job_is "$G" CANCELLED

# --- priority: the low-priority job is preempted as soon as it steps ---
printf 'preempt = priority\n' >>"$CONF"
reload_daemon
low=$(job low "$STEPS" 0)
check "the low-priority job runs" wait_for 120 running_past "$low" 5
ctl release "$high" >/dev/null
preempted() { ! job_is "$low" RUNNING && ctl logs "$low" | grep -q "preempted by job $high"; }
check "preempt = priority: the low-priority job is preempted" wait_for 60 preempted
check "the high-priority job is placed on $uuid" wait_for 60 placed "$high"
logs_low=$(ctl logs "$low")
expect_contains "its event names the preemptor" "$logs_low" "preempted by job $high (user $(id -un), priority 10), which needs GPU 0"
expect_contains "the preemptor's names it" "$(ctl logs "$high")" "preempted job $low (user $(id -un), priority 0) to make room on GPU 0"
check "the high-priority job succeeds" wait_for 300 job_is "$high" SUCCEEDED
check "the low-priority job resumes and succeeds" wait_for 600 job_is "$low" SUCCEEDED
logs_low=$(ctl logs "$low")
expect_contains "it went back to the queue" "$logs_low" "INTERRUPTED → QUEUED: preempted by job $high"
expect_contains "it resumed from its checkpoint" "$logs_low" "resumed from $WORK/low/checkpoints/step-"
expect_eq "two attempts" "$(json_field "$(ctl --json show "$low")" attempts)" 2
# The preemptor was placed after the victim stopped (its leases released
# then) and before the victim was placed again: event ids are one sequence
# across jobs.
seq_of() { ctl --json logs "$1" | grep -F -e "$2" | sed -n "${3:-1}s/.*\"seq\": *\"\{0,1\}\([0-9]*\).*/\1/p"; }
s_stop=$(seq_of "$low" "RUNNING → INTERRUPTED")
s_high=$(seq_of "$high" "QUEUED → ADMITTED")
s_back=$(seq_of "$low" "QUEUED → ADMITTED" 2)
note "events: low stopped $s_stop, high placed $s_high, low placed again $s_back"
check "the preemptor was placed between the victim's stop and its return" \
	test "${s_stop:-0}" -gt 0 -a "${s_high:-0}" -gt "${s_stop:-0}" -a "${s_back:-0}" -gt "${s_high:-0}"
check "the final model equals the uninterrupted run's, byte for byte" \
	cmp "$WORK/ref/model.safetensors" "$WORK/low/model.safetensors"
expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
printf '%s\n' "$logs_low" | grep -e "placed on" -e "preempted" -e "resumed" | sed 's/^/# /'
stop_daemon

# --- simulated GPUs only: a gang is preempted whole ---
# Two simulated GPUs of 1.5 plans each; a gang of 2 (a lease on each) runs;
# a job of one GPU fits beside it on neither: the gang is preempted whole
# (both leases released, never one), the job runs on GPU 0, the gang resumes
# on both and its model equals an uninterrupted gang's byte for byte.
if [ $fake = 1 ]; then
	start_daemon --user --config "$CONF" --fake-gpus "GPU-fake-0:$size,GPU-fake-1:$size"
	GSTEPS=${GSTEPS:-300}
	gref=$(job gref "$GSTEPS" 0 2)
	wait_for 600 ended "$gref"
	expect_eq "the uninterrupted gang succeeds" "$(job_state "$gref")" SUCCEEDED
	gang=$(job gang "$GSTEPS" 0 2)
	check "the gang runs" wait_for 120 running_past "$gang" 5
	expect_eq "it holds a lease on each GPU" "$(lease_of "$gang")" 2
	one=$(job one 400 10) # long enough to be running when the gang's leases are read
	gang_preempted() { ! job_is "$gang" RUNNING && ctl logs "$gang" | grep -q "preempted by job $one"; }
	check "the job of one GPU preempts the gang" wait_for 60 gang_preempted
	check "and is placed on GPU 0" wait_for 60 placed "$one"
	expect_eq "the gang holds no lease while it waits" "$(lease_of "$gang")" 0
	expect_contains "the preemptor's event names the gang once" "$(ctl logs "$one")" "preempted job $gang (user $(id -un), priority 0) to make room on GPU 0"
	check "the job of one GPU succeeds" wait_for 300 job_is "$one" SUCCEEDED
	wait_for 600 ended "$gang"
	expect_eq "the gang resumes and succeeds" "$(job_state "$gang")" SUCCEEDED
	expect_contains "on both GPUs again" "$(ctl logs "$gang" | grep 'placed on a gang' | tail -n 1)" "GPU 0+1"
	check "its model equals the uninterrupted gang's, byte for byte" \
		cmp "$WORK/gref/model.safetensors" "$WORK/gang/model.safetensors"
	expect_contains "no lease is left" "$(ctl ledger)" "no reservations"
	stop_daemon
fi
finish
