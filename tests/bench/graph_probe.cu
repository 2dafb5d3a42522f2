// What CUDA graphs save (issue 13; DESIGN.md, "A decoder layer's stages run
// as CUDA graphs"): 960 kernels, each over the whole GPU for a few to tens of
// microseconds, launched one after another on a stream, against the same
// kernels recorded by stream capture in segments of 12, 24 and 48 — each
// segment recorded anew and its exec updated (cuGraphExecUpdate) before it
// is launched, as train/model.c's STAGED does every call — and against the
// execs launched again without recording. Prints a line per (kernel length,
// segment): the device time a kernel and the host time of the enqueueing.
// Built by meson where nvcc is; tests/gpu/device-run.sh graphs compiles and
// runs it on the device.
#include <chrono>

#include "cublas_check.h"

// iters dependent multiply-adds a thread: the kernel's length
__global__ void spin(float *x, int n, int iters)
{
	int i = blockIdx.x * blockDim.x + threadIdx.x;
	if (i >= n)
		return;
	float v = x[i];
	for (int k = 0; k < iters; k++)
		v = v * 0.999f + 0.001f;
	x[i] = v;
}

static double now_us()
{
	return std::chrono::duration<double, std::micro>(
		       std::chrono::steady_clock::now().time_since_epoch())
		.count();
}

int main()
{
	enum { TOTAL = 960, MAXSEG = TOTAL / 12 };
	int sms = 0;
	CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
	const int n = sms * 4 * 256 * 8, blocks = (n + 255) / 256;
	float *x;
	CK(cudaMalloc(&x, n * sizeof(float)));
	CK(cudaMemset(x, 0, n * sizeof(float)));
	cudaStream_t s;
	CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	cudaEvent_t a, b;
	CK(cudaEventCreate(&a));
	CK(cudaEventCreate(&b));
	for (int iters : {50, 200, 800}) {
		// warm, then the stream alone
		for (int k = 0; k < TOTAL; k++)
			spin<<<blocks, 256, 0, s>>>(x, n, iters);
		CK(cudaStreamSynchronize(s));
		double h0 = now_us();
		CK(cudaEventRecord(a, s));
		for (int k = 0; k < TOTAL; k++)
			spin<<<blocks, 256, 0, s>>>(x, n, iters);
		CK(cudaEventRecord(b, s));
		const double host_stream = now_us() - h0;
		CK(cudaEventSynchronize(b));
		float ms_stream;
		CK(cudaEventElapsedTime(&ms_stream, a, b));
		for (int seg : {12, 24, 48}) {
			cudaGraphExec_t ex[MAXSEG] = {};
			float ms_rec = 0;
			double host_rec = 0;
			for (int rep = 0; rep < 3; rep++) { // the last of three: execs made
				h0 = now_us();
				CK(cudaEventRecord(a, s));
				for (int g = 0; g < TOTAL / seg; g++) {
					cudaGraph_t gr;
					CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
					for (int k = 0; k < seg; k++)
						spin<<<blocks, 256, 0, s>>>(x, n, iters);
					CK(cudaStreamEndCapture(s, &gr));
					cudaGraphExecUpdateResultInfo info;
					if (ex[g] && cudaGraphExecUpdate(ex[g], gr, &info) != cudaSuccess) {
						fprintf(stderr, "graph_probe: cuGraphExecUpdate failed\n");
						return 1;
					}
					if (!ex[g])
						CK(cudaGraphInstantiate(&ex[g], gr, 0));
					CK(cudaGraphDestroy(gr));
					CK(cudaGraphLaunch(ex[g], s));
				}
				CK(cudaEventRecord(b, s));
				host_rec = now_us() - h0;
				CK(cudaEventSynchronize(b));
				CK(cudaEventElapsedTime(&ms_rec, a, b));
			}
			CK(cudaEventRecord(a, s));
			for (int g = 0; g < TOTAL / seg; g++)
				CK(cudaGraphLaunch(ex[g], s));
			CK(cudaEventRecord(b, s));
			CK(cudaEventSynchronize(b));
			float ms_replay;
			CK(cudaEventElapsedTime(&ms_replay, a, b));
			printf("{\"iters\": %d, \"segment\": %d, \"kernels\": %d, \"us_a_kernel_stream\": %.3f, "
			       "\"us_a_kernel_recorded\": %.3f, \"us_a_kernel_replayed\": %.3f, "
			       "\"us_saved_recorded\": %.3f, \"host_us_stream\": %.0f, \"host_us_recorded\": %.0f}\n",
			       iters, seg, TOTAL, 1e3 * ms_stream / TOTAL, 1e3 * ms_rec / TOTAL,
			       1e3 * ms_replay / TOTAL, 1e3 * (ms_stream - ms_rec) / TOTAL, host_stream,
			       host_rec);
			for (int g = 0; g < MAXSEG; g++)
				if (ex[g])
					CK(cudaGraphExecDestroy(ex[g]));
		}
	}
	CK(cudaFree(x));
	return 0;
}
