#!/bin/bash
# Real GPU discovery and placement, end to end: a user-mode traind on a
# temporary state dir lists the host's GPUs (`trainctl info`); a short full
# fine-tune of the qwen2 fixture on the demo JSONL text, submitted with
# device GPU (no CPU fallback), is placed on a real GPU, holds a lease there
# while it runs (plan + the CUDA backend's 36 MiB + cuda_context_mib), runs on
# the CUDA backend, succeeds, and leaves no lease behind. Prints the job's
# tokens/s, and what nvidia-smi says the daemon's process used next to the
# lease (to check the cuda_context_mib allowance). Skips (77) without a GPU.
# Environment as the integration tests (tests/integration/lib.sh).
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1

start_daemon --user --cpu-slots 1
info=$(ctl info)
case "$info" in
*"backends:    cpu cuda"*) ;;
*)
	echo "SKIP: the daemon found no CUDA GPU: $(printf '%s\n' "$info" | grep -e '^no CUDA GPU' -e '^no GPUs' | tr '\n' ' ')"
	exit 77
	;;
esac
printf '%s\n' "$info" | sed -n '/^GPU /,$p'
uuid=$(printf '%s\n' "$info" | awk '$1 ~ /^[0-9]+$/ && $2 ~ /^GPU-/ { print $2; exit }')
check "trainctl info lists a real GPU with its UUID" test -n "$uuid"

fx=$TD_FIXTURES
cat >"$WORK/job.txtpb" <<SPEC
name: "daemon-gpu"
method: METHOD_FULL
model_dir: "$fx/qwen2"
data {
  train_file: "$fx/demo/fortunes.jsonl"
  format: DATA_FORMAT_JSONL
  seq_len: 128
  eos_id: 0
}
hyper { lr: 3e-3 warmup_steps: 5 max_steps: 30 micro_batch: 8 seed: 1 weight_decay: 0.01 }
output { dir: "$WORK/out" checkpoint_every: 10 }
resources { device: DEVICE_GPU allow_cpu: false }
SPEC
id=$(ctl submit "$WORK/job.txtpb")
check "the job is submitted" test -n "$id"

# While it runs: its lease in the ledger, on a GPU the daemon listed.
saw_lease=0 lease_bytes= used=
for _ in $(seq 1 1200); do
	st=$(job_state "$id")
	case $st in SUCCEEDED | FAILED | CANCELLED | INTERRUPTED) break ;; esac
	if [ "$st" = ADMITTED ] || [ "$st" = PREPARING ] || [ "$st" = RUNNING ]; then
		l=$(ctl --json ledger)
		case $l in *"\"job_id\": $id"*)
			saw_lease=1
			lease_bytes=$(printf '%s\n' "$l" | grep -B1 "\"job_id\": $id" | sed -n 's/^ *"bytes": *"\{0,1\}\([0-9]*\)"\{0,1\},\{0,1\}$/\1/p' | head -n 1)
			if command -v nvidia-smi >/dev/null; then
				u=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
					awk -F', *' -v p="$DPID" '$1 == p { print $2 }')
				[ -n "$u" ] && used=$u
			fi
			;;
		esac
	fi
	sleep 0.1
done
expect_eq "the job succeeds" "$(job_state "$id")" SUCCEEDED
logs=$(ctl logs "$id")
has() { printf '%s\n' "$logs" | grep -qF -e "$1"; }
check "it was placed on the real GPU $uuid" has "placed on $uuid"
# The lease: seen in `trainctl ledger` while the job held it, and recorded in
# the job's events (a fast job may end between two looks at the ledger).
check "the job's events record its lease (plan + CUDA backend + context)" \
	grep -qE "placed on $uuid .*: lease [0-9]+ of [0-9.]+ MiB \(plan [0-9.]+ MiB \+ CUDA backend 36.0 MiB \+ context [0-9]+ MiB\)" <<<"$logs"
if [ "$saw_lease" = 1 ]; then note "trainctl ledger showed the job's lease while it ran"; else note "the job ended between two looks at trainctl ledger"; fi
check "it ran on the CUDA backend" has "(cuda backend, CUDA device"
check "the trainer opened the CUDA backend" has "backend cuda ("
ledger_after=$(ctl --json ledger)
case $ledger_after in *"\"job_id\": $id"*) bad "a lease is left after the job: $ledger_after" ;; esac
CHECKS=$((CHECKS + 1))
show=$(ctl --json show "$id")
tps=$(json_field "$show" tokens_per_s)
check "the job reports its tokens/s" test -n "$tps"
printf '%s\n' "$logs" | grep -e "placed on" -e "running on" | sed 's/^/# /'
note "job $id: $(json_field "$show" step) steps, $(printf '%.0f' "${tps:-0}") tokens/s"
printf '%s\n' "$logs" | grep -e "backend cuda (" -e "RUNNING → SUCCEEDED" | sed 's/^/# /'
[ "$FAILS" -eq 0 ] || printf '%s\n' "$logs" | tail -n 30
[ -n "$lease_bytes" ] && note "lease: $lease_bytes bytes"
[ -n "$used" ] && note "nvidia-smi: traind (pid $DPID) used $used MiB during the job"
stop_daemon
finish
