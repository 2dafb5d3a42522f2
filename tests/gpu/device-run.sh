#!/bin/bash
# On the GPU machine: the gpu suite and the training benchmark beside the
# PyTorch peer, in one call. Expects .gpu-run/ (binaries and the CUDA module)
# and .gpu-libs/lib (bundle-libs.sh) in the repo root: tests/gpu/bundle.sh
# makes them.
# usage: tests/gpu/device-run.sh [tests|bench|faults|memory|big32|ddp|profile|preempt|share|attn|overlap|wgmma|gemm|splitk|graphs|ab|all]
# bench: the tokenizer, then Qwen2-0.5B (fp32, bf16, LoRA q,v) and the
# Llama-3-8B shapes' 4 layers (full, LoRA all seven; BENCH_8B=0 skips them)
# beside peer_hf.py and peer_big.py, ending with the README's table
# (tests/bench/bench_table.py); ~8 minutes on an H200.
# ab: the build against another CUDA module (bundle.sh with
# OLD_MODULE=FILE packs FILE as .gpu-run/old-libtraind-cuda.so: a build of
# the commit before, say), in one call: bench_train on $AB_SHAPES (default
# the bench's 8B full and LoRA and Qwen2-0.5B full and LoRA q,v; 8b-full,
# 8b-lora, qwen2-full, qwen2-lora, qwen2-lora-all) with the old and the new
# module in turn, $AB_ROUNDS times (default 2), a line a run (ms a step,
# loss_exact, the SM clock and board power nvidia-smi saw while it was busy),
# then each shape's means and whether every run gave the same loss_exact.
# Not in all.
# attn: attention alone (issue 13): bench_attn (the fused kernels' forward and
# backward, causal, bf16, HS 128 and 64, T 2048 and 8192, after its sanity
# check), again at HS 128 with TD_CUDA_NO_WGMMA=1 (the mma.sync kernels where
# Hopper's wgmma ones would run), beside peer_attn.py (PyTorch SDPA's flash
# backend) on the same shapes, and a ratio line per (T, HS, direction);
# ~3 minutes. Not in all.
# overlap: two GPUs (issue 12) — how much an NCCL all-reduce slows the
# products beside it, on plain memory (NCCL's ring) and on a symmetric
# window (its symmetric kernels); tests/bench/nccl_overlap.cu, compiled here
# with nvcc against the NCCL headers PyTorch ships; ~1 minute. Not in all.
# wgmma: tests/bench/wgmma_probe.cu compiled here for sm_90a and run: Hopper's
# warpgroup products and descriptors checked against the host's double
# products, then flash_wg.cuh's backward and the mma.sync one checked and
# timed side by side; ~1 minute. Not in all.
# gemm: tests/bench/gemm_tune.cu compiled here and run: each bf16 GEMM of
# the Qwen2-0.5B and Llama-3-8B-shaped steps as the backend calls it,
# against every algorithm cuBLASLt's heuristic offers for it (time, and
# whether its bits are the default's), timed cool and at the power cap the
# step holds the device at; then the backend's own timed choice
# (gpu/cuda/cuda_ops.c: lt_tune) A/B'd in the step: bench_train on the
# bench's four shapes with TD_CUDA_NO_GEMM_TUNE=1 and without, in turn,
# twice; ~4 minutes. Not in all.
# big32: all 32 of Llama-3-8B's layers, LoRA r16 on all seven: bench_train
# with recompute full, full-offload (and with its first 7 layers selective)
# and selective beside tests/bench/peer_big32.py
# (torch.compile with gradient checkpointing); ~6 minutes. Not in all.
# preempt: tests/gpu/preempt_gpu.sh alone (also part of tests).
# share: tests/gpu/share_gpu.sh — four Llama-3-8B-shaped LoRA jobs from two
# users sharing one frozen base on GPU 0 (the model dir made on the device),
# the ledger, nvidia-smi with and without sharing, the losses against each
# job alone; ~5 minutes on an H200.
# memory: each recompute policy's tokens/s and peak for Qwen2-0.5B full and
# Llama-3-8B LoRA (all 32 layers), beside peer_big.py (PEFT with and without
# gradient checkpointing); wants the memory of an H200 for the policy NONE.
# Prepare here: see the comment at the end of this file.
set -u -o pipefail  # a failing program before | tail fails the run
what=${1:-all}
root=$(pwd)
export LD_LIBRARY_PATH=$root/.gpu-libs/lib
export TD_CUDA_MODULE=$root/.gpu-run/libtraind-cuda.so
export TD_PROTO_PATH=$root/proto/traind.proto
bin=$root/.gpu-run
fx=$root/tests/fixtures
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
status=0
# bench_train with the process's whole footprint (context included) as
# nvidia-smi sees it, appended to the JSON line; one line to $out/$1.
bench_peak() {
	local file=$1
	shift
	"$bin/bench_train" --backend cuda "$@" >"$out/one.json" &
	local pid=$! peak=0 m
	while kill -0 $pid 2>/dev/null; do
		m=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits |
			awk -F', ' -v p=$pid '$1 == p {print $2}')
		[ -n "$m" ] && [ "$m" -gt "$peak" ] && peak=$m
		sleep 0.2
	done
	wait $pid || status=1
	sed "s/}\$/, \"nvidia_smi_peak_mib\": $peak}/" "$out/one.json" | tee -a "$out/$file"
}
if [ "$what" = ab ]; then
	old=$bin/old-libtraind-cuda.so
	[ -f "$old" ] || { echo "ab: no $old (tests/gpu/bundle.sh with OLD_MODULE=FILE)"; exit 1; }
	rm -f "$out/ab.txt"
	for shape in ${AB_SHAPES:-8b-full 8b-lora qwen2-full qwen2-lora}; do
		case $shape in
		8b-full) args="--shape llama3-8b-4l --batch 4 --seq 2048 --precision bf16 --clip 0" ;;
		8b-lora) args="--shape llama3-8b-4l --batch 4 --seq 2048 --precision bf16 --clip 0 --lora-rank 16 --lora-targets all" ;;
		qwen2-full) args="--shape qwen2-0.5b --precision bf16" ;;
		qwen2-lora) args="--shape qwen2-0.5b --precision bf16 --lora-rank 16 --lora-targets qv" ;;
		qwen2-lora-all) args="--shape qwen2-0.5b --precision bf16 --lora-rank 16 --lora-targets all" ;;
		*) echo "ab: unknown shape $shape"; exit 1 ;;
		esac
		for r in $(seq "${AB_ROUNDS:-2}"); do
			for which in old new; do
				mod=$old
				[ $which = new ] && mod=$TD_CUDA_MODULE
				nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 \
					>"$out/ab-smi.csv" 2>/dev/null &
				smi=$!
				line=$(TD_CUDA_MODULE=$mod "$bin/bench_train" --backend cuda $args --steps 8 --warm 2) ||
					status=1
				kill $smi 2>/dev/null
				wait $smi 2>/dev/null
				ms=$(echo "$line" | grep -o '"ms_per_step": [0-9.]*' | grep -o '[0-9.]*$')
				le=$(echo "$line" | grep -o '"loss_exact": [0-9.e+-]*' | grep -o '[^ ]*$')
				# busy: samples over 200 W (the load and the idle clock left out)
				pw=$(awk -F', ' '$2 + 0 > 200 {n++; c += $1; w += $2}
					END {if (n) printf "%.0f MHz %.0f W", c / n, w / n; else printf "- MHz - W"}' \
					"$out/ab-smi.csv")
				echo "$shape $which ${ms:-?} ms loss_exact ${le:-?} $pw" | tee -a "$out/ab.txt"
			done
		done
	done
	awk '{k = $1 " " $2; s[k] += $3; n[k]++; le[$1] = le[$1] == "" ? $6 : le[$1]; if ($6 != le[$1]) diff[$1] = 1}
		END {for (k in s) {split(k, a, " "); if (a[2] == "old") {o = s[k] / n[k]; nk = a[1] " new";
			if (nk in s) {nw = s[nk] / n[nk]; printf "%s: old %.2f ms, new %.2f ms a step (new/old %.4f); loss_exact %s\n",
				a[1], o, nw, nw / o, diff[a[1]] ? "DIFFERS between runs" : "the same in every run"}}}}' \
		"$out/ab.txt"
	exit $status
fi
if [ "$what" = memory ]; then
	echo "== memory: Qwen2-0.5B full bf16, B8 x T1024, per recompute policy"
	for r in none selective full full-offload; do
		bench_peak bench_memory.jsonl --shape qwen2-0.5b --precision bf16 --recompute $r --steps 6 --warm 2
	done
	# the 8B runs unclipped, as peer_big.py's
	echo "== memory: Llama-3-8B (32 layers) LoRA r16 on all seven, bf16, B4 x T2048"
	for r in ${MEM_POLICIES:-full-offload full selective none}; do
		bench_peak bench_memory.jsonl --shape llama3-8b --lora-rank 16 --lora-targets all \
			--precision bf16 --recompute $r --clip 0 --steps 4 --warm 2
	done
	echo "== memory: Llama-3-8B (32 layers) QLoRA (NF4 base) r16 on all seven, bf16, B4 x T2048"
	for r in ${MEM_QLORA_POLICIES:-full-offload full}; do
		bench_peak bench_memory.jsonl --shape llama3-8b --lora-rank 16 --lora-targets all --qlora \
			--precision bf16 --recompute $r --clip 0 --steps 4 --warm 2
	done
	echo "== memory: peer (PEFT, with and without gradient checkpointing)"
	PYTHONUNBUFFERED=1 RUNS=${PEER_RUNS:-lora-8b-gc,lora-8b} timeout 500 python3 "$root/.gpu-libs/peer_big.py" 2>&1 |
		grep '^{' | tee -a "$out/bench_memory.jsonl"
	exit $status
fi
if [ "$what" = big32 ]; then
	# All 32 of Llama-3-8B's layers (issue 13): LoRA r16 on all seven, bf16,
	# B4 x T2048, no clipping; traind with each recompute policy of
	# $BIG32_POLICIES (default: full full-offload full-offload:7 selective;
	# POLICY:S is POLICY with its first S layers selective,
	# memory.selective_layers: full-offload:7 plans 22.90 GiB, under the
	# peer's 23.39) beside tests/bench/peer_big32.py's torch.compile runs
	# ($PEER32_RUNS, default lora-8b-gc-compile: gradient checkpointing;
	# lora-8b-compile, without, wants an H200). Lines to
	# $out/bench_big32.jsonl.
	rm -f "$out/bench_big32.jsonl"
	for r in ${BIG32_POLICIES:-full full-offload full-offload:7 selective}; do
		sel=0
		case $r in *:*) sel=${r#*:} r=${r%%:*} ;; esac
		bench_peak bench_big32.jsonl --shape llama3-8b --lora-rank 16 --lora-targets all \
			--precision bf16 --recompute $r --selective-layers $sel --clip 0 --steps 4 --warm 2
	done
	PYTHONUNBUFFERED=1 RUNS=${PEER32_RUNS:-lora-8b-gc-compile} timeout 480 \
		python3 "$root/tests/bench/peer_big32.py" 2>&1 | grep '^{' | tee -a "$out/bench_big32.jsonl"
	[ "${PIPESTATUS[0]}" = 0 ] || status=1
	exit $status
fi
if [ "$what" = profile ]; then
	# Where a step's device time goes: TD_CUDA_PROFILE=1 (every op and
	# cuBLAS call timed by events; slower than a plain step) and --phases,
	# for $PROFILE_ARGS (default: Llama-3-8B LoRA r16 all seven,
	# FULL_OFFLOAD); the per-op table to $out/profile.txt. Then the copy
	# engine's pinned bandwidth both ways (what FULL_OFFLOAD's ring uses).
	args=${PROFILE_ARGS:---shape llama3-8b --lora-rank 16 --lora-targets all --precision bf16 --recompute full-offload}
	echo "== profile: bench_train $args"
	TD_CUDA_PROFILE=1 "$bin/bench_train" --backend cuda $args --steps 2 --warm 1 2>"$out/profile.txt" || status=1
	grep -v '^\s*$' "$out/profile.txt" | tail -n 90
	"$bin/bench_train" --backend cuda $args --steps 3 --warm 1 --phases || status=1
	python3 - <<'PY' || true
import torch, time
for mib in (128, 512):
    d = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    h = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    for name, dst, src in (("device->host", h, d), ("host->device", d, h)):
        dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(8):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        print(f"pinned copy {name} {mib} MiB: {8 * (mib << 20) / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
	exit $status
fi
if [ "$what" = ddp ]; then
	# Data parallel on two GPUs (issue 12): tests/gpu/ddp.sh's parts
	# ($DDP_PARTS, default all: curves resume faults daemon shard bench). NCCL is
	# loaded at run time: the host's libnccl.so.2, else PyTorch's
	# (nvidia-nccl-cu13), else $TD_NCCL_LIBRARY as given. Multicast off.
	export NCCL_NVLS_ENABLE=0
	if [ -z "${TD_NCCL_LIBRARY:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2 '; then
		TD_NCCL_LIBRARY=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
		[ -f "$TD_NCCL_LIBRARY" ] || TD_NCCL_LIBRARY=$(find / -name libnccl.so.2 -not -path '/proc/*' 2>/dev/null | head -n 1)
		export TD_NCCL_LIBRARY
	fi
	echo "== NCCL on the first two GPUs: topology, an all-reduce, the bandwidth of ddp's patterns, no hang (nccl_smoke)"
	"$bin/nccl_smoke"
	rc=$?
	[ $rc = 0 ] || [ $rc = 77 ] || status=1
	echo "== data parallel (tests/gpu/ddp.sh ${DDP_PARTS:-all}); NCCL: ${TD_NCCL_LIBRARY:-libnccl.so.2}"
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root BENCH_TRAIN=$bin/bench_train \
		PEER_DIST=$root/.gpu-libs/peer_dist.py OUT=$out bash tests/gpu/ddp.sh ${DDP_PARTS:-} || status=1
	exit $status
fi
if [ "$what" = share ]; then
	echo "== shared frozen base on CUDA: the same bits, the base unchanged (test_base --backend cuda)"
	TD_FIXTURES=$fx "$bin/test_base" --backend cuda | grep -v '^traind\[' || status=1
	echo "== shared frozen base: four Llama-3-8B-shaped LoRA jobs on one GPU (tests/gpu/share_gpu.sh)"
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/share_gpu.sh
	rc=$?
	[ $rc = 0 ] || [ $rc = 77 ] || status=1
	exit $status
fi
if [ "$what" = wgmma ]; then
	# Hopper's warpgroup products probed (issue 13): tests/bench/wgmma_probe.cu,
	# compiled here for sm_90a: its two operand layouts checked against the
	# host's double products, and the rate of its tile product.
	nvcc -O2 -std=c++17 -gencode arch=compute_90a,code=sm_90a tests/bench/wgmma_probe.cu -o "$out/wgmma_probe" ||
		exit 1
	"$out/wgmma_probe" | tee -a "$out/wgmma_probe.jsonl"
	exit $?
fi
if [ "$what" = gemm ]; then
	nvcc -O2 -std=c++17 -arch=native tests/bench/gemm_tune.cu -o "$out/gemm_tune" -lcublasLt -lcublas ||
		exit 1
	"$out/gemm_tune" | tee -a "$out/gemm_tune.jsonl" || status=1
	for args in "--shape qwen2-0.5b" "--shape qwen2-0.5b --lora-rank 16 --lora-targets qv" \
		"--shape llama3-8b-4l --batch 4 --seq 2048" \
		"--shape llama3-8b-4l --batch 4 --seq 2048 --lora-rank 16 --lora-targets all"; do
		for t in 1 0 1 0; do
			echo "TD_CUDA_NO_GEMM_TUNE=$t $args: $(TD_CUDA_NO_GEMM_TUNE=$t "$bin/bench_train" \
				--backend cuda $args --precision bf16 --steps 8 --warm 2 |
				grep -o '"ms_per_step": [0-9.]*\|"used_gib": [0-9.]*\|"loss": [0-9.]*' | tr '\n' ' ')" |
				tee -a "$out/gemm_ab.txt"
		done
	done
	exit $status
fi
if [ "$what" = graphs ]; then
	# What CUDA graphs save against launches on a stream, the way the
	# layer stages record them (tests/bench/graph_probe.cu, compiled here):
	# JSON lines.
	nvcc -O2 -std=c++17 -arch=native tests/bench/graph_probe.cu -o "$out/graph_probe" || exit 1
	"$out/graph_probe" | tee "$out/graphs.jsonl"
	exit $?
fi
if [ "$what" = splitk ]; then
	# Whether splitting k helps the small weight-gradient products
	# (tests/bench/splitk_probe.cu, compiled here): JSON lines.
	nvcc -O2 -std=c++17 -arch=native tests/bench/splitk_probe.cu -o "$out/splitk_probe" -lcublasLt -lcublas ||
		exit 1
	"$out/splitk_probe" | tee "$out/splitk.jsonl"
	exit $?
fi
if [ "$what" = overlap ]; then
	export NCCL_NVLS_ENABLE=0
	nccl=$(python3 -c 'import os, nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)
	if [ -z "$nccl" ] || [ ! -f "$nccl/include/nccl.h" ] || ! command -v nvcc >/dev/null; then
		echo "overlap: needs nvcc and NCCL's headers (PyTorch's nvidia-nccl package)"
		exit 1
	fi
	nvcc -O2 -arch=native -I"$nccl/include" tests/bench/nccl_overlap.cu -o "$out/nccl_overlap" \
		-L"$nccl/lib" -l:libnccl.so.2 -lcublas -Xlinker -rpath="$nccl/lib" || exit 1
	echo "== an all-reduce beside the products, 64 and 16 buckets of 60 MB (2 GPUs)"
	for na in 64 16; do
		"$out/nccl_overlap" 400 $na 60 | tee -a "$out/nccl_overlap.jsonl" || status=1
	done
	exit $status
fi
if [ "$what" = attn ]; then
	echo "== attention alone: traind's fused kernels (bench_attn) beside PyTorch SDPA's flash backend (peer_attn.py)"
	"$bin/bench_attn" | tee "$out/bench_attn.jsonl" || status=1
	# on Hopper, the mma.sync kernels too (HS 128's backward is
	# flash_wg.cuh's wgmma pair there): the two paths side by side
	TD_CUDA_NO_WGMMA=1 "$bin/bench_attn" --hs 128 | grep '^{' | sed 's/"traind-flash"/"traind-flash-mma.sync"/' |
		tee "$out/bench_attn_mma.jsonl" || status=1
	peer=$root/.gpu-libs/peer_attn.py
	[ -f "$peer" ] || peer=$root/tests/bench/peer_attn.py
	PYTHONUNBUFFERED=1 timeout 400 python3 "$peer" | tee "$out/peer_attn.jsonl" || status=1
	python3 - "$out/bench_attn.jsonl" "$out/peer_attn.jsonl" <<'PY' || status=1
import json, sys
def load(path):
    rows = {}
    for line in open(path):
        if line.startswith("{"):
            r = json.loads(line)
            if "error" not in r:
                rows[(r["T"], r["HS"], r["dir"])] = r
    return rows
ours, peer = load(sys.argv[1]), load(sys.argv[2])
if not ours or not peer:
    sys.exit("attn: no lines to compare")
for key in sorted(ours, key=lambda k: (-k[1], k[0], k[2] != "fwd")):
    o, p = ours[key], peer.get(key)
    if not p:
        print(f"ratio T={key[0]} HS={key[1]} {key[2]}: traind {o['tflops']} TFLOP/s, no peer line")
        continue
    print(f"ratio B={o['B']} T={key[0]} NH={o['NH']}/{o['NKV']} HS={key[1]} {key[2]}: traind {o['ms']:.3f} ms "
          f"{o['tflops']:.1f} TFLOP/s, sdpa-flash ({p['gqa']}) {p['ms']:.3f} ms {p['tflops']:.1f} TFLOP/s: "
          f"traind/peer {o['tflops'] / p['tflops']:.2f}x")
PY
	exit $status
fi
if [ "$what" = preempt ]; then
	# Preemption (issue 14): a low-priority GPU job preempted by a
	# high-priority one that cannot fit beside it, resumed bit-identical.
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/preempt_gpu.sh || status=1
	exit $status
fi
if [ "$what" = faults ]; then
	# The device paths that a fault or a resume touch, alone.
	tests/gpu/resume_cuda.sh "$bin/traind" "$fx" || status=1
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/daemon_gpu.sh || status=1
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/fault.sh || status=1
	exit $status
fi
if [ "$what" != bench ]; then
	for f in qwen2 llama qwen3 qwen2-lora qwen2-classify distill; do
		echo "== parity --backend cuda $f"
		"$bin/parity" "$fx/$f" --backend cuda | tail -n 12 || status=1
	done
	for f in qwen2 llama qwen3; do
		echo "== parity --backend cuda --precision bf16 $f"
		"$bin/parity" "$fx/$f" --backend cuda --precision bf16 | tail -n 8 || status=1
	done
	echo "== cuda-ops"
	# Hopper (compute capability 9.0) runs flash_wg.cuh's kernels: there
	# the attention backward's RoPE and roundings must fuse where they can
	cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1)
	wg=0
	[ "$cc" = 9.0 ] && wg=1
	TD_EXPECT_FLASH_WG=$wg "$bin/test_cuda_ops" 2>&1 | grep -E 'rope16|checks,|failed|SKIP' | tail -n 12 || status=1
	echo "== loss curve (100 steps, GPU vs CPU)"
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" fp32 || status=1
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" bf16 || status=1
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" bf16 lora-dropout || status=1
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" bf16 qlora || status=1
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" bf16 distill || status=1
	echo "== recompute: SELECTIVE, FULL and FULL_OFFLOAD against NONE on the CUDA backend, and their curves"
	for prec in fp32 bf16; do
		TD_FIXTURES=$fx "$bin/test_recompute" --backend cuda --precision $prec 2>&1 | tail -n 4 || status=1
	done
	echo "== frozen bases stored in bf16 (and NF4): the CUDA backend against the rounded reference"
	for prec in fp32 bf16; do
		TD_FIXTURES=$fx "$bin/test_frozen" --backend cuda --precision $prec 2>&1 | tail -n 3 || status=1
	done
	for r in selective full full-offload; do
		tests/gpu/loss_curve.sh "$bin/traind" "$fx" bf16 full $r || status=1
		tests/gpu/loss_curve.sh "$bin/traind" "$fx" bf16 lora-dropout $r || status=1
	done
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" fp32 full full || status=1
	tests/gpu/loss_curve.sh "$bin/traind" "$fx" fp32 full full-offload || status=1
	echo "== determinism at the real shapes (head sizes 64 and 128): the same loss twice"
	bash tests/gpu/determinism.sh "$bin/bench_train" || status=1
	echo "== resume on the GPU, compile counter"
	tests/gpu/resume_cuda.sh "$bin/traind" "$fx" || status=1
	echo "== the daemon places a job on the GPU"
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/daemon_gpu.sh || status=1
	echo "== preemption: two GPU jobs that cannot both fit the GPU's ledger share"
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/preempt_gpu.sh || status=1
	if [ -f tests/gpu/modcache.sh ]; then
		echo "== module cache (PTX path forced)"
		bash tests/gpu/modcache.sh "$bin/traind" "$fx" || status=1
		TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/modcache_daemon.sh || status=1
	fi
	echo "== a device fault: the job fails, the other is requeued, the context reset"
	TRAIND=$bin/traind TRAINCTL=$bin/trainctl TD_FIXTURES=$fx TD_SRC=$root bash tests/gpu/fault.sh || status=1
fi
if [ "$what" != tests ]; then
	echo "== bench: tokenizer, one thread, traind vs HF tokenizers (same text, ids compared)"
	tok=$fx/tokenizer/tokenizer.json data=$fx/demo/fortunes.jsonl
	python3 tests/bench/peer_tokenizers.py --tokenizer "$tok" --data "$data" --dump /tmp/hf-ids.bin || status=1
	"$bin/bench_tokenizer" --tokenizer "$tok" --data "$data" --check /tmp/hf-ids.bin || status=1
	echo "== bench: traind"
	rm -f "$out/bench_traind.jsonl" "$out/bench_peer.jsonl" "$out/bench_big.jsonl"
	for args in "--shape qwen2-0.5b" "--shape qwen2-0.5b --precision bf16" \
		"--shape qwen2-0.5b --lora-rank 16 --lora-targets qv --precision bf16"; do
		bench_peak bench_traind.jsonl $args --steps 8 --warm 2
	done
	# the Llama-3-8B shapes (4 of its 32 layers, peer_big.py's): BENCH_8B=0 skips them
	if [ "${BENCH_8B:-1}" != 0 ]; then
		# no clipping: peer_big.py steps AdamW without it (Qwen2's peer_hf.py
		# clips at 1.0, and so do the runs above)
		for args in "--precision bf16" "--lora-rank 16 --lora-targets all --precision bf16"; do
			bench_peak bench_traind.jsonl --shape llama3-8b-4l --batch 4 --seq 2048 $args \
				--clip 0 --steps 6 --warm 2
		done
	fi
	echo "== bench: peer (PyTorch + transformers + PEFT)"
	PYTHONUNBUFFERED=1 ONLY=${PEER_ONLY:-sdpa} OUT=$out timeout 400 python3 "$root/.gpu-libs/peer_hf.py" 2>&1 |
		grep '^{' | tee -a "$out/bench_peer.jsonl"
	if [ "${BENCH_8B:-1}" != 0 ]; then
		PYTHONUNBUFFERED=1 RUNS=full-8b4l,full-8b4l-compile,lora-8b4l,lora-8b4l-compile timeout 400 \
			python3 "$root/.gpu-libs/peer_big.py" 2>&1 | grep '^{' | tee -a "$out/bench_big.jsonl"
	fi
	echo "== bench: the README's table (tests/bench/bench_table.py)"
	python3 tests/bench/bench_table.py "$out" || status=1
fi
exit $status

# Preparing the bundle on the development machine (the build folder is not
# carried; these binaries and the Debian libraries they need are):
#   ninja -C build && tests/gpu/bundle.sh
# and run with carry [".gpu-pack.tar.xz"] and the command
#   tar xJf .gpu-pack.tar.xz; tests/gpu/device-run.sh all
