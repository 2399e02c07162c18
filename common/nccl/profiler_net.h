/* mplane: the events a net plugin reports to NCCL's profiler, written by us from the documented ABI
 * of NCCL's ext-profiler (net v10 and later pass the callback to init).
 *
 * A plugin calls the callback with type ncclProfilerNetEventStart, the pHandle NCCL passed with the
 * request (isend's phandle, irecv's phandles[i]), a plugin id and a descriptor; NCCL copies the
 * descriptor into its own event and hands back an event handle, which the plugin later passes to a
 * call of type ncclProfilerNetEventStop. The plugin id says which descriptor layout follows: the
 * network type in the high 16 bits, the descriptor's version in the low 16. We report NCCL's own
 * types (IB per QP work request, socket per stream transfer), so profiler plugins written for
 * net_ib and net_socket decode our events unchanged. Field order and types are ABI facts. */
#ifndef MPLANE_NCCL_PROFILER_NET_H
#define MPLANE_NCCL_PROFILER_NET_H

#include <stddef.h>
#include <stdint.h>

/* The callback's type argument. */
enum {
  ncclProfilerNetEventStart = 0,
  ncclProfilerNetEventStop = 1,
  ncclProfilerNetEventUpdate = 2,
  ncclProfilerNetEventUpdateAndStop = 3,
};

#define NCCL_PROFILER_NET_VER_BITS 16
#define NCCL_PROFILER_NET_VER_MASK (~0U >> NCCL_PROFILER_NET_VER_BITS)
#define NCCL_PROFILER_NET_TYPE_MASK (~0U << NCCL_PROFILER_NET_VER_BITS)
#define NCCL_PROFILER_NET_TYPE_IB (1U << NCCL_PROFILER_NET_VER_BITS)
#define NCCL_PROFILER_NET_TYPE_SOCK (2U << NCCL_PROFILER_NET_VER_BITS)

/* IB, descriptor version 1: one event per QP work request. */
#define NCCL_PROFILER_NET_IB_VER 1
enum { ncclProfileQp = (1 << 0) };

typedef struct {
  uint8_t type; /* ncclProfileQp */
  union {
    struct {
      int device;     /* the plugin's device index */
      uint64_t wr_id; /* the work request's id */
      int opcode;     /* enum ibv_wr_opcode */
      int qpNum;
      size_t length;  /* bytes the work request carries */
    } qp;
  };
} ncclProfilerNetIbDescr_v1_t;

/* Socket, descriptor version 1: one event per transfer on one socket. */
#define NCCL_PROFILER_NET_SOCKET_VER 1
enum { ncclProfileSocket = (1 << 0) };
#define NCCL_PROFILER_SOCKET_SEND 0 /* sock.op */
#define NCCL_PROFILER_SOCKET_RECV 1

typedef struct {
  uint8_t type; /* ncclProfileSocket */
  union {
    struct {
      int fd;
      int op;        /* NCCL_PROFILER_SOCKET_SEND / _RECV */
      size_t length; /* bytes of the transfer */
    } sock;
  };
} ncclProfilerNetSockDescr_v1_t;

#endif
