#!/bin/bash
# Shared frozen bases on one GPU (issue 11, item 5; tests/gpu/device-run.sh
# share). A Llama-3-8B-shaped model dir with random bf16 weights is made on
# the device (tests/gpu/gen_llama.py; $SHARE_MODEL, kept for the next run),
# then the daemon on GPU 0:
#  1. share on: four LoRA r16 jobs on all seven projections, B4 x T2048,
#     $STEPS steps, memory.recompute AUTO bounded by memory.max_bytes 24 GiB
#     (the least recompute whose plan fits: FULL), from two users (two
#     users made here when run as root, else the caller twice), submitted
#     held and released at once, run at once: `trainctl ledger --json`
#     (sampled every second) shows one shared block, the frozen base, with
#     the four leases as its holders, each lease the job's plan less the
#     base; the GPU's use (nvidia-smi) never exceeds what the ledger holds
#     (no job over its lease). A fifth job (its own base, recompute NONE,
#     B5) that cannot fit beside them waits in the queue, saying why (where
#     the GPU could never hold it, it fails at once, naming the bytes).
#  2. share off (share_bases 0): the same four jobs; the GPU's peak use
#     (nvidia-smi) rises by three copies of the base (the block's bytes,
#     within 512 MiB: each job's own allocations are its plan, the same in
#     both runs, contract 1; the rest is the VMM's 2 MiB rounding, nvidia-smi's
#     MiB and what cuBLAS loads lazily). Where the GPU cannot hold four
#     unshared jobs (an H100) they run as it admits them and the drop is
#     reported, not checked.
#  3. each user's job alone (its own base, nothing beside it): its losses
#     are, step for step, those of the same job in 1 (shared) and 2.
# Prints one JSON line (SHARE_JSON) with the numbers. Skips (77) without a
# GPU. Environment as the integration tests (tests/integration/lib.sh).
if ! nvidia-smi -L >/dev/null 2>&1; then
	echo "SKIP: no NVIDIA GPU"
	exit 77
fi
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1
# The daemon's only GPU is nvidia-smi's GPU 0 (the one whose use is read
# below), on a host of any number.
export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0
STEPS=${STEPS:-8}
MODEL=${SHARE_MODEL:-/tmp/td-llama8b-rand}
SEQ=${SHARE_SEQ:-2048}           # a dry run elsewhere: shorter
DARGS=${SHARE_DAEMON_ARGS:-}     # a dry run elsewhere: --fake-gpus ...
# SHARE_HYPER: more of the hyper section (a dry run on a simulated GPU:
# "precision: PRECISION_FP32", the CPU backend's)
GiB=$((1 << 30))

if [ ! -s "$MODEL/model.safetensors" ] || [ ! -s "$MODEL/data.tokens" ]; then
	echo "== generating $MODEL (random bf16 weights)"
	python3 tests/gpu/gen_llama.py "$MODEL" || exit 1
fi
chmod -R a+rX "$MODEL"

# JSON from stdin: py EXPR (d is the document).
py() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# Two users where we may make them; else the caller is both.
if [ "$(id -u)" = 0 ] && command -v useradd >/dev/null && command -v setpriv >/dev/null; then
	A=tdsha$$
	B=tdshb$$
	extra_cleanup() {
		userdel "$A" 2>/dev/null
		userdel "$B" 2>/dev/null
	}
	useradd -M -U -s /bin/false "$A" && useradd -M -U -s /bin/false "$B" || exit 1
	share_with_users || exit 1
	MODE=--system
	# The users run trainctl from $WORK: the libraries it takes from the
	# bundle (which may sit where they cannot enter) are copied beside it,
	# and they submit binary specs, encoded here (no protoc of theirs).
	mkdir -p "$WORK/shared/lib"
	if [ -n "${LD_LIBRARY_PATH:-}" ]; then
		ldd "$TRAINCTL" | awk '$3 ~ /^\// {print $3}' | while read -r l; do
			case "$l" in "${LD_LIBRARY_PATH%%:*}"/*) cp -L "$l" "$WORK/shared/lib/" ;; esac
		done
	fi
	chmod -R a+rX "$WORK/shared"
	ctlu() {
		local u=$1
		shift
		as_user "$u" env LD_LIBRARY_PATH="$WORK/shared/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
			"$UCTL" --socket "$SOCK" "$@"
	}
	ENCODE=1
else
	A=$(id -un)
	B=$A
	MODE=--user
	ENCODE=0
	mkdir -p "$WORK/shared"
	ctlu() { shift; ctl "$@"; }
	note "not root: one user submits all the jobs"
fi
for u in "$A" "$B"; do
	mkdir -p "$WORK/out-$u"
	[ "$(id -u)" = 0 ] && chown "$u:$u" "$WORK/out-$u"
done

# job FILE USER NAME SEED [MEMORY [MICRO_BATCH]]: a job file readable by
# every user; MEMORY: the memory section (AUTO bounded by 24 GiB by default).
job() {
	local mem=${5:-} mb=${6:-4}
	[ -n "$mem" ] || mem="memory { max_bytes: $((24 * GiB)) }"
	cat >"$WORK/shared/$1.txtpb" <<SPEC
name: "$3"
method: METHOD_LORA
model_dir: "$MODEL"
data { train_file: "$MODEL/data.tokens" format: DATA_FORMAT_TOKENS seq_len: $SEQ }
hyper { lr: 1e-4 max_steps: $STEPS micro_batch: $mb seed: $4 ${SHARE_HYPER:-}}
lora { rank: 16 alpha: 32 target_modules: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] }
$mem
output { dir: "$WORK/out-$2/$3" checkpoint_every: 0 }
resources { device: DEVICE_GPU }
SPEC
	chmod a+r "$WORK/shared/$1.txtpb"
}
# submit USER NAME SEED [MEMORY [MICRO_BATCH]]: held; prints the id.
submit() {
	job "$2" "$1" "$2" "$3" "${4:-}" "${5:-}"
	local f=$WORK/shared/$2.txtpb pp=${TD_PROTO_PATH:-$TD_SRC/proto/traind.proto}
	if [ "$ENCODE" = 1 ]; then
		"${TD_PROTOC:-protoc}" --encode=traind.JobSpec --proto_path="$(dirname "$pp")" \
			"$(basename "$pp")" <"$f" >"${f%.txtpb}.pb" || return 1
		f=${f%.txtpb}.pb
		chmod a+r "$f"
	fi
	ctlu "$1" submit "$f" --hold
}
release() { ctl release "$1" >/dev/null; } # the daemon's own user is an admin (root) or the owner
losses() { # JOB: "step loss" lines, the loss in full (json-c prints %.17g)
	ctl --json logs "$1" | python3 -c '
import json, sys
for l in sys.stdin:
    o = json.loads(l)
    if o.get("type") == "metric" and "loss" in o:
        print(o["step"], repr(o["loss"]))'
}
used_mib() { nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits | head -n 1; }
total_mib=$(nvidia-smi -i 0 --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
note "GPU 0: $total_mib MiB; $STEPS steps a job; users $A and $B"

# sample OUT JOBS...: every second while any of JOBS is not over, the GPU's
# use and the ledger, one line each: used_MiB reserved_bytes blocks
# most_holders running_jobs
sample() {
	local f=$1
	shift
	: >"$f"
	while :; do
		local any=0 run=0
		for j in "$@"; do
			case "$(job_state "$j")" in
			QUEUED | ADMITTED | PREPARING) any=1 ;;
			RUNNING) any=1 run=$((run + 1)) ;;
			esac
		done
		[ $any = 1 ] || break
		local l u
		l=$(ctl --json ledger 2>/dev/null)
		u=$(used_mib)
		printf '%s %s\n' "$u" "$(printf '%s' "$l" | py '" ".join([str(d["devices"][0].get("reserved_bytes", 0)), str(len(d.get("shared", []))), str(max([len(b.get("lease_ids", [])) for b in d.get("shared", [])] + [0]))])')" "$run" >>"$f"
		sleep 1
	done
}
# wait_all SECONDS STATE JOBS...: until every job is in STATE; fails at
# once where one ended otherwise (no device time spent waiting on a
# failure), printing its reason.
wait_all() {
	local secs=$1 want=$2
	shift 2
	for _ in $(seq 1 $((secs * 2))); do
		local all=1
		for j in "$@"; do
			local st
			st=$(job_state "$j")
			[ "$st" = "$want" ] && continue
			all=0
			case "$st" in SUCCEEDED | FAILED | CANCELLED)
				echo "# job $j is $st: $(ctl show "$j" | grep -i -m1 reason)"
				return 1 ;;
			esac
		done
		[ $all = 1 ] && return 0
		sleep 0.5
	done
	return 1
}

# --- 1: four jobs share one base; a fifth waits ---
start_daemon $MODE --cpu-slots 0 --tick-ms 500 $DARGS
j1=$(submit "$A" a1 1)
j2=$(submit "$A" a2 1)
j3=$(submit "$B" b1 2)
j4=$(submit "$B" b2 2)
j5=$(submit "$A" big 3 "memory { recompute: RECOMPUTE_NONE share_base: false }" 5)
for j in "$j1" "$j2" "$j3" "$j4"; do release "$j"; done
sample "$WORK/on.samples" "$j1" "$j2" "$j3" "$j4" &
SPID=$!
check "share on: the four jobs run at once" wait_all 600 RUNNING "$j1" "$j2" "$j3" "$j4"
led=$(ctl --json ledger)
nb=$(printf '%s' "$led" | py 'len(d.get("shared", []))')
expect_eq "share on: one shared block in the ledger" "$nb" 1
blk=$(printf '%s' "$led" | py 'd["shared"][0]["bytes"] if d.get("shared") else 0')
holders=$(printf '%s' "$led" | py '" ".join(str(j) for j in sorted(d["shared"][0].get("job_ids", []))) if d.get("shared") else ""')
expect_eq "share on: its holders are the four jobs" "$holders" "$(printf '%s\n' "$j1" "$j2" "$j3" "$j4" | sort -n | tr '\n' ' ' | sed 's/ $//')"
ctl ledger
release "$j5"
sleep 8
st5=$(job_state "$j5")
if [ "$st5" = QUEUED ]; then
	expect_contains "the fifth waits, saying why" "$(ctl show "$j5")" "waiting"
	note "fifth job: $(ctl show "$j5" | grep -i waiting | head -n 1)"
else
	expect_eq "the fifth, which no GPU of this host can hold, fails at once" "$st5" FAILED
	note "fifth job: $(ctl show "$j5" | grep -i reason | head -n 1)"
fi
ctl cancel "$j5" >/dev/null 2>&1
check "share on: the four jobs succeed" wait_all 900 SUCCEEDED "$j1" "$j2" "$j3" "$j4"
wait "$SPID"
on_peak=$(sort -n "$WORK/on.samples" | tail -n 1 | cut -d' ' -f1)
over=$(awk '$2 > 0 && $1 * 1048576 > $2 {n++} END {print n + 0}' "$WORK/on.samples")
expect_eq "share on: the GPU's use never above the ledger's reservations" "$over" 0
maxh=$(sort -n -k4 "$WORK/on.samples" | tail -n 1 | cut -d' ' -f4)
expect_eq "share on: the block had four holders at once" "$maxh" 4
for j in "$j1" "$j2" "$j3" "$j4"; do losses "$j" >"$WORK/on.$j.loss"; done
stop_daemon

# --- 2: the same four with share_bases 0 ---
start_daemon $MODE --cpu-slots 0 --tick-ms 500 $DARGS --share-bases 0
k1=$(submit "$A" a1-own 1)
k2=$(submit "$A" a2-own 1)
k3=$(submit "$B" b1-own 2)
k4=$(submit "$B" b2-own 2)
for j in "$k1" "$k2" "$k3" "$k4"; do release "$j"; done
sample "$WORK/off.samples" "$k1" "$k2" "$k3" "$k4" &
SPID=$!
check "share off: the four jobs succeed" wait_all 900 SUCCEEDED "$k1" "$k2" "$k3" "$k4"
wait "$SPID"
off_peak=$(sort -n "$WORK/off.samples" | tail -n 1 | cut -d' ' -f1)
off_blocks=$(sort -n -k3 "$WORK/off.samples" | tail -n 1 | cut -d' ' -f3)
expect_eq "share off: no shared block" "${off_blocks:-0}" 0
for j in "$k1" "$k2" "$k3" "$k4"; do losses "$j" >"$WORK/off.$j.loss"; done
drop=$((off_peak - on_peak))
want=$((3 * blk / 1048576))
four_fit=$(sort -n -k5 "$WORK/off.samples" | tail -n 1 | awk '{print ($5 == 4)}')
note "nvidia-smi peak: shared $on_peak MiB, unshared $off_peak MiB: drop $drop MiB; three bases $want MiB"
if [ "$four_fit" = 1 ]; then
	check "the drop is three copies of the base (within 512 MiB)" \
		test $((drop > want ? drop - want : want - drop)) -le 512
fi
stop_daemon

# --- 3: each user's job alone ---
start_daemon $MODE --cpu-slots 0 --tick-ms 500 $DARGS
l1=$(submit "$A" a-alone 1 "memory { max_bytes: $((24 * GiB)) share_base: false }")
release "$l1"
check "user A's job alone succeeds" wait_all 600 SUCCEEDED "$l1"
l2=$(submit "$B" b-alone 2 "memory { max_bytes: $((24 * GiB)) share_base: false }")
release "$l2"
check "user B's job alone succeeds" wait_all 600 SUCCEEDED "$l2"
losses "$l1" >"$WORK/alone.A.loss"
losses "$l2" >"$WORK/alone.B.loss"
stop_daemon
check "the alone runs logged $STEPS losses" test "$(wc -l <"$WORK/alone.A.loss")" = "$STEPS"
for p in "$j1 A" "$j2 A" "$j3 B" "$j4 B"; do
	set -- $p
	check "job $1 (shared base): its losses are its job's alone" cmp "$WORK/on.$1.loss" "$WORK/alone.$2.loss"
done
for p in "$k1 A" "$k2 A" "$k3 B" "$k4 B"; do
	set -- $p
	check "job $1 (own base, beside three): its losses are its job's alone" cmp "$WORK/off.$1.loss" "$WORK/alone.$2.loss"
done
echo "SHARE_JSON {\"gpu_mib\": $total_mib, \"steps\": $STEPS, \"base_bytes\": $blk, \"peak_shared_mib\": $on_peak, \"peak_unshared_mib\": $off_peak, \"drop_mib\": $drop, \"three_bases_mib\": $want, \"losses_A\": \"$(tr '\n' ' ' <"$WORK/alone.A.loss")\"}"
finish
