#!/bin/bash
# memory.recompute AUTO chooses where the job is placed: the fastest policy
# whose plan the GPU grants (NONE, then SELECTIVE, then FULL).
# 1. A daemon whose one simulated GPU is too small for any plan: the job
#    fails naming its smallest plan; its submit event gives every policy's
#    plan, which sizes the GPUs of:
# 2. A daemon with GPU 1 between SELECTIVE's plan and NONE's, GPU 0 between
#    FULL's and SELECTIVE's (vram_factor 1: a simulated GPU's share is its
#    size). Three jobs submitted together: one goes to GPU 1 with SELECTIVE,
#    one to GPU 0 with FULL, the third waits and runs after them; each says
#    its choice in its events and trains. A policy the spec fixes is kept
#    (NONE, which no GPU can grant, fails); FULL under a bound takes the
#    selective layers that fit. --max-memory bounds the plan at submit; an
#    unknown policy is refused.
# 3. AUTO on FULL takes as many selective layers as the GPU grants (the
#    fixture deepened to four layers), with no pinned host memory to give
#    (pinned_host_max_mib 0), which fails a job that fixes full-offload.
# 4. With pinned host memory, AUTO takes full-offload in full's place: more
#    selective layers in the same GPU bytes.
# 5. Jobs that fix full-offload wait for the pinned host memory others hold.
# 6. So does AUTO where only full-offload's plan fits a GPU.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
JOB=tests/integration/job.txtpb
U0=GPU-00000000-0000-0000-0000-000000000000
U1=GPU-11111111-1111-1111-1111-111111111111

submit() {
	ctl submit "$JOB" --device any --steps 150 --checkpoint-every 0 --output "$WORK/$1" --name "$1" "${@:2}"
}
all_succeeded() {
	for j in "$@"; do job_is "$j" SUCCEEDED || return 1; done
}

# --- 1: no GPU can take even the smallest plan ---
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:4096"
jp=$(submit probe)
check "a job whose smallest plan fits no GPU fails" wait_for 30 job_is "$jp" FAILED
ev=$(ctl logs "$jp")
expect_contains "naming the smallest plan" "$ev" "with its smallest plan"
line=$(printf '%s\n' "$ev" | grep 'plan: [0-9]* bytes with recompute none')
none=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective, \([0-9]*\) full.*/\1/p')
sel=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective, \([0-9]*\) full.*/\2/p')
full=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective, \([0-9]*\) full.*/\3/p')
if [ -z "$none" ] || [ -z "$sel" ] || [ -z "$full" ]; then
	bad "the submit event gives every policy's plan: '$line'"
	finish
	exit 1
fi
note "plans: none $none, selective $sel, full $full bytes"
check "FULL < SELECTIVE < NONE" test "$full" -lt "$sel" -a "$sel" -lt "$none"
stop_daemon

# --- 2: each GPU grants one job, with a different policy ---
rm -rf "$STATE"
g1=$(((sel + none) / 2))
g0=$(((full + sel) / 2))
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:$g0,$U1:$g1"
j1=$(submit a1)
j2=$(submit a2)
j3=$(submit a3)
check "all three finish" wait_for 120 all_succeeded "$j1" "$j2" "$j3"
ev1=$(ctl logs "$j1")
ev2=$(ctl logs "$j2")
expect_contains "job 1 on GPU 1" "$ev1" "placed on $U1"
expect_contains "job 1: AUTO chose selective" "$ev1" "memory.recompute AUTO chose selective"
expect_contains "job 2 on GPU 0" "$ev2" "placed on $U0"
expect_contains "job 2: AUTO chose full" "$ev2" "memory.recompute AUTO chose full"
# and the trainer built that plan (its plan print, in the job's log lines)
expect_contains "job 1 trained with selective" "$ev1" "recompute  selective;"
expect_contains "job 2 trained with full" "$ev2" "recompute  full;"
expect_contains "job 3 waited, then ran" "$(ctl logs "$j3")" "memory.recompute AUTO chose"

# A fixed policy is the user's: NONE fits no GPU here, ever.
jn=$(submit fixed --recompute none)
check "a fixed NONE fails" wait_for 30 job_is "$jn" FAILED
expect_contains "naming what it needs" "$(ctl logs "$jn")" "can ever grant"
# FULL under a bound takes as many selective layers as fit (train/method.c:
# most_selective): at SELECTIVE's bytes, the first of the fixture's two
# layers (its plan then the same size as SELECTIVE's: the last layer's
# products are FULL's working set); the plan the trainer built says so.
js=$(submit selbound --recompute full --max-memory "$sel")
check "FULL under SELECTIVE's bytes trains" wait_for 60 job_is "$js" SUCCEEDED
expect_contains "with its first layer selective" "$(ctl logs "$js")" \
	"recompute  full, the first 1 of 2 layers selective"
# --max-memory: the bound is checked at submit, before anything is queued.
ctl submit "$JOB" --device any --max-memory 1K --output "$WORK/m" >/dev/null 2>"$WORK/err"
expect_eq "a bound below every plan: refused" "$?" 2
expect_contains "naming memory.max_bytes" "$(cat "$WORK/err")" "memory.max_bytes"
ctl submit "$JOB" --device any --recompute sometimes --output "$WORK/m" >/dev/null 2>"$WORK/err"
expect_eq "an unknown policy: exit 2" "$?" 2
expect_contains "naming the flag" "$(cat "$WORK/err")" "--recompute"
stop_daemon

# --- 3: AUTO on FULL adds the selective layers the GPU grants ---
# The fixture deepened to four layers (deepen_model): a GPU halfway between
# FULL's plan and SELECTIVE's grants FULL with some of its first layers
# selective (each adds the layer's kept products; the last layer's are
# FULL's working set, so SELECTIVE is past three), the fastest plan it can;
# the trainer builds the plan the scheduler sized the lease for.
deep="$WORK/deep4"
mkdir -p "$deep"
"$DEEPEN_MODEL" "$TD_FIXTURES/qwen2" "$deep" 4 || bad "deepen_model"
cp "$TD_FIXTURES/qwen2/tokenizer.json" "$TD_FIXTURES/qwen2/generation_config.json" "$deep/"
rm -rf "$STATE"
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:4096"
jp=$(submit probe4 --model "$deep")
check "the deep probe fails" wait_for 30 job_is "$jp" FAILED
line=$(ctl logs "$jp" | grep 'plan: [0-9]* bytes with recompute none')
sel=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective, \([0-9]*\) full.*/\2/p')
full=$(printf '%s\n' "$line" | sed -n 's/.*plan: \([0-9]*\) bytes with recompute none, \([0-9]*\) selective, \([0-9]*\) full.*/\3/p')
stop_daemon
if [ -z "$sel" ] || [ -z "$full" ]; then
	bad "the deep probe gives every policy's plan: '$line'"
	finish
	exit 1
fi
rm -rf "$STATE"
# no pinned host memory (pinned_host_max_mib 0): full-offload is out (4 below)
start_daemon --user --cpu-slots 0 --vram-factor 1 --pinned-host-max-mib 0 \
	--fake-gpus "$U0:$(((full + sel) / 2))"
jd=$(submit deep --model "$deep")
check "the deep job trains" wait_for 60 job_is "$jd" SUCCEEDED
evd=$(ctl logs "$jd")
nsel=$(printf '%s\n' "$evd" | sed -n 's/.*memory.recompute AUTO chose full with its first \([0-9]*\) layers selective.*/\1/p' | head -n 1)
check "AUTO chose full with 1 to 3 selective layers (got '$nsel')" test "${nsel:-0}" -ge 1 -a "${nsel:-0}" -le 3
expect_contains "the trainer built that plan" "$evd" "recompute  full, the first $nsel of 4 layers selective"
# a job that fixes full-offload needs pinned host memory, and there is none
jo=$(submit deep-off --model "$deep" --recompute full-offload)
check "full-offload with no pinned host memory to give fails" wait_for 30 job_is "$jo" FAILED
expect_contains "naming the setting" "$(ctl logs "$jo")" \
	"more than the 0.0 MiB that the pinned_host_max_mib setting lets all running jobs hold together"
# an AUTO job too big for the GPU even with full's plan: full-offload, which
# it may never use here, is not named its smallest
jb=$(submit deep-big --model "$deep" --seq-len 1024)
check "an AUTO job that fits no GPU fails" wait_for 30 job_is "$jb" FAILED
expect_contains "naming full as its smallest usable plan" "$(ctl logs "$jb")" \
	"with its smallest plan (memory.recompute AUTO tried none, selective and full; full-offload pins more host memory than pinned_host_max_mib allows)"
stop_daemon

# --- 4: with pinned host memory, full-offload in full's place ---
# The same GPU and model with the default budget (half of the host's
# memory): full-offload keeps the layers' checkpoints on the host, so the
# bytes full was granted hold more selective layers, the faster plan.
rm -rf "$STATE"
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:$(((full + sel) / 2))"
jd=$(submit deep2 --model "$deep")
check "the deep job trains again" wait_for 60 job_is "$jd" SUCCEEDED
evd=$(ctl logs "$jd")
noff=$(printf '%s\n' "$evd" | sed -n 's/.*memory.recompute AUTO chose full-offload with its first \([0-9]*\) layers selective.*/\1/p' | head -n 1)
nfull=$(printf '%s\n' "$evd" | sed -n 's/.*full-offload rather than full, whose plan the GPU granted with \([0-9]*\) selective layers.*/\1/p' | head -n 1)
check "AUTO chose full-offload with more selective layers ($noff) than full's ($nfull, as in 3: $nsel)" \
	test "${noff:-0}" -gt "${nfull:-9}" -a "${nfull:-x}" = "$nsel"
expect_contains "its pinned host memory said" "$evd" "MiB of pinned host memory"
expect_contains "the trainer built full-offload's plan" "$evd" \
	"recompute  full-offload, the first $noff of 4 layers selective"
stop_daemon

# --- 5: jobs that fix full-offload share the pinned host memory ---
# pinned_host_max_mib 1 and the deep model at 2 x 384 tokens, whose
# full-offload plan pins 768 KiB: one such job at a time runs; the next waits
# for its bytes ("pinned host memory" in show's waiting line), not for the
# GPU, which has room for both, and runs once the first has ended (here,
# cancelled).
rm -rf "$STATE"
start_daemon --user --cpu-slots 0 --vram-factor 1 --pinned-host-max-mib 1 --fake-gpus "$U0:268435456"
p1=$(submit pin1 --model "$deep" --recompute full-offload --seq-len 384 --steps 300)
check "the first pinning job runs" wait_for 30 job_is "$p1" RUNNING
p2=$(submit pin2 --model "$deep" --recompute full-offload --seq-len 384 --steps 20)
pin_waits() { job_is "$p1" RUNNING && ctl show "$p2" | grep -q 'waiting: *pinned host memory: its plan (memory.recompute full-offload) pins 0.8 MiB and the running jobs hold 0.8 of the 1.0 MiB'; }
check "the second waits for pinned host memory while the first runs" wait_for 30 pin_waits
ctl cancel "$p1" >/dev/null
check "once the first has ended (cancelled), the second runs and succeeds" wait_for 60 job_is "$p2" SUCCEEDED
stop_daemon

# --- 6: AUTO waits for pinned host memory where only full-offload fits ---
# The deep model at 2 x 384 and 2 x 424 tokens; their plans from probes that
# fit nowhere. GPU 0 holds one full-offload job at 2 x 424 (848 KiB
# pinned) and nothing beside it; GPU 1 has room for the 2 x 384 job's
# full-offload plan but not full's, and neither GPU for full's at all. An
# AUTO job at 2 x 384 then waits for the pinned bytes (pinned_host_max_mib
# 1) — it does not fail as if no GPU could ever take it — says so, and
# runs once the first job has ended.
plans_of() { # SEQ: "full full-offload pinned" bytes of the deep model's plans
	rm -rf "$STATE"
	start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:4096"
	local j line
	j=$(submit "probe$1" --model "$deep" --seq-len "$1")
	wait_for 30 job_is "$j" FAILED
	line=$(ctl logs "$j" | grep 'plan: [0-9]* bytes with recompute none')
	stop_daemon
	printf '%s\n' "$line" | sed -n 's/.* selective, \([0-9]*\) full, \([0-9]*\) full-offload (and \([0-9]*\) pinned on the host).*/\1 \2 \3/p'
}
read -r f6 o6 h6 <<<"$(plans_of 384)"
read -r f7 o7 h7 <<<"$(plans_of 424)"
check "the plan events give full's and full-offload's plans and pinned bytes ($f6 $o6 $h6; $f7 $o7 $h7)" \
	test -n "$h7" -a "${h6:-0}" -gt 0 -a $(((o6 + f6) / 2)) -lt "${o7:-0}" -a $((o7 + 4096)) -lt "${f6:-0}"
rm -rf "$STATE"
U1=GPU-11111111-1111-1111-1111-111111111111
start_daemon --user --cpu-slots 0 --vram-factor 1 --pinned-host-max-mib 1 \
	--fake-gpus "$U0:$((o7 + 4096)),$U1:$(((o6 + f6) / 2))"
q1=$(submit pin424 --model "$deep" --recompute full-offload --seq-len 424 --steps 300)
check "a full-offload job runs (on GPU 0, the one with room for it)" wait_for 30 job_is "$q1" RUNNING
q2=$(submit auto384 --model "$deep" --seq-len 384 --steps 20)
auto_pin_waits() { job_is "$q1" RUNNING && job_is "$q2" QUEUED && ctl show "$q2" | grep -q "full-offload's plan pins 0.8 MiB of host memory and the running jobs hold 0.8 of the 1.0 MiB"; }
check "the AUTO job waits for the pinned bytes, not failing" wait_for 30 auto_pin_waits
ctl cancel "$q1" >/dev/null
check "then it runs and succeeds" wait_for 60 job_is "$q2" SUCCEEDED
expect_contains "placed by AUTO" "$(ctl logs "$q2")" "memory.recompute AUTO chose"
stop_daemon
finish
