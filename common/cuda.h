/* mplane: the CUDA driver shim. The plugin links no CUDA: the driver (libcuda.so.1) is opened with
 * dlopen at first use, so one build loads on machines without a GPU; every call here then fails
 * softly (-1, NULL, 0 GPUs) and says why where it is asked. Device pointers are plain pointers
 * (unified addressing). Used by the relay copy engine, the copier, and the socket RMA target. */
#ifndef MPLANE_COMMON_CUDA_H
#define MPLANE_COMMON_CUDA_H

#include <stddef.h>
#include <stdint.h>

/* Load the CUDA driver (libcuda.so.1, or MPLANE_CUDA_LIB for tests) and initialise it. Returns the
 * number of GPUs, 0 when there is no driver or no GPU (reason in why), never fails otherwise. */
int mplane_cuda_load(char *why, size_t whylen);

/* The CUDA device ordinal of a device pointer, -1 if ptr is host memory or CUDA is absent. */
int mplane_cuda_pointer_device(const void *ptr);

/* Allocation and host<->device helpers for the relay test (driver API, primary contexts). */
void *mplane_cuda_alloc(int gpu, size_t bytes);
void mplane_cuda_free(int gpu, void *ptr);
int mplane_cuda_memcpy_htod(int gpu, void *dst, const void *src, size_t bytes);
int mplane_cuda_memcpy_dtoh(int gpu, void *dst, const void *src, size_t bytes);
/* The same on this thread's non-blocking stream, synchronised before returning (the data is in
 * place when it returns 0): for copies made while a kernel may be running. */
int mplane_cuda_memcpy_htod_nb(int gpu, void *dst, const void *src, size_t bytes);
int mplane_cuda_memcpy_dtoh_nb(int gpu, void *dst, const void *src, size_t bytes);
/* Add to a 64-bit word in GPU memory, atomically against every other caller in this process (one
 * stream and lock per GPU): *now is the new value. Copies the caller made before are in place
 * first if they were synchronised. 0 ok, -1 CUDA failed. */
int mplane_cuda_signal_add(int gpu, void *word, uint64_t add, uint64_t *now);
/* The same for a word only this process writes (NCCL's SIGNAL_NEVER_RESET windows): *shadow holds
 * its value, so nothing is read back and nothing waits; the write goes out on the same stream, in
 * order, under the same lock (the shadow is updated under it). */
int mplane_cuda_signal_add_owned(int gpu, void *word, uint64_t *shadow, uint64_t add, uint64_t *now);
/* Owned-signal writes are collected per GPU and given to the driver together (one
 * cuStreamBatchMemOp instead of a call per signal: a GIN barrier's 16 signals in one call); they
 * reach the GPU once this is called. 0 ok, -1 the driver refused. */
int mplane_cuda_signal_flush(void);
/* Asynchronous copies on the same stream, for callers that must not wait (NCCL's GIN progress
 * thread): the copy is queued, then a sequence number is written into pinned host memory behind it
 * (with the pending signal writes, by the next mplane_cuda_signal_flush), so its completion is a
 * plain load (mplane_cuda_lane_done), no driver call. Signal adds made after the call are ordered
 * after the copy on the stream: a signal never reaches the GPU before the data it follows.
 * to_gpu: host -> GPU, else GPU -> host. Returns the copy's sequence number (> 0), 0 on failure or
 * where the driver lacks stream memory operations (mplane_cuda_async_ok says which, in advance). */
int mplane_cuda_async_ok(int gpu);
uint64_t mplane_cuda_copy_async(int gpu, void *dst, const void *src, size_t bytes, int to_gpu);
/* The highest sequence number whose copy (and everything before it on the stream) has completed. */
uint64_t mplane_cuda_lane_done(int gpu);
/* Wait (polling, yielding) until the copy `seq` has completed; -1 after timeout_ms or a CUDA error. */
int mplane_cuda_lane_wait(int gpu, uint64_t seq, int timeout_ms);
/* The newest asynchronous copy given to the GPU's lane so far (0: none): waiting for it waits for
 * every copy issued before, e.g. before a window's memory is given back. */
uint64_t mplane_cuda_lane_issued(int gpu);
/* 1 while the GPU's lane runs its ops through the lane kernel (MPLANE_GIN_LANE=kernel), 0 on stream
 * ops: the default, a kernel that could not be loaded, or after the fallback from one that did not
 * start or stopped making progress (docs/gin.md). */
int mplane_cuda_lane_kernel(int gpu);
int mplane_cuda_memset(int gpu, void *dst, int value, size_t bytes);
/* Pinned (page-locked) host memory, usable by every context: copies to and from it are real DMA,
 * not staged by the driver through a buffer of its own. NULL where the driver cannot give it. */
void *mplane_cuda_host_alloc(int gpu, size_t bytes);
void mplane_cuda_host_free(void *ptr);
/* Page-lock memory the caller allocated (an mmap'ed segment), so copies to and from it are DMA;
 * 0, or -1 where the driver lacks it or refuses (the memory stays usable, copies are staged). */
int mplane_cuda_host_register(int gpu, void *ptr, size_t bytes);
void mplane_cuda_host_unregister(void *ptr);
/* A dma-buf fd for [ptr, ptr + bytes) of GPU memory (cuMemGetHandleForAddressRange), or -1. */
int mplane_cuda_dmabuf_fd(int gpu, void *ptr, size_t bytes);
/* The PCI bus id of a GPU ("0000:19:00.0"), for choosing the GPU beside a NIC. 0 on success. */
int mplane_cuda_pci_bus_id(int gpu, char *buf, int len);

#endif
