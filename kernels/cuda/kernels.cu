// The one translation unit nvcc compiles per architecture (gpu/cuda/meson.build):
// it includes every kernel file of kernels/cuda, so that one cubin per
// architecture holds every kernel of gpu/cuda/kernels.def. Each file also
// compiles on its own (common.cuh is include-guarded, helpers are static).
#include "embedding.cu"
#include "rmsnorm.cu"
#include "matmul.cu"
#include "rope.cu"
#include "attention.cu"
#include "flash.cu"
#include "elementwise.cu"
#include "crossentropy.cu"
#include "optimizer.cu"
#include "methods.cu"
#include "fault.cu"
