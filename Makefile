# traind's Quick start: `make demo` and `make test` on a fresh Debian 12 machine.
# Thin by design: meson builds, this file installs what is missing and runs it.

# Debian 12 packages the build, the tests and the demo need (one list;
# prometheus for its promtool, which it-metrics checks the exposition with).
DEBS := gcc make pkg-config meson ninja-build \
	libuv1-dev libnng-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler \
	libsqlite3-dev libpcre2-dev libjson-c-dev libopenblas-dev libsystemd-dev \
	libcmocka-dev libunistring-dev clang libssl-dev jq \
	prometheus

BUILD ?= build
ASAN_BUILD ?= build-asan
MESONFLAGS ?=
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: all deps build demo test test-blas sanitize fuzz bench clean

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

# Each libFuzzer target (tests/fuzz/) under ASan and UBSan, one at a time,
# from its seeds: FUZZ_RUNS executions each, or FUZZ_SECONDS if that comes
# first; then the count and time of each. The slowest (jobspec, which runs
# protoc for its text inputs, and jsonl) take about half an hour for 10^6 on
# one core of a 2-core machine; the others a few minutes. A crash stops the
# run with its report; its input is in $(FUZZ_BUILD)/fuzz-artifacts/.
FUZZ_BUILD ?= build-fuzz
FUZZ_TARGETS ?= request jobspec config safetensors tokenizer jsonl tokcache
FUZZ_RUNS ?= 1000000
FUZZ_SECONDS ?= 3600
fuzz: deps
	[ -f $(FUZZ_BUILD)/build.ninja ] || meson setup $(FUZZ_BUILD) $(MESONFLAGS) -Dcuda=disabled
	ninja -C $(FUZZ_BUILD) $(addprefix tests/fuzz/fuzz_,$(FUZZ_TARGETS))
	@mkdir -p $(FUZZ_BUILD)/fuzz-artifacts; : >$(FUZZ_BUILD)/fuzz-summary; fail=0; \
	for t in $(FUZZ_TARGETS); do \
		echo "== fuzz_$$t: $(FUZZ_RUNS) runs or $(FUZZ_SECONDS) s"; \
		FUZZ_ARTIFACTS=$(CURDIR)/$(FUZZ_BUILD)/fuzz-artifacts/ tests/fuzz/run_fuzz.sh $$t \
			$(FUZZ_BUILD)/tests/fuzz/fuzz_$$t $(FUZZ_SECONDS) -runs=$(FUZZ_RUNS) >$(FUZZ_BUILD)/fuzz-$$t.log 2>&1 \
			|| fail=1; \
		tail -n 1 $(FUZZ_BUILD)/fuzz-$$t.log | tee -a $(FUZZ_BUILD)/fuzz-summary; \
		if [ $$fail -ne 0 ]; then tail -n 80 $(FUZZ_BUILD)/fuzz-$$t.log; break; fi; \
	done; \
	echo "== executions per target ($(FUZZ_BUILD)/fuzz-summary)"; cat $(FUZZ_BUILD)/fuzz-summary; exit $$fail

bench: build
	meson test -C $(BUILD) --benchmark --verbose

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) demo-out
