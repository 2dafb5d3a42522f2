#!/bin/bash
# The daemon's module cache and its sqlite index (contract 3): a user-mode
# traind with the PTX path forced (TD_CUDA_FORCE_PTX=1, the test hook) runs
# two short GPU jobs one after the other. The first compiles the kernels and
# writes the cache entry under the daemon's cache_dir; the second loads it
# (0 compiles). The module_cache table then holds exactly that entry: its
# key is the file's name, its sha256 and size those of the cubin after the
# file's 88-byte header (computed here with Python's hashlib), one hit.
# `trainctl cache` lists it; `trainctl cache clear` removes entry and file,
# and a third job compiles again.
# Skips (77) without a GPU. Environment as the integration tests.
. "$(dirname "$0")/../integration/lib.sh"
cd "$TD_SRC" || exit 1

export TD_CUDA_FORCE_PTX=1
start_daemon --user --cpu-slots 1
case "$(ctl info)" in
*"backends:    cpu cuda"*) ;;
*) echo "SKIP: the daemon found no CUDA GPU"; exit 77 ;;
esac

fx=$TD_FIXTURES
# run_job NAME: submits a 5-step GPU job, waits for it; its log in $logs.
run_job() {
	cat >"$WORK/$1.txtpb" <<SPEC
name: "$1"
model_dir: "$fx/qwen2"
data { train_file: "$fx/demo/fortunes.tokens" format: DATA_FORMAT_TOKENS seq_len: 32 }
hyper { lr: 1e-3 max_steps: 5 micro_batch: 4 seed: 5 }
output { dir: "$WORK/out-$1" }
resources { device: DEVICE_GPU allow_cpu: false }
SPEC
	local id
	id=$(ctl submit "$WORK/$1.txtpb")
	check "job $1 is submitted" test -n "$id"
	wait_for 240 eval 'case $(job_state "$id") in SUCCEEDED | FAILED | CANCELLED | INTERRUPTED) true ;; *) false ;; esac'
	expect_eq "job $1 succeeds" "$(job_state "$id")" SUCCEEDED
	logs=$(ctl logs "$id")
	line=$(printf '%s\n' "$logs" | grep -o 'backend cuda (.*' | head -n 1)
	note "$1: $line"
	compiles=$(printf '%s\n' "$line" | sed -n 's/.*: \([0-9]*\) kernel compiles, \([0-9]*\) after seal.*/\1 \2/p')
}

run_job first
set -- $compiles
check "the first job compiles the kernels (got '${1:-}')" test "${1:-0}" -ge 1
expect_eq "no compile after seal (first)" "${2:-}" 0
run_job second
set -- $compiles
expect_eq "the second job loads them from the cache: compiles" "${1:-}" 0
expect_eq "no compile after seal (second)" "${2:-}" 0

# The index against the file, computed independently.
index=$(python3 - "$STATE/traind.db" "$WORK/cache/modules" <<'PY'
import hashlib, os, sqlite3, sys
db, mdir = sys.argv[1], sys.argv[2]
files = [f for f in os.listdir(mdir) if f.endswith('.cubin')]
rows = sqlite3.connect(db).execute(
    'SELECT key, path, sha256, arch, size_bytes, hits FROM module_cache').fetchall()
if len(files) != 1 or len(rows) != 1:
    print(f'want 1 file and 1 row, got files {files} rows {rows}')
    sys.exit(0)
key, path, sha, arch, size, hits = rows[0]
data = open(os.path.join(mdir, files[0]), 'rb').read()[88:]
problems = []
if key + '.cubin' != files[0]: problems.append(f'key {key} is not the file {files[0]}')
if os.path.realpath(path) != os.path.realpath(os.path.join(mdir, files[0])): problems.append(f'path {path}')
if sha != hashlib.sha256(data).hexdigest(): problems.append(f'sha256 {sha}')
if size != len(data): problems.append(f'size {size} != {len(data)}')
if hits != 1: problems.append(f'hits {hits} != 1')
if not arch.startswith('sm_'): problems.append(f'arch {arch}')
print('ok' if not problems else '; '.join(problems))
PY
)
expect_eq "the module_cache row matches the entry file" "$index" ok

# The cache RPC: trainctl cache lists that entry, with its hit; clear removes
# it and its file, and the next job compiles again.
cache_out=$(ctl cache)
expect_contains "trainctl cache: the entry" "$cache_out" "1 module,"
expect_contains "trainctl cache: its hit" "$cache_out" "1 load from the cache"
expect_contains "trainctl cache: its file" "$cache_out" "$WORK/cache/modules/"
expect_contains "trainctl cache clear" "$(ctl cache clear)" "module cache cleared: 1 entries, 1 files"
expect_eq "no cubin left" "$(find "$WORK/cache/modules" -name '*.cubin' | wc -l)" 0
expect_contains "the index is empty" "$(ctl cache stats)" "0 modules"
run_job third
set -- $compiles
check "after clear the next job compiles again (got '${1:-}')" test "${1:-0}" -ge 1
stop_daemon
finish
