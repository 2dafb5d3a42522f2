/* What every backend shares: the check that its ops table is complete. */
#include "gpu/backend.h"

void gpu_backend_check_ops(const struct gpu_backend_ops *o)
{
	assert(o->name && o->alloc && o->free && o->upload && o->download && o->zero && o->sync && o->mem_info && o->set_bf16 &&
	       o->destroy);
	assert(o->host_alloc && o->host_free && o->copy_async && o->copy_wait);
	assert(o->embedding_forward && o->embedding_backward && o->embedding_forward_part &&
	       o->embedding_backward_part && o->rmsnorm_forward &&
	       o->rmsnorm_backward && o->matmul_forward && o->matmul_forward_add && o->matmul_forward_residual &&
	       o->matmul_backward && o->rope_forward &&
	       o->rope_backward && o->attention_flash && o->gemm_bf16 && o->attention_forward && o->attention_backward &&
	       o->swiglu_forward && o->swiglu_backward && o->lora_dx_add && o->residual_forward &&
	       o->crossentropy_forward && o->crossentropy_backward && o->adamw_update &&
	       o->sumsq && o->scale && o->bf16_round && o->bf16_widen &&
	       o->bf16_round_rows);
	assert(o->nf4_dequantize && o->absmax_dequantize && o->distill_forward &&
	       o->distill_backward && o->dropout);
	/* Shared memory is optional, but all of it or none. */
	assert(!o->share_alloc == !o->share_free && (!o->share_seal || o->share_alloc));
	(void)o;
}
