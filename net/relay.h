/* mplane: plane-aware connect and the cross-plane relay.
 *
 * Planes share no switch, so a connection from a local NIC on plane a to a peer listening on plane
 * b != a can only be carried by this node's NIC on plane b (the relay NIC). Host buffers go
 * straight out of it. GPU buffers are first moved by a CUDA copy engine (no SMs: copies only,
 * never a kernel) into a staging buffer on the GPU beside the relay NIC and sent from there: the
 * relay copy engine below. CUDA is opened with dlopen at run time; the plugin never links it.
 * MPLANE_RELAY=auto|nvlink|pcie|host|off chooses how (off: a cross-plane connect fails). */
#ifndef MPLANE_NET_RELAY_H
#define MPLANE_NET_RELAY_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "../common/nccl/err.h"
#include "transport.h"

/* ---------------------------------------------------------------- planes of devices */

/* Plane of an IPv4 address in the emulated fabric's range: 198.18.p.x -> p (198.18.0.0/16, p < 128).
 * -1 for any other address. */
int mplane_plane_from_fabric_ip(const struct sockaddr *addr);

/* Planes of n interfaces from their IP subnets (different planes are different subnets): the
 * fabric range gives its third octet; otherwise, when the interfaces are in at least two subnets,
 * each interface's plane is the rank of its subnet among the distinct subnets, sorted by address.
 * Writes -1 where the subnets say nothing (one subnet for all, unknown family). */
void mplane_planes_from_subnets(int n, const struct sockaddr *const *addrs, const struct sockaddr *const *masks,
                                int *planes);

/* Apply MPLANE_PLANES ("name=plane,...", parsed by mplane_planes_parse, the grammar's one parser;
 * names as the transport reports them, "mlx5_0" also matching "mlx5_0:1") to props. Devices it
 * does not name keep their plane, and names no device has are left to topo/ to refuse. 0 on
 * success, else -1 with the reason in why (props unchanged). */
int mplane_planes_apply(const char *spec, struct mplane_dev_props *props, int ndev, char *why, size_t whylen);

/* ---------------------------------------------------------------- the relay decision */

struct mplane_relay_choice {
  int dev;          /* device that carries the connection */
  int relayed;      /* 1 when dev differs from the one NCCL asked for because of planes */
  int local_plane;  /* plane of the device NCCL asked for */
  int peer_plane;   /* plane of the peer's listen handle */
};

/* Pick the device for a connect from dev to a peer on peer_plane. Same plane (or a plane unknown on
 * either side): dev itself. Cross-plane: the first local device on peer_plane (relay_mode != off);
 * with MPLANE_RELAY=off, or with no local device on that plane, ncclInvalidUsage and a WARN that
 * names both planes and how to enable relaying. */
ncclResult_t mplane_relay_pick(const struct mplane_dev_props *props, int ndev, int dev, int peer_plane,
                               int relay_mode, struct mplane_relay_choice *out);

/* ---------------------------------------------------------------- the CUDA relay copy engine */

/* Load the CUDA driver (libcuda.so.1, or MPLANE_CUDA_LIB for tests) and initialise it. Returns the
 * number of GPUs, 0 when there is no driver or no GPU (reason in why), never fails otherwise. */
int mplane_cuda_load(char *why, size_t whylen);

/* The CUDA device ordinal of a device pointer, -1 if ptr is host memory or CUDA is absent. */
int mplane_cuda_pointer_device(const void *ptr);

struct mplane_relay_engine;

#define MPLANE_RELAY_CHUNK_DEFAULT (8u << 20) /* 8 MiB: ~20 us of NVLink per chunk, far above launch cost */

/* A copy engine moving data from GPU src_gpu into a staging buffer of staging_bytes on GPU
 * staging_gpu, in chunks of chunk_bytes (0: MPLANE_RELAY_CHUNK_DEFAULT), on a stream of its own (non-blocking, so
 * NCCL's streams never wait on it). Peer access is enabled both ways where the GPUs allow it. */
ncclResult_t mplane_relay_engine_create(int src_gpu, int staging_gpu, size_t staging_bytes, size_t chunk_bytes,
                                        struct mplane_relay_engine **out);
/* Device address of the staging buffer. */
void *mplane_relay_engine_staging(struct mplane_relay_engine *e);
size_t mplane_relay_engine_staging_bytes(struct mplane_relay_engine *e);
/* Start copying bytes from src (on src_gpu) to staging + offset: one cuMemcpyPeerAsync and one event
 * per chunk, all queued at once so the copy engine streams them back to back. Returns a ticket. */
ncclResult_t mplane_relay_copy_start(struct mplane_relay_engine *e, size_t offset, const void *src, size_t bytes,
                                     uint64_t *ticket);
/* Same, for any direction: dst and src are device pointers on any GPUs (contexts found from them). */
ncclResult_t mplane_relay_copy_start_ptr(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes,
                                         uint64_t *ticket);
/* Poll: *ready = bytes of that copy already landed (chunk granularity, in order), *done when all.
 * Never blocks. */
ncclResult_t mplane_relay_copy_poll(struct mplane_relay_engine *e, uint64_t ticket, size_t *ready, int *done);
/* Block until everything queued on the engine has landed (tests and benchmarks only). */
ncclResult_t mplane_relay_engine_sync(struct mplane_relay_engine *e);
/* One plain cuMemcpyPeerAsync of the whole range on the engine's stream, no chunking: the baseline
 * the relay copy is compared with. */
ncclResult_t mplane_relay_plain_copy(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes);
void mplane_relay_engine_destroy(struct mplane_relay_engine *e);

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
int mplane_cuda_memset(int gpu, void *dst, int value, size_t bytes);
/* Pinned (page-locked) host memory, usable by every context: copies to and from it are real DMA,
 * not staged by the driver through a buffer of its own. NULL where the driver cannot give it. */
void *mplane_cuda_host_alloc(int gpu, size_t bytes);
void mplane_cuda_host_free(void *ptr);
/* A dma-buf fd for [ptr, ptr + bytes) of GPU memory (cuMemGetHandleForAddressRange), or -1. */
int mplane_cuda_dmabuf_fd(int gpu, void *ptr, size_t bytes);
/* The PCI bus id of a GPU ("0000:19:00.0"), for choosing the GPU beside a NIC. 0 on success. */
int mplane_cuda_pci_bus_id(int gpu, char *buf, int len);

/* ---------------------------------------------------------------- the copier (relay_copier.c)
 * What a transport's staging ring calls on a relayed connection: one asynchronous interface over
 * the CUDA relay copy engine above or, with MPLANE_TEST_RELAY_COPIER=cpu (tests only), a CPU
 * stand-in that memcpys on a worker thread, so the staging state machines run without a GPU. */
struct mplane_relay_copier;

/* MPLANE_TEST_RELAY_HOST (tests only): 0 unset; 1 host buffers on a relayed connection are staged as
 * GPU buffers are; 2 ("all") the same, and every connection counts as relayed. */
int mplane_relay_test_host(void);
/* MPLANE_TEST_RELAY_SLOT_BYTES (tests only; 4 KiB..1 GiB, whole pages), else dflt. */
size_t mplane_relay_test_slot_bytes(size_t dflt);
/* 1 when MPLANE_TEST_RELAY_FAIL=reg: registering the staging ring is made to fail (tests only). */
int mplane_relay_test_fail_reg(void);

/* A copier for buffers like src (CUDA: its GPU is the source). Staging lives on the GPU whose PCI bus
 * id is staging_busid (the GPU beside the relay NIC); on src's own GPU, with an INFO line, where
 * that is "" or no visible GPU has it. */
ncclResult_t mplane_relay_copier_create(const void *src, const char *staging_busid,
                                        struct mplane_relay_copier **out);
/* The CUDA ordinal of the GPU with PCI bus id busid (any case, "0000:19:00.0"), -1 none. */
int mplane_cuda_gpu_of_busid(const char *busid);
/* Staging memory the copier writes into (GPU memory, or page-aligned host memory for the stand-in). */
void *mplane_relay_copier_alloc(struct mplane_relay_copier *c, size_t bytes);
/* A dma-buf of that staging memory for a NIC to register (ibv_reg_dmabuf_mr), the caller's to close;
 * -1 where there is none (a GPU or driver without dma-buf). The stand-in's memory is a memfd, so the
 * verbs double can take the same path. */
int mplane_relay_copier_dmabuf_fd(struct mplane_relay_copier *c, void *mem, size_t bytes);
/* Queue a copy; *ticket 0 means no room now (call again later), never an error. */
ncclResult_t mplane_relay_copier_start(struct mplane_relay_copier *c, void *dst, const void *src, size_t bytes,
                                       uint64_t *ticket);
/* *done when that copy has landed; an error when it failed. Never blocks. */
ncclResult_t mplane_relay_copier_poll(struct mplane_relay_copier *c, uint64_t ticket, int *done);
/* Waits for a copy under way (bounded: one chunk), then frees staging (from _alloc, may be NULL) and c. */
void mplane_relay_copier_destroy(struct mplane_relay_copier *c, void *staging);

#endif
