/* Side streams: a second stream beside a backend's, for work that must
 * overlap the backend's math without joining its stream — the NCCL
 * collectives of data parallel (gpu/comm.c). The side stream is ordered
 * after the backend's work by an event (fork); nothing orders the backend's
 * stream after the side stream's: the caller polls the side stream
 * (query) and enqueues work that reads the results only once it is done,
 * so that no stream of the backend can wait forever on a collective whose
 * peer is gone (a host-side wait has a timeout; a stream wait has none).
 *
 * Exported by name (gpu/comm.c resolves them with gpu_cuda_module_sym),
 * beside the ops table: only data parallel needs them. The driver entry
 * points they use beyond cuda_internal.h's list are resolved here, from the
 * same libcuda.so.1, so that the list stays the backend's. Not thread-safe:
 * one side stream belongs to the rank thread of its backend. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dlfcn.h>

#include "gpu/cuda/cuda_internal.h"

#define CU_SIDE_STR2_(x) #x
#define CU_SIDE_STR_(x) CU_SIDE_STR2_(x) /* the versioned name cuda.h maps to */

/* Events recorded on the side stream after its collectives, in a ring
 * (gpu/comm.c: COMM_EVENTS, the same count). */
#define CU_SIDE_EVENTS 16

struct cu_side {
	struct cu_backend *cb;
	CUstream stream;
	CUevent ev;
	CUevent marks[CU_SIDE_EVENTS];
	__typeof__(&cuEventQuery) event_query;
	__typeof__(&cuStreamQuery) query;
	__typeof__(&cuStreamWaitEvent) wait_event;
	CUresult first_error;
	char where[64];
};

#define CU_SIDE_EXPORT __attribute__((visibility("default")))

CU_SIDE_EXPORT td_err gpu_cuda_side_new(struct gpu_backend *be, struct cu_side **out,
					struct td_errbuf *eb);
CU_SIDE_EXPORT void *gpu_cuda_side_stream(struct cu_side *s);
CU_SIDE_EXPORT void gpu_cuda_side_fork(struct cu_side *s);
CU_SIDE_EXPORT int gpu_cuda_side_query(struct cu_side *s);
CU_SIDE_EXPORT td_err gpu_cuda_side_error(struct cu_side *s, struct td_errbuf *eb);
CU_SIDE_EXPORT void gpu_cuda_side_free(struct cu_side *s);
CU_SIDE_EXPORT void gpu_cuda_side_record(struct cu_side *s, int k);
CU_SIDE_EXPORT int gpu_cuda_side_event_query(struct cu_side *s, int k);
CU_SIDE_EXPORT void gpu_cuda_side_join(struct cu_side *s, int k);

static void side_check(struct cu_side *s, CUresult r, const char *what)
{
	if (r == CUDA_SUCCESS || s->first_error != CUDA_SUCCESS)
		return;
	s->first_error = r;
	snprintf(s->where, sizeof(s->where), "%s", what);
}

static td_err side_err(struct cu_side *s, CUresult r, const char *what, struct td_errbuf *eb)
{
	const char *name = "?", *str = "?";
	s->cb->drv.cuGetErrorName(r, &name);
	s->cb->drv.cuGetErrorString(r, &str);
	/* The sticky ones (cuda_backend.c's list) lose the context. */
	bool lost = r == CUDA_ERROR_ILLEGAL_ADDRESS || r == CUDA_ERROR_LAUNCH_FAILED ||
		    r == CUDA_ERROR_ILLEGAL_INSTRUCTION || r == CUDA_ERROR_MISALIGNED_ADDRESS ||
		    r == CUDA_ERROR_INVALID_ADDRESS_SPACE || r == CUDA_ERROR_INVALID_PC ||
		    r == CUDA_ERROR_HARDWARE_STACK_ERROR || r == CUDA_ERROR_ASSERT ||
		    r == CUDA_ERROR_ECC_UNCORRECTABLE;
	return td_fail(eb, lost ? TD_EDEVICE_LOST : TD_EDEVICE, "%s (side stream): %s (%s)%s", what,
		       name, str, lost ? "; the device's context is lost" : "");
}

/* The side stream of be (a CUDA backend: the caller checks), on be's
 * context, which this makes current on the calling thread. It has the
 * device's highest priority where the driver has priorities, so that a
 * collective's kernels are not queued behind the backward's. */
td_err gpu_cuda_side_new(struct gpu_backend *be, struct cu_side **out, struct td_errbuf *eb)
{
	struct cu_backend *cb = cu_of(be);
	struct cu_side *s = calloc(1, sizeof(*s));
	if (!s)
		return td_fail(eb, TD_ENOMEM, "side stream: out of memory");
	s->cb = cb;
	s->query = (__typeof__(s->query))dlsym(cb->drv.lib, CU_SIDE_STR_(cuStreamQuery));
	s->wait_event = (__typeof__(s->wait_event))dlsym(cb->drv.lib, CU_SIDE_STR_(cuStreamWaitEvent));
	__typeof__(&cuStreamCreateWithPriority) create_prio = (__typeof__(create_prio))dlsym(
		cb->drv.lib, CU_SIDE_STR_(cuStreamCreateWithPriority));
	__typeof__(&cuCtxGetStreamPriorityRange) prio_range = (__typeof__(prio_range))dlsym(
		cb->drv.lib, CU_SIDE_STR_(cuCtxGetStreamPriorityRange));
	s->event_query = (__typeof__(s->event_query))dlsym(cb->drv.lib, CU_SIDE_STR_(cuEventQuery));
	if (!s->query || !s->wait_event || !s->event_query) {
		free(s);
		return td_fail(eb, TD_EUNSUPPORTED,
			       "the NVIDIA driver lacks cuStreamQuery, cuStreamWaitEvent or cuEventQuery "
			       "(too old?)");
	}
	CUresult r = cb->drv.cuCtxSetCurrent(cb->ctx);
	int least = 0, greatest = 0;
	if (r == CUDA_SUCCESS && create_prio && prio_range &&
	    prio_range(&least, &greatest) == CUDA_SUCCESS)
		r = create_prio(&s->stream, CU_STREAM_NON_BLOCKING, greatest);
	else if (r == CUDA_SUCCESS)
		r = cb->drv.cuStreamCreate(&s->stream, CU_STREAM_NON_BLOCKING);
	if (r == CUDA_SUCCESS)
		r = cb->drv.cuEventCreate(&s->ev, CU_EVENT_DISABLE_TIMING);
	for (int k = 0; k < CU_SIDE_EVENTS && r == CUDA_SUCCESS; k++)
		r = cb->drv.cuEventCreate(&s->marks[k], CU_EVENT_DISABLE_TIMING);
	if (r != CUDA_SUCCESS) {
		td_err e = side_err(s, r, "creating a side stream", eb);
		gpu_cuda_side_free(s);
		return e;
	}
	*out = s;
	return TD_OK;
}

void *gpu_cuda_side_stream(struct cu_side *s)
{
	return (void *)s->stream;
}

/* The side stream waits for everything enqueued on the backend's stream so
 * far (a device-side wait: the host goes on). */
void gpu_cuda_side_fork(struct cu_side *s)
{
	side_check(s, s->cb->drv.cuEventRecord(s->ev, s->cb->stream), "cuEventRecord");
	side_check(s, s->wait_event(s->stream, s->ev, 0), "cuStreamWaitEvent");
}

/* 1: all the side stream's work is done; 0: not yet; -1: it failed (or a
 * fork did): gpu_cuda_side_error says how. Never blocks. */
int gpu_cuda_side_query(struct cu_side *s)
{
	if (s->first_error != CUDA_SUCCESS)
		return -1;
	CUresult r = s->query(s->stream);
	if (r == CUDA_SUCCESS)
		return 1;
	if (r == CUDA_ERROR_NOT_READY)
		return 0;
	side_check(s, r, "cuStreamQuery");
	return -1;
}

td_err gpu_cuda_side_error(struct cu_side *s, struct td_errbuf *eb)
{
	if (s->first_error == CUDA_SUCCESS)
		return TD_OK;
	return side_err(s, s->first_error, s->where, eb);
}

/* Waits for the stream (its collectives must be complete or aborted, or
 * this blocks for as long as they do) and frees it. NULL: no-op. */
void gpu_cuda_side_free(struct cu_side *s)
{
	if (!s)
		return;
	struct cu_backend *cb = s->cb;
	cb->drv.cuCtxSetCurrent(cb->ctx);
	if (s->stream) {
		cb->drv.cuStreamSynchronize(s->stream);
		cb->drv.cuStreamDestroy(s->stream);
	}
	if (s->ev)
		cb->drv.cuEventDestroy(s->ev);
	for (int k = 0; k < CU_SIDE_EVENTS; k++)
		if (s->marks[k])
			cb->drv.cuEventDestroy(s->marks[k]);
	free(s);
}

/* Event k (mod CU_SIDE_EVENTS) recorded on the side stream after the work
 * enqueued on it so far: gpu_cuda_side_event_query(k) tells when that is
 * done. */
void gpu_cuda_side_record(struct cu_side *s, int k)
{
	side_check(s, s->cb->drv.cuEventRecord(s->marks[k % CU_SIDE_EVENTS], s->stream),
		   "cuEventRecord");
}

/* 1: event k's work is done (or it was never recorded); 0: not yet; -1:
 * the side stream failed (gpu_cuda_side_error). Never blocks. */
int gpu_cuda_side_event_query(struct cu_side *s, int k)
{
	if (s->first_error != CUDA_SUCCESS)
		return -1;
	CUresult r = s->event_query(s->marks[k % CU_SIDE_EVENTS]);
	if (r == CUDA_SUCCESS)
		return 1;
	if (r == CUDA_ERROR_NOT_READY)
		return 0;
	side_check(s, r, "cuEventQuery");
	return -1;
}

/* The backend's stream waits, on the device, for event k's work (its
 * latest record): what follows it there runs after that work; the host
 * goes on. An error shows at the next query (gpu_cuda_side_query). */
void gpu_cuda_side_join(struct cu_side *s, int k)
{
	side_check(s, s->wait_event(s->cb->stream, s->marks[k % CU_SIDE_EVENTS], 0),
		   "cuStreamWaitEvent (the stream after a collective)");
}
