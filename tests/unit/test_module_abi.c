/* traind refuses a CUDA backend module built from other sources than its
 * own (gpu/select.c: open_module, gpu/abi.py): a module of another GPU
 * interface, or one with no stamp, fails to open with an error naming the
 * module and both interfaces, and none of its code runs (its entry point
 * aborts); this build's own module, where there is one, passes the check.
 *
 * usage: test_module_abi STALE_MODULE UNSTAMPED_MODULE [THIS_BUILD_MODULE] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu_abi.h"
#include "gpu/select.h"
#include "tests/check.h"

static void refused(const char *path, const char *stamp)
{
	struct td_errbuf eb = {{0}};
	struct gpu_backend *be = NULL;
	setenv("TD_CUDA_MODULE", path, 1);
	CHECK_EQ_INT(gpu_backend_open(&be, "cuda", &eb), TD_EUNSUPPORTED);
	CHECK(be == NULL);
	CHECK_CONTAINS(eb.msg, path);
	CHECK_CONTAINS(eb.msg, "built from other sources than this traind");
	CHECK_CONTAINS(eb.msg, stamp);
	char ours[16];
	snprintf(ours, sizeof(ours), "%.12s", TD_GPU_ABI);
	CHECK_CONTAINS(eb.msg, ours);
	printf("refused %s: %s\n", path, eb.msg);
	/* the side streams' entry points go through the same check */
	eb.msg[0] = '\0';
	CHECK(gpu_cuda_module_sym("gpu_cuda_side_new", &eb) == NULL);
	CHECK_CONTAINS(eb.msg, "built from other sources than this traind");
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: test_module_abi STALE UNSTAMPED [THIS_BUILD]\n");
		return 2;
	}
	CHECK_EQ_INT(strlen(TD_GPU_ABI), 64);
	refused(argv[1], "0123456789ab");
	refused(argv[2], "unstamped");
	if (argc > 3) {
		/* this build's module: past the check (what follows may still
		 * fail without a driver, but not for its interface) */
		struct td_errbuf eb = {{0}};
		setenv("TD_CUDA_MODULE", argv[3], 1);
		const char *abi = gpu_cuda_module_sym("gpu_cuda_abi", &eb);
		CHECK_MSG(abi != NULL, "this build's module: %s", eb.msg);
		CHECK(abi && strcmp(abi, TD_GPU_ABI) == 0);
	}
	return check_status();
}
