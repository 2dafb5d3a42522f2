#!/bin/bash
# Packs what tests/gpu/device-run.sh needs on a GPU machine that has none of
# this project's build: the binaries and the CUDA module (.gpu-run/), the
# Debian libraries they load (.gpu-libs/lib, by ../shared/device/bundle-libs.sh)
# and the PyTorch peers (peer_hf.py, peer_big.py, peer_dist.py, peer_attn.py),
# stripped and xz-compressed into .gpu-pack.tar.xz (the uncompressed pair is
# over the device tool's 64 MiB carry). Run from the repo root after
# `ninja -C build`; then, on the device, with carry [".gpu-pack.tar.xz"]:
#   tar xJf .gpu-pack.tar.xz; tests/gpu/device-run.sh [tests|bench|faults|memory|ddp|preempt|share|attn|all]
# BUILD=DIR packs another build folder than build/ (e.g. BUILD=build-ddp).
# OLD_MODULE=FILE packs FILE (another build's libtraind-cuda.so) as
# .gpu-run/old-libtraind-cuda.so, for device-run.sh ab.
# Libraries the GPU machine has itself (libsystemd, libcrypto, sqlite, ...)
# are left out.
set -eu
cd "$(dirname "$0")/../.."
rm -rf .gpu-run .gpu-libs .gpu-pack.tar.xz
mkdir -p .gpu-run
b=${BUILD:-build}
cp "$b"/daemon/traind "$b"/client/trainctl "$b"/tests/parity "$b"/tests/gpu/test_cuda_ops \
	"$b"/tests/bench/bench_train "$b"/tests/bench/bench_tokenizer "$b"/tests/bench/bench_attn \
	"$b"/tests/unit/test_recompute \
	"$b"/tests/unit/test_frozen "$b"/tests/unit/test_base "$b"/tests/gpu/nccl_smoke \
	"$b"/gpu/cuda/libtraind-cuda.so .gpu-run/
if [ -n "${OLD_MODULE:-}" ]; then
	cp "$OLD_MODULE" .gpu-run/old-libtraind-cuda.so
fi
../shared/device/bundle-libs.sh .gpu-libs .gpu-run/* >/dev/null
cp ../shared/bench/peer_hf.py ../shared/bench/peer_big.py ../shared/bench/peer_dist.py \
	tests/bench/peer_attn.py .gpu-libs/
strip --strip-unneeded .gpu-libs/lib/* .gpu-run/* 2>/dev/null || true
rm -f .gpu-libs/lib/{libsystemd,libgcrypt,libgpg-error,liblz4,liblzma,libzstd,libcap,libsqlite3,libcrypto}*
tar cf - .gpu-run .gpu-libs | xz -T2 -6 >.gpu-pack.tar.xz
ls -la .gpu-pack.tar.xz
