/* CPU emulator of the CUDA runtime for libmplane-ep's tests (tests/ep/emu): just the calls the
 * library and its test use. Device memory is host memory (poisoned on allocation) in mappings of
 * its own that host code cannot read or write (only emulated kernels, copies and NCCL transfers
 * can, as on a GPU: see emu_runtime.cpp); copies check their kind against the pointers; streams and
 * copies are synchronous; kernels run on OS threads (emu_device.h). Not NVIDIA's header. */
#ifndef EMU_CUDA_RUNTIME_API_H
#define EMU_CUDA_RUNTIME_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorStreamCaptureUnsupported = 900
} cudaError_t;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2
} cudaStreamCaptureMode;
#define cudaStreamNonBlocking 0x01
typedef enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
} cudaMemcpyKind;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, cudaMemcpyKind k);
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, cudaMemcpyKind k, cudaStream_t st);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t st);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int dev);
const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);

cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);
/* Capture runs the work at once; the "graph" replays nothing. Calls CUDA forbids during capture
 * (synchronising, synchronous copies, allocation) fail here too, so a host wait hidden in a
 * worst-case-mode call is caught. */
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *e, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t e, cudaStream_t s);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t e);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaDeviceCanAccessPeer(int *can, int dev, int peer);
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags);
cudaError_t cudaMemcpyPeerAsync(void *d, int dd, const void *s, int sd, size_t n, cudaStream_t st);
/* CUDA IPC: the emulated ranks are threads of one process sharing its device mappings, so a
 * handle carries the allocation's address and opening it returns that address (the allocation
 * must be a live cudaMalloc; an open handle must be closed) */
typedef struct cudaIpcMemHandle_st {
  char reserved[64];
} cudaIpcMemHandle_t;
#define cudaIpcMemLazyEnablePeerAccess 0x01
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *h, void *p);
cudaError_t cudaIpcOpenMemHandle(void **p, cudaIpcMemHandle_t h, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void *p);

/* emulator only: device allocations still outstanding */
long emu_cuda_live_allocations(void);
/* emulator only: 1 if p lies in a cudaMalloc allocation */
int emu_cuda_is_device_pointer(const void *p);
/* emulator only: how host code is kept out of device memory: 2 protection keys (per thread),
 * 1 PROT_NONE while no thread is inside the device, 0 not at all (EMU_DEVMEM_OPEN=1) */
int emu_cuda_devmem_mode(void);

#ifdef __cplusplus
}
#endif

#endif
