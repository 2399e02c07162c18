/* fakecuda: a CPU stand-in for the CUDA driver (libcuda.so.1), for tests on machines without a GPU.
 *
 * The plugin opens the driver with dlopen and honours MPLANE_CUDA_LIB=<path>; pointing it at
 * libfakecuda.so runs the plugin's real GPU code (GPU windows, the signal lane, the relay engine)
 * against this library. Only the entry points the plugin (net/relay.c) and the RMA harness load
 * are here, with the driver's C signatures and numeric values (cuda.h), so nothing else changes.
 *
 * Model. "Device memory" is ordinary memory of this process, mapped by cuMemAlloc in regions the
 * library tracks, so pointer attributes answer DEVICE for them and an error for anything else.
 * Each stream is a worker thread that runs its operations in submission order; each operation
 * runs no earlier than MPLANE_FAKE_CUDA_DELAY_US after it was submitted, so an asynchronous copy
 * lands after its call returned, and code that reads or signals before synchronising shows it.
 * A copy lands in 4 KiB pieces from its last to its first, so a reader peeking at the end of a
 * copy in flight may see it before the start (the order of a copy engine's writes is not promised).
 * The synchronous copies (cuMemcpyHtoD/DtoH) copy at once, after draining the blocking streams
 * (those created without CU_STREAM_NON_BLOCKING, and the legacy stream), as the legacy stream does.
 *
 * Environment:
 *   MPLANE_FAKE_CUDA_DEVICES=N    devices (default 1, at most FAKE_CUDA_MAX_DEVICES); read by cuInit
 *   MPLANE_FAKE_CUDA_DELAY_US=U   each stream operation's delay (default 20; 0: none); read when a
 *                                 stream is created, so a test may change it between streams
 *   MPLANE_FAKE_CUDA_FAIL=copy:N  the N-th asynchronous copy of the process (1-based) fails at
 *                                 submission with CUDA_ERROR_UNKNOWN; read by cuInit
 *   MPLANE_FAKE_CUDA_LANE=nostart the lane kernel never starts (an application holds every SM)
 *   MPLANE_FAKE_CUDA_LANE=stall:N the lane kernels stop for good after N ops of the process, the
 *                                 next one claimed and never run (stopped mid-burst); read by cuInit
 *
 * Kernels: the plugin's lane kernel only (cuLaunchKernel), its loop written again in C.
 * Not modelled: other kernels, graphs, memory pools, IPC, dma-bufs (cuMemGetHandleForAddressRange says
 * CUDA_ERROR_NOT_SUPPORTED), streams surviving a fork (load the library after forking).
 */
#ifndef MPLANE_FAKE_CUDA_H
#define MPLANE_FAKE_CUDA_H

#include <stddef.h>
#include <stdint.h>

/* The driver's types, as cuda.h declares them for C. */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

/* Values from cuda.h (CUresult, CUpointer_attribute, CUmemorytype, CUstreamBatchMemOpType). */
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_INVALID_HANDLE 400
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_UNKNOWN 999

#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2

#define CU_STREAM_DEFAULT 0x0
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2

#define CU_STREAM_MEM_OP_WRITE_VALUE_32 2
#define CU_STREAM_MEM_OP_WRITE_VALUE_64 5
#define CU_STREAM_MEM_OP_WAIT_VALUE_64 4 /* flags 0 (GEQ): wait until the word >= value */
#define CUDA_ERROR_INVALID_PTX 218
#define CUDA_ERROR_NOT_FOUND 500
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;

/* CUstreamBatchMemOpParams's write member; the union is 48 bytes (cuuint64_t pad[6]). */
typedef union {
  int operation;
  struct {
    int operation;
    CUdeviceptr address;
    union {
      uint32_t value;
      uint64_t value64;
    };
    unsigned int flags;
    CUdeviceptr alias;
  } writeValue;
  uint64_t pad[6];
} CUstreamBatchMemOpParams;

#define FAKE_CUDA_MAX_DEVICES 16

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGetCount(int *count);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int flags);
CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev);
CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev);
CUresult cuGetErrorString(CUresult error, const char **pStr);

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags);
CUresult cuMemFreeHost(void *p);
CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N);
CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr);
CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr, size_t size, int handleType,
                                       unsigned long long flags);

CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount);
CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream);
CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice, CUcontext srcContext,
                           size_t ByteCount, CUstream hStream);
CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, uint64_t value, unsigned int flags);
CUresult cuStreamBatchMemOp_v2(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                               unsigned int flags);

/* Kernels: only the plugin's lane kernel (common/cuda_lane_ring.h), run by a C stand-in on the
 * stream's thread until it exits, as a kernel holds its stream. */
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name);
CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, unsigned gridDimY, unsigned gridDimZ, unsigned blockDimX,
                        unsigned blockDimY, unsigned blockDimZ, unsigned sharedMemBytes, CUstream hStream,
                        void **kernelParams, void **extra);

int fake_cuda_kernel_launches(void); /* kernels launched in this process (tests) */
void fake_cuda_hold_sms(int held);   /* 1: an application kernel holds every SM, no lane kernel starts */

/* Page-locking the caller's memory: arguments checked, nothing locked; the live count for tests. */
CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags);
CUresult cuMemHostUnregister(void *p);
int fake_cuda_host_registered(void);

CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags);
CUresult cuStreamDestroy_v2(CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);
CUresult cuStreamQuery(CUstream hStream);
CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags);
CUresult cuEventDestroy_v2(CUevent hEvent);
CUresult cuEventRecord(CUevent hEvent, CUstream hStream);
CUresult cuEventQuery(CUevent hEvent);

#endif
