/* libFuzzer target: request decoding, as the daemon does it before any
 * handler runs (proto/rpc.h), and the submitted spec's defaults, validation
 * and printing (proto/jobspec.h). Response decoding (trainctl's side) too.
 *
 * Built with clang -fsanitize=fuzzer,address,undefined by tests/fuzz/meson.build
 * where clang and libFuzzer exist; run for a bounded time by run_fuzz.sh. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "proto/jobspec.h"
#include "proto/rpc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct td_errbuf eb = {{0}};
	Traind__Request *r = NULL;
	if (rpc_request_decode(&r, data, size, 0, &eb) == TD_OK) {
		if (r->call_case == TRAIND__REQUEST__CALL_SUBMIT) {
			Traind__JobSpec *s = NULL;
			if (rpc_jobspec_copy(&s, r->submit->spec) == TD_OK) {
				if (rpc_jobspec_apply_defaults(s, &eb) == TD_OK &&
				    rpc_jobspec_validate(s, &eb) == TD_OK) {
					FILE *devnull = fopen("/dev/null", "w");
					if (devnull) {
						rpc_jobspec_print(s, devnull);
						fclose(devnull);
					}
					rpc_jobspec_resolve_precision(s, false, &eb);
				}
				rpc_jobspec_free(s);
			}
		}
		uint8_t *buf = NULL;
		size_t len = 0;
		if (rpc_request_encode(r, &buf, &len) == TD_OK) {
			Traind__Request *again = NULL;
			/* What decoded once must decode again after a re-encode. */
			if (rpc_request_decode(&again, buf, len, 0, &eb) != TD_OK)
				__builtin_trap();
			rpc_request_free(again);
			free(buf);
		}
		rpc_request_free(r);
	}
	Traind__Response *resp = NULL;
	if (rpc_response_decode(&resp, data, size, &eb) == TD_OK)
		rpc_response_free(resp);
	return 0;
}
