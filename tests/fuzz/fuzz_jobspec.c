/* libFuzzer target: a job file as trainctl and traind --check read it
 * (rpc_jobspec_load, proto/jobspec.h): binary protobuf (.pb) for every
 * input, and text format (.txtpb, through protoc and the installed
 * traind.proto, protoc's errors turned into "PATH:LINE:COL: what") for inputs
 * that are text; then what loaded defaulted, validated, printed, its
 * precision resolved for the CPU and a GPU, and encoded and decoded again.
 *
 * Text is an input whose every byte is printable ASCII, a tab, CR or LF, or
 * >= 0x80: binary protobuf almost never is, so the two formats share one
 * corpus and only text pays for running protoc.
 *
 * What must hold besides no crash, leak or UB: an error says what is wrong
 * (a text one names the file), and a spec that loaded encodes and decodes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/jobspec.h"
#include "tests/fuzz/fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static FILE *devnull;

static bool is_text(const uint8_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] < 0x20 && p[i] != '\t' && p[i] != '\n' && p[i] != '\r')
			return false;
	return true;
}

static void use(Traind__JobSpec *s)
{
	struct td_errbuf eb = {{0}};
	uint8_t *buf = NULL;
	size_t len = 0;
	if (rpc_jobspec_encode(s, &buf, &len) != TD_OK)
		__builtin_trap();
	Traind__JobSpec *again = NULL;
	if (rpc_jobspec_decode(&again, buf, len, &eb) != TD_OK)
		__builtin_trap(); /* what decoded once decodes again */
	free(buf);
	rpc_jobspec_free(again);
	for (int gpu = 0; gpu < 2; gpu++) {
		Traind__JobSpec *c = NULL;
		if (rpc_jobspec_copy(&c, s) != TD_OK)
			__builtin_trap();
		eb.msg[0] = '\0';
		if (rpc_jobspec_apply_defaults(c, &eb) == TD_OK) {
			if (rpc_jobspec_validate(c, &eb) == TD_OK) {
				rpc_jobspec_print(c, devnull);
				rpc_jobspec_resolve_precision(c, gpu, &eb);
			} else if (!eb.msg[0]) {
				__builtin_trap();
			}
		} else if (!eb.msg[0]) {
			__builtin_trap();
		}
		rpc_jobspec_free(c);
	}
}

static void load(const char *path)
{
	Traind__JobSpec *s = NULL;
	struct td_errbuf eb = {{0}};
	if (rpc_jobspec_load(&s, path, &eb) == TD_OK) {
		use(s);
		rpc_jobspec_free(s);
	} else if (!strstr(eb.msg, path)) {
		fprintf(stderr, "the error does not name the file: %s\n", eb.msg);
		__builtin_trap();
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	if (!devnull && !(devnull = fopen("/dev/null", "we")))
		abort();
	char path[PATH_MAX];
	fuzz_write(fuzz_path(path, "job.pb"), data, size);
	load(path);
	if (is_text(data, size)) {
		fuzz_write(fuzz_path(path, "job.txtpb"), data, size);
		load(path);
	}
	return 0;
}
