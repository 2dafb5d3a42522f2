#!/bin/bash
# The CUDA backend is deterministic at the shapes that take Hopper's and the
# mma.sync kernels (issue 13): the same bench_train run twice gives the same
# loss to the last bit (printed with 17 digits: "loss_exact"), at head size
# 64 (Qwen2-0.5B's shape, full fine-tune) and 128 (Llama-3-8B's, 4 layers:
# the full fine-tune and LoRA on all seven). The loss after three steps
# reads every weight the first two updated, so a race in any op of the
# forward, the backward or AdamW shows in it. The fixtures' parity and curve
# tests run head size 16, which takes none of the fused kernels at 64 or
# 128; this test is what catches an ordering bug there (one such, a dQ
# kernel reading d(y) while another block wrote the q, k, v gradients'
# operand over it, changed the 8B shapes' loss from run to run).
# The layer stages run as CUDA graphs from their third call (train/model.c:
# STAGED), so five steps take graphs in three forwards and backwards: a
# third run with TD_CUDA_NO_GRAPHS=1 (every op launched as it comes) must
# give the same bits too, and the first must have launched graphs
# ("graph_launches" > 0; a shape with recompute and offload among them).
# usage: determinism.sh BENCH_TRAIN. Skipped (77) without a GPU.
set -u
bt=$1
fails=0
n=0
for args in "--shape qwen2-0.5b --batch 2 --seq 1024 --precision bf16" \
	"--shape llama3-8b-4l --batch 1 --seq 2048 --precision bf16 --clip 0" \
	"--shape llama3-8b-4l --batch 1 --seq 2048 --lora-rank 16 --lora-targets all --precision bf16 --clip 0" \
	"--shape qwen2-0.5b --batch 2 --seq 1024 --lora-rank 16 --lora-targets all --precision bf16 --recompute full-offload --selective-layers 3"; do
	a=$("$bt" --backend cuda $args --steps 5 --warm 0 2>"${TMPDIR:-/tmp}/det.err")
	rc=$?
	if [ $rc != 0 ] && grep -q 'no NVIDIA driver\|no CUDA device\|no CUDA GPU\|CUDA module' "${TMPDIR:-/tmp}/det.err"; then
		echo "SKIP: no GPU ($(head -n 1 "${TMPDIR:-/tmp}/det.err"))"
		exit 77
	fi
	b=$("$bt" --backend cuda $args --steps 5 --warm 0 2>/dev/null)
	c=$(TD_CUDA_NO_GRAPHS=1 "$bt" --backend cuda $args --steps 5 --warm 0 2>/dev/null)
	la=$(printf '%s\n' "$a" | grep -o '"loss_exact": [^,}]*')
	lb=$(printf '%s\n' "$b" | grep -o '"loss_exact": [^,}]*')
	lc=$(printf '%s\n' "$c" | grep -o '"loss_exact": [^,}]*')
	ga=$(printf '%s\n' "$a" | grep -o '"graph_launches": [0-9]*' | grep -o '[0-9]*$')
	gc=$(printf '%s\n' "$c" | grep -o '"graph_launches": [0-9]*' | grep -o '[0-9]*$')
	n=$((n + 2))
	if [ -n "$la" ] && [ "$la" = "$lb" ]; then
		echo "ok: $args: the same loss twice ($la)"
	else
		echo "FAIL: $args: '$la' then '$lb'"
		fails=$((fails + 1))
	fi
	if [ -n "$la" ] && [ "$la" = "$lc" ] && [ "${ga:-0}" -gt 0 ] && [ "${gc:-1}" = 0 ]; then
		echo "ok: $args: the same loss with $ga graph launches and without graphs"
	else
		echo "FAIL: $args: graphs ($ga launches) '$la', without ($gc) '$lc'"
		fails=$((fails + 1))
	fi
done
echo "$n checks, $fails failed"
[ $fails = 0 ]
