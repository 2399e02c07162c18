/* mplane: the CUDA driver shim (see cuda.h): the driver opened with dlopen, primary contexts,
 * allocation and plain copies. The lane (ordered copies and signal writes) is cuda_lane.c. */
#include "cuda.h"
#include "cuda_driver.h"
#include "test_hooks.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct mplane_cu_driver mplane_cu;


static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

const char *mplane_cu_err(CUresult r) {
  const char *s = NULL;
  if (mplane_cu.cuGetErrorString && mplane_cu.cuGetErrorString(r, &s) == CUDA_SUCCESS && s) return s;
  return "unknown CUDA error";
}

#define CU_LOAD(field, sym)                                            \
  do {                                                                 \
    *(void **)&mplane_cu.field = dlsym(mplane_cu.lib, sym);                          \
    if (!mplane_cu.field) {                                                   \
      snprintf(mplane_cu.why, sizeof(mplane_cu.why), "%s lacks %s", libname, sym);   \
      goto fail;                                                       \
    }                                                                  \
  } while (0)

static void cu_load_once(void) {
  const char *libname = mplane_test_cuda_lib(); /* MPLANE_CUDA_LIB: a test hook, read in the test build only */
  if (!libname) libname = "libcuda.so.1";
  mplane_cu.lib = dlopen(libname, RTLD_NOW | RTLD_LOCAL);
  if (!mplane_cu.lib) {
    snprintf(mplane_cu.why, sizeof(mplane_cu.why), "no CUDA driver (%s): %s", libname, dlerror());
    return;
  }
  CU_LOAD(cuInit, "cuInit");
  CU_LOAD(cuDeviceGetCount, "cuDeviceGetCount");
  CU_LOAD(cuDeviceGet, "cuDeviceGet");
  CU_LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  CU_LOAD(cuCtxSetCurrent, "cuCtxSetCurrent");
  CU_LOAD(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess");
  CU_LOAD(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
  CU_LOAD(cuMemAlloc, "cuMemAlloc_v2");
  CU_LOAD(cuMemFree, "cuMemFree_v2");
  CU_LOAD(cuStreamCreate, "cuStreamCreate");
  CU_LOAD(cuStreamDestroy, "cuStreamDestroy_v2");
  CU_LOAD(cuStreamSynchronize, "cuStreamSynchronize");
  CU_LOAD(cuEventCreate, "cuEventCreate");
  CU_LOAD(cuEventDestroy, "cuEventDestroy_v2");
  CU_LOAD(cuEventRecord, "cuEventRecord");
  CU_LOAD(cuEventQuery, "cuEventQuery");
  CU_LOAD(cuStreamQuery, "cuStreamQuery");
  CU_LOAD(cuMemcpyPeerAsync, "cuMemcpyPeerAsync");
  CU_LOAD(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  CU_LOAD(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  CU_LOAD(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  CU_LOAD(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  CU_LOAD(cuMemsetD8, "cuMemsetD8_v2");
  CU_LOAD(cuPointerGetAttribute, "cuPointerGetAttribute");
  CU_LOAD(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
  CU_LOAD(cuGetErrorString, "cuGetErrorString");
  *(void **)&mplane_cu.cuMemHostAlloc = dlsym(mplane_cu.lib, "cuMemHostAlloc");
  *(void **)&mplane_cu.cuMemFreeHost = dlsym(mplane_cu.lib, "cuMemFreeHost");
  *(void **)&mplane_cu.cuStreamWriteValue64 = dlsym(mplane_cu.lib, "cuStreamWriteValue64_v2");
  *(void **)&mplane_cu.cuStreamBatchMemOp = dlsym(mplane_cu.lib, "cuStreamBatchMemOp_v2");
  *(void **)&mplane_cu.cuMemGetHandleForAddressRange = dlsym(mplane_cu.lib, "cuMemGetHandleForAddressRange");
  *(void **)&mplane_cu.cuMemHostRegister = dlsym(mplane_cu.lib, "cuMemHostRegister_v2");
  *(void **)&mplane_cu.cuMemHostUnregister = dlsym(mplane_cu.lib, "cuMemHostUnregister");
  *(void **)&mplane_cu.cuModuleLoadData = dlsym(mplane_cu.lib, "cuModuleLoadData");
  *(void **)&mplane_cu.cuModuleGetFunction = dlsym(mplane_cu.lib, "cuModuleGetFunction");
  *(void **)&mplane_cu.cuLaunchKernel = dlsym(mplane_cu.lib, "cuLaunchKernel");
  CUresult r = mplane_cu.cuInit(0);
  if (r != CUDA_SUCCESS) {
    snprintf(mplane_cu.why, sizeof(mplane_cu.why), "cuInit failed: %s (%d)", mplane_cu_err(r), r);
    goto fail;
  }
  int n = 0;
  r = mplane_cu.cuDeviceGetCount(&n);
  if (r != CUDA_SUCCESS || n <= 0) {
    snprintf(mplane_cu.why, sizeof(mplane_cu.why), "no GPU (cuDeviceGetCount: %d devices, result %d)", n, r);
    goto fail;
  }
  mplane_cu.ngpu = n > 64 ? 64 : n;
  return;
fail:
  if (mplane_cu.lib) dlclose(mplane_cu.lib);
  mplane_cu.lib = NULL;
  mplane_cu.ngpu = 0;
}

int mplane_cuda_load(char *why, size_t whylen) {
  pthread_once(&cu_once, cu_load_once);
  if (mplane_cu.ngpu == 0 && why) snprintf(why, whylen, "%s", mplane_cu.why);
  return mplane_cu.ngpu;
}

/* Make gpu's primary context current on this thread. */
int mplane_cu_use(int gpu) {
  if (mplane_cuda_load(NULL, 0) <= gpu || gpu < 0) return -1;
  if (!mplane_cu.ctx[gpu]) {
    CUdevice d;
    CUcontext c;
    if (mplane_cu.cuDeviceGet(&d, gpu) != CUDA_SUCCESS || mplane_cu.cuDevicePrimaryCtxRetain(&c, d) != CUDA_SUCCESS) return -1;
    /* Two threads may race here: both retain, one pointer wins; primary contexts are shared. */
    __atomic_store_n(&mplane_cu.ctx[gpu], c, __ATOMIC_RELEASE);
  }
  return mplane_cu.cuCtxSetCurrent(mplane_cu.ctx[gpu]) == CUDA_SUCCESS ? 0 : -1;
}

int mplane_cuda_pointer_device(const void *ptr) {
  if (mplane_cuda_load(NULL, 0) <= 0 || !ptr) return -1;
  unsigned int type = 0;
  if (mplane_cu.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS ||
      type != CU_MEMORYTYPE_DEVICE)
    return -1;
  int ord = -1;
  if (mplane_cu.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS)
    return -1;
  return ord;
}

void *mplane_cuda_alloc(int gpu, size_t bytes) {
  CUdeviceptr p = 0;
  if (mplane_cu_use(gpu) != 0 || mplane_cu.cuMemAlloc(&p, bytes) != CUDA_SUCCESS) return NULL;
  return (void *)(uintptr_t)p;
}

void mplane_cuda_free(int gpu, void *ptr) {
  if (ptr && mplane_cu_use(gpu) == 0) mplane_cu.cuMemFree((CUdeviceptr)(uintptr_t)ptr);
}

int mplane_cuda_memcpy_htod(int gpu, void *dst, const void *src, size_t bytes) {
  return mplane_cu_use(gpu) == 0 && mplane_cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes) == CUDA_SUCCESS ? 0 : -1;
}

int mplane_cuda_memcpy_dtoh(int gpu, void *dst, const void *src, size_t bytes) {
  return mplane_cu_use(gpu) == 0 && mplane_cu.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes) == CUDA_SUCCESS ? 0 : -1;
}

int mplane_cuda_dmabuf_fd(int gpu, void *ptr, size_t bytes) {
  int fd = -1;
  if (!mplane_cu.cuMemGetHandleForAddressRange || mplane_cu_use(gpu) != 0) return -1;
  if (mplane_cu.cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)(uintptr_t)ptr, bytes, 1 /* DMA_BUF_FD */, 0) !=
      CUDA_SUCCESS)
    return -1;
  return fd;
}

void *mplane_cuda_host_alloc(int gpu, size_t bytes) {
  void *p = NULL;
  if (mplane_cu_use(gpu) != 0 || !mplane_cu.cuMemHostAlloc || !mplane_cu.cuMemFreeHost ||
      mplane_cu.cuMemHostAlloc(&p, bytes, 0x03 /* PORTABLE | DEVICEMAP: the lane kernel reads and writes it */) != CUDA_SUCCESS)
    return NULL;
  return p;
}

void mplane_cuda_host_free(void *ptr) {
  if (ptr && mplane_cu.cuMemFreeHost) mplane_cu.cuMemFreeHost(ptr);
}

int mplane_cuda_host_register(int gpu, void *ptr, size_t bytes) {
  if (mplane_cu_use(gpu) != 0 || !mplane_cu.cuMemHostRegister || !mplane_cu.cuMemHostUnregister) return -1;
  return mplane_cu.cuMemHostRegister(ptr, bytes, 0x01 /* PORTABLE: every context's copies use it */) == CUDA_SUCCESS
             ? 0
             : -1;
}

void mplane_cuda_host_unregister(void *ptr) {
  if (ptr && mplane_cu.cuMemHostUnregister) mplane_cu.cuMemHostUnregister(ptr);
}

int mplane_cuda_memset(int gpu, void *dst, int value, size_t bytes) {
  return mplane_cu_use(gpu) == 0 && mplane_cu.cuMemsetD8((CUdeviceptr)(uintptr_t)dst, (unsigned char)value, bytes) == CUDA_SUCCESS
             ? 0
             : -1;
}

int mplane_cuda_pci_bus_id(int gpu, char *buf, int len) {
  CUdevice d;
  if (mplane_cuda_load(NULL, 0) <= gpu || gpu < 0 || mplane_cu.cuDeviceGet(&d, gpu) != CUDA_SUCCESS) return -1;
  return mplane_cu.cuDeviceGetPCIBusId(buf, len, d) == CUDA_SUCCESS ? 0 : -1;
}
