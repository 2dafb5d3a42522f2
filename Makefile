# traind's Quick start: `make demo` and `make test` on a fresh Debian 12 machine.
# Thin by design: meson builds, this file installs what is missing and runs it.

# Debian 12 packages the build, the tests and the demo need (one list).
DEBS := gcc make pkg-config meson ninja-build \
	libuv1-dev libnng-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
	libsqlite3-dev libpcre2-dev libjson-c-dev libopenblas-dev libsystemd-dev \
	libcmocka-dev libunistring-dev clang libssl-dev

BUILD ?= build
ASAN_BUILD ?= build-asan
MESONFLAGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build demo test test-blas sanitize bench clean

all: build

# Installs only what is missing; a machine that has everything runs no apt-get.
deps:
	@if ! command -v dpkg-query >/dev/null; then \
		echo "deps: not a Debian system; install the equivalents of: $(DEBS)"; exit 0; fi; \
	missing=""; for p in $(DEBS); do \
		dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q 'ok installed' || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		echo "deps: installing$$missing"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

$(BUILD)/build.ninja:
	meson setup $(BUILD) $(MESONFLAGS)

build: deps $(BUILD)/build.ninja
	ninja -C $(BUILD)

# A real short fine-tune of the bundled tiny Qwen2 on bundled JSONL text,
# through a user-mode traind with a temporary state dir: the demo job submitted
# and watched with trainctl; the ledger and the output; the daemon stopped.
demo: build
	client/demo.sh $(BUILD)

# Every suite that applies here; the gpu suite skips itself without a GPU.
test: build
	meson test -C $(BUILD) --print-errorlogs --num-processes 2

# The unit and integration suites under AddressSanitizer and UBSan.
sanitize: deps
	[ -f $(ASAN_BUILD)/build.ninja ] || meson setup $(ASAN_BUILD) $(MESONFLAGS) \
		-Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug -Dcuda=disabled
	ninja -C $(ASAN_BUILD)
	meson test -C $(ASAN_BUILD) --print-errorlogs --num-processes 2 --no-suite slow --no-suite gpu

# The suites under each BLAS split the tolerances must hold for: 1, 2 and 4
# OpenBLAS threads, with OPENBLAS_CORETYPE=Haswell and without it.
test-blas: build
	@fail=0; for ct in Haswell ""; do for t in 1 2 4; do \
		echo "== OPENBLAS_NUM_THREADS=$$t OPENBLAS_CORETYPE=$${ct:-(unset)}"; \
		if [ -n "$$ct" ]; then set -- env OPENBLAS_CORETYPE=$$ct; else set -- env -u OPENBLAS_CORETYPE; fi; \
		"$$@" OPENBLAS_NUM_THREADS=$$t meson test -C $(BUILD) --no-suite gpu --num-processes 2 \
			--print-errorlogs --logbase blas-$$t-$${ct:-none} || fail=1; \
	done; done; exit $$fail

bench: build
	meson test -C $(BUILD) --benchmark --verbose

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) demo-out
