#!/bin/sh
# `traind --plan` prints plans for real model shapes from their configs alone
# (no weights exist here): Qwen2-0.5B, Qwen2-1.5B, Llama-3-8B. Checks the
# parameter counts against the published ones and that the plan has every arena.
# usage: plan_shapes.sh TRAIND
set -eu
traind=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0

shape() { # name params config-json
	mkdir -p "$tmp/$1"
	printf '%s\n' "$3" >"$tmp/$1/config.json"
	printf 'model_dir: "%s"\ndata { train_file: "%s/none.tokens" seq_len: 1024 }\nhyper { micro_batch: 8 }\noutput { dir: "%s/out" }\n' \
		"$tmp/$1" "$tmp" "$tmp" >"$tmp/$1.txtpb"
	if ! out=$("$traind" --plan "$tmp/$1.txtpb" 2>&1); then
		echo "FAIL $1: traind --plan exited non-zero:"; echo "$out"; fail=1; return
	fi
	echo "$out"
	for want in "parameters $2 " "arena params" "arena grads" "arena optim" "arena acts" "arena scratch" "total"; do
		case $out in *"$want"*) ;; *) echo "FAIL $1: no '$want' in the plan"; fail=1 ;; esac
	done
}

shape qwen2-0.5b 494032768 '{"model_type":"qwen2","vocab_size":151936,"hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"rope_theta":1000000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true,"max_position_embeddings":32768,"torch_dtype":"bfloat16"}'
shape qwen2-1.5b 1543714304 '{"model_type":"qwen2","vocab_size":151936,"hidden_size":1536,"intermediate_size":8960,"num_hidden_layers":28,"num_attention_heads":12,"num_key_value_heads":2,"rope_theta":1000000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true,"max_position_embeddings":131072,"torch_dtype":"bfloat16"}'
shape llama3-8b 8030261248 '{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"rope_theta":500000.0,"rms_norm_eps":1e-5,"tie_word_embeddings":false,"max_position_embeddings":8192,"torch_dtype":"bfloat16"}'
exit $fail
