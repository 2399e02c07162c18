/* mplane: the cross-plane relay: which NIC carries a connection, and the copies that feed it.
 *
 * Planes share no switch, so a connection from a local NIC on plane a to a peer listening on plane
 * b != a can only be carried by this node's NIC on plane b (the relay NIC). Host buffers go
 * straight out of it. GPU buffers are first moved by a CUDA copy engine (no SMs: copies only,
 * never a kernel) into a staging buffer on the GPU beside the relay NIC and sent from there: the
 * relay copy engine below. CUDA is opened with dlopen at run time; the plugin never links it.
 * MPLANE_RELAY=auto|nvlink|pcie|host|off chooses how (off: a cross-plane connect fails). Which plane
 * a NIC is on is topo/'s to say (topo/planes.h); this file only reads it. */
#ifndef MPLANE_NET_RELAY_H
#define MPLANE_NET_RELAY_H

#include <stddef.h>
#include <stdint.h>

#include "../common/nccl/err.h"
#include "transport.h"

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

/* ---------------------------------------------------------------- the copier (relay_copier.c)
 * What a transport's staging ring calls on a relayed connection: one asynchronous interface over
 * the CUDA relay copy engine above or, with MPLANE_TEST_RELAY_COPIER=cpu (a test hook,
 * common/test_hooks.h), a CPU stand-in that memcpys on a worker thread, so the staging state machines run without a GPU. */
struct mplane_relay_copier;

/* The relay's test hooks (common/test_hooks.h; "unset" in what ships).
 * MPLANE_TEST_RELAY_HOST: 0 unset; 1 host buffers on a relayed connection are staged as
 * GPU buffers are; 2 ("all") the same, and every connection counts as relayed. */
int mplane_relay_test_host(void);
/* MPLANE_TEST_RELAY_SLOT_BYTES (4 KiB..1 GiB, whole pages), else dflt. */
size_t mplane_relay_test_slot_bytes(size_t dflt);
/* 1 when MPLANE_TEST_RELAY_FAIL=reg: registering the staging ring is made to fail. */
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
