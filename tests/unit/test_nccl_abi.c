/* gpu/nccl.h's declarations of NCCL's types against a real nccl.h, where
 * the build finds one: the same values, sizes and offsets, so that the
 * loader calls the library with its own ABI. Built only then; it checks at
 * compile time, and running it says which nccl.h it saw. */
#include "gpu/nccl.h"

#include <nccl.h>
#include <stddef.h>
#include <stdio.h>

#define SAME(a, b) _Static_assert((long long)(a) == (long long)(b), #a " != " #b)

SAME(GPU_NCCL_SUCCESS, ncclSuccess);
SAME(GPU_NCCL_UNHANDLED_CUDA_ERROR, ncclUnhandledCudaError);
SAME(GPU_NCCL_SYSTEM_ERROR, ncclSystemError);
SAME(GPU_NCCL_INTERNAL_ERROR, ncclInternalError);
SAME(GPU_NCCL_INVALID_ARGUMENT, ncclInvalidArgument);
SAME(GPU_NCCL_INVALID_USAGE, ncclInvalidUsage);
SAME(GPU_NCCL_REMOTE_ERROR, ncclRemoteError);
SAME(GPU_NCCL_IN_PROGRESS, ncclInProgress);
SAME(sizeof(gpu_nccl_result_t), sizeof(ncclResult_t));
SAME(GPU_NCCL_INT8, ncclInt8);
SAME(GPU_NCCL_UINT8, ncclUint8);
SAME(GPU_NCCL_INT32, ncclInt32);
SAME(GPU_NCCL_UINT32, ncclUint32);
SAME(GPU_NCCL_INT64, ncclInt64);
SAME(GPU_NCCL_UINT64, ncclUint64);
SAME(GPU_NCCL_FLOAT16, ncclFloat16);
SAME(GPU_NCCL_FLOAT32, ncclFloat32);
SAME(GPU_NCCL_FLOAT64, ncclFloat64);
SAME(GPU_NCCL_BFLOAT16, ncclBfloat16);
SAME(sizeof(int), sizeof(ncclDataType_t));
SAME(GPU_NCCL_SUM, ncclSum);
SAME(GPU_NCCL_PROD, ncclProd);
SAME(GPU_NCCL_MAX, ncclMax);
SAME(GPU_NCCL_MIN, ncclMin);
SAME(GPU_NCCL_AVG, ncclAvg);
SAME(sizeof(int), sizeof(ncclRedOp_t));
SAME(sizeof(gpu_nccl_comm), sizeof(ncclComm_t));
SAME(GPU_NCCL_UNIQUE_ID_BYTES, NCCL_UNIQUE_ID_BYTES);
SAME(sizeof(struct gpu_nccl_id), sizeof(ncclUniqueId));
SAME(GPU_NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT);
SAME(GPU_NCCL_VERSION_CODE(2, 28, 9), NCCL_VERSION(2, 28, 9));
SAME(GPU_NCCL_CONFIG_VERSION, NCCL_VERSION(2, 14, 3));
/* Our config is the prefix of NCCL's. */
SAME(offsetof(struct gpu_nccl_config, size), offsetof(ncclConfig_t, size));
SAME(offsetof(struct gpu_nccl_config, magic), offsetof(ncclConfig_t, magic));
SAME(offsetof(struct gpu_nccl_config, version), offsetof(ncclConfig_t, version));
SAME(offsetof(struct gpu_nccl_config, blocking), offsetof(ncclConfig_t, blocking));
SAME(offsetof(struct gpu_nccl_config, cga_cluster_size), offsetof(ncclConfig_t, cgaClusterSize));
SAME(offsetof(struct gpu_nccl_config, min_ctas), offsetof(ncclConfig_t, minCTAs));
SAME(offsetof(struct gpu_nccl_config, max_ctas), offsetof(ncclConfig_t, maxCTAs));
SAME(offsetof(struct gpu_nccl_config, net_name), offsetof(ncclConfig_t, netName));
_Static_assert(sizeof(struct gpu_nccl_config) <= sizeof(ncclConfig_t), "config prefix");

int main(void)
{
	ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
	struct gpu_nccl_config g = gpu_nccl_config_init(true);
	if (c.magic != g.magic || c.blocking != GPU_NCCL_CONFIG_UNDEF_INT) {
		fprintf(stderr, "NCCL_CONFIG_INITIALIZER differs\n");
		return 1;
	}
	printf("gpu/nccl.h matches nccl.h %d.%d.%d\n", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
	return 0;
}
