#!/bin/bash
# Shared frozen bases (issue 11, item 5) through the daemon, on a simulated
# GPU (its jobs run on the CPU backend; vram_factor 1: its share is its size).
# 1. Two LoRA jobs of the same model dir and one with memory.share_base:
#    false, submitted held and released at once, run together: `trainctl
#    ledger --json` shows one shared block with the two sharing jobs' leases
#    as its holders; a sharing lease plus the block is the unshared job's
#    lease (the base in no lease of its own); the GPU's reserved bytes count
#    the block once; when they end the block is gone. Two sharing jobs run to
#    their end (one loads, one attaches) give the adapters of the same jobs
#    with their own bases, byte for byte.
# 2. What does not share: QLoRA (NF4) of the same files, and a copy of the
#    files with one byte changed, each get a block of their own beside two
#    LoRA jobs' one; the share_bases setting 0 makes none.
# 4. On a GPU of two sharing leases, the block and half a block, two
#    sharing jobs run at once; two with their own bases do not (one waits).
# 3. The daemon killed (-9) while two sharing jobs run: at restart their
#    leases and the block are reaped with the dead daemon, the jobs resume
#    and share a new block, and end with none left.
. "$(dirname "$0")/lib.sh"
cd "$TD_SRC" || exit 1
U0=GPU-00000000-0000-0000-0000-00000000000a

spec() { # FILE [EXTRA...]: the integration job as LoRA in fp32, with EXTRA lines
	local f=$1
	shift
	sed -e 's/^method: METHOD_FULL$/method: METHOD_LORA/' \
		-e 's/^  seed: 1$/  seed: 1\n  precision: PRECISION_FP32/' \
		-e 's/^  device: DEVICE_CPU$/  device: DEVICE_GPU/' tests/integration/job.txtpb >"$f"
	printf 'lora { rank: 4 target_modules: ["q_proj", "v_proj", "down_proj"] }\n' >>"$f"
	for x in "$@"; do printf '%s\n' "$x" >>"$f"; done
}
spec "$WORK/lora.txtpb"
spec "$WORK/own.txtpb" "memory { share_base: false }"
# Section 4's: a fixed policy (AUTO would take a smaller plan where NONE's
# does not fit, and the second unshared job would fit).
spec "$WORK/lora-none.txtpb" "memory { recompute: RECOMPUTE_NONE }"
spec "$WORK/own-none.txtpb" "memory { recompute: RECOMPUTE_NONE share_base: false }"
spec "$WORK/qlora.txtpb"
sed -i 's/^method: METHOD_LORA$/method: METHOD_QLORA/' "$WORK/qlora.txtpb"
cp -r tests/fixtures/qwen2 "$WORK/qwen2-mod"
# One byte of the last tensor's data changed in place: a valid file, other bits.
mf="$WORK/qwen2-mod/model.safetensors"
off=$(($(stat -c %s "$mf") - 2))
orig=$(od -An -tu1 -j "$off" -N1 "$mf" | tr -d ' ')
printf "\\$(printf '%03o' $((orig ^ 1)))" | dd of="$mf" bs=1 seek="$off" conv=notrunc status=none
spec "$WORK/mod.txtpb"
sed -i "s|^model_dir: .*|model_dir: \"$WORK/qwen2-mod\"|" "$WORK/mod.txtpb"
check "the copy differs from the fixture" bash -c "! cmp -s tests/fixtures/qwen2/model.safetensors $WORK/qwen2-mod/model.safetensors"

# The ledger's JSON, read with jq.
ledger_json() { ctl --json ledger; }
nblocks() { ledger_json | jq '.shared // [] | length'; }
holders_of_first() { ledger_json | jq -r '.shared[0].lease_ids // [] | map(tostring) | join(" ")'; }
lease_bytes() { ledger_json | jq ".leases[] | select(.id == $1) | .bytes"; }
lease_of_job() { ledger_json | jq ".leases[] | select(.job_id == $1) | .id"; }
block_bytes() { ledger_json | jq '.shared[0].bytes'; }
reserved() { ledger_json | jq '.devices[0].reserved_bytes'; }
two_holders() { [ "$(holders_of_first | wc -w)" = 2 ]; }
cancel_all() { # JOBS...: cancelled, and waited for
	for j in "$@"; do ctl cancel "$j" >/dev/null; done
	for j in "$@"; do wait_for 60 job_is "$j" CANCELLED || bad "job $j did not stop"; done
}

# --- 1: two share, one holds its own ---
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:8G" --tick-ms 200
sub() { # SPEC NAME [STEPS]: held, no checkpoints
	ctl submit "$1" --steps "${3:-100000}" --checkpoint-every 0 --output "$WORK/$2" --name "$2" --hold
}
a=$(sub "$WORK/lora.txtpb" a)
b=$(sub "$WORK/lora.txtpb" b)
oa=$(sub "$WORK/own.txtpb" oa)
for j in "$a" "$b" "$oa"; do ctl release "$j" >/dev/null; done
all_running() { for j in "$a" "$b" "$oa"; do job_is "$j" RUNNING || return 1; done; }
check "the three jobs run at once" wait_for 60 all_running
check "the ledger's shared block has two holders" wait_for 20 two_holders
expect_eq "one shared block" "$(nblocks)" 1
la=$(lease_of_job "$a")
lb=$(lease_of_job "$b")
loa=$(lease_of_job "$oa")
expect_eq "its holders are the sharing jobs' leases" "$(holders_of_first)" "$la $lb"
blk=$(block_bytes)
sl=$(lease_bytes "$la")
ol=$(lease_bytes "$loa")
note "block $blk bytes; leases: shared $sl, own $ol"
check "the block is not empty" test "$blk" -gt 0
expect_eq "a sharing lease + the block = an unshared job's lease" \
	"$(($(lease_bytes "$la") + blk))" "$(lease_bytes "$loa")"
expect_eq "both sharing leases are alike" "$(lease_bytes "$la")" "$(lease_bytes "$lb")"
expect_eq "the GPU's reserved bytes count the block once" "$(reserved)" \
	"$((2 * $(lease_bytes "$la") + $(lease_bytes "$loa") + blk))"
human=$(ctl ledger)
expect_contains "trainctl ledger lists the block" "$human" "base of $TD_SRC/tests/fixtures/qwen2 (lora)"
expect_contains "with its holders" "$human" "$la/$a/"
expect_contains "the placement says so" "$(ctl logs "$b")" "its frozen base"
cancel_all "$a" "$b" "$oa"
expect_eq "no shared block after the last holder" "$(nblocks)" 0
expect_eq "nothing reserved" "$(reserved)" 0

# The same bits: two sharing jobs to their end, against the same jobs with
# their own base.
s1=$(sub "$WORK/lora.txtpb" s1 1000)
s2=$(sub "$WORK/lora.txtpb" s2 1000)
o1=$(sub "$WORK/own.txtpb" o1 1000)
o2=$(sub "$WORK/own.txtpb" o2 1000)
for j in "$s1" "$s2" "$o1" "$o2"; do ctl release "$j" >/dev/null; done
all_done() { for j in "$s1" "$s2" "$o1" "$o2"; do job_is "$j" SUCCEEDED || return 1; done; }
check "the four jobs succeed" wait_for 150 all_done
logs=$(ctl logs "$s1"; ctl logs "$s2")
expect_contains "one of the sharing jobs loaded the base" "$logs" "frozen base: shared (loaded by this job"
expect_contains "the other attached to it" "$logs" "frozen base: shared (attached; 2 jobs on it now)"
for p in "s1 o1" "s2 o2"; do
	set -- $p
	check "job $1's adapter (shared base) is job $2's (its own), byte for byte" \
		cmp "$WORK/$1/adapter_model.safetensors" "$WORK/$2/adapter_model.safetensors"
done
expect_eq "no block after them" "$(nblocks)" 0

# --- 2: another storage, other files, the setting off ---
q=$(sub "$WORK/qlora.txtpb" q)
m=$(sub "$WORK/mod.txtpb" m)
c=$(sub "$WORK/lora.txtpb" c)
c2=$(sub "$WORK/lora.txtpb" c2)
for j in "$q" "$m" "$c" "$c2"; do ctl release "$j" >/dev/null; done
four_running() { for j in "$q" "$m" "$c" "$c2"; do job_is "$j" RUNNING || return 1; done; }
check "QLoRA, modified files and two LoRA jobs run" wait_for 60 four_running
check "... in three blocks: QLoRA's, the modified files', LoRA's" wait_for 20 \
	test "$(ledger_json | jq '[.shared[].lease_ids | length] | sort | map(tostring) | join(",")' -r)" = "1,1,2"
cancel_all "$q" "$m" "$c" "$c2"
expect_eq "no block left" "$(nblocks)" 0
stop_daemon
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:8G" --tick-ms 200 --share-bases 0
d=$(sub "$WORK/lora.txtpb" d)
e=$(sub "$WORK/lora.txtpb" e)
ctl release "$d" >/dev/null && ctl release "$e" >/dev/null
both_running() { job_is "$d" RUNNING && job_is "$e" RUNNING; }
check "share_bases 0: both run" wait_for 60 both_running
expect_eq "share_bases 0: no shared block" "$(nblocks)" 0
expect_eq "share_bases 0: each lease is the whole plan" "$(lease_bytes "$(lease_of_job "$d")")" \
	"$(lease_bytes "$(lease_of_job "$e")")"
cancel_all "$d" "$e"
stop_daemon

# --- 4: a job that attaches fits where its own base would not ---
# recompute NONE (section 1's first placements took it: the leases measured
# there). A simulated GPU of two sharing leases, the block and half a block: two
# sharing jobs fit (2 own + block), two with their own bases do not
# (2 own + 2 blocks), one does.
size=$((2 * sl + blk + blk / 2))
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:$size" --tick-ms 200
h=$(sub "$WORK/lora-none.txtpb" h)
i=$(sub "$WORK/lora-none.txtpb" i)
ctl release "$h" >/dev/null && ctl release "$i" >/dev/null
both_run() { job_is "$h" RUNNING && job_is "$i" RUNNING; }
check "two sharing jobs run on a GPU of $size bytes" wait_for 60 both_run
expect_eq "sharing one block" "$(holders_of_first | wc -w)" 2
cancel_all "$h" "$i"
u=$(sub "$WORK/own-none.txtpb" u)
v=$(sub "$WORK/own-none.txtpb" v)
ctl release "$u" >/dev/null && ctl release "$v" >/dev/null
one_runs() { job_is "$u" RUNNING || job_is "$v" RUNNING; }
check "with their own bases one of them runs" wait_for 60 one_runs
sleep 1
if job_is "$u" RUNNING; then waiting=$v; else waiting=$u; fi
expect_eq "and the other waits" "$(job_state "$waiting")" QUEUED
expect_contains "saying why" "$(ctl show "$waiting")" "waiting"
cancel_all "$u" "$v"
stop_daemon

# --- 3: a restart reconciles ---
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:8G" --tick-ms 200
subl() { ctl submit "$1" --steps 100000 --checkpoint-every 50 --output "$WORK/$2" --name "$2" --hold; }
f=$(subl "$WORK/lora.txtpb" f)
g=$(subl "$WORK/lora.txtpb" g)
ctl release "$f" >/dev/null && ctl release "$g" >/dev/null
check "two sharing jobs hold one block" wait_for 60 two_holders
kill9_daemon
start_daemon --user --cpu-slots 0 --vram-factor 1 --fake-gpus "$U0:8G" --tick-ms 200
check "after the restart they share one block again" wait_for 60 two_holders
expect_eq "one block, not the dead daemon's too" "$(nblocks)" 1
cancel_all "$f" "$g"
expect_eq "no block left" "$(nblocks)" 0
expect_eq "nothing reserved at the end" "$(reserved)" 0
stop_daemon
finish
